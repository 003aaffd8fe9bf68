//! HunyuanVideo 1.5: the Qwen2.5-VL LLM conditioner ([`HUNYUAN_VIDEO_TEMPLATE`]), the
//! HunyuanVideo transformer (`models::diffusion::hunyuan_video`) and its VAE
//! (`models::vae::hunyuan`). Flow prediction with the default shift 7, like the reference.
//!
//! Image to video like the reference: the start (and end) picture, each encoded alone by the
//! VAE's encoder, is the first (last) latent frame of the transformer's concatenated
//! conditioning, with a frame mask (`VideoCond::ConcatKeyFrames`); a decode-only VAE file
//! refuses them. With a ByT5 glyph encoder (`t5xxl_path`, a T5 encoder 1472 wide) the
//! prompt's quoted text ("…", ‘…’, “…”) is encoded byte by byte (`Text "…". ` per quote)
//! and handed to the transformer's `byt5_in` beside the LLM's tokens, as the reference does.

use super::flux::DIT_PREFIX;
use super::{first_stage, flow_parts, BuildCtx, Parts, VideoCond};
use crate::error::Result;
use crate::graph::{Component, Components, Module};
use crate::models::diffusion::hunyuan_video::{HunyuanVideoConfig, HunyuanVideoModel, BYT5_WIDTH};
use crate::models::te::llm::LlmArch;
use crate::models::te::t5_tokenizer::T5Vocab;
use crate::models::Condition;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::pipeline::conditioning::t5::T5Text;
use crate::pipeline::conditioning::{CondRequest, Conditioner};
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

/// The ByT5 tokens of the prompt's quoted text: each quote (straight double quotes first,
/// then ‘…’, then “…”) as `Text "…". `, its bytes shifted by 3, then EOS (1); `None` without
/// quotes.
pub fn glyph_tokens(prompt: &str) -> Option<Vec<u32>> {
    let mut quoted = Vec::new();
    for (open, close) in [("\"", "\""), ("\u{2018}", "\u{2019}"), ("\u{201C}", "\u{201D}")] {
        let mut from = 0;
        while let Some(at) = prompt[from..].find(open) {
            let begin = from + at + open.len();
            let Some(len) = prompt[begin..].find(close) else { break };
            quoted.push(&prompt[begin..begin + len]);
            from = begin + len + close.len();
        }
    }
    if quoted.is_empty() {
        return None;
    }
    let text: String = quoted.iter().map(|q| format!("Text \"{q}\". ")).collect();
    Some(text.bytes().map(|b| b as u32 + 3).chain([1]).collect())
}

/// The LLM's context, and with a glyph encoder the ByT5 states of the prompt's quoted text
/// (`Condition::extra_context`).
struct HunyuanConditioner {
    llm: LlmConditioner,
    byt5: Option<T5Text>,
}

impl Components for HunyuanConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let mut parts = self.llm.components();
        if let Some(b) = &mut self.byt5 {
            parts.push(b.component());
        }
        parts
    }
}

impl Conditioner for HunyuanConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let mut cond = self.llm.encode(req)?;
        if let (Some(byt5), Some(ids)) = (&mut self.byt5, glyph_tokens(req.text)) {
            cond.extra_context = Some(byt5.encode(&ids, None)?);
        }
        Ok(cond)
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = HunyuanVideoConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    let latent = ctx.spec.latent.channels as i64;
    ensure!(cfg.out_channels == latent, "the HunyuanVideo transformer makes {} latent channels, its VAE's latents have {latent}", cfg.out_channels);
    ensure!(cfg.in_channels >= latent, "the HunyuanVideo transformer takes {} channels, fewer than the latent's {latent}", cfg.in_channels);
    // An encoder the transformer cannot read is not loaded, even eagerly.
    let byt5 = T5Text::open(weights, T5Vocab::T5, &te_place, n_threads, params.eager_load && cfg.use_byt5)?;
    if let Some(b) = &byt5 {
        ensure!(b.width() as i64 == BYT5_WIDTH, "the glyph encoder (t5xxl_path) is {} wide; HunyuanVideo reads ByT5's {BYT5_WIDTH}", b.width());
        if !cfg.use_byt5 {
            sd_warn!("HunyuanVideo: the transformer has no glyph mapper (byt5_in); the ByT5 encoder (t5xxl_path) is not used");
        }
    }
    let byt5 = byt5.filter(|_| cfg.use_byt5);
    let llm = LlmConditioner::new(weights, HUNYUAN_VIDEO_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    let width = llm.context_width() as i64;
    ensure!(
        width == cfg.context_in_dim,
        "the LLM's hidden states are {width} wide, the HunyuanVideo transformer takes {} (Qwen2.5-VL 7B's 3584)",
        cfg.context_in_dim
    );
    let model = ctx.load_transformer(DIT_PREFIX, |s| HunyuanVideoModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    let cond = HunyuanConditioner { llm, byt5 };
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

    /// Quotes of each kind in the reference's order, bytes shifted by 3, EOS last.
    #[test]
    fn glyph_tokens_of_quoted_text() {
        assert_eq!(glyph_tokens("a cat"), None);
        assert_eq!(glyph_tokens("an \"open quote"), None);
        let ids = glyph_tokens("a sign \u{201C}OPEN\u{201D} and \"Hi\" and \u{2018}é\u{2019}").unwrap();
        let text = "Text \"Hi\". Text \"é\". Text \"OPEN\". ";
        let want: Vec<u32> = text.bytes().map(|b| b as u32 + 3).chain([1]).collect();
        assert_eq!(ids, want);
    }
}
