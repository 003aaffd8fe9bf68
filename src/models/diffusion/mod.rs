//! Diffusion networks (noise / velocity predictors) and the one interface the sampling loop
//! calls them through.

pub mod anima;
pub mod boogu_image;
pub mod ernie_image;
pub mod flux;
pub mod hidream_o1;
pub mod hunyuan_video;
pub mod ideogram4;
pub mod krea2;
pub mod lens;
pub mod lingbot_video;
pub mod ltx;
pub mod mage_flow;
pub mod minimax_h3;
pub mod minit2i;
pub mod mmdit;
pub mod pid;
pub mod qwen_image;
pub mod sefi_image;
pub mod unet;
pub mod wan;
pub mod zimage;

use super::common::rope::RefIndexMode;
use super::condition::Condition;
use crate::error::Result;
use crate::graph::Components;
use crate::tensor::Tensor;

/// One denoiser evaluation's inputs (the reference's `DiffusionParams`).
#[derive(Clone, Copy)]
pub struct DiffusionInput<'a> {
    /// Noisy latent, already scaled by `c_in`: `[W, H, C, N]`.
    pub x: &'a Tensor,
    /// The model timestep: one for all, one per batch item, or (video models whose frames
    /// are denoised at different levels, Wan2.2 TI2V) one per latent frame.
    pub timesteps: &'a [f32],
    pub cond: &'a Condition,
    /// ControlNet residuals (UNet models), added × `control_strength`.
    pub controls: Option<&'a [Tensor]>,
    pub control_strength: f32,
    /// The distilled guidance value the model embeds (Flux dev).
    pub guidance: f32,
    /// Reference-image latents appended as tokens (Kontext), each `[W, H, C, 1]`, and how
    /// their positions are numbered.
    pub ref_latents: &'a [Tensor],
    pub ref_index_mode: RefIndexMode,
    /// The reference tokens are modulated for timestep 0 (`force_ref_timestep_zero`, Krea2).
    pub ref_timestep_zero: bool,
    /// Transformer blocks to skip (skip-layer guidance).
    pub skip_layers: &'a [i32],
    /// What only video models read (`None` for images).
    pub video: Option<&'a VideoInput<'a>>,
    /// IP-Adapter image tokens `[ctx, tokens, 1]` and their strength (UNet models whose
    /// cross-attentions have image projections).
    pub image_tokens: Option<(&'a Tensor, f32)>,
    /// The schedule's sigma at index `step + 1` (steps counted from 1, so the one after the
    /// next), which the reference passes HunyuanVideo's meanflow embedder as `timestep_r`;
    /// `None` past the schedule's end.
    pub timestep_r: Option<f32>,
    /// PuLID's identity embedding `[2048, tokens, 1]` and its weight (Flux models with PuLID
    /// modules; others ignore it).
    pub identity: Option<(&'a Tensor, f32)>,
    /// One timestep per video token (latent cell), for models that denoise conditioned
    /// frames less (LTX-2.3's start and end pictures); `timesteps` then holds the step's.
    pub token_timesteps: Option<&'a [f32]>,
}

/// The video-only inputs of one evaluation. A video latent is `[W, H, T, C, N]` (T latent
/// frames); the per-request conditioning (I2V's concat latent and CLIP-vision tokens) travels
/// in the [`Condition`].
#[derive(Clone, Copy, Debug, Default)]
pub struct VideoInput<'a> {
    /// Wan VACE: the context `[W, H, T, 96, 1]` (inactive and reactive latents and the mask
    /// patches) its blocks read, and how strongly their hints are added.
    pub vace_context: Option<&'a Tensor>,
    pub vace_strength: f32,
    /// Frames per second of the request (models that embed time in seconds).
    pub fps: f32,
    /// The video frames of the request (0: as the latent's frames make); LTX-2.3 derives its
    /// audio length from it.
    pub frames: usize,
    /// Keyframe latent frames appended behind the video's (LTX-2.3's end picture) and the
    /// pixel frame their positions are counted from.
    pub keyframes: usize,
    pub keyframe_at: Option<usize>,
    /// The references in sequence order (MiniMax-H3's keyframes, and Ref2VA's pictures, videos
    /// and sound): each but sound alone takes the next of `DiffusionInput::ref_latents`.
    pub ref_roles: &'a [RefRole],
    /// Reference sound latents (MiniMax-H3's `[steps, 2, 32]`), indexed by the roles.
    pub ref_audio_latents: &'a [Tensor],
}

/// What a reference latent of a video model stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefRole {
    /// A keyframe picture at this pixel frame (0: the start picture, else the end one).
    Keyframe(usize),
    /// A reference picture (MiniMax-H3's Ref2VA), before the video in time.
    Picture,
    /// A reference video (MiniMax-H3's Ref2VA), before the video in time, with its sound
    /// (an index into `VideoInput::ref_audio_latents`) if any.
    Video { audio: Option<usize> },
    /// Reference sound alone (an index into `VideoInput::ref_audio_latents`).
    Audio(usize),
}

impl<'a> DiffusionInput<'a> {
    pub fn new(x: &'a Tensor, timesteps: &'a [f32], cond: &'a Condition) -> DiffusionInput<'a> {
        DiffusionInput {
            x,
            timesteps,
            cond,
            controls: None,
            control_strength: 1.0,
            guidance: 0.0,
            ref_latents: &[],
            ref_index_mode: RefIndexMode::Fixed,
            ref_timestep_zero: false,
            skip_layers: &[],
            video: None,
            image_tokens: None,
            timestep_r: None,
            identity: None,
            token_timesteps: None,
        }
    }
}

/// A loaded diffusion network of some family. Its networks' phase hooks (`Components::begin`
/// / `end`) bracket a sampling run.
pub trait DiffusionModel: Components + Send {
    /// The model output for `input` (noise, v or velocity as the family predicts):
    /// `[W, H, C_out, N]`.
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor>;

    /// The outputs of two passes of one evaluation (a guided step's prompt and negative
    /// prompt) as one batch of two, where the family's every op works per batch item: each
    /// output is the one `compute` gives, and the weights are read once. `None`: these two
    /// inputs do not batch; the caller computes them one by one.
    fn compute_pair(&mut self, _a: &DiffusionInput<'_>, _b: &DiffusionInput<'_>) -> Result<Option<[Tensor; 2]>> {
        Ok(None)
    }

    /// Whether a batch is the frames of one video (a UNet with AnimateDiff motion modules).
    fn has_motion_modules(&self) -> bool {
        false
    }

    /// The model reads an identity embedding ([`DiffusionInput::identity`]: Flux with PuLID).
    fn takes_identity(&self) -> bool {
        false
    }

    /// The request's flow shift, for models that read it themselves (MiniMax-H3's audio
    /// timesteps follow the video's shift).
    fn set_flow_shift(&mut self, _shift: f32) {}
}
