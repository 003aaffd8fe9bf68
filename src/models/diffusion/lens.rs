//! Lens: a dual-stream DiT over Flux.2's patchified latent, like the reference's `lens.hpp`.
//!
//! - Weights under `model.diffusion_model.`: `time_text_embed.timestep_embedder.linear_{1,2}`,
//!   `img_in` (the 128-channel latent, one token per latent pixel), `txt_norm.{i}` and
//!   `txt_in` (the LLM's hidden states of several layers side by side, each RMS-normed, then
//!   projected), `transformer_blocks.N` and `norm_out.linear` / `proj_out`.
//! - A block modulates both streams with six vectors each from the SiLU of the timestep
//!   embedding (`img_mod.1`, `txt_mod.1`): RMS norms (no affine shift), a joint attention (fused `img_qkv` /
//!   `txt_qkv`, per-head RMS q/k norms, image tokens first) and a SwiGLU MLP (`w1`, `w3`,
//!   `w2`, width hidden / 3 · 8) per stream, each added back through its gate.
//! - RoPE over 3 axes (θ 10000, 8/28/28 dimensions of the 64 per head): image tokens
//!   `[0, row, col]` centred on 0, text tokens counting up on every axis from
//!   `max(h, w) / 2` in steps of `L / (L - 1)` (the reference's `linspace` to `start + L`).
//! - The attention kernel sees K and V scaled by 1/128 (undone after it); the timestep is the
//!   flow's sigma, scaled by 1000 in its embedding; the output is the flow velocity.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{split_qkv, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, T};
use crate::models::common::dit::{block_index, chunk, modulate, timestep_embedding, MlpEmbedder, RmsNorm};
use crate::models::common::rope::{self, Ids};
use crate::tensor::Tensor;

/// Width of the LLM's hidden states (GPT-OSS-20B's), fixed by the reference.
pub const JOINT_ATTENTION_DIM: i64 = 2880;
/// The RoPE's dimensions per axis; their sum is the head width the model must have.
const AXES_DIM: [usize; 3] = [8, 28, 28];
const THETA: f32 = 10000.0;
const PATCH: i64 = 2;

#[derive(Clone, Debug, PartialEq)]
pub struct LensConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    pub head_dim: i64,
    /// LLM layers whose hidden states come side by side (`txt_in` takes that many × 2880).
    pub selected_layers: i64,
}

impl LensConfig {
    /// The configuration under `prefix`, read from the weights like the reference: the heads
    /// are `img_in`'s width over 64 (read before the head width), the head width is the q
    /// norm's, the selected layers `txt_in`'s input over 2880, the output channels
    /// `proj_out`'s over the 2×2 patch.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> LensConfig {
        let mut cfg = LensConfig { in_channels: 128, out_channels: 32, num_layers: 0, num_heads: 24, head_dim: 64, selected_layers: 4 };
        let mut names: Vec<&String> = types.keys().filter(|n| n.starts_with(prefix)).collect();
        names.sort();
        for name in names {
            let shape = shape_of(name).unwrap_or_default();
            if name.ends_with("img_in.weight") && shape.len() == 2 {
                cfg.in_channels = shape[0];
                cfg.num_heads = shape[1] / cfg.head_dim;
            } else if name.ends_with("txt_in.weight") && shape.len() == 2 {
                cfg.selected_layers = shape[0] / JOINT_ATTENTION_DIM;
            } else if name.ends_with("proj_out.weight") && shape.len() == 2 {
                cfg.out_channels = shape[1] / (PATCH * PATCH);
            } else if name.ends_with("transformer_blocks.0.attn.norm_q.weight") && shape.len() == 1 {
                cfg.head_dim = shape[0];
            }
            if let Some(i) = block_index(name, "transformer_blocks.") {
                cfg.num_layers = cfg.num_layers.max(i + 1);
            }
        }
        if cfg.num_layers == 0 {
            cfg.num_layers = 48;
        }
        sd_debug!(
            "lens: num_layers = {}, selected_layer_count = {}, hidden_size = {}, num_attention_heads = {}, attention_head_dim = {}, in_channels = {}, out_channels = {}",
            cfg.num_layers,
            cfg.selected_layers,
            cfg.hidden_size(),
            cfg.num_heads,
            cfg.head_dim,
            cfg.in_channels,
            cfg.out_channels
        );
        cfg
    }

    pub fn hidden_size(&self) -> i64 {
        self.num_heads * self.head_dim
    }

    /// Width of the text context the model takes.
    pub fn context_width(&self) -> i64 {
        self.selected_layers * JOINT_ATTENTION_DIM
    }

    /// What the graphs need that the reference asserts (or fails on) while computing.
    pub fn validate(&self) -> Result<()> {
        let rot: usize = AXES_DIM.iter().sum();
        ensure!(self.num_heads > 0 && self.selected_layers > 0, "Lens: {} heads, {} selected LLM layers", self.num_heads, self.selected_layers);
        ensure!(self.head_dim == rot as i64, "Lens: its RoPE turns {rot} dimensions per head, the heads have {}", self.head_dim);
        ensure!(
            self.out_channels * PATCH * PATCH == self.in_channels,
            "Lens takes {} latent channels and gives {} × {PATCH}×{PATCH}",
            self.in_channels,
            self.out_channels
        );
        Ok(())
    }
}

