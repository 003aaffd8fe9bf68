//! UNet checks against an independent numpy model (tests/tools/unet_ref.py) on the
//! synthetic checkpoints of tests/fixtures/synth_model.py.
//!
//! Weights come from `$SD_FIXTURE_CACHE` (default `~/.cache/sd-rs-fixtures`):
//! `sd1-unet.safetensors` or `sd1.safetensors`, and `sd2.safetensors`. Without them the
//! numeric tests are skipped, unless `SD_PARITY=full`, which generates `sd1-unet`.
//! Checkpoint names are already the reference's internal UNet names
//! (`model.diffusion_model.…`, LDM layout), so no name mapping is needed.

use crate::testutil::f16_to_f32;
use crate::models::condition::Condition;
use super::*;
use crate::graph::{Backend, GgmlType, ParamStore, TypeMap, F16, F32};
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const PREFIX: &str = "model.diffusion_model.";

use crate::testutil::repo;

fn cache_dir() -> PathBuf {
    crate::testutil::fixture_cache()
}

/// One tensor of a safetensors file: type, ggml-order shape, byte range.
struct Entry {
    ty: GgmlType,
    ne: Vec<i64>,
    start: u64,
    len: usize,
}

/// Header of a safetensors file, read without loading the (multi-GB) data.
struct SafeTensorsFile {
    path: PathBuf,
    entries: HashMap<String, Entry>,
}

impl SafeTensorsFile {
    fn open(path: &Path) -> Result<SafeTensorsFile> {
        let mut f = std::fs::File::open(path)?;
        let mut n = [0u8; 8];
        f.read_exact(&mut n)?;
        let n = u64::from_le_bytes(n);
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header)?;
        let json: serde_json::Value = serde_json::from_slice(&header).context("safetensors header")?;
        let mut entries = HashMap::new();
        for (name, v) in json.as_object().context("safetensors header is not an object")? {
            if name == "__metadata__" {
                continue;
            }
            let ty = match v["dtype"].as_str() {
                Some("F16") => F16,
                Some("F32") => F32,
                other => bail!("{name}: unsupported dtype {other:?}"),
            };
            let mut ne: Vec<i64> = v["shape"].as_array().context("shape")?.iter().map(|d| d.as_i64().unwrap_or(0)).collect();
            ne.reverse();
            let off = v["data_offsets"].as_array().context("offsets")?;
            let (a, b) = (off[0].as_u64().unwrap_or(0), off[1].as_u64().unwrap_or(0));
            entries.insert(name.clone(), Entry { ty, ne, start: 8 + n + a, len: (b - a) as usize });
        }
        Ok(SafeTensorsFile { path: path.to_path_buf(), entries })
    }

    fn types(&self) -> TypeMap {
        self.entries.iter().map(|(k, e)| (k.clone(), e.ty)).collect()
    }

    fn shape_of(&self, name: &str) -> Option<Vec<i64>> {
        self.entries.get(name).map(|e| e.ne.clone())
    }

    /// Fills every declared tensor, converting f16 data to f32 where declared so.
    fn load_into(&self, store: &mut ParamStore) -> Result<()> {
        let mut f = std::fs::File::open(&self.path)?;
        let mut buf = Vec::new();
        store.load(|name, spec, dst| {
            let e = self.entries.get(name).with_context(|| format!("{name} missing from {}", self.path.display()))?;
            let n: i64 = spec.ne.iter().product();
            ensure!(e.ne.iter().product::<i64>() == n, "{name}: file shape {:?}, declared {:?}", e.ne, spec.ne);
            buf.resize(e.len, 0);
            f.seek(SeekFrom::Start(e.start))?;
            f.read_exact(&mut buf)?;
            match (e.ty, spec.ty) {
                (a, b) if a == b => dst.copy_from_slice(&buf),
                (F16, F32) => {
                    for (o, c) in dst.chunks_exact_mut(4).zip(buf.chunks_exact(2)) {
                        o.copy_from_slice(&f16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_le_bytes());
                    }
                }
                (a, b) => bail!("{name}: cannot convert ggml type {a} to {b}"),
            }
            Ok(())
        })
    }
}


