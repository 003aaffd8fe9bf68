//! The Wan VAEs (the reference's `wan_vae.hpp`): causal video autoencoders whose 3-D
//! convolutions only look back in time. Wan2.1's (Wan 2.1, Wan2.2 A14B, Qwen-Image on single
//! frames): 16 latent channels at 1/8 of the image. Wan2.2's (TI2V 5B): 48 channels at 1/16,
//! over 2×2-patchified pixels (12 channels), encoder width 160, decoder width 256, residual
//! levels with parameter-free averaging / duplicating shortcuts. Both: 1/4 of the frames
//! after the first.
//!
//! - Weights under `first_stage_model.` with the original names: `encoder.conv1`, the levels
//!   (Wan2.1: `encoder.downsamples.N` residual blocks `residual.{0,2,3,6}` / `shortcut` and
//!   resamplers `resample.1` / `time_conv`; Wan2.2: `encoder.downsamples.L.downsamples.N`),
//!   `encoder.middle.{0,1,2}` (the middle attention is `norm`, `to_qkv`, `proj`),
//!   `encoder.head.{0,2}`, `conv1`, `conv2`, and the decoder's mirror (`upsamples`). Norms
//!   are RMS norms over the channels whose `gamma` is kept in the file's shape; 3-D kernels
//!   `[OC, IC, KD, KH, KW]` are f16 `[KW, KH, KD, OC·IC]`.
//! - Frames go through the networks in chunks that share a feature cache (the last frames
//!   each causal convolution saw): the encoder takes the first frame, then 4 at a time, the
//!   decoder one latent frame at a time (its time upsamplers double the frames from the
//!   second chunk on). A single image is the first chunk alone: no time convolution runs.
//! - Each chunk is its own graph computation; the cache goes back to the host between them
//!   ([`FeatCache`]), so memory holds one chunk's compute buffer and the cache, not the
//!   whole video's (the reference builds one graph over all frames). The values are those of
//!   the one graph ([`WanVae::decode_graph`], kept to check that). With temporal tiling the
//!   decoder goes further: after each time upsampler it continues one frame per computation.
//! - Files whose `decoder.conv1` kernel is 2-D (a third dimension of more than 3) are the 2-D
//!   variant: every convolution is a plain 2-D one over each frame.
//! - Encoding returns the latent mean (no sampling); diffusion latents are normalised per
//!   channel with the fixed tables ([`WAN21_LATENT_MEAN`], [`WAN22_LATENT_MEAN`], …).

pub(crate) mod blocks;

use super::{cat_frames, per_channel, split_frames, take_frames, Progress, VaeNet};
use crate::error::Result;
use crate::graph::{Graph, Runner, Scope, T};
use crate::models::common::dit::chunk;
use crate::runtime::tiling::TemporalTiles;
use crate::tensor::Tensor;
use super::feat_cache::{run_cached, FeatCache};
use blocks::{AttentionBlock, Build, CachedConv, Conv, DownStage, ResampleMode, ResidualBlock, RmsNorm, UpStage};
use std::ops::Range;

/// Per-channel mean of the Wan2.1 VAE's latents (the reference's table).
pub const WAN21_LATENT_MEAN: [f32; 16] =
    [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921];
/// Per-channel standard deviation of the Wan2.1 VAE's latents (the reference's table).
pub const WAN21_LATENT_STD: [f32; 16] =
    [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160];

/// Per-channel mean of the Wan2.2 VAE's latents (the reference's table).
pub const WAN22_LATENT_MEAN: [f32; 48] = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
];
/// Per-channel standard deviation of the Wan2.2 VAE's latents (the reference's table).
pub const WAN22_LATENT_STD: [f32; 48] = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
];

/// Pixels per latent pixel of the networks (Wan2.2 patchifies 2×2 on top).
pub const SCALE: usize = 8;
/// Video frames per latent frame after the first.
pub const TIME_SCALE: usize = 4;
/// The latent scale factor (applied with the per-channel tables).
const SCALE_FACTOR: f32 = 1.0;
/// Longest video we build graphs for (frames), so sizes stay far from overflow.
const MAX_FRAMES: usize = 1 << 14;
/// Largest side we build graphs for (as the picture autoencoders).
const MAX_SIDE: usize = 1 << 16;

