//! Anima: its conditioner (a Qwen3 LLM read to its final normed state, plus the prompt's T5
//! token ids), the Anima DiT with its LLM adapter, and the Wan2.1 VAE on single frames. Flow
//! prediction with the default shift 3 and the model timestep `t / 1000`, like the
//! reference. Reference images become latent tokens after the image's (the
//! `cosmos_reference` preset: encoded at their own size).

use super::{first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::anima::{AnimaConfig, AnimaModel, CONTEXT_DIM};
use crate::pipeline::conditioning::anima::AnimaConditioner;
use crate::types::Prediction;

/// Where the loader puts the transformer's names (`net.` kept or added).
pub const DIT_PREFIX: &str = "model.diffusion_model.net.";

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = AnimaConfig::detect(weights.types(), DIT_PREFIX);
    ensure!(cfg.num_layers > 0, "no Anima transformer blocks found under '{DIT_PREFIX}blocks.'");
    let cond = AnimaConditioner::new(weights, &te_place, n_threads, params.eager_load)?;
    let width = cond.context_width();
    ensure!(
        width as i64 == CONTEXT_DIM,
        "the LLM's hidden states are {width} wide, Anima's LLM adapter reads {CONTEXT_DIM} (a Qwen3 of hidden size {CONTEXT_DIM})"
    );

    let model = ctx.load_transformer(DIT_PREFIX, |s| AnimaModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}
