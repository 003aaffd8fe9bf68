//! TAESD, the tiny autoencoder (madebyollin/taesd) for SD-family latents, and TAEF2 for
//! Flux.2's: 32 channels, a pooled group-norm branch in the blocks next to the latent, and
//! the latent patchified 2×2 like the Flux.2 VAE's (128 channels at 1/16).
//!
//! The reference loads a `--taesd` file under the prefix `tae.`: weights are
//! `tae.decoder.layers.{i}.*` and `tae.encoder.layers.{i}.*` (numbered like the torch
//! `nn.Sequential`, so ReLU/Upsample slots have no weights). Convolutions are f16.
//!
//! Unlike AutoencoderKL, TAESD works directly on *diffusion* latents (already scaled) and
//! on images in [0, 1]: the encoder takes [0, 1] pixels, the decoder returns pixels in
//! about [0, 1], unclamped. No range conversion or latent scaling happens around it.

use crate::error::{Context as _, Result};
use super::autoencoder_kl::{patchify_latent, unpatchify_latent};
use crate::graph::nn::{scale, Conv2d, GroupNorm};
use crate::graph::{Graph, Runner, Scope, TypeMap, T};
use crate::tensor::Tensor;

/// Where the reference loads a TAESD file.
pub const PREFIX: &str = "tae.";

const CHANNELS: i64 = 64;
const BLOCKS_PER_STAGE: usize = 3;

#[derive(Clone, Debug, PartialEq)]
pub struct TaeConfig {
    /// 4 for taesd / taesdxl.
    pub z_channels: i64,
    /// Without the encoder (previews).
    pub decode_only: bool,
    /// TAEF2: the side of the latent patches (2; 1 for TAESD) and the group-norm branch of
    /// the blocks next to the latent.
    pub patch: i64,
}

impl TaeConfig {
    /// Latent channels from the decoder's first convolution (`shape_of` gives ggml-order
    /// shapes of the file tensors); 4 when absent.
    pub fn detect(types: &TypeMap, prefix: &str, shape_of: impl Fn(&str) -> Option<Vec<i64>>, decode_only: bool) -> TaeConfig {
        let name = format!("{prefix}decoder.layers.0.weight");
        let z_channels = match (types.contains_key(&name), shape_of(&name)) {
            (true, Some(ne)) if ne.len() == 4 => ne[2],
            _ => 4,
        };
        TaeConfig { z_channels, decode_only, patch: 1 }
    }

    /// TAEF2, for Flux.2's patchified latents (what the reference builds for every family
    /// with the Flux.2 VAE, whatever the file holds).
    pub fn into_flux2(self) -> TaeConfig {
        TaeConfig { z_channels: FLUX2_Z_CHANNELS, patch: 2, ..self }
    }

    /// Channels of the diffusion latents it reads and writes.
    pub fn latent_channels(&self) -> i64 {
        self.z_channels * self.patch * self.patch
    }

    fn taef2(&self) -> bool {
        self.patch > 1
    }
}

const FLUX2_Z_CHANNELS: i64 = 32;
/// TAEF2's pooled branch: 1×1 up to 4× the channels, group norm (torch's default eps), ReLU,
/// 1×1 back, added to the block's input.
const POOL_WIDTH: i64 = 4;
const POOL_GROUPS: i32 = 4;
const POOL_EPS: f32 = 1e-5;

struct Pool {
    up: Conv2d,
    norm: GroupNorm,
    down: Conv2d,
}

/// conv-relu-conv-relu-conv plus identity skip, then ReLU (TAEF2's pooled branch first
/// where it has one).
struct Block {
    conv: [Conv2d; 3],
    pool: Option<Pool>,
}

