//! The LDM UNet of Stable Diffusion 1.x / 2.x / SDXL (and their tiny/distilled variants):
//! predicts the noise (or v) of a latent at a timestep, conditioned on a text context.
//!
//! Pipeline interface:
//! - `UNetConfig::detect(shape_of, "model.diffusion_model.", version)` reads the variant
//!   from the checkpoint's tensor shapes (ggml order), like the reference;
//! - `UNetModel::new(&mut scope, &config)` declares every weight under the scope's prefix
//!   (the reference's internal names: `model.diffusion_model.input_blocks.1.0.in_layers.0.weight`...);
//! - as a loaded model it implements `DiffusionModel` (context from the condition's
//!   cross-attention, `c_concat` and the SDXL vector `y`); `UNetModel::forward` builds the
//!   same graph inside a larger one.
//!
//! The reference evaluates the conditional and unconditional branches in separate calls
//! (batch N = the latent's N); any N ≥ 1 works, with context/c_concat/y of batch 1 broadcast.
//! With AnimateDiff motion modules (`motion`) a batch of N > 1 is the frames of one video.

use crate::models::common::blocks::{expand_batch, CrossContext, Downsample, EncoderBlock, ResBlock, SpatialTransformer, TimestepEmbed, Upsample};
use crate::error::{Context as _, Error, Result};
use crate::graph::nn::{self, Conv2d, GroupNorm};
use super::{DiffusionInput, DiffusionModel};
use crate::graph::{Graph, Loaded, Runner, Scope, T};
use crate::tensor::Tensor;
use motion::{MotionConfig, MotionModule, MotionModules};

pub mod motion;

/// The UNet variants whose architecture differs (inpaint / pix2pix models only change the
/// input channel count, which is read from the weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UNetVersion {
    Sd1,
    /// BK-SDM-style tiny SD 1.x (one res block per level, no middle block).
    Sd1Tiny,
    /// SDXS-512 DreamShaper: tiny SD 1.x without attention at the lowest resolution.
    Sdxs512Ds,
    Sd2,
    Sd2Tiny,
    /// SDXS-512-0.9: a tiny SD 2.x with single-head 320-wide attention.
    Sdxs09,
    Sdxl,
    /// Segmind Vega: SDXL with shallower transformers and no middle attention.
    SdxlVega,
    /// Segmind SSD-1B: SDXL with pruned transformers and no middle attention.
    SdxlSsd1b,
}

impl UNetVersion {
    pub fn is_sd2(self) -> bool {
        matches!(self, UNetVersion::Sd2 | UNetVersion::Sd2Tiny | UNetVersion::Sdxs09)
    }

    pub fn is_sdxl(self) -> bool {
        matches!(self, UNetVersion::Sdxl | UNetVersion::SdxlVega | UNetVersion::SdxlSsd1b)
    }

    /// The variant from the UNet's own tensors, with the reference's rules (it tells SD 1.x
    /// from SD 2.x by the text encoder width, which equals the cross-attention context
    /// width read here). None when `prefix` holds no UNet.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Option<UNetVersion> {
        let p = normalize_prefix(prefix);
        let has = |leaf: &str| shape_of(&format!("{p}{leaf}")).is_some();
        if !has("input_blocks.0.0.weight") {
            return None;
        }
        let has_middle_attn = has("middle_block.1.norm.weight");
        if has("label_emb.0.0.weight") {
            return Some(match (has_middle_attn, has("output_blocks.3.1.transformer_blocks.1.norm1.weight")) {
                (true, _) => UNetVersion::Sdxl,
                (false, true) => UNetVersion::SdxlSsd1b,
                (false, false) => UNetVersion::SdxlVega,
            });
        }
        let sd2 = cross_attention_width(shape_of, &p) == Some(1024);
        Some(match (sd2, has_middle_attn) {
            (false, true) => UNetVersion::Sd1,
            (false, false) if has("output_blocks.7.1.norm.weight") => UNetVersion::Sd1Tiny,
            (false, false) => UNetVersion::Sdxs512Ds,
            (true, true) => UNetVersion::Sd2,
            (true, false) => {
                let k = shape_of(&format!("{p}output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight"));
                if k.is_some_and(|ne| ne.first() == Some(&1024)) {
                    UNetVersion::Sdxs09
                } else {
                    UNetVersion::Sd2Tiny
                }
            }
        })
    }
}

