//! LTX-2.3's video VAE, like the reference's `ltx_vae.hpp` (decoder only here).
//!
//! - Latents: 128 channels at 1/32 of the pixels, one latent frame per 8 frames after the
//!   first; the decoder un-normalises them with the file's per-channel statistics
//!   (`per_channel_statistics.{std,mean}-of-means`) and the diffusion latents are the VAE's.
//! - Decoder (`decoder.`), its levels read from the weights like the reference: `conv_in`,
//!   then `up_blocks.N` that are either residual blocks (`res_blocks.M`: pixel norm, SiLU,
//!   3×3×3 convolution, twice) or depth-to-space upsamplers (a convolution to 8, 4 or 2 times
//!   the channels it keeps, rearranged into 2× time and/or space; the first new frame is
//!   dropped when time doubles), a pixel norm, SiLU, `conv_out` to 4×4 RGB patches. Its
//!   convolutions pad in time with copies of the first and last frames.
//! - Temporal tiling (`temporal_tiling`, tile size from `extra_tiling_args`): the latent
//!   frames are decoded a tile at a time, each convolution continuing from the frame before
//!   the tile that the previous tile left it; tiles overlap, the overlap's frames decoded by
//!   the earlier tile are dropped (their right padding was the tile's edge), as the
//!   reference's streaming temporal decode.
//! - Encoder (`encoder.rs`, when the file has one): pictures and videos (cropped to 8k + 1
//!   frames) → the normalised latent means, for LTX-2.3's start and end pictures.
//! - Timestep conditioning (`decoder.timestep_scale_multiplier`, as in LTX-2's VAE): the
//!   decode timestep 0.05 times the file's multiplier is embedded per residual level
//!   (`time_embedder`, four rows added to each block's `scale_shift_table`: shift and scale
//!   after each norm) and for the output (`last_time_embedder`, `last_scale_shift_table`).

mod encoder;

use super::feat_cache::{f16_columns, run_cached, FeatCache, HostSlot};
use super::{cat_frames, Progress, VaeNet};
pub use encoder::{EncoderConfig, Level};
use crate::error::Result;
use crate::graph::nn::{self, Linear};
use crate::graph::{Graph, Runner, Scope, F16, F32, T, W};
use crate::runtime::tiling::TemporalTiles;
use crate::tensor::Tensor;

/// Where the VAE's weights live.
pub const PREFIX: &str = "first_stage_model.";
pub const CHANNELS: usize = 128;
pub const SCALE: usize = 32;
pub const TIME_SCALE: usize = 8;
const PATCH: i64 = 4;
const RES_EPS: f32 = 1e-6;
const OUT_EPS: f32 = 1e-8;
/// The timestep the reference decodes at (before the file's multiplier).
const DECODE_TIMESTEP: f32 = 0.05;

pub type ShapeOf<'a> = &'a dyn Fn(&str) -> Option<Vec<i64>>;

/// A 3×3×3 convolution that pads its input in time with copies of the edge frames.
#[derive(Clone, Copy, Debug)]
struct Conv {
    weight: W,
    bias: W,
    ic: i64,
}

impl Conv {
    fn new(s: &mut Scope, ic: i64, oc: i64) -> Conv {
        let mut c = s.sub("conv");
        Conv { weight: c.tensor("weight", F16, &[3, 3, 3, ic * oc]), bias: c.tensor("bias", F32, &[oc]), ic }
    }

    /// `x` `[W, H, T, C]`, non-causal: one copy of the last frame behind, and in front one
    /// of the first frame, or in a temporal tile after the first, the frame before the tile.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, tile: &mut Option<TileCache<'_, 'g>>) -> T<'g> {
        let [w, h, t, c] = x.ne();
        let nb = x.nb();
        let frame = |i: i64| x.view(&[w, h, 1, c], &[nb[1], nb[2], nb[3]], i as usize * nb[2]);
        let weight = g.param(self.weight);
        let front = match tile {
            Some(tc) => tc.exchange(weight, t, |i| frame(i).cont()).unwrap_or_else(|| frame(0)),
            None => frame(0),
        };
        let x = front.concat(x, 2).concat(frame(t - 1), 2);
        nn::conv_3d(g, x, weight, Some(g.param(self.bias)), self.ic, [1; 3], [1, 1, 0], [1; 3])
    }

    /// Causal (the encoder's): two copies of the first frame in front, nothing behind.
    fn causal<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = encoder::first_frames(x, 2).concat(x, 2);
        nn::conv_3d(g, x, g.param(self.weight), Some(g.param(self.bias)), self.ic, [1; 3], [1, 1, 0], [1; 3])
    }
}

