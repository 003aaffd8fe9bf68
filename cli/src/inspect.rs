//! `-M metadata`: reads the metadata blocks of a PNG, JPEG or WebP file and prints them the way
//! the reference program does.
//!
//! The report is a tree of entries (PNG chunks, JPEG segments, WebP chunks), each with its
//! decoded fields: text chunks, comments, Exif (TIFF IFDs with their tag names), XMP, ICC
//! profiles and the container's own headers. Keys are kept sorted, which is the order the
//! reference prints them in (its JSON objects are sorted maps), both in the indented text
//! layout and in `--metadata-format json`. Text is kept as the file's bytes: the text layout
//! prints them unchanged, JSON replaces invalid UTF-8 with U+FFFD (the reference aborts there).
//! Every read is bounds-checked; a damaged file gives an error naming what is wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

/// One value of the report.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Null,
    Bool(bool),
    UInt(u64),
    Int(i64),
    /// Raw bytes, usually (not always) UTF-8.
    Str(Vec<u8>),
    Arr(Vec<Node>),
    Obj(Obj),
}

pub type Obj = BTreeMap<&'static str, Node>;

impl From<&str> for Node {
    fn from(s: &str) -> Node {
        Node::Str(s.as_bytes().to_vec())
    }
}

impl From<&[u8]> for Node {
    fn from(s: &[u8]) -> Node {
        Node::Str(s.to_vec())
    }
}

macro_rules! from_unsigned {
    ($($t:ty),*) => {$(impl From<$t> for Node { fn from(v: $t) -> Node { Node::UInt(v as u64) } })*};
}
from_unsigned!(u8, u16, u32, usize);

impl From<i32> for Node {
    fn from(v: i32) -> Node {
        Node::Int(i64::from(v))
    }
}

impl From<bool> for Node {
    fn from(v: bool) -> Node {
        Node::Bool(v)
    }
}

