//! First-stage autoencoders: AutoencoderKL (SD 1.x/2.x/SDXL, SD3, Flux), TAESD and the Wan2.1
//! VAE (Qwen-Image), and the identity of pixel-space models ([`PixelSpace`]).
//!
//! [`Vae`] is what the pipeline holds; it does the host steps around the networks that
//! the reference's `VAE` base class does, in the same order:
//!
//! - encode: image [W, H, 3, N] in [0, 1] → (KL only) `x * 2 - 1` → encoder (tiled when
//!   asked) → encoder output: KL moments [W/8, H/8, 8, N] (mean ‖ logvar) or TAESD latents.
//!   Then [`Vae::output_to_latents`] (KL: `mean + exp(0.5·clamp(logvar, -30, 20)) · noise`,
//!   the noise drawn from the generation RNG — img2img samples, it does not take the mean)
//!   and [`Vae::vae_to_diffusion_latents`] (KL: `(z - shift) * scale_factor`).
//! - decode: diffusion latents → [`Vae::diffusion_to_vae_latents`] (KL:
//!   `z / scale_factor + shift`) → decoder (tiled when asked) → (KL only) `clamp((x + 1) / 2, 0, 1)`.
//!   TAESD output is returned as computed (about [0, 1], unclamped), like the reference.
//!
//! The latent scale factor (0.18215 SD 1.x/2.x, 0.13025 SDXL) is therefore applied here,
//! on the host, never inside the graphs. Flux.2's autoencoder differs: its encoder output is
//! the patchified mean (no sampling, no noise drawn) and diffusion latents are normalised
//! per channel, `(z - mean) · scale / std`. The Wan VAE scales like KL, encodes to the latent
//! mean (no noise drawn) and normalises per channel with its own table. The pipeline holds a
//! first stage as a [`FirstStage`], which a loaded [`Vae`] implements.

pub mod autoencoder_kl;
pub mod pixel;
pub mod tae;
pub mod wan;
#[cfg(test)]
pub(crate) mod testutil;

pub use autoencoder_kl::{AutoEncoderKL, VaeConfig, FLUX2_LATENT_MEAN, FLUX2_LATENT_STD};
pub use pixel::PixelSpace;
pub use tae::{TaeConfig, TinyAutoEncoder};
pub use wan::{WanVae, WanVaeConfig, WAN21_LATENT_MEAN, WAN21_LATENT_STD};

use crate::error::Result;
use crate::graph::{Components, Loaded, Runner};
use crate::runtime::tiling::{self, TileSpec, TilingParams};
use crate::tensor::Tensor;
use std::time::Instant;

/// Pixels per latent pixel of the SD-family autoencoders (Flux.2's: 16, [`Vae::scale`]).
pub const SCALE: usize = 8;

/// Progress of tiled runs: (step, steps, seconds per step).
pub type Progress<'a> = Option<&'a mut dyn FnMut(i32, i32, f32)>;

/// The first stage a pipeline uses.
#[allow(clippy::large_enum_variant)] // one per context
pub enum Vae {
    Kl(AutoEncoderKL),
    Tiny(TinyAutoEncoder),
    Wan(WanVae),
}

/// Image tiles for encoding are this much larger than for decoding (more context); the
/// reference keeps a smaller factor for the video VAEs.
const ENCODE_TILE_FACTOR: f32 = 2.0;
const VIDEO_ENCODE_TILE_FACTOR: f32 = 1.30539;

impl Vae {
    /// Images are taken in [-1, 1] and returned clamped to [0, 1] (all but TAESD).
    fn works_in_unit_range(&self) -> bool {
        !matches!(self, Vae::Tiny(_))
    }

    /// Pixels per latent pixel.
    pub fn scale(&self) -> usize {
        match self {
            Vae::Kl(m) => m.cfg.scale(),
            Vae::Tiny(_) => SCALE,
            Vae::Wan(_) => wan::SCALE,
        }
    }

