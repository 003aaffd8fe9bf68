//! GPT-OSS-20B's text model as Lens's text encoder (the reference's `llm.hpp` with
//! `LLMArch::GPT_OSS_20B`): pre-norm blocks with RMS norms (ε 1e-5), grouped-query attention
//! (64 query heads and 8 key/value heads of 64, with biases, the output projection too)
//! rotated by YaRN-scaled NeoX RoPE (base 150000, factor 32, original context 4096), whose
//! softmax has a learned per-head sink logit, under a causal mask that on every other layer
//! (0, 2, …) also hides keys 128 or more tokens back; and a mixture-of-experts MLP: a router
//! picks the 4 best of 32 experts per token, weighted by the softmax of their logits, each a
//! clamped SwiGLU (α 1.702, limit 7) with biases.
//!
//! Weights under [`LLM_PREFIX`] in the reference's names: `model.embed_tokens`,
//! `model.layers.N.{input_layernorm, post_attention_norm}`, `self_attn.{q,k,v,o}_proj`,
//! `self_attn.sinks`, `mlp.router`, `mlp.experts.gate_up_proj` (gate and up interleaved) or
//! `mlp.experts.{gate,up}_proj`, `mlp.experts.down_proj`, `model.norm`. Width, layers,
//! vocabulary and expert width come from the weights; heads, experts and RoPE are fixed.
//!
//! Like the shared LLM ([`super::llm`]), the encoder returns the outputs of the requested
//! layers (1-based; `num_layers + 1` the normed final state) concatenated along the features.

use super::llm::{causal_mask, LlmArch, LlmConfig, LLM_PREFIX};
use crate::error::Result;
use crate::graph::matmul;
use crate::graph::nn::{Embedding, Linear};
use crate::graph::{Graph, RopeParams, Runner, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::RmsNorm;
use crate::tensor::Tensor;
use ggml_sys as gs;

/// Keys this many tokens back (or more) are hidden on the sliding-window layers.
pub const SLIDING_WINDOW: usize = 128;

#[derive(Clone, Debug, PartialEq)]
pub struct GptOssConfig {
    pub num_layers: usize,
    pub hidden_size: i64,
    /// Width of one expert's SwiGLU.
    pub intermediate_size: i64,
    pub vocab_size: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub num_experts: i64,
    pub experts_per_token: i64,
    pub rms_norm_eps: f32,
    /// Gate and up projections in one tensor (`gate_up_proj`, interleaved), else two.
    pub combined_gate_up: bool,
    pub rope: RopeParams,
}

impl GptOssConfig {
    /// The configuration of the model under `prefix` (ending in '.'): layers from the highest
    /// block index, width and vocabulary from `embed_tokens`, expert width from the first
    /// layer's expert projections (ggml-order shapes from `shape_of`).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> GptOssConfig {
        let mut cfg = GptOssConfig {
            num_layers: 0,
            hidden_size: 2880,
            intermediate_size: 2880,
            vocab_size: 201088,
            num_heads: 64,
            num_kv_heads: 8,
            head_dim: 64,
            num_experts: 32,
            experts_per_token: 4,
            rms_norm_eps: 1e-5,
            combined_gate_up: false,
            rope: RopeParams {
                n_dims: 64,
                mode: gs::GGML_ROPE_TYPE_NEOX as i32,
                n_ctx_orig: 4096,
                freq_base: 150000.0,
                freq_scale: 1.0 / 32.0,
                ext_factor: 1.0,
                attn_factor: 1.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
            },
        };
        for name in types.keys().filter(|n| n.starts_with(prefix) && !n.contains("visual.")) {
            if let Some(i) = layer_index(name) {
                cfg.num_layers = cfg.num_layers.max(i + 1);
            }
            let Some(s) = shape_of(name).filter(|s| s.len() >= 2) else { continue };
            if name.ends_with("embed_tokens.weight") {
                cfg.hidden_size = s[0];
                cfg.vocab_size = s[1];
            } else if name.ends_with("layers.0.mlp.experts.gate_up_proj.weight") {
                cfg.intermediate_size = s[1] / 2;
                cfg.combined_gate_up = true;
            } else if name.ends_with("layers.0.mlp.experts.gate_proj.weight") {
                cfg.intermediate_size = s[1];
            }
        }
        sd_debug!(
            "llm: num_layers = {}, vocab_size = {}, hidden_size = {}, intermediate_size = {}",
            cfg.num_layers,
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.intermediate_size
        );
        cfg
    }

    /// The layers of `out_layers` this model has (in order) and whether the normed final
    /// state is appended (the shared LLM's rule, [`LlmConfig::read_layers`]).
    pub fn read_layers(&self, out_layers: &[i32]) -> (Vec<usize>, bool) {
        self.as_llm().read_layers(out_layers)
    }

    /// Width of [`hidden_states`] for `out_layers`.
    pub fn output_width(&self, out_layers: &[i32]) -> usize {
        self.as_llm().output_width(out_layers)
    }

    /// The shared LLM configuration with this model's depth and width (what the layer rule reads).
    fn as_llm(&self) -> LlmConfig {
        LlmConfig { num_layers: self.num_layers, hidden_size: self.hidden_size, ..LlmConfig::for_arch(LlmArch::Qwen3) }
    }

    /// Whether block `i` attends through the sliding window.
    pub fn is_sliding(i: usize) -> bool {
        i.is_multiple_of(2)
    }
}

