//! HunyuanVideo 1.5's VAE, like the reference's `hunyuan_vae.hpp`: every size is fixed (32
//! latent channels, 1/16 in space, 1/4 in time, levels of 128-256-512-1024-1024 channels).
//!
//! - Causal 3-D convolutions (`<name>.conv`) pad in time with copies of the first frame (or
//!   the frames the previous chunk left) and replicate the border in space.
//! - Decoder (`decoder.`): `conv_in` plus the latent repeated over the channels, a mid block
//!   (resnet, single-head attention over every position, resnet), then one latent frame at a
//!   time (each continuing from the one before through its convolutions' last frames) five
//!   up blocks of three resnets with pixel-shuffle upsamplers (the first two also double the
//!   frames: a first chunk's first frame only in space), RMS norm, SiLU and `conv_out`.
//!   Each upsampler adds its input, repeated over channels and shuffled alike.
//! - Latents are the diffusion model's times 1.03682.
//!
//! - Encoder (`encoder.`): `conv_in`, five levels of two resnets with pixel-unshuffle
//!   downsamplers (the last two also halving the frames after the first), a mid block, RMS
//!   norm, SiLU and `conv_out` to the moments plus their channel-group means; the latent is
//!   the mean (no sampling).
//!
//! Without `encoder.conv_in.conv.weight` the VAE decodes only (the reference's rule).

use super::wan::blocks::{RmsNorm, ShapeOf};
use super::feat_cache::{f16_columns, run_cached, FeatCache};
use super::{cat_frames, take_frames, Progress, VaeNet};
use crate::error::Result;
use crate::graph::nn;
use crate::graph::{Graph, Runner, Scope, F16, F32, T, W};
use crate::runtime::tiling::TemporalTiles;
use crate::tensor::Tensor;

/// Where the VAE's weights live.
pub const PREFIX: &str = "first_stage_model.";
/// Latent channels.
pub const Z_CHANNELS: i64 = 32;
/// Channels per level, from the pixels in.
const DIMS: [i64; 5] = [128, 256, 512, 1024, 1024];
/// Resnets per decoder level.
const DECODER_RESNETS: usize = 3;
/// Resnets per encoder level.
const ENCODER_RESNETS: usize = 2;
/// Levels that double the sides (all but the last) and the frames (the first two, decoding).
const SPATIAL_LEVELS: usize = 4;
const TEMPORAL_LEVELS: usize = 2;
const SCALE: usize = 16;
const TIME_SCALE: usize = 4;
/// Diffusion latents are the VAE's times this.
const SCALING_FACTOR: f32 = 1.03682;

/// Frames `start..end` of `x` `[W, H, T, C]`, dense.
fn frames<'g>(x: T<'g>, start: i64, end: i64) -> T<'g> {
    slice(x, 2, start, end)
}

/// `x[start..end]` along `dim`, dense.
fn slice<'g>(x: T<'g>, dim: usize, start: i64, end: i64) -> T<'g> {
    let mut ne = x.ne();
    if start == 0 && end == ne[dim] {
        return x;
    }
    let nb = x.nb();
    ne[dim] = end - start;
    x.view(&ne, &[nb[1], nb[2], nb[3]], nb[dim] * start as usize).cont()
}

/// `x` with its first slice along `dim` repeated `n` times in front and its last `n` times
/// behind (replicate padding).
fn replicate_pad<'g>(x: T<'g>, dim: usize, n: i64) -> T<'g> {
    if n == 0 {
        return x;
    }
    let len = x.ne()[dim];
    let (first, last) = (slice(x, dim, 0, 1), slice(x, dim, len - 1, len));
    let mut y = x;
    for _ in 0..n {
        y = first.concat(y, dim as i32);
    }
    for _ in 0..n {
        y = y.concat(last, dim as i32);
    }
    y
}

/// One chunk's view of the feature cache: each causal convolution, in the order they run,
/// continues from its slot (the frames the previous chunk left) and leaves its last frames
/// there for the next.
struct Carry<'c, 'g> {
    cache: &'c mut FeatCache<'g>,
    next: usize,
    continuation: bool,
}

