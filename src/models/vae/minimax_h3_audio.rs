//! MiniMax-H3's audio VAE (`audio_vae_path`), like the reference's `minimax_h3_audio_vae.hpp`:
//! its decoder makes the sound of a generated video, its encoder reads reference sound.
//!
//! - The file holds the whole network under its own names: a waveform encoder (`encoder.*`,
//!   64 → 2048 channels), an attention pooling to 32 channels (`pre_block.*`), `mean_proj` /
//!   `logs_proj`, `dec_in_proj`, the latent statistics `latents_mean` / `latents_std`, and a
//!   BigVGAN decoder (`decoder.*`). Every size is fixed: the reference reads none and refuses
//!   a file that lacks a tensor or has another shape, so the encoder's layout is checked here
//!   too. The encoder turns Ref2VA's reference sound into latents: 32 kHz stereo (padded to
//!   800 samples a step) through a snake-activated convolution stack to 2048 channels, a causal
//!   attention pooling to 32 and `mean_proj`, normalised by the latent statistics.
//! - The latent is `[steps, 2, 32]`: two streams (left, right) of 32 channels, 40 steps a
//!   second. Each stream is un-normalised (`· std + mean`), projected to 2048 channels and
//!   decoded by BigVGAN ([`super::bigvgan`]): 1024 channels after its first convolution, seven
//!   transposed convolutions (×5, ×5, ×2 ×5: 800 samples per step), one output channel
//!   clamped to [-1, 1]: 32 kHz stereo.
//! - One stream per graph: the streams never meet, so the samples are the reference's.

use super::audio::{AudioStage, Waveform};
use super::bigvgan::{slice, Conv1d, Generator, Layout, Names};
use crate::graph::nn::{self, LayerNorm, Linear};
use crate::models::common::dit::chunk;
use crate::error::{Context as _, Result};
use crate::graph::{Graph, Loaded, Scope, F32, T, W};
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
const ENCODER_STRIDES: [i64; 5] = [2, 4, 4, 5, 5];
/// Added to the encoder's snake α before dividing (the reference's epsilon).
const SNAKE_EPS: f32 = 1e-9;

/// MiniMax-H3's names for BigVGAN's pieces.
const NAMES: Names = Names { up: |i| format!("ups.{i}.0"), act: |i, which| format!("activations.{}", 2 * i + which), act_post: "activation_post" };

/// MiniMax-H3's audio VAE (its decoder) whose weights live in a `ParamStore`.
pub struct MinimaxH3AudioVae {
    latents_mean: W,
    latents_std: W,
    dec_in: Conv1d,
    decoder: Generator,
    encoder: AudioEncoder,
}

impl MinimaxH3AudioVae {
    /// Declares the decoder's weights (the file's names have no prefix).
    pub fn new(s: &mut Scope) -> MinimaxH3AudioVae {
        let latents_mean = s.tensor("latents_mean", F32, &[LATENT_CHANNELS as i64]);
        let latents_std = s.tensor("latents_std", F32, &[LATENT_CHANNELS as i64]);
        let dec_in = Conv1d::new(s, "dec_in_proj", LATENT_CHANNELS as i64, DIM, 1, 0, 1, true);
        let layout = Layout { in_channels: DIM, initial_channels: INITIAL, out_channels: 1, up_rates: &UP_RATES, up_kernels: &UP_KERNELS, clamp: true };
        let decoder = Generator::new(&mut s.sub("decoder"), &NAMES, &layout);
        let encoder = AudioEncoder::new(s);
        MinimaxH3AudioVae { latents_mean, latents_std, dec_in, decoder, encoder }
    }

    /// Waveforms `[L, 2]` (L a multiple of 800) → the normalised latent means `[L / 800, 2, 32]`.
    fn encode_graph<'g>(&self, g: &'g Graph, wave: T<'g>) -> T<'g> {
        let c = LATENT_CHANNELS as i64;
        let [len, streams, _, _] = wave.ne();
        let x = self.encoder.wave.forward(g, wave.reshape(&[len, 1, streams]));
        let x = self.encoder.pooling.forward(g, x.permute(1, 0, 2, 3).cont());
        let z = self.encoder.mean_proj.forward(g, x.permute(1, 0, 2, 3).cont());
        let z = z.sub(g.param(self.latents_mean).reshape(&[1, c, 1, 1])).div(g.param(self.latents_std).reshape(&[1, c, 1, 1]));
        z.permute(0, 2, 1, 3).cont()
    }

