//! HiDream-O1: no separate text encoder (the network is itself a Qwen3-VL language model
//! reading the prompt's tokens, which its conditioner only tokenizes), no autoencoder
//! (pixels, the reference's FakeVAE). Flow prediction with the default shift 3, euler and
//! the discrete schedule, cfg as requested; the starting noise is scaled by eta (default
//! 8 for this family), like the reference.
//!
//! The reference also takes reference images (edit): their pixels as extra image tokens
//! and their Qwen3-VL vision embeddings in the prompt. The vision tower is not built here,
//! so such requests are refused (`ref_image_args "pass_to_vlm=false"` gives the reference's
//! text-to-image, as there).

use super::{flow_parts, BuildCtx, Parts};
use crate::error::Result;
use crate::graph::{Component, Components};
use crate::models::condition::Condition;
use crate::models::diffusion::hidream_o1::{HidreamO1Model, PATCH_SIZE};
use crate::models::te::qwen_tokenizer;
use crate::models::vae::PixelSpace;
use crate::pipeline::conditioning::{CondRequest, Conditioner};
use crate::tensor::Tensor;
use crate::types::Prediction;

/// The flow shift of a request that sets none.
const DEFAULT_FLOW_SHIFT: f32 = 3.0;
/// Where the network's weights live (the checkpoint's own names).
const PREFIX: &str = "model.";

/// The prompt in HiDream-O1's chat turn, ending in the image and timestep tokens.
fn chat_prompt(text: &str) -> String {
    format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<|boi_token|><|tms_token|>")
}

/// Tokenizes the prompt (no weights, no network): the ids travel as f32 in
/// [`Condition::vector`].
struct HidreamO1Conditioner;

impl Components for HidreamO1Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        Vec::new()
    }
}

impl Conditioner for HidreamO1Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        ensure!(
            req.ref_images.is_empty(),
            "HiDream-O1 edit (reference images for its Qwen3-VL vision tower) is not supported yet in this build (ref_image_args \"pass_to_vlm=false\" generates from the prompt alone, like stable-diffusion.cpp)"
        );
        let p = PATCH_SIZE as usize;
        // The reference counts whole patches in the prompt but patchifies the padded image,
        // and aborts when the two differ (or when there is no patch at all).
        ensure!(
            req.width >= p && req.height >= p && req.width.is_multiple_of(p) && req.height.is_multiple_of(p),
            "HiDream-O1 generates images whose sides are multiples of {p}, not {}x{} (stable-diffusion.cpp crashes here)",
            req.width,
            req.height
        );
        let ids = qwen_tokenizer::shared()?.encode(&chat_prompt(req.text));
        let v: Vec<f32> = ids.iter().map(|&t| t as f32).collect();
        Ok(Condition { vector: Some(Tensor::from_vec(&[v.len()], v)?), ..Condition::default() })
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let model = ctx.load_transformer(PREFIX, HidreamO1Model::new)?;
    sd_info!("using FakeVAE");
    Ok(flow_parts(ctx.params, Box::new(HidreamO1Conditioner), Box::new(model), (Box::new(PixelSpace), None), Prediction::Flow, DEFAULT_FLOW_SHIFT))
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
}
