//! Boogu Image: a Lumina-style DiT (the reference's `boogu.hpp`) on Flux.1's 16-channel
//! latents, conditioned by the final hidden states of Qwen3-VL's text model.
//!
//! - Weights under `model.diffusion_model.` with the original names: `x_embedder` and
//!   `ref_image_patch_embedder` (2×2 patches), `image_index_embedding` (5 rows, one per
//!   reference image, the fifth shared by the rest), `time_caption_embed.{timestep_embedder,
//!   caption_embedder}`, `context_refiner.N` (text, no modulation), `noise_refiner.N`
//!   (image), `ref_image_refiner.N` (reference images), `double_stream_layers.N` (text and
//!   image each with their own projections in one joint attention, plus the image's own
//!   self-attention), `single_stream_layers.N` (joint) and `norm_out`.
//! - Attention has fewer K/V heads than query heads (grouped), RMS-normed q and k, no
//!   biases; blocks are sandwich-normed and modulated by `tanh` gates of the timestep
//!   embedding (`min(hidden, 1024)` wide); the feed-forward is SwiGLU of 4 × hidden rounded
//!   up to a multiple of 256.
//! - RoPE over three axes: text token i at `(i, i, i)`, each reference image at
//!   `(shift, row, col)` with `shift` starting after the text and moving on by the longer
//!   side of each reference, then the image (see [`boogu_pe`]).
//! - The model timestep is `1 - t / 1000` (embedded × 1000) and the output is negated,
//!   both here, so the sampling loop sees a plain flow model.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{block_index, chunk, pad_and_patchify, scale_tokens, timestep_embedding, unpatchify_and_crop, MlpEmbedder, RmsNorm};
use crate::models::common::rope::{self, Ids};
use crate::tensor::Tensor;

/// Width of the sinusoidal timestep embedding.
const FREQ_DIM: i32 = 256;
/// The timestep embedding and the modulations' input are at most this wide.
const MAX_TEMB_DIM: i64 = 1024;
/// Rows of `image_index_embedding`: references past the fifth share its last row.
const IMAGE_INDEXES: usize = 5;
/// The feed-forward's inner width is rounded up to a multiple of this.
const MULTIPLE_OF: i64 = 256;

#[derive(Clone, Debug, PartialEq)]
pub struct BooguConfig {
    pub patch_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub hidden_size: i64,
    pub num_layers: usize,
    pub num_double_layers: usize,
    pub num_refiner_layers: usize,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    /// Width of the LLM hidden states (`caption_embedder`'s input).
    pub caption_dim: i64,
    pub temb_dim: i64,
    pub ffn_hidden: i64,
    pub norm_eps: f32,
    pub theta: f32,
    pub axes_dim: Vec<usize>,
}