/// Builds an object from `(key, value)` pairs.
fn obj<const N: usize>(pairs: [(&'static str, Node); N]) -> Node {
    Node::Obj(pairs.into_iter().collect())
}

/// How the report is printed and what it holds (the reference's `--metadata-*` options).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// `--metadata-format json`.
    pub json: bool,
    /// `--metadata-raw`: hex previews of payloads that are not decoded.
    pub raw: bool,
    /// `--metadata-brief`: text values cut at 240 bytes in the text layout.
    pub brief: bool,
    /// `--metadata-all`: also the structural entries (IHDR, IDAT, DQT, VP8L ...).
    pub all: bool,
}

// ---- byte readers (callers check the bounds) ----

fn be16(d: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([d[at], d[at + 1]])
}

fn be32(d: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

fn le32(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

fn trim_nuls(mut s: &[u8]) -> &[u8] {
    while let [rest @ .., 0] = s {
        s = rest;
    }
    s
}

/// The first 64 bytes as `xx xx ...`, with ` ...` when there are more.
pub fn hex_preview(d: &[u8]) -> String {
    let mut s = d.iter().take(64).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ");
    if d.len() > 64 {
        s.push_str(" ...");
    }
    s
}

fn find_nul(d: &[u8]) -> Option<usize> {
    d.iter().position(|&b| b == 0)
}

/// Inflates a zlib stream with the reference's output bound (256 bytes or four times the
/// input, doubled up to seven times); the error texts are the reference's.
fn inflate(d: &[u8]) -> Result<Vec<u8>, String> {
    if d.is_empty() {
        return Ok(Vec::new());
    }
    let limit = (d.len().saturating_mul(4)).max(256).saturating_mul(128);
    miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(d, limit).map_err(|e| match e.status {
        miniz_oxide::inflate::TINFLStatus::HasMoreOutput => "zlib decompression exceeded retry budget".to_string(),
        _ => "zlib decompression failed with status -3".to_string(),
    })
}

/// Adds the hex preview of an undecoded payload when `--metadata-raw` asks for it.
fn raw_preview(entry: &mut Obj, d: &[u8], raw: bool) {
    if raw {
        entry.insert("raw_hex_preview", hex_preview(d).as_str().into());
    }
}

// ---- Exif (TIFF) ----

fn exif_type_name(t: u16) -> &'static str {
    match t {
        1 => "BYTE",
        2 => "ASCII",
        3 => "SHORT",
        4 => "LONG",
        5 => "RATIONAL",
        7 => "UNDEFINED",
        9 => "SLONG",
        10 => "SRATIONAL",
        _ => "UNKNOWN",
    }
}

fn exif_type_size(t: u16) -> usize {
    match t {
        1 | 2 | 7 => 1,
        3 => 2,
        4 | 9 => 4,
        5 | 10 => 8,
        _ => 0,
    }
}

fn tag_name(tag: u16, ifd: &str) -> String {
    let name = match (ifd, tag) {
        ("Exif", 0x829A) => "ExposureTime",
        ("Exif", 0x829D) => "FNumber",
        ("Exif", 0x8827) => "ISOSpeedRatings",
        ("Exif", 0x9000) => "ExifVersion",
        ("Exif", 0x9003) => "DateTimeOriginal",
        ("Exif", 0x9004) => "DateTimeDigitized",
        ("Exif", 0x9201) => "ShutterSpeedValue",
        ("Exif", 0x9202) => "ApertureValue",
        ("Exif", 0x9204) => "ExposureBiasValue",
        ("Exif", 0x9209) => "Flash",
        ("Exif", 0x920A) => "FocalLength",
        ("Exif", 0x927C) => "MakerNote",
        ("Exif", 0x9286) => "UserComment",
        ("Exif", 0xA001) => "ColorSpace",
        ("Exif", 0xA002) => "PixelXDimension",
        ("Exif", 0xA003) => "PixelYDimension",
        ("Exif", 0xA005) => "InteroperabilityIFDPointer",
        ("Exif", 0xA402) => "ExposureMode",
        ("Exif", 0xA403) => "WhiteBalance",
        ("Exif", 0xA404) => "DigitalZoomRatio",
        ("Exif", 0xA405) => "FocalLengthIn35mmFilm",
        ("Exif", 0xA430) => "CameraOwnerName",
        ("Exif", 0xA431) => "BodySerialNumber",
        ("Exif", 0xA432) => "LensSpecification",
        ("Exif", 0xA433) => "LensMake",
        ("Exif", 0xA434) => "LensModel",
        ("Exif", 0xA435) => "LensSerialNumber",
        ("GPS", 0x0000) => "GPSVersionID",
        ("GPS", 0x0001) => "GPSLatitudeRef",
        ("GPS", 0x0002) => "GPSLatitude",
        ("GPS", 0x0003) => "GPSLongitudeRef",
        ("GPS", 0x0004) => "GPSLongitude",
        ("GPS", 0x0005) => "GPSAltitudeRef",
        ("GPS", 0x0006) => "GPSAltitude",
        ("GPS", 0x0007) => "GPSTimeStamp",
        ("GPS", 0x000D) => "GPSSpeed",
        ("GPS", 0x0011) => "GPSImgDirection",
        ("GPS", 0x001D) => "GPSDateStamp",
        ("Interop", 0x0001) => "InteroperabilityIndex",
        ("Interop", 0x0002) => "InteroperabilityVersion",
        ("Interop", 0x1000) => "RelatedImageFileFormat",
        ("Interop", 0x1001) => "RelatedImageWidth",
        ("Interop", 0x1002) => "RelatedImageLength",
        ("Exif" | "GPS" | "Interop", _) => "",
        (_, 0x0100) => "ImageWidth",
        (_, 0x0101) => "ImageLength",
        (_, 0x0102) => "BitsPerSample",
        (_, 0x0103) => "Compression",
        (_, 0x0106) => "PhotometricInterpretation",
        (_, 0x010E) => "ImageDescription",
        (_, 0x010F) => "Make",
        (_, 0x0110) => "Model",
        (_, 0x0111) => "StripOffsets",
        (_, 0x0112) => "Orientation",
        (_, 0x0115) => "SamplesPerPixel",
        (_, 0x011A) => "XResolution",
        (_, 0x011B) => "YResolution",
        (_, 0x0128) => "ResolutionUnit",
        (_, 0x0131) => "Software",
        (_, 0x0132) => "DateTime",
        (_, 0x013B) => "Artist",
        (_, 0x8298) => "Copyright",
        (_, 0x8769) => "ExifIFDPointer",
        (_, 0x8825) => "GPSInfoIFDPointer",
        _ => "",
    };
    if name.is_empty() {
        format!("0x{tag:04X}")
    } else {
        name.to_string()
    }
}

/// A TIFF structure (an Exif payload without its `Exif\0\0` prefix).
struct Tiff<'a> {
    d: &'a [u8],
    le: bool,
    raw: bool,
    visited: BTreeSet<u32>,
    /// The last problem met while following IFD pointers (the reference keeps only one).
    warning: Option<&'static str>,
}

impl Tiff<'_> {
    fn u16(&self, at: usize) -> u16 {
        let b = [self.d[at], self.d[at + 1]];
        if self.le {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        }
    }

    fn u32(&self, at: usize) -> u32 {
        let b = [self.d[at], self.d[at + 1], self.d[at + 2], self.d[at + 3]];
        if self.le {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        }
    }

    fn ratio(num: String, den_zero: bool, value: f64) -> Node {
        if den_zero {
            num.as_str().into()
        } else {
            format!("{num} ({value:.6})").as_str().into()
        }
    }

    /// `count` values of `kind` at `at` (in bounds): one value, or an array of them.
    fn value(&self, at: usize, kind: u16, count: u32, size: usize) -> Node {
        let many = |unit: usize, one: &dyn Fn(usize) -> Node| {
            if count == 1 {
                one(at)
            } else {
                Node::Arr((0..count as usize).map(|i| one(at + i * unit)).collect())
            }
        };
        let value = match kind {
            1 => many(1, &|p| self.d[p].into()),
            2 => trim_nuls(&self.d[at..at + count as usize]).into(),
            3 => many(2, &|p| self.u16(p).into()),
            4 => many(4, &|p| self.u32(p).into()),
            5 => many(8, &|p| {
                let (n, d) = (self.u32(p), self.u32(p + 4));
                Self::ratio(format!("{n}/{d}"), d == 0, f64::from(n) / f64::from(d))
            }),
            7 => self.d[at..at + count as usize].into(),
            9 => many(4, &|p| (self.u32(p) as i32).into()),
            10 => many(8, &|p| {
                let (n, d) = (self.u32(p) as i32, self.u32(p + 4) as i32);
                Self::ratio(format!("{n}/{d}"), d == 0, f64::from(n) / f64::from(d))
            }),
            _ => Node::Null,
        };
        if self.raw && size != 0 {
            return obj([("decoded", value), ("raw_hex_preview", hex_preview(&self.d[at..at + size]).as_str().into())]);
        }
        value
    }

    /// The IFD at `offset` with its sub-IFDs (Exif, GPS, Interop) and, for IFD0/IFD1, the next
    /// IFD; `None` for offset 0 and for an IFD that cannot be read (a warning says why).
    fn ifd(&mut self, offset: u32, name: &'static str) -> Option<Node> {
        if offset == 0 {
            return None;
        }
        if !self.visited.insert(offset) {
            self.warning = Some("detected recursive IFD pointer");
            return None;
        }
        let start = offset as usize;
        if start + 2 > self.d.len() {
            self.warning = Some("IFD offset out of range");
            return None;
        }
        let count = self.u16(start) as usize;
        if start + 2 + count * 12 + 4 > self.d.len() {
            self.warning = Some("IFD entries exceed Exif payload size");
            return None;
        }
        let top = matches!(name, "IFD0" | "IFD1");
        let mut tags = Vec::with_capacity(count);
        let mut subs: Vec<(&'static str, u32)> = Vec::new();
        for i in 0..count {
            let e = start + 2 + i * 12;
            let (tag, kind, n, pointer) = (self.u16(e), self.u16(e + 2), self.u32(e + 4), self.u32(e + 8));
            let mut t: Obj = [
                ("id", tag.into()),
                ("name", tag_name(tag, name).as_str().into()),
                ("type", exif_type_name(kind).into()),
                ("count", n.into()),
            ]
            .into_iter()
            .collect();
            let unit = exif_type_size(kind);
            if unit == 0 {
                t.insert("error", "unsupported Exif type".into());
                tags.push(Node::Obj(t));
                continue;
            }
            let size = unit * n as usize;
            let at = if size <= 4 { e + 8 } else { pointer as usize };
            if size > 4 && at.checked_add(size).is_none_or(|end| end > self.d.len()) {
                t.insert("error", "Exif value points outside payload".into());
                tags.push(Node::Obj(t));
                continue;
            }
            t.insert("value", self.value(at, kind, n, size));
            tags.push(Node::Obj(t));
            match (tag, name) {
                (0x8769, _) if top => subs.push(("Exif", pointer)),
                (0x8825, _) if top => subs.push(("GPS", pointer)),
                (0xA005, "Exif") => subs.push(("Interop", pointer)),
                _ => {}
            }
        }
        let next = self.u32(start + 2 + count * 12);
        let mut ifd: Obj = [("name", name.into()), ("tags", Node::Arr(tags))].into_iter().collect();
        let children: Vec<Node> = subs.into_iter().filter_map(|(n, p)| self.ifd(p, n)).collect();
        if !children.is_empty() {
            ifd.insert("children", Node::Arr(children));
        }
        if next != 0 && top {
            if let Some(n) = self.ifd(next, "IFD1") {
                ifd.insert("next_ifd", n);
            }
        }
        Some(Node::Obj(ifd))
    }
}

/// Decodes an Exif payload into `entry` (`data`, or `error` when the header is bad).
fn exif_into(entry: &mut Obj, d: &[u8], raw: bool) {
    if d.len() < 8 {
        entry.insert("error", "Exif payload too small".into());
        return;
    }
    let le = match &d[..2] {
        b"II" => true,
        b"MM" => false,
        _ => {
            entry.insert("error", "invalid TIFF byte order".into());
            return;
        }
    };
    let mut t = Tiff { d, le, raw, visited: BTreeSet::new(), warning: None };
    let magic = t.u16(2);
    if magic != 42 {
        entry.insert("error", format!("unsupported TIFF magic {magic}").as_str().into());
        return;
    }
    let first = t.u32(4);
    let ifd0 = t.ifd(first, "IFD0");
    let mut meta: Obj = [
        ("byte_order", if le { "little_endian" } else { "big_endian" }.into()),
        ("ifds", Node::Arr(ifd0.into_iter().collect())),
    ]
    .into_iter()
    .collect();
    if let Some(w) = t.warning {
        meta.insert("warning", w.into());
    }
    entry.insert("data", Node::Obj(meta));
}

// ---- containers ----

/// A parsed file: its format name and entries (each with `metadata_like` still set).
struct Report {
    format: &'static str,
    entries: Vec<Obj>,
}

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

fn png_text_like(kind: &[u8], p: &[u8], raw: bool, entry: &mut Obj) {
    match kind {
        b"tEXt" => {
            if let Some(sep) = find_nul(p) {
                entry.insert("data", obj([("keyword", p[..sep].into()), ("text", p[sep + 1..].into())]));
            }
        }
        b"zTXt" | b"iCCP" => {
            let Some(sep) = find_nul(p).filter(|&s| s + 2 <= p.len()) else { return };
            let mut meta = Obj::new();
            meta.insert(if kind == b"zTXt" { "keyword" } else { "profile_name" }, p[..sep].into());
            meta.insert("compression_method", p[sep + 1].into());
            match inflate(&p[sep + 2..]) {
                Ok(text) if kind == b"zTXt" => {
                    meta.insert("text", Node::Str(text));
                }
                Ok(profile) => {
                    meta.insert("profile_size", profile.len().into());
                    if raw {
                        meta.insert("profile_hex_preview", hex_preview(&profile).as_str().into());
                    }
                }
                Err(e) => {
                    meta.insert("decompression_error", e.as_str().into());
                }
            }
            entry.insert("data", Node::Obj(meta));
        }
        _ => {
            // iTXt: keyword, flag, method, language, translated keyword, text.
            let Some(sep) = find_nul(p).filter(|&s| s + 3 <= p.len()) else { return };
            let (flag, method) = (p[sep + 1], p[sep + 2]);
            let mut rest = &p[sep + 3..];
            let mut field = || {
                let end = find_nul(rest).unwrap_or(rest.len());
                let f = &rest[..end];
                rest = &rest[(end + 1).min(rest.len())..];
                f
            };
            let (language, translated) = (field(), field());
            let mut meta: Obj = [
                ("keyword", p[..sep].into()),
                ("language_tag", language.into()),
                ("translated_keyword", translated.into()),
                ("compression_flag", flag.into()),
                ("compression_method", method.into()),
            ]
            .into_iter()
            .collect();
            if flag == 1 {
                match inflate(rest) {
                    Ok(text) => meta.insert("text", Node::Str(text)),
                    Err(e) => meta.insert("decompression_error", e.as_str().into()),
                };
            } else {
                meta.insert("text", rest.into());
            }
            entry.insert("data", Node::Obj(meta));
        }
    }
}

fn parse_png(d: &[u8], raw: bool) -> Result<Report, String> {
    let mut entries = Vec::new();
    let mut at = PNG_SIGNATURE.len();
    while at + 12 <= d.len() {
        let len = be32(d, at);
        let kind = &d[at + 4..at + 8];
        at += 8;
        if at + len as usize + 4 > d.len() {
            return Err("PNG chunk exceeds file size".into());
        }
        let p = &d[at..at + len as usize];
        let mut e: Obj = [
            ("entry_type", "chunk".into()),
            ("name", kind.into()),
            ("length", len.into()),
            ("crc", be32(d, at + len as usize).into()),
            ("critical", kind[0].is_ascii_uppercase().into()),
            ("metadata_like", (!matches!(kind, b"IHDR" | b"PLTE" | b"IDAT" | b"IEND")).into()),
        ]
        .into_iter()
        .collect();
        let be = |o: usize| Node::from(be32(p, o));
        match (kind, len) {
            (b"IHDR", 13) => {
                e.insert(
                    "data",
                    obj([
                        ("width", be(0)),
                        ("height", be(4)),
                        ("bit_depth", p[8].into()),
                        ("color_type", p[9].into()),
                        ("compression_method", p[10].into()),
                        ("filter_method", p[11].into()),
                        ("interlace_method", p[12].into()),
                    ]),
                );
            }
            (b"tEXt" | b"zTXt" | b"iTXt" | b"iCCP", _) => png_text_like(kind, p, raw, &mut e),
            (b"eXIf", _) => exif_into(&mut e, p, raw),
            (b"gAMA", 4) => {
                e.insert("data", obj([("gamma_times_100000", be(0))]));
            }
            (b"cHRM", 32) => {
                let names = ["white_point_x", "white_point_y", "red_x", "red_y", "green_x", "green_y", "blue_x", "blue_y"];
                e.insert("data", Node::Obj(names.iter().enumerate().map(|(i, &n)| (n, be(4 * i))).collect()));
            }
            (b"sRGB", 1) => {
                e.insert("data", obj([("rendering_intent", p[0].into())]));
            }
            (b"pHYs", 9) => {
                e.insert("data", obj([("pixels_per_unit_x", be(0)), ("pixels_per_unit_y", be(4)), ("unit_specifier", p[8].into())]));
            }
            (b"tIME", 7) => {
                let f = |i: usize| Node::from(p[i]);
                e.insert(
                    "data",
                    obj([("year", be16(p, 0).into()), ("month", f(2)), ("day", f(3)), ("hour", f(4)), ("minute", f(5)), ("second", f(6))]),
                );
            }
            _ => raw_preview(&mut e, p, raw),
        }
        entries.push(e);
        at += len as usize + 4;
        if kind == b"IEND" {
            return Ok(Report { format: "PNG", entries });
        }
    }
    Err("PNG missing IEND chunk".into())
}

fn jpeg_marker_name(m: u8) -> String {
    match m {
        0xE0..=0xEF => format!("APP{}", m - 0xE0),
        0xFE => "COM".into(),
        0xDA => "SOS".into(),
        0xD8 => "SOI".into(),
        0xD9 => "EOI".into(),
        0xD0..=0xD7 => format!("RST{}", m - 0xD0),
        _ => format!("0x{m:X}"),
    }
}

const XMP_ID: &[u8] = b"http://ns.adobe.com/xap/1.0/\0";

fn parse_jpeg(d: &[u8], raw: bool) -> Result<Report, String> {
    let mut entries = Vec::new();
    let mut at = 2;
    while at + 1 < d.len() {
        if d[at] != 0xFF {
            return Err("invalid JPEG marker alignment".into());
        }
        while at < d.len() && d[at] == 0xFF {
            at += 1;
        }
        if at >= d.len() {
            break;
        }
        let marker = d[at];
        at += 1;
        if marker == 0xD9 || marker == 0xDA {
            break;
        }
        if marker == 0x01 || (0xD0..=0xD7).contains(&marker) {
            continue;
        }
        if at + 2 > d.len() {
            return Err("JPEG marker missing segment length".into());
        }
        let len = be16(d, at) as usize;
        if len < 2 || at + len > d.len() {
            return Err("JPEG segment exceeds file size".into());
        }
        let p = &d[at + 2..at + len];
        let n = p.len();
        let mut e: Obj = [
            ("entry_type", "segment".into()),
            ("marker", jpeg_marker_name(marker).as_str().into()),
            ("length", n.into()),
            ("metadata_like", (marker == 0xFE || (0xE0..=0xEF).contains(&marker)).into()),
        ]
        .into_iter()
        .collect();
        let byte_or_0 = |i: usize| Node::from(if n > i { p[i] } else { 0 });
        let u16_or_0 = |i: usize| Node::from(if n >= i + 2 { be16(p, i) } else { 0 });
        if marker == 0xFE {
            let data = match p.strip_prefix(b"parameters\0".as_slice()) {
                Some(text) => obj([("label", "parameters".into()), ("text", text.into())]),
                None => obj([("text", trim_nuls(p).into())]),
            };
            e.insert("data", data);
        } else if marker == 0xE0 && p.starts_with(b"JFIF\0") {
            e.insert(
                "data",
                obj([
                    ("identifier", "JFIF".into()),
                    ("version_major", if n >= 7 { p[5].into() } else { 0u8.into() }),
                    ("version_minor", if n >= 7 { p[6].into() } else { 0u8.into() }),
                    ("density_units", byte_or_0(7)),
                    ("x_density", u16_or_0(8)),
                    ("y_density", u16_or_0(10)),
                ]),
            );
        } else if marker == 0xE1 && p.starts_with(b"Exif\0\0") {
            exif_into(&mut e, &p[6..], raw);
        } else if marker == 0xE1 && p.starts_with(XMP_ID) {
            e.insert("data", obj([("type", "XMP".into()), ("xml", p[XMP_ID.len()..].into())]));
        } else if marker == 0xE2 && n >= 14 && p.starts_with(b"ICC_PROFILE\0") {
            let mut meta: Obj =
                [("type", "ICC_PROFILE".into()), ("sequence_no", p[12].into()), ("sequence_count", p[13].into()), ("profile_size", (n - 14).into())]
                    .into_iter()
                    .collect();
            if raw && n > 14 {
                meta.insert("profile_hex_preview", hex_preview(&p[14..]).as_str().into());
            }
            e.insert("data", Node::Obj(meta));
        } else if marker == 0xEE && n >= 12 && p.starts_with(b"Adobe\0") {
            e.insert(
                "data",
                obj([
                    ("identifier", "Adobe".into()),
                    ("version", be16(p, 6).into()),
                    ("flags0", be16(p, 8).into()),
                    ("flags1", be16(p, 10).into()),
                    ("color_transform", p[11].into()),
                ]),
            );
        } else {
            raw_preview(&mut e, p, raw);
        }
        entries.push(e);
        at += len;
    }
    Ok(Report { format: "JPEG", entries })
}

fn parse_webp(d: &[u8], raw: bool) -> Result<Report, String> {
    let mut entries = Vec::new();
    let mut at = 12;
    while at + 8 <= d.len() {
        let kind = &d[at..at + 4];
        let len = le32(d, at + 4);
        at += 8;
        if at + len as usize > d.len() {
            return Err("WebP chunk exceeds file size".into());
        }
        let p = &d[at..at + len as usize];
        let name = kind.strip_suffix(b" ").unwrap_or(kind);
        let mut e: Obj = [
            ("entry_type", "chunk".into()),
            ("name", name.into()),
            ("length", len.into()),
            ("metadata_like", matches!(kind, b"ICCP" | b"EXIF" | b"XMP ").into()),
        ]
        .into_iter()
        .collect();
        match kind {
            b"VP8X" if len >= 10 => {
                let flag = |bit: u8| Node::Bool(p[0] & bit != 0);
                let dim = |i: usize| Node::from(1 + u32::from(p[i]) + (u32::from(p[i + 1]) << 8) + (u32::from(p[i + 2]) << 16));
                e.insert(
                    "data",
                    obj([
                        ("icc_profile", flag(0x20)),
                        ("alpha", flag(0x10)),
                        ("exif", flag(0x08)),
                        ("xmp", flag(0x04)),
                        ("animation", flag(0x02)),
                        ("canvas_width", dim(4)),
                        ("canvas_height", dim(7)),
                    ]),
                );
            }
            b"EXIF" => exif_into(&mut e, p, raw),
            b"XMP " => {
                e.insert("data", obj([("type", "XMP".into()), ("xml", trim_nuls(p).into())]));
            }
            b"ICCP" => {
                let mut meta: Obj = [("profile_size", len.into())].into_iter().collect();
                raw_preview(&mut meta, p, raw);
                e.insert("data", Node::Obj(meta));
            }
            _ => raw_preview(&mut e, p, raw),
        }
        entries.push(e);
        at += len as usize + (len as usize & 1);
    }
    Ok(Report { format: "WEBP", entries })
}

/// Parses a file's bytes by their signature.
fn parse(d: &[u8], raw: bool) -> Result<Report, String> {
    if d.len() >= 8 && d.starts_with(&PNG_SIGNATURE[..4]) {
        if !d.starts_with(PNG_SIGNATURE) {
            return Err("not a PNG file".into());
        }
        parse_png(d, raw)
    } else if d.starts_with(&[0xFF, 0xD8]) {
        parse_jpeg(d, raw)
    } else if d.len() >= 12 && d.starts_with(b"RIFF") && &d[8..12] == b"WEBP" {
        parse_webp(d, raw)
    } else {
        Err("unsupported image format; only PNG, JPEG, and WebP are supported".into())
    }
}

// ---- printing ----

/// A string as a JSON literal, escaped as nlohmann::json does (control characters as
/// `\u00xx`, other characters as they are); invalid UTF-8 becomes U+FFFD.
fn json_string(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'"');
    for ch in String::from_utf8_lossy(s).chars() {
        match ch {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes()),
            c => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out.push(b'"');
}

/// True when some string in the tree is not valid UTF-8 (JSON output replaces it).
fn has_invalid_utf8(n: &Node) -> bool {
    match n {
        Node::Str(s) => std::str::from_utf8(s).is_err(),
        Node::Arr(a) => a.iter().any(has_invalid_utf8),
        Node::Obj(o) => o.values().any(has_invalid_utf8),
        _ => false,
    }
}

fn scalar(n: &Node) -> String {
    match n {
        Node::Null => "null".into(),
        Node::Bool(b) => b.to_string(),
        Node::UInt(v) => v.to_string(),
        Node::Int(v) => v.to_string(),
        _ => String::new(),
    }
}

/// Pretty JSON with two-space indentation, as nlohmann::json's `dump(2)` writes it.
pub fn dump_json(out: &mut Vec<u8>, n: &Node, level: usize) {
    let pad = |out: &mut Vec<u8>, l: usize| out.extend(std::iter::repeat_n(b' ', 2 * l));
    match n {
        Node::Str(s) => json_string(out, s),
        Node::Arr(a) if a.is_empty() => out.extend_from_slice(b"[]"),
        Node::Obj(o) if o.is_empty() => out.extend_from_slice(b"{}"),
        Node::Arr(a) => {
            out.extend_from_slice(b"[\n");
            for (i, item) in a.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(b",\n");
                }
                pad(out, level + 1);
                dump_json(out, item, level + 1);
            }
            out.push(b'\n');
            pad(out, level);
            out.push(b']');
        }
        Node::Obj(o) => {
            out.extend_from_slice(b"{\n");
            for (i, (k, v)) in o.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(b",\n");
                }
                pad(out, level + 1);
                json_string(out, k.as_bytes());
                out.extend_from_slice(b": ");
                dump_json(out, v, level + 1);
            }
            out.push(b'\n');
            pad(out, level);
            out.push(b'}');
        }
        _ => out.extend_from_slice(scalar(n).as_bytes()),
    }
}