/// Index of the block in `…layers.12.…`.
fn layer_index(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest.split('.').next()?.parse().ok()
}

fn rms_norm(s: &mut Scope, name: &str, dim: i64, eps: f32) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, eps, false)
}

/// A weight in the file's type, f32 when its rows do not fit the type's blocks (the
/// reference's `supported_type`).
/// The experts' weighted outputs `[hidden, k, tokens]` summed over the `k` picks one after
/// the other, as the reference adds them → `[hidden, tokens]`.
pub(crate) fn sum_expert_outputs(each: T<'_>) -> T<'_> {
    let [h, k, tokens, _] = each.ne();
    let nb = each.nb();
    let expert = |i: i64| each.view(&[h, tokens], &[nb[2]], i as usize * nb[1]);
    let mut out = expert(0);
    for i in 1..k {
        out = out.add(expert(i));
    }
    if k == 1 {
        out = out.cont();
    }
    out
}

fn matrix(s: &mut Scope, leaf: &str, ne: &[i64]) -> W {
    let mut ty = s.file_type(leaf).unwrap_or(F32);
    // SAFETY: pure lookup.
    if ne[0] % unsafe { gs::ggml_blck_size(ty) } != 0 {
        ty = F32;
    }
    s.tensor(leaf, ty, ne)
}

#[derive(Clone, Copy, Debug)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    sinks: W,
}

impl Attention {
    fn new(s: &mut Scope, cfg: &GptOssConfig) -> Attention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Attention {
            q: Linear::new(s, "q_proj", h, cfg.num_heads * d, true),
            k: Linear::new(s, "k_proj", h, cfg.num_kv_heads * d, true),
            v: Linear::new(s, "v_proj", h, cfg.num_kv_heads * d, true),
            o: Linear::new(s, "o_proj", cfg.num_heads * d, h, true),
            sinks: s.tensor("sinks", F32, &[cfg.num_heads]),
        }
    }

    /// x: [hidden, L, 1] → [hidden, L, 1]; the scores get `mask` `[L, L]` added, and each
    /// head's softmax has its sink.
    fn forward<'g>(&self, g: &'g Graph, cfg: &GptOssConfig, x: T<'g>, pos: T<'g>, mask: T<'g>) -> T<'g> {
        let l = x.ne()[1];
        let (d, heads, kv) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
        let q = self.q.forward(g, x).reshape(&[d, heads, l, 1]).rope_ext(pos, &cfg.rope);
        let k = self.k.forward(g, x).reshape(&[d, kv, l, 1]).rope_ext(pos, &cfg.rope);
        let v = self.v.forward(g, x).reshape(&[d, kv, l, 1]);
        let q = q.permute(0, 2, 1, 3).cont().reshape(&[d, l, heads]);
        let k = k.permute(0, 2, 1, 3).cont().reshape(&[d, l, kv]);
        // [L, d, kv]: the keys' positions first, for the product with the probabilities.
        let v = v.permute(1, 2, 0, 3).cont().reshape(&[l, d, kv]);
        let kq = matmul::mul_mat(g, k, q, true).scale_inplace(1.0 / (d as f32).sqrt()).add_inplace(mask).soft_max_inplace();
        // SAFETY: kq is the SOFT_MAX node just built; the sinks are an f32 [heads] tensor.
        unsafe { gs::ggml_soft_max_add_sinks(kq.raw(), g.param(self.sinks).raw()) };
        let out = matmul::mul_mat(g, v, kq, false).reshape(&[d, l, heads, 1]).permute(0, 2, 1, 3).cont().reshape(&[d * heads, l, 1]);
        self.o.forward(g, out)
    }
}

