//! Gemma 3 12B's text model, LTX-2.3's text encoder (the reference's `LLMArch::GEMMA3_12B` in
//! `llm.hpp`). Against Gemma 2 ([`super::gemma2`]): its RMS norms scale by the weight itself
//! (no offset from 1), 16 query heads and 8 key/value heads of 256 with per-head q/k RMS norms,
//! the norms around attention and MLP under other names, and two kinds of layers: every sixth
//! is global (RoPE base 1e6 with positions scaled by 1/8), the others local (base 1e4, a causal
//! window of 1024 tokens). The LTXAV embedder reads every hidden state: the scaled embeddings,
//! each layer's output but the last, and the normed final state.
//!
//! Weights use the Hugging Face names under [`LLM_PREFIX`]; layers, width, vocabulary and MLP
//! width come from the weights.

use super::gemma2::{check_ids, gelu_mlp, grouped_attention, Norm};
use super::llm::{causal_mask_after, hide_far_keys, LLM_PREFIX};
#[cfg(test)]
use super::llm::causal_mask;
use crate::error::Result;
use crate::graph::nn::{Embedding, Linear};
use crate::graph::{Graph, RopeParams, Runner, Scope, T};
use crate::tensor::Tensor;
use ggml_sys as gs;

pub const HEADS: i64 = 16;
pub const KV_HEADS: i64 = 8;
pub const HEAD_DIM: i64 = 256;
/// Local layers see this many tokens back.
pub const SLIDING_WINDOW: usize = 1024;
/// Of every six layers the last is global.
const PATTERN: usize = 6;

const fn rope(freq_base: f32, freq_scale: f32) -> RopeParams {
    RopeParams {
        n_dims: HEAD_DIM as i32,
        mode: gs::GGML_ROPE_TYPE_NEOX as i32,
        n_ctx_orig: 131072,
        freq_base,
        freq_scale,
        ext_factor: 0.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    }
}
const LOCAL_ROPE: RopeParams = rope(10000.0, 1.0);
const GLOBAL_ROPE: RopeParams = rope(1_000_000.0, 1.0 / 8.0);

/// Sizes read from the weights like Gemma 2's.
pub use super::gemma2::Gemma2Config as Gemma3Config;

#[derive(Clone, Copy, Debug)]
struct Block {
    global: bool,
    input_norm: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Norm,
    k_norm: Norm,
    post_attention_norm: Norm,
    pre_ffw_norm: Norm,
    gate: Linear,
    up: Linear,
    down: Linear,
    post_ffw_norm: Norm,
}

impl Block {
    fn new(s: &mut Scope, cfg: &Gemma3Config, index: usize) -> Block {
        let (h, ff) = (cfg.hidden_size, cfg.intermediate_size);
        let mut a = s.sub("self_attn");
        let (q, k, v, o) = (
            Linear::new(&mut a, "q_proj", h, HEADS * HEAD_DIM, false),
            Linear::new(&mut a, "k_proj", h, KV_HEADS * HEAD_DIM, false),
            Linear::new(&mut a, "v_proj", h, KV_HEADS * HEAD_DIM, false),
            Linear::new(&mut a, "o_proj", HEADS * HEAD_DIM, h, false),
        );
        let (q_norm, k_norm) = (Norm::plain(&mut a, "q_norm", HEAD_DIM), Norm::plain(&mut a, "k_norm", HEAD_DIM));
        let mut m = s.sub("mlp");
        let (gate, up, down) = (Linear::new(&mut m, "gate_proj", h, ff, false), Linear::new(&mut m, "up_proj", h, ff, false), Linear::new(&mut m, "down_proj", ff, h, false));
        Block {
            global: index % PATTERN == PATTERN - 1,
            input_norm: Norm::plain(s, "input_layernorm", h),
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            post_attention_norm: Norm::plain(s, "post_attention_norm", h),
            pre_ffw_norm: Norm::plain(s, "post_attention_layernorm", h),
            gate,
            up,
            down,
            post_ffw_norm: Norm::plain(s, "post_ffw_norm", h),
        }
    }

