//! Decoder-only LLMs used as text encoders (the text model of the reference's `llm.hpp`):
//! Qwen3 (Z-Image, Flux.2 klein), Qwen3-VL's and Qwen2.5-VL's text parts (SeFi-Image,
//! Qwen-Image), Mistral Small 3.2 and Ministral 3B (Flux.2) are one network with different configurations ([`LlmConfig`]):
//! pre-norm blocks with RMS norms (f32 weights), grouped-query attention (q/k/v biases and
//! per-head q/k RMS norms by arch) rotated by RoPE (NeoX, normal or multi-section, by arch),
//! under a causal (and padding) mask, and a SiLU-gated MLP.
//!
//! Weights use the Hugging Face names under [`LLM_PREFIX`] (`model.embed_tokens.weight`,
//! `model.layers.N.self_attn.q_proj.weight`, …, `model.norm.weight`); io maps llama.cpp GGUF
//! names (`token_embd`, `blk.N.attn_q`, …) to them. Widths, layer count and vocabulary come
//! from the weights, head counts and RoPE from the arch ([`LlmConfig::detect`]).
//!
//! The encoders read hidden states, not logits: [`hidden_states`] returns the outputs of the
//! requested layers (1-based: layer `i` is the output of block `i - 1`; `num_layers + 1` is
//! the final normed state), concatenated along the features; layers beyond the model are
//! skipped, and with none left it returns the normed final state, like the reference.

use crate::error::Result;
use crate::graph::nn::{attention, Embedding, Linear};
use crate::graph::{Graph, RopeParams, Runner, Scope, TypeMap, T};
use crate::models::common::dit::RmsNorm;
use crate::tensor::Tensor;
use ggml_sys as gs;

/// Where the reference puts the LLM text encoder (`llm_path` files get this prefix).
pub const LLM_PREFIX: &str = "text_encoders.llm.";

/// Added to the attention scores of masked (future or padding) tokens: the reference's
/// `-FLT_MAX / 4`.
pub const MASKED: f32 = -f32::MAX / 4.0;

/// Which LLM (its head layout, biases, norms and RoPE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlmArch {
    /// Qwen2.5-VL-7B's text model: q/k/v biases, multi-section RoPE.
    Qwen25Vl,
    /// Qwen3: per-head q/k norms, NeoX RoPE.
    Qwen3,
    /// Qwen3-VL's text model: Qwen3's layers with interleaved multi-section RoPE (base 5e6;
    /// text tokens get positions (i, i, i, 0), so the pairs of the empty fourth section and
    /// the leftovers past each section's count are not rotated).
    Qwen3Vl,
    /// Mistral Small 3.2: normal RoPE with base 1e9.
    MistralSmall32,
    /// Ministral 3B: NeoX RoPE.
    Ministral3b,
}

/// How q and k are rotated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LlmRope {
    /// `ggml_rope_ext` with positions 0..L.
    Ext(RopeParams),
    /// `ggml_rope_multi` with 4 position rows (t, h, w, e) = (i, i, i, 0) for text.
    Multi { sections: [i32; 4], params: RopeParams },
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlmConfig {
    pub arch: LlmArch,
    pub num_layers: usize,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub final_norm: bool,
    pub rms_norm_eps: f32,
    /// Rows of the token table.
    pub vocab_size: i64,
    pub rope: LlmRope,
}

const fn rope(mode: u32, n_ctx_orig: i32, freq_base: f32) -> RopeParams {
    RopeParams {
        n_dims: 128,
        mode: mode as i32,
        n_ctx_orig,
        freq_base,
        freq_scale: 1.0,
        ext_factor: 0.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    }
}

/// Index of the block in `…layers.12.…`.
fn layer_index(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest.split('.').next()?.parse().ok()
}