impl BooguConfig {
    /// The configuration of the network under `prefix`, read from the weights like the
    /// reference (widths, channels, block counts, heads from the q-norm and k widths); what
    /// is missing keeps the released model's value.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> BooguConfig {
        let p = 2;
        let mut cfg = BooguConfig {
            patch_size: p,
            in_channels: 16,
            out_channels: 16,
            hidden_size: 3360,
            num_layers: 32,
            num_double_layers: 8,
            num_refiner_layers: 2,
            num_heads: 28,
            num_kv_heads: 7,
            head_dim: 120,
            caption_dim: 4096,
            temb_dim: 1024,
            ffn_hidden: 0,
            norm_eps: 1e-5,
            theta: 10000.0,
            axes_dim: vec![40, 40, 40],
        };
        let (mut head_dim, mut kv_dim) = (0, 0);
        let (mut singles, mut doubles, mut refiners) = (0, 0, 0);
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            let matrix = || shape_of(name).filter(|s| s.len() == 2);
            let vector = || shape_of(name).filter(|s| s.len() == 1);
            if name.ends_with("x_embedder.weight") {
                if let Some(s) = matrix() {
                    cfg.in_channels = s[0] / (p * p);
                    cfg.hidden_size = s[1];
                }
            } else if name.ends_with("time_caption_embed.caption_embedder.1.weight") {
                if let Some(s) = matrix() {
                    cfg.caption_dim = s[0];
                    cfg.hidden_size = s[1];
                }
            } else if name.ends_with("single_stream_layers.0.attn.norm_q.weight") || name.ends_with("double_stream_layers.0.img_self_attn.norm_q.weight") {
                if let Some(s) = vector() {
                    head_dim = s[0];
                }
            } else if name.ends_with("single_stream_layers.0.attn.to_k.weight") || name.ends_with("double_stream_layers.0.img_instruct_attn.processor.img_to_k.weight") {
                if let Some(s) = matrix() {
                    kv_dim = s[1];
                }
            } else if name.ends_with("norm_out.linear_2.weight") {
                if let Some(s) = matrix() {
                    cfg.out_channels = s[1] / (p * p);
                }
            }
            let rest = &name[prefix.len()..];
            let count = |n: &mut usize, marker: &str| {
                if let Some(i) = block_index(rest, marker) {
                    *n = (*n).max(i + 1);
                }
            };
            count(&mut singles, "single_stream_layers.");
            count(&mut doubles, "double_stream_layers.");
            for marker in ["noise_refiner.", "ref_image_refiner.", "context_refiner."] {
                count(&mut refiners, marker);
            }
        }
        cfg.num_layers = singles.max(1);
        cfg.num_double_layers = doubles;
        cfg.num_refiner_layers = refiners.max(1);
        if head_dim > 0 {
            cfg.head_dim = head_dim;
            cfg.num_heads = cfg.hidden_size / head_dim;
            if kv_dim > 0 {
                cfg.num_kv_heads = kv_dim / head_dim;
            }
            // The reference keeps its 40-wide axes when the head does not split in three.
            if head_dim % 3 == 0 {
                cfg.axes_dim = vec![(head_dim / 3) as usize; 3];
            }
        }
        cfg.temb_dim = cfg.hidden_size.min(MAX_TEMB_DIM);
        cfg.ffn_hidden = (4 * cfg.hidden_size + MULTIPLE_OF - 1) / MULTIPLE_OF * MULTIPLE_OF;
        sd_debug!(
            "boogu_image: layers={}, double_stream_layers={}, refiner_layers={}, hidden={}, heads={}, kv_heads={}, head_dim={}, in_channels={}, out_channels={}",
            cfg.num_layers,
            cfg.num_double_layers,
            cfg.num_refiner_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.in_channels,
            cfg.out_channels
        );
        cfg
    }

    /// What the graphs need that the reference asserts (or miscomputes) while generating.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.head_dim > 0 && self.num_heads > 0 && self.num_heads * self.head_dim == self.hidden_size,
            "Boogu Image DiT: {} heads of {} do not make the hidden size {}",
            self.num_heads,
            self.head_dim,
            self.hidden_size
        );
        ensure!(
            self.num_kv_heads > 0 && self.num_heads % self.num_kv_heads == 0,
            "Boogu Image DiT: {} key/value heads do not divide its {} query heads",
            self.num_kv_heads,
            self.num_heads
        );
        let axes: usize = self.axes_dim.iter().sum();
        ensure!(
            axes as i64 == self.head_dim && self.axes_dim.iter().all(|a| a % 2 == 0),
            "Boogu Image DiT: heads of {} cannot be split into its three even RoPE axes ({:?})",
            self.head_dim,
            self.axes_dim
        );
        ensure!(self.in_channels == self.out_channels, "Boogu Image DiT with {} input and {} output channels", self.in_channels, self.out_channels);
        Ok(())
    }
}

/// `residual + x · tanh(gate)`, `gate` `[C, N]` broadcast over the tokens.
fn gate_residual<'g>(residual: T<'g>, x: T<'g>, gate: T<'g>) -> T<'g> {
    let gate = gate.tanh();
    let ne = gate.ne();
    residual.add(x.mul(gate.reshape(&[ne[0], 1, ne[1]])))
}

/// Tokens `from..to` of `x` along `dim`, made dense (as the reference slices: a length-1
/// axis is returned as it is).
fn slice<'g>(x: T<'g>, dim: usize, from: i64, to: i64) -> T<'g> {
    let mut ne = x.ne();
    if ne[dim] == 1 {
        return x;
    }
    let nb = x.nb();
    ne[dim] = to - from;
    x.view(&ne, &[nb[1], nb[2], nb[3]], from as usize * nb[dim]).cont()
}

fn rms_norm(s: &mut Scope, name: &str, dim: i64, eps: f32) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, eps, true)
}

/// RMS norm, then `x · (1 + scale)` with the first of four modulations of the timestep
/// embedding; the other three (gate, MLP scale, MLP gate) are returned with it.
#[derive(Clone, Copy, Debug)]
struct NormZero {
    linear: Linear,
    norm: RmsNorm,
}

