//! Anima: a Cosmos-Predict2-style DiT with an LLM adapter, like the reference's `anima.hpp`.
//!
//! - Weights under `model.diffusion_model.net.`: `x_embedder.proj.1` (2×2 patches of the
//!   16-channel latent plus a zero "padding mask" channel), `t_embedder.1.linear_{1,2}` and
//!   `t_embedding_norm`, `blocks.N` (self attention with 3-axis RoPE, cross attention on the
//!   text, a GELU MLP, each behind an adaLN-LoRA modulation with a gate), `final_layer`, and
//!   `llm_adapter` (6 blocks of 1024 that turn the T5 token ids of the prompt into the
//!   context, reading the Qwen3 hidden states by cross attention).
//! - Width 2048 (16 heads of 128) and the context width 1024 are fixed, as in the reference;
//!   only the number of blocks is read from the weights.
//! - The adapter's output, scaled per token by the prompt's attention weights, is padded with
//!   zeros (or cut) to 512 tokens. RoPE rotates each head's halves (not neighbours): the
//!   image with axes 44/42/42 (θ 10000, the two spatial axes NTK-extrapolated by 4), the
//!   adapter's 1-D positions with 64 dimensions.
//! - Reference latents (the `cosmos_reference` preset) are tokens after the image's, at
//!   index 1 of the first axis; only the image's tokens reach the final layer.
//! - The model timestep is `t / 1000`, embedded without further scaling; the output is the
//!   flow velocity as is.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, Embedding, LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, T};
use crate::models::common::dit::{chunk, modulate, pad_and_patchify, timestep_embedding, unpatchify_and_crop, RmsNorm};
use crate::models::common::rope::{self, Ids, RefIndexMode, TextIds};
use crate::tensor::Tensor;

/// The transformer's width (fixed by the reference).
pub const HIDDEN: i64 = 2048;
/// Width of the context the blocks read and of the adapter (the Qwen3 hidden states).
pub const CONTEXT_DIM: i64 = 1024;
const HEADS: i64 = 16;
const HEAD_DIM: i64 = 128;
const PATCH: i64 = 2;
const ADALN_LORA: i64 = 256;
const ADAPTER_LAYERS: usize = 6;
const ADAPTER_HEADS: i64 = 16;
/// The adapter's token table: the T5 vocabulary.
pub const T5_VOCAB: i64 = 32128;
/// Context tokens the blocks read: the adapter's output padded or cut to this.
const CONTEXT_TOKENS: i64 = 512;
const AXES_DIM: [usize; 3] = [44, 42, 42];
const THETA: f32 = 10000.0;
/// NTK extrapolation ratios of the time, height and width axes.
const EXTRAPOLATION: [f32; 3] = [1.0, 4.0, 4.0];
const EPS: f32 = 1e-6;

#[derive(Clone, Debug, PartialEq)]
pub struct AnimaConfig {
    pub in_channels: i64,
    pub num_layers: usize,
}

