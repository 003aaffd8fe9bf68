//! Krea2: the LLM conditioner with Qwen3-VL's text model ([`KREA2_TEMPLATE`]: twelve of its
//! layers side by side), the Krea2 transformer and the Wan2.1 VAE on single frames. Flux's
//! flow prediction with the default shift 1.15, like the reference. Reference images become
//! latent tokens after the image's (the `krea2_ostris_edit` preset: numbered from 1, modulated
//! for timestep 0; `krea2_edit` keeps the step's timestep). With a Qwen3-VL vision tower
//! (`llm_vision_path`, or `visual.` in the LLM file) the LLM also sees them, as
//! `Picture N: <|vision_start|>…` in the user turn ([`KREA2_EDIT`]); without one, as in the
//! reference, they reach only the transformer.

use super::flux::DIT_PREFIX;
use super::qwen_image::QWEN_IMAGE_TEMPLATE;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::krea2::{Krea2Config, Krea2Model};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::pipeline::conditioning::qwen_edit::EditTemplate;
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 1.15;

/// Qwen-Image's system prompt and turns around the prompt, without the system prompt's 34
/// tokens; the outputs of layers 2, 5, …, 35 side by side.
pub const KREA2_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen3Vl,
    prefix: QWEN_IMAGE_TEMPLATE.prefix,
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
    lead: "",
    out_layers: &[2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35],
    min_length: 0,
    drop_first: 34,
    zero_pad_to: 0,
    max_length: 0,
};

/// With reference images for the vision tower: after the same 34 system tokens, each image
/// as `Picture N: <|vision_start|>`, its embeddings and `<|vision_end|>` before the prompt;
/// the first 34 tokens are dropped as without images, the pictures' tokens stay. Images are
/// sized into 384²…1024² pixels.
pub const KREA2_EDIT: EditTemplate = EditTemplate {
    pipeline: "",
    system: QWEN_IMAGE_TEMPLATE.prefix,
    label: "Picture ",
    first_image_token: 34 + 6,
    image_gap: 1 + 6,
    drop_first: 34,
    min_length: 0,
    max_length: 0,
    min_size: 384,
    max_size: 1024,
};

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = Krea2Config::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    let mut cond = LlmConditioner::new(weights, KREA2_TEMPLATE, &te_place, n_threads, params.eager_load)?;
    let hint = format!("{} LLM layers of {}; its Qwen3-VL needs at least 35 layers", cfg.text_layers, cfg.text_dim);
    ensure_text_width(cond.context_width() as i64, cfg.context_width(), "the Krea2 transformer", &hint)?;
    cond.open_vision(weights, KREA2_EDIT, &te_place, n_threads, params.eager_load)?;

    let model = ctx.load_transformer(DIT_PREFIX, |s| Krea2Model::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::FluxFlow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START};
    use crate::pipeline::conditioning::llm::tokenize;

    /// The system prompt is the 34 tokens dropped; the prompt and the assistant turn remain.
    #[test]
    fn prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let empty = tokenize(tok, &KREA2_TEMPLATE, "");
        assert_eq!(empty.ids.len(), 34 + 5);
        assert_eq!(&empty.ids[34..], &[IM_END, 198, IM_START, 77091, 198]);
        let t = tokenize(tok, &KREA2_TEMPLATE, "a lovely cat");
        assert_eq!(&t.ids[34..37], &[64, 16690, 8251]);
    }

    /// The edit prompt's image positions are where the reference's tokenizer puts the pads.
    #[test]
    fn edit_image_tokens_land_on_the_pads() {
        assert_eq!(qwen_tokenizer::shared().unwrap().encode(KREA2_EDIT.system).len(), KREA2_EDIT.drop_first);
        crate::pipeline::conditioning::qwen_edit::tests::assert_image_tokens_land(&KREA2_EDIT);
    }
}
