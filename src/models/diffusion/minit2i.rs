//! MiniT2I: a pixel-space MMJiT that predicts the clean picture, like the reference's
//! `minit2i.hpp`.
//!
//! - Weights under `model.diffusion_model.model.net.`: `img_embedder.proj1` (a patch
//!   convolution into a narrow bottleneck) and `proj2` (1×1 up to the hidden size),
//!   `txt_embedder` (T5's states in), `txt_preamble_blocks.N` (text-only self-attention),
//!   `double_blocks.N` (separate image / text weights, one joint attention with shared q/k
//!   norms), `final_layer` (RMS norm and linear). `t_embedder` and `pooled_embedder` are
//!   loaded but never used: the network does not read the timestep.
//! - Text tokens whose prompt mask is 0 (padding; every token of the unconditional pass) are
//!   replaced by the learned `mask_token` before the text embedder.
//! - Image tokens get a 2-D sin-cos position table added; the attentions rotate q and k by
//!   RoPE pairing element `i` with `i + d/2`: text tokens by their index, image tokens by
//!   (row, column) over the two halves of the rotated frequencies.
//! - The reference builds its position tables for an `H/p × H/p` grid: non-square pictures
//!   and sides that are not multiples of the patch size abort it, so they are refused here.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{Conv2d, Linear};
use crate::graph::{nn, Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{block_index, unpatchify, RmsNorm};
use crate::models::common::rope::{self, Ids};
use crate::tensor::Tensor;

/// Width of the T5 states the reference's conditioner makes of nothing (no T5 loaded).
pub const EMPTY_TEXT_WIDTH: i64 = 1024;
const EPS: f32 = 1e-6;
const THETA: f32 = 10000.0;

#[derive(Clone, Debug, PartialEq)]
pub struct MiniT2iConfig {
    pub patch_size: i64,
    pub in_channels: i64,
    pub pca_channels: i64,
    pub hidden_size: i64,
    pub txt_input_size: i64,
    pub txt_hidden_size: i64,
    pub cond_vec_size: i64,
    pub depth_double: usize,
    pub txt_preamble_depth: usize,
    pub num_heads: i64,
    pub head_dim: i64,
}

impl MiniT2iConfig {
    /// The configuration under `prefix`, read from the weights in sorted name order like the
    /// reference (which keeps the released 768-wide model's values for what is missing).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> MiniT2iConfig {
        let mut cfg = MiniT2iConfig {
            patch_size: 16,
            in_channels: 3,
            pca_channels: 128,
            hidden_size: 768,
            txt_input_size: 1024,
            txt_hidden_size: 768,
            cond_vec_size: 768,
            depth_double: 0,
            txt_preamble_depth: 0,
            num_heads: 12,
            head_dim: 64,
        };
        let mut names: Vec<&String> = types.keys().filter(|n| n.starts_with(prefix)).collect();
        names.sort();
        for name in names {
            let shape = shape_of(name).unwrap_or_default();
            let dims = shape.len();
            if name.ends_with("img_embedder.proj1.weight") && dims == 4 {
                (cfg.patch_size, cfg.in_channels, cfg.pca_channels) = (shape[0], shape[2], shape[3]);
            } else if name.ends_with("img_embedder.proj2.weight") && dims == 4 {
                (cfg.pca_channels, cfg.hidden_size) = (shape[2], shape[3]);
            } else if name.ends_with("txt_embedder.weight") && dims == 2 {
                (cfg.txt_input_size, cfg.txt_hidden_size) = (shape[0], shape[1]);
            } else if name.ends_with("pooled_embedder.weight") && dims == 2 {
                cfg.cond_vec_size = shape[1];
            } else if name.ends_with("double_blocks.0.img_qkv.weight") && dims == 2 {
                cfg.hidden_size = shape[0];
                (cfg.num_heads, cfg.head_dim) = match cfg.hidden_size {
                    768 => (12, 64),
                    1248 => (24, 52),
                    _ if shape[1] / 3 > 0 => ((shape[1] / 3 / 64).max(1), 64),
                    _ => (cfg.num_heads, cfg.head_dim),
                };
            } else if name.ends_with("final_layer.linear.weight") && dims == 2 {
                let area = cfg.patch_size * cfg.patch_size;
                cfg.hidden_size = shape[0];
                if area > 0 {
                    cfg.in_channels = shape[1] / area;
                }
            }
            if let Some(i) = block_index(name, "double_blocks.") {
                cfg.depth_double = cfg.depth_double.max(i + 1);
            }
            if let Some(i) = block_index(name, "txt_preamble_blocks.") {
                cfg.txt_preamble_depth = cfg.txt_preamble_depth.max(i + 1);
            }
        }
        if cfg.depth_double == 0 {
            cfg.depth_double = if cfg.hidden_size == 1248 { 23 } else { 17 };
        }
        if cfg.txt_preamble_depth == 0 {
            cfg.txt_preamble_depth = 2;
        }
        sd_debug!(
            "minit2i: hidden_size={}, txt_hidden_size={}, heads={}, head_dim={}, double_blocks={}, txt_blocks={}, patch={}, in_channels={}",
            cfg.hidden_size,
            cfg.txt_hidden_size,
            cfg.num_heads,
            cfg.head_dim,
            cfg.depth_double,
            cfg.txt_preamble_depth,
            cfg.patch_size,
            cfg.in_channels
        );
        cfg
    }

    /// The SwiGLU width: `dim · 2.6667` (f32, truncated) rounded up to a multiple of 8.
    fn mlp_hidden(dim: i64) -> i64 {
        let h = (dim as f32 * 2.6667f32) as i64;
        (h + 7) / 8 * 8
    }

    /// What the reference asserts while it builds its tables.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.patch_size > 0, "MiniT2I: patch size {}", self.patch_size);
        ensure!(self.in_channels == 3, "MiniT2I works on RGB pixels, its patch embedder takes {} channels", self.in_channels);
        ensure!(self.hidden_size % 4 == 0, "MiniT2I: its 2-D position table needs a hidden size that is a multiple of 4, not {}", self.hidden_size);
        ensure!(self.head_dim % 4 == 0, "MiniT2I: its 2-D RoPE needs heads whose width is a multiple of 4, not {}", self.head_dim);
        Ok(())
    }
}

