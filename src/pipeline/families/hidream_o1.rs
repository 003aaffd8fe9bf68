//! HiDream-O1: no separate text encoder (the network is itself a Qwen3-VL language model
//! reading the prompt's tokens, which its conditioner only tokenizes), no autoencoder
//! (pixels, the reference's FakeVAE). Flow prediction with the default shift 3, euler and
//! the discrete schedule, cfg as requested; the starting noise is scaled by eta (default
//! 8 for this family), like the reference.
//!
//! Edit (`ref_image_args "pass_to_vlm=true"`; the reference's default leaves reference
//! images unread): each reference image is resized to the area of the request's longer side
//! (less with more images) and centre-cropped to whole 32-pixel patches; those pixels become
//! patch tokens after the image's, and a copy about 384² in size goes through the checkpoint's
//! Qwen3-VL vision tower (`model.visual.`), whose embeddings stand in the user turn before
//! the prompt as `<|vision_start|>`, pads, `<|vision_end|>`.

use super::{flow_parts, BuildCtx, Parts};
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, Module};
use crate::models::condition::Condition;
use crate::models::diffusion::hidream_o1::{self, EditImage, HidreamO1Model, HidreamPrompt, PATCH_SIZE};
use crate::models::te::qwen_tokenizer;
use crate::models::te::qwen_vision::VisionArch;
use crate::models::vae::PixelSpace;
use crate::pipeline::conditioning::qwen_edit::VisionTower;
use crate::pipeline::conditioning::{CondRequest, Conditioner};
use crate::pipeline::imageops::resize_nearest;
use crate::pipeline::resample::{resize_filtered, Filter};
use crate::tensor::Tensor;
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;
/// Where the network's weights live (the checkpoint's own names).
const PREFIX: &str = "model.";
/// Where its vision tower lives.
const VISION_PREFIX: &str = "model.visual.";
/// The opening of the user turn, and what follows the prompt: the image and timestep tokens.
const USER: &str = "<|im_start|>user\n";
const SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n<|boi_token|><|tms_token|>";

/// The prompt in HiDream-O1's chat turn, ending in the image and timestep tokens.
fn chat_prompt(text: &str) -> String {
    format!("{USER}{text}{SUFFIX}")
}

/// Tokenizes the prompt (text to image: no weights, no network) and, for edit, prepares the
/// reference images and runs the vision tower; the result travels as a [`HidreamPrompt`].
struct HidreamO1Conditioner {
    vision: Option<VisionTower>,
}

impl Components for HidreamO1Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        self.vision.iter_mut().map(|v| v.component()).collect()
    }
}

/// Pixels per side the reference images are sized to (the area of a square of it), by how
/// many there are, from the request's longer side.
fn ref_side(count: usize, longer: usize) -> usize {
    match count {
        1 => longer,
        2 => longer * 48 / 64,
        3..=4 => longer / 2,
        5..=8 => longer * 24 / 64,
        _ => longer / 4,
    }
}

/// Side of the square whose area the vision tower's copies get, by how many images.
fn vision_side(count: usize) -> usize {
    match count {
        0..=4 => 384,
        5..=8 => 384 * 48 / 64,
        _ => 384 / 2,
    }
}

/// The size of `ratio` (width / height) whose area is about `side`², in whole patches (at
/// least one), as the reference computes it.
fn vision_dims(side: usize, ratio: f64) -> (usize, usize) {
    let p = PATCH_SIZE as usize;
    let w = ((side * side) as f64 * ratio).sqrt() as usize;
    let h = (w as f64 / ratio) as usize;
    ((w / p * p).max(p), (h / p * p).max(p))
}

