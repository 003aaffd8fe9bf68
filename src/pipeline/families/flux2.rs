//! Flux.2: the LLM conditioner (dev: Mistral Small 3.2 in [`DEV_TEMPLATE`]; klein: Qwen3 in
//! [`KLEIN_TEMPLATE`]), the Flux.2 transformer (the Flux network configured with shared
//! modulations, SwiGLU MLPs and no biases; dev is told from klein by its 48 single blocks,
//! and embeds the distilled guidance) and the 32-channel AutoencoderKL with patchified,
//! normalised latents. Flux flow prediction; the default shift is 1.15 when the model embeds
//! guidance, else 1.0 (the default `flux2` scheduler ignores it), like the reference.

use super::flux::{flux_default_shift, DIT_PREFIX};
use super::{first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::Module;
use crate::io::SdVersion;
use crate::models::diffusion::flux::{Flux, FluxConfig, FluxModel, FluxOptions, FluxVariant};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{LlmConditioner, LlmTemplate};
use crate::types::Prediction;

/// Klein asks Qwen3 in its chat template with an empty reasoning block, padded to 512
/// tokens, and reads the hidden states after layers 9, 18 and 27 side by side.
pub const KLEIN_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen3,
    prefix: "<|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    lead: "",
    out_layers: &[9, 18, 27],
    min_length: 512,
    drop_first: 0,
    zero_pad_to: 0,
    max_length: 0,
};

/// Dev asks Mistral Small 3.2 with BFL's system prompt (BOS first, no token padding), reads
/// the hidden states after layers 10, 20 and 30 side by side, and appends zero rows up to
/// 512 tokens.
pub const DEV_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::MistralSmall32,
    prefix: "[SYSTEM_PROMPT]You are an AI that reasons about image descriptions. You give structured responses focusing on object relationships, object\nattribution and actions without speculation.[/SYSTEM_PROMPT][INST]",
    suffix: "[/INST]",
    lead: "",
    out_layers: &[10, 20, 30],
    min_length: 0,
    drop_first: 0,
    zero_pad_to: 512,
    max_length: 0,
};

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let template = if ctx.version == SdVersion::Flux2 { DEV_TEMPLATE } else { KLEIN_TEMPLATE };
    llm_transformer_parts(ctx, FluxVariant::Flux2, template, Prediction::FluxFlow, flux_default_shift)
}

/// The parts of a family built on the Flux.2 transformer (Flux.2, SeFi-Image): the LLM
/// conditioner asking in `template`, the transformer configured as `variant`, the first
/// stage, and `prediction` with the default shift the transformer's configuration gives.
pub(super) fn llm_transformer_parts(
    ctx: &mut BuildCtx<'_>,
    variant: FluxVariant,
    template: LlmTemplate,
    prediction: Prediction,
    default_shift: fn(&FluxConfig) -> f32,
) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;
    let name = ctx.version.name();

    let shape_of = |n: &str| weights.shape_of(n);
    let cfg = FluxConfig::detect(weights.types(), &shape_of, DIT_PREFIX, variant);
    ensure!(cfg.depth + cfg.depth_single_blocks > 0, "no {name} transformer blocks found under '{DIT_PREFIX}'");
    cfg.validate()?;
    let cond = LlmConditioner::new(weights, template, &te_place, n_threads, params.eager_load)?;
    // An LLM without the layers the family reads gives its final state instead (the
    // reference then fails an assertion in the transformer's first product).
    let width = cond.context_width() as i64;
    ensure!(
        width == cfg.context_in_dim,
        "{name}'s transformer takes {} wide text (LLM layers {:?} side by side), this LLM gives {width} wide (too few layers or another width)",
        cfg.context_in_dim,
        template.out_layers
    );

    let model = ctx.load_transformer(DIT_PREFIX, |s| FluxModel::new(s, &cfg))?;
    let diffusion = Flux { model, options: FluxOptions { use_mask: false } };
    let first = first_stage::build(ctx, vae_place)?;
    Ok(flow_parts(params, Box::new(cond), Box::new(diffusion), first, prediction, default_shift(&cfg)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START, PAD_TOKEN};
    use crate::pipeline::conditioning::llm::tokenize;

    /// The prompt in klein's template: the user turn, the assistant turn with its empty
    /// `<think>` block (special tokens), then `<|endoftext|>` padding to 512, masked.
    #[test]
    fn klein_prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let t = tokenize(tok, &KLEIN_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids.len(), 512);
        let real = t.keep.iter().filter(|&&k| k).count();
        assert_eq!(&t.ids[..11], &[IM_START, 872, 198, 64, 16690, 8251, IM_END, 198, IM_START, 77091, 198]);
        // <think>, "\n\n", </think>, "\n\n".
        assert_eq!(&t.ids[11..real], &[151667, 271, 151668, 271]);
        assert!(t.keep[..real].iter().all(|&k| k) && t.ids[real..].iter().all(|&i| i == PAD_TOKEN));
    }

    /// Dev's prompt: BOS, the system prompt and `[INST]`, the prompt (each weighted piece
    /// tokenized apart: "a " keeps its space as a token), `[/INST]`; no token padding (the
    /// hidden states are padded with zeros instead).
    #[test]
    fn dev_prompt_tokens() {
        use crate::models::te::mistral_tokenizer::{self, BOS_TOKEN, INST, INST_END, SYSTEM_PROMPT, SYSTEM_PROMPT_END};
        let tok = mistral_tokenizer::shared().unwrap();
        let t = tokenize(tok, &DEV_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids.len(), 1 + 31 + 3 + 1);
        assert_eq!((t.ids[0], t.ids[1], t.ids[30], t.ids[31]), (BOS_TOKEN, SYSTEM_PROMPT, SYSTEM_PROMPT_END, INST));
        assert_eq!(&t.ids[32..], &[1097, 45988, 7990, INST_END]);
        assert!(t.keep.iter().all(|&k| k) && t.weights.iter().all(|&w| w == 1.0));
        let t = tokenize(tok, &DEV_TEMPLATE, "a (red:1.4) apple");
        assert_eq!(&t.ids[32..], &[1097, 1032, 2338, 46227, INST_END]);
        assert_eq!(&t.weights[31..], &[1.0, 1.0, 1.0, 1.4, 1.0, 1.0]);
        // The empty (negative) prompt is the template alone.
        assert_eq!(tokenize(tok, &DEV_TEMPLATE, "").ids.len(), 33);
    }
}