/// A causal 3-D convolution (kernel `k` all round, stride 1).
#[derive(Clone, Copy, Debug)]
struct CausalConv {
    weight: W,
    bias: W,
    in_ch: i64,
    k: i64,
}

impl CausalConv {
    fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, k: i64) -> CausalConv {
        let mut s = s.sub(&format!("{name}.conv"));
        CausalConv { weight: s.tensor("weight", F16, &[k, k, k, in_ch * out_ch]), bias: s.tensor("bias", F32, &[out_ch]), in_ch, k }
    }

    /// x `[W, H, T, IC]` → `[W, H, T, OC]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, carry: Option<&mut Carry<'_, 'g>>) -> T<'g> {
        let pad_t = self.k - 1;
        let weight = g.param(self.weight);
        let mut padded = x;
        if pad_t > 0 {
            let mut carry = carry;
            let mut front = carry.as_mut().and_then(|c| c.cache.get(c.next));
            let mut n = front.map_or(0, |f| f.ne()[2]);
            let first = frames(x, 0, 1);
            while n < pad_t {
                front = Some(front.map_or(first, |f| f.concat(first, 2)));
                n += 1;
            }
            let front = front.expect("time padding");
            if let Some(c) = carry {
                // The last pad_t frames of the front frames followed by x's.
                let tx = x.ne()[2];
                let tail = if tx >= pad_t {
                    frames(x, tx - pad_t, tx)
                } else {
                    let joined = front.concat(x, 2);
                    let t = joined.ne()[2];
                    frames(joined, t - pad_t, t)
                };
                c.cache.set(c.next, tail, f16_columns(weight));
                c.next += 1;
            }
            // Front frames and replicated borders read in place, without the padded copies.
            if self.k == 3 {
                if let Some(y) = nn::conv_3d_after_replicated(g, front, x, weight, Some(g.param(self.bias)), self.in_ch) {
                    return y;
                }
            }
            padded = front.concat(x, 2);
        }
        let padded = replicate_pad(replicate_pad(padded, 0, self.k / 2), 1, self.k / 2);
        nn::conv_3d(g, padded, weight, Some(g.param(self.bias)), self.in_ch, [1; 3], [0; 3], [1; 3])
    }
}

/// A 1×1×1 convolution (the attention's projections).
#[derive(Clone, Copy, Debug)]
struct PointConv {
    weight: W,
    bias: W,
    in_ch: i64,
}

impl PointConv {
    fn new(s: &mut Scope, name: &str, c: i64) -> PointConv {
        let mut s = s.sub(name);
        PointConv { weight: s.tensor("weight", F16, &[1, 1, 1, c * c]), bias: s.tensor("bias", F32, &[c]), in_ch: c }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        nn::conv_3d(g, x, g.param(self.weight), Some(g.param(self.bias)), self.in_ch, [1; 3], [0; 3], [1; 3])
    }
}

#[derive(Clone, Copy, Debug)]
struct Resnet {
    norm1: RmsNorm,
    conv1: CausalConv,
    norm2: RmsNorm,
    conv2: CausalConv,
    shortcut: Option<CausalConv>,
}

impl Resnet {
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64, shape_of: ShapeOf) -> Resnet {
        let mut s = s.sub(name);
        Resnet {
            norm1: RmsNorm::new(&mut s, "norm1", ic, shape_of),
            conv1: CausalConv::new(&mut s, "conv1", ic, oc, 3),
            norm2: RmsNorm::new(&mut s, "norm2", oc, shape_of),
            conv2: CausalConv::new(&mut s, "conv2", oc, oc, 3),
            shortcut: (ic != oc).then(|| CausalConv::new(&mut s, "nin_shortcut", ic, oc, 1)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, mut carry: Option<&mut Carry<'_, 'g>>) -> T<'g> {
        let h = self.norm1.forward(g, x).silu_inplace();
        let h = self.conv1.forward(g, h, carry.as_deref_mut());
        let h = self.norm2.forward(g, h).silu_inplace();
        let h = self.conv2.forward(g, h, carry);
        let x = match &self.shortcut {
            Some(s) => s.forward(g, x, None),
            None => x,
        };
        h.add(x)
    }
}