/// Deterministic values in [-amp, amp).
fn pseudo_random(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64, amp: f32) -> Tensor {
    Tensor::from_vec(shape, pseudo_random(shape.iter().product(), seed, amp)).unwrap()
}

/// A synthetic checkpoint from the cache; generated under SD_PARITY=full when `gen` names
/// a synth_model.py architecture.
fn fixture(candidates: &[&str], gen: Option<&str>) -> Option<PathBuf> {
    if !crate::testutil::model_tests_enabled("UNet vs numpy") {
        return None;
    }
    let dir = cache_dir();
    if let Some(p) = candidates.iter().map(|c| dir.join(c)).find(|p| p.exists()) {
        return Some(p);
    }
    let arch = gen?;
    if std::env::var("SD_PARITY").as_deref() != Ok("full") {
        return None;
    }
    std::fs::create_dir_all(&dir).ok()?;
    let out = dir.join(format!("{arch}.safetensors"));
    let tmp = dir.join(format!("{arch}.safetensors.tmp{}", std::process::id()));
    let ok = Command::new(crate::testutil::numpy_python())
        .arg(repo().join("tests/fixtures/synth_model.py"))
        .arg(arch)
        .arg(&tmp)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        return None;
    }
    std::fs::rename(&tmp, &out).ok()?;
    Some(out)
}

fn load_unet(path: &Path, backend: &Arc<Backend>) -> (ParamStore, UNetModel) {
    let file = SafeTensorsFile::open(path).unwrap();
    let types = file.types();
    let cfg = UNetConfig::detect(&|n| file.shape_of(n), PREFIX, None).unwrap();
    let mut store = ParamStore::new(4096).unwrap();
    let unet = UNetModel::new(&mut Scope::new(&mut store, &types, PREFIX), &cfg);
    store.alloc(backend).unwrap();
    file.load_into(&mut store).unwrap();
    (store, unet)
}

struct Case {
    x: Tensor,
    timesteps: Vec<f32>,
    context: Tensor,
    controls: Vec<Tensor>,
    control_strength: f32,
}

impl Case {
    /// A `side`×`side` latent of batch 1 with a 77-token context, without control.
    fn single(side: usize, context_dim: usize, seed: u64, t: f32) -> Case {
        Case {
            x: tensor(&[side, side, 4, 1], seed, 1.0),
            timesteps: vec![t],
            context: tensor(&[context_dim, 77, 1], seed + 1, 1.0),
            controls: vec![],
            control_strength: 1.0,
        }
    }
}

/// Runs the numpy model on `case` (saving every block's output in `dir` with `dump_blocks`);
/// None when python3/numpy are unavailable.
fn numpy_expected(weights: &Path, variant: &str, case: &Case, dir: &Path, dump_blocks: bool) -> Option<Vec<f32>> {
    std::fs::create_dir_all(dir).unwrap();
    let write = |name: &str, data: &[f32], torch_shape: Vec<usize>| {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join(name), bytes).unwrap();
        serde_json::json!({ "file": name, "shape": torch_shape })
    };
    let torch = |t: &Tensor, rank: usize| (0..rank).rev().map(|i| t.ne(i)).collect::<Vec<_>>();
    let controls: Vec<_> =
        case.controls.iter().enumerate().map(|(i, c)| write(&format!("control{i}.bin"), c.data(), torch(c, 4))).collect();
    let meta = serde_json::json!({
        "variant": variant,
        "prefix": PREFIX,
        "x": write("x.bin", case.x.data(), torch(&case.x, 4)),
        "timesteps": write("t.bin", &case.timesteps, vec![case.timesteps.len()]),
        "context": write("context.bin", case.context.data(), torch(&case.context, 3)),
        "controls": controls,
        "control_strength": case.control_strength,
        "dump_blocks": dump_blocks,
    });
    std::fs::write(dir.join("case.json"), meta.to_string()).unwrap();
    let status = Command::new(crate::testutil::numpy_python())
        .arg(repo().join("tests/tools/unet_ref.py"))
        .arg(weights)
        .arg(dir)
        .status()
        .ok()?;
    if !status.success() {
        eprintln!("numpy reference failed ({status}); skipping the comparison");
        return None;
    }
    let bytes = std::fs::read(dir.join("expected.bin")).ok()?;
    Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// max |a - b| / max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_b = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    max_d / max_b
}

