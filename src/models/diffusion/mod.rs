//! Diffusion networks (noise/velocity predictors).
pub mod unet;