/// One temporal tile's view of the feature cache: each convolution, in the order the graph
/// runs them, reads the frame the previous tile left in its slot and leaves the next tile the
/// frame before this tile's overlap.
struct TileCache<'c, 'g> {
    cache: &'c mut FeatCache<'g>,
    /// The next convolution's slot.
    at: usize,
    /// Frames at the end, at the current time resolution, that the next tile decodes again.
    overlap: i64,
}

impl<'g> TileCache<'_, 'g> {
    /// For the convolution at hand (weights `weight`), over `t` frames (`frame(i)` makes frame
    /// i): what the previous tile left it; it leaves the last frame before the overlap.
    fn exchange(&mut self, weight: T<'g>, t: i64, frame: impl Fn(i64) -> T<'g>) -> Option<T<'g>> {
        let slot = self.at;
        self.at += 1;
        let prev = self.cache.get(slot);
        let end = t - self.overlap;
        if end >= 1 {
            self.cache.set(slot, frame(end - 1), f16_columns(weight));
        }
        prev
    }
}

/// RMS norm over the channels of `[W, H, T, C]`.
fn pixel_norm<'g>(x: T<'g>, eps: f32) -> T<'g> {
    x.permute_axes([3, 0, 1, 2]).cont().rms_norm(eps).permute_axes([1, 2, 3, 0]).cont()
}

/// A timestep embedder (`timestep_embedder.linear_1/2`): sinusoidal features of 256, two
/// linears with SiLU between.
#[derive(Clone, Copy, Debug)]
struct TimeEmbedder {
    linear_1: Linear,
    linear_2: Linear,
}

impl TimeEmbedder {
    fn new(s: &mut Scope, dim: i64) -> TimeEmbedder {
        let mut t = s.sub("timestep_embedder");
        TimeEmbedder { linear_1: Linear::with_options(&mut t, "linear_1", 256, dim, true, true), linear_2: Linear::with_options(&mut t, "linear_2", dim, dim, true, true) }
    }

    fn forward<'g>(&self, g: &'g Graph, t: T<'g>) -> T<'g> {
        self.linear_2.forward(g, self.linear_1.forward(g, t.timestep_embedding(256, 10000)).silu_inplace())
    }
}

/// Rows of `table` `[C, rows]` plus the embedding `[C · rows]`, each as `[1, 1, 1, C]`.
fn table_rows<'g>(g: &'g Graph, table: W, emb: T<'g>, channels: i64, rows: i64) -> Vec<T<'g>> {
    let sum = g.param(table).add(emb.reshape(&[channels, rows]));
    let nb = sum.nb();
    (0..rows).map(|r| sum.view(&[channels, 1], &[nb[1]], r as usize * nb[1]).cont().reshape(&[1, 1, 1, channels])).collect()
}

/// `x + x·scale + shift` over the channels of `[W, H, T, C]`.
fn scale_shift<'g>(x: T<'g>, scale: T<'g>, shift: T<'g>) -> T<'g> {
    x.add(x.mul(scale)).add(shift)
}

#[derive(Clone, Copy, Debug)]
struct ResBlock {
    conv1: Conv,
    conv2: Conv,
    /// The timestep-conditioned decoder's `scale_shift_table` `[C, 4]`.
    table: Option<W>,
}

impl ResBlock {
    fn new(s: &mut Scope, channels: i64) -> ResBlock {
        ResBlock { conv1: Conv::new(&mut s.sub("conv1"), channels, channels), conv2: Conv::new(&mut s.sub("conv2"), channels, channels), table: None }
    }

    /// A decoder block; with `timed`, its table for the level's timestep embedding.
    fn decoder(s: &mut Scope, channels: i64, timed: bool) -> ResBlock {
        let table = timed.then(|| s.tensor("scale_shift_table", F32, &[channels, 4]));
        ResBlock { table, ..ResBlock::new(s, channels) }
    }