    /// Stream `stream` of the diffusion latent `[steps, 2, 32]` → its samples `[800·steps]`.
    fn decode_stream<'g>(&self, g: &'g Graph, latent: T<'g>, stream: i64) -> T<'g> {
        let c = LATENT_CHANNELS as i64;
        let z = latent.permute(0, 2, 1, 3).cont();
        let z = z.mul(g.param(self.latents_std).reshape(&[1, c, 1, 1])).add(g.param(self.latents_mean).reshape(&[1, c, 1, 1]));
        let [steps, _, streams, _] = z.ne();
        let z = slice(z.reshape(&[steps, c, streams]), 2, stream, stream + 1);
        self.decoder.forward(g, self.dec_in.forward(g, z))
    }
}

/// The snake activation without anti-aliasing: `x + sin²(αx) / (α + 1e-9)`, α per channel.
#[derive(Clone, Copy, Debug)]
struct Snake {
    alpha: W,
}

impl Snake {
    fn new(s: &mut Scope, name: &str, channels: i64) -> Snake {
        Snake { alpha: s.sub(name).tensor("alpha", F32, &[1, channels, 1]) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let alpha = g.param(self.alpha);
        let s = x.mul(alpha).sin();
        let s = s.mul(s);
        let eps = g.input_f32(&[SNAKE_EPS], &[1, 1, 1, 1]);
        x.add(s.div(alpha.add(eps)))
    }
}

/// A residual unit of the waveform encoder: snake, a dilated 7-tap convolution, snake, a 1×1.
#[derive(Clone, Copy, Debug)]
struct ResidualUnit {
    act1: Snake,
    conv1: Conv1d,
    act2: Snake,
    conv2: Conv1d,
}

impl ResidualUnit {
    fn new(s: &mut Scope, channels: i64, dilation: i32) -> ResidualUnit {
        ResidualUnit {
            act1: Snake::new(s, "block.0", channels),
            conv1: Conv1d::new(s, "block.1", channels, channels, 7, 3 * dilation, dilation, true),
            act2: Snake::new(s, "block.2", channels),
            conv2: Conv1d::new(s, "block.3", channels, channels, 1, 0, 1, true),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.conv2.forward(g, self.act2.forward(g, self.conv1.forward(g, self.act1.forward(g, x))));
        x.add(h)
    }
}

/// The waveform encoder: a 7-tap convolution to 64 channels, five blocks (three residual
/// units, snake, a strided convolution doubling the channels: ×2, ×4, ×4, ×5, ×5 shorter, 800
/// samples a step), snake and a 3-tap convolution to 2048 channels.
#[derive(Clone, Debug)]
struct WaveEncoder {
    conv_in: Conv1d,
    blocks: Vec<([ResidualUnit; 3], Snake, Conv1d)>,
    act: Snake,
    conv_out: Conv1d,
}

impl WaveEncoder {
    fn new(s: &mut Scope) -> WaveEncoder {
        let conv_in = Conv1d::new(s, "block.0", 1, 64, 7, 3, 1, true);
        let mut ch = 64;
        let mut blocks = Vec::new();
        for (i, &stride) in ENCODER_STRIDES.iter().enumerate() {
            let mut b = s.sub(&format!("block.{}", i + 1));
            let units = [(0, 1), (1, 3), (2, 9)].map(|(u, d)| ResidualUnit::new(&mut b.sub(&format!("block.{u}")), ch, d));
            let act = Snake::new(&mut b, "block.3", ch);
            let stride = stride as i32;
            let down = Conv1d::new(&mut b, "block.4", ch, 2 * ch, 2 * stride, (stride + 1) / 2, 1, true).strided(stride);
            blocks.push((units, act, down));
            ch *= 2;
        }
        let act = Snake::new(s, "block.6", ch);
        let conv_out = Conv1d::new(s, "block.7", ch, DIM, 3, 1, 1, true);
        WaveEncoder { conv_in, blocks, act, conv_out }
    }