/// `head` followed by a text value (cut at 240 bytes with `...` under `--metadata-brief`)
/// or a number, and a newline.
fn line(out: &mut Vec<u8>, head: &str, n: &Node, brief: bool) {
    out.extend_from_slice(head.as_bytes());
    match n {
        Node::Str(s) if brief && s.len() > 240 => {
            out.extend_from_slice(&s[..240]);
            out.extend_from_slice(b"...");
        }
        Node::Str(s) => out.extend_from_slice(s),
        _ => out.extend_from_slice(scalar(n).as_bytes()),
    }
    out.push(b'\n');
}

/// One `key: value` line of the text layout, with nested objects and arrays indented below.
fn print_value(out: &mut Vec<u8>, key: &str, n: &Node, indent: usize, brief: bool) {
    let prefix = " ".repeat(indent);
    match n {
        Node::Arr(items) => {
            out.extend_from_slice(format!("{prefix}{key}:\n").as_bytes());
            for item in items {
                match item {
                    Node::Obj(o) => {
                        out.extend_from_slice(format!("{prefix}  -\n").as_bytes());
                        for (k, v) in o {
                            print_value(out, k, v, indent + 4, brief);
                        }
                    }
                    // The report never nests arrays directly.
                    Node::Arr(_) => out.extend_from_slice(format!("{prefix}  -\n").as_bytes()),
                    _ => line(out, &format!("{prefix}  - "), item, brief),
                }
            }
        }
        Node::Obj(o) => {
            out.extend_from_slice(format!("{prefix}{key}:\n").as_bytes());
            for (k, v) in o {
                print_value(out, k, v, indent + 2, brief);
            }
        }
        _ => line(out, &format!("{prefix}{key}: "), n, brief),
    }
}

