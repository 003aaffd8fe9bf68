//! LingBot Video: Qwen3-VL's text model (its normed final state after LingBot's system prompt,
//! which is dropped), the LingBot Video transformer (a mixture-of-experts DiT) and the Wan2.1
//! VAE. Flow prediction with the default shift 3, like the reference. An init image becomes
//! the first latent frame, kept by the denoise mask (the model's input is masked to it too,
//! one timestep for all frames); with a Qwen3-VL vision tower (`llm_vision_path`, or `visual.`
//! in the LLM file) the LLM also sees it, as `<|vision_start|>…<|vision_end|>` before the
//! prompt. The end image is not used.

use super::flux::DIT_PREFIX;
use super::{ensure_text_width, first_stage, flow_parts, BuildCtx, Parts, VideoCond};
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, Module};
use crate::models::diffusion::lingbot_video::{LingbotVideoConfig, LingbotVideoModel};
use crate::models::te::llm::LlmArch;
use crate::models::te::qwen_tokenizer::PAD_TOKEN;
use crate::models::te::qwen_vision::VisionArch;
use crate::models::Condition;
use crate::pipeline::conditioning::llm::{tokenize_parts, LlmText};
use crate::pipeline::conditioning::qwen_edit::{self, EditTemplate, ImagePrompt, VisionTower};
use crate::pipeline::conditioning::{CondRequest, Conditioner};
use crate::pipeline::ref_images::{RefImageParams, VlmResizeMode};
use crate::tensor::Tensor;
use crate::types::Prediction;
use std::time::Instant;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;

/// The system turn and the opening of the user turn; its tokens are dropped from the context.
pub const LINGBOT_SYSTEM: &str = "<|im_start|>system\nGiven a user input that may include a text prompt alone, \
a text prompt with an image reference, or a text prompt with a video reference \
or a video reference alone, generate an \"Enhanced prompt\" that provides detailed \
visual descriptions suitable for video generation. Evaluate the level of detail \
in the user's input: if it is simple, enrich it by adding specifics about colors, \
shapes, sizes, textures, lighting, motion dynamics, camera movement, temporal \
progression, and spatial relationships to create vivid, concrete, and temporally \
coherent scenes to create vivid and concrete scenes. Please generate only the \
enhanced description for the prompt below and avoid including any additional \
commentary or evaluations:<|im_end|>\n<|im_start|>user\n";

/// What follows the prompt.
const LINGBOT_SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n";

/// The init image for the vision tower: `<|vision_start|>`, its embeddings, `<|vision_end|>`
/// right after the system turn (`drop` tokens); each further image two tokens after the
/// previous one's embeddings. Sized by area into 4 to 16384 merged patches (`factor`² pixels
/// each: the tower's patch × its merge size), as the reference does.
fn vision_template(drop: usize, factor: i64) -> EditTemplate {
    EditTemplate {
        pipeline: "LingBotVideoI2VPipeline",
        system: LINGBOT_SYSTEM,
        label: "",
        first_image_token: drop + 1,
        image_gap: 1 + 1,
        drop_first: drop,
        min_length: 0,
        max_length: 0,
        min_size: 2 * factor as i32,
        max_size: 128 * factor as i32,
    }
}

/// The whole prompt is one piece (the reference parses no attention syntax for LingBot).
struct LingbotConditioner {
    llm: LlmText,
    vision: Option<VisionTower>,
    /// Tokens of [`LINGBOT_SYSTEM`] (not counting padding), dropped from the hidden states.
    drop: usize,
}

impl Components for LingbotConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let mut parts = vec![self.llm.component()];
        if let Some(v) = &mut self.vision {
            parts.push(v.component());
        }
        parts
    }
}

impl Conditioner for LingbotConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let images = match &mut self.vision {
            Some(tower) if !req.ref_images.is_empty() => {
                let template = vision_template(self.drop, tower.config().factor());
                let refs = RefImageParams { vlm_resize_mode: VlmResizeMode::Area, ..req.refs };
                qwen_edit::image_prompt(tower, req.ref_images, &refs, &template)?
            }
            _ => ImagePrompt { text: String::new(), images: Vec::new() },
        };
        let text = format!("{LINGBOT_SYSTEM}{}{}{LINGBOT_SUFFIX}", images.text, req.text);
        let tokens = tokenize_parts(self.llm.tokenizer(), &text, "", "", 0);
        let h = self.llm.encode_with_images(&tokens, &[], &images.images)?;
        let (width, n) = (h.ne(0), h.ne(1));
        ensure!(n > self.drop, "the prompt gave {n} LLM tokens, LingBot's system prompt alone is {}", self.drop);
        let data = h.data().get(self.drop * width..).context("LLM hidden states")?.to_vec();
        let context = Tensor::from_vec(&[width, n - self.drop, 1], data)?;
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition { crossattn: Some(context), vector: None, concat: None, extra_context: None, token_types: None })
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;

    let cfg = LingbotVideoConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    ctx.ensure_latent_channels(cfg.in_channels, "the LingBot Video transformer", "the Wan2.1 VAE makes")?;
    let llm = LlmText::open(weights, LlmArch::Qwen3Vl, &te_place, n_threads, params.eager_load)?;
    let width = llm.config().hidden_size;
    ensure_text_width(width, cfg.text_dim, "the LingBot Video transformer's text embedder", "")?;
    let vision = VisionTower::open(weights, VisionArch::Qwen3Vl, width, &te_place, n_threads, params.eager_load)?;
    let drop = llm.tokenizer().encode(LINGBOT_SYSTEM).iter().filter(|&&t| t != PAD_TOKEN).count();
    let cond = LingbotConditioner { llm, vision, drop };

    let model = ctx.load_transformer(DIT_PREFIX, |s| LingbotVideoModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    let mut parts = flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::Flow, DEFAULT_FLOW_SHIFT);
    parts.video_cond = VideoCond::FirstFrame;
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{self, IM_END, IM_START};

    /// The system turn is dropped; the prompt and the assistant turn remain, and an image's
    /// embeddings land on its pads.
    #[test]
    fn prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let drop = tok.encode(LINGBOT_SYSTEM).len();
        let t = tokenize_parts(tok, &format!("{LINGBOT_SYSTEM}a lovely cat{LINGBOT_SUFFIX}"), "", "", 0);
        assert_eq!(&t.ids[drop..], &[64, 16690, 8251, IM_END, 198, IM_START, 77091, 198]);
        crate::pipeline::conditioning::qwen_edit::tests::assert_image_tokens_land(&vision_template(drop, 32));
    }
}
