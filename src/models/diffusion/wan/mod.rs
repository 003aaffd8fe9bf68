//! The Wan 2.x video diffusion transformer (Alibaba's Wan2.1 / Wan2.2), like the reference's
//! `wan.hpp`, in every mode it runs: T2V (1.3B, 14B), I2V and FLF2V (CLIP-vision tokens
//! through `img_emb`, read by extra `k_img` / `v_img` projections; Wan2.2 I2V without them),
//! TI2V 5B (48-channel latent, one timestep per latent frame) and VACE (control blocks whose
//! hints are added to the main stream).
//!
//! - Weights under `model.diffusion_model.` with the Wan-AI names (`patch_embedding`,
//!   `text_embedding.{0,2}`, `time_embedding.{0,2}`, `time_projection.1`, `blocks.N`, `head`,
//!   `img_emb`, `vace_blocks.N`, `vace_patch_embedding`); a file of bare names given as
//!   `diffusion_model_path` gets the prefix from the loader. Modulations are f32 whatever
//!   the file's type (the reference looks their type up under a name no file has).
//! - The latent `[W, H, T, C]` (I2V: the 20 concat channels after the 16 noisy ones) is cut
//!   into 1×2×2 patches by a 3-D convolution (f16 im2col, as `ggml_conv_3d` composes it);
//!   tokens run frame by frame, row by row. RoPE on three axes (frame, row, column: 44, 42,
//!   42 of the 128 head dimensions), θ 10000.
//! - Blocks are adaLN-modulated by the timestep embedding (6 vectors per block, plus the
//!   block's learned `modulation`); with several timesteps (TI2V) each latent frame's tokens
//!   take their frame's vectors.
//! - Unlike the reference, whose padding of odd-sized latents is lost (it then aborts on the
//!   shapes), odd widths and heights are padded to the patch size and cropped after.
//! - Outputs are the reference `WanRunner`'s bit for bit on the synthetic 1.3B files (T2V,
//!   two timesteps, I2V, emb_pos, VACE): `tests/tools/wan_dit_ref.cpp` and the opt-in test
//!   `synthetic_wan21_files_load_and_run`.

mod blocks;
pub mod config;
pub mod rope;
#[cfg(test)]
mod tests;

pub use config::{WanConfig, WanMode};

use self::blocks::{Block, Head, MlpProj, VaceBlock};
use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, Linear};
use crate::graph::{Graph, Loaded, Scope, F16, F32, T, W};
use crate::models::common::dit::{pad_to_patch, timestep_embedding, unpatchify, MlpEmbedder};
use crate::tensor::Tensor;
use std::sync::atomic::{AtomicU8, Ordering};

/// The 1×2×2 patch embedding: a 3-D convolution with stride = kernel, f16 kernel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PatchEmbed {
    weight: W,
    bias: W,
    in_dim: i64,
    patch: [i64; 3],
}

impl PatchEmbed {
    fn new(s: &mut Scope, name: &str, in_dim: i64, cfg: &WanConfig) -> PatchEmbed {
        Self::with_dims(&mut s.sub(name), in_dim, cfg.dim, cfg.patch_size)
    }

    /// The strided Conv3d `weight` / `bias` of `s` from `in_dim` channels to `dim` over
    /// patches of `patch` (frames, rows, columns).
    pub(crate) fn with_dims(s: &mut Scope, in_dim: i64, dim: i64, patch: [i64; 3]) -> PatchEmbed {
        let [pt, ph, pw] = patch;
        PatchEmbed { weight: s.tensor("weight", F16, &[pw, ph, pt, in_dim * dim]), bias: s.tensor("bias", F32, &[dim]), in_dim, patch }
    }

    /// `[W, H, T, C]` (multiples of the patch) → tokens `[dim, L, 1]`.
    pub(crate) fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut w = g.adapted_param(self.weight);
        // A LoRA-patched kernel may come out f32; the convolution takes f16 like the reference's.
        if w.ty() != F16 {
            w = w.cast(F16);
        }
        let [pt, ph, pw] = self.patch;
        let stride = [pw as i32, ph as i32, pt as i32];
        let y = nn::conv_3d(g, x, w, Some(g.adapted_param(self.bias)), self.in_dim, stride, [0; 3], [1; 3]);
        let [ow, oh, od, dim] = y.ne();
        y.reshape(&[ow * oh * od, dim, 1]).permute(1, 0, 2, 3).cont()
    }
}

