//! Math that is not a network: noise generators, sigma schedules, denoiser
//! parameterisations, the samplers that drive a denoising model, step caches, tiling, latent
//! previews, image preprocessing and the importance-matrix collector.

pub mod args;
pub mod cache;
pub mod defaults;
pub mod denoiser;
pub mod imatrix;
pub mod preprocess;
pub mod preview;
pub mod rng;
pub mod samplers;
pub mod schedulers;
pub mod tiling;
