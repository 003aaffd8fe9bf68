//! PyTorch checkpoints: the zip format (`torch.save` since 1.6: `*/data.pkl` plus one
//! entry per storage under `*/data/`) and the legacy format (a sequence of pickles
//! followed by the raw storages).
//!
//! Only the pickle is interpreted (see [`super::pickle`]); tensor data stays in the file.
//! Stored (uncompressed) zip entries, which is what torch writes, become plain file
//! offsets; deflated entries are decompressed on demand, never beyond their declared size.

use super::pickle::{self, PickleError, PickleTensor, StateDict, StorageInfo};
use super::storage::TensorStorage;
use crate::error::{Context, Error, Result};
use std::io::{Read, Seek, SeekFrom};
use zip::{CompressionMethod, ZipArchive};

/// Largest `data.pkl` we read (real ones are kilobytes to a few megabytes).
const MAX_PICKLE_LEN: u64 = 256 << 20;
/// Largest pickle prefix of a legacy file we read.
const MAX_LEGACY_HEAD: u64 = 256 << 20;

/// Turns one pickled tensor into a storage, checking it fits the storage's bytes.
/// `None` (with a warning) for element types we cannot read.
fn make_storage(t: &PickleTensor, info: &StorageInfo, what: &str) -> Result<Option<TensorStorage>> {
    let Some(kind) = info.kind else {
        sd_warn!("'{}': skipping tensor '{}': storage type {} is not supported", what, t.name, info.type_name);
        return Ok(None);
    };
    let (ty, source) = kind.read_as();
    let ne: Vec<i64> = t.shape.iter().rev().copied().collect();
    let ts = TensorStorage::new(t.name.clone(), ty, &ne, source).map_err(|e| Error::new(format!("'{what}': {e}")))?;
    let fits = t.offset.checked_add(ts.file_nbytes()).is_some_and(|end| end <= info.nbytes);
    ensure!(
        fits,
        "'{}': tensor '{}' ({} bytes at offset {}) exceeds its storage '{}' ({} bytes)",
        what,
        t.name,
        ts.file_nbytes(),
        t.offset,
        t.storage_key,
        info.nbytes
    );
    Ok(Some(ts))
}

fn zip_err(what: &str, e: zip::result::ZipError) -> Error {
    Error::new(format!("'{what}': invalid zip archive: {e}"))
}

/// Reads at most `limit` bytes of entry `idx`, failing if it is larger.
fn read_entry<R: Read + Seek>(zip: &mut ZipArchive<R>, idx: usize, limit: u64, what: &str) -> Result<Vec<u8>> {
    let entry = zip.by_index(idx).map_err(|e| zip_err(what, e))?;
    let name = entry.name().map(|n| n.to_string()).unwrap_or_default();
    ensure!(entry.size() <= limit, "'{}': zip entry '{}' is too large ({} bytes)", what, name, entry.size());
    let declared = entry.size();
    let mut buf = Vec::new();
    entry
        .take(declared + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("'{what}': reading zip entry '{name}'"))?;
    ensure!(
        buf.len() as u64 == declared,
        "'{}': zip entry '{}' holds {} bytes, its header says {}",
        what,
        name,
        buf.len(),
        declared
    );
    Ok(buf)
}

/// What we need to know about a storage entry of a torch zip.
#[derive(Clone, Copy)]
struct EntryInfo {
    index: usize,
    size: u64,
    compressed: u64,
    method: CompressionMethod,
    encrypted: bool,
    data_start: Option<u64>,
}