#[derive(Clone, Debug, PartialEq)]
pub struct WanVaeConfig {
    /// Picture channels (4 for Qwen-Image-Layered's RGBA).
    pub in_channels: i64,
    /// Side of the pixel patches that become channels (Wan2.2: 2).
    pub patch: i64,
    /// Encoder width.
    pub dim: i64,
    /// Decoder width.
    pub dec_dim: i64,
    pub z_dim: i64,
    pub dim_mult: Vec<i64>,
    pub num_res_blocks: usize,
    /// Per level: whether the encoder's downsampling also halves the frames.
    pub temporal_downsample: Vec<bool>,
    /// Per level: whether the decoder's upsampling also doubles the frames.
    pub temporal_upsample: Vec<bool>,
    /// Wan2.2's levels: residual blocks plus a parameter-free shortcut around the level.
    pub residual_levels: bool,
    /// Every convolution is 2-D.
    pub is_2d: bool,
    pub decode_only: bool,
}

impl WanVaeConfig {
    /// The Wan2.1 VAE (dim 96, mult 1/2/4/4, 2 residual blocks, 16 latent channels).
    pub fn wan21(decode_only: bool) -> WanVaeConfig {
        WanVaeConfig {
            in_channels: 3,
            patch: 1,
            dim: 96,
            dec_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temporal_downsample: vec![false, true, true],
            temporal_upsample: vec![true, true, false],
            residual_levels: false,
            is_2d: false,
            decode_only,
        }
    }

    /// The Wan2.2 VAE (encoder 160, decoder 256, 48 latent channels over 2×2 patches).
    pub fn wan22(decode_only: bool) -> WanVaeConfig {
        WanVaeConfig { patch: 2, dim: 160, dec_dim: 256, z_dim: 48, residual_levels: true, ..Self::wan21(decode_only) }
    }

    /// The Wan2.1 (or, with `wan22`, Wan2.2) VAE under `prefix`, 2-D when the files'
    /// `decoder.conv1` kernel is.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str, decode_only: bool, in_channels: i64, wan22: bool) -> WanVaeConfig {
        let base = if wan22 { Self::wan22(decode_only) } else { Self::wan21(decode_only) };
        let mut cfg = WanVaeConfig { in_channels, ..base };
        if shape_of(&format!("{prefix}decoder.conv1.weight")).is_some_and(|ne| ne.len() >= 3 && ne[2] > 3) {
            sd_debug!("USING 2D VAE");
            cfg.is_2d = true;
            cfg.temporal_downsample = vec![false; 3];
            cfg.temporal_upsample = vec![false; 3];
        }
        cfg
    }

    /// Channels the networks see at the pixel end (patches of picture channels).
    fn io_channels(&self) -> i64 {
        self.in_channels * self.patch * self.patch
    }

    /// Pixels per latent pixel.
    pub fn scale(&self) -> usize {
        SCALE * self.patch as usize
    }
}

/// One step of the encoder's or decoder's level sequence.
#[derive(Clone, Debug)]
enum Layer {
    Res(ResidualBlock),
    Resample(blocks::Resample),
    Down(DownStage),
    Up(UpStage),
}

impl Layer {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        match self {
            Layer::Res(r) => r.forward(g, x, cache),
            Layer::Resample(r) => r.forward(g, x, cache, chunk_idx),
            Layer::Down(d) => d.forward(g, x, cache, chunk_idx),
            Layer::Up(u) => u.forward(g, x, cache, chunk_idx),
        }
    }

    /// Whether the frames double here (from the second chunk on).
    fn doubles_frames(&self) -> bool {
        match self {
            Layer::Resample(r) => r.mode == ResampleMode::Up3d,
            Layer::Up(u) => u.temporal(),
            _ => false,
        }
    }
}

/// Which part of the decoder a graph runs: the prelude (first convolution and middle), a
/// range of levels, the head.
#[derive(Clone, Debug, PartialEq)]
struct Part {
    prelude: bool,
    levels: Range<usize>,
    head: bool,
}

