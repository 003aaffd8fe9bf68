//! Test helpers: synthetic checkpoints, loading them into a `ParamStore`, and running the
//! numpy re-implementation in `tests/tools/vae_ref.py` for comparison.
//!
//! Name mapping: the files written by `tests/fixtures/synth_model.py` use the checkpoint
//! names. For `sd1-vae` these are already the reference's internal names
//! (`first_stage_model.*`); a TAESD file's names get the prefix `tae.` the reference loads
//! it under. `SafeFile::new(path, prefix)` applies such a prefix to every file name.

pub(crate) use crate::testutil::{f16_to_f32, f32_to_f16};
use crate::graph::{Backend, ParamStore, TensorSpec, TypeMap, F16, F32};
use crate::tensor::Tensor;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::testutil::repo;

/// A synthetic checkpoint in the shared fixture cache, generated on first use (written to a
/// temporary name, then renamed, as other test runs may look for it concurrently).
pub fn fixture(file: &str) -> PathBuf {
    crate::testutil::synthetic_fixture(file).unwrap_or_else(|e| panic!("synthetic fixture {file}: {e}"))
}

/// A safetensors file read into memory, with its names under `prefix`.
pub struct SafeFile {
    bytes: Vec<u8>,
    prefix: String,
}

fn ggml_type(d: Dtype) -> crate::graph::GgmlType {
    match d {
        Dtype::F16 => F16,
        Dtype::BF16 => ggml_sys::GGML_TYPE_BF16,
        _ => F32,
    }
}

impl SafeFile {
    pub fn new(path: &Path, prefix: &str) -> SafeFile {
        SafeFile { bytes: std::fs::read(path).expect("read safetensors"), prefix: prefix.to_string() }
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("parse safetensors")
    }

    fn file_name<'a>(&self, name: &'a str) -> Option<&'a str> {
        name.strip_prefix(self.prefix.as_str())
    }

    /// Internal name → type in the file.
    pub fn types(&self) -> TypeMap {
        self.st().iter().map(|(n, v)| (format!("{}{n}", self.prefix), ggml_type(v.dtype()))).collect()
    }

    /// Shape in ggml order of an internal name.
    pub fn shape_of(&self, name: &str) -> Option<Vec<i64>> {
        let v = self.st().tensor(self.file_name(name)?).ok()?;
        Some(v.shape().iter().rev().map(|&d| d as i64).collect())
    }

    /// Fills every declared tensor, converting f16/bf16/f32 to the declared type.
    pub fn load(&self, store: &mut ParamStore) {
        let st = self.st();
        store
            .load(|name, spec: &TensorSpec, dst| {
                let file_name = self.file_name(name).unwrap_or(name);
                let v = st.tensor(file_name).map_err(|e| crate::error::Error::new(format!("{name}: {e}")))?;
                let n: usize = v.shape().iter().product();
                let want: i64 = spec.ne.iter().product();
                ensure!(n as i64 == want, "{name}: file has {n} elements, declared {want}");
                let vals: Vec<f32> = match v.dtype() {
                    Dtype::F32 => v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                    Dtype::F16 => v.data().chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
                    Dtype::BF16 => {
                        v.data().chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect()
                    }
                    d => bail!("{name}: unsupported dtype {d:?}"),
                };
                if spec.ty == F32 {
                    for (o, x) in dst.chunks_exact_mut(4).zip(&vals) {
                        o.copy_from_slice(&x.to_le_bytes());
                    }
                } else if spec.ty == F16 {
                    for (o, x) in dst.chunks_exact_mut(2).zip(&vals) {
                        o.copy_from_slice(&f32_to_f16(*x).to_le_bytes());
                    }
                } else {
                    bail!("{name}: test loader cannot write ggml type {}", spec.ty);
                }
                Ok(())
            })
            .expect("load weights");
    }
}

/// The golden latent format: i32 ndim, i64 shape (ggml order), f32 data.
pub fn write_bin(path: &Path, t: &Tensor) {
    let mut b = Vec::new();
    b.extend_from_slice(&(t.shape().len() as i32).to_le_bytes());
    for &d in t.shape() {
        b.extend_from_slice(&(d as i64).to_le_bytes());
    }
    for v in t.data() {
        b.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, b).expect("write tensor");
}

