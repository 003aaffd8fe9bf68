//! AutoencoderKL (ldm `AutoencoderKL`): the first stage of SD 1.x, 2.x and SDXL, of SD3 and
//! Flux (16 channels, no quant convolutions) and of Flux.2 (32 channels whose latents are
//! cut into 2×2 patches: 128 channels at 1/16 of the image, see [`VaeConfig::flux2`]).
//!
//! Weights live under `first_stage_model.` with the reference's internal (LDM) names:
//! `encoder.*`, `quant_conv`, `post_quant_conv`, `decoder.*`. Convolutions are f16, norms
//! f32; the mid-block attention projections are 1×1 convolutions, or linear layers when
//! the files hold them as 2-D matrices (diffusers-converted VAEs).
//!
//! The network works in its own domain: the encoder takes images in [-1, 1] and returns
//! moments (mean ‖ logvar, 2·z channels); the decoder takes *VAE-space* latents
//! (diffusion latents / `scale_factor` + `shift_factor`) and returns unclamped images in
//! about [-1, 1]. Range conversion, sampling from the moments and the latent scale factor
//! are host steps in `super::Vae`, like the reference's `VAE` base class.

use crate::error::{Context as _, Result};
use crate::graph::nn::{pad_circular, Conv2d, GroupNorm, Linear};
use crate::graph::{Graph, Runner, Scope, TypeMap, T};
use crate::models::common::dit::chunk;
use crate::tensor::Tensor;

/// Architecture and latent convention of an AutoencoderKL.
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    pub ch: i64,
    /// The decoder's base width; pruned VAEs differ from `ch`.
    pub decoder_ch: i64,
    pub ch_mult: Vec<i64>,
    pub num_res_blocks: usize,
    pub in_channels: i64,
    pub out_ch: i64,
    pub z_channels: i64,
    pub embed_dim: i64,
    pub double_z: bool,
    pub use_quant: bool,
    /// Attention projections are linear layers (per network: encoder, decoder).
    pub encoder_attn_linear: bool,
    pub decoder_attn_linear: bool,
    /// Declare only the decoder (previews); the pipeline's VAE always has both.
    pub decode_only: bool,
    /// diffusion latent = (vae latent - shift_factor) * scale_factor.
    pub scale_factor: f32,
    pub shift_factor: f32,
    /// Encoded latents are the moments' mean, not a sample, and stay in VAE space (the
    /// reference does this for SD 1.x instruct-pix2pix only).
    pub raw_encoder_latents: bool,
    /// Flux.2: the encoder returns the moments' mean cut into 2×2 patches (4·z channels at
    /// half the size), the decoder takes such patches, and diffusion latents are these
    /// normalised per channel with the fixed [`FLUX2_LATENT_MEAN`] / [`FLUX2_LATENT_STD`].
    pub flux2: bool,
    /// Channels the diffusion latents carry in front of the VAE's own (SeFi-Image's 16
    /// semantic channels): dropped before decoding; encoding does not make them.
    pub leading_channels: usize,
}

/// Per-channel mean of Flux.2's patchified latents (the reference's table).
#[rustfmt::skip]
pub const FLUX2_LATENT_MEAN: [f32; 128] = [
    -0.0676, -0.0715, -0.0753, -0.0745, 0.0223, 0.0180, 0.0142, 0.0184,
    -0.0001, -0.0063, -0.0002, -0.0031, -0.0272, -0.0281, -0.0276, -0.0290,
    -0.0769, -0.0672, -0.0902, -0.0892, 0.0168, 0.0152, 0.0079, 0.0086,
    0.0083, 0.0015, 0.0003, -0.0043, -0.0439, -0.0419, -0.0438, -0.0431,
    -0.0102, -0.0132, -0.0066, -0.0048, -0.0311, -0.0306, -0.0279, -0.0180,
    0.0030, 0.0015, 0.0126, 0.0145, 0.0347, 0.0338, 0.0337, 0.0283,
    0.0020, 0.0047, 0.0047, 0.0050, 0.0123, 0.0081, 0.0081, 0.0146,
    0.0681, 0.0679, 0.0767, 0.0732, -0.0462, -0.0474, -0.0392, -0.0511,
    -0.0528, -0.0477, -0.0470, -0.0517, -0.0317, -0.0316, -0.0345, -0.0283,
    0.0510, 0.0445, 0.0578, 0.0458, -0.0412, -0.0458, -0.0487, -0.0467,
    -0.0088, -0.0106, -0.0088, -0.0046, -0.0376, -0.0432, -0.0436, -0.0499,
    0.0118, 0.0166, 0.0203, 0.0279, 0.0113, 0.0129, 0.0016, 0.0072,
    -0.0118, -0.0018, -0.0141, -0.0054, -0.0091, -0.0138, -0.0145, -0.0187,
    0.0323, 0.0305, 0.0259, 0.0300, 0.0540, 0.0614, 0.0495, 0.0590,
    -0.0511, -0.0603, -0.0478, -0.0524, -0.0227, -0.0274, -0.0154, -0.0255,
    -0.0572, -0.0565, -0.0518, -0.0496, 0.0116, 0.0054, 0.0163, 0.0104,
];