    /// The non-causal decoder block; `emb` the level's timestep embedding `[4C]` when the
    /// decoder is timestep-conditioned.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, emb: Option<T<'g>>, tile: &mut Option<TileCache<'_, 'g>>) -> T<'g> {
        let mods = match (self.table, emb) {
            (Some(table), Some(emb)) => Some(table_rows(g, table, emb, x.ne()[3], 4)),
            _ => None,
        };
        let norm = |h: T<'g>, i: usize| match &mods {
            Some(m) => scale_shift(pixel_norm(h, RES_EPS), m[2 * i + 1], m[2 * i]),
            None => pixel_norm(h, RES_EPS),
        };
        let h = self.conv1.forward(g, norm(x, 0).silu_inplace(), tile);
        let h = self.conv2.forward(g, norm(h, 1).silu_inplace(), tile);
        h.add(x)
    }

    fn forward_causal<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.conv1.causal(g, pixel_norm(x, RES_EPS).silu_inplace());
        let h = self.conv2.causal(g, pixel_norm(h, RES_EPS).silu_inplace());
        h.add(x)
    }
}

/// `"b (c p1 p2 p3) d h w -> b c (d p1) (h p2) (w p3)"` on `[W, H, T, c·ft·fs·fs]`, the first
/// frame dropped when time doubles (`drop_first`: at the start of the video).
pub(crate) fn depth_to_space<'g>(x: T<'g>, c: i64, ft: i64, fs: i64, drop_first: bool) -> T<'g> {
    let [w, h, t, _] = x.ne();
    let x = x.permute_axes([0, 1, 3, 2]).cont().reshape(&[w, h, fs, fs * ft * c * t]);
    let x = x.permute_axes([2, 0, 1, 3]).cont().reshape(&[fs * w, h, fs, ft * c * t]);
    let x = x.permute_axes([0, 2, 1, 3]).cont().reshape(&[fs * w * fs * h, ft, c, t]);
    let x = x.permute_axes([0, 1, 3, 2]).cont().reshape(&[fs * w, fs * h, ft * t, c]);
    if ft > 1 && drop_first {
        let [w2, h2, t2, c2] = x.ne();
        let nb = x.nb();
        return x.view(&[w2, h2, t2 - 1, c2], &[nb[1], nb[2], nb[3]], nb[2]).cont();
    }
    x
}

/// 4×4 RGB patches `[W, H, T, 3·16]` → pixels `[4W, 4H, T, 3]`.
fn unpatchify<'g>(x: T<'g>) -> T<'g> {
    let [w, h, f, ch] = x.ne();
    let (q, r) = (PATCH, PATCH);
    let c = ch / (q * r);
    let x = x.reshape(&[w * h, f, q * r, c]).permute_axes([0, 2, 1, 3]).cont();
    let x = x.reshape(&[w, h * q, r, f * c]).permute_axes([2, 0, 1, 3]).cont();
    let x = x.reshape(&[r * w, h, q, f * c]).permute_axes([0, 2, 1, 3]).cont();
    x.reshape(&[r * w, q * h, f, c])
}

#[derive(Clone, Debug)]
enum Up {
    /// Residual blocks, with the level's time embedder when timestep-conditioned.
    Res(Vec<ResBlock>, Option<TimeEmbedder>),
    /// The convolution, the channels kept and the time and space factors.
    DepthToSpace { conv: Conv, channels: i64, ft: i64, fs: i64 },
}

/// One level of an encoder's or decoder's `{blocks}.N.` as the weights describe it.
enum LevelWeights {
    /// Residual blocks: their count and width.
    Res { layers: usize, width: i64 },
    /// A resampler: its convolution's outputs and the width of the next residual level (0
    /// when none follows before the end).
    Resample { conv: i64, next: i64 },
}

/// The levels under `blocks` (e.g. `first_stage_model.decoder.up_blocks`), read as the
/// reference reads them.
fn level_weights(shape_of: ShapeOf, blocks: &str) -> Vec<LevelWeights> {
    let bias = |i: usize, rest: &str| shape_of(&format!("{blocks}.{i}.{rest}")).map(|s| s[0]);
    let res = |i: usize, m: usize| bias(i, &format!("res_blocks.{m}.conv1.conv.bias"));
    let mut out = Vec::new();
    for i in 0.. {
        if let Some(width) = res(i, 0) {
            out.push(LevelWeights::Res { layers: (0..).take_while(|&m| res(i, m).is_some()).count(), width });
            continue;
        }
        let Some(conv) = bias(i, "conv.conv.bias") else { break };
        let next = (i + 1..).map_while(|j| res(j, 0).map(Ok).or_else(|| bias(j, "conv.conv.bias").map(|_| Err(())))).find_map(|r| r.ok()).unwrap_or(0);
        out.push(LevelWeights::Resample { conv, next });
    }
    out
}

