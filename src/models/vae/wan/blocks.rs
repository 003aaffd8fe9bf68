//! The Wan VAEs' layers and the feature cache their causal convolutions share.
//!
//! Tensors are `[W, H, T, C]` (one batch item). A causal convolution pads time with two zero
//! frames in front (or the frames the previous chunk left in its cache slot) and none behind;
//! the product covers the zero frames too, like the reference, so the sums are its sums.
//! Every cached convolution owns a fixed slot of the [`FeatCache`], numbered when the network
//! is declared, so a graph that runs only part of a network touches only that part's slots.

use super::WanVaeConfig;
use crate::models::vae::feat_cache::{f16_columns, FeatCache};
use crate::graph::nn::{self, pad_circular, Conv2d};
use crate::graph::{Graph, Scope, F16, F32, T, W};

/// Frames of the previous chunk a causal convolution keeps.
pub(super) const CACHE_T: i64 = 2;

pub(crate) type ShapeOf<'a> = &'a dyn Fn(&str) -> Option<Vec<i64>>;

/// What the layers' constructors share: the configuration, the files' shapes (the norms keep
/// theirs) and the next free cache slot.
pub(super) struct Build<'a> {
    pub cfg: &'a WanVaeConfig,
    pub shape_of: ShapeOf<'a>,
    next_slot: usize,
}

impl<'a> Build<'a> {
    pub fn new(cfg: &'a WanVaeConfig, shape_of: ShapeOf<'a>) -> Build<'a> {
        Build { cfg, shape_of, next_slot: 0 }
    }

    fn slot(&mut self) -> usize {
        self.next_slot += 1;
        self.next_slot - 1
    }

    /// The slots numbered so far (one network's), restarting from 0 for the next network.
    pub fn take_slots(&mut self) -> usize {
        std::mem::take(&mut self.next_slot)
    }
}

/// The last `n` frames of `x` `[W, H, T, C]` (all of them when it has one, as the reference).
pub(super) fn last_frames<'g>(x: T<'g>, n: i64) -> T<'g> {
    let t = x.ne()[2];
    if t == 1 {
        return x;
    }
    frames(x, (t - n).max(0), t)
}

/// Frames `start..end` of `x` `[W, H, T, C]`, dense (`x` itself when it has one frame).
pub(super) fn frames<'g>(x: T<'g>, start: i64, end: i64) -> T<'g> {
    let [w, h, t, c] = x.ne();
    if t == 1 {
        return x;
    }
    let nb = x.nb();
    x.view(&[w, h, end - start, c], &[nb[1], nb[2], nb[3]], start as usize * nb[2]).cont()
}

/// The frames to keep after a convolution over `x`: its last two, or its last one after the
/// previous chunk's last one.
fn frames_to_keep<'g>(prev: Option<T<'g>>, x: T<'g>) -> T<'g> {
    let keep = last_frames(x, CACHE_T);
    match prev {
        Some(p) if keep.ne()[2] < CACHE_T => last_frames(p, 1).concat(keep, 2),
        _ => keep,
    }
}

/// A convolution that only looks back in time (kernel `(kd, kh, kw)`, padding `(pd, ph,
/// pw)`: `2·pd` frames in front, `ph`/`pw` on both sides in space).
#[derive(Clone, Copy, Debug)]
pub(super) struct CausalConv3d {
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
        let front = 2 * pd;
        // Zero padding in space is the convolution's own (no padded copy); wrapping padding
        // is made here, frame by frame.
        let circular = g.options.circular_x || g.options.circular_y;
        let (space, padding) = if circular { ([pw, ph], [0; 3]) } else { ([0, 0], [pw, ph, 0]) };
        let pad = |t: T<'g>, front: i32| pad_circular(g, t, [space[0], space[1], front, 0], [space[0], space[1], 0, 0]);
        let (w, b) = (g.param(self.weight), Some(g.param(self.bias)));
        let [sd, sh, sw] = self.stride;
        match cache.filter(|_| front > 0) {
            // The cached frames lead, after the zero frames they lack; read where they are.
            Some(c) if self.stride == [1; 3] => {
                let missing = (front - c.ne()[2] as i32).max(0);
                nn::conv_3d_after(g, pad(c, missing), pad(x, 0), w, b, self.in_ch, padding)
            }
            Some(c) => nn::conv_3d(g, pad(c.concat(x, 2), (front - c.ne()[2] as i32).max(0)), w, b, self.in_ch, [sw, sh, sd], padding, [1; 3]),
            None if self.stride == [1; 3] && !circular => nn::conv_3d_zero_front(g, front, x, w, b, self.in_ch, padding),
            None => nn::conv_3d(g, pad(x, front), w, b, self.in_ch, [sw, sh, sd], padding, [1; 3]),
        }
    }
}