/// Lists the tensors of a torch zip checkpoint of `file_len` bytes.
pub fn read_zip<R: Read + Seek>(reader: R, file_len: u64, what: &str) -> Result<Vec<TensorStorage>> {
    let mut zip = ZipArchive::new(reader).map_err(|e| zip_err(what, e))?;
    let names: Vec<(usize, String)> = (0..zip.len())
        .filter_map(|i| zip.name_for_index(i).and_then(|n| n.ok()).map(|n| (i, n.to_string())))
        .collect();

    for (i, n) in &names {
        if n == "byteorder" || n.ends_with("/byteorder") {
            let order = read_entry(&mut zip, *i, 16, what)?;
            ensure!(
                order.trim_ascii() != b"big",
                "'{}' was saved on a big-endian machine; its data cannot be read here",
                what
            );
        }
    }

    let pickles: Vec<(usize, String)> = names.iter().filter(|(_, n)| n.contains("data.pkl")).cloned().collect();
    ensure!(!pickles.is_empty(), "data.pkl was not found in '{}'", what);

    let mut out = Vec::new();
    // Storages shared by many tensors are looked up once.
    let mut entries: std::collections::HashMap<String, EntryInfo> = std::collections::HashMap::new();
    for (idx, pkl_name) in pickles {
        let dir = &pkl_name[..pkl_name.find("data.pkl").expect("filtered")];
        let bytes = read_entry(&mut zip, idx, MAX_PICKLE_LEN, what)?;
        let sd = pickle::parse_state_dict(&bytes).map_err(|e| Error::new(format!("'{what}': {pkl_name}: {e}")))?;
        for t in &sd.tensors {
            let info = &sd.storages[&t.storage_key];
            let entry_name = format!("{dir}data/{}", t.storage_key);
            let EntryInfo { index: ei, size, compressed, method, encrypted, data_start } = match entries.get(&entry_name) {
                Some(e) => *e,
                None => {
                    let index = zip
                        .index_for_name(&entry_name)
                        .ok_or_else(|| Error::new(format!("'{what}': storage entry '{entry_name}' was not found")))?;
                    let entry = zip.by_index_raw(index).map_err(|e| zip_err(what, e))?;
                    let info = EntryInfo {
                        index,
                        size: entry.size(),
                        compressed: entry.compressed_size(),
                        method: entry.compression(),
                        encrypted: entry.encrypted(),
                        data_start: entry.data_start(),
                    };
                    drop(entry);
                    entries.insert(entry_name.clone(), info);
                    info
                }
            };
            ensure!(
                size >= info.nbytes,
                "'{}': storage entry '{}' ({} bytes) is smaller than the pickle says ({} bytes)",
                what,
                entry_name,
                size,
                info.nbytes
            );
            let Some(mut ts) = make_storage(t, info, what)? else { continue };
            ensure!(!encrypted, "'{}': storage entry '{}' is encrypted", what, entry_name);
            match method {
                CompressionMethod::Stored => {
                    let start = data_start.ok_or_else(|| Error::new(format!("'{what}': no data for '{entry_name}'")))?;
                    ensure!(
                        compressed == size && start.checked_add(size).is_some_and(|e| e <= file_len),
                        "'{}': storage entry '{}' extends beyond the end of the file",
                        what,
                        entry_name
                    );
                    ts.offset = start + t.offset;
                }
                CompressionMethod::Deflated => {
                    ts.offset = t.offset;
                    ts.zip_entry = Some(ei);
                }
                m => bail!("'{}': storage entry '{}' uses unsupported compression {:?}", what, entry_name, m),
            }
            out.push(ts);
        }
    }
    Ok(out)
}

/// Reads `buf.len()` bytes at `offset` of the uncompressed data of zip entry `idx`.
pub fn read_zip_range<R: Read + Seek>(zip: &mut ZipArchive<R>, idx: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
    let mut entry = zip.by_index(idx).map_err(|e| Error::new(format!("invalid zip entry: {e}")))?;
    let end = offset.checked_add(buf.len() as u64);
    ensure!(end.is_some_and(|e| e <= entry.size()), "tensor exceeds its zip storage entry");
    let skipped = std::io::copy(&mut (&mut entry).take(offset), &mut std::io::sink())?;
    ensure!(skipped == offset, "zip storage entry is shorter than declared");
    entry.read_exact(buf).context("zip storage entry is shorter than declared")?;
    Ok(())
}

/// The pickles at the start of a legacy file and where the storages begin.
struct LegacyHead {
    dict: StateDict,
    keys: Vec<String>,
    data_offset: u64,
}

fn parse_legacy_head(buf: &[u8]) -> std::result::Result<LegacyHead, PickleError> {
    use pickle::Simple;
    let bad = |m: &str| PickleError::Invalid(m.to_string());
    let mut off = 0usize;
    if let Ok((Simple::TorchMagic, n)) = pickle::eval_simple(buf) {
        off += n;
        match pickle::eval_simple(&buf[off..])? {
            (Simple::Int(1001), n) => off += n,
            _ => return Err(bad("unsupported legacy PyTorch protocol version")),
        }
        off += pickle::eval_simple(&buf[off..])?.1; // sys_info
    }
    let (dict, n) = pickle::parse_state_dict_prefix(&buf[off..])?;
    off += n;
    let (keys, n) = pickle::eval_simple(&buf[off..])?;
    off += n;
    let keys = match keys {
        Simple::StrList(k) => k,
        _ => return Err(bad("the storage key list of the legacy PyTorch file is missing")),
    };
    Ok(LegacyHead { dict, keys, data_offset: off as u64 })
}

fn first_bytes_hex(b: &[u8]) -> String {
    b.iter().take(16).map(|x| format!("{x:02X}")).collect::<Vec<_>>().join("-")
}

