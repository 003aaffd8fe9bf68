//! SeFi-Image: the LLM conditioner with Qwen3-VL's text model ([`SEFI_TEMPLATE`]), the
//! Flux.2 transformer with SeFi's two timestep embeddings ([`FluxVariant::Sefi`]) and
//! Flux.2's AutoencoderKL, which decodes the 128 texture channels behind the 16 semantic
//! ones. Its denoiser brings its own dual schedule and sampler (`runtime::denoiser`,
//! `runtime::samplers`: every request runs SeFi's Euler on it, whatever sampler and
//! scheduler it names, like the reference).

use super::flux2::llm_transformer_parts;
use super::{BuildCtx, Parts};
use crate::error::Result;
use crate::models::diffusion::flux::FluxVariant;
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::LlmTemplate;
use crate::types::Prediction;

/// Qwen3-VL's chat template around the prompt (no reasoning block), padded to 1024 tokens;
/// the hidden states after layers 9, 18 and 27 side by side.
pub const SEFI_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen3Vl,
    prefix: "<|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
    lead: "",
    out_layers: &[9, 18, 27],
    min_length: 1024,
    drop_first: 0,
    zero_pad_to: 0,
    max_length: 0,
};

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    // The reference sets SeFi no default flow shift (its own schedule never reads one).
    llm_transformer_parts(ctx, FluxVariant::Sefi, SEFI_TEMPLATE, Prediction::SefiFlow, |_| f32::INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START, PAD_TOKEN};
    use crate::pipeline::conditioning::llm::tokenize;

    /// The user turn and the bare assistant turn, then `<|endoftext|>` padding to 1024,
    /// masked.
    #[test]
    fn prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let t = tokenize(tok, &SEFI_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids.len(), 1024);
        assert_eq!(&t.ids[..11], &[IM_START, 872, 198, 64, 16690, 8251, IM_END, 198, IM_START, 77091, 198]);
        assert!(t.keep[..11].iter().all(|&k| k) && !t.keep[11] && t.ids[11..].iter().all(|&i| i == PAD_TOKEN));
    }
}