/// The middle (residual, attention, residual) and head (norm, SiLU, convolution) both
/// networks share, with their first convolution and level sequence.
#[derive(Clone, Debug)]
struct Network {
    conv1: CachedConv,
    levels: Vec<Layer>,
    middle: (ResidualBlock, AttentionBlock, ResidualBlock),
    head_norm: RmsNorm,
    head_conv: CachedConv,
    /// Cache slots of its causal convolutions.
    slots: usize,
}

impl Network {
    /// The middle at `mid` channels and the head from `head` to `out_ch` channels.
    fn middle_and_head(s: &mut Scope, mid: i64, head: i64, out_ch: i64, b: &mut Build) -> ((ResidualBlock, AttentionBlock, ResidualBlock), RmsNorm, CachedConv) {
        let middle = (
            ResidualBlock::new(s, "middle.0", mid, mid, b),
            AttentionBlock::new(s, "middle.1", mid, b.shape_of),
            ResidualBlock::new(s, "middle.2", mid, mid, b),
        );
        let head_norm = RmsNorm::new(s, "head.0", head, b.shape_of);
        (middle, head_norm, CachedConv::new(s, "head.2", head, out_ch, 3, 1, b))
    }

    fn encoder(s: &mut Scope, b: &mut Build) -> Network {
        let cfg = b.cfg;
        let mut s = s.sub("encoder");
        let dims: Vec<i64> = std::iter::once(cfg.dim).chain(cfg.dim_mult.iter().map(|m| cfg.dim * m)).collect();
        let conv1 = CachedConv::new(&mut s, "conv1", cfg.io_channels(), dims[0], 3, 1, b);
        let mut levels = Vec::new();
        let last = cfg.dim_mult.len() - 1;
        for i in 0..=last {
            let (mut in_dim, out_dim) = (dims[i], dims[i + 1]);
            let temporal = cfg.temporal_downsample.get(i).copied().unwrap_or(false);
            if cfg.residual_levels {
                levels.push(Layer::Down(DownStage::new(&mut s, &format!("downsamples.{i}"), in_dim, out_dim, temporal, i != last, b)));
                continue;
            }
            for _ in 0..cfg.num_res_blocks {
                levels.push(Layer::Res(ResidualBlock::new(&mut s, &format!("downsamples.{}", levels.len()), in_dim, out_dim, b)));
                in_dim = out_dim;
            }
            if i != last {
                let mode = if temporal { ResampleMode::Down3d } else { ResampleMode::Down2d };
                levels.push(Layer::Resample(blocks::Resample::new(&mut s, &format!("downsamples.{}", levels.len()), out_dim, mode, false, b)));
            }
        }
        let (middle, head_norm, head_conv) = Self::middle_and_head(&mut s, dims[last + 1], dims[last + 1], cfg.z_dim * 2, b);
        Network { conv1, levels, middle, head_norm, head_conv, slots: b.take_slots() }
    }

    fn decoder(s: &mut Scope, b: &mut Build) -> Network {
        let cfg = b.cfg;
        let mut s = s.sub("decoder");
        let last = cfg.dim_mult.len() - 1;
        let d = cfg.dec_dim;
        let dims: Vec<i64> = std::iter::once(d * cfg.dim_mult[last]).chain(cfg.dim_mult.iter().rev().map(|m| d * m)).collect();
        let conv1 = CachedConv::new(&mut s, "conv1", cfg.z_dim, dims[0], 3, 1, b);
        let mut levels = Vec::new();
        for i in 0..=last {
            let temporal = cfg.temporal_upsample.get(i).copied().unwrap_or(false);
            if cfg.residual_levels {
                levels.push(Layer::Up(UpStage::new(&mut s, &format!("upsamples.{i}"), dims[i], dims[i + 1], temporal, i != last, b)));
                continue;
            }
            // The previous level's upsampling halved the channels.
            let (mut in_dim, out_dim) = (if i == 0 { dims[0] } else { dims[i] / 2 }, dims[i + 1]);
            for _ in 0..cfg.num_res_blocks + 1 {
                levels.push(Layer::Res(ResidualBlock::new(&mut s, &format!("upsamples.{}", levels.len()), in_dim, out_dim, b)));
                in_dim = out_dim;
            }
            if i != last {
                let mode = if temporal { ResampleMode::Up3d } else { ResampleMode::Up2d };
                levels.push(Layer::Resample(blocks::Resample::new(&mut s, &format!("upsamples.{}", levels.len()), out_dim, mode, false, b)));
            }
        }
        let (middle, head_norm, head_conv) = Self::middle_and_head(&mut s, dims[0], dims[last + 1], cfg.io_channels(), b);
        Network { conv1, levels, middle, head_norm, head_conv, slots: b.take_slots() }
    }

