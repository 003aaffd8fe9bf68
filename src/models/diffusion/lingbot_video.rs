//! LingBot Video: a single-stream video DiT with a mixture of experts, on the Wan2.1 VAE's
//! latents and conditioned by Qwen3-VL's text model, like the reference's `lingbot_video.hpp`.
//!
//! - Weights under `model.diffusion_model.`: `patch_embedder` (a linear layer over 1×2×2
//!   patches, channels fastest), `time_embedder.linear_{1,2}`, `time_modulation.1` (six
//!   vectors per token), `text_embedder` (RMS norm, linear, SiLU, linear), `blocks.N` and
//!   `norm_out_modulation.1` / `proj_out`.
//! - A block adds its own `scale_shift_table` to the six vectors; attention and feed-forward
//!   are each RMS-normed before (modulated) and after (`norm_post_*`), then added through a
//!   tanh gate. Attention has per-head RMS q/k norms and joint video + text tokens with 3-axis
//!   RoPE (θ 256, axes 32/48/48): video ids `[frame + text_len + 1, row, col]`, text ids
//!   `[i + 1, 0, 0]`.
//! - The feed-forward is a SwiGLU MLP, or, in blocks holding `ffn.experts.w1`, a mixture of
//!   experts: sigmoid router scores (plus `e_score_correction_bias` for choosing), the best
//!   two of four groups by the sum of their two best scores, the best 8 experts inside them,
//!   weights normalised and scaled by 2.5, and a shared expert. With any such block the
//!   reference fixes the mixture's sizes (128 experts of 768, one shared) whatever the file.
//! - The reference reads the configuration in sorted name order, so the head count comes from
//!   `blocks.0.attn.norm_q.weight` and the hidden size known *then* (the default 2048 unless a
//!   name ending in `patch_embedder.weight` sorts before the blocks); [`LingbotVideoConfig::detect`]
//!   follows the same order.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::matmul;
use crate::graph::nn::{LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{chunk, patchify, timestep_embedding, unpatchify, MlpEmbedder, RmsNorm};
use crate::models::common::rope::{self, embed_nd, Ids};
use crate::models::te::gpt_oss::sum_expert_outputs;
use crate::tensor::Tensor;
use ggml_sys as gs;

/// The spatial patch (the temporal one is 1).
const PATCH: i64 = 2;

#[derive(Clone, Debug, PartialEq)]
pub struct LingbotVideoConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub hidden_size: i64,
    pub num_heads: i64,
    pub depth: usize,
    pub intermediate_size: i64,
    pub text_dim: i64,
    pub freq_dim: i64,
    pub eps: f32,
    pub theta: f32,
    pub axes_dim: Vec<usize>,
    pub qkv_bias: bool,
    /// Blocks whose feed-forward is the mixture of experts.
    pub sparse_layers: Vec<usize>,
    pub moe: MoeConfig,
}

/// The mixture of experts' sizes and routing.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i64,
    pub experts_per_token: i64,
    pub intermediate_size: i64,
    pub shared_experts: i64,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub n_group: i64,
    pub topk_group: i64,
}

/// The digits at the start of `s` as the reference's `atoi` reads them (0 without any).
fn atoi(s: &str) -> usize {
    let digits: String = s.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().unwrap_or(0)
}

