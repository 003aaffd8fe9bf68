//! Anima's conditioner (the reference's `AnimaConditioner`): the prompt's attention pieces,
//! tokenized with Qwen2's tokenizer alone (no chat template, all weights 1; an empty prompt
//! becomes the pad token), run through a Qwen3 LLM whose final normed hidden states are the
//! context; and the same pieces as T5 token ids (T5's tokenizer only, `</s>` at the end) with
//! their attention weights, which Anima's LLM adapter turns into the context its blocks read.
//! The ids travel in [`Condition::vector`] as [`anima::pack_t5`] packs them.

use super::llm::{tokenize_parts, LlmText};
use super::{CondRequest, Conditioner};
use crate::error::Result;
use crate::graph::{Component, Components, Placement};
use crate::models::diffusion::anima;
use crate::models::te::llm::LlmArch;
use crate::models::te::qwen_tokenizer::PAD_TOKEN;
use crate::models::te::t5_tokenizer::{T5Tokenizer, T5Vocab};
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::parse_prompt_attention;
use std::sync::Arc;
use std::time::Instant;

/// T5's `</s>`, which ends the ids.
const T5_EOS: u32 = 1;

pub struct AnimaConditioner {
    llm: LlmText,
    t5: &'static T5Tokenizer,
}

impl AnimaConditioner {
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, resident: bool) -> Result<AnimaConditioner> {
        Ok(AnimaConditioner { llm: LlmText::open(weights, LlmArch::Qwen3, place, n_threads, resident)?, t5: T5Tokenizer::shared(T5Vocab::T5)? })
    }

    /// Width of the LLM's hidden states (the context).
    pub fn context_width(&self) -> usize {
        self.llm.config().hidden_size as usize
    }

}

/// The prompt's T5 ids and weights: each attention piece encoded apart, then `</s>`.
fn t5_tokens(t5: &T5Tokenizer, text: &str) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for (piece, weight) in parse_prompt_attention(text) {
        let piece_ids = t5.encode(&piece);
        weights.extend(std::iter::repeat_n(weight, piece_ids.len()));
        ids.extend(piece_ids);
    }
    ids.push(T5_EOS);
    weights.push(1.0);
    (ids, weights)
}

impl Components for AnimaConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![self.llm.component()]
    }
}

impl Conditioner for AnimaConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let mut tokens = tokenize_parts(self.llm.tokenizer(), "", req.text, "", 0);
        if tokens.ids.is_empty() {
            tokens.ids.push(PAD_TOKEN);
            tokens.keep.push(true);
        }
        tokens.weights = vec![1.0; tokens.ids.len()];
        let context = self.llm.encode(&tokens, &[])?;
        let (ids, weights) = t5_tokens(self.t5, req.text);
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition { crossattn: Some(context), vector: Some(anima::pack_t5(&ids, &weights)?), concat: None, extra_context: None, token_types: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t5_tokens_end_with_eos_and_carry_weights() {
        let t5 = T5Tokenizer::shared(T5Vocab::T5).unwrap();
        // An empty prompt is T5's lone word start "▁" (id 3), as in the reference, then `</s>`.
        assert_eq!(t5_tokens(t5, ""), (vec![3, T5_EOS], vec![1.0, 1.0]));
        let (ids, weights) = t5_tokens(t5, "a (lovely:1.5) cat");
        let mut want = t5.encode("a ");
        let lovely = t5.encode("lovely");
        want.extend(&lovely);
        want.extend(t5.encode(" cat"));
        want.push(T5_EOS);
        assert_eq!(ids, want);
        let start = t5.encode("a ").len();
        assert!(weights[start..start + lovely.len()].iter().all(|&w| w == 1.5));
        assert_eq!((weights[0], weights[weights.len() - 1]), (1.0, 1.0));
    }
}
