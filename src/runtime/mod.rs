//! Math that is not a network: noise generators, sigma schedules, denoiser
//! parameterisations and the samplers that drive a denoising model.

pub mod args;
pub mod defaults;
pub mod denoiser;
pub mod rng;
pub mod samplers;
pub mod schedulers;
