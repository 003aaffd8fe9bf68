//! Z-Image (Turbo): the single-stream DiT of Alibaba's Tongyi lab, like the reference's
//! `z_image.hpp` (Lumina-Image-2.0 lineage).
//!
//! - Weights under `model.diffusion_model.` with the original names: `x_embedder`,
//!   `cap_embedder.{0,1}` (RMS norm + linear of the LLM hidden states), `t_embedder.mlp`,
//!   the pad tokens `cap_pad_token` / `x_pad_token`, `context_refiner.N` (text only, no
//!   modulation), `noise_refiner.N` (image only), `layers.N` (joint) and `final_layer`.
//! - Text and image tokens are each padded to a multiple of 32 with their pad token, refined
//!   separately, then attend jointly with 3-axis RoPE (θ 256; text ids count from 1, image
//!   rows/cols after them); blocks are sandwich-normed, modulated by `tanh` gates of the
//!   timestep embedding.
//! - Reference-image latents (the `z_image_omni` preset) are patchified and appended to the
//!   image's tokens before the embedding; they are padded together, refined and attended
//!   with the image, and only the image's tokens are read back. Like the reference, they
//!   get no positions of their own (id 0, as padding; see [`rope::zimage_pe`]).
//! - The model timestep is `1000 - t` and the output is negated (its velocity points the
//!   other way), both inside [`ZImage`], so the sampling loop sees a plain flow model.
//! - The reference needs the hidden size to be at least 256 (its timestep embedding is 256
//!   wide while the modulations read `min(hidden, 256)`); narrower files are refused here.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{block_index, chunk, pad_and_patchify, scale_tokens, timestep_embedding, unpatchify_and_crop, MlpEmbedder, RmsNorm};
use crate::models::common::rope::{self, pad_to_multiple};
use crate::tensor::Tensor;

/// Text and image token sequences are padded to multiples of this.
pub const SEQ_MULTIPLE: usize = 32;
/// Width of the timestep embedding and of the modulations' input.
const ADALN_DIM: i64 = 256;
/// Z-Image's attention runs with K and V scaled by this in the fused kernel.
const KV_SCALE: f32 = 1.0 / 128.0;
/// The feed-forward's output projection sees its input scaled by this (undone after it).
const FF_OUT_SCALE: f32 = 1.0 / 128.0;

#[derive(Clone, Debug, PartialEq)]
pub struct ZImageConfig {
    pub patch_size: i64,
    pub hidden_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub num_layers: usize,
    pub num_refiner_layers: usize,
    pub head_dim: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub ffn_hidden: i64,
    pub norm_eps: f32,
    pub cap_feat_dim: i64,
    pub theta: f32,
    pub axes_dim: Vec<usize>,
}