/// Single-head attention over every position of `[W, H, T, C]`.
#[derive(Clone, Copy, Debug)]
struct Attention {
    norm: RmsNorm,
    q: PointConv,
    k: PointConv,
    v: PointConv,
    proj_out: PointConv,
}

impl Attention {
    fn new(s: &mut Scope, name: &str, c: i64, shape_of: ShapeOf) -> Attention {
        let mut s = s.sub(name);
        Attention {
            norm: RmsNorm::new(&mut s, "norm", c, shape_of),
            q: PointConv::new(&mut s, "q", c),
            k: PointConv::new(&mut s, "k", c),
            v: PointConv::new(&mut s, "v", c),
            proj_out: PointConv::new(&mut s, "proj_out", c),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [w, h, t, c] = x.ne();
        let n = self.norm.forward(g, x);
        let tokens = |y: T<'g>| y.reshape(&[w * h * t, c, 1]).permute(1, 0, 2, 3).cont();
        let (q, k, v) = (tokens(self.q.forward(g, n)), tokens(self.k.forward(g, n)), tokens(self.v.forward(g, n)));
        let a = nn::attention(g, q, k, v, 1, None, false, g.options.flash_attn, 1.0);
        let a = a.permute(1, 0, 2, 3).cont().reshape(&[w, h, t, c]);
        self.proj_out.forward(g, a).add(x)
    }
}

#[derive(Clone, Copy, Debug)]
struct MidBlock {
    block_1: Resnet,
    attn_1: Attention,
    block_2: Resnet,
}

impl MidBlock {
    fn new(s: &mut Scope, c: i64, shape_of: ShapeOf) -> MidBlock {
        let mut s = s.sub("mid");
        MidBlock {
            block_1: Resnet::new(&mut s, "block_1", c, c, shape_of),
            attn_1: Attention::new(&mut s, "attn_1", c, shape_of),
            block_2: Resnet::new(&mut s, "block_2", c, c, shape_of),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.block_1.forward(g, x, None);
        let x = self.attn_1.forward(g, x);
        self.block_2.forward(g, x, None)
    }
}

/// `x` `[W, H, T, C]` with each channel repeated `repeats` times in place (channel `c`
/// becomes `c·repeats .. (c+1)·repeats`).
fn repeat_channels<'g>(g: &'g Graph, x: T<'g>, repeats: i64) -> T<'g> {
    if repeats == 1 {
        return x;
    }
    let [w, h, t, c] = x.ne();
    let x = x.reshape(&[w * h * t, 1, c]);
    x.repeat(g.new_tensor(x.ty(), &[w * h * t, repeats, c])).reshape(&[w, h, t, c * repeats])
}

/// `[W, H, T, C·ft·fs·fs]` → `[W·fs, H·fs, T·ft, C]` (the reference's `_pixel_shuffle_3d`).
fn pixel_shuffle<'g>(x: T<'g>, ft: i64, fs: i64) -> T<'g> {
    let [w, h, t, cf] = x.ne();
    let factor = ft * fs * fs;
    let c = cf / factor;
    let x = x.cont().reshape(&[w, h * t, c, factor]).permute_axes([0, 1, 3, 2]).cont();
    let x = x.reshape(&[w, h * t, fs, fs * ft * c]).permute_axes([2, 0, 1, 3]).cont();
    let x = x.reshape(&[fs * w, h * t, fs, ft * c]).permute_axes([0, 2, 1, 3]).cont();
    let x = x.reshape(&[fs * w * fs * h, t, ft, c]).permute_axes([0, 2, 1, 3]).cont();
    x.reshape(&[fs * w, fs * h, ft * t, c])
}

/// Doubles the sides (and with `temporal` the frames after a first chunk's first) by a
/// convolution to `out·factor` channels shuffled into place, plus the input shuffled alike.
#[derive(Clone, Copy, Debug)]
struct Upsample {
    conv: CausalConv,
    out: i64,
    temporal: bool,
    repeats: i64,
}

