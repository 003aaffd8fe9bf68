//! Building blocks of the LDM UNet family (UNet, ControlNet): residual blocks with a
//! timestep embedding, spatial transformers with cross-attention, down/up-sampling.
//!
//! Each block declares its weights under the reference's internal names and builds the
//! reference's op sequence (same ops, same order, same inplace variants), because pictures
//! only match when the float roundings match.

use crate::graph::nn::{self, Conv2d, GroupNorm, LayerNorm, Linear};
use crate::graph::{Graph, Scope, F32, T};

/// `x` split into `n` equal views along dim 0 (no copies), like torch's `chunk(n, -1)`.
pub fn chunk_dim0<'g>(x: T<'g>, n: i64) -> Vec<T<'g>> {
    let ne = x.ne();
    let nb = x.nb();
    assert!(ne[0] % n == 0, "chunk of {} into {n}", ne[0]);
    let size = ne[0] / n;
    (0..n)
        .map(|i| x.view(&[size, ne[1], ne[2], ne[3]], &[nb[1], nb[2], nb[3]], (i * size) as usize * nb[0]))
        .collect()
}

/// `t` repeated along its batch dimension `dim` (its last) to `n` items when it holds another
/// count (conditioning of batch 1 for a batch of latents).
pub fn expand_batch<'g>(g: &'g Graph, t: T<'g>, dim: usize, n: i64) -> T<'g> {
    let mut ne = t.ne()[..=dim].to_vec();
    if ne[dim] == n {
        return t;
    }
    ne[dim] = n;
    t.repeat(g.new_tensor(F32, &ne))
}

/// The timestep embedding MLP (`time_embed`) and, for SDXL, the label embedding of the size
/// vector `y` (`label_emb`), summed.
#[derive(Clone, Copy, Debug)]
pub struct TimestepEmbed {
    model_channels: i64,
    time: (Linear, Linear),
    label: Option<(Linear, Linear)>,
}

impl TimestepEmbed {
    pub fn new(s: &mut Scope, model_channels: i64, time_embed_dim: i64, adm_in_channels: Option<i64>) -> TimestepEmbed {
        let ted = time_embed_dim;
        let time = (Linear::new(s, "time_embed.0", model_channels, ted, true), Linear::new(s, "time_embed.2", ted, ted, true));
        let label = adm_in_channels.map(|adm| {
            (Linear::new(s, "label_emb.0.0", adm, ted, true), Linear::new(s, "label_emb.0.2", ted, ted, true))
        });
        TimestepEmbed { model_channels, time, label }
    }

    /// timesteps [N], y [adm, N] → [time_embed_dim, N]; `y` is ignored without a label embedding.
    pub fn forward<'g>(&self, g: &'g Graph, timesteps: T<'g>, y: Option<T<'g>>) -> T<'g> {
        // The reference scales timesteps by a time factor (1 here) before embedding them.
        let t_emb = nn::scale(timesteps, 1.0, false).timestep_embedding(self.model_channels as i32, 10000);
        let emb = self.time.0.forward(g, t_emb).silu_inplace();
        let emb = self.time.1.forward(g, emb);
        match (y, &self.label) {
            (Some(y), Some((l0, l2))) => emb.add(l2.forward(g, l0.forward(g, y).silu_inplace())),
            _ => emb,
        }
    }
}

/// One block of the LDM encoder half (the UNet's input blocks, the ControlNet): a residual
/// block with its spatial transformer where the level has one, or a downsampling.
// A dozen per network, built once: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum EncoderBlock {
    Res { res: ResBlock, attn: Option<SpatialTransformer> },
    Down(Downsample),
}

impl EncoderBlock {
    pub fn forward<'g>(&self, g: &'g Graph, h: T<'g>, emb: T<'g>, context: impl Into<CrossContext<'g>>) -> T<'g> {
        match self {
            EncoderBlock::Res { res, attn } => {
                let h = res.forward(g, h, Some(emb));
                match attn {
                    Some(a) => a.forward(g, h, context),
                    None => h,
                }
            }
            EncoderBlock::Down(d) => d.forward(g, h),
        }
    }
}

