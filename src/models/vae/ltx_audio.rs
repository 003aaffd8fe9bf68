//! LTX-2.3's audio VAE (`audio_vae_path`), like the reference's `ltx_audio_vae.hpp`: the
//! decoder from the audio latent to a stereo mel spectrogram, the BigVGAN vocoder to 16 kHz
//! and, when the file has one, the bandwidth extension to 48 kHz.
//!
//! - The latent is `[16 frequency bins, steps, 8 channels]` (ggml order), 25 steps a second
//!   (16 kHz mel frames of hop 160, four per step).
//!   It is un-normalised per (channel, bin) and decoded as a picture whose width is frequency
//!   and height time: convolutions causal in time (padded above only), RMS norms over the
//!   channels, levels of residual blocks read from the file, each but the last followed by a
//!   nearest ×2 upscale whose first time row is dropped: `4·steps - 3` mel frames of 64 bins
//!   in 2 channels.
//! - The vocoder reads both channels' mel bins as 128 input channels and upsamples by 160
//!   (×5, then ×2 five times) to 16 kHz stereo, clamped to [-1, 1].
//! - The bandwidth extension (`vocoder.bwe_generator.*`) takes the 16 kHz sound's log-mel
//!   spectrogram (a 512-point STFT as a strided convolution with the file's basis, hop 80, the
//!   file's mel filters), a second generator (×240) gives the residual, added to the sound
//!   resampled ×3 through a Hann-windowed sinc filter, clamped: 48 kHz.
//! - Like the reference, every size but the decoder's and vocoder's widths and the
//!   upsampling kernels is fixed, and files whose sound is not 2 channels of 64 mel bins from
//!   8 latent channels are refused (the reference's graph would not fit them).

use super::bigvgan::{depthwise_upsample, replicate_pad, slice, Generator, Layout, Names, RES_KERNELS};
use super::audio::{AudioStage, Waveform};
use crate::error::{Context as _, Result};
use crate::graph::nn::Conv2d;
use crate::graph::{Graph, Loaded, Scope, F32, T, W};
use crate::tensor::Tensor;

/// Latent channels and frequency bins of a latent step.
pub const LATENT_CHANNELS: usize = 8;
pub const FREQUENCY_BINS: usize = 16;

const SAMPLE_RATE: u32 = 16_000;
const TIME_DOWNSAMPLE: i64 = 4;
const MEL_BINS: i64 = 64;
const AUDIO_CHANNELS: i64 = 2;
const BASE_RATES: [i32; 6] = [5, 2, 2, 2, 2, 2];
/// The RMS norms' epsilon.
const NORM_EPS: f32 = 1e-6;

/// The bandwidth extension's fixed layout.
const BWE_RATE: u32 = 48_000;
const BWE_HOP: i64 = 80;
const BWE_FFT: i64 = 512;
const BWE_INITIAL: i64 = 512;
const BWE_RATES: [i32; 5] = [6, 5, 2, 2, 2];
const BWE_KERNELS: [i32; 5] = [12, 11, 4, 4, 4];

/// LTX-2.3's names for BigVGAN's pieces.
const NAMES: Names = Names { up: |i| format!("ups.{i}"), act: |i, which| format!("acts{}.{i}", which + 1), act_post: "act_post" };

/// What the file says of the network.
#[derive(Clone, Debug, PartialEq)]
pub struct LtxAudioConfig {
    /// Width of the decoder's first level, and each level's multiple of it.
    pub decoder_channels: i64,
    pub multipliers: Vec<i64>,
    /// Residual blocks per decoder level.
    pub level_blocks: usize,
    /// Width after the vocoder's first convolution, and its upsampling kernels.
    pub vocoder_channels: i64,
    pub up_kernels: Vec<i32>,
    /// The file has the bandwidth extension (48 kHz).
    pub bwe: bool,
}

