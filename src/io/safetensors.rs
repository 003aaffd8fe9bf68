//! safetensors: an 8-byte little-endian header length, a JSON header, then raw data.
//!
//! Our own strict reader: sizes are checked against the file before anything is
//! allocated, duplicate names are errors, and every dtype the reference accepts is mapped
//! the same way (F64→F32, I64→I32, F8→F16 on read). Tensors may share bytes (overlapping
//! data ranges), as the reference allows: only reads are made from them.

use super::dtype::SourceDtype;
use super::storage::TensorStorage;
use crate::error::{Context, Error, Result};
use crate::types::SdType;
use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, Visitor};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

/// The safetensors specification caps the JSON header at 100 MB.
pub const MAX_HEADER_LEN: u64 = 100 << 20;
const MAX_COMFY_CONFIG_LEN: u64 = 64 << 10;
const MAX_INDEX_LEN: u64 = 64 << 20;

/// The tensors and string metadata of one safetensors file.
#[derive(Debug, Default)]
pub struct SafetensorsFile {
    /// In the reference's order (names sorted bytewise); offsets are absolute.
    pub tensors: Vec<TensorStorage>,
    pub metadata: BTreeMap<String, String>,
}

/// True when `head` (the first bytes of a file of `file_len` bytes) looks like
/// safetensors: a plausible header length followed by a JSON object.
pub fn probe(head: &[u8], file_len: u64) -> bool {
    if head.len() < 9 || file_len <= 8 {
        return false;
    }
    let n = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    n > 2 && n <= file_len - 8 && head[8..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// Parses the header of a safetensors file of `file_len` bytes; `what` names the file in
/// error messages.
pub fn read<R: Read + Seek>(r: &mut R, file_len: u64, what: &str) -> Result<SafetensorsFile> {
    ensure!(file_len > 8, "'{}' is not a safetensors file: only {} bytes", what, file_len);
    let mut len_bytes = [0u8; 8];
    r.seek(SeekFrom::Start(0))?;
    r.read_exact(&mut len_bytes).with_context(|| format!("reading the safetensors header of '{what}'"))?;
    let header_len = u64::from_le_bytes(len_bytes);
    ensure!(
        header_len <= file_len - 8,
        "'{}': safetensors header length {} exceeds the file size {}",
        what,
        header_len,
        file_len
    );
    ensure!(
        header_len <= MAX_HEADER_LEN,
        "'{}': safetensors header of {} bytes is larger than the 100 MB the format allows",
        what,
        header_len
    );
    let mut header = vec![0u8; header_len as usize];
    r.read_exact(&mut header).with_context(|| format!("reading the safetensors header of '{what}'"))?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;

    let Entries(mut entries) = serde_json::from_slice(&header)
        .map_err(|e| Error::new(format!("'{what}': invalid safetensors header: {e}")))?;
    // The reference walks the header as a sorted map.
    entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));

    let mut out = SafetensorsFile::default();
    // ComfyUI quantization configs by module (the reference reads them in the same pass; the
    // sorted order puts `<module>.comfy_quant` before `<module>.weight`).
    let mut comfy: HashMap<String, ComfyQuant> = HashMap::new();

    for (name, info) in entries.iter() {
        if name == "__metadata__" {
            if let Value::Object(m) = info {
                for (k, v) in m {
                    if let Value::String(s) = v {
                        out.metadata.insert(k.clone(), s.clone());
                    }
                }
            }
            continue;
        }
        let bad = |problem: &str| Error::new(format!("'{what}': tensor '{name}': {problem}"));
        let info = info.as_object().ok_or_else(|| bad("header entry is not an object"))?;
        let dtype = info.get("dtype").and_then(Value::as_str).ok_or_else(|| bad("missing dtype"))?;
        let (begin, end) = match info.get("data_offsets").and_then(Value::as_array).map(|a| a.as_slice()) {
            Some([b, e]) => (
                b.as_u64().ok_or_else(|| bad("invalid data_offsets"))?,
                e.as_u64().ok_or_else(|| bad("invalid data_offsets"))?,
            ),
            _ => return Err(bad("missing or invalid data_offsets")),
        };
        ensure!(
            begin <= end && end <= data_len,
            "'{}': data offsets [{}, {}] of tensor '{}' are out of bounds (data section is {} bytes)",
            what,
            begin,
            end,
            name,
            data_len
        );

        if dtype == "U8" {
            // Raw byte blobs are not weights; ComfyUI keeps its quantization configs here.
            if let Some(module) = name.strip_suffix(".comfy_quant") {
                comfy.insert(module.to_string(), read_comfy_config(r, data_start + begin, end - begin, what, name)?);
            }
            continue;
        }
        if name.ends_with(".comfy_quant") {
            bail!("'{}': ComfyUI quantization metadata tensor '{}' has dtype {} instead of U8", what, name, dtype);
        }

        let (ty, source) = dtype_to_type(dtype)
            .ok_or_else(|| Error::new(format!("'{what}': unsupported dtype '{dtype}' (tensor '{name}')")))?;
        let shape = info.get("shape").and_then(Value::as_array).ok_or_else(|| bad("missing shape"))?;
        ensure!(shape.len() <= 5, "'{}': tensor '{}' has {} dimensions (at most 5 are supported)", what, name, shape.len());
        let mut ne = Vec::with_capacity(shape.len());
        for d in shape.iter().rev() {
            let d = d.as_u64().filter(|&d| d <= i64::MAX as u64).ok_or_else(|| bad("invalid shape"))?;
            ne.push(d as i64);
        }
        let mut ts = TensorStorage::new(name.clone(), ty, &ne, source).map_err(|e| Error::new(format!("'{what}': {e}")))?;
        ensure!(
            ts.file_nbytes() == end - begin,
            "'{}': size mismatch for tensor '{}' ({}): shape {:?} needs {} bytes, the file gives {}",
            what,
            name,
            dtype,
            shape,
            ts.file_nbytes(),
            end - begin
        );
        ts.offset = data_start + begin;
        mark_int8(&mut ts, &comfy, what)?;
        out.tensors.push(ts);
    }

    Ok(out)
}