/// `prefix` with exactly one trailing dot (or empty).
fn normalize_prefix(prefix: &str) -> String {
    let p = prefix.trim_end_matches('.');
    if p.is_empty() {
        String::new()
    } else {
        format!("{p}.")
    }
}

/// Input width of the first IP-Adapter image key projection (`attn2.to_k_ip`, from an
/// `ip_adapter_path` file) found in the UNet's transformers, in block order.
fn image_attention_width(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, p: &str) -> Option<i64> {
    let blocks = (1..=12)
        .map(|i| format!("input_blocks.{i}.1"))
        .chain(std::iter::once("middle_block.1".to_string()))
        .chain((0..12).map(|i| format!("output_blocks.{i}.1")));
    for b in blocks {
        for d in 0..10 {
            if let Some(ne) = shape_of(&format!("{p}{b}.transformer_blocks.{d}.attn2.to_k_ip.weight")) {
                if ne.len() == 2 {
                    return Some(ne[0]);
                }
            }
        }
    }
    None
}

/// Input width of the first cross-attention key projection found, in block order.
fn cross_attention_width(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, p: &str) -> Option<i64> {
    let blocks = (1..=12)
        .map(|i| format!("input_blocks.{i}.1"))
        .chain(std::iter::once("middle_block.1".to_string()))
        .chain((0..12).map(|i| format!("output_blocks.{i}.1")));
    for b in blocks {
        if let Some(ne) = shape_of(&format!("{p}{b}.transformer_blocks.0.attn2.to_k.weight")) {
            if ne.len() == 2 {
                return Some(ne[0]);
            }
        }
    }
    None
}

/// Hyper-parameters of a UNet.
#[derive(Clone, Debug, PartialEq)]
pub struct UNetConfig {
    pub version: UNetVersion,
    pub in_channels: i64,
    pub out_channels: i64,
    pub num_res_blocks: usize,
    /// Downsampling factors (1, 2, 4...) at which blocks carry a spatial transformer.
    pub attention_resolutions: Vec<i64>,
    pub channel_mult: Vec<i64>,
    pub transformer_depth: Vec<i64>,
    pub time_embed_dim: i64,
    /// Either a fixed head count (SD 1.x) or a fixed head width (SD 2.x, SDXL); the other is -1.
    pub num_heads: i64,
    pub num_head_channels: i64,
    pub context_dim: i64,
    pub use_linear_projection: bool,
    pub tiny_unet: bool,
    pub model_channels: i64,
    /// Width of the SDXL size/aesthetic vector `y` (label embedding), None without one.
    pub adm_in_channels: Option<i64>,
    /// AnimateDiff motion modules to declare (`motion_module.*`), set by the family builder.
    pub motion: Option<MotionConfig>,
    /// Width of the IP-Adapter image tokens the cross-attentions with `to_k_ip` / `to_v_ip`
    /// read (None without an IP-Adapter).
    pub ip_context_dim: Option<i64>,
}

impl UNetConfig {
    /// The defaults of a variant, before reading sizes from the weights.
    pub fn for_version(version: UNetVersion) -> UNetConfig {
        let mut c = UNetConfig {
            version,
            in_channels: 4,
            out_channels: 4,
            num_res_blocks: 2,
            attention_resolutions: vec![4, 2, 1],
            channel_mult: vec![1, 2, 4, 4],
            transformer_depth: vec![1, 1, 1, 1],
            time_embed_dim: 1280,
            num_heads: 8,
            num_head_channels: -1,
            context_dim: 768,
            use_linear_projection: false,
            tiny_unet: false,
            model_channels: 320,
            adm_in_channels: None,
            motion: None,
            ip_context_dim: None,
        };
        if version.is_sd2() {
            c.context_dim = 1024;
            c.num_head_channels = 64;
            c.num_heads = -1;
            c.use_linear_projection = true;
        } else if version.is_sdxl() {
            c.context_dim = 2048;
            c.attention_resolutions = vec![4, 2];
            c.channel_mult = vec![1, 2, 4];
            c.transformer_depth = if version == UNetVersion::SdxlVega { vec![1, 1, 2] } else { vec![1, 2, 10] };
            c.num_head_channels = 64;
            c.num_heads = -1;
            c.use_linear_projection = true;
            c.adm_in_channels = Some(2816);
        }
        if matches!(version, UNetVersion::Sd1Tiny | UNetVersion::Sd2Tiny | UNetVersion::Sdxs512Ds | UNetVersion::Sdxs09) {
            c.num_res_blocks = 1;
            c.channel_mult = vec![1, 2, 4];
            c.tiny_unet = true;
            if version == UNetVersion::Sdxs512Ds {
                c.attention_resolutions = vec![4, 2];
            }
        }
        c
    }

