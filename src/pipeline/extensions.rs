//! Generation extensions (the reference's `GenerationExtension`): networks loaded with the
//! context that act on a request through hooks instead of being wired into the pipeline.
//! PhotoMaker and PuLID use the hooks here:
//!
//! - [`Extension::loras`]: LoRAs its file carries, in effect for every request (before the
//!   request's own);
//! - [`Extension::prepare`]: before the request's prompts are encoded, with the conditioner
//!   in its phase: it may prepare a condition of its own and rewrite the prompt text;
//! - [`Extension::conditioned`]: once the prompt's condition is encoded;
//! - [`Extension::step_condition`]: per sampling step, a condition the prompt's pass uses
//!   instead of the plain one (the first extension that gives one wins, as in the reference);
//! - [`Extension::identity`]: an identity embedding every pass of the diffusion model reads
//!   (PuLID's, for Flux);
//! - [`Extension::end_request`]: the request's state is dropped.

use super::conditioning::Conditioner;
use crate::error::Result;
use crate::graph::Components;
use crate::models::Condition;
use crate::params::{ImgGenParams, Lora};
use crate::tensor::Tensor;

/// What an extension sees of a request before its prompts are encoded.
pub struct ExtRequest<'a> {
    pub cond: &'a mut dyn Conditioner,
    pub params: &'a ImgGenParams,
    /// The prompt the request's condition will be encoded from (an extension may rewrite it).
    pub text: String,
    pub clip_skip: i32,
    pub width: usize,
    pub height: usize,
    /// Sampling steps of the request (before img2img's strength cut: the reference's total).
    pub total_steps: usize,
}

pub trait Extension: Components + Send {
    fn name(&self) -> &'static str;

    fn loras(&self) -> Vec<Lora> {
        Vec::new()
    }

    fn prepare(&mut self, _req: &mut ExtRequest<'_>) -> Result<()> {
        Ok(())
    }

    fn conditioned(&mut self, _cond: &Condition) {}

    fn step_condition(&self, _step: i32) -> Option<&Condition> {
        None
    }

    fn identity(&self) -> Option<(&Tensor, f32)> {
        None
    }

    fn end_request(&mut self) {}
}

/// The condition the prompt's pass of `step` uses: the first extension's, else `plain`.
pub fn step_condition<'c>(extensions: &'c [Box<dyn Extension>], step: i32, plain: &'c Condition) -> &'c Condition {
    extensions.iter().find_map(|e| e.step_condition(step)).unwrap_or(plain)
}

/// The identity embedding and weight the diffusion passes read: the first extension's.
pub fn identity(extensions: &[Box<dyn Extension>]) -> Option<(&Tensor, f32)> {
    extensions.iter().find_map(|e| e.identity())
}
