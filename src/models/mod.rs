//! Networks, one file per family like the reference's src/model/: text encoders (`te`),
//! diffusion models, autoencoders (`vae`), shared blocks (`common`), adapters and upscalers.

pub mod adapter;
pub mod common;
pub mod diffusion;
pub mod te;
pub mod vae;
