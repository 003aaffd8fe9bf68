//! ControlNet for the LDM UNets (SD 1.x, SD 2.x, SDXL; ComfyUI's `cldm`): a copy of the
//! UNet's encoder half that also reads a hint image and returns one residual per UNet skip
//! connection plus one for the middle block, which the UNet adds × `control_strength`.
//!
//! Weights use the LDM names without prefix (`input_hint_block.0.weight`,
//! `zero_convs.3.0.weight`, `middle_block_out.0.weight`, ...); `control_model.` files and
//! diffusers SDXL ControlNets are renamed to them by `io::names`. The layout is the UNet's
//! of the same family (read from the weights with `UNetConfig::detect`: model width, context
//! width, label embedding, linear or 1×1 projections), like the reference builds it from the
//! model's version.
//!
//! The hint path (`input_hint_block`, 3 → `model_channels` at 1/8 of the size) depends on the
//! hint image only, so it runs once per sampling run (`compute_hint`) and every step reuses
//! it; the reference caches it the same way.

use crate::error::{Context as _, Result};
use crate::graph::nn::Conv2d;
use crate::graph::{Graph, Runner, Scope, T};
use crate::models::common::blocks::{expand_batch, Downsample, EncoderBlock, ResBlock, SpatialTransformer, TimestepEmbed};
use crate::models::diffusion::unet::{UNetConfig, UNetVersion};
use crate::tensor::Tensor;

/// Channels after each convolution of the hint path (SiLU between them); the strides halve
/// the size three times, to the latent's.
const HINT_CONVS: [(i64, i32); 7] = [(16, 1), (16, 1), (32, 2), (32, 1), (96, 2), (96, 1), (256, 2)];

/// Hyper-parameters: the UNet family's, plus the hint image's channel count.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlNetConfig {
    pub unet: UNetConfig,
    pub hint_channels: i64,
}

impl ControlNetConfig {
    /// The layout of the ControlNet whose (internally named) tensors `shape_of` describes.
    /// Only the full SD 1.x / SD 2.x / SDXL layouts exist as ControlNets.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Result<ControlNetConfig> {
        ensure!(
            shape_of("input_hint_block.0.weight").is_some() && shape_of("zero_convs.0.0.weight").is_some(),
            "not a ControlNet model: it has no input_hint_block / zero_convs tensors"
        );
        let version = UNetVersion::detect(shape_of, "").context("not a ControlNet model: it has no input_blocks.0.0 tensor")?;
        ensure!(
            matches!(version, UNetVersion::Sd1 | UNetVersion::Sd2 | UNetVersion::Sdxl),
            "unsupported ControlNet layout ({version:?}): only SD 1.x, SD 2.x and SDXL ControlNets exist"
        );
        let unet = UNetConfig::detect(shape_of, "", Some(version))?;
        let hint = shape_of("input_hint_block.0.weight").unwrap_or_default();
        ensure!(
            hint.len() == 4 && hint[0] == 3 && hint[1] == 3 && hint[3] == HINT_CONVS[0].0,
            "ControlNet tensor 'input_hint_block.0.weight' has shape {hint:?}, expected [3, 3, channels, 16]"
        );
        Ok(ControlNetConfig { unet, hint_channels: hint[2] })
    }

    /// "SD 1.x", "SD 2.x" or "SDXL", for messages.
    pub fn family_name(&self) -> &'static str {
        if self.unet.version.is_sdxl() {
            "SDXL"
        } else if self.unet.version.is_sd2() {
            "SD 2.x"
        } else {
            "SD 1.x"
        }
    }
}

/// The ControlNet's declared weights and structure.
#[derive(Clone, Debug)]
pub struct ControlNet {
    pub config: ControlNetConfig,
    embed: TimestepEmbed,
    hint: Vec<Conv2d>,
    input_conv: Conv2d,
    /// Encoder blocks 1.., each with the zero convolution of its output.
    blocks: Vec<(EncoderBlock, Conv2d)>,
    /// The zero convolution of the input convolution's output.
    zero_conv0: Conv2d,
    middle: (ResBlock, SpatialTransformer, ResBlock),
    middle_out: Conv2d,
}

