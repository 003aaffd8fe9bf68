//! A loaded Stable Diffusion model set (SD 1.x / SD 2.x UNet families): text encoder,
//! UNet, first-stage autoencoder (or TAESD) and an optional preview decoder, each with its
//! own weights and graph runner, plus the denoiser the checkpoint needs.

use super::conditioner::ClipConditioner;
use super::loader::Weights;
use super::lora::{LoraSet, LoraTarget};
use crate::params::CtxParams;
use crate::error::{Context as _, Result};
use crate::graph::{Backend, ParamStore, Runner, Scope};
use crate::io::SdVersion;
use crate::models::diffusion::unet::{self, UNetConfig, UNetModel};
use crate::models::vae::{self, AutoEncoderKL, LatentFamily, TaeConfig, TinyAutoEncoder, Vae, VaeConfig};
use crate::runtime::defaults::ModelFamily;
use crate::runtime::denoiser::Denoiser;
use crate::runtime::schedulers::TIMESTEPS;
use crate::tensor::Tensor;
use crate::types::{Prediction, RngType};
use std::collections::HashMap;
use std::sync::Arc;

/// Weight tensors a model may declare (the SD UNet has about 700).
const STORE_CAPACITY: usize = 4096;

/// A network with the store holding its weights and the runner computing its graphs.
pub struct Loaded<M> {
    pub model: M,
    // The model's weight handles point into this store: it lives as long as the model.
    _store: ParamStore,
    pub runner: Runner,
}

impl<M> Loaded<M> {
    fn load(
        weights: &Weights,
        backend: Arc<Backend>,
        n_threads: i32,
        prefix: &str,
        what: &str,
        declare: impl FnOnce(&mut Scope) -> M,
    ) -> Result<Loaded<M>> {
        let mut store = ParamStore::new(STORE_CAPACITY)?;
        let model = declare(&mut Scope::new(&mut store, weights.types(), prefix));
        weights.load(&mut store, &backend, what, n_threads.max(1) as usize)?;
        Ok(Loaded { model, _store: store, runner: Runner::new(backend, n_threads) })
    }

    /// The weights and runner LoRAs update.
    pub fn lora_target(&mut self) -> LoraTarget<'_> {
        LoraTarget { store: &mut self._store, runner: &mut self.runner }
    }
}

/// Which device each part computes on: `DEVICE` for all, or `module=DEVICE` entries
/// (modules `te`, `diffusion`, `vae` and the reference's aliases), comma-separated.
#[derive(Debug, Default, Clone, PartialEq)]
struct DeviceSpec {
    default: Option<String>,
    modules: HashMap<&'static str, String>,
}

impl DeviceSpec {
    fn parse(spec: Option<&str>) -> Result<DeviceSpec> {
        let mut out = DeviceSpec::default();
        for part in spec.unwrap_or("").split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                out.default = Some(part.to_string());
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            ensure!(!key.is_empty() && !value.is_empty(), "invalid backend assignment '{part}'");
            let k: String = key.to_ascii_lowercase().chars().filter(|c| *c != '-' && *c != '_').collect();
            let module = match k.as_str() {
                "all" | "default" | "*" => {
                    out.default = Some(value.to_string());
                    continue;
                }
                "diffusion" | "model" | "unet" | "dit" => "diffusion",
                "te" | "clip" | "text" | "textencoder" | "textencoders" | "conditioner" | "cond" | "llm" | "t5" | "t5xxl" => "te",
                "vae" | "firststage" | "autoencoder" | "tae" => "vae",
                "clipvision" | "vision" | "controlnet" | "control" | "photomaker" | "photomakerid" | "pmid" | "photo" | "upscaler"
                | "esrgan" | "hires" | "detector" | "adetailer" | "yolo" => continue,
                _ => bail!("unknown backend module '{key}'"),
            };
            out.modules.insert(module, value.to_string());
        }
        Ok(out)
    }

    fn device(&self, module: &str) -> Option<&str> {
        self.modules.get(module).or(self.default.as_ref()).map(String::as_str).filter(|d| {
            let d = d.to_ascii_lowercase();
            !(d == "default" || d == "auto" || d == "disk")
        })
    }
}

