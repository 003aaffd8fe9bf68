//! MiniMax-H3: the joint audio-video DiT of the reference's `minimax_h3.hpp`.
//!
//! - Weights under `model.diffusion_model.`: `video_patch_proj` (2×2 patches of the 24-channel
//!   video latent), `audio_patch_proj` (the 32-channel audio latent, two rows per time step),
//!   `condition_proj` and a `token_refiner` for the text (skipped when the text is already as
//!   wide as the model), `time_embedder.proj_{in,out}`, `blocks.N` and `final_layer`
//!   (`video_out`, `audio_out`), and `rope.inv_freq`. Sizes are read from the weights.
//! - One sequence: text, audio, video tokens. Each block takes one adaLN projection of every
//!   distinct timestep for three modalities (video 0, text 1, audio 2) and modulates each run
//!   of tokens with its own row: the video's timestep is `1 - sigma`, the audio's follows the
//!   sigma from the video's flow shift to the audio's (3).
//! - RoPE over (time, height, width) rotates the first `6 · len(inv_freq)` dimensions of each
//!   head, the halves paired; text tokens sit at (i, 0, 0), audio rows on the time axis from
//!   the text's end, video frames 5/3 · (1, 4, 4, 4, 4, ..) apart.
//! - The latent the sampler sees is packed: the video's channels, then the audio latent's
//!   values (zero-padded to whole channels). The output is the negated velocity of both, the
//!   audio's scaled by the slope of its sigma against the video's.

use super::{DiffusionInput, DiffusionModel, RefRole};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, T, W, F32};
use crate::models::common::dit::{chunk, RmsNorm};
use crate::models::common::rope;
use crate::tensor::Tensor;
use std::collections::BTreeSet;

/// Frames of the latent video are this far apart on the time axis (× the 1, 4, 4, 4, 4 spans).
const FRAME_RESCALE: f32 = 5.0 / 3.0;
/// Audio latent channels and rows per time step (the reference fixes them).
pub const AUDIO_CHANNELS: usize = 32;
pub const AUDIO_ROWS: usize = 2;
/// The audio's flow shift (the reference fixes it).
pub const AUDIO_SHIFT: f32 = 3.0;
/// The video's flow shift when the request's is not finite.
pub const DEFAULT_VIDEO_SHIFT: f32 = 12.0;
/// The timestep keyframe tokens are modulated for (at least), and how much of a keyframe's
/// latent stays against noise.
pub const VISUAL_COND_TIMESTEP: f32 = 0.999;

#[derive(Clone, Debug, PartialEq)]
pub struct MinimaxH3Config {
    pub hidden_size: i64,
    pub num_layers: usize,
    pub refiner_layers: usize,
    pub num_heads: i64,
    pub head_dim: i64,
    pub ffn_hidden_size: i64,
    pub video_channels: i64,
    pub audio_channels: i64,
    pub text_dim: i64,
    pub timestep_input_dim: i64,
    pub time_hidden: i64,
    pub time_dim: i64,
    pub inv_freq_len: i64,
    /// `adaln_t_table` (a curve of modulations over the timestep) instead of the embedder.
    pub adaln_curve_grid: i64,
}

fn count_blocks(types: &TypeMap, prefix: &str) -> usize {
    let set: BTreeSet<usize> = types
        .keys()
        .filter_map(|n| n.strip_prefix(prefix))
        .filter_map(|rest| rest.split_once('.').and_then(|(i, _)| i.parse().ok()))
        .collect();
    set.len()
}

impl MinimaxH3Config {
    /// The configuration under `prefix` (ending in '.'), read from the weights like the
    /// reference (what is missing keeps the released model's value).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> MinimaxH3Config {
        let mut cfg = MinimaxH3Config {
            hidden_size: 5376,
            num_layers: 50,
            refiner_layers: 2,
            num_heads: 56,
            head_dim: 128,
            ffn_hidden_size: 14336,
            video_channels: 24,
            audio_channels: 32,
            text_dim: 5120,
            timestep_input_dim: 256,
            time_hidden: 5376,
            time_dim: 2688,
            inv_freq_len: 16,
            adaln_curve_grid: 0,
        };
        let shape = |n: &str| shape_of(&format!("{prefix}{n}")).filter(|s| !s.is_empty());
        if let Some(s) = shape("video_patch_proj.weight").filter(|s| s.len() == 2) {
            cfg.video_channels = s[0] / 4;
            cfg.hidden_size = s[1];
        }
        if let Some(s) = shape("audio_patch_proj.weight") {
            cfg.audio_channels = s[0];
        }
        cfg.num_layers = count_blocks(types, &format!("{prefix}blocks."));
        cfg.refiner_layers = count_blocks(types, &format!("{prefix}token_refiner.blocks."));
        if let Some(s) = shape("blocks.0.attn.q_norm.weight") {
            cfg.head_dim = s[0];
        }
        if let Some(s) = shape("blocks.0.attn.qkv_proj.weight").filter(|s| s.len() == 2) {
            cfg.num_heads = s[1] / (3 * cfg.head_dim.max(1));
        }
        if let Some(s) = shape("blocks.0.mlp.fc1.weight").filter(|s| s.len() == 2) {
            cfg.ffn_hidden_size = s[1] / 2;
        }
        if let Some(s) = shape("condition_proj.weight") {
            cfg.text_dim = s[0];
        }
        if let Some(s) = shape("adaln_t_table").filter(|s| s.len() == 2) {
            cfg.time_dim = s[0];
            cfg.adaln_curve_grid = s[1];
        } else {
            if let Some(s) = shape("time_embedder.proj_in.weight").filter(|s| s.len() == 2) {
                cfg.timestep_input_dim = s[0];
                cfg.time_hidden = s[1];
            }
            if let Some(s) = shape("time_embedder.proj_out.weight").filter(|s| s.len() == 2) {
                cfg.time_dim = s[1];
            }
        }
        if let Some(s) = shape("rope.inv_freq") {
            cfg.inv_freq_len = s[0];
        }
        sd_debug!(
            "minimax_h3: layers={}, hidden={}, heads={}, head_dim={}, ffn={}, adaln_curve={}",
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.head_dim,
            cfg.ffn_hidden_size,
            cfg.adaln_curve_grid
        );
        cfg
    }

    /// What the graphs need that the reference asserts while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.num_layers > 0, "MiniMax-H3: no transformer blocks (blocks.N)");
        ensure!(self.adaln_curve_grid == 0, "MiniMax-H3 with adaLN curves (adaln_t_table) is not supported yet");
        ensure!(self.head_dim > 0 && self.num_heads > 0, "MiniMax-H3: {} heads of {}", self.num_heads, self.head_dim);
        ensure!(
            6 * self.inv_freq_len <= self.head_dim && self.inv_freq_len > 0,
            "MiniMax-H3: its RoPE turns {} dimensions per head (rope.inv_freq of {}), the heads have {}",
            6 * self.inv_freq_len,
            self.inv_freq_len,
            self.head_dim
        );
        ensure!(
            self.audio_channels as usize == AUDIO_CHANNELS,
            "MiniMax-H3: the audio latent has {AUDIO_CHANNELS} channels, audio_patch_proj takes {}",
            self.audio_channels
        );
        Ok(())
    }

    fn video_dim(&self) -> i64 {
        self.video_channels * 4
    }
}

