//! SD3 / SD3.5: `Sd3Conditioner` (CLIP-L, CLIP-G, T5, each optional), the MMDiT and the
//! 16-channel AutoencoderKL; discrete flow prediction with shift 3 by default.

use super::flux::DIT_PREFIX;
use super::{first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::mmdit::{MmditConfig, MmditModel};
use crate::pipeline::conditioning::sd3::{Sd3Conditioner, CONTEXT_WIDTH};
use crate::types::Prediction;

/// SD3's default flow shift.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cond = Sd3Conditioner::new(weights, &te_place, n_threads, params.eager_load)?;
    let shape_of = |n: &str| weights.shape_of(n);
    let cfg = MmditConfig::detect(weights.types(), &shape_of, DIT_PREFIX);
    ensure!(
        cfg.context_size as usize == CONTEXT_WIDTH,
        "the MMDiT's context embedder takes {} features, SD3 conditioning gives {CONTEXT_WIDTH}",
        cfg.context_size
    );
    ensure!(cfg.hidden_size % cfg.depth as i64 == 0, "MMDiT width {} is not a multiple of its {} heads", cfg.hidden_size, cfg.depth);
    let model = ctx.load_transformer(DIT_PREFIX, |s| MmditModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}
