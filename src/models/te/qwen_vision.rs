//! The vision towers of Qwen2.5-VL and Qwen3-VL (the vision part of the reference's
//! `llm.hpp`), which turn a reference image into embeddings the LLM reads in place of its
//! `<|image_pad|>` tokens (Qwen-Image-Edit, LongCat-Image-Edit; Krea2, Boogu Image). The
//! weights decide which tower a file holds ([`VisionArch`]).
//!
//! The image is cut into 14×14 patches; each patch is seen as two identical frames (the
//! temporal patch of 2) and embedded by a 3-D convolution, or by two 2-D convolutions whose
//! sum is the same thing (llama.cpp mmproj files, `patch_embed.proj.0/1`). Patches are
//! ordered so that every 2×2 group (what the merger joins into one LLM token) is contiguous.
//! Attention is rotated by a 2-D RoPE (row and column, half the rotary width each, halves
//! not interleaved); the merger normalises each patch, joins each 2×2 group and maps it
//! through a GELU MLP to the LLM's width.
//!
//! Qwen2.5-VL: patches are regrouped by windows of 112×112 pixels: most blocks attend within
//! their window (an additive mask), the full-attention blocks (7, 15, 23, 31) attend to
//! everything; blocks are pre-norm with RMS norms and a SiLU-gated MLP; the window order is
//! undone at the end.
//!
//! Qwen3-VL: the patch convolution has a bias, learned position embeddings (a square grid)
//! are interpolated bilinearly to the image's patch grid and added; every block attends to
//! everything, with layer norms and a GELU MLP; the merger's norm is a layer norm and its
//! GELU the exact one. A tower of 24 or 27 blocks also has three deepstack mergers (after
//! blocks 5/11/17 or 8/16/24: a layer norm over each 2×2 group's joined features, then a GELU
//! MLP) whose outputs the LLM adds to its first three layers' states; only MiniMax-H3 reads them
//! in the reference, so only its tower builds them ([`VisionConfig::deepstack`]).
//!
//! Widths come from the weights where the reference reads them (`patch_embed.proj.0`, the
//! patch bias or the position table give the width; an unsplit Qwen2.5-VL tower keeps the
//! 1280 of Qwen2.5-VL-7B), the head count is fixed at 16 and the layer count is the highest
//! block index.

use crate::error::Result;
use crate::graph::nn::{attention, split_qkv, Conv2d, LayerNorm, Linear};
use crate::graph::{nn, Graph, Runner, Scope, TypeMap, F16, F32, T, W};
use crate::models::common::dit::RmsNorm;
use crate::models::common::rope;
use crate::tensor::Tensor;

/// Where the vision tower's weights live (an `llm_vision_path` file gets this prefix; an
/// `llm_path` file that holds the tower has it under `visual.`).
pub const VISION_PREFIX: &str = "text_encoders.llm.visual.";

/// CLIP's pixel normalisation, which the reference applies to the tower's input.
const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// Which tower a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VisionArch {
    Qwen25Vl,
    Qwen3Vl,
}

#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub arch: VisionArch,
    pub num_layers: usize,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub in_channels: i64,
    /// The LLM width the merger maps to.
    pub out_hidden_size: i64,
    pub temporal_patch_size: i64,
    pub patch_size: i64,
    pub spatial_merge_size: i64,
    /// Side of an attention window in pixels.
    pub window_size: i64,
    pub fullatt_blocks: Vec<usize>,
    /// Two 2-D patch convolutions (llama.cpp's mmproj layout) instead of one 3-D one.
    pub split_patch_embed: bool,
    /// Separate q/k/v projections (llama.cpp's names) instead of one fused `qkv`.
    pub separate_qkv: bool,
    /// Qwen3-VL: rows of the learned position table (a square grid).
    pub num_position_embeddings: i64,
    /// Qwen3-VL: the blocks after which a deepstack merger reads the state (empty: none).
    pub deepstack: Vec<usize>,
}

impl Default for VisionConfig {
    /// Qwen2.5-VL-7B's tower, the reference's defaults.
    fn default() -> Self {
        VisionConfig {
            arch: VisionArch::Qwen25Vl,
            num_layers: 32,
            hidden_size: 1280,
            intermediate_size: 3420,
            num_heads: 16,
            in_channels: 3,
            out_hidden_size: 3584,
            temporal_patch_size: 2,
            patch_size: 14,
            spatial_merge_size: 2,
            window_size: 112,
            fullatt_blocks: vec![7, 15, 23, 31],
            split_patch_embed: false,
            separate_qkv: false,
            num_position_embeddings: 0,
            deepstack: Vec::new(),
        }
    }
}

/// Index of the block in `…blocks.12.…`.
fn block_index(name: &str) -> Option<usize> {
    let rest = &name[name.find("blocks.")? + "blocks.".len()..];
    rest.split('.').next()?.parse().ok()
}

