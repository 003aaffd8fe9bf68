//! The Wan2.1 VAE (the reference's `wan_vae.hpp`): a causal video autoencoder whose 3-D
//! convolutions only look back in time, used by Wan 2.x and, on single frames, by
//! Qwen-Image. 16 latent channels at 1/8 of the image and 1/4 of the frames (after the first).
//!
//! - Weights under `first_stage_model.` with the original names: `encoder.conv1`,
//!   `encoder.downsamples.N` (residual blocks `residual.{0,2,3,6}` / `shortcut`, resamplers
//!   `resample.1` / `time_conv`), `encoder.middle.{0,1,2}` (the middle attention is `norm`,
//!   `to_qkv`, `proj`), `encoder.head.{0,2}`, `conv1`, `conv2`, and the decoder's mirror
//!   (`decoder.upsamples.N`). Norms are RMS norms over the channels whose `gamma` is kept in
//!   the file's shape (`[C, 1, 1, 1]`, `[C, 1, 1]`); 3-D kernels `[OC, IC, KD, KH, KW]` are
//!   f16 `[KW, KH, KD, OC·IC]`.
//! - Tensors are `[W, H, T, C]` (one batch item). A causal convolution pads time with two
//!   zero frames in front (or the cached frames of the previous chunk) and none behind; the
//!   product covers the zero frames too, like the reference, so the sums are its sums.
//! - Frames go through the networks in chunks that share a feature cache (the last frames
//!   each causal convolution saw): the encoder takes the first frame, then 4 at a time, the
//!   decoder one latent frame at a time (its `upsample3d` doubles the frames from the second
//!   on). A single image is the first chunk alone: no time convolution runs.
//! - Files whose `decoder.conv1` kernel is 2-D (a third dimension of more than 3) are the 2-D
//!   variant: every convolution is a plain 2-D one over each frame.
//! - Encoding returns the latent mean (no sampling); diffusion latents are normalised per
//!   channel with the fixed [`WAN21_LATENT_MEAN`] / [`WAN21_LATENT_STD`] (host steps in
//!   `super::Vae`).

use crate::error::Result;
use crate::graph::nn::{self, pad_circular, Conv2d};
use crate::graph::{Graph, Runner, Scope, F16, F32, T, W};
use crate::models::common::dit::chunk;
use crate::tensor::Tensor;

/// Per-channel mean of the Wan2.1 VAE's latents (the reference's table).
pub const WAN21_LATENT_MEAN: [f32; 16] =
    [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921];
/// Per-channel standard deviation of the Wan2.1 VAE's latents (the reference's table).
pub const WAN21_LATENT_STD: [f32; 16] =
    [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160];

/// Frames of the previous chunk a causal convolution keeps.
const CACHE_T: i64 = 2;
/// Pixels per latent pixel.
pub const SCALE: usize = 8;

#[derive(Clone, Debug, PartialEq)]
pub struct WanVaeConfig {
    /// Image channels (4 for Qwen-Image-Layered's RGBA).
    pub in_channels: i64,
    pub dim: i64,
    pub z_dim: i64,
    pub dim_mult: Vec<i64>,
    pub num_res_blocks: usize,
    /// Per level: whether the encoder's downsampling also halves the frames.
    pub temporal_downsample: Vec<bool>,
    /// Per level: whether the decoder's upsampling also doubles the frames.
    pub temporal_upsample: Vec<bool>,
    /// Every convolution is 2-D.
    pub is_2d: bool,
    pub decode_only: bool,
}

impl WanVaeConfig {
    /// The Wan2.1 VAE (dim 96, mult 1/2/4/4, 2 residual blocks, 16 latent channels).
    pub fn wan21(decode_only: bool) -> WanVaeConfig {
        WanVaeConfig {
            in_channels: 3,
            dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temporal_downsample: vec![false, true, true],
            temporal_upsample: vec![true, true, false],
            is_2d: false,
            decode_only,
        }
    }

