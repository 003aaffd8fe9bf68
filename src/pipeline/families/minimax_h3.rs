//! MiniMax-H3: Qwen3-VL's text model (the output of layer 50, the prompt as it is: no
//! template, no attention syntax), the joint audio-video transformer and its own video VAE.
//! Flow prediction with the default shift 12 (the audio's is 3), like the reference. The
//! audio latent rides behind the video's channels through sampling; its audio VAE (the file
//! of `audio_vae_path`, loaded by [`load_audio_vae`]) decodes it to sound, without one no
//! sound is decoded.
//!
//! With a vision tower (`llm_vision_path`, or `visual.` in `llm_path`) the LLM is shown the
//! keyframe pictures, or Ref2VA's references in order: each announced (`<Picture N>: `,
//! `<Video N>: `, `<Audio N>: `), pictures and each pair of a video's sampled frames (with
//! their mean time, `<0.2 seconds>`) as `<|vision_start|>`, one `<|image_pad|>` per
//! embedding, `<|vision_end|>`, in front of the prompt. The tower's deepstack outputs are added
//! to the LLM's first layers and the pictures' tokens get their grid's positions.

use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::{Component, Components, Module};
use crate::models::Condition;
use crate::models::diffusion::minimax_h3::{MinimaxH3Config, MinimaxH3Model};
use crate::models::te::llm::{ImageGrid, LlmArch, VlInputs};
use crate::models::te::qwen_vision::VisionArch;
use crate::pipeline::conditioning::llm::{tokenize_parts, LlmText};
use crate::pipeline::conditioning::qwen_edit::{vision_size, VisionTower};
use crate::pipeline::conditioning::{CondRequest, Conditioner, Shown};
use crate::pipeline::imageops::resize_nearest;
use crate::pipeline::ref_images::VlmResizeMode;
use crate::tensor::Tensor;
use crate::models::vae::audio::AudioStage;
use crate::models::vae::minimax_h3_audio::{self, MinimaxH3AudioVae};
use crate::types::Prediction;
use std::sync::Arc;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 12.0;
/// The LLM layer whose output (before the final norm) conditions the transformer.
const OUT_LAYERS: &[i32] = &[50];
const DIT_PREFIX: &str = "model.diffusion_model.";

/// Pixel area bounds of what the vision tower is shown (56² to 3584²).
const VISION_MIN_AREA: i32 = 3136;
const VISION_MAX_AREA: i32 = 12_845_056;

/// The prompt through the LLM, tokenized whole with weight 1 (the reference parses no
/// attention syntax for MiniMax-H3), with what the vision tower is shown in front of it.
pub struct MinimaxH3Conditioner {
    llm: LlmText,
    vision: Option<VisionTower>,
}

impl Components for MinimaxH3Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let mut c = vec![self.llm.component()];
        if let Some(v) = self.vision.as_mut() {
            c.push(v.component());
        }
        c
    }
}

/// The prompt's front and what the LLM reads in it, built reference by reference.
#[derive(Default)]
struct VisionPrompt {
    text: String,
    images: Vec<(usize, Tensor)>,
    deepstack: Vec<Vec<(usize, Tensor)>>,
    grids: Vec<ImageGrid>,
    /// The tower's patch side and 2×2 merge (its grids are in patches).
    patch: usize,
    merge: usize,
}

/// A frame `[W, H, 3, 1]` in [0, 1] as the tower takes it: nearest-resized to multiples of
/// its patch grid within the area bounds, then mapped to [-1, 1].
fn for_vision(frame: &Tensor, factor: i32) -> Result<Tensor> {
    let (w, h) = vision_size(frame.ne(0) as i32, frame.ne(1) as i32, factor, VISION_MIN_AREA, VISION_MAX_AREA, VlmResizeMode::Area);
    ensure!(w > 0 && h > 0, "a {}x{} picture is too small for the vision tower", frame.ne(0), frame.ne(1));
    let mut t = resize_nearest(frame, &[w as usize, h as usize, 3, 1])?;
    for v in t.data_mut() {
        *v = v.clamp(0.0, 1.0) * 2.0 - 1.0;
    }
    Ok(t)
}

