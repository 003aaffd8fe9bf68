//! LTX-2.3's latent spatial upsampler (the reference's `ltx_latent_upscaler.hpp`), the model
//! of its latent-upscale refine pass (`hires.model_path`): un-normalised video latents
//! `[W, H, T, 128]` → `[2W, 2H, T, 128]`. A 3×3×3 convolution to the middle width, group norm
//! (32 groups) and SiLU, residual blocks (convolution, group norm, SiLU, convolution, group
//! norm, the input added, SiLU), a per-frame 3×3 convolution to four times the width shuffled
//! into 2×2 pixels, residual blocks again and a 3×3×3 convolution back. Sizes come from the
//! weights like the reference's, and so does the resampler: besides the ×2 spatial one, the
//! temporal one (a 3×3×3 convolution to twice the width shuffled into two frames each, the
//! first frame dropped: `2T - 1` frames) and the rational one (a per-frame 3×3 convolution to
//! n² times the width shuffled into n×n pixels, then a 5×5 binomial blur with stride d: ×3/2
//! for n = 3, ×n otherwise).

use crate::error::Result;
use crate::graph::nn::{self, Conv2d};
use crate::graph::{Graph, Scope, F16, F32, T, W};
use crate::models::vae::ltx::depth_to_space;

const GROUPS: i32 = 32;
const EPS: f32 = 1e-5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resampler {
    /// ×2 in space (`upsampler.0`, a 2-D convolution to 4× the width).
    Spatial,
    /// ×2 in time (`upsampler.0`, a 3-D convolution to 2× the width), `2T - 1` frames.
    Temporal,
    /// ×num/den in space (`upsampler.conv`, `upsampler.blur_down`).
    Rational { num: i64, den: i64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LtxUpsamplerConfig {
    pub in_channels: i64,
    pub mid_channels: i64,
    pub blocks: usize,
    pub resampler: Resampler,
}

impl LtxUpsamplerConfig {
    /// The upsampler of a file's (unprefixed) weights.
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Result<LtxUpsamplerConfig> {
        let names: Vec<&str> = names.into_iter().collect();
        let mid_channels = shape_of("initial_norm.weight").map_or(1024, |s| s[0]);
        let in_channels = shape_of("final_conv.bias").map_or(128, |s| s[0]);
        let blocks = names
            .iter()
            .filter_map(|n| n.strip_prefix("res_blocks.")?.split_once('.')?.0.parse::<usize>().ok())
            .max()
            .map_or(4, |b| b + 1);
        ensure!(mid_channels > 0 && mid_channels % GROUPS as i64 == 0, "the LTX latent upsampler's width {mid_channels} is not a multiple of its {GROUPS} norm groups");
        let up = shape_of("upsampler.0.bias").map_or(0, |s| s[0]);
        let resampler = match shape_of("upsampler.conv.weight") {
            Some(w) => {
                let out = w.get(3).copied().unwrap_or(0);
                let ratio = if out % mid_channels == 0 { out / mid_channels } else { 0 };
                let num = (ratio as f64).sqrt().round() as i64;
                ensure!(num >= 1 && num * num == ratio, "unsupported LTX latent upsampler: upsampler.conv makes {out} channels, not a square multiple of {mid_channels}");
                Resampler::Rational { num, den: if num == 3 { 2 } else { 1 } }
            }
            None if up == 4 * mid_channels => Resampler::Spatial,
            None if up == 2 * mid_channels => Resampler::Temporal,
            None => bail!("unsupported LTX latent upsampler: upsampler.0 makes {up} channels, a 2x spatial one makes {}, a 2x temporal one {}", 4 * mid_channels, 2 * mid_channels),
        };
        let (scale, time) = match resampler {
            Resampler::Spatial => (2.0, 1),
            Resampler::Temporal => (1.0, 2),
            Resampler::Rational { num, den } => (num as f32 / den as f32, 1),
        };
        sd_debug!(
            "ltx latent upsampler: in_channels = {in_channels}, mid_channels = {mid_channels}, num_blocks_per_stage = {blocks}, spatial_scale = {scale:.3}, temporal_up_factor = {time}, rational_resampler = {}",
            matches!(resampler, Resampler::Rational { .. }) as i32
        );
        Ok(LtxUpsamplerConfig { in_channels, mid_channels, blocks, resampler })
    }
}

/// A 3×3×3 convolution padded by zeros in every direction.
#[derive(Clone, Copy, Debug)]
struct Conv3 {
    weight: W,
    bias: W,
    ic: i64,
}

impl Conv3 {
    fn new(s: &mut Scope, name: &str, ic: i64, oc: i64) -> Conv3 {
        let mut c = s.sub(name);
        Conv3 { weight: c.tensor("weight", F16, &[3, 3, 3, ic * oc]), bias: c.tensor("bias", F32, &[oc]), ic }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        nn::conv_3d(g, x, g.param(self.weight), Some(g.param(self.bias)), self.ic, [1; 3], [1; 3], [1; 3])
    }
}

/// Group norm over the channels of `[W, H, T, C]` with an affine per channel.
#[derive(Clone, Copy, Debug)]
struct GroupNorm {
    weight: W,
    bias: W,
}

impl GroupNorm {
    fn new(s: &mut Scope, name: &str, channels: i64) -> GroupNorm {
        let mut n = s.sub(name);
        GroupNorm { weight: n.tensor("weight", F32, &[channels]), bias: n.tensor("bias", F32, &[channels]) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [w, h, t, c] = x.ne();
        let y = x.cont().reshape(&[w, h * t, c, 1]).group_norm(GROUPS, EPS);
        let y = y.mul_inplace(g.param(self.weight).reshape(&[1, 1, c, 1])).add_inplace(g.param(self.bias).reshape(&[1, 1, c, 1]));
        y.reshape(&[w, h, t, c])
    }
}

#[derive(Clone, Copy, Debug)]
struct ResBlock {
    conv1: Conv3,
    norm1: GroupNorm,
    conv2: Conv3,
    norm2: GroupNorm,
}

impl ResBlock {
    fn new(s: &mut Scope, channels: i64) -> ResBlock {
        ResBlock {
            conv1: Conv3::new(s, "conv1", channels, channels),
            norm1: GroupNorm::new(s, "norm1", channels),
            conv2: Conv3::new(s, "conv2", channels, channels),
            norm2: GroupNorm::new(s, "norm2", channels),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.norm1.forward(g, self.conv1.forward(g, x)).silu_inplace();
        let h = self.norm2.forward(g, self.conv2.forward(g, h));
        h.add(x).silu()
    }
}

/// The resampler's weights.
#[derive(Clone, Copy, Debug)]
enum Up {
    Spatial(Conv2d),
    Temporal(Conv3),
    Rational(Conv2d),
}

pub struct LtxUpsampler {
    pub config: LtxUpsamplerConfig,
    initial_conv: Conv3,
    initial_norm: GroupNorm,
    res_blocks: Vec<ResBlock>,
    upsampler: Up,
    post_blocks: Vec<ResBlock>,
    final_conv: Conv3,
}

/// The rational resampler's blur: a 5×5 binomial kernel per channel `[5, 5, 1, C]`.
fn binomial_kernel(channels: usize) -> Vec<f32> {
    const B: [f32; 5] = [1.0, 4.0, 6.0, 4.0, 1.0];
    let one: Vec<f32> = (0..25).map(|i| B[i / 5] * B[i % 5] / 256.0).collect();
    one.repeat(channels)
}

impl LtxUpsampler {
    pub fn new(s: &mut Scope, c: &LtxUpsamplerConfig) -> LtxUpsampler {
        let mid = c.mid_channels;
        let blocks = |s: &mut Scope, name: &str| (0..c.blocks).map(|i| ResBlock::new(&mut s.sub(&format!("{name}.{i}")), mid)).collect();
        LtxUpsampler {
            config: c.clone(),
            initial_conv: Conv3::new(s, "initial_conv", c.in_channels, mid),
            initial_norm: GroupNorm::new(s, "initial_norm", mid),
            res_blocks: blocks(s, "res_blocks"),
            upsampler: match c.resampler {
                Resampler::Spatial => Up::Spatial(Conv2d::square(&mut s.sub("upsampler"), "0", mid, 4 * mid, 3, 1, 1)),
                Resampler::Temporal => Up::Temporal(Conv3::new(&mut s.sub("upsampler"), "0", mid, 2 * mid)),
                Resampler::Rational { num, .. } => Up::Rational(Conv2d::square(&mut s.sub("upsampler"), "conv", mid, num * num * mid, 3, 1, 1)),
            },
            post_blocks: blocks(s, "post_upsample_res_blocks"),
            final_conv: Conv3::new(s, "final_conv", mid, c.in_channels),
        }
    }

    /// `[W, H, T, in]` → `[2W, 2H, T, in]` (spatial), `[W, H, 2T - 1, in]` (temporal) or
    /// `[W', H', T, in]` (rational).
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mid = self.config.mid_channels;
        let x = self.initial_norm.forward(g, self.initial_conv.forward(g, x)).silu();
        let x = self.res_blocks.iter().fold(x, |x, b| b.forward(g, x));
        let x = match (self.upsampler, self.config.resampler) {
            // Per frame: frames behind the channels for the 2-D convolution, back for the shuffle.
            (Up::Spatial(conv), _) => {
                let y = conv.forward(g, x.permute_axes([0, 1, 3, 2]).cont());
                depth_to_space(y.permute_axes([0, 1, 3, 2]).cont(), mid, 1, 2, false)
            }
            // Channel k + 2c of frame f becomes channel c of frame 2f + k; the first is dropped.
            (Up::Temporal(conv), _) => {
                let y = conv.forward(g, x);
                let [w, h, f, _] = y.ne();
                let y = y.reshape(&[w * h, f, 2, mid]).permute_axes([0, 2, 1, 3]).cont().reshape(&[w, h, 2 * f, mid]);
                let nb = y.nb();
                y.view(&[w, h, 2 * f - 1, mid], &[nb[1], nb[2], nb[3]], nb[2]).cont()
            }
            (Up::Rational(conv), Resampler::Rational { num, den }) => {
                let y = conv.forward(g, x.permute_axes([0, 1, 3, 2]).cont());
                let y = depth_to_space(y.permute_axes([0, 1, 3, 2]).cont(), mid, 1, num, false);
                let y = y.permute_axes([0, 1, 3, 2]).cont();
                let y = if den > 1 {
                    let kernel = g.input_f32(&binomial_kernel(mid as usize), &[5, 5, 1, mid]);
                    kernel.conv_2d_dw(y, den as i32, den as i32, 2, 2, 1, 1)
                } else {
                    y
                };
                y.permute_axes([0, 1, 3, 2]).cont()
            }
            (Up::Rational(_), _) => unreachable!("a rational resampler's config"),
        };
        let x = self.post_blocks.iter().fold(x, |x, b| b.forward(g, x));
        self.final_conv.forward(g, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect(extra: &[(&str, Vec<i64>)]) -> Result<LtxUpsamplerConfig> {
        let mut shapes: HashMap<String, Vec<i64>> = HashMap::new();
        for (n, s) in [("initial_norm.weight", vec![64]), ("final_conv.bias", vec![128]), ("res_blocks.0.conv1.bias", vec![64]), ("res_blocks.1.conv1.bias", vec![64])] {
            shapes.insert(n.to_string(), s);
        }
        for (n, s) in extra {
            shapes.insert(n.to_string(), s.clone());
        }
        let names: Vec<String> = shapes.keys().cloned().collect();
        LtxUpsamplerConfig::detect(names.iter().map(|s| s.as_str()), &|n| shapes.get(n).cloned())
    }

    /// Widths and block counts come from the weights; the resamplers not built are refused
    /// by name.
    #[test]
    fn the_upsampler_is_read_from_its_weights() {
        let c = detect(&[("upsampler.0.bias", vec![256])]).unwrap();
        assert_eq!(c, LtxUpsamplerConfig { in_channels: 128, mid_channels: 64, blocks: 2, resampler: Resampler::Spatial });
        assert_eq!(detect(&[("upsampler.0.bias", vec![128])]).unwrap().resampler, Resampler::Temporal);
        assert_eq!(detect(&[("upsampler.0.bias", vec![256])]).unwrap().resampler, Resampler::Spatial);
        assert_eq!(detect(&[("upsampler.conv.weight", vec![3, 3, 64, 576])]).unwrap().resampler, Resampler::Rational { num: 3, den: 2 });
        assert_eq!(detect(&[("upsampler.conv.weight", vec![3, 3, 64, 1024])]).unwrap().resampler, Resampler::Rational { num: 4, den: 1 });
        assert!(detect(&[("upsampler.conv.weight", vec![3, 3, 64, 320])]).is_err());
        assert!(detect(&[("upsampler.0.bias", vec![192])]).is_err());
        assert!(detect(&[]).is_err());
    }
}