/// `w2(silu(w1 x) · w3 x)`.
#[derive(Clone, Copy, Debug)]
struct SwiGlu {
    w1: Linear,
    w3: Linear,
    w2: Linear,
}

impl SwiGlu {
    fn new(s: &mut Scope, name: &str, dim: i64) -> SwiGlu {
        let mut s = s.sub(name);
        let hidden = MiniT2iConfig::mlp_hidden(dim);
        SwiGlu { w1: Linear::new(&mut s, "w1", dim, hidden, false), w3: Linear::new(&mut s, "w3", dim, hidden, false), w2: Linear::new(&mut s, "w2", hidden, dim, false) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gate = self.w1.forward(g, x).silu();
        self.w2.forward(g, gate.mul(self.w3.forward(g, x)))
    }
}

/// q, k, v of a fused projection `[3 · heads · d, L, N]`, each `[d, heads, L, N]`.
fn split_qkv<'g>(qkv: T<'g>, heads: i64, d: i64) -> [T<'g>; 3] {
    let [_, l, n, _] = qkv.ne();
    let nb = qkv.nb();
    let part = |i: usize| qkv.view(&[d, heads, l, n], &[nb[0] * d as usize, nb[1], nb[2]], nb[0] * (d * heads) as usize * i);
    [part(0), part(1), part(2)]
}

/// Attention of q, k, v `[d, heads, L, N]` with q and k rotated by `pe` (halves paired):
/// `[heads · d, L, N]`.
fn attention<'g>(g: &'g Graph, q: T<'g>, k: T<'g>, v: T<'g>, pe: T<'g>) -> T<'g> {
    let heads = q.ne()[1];
    let q = rope::apply_rope_halves(g, q, pe);
    let k = rope::apply_rope_halves(g, k, pe);
    nn::attention(g, q, k, v, heads, None, true, g.options.flash_attn, 1.0)
}

