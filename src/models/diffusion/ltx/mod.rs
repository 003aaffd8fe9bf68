//! LTX-2.3: the joint audio-video DiT of the reference's `ltxv.hpp` (`LTXAVModel`).
//!
//! - Weights under `model.diffusion_model.`; sizes come from the weights like the reference:
//!   widths from `patchify_proj` / `audio_patchify_proj`, heads from the attention gates'
//!   biases (or a head width that divides the model's), context widths from the text
//!   cross-attentions, `prompt_scale_shift_table` switches the text modulation on.
//! - The sampler's latent is packed: the 128 video channels `[W, H, T, 128]`, then the audio
//!   latent `[16 bins, A steps, 8 channels]` zero-padded to whole channels. Video tokens are
//!   the latent's cells (no patches), audio tokens its steps (8 × 16 features).
//! - The timestep (sigma) is scaled by 1000 for the streams' modulations and the prompt's;
//!   the audio-video cross-attentions read the sigma itself.
//! - The text is the LTXAV embedder's `[width, tokens]`: one context for both streams, or the
//!   video's and the audio's side by side; each stream's part goes through its embeddings
//!   connector (`connector.rs`) when the weights have one of that width, as the reference's
//!   (the caption projections, which the reference never builds, are not read).
//! - RoPE (`rope.rs`): per-head tables over (time, height, width) for video, time for audio
//!   and for the cross-attentions between them.

mod block;
pub mod connector;
pub mod rope;

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::Linear;
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::tensor::Tensor;
use block::{AvBlock, BlockDims, Stream, StreamTimes};
use connector::{Connector, ConnectorConfig};
use std::collections::BTreeSet;

/// Channels of the video latent and of the audio latent (8 channels × 16 mel bins).
pub const VIDEO_CHANNELS: usize = 128;
pub const AUDIO_CHANNELS: usize = 8;
pub const AUDIO_BINS: usize = 16;
/// Audio latent steps per second: 16 kHz, hops of 160 samples, 4 mel frames per step.
pub const AUDIO_STEPS_PER_SECOND: f32 = 16000.0 / 160.0 / 4.0;
const TIMESTEP_SCALE: f32 = 1000.0;
/// The Gemma states' width the reference takes a context twice as wide as for two streams.
const CAPTION_CHANNELS: i64 = 3840;
/// Contexts this long (or longer) as wide as both cross-attentions are already connected.
const CONNECTED_TOKENS: usize = 1024;
const TIME_FEATURES: i64 = 256;

/// Latent frames of `frames` video frames (8 per latent frame after the first).
pub fn latent_frames(frames: usize) -> usize {
    (frames.max(1) - 1) / 8 + 1
}

/// Video frames of `latent` latent frames.
pub fn video_frames(latent: usize) -> usize {
    (latent.max(1) - 1) * 8 + 1
}

/// Audio latent steps of `frames` video frames at `fps`.
pub fn audio_steps(frames: usize, fps: f32) -> usize {
    ((frames as f32 / fps) * AUDIO_STEPS_PER_SECOND).ceil() as usize
}

#[derive(Clone, Debug, PartialEq)]
pub struct LtxConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub hidden: i64,
    pub heads: i64,
    pub head_dim: i64,
    pub audio_in_channels: i64,
    pub audio_out_channels: i64,
    pub audio_hidden: i64,
    pub audio_heads: i64,
    pub audio_head_dim: i64,
    pub cross_dim: i64,
    pub audio_cross_dim: i64,
    pub layers: usize,
    pub prompt_adaln: bool,
    pub gated: bool,
    pub video_connector: Option<ConnectorConfig>,
    pub audio_connector: Option<ConnectorConfig>,
}

/// Heads × width of `hidden`: the gate's head count when it divides, else the first head width
/// of 128, 96, 80, 64, 48, 40, 32 giving 8..=64 heads, else 32 heads.
pub(super) fn layout(hidden: i64, heads: Option<i64>) -> (i64, i64) {
    if let Some(h) = heads.filter(|&h| h > 0 && hidden % h == 0) {
        return (h, hidden / h);
    }
    for d in [128, 96, 80, 64, 48, 40, 32] {
        if hidden % d == 0 && (8..=64).contains(&(hidden / d)) {
            return (hidden / d, d);
        }
    }
    (32, hidden / 32)
}

