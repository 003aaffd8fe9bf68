//! The audio first stages' common face: a loaded audio VAE turns the denoised audio latent of
//! a video into sound (MiniMax-H3's, LTX-2.3's).

use crate::error::Result;
use crate::graph::Components;
use crate::tensor::Tensor;

/// Decoded sound: `channels` streams of `sample_rate` samples a second, channel-interleaved.
#[derive(Clone, Debug, PartialEq)]
pub struct Waveform {
    pub sample_rate: u32,
    pub channels: u32,
    pub interleaved: Vec<f32>,
}

/// A loaded audio VAE as the video job uses it.
pub trait AudioStage: Components + Send {
    /// The shape (ggml order) of an audio latent of `steps` steps, as the sampled latent
    /// packs its values behind the video's.
    fn latent_shape(&self, steps: usize) -> Vec<usize>;
    /// Audio latent of [`AudioStage::latent_shape`] → sound.
    fn decode_audio(&mut self, latent: &Tensor) -> Result<Waveform>;
    /// The sample rate [`AudioStage::encode_audio`] takes; `None`: no encoder here.
    fn input_sample_rate(&self) -> Option<u32> {
        None
    }
    /// A waveform `[samples, channels]` at the input rate → its audio latent.
    fn encode_audio(&mut self, _waveform: &Tensor) -> Result<Tensor> {
        bail!("this audio VAE has no encoder here")
    }
}
