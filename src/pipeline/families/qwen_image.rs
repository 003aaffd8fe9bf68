//! Qwen-Image (and Qwen-Image-Edit: reference images as extra latent tokens): the
//! Qwen2.5-VL LLM conditioner ([`QWEN_IMAGE_TEMPLATE`]), the Qwen-Image transformer and the
//! Wan2.1 VAE on single frames (`vae_path`). Flow prediction with the default shift 3, like
//! the reference.
//!
//! The LLM (`llm_path`) is read for each conditioning phase and freed before sampling unless
//! the context's `eager_load` keeps it resident. With a vision tower (`llm_vision_path`, or
//! `visual.` weights in the LLM file) reference images are also described to the LLM
//! (`conditioning::qwen_edit`); without one they reach only the transformer, like the
//! reference.
//! Qwen-Image-Layered is the same build: its transformer always adds the layer embedding
//! and it never reads pictures with the vision tower (the reference turns it off).

use super::flux::DIT_PREFIX;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::qwen_image::{QwenImageConfig, QwenImageModel};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::pipeline::conditioning::qwen_edit;
use crate::runtime::args::{parse_key_value_args, parse_strict_bool};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;

/// Qwen-Image asks Qwen2.5-VL to describe the image in a system prompt and reads the normed
/// final state, without the system prompt's 34 tokens.
pub const QWEN_IMAGE_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen25Vl,
    prefix: "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
    lead: "",
    out_layers: &[],
    min_length: 0,
    drop_first: 34,
    zero_pad_to: 0,
    max_length: 0,
};

/// `qwen_image_zero_cond_t` of the context's `model_args`: Edit 2511's zero-timestep
/// modulation of the reference tokens for files without the marker tensor.
fn zero_cond_t_arg(model_args: Option<&str>) -> bool {
    let mut on = false;
    for (k, v) in parse_key_value_args(model_args, "model arg") {
        if k == "qwen_image_zero_cond_t" {
            match parse_strict_bool(&v) {
                Some(b) => on |= b,
                None => sd_warn!("ignoring invalid Qwen Image model arg '{k}={v}'"),
            }
        }
    }
    on
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let mut cfg = QwenImageConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.zero_cond_t |= zero_cond_t_arg(params.model_args.as_deref());
    cfg.use_additional_t_cond |= ctx.spec.is_layered();
    cfg.validate()?;
    let mut cond = LlmConditioner::new(weights, QWEN_IMAGE_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    // Like the reference, Layered never describes its input image to the LLM.
    if !ctx.spec.is_layered() {
        cond.open_vision(weights, qwen_edit::QWEN_EDIT, &te_place, n_threads, params.eager_load)?;
    }
    ensure_text_width(cond.context_width() as i64, cfg.joint_attention_dim, "the Qwen-Image transformer's txt_in", "")?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| QwenImageModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START};
    use crate::pipeline::conditioning::llm::tokenize;

    /// The system prompt is exactly the 34 tokens the conditioner drops: what remains is the
    /// prompt and the assistant turn.
    #[test]
    fn system_prompt_is_dropped() {
        let tok = qwen_tokenizer::shared().unwrap();
        let empty = tokenize(tok, &QWEN_IMAGE_TEMPLATE, "");
        assert_eq!(empty.ids.len(), 34 + 5);
        assert_eq!(&empty.ids[34..], &[IM_END, 198, IM_START, 77091, 198]);
        let t = tokenize(tok, &QWEN_IMAGE_TEMPLATE, "a lovely cat");
        assert_eq!(&t.ids[34..37], &[64, 16690, 8251]);
        assert_eq!(t.ids[..34], empty.ids[..34]);
    }

    #[test]
    fn zero_cond_t_model_arg() {
        assert!(!zero_cond_t_arg(None));
        assert!(zero_cond_t_arg(Some("qwen_image_zero_cond_t=true")));
        assert!(!zero_cond_t_arg(Some("qwen_image_zero_cond_t=maybe,chroma_use_dit_mask=false")));
    }
}