    fn run_levels<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize, levels: Range<usize>) -> T<'g> {
        self.levels[levels].iter().fold(x, |x, layer| layer.forward(g, x, cache, chunk_idx))
    }

    fn run_middle<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        let x = self.middle.0.forward(g, x, cache);
        let x = self.middle.1.forward(g, x);
        self.middle.2.forward(g, x, cache)
    }

    fn run_head<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        self.head_conv.forward(g, self.head_norm.forward(g, x).silu(), cache)
    }

    /// One chunk through the encoder: levels, then middle, then head.
    fn encode_chunk<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        let x = self.conv1.forward(g, x, cache);
        let x = self.run_levels(g, x, cache, chunk_idx, 0..self.levels.len());
        let x = self.run_middle(g, x, cache);
        self.run_head(g, x, cache)
    }

    /// The whole decoder.
    fn all(&self) -> Part {
        Part { prelude: true, levels: 0..self.levels.len(), head: true }
    }

    /// The decoder cut after each level that doubles the frames.
    fn parts_by_frame_rate(&self) -> Vec<Part> {
        let mut parts = Vec::new();
        let mut start = 0;
        for (i, l) in self.levels.iter().enumerate() {
            if l.doubles_frames() {
                parts.push(Part { prelude: start == 0, levels: start..i + 1, head: false });
                start = i + 1;
            }
        }
        parts.push(Part { prelude: start == 0, levels: start..self.levels.len(), head: true });
        parts
    }

    /// Part of one latent frame's way through the decoder: middle, then levels, then head.
    fn decode_part<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize, part: &Part) -> T<'g> {
        let mut x = x;
        if part.prelude {
            x = self.conv1.forward(g, x, cache);
            x = self.run_middle(g, x, cache);
        }
        x = self.run_levels(g, x, cache, chunk_idx, part.levels.clone());
        if part.head {
            x = self.run_head(g, x, cache);
        }
        x
    }
}

/// The Wan VAE's weights and graph builders.
pub struct WanVae {
    pub cfg: WanVaeConfig,
    encoder: Option<(Network, Conv)>,
    decoder: Network,
    conv2: Conv,
}

impl WanVae {
    /// Declares every weight under the scope (prefix `first_stage_model.`); `shape_of`
    /// gives the files' shapes (the norms keep theirs).
    pub fn new(s: &mut Scope, cfg: &WanVaeConfig, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> WanVae {
        let mut b = Build::new(cfg, shape_of);
        let z2 = cfg.z_dim * 2;
        let encoder = (!cfg.decode_only).then(|| {
            let net = Network::encoder(s, &mut b);
            (net, Conv::new(s, "conv1", z2, z2, 1, 0, cfg.is_2d))
        });
        let decoder = Network::decoder(s, &mut b);
        let conv2 = Conv::new(s, "conv2", cfg.z_dim, cfg.z_dim, 1, 0, cfg.is_2d);
        WanVae { cfg: cfg.clone(), encoder, decoder, conv2 }
    }

    pub fn has_encoder(&self) -> bool {
        self.encoder.is_some()
    }

    fn encoder(&self) -> Result<&(Network, Conv)> {
        self.encoder.as_ref().ok_or_else(|| crate::error::Error::new("this VAE was loaded for decoding only"))
    }

    /// Frames `start..end` of the encoder's chunk `i` (the first frame, then 4 at a time;
    /// the 2-D variant keeps only the first of each 4).
    fn encode_chunk_frames(&self, i: usize) -> Range<usize> {
        if i == 0 {
            return 0..1;
        }
        let start = 1 + TIME_SCALE * (i - 1);
        start..if self.cfg.is_2d { start + 1 } else { start + TIME_SCALE }
    }

    /// One encoder chunk (pixels in [-1, 1]) → its latent mean.
    fn encode_piece<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> Result<T<'g>> {
        let (enc, conv1) = self.encoder()?;
        let x = blocks::patchify(x, self.cfg.patch);
        let out = conv1.forward(g, enc.encode_chunk(g, x, cache, chunk_idx));
        Ok(chunk(out, 2, 3, true)[0])
    }

