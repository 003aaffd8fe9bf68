//! Lens: the GPT-OSS-20B LLM conditioner ([`LENS_TEMPLATE`]), the Lens transformer and
//! Flux.2's 32-channel AutoencoderKL with patchified, normalised latents. Flux-style flow
//! prediction (the timestep is sigma) with the default shift 1.83, like the reference.

use super::flux::DIT_PREFIX;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::lens::{LensConfig, LensModel};
use crate::pipeline::conditioning::gpt_oss::{GptOssConditioner, LENS_TEMPLATE};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 1.83;

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = LensConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    ctx.ensure_latent_channels(cfg.in_channels, "the Lens transformer", "the Flux.2 VAE's patchified latents have")?;
    let cond = GptOssConditioner::new(weights, LENS_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    let hint = format!("{} layers of GPT-OSS-20B's 2880: it reads layers 6, 12, 18 and 24", cfg.selected_layers);
    ensure_text_width(cond.context_width() as i64, cfg.context_width(), "the Lens transformer", &hint)?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| LensModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::FluxFlow, DEFAULT_FLOW_SHIFT))
}
