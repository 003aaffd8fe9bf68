//! BigVGAN, the vocoder behind the audio VAEs (MiniMax-H3's decoder, LTX-2.3's vocoder and its
//! bandwidth extension): a 7-tap convolution, transposed convolutions that upsample by their
//! rates, each followed by the mean of three residual stacks (kernels 3, 7, 11, dilations 1,
//! 3, 5) of anti-aliased snake activations (×2 up through a 12-tap filter,
//! `x + sin²(αx)/(β + ε)` with α, β stored as logarithms, low-passed ×2 down), then the
//! activation and a 7-tap convolution to the output channels.
//!
//! The graphs are the reference's op for op: ggml's 1-D convolutions (f16 im2col), filters
//! reversed and signals padded by slices and concatenations, so the samples are the reference's.
//! The files name the same pieces differently; [`Names`] says how.

use crate::graph::{GgmlType, Graph, Scope, F16, F32, T, W};

/// The anti-aliasing filters' taps and rates.
const FILTER_TAPS: i64 = 12;
const RATIO: i32 = 2;
/// Added to the snake's β before dividing (the reference's epsilon).
const SNAKE_EPS: f32 = 1e-9;
/// The residual stacks' kernels and dilations.
pub const RES_KERNELS: [i32; 3] = [3, 7, 11];
const DILATIONS: [i32; 3] = [1, 3, 5];

/// `x[start..end]` along `dim`, copied (the reference's slice); a dimension of one is kept whole.
pub fn slice<'g>(x: T<'g>, dim: usize, start: i64, end: i64) -> T<'g> {
    let ne = x.ne();
    if ne[dim] == 1 {
        return x;
    }
    let nb = x.nb();
    let mut shape = ne;
    shape[dim] = end - start;
    x.view(&shape, &[nb[1], nb[2], nb[3]], start as usize * nb[dim]).cont()
}

/// Copies of the first and last sample in front of and behind `x` `[L, C, ..]`.
pub fn replicate_pad<'g>(x: T<'g>, left: i64, right: i64) -> T<'g> {
    let mut x = x;
    if left > 0 {
        let first = slice(x, 0, 0, 1);
        let [_, c, n, m] = first.ne();
        x = first.repeat_4d([left, c, n, m]).concat(x, 0);
    }
    if right > 0 {
        let len = x.ne()[0];
        let last = slice(x, 0, len - 1, len);
        let [_, c, n, m] = last.ne();
        x = x.concat(last.repeat_4d([right, c, n, m]), 0);
    }
    x
}

/// Transposed depthwise convolution of `x` `[L, C, 1, 1]` by `stride` through the filter
/// `[K, 1, 1]`, as the reference builds it: the samples spread with zeros between, convolved
/// with the reversed filter, scaled by the stride. Gives `[(L - 1)·stride + K, C, 1, 1]`.
pub fn depthwise_upsample<'g>(x: T<'g>, filter: T<'g>, stride: i64) -> T<'g> {
    let [time, channels, _, _] = x.ne();
    let k = filter.ne()[0];
    let flat = x.reshape(&[1, time, channels]);
    let mut spread = flat;
    if stride > 1 {
        let zero = flat.scale(0.0);
        let mut zeros = zero;
        for _ in 1..stride - 1 {
            zeros = zeros.concat(zero, 0);
        }
        spread = flat.concat(zeros, 0);
    }
    let spread = spread.reshape(&[time * stride, 1, channels]);
    let mut reversed = slice(filter, 0, k - 1, k);
    for i in (0..k - 1).rev() {
        reversed = reversed.concat(slice(filter, 0, i, i + 1), 0);
    }
    let out_time = (time - 1) * stride + k;
    let mut out = reversed.conv_1d(spread, 1, (k - 1) as i32, 1);
    if out.ne()[0] > out_time {
        out = slice(out, 0, 0, out_time);
    }
    out.scale(stride as f32).reshape(&[out_time, channels, 1, 1])
}

