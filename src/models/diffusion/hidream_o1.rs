//! HiDream-O1: a Qwen3-VL language model that is itself the denoiser, like the reference's
//! `hidream_o1.hpp`.
//!
//! - Weights under `model.`: the text model `language_model.*` (36 Qwen3 layers of 4096,
//!   32 q / 8 kv heads of 128, q/k norms, interleaved multi-section RoPE), `t_embedder1.mlp.{0,2}`
//!   (the sinusoidal timestep embedding through a SiLU MLP), `x_embedder.proj{1,2}` (32×32 RGB
//!   patches through a 1024-wide bottleneck) and `final_layer2.linear` (back to patches).
//!   The reference fixes every size; the vision tower `model.visual.*` is for edit prompts.
//! - One sequence: the prompt's token embeddings with the last one (`<|tms_token|>`)
//!   replaced by the timestep embedding, then the image's patch tokens. Text tokens attend
//!   causally, the timestep and image tokens to everything; text positions count up from 0,
//!   image tokens sit at (4096, 4096 + row, 4096 + column).
//! - The network predicts the clean image; the denoiser gets the flow velocity
//!   `(x - x̂) / σ` with σ = 1 - timestep, the timestep being `1 - t / 1000`.
//!
//! The prompt's token ids come from the conditioner in [`Condition::vector`] (as f32).

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::Linear;
use crate::graph::{Graph, Loaded, Scope, T};
use crate::models::common::dit::{pad_and_patchify, timestep_embedding, unpatchify_and_crop};
use crate::models::condition::Condition;
use crate::models::te::llm::{LlmArch, LlmConfig, LlmModel};
use crate::tensor::Tensor;

/// Pixels per side of an image token.
pub const PATCH_SIZE: i64 = 32;
/// Image positions start here on every axis.
const IMAGE_POSITION_BASE: i32 = 4096;

/// The reference's fixed Qwen3-VL text model (Qwen3-VL-8B's).
pub fn llm_config() -> LlmConfig {
    LlmConfig { num_layers: 36, hidden_size: 4096, intermediate_size: 12288, vocab_size: 151936, ..LlmConfig::for_arch(LlmArch::Qwen3Vl) }
}

#[derive(Clone, Copy, Debug)]
struct TimestepEmbedder {
    mlp0: Linear,
    mlp2: Linear,
}

/// The HiDream-O1 network (weights declared under `model.`).
pub struct HidreamO1Model {
    pub llm: LlmModel,
    t_embedder: TimestepEmbedder,
    proj1: Linear,
    proj2: Linear,
    final_linear: Linear,
}

impl HidreamO1Model {
    pub fn new(s: &mut Scope) -> HidreamO1Model {
        let cfg = llm_config();
        let h = cfg.hidden_size;
        let patch = PATCH_SIZE * PATCH_SIZE * 3;
        let llm = LlmModel::new_under(s, &cfg, "language_model");
        let t_embedder = {
            let mut t = s.sub("t_embedder1");
            TimestepEmbedder { mlp0: Linear::new(&mut t, "mlp.0", 256, h, true), mlp2: Linear::new(&mut t, "mlp.2", h, h, true) }
        };
        let mut x = s.sub("x_embedder");
        let proj1 = Linear::new(&mut x, "proj1", patch, h / 4, false);
        let proj2 = Linear::new(&mut x, "proj2", h / 4, h, true);
        let final_linear = Linear::new(&mut s.sub("final_layer2"), "linear", h, patch, true);
        HidreamO1Model { llm, t_embedder, proj1, proj2, final_linear }
    }

    /// x `[W, H, 3, 1]`, the model timestep `[1]`, the prompt's ids `[n_txt, 1]` (at least
    /// one), positions `[4·L]` and the mask `[L, L]` → the clean image `[W, H, 3, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, ids: T<'g>, pos: T<'g>, mask: T<'g>) -> T<'g> {
        let [w, h, _, _] = x.ne();
        let n_txt = ids.ne()[0];
        let hidden = self.llm.cfg.hidden_size;
        let txt = self.llm.embed(g, ids);
        let t_emb = timestep_embedding(t, 256, 10000, 1000.0);
        let t_emb = self.t_embedder.mlp2.forward(g, self.t_embedder.mlp0.forward(g, t_emb).silu_inplace());
        let t_emb = t_emb.reshape(&[hidden, 1, 1]);
        let txt = if n_txt > 1 {
            let nb = txt.nb();
            txt.view(&[hidden, n_txt - 1, 1], &[nb[1], nb[2]], 0).cont().concat(t_emb, 1)
        } else {
            t_emb
        };
        let patches = pad_and_patchify(g, x, PATCH_SIZE, true);
        let n_img = patches.ne()[1];
        let vis = self.proj2.forward(g, self.proj1.forward(g, patches));
        let seq = txt.concat(vis, 1);
        let out = self.final_linear.forward(g, self.llm.forward_embeds(g, seq, pos, Some(mask)));
        let nb = out.nb();
        let pred = out.view(&[out.ne()[0], n_img, 1], &[nb[1], nb[2]], n_txt as usize * nb[1]).cont();
        unpatchify_and_crop(pred, h, w, PATCH_SIZE, true)
    }
}

