//! Mage-Flow: the LLM conditioner with Qwen3-VL's text model and Qwen-Image's template
//! ([`MAGE_FLOW_TEMPLATE`]), the Qwen-Image transformer at the sizes the reference fixes for
//! Mage-Flow (`models::diffusion::mage_flow`) and the Mage VAE. Flow prediction with the
//! default shift 6, like the reference. Reference images become latent tokens after the
//! image's (the `mage_flow` preset: resized to the request's size, numbered from 1).
//!
//! When the files hold a Qwen3-VL vision tower (`llm_vision_path`, or `visual.` in the LLM
//! file) reference images are also shown to the LLM in Qwen-Image's edit prompt with
//! `Image N: ` labels (`MageFlowEditPipeline`; the preset sizes them to at most 384 pixels on
//! the longest side), as the reference does. Like the reference, only the first 2048 tokens
//! after the system prompt are read (the template's end is cut with the rest; a warning).

use super::flux::DIT_PREFIX;
use super::qwen_image::QWEN_IMAGE_TEMPLATE;
use super::{first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::mage_flow;
use crate::models::diffusion::qwen_image::QwenImageModel;
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::pipeline::conditioning::qwen_edit::{EditTemplate, QWEN_EDIT};
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 6.0;

/// Qwen-Image's system prompt and turns around the prompt, read by Qwen3-VL, without the
/// system prompt's 34 tokens.
pub const MAGE_FLOW_TEMPLATE: LlmTemplate = LlmTemplate { arch: LlmArch::Qwen3Vl, max_length: MAX_TOKENS + QWEN_IMAGE_TEMPLATE.drop_first, ..QWEN_IMAGE_TEMPLATE };

/// The prompt tokens the reference reads after the system prompt; the rest is cut.
const MAX_TOKENS: usize = 2048;

/// Qwen-Image-Edit's prompt with `Image N: ` labels (the same token count as `Picture N: `,
/// so the reference's positions hold) and no lower size bound; the `mage_flow` preset sets
/// the upper one (384 on the longest side).
pub const MAGE_FLOW_EDIT: EditTemplate =
    EditTemplate { pipeline: "MageFlowEditPipeline", label: "Image ", min_size: -1, max_size: 384, max_length: MAX_TOKENS + QWEN_EDIT.drop_first, ..QWEN_EDIT };

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = mage_flow::config();
    cfg.validate()?;
    let mut cond = LlmConditioner::new(weights, MAGE_FLOW_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    let width = cond.context_width();
    ensure!(
        width as i64 == cfg.joint_attention_dim,
        "the LLM's hidden states are {width} wide, the Mage-Flow transformer's txt_in takes {} (Qwen3-VL-4B)",
        cfg.joint_attention_dim
    );
    cond.open_vision(weights, MAGE_FLOW_EDIT, &te_place, n_threads, params.eager_load)?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| QwenImageModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen-Image's template (its tokens are checked in `qwen_image`), read by Qwen3-VL.
    #[test]
    fn qwen_image_template_for_qwen3_vl() {
        let (m, q) = (MAGE_FLOW_TEMPLATE, QWEN_IMAGE_TEMPLATE);
        assert!(m.arch == LlmArch::Qwen3Vl && q.arch == LlmArch::Qwen25Vl);
        assert_eq!((m.prefix, m.suffix, m.drop_first, m.min_length), (q.prefix, q.suffix, 34, 0));
    }

    /// The reference keeps 2048 prompt tokens after the system prompt (34 tokens, or the edit
    /// prompt's 64), the template's end cut with the rest.
    #[test]
    fn prompts_are_cut_after_2048_tokens() {
        assert_eq!((MAGE_FLOW_TEMPLATE.max_length, MAGE_FLOW_EDIT.max_length), (2048 + 34, 2048 + 64));
        let tok = crate::pipeline::conditioning::llm::tokenizer_for(LlmArch::Qwen3Vl).unwrap();
        let long = "a lovely cat, ".repeat(1000);
        let t = crate::pipeline::conditioning::llm::tokenize(tok, &MAGE_FLOW_TEMPLATE, &long);
        assert_eq!((t.ids.len(), t.weights.len(), t.keep.len()), (2082, 2082, 2082));
        let short = crate::pipeline::conditioning::llm::tokenize(tok, &MAGE_FLOW_TEMPLATE, "a lovely cat");
        assert!(short.ids.len() < 60);
        // Other templates are never cut.
        assert_eq!(QWEN_IMAGE_TEMPLATE.max_length, 0);
    }

    /// `Image N: ` has as many tokens as `Picture N: `: the embeddings land on the pads.
    #[test]
    fn edit_images_land_on_their_pads() {
        crate::pipeline::conditioning::qwen_edit::tests::assert_image_tokens_land(&MAGE_FLOW_EDIT);
    }
}