/// Backends by device name, initialised once per context.
#[derive(Default)]
struct Backends(HashMap<String, Arc<Backend>>);

impl Backends {
    fn get(&mut self, device: Option<&str>) -> Result<Arc<Backend>> {
        let key = device.unwrap_or("CPU").to_ascii_lowercase();
        if let Some(b) = self.0.get(&key) {
            return Ok(b.clone());
        }
        let b = Arc::new(match device {
            None => Backend::cpu()?,
            Some(name) => {
                let found = crate::graph::backend::devices().into_iter().find(|d| d.name.eq_ignore_ascii_case(name));
                Backend::by_name(found.map_or(name.to_string(), |d| d.name).as_str())?
            }
        });
        self.0.insert(key, b.clone());
        Ok(b)
    }
}

/// Whether CPU matrix products should use ggml's reference kernels rather than its tiled
/// GEMM (llamafile) kernels. The tiled kernels sum in another order: with f16/f32 weights
/// pictures stay within max 1 / mean ~0.06 of the reference's (like f16 vs f32 weights), but
/// quantized weights re-quantize every activation, which turns those last-bit differences
/// into whole quantization steps; such models use the reference kernels and render the
/// reference's pictures exactly. `SD_CPU_REFERENCE_KERNELS=1`/`0` forces either choice.
fn reference_kernels_wanted(types: &crate::graph::TypeMap) -> bool {
    match std::env::var("SD_CPU_REFERENCE_KERNELS").as_deref().map(str::trim) {
        Ok("1") | Ok("on") | Ok("true") => true,
        Ok("0") | Ok("off") | Ok("false") => false,
        _ => types.values().any(|&t| crate::graph::is_block_quantized(t)),
    }
}

/// Everything loaded by `new_sd_ctx` for an SD 1.x / 2.x model.
pub struct StableDiffusion {
    pub version: SdVersion,
    pub family: ModelFamily,
    pub prediction: Prediction,
    pub denoiser: Denoiser,
    pub rng_type: RngType,
    pub sampler_rng_type: Option<RngType>,
    pub n_threads: i32,
    pub cond: ClipConditioner,
    pub unet: Loaded<UNetModel>,
    /// The first stage: AutoencoderKL, or TAESD when given (and not for previews only).
    pub first_stage: Loaded<Vae>,
    /// TAESD for previews only (`tae_preview_only`).
    pub preview_vae: Option<Loaded<Vae>>,
    /// The model files, kept to undo merged LoRAs.
    weights: Weights,
    pub loras: LoraSet,
}

/// Whether `version` is one of the SD 1.x / SD 2.x UNet models this pipeline runs, and
/// if so whether it is SD 2.x.
fn unet_family(version: SdVersion) -> Result<bool> {
    match version {
        SdVersion::Sd1 | SdVersion::Sd1Inpaint | SdVersion::Sd1TinyUnet | SdVersion::Sdxs512Ds => Ok(false),
        SdVersion::Sd2 | SdVersion::Sd2Inpaint | SdVersion::Sd2TinyUnet => Ok(true),
        v => bail!("{} models are not supported yet in this build of libstable-diffusion", v.name()),
    }
}

