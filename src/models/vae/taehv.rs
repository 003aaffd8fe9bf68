//! TAEHV, the tiny video autoencoder (madebyollin/taehv) the reference uses for Wan's latents
//! (Wan 2.1's 16 channels: taew2_1; Wan 2.2 TI2V's 48: taew2_2), HunyuanVideo 1.5's, LTX-2.3's
//! and MiniMax-H3's when `taesd_path` is given.
//!
//! Like TAESD it works on diffusion latents and [0, 1] pixels directly, and its convolutions
//! are 2-D: a video is a batch of frames (`[W, H, C, T]` in the graphs). Time enters through
//! the memory blocks, which see each frame's predecessor (zeros before the first), and through
//! reshapes of channels into frames: the decoder's `TGrow` turns `s·C` channels of a frame into
//! `s` frames, the encoder's `TPool` the reverse. The decoder makes 4 frames of each latent
//! frame and drops the first 3 (`4t - 3`, Wan's count; LTX-2.3: 8 and 7, every stage doubling);
//! the encoder takes the frames padded to a multiple of 4 (8) with copies of the last one.
//! MiniMax-H3's frames come in chunks like its VAE's (see [`TaehvConfig::decode_chunk`]), and
//! its encoder takes chunks of 17 frames behind 3 zero frames (`Taehv::encode_chunks`: a
//! picture gives 2 latent frames, as in the reference). Weights live under `tae.` like TAESD's, named
//! like the torch `nn.Sequential` (`decoder.N...`, `encoder.N...`; ReLU, Upsample and Clamp
//! slots have no weights). The latent width and patch size come from the model's family, as
//! in the reference; a file made for the other width is an error naming it. A file with
//! `decoder.3.conv.6.weight` has the wide decoder (1024 → 512 → 256 → 64 channels, memory
//! blocks of 1×1 and grouped 3×3 convolutions), as the reference decides.

use super::wan::{check_video, per_item};
use super::Progress;
use crate::error::{Context as _, Result};
use crate::graph::nn::{conv_2d, scale, Conv2d};
use crate::graph::{Graph, Runner, Scope, T};
use crate::runtime::tiling::TemporalTiles;
use crate::tensor::Tensor;

pub use super::tae::PREFIX;

/// Decoder widths (the narrow decoder's): after the first convolution, then after each of
/// the three stages.
const DECODER_CHANNELS: [i64; 4] = [256, 128, 64, 64];
/// Encoder width.
const HIDDEN: i64 = 64;
/// Memory blocks per stage.
const BLOCKS: usize = 3;
/// Which decoder stages double the frames, and which encoder stages halve them, for 4 video
/// frames a latent frame (Wan, HunyuanVideo); with 8 (LTX-2.3) every stage does.
const TIME_UPSCALE: [bool; 3] = [false, true, true];
const TIME_DOWNSCALE: [bool; 3] = [true, true, false];

#[derive(Clone, Debug, PartialEq)]
pub struct TaehvConfig {
    /// 16 (Wan 2.1, Qwen-Image), 32 (HunyuanVideo 1.5) or 48 (Wan 2.2 TI2V).
    pub z_channels: i64,
    /// Pixels folded into channels around the network (Wan 2.2, HunyuanVideo: 2×2; LTX-2.3:
    /// 4×4).
    pub patch: i64,
    /// Video frames per latent frame: 4, or 8 (LTX-2.3).
    pub time_scale: usize,
    /// Latent frames per chunk of the family's own VAE, when its frames count in chunks
    /// (MiniMax-H3: 5 latent frames make 17 frames). The decoded frames are then cut into
    /// chunks of `time_scale` × that many, each chunk loses its last `time_scale - 1` frames,
    /// and the video its last 3 × `time_scale` (zero frames past the end when the count is
    /// not a whole number of chunks), as the reference trims them.
    pub decode_chunk: Option<usize>,
    /// Without the encoder (previews).
    pub decode_only: bool,
    /// The wide decoder (1024 → 512 → 256 → 64 channels, grouped convolutions), which the
    /// reference takes when the file has `decoder.3.conv.6.weight`.
    pub wide: bool,
}