impl LtxAudioConfig {
    /// Reads the layout from the stored shapes (ggml order); errors name what does not fit.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Result<LtxAudioConfig> {
        let need = |n: &str| shape_of(n).with_context(|| format!("tensor '{n}' is missing (not an LTX-2.3 audio VAE)"));
        let dim = |s: &[i64], i: usize| s.get(i).copied().unwrap_or(1);
        let conv_in = need("audio_vae.decoder.conv_in.conv.weight")?;
        let conv_out = need("audio_vae.decoder.conv_out.conv.weight")?;
        let stats = need("audio_vae.per_channel_statistics.std-of-means")?;
        let pre = need("vocoder.vocoder.conv_pre.weight")?;
        need("vocoder.vocoder.conv_post.weight")?;
        let (latent, sound) = (dim(&conv_in, 2), dim(&conv_out, 3));
        let bins = dim(&stats, 0) / latent.max(1);
        ensure!(
            latent == LATENT_CHANNELS as i64 && sound == AUDIO_CHANNELS && bins * TIME_DOWNSAMPLE == MEL_BINS && dim(&stats, 0) % latent.max(1) == 0,
            "the LTX-2.3 audio VAE makes {AUDIO_CHANNELS} channels of {MEL_BINS} mel bins from {LATENT_CHANNELS} latent channels; this file has {latent} latent channels, {sound} sound channels and {} statistics",
            dim(&stats, 0)
        );
        let mut widths = Vec::new();
        while let Some(s) = shape_of(&format!("audio_vae.decoder.up.{}.block.0.conv1.conv.weight", widths.len())) {
            widths.push(dim(&s, 3));
        }
        // Each level but the last doubles the frequency bins: 16 → 64 takes three.
        ensure!(widths.len() == 3, "the LTX-2.3 audio VAE's decoder has 3 levels (audio_vae.decoder.up.N); this file has {}", widths.len());
        let decoder_channels = widths[0];
        ensure!(
            decoder_channels > 0 && widths.iter().all(|w| w % decoder_channels == 0),
            "the LTX-2.3 audio VAE's decoder levels are {widths:?} wide: not multiples of the first"
        );
        let mut level_blocks = 0;
        while shape_of(&format!("audio_vae.decoder.up.0.block.{level_blocks}.conv1.conv.weight")).is_some() {
            level_blocks += 1;
        }
        let mut up_kernels = Vec::new();
        while let Some(s) = shape_of(&format!("vocoder.vocoder.ups.{}.weight", up_kernels.len())) {
            up_kernels.push(dim(&s, 0) as i32);
        }
        ensure!(
            up_kernels.len() == BASE_RATES.len(),
            "the LTX-2.3 vocoder upsamples in {} stages; this file has {}",
            BASE_RATES.len(),
            up_kernels.len()
        );
        let kernels: Vec<i64> = (0..RES_KERNELS.len()).filter_map(|i| shape_of(&format!("vocoder.vocoder.resblocks.{i}.convs1.0.weight")).map(|s| dim(&s, 0))).collect();
        ensure!(
            kernels == RES_KERNELS.map(i64::from),
            "the LTX-2.3 vocoder's residual kernels are {RES_KERNELS:?}; this file has {kernels:?}"
        );
        let vocoder_channels = dim(&pre, 2);
        ensure!(
            vocoder_channels % (1 << BASE_RATES.len()) == 0,
            "the LTX-2.3 vocoder halves its {vocoder_channels} channels {} times",
            BASE_RATES.len()
        );
        Ok(LtxAudioConfig {
            decoder_channels,
            multipliers: widths.iter().map(|w| w / decoder_channels).collect(),
            level_blocks,
            vocoder_channels,
            up_kernels,
            bwe: shape_of("vocoder.bwe_generator.conv_pre.weight").is_some(),
        })
    }

    /// Samples a second of the decoded sound.
    pub fn sample_rate(&self) -> u32 {
        if self.bwe {
            BWE_RATE
        } else {
            SAMPLE_RATE
        }
    }
}

/// A convolution causal in time (height): padded above by `k - 1` rows and on both sides of
/// the frequency axis by half of `k - 1`.
#[derive(Clone, Copy, Debug)]
struct CausalConv {
    conv: Conv2d,
    k: i32,
}

impl CausalConv {
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64, k: i64) -> CausalConv {
        let conv = Conv2d::new(&mut s.sub(name), "conv", ic, oc, (k, k), (1, 1), (0, 0), true);
        CausalConv { conv, k: k as i32 }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let pad = self.k - 1;
        let x = x.pad_ext([pad / 2, pad, 0, 0], [pad - pad / 2, 0, 0, 0]);
        self.conv.forward(g, x)
    }
}