    /// Part of one latent frame's way to pixels: `conv2` before the decoder's prelude, the
    /// pixel patches undone after its head.
    fn decode_piece<'g>(&self, g: &'g Graph, z: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize, part: &Part) -> T<'g> {
        let x = if part.prelude { self.conv2.forward(g, z) } else { z };
        let x = self.decoder.decode_part(g, x, cache, chunk_idx, part);
        if part.head {
            blocks::unpatchify(x, self.cfg.patch)
        } else {
            x
        }
    }

    /// Frames `[W, H, T, C]` in [-1, 1] → latent mean `[W/s, H/s, 1 + (T-1)/4, z]`, all in
    /// one graph (the reference's structure: memory grows with the frames). See
    /// [`WanVae::encode_frames`].
    pub fn encode_graph<'g>(&self, g: &'g Graph, x: T<'g>) -> Result<T<'g>> {
        let (enc, conv1) = self.encoder()?;
        let t = x.ne()[2] as usize;
        if t > 1 && self.cfg.is_2d {
            sd_warn!("Using 2D VAE to encode video, expect poor results");
        }
        let x = blocks::patchify(x, self.cfg.patch);
        let mut cache = FeatCache::new(g, enc.slots);
        let mut out: Option<T<'g>> = None;
        for i in 0..=(t - 1) / TIME_SCALE {
            let r = self.encode_chunk_frames(i);
            let part = enc.encode_chunk(g, blocks::frames(x, r.start as i64, r.end as i64), &mut cache, i);
            out = Some(out.map_or(part, |o| o.concat(part, 2)));
        }
        let out = conv1.forward(g, out.ok_or_else(|| crate::error::Error::new("vae encode: no frames"))?);
        Ok(chunk(out, 2, 3, true)[0])
    }

    /// Latent `[w, h, T, z]` → frames `[s·w, s·h, T', C]` in about [-1, 1] (unclamped), all in
    /// one graph: `T' = 1 + 4(T-1)` (the 2-D variant repeats each later frame 4 times). See
    /// [`WanVae::decode_frames`].
    pub fn decode_graph<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let t = z.ne()[2];
        if t > 1 && self.cfg.is_2d {
            sd_warn!("Using 2D VAE to decode video, expect poor results");
        }
        let x = self.conv2.forward(g, z);
        let mut cache = FeatCache::new(g, self.decoder.slots);
        let whole = Part { prelude: true, levels: 0..self.decoder.levels.len(), head: true };
        let mut out: Option<T<'g>> = None;
        for i in 0..t {
            let part = self.decoder.decode_part(g, blocks::frames(x, i, i + 1), &mut cache, i as usize, &whole);
            let mut o = out.map_or(part, |o| o.concat(part, 2));
            if i > 0 && self.cfg.is_2d {
                for _ in 0..TIME_SCALE - 1 {
                    o = o.concat(part, 2);
                }
            }
            out = Some(o);
        }
        blocks::unpatchify(out.expect("at least one latent frame"), self.cfg.patch)
    }

    /// Frames `[W, H, T, C]` in [-1, 1] → latent mean `[W/s, H/s, 1 + (T-1)/4, z]`, one graph
    /// computation per chunk (the first frame, then 4 at a time), the feature cache kept on
    /// the host in between. Frames after the last whole group of 4 are not encoded.
    pub fn encode_frames(&self, runner: &mut Runner, x: &Tensor) -> Result<Tensor> {
        let (enc, _) = self.encoder()?;
        let t = x.ne(2);
        ensure!(t >= 1, "vae encode: no frames");
        if t > 1 && self.cfg.is_2d {
            sd_warn!("Using 2D VAE to encode video, expect poor results");
        }
        let chunks = 1 + (t - 1) / TIME_SCALE;
        // The encoder's latent is sampled further: ggml's convolution sums (see
        // `graph::context::winograd_wanted`; only the 2-D variant has convolutions it takes).
        let winograd = runner.options.encoder_winograd();
        let mut cache = Vec::new();
        let mut out = Vec::with_capacity(chunks);
        let mut run = || -> Result<()> {
            for i in 0..chunks {
                let piece = take_frames(x, self.encode_chunk_frames(i))?;
                let keep = i + 1 < chunks;
                out.push(run_cached(runner, &mut cache, enc.slots, keep, |g, fc| self.encode_piece(g, g.input(&piece), fc, i))?);
            }
            Ok(())
        };
        let done = run();
        runner.options.cpu_winograd = winograd;
        done?;
        cat_frames(&out)
    }

    /// Latent `[w, h, T, z]` → frames `[s·w, s·h, 1 + 4(T-1), C]` in about [-1, 1]
    /// (unclamped), one graph computation per latent frame with the feature cache kept on the
    /// host in between; with `temporal_tiling`, one per output frame after each time
    /// upsampler. The values are [`WanVae::decode_graph`]'s either way. `progress` is told
    /// about each latent frame.
    pub fn decode_frames(&self, runner: &mut Runner, z: &Tensor, temporal_tiling: bool, mut progress: Progress<'_>) -> Result<Tensor> {
        let t = z.ne(2);
        ensure!(t >= 1, "vae decode: no latent frames");
        if t > 1 && self.cfg.is_2d {
            sd_warn!("Using 2D VAE to decode video, expect poor results");
        }
        let n = self.decoder.slots;
        let all = self.decoder.all();
        let parts = self.decoder.parts_by_frame_rate();
        let mut cache = Vec::new();
        let mut out: Vec<Tensor> = Vec::with_capacity(t);
        for i in 0..t {
            let start = std::time::Instant::now();
            let last = i + 1 == t;
            let latent = take_frames(z, i..i + 1)?;
            let frames = if temporal_tiling && i > 0 && parts.len() > 1 {
                // Every part runs on one frame at a time: the frames a time upsampler made
                // go on separately, each continuing from the one before through the cache.
                let mut pieces = vec![latent];
                for part in &parts {
                    let inputs: Vec<Tensor> = pieces.iter().map(split_frames).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
                    let count = inputs.len();
                    pieces = Vec::with_capacity(count);
                    for (j, frame) in inputs.iter().enumerate() {
                        let keep = !(last && j + 1 == count);
                        pieces.push(run_cached(runner, &mut cache, n, keep, |g, fc| Ok(self.decode_piece(g, g.input(frame), fc, i, part)))?);
                    }
                }
                cat_frames(&pieces)?
            } else {
                run_cached(runner, &mut cache, n, !last, |g, fc| Ok(self.decode_piece(g, g.input(&latent), fc, i, &all)))?
            };
            let repeats = if i > 0 && self.cfg.is_2d { TIME_SCALE } else { 1 };
            out.extend(std::iter::repeat_n(frames, repeats));
            if let Some(p) = progress.as_mut() {
                p(i as i32 + 1, t as i32, start.elapsed().as_secs_f32());
            }
        }
        cat_frames(&out)
    }
}