/// Residual block conditioned on the timestep embedding (`ResBlock` of openaimodel.py).
#[derive(Clone, Debug)]
pub struct ResBlock {
    in_norm: GroupNorm,
    in_conv: Conv2d,
    emb_proj: Option<Linear>,
    out_norm: GroupNorm,
    out_conv: Conv2d,
    skip: Option<Conv2d>,
}

impl ResBlock {
    /// `emb_channels = None` declares a block without timestep input (`skip_t_emb`).
    pub fn new(s: &mut Scope, channels: i64, emb_channels: Option<i64>, out_channels: i64) -> ResBlock {
        let in_norm = GroupNorm::gn32(s, "in_layers.0", channels);
        let in_conv = Conv2d::square(s, "in_layers.2", channels, out_channels, 3, 1, 1);
        let emb_proj = emb_channels.map(|e| Linear::new(s, "emb_layers.1", e, out_channels, true));
        let out_norm = GroupNorm::gn32(s, "out_layers.0", out_channels);
        let out_conv = Conv2d::square(s, "out_layers.3", out_channels, out_channels, 3, 1, 1);
        let skip = (out_channels != channels).then(|| Conv2d::square(s, "skip_connection", channels, out_channels, 1, 1, 0));
        ResBlock { in_norm, in_conv, emb_proj, out_norm, out_conv, skip }
    }

    /// x: [W, H, C, N], emb: [emb_channels, N] → [W, H, out_channels, N].
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, emb: Option<T<'g>>) -> T<'g> {
        let mut h = self.in_norm.forward(g, x).silu_inplace();
        h = self.in_conv.forward(g, h);
        if let Some(proj) = &self.emb_proj {
            let emb = emb.expect("ResBlock with an embedding projection needs the embedding");
            let e = proj.forward(g, emb.silu());
            let en = e.ne();
            h = h.add(e.reshape(&[1, 1, en[0], en[1]]));
        }
        h = self.out_norm.forward(g, h).silu_inplace();
        h = self.out_conv.forward(g, h);
        let x = match &self.skip {
            Some(conv) => conv.forward(g, x),
            None => x,
        };
        h.add(x)
    }
}

/// Stride-2 3×3 convolution (`Downsample` with `use_conv`).
#[derive(Clone, Copy, Debug)]
pub struct Downsample {
    conv: Conv2d,
}

impl Downsample {
    pub fn new(s: &mut Scope, channels: i64, out_channels: i64) -> Downsample {
        Downsample { conv: Conv2d::square(s, "op", channels, out_channels, 3, 2, 1) }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.conv.forward(g, x)
    }
}

/// Nearest ×2 upscale then a 3×3 convolution.
#[derive(Clone, Copy, Debug)]
pub struct Upsample {
    conv: Conv2d,
}

impl Upsample {
    pub fn new(s: &mut Scope, channels: i64, out_channels: i64) -> Upsample {
        Upsample { conv: Conv2d::square(s, "conv", channels, out_channels, 3, 1, 1) }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.conv.forward(g, x.upscale(2))
    }
}

/// The diffusers feed-forward: `net.0.proj`, an activation, `net.2`. GEGLU (the UNets)
/// projects to twice the inner width and computes `a * gelu(gate)`; plain GELU (Qwen-Image)
/// activates the projection in place.
#[derive(Clone, Copy, Debug)]
pub struct FeedForward {
    proj: Linear,
    out: Linear,
    geglu: bool,
}

impl FeedForward {
    /// GEGLU.
    pub fn new(s: &mut Scope, dim: i64, dim_out: i64, mult: i64) -> FeedForward {
        let inner = dim * mult;
        let proj = Linear::new(&mut s.sub("net.0"), "proj", dim, inner * 2, true);
        let out = Linear::new(s, "net.2", inner, dim_out, true);
        FeedForward { proj, out, geglu: true }
    }