/// Q/K-normed attention over a fused qkv projection.
#[derive(Clone, Copy, Debug)]
struct Attention {
    qkv: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    out: Linear,
    heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(s: &mut Scope, cfg: &MinimaxH3Config) -> Attention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let inner = cfg.num_heads * d;
        Attention {
            qkv: Linear::new(s, "qkv_proj", h, 3 * inner, false),
            q_norm: RmsNorm::new(s, "q_norm", "weight", d, 1e-5, true),
            k_norm: RmsNorm::new(s, "k_norm", "weight", d, 1e-5, true),
            out: Linear::new(s, "out_proj", inner, h, false),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    /// x `[hidden, L, 1]`; `pe` rotates the first dimensions of each head (text refiner: none).
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: Option<T<'g>>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let shape = [self.head_dim, self.heads, l, n];
        let qkv = chunk(self.qkv.forward(g, x), 3, 0, true);
        let q = self.q_norm.forward(g, qkv[0].reshape(&shape));
        let k = self.k_norm.forward(g, qkv[1].reshape(&shape));
        let v = qkv[2].reshape(&shape);
        let (q, k) = match pe {
            Some(pe) => (partial_rope(g, q, pe), partial_rope(g, k, pe)),
            None => (heads_last(q), heads_last(k)),
        };
        let out = nn::attention(g, q, k, v, self.heads, None, true, g.options.flash_attn, 1.0 / 128.0);
        self.out.forward(g, out)
    }
}

/// `[d, heads, L, N]` → `[d, L, heads · N]`.
pub(crate) fn heads_last<'g>(x: T<'g>) -> T<'g> {
    let [d, heads, l, n] = x.ne();
    x.permute(0, 2, 1, 3).cont().reshape(&[d, l, heads * n])
}

/// The first `2 · pe.ne[2]` dimensions of each head `[d, heads, L, N]` rotated (halves
/// paired), the rest as they are → `[d, L, heads · N]`.
pub(crate) fn partial_rope<'g>(g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
    let [d, heads, l, n] = x.ne();
    let rot = pe.ne()[2] * 2;
    let nb = x.nb();
    let part = |from: i64, len: i64| x.view(&[len, heads, l, n], &[nb[1], nb[2], nb[3]], from as usize * nb[0]).cont();
    let rotated = rope::apply_rope_halves(g, part(0, rot), pe);
    if rot == d {
        return rotated;
    }
    rotated.concat(heads_last(part(rot, d - rot)), 0)
}

/// SwiGLU MLP whose products see the input scaled by 1/128 (f32 precision).
#[derive(Clone, Copy, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(s: &mut Scope, hidden: i64, ffn: i64) -> Mlp {
        let scaled = |mut l: Linear| {
            l.force_prec_f32 = true;
            l.scale = 1.0 / 128.0;
            l
        };
        Mlp { fc1: scaled(Linear::new(s, "fc1", hidden, 2 * ffn, false)), fc2: scaled(Linear::new(s, "fc2", ffn, hidden, false)) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let uv = chunk(self.fc1.forward(g, x), 2, 0, true);
        self.fc2.forward(g, uv[0].silu().mul(uv[1]))
    }
}

/// One block's norms, attention and MLP (`adaln`: its modulation projection, absent in the
/// text refiner).
#[derive(Clone, Copy, Debug)]
struct Block {
    norm1: RmsNorm,
    norm2: RmsNorm,
    attn: Attention,
    mlp: Mlp,
    adaln: Option<Linear>,
}

impl Block {
    fn new(s: &mut Scope, cfg: &MinimaxH3Config, modulated: bool) -> Block {
        let h = cfg.hidden_size;
        Block {
            norm1: RmsNorm::new(s, "norm1", "weight", h, 1e-5, true),
            norm2: RmsNorm::new(s, "norm2", "weight", h, 1e-5, true),
            attn: Attention::new(&mut s.sub("attn"), cfg),
            mlp: Mlp::new(&mut s.sub("mlp"), h, cfg.ffn_hidden_size),
            adaln: modulated.then(|| Linear::new(&mut s.sub("adaln_proj"), "linear", cfg.time_dim, h * 6 * 3, true)),
        }
    }