/// RMS norm over the channels of `[W, H, C, N]`.
fn pixel_norm<'g>(x: T<'g>) -> T<'g> {
    let h = x.permute(1, 2, 0, 3).cont().rms_norm(NORM_EPS);
    h.permute(2, 0, 1, 3).cont()
}

#[derive(Clone, Debug)]
struct ResBlock {
    conv1: CausalConv,
    conv2: CausalConv,
    shortcut: Option<CausalConv>,
}

impl ResBlock {
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64) -> ResBlock {
        let mut s = s.sub(name);
        ResBlock {
            conv1: CausalConv::new(&mut s, "conv1", ic, oc, 3),
            conv2: CausalConv::new(&mut s, "conv2", oc, oc, 3),
            shortcut: (ic != oc).then(|| CausalConv::new(&mut s, "nin_shortcut", ic, oc, 1)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.conv1.forward(g, pixel_norm(x).silu_inplace());
        let h = self.conv2.forward(g, pixel_norm(h).silu_inplace());
        let x = match &self.shortcut {
            Some(s) => s.forward(g, x),
            None => x,
        };
        x.add(h)
    }
}

/// One decoder level: its residual blocks and, but for the last level, the upscale.
#[derive(Clone, Debug)]
struct Level {
    blocks: Vec<ResBlock>,
    upsample: Option<CausalConv>,
}

/// The decoder's bandwidth extension: the mel filters, the STFT basis and the generator.
#[derive(Clone, Debug)]
struct Bwe {
    mel_basis: W,
    stft_basis: W,
    generator: Generator,
    /// The Hann-windowed sinc filter that resamples the sound ×3.
    resample: Vec<f32>,
}

/// LTX-2.3's audio VAE (decoder and vocoder) whose weights live in a `ParamStore`.
pub struct LtxAudioVae {
    pub config: LtxAudioConfig,
    mean: W,
    std: W,
    conv_in: CausalConv,
    mid: [ResBlock; 2],
    /// From the widest level (the first run) to level 0.
    levels: Vec<Level>,
    conv_out: CausalConv,
    vocoder: Generator,
    bwe: Option<Bwe>,
}

impl LtxAudioVae {
    /// Declares the weights of `config` (the file's names have no prefix).
    pub fn new(s: &mut Scope, config: &LtxAudioConfig) -> LtxAudioVae {
        let stats = (LATENT_CHANNELS * FREQUENCY_BINS) as i64;
        let mean = s.tensor("audio_vae.per_channel_statistics.mean-of-means", F32, &[stats]);
        let std = s.tensor("audio_vae.per_channel_statistics.std-of-means", F32, &[stats]);
        let mut d = s.sub("audio_vae.decoder");
        let base = config.decoder_channels;
        let mut ch = base * config.multipliers.last().copied().unwrap_or(1);
        let conv_in = CausalConv::new(&mut d, "conv_in", LATENT_CHANNELS as i64, ch, 3);
        let mid = [ResBlock::new(&mut d, "mid.block_1", ch, ch), ResBlock::new(&mut d, "mid.block_2", ch, ch)];
        let mut levels = Vec::new();
        for (level, &m) in config.multipliers.iter().enumerate().rev() {
            let out = base * m;
            let blocks = (0..config.level_blocks)
                .map(|b| {
                    let block = ResBlock::new(&mut d, &format!("up.{level}.block.{b}"), ch, out);
                    ch = out;
                    block
                })
                .collect();
            let upsample = (level != 0).then(|| CausalConv::new(&mut d.sub(&format!("up.{level}.upsample")), "conv", ch, ch, 3));
            levels.push(Level { blocks, upsample });
        }
        let conv_out = CausalConv::new(&mut d, "conv_out", ch, AUDIO_CHANNELS, 3);
        let layout = Layout {
            in_channels: MEL_BINS * AUDIO_CHANNELS,
            initial_channels: config.vocoder_channels,
            out_channels: AUDIO_CHANNELS,
            up_rates: &BASE_RATES,
            up_kernels: &config.up_kernels,
            clamp: true,
        };
        let vocoder = Generator::new(&mut s.sub("vocoder.vocoder"), &NAMES, &layout);
        let bwe = config.bwe.then(|| {
            let freqs = BWE_FFT / 2 + 1;
            let mel_basis = s.tensor("vocoder.mel_stft.mel_basis", F32, &[freqs, MEL_BINS]);
            let stft_basis = s.tensor("vocoder.mel_stft.stft_fn.forward_basis", F32, &[BWE_FFT, 1, 2 * freqs]);
            // Unused here, but part of the file the reference requires.
            s.tensor("vocoder.mel_stft.stft_fn.inverse_basis", F32, &[BWE_FFT, 1, 2 * freqs]);
            let layout = Layout {
                in_channels: MEL_BINS * AUDIO_CHANNELS,
                initial_channels: BWE_INITIAL,
                out_channels: AUDIO_CHANNELS,
                up_rates: &BWE_RATES,
                up_kernels: &BWE_KERNELS,
                clamp: false,
            };
            let generator = Generator::new(&mut s.sub("vocoder.bwe_generator"), &NAMES, &layout);
            Bwe { mel_basis, stft_basis, generator, resample: hann_resample_filter((BWE_RATE / SAMPLE_RATE) as usize) }
        });
        LtxAudioVae { config: config.clone(), mean, std, conv_in, mid, levels, conv_out, vocoder, bwe }
    }

    /// The latent `[16, steps, 8, 1]` → the mel spectrogram `[64, 4·steps - 3, 2, 1]`.
    fn decode_mel<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let [bins, steps, channels, n] = z.ne();
        // Un-normalise per (channel, bin).
        let flat = z.permute(0, 2, 1, 3).cont().reshape(&[bins * channels, steps, 1, n]);
        let stats = [bins * channels, 1, 1, 1];
        let flat = flat.mul(g.param(self.std).reshape(&stats)).add(g.param(self.mean).reshape(&stats));
        let x = flat.reshape(&[bins, channels, steps, n]).permute(0, 2, 1, 3).cont();

        let mut x = self.conv_in.forward(g, x);
        for block in &self.mid {
            x = block.forward(g, x);
        }
        for level in &self.levels {
            for block in &level.blocks {
                x = block.forward(g, x);
            }
            if let Some(up) = &level.upsample {
                let y = up.forward(g, x.upscale(2));
                let rows = y.ne()[1];
                x = slice(y, 1, 1, rows);
            }
        }
        let x = self.conv_out.forward(g, pixel_norm(x).silu_inplace());
        let frames = steps * TIME_DOWNSAMPLE - (TIME_DOWNSAMPLE - 1);
        let [w, h, _, _] = x.ne();
        let x = slice(x, 0, 0, w.min(MEL_BINS));
        slice(x, 1, 0, h.min(frames))
    }

    /// A vocoder's input from the mel spectrogram `[64, frames, 2, 1]`: `[frames, 128, 1, 1]`,
    /// the first channel's bins then the second's.
    fn vocoder_input<'g>(mel: T<'g>) -> T<'g> {
        let mel = mel.permute(1, 0, 2, 3).cont();
        let [frames, bins, ch, n] = mel.ne();
        let nb = mel.nb();
        let half = ch / 2;
        let part = |i: i64| mel.view(&[frames, bins, half, n], &[nb[1], nb[2], nb[3]], (i * half) as usize * nb[2]);
        part(0).concat(part(1), 1)
    }

    /// The sound `[L, 2, 1, 1]` at 16 kHz → `[3·L, 2, 1, 1]` at 48 kHz.
    fn extend_bandwidth<'g>(&self, g: &'g Graph, bwe: &Bwe, sound: T<'g>) -> T<'g> {
        let low = sound.ne()[0];
        let rem = low % BWE_HOP;
        let padded = if rem != 0 { sound.pad_ext([0; 4], [(BWE_HOP - rem) as i32, 0, 0, 0]) } else { sound };
        let mel = log_mel(padded, g.param(bwe.stft_basis), g.param(bwe.mel_basis), BWE_HOP);
        let residual = bwe.generator.forward(g, Self::vocoder_input(mel));
        let ratio = (BWE_RATE / SAMPLE_RATE) as i64;
        let filter = g.input_f32(&bwe.resample, &[bwe.resample.len() as i64, 1, 1, 1]);
        let skip = hann_upsample(padded, filter, ratio);
        let out = residual.add(skip).clamp(-1.0, 1.0);
        slice(out, 0, 0, low * ratio)
    }

    /// The audio latent `[16, steps, 8, 1]` → the sound `[samples, 2, 1, 1]`.
    fn decode<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let mel = self.decode_mel(g, z);
        let sound = self.vocoder.forward(g, Self::vocoder_input(mel));
        match &self.bwe {
            Some(bwe) => self.extend_bandwidth(g, bwe, sound),
            None => sound,
        }
    }
}