/// The rotation table of an `h`×`w` latent (one token per latent pixel) and `context_len`
/// text tokens (module documentation); on circular axes the image tokens wrap around.
pub fn lens_pe(h: usize, w: usize, context_len: usize, circular: (bool, bool)) -> Vec<f32> {
    let (hh, ww) = (h as i64, w as i64);
    let mut ids = rope::image_ids(3, h, w, 1, 0.0, -(hh / 2), -(ww / 2));
    let start = (h / 2).max(w / 2) as f32;
    let end = context_len as f32 + start;
    let step = if context_len > 1 { (end - start) / (context_len as f32 - 1.0) } else { 0.0 };
    for i in 0..context_len {
        let v = start + i as f32 * step;
        ids.data.extend([v, v, v]);
    }
    let wrap = (circular.0 || circular.1).then(|| image_wraps(&ids, h, w, circular));
    rope::embed_nd(&ids, THETA, &AXES_DIM, wrap.as_deref())
}

/// Wrap lengths per axis and token: the image's rows on axis 1, columns on axis 2.
fn image_wraps(ids: &Ids, h: usize, w: usize, (circ_x, circ_y): (bool, bool)) -> Vec<Vec<usize>> {
    let mut dims = vec![vec![0usize; ids.len()]; 3];
    if circ_y {
        dims[1][..h * w].fill(h);
    }
    if circ_x {
        dims[2][..h * w].fill(w);
    }
    dims
}