impl Block {
    fn new(s: &mut Scope, name: &str, pooled: bool) -> Block {
        let mut s = s.sub(name);
        let c = CHANNELS;
        let wide = c * POOL_WIDTH;
        let pool = pooled.then(|| Pool {
            up: Conv2d::new(&mut s, "pool.0", c, wide, (1, 1), (1, 1), (0, 0), false),
            norm: GroupNorm::new(&mut s, "pool.1", POOL_GROUPS, wide, true).with_eps(POOL_EPS),
            down: Conv2d::new(&mut s, "pool.3", wide, c, (1, 1), (1, 1), (0, 0), false),
        });
        Block {
            conv: [
                Conv2d::square(&mut s, "conv.0", c, c, 3, 1, 1),
                Conv2d::square(&mut s, "conv.2", c, c, 3, 1, 1),
                Conv2d::square(&mut s, "conv.4", c, c, 3, 1, 1),
            ],
            pool,
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = match &self.pool {
            Some(p) => {
                let h = p.norm.forward(g, p.up.forward(g, x)).relu_inplace();
                x.add(p.down.forward(g, h))
            }
            None => x,
        };
        let mut h = self.conv[0].forward(g, x).relu_inplace();
        h = self.conv[1].forward(g, h).relu_inplace();
        h = self.conv[2].forward(g, h);
        h.add(x).relu_inplace()
    }
}

/// A layer of the sequential stacks.
enum Layer {
    Conv(Conv2d),
    Block(Box<Block>),
    Relu,
    Upsample,
}

impl Layer {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            Layer::Conv(c) => c.forward(g, x),
            Layer::Block(b) => b.forward(g, x),
            Layer::Relu => x.relu_inplace(),
            Layer::Upsample => x.upscale(2),
        }
    }
}

/// Declares the numbered layers of one stack.
struct Stack<'a> {
    s: Scope<'a>,
    layers: Vec<Layer>,
}

impl Stack<'_> {
    fn name(&self) -> String {
        self.layers.len().to_string()
    }

    fn conv(&mut self, cin: i64, cout: i64, stride: i32, bias: bool) {
        let name = self.name();
        let c = Conv2d::new(&mut self.s, &name, cin, cout, (3, 3), (stride, stride), (1, 1), bias);
        self.layers.push(Layer::Conv(c));
    }

    fn blocks(&mut self, n: usize, pooled: bool) {
        for _ in 0..n {
            let name = self.name();
            let b = Block::new(&mut self.s, &name, pooled);
            self.layers.push(Layer::Block(Box::new(b)));
        }
    }
}

fn run<'g>(layers: &[Layer], g: &'g Graph, x: T<'g>) -> T<'g> {
    layers.iter().fold(x, |h, l| l.forward(g, h))
}

pub struct TinyAutoEncoder {
    pub cfg: TaeConfig,
    decoder: Vec<Layer>,
    encoder: Option<Vec<Layer>>,
}

impl TinyAutoEncoder {
    /// Declares the weights under the scope (use a scope with prefix [`PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &TaeConfig) -> TinyAutoEncoder {
        let c = CHANNELS;
        let mut d = Stack { s: s.sub("decoder.layers"), layers: Vec::new() };
        d.conv(cfg.z_channels, c, 1, true);
        d.layers.push(Layer::Relu);
        for stage in 0..3 {
            d.blocks(BLOCKS_PER_STAGE, stage == 0 && cfg.taef2());
            d.layers.push(Layer::Upsample);
            d.conv(c, c, 1, false);
        }
        d.blocks(1, false);
        d.conv(c, 3, 1, true);
        let decoder = d.layers;