impl ControlNet {
    /// Declares every weight under `s`'s prefix.
    pub fn new(s: &mut Scope, config: &ControlNetConfig) -> ControlNet {
        let cfg = &config.unet;
        let mc = cfg.model_channels;
        let ted = cfg.time_embed_dim;
        let embed = TimestepEmbed::new(s, mc, ted, cfg.adm_in_channels);
        let input_conv = Conv2d::square(s, "input_blocks.0.0", cfg.in_channels, mc, 3, 1, 1);
        let zero_conv = |s: &mut Scope, idx: usize, ch: i64| Conv2d::square(s, &format!("zero_convs.{idx}.0"), ch, ch, 1, 1, 0);
        let zero_conv0 = zero_conv(s, 0, mc);

        let mut hint = Vec::with_capacity(HINT_CONVS.len() + 1);
        let mut ch_in = config.hint_channels;
        for (i, &(ch_out, stride)) in HINT_CONVS.iter().enumerate() {
            hint.push(Conv2d::square(s, &format!("input_hint_block.{}", 2 * i), ch_in, ch_out, 3, stride, 1));
            ch_in = ch_out;
        }
        hint.push(Conv2d::square(s, &format!("input_hint_block.{}", 2 * HINT_CONVS.len()), ch_in, mc, 3, 1, 1));

        let transformer = |s: &mut Scope, name: &str, ch: i64, depth: i64| cfg.transformer(s, name, ch, depth);
        let mut blocks = Vec::new();
        let (mut ch, mut idx, mut ds) = (mc, 0usize, 1i64);
        let levels = cfg.channel_mult.len();
        for (i, &mult) in cfg.channel_mult.iter().enumerate() {
            for _ in 0..cfg.num_res_blocks {
                idx += 1;
                let res = ResBlock::new(&mut s.sub(&format!("input_blocks.{idx}.0")), ch, Some(ted), mult * mc);
                ch = mult * mc;
                let attn = cfg
                    .attention_resolutions
                    .contains(&ds)
                    .then(|| transformer(s, &format!("input_blocks.{idx}.1"), ch, cfg.transformer_depth[i]));
                blocks.push((EncoderBlock::Res { res, attn }, zero_conv(s, idx, ch)));
            }
            if i != levels - 1 {
                idx += 1;
                let down = Downsample::new(&mut s.sub(&format!("input_blocks.{idx}.0")), ch, ch);
                blocks.push((EncoderBlock::Down(down), zero_conv(s, idx, ch)));
                ds *= 2;
            }
        }
        let depth = *cfg.transformer_depth.last().expect("non-empty transformer_depth");
        let middle = (
            ResBlock::new(&mut s.sub("middle_block.0"), ch, Some(ted), ch),
            transformer(s, "middle_block.1", ch, depth),
            ResBlock::new(&mut s.sub("middle_block.2"), ch, Some(ted), ch),
        );
        let middle_out = Conv2d::square(s, "middle_block_out.0", ch, ch, 1, 1, 0);
        ControlNet { config: config.clone(), embed, hint, input_conv, blocks, zero_conv0, middle, middle_out }
    }

    /// Residuals returned per evaluation: the UNet's skip connections plus the middle.
    pub fn num_controls(&self) -> usize {
        self.blocks.len() + 2
    }

    /// The hint path: hint [W·8, H·8, hint_channels, 1] → guided hint [W, H, model_channels, 1].
    pub fn forward_hint<'g>(&self, g: &'g Graph, hint: T<'g>) -> T<'g> {
        let mut h = hint;
        for (i, conv) in self.hint.iter().enumerate() {
            if i > 0 {
                h = h.silu_inplace();
            }
            h = conv.forward(g, h);
        }
        h
    }

