//! Flux.2 klein: the Qwen3 LLM conditioner (`Flux2Conditioner`), the Flux.2 transformer
//! (the Flux network configured with shared modulations, SwiGLU MLPs and no biases) and
//! the 32-channel AutoencoderKL with patchified, normalised latents. Flux flow prediction;
//! the default shift is 1.15 when the model embeds guidance, else 1.0 (the default `flux2`
//! scheduler ignores it), like the reference.

use super::flux::DIT_PREFIX;
use super::{first_stage, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::flux::{Flux, FluxConfig, FluxModel, FluxOptions, FluxVariant};
use crate::pipeline::conditioning::flux2::Flux2Conditioner;
use crate::runtime::denoiser::Denoiser;
use crate::types::Prediction;

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let diffusion_place = ctx.devices.placement(Module::Diffusion)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let shape_of = |n: &str| weights.shape_of(n);
    let cfg = FluxConfig::detect(weights.types(), &shape_of, DIT_PREFIX, FluxVariant::Flux2);
    ensure!(cfg.depth + cfg.depth_single_blocks > 0, "no Flux.2 transformer blocks found under '{DIT_PREFIX}'");
    let cond = Flux2Conditioner::new(weights, &te_place, n_threads, cfg.context_in_dim)?;

    let mut model = weights.load_model(diffusion_place, n_threads, DIT_PREFIX, "diffusion model", |s| FluxModel::new(s, &cfg))?;
    model.runner.options.flash_attn = params.flash_attn || params.diffusion_flash_attn;
    model.runner.options.conv_direct = params.diffusion_conv_direct;
    let diffusion = Flux { model, options: FluxOptions { use_mask: false } };

    let (first_stage, preview) = first_stage::build(ctx, vae_place)?;
    let prediction = params.prediction.unwrap_or(Prediction::FluxFlow);
    let default_flow_shift = params.prediction.is_none().then_some(if cfg.guidance_embed { 1.15 } else { 1.0 });
    Ok(Parts {
        cond: Box::new(cond),
        diffusion: Box::new(diffusion),
        first_stage,
        preview,
        prediction,
        denoiser: Denoiser::new(prediction, None),
        default_flow_shift,
    })
}
