//! HunyuanVideo 1.5: the video transformer of the reference's `hunyuan.hpp`.
//!
//! - Weights under `model.diffusion_model.` in the Flux-style names the reference converts
//!   the released ones to: `img_in.proj` (a strided Conv3d over 1×2×2 patches of the latent,
//!   the picture's latent and the frame mask: 65 channels), `txt_in` (the token refiner:
//!   `input_embedder`, the `t_embedder` / `c_embedder` MLPs of the timestep and of the
//!   prompt's mean hidden state, two `individual_token_refiner.blocks` of gated self-attention
//!   and MLP), `time_in`, `time_r_in` (meanflow), optional `guidance_in`,
//!   `cond_type_embedding`, `double_blocks.N` / `single_blocks.N` (Flux's) and `final_layer`.
//! - Text tokens (all at position 0) and the latent's patch tokens (frame, row, column)
//!   attend jointly through Flux's double blocks with rotary embeddings over axes 16+56+56
//!   (θ 256), which fixes the head size at 128.
//! - The meanflow embedder reads `timestep_r`, a sigma of the schedule (×1000); with it the
//!   two embeddings are averaged.
//!
//! The reference reads the head count from the q/k norms while the width is still its
//! default 2048 (the names are sorted, `double_blocks` before `img_in`): any other width
//! fails its head-size check, which is a clean error here.

use super::flux::{DoubleStreamBlock, FluxConfig, LastLayer, MlpEmbedder, SingleStreamBlock};
use super::wan::rope::wan_ids;
use super::wan::{tokens_to_video, video_dims, PatchEmbed};
use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F16, T, W};
use crate::models::common::dit::{chunk, pad_to_patch, timestep_embedding};
use crate::models::common::rope::{embed_nd, Ids};
use crate::tensor::Tensor;
use std::sync::atomic::{AtomicU8, Ordering};

/// The width the reference assumes when it reads the head count.
const DEFAULT_HIDDEN: i64 = 2048;
/// Rotary axes (frames, rows, columns) and their base.
const AXES_DIM: [usize; 3] = [16, 56, 56];
const THETA: f32 = 256.0;
/// Token refiner blocks (fixed by the reference) and their MLP ratio.
const REFINER_BLOCKS: usize = 2;
const REFINER_MLP_RATIO: i64 = 4;

#[derive(Clone, Debug, PartialEq)]
pub struct HunyuanVideoConfig {
    /// Frames, rows, columns per patch.
    pub patch: [i64; 3],
    pub in_channels: i64,
    pub out_channels: i64,
    pub hidden_size: i64,
    pub context_in_dim: i64,
    pub mlp_ratio: f32,
    pub num_heads: i64,
    pub depth: usize,
    pub depth_single_blocks: usize,
    pub qkv_bias: bool,
    pub guidance_embed: bool,
    pub use_meanflow: bool,
    /// The meanflow embeddings are summed, not averaged (models with `vision_in`).
    pub meanflow_sum: bool,
    pub cond_type_embedding: bool,
    /// ByT5 glyph mapper (`byt5_in`), read when the condition carries ByT5 states.
    pub use_byt5: bool,
}

