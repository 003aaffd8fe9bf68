//! ESRGAN's RRDBNet (BasicSR `rrdbnet_arch.py`, Real-ESRGAN): a stack of residual-in-residual
//! dense blocks at the input resolution, then ×2 nearest-neighbour upsampling steps, each
//! followed by a convolution.
//!
//! Weights use the internal (RealESRGAN) names: `conv_first`, `body.{i}.rdb{1,2,3}.conv{1..5}`,
//! `conv_body`, `conv_up1`, `conv_up2`, `conv_hr`, `conv_last`; original-ESRGAN files
//! (`model.0`, `model.1.sub.{i}.RDB1.conv1.0`, ...) are renamed to them by `io::names`.
//! The layout is read from the weights: the block count from the highest `body.{i}`, the
//! scale from which upsampling convolutions exist (×4, ×2 or ×1), the channel counts from
//! the convolution shapes. The reference reads only the first two and fixes the widths at
//! 3 / 64 / 32 (so it cannot load other widths); for every model it can load the result is
//! the same. Convolutions are f16 with f32 biases, like every reference `Conv2d`.

use crate::error::Result;
use crate::graph::nn::{scale, Conv2d};
use crate::graph::{Graph, Runner, Scope, T};
use crate::tensor::Tensor;

/// LeakyReLU slope of every activation.
const SLOPE: f32 = 0.2;
/// Residual scaling of the dense and residual-in-residual blocks.
const RESIDUAL_SCALE: f32 = 0.2;
/// More blocks than any published model (23 for RealESRGAN x4plus); bounds what a file can
/// make us declare.
pub const MAX_BLOCKS: usize = 128;
/// Weight tensors declared for `num_block` blocks: 30 per block, at most 12 outside.
pub fn tensor_count(num_block: usize) -> usize {
    num_block * 30 + 12
}

/// The network's layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EsrganConfig {
    /// 1, 2 or 4.
    pub scale: u32,
    pub num_block: usize,
    pub num_in_ch: i64,
    pub num_out_ch: i64,
    pub num_feat: i64,
    pub num_grow_ch: i64,
}

/// A 3×3 convolution's ggml shape [3, 3, in, out] as (in, out).
fn conv3x3_channels(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, name: &str) -> Result<(i64, i64)> {
    let ne = shape_of(name).ok_or_else(|| crate::error::Error::new(format!("tensor '{name}' not found")))?;
    ensure!(
        ne.len() == 4 && ne[0] == 3 && ne[1] == 3 && ne[2] > 0 && ne[3] > 0,
        "tensor '{name}' has shape {ne:?}, expected a 3x3 convolution [3, 3, in, out]"
    );
    Ok((ne[2], ne[3]))
}

impl EsrganConfig {
    /// Reads the layout from the (internally named) tensors of a file: `names` lists them,
    /// `shape_of` gives a tensor's ggml-order shape. A file without `conv_first`,
    /// `conv_last` or any `body.{i}` block is not an ESRGAN model.
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Result<EsrganConfig> {
        let mut num_block = 0usize;
        for name in names {
            let Some(rest) = name.strip_prefix("body.") else { continue };
            let Some((index, _)) = rest.split_once('.') else { continue };
            if let Ok(i) = index.parse::<usize>() {
                num_block = num_block.max(i.saturating_add(1));
            }
        }
        let has = |name: &str| shape_of(name).is_some();
        ensure!(
            has("conv_first.weight") && has("conv_last.weight") && num_block > 0,
            "not an ESRGAN model: it needs conv_first, body.N and conv_last tensors (RRDBNet)"
        );
        ensure!(num_block <= MAX_BLOCKS, "ESRGAN model with {num_block} blocks: at most {MAX_BLOCKS} are supported");
        let scale = if has("conv_up2.weight") {
            4
        } else if has("conv_up1.weight") {
            2
        } else {
            1
        };
        let (num_in_ch, num_feat) = conv3x3_channels(shape_of, "conv_first.weight")?;
        let (_, num_out_ch) = conv3x3_channels(shape_of, "conv_last.weight")?;
        let (_, num_grow_ch) = conv3x3_channels(shape_of, "body.0.rdb1.conv1.weight")?;
        let cfg = EsrganConfig { scale, num_block, num_in_ch, num_out_ch, num_feat, num_grow_ch };
        sd_debug!(
            "esrgan: scale = {}, num_block = {}, num_in_ch = {}, num_out_ch = {}, num_feat = {}, num_grow_ch = {}",
            cfg.scale,
            cfg.num_block,
            cfg.num_in_ch,
            cfg.num_out_ch,
            cfg.num_feat,
            cfg.num_grow_ch
        );
        Ok(cfg)
    }
}

fn conv3x3(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64) -> Conv2d {
    Conv2d::square(s, name, in_ch, out_ch, 3, 1, 1)
}