/// The VACE part: its own patch embedding of the control context and the blocks whose hints
/// follow some main blocks.
struct Vace {
    patch_embedding: PatchEmbed,
    blocks: Vec<VaceBlock>,
    /// Per main block, the VACE block run after it.
    after: Vec<Option<usize>>,
}

/// A Wan transformer whose weights live in a `ParamStore`.
pub struct WanModel {
    pub config: WanConfig,
    patch_embedding: PatchEmbed,
    text_embedding: (Linear, Linear),
    time_embedding: MlpEmbedder,
    time_projection: Linear,
    blocks: Vec<Block>,
    head: Head,
    img_emb: Option<MlpProj>,
    vace: Option<Vace>,
    /// Inputs already warned about as ignored (one bit each), so a sampling run warns once.
    warned: AtomicU8,
}

/// Host inputs of one evaluation after their checks.
struct Inputs<'a> {
    /// `(W, H, T)` of the latent.
    size: [usize; 3],
    channels: usize,
    context: &'a Tensor,
    concat: Option<&'a Tensor>,
    clip: Option<&'a Tensor>,
    vace: Option<(&'a Tensor, f32)>,
}

/// `t`'s first four dimensions when it is `[W, H, T, C]` or `[W, H, T, C, 1]`.
pub(crate) fn video_dims(t: &Tensor) -> Option<[usize; 4]> {
    let s = t.shape();
    let ok = (s.len() == 4 || (s.len() == 5 && s[4] == 1)) && s[..4].iter().all(|&d| d > 0);
    ok.then(|| [s[0], s[1], s[2], s[3]])
}

fn ne4(d: [usize; 4]) -> [i64; 4] {
    d.map(|v| v as i64)
}

/// Head output `[C·p·p, L, 1]` (channels fastest within a patch pixel; tokens frame by frame,
/// row by row) → the `[W, H, T, C]` video, cropped to `size` (the unpadded `W, H, T`).
pub(crate) fn tokens_to_video<'g>(x: T<'g>, size: [i64; 3], p: i64) -> T<'g> {
    let [w, h, frames] = size;
    let (w_len, h_len) = ((w + p - 1) / p, (h + p - 1) / p);
    // A frame's rows follow the previous frame's: unpatchify them as one tall picture.
    let x = unpatchify(x, h_len * frames, w_len, p, false);
    let [_, _, ch, _] = x.ne();
    let x = x.reshape(&[w_len * p, h_len * p, frames, ch]);
    if w_len * p == w && h_len * p == h {
        return x;
    }
    let nb = x.nb();
    x.view(&[w, h, frames, ch], &[nb[1], nb[2], nb[3]], 0).cont()
}

impl WanModel {
    pub fn new(s: &mut Scope, cfg: &WanConfig) -> WanModel {
        let d = cfg.dim;
        let patch_embedding = PatchEmbed::new(s, "patch_embedding", cfg.in_dim, cfg);
        let text_embedding = (Linear::new(s, "text_embedding.0", cfg.text_dim, d, true), Linear::new(s, "text_embedding.2", d, d, true));
        let time_embedding = MlpEmbedder::with_layers(s, "time_embedding", ["0", "2"], cfg.freq_dim, d, d, false);
        let time_projection = Linear::new(s, "time_projection.1", d, 6 * d, true);
        let blocks = (0..cfg.num_layers).map(|i| Block::new(&mut s.sub(&format!("blocks.{i}")), cfg)).collect();
        let head = Head::new(&mut s.sub("head"), cfg);
        let img_emb = cfg.has_img_emb.then(|| MlpProj::new(&mut s.sub("img_emb"), cfg));
        let vace = (cfg.vace_layers > 0).then(|| Vace {
            blocks: (0..cfg.vace_layers).map(|i| VaceBlock::new(&mut s.sub(&format!("vace_blocks.{i}")), cfg, i)).collect(),
            patch_embedding: PatchEmbed::new(s, "vace_patch_embedding", cfg.vace_in_dim, cfg),
            // `detect` / `validate` refuse layouts without a mapping.
            after: cfg.vace_mapping().unwrap_or_default(),
        });
        WanModel {
            config: cfg.clone(),
            patch_embedding,
            text_embedding,
            time_embedding,
            time_projection,
            blocks,
            head,
            img_emb,
            vace,
            warned: AtomicU8::new(0),
        }
    }