    fn refine<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = x.add(self.attn.forward(g, self.norm1.forward(g, x), None));
        x.add(self.mlp.forward(g, self.norm2.forward(g, x)))
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t_emb: T<'g>, spans: &[Span], pe: T<'g>, hidden: i64) -> T<'g> {
        let mods = self.adaln.expect("a modulated block").forward(g, t_emb.silu());
        let rows = |row: i64| modulation_row(mods, hidden, 6, 3, row);
        let modulate = |x: T<'g>, shift: usize, scale: usize| {
            join(spans.iter().map(|s| {
                let m = rows(s.row);
                let part = slice_tokens(x, s.start, s.end);
                part.add(part.mul(m[scale])).add(m[shift])
            }))
        };
        let gated = |x: T<'g>, update: T<'g>, gate: usize| {
            join(spans.iter().map(|s| {
                let m = rows(s.row);
                slice_tokens(x, s.start, s.end).add(slice_tokens(update, s.start, s.end).mul(m[gate]))
            }))
        };
        let h = modulate(self.norm1.forward(g, x), 0, 1);
        let x = gated(x, self.attn.forward(g, h, Some(pe)), 2);
        let h = modulate(self.norm2.forward(g, x), 3, 4);
        gated(x, self.mlp.forward(g, h), 5)
    }
}

/// Tokens `start..end` of `x` `[C, L, N]`, dense.
fn slice_tokens<'g>(x: T<'g>, start: i64, end: i64) -> T<'g> {
    let ne = x.ne();
    if ne[1] == 1 {
        return x;
    }
    let nb = x.nb();
    x.view(&[ne[0], end - start, ne[2], ne[3]], &[nb[1], nb[2], nb[3]], start as usize * nb[1]).cont()
}

/// Parts joined along the tokens.
fn join<'g>(parts: impl Iterator<Item = T<'g>>) -> T<'g> {
    parts.reduce(|a, b| a.concat(b, 1)).expect("at least one span")
}

/// The `expand` modulation vectors `[hidden, 1]` of row `row` (timestep · modalities +
/// modality) of a projection `[hidden · expand · modalities, timesteps]`.
fn modulation_row<'g>(projection: T<'g>, hidden: i64, expand: i64, modalities: i64, row: i64) -> Vec<T<'g>> {
    let rows = projection.ne()[1];
    let reshaped = projection.reshape(&[hidden * expand, rows * modalities]);
    let selected = slice_tokens(reshaped, row, row + 1);
    chunk(selected, expand, 0, true)
}

/// A run of tokens modulated with one projection row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub start: i64,
    pub end: i64,
    pub row: i64,
}

/// The sequence of one evaluation (text, audio, video): positions `[3, L]`, modulation spans,
/// the final layer's rows of video and audio, and the distinct timesteps embedded.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub positions: Vec<f32>,
    pub spans: Vec<Span>,
    pub audio: Span,
    pub video: Span,
    pub timesteps: Vec<f32>,
}

fn video_span(frame: usize) -> f32 {
    const SPANS: [f32; 5] = [1.0, 4.0, 4.0, 4.0, 4.0];
    FRAME_RESCALE * SPANS[frame % 5]
}

/// Positions of `dim` latent pixels' patches along one spatial axis, centred and scaled by the
/// latent's area.
fn spatial_axis(dim: usize, sqrt_area: f32) -> Vec<f32> {
    let count = dim / 2;
    let ratio = dim as f32 / sqrt_area;
    (0..count).map(|i| (i as f32 * (ratio / count as f32) + (1.0 - ratio) * 0.5) * 32.0).collect()
}

fn find_or_add(values: &mut Vec<f32>, v: f32) -> i64 {
    match values.iter().position(|&x| x == v) {
        Some(i) => i as i64,
        None => {
            values.push(v);
            values.len() as i64 - 1
        }
    }
}

/// A reference the transformer sees but does not denoise: a latent's size in latent pixels
/// and frames (`t` 0: none), the steps of its sound (0: none), and what it stands for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefTokens {
    pub w: usize,
    pub h: usize,
    pub t: usize,
    pub audio: usize,
    pub role: RefRole,
}

impl RefTokens {
    /// A keyframe, picture or silent video latent of `w`×`h`×`t`.
    pub fn video(w: usize, h: usize, t: usize, role: RefRole) -> RefTokens {
        RefTokens { w, h, t, audio: 0, role }
    }

    fn tokens(&self) -> usize {
        self.t * (self.h / 2) * (self.w / 2)
    }

    /// Positions `(h, w)` of its patches, centred and scaled by its own area.
    fn axes(&self) -> (Vec<f32>, Vec<f32>) {
        let area = ((self.w * self.h) as f32).sqrt();
        (spatial_axis(self.h, area), spatial_axis(self.w, area))
    }
}

/// Where a reference's tokens come from: `n` rows of the projected video or audio rows, in
/// sequence order (each source's rows are consumed in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    Video(i64),
    Audio(i64),
}

/// The order of the references' token runs in the sequence (a block's sound before its
/// picture).
pub fn pieces(refs: &[RefTokens]) -> Vec<Piece> {
    let mut out = Vec::new();
    for r in refs {
        if r.audio > 0 {
            out.push(Piece::Audio((r.audio * AUDIO_ROWS) as i64));
        }
        if r.t > 0 {
            out.push(Piece::Video(r.tokens() as i64));
        }
    }
    out
}