impl NormZero {
    fn new(s: &mut Scope, name: &str, cfg: &BooguConfig) -> NormZero {
        let mut s = s.sub(name);
        let h = cfg.hidden_size;
        NormZero { linear: Linear::new(&mut s, "linear", cfg.temb_dim, 4 * h, true), norm: rms_norm(&mut s, "norm", h, cfg.norm_eps) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, temb: T<'g>) -> (T<'g>, [T<'g>; 3]) {
        let mods = chunk(self.linear.forward(g, temb.silu()), 4, 0, true);
        (scale_tokens(self.norm.forward(g, x), mods[0]), [mods[1], mods[2], mods[3]])
    }
}

/// w2(silu(w1 x) · w3 x).
#[derive(Clone, Copy, Debug)]
struct FeedForward {
    linear_1: Linear,
    linear_2: Linear,
    linear_3: Linear,
}

impl FeedForward {
    fn new(s: &mut Scope, name: &str, cfg: &BooguConfig) -> FeedForward {
        let mut s = s.sub(name);
        let (h, f) = (cfg.hidden_size, cfg.ffn_hidden);
        FeedForward {
            linear_1: Linear::new(&mut s, "linear_1", h, f, false),
            linear_2: Linear::new(&mut s, "linear_2", f, h, false),
            linear_3: Linear::new(&mut s, "linear_3", h, f, false),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.linear_1.forward(g, x).swiglu_split(self.linear_3.forward(g, x));
        self.linear_2.forward(g, h)
    }
}

/// The heads of one attention: query, key/value counts and width.
#[derive(Clone, Copy, Debug)]
struct Heads {
    heads: i64,
    kv_heads: i64,
    dim: i64,
}

impl Heads {
    fn of(cfg: &BooguConfig) -> Heads {
        Heads { heads: cfg.num_heads, kv_heads: cfg.num_kv_heads, dim: cfg.head_dim }
    }

    /// `[heads · dim, L, N]` → `[dim, heads, L, N]` (`kv`: the key/value head count).
    fn split<'g>(&self, x: T<'g>, kv: bool) -> T<'g> {
        let [_, l, n, _] = x.ne();
        x.reshape(&[self.dim, if kv { self.kv_heads } else { self.heads }, l, n])
    }
}

/// Projections of one token stream: q, k, v.
#[derive(Clone, Copy, Debug)]
struct Qkv {
    q: Linear,
    k: Linear,
    v: Linear,
}

impl Qkv {
    fn new(s: &mut Scope, names: [&str; 3], cfg: &BooguConfig) -> Qkv {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Qkv {
            q: Linear::new(s, names[0], h, cfg.num_heads * d, false),
            k: Linear::new(s, names[1], h, cfg.num_kv_heads * d, false),
            v: Linear::new(s, names[2], h, cfg.num_kv_heads * d, false),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, heads: Heads) -> [T<'g>; 3] {
        [heads.split(self.q.forward(g, x), false), heads.split(self.k.forward(g, x), true), heads.split(self.v.forward(g, x), true)]
    }
}

/// Self-attention with q/k norms (`to_q`, `to_k`, `to_v`, `to_out.0`).
#[derive(Clone, Copy, Debug)]
struct Attention {
    qkv: Qkv,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    to_out: Linear,
    heads: Heads,
}

impl Attention {
    fn new(s: &mut Scope, name: &str, cfg: &BooguConfig) -> Attention {
        let mut s = s.sub(name);
        let d = cfg.head_dim;
        Attention {
            qkv: Qkv::new(&mut s, ["to_q", "to_k", "to_v"], cfg),
            norm_q: rms_norm(&mut s, "norm_q", d, 1e-5),
            norm_k: rms_norm(&mut s, "norm_k", d, 1e-5),
            to_out: Linear::new(&mut s, "to_out.0", cfg.num_heads * d, cfg.hidden_size, false),
            heads: Heads::of(cfg),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [q, k, v] = self.qkv.forward(g, x, self.heads);
        let out = rope::attention(g, self.norm_q.forward(g, q), self.norm_k.forward(g, k), v, pe, None);
        self.to_out.forward(g, out)
    }
}

/// The double-stream blocks' joint attention: text ("instruct") and image tokens through
/// their own projections, attended together, each through its own output projection and
/// then the shared `to_out.0`.
#[derive(Clone, Copy, Debug)]
struct JointAttention {
    img: Qkv,
    instruct: Qkv,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    img_out: Linear,
    instruct_out: Linear,
    to_out: Linear,
    heads: Heads,
}

impl JointAttention {
    fn new(s: &mut Scope, name: &str, cfg: &BooguConfig) -> JointAttention {
        let mut s = s.sub(name);
        let (h, d, inner) = (cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim);
        let norm_q = rms_norm(&mut s, "norm_q", d, 1e-5);
        let norm_k = rms_norm(&mut s, "norm_k", d, 1e-5);
        let to_out = Linear::new(&mut s, "to_out.0", inner, h, false);
        let mut p = s.sub("processor");
        JointAttention {
            img: Qkv::new(&mut p, ["img_to_q", "img_to_k", "img_to_v"], cfg),
            instruct: Qkv::new(&mut p, ["instruct_to_q", "instruct_to_k", "instruct_to_v"], cfg),
            instruct_out: Linear::new(&mut p, "instruct_out", inner, h, false),
            img_out: Linear::new(&mut p, "img_out", inner, h, false),
            norm_q,
            norm_k,
            to_out,
            heads: Heads::of(cfg),
        }
    }

