//! Z-Image: the Qwen3 LLM conditioner (`LlmConditioner` with the Z-Image template), the
//! Z-Image transformer and the 16-channel AutoencoderKL of Flux.1 (`vae_path`). Flow
//! prediction with the default shift 3, like the reference. Reference images (the
//! `z_image_omni` preset) become tokens of the transformer and, passed to the LLM, switch it
//! to the omni template ([`ZIMAGE_OMNI_TEMPLATE`]).
//!
//! The LLM (`llm_path`) is read for each conditioning phase and freed before sampling unless
//! the context's `eager_load` keeps it resident.

use super::flux::DIT_PREFIX;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::zimage::{ZImageConfig, ZImageModel};
use crate::pipeline::conditioning::llm::{LlmConditioner, ZIMAGE_OMNI_TEMPLATE, ZIMAGE_TEMPLATE};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = ZImageConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    ensure!(cfg.num_layers > 0, "no Z-Image transformer layers found under '{DIT_PREFIX}'");
    cfg.validate()?;
    let cond = LlmConditioner::new(weights, ZIMAGE_TEMPLATE, &te_place, n_threads, params.eager_load)?.with_ref_image_template(ZIMAGE_OMNI_TEMPLATE);
    ensure_text_width(cond.context_width() as i64, cfg.cap_feat_dim, "the Z-Image transformer's cap_embedder", "")?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| ZImageModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}