impl LtxConfig {
    /// The configuration under `prefix` (ending in '.'), read from the weights like the
    /// reference (what is missing keeps the released model's value).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> LtxConfig {
        let shape = |n: &str| shape_of(&format!("{prefix}{n}")).filter(|s| !s.is_empty());
        let has = |n: &str| types.contains_key(&format!("{prefix}{n}"));
        let mut c = LtxConfig {
            in_channels: 128,
            out_channels: 128,
            hidden: 3840,
            heads: 30,
            head_dim: 128,
            audio_in_channels: 128,
            audio_out_channels: 128,
            audio_hidden: 2048,
            audio_heads: 32,
            audio_head_dim: 64,
            cross_dim: 4096,
            audio_cross_dim: 2048,
            layers: 0,
            prompt_adaln: has("transformer_blocks.0.prompt_scale_shift_table"),
            gated: ["attn1", "audio_attn1", "attn2", "audio_attn2"].iter().any(|a| has(&format!("transformer_blocks.0.{a}.to_gate_logits.weight"))),
            video_connector: ConnectorConfig::detect(types, shape_of, prefix, "video_embeddings_connector"),
            audio_connector: ConnectorConfig::detect(types, shape_of, prefix, "audio_embeddings_connector"),
        };
        let gate_heads = |a: &str| shape(&format!("transformer_blocks.0.{a}.to_gate_logits.bias")).map(|s| s[0]).or(Some(32));
        if let Some(s) = shape("patchify_proj.weight").filter(|s| s.len() == 2) {
            (c.in_channels, c.hidden) = (s[0], s[1]);
            (c.heads, c.head_dim) = layout(c.hidden, gate_heads("attn1"));
        }
        if let Some(s) = shape("audio_patchify_proj.weight").filter(|s| s.len() == 2) {
            (c.audio_in_channels, c.audio_hidden) = (s[0], s[1]);
            c.audio_out_channels = c.audio_in_channels;
            (c.audio_heads, c.audio_head_dim) = layout(c.audio_hidden, gate_heads("audio_attn1"));
        }
        if let Some(s) = shape("proj_out.weight").filter(|s| s.len() == 2) {
            c.out_channels = s[1];
        }
        if let Some(s) = shape("audio_proj_out.weight").filter(|s| s.len() == 2) {
            c.audio_out_channels = s[1];
        }
        if let Some(s) = shape("transformer_blocks.0.attn2.to_k.weight") {
            c.cross_dim = s[0];
        }
        if let Some(s) = shape("transformer_blocks.0.audio_attn2.to_k.weight") {
            c.audio_cross_dim = s[0];
        }
        let blocks: BTreeSet<usize> = types
            .keys()
            .filter_map(|n| n.strip_prefix(prefix)?.strip_prefix("transformer_blocks."))
            .filter_map(|rest| rest.split_once('.')?.0.parse().ok())
            .collect();
        c.layers = blocks.iter().next_back().map_or(0, |&b| b + 1);
        sd_debug!(
            "ltxav: num_layers = {}, hidden_size = {}, num_attention_heads = {}, audio_hidden_size = {}, audio_num_attention_heads = {}",
            c.layers,
            c.hidden,
            c.heads,
            c.audio_hidden,
            c.audio_heads
        );
        c
    }

    /// What the graphs need that the reference asserts while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.layers > 0, "LTX-2.3: no transformer blocks (transformer_blocks.N)");
        for k in self.video_connector.iter().chain(&self.audio_connector) {
            ensure!(k.layers > 0, "LTX-2.3: an embeddings connector without blocks (transformer_1d_blocks.N)");
            ensure!(k.heads * k.head_dim == k.hidden && k.head_dim % 2 == 0, "LTX-2.3: an embeddings connector of {} heads of {} for width {}", k.heads, k.head_dim, k.hidden);
        }
        ensure!(
            self.in_channels as usize == VIDEO_CHANNELS && self.out_channels as usize == VIDEO_CHANNELS,
            "LTX-2.3: the video latent has {VIDEO_CHANNELS} channels, the transformer takes {} and gives {}",
            self.in_channels,
            self.out_channels
        );
        let audio = (AUDIO_CHANNELS * AUDIO_BINS) as i64;
        ensure!(
            self.audio_in_channels == audio && self.audio_out_channels == audio,
            "LTX-2.3: the audio latent has {audio} features per step, the transformer takes {} and gives {}",
            self.audio_in_channels,
            self.audio_out_channels
        );
        ensure!(
            self.heads * self.head_dim == self.hidden && self.audio_heads * self.audio_head_dim == self.audio_hidden,
            "LTX-2.3: {} heads of {} for width {}, {} of {} for the audio's {}",
            self.heads,
            self.head_dim,
            self.hidden,
            self.audio_heads,
            self.audio_head_dim,
            self.audio_hidden
        );
        ensure!(self.head_dim % 2 == 0 && self.audio_head_dim % 2 == 0, "LTX-2.3: head widths must be even for RoPE");
        Ok(())
    }

    fn rows(&self) -> i64 {
        if self.prompt_adaln {
            9
        } else {
            6
        }
    }
}