/// A 3-D causal convolution, or in the 2-D variant a 2-D one over each frame.
#[derive(Clone, Copy, Debug)]
pub(super) enum Conv {
    Causal(CausalConv3d),
    Flat(Conv2d),
}

impl Conv {
    /// Kernel `k`×`k`(×`k` frames), padding `p` all round (causal in time).
    pub fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, k: i64, p: i32, is_2d: bool) -> Conv {
        if is_2d {
            Conv::Flat(Conv2d::square(s, name, in_ch, out_ch, k, 1, p))
        } else {
            Conv::Causal(CausalConv3d::new(s, name, in_ch, out_ch, [k; 3], [1; 3], [p; 3]))
        }
    }

    /// Without a cache (1×1×1 kernels, shortcuts).
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            Conv::Causal(c) => c.forward(g, x, None),
            Conv::Flat(c) => c.forward(g, x.permute_axes([0, 1, 3, 2]).cont()).permute_axes([0, 1, 3, 2]).cont(),
        }
    }
}

/// A convolution that continues from its cache slot and leaves its input's last frames
/// there. The 2-D variant's convolutions see one frame at a time and keep nothing.
#[derive(Clone, Copy, Debug)]
pub(super) struct CachedConv {
    conv: Conv,
    slot: usize,
}

impl CachedConv {
    pub fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, k: i64, p: i32, b: &mut Build) -> CachedConv {
        let conv = Conv::new(s, name, in_ch, out_ch, k, p, b.cfg.is_2d);
        let slot = if b.cfg.is_2d { usize::MAX } else { b.slot() };
        CachedConv { conv, slot }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        let Conv::Causal(c) = &self.conv else { return self.conv.forward(g, x) };
        let prev = cache.get(self.slot);
        let keep = frames_to_keep(prev, x);
        let out = c.forward(g, x, prev);
        cache.set(self.slot, keep, f16_columns(g.param(c.weight)));
        out
    }
}

/// RMS normalisation over the channels (`F.normalize · √C · γ`, as ggml's RMS norm).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RmsNorm {
    gamma: W,
}

impl RmsNorm {
    /// `gamma` in the shape the files hold it (`[C]` when absent).
    pub fn new(s: &mut Scope, name: &str, dim: i64, shape_of: ShapeOf) -> RmsNorm {
        let mut s = s.sub(name);
        let ne = shape_of(&s.full_name("gamma")).filter(|ne| ne.iter().product::<i64>() == dim && ne.len() <= 4).unwrap_or_else(|| vec![dim]);
        RmsNorm { gamma: s.tensor("gamma", F32, &ne) }
    }