impl LlmConfig {
    /// The arch's fixed facts and the reference's defaults for the sizes the weights decide.
    pub fn for_arch(arch: LlmArch) -> LlmConfig {
        let base = LlmConfig {
            arch,
            num_layers: 28,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_heads: 28,
            num_kv_heads: 4,
            head_dim: 128,
            qkv_bias: true,
            qk_norm: false,
            final_norm: true,
            rms_norm_eps: 1e-6,
            vocab_size: 152064,
            rope: LlmRope::Multi { sections: [16, 24, 24, 0], params: rope(gs::GGML_ROPE_TYPE_MROPE, 128000, 1_000_000.0) },
        };
        match arch {
            LlmArch::Qwen25Vl => base,
            LlmArch::Qwen3 => LlmConfig {
                num_heads: 32,
                num_kv_heads: 8,
                qkv_bias: false,
                qk_norm: true,
                rope: LlmRope::Ext(rope(gs::GGML_ROPE_TYPE_NEOX, 40960, 1_000_000.0)),
                ..base
            },
            LlmArch::Qwen3Vl => LlmConfig {
                arch,
                rope: LlmRope::Multi { sections: [24, 20, 20, 0], params: rope(gs::GGML_ROPE_TYPE_IMROPE, 262144, 5_000_000.0) },
                ..LlmConfig::for_arch(LlmArch::Qwen3)
            },
            LlmArch::MistralSmall32 => LlmConfig {
                num_heads: 32,
                num_kv_heads: 8,
                qkv_bias: false,
                rms_norm_eps: 1e-5,
                rope: LlmRope::Ext(rope(gs::GGML_ROPE_TYPE_NORMAL, 8192, 1_000_000_000.0)),
                ..base
            },
            LlmArch::Ministral3b => LlmConfig {
                num_heads: 32,
                num_kv_heads: 8,
                qkv_bias: false,
                rms_norm_eps: 1e-5,
                rope: LlmRope::Ext(rope(gs::GGML_ROPE_TYPE_NEOX, 262144, 1_000_000.0)),
                ..base
            },
        }
    }

    /// The configuration of the LLM under `prefix` (ending in '.'): layers from the highest
    /// block index, width and vocabulary from `embed_tokens`, MLP width from the first
    /// `gate_proj`; heads and RoPE from the arch (Qwen3 and Qwen3-VL with 28 layers have 16
    /// heads, like the reference). `shape_of` gives ggml-order shapes. Vision weights are ignored.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str, arch: LlmArch) -> LlmConfig {
        let mut cfg = LlmConfig::for_arch(arch);
        cfg.num_layers = 0;
        for name in types.keys().filter(|n| n.starts_with(prefix) && !n.contains("visual.")) {
            if let Some(i) = layer_index(name) {
                cfg.num_layers = cfg.num_layers.max(i + 1);
            }
            let matrix = || shape_of(name).filter(|s| s.len() >= 2);
            if name.ends_with("embed_tokens.weight") {
                if let Some(s) = matrix() {
                    cfg.hidden_size = s[0];
                    cfg.vocab_size = s[1];
                }
            }
            if name.ends_with("layers.0.mlp.gate_proj.weight") {
                if let Some(s) = matrix() {
                    cfg.intermediate_size = s[1];
                }
            }
        }
        let qwen3 = matches!(arch, LlmArch::Qwen3 | LlmArch::Qwen3Vl);
        if qwen3 && cfg.num_layers == 28 {
            cfg.num_heads = 16;
        }
        // Qwen3-VL-32B's text model, which the reference reads without a final norm.
        if arch == LlmArch::Qwen3Vl && cfg.num_layers == 50 && cfg.hidden_size == 5120 {
            cfg.num_heads = 64;
            cfg.final_norm = false;
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

    /// The layers of `out_layers` this model has, in layer order, and whether the normed
    /// final state (`num_layers + 1`) is appended; none of them: the normed state alone.
    pub fn read_layers(&self, out_layers: &[i32]) -> (Vec<usize>, bool) {
        let n = self.num_layers as i64;
        let mut layers: Vec<usize> = out_layers.iter().filter(|&&l| l >= 1 && (l as i64) <= n).map(|&l| l as usize).collect();
        layers.sort_unstable();
        layers.dedup();
        let normed = layers.is_empty() || out_layers.iter().any(|&l| l as i64 == n + 1);
        (layers, normed)
    }

    /// Width of [`hidden_states`] for `out_layers`.
    pub fn output_width(&self, out_layers: &[i32]) -> usize {
        let (layers, normed) = self.read_layers(out_layers);
        (layers.len() + usize::from(normed)) * self.hidden_size as usize
    }
}

fn rms_norm(s: &mut Scope, name: &str, dim: i64, eps: f32) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, eps, false)
}