/// Lists the tensors of a legacy (pre-zip) torch checkpoint of `file_len` bytes.
pub fn read_legacy<R: Read + Seek>(r: &mut R, file_len: u64, what: &str) -> Result<Vec<TensorStorage>> {
    ensure!(file_len > 0, "empty file '{}'", what);
    let mut want = file_len.min(1 << 20);
    let head = loop {
        let mut buf = vec![0u8; want as usize];
        r.seek(SeekFrom::Start(0))?;
        r.read_exact(&mut buf).with_context(|| format!("failed to read '{what}'"))?;
        match parse_legacy_head(&buf) {
            Ok(h) => break h,
            Err(PickleError::Truncated) if want < file_len && want < MAX_LEGACY_HEAD => {
                want = (want * 4).min(file_len).min(MAX_LEGACY_HEAD);
            }
            Err(PickleError::Truncated) => bail!("'{}': truncated PyTorch checkpoint", what),
            Err(PickleError::Invalid(m)) => {
                let tar = buf.len() >= 262 && &buf[257..262] == b"ustar";
                if tar {
                    bail!("'{}': legacy tar PyTorch checkpoints are not supported", what);
                }
                if buf[0] != 0x80 {
                    bail!("'{}' is not a PyTorch checkpoint (first bytes {})", what, first_bytes_hex(&buf));
                }
                bail!("unsupported PyTorch file '{}': {}", what, m);
            }
        }
    };

    // Storages follow the pickles in key-list order, each behind an 8-byte element count.
    let mut starts = std::collections::HashMap::new();
    let mut cur = head.data_offset;
    for key in &head.keys {
        let info = head
            .dict
            .storages
            .get(key)
            .ok_or_else(|| Error::new(format!("'{what}': storage '{key}' is listed but never used")))?;
        ensure!(info.elem_size.is_some(), "'{}': storage '{}' has unknown type {}", what, key, info.type_name);
        ensure!(
            cur.checked_add(8).is_some_and(|e| e <= file_len),
            "'{}': truncated PyTorch checkpoint (storage '{}')",
            what,
            key
        );
        let mut n = [0u8; 8];
        r.seek(SeekFrom::Start(cur))?;
        r.read_exact(&mut n)?;
        let numel = u64::from_le_bytes(n);
        ensure!(
            numel == info.numel,
            "'{}': storage '{}' holds {} elements, the pickle says {}",
            what,
            key,
            numel,
            info.numel
        );
        let start = cur + 8;
        let end = start.checked_add(info.nbytes).filter(|&e| e <= file_len);
        let end = end.ok_or_else(|| Error::new(format!("'{what}': storage '{key}' extends beyond the end of the file")))?;
        starts.insert(key.as_str(), start);
        cur = end;
    }

    let mut out = Vec::new();
    for t in &head.dict.tensors {
        let info = &head.dict.storages[&t.storage_key];
        let start = *starts
            .get(t.storage_key.as_str())
            .ok_or_else(|| Error::new(format!("'{what}': storage '{}' of tensor '{}' is missing", t.storage_key, t.name)))?;
        if let Some(mut ts) = make_storage(t, info, what)? {
            ts.offset = start + t.offset;
            out.push(ts);
        }
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::io::pickle::tests::P;
    use crate::types::SdType;
    use std::io::{Cursor, Write};

    /// A torch zip: `archive/data.pkl` (tensors a: f16[2,3] in storage 0, b: f32[4] at
    /// element 1 of storage 1) and the storages, stored or deflated.
    pub fn zip_file(method: CompressionMethod) -> Vec<u8> {
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default().compression_method(method);
        w.start_file("archive/data.pkl", opts).unwrap();
        w.write_all(&crate::io::pickle::tests::sample()).unwrap();
        w.start_file("archive/byteorder", opts).unwrap();
        w.write_all(b"little").unwrap();
        w.start_file("archive/data/0", opts).unwrap();
        let h: Vec<u8> = (0..6u16).flat_map(|i| (0x3c00 + i).to_le_bytes()).collect();
        w.write_all(&h).unwrap();
        w.start_file("archive/data/1", opts).unwrap();
        let f: Vec<u8> = (0..5).flat_map(|i| (i as f32).to_le_bytes()).collect();
        w.write_all(&f).unwrap();
        w.finish().unwrap().into_inner()
    }

    /// A legacy file with the same tensors.
    pub fn legacy_file() -> Vec<u8> {
        let mut f = vec![0x80, 2, 0x8a, 10, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, b'.'];
        f.extend_from_slice(b"\x80\x02M\xe9\x03.");
        f.extend_from_slice(b"\x80\x02}q\x00.");
        f.extend_from_slice(&crate::io::pickle::tests::sample());
        let mut p = P::new();
        p.op(b"](").s("0").s("1").op(b"e");
        f.extend_from_slice(&p.done());
        f.extend_from_slice(&6u64.to_le_bytes());
        f.extend((0..6u16).flat_map(|i| (0x3c00 + i).to_le_bytes()));
        f.extend_from_slice(&5u64.to_le_bytes());
        f.extend((0..5).flat_map(|i| (i as f32).to_le_bytes()));
        f
    }

    #[test]
    fn zip_stored_and_deflated() {
        let f = zip_file(CompressionMethod::Stored);
        let ts = read_zip(Cursor::new(&f), f.len() as u64, "m.ckpt").unwrap();
        assert_eq!(ts.len(), 2);
        assert_eq!((ts[0].name(), ts[0].ty(), ts[0].shape()), ("a", SdType::F16, &[3i64, 2][..]));
        assert_eq!(&f[ts[1].offset() as usize..][..4], &1f32.to_le_bytes());
        assert_eq!(ts[1].zip_entry, None);

        let f = zip_file(CompressionMethod::Deflated);
        let ts = read_zip(Cursor::new(&f), f.len() as u64, "m.ckpt").unwrap();
        let idx = ts[1].zip_entry.unwrap();
        let mut zip = ZipArchive::new(Cursor::new(&f)).unwrap();
        let mut buf = [0u8; 16];
        read_zip_range(&mut zip, idx, ts[1].offset(), &mut buf).unwrap();
        assert_eq!(crate::io::dtype::f32_values(&buf), vec![1.0, 2.0, 3.0, 4.0]);
        assert!(read_zip_range(&mut zip, idx, 8, &mut buf).is_err());
    }

    #[test]
    fn legacy_layout() {
        let f = legacy_file();
        let ts = read_legacy(&mut Cursor::new(&f), f.len() as u64, "m.pt").unwrap();
        assert_eq!(ts.len(), 2);
        let a = ts[0].offset() as usize;
        assert_eq!(&f[a..a + 2], &0x3c00u16.to_le_bytes());
        let b = ts[1].offset() as usize;
        assert_eq!(&f[b..b + 4], &1f32.to_le_bytes());
    }

    #[test]
    fn hostile_torch_files() {
        let e = |f: &[u8]| read_legacy(&mut Cursor::new(f), f.len() as u64, "m.pt").unwrap_err().to_string();
        let f = legacy_file();
        assert!(e(&f[..f.len() - 1]).contains("beyond the end"));
        assert!(e(&f[..200]).contains("truncated"));
        assert!(e(b"hello world").contains("not a PyTorch checkpoint"));
        let mut tar = vec![0u8; 600];
        tar[257..262].copy_from_slice(b"ustar");
        assert!(e(&tar).contains("tar"));
        let mut bad = f.clone();
        let pos = f.len() - 20 - 8 - 12 - 8;
        bad[pos] = 7; // wrong element count in the first storage header
        assert!(e(&bad).contains("holds 7 elements"));

        let ez = |f: &[u8]| read_zip(Cursor::new(f), f.len() as u64, "m.ckpt").unwrap_err().to_string();
        assert!(ez(b"PK\x03\x04 not really").contains("invalid zip"));
        // missing storage entry / storage smaller than the pickle / data.pkl missing
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let o = zip::write::SimpleFileOptions::default().compression_method(CompressionMethod::Stored);
        w.start_file("archive/data.pkl", o).unwrap();
        w.write_all(&crate::io::pickle::tests::sample()).unwrap();
        w.start_file("archive/data/0", o).unwrap();
        w.write_all(&[0u8; 4]).unwrap();
        let f = w.finish().unwrap().into_inner();
        assert!(ez(&f).contains("smaller than the pickle"));
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        w.start_file("archive/data.pkl", o).unwrap();
        w.write_all(&crate::io::pickle::tests::sample()).unwrap();
        let f = w.finish().unwrap().into_inner();
        assert!(ez(&f).contains("was not found"));
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        w.start_file("archive/other", o).unwrap();
        let f = w.finish().unwrap().into_inner();
        assert!(ez(&f).contains("data.pkl was not found"));
        let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
        w.start_file("archive/byteorder", o).unwrap();
        w.write_all(b"big").unwrap();
        let f = w.finish().unwrap().into_inner();
        assert!(ez(&f).contains("big-endian"));
        // a deflated data.pkl that inflates beyond its declared size is refused (bomb)
        let f = zip_file(CompressionMethod::Deflated);
        let mut bomb = f.clone();
        let cd = bomb.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
        // uncompressed size field of the first central directory entry
        bomb[cd + 24..cd + 28].copy_from_slice(&3u32.to_le_bytes());
        assert!(read_zip(Cursor::new(&bomb), bomb.len() as u64, "m.ckpt").is_err());
    }
}
