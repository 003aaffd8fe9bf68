//! Prompts (and images) to the condition a diffusion model reads: one trait, one file per
//! kind of conditioner (the reference keeps ten of them in one 3,200-line header).

pub mod anima;
pub mod clip;
pub mod clip_vision;
pub mod flux;
pub mod gpt_oss;
pub mod llm;
pub mod minit2i;
pub mod pid;
pub mod qwen_edit;
pub mod sd3;
pub mod t5;

use crate::error::Result;
use crate::graph::Components;
use crate::models::Condition;
use crate::pipeline::ref_images::RefImageParams;
use crate::tensor::Tensor;

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
    /// Reference images `[W, H, 3, 1]` in [0, 1] for a vision-language encoder (empty
    /// unless `pass_to_vlm`), and how to size them for it.
    pub ref_images: &'a [Tensor],
    pub refs: RefImageParams,
    /// What a vision-language conditioner is shown of a request's references instead of
    /// `ref_images`, in order (MiniMax-H3's Ref2VA); empty: `ref_images`.
    pub shown: &'a [Shown],
}

/// A reference as a vision-language conditioner is shown it.
#[derive(Clone, Debug)]
pub enum Shown {
    /// A picture `[W, H, 3, 1]` in [0, 1].
    Picture(Tensor),
    /// Frames `[W, H, 3, 1]` of a video, each with its time in seconds.
    Video(Vec<(Tensor, f32)>),
    /// A sound (announced only).
    Audio,
}

/// A loaded conditioner of some family. `encode` runs between its networks' phase hooks
/// (`Components::begin` / `end`), which the pipeline brackets around all of a request's
/// prompts.
pub trait Conditioner: Components + Send {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition>;

    /// The unconditional condition of a request whose condition is `cond`: the negative
    /// prompt encoded, unless the family derives it from `cond` (MiniT2I masks the prompt).
    fn unconditional(&mut self, _cond: &Condition, negative: &CondRequest<'_>) -> Result<Condition> {
        self.encode(negative)
    }

    /// Reference images passed to it (`pass_to_vlm`) are its to read even though the family
    /// takes no reference latents (HiDream-O1's edit prompt).
    fn reads_ref_images(&self) -> bool {
        false
    }

    /// The UNet families' CLIP conditioner (PhotoMaker tokenizes through it), if this is one.
    fn as_clip(&mut self) -> Option<&mut clip::ClipConditioner> {
        None
    }
}