/// The decoder's levels as the reference reads them from the weights.
fn levels(shape_of: ShapeOf, prefix: &str, conv_in: i64) -> Result<Vec<(String, i64, i64, i64)>> {
    // (kind, layers or kept channels, ft, fs)
    let up = |i: usize| format!("{prefix}decoder.up_blocks.{i}.");
    let mut out = Vec::new();
    let mut channels = conv_in;
    for (i, level) in level_weights(shape_of, &format!("{prefix}decoder.up_blocks")).into_iter().enumerate() {
        let (conv_out, mut next) = match level {
            LevelWeights::Res { layers, width } => {
                out.push(("res".to_string(), layers as i64, 0, 0));
                channels = width;
                continue;
            }
            LevelWeights::Resample { conv, next } => (conv, next),
        };
        if next <= 0 || channels % next != 0 {
            next = (channels / 2).max(1);
        }
        let (ft, fs) = match conv_out / next {
            4 => (1, 2),
            2 => (2, 1),
            8 => (2, 2),
            f => {
                sd_warn!("unexpected LTX VAE upsample factor at '{}': conv_out={conv_out} current={channels} next={next}, falling back to 2x2x2", up(i));
                let _ = f;
                (2, 2)
            }
        };
        let reduction = (channels / next).max(1);
        ensure!(channels % reduction == 0, "LTX VAE: up block {i} reduces {channels} channels by {reduction}");
        out.push(("d2s".to_string(), channels / reduction, ft, fs));
        channels /= reduction;
    }
    Ok(out)
}

/// The decoder's sizes read from the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LtxVaeConfig {
    conv_in: i64,
    levels: Vec<(String, i64, i64, i64)>,
    /// The decoder is timestep-conditioned (`decoder.timestep_scale_multiplier`).
    pub timestep: bool,
    /// `None`: the file has no encoder (decode only).
    pub encoder: Option<EncoderConfig>,
}

impl LtxVaeConfig {
    /// The decoder (and encoder) under `prefix` (full names through `shape_of`).
    pub fn detect(shape_of: ShapeOf, prefix: &str) -> Result<LtxVaeConfig> {
        let timestep = shape_of(&format!("{prefix}decoder.timestep_scale_multiplier")).is_some();
        let conv_in = shape_of(&format!("{prefix}decoder.conv_in.conv.bias")).map_or(128, |s| s[0]);
        Ok(LtxVaeConfig { conv_in, levels: levels(shape_of, prefix, conv_in)?, timestep, encoder: EncoderConfig::detect(shape_of, prefix) })
    }
}

pub struct LtxVae {
    std: W,
    mean: W,
    conv_in: Conv,
    ups: Vec<Up>,
    conv_out: Conv,
    encoder: Option<encoder::Encoder>,
    /// Timestep conditioning: the multiplier `[1]`, the output's embedder and table `[C, 2]`.
    timestep: Option<(W, TimeEmbedder, W)>,
}

impl LtxVae {
    /// The decoder under `s` (`PREFIX`).
    pub fn new(s: &mut Scope, cfg: &LtxVaeConfig) -> LtxVae {
        let mut stats = s.sub("per_channel_statistics");
        let std = stats.tensor("std-of-means", F32, &[CHANNELS as i64]);
        let mean = stats.tensor("mean-of-means", F32, &[CHANNELS as i64]);
        let mut d = s.sub("decoder");
        let conv_in = Conv::new(&mut d.sub("conv_in"), CHANNELS as i64, cfg.conv_in);
        let mut channels = cfg.conv_in;
        let mut ups = Vec::new();
        for (i, (kind, n, ft, fs)) in cfg.levels.iter().cloned().enumerate() {
            let mut b = d.sub(&format!("up_blocks.{i}"));
            if kind == "res" {
                let blocks = (0..n).map(|m| ResBlock::decoder(&mut b.sub(&format!("res_blocks.{m}")), channels, cfg.timestep)).collect();
                let embedder = cfg.timestep.then(|| TimeEmbedder::new(&mut b.sub("time_embedder"), 4 * channels));
                ups.push(Up::Res(blocks, embedder));
            } else {
                let conv = Conv::new(&mut b.sub("conv"), channels, n * ft * fs * fs);
                ups.push(Up::DepthToSpace { conv, channels: n, ft, fs });
                channels = n;
            }
        }
        let conv_out = Conv::new(&mut d.sub("conv_out"), channels, 3 * PATCH * PATCH);
        let timestep = cfg.timestep.then(|| {
            let multiplier = d.tensor("timestep_scale_multiplier", F32, &[1]);
            let embedder = TimeEmbedder::new(&mut d.sub("last_time_embedder"), 2 * channels);
            (multiplier, embedder, d.tensor("last_scale_shift_table", F32, &[channels, 2]))
        });
        let encoder = cfg.encoder.as_ref().map(|e| encoder::Encoder::new(&mut s.sub("encoder"), e));
        LtxVae { std, mean, conv_in, ups, conv_out, encoder, timestep }
    }