    /// x `[W, H, T, C]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gamma = g.param(self.gamma);
        let gamma = gamma.reshape(&[gamma.ne().iter().product()]);
        if let Some(y) = nn::rms_norm_channels(g, x, gamma, 1e-12) {
            return y;
        }
        let h = x.permute_axes([3, 0, 1, 2]).contiguous().rms_norm(1e-12).mul(gamma);
        h.permute_axes([1, 2, 3, 0]).contiguous()
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct ResidualBlock {
    norm1: RmsNorm,
    conv1: CachedConv,
    norm2: RmsNorm,
    conv2: CachedConv,
    shortcut: Option<Conv>,
}

impl ResidualBlock {
    pub fn new(s: &mut Scope, name: &str, in_dim: i64, out_dim: i64, b: &mut Build) -> ResidualBlock {
        let mut s = s.sub(name);
        ResidualBlock {
            norm1: RmsNorm::new(&mut s, "residual.0", in_dim, b.shape_of),
            conv1: CachedConv::new(&mut s, "residual.2", in_dim, out_dim, 3, 1, b),
            norm2: RmsNorm::new(&mut s, "residual.3", out_dim, b.shape_of),
            conv2: CachedConv::new(&mut s, "residual.6", out_dim, out_dim, 3, 1, b),
            shortcut: (in_dim != out_dim).then(|| Conv::new(&mut s, "shortcut", in_dim, out_dim, 1, 0, b.cfg.is_2d)),
        }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>) -> T<'g> {
        let skip = match &self.shortcut {
            Some(c) => c.forward(g, x),
            None => x,
        };
        let h = self.norm1.forward(g, x).silu();
        let h = self.conv1.forward(g, h, cache);
        let h = self.norm2.forward(g, h).silu();
        let h = self.conv2.forward(g, h, cache);
        h.add(skip)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ResampleMode {
    Up2d,
    Up3d,
    Down2d,
    Down3d,
}

/// Spatial up/downsampling (a 2-D convolution per frame), with a time convolution that
/// doubles (up) or halves (down) the frames from the second chunk on.
#[derive(Clone, Copy, Debug)]
pub(super) struct Resample {
    pub mode: ResampleMode,
    conv: Conv2d,
    time_conv: Option<(CausalConv3d, usize)>,
}

impl Resample {
    /// Wan2.1's upsamplers halve the channels; Wan2.2's keep them (`keep_channels`).
    pub fn new(s: &mut Scope, name: &str, dim: i64, mode: ResampleMode, keep_channels: bool, b: &mut Build) -> Resample {
        let mut s = s.sub(name);
        let up_out = if keep_channels { dim } else { dim / 2 };
        let conv = match mode {
            ResampleMode::Up2d | ResampleMode::Up3d => Conv2d::square(&mut s, "resample.1", dim, up_out, 3, 1, 1),
            ResampleMode::Down2d | ResampleMode::Down3d => Conv2d::square(&mut s, "resample.1", dim, dim, 3, 2, 0),
        };
        let time_conv = match mode {
            ResampleMode::Up3d => Some((CausalConv3d::new(&mut s, "time_conv", dim, dim * 2, [3, 1, 1], [1; 3], [1, 0, 0]), b.slot())),
            ResampleMode::Down3d => Some((CausalConv3d::new(&mut s, "time_conv", dim, dim, [3, 1, 1], [2, 1, 1], [0; 3]), b.slot())),
            _ => None,
        };
        Resample { mode, conv, time_conv }
    }