/// Per-channel standard deviation of Flux.2's patchified latents (the reference's table).
#[rustfmt::skip]
pub const FLUX2_LATENT_STD: [f32; 128] = [
    1.8029, 1.7786, 1.7868, 1.7837, 1.7717, 1.7590, 1.7610, 1.7479,
    1.7336, 1.7373, 1.7340, 1.7343, 1.8626, 1.8527, 1.8629, 1.8589,
    1.7593, 1.7526, 1.7556, 1.7583, 1.7363, 1.7400, 1.7355, 1.7394,
    1.7342, 1.7246, 1.7392, 1.7304, 1.7551, 1.7513, 1.7559, 1.7488,
    1.8449, 1.8454, 1.8550, 1.8535, 1.8240, 1.7813, 1.7854, 1.7945,
    1.8047, 1.7876, 1.7695, 1.7676, 1.7782, 1.7667, 1.7925, 1.7848,
    1.7579, 1.7407, 1.7483, 1.7368, 1.7961, 1.7998, 1.7920, 1.7925,
    1.7780, 1.7747, 1.7727, 1.7749, 1.7526, 1.7447, 1.7657, 1.7495,
    1.7775, 1.7720, 1.7813, 1.7813, 1.8162, 1.8013, 1.8023, 1.8033,
    1.7527, 1.7331, 1.7563, 1.7482, 1.7610, 1.7507, 1.7681, 1.7613,
    1.7665, 1.7545, 1.7828, 1.7726, 1.7896, 1.7999, 1.7864, 1.7760,
    1.7613, 1.7625, 1.7560, 1.7577, 1.7783, 1.7671, 1.7810, 1.7799,
    1.7201, 1.7068, 1.7265, 1.7091, 1.7793, 1.7578, 1.7502, 1.7455,
    1.7587, 1.7500, 1.7525, 1.7362, 1.7616, 1.7572, 1.7444, 1.7430,
    1.7509, 1.7610, 1.7634, 1.7612, 1.7254, 1.7135, 1.7321, 1.7226,
    1.7664, 1.7624, 1.7718, 1.7664, 1.7457, 1.7441, 1.7569, 1.7530,
];

/// Side of Flux.2's latent patches.
const FLUX2_PATCH: i64 = 2;

impl VaeConfig {
    /// The SD-family VAE (ch 128, mult 1,2,4,4, 2 res blocks, 4 latent channels).
    /// `scale_factor` is the family's (0.18215 SD 1.x/2.x, 0.13025 SDXL).
    pub fn sd(scale_factor: f32, decode_only: bool) -> VaeConfig {
        VaeConfig {
            ch: 128,
            decoder_ch: 128,
            ch_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            in_channels: 3,
            out_ch: 3,
            z_channels: 4,
            embed_dim: 4,
            double_z: true,
            use_quant: true,
            encoder_attn_linear: false,
            decoder_attn_linear: false,
            decode_only,
            scale_factor,
            shift_factor: 0.0,
            raw_encoder_latents: false,
            flux2: false,
            leading_channels: 0,
        }
    }

    /// Turns this into Flux.2's autoencoder: 32 latent channels with quant convolutions,
    /// patchified latents, scale 1 and no shift (the mean/std table does the rest).
    pub fn into_flux2(self) -> VaeConfig {
        VaeConfig { z_channels: 32, embed_dim: 32, use_quant: true, scale_factor: 1.0, shift_factor: 0.0, flux2: true, ..self }
    }