impl Upsample {
    fn new(s: &mut Scope, ic: i64, oc: i64, temporal: bool) -> Upsample {
        let factor = if temporal { 8 } else { 4 };
        Upsample { conv: CausalConv::new(s, "upsample.conv", ic, oc * factor, 3), out: oc, temporal, repeats: oc * factor / ic }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, carry: &mut Carry<'_, 'g>) -> T<'g> {
        let continuation = carry.continuation;
        let h = self.conv.forward(g, x, Some(carry));
        let t = x.ne()[2];
        if self.temporal && !continuation {
            let h_first = slice(pixel_shuffle(frames(h, 0, 1), 1, 2), 3, 0, self.out);
            let x_first = pixel_shuffle(repeat_channels(g, frames(x, 0, 1), self.repeats / 2), 1, 2);
            if t == 1 {
                return h_first.add(x_first);
            }
            let h = h_first.concat(pixel_shuffle(frames(h, 1, t), 2, 2), 2);
            let shortcut = x_first.concat(pixel_shuffle(repeat_channels(g, frames(x, 1, t), self.repeats), 2, 2), 2);
            return h.add(shortcut);
        }
        let ft = if self.temporal { 2 } else { 1 };
        pixel_shuffle(h, ft, 2).add(pixel_shuffle(repeat_channels(g, x, self.repeats), ft, 2))
    }
}

/// `[W·fs, H·fs, T·ft, C]` → `[W, H, T, C·ft·fs·fs]` (the reference's `pixel_unshuffle_3d`).
fn pixel_unshuffle<'g>(x: T<'g>, ft: i64, fs: i64) -> T<'g> {
    let [w, h, t, c] = x.ne();
    let (w, h, t) = (w / fs, h / fs, t / ft);
    let factor = ft * fs * fs;
    let x = x.cont().reshape(&[fs * w * fs * h, ft, t, c]).permute_axes([0, 2, 1, 3]).cont();
    let x = x.reshape(&[fs * w, fs, h * t, ft * c]).permute_axes([0, 2, 1, 3]).cont();
    let x = x.reshape(&[fs, w, h * t, fs * ft * c]).permute_axes([1, 2, 0, 3]).cont();
    let x = x.reshape(&[w, h * t, factor, c]).permute_axes([0, 1, 3, 2]).cont();
    x.reshape(&[w, h, t, c * factor])
}

/// The mean of each run of `group` consecutive channels of `[W, H, T, C]`.
fn mean_channel_groups<'g>(x: T<'g>, group: i64) -> T<'g> {
    if group == 1 {
        return x;
    }
    let [w, h, t, c] = x.ne();
    let x = x.reshape(&[w * h * t, group, c / group]).permute_axes([1, 0, 2, 3]).cont().sum_rows();
    let x = x.permute_axes([1, 0, 2, 3]).cont().reshape(&[w, h, t, c / group]);
    nn::scale(x, 1.0 / group as f32, false)
}

/// Halves the sides (and with `temporal` the frames after the first) by a convolution to
/// `out / factor` channels unshuffled into place, plus the input unshuffled and averaged
/// over channel groups.
#[derive(Clone, Copy, Debug)]
struct Downsample {
    conv: CausalConv,
    temporal: bool,
    group: i64,
}