    /// `img` `[hidden, Li, N]`, `instruct` `[hidden, Lt, N]`, `pe` over text then image →
    /// `[hidden, Lt + Li, N]` (text first).
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, instruct: T<'g>, pe: T<'g>) -> T<'g> {
        let (l_img, l_txt) = (img.ne()[1], instruct.ne()[1]);
        let [iq, ik, iv] = self.img.forward(g, img, self.heads);
        let [tq, tk, tv] = self.instruct.forward(g, instruct, self.heads);
        let q = self.norm_q.forward(g, tq.concat(iq, 2));
        let k = self.norm_k.forward(g, tk.concat(ik, 2));
        let h = rope::attention(g, q, k, tv.concat(iv, 2), pe, None);
        let txt = self.instruct_out.forward(g, slice(h, 1, 0, l_txt));
        let img = self.img_out.forward(g, slice(h, 1, l_txt, l_txt + l_img));
        self.to_out.forward(g, txt.concat(img, 1))
    }
}

/// A block's first norm: modulated by the timestep embedding, or not (the context refiner).
#[derive(Clone, Copy, Debug)]
enum Norm1 {
    Plain(RmsNorm),
    Modulated(NormZero),
}

/// The refiners' and single-stream layers' block: sandwich-normed attention and
/// feed-forward, gated by the timestep embedding when `norm1` modulates.
#[derive(Clone, Copy, Debug)]
struct Block {
    attn: Attention,
    feed_forward: FeedForward,
    norm1: Norm1,
    norm2: RmsNorm,
    ffn_norm1: RmsNorm,
    ffn_norm2: RmsNorm,
}

impl Block {
    fn new(s: &mut Scope, cfg: &BooguConfig, modulated: bool) -> Block {
        let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
        Block {
            norm1: if modulated { Norm1::Modulated(NormZero::new(s, "norm1", cfg)) } else { Norm1::Plain(rms_norm(s, "norm1", h, eps)) },
            attn: Attention::new(s, "attn", cfg),
            feed_forward: FeedForward::new(s, "feed_forward", cfg),
            norm2: rms_norm(s, "norm2", h, eps),
            ffn_norm1: rms_norm(s, "ffn_norm1", h, eps),
            ffn_norm2: rms_norm(s, "ffn_norm2", h, eps),
        }
    }

    /// `temb`: the timestep embedding (read by modulated blocks only).
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>, temb: T<'g>) -> T<'g> {
        match self.norm1 {
            Norm1::Modulated(m) => {
                let (h, [gate_msa, scale_mlp, gate_mlp]) = m.forward(g, x, temb);
                let attn = self.attn.forward(g, h, pe);
                let x = gate_residual(x, self.norm2.forward(g, attn), gate_msa);
                let h = scale_tokens(self.ffn_norm1.forward(g, x), scale_mlp);
                let mlp = self.feed_forward.forward(g, h);
                gate_residual(x, self.ffn_norm2.forward(g, mlp), gate_mlp)
            }
            Norm1::Plain(norm1) => {
                let attn = self.attn.forward(g, norm1.forward(g, x), pe);
                let x = x.add(self.norm2.forward(g, attn));
                let mlp = self.feed_forward.forward(g, self.ffn_norm1.forward(g, x));
                x.add(self.ffn_norm2.forward(g, mlp))
            }
        }
    }
}

/// One stream's sandwich norms around a block's attention and feed-forward.
#[derive(Clone, Copy, Debug)]
struct StreamNorms {
    attn: RmsNorm,
    ffn1: RmsNorm,
    ffn2: RmsNorm,
}

impl StreamNorms {
    fn new(s: &mut Scope, stream: &str, cfg: &BooguConfig) -> StreamNorms {
        let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
        StreamNorms {
            attn: rms_norm(s, &format!("{stream}_attn_norm"), h, eps),
            ffn1: rms_norm(s, &format!("{stream}_ffn_norm1"), h, eps),
            ffn2: rms_norm(s, &format!("{stream}_ffn_norm2"), h, eps),
        }
    }

