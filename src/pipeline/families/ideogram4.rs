//! Ideogram 4: Qwen3-VL's text model (the hidden states after 13 of its layers side by side,
//! [`IDEOGRAM4_OUT_LAYERS`]), the Ideogram 4 transformer and Flux.2's AutoencoderKL. The
//! unconditional pass of cfg has no text at all (the reference never encodes the negative
//! prompt for this family) and runs the second transformer of `uncond_diffusion_model_path`
//! when one is given. Flow prediction with the default shift 1, euler and the logit-normal
//! schedule (`runtime::defaults`), like the reference.

use super::flux::DIT_PREFIX;
use super::{first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::{Component, Components, Module};
use crate::io::Component as Source;
use crate::models::condition::Condition;
use crate::models::diffusion::ideogram4::{Ideogram4, Ideogram4Config, Ideogram4Model, LLM_LAYERS};
use crate::models::te::llm::LlmArch;
use crate::pipeline::conditioning::llm::{tokenize_parts, LlmText};
use crate::pipeline::conditioning::{CondRequest, Conditioner};
use crate::tensor::Tensor;
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 1.0;

/// The LLM layers whose outputs make the text (36: the last, before the final norm).
pub const IDEOGRAM4_OUT_LAYERS: &[i32] = &[1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 36];

/// The prompt in Qwen3-VL's chat turn, tokenized as one piece (no attention weights).
fn chat_prompt(text: &str) -> String {
    format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
}

/// The LLM's hidden states of the chat turn; the unconditional condition has no text.
struct Ideogram4Conditioner {
    llm: LlmText,
}

impl Components for Ideogram4Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![self.llm.component()]
    }
}

impl Conditioner for Ideogram4Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let tokens = tokenize_parts(self.llm.tokenizer(), &chat_prompt(req.text), "", "", 0);
        let context = self.llm.encode(&tokens, IDEOGRAM4_OUT_LAYERS)?;
        Ok(Condition { crossattn: Some(context), ..Condition::default() })
    }

    fn unconditional(&mut self, _cond: &Condition, _negative: &CondRequest<'_>) -> Result<Condition> {
        Ok(Condition { vector: Some(Tensor::from_vec(&[1], vec![1.0])?), ..Condition::default() })
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = Ideogram4Config::detect(weights.types(), DIT_PREFIX);
    let llm = LlmText::open(weights, LlmArch::Qwen3Vl, &te_place, n_threads, params.eager_load)?;
    // An LLM of another width or with fewer layers gives text the transformer cannot read
    // (the reference then fails a shape assertion while generating).
    let width = llm.config().output_width(IDEOGRAM4_OUT_LAYERS) as i64;
    ensure!(
        width == cfg.llm_features_dim,
        "Ideogram 4's transformer takes {} wide text ({LLM_LAYERS} Qwen3-VL layers of {}: {:?}), this LLM gives {width} ({} layers of {})",
        cfg.llm_features_dim,
        cfg.llm_hidden(),
        IDEOGRAM4_OUT_LAYERS,
        llm.config().num_layers,
        llm.config().hidden_size
    );

    let model = ctx.load_transformer(DIT_PREFIX, |s| Ideogram4Model::new(s, &cfg))?;
    let uncond_prefix = Source::UncondDiffusionModel.prefix();
    let uncond = if weights.has_prefix(uncond_prefix) {
        sd_debug!("using uncond model");
        Some(ctx.load_transformer(uncond_prefix, |s| Ideogram4Model::new(s, &cfg))?)
    } else {
        None
    };
    let first = first_stage::build(ctx, vae_place)?;
    let cond = Ideogram4Conditioner { llm };
    Ok(flow_parts(params, Box::new(cond), Box::new(Ideogram4 { model, uncond }), first, Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START};

    /// The chat turn is one piece: attention syntax stays text.
    #[test]
    fn prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let t = tokenize_parts(tok, &chat_prompt("a lovely cat"), "", "", 0);
        assert_eq!(t.ids, [IM_START, 872, 198, 64, 16690, 8251, IM_END, 198, IM_START, 77091, 198]);
        let t = tokenize_parts(tok, &chat_prompt("a (red:1.4) apple"), "", "", 0);
        assert!(t.weights.iter().all(|&w| w == 1.0) && t.ids.len() > 11);
    }
}