fn lrelu(x: T<'_>) -> T<'_> {
    x.leaky_relu(SLOPE, true)
}

/// Five convolutions, each seeing the block input and every earlier output.
struct ResidualDenseBlock {
    convs: [Conv2d; 5],
}

impl ResidualDenseBlock {
    fn new(s: &mut Scope, name: &str, feat: i64, grow: i64) -> ResidualDenseBlock {
        let mut s = s.sub(name);
        let convs = std::array::from_fn(|i| {
            let out = if i == 4 { feat } else { grow };
            conv3x3(&mut s, &format!("conv{}", i + 1), feat + i as i64 * grow, out)
        });
        ResidualDenseBlock { convs }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut cat = x;
        for conv in &self.convs[..4] {
            let y = lrelu(conv.forward(g, cat));
            cat = cat.concat(y, 2);
        }
        let out = self.convs[4].forward(g, cat);
        scale(out, RESIDUAL_SCALE, false).add(x)
    }
}

/// Three dense blocks with a scaled skip around them.
struct Rrdb {
    rdbs: [ResidualDenseBlock; 3],
}

impl Rrdb {
    fn new(s: &mut Scope, name: &str, feat: i64, grow: i64) -> Rrdb {
        let mut s = s.sub(name);
        Rrdb { rdbs: std::array::from_fn(|i| ResidualDenseBlock::new(&mut s, &format!("rdb{}", i + 1), feat, grow)) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let out = self.rdbs.iter().fold(x, |h, rdb| rdb.forward(g, h));
        scale(out, RESIDUAL_SCALE, false).add(x)
    }
}

pub struct Esrgan {
    pub cfg: EsrganConfig,
    conv_first: Conv2d,
    body: Vec<Rrdb>,
    conv_body: Conv2d,
    /// `conv_up1` (×2 and ×4), then `conv_up2` (×4).
    conv_up: Vec<Conv2d>,
    conv_hr: Conv2d,
    conv_last: Conv2d,
}

impl Esrgan {
    /// Declares the weights (internal names, scope without prefix).
    pub fn new(s: &mut Scope, cfg: &EsrganConfig) -> Esrgan {
        let (feat, grow) = (cfg.num_feat, cfg.num_grow_ch);
        let conv_first = conv3x3(s, "conv_first", cfg.num_in_ch, feat);
        let body = (0..cfg.num_block).map(|i| Rrdb::new(s, &format!("body.{i}"), feat, grow)).collect();
        let conv_body = conv3x3(s, "conv_body", feat, feat);
        let ups: &[&str] = match cfg.scale {
            4 => &["conv_up1", "conv_up2"],
            2 => &["conv_up1"],
            _ => &[],
        };
        let conv_up = ups.iter().map(|n| conv3x3(s, n, feat, feat)).collect();
        let conv_hr = conv3x3(s, "conv_hr", feat, feat);
        let conv_last = conv3x3(s, "conv_last", feat, cfg.num_out_ch);
        Esrgan { cfg: cfg.clone(), conv_first, body, conv_body, conv_up, conv_hr, conv_last }
    }

    /// Image [W, H, in_ch, N] → [W·scale, H·scale, out_ch, N].
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let feat = self.conv_first.forward(g, x);
        let body = self.body.iter().fold(feat, |h, block| block.forward(g, h));
        let mut feat = feat.add(self.conv_body.forward(g, body));
        for conv in &self.conv_up {
            feat = lrelu(conv.forward(g, feat.upscale(2)));
        }
        self.conv_last.forward(g, lrelu(self.conv_hr.forward(g, feat)))
    }
}

/// Runs the network on an image tensor [W, H, in_ch, N] (values in [0, 1]).
pub fn compute(runner: &mut Runner, model: &Esrgan, x: &Tensor) -> Result<Tensor> {
    crate::models::vae::autoencoder_kl::check_input(x, model.cfg.num_in_ch, 1, "esrgan")?;
    runner.compute(|g| Ok(model.forward(g, g.input(x))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn shapes(feat: i64, grow: i64, blocks: usize, ups: usize) -> HashMap<String, Vec<i64>> {
        let mut m = HashMap::new();
        let mut conv = |n: &str, i: i64, o: i64| {
            m.insert(format!("{n}.weight"), vec![3, 3, i, o]);
            m.insert(format!("{n}.bias"), vec![o]);
        };
        conv("conv_first", 3, feat);
        for b in 0..blocks {
            for r in 1..=3 {
                for c in 1..=5 {
                    conv(&format!("body.{b}.rdb{r}.conv{c}"), feat + (c - 1) * grow, if c == 5 { feat } else { grow });
                }
            }
        }
        for n in ["conv_body", "conv_hr"].iter().chain(["conv_up1", "conv_up2"][..ups].iter()) {
            conv(n, feat, feat);
        }
        conv("conv_last", feat, 3);
        m
    }

    fn detect(m: &HashMap<String, Vec<i64>>) -> Result<EsrganConfig> {
        EsrganConfig::detect(m.keys().map(String::as_str), &|n| m.get(n).cloned())
    }

    #[test]
    fn layout_is_read_from_the_weights() {
        let cfg = detect(&shapes(64, 32, 6, 2)).unwrap();
        assert_eq!(cfg, EsrganConfig { scale: 4, num_block: 6, num_in_ch: 3, num_out_ch: 3, num_feat: 64, num_grow_ch: 32 });
        let cfg = detect(&shapes(16, 8, 23, 1)).unwrap();
        assert_eq!((cfg.scale, cfg.num_block, cfg.num_feat, cfg.num_grow_ch), (2, 23, 16, 8));
        assert_eq!(detect(&shapes(8, 4, 1, 0)).unwrap().scale, 1);
    }

    #[test]
    fn other_models_and_broken_layouts_are_refused() {
        let sd: HashMap<String, Vec<i64>> = [("model.diffusion_model.input_blocks.0.0.weight".to_string(), vec![3, 3, 4, 320])].into();
        assert!(detect(&sd).unwrap_err().to_string().contains("not an ESRGAN model"));
        let mut m = shapes(8, 4, 2, 2);
        m.insert("conv_first.weight".into(), vec![1, 1, 3, 8]);
        assert!(detect(&m).unwrap_err().to_string().contains("3x3"));
        let mut m = shapes(8, 4, 1, 2);
        m.insert(format!("body.{MAX_BLOCKS}.rdb1.conv1.weight"), vec![3, 3, 8, 4]);
        assert!(detect(&m).unwrap_err().to_string().contains("blocks"));
    }
}
