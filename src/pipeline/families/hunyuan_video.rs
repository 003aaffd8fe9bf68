//! HunyuanVideo 1.5: the Qwen2.5-VL LLM conditioner ([`HUNYUAN_VIDEO_TEMPLATE`]), the
//! HunyuanVideo transformer (`models::diffusion::hunyuan_video`) and its VAE
//! (`models::vae::hunyuan`). Flow prediction with the default shift 7, like the reference.
//!
//! Image to video like the reference: the start (and end) picture, each encoded alone by the
//! VAE's encoder, is the first (last) latent frame of the transformer's concatenated
//! conditioning, with a frame mask (`VideoCond::ConcatKeyFrames`); a decode-only VAE file
//! refuses them. The reference's optional ByT5 glyph encoder (`t5xxl_path`, for quoted text
//! in the prompt) is not supported: its weights are ignored with a warning.

use super::flux::DIT_PREFIX;
use super::{first_stage, flow_parts, BuildCtx, Parts, VideoCond};
use crate::error::Result;
use crate::graph::Module;
use crate::io::source::Component;
use crate::models::diffusion::hunyuan_video::{HunyuanVideoConfig, HunyuanVideoModel};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 7.0;

/// HunyuanVideo asks Qwen2.5-VL to describe the video in a system prompt and reads layer 26
/// (the normed final state when the LLM has fewer layers), without the template's first 98
/// tokens.
pub const HUNYUAN_VIDEO_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen25Vl,
    prefix: "<|im_start|>system\nYou are a helpful assistant. Describe the video by detailing the following aspects:\n\
             1. The main content and theme of the video.\n\
             2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.\n\
             3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.\n\
             4. background environment, light, style and atmosphere.\n\
             5. camera angles, movements, and transitions used in the video.<|im_end|>\n\
             <|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
    lead: "",
    out_layers: &[26],
    min_length: 0,
    drop_first: 98,
    zero_pad_to: 0,
    max_length: 0,
};

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = HunyuanVideoConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    let latent = ctx.spec.latent.channels as i64;
    ensure!(cfg.out_channels == latent, "the HunyuanVideo transformer makes {} latent channels, its VAE's latents have {latent}", cfg.out_channels);
    ensure!(cfg.in_channels >= latent, "the HunyuanVideo transformer takes {} channels, fewer than the latent's {latent}", cfg.in_channels);
    if weights.has_prefix(Component::T5xxl.prefix()) {
        sd_warn!("HunyuanVideo: the ByT5 glyph encoder (t5xxl_path) is not supported yet; its weights are ignored and quoted text in the prompt is not given to the transformer");
    }
    let cond = LlmConditioner::new(weights, HUNYUAN_VIDEO_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    let width = cond.context_width() as i64;
    ensure!(
        width == cfg.context_in_dim,
        "the LLM's hidden states are {width} wide, the HunyuanVideo transformer takes {} (Qwen2.5-VL 7B's 3584)",
        cfg.context_in_dim
    );
    let model = ctx.load_transformer(DIT_PREFIX, |s| HunyuanVideoModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    let mut parts = flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT);
    parts.video_cond = VideoCond::ConcatKeyFrames;
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer;
    use crate::pipeline::conditioning::llm::tokenize;

    /// The template alone is more than the 98 tokens the reference drops, the prompt's
    /// tokens follow them.
    #[test]
    fn template_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let empty = tokenize(tok, &HUNYUAN_VIDEO_TEMPLATE, "");
        let cat = tokenize(tok, &HUNYUAN_VIDEO_TEMPLATE, "a lovely cat");
        assert_eq!(cat.ids.len(), empty.ids.len() + 3);
        assert!(empty.ids.len() > HUNYUAN_VIDEO_TEMPLATE.drop_first);
    }
}