        let encoder = (!cfg.decode_only).then(|| {
            let mut e = Stack { s: s.sub("encoder.layers"), layers: Vec::new() };
            e.conv(3, c, 1, true);
            e.blocks(1, false);
            for stage in 0..3 {
                e.conv(c, c, 2, false);
                e.blocks(BLOCKS_PER_STAGE, stage == 2 && cfg.taef2());
            }
            e.conv(c, cfg.z_channels, 1, true);
            e.layers
        });
        TinyAutoEncoder { cfg: cfg.clone(), decoder, encoder }
    }

    /// Diffusion latent [w, h, z·p², N] → image [8pw, 8ph, 3, N] in about [0, 1].
    pub fn decode_graph<'g>(&self, g: &'g Graph, z: T<'g>) -> T<'g> {
        let z = if self.cfg.taef2() { unpatchify_latent(z, self.cfg.patch) } else { z };
        // Soft clamp of the latents to ±3.
        let h = scale(z, 1.0 / 3.0, false).tanh_inplace();
        let h = scale(h, 3.0, false);
        run(&self.decoder, g, h)
    }

    /// Image [W, H, 3, N] in [0, 1] → diffusion latent [W/8p, H/8p, z·p², N].
    pub fn encode_graph<'g>(&self, g: &'g Graph, x: T<'g>) -> Result<T<'g>> {
        let enc = self.encoder.as_ref().context("this TAESD was loaded for decoding only")?;
        let z = run(enc, g, x);
        Ok(if self.cfg.taef2() { patchify_latent(z, self.cfg.patch) } else { z })
    }

    pub fn has_encoder(&self) -> bool {
        self.encoder.is_some()
    }
}

/// Runs the decoder: diffusion latent [w, h, z·p², N] → image [8pw, 8ph, 3, N] in about [0, 1].
pub fn decode(runner: &mut Runner, tae: &TinyAutoEncoder, latent: &Tensor) -> Result<Tensor> {
    super::autoencoder_kl::check_input(latent, tae.cfg.latent_channels(), 1, "taesd decode")?;
    runner.compute(|g| Ok(tae.decode_graph(g, g.input(latent))))
}

/// Runs the encoder: image [W, H, 3, N] in [0, 1] → diffusion latent [W/8p, H/8p, z·p², N].
pub fn encode(runner: &mut Runner, tae: &TinyAutoEncoder, image: &Tensor) -> Result<Tensor> {
    super::autoencoder_kl::check_input(image, 3, super::SCALE * tae.cfg.patch as usize, "taesd encode")?;
    runner.compute(|g| tae.encode_graph(g, g.input(image)))
}

/// TAESD works on diffusion latents and [0, 1] pixels directly: no range mapping, no
/// latent scaling, no sampling.
impl super::VaeNet for TinyAutoEncoder {
    fn name(&self) -> &'static str {
        if self.cfg.taef2() {
            "TAEF2"
        } else {
            "TAESD"
        }
    }

    fn scale(&self) -> usize {
        super::SCALE * self.cfg.patch as usize
    }

    fn unit_range(&self) -> bool {
        false
    }

    fn encoder_output_channels(&self) -> i64 {
        self.cfg.latent_channels()
    }

    fn encode(&self, runner: &mut Runner, image: &Tensor) -> Result<Tensor> {
        encode(runner, self, image)
    }

    fn decode(&self, runner: &mut Runner, latent: &Tensor) -> Result<Tensor> {
        decode(runner, self, latent)
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
    use crate::models::vae::testutil::{assert_matches_numpy, cpu, load_tae, pattern};

    #[test]
    fn decoder_and_encoder_match_numpy() {
        let (store, tae, path) = load_tae(false);
        assert_eq!(tae.cfg, TaeConfig { z_channels: 4, decode_only: false, patch: 1 });
        assert_eq!(store.len(), 134);
        assert!(store.get("tae.decoder.layers.18.bias").is_some() && store.get("tae.encoder.layers.14.weight").is_some());
        let mut runner = Runner::new(cpu(), 2);

        let z = pattern(&[8, 8, 4, 1], -4.0, 4.0, 3);
        let ours = decode(&mut runner, &tae, &z).unwrap();
        assert_eq!(ours.shape(), &[64, 64, 3, 1]);
        assert_matches_numpy("taesd decode", "tae-decode", &path, &z, &ours);

        let x = pattern(&[64, 64, 3, 1], 0.0, 1.0, 4);
        let ours = encode(&mut runner, &tae, &x).unwrap();
        assert_eq!(ours.shape(), &[8, 8, 4, 1]);
        assert_matches_numpy("taesd encode", "tae-encode", &path, &x, &ours);
    }
}
