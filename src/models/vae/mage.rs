//! The Mage VAE (Mage-Flow's first stage), like the reference's `mage_vae.hpp`: every size
//! is fixed (384 wide, 128 latent channels at 1/16 of the image).
//!
//! - Encoder (`student.dconv_encoder.`): a 16×16 patch convolution to 768 channels, two
//!   DiCo blocks (layer norm over channels, 1×1, depthwise 3×3, GELU, channel attention,
//!   1×1, then a 4× 1×1 MLP), down to 384, fused with the projection of an all-zero latent,
//!   21 DiCo blocks modulated by the embedding of timestep 0, and the moments (mean ‖
//!   logvar, 256 channels). Latents are sampled `mean + exp(0.5·clamp(logvar, -20, 10))·ε`.
//! - Decoder (`pipeline.`): a small convolutional decoder of the latent (resnet and
//!   windowed-attention blocks, 384 channels, still at 1/16), 21 modulated DiCo blocks over
//!   it and an all-zero image's patches, then per pixel of each 16×16 patch an MLP over the
//!   pixel's features, the latent's and a fixed 8×8 cosine basis, to RGB.
//!
//! Latents are the diffusion model's as they are (no scale or shift).

use super::{split_moments, VaeNet};
use crate::error::Result;
use crate::graph::nn::{self, Conv2d, GroupNorm, LayerNorm, Linear};
use crate::graph::{Graph, Runner, Scope, F16, F32, T, W};
use crate::models::common::dit::{chunk, patchify, timestep_embedding, unpatchify, RmsNorm};
use crate::tensor::Tensor;

/// Where the VAE's weights live.
pub const PREFIX: &str = "first_stage_model.";
const HIDDEN: i64 = 384;
const LATENT: i64 = 128;
/// Pixels per latent pixel (the encoder's and decoder's patch).
const PATCH: i64 = 16;
/// The decoder's per-pixel features.
const PIXEL_DIM: i64 = 32;
/// Cosine basis functions per pixel.
const DCT: i64 = 64;
/// Side of the decoder attention's windows.
const WINDOW: i64 = 32;
const EPS: f32 = 1e-6;
const DICO_BLOCKS: usize = 21;

/// The reference's constant inputs: a tensor of `value` of shape `ne`.
fn full<'g>(g: &'g Graph, value: f32, ne: [i64; 4]) -> T<'g> {
    g.input_f32(&vec![value; ne.iter().product::<i64>() as usize], &ne)
}

/// Layer norm over the channels of `[W, H, C, N]`.
#[derive(Clone, Copy)]
struct LayerNorm2d(LayerNorm);

impl LayerNorm2d {
    fn new(s: &mut Scope, name: &str, c: i64, affine: bool) -> LayerNorm2d {
        LayerNorm2d(LayerNorm::new(s, name, c, EPS, affine, true))
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.0.forward(g, x.permute(1, 2, 0, 3).cont());
        x.permute(2, 0, 1, 3).cont()
    }
}

/// 3×3 depthwise convolution (one filter per channel), padding 1.
#[derive(Clone, Copy)]
struct DepthwiseConv {
    weight: W,
    bias: W,
}