    /// GELU (tanh approximation); `net.2` sees its input scaled by `out_scale` (undone after
    /// it), which keeps large activations within f16 on some backends.
    pub fn gelu(s: &mut Scope, dim: i64, dim_out: i64, mult: i64, out_scale: f32) -> FeedForward {
        let inner = dim * mult;
        let proj = Linear::new(&mut s.sub("net.0"), "proj", dim, inner, true);
        let mut out = Linear::new(s, "net.2", inner, dim_out, true);
        out.scale = out_scale;
        FeedForward { proj, out, geglu: false }
    }

    /// x: [dim, L, N] → [dim_out, L, N].
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.proj.forward(g, x);
        if !self.geglu {
            return self.out.forward(g, h.contiguous().gelu_inplace());
        }
        let halves = chunk_dim0(h, 2);
        // The gate is made dense and activated in place; the value half stays a view.
        let gate = halves[1].cont().gelu_inplace();
        self.out.forward(g, halves[0].mul(gate))
    }
}

/// What a spatial transformer's cross-attention reads: the text context `[context_dim, L, N]`
/// and, with an IP-Adapter, its image tokens `[ip_dim, tokens, N]` and their strength.
#[derive(Clone, Copy)]
pub struct CrossContext<'g> {
    pub text: T<'g>,
    pub image: Option<(T<'g>, f32)>,
}

impl<'g> From<T<'g>> for CrossContext<'g> {
    fn from(text: T<'g>) -> CrossContext<'g> {
        CrossContext { text, image: None }
    }
}

/// Multi-head attention of `x` over `context` (itself for self-attention).
#[derive(Clone, Copy, Debug)]
pub struct CrossAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    n_head: i64,
    /// Key/value input width when the context is read as overlapping windows
    /// (`self_attention_windows`).
    kv_window: Option<i64>,
    /// An IP-Adapter's key and value projections of the image tokens (`to_k_ip`, `to_v_ip`).
    image: Option<(Linear, Linear)>,
}

impl CrossAttention {
    pub fn new(s: &mut Scope, query_dim: i64, context_dim: i64, n_head: i64, d_head: i64) -> CrossAttention {
        let inner = n_head * d_head;
        CrossAttention {
            to_q: Linear::new(s, "to_q", query_dim, inner, false),
            to_k: Linear::new(s, "to_k", context_dim, inner, false),
            to_v: Linear::new(s, "to_v", context_dim, inner, false),
            to_out: Linear::new(s, "to_out.0", inner, query_dim, true),
            n_head,
            kv_window: None,
            image: None,
        }
    }

    /// Cross-attention that also attends to IP-Adapter image tokens `ip_dim` wide where the
    /// files give it `to_k_ip` / `to_v_ip` (the reference's `has_ip`); plain otherwise.
    pub fn with_image(s: &mut Scope, query_dim: i64, context_dim: i64, n_head: i64, d_head: i64, ip_dim: Option<i64>) -> CrossAttention {
        let mut a = CrossAttention::new(s, query_dim, context_dim, n_head, d_head);
        if let Some(ip_dim) = ip_dim.filter(|_| s.has("to_k_ip.weight")) {
            let inner = n_head * d_head;
            a.image = Some((Linear::new(s, "to_k_ip", ip_dim, inner, false), Linear::new(s, "to_v_ip", ip_dim, inner, false)));
        }
        a
    }

    /// Self-attention whose key/value projections take `kv_width` inputs while the tokens
    /// have `dim` values (SDXS-512-0.9's single-head 320-wide level: 1024-input `to_k` /
    /// `to_v`). The reference feeds those projections the tokens' memory read as rows of
    /// `kv_width` values `dim` apart, i.e. each token followed by the next tokens' values;
    /// see `self_attention_windows`.
    pub fn windowed_self(s: &mut Scope, dim: i64, n_head: i64, d_head: i64, kv_width: i64) -> CrossAttention {
        CrossAttention { kv_window: Some(kv_width), ..CrossAttention::new(s, dim, kv_width, n_head, d_head) }
    }

    /// x: [query_dim, L, N], context: [context_dim, L_ctx, N] → [query_dim, L, N].
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: T<'g>) -> T<'g> {
        self.forward_with_image(g, x, context.into())
    }

