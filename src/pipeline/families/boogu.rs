//! Boogu Image: the LLM conditioner with Qwen3-VL's text model ([`BOOGU_TEMPLATE`], its
//! final normed hidden states), the Boogu Image transformer and Flux.1's 16-channel
//! AutoencoderKL. Flow prediction with the default shift 3.16, like the reference.
//! Reference images (the `z_image_omni` preset) become tokens of the transformer, with
//! 3-way guidance; its LLM reads them only through a Qwen3-VL vision tower
//! (`llm_vision_path`, or `visual.` in the LLM file), in the edit prompt [`BOOGU_EDIT`].

use super::flux::DIT_PREFIX;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::boogu_image::{BooguConfig, BooguModel};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::pipeline::conditioning::qwen_edit::EditTemplate;
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.16;

/// Qwen3-VL's chat template with Boogu's text-to-image system prompt, the user turn closed
/// and no assistant turn; the normed output of the last layer.
pub const BOOGU_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen3Vl,
    prefix: "<|im_start|>system\nYou are a helpful assistant that generates high-quality images based on user instructions. The instructions are as follows.<|im_end|>\n<|im_start|>user\n",
    suffix: "<|im_end|>\n",
    lead: "",
    out_layers: &[],
    min_length: 0,
    drop_first: 0,
    zero_pad_to: 0,
    max_length: 0,
};

/// What a blank prompt (an empty negative one, say) is put after instead: the reference
/// asks with its edit system prompt then.
pub const BOOGU_BLANK_PREFIX: &str = "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), then explain how the user's text instruction should alter or modify the image. Generate a new image that meets the user's requirements while maintaining consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n";

/// With reference images for the vision tower: the edit system turn (64 tokens), then each
/// image as `<|vision_start|>`, its embeddings and `<|vision_end|>` before the prompt; nothing
/// dropped. Images are sized to 384² pixels.
pub const BOOGU_EDIT: EditTemplate = EditTemplate {
    pipeline: "BooguImageEditPipeline",
    system: BOOGU_BLANK_PREFIX,
    label: "",
    first_image_token: 64 + 1,
    image_gap: 1 + 1,
    drop_first: 0,
    min_length: 0,
    max_length: 0,
    min_size: 384,
    max_size: 384,
};

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = BooguConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    ctx.ensure_latent_channels(cfg.in_channels, "the Boogu Image transformer", "Flux.1's VAE makes")?;
    let mut cond = LlmConditioner::new(weights, BOOGU_TEMPLATE, &te_place, n_threads, params.eager_load)?.with_blank_prompt_prefix(BOOGU_BLANK_PREFIX);
    cond.open_vision(weights, BOOGU_EDIT, &te_place, n_threads, params.eager_load)?;
    ensure_text_width(cond.context_width() as i64, cfg.caption_dim, "the Boogu Image transformer's caption_embedder", "")?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| BooguModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START};
    use crate::pipeline::conditioning::llm::{tokenize, tokenize_parts};

    /// The system turn, the user turn with the prompt, closed, and nothing after it.
    #[test]
    fn prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let t = tokenize(tok, &BOOGU_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids[0], IM_START);
        assert_eq!(&t.ids[t.ids.len() - 8..], &[IM_START, 872, 198, 64, 16690, 8251, IM_END, 198]);
        let blank = tokenize_parts(tok, BOOGU_BLANK_PREFIX, "", BOOGU_TEMPLATE.suffix, 0);
        assert_eq!(&blank.ids[blank.ids.len() - 5..], &[IM_START, 872, 198, IM_END, 198]);
        assert!(t.keep.iter().all(|&k| k) && t.weights.iter().all(|&w| w == 1.0));
    }

    /// The edit prompt's image positions are where the reference's tokenizer puts the pads.
    #[test]
    fn edit_image_tokens_land_on_the_pads() {
        crate::pipeline::conditioning::qwen_edit::tests::assert_image_tokens_land(&BOOGU_EDIT);
    }
}