impl AnimaConfig {
    /// Blocks counted from the names under `prefix` (`…net.`) like the reference: the highest
    /// `blocks.N` plus one (the adapter's blocks are under `llm_adapter.`).
    pub fn detect(types: &TypeMap, prefix: &str) -> AnimaConfig {
        let tag = format!("{prefix}blocks.");
        let layers = types
            .keys()
            .filter_map(|n| n.strip_prefix(tag.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .map(|i| i + 1)
            .max()
            .unwrap_or(0);
        sd_debug!("anima: num_layers = {layers}, hidden_size = {HIDDEN}, num_heads = {HEADS}, head_dim = {HEAD_DIM}");
        AnimaConfig { in_channels: 16, num_layers: layers }
    }
}

/// Theta of each axis after NTK extrapolation (`ratio^(d / (d - 2))`), in f32 like the reference.
fn axis_thetas() -> [f32; 3] {
    let mut out = [THETA; 3];
    for (i, (&ratio, &dim)) in EXTRAPOLATION.iter().zip(&AXES_DIM).enumerate() {
        if ratio != 1.0 && dim > 2 {
            out[i] = THETA * ratio.powf(dim as f32 / (dim as f32 - 2.0));
        }
    }
    out
}

/// The rotation table of `ids` with its own theta per axis: per token, the axes' tables side
/// by side (`[2, 2, dims / 2, L]`).
fn table_per_axis(ids: &Ids, thetas: &[f32], axes_dim: &[usize]) -> Vec<f32> {
    let n = ids.len();
    let tables: Vec<Vec<f32>> = axes_dim
        .iter()
        .enumerate()
        .map(|(a, &dim)| {
            let axis = Ids { n_axes: 1, data: ids.data.chunks(ids.n_axes).map(|r| r[a]).collect() };
            rope::embed_nd(&axis, thetas[a], &[dim], None)
        })
        .collect();
    let mut out = Vec::with_capacity(n * axes_dim.iter().sum::<usize>() * 2);
    for t in 0..n {
        for (table, &dim) in tables.iter().zip(axes_dim) {
            let row = dim * 2;
            out.extend_from_slice(&table[t * row..(t + 1) * row]);
        }
    }
    out
}

/// The image's rotation table: the (padded) latent's patches at index 0, then the reference
/// latents' (`(h, w)` each) at index 1, side by side.
pub fn image_pe(h: usize, w: usize, refs: &[(usize, usize)]) -> Vec<f32> {
    let ids = rope::flux_ids(AXES_DIM.len(), h, w, PATCH as usize, TextIds::zeros(0), refs, RefIndexMode::Fixed, 1.0);
    table_per_axis(&ids, &axis_thetas(), &AXES_DIM)
}

/// The adapter's 1-D table for `len` positions.
fn sequence_pe(len: usize) -> Vec<f32> {
    let ids = Ids { n_axes: 1, data: (0..len).map(|i| i as f32).collect() };
    rope::embed_nd(&ids, THETA, &[(CONTEXT_DIM / ADAPTER_HEADS) as usize], None)
}

/// Attention with per-head RMS-normed q and k; rotated by tables when given.
#[derive(Clone, Copy, Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    out_proj: Linear,
    heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(s: &mut Scope, dim: i64, context_dim: i64, heads: i64, head_dim: i64, out_name: &str) -> Attention {
        let inner = heads * head_dim;
        Attention {
            q_proj: Linear::new(s, "q_proj", dim, inner, false),
            k_proj: Linear::new(s, "k_proj", context_dim, inner, false),
            v_proj: Linear::new(s, "v_proj", context_dim, inner, false),
            q_norm: RmsNorm::new(s, "q_norm", "weight", head_dim, EPS, false),
            k_norm: RmsNorm::new(s, "k_norm", "weight", head_dim, EPS, false),
            out_proj: Linear::new(s, out_name, inner, dim, false),
            heads,
            head_dim,
        }
    }

    /// `x` `[dim, Lq, N]` attending to `context` `[context_dim, Lk, N]` (itself when `None`);
    /// `pe`: the tables of the queries and of the keys.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: Option<T<'g>>, pe: Option<(T<'g>, T<'g>)>) -> T<'g> {
        let context = context.unwrap_or(x);
        let (l_q, l_k, n) = (x.ne()[1], context.ne()[1], x.ne()[2]);
        let heads = |t: T<'g>, l: i64| t.reshape(&[self.head_dim, self.heads, l, n]);
        let q = self.q_norm.forward(g, heads(self.q_proj.forward(g, x), l_q));
        let k = self.k_norm.forward(g, heads(self.k_proj.forward(g, context), l_k));
        let v = self.v_proj.forward(g, context);
        let flash = g.options.flash_attn;
        let out = match pe {
            Some((pe_q, pe_k)) => {
                let q = rope::apply_rope_halves(g, q, pe_q);
                let k = rope::apply_rope_halves(g, k, pe_k);
                nn::attention(g, q, k, heads(v, l_k), self.heads, None, true, flash, 1.0)
            }
            None => {
                let inner = self.heads * self.head_dim;
                nn::attention(g, q.reshape(&[inner, l_q, n]), k.reshape(&[inner, l_k, n]), v, self.heads, None, false, flash, 1.0)
            }
        };
        self.out_proj.forward(g, out)
    }
}

/// `second(gelu(first(x)))`.
#[derive(Clone, Copy, Debug)]
struct Mlp {
    first: Linear,
    second: Linear,
}

