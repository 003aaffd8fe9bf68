//! Gemma 2 2B's text model, PiD's text encoder (the reference's `LLMArch::GEMMA2_2B` in
//! `llm.hpp`): token embeddings scaled by √hidden; each block normalises before and after its
//! attention and before and after its MLP (RMS norms whose weights are offsets from 1:
//! `x̂·w + x̂`); grouped-query attention (8 query heads, 4 key/value heads of 256, no biases)
//! rotated by NeoX RoPE (base 10000) under the causal / padding mask; a GELU (tanh) gated MLP.
//! The reference reads no sliding window and no soft-capping for it (it never computes
//! logits), so neither exists here.
//!
//! Weights use the Hugging Face names under [`LLM_PREFIX`] like the other LLMs; layers,
//! width, vocabulary and MLP width come from the weights.

use super::llm::{causal_mask, LlmArch, LlmConfig, LLM_PREFIX};
use crate::error::Result;
use crate::graph::nn::{attention, Embedding, Linear};
use crate::graph::{Graph, RopeParams, Runner, Scope, TypeMap, F32, T, W};
use crate::tensor::Tensor;
use ggml_sys as gs;

pub const HEADS: i64 = 8;
pub const KV_HEADS: i64 = 4;
pub const HEAD_DIM: i64 = 256;
const EPS: f32 = 1e-6;
const ROPE: RopeParams = RopeParams {
    n_dims: HEAD_DIM as i32,
    mode: gs::GGML_ROPE_TYPE_NEOX as i32,
    n_ctx_orig: 8192,
    freq_base: 10000.0,
    freq_scale: 1.0,
    ext_factor: 0.0,
    attn_factor: 1.0,
    beta_fast: 32.0,
    beta_slow: 1.0,
};

#[derive(Clone, Debug, PartialEq)]
pub struct Gemma2Config {
    pub num_layers: usize,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub vocab_size: i64,
}

impl Gemma2Config {
    /// From the weights under `prefix` (ending in '.'), read like the other LLMs'
    /// (`LlmConfig::detect`: layers, width, vocabulary, MLP width).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Gemma2Config {
        let c = LlmConfig::detect(types, shape_of, prefix, LlmArch::Qwen3);
        Gemma2Config { num_layers: c.num_layers, hidden_size: c.hidden_size, intermediate_size: c.intermediate_size, vocab_size: c.vocab_size }
    }

    /// Hidden states per token when every one is read (the embeddings and one per layer).
    pub fn states(&self) -> usize {
        self.num_layers + 1
    }
}

/// RMS norm whose weight is an offset from 1 (`x̂·w + x̂`; Gemma 3's: `x̂·w`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Norm {
    weight: W,
    unit_offset: bool,
}

impl Norm {
    fn new(s: &mut Scope, name: &str, dim: i64) -> Norm {
        Norm { weight: s.sub(name).tensor("weight", F32, &[dim]), unit_offset: true }
    }

    pub(super) fn plain(s: &mut Scope, name: &str, dim: i64) -> Norm {
        Norm { unit_offset: false, ..Norm::new(s, name, dim) }
    }

    pub(super) fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = x.rms_norm(EPS);
        let y = x.mul(g.adapted_param(self.weight));
        if self.unit_offset {
            y.add_inplace(x)
        } else {
            y
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    input_norm: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_attention_norm: Norm,
    pre_ffw_norm: Norm,
    gate: Linear,
    up: Linear,
    down: Linear,
    post_ffw_norm: Norm,
}

impl Block {
    fn new(s: &mut Scope, cfg: &Gemma2Config) -> Block {
        let (h, ff) = (cfg.hidden_size, cfg.intermediate_size);
        let mut a = s.sub("self_attn");
        let (q, k, v, o) = (
            Linear::new(&mut a, "q_proj", h, HEADS * HEAD_DIM, false),
            Linear::new(&mut a, "k_proj", h, KV_HEADS * HEAD_DIM, false),
            Linear::new(&mut a, "v_proj", h, KV_HEADS * HEAD_DIM, false),
            Linear::new(&mut a, "o_proj", HEADS * HEAD_DIM, h, false),
        );
        let mut m = s.sub("mlp");
        let (gate, up, down) = (Linear::new(&mut m, "gate_proj", h, ff, false), Linear::new(&mut m, "up_proj", h, ff, false), Linear::new(&mut m, "down_proj", ff, h, false));
        Block {
            input_norm: Norm::new(s, "input_layernorm", h),
            q,
            k,
            v,
            o,
            post_attention_norm: Norm::new(s, "post_attention_layernorm", h),
            pre_ffw_norm: Norm::new(s, "pre_feedforward_layernorm", h),
            gate,
            up,
            down,
            post_ffw_norm: Norm::new(s, "post_feedforward_layernorm", h),
        }
    }

