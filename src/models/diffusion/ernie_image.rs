//! ERNIE-Image: Baidu's single-stream DiT, like the reference's `ernie_image.hpp`.
//!
//! - Weights under `model.diffusion_model.`: `x_embedder.proj` (a convolution over patches of
//!   the 128-channel Flux.2 latent), `text_proj` (only when the LLM's width differs from the
//!   hidden size), `time_embedding.linear_{1,2}`, one shared `adaLN_modulation.1` for every
//!   layer, `layers.N` (RMS-normed attention with per-head q/k norms and a GELU-gated MLP)
//!   and `final_norm` / `final_linear`.
//! - Image tokens come first, then the text tokens; both attend jointly with 3-axis RoPE
//!   (θ 256, axes 32/48/48): image ids `[text_len, row, col]`, text ids `[i, 0, 0]`.
//! - Its rotation pairs element `i` with `i + d/2` while taking the frequency of the table's
//!   position `i` (each frequency fills two neighbouring positions), so it is applied as the
//!   reference does, with a cos / sin table ([`rope::ernie_pe`]) and elementwise products,
//!   not as pairs of 2×2 rotations.
//! - The timestep embedding is sin-first; the output is the flow velocity as is.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{Conv2d, LayerNorm, Linear};
use crate::graph::{nn, Graph, Loaded, Scope, TypeMap, T};
use crate::models::common::dit::{chunk, modulate, timestep_embedding, unpatchify, MlpEmbedder, RmsNorm};
use crate::models::common::rope;
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub struct ErnieImageConfig {
    pub hidden_size: i64,
    pub num_heads: i64,
    pub num_layers: usize,
    pub ffn_hidden_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub patch_size: i64,
    /// Width of the text the model takes (the LLM's hidden states).
    pub text_in_dim: i64,
    pub theta: f32,
    pub axes_dim: Vec<usize>,
    pub eps: f32,
}

impl ErnieImageConfig {
    /// The configuration under `prefix`, read from the weights like the reference (what is
    /// missing keeps the released model's value: 36 layers of 4096, 32 heads).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> ErnieImageConfig {
        let mut cfg = ErnieImageConfig {
            hidden_size: 4096,
            num_heads: 32,
            num_layers: 36,
            ffn_hidden_size: 12288,
            in_channels: 128,
            out_channels: 128,
            patch_size: 1,
            text_in_dim: 3072,
            theta: 256.0,
            axes_dim: vec![32, 48, 48],
            eps: 1e-6,
        };
        let (mut layers, mut head_dim, mut out_dim) = (0usize, 0i64, None);
        // Names in sorted order, as the reference sees them (the patch size the output
        // width is divided by is the one known when `final_linear` is read).
        let mut names: Vec<&String> = types.keys().filter(|n| n.starts_with(prefix)).collect();
        names.sort();
        for name in names {
            let shape = shape_of(name).unwrap_or_default();
            if name.ends_with("x_embedder.proj.weight") && shape.len() == 4 {
                cfg.patch_size = shape[0];
                cfg.in_channels = shape[2];
                cfg.hidden_size = shape[3];
            } else if name.ends_with("text_proj.weight") && shape.len() == 2 {
                cfg.text_in_dim = shape[0];
            } else if name.ends_with("layers.0.self_attention.norm_q.weight") && !shape.is_empty() {
                head_dim = shape[0];
            } else if name.ends_with("layers.0.mlp.gate_proj.weight") && shape.len() == 2 {
                cfg.ffn_hidden_size = shape[1];
            } else if name.ends_with("final_linear.weight") && shape.len() == 2 {
                out_dim = Some((shape[1], cfg.patch_size));
            }
            if let Some(i) = layer_index(name) {
                layers = layers.max(i + 1);
            }
        }
        if let Some((d, p)) = out_dim {
            cfg.out_channels = d / (p * p).max(1);
        }
        if layers > 0 {
            cfg.num_layers = layers;
        }
        if head_dim > 0 {
            cfg.num_heads = cfg.hidden_size / head_dim;
        }
        sd_debug!(
            "ernie_image: num_layers = {}, hidden_size = {}, num_heads = {}, ffn_hidden_size = {}, in_channels = {}, out_channels = {}",
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.ffn_hidden_size,
            cfg.in_channels,
            cfg.out_channels
        );
        cfg
    }

    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads.max(1)
    }

    /// What the graphs need that the reference asserts while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.num_layers > 0, "ERNIE-Image: no transformer layers");
        ensure!(
            self.num_heads > 0 && self.hidden_size % self.num_heads == 0,
            "ERNIE-Image: {} heads do not divide the hidden size {}",
            self.num_heads,
            self.hidden_size
        );
        let rot: usize = self.axes_dim.iter().sum();
        ensure!(
            rot as i64 <= self.head_dim(),
            "ERNIE-Image: its RoPE turns {rot} dimensions per head, the heads have {}",
            self.head_dim()
        );
        ensure!(self.patch_size > 0, "ERNIE-Image: patch size {}", self.patch_size);
        Ok(())
    }
}