/// The log-mel spectrogram `[mels, frames, channels, 1]` of `sound` `[L, channels, 1, 1]`:
/// the STFT as a convolution with `basis` `[fft, 1, 2·freqs]` (real parts, then imaginary) at
/// hop `hop` after `fft - hop` zeros in front, magnitudes through the filters `mel`
/// `[freqs, mels]`, the logarithm of at least 1e-5.
fn log_mel<'g>(sound: T<'g>, basis: T<'g>, mel: T<'g>, hop: i64) -> T<'g> {
    let [len, channels, _, _] = sound.ne();
    let fft = basis.ne()[0];
    let freqs = basis.ne()[2] / 2;
    let x = sound.reshape(&[len, 1, channels]);
    let left = (fft - hop).max(0);
    let x = if left > 0 { x.pad_ext([left as i32, 0, 0, 0], [0; 4]) } else { x };
    let frames = basis.conv_1d(x, hop as i32, 0, 1);
    let real = slice(frames, 1, 0, freqs);
    let imag = slice(frames, 1, freqs, 2 * freqs);
    let magnitude = real.sqr().add(imag.sqr()).sqrt().permute(1, 0, 2, 3).cont();
    let mels = mel.mul_mat(magnitude).clamp(1e-5, f32::MAX).log();
    let [m, f, _, _] = mels.ne();
    mels.reshape(&[m, f, channels, 1])
}