/// Tokens `[from, from + len)` of `x` `[C, L, N]`.
fn tokens<'g>(x: T<'g>, from: i64, len: i64) -> T<'g> {
    let [c, _, n, _] = x.ne();
    let nb = x.nb();
    x.view(&[c, len, n], &[nb[1], nb[2]], nb[1] * from as usize).cont()
}

#[derive(Clone, Copy, Debug)]
struct TextBlock {
    norm1: RmsNorm,
    norm2: RmsNorm,
    qkv: Linear,
    attn_proj: Linear,
    mlp: SwiGlu,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i64,
    head_dim: i64,
}

impl TextBlock {
    fn new(s: &mut Scope, cfg: &MiniT2iConfig) -> TextBlock {
        let (h, d) = (cfg.txt_hidden_size, cfg.head_dim);
        let inner = cfg.num_heads * d;
        TextBlock {
            norm1: RmsNorm::new(s, "norm1", "weight", h, EPS, true),
            norm2: RmsNorm::new(s, "norm2", "weight", h, EPS, true),
            qkv: Linear::new(s, "qkv", h, 3 * inner, true),
            attn_proj: Linear::new(s, "attn_proj", inner, h, true),
            mlp: SwiGlu::new(s, "mlp", h),
            q_norm: RmsNorm::new(s, "q_norm", "weight", d, EPS, true),
            k_norm: RmsNorm::new(s, "k_norm", "weight", d, EPS, true),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    fn forward<'g>(&self, g: &'g Graph, txt: T<'g>, pe: T<'g>) -> T<'g> {
        let [q, k, v] = split_qkv(self.qkv.forward(g, self.norm1.forward(g, txt)), self.heads, self.head_dim);
        let out = attention(g, self.q_norm.forward(g, q), self.k_norm.forward(g, k), v, pe);
        let txt = txt.add(self.attn_proj.forward(g, out));
        txt.add(self.mlp.forward(g, self.norm2.forward(g, txt)))
    }
}

/// One stream's weights of a double block.
#[derive(Clone, Copy, Debug)]
struct Stream {
    norm1: RmsNorm,
    norm2: RmsNorm,
    qkv: Linear,
    attn_proj: Linear,
    mlp: SwiGlu,
}

impl Stream {
    fn new(s: &mut Scope, side: &str, dim: i64, inner: i64) -> Stream {
        Stream {
            norm1: RmsNorm::new(s, &format!("{side}_norm1"), "weight", dim, EPS, true),
            norm2: RmsNorm::new(s, &format!("{side}_norm2"), "weight", dim, EPS, true),
            qkv: Linear::new(s, &format!("{side}_qkv"), dim, 3 * inner, true),
            attn_proj: Linear::new(s, &format!("{side}_attn_proj"), inner, dim, true),
            mlp: SwiGlu::new(s, &format!("{side}_mlp"), dim),
        }
    }

    /// The attention output added, then the MLP.
    fn finish<'g>(&self, g: &'g Graph, x: T<'g>, attn: T<'g>) -> T<'g> {
        let x = x.add(self.attn_proj.forward(g, attn));
        x.add(self.mlp.forward(g, self.norm2.forward(g, x)))
    }
}

#[derive(Clone, Copy, Debug)]
struct DoubleBlock {
    img: Stream,
    txt: Stream,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i64,
    head_dim: i64,
}

