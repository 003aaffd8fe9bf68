//! Entry points for the fuzz targets in `fuzz/` (and the `cargo test` smoke run over the
//! same seeds): each parses untrusted bytes the way loading a file would, then reads the
//! data of every (small) tensor. They must return normally for any input; a panic, an
//! abort or a hang is a bug. The invariants the readers promise are asserted here.

use super::storage::TensorStorage;
use super::{dtype, gguf, pickle, safetensors, torch};
use crate::types::SdType;
use std::io::Cursor;

/// Tensors above this size are listed but their data is not converted (keeps runs fast).
const MAX_CONVERT_BYTES: u64 = 1 << 20;

/// Checks a listed tensor lies inside `data` and converts its bytes like a load would.
fn exercise(data: &[u8], ts: &TensorStorage) {
    let len = ts.file_nbytes();
    let start = ts.offset();
    let end = start.checked_add(len).expect("reader returned an overflowing range");
    assert!(end <= data.len() as u64, "reader returned data beyond the file: {}", ts.describe());
    if ts.nbytes() > MAX_CONVERT_BYTES {
        return;
    }
    convert_bytes(&data[start as usize..end as usize], ts);
}

fn convert_bytes(raw: &[u8], ts: &TensorStorage) {
    let mut stored = vec![0u8; ts.nbytes() as usize];
    dtype::decode_source(ts.source(), raw, &mut stored).expect("sizes agreed by the reader");
    let (row, rows) = ts.rows();
    if dtype::can_dequantize(ts.ty()) {
        let mut f = vec![0u8; ts.nelements() as usize * 4];
        dtype::convert_rows(&stored, ts.ty(), &mut f, SdType::F32, rows, row).expect("dequantize");
        if row % 32 == 0 {
            let mut q = vec![0u8; ts.nbytes_as(SdType::Q8_0).expect("whole blocks") as usize];
            dtype::convert_rows(&f, SdType::F32, &mut q, SdType::Q8_0, rows, row).expect("quantize");
        }
    }
}

pub fn safetensors_bytes(data: &[u8]) {
    if let Ok(st) = safetensors::read(&mut Cursor::new(data), data.len() as u64, "fuzz.safetensors") {
        for ts in &st.tensors {
            exercise(data, ts);
        }
    }
}

pub fn gguf_bytes(data: &[u8]) {
    if let Ok(g) = gguf::read(&mut Cursor::new(data), data.len() as u64, "fuzz.gguf") {
        assert!(g.data_offset % g.alignment == 0);
        for ts in &g.tensors {
            exercise(data, ts);
        }
    }
}

pub fn pickle_bytes(data: &[u8]) {
    if let Ok(sd) = pickle::parse_state_dict(data) {
        for t in &sd.tensors {
            assert!(sd.storages.contains_key(&t.storage_key));
        }
    }
}

pub fn torch_legacy_bytes(data: &[u8]) {
    if let Ok(tensors) = torch::read_legacy(&mut Cursor::new(data), data.len() as u64, "fuzz.pt") {
        for ts in &tensors {
            exercise(data, ts);
        }
    }
}

pub fn torch_zip_bytes(data: &[u8]) {
    let Ok(tensors) = torch::read_zip(Cursor::new(data), data.len() as u64, "fuzz.ckpt") else { return };
    let mut zip = None;
    for ts in &tensors {
        match ts.zip_entry() {
            None => exercise(data, ts),
            Some(entry) => {
                if ts.nbytes() > MAX_CONVERT_BYTES {
                    continue;
                }
                if zip.is_none() {
                    zip = zip::ZipArchive::new(Cursor::new(data)).ok();
                }
                let Some(z) = zip.as_mut() else { return };
                let mut raw = vec![0u8; ts.file_nbytes() as usize];
                if torch::read_zip_range(z, entry, ts.offset(), &mut raw).is_ok() {
                    convert_bytes(&raw, ts);
                }
            }
        }
    }
}

/// Whichever reader the bytes look like, as a file of unknown type would be.
pub fn any_bytes(data: &[u8]) {
    safetensors_bytes(data);
    gguf_bytes(data);
    pickle_bytes(data);
    torch_legacy_bytes(data);
    torch_zip_bytes(data);
}
