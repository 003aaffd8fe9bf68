//! MiniMax-H3: Qwen3-VL's text model (the output of layer 50, the prompt as it is: no
//! template, no attention syntax), the joint audio-video transformer and its own video VAE.
//! Flow prediction with the default shift 12 (the audio's is 3), like the reference. The
//! audio latent rides behind the video's channels through sampling; its audio VAE (the file
//! of `audio_vae_path`, loaded by [`load_audio_vae`]) decodes it to sound, without one no
//! sound is decoded.

use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::{Component, Components, Module};
use crate::models::Condition;
use crate::models::diffusion::minimax_h3::{MinimaxH3Config, MinimaxH3Model};
use crate::models::te::llm::LlmArch;
use crate::models::te::qwen_vision::{VisionConfig, VISION_PREFIX};
use crate::pipeline::conditioning::llm::{tokenize_parts, LlmText};
use crate::pipeline::conditioning::{CondRequest, Conditioner};
use crate::models::vae::audio::AudioStage;
use crate::models::vae::minimax_h3_audio::{self, MinimaxH3AudioVae};
use crate::types::Prediction;
use std::sync::Arc;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 12.0;
/// The LLM layer whose output (before the final norm) conditions the transformer.
const OUT_LAYERS: &[i32] = &[50];
const DIT_PREFIX: &str = "model.diffusion_model.";

/// The prompt through the LLM, tokenized whole with weight 1 (the reference parses no
/// attention syntax for MiniMax-H3).
pub struct MinimaxH3Conditioner {
    llm: LlmText,
    /// The files hold a vision tower, which the reference shows the keyframe pictures; not
    /// built here.
    vision: bool,
}

impl Components for MinimaxH3Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![self.llm.component()]
    }
}

impl Conditioner for MinimaxH3Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        if self.vision && !req.ref_images.is_empty() {
            sd_warn!("MiniMax-H3: the LLM's vision tower is not supported; the keyframe and reference pictures are not shown to the LLM (only the transformer sees them)");
        }
        let tokens = tokenize_parts(self.llm.tokenizer(), req.text, "", "", 0);
        ensure!(
            !tokens.ids.is_empty(),
            "MiniMax-H3: the prompt \"{}\" gives no LLM tokens (the reference aborts on an empty prompt; with cfg > 1 the negative prompt must not be empty either)",
            req.text
        );
        let h = self.llm.encode(&tokens, OUT_LAYERS)?;
        Ok(Condition { crossattn: Some(h), vector: None, concat: None, extra_context: None })
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
    let vision = VisionConfig::detect(weights.types(), &|n| weights.shape_of(n), VISION_PREFIX).is_some();
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
