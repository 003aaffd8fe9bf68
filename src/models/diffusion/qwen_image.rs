//! Qwen-Image (and its Edit versions): the double-stream MMDiT of Alibaba's Qwen team, like
//! the reference's `qwen_image.hpp`.
//!
//! - Weights under `model.diffusion_model.` with the diffusers names: `img_in`, `txt_norm`
//!   (RMS norm of the LLM's hidden states) and `txt_in`, `time_text_embed.timestep_embedder`
//!   (`linear_1`, `linear_2`), `transformer_blocks.N.{img,txt}_{mod.1,norm1,norm2,mlp}` and
//!   `attn.{to_q,to_k,to_v,add_{q,k,v}_proj,norm_{q,k},norm_added_{q,k},to_out.0,to_add_out}`,
//!   then `norm_out.linear` (adaLN-continuous: scale before shift) and `proj_out`.
//! - The 16-channel latent is cut into 2×2 patches (reference latents appended as more
//!   tokens), text and image streams keep their own weights and attend jointly with 3-axis
//!   RoPE (θ 10000, axes 16/56/56, text ids on the diagonal after the image's centred ones).
//! - Some products see their input scaled down (undone after them) as in the reference,
//!   which keeps activations within f16 on GPUs: the attention's K and V by 1/128, the
//!   attention outputs' projections by 1/32, the MLPs' second layers by 1/128.
//! - Edit 2511 (`__index_timestep_zero__` in the file, or the `qwen_image_zero_cond_t` model
//!   arg) modulates the reference tokens with the embedding of timestep 0. Layered adds an
//!   `addition_t_embedding` to the timestep embedding (index 0 for every item).

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{Embedding, LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, T};
use crate::models::common::blocks::FeedForward;
use crate::models::common::dit::{chunk, modulate, pad_and_patchify, timestep_embedding, unpatchify_and_crop, MlpEmbedder, RmsNorm};
use crate::models::common::rope::{self, RefIndexMode};
use crate::tensor::Tensor;

/// The attention's K and V are scaled by this inside the fused kernel.
const KV_SCALE: f32 = 1.0 / 128.0;
/// The attention output projections see their input scaled by this.
const ATTN_OUT_SCALE: f32 = 1.0 / 32.0;
/// The MLPs' `net.2` sees its input scaled by this.
const FF_OUT_SCALE: f32 = 1.0 / 128.0;
const EPS: f32 = 1e-6;
/// Width of the sinusoidal timestep embedding.
const TIME_DIM: i64 = 256;

#[derive(Clone, Debug, PartialEq)]
pub struct QwenImageConfig {
    pub patch_size: i64,
    /// Channels of a patch token (latent channels × patch²).
    pub in_channels: i64,
    /// Latent channels of the output.
    pub out_channels: i64,
    pub num_layers: usize,
    pub hidden_size: i64,
    pub head_dim: i64,
    pub num_heads: i64,
    /// Width of the LLM's hidden states.
    pub joint_attention_dim: i64,
    pub theta: f32,
    pub axes_dim: Vec<usize>,
    /// Reference tokens are modulated with the embedding of timestep 0 (Edit 2511).
    pub zero_cond_t: bool,
    /// The timestep embedding gets `addition_t_embedding` added (Layered).
    pub use_additional_t_cond: bool,
    /// Mage-Flow: the timestep projection comes from the host (bf16-rounded) and positions
    /// follow [`super::mage_flow::ids`].
    pub mage_flow: bool,
}

/// Index of the block in a name like `…transformer_blocks.12.attn…`.
fn block_index(name: &str) -> Option<usize> {
    const MARKER: &str = "transformer_blocks.";
    let rest = &name[name.find(MARKER)? + MARKER.len()..];
    rest.split('.').next()?.parse().ok()
}