    /// The first chunk (`chunk_idx` 0) passes its one frame through the upsamplers' time
    /// convolution untouched and leaves the slot empty; the first time the slot is read
    /// empty, zero frames stand for the missing history.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        let mut x = x;
        if let (ResampleMode::Up3d, Some((tc, slot)), true) = (self.mode, &self.time_conv, chunk_idx > 0) {
            let prev = cache.get(*slot);
            let mut keep = frames_to_keep(prev, x);
            if prev.is_none() && keep.ne()[2] < CACHE_T {
                let n = keep.ne()[2] as i32;
                keep = keep.pad_ext([0, 0, n, 0], [0; 4]);
            }
            let y = tc.forward(g, x, prev);
            cache.set(*slot, keep, f16_columns(g.param(tc.weight)));
            // [W, H, T, 2C] → [W, H, 2T, C]: the two halves of the channels become
            // consecutive frames.
            let [w, h, t, c2] = y.ne();
            let c = c2 / 2;
            x = y.reshape(&[w * h, t, c, 2]).permute_axes([0, 3, 1, 2]).contiguous().reshape(&[w, h, 2 * t, c]);
        }
        let up = matches!(self.mode, ResampleMode::Up2d | ResampleMode::Up3d);
        // Upsampled frames convolved where they are (Winograd), or moved behind the channels
        // for the per-image convolution and back.
        if let Some(y) = up.then(|| self.conv.forward_frames(g, x.upscale(2))).flatten() {
            return y;
        }
        let mut y = x.permute_axes([0, 1, 3, 2]).contiguous();
        y = if up {
            y.upscale(2)
        } else {
            // torch pads (0, 1, 0, 1): one column right, one row at the bottom.
            pad_circular(g, y, [0; 4], [1, 1, 0, 0])
        };
        let mut x = self.conv.forward(g, y).permute_axes([0, 1, 3, 2]).contiguous();
        if let (ResampleMode::Down3d, Some((tc, slot))) = (self.mode, &self.time_conv) {
            match cache.get(*slot) {
                // The first chunk only remembers its output.
                None => cache.set(*slot, x, f16_columns(g.param(tc.weight))),
                Some(prev) => {
                    let keep = last_frames(x, 1);
                    x = tc.forward(g, last_frames(prev, 1).concat(x, 2), None);
                    cache.set(*slot, keep, f16_columns(g.param(tc.weight)));
                }
            }
        }
        x
    }
}

/// Single-head self-attention over each frame's pixels.
#[derive(Clone, Copy, Debug)]
pub(super) struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: Conv2d,
    proj: Conv2d,
}

impl AttentionBlock {
    pub fn new(s: &mut Scope, name: &str, dim: i64, shape_of: ShapeOf) -> AttentionBlock {
        let mut s = s.sub(name);
        AttentionBlock {
            norm: RmsNorm::new(&mut s, "norm", dim, shape_of),
            to_qkv: Conv2d::square(&mut s, "to_qkv", dim, dim * 3, 1, 1, 0),
            proj: Conv2d::square(&mut s, "proj", dim, dim, 1, 1, 0),
        }
    }

    /// x `[W, H, T, C]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
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

/// Wan2.2's parameter-free downsampling shortcut: each `ft`×`fs`×`fs` block of a channel
/// becomes `ft·fs·fs` channels (time, then rows, then columns within the block), and each
/// output channel is the mean of `group` consecutive ones. Time is padded in front to a
/// multiple of `ft`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AvgDown3d {
    out_ch: i64,
    group: i64,
    ft: i64,
    fs: i64,
}

impl AvgDown3d {
    pub fn new(in_ch: i64, out_ch: i64, ft: i64, fs: i64) -> AvgDown3d {
        AvgDown3d { out_ch, group: in_ch * ft * fs * fs / out_ch, ft, fs }
    }

    /// x `[W, H, T, C]` → `[W/fs, H/fs, ⌈T/ft⌉, out]`.
    pub fn forward<'g>(&self, x: T<'g>) -> T<'g> {
        let (ft, fs) = (self.ft, self.fs);
        let pad_t = (ft - x.ne()[2] % ft) % ft;
        let x = x.pad_ext([0, 0, pad_t as i32, 0], [0; 4]);
        let [w, h, t, c] = x.ne();
        let (w2, h2, t2) = (w / fs, h / fs, t / ft);
        // Memory order (fastest first): x-in-block, w', y-in-block, h', t-in-block, t', c.
        let x = x.reshape(&[fs, w2, fs, h2 * t * c]).permute_axes([0, 2, 1, 3]).cont();
        // → x-in-block, y-in-block, w', h', t-in-block, t', c
        let x = x.reshape(&[fs * fs, w2 * h2, ft, t2 * c]).permute_axes([0, 2, 1, 3]).cont();
        // → block offset, w', h', t', c
        let x = x.reshape(&[fs * fs * ft, w2 * h2 * t2, c, 1]).permute_axes([0, 2, 1, 3]).cont();
        // → (block offset, c) = (group member, out channel), pixel
        let x = x.reshape(&[self.group, self.out_ch, w2 * h2 * t2, 1]).permute_axes([0, 2, 1, 3]).cont();
        x.mean().reshape(&[w2, h2, t2, self.out_ch])
    }
}

