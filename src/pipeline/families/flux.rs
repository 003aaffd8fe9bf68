//! The Flux family (Flux.1 dev / schnell / Fill / Controls, Flex.2, Kontext through
//! reference images, Chroma, Chroma1-Radiance, Ovis-Image, LongCat-Image): `FluxConditioner`
//! (CLIP-L + T5), for Chroma and Chroma1-Radiance `T5Conditioner` (T5 only), for Ovis-Image
//! the Qwen3 `LlmConditioner` ([`OVIS_TEMPLATE`]), for LongCat Qwen2.5-VL
//! ([`LONGCAT_TEMPLATE`]); the Flux transformer; the 16-channel AutoencoderKL, or for
//! Chroma1-Radiance no autoencoder (`PixelSpace`). Flux flow prediction with the default
//! shift 1.15 when the model embeds guidance (dev), 1.0 otherwise (schnell, Chroma), 3 for
//! LongCat, like the reference.

use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::models::diffusion::flux::{Flux, FluxConfig, FluxModel, FluxOptions, FluxVariant};
use crate::models::te::llm::LlmArch;
use crate::models::vae::{FirstStage, PixelSpace};
use crate::pipeline::conditioning::flux::{T5Conditioner, T5TextOptions, FluxConditioner};
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::pipeline::conditioning::qwen_edit;
use crate::pipeline::conditioning::Conditioner;
use crate::runtime::args::{parse_key_value_args, parse_strict_bool};
use crate::types::Prediction;

/// Where the transformer's weights live (`diffusion_model_path` files are put there).
pub(super) const DIT_PREFIX: &str = "model.diffusion_model.";

/// Ovis-Image asks Qwen3 to describe the picture (the prompt after a space), with an empty
/// reasoning block, pads to 284 tokens and drops the first 28 (all of the prefix but its
/// final ':', like the reference); the context is the LLM's normed final state.
pub const OVIS_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen3,
    prefix: "<|im_start|>user\nDescribe the image by detailing the color, quantity, text, shape, size, texture, spatial relationships of the objects and background:",
    suffix: "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    lead: " ",
    out_layers: &[],
    min_length: 28 + 256,
    drop_first: 28,
    zero_pad_to: 0,
    max_length: 0,
};

/// LongCat-Image asks Qwen2.5-VL for a caption in its chat template (quoted text spelled
/// out), pads to 548 tokens and drops the 36 of the system turn; the context is the LLM's
/// normed final state.
pub const LONGCAT_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen25Vl,
    prefix: "<|im_start|>system\nAs an image captioning expert, generate a descriptive text prompt based on an image content, suitable for input to a text-to-image model.<|im_end|>\n<|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
    lead: "",
    out_layers: &[],
    min_length: 36 + 512,
    drop_first: 36,
    zero_pad_to: 0,
    max_length: 0,
};

/// LongCat's default flow shift (it has no guidance embedding rule).
const LONGCAT_FLOW_SHIFT: f32 = 3.0;

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
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let shape_of = |n: &str| weights.shape_of(n);
    let cfg = FluxConfig::detect(weights.types(), &shape_of, DIT_PREFIX, variant);
    ensure!(cfg.depth + cfg.depth_single_blocks > 0, "no Flux transformer blocks found under '{DIT_PREFIX}'");
    cfg.validate()?;
    let t5_resident = params.eager_load;
    let cond: Box<dyn Conditioner> = if cfg.is_chroma {
        sd_info!("Using pruned modulation (Chroma)");
        let options = T5TextOptions::parse(params.model_args.as_deref());
        Box::new(T5Conditioner::new(weights, &te_place, n_threads, t5_resident, options)?)
    } else if matches!(variant, FluxVariant::Ovis | FluxVariant::LongCat) {
        let longcat = variant == FluxVariant::LongCat;
        let template = if longcat { LONGCAT_TEMPLATE } else { OVIS_TEMPLATE };
        let mut cond = LlmConditioner::new(weights, template, &te_place, n_threads, params.eager_load)?;
        if longcat {
            cond = cond.with_spelled_quotes();
            cond.open_vision(weights, qwen_edit::LONGCAT_EDIT, &te_place, n_threads, params.eager_load)?;
        }
        let reader = format!("the {} transformer's txt_in", ctx.version.name());
        ensure_text_width(cond.context_width() as i64, cfg.context_in_dim, &reader, "")?;
        Box::new(cond)
    } else {
        Box::new(FluxConditioner::new(weights, &te_place, n_threads, t5_resident)?)
    };

    let model = ctx.load_transformer(DIT_PREFIX, |s| FluxModel::new(s, &cfg))?;
    let diffusion = Flux { model, options: FluxOptions { use_mask: chroma_use_dit_mask(params.model_args.as_deref()) } };

    let first: (Box<dyn FirstStage>, _) = if variant == FluxVariant::ChromaRadiance {
        sd_info!("using FakeVAE");
        (Box::new(PixelSpace), None)
    } else {
        first_stage::build(ctx, vae_place)?
    };
    let shift = if variant == FluxVariant::LongCat { LONGCAT_FLOW_SHIFT } else { flux_default_shift(&cfg) };
    Ok(flow_parts(params, cond, Box::new(diffusion), first, Prediction::FluxFlow, shift))
}

/// Flux's default flow shift: 1.15 with a guidance embedding (dev), else 1.
pub(super) fn flux_default_shift(cfg: &FluxConfig) -> f32 {
    if cfg.guidance_embed {
        1.15
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt follows the template's prefix after a space (inside its weighted part), then
    /// the assistant turn; padding to 284.
    #[test]
    fn ovis_prompt_tokens() {
        use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START, PAD_TOKEN};
        use crate::pipeline::conditioning::llm::tokenize;
        let tok = qwen_tokenizer::shared().unwrap();
        let prefix = tok.encode(OVIS_TEMPLATE.prefix);
        // The reference drops 28 of the prefix's 29 tokens: its final ':' stays in the context.
        assert_eq!((prefix.len(), prefix[0], tok.decode(&prefix[28..])), (29, IM_START, ":".to_string()));
        let t = tokenize(tok, &OVIS_TEMPLATE, "a (lovely:1.5) cat");
        assert_eq!(t.ids.len(), 284);
        assert_eq!(&t.ids[..29], &prefix[..]);
        let prompt = tok.encode(" a ");
        assert_eq!(&t.ids[29..29 + prompt.len()], &prompt[..]);
        let real = t.keep.iter().filter(|&&k| k).count();
        assert!(t.ids[29..real].contains(&IM_END) && t.ids[real..].iter().all(|&i| i == PAD_TOKEN));
        assert!(t.weights.contains(&1.5));
        // An empty prompt still has its space.
        assert_eq!(tokenize(tok, &OVIS_TEMPLATE, "").ids[29], tok.encode(" ")[0]);
    }

    #[test]
    fn dit_mask_model_arg() {
        assert!(chroma_use_dit_mask(None));
        assert!(!chroma_use_dit_mask(Some("chroma_use_dit_mask=false")));
        assert!(chroma_use_dit_mask(Some("chroma_use_dit_mask=nope")));
    }
}