    /// The configuration of the UNet under `prefix` (e.g. `model.diffusion_model.`):
    /// `version` (detected from the weights when None) sets the defaults, then sizes are
    /// read from the tensors' shapes (ggml order) like the reference does.
    pub fn detect(
        shape_of: &dyn Fn(&str) -> Option<Vec<i64>>,
        prefix: &str,
        version: Option<UNetVersion>,
    ) -> Result<UNetConfig> {
        let p = normalize_prefix(prefix);
        let version = match version {
            Some(v) => v,
            None => UNetVersion::detect(shape_of, &p).with_context(|| format!("no UNet weights under '{p}'"))?,
        };
        ensure!(
            shape_of(&format!("{p}input_blocks.8.0.time_mixer.mix_factor")).is_none(),
            "Stable Video Diffusion UNets are not supported"
        );
        let mut c = UNetConfig::for_version(version);
        let shape = |leaf: &str| shape_of(&format!("{p}{leaf}"));
        if let Some(ne) = shape("input_blocks.0.0.weight").filter(|ne| ne.len() == 4) {
            c.in_channels = ne[2];
            c.model_channels = ne[3];
            c.time_embed_dim = c.model_channels * 4;
        }
        if let Some(ne) = shape("time_embed.0.weight").filter(|ne| ne.len() == 2) {
            c.model_channels = ne[0];
            c.time_embed_dim = ne[1];
        }
        if let Some(ne) = shape("label_emb.0.0.weight").filter(|ne| ne.len() == 2) {
            // Like the reference, only SDXL UNets use the label embedding.
            if c.adm_in_channels.is_some() {
                c.adm_in_channels = Some(ne[0]);
            }
            c.time_embed_dim = ne[1];
        }
        if let Some(ne) = shape("out.2.weight").filter(|ne| ne.len() == 4) {
            c.out_channels = ne[3];
        }
        if let Some(w) = cross_attention_width(shape_of, &p) {
            c.context_dim = w;
        }
        c.ip_context_dim = image_attention_width(shape_of, &p);
        // The reference picks conv or linear projections per block from the file's tensor
        // rank; every known checkpoint uses one kind throughout.
        if let Some(ne) = first_proj_out(shape_of, &p) {
            c.use_linear_projection = ne.len() == 2;
        }
        ensure!(
            c.in_channels > 0 && c.model_channels > 0 && c.model_channels % 32 == 0 && c.out_channels > 0,
            "unsupported UNet sizes: in_channels {}, model_channels {}, out_channels {}",
            c.in_channels,
            c.model_channels,
            c.out_channels
        );
        sd_debug!(
            "unet: in_channels = {}, out_channels = {}, model_channels = {}, time_embed_dim = {}, context_dim = {}, adm_in_channels = {}, num_res_blocks = {}, tiny_unet = {}",
            c.in_channels,
            c.out_channels,
            c.model_channels,
            c.time_embed_dim,
            c.context_dim,
            c.adm_in_channels.unwrap_or(0),
            c.num_res_blocks,
            c.tiny_unet
        );
        Ok(c)
    }

    /// (heads, head width) of a transformer over `ch` channels.
    fn heads(&self, ch: i64) -> (i64, i64) {
        let (n_head, d_head) = if self.num_head_channels != -1 {
            (ch / self.num_head_channels, self.num_head_channels)
        } else {
            (self.num_heads, ch / self.num_heads)
        };
        if self.version == UNetVersion::Sdxs09 && n_head == 5 {
            return (1, 320);
        }
        (n_head, d_head)
    }

