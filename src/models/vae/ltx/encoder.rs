//! The LTX video VAE's encoder (`encoder.`), for the pictures LTX-2.3 is conditioned on (start
//! and end images): levels read from the weights like the reference's (version 2 layout):
//! `conv_in` on 4×4 RGB patches, then `down_blocks.N` that are residual blocks or
//! space-to-depth downsamplers (a convolution to `next / factor` channels rearranged into
//! `next`, plus a parameter-free averaged shortcut; 2× space, 2× time or both), a pixel norm,
//! SiLU and `conv_out` to the 128 latent means plus a log-variance channel. All its
//! convolutions are causal: two copies of the first frame in front, nothing behind.

use super::{level_weights, pixel_norm, Conv, LevelWeights, ResBlock, ShapeOf, CHANNELS, OUT_EPS, PATCH};
use crate::error::Result;
use crate::graph::{Graph, Scope, T};
use crate::models::vae::wan::blocks::AvgDown3d;

/// One level of the encoder, as read from the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Residual blocks at the current width.
    Res(usize),
    /// A downsampler by `ft` in time and `fs` in space, widening the channels `multiplier`
    /// times.
    Down { ft: i64, fs: i64, multiplier: i64 },
}

/// The encoder's sizes read from the weights (`prefix` is the VAE's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncoderConfig {
    pub conv_in: i64,
    pub levels: Vec<Level>,
}

impl EncoderConfig {
    /// `None` without encoder weights; like the reference, a downsampler's factor is the next
    /// level's width over its convolution's, its multiplier the next width over the current.
    pub fn detect(shape_of: ShapeOf, prefix: &str) -> Option<EncoderConfig> {
        let conv_in = shape_of(&format!("{prefix}encoder.conv_in.conv.bias"))?[0];
        let mut levels = Vec::new();
        let mut current = conv_in;
        for (i, level) in level_weights(shape_of, &format!("{prefix}encoder.down_blocks")).into_iter().enumerate() {
            let (conv, next) = match level {
                LevelWeights::Res { layers, width } => {
                    levels.push(Level::Res(layers));
                    current = width;
                    continue;
                }
                LevelWeights::Resample { conv, next } => (conv, next),
            };
            let multiplier = if current > 0 && next > 0 && next % current == 0 { (next / current).max(1) } else { 1 };
            let factor = if conv > 0 && next > 0 && next % conv == 0 { next / conv } else { 0 };
            let (ft, fs) = match factor {
                8 => (2, 2),
                4 => (1, 2),
                2 => (2, 1),
                _ => {
                    sd_warn!(
                        "unexpected LTX VAE encoder downsample factor at '{prefix}encoder.down_blocks.{i}': conv_out={conv} current={current} next={next}, falling back to compress_all_res x{multiplier}"
                    );
                    (2, 2)
                }
            };
            levels.push(Level::Down { ft, fs, multiplier });
            current = if next > 0 { next } else { current * multiplier };
        }
        Some(EncoderConfig { conv_in, levels })
    }

    /// Pixels per latent pixel and frames per latent frame after the first.
    pub fn scales(&self) -> (i64, i64) {
        self.levels.iter().fold((PATCH, 1), |(s, t), l| match *l {
            Level::Down { ft, fs, .. } => (s * fs, t * ft),
            Level::Res(_) => (s, t),
        })
    }
}

#[derive(Clone, Debug)]
enum Down {
    Res(Vec<ResBlock>),
    SpaceToDepth { conv: Conv, skip: AvgDown3d, conv_down: AvgDown3d, ft: i64 },
}

#[derive(Clone, Debug)]
pub struct Encoder {
    conv_in: Conv,
    downs: Vec<Down>,
    conv_out: Conv,
}

impl Encoder {
    /// The encoder under `s` (`encoder`).
    pub fn new(s: &mut Scope, cfg: &EncoderConfig) -> Encoder {
        let conv_in = Conv::new(&mut s.sub("conv_in"), 3 * PATCH * PATCH, cfg.conv_in);
        let mut channels = cfg.conv_in;
        let mut downs = Vec::new();
        for (i, level) in cfg.levels.iter().enumerate() {
            let mut b = s.sub(&format!("down_blocks.{i}"));
            match *level {
                Level::Res(n) => downs.push(Down::Res((0..n).map(|m| ResBlock::new(&mut b.sub(&format!("res_blocks.{m}")), channels)).collect())),
                Level::Down { ft, fs, multiplier } => {
                    let next = channels * multiplier;
                    let inner = next / (ft * fs * fs);
                    let conv = Conv::new(&mut b.sub("conv"), channels, inner);
                    downs.push(Down::SpaceToDepth { conv, skip: AvgDown3d::new(channels, next, ft, fs), conv_down: AvgDown3d::new(inner, next, ft, fs), ft });
                    channels = next;
                }
            }
        }
        let conv_out = Conv::new(&mut s.sub("conv_out"), channels, CHANNELS as i64 + 1);
        Encoder { conv_in, downs, conv_out }
    }

    /// Patches `[W, H, T, 48]` → the latent means `[w, h, t, 128]` (not yet normalised).
    pub fn graph<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.conv_in.causal(g, x);
        for down in &self.downs {
            x = match down {
                Down::Res(blocks) => blocks.iter().fold(x, |x, b| b.forward_causal(g, x)),
                Down::SpaceToDepth { conv, skip, conv_down, ft } => {
                    let x = if *ft > 1 { first_frames(x, *ft - 1).concat(x, 2) } else { x };
                    conv_down.forward(conv.causal(g, x)).add(skip.forward(x))
                }
            };
        }
        let x = self.conv_out.causal(g, pixel_norm(x, OUT_EPS).silu_inplace());
        let [w, h, t, _] = x.ne();
        let nb = x.nb();
        x.view(&[w, h, t, CHANNELS as i64], &[nb[1], nb[2], nb[3]], 0).cont()
    }
}

/// `n` copies of the first frame of `x` `[W, H, T, C]`.
pub(super) fn first_frames<'g>(x: T<'g>, n: i64) -> T<'g> {
    let [w, h, _, c] = x.ne();
    let nb = x.nb();
    let first = x.view(&[w, h, 1, c], &[nb[1], nb[2], nb[3]], 0);
    (1..n).fold(first, |acc, _| acc.concat(first, 2))
}

/// Pixels `[4W, 4H, T, 3]` (host order, width fastest) → 4×4 patches `[W, H, T, 48]`, patch
/// channel `(c·4 + r)·4 + q` holding pixel `(4x + r, 4y + q)` of colour `c`.
pub fn patchify(pixels: &[f32], width: usize, height: usize, frames: usize) -> Result<Vec<f32>> {
    let p = PATCH as usize;
    ensure!(width % p == 0 && height % p == 0, "the LTX VAE encodes sizes in multiples of {p}, got {width}x{height}");
    ensure!(pixels.len() == width * height * frames * 3, "LTX VAE encode: {} values for {width}x{height}x{frames} RGB", pixels.len());
    let (w, h) = (width / p, height / p);
    let mut out = vec![0.0f32; pixels.len()];
    for c in 0..3 {
        for r in 0..p {
            for q in 0..p {
                let ch = (c * p + r) * p + q;
                for t in 0..frames {
                    for y in 0..h {
                        let src = ((c * frames + t) * height + y * p + q) * width;
                        let dst = ((ch * frames + t) * h + y) * w;
                        for x in 0..w {
                            out[dst + x] = pixels[src + x * p + r];
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}