    /// Channels of the encoder's output: moments (8) for KL, latents (4) for TAESD.
    pub fn encoder_output_channels(&self) -> i64 {
        match self {
            Vae::Kl(m) => m.cfg.encoder_output_channels(),
            Vae::Tiny(t) => t.cfg.z_channels,
            Vae::Wan(w) => w.cfg.z_dim,
        }
    }

    fn compute(&self, runner: &mut Runner, x: &Tensor, decode: bool) -> Result<Tensor> {
        match (self, decode) {
            (Vae::Kl(m), true) => autoencoder_kl::decode(runner, m, x),
            (Vae::Kl(m), false) => autoencoder_kl::encode(runner, m, x),
            (Vae::Tiny(t), true) => tae::decode(runner, t, x),
            (Vae::Tiny(t), false) => tae::encode(runner, t, x),
            (Vae::Wan(w), true) => wan::decode(runner, w, x),
            (Vae::Wan(w), false) => wan::encode(runner, w, x),
        }
    }

    /// Image [W, H, 3, N] in [0, 1] → encoder output (see the module doc). Tiled when
    /// `tiling.enabled`; `circular` makes the tiles wrap around (graph-level circular
    /// padding is `runner.options`). The runner's compute buffer is released afterwards.
    pub fn encode(
        &self,
        runner: &mut Runner,
        image: &Tensor,
        tiling: &TilingParams,
        circular: (bool, bool),
    ) -> Result<Tensor> {
        let start = Instant::now();
        let input = if self.works_in_unit_range() { image.map(|v| v * 2.0 - 1.0) } else { image.clone() };
        let scale = self.scale();
        let out = if tiling.enabled {
            let (w, h) = (input.ne(0) / scale, input.ne(1) / scale);
            ensure!(w > 0 && h > 0, "vae encode: image {}x{} is smaller than a latent pixel", input.ne(0), input.ne(1));
            let factor = if matches!(self, Vae::Wan(_)) { VIDEO_ENCODE_TILE_FACTOR } else { ENCODE_TILE_FACTOR };
            let (tx, ty, overlap) = tiling::tile_sizes(tiling, w as i64, h as i64, factor);
            sd_debug!("VAE Tile size: {tx}x{ty}");
            let spec = TileSpec { tile_size_x: tx, tile_size_y: ty, overlap, circular_x: circular.0, circular_y: circular.1 };
            tiling::process_tiles(&input, w, h, scale, &spec, None, |t| {
                self.compute(runner, t, false)
                    .map_err(|e| crate::error::Error::new(format!("vae encode compute failed while processing a tile: {e}")))
            })
        } else {
            self.compute(runner, &input, false)
        };
        runner.release();
        let out = out.map_err(|e| crate::error::Error::new(format!("vae encode compute failed: {e}")))?;
        sd_debug!("computing vae encode graph completed, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(out)
    }

    /// VAE-space latents [w, h, 4, N] → image [8w, 8h, 3, N]: in [0, 1] for KL (clamped),
    /// about [0, 1] for TAESD. Tiled when `tiling.enabled` (tile size from
    /// `tiling::tile_sizes`). On failure (e.g. out of memory) the pipeline may retry with
    /// `tiling::retry_tiling`. The runner's compute buffer is released afterwards.
    pub fn decode(
        &self,
        runner: &mut Runner,
        latents: &Tensor,
        tiling: &TilingParams,
        circular: (bool, bool),
        progress: Progress<'_>,
    ) -> Result<Tensor> {
        let spec = tiling.enabled.then(|| {
            let (tx, ty, overlap) = tiling::tile_sizes(tiling, latents.ne(0) as i64, latents.ne(1) as i64, 1.0);
            if progress.is_some() {
                sd_debug!("VAE Tile size: {tx}x{ty}");
            }
            TileSpec { tile_size_x: tx, tile_size_y: ty, overlap, circular_x: circular.0, circular_y: circular.1 }
        });
        self.decode_with(runner, latents, spec.as_ref(), progress)
    }

    /// Decode with an explicit tile layout (`None`: one graph for the whole latent).
    pub fn decode_tiled(
        &self,
        runner: &mut Runner,
        latents: &Tensor,
        spec: &TileSpec,
        progress: Progress<'_>,
    ) -> Result<Tensor> {
        self.decode_with(runner, latents, Some(spec), progress)
    }

    fn decode_with(
        &self,
        runner: &mut Runner,
        latents: &Tensor,
        spec: Option<&TileSpec>,
        progress: Progress<'_>,
    ) -> Result<Tensor> {
        let start = Instant::now();
        let scale = self.scale();
        let out = match spec {
            Some(spec) => {
                let (w, h) = (latents.ne(0), latents.ne(1));
                ensure!(
                    w <= usize::MAX / scale && h <= usize::MAX / scale,
                    "vae decode: latent {w}x{h} too large"
                );
                tiling::process_tiles(latents, w * scale, h * scale, scale, spec, progress, |t| {
                    self.compute(runner, t, true)
                        .map_err(|e| crate::error::Error::new(format!("vae decode compute failed while processing a tile: {e}")))
                })
            }
            None => self.compute(runner, latents, true),
        };
        runner.release();
        let mut out = out.map_err(|e| crate::error::Error::new(format!("vae decode compute failed: {e}")))?;
        if self.works_in_unit_range() {
            out = out.map(|v| ((v + 1.0) * 0.5).clamp(0.0, 1.0));
        }
        sd_debug!("computing vae decode graph completed, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(out)
    }

    /// Encoder output → VAE-space latents. KL samples the diagonal Gaussian with noise
    /// `randn(n)` (n standard normals from the generation RNG, in element order of the
    /// mean [w, h, 4, N]); TAESD output already is the latent.
    pub fn output_to_latents(&self, out: &Tensor, randn: impl FnOnce(usize) -> Vec<f32>) -> Result<Tensor> {
        match self {
            Vae::Kl(m) if m.cfg.flux2 => Ok(out.clone()),
            Vae::Kl(m) if m.cfg.raw_encoder_latents => Ok(split_moments(out)?.0),
            Vae::Kl(_) => {
                let (mean, logvar) = split_moments(out)?;
                let noise = randn(mean.len());
                ensure!(noise.len() == mean.len(), "vae: got {} noise values for {}", noise.len(), mean.len());
                let data = mean
                    .data()
                    .iter()
                    .zip(logvar.data())
                    .zip(&noise)
                    .map(|((&m, &lv), &e)| m + (0.5 * lv.clamp(-30.0, 20.0)).exp() * e)
                    .collect();
                Tensor::from_vec(mean.shape(), data)
            }
            Vae::Tiny(_) | Vae::Wan(_) => Ok(out.clone()),
        }
    }

    /// `(z - shift) * scale_factor` for KL; identity for TAESD.
    pub fn vae_to_diffusion_latents(&self, z: &Tensor) -> Tensor {
        match self {
            Vae::Kl(m) if m.cfg.raw_encoder_latents => z.clone(),
            Vae::Kl(m) if m.cfg.flux2 => {
                let scale = m.cfg.scale_factor;
                per_channel(z, FLUX2_LATENT_MEAN.len(), |v, c| ((v - FLUX2_LATENT_MEAN[c]) * scale) / FLUX2_LATENT_STD[c])
            }
            Vae::Wan(_) => per_channel(z, WAN21_LATENT_MEAN.len(), |v, c| ((v - WAN21_LATENT_MEAN[c]) * WAN_SCALE_FACTOR) / WAN21_LATENT_STD[c]),
            Vae::Kl(m) => {
                let (scale, shift) = (m.cfg.scale_factor, m.cfg.shift_factor);
                z.map(|v| (v - shift) * scale)
            }
            Vae::Tiny(_) => z.clone(),
        }
    }

    /// `z / scale_factor + shift` for KL; identity for TAESD.
    pub fn diffusion_to_vae_latents(&self, z: &Tensor) -> Tensor {
        match self {
            Vae::Kl(m) if m.cfg.flux2 => {
                let scale = m.cfg.scale_factor;
                per_channel(z, FLUX2_LATENT_MEAN.len(), |v, c| (v * FLUX2_LATENT_STD[c]) / scale + FLUX2_LATENT_MEAN[c])
            }
            Vae::Wan(_) => per_channel(z, WAN21_LATENT_MEAN.len(), |v, c| (v * WAN21_LATENT_STD[c]) / WAN_SCALE_FACTOR + WAN21_LATENT_MEAN[c]),
            Vae::Kl(m) => {
                let (scale, shift) = (m.cfg.scale_factor, m.cfg.shift_factor);
                z.map(|v| v / scale + shift)
            }
            Vae::Tiny(_) => z.clone(),
        }
    }
}

/// A loaded first stage as the pipeline uses it: image ↔ diffusion latents, with the host
/// steps of the reference's `VAE` base class around the networks. Encoding and decoding
/// run between its networks' phase hooks (`Components::begin` / `end`).
pub trait FirstStage: Components + Send {
    /// Image [W, H, 3, N] in [0, 1] → encoder output (see [`Vae::encode`]).
    fn encode(&mut self, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor>;
    /// Encoder output → VAE-space latents, drawing noise from `randn` when it samples.
    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor>;
    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor;
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor;
    /// VAE-space latents → image (see [`Vae::decode`]).
    fn decode(&mut self, latents: &Tensor, tiling: &TilingParams, circular: (bool, bool), progress: Progress<'_>) -> Result<Tensor>;

    /// Image → diffusion latents: encode, sample (or take) the latent, scale it.
    fn encode_latents(
        &mut self,
        image: &Tensor,
        tiling: &TilingParams,
        circular: (bool, bool),
        randn: &mut dyn FnMut(usize) -> Vec<f32>,
    ) -> Result<Tensor> {
        let out = self.encode(image, tiling, circular)?;
        let latents = self.output_to_latents(&out, randn)?;
        Ok(self.vae_to_diffusion(&latents))
    }
}

impl FirstStage for Loaded<Vae> {
    fn encode(&mut self, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        let (vae, runner) = self.parts();
        vae.encode(runner, image, tiling, circular)
    }

    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        self.model.output_to_latents(out, randn)
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        self.model.vae_to_diffusion_latents(z)
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        self.model.diffusion_to_vae_latents(z)
    }

    fn decode(&mut self, latents: &Tensor, tiling: &TilingParams, circular: (bool, bool), progress: Progress<'_>) -> Result<Tensor> {
        let (vae, runner) = self.parts();
        vae.decode(runner, latents, tiling, circular, progress)
    }
}

/// The Wan VAE's latent scale factor (applied with its per-channel table).
const WAN_SCALE_FACTOR: f32 = 1.0;

/// `f(value, channel)` over a [w, h, C, N] latent for the `table` channels of a per-channel
/// table; the decoders' input checks refuse other widths, so other channels map to the identity.
fn per_channel(z: &Tensor, table: usize, f: impl Fn(f32, usize) -> f32) -> Tensor {
    let plane = (z.ne(0) * z.ne(1)).max(1);
    let channels = z.ne(2).max(1);
    let mut out = z.clone();
    for (i, v) in out.data_mut().iter_mut().enumerate() {
        let c = (i / plane) % channels;
        if c < table {
            *v = f(*v, c);
        }
    }
    out
}

/// Splits KL moments [w, h, 2c, N] into (mean, logvar), each [w, h, c, N].
pub fn split_moments(moments: &Tensor) -> Result<(Tensor, Tensor)> {
    let (w, h, c2, n) = (moments.ne(0), moments.ne(1), moments.ne(2), moments.ne(3));
    ensure!(moments.shape().len() <= 4 && c2 % 2 == 0 && c2 > 0, "vae moments of shape {:?}", moments.shape());
    let c = c2 / 2;
    let plane = w * h * c;
    let (mut mean, mut logvar) = (Vec::with_capacity(plane * n), Vec::with_capacity(plane * n));
    for b in 0..n {
        let batch = &moments.data()[b * 2 * plane..(b + 1) * 2 * plane];
        mean.extend_from_slice(&batch[..plane]);
        logvar.extend_from_slice(&batch[plane..]);
    }
    Ok((Tensor::from_vec(&[w, h, c, n], mean)?, Tensor::from_vec(&[w, h, c, n], logvar)?))
}

#[cfg(test)]
mod tests {
    use super::testutil::{cpu, load_kl, load_tae, read_bin, TempDir};
    use super::*;
    use crate::graph::{ParamStore, Scope, TypeMap};
    use std::path::PathBuf;

    fn golden_dir(set: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden").join(set)
    }

    /// A reference picture (`set/name`) as [W, H, 3, 1] of 0..255 values.
    fn golden_png(set: &str, name: &str) -> Tensor {
        let dir = TempDir::new("png");
        let out = dir.0.join("png.bin");
        let ok = std::process::Command::new(crate::testutil::numpy_python())
            .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools/vae_ref.py"))
            .arg("png")
            .arg(golden_dir(set).join(name))
            .arg("-")
            .arg(&out)
            .status()
            .expect("python3 needed to read PNGs")
            .success();
        assert!(ok, "reading {name}");
        read_bin(&out)
    }

    /// Like the reference's float → byte conversion of output pictures.
    fn to_u8(v: f32) -> f32 {
        if v <= 0.0 {
            0.0
        } else if v >= 1.0 {
            255.0
        } else {
            (v * 255.0 + 0.5) as u8 as f32
        }
    }

    /// Decodes the reference's final latent of sd1 case `latent` and compares the picture
    /// with the reference's `png` (a path under golden/): max and mean |diff| in grey levels.
    fn decode_golden(vae: &Vae, latent: &str, png: (&str, &str), tiling: &TilingParams) -> (f32, f32) {
        let latent = read_bin(&golden_dir("sd1").join(format!("latents/{latent}.bin")));
        let mut runner = Runner::new(cpu(), 2);
        let mut steps = 0;
        let mut progress = |_: i32, _: i32, _: f32| steps += 1;
        let img = vae
            .decode(&mut runner, &vae.diffusion_to_vae_latents(&latent), tiling, (false, false), Some(&mut progress))
            .unwrap();
        assert!(!tiling.enabled || steps > 1);
        let want = golden_png(png.0, png.1);
        assert_eq!(img.shape(), want.shape());
        let diffs: Vec<f32> = img.data().iter().zip(want.data()).map(|(&a, &b)| (to_u8(a) - b).abs()).collect();
        let max = diffs.iter().fold(0f32, |m, &d| m.max(d));
        let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
        eprintln!("{}: max |diff| {max}, mean |diff| {mean:.4} grey levels", png.1);
        (max, mean)
    }

    #[test]
    fn decode_matches_reference_pictures() {
        // The stores must outlive the models: their weights live there.
        let (_kl_store, kl, _) = load_kl(true);
        let vae = Vae::Kl(kl);
        let (max, mean) = decode_golden(&vae, "defaults_0", ("sd1", "defaults_0.png"), &TilingParams::default());
        assert!(max <= 3.0 && mean <= 0.25, "max {max}, mean {mean}");
        // sd1-extra/taesd_txt2img samples exactly like sd1/sampler_euler, then decodes with TAESD.
        let (_tae_store, tae, _) = load_tae(true);
        let tae = Vae::Tiny(tae);
        let (max, mean) =
            decode_golden(&tae, "sampler_euler_0", ("sd1-extra", "taesd_txt2img_0.png"), &TilingParams::default());
        assert!(max <= 3.0 && mean <= 0.25, "max {max}, mean {mean}");
    }

    /// 16×16 latent in 3×3 tiles of 8 with overlap 0.5 (slow: run with SD_PARITY set).
    #[test]
    fn tiled_decode_matches_reference_picture() {
        if std::env::var_os("SD_PARITY").is_none() {
            eprintln!("skipped: set SD_PARITY to run the tiled golden decode");
            return;
        }
        let tiling =
            TilingParams { enabled: true, tile_size_x: 8, tile_size_y: 8, target_overlap: 0.5, ..Default::default() };
        let (_store, vae, _) = load_kl(true);
        let vae = Vae::Kl(vae);
        let (max, mean) = decode_golden(&vae, "vae_tiling_0", ("sd1", "vae_tiling_0.png"), &tiling);
        assert!(max <= 3.0 && mean <= 0.25, "max {max}, mean {mean}");
    }

    /// The host steps around the networks, on a VAE that is declared but not loaded.
    #[test]
    fn latent_conversions_and_sampling() {
        let types = TypeMap::new();
        let mut store = ParamStore::new(1024).unwrap();
        let cfg = VaeConfig::sd(0.13025, false);
        let vae = Vae::Kl(AutoEncoderKL::new(&mut Scope::new(&mut store, &types, autoencoder_kl::PREFIX), &cfg));
        assert_eq!(vae.encoder_output_channels(), 8);
        let z = Tensor::from_vec(&[1, 1, 4, 1], vec![0.13025, -0.2605, 0.0, 1.0]).unwrap();
        let v = vae.diffusion_to_vae_latents(&z);
        assert_eq!(&v.data()[..3], &[1.0, -2.0, 0.0]);
        let back = vae.vae_to_diffusion_latents(&v);
        assert!(back.data().iter().zip(z.data()).all(|(a, b)| (a - b).abs() < 1e-6));

        // Moments of two batch items: mean channels first, then logvar, per item.
        let mut m = Vec::new();
        for b in 0..2 {
            m.extend([1.0 + b as f32, 2.0, 3.0, 4.0]); // mean
            m.extend([0.0, 2.0f32.ln() * 2.0, -100.0, 100.0]); // logvar
        }
        let moments = Tensor::from_vec(&[1, 1, 8, 2], m).unwrap();
        let (mean, logvar) = split_moments(&moments).unwrap();
        assert_eq!(mean.data(), &[1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 3.0, 4.0]);
        assert_eq!(logvar.shape(), &[1, 1, 4, 2]);
        let lat = vae.output_to_latents(&moments, |n| vec![1.0; n]).unwrap();
        let want = [2.0, 4.0, 3.0 + (-15f32).exp(), 4.0 + 10f32.exp()];
        for (a, b) in lat.data()[..4].iter().zip(want) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
        }
        assert!(vae.output_to_latents(&moments, |_| vec![0.0; 3]).is_err());
        assert!(split_moments(&Tensor::zeros(&[1, 1, 3, 1])).is_err());
    }

    /// Flux.2: the encoder output is the latent (no noise drawn), normalised per channel
    /// with the fixed table, and back.
    #[test]
    fn flux2_latent_normalisation() {
        let types = TypeMap::new();
        let mut store = ParamStore::new(1024).unwrap();
        let cfg = VaeConfig::sd(0.18215, false).into_flux2();
        let vae = Vae::Kl(AutoEncoderKL::new(&mut Scope::new(&mut store, &types, autoencoder_kl::PREFIX), &cfg));
        assert_eq!((vae.scale(), vae.encoder_output_channels()), (16, 128));
        let z = Tensor::from_vec(&[2, 1, 128, 1], (0..256).map(|v| v as f32 / 100.0).collect()).unwrap();
        let lat = vae.output_to_latents(&z, |_| panic!("Flux.2 draws no noise")).unwrap();
        assert_eq!(lat, z);
        let d = vae.vae_to_diffusion_latents(&z);
        let c = 5;
        assert_eq!(d.data()[2 * c + 1], (z.data()[2 * c + 1] - FLUX2_LATENT_MEAN[c]) / FLUX2_LATENT_STD[c]);
        let back = vae.diffusion_to_vae_latents(&d);
        assert!(back.data().iter().zip(z.data()).all(|(a, b)| (a - b).abs() < 1e-5));
    }
}
