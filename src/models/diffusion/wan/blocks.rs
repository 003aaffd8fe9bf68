//! The pieces of a Wan transformer: attention blocks modulated by the timestep (one
//! modulation per latent frame for TI2V), the VACE blocks, the output head and the CLIP-vision
//! projection. Each builds the reference's op sequence (`wan.hpp`), in its order and types.

use crate::graph::nn::{self, LayerNorm, Linear};
use crate::graph::{Graph, Scope, F32, T, W};
use crate::models::common::dit::{chunk, RmsNorm};
use crate::models::common::rope;

use super::config::WanConfig;

/// `x` `[dim, L, 1]` combined with `e` `[dim, 1]` (one modulation for all tokens) or
/// `[dim, 1, F]` (one per latent frame: the L tokens are F runs of L / F).
fn per_frame<'g>(x: T<'g>, e: T<'g>, op: fn(T<'g>, T<'g>) -> T<'g>) -> T<'g> {
    if e.n_dims() < 3 {
        return op(x, e);
    }
    let [dim, l, n, _] = x.ne();
    let frames = e.ne()[2];
    op(x.reshape(&[dim, l / frames, frames, n]), e).reshape(&[dim, l, n])
}

fn modulate_add<'g>(x: T<'g>, e: T<'g>) -> T<'g> {
    per_frame(x, e, T::add)
}

fn modulate_mul<'g>(x: T<'g>, e: T<'g>) -> T<'g> {
    per_frame(x, e, T::mul)
}

/// adaLN: `x + x·scale + shift`, in the reference's op order.
fn scale_shift<'g>(x: T<'g>, shift: T<'g>, scale: T<'g>) -> T<'g> {
    modulate_add(x.add(modulate_mul(x, scale)), shift)
}

/// Layer norm without affine weights (`elementwise_affine = False`).
fn plain_norm(eps: f32) -> LayerNorm {
    LayerNorm { weight: None, bias: None, eps }
}

fn rms(s: &mut Scope, name: &str, dim: i64, eps: f32) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, eps, true)
}

/// The q/k/v/o projections with q and k RMS-normed over the whole width (not per head),
/// which the self- and cross-attention share (the reference derives one from the other).
#[derive(Clone, Copy, Debug)]
struct Projections {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    heads: i64,
}

impl Projections {
    fn new(s: &mut Scope, cfg: &WanConfig) -> Projections {
        let d = cfg.dim;
        Projections {
            q: Linear::new(s, "q", d, d, true),
            k: Linear::new(s, "k", d, d, true),
            v: Linear::new(s, "v", d, d, true),
            o: Linear::new(s, "o", d, d, true),
            norm_q: rms(s, "norm_q", d, cfg.eps),
            norm_k: rms(s, "norm_k", d, cfg.eps),
            heads: cfg.num_heads,
        }
    }

    fn query<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.norm_q.forward(g, self.q.forward(g, x))
    }

    /// Normed keys and values of `x`.
    fn key_value<'g>(&self, g: &'g Graph, x: T<'g>) -> (T<'g>, T<'g>) {
        (self.norm_k.forward(g, self.k.forward(g, x)), self.v.forward(g, x))
    }

    /// Self-attention of `x` `[dim, L, 1]`, q and k rotated by `pe`.
    fn self_attention<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [dim, l, n, _] = x.ne();
        let heads = |t: T<'g>| t.reshape(&[dim / self.heads, self.heads, l, n]);
        let q = self.query(g, x);
        let (k, v) = self.key_value(g, x);
        let out = rope::attention(g, heads(q), heads(k), heads(v), pe, None);
        self.o.forward(g, out)
    }

    fn attend<'g>(&self, g: &'g Graph, q: T<'g>, k: T<'g>, v: T<'g>) -> T<'g> {
        nn::attention(g, q, k, v, self.heads, None, false, g.options.flash_attn, 1.0)
    }
}

/// Cross-attention over the text tokens, and for I2V models also over the CLIP-vision tokens
/// in front of them (their own `k_img` / `v_img`), the two results summed.
#[derive(Clone, Copy, Debug)]
struct CrossAttention {
    p: Projections,
    img: Option<(Linear, Linear, RmsNorm)>,
}

impl CrossAttention {
    fn new(s: &mut Scope, cfg: &WanConfig) -> CrossAttention {
        let p = Projections::new(s, cfg);
        let d = cfg.dim;
        let img = cfg
            .has_img_emb
            .then(|| (Linear::new(s, "k_img", d, d, true), Linear::new(s, "v_img", d, d, true), rms(s, "norm_k_img", d, cfg.eps)));
        CrossAttention { p, img }
    }

