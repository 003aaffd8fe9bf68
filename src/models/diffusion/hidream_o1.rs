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
//! - Edit: each reference image's vision embeddings replace the prompt's `<|image_pad|>`
//!   tokens (their positions a grid after the text before them), and its pixels (resized by
//!   the conditioner) follow the image's patches as more patch tokens, numbered after it.
//! - The network predicts the clean image; the denoiser gets the flow velocity
//!   `(x - x̂) / σ` with σ = 1 - timestep, the timestep being `1 - t / 1000`.
//!
//! The conditioner's [`HidreamPrompt`] travels packed in the [`Condition`]'s three tensors.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::Linear;
use crate::graph::{Graph, Loaded, Scope, T};
use crate::models::common::dit::{pad_and_patchify, timestep_embedding, unpatchify_and_crop};
use crate::models::condition::Condition;
use crate::models::te::llm::{splice_rows, LlmArch, LlmConfig, LlmModel};
use crate::tensor::Tensor;

/// Pixels per side of an image token.
pub const PATCH_SIZE: i64 = 32;
/// Image positions start here on every axis.
const IMAGE_POSITION_BASE: i32 = 4096;
/// `<|image_pad|>` and `<|vision_start|>`: the token list the positions are read from marks
/// every image token with them.
pub const IMAGE_TOKEN: i32 = 151655;
pub const VISION_START_TOKEN: i32 = 151652;

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
    /// `images`: vision embeddings `[hidden, n]` over the ids from their index on; `refs`:
    /// reference pixels `[W, H, 3, 1]` (sides multiples of 32) read after the image.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, ids: T<'g>, pos: T<'g>, mask: T<'g>, images: &[(usize, T<'g>)], refs: &[T<'g>]) -> T<'g> {
        let [w, h, _, _] = x.ne();
        let n_txt = ids.ne()[0];
        let hidden = self.llm.cfg.hidden_size;
        let txt = splice_rows(self.llm.embed(g, ids), images);
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
        let patches = refs.iter().fold(patches, |acc, &r| acc.concat(pad_and_patchify(g, r, PATCH_SIZE, true), 1));
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

/// The four position rows (t, h, w, e) of the sequence `tokens`, whose image tokens are
/// runs marked by [`IMAGE_TOKEN`] (each run's first token may be the `<|vision_start|>`
/// before it: `skip`), one grid (rows, columns) per run in order. Text counts up from one past
/// the highest time position so far; a run after text sits at the next position, the first
/// run that skips its start token at 4096, later ones at the next position (the reference's
/// `build_position_ids`, whose odd cases, such as a one-token image read as text, are kept).
pub fn positions(tokens: &[i32], grids: &[(usize, usize)], skip: &[bool]) -> Result<Vec<i32>> {
    let n = tokens.len();
    let (mut t, mut hh, mut ww) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let mut fixed = Some(IMAGE_POSITION_BASE);
    let (mut st, mut image) = (0usize, 0usize);
    let text = |t: &mut Vec<i32>, hh: &mut Vec<i32>, ww: &mut Vec<i32>, from: i32, count: usize| {
        for i in 0..count as i32 {
            t.push(from + i);
            hh.push(from + i);
            ww.push(from + i);
        }
    };
    while st < n {
        let next = t.iter().max().map_or(0, |&m| m + 1);
        let Some(ed) = tokens[st..].iter().position(|&id| id == IMAGE_TOKEN).map(|i| st + i) else {
            text(&mut t, &mut hh, &mut ww, next, n - st);
            break;
        };
        let (Some(&(rows, cols)), Some(&skips)) = (grids.get(image), skip.get(image)) else {
            bail!("HiDream-O1: the prompt holds more <|image_pad|> runs than the {} images it was given", grids.len());
        };
        let text_len = (ed - st).saturating_sub(usize::from(skips));
        text(&mut t, &mut hh, &mut ww, next, text_len);
        let base = if skips { fixed.take().unwrap_or(next) } else { next + text_len as i32 };
        for r in 0..rows as i32 {
            for c in 0..cols as i32 {
                t.push(base);
                hh.push(base + r);
                ww.push(base + c);
            }
        }
        st = ed + rows * cols;
        image += 1;
    }
    ensure!(t.len() == n, "HiDream-O1: the prompt's image tokens do not match its images' grids ({} positions for {n} tokens)", t.len());
    let mut p = t;
    p.extend(hh);
    p.extend(ww);
    p.resize(4 * n, 0);
    Ok(p)
}