impl StableDiffusion {
    pub fn new(params: &CtxParams) -> Result<StableDiffusion> {
        let weights = Weights::open(params)?;
        let version = weights.version();
        let sd2 = unet_family(version)?;
        let n_threads = if params.n_threads <= 0 { crate::graph::backend::physical_cores() } else { params.n_threads };

        let runtime = DeviceSpec::parse(params.backend.as_deref()).context("backend")?;
        let weights_on = DeviceSpec::parse(params.params_backend.as_deref()).context("params_backend")?;
        let mut backends = Backends::default();
        let mut backend_for = |module: &str| -> Result<Arc<Backend>> {
            let run = runtime.device(module);
            if let Some(p) = weights_on.device(module) {
                if !p.eq_ignore_ascii_case(run.unwrap_or("CPU")) {
                    sd_warn!("{module}: keeping weights on the compute device (params backend '{p}' is not supported separately)");
                }
            }
            backends.get(run)
        };
        let te_backend = backend_for("te")?;
        let diffusion_backend = backend_for("diffusion")?;
        let vae_backend = backend_for("vae")?;
        let reference_kernels = reference_kernels_wanted(weights.types());
        for b in backends.0.values() {
            if b.set_reference_kernels(reference_kernels) && reference_kernels {
                sd_info!("{}: using ggml's reference matrix kernels (quantized weights or SD_CPU_REFERENCE_KERNELS)", b.name());
            }
        }

        let cond = ClipConditioner::new(&weights, sd2, &params.embeddings, te_backend, n_threads)?;

        let shape_of = |n: &str| weights.shape_of(n);
        let unet_cfg = UNetConfig::detect(&shape_of, "model.diffusion_model.", None)?;
        let mut unet = Loaded::load(&weights, diffusion_backend, n_threads, "model.diffusion_model.", "diffusion model", |s| {
            UNetModel::new(s, &unet_cfg)
        })?;
        unet.runner.options.flash_attn = params.flash_attn || params.diffusion_flash_attn;
        unet.runner.options.conv_direct = params.diffusion_conv_direct;

        let family = if sd2 { LatentFamily::Sd2 } else { LatentFamily::Sd1 };
        let has_tae = weights.has_prefix(vae::tae::PREFIX);
        let sdxs = matches!(version, SdVersion::Sdxs512Ds | SdVersion::Sdxs09);
        let tae_preview_only = params.tae_preview_only && !sdxs;
        let load_tae = |decode_only: bool, backend: Arc<Backend>| -> Result<Loaded<Vae>> {
            let cfg = TaeConfig::detect(weights.types(), vae::tae::PREFIX, |n| weights.shape_of(n), decode_only);
            Loaded::load(&weights, backend, n_threads, vae::tae::PREFIX, "TAE", |s| Vae::Tiny(TinyAutoEncoder::new(s, &cfg)))
        };
        ensure!(!sdxs || has_tae, "{} models need their tiny autoencoder (taesd_path)", version.name());
        let (mut first_stage, mut preview_vae) = if has_tae && !tae_preview_only {
            sd_info!("using TAE for encoding / decoding");
            (load_tae(false, vae_backend.clone())?, None)
        } else {
            sd_info!("using VAE for encoding / decoding");
            let prefix = vae::autoencoder_kl::PREFIX;
            let cfg = VaeConfig::detect(weights.types(), prefix, |n| weights.shape_of(n), family, false);
            let kl = Loaded::load(&weights, vae_backend.clone(), n_threads, prefix, "VAE", |s| Vae::Kl(AutoEncoderKL::new(s, &cfg)))?;
            let preview = if has_tae {
                sd_info!("using TAE for preview");
                Some(load_tae(true, vae_backend)?)
            } else {
                None
            };
            (kl, preview)
        };
        for v in std::iter::once(&mut first_stage).chain(preview_vae.as_mut()) {
            v.runner.options.flash_attn = params.flash_attn;
            v.runner.options.conv_direct = params.vae_conv_direct;
        }
        if params.flash_attn {
            sd_info!("Using flash attention");
        }

        let alphas_cumprod = load_alphas_cumprod(&weights);
        let loras = LoraSet::new(params.lora_apply_mode, &weights);
        let mut sd = StableDiffusion {
            version,
            family: if sd2 { ModelFamily::Sd2 } else { ModelFamily::Sd1 },
            prediction: Prediction::Eps,
            denoiser: Denoiser::new(Prediction::Eps, alphas_cumprod.as_deref()),
            rng_type: params.rng_type,
            sampler_rng_type: params.sampler_rng_type,
            n_threads,
            cond,
            unet,
            first_stage,
            preview_vae,
            weights,
            loras,
        };
        let prediction = match params.prediction {
            Some(p) => p,
            None if sd2 => {
                if sd.uses_v_parameterization()? {
                    Prediction::V
                } else {
                    Prediction::Eps
                }
            }
            None => Prediction::Eps,
        };
        ensure!(
            matches!(prediction, Prediction::Eps | Prediction::V | Prediction::EdmV),
            "prediction '{}' does not apply to {} models",
            prediction.name(),
            version.name()
        );
        sd_info!(
            "running in {} mode",
            match prediction {
                Prediction::Eps => "eps-prediction",
                Prediction::V => "v-prediction",
                _ => "v-prediction EDM",
            }
        );
        sd.prediction = prediction;
        sd.denoiser = Denoiser::new(prediction, alphas_cumprod.as_deref());
        Ok(sd)
    }