impl TaehvConfig {
    /// The reference's choice by family, from the latents the family's VAE makes: their
    /// channels, patches around the network (which itself scales by 8: 2×2 for VAEs at 1/16,
    /// taew2_2 for Wan 2.2's 48 channels or HunyuanVideo 1.5's 32; 4×4 for LTX-2.3's 1/32;
    /// none at 1/8, taew2_1) and the frames a latent frame stands for.
    pub fn for_latents(z_channels: usize, vae_scale: usize, time_scale: usize, decode_only: bool) -> TaehvConfig {
        let patch = (vae_scale / 8).max(1) as i64;
        TaehvConfig { z_channels: z_channels as i64, patch, time_scale, decode_chunk: None, decode_only, wide: false }
    }

    /// Frames trimmed in chunks of this many latent frames (see [`TaehvConfig::decode_chunk`]).
    pub fn with_decode_chunk(self, decode_chunk: Option<usize>) -> TaehvConfig {
        TaehvConfig { decode_chunk, ..self }
    }

    /// Which decoded frames (of `decoded`; past the end, zeros) make the video, in order.
    fn kept_frames(&self, decoded: usize) -> Vec<usize> {
        let Some(chunk) = self.decode_chunk else { return (0..decoded).collect() };
        let k = self.time_scale;
        let span = chunk * k;
        let chunks = decoded.div_ceil(span);
        let keep = (chunks * (span - (k - 1))).saturating_sub(3 * k);
        (0..chunks).flat_map(|c| c * span..c * span + span - (k - 1)).take(keep).collect()
    }

    /// Which decoder stages double the frames.
    fn time_upscale(&self) -> [bool; 3] {
        if self.time_scale == 8 { [true; 3] } else { TIME_UPSCALE }
    }

    /// Which encoder stages halve them.
    fn time_downscale(&self) -> [bool; 3] {
        if self.time_scale == 8 { [true; 3] } else { TIME_DOWNSCALE }
    }

    /// Reads the decoder's kind from the file under `prefix` (wide when it has the reference's
    /// marker tensor) and checks the file is a TAEHV for these latents (the reference would
    /// fail to load another one).
    pub fn detect(mut self, prefix: &str, shape_of: impl Fn(&str) -> Option<Vec<i64>>) -> Result<TaehvConfig> {
        self.wide = shape_of(&format!("{prefix}decoder.3.conv.6.weight")).is_some();
        let first = format!("{prefix}decoder.1.weight");
        let Some(ne) = shape_of(&first) else {
            bail!("the tiny autoencoder (taesd_path) is not a TAEHV video autoencoder: no '{first}'");
        };
        let z = ne.get(2).copied().unwrap_or(0);
        ensure!(
            ne.len() == 4 && z == self.z_channels,
            "the tiny video autoencoder (taesd_path) is for {z}-channel latents ('{first}' {ne:?}); this model's are {} channels (taew2_1: 16, Wan 2.1; taew2_2: 48, Wan 2.2; HunyuanVideo 1.5: 32; MiniMax-H3: 24; LTX-2.3: 128)",
            self.z_channels
        );
        Ok(self)
    }

    /// Decoder widths: after the first convolution, then after each of the three stages.
    fn decoder_channels(&self) -> [i64; 4] {
        if self.wide {
            [1024, 512, 256, 64]
        } else {
            DECODER_CHANNELS
        }
    }

    /// Pixels per latent pixel.
    pub fn scale(&self) -> usize {
        8 * self.patch as usize
    }
}

/// Three convolutions over a frame and its predecessor, plus the frame: the network's memory.
struct MemBlock {
    conv: [Conv2d; 3],
}