impl QwenImageConfig {
    /// The configuration of the network under `prefix`: blocks and the Edit-2511 marker like
    /// the reference, widths from the weights (Qwen-Image's own values when absent).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> QwenImageConfig {
        let p = 2;
        let mut cfg = QwenImageConfig {
            patch_size: p,
            in_channels: 64,
            out_channels: 16,
            num_layers: 0,
            hidden_size: 3072,
            head_dim: 128,
            num_heads: 24,
            joint_attention_dim: 3584,
            theta: 10000.0,
            axes_dim: vec![16, 56, 56],
            zero_cond_t: false,
            use_additional_t_cond: false,
            mage_flow: false,
        };
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            if name.contains("__index_timestep_zero__") {
                cfg.zero_cond_t = true;
            }
            if let Some(i) = block_index(name) {
                cfg.num_layers = cfg.num_layers.max(i + 1);
            }
            let leaf = &name[prefix.len()..];
            let matrix = || shape_of(name).filter(|s| s.len() == 2);
            match leaf {
                "img_in.weight" => {
                    if let Some(s) = matrix() {
                        cfg.in_channels = s[0];
                        cfg.hidden_size = s[1];
                    }
                }
                "txt_in.weight" => {
                    if let Some(s) = matrix() {
                        cfg.joint_attention_dim = s[0];
                    }
                }
                "proj_out.weight" => {
                    if let Some(s) = matrix() {
                        cfg.out_channels = s[1] / (p * p);
                    }
                }
                "transformer_blocks.0.attn.norm_q.weight" => {
                    if let Some(s) = shape_of(name).filter(|s| s.len() == 1) {
                        cfg.head_dim = s[0];
                    }
                }
                "time_text_embed.addition_t_embedding.weight" => cfg.use_additional_t_cond = true,
                _ => {}
            }
        }
        if cfg.head_dim > 0 {
            cfg.num_heads = cfg.hidden_size / cfg.head_dim;
        }
        sd_debug!("qwen_image: num_layers = {}, zero_cond_t = {}", cfg.num_layers, cfg.zero_cond_t);
        cfg
    }

    /// What the graphs need that the reference asserts while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.num_layers > 0, "no Qwen-Image transformer blocks found");
        ensure!(
            self.head_dim > 0 && self.num_heads * self.head_dim == self.hidden_size,
            "Qwen-Image DiT: {} heads of {} do not make the hidden size {}",
            self.num_heads,
            self.head_dim,
            self.hidden_size
        );
        let axes: usize = self.axes_dim.iter().sum();
        ensure!(axes as i64 == self.head_dim, "Qwen-Image DiT: RoPE axes cover {axes} of the head's {} dimensions", self.head_dim);
        let p2 = self.patch_size * self.patch_size;
        ensure!(
            self.in_channels == p2 * self.out_channels,
            "Qwen-Image DiT: img_in takes {} channels, proj_out gives {} latent channels in {}×{} patches",
            self.in_channels,
            self.out_channels,
            self.patch_size,
            self.patch_size
        );
        Ok(())
    }
}

fn rms_norm(s: &mut Scope, name: &str, dim: i64) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, EPS, true)
}

/// Joint attention: each stream's q/k/v (q and k RMS-normed per head), one attention over
/// text then image tokens, each stream's output projection.
#[derive(Clone, Copy, Debug)]
struct JointAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    add_q: Linear,
    add_k: Linear,
    add_v: Linear,
    norm_added_q: RmsNorm,
    norm_added_k: RmsNorm,
    to_out: Linear,
    to_add_out: Linear,
    head_dim: i64,
}