impl DepthwiseConv {
    fn new(s: &mut Scope, name: &str, c: i64) -> DepthwiseConv {
        let mut s = s.sub(name);
        DepthwiseConv { weight: s.tensor("weight", F16, &[3, 3, 1, c]), bias: s.tensor("bias", F32, &[c]) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let w = g.param(self.weight);
        let y = if g.options.conv_direct { w.conv_2d_dw_direct(x, 1, 1, 1, 1, 1, 1) } else { w.conv_2d_dw(x, 1, 1, 1, 1, 1, 1) };
        let b = g.param(self.bias);
        y.add_inplace(b.reshape(&[1, 1, b.ne()[0], 1]))
    }
}

fn conv1x1(s: &mut Scope, name: &str, i: i64, o: i64) -> Conv2d {
    Conv2d::square(s, name, i, o, 1, 1, 0)
}

fn conv3x3(s: &mut Scope, name: &str, i: i64, o: i64) -> Conv2d {
    Conv2d::square(s, name, i, o, 3, 1, 1)
}

/// `x · sigmoid(proj(mean over the pixels of x))`.
fn channel_attention<'g>(g: &'g Graph, x: T<'g>, proj: &Conv2d) -> T<'g> {
    let [w, h, c, n] = x.ne();
    let pooled = x.reshape(&[w * h, c, n]).mean().reshape(&[1, 1, c, n]);
    x.mul(proj.forward(g, pooled).sigmoid())
}

/// `x · (scale + 1) + shift` with `[C, N]` modulations.
fn modulate_2d<'g>(g: &'g Graph, x: T<'g>, shift: T<'g>, scale: T<'g>) -> T<'g> {
    let per_channel = |m: T<'g>| m.reshape(&[1, 1, m.ne()[0], m.ne()[1]]);
    x.mul(per_channel(scale).add(full(g, 1.0, [1, 1, 1, 1]))).add(per_channel(shift))
}

/// A DiCo block: affine norms and no modulation in the encoder's head, modulated (adaLN,
/// gates) with plain norms elsewhere.
struct DiCoBlock {
    conv1: Conv2d,
    conv2: DepthwiseConv,
    conv3: Conv2d,
    ca: Conv2d,
    conv4: Conv2d,
    conv5: Conv2d,
    norm1: LayerNorm2d,
    norm2: LayerNorm2d,
    ada: Option<Linear>,
}

impl DiCoBlock {
    fn new(s: &mut Scope, name: &str, c: i64, modulated: bool) -> DiCoBlock {
        let mut s = s.sub(name);
        DiCoBlock {
            conv1: conv1x1(&mut s, "conv1", c, c),
            conv2: DepthwiseConv::new(&mut s, "conv2", c),
            conv3: conv1x1(&mut s, "conv3", c, c),
            ca: conv1x1(&mut s, "ca.1", c, c),
            conv4: conv1x1(&mut s, "conv4", c, 4 * c),
            conv5: conv1x1(&mut s, "conv5", 4 * c, c),
            norm1: LayerNorm2d::new(&mut s, "norm1", c, !modulated),
            norm2: LayerNorm2d::new(&mut s, "norm2", c, !modulated),
            ada: modulated.then(|| Linear::new(&mut s, "adaLN_modulation.1", c, 6 * c, true)),
        }
    }

    /// `cond` `[C, N]` for the modulated blocks.
    fn forward<'g>(&self, g: &'g Graph, input: T<'g>, cond: Option<T<'g>>) -> T<'g> {
        let mods = match (&self.ada, cond) {
            (Some(ada), Some(c)) => Some(chunk(ada.forward(g, c.silu()), 6, 0, true)),
            _ => None,
        };
        let gate = |m: T<'g>| m.reshape(&[1, 1, m.ne()[0], m.ne()[1]]);
        let mut x = self.norm1.forward(g, input);
        if let Some(m) = &mods {
            x = modulate_2d(g, x, m[0], m[1]);
        }
        x = self.conv2.forward(g, self.conv1.forward(g, x)).gelu();
        x = self.conv3.forward(g, channel_attention(g, x, &self.ca));
        let x = match &mods {
            Some(m) => input.add(x.mul(gate(m[2]))),
            None => input.add(x),
        };
        let mut h = self.norm2.forward(g, x);
        if let Some(m) = &mods {
            h = modulate_2d(g, h, m[3], m[4]);
        }
        h = self.conv5.forward(g, self.conv4.forward(g, h).gelu());
        match &mods {
            Some(m) => x.add(h.mul(gate(m[5]))),
            None => x.add(h),
        }
    }
}

/// The embedding `[384, N]` of timestep 0 for `n` pictures.
struct TimestepEmbedder {
    mlp0: Linear,
    mlp2: Linear,
}

impl TimestepEmbedder {
    fn new(s: &mut Scope) -> TimestepEmbedder {
        let mut s = s.sub("t_embedder");
        TimestepEmbedder { mlp0: Linear::new(&mut s, "mlp.0", 256, HIDDEN, true), mlp2: Linear::new(&mut s, "mlp.2", HIDDEN, HIDDEN, true) }
    }

    fn forward_zero<'g>(&self, g: &'g Graph, n: i64) -> T<'g> {
        let t = full(g, 0.0, [n, 1, 1, 1]).reshape(&[n]);
        let x = self.mlp0.forward(g, timestep_embedding(t, 256, 10000, 1.0));
        self.mlp2.forward(g, x.silu_inplace())
    }
}

struct ResnetBlock {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
}