impl MemBlock {
    fn new(s: &mut Scope, name: &str, c: i64) -> MemBlock {
        let mut s = s.sub(name);
        MemBlock {
            conv: [
                Conv2d::square(&mut s, "conv.0", 2 * c, c, 3, 1, 1),
                Conv2d::square(&mut s, "conv.2", c, c, 3, 1, 1),
                Conv2d::square(&mut s, "conv.4", c, c, 3, 1, 1),
            ],
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, past: T<'g>) -> T<'g> {
        let mut y = self.conv[0].forward(g, x.concat(past, 2)).relu_inplace();
        y = self.conv[1].forward(g, y).relu_inplace();
        y = self.conv[2].forward(g, y);
        y.add_inplace(x).relu_inplace()
    }
}

/// A convolution whose input and output channels are cut into `groups` equal groups, each
/// output group computed from its input group alone: one convolution per group on views of
/// the input and kernel, joined along the channels pairwise (the reference's order).
struct GroupedConv {
    conv: Conv2d,
    groups: i64,
}

impl GroupedConv {
    fn new(s: &mut Scope, name: &str, c: i64, groups: i64) -> GroupedConv {
        GroupedConv { conv: Conv2d::square(s, name, c / groups, c, 3, 1, 1), groups }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        if self.groups == 1 {
            return self.conv.forward(g, x);
        }
        let (w, b) = (g.param(self.conv.weight), g.opt_param(self.conv.bias));
        let ([xw, xh, c, n], xb) = (x.ne(), x.nb());
        let ([kw, kh, icg, oc], wb) = (w.ne(), w.nb());
        let ocg = oc / self.groups;
        let (stride, padding) = ((self.conv.stride.1, self.conv.stride.0), (self.conv.padding.1, self.conv.padding.0));
        let mut parts: Vec<T<'g>> = (0..self.groups as usize)
            .map(|i| {
                let xi = x.view(&[xw, xh, c / self.groups, n], &[xb[1], xb[2], xb[3]], i * icg as usize * xb[2]).cont();
                let wi = w.view(&[kw, kh, icg, ocg], &[wb[1], wb[2], wb[3]], i * ocg as usize * wb[3]);
                let bi = b.map(|b| b.view(&[ocg], &[], i * ocg as usize * b.nb()[0]));
                conv_2d(g, xi, wi, bi, stride, padding, (1, 1), 1.0)
            })
            .collect();
        while parts.len() > 1 {
            parts = parts.chunks(2).map(|p| if p.len() == 2 { p[0].concat(p[1], 2) } else { p[0] }).collect();
        }
        parts[0]
    }
}

/// The wide decoder's memory block: 1×1, grouped 3×3, 1×1, grouped 3×3 (64 channels a group).
struct WideMemBlock {
    squeeze: Conv2d,
    grouped: [GroupedConv; 2],
    mix: Conv2d,
}

impl WideMemBlock {
    fn new(s: &mut Scope, name: &str, c: i64) -> WideMemBlock {
        let mut s = s.sub(name);
        let groups = (c / 64).max(1);
        WideMemBlock {
            squeeze: Conv2d::square(&mut s, "conv.0", 2 * c, c, 1, 1, 0),
            grouped: [GroupedConv::new(&mut s, "conv.2", c, groups), GroupedConv::new(&mut s, "conv.6", c, groups)],
            mix: Conv2d::square(&mut s, "conv.4", c, c, 1, 1, 0),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, past: T<'g>) -> T<'g> {
        let mut y = self.squeeze.forward(g, x.concat(past, 2)).relu_inplace();
        y = self.grouped[0].forward(g, y).relu_inplace();
        y = self.mix.forward(g, y).relu_inplace();
        y = self.grouped[1].forward(g, y);
        y.add_inplace(x).relu_inplace()
    }
}

/// A memory block of either kind.
enum Memory {
    Narrow(MemBlock),
    Wide(WideMemBlock),
}

impl Memory {
    /// `x` [W, H, C, T] → [W, H, C, T], seeing each frame's predecessor (zeros before the
    /// first).
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [w, h, c, t] = x.ne();
        let padded = x.pad_ext([0, 0, 0, 1], [0, 0, 0, 0]);
        let nb = padded.nb();
        let past = padded.view(&[w, h, c, t], &[nb[1], nb[2], nb[3]], 0);
        match self {
            Memory::Narrow(b) => b.forward(g, x, past),
            Memory::Wide(b) => b.forward(g, x, past),
        }
    }
}

/// A 1×1 convolution without bias named `{name}.conv` (TGrow / TPool).
fn time_conv(s: &mut Scope, name: &str, cin: i64, cout: i64) -> Conv2d {
    Conv2d::new(&mut s.sub(name), "conv", cin, cout, (1, 1), (1, 1), (0, 0), false)
}

/// One decoder stage: memory blocks, nearest 2× upsampling, TGrow (`stride` frames out of
/// each), then a 3×3 convolution to the next width.
struct UpStage {
    blocks: Vec<Memory>,
    grow: Conv2d,
    stride: i64,
    conv: Conv2d,
}

/// One encoder stage: TPool (`stride` frames into one), a strided 3×3 convolution, memory
/// blocks.
struct DownStage {
    pool: Conv2d,
    stride: i64,
    conv: Conv2d,
    blocks: Vec<Memory>,
}

struct Encoder {
    first: Conv2d,
    stages: Vec<DownStage>,
    last: Conv2d,
}

pub struct Taehv {
    pub cfg: TaehvConfig,
    first: Conv2d,
    stages: Vec<UpStage>,
    last: Conv2d,
    encoder: Option<Encoder>,
}

/// Declares `BLOCKS` memory blocks (wide ones when `wide`) numbered from `*index`.
fn mem_blocks(s: &mut Scope, index: &mut usize, c: i64, wide: bool) -> Vec<Memory> {
    (0..BLOCKS)
        .map(|_| {
            *index += 1;
            let name = (*index - 1).to_string();
            if wide {
                Memory::Wide(WideMemBlock::new(s, &name, c))
            } else {
                Memory::Narrow(MemBlock::new(s, &name, c))
            }
        })
        .collect()
}

impl Taehv {
    /// Declares the weights under the scope (use a scope with prefix [`PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &TaehvConfig) -> Taehv {
        let ch = cfg.decoder_channels();
        let pp = cfg.patch * cfg.patch;
        let mut d = s.sub("decoder");
        // 0 is the clamp, 2 a ReLU.
        let first = Conv2d::square(&mut d, "1", cfg.z_channels, ch[0], 3, 1, 1);
        let mut i = 3;
        let mut stages = Vec::new();
        for (k, &up) in cfg.time_upscale().iter().enumerate() {
            let blocks = mem_blocks(&mut d, &mut i, ch[k], cfg.wide);
            i += 1; // upsample
            let stride = if up { 2 } else { 1 };
            let grow = time_conv(&mut d, &i.to_string(), ch[k], ch[k] * stride);
            let conv = Conv2d::new(&mut d, &(i + 1).to_string(), ch[k], ch[k + 1], (3, 3), (1, 1), (1, 1), false);
            i += 2;
            stages.push(UpStage { blocks, grow, stride, conv });
        }
        // i is a ReLU.
        let last = Conv2d::square(&mut d, &(i + 1).to_string(), ch[3], 3 * pp, 3, 1, 1);

        let encoder = (!cfg.decode_only).then(|| {
            let mut e = s.sub("encoder");
            // 1 is a ReLU.
            let first = Conv2d::square(&mut e, "0", 3 * pp, HIDDEN, 3, 1, 1);
            let mut i = 2;
            let mut stages = Vec::new();
            for down in cfg.time_downscale() {
                let stride = if down { 2 } else { 1 };
                let pool = time_conv(&mut e, &i.to_string(), HIDDEN * stride, HIDDEN);
                let conv = Conv2d::new(&mut e, &(i + 1).to_string(), HIDDEN, HIDDEN, (3, 3), (2, 2), (1, 1), false);
                i += 2;
                let blocks = mem_blocks(&mut e, &mut i, HIDDEN, false);
                stages.push(DownStage { pool, stride, conv, blocks });
            }
            let last = Conv2d::square(&mut e, &i.to_string(), HIDDEN, cfg.z_channels, 3, 1, 1);
            Encoder { first, stages, last }
        });
        Taehv { cfg: cfg.clone(), first, stages, last, encoder }
    }

    /// Latent frames `[w, h, z, t]` → frames `[s·w, s·h, 3, k·t - (k - 1)]` in about [0, 1]
    /// (k the time scale).
    pub fn decode_graph<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        // Soft clamp of the latents to ±3.
        let h = scale(z, 1.0 / 3.0, false).tanh_inplace();
        let mut h = scale(h, 3.0, true);
        h = self.first.forward(g, h).relu_inplace();
        for st in &self.stages {
            for b in &st.blocks {
                h = b.forward(g, h);
            }
            h = st.grow.forward(g, h.upscale(2));
            if st.stride != 1 {
                let [w, hh, c, t] = h.ne();
                h = h.reshape(&[w, hh, c / st.stride, t * st.stride]);
            }
            h = st.conv.forward(g, h);
        }
        h = self.last.forward(g, h.relu_inplace());
        if self.cfg.patch > 1 {
            h = super::autoencoder_kl::unpatchify_latent(h, self.cfg.patch);
        }
        let drop = (self.cfg.time_scale - 1) as i64;
        let [w, hh, c, t] = h.ne();
        let nb = h.nb();
        h.view(&[w, hh, c, t - drop], &[nb[1], nb[2], nb[3]], drop as usize * nb[3])
    }

    /// Frames `[W, H, 3, T]` in [0, 1] (T a multiple of the time scale k) → latent frames
    /// `[W/s, H/s, z, T/k]`.
    pub fn encode_graph<'g>(&self, g: &'g Graph, x: T<'g>) -> Result<T<'g>> {
        let enc = self.encoder.as_ref().context("this TAEHV was loaded for decoding only")?;
        let x = if self.cfg.patch > 1 { super::autoencoder_kl::patchify_latent(x, self.cfg.patch) } else { x };
        let mut h = enc.first.forward(g, x).relu_inplace();
        for st in &enc.stages {
            if st.stride != 1 {
                let [w, hh, c, t] = h.ne();
                h = h.reshape(&[w, hh, c * st.stride, t / st.stride]);
            }
            h = st.conv.forward(g, st.pool.forward(g, h));
            for b in &st.blocks {
                h = b.forward(g, h);
            }
        }
        Ok(enc.last.forward(g, h))
    }

    /// Latents `[w, h, t, z]` (video layout) → frames `[W, H, k·t - (k - 1), 3]`.
    fn decode_frames(&self, runner: &mut Runner, latents: &Tensor) -> Result<Tensor> {
        let z = latents.clone().reshape(&[latents.ne(0), latents.ne(1), latents.ne(2), latents.ne(3)])?;
        runner.compute(|g| {
            let frames = g.input(&z).permute(0, 1, 3, 2).cont();
            Ok(self.decode_graph(g, frames).permute(0, 1, 3, 2).cont())
        })
    }

    /// Frames `[W, H, T, 3]` (video layout) → latents `[w, h, ⌈T/k⌉, z]`; the frames are
    /// padded to a multiple of k with copies of the last one. The latents are sampled
    /// further: ggml's convolution sums, no Winograd (`graph::context::winograd_wanted`).
    fn encode_frames(&self, runner: &mut Runner, frames: &Tensor) -> Result<Tensor> {
        if self.cfg.decode_chunk.is_some() {
            return self.encode_chunks(runner, frames);
        }
        let (w, h, t, c) = (frames.ne(0), frames.ne(1), frames.ne(2), frames.ne(3));
        let ts = self.cfg.time_scale;
        let padded_t = t.div_ceil(ts) * ts;
        let mut data = Vec::with_capacity(w * h * padded_t * c);
        for ch in frames.data().chunks_exact(w * h * t) {
            data.extend_from_slice(ch);
            for _ in t..padded_t {
                data.extend_from_slice(&ch[(t - 1) * w * h..]);
            }
        }
        let x = Tensor::from_vec(&[w, h, padded_t, c], data)?;
        let winograd = runner.options.encoder_winograd();
        let out = runner.compute(|g| {
            let x = g.input(&x).permute(0, 1, 3, 2).cont();
            Ok(self.encode_graph(g, x)?.permute(0, 1, 3, 2).cont())
        });
        runner.options.cpu_winograd = winograd;
        out
    }
}

impl Taehv {
    /// MiniMax-H3's encoding: frames `[W, H, T, 3]` padded with copies of the last one to
    /// whole chunks of 17, each encoded alone behind 3 zero frames (5 latent frames), the
    /// last 3 latent frames dropped: `[w, h, 5·chunks - 3, z]` (a picture gives 2).
    fn encode_chunks(&self, runner: &mut Runner, frames: &Tensor) -> Result<Tensor> {
        const CHUNK: usize = 17;
        const LEAD: usize = 3;
        let (w, h, t, c) = (frames.ne(0), frames.ne(1), frames.ne(2), frames.ne(3));
        let plane = w * h;
        let chunks = t.div_ceil(CHUNK);
        let mut outs = Vec::with_capacity(chunks);
        let winograd = runner.options.encoder_winograd();
        let result = (|| -> Result<()> {
            for k in 0..chunks {
                let mut data = Vec::with_capacity(plane * (LEAD + CHUNK) * c);
                for ch in frames.data().chunks_exact(plane * t) {
                    data.resize(data.len() + LEAD * plane, 0.0);
                    for f in k * CHUNK..(k + 1) * CHUNK {
                        let f = f.min(t - 1);
                        data.extend_from_slice(&ch[f * plane..(f + 1) * plane]);
                    }
                }
                let x = Tensor::from_vec(&[w, h, LEAD + CHUNK, c], data)?;
                outs.push(runner.compute(|g| {
                    let x = g.input(&x).permute(0, 1, 3, 2).cont();
                    Ok(self.encode_graph(g, x)?.permute(0, 1, 3, 2).cont())
                })?);
            }
            Ok(())
        })();
        runner.options.cpu_winograd = winograd;
        result?;
        let (lw, lh, z) = (outs[0].ne(0), outs[0].ne(1), outs[0].ne(3));
        let per = outs[0].ne(2);
        let total = per * chunks;
        let kept = if total > LEAD { total - LEAD } else { total };
        let lplane = lw * lh;
        let mut data = Vec::with_capacity(lplane * kept * z);
        for ch in 0..z {
            let mut frames_left = kept;
            for o in &outs {
                let n = per.min(frames_left);
                data.extend_from_slice(&o.data()[ch * per * lplane..(ch * per + n) * lplane]);
                frames_left -= n;
            }
        }
        Tensor::from_vec(&[lw, lh, kept, z], data)
    }
}

/// The video of the decoder's frames `[W, H, T, C]` (the family's chunk trim, if any).
fn trim(cfg: &TaehvConfig, decoded: Tensor) -> Result<Tensor> {
    let (w, h, t, c) = (decoded.ne(0), decoded.ne(1), decoded.ne(2), decoded.ne(3));
    let kept = cfg.kept_frames(t);
    if kept.len() == t {
        return Ok(decoded);
    }
    let plane = w * h;
    let mut data = vec![0.0f32; plane * kept.len() * c];
    for (ch, out) in decoded.data().chunks_exact(plane * t).zip(data.chunks_exact_mut(plane * kept.len())) {
        for (dst, &f) in out.chunks_exact_mut(plane).zip(&kept) {
            if f < t {
                dst.copy_from_slice(&ch[f * plane..(f + 1) * plane]);
            }
        }
    }
    Tensor::from_vec(&[w, h, kept.len(), c], data)
}

/// TAEHV works on diffusion latents and [0, 1] pixels directly: no range mapping, no latent
/// scaling, no sampling. Pictures (Qwen-Image) are one-frame videos.
impl super::VaeNet for Taehv {
    fn name(&self) -> &'static str {
        "TAEHV"
    }