/// Wan2.2's parameter-free upsampling shortcut: every channel repeated `repeats` times, each
/// run of `ft·fs·fs` channels spread over a `ft`×`fs`×`fs` block (the inverse layout of
/// [`AvgDown3d`]). The first chunk keeps only the block's last frame.
#[derive(Clone, Copy, Debug)]
pub(super) struct DupUp3d {
    out_ch: i64,
    repeats: i64,
    ft: i64,
    fs: i64,
}

impl DupUp3d {
    pub fn new(in_ch: i64, out_ch: i64, ft: i64, fs: i64) -> DupUp3d {
        DupUp3d { out_ch, repeats: out_ch * ft * fs * fs / in_ch, ft, fs }
    }

    /// x `[W, H, T, C]` → `[fs·W, fs·H, ft·T, out]` (`ft·T - ft + 1` frames for the first chunk).
    pub fn forward<'g>(&self, x: T<'g>, first_chunk: bool) -> T<'g> {
        let (ft, fs, out) = (self.ft, self.fs, self.out_ch);
        let [w, h, t, c] = x.ne();
        let x = x.reshape(&[w * h * t, 1, c, 1]).repeat_4d([w * h * t, self.repeats, c, 1]);
        // Memory order (fastest first): w, h, t, x-in-block, y-in-block, t-in-block, out.
        let x = x.reshape(&[w * h * t, fs, fs * ft, out]).permute_axes([1, 0, 2, 3]).cont();
        // → x-in-block, w, h, t, y-in-block, t-in-block, out
        let x = x.reshape(&[fs * w, h * t, fs, ft * out]).permute_axes([0, 2, 1, 3]).cont();
        // → x-in-block, w, y-in-block, h, t, t-in-block, out
        let x = x.reshape(&[fs * w * fs * h, t, ft, out]).permute_axes([0, 2, 1, 3]).cont();
        let x = x.reshape(&[fs * w, fs * h, ft * t, out]);
        if first_chunk && ft > 1 {
            frames(x, ft - 1, ft * t)
        } else {
            x
        }
    }
}

/// A Wan2.2 encoder level: residual blocks, an optional downsampler, plus the averaging
/// shortcut from the level's input.
#[derive(Clone, Debug)]
pub(super) struct DownStage {
    blocks: Vec<ResidualBlock>,
    down: Option<Resample>,
    shortcut: AvgDown3d,
}

impl DownStage {
    pub fn new(s: &mut Scope, name: &str, in_dim: i64, out_dim: i64, temporal: bool, down: bool, b: &mut Build) -> DownStage {
        let mut s = s.sub(name);
        let mut blocks = Vec::new();
        let mut ci = in_dim;
        for j in 0..b.cfg.num_res_blocks {
            blocks.push(ResidualBlock::new(&mut s, &format!("downsamples.{j}"), ci, out_dim, b));
            ci = out_dim;
        }
        let mode = if temporal { ResampleMode::Down3d } else { ResampleMode::Down2d };
        let name = format!("downsamples.{}", blocks.len());
        let down_layer = down.then(|| Resample::new(&mut s, &name, out_dim, mode, true, b));
        let (ft, fs) = (if temporal { 2 } else { 1 }, if down { 2 } else { 1 });
        DownStage { blocks, down: down_layer, shortcut: AvgDown3d::new(in_dim, out_dim, ft, fs) }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        let input = x;
        let mut x = x;
        for r in &self.blocks {
            x = r.forward(g, x, cache);
        }
        if let Some(d) = &self.down {
            x = d.forward(g, x, cache, chunk_idx);
        }
        x.add(self.shortcut.forward(input))
    }
}