impl ZImageConfig {
    /// The configuration of the network under `prefix`, read from the weights like the
    /// reference (widths, channels, block counts, heads from the q-norm and qkv widths);
    /// what is missing keeps the 6B model's value.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> ZImageConfig {
        let p = 2;
        let mut cfg = ZImageConfig {
            patch_size: p,
            hidden_size: 3840,
            in_channels: 16,
            out_channels: 16,
            num_layers: 30,
            num_refiner_layers: 2,
            head_dim: 128,
            num_heads: 30,
            num_kv_heads: 30,
            ffn_hidden: 0,
            norm_eps: 1e-5,
            cap_feat_dim: 2560,
            theta: 256.0,
            axes_dim: vec![32, 48, 48],
        };
        let (mut layers, mut refiners, mut head_dim, mut qkv_dim) = (0, 0, 0, 0);
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            let matrix = || shape_of(name).filter(|s| s.len() == 2);
            if name.ends_with("x_embedder.weight") {
                if let Some(s) = matrix() {
                    cfg.in_channels = s[0] / (p * p);
                    cfg.hidden_size = s[1];
                }
            } else if name.ends_with("cap_embedder.1.weight") {
                if let Some(s) = matrix() {
                    cfg.cap_feat_dim = s[0];
                    cfg.hidden_size = s[1];
                }
            } else if name.ends_with("layers.0.attention.q_norm.weight") {
                if let Some(s) = shape_of(name).filter(|s| s.len() == 1) {
                    head_dim = s[0];
                }
            } else if name.ends_with("layers.0.attention.qkv.weight") {
                if let Some(s) = matrix() {
                    qkv_dim = s[1];
                }
            } else if name.ends_with("final_layer.linear.weight") {
                if let Some(s) = matrix() {
                    cfg.out_channels = s[1] / (p * p);
                }
            }
            if let Some(i) = block_index(name, "layers.") {
                layers = layers.max(i + 1);
            }
            for marker in ["noise_refiner.", "context_refiner."] {
                if let Some(i) = block_index(name, marker) {
                    refiners = refiners.max(i + 1);
                }
            }
        }
        if layers > 0 {
            cfg.num_layers = layers;
        }
        if refiners > 0 {
            cfg.num_refiner_layers = refiners;
        }
        if head_dim > 0 {
            cfg.head_dim = head_dim;
            cfg.num_heads = cfg.hidden_size / head_dim;
            if qkv_dim > 0 {
                cfg.num_kv_heads = ((qkv_dim / head_dim - cfg.num_heads) / 2).max(1);
            }
        }
        // int(8/3 · hidden) rounded up to a multiple of 256, as the reference sizes it.
        let ffn = (8.0f32 / 3.0 * cfg.hidden_size as f32) as i64;
        cfg.ffn_hidden = (ffn + 255) / 256 * 256;
        sd_debug!(
            "z_image: num_layers = {}, num_refiner_layers = {}, hidden_size = {}, num_heads = {}, num_kv_heads = {}, in_channels = {}, out_channels = {}",
            cfg.num_layers,
            cfg.num_refiner_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.in_channels,
            cfg.out_channels
        );
        cfg
    }

    /// What the graphs need that the reference asserts while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.hidden_size >= ADALN_DIM,
            "Z-Image DiT hidden size {} is narrower than {ADALN_DIM}: its timestep embedding ({ADALN_DIM} wide) cannot feed the {}-wide modulations",
            self.hidden_size,
            self.hidden_size
        );
        ensure!(
            self.head_dim > 0 && self.head_dim % 2 == 0 && self.num_heads * self.head_dim == self.hidden_size,
            "Z-Image DiT: {} heads of {} do not make the hidden size {}",
            self.num_heads,
            self.head_dim,
            self.hidden_size
        );
        let axes: usize = self.axes_dim.iter().sum();
        ensure!(axes as i64 == self.head_dim, "Z-Image DiT: RoPE axes cover {axes} of the head's {} dimensions", self.head_dim);
        Ok(())
    }
}

fn rms_norm(s: &mut Scope, name: &str, dim: i64, eps: f32) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, eps, true)
}

#[derive(Clone, Copy, Debug)]
struct JointAttention {
    qkv: Linear,
    out: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl JointAttention {
    fn new(s: &mut Scope, cfg: &ZImageConfig) -> JointAttention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        JointAttention {
            qkv: Linear::new(s, "qkv", h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, false),
            out: Linear::new(s, "out", cfg.num_heads * d, h, false),
            q_norm: rms_norm(s, "q_norm", d, 1e-6),
            k_norm: rms_norm(s, "k_norm", d, 1e-6),
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: d,
        }
    }

    /// x: [hidden, L, N] → [hidden, L, N].
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let qkv = self.qkv.forward(g, x);
        let [_, l, n, _] = qkv.ne();
        let qkv = qkv.reshape(&[self.head_dim, self.heads + 2 * self.kv_heads, l, n]);
        let nb = qkv.nb();
        let part = |heads: i64, first: i64| qkv.view(&[self.head_dim, heads, l, n], &[nb[1], nb[2], nb[3]], first as usize * nb[1]);
        let q = self.q_norm.forward(g, part(self.heads, 0));
        let k = self.k_norm.forward(g, part(self.kv_heads, self.heads));
        let v = part(self.kv_heads, self.heads + self.kv_heads);
        let x = rope::attention_scaled(g, q, k, v, pe, None, KV_SCALE);
        self.out.forward(g, x)
    }
}