/// The layout of one evaluation: the text's tokens, the references' tokens (pictures
/// modulated for timestep `max(t_v, 0.999)`, sound for `max(t_a, 1)`), `audio_t` audio steps
/// and a `latent_t` × `latent_h` × `latent_w` video latent, at timesteps `t_v` (video) and
/// `t_a`. Keyframes sit at the time of the frame they stand for; Ref2VA's blocks (pictures,
/// videos, sound) come one after the other before the video, which starts after them in
/// time; a block's sound starts with it and sits at its picture's left and right edge.
/// The text's tokens are tagged (1 text, 0 a picture the LLM was shown): each run of one tag
/// is modulated as that modality.
#[allow(clippy::too_many_arguments)]
pub fn layout(tags: &[i32], latent_t: usize, latent_h: usize, latent_w: usize, audio_t: usize, refs: &[RefTokens], t_v: f32, t_a: f32) -> Layout {
    let text_len = tags.len();
    let sqrt_area = ((latent_h * latent_w) as f32).sqrt();
    let (h_axis, w_axis) = (spatial_axis(latent_h, sqrt_area), spatial_axis(latent_w, sqrt_area));
    let (w_low, w_high) = (w_axis.first().copied().unwrap_or(0.0), w_axis.last().copied().unwrap_or(0.0));
    let mut positions = Vec::new();
    let mut push = |t: f32, h: f32, w: f32| positions.extend_from_slice(&[t, h, w]);
    for i in 0..text_len {
        push(i as f32, 0.0, 0.0);
    }
    let mut timesteps = Vec::new();
    let video_row = find_or_add(&mut timesteps, t_v);
    let audio_row = find_or_add(&mut timesteps, t_a);
    let ref_row = find_or_add(&mut timesteps, t_v.max(VISUAL_COND_TIMESTEP));
    let ref_audio_row = find_or_add(&mut timesteps, t_a.max(1.0));
    let text = text_len as i64;
    let mut spans = Vec::new();
    let mut start = 0;
    for i in 1..=text_len {
        if i == text_len || tags[i] != tags[start] {
            spans.push(Span { start: start as i64, end: i as i64, row: video_row * 3 + tags[start] as i64 });
            start = i;
        }
    }
    let duration = (0..latent_t).fold(0.0f32, |d, t| d + video_span(t));
    // Ref2VA's blocks or keyframes: the two are not mixed.
    let blocks = refs.iter().any(|r| !matches!(r.role, RefRole::Keyframe(_)));
    let mut cursor = text_len as f32;
    let mut row = text;
    for r in refs {
        let (hs, ws) = if r.t > 0 { r.axes() } else { (Vec::new(), Vec::new()) };
        let keyframe_time = match r.role {
            RefRole::Keyframe(0) if !blocks => Some(text_len as f32),
            RefRole::Keyframe(_) if !blocks => Some(text_len as f32 + duration - FRAME_RESCALE),
            _ => None,
        };
        let mut end = cursor;
        if r.audio > 0 {
            let (lo, hi) = match (ws.first(), ws.last()) {
                (Some(&lo), Some(&hi)) => (lo, hi),
                _ => (w_low, w_high),
            };
            for w in [lo, hi] {
                for t in 0..r.audio {
                    push(cursor + t as f32, 0.0, w);
                }
            }
            let stop = row + (r.audio * AUDIO_ROWS) as i64;
            spans.push(Span { start: row, end: stop, row: ref_audio_row * 3 + 2 });
            row = stop;
            end = end.max(cursor + r.audio as f32);
        }
        if r.t > 0 {
            let mut time = keyframe_time.unwrap_or(cursor);
            for t in 0..r.t {
                for &h in &hs {
                    for &w in &ws {
                        push(time, h, w);
                    }
                }
                if keyframe_time.is_none() {
                    time += video_span(t);
                }
            }
            let stop = row + r.tokens() as i64;
            spans.push(Span { start: row, end: stop, row: ref_row * 3 });
            row = stop;
            // A video lasts as long as its frames, a picture one unit of time.
            end = match r.role {
                RefRole::Picture => end.max(cursor + 1.0),
                _ => end.max(time),
            };
        }
        if keyframe_time.is_none() {
            cursor = end;
        }
    }
    for w in [w_low, w_high] {
        for t in 0..audio_t {
            push(cursor + t as f32, 0.0, w);
        }
    }
    let audio_start = row;
    let audio_end = audio_start + (audio_t * AUDIO_ROWS) as i64;
    spans.push(Span { start: audio_start, end: audio_end, row: audio_row * 3 + 2 });
    let mut cursor = cursor;
    for t in 0..latent_t {
        for &h in &h_axis {
            for &w in &w_axis {
                push(cursor, h, w);
            }
        }
        cursor += video_span(t);
    }
    let video_end = audio_end + (latent_t * h_axis.len() * w_axis.len()) as i64;
    spans.push(Span { start: audio_end, end: video_end, row: video_row * 3 });
    Layout {
        positions,
        spans,
        audio: Span { start: audio_start, end: audio_end, row: audio_row },
        video: Span { start: audio_end, end: video_end, row: video_row },
        timesteps,
    }
}

/// `sigma` moved from flow shift `from` to `to`.
pub fn time_shift_sigma(sigma: f32, from: f32, to: f32) -> f32 {
    let base = sigma / (from + sigma * (1.0 - from));
    to * base / (1.0 + (to - 1.0) * base)
}

/// d(shifted sigma) / d(sigma) of [`time_shift_sigma`].
pub fn time_shift_slope(sigma: f32, from: f32, to: f32) -> f32 {
    let base = sigma / (from + sigma * (1.0 - from));
    let a = 1.0 + (from - 1.0) * base;
    let b = 1.0 + (to - 1.0) * base;
    to * a * a / (from * b * b)
}

/// The sinusoidal features (cos first) of `timesteps`, `dim` each, like the reference's host
/// `timestep_embedding` (frequencies in double precision).
fn timestep_features(timesteps: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half).map(|i| (-(10000f64.ln()) * i as f64 / half as f64).exp() as f32).collect();
    let mut out = vec![0.0; timesteps.len() * dim];
    for (i, &t) in timesteps.iter().enumerate() {
        for (j, &f) in freqs.iter().enumerate() {
            let arg = t * f;
            out[i * dim + j] = arg.cos();
            out[i * dim + j + half] = arg.sin();
        }
    }
    out
}

/// The MiniMax-H3 transformer whose weights live in a `ParamStore`.
pub struct MinimaxH3Model {
    pub config: MinimaxH3Config,
    video_patch_proj: Linear,
    audio_patch_proj: Linear,
    condition_proj: Linear,
    time_in: Linear,
    time_out: Linear,
    refiner: Vec<Block>,
    refiner_norm: RmsNorm,
    blocks: Vec<Block>,
    final_norm: RmsNorm,
    final_adaln: Linear,
    video_out: Linear,
    audio_out: Linear,
    inv_freq: W,
    /// The video's flow shift of the request (the audio's sigma follows it).
    pub flow_shift: f32,
}

