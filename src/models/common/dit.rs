//! Pieces shared by the diffusion transformers (Flux / Chroma, SD3's MMDiT): latent ↔ patch
//! tokens, adaLN modulation, RMS norms and the sinusoidal timestep embedding, built with the
//! reference's op sequences (its `DiT` helpers and the blocks of `flux.hpp` / `mmdit.hpp`).

use crate::graph::nn::{pad_circular, scale, Linear};
use crate::graph::{Graph, Scope, F32, T, W};

/// `[W, H, C, N]` → patch tokens `[C·p·p, (H/p)·(W/p), N]` (`patch_last`: each token is C
/// groups of p·p pixels) or `[p·p·C, .., N]` (pixels of one channel interleaved, SD3).
/// W and H must be multiples of p.
pub fn patchify<'g>(x: T<'g>, p: i64, patch_last: bool) -> T<'g> {
    let [w_full, h_full, c, n] = x.ne();
    let (h, w) = (h_full / p, w_full / p);
    debug_assert!(h * p == h_full && w * p == w_full, "patchify of {w_full}x{h_full} by {p}");
    let x = x.reshape(&[p, w, p, h * c * n]).permute(0, 2, 1, 3).cont();
    let x = x.reshape(&[p * p, w * h, c, n]);
    if patch_last {
        x.permute(0, 2, 1, 3).cont().reshape(&[p * p * c, w * h, n])
    } else {
        // torch permute (2, 0, 1, 3) of ggml dims: [pp, wh, C, N] → [C, pp, wh, N].
        x.permute(1, 2, 0, 3).cont().reshape(&[c * p * p, w * h, n])
    }
}

/// Inverse of [`patchify`]: tokens `[C·p·p, h·w, N]` → `[w·p, h·p, C, N]`.
pub fn unpatchify<'g>(x: T<'g>, h: i64, w: i64, p: i64, patch_last: bool) -> T<'g> {
    let [d, _, n, _] = x.ne();
    let c = d / p / p;
    debug_assert_eq!(c * p * p, d);
    let x = if patch_last {
        x.reshape(&[p * p, c, w * h, n]).permute(0, 2, 1, 3).cont()
    } else {
        x.reshape(&[c, p * p, w * h, n]).permute(2, 0, 1, 3).cont()
    };
    x.reshape(&[p, p, w, h * c * n]).permute(0, 2, 1, 3).cont().reshape(&[w * p, h * p, c, n])
}

/// Pads W and H up to multiples of `p` (wrapping around on the graph's circular axes).
pub fn pad_to_patch<'g>(g: &'g Graph, x: T<'g>, p: i64) -> T<'g> {
    let [w, h, _, _] = x.ne();
    let pad_w = ((p - w % p) % p) as i32;
    let pad_h = ((p - h % p) % p) as i32;
    if pad_w == 0 && pad_h == 0 {
        return x;
    }
    pad_circular(g, x, [0; 4], [pad_w, pad_h, 0, 0])
}

/// [`pad_to_patch`] then [`patchify`].
pub fn pad_and_patchify<'g>(g: &'g Graph, x: T<'g>, p: i64, patch_last: bool) -> T<'g> {
    patchify(pad_to_patch(g, x, p), p, patch_last)
}

/// Tokens back to `[W, H, C, N]`, dropping the padding [`pad_to_patch`] added.
pub fn unpatchify_and_crop<'g>(x: T<'g>, h_full: i64, w_full: i64, p: i64, patch_last: bool) -> T<'g> {
    let h = (h_full + (p - h_full % p) % p) / p;
    let w = (w_full + (p - w_full % p) % p) / p;
    let x = unpatchify(x, h, w, p, patch_last);
    let [xw, xh, c, n] = x.ne();
    if xw == w_full && xh == h_full {
        return x;
    }
    let nb = x.nb();
    x.view(&[w_full, h_full, c, n], &[nb[1], nb[2], nb[3]], 0).cont()
}

