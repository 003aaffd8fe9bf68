//! AnimateDiff motion modules (SD 1.5 v2/v3 layout), the reference's `AnimateDiff` namespace:
//! temporal transformers inserted after UNet blocks that let the items of the batch — the
//! frames of one video — attend to each other, pixel by pixel, along time.
//!
//! Their widths are fixed (the SD 1.5 UNet's), not read from the file: two modules after the
//! res blocks of each input level, three after those of each output level, one after the
//! middle block when the file has it (v2). A file whose shapes differ (the 24-frame v1
//! modules, SDXL's) is refused by the loader's shape check, naming the tensor.

use crate::error::Result;
use crate::graph::nn::{self, GroupNorm, LayerNorm, Linear};
use crate::graph::{Graph, Scope, F32, T, W};
use crate::models::common::blocks::FeedForward;

/// Frames of the positional encoding: the most frames one module relates.
pub const MAX_FRAMES: i64 = 32;
const HEADS: i64 = 8;
/// Widths of the input levels' modules (the output levels' in reverse).
const LEVEL_CHANNELS: [i64; 4] = [320, 640, 1280, 1280];
const INPUT_PER_LEVEL: usize = 2;
const OUTPUT_PER_LEVEL: usize = 3;
const MIDDLE_CHANNELS: i64 = 1280;
const LAYER_NORM_EPS: f32 = 1e-5;

/// What a motion module file holds beyond the fixed layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MotionConfig {
    /// A module after the middle block (v2 files; v3 has none).
    pub mid_block: bool,
}

impl MotionConfig {
    /// The motion modules under `prefix` (the UNet's `motion_module.` names), detected like
    /// the reference: by the first input module's `proj_in`.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Option<MotionConfig> {
        let has = |block: &str| shape_of(&format!("{prefix}{block}.motion_modules.0.temporal_transformer.proj_in.weight")).is_some();
        has("down_blocks.0").then(|| MotionConfig { mid_block: has("mid_block") })
    }

    /// The modules' fixed widths are the SD 1.5 UNet's: refuse any other layout (the
    /// reference would fail inside the graph).
    pub fn check_unet(model_channels: i64, channel_mult: &[i64], num_res_blocks: usize) -> Result<()> {
        let widths: Vec<i64> = channel_mult.iter().map(|m| m * model_channels).collect();
        ensure!(
            widths == LEVEL_CHANNELS && num_res_blocks == INPUT_PER_LEVEL,
            "AnimateDiff motion modules fit the SD 1.5 UNet (levels of {LEVEL_CHANNELS:?} channels, {INPUT_PER_LEVEL} res blocks each); this UNet has levels of {widths:?} channels and {num_res_blocks} res blocks"
        );
        Ok(())
    }
}

/// Self-attention along the frames, positions added from a learned table.
#[derive(Clone, Copy, Debug)]
struct TemporalAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    /// `[C, MAX_FRAMES, 1]`.
    pe: W,
}

impl TemporalAttention {
    fn new(s: &mut Scope, c: i64) -> TemporalAttention {
        TemporalAttention {
            to_q: Linear::new(s, "to_q", c, c, false),
            to_k: Linear::new(s, "to_k", c, c, false),
            to_v: Linear::new(s, "to_v", c, c, false),
            to_out: Linear::new(s, "to_out.0", c, c, true),
            pe: s.tensor("pos_encoder.pe", F32, &[c, MAX_FRAMES, 1]),
        }
    }

    /// x: [C, F, pixels].
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [c, f, ..] = x.ne();
        let pe = g.param(self.pe);
        let pe = if f == MAX_FRAMES { pe } else { pe.view(&[c, f, 1], &[pe.nb()[1], pe.nb()[2]], 0) };
        let x = x.add(pe.repeat(x));
        let q = self.to_q.forward(g, x);
        let k = self.to_k.forward(g, x);
        let v = self.to_v.forward(g, x);
        // The reference never takes the fused kernel here.
        let a = nn::attention(g, q, k, v, HEADS, None, false, false, 1.0);
        self.to_out.forward(g, a)
    }
}

/// Two temporal attentions and a GEGLU feed-forward, each pre-normed with a residual.
#[derive(Clone, Copy, Debug)]
struct TemporalBlock {
    attn: [TemporalAttention; 2],
    norms: [LayerNorm; 2],
    ff: FeedForward,
    ff_norm: LayerNorm,
}