/// Runs every stage of the UNet on the numpy model's own input to that stage (saved by
/// `numpy_expected(.., dump_blocks)` in `dir`) and returns each stage's error: unlike the
/// end-to-end error this does not include the amplification of rounding noise.
fn blockwise_errors(runner: &mut Runner, unet: &UNetModel, case: &Case, dir: &Path, expected: &[f32]) -> Vec<(String, f32)> {
    let shapes: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("dumped.json")).unwrap()).unwrap();
    let read = |name: &str| {
        let mut shape: Vec<usize> =
            shapes[name].as_array().unwrap_or_else(|| panic!("{name} not dumped")).iter().map(|d| d.as_u64().unwrap() as usize).collect();
        shape.reverse();
        let bytes = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
        Tensor::from_vec(&shape, bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()).unwrap()
    };
    let mut errors = Vec::new();
    let mut check = |name: String, got: Tensor, want: &[f32]| errors.push((name, rel_err(got.data(), want)));

    let emb = read("emb");
    let n_t = case.timesteps.len() as i64;
    let got = runner.compute(|g| Ok(unet.embed.forward(g, g.input_f32(&case.timesteps, &[n_t]), None))).unwrap();
    check("time embedding".into(), got, emb.data());
    let got = runner.compute(|g| Ok(unet.input_conv.forward(g, g.input(&case.x)))).unwrap();
    check("input_blocks.0".into(), got, read("skip0").data());
    for (i, block) in unet.input_blocks.iter().enumerate() {
        let h = read(&format!("skip{i}"));
        // Inputs a graph does not use are never allocated (and cannot be uploaded), so blocks
        // without attention get the embedding in place of the (unused) context.
        let got = match block {
            EncoderBlock::Down(d) => runner.compute(|g| Ok(d.forward(g, g.input(&h)))),
            EncoderBlock::Res { attn, .. } => runner.compute(|g| {
                let e = g.input(&emb);
                let ctx = if attn.is_some() { g.input(&case.context) } else { e };
                Ok(block.forward(g, g.input(&h), e, ctx))
            }),
        };
        check(format!("input_blocks.{}", i + 1), got.unwrap(), read(&format!("skip{}", i + 1)).data());
    }
    let n_in = unet.input_blocks.len();
    let middle = unet.middle.as_ref().unwrap();
    let h = read(&format!("skip{n_in}"));
    let got = runner.compute(|g| Ok(middle.forward(g, g.input(&h), g.input(&emb), g.input(&case.context).into()))).unwrap();
    check("middle_block".into(), got, read("mid").data());
    for (k, block) in unet.output_blocks.iter().enumerate() {
        let h = if k == 0 { read("mid") } else { read(&format!("out{}", k - 1)) };
        let skip = read(&format!("skip{}", n_in - k));
        let got = runner
            .compute(|g| {
                let e = g.input(&emb);
                let ctx = if block.attn.is_some() { g.input(&case.context) } else { e };
                Ok(block.forward(g, g.input(&h), g.input(&skip), e, ctx.into(), None))
            })
            .unwrap();
        check(format!("output_blocks.{k}"), got, read(&format!("out{k}")).data());
    }
    let h = read(&format!("out{}", unet.output_blocks.len() - 1));
    let got = runner.compute(|g| Ok(unet.head(g, g.input(&h)))).unwrap();
    check("out".into(), got, expected);
    errors
}

fn worst_stage(errors: &[(String, f32)]) -> (String, f32) {
    errors.iter().fold((String::new(), 0f32), |m, (n, e)| if *e > m.1 { (n.clone(), *e) } else { m })
}

/// Runs `case`, checking the output's shape and that it is finite.
fn run(runner: &mut Runner, unet: &UNetModel, case: &Case) -> Tensor {
    let controls = (!case.controls.is_empty()).then_some(case.controls.as_slice());
    let out = compute(runner, unet, &case.x, &case.timesteps, &case.context, None, None, controls, case.control_strength, None).unwrap();
    let mut shape = case.x.shape().to_vec();
    shape[2] = unet.config.out_channels as usize;
    assert_eq!(out.shape(), &shape[..]);
    assert!(out.data().iter().all(|v| v.is_finite()), "non-finite UNet output");
    out
}

