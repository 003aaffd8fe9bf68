//! MiniT2I: T5 ([`MiniT2iConditioner`]), the MiniT2I transformer and no autoencoder (it
//! denoises pixels: `PixelSpace`). Its own denoiser (x0 prediction from noise × 2, linear
//! sigmas 1 → 0 whatever the scheduler) and no default flow shift, like the reference.

use super::{flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::{Module, F32};
use crate::models::diffusion::minit2i::{MiniT2iConfig, MiniT2iModel, EMPTY_TEXT_WIDTH};
use crate::models::te::t5::T5XXL_PREFIX;
use crate::models::vae::PixelSpace;
use crate::pipeline::conditioning::minit2i::MiniT2iConditioner;
use crate::types::Prediction;

/// Where the transformer's weights live (`diffusion_model_path` files hold `model.net.`).
const DIT_PREFIX: &str = "model.diffusion_model.model.net.";

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let cfg = MiniT2iConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    let mask_token = format!("{DIT_PREFIX}mask_token");
    let ty = weights.types().get(&mask_token).copied();
    ensure!(
        ty.is_none_or(|t| t == F32),
        "MiniT2I's mask_token is not stored as f32: the reference adds it to the f32 text states, which ggml cannot do with another type (store it as f32)"
    );
    let cond = MiniT2iConditioner::new(weights, &te_place, n_threads, params.eager_load)?;
    let width = cond.context_width();
    ensure!(
        width == cfg.txt_input_size,
        "the MiniT2I transformer takes text {} wide, {}",
        cfg.txt_input_size,
        if width == EMPTY_TEXT_WIDTH && !weights.has_prefix(T5XXL_PREFIX) {
            format!("and without T5 (t5xxl_path) the context is {EMPTY_TEXT_WIDTH} wide")
        } else {
            format!("the T5 encoder's states are {width} wide")
        }
    );
    let model = ctx.load_transformer(DIT_PREFIX, |s| MiniT2iModel::new(s, &cfg))?;
    sd_info!("using FakeVAE");
    Ok(flow_parts(params, Box::new(cond), Box::new(model), (Box::new(PixelSpace), None), Prediction::Minit2iFlow, f32::INFINITY))
}