impl ResnetBlock {
    fn new(s: &mut Scope, c: i64) -> ResnetBlock {
        ResnetBlock { norm1: GroupNorm::gn32(s, "norm1", c), conv1: conv3x3(s, "conv1", c, c), norm2: GroupNorm::gn32(s, "norm2", c), conv2: conv3x3(s, "conv2", c, c) }
    }

    fn forward<'g>(&self, g: &'g Graph, input: T<'g>) -> T<'g> {
        let x = self.conv1.forward(g, self.norm1.forward(g, input).silu());
        let x = self.conv2.forward(g, self.norm2.forward(g, x).silu());
        input.add(x)
    }
}

/// Self-attention within 32×32 windows (the input padded right and bottom by repeating its
/// last column and row).
struct WindowAttention {
    norm: GroupNorm,
    q: Conv2d,
    k: Conv2d,
    v: Conv2d,
    proj_out: Conv2d,
}

/// Pads `[W, H, C, N]` right by `pad_w` copies of its last column, then bottom by `pad_h`
/// copies of its last row.
fn replicate_pad<'g>(x: T<'g>, pad_w: i64, pad_h: i64) -> T<'g> {
    let last = |x: T<'g>, dim: usize| {
        let ne = x.ne();
        if ne[dim] == 1 {
            return x;
        }
        let mut e = ne;
        e[dim] = 1;
        let nb = x.nb();
        x.view(&e, &[nb[1], nb[2], nb[3]], (ne[dim] as usize - 1) * nb[dim]).cont()
    };
    let mut x = x;
    if pad_w > 0 {
        let [_, h, c, n] = x.ne();
        x = x.concat(last(x, 0).repeat_4d([pad_w, h, c, n]), 0);
    }
    if pad_h > 0 {
        let [w, _, c, n] = x.ne();
        x = x.concat(last(x, 1).repeat_4d([w, pad_h, c, n]), 1);
    }
    x
}

impl WindowAttention {
    fn new(s: &mut Scope, c: i64) -> WindowAttention {
        WindowAttention {
            norm: GroupNorm::gn32(s, "norm", c),
            q: conv1x1(s, "q", c, c),
            k: conv1x1(s, "k", c, c),
            v: conv1x1(s, "v", c, c),
            proj_out: conv1x1(s, "proj_out", c, c),
        }
    }

    /// `[Wp, Hp, C, N]` → `[C, 32·32, windows·N]`.
    fn to_windows<'g>(x: T<'g>, c: i64) -> T<'g> {
        let x = patchify(x, WINDOW, true);
        let [_, np, n, _] = x.ne();
        let x = x.reshape(&[WINDOW * WINDOW, c, np, n]).permute(1, 0, 2, 3).cont();
        x.reshape(&[c, WINDOW * WINDOW, np * n])
    }

    fn forward<'g>(&self, g: &'g Graph, input: T<'g>) -> T<'g> {
        let [w, h, c, n] = input.ne();
        let pad_w = (WINDOW - w % WINDOW) % WINDOW;
        let pad_h = (WINDOW - h % WINDOW) % WINDOW;
        let (wp, hp) = ((w + pad_w) / WINDOW, (h + pad_h) / WINDOW);
        let x = self.norm.forward(g, input);
        let windows = |conv: &Conv2d| Self::to_windows(replicate_pad(conv.forward(g, x), pad_w, pad_h), c);
        let (q, k, v) = (windows(&self.q), windows(&self.k), windows(&self.v));
        let a = nn::attention(g, q, k, v, 1, None, false, g.options.flash_attn, 1.0);
        let a = a.reshape(&[c, WINDOW * WINDOW, wp * hp, n]).permute(1, 0, 2, 3).cont();
        let mut a = unpatchify(a.reshape(&[WINDOW * WINDOW * c, wp * hp, n]), hp, wp, WINDOW, true);
        if pad_h > 0 || pad_w > 0 {
            let nb = a.nb();
            a = a.view(&[w, h, c, n], &[nb[1], nb[2], nb[3]], 0).cont();
        }
        input.add(self.proj_out.forward(g, a))
    }
}

