//! Generation orchestration: the model families (what to load for a detected version),
//! prompts to conditioning, the sampling loop, decoding.

pub mod adetailer;
pub mod animatediff;
pub mod callbacks;
pub mod conditioning;
pub mod control;
pub mod extensions;
pub mod families;
pub mod fields;
pub mod guidance;
pub mod hires;
pub mod image;
pub mod imageops;
pub mod ip_adapter;
pub mod loader;
pub mod lora;
mod ltx_refine;
pub mod photomaker;
pub mod pulid;
pub mod prompt;
pub mod ref_images;
pub mod request;
pub mod resample;
pub mod sampling;
pub mod t5;
pub mod upscaler;
pub mod video;

pub use families::ModelSet;
pub use image::capture_final_latents;
pub use upscaler::Upscaler;
