//! Diffusion networks (noise / velocity predictors) and the one interface the sampling loop
//! calls them through.

pub mod unet;

use super::condition::Condition;
use crate::error::Result;
use crate::graph::Components;
use crate::tensor::Tensor;

/// One denoiser evaluation's inputs (the reference's `DiffusionParams`).
pub struct DiffusionInput<'a> {
    /// Noisy latent, already scaled by `c_in`: `[W, H, C, N]`.
    pub x: &'a Tensor,
    /// The model timestep, one per batch item (or one for all).
    pub timesteps: &'a [f32],
    pub cond: &'a Condition,
    /// ControlNet residuals (UNet models), added × `control_strength`.
    pub controls: Option<&'a [Tensor]>,
    pub control_strength: f32,
}

impl<'a> DiffusionInput<'a> {
    pub fn new(x: &'a Tensor, timesteps: &'a [f32], cond: &'a Condition) -> DiffusionInput<'a> {
        DiffusionInput { x, timesteps, cond, controls: None, control_strength: 1.0 }
    }
}

/// A loaded diffusion network of some family. Its networks' phase hooks (`Components::begin`
/// / `end`) bracket a sampling run.
pub trait DiffusionModel: Components + Send {
    /// The model output for `input` (noise, v or velocity as the family predicts):
    /// `[W, H, C_out, N]`.
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor>;
}