/// The convolutional decoder of the latent: 128 → 384 channels at the latent's size.
struct LatentDecoder {
    conv_in: Conv2d,
    res: [ResnetBlock; 3],
    attn: [WindowAttention; 2],
    norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl LatentDecoder {
    fn new(s: &mut Scope) -> LatentDecoder {
        let mut s = s.sub("y_embedder.decoder");
        LatentDecoder {
            conv_in: conv3x3(&mut s, "conv_in", LATENT, HIDDEN),
            res: [0, 2, 4].map(|i| ResnetBlock::new(&mut s.sub(&format!("block.{i}")), HIDDEN)),
            attn: [1, 3].map(|i| WindowAttention::new(&mut s.sub(&format!("block.{i}")), HIDDEN)),
            norm_out: GroupNorm::gn32(&mut s, "norm_out", HIDDEN),
            conv_out: conv3x3(&mut s, "conv_out", HIDDEN, HIDDEN),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.conv_in.forward(g, x);
        x = self.res[0].forward(g, x);
        x = self.attn[0].forward(g, x);
        x = self.res[1].forward(g, x);
        x = self.attn[1].forward(g, x);
        x = self.res[2].forward(g, x);
        self.conv_out.forward(g, self.norm_out.forward(g, x).silu())
    }
}

struct Encoder {
    patch_embed: Conv2d,
    head: [DiCoBlock; 2],
    proj_down: Conv2d,
    z_proj: Conv2d,
    fuse_proj: Conv2d,
    t_embedder: TimestepEmbedder,
    blocks: Vec<DiCoBlock>,
    norm_out: LayerNorm2d,
    proj_out: Conv2d,
}

impl Encoder {
    fn new(s: &mut Scope) -> Encoder {
        let mut s = s.sub("student.dconv_encoder");
        Encoder {
            patch_embed: Conv2d::square(&mut s, "patch_cond_embed", 3, 768, PATCH, PATCH as i32, 0),
            head: [0, 1].map(|i| DiCoBlock::new(&mut s, &format!("head_blocks.{i}"), 768, false)),
            proj_down: conv1x1(&mut s, "proj_down", 768, HIDDEN),
            z_proj: conv1x1(&mut s, "z_proj", LATENT, HIDDEN),
            fuse_proj: conv1x1(&mut s, "fuse_proj", 2 * HIDDEN, HIDDEN),
            t_embedder: TimestepEmbedder::new(&mut s),
            blocks: (0..DICO_BLOCKS).map(|i| DiCoBlock::new(&mut s, &format!("blocks.{i}"), HIDDEN, true)).collect(),
            norm_out: LayerNorm2d::new(&mut s, "norm_out", HIDDEN, true),
            proj_out: conv1x1(&mut s, "proj_out", HIDDEN, 2 * LATENT),
        }
    }

    /// Image `[W, H, 3, N]` in [-1, 1] → moments `[W/16, H/16, 256, N]`.
    fn forward<'g>(&self, g: &'g Graph, image: T<'g>) -> T<'g> {
        let mut cond = self.patch_embed.forward(g, image);
        for b in &self.head {
            cond = b.forward(g, cond, None);
        }
        let cond = self.proj_down.forward(g, cond);
        let [w, h, _, n] = cond.ne();
        let z = self.z_proj.forward(g, full(g, 0.0, [w, h, LATENT, n]));
        let mut z = self.fuse_proj.forward(g, cond.concat(z, 2));
        let c = self.t_embedder.forward_zero(g, image.ne()[3]);
        for b in &self.blocks {
            z = b.forward(g, z, Some(c));
        }
        self.proj_out.forward(g, self.norm_out.forward(g, z))
    }
}

/// One of the decoder's per-pixel residual MLPs, modulated per pixel.
struct PixelBlock {
    in_ln: LayerNorm,
    mlp0: Linear,
    mlp2: Linear,
    ada: Linear,
}

impl PixelBlock {
    fn new(s: &mut Scope, i: usize) -> PixelBlock {
        let mut s = s.sub(&format!("dec_net.res_blocks.{i}"));
        PixelBlock {
            in_ln: LayerNorm::new(&mut s, "in_ln", PIXEL_DIM, EPS, true, true),
            mlp0: Linear::new(&mut s, "mlp.0", PIXEL_DIM, PIXEL_DIM, true),
            mlp2: Linear::new(&mut s, "mlp.2", PIXEL_DIM, PIXEL_DIM, true),
            ada: Linear::new(&mut s, "adaLN_modulation.1", PIXEL_DIM, 3 * PIXEL_DIM, true),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, cond: T<'g>) -> T<'g> {
        let m = chunk(self.ada.forward(g, cond.silu()), 3, 0, true);
        let h = self.in_ln.forward(g, x);
        let h = h.mul(m[1].add(full(g, 1.0, [1, 1, 1, 1]))).add(m[0]);
        let h = self.mlp2.forward(g, self.mlp0.forward(g, h).silu());
        x.add(m[2].mul(h))
    }
}

struct Decoder {
    t_embedder: TimestepEmbedder,
    y_embedder_x: Conv2d,
    x_embedder: Linear,
    s_proj1: Conv2d,
    s_proj2: Conv2d,
    blocks: Vec<DiCoBlock>,
    cond_embed: Linear,
    input_proj: Linear,
    res_blocks: Vec<PixelBlock>,
    final_norm: RmsNorm,
    final_linear: Linear,
    latent_decoder: LatentDecoder,
}

impl Decoder {
    fn new(s: &mut Scope) -> Decoder {
        let mut s = s.sub("pipeline");
        let pixels = PATCH * PATCH;
        Decoder {
            t_embedder: TimestepEmbedder::new(&mut s),
            y_embedder_x: conv1x1(&mut s, "y_embedder_x", HIDDEN, PIXEL_DIM * pixels),
            x_embedder: Linear::new(&mut s, "x_embedder.embedder.0", 3 + PIXEL_DIM + DCT, PIXEL_DIM, true),
            s_proj1: Conv2d::new(&mut s, "s_embedder.proj1", 3, LATENT, (PATCH, PATCH), (PATCH as i32, PATCH as i32), (0, 0), false),
            s_proj2: conv1x1(&mut s, "s_embedder.proj2", LATENT + HIDDEN, HIDDEN),
            blocks: (0..DICO_BLOCKS).map(|i| DiCoBlock::new(&mut s, &format!("blocks.{i}"), HIDDEN, true)).collect(),
            cond_embed: Linear::new(&mut s, "dec_net.cond_embed", HIDDEN, pixels * PIXEL_DIM, true),
            input_proj: Linear::new(&mut s, "dec_net.input_proj", PIXEL_DIM, PIXEL_DIM, true),
            res_blocks: (0..3).map(|i| PixelBlock::new(&mut s, i)).collect(),
            final_norm: RmsNorm::new(&mut s.sub("final_layer"), "norm", "weight", PIXEL_DIM, EPS, true),
            final_linear: Linear::new(&mut s, "final_layer.linear", PIXEL_DIM, 3, true),
            latent_decoder: LatentDecoder::new(&mut s),
        }
    }

    /// Latent `[w, h, 128, N]` → image `[16w, 16h, 3, N]`; `dct` `[64, 256, 1]`.
    fn forward<'g>(&self, g: &'g Graph, latent: T<'g>, dct: T<'g>) -> T<'g> {
        let cond = self.latent_decoder.forward(g, latent);
        let [w, h, _, n] = cond.ne();
        let (len, pixels) = (w * h, PATCH * PATCH);
        let image = full(g, 0.0, [w * PATCH, h * PATCH, 3, n]);
        let c = self.t_embedder.forward_zero(g, n);
        let s0 = self.s_proj1.forward(g, image).concat(cond, 2);
        let mut s = self.s_proj2.forward(g, s0);
        for b in &self.blocks {
            s = b.forward(g, s, Some(c));
        }
        let s = s.permute(1, 2, 0, 3).cont().reshape(&[HIDDEN, len * n]);

        let y = self.y_embedder_x.forward(g, cond).reshape(&[len, pixels, PIXEL_DIM, n]);
        let y = y.permute(2, 1, 0, 3).cont().reshape(&[PIXEL_DIM, pixels, len * n]);
        let dct = dct.repeat_4d([DCT, pixels, len * n, 1]);
        let x = full(g, 0.0, [3, pixels, len * n, 1]).concat(y, 0).concat(dct, 0);
        let mut x = self.input_proj.forward(g, self.x_embedder.forward(g, x));
        let dec_cond = self.cond_embed.forward(g, s).reshape(&[PIXEL_DIM, pixels, len * n]);
        for b in &self.res_blocks {
            x = b.forward(g, x, dec_cond);
        }
        let x = self.final_linear.forward(g, self.final_norm.forward(g, x));
        let x = x.reshape(&[3, pixels, len, n]).permute(1, 0, 2, 3).cont().reshape(&[3 * pixels, len, n]);
        unpatchify(x, h, w, PATCH, true)
    }
}

/// The decoder's cosine basis `[64, 256]`: for each pixel of a 16×16 patch (row-major), the
/// 8×8 products `cos(π·x·fx')·cos(π·y·fy') / (1 + fx'·fy')` with `f' = f·8/7`, pixel
/// coordinates in [0, 1], frequency index `fx·8 + fy`.
fn dct_basis() -> Vec<f32> {
    let p = PATCH as usize;
    let pi = std::f32::consts::PI;
    let mut out = vec![0.0f32; DCT as usize * p * p];
    for py in 0..p {
        let y = py as f32 / (p - 1) as f32;
        for px in 0..p {
            let x = px as f32 / (p - 1) as f32;
            let pos = py * p + px;
            for fy in 0..8 {
                for fx in 0..8 {
                    let (freq_x, freq_y) = (fx as f32 * 8.0 / 7.0, fy as f32 * 8.0 / 7.0);
                    let coeff = 1.0 / (1.0 + freq_x * freq_y);
                    out[fx * 8 + fy + 64 * pos] = (x * freq_x * pi).cos() * (y * freq_y * pi).cos() * coeff;
                }
            }
        }
    }
    out
}

/// The Mage VAE, its weights declared under [`PREFIX`].
pub struct MageVae {
    encoder: Encoder,
    decoder: Decoder,
    dct: Vec<f32>,
}

impl MageVae {
    pub fn new(s: &mut Scope) -> MageVae {
        MageVae { encoder: Encoder::new(s), decoder: Decoder::new(s), dct: dct_basis() }
    }
}

impl VaeNet for MageVae {
    fn name(&self) -> &'static str {
        "Mage VAE"
    }

    fn scale(&self) -> usize {
        PATCH as usize
    }

    fn encoder_output_channels(&self) -> i64 {
        2 * LATENT
    }

    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        super::autoencoder_kl::check_input(image, 3, self.scale(), "vae encode")?;
        runner.compute(|g| Ok(self.encoder.forward(g, g.input(image))))
    }

    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        super::autoencoder_kl::check_input(latent, LATENT, 1, "vae decode")?;
        runner.compute(|g| {
            let dct = g.input_f32(&self.dct, &[DCT, PATCH * PATCH, 1]);
            Ok(self.decoder.forward(g, g.input(latent), dct))
        })
    }

    /// `mean + exp(0.5 · clamp(logvar, -20, 10)) · ε`.
    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        let (mean, logvar) = split_moments(out)?;
        let noise = randn(mean.len());
        ensure!(noise.len() == mean.len(), "vae: got {} noise values for {}", noise.len(), mean.len());
        let data = mean.data().iter().zip(logvar.data()).zip(&noise).map(|((&m, &lv), &e)| m + (0.5 * lv.clamp(-20.0, 10.0)).exp() * e).collect();
        Tensor::from_vec(mean.shape(), data)
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        z.clone()
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        z.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dct_basis_corners() {
        let d = dct_basis();
        assert_eq!(d.len(), 64 * 256);
        // Frequency (0, 0) is 1 everywhere; at pixel (0, 0) every cosine is 1.
        assert!((0..256).all(|pos| d[64 * pos] == 1.0));
        assert_eq!(d[9], 1.0 / (1.0 + (8.0f32 / 7.0) * (8.0 / 7.0)));
    }

    #[test]
    fn declares_the_reference_names() {
        let mut store = crate::graph::ParamStore::new(8192).unwrap();
        let types = crate::graph::TypeMap::new();
        MageVae::new(&mut Scope::new(&mut store, &types, PREFIX));
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        assert_eq!(names.len(), 728);
        for n in [
            "student.dconv_encoder.head_blocks.1.norm2.bias",
            "student.dconv_encoder.blocks.20.adaLN_modulation.1.weight",
            "pipeline.y_embedder.decoder.block.3.proj_out.weight",
            "pipeline.dec_net.res_blocks.2.in_ln.bias",
            "pipeline.final_layer.norm.weight",
            "pipeline.s_embedder.proj1.weight",
        ] {
            assert!(names.contains(&format!("{PREFIX}{n}").as_str()), "{n}");
        }
    }
}
