//! Generation orchestration: loading the model set, prompts to conditioning, the sampling
//! loop, decoding.

pub mod callbacks;
pub mod conditioner;
pub mod generate;
pub mod imageops;
pub mod loader;
pub mod lora;
pub mod prompt;
pub mod sd;

pub use generate::capture_final_latents;
pub use sd::StableDiffusion;