    /// Declares the spatial transformer `name` over `ch` channels.
    pub fn transformer(&self, s: &mut Scope, name: &str, ch: i64, depth: i64) -> SpatialTransformer {
        let (n_head, d_head) = self.heads(ch);
        // SDXS-512-0.9's single 320-wide head: 1024-input self-attention keys and values.
        let self_kv_width = (self.version == UNetVersion::Sdxs09 && d_head == 320).then_some(1024);
        let ip_dim = self.ip_context_dim;
        SpatialTransformer::new(&mut s.sub(name), ch, n_head, d_head, depth, self.context_dim, self.use_linear_projection, self_kv_width, ip_dim)
    }

    /// Latent sides must divide by this (one halving per level below the top).
    pub fn size_multiple(&self) -> i64 {
        1 << (self.channel_mult.len() - 1)
    }
}

fn first_proj_out(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, p: &str) -> Option<Vec<i64>> {
    let blocks = (1..=12)
        .map(|i| format!("input_blocks.{i}.1"))
        .chain(std::iter::once("middle_block.1".to_string()))
        .chain((0..12).map(|i| format!("output_blocks.{i}.1")));
    blocks.filter_map(|b| shape_of(&format!("{p}{b}.proj_out.weight"))).next()
}

#[derive(Clone, Debug)]
struct OutputBlock {
    res: ResBlock,
    attn: Option<SpatialTransformer>,
    up: Option<Upsample>,
}

/// A motion module applied to a batch of frames (none for a single picture).
fn animate<'g>(g: &'g Graph, module: Option<&MotionModule>, h: T<'g>) -> T<'g> {
    match module {
        Some(m) if h.ne()[3] > 1 => m.forward(g, h),
        _ => h,
    }
}

#[derive(Clone, Debug)]
struct MiddleBlock {
    res0: ResBlock,
    /// Absent in SSD-1B / Vega.
    attn_res: Option<(SpatialTransformer, ResBlock)>,
}

impl MiddleBlock {
    fn forward<'g>(&self, g: &'g Graph, h: T<'g>, emb: T<'g>, context: CrossContext<'g>) -> T<'g> {
        let h = self.res0.forward(g, h, Some(emb));
        match &self.attn_res {
            Some((attn, res2)) => res2.forward(g, attn.forward(g, h, context), Some(emb)),
            None => h,
        }
    }
}

impl OutputBlock {
    /// `h` continues the decoder path, `skip` is the matching encoder output; `motion`
    /// runs before the upsampler.
    fn forward<'g>(&self, g: &'g Graph, h: T<'g>, skip: T<'g>, emb: T<'g>, context: CrossContext<'g>, motion: Option<&MotionModule>) -> T<'g> {
        let mut h = self.res.forward(g, h.concat(skip, 2), Some(emb));
        if let Some(a) = &self.attn {
            h = a.forward(g, h, context);
        }
        h = animate(g, motion, h);
        match &self.up {
            Some(u) => u.forward(g, h),
            None => h,
        }
    }
}

/// The UNet's declared weights and structure.
#[derive(Clone, Debug)]
pub struct UNetModel {
    pub config: UNetConfig,
    embed: TimestepEmbed,
    input_conv: Conv2d,
    input_blocks: Vec<EncoderBlock>,
    middle: Option<MiddleBlock>,
    output_blocks: Vec<OutputBlock>,
    out_norm: GroupNorm,
    out_conv: Conv2d,
    motion: Option<MotionModules>,
}

