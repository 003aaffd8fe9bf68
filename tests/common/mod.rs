//! Shared helpers of the C-API integration tests: the ABI manifest and defaults.json.
#![allow(dead_code)]

pub mod logs;
pub mod parity;

use serde_json::Value;
use std::path::{Path, PathBuf};

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The reference's ABI facts (tests/abi/stable-diffusion-abi.json).
pub fn manifest() -> Value {
    let text = std::fs::read_to_string(root().join("tests/abi/stable-diffusion-abi.json")).expect("ABI manifest");
    serde_json::from_str(&text).expect("ABI manifest is JSON")
}

/// tests/abi/defaults.json, whose bare `Infinity` / `NaN` tokens become strings.
pub fn defaults() -> Value {
    let text = std::fs::read_to_string(root().join("tests/abi/defaults.json")).expect("defaults.json");
    let text = text
        .replace(": -Infinity", ": \"-Infinity\"")
        .replace(": Infinity", ": \"Infinity\"")
        .replace(": NaN", ": \"NaN\"");
    serde_json::from_str(&text).expect("defaults.json is JSON (after quoting Infinity)")
}

/// The value of a named enum constant in the manifest.
pub fn enum_constant(manifest: &Value, name: &str) -> Option<i64> {
    manifest["enums"].as_object()?.values().find_map(|e| {
        e["constants"].as_array()?.iter().find(|c| c["name"] == name).and_then(|c| c["value"].as_i64())
    })
}

/// The folder holding the built libstable_diffusion.{so,a} (target/<profile>).
pub fn artifact_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}