/// Runs `f` on each batch item of `x` `[W, H, C, N]` as one frame `[W, H, 1, C]` and puts
/// the outputs (`[W', H', 1, C']`) back as `[W', H', C', N]`.
pub(super) fn per_item(x: &Tensor, mut f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (w, h, c, n) = (x.ne(0), x.ne(1), x.ne(2), x.ne(3));
    let item = w * h * c;
    let mut out: Vec<f32> = Vec::new();
    let mut shape = [0usize; 4];
    for b in 0..n {
        let frame = Tensor::from_vec(&[w, h, 1, c], x.data()[b * item..(b + 1) * item].to_vec())?;
        let y = f(&frame)?;
        shape = [y.ne(0), y.ne(1), y.ne(3), n];
        out.extend_from_slice(y.data());
    }
    Tensor::from_vec(&shape, out)
}

/// A video `[W, H, T, C]` or `[W, H, T, C, 1]` with `channels` channels and sides of at
/// least `min_side` (multiples of `multiple`).
pub(super) fn check_video(t: &Tensor, channels: i64, min_side: usize, multiple: usize, what: &str) -> Result<()> {
    let shape = t.shape();
    ensure!(
        (4..=5).contains(&shape.len()) && shape[4..].iter().all(|&d| d == 1),
        "{what}: expected a video [W, H, T, C, 1], got shape {shape:?}"
    );
    let (w, h, frames, c) = (t.ne(0), t.ne(1), t.ne(2), t.ne(3));
    ensure!(c as i64 == channels, "{what}: expected {channels} channels, got {c}");
    ensure!((min_side..=MAX_SIDE).contains(&w) && (min_side..=MAX_SIDE).contains(&h), "{what}: unsupported size {w}x{h}");
    ensure!((1..=MAX_FRAMES).contains(&frames), "{what}: unsupported frame count {frames}");
    ensure!(t.ne(0) % multiple == 0 && t.ne(1) % multiple == 0, "{what}: sides must be multiples of {multiple}, got {}x{}", t.ne(0), t.ne(1));
    Ok(())
}