    /// The feed-forward half: `x + tanh(gate) · ffn_norm2(ff(ffn_norm1(h · (1 + scale) + shift)))`
    /// where `h` is `norm2`'s output.
    #[allow(clippy::too_many_arguments)]
    fn mlp<'g>(&self, g: &'g Graph, ff: &FeedForward, x: T<'g>, h: T<'g>, scale: T<'g>, shift: T<'g>, gate: T<'g>) -> T<'g> {
        let ne = shift.ne();
        let h = scale_tokens(h, scale).add(shift.reshape(&[ne[0], 1, ne[1]]));
        let out = ff.forward(g, self.ffn1.forward(g, h));
        gate_residual(x, self.ffn2.forward(g, out), gate)
    }
}

/// A double-stream layer: the joint text-image attention, the image's own self-attention
/// and a feed-forward per stream, each modulated by the timestep embedding.
#[derive(Clone, Copy, Debug)]
struct DoubleBlock {
    joint: JointAttention,
    img_self_attn: Attention,
    img_ff: FeedForward,
    instruct_ff: FeedForward,
    img_norm: [NormZero; 3],
    instruct_norm: [NormZero; 2],
    img_self_attn_norm: RmsNorm,
    img: StreamNorms,
    instruct: StreamNorms,
}

impl DoubleBlock {
    fn new(s: &mut Scope, cfg: &BooguConfig) -> DoubleBlock {
        DoubleBlock {
            joint: JointAttention::new(s, "img_instruct_attn", cfg),
            img_self_attn: Attention::new(s, "img_self_attn", cfg),
            img_ff: FeedForward::new(s, "img_feed_forward", cfg),
            instruct_ff: FeedForward::new(s, "instruct_feed_forward", cfg),
            img_norm: [1, 2, 3].map(|i| NormZero::new(s, &format!("img_norm{i}"), cfg)),
            instruct_norm: [1, 2].map(|i| NormZero::new(s, &format!("instruct_norm{i}"), cfg)),
            img_self_attn_norm: rms_norm(s, "img_self_attn_norm", cfg.hidden_size, cfg.norm_eps),
            img: StreamNorms::new(s, "img", cfg),
            instruct: StreamNorms::new(s, "instruct", cfg),
        }
    }

    /// `img` `[hidden, Li, N]` (references and image), `txt` `[hidden, Lt, N]`; `joint_pe`
    /// covers both, `img_pe` the image tokens → the new `(img, txt)`.
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, txt: T<'g>, joint_pe: T<'g>, img_pe: T<'g>, temb: T<'g>) -> (T<'g>, T<'g>) {
        let l_txt = txt.ne()[1];
        let (img1, [img_gate_msa, img_scale_mlp, img_gate_mlp]) = self.img_norm[0].forward(g, img, temb);
        let (img2, [img_shift_mlp, _, _]) = self.img_norm[1].forward(g, img, temb);
        let (img3, [img_gate_self, _, _]) = self.img_norm[2].forward(g, img, temb);
        let (txt1, [txt_gate_msa, txt_scale_mlp, txt_gate_mlp]) = self.instruct_norm[0].forward(g, txt, temb);
        let (txt2, [txt_shift_mlp, _, _]) = self.instruct_norm[1].forward(g, txt, temb);

        let joint = self.joint.forward(g, img1, txt1, joint_pe);
        let txt_attn = slice(joint, 1, 0, l_txt);
        let img_attn = slice(joint, 1, l_txt, joint.ne()[1]);
        let img_self = self.img_self_attn.forward(g, img3, img_pe);

        let img = gate_residual(img, self.img.attn.forward(g, img_attn), img_gate_msa);
        let img = gate_residual(img, self.img_self_attn_norm.forward(g, img_self), img_gate_self);
        let img = self.img.mlp(g, &self.img_ff, img, img2, img_scale_mlp, img_shift_mlp, img_gate_mlp);

        let txt = gate_residual(txt, self.instruct.attn.forward(g, txt_attn), txt_gate_msa);
        let txt = self.instruct.mlp(g, &self.instruct_ff, txt, txt2, txt_scale_mlp, txt_shift_mlp, txt_gate_mlp);
        (img, txt)
    }
}