    /// One evaluation: the latent `x` `[W, H, T, in_dim]` (concat channels already
    /// appended), timesteps `t` `[1]` or `[T]`, the text context `[text_dim, L, 1]`, the
    /// CLIP-vision tokens `[clip_dim, n, 1]` (I2V), the VACE context `[W, H, T, vace_in_dim]`
    /// with its strength, and the rotation table → `[W, H, T, out_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(
        &self,
        g: &'g Graph,
        x: T<'g>,
        t: T<'g>,
        context: T<'g>,
        clip: Option<T<'g>>,
        vace: Option<(T<'g>, f32)>,
        pe: T<'g>,
    ) -> T<'g> {
        let cfg = &self.config;
        let p = cfg.patch_size[2];
        let [w, h, frames, _] = x.ne();
        let mut x = self.patch_embedding.forward(g, pad_to_patch(g, x, p));

        let e = self.time_embedding.forward(g, timestep_embedding(t, cfg.freq_dim as i32, 10000, 1.0));
        let e0 = self.time_projection.forward(g, e.silu());
        let e0 = e0.reshape(&[cfg.dim, 6, e0.ne()[1], e0.ne()[2]]);

        let (te0, te2) = self.text_embedding;
        let mut context = te2.forward(g, te0.forward(g, context).contiguous().gelu());
        let mut img_len = 0;
        if let Some(clip) = clip {
            if let Some(img_emb) = &self.img_emb {
                context = img_emb.forward(g, clip).concat(context, 1);
            }
            img_len = clip.ne()[1];
        }

        // The control stream with the VACE blocks and the hints' strength.
        let mut control = match (&self.vace, vace) {
            (Some(v), Some((ctx, strength))) => Some((v, v.patch_embedding.forward(g, pad_to_patch(g, ctx, p)), strength)),
            _ => None,
        };
        let x_orig = x;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(g, x, e0, pe, context, img_len);
            if let Some((v, c, strength)) = control.as_mut() {
                if let Some(n) = v.after.get(i).copied().flatten() {
                    let (hint, next) = v.blocks[n].forward(g, *c, x_orig, e0, pe, context, img_len);
                    *c = next;
                    x = x.add(nn::scale(hint, *strength, false));
                }
            }
        }

        tokens_to_video(self.head.forward(g, x, e), [w, h, frames], p)
    }

    /// Warns about an input the model does not act on, once per model.
    fn warn_once(&self, bit: u8, what: &str) {
        if self.warned.fetch_or(1 << bit, Ordering::Relaxed) & (1 << bit) == 0 {
            sd_warn!("{}: {what} is ignored (the Wan transformer does not use it)", self.config.desc());
        }
    }

    /// Checks one evaluation's host inputs against the configuration before a graph is built.
    fn check_inputs<'a>(&self, input: &DiffusionInput<'a>) -> Result<Inputs<'a>> {
        let cfg = &self.config;
        let name = cfg.desc();
        let [w, h, frames, channels] =
            video_dims(input.x).with_context(|| format!("{name} takes a video latent [W, H, T, C, 1], got {:?}", input.x.shape()))?;
        let context = input.cond.crossattn.as_ref().with_context(|| format!("{name} needs a text context (no text encoder output)"))?;
        ensure!(
            context.ne(0) as i64 == cfg.text_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "{name}'s text context must be [{}, L, 1] (UMT5's width), got {:?}",
            cfg.text_dim,
            context.shape()
        );
        let n_t = input.timesteps.len();
        ensure!(n_t == 1 || n_t == frames, "{name} takes one timestep or one per latent frame ({frames}), got {n_t}");

        let concat = input.cond.concat.as_ref();
        let mut total = channels;
        if let Some(c) = concat {
            let d = video_dims(c).filter(|d| d[..3] == [w, h, frames]).with_context(|| {
                format!("{name}: the concat latent must be [{w}, {h}, {frames}, C, 1] like the latent, got {:?}", c.shape())
            })?;
            total += d[3];
        }
        ensure!(
            total as i64 == cfg.in_dim,
            "{name} takes {} latent channels, got {channels}{}",
            cfg.in_dim,
            concat.map_or(String::new(), |c| format!(" + {} concat channels", c.ne(3)))
        );
        ensure!(cfg.out_dim == channels as i64, "{name} outputs {} channels for a latent of {channels}", cfg.out_dim);

        let clip = input.cond.vector.as_ref();
        match (clip, cfg.has_img_emb) {
            (Some(v), true) => {
                ensure!(
                    v.ne(0) as i64 == cfg.clip_dim && v.ne(1) > 0 && v.ne(2) == 1 && v.ne(3) == 1,
                    "{name}'s CLIP-vision tokens must be [{}, n, 1], got {:?}",
                    cfg.clip_dim,
                    v.shape()
                );
                ensure!(
                    cfg.flf_pos_tokens == 0 || v.ne(1) as i64 == cfg.flf_pos_tokens,
                    "{name}: img_emb.emb_pos takes {} CLIP-vision tokens (first and last frame), got {}",
                    cfg.flf_pos_tokens,
                    v.ne(1)
                );
            }
            (None, true) => bail!("{name} needs the CLIP-vision hidden states of the start image (clip_vision_path)"),
            (Some(_), false) => self.warn_once(0, "the CLIP-vision conditioning"),
            (None, false) => {}
        }

        let vace_ctx = input.video.and_then(|v| v.vace_context.map(|c| (c, v.vace_strength)));
        let vace = match (vace_ctx, cfg.vace_layers > 0) {
            (Some((c, strength)), true) => {
                ensure!(
                    video_dims(c) == Some([w, h, frames, cfg.vace_in_dim as usize]),
                    "{name}'s VACE context must be [{w}, {h}, {frames}, {}, 1] like the latent, got {:?}",
                    cfg.vace_in_dim,
                    c.shape()
                );
                Some((c, strength))
            }
            (None, true) => bail!("{name} needs a VACE context (control frames / reference image)"),
            (Some(_), false) => {
                self.warn_once(1, "the VACE context");
                None
            }
            (None, false) => None,
        };
        if !input.skip_layers.is_empty() {
            self.warn_once(2, "skip-layer guidance");
        }
        if !input.ref_latents.is_empty() {
            self.warn_once(3, "the reference latents");
        }
        Ok(Inputs { size: [w, h, frames], channels, context, concat, clip: clip.filter(|_| cfg.has_img_emb), vace })
    }
}

