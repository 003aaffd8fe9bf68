//! Helpers shared by the unit tests of several layers (test builds only).

use std::path::PathBuf;
use std::process::Command;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where synthetic checkpoints are cached (never inside the repository).
pub fn fixture_cache() -> PathBuf {
    match std::env::var_os("SD_FIXTURE_CACHE") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures"),
    }
}

/// Network-vs-numpy comparisons on full-size synthetic weights take minutes each: they run
/// with `SD_MODEL_TESTS=1` or `SD_PARITY=full`, and are skipped (with a note) otherwise.
pub fn model_tests_enabled(what: &str) -> bool {
    let on = std::env::var("SD_MODEL_TESTS").as_deref() == Ok("1") || std::env::var("SD_PARITY").as_deref() == Ok("full");
    if !on {
        eprintln!("skipped {what}: set SD_MODEL_TESTS=1 (or SD_PARITY=full) to run it");
    }
    on
}

/// Asserts `got` is finite and within `rel` × max |want| of `want` everywhere (networks
/// with f16 weights against a float numpy model), printing the error it found.
pub fn assert_close_rel(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{what}: max |err| {err:.3e}, max |ref| {scale:.3}");
    assert!(err <= rel * scale, "{what}: max |err| {err} > {rel} * {scale}");
}

/// `file` of tests/fixtures/recipes.tsv in the fixture cache, made on first use by
/// `scripts/fixtures.sh` (one writer per file across threads and processes, numpy in its
/// own virtual environment). The error carries the script's message.
pub fn synthetic_fixture(file: &str) -> std::io::Result<PathBuf> {
    let path = fixture_cache().join(file);
    if path.exists() {
        mark_used(&path);
        return Ok(path);
    }
    let out = Command::new(repo().join("scripts/fixtures.sh"))
        .arg(file)
        .output()
        .map_err(|e| std::io::Error::other(format!("cannot run scripts/fixtures.sh: {e}")))?;
    if !out.status.success() || !path.exists() {
        return Err(std::io::Error::other(format!(
            "scripts/fixtures.sh {file} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(path)
}

/// Stamps `path`'s access time: `scripts/fixtures.sh` removes the least recently used
/// fixtures first when the disk runs short, and a relatime mount alone would not say.
pub fn mark_used(path: &std::path::Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.set_times(std::fs::FileTimes::new().set_accessed(std::time::SystemTime::now()));
    }
}

/// A python with numpy: the fixture environment `scripts/fixtures.sh --python` makes once
/// (so a plain `cargo test` finds numpy too), or `python3` when that cannot be made.
pub fn numpy_python() -> PathBuf {
    static PY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PY.get_or_init(|| {
        let out = Command::new(repo().join("scripts/fixtures.sh")).arg("--python").output();
        match out {
            Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
            _ => PathBuf::from("python3"),
        }
    })
    .clone()
}

/// Exact f16 ↔ f32 conversions (round to nearest even), shared with the CPU kernels.
pub(crate) use crate::graph::gemm::scalar::{f16_to_f32, f32_to_f16};

/// `n` deterministic values in [-1, 1) (an xorshift sequence from `seed`).
pub fn pattern(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// 32-byte aligned bytes standing in for a mapped model file (ggml wraps only aligned
/// memory): `len` zero bytes with `bytes` at offset `at`.
pub struct MappedBytes(Vec<Block32>);

#[repr(C, align(32))]
#[derive(Clone, Copy)]
struct Block32([u8; 32]);

impl MappedBytes {
    pub fn new(len: usize, at: usize, bytes: &[u8]) -> MappedBytes {
        let mut m = MappedBytes(vec![Block32([0; 32]); len.div_ceil(32)]);
        // SAFETY: plain bytes, 32 per block, exclusively borrowed here.
        let all = unsafe { std::slice::from_raw_parts_mut(m.0.as_mut_ptr() as *mut u8, m.0.len() * 32) };
        all[at..at + bytes.len()].copy_from_slice(bytes);
        m
    }
}

impl AsRef<[u8]> for MappedBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: plain bytes, 32 per block.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.0.len() * 32) }
    }
}

#[test]
fn half_conversions_round_trip() {
    for h in [0u16, 0x3c00, 0xbc00, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0x3555] {
        assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#x}");
    }
    assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie → even
    assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02);
    assert_eq!(f32_to_f16(1e6), 0x7c00);
}