/// `image` `[W, H, 3, 1]` scaled (bicubic) to cover the largest size of whole patches whose
/// area is at most `side`², then centre-cropped to it.
fn resize_to_area(image: &Tensor, side: usize) -> Result<Tensor> {
    let p = PATCH_SIZE as i64;
    let (w, h) = (image.ne(0) as f64, image.ne(1) as f64);
    let max_area = (side * side) as i64;
    let scale = (max_area as f64 / (w * h)).sqrt();
    let whole = |v: i64| v / p * p;
    let (rw, fw) = (whole((w * scale).round() as i64), whole((w * scale).floor() as i64));
    let (rh, fh) = (whole((h * scale).round() as i64), whole((h * scale).floor() as i64));
    let mut sizes = [(rw, rh), (rw, fh), (fw, rh), (fw, fh)];
    sizes.sort_by_key(|&(a, b)| std::cmp::Reverse(a * b));
    let fits = sizes.iter().find(|&&(a, b)| a > 0 && b > 0 && a * b <= max_area);
    let (nw, nh) = *fits.unwrap_or(&sizes[3]);
    ensure!(nw > 0 && nh > 0, "a {}x{} reference image is too small for HiDream-O1's {side}-pixel references (no whole {p}-pixel patch)", image.ne(0), image.ne(1));
    let (nw, nh) = (nw as usize, nh as usize);
    let (s1, s2) = (w / nw as f64, h / nh as f64);
    if s1 < s2 {
        let rh = (h / s1).round() as usize;
        let resized = resize_filtered(image, nw, rh, Filter::Bicubic, false)?;
        crop_rows(&resized, (rh - nh) / 2, nh)
    } else {
        let rw = (w / s2).round() as usize;
        let resized = resize_filtered(image, rw, nh, Filter::Bicubic, false)?;
        crop_columns(&resized, (rw - nw) / 2, nw)
    }
}

/// Rows `top..top + rows` of each plane of `t` `[W, H, C, 1]`.
fn crop_rows(t: &Tensor, top: usize, rows: usize) -> Result<Tensor> {
    let (w, h, c) = (t.ne(0), t.ne(1), t.ne(2));
    let data = t.data().chunks_exact(w * h).flat_map(|plane| &plane[top * w..(top + rows) * w]).copied().collect();
    Tensor::from_vec(&[w, rows, c, 1], data)
}

/// Columns `left..left + cols` of each row of `t` `[W, H, C, 1]`.
fn crop_columns(t: &Tensor, left: usize, cols: usize) -> Result<Tensor> {
    let (w, h, c) = (t.ne(0), t.ne(1), t.ne(2));
    let data = t.data().chunks_exact(w).flat_map(|row| &row[left..left + cols]).copied().collect();
    Tensor::from_vec(&[cols, h, c, 1], data)
}

impl HidreamO1Conditioner {
    /// The edit prompt: each reference image, resized, as patch pixels and (a copy sized for
    /// the tower, nearest-resized) as vision embeddings in the user turn before the prompt.
    fn edit(&mut self, req: &CondRequest<'_>) -> Result<HidreamPrompt> {
        let tower = self.vision.as_mut().context(
            "HiDream-O1 edit needs its Qwen3-VL vision tower (model.visual.* in the model file), which this checkpoint lacks (ref_image_args \"pass_to_vlm=false\" generates from the prompt alone)",
        )?;
        let p = PATCH_SIZE as usize;
        let tok = qwen_tokenizer::shared()?;
        let count = req.ref_images.len();
        let (side, vis_side) = (ref_side(count, req.width.max(req.height)), vision_side(count));
        let mut prompt = USER.to_string();
        let mut images = Vec::with_capacity(count);
        for image in req.ref_images {
            let resized = resize_to_area(image, side)?.map(|v| v.clamp(0.0, 1.0));
            let (vw, vh) = vision_dims(vis_side, resized.ne(0) as f64 / resized.ne(1) as f64);
            let for_tower = resize_nearest(&resized, &[vw, vh, 3, 1])?.map(|v| v * 2.0 - 1.0);
            let (rows, cols) = (vh / p, vw / p);
            prompt.push_str("<|vision_start|>");
            let start = tok.encode(&prompt).len();
            let embeds = tower.encode(&for_tower)?;
            ensure!(
                embeds.ne(1) == rows * cols,
                "HiDream-O1's vision tower gave {} embeddings for a {vw}x{vh} image, the prompt counts {}",
                embeds.ne(1),
                rows * cols
            );
            prompt.push_str(&"<|image_pad|>".repeat(rows * cols));
            prompt.push_str("<|vision_end|>");
            images.push(EditImage { start, rows, cols, embeds, pixels: resized.map(|v| v * 2.0 - 1.0) });
        }
        prompt.push_str(req.text);
        prompt.push_str(SUFFIX);
        let ids = tok.encode(&prompt).iter().map(|&t| t as i32).collect();
        Ok(HidreamPrompt { ids, images })
    }
}