/// `x + x · scale`, `scale` `[C, N]` broadcast over the tokens of `x` `[C, L, N]` (the
/// Lumina-style blocks' modulation without a shift).
pub fn scale_tokens<'g>(x: T<'g>, scale: T<'g>) -> T<'g> {
    let ne = scale.ne();
    x.add(x.mul(scale.reshape(&[ne[0], 1, ne[1]])))
}

/// Index of the block in a weight name like `…double_blocks.12.img_attn…` (the number after
/// `marker`).
pub fn block_index(name: &str, marker: &str) -> Option<usize> {
    let rest = &name[name.find(marker)? + marker.len()..];
    rest.split('.').next()?.parse().ok()
}

/// `x + x·scale + shift` with `shift`, `scale` of shape `[C, N]` broadcast over the tokens
/// of `x` `[C, L, N]` (adaLN).
pub fn modulate<'g>(x: T<'g>, shift: T<'g>, scale: T<'g>) -> T<'g> {
    let sc = scale.reshape(&[scale.ne()[0], 1, scale.ne()[1]]);
    let sh = shift.reshape(&[shift.ne()[0], 1, shift.ne()[1]]);
    x.add(x.mul(sc)).add(sh)
}

/// Sinusoidal embedding of `t` scaled by `time_factor` (1000 for Flux's [0, 1] timesteps).
pub fn timestep_embedding<'g>(t: T<'g>, dim: i32, max_period: i32, time_factor: f32) -> T<'g> {
    scale(t, time_factor, false).timestep_embedding(dim, max_period)
}

/// Tokens per chunk where a block runs its per-token layers a chunk at a time
/// ([`by_token_chunks`]).
pub const TOKEN_CHUNK: i64 = 512;

/// Tokens `c0 .. c0 + len` of `x` `[C, L, 1]` (a view).
pub fn token_cols<'g>(x: T<'g>, c0: i64, len: i64) -> T<'g> {
    let nb = x.nb();
    x.view(&[x.ne()[0], len, 1], &[nb[1], nb[1] * len as usize], c0 as usize * nb[1])
}

/// `f(c0, len)` over consecutive chunks of at most `chunk` of `l` tokens, concatenated along
/// the tokens. For layers that act on each token alone (norms, modulations, MLPs,
/// projections: every output is the same product or element-wise op as over all tokens at
/// once) this gives the same values, while the chunk's intermediates (an MLP's hidden
/// layer is 3-8 widths a token) live one chunk at a time.
pub fn by_token_chunks<'g>(l: i64, chunk: i64, mut f: impl FnMut(i64, i64) -> Option<T<'g>>) -> Option<T<'g>> {
    let mut out: Option<T<'g>> = None;
    for c0 in (0..l).step_by(chunk.max(1) as usize) {
        let y = f(c0, chunk.min(l - c0))?;
        out = Some(match out {
            Some(o) => o.concat(y, 1),
            None => y,
        });
    }
    out
}

/// `n` equal views of `x` along `dim` (made dense when `cont`), like torch's `chunk`.
pub fn chunk<'g>(x: T<'g>, n: i64, dim: usize, cont: bool) -> Vec<T<'g>> {
    let mut ne = x.ne();
    let nb = x.nb();
    debug_assert!(ne[dim] % n == 0, "chunk of {} into {n}", ne[dim]);
    ne[dim] /= n;
    let stride = ne[dim] as usize * nb[dim];
    (0..n as usize)
        .map(|i| {
            let v = x.view(&ne, &[nb[1], nb[2], nb[3]], stride * i);
            if cont {
                v.cont()
            } else {
                v
            }
        })
        .collect()
}

/// Linear, SiLU, linear: the timestep / vector embedders of SD3 and Z-Image (`mlp.0`,
/// `mlp.2`, f32 weights) and Qwen-Image (`linear_1`, `linear_2`).
#[derive(Clone, Copy, Debug)]
pub struct MlpEmbedder {
    mlp_0: Linear,
    mlp_2: Linear,
}