#[test]
fn sd1_unet_matches_numpy_model() {
    let Some(path) = fixture(&["sd1-unet.safetensors", "sd1.safetensors"], Some("sd1-unet")) else {
        eprintln!("skipped: no sd1 fixture in {} (SD_PARITY=full generates it)", cache_dir().display());
        return;
    };
    let backend = Arc::new(Backend::cpu().unwrap());
    let (_store, unet) = load_unet(&path, &backend);
    assert_eq!(unet.config.version, UNetVersion::Sd1);
    assert!(!unet.config.use_linear_projection);
    let mut runner = Runner::new(backend, 2);
    let tmp = std::env::temp_dir().join(format!("unet-sd1-{}", std::process::id()));

    // 8×8 latent, batch 1.
    let a = Case::single(8, 768, 1, 500.0);
    let out = run(&mut runner, &unet, &a);
    runner.options.flash_attn = true;
    let out_flash = run(&mut runner, &unet, &a);
    runner.options.flash_attn = false;

    // 16×8 latent, batch 2 with one context for both, ControlNet residuals.
    let controls: Vec<Tensor> = unet
        .control_shapes(16, 8)
        .into_iter()
        .enumerate()
        .map(|(i, s)| tensor(&[s[0] as usize, s[1] as usize, s[2] as usize, 2], 100 + i as u64, 0.5))
        .collect();
    let b = Case {
        x: tensor(&[16, 8, 4, 2], 3, 1.0),
        timesteps: vec![20.0, 900.0],
        context: tensor(&[768, 77, 1], 4, 1.0),
        controls,
        control_strength: 0.7,
    };
    let out_b = run(&mut runner, &unet, &b);

    let Some(exp_a) = numpy_expected(&path, "sd1", &a, &tmp.join("a"), true) else { return };
    let blocks = blockwise_errors(&mut runner, &unet, &a, &tmp.join("a"), &exp_a);
    let (worst_name, worst) = worst_stage(&blocks);
    let err_a = rel_err(out.data(), &exp_a);
    let err_flash = rel_err(out_flash.data(), &exp_a);
    let exp_b = numpy_expected(&path, "sd1", &b, &tmp.join("b"), false).expect("numpy model ran once already");
    let err_b = rel_err(out_b.data(), &exp_b);
    eprintln!("sd1 UNet vs numpy (max |diff| / max |expected|):");
    let listing: Vec<String> = blocks.iter().map(|(n, e)| format!("{n} {e:.1e}")).collect();
    eprintln!("  per stage on the numpy model's inputs: worst {worst:.2e} ({worst_name}); {}", listing.join(", "));
    eprintln!("  end to end: 8x8 {err_a:.2e}, 8x8 flash {err_flash:.2e}, 16x8 batch 2 + control {err_b:.2e}");
    let _ = std::fs::remove_dir_all(&tmp);
    // Each stage must agree to rounding level. End to end the synthetic network amplifies
    // rounding noise: in the numpy model alone, a 1-ulp f32 change of the first feature map
    // moves the output by 1.7e-2 (max) / 1.1e-2 (rms), so whole-network errors of a few
    // 1e-2 are its noise floor; the flash path adds f16 K/V rounding.
    assert!(worst < 2e-3, "stage {worst_name} differs by {worst:.2e}");
    assert!(err_a < 6e-2 && err_b < 6e-2, "end-to-end errors {err_a:.2e} / {err_b:.2e}");
    assert!(err_flash < 1e-1, "flash attention error {err_flash:.2e}");
}