    /// Like `forward`; with image projections and image tokens of a non-zero strength, the
    /// queries' attention over the image tokens × strength is added before the output
    /// projection, as the reference does.
    pub fn forward_with_image<'g>(&self, g: &'g Graph, x: T<'g>, context: CrossContext<'g>) -> T<'g> {
        let text = match self.kv_window {
            Some(width) => self_attention_windows(context.text, width),
            None => context.text,
        };
        let flash = g.options.flash_attn;
        let q = self.to_q.forward(g, x);
        let k = self.to_k.forward(g, text);
        let v = self.to_v.forward(g, text);
        let mut h = nn::attention(g, q, k, v, self.n_head, None, false, flash, 1.0);
        if let (Some((to_k, to_v)), Some((tokens, strength))) = (self.image, context.image) {
            if strength != 0.0 {
                let k = to_k.forward(g, tokens);
                let v = to_v.forward(g, tokens);
                let seen = nn::attention(g, q, k, v, self.n_head, None, false, flash, 1.0);
                h = h.add(nn::scale(seen, strength, false));
            }
        }
        self.to_out.forward(g, h)
    }
}

/// The tokens `x` [C, L, N] as `width`-wide rows starting `C` values apart: row t holds the
/// values from token t onwards, running into the next tokens. That is what the reference's
/// SDXS-0.9 self-attention projects: it relabels the token tensor's row width to 1024 while
/// keeping its strides (it runs one item at a time). Past the last token the reference reads
/// stale scratch memory; here those values are zeros.
fn self_attention_windows<'g>(x: T<'g>, width: i64) -> T<'g> {
    let [c, l, n, _] = x.ne();
    let size = x.nb()[0];
    // Padded to width × L values per item, the size ggml requires of a view's source.
    let padded = x.contiguous().reshape(&[c * l, n]).pad(((width - c) * l) as i32, 0, 0, 0);
    padded.view(&[width, l, n], &[c as usize * size, padded.nb()[1]], 0).cont()
}

/// Pre-norm transformer layer: self-attention, cross-attention, GEGLU feed-forward.
#[derive(Clone, Copy, Debug)]
pub struct BasicTransformerBlock {
    attn1: CrossAttention,
    attn2: CrossAttention,
    ff: FeedForward,
    norm1: LayerNorm,
    norm2: LayerNorm,
    norm3: LayerNorm,
}

const LAYER_NORM_EPS: f32 = 1e-5;

impl BasicTransformerBlock {
    /// `self_kv_width`: see `CrossAttention::windowed_self` (None: plain self-attention);
    /// `ip_dim`: the width of IP-Adapter image tokens, see `CrossAttention::with_image`.
    pub fn new(s: &mut Scope, dim: i64, n_head: i64, d_head: i64, context_dim: i64, self_kv_width: Option<i64>, ip_dim: Option<i64>) -> BasicTransformerBlock {
        let attn1 = match self_kv_width {
            Some(width) => CrossAttention::windowed_self(&mut s.sub("attn1"), dim, n_head, d_head, width),
            None => CrossAttention::new(&mut s.sub("attn1"), dim, dim, n_head, d_head),
        };
        BasicTransformerBlock {
            attn1,
            attn2: CrossAttention::with_image(&mut s.sub("attn2"), dim, context_dim, n_head, d_head, ip_dim),
            ff: FeedForward::new(&mut s.sub("ff"), dim, dim, 4),
            norm1: LayerNorm::new(s, "norm1", dim, LAYER_NORM_EPS, true, true),
            norm2: LayerNorm::new(s, "norm2", dim, LAYER_NORM_EPS, true, true),
            norm3: LayerNorm::new(s, "norm3", dim, LAYER_NORM_EPS, true, true),
        }
    }