impl Downsample {
    fn new(s: &mut Scope, ic: i64, oc: i64, temporal: bool) -> Downsample {
        let factor = if temporal { 8 } else { 4 };
        Downsample { conv: CausalConv::new(s, "downsample.conv", ic, oc / factor, 3), temporal, group: factor * ic / oc }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut h = self.conv.forward(g, x, None);
        let mut x = x;
        let t = x.ne()[2];
        let mut first = None;
        if self.temporal {
            let h_first = pixel_unshuffle(frames(h, 0, 1), 1, 2);
            let h_first = h_first.concat(h_first, 3);
            let x_first = mean_channel_groups(pixel_unshuffle(frames(x, 0, 1), 1, 2), self.group / 2);
            if t == 1 {
                return h_first.add(x_first);
            }
            first = Some((h_first, x_first));
            h = frames(h, 1, t);
            x = frames(x, 1, t);
        }
        let ft = if self.temporal { 2 } else { 1 };
        let mut h = pixel_unshuffle(h, ft, 2);
        let mut x = mean_channel_groups(pixel_unshuffle(x, ft, 2), self.group);
        if let Some((hf, xf)) = first {
            h = hf.concat(h, 2);
            x = xf.concat(x, 2);
        }
        h.add(x)
    }
}

#[derive(Clone, Debug)]
struct DownBlock {
    resnets: Vec<Resnet>,
    downsample: Option<Downsample>,
}

#[derive(Clone, Debug)]
struct Encoder {
    conv_in: CausalConv,
    down: Vec<DownBlock>,
    mid: MidBlock,
    norm_out: RmsNorm,
    conv_out: CausalConv,
}

impl Encoder {
    fn new(s: &mut Scope, shape_of: ShapeOf) -> Encoder {
        let mut s = s.sub("encoder");
        let conv_in = CausalConv::new(&mut s, "conv_in", 3, DIMS[0], 3);
        let mut ic = DIMS[0];
        let down = DIMS
            .iter()
            .enumerate()
            .map(|(i, &oc)| {
                let mut b = s.sub(&format!("down.{i}"));
                let resnets = (0..ENCODER_RESNETS).map(|j| Resnet::new(&mut b, &format!("block.{j}"), if j == 0 { ic } else { oc }, oc, shape_of)).collect();
                let downsample = (i < SPATIAL_LEVELS).then(|| Downsample::new(&mut b, oc, DIMS[i + 1], i >= SPATIAL_LEVELS - TEMPORAL_LEVELS));
                ic = if downsample.is_some() { DIMS[i + 1] } else { oc };
                DownBlock { resnets, downsample }
            })
            .collect();
        Encoder {
            conv_in,
            down,
            mid: MidBlock::new(&mut s, ic, shape_of),
            norm_out: RmsNorm::new(&mut s, "norm_out", ic, shape_of),
            conv_out: CausalConv::new(&mut s, "conv_out", ic, 2 * Z_CHANNELS, 3),
        }
    }

    /// Video `[W, H, T, 3]` in [-1, 1] → latent mean `[W/16, H/16, (T-1)/4+1, 32]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.conv_in.forward(g, x, None);
        for level in &self.down {
            for r in &level.resnets {
                x = r.forward(g, x, None);
            }
            if let Some(d) = &level.downsample {
                x = d.forward(g, x);
            }
        }
        let x = self.mid.forward(g, x);
        let shortcut = mean_channel_groups(x, x.ne()[3] / (2 * Z_CHANNELS));
        let y = self.conv_out.forward(g, self.norm_out.forward(g, x).silu_inplace(), None).add(shortcut);
        slice(y, 3, 0, Z_CHANNELS)
    }
}

#[derive(Clone, Debug)]
struct UpBlock {
    resnets: Vec<Resnet>,
    upsample: Option<Upsample>,
}

#[derive(Clone, Debug)]
struct Decoder {
    conv_in: CausalConv,
    mid: MidBlock,
    up: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv,
}

impl Decoder {
    fn new(s: &mut Scope, shape_of: ShapeOf) -> Decoder {
        let mut s = s.sub("decoder");
        let dims: Vec<i64> = DIMS.iter().rev().copied().collect();
        let conv_in = CausalConv::new(&mut s, "conv_in", Z_CHANNELS, dims[0], 3);
        let mid = MidBlock::new(&mut s, dims[0], shape_of);
        let mut ic = dims[0];
        let up = dims
            .iter()
            .enumerate()
            .map(|(i, &oc)| {
                let mut b = s.sub(&format!("up.{i}"));
                let resnets = (0..DECODER_RESNETS).map(|j| Resnet::new(&mut b, &format!("block.{j}"), if j == 0 { ic } else { oc }, oc, shape_of)).collect();
                let upsample = (i < SPATIAL_LEVELS).then(|| Upsample::new(&mut b, oc, dims[i + 1], i < TEMPORAL_LEVELS));
                ic = upsample.map_or(oc, |u| u.out);
                UpBlock { resnets, upsample }
            })
            .collect();
        let last = *dims.last().expect("levels");
        Decoder {
            conv_in,
            mid,
            up,
            norm_out: RmsNorm::new(&mut s, "norm_out", last, shape_of),
            conv_out: CausalConv::new(&mut s, "conv_out", last, 3, 3),
        }
    }