#[derive(Clone, Copy, Debug)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
}

impl Attention {
    fn new(s: &mut Scope, cfg: &LlmConfig) -> Attention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Attention {
            q: Linear::new(s, "q_proj", h, cfg.num_heads * d, cfg.qkv_bias),
            k: Linear::new(s, "k_proj", h, cfg.num_kv_heads * d, cfg.qkv_bias),
            v: Linear::new(s, "v_proj", h, cfg.num_kv_heads * d, cfg.qkv_bias),
            o: Linear::new(s, "o_proj", cfg.num_heads * d, h, false),
            qk_norm: cfg.qk_norm.then(|| (rms_norm(s, "q_norm", d, cfg.rms_norm_eps), rms_norm(s, "k_norm", d, cfg.rms_norm_eps))),
        }
    }

    /// x: [hidden, L, N] → [hidden, L, N].
    fn forward<'g>(&self, g: &'g Graph, cfg: &LlmConfig, x: T<'g>, pos: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let d = cfg.head_dim;
        let mut q = self.q.forward(g, x).reshape(&[d, cfg.num_heads, l, n]);
        let mut k = self.k.forward(g, x).reshape(&[d, cfg.num_kv_heads, l, n]);
        let v = self.v.forward(g, x).reshape(&[d, cfg.num_kv_heads, l, n]);
        if let Some((qn, kn)) = &self.qk_norm {
            q = qn.forward(g, q);
            k = kn.forward(g, k);
        }
        (q, k) = match &cfg.rope {
            LlmRope::Ext(p) => (q.rope_ext(pos, p), k.rope_ext(pos, p)),
            LlmRope::Multi { sections, params } => (q.rope_multi(pos, *sections, params), k.rope_multi(pos, *sections, params)),
        };
        let heads_first = |t: T<'g>| {
            let ne = t.ne();
            t.permute(0, 2, 1, 3).cont().reshape(&[ne[0], ne[2], ne[1] * ne[3]])
        };
        let x = attention(g, heads_first(q), heads_first(k), v, cfg.num_heads, mask, true, false, 1.0);
        self.o.forward(g, x)
    }
}

#[derive(Clone, Copy, Debug)]
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.gate.forward(g, x).silu_inplace();
        let h = h.mul_inplace(self.up.forward(g, x));
        self.down.forward(g, h)
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attention_norm: RmsNorm,
    mlp: Mlp,
}

impl Block {
    fn new(s: &mut Scope, cfg: &LlmConfig) -> Block {
        let (h, ff, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps);
        let attn = Attention::new(&mut s.sub("self_attn"), cfg);
        let mlp = {
            let mut m = s.sub("mlp");
            Mlp { gate: Linear::new(&mut m, "gate_proj", h, ff, false), up: Linear::new(&mut m, "up_proj", h, ff, false), down: Linear::new(&mut m, "down_proj", ff, h, false) }
        };
        Block { input_norm: rms_norm(s, "input_layernorm", h, eps), attn, post_attention_norm: rms_norm(s, "post_attention_layernorm", h, eps), mlp }
    }

    fn forward<'g>(&self, g: &'g Graph, cfg: &LlmConfig, x: T<'g>, pos: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let h = self.attn.forward(g, cfg, self.input_norm.forward(g, x), pos, mask).add_inplace(x);
        self.mlp.forward(g, self.post_attention_norm.forward(g, h)).add_inplace(h)
    }
}