impl HunyuanVideoConfig {
    /// The configuration under `prefix`, read from the weights like the reference (names in
    /// sorted order).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> HunyuanVideoConfig {
        let mut cfg = HunyuanVideoConfig {
            patch: [1, 2, 2],
            in_channels: 65,
            out_channels: 32,
            hidden_size: DEFAULT_HIDDEN,
            context_in_dim: 3584,
            mlp_ratio: 4.0,
            num_heads: 16,
            depth: 0,
            depth_single_blocks: 0,
            qkv_bias: false,
            guidance_embed: false,
            use_meanflow: false,
            meanflow_sum: false,
            cond_type_embedding: false,
            use_byt5: false,
        };
        let mut names: Vec<&String> = types.keys().filter(|n| n.starts_with(prefix)).collect();
        names.sort();
        let img_embed_dim = shape_of(&format!("{prefix}img_in.proj.bias")).and_then(|s| s.first().copied()).unwrap_or(0);
        for name in names {
            let rel = &name[prefix.len()..];
            let shape = shape_of(name).unwrap_or_default();
            let index = |marker: &str| rel.strip_prefix(marker).and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
            if let Some(i) = index("double_blocks.") {
                cfg.depth = cfg.depth.max(i + 1);
            }
            if let Some(i) = index("single_blocks.") {
                cfg.depth_single_blocks = cfg.depth_single_blocks.max(i + 1);
            }
            match rel {
                "img_in.proj.weight" if shape.len() == 5 => {
                    cfg.patch = [shape[2], shape[1], shape[0]];
                    cfg.in_channels = shape[3];
                    cfg.hidden_size = shape[4];
                }
                "img_in.proj.weight" if shape.len() == 4 => {
                    cfg.patch = [shape[2], shape[1], shape[0]];
                    if img_embed_dim > 0 && shape[3] % img_embed_dim == 0 {
                        cfg.hidden_size = img_embed_dim;
                        cfg.in_channels = shape[3] / img_embed_dim;
                    }
                }
                "txt_in.input_embedder.weight" if !shape.is_empty() => cfg.context_in_dim = shape[0],
                // Read while the width is whatever is known so far (see the module notes).
                "double_blocks.0.img_attn.norm.key_norm.scale" | "double_blocks.0.img_attn.norm.key_norm.weight" if !shape.is_empty() => {
                    cfg.num_heads = cfg.hidden_size / shape[0].max(1);
                }
                "double_blocks.0.img_mlp.0.weight" if shape.len() == 2 => cfg.mlp_ratio = shape[1] as f32 / shape[0] as f32,
                _ => {}
            }
            cfg.guidance_embed |= rel.starts_with("guidance_in.");
            cfg.use_byt5 |= rel.starts_with("byt5_in.");
            cfg.use_meanflow |= rel.starts_with("time_r_in.");
            cfg.meanflow_sum |= rel.starts_with("vision_in.");
        }
        cfg.cond_type_embedding = types.contains_key(&format!("{prefix}cond_type_embedding.weight"));
        if let Some(s) = shape_of(&format!("{prefix}final_layer.linear.weight")).filter(|s| s.len() == 2) {
            cfg.out_channels = s[1] / cfg.patch_volume();
        }
        cfg.qkv_bias = types.contains_key(&format!("{prefix}double_blocks.0.img_attn.qkv.bias"));
        cfg
    }

    pub fn patch_volume(&self) -> i64 {
        self.patch.iter().product()
    }

    fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads.max(1)
    }

    /// The reference's checks (its asserts), and what this implementation supports.
    pub fn validate(&self) -> Result<()> {
        let axes: usize = AXES_DIM.iter().sum();
        ensure!(
            self.num_heads > 0 && self.hidden_size % self.num_heads == 0 && self.head_dim() == axes as i64,
            "the HunyuanVideo transformer is {} wide with {} heads (the count the reference reads from the q/k norms while it assumes a width of {DEFAULT_HIDDEN}): heads must be {axes} wide for its rotary axes {AXES_DIM:?}, so the width must be {} (stable-diffusion.cpp aborts)",
            self.hidden_size,
            self.num_heads,
            axes as i64 * self.num_heads
        );
        ensure!(self.depth > 0 || self.depth_single_blocks > 0, "the HunyuanVideo transformer has no blocks");
        ensure!(
            self.patch[0] == 1 && self.patch[1] == self.patch[2] && self.patch[1] > 0,
            "HunyuanVideo patches of {:?} (frames, rows, columns) are not supported: 1×p×p only",
            self.patch
        );
        ensure!(self.out_channels > 0, "the HunyuanVideo transformer has no final_layer.linear (its output channels are unknown)");
        Ok(())
    }
}

/// One block of the token refiner: gated self-attention and MLP, gates from the timestep
/// and prompt embedding.
#[derive(Clone, Copy, Debug)]
struct RefinerBlock {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    ada_ln: Linear,
    heads: i64,
}

impl RefinerBlock {
    fn new(s: &mut Scope, h: i64, heads: i64) -> RefinerBlock {
        RefinerBlock {
            norm1: LayerNorm::new(s, "norm1", h, 1e-6, true, true),
            qkv: Linear::new(s, "self_attn.qkv", h, 3 * h, true),
            proj: Linear::new(s, "self_attn.proj", h, h, true),
            norm2: LayerNorm::new(s, "norm2", h, 1e-6, true, true),
            fc1: Linear::new(s, "mlp.0", h, REFINER_MLP_RATIO * h, true),
            fc2: Linear::new(s, "mlp.2", REFINER_MLP_RATIO * h, h, true),
            ada_ln: Linear::new(s, "adaLN_modulation.1", h, 2 * h, true),
            heads,
        }
    }