/// The block index after the first `layers.` of `name`, as the reference counts layers.
fn layer_index(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest.split('.').next()?.parse().ok()
}

/// Rotates `x` `[d_head, heads, L, N]` by the cos / sin table `pe` `[rot, 1, L, 2]` over its
/// first `rot` dimensions (the rest pass through): `x·cos + [-x₂, x₁]·sin` with `x₁`, `x₂`
/// the two halves of the rotated part.
fn rotate<'g>(x: T<'g>, pe: T<'g>) -> T<'g> {
    let [d_head, heads, l, n] = x.ne();
    let rot = pe.ne()[0];
    let x = x.cont();
    let nb = x.nb();
    let part = |from: i64, len: i64| x.view(&[len, heads, l, n], &[nb[1], nb[2], nb[3]], from as usize * nb[0]).cont();
    let x_rot = if rot < d_head { part(0, rot) } else { x };
    let half = rot / 2;
    let (x1, x2) = (part(0, half), part(half, half));
    let rotated = x2.scale(-1.0).concat(x1, 0);
    let pnb = pe.nb();
    let plane = |i: usize| pe.view(&[rot, 1, l, 1], &[pnb[1], pnb[2], pnb[3]], i * pnb[3]);
    let out = x_rot.mul(plane(0)).add(rotated.mul(plane(1)));
    if rot < d_head {
        out.concat(part(rot, d_head - rot), 0)
    } else {
        out
    }
}

#[derive(Clone, Copy, Debug)]
struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    to_out: Linear,
    heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(s: &mut Scope, cfg: &ErnieImageConfig) -> Attention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let inner = cfg.num_heads * d;
        Attention {
            to_q: Linear::new(s, "to_q", h, inner, false),
            to_k: Linear::new(s, "to_k", h, inner, false),
            to_v: Linear::new(s, "to_v", h, inner, false),
            norm_q: RmsNorm::new(s, "norm_q", "weight", d, cfg.eps, true),
            norm_k: RmsNorm::new(s, "norm_k", "weight", d, cfg.eps, true),
            to_out: Linear::new(s, "to_out.0", inner, h, false),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    /// x: [hidden, L, N] → [hidden, L, N].
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let shape = [self.head_dim, self.heads, l, n];
        let q = self.norm_q.forward(g, self.to_q.forward(g, x).reshape(&shape));
        let k = self.norm_k.forward(g, self.to_k.forward(g, x).reshape(&shape));
        let v = self.to_v.forward(g, x).reshape(&shape);
        let heads_last = |t: T<'g>| t.permute(0, 2, 1, 3).cont().reshape(&[self.head_dim, l, self.heads * n]);
        let q = heads_last(rotate(q, pe));
        let k = heads_last(rotate(k, pe));
        let x = nn::attention(g, q, k, v, self.heads, None, true, g.options.flash_attn, 1.0);
        self.to_out.forward(g, x)
    }
}

/// `linear_fc2(up_proj(x) · gelu(gate_proj(x)))`.
#[derive(Clone, Copy, Debug)]
struct FeedForward {
    gate_proj: Linear,
    up_proj: Linear,
    linear_fc2: Linear,
}

impl FeedForward {
    fn new(s: &mut Scope, hidden: i64, ffn: i64) -> FeedForward {
        FeedForward {
            gate_proj: Linear::new(s, "gate_proj", hidden, ffn, false),
            up_proj: Linear::new(s, "up_proj", hidden, ffn, false),
            linear_fc2: Linear::new(s, "linear_fc2", ffn, hidden, false),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gate = self.gate_proj.forward(g, x).gelu();
        self.linear_fc2.forward(g, self.up_proj.forward(g, x).mul(gate))
    }
}

/// A layer modulated by the model's one shared set of six adaLN vectors.
#[derive(Clone, Copy, Debug)]
struct Layer {
    sa_norm: RmsNorm,
    attention: Attention,
    mlp_norm: RmsNorm,
    mlp: FeedForward,
}

impl Layer {
    fn new(s: &mut Scope, cfg: &ErnieImageConfig) -> Layer {
        let (h, eps) = (cfg.hidden_size, cfg.eps);
        Layer {
            sa_norm: RmsNorm::new(s, "adaLN_sa_ln", "weight", h, eps, true),
            attention: Attention::new(&mut s.sub("self_attention"), cfg),
            mlp_norm: RmsNorm::new(s, "adaLN_mlp_ln", "weight", h, eps, true),
            mlp: FeedForward::new(&mut s.sub("mlp"), h, cfg.ffn_hidden_size),
        }
    }