    fn scale(&self) -> usize {
        self.cfg.scale()
    }

    fn time_scale(&self) -> usize {
        self.cfg.time_scale
    }

    fn unit_range(&self) -> bool {
        false
    }

    fn encoder_output_channels(&self) -> i64 {
        self.cfg.z_channels
    }

    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        super::autoencoder_kl::check_input(image, 3, self.cfg.patch as usize, "taehv encode")?;
        per_item(image, |frame| self.encode_frames(runner, frame))
    }

    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        super::autoencoder_kl::check_input(latent, self.cfg.z_channels, 1, "taehv decode")?;
        per_item(latent, |frame| self.decode_frames(runner, frame))
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        z.clone()
    }

    /// The video's channels of a packed latent (LTX-2.3's audio dropped).
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        super::video_channels(z, self.cfg.z_channels as usize)
    }

    fn supports_video(&self) -> bool {
        true
    }

    fn encode_video(&self, runner: &mut Runner, frames: &Tensor) -> Result<Tensor> {
        let p = self.cfg.patch as usize;
        check_video(frames, 3, p, p, "taehv encode")?;
        self.encode_frames(runner, frames)
    }

    fn decode_video(&self, runner: &mut Runner, latents: &Tensor, _temporal: Option<TemporalTiles>, _progress: Progress<'_>) -> Result<Tensor> {
        check_video(latents, self.cfg.z_channels, 1, 1, "taehv decode")?;
        trim(&self.cfg, self.decode_frames(runner, latents)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::vae::testutil::{compare, cpu, load_taehv, pattern};
    use crate::models::vae::VaeNet;

    /// The first `t` frames of a video `[W, H, T, C, 1]`.
    fn first_frames(v: &Tensor, t: usize) -> Tensor {
        let (w, h, all, c) = (v.ne(0), v.ne(1), v.ne(2), v.ne(3));
        let data = v.data().chunks_exact(w * h * all).flat_map(|ch| ch[..w * h * t].to_vec()).collect();
        Tensor::from_vec(&[w, h, t, c, 1], data).unwrap()
    }

    fn assert_close(label: &str, a: &Tensor, b: &Tensor) {
        let (rel, abs) = compare(a, b);
        assert!(rel < 1e-5, "{label}: max rel {rel}, abs {abs}");
    }

    /// Frame counts, sizes and causality (a frame depends only on the frames before it) of
    /// both widths, decoding and encoding; pictures are one-frame videos.
    #[test]
    fn frames_are_causal_and_counted_like_wan() {
        for (file, wan22, tensors) in [("taew2_1.safetensors", false, 128), ("taew2_2.safetensors", true, 128), ("taew2_1_wide.safetensors", false, 146)] {
            let (store, tae) = load_taehv(file, wan22, false);
            assert_eq!((store.len(), tae.cfg.wide), (tensors, file.contains("wide")), "{file}");
            let (z, s) = (tae.cfg.z_channels as usize, tae.cfg.scale());
            let mut runner = Runner::new(cpu(), 2);

            let latents = pattern(&[4, 3, 3, z, 1], -4.0, 4.0, 5);
            let video = tae.decode_video(&mut runner, &latents, None, None).unwrap();
            assert_eq!(video.shape(), &[4 * s, 3 * s, 9, 3], "{file}");
            let mean = video.data().iter().sum::<f32>() / video.data().len() as f32;
            assert!(video.data().iter().all(|v| v.is_finite()) && (0.2..0.8).contains(&mean), "{file}: mean {mean}");
            // Two latent frames make the same first 5 frames; one makes the first frame, as
            // does the picture decode.
            let two = tae.decode_video(&mut runner, &first_frames(&latents, 2), None, None).unwrap();
            assert_close(file, &first_frames(&video.clone().reshape(&[4 * s, 3 * s, 9, 3, 1]).unwrap(), 5), &two.reshape(&[4 * s, 3 * s, 5, 3, 1]).unwrap());
            let one = first_frames(&latents, 1);
            let picture = tae.decode(&mut runner, &one.clone().reshape(&[4, 3, z, 1]).unwrap()).unwrap();
            assert_eq!(picture.shape(), &[4 * s, 3 * s, 3, 1]);
            let frame0 = first_frames(&video.reshape(&[4 * s, 3 * s, 9, 3, 1]).unwrap(), 1);
            assert_close(file, &frame0.reshape(&[4 * s, 3 * s, 3, 1]).unwrap(), &picture);

            // Frames 0-3 the same picture, frame 4 another: latent frame 0 is the picture's.
            let (pic, other) = (pattern(&[4 * s, 3 * s, 1, 3, 1], 0.0, 1.0, 6), pattern(&[4 * s, 3 * s, 1, 3, 1], 0.0, 1.0, 7));
            let plane = 4 * s * 3 * s;
            let mut data = Vec::new();
            for c in 0..3 {
                for _ in 0..4 {
                    data.extend_from_slice(&pic.data()[c * plane..(c + 1) * plane]);
                }
                data.extend_from_slice(&other.data()[c * plane..(c + 1) * plane]);
            }
            let frames = Tensor::from_vec(&[4 * s, 3 * s, 5, 3, 1], data).unwrap();
            let lat = tae.encode_video(&mut runner, &frames).unwrap();
            assert_eq!(lat.shape(), &[4, 3, 2, z], "{file}");
            let lat_pic = tae.encode(&mut runner, &pic.reshape(&[4 * s, 3 * s, 3, 1]).unwrap()).unwrap();
            assert_eq!(lat_pic.shape(), &[4, 3, z, 1]);
            let lat0 = first_frames(&lat.reshape(&[4, 3, 2, z, 1]).unwrap(), 1);
            assert_close(file, &lat0.reshape(&[4, 3, z, 1]).unwrap(), &lat_pic);
        }
    }

    /// MiniMax-H3's trim: 4t - 3 decoded frames, chunks of 20 keeping 17, the last 12 of the
    /// whole dropped: 2 latent frames make 5 frames, 7 make 22 (frames 17-19 dropped), 12 make
    /// 39, as the family counts them.
    #[test]
    fn minimax_frames_are_trimmed_by_chunks() {
        let cfg = TaehvConfig::for_latents(24, 16, 4, true).with_decode_chunk(Some(5));
        assert_eq!(cfg.patch, 2);
        let kept = |t: usize| cfg.kept_frames(4 * t - 3);
        assert_eq!(kept(2), (0..5).collect::<Vec<_>>());
        assert_eq!(kept(7), (0..17).chain(20..25).collect::<Vec<_>>());
        assert_eq!(kept(12), (0..17).chain(20..37).chain(40..45).collect::<Vec<_>>());
        for t in [2, 7, 12, 17] {
            assert_eq!(kept(t).len(), crate::models::diffusion::minimax_h3::video_frames(t), "{t} latent frames");
        }
        assert_eq!(TaehvConfig::for_latents(16, 8, 4, true).kept_frames(9), (0..9).collect::<Vec<_>>());

        // On a tensor: frame f of channel c holds f + 1 + 100 c.
        let (w, h, t) = (2, 1, 25);
        let data = (0..3).flat_map(|c| (0..t).flat_map(move |f| std::iter::repeat_n((f + 1 + 100 * c) as f32, w * h))).collect();
        let out = trim(&cfg, Tensor::from_vec(&[w, h, t, 3], data).unwrap()).unwrap();
        assert_eq!(out.shape(), &[w, h, 22, 3]);
        let firsts: Vec<f32> = out.data().chunks_exact(w * h).map(|f| f[0]).collect();
        let want: Vec<f32> = (0..3).flat_map(|c| (1..18).chain(21..26).map(move |f| (f + 100 * c) as f32)).collect();
        assert_eq!(firsts, want);
    }

    #[test]
    fn files_for_other_latents_are_refused() {
        let file = |f: &str| crate::models::vae::testutil::SafeFile::new(&crate::models::vae::testutil::fixture(f), PREFIX);
        let (w21, w22, wide, taesd) = (file("taew2_1.safetensors"), file("taew2_2.safetensors"), file("taew2_1_wide.safetensors"), file("taesd.safetensors"));
        let (c21, c22) = (TaehvConfig::for_latents(16, 8, 4, true), TaehvConfig::for_latents(48, 16, 4, true));
        assert_eq!((c21.patch, c22.patch, TaehvConfig::for_latents(32, 16, 4, true).patch), (1, 2, 2));
        let ltx = TaehvConfig::for_latents(128, 32, 8, true);
        assert_eq!((ltx.patch, ltx.time_upscale(), ltx.time_downscale()), (4, [true; 3], [true; 3]));
        assert!(!c21.clone().detect(PREFIX, |n| w21.shape_of(n)).unwrap().wide && !c22.clone().detect(PREFIX, |n| w22.shape_of(n)).unwrap().wide);
        assert!(c21.clone().detect(PREFIX, |n| wide.shape_of(n)).unwrap().wide);
        let e = c21.clone().detect(PREFIX, |n| w22.shape_of(n)).unwrap_err().to_string();
        assert!(e.contains("48-channel") && e.contains("16 channels"), "{e}");
        let e = c22.detect(PREFIX, |n| taesd.shape_of(n)).unwrap_err().to_string();
        assert!(e.contains("not a TAEHV") && e.contains("tae.decoder.1.weight"), "{e}");
    }
}