/// The convolutions' weight type: the file's, bf16 read as f16 (the reference's rule).
fn conv_type(s: &Scope, leaf: &str) -> GgmlType {
    match s.file_type(leaf) {
        Some(t) if t == ggml_sys::GGML_TYPE_BF16 => F16,
        Some(t) => t,
        None => F16,
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Conv1d {
    weight: W,
    bias: Option<W>,
    padding: i32,
    dilation: i32,
    stride: i32,
}

impl Conv1d {
    #[allow(clippy::too_many_arguments)]
    pub fn new(s: &mut Scope, name: &str, ic: i64, oc: i64, k: i32, padding: i32, dilation: i32, bias: bool) -> Conv1d {
        let mut s = s.sub(name);
        let ty = conv_type(&s, "weight");
        let weight = s.tensor("weight", ty, &[k as i64, ic, oc]);
        let bias = bias.then(|| s.tensor("bias", F32, &[oc]));
        Conv1d { weight, bias, padding, dilation, stride: 1 }
    }

    /// The same convolution with a stride.
    pub fn strided(self, stride: i32) -> Conv1d {
        Conv1d { stride, ..self }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = g.param(self.weight).conv_1d(x, self.stride, self.padding, self.dilation);
        match self.bias {
            Some(b) => x.add_inplace(g.param(b).reshape(&[1, b.ne()[0], 1, 1])),
            None => x,
        }
    }
}

/// A transposed convolution by its stride, cropped by `(k - stride) / 2` on each side.
#[derive(Clone, Copy, Debug)]
struct ConvTranspose1d {
    weight: W,
    bias: W,
    stride: i32,
    padding: i64,
}

impl ConvTranspose1d {
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64, k: i32, stride: i32) -> ConvTranspose1d {
        let mut s = s.sub(name);
        let weight = s.tensor("weight", F32, &[k as i64, oc, ic]);
        let bias = s.tensor("bias", F32, &[oc]);
        ConvTranspose1d { weight, bias, stride, padding: ((k - stride) / 2) as i64 }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = g.param(self.weight).conv_transpose_1d(x, self.stride);
        if self.padding > 0 {
            let len = x.ne()[0];
            x = slice(x, 0, self.padding, len - self.padding);
        }
        x.add_inplace(g.param(self.bias).reshape(&[1, self.bias.ne()[0], 1, 1]))
    }
}

/// The anti-aliased snake activation.
#[derive(Clone, Copy, Debug)]
struct Activation {
    alpha: W,
    beta: W,
    up: W,
    down: W,
}

impl Activation {
    fn new(s: &mut Scope, name: &str, channels: i64) -> Activation {
        let mut s = s.sub(name);
        let (alpha, beta) = {
            let mut a = s.sub("act");
            (a.tensor("alpha", F32, &[channels]), a.tensor("beta", F32, &[channels]))
        };
        let up = s.tensor("upsample.filter", F32, &[FILTER_TAPS, 1, 1]);
        let down_ty = conv_type(&s, "downsample.lowpass.filter");
        let down = s.tensor("downsample.lowpass.filter", down_ty, &[FILTER_TAPS, 1, 1]);
        Activation { alpha, beta, up, down }
    }

    fn snake<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let c = self.alpha.ne()[0];
        let alpha = g.param(self.alpha).exp().reshape(&[1, c, 1, 1]);
        let beta = g.param(self.beta).exp().reshape(&[1, c, 1, 1]);
        let s = x.mul(alpha).sin();
        let s = s.mul(s);
        let eps = g.input_f32(&[SNAKE_EPS], &[1, 1, 1, 1]);
        x.add(s.div(beta.add(eps)))
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let ratio = RATIO as i64;
        let pad = FILTER_TAPS / ratio - 1;
        let crop_left = pad * ratio + (FILTER_TAPS - ratio) / 2;
        let crop_right = pad * ratio + (FILTER_TAPS - ratio + 1) / 2;
        let x = replicate_pad(x, pad, pad);
        let x = depthwise_upsample(x, g.param(self.up), ratio);
        let len = x.ne()[0];
        let x = self.snake(g, slice(x, 0, crop_left, len - crop_right));
        let left = FILTER_TAPS / 2 - if FILTER_TAPS % 2 == 0 { 1 } else { 0 };
        let x = replicate_pad(x, left, FILTER_TAPS / 2);
        let channels = x.ne()[1];
        let tiled = g.param(self.down).reshape(&[FILTER_TAPS, 1, 1, 1]).repeat_4d([FILTER_TAPS, 1, channels, 1]);
        let out = tiled.conv_1d_dw(x, RATIO, 0, 1);
        let [l, c, _, _] = out.ne();
        out.reshape(&[l, c, 1, 1])
    }
}

/// Three residual pairs of (activation, dilated convolution, activation, convolution).
#[derive(Clone, Debug)]
struct AmpBlock {
    /// The activations before the first and the second convolution of each pair.
    acts: Vec<(Activation, Activation)>,
    convs1: Vec<Conv1d>,
    convs2: Vec<Conv1d>,
}