    /// Variants from the files under `prefix` (e.g. `first_stage_model.`), like the
    /// reference: attention projections are linear when `attn_1.proj_out.weight` is 2-D,
    /// and the decoder width comes from `decoder.conv_in.weight`. `shape_of(name)` gives a
    /// file tensor's shape in ggml order (`ne`, as many dims as stored).
    pub fn detect(
        types: &TypeMap,
        prefix: &str,
        shape_of: impl Fn(&str) -> Option<Vec<i64>>,
        scale_factor: f32,
        decode_only: bool,
    ) -> VaeConfig {
        let mut cfg = VaeConfig::sd(scale_factor, decode_only);
        // Any attention block decides the default; each block then follows its own weights.
        let mut names: Vec<&String> =
            types.keys().filter(|n| n.starts_with(prefix) && n.ends_with("attn_1.proj_out.weight")).collect();
        names.sort();
        let default_linear = names.first().and_then(|n| shape_of(n)).is_some_and(|s| s.len() == 2);
        let block_linear = |net: &str| match shape_of(&format!("{prefix}{net}.mid.attn_1.proj_out.weight")) {
            Some(s) if s.len() == 4 => false,
            Some(s) if s.len() == 2 => true,
            _ => default_linear,
        };
        cfg.encoder_attn_linear = block_linear("encoder");
        cfg.decoder_attn_linear = block_linear("decoder");
        if let Some(ne) = shape_of(&format!("{prefix}decoder.conv_in.weight")) {
            let last = *cfg.ch_mult.last().expect("ch_mult");
            if ne.len() >= 4 && ne[3] > 0 {
                if ne[3] % last == 0 {
                    cfg.decoder_ch = ne[3] / last;
                    sd_info!("vae decoder: ch = {}", cfg.decoder_ch);
                } else {
                    sd_warn!("vae decoder: failed to infer ch from {prefix}decoder.conv_in.weight ({} / {last})", ne[3]);
                }
            }
        }
        cfg
    }

    fn moments_channels(&self) -> i64 {
        self.z_channels * if self.double_z { 2 } else { 1 }
    }

    /// Channels of the encoder's output (moments; Flux.2: the patchified mean).
    pub fn encoder_output_channels(&self) -> i64 {
        if self.flux2 {
            self.z_channels * FLUX2_PATCH * FLUX2_PATCH
        } else {
            self.moments_channels()
        }
    }

    /// Channels of the latents the decoder takes.
    pub fn latent_channels(&self) -> i64 {
        if self.flux2 {
            self.z_channels * FLUX2_PATCH * FLUX2_PATCH
        } else {
            self.z_channels
        }
    }

    /// Pixels per latent pixel.
    pub fn scale(&self) -> usize {
        if self.flux2 {
            16
        } else {
            8
        }
    }
}

/// Residual block without time embedding.
struct ResnetBlock {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    nin_shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    fn new(s: &mut Scope, name: &str, cin: i64, cout: i64) -> ResnetBlock {
        let mut s = s.sub(name);
        ResnetBlock {
            norm1: GroupNorm::gn32(&mut s, "norm1", cin),
            conv1: Conv2d::square(&mut s, "conv1", cin, cout, 3, 1, 1),
            norm2: GroupNorm::gn32(&mut s, "norm2", cout),
            conv2: Conv2d::square(&mut s, "conv2", cout, cout, 3, 1, 1),
            nin_shortcut: (cin != cout).then(|| Conv2d::square(&mut s, "nin_shortcut", cin, cout, 1, 1, 0)),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut h = self.norm1.forward(g, x).silu_inplace();
        h = self.conv1.forward(g, h);
        h = self.norm2.forward(g, h).silu_inplace();
        h = self.conv2.forward(g, h);
        let skip = match &self.nin_shortcut {
            Some(c) => c.forward(g, x),
            None => x,
        };
        h.add(skip)
    }

