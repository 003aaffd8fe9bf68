//! The edit prompts of the vision-language LLM families (the reference's
//! `QwenImageEditPlusPipeline` and `LongCatEditPipeline` branches of its LLM conditioner, and
//! Krea2's and Boogu Image's with Qwen3-VL): with a vision tower, each
//! reference image is resized for it, encoded, and put in the user turn as
//! `<|vision_start|>`, one `<|image_pad|>` per embedding and `<|vision_end|>` (Qwen-Image
//! labels each `Picture N: `, Mage-Flow `Image N: `); the LLM reads the embeddings at token positions the
//! reference hard-codes per family ([`EditTemplate`]), and the front of the hidden states
//! is dropped.

use super::llm::LlmText;
use crate::error::Result;
use crate::graph::{Component, Loaded, Placement};
use crate::models::te::qwen_vision::{self, QwenVisionModel, VisionArch, VisionConfig, VISION_PREFIX};
use crate::pipeline::loader::Weights;
use crate::pipeline::ref_images::{RefImageParams, VlmResizeMode};
use crate::tensor::Tensor;
use std::sync::Arc;

/// A family's edit prompt: its system turn and the token arithmetic the reference
/// hard-codes for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EditTemplate {
    /// Logged when the edit prompt is used (the reference's pipeline name; empty: none).
    pub pipeline: &'static str,
    pub system: &'static str,
    /// Each image is announced as `{label}N: ` before its `<|vision_start|>` (empty: not
    /// announced).
    pub label: &'static str,
    /// Where the first image's embeddings go, and how far each next one starts after the
    /// previous one's embeddings end.
    pub first_image_token: usize,
    pub image_gap: usize,
    /// Tokens dropped from the front of the hidden states.
    pub drop_first: usize,
    /// Token sequences shorter than this are padded (masked).
    pub min_length: usize,
    /// Longer token sequences are cut to this many (0: never).
    pub max_length: usize,
    /// The vision input's default pixel bounds (sides; squared in area mode).
    pub min_size: i32,
    pub max_size: i32,
}

/// Qwen-Image-Edit: the first image's embeddings start at token 70, after the 64 system
/// tokens and `Picture 1: <|vision_start|>`; each further image 7 tokens after the previous
/// one's end.
pub const QWEN_EDIT: EditTemplate = EditTemplate {
    pipeline: "QwenImageEditPlusPipeline",
    system: "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), then explain how the user's text instruction should alter or modify the image. Generate a new image that meets the user's requirements while maintaining consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n",
    label: "Picture ",
    first_image_token: 64 + 6,
    image_gap: 1 + 6,
    drop_first: 64,
    min_length: 0,
    max_length: 0,
    min_size: 384,
    max_size: 560,
};

/// LongCat-Image-Edit: the reference drops the 67 tokens of the system turn and pads to 579,
/// but puts the embeddings at token 42 (each next image 7 tokens after the previous one's
/// end), inside the system turn: they replace system tokens rather than the pad tokens (the
/// reference's arithmetic, kept; a warning says so).
pub const LONGCAT_EDIT: EditTemplate = EditTemplate {
    pipeline: "LongCatEditPipeline",
    system: "<|im_start|>system\nAs an image editing expert, first analyze the content and attributes of the input image(s). Then, based on the user's editing instructions, clearly and precisely determine how to modify the given image(s), ensuring that only the specified parts are altered and all other aspects remain consistent with the original(s).<|im_end|>\n<|im_start|>user\n",
    label: "",
    first_image_token: 36 + 6,
    image_gap: 1 + 6,
    drop_first: 67,
    min_length: 512 + 67,
    max_length: 0,
    min_size: 384,
    max_size: 560,
};

/// The vision tower of an LLM conditioner, with its weights like the LLM's: read for each
/// conditioning phase unless resident.
pub struct VisionTower {
    net: Loaded<QwenVisionModel>,
}

impl VisionTower {
    /// The tower in the context's files (`llm_vision_path`, or `visual.` in `llm_path`), if
    /// any; it must be the LLM's kind (`arch`) and its output `llm_width` wide.
    pub fn open(weights: &Arc<Weights>, arch: VisionArch, llm_width: i64, place: &Placement, n_threads: i32, resident: bool) -> Result<Option<VisionTower>> {
        Self::open_at(weights, VISION_PREFIX, arch, llm_width, place, n_threads, resident)
    }