impl Mlp {
    fn new(s: &mut Scope, names: [&str; 2], dim: i64, hidden: i64, bias: bool) -> Mlp {
        Mlp { first: Linear::new(s, names[0], dim, hidden, bias), second: Linear::new(s, names[1], hidden, dim, bias) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.second.forward(g, self.first.forward(g, x).cont().gelu())
    }
}

/// One adapter block: RMS-normed self attention, cross attention on the LLM's hidden states
/// and an MLP, each added to the stream.
#[derive(Clone, Copy, Debug)]
struct AdapterBlock {
    norm_self_attn: RmsNorm,
    self_attn: Attention,
    norm_cross_attn: RmsNorm,
    cross_attn: Attention,
    norm_mlp: RmsNorm,
    mlp: Mlp,
}

impl AdapterBlock {
    fn new(s: &mut Scope) -> AdapterBlock {
        let (d, hd) = (CONTEXT_DIM, CONTEXT_DIM / ADAPTER_HEADS);
        AdapterBlock {
            norm_self_attn: RmsNorm::new(s, "norm_self_attn", "weight", d, EPS, false),
            self_attn: Attention::new(&mut s.sub("self_attn"), d, d, ADAPTER_HEADS, hd, "o_proj"),
            norm_cross_attn: RmsNorm::new(s, "norm_cross_attn", "weight", d, EPS, false),
            cross_attn: Attention::new(&mut s.sub("cross_attn"), d, CONTEXT_DIM, ADAPTER_HEADS, hd, "o_proj"),
            norm_mlp: RmsNorm::new(s, "norm_mlp", "weight", d, EPS, false),
            mlp: Mlp::new(&mut s.sub("mlp"), ["0", "2"], d, 4 * d, true),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, source: T<'g>, target_pe: T<'g>, source_pe: T<'g>) -> T<'g> {
        let h = self.self_attn.forward(g, self.norm_self_attn.forward(g, x), None, Some((target_pe, target_pe)));
        let x = x.add(h);
        let h = self.cross_attn.forward(g, self.norm_cross_attn.forward(g, x), Some(source), Some((target_pe, source_pe)));
        let x = x.add(h);
        x.add(self.mlp.forward(g, self.norm_mlp.forward(g, x)))
    }
}

/// The LLM adapter: T5 token embeddings refined by reading the LLM's hidden states.
#[derive(Debug)]
struct LlmAdapter {
    embed: Embedding,
    blocks: Vec<AdapterBlock>,
    out_proj: Linear,
    norm: RmsNorm,
}

impl LlmAdapter {
    fn new(s: &mut Scope) -> LlmAdapter {
        LlmAdapter {
            embed: Embedding::new(s, "embed", T5_VOCAB, CONTEXT_DIM),
            blocks: (0..ADAPTER_LAYERS).map(|i| AdapterBlock::new(&mut s.sub(&format!("blocks.{i}")))).collect(),
            out_proj: Linear::new(s, "out_proj", CONTEXT_DIM, CONTEXT_DIM, true),
            norm: RmsNorm::new(s, "norm", "weight", CONTEXT_DIM, EPS, false),
        }
    }

    /// `ids` i32 `[L_t, 1]`, `source` `[1024, L_s, 1]` → `[1024, L_t, 1]`.
    fn forward<'g>(&self, g: &'g Graph, ids: T<'g>, source: T<'g>, target_pe: T<'g>, source_pe: T<'g>) -> T<'g> {
        let mut x = self.embed.forward(g, ids);
        for block in &self.blocks {
            x = block.forward(g, x, source, target_pe, source_pe);
        }
        self.norm.forward(g, self.out_proj.forward(g, x))
    }
}

/// adaLN with a low-rank projection of the embedded timestep, plus the shared `temb`:
/// `n` chunks of `[hidden, N]` (shift, scale[, gate]).
#[derive(Clone, Copy, Debug)]
struct AdaLn {
    down: Linear,
    up: Linear,
    n: i64,
}

impl AdaLn {
    fn new(s: &mut Scope, n: i64) -> AdaLn {
        AdaLn { down: Linear::new(s, "1", HIDDEN, ADALN_LORA, false), up: Linear::new(s, "2", ADALN_LORA, n * HIDDEN, false), n }
    }

    fn forward<'g>(&self, g: &'g Graph, embedded_t: T<'g>, temb: T<'g>) -> Vec<T<'g>> {
        let emb = self.up.forward(g, self.down.forward(g, embedded_t.silu()));
        let temb = if self.n * HIDDEN == temb.ne()[0] {
            temb
        } else {
            temb.view(&[self.n * HIDDEN, temb.ne()[1]], &[temb.nb()[1]], 0)
        };
        chunk(emb.add(temb), self.n, 0, true)
    }
}