impl AmpBlock {
    fn new(s: &mut Scope, names: &Names, channels: i64, k: i32) -> AmpBlock {
        let acts = (0..3).map(|i| (Activation::new(s, &(names.act)(i, 0), channels), Activation::new(s, &(names.act)(i, 1), channels))).collect();
        let convs1 = (0..3)
            .map(|i| Conv1d::new(s, &format!("convs1.{i}"), channels, channels, k, (k * DILATIONS[i] - DILATIONS[i]) / 2, DILATIONS[i], true))
            .collect();
        let convs2 = (0..3).map(|i| Conv1d::new(s, &format!("convs2.{i}"), channels, channels, k, k / 2, 1, true)).collect();
        AmpBlock { acts, convs1, convs2 }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = x;
        for (i, (a1, a2)) in self.acts.iter().enumerate() {
            let h = self.convs1[i].forward(g, a1.forward(g, x));
            let h = self.convs2[i].forward(g, a2.forward(g, h));
            x = x.add(h);
        }
        x
    }
}

/// How a file names a generator's pieces.
pub struct Names {
    /// The transposed convolution of upsampling stage `i`.
    pub up: fn(usize) -> String,
    /// Activation `which` (0: before the dilated convolution, 1: before the second) of
    /// residual pair `i` in a stack.
    pub act: fn(usize, usize) -> String,
    /// The activation before the last convolution.
    pub act_post: &'static str,
}

/// What a generator's layers are: its widths, rates and kernels.
pub struct Layout<'a> {
    pub in_channels: i64,
    pub initial_channels: i64,
    pub out_channels: i64,
    pub up_rates: &'a [i32],
    pub up_kernels: &'a [i32],
    /// Whether the output is clamped to [-1, 1].
    pub clamp: bool,
}

/// A BigVGAN generator: `[L, in_channels, 1, 1]` → `[L·Π rates, out_channels, 1, 1]`.
#[derive(Clone, Debug)]
pub struct Generator {
    conv_pre: Conv1d,
    ups: Vec<ConvTranspose1d>,
    resblocks: Vec<AmpBlock>,
    act_post: Activation,
    conv_post: Conv1d,
    clamp: bool,
}

impl Generator {
    /// Declares the generator's weights under `s` (`conv_pre`, the stages, `resblocks.{n}`,
    /// the post activation and `conv_post`, which has no bias).
    pub fn new(s: &mut Scope, names: &Names, layout: &Layout<'_>) -> Generator {
        let conv_pre = Conv1d::new(s, "conv_pre", layout.in_channels, layout.initial_channels, 7, 3, 1, true);
        let (mut ups, mut resblocks, mut ch) = (Vec::new(), Vec::new(), layout.initial_channels);
        for (i, (&rate, &k)) in layout.up_rates.iter().zip(layout.up_kernels).enumerate() {
            let next = layout.initial_channels >> (i + 1);
            ups.push(ConvTranspose1d::new(s, &(names.up)(i), ch, next, k, rate));
            ch = next;
            for (j, &rk) in RES_KERNELS.iter().enumerate() {
                resblocks.push(AmpBlock::new(&mut s.sub(&format!("resblocks.{}", i * RES_KERNELS.len() + j)), names, ch, rk));
            }
        }
        let act_post = Activation::new(s, names.act_post, ch);
        let conv_post = Conv1d::new(s, "conv_post", ch, layout.out_channels, 7, 3, 1, false);
        Generator { conv_pre, ups, resblocks, act_post, conv_post, clamp: layout.clamp }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.conv_pre.forward(g, x);
        let kernels = RES_KERNELS.len();
        for (i, up) in self.ups.iter().enumerate() {
            x = up.forward(g, x);
            let mut sum: Option<T<'g>> = None;
            for block in &self.resblocks[i * kernels..(i + 1) * kernels] {
                let v = block.forward(g, x);
                sum = Some(match sum {
                    Some(s) => s.add(v),
                    None => v,
                });
            }
            x = sum.expect("three residual stacks").scale(1.0 / kernels as f32);
        }
        let x = self.conv_post.forward(g, self.act_post.forward(g, x));
        if self.clamp {
            x.clamp(-1.0, 1.0)
        } else {
            x
        }
    }
}

#[cfg(test)]
mod tests {
    /// Each transposed convolution multiplies the length by its rate exactly.
    #[test]
    fn transposed_convolutions_multiply_the_length_by_their_rate() {
        for (r, k) in [(5, 9), (2, 4), (5, 11), (6, 12)] {
            let len = 7i32;
            assert_eq!((len - 1) * r + k - 2 * ((k - r) / 2), len * r, "rate {r} kernel {k}");
        }
    }
}
