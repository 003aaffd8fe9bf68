//! GGUF v2/v3: our own reader and writer.
//!
//! ggml's `gguf_init_from_file` aborts the process on some malformed input, so we parse
//! the format ourselves: every count and length is checked against the bytes left in the
//! file before anything is allocated, tensor data must lie inside the file without
//! overlapping, and names and keys must be unique.

use super::dtype::SourceDtype;
use super::storage::{TensorStorage, MAX_DIMS};
use crate::error::{Context, Error, Result};
use crate::types::SdType;
use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// More dimensions than this in a tensor info is treated as corruption.
const MAX_FILE_DIMS: u32 = 16;
/// Upper bound on the memory metadata may take once parsed.
const METADATA_BUDGET: u64 = 1 << 30;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an integer, if it is one.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v as i128,
            GgufValue::I8(v) => v as i128,
            GgufValue::U16(v) => v as i128,
            GgufValue::I16(v) => v as i128,
            GgufValue::U32(v) => v as i128,
            GgufValue::I32(v) => v as i128,
            GgufValue::U64(v) => v as i128,
            GgufValue::I64(v) => v as i128,
            _ => return None,
        })
    }
}

/// The parsed head of a GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub metadata: Vec<(String, GgufValue)>,
    /// Offsets are absolute.
    pub tensors: Vec<TensorStorage>,
}

/// Bounds-checked little-endian reading of the file head.
struct Reader<'r, R> {
    r: &'r mut R,
    pos: u64,
    len: u64,
    what: &'r str,
}

impl<R: Read> Reader<'_, R> {
    fn left(&self) -> u64 {
        self.len - self.pos
    }

    fn bytes(&mut self, n: u64, item: &str) -> Result<Vec<u8>> {
        ensure!(
            n <= self.left(),
            "'{}': truncated GGUF file: {} needs {} bytes at offset {}, {} left",
            self.what,
            item,
            n,
            self.pos,
            self.left()
        );
        let mut b = vec![0u8; n as usize];
        self.r
            .read_exact(&mut b)
            .with_context(|| format!("'{}': reading {} at offset {}", self.what, item, self.pos))?;
        self.pos += n;
        Ok(b)
    }

    fn array<const N: usize>(&mut self, item: &str) -> Result<[u8; N]> {
        Ok(self.bytes(N as u64, item)?.try_into().expect("exact length"))
    }

    fn u32(&mut self, item: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(item)?))
    }

    fn u64(&mut self, item: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(item)?))
    }

    fn string(&mut self, item: &str) -> Result<String> {
        let n = self.u64(item)?;
        let b = self.bytes(n, item)?;
        String::from_utf8(b).map_err(|_| Error::new(format!("'{}': {} is not valid UTF-8", self.what, item)))
    }
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// Minimum encoded size of one value of GGUF type `t` (0 = invalid type).
fn min_value_size(t: u32) -> u64 {
    match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 9 => 8,
        10..=12 => 8,
        _ => 0,
    }
}