/// `sound` `[L, channels, 1, 1]` resampled ×`ratio` through `filter` (edges repeated).
fn hann_upsample<'g>(sound: T<'g>, filter: T<'g>, ratio: i64) -> T<'g> {
    let taps = filter.ne()[0];
    let width = (taps - 1) / (2 * ratio);
    let (crop_left, crop_right) = (2 * width * ratio, taps - ratio);
    let x = depthwise_upsample(replicate_pad(sound, width, width), filter, ratio);
    let len = x.ne()[0];
    slice(x, 0, crop_left, len - crop_right)
}

/// The ×`ratio` resampling filter: a sinc low-pass at 0.99 of the band, 6 zero crossings
/// each side, under a squared-cosine (Hann) window, `2·⌈6/0.99⌉·ratio + 1` taps.
fn hann_resample_filter(ratio: usize) -> Vec<f32> {
    const ZEROS: f64 = 6.0;
    const ROLLOFF: f64 = 0.99;
    let width = (ZEROS / ROLLOFF).ceil() as usize;
    let taps = 2 * width * ratio + 1;
    (0..taps)
        .map(|i| {
            let t = (i as f64 / ratio as f64 - width as f64) * ROLLOFF;
            let window = (t.clamp(-ZEROS, ZEROS) * std::f64::consts::PI / ZEROS / 2.0).cos().powi(2);
            let sinc = if t == 0.0 { 1.0 } else { (std::f64::consts::PI * t).sin() / (std::f64::consts::PI * t) };
            (sinc * window * ROLLOFF / ratio as f64) as f32
        })
        .collect()
}

impl AudioStage for Loaded<LtxAudioVae> {
    fn latent_shape(&self, steps: usize) -> Vec<usize> {
        vec![FREQUENCY_BINS, steps, LATENT_CHANNELS]
    }