/// A reference image in the prompt: its vision embeddings `[hidden, rows·cols]` over the
/// prompt's `<|image_pad|>` tokens from `start` (a grid of `rows`×`cols` cells of 32 pixels),
/// and its pixels `[W, H, 3, 1]` in [-1, 1] (sides multiples of 32), read as patch tokens.
#[derive(Clone, Debug)]
pub struct EditImage {
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
    pub embeds: Tensor,
    pub pixels: Tensor,
}

/// What the conditioner hands the network: the prompt's token ids (with the images'
/// `<|image_pad|>` tokens) and its reference images.
#[derive(Clone, Debug, Default)]
pub struct HidreamPrompt {
    pub ids: Vec<i32>,
    pub images: Vec<EditImage>,
}

/// Values per image in the packed table: start, rows, columns, pixel width, pixel height.
const IMAGE_FIELDS: usize = 5;

impl HidreamPrompt {
    /// Packed into a [`Condition`]: the ids (as f32) in `vector`; with images, their
    /// embeddings one after another in `crossattn` `[hidden, Σ rows·cols, 1]`, and in
    /// `concat` the image count, each image's [`IMAGE_FIELDS`] and then every image's pixels.
    pub fn to_condition(&self) -> Result<Condition> {
        let v: Vec<f32> = self.ids.iter().map(|&t| t as f32).collect();
        let mut cond = Condition { vector: Some(Tensor::from_vec(&[v.len()], v)?), ..Condition::default() };
        if self.images.is_empty() {
            return Ok(cond);
        }
        let hidden = self.images[0].embeds.ne(0);
        let mut embeds = Vec::new();
        let mut table = vec![self.images.len() as f32];
        let mut pixels = Vec::new();
        for im in &self.images {
            ensure!(im.embeds.ne(0) == hidden && im.embeds.ne(1) == im.rows * im.cols, "HiDream-O1: vision embeddings of shape {:?} for a {}x{} grid", im.embeds.shape(), im.cols, im.rows);
            embeds.extend_from_slice(im.embeds.data());
            table.extend([im.start, im.rows, im.cols, im.pixels.ne(0), im.pixels.ne(1)].map(|v| v as f32));
            pixels.extend_from_slice(im.pixels.data());
        }
        let n = embeds.len() / hidden;
        cond.crossattn = Some(Tensor::from_vec(&[hidden, n, 1], embeds)?);
        table.extend(pixels);
        cond.concat = Some(Tensor::from_vec(&[table.len()], table)?);
        Ok(cond)
    }

    /// Unpacks [`HidreamPrompt::to_condition`], checking every size.
    pub fn from_condition(cond: &Condition) -> Result<HidreamPrompt> {
        let v = cond.vector.as_ref().context("HiDream-O1 needs the prompt's tokens (no conditioner produced them)")?;
        let ids = v.data().iter().map(|&x| x as i32).collect();
        let (Some(embeds), Some(packed)) = (&cond.crossattn, &cond.concat) else {
            return Ok(HidreamPrompt { ids, images: Vec::new() });
        };
        let packed = packed.data();
        let bad = || crate::error::Error::new("HiDream-O1: malformed reference image data in the condition");
        let count = *packed.first().ok_or_else(bad)? as usize;
        let table = packed.get(1..1 + count * IMAGE_FIELDS).ok_or_else(bad)?;
        let (hidden, mut embed_at, mut pixel_at) = (embeds.ne(0), 0usize, 1 + count * IMAGE_FIELDS);
        let mut images = Vec::with_capacity(count);
        for f in table.chunks_exact(IMAGE_FIELDS) {
            let [start, rows, cols, w, h] = [f[0], f[1], f[2], f[3], f[4]].map(|x| x as usize);
            let n = rows * cols;
            let e = embeds.data().get(embed_at * hidden..(embed_at + n) * hidden).ok_or_else(bad)?;
            let p = packed.get(pixel_at..pixel_at + w * h * 3).ok_or_else(bad)?;
            images.push(EditImage { start, rows, cols, embeds: Tensor::from_vec(&[hidden, n], e.to_vec())?, pixels: Tensor::from_vec(&[w, h, 3, 1], p.to_vec())? });
            embed_at += n;
            pixel_at += w * h * 3;
        }
        Ok(HidreamPrompt { ids, images })
    }