    /// `front` zero keys and values go before the tokens' own (see [`all_hidden_states`]).
    fn attention<'g>(&self, g: &'g Graph, x: T<'g>, pos: T<'g>, mask: T<'g>, front: i32) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let rope = if self.global { &GLOBAL_ROPE } else { &LOCAL_ROPE };
        let q = self.q_norm.forward(g, self.q.forward(g, x).reshape(&[HEAD_DIM, HEADS, l, n])).rope_ext(pos, rope);
        let mut k = self.k_norm.forward(g, self.k.forward(g, x).reshape(&[HEAD_DIM, KV_HEADS, l, n])).rope_ext(pos, rope);
        let mut v = self.v.forward(g, x).reshape(&[HEAD_DIM, KV_HEADS, l, n]);
        if front > 0 {
            k = k.pad_ext([0, 0, front, 0], [0; 4]);
            v = v.pad_ext([0, 0, front, 0], [0; 4]);
        }
        self.o.forward(g, grouped_attention(g, q, k, v, HEADS, mask))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pos: T<'g>, mask: T<'g>, local_mask: T<'g>, front: i32) -> T<'g> {
        let mask = if self.global { mask } else { local_mask };
        let h = self.attention(g, self.input_norm.forward(g, x), pos, mask, front);
        let x = self.post_attention_norm.forward(g, h).add_inplace(x);
        let y = self.pre_ffw_norm.forward(g, x);
        self.post_ffw_norm.forward(g, gelu_mlp(g, [self.gate, self.up, self.down], y)).add_inplace(x)
    }
}

/// Gemma 3's text model whose weights live in a `ParamStore`.
pub struct Gemma3Model {
    pub cfg: Gemma3Config,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: Norm,
}

impl Gemma3Model {
    /// Declares every weight under the scope's prefix (e.g. [`LLM_PREFIX`]) + `model.`.
    pub fn new(s: &mut Scope, cfg: &Gemma3Config) -> Gemma3Model {
        let mut m = s.sub("model");
        let embed_tokens = Embedding::new(&mut m, "embed_tokens", cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers).map(|i| Block::new(&mut m.sub(&format!("layers.{i}")), cfg, i)).collect();
        let norm = Norm::plain(&mut m, "norm", cfg.hidden_size);
        Gemma3Model { cfg: cfg.clone(), embed_tokens, layers, norm }
    }

    /// Every hidden state of `ids` (i32 `[L, 1]`) side by side, `[hidden × (layers + 1), keep]`
    /// for the last `keep` tokens: the scaled embeddings, the outputs of layers 0..L-2 and the
    /// normed final state. `mask` / `local_mask` are the additive `[front + L, L]` masks of the
    /// global and the local layers, over `front` zero keys and then the tokens'.
    #[allow(clippy::too_many_arguments)]
    pub fn all_states<'g>(&self, g: &'g Graph, ids: T<'g>, pos: T<'g>, mask: T<'g>, local_mask: T<'g>, keep: i64, front: i32) -> T<'g> {
        let len = ids.ne()[0];
        let last = |t: T<'g>| {
            let nb1 = t.nb()[1];
            t.view(&[t.ne()[0], keep], &[nb1], (len - keep) as usize * nb1).cont()
        };
        let mut x = self.embed_tokens.forward(g, ids).scale_inplace((self.cfg.hidden_size as f32).sqrt());
        let mut states = vec![last(x)];
        for (i, b) in self.layers.iter().enumerate() {
            x = b.forward(g, x, pos, mask, local_mask, front);
            if i + 1 < self.layers.len() {
                states.push(last(x));
            }
        }
        states.push(last(self.norm.forward(g, x)));
        states.into_iter().reduce(|a, b| a.concat(b, 0)).expect("the embeddings are always a state")
    }
}

