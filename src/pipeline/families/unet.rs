//! The UNet families (SD 1.x, SD 2.x, SDXL and their inpaint / instruct-pix2pix / tiny /
//! SDXS / SSD-1B / Vega variants): CLIP conditioning, the LDM UNet and an AutoencoderKL or
//! a tiny autoencoder, like the reference's `FrozenCLIPEmbedderWithCustomWords`,
//! `UNetModelRunner` and `AutoEncoderKL`.

use super::{first_stage, BuildCtx, Concat, Parts, PredictionRule};
use crate::error::{Context as _, Result};
use crate::graph::{Component, Loaded, Module};
use crate::models::condition::Condition;
use crate::models::diffusion::unet::motion::MotionConfig;
use crate::models::diffusion::unet::{UNetConfig, UNetModel, UNetVersion};
use crate::models::diffusion::{DiffusionInput, DiffusionModel};
use crate::pipeline::conditioning::clip::{ClipConditioner, ClipSet};
use crate::pipeline::ip_adapter::IpAdapterModel;
use crate::pipeline::loader::Weights;
use crate::runtime::denoiser::Denoiser;
use crate::runtime::schedulers::TIMESTEPS;
use crate::tensor::Tensor;
use crate::types::Prediction;

/// Where the UNet's weights live in a checkpoint (and where split files are put).
const UNET_PREFIX: &str = "model.diffusion_model.";

pub(super) fn build(ctx: &mut BuildCtx<'_>, unet_version: UNetVersion, text: ClipSet) -> Result<Parts> {
    let (params, weights, spec, n_threads) = (ctx.params, ctx.weights, ctx.spec, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    // Without `eager_load` the UNet is read when it first samples (as the reference prepares
    // its weights), so SDXL's 5 GB are not resident beside the text encoders' conditioning.
    let diffusion_place = ctx.diffusion_placement()?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    // The text encoders are read per conditioning phase unless `eager_load` (like every
    // family's): SDXL's CLIP-G is 1.4 GB in f16, not needed while the UNet samples.
    let cond = ClipConditioner::new(weights, text, &params.embeddings, &te_place.resident_or_per_phase(params.eager_load), n_threads)?;

    let shape_of = |n: &str| weights.shape_of(n);
    let mut unet_cfg = UNetConfig::detect(&shape_of, UNET_PREFIX, Some(unet_version))?;
    // Like the reference, the motion module's file joins the checkpoint under
    // `model.diffusion_model.motion_module.` (other families warn and leave it unread).
    let motion_path = params.motion_module_path.as_deref().filter(|p| !p.is_empty());
    if let (Some(path), true) = (motion_path, spec.motion_modules) {
        match MotionConfig::detect(&shape_of, &format!("{UNET_PREFIX}motion_module.")) {
            Some(motion) => {
                MotionConfig::check_unet(unet_cfg.model_channels, &unet_cfg.channel_mult, unet_cfg.num_res_blocks)?;
                sd_debug!("AnimateDiff motion modules, middle block module: {}", motion.mid_block);
                unet_cfg.motion = Some(motion);
            }
            None => sd_warn!(
                "'{path}' holds no AnimateDiff motion module (no 'down_blocks.0.motion_modules.0.temporal_transformer.proj_in.weight'); ignoring motion_module_path"
            ),
        }
    }
    ensure!(
        unet_cfg.context_dim as usize == cond.context_dim(),
        "the UNet's cross-attention width {} does not match the text encoders' {}",
        unet_cfg.context_dim,
        cond.context_dim()
    );
    let mut unet = weights.load_model(diffusion_place, n_threads, UNET_PREFIX, "diffusion model", |s| UNetModel::new(s, &unet_cfg))?;
    unet.runner.options.flash_attn = params.flash_attn || params.diffusion_flash_attn;
    unet.runner.options.conv_direct = params.diffusion_conv_direct;
    // On the fast path the UNet's products sum in their own order too (on AMX tiles they
    // are most of what the fast path buys an SDXL step): within the bound with Winograd.
    unet.runner.options.cpu_fast_products = unet.runner.options.fast;
    unet.runner.options.cpu_fast_q8_0 = unet.runner.options.fast;
    if params.diffusion_conv_direct {
        sd_info!("Using Conv2d direct in the diffusion model");
    }

    // Like the reference, the adapter's image projection runs where the diffusion model does.
    let ip_adapter = match params.ip_adapter_path.as_deref().filter(|p| !p.is_empty()) {
        Some(path) => {
            let (place, clip_place) = (ctx.devices.placement(Module::Diffusion)?, ctx.devices.placement(Module::ClipVision)?);
            let ip = IpAdapterModel::load(weights, place, clip_place, n_threads, unet.model.config.ip_context_dim);
            Some(ip.with_context(|| format!("load IP-Adapter from '{path}' failed"))?)
        }
        None => None,
    };

    let (first_stage, preview) = first_stage::build(ctx, vae_place)?;

    let alphas_cumprod = load_alphas_cumprod(weights);
    let prediction = match params.prediction {
        Some(p) => p,
        None => match spec.prediction {
            PredictionRule::Fixed(p) => p,
            PredictionRule::ProbeV => {
                if uses_v_parameterization(&mut unet, spec.concat == Concat::Inpaint)? {
                    Prediction::V
                } else {
                    Prediction::Eps
                }
            }
            PredictionRule::SdxlMarkers => {
                if weights.get("edm_vpred.sigma_max").is_some() {
                    Prediction::EdmV
                } else if weights.get("v_pred").is_some() {
                    Prediction::V
                } else {
                    Prediction::Eps
                }
            }
        },
    };
    ensure!(
        matches!(prediction, Prediction::Eps | Prediction::V | Prediction::EdmV),
        "prediction '{}' does not apply to {} models",
        prediction.name(),
        ctx.version.name()
    );
    Ok(Parts {
        cond: Box::new(cond),
        diffusion: Box::new(unet),
        first_stage,
        preview,
        prediction,
        denoiser: Denoiser::new(prediction, alphas_cumprod.as_deref()),
        default_flow_shift: None,
        high_noise: None,
        video_cond: super::VideoCond::Text,
        clip_vision: None,
        ip_adapter,
    })
}

/// SD 2.x checkpoints come with eps or v prediction and do not say which: like the
/// reference, run the UNet once on a constant input at t = 999 and call it v when the
/// output is far below the input on average.
fn uses_v_parameterization(unet: &mut Loaded<UNetModel>, inpaint: bool) -> Result<bool> {
    let cfg = unet.model.config.clone();
    let x = Tensor::full(&[8, 8, 4, 1], 0.5);
    let cond = Condition {
        crossattn: Some(Tensor::full(&[cfg.context_dim as usize, 2, 1], 0.5)),
        vector: None,
        concat: inpaint.then(|| Tensor::zeros(&[8, 8, cfg.in_channels as usize - 4, 1])),
        extra_context: None,
        token_types: None,
    };
    let start = std::time::Instant::now();
    Component::begin(unet)?;
    let out = unet.compute(&DiffusionInput::new(&x, &[999.0], &cond));
    Component::end(unet);
    let out = out?;
    let mean = out.data().iter().zip(x.data()).map(|(&o, &i)| (o - i) as f64).sum::<f64>() / out.len() as f64;
    sd_debug!("check is_using_v_parameterization_for_sd2, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(mean < -1.0)
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
