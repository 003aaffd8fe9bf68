//! First-stage autoencoders: AutoencoderKL (SD 1.x/2.x/SDXL, SD3, Flux, Flux.2), TAESD, the
//! Wan2.1 and Wan2.2 video VAEs, TAEHV (their tiny counterpart), HunyuanVideo 1.5's VAE ([`HunyuanVae`]), Mage-Flow's VAE ([`MageVae`]), and the identity of pixel-space models ([`PixelSpace`]).
//!
//! Each network implements [`VaeNet`]: its graphs and its latent conventions. A loaded one,
//! `Loaded<V>`, is a [`FirstStage`], which does the host steps around the network that the
//! reference's `VAE` base class does, in the same order:
//!
//! - encode: image [W, H, 3, N] in [0, 1] → (unless TAESD) `x * 2 - 1` → encoder (tiled when
//!   asked) → encoder output: KL moments [W/8, H/8, 8, N] (mean ‖ logvar) or TAESD latents.
//!   Then [`VaeNet::output_to_latents`] (KL: `mean + exp(0.5·clamp(logvar, -30, 20)) · noise`,
//!   the noise drawn from the generation RNG — img2img samples, it does not take the mean)
//!   and [`VaeNet::vae_to_diffusion`] (KL: `(z - shift) * scale_factor`).
//! - decode: diffusion latents → [`VaeNet::diffusion_to_vae`] (KL: `z / scale_factor + shift`)
//!   → decoder (tiled when asked) → (unless TAESD) `clamp((x + 1) / 2, 0, 1)`. TAESD output
//!   is returned as computed (about [0, 1], unclamped), like the reference.
//!
//! The latent scale factor (0.18215 SD 1.x/2.x, 0.13025 SDXL) is therefore applied here,
//! on the host, never inside the graphs. Flux.2's autoencoder differs: its encoder output is
//! the patchified mean (no sampling, no noise drawn) and diffusion latents are normalised
//! per channel, `(z - mean) · scale / std`. The Wan VAEs scale like KL, encode to the latent
//! mean (no noise drawn) and normalise per channel with their own tables.
//!
//! Videos ([`FirstStage::encode_video`], [`FirstStage::decode_video`]) are `[W, H, T, C, 1]`
//! and go through the same host steps; spatial tiles span all frames (each tile is a video of
//! its own), and temporal tiling is the network's own business ([`VaeNet::decode_video`]).
//! [`decode_video_with_retry`] retries a failed video decode with temporal, then spatial tiling.

pub mod audio;
pub mod autoencoder_kl;
pub mod bigvgan;
pub(crate) mod feat_cache;
pub mod hunyuan;
pub mod ltx;
pub mod ltx_audio;
pub mod mage;
pub mod minimax_h3;
pub mod minimax_h3_audio;
pub mod pixel;
pub mod tae;
pub mod taehv;
#[cfg(test)]
pub(crate) mod testutil;
pub mod wan;

pub use autoencoder_kl::{AutoEncoderKL, VaeConfig, FLUX2_LATENT_MEAN, FLUX2_LATENT_STD};
pub use hunyuan::HunyuanVae;
pub use mage::MageVae;
pub use pixel::PixelSpace;
pub use tae::{TaeConfig, TinyAutoEncoder};
pub use taehv::{Taehv, TaehvConfig};
pub use wan::{WanVae, WanVaeConfig, WAN21_LATENT_MEAN, WAN21_LATENT_STD, WAN22_LATENT_MEAN, WAN22_LATENT_STD};

use crate::error::{Error, Result};
use crate::graph::{Components, Loaded, Runner};
use crate::runtime::tiling::{self, TemporalTiles, TileSpec, TilingParams};
use crate::tensor::Tensor;
use std::time::Instant;

/// Pixels per latent pixel of the SD-family autoencoders (Flux.2's: 16, [`VaeNet::scale`]).
pub const SCALE: usize = 8;

/// Progress of tiled runs: (step, steps, seconds per step).
pub type Progress<'a> = Option<&'a mut dyn FnMut(i32, i32, f32)>;


