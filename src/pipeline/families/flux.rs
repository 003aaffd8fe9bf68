//! The Flux family (Flux.1 dev / schnell / Fill / Controls, Flex.2, Kontext through
//! reference images, Chroma): `FluxConditioner` (CLIP-L + T5) or, for Chroma,
//! `ChromaConditioner` (T5 only), the Flux transformer and the 16-channel AutoencoderKL.
//! Flux flow prediction with the default shift 1.15 when the model embeds guidance (dev),
//! 1.0 otherwise (schnell, Chroma), like the reference.

use super::{first_stage, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::flux::{Flux, FluxConfig, FluxModel, FluxOptions, FluxVariant};
use crate::pipeline::conditioning::flux::{ChromaConditioner, ChromaTextOptions, FluxConditioner};
use crate::pipeline::conditioning::Conditioner;
use crate::runtime::args::{parse_key_value_args, parse_strict_bool};
use crate::runtime::denoiser::Denoiser;
use crate::types::Prediction;

/// Where the transformer's weights live (`diffusion_model_path` files are put there).
pub(super) const DIT_PREFIX: &str = "model.diffusion_model.";

/// `chroma_use_dit_mask` of the context's `model_args` (default true).
fn chroma_use_dit_mask(model_args: Option<&str>) -> bool {
    let mut use_mask = true;
    for (k, v) in parse_key_value_args(model_args, "model arg") {
        if k == "chroma_use_dit_mask" {
            match parse_strict_bool(&v) {
                Some(b) => use_mask = b,
                None => sd_warn!("ignoring invalid Chroma DiT model arg '{k}={v}'"),
            }
        }
    }
    use_mask
}

pub(super) fn build(ctx: &mut BuildCtx<'_>, variant: FluxVariant) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let diffusion_place = ctx.devices.placement(Module::Diffusion)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let shape_of = |n: &str| weights.shape_of(n);
    let cfg = FluxConfig::detect(weights.types(), &shape_of, DIT_PREFIX, variant);
    ensure!(cfg.depth + cfg.depth_single_blocks > 0, "no Flux transformer blocks found under '{DIT_PREFIX}'");
    let t5_resident = params.eager_load;
    let cond: Box<dyn Conditioner> = if cfg.is_chroma {
        sd_info!("Using pruned modulation (Chroma)");
        let options = ChromaTextOptions::parse(params.model_args.as_deref());
        Box::new(ChromaConditioner::new(weights, &te_place, n_threads, t5_resident, options)?)
    } else {
        Box::new(FluxConditioner::new(weights, &te_place, n_threads, t5_resident)?)
    };

    let mut model = weights.load_model(diffusion_place, n_threads, DIT_PREFIX, "diffusion model", |s| FluxModel::new(s, &cfg))?;
    model.runner.options.flash_attn = params.flash_attn || params.diffusion_flash_attn;
    model.runner.options.conv_direct = params.diffusion_conv_direct;
    let diffusion = Flux { model, options: FluxOptions { use_mask: chroma_use_dit_mask(params.model_args.as_deref()) } };

    let (first_stage, preview) = first_stage::build(ctx, vae_place)?;
    let prediction = params.prediction.unwrap_or(Prediction::FluxFlow);
    // The reference picks the default shift only when it chose the prediction itself.
    let default_flow_shift = params.prediction.is_none().then_some(if cfg.guidance_embed { 1.15 } else { 1.0 });
    Ok(Parts {
        cond,
        diffusion: Box::new(diffusion),
        first_stage,
        preview,
        prediction,
        denoiser: Denoiser::new(prediction, None),
        default_flow_shift,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dit_mask_model_arg() {
        assert!(chroma_use_dit_mask(None));
        assert!(!chroma_use_dit_mask(Some("chroma_use_dit_mask=false")));
        assert!(chroma_use_dit_mask(Some("chroma_use_dit_mask=nope")));
    }
}