/// `x · gate` with `gate` `[C, N]` broadcast over the tokens.
fn gated<'g>(x: T<'g>, gate: T<'g>) -> T<'g> {
    x.mul(gate.reshape(&[gate.ne()[0], 1, gate.ne()[1]]))
}

#[derive(Clone, Copy, Debug)]
struct Block {
    mod_self_attn: AdaLn,
    self_attn: Attention,
    mod_cross_attn: AdaLn,
    cross_attn: Attention,
    mod_mlp: AdaLn,
    mlp: Mlp,
}

impl Block {
    fn new(s: &mut Scope) -> Block {
        Block {
            mod_self_attn: AdaLn::new(&mut s.sub("adaln_modulation_self_attn"), 3),
            self_attn: Attention::new(&mut s.sub("self_attn"), HIDDEN, HIDDEN, HEADS, HEAD_DIM, "output_proj"),
            mod_cross_attn: AdaLn::new(&mut s.sub("adaln_modulation_cross_attn"), 3),
            cross_attn: Attention::new(&mut s.sub("cross_attn"), HIDDEN, CONTEXT_DIM, HEADS, HEAD_DIM, "output_proj"),
            mod_mlp: AdaLn::new(&mut s.sub("adaln_modulation_mlp"), 3),
            mlp: Mlp::new(&mut s.sub("mlp"), ["layer1", "layer2"], HIDDEN, 4 * HIDDEN, false),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: T<'g>, embedded_t: T<'g>, temb: T<'g>, pe: T<'g>) -> T<'g> {
        let norm = |x: T<'g>| x.norm(EPS);
        let m = self.mod_self_attn.forward(g, embedded_t, temb);
        let h = self.self_attn.forward(g, modulate(norm(x), m[0], m[1]), None, Some((pe, pe)));
        let x = x.add(gated(h, m[2]));
        let m = self.mod_cross_attn.forward(g, embedded_t, temb);
        let h = self.cross_attn.forward(g, modulate(norm(x), m[0], m[1]), Some(context), None);
        let x = x.add(gated(h, m[2]));
        let m = self.mod_mlp.forward(g, embedded_t, temb);
        let h = self.mlp.forward(g, modulate(norm(x), m[0], m[1]));
        x.add(gated(h, m[2]))
    }
}

/// An Anima transformer whose weights live in a `ParamStore`.
pub struct AnimaModel {
    pub config: AnimaConfig,
    x_embedder: Linear,
    t_linear_1: Linear,
    t_linear_2: Linear,
    t_embedding_norm: RmsNorm,
    blocks: Vec<Block>,
    final_modulation: AdaLn,
    final_norm: LayerNorm,
    final_linear: Linear,
    adapter: LlmAdapter,
}

/// The graph inputs of one evaluation.
struct Inputs<'g> {
    x: T<'g>,
    refs: Vec<T<'g>>,
    t: T<'g>,
    context: T<'g>,
    t5_ids: T<'g>,
    t5_weights: T<'g>,
    image_pe: T<'g>,
    target_pe: T<'g>,
    source_pe: T<'g>,
}

impl AnimaModel {
    pub fn new(s: &mut Scope, cfg: &AnimaConfig) -> AnimaModel {
        let patch_dim = (cfg.in_channels + 1) * PATCH * PATCH;
        let x_embedder = Linear::new(s, "x_embedder.proj.1", patch_dim, HIDDEN, false);
        let t_linear_1 = Linear::new(s, "t_embedder.1.linear_1", HIDDEN, HIDDEN, false);
        let t_linear_2 = Linear::new(s, "t_embedder.1.linear_2", HIDDEN, 3 * HIDDEN, false);
        let t_embedding_norm = RmsNorm::new(s, "t_embedding_norm", "weight", HIDDEN, EPS, false);
        let blocks = (0..cfg.num_layers).map(|i| Block::new(&mut s.sub(&format!("blocks.{i}")))).collect();
        let mut fin = s.sub("final_layer");
        let final_modulation = AdaLn::new(&mut fin.sub("adaln_modulation"), 2);
        let final_linear = Linear::new(&mut fin, "linear", HIDDEN, PATCH * PATCH * cfg.in_channels, false);
        AnimaModel {
            config: cfg.clone(),
            x_embedder,
            t_linear_1,
            t_linear_2,
            t_embedding_norm,
            blocks,
            final_modulation,
            final_norm: LayerNorm { weight: None, bias: None, eps: EPS },
            final_linear,
            adapter: LlmAdapter::new(&mut s.sub("llm_adapter")),
        }
    }