impl JointAttention {
    fn new(s: &mut Scope, cfg: &QwenImageConfig) -> JointAttention {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let out = |s: &mut Scope, name: &str| {
            let mut l = Linear::new(s, name, h, h, true);
            l.scale = ATTN_OUT_SCALE;
            l
        };
        JointAttention {
            to_q: Linear::new(s, "to_q", h, h, true),
            to_k: Linear::new(s, "to_k", h, h, true),
            to_v: Linear::new(s, "to_v", h, h, true),
            norm_q: rms_norm(s, "norm_q", d),
            norm_k: rms_norm(s, "norm_k", d),
            add_q: Linear::new(s, "add_q_proj", h, h, true),
            add_k: Linear::new(s, "add_k_proj", h, h, true),
            add_v: Linear::new(s, "add_v_proj", h, h, true),
            norm_added_q: rms_norm(s, "norm_added_q", d),
            norm_added_k: rms_norm(s, "norm_added_k", d),
            to_out: out(s, "to_out.0"),
            to_add_out: out(s, "to_add_out"),
            head_dim: d,
        }
    }

    /// img [hidden, L_img, N], txt [hidden, L_txt, N] → their attention outputs.
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, txt: T<'g>, pe: T<'g>) -> (T<'g>, T<'g>) {
        let heads = |t: T<'g>| {
            let [c, l, n, _] = t.ne();
            t.reshape(&[self.head_dim, c / self.head_dim, l, n])
        };
        let img_q = self.norm_q.forward(g, heads(self.to_q.forward(g, img)));
        let img_k = self.norm_k.forward(g, heads(self.to_k.forward(g, img)));
        let img_v = heads(self.to_v.forward(g, img));
        let txt_q = self.norm_added_q.forward(g, heads(self.add_q.forward(g, txt)));
        let txt_k = self.norm_added_k.forward(g, heads(self.add_k.forward(g, txt)));
        let txt_v = heads(self.add_v.forward(g, txt));
        let q = txt_q.concat(img_q, 2);
        let k = txt_k.concat(img_k, 2);
        let v = txt_v.concat(img_v, 2);
        let attn = rope::attention_scaled(g, q, k, v, pe, None, KV_SCALE);
        let [d, _, n, _] = attn.ne();
        let nb = attn.nb();
        let n_txt = txt.ne()[1];
        let txt_attn = attn.view(&[d, n_txt, n], &[nb[1], nb[2]], 0).cont();
        let img_attn = attn.view(&[d, img.ne()[1], n], &[nb[1], nb[2]], n_txt as usize * nb[1]).cont();
        (self.to_out.forward(g, img_attn), self.to_add_out.forward(g, txt_attn))
    }
}

/// The six modulations (shift, scale, gate of attention and MLP) of one stream.
type Mods<'g> = Vec<T<'g>>;

/// `lin(silu(t_emb))` cut into six `[hidden, N]` modulations; with a per-token `index`
/// (0: the image, 1: references; Edit 2511) `t_emb` holds two embeddings and each
/// modulation becomes `[hidden, tokens]`, the first embedding's where the index is 0.
fn modulations<'g>(g: &'g Graph, lin: &Linear, t_emb: T<'g>, index: Option<T<'g>>) -> Mods<'g> {
    let params = lin.forward(g, t_emb.silu());
    let Some(index) = index else {
        return chunk(params, 6, 0, true);
    };
    let params = params.reshape(&[params.ne().iter().product()]);
    let parts = chunk(params, 12, 0, true);
    let tokens = index.ne()[0];
    let index = index.reshape(&[1, tokens, 1]).repeat_4d([parts[0].ne()[0], tokens, 1, 1]);
    (0..6)
        .map(|i| {
            let (m0, m1) = (parts[i], parts[i + 6]);
            let m0 = m0.repeat(index).sub(index.mul(m0));
            m0.add(index.mul(m1))
        })
        .collect()
}

/// `x + x·scale + shift` with per-token modulations (`[C, L]`, [`modulations`] with an
/// index) or per-item ones (`[C, N]`).
fn modulate_tokens<'g>(x: T<'g>, shift: T<'g>, scale: T<'g>, per_token: bool) -> T<'g> {
    if per_token {
        x.add(x.mul(scale)).add(shift)
    } else {
        modulate(x, shift, scale)
    }
}

