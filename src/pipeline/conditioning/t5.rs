//! The T5-XXL part of the DiT conditioners (SD3, Flux, Chroma): tokenizing a prompt into
//! weighted chunks with their attention mask, and encoding chunks.
//!
//! T5's weights are not kept through sampling: they are loaded by the first encoding of a
//! generation and freed when the conditioner is released (after the prompt and the negative
//! prompt), unless the context asks for eager loading, which keeps them resident.

use crate::error::Result;
use crate::graph::{Backend, Runner};
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::WeightedTokens;
use crate::tensor::Tensor;
use std::sync::Arc;

/// Where the T5 encoder's weights live (`t5xxl_path` files are put there).
pub const T5XXL_PREFIX: &str = "text_encoders.t5xxl.transformer.";

/// Weighted T5 tokens (chunks ending in EOS, padded) and their additive attention mask
/// (0 for prompt tokens and EOS, -inf for padding).
#[derive(Clone, Debug, Default)]
pub struct T5Tokens {
    pub tokens: WeightedTokens,
    pub mask: Vec<f32>,
}

/// A T5 encoder and its tokenizer.
pub struct T5Text {
    width: usize,
}

impl T5Text {
    /// The encoder of the context's files, `None` when they hold no T5 weights.
    pub fn open(weights: &Arc<Weights>, backend: Arc<Backend>, n_threads: i32, resident: bool) -> Result<Option<T5Text>> {
        if !weights.has_prefix(T5XXL_PREFIX) {
            return Ok(None);
        }
        let _ = (backend, n_threads, resident);
        bail!("T5-XXL text encoding is not available in this build yet")
    }

    /// Width of the hidden states (4096 for T5-XXL).
    pub fn width(&self) -> usize {
        self.width
    }

    /// `text` as weighted T5 tokens in chunks of `chunk_len` (each piece of the attention
    /// syntax tokenized on its own).
    pub fn tokenize(&self, _text: &str, _chunk_len: usize) -> T5Tokens {
        T5Tokens::default()
    }

    /// Hidden states `[width, L, 1]` of one chunk, attending only where `mask` is 0 when given.
    pub fn encode(&mut self, _ids: &[u32], _mask: Option<&[f32]>) -> Result<Tensor> {
        bail!("T5-XXL text encoding is not available in this build yet")
    }

    /// Frees the weights (unless resident) and the compute buffer.
    pub fn release(&mut self) {}

    pub fn runner(&mut self) -> Option<&mut Runner> {
        None
    }
}

/// Lets the first `extra` padding positions of an additive mask be attended (Chroma's
/// `chroma_t5_mask_pad`).
pub fn attend_padding(mask: &mut [f32], extra: usize) {
    for m in mask.iter_mut().filter(|m| m.is_infinite()).take(extra) {
        *m = 0.0;
    }
}