impl LingbotVideoConfig {
    /// The configuration under `prefix`, read in sorted name order like the reference (what
    /// is missing keeps the released model's value).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> LingbotVideoConfig {
        let mut cfg = LingbotVideoConfig {
            in_channels: 16,
            out_channels: 16,
            hidden_size: 2048,
            num_heads: 16,
            depth: 0,
            intermediate_size: 6144,
            text_dim: 2560,
            freq_dim: 256,
            eps: 1e-6,
            theta: 256.0,
            axes_dim: vec![32, 48, 48],
            qkv_bias: false,
            sparse_layers: Vec::new(),
            moe: MoeConfig {
                num_experts: 0,
                experts_per_token: 8,
                intermediate_size: 512,
                shared_experts: 0,
                norm_topk_prob: true,
                routed_scaling_factor: 1.0,
                n_group: 0,
                topk_group: 0,
            },
        };
        let patch_volume = PATCH * PATCH;
        let mut names: Vec<&String> = types.keys().filter(|n| n.starts_with(prefix)).collect();
        names.sort();
        for name in names {
            let shape = shape_of(name).unwrap_or_default();
            let two_d = shape.len() == 2;
            if name.ends_with("patch_embedder.weight") && two_d {
                cfg.hidden_size = shape[1];
                if shape[0] % patch_volume == 0 {
                    cfg.in_channels = shape[0] / patch_volume;
                }
            } else if name.ends_with("text_embedder.linear_1.weight") && two_d {
                cfg.text_dim = shape[0];
            } else if name.ends_with("time_embedder.linear_1.weight") && two_d {
                cfg.freq_dim = shape[0];
            } else if name.ends_with("blocks.0.attn.norm_q.weight") && shape.len() == 1 {
                if shape[0] > 0 {
                    cfg.num_heads = cfg.hidden_size / shape[0];
                }
            } else if name.contains(".attn.to_q.bias") {
                cfg.qkv_bias = true;
            } else if name.contains(".ffn.gate_proj.weight") && two_d {
                cfg.intermediate_size = shape[1];
            } else if name.contains(".ffn.experts.w1") && shape.len() == 3 {
                cfg.moe.num_experts = shape[2];
                cfg.moe.intermediate_size = shape[1];
            } else if name.contains(".ffn.shared_experts.gate_proj.weight") && two_d {
                if cfg.moe.intermediate_size > 0 {
                    cfg.moe.shared_experts = shape[1] / cfg.moe.intermediate_size;
                }
            } else if name.ends_with("proj_out.weight") && two_d {
                cfg.out_channels = shape[1] / patch_volume;
            }
            if let Some(at) = name.find("blocks.") {
                let index = atoi(&name[at + "blocks.".len()..]);
                cfg.depth = cfg.depth.max(index + 1);
                if name.contains(&format!("blocks.{index}.ffn.experts.w1")) && !cfg.sparse_layers.contains(&index) {
                    cfg.sparse_layers.push(index);
                }
            }
        }
        if cfg.depth == 0 {
            cfg.depth = 24;
        }
        cfg.sparse_layers.sort_unstable();
        if !cfg.sparse_layers.is_empty() {
            // The reference's fixed mixture, whatever the file holds.
            cfg.moe = MoeConfig {
                num_experts: 128,
                experts_per_token: 8,
                intermediate_size: 768,
                shared_experts: 1,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
                n_group: 4,
                topk_group: 2,
            };
        }
        sd_debug!(
            "lingbot_video: depth = {}, hidden_size = {}, heads = {}, text_dim = {}, experts = {}, sparse_layers = {}",
            cfg.depth,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.text_dim,
            cfg.moe.num_experts,
            cfg.sparse_layers.len()
        );
        cfg
    }

    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads.max(1)
    }

    /// What the graphs need that the reference asserts (or gets wrong) while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.num_heads > 0 && self.hidden_size % self.num_heads == 0,
            "LingBot Video: {} heads do not divide the hidden size {} (the head count comes from blocks.0.attn.norm_q with the hidden size read before it)",
            self.num_heads,
            self.hidden_size
        );
        let rot: usize = self.axes_dim.iter().sum();
        ensure!(
            self.head_dim() == rot as i64,
            "LingBot Video: heads of {} (hidden {} / {} heads), its RoPE turns {rot} dimensions per head",
            self.head_dim(),
            self.hidden_size,
            self.num_heads
        );
        ensure!(self.in_channels > 0 && self.out_channels > 0, "LingBot Video: {} input and {} output channels", self.in_channels, self.out_channels);
        if !self.sparse_layers.is_empty() {
            let m = &self.moe;
            ensure!(
                m.n_group > 0 && m.num_experts % m.n_group == 0 && m.num_experts / m.n_group >= 2 && m.topk_group <= m.n_group,
                "LingBot Video: {} experts in {} groups",
                m.num_experts,
                m.n_group
            );
            ensure!(m.experts_per_token <= m.num_experts, "LingBot Video: {} experts per token of {}", m.experts_per_token, m.num_experts);
        }
        Ok(())
    }
}