    fn attention<'g>(&self, g: &'g Graph, x: T<'g>, pos: T<'g>, mask: T<'g>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let q = self.q.forward(g, x).reshape(&[HEAD_DIM, HEADS, l, n]).rope_ext(pos, &ROPE);
        let k = self.k.forward(g, x).reshape(&[HEAD_DIM, KV_HEADS, l, n]).rope_ext(pos, &ROPE);
        let v = self.v.forward(g, x).reshape(&[HEAD_DIM, KV_HEADS, l, n]);
        self.o.forward(g, grouped_attention(g, q, k, v, HEADS, mask))
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pos: T<'g>, mask: T<'g>) -> T<'g> {
        let h = self.attention(g, self.input_norm.forward(g, x), pos, mask);
        let x = self.post_attention_norm.forward(g, h).add_inplace(x);
        let y = self.pre_ffw_norm.forward(g, x);
        self.post_ffw_norm.forward(g, gelu_mlp(g, [self.gate, self.up, self.down], y)).add_inplace(x)
    }
}

/// Attention of q, k `[d, heads, L, N]` (rotated) and v under the additive `mask`, the
/// LLMs' way (Gemma 2 and 3): heads first, then the reference's attention.
pub(super) fn grouped_attention<'g>(g: &'g Graph, q: T<'g>, k: T<'g>, v: T<'g>, heads: i64, mask: T<'g>) -> T<'g> {
    let heads_first = |t: T<'g>| {
        let ne = t.ne();
        t.permute(0, 2, 1, 3).cont().reshape(&[ne[0], ne[2], ne[1] * ne[3]])
    };
    attention(g, heads_first(q), heads_first(k), v, heads, Some(mask), true, false, 1.0)
}

/// `down(gelu(gate(y)) · up(y))`.
pub(super) fn gelu_mlp<'g>(g: &'g Graph, [gate, up, down]: [Linear; 3], y: T<'g>) -> T<'g> {
    down.forward(g, gate.forward(g, y).gelu_inplace().mul_inplace(up.forward(g, y)))
}

/// Token ids must index the embeddings.
pub(super) fn check_ids(ids: &[i32], vocab: i64, model: &str) -> Result<()> {
    if let Some(&bad) = ids.iter().find(|&&t| t < 0 || t as i64 >= vocab) {
        bail!("token id {bad} is outside the {model} model's {vocab} embeddings");
    }
    Ok(())
}

/// Gemma 2's text model whose weights live in a `ParamStore`.
pub struct Gemma2Model {
    pub cfg: Gemma2Config,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: Norm,
}

impl Gemma2Model {
    /// Declares every weight under the scope's prefix (e.g. [`LLM_PREFIX`]) + `model.`.
    pub fn new(s: &mut Scope, cfg: &Gemma2Config) -> Gemma2Model {
        let mut m = s.sub("model");
        let embed_tokens = Embedding::new(&mut m, "embed_tokens", cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers).map(|i| Block::new(&mut m.sub(&format!("layers.{i}")), cfg)).collect();
        let norm = Norm::new(&mut m, "norm", cfg.hidden_size);
        Gemma2Model { cfg: cfg.clone(), embed_tokens, layers, norm }
    }

    /// The normed final state `[hidden, L, N]` of `ids` (i32 `[L, N]`), positions `pos`
    /// (i32 `[L]`) and the additive mask `[L, L]`.
    pub fn forward<'g>(&self, g: &'g Graph, ids: T<'g>, pos: T<'g>, mask: T<'g>) -> T<'g> {
        let x = self.embed_tokens.forward(g, ids).scale_inplace((self.cfg.hidden_size as f32).sqrt());
        let x = self.layers.iter().fold(x, |x, b| b.forward(g, x, pos, mask));
        self.norm.forward(g, x)
    }
}

/// The normed final hidden states `[hidden, L, 1]` of `ids`, attending causally and never to
/// the tokens whose `keep` is false (padding).
pub fn hidden_states(runner: &mut Runner, model: &Gemma2Model, ids: &[i32], keep: &[bool]) -> Result<Tensor> {
    let cfg = &model.cfg;
    let len = ids.len();
    ensure!(len > 0 && keep.len() == len, "Gemma 2 input has {len} tokens and {} mask values", keep.len());
    ensure!(cfg.num_layers > 0, "the Gemma 2 text model has no layers");
    check_ids(ids, cfg.vocab_size, "Gemma 2")?;
    let mask = causal_mask(keep);
    let pos: Vec<i32> = (0..len as i32).collect();
    let out = runner.compute(|g| {
        let ids = g.input_i32(ids, &[len as i64, 1]);
        let pos = g.input_i32(&pos, &[len as i64]);
        let mask = g.input_f32(&mask, &[len as i64, len as i64]);
        Ok(model.forward(g, ids, pos, mask))
    })?;
    out.reshape(&[cfg.hidden_size as usize, len, 1])
}

/// Where the reference puts the text encoder's weights.
pub const PREFIX: &str = LLM_PREFIX;
