//! models
pub mod common;
pub mod diffusion;
