//! PhotoMaker as a generation extension (the reference's `photomaker_extension.cpp`), for
//! the CLIP-conditioned UNet families.
//!
//! With ID images and the trigger word `img` after a class word ("a man img"), the prompt is
//! tokenized with the trigger dropped and the class token repeated once per ID image (twice
//! for v2); the condition of those tokens gets the ID encoder's fused embeddings in the
//! class tokens' rows. The request's own condition is encoded from the prompt with the
//! trigger removed (decoded from its tokens: weights and `BREAK`s are gone). The prompt's
//! pass of every step after `style_strength / 100 · steps` uses the fused condition.
//!
//! The file's LoRA (its `lora_unet_*`-style tensors) is in effect for every request, at 1.
//! Like the reference, a request without ID images, without the trigger word or (v2)
//! without matching ID embeddings runs without PhotoMaker, with a warning.

use super::extensions::{Conditioned, ExtRequest, Extension};
use super::imageops::image_to_tensor;
use super::loader::Weights;
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, DeviceMap, Loaded, Module};
use crate::image::Image;
use crate::io::SdVersion;
use crate::models::adapter::photomaker::{self, PhotoMakerIdEncoder, PmVersion, PHOTOMAKER_PREFIX};
use crate::models::te::clip_vision::{self, ClipVisionConfig};
use crate::models::te::tokenizer::{BOS_TOKEN, EOS_TOKEN};
use crate::models::Condition;
use crate::params::{CtxParams, Lora};
use crate::pipeline::prompt::WeightedTokens;
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

const TRIGGER_WORD: &str = "img";

pub struct PhotoMaker {
    net: Loaded<PhotoMakerIdEncoder>,
    /// Kept open: weights living on disk are re-read from it.
    _weights: Arc<Weights>,
    path: String,
    /// The request's fused condition and the step after which it is used.
    id_condition: Option<Condition>,
    start_merge_step: i32,
}

impl PhotoMaker {
    /// The PhotoMaker of `path` (v2 when the path contains "v2", as in the reference).
    pub fn load(path: &str, version: SdVersion, params: &CtxParams, devices: &DeviceMap, n_threads: i32) -> Result<PhotoMaker> {
        let pm_version = PmVersion::of_path(path);
        sd_info!("loading stacked ID embedding (PHOTOMAKER) model file from '{path}'");
        let weights = Arc::new(Weights::open_addon_under(path, PHOTOMAKER_PREFIX, version, params)?);
        let placement = devices.placement(Module::PhotoMaker)?;
        let net = weights
            .load_model(placement, n_threads, PHOTOMAKER_PREFIX, "pmid", |s| PhotoMakerIdEncoder::new(s, pm_version))
            .with_context(|| format!("load PhotoMaker weights from '{path}' failed"))?;
        if pm_version == PmVersion::V2 {
            sd_info!("using PhotoMaker Version 2");
        }
        Ok(PhotoMaker { net, _weights: weights, path: path.to_string(), id_condition: None, start_merge_step: -1 })
    }

    fn turn_off(why: &str) {
        sd_warn!("{why}");
        sd_warn!("Turn off PhotoMaker for this request");
    }

    /// The ID images preprocessed for the tower and stacked: `[224, 224, 3, N]`.
    fn pixels(&self, images: &[Image]) -> Result<Tensor> {
        let size = self.net.model.image_size() as i64;
        let cfg = ClipVisionConfig { image_size: size, ..ClipVisionConfig::vit_l14() };
        let mut data = Vec::new();
        for img in images {
            let t = rgb(img)?;
            data.extend_from_slice(clip_vision::preprocess(&cfg, &t)?.data());
        }
        let s = size as usize;
        Tensor::from_vec(&[s, s, 3, images.len()], data)
    }
}