    fn convs(&mut self) -> Vec<&mut Conv2d> {
        let mut v = vec![&mut self.conv1, &mut self.conv2];
        v.extend(self.nin_shortcut.as_mut());
        v
    }
}

/// A q/k/v/out projection: 1×1 convolution or linear layer, as the files have it.
enum Proj {
    Conv(Conv2d),
    Linear(Linear),
}

impl Proj {
    fn new(s: &mut Scope, name: &str, ch: i64, linear: bool) -> Proj {
        if linear {
            Proj::Linear(Linear::new(s, name, ch, ch, true))
        } else {
            Proj::Conv(Conv2d::square(s, name, ch, ch, 1, 1, 0))
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            Proj::Conv(c) => c.forward(g, x),
            Proj::Linear(l) => l.forward(g, x),
        }
    }
}

/// Single-head self-attention over all pixels.
struct AttnBlock {
    norm: GroupNorm,
    q: Proj,
    k: Proj,
    v: Proj,
    proj_out: Proj,
    linear: bool,
}

impl AttnBlock {
    fn new(s: &mut Scope, name: &str, ch: i64, linear: bool) -> AttnBlock {
        let mut s = s.sub(name);
        AttnBlock {
            norm: GroupNorm::gn32(&mut s, "norm", ch),
            q: Proj::new(&mut s, "q", ch, linear),
            k: Proj::new(&mut s, "k", ch, linear),
            v: Proj::new(&mut s, "v", ch, linear),
            proj_out: Proj::new(&mut s, "proj_out", ch, linear),
            linear,
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h_ = self.norm.forward(g, x);
        let [w, h, c, n] = h_.ne();
        // [W, H, C, N] → [C, W·H, N]
        let tokens = |t: T<'g>| t.permute(1, 2, 0, 3).cont().reshape(&[c, h * w, n]);
        // [C, W·H, N] → [W, H, C, N]
        let image = |t: T<'g>| t.permute(1, 0, 2, 3).cont().reshape(&[w, h, c, n]);
        let out = if self.linear {
            let t = tokens(h_);
            let (q, k, v) = (self.q.forward(g, t), self.k.forward(g, t), self.v.forward(g, t));
            let a = crate::graph::nn::attention(g, q, k, v, 1, None, false, g.options.flash_attn, 1.0);
            image(self.proj_out.forward(g, a))
        } else {
            let q = tokens(self.q.forward(g, h_));
            let k = tokens(self.k.forward(g, h_));
            let v = tokens(self.v.forward(g, h_));
            let a = crate::graph::nn::attention(g, q, k, v, 1, None, false, g.options.flash_attn, 1.0);
            self.proj_out.forward(g, image(a))
        };
        out.add(x)
    }

    fn convs(&mut self) -> Vec<&mut Conv2d> {
        [&mut self.q, &mut self.k, &mut self.v, &mut self.proj_out]
            .into_iter()
            .filter_map(|p| match p {
                Proj::Conv(c) => Some(c),
                Proj::Linear(_) => None,
            })
            .collect()
    }
}

/// Middle of both networks: resnet, attention, resnet.
struct Mid {
    block_1: ResnetBlock,
    attn_1: AttnBlock,
    block_2: ResnetBlock,
}

impl Mid {
    fn new(s: &mut Scope, ch: i64, linear: bool) -> Mid {
        Mid {
            block_1: ResnetBlock::new(s, "mid.block_1", ch, ch),
            attn_1: AttnBlock::new(s, "mid.attn_1", ch, linear),
            block_2: ResnetBlock::new(s, "mid.block_2", ch, ch),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.block_1.forward(g, x);
        let h = self.attn_1.forward(g, h);
        self.block_2.forward(g, h)
    }

    fn convs(&mut self) -> Vec<&mut Conv2d> {
        let mut v = self.block_1.convs();
        v.extend(self.attn_1.convs());
        v.extend(self.block_2.convs());
        v
    }
}

/// One resolution level: resnet blocks, then an optional down/upsampling conv.
struct Level {
    blocks: Vec<ResnetBlock>,
    resample: Option<Conv2d>,
}

impl Level {
    fn convs(&mut self) -> Vec<&mut Conv2d> {
        let mut v: Vec<&mut Conv2d> = self.blocks.iter_mut().flat_map(|b| b.convs()).collect();
        v.extend(self.resample.as_mut());
        v
    }
}

struct Encoder {
    conv_in: Conv2d,
    down: Vec<Level>,
    mid: Mid,
    norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Encoder {
    fn new(s: &mut Scope, cfg: &VaeConfig) -> Encoder {
        let mut s = s.sub("encoder");
        let ch = cfg.ch;
        let conv_in = Conv2d::square(&mut s, "conv_in", cfg.in_channels, ch, 3, 1, 1);
        let mut block_in = ch;
        let mut down = Vec::new();
        for (i, &mult) in cfg.ch_mult.iter().enumerate() {
            let block_out = ch * mult;
            let blocks = (0..cfg.num_res_blocks)
                .map(|j| {
                    let b = ResnetBlock::new(&mut s, &format!("down.{i}.block.{j}"), block_in, block_out);
                    block_in = block_out;
                    b
                })
                .collect();
            // Asymmetric padding is added in forward, so the conv itself pads nothing.
            let resample = (i + 1 != cfg.ch_mult.len()).then(|| {
                Conv2d::square(&mut s, &format!("down.{i}.downsample.conv"), block_in, block_in, 3, 2, 0)
            });
            down.push(Level { blocks, resample });
        }
        Encoder {
            conv_in,
            down,
            mid: Mid::new(&mut s, block_in, cfg.encoder_attn_linear),
            norm_out: GroupNorm::gn32(&mut s, "norm_out", block_in),
            conv_out: Conv2d::square(&mut s, "conv_out", block_in, cfg.moments_channels(), 3, 1, 1),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut h = self.conv_in.forward(g, x);
        for level in &self.down {
            for b in &level.blocks {
                h = b.forward(g, h);
            }
            if let Some(conv) = &level.resample {
                // torch pads (0, 1, 0, 1): one column right, one row at the bottom.
                h = pad_circular(g, h, [0; 4], [1, 1, 0, 0]);
                h = conv.forward(g, h);
            }
        }
        h = self.mid.forward(g, h);
        h = self.norm_out.forward(g, h).silu_inplace();
        self.conv_out.forward(g, h)
    }

    fn convs(&mut self) -> Vec<&mut Conv2d> {
        let mut v = vec![&mut self.conv_in];
        v.extend(self.down.iter_mut().flat_map(Level::convs));
        v.extend(self.mid.convs());
        v.push(&mut self.conv_out);
        v
    }
}

struct Decoder {
    conv_in: Conv2d,
    mid: Mid,
    /// Indexed by resolution level (`up.{i}`), run from the last to the first.
    up: Vec<Level>,
    norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl Decoder {
    fn new(s: &mut Scope, cfg: &VaeConfig) -> Decoder {
        let mut s = s.sub("decoder");
        let ch = cfg.decoder_ch;
        let levels = cfg.ch_mult.len();
        let mut block_in = ch * cfg.ch_mult[levels - 1];
        let conv_in = Conv2d::square(&mut s, "conv_in", cfg.z_channels, block_in, 3, 1, 1);
        let mid = Mid::new(&mut s, block_in, cfg.decoder_attn_linear);
        let mut up: Vec<Option<Level>> = (0..levels).map(|_| None).collect();
        for i in (0..levels).rev() {
            let block_out = ch * cfg.ch_mult[i];
            let blocks = (0..cfg.num_res_blocks + 1)
                .map(|j| {
                    let b = ResnetBlock::new(&mut s, &format!("up.{i}.block.{j}"), block_in, block_out);
                    block_in = block_out;
                    b
                })
                .collect();
            let resample =
                (i != 0).then(|| Conv2d::square(&mut s, &format!("up.{i}.upsample.conv"), block_in, block_in, 3, 1, 1));
            up[i] = Some(Level { blocks, resample });
        }
        Decoder {
            conv_in,
            mid,
            up: up.into_iter().map(|l| l.expect("every level declared")).collect(),
            norm_out: GroupNorm::gn32(&mut s, "norm_out", block_in),
            conv_out: Conv2d::square(&mut s, "conv_out", block_in, cfg.out_ch, 3, 1, 1),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let mut h = self.conv_in.forward(g, z);
        h = self.mid.forward(g, h);
        for level in self.up.iter().rev() {
            for b in &level.blocks {
                h = b.forward(g, h);
            }
            if let Some(conv) = &level.resample {
                h = conv.forward(g, h.upscale(2));
            }
        }
        h = self.norm_out.forward(g, h).silu_inplace();
        self.conv_out.forward(g, h)
    }

    fn convs(&mut self) -> Vec<&mut Conv2d> {
        let mut v = vec![&mut self.conv_in];
        v.extend(self.mid.convs());
        v.extend(self.up.iter_mut().flat_map(Level::convs));
        v.push(&mut self.conv_out);
        v
    }
}

/// The autoencoder's weights and graph builders.
pub struct AutoEncoderKL {
    pub cfg: VaeConfig,
    encoder: Option<Encoder>,
    quant_conv: Option<Conv2d>,
    post_quant_conv: Option<Conv2d>,
    decoder: Decoder,
}

/// Where the reference loads the first stage.
pub const PREFIX: &str = "first_stage_model.";

impl AutoEncoderKL {
    /// Declares every weight under the scope (use a scope with prefix [`PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &VaeConfig) -> AutoEncoderKL {
        let decoder = Decoder::new(s, cfg);
        let post_quant_conv =
            cfg.use_quant.then(|| Conv2d::square(s, "post_quant_conv", cfg.z_channels, cfg.embed_dim, 1, 1, 0));
        let (encoder, quant_conv) = if cfg.decode_only {
            (None, None)
        } else {
            let factor = if cfg.double_z { 2 } else { 1 };
            let enc = Encoder::new(s, cfg);
            let qc = cfg.use_quant.then(|| {
                Conv2d::square(s, "quant_conv", cfg.embed_dim * factor, cfg.z_channels * factor, 1, 1, 0)
            });
            (Some(enc), qc)
        };
        AutoEncoderKL { cfg: cfg.clone(), encoder, quant_conv, post_quant_conv, decoder }
    }

    /// Scales the input of every convolution by `scale` (and the result back), keeping
    /// f16 im2col in range. The reference does this with 1/32 for SDXL when no separate
    /// VAE is given (the original SDXL VAE overflows in f16) or when forced.
    pub fn set_conv2d_scale(&mut self, scale: f32) {
        let mut convs = self.decoder.convs();
        convs.extend(self.post_quant_conv.as_mut());
        if let Some(e) = self.encoder.as_mut() {
            convs.extend(e.convs());
        }
        convs.extend(self.quant_conv.as_mut());
        for c in convs {
            c.scale = scale;
        }
    }

    pub fn has_encoder(&self) -> bool {
        self.encoder.is_some()
    }

    /// VAE-space latent [w, h, z, N] → image [8w, 8h, 3, N] in about [-1, 1] (unclamped).
    /// Flux.2: [w, h, 4z, N] patches → [16w, 16h, 3, N].
    pub fn decode_graph<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let z = if self.cfg.flux2 { unpatchify_latent(z, FLUX2_PATCH) } else { z };
        let z = match &self.post_quant_conv {
            Some(c) => c.forward(g, z),
            None => z,
        };
        self.decoder.forward(g, z)
    }

    /// Image [W, H, 3, N] in [-1, 1] → moments [W/8, H/8, 2z, N] (mean channels first).
    /// Flux.2: the mean only, as patches [W/16, H/16, 4z, N].
    pub fn encode_graph<'g>(&self, g: &'g Graph, x: T<'g>) -> Result<T<'g>> {
        let enc = self.encoder.as_ref().context("this VAE was loaded for decoding only")?;
        let z = enc.forward(g, x);
        let z = match &self.quant_conv {
            Some(c) => c.forward(g, z),
            None => z,
        };
        if self.cfg.flux2 {
            let mean = chunk(z, 2, 2, true)[0];
            return Ok(patchify_latent(mean, FLUX2_PATCH));
        }
        Ok(z)
    }
}

/// [W, H, C, N] → [W/p, H/p, C·p·p, N]: each p×p block of a channel becomes p·p channels
/// (row-major inside the block), channel by channel.
pub(super) fn patchify_latent<'g>(z: T<'g>, p: i64) -> T<'g> {
    let [w_full, h_full, c, n] = z.ne();
    let (w, h) = (w_full / p, h_full / p);
    let z = z.reshape(&[p, w, p, h * c * n]).permute(0, 2, 1, 3).cont();
    let z = z.reshape(&[p * p, w * h, c, n]).permute(1, 0, 2, 3).cont();
    z.reshape(&[w, h, p * p * c, n])
}

/// Inverse of [`patchify_latent`].
pub(super) fn unpatchify_latent<'g>(z: T<'g>, p: i64) -> T<'g> {
    let [w, h, cpp, n] = z.ne();
    let c = cpp / p / p;
    let z = z.reshape(&[w * h, p * p, c, n]).permute(1, 0, 2, 3).cont();
    let z = z.reshape(&[p, p, w, h * c * n]).permute(0, 2, 1, 3).cont();
    z.reshape(&[w * p, h * p, c, n])
}


/// Largest side we build graphs for (ggml's int sizes and our buffers).
const MAX_SIDE: usize = 1 << 16;

pub(crate) fn check_input(t: &Tensor, channels: i64, min_side: usize, what: &str) -> Result<()> {
    ensure!(t.shape().len() <= 4, "{what}: expected a 4-D tensor, got shape {:?}", t.shape());
    let (w, h, c, n) = (t.ne(0), t.ne(1), t.ne(2), t.ne(3));
    ensure!(c as i64 == channels, "{what}: expected {channels} channels, got {c}");
    ensure!(
        (min_side..=MAX_SIDE).contains(&w) && (min_side..=MAX_SIDE).contains(&h) && (1..=4096).contains(&n),
        "{what}: unsupported size {w}x{h} (batch {n})"
    );
    Ok(())
}

/// Runs the encoder: image [W, H, 3, N] in [-1, 1] → moments [W/8, H/8, 8, N] (see
/// [`AutoEncoderKL::encode_graph`]).
pub fn encode(runner: &mut Runner, vae: &AutoEncoderKL, image: &Tensor) -> Result<Tensor> {
    let scale = vae.cfg.scale();
    check_input(image, vae.cfg.in_channels, scale, "vae encode")?;
    if vae.cfg.flux2 {
        ensure!(image.ne(0) % scale == 0 && image.ne(1) % scale == 0, "vae encode: Flux.2 needs sides that are multiples of {scale}, got {}x{}", image.ne(0), image.ne(1));
    }
    // The encoder's latent is sampled further: ggml's convolution sums (see
    // `graph::context::winograd_wanted`).
    let winograd = runner.options.encoder_winograd();
    let moments = runner.compute(|g| vae.encode_graph(g, g.input(image)));
    runner.options.cpu_winograd = winograd;
    moments
}

/// Runs the decoder: VAE-space latent [w, h, 4, N] → image [8w, 8h, 3, N], unclamped, in
/// about [-1, 1].
pub fn decode(runner: &mut Runner, vae: &AutoEncoderKL, latent: &Tensor) -> Result<Tensor> {
    check_input(latent, vae.cfg.latent_channels(), 1, "vae decode")?;
    runner.compute(|g| Ok(vae.decode_graph(g, g.input(latent))))
}

impl super::VaeNet for AutoEncoderKL {
    fn name(&self) -> &'static str {
        "AutoencoderKL"
    }