/// A JSON object read as a list of entries, refusing repeated keys.
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<Entries, A::Error> {
                let mut seen = HashSet::new();
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Value>()? {
                    if !seen.insert(k.clone()) {
                        return Err(A::Error::custom(format!("'{k}' is listed twice")));
                    }
                    v.push((k, val));
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// One module's ComfyUI quantization config (`<module>.comfy_quant`, JSON in a U8 tensor).
struct ComfyQuant {
    format: String,
    convrot: bool,
    group: i64,
}

/// The largest ConvRot group the CPU kernels rotate (the reference's fork has the same bound).
pub const MAX_CONVROT_GROUP: i64 = 256;

/// Marks an `int8_tensorwise` module's weight with its rotation group, checking it as the
/// reference does, and makes its `[out, 1]` row scales 1-D.
fn mark_int8(ts: &mut TensorStorage, comfy: &HashMap<String, ComfyQuant>, what: &str) -> Result<()> {
    let name = ts.name().to_string();
    let ne = TensorStorage::ne(ts);
    let config = |suffix: &str| name.strip_suffix(suffix).and_then(|m| comfy.get(m)).filter(|c| c.format == "int8_tensorwise");
    if let Some(c) = config(".weight") {
        ensure!(ts.ty() == SdType::I8, "'{}': ComfyUI int8_tensorwise weight is not I8: '{}'", what, name);
        let mut group = 0;
        if c.convrot {
            let g = c.group;
            let power_of_4 = g >= 1 && (g & (g - 1)) == 0 && g.trailing_zeros() % 2 == 0;
            ensure!(power_of_4 && ne[0] % g == 0, "'{}': invalid ComfyUI convrot group size {} for tensor '{}' (a power of 4 dividing its {} inputs)", what, g, name, ne[0]);
            ensure!(g <= MAX_CONVROT_GROUP, "'{}': the ComfyUI convrot group size {} of tensor '{}' is larger than {}, the most the CPU kernels rotate", what, g, name, MAX_CONVROT_GROUP);
            group = g as u32;
        }
        ts.set_int8_group(group);
    } else if config(".weight_scale").is_some() && ts.n_dims() == 2 && ne[0] == 1 {
        ts.flatten();
    }
    Ok(())
}

fn read_comfy_config<R: Read + Seek>(r: &mut R, offset: u64, len: u64, what: &str, name: &str) -> Result<ComfyQuant> {
    ensure!(
        len > 0 && len <= MAX_COMFY_CONFIG_LEN,
        "'{}': invalid ComfyUI quantization metadata tensor '{}' ({} bytes)",
        what,
        name,
        len
    );
    let mut buf = vec![0u8; len as usize];
    r.seek(SeekFrom::Start(offset))?;
    r.read_exact(&mut buf).with_context(|| format!("'{what}': reading ComfyUI quantization metadata '{name}'"))?;
    let v: Value = serde_json::from_slice(&buf)
        .map_err(|e| Error::new(format!("'{what}': parsing ComfyUI quantization metadata '{name}' failed: {e}")))?;
    let format = v.get("format").and_then(Value::as_str).unwrap_or("").to_string();
    let convrot = v.get("convrot").and_then(Value::as_bool).unwrap_or(false);
    let group = v.get("convrot_groupsize").and_then(Value::as_i64).unwrap_or(0);
    Ok(ComfyQuant { format, convrot, group })
}

/// The ggml type a safetensors dtype is read as, and how its bytes are converted.
pub fn dtype_to_type(dtype: &str) -> Option<(SdType, SourceDtype)> {
    Some(match dtype {
        "F16" => (SdType::F16, SourceDtype::Native),
        "BF16" => (SdType::Bf16, SourceDtype::Native),
        "F32" => (SdType::F32, SourceDtype::Native),
        "F64" => (SdType::F32, SourceDtype::F64),
        "F8_E4M3" => (SdType::F16, SourceDtype::F8E4M3),
        "F8_E5M2" => (SdType::F16, SourceDtype::F8E5M2),
        "I32" => (SdType::I32, SourceDtype::Native),
        "I64" => (SdType::I32, SourceDtype::I64),
        "I8" => (SdType::I8, SourceDtype::Native),
        _ => return None,
    })
}

/// The safetensors dtype a ggml type is written as (only these can be written).
pub fn type_to_dtype(ty: SdType) -> Option<&'static str> {
    Some(match ty {
        SdType::F16 => "F16",
        SdType::Bf16 => "BF16",
        SdType::F32 => "F32",
        SdType::I32 => "I32",
        _ => return None,
    })
}

pub use super::storage::WriteEntry;

/// Serialises the file head (length prefix + JSON header) for tensors written back to
/// back in the given order; returns it with the absolute offset of each tensor's data.
pub fn write_header(entries: &[WriteEntry]) -> Result<(Vec<u8>, Vec<u64>)> {
    let mut json = String::from("{");
    let mut rel = Vec::with_capacity(entries.len());
    let mut offset = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let dtype = type_to_dtype(e.ty)
            .ok_or_else(|| Error::new(format!("unsupported safetensors dtype '{}' for tensor '{}'", e.ty.name(), e.name)))?;
        let shape: Vec<String> = e.shape.iter().rev().map(|d| d.to_string()).collect();
        if i > 0 {
            json.push(',');
        }
        let end = offset + e.nbytes;
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            serde_json::to_string(e.name).map_err(|e| Error::new(e.to_string()))?,
            dtype,
            shape.join(","),
            offset,
            end
        ));
        rel.push(offset);
        offset = end;
    }
    json.push('}');
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(json.as_bytes());
    let start = head.len() as u64;
    Ok((head, rel.into_iter().map(|o| o + start).collect()))
}