/// w2(silu(w1 x) · w3 x).
#[derive(Clone, Copy, Debug)]
struct FeedForward {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl FeedForward {
    fn new(s: &mut Scope, dim: i64, hidden: i64) -> FeedForward {
        let mut w2 = Linear::new(s, "w2", hidden, dim, false);
        w2.scale = FF_OUT_SCALE;
        FeedForward { w1: Linear::new(s, "w1", dim, hidden, false), w2, w3: Linear::new(s, "w3", dim, hidden, false) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.w1.forward(g, x).swiglu_split(self.w3.forward(g, x));
        self.w2.forward(g, h)
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    attention: JointAttention,
    feed_forward: FeedForward,
    attention_norm1: RmsNorm,
    attention_norm2: RmsNorm,
    ffn_norm1: RmsNorm,
    ffn_norm2: RmsNorm,
    /// `adaLN_modulation.0` (absent in the context refiner).
    modulation: Option<Linear>,
}

impl Block {
    fn new(s: &mut Scope, cfg: &ZImageConfig, modulation: bool) -> Block {
        let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
        Block {
            attention: JointAttention::new(&mut s.sub("attention"), cfg),
            feed_forward: FeedForward::new(&mut s.sub("feed_forward"), h, cfg.ffn_hidden),
            attention_norm1: rms_norm(s, "attention_norm1", h, eps),
            attention_norm2: rms_norm(s, "attention_norm2", h, eps),
            ffn_norm1: rms_norm(s, "ffn_norm1", h, eps),
            ffn_norm2: rms_norm(s, "ffn_norm2", h, eps),
            modulation: modulation.then(|| Linear::new(s, "adaLN_modulation.0", h.min(ADALN_DIM), 4 * h, true)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>, t_emb: Option<T<'g>>) -> T<'g> {
        let mods = match (self.modulation, t_emb) {
            (Some(m), Some(t)) => Some(chunk(m.forward(g, t), 4, 0, true)),
            _ => None,
        };
        let residual = x;
        let mut h = self.attention_norm1.forward(g, x);
        if let Some(m) = &mods {
            h = scale_tokens(h, m[0]);
        }
        h = self.attention_norm2.forward(g, self.attention.forward(g, h, pe));
        if let Some(m) = &mods {
            h = h.mul(m[1].tanh());
        }
        let x = h.add(residual);
        let residual = x;
        let mut h = self.ffn_norm1.forward(g, x);
        if let Some(m) = &mods {
            h = scale_tokens(h, m[2]);
        }
        h = self.ffn_norm2.forward(g, self.feed_forward.forward(g, h));
        if let Some(m) = &mods {
            h = h.mul(m[3].tanh());
        }
        h.add(residual)
    }
}

#[derive(Clone, Copy, Debug)]
struct FinalLayer {
    norm: LayerNorm,
    linear: Linear,
    modulation: Linear,
}

impl FinalLayer {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, c: T<'g>) -> T<'g> {
        let scale = self.modulation.forward(g, c.silu());
        let x = scale_tokens(self.norm.forward(g, x), scale);
        self.linear.forward(g, x)
    }
}

/// A Z-Image transformer whose weights live in a `ParamStore`.
pub struct ZImageModel {
    pub config: ZImageConfig,
    x_embedder: Linear,
    t_embedder: MlpEmbedder,
    cap_norm: RmsNorm,
    cap_embedder: Linear,
    cap_pad_token: W,
    x_pad_token: W,
    noise_refiner: Vec<Block>,
    context_refiner: Vec<Block>,
    layers: Vec<Block>,
    final_layer: FinalLayer,
}

impl ZImageModel {
    pub fn new(s: &mut Scope, cfg: &ZImageConfig) -> ZImageModel {
        let (h, p) = (cfg.hidden_size, cfg.patch_size);
        let blocks = |s: &mut Scope, name: &str, modulation: bool| -> Vec<Block> {
            (0..if name == "layers" { cfg.num_layers } else { cfg.num_refiner_layers })
                .map(|i| Block::new(&mut s.sub(&format!("{name}.{i}")), cfg, modulation))
                .collect()
        };
        let x_embedder = Linear::new(s, "x_embedder", p * p * cfg.in_channels, h, true);
        let t_embedder = MlpEmbedder::new(s, "t_embedder", 256, h.min(1024), ADALN_DIM);
        let cap_norm = rms_norm(s, "cap_embedder.0", cfg.cap_feat_dim, cfg.norm_eps);
        let cap_embedder = Linear::new(s, "cap_embedder.1", cfg.cap_feat_dim, h, true);
        let cap_pad_token = s.tensor("cap_pad_token", F32, &[h]);
        let x_pad_token = s.tensor("x_pad_token", F32, &[h]);
        let noise_refiner = blocks(s, "noise_refiner", true);
        let context_refiner = blocks(s, "context_refiner", false);
        let layers = blocks(s, "layers", true);
        let mut fl = s.sub("final_layer");
        let final_layer = FinalLayer {
            norm: LayerNorm { weight: None, bias: None, eps: 1e-6 },
            linear: Linear::with_options(&mut fl, "linear", h, p * p * cfg.out_channels, true, true),
            modulation: Linear::new(&mut fl, "adaLN_modulation.1", h.min(ADALN_DIM), h, true),
        };
        ZImageModel {
            config: cfg.clone(),
            x_embedder,
            t_embedder,
            cap_norm,
            cap_embedder,
            cap_pad_token,
            x_pad_token,
            noise_refiner,
            context_refiner,
            layers,
            final_layer,
        }
    }

    /// `tokens` `[hidden, L, N]` followed by copies of `pad` up to a multiple of 32.
    fn pad_tokens<'g>(g: &'g Graph, tokens: T<'g>, pad: W) -> T<'g> {
        let [h, l, n, _] = tokens.ne();
        let extra = pad_to_multiple(l as usize, SEQ_MULTIPLE) as i64;
        if extra == 0 {
            return tokens;
        }
        tokens.concat(g.param(pad).repeat_4d([h, extra, n, 1]), 1)
    }

    /// One evaluation: the latent `x` `[W, H, C, 1]`, model timestep `t` `[1]`, LLM hidden
    /// states `context` `[cap_feat_dim, L, 1]`, the rotation table `pe` and the reference
    /// latents `refs` (`[W', H', C, 1]` each, appended as tokens) → `[W, H, C, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, pe: T<'g>, refs: &[T<'g>]) -> T<'g> {
        let p = self.config.patch_size;
        let [w, h, _, _] = x.ne();
        let mut img = pad_and_patchify(g, x, p, false);
        let n_img = img.ne()[1];
        for r in refs {
            img = img.concat(pad_and_patchify(g, *r, p, false), 1);
        }
        let t_emb = self.t_embedder.forward(g, timestep_embedding(t, 256, 10000, 1.0));
        let txt = self.cap_embedder.forward(g, self.cap_norm.forward(g, context));
        let img = self.x_embedder.forward(g, img);
        let mut txt = Self::pad_tokens(g, txt, self.cap_pad_token);
        let mut img = Self::pad_tokens(g, img, self.x_pad_token);
        let txt_len = txt.ne()[1];
        let slice = |t: T<'g>, dim: usize, from: i64, to: i64| {
            let mut ne = t.ne();
            let nb = t.nb();
            ne[dim] = to - from;
            t.view(&ne, &[nb[1], nb[2], nb[3]], from as usize * nb[dim]).cont()
        };
        let pe_len = pe.ne()[3];
        let (txt_pe, img_pe) = (slice(pe, 3, 0, txt_len), slice(pe, 3, txt_len, pe_len));
        for block in &self.context_refiner {
            txt = block.forward(g, txt, txt_pe, None);
        }
        for block in &self.noise_refiner {
            img = block.forward(g, img, img_pe, Some(t_emb));
        }
        let mut x = txt.concat(img, 1);
        for block in &self.layers {
            x = block.forward(g, x, pe, Some(t_emb));
        }
        let out = self.final_layer.forward(g, x, t_emb);
        let out = slice(out, 1, txt_len, txt_len + n_img);
        unpatchify_and_crop(out, h, w, p, false).scale(-1.0)
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor, refs: &[Tensor]) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.in_channels as usize;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Z-Image takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        ensure!(
            context.ne(0) as i64 == cfg.cap_feat_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "Z-Image's text context must be [{}, L, 1] (the LLM's width), got {:?}",
            cfg.cap_feat_dim,
            context.shape()
        );
        ensure!(cfg.out_channels == cfg.in_channels, "Z-Image with {} input and {} output channels", cfg.in_channels, cfg.out_channels);
        for r in refs {
            ensure!(
                r.shape().len() <= 4 && r.ne(2) == c && r.ne(3) == 1 && r.ne(0) > 0 && r.ne(1) > 0,
                "Z-Image reference latent must be [W, H, {c}, 1], got {:?}",
                r.shape()
            );
        }
        Ok(())
    }
}

/// A loaded Z-Image transformer.
pub type ZImage = Loaded<ZImageModel>;

impl DiffusionModel for Loaded<ZImageModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("Z-Image needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context, input.ref_latents)?;
        ensure!(input.timesteps.len() == 1, "Z-Image takes one timestep, got {}", input.timesteps.len());
        let cfg = &model.config;
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        let circular = (runner.options.circular_x, runner.options.circular_y);
        let p = cfg.patch_size as usize;
        let ref_tokens = input.ref_latents.iter().map(|r| r.ne(0).div_ceil(p) * r.ne(1).div_ceil(p)).sum();
        let pe = rope::zimage_pe(h, w, p, context.ne(1), ref_tokens, SEQ_MULTIPLE, cfg.theta, &cfg.axes_dim, circular);
        let axes_sum: usize = cfg.axes_dim.iter().sum();
        let pos_len = pe.len() / axes_sum / 2;
        let t = [1000.0 - input.timesteps[0]];
        runner.compute(|g| {
            let x = g.input(input.x);
            let t = g.input_f32(&t, &[1]);
            let ctx = g.input(context);
            let pe = g.input_f32(&pe, &[2, 2, axes_sum as i64 / 2, pos_len as i64]);
            let refs: Vec<T> = input.ref_latents.iter().map(|r| g.input(r)).collect();
            Ok(model.forward(g, x, t, ctx, pe, &refs))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ParamStore;
    use std::collections::HashMap;

    fn synthetic_types(h: i64) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let p = "model.diffusion_model.";
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("{p}{n}"), F32);
            shapes.insert(format!("{p}{n}"), s.to_vec());
        };
        add("x_embedder.weight", &[64, h]);
        add("cap_embedder.1.weight", &[64, h]);
        add("layers.0.attention.q_norm.weight", &[128]);
        add("layers.0.attention.qkv.weight", &[h, 3 * h]);
        add("layers.1.attention.qkv.weight", &[h, 3 * h]);
        add("noise_refiner.0.attention.qkv.weight", &[h, 3 * h]);
        add("context_refiner.0.attention.qkv.weight", &[h, 3 * h]);
        add("final_layer.linear.weight", &[h, 64]);
        (types, shapes)
    }

    #[test]
    fn config_from_weights() {
        let (types, shapes) = synthetic_types(256);
        let cfg = ZImageConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert_eq!((cfg.hidden_size, cfg.in_channels, cfg.out_channels, cfg.cap_feat_dim), (256, 16, 16, 64));
        assert_eq!((cfg.num_layers, cfg.num_refiner_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden), (2, 1, 2, 2, 768));
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        ZImageModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        assert!(names.contains(&"model.diffusion_model.context_refiner.0.attention.k_norm.weight"));
        assert!(!names.iter().any(|n| n.starts_with("model.diffusion_model.context_refiner.0.adaLN")));
        assert!(names.contains(&"model.diffusion_model.t_embedder.mlp.2.bias"));

        // The reference asserts in generation below 256; this build refuses the file.
        let (types, shapes) = synthetic_types(128);
        let narrow = ZImageConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert!(narrow.validate().unwrap_err().to_string().contains("narrower than 256"));
    }

    #[test]
    fn rotation_table_pads_text_and_image() {
        // 5 text tokens → 32, a 6×4 latent → 3×2 = 6 patches → 32.
        let axes = [32usize, 48, 48];
        let pe = rope::zimage_pe(4, 6, 2, 5, 0, SEQ_MULTIPLE, 256.0, &axes, (false, false));
        assert_eq!(pe.len(), 64 * 128 * 2);
        let row = |t: usize| &pe[t * 256..(t + 1) * 256];
        // Text token 0 has id (1, 0, 0): its first frequency of axis 0 rotates by 1 rad.
        assert!((row(0)[0] - 1f32.cos()).abs() < 1e-6);
        // Image padding tokens have id 0: identity rotations.
        assert_eq!(&row(63)[..4], &[1.0, -0.0, 0.0, 1.0]);
        // Seamless tiling changes the image tokens' rows and columns only (tokens 32..38).
        let circ = rope::zimage_pe(4, 6, 2, 5, 0, SEQ_MULTIPLE, 256.0, &axes, (true, true));
        assert_eq!(&circ[..32 * 256], &pe[..32 * 256]);
        assert_eq!(&circ[38 * 256..], &pe[38 * 256..]);
        assert_ne!(&circ[37 * 256..38 * 256], &pe[37 * 256..38 * 256]);
        // Reference tokens take the padding's ids: while image and references fit in the
        // image's padded length the table is the same, beyond it more id-0 rows follow.
        assert_eq!(rope::zimage_pe(4, 6, 2, 5, 26, SEQ_MULTIPLE, 256.0, &axes, (false, false)), pe);
        let long = rope::zimage_pe(4, 6, 2, 5, 30, SEQ_MULTIPLE, 256.0, &axes, (false, false));
        assert_eq!(long.len(), 96 * 128 * 2);
        assert_eq!(&long[..64 * 256], &pe[..]);
        assert_eq!(&long[95 * 256..95 * 256 + 4], &[1.0, -0.0, 0.0, 1.0]);
    }
}