    /// Waveforms `[L, 1, streams]` → features `[L / 800, 2048, streams]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.conv_in.forward(g, x);
        for (units, act, down) in &self.blocks {
            for u in units {
                x = u.forward(g, x);
            }
            x = down.forward(g, act.forward(g, x));
        }
        self.conv_out.forward(g, self.act.forward(g, x))
    }
}

/// The attention pooling from 2048 to the 32 latent channels (`pre_block`): a causal
/// self-attention of 8 heads whose output is averaged over the heads and then over groups of
/// 8 dimensions, plus a linear projection of the input; then a GeGLU MLP of 64.
#[derive(Clone, Copy, Debug)]
struct Pooling {
    norm1: LayerNorm,
    qkv: Linear,
    q_bias: W,
    v_bias: W,
    attn_proj: Linear,
    norm3: LayerNorm,
    proj: Linear,
    norm2: LayerNorm,
    mlp_norm: LayerNorm,
    w0: Linear,
    w1: Linear,
    w2: Linear,
}

const POOL_HEADS: i64 = 8;

impl Pooling {
    fn new(s: &mut Scope) -> Pooling {
        let l = LATENT_CHANNELS as i64;
        let norm = |s: &mut Scope, name: &str, dim: i64| LayerNorm::new(s, name, dim, 1e-5, true, true);
        let mut a = s.sub("attn");
        let (qkv, q_bias, v_bias, attn_proj) =
            (Linear::new(&mut a, "qkv", DIM, 3 * DIM, false), a.tensor("q_bias", F32, &[DIM]), a.tensor("v_bias", F32, &[DIM]), Linear::new(&mut a, "proj", l, l, true));
        let mut m = s.sub("mlp");
        let (mlp_norm, w0, w1, w2) = (norm(&mut m, "norm", l), Linear::new(&mut m, "w0", l, 2 * l, true), Linear::new(&mut m, "w1", l, 2 * l, true), Linear::new(&mut m, "w2", 2 * l, l, true));
        Pooling {
            norm1: norm(s, "norm1", DIM),
            qkv,
            q_bias,
            v_bias,
            attn_proj,
            norm3: norm(s, "norm3", DIM),
            proj: Linear::new(s, "proj", DIM, l, true),
            norm2: norm(s, "norm2", l),
            mlp_norm,
            w0,
            w1,
            w2,
        }
    }

    /// `x` `[2048, S, streams]` → `[32, S, streams]`.
    fn attention<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [_, seq, streams, _] = x.ne();
        let qkv = chunk(self.qkv.forward(g, x), 3, 0, true);
        let q = qkv[0].add(g.param(self.q_bias).reshape(&[DIM, 1, 1, 1]));
        let v = qkv[2].add(g.param(self.v_bias).reshape(&[DIM, 1, 1, 1]));
        let n = seq as usize;
        let mask: Vec<f32> = (0..n * n).map(|i| if i % n > i / n { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = g.input_f32(&mask, &[seq, seq]);
        let out = nn::attention(g, q, qkv[1], v, POOL_HEADS, Some(mask), false, g.options.flash_attn, 1.0);
        let head = DIM / POOL_HEADS;
        let out = out.reshape(&[head, POOL_HEADS, seq, streams]).permute(1, 0, 2, 3).cont().mean();
        let l = LATENT_CHANNELS as i64;
        let out = out.reshape(&[head / l, l, seq, streams]).mean().reshape(&[l, seq, streams]);
        self.attn_proj.forward(g, out)
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.proj.forward(g, self.norm3.forward(g, x)).add(self.attention(g, self.norm1.forward(g, x)));
        let h = self.mlp_norm.forward(g, self.norm2.forward(g, x));
        let h = self.w2.forward(g, self.w0.forward(g, h).gelu().mul(self.w1.forward(g, h)));
        x.add(h)
    }
}

/// The encoder side of the audio VAE, for Ref2VA's reference sound.
#[derive(Clone, Debug)]
struct AudioEncoder {
    wave: WaveEncoder,
    pooling: Pooling,
    mean_proj: Conv1d,
}

impl AudioEncoder {
    fn new(s: &mut Scope) -> AudioEncoder {
        let l = LATENT_CHANNELS as i64;
        // Declared by the reference (the variance's projection), never read.
        let _ = Conv1d::new(s, "logs_proj", l, l, 1, 0, 1, true);
        AudioEncoder { wave: WaveEncoder::new(&mut s.sub("encoder")), pooling: Pooling::new(&mut s.sub("pre_block")), mean_proj: Conv1d::new(s, "mean_proj", l, l, 1, 0, 1, true) }
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

impl AudioStage for Loaded<MinimaxH3AudioVae> {
    fn latent_shape(&self, steps: usize) -> Vec<usize> {
        vec![steps, STREAMS, LATENT_CHANNELS]
    }

    fn input_sample_rate(&self) -> Option<u32> {
        Some(SAMPLE_RATE)
    }

    fn encode_audio(&mut self, waveform: &Tensor) -> Result<Tensor> {
        let s = waveform.shape();
        ensure!(
            s.len() >= 2 && s[1] == STREAMS && s[0] > 0 && s[0] % SAMPLES_PER_STEP == 0 && s[2..].iter().all(|&d| d == 1),
            "the MiniMax-H3 audio VAE encodes stereo waveforms of whole steps [{SAMPLES_PER_STEP}k, {STREAMS}], got {s:?}"
        );
        let start = std::time::Instant::now();
        let model = &self.model;
        let out = self.runner.compute(|g| Ok(model.encode_graph(g, g.input_f32(waveform.data(), &[s[0] as i64, STREAMS as i64]))))?;
        self.runner.release();
        sd_info!("MiniMax-H3 audio VAE encode completed, taking {:.2}s", start.elapsed().as_secs_f32());
        out.reshape(&[s[0] / SAMPLES_PER_STEP, STREAMS, LATENT_CHANNELS])
    }

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
    }
}