impl TemporalBlock {
    fn new(s: &mut Scope, c: i64) -> TemporalBlock {
        let attn = [0, 1].map(|i| TemporalAttention::new(&mut s.sub(&format!("attention_blocks.{i}")), c));
        let norms = [0, 1].map(|i| LayerNorm::new(s, &format!("norms.{i}"), c, LAYER_NORM_EPS, true, true));
        TemporalBlock { attn, norms, ff: FeedForward::new(&mut s.sub("ff"), c, c, 4), ff_norm: LayerNorm::new(s, "ff_norm", c, LAYER_NORM_EPS, true, true) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = x;
        for (attn, norm) in self.attn.iter().zip(&self.norms) {
            x = attn.forward(g, norm.forward(g, x)).add(x);
        }
        self.ff.forward(g, self.ff_norm.forward(g, x)).add(x)
    }
}

/// One motion module (`temporal_transformer`): the frames of each pixel as a sequence.
#[derive(Clone, Copy, Debug)]
pub struct MotionModule {
    norm: GroupNorm,
    proj_in: Linear,
    block: TemporalBlock,
    proj_out: Linear,
}

impl MotionModule {
    fn new(s: &mut Scope, c: i64) -> MotionModule {
        let mut s = s.sub("temporal_transformer");
        MotionModule {
            norm: GroupNorm::gn32(&mut s, "norm", c),
            proj_in: Linear::new(&mut s, "proj_in", c, c, true),
            block: TemporalBlock::new(&mut s.sub("transformer_blocks.0"), c),
            proj_out: Linear::new(&mut s, "proj_out", c, c, true),
        }
    }

    /// x: [W, H, C, F] (the batch is the video's frames) → the same shape.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let [w, h, c, f] = x.ne();
        let t = self.norm.forward(g, x);
        let t = t.permute(2, 3, 0, 1).contiguous().reshape(&[c, f, w * h]);
        let t = self.proj_in.forward(g, t);
        let t = self.block.forward(g, t);
        let t = self.proj_out.forward(g, t);
        // Always copied: at a 1×1 level ggml takes the permuted view for contiguous (its
        // first dimension has size 1) and the addition would read it wrongly; the reference
        // aborts there (64×64 pictures).
        let t = t.reshape(&[c, f, w, h]).permute(2, 3, 0, 1).cont();
        t.add(x)
    }
}

/// Every motion module of a file, by UNet level.
#[derive(Clone, Debug)]
pub struct MotionModules {
    input: Vec<[MotionModule; INPUT_PER_LEVEL]>,
    output: Vec<[MotionModule; OUTPUT_PER_LEVEL]>,
    middle: Option<MotionModule>,
}

impl MotionModules {
    /// Declares the modules under `s` (the UNet's `motion_module.` scope).
    pub fn new(s: &mut Scope, cfg: MotionConfig) -> MotionModules {
        let mut level = |block: String, c: i64, j: usize| MotionModule::new(&mut s.sub(&format!("{block}.motion_modules.{j}")), c);
        let input = LEVEL_CHANNELS.iter().enumerate().map(|(i, &c)| [0, 1].map(|j| level(format!("down_blocks.{i}"), c, j))).collect();
        let output = LEVEL_CHANNELS.iter().rev().enumerate().map(|(i, &c)| [0, 1, 2].map(|j| level(format!("up_blocks.{i}"), c, j))).collect();
        let middle = cfg.mid_block.then(|| level("mid_block".into(), MIDDLE_CHANNELS, 0));
        MotionModules { input, output, middle }
    }

    /// The module after input block `idx` (`input_blocks.{idx}`, 1-based; downsamplers have none).
    pub fn after_input(&self, idx: usize) -> Option<&MotionModule> {
        let (level, j) = ((idx.checked_sub(1)?) / 3, (idx - 1) % 3);
        self.input.get(level)?.get(j)
    }

    /// The module after output block `idx` (`output_blocks.{idx}`), before its upsampler.
    pub fn after_output(&self, idx: usize) -> Option<&MotionModule> {
        self.output.get(idx / 3)?.get(idx % 3)
    }

    pub fn after_middle(&self) -> Option<&MotionModule> {
        self.middle.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_sit_after_the_res_blocks_of_the_sd15_layout() {
        let mut store = crate::graph::ParamStore::new(1024).unwrap();
        let types = Default::default();
        let mm = MotionModules::new(&mut Scope::new(&mut store, &types, "model.diffusion_model.motion_module."), MotionConfig { mid_block: true });
        let has = |name: &str| store.get(&format!("model.diffusion_model.motion_module.{name}")).is_some();
        assert!(has("down_blocks.3.motion_modules.1.temporal_transformer.transformer_blocks.0.attention_blocks.1.pos_encoder.pe"));
        assert!(has("up_blocks.0.motion_modules.2.temporal_transformer.transformer_blocks.0.ff.net.0.proj.weight"));
        assert!(has("mid_block.motion_modules.0.temporal_transformer.proj_out.bias"));
        assert!(!has("down_blocks.0.motion_modules.2.temporal_transformer.norm.weight"));
        // Input blocks 1, 2, 4, 5, 7, 8, 10, 11 (3, 6, 9 downsample); every output block.
        let inputs: Vec<usize> = (0..=12).filter(|&i| mm.after_input(i).is_some()).collect();
        assert_eq!(inputs, [1, 2, 4, 5, 7, 8, 10, 11]);
        assert!((0..12).all(|i| mm.after_output(i).is_some()) && mm.after_output(12).is_none());
        assert!(MotionConfig::check_unet(320, &[1, 2, 4, 4], 2).is_ok());
        let e = MotionConfig::check_unet(320, &[1, 2, 4], 1).unwrap_err().to_string();
        assert!(e.contains("SD 1.5 UNet"), "{e}");
    }
}