impl WanVae {
    /// Side multiple the encoder needs (Wan2.2's shortcuts fold 2×2 blocks at each level).
    fn encode_multiple(&self) -> usize {
        if self.cfg.residual_levels {
            self.cfg.scale()
        } else {
            1
        }
    }

    fn mean_std(&self) -> (&'static [f32], &'static [f32]) {
        if self.cfg.z_dim == 48 {
            (&WAN22_LATENT_MEAN, &WAN22_LATENT_STD)
        } else {
            (&WAN21_LATENT_MEAN, &WAN21_LATENT_STD)
        }
    }
}

impl VaeNet for WanVae {
    fn name(&self) -> &'static str {
        if self.cfg.residual_levels {
            "Wan2.2 VAE"
        } else {
            "Wan VAE"
        }
    }

    fn scale(&self) -> usize {
        self.cfg.scale()
    }

    fn time_scale(&self) -> usize {
        TIME_SCALE
    }

    fn encoder_output_channels(&self) -> i64 {
        self.cfg.z_dim
    }

    /// Image `[W, H, C, N]` in [-1, 1] → latent mean `[W/s, H/s, z, N]`.
    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        super::autoencoder_kl::check_input(image, self.cfg.in_channels, self.scale(), "vae encode")?;
        let m = self.encode_multiple();
        ensure!(image.ne(0) % m == 0 && image.ne(1) % m == 0, "vae encode: the {} needs sides that are multiples of {m}, got {}x{}", self.name(), image.ne(0), image.ne(1));
        per_item(image, |frame| self.encode_frames(runner, frame))
    }

    /// VAE-space latent `[w, h, z, N]` → image `[s·w, s·h, C, N]`, unclamped.
    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        super::autoencoder_kl::check_input(latent, self.cfg.z_dim, 1, "vae decode")?;
        per_item(latent, |frame| self.decode_frames(runner, frame, false, None))
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        let (mean, std) = self.mean_std();
        per_channel(z, mean.len(), |v, c| ((v - mean[c]) * SCALE_FACTOR) / std[c])
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        let (mean, std) = self.mean_std();
        per_channel(z, mean.len(), |v, c| (v * std[c]) / SCALE_FACTOR + mean[c])
    }

    fn supports_video(&self) -> bool {
        true
    }

    fn supports_temporal_tiling(&self) -> bool {
        !self.cfg.is_2d
    }

    fn encode_video(&self, runner: &mut Runner, frames: &Tensor) -> Result<Tensor> {
        check_video(frames, self.cfg.in_channels, self.scale(), self.encode_multiple(), "vae encode")?;
        self.encode_frames(runner, frames)
    }

    fn decode_video(&self, runner: &mut Runner, latents: &Tensor, temporal: Option<TemporalTiles>, progress: Progress<'_>) -> Result<Tensor> {
        check_video(latents, self.cfg.z_dim, 1, 1, "vae decode")?;
        self.decode_frames(runner, latents, temporal.is_some(), progress)
    }
}

/// Names of every weight the Wan VAE declares, for tests.
#[cfg(test)]
pub(crate) fn declared_names(cfg: &WanVaeConfig) -> Vec<String> {
    let mut store = crate::graph::ParamStore::new(4096).expect("store");
    let types = crate::graph::TypeMap::new();
    WanVae::new(&mut Scope::new(&mut store, &types, super::autoencoder_kl::PREFIX), cfg, &|_| None);
    store.entries().map(|e| e.0.to_string()).collect()
}

#[cfg(test)]
pub(crate) mod tests;