    /// `context` `[dim, img_len + txt_len, 1]`; `img_len` is read only by I2V models.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: T<'g>, img_len: i64) -> T<'g> {
        let p = &self.p;
        let q = p.query(g, x);
        let Some((k_img, v_img, norm_k_img)) = self.img else {
            let (k, v) = p.key_value(g, context);
            return p.o.forward(g, p.attend(g, q, k, v));
        };
        let [dim, len, n, _] = context.ne();
        let nb = context.nb();
        let img = context.view(&[dim, img_len, n], &[nb[1], nb[2]], 0);
        let txt = context.view(&[dim, len - img_len, n], &[nb[1], nb[2]], img_len as usize * nb[1]);
        let (k, v) = p.key_value(g, txt);
        let ki = norm_k_img.forward(g, k_img.forward(g, img));
        let vi = v_img.forward(g, img);
        let from_img = p.attend(g, q, ki, vi);
        let from_txt = p.attend(g, q, k, v);
        p.o.forward(g, from_txt.add(from_img))
    }
}

/// One transformer block: modulated self-attention, cross-attention (layer-normed input),
/// modulated GELU (tanh) feed-forward.
#[derive(Clone, Copy, Debug)]
pub(super) struct Block {
    /// `[dim, 6, 1]` f32, added to the projected timestep embedding.
    modulation: W,
    norm1: LayerNorm,
    self_attn: Projections,
    norm3: LayerNorm,
    cross_attn: CrossAttention,
    norm2: LayerNorm,
    ffn_0: Linear,
    ffn_2: Linear,
}

impl Block {
    pub(super) fn new(s: &mut Scope, cfg: &WanConfig) -> Block {
        let (d, eps) = (cfg.dim, cfg.eps);
        Block {
            // The reference looks the type up under a name no file has, so always f32.
            modulation: s.tensor("modulation", F32, &[d, 6, 1]),
            norm1: plain_norm(eps),
            self_attn: Projections::new(&mut s.sub("self_attn"), cfg),
            // `cross_attn_norm` is on in every Wan configuration.
            norm3: LayerNorm::new(s, "norm3", d, eps, true, true),
            cross_attn: CrossAttention::new(&mut s.sub("cross_attn"), cfg),
            norm2: plain_norm(eps),
            ffn_0: Linear::new(s, "ffn.0", d, cfg.ffn_dim, true),
            ffn_2: Linear::new(s, "ffn.2", cfg.ffn_dim, d, true),
        }
    }

    /// x `[dim, L, 1]`, e `[dim, 6, F]` (F = 1, or one per latent frame).
    pub(super) fn forward<'g>(&self, g: &'g Graph, x: T<'g>, e: T<'g>, pe: T<'g>, context: T<'g>, img_len: i64) -> T<'g> {
        let es = chunk(e.add(g.param(self.modulation)), 6, 1, true);
        let y = scale_shift(self.norm1.forward(g, x), es[0], es[1]);
        let y = self.self_attn.self_attention(g, y, pe);
        let x = x.add(modulate_mul(y, es[2]));
        let x = x.add(self.cross_attn.forward(g, self.norm3.forward(g, x), context, img_len));
        let y = scale_shift(self.norm2.forward(g, x), es[3], es[4]);
        let y = self.ffn_0.forward(g, y).contiguous().gelu_inplace();
        let y = self.ffn_2.forward(g, y);
        x.add(modulate_mul(y, es[5]))
    }
}

/// A VACE block: a [`Block`] over the control stream `c` whose projection (`after_proj`) is
/// the hint added to the main stream; the first one first projects the embedded control
/// video and adds the main stream's input to it.
#[derive(Clone, Copy, Debug)]
pub(super) struct VaceBlock {
    block: Block,
    before_proj: Option<Linear>,
    after_proj: Linear,
}

impl VaceBlock {
    pub(super) fn new(s: &mut Scope, cfg: &WanConfig, index: usize) -> VaceBlock {
        let block = Block::new(s, cfg);
        let before_proj = (index == 0).then(|| Linear::new(s, "before_proj", cfg.dim, cfg.dim, true));
        let after_proj = Linear::new(s, "after_proj", cfg.dim, cfg.dim, true);
        VaceBlock { block, before_proj, after_proj }
    }

    /// → (hint, new control stream).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward<'g>(&self, g: &'g Graph, c: T<'g>, x: T<'g>, e: T<'g>, pe: T<'g>, context: T<'g>, img_len: i64) -> (T<'g>, T<'g>) {
        let c = match self.before_proj {
            Some(p) => p.forward(g, c).add(x),
            None => c,
        };
        let c = self.block.forward(g, c, e, pe, context, img_len);
        (self.after_proj.forward(g, c), c)
    }
}