/// `norm_out`: LayerNorm (no affine) scaled by the timestep embedding, then the patch
/// projection.
#[derive(Clone, Copy, Debug)]
struct NormOut {
    linear_1: Linear,
    norm: LayerNorm,
    linear_2: Linear,
}

impl NormOut {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, temb: T<'g>) -> T<'g> {
        let scale = self.linear_1.forward(g, temb.silu());
        self.linear_2.forward(g, scale_tokens(self.norm.forward(g, x), scale))
    }
}

/// A Boogu Image transformer whose weights live in a `ParamStore`.
pub struct BooguModel {
    pub config: BooguConfig,
    x_embedder: Linear,
    ref_embedder: Linear,
    image_index_embedding: W,
    t_embedder: MlpEmbedder,
    caption_norm: RmsNorm,
    caption_embedder: Linear,
    noise_refiner: Vec<Block>,
    ref_refiner: Vec<Block>,
    context_refiner: Vec<Block>,
    double_layers: Vec<DoubleBlock>,
    single_layers: Vec<Block>,
    norm_out: NormOut,
}

impl BooguModel {
    pub fn new(s: &mut Scope, cfg: &BooguConfig) -> BooguModel {
        let (h, p) = (cfg.hidden_size, cfg.patch_size);
        let patch = p * p * cfg.in_channels;
        let blocks = |s: &mut Scope, name: &str, n: usize, modulated: bool| -> Vec<Block> {
            (0..n).map(|i| Block::new(&mut s.sub(&format!("{name}.{i}")), cfg, modulated)).collect()
        };
        let x_embedder = Linear::new(s, "x_embedder", patch, h, true);
        let ref_embedder = Linear::new(s, "ref_image_patch_embedder", patch, h, true);
        let image_index_embedding = s.tensor("image_index_embedding", F32, &[h, IMAGE_INDEXES as i64]);
        let mut tce = s.sub("time_caption_embed");
        let t_embedder = MlpEmbedder::with_layers(&mut tce, "timestep_embedder", ["linear_1", "linear_2"], FREQ_DIM as i64, cfg.temb_dim, cfg.temb_dim, false);
        let caption_norm = rms_norm(&mut tce, "caption_embedder.0", cfg.caption_dim, cfg.norm_eps);
        let caption_embedder = Linear::new(&mut tce, "caption_embedder.1", cfg.caption_dim, h, true);
        let r = cfg.num_refiner_layers;
        let noise_refiner = blocks(s, "noise_refiner", r, true);
        let ref_refiner = blocks(s, "ref_image_refiner", r, true);
        let context_refiner = blocks(s, "context_refiner", r, false);
        let double_layers = (0..cfg.num_double_layers).map(|i| DoubleBlock::new(&mut s.sub(&format!("double_stream_layers.{i}")), cfg)).collect();
        let single_layers = blocks(s, "single_stream_layers", cfg.num_layers, true);
        let mut no = s.sub("norm_out");
        let norm_out = NormOut {
            linear_1: Linear::new(&mut no, "linear_1", cfg.temb_dim, h, true),
            norm: LayerNorm { weight: None, bias: None, eps: 1e-6 },
            linear_2: Linear::new(&mut no, "linear_2", h, p * p * cfg.out_channels, true),
        };
        BooguModel {
            config: cfg.clone(),
            x_embedder,
            ref_embedder,
            image_index_embedding,
            t_embedder,
            caption_norm,
            caption_embedder,
            noise_refiner,
            ref_refiner,
            context_refiner,
            double_layers,
            single_layers,
            norm_out,
        }
    }