/// The shard files of a sharded checkpoint (`*.safetensors.index.json`), in the order the
/// reference opens them. Shards must be files next to the index.
pub fn read_index(path: &Path) -> Result<Vec<PathBuf>> {
    let what = path.display();
    let len = std::fs::metadata(path).with_context(|| format!("failed to open '{what}'"))?.len();
    ensure!(len <= MAX_INDEX_LEN, "'{}': safetensors index of {} bytes is too large", what, len);
    let text = std::fs::read(path).with_context(|| format!("failed to read '{what}'"))?;
    let v: Value =
        serde_json::from_slice(&text).map_err(|e| Error::new(format!("parsing safetensors index '{what}' failed: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::new(format!("invalid safetensors index '{what}': no weight_map object")))?;
    let mut items: Vec<(&String, &Value)> = map.iter().collect();
    items.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut seen = HashSet::new();
    let mut shards = Vec::new();
    for (tensor, shard) in items {
        let shard = shard
            .as_str()
            .ok_or_else(|| Error::new(format!("'{what}': invalid shard path for tensor '{tensor}'")))?;
        let rel = Path::new(shard);
        ensure!(
            !shard.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)),
            "'{}': shard path '{}' (tensor '{}') must name a file next to the index",
            what,
            shard,
            tensor
        );
        ensure!(
            !shard.ends_with(".json"),
            "'{}': shard '{}' is itself an index; nested indexes are not supported",
            what,
            shard
        );
        let full = dir.join(rel);
        if seen.insert(full.clone()) {
            shards.push(full);
        }
    }
    ensure!(!shards.is_empty(), "safetensors index has no tensors: '{}'", what);
    Ok(shards)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Cursor;

    /// Builds a safetensors file from a JSON header and a data section.
    pub fn file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend_from_slice(data);
        f
    }

    fn parse(bytes: &[u8]) -> Result<SafetensorsFile> {
        read(&mut Cursor::new(bytes), bytes.len() as u64, "t.safetensors")
    }

    #[test]
    fn reads_dtypes_sorted_with_offsets() {
        let h = r#"{"b":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},
                    "a":{"dtype":"F64","shape":[2],"data_offsets":[12,28]},
                    "c":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[28,32]},
                    "d":{"dtype":"I64","shape":[],"data_offsets":[32,40]},
                    "u":{"dtype":"U8","shape":[1],"data_offsets":[40,41]},
                    "__metadata__":{"format":"pt","n":1}}"#;
        let f = file(h, &[0u8; 41]);
        let st = parse(&f).unwrap();
        let names: Vec<&str> = st.tensors.iter().map(|t| t.name()).collect();
        assert_eq!(names, ["a", "b", "c", "d"]);
        let start = 8 + h.len() as u64;
        let b = &st.tensors[1];
        assert_eq!((b.shape(), b.ty(), b.offset()), (&[3i64, 2][..], SdType::F16, start));
        assert_eq!((st.tensors[0].ty(), st.tensors[0].source()), (SdType::F32, SourceDtype::F64));
        assert_eq!((st.tensors[2].ty(), st.tensors[2].file_nbytes()), (SdType::F16, 4));
        assert_eq!((st.tensors[3].ty(), st.tensors[3].shape()), (SdType::I32, &[1i64][..]));
        assert_eq!(st.metadata.get("format").map(String::as_str), Some("pt"));
        assert!(!st.metadata.contains_key("n"));
    }

    #[test]
    fn five_dims_fold_outer() {
        let h = r#"{"w":{"dtype":"F32","shape":[2,3,4,5,6],"data_offsets":[0,2880]}}"#;
        let st = parse(&file(h, &vec![0u8; 2880])).unwrap();
        assert_eq!(st.tensors[0].shape(), &[6, 5, 4, 6]);
    }

    fn err(h: &str, data_len: usize) -> String {
        parse(&file(h, &vec![0u8; data_len])).unwrap_err().to_string()
    }

    #[test]
    fn hostile_headers() {
        // truncated / absurd header length
        assert!(parse(&[1, 2, 3]).unwrap_err().to_string().contains("only 3 bytes"));
        let mut f = file(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, &[0; 4]);
        f[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(&f).unwrap_err().to_string().contains("exceeds the file size"));
        // offsets
        assert!(err(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}}"#, 4).contains("out of bounds"));
        assert!(err(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#, 4).contains("out of bounds"));
        assert!(err(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[-1,4]}}"#, 4).contains("data_offsets"));
        let overlap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        // Shared bytes are allowed, as in the reference.
        let f = file(overlap, &[0; 12]);
        assert_eq!(parse(&f).unwrap().tensors.len(), 2);
        // repeated names
        let dup = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        assert!(err(dup, 8).contains("listed twice"));
        // dtype / shape / byte count
        assert!(err(r#"{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}"#, 8).contains("unsupported dtype 'C64'"));
        assert!(err(r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8).contains("size mismatch"));
        assert!(err(r#"{"a":{"dtype":"F32","shape":[1,1,1,1,1,1],"data_offsets":[0,4]}}"#, 4).contains("6 dimensions"));
        assert!(err(r#"{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,4]}}"#, 4).contains("invalid shape"));
        let huge = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}"#;
        assert!(err(huge, 4).contains("'a'"));
        assert!(err(r#"{"a":{"dtype":"F32","shape":[1]}}"#, 4).contains("data_offsets"));
        assert!(err(r#"[1,2,3]"#, 4).contains("invalid safetensors header"));
        assert!(err(r#"{"a":5}"#, 4).contains("not an object"));
        let deep = format!("{}{}", "[".repeat(100000), "]".repeat(100000));
        assert!(err(&deep, 0).contains("invalid safetensors header"));
        assert!(err("{\"a\":", 0).contains("invalid safetensors header"));
    }

    /// A weight `m.weight` plus its ComfyUI quantization config `cfg`.
    fn comfy(dtype: &str, weight: &[u8], shape: &str, cfg: &[u8]) -> Vec<u8> {
        let n = weight.len();
        let h = format!(
            r#"{{"m.weight":{{"dtype":"{dtype}","shape":{shape},"data_offsets":[0,{n}]}},"m.comfy_quant":{{"dtype":"U8","shape":[{}],"data_offsets":[{n},{}]}}}}"#,
            cfg.len(),
            n + cfg.len()
        );
        file(&h, &[weight, cfg].concat())
    }

    #[test]
    fn comfy_int8_weights_carry_their_rotation() {
        let cfg = |convrot: bool, g: i64| format!(r#"{{"format":"int8_tensorwise","convrot":{convrot},"convrot_groupsize":{g}}}"#).into_bytes();
        let f = parse(&comfy("I8", &[0; 256], "[16,16]", &cfg(true, 16))).unwrap();
        assert_eq!((f.tensors.len(), f.tensors[0].int8_group()), (1, Some(16)));
        let f = parse(&comfy("I8", &[0; 256], "[16,16]", &cfg(false, 16))).unwrap();
        assert_eq!(f.tensors[0].int8_group(), Some(0));
        // groups that are not powers of 4 dividing the inputs, or beyond the kernels' 256
        for g in [0, 2, 8, 12, 64] {
            let e = parse(&comfy("I8", &[0; 256], "[16,16]", &cfg(true, g))).unwrap_err().to_string();
            assert!(e.contains("invalid ComfyUI convrot group size") && e.contains("'m.weight'"), "{g}: {e}");
        }
        let e = parse(&comfy("I8", &[0; 1024], "[2,512]", &cfg(true, 1024 / 2))).unwrap_err().to_string();
        assert!(e.contains("invalid"), "{e}");
        let e = parse(&comfy("I8", &[0; 2048], "[2,1024]", &cfg(true, 1024))).unwrap_err().to_string();
        assert!(e.contains("larger than 256"), "{e}");
        let e = parse(&comfy("F16", &[0; 8], "[4]", &cfg(false, 0))).unwrap_err().to_string();
        assert!(e.contains("not I8: 'm.weight'"), "{e}");
        // other ComfyUI formats load as plain tensors
        let f = comfy("F8_E4M3", &[0; 4], "[4]", br#"{"format":"float8_e4m3fn"}"#);
        assert_eq!(parse(&f).unwrap().tensors[0].int8_group(), None);
        assert!(parse(&comfy("I8", &[0; 4], "[4]", b"{bad")).unwrap_err().to_string().contains("ComfyUI"));
    }

    #[test]
    fn comfy_int8_row_scales_become_one_dimensional() {
        let cfg = br#"{"format":"int8_tensorwise"}"#;
        let h = format!(
            r#"{{"m.weight":{{"dtype":"I8","shape":[2,4],"data_offsets":[0,8]}},"m.weight_scale":{{"dtype":"F32","shape":[2,1],"data_offsets":[8,16]}},"m.comfy_quant":{{"dtype":"U8","shape":[{}],"data_offsets":[16,{}]}}}}"#,
            cfg.len(),
            16 + cfg.len()
        );
        let f = parse(&file(&h, &[&[0u8; 16][..], cfg].concat())).unwrap();
        let scale = f.tensors.iter().find(|t| t.name() == "m.weight_scale").unwrap();
        assert_eq!(scale.shape(), &[2]);
    }

    #[test]
    fn header_round_trip() {
        let e = [
            WriteEntry { name: "x\"y", ty: SdType::F16, shape: &[3, 2], nbytes: 12 },
            WriteEntry { name: "z", ty: SdType::F32, shape: &[1], nbytes: 4 },
        ];
        let (mut head, offs) = write_header(&e).unwrap();
        assert_eq!(offs, vec![head.len() as u64, head.len() as u64 + 12]);
        head.extend_from_slice(&[0u8; 16]);
        let st = parse(&head).unwrap();
        assert_eq!(st.tensors[0].name(), "x\"y");
        assert_eq!(st.tensors[0].shape(), &[3, 2]);
        assert!(write_header(&[WriteEntry { name: "q", ty: SdType::Q8_0, shape: &[32], nbytes: 34 }]).is_err());
    }

    #[test]
    fn index_files() {
        let dir = std::env::temp_dir().join(format!("sd-io-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let idx = dir.join("m.safetensors.index.json");
        std::fs::write(&idx, r#"{"weight_map":{"b":"s2.safetensors","a":"s1.safetensors","c":"s2.safetensors"}}"#).unwrap();
        assert_eq!(read_index(&idx).unwrap(), vec![dir.join("s1.safetensors"), dir.join("s2.safetensors")]);
        std::fs::write(&idx, r#"{"weight_map":{"a":"../x.safetensors"}}"#).unwrap();
        assert!(read_index(&idx).unwrap_err().to_string().contains("next to the index"));
        std::fs::write(&idx, r#"{"weight_map":{"a":"/etc/passwd"}}"#).unwrap();
        assert!(read_index(&idx).is_err());
        std::fs::write(&idx, r#"{"weight_map":{}}"#).unwrap();
        assert!(read_index(&idx).unwrap_err().to_string().contains("no tensors"));
        std::fs::write(&idx, r#"{"metadata":{}}"#).unwrap();
        assert!(read_index(&idx).unwrap_err().to_string().contains("weight_map"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