/// The output head: layer norm modulated by the timestep embedding, then the projection to
/// `out_dim` channels per patch pixel.
#[derive(Clone, Copy, Debug)]
pub(super) struct Head {
    modulation: W,
    norm: LayerNorm,
    head: Linear,
}

impl Head {
    pub(super) fn new(s: &mut Scope, cfg: &WanConfig) -> Head {
        let [pt, ph, pw] = cfg.patch_size;
        Head {
            modulation: s.tensor("modulation", F32, &[cfg.dim, 2, 1]),
            norm: plain_norm(cfg.eps),
            head: Linear::new(s, "head", cfg.dim, cfg.out_dim * pt * ph * pw, true),
        }
    }

    /// x `[dim, L, 1]`, e `[dim, F]` (the timestep embedding) → `[out_dim·patch, L, 1]`.
    pub(super) fn forward<'g>(&self, g: &'g Graph, x: T<'g>, e: T<'g>) -> T<'g> {
        let [dim, frames, n, _] = e.ne();
        let e = e.reshape(&[dim, 1, frames, n]).repeat_4d([dim, 2, frames, n]);
        let es = chunk(e.add(g.param(self.modulation)), 2, 1, true);
        let x = scale_shift(self.norm.forward(g, x), es[0], es[1]);
        self.head.forward(g, x)
    }
}

/// `img_emb`: the CLIP-vision hidden states to context tokens (layer norm, linear, GELU,
/// linear, layer norm); FLF2V first adds its learned positions of the 514 tokens.
#[derive(Clone, Copy, Debug)]
pub(super) struct MlpProj {
    emb_pos: Option<W>,
    proj_0: LayerNorm,
    proj_1: Linear,
    proj_3: Linear,
    proj_4: LayerNorm,
}

/// Layer-norm eps of `img_emb` (torch's default).
const MLP_PROJ_EPS: f32 = 1e-5;

impl MlpProj {
    pub(super) fn new(s: &mut Scope, cfg: &WanConfig) -> MlpProj {
        let (c, d) = (cfg.clip_dim, cfg.dim);
        MlpProj {
            emb_pos: (cfg.flf_pos_tokens > 0).then(|| s.tensor("emb_pos", F32, &[c, cfg.flf_pos_tokens, 1])),
            proj_0: LayerNorm::new(s, "proj.0", c, MLP_PROJ_EPS, true, true),
            proj_1: Linear::new(s, "proj.1", c, c, true),
            proj_3: Linear::new(s, "proj.3", c, d, true),
            proj_4: LayerNorm::new(s, "proj.4", d, MLP_PROJ_EPS, true, true),
        }
    }

    /// `clip` `[clip_dim, tokens, 1]` (with `emb_pos`: exactly its token count, checked
    /// before the graph is built) → `[dim, tokens, 1]`.
    pub(super) fn forward<'g>(&self, g: &'g Graph, clip: T<'g>) -> T<'g> {
        let x = match self.emb_pos {
            Some(pos) => clip.add(g.param(pos)),
            None => clip,
        };
        let x = self.proj_0.forward(g, x);
        let x = self.proj_1.forward(g, x).contiguous().gelu_inplace();
        let x = self.proj_3.forward(g, x);
        self.proj_4.forward(g, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, Runner};
    use std::sync::Arc;

    /// Per-frame modulation adds frame f's vector to the f-th run of tokens; a 2-D one adds
    /// the same vector to all.
    #[test]
    fn modulation_is_per_frame_with_a_3d_e() {
        let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), 1);
        // 2 channels, 4 tokens (2 frames of 2), batch 1.
        let x: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let out = runner
            .compute(|g| {
                let x = g.input_f32(&x, &[2, 4, 1]);
                let e = g.input_f32(&[100., 200., 1000., 2000.], &[2, 1, 2]);
                Ok(modulate_add(x, e))
            })
            .unwrap();
        assert_eq!(out.data(), &[100., 201., 102., 203., 1004., 2005., 1006., 2007.]);
        assert_eq!(&out.shape()[..2], &[2, 4]);
        let out = runner
            .compute(|g| {
                let x = g.input_f32(&x, &[2, 4, 1]);
                let e = g.input_f32(&[2., 3.], &[2, 1]);
                Ok(scale_shift(x, e, e))
            })
            .unwrap();
        // Channel 0: x + 2x + 2, channel 1: x + 3x + 3.
        assert_eq!(&out.data()[..4], &[2., 7., 8., 15.]);
    }
}
