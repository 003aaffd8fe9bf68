//! Upscaling networks, like the reference's `src/model/upscaler/`: ESRGAN for pictures, LTX-2.3's latent upsampler.

pub mod esrgan;
pub mod ltx_latent;
