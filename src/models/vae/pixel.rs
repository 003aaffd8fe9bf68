//! The first stage of pixel-space models (Chroma1-Radiance): no network. The diffusion
//! "latent" is the RGB image scaled to [-1, 1] (the reference's `FakeVAE`: the KL
//! autoencoder's input and output scaling around an identity).

use super::{FirstStage, Progress};
use crate::error::Result;
use crate::graph::{Component, Components};
use crate::runtime::tiling::TilingParams;
use crate::tensor::Tensor;

/// Pixels per latent pixel.
pub const SCALE: usize = 1;

pub struct PixelSpace;

impl Components for PixelSpace {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        Vec::new()
    }
}

impl FirstStage for PixelSpace {
    /// Tiling changes nothing on an identity, so it is not done.
    fn encode(&mut self, image: &Tensor, _tiling: &TilingParams, _circular: (bool, bool)) -> Result<Tensor> {
        Ok(image.map(|v| v * 2.0 - 1.0))
    }

    /// Nothing is sampled (no noise is drawn).
    fn output_to_latents(&self, out: &Tensor, _randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        Ok(out.clone())
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        z.clone()
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        z.clone()
    }

    fn decode(&mut self, latents: &Tensor, _tiling: &TilingParams, _circular: (bool, bool), _progress: Progress<'_>) -> Result<Tensor> {
        Ok(latents.map(|v| ((v + 1.0) * 0.5).clamp(0.0, 1.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pixels_round_trip_through_the_latent_range() {
        let mut fs = PixelSpace;
        let img = Tensor::from_vec(&[2, 1, 3, 1], vec![0.0, 1.0, 0.25, 0.5, 0.75, 1.0]).unwrap();
        let t = TilingParams::default();
        let lat = fs.encode_latents(&img, &t, (false, false), &mut |_| panic!("no noise is drawn")).unwrap();
        assert_eq!(lat.data(), &[-1.0, 1.0, -0.5, 0.0, 0.5, 1.0]);
        assert_eq!(fs.decode(&fs.diffusion_to_vae(&lat), &t, (false, false), None).unwrap(), img);
        let out_of_range = Tensor::from_vec(&[1, 1, 3, 1], vec![-3.0, 3.0, 0.0]).unwrap();
        assert_eq!(fs.decode(&out_of_range, &t, (false, false), None).unwrap().data(), &[0.0, 1.0, 0.5]);
    }
}
