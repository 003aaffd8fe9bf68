//! `convert` against the reference's conversions of the synthetic sd1 checkpoint
//! (tests/fixtures/convert/sd1_{q8_0,q4_K,f16}.json: names, types and shapes).
//!
//! The plan (which type each tensor gets) is checked from the checkpoint's tensor list;
//! the full conversion of the 2 GB synthetic file runs with SD_PARITY set (the file is
//! generated into the fixture cache if missing).

mod io_common;

use serde_json::Value;
use stable_diffusion::io::convert::{plan, OutputFormat, PlannedTensor};
use stable_diffusion::io::{ModelFiles, ModelSource, SdVersion, SourceDtype, TensorStorage, TypeRules};
use stable_diffusion::types::SdType;

fn fixture(ty: &str) -> Vec<PlannedTensor> {
    let path = format!("{}/tests/fixtures/convert/sd1_{ty}.json", env!("CARGO_MANIFEST_DIR"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| PlannedTensor {
            name: t["name"].as_str().unwrap().to_string(),
            ty: SdType::ALL.iter().copied().find(|s| s.name().eq_ignore_ascii_case(t["type"].as_str().unwrap())).unwrap(),
            shape: t["shape"].as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect(),
        })
        .collect()
}

fn compare(got: &[PlannedTensor], want: &[PlannedTensor], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: tensor count");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g, w, "{what}");
    }
}

#[test]
fn plan_matches_reference_for_sd1() {
    let Some(mut list) = io_common::synth_list("sd1") else {
        eprintln!("skipping: python3 with numpy is needed to list the synthetic sd1 checkpoint");
        return;
    };
    list.sort_by(|a, b| a.0.cmp(&b.0));
    let tensors: Vec<TensorStorage> =
        list.iter().map(|(n, ne)| TensorStorage::new(n.clone(), SdType::F16, ne, SourceDtype::Native).unwrap()).collect();
    for (name, ty) in [("q8_0", SdType::Q8_0), ("q4_K", SdType::Q4K), ("f16", SdType::F16)] {
        let p = plan(&tensors, Some(ty), &TypeRules::default(), OutputFormat::Gguf).unwrap();
        // GGUF drops trailing 1-dimensions, as ggml's writer does.
        let p: Vec<PlannedTensor> = p
            .into_iter()
            .map(|mut t| {
                while t.shape.len() > 1 && t.shape.last() == Some(&1) {
                    t.shape.pop();
                }
                t
            })
            .collect();
        compare(&p, &fixture(name), name);
    }
}

#[test]
fn full_conversion_matches_reference_for_sd1() {
    let Some(src) = io_common::synth_file("sd1", "sd1.safetensors") else { return };
    let out_dir = std::env::temp_dir().join(format!("sd-io-convert-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    for (name, ty) in [("q8_0", SdType::Q8_0), ("q4_K", SdType::Q4K), ("f16", SdType::F16)] {
        let out = out_dir.join(format!("sd1_{name}.gguf"));
        stable_diffusion::io::convert(&[ModelSource::new(&src, "")], &out, Some(ty), "", false, 2).unwrap();
        let m = ModelFiles::open(&[ModelSource::new(&out, "")]).unwrap();
        let got: Vec<PlannedTensor> = m
            .tensors()
            .iter()
            .map(|t| PlannedTensor { name: t.name().to_string(), ty: t.ty(), shape: t.shape().to_vec() })
            .collect();
        compare(&got, &fixture(name), name);
        assert_eq!(m.detect_version(), Some(SdVersion::Sd1));
        std::fs::remove_file(&out).unwrap();
    }
    std::fs::remove_dir_all(&out_dir).unwrap();
}