/// The report of the file at `path` as the reference prints it. The second value is set
/// when JSON output had to replace invalid UTF-8.
pub fn report(path: &str, opts: Options) -> Result<(Vec<u8>, bool), String> {
    let bytes = read_file(path)?;
    render(path, &bytes, opts)
}

/// Reads the whole file; the error says which step failed.
fn read_file(path: &str) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("failed to open file: {path} ({e})"))?;
    if meta.is_dir() {
        return Err(format!("failed to read file: {path} (it is a directory)"));
    }
    std::fs::read(path).map_err(|e| format!("failed to read file: {path} ({e})"))
}

/// The report of `bytes` (a file named `path`) in the chosen layout.
pub fn render(path: &str, bytes: &[u8], opts: Options) -> Result<(Vec<u8>, bool), String> {
    let report = parse(bytes, opts.raw)?;
    let entries: Vec<Obj> = report
        .entries
        .into_iter()
        .filter(|e| opts.all || e.get("metadata_like") == Some(&Node::Bool(true)))
        .map(|mut e| {
            e.remove("metadata_like");
            e
        })
        .collect();
    let mut out = Vec::new();
    if opts.json {
        let tree = obj([
            ("entries", Node::Arr(entries.into_iter().map(Node::Obj).collect())),
            ("file", path.into()),
            ("format", report.format.into()),
        ]);
        dump_json(&mut out, &tree, 0);
        out.push(b'\n');
        return Ok((out, has_invalid_utf8(&tree)));
    }
    out.extend_from_slice(format!("File: {path}\nFormat: {}\n\n", report.format).as_bytes());
    if entries.is_empty() {
        out.extend_from_slice(b"No metadata entries found.\n");
        return Ok((out, false));
    }
    for e in &entries {
        let chunk = e.get("entry_type") == Some(&Node::from("chunk"));
        let name = e.get(if chunk { "name" } else { "marker" }).cloned().unwrap_or_else(|| "unknown".into());
        out.extend_from_slice(if chunk { b"Chunk: ".as_slice() } else { b"Segment: ".as_slice() });
        if let Node::Str(s) = &name {
            out.extend_from_slice(s);
        }
        out.push(b'\n');
        for (k, v) in e {
            if !matches!(*k, "entry_type" | "name" | "marker") {
                print_value(&mut out, k, v, 2, opts.brief);
            }
        }
        out.push(b'\n');
    }
    Ok((out, false))
}