    fn decode_audio(&mut self, latent: &Tensor) -> Result<Waveform> {
        let s = latent.shape();
        ensure!(
            s.len() >= 3 && s[0] == FREQUENCY_BINS && s[2] == LATENT_CHANNELS && s[1] > 0 && s[3..].iter().all(|&d| d == 1),
            "the LTX-2.3 audio VAE decodes latents [{FREQUENCY_BINS}, steps, {LATENT_CHANNELS}], got {s:?}"
        );
        let start = std::time::Instant::now();
        let model = &self.model;
        let out = self.runner.compute(|g| {
            let z = g.input_f32(latent.data(), &[FREQUENCY_BINS as i64, s[1] as i64, LATENT_CHANNELS as i64, 1]);
            Ok(model.decode(g, z))
        })?;
        let (samples, channels) = (out.ne(0), out.ne(1));
        ensure!(channels == AUDIO_CHANNELS as usize && samples > 0, "the LTX-2.3 vocoder gave {:?}", out.shape());
        let data = out.data();
        let interleaved = (0..samples).flat_map(|i| (0..channels).map(move |c| data[c * samples + i])).collect();
        sd_info!("ltx audio vae decode completed, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(Waveform { sample_rate: model.config.sample_rate(), channels: channels as u32, interleaved })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resampling_filter_is_a_windowed_sinc() {
        let f = hann_resample_filter(3);
        assert_eq!(f.len(), 43);
        // Symmetric, peaking at the centre with 1/ratio of the rolloff.
        for i in 0..f.len() {
            assert!((f[i] - f[f.len() - 1 - i]).abs() < 1e-7, "tap {i}");
        }
        assert!((f[21] - 0.33).abs() < 1e-6, "{}", f[21]);
        // Zero crossings every `ratio` taps off the centre, up to the rolloff.
        assert!(f[24].abs() < 0.01 && f[0].abs() < 1e-6);
    }

    fn shapes(bwe: bool, latent: i64) -> impl Fn(&str) -> Option<Vec<i64>> {
        move |n: &str| {
            let v = match n {
                "audio_vae.decoder.conv_in.conv.weight" => vec![3, 3, latent, 32],
                "audio_vae.decoder.conv_out.conv.weight" => vec![3, 3, 8, 2],
                "audio_vae.per_channel_statistics.std-of-means" => vec![128],
                "vocoder.vocoder.conv_pre.weight" => vec![7, 128, 64],
                "vocoder.vocoder.conv_post.weight" => vec![7, 1, 2],
                "vocoder.bwe_generator.conv_pre.weight" if bwe => vec![7, 128, 512],
                _ => {
                    for (l, w) in [8i64, 16, 32].iter().enumerate() {
                        for b in 0..3 {
                            if n == format!("audio_vae.decoder.up.{l}.block.{b}.conv1.conv.weight") {
                                return Some(vec![3, 3, *w, *w]);
                            }
                        }
                    }
                    for i in 0..6 {
                        if n == format!("vocoder.vocoder.ups.{i}.weight") {
                            return Some(vec![if i == 0 { 11 } else { 4 }, 32, 64]);
                        }
                    }
                    for (i, k) in RES_KERNELS.iter().enumerate() {
                        if n == format!("vocoder.vocoder.resblocks.{i}.convs1.0.weight") {
                            return Some(vec![*k as i64, 32, 32]);
                        }
                    }
                    return None;
                }
            };
            Some(v)
        }
    }

    #[test]
    fn the_layout_is_read_from_the_weights() {
        let c = LtxAudioConfig::detect(&shapes(false, 8)).unwrap();
        assert_eq!(c.decoder_channels, 8);
        assert_eq!(c.multipliers, vec![1, 2, 4]);
        assert_eq!(c.level_blocks, 3);
        assert_eq!(c.vocoder_channels, 64);
        assert_eq!(c.up_kernels, vec![11, 4, 4, 4, 4, 4]);
        assert_eq!((c.bwe, c.sample_rate()), (false, 16_000));
        assert_eq!(LtxAudioConfig::detect(&shapes(true, 8)).unwrap().sample_rate(), 48_000);
        let e = LtxAudioConfig::detect(&shapes(false, 4)).unwrap_err().to_string();
        assert!(e.contains("4 latent channels"), "{e}");
        let e = LtxAudioConfig::detect(&|_: &str| None).unwrap_err().to_string();
        assert!(e.contains("audio_vae.decoder.conv_in.conv.weight") && e.contains("missing"), "{e}");
    }
}