impl DoubleBlock {
    fn new(s: &mut Scope, cfg: &MiniT2iConfig) -> DoubleBlock {
        let d = cfg.head_dim;
        let inner = cfg.num_heads * d;
        DoubleBlock {
            img: Stream::new(s, "img", cfg.hidden_size, inner),
            txt: Stream::new(s, "txt", cfg.txt_hidden_size, inner),
            q_norm: RmsNorm::new(s, "q_norm", "weight", d, EPS, true),
            k_norm: RmsNorm::new(s, "k_norm", "weight", d, EPS, true),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    /// Text tokens first in the joint attention.
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, txt: T<'g>, pe: T<'g>) -> (T<'g>, T<'g>) {
        let (li, lt) = (img.ne()[1], txt.ne()[1]);
        let [iq, ik, iv] = split_qkv(self.img.qkv.forward(g, self.img.norm1.forward(g, img)), self.heads, self.head_dim);
        let [tq, tk, tv] = split_qkv(self.txt.qkv.forward(g, self.txt.norm1.forward(g, txt)), self.heads, self.head_dim);
        let q = self.q_norm.forward(g, tq).concat(self.q_norm.forward(g, iq), 2);
        let k = self.k_norm.forward(g, tk).concat(self.k_norm.forward(g, ik), 2);
        let v = tv.cont().concat(iv.cont(), 2);
        let out = attention(g, q, k, v, pe);
        let (out_txt, out_img) = (tokens(out, 0, lt), tokens(out, lt, li));
        (self.img.finish(g, img, out_img), self.txt.finish(g, txt, out_txt))
    }
}

/// A MiniT2I transformer whose weights live in a `ParamStore`.
pub struct MiniT2iModel {
    pub config: MiniT2iConfig,
    proj1: Conv2d,
    proj2: Conv2d,
    txt_embedder: Linear,
    mask_token: W,
    preamble: Vec<TextBlock>,
    blocks: Vec<DoubleBlock>,
    norm_final: RmsNorm,
    final_linear: Linear,
}

impl MiniT2iModel {
    pub fn new(s: &mut Scope, cfg: &MiniT2iConfig) -> MiniT2iModel {
        let (h, p) = (cfg.hidden_size, cfg.patch_size);
        let mut emb = s.sub("img_embedder");
        let proj1 = Conv2d::new(&mut emb, "proj1", cfg.in_channels, cfg.pca_channels, (p, p), (p as i32, p as i32), (0, 0), false);
        let proj2 = Conv2d::new(&mut emb, "proj2", cfg.pca_channels, h, (1, 1), (1, 1), (0, 0), true);
        let txt_embedder = Linear::new(s, "txt_embedder", cfg.txt_input_size, cfg.txt_hidden_size, false);
        // Loaded like the reference, never used by its forward pass.
        let mut t = s.sub("t_embedder");
        Linear::with_options(&mut t, "mlp.0", 256, cfg.cond_vec_size, true, true);
        Linear::with_options(&mut t, "mlp.2", cfg.cond_vec_size, cfg.cond_vec_size, true, true);
        Linear::new(s, "pooled_embedder", cfg.txt_input_size, cfg.cond_vec_size, false);
        let mask_token = s.tensor("mask_token", F32, &[cfg.txt_input_size, 1, 1]);
        let preamble = (0..cfg.txt_preamble_depth).map(|i| TextBlock::new(&mut s.sub(&format!("txt_preamble_blocks.{i}")), cfg)).collect();
        let blocks = (0..cfg.depth_double).map(|i| DoubleBlock::new(&mut s.sub(&format!("double_blocks.{i}")), cfg)).collect();
        let mut fin = s.sub("final_layer");
        let norm_final = RmsNorm::new(&mut fin, "norm_final", "weight", h, EPS, true);
        let final_linear = Linear::new(&mut fin, "linear", h, p * p * cfg.in_channels, true);
        MiniT2iModel { config: cfg.clone(), proj1, proj2, txt_embedder, mask_token, preamble, blocks, norm_final, final_linear }
    }

    /// One evaluation: the picture `x` `[W, H, 3, 1]`, the T5 `context` `[txt_in, L, 1]`,
    /// its prompt mask `keep` and `1 - keep` (`[1, L, 1]`), the position table `pos`
    /// `[hidden, tokens, 1]` and the rotation tables of the text and of text + image →
    /// the predicted picture `[W, H, 3, 1]`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: T<'g>, keep: T<'g>, drop: T<'g>, pos: T<'g>, txt_pe: T<'g>, joint_pe: T<'g>) -> T<'g> {
        let (p, h) = (self.config.patch_size, self.config.hidden_size);
        let [w, hh, _, n] = x.ne();
        let (wp, hp) = (w / p, hh / p);
        // Masked text tokens become the mask token (`keep` and `drop` are 0 or 1: exact).
        let mask_token = g.param(self.mask_token).repeat(context);
        let context = context.mul(keep).add(mask_token.mul(drop));
        let img = self.proj2.forward(g, self.proj1.forward(g, x));
        let mut img = img.reshape(&[wp * hp, h, n]).permute(1, 0, 2, 3).cont().add(pos);
        let mut txt = self.txt_embedder.forward(g, context);
        for block in &self.preamble {
            txt = block.forward(g, txt, txt_pe);
        }
        for block in &self.blocks {
            (img, txt) = block.forward(g, img, txt, joint_pe);
        }
        let lt = txt.ne()[1];
        let out = self.final_linear.forward(g, self.norm_final.forward(g, txt.concat(img, 1)));
        unpatchify(tokens(out, lt, wp * hp), hp, wp, p, false)
    }