/// `x + x·scale + shift` with per-token `shift` and `scale` of `x`'s shape.
fn modulate_tokens<'g>(x: T<'g>, shift: T<'g>, scale: T<'g>) -> T<'g> {
    x.add(x.mul(scale)).add(shift)
}

#[derive(Clone, Copy, Debug)]
struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    to_out: Linear,
    heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(s: &mut Scope, cfg: &LingbotVideoConfig) -> Attention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let inner = cfg.num_heads * d;
        Attention {
            to_q: Linear::new(s, "to_q", h, inner, cfg.qkv_bias),
            to_k: Linear::new(s, "to_k", h, inner, cfg.qkv_bias),
            to_v: Linear::new(s, "to_v", h, inner, cfg.qkv_bias),
            norm_q: RmsNorm::new(s, "norm_q", "weight", d, cfg.eps, true),
            norm_k: RmsNorm::new(s, "norm_k", "weight", d, cfg.eps, true),
            to_out: Linear::new(s, "to_out", inner, h, true),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    /// x: [hidden, S, 1] → [hidden, S, 1].
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [_, s, n, _] = x.ne();
        let shape = [self.head_dim, self.heads, s, n];
        let q = self.norm_q.forward(g, self.to_q.forward(g, x).reshape(&shape));
        let k = self.norm_k.forward(g, self.to_k.forward(g, x).reshape(&shape));
        let v = self.to_v.forward(g, x).reshape(&shape);
        self.to_out.forward(g, rope::attention(g, q, k, v, pe, None))
    }
}

/// `down_proj(silu(gate_proj(x)) · up_proj(x))`.
#[derive(Clone, Copy, Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(s: &mut Scope, hidden: i64, ff: i64) -> Mlp {
        Mlp {
            gate_proj: Linear::new(s, "gate_proj", hidden, ff, false),
            up_proj: Linear::new(s, "up_proj", hidden, ff, false),
            down_proj: Linear::new(s, "down_proj", ff, hidden, false),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gate = self.gate_proj.forward(g, x).silu_inplace();
        self.down_proj.forward(g, gate.mul(self.up_proj.forward(g, x)))
    }
}

/// A weight in the file's type (the reference's `get_type`, f32 when absent).
fn file_typed(s: &mut Scope, leaf: &str, ne: &[i64]) -> W {
    let ty = s.file_type(leaf).unwrap_or(F32);
    s.tensor(leaf, ty, ne)
}

/// `ggml_argsort_top_k`: the indices of the `k` largest values of each row, best first.
fn top_k<'g>(x: T<'g>, k: i64) -> T<'g> {
    // SAFETY: a live f32 tensor of this graph; k is at most its row length (validated).
    x.wrap(unsafe { gs::ggml_argsort_top_k(x.ctx(), x.raw(), k as i32) })
}

/// The mixture of experts of a sparse block.
#[derive(Clone, Copy, Debug)]
struct Moe {
    router: W,
    correction_bias: Option<W>,
    w1: W,
    w2: W,
    w3: W,
    shared: Option<Mlp>,
}

impl Moe {
    fn new(s: &mut Scope, cfg: &LingbotVideoConfig) -> Moe {
        let (h, m) = (cfg.hidden_size, &cfg.moe);
        let (e, ff) = (m.num_experts, m.intermediate_size);
        let correction_bias = s.has("router.e_score_correction_bias").then(|| s.tensor("router.e_score_correction_bias", F32, &[e]));
        Moe {
            router: file_typed(s, "router.weight", &[h, e]),
            correction_bias,
            w1: file_typed(s, "experts.w1", &[h, ff, e]),
            w2: file_typed(s, "experts.w2", &[ff, h, e]),
            w3: file_typed(s, "experts.w3", &[h, ff, e]),
            shared: (m.shared_experts > 0).then(|| Mlp::new(&mut s.sub("shared_experts"), h, ff * m.shared_experts)),
        }
    }

