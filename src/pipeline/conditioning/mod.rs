//! Prompts (and images) to the condition a diffusion model reads: one trait, one file per
//! kind of conditioner (the reference keeps ten of them in one 3,200-line header).

pub mod clip;
pub mod flux;
pub mod sd3;
pub mod t5;

use crate::error::Result;
use crate::graph::Runner;
use crate::models::Condition;

/// What one conditioning pass is asked for (the reference's `ConditionerParams`).
#[derive(Clone, Debug)]
pub struct CondRequest<'a> {
    pub text: &'a str,
    /// <= 0: the model's default.
    pub clip_skip: i32,
    /// Size of the generated image in pixels (SDXL's size conditioning).
    pub width: usize,
    pub height: usize,
    /// Zero the cross-attention context (SDXL's empty negative prompt).
    pub zero_out_masked: bool,
}

/// A loaded conditioner of some family.
pub trait Conditioner: Send {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition>;

    /// Every graph runner (graph options, compute-buffer release).
    fn runners(&mut self) -> Vec<&mut Runner>;

    /// Frees compute buffers and the weights that are only loaded while encoding.
    fn release(&mut self) {
        for r in self.runners() {
            r.release();
        }
        self.unload();
    }

    /// Frees weights loaded for encoding only (T5); nothing by default.
    fn unload(&mut self) {}
}
