//! MiniT2I's conditioning, like the reference's `MiniT2IConditioner`: the prompt's T5
//! tokens as they are (no attention syntax, no EOS), cut or padded to 256; T5 attends only
//! to the prompt's tokens; the context is T5's states and the vector the prompt mask (1 for
//! the prompt's tokens, 0 for padding), which the transformer uses to put its mask token
//! in place of padding. The unconditional pass is the same states with a zero mask (the
//! negative prompt is not encoded). Without T5 the context is zeros `[1024, 256]` and the
//! mask zeros.

use super::t5::{T5Text, T5Vocab};
use super::{CondRequest, Conditioner};
use crate::error::Result;
use crate::graph::{Component, Components, Placement};
use crate::models::diffusion::minit2i::EMPTY_TEXT_WIDTH;
use crate::models::te::t5_tokenizer::{T5Tokenizer, PAD_TOKEN};
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::tensor::Tensor;
use std::sync::Arc;

/// Text tokens the transformer reads.
pub const PROMPT_LENGTH: usize = 256;

pub struct MiniT2iConditioner {
    t5: Option<T5Text>,
}

impl MiniT2iConditioner {
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, t5_resident: bool) -> Result<MiniT2iConditioner> {
        let t5 = T5Text::open(weights, T5Vocab::T5, place, n_threads, t5_resident)?;
        if t5.is_none() {
            sd_warn!("IMPORTANT NOTICE: No MiniT2I T5 text encoder provided, cannot process prompts!");
        }
        Ok(MiniT2iConditioner { t5 })
    }

    /// Width of the context: T5's, or the reference's 1024 of zeros without it.
    pub fn context_width(&self) -> i64 {
        self.t5.as_ref().map_or(EMPTY_TEXT_WIDTH, |t| t.width() as i64)
    }
}

/// The prompt's ids padded (or cut) to [`PROMPT_LENGTH`] and its mask (1 prompt, 0 padding).
fn prompt_tokens(tokenizer: &T5Tokenizer, text: &str) -> (Vec<u32>, Vec<f32>) {
    let mut ids = tokenizer.encode(text);
    ids.truncate(PROMPT_LENGTH);
    let mut mask = vec![1.0; ids.len()];
    mask.resize(PROMPT_LENGTH, 0.0);
    ids.resize(PROMPT_LENGTH, PAD_TOKEN);
    (ids, mask)
}

impl Components for MiniT2iConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        self.t5.iter_mut().map(|t| t.component()).collect()
    }
}

impl Conditioner for MiniT2iConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let Some(t5) = &mut self.t5 else {
            return Ok(Condition {
                crossattn: Some(Tensor::zeros(&[EMPTY_TEXT_WIDTH as usize, PROMPT_LENGTH, 1])),
                vector: Some(Tensor::zeros(&[PROMPT_LENGTH])),
                concat: None,
                extra_context: None,
                token_types: None,
            });
        };
        let (ids, mask) = prompt_tokens(T5Tokenizer::shared(T5Vocab::T5)?, req.text);
        let attn: Vec<f32> = mask.iter().map(|&m| if m > 0.0 { 0.0 } else { f32::NEG_INFINITY }).collect();
        let h = t5.encode(&ids, Some(&attn))?;
        let width = t5.width();
        Ok(Condition {
            crossattn: Some(h.reshape(&[width, PROMPT_LENGTH, 1])?),
            vector: Some(Tensor::from_vec(&[PROMPT_LENGTH], mask)?),
            concat: None,
            extra_context: None,
            token_types: None,
        })
    }

    /// The prompt's states with every token masked.
    fn unconditional(&mut self, cond: &Condition, _negative: &CondRequest<'_>) -> Result<Condition> {
        Ok(Condition { crossattn: cond.crossattn.clone(), vector: Some(Tensor::zeros(&[PROMPT_LENGTH])), concat: None, extra_context: None, token_types: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No EOS, padding with `<pad>`, attention syntax kept as text.
    #[test]
    fn prompt_is_padded_to_256_without_eos() {
        let tok = T5Tokenizer::shared(T5Vocab::T5).unwrap();
        let (ids, mask) = prompt_tokens(tok, "a lovely cat");
        let plain = tok.encode("a lovely cat");
        assert_eq!((ids.len(), mask.len()), (PROMPT_LENGTH, PROMPT_LENGTH));
        assert_eq!(&ids[..plain.len()], &plain[..]);
        assert!(ids[plain.len()..].iter().all(|&i| i == PAD_TOKEN) && mask.iter().filter(|&&m| m == 1.0).count() == plain.len());
        let (weighted, _) = prompt_tokens(tok, "(cat:1.5)");
        assert_eq!(&weighted[..tok.encode("(cat:1.5)").len()], &tok.encode("(cat:1.5)")[..]);
        let long = "cat ".repeat(400);
        assert!(prompt_tokens(tok, &long).1.iter().all(|&m| m == 1.0));
    }
}