fn read_value<R: Read>(rd: &mut Reader<R>, t: u32, key: &str, budget: &mut u64, in_array: bool) -> Result<GgufValue> {
    let item = format!("value of '{key}'");
    let what = rd.what;
    let spend = |budget: &mut u64, n: u64| -> Result<()> {
        *budget = budget
            .checked_sub(n)
            .ok_or_else(|| Error::new(format!("'{what}': GGUF metadata is larger than 1 GiB")))?;
        Ok(())
    };
    spend(budget, std::mem::size_of::<GgufValue>() as u64)?;
    Ok(match t {
        0 => GgufValue::U8(rd.array::<1>(&item)?[0]),
        1 => GgufValue::I8(rd.array::<1>(&item)?[0] as i8),
        2 => GgufValue::U16(u16::from_le_bytes(rd.array(&item)?)),
        3 => GgufValue::I16(i16::from_le_bytes(rd.array(&item)?)),
        4 => GgufValue::U32(u32::from_le_bytes(rd.array(&item)?)),
        5 => GgufValue::I32(i32::from_le_bytes(rd.array(&item)?)),
        6 => GgufValue::F32(f32::from_le_bytes(rd.array(&item)?)),
        7 => match rd.array::<1>(&item)?[0] {
            0 => GgufValue::Bool(false),
            1 => GgufValue::Bool(true),
            b => bail!("'{}': invalid bool {} in '{}'", rd.what, b, key),
        },
        8 => {
            let s = rd.string(&item)?;
            spend(budget, s.len() as u64)?;
            GgufValue::Str(s)
        }
        9 => {
            ensure!(!in_array, "'{}': nested arrays are not supported (key '{}')", rd.what, key);
            let et = rd.u32(&item)?;
            let n = rd.u64(&item)?;
            let min = min_value_size(et);
            ensure!(et != 9, "'{}': nested arrays are not supported (key '{}')", rd.what, key);
            ensure!(min > 0, "'{}': array of unknown type {} in '{}'", rd.what, et, key);
            ensure!(
                n <= rd.left() / min,
                "'{}': truncated GGUF file: array '{}' claims {} elements",
                rd.what,
                key,
                n
            );
            let mut v = Vec::with_capacity((n as usize).min(1 << 16));
            for _ in 0..n {
                v.push(read_value(rd, et, key, budget, true)?);
            }
            GgufValue::Array(v)
        }
        10 => GgufValue::U64(u64::from_le_bytes(rd.array(&item)?)),
        11 => GgufValue::I64(i64::from_le_bytes(rd.array(&item)?)),
        12 => GgufValue::F64(f64::from_le_bytes(rd.array(&item)?)),
        _ => bail!("'{}': unknown metadata type {} for key '{}'", rd.what, t, key),
    })
}