    /// `m`: shift, scale, gate of the attention, then of the MLP, each `[hidden, N]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>, m: &[T<'g>]) -> T<'g> {
        let tokens = |t: T<'g>| t.reshape(&[t.ne()[0], 1, t.ne()[1]]);
        let h = modulate(self.sa_norm.forward(g, x), m[0], m[1]);
        let x = x.add(self.attention.forward(g, h, pe).mul(tokens(m[2])));
        let h = modulate(self.mlp_norm.forward(g, x), m[3], m[4]);
        x.add(self.mlp.forward(g, h).mul(tokens(m[5])))
    }
}

/// An ERNIE-Image transformer whose weights live in a `ParamStore`.
pub struct ErnieImageModel {
    pub config: ErnieImageConfig,
    x_embedder: Conv2d,
    text_proj: Option<Linear>,
    time_embedding: MlpEmbedder,
    modulation: Linear,
    layers: Vec<Layer>,
    final_norm: LayerNorm,
    final_modulation: Linear,
    final_linear: Linear,
}

impl ErnieImageModel {
    pub fn new(s: &mut Scope, cfg: &ErnieImageConfig) -> ErnieImageModel {
        let (h, p) = (cfg.hidden_size, cfg.patch_size);
        let x_embedder = Conv2d::new(s, "x_embedder.proj", cfg.in_channels, h, (p, p), (p as i32, p as i32), (0, 0), true);
        let text_proj = (cfg.text_in_dim != h).then(|| Linear::new(s, "text_proj", cfg.text_in_dim, h, false));
        let time_embedding = MlpEmbedder::with_layers(s, "time_embedding", ["linear_1", "linear_2"], h, h, h, false);
        let modulation = Linear::new(s, "adaLN_modulation.1", h, 6 * h, true);
        let layers = (0..cfg.num_layers).map(|i| Layer::new(&mut s.sub(&format!("layers.{i}")), cfg)).collect();
        let mut fin = s.sub("final_norm");
        let final_modulation = Linear::new(&mut fin, "linear", h, 2 * h, true);
        let final_linear = Linear::new(s, "final_linear", h, p * p * cfg.out_channels, true);
        ErnieImageModel {
            config: cfg.clone(),
            x_embedder,
            text_proj,
            time_embedding,
            modulation,
            layers,
            final_norm: LayerNorm { weight: None, bias: None, eps: cfg.eps },
            final_modulation,
            final_linear,
        }
    }

    /// One evaluation: the latent `x` `[W, H, C, 1]`, the model timestep `t` `[1]`, the
    /// text `context` `[text_in_dim, L, 1]` and the table of [`rope::ernie_pe`] →
    /// `[W, H, C_out, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, pe: T<'g>) -> T<'g> {
        let p = self.config.patch_size;
        let h = self.config.hidden_size;
        let [w, hh, _, n] = x.ne();
        let (wp, hp) = (w / p, hh / p);
        let img = self.x_embedder.forward(g, x).reshape(&[wp * hp, h, n]).permute(1, 0, 2, 3).cont();
        let txt = match self.text_proj {
            Some(proj) => proj.forward(g, context),
            None => context,
        };
        let mut x = img.concat(txt, 1);

        let emb = timestep_embedding(t, h as i32, 10000, 1.0);
        let half = h / 2;
        let enb = emb.nb();
        let emb_half = |i: usize| emb.view(&[half, emb.ne()[1]], &[enb[1]], i * half as usize * enb[0]);
        let c = self.time_embedding.forward(g, emb_half(1).concat(emb_half(0), 0));
        let mods = chunk(self.modulation.forward(g, c.silu()), 6, 0, true);
        for layer in &self.layers {
            x = layer.forward(g, x, pe, &mods);
        }