    /// The experts each token uses `[k, tokens]` from its scores `[experts, tokens]`: the best
    /// `topk_group` groups by the sum of their two best scores, then the best `k` inside them.
    fn select<'g>(&self, g: &'g Graph, m: &MoeConfig, scores: T<'g>) -> T<'g> {
        let k = m.experts_per_token;
        if m.n_group <= 1 || m.topk_group <= 0 {
            return top_k(scores, k);
        }
        let (e, groups) = (m.num_experts, m.n_group);
        let tokens = scores.ne()[1];
        let per_group = e / groups;
        const GROUP_BEST: i64 = 2;
        let grouped = scores.reshape(&[per_group, groups, tokens]);
        let best = top_k(grouped, GROUP_BEST).cont().reshape(&[GROUP_BEST, groups * tokens]);
        let values = grouped.reshape(&[1, per_group, groups * tokens]).get_rows(best).reshape(&[GROUP_BEST, groups, tokens]);
        let nb = values.nb();
        let rank = |r: i64| values.view(&[1, groups, tokens], &[nb[1], nb[2]], r as usize * nb[0]);
        let mut group_scores = rank(0);
        for r in 1..GROUP_BEST {
            group_scores = group_scores.add(rank(r));
        }
        let chosen = top_k(group_scores.reshape(&[groups, tokens]), m.topk_group).cont();
        // Row `group` of the mask marks that group's experts.
        let mask: Vec<f32> = (0..groups).flat_map(|gr| (0..e).map(move |x| if x / per_group == gr { 1.0 } else { 0.0 })).collect();
        let mask = g.input_f32(&mask, &[e, groups, 1]).repeat(g.new_tensor(F32, &[e, groups, tokens]));
        let picked = mask.get_rows(chosen);
        let pnb = picked.nb();
        let group = |r: i64| picked.view(&[e, 1, tokens], &[pnb[1], pnb[2]], r as usize * pnb[1]);
        let mut allowed = group(0);
        for r in 1..m.topk_group {
            allowed = allowed.add(group(r));
        }
        let allowed = allowed.reshape(&[e, tokens]);
        let ones = g.input_f32(&vec![1.0; (e * tokens) as usize], &[e, tokens]);
        let excluded = allowed.sub(ones).scale(1.0e9);
        top_k(scores.add(excluded), k)
    }