/// A guided step's two passes as one batch give each pass's output bit for bit (exact
/// path, with and without flash attention), and inputs that do not batch are left alone.
#[test]
fn a_pair_of_passes_gives_each_pass_bit_for_bit() {
    let Some(path) = fixture(&["sd1-unet.safetensors", "sd1.safetensors"], Some("sd1-unet")) else {
        eprintln!("skipped: no sd1 fixture in {} (SD_PARITY=full generates it)", cache_dir().display());
        return;
    };
    let backend = Arc::new(Backend::cpu().unwrap());
    let (_store, unet) = load_unet(&path, &backend);
    let mut runner = Runner::new(backend, 2);
    let x = tensor(&[16, 8, 4, 1], 11, 1.0);
    let timesteps = [420.0];
    let cond = Condition { crossattn: Some(tensor(&[768, 77, 1], 12, 1.0)), ..Condition::default() };
    let uncond = Condition { crossattn: Some(tensor(&[768, 77, 1], 13, 1.0)), ..Condition::default() };
    let (a, b) = (DiffusionInput::new(&x, &timesteps, &cond), DiffusionInput::new(&x, &timesteps, &uncond));
    for flash in [false, true] {
        runner.options.flash_attn = flash;
        let [p, q] = compute_pair(&mut runner, &unet, &a, &b).unwrap().expect("two plain passes batch");
        for (got, c) in [(&p, &cond), (&q, &uncond)] {
            let alone = compute(&mut runner, &unet, &x, &timesteps, c.crossattn.as_ref().unwrap(), None, None, None, 1.0, None).unwrap();
            assert_eq!(got.shape(), alone.shape());
            let same = got.data().iter().zip(alone.data()).all(|(u, v)| u.to_bits() == v.to_bits());
            assert!(same, "a batched pass differs from the pass alone (flash attention {flash})");
        }
    }
    // Contexts of different lengths, residuals or a graph budget: computed one by one.
    let long = Condition { crossattn: Some(tensor(&[768, 154, 1], 14, 1.0)), ..Condition::default() };
    assert!(compute_pair(&mut runner, &unet, &a, &DiffusionInput::new(&x, &timesteps, &long)).unwrap().is_none());
    let controls: Vec<Tensor> = unet.control_shapes(16, 8).into_iter().map(|s| Tensor::zeros(&[s[0] as usize, s[1] as usize, s[2] as usize, 1])).collect();
    let with_controls = DiffusionInput { controls: Some(&controls), ..a };
    assert!(compute_pair(&mut runner, &unet, &with_controls, &b).unwrap().is_none());
    runner.max_vram = 1 << 30;
    assert!(compute_pair(&mut runner, &unet, &a, &b).unwrap().is_none());
}

#[test]
fn sd2_unet_runs_and_matches_numpy_model() {
    let Some(path) = fixture(&["sd2.safetensors"], None) else {
        eprintln!("skipped: no sd2.safetensors in {}", cache_dir().display());
        return;
    };
    let backend = Arc::new(Backend::cpu().unwrap());
    let (_store, unet) = load_unet(&path, &backend);
    assert_eq!(unet.config.version, UNetVersion::Sd2);
    assert_eq!(unet.config.context_dim, 1024);
    assert!(unet.config.use_linear_projection);
    let mut runner = Runner::new(backend, 2);
    let case = Case::single(8, 1024, 5, 300.0);
    let out = run(&mut runner, &unet, &case);
    let tmp = std::env::temp_dir().join(format!("unet-sd2-{}", std::process::id()));
    let Some(exp) = numpy_expected(&path, "sd2", &case, &tmp, true) else { return };
    let (worst_name, worst) = worst_stage(&blockwise_errors(&mut runner, &unet, &case, &tmp, &exp));
    let err = rel_err(out.data(), &exp);
    eprintln!("sd2 UNet vs numpy (max |diff| / max |expected|): worst stage {worst:.2e} ({worst_name}), end to end 8x8 {err:.2e}");
    let _ = std::fs::remove_dir_all(&tmp);
    // See the sd1 test for the tolerances.
    assert!(worst < 2e-3, "stage {worst_name} differs by {worst:.2e}");
    assert!(err < 6e-2);
}