/// `adaln_single`-style embedder: the timestep's sinusoidal features through two linears
/// (`emb.timestep_embedder`), then SiLU and a projection to `rows` vectors.
#[derive(Clone, Copy, Debug)]
struct AdaLn {
    linear_1: Linear,
    linear_2: Linear,
    linear: Linear,
}

impl AdaLn {
    fn new(s: &mut Scope, dim: i64, rows: i64) -> AdaLn {
        let forced = |s: &mut Scope, name: &str, i: i64, o: i64| Linear::with_options(s, name, i, o, true, true);
        let mut e = s.sub("emb");
        let mut te = e.sub("timestep_embedder");
        AdaLn {
            linear_1: forced(&mut te, "linear_1", TIME_FEATURES, dim),
            linear_2: forced(&mut te, "linear_2", dim, dim),
            linear: forced(s, "linear", dim, rows * dim),
        }
    }

    /// (projection `[rows · dim, 1]`, embedded timestep `[dim, 1]`).
    fn forward<'g>(&self, g: &'g Graph, t: T<'g>) -> (T<'g>, T<'g>) {
        let emb = t.timestep_embedding(TIME_FEATURES as i32, 10000);
        let emb = self.linear_2.forward(g, self.linear_1.forward(g, emb).silu_inplace());
        (self.linear.forward(g, emb.silu()), emb)
    }
}

pub struct LtxModel {
    pub config: LtxConfig,
    patchify_proj: Linear,
    audio_patchify_proj: Linear,
    adaln: AdaLn,
    audio_adaln: AdaLn,
    prompt_adaln: Option<(AdaLn, AdaLn)>,
    video_cross_ss: AdaLn,
    a2v_gate: AdaLn,
    audio_cross_ss: AdaLn,
    v2a_gate: AdaLn,
    blocks: Vec<AvBlock>,
    scale_shift_table: W,
    audio_scale_shift_table: W,
    proj_out: Linear,
    audio_proj_out: Linear,
    video_connector: Option<Connector>,
    audio_connector: Option<Connector>,
}

/// Where each stream's text comes from in a context: its columns and the connector it goes
/// through, if any.
struct TextRoute<'m> {
    video: (i64, i64),
    audio: (i64, i64),
    video_connector: Option<&'m Connector>,
    audio_connector: Option<&'m Connector>,
}