/// A Wan2.2 decoder level: residual blocks and, except the last, an upsampler plus the
/// duplicating shortcut from the level's input.
#[derive(Clone, Debug)]
pub(super) struct UpStage {
    blocks: Vec<ResidualBlock>,
    up: Option<(Resample, DupUp3d)>,
}

impl UpStage {
    pub fn new(s: &mut Scope, name: &str, in_dim: i64, out_dim: i64, temporal: bool, up: bool, b: &mut Build) -> UpStage {
        let mut s = s.sub(name);
        let mut blocks = Vec::new();
        let mut ci = in_dim;
        for j in 0..b.cfg.num_res_blocks + 1 {
            blocks.push(ResidualBlock::new(&mut s, &format!("upsamples.{j}"), ci, out_dim, b));
            ci = out_dim;
        }
        let mode = if temporal { ResampleMode::Up3d } else { ResampleMode::Up2d };
        let name = format!("upsamples.{}", blocks.len());
        let up = up.then(|| {
            (Resample::new(&mut s, &name, out_dim, mode, true, b), DupUp3d::new(in_dim, out_dim, if temporal { 2 } else { 1 }, 2))
        });
        UpStage { blocks, up }
    }

    /// Whether this level doubles the frames.
    pub fn temporal(&self) -> bool {
        self.up.as_ref().is_some_and(|(r, _)| r.mode == ResampleMode::Up3d)
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cache: &mut FeatCache<'g>, chunk_idx: usize) -> T<'g> {
        let input = x;
        let mut x = x;
        for r in &self.blocks {
            x = r.forward(g, x, cache);
        }
        match &self.up {
            Some((resample, dup)) => {
                let x = resample.forward(g, x, cache, chunk_idx);
                x.add(dup.forward(input, chunk_idx == 0))
            }
            None => x,
        }
    }
}

/// Pixels `[p·w, p·h, T, C]` → `[w, h, T, C·p·p]`: each `p`×`p` block of a channel becomes
/// `p·p` channels, channel `c·p·p + column·p + row` (Wan2.2's `(c r q)` order).
pub(super) fn patchify<'g>(x: T<'g>, p: i64) -> T<'g> {
    if p == 1 {
        return x;
    }
    let [wp, hp, f, c] = x.ne();
    let (w, h) = (wp / p, hp / p);
    // Memory order (fastest first): column, w, row, h, f, c.
    let x = x.reshape(&[p, w, p, h * f * c]).permute_axes([1, 2, 0, 3]).contiguous();
    // → w, row, column, h, f, c
    let x = x.reshape(&[w, p * p, h, f * c]).permute_axes([0, 2, 1, 3]).contiguous();
    // → w, h, (row, column), f, c
    let x = x.reshape(&[w * h, p * p, f, c]).permute_axes([0, 2, 1, 3]).contiguous();
    x.reshape(&[w, h, f, p * p * c])
}

/// Inverse of [`patchify`].
pub(super) fn unpatchify<'g>(x: T<'g>, p: i64) -> T<'g> {
    if p == 1 {
        return x;
    }
    let [w, h, f, cpp] = x.ne();
    let c = cpp / (p * p);
    // Memory order (fastest first): w, h, f, row, column, c.
    let x = x.reshape(&[w * h, f, p * p, c]).permute_axes([0, 2, 1, 3]).contiguous();
    // → w, h, (row, column), f, c
    let x = x.reshape(&[w, h, p * p, f * c]).permute_axes([0, 2, 1, 3]).contiguous();
    // → w, row, column, h, f, c
    let x = x.reshape(&[w, p, p, h * f * c]).permute_axes([2, 0, 1, 3]).contiguous();
    x.reshape(&[p * w, p * h, f, c])
}
