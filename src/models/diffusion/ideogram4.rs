//! Ideogram 4: a single-stream DiT over the text tokens (13 layers of a Qwen3-VL LLM side by
//! side) and the Flux.2 latent's tokens, like the reference's `ideogram4.hpp`.
//!
//! - Weights under `model.diffusion_model.` (the unconditional twin of
//!   `uncond_diffusion_model_path` under `model.diffusion_model.uncond.`): `input_proj`,
//!   `llm_cond_norm` / `llm_cond_proj`, `t_embedding.mlp_{in,out}`, `adaln_proj`,
//!   `embed_image_indicator`, `layers.N` and `final_layer`. The reference reads only the
//!   layer count from them; every width is fixed ([`Ideogram4Config`]).
//! - The text's channels are regrouped from the LLM's layer-major order to hidden-major
//!   before its RMS norm and projection; text tokens come first, each token gets the
//!   embedding of its kind (text 0, image 1).
//! - Every layer has its own adaLN (scales and tanh gates, no shifts), RMS norms before and
//!   after the attention and the SwiGLU MLP; attention q/k are RMS-normed per head and turned
//!   by a 3-axis interleaved multi-section RoPE (θ 5e6, sections 24/20/20 over 256-wide heads)
//!   whose pairs are the two halves of a head; K and V enter the attention scaled by 1/128.
//! - Text positions are `(i, i, i)`, image positions `(65536, 65536 + row, 65536 + col)`.
//! - The timestep is `1000 - t` (sinusoidal ×10, sin first); the output is the negated
//!   velocity.
//! - The unconditional pass has no text at all (image tokens only); it runs the twin when
//!   one is loaded.

use super::{DiffusionInput, DiffusionModel};
use crate::error::Result;
use crate::graph::nn::{self, Embedding, LayerNorm, Linear};
use crate::graph::{Component, Components, Graph, Loaded, Scope, TypeMap, T};
use crate::models::common::dit::{block_index, chunk, timestep_embedding, RmsNorm};
use crate::models::common::rope::{apply_rope_halves, embed_nd, Ids};
use crate::tensor::Tensor;

/// LLM layers whose hidden states the text is made of.
pub const LLM_LAYERS: i64 = 13;
/// Where image positions start on every axis.
const IMAGE_POSITION_OFFSET: f32 = 65536.0;

#[derive(Clone, Debug, PartialEq)]
pub struct Ideogram4Config {
    pub emb_dim: i64,
    pub num_layers: usize,
    pub num_heads: i64,
    pub intermediate_size: i64,
    pub adaln_dim: i64,
    pub in_channels: i64,
    /// Width of the text the model takes: [`LLM_LAYERS`] hidden states side by side.
    pub llm_features_dim: i64,
    pub rope_theta: f32,
    pub mrope_section: [usize; 3],
    pub norm_eps: f32,
}

impl Default for Ideogram4Config {
    fn default() -> Ideogram4Config {
        Ideogram4Config {
            emb_dim: 4608,
            num_layers: 34,
            num_heads: 18,
            intermediate_size: 12288,
            adaln_dim: 512,
            in_channels: 128,
            llm_features_dim: 53248,
            rope_theta: 5_000_000.0,
            mrope_section: [24, 20, 20],
            norm_eps: 1e-5,
        }
    }
}

impl Ideogram4Config {
    /// The released model's sizes with the layer count of the weights under `prefix` (34
    /// when there are none), as the reference reads them.
    pub fn detect(types: &TypeMap, prefix: &str) -> Ideogram4Config {
        let layers = types
            .keys()
            .filter_map(|n| n.strip_prefix(prefix))
            .filter(|n| n.starts_with("layers."))
            .filter_map(|n| block_index(n, "layers."))
            .max()
            .map_or(0, |i| i + 1);
        let mut cfg = Ideogram4Config::default();
        if layers > 0 {
            cfg.num_layers = layers;
        }
        sd_debug!("ideogram4: num_layers = {}, emb_dim = {}, num_heads = {}, intermediate_size = {}", cfg.num_layers, cfg.emb_dim, cfg.num_heads, cfg.intermediate_size);
        cfg
    }