    /// The Wan2.1 VAE under `prefix`, 2-D when the files' `decoder.conv1` kernel is.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str, decode_only: bool, in_channels: i64) -> WanVaeConfig {
        let mut cfg = WanVaeConfig { in_channels, ..Self::wan21(decode_only) };
        if shape_of(&format!("{prefix}decoder.conv1.weight")).is_some_and(|ne| ne.len() >= 3 && ne[2] > 3) {
            sd_debug!("USING 2D VAE");
            cfg.is_2d = true;
            cfg.temporal_downsample = vec![false; 3];
            cfg.temporal_upsample = vec![false; 3];
        }
        cfg
    }
}

/// The last `n` frames of `x` `[W, H, T, C]` (all of them when it has one, as the reference).
fn last_frames<'g>(x: T<'g>, n: i64) -> T<'g> {
    let t = x.ne()[2];
    if t == 1 {
        return x;
    }
    frames(x, (t - n).max(0), t)
}

/// Frames `start..end` of `x` `[W, H, T, C]`, dense (`x` itself when it has one frame).
fn frames<'g>(x: T<'g>, start: i64, end: i64) -> T<'g> {
    let [w, h, t, c] = x.ne();
    if t == 1 {
        return x;
    }
    let nb = x.nb();
    x.view(&[w, h, end - start, c], &[nb[1], nb[2], nb[3]], start as usize * nb[2]).cont()
}

/// The feature cache of one pass: per causal convolution (in network order), the frames
/// the next chunk continues from.
struct FeatCache<'g> {
    slots: Vec<Option<T<'g>>>,
    next: usize,
}

impl<'g> FeatCache<'g> {
    fn new() -> FeatCache<'g> {
        FeatCache { slots: Vec::new(), next: 0 }
    }

    /// Starts a chunk: slots are visited from the first again.
    fn rewind(&mut self) {
        self.next = 0;
    }

    /// The next slot's index (created empty on first use).
    fn take_index(&mut self) -> usize {
        let i = self.next;
        if self.slots.len() <= i {
            self.slots.resize(i + 1, None);
        }
        self.next += 1;
        i
    }

    /// The frames to keep after a convolution over `x`: its last two, or its last one after
    /// the previous chunk's last one.
    fn frames_to_keep(&self, i: usize, x: T<'g>) -> T<'g> {
        let keep = last_frames(x, CACHE_T);
        match self.slots[i] {
            Some(prev) if keep.ne()[2] < CACHE_T => last_frames(prev, 1).concat(keep, 2),
            _ => keep,
        }
    }
}

/// A convolution that only looks back in time (kernel `(kd, kh, kw)`, padding `(pd, ph,
/// pw)`: `2·pd` frames in front, `ph`/`pw` on both sides in space).
#[derive(Clone, Copy, Debug)]
struct CausalConv3d {
    weight: W,
    bias: W,
    in_ch: i64,
    stride: [i32; 3],
    padding: [i32; 3],
}

impl CausalConv3d {
    fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, kernel: [i64; 3], stride: [i32; 3], padding: [i32; 3]) -> CausalConv3d {
        let mut s = s.sub(name);
        let [kd, kh, kw] = kernel;
        CausalConv3d {
            weight: s.tensor("weight", F16, &[kw, kh, kd, in_ch * out_ch]),
            bias: s.tensor("bias", F32, &[out_ch]),
            in_ch,
            stride,
            padding,
        }
    }

    /// x `[W, H, T, IC]`, after the `cache` frames of the previous chunk → `[W', H', T', OC]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: Option<T<'g>>) -> T<'g> {
        let [pd, ph, pw] = self.padding;
        let mut front = 2 * pd;
        let mut x = x;
        if let Some(c) = cache.filter(|_| front > 0) {
            x = c.concat(x, 2);
            front -= c.ne()[2] as i32;
        }
        let x = pad_circular(g, x, [pw, ph, front, 0], [pw, ph, 0, 0]);
        let [sd, sh, sw] = self.stride;
        nn::conv_3d(g, x, g.param(self.weight), Some(g.param(self.bias)), self.in_ch, [sw, sh, sd], [0; 3], [1; 3])
    }
}