impl LtxModel {
    /// The reference's reading of a context `width` wide of `tokens`: split when as wide as
    /// both cross-attentions (connected already at 1024 tokens or more) or twice Gemma's
    /// width, shared otherwise; a part goes through its stream's connector when as wide.
    fn route(&self, width: i64, tokens: usize) -> TextRoute<'_> {
        let c = &self.config;
        let both = c.cross_dim + c.audio_cross_dim;
        let (video, audio) = if width == both {
            ((0, c.cross_dim), (c.cross_dim, c.audio_cross_dim))
        } else if width == 2 * CAPTION_CHANNELS {
            ((0, CAPTION_CHANNELS), (CAPTION_CHANNELS, CAPTION_CHANNELS))
        } else {
            ((0, width), (0, width))
        };
        let connected = width == both && tokens >= CONNECTED_TOKENS;
        let video_connector = self.video_connector.as_ref().filter(|k| !connected && k.config.hidden == video.1);
        let audio_connector = self.audio_connector.as_ref().filter(|k| !connected && k.config.hidden == audio.1);
        TextRoute { video, audio, video_connector, audio_connector }
    }

    pub fn new(s: &mut Scope, c: &LtxConfig) -> LtxModel {
        let forced = |s: &mut Scope, name: &str, i: i64, o: i64| Linear::with_options(s, name, i, o, true, true);
        let rows = c.rows();
        let dims = BlockDims {
            video: c.hidden,
            audio: c.audio_hidden,
            video_heads: c.heads,
            audio_heads: c.audio_heads,
            video_head_dim: c.head_dim,
            audio_head_dim: c.audio_head_dim,
            video_context: c.cross_dim,
            audio_context: c.audio_cross_dim,
            gated: c.gated,
            prompt_adaln: c.prompt_adaln,
        };
        let mut table = |name: &str, dim: i64| {
            let ty = s.file_type(name).unwrap_or(F32);
            s.tensor(name, ty, &[dim, 2])
        };
        let scale_shift_table = table("scale_shift_table", c.hidden);
        let audio_scale_shift_table = table("audio_scale_shift_table", c.audio_hidden);
        LtxModel {
            config: c.clone(),
            patchify_proj: forced(s, "patchify_proj", c.in_channels, c.hidden),
            audio_patchify_proj: forced(s, "audio_patchify_proj", c.audio_in_channels, c.audio_hidden),
            adaln: AdaLn::new(&mut s.sub("adaln_single"), c.hidden, rows),
            audio_adaln: AdaLn::new(&mut s.sub("audio_adaln_single"), c.audio_hidden, rows),
            prompt_adaln: c
                .prompt_adaln
                .then(|| (AdaLn::new(&mut s.sub("prompt_adaln_single"), c.hidden, 2), AdaLn::new(&mut s.sub("audio_prompt_adaln_single"), c.audio_hidden, 2))),
            video_cross_ss: AdaLn::new(&mut s.sub("av_ca_video_scale_shift_adaln_single"), c.hidden, 4),
            a2v_gate: AdaLn::new(&mut s.sub("av_ca_a2v_gate_adaln_single"), c.hidden, 1),
            audio_cross_ss: AdaLn::new(&mut s.sub("av_ca_audio_scale_shift_adaln_single"), c.audio_hidden, 4),
            v2a_gate: AdaLn::new(&mut s.sub("av_ca_v2a_gate_adaln_single"), c.audio_hidden, 1),
            blocks: (0..c.layers).map(|i| AvBlock::new(&mut s.sub(&format!("transformer_blocks.{i}")), &dims)).collect(),
            scale_shift_table,
            audio_scale_shift_table,
            proj_out: forced(s, "proj_out", c.hidden, c.out_channels),
            audio_proj_out: forced(s, "audio_proj_out", c.audio_hidden, c.audio_out_channels),
            video_connector: c.video_connector.as_ref().map(|k| Connector::new(&mut s.sub("video_embeddings_connector"), k)),
            audio_connector: c.audio_connector.as_ref().map(|k| Connector::new(&mut s.sub("audio_embeddings_connector"), k)),
        }
    }

    /// The output norm (no affine), modulated by the table plus the embedded timestep (one,
    /// or one per token: `emb` `[dim, n]`).
    fn out_norm<'g>(g: &'g Graph, x: T<'g>, table: W, emb: T<'g>, dim: i64) -> T<'g> {
        let n = emb.ne()[1];
        let shape = g.new_tensor(emb.ty(), &[dim, 2, n]);
        let t = emb.reshape(&[dim, 1, n]).repeat(shape);
        let sum = g.param(table).reshape(&[dim, 2, 1]).repeat(shape).add(t);
        let nb = sum.nb();
        let row = |r: usize| {
            let v = sum.view(&[dim, 1, n], &[nb[1], nb[2]], r * nb[1]).cont();
            if n == 1 {
                v
            } else {
                v.reshape(&[dim, n])
            }
        };
        block::modulate(x.norm(1e-6), row(0), row(1))
    }

    /// One evaluation. `video` `[128, Nv]` (one row per latent cell), `audio` `[128, A]`,
    /// the contexts `[width, L]`, the sigma `[1]`, the video tokens' sigmas (`[1]` or `[Nv]`:
    /// conditioned frames are less noisy) and the rotation tables → (video rows, audio rows).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(&self, g: &'g Graph, video: T<'g>, audio: T<'g>, v_context: T<'g>, a_context: T<'g>, sigma: T<'g>, v_sigma: T<'g>, pe: &Pe<'g>) -> (T<'g>, T<'g>) {
        let c = &self.config;
        let vx = self.patchify_proj.forward(g, video);
        let ax = self.audio_patchify_proj.forward(g, audio);
        let scaled = v_sigma.scale(TIMESTEP_SCALE);
        let (v_main, v_emb) = self.adaln.forward(g, scaled);
        let scaled_a = sigma.scale(TIMESTEP_SCALE);
        let (a_main, a_emb) = self.audio_adaln.forward(g, scaled_a);
        let (v_prompt, a_prompt) = match &self.prompt_adaln {
            Some((vp, ap)) => (Some(vp.forward(g, scaled_a).0), Some(ap.forward(g, scaled_a).0)),
            None => (None, None),
        };
        let v_times = StreamTimes {
            main: v_main,
            prompt: v_prompt,
            cross_scale_shift: self.video_cross_ss.forward(g, sigma).0,
            cross_gate: self.a2v_gate.forward(g, sigma.scale(1.0)).0,
        };
        let a_times = StreamTimes {
            main: a_main,
            prompt: a_prompt,
            cross_scale_shift: self.audio_cross_ss.forward(g, sigma).0,
            cross_gate: self.v2a_gate.forward(g, sigma.scale(1.0)).0,
        };
        let (mut vx, mut ax) = (vx, ax);
        for b in &self.blocks {
            let v = Stream { x: vx, context: v_context, pe: pe.video, cross_pe: pe.video_cross, times: v_times };
            let a = Stream { x: ax, context: a_context, pe: pe.audio, cross_pe: pe.audio_cross, times: a_times };
            (vx, ax) = b.forward(g, &v, &a);
        }
        let vx = self.proj_out.forward(g, Self::out_norm(g, vx, self.scale_shift_table, v_emb, c.hidden));
        let ax = self.audio_proj_out.forward(g, Self::out_norm(g, ax, self.audio_scale_shift_table, a_emb, c.audio_hidden));
        (vx, ax)
    }
}