    fn forward<'g>(&self, g: &'g Graph, txt: T<'g>, t_emb: T<'g>) -> T<'g> {
        let (q, k, v) = nn::split_qkv(self.qkv.forward(g, self.norm1.forward(g, txt)));
        let attn = nn::attention(g, q, k, v, self.heads, None, false, g.options.flash_attn, 1.0);
        let attn = self.proj.forward(g, attn);
        let gates = chunk(self.ada_ln.forward(g, t_emb.silu()), 2, 0, true);
        let txt = txt.add(attn.mul(gates[0]));
        let mlp = self.fc2.forward(g, self.fc1.forward(g, self.norm2.forward(g, txt)).silu_inplace());
        txt.add(mlp.mul(gates[1]))
    }
}

/// `txt_in`: the prompt's hidden states to tokens, refined under the timestep and the
/// prompt's mean.
#[derive(Clone, Debug)]
struct TokenRefiner {
    input_embedder: Linear,
    t_embedder: MlpEmbedder,
    c_embedder: MlpEmbedder,
    blocks: Vec<RefinerBlock>,
}

impl TokenRefiner {
    fn new(s: &mut Scope, cfg: &HunyuanVideoConfig) -> TokenRefiner {
        let (h, ctx) = (cfg.hidden_size, cfg.context_in_dim);
        let mut s = s.sub("txt_in");
        TokenRefiner {
            input_embedder: Linear::new(&mut s, "input_embedder", ctx, h, true),
            t_embedder: MlpEmbedder::new(&mut s, "t_embedder", 256, h, true),
            c_embedder: MlpEmbedder::new(&mut s, "c_embedder", ctx, h, true),
            blocks: (0..REFINER_BLOCKS)
                .map(|i| RefinerBlock::new(&mut s.sub(&format!("individual_token_refiner.blocks.{i}")), h, cfg.num_heads))
                .collect(),
        }
    }

    /// `txt` `[ctx, L, 1]`, `t` `[1]` → `[hidden, L, 1]`.
    fn forward<'g>(&self, g: &'g Graph, txt: T<'g>, t: T<'g>) -> T<'g> {
        let t_emb = self.t_embedder.forward(g, timestep_embedding(t, 256, 10000, 1.0));
        let len = txt.ne()[1];
        let pooled = nn::scale(txt.permute(1, 0, 2, 3).cont().sum_rows(), 1.0 / len as f32, false).permute(1, 0, 2, 3).cont();
        let t_emb = t_emb.add(self.c_embedder.forward(g, pooled));
        let mut x = self.input_embedder.forward(g, txt);
        for b in &self.blocks {
            x = b.forward(g, x, t_emb);
        }
        x
    }
}

/// ByT5's width, which `byt5_in` reads (the reference's mapper is built for it).
pub const BYT5_WIDTH: i64 = 1472;
/// The mapper's inner width.
const BYT5_MAPPER_WIDTH: i64 = 2048;

/// `byt5_in`: the glyph encoder's states to text tokens (LayerNorm, three linears with GELU
/// between).
struct ByT5Mapper {
    norm: LayerNorm,
    fc: [Linear; 3],
}