/// An LLM's text model whose weights live in a `ParamStore`.
pub struct LlmModel {
    pub cfg: LlmConfig,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: Option<RmsNorm>,
}

impl LlmModel {
    /// Declares every weight under the scope's prefix (e.g. [`LLM_PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &LlmConfig) -> LlmModel {
        LlmModel::new_under(s, cfg, "model")
    }

    /// [`LlmModel::new`] with the text model's weights under `sub` instead of `model`
    /// (HiDream-O1's `model.language_model.`).
    pub fn new_under(s: &mut Scope, cfg: &LlmConfig, sub: &str) -> LlmModel {
        let mut m = s.sub(sub);
        let embed_tokens = Embedding::new(&mut m, "embed_tokens", cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers).map(|i| Block::new(&mut m.sub(&format!("layers.{i}")), cfg)).collect();
        let norm = cfg.final_norm.then(|| rms_norm(&mut m, "norm", cfg.hidden_size, cfg.rms_norm_eps));
        LlmModel { cfg: cfg.clone(), embed_tokens, layers, norm }
    }

    /// Token embeddings `[hidden, L, N]` of `ids` (i32 `[L, N]`).
    pub fn embed<'g>(&self, g: &'g Graph, ids: T<'g>) -> T<'g> {
        self.embed_tokens.forward(g, ids)
    }

    /// The normed final state `[hidden, L, N]` of the embeddings `x` (see [`LlmModel::forward`]
    /// for the positions and mask).
    pub fn forward_embeds<'g>(&self, g: &'g Graph, x: T<'g>, pos: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let x = self.layers.iter().fold(x, |x, block| block.forward(g, &self.cfg, x, pos, mask));
        self.norm.map_or(x, |n| n.forward(g, x))
    }

    /// Hidden states `[width, L, N]` of `ids` (i32 `[L, N]`) at `out_layers` (see the module
    /// documentation), given the positions (i32 `[L]`, or `[4·L]` for multi-section RoPE)
    /// and an additive attention mask `[L, L]` (key fastest). `images` (`[hidden, n]` each,
    /// batch 1, in token order) replace the token embeddings from their index on.
    pub fn forward<'g>(&self, g: &'g Graph, ids: T<'g>, pos: T<'g>, mask: Option<T<'g>>, out_layers: &[i32], images: &[(usize, T<'g>)]) -> T<'g> {
        self.forward_deepstack(g, ids, pos, mask, out_layers, images, &[])
    }

    /// [`LlmModel::forward`] with Qwen3-VL's deepstack embeddings: `deepstack[i]` (rows at
    /// token indices, like `images`) added to layer `i`'s output.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_deepstack<'g>(&self, g: &'g Graph, ids: T<'g>, pos: T<'g>, mask: Option<T<'g>>, out_layers: &[i32], images: &[(usize, T<'g>)], deepstack: &[Vec<(usize, T<'g>)>]) -> T<'g> {
        let (read, normed) = self.cfg.read_layers(out_layers);
        let many = read.len() + usize::from(normed) > 1;
        let mut x = splice_rows(self.embed_tokens.forward(g, ids), images);
        let mut outs = Vec::new();
        for (i, block) in self.layers.iter().enumerate() {
            x = block.forward(g, &self.cfg, x, pos, mask);
            if let Some(rows) = deepstack.get(i) {
                x = add_rows(x, rows);
            }
            if many {
                x = x.cont();
            }
            if read.contains(&(i + 1)) {
                outs.push(x);
            }
        }
        if normed {
            outs.push(self.norm.map_or(x, |n| n.forward(g, x)));
        }
        let first = outs[0];
        outs[1..].iter().fold(first, |acc, &o| acc.concat(o, 0))
    }
}