/// Parses the head of a GGUF file of `file_len` bytes (`what` names it in messages).
pub fn read<R: Read + Seek>(r: &mut R, file_len: u64, what: &str) -> Result<GgufFile> {
    r.seek(SeekFrom::Start(0))?;
    let mut rd = Reader { r, pos: 0, len: file_len, what };
    let magic: [u8; 4] = rd.array("magic")?;
    ensure!(&magic == MAGIC, "'{}' is not a GGUF file", what);
    let version = rd.u32("version")?;
    ensure!(version != 1, "'{}': GGUF version 1 is not supported (convert it to v3)", what);
    ensure!(
        version == 2 || version == 3,
        "'{}': unsupported GGUF version {}{}",
        what,
        version,
        if version.swap_bytes() <= 3 { " (a big-endian file?)" } else { "" }
    );
    let n_tensors = rd.u64("tensor count")?;
    let n_kv = rd.u64("metadata count")?;
    // Each metadata entry takes at least 13 bytes, each tensor info at least 32.
    ensure!(n_kv <= rd.left() / 13, "'{}': metadata count {} is larger than the file allows", what, n_kv);
    ensure!(n_tensors <= rd.left() / 32, "'{}': tensor count {} is larger than the file allows", what, n_tensors);

    let mut budget = METADATA_BUDGET;
    let mut metadata = Vec::with_capacity(n_kv.min(1 << 16) as usize);
    let mut keys = HashSet::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..n_kv {
        let key = rd.string(&format!("metadata key #{i}"))?;
        ensure!(keys.insert(key.clone()), "'{}': duplicate metadata key '{}'", what, key);
        let t = rd.u32(&format!("type of '{key}'"))?;
        let v = read_value(&mut rd, t, &key, &mut budget, false)?;
        if key == "general.alignment" {
            match v {
                GgufValue::U32(a) if a != 0 && a.is_power_of_two() => alignment = a as u64,
                GgufValue::U32(a) => {
                    sd_warn!("'{}': invalid alignment value {}, using {}", what, a, DEFAULT_ALIGNMENT);
                }
                _ => bail!("'{}': general.alignment must be a u32", what),
            }
        }
        metadata.push((key, v));
    }

    struct Info {
        name: String,
        ne: Vec<i64>,
        ty: SdType,
        offset: u64,
    }
    let mut infos = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = rd.string(&format!("name of tensor #{i}"))?;
        ensure!(names.insert(name.clone()), "'{}': duplicate tensor name '{}'", what, name);
        let n_dims = rd.u32(&format!("dimensions of '{name}'"))?;
        ensure!(
            (1..=MAX_FILE_DIMS).contains(&n_dims),
            "'{}': tensor '{}' has {} dimensions",
            what,
            name,
            n_dims
        );
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = i64::from_le_bytes(rd.array(&format!("shape of '{name}'"))?);
            ensure!(d >= 0, "'{}': tensor '{}' has a negative dimension {}", what, name, d);
            ne.push(d);
        }
        let raw_ty = rd.u32(&format!("type of '{name}'"))?;
        let ty = SdType::from_raw(raw_ty)
            .ok_or_else(|| Error::new(format!("'{what}': tensor '{name}' has unknown ggml type {raw_ty}")))?;
        let offset = rd.u64(&format!("offset of '{name}'"))?;
        infos.push(Info { name, ne, ty, offset });
    }

    let data_offset = align_up(rd.pos, alignment).unwrap_or(u64::MAX);
    ensure!(
        infos.is_empty() || data_offset <= file_len,
        "'{}': truncated GGUF file: data section starts at {} beyond the end ({})",
        what,
        data_offset,
        file_len
    );

    let mut tensors = Vec::with_capacity(infos.len());
    let mut ranges = Vec::with_capacity(infos.len());
    for (i, info) in infos.into_iter().enumerate() {
        // Outer dimensions beyond four are folded, trailing ones dropped (ggml_n_dims).
        let mut ne = info.ne;
        if ne.len() > MAX_DIMS {
            let outer: Option<i64> = ne[MAX_DIMS - 1..].iter().try_fold(1i64, |a, &d| a.checked_mul(d));
            let outer = outer.ok_or_else(|| Error::new(format!("'{}': tensor '{}' is too large", what, info.name)))?;
            ne.truncate(MAX_DIMS);
            ne[MAX_DIMS - 1] = outer;
        }
        while ne.len() > 1 && ne[ne.len() - 1] == 1 {
            ne.pop();
        }
        let mut ts = TensorStorage::new(info.name, info.ty, &ne, SourceDtype::Native)
            .map_err(|e| Error::new(format!("'{what}': {e}")))?;
        ensure!(
            info.offset % alignment == 0,
            "'{}': tensor '{}' has offset {}, not a multiple of the alignment {}",
            what,
            ts.name(),
            info.offset,
            alignment
        );
        let start = data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(ts.nbytes()));
        match (start, end) {
            (Some(s), Some(e)) if e <= file_len => {
                ts.offset = s;
                if s < e {
                    ranges.push((s, e, i));
                }
            }
            _ => bail!(
                "'{}': tensor '{}' ({} bytes at data offset {}) extends beyond the end of the file ({} bytes)",
                what,
                ts.name(),
                ts.nbytes(),
                info.offset,
                file_len
            ),
        }
        tensors.push(ts);
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            bail!("'{}': the data of tensors '{}' and '{}' overlap", what, tensors[w[0].2].name(), tensors[w[1].2].name());
        }
    }
    Ok(GgufFile { version, alignment, data_offset, metadata, tensors })
}

pub use super::storage::WriteEntry;