/// The rotation tables of one evaluation.
pub struct Pe<'g> {
    pub video: T<'g>,
    pub audio: T<'g>,
    pub video_cross: T<'g>,
    pub audio_cross: T<'g>,
}

/// The packed latent's shape: video `[W, H, T, 128]`, then `audio` steps.
#[derive(Clone, Copy, Debug)]
pub struct Packed {
    pub w: usize,
    pub h: usize,
    pub t: usize,
    pub audio: usize,
}

impl Packed {
    pub fn cells(&self) -> usize {
        self.w * self.h * self.t
    }

    pub fn video_len(&self) -> usize {
        self.cells() * VIDEO_CHANNELS
    }

    pub fn audio_len(&self) -> usize {
        self.audio * AUDIO_CHANNELS * AUDIO_BINS
    }

    /// Channels of the packed latent: the video's and whole channels holding the audio.
    pub fn channels(&self) -> usize {
        VIDEO_CHANNELS + self.audio_len().div_ceil(self.cells())
    }
}

/// Video latent `[W, H, T, C]` → rows `[C, cells]`.
fn video_rows(x: &[f32], cells: usize) -> Vec<f32> {
    let mut out = vec![0.0; cells * VIDEO_CHANNELS];
    for ch in 0..VIDEO_CHANNELS {
        for i in 0..cells {
            out[i * VIDEO_CHANNELS + ch] = x[ch * cells + i];
        }
    }
    out
}

/// Inverse of [`video_rows`].
fn video_latent(rows: &[f32], cells: usize, out: &mut [f32]) {
    for ch in 0..VIDEO_CHANNELS {
        for i in 0..cells {
            out[ch * cells + i] = rows[i * VIDEO_CHANNELS + ch];
        }
    }
}