    /// VAE-space latent `[w, h, t, 128]` → frames `[32w, 32h, 8(t-1)+1, 3]` in [-1, 1]; in a
    /// temporal tile (`tile`), frames `[32w, 32h, 8t (-7 for the first tile) - 8·overlap, 3]`.
    fn graph<'g>(&self, g: &'g Graph, z: T<'g>, tile: &mut Option<TileCache<'_, 'g>>, first: bool) -> T<'g> {
        let c = CHANNELS as i64;
        let x = z.mul(g.param(self.std).reshape(&[1, 1, 1, c])).add(g.param(self.mean).reshape(&[1, 1, 1, c]));
        let mut x = self.conv_in.forward(g, x, tile);
        let t = self.timestep.map(|(multiplier, _, _)| g.input_f32(&[DECODE_TIMESTEP], &[1]).mul(g.param(multiplier)));
        for up in &self.ups {
            x = match up {
                Up::Res(blocks, embedder) => {
                    let emb = embedder.zip(t).map(|(e, t)| e.forward(g, t));
                    blocks.iter().fold(x, |x, b| b.forward(g, x, emb, tile))
                }
                Up::DepthToSpace { conv, channels, ft, fs } => {
                    let y = depth_to_space(conv.forward(g, x, tile), *channels, *ft, *fs, first);
                    if let Some(tc) = tile.as_mut() {
                        tc.overlap *= ft;
                    }
                    y
                }
            };
        }
        let mut x = pixel_norm(x, OUT_EPS);
        if let (Some((_, embedder, table)), Some(t)) = (self.timestep, t) {
            let m = table_rows(g, table, embedder.forward(g, t), x.ne()[3], 2);
            x = scale_shift(x, m[1], m[0]);
        }
        let mut x = self.conv_out.forward(g, x.silu_inplace(), tile);
        if let Some(overlap) = tile.as_ref().map(|tc| tc.overlap).filter(|&o| o > 0) {
            let [w, h, t, c] = x.ne();
            let nb = x.nb();
            x = x.view(&[w, h, t - overlap, c], &[nb[1], nb[2], nb[3]], 0).cont();
        }
        unpatchify(x)
    }

    /// The decoder's convolutions (one feature-cache slot each in temporal tiles).
    fn convolutions(&self) -> usize {
        let ups: usize = self.ups.iter().map(|up| if let Up::Res(blocks, _) = up { 2 * blocks.len() } else { 1 }).sum();
        2 + ups
    }

    /// Decodes `z` `[w, h, T, 128]` a temporal tile at a time (the reference's plan: tiles
    /// of `frames` latent frames, `overlap` of them shared with the next; an overlap as large
    /// as the tile or the video is cut down with a warning).
    fn run_tiled(&self, runner: &mut Runner, z: &Tensor, tiles: TemporalTiles) -> Result<Tensor> {
        let total = z.ne(2) as i64;
        let frames = tiles.frames.max(1) as i64;
        let mut overlap = tiles.overlap.max(0) as i64;
        if overlap >= frames {
            sd_warn!("temporal_tile_overlap ({overlap}) is greater than or equal to temporal_tile_frames ({frames}), adjusting values to avoid empty decode windows");
            overlap = frames - 1;
        }
        if overlap >= total {
            sd_warn!("temporal_tile_overlap ({overlap}) is greater than or equal to total latent frames ({total}), adjusting values to decode at least one tile");
            overlap = total - 1;
        }
        let stride = (frames - overlap).max(1);
        let count = ((total - overlap).max(1) + stride - 1) / stride;
        sd_debug!("Using streaming temporal tiling: temporal_tile_frames={frames}, temporal_tile_overlap={overlap}, total latent frames={total}, resulting in {count} tiles");
        let (w, h) = (z.ne(0), z.ne(1));
        let plane = w * h;
        let channel = |ch: usize| &z.data()[ch * plane * total as usize..(ch + 1) * plane * total as usize];
        let slots = self.convolutions();
        let mut cache: Vec<Option<HostSlot>> = Vec::new();
        let mut outs = Vec::new();
        let mut start = 0;
        while start < total - overlap {
            let end = total.min(start + frames);
            let tile_overlap = if end < total { overlap } else { 0 };
            sd_debug!("LTX VAE temporal tile {}/{count}: latent frames [{start}, {end}), overlap={tile_overlap}", start / stride + 1);
            let (s, e) = (start as usize * plane, end as usize * plane);
            let chunk: Vec<f32> = (0..CHANNELS).flat_map(|ch| channel(ch)[s..e].iter().copied()).collect();
            let ne = [w as i64, h as i64, end - start, CHANNELS as i64];
            outs.push(run_cached(runner, &mut cache, slots, end < total, |g, fc| {
                let mut tile = Some(TileCache { cache: fc, at: 0, overlap: tile_overlap });
                Ok(self.graph(g, g.input_f32(&chunk, &ne), &mut tile, start == 0))
            })?);
            start += stride;
        }
        cat_frames(&outs)
    }