    /// x: [dim, L, N], context: [context_dim, L_ctx, N] (and the image tokens).
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: CrossContext<'g>) -> T<'g> {
        let n = self.norm1.forward(g, x);
        let x = self.attn1.forward(g, n, n).add(x);
        let n = self.norm2.forward(g, x);
        let x = self.attn2.forward_with_image(g, n, context).add(x);
        let n = self.norm3.forward(g, x);
        self.ff.forward(g, n).add(x)
    }
}

/// Projection in/out of a spatial transformer: 1×1 convolution (SD 1.x) or linear (SD 2.x, SDXL).
#[derive(Clone, Copy, Debug)]
enum Projection {
    Conv(Conv2d),
    Linear(Linear),
}

/// Transformer over the pixels of a feature map, conditioned on a context sequence.
#[derive(Clone, Debug)]
pub struct SpatialTransformer {
    norm: GroupNorm,
    proj_in: Projection,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Projection,
}

impl SpatialTransformer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        s: &mut Scope,
        in_channels: i64,
        n_head: i64,
        d_head: i64,
        depth: i64,
        context_dim: i64,
        use_linear: bool,
        self_kv_width: Option<i64>,
        ip_dim: Option<i64>,
    ) -> SpatialTransformer {
        let inner = n_head * d_head;
        let projection = |s: &mut Scope, name: &str, i: i64, o: i64| {
            if use_linear {
                Projection::Linear(Linear::new(s, name, i, o, true))
            } else {
                Projection::Conv(Conv2d::square(s, name, i, o, 1, 1, 0))
            }
        };
        let norm = GroupNorm::gn32(s, "norm", in_channels);
        let proj_in = projection(s, "proj_in", in_channels, inner);
        let blocks = (0..depth)
            .map(|i| BasicTransformerBlock::new(&mut s.sub(&format!("transformer_blocks.{i}")), inner, n_head, d_head, context_dim, self_kv_width, ip_dim))
            .collect();
        let proj_out = projection(s, "proj_out", inner, in_channels);
        SpatialTransformer { norm, proj_in, blocks, proj_out }
    }

    /// x: [W, H, C, N], context: [context_dim, L_ctx, N] (and IP-Adapter image tokens) →
    /// [W, H, C, N].
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: impl Into<CrossContext<'g>>) -> T<'g> {
        let context = context.into();
        let [w, h, _, n] = x.ne();
        // [W, H, C, N] → tokens [C, W*H, N] (pixel order row by row, as torch flattens).
        let to_tokens = |t: T<'g>| {
            let c = t.ne()[2];
            t.permute(1, 2, 0, 3).cont().reshape(&[c, w * h, n])
        };
        let to_map = |t: T<'g>| {
            let c = t.ne()[0];
            t.permute(1, 0, 2, 3).cont().reshape(&[w, h, c, n])
        };
        let mut t = self.norm.forward(g, x);
        t = match &self.proj_in {
            Projection::Linear(l) => l.forward(g, to_tokens(t)),
            Projection::Conv(c) => to_tokens(c.forward(g, t)),
        };
        for block in &self.blocks {
            t = block.forward(g, t, context);
        }
        t = match &self.proj_out {
            Projection::Linear(l) => to_map(l.forward(g, t)),
            Projection::Conv(c) => c.forward(g, to_map(t)),
        };
        t.add(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, Runner};
    use std::sync::Arc;

    #[test]
    fn self_attention_windows_run_into_the_next_tokens_then_zeros() {
        // Two items of 4 tokens × 3 values, read as 5-wide rows 3 values apart.
        let data: Vec<f32> = (1..=24).map(|v| v as f32).collect();
        let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), 1);
        let out = runner.compute(|g| Ok(self_attention_windows(g.input_f32(&data, &[3, 4, 2]), 5))).unwrap();
        assert_eq!(out.shape(), [5, 4, 2, 1]);
        let item = |o: f32| {
            let row = |t: f32| (0..5).map(move |i| t * 3. + i as f32 + 1. + o).map(move |v| if v > o + 12. { 0. } else { v });
            (0..4).flat_map(move |t| row(t as f32)).collect::<Vec<f32>>()
        };
        assert_eq!(out.data(), [item(0.), item(12.)].concat());
    }
}