    /// The reference latents as tokens, each plus its row of `image_index_embedding`.
    fn embed_refs<'g>(&self, g: &'g Graph, refs: &[T<'g>]) -> Option<T<'g>> {
        let h = self.config.hidden_size;
        let table = g.param(self.image_index_embedding);
        let row_bytes = h as usize * table.nb()[0];
        refs.iter().enumerate().fold(None, |acc, (i, r)| {
            let tokens = self.ref_embedder.forward(g, pad_and_patchify(g, *r, self.config.patch_size, false));
            let index = table.view(&[h], &[], i.min(IMAGE_INDEXES - 1) * row_bytes).reshape(&[h, 1, 1]);
            let tokens = tokens.add(index);
            Some(match acc {
                None => tokens,
                Some(a) => a.concat(tokens, 1),
            })
        })
    }

    /// One evaluation: the latent `x` `[W, H, C, 1]`, the model timestep `t` `[1]` (in
    /// [0, 1], already `1 - t / 1000`), LLM hidden states `context` `[caption_dim, L, 1]`,
    /// the rotation table `pe` (text, references, image) and the reference latents `refs`
    /// → the velocity `[W, H, C, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, pe: T<'g>, refs: &[T<'g>]) -> T<'g> {
        let p = self.config.patch_size;
        let [w, h, _, _] = x.ne();
        let temb = self.t_embedder.forward(g, timestep_embedding(t, FREQ_DIM, 10000, 1000.0));
        let mut txt = self.caption_embedder.forward(g, self.caption_norm.forward(g, context));

        let mut img = self.x_embedder.forward(g, pad_and_patchify(g, x, p, false));
        let img_len = img.ne()[1];
        let ref_img = self.embed_refs(g, refs);
        let ref_len = ref_img.map_or(0, |r| r.ne()[1]);
        let txt_len = txt.ne()[1];

        let txt_pe = slice(pe, 3, 0, txt_len);
        let noise_pe = slice(pe, 3, txt_len + ref_len, txt_len + ref_len + img_len);
        for block in &self.context_refiner {
            txt = block.forward(g, txt, txt_pe, temb);
        }
        for block in &self.noise_refiner {
            img = block.forward(g, img, noise_pe, temb);
        }
        let mut combined = match ref_img {
            Some(mut r) => {
                let ref_pe = slice(pe, 3, txt_len, txt_len + ref_len);
                for block in &self.ref_refiner {
                    r = block.forward(g, r, ref_pe, temb);
                }
                r.concat(img, 1)
            }
            None => img,
        };
        let img_pe = slice(pe, 3, txt_len, txt_len + combined.ne()[1]);
        for block in &self.double_layers {
            (combined, txt) = block.forward(g, combined, txt, pe, img_pe, temb);
        }
        let mut x = txt.concat(combined, 1);
        for block in &self.single_layers {
            x = block.forward(g, x, pe, temb);
        }
        let x = self.norm_out.forward(g, x, temb);
        let len = x.ne()[1];
        let x = slice(x, 1, len - img_len, len);
        unpatchify_and_crop(x, h, w, p, false).scale(-1.0)
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor, refs: &[Tensor]) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.in_channels as usize;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Boogu Image takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        ensure!(
            context.ne(0) as i64 == cfg.caption_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "Boogu Image's text context must be [{}, L, 1] (the LLM's width), got {:?}",
            cfg.caption_dim,
            context.shape()
        );
        for r in refs {
            ensure!(
                r.shape().len() <= 4 && r.ne(2) == c && r.ne(3) == 1 && r.ne(0) > 0 && r.ne(1) > 0,
                "Boogu Image reference latent must be [W, H, {c}, 1], got {:?}",
                r.shape()
            );
        }
        Ok(())
    }
}

/// Tokens per side of `len` latent pixels in patches of `p` (padded up).
fn patched(len: usize, p: usize) -> usize {
    len.div_ceil(p)
}

/// Boogu's rotation table for an `h`×`w` latent (patch `p`), `context_len` text tokens and
/// the reference latents `refs` (`(h, w)` each): text token i at `(i, i, i)`, then each
/// reference's patches at `(shift, row, col)`, `shift` starting at `context_len` and moving
/// on by the reference's longer side in tokens, then the image's patches likewise.
pub fn boogu_pe(h: usize, w: usize, p: usize, context_len: usize, refs: &[(usize, usize)], theta: f32, axes_dim: &[usize]) -> Vec<f32> {
    let mut ids = Ids::new(3);
    for i in 0..context_len {
        ids.data.extend([i as f32; 3]);
    }
    let mut shift = context_len;
    let grid = |ids: &mut Ids, shift: usize, h: usize, w: usize| {
        let (rows, cols) = (patched(h, p), patched(w, p));
        for r in 0..rows {
            for c in 0..cols {
                ids.data.extend([shift as f32, r as f32, c as f32]);
            }
        }
        rows.max(cols)
    };
    for &(rh, rw) in refs {
        shift += grid(&mut ids, shift, rh, rw);
    }
    grid(&mut ids, shift, h, w);
    rope::embed_nd(&ids, theta, axes_dim, None)
}