    /// Video `[W, H, T, 3, ..]` in [-1, 1] → normalised latent means `[W/s, H/s, t, 128]`; the
    /// frames are cropped to 8k + 1 first, as the reference does.
    fn run_encoder(&self, runner: &mut Runner, video: &Tensor) -> Result<Tensor> {
        let Some(enc) = &self.encoder else { bail!("LTX video VAE encode requires encoder weights (this file has no encoder.*)") };
        let (w, h, t) = (video.ne(0), video.ne(1), video.ne(2));
        ensure!(video.shape().len() >= 4 && video.ne(3) == 3, "LTX VAE encode takes RGB frames [W, H, T, 3], got {:?}", video.shape());
        let kept = 1 + (t.max(1) - 1) / TIME_SCALE * TIME_SCALE;
        let plane = w * h;
        let pixels: Vec<f32> = (0..3).flat_map(|c| video.data()[c * t * plane..(c * t + kept) * plane].iter().copied()).collect();
        let patches = encoder::patchify(&pixels, w, h, kept)?;
        let p = PATCH as usize;
        let ne = [(w / p) as i64, (h / p) as i64, kept as i64, 3 * PATCH * PATCH];
        let c = CHANNELS as i64;
        // The reference's sums (no Winograd): the encoded pictures condition every step after,
        // frames and sound, where rounding differences would spread.
        let winograd = runner.options.encoder_winograd();
        let out = runner.compute(|g| {
            let means = enc.graph(g, g.input_f32(&patches, &ne));
            Ok(means.sub(g.param(self.mean).reshape(&[1, 1, 1, c])).div(g.param(self.std).reshape(&[1, 1, 1, c])))
        });
        runner.options.cpu_winograd = winograd;
        out
    }

    fn run(&self, runner: &mut Runner, z: &Tensor) -> Result<Tensor> {
        ensure!(z.shape().len() >= 4 && z.ne(3) == CHANNELS, "vae decode: the LTX VAE takes {CHANNELS} latent channels, got {:?}", z.shape());
        let shape = [z.ne(0), z.ne(1), z.ne(2), CHANNELS];
        let data = &z.data()[..shape.iter().product::<usize>()];
        runner.compute(|g| {
            let x = g.input_f32(data, &shape.map(|d| d as i64));
            Ok(self.graph(g, x, &mut None, true))
        })
    }
}