impl Conditioner for HidreamO1Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let p = PATCH_SIZE as usize;
        // The reference counts whole patches in the prompt but patchifies the padded image,
        // and aborts when the two differ (or when there is no patch at all).
        ensure!(
            req.width >= p && req.height >= p && req.width.is_multiple_of(p) && req.height.is_multiple_of(p),
            "HiDream-O1 generates images whose sides are multiples of {p}, not {}x{} (stable-diffusion.cpp crashes here)",
            req.width,
            req.height
        );
        let prompt = if req.ref_images.is_empty() {
            let ids = qwen_tokenizer::shared()?.encode(&chat_prompt(req.text)).iter().map(|&t| t as i32).collect();
            HidreamPrompt { ids, images: Vec::new() }
        } else {
            self.edit(req)?
        };
        prompt.to_condition()
    }

    fn reads_ref_images(&self) -> bool {
        true
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let te_place = ctx.devices.placement(Module::Te)?;
    let hidden = hidream_o1::llm_config().hidden_size;
    let vision = VisionTower::open_at(ctx.weights, VISION_PREFIX, VisionArch::Qwen3Vl, hidden, &te_place, ctx.n_threads, ctx.params.eager_load)?;
    if let Some(v) = &vision {
        ensure!(v.config().factor() == PATCH_SIZE, "HiDream-O1's vision tower merges {}-pixel cells, the network's patches are {PATCH_SIZE}", v.config().factor());
    }
    let model = ctx.load_transformer(PREFIX, HidreamO1Model::new)?;
    sd_info!("using FakeVAE");
    let cond = HidreamO1Conditioner { vision };
    Ok(flow_parts(ctx.params, Box::new(cond), Box::new(model), (Box::new(PixelSpace), None), Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{IM_END, IM_START};

    /// The chat turn's special tokens are single ids; the timestep token comes last.
    #[test]
    fn prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let ids = tok.encode(&chat_prompt("a lovely cat"));
        assert_eq!(ids[0], IM_START);
        assert_eq!(&ids[3..6], &[64, 16690, 8251]);
        assert_eq!(ids[6], IM_END);
        assert_eq!(*ids.last().unwrap(), 151673);
    }

    /// The reference's sizes: a 64² request's one reference image at 64², its tower copy at
    /// 384²; a 100×50 picture cropped to whole patches of the area.
    #[test]
    fn edit_sizes() {
        assert_eq!((ref_side(1, 64), ref_side(2, 64), ref_side(3, 64), ref_side(6, 64), ref_side(9, 64)), (64, 48, 32, 24, 16));
        assert_eq!((vision_side(4), vision_side(5), vision_side(9)), (384, 288, 192));
        assert_eq!(vision_dims(384, 1.0), (384, 384));
        assert_eq!(vision_dims(384, 2.0), (512, 256));
        let img = Tensor::full(&[100, 50, 3, 1], 0.25);
        let r = resize_to_area(&img, 64).unwrap();
        assert_eq!(r.shape(), &[64, 32, 3, 1]);
        assert!(r.data().iter().all(|&v| (v - 0.25).abs() < 1e-6));
        assert!(resize_to_area(&Tensor::full(&[8, 8, 3, 1], 0.5), 16).is_err());
    }
}