    /// The latent family (scale factor and preview projection).
    pub fn latent_family(&self) -> LatentFamily {
        match self.family {
            ModelFamily::Sd2 => LatentFamily::Sd2,
            _ => LatentFamily::Sd1,
        }
    }

    pub fn is_inpaint(&self) -> bool {
        self.version.is_inpaint()
    }

    /// Brings the model to the LoRAs of a request (text encoder, UNet, VAE).
    pub fn apply_loras(&mut self, wanted: &[crate::params::Lora]) -> Result<()> {
        let mut targets = [self.cond.lora_target(), self.unet.lora_target(), self.first_stage.lora_target()];
        self.loras.apply(wanted, &self.weights, &mut targets, self.n_threads)
    }

    /// SD 2.x checkpoints come with eps or v prediction and do not say which: like the
    /// reference, run the UNet once on a constant input at t = 999 and call it v when the
    /// output is far below the input on average.
    fn uses_v_parameterization(&mut self) -> Result<bool> {
        let x = Tensor::full(&[8, 8, 4, 1], 0.5);
        let context = Tensor::full(&[self.unet.model.config.context_dim as usize, 2, 1], 0.5);
        let concat = self.is_inpaint().then(|| Tensor::zeros(&[8, 8, self.unet.model.config.in_channels as usize - 4, 1]));
        let start = std::time::Instant::now();
        let out = unet::compute(&mut self.unet.runner, &self.unet.model, &x, &[999.0], &context, concat.as_ref(), None, None, 1.0)?;
        self.unet.runner.release();
        let mean = out.data().iter().zip(x.data()).map(|(&o, &i)| (o - i) as f64).sum::<f64>() / out.len() as f64;
        sd_debug!("check is_using_v_parameterization_for_sd2, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(mean < -1.0)
    }
}

/// The checkpoint's `alphas_cumprod` when it has a valid one (1000 values in (0, 1]).
fn load_alphas_cumprod(weights: &Weights) -> Option<Vec<f32>> {
    weights.get("alphas_cumprod")?;
    match weights.read_f32("alphas_cumprod") {
        Ok(v) if v.len() != TIMESTEPS => {
            sd_warn!("ignore alphas_cumprod from model file: expected {} values, got {}", TIMESTEPS, v.len());
            None
        }
        Ok(v) if v.iter().any(|a| !a.is_finite() || *a <= 0.0 || *a > 1.0) => {
            sd_warn!("ignore invalid alphas_cumprod from model file");
            None
        }
        Ok(v) => {
            sd_debug!("loaded alphas_cumprod from model file");
            Some(v)
        }
        Err(e) => {
            sd_warn!("ignore alphas_cumprod from model file: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs() {
        let s = DeviceSpec::parse(Some("CUDA0, vae = CPU,text-encoder=Vulkan0")).unwrap();
        assert_eq!(s.device("diffusion"), Some("CUDA0"));
        assert_eq!(s.device("vae"), Some("CPU"));
        assert_eq!(s.device("te"), Some("Vulkan0"));
        assert_eq!(DeviceSpec::parse(None).unwrap().device("vae"), None);
        assert_eq!(DeviceSpec::parse(Some("auto")).unwrap().device("vae"), None);
        assert!(DeviceSpec::parse(Some("bogus=CPU")).is_err());
        assert!(DeviceSpec::parse(Some("vae=")).is_err());
    }
}
