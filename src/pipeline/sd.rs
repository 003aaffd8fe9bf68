//! A loaded Stable Diffusion model set (SD 1.x / SD 2.x UNet families): text encoder,
//! UNet, first-stage autoencoder (or TAESD) and an optional preview decoder, each with its
//! own weights and graph runner, plus the denoiser the checkpoint needs.

use super::conditioner::ClipConditioner;
use super::loader::Weights;
use crate::params::CtxParams;
use crate::error::{Context as _, Result};
use crate::graph::{DeviceMap, DeviceOptions, Module, ParamStore, Placement, Runner, Scope};
use crate::io::SdVersion;
use crate::models::diffusion::unet::{self, UNetConfig, UNetModel};
use crate::models::vae::{self, AutoEncoderKL, LatentFamily, TaeConfig, TinyAutoEncoder, Vae, VaeConfig};
use crate::runtime::defaults::ModelFamily;
use crate::runtime::denoiser::Denoiser;
use crate::runtime::schedulers::TIMESTEPS;
use crate::tensor::Tensor;
use crate::types::{Prediction, RngType};

/// Weight tensors a model may declare (the SD UNet has about 700).
const STORE_CAPACITY: usize = 4096;

/// A network with the store holding its weights, where it computes and its graph runner.
pub struct Loaded<M> {
    pub model: M,
    // The model's weight handles point into this store: it lives as long as the model.
    store: ParamStore,
    pub placement: Placement,
    pub runner: Runner,
}

impl<M> Loaded<M> {
    fn load(
        weights: &Weights,
        placement: Placement,
        n_threads: i32,
        prefix: &str,
        what: &str,
        declare: impl FnOnce(&mut Scope) -> M,
    ) -> Result<Loaded<M>> {
        let mut store = ParamStore::new(STORE_CAPACITY)?;
        let model = declare(&mut Scope::new(&mut store, weights.types(), prefix));
        let threads = n_threads.max(1) as usize;
        if !placement.split.is_empty() {
            let (devices, shares) = placement.split_devices();
            store.alloc_split(&devices, &shares).with_context(|| format!("{what}: allocating weights"))?;
            weights.fill(&mut store, threads)?;
        } else if let Some(b) = placement.weights_backend() {
            weights.load(&mut store, b, what, threads)?;
        } else {
            sd_info!("{what}: weights are read from the model files for each use (params_backend disk)");
        }
        let runner = Runner::for_placement(&placement, n_threads);
        Ok(Loaded { model, store, placement, runner })
    }

    /// Makes the weights usable on the compute device for a phase (uploads or reads them
    /// when they live elsewhere; see `ParamStore::begin_phase`).
    pub fn begin(&mut self, weights: &Weights) -> Result<()> {
        let threads = self.runner.n_threads().max(1) as usize;
        self.store.begin_phase(&self.placement, |store, b| weights.load(store, b, "weights", threads))
    }

    /// Ends a phase: frees the compute buffer and any phase copy of the weights.
    pub fn end(&mut self) {
        self.runner.release();
        self.store.end_phase(&self.placement);
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
    /// The model files (weights read per phase with `params_backend=disk`).
    pub weights: Weights,
    pub devices: DeviceMap,
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

        let devices = DeviceMap::new(&DeviceOptions {
            backend: params.backend.as_deref(),
            params_backend: params.params_backend.as_deref(),
            split_mode: params.split_mode.as_deref(),
            max_vram: params.max_vram.as_deref(),
            rpc_servers: params.rpc_servers.as_deref(),
            stream_layers: params.stream_layers,
            auto_fit: params.auto_fit,
        })?;
        let te_place = devices.placement(Module::Te)?;
        let diffusion_place = devices.placement(Module::Diffusion)?;
        let vae_place = devices.placement(Module::Vae)?;
        let reference_kernels = reference_kernels_wanted(weights.types());
        for b in devices.backends() {
            if b.set_reference_kernels(reference_kernels) && reference_kernels {
                sd_info!("{}: using ggml's reference matrix kernels (quantized weights or SD_CPU_REFERENCE_KERNELS)", b.name());
            }
        }

        let cond = ClipConditioner::new(&weights, sd2, &params.embeddings, te_place, n_threads)?;

        let shape_of = |n: &str| weights.shape_of(n);
        let unet_cfg = UNetConfig::detect(&shape_of, "model.diffusion_model.", None)?;
        let mut unet = Loaded::load(&weights, diffusion_place, n_threads, "model.diffusion_model.", "diffusion model", |s| {
            UNetModel::new(s, &unet_cfg)
        })?;
        unet.runner.options.flash_attn = params.flash_attn || params.diffusion_flash_attn;
        unet.runner.options.conv_direct = params.diffusion_conv_direct;

        let family = if sd2 { LatentFamily::Sd2 } else { LatentFamily::Sd1 };
        let has_tae = weights.has_prefix(vae::tae::PREFIX);
        let sdxs = matches!(version, SdVersion::Sdxs512Ds | SdVersion::Sdxs09);
        let tae_preview_only = params.tae_preview_only && !sdxs;
        let load_tae = |decode_only: bool, placement: Placement| -> Result<Loaded<Vae>> {
            let cfg = TaeConfig::detect(weights.types(), vae::tae::PREFIX, |n| weights.shape_of(n), decode_only);
            Loaded::load(&weights, placement, n_threads, vae::tae::PREFIX, "TAE", |s| Vae::Tiny(TinyAutoEncoder::new(s, &cfg)))
        };
        ensure!(!sdxs || has_tae, "{} models need their tiny autoencoder (taesd_path)", version.name());
        let (mut first_stage, mut preview_vae) = if has_tae && !tae_preview_only {
            sd_info!("using TAE for encoding / decoding");
            (load_tae(false, vae_place.clone())?, None)
        } else {
            sd_info!("using VAE for encoding / decoding");
            let prefix = vae::autoencoder_kl::PREFIX;
            let cfg = VaeConfig::detect(weights.types(), prefix, |n| weights.shape_of(n), family, false);
            let kl = Loaded::load(&weights, vae_place.clone(), n_threads, prefix, "VAE", |s| Vae::Kl(AutoEncoderKL::new(s, &cfg)))?;
            let preview = if has_tae {
                sd_info!("using TAE for preview");
                Some(load_tae(true, vae_place)?)
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
            devices,
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

    /// SD 2.x checkpoints come with eps or v prediction and do not say which: like the
    /// reference, run the UNet once on a constant input at t = 999 and call it v when the
    /// output is far below the input on average.
    fn uses_v_parameterization(&mut self) -> Result<bool> {
        let x = Tensor::full(&[8, 8, 4, 1], 0.5);
        let context = Tensor::full(&[self.unet.model.config.context_dim as usize, 2, 1], 0.5);
        let concat = self.is_inpaint().then(|| Tensor::zeros(&[8, 8, self.unet.model.config.in_channels as usize - 4, 1]));
        let start = std::time::Instant::now();
        self.unet.begin(&self.weights)?;
        let out = unet::compute(&mut self.unet.runner, &self.unet.model, &x, &[999.0], &context, concat.as_ref(), None, None, 1.0);
        self.unet.end();
        let out = out?;
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