    /// The whole sequence as the positions read it: the ids, then the image's `rows`×`cols`
    /// tokens and each reference image's, every run opened by `<|vision_start|>`; with each
    /// run's grid and whether its start token is one of its cells.
    fn sequence(&self, rows: usize, cols: usize) -> (Vec<i32>, Vec<(usize, usize)>, Vec<bool>) {
        let p = PATCH_SIZE as usize;
        let mut tokens = self.ids.clone();
        let mut grids: Vec<(usize, usize)> = self.images.iter().map(|im| (im.rows, im.cols)).collect();
        let mut skip = vec![false; grids.len()];
        let runs = std::iter::once((rows, cols)).chain(self.images.iter().map(|im| (im.pixels.ne(1) / p, im.pixels.ne(0) / p)));
        for (r, c) in runs {
            tokens.push(VISION_START_TOKEN);
            tokens.extend(std::iter::repeat_n(IMAGE_TOKEN, (r * c).saturating_sub(1)));
            grids.push((r, c));
            skip.push(true);
        }
        (tokens, grids, skip)
    }
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

impl DiffusionModel for Loaded<HidreamO1Model> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let prompt = HidreamPrompt::from_condition(input.cond)?;
        ensure!(input.timesteps.len() == 1, "HiDream-O1 takes one timestep, got {}", input.timesteps.len());
        ensure!(input.ref_latents.is_empty(), "HiDream-O1 reads reference images from its prompt (ref_image_args \"pass_to_vlm=true\"), not as latents");
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
        let (vocab, hidden) = (model.llm.cfg.vocab_size, model.llm.cfg.hidden_size as usize);
        let ids = &prompt.ids;
        ensure!(!ids.is_empty() && ids.iter().all(|&t| t >= 0 && (t as i64) < vocab), "HiDream-O1 prompt tokens outside its {vocab} embeddings");
        let n_txt = ids.len();
        for im in &prompt.images {
            let p = PATCH_SIZE as usize;
            ensure!(
                im.embeds.ne(0) == hidden && im.start + im.rows * im.cols <= n_txt,
                "HiDream-O1: a reference image's {} vision embeddings do not fit the {n_txt} prompt tokens at {}",
                im.rows * im.cols,
                im.start
            );
            let (pw, ph) = (im.pixels.ne(0), im.pixels.ne(1));
            ensure!(pw >= p && ph >= p && pw % p == 0 && ph % p == 0, "HiDream-O1 reads reference images whose sides are multiples of {p}, not {pw}x{ph}");
        }
        let (tokens, grids, skip) = prompt.sequence(rows, cols);
        let pos = positions(&tokens, &grids, &skip)?;
        let len = tokens.len();
        let mask = attention_mask(n_txt, len - n_txt);
        // The reference's timestep rule and the sigma it divides by, in its f32 steps.
        let ts = 1.0f32 - input.timesteps[0] / 1000.0f32;
        let sigma = (1.0f32 - ts).max(1e-6);
        runner.compute(|g| {
            let xin = g.input(x);
            let t = g.input_f32(&[ts], &[1]);
            let ids = g.input_i32(ids, &[n_txt as i64, 1]);
            let pos = g.input_i32(&pos, &[4 * len as i64]);
            let mask = g.input_f32(&mask, &[len as i64, len as i64]);
            let images: Vec<(usize, T)> = prompt.images.iter().map(|im| (im.start, g.input(&im.embeds))).collect();
            let refs: Vec<T> = prompt.images.iter().map(|im| g.input(&im.pixels)).collect();
            let pred = model.forward(g, xin, t, ids, pos, mask, &images, &refs);
            Ok(xin.sub(pred).scale(1.0f32 / sigma))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_only(n_txt: usize, rows: usize, cols: usize) -> Vec<i32> {
        let prompt = HidreamPrompt { ids: vec![1; n_txt], images: Vec::new() };
        let (tokens, grids, skip) = prompt.sequence(rows, cols);
        positions(&tokens, &grids, &skip).unwrap()
    }

    #[test]
    fn text_then_image_positions() {
        let p = text_only(2, 2, 3);
        let n = 8;
        assert_eq!(&p[..n], &[0, 1, 4096, 4096, 4096, 4096, 4096, 4096]);
        assert_eq!(&p[n..2 * n], &[0, 1, 4096, 4096, 4096, 4097, 4097, 4097]);
        assert_eq!(&p[2 * n..3 * n], &[0, 1, 4096, 4097, 4098, 4096, 4097, 4098]);
        assert!(p[3 * n..].iter().all(|&v| v == 0));
    }

    /// Text up to a vision image's pads, its grid after that text, text from one past the
    /// grid's time position; then the image at 4096 and a reference image at 4097.
    #[test]
    fn edit_positions() {
        let image = |start, rows, cols, w, h| EditImage {
            start,
            rows,
            cols,
            embeds: Tensor::zeros(&[4, rows * cols]),
            pixels: Tensor::zeros(&[w, h, 3, 1]),
        };
        let ids = vec![7, VISION_START_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 8, 9];
        let prompt = HidreamPrompt { ids, images: vec![image(2, 1, 2, 32, 64)] };
        let (tokens, grids, skip) = prompt.sequence(1, 2);
        assert_eq!(tokens.len(), 6 + 2 + 2);
        let p = positions(&tokens, &grids, &skip).unwrap();
        let n = 10;
        assert_eq!(&p[..n], &[0, 1, 2, 2, 3, 4, 4096, 4096, 4097, 4097]);
        assert_eq!(&p[n..2 * n], &[0, 1, 2, 2, 3, 4, 4096, 4096, 4097, 4098]);
        assert_eq!(&p[2 * n..3 * n], &[0, 1, 2, 3, 3, 4, 4096, 4097, 4097, 4097]);
        // A one-token image has no pad: the reference reads its start token as text.
        assert_eq!(&text_only(3, 1, 1)[..4], &[0, 1, 2, 3]);
        // More pad runs than images: refused.
        assert!(positions(&[IMAGE_TOKEN, 1, IMAGE_TOKEN], &[(1, 1)], &[false]).is_err());
    }

    #[test]
    fn packs_and_unpacks() {
        let im = EditImage { start: 3, rows: 1, cols: 2, embeds: Tensor::from_vec(&[2, 2], vec![1., 2., 3., 4.]).unwrap(), pixels: Tensor::full(&[32, 64, 3, 1], 0.5) };
        let prompt = HidreamPrompt { ids: vec![5, 6, 7, 8, 9], images: vec![im.clone(), im] };
        let back = HidreamPrompt::from_condition(&prompt.to_condition().unwrap()).unwrap();
        assert_eq!(back.ids, prompt.ids);
        assert_eq!(back.images.len(), 2);
        assert_eq!((back.images[1].start, back.images[1].rows, back.images[1].cols), (3, 1, 2));
        assert_eq!(back.images[1].embeds.data(), &[1., 2., 3., 4.]);
        assert_eq!(back.images[1].pixels.shape(), &[32, 64, 3, 1]);
        let text = HidreamPrompt::from_condition(&HidreamPrompt { ids: vec![1], images: vec![] }.to_condition().unwrap()).unwrap();
        assert!(text.images.is_empty());
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