/// Serialises a GGUF v3 head (no metadata) for the given tensors; returns the bytes up to
/// the data section, the absolute offset of each tensor's data and the total file size
/// (every tensor padded to the alignment, as ggml writes it). Trailing 1-dimensions are
/// dropped like ggml's writer does.
pub fn write_header(entries: &[WriteEntry]) -> Result<(Vec<u8>, Vec<u64>, u64)> {
    let a = DEFAULT_ALIGNMENT;
    let mut h = Vec::new();
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    let mut rel = Vec::with_capacity(entries.len());
    let mut off = 0u64;
    for e in entries {
        let mut dims = e.shape.len().clamp(1, MAX_DIMS);
        while dims > 1 && e.shape.get(dims - 1) == Some(&1) {
            dims -= 1;
        }
        h.extend_from_slice(&(e.name.len() as u64).to_le_bytes());
        h.extend_from_slice(e.name.as_bytes());
        h.extend_from_slice(&(dims as u32).to_le_bytes());
        for i in 0..dims {
            h.extend_from_slice(&e.shape.get(i).copied().unwrap_or(1).to_le_bytes());
        }
        h.extend_from_slice(&e.ty.raw().to_le_bytes());
        h.extend_from_slice(&off.to_le_bytes());
        rel.push(off);
        off = align_up(off + e.nbytes, a).context("output too large")?;
    }
    let data = align_up(h.len() as u64, a).context("output too large")?;
    h.resize(data as usize, 0);
    Ok((h, rel.into_iter().map(|o| o + data).collect(), data + off))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Cursor;

    /// A GGUF image with the given metadata bytes and tensors (name, ne, type, offset).
    pub fn file(version: u32, kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[i64], u32, u64)], data: &[u8]) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(b"GGUF");
        h.extend_from_slice(&version.to_le_bytes());
        h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        for (k, t, v) in kv {
            h.extend_from_slice(&(k.len() as u64).to_le_bytes());
            h.extend_from_slice(k.as_bytes());
            h.extend_from_slice(&t.to_le_bytes());
            h.extend_from_slice(v);
        }
        for (n, ne, t, off) in tensors {
            h.extend_from_slice(&(n.len() as u64).to_le_bytes());
            h.extend_from_slice(n.as_bytes());
            h.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in *ne {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.to_le_bytes());
            h.extend_from_slice(&off.to_le_bytes());
        }
        h.resize(h.len().div_ceil(32) * 32, 0);
        h.extend_from_slice(data);
        h
    }

    fn parse(b: &[u8]) -> Result<GgufFile> {
        read(&mut Cursor::new(b), b.len() as u64, "t.gguf")
    }

    fn str_val(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let mut arr = 4u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&2u64.to_le_bytes());
        arr.extend_from_slice(&7u32.to_le_bytes());
        arr.extend_from_slice(&9u32.to_le_bytes());
        let f = file(
            3,
            &[("general.name", 8, str_val("m")), ("xs", 9, arr), ("b", 7, vec![1])],
            &[("a", &[32, 2], 8, 0), ("b", &[4, 1, 1], 0, 96)],
            &[0u8; 112],
        );
        let g = parse(&f).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.metadata[0], ("general.name".to_string(), GgufValue::Str("m".into())));
        assert_eq!(g.metadata[1].1, GgufValue::Array(vec![GgufValue::U32(7), GgufValue::U32(9)]));
        assert_eq!(g.tensors[0].ty(), SdType::Q8_0);
        assert_eq!(g.tensors[0].nbytes(), 68);
        assert_eq!(g.tensors[0].offset(), g.data_offset);
        assert_eq!((g.tensors[1].shape(), g.tensors[1].offset()), (&[4i64][..], g.data_offset + 96));
    }

    #[test]
    fn custom_alignment_and_many_dims() {
        let f = file(2, &[("general.alignment", 4, 64u32.to_le_bytes().to_vec())], &[("a", &[2, 1, 1, 3, 2], 0, 0)], &[0u8; 96]);
        let g = parse(&f).unwrap();
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_offset % 64, 0);
        assert_eq!(g.tensors[0].shape(), &[2, 1, 1, 6]);
    }

    #[test]
    fn hostile_files() {
        let e = |b: &[u8]| parse(b).unwrap_err().to_string();
        assert!(e(b"GGU").contains("truncated"));
        assert!(e(b"GGML\x03\0\0\0").contains("not a GGUF"));
        assert!(e(&file(1, &[], &[], &[])).contains("version 1"));
        assert!(e(&file(0x0300_0000, &[], &[], &[])).contains("big-endian"));
        let mut f = file(3, &[], &[], &[]);
        f[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(e(&f).contains("tensor count"));
        let mut f = file(3, &[], &[], &[]);
        f[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(e(&f).contains("metadata count"));
        // string longer than the file
        let mut big = u64::MAX.to_le_bytes().to_vec();
        big.extend_from_slice(b"xx");
        assert!(e(&file(3, &[("k", 8, big)], &[], &[])).contains("truncated"));
        // array longer than the file
        let mut arr = 0u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&(1u64 << 50).to_le_bytes());
        assert!(e(&file(3, &[("k", 9, arr)], &[], &[])).contains("claims"));
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend_from_slice(&1u64.to_le_bytes());
        assert!(e(&file(3, &[("k", 9, nested)], &[], &[])).contains("nested arrays"));
        assert!(e(&file(3, &[("k", 77, vec![])], &[], &[])).contains("unknown metadata type"));
        assert!(e(&file(3, &[("k", 7, vec![3])], &[], &[])).contains("invalid bool"));
        assert!(e(&file(3, &[("k", 0, vec![1]), ("k", 0, vec![1])], &[], &[])).contains("duplicate metadata key"));
        assert!(e(&file(3, &[("general.alignment", 8, str_val("x"))], &[], &[])).contains("alignment"));
        // tensors
        assert!(e(&file(3, &[], &[("a", &[4], 0, 0), ("a", &[4], 0, 32)], &[0; 64])).contains("duplicate tensor"));
        assert!(e(&file(3, &[], &[("a", &[4], 0, 0)], &[0; 8])).contains("beyond the end"));
        assert!(e(&file(3, &[], &[("a", &[4], 0, u64::MAX - 31)], &[0; 8])).contains("beyond the end"));
        assert!(e(&file(3, &[], &[("a", &[4], 0, 4)], &[0; 64])).contains("alignment"));
        assert!(e(&file(3, &[], &[("a", &[16], 0, 0), ("b", &[4], 0, 32)], &[0; 96])).contains("overlap"));
        assert!(e(&file(3, &[], &[("a", &[4], 99, 0)], &[0; 64])).contains("unknown ggml type 99"));
        assert!(e(&file(3, &[], &[("a", &[4], 4, 0)], &[0; 64])).contains("unknown ggml type 4"));
        assert!(e(&file(3, &[], &[("a", &[33], 8, 0)], &[0; 64])).contains("invalid shape"));
        assert!(e(&file(3, &[], &[("a", &[-1], 0, 0)], &[0; 64])).contains("negative"));
        assert!(e(&file(3, &[], &[("a", &[1 << 40, 1 << 40], 0, 0)], &[0; 64])).contains("'a'"));
        let many: Vec<i64> = vec![2; 17];
        assert!(e(&file(3, &[], &[("a", &many, 0, 0)], &[0; 64])).contains("17 dimensions"));
        let mut f = file(3, &[], &[("a", &[4], 0, 0)], &[0; 16]);
        f.truncate(56);
        assert!(e(&f).contains("truncated"));
    }

    #[test]
    fn writer_round_trip() {
        let e = [
            WriteEntry { name: "a", ty: SdType::Q8_0, shape: &[64, 3], nbytes: 204 },
            WriteEntry { name: "b", ty: SdType::F16, shape: &[5, 1, 1, 1], nbytes: 10 },
        ];
        let (mut h, offs, total) = write_header(&e).unwrap();
        assert_eq!(h.len() % 32, 0);
        assert_eq!(offs, vec![h.len() as u64, h.len() as u64 + 224]);
        assert_eq!(total, h.len() as u64 + 224 + 32);
        h.resize(total as usize, 0);
        let g = parse(&h).unwrap();
        assert_eq!(g.tensors[0].shape(), &[64, 3]);
        assert_eq!(g.tensors[1].shape(), &[5]);
        assert_eq!(g.tensors[1].offset(), offs[1]);
    }
}
