//! Quantization with an importance matrix (`load_imatrix`, then `convert_with_components`)
//! against the reference's bytes (`golden/imatrix-quant/`: the imatrix the reference collected
//! on a Z-Image run, and the digests of every tensor of its conversions to six types).
//! Its own process: the loaded imatrix is process-wide.

mod common;

use common::parity::fixture;
use serde_json::Value;
use stable_diffusion::capi::*;
use std::ffi::CString;
use std::path::Path;
use std::process::Command;

/// `SD_TYPE_*` of a type name of the golden file.
fn sd_type(name: &str) -> sd_type_t {
    let code = match name {
        "q4_0" => 2,
        "q5_1" => 7,
        "q4_K" => 12,
        "q3_K" => 11,
        "q6_K" => 14,
        "iq4_nl" => 20,
        other => panic!("no type {other}"),
    };
    sd_type_t(code)
}

/// The tensors of a GGUF file with their digests, as the golden tool lists them.
fn digests(gguf: &Path) -> Value {
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tools/imatrix_golden.py");
    let out = Command::new("python3").arg(tool).args(["digest", "--out"]).arg(gguf).output().expect("python3");
    assert!(out.status.success(), "digest failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn imatrix_quantization_matches_reference() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/imatrix-quant");
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let model = CString::new(fixture("z_image.safetensors").to_string_lossy().as_bytes()).unwrap();
    let imatrix = CString::new(dir.join("zimage.imatrix").to_string_lossy().as_bytes()).unwrap();
    // SAFETY: NUL-terminated path alive during the call.
    assert!(unsafe { load_imatrix(imatrix.as_ptr()) }.0 != 0, "load_imatrix failed");
    let tmp = std::env::temp_dir().join(format!("sd-imatrix-quant-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut failures = Vec::new();
    for conv in golden["conversions"].as_array().unwrap() {
        let ty = conv["type"].as_str().unwrap();
        let out = tmp.join(format!("{ty}.gguf"));
        let out_c = CString::new(out.to_string_lossy().as_bytes()).unwrap();
        let null = std::ptr::null();
        // SAFETY: NUL-terminated strings alive during the call; NULLs where optional.
        let ok = unsafe { convert_with_components(null, null, null, null, model.as_ptr(), null, out_c.as_ptr(), sd_type(ty), null, CBool::FALSE, 2) };
        assert!(ok.0 != 0, "convert to {ty} failed");
        let got = digests(&out);
        let want = conv["tensors"].as_array().unwrap();
        assert_eq!(got.as_array().unwrap().len(), want.len(), "{ty}: tensor count");
        for (g, w) in got.as_array().unwrap().iter().zip(want) {
            if g != w {
                failures.push(format!("{ty}: {} ({}) differs", w["name"], w["type"]));
            }
        }
        std::fs::remove_file(&out).unwrap();
    }
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(failures.is_empty(), "{} tensors differ from the reference's:\n{}", failures.len(), failures.join("\n"));
}