impl MlpEmbedder {
    pub fn new(s: &mut Scope, name: &str, in_dim: i64, hidden: i64, out_dim: i64) -> MlpEmbedder {
        Self::with_layers(s, name, ["mlp.0", "mlp.2"], in_dim, hidden, out_dim, true)
    }

    /// Layers named `layers` (with biases), weights in f32 when `force_f32`, else the file's type.
    pub fn with_layers(s: &mut Scope, name: &str, layers: [&str; 2], in_dim: i64, hidden: i64, out_dim: i64, force_f32: bool) -> MlpEmbedder {
        let mut s = s.sub(name);
        MlpEmbedder {
            mlp_0: Linear::with_options(&mut s, layers[0], in_dim, hidden, true, force_f32),
            mlp_2: Linear::with_options(&mut s, layers[1], hidden, out_dim, true, force_f32),
        }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.mlp_2.forward(g, self.mlp_0.forward(g, x).silu_inplace())
    }
}

/// RMS normalisation over dim 0 with an f32 scale (`weight` or, in Flux, `scale`).
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub weight: W,
    pub eps: f32,
    /// The scale is applied in place (the shared RMSNorm) or not (Flux's own).
    pub inplace: bool,
}

impl RmsNorm {
    pub fn new(s: &mut Scope, name: &str, leaf: &str, dim: i64, eps: f32, inplace: bool) -> RmsNorm {
        RmsNorm { weight: s.sub(name).tensor(leaf, F32, &[dim]), eps, inplace }
    }

    /// The scale takes a runtime LoRA's difference like every other weight.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = x.rms_norm(self.eps);
        let w = g.adapted_param(self.weight);
        if self.inplace {
            x.mul_inplace(w)
        } else {
            x.mul(w)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, Runner};
    use std::sync::Arc;

    fn runner() -> Runner {
        Runner::new(Arc::new(Backend::cpu().unwrap()), 1)
    }

    /// Patchify puts each 2×2 block of a channel in one token (channel-major with
    /// `patch_last`), and unpatchify (with cropping) gives the input back.
    #[test]
    fn patch_tokens_round_trip() {
        let (w, h, c) = (6i64, 4i64, 2i64);
        let data: Vec<f32> = (0..w * h * c).map(|v| v as f32).collect();
        for patch_last in [true, false] {
            let tokens = runner()
                .compute(|g| Ok(patchify(g.input_f32(&data, &[w, h, c, 1]), 2, patch_last)))
                .unwrap();
            assert_eq!(&tokens.shape()[..3], &[8, 6, 1]);
            // Token 1 is the block at x 2..4, y 0..2.
            let t1 = &tokens.data()[8..16];
            let want: Vec<f32> = if patch_last {
                vec![2., 3., 8., 9., 26., 27., 32., 33.]
            } else {
                vec![2., 26., 3., 27., 8., 32., 9., 33.]
            };
            assert_eq!(t1, &want[..], "patch_last {patch_last}");
            let back = runner()
                .compute(|g| {
                    let t = patchify(g.input_f32(&data, &[w, h, c, 1]), 2, patch_last);
                    Ok(unpatchify_and_crop(t, h, w, 2, patch_last))
                })
                .unwrap();
            assert_eq!(back.data(), &data[..]);
        }
    }

    #[test]
    fn chunks_and_modulation() {
        let data: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let out = runner()
            .compute(|g| {
                let m = g.input_f32(&data, &[6, 2]);
                let parts = chunk(m, 3, 0, true);
                Ok(parts[1])
            })
            .unwrap();
        assert_eq!(out.data(), &[2., 3., 8., 9.]);
        // x + x·scale + shift, per channel and batch item.
        let out = runner()
            .compute(|g| {
                let x = g.input_f32(&[1., 2., 3., 4.], &[2, 2, 1]);
                let shift = g.input_f32(&[10., 20.], &[2, 1]);
                let sc = g.input_f32(&[1., -1.], &[2, 1]);
                Ok(modulate(x, shift, sc))
            })
            .unwrap();
        assert_eq!(out.data(), &[12., 20., 16., 20.]);
    }
}