#[derive(Clone, Copy, Debug)]
struct Stream {
    modulation: Linear,
    norm1: LayerNorm,
    norm2: LayerNorm,
    mlp: FeedForward,
}

impl Stream {
    fn new(s: &mut Scope, kind: &str, h: i64) -> Stream {
        Stream {
            modulation: Linear::new(&mut s.sub(&format!("{kind}_mod")), "1", h, 6 * h, true),
            norm1: LayerNorm { weight: None, bias: None, eps: EPS },
            norm2: LayerNorm { weight: None, bias: None, eps: EPS },
            mlp: FeedForward::gelu(&mut s.sub(&format!("{kind}_mlp")), h, h, 4, FF_OUT_SCALE),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    img: Stream,
    txt: Stream,
    attn: JointAttention,
}

impl Block {
    fn new(s: &mut Scope, cfg: &QwenImageConfig) -> Block {
        let h = cfg.hidden_size;
        Block { img: Stream::new(s, "img", h), txt: Stream::new(s, "txt", h), attn: JointAttention::new(&mut s.sub("attn"), cfg) }
    }

    /// `t_emb` `[hidden, N]` (with `index`: `[hidden, 2]`, the second for timestep 0).
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, txt: T<'g>, t_emb: T<'g>, pe: T<'g>, index: Option<T<'g>>) -> (T<'g>, T<'g>) {
        let per_token = index.is_some();
        let im = modulations(g, &self.img.modulation, t_emb, index);
        let t_txt = if per_token { chunk(t_emb, 2, 1, true)[0] } else { t_emb };
        let tm = modulations(g, &self.txt.modulation, t_txt, None);

        let img_in = modulate_tokens(self.img.norm1.forward(g, img), im[0], im[1], per_token);
        let txt_in = modulate(self.txt.norm1.forward(g, txt), tm[0], tm[1]);
        let (img_attn, txt_attn) = self.attn.forward(g, img_in, txt_in, pe);
        let img = img.add(img_attn.mul(im[2]));
        let txt = txt.add(txt_attn.mul(tm[2]));

        let img_in = modulate_tokens(self.img.norm2.forward(g, img), im[3], im[4], per_token);
        let txt_in = modulate(self.txt.norm2.forward(g, txt), tm[3], tm[4]);
        let img = img.add(self.img.mlp.forward(g, img_in).mul(im[5]));
        let txt = txt.add(self.txt.mlp.forward(g, txt_in).mul(tm[5]));
        (img, txt)
    }
}

/// A Qwen-Image transformer whose weights live in a `ParamStore`.
pub struct QwenImageModel {
    pub config: QwenImageConfig,
    timestep_embedder: MlpEmbedder,
    addition_t_embedding: Option<Embedding>,
    txt_norm: RmsNorm,
    img_in: Linear,
    txt_in: Linear,
    blocks: Vec<Block>,
    norm_out: Linear,
    proj_out: Linear,
}

impl QwenImageModel {
    pub fn new(s: &mut Scope, cfg: &QwenImageConfig) -> QwenImageModel {
        let h = cfg.hidden_size;
        let p = cfg.patch_size;
        let mut tte = s.sub("time_text_embed");
        let timestep_embedder = MlpEmbedder::with_layers(&mut tte, "timestep_embedder", ["linear_1", "linear_2"], TIME_DIM, h, h, false);
        let addition_t_embedding = cfg.use_additional_t_cond.then(|| Embedding::new(&mut tte, "addition_t_embedding", 2, h));
        QwenImageModel {
            config: cfg.clone(),
            timestep_embedder,
            addition_t_embedding,
            txt_norm: rms_norm(s, "txt_norm", cfg.joint_attention_dim),
            img_in: Linear::new(s, "img_in", cfg.in_channels, h, true),
            txt_in: Linear::new(s, "txt_in", cfg.joint_attention_dim, h, true),
            blocks: (0..cfg.num_layers).map(|i| Block::new(&mut s.sub(&format!("transformer_blocks.{i}")), cfg)).collect(),
            norm_out: Linear::new(&mut s.sub("norm_out"), "linear", h, 2 * h, true),
            proj_out: Linear::new(s, "proj_out", h, p * p * cfg.out_channels, true),
        }
    }