    /// One evaluation: x [W, H, C, N] (the UNet's noisy input without concatenated
    /// channels), the guided hint (batch 1, broadcast), timesteps [N], context
    /// [context_dim, L, N or 1], y [adm, N or 1] (SDXL). Returns the residuals in the order
    /// the UNet takes them (input convolution, encoder blocks, middle).
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, guided_hint: T<'g>, timesteps: T<'g>, context: T<'g>, y: Option<T<'g>>) -> Vec<T<'g>> {
        let n = x.ne()[3];
        let context = expand_batch(g, context, 2, n);
        let y = y.map(|y| expand_batch(g, y, 1, n));
        let emb = self.embed.forward(g, timesteps, y);

        let mut outs = Vec::with_capacity(self.num_controls());
        let mut h = self.input_conv.forward(g, x).add(guided_hint);
        outs.push(self.zero_conv0.forward(g, h));
        for (block, zero) in &self.blocks {
            h = block.forward(g, h, emb, context);
            outs.push(zero.forward(g, h));
        }
        let (res0, attn, res2) = &self.middle;
        h = res0.forward(g, h, Some(emb));
        h = attn.forward(g, h, context);
        h = res2.forward(g, h, Some(emb));
        outs.push(self.middle_out.forward(g, h));
        outs
    }

    /// Checks the hint image before a graph is built (ggml aborts on mismatches): its sides
    /// must be 8 × the latent's.
    pub fn check_hint(&self, hint: &Tensor) -> Result<()> {
        ensure!(
            hint.shape().len() <= 4 && !hint.is_empty() && hint.ne(2) as i64 == self.config.hint_channels && hint.ne(3) == 1,
            "ControlNet hint must be one [W, H, {}] image, got {:?}",
            self.config.hint_channels,
            hint.shape()
        );
        Ok(())
    }

    /// Checks the host inputs of an evaluation against the model and the guided hint.
    pub fn check_inputs(&self, x: &Tensor, n_timesteps: usize, guided_hint: &Tensor, context: &Tensor, y: Option<&Tensor>) -> Result<()> {
        let c = &self.config.unet;
        ensure!(x.shape().len() <= 4 && !x.is_empty(), "ControlNet input must be a non-empty [W, H, C, N] tensor, got {:?}", x.shape());
        let n = x.ne(3);
        ensure!(x.ne(2) as i64 == c.in_channels, "ControlNet expects {} latent channels, got {}", c.in_channels, x.ne(2));
        let m = c.size_multiple();
        ensure!(
            x.ne(0) as i64 % m == 0 && x.ne(1) as i64 % m == 0,
            "ControlNet latent size {}x{} must be a multiple of {m}",
            x.ne(0),
            x.ne(1)
        );
        ensure!(n_timesteps == n, "ControlNet got {n_timesteps} timesteps for a batch of {n}");
        ensure!(
            guided_hint.ne(0) == x.ne(0) && guided_hint.ne(1) == x.ne(1) && guided_hint.ne(2) as i64 == c.model_channels && guided_hint.ne(3) == 1,
            "the control image ({}x{} after the hint blocks) does not match the latent {}x{}",
            guided_hint.ne(0),
            guided_hint.ne(1),
            x.ne(0),
            x.ne(1)
        );
        ensure!(
            context.shape().len() <= 3 && context.ne(0) as i64 == c.context_dim && context.ne(1) > 0 && (context.ne(2) == n || context.ne(2) == 1),
            "ControlNet context must be [{}, L, {n} or 1], got {:?}",
            c.context_dim,
            context.shape()
        );
        if let (Some(y), Some(adm)) = (y, c.adm_in_channels) {
            ensure!(
                y.shape().len() <= 2 && y.ne(0) as i64 == adm && (y.ne(1) == n || y.ne(1) == 1),
                "ControlNet y must be [{adm}, {n} or 1], got {:?}",
                y.shape()
            );
        }
        Ok(())
    }
}

/// Runs the hint path once: hint image [W, H, C, 1] in [0, 1] → guided hint.
pub fn compute_hint(runner: &mut Runner, net: &ControlNet, hint: &Tensor) -> Result<Tensor> {
    net.check_hint(hint)?;
    runner.compute(|g| {
        let h = g.input(hint);
        Ok(net.forward_hint(g, h))
    })
}