impl ByT5Mapper {
    fn new(s: &mut Scope, hidden: i64) -> ByT5Mapper {
        let mut s = s.sub("byt5_in");
        ByT5Mapper {
            norm: LayerNorm::new(&mut s, "layernorm", BYT5_WIDTH, 1e-5, true, true),
            fc: [
                Linear::new(&mut s, "fc1", BYT5_WIDTH, BYT5_MAPPER_WIDTH, true),
                Linear::new(&mut s, "fc2", BYT5_MAPPER_WIDTH, BYT5_MAPPER_WIDTH, true),
                Linear::new(&mut s, "fc3", BYT5_MAPPER_WIDTH, hidden, true),
            ],
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.fc[0].forward(g, self.norm.forward(g, x)).contiguous().gelu();
        let x = self.fc[1].forward(g, x).contiguous().gelu();
        self.fc[2].forward(g, x)
    }
}

/// The HunyuanVideo transformer.
pub struct HunyuanVideoModel {
    pub config: HunyuanVideoConfig,
    img_in: PatchEmbed,
    txt_in: TokenRefiner,
    time_in: MlpEmbedder,
    time_r_in: Option<MlpEmbedder>,
    guidance_in: Option<MlpEmbedder>,
    cond_type: Option<W>,
    byt5_in: Option<ByT5Mapper>,
    double_blocks: Vec<DoubleStreamBlock>,
    single_blocks: Vec<SingleStreamBlock>,
    final_layer: LastLayer,
    warned: AtomicU8,
}

impl HunyuanVideoModel {
    pub fn new(s: &mut Scope, cfg: &HunyuanVideoConfig) -> HunyuanVideoModel {
        let h = cfg.hidden_size;
        let blocks = FluxConfig::for_blocks(h, cfg.num_heads, cfg.mlp_ratio, cfg.qkv_bias);
        HunyuanVideoModel {
            config: cfg.clone(),
            img_in: PatchEmbed::with_dims(&mut s.sub("img_in.proj"), cfg.in_channels, h, cfg.patch),
            txt_in: TokenRefiner::new(s, cfg),
            time_in: MlpEmbedder::new(s, "time_in", 256, h, true),
            time_r_in: cfg.use_meanflow.then(|| MlpEmbedder::new(s, "time_r_in", 256, h, true)),
            guidance_in: cfg.guidance_embed.then(|| MlpEmbedder::new(s, "guidance_in", 256, h, true)),
            cond_type: cfg.cond_type_embedding.then(|| s.tensor("cond_type_embedding.weight", F16, &[h, 3])),
            byt5_in: cfg.use_byt5.then(|| ByT5Mapper::new(s, h)),
            double_blocks: (0..cfg.depth).map(|i| DoubleStreamBlock::new(&mut s.sub(&format!("double_blocks.{i}")), &blocks, i)).collect(),
            single_blocks: (0..cfg.depth_single_blocks)
                .map(|i| SingleStreamBlock::new(&mut s.sub(&format!("single_blocks.{i}")), &blocks, i))
                .collect(),
            final_layer: LastLayer::new(s, h, cfg.out_channels * cfg.patch_volume(), true),
            warned: AtomicU8::new(0),
        }
    }

    /// One evaluation: the latent `x` `[W, H, T, C]` (concat channels appended, padded to
    /// `in_channels`), timestep `[1]`, text `[ctx, L, 1]`, the meanflow sigma `[1]`, the
    /// distilled guidance `[1]`, the glyph encoder's states `[1472, G, 1]` and the rotation
    /// table → `[W, H, T, out_channels]`.
    #[allow(clippy::too_many_arguments)]
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, timestep_r: Option<T<'g>>, guidance: T<'g>, glyphs: Option<T<'g>>, pe: T<'g>) -> T<'g> {
        let cfg = &self.config;
        let p = cfg.patch[2];
        let [w, h, frames, _] = x.ne();
        let mut img = self.img_in.forward(g, pad_to_patch(g, x, p));
        let mut txt = self.txt_in.forward(g, context, t);
        let mut vec = self.time_in.forward(g, timestep_embedding(t, 256, 10000, 1.0));
        if let (Some(tr), Some(r)) = (&self.time_r_in, timestep_r) {
            vec = vec.add(tr.forward(g, timestep_embedding(r, 256, 10000, 1000.0)));
            if !cfg.meanflow_sum {
                vec = nn::scale(vec, 0.5, false);
            }
        }
        if let Some(gi) = &self.guidance_in {
            vec = vec.add(gi.forward(g, timestep_embedding(guidance, 256, 10000, 1.0)));
        }
        // Each kind of text token gets its row of the table: the prompt's 0, the glyphs' 1.
        let typed = |x: T<'g>, kind: usize| -> T<'g> {
            let Some(table) = self.cond_type else { return x };
            let table = g.param(table);
            let row = table.view(&[table.ne()[0]], &[], kind * table.nb()[1]);
            let target = g.new_tensor(row.ty(), &[cfg.hidden_size, x.ne()[1], x.ne()[2]]);
            x.add(row.repeat(target).cast(x.ty()))
        };
        txt = typed(txt, 0);
        if let (Some(mapper), Some(glyphs)) = (&self.byt5_in, glyphs) {
            let glyphs = typed(mapper.forward(g, glyphs), 1);
            txt = if self.cond_type.is_some() { glyphs.concat(txt, 1) } else { txt.concat(glyphs, 1) };
        }
        for block in &self.double_blocks {
            (img, txt) = block.forward(g, img, txt, vec, pe, None, None);
        }
        if !self.single_blocks.is_empty() {
            let n_img = img.ne()[1];
            let mut txt_img = txt.concat(img, 1);
            for block in &self.single_blocks {
                txt_img = block.forward(g, txt_img, vec, pe, None, None);
            }
            let [d, _, n, _] = txt_img.ne();
            let nb = txt_img.nb();
            img = txt_img.view(&[d, n_img, n], &[nb[1], nb[2]], txt.ne()[1] as usize * nb[1]);
        }
        tokens_to_video(self.final_layer.forward(g, img, vec), [w, h, frames], p)
    }

    fn warn_once(&self, bit: u8, what: &str) {
        if self.warned.fetch_or(1 << bit, Ordering::Relaxed) & (1 << bit) == 0 {
            sd_warn!("HunyuanVideo: {what}");
        }
    }
}

