//! Networks, one file per family like the reference's src/model/: text encoders (`te`),
//! diffusion models, autoencoders (`vae`), shared blocks (`common`), adapters, upscalers and
//! detectors.
//! The pipeline sees them through three traits: `diffusion::DiffusionModel`,
//! `vae::FirstStage` and (in the pipeline, since it owns prompt parsing) the conditioner.

pub mod adapter;
pub mod common;
pub mod condition;
pub mod detector;
pub mod diffusion;
pub mod te;
pub mod upscaler;
pub mod vae;

pub use condition::Condition;