    /// `x` `[W, H, C, 1]` with a zero channel, padded to whole patches → tokens.
    fn tokens<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [w, h, _, n] = x.ne();
        let zeros = g.input_f32(&vec![0.0; (w * h * n) as usize], &[w, h, 1, n]);
        pad_and_patchify(g, x.concat(zeros, 2), PATCH, true)
    }

    fn forward<'g>(&self, g: &'g Graph, i: &Inputs<'g>) -> T<'g> {
        let [w, h, _, _] = i.x.ne();
        let mut x = self.tokens(g, i.x);
        let img_len = x.ne()[1];
        for &r in &i.refs {
            x = x.concat(self.tokens(g, r), 1);
        }
        let x = self.x_embedder.forward(g, x);

        let t_proj = timestep_embedding(i.t, HIDDEN as i32, 10000, 1.0);
        let temb = self.t_linear_2.forward(g, self.t_linear_1.forward(g, t_proj).silu());
        let embedded_t = self.t_embedding_norm.forward(g, t_proj);

        let adapted = self.adapter.forward(g, i.t5_ids, i.context, i.target_pe, i.source_pe);
        let [d, l, n, _] = adapted.ne();
        let adapted = adapted.mul(i.t5_weights.reshape(&[1, l, 1]).repeat_4d([d, l, n, 1]));
        let context = if l < CONTEXT_TOKENS {
            let zeros = g.input_f32(&vec![0.0; (d * (CONTEXT_TOKENS - l) * n) as usize], &[d, CONTEXT_TOKENS - l, n]);
            adapted.concat(zeros, 1)
        } else if l > CONTEXT_TOKENS {
            let nb = adapted.nb();
            adapted.view(&[d, CONTEXT_TOKENS, n], &[nb[1], nb[2]], 0).cont()
        } else {
            adapted
        };

        let mut x = x;
        for block in &self.blocks {
            x = block.forward(g, x, context, embedded_t, temb, i.image_pe);
        }
        let nb = x.nb();
        let x = x.view(&[HIDDEN, img_len, x.ne()[2]], &[nb[1], nb[2]], 0).cont();
        let m = self.final_modulation.forward(g, embedded_t, temb);
        let x = self.final_linear.forward(g, modulate(self.final_norm.forward(g, x), m[0], m[1]));
        unpatchify_and_crop(x, h, w, PATCH, false)
    }
}

/// A loaded Anima transformer.
pub type Anima = Loaded<AnimaModel>;

/// The T5 token ids and their weights as a conditioner hands them over in
/// [`Condition::vector`](crate::models::Condition): `[L, 2]`, the ids (as floats) then the
/// weights.
pub fn pack_t5(ids: &[u32], weights: &[f32]) -> Result<Tensor> {
    let mut data: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    data.extend_from_slice(weights);
    Tensor::from_vec(&[ids.len(), 2], data)
}

fn unpack_t5(t: &Tensor) -> Result<(Vec<i32>, Vec<f32>)> {
    ensure!(t.shape().len() == 2 && t.ne(1) == 2 && t.ne(0) > 0, "Anima's T5 tokens must be [L, 2], got {:?}", t.shape());
    let (ids, weights) = t.data().split_at(t.ne(0));
    ensure!(ids.iter().all(|&i| i >= 0.0 && (i as i64) < T5_VOCAB), "Anima: T5 token ids out of its adapter's {T5_VOCAB} rows");
    Ok((ids.iter().map(|&i| i as i32).collect(), weights.to_vec()))
}

