//! GPT-OSS conditioning (the reference's `LLMEmbedder` for Lens): the prompt goes into the
//! harmony chat template ([`LENS_TEMPLATE`]), is tokenized with the GPT-OSS tokenizer (the
//! template's text and each attention-weighted piece of the prompt separately) and cut to
//! 512 tokens; the hidden states of layers 6, 12, 18 and 24 side by side, re-weighted by
//! the attention syntax, without the template's first 97 tokens, are the context.
//!
//! The LLM's weights are read per conditioning phase unless `eager_load` (as the shared LLM
//! conditioner's).

use super::llm::{tokenize_parts, LlmTokens};
use super::{CondRequest, Conditioner};
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, Loaded, Placement};
use crate::models::te::bpe::BpeTokenizer;
use crate::models::te::gpt_oss::{self, GptOssConfig, GptOssModel};
use crate::models::te::gpt_oss_tokenizer;
use crate::models::te::llm::{causal_mask, LLM_PREFIX};
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::apply_token_weights;
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// How Lens asks its LLM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptOssTemplate {
    pub prefix: &'static str,
    pub suffix: &'static str,
    /// Hidden states read (1-based layer outputs).
    pub out_layers: &'static [i32],
    /// Longer token sequences are cut to this many.
    pub max_length: usize,
    /// Tokens dropped from the front of the hidden states.
    pub drop_first: usize,
}

/// Lens: the system and developer turns (with the reference's fixed date), the prompt as the
/// user turn, then an analysis turn and the opening of the final answer.
pub const LENS_TEMPLATE: GptOssTemplate = GptOssTemplate {
    prefix: "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2026-05-26\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>developer<|message|># Instructions\n\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background.\n\n<|end|><|start|>user<|message|>",
    suffix: "<|end|><|start|>assistant<|channel|>analysis<|message|>Need to generate one image according to the description.<|end|><|start|>assistant<|channel|>final<|message|>",
    out_layers: &[6, 12, 18, 24],
    max_length: 512,
    drop_first: 97,
};

/// `text` in `template`, tokenized like the reference (no BOS, no padding), cut to
/// `max_length` tokens.
pub fn tokenize(tokenizer: &BpeTokenizer, template: &GptOssTemplate, text: &str) -> LlmTokens {
    let mut t = tokenize_parts(tokenizer, template.prefix, text, template.suffix, 0);
    if t.ids.len() > template.max_length {
        t.ids.truncate(template.max_length);
        t.weights.truncate(template.max_length);
        t.keep.truncate(template.max_length);
    }
    t
}

/// The conditioner of Lens.
pub struct GptOssConditioner {
    net: Loaded<GptOssModel>,
    tokenizer: &'static BpeTokenizer,
    template: GptOssTemplate,
}

impl GptOssConditioner {
    /// The GPT-OSS text model of the context's files (`llm_path`, under [`LLM_PREFIX`]).
    pub fn new(weights: &Arc<Weights>, template: GptOssTemplate, place: &Placement, n_threads: i32, resident: bool) -> Result<GptOssConditioner> {
        ensure!(weights.has_prefix(LLM_PREFIX), "no LLM text encoder weights (llm_path) in the model files");
        let cfg = GptOssConfig::detect(weights.types(), &|n| weights.shape_of(n), LLM_PREFIX);
        ensure!(cfg.num_layers > 0, "the LLM text encoder has no layers under '{LLM_PREFIX}model.layers.'");
        let net = weights.load_model(place.resident_or_per_phase(resident), n_threads, LLM_PREFIX, "llm", |s| GptOssModel::new(s, &cfg))?;
        Ok(GptOssConditioner { net, tokenizer: gpt_oss_tokenizer::shared()?, template })
    }

    pub fn config(&self) -> &GptOssConfig {
        &self.net.model.cfg
    }

    /// Width of the context this conditioner produces.
    pub fn context_width(&self) -> usize {
        self.config().output_width(self.template.out_layers)
    }
}

impl Components for GptOssConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.net]
    }
}

impl Conditioner for GptOssConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let tokens = tokenize(self.tokenizer, &self.template, req.text);
        let ids: Vec<i32> = tokens.ids.iter().map(|&t| i32::try_from(t).unwrap_or(-1)).collect();
        let mask = causal_mask(&tokens.keep);
        let out_layers = self.template.out_layers;
        let mut h = self.net.run_in_phase(|model, runner| gpt_oss::hidden_states(runner, model, &ids, Some(&mask), out_layers))?;
        let (width, n) = (h.ne(0), tokens.ids.len());
        h = h.reshape(&[width, n])?;
        apply_token_weights(&mut h, &tokens.weights, n)?;
        let drop = self.template.drop_first;
        ensure!(n > drop, "the prompt gave {n} LLM tokens, the template drops the first {drop}");
        let data = h.data().get(drop * width..).context("LLM hidden states")?.to_vec();
        let mut context = Tensor::from_vec(&[width, n - drop, 1], data)?;
        if req.zero_out_masked {
            context.data_mut().fill(0.0);
        }
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition { crossattn: Some(context), vector: None, concat: None, extra_context: None, token_types: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template is 104 tokens before the prompt and 22 after it (the reference's split).
    #[test]
    fn lens_prompt_tokens() {
        let tok = gpt_oss_tokenizer::shared().unwrap();
        let t = tokenize(tok, &LENS_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids.len(), 104 + 3 + 22);
        assert_eq!(&t.ids[..3], &[200006, 17360, 200008]);
        assert_eq!(t.ids[126..], [200005, 17196, 200008]);
        let w = tokenize(tok, &LENS_TEMPLATE, "a (red:1.4) apple");
        assert!(w.weights.contains(&1.4) && !w.ids.contains(&gpt_oss_tokenizer::END_OF_TEXT));
        let long = "cat ".repeat(600);
        assert_eq!(tokenize(tok, &LENS_TEMPLATE, &long).ids.len(), 512);
    }
}