/// A 3-D causal convolution, or in the 2-D variant a 2-D one over each frame.
#[derive(Clone, Copy, Debug)]
enum Conv {
    Causal(CausalConv3d),
    Flat(Conv2d),
}

impl Conv {
    /// Kernel `k`×`k`(×`k` frames), padding `p` all round (causal in time).
    fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, k: i64, p: i32, is_2d: bool) -> Conv {
        if is_2d {
            Conv::Flat(Conv2d::square(s, name, in_ch, out_ch, k, 1, p))
        } else {
            Conv::Causal(CausalConv3d::new(s, name, in_ch, out_ch, [k; 3], [1; 3], [p; 3]))
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: Option<T<'g>>) -> T<'g> {
        match self {
            Conv::Causal(c) => c.forward(g, x, cache),
            Conv::Flat(c) => c.forward(g, x.permute_axes([0, 1, 3, 2]).cont()).permute_axes([0, 1, 3, 2]).cont(),
        }
    }

    /// Runs with the chunk's feature cache: the cached frames in front, this input's last
    /// frames kept for the next chunk.
    fn forward_cached<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        let i = cache.take_index();
        let keep = cache.frames_to_keep(i, x);
        let out = self.forward(g, x, cache.slots[i]);
        cache.slots[i] = Some(keep);
        out
    }
}

/// RMS normalisation over the channels (`F.normalize · √C · γ`, as ggml's RMS norm).
#[derive(Clone, Copy, Debug)]
struct RmsNorm {
    gamma: W,
}

impl RmsNorm {
    /// `gamma` in the shape the files hold it (`[C]` when absent).
    fn new(s: &mut Scope, name: &str, dim: i64, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> RmsNorm {
        let mut s = s.sub(name);
        let ne = shape_of(&s.full_name("gamma")).filter(|ne| ne.iter().product::<i64>() == dim && ne.len() <= 4).unwrap_or_else(|| vec![dim]);
        RmsNorm { gamma: s.tensor("gamma", F32, &ne) }
    }

    /// x `[W, H, T, C]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gamma = g.param(self.gamma);
        let gamma = gamma.reshape(&[gamma.ne().iter().product()]);
        let h = x.permute_axes([3, 0, 1, 2]).contiguous().rms_norm(1e-12).mul(gamma);
        h.permute_axes([1, 2, 3, 0]).contiguous()
    }
}