/// Names and torch shapes synth_model.py gives an architecture; None without python3.
fn synth_spec(arch: &str) -> Option<Vec<(String, Vec<i64>)>> {
    let out = Command::new(crate::testutil::numpy_python()).arg(repo().join("tests/fixtures/synth_model.py")).args(["list", arch]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    Some(
        text.lines()
            .filter_map(|l| {
                let (name, shape) = l.split_once(' ')?;
                let dims = shape.trim_matches(|c| c == '[' || c == ']');
                let ne = dims.split(',').filter(|d| !d.trim().is_empty()).map(|d| d.trim().parse().unwrap()).collect();
                Some((name.to_string(), ne))
            })
            .collect(),
    )
}

/// The declaration covers exactly the checkpoint's UNet tensors, with its shapes.
fn check_declaration(arch: &str, version: UNetVersion) -> Option<(ParamStore, UNetModel)> {
    let spec = synth_spec(arch)?;
    let unet_spec: HashMap<String, Vec<i64>> = spec
        .into_iter()
        .filter(|(n, _)| n.starts_with(PREFIX))
        .map(|(n, mut s)| {
            s.reverse();
            (n, s)
        })
        .collect();
    let types: TypeMap = unet_spec.keys().map(|k| (k.clone(), F16)).collect();
    let cfg = UNetConfig::detect(&|n| unet_spec.get(n).cloned(), PREFIX, None).unwrap();
    assert_eq!(cfg.version, version);
    let mut store = ParamStore::new(4096).unwrap();
    let unet = UNetModel::new(&mut Scope::new(&mut store, &types, PREFIX), &cfg);
    let declared: HashMap<String, Vec<i64>> = store.entries().map(|(n, w)| (n.to_string(), ParamStore::spec(w).ne)).collect();
    for (name, ne) in &unet_spec {
        let d = declared.get(name).unwrap_or_else(|| panic!("{arch}: {name} not declared"));
        assert_eq!(d.iter().product::<i64>(), ne.iter().product::<i64>(), "{arch}: {name} declared {d:?}, file {ne:?}");
        assert_eq!(&d[..], &ne[..d.len()], "{arch}: {name} declared {d:?}, file {ne:?}");
    }
    assert_eq!(declared.len(), unet_spec.len(), "{arch}: declared tensors not in the checkpoint");
    Some((store, unet))
}

#[test]
fn declarations_match_sd1_sd2_sdxl_checkpoints() {
    if check_declaration("sd1", UNetVersion::Sd1).is_none() {
        eprintln!("skipped: python3/numpy unavailable");
        return;
    }
    let (_, sd2) = check_declaration("sd2", UNetVersion::Sd2).unwrap();
    assert_eq!((sd2.config.context_dim, sd2.config.heads(320)), (1024, (5, 64)));
    let (_store, xl) = check_declaration("sdxl", UNetVersion::Sdxl).unwrap();
    assert_eq!(xl.config.adm_in_channels, Some(2816));
    assert_eq!(xl.config.context_dim, 2048);
    assert_eq!(xl.num_controls(), 10);

    // The SDXL graph builds (no data needed) and has the latent's shape.
    let g = Graph::new().unwrap();
    let x = g.new_tensor(F32, &[16, 12, 4, 2]);
    let t = g.new_tensor(F32, &[2]);
    let ctx = g.new_tensor(F32, &[2048, 77, 1]);
    let y = g.new_tensor(F32, &[2816, 1]);
    let out = xl.forward(&g, x, t, ctx, None, Some(y), &[], 1.0, None);
    assert_eq!(out.ne(), [16, 12, 4, 2]);
}

#[test]
fn detects_variants_and_checks_inputs() {
    // A minimal tiny SD 1.x layout (BK-SDM): no middle attention, output_blocks.7.1 present.
    let shapes: HashMap<String, Vec<i64>> = [
        ("input_blocks.0.0.weight", vec![3, 3, 4, 320]),
        ("input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight", vec![768, 320]),
        ("input_blocks.1.1.proj_out.weight", vec![1, 1, 320, 320]),
        ("output_blocks.7.1.norm.weight", vec![320]),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{PREFIX}{k}"), v))
    .collect();
    let cfg = UNetConfig::detect(&|n| shapes.get(n).cloned(), "model.diffusion_model", None).unwrap();
    assert_eq!(cfg.version, UNetVersion::Sd1Tiny);
    assert!(cfg.tiny_unet && cfg.num_res_blocks == 1 && cfg.channel_mult == [1, 2, 4]);
    let types = TypeMap::new();
    let mut store = ParamStore::new(4096).unwrap();
    let unet = UNetModel::new(&mut Scope::new(&mut store, &types, PREFIX), &cfg);
    // The reference's tiny numbering: blocks 1, 3, 4, 6, 7 in, upsamplers at out 2.1 and 5.2.
    for name in ["input_blocks.7.1.norm.weight", "output_blocks.2.1.conv.weight", "output_blocks.5.2.conv.weight"] {
        assert!(store.get(&format!("{PREFIX}{name}")).is_some(), "{name}");
    }
    assert!(store.get(&format!("{PREFIX}middle_block.0.in_layers.0.weight")).is_none());
    assert_eq!(unet.num_controls(), 7);

    let x = Tensor::zeros(&[12, 8, 4, 1]);
    let ctx = Tensor::zeros(&[768, 77, 1]);
    assert!(unet.check_inputs(&x, 1, &ctx, None, None, &[]).is_ok());
    assert!(unet.check_inputs(&Tensor::zeros(&[10, 8, 4, 1]), 1, &ctx, None, None, &[]).is_err());
    assert!(unet.check_inputs(&x, 1, &Tensor::zeros(&[1024, 77, 1]), None, None, &[]).is_err());
    assert!(unet.check_inputs(&x, 1, &ctx, None, Some(&Tensor::zeros(&[2816, 1])), &[]).is_err());
    assert!(unet.check_inputs(&x, 1, &ctx, Some(&Tensor::zeros(&[12, 8, 5, 1])), None, &[]).is_err());
    assert!(unet.check_inputs(&x, 1, &ctx, None, None, &[Tensor::zeros(&[12, 8, 320, 1])]).is_err());

    // Inpainting: 9 input channels = latent + c_concat (mask + masked-image latent).
    let mut inpaint = shapes.clone();
    inpaint.insert(format!("{PREFIX}input_blocks.0.0.weight"), vec![3, 3, 9, 320]);
    let cfg = UNetConfig::detect(&|n| inpaint.get(n).cloned(), PREFIX, Some(UNetVersion::Sd1Tiny)).unwrap();
    assert_eq!(cfg.in_channels, 9);
    let mut store = ParamStore::new(4096).unwrap();
    let unet = UNetModel::new(&mut Scope::new(&mut store, &types, PREFIX), &cfg);
    assert!(unet.check_inputs(&x, 1, &ctx, Some(&Tensor::zeros(&[12, 8, 5, 1])), None, &[]).is_ok());
    assert!(unet.check_inputs(&x, 1, &ctx, None, None, &[]).is_err());

    // SDXS-512-0.9: a tiny SD 2.x whose 320-wide level has one 320-wide head with 1024-input
    // self-attention keys/values (output_blocks.7.1's tells it from the SD 2.x tiny UNet).
    let attn1_k = "output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight";
    let mut sdxs09 = shapes.clone();
    sdxs09.insert(format!("{PREFIX}input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"), vec![1024, 320]);
    sdxs09.insert(format!("{PREFIX}input_blocks.1.1.proj_out.weight"), vec![320, 320]);
    sdxs09.insert(format!("{PREFIX}{attn1_k}"), vec![1024, 320]);
    let cfg = UNetConfig::detect(&|n| sdxs09.get(n).cloned(), PREFIX, None).unwrap();
    assert_eq!((cfg.version, cfg.context_dim, cfg.heads(320), cfg.heads(640)), (UNetVersion::Sdxs09, 1024, (1, 320), (10, 64)));
    let mut store = ParamStore::new(4096).unwrap();
    UNetModel::new(&mut Scope::new(&mut store, &types, PREFIX), &cfg);
    let ne = |name: &str| ParamStore::spec(store.get(&format!("{PREFIX}{name}")).expect(name)).ne;
    assert_eq!(ne(attn1_k), [1024, 320]);
    assert_eq!(ne("input_blocks.1.1.transformer_blocks.0.attn1.to_v.weight"), [1024, 320]);
    assert_eq!(ne("input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"), [320, 320]);
    assert_eq!(ne("input_blocks.4.1.transformer_blocks.0.attn1.to_k.weight"), [640, 640]);
    sdxs09.insert(format!("{PREFIX}{attn1_k}"), vec![320, 320]);
    let cfg = UNetConfig::detect(&|n| sdxs09.get(n).cloned(), PREFIX, None).unwrap();
    assert_eq!((cfg.version, cfg.heads(320)), (UNetVersion::Sd2Tiny, (5, 64)));
}

