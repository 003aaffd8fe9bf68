//! LTX-2.3's latent spatial upsampler (the reference's `ltx_latent_upscaler.hpp`), the model
//! of its latent-upscale refine pass (`hires.model_path`): un-normalised video latents
//! `[W, H, T, 128]` → `[2W, 2H, T, 128]`. A 3×3×3 convolution to the middle width, group norm
//! (32 groups) and SiLU, residual blocks (convolution, group norm, SiLU, convolution, group
//! norm, the input added, SiLU), a per-frame 3×3 convolution to four times the width shuffled
//! into 2×2 pixels, residual blocks again and a 3×3×3 convolution back. Sizes come from the
//! weights like the reference's; its temporal (×2 in time) and rational (×1.5, ×4) resamplers
//! are refused by name.

use crate::error::Result;
use crate::graph::nn::{self, Conv2d};
use crate::graph::{Graph, Scope, F16, F32, T, W};
use crate::models::vae::ltx::depth_to_space;

const GROUPS: i32 = 32;
const EPS: f32 = 1e-5;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LtxUpsamplerConfig {
    pub in_channels: i64,
    pub mid_channels: i64,
    pub blocks: usize,
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
        ensure!(shape_of("upsampler.conv.weight").is_none(), "the rational (x1.5 / x4) LTX latent upsampler is not supported yet");
        let up = shape_of("upsampler.0.bias").map_or(0, |s| s[0]);
        ensure!(up != 2 * mid_channels, "the temporal (x2 in time) LTX latent upsampler is not supported yet");
        ensure!(
            up == 4 * mid_channels,
            "unsupported LTX latent upsampler: upsampler.0 makes {up} channels, a 2x spatial one makes {}",
            4 * mid_channels
        );
        ensure!(mid_channels % GROUPS as i64 == 0, "the LTX latent upsampler's width {mid_channels} is not a multiple of its {GROUPS} norm groups");
        sd_debug!("ltx latent upsampler: in_channels = {in_channels}, mid_channels = {mid_channels}, num_blocks_per_stage = {blocks}, spatial_scale = 2.000");
        Ok(LtxUpsamplerConfig { in_channels, mid_channels, blocks })
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

pub struct LtxUpsampler {
    pub config: LtxUpsamplerConfig,
    initial_conv: Conv3,
    initial_norm: GroupNorm,
    res_blocks: Vec<ResBlock>,
    upsampler: Conv2d,
    post_blocks: Vec<ResBlock>,
    final_conv: Conv3,
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
            upsampler: Conv2d::square(&mut s.sub("upsampler"), "0", mid, 4 * mid, 3, 1, 1),
            post_blocks: blocks(s, "post_upsample_res_blocks"),
            final_conv: Conv3::new(s, "final_conv", mid, c.in_channels),
        }
    }

    /// `[W, H, T, in]` → `[2W, 2H, T, in]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.initial_norm.forward(g, self.initial_conv.forward(g, x)).silu();
        let x = self.res_blocks.iter().fold(x, |x, b| b.forward(g, x));
        // Per frame: frames behind the channels for the 2-D convolution, back for the shuffle.
        let y = self.upsampler.forward(g, x.permute_axes([0, 1, 3, 2]).cont());
        let x = depth_to_space(y.permute_axes([0, 1, 3, 2]).cont(), self.config.mid_channels, 1, 2, false);
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
        assert_eq!(c, LtxUpsamplerConfig { in_channels: 128, mid_channels: 64, blocks: 2 });
        assert!(detect(&[("upsampler.0.bias", vec![128])]).unwrap_err().to_string().contains("temporal"));
        assert!(detect(&[("upsampler.conv.weight", vec![3, 3, 64, 576])]).unwrap_err().to_string().contains("rational"));
        assert!(detect(&[]).is_err());
    }
}