    pub fn head_dim(&self) -> i64 {
        self.emb_dim / self.num_heads
    }

    /// Width of each LLM hidden state the text is made of.
    pub fn llm_hidden(&self) -> i64 {
        self.llm_features_dim / LLM_LAYERS
    }
}

/// The rotation table (`[2, 2, head_dim / 2, L]` values) of `context_len` text tokens and an
/// `h`×`w` latent: each axis turns every frequency of the head; frequency `i` is taken from
/// axis `i mod 3` when that axis's section reaches it, else from axis 0. On circular axes
/// image tokens wrap around the grid.
pub fn ideogram4_pe(h: usize, w: usize, context_len: usize, cfg: &Ideogram4Config, circular: (bool, bool)) -> Vec<f32> {
    let n = context_len + h * w;
    let mut data = Vec::with_capacity(n * 3);
    for i in 0..context_len {
        data.extend([i as f32; 3]);
    }
    for y in 0..h {
        for x in 0..w {
            data.extend([IMAGE_POSITION_OFFSET, IMAGE_POSITION_OFFSET + y as f32, IMAGE_POSITION_OFFSET + x as f32]);
        }
    }
    let ids = Ids { n_axes: 3, data };
    let wrap = (circular.0 || circular.1).then(|| {
        let along = |on: bool, len: usize| (0..n).map(|t| if on && t >= context_len { len } else { 0 }).collect::<Vec<usize>>();
        vec![vec![0; n], along(circular.1, h), along(circular.0, w)]
    });
    let d = cfg.head_dim() as usize;
    let half = d / 2;
    // Per token the three axes' tables side by side, 4 values per frequency each.
    let tables = embed_nd(&ids, cfg.rope_theta, &[d, d, d], wrap.as_deref());
    let mut out = Vec::with_capacity(n * half * 4);
    for t in 0..n {
        let row = &tables[t * 3 * half * 4..(t + 1) * 3 * half * 4];
        for f in 0..half {
            let axis = match f % 3 {
                a @ (1 | 2) if f < (cfg.mrope_section[a] * 3).min(half) => a,
                _ => 0,
            };
            let at = (axis * half + f) * 4;
            out.extend_from_slice(&row[at..at + 4]);
        }
    }
    out
}