impl MinimaxH3Model {
    pub fn new(s: &mut Scope, cfg: &MinimaxH3Config) -> MinimaxH3Model {
        let h = cfg.hidden_size;
        let forced = |s: &mut Scope, name: &str, i: i64, o: i64| Linear::with_options(s, name, i, o, true, true);
        let video_patch_proj = forced(s, "video_patch_proj", cfg.video_dim(), h);
        let audio_patch_proj = forced(s, "audio_patch_proj", cfg.audio_channels, h);
        let condition_proj = Linear::new(s, "condition_proj", cfg.text_dim, h, true);
        let mut te = s.sub("time_embedder");
        let time_in = forced(&mut te, "proj_in", cfg.timestep_input_dim, cfg.time_hidden);
        let time_out = forced(&mut te, "proj_out", cfg.time_hidden, cfg.time_dim);
        let mut tr = s.sub("token_refiner");
        let refiner = (0..cfg.refiner_layers).map(|i| Block::new(&mut tr.sub(&format!("blocks.{i}")), cfg, false)).collect();
        let refiner_norm = RmsNorm::new(&mut tr, "final_norm", "weight", h, 1e-5, true);
        let blocks = (0..cfg.num_layers).map(|i| Block::new(&mut s.sub(&format!("blocks.{i}")), cfg, true)).collect();
        let mut fl = s.sub("final_layer");
        let final_norm = RmsNorm::new(&mut fl, "norm", "weight", h, 1e-5, true);
        let final_adaln = Linear::new(&mut fl.sub("adaln_proj"), "linear", cfg.time_dim, h * 2, true);
        let video_out = forced(&mut fl, "video_out", h, cfg.video_dim());
        let audio_out = forced(&mut fl, "audio_out", h, cfg.audio_channels);
        let inv_freq = s.sub("rope").tensor("inv_freq", F32, &[cfg.inv_freq_len]);
        MinimaxH3Model {
            config: cfg.clone(),
            video_patch_proj,
            audio_patch_proj,
            condition_proj,
            time_in,
            time_out,
            refiner,
            refiner_norm,
            blocks,
            final_norm,
            final_adaln,
            video_out,
            audio_out,
            inv_freq,
            flow_shift: DEFAULT_VIDEO_SHIFT,
        }
    }

    /// The rotation table `[2, 2, 3 · len(inv_freq), L]` of positions `[3, L]`, built in the
    /// graph from `rope.inv_freq` as the reference does.
    fn rope<'g>(&self, g: &'g Graph, positions: T<'g>) -> T<'g> {
        let n = self.config.inv_freq_len;
        let seq = positions.ne()[1];
        let inv = g.param(self.inv_freq).reshape(&[n, 1]);
        let nb = positions.nb();
        let mut angles: Option<T<'g>> = None;
        for axis in 0..3 {
            let pos = positions.view(&[1, seq], &[nb[1]], axis * nb[0]).cont();
            let a = inv.repeat_4d([n, seq, 1, 1]).mul(pos);
            angles = Some(match angles {
                Some(acc) => acc.concat(a, 0),
                None => a,
            });
        }
        let angles = angles.expect("three axes");
        let [na, l, _, _] = angles.ne();
        let c = angles.cos().reshape(&[1, na, l, 1]);
        let s = angles.sin().reshape(&[1, na, l, 1]);
        let pe = c.concat(s.neg(), 0).concat(s, 0).concat(c, 0);
        pe.reshape(&[2, 2, na, l])
    }

    /// One evaluation: video patch rows `[4·C, K + Nv]` and audio rows `[32, R + 2·A]`
    /// (channel-major), the references' rows first (each source projected as one, as the
    /// reference does; `pieces` says how their tokens follow each other after the text), the
    /// text `[text_dim, L]`, timestep features `[D, n]`, positions `[3, L + K + R + 2A + Nv]` →
    /// (video rows `[4·C, Nv]`, audio rows `[32, 2·A]`), not yet negated.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(&self, g: &'g Graph, video: T<'g>, audio: T<'g>, context: T<'g>, t_features: T<'g>, positions: T<'g>, lay: &Layout, pieces: &[Piece]) -> (T<'g>, T<'g>) {
        let cfg = &self.config;
        let video = self.video_patch_proj.forward(g, video);
        let audio = self.audio_patch_proj.forward(g, audio);
        let (mut at_video, mut at_audio) = (0, 0);
        let mut refs = Vec::with_capacity(pieces.len());
        for piece in pieces {
            refs.push(match *piece {
                Piece::Video(n) => {
                    at_video += n;
                    slice_tokens(video, at_video - n, at_video)
                }
                Piece::Audio(n) => {
                    at_audio += n;
                    slice_tokens(audio, at_audio - n, at_audio)
                }
            });
        }
        let video = if at_video > 0 { slice_tokens(video, at_video, video.ne()[1]) } else { video };
        let audio = if at_audio > 0 { slice_tokens(audio, at_audio, audio.ne()[1]) } else { audio };
        let context = if context.ne()[0] == cfg.hidden_size {
            context
        } else {
            let mut x = self.condition_proj.forward(g, context);
            for b in &self.refiner {
                x = b.refine(g, x);
            }
            self.refiner_norm.forward(g, x)
        };
        let mut h = refs.into_iter().fold(context, |h, r| h.concat(r, 1));
        h = h.concat(audio, 1).concat(video, 1);
        let t_emb = self.time_out.forward(g, self.time_in.forward(g, t_features).silu());
        let pe = self.rope(g, positions);
        for b in &self.blocks {
            h = b.forward(g, h, t_emb, &lay.spans, pe, cfg.hidden_size);
        }
        let mods = self.final_adaln.forward(g, t_emb.silu());
        let apply = |s: Span| {
            let row = modulation_row(mods, cfg.hidden_size, 2, 1, s.row);
            let v = self.final_norm.forward(g, slice_tokens(h, s.start, s.end));
            v.add(v.mul(row[1])).add(row[0])
        };
        (self.video_out.forward(g, apply(lay.video)), self.audio_out.forward(g, apply(lay.audio)))
    }
}

