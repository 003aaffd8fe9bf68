//! Test-only: synthetic text-encoder weights and the numpy reference model
//! (`tests/tools/clip_reference.py`), plus a small safetensors loader with the checkpoint →
//! internal name mapping of the text encoders (what `io`'s conversion must also produce).

use crate::testutil::f16_to_f32;
use crate::error::{Context as _, Result};
use crate::graph::{GgmlType, ParamStore, TypeMap, F16, F32};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tools/clip_reference.py");

pub use crate::testutil::fixture_cache;

/// A python with numpy: the fixture generator's virtual environment (`SD_FIXTURE_VENV`,
/// default `target/fixture-venv`), else python3; None when none has numpy.
pub fn numpy_python() -> Option<PathBuf> {
    let venv = std::env::var_os("SD_FIXTURE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::testutil::repo().join("target/fixture-venv"));
    [venv.join("bin/python"), PathBuf::from("python3")].into_iter().find(|py| {
        Command::new(py).args(["-c", "import numpy"]).status().map(|s| s.success()).unwrap_or(false)
    })
}

/// Whether python3 with numpy can run the reference script; tests skip without it.
pub fn have_numpy() -> bool {
    if !crate::testutil::model_tests_enabled("CLIP vs numpy") {
        return false;
    }
    let ok = Command::new(crate::testutil::numpy_python()).args(["-c", "import numpy"]).status().map(|s| s.success()).unwrap_or(false);
    if !ok {
        eprintln!("skipping: python3 with numpy is needed for the CLIP reference");
    }
    ok
}

/// `clip_<arch>.safetensors` in the fixture cache (text-encoder tensors only, same names
/// and bytes as the full synthetic checkpoint), written on first use.
pub fn clip_weights(arch: &str) -> PathBuf {
    let dir = fixture_cache();
    std::fs::create_dir_all(&dir).expect("fixture cache");
    let path = dir.join(format!("clip_{arch}.safetensors"));
    if !path.exists() {
        run_script(&["weights", arch, path.to_str().expect("utf-8 path")]);
    }
    path
}

fn run_script(args: &[&str]) {
    let st = Command::new(crate::testutil::numpy_python()).arg(SCRIPT).args(args).status().expect("python3");
    assert!(st.success(), "clip_reference.py {args:?} failed");
}

/// Runs the numpy model on `cases` (see the script) and returns each case's output.
pub fn reference(arch: &str, weights: &Path, cases: &serde_json::Value) -> Vec<Vec<f32>> {
    run_cases(&format!("clip-{arch}"), cases, |cases_path, dir| {
        run_script(&["run", arch, weights.to_str().unwrap(), cases_path.to_str().unwrap(), dir.to_str().unwrap()]);
    })
}

/// Writes `cases` (a JSON list of objects with a "name") to `cases.json` in a fresh temporary
/// directory, lets `run(cases.json, dir)` write `dir/NAME.f32` for each, and reads them back.
pub fn run_cases(tag: &str, cases: &serde_json::Value, run: impl FnOnce(&Path, &Path)) -> Vec<Vec<f32>> {
    let dir = std::env::temp_dir().join(format!("sd-rs-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases_path = dir.join("cases.json");
    std::fs::write(&cases_path, cases.to_string()).unwrap();
    run(&cases_path, &dir);
    let out = cases
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let bytes = std::fs::read(dir.join(format!("{}.f32", c["name"].as_str().unwrap()))).unwrap();
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// Checkpoint name → internal name for the text encoders of SD 1.x / 2.x / SDXL files
/// (HF CLIP names pass through; OpenCLIP names are renamed, q/k/v stay fused).
pub fn internal_name(name: &str) -> Option<String> {
    const PREFIXES: [(&str, &str); 3] = [
        ("conditioner.embedders.0.", "cond_stage_model."),
        ("conditioner.embedders.1.", "cond_stage_model.1."),
        ("cond_stage_model.", "cond_stage_model."),
    ];
    let (rest, prefix) = PREFIXES.iter().find_map(|(f, i)| name.strip_prefix(f).map(|r| (r, *i)))?;
    let rest = match rest.strip_prefix("model.") {
        Some(open_clip) => open_clip_name(open_clip)?,
        None => rest.to_string(),
    };
    Some(format!("{prefix}{rest}"))
}

fn open_clip_name(rest: &str) -> Option<String> {
    const TOP: [(&str, &str); 5] = [
        ("token_embedding.weight", "embeddings.token_embedding.weight"),
        ("positional_embedding", "embeddings.position_embedding.weight"),
        ("ln_final.weight", "final_layer_norm.weight"),
        ("ln_final.bias", "final_layer_norm.bias"),
        ("text_projection", "text_projection"),
    ];
    const BLOCK: [(&str, &str); 7] = [
        ("attn.in_proj_weight", "self_attn.in_proj.weight"),
        ("attn.in_proj_bias", "self_attn.in_proj.bias"),
        ("attn.out_proj.", "self_attn.out_proj."),
        ("ln_1.", "layer_norm1."),
        ("ln_2.", "layer_norm2."),
        ("mlp.c_fc.", "mlp.fc1."),
        ("mlp.c_proj.", "mlp.fc2."),
    ];
    if let Some((_, to)) = TOP.iter().find(|(from, _)| *from == rest) {
        return Some(format!("transformer.text_model.{to}"));
    }
    let block = rest.strip_prefix("transformer.resblocks.")?;
    let (idx, suffix) = block.split_once('.')?;
    let (from, to) = BLOCK.iter().find(|(from, _)| suffix.starts_with(from))?;
    Some(format!("transformer.text_model.encoder.layers.{idx}.{to}{}", &suffix[from.len()..]))
}

struct FileTensor {
    ty: GgmlType,
    shape: Vec<i64>,
    offset: u64,
    len: usize,
}

/// A safetensors file's tensors under their internal names.
pub struct Weights {
    file: File,
    tensors: HashMap<String, FileTensor>,
}

impl Weights {
    pub fn open(path: &Path) -> Result<Weights> {
        Self::open_mapped(path, internal_name)
    }

    /// The tensors `internal` gives a name for, under that name.
    pub fn open_mapped(path: &Path, internal: impl Fn(&str) -> Option<String>) -> Result<Weights> {
        let file = File::open(path).with_context(|| format!("{}", path.display()))?;
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)?;
        let n = u64::from_le_bytes(n) as usize;
        let mut header = vec![0u8; n];
        file.read_exact_at(&mut header, 8)?;
        let header: serde_json::Value = serde_json::from_slice(&header).context("safetensors header")?;
        let mut tensors = HashMap::new();
        for (name, info) in header.as_object().context("header is not an object")? {
            if name == "__metadata__" {
                continue;
            }
            let ty = match info["dtype"].as_str() {
                Some("F16") => F16,
                Some("F32") => F32,
                other => bail!("{name}: unsupported dtype {other:?}"),
            };
            let shape = info["shape"].as_array().context("shape")?.iter().map(|d| d.as_i64().unwrap()).collect();
            let off = info["data_offsets"].as_array().context("offsets")?;
            let (a, b) = (off[0].as_u64().unwrap(), off[1].as_u64().unwrap());
            let Some(internal) = internal(name) else { continue };
            tensors.insert(internal, FileTensor { ty, shape, offset: 8 + n as u64 + a, len: (b - a) as usize });
        }
        Ok(Weights { file, tensors })
    }

    /// Shape of a tensor in ggml order.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        self.tensors.get(name).map(|t| t.shape.iter().rev().copied().collect())
    }

    pub fn types(&self) -> TypeMap {
        self.tensors.iter().map(|(n, t)| (n.clone(), t.ty)).collect()
    }

    /// Fills every declared tensor of an allocated store, converting f16 ↔ f32.
    pub fn load_into(&self, store: &mut ParamStore) -> Result<()> {
        store.load(|name, spec, dst| {
            let t = self.tensors.get(name).with_context(|| format!("{name} missing from the file"))?;
            let ne: Vec<i64> = t.shape.iter().rev().copied().collect();
            ensure!(ne == spec.ne, "{name}: file shape {:?}, declared {:?}", ne, spec.ne);
            let mut raw = vec![0u8; t.len];
            self.file.read_exact_at(&mut raw, t.offset)?;
            match (t.ty, spec.ty) {
                (a, b) if a == b => dst.copy_from_slice(&raw),
                (F16, F32) => {
                    for (d, s) in dst.chunks_exact_mut(4).zip(raw.chunks_exact(2)) {
                        d.copy_from_slice(&f16_to_f32(u16::from_le_bytes([s[0], s[1]])).to_le_bytes());
                    }
                }
                (a, b) => bail!("{name}: cannot convert ggml type {a} to {b}"),
            }
            Ok(())
        })
    }
}


#[test]
fn open_clip_names_map_to_internal_ones() {
    let m = |n: &str| internal_name(n).unwrap();
    assert_eq!(
        m("cond_stage_model.model.transformer.resblocks.7.attn.in_proj_weight"),
        "cond_stage_model.transformer.text_model.encoder.layers.7.self_attn.in_proj.weight"
    );
    assert_eq!(
        m("conditioner.embedders.1.model.transformer.resblocks.0.mlp.c_proj.bias"),
        "cond_stage_model.1.transformer.text_model.encoder.layers.0.mlp.fc2.bias"
    );
    assert_eq!(
        m("conditioner.embedders.1.model.positional_embedding"),
        "cond_stage_model.1.transformer.text_model.embeddings.position_embedding.weight"
    );
    assert_eq!(
        m("conditioner.embedders.0.transformer.text_model.final_layer_norm.bias"),
        "cond_stage_model.transformer.text_model.final_layer_norm.bias"
    );
    assert_eq!(f16_to_f32(0x3C00), 1.0);
    assert_eq!(f16_to_f32(0xC000), -2.0);
    assert_eq!(f16_to_f32(0x0001), 5.960_464_5e-8);
}