/// An ID image as `[W, H, 3, 1]` in [0, 1] (grey becomes RGB, alpha is dropped).
fn rgb(img: &Image) -> Result<Tensor> {
    let t = image_to_tensor(img, None)?;
    let plane = t.ne(0) * t.ne(1);
    let data = match t.ne(2) {
        1 => t.data().repeat(3),
        _ => t.data()[..3 * plane].to_vec(),
    };
    Tensor::from_vec(&[t.ne(0), t.ne(1), 3, 1], data)
}

/// The prompt's tokens (between BOS and EOS, `img` marks the class word before it) →
/// tokens with the trigger dropped and the class token repeated `count` times in all, and
/// the positions of those class tokens once padded (BOS in front; empty without a class
/// word before the trigger). Like the reference, the last trigger with a word before it
/// counts, and positions are counted as if the prompt were one chunk.
fn merge_trigger(source: &WeightedTokens, trigger: u32, count: usize) -> (WeightedTokens, Vec<usize>) {
    let (mut ids, mut ws) = (source.tokens.as_slice(), source.weights.as_slice());
    if ids.first() == Some(&BOS_TOKEN) {
        (ids, ws) = (&ids[1..], &ws[1..]);
    }
    if ids.last() == Some(&EOS_TOKEN) {
        (ids, ws) = (&ids[..ids.len() - 1], &ws[..ws.len() - 1]);
    }
    let mut out = WeightedTokens::default();
    let mut class_idx = None;
    for (&t, &w) in ids.iter().zip(ws) {
        if t == trigger {
            if let (Some(&class), Some(&weight)) = (out.tokens.last(), out.weights.last()) {
                class_idx = Some(out.tokens.len() - 1);
                for _ in 1..count {
                    out.tokens.push(class);
                    out.weights.push(weight);
                }
            }
            continue;
        }
        out.tokens.push(t);
        out.weights.push(w);
    }
    let positions = class_idx.map(|c| (c + 1..c + 1 + count).collect()).unwrap_or_default();
    (out, positions)
}

/// The extension's name, which the field rule looks for.
pub const NAME: &str = "photomaker";