/// The packed latent's parts: video `[W, H, T, C]` values, then the audio's.
pub struct Packed {
    pub w: usize,
    pub h: usize,
    pub t: usize,
    pub video_channels: usize,
    pub audio_len: usize,
}

impl Packed {
    fn video_len(&self) -> usize {
        self.w * self.h * self.t * self.video_channels
    }
}

/// Each (latent index, patch-row index) pair of the first `c` channels of a video latent
/// `[W, H, T, ..]` and its patch rows `[4·c, T·H/2·W/2]` (2×2 patches, channel-major).
fn patch_pairs(p: &Packed) -> impl Iterator<Item = (usize, usize)> + '_ {
    let (w, h, t, c) = (p.w, p.h, p.t, p.video_channels);
    let (wl, hl) = (w / 2, h / 2);
    (0..t * hl * wl).flat_map(move |token| {
        let (ti, hi, wi) = (token / (hl * wl), token / wl % hl, token % wl);
        (0..c * 4).map(move |f| {
            let (ci, ph, pw) = (f / 4, f / 2 % 2, f % 2);
            (((ci * t + ti) * h + hi * 2 + ph) * w + wi * 2 + pw, token * 4 * c + f)
        })
    })
}

/// Video latent → patch rows (see [`patch_pairs`]).
fn patchify(x: &[f32], p: &Packed) -> Vec<f32> {
    let mut out = vec![0.0; p.video_len()];
    for (latent, row) in patch_pairs(p) {
        out[row] = x[latent];
    }
    out
}

/// Inverse of [`patchify`], each value times `factor`.
fn unpatchify(rows: &[f32], p: &Packed, factor: f32, out: &mut [f32]) {
    for (latent, row) in patch_pairs(p) {
        out[latent] = rows[row] * factor;
    }
}

/// The audio latent `[A, 2, 32]` → rows `[32, 2·A]` (the two rows of a step A apart).
fn audio_rows(a: &[f32], len: usize) -> Vec<f32> {
    let mut out = vec![0.0; a.len()];
    for ch in 0..AUDIO_CHANNELS {
        for r in 0..AUDIO_ROWS {
            for t in 0..len {
                out[(r * len + t) * AUDIO_CHANNELS + ch] = a[(ch * AUDIO_ROWS + r) * len + t];
            }
        }
    }
    out
}

/// Inverse of [`audio_rows`], each value times `factor`.
fn audio_latent(rows: &[f32], len: usize, factor: f32, out: &mut [f32]) {
    for ch in 0..AUDIO_CHANNELS {
        for r in 0..AUDIO_ROWS {
            for t in 0..len {
                out[(ch * AUDIO_ROWS + r) * len + t] = rows[(r * len + t) * AUDIO_CHANNELS + ch] * factor;
            }
        }
    }
}

/// The frames the reference gives at 24 fps.
pub const FPS: usize = 24;

/// Latent frames of `frames` video frames: 2 for up to 5, then 5 per 17 frames.
pub fn latent_frames(frames: usize) -> usize {
    if frames <= 5 {
        2
    } else {
        (frames - 5) / 17 * 5 + 2
    }
}

/// Video frames of `latent` latent frames (the inverse of [`latent_frames`] on aligned counts).
pub fn video_frames(latent: usize) -> usize {
    if latent <= 2 {
        5
    } else {
        (latent - 2) / 5 * 17 + 5
    }
}

/// A request for `frames` frames gets at least 5, and 17k + 5.
pub fn align_frames(frames: usize) -> usize {
    let mut f = frames.max(5);
    while f % 17 != 5 {
        f += 1;
    }
    f
}

/// Audio latent steps of a `frames`-frame video at 24 fps (40 per second, at least one).
pub fn audio_latents(frames: usize) -> usize {
    ((frames as f64 * 40.0 / FPS as f64).round() as usize).max(1)
}

/// The references of an evaluation (`ref_latents` in order, as `VideoInput::ref_roles` says
/// what each stands for; a role of sound alone takes no latent, a video's sound and sound
/// alone come from `VideoInput::ref_audio_latents` `[steps, 2, 32]`) → their token counts and
/// their video patch rows and audio rows, in order.
fn reference_rows(input: &DiffusionInput<'_>, channels: usize) -> Result<(Vec<RefTokens>, Vec<f32>, Vec<f32>)> {
    let roles: Vec<RefRole> = match input.video.map(|v| v.ref_roles).filter(|r| !r.is_empty()) {
        Some(r) => r.to_vec(),
        // Bare latents are start keyframes (the reference's empty keyframe_indices).
        None => vec![RefRole::Keyframe(0); input.ref_latents.len()],
    };
    let sounds = input.video.map(|v| v.ref_audio_latents).unwrap_or(&[]);
    let mut latents = input.ref_latents.iter();
    let (mut refs, mut vrows, mut arows) = (Vec::new(), Vec::new(), Vec::new());
    let mut sound = |i: usize| -> Result<usize> {
        let a = sounds.get(i).with_context(|| format!("MiniMax-H3 reference audio {} is missing", i + 1))?;
        ensure!(
            a.shape().len() >= 3 && a.ne(1) == AUDIO_ROWS && a.ne(2) == AUDIO_CHANNELS && a.ne(0) > 0,
            "MiniMax-H3 reference audio {} has latent shape {:?}; it takes [steps, {AUDIO_ROWS}, {AUDIO_CHANNELS}]",
            i + 1,
            a.shape()
        );
        arows.extend(audio_rows(&a.data()[..a.ne(0) * AUDIO_ROWS * AUDIO_CHANNELS], a.ne(0)));
        Ok(a.ne(0))
    };
    for (i, &role) in roles.iter().enumerate() {
        let audio = match role {
            RefRole::Video { audio: Some(a) } | RefRole::Audio(a) => sound(a)?,
            _ => 0,
        };
        let (mut w, mut h, mut t) = (0, 0, 0);
        if !matches!(role, RefRole::Audio(_)) {
            let r = latents.next().with_context(|| format!("MiniMax-H3 reference {} has no latent", i + 1))?;
            (w, h, t) = (r.ne(0), r.ne(1), r.ne(2));
            ensure!(
                r.shape().len() >= 4 && r.ne(3) >= channels && w.is_multiple_of(2) && h.is_multiple_of(2) && t > 0,
                "MiniMax-H3 reference {} has latent shape {:?}; it takes [even W, even H, T, {channels}]",
                i + 1,
                r.shape()
            );
            vrows.extend(patchify(r.data(), &Packed { w, h, t, video_channels: channels, audio_len: 0 }));
        }
        refs.push(RefTokens { w, h, t, audio, role });
    }
    Ok((refs, vrows, arows))
}