    /// The reference's position tables only fit square pictures cut into whole patches.
    fn check_inputs(&self, x: &Tensor, context: &Tensor, mask: &Tensor) -> Result<()> {
        let cfg = &self.config;
        let (c, p) = (cfg.in_channels as usize, cfg.patch_size as usize);
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c, "MiniT2I takes one picture [W, H, {c}, 1], got {:?}", x.shape());
        let (w, h) = (x.ne(0), x.ne(1));
        ensure!(
            w == h && w > 0 && w % p == 0,
            "MiniT2I generates square pictures whose sides are multiples of its patch size {p}, not {w}x{h} (the reference's position tables cover H/{p} x H/{p} patches)"
        );
        ensure!(
            context.ne(0) as i64 == cfg.txt_input_size && context.ne(1) > 0 && context.ne(2) == 1,
            "MiniT2I's text context must be [{}, L, 1], got {:?}",
            cfg.txt_input_size,
            context.shape()
        );
        ensure!(mask.len() == context.ne(1), "MiniT2I's prompt mask has {} values for {} text tokens", mask.len(), context.ne(1));
        Ok(())
    }
}

/// The 2-D sin-cos table added to the image tokens of a `side`×`side` grid `[dim, side²]`:
/// per token (row y, column x) `sin(x·ω), cos(x·ω), sin(y·ω), cos(y·ω)`, a quarter each.
fn sincos_pos_embed(side: usize, dim: usize) -> Vec<f32> {
    let quarter = dim / 4;
    let omega: Vec<f32> = (0..quarter).map(|i| 1.0 / 10000f32.powf(i as f32 / quarter as f32)).collect();
    let mut out = Vec::with_capacity(side * side * dim);
    for y in 0..side {
        for x in 0..side {
            let row = |pos: usize| omega.iter().map(move |&o| pos as f32 * o);
            out.extend(row(x).map(f32::sin));
            out.extend(row(x).map(f32::cos));
            out.extend(row(y).map(f32::sin));
            out.extend(row(y).map(f32::cos));
        }
    }
    out
}

/// The image tokens' rotations: per token `head_dim / 2` 2×2 rotations, the first half by
/// the row, the second by the column, each with frequencies `θ^(-2i / (head_dim / 2))`.
fn vision_rope(side: usize, head_dim: usize) -> Vec<f32> {
    let dim = head_dim / 2;
    let quarter = dim / 2;
    let freqs: Vec<f32> = (0..quarter).map(|i| 1.0 / THETA.powf((2 * i) as f32 / dim as f32)).collect();
    let mut out = Vec::with_capacity(side * side * dim * 4);
    for y in 0..side {
        for x in 0..side {
            for pos in [y, x] {
                for &f in &freqs {
                    let a = pos as f32 * f;
                    let (s, c) = (a.sin(), a.cos());
                    out.extend_from_slice(&[c, -s, s, c]);
                }
            }
        }
    }
    out
}

/// A loaded MiniT2I transformer.
pub type MiniT2i = Loaded<MiniT2iModel>;