    /// Latent `[w, h, t, 32]` → the mid block's output `[w, h, t, 1024]` (its attention spans
    /// every frame, so it runs on all of them at once).
    fn head<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let h = self.conv_in.forward(g, z, None).add(repeat_channels(g, z, DIMS[DIMS.len() - 1] / Z_CHANNELS));
        self.mid.forward(g, h)
    }

    /// The causal convolutions a chunk runs, each with its slot of the feature cache.
    fn cached_convs(&self) -> usize {
        self.up.iter().map(|l| 2 * l.resnets.len() + usize::from(l.upsample.is_some())).sum::<usize>() + 1
    }

    /// One latent frame of the mid block's output `[w, h, 1, 1024]` → its frames (1 for the
    /// video's first chunk, 4 after), continuing from the frames the chunk before left.
    fn chunk<'g>(&self, g: &'g Graph, x: T<'g>, carry: &mut Carry<'_, 'g>) -> T<'g> {
        let mut x = x;
        for level in &self.up {
            for r in &level.resnets {
                x = r.forward(g, x, Some(&mut *carry));
            }
            if let Some(u) = &level.upsample {
                x = u.forward(g, x, carry);
            }
        }
        let x = self.norm_out.forward(g, x).silu_inplace();
        self.conv_out.forward(g, x, Some(carry))
    }
}

/// The HunyuanVideo VAE (the encoder only where the file has one).
pub struct HunyuanVae {
    encoder: Option<Encoder>,
    decoder: Decoder,
}

impl HunyuanVae {
    /// The decoder under `s` (`PREFIX`), and the encoder when `has_encoder` (the file holds
    /// `encoder.conv_in.conv.weight`).
    pub fn new(s: &mut Scope, shape_of: ShapeOf, has_encoder: bool) -> HunyuanVae {
        let encoder = has_encoder.then(|| Encoder::new(s, shape_of));
        HunyuanVae { encoder, decoder: Decoder::new(s, shape_of) }
    }

    fn run_encoder(&self, runner: &mut Runner, x: &Tensor) -> Result<Tensor> {
        let Some(encoder) = &self.encoder else {
            bail!("the HunyuanVideo VAE file has no encoder (no encoder.conv_in.conv.weight): it only decodes, pictures cannot be encoded")
        };
        let (w, h, t) = (x.ne(0), x.ne(1), x.ne(2));
        ensure!(x.ne(3) == 3, "vae encode: the HunyuanVideo VAE takes RGB, got {} channels", x.ne(3));
        ensure!(w % SCALE == 0 && h % SCALE == 0 && t >= 1, "vae encode: the HunyuanVideo VAE needs sides that are multiples of {SCALE}, got {w}x{h}");
        ensure!(t == 1 || (t - 1) % TIME_SCALE == 0, "vae encode: the HunyuanVideo VAE takes 4k+1 frames, got {t}");
        let out = runner.compute(|g| Ok(encoder.forward(g, g.input_f32(x.data(), &[w as i64, h as i64, t as i64, 3]))))?;
        out.reshape(&[w / SCALE, h / SCALE, (t - 1) / TIME_SCALE + 1, Z_CHANNELS as usize])
    }