    /// The timestep embedding `[hidden, N]` of `t` `[N]` (plus Layered's addition); for
    /// Mage-Flow `t` is already the projection `[256, N]`.
    fn time_embedding<'g>(&self, g: &'g Graph, t: T<'g>, addition: Option<T<'g>>) -> T<'g> {
        let proj = if self.config.mage_flow { t } else { timestep_embedding(t, TIME_DIM as i32, 10000, 1.0) };
        let emb = self.timestep_embedder.forward(g, proj);
        match (&self.addition_t_embedding, addition) {
            (Some(e), Some(ids)) => {
                let a = e.forward(g, ids);
                emb.add(a.reshape(&[a.ne()[0], a.ne()[1] * a.ne()[2]]))
            }
            _ => emb,
        }
    }

    /// One evaluation: the latent `x` `[W, H, C, 1]` (with `layered`: a stack `[W, H, T, C]`
    /// whose layers become consecutive runs of tokens, as the reference's 3-D patchify with
    /// one frame per patch orders them), timestep `t` `[1]` (Mage-Flow: its projection
    /// `[256, 1]`), the LLM's hidden states `context` `[joint_dim, L, 1]`, the rotation table
    /// `pe`, reference latents appended as tokens, Edit 2511's per-token `index` and
    /// Layered's `addition` ids.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(
        &self,
        g: &'g Graph,
        x: T<'g>,
        t: T<'g>,
        context: T<'g>,
        pe: T<'g>,
        refs: &[T<'g>],
        index: Option<T<'g>>,
        addition: Option<T<'g>>,
        layered: bool,
    ) -> T<'g> {
        let p = self.config.patch_size;
        let [w, h, _, _] = x.ne();
        // The layers as a batch of images: their token runs follow one another.
        let x = if layered { x.permute(0, 1, 3, 2).cont() } else { x };
        let mut img = pad_and_patchify(g, x, p, true);
        let [d, l, layers, _] = img.ne();
        img = img.reshape(&[d, l * layers, 1]);
        let img_tokens = img.ne()[1];
        for r in refs {
            img = img.concat(pad_and_patchify(g, *r, p, true), 1);
        }
        let mut t_emb = self.time_embedding(g, t, addition);
        if self.config.zero_cond_t {
            let zero = self.time_embedding(g, t.scale(0.0), addition);
            t_emb = t_emb.concat(zero, 1);
        }
        let mut img = self.img_in.forward(g, img);
        let mut txt = self.txt_in.forward(g, self.txt_norm.forward(g, context));
        let index = index.filter(|_| self.config.zero_cond_t);
        for block in &self.blocks {
            (img, txt) = block.forward(g, img, txt, t_emb, pe, index);
        }
        if self.config.zero_cond_t {
            t_emb = chunk(t_emb, 2, 1, true)[0];
        }
        let emb = self.norm_out.forward(g, t_emb.silu());
        let mods = chunk(emb, 2, 0, true);
        let img = modulate(img.norm(EPS), mods[1], mods[0]);
        let mut out = self.proj_out.forward(g, img);
        if out.ne()[1] > img_tokens {
            let nb = out.nb();
            let ne = out.ne();
            out = out.view(&[ne[0], img_tokens, ne[2]], &[nb[1], nb[2]], 0).cont();
        }
        let out = unpatchify_and_crop(out.reshape(&[out.ne()[0], l, layers]), h, w, p, true);
        if layered {
            out.permute(0, 1, 3, 2).cont()
        } else {
            out
        }
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor, refs: &[Tensor]) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.out_channels as usize;
        if x.shape().len() == 5 {
            ensure!(
                x.ne(3) == c && x.ne(4) == 1 && x.ne(2) > 0 && x.ne(0) > 0 && x.ne(1) > 0,
                "Qwen-Image takes a stack of layers [W, H, T, {c}, 1], got {:?}",
                x.shape()
            );
        } else {
            ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Qwen-Image takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        }
        ensure!(
            context.ne(0) as i64 == cfg.joint_attention_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "Qwen-Image's text context must be [{}, L, 1] (the LLM's width), got {:?}",
            cfg.joint_attention_dim,
            context.shape()
        );
        for r in refs {
            ensure!(r.ne(2) == c && r.ne(3) == 1 && r.ne(0) > 0 && r.ne(1) > 0, "Qwen-Image reference latent must be [W, H, {c}, 1], got {:?}", r.shape());
        }
        Ok(())
    }
}