/// Image tokens of a `width`×`height` picture as the conditioner counts them (whole patches).
pub fn image_tokens(width: usize, height: usize) -> (usize, usize) {
    (width / PATCH_SIZE as usize, height / PATCH_SIZE as usize)
}

/// The four position rows (t, h, w, e) of `n_txt` text tokens then a grid of `rows`×`cols`
/// image tokens (the reference's `build_position_ids` for a text-only prompt).
pub fn positions(n_txt: usize, rows: usize, cols: usize) -> Vec<i32> {
    let n = n_txt + rows * cols;
    let mut p = vec![0i32; 4 * n];
    for i in 0..n_txt {
        for a in 0..3 {
            p[a * n + i] = i as i32;
        }
    }
    for r in 0..rows {
        for c in 0..cols {
            let i = n_txt + r * cols + c;
            p[i] = IMAGE_POSITION_BASE;
            p[n + i] = IMAGE_POSITION_BASE + r as i32;
            p[2 * n + i] = IMAGE_POSITION_BASE + c as i32;
        }
    }
    p
}

/// The additive mask `[L, L]` (key fastest): the text tokens before the timestep token see
/// no later token, the timestep and image tokens see all.
pub fn attention_mask(n_txt: usize, n_img: usize) -> Vec<f32> {
    let n = n_txt + n_img;
    let mut m = vec![0.0f32; n * n];
    for q in 0..n_txt.saturating_sub(1) {
        for k in q + 1..n {
            m[q * n + k] = f32::NEG_INFINITY;
        }
    }
    m
}

/// The prompt's token ids from the conditioner (f32 in [`Condition::vector`]).
fn prompt_ids(cond: &Condition) -> Result<Vec<i32>> {
    let v = cond.vector.as_ref().context("HiDream-O1 needs the prompt's tokens (no conditioner produced them)")?;
    Ok(v.data().iter().map(|&x| x as i32).collect())
}

impl DiffusionModel for Loaded<HidreamO1Model> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let ids = prompt_ids(input.cond)?;
        ensure!(input.timesteps.len() == 1, "HiDream-O1 takes one timestep, got {}", input.timesteps.len());
        ensure!(input.ref_latents.is_empty(), "HiDream-O1 edit (reference images) is not supported yet in this build");
        let x = input.x;
        ensure!(x.shape().len() <= 4 && x.ne(2) == 3 && x.ne(3) == 1, "HiDream-O1 denoises one RGB image, got a latent of shape {:?}", x.shape());
        let (w, h) = (x.ne(0), x.ne(1));
        let (cols, rows) = image_tokens(w, h);
        let padded = |v: usize| v.div_ceil(PATCH_SIZE as usize);
        // The reference counts the prompt's image tokens in whole patches but patchifies
        // the padded image, and then aborts when the two differ.
        ensure!(
            cols > 0 && rows > 0 && cols == padded(w) && rows == padded(h),
            "HiDream-O1 generates images whose sides are multiples of {PATCH_SIZE}, not {w}x{h} (stable-diffusion.cpp crashes here)"
        );
        let (model, runner) = self.parts();
        let vocab = model.llm.cfg.vocab_size;
        ensure!(!ids.is_empty() && ids.iter().all(|&t| t >= 0 && (t as i64) < vocab), "HiDream-O1 prompt tokens outside its {vocab} embeddings");
        let n_txt = ids.len();
        let pos = positions(n_txt, rows, cols);
        let mask = attention_mask(n_txt, rows * cols);
        let len = (n_txt + rows * cols) as i64;
        // The reference's timestep rule and the sigma it divides by, in its f32 steps.
        let ts = 1.0f32 - input.timesteps[0] / 1000.0f32;
        let sigma = (1.0f32 - ts).max(1e-6);
        runner.compute(|g| {
            let xin = g.input(x);
            let t = g.input_f32(&[ts], &[1]);
            let ids = g.input_i32(&ids, &[n_txt as i64, 1]);
            let pos = g.input_i32(&pos, &[4 * len]);
            let mask = g.input_f32(&mask, &[len, len]);
            let pred = model.forward(g, xin, t, ids, pos, mask);
            Ok(xin.sub(pred).scale(1.0f32 / sigma))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_then_image_positions() {
        let p = positions(2, 2, 3);
        let n = 8;
        assert_eq!(&p[..n], &[0, 1, 4096, 4096, 4096, 4096, 4096, 4096]);
        assert_eq!(&p[n..2 * n], &[0, 1, 4096, 4096, 4096, 4097, 4097, 4097]);
        assert_eq!(&p[2 * n..3 * n], &[0, 1, 4096, 4097, 4098, 4096, 4097, 4098]);
        assert!(p[3 * n..].iter().all(|&v| v == 0));
    }

    #[test]
    fn text_is_causal_timestep_and_image_see_all() {
        let m = attention_mask(3, 2);
        let row = |q: usize| &m[q * 5..q * 5 + 5];
        assert_eq!(row(0)[1], f32::NEG_INFINITY);
        assert_eq!(row(1)[..2], [0.0, 0.0]);
        assert!(row(1)[2..].iter().all(|v| v.is_infinite()));
        assert!(row(2).iter().chain(row(4)).all(|&v| v == 0.0));
    }
}