    fn run_decoder(&self, runner: &mut Runner, z: &Tensor, mut progress: Progress<'_>) -> Result<Tensor> {
        let (w, h, t) = (z.ne(0), z.ne(1), z.ne(2));
        ensure!(z.ne(3) as i64 == Z_CHANNELS, "vae decode: the HunyuanVideo VAE takes {Z_CHANNELS} latent channels, got {}", z.ne(3));
        ensure!(t >= 1, "vae decode: no latent frames");
        let decoder = &self.decoder;
        let mid = runner.compute(|g| Ok(decoder.head(g, g.input_f32(z.data(), &[w as i64, h as i64, t as i64, Z_CHANNELS]))))?;
        let mid = mid.reshape(&[w, h, t, DIMS[DIMS.len() - 1] as usize])?;
        // One graph per latent frame: memory holds one chunk's buffers and the cached frames,
        // however long the video.
        let (slots, mut cache, mut parts) = (decoder.cached_convs(), Vec::new(), Vec::with_capacity(t));
        for i in 0..t {
            let start = std::time::Instant::now();
            let x = take_frames(&mid, i..i + 1)?;
            parts.push(run_cached(runner, &mut cache, slots, i + 1 < t, |g, fc| {
                let mut carry = Carry { cache: fc, next: 0, continuation: i > 0 };
                Ok(decoder.chunk(g, g.input(&x), &mut carry))
            })?);
            if let Some(p) = progress.as_mut() {
                p(i as i32 + 1, t as i32, start.elapsed().as_secs_f32());
            }
        }
        cat_frames(&parts)
    }
}

impl VaeNet for HunyuanVae {
    fn name(&self) -> &'static str {
        "HunyuanVideo VAE"
    }

    fn scale(&self) -> usize {
        SCALE
    }

    fn time_scale(&self) -> usize {
        TIME_SCALE
    }

    fn encoder_output_channels(&self) -> i64 {
        Z_CHANNELS
    }

    /// Pictures `[W, H, 3, N]` in [-1, 1] → latent means `[W/16, H/16, 32, N]`, one frame each.
    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        let (w, h, c, n) = (image.ne(0), image.ne(1), image.ne(2), image.ne(3));
        let mut out = Vec::new();
        for b in 0..n {
            let item = Tensor::from_vec(&[w, h, 1, c], image.data()[b * w * h * c..(b + 1) * w * h * c].to_vec())?;
            out.extend_from_slice(self.run_encoder(runner, &item)?.data());
        }
        Tensor::from_vec(&[w / SCALE, h / SCALE, Z_CHANNELS as usize, n], out)
    }

    /// VAE-space latent `[w, h, 32, N]` → pictures, one frame each.
    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        let (w, h, c, n) = (latent.ne(0), latent.ne(1), latent.ne(2), latent.ne(3));
        let mut out = Vec::with_capacity(n * w * h * SCALE * SCALE * 3);
        for b in 0..n {
            let item = Tensor::from_vec(&[w, h, 1, c], latent.data()[b * w * h * c..(b + 1) * w * h * c].to_vec())?;
            out.extend_from_slice(self.run_decoder(runner, &item, None)?.data());
        }
        Tensor::from_vec(&[w * SCALE, h * SCALE, 3, n], out)
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        z.map(|v| v * SCALING_FACTOR)
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        z.map(|v| v / SCALING_FACTOR)
    }

    fn supports_video(&self) -> bool {
        true
    }

    fn encode_video(&self, runner: &mut Runner, frames: &Tensor) -> Result<Tensor> {
        let s = frames.shape();
        ensure!((4..=5).contains(&s.len()) && s[4..].iter().all(|&d| d == 1), "vae encode: expected a video [W, H, T, C, 1], got shape {s:?}");
        self.run_encoder(runner, frames)
    }

    fn decode_video(&self, runner: &mut Runner, latents: &Tensor, _temporal: Option<TemporalTiles>, progress: Progress<'_>) -> Result<Tensor> {
        let s = latents.shape();
        ensure!((4..=5).contains(&s.len()) && s[4..].iter().all(|&d| d == 1), "vae decode: expected a video [W, H, T, C, 1], got shape {s:?}");
        self.run_decoder(runner, latents, progress)
    }
}