/// Linear, SiLU-gated: `w2(silu(w1 x) · w3 x)`.
#[derive(Clone, Copy, Debug)]
struct GateMlp {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl GateMlp {
    fn new(s: &mut Scope, dim: i64, hidden: i64) -> GateMlp {
        GateMlp { w1: Linear::new(s, "w1", dim, hidden, false), w2: Linear::new(s, "w2", hidden, dim, false), w3: Linear::new(s, "w3", dim, hidden, false) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gate = self.w1.forward(g, x).silu();
        self.w2.forward(g, gate.mul(self.w3.forward(g, x)))
    }
}

#[derive(Clone, Copy, Debug)]
struct JointAttention {
    img_qkv: Linear,
    txt_qkv: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    norm_added_q: RmsNorm,
    norm_added_k: RmsNorm,
    to_out: Linear,
    to_add_out: Linear,
    heads: i64,
    head_dim: i64,
}

impl JointAttention {
    fn new(s: &mut Scope, cfg: &LensConfig) -> JointAttention {
        let (h, d) = (cfg.hidden_size(), cfg.head_dim);
        let norm = |s: &mut Scope, n: &str| RmsNorm::new(s, n, "weight", d, 1e-5, true);
        JointAttention {
            img_qkv: Linear::new(s, "img_qkv", h, 3 * h, true),
            txt_qkv: Linear::new(s, "txt_qkv", h, 3 * h, true),
            norm_q: norm(s, "norm_q"),
            norm_k: norm(s, "norm_k"),
            norm_added_q: norm(s, "norm_added_q"),
            norm_added_k: norm(s, "norm_added_k"),
            to_out: Linear::new(s, "to_out.0", h, h, true),
            to_add_out: Linear::new(s, "to_add_out", h, h, true),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    /// img [hidden, L_img, N], txt [hidden, L_txt, N] → their attention outputs.
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, txt: T<'g>, pe: T<'g>) -> (T<'g>, T<'g>) {
        let (d, heads) = (self.head_dim, self.heads);
        let (n_img, n_txt, n) = (img.ne()[1], txt.ne()[1], img.ne()[2]);
        let heads_of = |t: T<'g>, l: i64| t.reshape(&[d, heads, l, n]);
        let (iq, ik, iv) = split_qkv(self.img_qkv.forward(g, img));
        let (tq, tk, tv) = split_qkv(self.txt_qkv.forward(g, txt));
        let q = self.norm_q.forward(g, heads_of(iq, n_img)).concat(self.norm_added_q.forward(g, heads_of(tq, n_txt)), 2);
        let k = self.norm_k.forward(g, heads_of(ik, n_img)).concat(self.norm_added_k.forward(g, heads_of(tk, n_txt)), 2);
        let v = heads_of(iv, n_img).concat(heads_of(tv, n_txt), 2);
        let attn = rope::attention_scaled(g, q, k, v, pe, None, 1.0 / 128.0);
        let inner = d * heads;
        let nb = attn.nb();
        let img_out = attn.view(&[inner, n_img, n], &[nb[1], nb[2]], 0).cont();
        let txt_out = attn.view(&[inner, n_txt, n], &[nb[1], nb[2]], n_img as usize * nb[1]).cont();
        (self.to_out.forward(g, img_out), self.to_add_out.forward(g, txt_out))
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    img_mod: Linear,
    txt_mod: Linear,
    img_norm1: RmsNorm,
    img_norm2: RmsNorm,
    txt_norm1: RmsNorm,
    txt_norm2: RmsNorm,
    img_mlp: GateMlp,
    txt_mlp: GateMlp,
    attn: JointAttention,
}

impl Block {
    fn new(s: &mut Scope, cfg: &LensConfig) -> Block {
        let h = cfg.hidden_size();
        let ff = h / 3 * 8;
        let norm = |s: &mut Scope, n: &str| RmsNorm::new(s, n, "weight", h, 1e-6, true);
        Block {
            img_mod: Linear::new(&mut s.sub("img_mod"), "1", h, 6 * h, true),
            txt_mod: Linear::new(&mut s.sub("txt_mod"), "1", h, 6 * h, true),
            img_norm1: norm(s, "img_norm1"),
            img_norm2: norm(s, "img_norm2"),
            txt_norm1: norm(s, "txt_norm1"),
            txt_norm2: norm(s, "txt_norm2"),
            img_mlp: GateMlp::new(&mut s.sub("img_mlp"), h, ff),
            txt_mlp: GateMlp::new(&mut s.sub("txt_mlp"), h, ff),
            attn: JointAttention::new(&mut s.sub("attn"), cfg),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, txt: T<'g>, temb: T<'g>, pe: T<'g>) -> (T<'g>, T<'g>) {
        let temb = temb.silu();
        let im = chunk(self.img_mod.forward(g, temb), 6, 0, true);
        let tm = chunk(self.txt_mod.forward(g, temb), 6, 0, true);
        let gate = |t: T<'g>| t.reshape(&[t.ne()[0], 1, t.ne()[1]]);
        let img_in = modulate(self.img_norm1.forward(g, img), im[0], im[1]);
        let txt_in = modulate(self.txt_norm1.forward(g, txt), tm[0], tm[1]);
        let (ia, ta) = self.attn.forward(g, img_in, txt_in, pe);
        let img = img.add(ia.mul(gate(im[2])));
        let txt = txt.add(ta.mul(gate(tm[2])));
        let img_in = modulate(self.img_norm2.forward(g, img), im[3], im[4]);
        let txt_in = modulate(self.txt_norm2.forward(g, txt), tm[3], tm[4]);
        let img = img.add(self.img_mlp.forward(g, img_in).mul(gate(im[5])));
        let txt = txt.add(self.txt_mlp.forward(g, txt_in).mul(gate(tm[5])));
        (img, txt)
    }
}

/// A Lens transformer whose weights live in a `ParamStore`.
pub struct LensModel {
    pub config: LensConfig,
    timestep_embedder: MlpEmbedder,
    img_in: Linear,
    txt_norms: Vec<RmsNorm>,
    txt_in: Linear,
    blocks: Vec<Block>,
    norm_out: Linear,
    proj_out: Linear,
}

impl LensModel {
    pub fn new(s: &mut Scope, cfg: &LensConfig) -> LensModel {
        let h = cfg.hidden_size();
        let timestep_embedder = MlpEmbedder::with_layers(&mut s.sub("time_text_embed"), "timestep_embedder", ["linear_1", "linear_2"], 256, h, h, false);
        LensModel {
            config: cfg.clone(),
            timestep_embedder,
            img_in: Linear::new(s, "img_in", cfg.in_channels, h, true),
            txt_norms: (0..cfg.selected_layers).map(|i| RmsNorm::new(s, &format!("txt_norm.{i}"), "weight", JOINT_ATTENTION_DIM, 1e-5, true)).collect(),
            txt_in: Linear::new(s, "txt_in", cfg.context_width(), h, true),
            blocks: (0..cfg.num_layers).map(|i| Block::new(&mut s.sub(&format!("transformer_blocks.{i}")), cfg)).collect(),
            norm_out: Linear::new(&mut s.sub("norm_out"), "linear", h, 2 * h, true),
            proj_out: Linear::new(s, "proj_out", h, PATCH * PATCH * cfg.out_channels, true),
        }
    }

    /// One evaluation: the latent `x` `[W, H, C, 1]`, the timestep `t` `[1]` (sigma), the
    /// text `context` `[selected · 2880, L, 1]` and the table of [`lens_pe`] → `[W, H, C, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, pe: T<'g>) -> T<'g> {
        let [w, hh, c, n] = x.ne();
        let temb = self.timestep_embedder.forward(g, timestep_embedding(t, 256, 10000, 1000.0));
        let img = self.img_in.forward(g, x.reshape(&[w * hh, c, n]).permute(1, 0, 2, 3).cont());
        let chunks = chunk(context, self.config.selected_layers, 0, true);
        let mut txt = self.txt_norms[0].forward(g, chunks[0]);
        for (norm, part) in self.txt_norms.iter().zip(&chunks).skip(1) {
            txt = txt.concat(norm.forward(g, *part), 0);
        }
        let mut txt = self.txt_in.forward(g, txt);
        let mut img = img;
        for block in &self.blocks {
            (img, txt) = block.forward(g, img, txt, temb, pe);
        }
        let mods = chunk(self.norm_out.forward(g, temb.silu()), 2, 0, true);
        let img = modulate(img.norm(1e-6), mods[1], mods[0]);
        let out = self.proj_out.forward(g, img);
        out.permute(1, 0, 2, 3).cont().reshape(&[w, hh, out.ne()[0], n])
    }

    fn check_inputs(&self, x: &Tensor, context: &Tensor) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.in_channels as usize;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Lens takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        ensure!(
            context.ne(0) as i64 == cfg.context_width() && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "Lens's text context must be [{}, L, 1] ({} LLM layers of {JOINT_ATTENTION_DIM}), got {:?}",
            cfg.context_width(),
            cfg.selected_layers,
            context.shape()
        );
        Ok(())
    }
}

impl DiffusionModel for Loaded<LensModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("Lens needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context)?;
        ensure!(input.timesteps.len() == 1, "Lens takes one timestep, got {}", input.timesteps.len());
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        let circular = (runner.options.circular_x, runner.options.circular_y);
        let pe = lens_pe(h, w, context.ne(1), circular);
        let rot: usize = AXES_DIM.iter().sum();
        let pos_len = pe.len() / rot / 2;
        let t = [input.timesteps[0]];
        runner.compute(|g| {
            let x = g.input(input.x);
            let t = g.input_f32(&t, &[1]);
            let ctx = g.input(context);
            let pe = g.input_f32(&pe, &[2, 2, rot as i64 / 2, pos_len as i64]);
            Ok(model.forward(g, x, t, ctx, pe))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ParamStore, F32};
    use std::collections::HashMap;

    #[test]
    fn config_from_weights() {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("model.diffusion_model.{n}"), F32);
            shapes.insert(format!("model.diffusion_model.{n}"), s.to_vec());
        };
        add("img_in.weight", &[128, 128]);
        add("txt_in.weight", &[4 * 2880, 128]);
        add("proj_out.weight", &[128, 128]);
        add("transformer_blocks.0.attn.norm_q.weight", &[64]);
        add("transformer_blocks.1.attn.norm_q.weight", &[64]);
        let cfg = LensConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert_eq!((cfg.num_heads, cfg.head_dim, cfg.num_layers, cfg.selected_layers, cfg.in_channels, cfg.out_channels), (2, 64, 2, 4, 128, 32));
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        LensModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in ["txt_norm.3.weight", "transformer_blocks.1.img_mlp.w3.weight", "transformer_blocks.0.attn.norm_added_k.weight", "norm_out.linear.bias"] {
            assert!(names.contains(&format!("model.diffusion_model.{n}").as_str()), "{n}");
        }
        let mut wide = cfg.clone();
        wide.head_dim = 128;
        assert!(wide.validate().unwrap_err().to_string().contains("turns 64"));
    }

    /// Text ids count up from max(h, w) / 2 in steps of L / (L - 1), image ids are centred.
    #[test]
    fn rotation_ids() {
        let pe = lens_pe(4, 6, 3, (false, false));
        assert_eq!(pe.len(), (24 + 3) * 64 * 2);
        // Token 0 (row -2, column -3): axis 1's first frequency turns -2 rad.
        let at = |tok: usize, i: usize| pe[tok * 128 + i];
        assert!((at(0, 4 * 4) - (-2f32).cos()).abs() < 1e-6);
        // The last text token sits at 3 + 2 · 1.5 = 6 on every axis.
        assert!((at(26, 0) - 6f32.cos()).abs() < 1e-6);
    }
}