/// Prints the report of `path` on stdout (`-M metadata`).
pub fn print_report(path: &str, opts: Options) -> Result<(), String> {
    let (text, replaced) = report(path, opts)?;
    if replaced {
        stable_diffusion::sd_warn!("{path}: text that is not valid UTF-8 is shown with U+FFFD in the JSON output");
    }
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&text).and_then(|_| stdout.flush()).map_err(|e| format!("failed to write the report: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(bytes: &[u8], opts: Options) -> String {
        String::from_utf8(render("f", bytes, opts).unwrap().0).unwrap()
    }

    #[test]
    fn hex_previews_stop_at_64_bytes() {
        assert_eq!(hex_preview(&[0, 0xab, 7]), "00 ab 07");
        assert_eq!(hex_preview(&[]), "");
        assert!(hex_preview(&[1; 65]).ends_with("01 ..."));
    }

    #[test]
    fn json_escapes_like_nlohmann() {
        let mut out = Vec::new();
        json_string(&mut out, b"a\"\\\n\t\x01\x7f\xc3\xa9/");
        assert_eq!(String::from_utf8(out).unwrap(), "\"a\\\"\\\\\\n\\t\\u0001\u{7f}é/\"");
        let mut out = Vec::new();
        dump_json(&mut out, &obj([("b", Node::Arr(vec![])), ("a", obj([("x", 1u8.into())])), ("c", Node::Obj(Obj::new()))]), 0);
        assert_eq!(String::from_utf8(out).unwrap(), "{\n  \"a\": {\n    \"x\": 1\n  },\n  \"b\": [],\n  \"c\": {}\n}");
    }

    #[test]
    fn exif_in_a_webp_chunk() {
        // Little-endian TIFF: IFD0 with Make (ASCII, out of line), an Exif pointer and a
        // rational; the Exif IFD holds a UserComment and an unknown tag type.
        let mut t = b"II*\0\x08\0\0\0".to_vec();
        let ifd0 = |t: &mut Vec<u8>, e: &[(u16, u16, u32, u32)], next: u32| {
            t.extend((e.len() as u16).to_le_bytes());
            for &(tag, kind, n, v) in e {
                t.extend(tag.to_le_bytes());
                t.extend(kind.to_le_bytes());
                t.extend(n.to_le_bytes());
                t.extend(v.to_le_bytes());
            }
            t.extend(next.to_le_bytes());
        };
        // IFD0 at 8: 3 entries -> 2 + 36 + 4 = 42 bytes, data from 50.
        // Its next-IFD pointer leads back to itself.
        ifd0(&mut t, &[(0x010F, 2, 6, 50), (0x8769, 4, 1, 64), (0x011A, 5, 1, 56)], 8);
        t.extend(b"Maker\0");
        t.extend(72u32.to_le_bytes());
        t.extend(1u32.to_le_bytes());
        assert_eq!(t.len(), 64);
        ifd0(&mut t, &[(0x9286, 7, 3, u32::from_le_bytes(*b"hi!\0")), (0x1234, 99, 1, 0)], 0);
        let mut webp = b"RIFF\0\0\0\0WEBPEXIF".to_vec();
        webp.extend((t.len() as u32).to_le_bytes());
        webp.extend(&t);
        let out = text(&webp, Options::default());
        let expected = "File: f\nFormat: WEBP\n\nChunk: EXIF\n  data:\n    byte_order: little_endian\n    ifds:\n      -\n        children:\n          -\n            name: Exif\n            tags:\n              -\n                count: 3\n                id: 37510\n                name: UserComment\n                type: UNDEFINED\n                value: hi!\n              -\n                count: 1\n                error: unsupported Exif type\n                id: 4660\n                name: 0x1234\n                type: UNKNOWN\n        name: IFD0\n        tags:\n          -\n            count: 6\n            id: 271\n            name: Make\n            type: ASCII\n            value: Maker\n          -\n            count: 1\n            id: 34665\n            name: ExifIFDPointer\n            type: LONG\n            value: 64\n          -\n            count: 1\n            id: 282\n            name: XResolution\n            type: RATIONAL\n            value: 72/1 (72.000000)\n    warning: detected recursive IFD pointer\n  length: 94\n\n";
        assert_eq!(out, expected);
    }

    #[test]
    fn damaged_files_are_errors() {
        let png = {
            let mut p = PNG_SIGNATURE.to_vec();
            p.extend(13u32.to_be_bytes());
            p.extend(b"IHDR");
            p.extend([0; 17]);
            p
        };
        assert_eq!(render("f", &png, Options::default()).unwrap_err(), "PNG missing IEND chunk");
        assert_eq!(render("f", &png[..19], Options::default()).unwrap_err(), "PNG missing IEND chunk");
        assert_eq!(render("f", &png[..30], Options::default()).unwrap_err(), "PNG chunk exceeds file size");
        assert_eq!(render("f", b"\xff\xd8\xff\xfe\x00\x09ab", Options::default()).unwrap_err(), "JPEG segment exceeds file size");
        assert_eq!(render("f", b"\xff\xd8\x00\x00", Options::default()).unwrap_err(), "invalid JPEG marker alignment");
        assert_eq!(render("f", b"\xff\xd8\xff\xe0", Options::default()).unwrap_err(), "JPEG marker missing segment length");
        assert_eq!(render("f", b"RIFF\0\0\0\0WEBPVP8L\xff\0\0\0", Options::default()).unwrap_err(), "WebP chunk exceeds file size");
        assert!(render("f", b"GIF89a", Options::default()).unwrap_err().starts_with("unsupported image format"));
        assert!(render("f", b"", Options::default()).is_err());
        // Compressed text that does not inflate is reported inside the entry, not as an error.
        let mut z = PNG_SIGNATURE.to_vec();
        for (kind, body) in [(&b"zTXt"[..], &b"k\0\0\x78\x9c\x01"[..]), (b"IEND", b"")] {
            z.extend((body.len() as u32).to_be_bytes());
            z.extend(kind);
            z.extend(body);
            z.extend([0; 4]);
        }
        assert!(text(&z, Options::default()).contains("decompression_error: zlib decompression failed with status -3"));
    }

    #[test]
    fn brief_cuts_long_text() {
        let long = "x".repeat(300);
        let mut jpeg = b"\xff\xd8\xff\xfe".to_vec();
        jpeg.extend(((long.len() + 2) as u16).to_be_bytes());
        jpeg.extend(long.as_bytes());
        jpeg.extend(b"\xff\xd9");
        let out = text(&jpeg, Options { brief: true, ..Options::default() });
        assert!(out.contains(&format!("    text: {}...\n", "x".repeat(240))), "{out}");
        assert_eq!(text(b"\xff\xd8\xff\xd9", Options::default()), "File: f\nFormat: JPEG\n\nNo metadata entries found.\n");
    }
}