impl VisionConfig {
    /// The tower under `prefix` (ending in "visual."), or `None` when the files hold none.
    /// `shape_of` gives ggml-order shapes.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Option<VisionConfig> {
        let mut cfg = VisionConfig::default();
        let mut layers = 0;
        let mut any = false;
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            any = true;
            let rest = &name[prefix.len()..];
            let shape = || shape_of(name).unwrap_or_default();
            if rest.contains("attn.q_proj") {
                cfg.separate_qkv = true;
            }
            match rest {
                "patch_embed.proj.1.weight" => cfg.split_patch_embed = true,
                "patch_embed.proj.0.weight" => {
                    if let [p, _, c, h, ..] = shape()[..] {
                        (cfg.patch_size, cfg.in_channels, cfg.hidden_size) = (p, c, h);
                    }
                }
                "patch_embed.proj.weight" => {
                    if let Some(&p) = shape().first() {
                        cfg.patch_size = p;
                    }
                }
                "patch_embed.bias" | "patch_embed.proj.bias" => {
                    if let Some(&h) = shape().first() {
                        cfg.hidden_size = h;
                    }
                }
                "pos_embed.weight" => {
                    cfg.arch = VisionArch::Qwen3Vl;
                    if let [h, n, ..] = shape()[..] {
                        (cfg.hidden_size, cfg.num_position_embeddings) = (h, n);
                    }
                }
                "blocks.0.mlp.gate_proj.weight" | "blocks.0.mlp.linear_fc1.weight" => {
                    if let [_, n, ..] = shape()[..] {
                        cfg.intermediate_size = n;
                    }
                }
                "merger.mlp.2.weight" | "merger.linear_fc2.weight" => {
                    if let [_, n, ..] = shape()[..] {
                        cfg.out_hidden_size = n;
                    }
                }
                _ => {}
            }
            if rest.starts_with("merger.linear_fc") || rest.contains(".mlp.linear_fc") {
                cfg.arch = VisionArch::Qwen3Vl;
            }
            if rest.starts_with("blocks.") {
                if let Some(i) = block_index(rest) {
                    layers = layers.max(i + 1);
                }
            }
        }
        if !any {
            return None;
        }
        if layers > 0 {
            cfg.num_layers = layers;
        }
        if cfg.arch == VisionArch::Qwen3Vl {
            cfg.deepstack = match cfg.num_layers {
                24 => vec![5, 11, 17],
                27 => vec![8, 16, 24],
                _ => Vec::new(),
            };
        }
        Some(cfg)
    }

    /// Side of the pixel grid images are resized to a multiple of (28).
    pub fn factor(&self) -> i64 {
        self.patch_size * self.spatial_merge_size
    }

    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads
    }

    /// Checks what the graph relies on, so a strange file is an error, not an abort.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.num_layers > 0, "the vision tower has no blocks");
        ensure!(
            self.hidden_size > 0 && self.hidden_size % (4 * self.num_heads) == 0,
            "the vision tower's width {} is not a multiple of 4 × its {} heads",
            self.hidden_size,
            self.num_heads
        );
        ensure!(self.in_channels == 3, "the vision tower takes {} channels, not RGB", self.in_channels);
        ensure!(self.patch_size > 0 && self.window_size >= self.factor(), "the vision tower's patch size {} is unusable", self.patch_size);
        ensure!(
            self.arch == VisionArch::Qwen25Vl || self.num_position_embeddings > 0,
            "the Qwen3-VL vision tower has no position embeddings (pos_embed.weight)"
        );
        Ok(())
    }

    /// Qwen3-VL: side of the learned position grid.
    pub fn position_grid_side(&self) -> usize {
        (self.num_position_embeddings.max(0) as f64).sqrt() as usize
    }
}

#[derive(Clone, Copy, Debug)]
enum PatchEmbed {
    /// One convolution over both frames: kernel [pw, ph, pt, IC·OC] (Qwen3-VL: with a bias).
    Conv3d(W, Option<W>),
    /// One convolution per frame, summed (Qwen3-VL: then `patch_embed.bias`).
    Split(Conv2d, Conv2d, Option<W>),
}

#[derive(Clone, Copy, Debug)]
enum Qkv {
    Fused(Linear),
    Separate(Linear, Linear, Linear),
}

