//! MiniMax-H3's audio VAE (`audio_vae_path`), like the reference's `minimax_h3_audio_vae.hpp`;
//! only its decoder runs here (the sound of a generated video).
//!
//! - The file holds the whole network under its own names: a waveform encoder (`encoder.*`,
//!   64 → 2048 channels), an attention pooling to 32 channels (`pre_block.*`), `mean_proj` /
//!   `logs_proj`, `dec_in_proj`, the latent statistics `latents_mean` / `latents_std`, and a
//!   BigVGAN decoder (`decoder.*`). Every size is fixed: the reference reads none and refuses
//!   a file that lacks a tensor or has another shape, so the encoder's layout is checked here
//!   too, though its weights are not loaded (Ref2VA's reference audio is not supported).
//! - The latent is `[steps, 2, 32]`: two streams (left, right) of 32 channels, 40 steps a
//!   second. Each stream is un-normalised (`· std + mean`), projected to 2048 channels and
//!   decoded by BigVGAN: a 7-tap convolution to 1024 channels, seven transposed convolutions
//!   (×5, ×5, ×2 ×5: 800 samples per step) each followed by the mean of three residual stacks
//!   (kernels 3, 7, 11, dilations 1, 3, 5) of anti-aliased snake activations (upsampled ×2
//!   through a 12-tap filter, `x + sin²(αx)/β`, low-passed and downsampled ×2), and a 7-tap
//!   convolution to one channel clamped to [-1, 1]: 32 kHz stereo.
//! - The graphs are the reference's op for op (ggml's 1-D convolutions in f16 im2col, the
//!   filters reversed and the signals padded by slices and concatenations), one stream per
//!   graph: the streams never meet, so the samples are the reference's.

use crate::error::{Context as _, Result};
use crate::graph::{Components, GgmlType, Graph, Loaded, Scope, F16, F32, T, W};
use crate::tensor::Tensor;

/// Samples a second of the decoded sound.
pub const SAMPLE_RATE: u32 = 32_000;
/// Streams (channels of the sound) and latent channels per stream.
pub const STREAMS: usize = 2;
pub const LATENT_CHANNELS: usize = 32;
/// Waveform samples per latent step (the product of the upsampling rates).
pub const SAMPLES_PER_STEP: usize = 800;
/// Latent steps per second (what the reference sizes the audio latent of a video by).
pub const STEPS_PER_SECOND: f64 = SAMPLE_RATE as f64 / SAMPLES_PER_STEP as f64;

const DIM: i64 = 2048;
const INITIAL: i64 = 1024;
const UP_RATES: [i32; 7] = [5, 5, 2, 2, 2, 2, 2];
const UP_KERNELS: [i32; 7] = [9, 9, 4, 4, 4, 4, 4];
const RES_KERNELS: [i32; 3] = [3, 7, 11];
const DILATIONS: [i32; 3] = [1, 3, 5];
const ENCODER_STRIDES: [i64; 5] = [2, 4, 4, 5, 5];
/// The anti-aliasing filters' taps and rates.
const FILTER_TAPS: i64 = 12;
const RATIO: i32 = 2;
/// Added to the snake's β before dividing (the reference's epsilon).
const SNAKE_EPS: f32 = 1e-9;

/// Decoded sound: `channels` streams of `SAMPLE_RATE` samples a second, channel-interleaved.
#[derive(Clone, Debug, PartialEq)]
pub struct Waveform {
    pub sample_rate: u32,
    pub channels: u32,
    pub interleaved: Vec<f32>,
}

/// `x[start..end]` along `dim`, copied (the reference's slice); a dimension of one is kept whole.
fn slice<'g>(x: T<'g>, dim: usize, start: i64, end: i64) -> T<'g> {
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
fn replicate_pad<'g>(x: T<'g>, left: i64, right: i64) -> T<'g> {
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

/// The convolutions' weight type: the file's, bf16 read as f16 (the reference's rule).
fn conv_type(s: &Scope, leaf: &str) -> GgmlType {
    match s.file_type(leaf) {
        Some(t) if t == ggml_sys::GGML_TYPE_BF16 => F16,
        Some(t) => t,
        None => F16,
    }
}

#[derive(Clone, Copy, Debug)]
struct Conv1d {
    weight: W,
    bias: Option<W>,
    stride: i32,
    padding: i32,
    dilation: i32,
}