    /// [`VisionTower::open`] for a tower under `prefix` (HiDream-O1's checkpoint keeps it
    /// under `model.visual.`).
    pub fn open_at(weights: &Arc<Weights>, prefix: &str, arch: VisionArch, llm_width: i64, place: &Placement, n_threads: i32, resident: bool) -> Result<Option<VisionTower>> {
        Self::open_with(weights, prefix, arch, llm_width, place, n_threads, resident, false)
    }

    /// [`VisionTower::open`] with the deepstack mergers a 24- or 27-block tower has (MiniMax-H3
    /// reads them; the other families leave them unread, like the reference).
    pub fn open_deepstack(weights: &Arc<Weights>, arch: VisionArch, llm_width: i64, place: &Placement, n_threads: i32, resident: bool) -> Result<Option<VisionTower>> {
        Self::open_with(weights, VISION_PREFIX, arch, llm_width, place, n_threads, resident, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn open_with(weights: &Arc<Weights>, prefix: &str, arch: VisionArch, llm_width: i64, place: &Placement, n_threads: i32, resident: bool, deepstack: bool) -> Result<Option<VisionTower>> {
        let Some(mut cfg) = VisionConfig::detect(weights.types(), &|n| weights.shape_of(n), prefix) else {
            return Ok(None);
        };
        if !deepstack {
            cfg.deepstack.clear();
        }
        ensure!(cfg.arch == arch, "the LLM vision tower (llm_vision_path) is {:?}'s, the LLM text encoder needs {arch:?}'s", cfg.arch);
        cfg.validate()?;
        ensure!(
            cfg.out_hidden_size == llm_width,
            "the LLM vision tower (llm_vision_path) outputs {} wide embeddings, the LLM text encoder (llm_path) is {llm_width} wide",
            cfg.out_hidden_size
        );
        sd_debug!("enable llm vision: {} blocks of {}, {} heads", cfg.num_layers, cfg.hidden_size, cfg.num_heads);
        let net = weights.load_model(place.resident_or_per_phase(resident), n_threads, prefix, "llm vision", |s| QwenVisionModel::new(s, &cfg))?;
        Ok(Some(VisionTower { net }))
    }

    pub fn config(&self) -> &VisionConfig {
        &self.net.model.cfg
    }

    /// Embeddings `[width, tokens]` of a preprocessed image; outside a conditioning phase
    /// the weights are read and freed around the call.
    pub fn encode(&mut self, image: &Tensor) -> Result<Tensor> {
        self.net.run_in_phase(|model, runner| qwen_vision::encode_image(runner, model, image))
    }

    /// The embeddings of a block of preprocessed frames (one picture, or a video's two frames)
    /// and the deepstack mergers' outputs after them.
    pub fn encode_outputs(&mut self, frames: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.net.run_in_phase(|model, runner| qwen_vision::encode_outputs(runner, model, frames))
    }

    pub fn component(&mut self) -> &mut dyn Component {
        &mut self.net
    }
}

/// The size (`w`, `h`) a `width`×`height` image is resized to for the tower: sides rounded
/// to multiples of `factor`, then scaled into `[min, max]` (area or longest side), like the
/// reference's `resize_image_dims`.
pub fn vision_size(width: i32, height: i32, factor: i32, min: i32, max: i32, mode: VlmResizeMode) -> (i32, i32) {
    let f = factor as f64;
    let (w, h) = (width as f64, height as f64);
    let mut h_bar = ((h / f).round() * f) as i32;
    let mut w_bar = ((w / f).round() * f) as i32;
    let at_least = |v: f64| factor.max((v / f).floor() as i32 * factor);
    let rounded = |v: f64| factor.max((v / f).round() as i32 * factor);
    let up = |v: f64| (v / f).ceil() as i32 * factor;
    if min > 0 && min == max {
        match mode {
            VlmResizeMode::Area => {
                let beta = (min as f64 / (h * w)).sqrt();
                (h_bar, w_bar) = (rounded(h * beta), rounded(w * beta));
            }
            VlmResizeMode::LongestSide => {
                let beta = min as f64 / h.max(w);
                (h_bar, w_bar) = (rounded(h * beta), rounded(w * beta));
            }
            VlmResizeMode::None => {}
        }
        return (w_bar, h_bar);
    }
    match mode {
        VlmResizeMode::Area => {
            let area = h_bar as f64 * w_bar as f64;
            if max > 0 && area > max as f64 {
                let beta = (h * w / max as f64).sqrt();
                (h_bar, w_bar) = (at_least(h / beta), at_least(w / beta));
            } else if min > 0 && area < min as f64 {
                let beta = (min as f64 / (h * w)).sqrt();
                (h_bar, w_bar) = (up(h * beta), up(w * beta));
            }
        }
        VlmResizeMode::LongestSide => {
            let side = height.max(width);
            if max > 0 && side > max {
                let beta = max as f64 / side as f64;
                (h_bar, w_bar) = (at_least(h * beta), at_least(w * beta));
            } else if min > 0 && side < min {
                let beta = min as f64 / side as f64;
                (h_bar, w_bar) = (up(h * beta), up(w * beta));
            }
        }
        VlmResizeMode::None => {}
    }
    (w_bar, h_bar)
}

/// The request's bounds, or the template's defaults (squared in area mode; none stays none).
fn bounds(refs: &RefImageParams, template: &EditTemplate) -> (i32, i32) {
    let default = |v: i32| {
        if v > 0 && refs.vlm_resize_mode == VlmResizeMode::Area {
            v * v
        } else {
            v
        }
    };
    let min = if refs.vlm_min_size > 0 { refs.vlm_min_size } else { default(template.min_size) };
    let max = if refs.vlm_max_size > 0 { refs.vlm_max_size } else { default(template.max_size) };
    (min, max)
}

/// The user turn's image part (`Picture 1: <|vision_start|><|image_pad|>…<|vision_end|>…`)
/// and each image's embeddings with the token they start at.
pub struct ImagePrompt {
    pub text: String,
    pub images: Vec<(usize, Tensor)>,
}

/// Encodes `ref_images` (`[W, H, 3, 1]` in [0, 1]) with `tower` into an [`ImagePrompt`] of
/// `template`.
pub fn image_prompt(tower: &mut VisionTower, ref_images: &[Tensor], refs: &RefImageParams, template: &EditTemplate) -> Result<ImagePrompt> {
    if !template.pipeline.is_empty() {
        sd_info!("{}", template.pipeline);
    }
    let (min, max) = bounds(refs, template);
    let factor = tower.config().factor() as i32;
    let mut prompt = ImagePrompt { text: String::new(), images: Vec::new() };
    let mut index = template.first_image_token;
    for (i, image) in ref_images.iter().enumerate() {
        let (width, height) = (image.ne(0) as i32, image.ne(1) as i32);
        let (w, h) = vision_size(width, height, factor, min, max, refs.vlm_resize_mode);
        sd_debug!("resize conditioner ref image {i} from {height}x{width} to {h}x{w}");
        ensure!(w > 0 && h > 0, "reference image {i} ({width}x{height}) is too small for the vision tower");
        let embeds = tower.encode(&qwen_vision::preprocess(image, w as usize, h as usize)?)?;
        let n = embeds.ne(1);
        prompt.images.push((index, embeds));
        index += n + template.image_gap;
        if !template.label.is_empty() {
            prompt.text.push_str(&format!("{}{}: ", template.label, i + 1));
        }
        prompt.text.push_str("<|vision_start|>");
        prompt.text.push_str(&"<|image_pad|>".repeat(n));
        prompt.text.push_str("<|vision_end|>");
    }
    Ok(prompt)
}

/// Runs `llm` on `template` around `text` with the image prompt spliced in: hidden states
/// `[width, L, 1]` of the whole sequence (the caller drops `template.drop_first`).
pub fn encode(llm: &mut LlmText, template: &EditTemplate, images: ImagePrompt, text: &str, suffix: &str, out_layers: &[i32], spell_quotes: bool) -> Result<Tensor> {
    let prefix = format!("{}{}", template.system, images.text);
    let tokens = super::llm::tokenize_pieces(llm.tokenizer(), &prefix, text, suffix, template.min_length, spell_quotes).cut(template.max_length);
    for (index, rows) in &images.images {
        let pads = tokens.ids.get(*index..index + rows.ne(1)).unwrap_or_default();
        if pads.iter().any(|&t| t != IMAGE_PAD) {
            sd_warn!("image embeddings at token {index} do not fall on <|image_pad|> tokens");
        }
    }
    llm.encode_with_images(&tokens, out_layers, &images.images)
}

/// `<|image_pad|>`.
const IMAGE_PAD: u32 = 151655;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer;

    #[test]
    fn edit_sizes_follow_the_reference() {
        let area = VlmResizeMode::Area;
        // 64×64 is below 384²: scaled up to the next multiples of 28.
        assert_eq!(vision_size(64, 64, 28, 384 * 384, 560 * 560, area), (392, 392));
        // 1024×768 is above 560²: scaled down (floored).
        assert_eq!(vision_size(1024, 768, 28, 384 * 384, 560 * 560, area), (644, 476));
        // Within the bounds: only rounded.
        assert_eq!(vision_size(500, 400, 28, 384 * 384, 560 * 560, area), (504, 392));
        assert_eq!(vision_size(1000, 500, 28, 384, 560, VlmResizeMode::LongestSide), (560, 280));
        assert_eq!(vision_size(300, 200, 28, 560, 560, VlmResizeMode::LongestSide), (560, 364));
        assert_eq!(bounds(&RefImageParams::default(), &QWEN_EDIT), (384 * 384, 560 * 560));
    }

    /// The hard-coded token arithmetic holds: the system prompt is 64 tokens and each image's
    /// embeddings start right after its `Picture N: <|vision_start|>`.
    #[test]
    fn image_tokens_land_on_the_pads() {
        let tok = qwen_tokenizer::shared().unwrap();
        assert_eq!(tok.encode(QWEN_EDIT.system).len(), QWEN_EDIT.drop_first);
        assert_image_tokens_land(&QWEN_EDIT);
    }

    /// Two images' prompt in `t`: each image's embeddings start on its first
    /// `<|image_pad|>`, right after `<|vision_start|>`, and end before `<|vision_end|>`.
    pub(crate) fn assert_image_tokens_land(t: &EditTemplate) {
        let tok = qwen_tokenizer::shared().unwrap();
        let mut text = String::new();
        let mut index = t.first_image_token;
        let mut starts = Vec::new();
        for (i, n) in [3usize, 2].iter().enumerate() {
            starts.push(index);
            index += n + t.image_gap;
            if !t.label.is_empty() {
                text.push_str(&format!("{}{}: ", t.label, i + 1));
            }
            text.push_str(&format!("<|vision_start|>{}<|vision_end|>", "<|image_pad|>".repeat(*n)));
        }
        let ids = tok.encode(&format!("{}{text}make it blue", t.system));
        assert_eq!(&ids[starts[0]..starts[0] + 3], &[IMAGE_PAD; 3]);
        assert_eq!(ids[starts[0] - 1], IMAGE_PAD - 3, "<|vision_start|> before the pads");
        assert_eq!(ids[starts[1] - 1], IMAGE_PAD - 3, "<|vision_start|> before the pads");
        assert_eq!(&ids[starts[1]..starts[1] + 2], &[IMAGE_PAD; 2]);
        assert_eq!(ids[starts[1] + 2], IMAGE_PAD - 2, "<|vision_end|> after them");
    }

    /// LongCat drops its 67-token system turn, but its hard-coded first image position lies
    /// inside that turn, so the embeddings replace system tokens (the reference's arithmetic).
    #[test]
    fn longcat_edit_positions_are_the_references() {
        let tok = qwen_tokenizer::shared().unwrap();
        let system = tok.encode(LONGCAT_EDIT.system).len();
        assert_eq!(system, LONGCAT_EDIT.drop_first);
        assert!(LONGCAT_EDIT.first_image_token < system);
    }
}
