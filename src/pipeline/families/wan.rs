//! Wan 2.1 / 2.2: UMT5-XXL text (the reference's T5 conditioner with UMT5's tokenizer, the
//! encoder masked, 512 tokens; zeros without `t5xxl_path`), the Wan transformer under
//! `model.diffusion_model.`, optionally a second one for the high-noise steps
//! (`high_noise_diffusion_model_path`, Wan2.2 A14B's mixture of two experts), and the Wan
//! VAE (2.1's 16 channels, or 2.2's 48 for TI2V 5B). Flow prediction with the default shift 5.

use super::{first_stage, flow_parts, BuildCtx, Parts, VideoCond};
use crate::pipeline::conditioning::clip_vision::ClipVision;
use crate::error::{Context as _, Result};
use crate::graph::Module;
use crate::io::source::Component;
use crate::models::diffusion::wan::{WanConfig, WanModel};
use crate::pipeline::conditioning::flux::{T5Conditioner, T5TextOptions};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 5.0;

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let prefix = Component::DiffusionModel.prefix();
    let cfg = WanConfig::detect(weights.types(), &|n| weights.shape_of(n), prefix)?;
    cfg.validate()?;
    let high_prefix = Component::HighNoiseDiffusionModel.prefix();
    let high_cfg = if weights.has_prefix(high_prefix) {
        let hi = WanConfig::detect(weights.types(), &|n| weights.shape_of(n), high_prefix)
            .context("the high noise diffusion model (high_noise_diffusion_model_path) is not a Wan transformer")?;
        hi.validate()?;
        ensure!(
            (hi.in_dim, hi.out_dim, hi.mode) == (cfg.in_dim, cfg.out_dim, cfg.mode),
            "the high noise diffusion model is a {} ({} channels in), the diffusion model a {} ({} channels in): they must be the two experts of one model",
            hi.desc(),
            hi.in_dim,
            cfg.desc(),
            cfg.in_dim
        );
        Some(hi)
    } else {
        None
    };

    let cond = T5Conditioner::new(weights, &te_place, n_threads, params.eager_load, T5TextOptions::WAN)?;
    let model = ctx.load_transformer(prefix, |s| WanModel::new(s, &cfg))?;
    let high_noise = match &high_cfg {
        Some(hi) => Some(Box::new(ctx.load_transformer(high_prefix, |s| WanModel::new(s, hi))?) as Box<_>),
        None => None,
    };
    let video_cond = video_cond(cfg.desc());
    let clip_vision = match video_cond {
        VideoCond::ConcatFrames { clip: true, .. } => {
            let place = ctx.devices.placement(Module::ClipVision)?;
            Some(ClipVision::load(weights, place, n_threads, Some(cfg.clip_dim), cfg.desc())?)
        }
        _ => None,
    };
    let first = first_stage::build(ctx, vae_place)?;
    let mut parts = flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT);
    parts.high_noise = high_noise;
    parts.video_cond = video_cond;
    parts.clip_vision = clip_vision;
    Ok(parts)
}

/// How the reference conditions a Wan model on pictures, by its description: the I2V and
/// FLF2V models on encoded frames (the 2.1 ones with CLIP-vision tokens, of both pictures
/// only for the 14B FLF2V), TI2V on fixed latent frames, VACE on its context.
fn video_cond(desc: &str) -> VideoCond {
    match desc {
        "Wan2.1-I2V-14B" | "Wan2.1-I2V-1.3B" => VideoCond::ConcatFrames { clip: true, end_clip: false },
        "Wan2.1-FLF2V-14B" => VideoCond::ConcatFrames { clip: true, end_clip: true },
        "Wan2.2-I2V-14B" => VideoCond::ConcatFrames { clip: false, end_clip: false },
        "Wan2.2-TI2V-5B" => VideoCond::FixedFrames,
        "Wan2.1-VACE-1.3B" | "Wan2.x-VACE-14B" => VideoCond::Vace,
        _ => VideoCond::Text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picture_conditioning_follows_the_model_description() {
        assert_eq!(video_cond("Wan2.1-T2V-1.3B"), VideoCond::Text);
        assert_eq!(video_cond("Wan2.x-T2V-14B"), VideoCond::Text);
        assert_eq!(video_cond("Wan2.1-I2V-1.3B"), VideoCond::ConcatFrames { clip: true, end_clip: false });
        assert_eq!(video_cond("Wan2.1-FLF2V-14B"), VideoCond::ConcatFrames { clip: true, end_clip: true });
        assert_eq!(video_cond("Wan2.2-I2V-14B"), VideoCond::ConcatFrames { clip: false, end_clip: false });
        assert_eq!(video_cond("Wan2.2-TI2V-5B"), VideoCond::FixedFrames);
        assert_eq!(video_cond("Wan2.1-VACE-1.3B"), VideoCond::Vace);
    }
}
