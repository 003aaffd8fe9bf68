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

/// `file` in the fixture cache, written by `tests/fixtures/synth_model.py ARCH` on first use
/// (to a temporary name, then renamed: other test processes may look for it concurrently).
pub fn synthetic_fixture(arch: &str, file: &str) -> std::io::Result<PathBuf> {
    let dir = fixture_cache();
    let path = dir.join(file);
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir)?;
    let tmp = dir.join(format!("{file}.tmp.{}", std::process::id()));
    let status = Command::new("python3").arg(repo().join("tests/fixtures/synth_model.py")).arg(arch).arg(&tmp).status()?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(std::io::Error::other(format!("synth_model.py {arch} failed ({status})")));
    }
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}