impl DiffusionModel for Loaded<MiniT2iModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("MiniT2I needs a text context")?;
        let mask = input.cond.vector.as_ref().context("MiniT2I needs its prompt mask")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context, mask)?;
        let cfg = &model.config;
        let (side, lt) = (input.x.ne(1) / cfg.patch_size as usize, context.ne(1));
        let (h, d) = (cfg.hidden_size as usize, cfg.head_dim as usize);
        let pos = sincos_pos_embed(side, h);
        let text_ids = Ids { n_axes: 1, data: (0..lt).map(|i| i as f32).collect() };
        let txt_pe = rope::embed_nd(&text_ids, THETA, &[d], None);
        let mut joint_pe = txt_pe.clone();
        joint_pe.extend(vision_rope(side, d));
        let keep: Vec<f32> = mask.data().to_vec();
        let drop: Vec<f32> = keep.iter().map(|&m| 1.0 - m).collect();
        runner.compute(|g| {
            let x = g.input(input.x);
            let ctx = g.input(context);
            let keep = g.input_f32(&keep, &[1, lt as i64, 1]);
            let drop = g.input_f32(&drop, &[1, lt as i64, 1]);
            let pos = g.input_f32(&pos, &[h as i64, (side * side) as i64, 1]);
            let half = d as i64 / 2;
            let txt_pe = g.input_f32(&txt_pe, &[2, 2, half, lt as i64]);
            let joint_pe = g.input_f32(&joint_pe, &[2, 2, half, (lt + side * side) as i64]);
            Ok(model.forward(g, x, ctx, keep, drop, pos, txt_pe, joint_pe))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ParamStore;
    use std::collections::HashMap;

    #[test]
    fn config_from_weights() {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let pre = "model.diffusion_model.model.net.";
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("{pre}{n}"), F32);
            shapes.insert(format!("{pre}{n}"), s.to_vec());
        };
        add("img_embedder.proj1.weight", &[8, 8, 3, 16]);
        add("img_embedder.proj2.weight", &[1, 1, 16, 128]);
        add("txt_embedder.weight", &[4096, 64]);
        add("pooled_embedder.weight", &[4096, 96]);
        add("double_blocks.0.img_qkv.weight", &[128, 384]);
        add("double_blocks.2.img_qkv.weight", &[128, 384]);
        add("txt_preamble_blocks.0.qkv.weight", &[64, 384]);
        add("final_layer.linear.weight", &[128, 192]);
        let cfg = MiniT2iConfig::detect(&types, &|n| shapes.get(n).cloned(), pre);
        assert_eq!((cfg.patch_size, cfg.in_channels, cfg.pca_channels, cfg.hidden_size), (8, 3, 16, 128));
        assert_eq!((cfg.txt_input_size, cfg.txt_hidden_size, cfg.cond_vec_size), (4096, 64, 96));
        assert_eq!((cfg.num_heads, cfg.head_dim, cfg.depth_double, cfg.txt_preamble_depth), (2, 64, 3, 1));
        cfg.validate().unwrap();
        assert_eq!((MiniT2iConfig::mlp_hidden(64), MiniT2iConfig::mlp_hidden(768)), (176, 2048));
        let mut store = ParamStore::new(4096).unwrap();
        MiniT2iModel::new(&mut Scope::new(&mut store, &types, pre), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in ["mask_token", "double_blocks.2.txt_mlp.w2.weight", "txt_preamble_blocks.0.k_norm.weight", "t_embedder.mlp.2.bias"] {
            assert!(names.contains(&format!("{pre}{n}").as_str()), "{n}");
        }
    }

    #[test]
    fn position_tables() {
        // 2×2 grid, 8 wide: token 3 is row 1, column 1.
        let pos = sincos_pos_embed(2, 8);
        assert_eq!(pos.len(), 4 * 8);
        // Token 1 (row 0, column 1): sin(1), sin(1/100) for x; y's quarters are sin 0 / cos 0.
        assert!((pos[8] - 1f32.sin()).abs() < 1e-7 && (pos[9] - 0.01f32.sin()).abs() < 1e-7 && pos[12] == 0.0 && pos[14] == 1.0);
        let rope = vision_rope(2, 8);
        assert_eq!(rope.len(), 4 * 4 * 4);
        // Token 2 is row 1, column 0: the first (row) rotation turns 1 rad, the column's none.
        let t = &rope[2 * 16..3 * 16];
        assert!((t[0] - 1f32.cos()).abs() < 1e-7 && (t[2] - 1f32.sin()).abs() < 1e-7 && t[8] == 1.0 && t[10] == 0.0);
    }
}