impl Conv1d {
    #[allow(clippy::too_many_arguments)]
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64, k: i32, padding: i32, dilation: i32, bias: bool) -> Conv1d {
        let mut s = s.sub(name);
        let ty = conv_type(&s, "weight");
        let weight = s.tensor("weight", ty, &[k as i64, ic, oc]);
        let bias = bias.then(|| s.tensor("bias", F32, &[oc]));
        Conv1d { weight, bias, stride: 1, padding, dilation }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = g.param(self.weight).conv_1d(x, self.stride, self.padding, self.dilation);
        match self.bias {
            Some(b) => x.add_inplace(g.param(b).reshape(&[1, b.ne()[0], 1, 1])),
            None => x,
        }
    }
}

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

/// BigVGAN's anti-aliased snake: ×2 up through a filter, `x + sin²(αx)/(β + ε)` with α, β
/// stored as logarithms, low-passed ×2 down.
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

    /// Transposed depthwise convolution by `RATIO` through `filter`, as the reference builds
    /// it: the samples spread with zeros between, then convolved with the reversed filter.
    fn upsample<'g>(x: T<'g>, filter: T<'g>) -> T<'g> {
        let [time, channels, _, _] = x.ne();
        let k = filter.ne()[0];
        let flat = x.reshape(&[1, time, channels]);
        let zeros = flat.scale(0.0);
        let spread = flat.concat(zeros, 0).reshape(&[time * RATIO as i64, 1, channels]);
        let mut reversed = slice(filter, 0, k - 1, k);
        for i in (0..k - 1).rev() {
            reversed = reversed.concat(slice(filter, 0, i, i + 1), 0);
        }
        let out_time = (time - 1) * RATIO as i64 + k;
        let mut out = reversed.conv_1d(spread, 1, (k - 1) as i32, 1);
        if out.ne()[0] > out_time {
            out = slice(out, 0, 0, out_time);
        }
        out.scale(RATIO as f32).reshape(&[out_time, channels, 1, 1])
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let pad = FILTER_TAPS / RATIO as i64 - 1;
        let crop_left = pad * RATIO as i64 + (FILTER_TAPS - RATIO as i64) / 2;
        let crop_right = pad * RATIO as i64 + (FILTER_TAPS - RATIO as i64 + 1) / 2;
        let x = replicate_pad(x, pad, pad);
        let x = Self::upsample(x, g.param(self.up));
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
    acts: Vec<Activation>,
    convs1: Vec<Conv1d>,
    convs2: Vec<Conv1d>,
}

impl AmpBlock {
    fn new(s: &mut Scope, channels: i64, k: i32) -> AmpBlock {
        let acts = (0..6).map(|i| Activation::new(s, &format!("activations.{i}"), channels)).collect();
        let convs1 = (0..3)
            .map(|i| Conv1d::new(s, &format!("convs1.{i}"), channels, channels, k, (k * DILATIONS[i] - DILATIONS[i]) / 2, DILATIONS[i], true))
            .collect();
        let convs2 = (0..3).map(|i| Conv1d::new(s, &format!("convs2.{i}"), channels, channels, k, k / 2, 1, true)).collect();
        AmpBlock { acts, convs1, convs2 }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = x;
        for i in 0..3 {
            let h = self.convs1[i].forward(g, self.acts[2 * i].forward(g, x));
            let h = self.convs2[i].forward(g, self.acts[2 * i + 1].forward(g, h));
            x = x.add(h);
        }
        x
    }
}

/// MiniMax-H3's audio VAE (its decoder) whose weights live in a `ParamStore`.
pub struct MinimaxH3AudioVae {
    latents_mean: W,
    latents_std: W,
    dec_in: Conv1d,
    conv_pre: Conv1d,
    ups: Vec<ConvTranspose1d>,
    resblocks: Vec<AmpBlock>,
    act_post: Activation,
    conv_post: Conv1d,
}