impl UNetModel {
    /// Declares every weight under `s`'s prefix (normally `model.diffusion_model.`).
    pub fn new(s: &mut Scope, cfg: &UNetConfig) -> UNetModel {
        let mc = cfg.model_channels;
        let ted = cfg.time_embed_dim;
        let v = cfg.version;
        let embed = TimestepEmbed::new(s, mc, ted, cfg.adm_in_channels);
        let input_conv = Conv2d::square(s, "input_blocks.0.0", cfg.in_channels, mc, 3, 1, 1);

        let transformer = |s: &mut Scope, name: &str, ch: i64, depth: i64| cfg.transformer(s, name, ch, depth);
        let has_attn = |ds: i64| cfg.attention_resolutions.contains(&ds);

        let mut input_blocks = Vec::new();
        let mut chans = vec![mc];
        let mut ch = mc;
        let mut idx = 0;
        let mut ds = 1;
        let levels = cfg.channel_mult.len();
        for (i, &mult) in cfg.channel_mult.iter().enumerate() {
            for _ in 0..cfg.num_res_blocks {
                idx += 1;
                let res = ResBlock::new(&mut s.sub(&format!("input_blocks.{idx}.0")), ch, Some(ted), mult * mc);
                ch = mult * mc;
                let attn = has_attn(ds).then(|| {
                    let depth = if v == UNetVersion::SdxlSsd1b && i == 2 { 4 } else { cfg.transformer_depth[i] };
                    transformer(s, &format!("input_blocks.{idx}.1"), ch, depth)
                });
                input_blocks.push(EncoderBlock::Res { res, attn });
                chans.push(ch);
                if cfg.tiny_unet {
                    idx += 1;
                }
            }
            if i != levels - 1 {
                idx += 1;
                input_blocks.push(EncoderBlock::Down(Downsample::new(&mut s.sub(&format!("input_blocks.{idx}.0")), ch, ch)));
                chans.push(ch);
                ds *= 2;
            }
        }

        let middle = (!cfg.tiny_unet).then(|| {
            let res0 = ResBlock::new(&mut s.sub("middle_block.0"), ch, Some(ted), ch);
            let attn_res = (!matches!(v, UNetVersion::SdxlSsd1b | UNetVersion::SdxlVega)).then(|| {
                let depth = *cfg.transformer_depth.last().expect("non-empty transformer_depth");
                let attn = transformer(s, "middle_block.1", ch, depth);
                (attn, ResBlock::new(&mut s.sub("middle_block.2"), ch, Some(ted), ch))
            });
            MiddleBlock { res0, attn_res }
        });

        let mut output_blocks = Vec::new();
        let mut idx = 0;
        for (i, &mult) in cfg.channel_mult.iter().enumerate().rev() {
            for j in 0..=cfg.num_res_blocks {
                let skip_ch = chans.pop().expect("one skip per output block");
                let res = ResBlock::new(&mut s.sub(&format!("output_blocks.{idx}.0")), ch + skip_ch, Some(ted), mult * mc);
                ch = mult * mc;
                let mut up_idx = 1;
                let attn = has_attn(ds).then(|| {
                    let mut depth = cfg.transformer_depth[i];
                    if v == UNetVersion::SdxlSsd1b {
                        if i == 2 && j <= 1 {
                            depth = 4;
                        }
                        if i == 1 && (j == 1 || j == 2) {
                            depth = 1;
                        }
                    }
                    up_idx = 2;
                    transformer(s, &format!("output_blocks.{idx}.1"), ch, depth)
                });
                let up = (i > 0 && j == cfg.num_res_blocks).then(|| {
                    if cfg.tiny_unet {
                        idx += 1;
                        if idx == 2 {
                            up_idx = 1;
                        }
                    }
                    ds /= 2;
                    Upsample::new(&mut s.sub(&format!("output_blocks.{idx}.{up_idx}")), ch, ch)
                });
                output_blocks.push(OutputBlock { res, attn, up });
                idx += 1;
            }
        }

        let out_norm = GroupNorm::gn32(s, "out.0", ch);
        let out_conv = Conv2d::square(s, "out.2", mc, cfg.out_channels, 3, 1, 1);
        let motion = cfg.motion.map(|m| MotionModules::new(&mut s.sub("motion_module"), m));
        UNetModel {
            config: cfg.clone(),
            embed,
            input_conv,
            input_blocks,
            middle,
            output_blocks,
            out_norm,
            out_conv,
            motion,
        }
    }

    /// Whether AnimateDiff motion modules relate the items of a batch as frames.
    pub fn has_motion_modules(&self) -> bool {
        self.motion.is_some()
    }

    /// Number of ControlNet residuals `forward` takes: one per skip connection, then the middle.
    pub fn num_controls(&self) -> usize {
        self.output_blocks.len() + 1
    }