/// A loaded Boogu Image transformer.
pub type Boogu = Loaded<BooguModel>;

impl DiffusionModel for Loaded<BooguModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("Boogu Image needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context, input.ref_latents)?;
        ensure!(input.timesteps.len() == 1, "Boogu Image takes one timestep, got {}", input.timesteps.len());
        let cfg = &model.config;
        let p = cfg.patch_size as usize;
        let refs: Vec<(usize, usize)> = input.ref_latents.iter().map(|r| (r.ne(1), r.ne(0))).collect();
        let pe = boogu_pe(input.x.ne(1), input.x.ne(0), p, context.ne(1), &refs, cfg.theta, &cfg.axes_dim);
        let axes_sum: usize = cfg.axes_dim.iter().sum();
        let pos_len = pe.len() / axes_sum / 2;
        // The reference's timestep is t / 1000, which the model turns into 1 - that.
        let t = [1.0 - input.timesteps[0] / 1000.0];
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

    fn synthetic_types(h: i64, head_dim: i64, kv: i64) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let p = "model.diffusion_model.";
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("{p}{n}"), F32);
            shapes.insert(format!("{p}{n}"), s.to_vec());
        };
        add("x_embedder.weight", &[64, h]);
        add("ref_image_patch_embedder.weight", &[64, h]);
        add("time_caption_embed.caption_embedder.1.weight", &[32, h]);
        add("single_stream_layers.0.attn.norm_q.weight", &[head_dim]);
        add("single_stream_layers.0.attn.to_k.weight", &[h, kv * head_dim]);
        add("single_stream_layers.1.attn.to_k.weight", &[h, kv * head_dim]);
        add("double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight", &[h, h]);
        add("context_refiner.0.attn.to_q.weight", &[h, h]);
        add("norm_out.linear_2.weight", &[h, 64]);
        (types, shapes)
    }

    #[test]
    fn config_from_weights() {
        let (types, shapes) = synthetic_types(96, 48, 1);
        let cfg = BooguConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert_eq!((cfg.hidden_size, cfg.in_channels, cfg.out_channels, cfg.caption_dim, cfg.temb_dim), (96, 16, 16, 32, 96));
        assert_eq!((cfg.num_layers, cfg.num_double_layers, cfg.num_refiner_layers), (2, 1, 1));
        assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden), (2, 1, 48, 512));
        assert_eq!(cfg.axes_dim, [16, 16, 16]);
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        BooguModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in [
            "model.diffusion_model.context_refiner.0.norm1.weight",
            "model.diffusion_model.noise_refiner.0.norm1.norm.weight",
            "model.diffusion_model.ref_image_refiner.0.norm1.linear.bias",
            "model.diffusion_model.double_stream_layers.0.img_instruct_attn.processor.instruct_out.weight",
            "model.diffusion_model.double_stream_layers.0.instruct_norm2.linear.weight",
            "model.diffusion_model.time_caption_embed.timestep_embedder.linear_2.bias",
            "model.diffusion_model.image_index_embedding",
        ] {
            assert!(names.contains(&n), "{n}");
        }
        // Heads of 32 do not split into three even axes: the reference keeps 40-wide ones.
        let (types, shapes) = synthetic_types(64, 32, 1);
        let odd = BooguConfig::detect(&types, &|n| shapes.get(n).cloned(), "model.diffusion_model.");
        assert!(odd.validate().unwrap_err().to_string().contains("RoPE axes"));
    }

    #[test]
    fn rotation_ids_follow_text_references_and_image() {
        // 2 text tokens, a 4×6 reference (2×3 tokens, shift 2 → 5), a 2×2 image (1 token).
        let axes = [2usize, 2, 2];
        let pe = boogu_pe(2, 2, 2, 2, &[(4, 6)], 10000.0, &axes);
        assert_eq!(pe.len(), (2 + 6 + 1) * 3 * 4);
        let first_cos = |t: usize, axis: usize| pe[t * 12 + axis * 4];
        assert_eq!((first_cos(1, 0), first_cos(1, 2)), (1f32.cos(), 1f32.cos()));
        assert_eq!((first_cos(7, 0), first_cos(7, 1), first_cos(7, 2)), (2f32.cos(), 1f32.cos(), 2f32.cos()));
        assert_eq!((first_cos(8, 0), first_cos(8, 1)), (5f32.cos(), 1.0));
    }
}