impl MinimaxH3AudioVae {
    /// Declares the decoder's weights (the file's names have no prefix).
    pub fn new(s: &mut Scope) -> MinimaxH3AudioVae {
        let latents_mean = s.tensor("latents_mean", F32, &[LATENT_CHANNELS as i64]);
        let latents_std = s.tensor("latents_std", F32, &[LATENT_CHANNELS as i64]);
        let dec_in = Conv1d::new(s, "dec_in_proj", LATENT_CHANNELS as i64, DIM, 1, 0, 1, true);
        let mut d = s.sub("decoder");
        let conv_pre = Conv1d::new(&mut d, "conv_pre", DIM, INITIAL, 7, 3, 1, true);
        let (mut ups, mut resblocks, mut ch) = (Vec::new(), Vec::new(), INITIAL);
        for (i, (&rate, &k)) in UP_RATES.iter().zip(&UP_KERNELS).enumerate() {
            ups.push(ConvTranspose1d::new(&mut d, &format!("ups.{i}.0"), ch, ch / 2, k, rate));
            ch /= 2;
            for (j, &rk) in RES_KERNELS.iter().enumerate() {
                resblocks.push(AmpBlock::new(&mut d.sub(&format!("resblocks.{}", i * RES_KERNELS.len() + j)), ch, rk));
            }
        }
        let act_post = Activation::new(&mut d, "activation_post", ch);
        let conv_post = Conv1d::new(&mut d, "conv_post", ch, 1, 7, 3, 1, false);
        MinimaxH3AudioVae { latents_mean, latents_std, dec_in, conv_pre, ups, resblocks, act_post, conv_post }
    }

    /// Stream `stream` of the diffusion latent `[steps, 2, 32]` → its samples `[800·steps]`.
    fn decode_stream<'g>(&self, g: &'g Graph, latent: T<'g>, stream: i64) -> T<'g> {
        let c = LATENT_CHANNELS as i64;
        let z = latent.permute(0, 2, 1, 3).cont();
        let z = z.mul(g.param(self.latents_std).reshape(&[1, c, 1, 1])).add(g.param(self.latents_mean).reshape(&[1, c, 1, 1]));
        let [steps, _, streams, _] = z.ne();
        let z = slice(z.reshape(&[steps, c, streams]), 2, stream, stream + 1);
        let mut x = self.conv_pre.forward(g, self.dec_in.forward(g, z));
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
        self.conv_post.forward(g, self.act_post.forward(g, x)).clamp(-1.0, 1.0)
    }
}

/// Every tensor of the file besides the decoder's, `(name, ggml shape)`: the encoder, the
/// attention pooling and the latent projections, which the reference requires too.
fn encoder_layout() -> Vec<(String, Vec<i64>)> {
    fn conv(v: &mut Vec<(String, Vec<i64>)>, p: &str, ic: i64, oc: i64, k: i64) {
        v.push((format!("{p}.weight"), vec![k, ic, oc]));
        v.push((format!("{p}.bias"), vec![oc]));
    }
    let mut v: Vec<(String, Vec<i64>)> = Vec::new();
    conv(&mut v, "encoder.block.0", 1, 64, 7);
    let mut ch = 64;
    for (i, &stride) in ENCODER_STRIDES.iter().enumerate() {
        let p = format!("encoder.block.{}", i + 1);
        for u in 0..3 {
            v.push((format!("{p}.block.{u}.block.0.alpha"), vec![1, ch, 1]));
            conv(&mut v, &format!("{p}.block.{u}.block.1"), ch, ch, 7);
            v.push((format!("{p}.block.{u}.block.2.alpha"), vec![1, ch, 1]));
            conv(&mut v, &format!("{p}.block.{u}.block.3"), ch, ch, 1);
        }
        v.push((format!("{p}.block.3.alpha"), vec![1, ch, 1]));
        conv(&mut v, &format!("{p}.block.4"), ch, 2 * ch, 2 * stride);
        ch *= 2;
    }
    v.push(("encoder.block.6.alpha".into(), vec![1, ch, 1]));
    conv(&mut v, "encoder.block.7", ch, DIM, 3);
    let l = LATENT_CHANNELS as i64;
    for (n, c) in [("norm1", DIM), ("norm3", DIM), ("norm2", l), ("mlp.norm", l)] {
        v.push((format!("pre_block.{n}.weight"), vec![c]));
        v.push((format!("pre_block.{n}.bias"), vec![c]));
    }
    v.push(("pre_block.attn.qkv.weight".into(), vec![DIM, 3 * DIM]));
    v.push(("pre_block.attn.q_bias".into(), vec![DIM]));
    v.push(("pre_block.attn.v_bias".into(), vec![DIM]));
    for (n, i, o) in [("attn.proj", l, l), ("proj", DIM, l), ("mlp.w0", l, 2 * l), ("mlp.w1", l, 2 * l), ("mlp.w2", 2 * l, l)] {
        v.push((format!("pre_block.{n}.weight"), vec![i, o]));
        v.push((format!("pre_block.{n}.bias"), vec![o]));
    }
    conv(&mut v, "mean_proj", l, l, 1);
    conv(&mut v, "logs_proj", l, l, 1);
    v
}