    fn scale(&self) -> usize {
        self.cfg.scale()
    }

    fn encoder_output_channels(&self) -> i64 {
        self.cfg.encoder_output_channels()
    }

    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        encode(runner, self, image)
    }

    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        decode(runner, self, latent)
    }

    /// Samples the diagonal Gaussian with noise `randn(n)` (n standard normals from the
    /// generation RNG, in element order of the mean [w, h, 4, N]); Flux.2's output already is
    /// the latent, and instruct-pix2pix (`raw_encoder_latents`) takes the mean.
    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        if self.cfg.flux2 {
            return Ok(out.clone());
        }
        let (mean, logvar) = super::split_moments(out)?;
        if self.cfg.raw_encoder_latents {
            return Ok(mean);
        }
        let noise = randn(mean.len());
        ensure!(noise.len() == mean.len(), "vae: got {} noise values for {}", noise.len(), mean.len());
        let data = mean
            .data()
            .iter()
            .zip(logvar.data())
            .zip(&noise)
            .map(|((&m, &lv), &e)| m + (0.5 * lv.clamp(-30.0, 20.0)).exp() * e)
            .collect();
        Tensor::from_vec(mean.shape(), data)
    }

    /// `(z - shift) * scale_factor`; Flux.2 normalises per channel; identity for
    /// instruct-pix2pix.
    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        let (scale, shift) = (self.cfg.scale_factor, self.cfg.shift_factor);
        if self.cfg.raw_encoder_latents {
            z.clone()
        } else if self.cfg.flux2 {
            super::per_channel(z, FLUX2_LATENT_MEAN.len(), |v, c| ((v - FLUX2_LATENT_MEAN[c]) * scale) / FLUX2_LATENT_STD[c])
        } else {
            z.map(|v| (v - shift) * scale)
        }
    }

    /// `z / scale_factor + shift`; Flux.2 per channel (after the leading channels the VAE
    /// does not read).
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        let (scale, shift) = (self.cfg.scale_factor, self.cfg.shift_factor);
        let dropped;
        let z = if self.cfg.leading_channels > 0 {
            dropped = super::drop_leading_channels(z, self.cfg.leading_channels);
            &dropped
        } else {
            z
        };
        if self.cfg.flux2 {
            super::per_channel(z, FLUX2_LATENT_MEAN.len(), |v, c| (v * FLUX2_LATENT_STD[c]) / scale + FLUX2_LATENT_MEAN[c])
        } else {
            z.map(|v| v / scale + shift)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::vae::testutil::{assert_matches_numpy, cpu, load_kl, load_kl_with, pattern};

    #[test]
    fn config_detects_sd_layout() {
        let (store, vae, _) = load_kl(false);
        assert_eq!(vae.cfg, VaeConfig::sd(0.18215, false));
        // Every tensor of the file is declared (248), with conv weights in f16.
        assert_eq!(store.len(), 248);
        let w = store.get("first_stage_model.decoder.mid.attn_1.q.weight").unwrap();
        assert_eq!((w.ty(), w.ne()), (crate::graph::F16, [1, 1, 512, 512]));
        let n = store.get("first_stage_model.encoder.norm_out.weight").unwrap();
        assert_eq!(n.ty(), crate::graph::F32);
        assert_eq!(vae.cfg.encoder_output_channels(), 8);
        // The conv scale reaches every convolution (all f16 weights here).
        let mut vae = vae;
        vae.set_conv2d_scale(0.25);
        let mut convs = vae.decoder.convs();
        convs.extend(vae.encoder.as_mut().unwrap().convs());
        let f16_weights = store.entries().filter(|(_, w)| w.ty() == crate::graph::F16).count();
        assert_eq!(convs.len() + 2, f16_weights);
        assert!(convs.iter().all(|c| c.scale == 0.25));
        assert_eq!(vae.quant_conv.unwrap().scale, 0.25);
    }

    #[test]
    fn decoder_matches_numpy() {
        let (_store, vae, path) = load_kl(true);
        assert!(!vae.has_encoder());
        let mut runner = Runner::new(cpu(), 2);
        let z = pattern(&[8, 8, 4, 1], -2.5, 2.5, 1);
        let ours = decode(&mut runner, &vae, &z).unwrap();
        assert_eq!(ours.shape(), &[64, 64, 3, 1]);
        assert_matches_numpy("kl decode", "kl-decode", &path, &z, &ours);
        // Decode-only: encoding is an error, not a crash.
        assert!(encode(&mut runner, &vae, &Tensor::zeros(&[8, 8, 3, 1])).is_err());
    }

    /// Linear attention projections (diffusers-converted VAEs), the SDXL conv scale, flash
    /// attention and direct convolution compute the same function.
    #[test]
    fn decoder_variants_match_numpy() {
        let (_store, mut vae, path) = load_kl_with(true, |cfg| cfg.decoder_attn_linear = true);
        vae.set_conv2d_scale(1.0 / 32.0);
        let mut runner = Runner::new(cpu(), 2);
        runner.options.flash_attn = true;
        runner.options.conv_direct = true;
        let z = pattern(&[8, 8, 4, 1], -2.5, 2.5, 1);
        let ours = decode(&mut runner, &vae, &z).unwrap();
        assert_matches_numpy("kl decode (linear attn, conv scale, flash, direct)", "kl-decode", &path, &z, &ours);
    }

    /// Flux.2's latent patches: channel c's 2×2 block becomes channels 4c..4c+4 (row-major
    /// inside the block), and unpatchify gives the latent back.
    #[test]
    fn flux2_latent_patches_round_trip() {
        let (w, h, c) = (4i64, 2i64, 2i64);
        let data: Vec<f32> = (0..w * h * c).map(|v| v as f32).collect();
        let mut runner = Runner::new(cpu(), 1);
        let patches = runner.compute(|g| Ok(patchify_latent(g.input_f32(&data, &[w, h, c, 1]), 2))).unwrap();
        assert_eq!(patches.shape(), &[2, 1, 8, 1]);
        // Patch 1 (x 2..4) of channel 1: pixels 8 + (2, 3, 6, 7).
        let at = |ch: usize| patches.data()[ch * 2 + 1];
        assert_eq!((at(4), at(5), at(6), at(7)), (10.0, 11.0, 14.0, 15.0));
        let back = runner
            .compute(|g| Ok(unpatchify_latent(patchify_latent(g.input_f32(&data, &[w, h, c, 1]), 2), 2)))
            .unwrap();
        assert_eq!(back.data(), &data[..]);
        let cfg = VaeConfig::sd(0.18215, false).into_flux2();
        assert_eq!((cfg.latent_channels(), cfg.encoder_output_channels(), cfg.scale()), (128, 128, 16));
    }

    #[test]
    fn detect_follows_the_files() {
        let mut types = TypeMap::new();
        for net in ["encoder", "decoder"] {
            types.insert(format!("{PREFIX}{net}.mid.attn_1.proj_out.weight"), crate::graph::F16);
        }
        types.insert(format!("{PREFIX}decoder.conv_in.weight"), crate::graph::F16);
        let shapes = |n: &str| -> Option<Vec<i64>> {
            if n.ends_with("decoder.conv_in.weight") {
                Some(vec![3, 3, 4, 256]) // a pruned decoder: 256 / 4 = 64
            } else if n.contains("decoder.mid.attn_1") {
                Some(vec![512, 512])
            } else if n.contains("attn_1.proj_out") {
                Some(vec![1, 1, 512, 512])
            } else {
                None
            }
        };
        let cfg = VaeConfig::detect(&types, PREFIX, shapes, 0.13025, false);
        assert_eq!((cfg.encoder_attn_linear, cfg.decoder_attn_linear), (false, true));
        assert_eq!((cfg.ch, cfg.decoder_ch), (128, 64));
        assert_eq!(cfg.scale_factor, 0.13025);
        // Only 2-D weights anywhere: the default becomes linear for blocks without weights.
        let cfg = VaeConfig::detect(&types, PREFIX, |_| Some(vec![512, 512]), 0.18215, true);
        assert!(cfg.encoder_attn_linear && cfg.decoder_attn_linear);
    }

    #[test]
    fn encoder_matches_numpy() {
        let (_store, vae, path) = load_kl(false);
        let mut runner = Runner::new(cpu(), 2);
        let x = pattern(&[64, 64, 3, 1], -1.0, 1.0, 2);
        let ours = encode(&mut runner, &vae, &x).unwrap();
        assert_eq!(ours.shape(), &[8, 8, 8, 1]);
        assert_matches_numpy("kl encode", "kl-encode", &path, &x, &ours);
        // User-controlled sizes are checked before building a graph.
        assert!(encode(&mut runner, &vae, &Tensor::zeros(&[4, 4, 3, 1])).is_err());
        assert!(encode(&mut runner, &vae, &Tensor::zeros(&[16, 16, 4, 1])).is_err());
        assert!(decode(&mut runner, &vae, &Tensor::zeros(&[8, 8, 3, 1])).is_err());
    }
}