#[derive(Clone, Copy, Debug)]
enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    /// Qwen2.5-VL's RMS norm or Qwen3-VL's layer norm (eps 1e-6) over `dim`.
    fn new(s: &mut Scope, cfg: &VisionConfig, name: &str, dim: i64) -> Norm {
        match cfg.arch {
            VisionArch::Qwen25Vl => Norm::Rms(RmsNorm::new(s, name, "weight", dim, 1e-6, true)),
            VisionArch::Qwen3Vl => Norm::Layer(LayerNorm::new(s, name, dim, 1e-6, true, true)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            Norm::Rms(n) => n.forward(g, x),
            Norm::Layer(n) => n.forward(g, x),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Mlp {
    /// Qwen2.5-VL: down(silu(gate(x)) · up(x)).
    Gated { gate: Linear, up: Linear, down: Linear },
    /// Qwen3-VL: fc2(gelu(fc1(x))).
    Gelu { fc1: Linear, fc2: Linear },
}

#[derive(Clone, Copy, Debug)]
struct Block {
    norm1: Norm,
    norm2: Norm,
    qkv: Qkv,
    proj: Linear,
    mlp: Mlp,
}

impl Block {
    fn new(s: &mut Scope, cfg: &VisionConfig) -> Block {
        let (h, ff) = (cfg.hidden_size, cfg.intermediate_size);
        let (norm1, norm2) = (Norm::new(s, cfg, "norm1", h), Norm::new(s, cfg, "norm2", h));
        let (qkv, proj) = {
            let mut a = s.sub("attn");
            let qkv = if cfg.separate_qkv {
                Qkv::Separate(Linear::new(&mut a, "q_proj", h, h, true), Linear::new(&mut a, "k_proj", h, h, true), Linear::new(&mut a, "v_proj", h, h, true))
            } else {
                Qkv::Fused(Linear::new(&mut a, "qkv", h, 3 * h, true))
            };
            (qkv, Linear::new(&mut a, "proj", h, h, true))
        };
        let mut m = s.sub("mlp");
        let mlp = match cfg.arch {
            VisionArch::Qwen25Vl => Mlp::Gated {
                gate: Linear::new(&mut m, "gate_proj", h, ff, true),
                up: Linear::new(&mut m, "up_proj", h, ff, true),
                down: Linear::new(&mut m, "down_proj", ff, h, true),
            },
            VisionArch::Qwen3Vl => Mlp::Gelu { fc1: Linear::new(&mut m, "linear_fc1", h, ff, true), fc2: Linear::new(&mut m, "linear_fc2", ff, h, true) },
        };
        Block { norm1, norm2, qkv, proj, mlp }
    }

    /// x: [hidden, n]; `pe` the 2-D rotation table, `mask` the window mask (none: full).
    fn forward<'g>(&self, g: &'g Graph, cfg: &VisionConfig, x: T<'g>, pe: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let h = self.norm1.forward(g, x);
        let (q, k, v) = match self.qkv {
            Qkv::Fused(l) => split_qkv(l.forward(g, h)),
            Qkv::Separate(q, k, v) => (q.forward(g, h), k.forward(g, h), v.forward(g, h)),
        };
        let d = cfg.head_dim();
        let heads = |t: T<'g>| {
            let ne = t.ne();
            t.reshape(&[d, cfg.num_heads, ne[1], ne[2]])
        };
        let (q, k, v) = (heads(q), heads(k), heads(v));
        let q = rope::apply_rope_halves(g, q, pe);
        let k = rope::apply_rope_halves(g, k, pe);
        let a = attention(g, q, k, v, cfg.num_heads, mask, true, g.options.flash_attn, 1.0);
        let x = self.proj.forward(g, a).add_inplace(x);
        let h = self.norm2.forward(g, x);
        let m = match self.mlp {
            Mlp::Gated { gate, up, down } => down.forward(g, gate.forward(g, h).silu_inplace().mul_inplace(up.forward(g, h))),
            Mlp::Gelu { fc1, fc2 } => fc2.forward(g, fc1.forward(g, h).gelu()),
        };
        m.add_inplace(x)
    }
}

/// How the patches are laid out for the blocks: Qwen2.5-VL's attention windows (window
/// order → natural merged token, its inverse, the additive mask), or Qwen3-VL's bilinear
/// position lookup (four corner rows of the position table per patch and their weights
/// `[1, n]`).
enum Layout<'g> {
    Windows([T<'g>; 3]),
    Positions([T<'g>; 4], [T<'g>; 4]),
}

/// A deepstack merger: the 2×2 groups' joined features normed, then fc2(gelu_erf(fc1(x))).
#[derive(Clone, Copy, Debug)]
struct DeepstackMerger {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// The vision tower whose weights live in a `ParamStore`.
pub struct QwenVisionModel {
    pub cfg: VisionConfig,
    patch_embed: PatchEmbed,
    pos_embed: Option<nn::Embedding>,
    blocks: Vec<Block>,
    merger_norm: Norm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    deepstack: Vec<DeepstackMerger>,
}

impl QwenVisionModel {
    /// Declares every weight under the scope's prefix ([`VISION_PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &VisionConfig) -> QwenVisionModel {
        let (p, c, h) = (cfg.patch_size, cfg.in_channels, cfg.hidden_size);
        let qwen3 = cfg.arch == VisionArch::Qwen3Vl;
        let patch_embed = {
            let mut pe = s.sub("patch_embed");
            if cfg.split_patch_embed {
                let bias = qwen3.then(|| pe.tensor("bias", F32, &[h]));
                let mut proj = pe.sub("proj");
                let conv = |s: &mut Scope, name: &str| Conv2d::new(s, name, c, h, (p, p), (p as i32, p as i32), (0, 0), false);
                PatchEmbed::Split(conv(&mut proj, "0"), conv(&mut proj, "1"), bias)
            } else {
                let mut proj = pe.sub("proj");
                let w = proj.tensor("weight", F16, &[p, p, cfg.temporal_patch_size, c * h]);
                PatchEmbed::Conv3d(w, qwen3.then(|| proj.tensor("bias", F32, &[h])))
            }
        };
        let pos_embed = qwen3.then(|| nn::Embedding::new(s, "pos_embed", cfg.num_position_embeddings, h));
        let blocks = (0..cfg.num_layers).map(|i| Block::new(&mut s.sub(&format!("blocks.{i}")), cfg)).collect();
        let mut merger = s.sub("merger");
        let joined = h * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let (merger_norm, merger_fc1, merger_fc2) = if qwen3 {
            let norm = Norm::new(&mut merger, cfg, "norm", h);
            (norm, Linear::new(&mut merger, "linear_fc1", joined, joined, true), Linear::new(&mut merger, "linear_fc2", joined, cfg.out_hidden_size, true))
        } else {
            let norm = Norm::new(&mut merger, cfg, "ln_q", h);
            let mut mlp = merger.sub("mlp");
            (norm, Linear::new(&mut mlp, "0", joined, joined, true), Linear::new(&mut mlp, "2", joined, cfg.out_hidden_size, true))
        };
        let deepstack = (0..cfg.deepstack.len())
            .map(|i| {
                let mut d = s.sub(&format!("deepstack_merger_list.{i}"));
                DeepstackMerger {
                    norm: LayerNorm::new(&mut d, "norm", joined, 1e-6, true, true),
                    fc1: Linear::new(&mut d, "linear_fc1", joined, joined, true),
                    fc2: Linear::new(&mut d, "linear_fc2", joined, cfg.out_hidden_size, true),
                }
            })
            .collect();
        QwenVisionModel { cfg: cfg.clone(), patch_embed, pos_embed, blocks, merger_norm, merger_fc1, merger_fc2, deepstack }
    }

    /// Embeddings `[out_hidden, tokens]` of the patches `pixels` ([`patchify`]'s layout) with
    /// the rotation table `pe` and the patches' `layout`, then the deepstack mergers' outputs
    /// (as wide, as many tokens) in block order.
    fn forward<'g>(&self, g: &'g Graph, pixels: T<'g>, pe: T<'g>, layout: Layout<'g>) -> Vec<T<'g>> {
        let cfg = &self.cfg;
        let (p, pt, h) = (cfg.patch_size, cfg.temporal_patch_size, cfg.hidden_size);
        let n = pixels.ne()[1];
        let x = pixels.reshape(&[p, p, pt, n * cfg.in_channels]);
        let x = match self.patch_embed {
            PatchEmbed::Conv3d(w, b) => nn::conv_3d(g, x, g.param(w), g.opt_param(b), cfg.in_channels, [p as i32, p as i32, pt as i32], [0; 3], [1; 3]),
            PatchEmbed::Split(c0, c1, b) => {
                let (ne, nb) = (x.ne(), x.nb());
                let frame = |t: usize| x.view(&[ne[0], ne[1], 1, ne[3]], &[nb[1], nb[2], nb[3]], t * nb[2]).cont().reshape(&[p, p, cfg.in_channels, n]);
                let y = c0.forward(g, frame(0)).add(c1.forward(g, frame(1)));
                match b {
                    Some(b) => y.add_inplace(g.param(b).reshape(&[1, 1, h, 1])),
                    None => y,
                }
            }
        };
        let m2 = cfg.spatial_merge_size * cfg.spatial_merge_size;
        let mut x = x.reshape(&[h, n]);
        let (mask, inverse) = match layout {
            Layout::Windows([window_index, inverse_index, mask]) => {
                x = x.reshape(&[h * m2, n / m2]).get_rows(window_index).reshape(&[h, n]);
                (Some(mask), Some(inverse_index))
            }
            Layout::Positions(rows, weights) => {
                if let Some(table) = self.pos_embed {
                    let table = g.param(table.weight);
                    let pos = (0..4).map(|i| table.get_rows(rows[i]).mul(weights[i])).reduce(|a, b| a.add(b));
                    x = x.add(pos.expect("four corners"));
                }
                (None, None)
            }
        };
        let mut deep = Vec::new();
        for (i, block) in self.blocks.iter().enumerate() {
            let m = mask.filter(|_| !cfg.fullatt_blocks.contains(&i));
            x = block.forward(g, cfg, x, pe, m);
            if let Some(d) = cfg.deepstack.iter().position(|&b| b == i).and_then(|d| self.deepstack.get(d)) {
                let joined = d.norm.forward(g, x.reshape(&[h * m2, n / m2]));
                deep.push(d.fc2.forward(g, d.fc1.forward(g, joined).gelu_erf()));
            }
        }
        let x = self.merger_norm.forward(g, x).reshape(&[h * m2, n / m2]);
        let x = self.merger_fc1.forward(g, x);
        let x = match cfg.arch {
            VisionArch::Qwen25Vl => x.gelu(),
            VisionArch::Qwen3Vl => x.gelu_erf(),
        };
        let x = self.merger_fc2.forward(g, x);
        let x = match inverse {
            Some(inverse) => x.get_rows(inverse),
            None => x,
        };
        std::iter::once(x).chain(deep).collect()
    }
}

/// The image `[W, H, 3, 1]` (RGB in [0, 1]) resized to `w`×`h` like the reference's
/// `clip_preprocess`: scaled (nearest) to cover the target, centre-cropped, clamped and
/// normalised with CLIP's mean and deviation.
pub fn preprocess(image: &Tensor, w: usize, h: usize) -> Result<Tensor> {
    let (iw, ih) = (image.ne(0), image.ne(1));
    ensure!(image.ne(2) == 3 && image.ne(3) == 1 && w > 0 && h > 0, "cannot prepare an image of shape {:?} for the vision tower", image.shape());
    let scale = (w as f32 / iw as f32).max(h as f32 / ih as f32);
    let (rw, rh) = ((scale * iw as f32) as usize, (scale * ih as f32) as usize);
    let (dx, dy) = (rw.saturating_sub(w) / 2, rh.saturating_sub(h) / 2);
    let src = image.data();
    let mut out = Vec::with_capacity(w * h * 3);
    for c in 0..3 {
        for y in 0..h {
            // Nearest resize to rw×rh (`o · in / out`), then the crop.
            let sy = ((y + dy) * ih / rh).min(ih - 1);
            for x in 0..w {
                let sx = ((x + dx) * iw / rw).min(iw - 1);
                let v = src[(c * ih + sy) * iw + sx].clamp(0.0, 1.0);
                out.push((v - CLIP_MEAN[c]) / CLIP_STD[c]);
            }
        }
    }
    Tensor::from_vec(&[w, h, 3, 1], out)
}

/// The patches of `image` `[W, H, C, 1]` as the tower reads them: one row of
/// `C · pt · p · p` values per patch (channel, frame, row, column; both frames the image),
/// patches in 2×2 groups (group by group in row order, each group row by row).
pub fn patchify(cfg: &VisionConfig, image: &Tensor) -> Result<Tensor> {
    patchify_frames(cfg, &[image])
}

/// [`patchify`] of a block of frames (the temporal patch's frames in order; the last one
/// repeated when fewer are given: a picture is both frames), all `[W, H, C, 1]` alike.
pub fn patchify_frames(cfg: &VisionConfig, frames: &[&Tensor]) -> Result<Tensor> {
    let first: &Tensor = frames.first().ok_or_else(|| crate::error::Error::new("no frames for the vision tower"))?;
    let (w, h, c) = (first.ne(0), first.ne(1), first.ne(2));
    ensure!(frames.iter().all(|f| f.shape() == first.shape()), "the frames of a vision block differ in size");
    let (p, m, pt) = (cfg.patch_size as usize, cfg.spatial_merge_size as usize, cfg.temporal_patch_size as usize);
    ensure!(w % (p * m) == 0 && h % (p * m) == 0, "a {w}x{h} image is not a multiple of the vision tower's {}", p * m);
    let (gw, gh) = (w / p, h / p);
    let row = c * pt * p * p;
    let mut out = Vec::with_capacity(row * gw * gh);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for ih in 0..m {
                for iw in 0..m {
                    let (py, px) = (bh * m + ih, bw * m + iw);
                    for ch in 0..c {
                        for t in 0..pt {
                            let src = frames[t.min(frames.len() - 1)].data();
                            for y in 0..p {
                                let start = (ch * h + py * p + y) * w + px * p;
                                out.extend_from_slice(&src[start..start + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    Tensor::from_vec(&[row, gw * gh], out)
}

/// How the merged tokens are regrouped into attention windows.
#[derive(Clone, Debug, PartialEq)]
pub struct Windows {
    /// Window order → natural (row-major) merged-token index.
    pub index: Vec<i32>,
    /// Natural merged-token index → window order.
    pub inverse: Vec<i32>,
    /// Additive mask `[n, n]` over patches in window order: 0 within a window, -inf across.
    pub mask: Vec<f32>,
}

/// The windows of a `grid_h`×`grid_w` patch grid: merged tokens taken window by window
/// (windows in row order, tokens in each row by row), each window `window_size` pixels wide.
pub fn windows(cfg: &VisionConfig, grid_h: usize, grid_w: usize) -> Windows {
    let m = cfg.spatial_merge_size as usize;
    let (lh, lw) = (grid_h / m, grid_w / m);
    let side = (cfg.window_size / cfg.patch_size / cfg.spatial_merge_size) as usize;
    let mut index = Vec::with_capacity(lh * lw);
    let mut inverse = vec![0i32; lh * lw];
    let mut spans = Vec::new();
    for wy in (0..lh).step_by(side) {
        for wx in (0..lw).step_by(side) {
            let start = index.len();
            for y in wy..(wy + side).min(lh) {
                for x in wx..(wx + side).min(lw) {
                    inverse[y * lw + x] = index.len() as i32;
                    index.push((y * lw + x) as i32);
                }
            }
            spans.push((start * m * m, index.len() * m * m));
        }
    }
    let n = grid_h * grid_w;
    let mut mask = vec![f32::NEG_INFINITY; n * n];
    for &(a, b) in &spans {
        for q in a..b {
            mask[q * n + a..q * n + b].fill(0.0);
        }
    }
    Windows { index, inverse, mask }
}

/// Row and column of every patch in window order (the 2-D RoPE's positions).
pub fn patch_ids(cfg: &VisionConfig, grid_h: usize, grid_w: usize, inverse: &[i32]) -> rope::Ids {
    let m = cfg.spatial_merge_size as usize;
    let mut rows = vec![[0.0f32; 2]; grid_h * grid_w];
    let mut natural = 0;
    for bh in (0..grid_h).step_by(m) {
        for bw in (0..grid_w).step_by(m) {
            for iy in 0..m {
                for ix in 0..m {
                    let at = inverse[natural / (m * m)] as usize * m * m + natural % (m * m);
                    rows[at] = [(bh + iy) as f32, (bw + ix) as f32];
                    natural += 1;
                }
            }
        }
    }
    rope::Ids { n_axes: 2, data: rows.concat() }
}

/// Qwen3-VL's position embeddings of a `grid_h`×`grid_w` patch grid, in [`patchify`]'s
/// order: for each patch the four rows of the learned position grid around its place
/// (scaled onto that grid: top-left, top-right, bottom-left, bottom-right) and their bilinear
/// weights.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionLookup {
    pub rows: [Vec<i32>; 4],
    pub weights: [Vec<f32>; 4],
}

pub fn position_lookup(cfg: &VisionConfig, grid_h: usize, grid_w: usize) -> PositionLookup {
    let side = cfg.position_grid_side();
    let m = cfg.spatial_merge_size as usize;
    let last = side.saturating_sub(1) as f64;
    let at = |i: usize, n: usize| if n == 1 { 0.0 } else { last * i as f64 / (n - 1) as f64 };
    let mut out = PositionLookup { rows: Default::default(), weights: Default::default() };
    for bh in 0..grid_h / m {
        for bw in 0..grid_w / m {
            for ih in 0..m {
                let hp = at(bh * m + ih, grid_h);
                let (h0, dh) = (hp.floor() as usize, hp - hp.floor());
                let h1 = (h0 + 1).min(side - 1);
                for iw in 0..m {
                    let wp = at(bw * m + iw, grid_w);
                    let (w0, dw) = (wp.floor() as usize, wp - wp.floor());
                    let w1 = (w0 + 1).min(side - 1);
                    let corners = [(h0, w0), (h0, w1), (h1, w0), (h1, w1)];
                    let weights = [(1.0 - dh) * (1.0 - dw), (1.0 - dh) * dw, dh * (1.0 - dw), dh * dw];
                    for k in 0..4 {
                        out.rows[k].push((corners[k].0 * side + corners[k].1) as i32);
                        out.weights[k].push(weights[k] as f32);
                    }
                }
            }
        }
    }
    out
}

/// Embeddings `[out_hidden, tokens]` of a preprocessed image `[W, H, 3, 1]` (sides
/// multiples of [`VisionConfig::factor`]): one token per 2×2 group of patches, row by row.
pub fn encode_image(runner: &mut Runner, model: &QwenVisionModel, image: &Tensor) -> Result<Tensor> {
    let mut outputs = encode_outputs(runner, model, &[image])?;
    Ok(outputs.swap_remove(0))
}

/// [`encode_image`] of a block of frames ([`patchify_frames`]), with the deepstack mergers'
/// outputs after the embeddings (each `[out_hidden, tokens]`).
pub fn encode_outputs(runner: &mut Runner, model: &QwenVisionModel, frames: &[&Tensor]) -> Result<Vec<Tensor>> {
    let cfg = &model.cfg;
    let p = cfg.patch_size as usize;
    let image: &Tensor = frames.first().ok_or_else(|| crate::error::Error::new("no frames for the vision tower"))?;
    let (grid_w, grid_h) = (image.ne(0) / p, image.ne(1) / p);
    let pixels = patchify_frames(cfg, frames)?;
    let n = grid_h * grid_w;
    let tokens = n / (cfg.spatial_merge_size * cfg.spatial_merge_size) as usize;
    let hd = cfg.head_dim() as usize;
    let out = match cfg.arch {
        VisionArch::Qwen25Vl => {
            let win = windows(cfg, grid_h, grid_w);
            let pe = rope::embed_nd(&patch_ids(cfg, grid_h, grid_w, &win.inverse), 10000.0, &[hd / 2, hd / 2], None);
            runner.compute(|g| {
                let x = g.input_f32(pixels.data(), &[pixels.ne(0) as i64, n as i64]);
                let pe = g.input_f32(&pe, &[2, 2, hd as i64 / 2, n as i64]);
                let index = g.input_i32(&win.index, &[tokens as i64]);
                let inverse = g.input_i32(&win.inverse, &[tokens as i64]);
                let mask = g.input_f32(&win.mask, &[n as i64, n as i64]);
                Ok(joined(model.forward(g, x, pe, Layout::Windows([index, inverse, mask]))))
            })?
        }
        VisionArch::Qwen3Vl => {
            let natural: Vec<i32> = (0..tokens as i32).collect();
            let pe = rope::embed_nd(&patch_ids(cfg, grid_h, grid_w, &natural), 10000.0, &[hd / 2, hd / 2], None);
            let lookup = position_lookup(cfg, grid_h, grid_w);
            runner.compute(|g| {
                let x = g.input_f32(pixels.data(), &[pixels.ne(0) as i64, n as i64]);
                let pe = g.input_f32(&pe, &[2, 2, hd as i64 / 2, n as i64]);
                let rows = [0, 1, 2, 3].map(|k| g.input_i32(&lookup.rows[k], &[n as i64]));
                let weights = [0, 1, 2, 3].map(|k| g.input_f32(&lookup.weights[k], &[1, n as i64]));
                Ok(joined(model.forward(g, x, pe, Layout::Positions(rows, weights))))
            })?
        }
    };
    // The outputs were joined along the features: split them again.
    let width = cfg.out_hidden_size as usize;
    let count = out.ne(0) / width;
    let data = out.data();
    (0..count)
        .map(|k| {
            let rows: Vec<f32> = data.chunks_exact(width * count).flat_map(|r| &r[k * width..(k + 1) * width]).copied().collect();
            Tensor::from_vec(&[width, tokens], rows)
        })
        .collect()
}

/// The tower's outputs side by side along the features (one graph output).
fn joined<'g>(outputs: Vec<T<'g>>) -> T<'g> {
    let first = outputs[0];
    outputs[1..].iter().fold(first, |acc, &o| acc.concat(o, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> VisionConfig {
        VisionConfig { hidden_size: 64, num_layers: 2, split_patch_embed: true, ..VisionConfig::default() }
    }

    /// The config `detect` reads under `prefix` from f16 tensors `(name, ggml shape)` named
    /// under [`VISION_PREFIX`].
    fn detect_from(tensors: &[(&str, &[i64])], prefix: &str) -> Option<VisionConfig> {
        let mut types = TypeMap::new();
        let mut shapes = std::collections::HashMap::new();
        for (n, s) in tensors {
            types.insert(format!("{VISION_PREFIX}{n}"), F16);
            shapes.insert(format!("{VISION_PREFIX}{n}"), s.to_vec());
        }
        VisionConfig::detect(&types, &|n| shapes.get(n).cloned(), prefix)
    }

    #[test]
    fn config_from_mmproj_like_names() {
        let tensors: [(&str, &[i64]); 5] = [
            ("patch_embed.proj.0.weight", &[14, 14, 3, 128]),
            ("patch_embed.proj.1.weight", &[14, 14, 3, 128]),
            ("blocks.0.mlp.gate_proj.weight", &[128, 256]),
            ("blocks.7.attn.q_proj.weight", &[128, 128]),
            ("merger.mlp.2.weight", &[512, 3584]),
        ];
        let cfg = detect_from(&tensors, VISION_PREFIX).unwrap();
        assert_eq!(cfg.arch, VisionArch::Qwen25Vl);
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size), (8, 128, 256, 3584));
        assert!(cfg.split_patch_embed && cfg.separate_qkv);
        assert_eq!((cfg.num_heads, cfg.factor(), cfg.head_dim()), (16, 28, 8));
        assert!(detect_from(&tensors, "other.").is_none());
    }

    /// Qwen3-VL's HF names: the kind, the width from the patch bias and the position table.
    #[test]
    fn config_from_qwen3_vl_names() {
        let tensors: [(&str, &[i64]); 6] = [
            ("patch_embed.proj.weight", &[16, 16, 2, 3 * 1152]),
            ("patch_embed.proj.bias", &[1152]),
            ("pos_embed.weight", &[1152, 2304]),
            ("blocks.26.mlp.linear_fc1.weight", &[1152, 4304]),
            ("blocks.0.mlp.linear_fc1.weight", &[1152, 4304]),
            ("merger.linear_fc2.weight", &[4608, 4096]),
        ];
        let cfg = detect_from(&tensors, VISION_PREFIX).unwrap();
        assert_eq!(cfg.arch, VisionArch::Qwen3Vl);
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size, cfg.patch_size), (27, 1152, 4304, 4096, 16));
        assert_eq!((cfg.num_position_embeddings, cfg.position_grid_side()), (2304, 48));
        assert!(!cfg.split_patch_embed && !cfg.separate_qkv);
        cfg.validate().unwrap();
        // 27 blocks: deepstack mergers after blocks 8, 16 and 24; 24 blocks: 5, 11, 17.
        assert_eq!(cfg.deepstack, [8, 16, 24]);
        let no_table = VisionConfig { num_position_embeddings: 0, ..cfg };
        assert!(no_table.validate().is_err());
        let mut t = tensors;
        t[3].0 = "blocks.23.mlp.linear_fc1.weight";
        assert_eq!(detect_from(&t, VISION_PREFIX).unwrap().deepstack, [5, 11, 17]);
        t[3].0 = "blocks.1.mlp.linear_fc1.weight";
        assert!(detect_from(&t, VISION_PREFIX).unwrap().deepstack.is_empty());
    }

    /// A video block's two frames fill the temporal patch's two slots (a picture fills both).
    #[test]
    fn video_blocks_patch_two_frames() {
        let (w, h) = (28usize, 28usize);
        let frame = |k: f32| Tensor::from_vec(&[w, h, 3, 1], (0..3 * w * h).map(|i| i as f32 + k).collect()).unwrap();
        let (a, b) = (frame(0.0), frame(0.5));
        let cfg = tiny();
        let pair = patchify_frames(&cfg, &[&a, &b]).unwrap();
        let one = patchify(&cfg, &a).unwrap();
        assert_eq!(pair.shape(), one.shape());
        // Channel 0: slot 0 from the first frame, slot 1 (196 values on) from the second.
        assert_eq!((pair.data()[0], pair.data()[196]), (0.0, 0.5));
        assert_eq!((one.data()[0], one.data()[196]), (0.0, 0.0));
        assert!(patchify_frames(&cfg, &[&a, &frame(0.0).reshape(&[w * h, 3, 1, 1]).unwrap()]).is_err());
    }

    /// The position grid is stretched over the patch grid: corners map to corners, and each
    /// patch's four weights sum to one (patches in merge-group order).
    #[test]
    fn positions_interpolate_the_learned_grid() {
        let cfg = VisionConfig { arch: VisionArch::Qwen3Vl, num_position_embeddings: 16, ..tiny() };
        let lookup = position_lookup(&cfg, 4, 6);
        assert_eq!(lookup.rows[0].len(), 24);
        // Patch 0 is (0, 0): row 0 with weight 1.
        assert_eq!((lookup.rows[0][0], lookup.weights[0][0]), (0, 1.0));
        // Patch 1 is (0, 1): column 3/5 of the way to 1 → between columns 0 and 1.
        assert_eq!((lookup.rows[0][1], lookup.rows[1][1]), (0, 1));
        assert!((lookup.weights[1][1] - 0.6).abs() < 1e-6);
        // The last patch is (3, 5): the grid's last row and column.
        assert_eq!(lookup.rows[0][23], 15);
        for i in 0..24 {
            let sum: f32 = (0..4).map(|k| lookup.weights[k][i]).sum();
            assert!((sum - 1.0).abs() < 1e-6);
        }
    }

    #[test]
    fn patches_come_in_merge_groups() {
        // 56×28 image, one channel plane per value: x + 100·y + 10000·c.
        let (w, h) = (56usize, 28usize);
        let data: Vec<f32> = (0..3).flat_map(|c| (0..h).flat_map(move |y| (0..w).map(move |x| (x + 100 * y + 10000 * c) as f32))).collect();
        let img = Tensor::from_vec(&[w, h, 3, 1], data).unwrap();
        let cfg = tiny();
        let p = patchify(&cfg, &img).unwrap();
        assert_eq!(p.shape(), &[3 * 2 * 14 * 14, 8]);
        let row = |t: usize| &p.data()[t * 1176..(t + 1) * 1176];
        // Token 1 is the top-right patch of the first 2×2 group; token 2 its bottom-left.
        assert_eq!(row(1)[0], 14.0);
        assert_eq!(row(2)[0], 1400.0);
        // Token 4 starts the second group (patch column 2); channel 1 follows both frames of channel 0.
        assert_eq!(row(4)[0], 28.0);
        assert_eq!(row(0)[196], 0.0);
        assert_eq!(row(0)[15], 101.0);
        assert_eq!(row(0)[392], 10000.0);
    }

    #[test]
    fn windows_group_merged_tokens() {
        // 12×10 patches: 6×5 merged tokens, windows of 4×4 tokens → 2×2 windows.
        let cfg = tiny();
        let win = windows(&cfg, 10, 12);
        assert_eq!(win.index.len(), 30);
        assert_eq!(&win.index[..5], &[0, 1, 2, 3, 6]);
        assert_eq!(win.index[16], 4);
        for (pos, &natural) in win.index.iter().enumerate() {
            assert_eq!(win.inverse[natural as usize], pos as i32);
        }
        let n = 120;
        // The first window has 16 tokens, 64 patches.
        assert_eq!(win.mask[63], 0.0);
        assert_eq!(win.mask[64], f32::NEG_INFINITY);
        assert_eq!(win.mask[64 * n + 64], 0.0);
        assert_eq!(win.mask[64 * n + 63], f32::NEG_INFINITY);
        // Patch ids follow the windows: the 5th merged token in window order is natural 6 (row 1).
        let ids = patch_ids(&cfg, 10, 12, &win.inverse);
        assert_eq!(&ids.data[16 * 2..16 * 2 + 8], &[2.0, 0.0, 2.0, 1.0, 3.0, 0.0, 3.0, 1.0]);
    }

    /// Deterministic values in [-0.5, 0.5) from a name and an index.
    fn value(name: &str, i: usize) -> f32 {
        let mut h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        h = (h ^ i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((h >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// A tower of `cfg` whose weights are the split / fused layout's `value`s, laid out in
    /// `cfg`'s own layout (the 3-D kernel is both frames' kernels, q/k/v the fused rows).
    fn tower(cfg: &VisionConfig) -> crate::graph::Loaded<QwenVisionModel> {
        use crate::graph::{Backend, Placement, ParamStore, Runner};
        use std::sync::Arc;
        let types = TypeMap::new();
        let mut store = ParamStore::new(256).unwrap();
        let model = QwenVisionModel::new(&mut Scope::new(&mut store, &types, VISION_PREFIX), cfg);
        let backend = Arc::new(Backend::cpu().unwrap());
        store.alloc(&backend).unwrap();
        let h = cfg.hidden_size as usize;
        store
            .load(|name, spec, dst| {
                let n: usize = spec.ne.iter().product::<i64>() as usize;
                let rest = &name[VISION_PREFIX.len()..];
                let p2 = (cfg.patch_size * cfg.patch_size) as usize;
                let (pt, ic) = (cfg.temporal_patch_size as usize, cfg.in_channels as usize);
                // The split / fused layout's value behind element i of this tensor.
                let source = |i: usize| -> (String, usize) {
                    if rest == "patch_embed.bias" {
                        return ("patch_embed.proj.bias".to_string(), i);
                    }
                    if rest == "patch_embed.proj.weight" {
                        // [pw, ph, pt, IC·OC] → frame t's [pw, ph, IC, OC].
                        let (xy, t, c, o) = (i % p2, (i / p2) % pt, (i / (p2 * pt)) % ic, i / (p2 * pt * ic));
                        return (format!("patch_embed.proj.{t}.weight"), xy + p2 * c + p2 * ic * o);
                    }
                    for (k, which) in [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)] {
                        if let Some((stem, leaf)) = rest.split_once(&format!(".{k}.")) {
                            return (format!("{stem}.qkv.{leaf}"), i + which * n);
                        }
                    }
                    (rest.to_string(), i)
                };
                let norm = rest.contains("norm") || rest.contains("ln_q");
                let v: Vec<f32> = (0..n)
                    .map(|i| {
                        let (name, at) = source(i);
                        if norm {
                            1.0 + 0.1 * value(&name, at)
                        } else {
                            value(&name, at) / (h as f32).sqrt()
                        }
                    })
                    .collect();
                if spec.ty == F16 {
                    let bits: Vec<u8> = v.iter().flat_map(|&x| crate::graph::gemm::scalar::f32_to_f16(x).to_le_bytes()).collect();
                    dst.copy_from_slice(&bits);
                } else {
                    dst.copy_from_slice(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                }
                Ok(())
            })
            .unwrap();
        let place = Placement::on(crate::graph::Module::Te, backend.clone());
        crate::graph::Loaded::new(model, store, place, Runner::new(backend, 1), None, "llm vision")
    }

    /// The 3-D patch convolution is the split one's two frames, and separate q/k/v are the
    /// fused projection's rows: the same tower in each layout embeds an image alike.
    #[test]
    fn layouts_agree() {
        let base = VisionConfig { hidden_size: 64, intermediate_size: 32, num_layers: 2, out_hidden_size: 16, fullatt_blocks: vec![1], ..VisionConfig::default() };
        let split = VisionConfig { split_patch_embed: true, ..base.clone() };
        let other = VisionConfig { separate_qkv: true, ..base.clone() };
        assert_same_embeddings(&split, &other);
    }

    /// Towers of `a` and `b` (16 wide outputs) embed a 112×56 image alike.
    fn assert_same_embeddings(a: &VisionConfig, b: &VisionConfig) {
        let image: Vec<f32> = (0..112 * 56 * 3).map(|i| value("image", i) * 2.0).collect();
        let image = Tensor::from_vec(&[112, 56, 3, 1], image).unwrap();
        let mut a = tower(a);
        let mut b = tower(b);
        let (ma, ra) = a.parts();
        let ea = encode_image(ra, ma, &image).unwrap();
        let (mb, rb) = b.parts();
        let eb = encode_image(rb, mb, &image).unwrap();
        assert_eq!(ea.shape(), &[16, 8]);
        let scale = ea.data().iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = ea.data().iter().zip(eb.data()).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(scale > 0.1 && worst < 2e-3 * scale, "layouts differ by {worst} (scale {scale})");
    }

    /// Qwen3-VL's tower alike: the split convolutions plus `patch_embed.bias` are the 3-D
    /// one with its bias (and the position grid is read through the same lookup).
    #[test]
    fn qwen3_layouts_agree() {
        let base = VisionConfig {
            arch: VisionArch::Qwen3Vl,
            hidden_size: 64,
            intermediate_size: 32,
            num_layers: 2,
            out_hidden_size: 16,
            num_position_embeddings: 16,
            ..VisionConfig::default()
        };
        assert_same_embeddings(&VisionConfig { split_patch_embed: true, ..base.clone() }, &base);
    }

    #[test]
    fn preprocess_scales_crops_and_normalises() {
        let img = Tensor::from_vec(&[2, 1, 3, 1], vec![0.0, 1.0, 0.5, 0.5, 2.0, -1.0]).unwrap();
        let t = preprocess(&img, 4, 4).unwrap();
        assert_eq!(t.shape(), &[4, 4, 3, 1]);
        // Scaled ×4 to 8×4, the middle 4 columns kept: 0, 0, 1, 1.
        let r = |v: f32, c: usize| (v - CLIP_MEAN[c]) / CLIP_STD[c];
        assert_eq!(&t.data()[..4], &[r(0.0, 0), r(0.0, 0), r(1.0, 0), r(1.0, 0)]);
        assert_eq!(t.data()[32], r(1.0, 2));
        assert_eq!(t.data()[35], r(0.0, 2));
    }
}