impl VisionPrompt {
    /// Encodes a block of frames (a picture, or two of a video's) and puts it in the prompt.
    fn add(&mut self, tower: &mut VisionTower, llm: &LlmText, frames: &[&Tensor]) -> Result<()> {
        let mut outputs = tower.encode_outputs(frames)?;
        ensure!(
            outputs.len() == 1 + 3,
            "the MiniMax-H3 LLM's vision tower has {} deepstack mergers; it needs 3 (a tower of 24 or 27 blocks, {} here)",
            outputs.len() - 1,
            tower.config().num_layers
        );
        self.text.push_str("<|vision_start|>");
        let index = llm.tokenizer().encode(&self.text).len();
        let embeds = outputs.remove(0);
        let size = embeds.ne(1);
        self.deepstack.resize_with(outputs.len(), Vec::new);
        for (layer, d) in self.deepstack.iter_mut().zip(outputs) {
            layer.push((index, d));
        }
        self.grids.push(ImageGrid { index, size, grid_h: frames[0].ne(1) / self.patch, grid_w: frames[0].ne(0) / self.patch });
        self.images.push((index, embeds));
        self.text.push_str(&"<|image_pad|>".repeat(size));
        self.text.push_str("<|vision_end|>");
        Ok(())
    }
}

impl MinimaxH3Conditioner {
    /// What the vision tower is shown of `req`, as the prompt's front.
    fn show(&mut self, req: &CondRequest<'_>) -> Result<VisionPrompt> {
        let Some(tower) = self.vision.as_mut() else { return Ok(VisionPrompt::default()) };
        let cfg = tower.config();
        let factor = cfg.factor() as i32;
        let mut out = VisionPrompt { patch: cfg.patch_size as usize, merge: cfg.spatial_merge_size as usize, ..VisionPrompt::default() };
        let llm = &self.llm;
        if req.shown.is_empty() {
            for (i, picture) in req.ref_images.iter().enumerate() {
                out.text.push_str(&format!("<Picture {}>: ", i + 1));
                out.add(tower, llm, &[&for_vision(picture, factor)?])?;
            }
            return Ok(out);
        }
        let (mut pictures, mut videos, mut sounds) = (0, 0, 0);
        for item in req.shown {
            match item {
                Shown::Audio => {
                    sounds += 1;
                    out.text.push_str(&format!("<Audio {sounds}>: "));
                }
                Shown::Picture(picture) => {
                    pictures += 1;
                    out.text.push_str(&format!("<Picture {pictures}>: "));
                    out.add(tower, llm, &[&for_vision(picture, factor)?])?;
                }
                Shown::Video(frames) => {
                    videos += 1;
                    out.text.push_str(&format!("<Video {videos}>: "));
                    for pair in frames.chunks(2) {
                        let (first, t0) = &pair[0];
                        let (second, t1) = pair.last().expect("a chunk is never empty");
                        out.text.push_str(&format!("<{:.1} seconds>", (t0 + t1) * 0.5));
                        let a = for_vision(first, factor)?;
                        let mut b = for_vision(second, factor)?;
                        if b.shape() != a.shape() {
                            b = resize_nearest(&b, &[a.ne(0), a.ne(1), 3, 1])?;
                        }
                        out.add(tower, llm, &[&a, &b])?;
                    }
                }
            }
        }
        Ok(out)
    }
}