    /// x: [hidden, S, N] → [hidden, S, N].
    fn forward<'g>(&self, g: &'g Graph, m: &MoeConfig, x: T<'g>) -> T<'g> {
        let [h, s, n, _] = x.ne();
        let tokens = s * n;
        let (e, k) = (m.num_experts, m.experts_per_token);
        let logits = matmul::mul_mat(g, g.param(self.router), x, false).reshape(&[e, tokens]);
        let probs = logits.sigmoid();
        let scores = match self.correction_bias {
            Some(b) => probs.add(g.param(b)),
            None => probs,
        };
        let picked = self.select(g, m, scores);
        let mut weights = probs.reshape(&[1, e, tokens]).get_rows(picked).reshape(&[k, tokens]);
        if m.norm_topk_prob && k > 1 {
            // At least f16's smallest normal, 2^-14, as the reference clamps.
            let sum = weights.sum_rows().clamp(1.0 / 16384.0, f32::INFINITY);
            weights = weights.div(sum);
        }
        if m.routed_scaling_factor != 1.0 {
            weights = weights.scale(m.routed_scaling_factor);
        }
        let weights = weights.reshape(&[1, k, tokens]);
        let flat = x.reshape(&[h, 1, tokens]);
        let by_experts = |w: W, input: T<'g>| {
            let w = g.param(w);
            // SAFETY: live tensors of this graph with the shapes ggml_mul_mat_id takes.
            input.wrap(unsafe { gs::ggml_mul_mat_id(input.ctx(), w.raw(), input.raw(), picked.raw()) })
        };
        let gate = by_experts(self.w1, flat).silu_inplace();
        let act = gate.mul(by_experts(self.w3, flat));
        let out = sum_expert_outputs(by_experts(self.w2, act).mul(weights)).reshape(&[h, s, n]);
        match &self.shared {
            Some(mlp) => out.add(mlp.forward(g, x)),
            None => out,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum FeedForward {
    Dense(Mlp),
    Experts(Moe),
}

#[derive(Clone, Copy, Debug)]
struct Block {
    scale_shift_table: W,
    norm1: RmsNorm,
    attn: Attention,
    norm_post_attn: RmsNorm,
    norm2: RmsNorm,
    ffn: FeedForward,
    norm_post_ffn: RmsNorm,
}

impl Block {
    fn new(s: &mut Scope, cfg: &LingbotVideoConfig, sparse: bool) -> Block {
        let (h, eps) = (cfg.hidden_size, cfg.eps);
        let ffn = if sparse {
            FeedForward::Experts(Moe::new(&mut s.sub("ffn"), cfg))
        } else {
            FeedForward::Dense(Mlp::new(&mut s.sub("ffn"), h, cfg.intermediate_size))
        };
        Block {
            scale_shift_table: s.tensor("scale_shift_table", F32, &[6 * h, 1]),
            norm1: RmsNorm::new(s, "norm1", "weight", h, eps, true),
            attn: Attention::new(&mut s.sub("attn"), cfg),
            norm_post_attn: RmsNorm::new(s, "norm_post_attn", "weight", h, eps, true),
            norm2: RmsNorm::new(s, "norm2", "weight", h, eps, true),
            ffn,
            norm_post_ffn: RmsNorm::new(s, "norm_post_ffn", "weight", h, eps, true),
        }
    }

    /// x: [hidden, S, 1], temb6: [6·hidden, S, 1] (the timestep's six vectors per token).
    fn forward<'g>(&self, g: &'g Graph, cfg: &LingbotVideoConfig, x: T<'g>, temb6: T<'g>, pe: T<'g>) -> T<'g> {
        let h = cfg.hidden_size;
        let table = g.param(self.scale_shift_table).reshape(&[6 * h, 1, 1]);
        let m = chunk(temb6.add(table), 6, 0, true);
        let (gate_msa, gate_mlp) = (m[2].tanh(), m[5].tanh());
        let attn_in = modulate_tokens(self.norm1.forward(g, x), m[0], m[1]);
        let attn_out = self.norm_post_attn.forward(g, self.attn.forward(g, attn_in, pe));
        let x = x.add(gate_msa.mul(attn_out));
        let ffn_in = modulate_tokens(self.norm2.forward(g, x), m[3], m[4]);
        let ffn_out = match &self.ffn {
            FeedForward::Dense(mlp) => mlp.forward(g, ffn_in),
            FeedForward::Experts(moe) => moe.forward(g, &cfg.moe, ffn_in),
        };
        x.add(gate_mlp.mul(self.norm_post_ffn.forward(g, ffn_out)))
    }
}

/// The text embedder: RMS norm, linear, SiLU, linear.
#[derive(Clone, Copy, Debug)]
struct TextEmbedder {
    norm: RmsNorm,
    linear_1: Linear,
    linear_2: Linear,
}

/// A LingBot Video transformer whose weights live in a `ParamStore`.
pub struct LingbotVideoModel {
    pub config: LingbotVideoConfig,
    patch_embedder: Linear,
    time_embedder: MlpEmbedder,
    time_modulation: Linear,
    text_embedder: TextEmbedder,
    blocks: Vec<Block>,
    norm_out: LayerNorm,
    norm_out_modulation: Linear,
    proj_out: Linear,
}

impl LingbotVideoModel {
    pub fn new(s: &mut Scope, cfg: &LingbotVideoConfig) -> LingbotVideoModel {
        let h = cfg.hidden_size;
        let patch = PATCH * PATCH;
        let mut t = s.sub("text_embedder");
        let text_embedder = TextEmbedder {
            norm: RmsNorm::new(&mut t, "norm", "weight", cfg.text_dim, cfg.eps, true),
            linear_1: Linear::new(&mut t, "linear_1", cfg.text_dim, h, true),
            linear_2: Linear::new(&mut t, "linear_2", h, h, true),
        };
        LingbotVideoModel {
            config: cfg.clone(),
            patch_embedder: Linear::new(s, "patch_embedder", patch * cfg.in_channels, h, true),
            time_embedder: MlpEmbedder::with_layers(s, "time_embedder", ["linear_1", "linear_2"], cfg.freq_dim, h, h, false),
            time_modulation: Linear::new(s, "time_modulation.1", h, 6 * h, true),
            text_embedder,
            blocks: (0..cfg.depth).map(|i| Block::new(&mut s.sub(&format!("blocks.{i}")), cfg, cfg.sparse_layers.contains(&i))).collect(),
            norm_out: LayerNorm { weight: None, bias: None, eps: cfg.eps },
            norm_out_modulation: Linear::new(s, "norm_out_modulation.1", h, 2 * h, true),
            proj_out: Linear::new(s, "proj_out", h, patch * cfg.out_channels, true),
        }
    }

    /// One evaluation: the latent video `x` `[W, H, T, C]`, the model timestep `t` `[1]`, the
    /// text `context` `[text_dim, L, 1]` and the rotation table of [`lingbot_pe`] →
    /// `[W, H, T, C_out]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, pe: T<'g>) -> T<'g> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let [w, hh, frames, _] = x.ne();
        let (wp, hp) = (w / PATCH, hh / PATCH);
        let n_img = wp * hp * frames;
        // Frames as the batch: one 2×2 patch per token, channels fastest, frame by frame.
        let img = patchify(x.permute(0, 1, 3, 2).cont(), PATCH, false).reshape(&[PATCH * PATCH * cfg.in_channels, n_img, 1]);
        let img = self.patch_embedder.forward(g, img);
        let te = &self.text_embedder;
        let txt = te.linear_2.forward(g, te.linear_1.forward(g, te.norm.forward(g, context)).silu_inplace());
        let mut x = img.concat(txt, 1);
        let tokens = x.ne()[1];

        let t_emb = self.time_embedder.forward(g, timestep_embedding(t, cfg.freq_dim as i32, 10000, 1.0));
        let temb = t_emb.reshape(&[h, 1, 1]).repeat(g.new_tensor(t_emb.ty(), &[h, tokens, 1]));
        let temb6 = self.time_modulation.forward(g, temb.silu());
        for block in &self.blocks {
            x = block.forward(g, cfg, x, temb6, pe);
        }

        let fm = chunk(self.norm_out_modulation.forward(g, temb.silu()), 2, 0, true);
        let x = modulate_tokens(self.norm_out.forward(g, x), fm[0], fm[1]);
        let x = self.proj_out.forward(g, x);
        let nb = x.nb();
        let video = x.view(&[x.ne()[0], n_img, 1], &[nb[1], nb[2]], 0).cont();
        let video = video.reshape(&[video.ne()[0], wp * hp, frames]);
        unpatchify(video, hp, wp, PATCH, false).permute(0, 1, 3, 2).cont()
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.in_channels as usize;
        ensure!(
            x.shape().len() == 5 && x.ne(4) == 1 && x.ne(3) == c && x.ne(0) > 0 && x.ne(1) > 0 && x.ne(2) > 0,
            "LingBot Video takes one latent video [W, H, T, {c}, 1], got {:?}",
            x.shape()
        );
        let p = PATCH as usize;
        ensure!(x.ne(0).is_multiple_of(p) && x.ne(1).is_multiple_of(p), "LingBot Video's latent sides must be multiples of {p}, got {}x{}", x.ne(0), x.ne(1));
        ensure!(
            context.ne(0) as i64 == cfg.text_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "LingBot Video's text embedder takes the LLM's hidden states [{}, L, 1], got {:?} (an LLM of another width?)",
            cfg.text_dim,
            context.shape()
        );
        ensure!(cfg.out_channels == cfg.in_channels, "LingBot Video with {} input and {} output channels", cfg.in_channels, cfg.out_channels);
        Ok(())
    }
}

/// Position ids of LingBot's tokens: the video's patches `[frame + text_len + 1, row, col]`,
/// then the text's `[i + 1, 0, 0]`.
pub fn lingbot_ids(frames: usize, h: usize, w: usize, context_len: usize) -> Ids {
    let p = PATCH as usize;
    let (h_len, w_len) = ((h + p / 2) / p, (w + p / 2) / p);
    let mut ids = Ids::new(3);
    let offset = context_len + 1;
    for f in 0..frames {
        for r in 0..h_len {
            for c in 0..w_len {
                ids.data.extend_from_slice(&[(f + offset) as f32, r as f32, c as f32]);
            }
        }
    }
    for j in 0..context_len {
        ids.data.extend_from_slice(&[(j + 1) as f32, 0.0, 0.0]);
    }
    ids
}

/// The rotation table `[2, 2, Σaxes / 2, tokens]` (host) of a `frames`×`h`×`w` latent with
/// `context_len` text tokens.
pub fn lingbot_pe(frames: usize, h: usize, w: usize, context_len: usize, theta: f32, axes_dim: &[usize]) -> Vec<f32> {
    embed_nd(&lingbot_ids(frames, h, w, context_len), theta, axes_dim, None)
}

/// A loaded LingBot Video transformer.
pub type LingbotVideo = Loaded<LingbotVideoModel>;

impl DiffusionModel for Loaded<LingbotVideoModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("LingBot Video needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context)?;
        ensure!(input.timesteps.len() == 1, "LingBot Video takes one timestep, got {}", input.timesteps.len());
        let cfg = &model.config;
        let (w, h, frames, c) = (input.x.ne(0), input.x.ne(1), input.x.ne(2), input.x.ne(3));
        let pe = lingbot_pe(frames, h, w, context.ne(1), cfg.theta, &cfg.axes_dim);
        let half: usize = cfg.axes_dim.iter().sum::<usize>() / 2;
        let tokens = pe.len() / half / 4;
        let t = [input.timesteps[0]];
        let out = runner.compute(|g| {
            let x = g.input_f32(input.x.data(), &[w as i64, h as i64, frames as i64, c as i64]);
            let t = g.input_f32(&t, &[1]);
            let ctx = g.input(context);
            let pe = g.input_f32(&pe, &[2, 2, half as i64, tokens as i64]);
            Ok(model.forward(g, x, t, ctx, pe))
        })?;
        out.reshape(&[w, h, frames, cfg.out_channels as usize, 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ParamStore;
    use std::collections::HashMap;

    fn synthetic(names: &[(&str, &[i64])]) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        for (n, s) in names {
            types.insert(format!("model.diffusion_model.{n}"), F32);
            shapes.insert(format!("model.diffusion_model.{n}"), s.to_vec());
        }
        (types, shapes)
    }

    /// Sizes come from the weights in sorted name order: the heads from the hidden size known
    /// when `blocks.0.attn.norm_q` is read; a block with experts fixes the mixture.
    #[test]
    fn config_from_weights() {
        let layout: &[(&str, &[i64])] = &[
            ("patch_embedder.weight", &[64, 128]),
            ("text_embedder.linear_1.weight", &[80, 128]),
            ("time_embedder.linear_1.weight", &[256, 128]),
            ("blocks.0.attn.norm_q.weight", &[128]),
            ("blocks.0.ffn.gate_proj.weight", &[128, 256]),
            ("blocks.1.ffn.experts.w1", &[128, 64, 8]),
            ("proj_out.weight", &[128, 64]),
        ];
        let (types, shapes) = synthetic(layout);
        let cfg = LingbotVideoConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        // "blocks.0.attn.norm_q" sorts before "patch_embedder": 2048 / 128 heads.
        assert_eq!((cfg.hidden_size, cfg.num_heads, cfg.depth, cfg.text_dim), (128, 16, 2, 80));
        assert!(cfg.validate().is_err());
        assert_eq!((cfg.sparse_layers.clone(), cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.intermediate_size), (vec![1], 128, 768, 256));
        let mut probed = layout.to_vec();
        probed.push(("a_probe.patch_embedder.weight", &[64, 128]));
        let (types, shapes) = synthetic(&probed);
        let cfg = LingbotVideoConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert_eq!((cfg.hidden_size, cfg.num_heads, cfg.in_channels, cfg.out_channels), (128, 1, 16, 16));
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        LingbotVideoModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
    }

    #[test]
    fn positions_put_the_video_after_the_text_on_the_frame_axis() {
        let ids = lingbot_ids(2, 4, 6, 3);
        assert_eq!(ids.len(), 2 * 2 * 3 + 3);
        let row = |i: usize| ids.data[i * 3..i * 3 + 3].to_vec();
        assert_eq!(row(0), vec![4., 0., 0.]);
        assert_eq!(row(5), vec![4., 1., 2.]);
        assert_eq!(row(6), vec![5., 0., 0.]);
        assert_eq!(row(12), vec![1., 0., 0.]);
        assert_eq!(row(14), vec![3., 0., 0.]);
    }
}