#[derive(Clone, Copy, Debug)]
struct ResidualBlock {
    norm1: RmsNorm,
    conv1: Conv,
    norm2: RmsNorm,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl ResidualBlock {
    fn new(s: &mut Scope, name: &str, in_dim: i64, out_dim: i64, cfg: &WanVaeConfig, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> ResidualBlock {
        let mut s = s.sub(name);
        ResidualBlock {
            norm1: RmsNorm::new(&mut s, "residual.0", in_dim, shape_of),
            conv1: Conv::new(&mut s, "residual.2", in_dim, out_dim, 3, 1, cfg.is_2d),
            norm2: RmsNorm::new(&mut s, "residual.3", out_dim, shape_of),
            conv2: Conv::new(&mut s, "residual.6", out_dim, out_dim, 3, 1, cfg.is_2d),
            shortcut: (in_dim != out_dim).then(|| Conv::new(&mut s, "shortcut", in_dim, out_dim, 1, 0, cfg.is_2d)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        let skip = match &self.shortcut {
            Some(c) => c.forward(g, x, None),
            None => x,
        };
        let h = self.norm1.forward(g, x).silu();
        let h = self.conv1.forward_cached(g, h, cache);
        let h = self.norm2.forward(g, h).silu();
        let h = self.conv2.forward_cached(g, h, cache);
        h.add(skip)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ResampleMode {
    Up2d,
    Up3d,
    Down2d,
    Down3d,
}

/// Spatial up/downsampling (a 2-D convolution per frame), with a time convolution that
/// doubles (up) or halves (down) the frames from the second chunk on.
#[derive(Clone, Copy, Debug)]
struct Resample {
    mode: ResampleMode,
    conv: Conv2d,
    time_conv: Option<CausalConv3d>,
}

impl Resample {
    fn new(s: &mut Scope, name: &str, dim: i64, mode: ResampleMode) -> Resample {
        let mut s = s.sub(name);
        let conv = match mode {
            ResampleMode::Up2d | ResampleMode::Up3d => Conv2d::square(&mut s, "resample.1", dim, dim / 2, 3, 1, 1),
            ResampleMode::Down2d | ResampleMode::Down3d => Conv2d::square(&mut s, "resample.1", dim, dim, 3, 2, 0),
        };
        let time_conv = match mode {
            ResampleMode::Up3d => Some(CausalConv3d::new(&mut s, "time_conv", dim, dim * 2, [3, 1, 1], [1; 3], [1, 0, 0])),
            ResampleMode::Down3d => Some(CausalConv3d::new(&mut s, "time_conv", dim, dim, [3, 1, 1], [2, 1, 1], [0; 3])),
            _ => None,
        };
        Resample { mode, conv, time_conv }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        let mut x = x;
        if let (ResampleMode::Up3d, Some(tc)) = (self.mode, &self.time_conv) {
            let i = cache.take_index();
            // The first chunk leaves its slot empty: its single frame is not doubled.
            if chunk_idx > 0 {
                let mut keep = cache.frames_to_keep(i, x);
                if chunk_idx == 1 && keep.ne()[2] < CACHE_T {
                    let n = keep.ne()[2] as i32;
                    keep = keep.pad_ext([0, 0, n, 0], [0; 4]);
                }
                let prev = if chunk_idx == 1 { None } else { cache.slots[i] };
                let y = tc.forward(g, x, prev);
                cache.slots[i] = Some(keep);
                // [W, H, T, 2C] → [W, H, 2T, C]: the two halves of the channels become
                // consecutive frames.
                let [w, h, t, c2] = y.ne();
                let c = c2 / 2;
                x = y.reshape(&[w * h, t, c, 2]).permute_axes([0, 3, 1, 2]).contiguous().reshape(&[w, h, 2 * t, c]);
            }
        }
        let mut y = x.permute_axes([0, 1, 3, 2]).contiguous();
        y = match self.mode {
            ResampleMode::Up2d | ResampleMode::Up3d => y.upscale(2),
            // torch pads (0, 1, 0, 1): one column right, one row at the bottom.
            ResampleMode::Down2d | ResampleMode::Down3d => pad_circular(g, y, [0; 4], [1, 1, 0, 0]),
        };
        let mut x = self.conv.forward(g, y).permute_axes([0, 1, 3, 2]).contiguous();
        if let (ResampleMode::Down3d, Some(tc)) = (self.mode, &self.time_conv) {
            let i = cache.take_index();
            match cache.slots[i] {
                // The first chunk only remembers its output.
                None => cache.slots[i] = Some(x),
                Some(prev) => {
                    let keep = last_frames(x, 1);
                    x = tc.forward(g, last_frames(prev, 1).concat(x, 2), None);
                    cache.slots[i] = Some(keep);
                }
            }
        }
        x
    }
}

/// Single-head self-attention over each frame's pixels.
#[derive(Clone, Copy, Debug)]
struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: Conv2d,
    proj: Conv2d,
}

impl AttentionBlock {
    fn new(s: &mut Scope, name: &str, dim: i64, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> AttentionBlock {
        let mut s = s.sub(name);
        AttentionBlock {
            norm: RmsNorm::new(&mut s, "norm", dim, shape_of),
            to_qkv: Conv2d::square(&mut s, "to_qkv", dim, dim * 3, 1, 1, 0),
            proj: Conv2d::square(&mut s, "proj", dim, dim, 1, 1, 0),
        }
    }

    /// x `[W, H, T, C]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.norm.forward(g, x).permute_axes([0, 1, 3, 2]).contiguous();
        let [w, ht, c, n] = h.ne();
        let qkv = self.to_qkv.forward(g, h);
        // [W, H, 3C, N] → [W·H, C, N, 3]: q, k and v one after the other.
        let qkv = qkv.reshape(&[w * ht, c, 3, n]).permute_axes([0, 1, 3, 2]).cont();
        let nb = qkv.nb();
        let part = |i: usize| qkv.view(&[w, ht, c, n], &[nb[0] * w as usize, nb[1], nb[2]], i * nb[3]);
        let tokens = |t: T<'g>| t.permute_axes([2, 0, 1, 3]).contiguous().reshape(&[c, ht * w, n]);
        let (q, k) = (tokens(part(0)), tokens(part(1)));
        let v = part(2).cont().reshape(&[ht * w, c, n]).permute_axes([1, 0, 2, 3]).cont();
        let a = nn::attention(g, q, k, v, 1, None, false, g.options.flash_attn, 1.0);
        let a = a.permute(1, 0, 2, 3).cont().reshape(&[w, ht, c, n]);
        self.proj.forward(g, a).permute_axes([0, 1, 3, 2]).contiguous().add(x)
    }
}

/// One step of the encoder's or decoder's level sequence.
#[derive(Clone, Copy, Debug)]
enum Layer {
    Res(ResidualBlock),
    Resample(Resample),
}

/// The middle (residual, attention, residual) and head (norm, SiLU, convolution) both
/// networks share, with their first convolution and level sequence.
#[derive(Clone, Debug)]
struct Network {
    conv1: Conv,
    levels: Vec<Layer>,
    middle: (ResidualBlock, AttentionBlock, ResidualBlock),
    head_norm: RmsNorm,
    head_conv: Conv,
}

impl Network {
    /// The middle at `mid` channels and the head from `head` to `out_ch` channels.
    fn middle_and_head(s: &mut Scope, mid: i64, head: i64, out_ch: i64, cfg: &WanVaeConfig, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> ((ResidualBlock, AttentionBlock, ResidualBlock), RmsNorm, Conv) {
        let middle = (
            ResidualBlock::new(s, "middle.0", mid, mid, cfg, shape_of),
            AttentionBlock::new(s, "middle.1", mid, shape_of),
            ResidualBlock::new(s, "middle.2", mid, mid, cfg, shape_of),
        );
        (middle, RmsNorm::new(s, "head.0", head, shape_of), Conv::new(s, "head.2", head, out_ch, 3, 1, cfg.is_2d))
    }

    fn encoder(s: &mut Scope, cfg: &WanVaeConfig, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Network {
        let mut s = s.sub("encoder");
        let dims: Vec<i64> = std::iter::once(cfg.dim).chain(cfg.dim_mult.iter().map(|m| cfg.dim * m)).collect();
        let conv1 = Conv::new(&mut s, "conv1", cfg.in_channels, dims[0], 3, 1, cfg.is_2d);
        let mut levels = Vec::new();
        let last = cfg.dim_mult.len() - 1;
        for i in 0..=last {
            let (mut in_dim, out_dim) = (dims[i], dims[i + 1]);
            for _ in 0..cfg.num_res_blocks {
                levels.push(Layer::Res(ResidualBlock::new(&mut s, &format!("downsamples.{}", levels.len()), in_dim, out_dim, cfg, shape_of)));
                in_dim = out_dim;
            }
            if i != last {
                let mode = if cfg.temporal_downsample[i] { ResampleMode::Down3d } else { ResampleMode::Down2d };
                levels.push(Layer::Resample(Resample::new(&mut s, &format!("downsamples.{}", levels.len()), out_dim, mode)));
            }
        }
        let (middle, head_norm, head_conv) = Self::middle_and_head(&mut s, dims[last + 1], dims[last + 1], cfg.z_dim * 2, cfg, shape_of);
        Network { conv1, levels, middle, head_norm, head_conv }
    }

    fn decoder(s: &mut Scope, cfg: &WanVaeConfig, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Network {
        let mut s = s.sub("decoder");
        let last = cfg.dim_mult.len() - 1;
        let dims: Vec<i64> = std::iter::once(cfg.dim * cfg.dim_mult[last]).chain(cfg.dim_mult.iter().rev().map(|m| cfg.dim * m)).collect();
        let conv1 = Conv::new(&mut s, "conv1", cfg.z_dim, dims[0], 3, 1, cfg.is_2d);
        let mut levels = Vec::new();
        for i in 0..=last {
            // The previous level's upsampling halved the channels.
            let (mut in_dim, out_dim) = (if i == 0 { dims[0] } else { dims[i] / 2 }, dims[i + 1]);
            for _ in 0..cfg.num_res_blocks + 1 {
                levels.push(Layer::Res(ResidualBlock::new(&mut s, &format!("upsamples.{}", levels.len()), in_dim, out_dim, cfg, shape_of)));
                in_dim = out_dim;
            }
            if i != last {
                let mode = if cfg.temporal_upsample[i] { ResampleMode::Up3d } else { ResampleMode::Up2d };
                levels.push(Layer::Resample(Resample::new(&mut s, &format!("upsamples.{}", levels.len()), out_dim, mode)));
            }
        }
        let (middle, head_norm, head_conv) = Self::middle_and_head(&mut s, dims[0], dims[last + 1], cfg.in_channels, cfg, shape_of);
        Network { conv1, levels, middle, head_norm, head_conv }
    }

    fn run_levels<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        self.levels.iter().fold(x, |x, layer| match layer {
            Layer::Res(r) => r.forward(g, x, cache),
            Layer::Resample(r) => r.forward(g, x, cache, chunk_idx),
        })
    }

    fn run_middle<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        let x = self.middle.0.forward(g, x, cache);
        let x = self.middle.1.forward(g, x);
        self.middle.2.forward(g, x, cache)
    }

    fn run_head<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        self.head_conv.forward_cached(g, self.head_norm.forward(g, x).silu(), cache)
    }

    /// One chunk through the encoder: levels, then middle, then head.
    fn encode_chunk<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        cache.rewind();
        let x = self.conv1.forward_cached(g, x, cache);
        let x = self.run_levels(g, x, cache, chunk_idx);
        let x = self.run_middle(g, x, cache);
        self.run_head(g, x, cache)
    }

    /// One latent frame through the decoder: middle, then levels, then head.
    fn decode_chunk<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        cache.rewind();
        let x = self.conv1.forward_cached(g, x, cache);
        let x = self.run_middle(g, x, cache);
        let x = self.run_levels(g, x, cache, chunk_idx);
        self.run_head(g, x, cache)
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
        let z2 = cfg.z_dim * 2;
        let encoder = (!cfg.decode_only).then(|| (Network::encoder(s, cfg, shape_of), Conv::new(s, "conv1", z2, z2, 1, 0, cfg.is_2d)));
        let decoder = Network::decoder(s, cfg, shape_of);
        let conv2 = Conv::new(s, "conv2", cfg.z_dim, cfg.z_dim, 1, 0, cfg.is_2d);
        WanVae { cfg: cfg.clone(), encoder, decoder, conv2 }
    }

    pub fn has_encoder(&self) -> bool {
        self.encoder.is_some()
    }

    /// Frames `[W, H, T, C]` in [-1, 1] → latent mean `[W/8, H/8, 1 + (T-1)/4, z]`.
    pub fn encode_graph<'g>(&self, g: &'g Graph, x: T<'g>) -> Result<T<'g>> {
        let (enc, conv1) = self.encoder.as_ref().ok_or_else(|| crate::error::Error::new("this VAE was loaded for decoding only"))?;
        let t = x.ne()[2];
        if t > 1 && self.cfg.is_2d {
            sd_warn!("Using 2D VAE to encode video, expect poor results");
        }
        let mut cache = FeatCache::new();
        let mut out = enc.encode_chunk(g, frames(x, 0, 1), &mut cache, 0);
        for i in 1..=((t - 1) / 4) as usize {
            // The 2-D variant keeps only the first of each 4 frames.
            let start = 1 + 4 * (i as i64 - 1);
            let end = if self.cfg.is_2d { start + 1 } else { start + 4 };
            let part = enc.encode_chunk(g, frames(x, start, end), &mut cache, i);
            out = out.concat(part, 2);
        }
        let out = conv1.forward(g, out, None);
        Ok(chunk(out, 2, 3, true)[0])
    }

    /// Latent `[w, h, T, z]` → frames `[8w, 8h, T', C]` in about [-1, 1] (unclamped):
    /// `T' = 1 + 4(T-1)` (the 2-D variant repeats each later frame 4 times).
    pub fn decode_graph<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let t = z.ne()[2];
        if t > 1 && self.cfg.is_2d {
            sd_warn!("Using 2D VAE to decode video, expect poor results");
        }
        let x = self.conv2.forward(g, z, None);
        let mut cache = FeatCache::new();
        let mut out = self.decoder.decode_chunk(g, frames(x, 0, 1), &mut cache, 0);
        for i in 1..t {
            let part = self.decoder.decode_chunk(g, frames(x, i, i + 1), &mut cache, i as usize);
            out = out.concat(part, 2);
            if self.cfg.is_2d {
                for _ in 0..3 {
                    out = out.concat(part, 2);
                }
            }
        }
        out
    }
}

/// Runs `f` on each batch item of `x` `[W, H, C, N]` as one frame `[W, H, 1, C]` and puts
/// the outputs (`[W', H', 1, C']`) back as `[W', H', C', N]`.
fn per_item(x: &Tensor, mut f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
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

/// Runs the encoder: image `[W, H, C, N]` in [-1, 1] → latent mean `[W/8, H/8, z, N]`.
pub fn encode(runner: &mut Runner, vae: &WanVae, image: &Tensor) -> Result<Tensor> {
    super::autoencoder_kl::check_input(image, vae.cfg.in_channels, SCALE, "vae encode")?;
    per_item(image, |frame| runner.compute(|g| vae.encode_graph(g, g.input(frame))))
}

/// Runs the decoder: VAE-space latent `[w, h, z, N]` → image `[8w, 8h, C, N]`, unclamped.
pub fn decode(runner: &mut Runner, vae: &WanVae, latent: &Tensor) -> Result<Tensor> {
    super::autoencoder_kl::check_input(latent, vae.cfg.z_dim, 1, "vae decode")?;
    per_item(latent, |frame| runner.compute(|g| Ok(vae.decode_graph(g, g.input(frame)))))
}

/// Types of every weight the Wan2.1 VAE declares, for tests (f16 kernels, f32 the rest).
#[cfg(test)]
pub(crate) fn declared_names(cfg: &WanVaeConfig) -> Vec<String> {
    let mut store = crate::graph::ParamStore::new(4096).expect("store");
    let types = crate::graph::TypeMap::new();
    WanVae::new(&mut Scope::new(&mut store, &types, super::autoencoder_kl::PREFIX), cfg, &|_| None);
    store.entries().map(|e| e.0.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The declared names are the reference's (and the synthetic file's): 2 × 11 encoder
    /// levels and 15 decoder levels, time convolutions at the temporal resamplers.
    #[test]
    fn declares_the_reference_layout() {
        let names = declared_names(&WanVaeConfig::wan21(false));
        let has = |n: &str| names.iter().any(|x| x == &format!("first_stage_model.{n}"));
        for n in [
            "encoder.conv1.weight",
            "encoder.downsamples.2.resample.1.weight",
            "encoder.downsamples.5.time_conv.bias",
            "encoder.downsamples.10.residual.6.weight",
            "encoder.middle.1.to_qkv.weight",
            "encoder.head.2.bias",
            "conv1.weight",
            "conv2.weight",
            "decoder.upsamples.3.time_conv.weight",
            "decoder.upsamples.4.shortcut.weight",
            "decoder.upsamples.11.resample.1.weight",
            "decoder.upsamples.14.residual.3.gamma",
            "decoder.head.0.gamma",
        ] {
            assert!(has(n), "{n}");
        }
        assert!(!has("encoder.downsamples.2.time_conv.weight") && !has("decoder.upsamples.11.time_conv.weight"));
        assert!(!has("decoder.upsamples.15.residual.0.gamma"));
        let decode_only = declared_names(&WanVaeConfig::wan21(true));
        assert!(decode_only.iter().all(|n| !n.contains("encoder.") && n != "first_stage_model.conv1.weight"));
    }

    /// The video path on a narrow VAE (dim 4): 5 frames encode to 2 latent frames (the first
    /// alone, then 4 halved twice in time) and decode back to 5, through the feature caches
    /// and the time convolutions; the first frame does not depend on the later ones.
    #[test]
    fn video_frames_round_trip_in_shape() {
        use crate::graph::{Backend, ParamStore, Runner, TypeMap};
        let cfg = WanVaeConfig { dim: 4, ..WanVaeConfig::wan21(false) };
        let mut store = ParamStore::new(1024).unwrap();
        let vae = WanVae::new(&mut Scope::new(&mut store, &TypeMap::new(), ""), &cfg, &|_| None);
        let backend = std::sync::Arc::new(Backend::cpu().unwrap());
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let seed = name.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
                let v: Vec<f32> = crate::testutil::pattern(n, seed).iter().map(|x| if name.ends_with("gamma") { 1.0 + x * 0.05 } else { x * 0.2 }).collect();
                if spec.ty == F16 {
                    let mut h = vec![0u16; n];
                    // SAFETY: h holds n values.
                    unsafe { ggml_sys::ggml_fp32_to_fp16_row(v.as_ptr(), h.as_mut_ptr(), n as i64) };
                    dst.copy_from_slice(&h.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                } else {
                    dst.copy_from_slice(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                }
                Ok(())
            })
            .unwrap();
        let mut runner = Runner::new(backend, 2);
        let video = crate::testutil::pattern(16 * 16 * 5 * 3, 9);
        let z = runner.compute(|g| vae.encode_graph(g, g.input_f32(&video, &[16, 16, 5, 3]))).unwrap();
        assert_eq!(z.shape(), &[2, 2, 2, 16]);
        let first = runner.compute(|g| vae.encode_graph(g, g.input_f32(&video[..16 * 16], &[16, 16, 1, 1]).concat(g.input_f32(&video[16 * 16 * 5..16 * 16 * 6], &[16, 16, 1, 1]), 3).concat(g.input_f32(&video[16 * 16 * 10..16 * 16 * 11], &[16, 16, 1, 1]), 3))).unwrap();
        assert_eq!(first.shape(), &[2, 2, 1, 16]);
        let out = runner.compute(|g| Ok(vae.decode_graph(g, g.input(&z)))).unwrap();
        assert_eq!(out.shape(), &[16, 16, 5, 3]);
        assert!(out.data().iter().chain(z.data()).all(|v| v.is_finite()));
        // The first latent frame is the first frame's alone.
        for c in 0..16 {
            assert_eq!(z.data()[c * 8..c * 8 + 4], first.data()[c * 4..c * 4 + 4], "channel {c}");
        }
    }

    #[test]
    fn frame_slices() {
        use crate::graph::{Backend, Runner};
        let data: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let mut runner = Runner::new(std::sync::Arc::new(Backend::cpu().unwrap()), 1);
        let out = runner.compute(|g| Ok(last_frames(g.input_f32(&data, &[2, 1, 3, 2]), 2))).unwrap();
        assert_eq!(out.data(), &[2., 3., 4., 5., 8., 9., 10., 11.]);
        let out = runner.compute(|g| Ok(frames(g.input_f32(&data, &[2, 1, 3, 2]), 0, 1))).unwrap();
        assert_eq!(out.data(), &[0., 1., 6., 7.]);
    }
}
