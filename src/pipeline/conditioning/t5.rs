//! The T5-XXL part of the DiT conditioners (SD3, Flux, Chroma) over `pipeline::t5`.
//!
//! T5's weights are not kept through sampling: the conditioner's phase (around a request's
//! prompts) reads them, they serve the prompt and the negative prompt, and the phase's end
//! (before sampling) frees them again. With the context's `eager_load` they are
//! loaded at creation and stay resident.

use crate::error::Result;
use crate::graph::{Component, Placement};
use crate::models::te::t5::T5XXL_PREFIX;
pub use crate::models::te::t5_tokenizer::T5Vocab;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::PadOptions;
use crate::pipeline::t5::{tokenize_weighted_t5, Residency, T5Encoder};
use crate::tensor::Tensor;
use std::sync::Arc;

pub use crate::pipeline::t5::{attend_padding, T5Tokens};

/// A T5 encoder for one conditioner.
pub struct T5Text {
    encoder: T5Encoder,
}

impl T5Text {
    /// The encoder of the context's files, `None` when they hold no T5 weights.
    pub fn open(weights: &Arc<Weights>, vocab: T5Vocab, place: &Placement, n_threads: i32, resident: bool) -> Result<Option<T5Text>> {
        if !weights.has_prefix(T5XXL_PREFIX) {
            return Ok(None);
        }
        let residency = if resident { Residency::Resident } else { Residency::OnDemand };
        let encoder = T5Encoder::new(weights, T5XXL_PREFIX, vocab, place, n_threads, residency)?;
        Ok(Some(T5Text { encoder }))
    }

    /// Width of the hidden states (4096 for T5-XXL).
    pub fn width(&self) -> usize {
        self.encoder.config().model_dim as usize
    }

    /// `text` as weighted T5 tokens in chunks of `chunk_len`, each ending in EOS.
    pub fn tokenize(&self, text: &str, chunk_len: usize) -> T5Tokens {
        tokenize_weighted_t5(self.encoder.tokenizer(), text, &PadOptions::t5_chunks(chunk_len))
    }

    /// Hidden states `[width, L, 1]` of one chunk (attending only where `mask` is 0 when
    /// given). Within the conditioner's phase the weights stay loaded until its end.
    pub fn encode(&mut self, ids: &[u32], mask: Option<&[f32]>) -> Result<Tensor> {
        self.encoder.encode(ids, mask)
    }

    pub fn component(&mut self) -> &mut dyn Component {
        &mut self.encoder
    }
}