/// A loaded MiniMax-H3 transformer.
pub type MinimaxH3 = Loaded<MinimaxH3Model>;

impl DiffusionModel for Loaded<MinimaxH3Model> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("MiniMax-H3 needs a text context (no LLM produced one)")?;
        ensure!(input.video.is_some(), "MiniMax-H3 generates video (generate_video)");
        let (model, runner) = self.parts();
        let cfg = &model.config;
        let x = input.x;
        let s = x.shape();
        ensure!(s.len() == 5 && s[4] == 1, "MiniMax-H3 takes one packed video latent [W, H, T, C, 1], got {s:?}");
        let p = Packed { w: s[0], h: s[1], t: s[2], video_channels: cfg.video_channels as usize, audio_len: audio_latents(video_frames(s[2])) };
        ensure!(p.w.is_multiple_of(2) && p.h.is_multiple_of(2), "MiniMax-H3's latent sides must be even, got {}x{}", p.w, p.h);
        let audio_values = p.audio_len * AUDIO_ROWS * AUDIO_CHANNELS;
        ensure!(p.audio_len > 0, "MiniMax-H3 needs an audio latent next to the video");
        ensure!(x.len() >= p.video_len() + audio_values, "MiniMax-H3: the packed latent {s:?} holds no {} audio steps", p.audio_len);
        ensure!(
            context.ne(0) as i64 == cfg.text_dim || context.ne(0) as i64 == cfg.hidden_size,
            "the LLM's hidden states are {} wide, the MiniMax-H3 transformer takes {} (condition_proj)",
            context.ne(0),
            cfg.text_dim
        );
        ensure!(context.ne(1) > 0, "MiniMax-H3: the prompt gave no text tokens");
        ensure!(input.timesteps.len() == 1, "MiniMax-H3 takes one timestep, got {}", input.timesteps.len());
        let sigma = (input.timesteps[0] / 1000.0).clamp(1e-6, 1.0);
        let shift = if model.flow_shift.is_finite() { model.flow_shift } else { DEFAULT_VIDEO_SHIFT };
        let t_v = 1.0 - sigma;
        let t_a = 1.0 - time_shift_sigma(sigma, shift, AUDIO_SHIFT);
        let slope = time_shift_slope(sigma, shift, AUDIO_SHIFT);
        let (refs, mut vrows, mut arows) = reference_rows(input, p.video_channels)?;
        let all_text;
        let tags: &[i32] = match &input.cond.token_types {
            Some(tags) => {
                ensure!(
                    tags.len() == context.ne(1) && tags.iter().all(|&t| t == 0 || t == 1),
                    "MiniMax-H3: {} token types for {} text tokens",
                    tags.len(),
                    context.ne(1)
                );
                tags
            }
            None => {
                all_text = vec![1; context.ne(1)];
                &all_text
            }
        };
        let lay = layout(tags, p.t, p.h, p.w, p.audio_len, &refs, t_v, t_a);
        let pieces = pieces(&refs);
        let ref_video_tokens: usize = refs.iter().map(RefTokens::tokens).sum();
        let ref_audio_rows: usize = refs.iter().map(|r| r.audio * AUDIO_ROWS).sum();
        let data = x.data();
        vrows.extend(patchify(data, &p));
        arows.extend(audio_rows(&data[p.video_len()..p.video_len() + audio_values], p.audio_len));
        let features = timestep_features(&lay.timesteps, cfg.timestep_input_dim as usize);
        let n_tokens = (p.t * (p.h / 2) * (p.w / 2)) as i64;
        let outs = runner.compute_many(|g| {
            let v = g.input_f32(&vrows, &[cfg.video_dim(), n_tokens + ref_video_tokens as i64]);
            let a = g.input_f32(&arows, &[cfg.audio_channels, (ref_audio_rows + p.audio_len * AUDIO_ROWS) as i64]);
            let ctx = g.input(context);
            let t = g.input_f32(&features, &[cfg.timestep_input_dim, lay.timesteps.len() as i64]);
            let pos = g.input_f32(&lay.positions, &[3, (lay.positions.len() / 3) as i64]);
            let (vo, ao) = model.forward(g, v, a, ctx, t, pos, &lay, &pieces);
            Ok(vec![vo, ao])
        })?;
        let mut out = vec![0.0; x.len()];
        unpatchify(outs[0].data(), &p, -1.0, &mut out[..p.video_len()]);
        audio_latent(outs[1].data(), p.audio_len, -slope, &mut out[p.video_len()..p.video_len() + audio_values]);
        Tensor::from_vec(s, out)
    }

    fn set_flow_shift(&mut self, shift: f32) {
        self.model.flow_shift = shift;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_of_text_audio_and_video() {
        // 2 text tokens, 3 audio steps, 2 frames of a 4x4 latent (2x2 patches each).
        let lay = layout(&[1; 2], 2, 4, 4, 3, &[], 0.25, 0.5);
        assert_eq!(lay.timesteps, vec![0.25, 0.5, 0.999, 1.0]);
        assert_eq!(lay.spans, vec![Span { start: 0, end: 2, row: 1 }, Span { start: 2, end: 8, row: 5 }, Span { start: 8, end: 16, row: 0 }]);
        assert_eq!(lay.positions.len(), 16 * 3);
        // Text with a picture's tokens (tag 0) inside: each run its own modality row.
        let tagged = layout(&[1, 0, 0, 1], 2, 4, 4, 3, &[], 0.25, 0.5);
        assert_eq!(&tagged.spans[..3], &[Span { start: 0, end: 1, row: 1 }, Span { start: 1, end: 3, row: 0 }, Span { start: 3, end: 4, row: 1 }]);
        assert_eq!(tagged.spans[3], Span { start: 4, end: 10, row: 5 });
        // Spatial axis of 4 pixels in a 4x4 latent: ratio 1, two patches at 0 and 16.
        assert_eq!(&lay.positions[2 * 3..2 * 3 + 3], &[2.0, 0.0, 0.0]);
        assert_eq!(&lay.positions[5 * 3..5 * 3 + 3], &[2.0, 0.0, 16.0]);
        assert_eq!(&lay.positions[8 * 3..8 * 3 + 3], &[2.0, 0.0, 0.0]);
        // The second frame is 5/3 later.
        assert_eq!(lay.positions[12 * 3], 2.0 + FRAME_RESCALE);
        let data: Vec<f32> = (0..4 * 4 * 2 * 24).map(|i| i as f32).collect();
        let p = Packed { w: 4, h: 4, t: 2, video_channels: 24, audio_len: 0 };
        let mut back = vec![0.0; data.len()];
        unpatchify(&patchify(&data, &p), &p, 1.0, &mut back);
        assert_eq!(back, data);
        let a: Vec<f32> = (0..3 * 2 * 32).map(|i| i as f32).collect();
        let mut back = vec![0.0; a.len()];
        audio_latent(&audio_rows(&a, 3), 3, 1.0, &mut back);
        assert_eq!(back, a);
    }

    /// Keyframes come between the text and the audio, each at the time of its frame (the end
    /// one at the last latent frame's), modulated for timestep 0.999 at least; the audio and
    /// video keep the positions they have without them.
    #[test]
    fn layout_with_keyframes() {
        let plain = layout(&[1; 2], 2, 4, 4, 3, &[], 0.25, 0.5);
        let keys = [RefTokens::video(4, 4, 1, RefRole::Keyframe(0)), RefTokens::video(4, 4, 1, RefRole::Keyframe(4))];
        let lay = layout(&[1; 2], 2, 4, 4, 3, &keys, 0.25, 0.5);
        assert_eq!(lay.timesteps, plain.timesteps);
        assert_eq!(
            lay.spans,
            vec![
                Span { start: 0, end: 2, row: 1 },
                Span { start: 2, end: 6, row: 6 },
                Span { start: 6, end: 10, row: 6 },
                Span { start: 10, end: 16, row: 5 },
                Span { start: 16, end: 24, row: 0 },
            ]
        );
        assert_eq!((lay.audio, lay.video), (Span { start: 10, end: 16, row: 1 }, Span { start: 16, end: 24, row: 0 }));
        assert_eq!(&lay.positions[2 * 3..6 * 3], &[2.0, 0.0, 0.0, 2.0, 0.0, 16.0, 2.0, 16.0, 0.0, 2.0, 16.0, 16.0]);
        // Two latent frames last 1 + 4 spans: the end keyframe sits at the start of the last.
        assert_eq!(lay.positions[6 * 3], 2.0 + (FRAME_RESCALE + FRAME_RESCALE * 4.0) - FRAME_RESCALE);
        assert_eq!(&lay.positions[10 * 3..], &plain.positions[2 * 3..]);
        // A step past 0.999 modulates keyframes with the video's own row.
        let late = layout(&[1; 2], 2, 4, 4, 3, &keys[..1], 0.9995, 0.5);
        assert_eq!(late.spans[1].row, 0);
    }

    /// Reference pictures come one after the other in time, one unit each, and the audio and
    /// video start after them.
    #[test]
    fn layout_with_reference_pictures() {
        let pic = RefTokens::video(4, 2, 1, RefRole::Picture);
        let lay = layout(&[1; 2], 2, 4, 4, 3, &[pic, pic], 0.25, 0.5);
        assert_eq!(lay.spans[1..3], [Span { start: 2, end: 4, row: 6 }, Span { start: 4, end: 6, row: 6 }]);
        // A 4x2 picture: one row of patches (height 2: at 8), two columns at 0 and 16 scaled by its area.
        let (hs, ws) = pic.axes();
        assert_eq!((hs.len(), ws.len()), (1, 2));
        assert_eq!(&lay.positions[2 * 3..4 * 3], &[2.0, hs[0], ws[0], 2.0, hs[0], ws[1]]);
        assert_eq!(lay.positions[4 * 3], 3.0);
        assert_eq!(lay.positions[6 * 3], 4.0);
        let plain = layout(&[1; 2], 2, 4, 4, 3, &[], 0.25, 0.5);
        assert_eq!(lay.positions[lay.video.start as usize * 3], plain.positions[plain.video.start as usize * 3] + 2.0);
    }

    /// A reference video's frames advance in time like the video's, and the next block starts
    /// where it ends.
    #[test]
    fn layout_with_a_reference_video() {
        let video = RefTokens::video(2, 2, 2, RefRole::Video { audio: None });
        let pic = RefTokens::video(2, 2, 1, RefRole::Picture);
        let lay = layout(&[1], 2, 4, 4, 3, &[video, pic], 0.25, 0.5);
        let times: Vec<f32> = lay.positions.chunks(3).map(|p| p[0]).collect();
        let after = (1.0 + FRAME_RESCALE * 1.0) + FRAME_RESCALE * 4.0;
        assert_eq!(&times[..4], &[0.0, 1.0, 1.0 + FRAME_RESCALE, after]);
        assert_eq!(times[4], after + 1.0);
    }
}