    /// Shapes ([W, H, C] per sample) of the skip connections for a latent of `w`×`h`, in
    /// the order ControlNet residuals are given (input blocks first to last, then the middle).
    pub fn control_shapes(&self, w: i64, h: i64) -> Vec<[i64; 3]> {
        let c = &self.config;
        let mut out = vec![[w, h, c.model_channels]];
        let (mut w, mut h, mut ch) = (w, h, c.model_channels);
        for (i, &mult) in c.channel_mult.iter().enumerate() {
            ch = mult * c.model_channels;
            for _ in 0..c.num_res_blocks {
                out.push([w, h, ch]);
            }
            if i != c.channel_mult.len() - 1 {
                w = (w + 1) / 2;
                h = (h + 1) / 2;
                out.push([w, h, ch]);
            }
        }
        out.push([w, h, ch]);
        out
    }

    /// One evaluation.
    /// - x: [W, H, C, N] noisy latent (C + c_concat's C = in_channels);
    /// - timesteps: [N] f32;
    /// - context: [context_dim, L, N or 1];
    /// - c_concat: [W, H, C', N or 1], concatenated to x on channels (inpaint: mask + masked latent);
    /// - y: [adm_in_channels, N or 1] (SDXL);
    /// - controls: empty or `num_controls()` residuals, each added × `control_strength`;
    /// - image: IP-Adapter image tokens [ip_context_dim, tokens, N or 1] and their strength.
    ///
    /// With motion modules, a batch of N > 1 is N frames of one video.
    ///
    /// Returns [W, H, out_channels, N]. Shapes must have been checked (`check_inputs`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'g>(
        &self,
        g: &'g Graph,
        x: T<'g>,
        timesteps: T<'g>,
        context: T<'g>,
        c_concat: Option<T<'g>>,
        y: Option<T<'g>>,
        controls: &[T<'g>],
        control_strength: f32,
        image: Option<(T<'g>, f32)>,
    ) -> T<'g> {
        let n = x.ne()[3];
        let text = expand_batch(g, context, 2, n);
        let context = CrossContext { text, image: image.map(|(t, s)| (expand_batch(g, t, 2, n), s)) };
        let mut x = x;
        if let Some(c) = c_concat {
            x = x.concat(expand_batch(g, c, 3, n), 2);
        }
        let y = y.map(|y| expand_batch(g, y, 1, n));

        let emb = self.embed.forward(g, timesteps, y);
        // Cut points for segmented runs under a memory budget (`max_vram`), where the
        // reference has them: after the input conv, each res input block, the middle
        // block and each output block.
        let mut h = g.mark_cut(self.input_conv.forward(g, x), "unet.input_blocks.0");
        let mut skips = vec![h];
        let motion = self.motion.as_ref();
        for (i, block) in self.input_blocks.iter().enumerate() {
            h = block.forward(g, h, emb, context);
            if matches!(block, EncoderBlock::Res { .. }) {
                // Motion modules exist only for the full SD 1.x layout, where input block
                // i + 1 is `input_blocks.{i + 1}`.
                h = animate(g, motion.and_then(|m| m.after_input(i + 1)), h);
                h = g.mark_cut(h, &format!("unet.input_blocks.{}", i + 1));
            }
            skips.push(h);
        }
        if let Some(m) = &self.middle {
            let mid = m.forward(g, h, emb, context);
            h = g.mark_cut(animate(g, motion.and_then(MotionModules::after_middle), mid), "unet.middle_block");
        }
        let mut controls = controls.iter().rev();
        if let Some(&c) = controls.next() {
            h = h.add(nn::scale(c, control_strength, true));
        }
        for (k, block) in self.output_blocks.iter().enumerate() {
            let mut skip = skips.pop().expect("one skip per output block");
            if let Some(&c) = controls.next() {
                skip = skip.add(nn::scale(c, control_strength, true));
            }
            h = block.forward(g, h, skip, emb, context, motion.and_then(|m| m.after_output(k)));
            h = g.mark_cut(h, &format!("unet.output_blocks.{k}"));
        }
        self.head(g, h)
    }

    fn head<'g>(&self, g: &'g Graph, h: T<'g>) -> T<'g> {
        let h = self.out_norm.forward(g, h).silu_inplace();
        self.out_conv.forward(g, h)
    }