/// The experts' projections: `[in, out, experts]` weights, `[out, experts]` biases.
#[derive(Clone, Copy, Debug)]
struct Experts {
    weight: W,
    bias: W,
}

impl Experts {
    fn new(s: &mut Scope, name: &str, in_f: i64, out_f: i64, experts: i64) -> Experts {
        let mut s = s.sub(name);
        Experts { weight: matrix(&mut s, "weight", &[in_f, out_f, experts]), bias: s.tensor("bias", F32, &[out_f, experts]) }
    }

    /// x `[in, 1 or k, T]` through the experts `ids` `[k, T]` picks → `[out, k, T]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, ids: T<'g>) -> T<'g> {
        let (w, b) = (g.param(self.weight), g.param(self.bias));
        // SAFETY: live tensors of this graph with the shapes ggml_mul_mat_id / ggml_add_id take.
        let out = x.wrap(unsafe { gs::ggml_mul_mat_id(x.ctx(), w.raw(), x.raw(), ids.raw()) });
        out.wrap(unsafe { gs::ggml_add_id(out.ctx(), out.raw(), b.raw(), ids.raw()) })
    }
}

#[derive(Clone, Copy, Debug)]
enum GateUp {
    Combined(Experts),
    Split(Experts, Experts),
}

#[derive(Clone, Copy, Debug)]
struct MoeMlp {
    router: Linear,
    gate_up: GateUp,
    down: Experts,
}

impl MoeMlp {
    fn new(s: &mut Scope, cfg: &GptOssConfig) -> MoeMlp {
        let (h, ff, e) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
        let router = {
            let mut r = s.sub("router");
            Linear { weight: matrix(&mut r, "weight", &[h, e]), bias: Some(r.tensor("bias", F32, &[e])), force_prec_f32: false, scale: 1.0, int8: None }
        };
        let mut x = s.sub("experts");
        let gate_up = if cfg.combined_gate_up {
            GateUp::Combined(Experts::new(&mut x, "gate_up_proj", h, 2 * ff, e))
        } else {
            GateUp::Split(Experts::new(&mut x, "gate_proj", h, ff, e), Experts::new(&mut x, "up_proj", h, ff, e))
        };
        MoeMlp { router, gate_up, down: Experts::new(&mut x, "down_proj", ff, h, e) }
    }