/// A first-stage network: its graphs (one batch of pictures, or one video, per call) and
/// its latent conventions. The host steps and tiling around it are shared
/// (`impl FirstStage for Loaded<V>`).
pub trait VaeNet: Send {
    /// For messages.
    fn name(&self) -> &'static str;
    /// Pixels per latent pixel.
    fn scale(&self) -> usize;
    /// Video frames per latent frame after the first (pictures: 1).
    fn time_scale(&self) -> usize {
        1
    }
    /// Pictures are taken in [-1, 1] and returned clamped to [0, 1] (all but TAESD, which
    /// works on [0, 1] directly).
    fn unit_range(&self) -> bool {
        true
    }
    /// Channels of the encoder's output (KL: the moments, twice the latent's).
    fn encoder_output_channels(&self) -> i64;
    /// Image `[W, H, C, N]` (in [-1, 1] when [`VaeNet::unit_range`]) → encoder output.
    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor>;
    /// VAE-space latent `[w, h, z, N]` → image, unclamped.
    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor>;
    /// Encoder output → VAE-space latents, drawing noise from `randn` when it samples
    /// (default: the output is the latent).
    fn output_to_latents(&self, out: &Tensor, _randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        Ok(out.clone())
    }
    /// VAE-space → diffusion latents (`[w, h, C, N]`, or `[w, h, T, C, 1]` for video).
    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor;
    /// Diffusion → VAE-space latents.
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor;
    /// Whether [`VaeNet::encode_video`] / [`VaeNet::decode_video`] exist.
    fn supports_video(&self) -> bool {
        false
    }
    /// Whether `decode_video(.., Some(tiles), ..)` changes how it runs.
    fn supports_temporal_tiling(&self) -> bool {
        false
    }
    /// Video `[W, H, T, C, 1]` in [-1, 1] → VAE-space latent mean `[w, h, t, z]`.
    fn encode_video(&self, _runner: &mut Runner, _frames: &Tensor) -> Result<Tensor> {
        bail!("the {} encodes pictures, not videos", self.name())
    }
    /// VAE-space latents `[w, h, t, z, 1]` → video `[W, H, T, C]`, unclamped; `temporal`:
    /// temporal tiling asked for (with the tile size a VAE that takes one reads).
    fn decode_video(&self, _runner: &mut Runner, _latents: &Tensor, _temporal: Option<TemporalTiles>, _progress: Progress<'_>) -> Result<Tensor> {
        bail!("the {} decodes pictures, not videos", self.name())
    }
}

/// `frames` video frames → latent frames when each latent frame after the first stands for
/// `time_scale` video frames.
pub fn latent_frames(frames: usize, time_scale: usize) -> usize {
    if frames == 0 {
        0
    } else {
        (frames - 1) / time_scale.max(1) + 1
    }
}

/// The tile layout of `tiling` over a `w`×`h` latent (`factor`: encode tiles are larger).
fn tile_spec(tiling: &TilingParams, w: usize, h: usize, factor: f32, circular: (bool, bool)) -> TileSpec {
    let (tx, ty, overlap) = tiling::tile_sizes(tiling, w as i64, h as i64, factor);
    TileSpec { tile_size_x: tx, tile_size_y: ty, overlap, circular_x: circular.0, circular_y: circular.1 }
}

/// The decode tiles of `tiling` over `latents` (none when tiling is off), logged when `log`.
fn decode_tiles(tiling: &TilingParams, latents: &Tensor, circular: (bool, bool), log: bool) -> Option<TileSpec> {
    let spec = tiling.enabled.then(|| tile_spec(tiling, latents.ne(0), latents.ne(1), 1.0, circular))?;
    if log {
        sd_debug!("VAE Tile size: {}x{}", spec.tile_size_x, spec.tile_size_y);
    }
    Some(spec)
}