        let fm = chunk(self.final_modulation.forward(g, c), 2, 0, true);
        let x = modulate(self.final_norm.forward(g, x), fm[1], fm[0]);
        let x = self.final_linear.forward(g, x);
        let nb = x.nb();
        let patches = x.view(&[x.ne()[0], wp * hp, n], &[nb[1], nb[2]], 0).cont();
        unpatchify(patches, hp, wp, p, false)
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor) -> Result<()> {
        let cfg = &self.config;
        let (c, p) = (cfg.in_channels as usize, cfg.patch_size as usize);
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "ERNIE-Image takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        ensure!(
            x.ne(0) % p == 0 && x.ne(1) % p == 0,
            "ERNIE-Image's latent sides must be multiples of its patch size {p}, got {}x{}",
            x.ne(0),
            x.ne(1)
        );
        ensure!(
            context.ne(0) as i64 == cfg.text_in_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "ERNIE-Image's text context must be [{}, L, 1] (the LLM's width), got {:?}",
            cfg.text_in_dim,
            context.shape()
        );
        ensure!(cfg.out_channels == cfg.in_channels, "ERNIE-Image with {} input and {} output channels", cfg.in_channels, cfg.out_channels);
        Ok(())
    }
}

/// A loaded ERNIE-Image transformer.
pub type ErnieImage = Loaded<ErnieImageModel>;

impl DiffusionModel for Loaded<ErnieImageModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("ERNIE-Image needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context)?;
        ensure!(input.timesteps.len() == 1, "ERNIE-Image takes one timestep, got {}", input.timesteps.len());
        let cfg = &model.config;
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        let circular = (runner.options.circular_x, runner.options.circular_y);
        let p = cfg.patch_size as usize;
        let pe = rope::ernie_pe(h, w, p, context.ne(1), cfg.theta, &cfg.axes_dim, circular);
        let rot: usize = cfg.axes_dim.iter().sum();
        let pos_len = pe.len() / rot / 2;
        let t = [input.timesteps[0]];
        runner.compute(|g| {
            let x = g.input(input.x);
            let t = g.input_f32(&t, &[1]);
            let ctx = g.input(context);
            let pe = g.input_f32(&pe, &[rot as i64, 1, pos_len as i64, 2]);
            Ok(model.forward(g, x, t, ctx, pe))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ParamStore, F32};
    use std::collections::HashMap;

    fn synthetic(h: i64, text: i64) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("model.diffusion_model.{n}"), F32);
            shapes.insert(format!("model.diffusion_model.{n}"), s.to_vec());
        };
        add("x_embedder.proj.weight", &[1, 1, 128, h]);
        add("text_proj.weight", &[text, h]);
        add("layers.0.self_attention.norm_q.weight", &[128]);
        add("layers.0.mlp.gate_proj.weight", &[h, 3 * h]);
        add("layers.2.mlp.gate_proj.weight", &[h, 3 * h]);
        add("final_linear.weight", &[h, 128]);
        (types, shapes)
    }

    #[test]
    fn config_from_weights() {
        let (types, shapes) = synthetic(256, 64);
        let cfg = ErnieImageConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert_eq!((cfg.hidden_size, cfg.num_heads, cfg.num_layers, cfg.ffn_hidden_size), (256, 2, 3, 768));
        assert_eq!((cfg.in_channels, cfg.out_channels, cfg.patch_size, cfg.text_in_dim), (128, 128, 1, 64));
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        ErnieImageModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in ["text_proj.weight", "time_embedding.linear_2.bias", "final_norm.linear.weight", "layers.2.self_attention.to_out.0.weight"] {
            assert!(names.contains(&format!("model.diffusion_model.{n}").as_str()), "{n}");
        }
        // Heads of 64 cannot hold the 128 dimensions the RoPE turns.
        let mut narrow = cfg.clone();
        narrow.num_heads = 4;
        assert!(narrow.validate().unwrap_err().to_string().contains("turns 128"));
    }

    #[test]
    fn rotation_table_puts_the_image_first() {
        let axes = [32usize, 48, 48];
        // A 3×2 latent (patch 1) and 4 text tokens: 6 image tokens, then the text.
        let pe = rope::ernie_pe(2, 3, 1, 4, 256.0, &axes, (false, false));
        assert_eq!(pe.len(), 10 * 128 * 2);
        let (cos, sin) = pe.split_at(10 * 128);
        // Image token 0 has ids (4, 0, 0): the first frequency of axis 0 turns 4 rad, and
        // fills two neighbouring positions.
        assert!((cos[0] - 4f32.cos()).abs() < 1e-6 && cos[1] == cos[0] && (sin[1] - 4f32.sin()).abs() < 1e-6);
        // Image token 4 is row 1, column 1: axis 1's first frequency (position 32) turns 1 rad.
        assert!((cos[4 * 128 + 32] - 1f32.cos()).abs() < 1e-6);
        // Text token 1 has ids (1, 0, 0).
        assert!((sin[7 * 128] - 1f32.sin()).abs() < 1e-6 && cos[7 * 128 + 32] == 1.0);
    }
}