impl VaeNet for LtxVae {
    fn name(&self) -> &'static str {
        "LTX VAE"
    }

    fn scale(&self) -> usize {
        SCALE
    }

    fn time_scale(&self) -> usize {
        TIME_SCALE
    }

    /// The encoder's output is already the latent (the normalised means).
    fn encoder_output_channels(&self) -> i64 {
        CHANNELS as i64
    }

    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        let (w, h, c, n) = (image.ne(0), image.ne(1), image.ne(2), image.ne(3));
        ensure!(n == 1 && c == 3, "LTX VAE encode takes one RGB picture, got {:?}", image.shape());
        let out = self.run_encoder(runner, &Tensor::from_vec(&[w, h, 1, 3], image.data().to_vec())?)?;
        Tensor::from_vec(&[out.ne(0), out.ne(1), CHANNELS, 1], out.data().to_vec())
    }

    fn encode_video(&self, runner: &mut Runner, frames: &Tensor) -> Result<Tensor> {
        self.run_encoder(runner, frames)
    }

    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        let (w, h, c, n) = (latent.ne(0), latent.ne(1), latent.ne(2), latent.ne(3));
        ensure!(n == 1, "vae decode: the LTX VAE decodes one picture at a time, got {n}");
        let one = Tensor::from_vec(&[w, h, 1, c], latent.data().to_vec())?;
        let out = self.run(runner, &one)?;
        Tensor::from_vec(&[out.ne(0), out.ne(1), 3, 1], out.data().to_vec())
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        z.clone()
    }

    /// The video's channels of a packed latent (the audio's dropped).
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        super::video_channels(z, CHANNELS)
    }

    fn supports_video(&self) -> bool {
        true
    }

    fn supports_temporal_tiling(&self) -> bool {
        true
    }

    fn decode_video(&self, runner: &mut Runner, latents: &Tensor, temporal: Option<TemporalTiles>, _progress: Progress<'_>) -> Result<Tensor> {
        match temporal {
            Some(tiles) if latents.shape().len() == 5 && latents.ne(2) > 1 => {
                ensure!(latents.ne(3) == CHANNELS, "vae decode: the LTX VAE takes {CHANNELS} latent channels, got {:?}", latents.shape());
                self.run_tiled(runner, latents, tiles)
            }
            _ => self.run(runner, latents),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Backend;
    use std::sync::Arc;

    fn runner() -> Runner {
        Runner::new(Arc::new(Backend::cpu().unwrap()), 1)
    }

    /// Channel (c, p1, p2, p3) of input cell (d, h, w) lands on frame d·2 + p1 (less the dropped
    /// first), row h·2 + p2, column w·2 + p3 of output channel c.
    #[test]
    fn depth_to_space_moves_channels_into_time_and_space() {
        let (w, h, t, c) = (3usize, 2usize, 2usize, 2usize);
        let n = w * h * t * c * 8;
        let data: Vec<f32> = (0..n).map(|v| v as f32).collect();
        let out = runner().compute(|g| Ok(depth_to_space(g.input_f32(&data, &[w as i64, h as i64, t as i64, (c * 8) as i64]), c as i64, 2, 2, true))).unwrap();
        assert_eq!(out.shape(), &[2 * w, 2 * h, 2 * t - 1, c]);
        let at = |x: usize, y: usize, f: usize, ch: usize| out.data()[((ch * (2 * t - 1) + f) * 2 * h + y) * 2 * w + x];
        let input = |x: usize, y: usize, f: usize, ch: usize| data[((ch * t + f) * h + y) * w + x];
        for ch in 0..c {
            for (p1, p2, p3) in [(0, 0, 0), (1, 0, 1), (1, 1, 0), (0, 1, 1)] {
                let src_ch = ((ch * 2 + p1) * 2 + p2) * 2 + p3;
                for (x, y, d) in [(0, 0, 1), (2, 1, 1), (1, 0, 0)] {
                    let f = d * 2 + p1;
                    if f == 0 {
                        continue;
                    }
                    assert_eq!(at(x * 2 + p3, y * 2 + p2, f - 1, ch), input(x, y, d, src_ch), "c{ch} p{p1}{p2}{p3} at {x},{y},{d}");
                }
            }
        }
    }

    /// Patch channel (c, r, q) (q fastest) of cell (x, y) is pixel (4x + r, 4y + q) of colour c.
    #[test]
    fn patches_become_pixels() {
        let (w, h) = (2usize, 3usize);
        let data: Vec<f32> = (0..w * h * 48).map(|v| v as f32).collect();
        let out = runner().compute(|g| Ok(unpatchify(g.input_f32(&data, &[w as i64, h as i64, 1, 48])))).unwrap();
        assert_eq!(out.shape(), &[4 * w, 4 * h, 1, 3]);
        let (x, y, c, q, r) = (1, 2, 2, 3, 1);
        let ch = (c * 4 + r) * 4 + q;
        assert_eq!(out.data()[(c * 4 * h + 4 * y + q) * 4 * w + 4 * x + r], data[(ch * h + y) * w + x]);
    }

    /// Host patches turned back into pixels by the decoder's rearrangement are the pixels.
    #[test]
    fn patchify_is_the_inverse_of_unpatchify() {
        let (w, h, t) = (8usize, 12usize, 2usize);
        let pixels: Vec<f32> = (0..w * h * t * 3).map(|v| v as f32).collect();
        let patches = encoder::patchify(&pixels, w, h, t).unwrap();
        let out = runner().compute(|g| Ok(unpatchify(g.input_f32(&patches, &[2, 3, t as i64, 48])))).unwrap();
        assert_eq!(out.shape(), &[w, h, t, 3]);
        assert_eq!(out.data(), &pixels[..]);
        assert!(encoder::patchify(&pixels[..10], 8, 12, 1).is_err());
        assert!(encoder::patchify(&pixels, 6, 16, 2).is_err());
    }

    /// The encoder's levels come from the weights as the reference reads them: the full
    /// encoder compresses as the decoder expands; the one-level file's lone downsampler has no
    /// next level to read its factor from and falls back to 2×2×2.
    #[test]
    fn encoder_levels_are_read_from_the_weights() {
        let (_s, vae, cfg) = crate::models::vae::testutil::load_ltx_vae("ltx_vae_i2v.safetensors");
        let enc = cfg.encoder.clone().expect("an encoder");
        let down = |ft, fs, multiplier| Level::Down { ft, fs, multiplier };
        assert_eq!(enc.levels, vec![Level::Res(1), down(1, 2, 2), Level::Res(1), down(2, 1, 2), Level::Res(1), down(2, 2, 1), Level::Res(1), down(2, 2, 1), Level::Res(1)]);
        assert_eq!(enc.scales(), (SCALE as i64, TIME_SCALE as i64));
        // 64×64, 10 frames (cropped to 9) → 2×2×2 latent cells of 128 finite values.
        let video = crate::models::vae::testutil::pattern(&[64, 64, 10, 3, 1], -1.0, 1.0, 5);
        let z = vae.encode_video(&mut runner(), &video).unwrap();
        assert_eq!(z.shape(), &[2, 2, 2, CHANNELS]);
        assert!(z.data().iter().all(|v| v.is_finite()));
        let (_s, small, cfg) = crate::models::vae::testutil::load_ltx_vae("ltx_vae.safetensors");
        assert_eq!(cfg.encoder.expect("an encoder").scales(), (8, 2));
        assert_eq!(small.encode_video(&mut runner(), &video).unwrap().shape(), &[8, 8, 5, CHANNELS]);
    }

    #[test]
    fn pixel_norm_normalises_each_cell_over_channels() {
        let data = [3.0f32, 0.0, 4.0, 0.0];
        let out = runner().compute(|g| Ok(pixel_norm(g.input_f32(&data, &[2, 1, 1, 2]), 1e-6))).unwrap();
        // Cell 0 holds (3, 4): rms 3.5355; cell 1 is zero.
        let r = (12.5f32).sqrt();
        assert!((out.data()[0] - 3.0 / r).abs() < 1e-5 && (out.data()[2] - 4.0 / r).abs() < 1e-5);
        assert_eq!((out.data()[1], out.data()[3]), (0.0, 0.0));
    }

    /// Temporal tiles: one tile covering the video is the plain decode, bit for bit, and so is
    /// the first tile without overlap on its own frames; tiles that overlap make as many
    /// frames (the overlap's first copies dropped, only the first tile losing its first frame
    /// to each time doubling); an overlap as large as the tile is cut down.
    #[test]
    fn temporal_tiles_make_the_plain_decodes_frames() {
        let (_store, vae, _) = crate::models::vae::testutil::load_ltx_vae("ltx_vae.safetensors");
        let mut runner = runner();
        let z = crate::models::vae::testutil::pattern(&[2, 2, 5, CHANNELS, 1], -2.0, 2.0, 3);
        let plain = vae.decode_video(&mut runner, &z, None, None).unwrap();
        assert_eq!(plain.shape(), &[64, 64, 33, 3]);
        let whole = vae.decode_video(&mut runner, &z, Some(TemporalTiles { frames: 8, overlap: 1 }), None).unwrap();
        assert_eq!(whole.data(), plain.data());
        for (frames, overlap) in [(4, 1), (2, 0), (3, 2), (2, 5)] {
            let tiled = vae.decode_video(&mut runner, &z, Some(TemporalTiles { frames, overlap }), None).unwrap();
            assert_eq!(tiled.shape(), plain.shape(), "tiles of {frames} overlapping by {overlap}");
            assert!(tiled.data().iter().all(|v| v.is_finite()));
            if (frames, overlap) == (2, 0) {
                let two: Vec<f32> = z.data().chunks_exact(4 * 5).flat_map(|ch| ch[..4 * 2].to_vec()).collect();
                let first = vae.decode_video(&mut runner, &Tensor::from_vec(&[2, 2, 2, CHANNELS, 1], two).unwrap(), None, None).unwrap();
                let plane = 64 * 64;
                for c in 0..3 {
                    assert_eq!(tiled.data()[c * 33 * plane..(c * 33 + 9) * plane], first.data()[c * 9 * plane..(c + 1) * 9 * plane]);
                }
            }
        }
    }
}