    /// Checks host-side input shapes before a graph is built (ggml aborts on mismatches).
    pub fn check_inputs(
        &self,
        x: &Tensor,
        n_timesteps: usize,
        context: &Tensor,
        c_concat: Option<&Tensor>,
        y: Option<&Tensor>,
        controls: &[Tensor],
    ) -> Result<()> {
        let c = &self.config;
        ensure!(x.shape().len() <= 4 && !x.is_empty(), "UNet input must be a non-empty [W, H, C, N] tensor, got {:?}", x.shape());
        let (w, h, n) = (x.ne(0) as i64, x.ne(1) as i64, x.ne(3));
        let m = c.size_multiple();
        ensure!(w % m == 0 && h % m == 0, "UNet latent size {w}x{h} must be a multiple of {m}");
        ensure!(n_timesteps == n, "UNet got {n_timesteps} timesteps for a batch of {n}");
        ensure!(
            self.motion.is_none() || n as i64 <= motion::MAX_FRAMES,
            "AnimateDiff motion modules relate at most {} frames, got {n}",
            motion::MAX_FRAMES
        );
        let mut channels = x.ne(2) as i64;
        if let Some(cc) = c_concat {
            ensure!(
                cc.shape().len() <= 4 && cc.ne(0) == x.ne(0) && cc.ne(1) == x.ne(1) && (cc.ne(3) == n || cc.ne(3) == 1),
                "UNet c_concat shape {:?} does not match the latent {:?}",
                cc.shape(),
                x.shape()
            );
            channels += cc.ne(2) as i64;
        }
        ensure!(
            channels == c.in_channels,
            "UNet expects {} input channels, got {channels} (latent{})",
            c.in_channels,
            if c_concat.is_some() { " + c_concat" } else { "" }
        );
        ensure!(
            context.shape().len() <= 3 && context.ne(0) as i64 == c.context_dim && context.ne(1) > 0 && (context.ne(2) == n || context.ne(2) == 1),
            "UNet context must be [{}, L, {n} or 1], got {:?}",
            c.context_dim,
            context.shape()
        );
        if let Some(y) = y {
            let adm = c.adm_in_channels.context("this UNet takes no vector conditioning (y)")?;
            ensure!(
                y.shape().len() <= 2 && y.ne(0) as i64 == adm && (y.ne(1) == n || y.ne(1) == 1),
                "UNet y must be [{adm}, {n} or 1], got {:?}",
                y.shape()
            );
        }
        if !controls.is_empty() {
            let expected = self.control_shapes(w, h);
            ensure!(
                controls.len() == expected.len(),
                "UNet takes {} control residuals, got {}",
                expected.len(),
                controls.len()
            );
            for (i, (ct, e)) in controls.iter().zip(&expected).enumerate() {
                let ok = ct.shape().len() <= 4
                    && (0..3).all(|d| ct.ne(d) as i64 == e[d])
                    && (ct.ne(3) == n || ct.ne(3) == 1);
                ensure!(ok, "UNet control residual {i} has shape {:?}, expected [{}, {}, {}, {n}]", ct.shape(), e[0], e[1], e[2]);
            }
        }
        Ok(())
    }
}

impl DiffusionModel for Loaded<UNetModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let c = input.cond;
        let context = c.crossattn.as_ref().context("the UNet needs a cross-attention context")?;
        let (model, runner) = self.parts();
        let image = input.image_tokens;
        compute(runner, model, input.x, input.timesteps, context, c.concat.as_ref(), c.vector.as_ref(), input.controls, input.control_strength, image)
    }

    fn compute_pair(&mut self, a: &DiffusionInput<'_>, b: &DiffusionInput<'_>) -> Result<Option<[Tensor; 2]>> {
        let (model, runner) = self.parts();
        compute_pair(runner, model, a, b)
    }

    fn has_motion_modules(&self) -> bool {
        self.model.has_motion_modules()
    }
}