/// `x` `[hidden, L, 1]` with the rows from each `(index, rows)` on replaced by `rows`
/// (the reference's `splice_image_embeds`).
pub fn splice_rows<'g>(x: T<'g>, images: &[(usize, T<'g>)]) -> T<'g> {
    join_rows(x, images, |_, rows| rows)
}

/// `x` `[hidden, L, 1]` with `rows` added from each `(index, rows)` on (the reference's
/// `add_deepstack_image_embeds`).
fn add_rows<'g>(x: T<'g>, images: &[(usize, T<'g>)]) -> T<'g> {
    join_rows(x, images, |own, rows| own.add(rows))
}

/// `x` `[hidden, L, 1]` rebuilt along the tokens: the untouched rows between the pictures
/// copied, each picture's span given by `piece(x's rows there, the picture's rows)`.
fn join_rows<'g>(x: T<'g>, images: &[(usize, T<'g>)], piece: impl Fn(T<'g>, T<'g>) -> T<'g>) -> T<'g> {
    if images.is_empty() {
        return x;
    }
    let [hidden, len, ..] = x.ne();
    let nb1 = x.nb()[1];
    let span = |from: usize, to: usize| x.view(&[hidden, (to - from) as i64], &[nb1], from * nb1);
    let text = |from: usize, to: usize| (to > from).then(|| span(from, to).cont());
    let mut parts = Vec::new();
    let mut at = 0;
    for &(index, rows) in images {
        parts.extend(text(at, index));
        let end = index + rows.ne()[1] as usize;
        parts.push(piece(span(index, end), rows));
        at = end;
    }
    parts.extend(text(at, len as usize));
    let first = parts[0];
    parts[1..].iter().fold(first, |acc, &p| acc.concat(p, 1)).reshape(&[hidden, len, 1])
}

/// Where a picture's embeddings sit in a Qwen3-VL prompt: its first token, how many, and its
/// patch grid (before the 2×2 merge).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageGrid {
    pub index: usize,
    pub size: usize,
    pub grid_h: usize,
    pub grid_w: usize,
}

/// The four position rows (t, h, w, e; `4·len` values) of a Qwen3-VL prompt with pictures:
/// text counts on, a picture's tokens share its first position in t and count rows and
/// columns from it in h and w, and the text after it resumes at that position plus the
/// grid's longer side (the reference's arithmetic, grid after grid).
pub fn grid_positions(len: usize, grids: &[ImageGrid], merge: usize) -> Result<Vec<i32>> {
    let mut pos: Vec<i32> = (0..4).flat_map(|row| (0..len as i32).map(move |i| if row < 3 { i } else { 0 })).collect();
    let mut offset = 0i64;
    for g in grids {
        let (gh, gw) = (g.grid_h / merge.max(1), g.grid_w / merge.max(1));
        let end = g.index + g.size;
        ensure!(gh > 0 && gw > 0 && g.size == gh * gw && end <= len, "picture tokens {}..{end} (a {gh}x{gw} grid) do not fit {len} tokens", g.index);
        let longest = gh.max(gw) as i64;
        let next = g.index as i64 + longest + offset;
        for token in end..len {
            let p = (next + (token - end) as i64) as i32;
            for row in 0..3 {
                pos[row * len + token] = p;
            }
        }
        let base = g.index as i64 + offset;
        for token in 0..g.size {
            pos[g.index + token] = base as i32;
            pos[len + g.index + token] = (base + (token / gw) as i64) as i32;
            pos[2 * len + g.index + token] = (base + (token % gw) as i64) as i32;
        }
        offset += longest - g.size as i64;
    }
    Ok(pos)
}

/// The additive attention mask the LLM conditioners pass: causal, and padding (`keep[i]`
/// false) never attended; `[L, L]` with the key index fastest, masked entries [`MASKED`]
/// (both reasons add up, like the reference).
pub fn causal_mask(keep: &[bool]) -> Vec<f32> {
    causal_mask_after(keep, 0)
}

/// [`causal_mask`] of `L = keep.len()` tokens at positions `front..` over `front + L` keys:
/// `[front + L, L]`, the `front` keys before the tokens never attended.
pub fn causal_mask_after(keep: &[bool], front: usize) -> Vec<f32> {
    let len = keep.len();
    let keys = front + len;
    let mut m = vec![0.0f32; keys * len];
    for q in 0..len {
        for k in 0..keys {
            let mut v = 0.0;
            if k < front || !keep[k - front] {
                v += MASKED;
            }
            if k > front + q {
                v += MASKED;
            }
            m[q * keys + k] = v;
        }
    }
    m
}

/// `mask` (`[front + L, L]`, key fastest, queries at positions `front..`) with the keys
/// `window` or more positions before each query set to -∞ (sliding-window layers).
pub fn hide_far_keys(mask: &[f32], front: usize, len: usize, window: usize) -> Vec<f32> {
    let keys = front + len;
    let mut m = mask.to_vec();
    for q in 0..len {
        for k in 0..keys {
            if k + window <= front + q {
                m[q * keys + k] = f32::NEG_INFINITY;
            }
        }
    }
    m
}

/// Hidden states `[width, L, 1]` of one token sequence at `out_layers` (1-based layer
/// outputs concatenated along the features, see the module documentation), with the
/// additive attention mask `mask` (`[L·L]`, e.g. [`causal_mask`]; without one the model
/// attends causally, like the reference's own default).
pub fn hidden_states(runner: &mut Runner, model: &LlmModel, ids: &[i32], mask: Option<&[f32]>, out_layers: &[i32]) -> Result<Tensor> {
    hidden_states_with_images(runner, model, ids, mask, out_layers, &[])
}

/// [`hidden_states`] with image embeddings (`[hidden, n]` each) in place of the token
/// embeddings from their index on (the `<|image_pad|>` tokens), in token order.
pub fn hidden_states_with_images(runner: &mut Runner, model: &LlmModel, ids: &[i32], mask: Option<&[f32]>, out_layers: &[i32], images: &[(usize, Tensor)]) -> Result<Tensor> {
    hidden_states_vl(runner, model, ids, mask, out_layers, &VlInputs { images, ..VlInputs::default() })
}

/// What a vision tower adds to an LLM's prompt: embeddings in place of token embeddings,
/// deepstack embeddings added to the first layers' states (`deepstack[layer]`), and the
/// pictures' grids for their positions (Qwen3-VL; none: text positions).
#[derive(Default)]
pub struct VlInputs<'a> {
    pub images: &'a [(usize, Tensor)],
    pub deepstack: &'a [Vec<(usize, Tensor)>],
    pub grids: &'a [ImageGrid],
    pub merge: usize,
}

/// [`hidden_states_with_images`] with everything of [`VlInputs`].
pub fn hidden_states_vl(runner: &mut Runner, model: &LlmModel, ids: &[i32], mask: Option<&[f32]>, out_layers: &[i32], vl: &VlInputs<'_>) -> Result<Tensor> {
    let (images, deepstack) = (vl.images, vl.deepstack);
    let cfg = &model.cfg;
    let len = ids.len();
    ensure!(len > 0, "LLM input has no tokens");
    // Rows in token order, inside the prompt, as wide as the model.
    let fits = |what: &str, list: &[(usize, Tensor)]| -> Result<()> {
        let mut end = 0;
        for (index, rows) in list {
            ensure!(
                rows.ne(0) as i64 == cfg.hidden_size && *index >= end && index + rows.ne(1) <= len,
                "{what} embeddings {:?} at token {index} do not fit {len} tokens of width {}",
                rows.shape(),
                cfg.hidden_size
            );
            end = index + rows.ne(1);
        }
        Ok(())
    };
    fits("image", images)?;
    for layer in deepstack {
        fits("deepstack", layer)?;
    }
    ensure!(cfg.num_layers > 0, "the LLM has no layers");
    if let Some(&bad) = ids.iter().find(|&&t| t < 0 || t as i64 >= cfg.vocab_size) {
        bail!("token id {bad} is outside the LLM's {} embeddings", cfg.vocab_size);
    }
    let default_mask;
    let mask = match mask {
        Some(m) => {
            ensure!(m.len() == len * len, "LLM attention mask has {} values for {len} tokens", m.len());
            m
        }
        None => {
            default_mask = causal_mask(&vec![true; len]);
            &default_mask
        }
    };
    let pos: Vec<i32> = match cfg.rope {
        LlmRope::Ext(_) => (0..len as i32).collect(),
        LlmRope::Multi { .. } => grid_positions(len, if cfg.arch == LlmArch::Qwen3Vl { vl.grids } else { &[] }, vl.merge)?,
    };
    let width = cfg.output_width(out_layers);
    let out = runner.compute(|g| {
        let ids = g.input_i32(ids, &[len as i64, 1]);
        let pos = g.input_i32(&pos, &[pos.len() as i64]);
        let mask = g.input_f32(mask, &[len as i64, len as i64]);
        let input = |(i, t): &(usize, Tensor)| (*i, g.input_f32(t.data(), &[t.ne(0) as i64, t.ne(1) as i64]));
        let images: Vec<(usize, T<'_>)> = images.iter().map(input).collect();
        let deepstack: Vec<Vec<(usize, T<'_>)>> = deepstack.iter().map(|layer| layer.iter().map(input).collect()).collect();
        Ok(model.forward_deepstack(g, ids, pos, Some(mask), out_layers, &images, &deepstack))
    })?;
    out.reshape(&[width, len, 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two pictures' grids in a Qwen3-VL prompt: the reference's positions, worked by hand.
    #[test]
    fn picture_grids_position_like_the_reference() {
        // Text 0-1, a 4×6-patch picture (3×2 tokens) at 2, text 8, a 2×4-patch one at 9, text 11-13.
        let grids = [ImageGrid { index: 2, size: 6, grid_h: 4, grid_w: 6 }, ImageGrid { index: 9, size: 2, grid_h: 2, grid_w: 4 }];
        let pos = grid_positions(14, &grids, 2).unwrap();
        assert_eq!(&pos[..14], &[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 6, 8, 9, 10]);
        assert_eq!(&pos[14..28], &[0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 6, 8, 9, 10]);
        assert_eq!(&pos[28..42], &[0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert!(pos[42..].iter().all(|&p| p == 0));
        // No pictures: text positions; a grid that does not match its tokens is an error.
        assert_eq!(grid_positions(3, &[], 2).unwrap(), [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 0]);
        assert!(grid_positions(14, &[ImageGrid { size: 5, ..grids[0] }], 2).is_err());
        assert!(grid_positions(7, &grids[..1], 2).is_err());
    }
    use crate::graph::ParamStore;
    use std::collections::HashMap;

    fn qwen3_types(layers: usize, hidden: i64) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let mut add = |n: String, s: &[i64]| {
            types.insert(n.clone(), crate::graph::F16);
            shapes.insert(n, s.to_vec());
        };
        add(format!("{LLM_PREFIX}model.embed_tokens.weight"), &[hidden, 151936]);
        for i in 0..layers {
            add(format!("{LLM_PREFIX}model.layers.{i}.mlp.gate_proj.weight"), &[hidden, 128]);
        }
        add(format!("{LLM_PREFIX}model.norm.weight"), &[hidden]);
        (types, shapes)
    }

    #[test]
    fn config_from_weights() {
        let (types, shapes) = qwen3_types(36, 64);
        let cfg = LlmConfig::detect(&types, &|n| shapes.get(n).cloned(), LLM_PREFIX, LlmArch::Qwen3);
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size), (36, 64, 128, 151936));
        assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias), (32, 8, 128, true, false));
        let (types, shapes) = qwen3_types(28, 64);
        assert_eq!(LlmConfig::detect(&types, &|n| shapes.get(n).cloned(), LLM_PREFIX, LlmArch::Qwen3).num_heads, 16);
        // Qwen3-VL's text model: Qwen3's layers, heads and widths, interleaved multi-section RoPE.
        let vl3 = LlmConfig::detect(&types, &|n| shapes.get(n).cloned(), LLM_PREFIX, LlmArch::Qwen3Vl);
        assert_eq!((vl3.num_heads, vl3.num_kv_heads, vl3.qk_norm, vl3.qkv_bias, vl3.final_norm), (16, 8, true, false, true));
        assert_eq!(vl3.arch, LlmArch::Qwen3Vl);
        match vl3.rope {
            LlmRope::Multi { sections, params } => {
                assert_eq!((sections, params.mode, params.n_ctx_orig, params.freq_base), ([24, 20, 20, 0], gs::GGML_ROPE_TYPE_IMROPE as i32, 262144, 5e6));
            }
            LlmRope::Ext(_) => panic!("Qwen3-VL rotates by sections"),
        }
        let vl = LlmConfig::for_arch(LlmArch::Qwen25Vl);
        assert!(vl.qkv_bias && !vl.qk_norm && matches!(vl.rope, LlmRope::Multi { .. }));

        // Declared weights: Qwen3 has q/k norms and no q/k/v biases.
        let mut store = ParamStore::new(4096).unwrap();
        LlmModel::new(&mut Scope::new(&mut store, &types, LLM_PREFIX), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        assert!(names.contains(&"text_encoders.llm.model.layers.35.self_attn.k_norm.weight"));
        assert!(names.contains(&"text_encoders.llm.model.norm.weight"));
        assert!(!names.iter().any(|n| n.ends_with("q_proj.bias")));
        assert_eq!(store.len(), 2 + 36 * 11);
    }

    #[test]
    fn layers_read() {
        let mut cfg = LlmConfig::for_arch(LlmArch::Qwen3);
        cfg.num_layers = 36;
        assert_eq!(cfg.read_layers(&[35]), (vec![35], false));
        assert_eq!(cfg.read_layers(&[27, 9, 18]), (vec![9, 18, 27], false));
        assert_eq!(cfg.read_layers(&[37]), (vec![], true));
        assert_eq!(cfg.read_layers(&[36, 37]), (vec![36], true));
        cfg.num_layers = 8;
        // Layers beyond the model are skipped; none left: the normed final state.
        assert_eq!(cfg.read_layers(&[9, 18, 27]), (vec![], true));
        assert_eq!(cfg.read_layers(&[35]), (vec![], true));
        assert_eq!(cfg.read_layers(&[]), (vec![], true));
        cfg.hidden_size = 64;
        assert_eq!(cfg.output_width(&[2, 4, 6]), 192);
        assert_eq!(cfg.output_width(&[9, 18, 27]), 64);
    }

    /// Image rows replace the token rows from their index on; the text around them stays.
    #[test]
    fn image_rows_are_spliced_over_their_tokens() {
        use crate::graph::{Backend, Runner};
        let x: Vec<f32> = (0..2 * 6).map(|v| v as f32).collect();
        let out = Runner::new(std::sync::Arc::new(Backend::cpu().unwrap()), 1)
            .compute(|g| {
                let x = g.input_f32(&x, &[2, 6, 1]);
                let a = g.input_f32(&[-1.0, -2.0, -3.0, -4.0], &[2, 2]);
                let b = g.input_f32(&[-5.0, -6.0], &[2, 1]);
                Ok(splice_rows(x, &[(1, a), (5, b)]))
            })
            .unwrap();
        assert_eq!(&out.shape()[..2], &[2, 6]);
        assert_eq!(out.data(), &[0., 1., -1., -2., -3., -4., 6., 7., 8., 9., -5., -6.]);
    }

    #[test]
    fn mask_is_causal_and_hides_padding() {
        let m = causal_mask(&[true, true, false]);
        assert_eq!(&m[0..3], &[0.0, MASKED, 2.0 * MASKED]);
        assert_eq!(&m[3..6], &[0.0, 0.0, 2.0 * MASKED]);
        assert_eq!(&m[6..9], &[0.0, 0.0, MASKED]);
    }
}
