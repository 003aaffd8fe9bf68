//! PiD's conditioning, like the reference's `LLMEmbedder` for it: the prompt after one space
//! (its attention syntax parsed), Gemma 2's tokens behind `<bos>`, padded with `<pad>`
//! (masked) or cut to a fixed length: 298 more than the tokens of the reference's "enhanced
//! prompt" instruction (which is counted, never encoded). The normed final hidden states,
//! re-weighted by the attention syntax, are the context; past 300 tokens the first and the
//! last 299 are kept (the transformer reads 300).

use super::{CondRequest, Conditioner};
use crate::error::Result;
use crate::graph::{Component, Components, Loaded, Placement};
use crate::models::diffusion::pid::TXT_MAX;
use crate::models::te::gemma2::{self, Gemma2Config, Gemma2Model, PREFIX};
use crate::models::te::gemma_tokenizer::{self, GemmaTokenizer, BOS_TOKEN, PAD_TOKEN};
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::{apply_token_weights, parse_prompt_attention};
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// The instruction whose token count fixes the sequence length (the reference tokenizes it
/// only to count).
const CHI_PROMPT: &str = "Given a user prompt, generate an \"Enhanced prompt\" that provides detailed visual descriptions suitable for image generation. Evaluate the level of detail in the user prompt:\n\
- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial relationships to create vivid and concrete scenes.\n\
- If the prompt is already detailed, refine and enhance the existing details slightly without overcomplicating.\n\
Here are examples of how to transform or refine prompts:\n\
- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.\n\
- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass skyscrapers.\n\
Please generate only the enhanced description for the prompt below and avoid including any additional commentary or evaluations:\n\
User Prompt: ";

/// The prompt's tokens: ids, weights and which are real (not padding).
#[derive(Clone, Debug, PartialEq)]
pub struct PidTokens {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub keep: Vec<bool>,
}

/// Tokens of `text` as the reference feeds Gemma 2 for PiD (see the module documentation).
pub fn tokenize(tok: &GemmaTokenizer, text: &str) -> PidTokens {
    let length = 1 + tok.encode(CHI_PROMPT).len() + TXT_MAX - 2;
    let mut t = PidTokens { ids: vec![BOS_TOKEN], weights: vec![1.0], keep: vec![true] };
    for (piece, weight) in parse_prompt_attention(&format!(" {text}")) {
        let ids = tok.encode(&piece);
        t.weights.extend(std::iter::repeat_n(weight, ids.len()));
        t.ids.extend(ids);
    }
    t.keep = vec![true; t.ids.len()];
    t.ids.resize(length, PAD_TOKEN);
    t.weights.resize(length, 1.0);
    t.keep.resize(length, false);
    t
}

pub struct PidConditioner {
    net: Loaded<Gemma2Model>,
    tokenizer: &'static GemmaTokenizer,
}

impl PidConditioner {
    /// Gemma 2 of the context's files (`llm_path`); its weights are read per conditioning
    /// phase unless `resident`.
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, resident: bool) -> Result<PidConditioner> {
        ensure!(weights.has_prefix(PREFIX), "PiD needs its Gemma 2 text encoder (llm_path): no '{PREFIX}' weights in the model files");
        let cfg = Gemma2Config::detect(weights.types(), &|n| weights.shape_of(n), PREFIX);
        ensure!(cfg.num_layers > 0, "the Gemma 2 text encoder has no layers under '{PREFIX}model.layers.'");
        let net = weights.load_model(place.resident_or_per_phase(resident), n_threads, PREFIX, "llm", |s| Gemma2Model::new(s, &cfg))?;
        Ok(PidConditioner { net, tokenizer: gemma_tokenizer::shared()? })
    }

    /// Width of the states it gives.
    pub fn context_width(&self) -> i64 {
        self.net.model.cfg.hidden_size
    }
}

impl Components for PidConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.net]
    }
}

impl Conditioner for PidConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let tokens = tokenize(self.tokenizer, req.text);
        let ids: Vec<i32> = tokens.ids.iter().map(|&t| t as i32).collect();
        let h = self.net.run_in_phase(|model, runner| gemma2::hidden_states(runner, model, &ids, &tokens.keep))?;
        let (width, n) = (h.ne(0), ids.len());
        let mut h = h.reshape(&[width, n])?;
        apply_token_weights(&mut h, &tokens.weights, n)?;
        let mut data = h.data().to_vec();
        if n > TXT_MAX {
            data.drain(width..(n - (TXT_MAX - 1)) * width);
        }
        let len = data.len() / width;
        if req.zero_out_masked {
            data.fill(0.0);
        }
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition { crossattn: Some(Tensor::from_vec(&[width, len, 1], data)?), vector: None, concat: None, extra_context: None, token_types: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `<bos>`, the prompt after a space, `<pad>` up to the instruction's length + 298.
    #[test]
    fn prompt_tokens() {
        let tok = gemma_tokenizer::shared().unwrap();
        let t = tokenize(tok, "a (lovely:1.5) cat");
        let chi = 1 + tok.encode(CHI_PROMPT).len();
        assert_eq!(t.ids.len(), chi + TXT_MAX - 2);
        assert_eq!(&t.ids[..2], &[BOS_TOKEN, tok.encode(" a ")[0]]);
        assert!(t.weights.contains(&1.5) && t.keep.iter().filter(|&&k| k).count() < 10 && t.ids.last() == Some(&PAD_TOKEN));
    }
}