/// A shape as the reference compares them: four dimensions, the missing ones 1.
fn ne4(shape: &[i64]) -> [i64; 4] {
    let mut ne = [1; 4];
    for (d, &n) in ne.iter_mut().zip(shape) {
        *d = n;
    }
    ne
}

/// Checks that the file's tensors outside the decoder are MiniMax-H3's (names and shapes);
/// `shape_of` gives a tensor's stored shape (ggml order).
pub fn check_layout(shape_of: impl Fn(&str) -> Option<Vec<i64>>) -> Result<()> {
    for (name, want) in encoder_layout() {
        let have = shape_of(&name).with_context(|| format!("tensor '{name}' is missing"))?;
        ensure!(ne4(&have) == ne4(&want), "tensor '{name}' has shape {have:?}, MiniMax-H3's audio VAE has {want:?}");
    }
    Ok(())
}

/// A loaded audio VAE as the video job uses it: the denoised audio latent → sound.
pub trait AudioStage: Components + Send {
    /// Audio latent `[steps, streams, channels]` (ggml order) → sound.
    fn decode_audio(&mut self, latent: &Tensor) -> Result<Waveform>;
}

impl AudioStage for Loaded<MinimaxH3AudioVae> {
    fn decode_audio(&mut self, latent: &Tensor) -> Result<Waveform> {
        let s = latent.shape();
        ensure!(
            s.len() >= 3 && s[1] == STREAMS && s[2] == LATENT_CHANNELS && s[3..].iter().all(|&d| d == 1),
            "the MiniMax-H3 audio VAE decodes latents [steps, {STREAMS}, {LATENT_CHANNELS}], got {s:?}"
        );
        let steps = s[0];
        let start = std::time::Instant::now();
        let mut streams = Vec::with_capacity(STREAMS);
        for stream in 0..STREAMS {
            let model = &self.model;
            let out = self.runner.compute(|g| {
                let z = g.input_f32(latent.data(), &[steps as i64, STREAMS as i64, LATENT_CHANNELS as i64, 1]);
                Ok(model.decode_stream(g, z, stream as i64))
            })?;
            ensure!(out.len() == steps * SAMPLES_PER_STEP, "the audio decoder gave {} samples for {steps} latent steps", out.len());
            streams.push(out);
        }
        let n = steps * SAMPLES_PER_STEP;
        let mut interleaved = Vec::with_capacity(n * STREAMS);
        for i in 0..n {
            interleaved.extend(streams.iter().map(|s| s.data()[i]));
        }
        sd_info!("MiniMax-H3 audio VAE decode completed, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(Waveform { sample_rate: SAMPLE_RATE, channels: STREAMS as u32, interleaved })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_encoder_layout_is_the_references() {
        let layout = encoder_layout();
        // 2 + 5 × (3 × 6 + 3) + 3 tensors in the encoder, 21 in the pooling, 4 in the projections.
        assert_eq!(layout.len(), 2 + 5 * (3 * 6 + 3) + 3 + 21 + 4);
        let find = |n: &str| layout.iter().find(|(name, _)| name == n).map(|(_, s)| s.clone());
        assert_eq!(find("encoder.block.5.block.4.weight"), Some(vec![10, 1024, 2048]));
        assert_eq!(find("encoder.block.7.weight"), Some(vec![3, 2048, 2048]));
        assert_eq!(find("pre_block.attn.qkv.weight"), Some(vec![2048, 6144]));
        let ok = |n: &str| find(n);
        assert!(check_layout(ok).is_ok());
        let wrong = |n: &str| if n == "mean_proj.weight" { Some(vec![1, 16, 32]) } else { find(n) };
        let e = check_layout(wrong).unwrap_err().to_string();
        assert!(e.contains("mean_proj.weight"), "{e}");
        let e = check_layout(|n: &str| if n.starts_with("pre_block.") { None } else { find(n) }).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn a_second_of_latents_is_a_second_of_sound() {
        assert_eq!(UP_RATES.iter().product::<i32>() as usize, SAMPLES_PER_STEP);
        assert_eq!(STEPS_PER_SECOND, 40.0);
        // Each transposed convolution multiplies the length by its rate exactly.
        for (&r, &k) in UP_RATES.iter().zip(&UP_KERNELS) {
            let len = 7i32;
            assert_eq!((len - 1) * r + k - 2 * ((k - r) / 2), len * r);
        }
    }
}