impl Conditioner for MinimaxH3Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let shown = self.show(req)?;
        let prompt = format!("{}{}", shown.text, req.text);
        let tokens = tokenize_parts(self.llm.tokenizer(), &prompt, "", "", 0);
        ensure!(
            !tokens.ids.is_empty(),
            "MiniMax-H3: the prompt \"{}\" gives no LLM tokens (the reference aborts on an empty prompt; with cfg > 1 the negative prompt must not be empty either)",
            req.text
        );
        let h = if shown.images.is_empty() {
            self.llm.encode(&tokens, OUT_LAYERS)?
        } else {
            let vl = VlInputs { images: &shown.images, deepstack: &shown.deepstack, grids: &shown.grids, merge: shown.merge };
            self.llm.encode_vl(&tokens, OUT_LAYERS, &vl)?
        };
        // The pictures' tokens, with the <|vision_start|> and <|vision_end|> around each, are
        // not text to the transformer.
        let token_types = (!shown.images.is_empty()).then(|| {
            let mut tags = vec![1; tokens.ids.len()];
            for (index, rows) in &shown.images {
                let end = (index + rows.ne(1) + 1).min(tags.len());
                tags[index.saturating_sub(1)..end].fill(0);
            }
            tags
        });
        Ok(Condition { crossattn: Some(h), vector: None, concat: None, extra_context: None, token_types })
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = MinimaxH3Config::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    ctx.ensure_latent_channels(cfg.video_channels, "the MiniMax-H3 transformer", "the MiniMax-H3 VAE's latents have")?;
    let llm = LlmText::open(weights, LlmArch::Qwen3Vl, &te_place, n_threads, params.eager_load)?;
    let width = llm.config().output_width(OUT_LAYERS) as i64;
    // The transformer reads states as wide as itself directly, others through condition_proj
    // (the reference asserts on any other width).
    if width != cfg.hidden_size {
        ensure_text_width(width, cfg.text_dim, "the MiniMax-H3 transformer's condition_proj", "or its own width")?;
    }
    let model = ctx.load_transformer(DIT_PREFIX, |s| MinimaxH3Model::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    let vision = VisionTower::open_deepstack(weights, VisionArch::Qwen3Vl, llm.config().hidden_size, &te_place, n_threads, params.eager_load)?;
    if vision.is_none() {
        // As the reference: its LLM would show the pictures to the tower.
        sd_warn!("no vision weights detected, vision disabled (MiniMax-H3's LLM is not shown the keyframe or reference pictures; llm_vision_path gives it a Qwen3-VL vision tower)");
    }
    let cond = MinimaxH3Conditioner { llm, vision };
    let mut parts = flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT);
    parts.video_cond = super::VideoCond::RefKeyframes;
    Ok(parts)
}

/// MiniMax-H3's audio VAE from `path` (its own names, no prefix, the file's types). A file that
/// is not its layout is refused before any weight is read, as the reference refuses it.
pub(super) fn load_audio_vae(path: &str, devices: &crate::graph::DeviceMap, n_threads: i32) -> Result<Option<Box<dyn AudioStage>>> {
    let Some(weights) = super::open_audio_vae(path) else { return Ok(None) };
    let weights = Arc::new(weights);
    let not_ours = |e: crate::error::Error| crate::error::Error::new(format!("the audio VAE '{path}' is not MiniMax-H3's: {e}"));
    minimax_h3_audio::check_layout(|n| weights.shape_of(n)).map_err(not_ours)?;
    super::audio_vae_floats_only(&weights, path, "MiniMax-H3", |_| true)?;
    let place = devices.placement(crate::graph::Module::Vae)?;
    let vae = weights.load_model(place, n_threads, "", "audio VAE", MinimaxH3AudioVae::new).map_err(not_ours)?;
    Ok(Some(Box::new(vae)))
}

/// `audio_vae_path` for a family without sound. The reference reads such a file as LTX-2.3's
/// audio VAE whatever the family: one without LTX-2.3's tensors fails the context (its metadata
/// validation), an LTX-2.3 one is loaded and never used (here: a warning).
pub(super) fn audio_vae_without_sound(path: &str, version: crate::io::SdVersion) -> Result<()> {
    let Some(weights) = super::open_audio_vae(path) else { return Ok(()) };
    let ltx = weights.names().any(|n| n.starts_with("audio_vae.decoder.") || n.starts_with("vocoder."));
    ensure!(
        ltx,
        "{} models make no sound; the audio VAE '{path}' would have to be LTX-2.3's (audio_vae.decoder.*, vocoder.*), as the reference reads it for them",
        version.name()
    );
    sd_warn!("{} models make no sound; ignoring audio_vae_path", version.name());
    Ok(())
}