impl Extension for PhotoMaker {
    fn name(&self) -> &'static str {
        NAME
    }

    fn loras(&self) -> Vec<Lora> {
        vec![Lora { path: self.path.clone(), multiplier: 1.0, is_high_noise: false }]
    }

    fn prepare(&mut self, req: &mut ExtRequest<'_>) -> Result<()> {
        self.end_request();
        let pm = &req.params.pm_params;
        if pm.id_images.is_empty() {
            Self::turn_off("Provided PhotoMaker model file, but NO input ID images");
            return Ok(());
        }
        let Some(clip) = req.cond.as_clip() else {
            Self::turn_off("PhotoMaker requires FrozenCLIPEmbedderWithCustomWords conditioner");
            return Ok(());
        };
        // SD 1.x / 2.x: the reference's fuse module meets a narrower context and aborts.
        ensure!(
            clip.context_dim() == photomaker::PM_CONTEXT_DIM,
            "PhotoMaker fuses its ID embeddings into SDXL's {}-wide text context, this model's is {} wide (stable-diffusion.cpp aborts here)",
            photomaker::PM_CONTEXT_DIM,
            clip.context_dim()
        );
        let pixels = self.pixels(&pm.id_images)?;
        let start = Instant::now();
        let version = self.net.model.version;
        let n_images = pm.id_images.len();
        let count = n_images * version.tokens_per_image();
        let trigger = match clip.word_ids(TRIGGER_WORD)[..] {
            [t] => t,
            _ => bail!("the PhotoMaker trigger word '{TRIGGER_WORD}' is not one token"),
        };
        let (mut tokens, positions) = merge_trigger(&clip.tokenize_unpadded(&req.text), trigger, count);
        clip.pad_chunks(&mut tokens);
        let positions: Vec<usize> = positions.into_iter().filter(|&p| p < tokens.tokens.len()).collect();
        if positions.is_empty() {
            Self::turn_off(&format!("PhotoMaker trigger word '{TRIGGER_WORD}' was not found in prompt"));
            return Ok(());
        }
        let id_embeds = match (version, pm.id_embed_path.as_deref()) {
            (PmVersion::V2, Some(path)) => photomaker::read_id_embeds(path).ok().filter(|t| !t.is_empty()),
            _ => None,
        };
        if version == PmVersion::V2 {
            let Some(e) = &id_embeds else {
                Self::turn_off("Provided PhotoMaker images, but NO valid ID embeds file for PM v2");
                return Ok(());
            };
            let embeds = e.shape().get(1).copied().unwrap_or(1);
            if embeds != n_images {
                Self::turn_off(&format!(
                    "PhotoMaker image count ({n_images}) does NOT match ID embeds ({embeds}). You should run face_detect.py again."
                ));
                return Ok(());
            }
        }
        let mut cond = clip.encode_tokens(&tokens, req.clip_skip, req.width, req.height, false)?;
        let context = cond.crossattn.as_mut().context("PhotoMaker needs a cross-attention context")?;
        let rows = photomaker::take_rows(context, &positions)?;
        let fused = self.net.run_in_phase(|model, runner| photomaker::fuse(runner, model, &pixels, &rows, id_embeds.as_ref()));
        let fused = match fused {
            Ok(f) => f,
            Err(e) => {
                sd_error!("{e}");
                Self::turn_off("Photomaker ID Stacking failed");
                return Ok(());
            }
        };
        photomaker::replace_rows(context, &positions, &fused)?;
        self.id_condition = Some(cond);
        self.start_merge_step = (pm.style_strength / 100.0 * req.total_steps as f32) as i32;
        let mut plain = clip.tokenize_unpadded(&req.text).tokens;
        if let Some(at) = plain.iter().position(|&t| t == trigger) {
            plain.remove(at);
        }
        req.text = clip.decode(&plain);
        sd_info!("Photomaker ID Stacking, taking {} ms", start.elapsed().as_millis());
        sd_info!("PHOTOMAKER: start_merge_step: {}", self.start_merge_step);
        Ok(())
    }

    fn conditioned(&mut self, req: &Conditioned<'_>) -> Result<()> {
        // The fused condition's pass takes the prompt's concatenated latent channels.
        if let Some(c) = self.id_condition.as_mut() {
            c.concat = req.cond.concat.clone();
        }
        Ok(())
    }

    fn step_condition(&self, step: i32) -> Option<&Condition> {
        self.id_condition.as_ref().filter(|_| self.start_merge_step != -1 && step > self.start_merge_step)
    }

    fn end_request(&mut self) {
        self.id_condition = None;
        self.start_merge_step = -1;
    }
}

impl Components for PhotoMaker {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.net]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(ids: &[u32]) -> WeightedTokens {
        WeightedTokens { tokens: ids.to_vec(), weights: ids.iter().map(|&t| t as f32 / 10.0).collect() }
    }

    #[test]
    fn trigger_repeats_the_class_token() {
        // BOS a man img smiling EOS, two rows per picture.
        let (out, pos) = merge_trigger(&tokens(&[BOS_TOKEN, 1, 2, 9, 3, EOS_TOKEN]), 9, 2);
        assert_eq!(out.tokens, vec![1, 2, 2, 3]);
        assert_eq!(out.weights, vec![0.1, 0.2, 0.2, 0.3]);
        // Padded, BOS goes in front: the class tokens are at 2 and 3.
        assert_eq!(pos, vec![2, 3]);
        // A trigger with nothing before it marks nothing; the last one with a class counts.
        let (out, pos) = merge_trigger(&tokens(&[BOS_TOKEN, 9, 1, 9, 4, 9, EOS_TOKEN]), 9, 1);
        assert_eq!(out.tokens, vec![1, 4]);
        assert_eq!(pos, vec![2]);
        assert!(merge_trigger(&tokens(&[BOS_TOKEN, 1, 2, EOS_TOKEN]), 9, 1).1.is_empty());
    }
}
