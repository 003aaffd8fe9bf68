//! MiniMax-H3's VAE encoder (`encoder.`, `quant_conv`), which turns the keyframe pictures
//! into latents. Its sizes are fixed (the reference reads none from the weights): `conv_in`
//! to 128 channels, six levels of two residual blocks at 128·(1, 2, 2, 4, 4, 8) channels with
//! a downsampler after the first four (2× in space; 2× in time too after levels 1 and 2), a
//! group norm, SiLU and `conv_out` to 48 channels, `quant_conv` (1×1×1) and the first 24
//! channels (the means). Every 3×3×3 convolution is causal in time (zero frames in front)
//! and reflects the picture's edges in space; the group norms (32 groups) see one frame at
//! a time.

use crate::graph::nn::{self, GroupNorm};
use crate::graph::{Graph, Scope, F16, F32, T, W};

const WIDTH: i64 = 128;
const MULTIPLIERS: [i64; 6] = [1, 2, 2, 4, 4, 8];
const SPATIAL_DOWN: [i32; 6] = [2, 2, 2, 2, 1, 1];
const TEMPORAL_DOWN: [i32; 6] = [1, 2, 2, 1, 1, 1];
const MOMENTS: i64 = 48;

/// A convolution with the encoder's padding: `pad_t` (doubled) zero frames in front and
/// `pad_s` reflected pixels on each side.
#[derive(Clone, Copy, Debug)]
struct Conv {
    weight: W,
    bias: W,
    ic: i64,
    k: i64,
    stride: [i32; 3],
    pad_t: i32,
    pad_s: i32,
}

impl Conv {
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64, k: i64, stride: [i32; 3], pad_t: i32, pad_s: i32) -> Conv {
        let mut c = s.sub(name);
        Conv { weight: c.tensor("weight", F16, &[k, k, k, ic * oc]), bias: c.tensor("bias", F32, &[oc]), ic, k, stride, pad_t, pad_s }
    }

    /// 3×3×3 with one reflected pixel and two zero frames in front.
    fn causal(s: &mut Scope, name: &str, ic: i64, oc: i64) -> Conv {
        Conv::new(s, name, ic, oc, 3, [1; 3], 1, 1)
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = x;
        for _ in 0..self.pad_s {
            x = reflect(x, 0);
            x = reflect(x, 1);
        }
        if self.pad_t > 0 {
            x = x.pad_ext([0, 0, 2 * self.pad_t, 0], [0; 4]);
        }
        debug_assert!(self.k == 1 || self.k == 3);
        nn::conv_3d(g, x, g.param(self.weight), Some(g.param(self.bias)), self.ic, self.stride, [0; 3], [1; 3])
    }
}

/// Slice `i` (one wide) of `x` along `axis` (0 or 1).
fn at<'g>(x: T<'g>, axis: usize, i: i64) -> T<'g> {
    let mut ne = x.ne();
    let nb = x.nb();
    ne[axis] = 1;
    x.view(&ne, &[nb[1], nb[2], nb[3]], i as usize * nb[axis])
}

/// `x` with one more pixel on each side of `axis`, mirrored about the edge pixel.
fn reflect<'g>(x: T<'g>, axis: usize) -> T<'g> {
    let n = x.ne()[axis];
    at(x, axis, 1).concat(x, axis as i32).concat(at(x, axis, n - 2), axis as i32)
}

/// Group norm (32 groups) of each frame of `x` `[W, H, T, C]` on its own.
fn frame_norm<'g>(g: &'g Graph, norm: &GroupNorm, x: T<'g>) -> T<'g> {
    let y = norm.forward(g, x.permute(0, 1, 3, 2).cont());
    y.permute(0, 1, 3, 2).cont()
}

#[derive(Clone, Copy, Debug)]
struct ResBlock {
    norm1: GroupNorm,
    conv1: Conv,
    norm2: GroupNorm,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl ResBlock {
    fn new(s: &mut Scope, ic: i64, oc: i64) -> ResBlock {
        ResBlock {
            norm1: GroupNorm::gn32(s, "norm1", ic),
            conv1: Conv::causal(s, "conv1", ic, oc),
            norm2: GroupNorm::gn32(s, "norm2", oc),
            conv2: Conv::causal(s, "conv2", oc, oc),
            shortcut: (ic != oc).then(|| Conv::new(s, "nin_shortcut", ic, oc, 1, [1; 3], 0, 0)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.conv1.forward(g, frame_norm(g, &self.norm1, x).silu());
        let h = self.conv2.forward(g, frame_norm(g, &self.norm2, h).silu());
        let x = match &self.shortcut {
            Some(c) => c.forward(g, x),
            None => x,
        };
        x.add(h)
    }
}

/// A level's downsampler: the picture grown by one reflected pixel on the right and at the
/// bottom, then a strided causal convolution without spatial padding.
#[derive(Clone, Copy, Debug)]
struct Down {
    conv: Conv,
    spatial: i32,
}

impl Down {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = x;
        if self.spatial == 2 {
            let w = x.ne()[0];
            x = x.concat(at(x, 0, w - 2), 0);
            let h = x.ne()[1];
            x = x.concat(at(x, 1, h - 2), 1);
        }
        self.conv.forward(g, x)
    }
}

#[derive(Clone, Debug)]
pub(super) struct Encoder {
    conv_in: Conv,
    levels: Vec<([ResBlock; 2], Option<Down>)>,
    norm_out: GroupNorm,
    conv_out: Conv,
    quant: Conv,
}

impl Encoder {
    /// `s`: the VAE's scope (`encoder.` and `quant_conv` under it).
    pub(super) fn new(s: &mut Scope) -> Encoder {
        let mut e = s.sub("encoder");
        let conv_in = Conv::causal(&mut e, "conv_in", 3, WIDTH);
        let mut previous = WIDTH;
        let mut levels = Vec::new();
        for level in 0..MULTIPLIERS.len() {
            let current = WIDTH * MULTIPLIERS[level];
            let mut d = e.sub(&format!("down.{level}"));
            let blocks = [ResBlock::new(&mut d.sub("block.0"), previous, current), ResBlock::new(&mut d.sub("block.1"), current, current)];
            let (ts, ss) = (TEMPORAL_DOWN[level], SPATIAL_DOWN[level]);
            let down = (ts * ss > 1).then(|| Down { conv: Conv::new(&mut d.sub("downsample"), "conv", current, current, 3, [ss, ss, ts], 1, 0), spatial: ss });
            levels.push((blocks, down));
            previous = current;
        }
        let norm_out = GroupNorm::gn32(&mut e, "norm_out", previous);
        let conv_out = Conv::causal(&mut e, "conv_out", previous, MOMENTS);
        let quant = Conv::new(s, "quant_conv", MOMENTS, MOMENTS, 1, [1; 3], 0, 0);
        Encoder { conv_in, levels, norm_out, conv_out, quant }
    }

    /// Normalised pixels `[W, H, T, 3]` → VAE-space latent means `[W/16, H/16, t, 24]`.
    pub(super) fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.conv_in.forward(g, x);
        for (blocks, down) in &self.levels {
            for b in blocks {
                x = b.forward(g, x);
            }
            if let Some(d) = down {
                x = d.forward(g, x);
            }
        }
        let x = self.conv_out.forward(g, frame_norm(g, &self.norm_out, x).silu());
        let moments = self.quant.forward(g, x);
        let [w, h, t, _] = moments.ne();
        let nb = moments.nb();
        moments.view(&[w, h, t, super::CHANNELS as i64], &[nb[1], nb[2], nb[3]], 0).cont()
    }
}