/// One evaluation on host tensors (see [`ControlNet::forward`]); a single timestep is used
/// for the whole batch. Without a label embedding `y` is ignored, like the UNet does.
pub fn compute(
    runner: &mut Runner,
    net: &ControlNet,
    x: &Tensor,
    guided_hint: &Tensor,
    timesteps: &[f32],
    context: &Tensor,
    y: Option<&Tensor>,
) -> Result<Vec<Tensor>> {
    let n = x.ne(3);
    let timesteps: Vec<f32> = match timesteps.len() {
        1 if n > 1 => vec![timesteps[0]; n],
        _ => timesteps.to_vec(),
    };
    let y = y.filter(|_| net.config.unet.adm_in_channels.is_some());
    net.check_inputs(x, timesteps.len(), guided_hint, context, y)?;
    runner.compute_many(|g| {
        let xt = g.input(x);
        let gh = g.input(guided_hint);
        let ts = g.input_f32(&timesteps, &[timesteps.len() as i64]);
        let ctx = g.input(context);
        let yt = y.map(|t| g.input(t));
        Ok(net.forward(g, xt, gh, ts, ctx, yt))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ParamStore, TypeMap, F32};
    use crate::io::{ModelFiles, ModelSource, SdVersion};
    use crate::models::diffusion::unet::UNetModel;
    use crate::testutil::synthetic_fixture;
    use std::collections::HashMap;

    /// The synthetic SD 1.x ControlNet (`control_model.` names): its layout is detected, every
    /// tensor of the file is declared with the file's shape, and it yields one residual per
    /// skip connection of the SD 1.x UNet plus the middle, with the UNet's shapes.
    #[test]
    fn sd1_controlnet_from_its_weights() {
        let path = synthetic_fixture("control_sd1.safetensors").unwrap();
        let mut files = ModelFiles::open(&[ModelSource::new(&path, "")]).unwrap();
        files.convert_names(Some(SdVersion::Sd1));
        let shapes: HashMap<String, Vec<i64>> = files.tensors().iter().map(|t| (t.name().to_string(), t.shape().to_vec())).collect();
        let shape_of = |n: &str| shapes.get(n).cloned();
        let cfg = ControlNetConfig::detect(&shape_of).unwrap();
        assert_eq!(cfg.unet.version, UNetVersion::Sd1);
        assert_eq!((cfg.hint_channels, cfg.unet.model_channels, cfg.unet.context_dim), (3, 320, 768));
        assert_eq!(cfg.family_name(), "SD 1.x");

        let types = TypeMap::new();
        let mut store = ParamStore::new(4096).unwrap();
        let net = ControlNet::new(&mut Scope::new(&mut store, &types, ""), &cfg);
        assert_eq!(store.len(), shapes.len(), "declared tensors vs the file's");
        for (name, w) in store.entries() {
            let file = shapes.get(name).unwrap_or_else(|| panic!("{name} is not in the file"));
            assert_eq!(&ParamStore::spec(w).ne, file, "{name}");
        }

        let mut unet_store = ParamStore::new(4096).unwrap();
        let unet = UNetModel::new(&mut Scope::new(&mut unet_store, &types, "model.diffusion_model."), &UNetConfig::for_version(UNetVersion::Sd1));
        assert_eq!(net.num_controls(), unet.num_controls());

        // The graphs build (no data needed): a 96×64 hint becomes a 12×8 guided hint, and the
        // residuals of a batch of 2 have the UNet's skip shapes.
        let g = Graph::new().unwrap();
        let gh = net.forward_hint(&g, g.new_tensor(F32, &[96, 64, 3, 1]));
        assert_eq!(gh.ne(), [12, 8, 320, 1]);
        let x = g.new_tensor(F32, &[12, 8, 4, 2]);
        let outs = net.forward(&g, x, gh, g.new_tensor(F32, &[2]), g.new_tensor(F32, &[768, 77, 1]), None);
        let want = unet.control_shapes(12, 8);
        assert_eq!(outs.len(), want.len());
        for (o, w) in outs.iter().zip(&want) {
            assert_eq!(o.ne(), [w[0], w[1], w[2], 2]);
        }
        assert!(net.check_inputs(&Tensor::zeros(&[16, 8, 4, 2]), 2, &Tensor::zeros(&[16, 8, 320, 1]), &Tensor::zeros(&[768, 77, 1]), None).is_ok());
        assert!(net.check_inputs(&Tensor::zeros(&[16, 8, 4, 1]), 1, &Tensor::zeros(&[8, 8, 320, 1]), &Tensor::zeros(&[768, 77, 1]), None).is_err());
        assert!(net.check_hint(&Tensor::zeros(&[96, 64, 4, 1])).is_err());
    }

    #[test]
    fn other_models_are_not_controlnets() {
        let unet_only = |n: &str| match n {
            "input_blocks.0.0.weight" => Some(vec![3, 3, 4, 320]),
            _ => None,
        };
        let e = ControlNetConfig::detect(&unet_only).unwrap_err().to_string();
        assert!(e.contains("not a ControlNet"), "{e}");
        let hint_only = |n: &str| match n {
            "input_hint_block.0.weight" => Some(vec![3, 3, 3, 16]),
            "zero_convs.0.0.weight" => Some(vec![1, 1, 320, 320]),
            _ => None,
        };
        let e = ControlNetConfig::detect(&hint_only).unwrap_err().to_string();
        assert!(e.contains("input_blocks.0.0"), "{e}");
    }
}