/// A network's `[W, H, T, C]` video as the pipeline's `[W, H, T, C, 1]`.
fn as_video(t: Tensor) -> Result<Tensor> {
    let shape = [t.ne(0), t.ne(1), t.ne(2), t.ne(3), 1];
    t.reshape(&shape)
}

/// `x * 2 - 1` for networks working in [-1, 1].
fn to_net_range<V: VaeNet + ?Sized>(net: &V, x: &Tensor) -> Tensor {
    if net.unit_range() {
        x.map(|v| v * 2.0 - 1.0)
    } else {
        x.clone()
    }
}

/// `clamp((x + 1) / 2, 0, 1)` for networks working in [-1, 1].
fn from_net_range<V: VaeNet + ?Sized>(net: &V, x: Tensor) -> Tensor {
    if net.unit_range() {
        x.map(|v| ((v + 1.0) * 0.5).clamp(0.0, 1.0))
    } else {
        x
    }
}

/// Pictures or video in [0, 1] → encoder output: the network's `run` on the input in its
/// range, over tiles of it when `tiling.enabled` (the tiles span every frame). The runner's
/// compute buffer is released afterwards.
fn encode_with<V: VaeNet + ?Sized>(
    net: &V,
    runner: &mut Runner,
    pixels: &Tensor,
    tiling: &TilingParams,
    circular: (bool, bool),
    mut run: impl FnMut(&mut Runner, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let start = Instant::now();
    let input = to_net_range(net, pixels);
    let scale = net.scale();
    let out = if tiling.enabled {
        let (w, h) = (input.ne(0) / scale, input.ne(1) / scale);
        ensure!(w > 0 && h > 0, "vae encode: image {}x{} is smaller than a latent pixel", input.ne(0), input.ne(1));
        let spec = tile_spec(tiling, w, h, tiling.encode_factor, circular);
        sd_debug!("VAE Tile size: {}x{}", spec.tile_size_x, spec.tile_size_y);
        tiling::process_tiles(&input, w, h, scale, &spec, None, |t| {
            run(runner, t).map_err(|e| Error::new(format!("vae encode compute failed while processing a tile: {e}")))
        })
    } else {
        run(runner, &input)
    };
    runner.release();
    let out = out.map_err(|e| Error::new(format!("vae encode compute failed: {e}")))?;
    sd_debug!("computing vae encode graph completed, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(out)
}

/// VAE-space latents → pixels in the network's range, mapped to [0, 1]: `run` on the whole
/// latent, or on tiles of it (`spec`; the tiles span every frame, `progress` counts tiles).
/// The runner's compute buffer is released afterwards.
fn decode_with<V: VaeNet + ?Sized>(
    net: &V,
    runner: &mut Runner,
    latents: &Tensor,
    spec: Option<&TileSpec>,
    progress: Progress<'_>,
    mut run: impl FnMut(&mut Runner, &Tensor, Progress<'_>) -> Result<Tensor>,
) -> Result<Tensor> {
    let start = Instant::now();
    let scale = net.scale();
    let out = match spec {
        Some(spec) => {
            let (w, h) = (latents.ne(0), latents.ne(1));
            ensure!(w <= usize::MAX / scale && h <= usize::MAX / scale, "vae decode: latent {w}x{h} too large");
            tiling::process_tiles(latents, w * scale, h * scale, scale, spec, progress, |t| {
                run(runner, t, None).map_err(|e| Error::new(format!("vae decode compute failed while processing a tile: {e}")))
            })
        }
        None => run(runner, latents, progress),
    };
    runner.release();
    let out = out.map_err(|e| Error::new(format!("vae decode compute failed: {e}")))?;
    let out = from_net_range(net, out);
    sd_debug!("computing vae decode graph completed, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(out)
}

/// Image [W, H, 3, N] in [0, 1] → encoder output (see the module doc). Tiled when
/// `tiling.enabled`; `circular` makes the tiles wrap around (graph-level circular padding
/// is `runner.options`).
pub fn encode_image<V: VaeNet + ?Sized>(net: &V, runner: &mut Runner, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
    encode_with(net, runner, image, tiling, circular, |r, x| net.encode(r, x))
}

/// VAE-space latents [w, h, z, N] → image [s·w, s·h, 3, N]: in [0, 1] (clamped) for all but
/// TAESD, about [0, 1] for TAESD. Tiled when `tiling.enabled` (tile size from
/// `tiling::tile_sizes`). On failure (e.g. out of memory) the pipeline may retry with
/// `tiling::retry_tiling`.
pub fn decode_image<V: VaeNet + ?Sized>(
    net: &V,
    runner: &mut Runner,
    latents: &Tensor,
    tiling: &TilingParams,
    circular: (bool, bool),
    progress: Progress<'_>,
) -> Result<Tensor> {
    let spec = decode_tiles(tiling, latents, circular, progress.is_some());
    decode_with(net, runner, latents, spec.as_ref(), progress, |r, z, _| net.decode(r, z))
}

/// Video `[W, H, T, C, 1]` in [0, 1] → VAE-space latent mean `[w, h, t, z, 1]`, `t` the
/// network's [`latent_frames`]. Spatial tiles span all frames.
pub fn encode_video<V: VaeNet + ?Sized>(net: &V, runner: &mut Runner, frames: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
    ensure!(net.supports_video(), "the {} encodes pictures, not videos", net.name());
    as_video(encode_with(net, runner, frames, tiling, circular, |r, x| net.encode_video(r, x))?)
}

/// VAE-space latents `[w, h, t, z, 1]` → video `[s·w, s·h, T, C, 1]` in [0, 1]. Spatial tiles
/// (`tiling.enabled`) span all frames; `tiling.temporal_tiling` is passed to the network.
/// `progress` counts spatial tiles; an untiled decode reports nothing, as the reference's
/// (a caller counting progress calls sees sampling steps only).
pub fn decode_video<V: VaeNet + ?Sized>(
    net: &V,
    runner: &mut Runner,
    latents: &Tensor,
    tiling: &TilingParams,
    circular: (bool, bool),
    progress: Progress<'_>,
) -> Result<Tensor> {
    ensure!(net.supports_video(), "the {} decodes pictures, not videos", net.name());
    let temporal = tiling.temporal_tiling.then_some(tiling.temporal_tiles);
    if temporal.is_some() && !net.supports_temporal_tiling() {
        sd_warn!("the {} has no temporal tiling; decoding without it", net.name());
    }
    let spec = decode_tiles(tiling, latents, circular, true);
    as_video(decode_with(net, runner, latents, spec.as_ref(), progress, |r, z, _| net.decode_video(r, z, temporal, None))?)
}

/// A loaded first stage as the pipeline uses it: pictures and videos ↔ diffusion latents,
/// with the host steps of the reference's `VAE` base class around the networks. Encoding and
/// decoding run between its networks' phase hooks (`Components::begin` / `end`).
pub trait FirstStage: Components + Send {
    /// Image [W, H, 3, N] in [0, 1] → encoder output (see [`encode_image`]).
    fn encode(&mut self, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor>;
    /// Encoder output → VAE-space latents, drawing noise from `randn` when it samples.
    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor>;
    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor;
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor;
    /// VAE-space latents → image (see [`decode_image`]).
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

    /// Video frames per latent frame after the first (Wan: 4; picture autoencoders: 1).
    fn time_scale(&self) -> usize {
        1
    }

    /// Latent frames of a `frames`-frame video (Wan: `(frames - 1) / 4 + 1`).
    fn latent_frames(&self, frames: usize) -> usize {
        latent_frames(frames, self.time_scale())
    }

    /// Whether `tiling.temporal_tiling` changes how [`FirstStage::decode_video`] runs (the
    /// retry of a failed decode tries it first then).
    fn supports_temporal_tiling(&self) -> bool {
        false
    }

    /// Video `[W, H, T, 3, 1]` in [0, 1] → diffusion latents `[w, h, t, C, 1]`: the encoder's
    /// mean (no noise drawn), normalised. Picture-only first stages refuse.
    fn encode_video(&mut self, _frames: &Tensor, _tiling: &TilingParams, _circular: (bool, bool)) -> Result<Tensor> {
        bail!("this first stage encodes pictures, not videos")
    }

    /// Diffusion latents `[w, h, t, C, 1]` → video `[W, H, T, 3, 1]` in [0, 1]. Picture-only
    /// first stages refuse.
    fn decode_video(&mut self, _latents: &Tensor, _tiling: &TilingParams, _circular: (bool, bool), _progress: Progress<'_>) -> Result<Tensor> {
        bail!("this first stage decodes pictures, not videos")
    }
}

impl<V: VaeNet + 'static> FirstStage for Loaded<V> {
    fn encode(&mut self, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        let (net, runner) = self.parts();
        encode_image(net, runner, image, tiling, circular)
    }

    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        self.model.output_to_latents(out, randn)
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        self.model.vae_to_diffusion(z)
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        self.model.diffusion_to_vae(z)
    }

    fn decode(&mut self, latents: &Tensor, tiling: &TilingParams, circular: (bool, bool), progress: Progress<'_>) -> Result<Tensor> {
        let (net, runner) = self.parts();
        decode_image(net, runner, latents, tiling, circular, progress)
    }

    fn time_scale(&self) -> usize {
        self.model.time_scale()
    }

    fn supports_temporal_tiling(&self) -> bool {
        self.model.supports_temporal_tiling()
    }

    fn encode_video(&mut self, frames: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        let (net, runner) = self.parts();
        let mean = encode_video(net, runner, frames, tiling, circular)?;
        Ok(net.vae_to_diffusion(&mean))
    }

    fn decode_video(&mut self, latents: &Tensor, tiling: &TilingParams, circular: (bool, bool), progress: Progress<'_>) -> Result<Tensor> {
        let (net, runner) = self.parts();
        ensure!(latents.shape().len() == 5, "vae decode: expected video latents [w, h, t, C, 1], got shape {:?}", latents.shape());
        decode_video(net, runner, &net.diffusion_to_vae(latents), tiling, circular, progress)
    }
}

/// The tiling to retry a failed video decode with, and its name for the log: temporal tiling
/// first where the first stage has it, then spatial tiles of half the latent (keeping the
/// temporal tiling); `None` when both are on already. The reference's newer rule.
pub fn video_retry_tiling(t: &TilingParams, temporal_supported: bool, latent_w: usize, latent_h: usize) -> Option<(TilingParams, &'static str)> {
    if temporal_supported && !t.temporal_tiling {
        let mode = if t.enabled { "spatial+temporal" } else { "temporal" };
        return Some((TilingParams { temporal_tiling: true, ..*t }, mode));
    }
    let spatial = tiling::retry_tiling(t, latent_w as i64, latent_h as i64)?;
    Some((spatial, if spatial.temporal_tiling { "spatial+temporal" } else { "spatial" }))
}

/// [`FirstStage::decode_video`], retried when it fails (likely out of memory) with temporal
/// tiling, then spatial tiling as well ([`video_retry_tiling`]). The last error is returned
/// when nothing is left to try.
pub fn decode_video_with_retry(
    fs: &mut dyn FirstStage,
    latents: &Tensor,
    tiling: &TilingParams,
    circular: (bool, bool),
    mut progress: Progress<'_>,
) -> Result<Tensor> {
    let mut tiling = *tiling;
    loop {
        let attempt = fs.decode_video(latents, &tiling, circular, progress.as_mut().map(|p| &mut **p as &mut dyn FnMut(i32, i32, f32)));
        let e = match attempt {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let Some((next, mode)) = video_retry_tiling(&tiling, fs.supports_temporal_tiling(), latents.ne(0), latents.ne(1)) else {
            return Err(e);
        };
        sd_warn!("VAE decode failed (likely out of memory: {e}); retrying with {mode} tiling");
        tiling = next;
    }
}

/// `f(value, channel)` over the latent's channels for the `table` channels of a per-channel
/// table (the channel axis is 2 of `[w, h, C, N]`, 3 of a video `[w, h, T, C, 1]`); the
/// decoders' input checks refuse other widths, so other channels map to the identity.
pub(crate) fn per_channel(z: &Tensor, table: usize, f: impl Fn(f32, usize) -> f32) -> Tensor {
    let video = z.shape().len() == 5;
    let plane = (z.ne(0) * z.ne(1) * if video { z.ne(2) } else { 1 }).max(1);
    let channels = z.ne(if video { 3 } else { 2 }).max(1);
    let mut out = z.clone();
    for (i, v) in out.data_mut().iter_mut().enumerate() {
        let c = (i / plane) % channels;
        if c < table {
            *v = f(*v, c);
        }
    }
    out
}

/// The first `channels` channels of a video latent `[w, h, t, C, 1]`: the video's, when a
/// family packs its audio behind them (LTX-2.3); other tensors as they are.
pub(crate) fn video_channels(z: &Tensor, channels: usize) -> Tensor {
    let s = z.shape();
    if s.len() != 5 || s[4] != 1 || s[3] <= channels {
        return z.clone();
    }
    let mut shape = s.to_vec();
    shape[3] = channels;
    let len = s[0] * s[1] * s[2] * channels;
    Tensor::from_vec(&shape, z.data()[..len].to_vec()).expect("a prefix of the latent")
}

/// Frames `range` of `x` `[W, H, T, C, ...]` as `[W, H, len, C]`.
pub(crate) fn take_frames(x: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
    let (w, h, t, c) = (x.ne(0), x.ne(1), x.ne(2), x.ne(3));
    ensure!(range.start < range.end && range.end <= t, "frames {range:?} of a {t}-frame video");
    let plane = w * h;
    let mut data = Vec::with_capacity(plane * range.len() * c);
    for ch in 0..c {
        let base = ch * t * plane;
        data.extend_from_slice(&x.data()[base + range.start * plane..base + range.end * plane]);
    }
    Tensor::from_vec(&[w, h, range.len(), c], data)
}

/// Each frame of `x` `[W, H, T, C]` as `[W, H, 1, C]`.
pub(crate) fn split_frames(x: &Tensor) -> Result<Vec<Tensor>> {
    (0..x.ne(2)).map(|i| take_frames(x, i..i + 1)).collect()
}

/// `[W, H, T_i, C]` pieces one after the other in time.
pub(crate) fn cat_frames(parts: &[Tensor]) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| crate::error::Error::new("no frames to join"))?;
    let (w, h, c) = (first.ne(0), first.ne(1), first.ne(3));
    ensure!(parts.iter().all(|p| p.ne(0) == w && p.ne(1) == h && p.ne(3) == c), "frames of different sizes");
    if parts.len() == 1 {
        return first.clone().reshape(&[w, h, first.ne(2), c]);
    }
    let t: usize = parts.iter().map(|p| p.ne(2)).sum();
    let plane = w * h;
    let mut data = Vec::with_capacity(plane * t * c);
    for ch in 0..c {
        for p in parts {
            let n = p.ne(2) * plane;
            data.extend_from_slice(&p.data()[ch * n..(ch + 1) * n]);
        }
    }
    Tensor::from_vec(&[w, h, t, c], data)
}

/// Picture latents `[W, H, C, N]` without their first `n` channels.
pub(crate) fn drop_leading_channels(z: &Tensor, n: usize) -> Tensor {
    let (plane, c) = (z.ne(0) * z.ne(1), z.ne(2));
    if z.shape().len() < 3 || z.is_empty() || n == 0 {
        return z.clone();
    }
    let n = n.min(c);
    let data: Vec<f32> = z.data().chunks(plane * c).flat_map(|item| item[n * plane..].iter().copied()).collect();
    let mut shape = z.shape().to_vec();
    shape[2] = c - n;
    Tensor::from_vec(&shape, data).unwrap_or_else(|_| z.clone())
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
mod tests;