pub fn read_bin(path: &Path) -> Tensor {
    let b = std::fs::read(path).expect("read tensor");
    let nd = i32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
    let shape: Vec<usize> =
        (0..nd).map(|i| i64::from_le_bytes(b[4 + 8 * i..12 + 8 * i].try_into().unwrap()) as usize).collect();
    let data = b[4 + 8 * nd..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Tensor::from_vec(&shape, data).expect("tensor size")
}

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Unique per call: tests run in parallel threads of one process.
    pub fn new(tag: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("sd-vae-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `tests/tools/vae_ref.py CMD WEIGHTS IN OUT` on `input` and returns its output.
pub fn numpy_ref(cmd: &str, weights: &Path, input: &Tensor) -> Tensor {
    let dir = TempDir::new(cmd);
    let (inp, out) = (dir.0.join("in.bin"), dir.0.join("out.bin"));
    write_bin(&inp, input);
    let status = Command::new(crate::testutil::numpy_python())
        .arg(repo().join("tests/tools/vae_ref.py"))
        .args([cmd.as_ref(), weights.as_os_str(), inp.as_os_str(), out.as_os_str()])
        .status()
        .expect("python3 with numpy is needed for the numpy comparison");
    assert!(status.success(), "vae_ref.py {cmd} failed");
    read_bin(&out)
}

pub fn cpu() -> Arc<Backend> {
    Arc::new(Backend::cpu().expect("cpu backend"))
}

/// Deterministic values in [lo, hi).
pub fn pattern(shape: &[usize], lo: f32, hi: f32, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect();
    Tensor::from_vec(shape, data).unwrap()
}

/// (max |a-b| / max |b|, max |a-b|), after checking shapes and finiteness.
pub fn compare(a: &Tensor, b: &Tensor) -> (f32, f32) {
    assert_eq!(a.shape(), b.shape(), "shape mismatch");
    assert!(a.data().iter().all(|v| v.is_finite()), "non-finite output");
    let scale = b.data().iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    let d = a.data().iter().zip(b.data()).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    (d / scale, d)
}

/// Compares `ours` with `vae_ref.py CMD` on `input`: same shape, finite, max error below
/// 1% of the largest reference value (f16 weights and im2col); returns that error.
pub fn assert_matches_numpy(label: &str, cmd: &str, weights: &Path, input: &Tensor, ours: &Tensor) -> f32 {
    let (rel, abs) = compare(ours, &numpy_ref(cmd, weights, input));
    eprintln!("{label} vs numpy: max rel err {rel:.2e}, max abs err {abs:.2e}");
    assert!(rel < 1e-2, "{label}: max rel err {rel}");
    rel
}


/// Declares a model under `prefix` with `build` on the file's types and loads the file
/// into it (CPU). The file's names get `file_prefix` prepended.
fn load<M>(
    path: &Path,
    file_prefix: &str,
    prefix: &str,
    build: impl FnOnce(&mut crate::graph::Scope, &TypeMap, &SafeFile) -> M,
) -> (ParamStore, M) {
    let file = SafeFile::new(path, file_prefix);
    let types = file.types();
    let mut store = ParamStore::new(1024).unwrap();
    let model = build(&mut crate::graph::Scope::new(&mut store, &types, prefix), &types, &file);
    store.alloc(&cpu()).unwrap();
    file.load(&mut store);
    (store, model)
}

/// The synthetic SD VAE, loaded on the CPU.
pub fn load_kl(decode_only: bool) -> (ParamStore, super::AutoEncoderKL, PathBuf) {
    load_kl_with(decode_only, |_| {})
}

/// The synthetic SD VAE with its detected configuration changed by `tweak`.
pub fn load_kl_with(decode_only: bool, tweak: impl FnOnce(&mut super::VaeConfig)) -> (ParamStore, super::AutoEncoderKL, PathBuf) {
    use super::autoencoder_kl::PREFIX;
    let path = fixture("vae.safetensors");
    let (store, vae) = load(&path, "", PREFIX, |s, types, file| {
        let mut cfg = super::VaeConfig::detect(types, PREFIX, |n| file.shape_of(n), 0.18215, decode_only);
        tweak(&mut cfg);
        super::AutoEncoderKL::new(s, &cfg)
    });
    (store, vae, path)
}

/// The synthetic TAESD, loaded on the CPU.
pub fn load_tae(decode_only: bool) -> (ParamStore, super::TinyAutoEncoder, PathBuf) {
    use super::tae::PREFIX;
    let path = fixture("taesd.safetensors");
    let (store, tae) = load(&path, PREFIX, PREFIX, |s, types, file| {
        let cfg = super::TaeConfig::detect(types, PREFIX, |n| file.shape_of(n), decode_only);
        super::TinyAutoEncoder::new(s, &cfg)
    });
    (store, tae, path)
}

/// A synthetic LTX-2.3 video VAE (`ltx_vae.safetensors`: one-level encoder;
/// `ltx_vae_i2v.safetensors`: full encoder), loaded on the CPU.
pub fn load_ltx_vae(file: &str) -> (ParamStore, super::ltx::LtxVae, super::ltx::LtxVaeConfig) {
    use super::ltx::{LtxVae, LtxVaeConfig, PREFIX};
    let mut config = None;
    let (store, vae) = load(&fixture(file), PREFIX, PREFIX, |s, _, f| {
        let cfg = LtxVaeConfig::detect(&|n| f.shape_of(n), PREFIX).expect("an LTX VAE file");
        config = Some(cfg.clone());
        LtxVae::new(s, &cfg)
    });
    (store, vae, config.expect("loaded"))
}

/// A synthetic TAEHV (`taew2_1.safetensors`, `taew2_1_wide.safetensors` /
/// `taew2_2.safetensors`) for Wan 2.1 or 2.2 latents, loaded on the CPU.
pub fn load_taehv(file: &str, wan22: bool, decode_only: bool) -> (ParamStore, super::Taehv) {
    use super::taehv::PREFIX;
    let base = if wan22 { super::TaehvConfig::for_latents(48, 16, 4, decode_only) } else { super::TaehvConfig::for_latents(16, 8, 4, decode_only) };
    load(&fixture(file), PREFIX, PREFIX, |s, _, f| super::Taehv::new(s, &base.detect(PREFIX, |n| f.shape_of(n)).expect("a TAEHV file")))
}