/// Runs the UNet once on host tensors (see `UNetModel::forward` for the shapes). A single
/// timestep is used for the whole batch. Image tokens are read only by a UNet with IP-Adapter
/// attentions (`ip_context_dim`).
#[allow(clippy::too_many_arguments)]
pub fn compute(
    runner: &mut Runner,
    unet: &UNetModel,
    x: &Tensor,
    timesteps: &[f32],
    context: &Tensor,
    c_concat: Option<&Tensor>,
    y: Option<&Tensor>,
    control: Option<&[Tensor]>,
    control_strength: f32,
    image: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    let n = x.ne(3);
    let timesteps: Vec<f32> = match timesteps.len() {
        1 if n > 1 => vec![timesteps[0]; n],
        _ => timesteps.to_vec(),
    };
    let controls = control.unwrap_or(&[]);
    unet.check_inputs(x, timesteps.len(), context, c_concat, y, controls)?;
    let image = match (image, unet.config.ip_context_dim) {
        (Some((tokens, strength)), Some(width)) => {
            ensure!(
                tokens.shape().len() <= 3 && tokens.ne(0) as i64 == width && tokens.ne(1) > 0 && (tokens.ne(2) == n || tokens.ne(2) == 1),
                "the IP-Adapter's image tokens are {:?}, its UNet attentions read [{width}, tokens, {n} or 1]",
                tokens.shape()
            );
            Some((tokens, strength))
        }
        _ => None,
    };
    runner.compute(|g| {
        let xt = g.input(x);
        let ts = g.input_f32(&timesteps, &[timesteps.len() as i64]);
        let ctx = g.input(context);
        let cc = c_concat.map(|t| g.input(t));
        let yt = y.map(|t| g.input(t));
        let cs: Vec<T> = controls.iter().map(|t| g.input(t)).collect();
        let it = image.map(|(t, s)| (g.input(t), s));
        Ok(unet.forward(g, xt, ts, ctx, cc, yt, &cs, control_strength, it))
    })
}

/// Every UNet op (convolutions, group norms, attention, the timestep embedding) works per
/// batch item, so a batch of the two passes gives each pass's output as alone. Not with
/// motion modules (a batch is a video's frames), per-pass residuals or image tokens, a
/// graph budget (the batch's activations are twice one pass's), or conditions of
/// different shapes.
pub fn compute_pair(runner: &mut Runner, model: &UNetModel, a: &DiffusionInput<'_>, b: &DiffusionInput<'_>) -> Result<Option<[Tensor; 2]>> {
    let (ca, cb) = (a.cond, b.cond);
    let same = |p: Option<&Tensor>, q: Option<&Tensor>| match (p, q) {
        (Some(p), Some(q)) => p.shape() == q.shape(),
        (p, q) => p.is_none() && q.is_none(),
    };
    let single = |t: &Tensor, batch_dim: usize| t.shape().len() <= batch_dim + 1 && t.ne(batch_dim) == 1;
    let batches = !model.has_motion_modules()
        && runner.max_vram == 0
        && [a, b].iter().all(|i| i.controls.is_none() && i.image_tokens.is_none() && i.timesteps.len() == 1 && single(i.x, 3))
        && a.x.shape() == b.x.shape()
        && a.control_strength == b.control_strength
        && same(ca.crossattn.as_ref(), cb.crossattn.as_ref())
        && ca.crossattn.as_ref().is_some_and(|c| single(c, 2))
        && same(ca.vector.as_ref(), cb.vector.as_ref())
        && ca.vector.as_ref().is_none_or(|y| single(y, 1))
        && same(ca.concat.as_ref(), cb.concat.as_ref())
        && ca.concat.as_ref().is_none_or(|c| single(c, 3));
    if !batches {
        return Ok(None);
    }
    let pair = |p: Option<&Tensor>, q: Option<&Tensor>, dim: usize| p.zip(q).map(|(p, q)| Tensor::stack(&[p, q], dim)).transpose();
    let x = Tensor::stack(&[a.x, b.x], 3)?;
    let context = pair(ca.crossattn.as_ref(), cb.crossattn.as_ref(), 2)?.context("the UNet needs a cross-attention context")?;
    let y = pair(ca.vector.as_ref(), cb.vector.as_ref(), 1)?;
    let concat = pair(ca.concat.as_ref(), cb.concat.as_ref(), 3)?;
    let timesteps = [a.timesteps[0], b.timesteps[0]];
    let out = compute(runner, model, &x, &timesteps, &context, concat.as_ref(), y.as_ref(), None, a.control_strength, None)?;
    let [p, q]: [Tensor; 2] = out.unstack(3)?.try_into().map_err(|_| Error::new("the UNet's batch of two gave another count"))?;
    Ok(Some([p, q]))
}

#[cfg(test)]
mod tests;