/// The rotation table of `context_len` text tokens (all at 0) and a `t`×`h`×`w` latent.
pub fn hunyuan_video_pe(t: usize, h: usize, w: usize, patch: [usize; 3], context_len: usize) -> Vec<f32> {
    let mut ids = Ids { n_axes: 3, data: vec![0.0; context_len * 3] };
    ids.data.extend(wan_ids(t, h, w, patch).data);
    embed_nd(&ids, THETA, &AXES_DIM, None)
}

impl DiffusionModel for Loaded<HunyuanVideoModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let (model, runner) = self.parts();
        let cfg = &model.config;
        let [w, h, frames, channels] =
            video_dims(input.x).with_context(|| format!("HunyuanVideo takes a video latent [W, H, T, C, 1], got {:?}", input.x.shape()))?;
        ensure!(channels as i64 == cfg.out_channels, "HunyuanVideo outputs {} channels for a latent of {channels}", cfg.out_channels);
        let context = input.cond.crossattn.as_ref().context("HunyuanVideo needs a text context (no text encoder output)")?;
        ensure!(
            context.ne(0) as i64 == cfg.context_in_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "HunyuanVideo's text context must be [{}, L, 1], got {:?}",
            cfg.context_in_dim,
            context.shape()
        );
        ensure!(input.timesteps.len() == 1, "HunyuanVideo takes one timestep, got {}", input.timesteps.len());
        let concat = input.cond.concat.as_ref();
        let mut total = channels;
        if let Some(c) = concat {
            let d = video_dims(c)
                .filter(|d| d[..3] == [w, h, frames])
                .with_context(|| format!("HunyuanVideo: the concat latent must be [{w}, {h}, {frames}, C, 1] like the latent, got {:?}", c.shape()))?;
            total += d[3];
        }
        ensure!(
            total as i64 <= cfg.in_channels,
            "HunyuanVideo takes {} latent channels, got {total} (with the picture's conditioning)",
            cfg.in_channels
        );
        if !input.skip_layers.is_empty() {
            model.warn_once(0, "skip-layer guidance is ignored");
        }
        if !input.ref_latents.is_empty() {
            model.warn_once(1, "reference latents are ignored");
        }
        // The glyph encoder's states, read by a transformer with the mapper.
        let glyphs = input.cond.extra_context.as_ref().filter(|_| cfg.use_byt5);
        if let Some(gl) = glyphs {
            ensure!(
                gl.ne(0) as i64 == BYT5_WIDTH && gl.ne(1) > 0 && gl.ne(2) == 1,
                "HunyuanVideo's glyph states must be [{BYT5_WIDTH}, G, 1] (ByT5's width), got {:?}",
                gl.shape()
            );
        }
        let patch = cfg.patch.map(|v| v as usize);
        let pe = hunyuan_video_pe(frames, h, w, patch, context.ne(1) + glyphs.map_or(0, |gl| gl.ne(1)));
        let half = AXES_DIM.iter().sum::<usize>() / 2;
        let pe_ne = [2, 2, half as i64, (pe.len() / half / 4) as i64];
        let ne4 = |c: usize| [w as i64, h as i64, frames as i64, c as i64];
        let pad = cfg.in_channels - total as i64;
        let out = runner.compute(|g| {
            let mut x = g.input_f32(input.x.data(), &ne4(channels));
            if let Some(c) = concat {
                x = x.concat(g.input_f32(c.data(), &ne4(c.ne(3))), 3);
            }
            if pad > 0 {
                x = x.pad(0, 0, 0, pad as i32);
            }
            let t = g.input_f32(input.timesteps, &[1]);
            let r = input.timestep_r.map(|r| g.input_f32(&[r], &[1]));
            let guidance = g.input_f32(&[input.guidance], &[1]);
            let glyphs = glyphs.map(|gl| g.input(gl));
            Ok(model.forward(g, x, t, g.input(context), r, guidance, glyphs, g.input_f32(&pe, &pe_ne)))
        })?;
        out.reshape(&[w, h, frames, channels, 1])
    }
}

/// A loaded HunyuanVideo transformer.
pub type HunyuanVideo = Loaded<HunyuanVideoModel>;
