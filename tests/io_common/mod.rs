//! Helpers shared by the io integration tests: the synthetic checkpoints of
//! tests/fixtures/synth_model.py, listed or generated into the fixture cache.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/synth_model.py"))
}

/// Where generated checkpoints live: `$SD_FIXTURE_CACHE` or `~/.cache/sd-rs-fixtures`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("SD_FIXTURE_CACHE") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures"),
    }
}

/// Names and ggml shapes of a synthetic checkpoint (`synth_model.py list ARCH`), or `None`
/// when python3/numpy are not available.
pub fn synth_list(arch: &str) -> Option<Vec<(String, Vec<i64>)>> {
    let out = Command::new(numpy_python()).arg(script()).arg("list").arg(arch).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let mut v = Vec::new();
    for line in text.lines() {
        let (name, shape) = line.split_once(" [")?;
        let shape = shape.trim_end_matches(']');
        let mut dims: Vec<i64> = shape.split(", ").filter(|s| !s.is_empty()).map(|d| d.parse().unwrap()).collect();
        dims.reverse();
        v.push((name.to_string(), dims));
    }
    Some(v)
}

/// The synthetic checkpoint `file` (e.g. "sd1.safetensors") of `arch` from the cache,
/// generated there if missing. Tests on these multi-GB files are slow, so they run only
/// when `SD_PARITY` is set; otherwise this returns `None` (skip).
pub fn synth_file(arch: &str, file: &str) -> Option<PathBuf> {
    let path = cache_dir().join(file);
    if std::env::var_os("SD_PARITY").is_none() {
        eprintln!("skipping: set SD_PARITY=1 to run the tests on {}", path.display());
        return None;
    }
    if path.exists() {
        return Some(path);
    }
    std::fs::create_dir_all(cache_dir()).unwrap();
    let tmp = path.with_extension("partial.safetensors");
    let status = Command::new(numpy_python()).arg(script()).arg(arch).arg(&tmp).status().expect("python3");
    assert!(status.success(), "synth_model.py {arch} failed");
    std::fs::rename(&tmp, &path).unwrap();
    Some(path)
}

/// A synthetic checkpoint already in the fixture cache (nothing is generated).
pub fn cached_file(file: &str) -> Option<PathBuf> {
    let path = cache_dir().join(file);
    path.exists().then_some(path)
}

/// The fixture environment's python (numpy), made once by `scripts/fixtures.sh --python`.
fn numpy_python() -> PathBuf {
    static PY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PY.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures.sh");
        match Command::new(script).arg("--python").output() {
            Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
            _ => PathBuf::from("python3"),
        }
    })
    .clone()
}
