//! Flux.2 klein conditioning, like the reference's `LLMEmbedder` for klein: the prompt in
//! Qwen3's chat template (with an empty `<think>` block), padded to 512 tokens with an
//! attention mask, through the LLM; the hidden states after layers 9, 18 and 27 side by
//! side are the transformer's text context.

use super::{CondRequest, Conditioner};
use crate::error::Result;
use crate::graph::{Component, Components, Placement};
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use std::sync::Arc;

pub struct Flux2Conditioner {
    context_dim: i64,
}

impl Flux2Conditioner {
    pub fn new(_weights: &Arc<Weights>, _place: &Placement, _n_threads: i32, context_dim: i64) -> Result<Flux2Conditioner> {
        bail!("Flux.2 klein needs the LLM text encoder, which this build does not have yet (context {context_dim})")
    }
}

impl Components for Flux2Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        Vec::new()
    }
}

impl Conditioner for Flux2Conditioner {
    fn encode(&mut self, _req: &CondRequest<'_>) -> Result<Condition> {
        bail!("no LLM (context {})", self.context_dim)
    }
}