/// The additive masks `[front + len, len]` (global, local) of `len` tokens at positions
/// `front..`: causal, never to a token whose `attend` is false nor to the `front` keys before
/// them, and in the local layers nothing [`SLIDING_WINDOW`] or more positions back.
pub fn masks(attend: &[bool], front: usize) -> (Vec<f32>, Vec<f32>) {
    let global = causal_mask_after(attend, front);
    let local = hide_far_keys(&global, front, attend.len(), SLIDING_WINDOW);
    (global, local)
}

/// Every hidden state `[hidden × (layers + 1), keep]` of the last `keep` tokens of `ids`,
/// attending causally and never to the tokens whose `attend` is false (padding). The tokens
/// sit at positions `first_pos..`: a suffix of a longer sequence whose front they never see
/// (masked padding) gets the positions it has there, and its attention runs over as many
/// keys as that sequence's (zeros where the padding would be), so that every sum is the
/// reference's over the whole padded prompt, term for term.
pub fn all_hidden_states(runner: &mut Runner, model: &Gemma3Model, ids: &[i32], attend: &[bool], keep: usize, first_pos: usize) -> Result<Tensor> {
    let cfg = &model.cfg;
    let len = ids.len();
    ensure!(len > 0 && attend.len() == len, "Gemma 3 input has {len} tokens and {} mask values", attend.len());
    ensure!(keep > 0 && keep <= len, "Gemma 3: {keep} of {len} tokens asked for");
    ensure!(cfg.num_layers > 0, "the Gemma 3 text model has no layers");
    check_ids(ids, cfg.vocab_size, "Gemma 3")?;
    let (mask, local) = masks(attend, first_pos);
    let keys = (first_pos + len) as i64;
    let pos: Vec<i32> = (first_pos..first_pos + len).map(|p| p as i32).collect();
    let out = runner.compute(|g| {
        let ids = g.input_i32(ids, &[len as i64, 1]);
        let pos = g.input_i32(&pos, &[len as i64]);
        let mask = g.input_f32(&mask, &[keys, len as i64]);
        let local = g.input_f32(&local, &[keys, len as i64]);
        Ok(model.all_states(g, ids, pos, mask, local, keep as i64, first_pos as i32))
    })?;
    out.reshape(&[cfg.hidden_size as usize * cfg.states(), keep])
}

/// Where the reference puts the text encoder's weights.
pub const PREFIX: &str = LLM_PREFIX;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sixth_layer_is_global() {
        let globals: Vec<usize> = (0..12).filter(|i| i % PATTERN == PATTERN - 1).collect();
        assert_eq!(globals, [5, 11]);
    }

    #[test]
    fn local_mask_cuts_the_window_only() {
        let len = SLIDING_WINDOW + 2;
        let (full, local) = masks(&vec![true; len], 0);
        assert_eq!(full, causal_mask(&vec![true; len]));
        // The last query sees back to SLIDING_WINDOW - 1 tokens before it.
        let q = len - 1;
        assert!(local[q * len + q - SLIDING_WINDOW].is_infinite());
        assert_eq!(local[q * len + q - SLIDING_WINDOW + 1], 0.0);
        assert_eq!(&local[..SLIDING_WINDOW * len], &full[..SLIDING_WINDOW * len]);
    }

    #[test]
    fn a_suffix_attends_over_the_whole_sequence_s_keys() {
        // Two tokens at positions 3 and 4 of five, the first of them padding.
        let (full, _) = masks(&[false, true], 3);
        let keys = 5;
        let row = |q: usize| &full[q * keys..(q + 1) * keys];
        // The front keys and the padding are never seen; each token sees itself and before.
        assert!(row(0).iter().all(|&v| v < -1e30));
        assert_eq!(row(1)[4], 0.0);
        assert!(row(1)[..4].iter().all(|&v| v < -1e30));
        assert_eq!(masks(&[true, true], 0).0, causal_mask(&[true, true]));
    }
}