/// Tokens per side of `len` latent pixels in patches of `p` (padded up).
fn patches(len: usize, p: usize) -> usize {
    len.div_ceil(p)
}

/// Edit 2511's per-token modulation index: 0 for the image's tokens, 1 for the references'.
fn modulation_index(w: usize, h: usize, refs: &[(usize, usize)], p: usize) -> Vec<f32> {
    let mut index = vec![0.0; patches(h, p) * patches(w, p)];
    for &(rh, rw) in refs {
        index.extend(std::iter::repeat_n(1.0, patches(rh, p) * patches(rw, p)));
    }
    index
}

/// A loaded Qwen-Image transformer.
pub type QwenImage = Loaded<QwenImageModel>;

impl DiffusionModel for Loaded<QwenImageModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("Qwen-Image needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context, input.ref_latents)?;
        ensure!(input.timesteps.len() == 1, "Qwen-Image takes one timestep, got {}", input.timesteps.len());
        let cfg = &model.config;
        let p = cfg.patch_size as usize;
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        // A 5-D latent is a stack of layers [W, H, T, C, 1] (Qwen-Image-Layered).
        let layered = input.x.shape().len() == 5;
        let frames = if layered { input.x.ne(2) } else { 1 };
        let refs: Vec<(usize, usize)> = input.ref_latents.iter().map(|r| (r.ne(1), r.ne(0))).collect();
        // Layered numbers its references downwards whatever the request says.
        let mode = if cfg.use_additional_t_cond { RefIndexMode::Decrease } else { input.ref_index_mode };
        let circular = (runner.options.circular_x, runner.options.circular_y);
        let pe = if cfg.mage_flow {
            super::mage_flow::pe(h, w, context.ne(1), &refs, cfg)
        } else {
            rope::qwen_image_pe(frames, h, w, p, context.ne(1), &refs, mode, cfg.theta, &cfg.axes_dim, circular)
        };
        let axes_sum: usize = cfg.axes_dim.iter().sum();
        let pos_len = pe.len() / axes_sum / 2;
        let index = cfg.zero_cond_t.then(|| modulation_index(w, h, &refs, p));
        let (t, t_ne) = if cfg.mage_flow {
            (super::mage_flow::timestep_projection(input.timesteps), vec![super::mage_flow::TIMESTEP_DIM as i64, 1])
        } else {
            (input.timesteps.to_vec(), vec![1])
        };
        let x_ne: Vec<i64> = input.x.shape().iter().take(4).map(|&v| v as i64).collect();
        let out = runner.compute(|g| {
            let refs: Vec<T> = input.ref_latents.iter().map(|r| g.input(r)).collect();
            let index = index.as_ref().map(|i| g.input_f32(i, &[i.len() as i64]));
            let addition = cfg.use_additional_t_cond.then(|| g.input_i32(&[0], &[1, 1]));
            Ok(model.forward(
                g,
                g.input_f32(input.x.data(), &x_ne),
                g.input_f32(&t, &t_ne),
                g.input(context),
                g.input_f32(&pe, &[2, 2, axes_sum as i64 / 2, pos_len as i64]),
                &refs,
                index,
                addition,
                layered,
            ))
        })?;
        out.reshape(input.x.shape())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ParamStore, F16, F32};
    use std::collections::HashMap;

    fn synthetic_types(extra: &[&str]) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let p = "model.diffusion_model.";
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("{p}{n}"), if s.len() == 2 { F16 } else { F32 });
            shapes.insert(format!("{p}{n}"), s.to_vec());
        };
        add("img_in.weight", &[64, 3072]);
        add("txt_in.weight", &[3584, 3072]);
        add("proj_out.weight", &[3072, 64]);
        add("transformer_blocks.0.attn.norm_q.weight", &[128]);
        add("transformer_blocks.1.img_mod.1.weight", &[3072, 18432]);
        for n in extra {
            add(n, &[1]);
        }
        (types, shapes)
    }

    #[test]
    fn config_from_weights() {
        let (types, shapes) = synthetic_types(&[]);
        let cfg = QwenImageConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.in_channels, cfg.out_channels), (2, 3072, 24, 64, 16));
        assert!(!cfg.zero_cond_t && !cfg.use_additional_t_cond);
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        QwenImageModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in [
            "time_text_embed.timestep_embedder.linear_2.bias",
            "transformer_blocks.1.attn.to_add_out.weight",
            "transformer_blocks.0.txt_mlp.net.0.proj.weight",
            "transformer_blocks.0.attn.norm_added_k.weight",
            "norm_out.linear.weight",
        ] {
            assert!(names.contains(&format!("model.diffusion_model.{n}").as_str()), "{n}");
        }
        assert_eq!(store.len(), 13 + 2 * 32);

        let (types, shapes) = synthetic_types(&["__index_timestep_zero__", "time_text_embed.addition_t_embedding.weight"]);
        let cfg = QwenImageConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert!(cfg.zero_cond_t && cfg.use_additional_t_cond);
        let empty = QwenImageConfig::detect(&TypeMap::new(), &|_| None, "model.diffusion_model.");
        assert!(empty.validate().unwrap_err().to_string().contains("no Qwen-Image transformer blocks"));
    }

    /// A 1-block DiT of width 256 with f32 weights (deterministic pattern).
    fn tiny(zero_cond_t: bool) -> (ParamStore, QwenImageModel) {
        let cfg = QwenImageConfig {
            num_layers: 1,
            hidden_size: 256,
            num_heads: 2,
            joint_attention_dim: 64,
            zero_cond_t,
            ..QwenImageConfig::detect(&TypeMap::new(), &|_| None, "")
        };
        let mut store = ParamStore::new(256).unwrap();
        let model = QwenImageModel::new(&mut Scope::new(&mut store, &TypeMap::new(), ""), &cfg);
        store.alloc(&crate::graph::Backend::cpu().unwrap()).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let seed = name.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
                let v: Vec<f32> = crate::testutil::pattern(n, seed).iter().map(|x| x * 0.1).collect();
                dst.copy_from_slice(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                Ok(())
            })
            .unwrap();
        (store, model)
    }

    /// Edit 2511's per-token modulation: without references every token takes the
    /// modulation of the real timestep, so the output is the plain model's bit for bit;
    /// with a reference the image tokens change (they attend to it) but stay finite.
    #[test]
    fn zero_timestep_modulation_matches_the_plain_model_without_references() {
        let (_s1, plain) = tiny(false);
        let (_s2, zero) = tiny(true);
        let x = crate::testutil::pattern(4 * 4 * 16, 3);
        let ctx = crate::testutil::pattern(64 * 5, 4);
        let refs = [Tensor::from_vec(&[2, 2, 16, 1], crate::testutil::pattern(64, 5)).unwrap()];
        let run = |m: &QwenImageModel, refs: &[Tensor]| {
            let sizes: Vec<(usize, usize)> = refs.iter().map(|r| (r.ne(1), r.ne(0))).collect();
            let pe = rope::qwen_image_pe(1, 4, 4, 2, 5, &sizes, RefIndexMode::Increase, 10000.0, &m.config.axes_dim, (false, false));
            let index = modulation_index(4, 4, &sizes, 2);
            let mut runner = crate::graph::Runner::new(std::sync::Arc::new(crate::graph::Backend::cpu().unwrap()), 1);
            runner
                .compute(|g| {
                    let refs: Vec<T> = refs.iter().map(|r| g.input(r)).collect();
                    let index = m.config.zero_cond_t.then(|| g.input_f32(&index, &[index.len() as i64]));
                    let pe = g.input_f32(&pe, &[2, 2, 64, (pe.len() / 256) as i64]);
                    Ok(m.forward(g, g.input_f32(&x, &[4, 4, 16, 1]), g.input_f32(&[500.0], &[1]), g.input_f32(&ctx, &[64, 5, 1]), pe, &refs, index, None, false))
                })
                .unwrap()
        };
        let a = run(&plain, &[]);
        assert_eq!(a.shape(), &[4, 4, 16, 1]);
        assert_eq!(a, run(&zero, &[]));
        let with_ref = run(&zero, &refs);
        assert!(with_ref.data().iter().all(|v| v.is_finite()) && with_ref != a);
    }

    /// Layered: a stack of one layer is the plain image bit for bit (same tokens, same
    /// positions); with two layers both layers' tokens attend to each other and the output
    /// keeps the stack's shape.
    #[test]
    fn a_stack_of_layers_runs_as_consecutive_token_runs() {
        let (_s, m) = tiny(false);
        let ctx = crate::testutil::pattern(64 * 5, 4);
        let run = |x: &[f32], ne: [i64; 4], frames: usize, layered: bool| {
            let pe = rope::qwen_image_pe(frames, 4, 4, 2, 5, &[], RefIndexMode::Decrease, 10000.0, &m.config.axes_dim, (false, false));
            let mut runner = crate::graph::Runner::new(std::sync::Arc::new(crate::graph::Backend::cpu().unwrap()), 1);
            runner
                .compute(|g| {
                    let pe = g.input_f32(&pe, &[2, 2, 64, (pe.len() / 256) as i64]);
                    Ok(m.forward(g, g.input_f32(x, &ne), g.input_f32(&[500.0], &[1]), g.input_f32(&ctx, &[64, 5, 1]), pe, &[], None, None, layered))
                })
                .unwrap()
        };
        let one = crate::testutil::pattern(4 * 4 * 16, 3);
        let plain = run(&one, [4, 4, 16, 1], 1, false);
        assert_eq!(run(&one, [4, 4, 1, 16], 1, true).data(), plain.data());
        let two = crate::testutil::pattern(4 * 4 * 2 * 16, 6);
        let stack = run(&two, [4, 4, 2, 16], 2, true);
        assert_eq!(stack.shape(), &[4, 4, 2, 16]);
        assert!(stack.data().iter().all(|v| v.is_finite()));
        // Layer 0 alone differs from layer 0 in the stack: the layers see each other.
        let layer0: Vec<f32> = (0..16).flat_map(|c| two[c * 32..c * 32 + 16].to_vec()).collect();
        let alone = run(&layer0, [4, 4, 16, 1], 1, false);
        let in_stack: Vec<f32> = (0..16).flat_map(|c| stack.data()[c * 32..c * 32 + 16].to_vec()).collect();
        assert_ne!(alone.data(), &in_stack[..]);
    }

    #[test]
    fn modulation_index_marks_reference_tokens() {
        // A 5×4 latent: 3×2 patches (padded up); one 2×2 reference: one patch.
        assert_eq!(modulation_index(5, 4, &[(2, 2)], 2), vec![0., 0., 0., 0., 0., 0., 1.]);
    }
}