    /// x: [hidden, L, 1] → [hidden, L, 1].
    fn forward<'g>(&self, g: &'g Graph, cfg: &GptOssConfig, x: T<'g>) -> T<'g> {
        let [h, l, n, _] = x.ne();
        let tokens = l * n;
        let (e, k, ff) = (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size);
        let logits = self.router.forward(g, x).reshape(&[e, tokens]);
        // SAFETY: a live [experts, tokens] f32 tensor.
        let picked = logits.wrap(unsafe { gs::ggml_argsort_top_k(logits.ctx(), logits.raw(), k as i32) });
        let weights = logits.reshape(&[1, e, tokens]).get_rows(picked).reshape(&[k, tokens]).soft_max().reshape(&[1, k, tokens]);
        let x = x.reshape(&[h, 1, tokens]);
        let (gate, up) = match self.gate_up {
            GateUp::Combined(gu) => {
                let both = gu.forward(g, x, picked).reshape(&[2, ff, k, tokens]);
                let nb = both.nb();
                let half = |i: usize| both.view(&[1, ff, k, tokens], &[nb[1], nb[2], nb[3]], i * nb[0]).cont().reshape(&[ff, k, tokens]);
                (half(0), half(1))
            }
            GateUp::Split(gp, up) => (gp.forward(g, x, picked), up.forward(g, x, picked)),
        };
        // SAFETY: two live [ff, k, tokens] tensors.
        let act = gate.wrap(unsafe { gs::ggml_swiglu_oai(gate.ctx(), gate.raw(), up.raw(), 1.702, 7.0) });
        sum_expert_outputs(self.down.forward(g, act, picked).mul(weights)).reshape(&[h, l, n])
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attention_norm: RmsNorm,
    mlp: MoeMlp,
}

impl Block {
    fn new(s: &mut Scope, cfg: &GptOssConfig) -> Block {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Block {
            input_norm: rms_norm(s, "input_layernorm", h, eps),
            attn: Attention::new(&mut s.sub("self_attn"), cfg),
            post_attention_norm: rms_norm(s, "post_attention_norm", h, eps),
            mlp: MoeMlp::new(&mut s.sub("mlp"), cfg),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, cfg: &GptOssConfig, x: T<'g>, pos: T<'g>, mask: T<'g>) -> T<'g> {
        let h = self.attn.forward(g, cfg, self.input_norm.forward(g, x), pos, mask).add_inplace(x);
        self.mlp.forward(g, cfg, self.post_attention_norm.forward(g, h)).add_inplace(h)
    }
}

/// GPT-OSS's text model whose weights live in a `ParamStore`.
pub struct GptOssModel {
    pub cfg: GptOssConfig,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
}

impl GptOssModel {
    /// Declares every weight under the scope's prefix (e.g. [`LLM_PREFIX`]) + `model.`.
    pub fn new(s: &mut Scope, cfg: &GptOssConfig) -> GptOssModel {
        let mut m = s.sub("model");
        let embed_tokens = Embedding::new(&mut m, "embed_tokens", cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers).map(|i| Block::new(&mut m.sub(&format!("layers.{i}")), cfg)).collect();
        let norm = rms_norm(&mut m, "norm", cfg.hidden_size, cfg.rms_norm_eps);
        GptOssModel { cfg: cfg.clone(), embed_tokens, layers, norm }
    }

    /// Hidden states `[width, L, 1]` of `ids` (i32 `[L, 1]`) at `out_layers`, given the
    /// positions (i32 `[L]`) and the additive masks `[L, L]` (key fastest) of the full and
    /// the sliding-window layers.
    pub fn forward<'g>(&self, g: &'g Graph, ids: T<'g>, pos: T<'g>, mask: T<'g>, sliding: T<'g>, out_layers: &[i32]) -> T<'g> {
        let (read, normed) = self.cfg.read_layers(out_layers);
        let many = read.len() + usize::from(normed) > 1;
        let mut x = self.embed_tokens.forward(g, ids);
        let mut outs = Vec::new();
        for (i, block) in self.layers.iter().enumerate() {
            let m = if GptOssConfig::is_sliding(i) { sliding } else { mask };
            x = block.forward(g, &self.cfg, x, pos, m);
            if many {
                x = x.cont();
            }
            if read.contains(&(i + 1)) {
                outs.push(x);
            }
        }
        if normed {
            outs.push(self.norm.forward(g, x));
        }
        let first = outs[0];
        outs[1..].iter().fold(first, |acc, &o| acc.concat(o, 0))
    }
}

/// `mask` (`[L·L]`, key fastest) with the keys [`SLIDING_WINDOW`] or more tokens before the
/// query set to -∞.
pub fn sliding_mask(mask: &[f32], len: usize) -> Vec<f32> {
    super::llm::hide_far_keys(mask, 0, len, SLIDING_WINDOW)
}

/// Hidden states `[width, L, 1]` of one token sequence at `out_layers`, with the additive
/// attention mask `mask` (`[L·L]`, e.g. [`causal_mask`]); the sliding-window layers get it
/// with the far keys hidden too.
pub fn hidden_states(runner: &mut Runner, model: &GptOssModel, ids: &[i32], mask: Option<&[f32]>, out_layers: &[i32]) -> Result<Tensor> {
    let cfg = &model.cfg;
    let len = ids.len();
    ensure!(len > 0, "LLM input has no tokens");
    ensure!(cfg.num_layers > 0, "the GPT-OSS text encoder has no layers");
    if let Some(&bad) = ids.iter().find(|&&t| t < 0 || t as i64 >= cfg.vocab_size) {
        bail!("token id {bad} is outside the LLM's {} embeddings", cfg.vocab_size);
    }
    let full = match mask {
        Some(m) => {
            ensure!(m.len() == len * len, "LLM attention mask has {} values for {len} tokens", m.len());
            m.to_vec()
        }
        None => causal_mask(&vec![true; len]),
    };
    let sliding = sliding_mask(&full, len);
    let pos: Vec<i32> = (0..len as i32).collect();
    let width = cfg.output_width(out_layers);
    let out = runner.compute(|g| {
        let ids = g.input_i32(ids, &[len as i64, 1]);
        let pos = g.input_i32(&pos, &[len as i64]);
        let mask = g.input_f32(&full, &[len as i64, len as i64]);
        let sliding = g.input_f32(&sliding, &[len as i64, len as i64]);
        Ok(model.forward(g, ids, pos, mask, sliding, out_layers))
    })?;
    out.reshape(&[width, len, 1])
}

/// Whether the files hold a GPT-OSS text model under [`LLM_PREFIX`] (its attention sinks).
pub fn is_gpt_oss(types: &TypeMap) -> bool {
    types.keys().any(|n| n.starts_with(LLM_PREFIX) && n.ends_with("self_attn.sinks"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ParamStore;
    use std::collections::HashMap;

    #[test]
    fn config_and_weights() {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("{LLM_PREFIX}{n}"), crate::graph::F16);
            shapes.insert(format!("{LLM_PREFIX}{n}"), s.to_vec());
        };
        add("model.embed_tokens.weight", &[2880, 201088]);
        add("model.layers.0.mlp.experts.gate_up_proj.weight", &[2880, 64, 32]);
        add("model.layers.23.input_layernorm.weight", &[2880]);
        let cfg = GptOssConfig::detect(&types, &|n| shapes.get(n).cloned(), LLM_PREFIX);
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.combined_gate_up), (24, 2880, 201088, 32, true));
        assert_eq!(cfg.read_layers(&[6, 12, 18, 24]), (vec![6, 12, 18, 24], false));
        assert_eq!(cfg.output_width(&[6, 12, 18, 24]), 4 * 2880);
        let mut store = ParamStore::new(4096).unwrap();
        GptOssModel::new(&mut Scope::new(&mut store, &types, LLM_PREFIX), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in ["model.layers.23.self_attn.sinks", "model.layers.0.mlp.router.bias", "model.layers.5.mlp.experts.down_proj.bias", "model.norm.weight"] {
            assert!(names.contains(&format!("{LLM_PREFIX}{n}").as_str()), "{n}");
        }
        assert_eq!(store.len(), 2 + 24 * 17);
    }

    #[test]
    fn sliding_layers_hide_far_keys() {
        let len = 130;
        let m = sliding_mask(&causal_mask(&vec![true; len]), len);
        assert_eq!(m[128 * len], f32::NEG_INFINITY);
        assert_eq!(m[128 * len + 1], 0.0);
        assert_eq!(m[129 * len + 1], f32::NEG_INFINITY);
        assert_eq!(m[127 * len], 0.0);
        assert!(GptOssConfig::is_sliding(0) && !GptOssConfig::is_sliding(1));
    }
}