#[derive(Clone, Copy, Debug)]
struct Attention {
    qkv: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    o: Linear,
    heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(s: &mut Scope, cfg: &Ideogram4Config) -> Attention {
        let (h, d) = (cfg.emb_dim, cfg.head_dim());
        Attention {
            qkv: Linear::new(s, "qkv", h, 3 * h, false),
            norm_q: RmsNorm::new(s, "norm_q", "weight", d, cfg.norm_eps, true),
            norm_k: RmsNorm::new(s, "norm_k", "weight", d, cfg.norm_eps, true),
            o: Linear::new(s, "o", h, h, false),
            heads: cfg.num_heads,
            head_dim: d,
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let (q, k, v) = nn::split_qkv(self.qkv.forward(g, x));
        let shape = [self.head_dim, self.heads, l, n];
        let q = apply_rope_halves(g, self.norm_q.forward(g, q.reshape(&shape)), pe);
        let k = apply_rope_halves(g, self.norm_k.forward(g, k.reshape(&shape)), pe);
        let v = v.reshape(&shape);
        let x = nn::attention(g, q, k, v, self.heads, None, true, g.options.flash_attn, 1.0 / 128.0);
        self.o.forward(g, x)
    }
}

/// `w2(silu(w1(x)) · w3(x))`.
#[derive(Clone, Copy, Debug)]
struct FeedForward {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl FeedForward {
    fn new(s: &mut Scope, dim: i64, hidden: i64) -> FeedForward {
        FeedForward { w1: Linear::new(s, "w1", dim, hidden, false), w2: Linear::new(s, "w2", hidden, dim, false), w3: Linear::new(s, "w3", dim, hidden, false) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gate = self.w1.forward(g, x).silu();
        self.w2.forward(g, gate.mul(self.w3.forward(g, x)))
    }
}

/// `[C, N]` → `[C, 1, N]`, broadcast over the tokens.
fn per_token(t: T<'_>) -> T<'_> {
    t.reshape(&[t.ne()[0], 1, t.ne()[1]])
}

/// `x + x · scale`.
fn scale_up<'g>(x: T<'g>, scale: T<'g>) -> T<'g> {
    x.add(x.mul(per_token(scale)))
}

#[derive(Clone, Copy, Debug)]
struct Layer {
    attention: Attention,
    feed_forward: FeedForward,
    attention_norm1: RmsNorm,
    ffn_norm1: RmsNorm,
    attention_norm2: RmsNorm,
    ffn_norm2: RmsNorm,
    adaln_modulation: Linear,
}

impl Layer {
    fn new(s: &mut Scope, cfg: &Ideogram4Config) -> Layer {
        let (h, eps) = (cfg.emb_dim, cfg.norm_eps);
        let mut norm = |name: &str| RmsNorm::new(s, name, "weight", h, eps, true);
        let (attention_norm1, ffn_norm1, attention_norm2, ffn_norm2) = (norm("attention_norm1"), norm("ffn_norm1"), norm("attention_norm2"), norm("ffn_norm2"));
        Layer {
            attention: Attention::new(&mut s.sub("attention"), cfg),
            feed_forward: FeedForward::new(&mut s.sub("feed_forward"), h, cfg.intermediate_size),
            attention_norm1,
            ffn_norm1,
            attention_norm2,
            ffn_norm2,
            adaln_modulation: Linear::new(s, "adaln_modulation", cfg.adaln_dim, 4 * h, true),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>, adaln: T<'g>) -> T<'g> {
        let m = chunk(self.adaln_modulation.forward(g, adaln), 4, 0, false);
        let a = scale_up(self.attention_norm1.forward(g, x), m[0]);
        let a = self.attention_norm2.forward(g, self.attention.forward(g, a, pe));
        let x = x.add(a.mul(per_token(m[1].tanh())));
        let f = scale_up(self.ffn_norm1.forward(g, x), m[2]);
        let f = self.ffn_norm2.forward(g, self.feed_forward.forward(g, f));
        x.add(f.mul(per_token(m[3].tanh())))
    }
}

/// An Ideogram 4 transformer whose weights live in a `ParamStore`.
pub struct Ideogram4Model {
    pub config: Ideogram4Config,
    input_proj: Linear,
    llm_cond_norm: RmsNorm,
    llm_cond_proj: Linear,
    t_mlp_in: Linear,
    t_mlp_out: Linear,
    adaln_proj: Linear,
    embed_image_indicator: Embedding,
    layers: Vec<Layer>,
    final_norm: LayerNorm,
    final_linear: Linear,
    final_modulation: Linear,
}

impl Ideogram4Model {
    pub fn new(s: &mut Scope, cfg: &Ideogram4Config) -> Ideogram4Model {
        let h = cfg.emb_dim;
        let mut t = s.sub("t_embedding");
        let (t_mlp_in, t_mlp_out) = (Linear::new(&mut t, "mlp_in", h, h, true), Linear::new(&mut t, "mlp_out", h, h, true));
        let mut fin = s.sub("final_layer");
        let final_linear = Linear::new(&mut fin, "linear", h, cfg.in_channels, true);
        let final_modulation = Linear::new(&mut fin, "adaln_modulation", cfg.adaln_dim, h, true);
        Ideogram4Model {
            config: cfg.clone(),
            input_proj: Linear::new(s, "input_proj", cfg.in_channels, h, true),
            llm_cond_norm: RmsNorm::new(s, "llm_cond_norm", "weight", cfg.llm_features_dim, 1e-6, true),
            llm_cond_proj: Linear::new(s, "llm_cond_proj", cfg.llm_features_dim, h, true),
            t_mlp_in,
            t_mlp_out,
            adaln_proj: Linear::new(s, "adaln_proj", h, cfg.adaln_dim, true),
            embed_image_indicator: Embedding::new(s, "embed_image_indicator", 2, h),
            layers: (0..cfg.num_layers).map(|i| Layer::new(&mut s.sub(&format!("layers.{i}")), cfg)).collect(),
            final_norm: LayerNorm { weight: None, bias: None, eps: 1e-6 },
            final_linear,
            final_modulation,
        }
    }

    /// One evaluation: the latent `x` `[W, H, 128, 1]` (channels `[32 VAE channels, 2, 2]`),
    /// the model timestep `t` `[1]`, the text `context` `[53248, L, 1]` (none: the
    /// unconditional pass), the token kinds `indicator` (i32 `[L + W·H, 1]`) and the table
    /// of [`ideogram4_pe`] → the velocity `[W, H, 128, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: Option<T<'g>>, indicator: T<'g>, pe: T<'g>) -> T<'g> {
        let cfg = &self.config;
        let [w, hh, c, n] = x.ne();
        let ae = c / 4;
        // Token channels in the order [row in patch, column in patch, VAE channel].
        let img = x.cont().reshape(&[w * hh, 2, 2, ae]).permute(3, 1, 2, 0).cont().reshape(&[c, w * hh, n]);
        let img = self.input_proj.forward(g, img);
        let (mut x, context_len) = match context {
            Some(ctx) => {
                let [_, l, _, _] = ctx.ne();
                let ctx = ctx.reshape(&[cfg.llm_hidden(), LLM_LAYERS, l, n]).permute(1, 0, 2, 3).cont().reshape(&[cfg.llm_features_dim, l, n]);
                let txt = self.llm_cond_proj.forward(g, self.llm_cond_norm.forward(g, ctx));
                (txt.concat(img, 1), l)
            }
            None => (img, 0),
        };
        x = x.add(self.embed_image_indicator.forward(g, indicator));

        let emb = timestep_embedding(t, cfg.emb_dim as i32, 10000, 10.0);
        let half = chunk(emb, 2, 0, false);
        let t_cond = self.t_mlp_out.forward(g, self.t_mlp_in.forward(g, half[1].concat(half[0], 0)).silu());
        let adaln = self.adaln_proj.forward(g, t_cond).silu();
        for layer in &self.layers {
            x = layer.forward(g, x, pe, adaln);
        }

        let scale = self.final_modulation.forward(g, adaln.silu());
        let x = self.final_linear.forward(g, scale_up(self.final_norm.forward(g, x), scale));
        let nb = x.nb();
        let x = x.view(&[c, w * hh, n], &[nb[1], nb[2]], context_len as usize * nb[1]).cont();
        x.reshape(&[ae, 2, 2, w * hh]).permute(3, 1, 2, 0).cont().reshape(&[w, hh, c, n]).scale(-1.0)
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: Option<&Tensor>) -> Result<()> {
        let c = self.config.in_channels as usize;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Ideogram 4 takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        if let Some(ctx) = context {
            ensure!(
                ctx.ne(0) as i64 == self.config.llm_features_dim && ctx.ne(1) > 0 && ctx.ne(2) == 1 && ctx.ne(3) == 1,
                "Ideogram 4's text context must be [{}, L, 1] ({LLM_LAYERS} LLM layers of {}), got {:?}",
                self.config.llm_features_dim,
                self.config.llm_hidden(),
                ctx.shape()
            );
        }
        Ok(())
    }

    fn compute(&self, runner: &mut crate::graph::Runner, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref();
        self.check_inputs(input.x, context)?;
        ensure!(input.timesteps.len() == 1, "Ideogram 4 takes one timestep, got {}", input.timesteps.len());
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        let context_len = context.map_or(0, |c| c.ne(1));
        let circular = (runner.options.circular_x, runner.options.circular_y);
        let pe = ideogram4_pe(h, w, context_len, &self.config, circular);
        let pos_len = context_len + w * h;
        let kinds: Vec<i32> = (0..pos_len).map(|i| i32::from(i >= context_len)).collect();
        let t = [1000.0 - input.timesteps[0]];
        let d = self.config.head_dim();
        runner.compute(|g| {
            let x = g.input(input.x);
            let t = g.input_f32(&t, &[1]);
            let ctx = context.map(|c| g.input(c));
            let kinds = g.input_i32(&kinds, &[pos_len as i64, 1]);
            let pe = g.input_f32(&pe, &[2, 2, d / 2, pos_len as i64]);
            Ok(self.forward(g, x, t, ctx, kinds, pe))
        })
    }
}

/// The loaded Ideogram 4 transformer and, when `uncond_diffusion_model_path` gave one, its
/// unconditional twin, which then makes every pass without text.
pub struct Ideogram4 {
    pub model: Loaded<Ideogram4Model>,
    pub uncond: Option<Loaded<Ideogram4Model>>,
}

impl Components for Ideogram4 {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let mut v: Vec<&mut dyn Component> = vec![&mut self.model];
        if let Some(u) = &mut self.uncond {
            v.push(u);
        }
        v
    }
}

impl DiffusionModel for Ideogram4 {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let net = match &mut self.uncond {
            Some(u) if input.cond.crossattn.is_none() => u,
            _ => &mut self.model,
        };
        let (model, runner) = net.parts();
        model.compute(runner, input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::F32;

    #[test]
    fn layer_count_from_the_weights() {
        let mut types = TypeMap::new();
        for n in ["layers.0.attention.qkv.weight", "layers.2.ffn_norm1.weight", "uncond.layers.5.ffn_norm1.weight", "input_proj.weight"] {
            types.insert(format!("model.diffusion_model.{n}"), F32);
        }
        let cfg = Ideogram4Config::detect(&types, "model.diffusion_model.");
        assert_eq!((cfg.num_layers, cfg.head_dim(), cfg.llm_hidden()), (3, 256, 4096));
        assert_eq!(Ideogram4Config::detect(&TypeMap::new(), "model.diffusion_model.").num_layers, 34);
    }

    #[test]
    fn rotation_table_interleaves_the_axes() {
        let cfg = Ideogram4Config::default();
        // 2 text tokens and a 2×3 latent.
        let pe = ideogram4_pe(2, 3, 2, &cfg, (false, false));
        assert_eq!(pe.len(), 8 * 128 * 4);
        let at = |t: usize, f: usize| &pe[(t * 128 + f) * 4..(t * 128 + f) * 4 + 4];
        // Text token 1 turns by 1 rad at frequency 0 on every axis.
        assert!((at(1, 0)[0] - 1f32.cos()).abs() < 1e-6 && (at(1, 0)[2] - 1f32.sin()).abs() < 1e-6);
        // Image token 5 (row 1, column 0): frequency 3 is axis 0's, 4 (< 60) the row's, 5 the
        // column's, 61 (past the row's section) axis 0's.
        let omega = |f: usize| 1.0 / 5e6f32.powf(f as f32 * ((256.0 - 2.0) / 256.0) / 127.0);
        let angle = |t: usize, f: usize| at(t, f)[2].atan2(at(t, f)[0]);
        let wrapped = |a: f32| (a + std::f32::consts::PI).rem_euclid(std::f32::consts::TAU) - std::f32::consts::PI;
        assert!((angle(5, 4) - wrapped(65537.0 * omega(4))).abs() < 1e-2);
        assert!((angle(5, 5) - wrapped(65536.0 * omega(5))).abs() < 1e-2);
        assert_eq!(at(5, 61), at(2, 61));
    }
}