/// Audio latent `[16 bins, A, 8 channels]` → rows `[8·16, A]` (bins fastest).
fn audio_rows(a: &[f32], steps: usize) -> Vec<f32> {
    let mut out = vec![0.0; a.len()];
    for c in 0..AUDIO_CHANNELS {
        for t in 0..steps {
            for f in 0..AUDIO_BINS {
                out[t * AUDIO_CHANNELS * AUDIO_BINS + c * AUDIO_BINS + f] = a[(c * steps + t) * AUDIO_BINS + f];
            }
        }
    }
    out
}

/// Inverse of [`audio_rows`].
fn audio_latent(rows: &[f32], steps: usize, out: &mut [f32]) {
    for c in 0..AUDIO_CHANNELS {
        for t in 0..steps {
            for f in 0..AUDIO_BINS {
                out[(c * steps + t) * AUDIO_BINS + f] = rows[t * AUDIO_CHANNELS * AUDIO_BINS + c * AUDIO_BINS + f];
            }
        }
    }
}

/// A loaded LTX-2.3 transformer.
pub type Ltx = Loaded<LtxModel>;

impl DiffusionModel for Loaded<LtxModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("LTX-2.3 needs a text context (no text encoder produced one)")?;
        let video = input.video.context("LTX-2.3 generates video (generate_video)")?;
        let (model, runner) = self.parts();
        let c = &model.config;
        let x = input.x;
        let s = x.shape();
        ensure!(s.len() == 5 && s[4] == 1, "LTX-2.3 takes one packed video latent [W, H, T, C, 1], got {s:?}");
        let fps = if video.fps > 0.0 { video.fps } else { 24.0 };
        // The last `keyframes` latent frames are appended keyframes.
        let frames = if video.frames > 0 { video.frames } else { video_frames(s[2]) };
        ensure!(video.keyframes < s[2], "LTX-2.3: {} keyframes behind a latent of {} frames", video.keyframes, s[2]);
        let target = s[2] - video.keyframes;
        let p = Packed { w: s[0], h: s[1], t: s[2], audio: audio_steps(frames, fps) };
        ensure!(p.audio > 0 && x.len() >= p.video_len() + p.audio_len(), "LTX-2.3: the packed latent {s:?} holds no {} audio steps", p.audio);
        ensure!(input.timesteps.len() == 1, "LTX-2.3 takes one timestep for the whole latent, got {}", input.timesteps.len());
        let mut times = rope::frame_times(target as i64, fps);
        if s[2] > target {
            let at = video.keyframe_at.context("LTX-2.3: latent frames behind the video's need the keyframes' frame index")?;
            times.extend(rope::keyframe_times(at, s[2] - target, fps));
        }
        if let Some(tt) = input.token_timesteps {
            ensure!(tt.len() == p.cells(), "LTX-2.3: {} token timesteps for {} video tokens", tt.len(), p.cells());
        }
        let width = context.ne(0) as i64;
        let tokens = context.ne(1) as i64;
        ensure!(tokens > 0, "LTX-2.3: the prompt gave no text tokens");
        let route = model.route(width, tokens as usize);
        let (v_ctx, a_ctx) = (route.video, route.audio);
        ensure!(
            v_ctx.1 == c.cross_dim && a_ctx.1 == c.audio_cross_dim,
            "the LTX-2.3 text states are {width} wide, the transformer reads {} (video) and {} (audio)",
            c.cross_dim,
            c.audio_cross_dim
        );

        let data = x.data();
        let vrows = video_rows(data, p.cells());
        let arows = audio_rows(&data[p.video_len()..p.video_len() + p.audio_len()], p.audio);
        let (w, h) = (p.w as i64, p.h as i64);
        let ahd = c.audio_head_dim as usize;
        let video_pe = rope::video(w, h, &times, c.hidden as usize, c.heads as usize);
        let audio_pe = rope::audio(p.audio as i64, c.audio_hidden as usize, c.audio_heads as usize, rope::MAX_POS[0]);
        let cross_len = |tokens: usize| 4 * ahd / 2 * tokens * c.audio_heads as usize;
        let cross_dim = c.audio_cross_dim as usize;
        let video_cross = rope::leading(rope::video_time(w, h, &times, cross_dim, c.audio_heads as usize, rope::MAX_POS[0]), cross_len(p.cells()));
        let audio_cross = rope::leading(rope::audio(p.audio as i64, cross_dim, c.audio_heads as usize, rope::MAX_POS[0]), cross_len(p.audio));
        let sigma = input.timesteps[0];
        let cells = p.cells() as i64;
        let outs = runner.compute_many(|g| {
            let v = g.input_f32(&vrows, &[VIDEO_CHANNELS as i64, cells]);
            let a = g.input_f32(&arows, &[(AUDIO_CHANNELS * AUDIO_BINS) as i64, p.audio as i64]);
            let ctx = g.input(context);
            let part = |(from, len): (i64, i64)| {
                if len == width {
                    return ctx;
                }
                let nb = ctx.nb();
                ctx.view(&[len, tokens], &[nb[1]], from as usize * nb[0]).cont()
            };
            let (vc, ac) = (part(v_ctx), part(a_ctx).cont());
            let vc = route.video_connector.map_or(vc, |k| k.forward_with_rope(g, vc.cont(), tokens as usize));
            let ac = route.audio_connector.map_or(ac, |k| k.forward_with_rope(g, ac, tokens as usize));
            let pe = Pe {
                video: g.input_f32(&video_pe, &[2, 2, c.head_dim / 2, cells * c.heads]),
                audio: g.input_f32(&audio_pe, &[2, 2, c.audio_head_dim / 2, p.audio as i64 * c.audio_heads]),
                video_cross: g.input_f32(&video_cross, &[2, 2, c.audio_head_dim / 2, cells * c.audio_heads]),
                audio_cross: g.input_f32(&audio_cross, &[2, 2, c.audio_head_dim / 2, p.audio as i64 * c.audio_heads]),
            };
            let sigma = g.input_f32(&[sigma], &[1]);
            let v_sigma = match input.token_timesteps {
                Some(tt) => g.input_f32(tt, &[cells]),
                None => sigma,
            };
            let (vo, ao) = model.forward(g, v, a, vc, ac, sigma, v_sigma, &pe);
            Ok(vec![vo, ao])
        })?;
        let mut out = vec![0.0; x.len()];
        video_latent(outs[0].data(), p.cells(), &mut out[..p.video_len()]);
        audio_latent(outs[1].data(), p.audio, &mut out[p.video_len()..p.video_len() + p.audio_len()]);
        Tensor::from_vec(s, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_and_audio_steps() {
        assert_eq!(latent_frames(9), 2);
        assert_eq!(latent_frames(5), 1);
        assert_eq!(video_frames(3), 17);
        // 9 frames at 16 fps: 0.5625 s, 14.06 steps → 15.
        assert_eq!(audio_steps(9, 16.0), 15);
        assert_eq!(audio_steps(1, 24.0), 2);
        let p = Packed { w: 2, h: 2, t: 2, audio: 15 };
        assert_eq!(p.channels(), 128 + 240);
    }

    #[test]
    fn layout_prefers_the_gate_heads() {
        assert_eq!(layout(64, Some(4)), (4, 16));
        assert_eq!(layout(3840, Some(32)), (32, 120));
        assert_eq!(layout(3840, None), (30, 128));
        assert_eq!(layout(2048, Some(32)), (32, 64));
    }

    #[test]
    fn rows_round_trip() {
        let cells = 6;
        let x: Vec<f32> = (0..cells * VIDEO_CHANNELS).map(|i| i as f32).collect();
        let mut back = vec![0.0; x.len()];
        video_latent(&video_rows(&x, cells), cells, &mut back);
        assert_eq!(back, x);
        let a: Vec<f32> = (0..3 * 128).map(|i| i as f32).collect();
        let mut back = vec![0.0; a.len()];
        audio_latent(&audio_rows(&a, 3), 3, &mut back);
        assert_eq!(back, a);
        // Step 1's first feature is channel 0, bin 0 of step 1.
        assert_eq!(audio_rows(&a, 3)[128], 16.0);
    }
}