impl DiffusionModel for Loaded<AnimaModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("Anima needs the LLM's hidden states (no LLM produced them)")?;
        let t5 = input.cond.vector.as_ref().context("Anima needs the prompt's T5 tokens (its conditioner gave none)")?;
        let (ids, weights) = unpack_t5(t5)?;
        let (model, runner) = self.parts();
        let c = model.config.in_channels as usize;
        let x = input.x;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Anima takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        ensure!(
            context.ne(0) as i64 == CONTEXT_DIM && context.ne(1) > 0 && context.ne(2) == 1,
            "Anima's LLM adapter reads hidden states {CONTEXT_DIM} wide, got {:?}",
            context.shape()
        );
        ensure!(input.timesteps.len() == 1, "Anima takes one timestep, got {}", input.timesteps.len());
        for r in input.ref_latents {
            ensure!(r.ne(2) == c && r.ne(3) == 1, "Anima's reference latents must be [W, H, {c}, 1], got {:?}", r.shape());
        }
        let pad = |v: usize| v + (PATCH as usize - v % PATCH as usize) % PATCH as usize;
        let refs: Vec<(usize, usize)> = input.ref_latents.iter().map(|r| (r.ne(1), r.ne(0))).collect();
        let image_pe = image_pe(pad(x.ne(1)), pad(x.ne(0)), &refs);
        let target_pe = sequence_pe(ids.len());
        let source_pe = sequence_pe(context.ne(1));
        let t = [input.timesteps[0] / 1000.0];
        let quarter = |v: &Vec<f32>, d: i64| [2, 2, d / 2, (v.len() as i64) / (2 * d)];
        runner.compute(|g| {
            let inputs = Inputs {
                x: g.input(x),
                refs: input.ref_latents.iter().map(|r| g.input(r)).collect(),
                t: g.input_f32(&t, &[1]),
                context: g.input(context),
                t5_ids: g.input_i32(&ids, &[ids.len() as i64, 1]),
                t5_weights: g.input_f32(&weights, &[weights.len() as i64]),
                image_pe: g.input_f32(&image_pe, &quarter(&image_pe, HEAD_DIM)),
                target_pe: g.input_f32(&target_pe, &quarter(&target_pe, CONTEXT_DIM / ADAPTER_HEADS)),
                source_pe: g.input_f32(&source_pe, &quarter(&source_pe, CONTEXT_DIM / ADAPTER_HEADS)),
            };
            Ok(model.forward(g, &inputs))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ParamStore, F32};

    #[test]
    fn config_counts_only_the_transformer_blocks() {
        let mut types = TypeMap::new();
        for n in ["net.blocks.0.mlp.layer1.weight", "net.blocks.2.mlp.layer1.weight", "net.llm_adapter.blocks.5.mlp.0.weight"] {
            types.insert(format!("model.diffusion_model.{n}"), F32);
        }
        let cfg = AnimaConfig::detect(&types, "model.diffusion_model.net.");
        assert_eq!(cfg.num_layers, 3);
        let mut store = ParamStore::new(4096).unwrap();
        AnimaModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model.net."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in ["x_embedder.proj.1.weight", "blocks.2.adaln_modulation_mlp.2.weight", "final_layer.adaln_modulation.1.weight", "llm_adapter.blocks.5.mlp.2.bias"] {
            assert!(names.contains(&format!("model.diffusion_model.net.{n}").as_str()), "{n}");
        }
    }

    #[test]
    fn rotation_tables() {
        // A 4x4 latent: 4 patch tokens at index 0, then a 2x2 reference at index 1.
        let pe = image_pe(4, 4, &[(2, 2)]);
        assert_eq!(pe.len(), 5 * 64 * 4);
        let token = |t: usize| &pe[t * 256..(t + 1) * 256];
        // Token 3 is row 1, column 1: the height axis (from frequency 22) turns 1 rad at its
        // first frequency; the time axis does not turn.
        assert_eq!(&token(3)[..4], &[1.0, -0.0, 0.0, 1.0]);
        assert!((token(3)[22 * 4] - 1f32.cos()).abs() < 1e-6);
        // The reference token has index 1 on the time axis.
        assert!((token(4)[2] - 1f32.sin()).abs() < 1e-6);
        // The spatial axes' theta is extrapolated: 10000 · 4^(42/40).
        let th = axis_thetas();
        assert_eq!(th[0], 10000.0);
        assert!((th[1] / 10000.0 - 4f32.powf(1.05)).abs() < 1e-4);
        assert_eq!(sequence_pe(3).len(), 3 * 32 * 4);
    }

    #[test]
    fn t5_tokens_round_trip() {
        let t = pack_t5(&[3, 1], &[1.5, 1.0]).unwrap();
        assert_eq!(unpack_t5(&t).unwrap(), (vec![3, 1], vec![1.5, 1.0]));
        assert!(unpack_t5(&pack_t5(&[40000], &[1.0]).unwrap()).is_err());
    }
}