/// Bands of query rows one CPU self-attention is computed in, at most: about 7 graph nodes
/// each, so even 48 blocks (14B + VACE) stay well inside the graph's `MAX_NODES`.
const MAX_SCORE_BANDS: usize = 32;

/// A loaded Wan transformer.
pub type Wan = Loaded<WanModel>;

impl DiffusionModel for Loaded<WanModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let (model, runner) = self.parts();
        let inputs = model.check_inputs(input)?;
        let cfg = &model.config;
        let [w, h, frames] = inputs.size;
        let patch = cfg.patch_size.map(|v| v as usize);
        let pe = rope::wan_pe(frames, h, w, patch, cfg.theta, &cfg.axes_dim);
        let half: usize = cfg.axes_dim.iter().sum::<usize>() / 2;
        let tokens = pe.len() / half / 4;
        let pe_ne = [2, 2, half as i64, tokens as i64];
        // On the CPU, self-attention scores are computed in bands of query rows; a long video
        // would need so many bands that the graph outgrows its node budget. At most
        // MAX_SCORE_BANDS per attention (same numbers, larger bands).
        let saved_limit = runner.options.cpu_scores_limit;
        let band_bytes = tokens * tokens.div_ceil(MAX_SCORE_BANDS) * cfg.num_heads as usize * 4;
        runner.options.cpu_scores_limit = saved_limit.max(band_bytes);
        let out = runner.compute(|g| {
            let mut x = g.input_f32(input.x.data(), &ne4([w, h, frames, inputs.channels]));
            if let Some(c) = inputs.concat {
                x = x.concat(g.input_f32(c.data(), &ne4([w, h, frames, c.ne(3)])), 3);
            }
            let t = g.input_f32(input.timesteps, &[input.timesteps.len() as i64]);
            let clip = inputs.clip.map(|c| g.input(c));
            let vace = inputs.vace.map(|(c, s)| (g.input_f32(c.data(), &ne4([w, h, frames, c.ne(3)])), s));
            Ok(model.forward(g, x, t, g.input(inputs.context), clip, vace, g.input_f32(&pe, &pe_ne)))
        });
        runner.options.cpu_scores_limit = saved_limit;
        out?.reshape(&[w, h, frames, cfg.out_dim as usize, 1])
    }
}
