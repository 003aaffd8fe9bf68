//! Prompt → text conditioning for the UNet models of SD 1.x (CLIP ViT-L, padding with
//! EOS) and SD 2.x (OpenCLIP ViT-H, padding with 0), like the reference's
//! `FrozenCLIPEmbedderWithCustomWords`: the weighted tokens are cut into 77-token chunks,
//! each chunk is encoded on its own, re-weighted, and the chunks are concatenated.

use super::loader::{read_all_f32, Weights};
use super::prompt::{apply_token_weights, tokenize_weighted, EmbeddingSet, PadOptions, CHUNK_LEN, SD1_PAD_TOKEN, SD2_PAD_TOKEN};
use crate::params::Embedding;
use crate::error::{Context as _, Result};
use crate::graph::{Backend, ParamStore, Runner, Scope};
use crate::models::te::clip::{self, ClipConfig, ClipTextModel, ClipVersion, SD_CLIP_PREFIX};
use crate::models::te::tokenizer::ClipTokenizer;
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// One CLIP text encoder with its weights and textual-inversion embeddings.
pub struct ClipConditioner {
    model: ClipTextModel,
    // Holds the weights `model` refers to; dropped with it.
    _store: ParamStore,
    runner: Runner,
    tokenizer: &'static ClipTokenizer,
    pad_token: u32,
    embeddings: EmbeddingSet,
}

impl ClipConditioner {
    /// The text encoder of an SD 1.x (`sd2 == false`) or SD 2.x checkpoint, with the
    /// embeddings of `embeddings` (files of any float type).
    pub fn new(weights: &Weights, sd2: bool, embeddings: &[Embedding], backend: Arc<Backend>, n_threads: i32) -> Result<Self> {
        let version = if sd2 { ClipVersion::OpenClipVitH14 } else { ClipVersion::OpenAiVitL14 };
        let mut cfg = ClipConfig::detect(weights.types(), SD_CLIP_PREFIX, version);
        // Like the reference: with embeddings configured the token table stays f32.
        cfg.force_f32_token_embedding = !embeddings.is_empty();
        let mut store = ParamStore::new(16 + 16 * cfg.n_layer as usize)?;
        let model = ClipTextModel::new(&mut Scope::new(&mut store, weights.types(), SD_CLIP_PREFIX), &cfg);
        weights.load(&mut store, &backend, "text encoder", n_threads.max(1) as usize)?;

        let mut set = EmbeddingSet::new(&[cfg.hidden_size as usize]);
        for e in embeddings {
            let tensors: Vec<Tensor> = read_all_f32(&e.path)
                .with_context(|| format!("embedding '{}'", e.name))?
                .into_iter()
                .map(|(_, t)| t)
                .collect();
            set.register_tensors(&e.name, &tensors).with_context(|| format!("embedding '{}' from '{}'", e.name, e.path))?;
            sd_debug!("embedding '{}' loaded from '{}'", e.name, e.path);
        }
        Ok(ClipConditioner {
            model,
            _store: store,
            runner: Runner::new(backend, n_threads),
            tokenizer: ClipTokenizer::shared()?,
            pad_token: if sd2 { SD2_PAD_TOKEN } else { SD1_PAD_TOKEN },
            embeddings: set,
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.model.cfg.hidden_size as usize
    }

    pub fn runner_mut(&mut self) -> &mut Runner {
        &mut self.runner
    }

    /// The weights and runner LoRAs update.
    pub fn lora_target(&mut self) -> super::lora::LoraTarget<'_> {
        super::lora::LoraTarget { store: &mut self._store, runner: &mut self.runner }
    }

    /// The cross-attention context of `text`: [hidden, 77 · chunks, 1].
    pub fn encode(&mut self, text: &str, clip_skip: i32) -> Result<Tensor> {
        let start = Instant::now();
        let tokens = tokenize_weighted(self.tokenizer, text, &self.embeddings, &PadOptions::clip_chunks(self.pad_token));
        let custom = if self.embeddings.token_count() > 0 { Some(self.embeddings.custom_rows(0)?) } else { None };
        let dim = self.hidden_size();
        let mut data = Vec::with_capacity(tokens.tokens.len() * dim);
        for (ids, weights) in tokens.chunks(CHUNK_LEN) {
            let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
            let mut hidden = clip::encode(&mut self.runner, &self.model, &ids, custom.as_ref(), clip_skip)?;
            apply_token_weights(&mut hidden, weights, CHUNK_LEN)?;
            data.extend_from_slice(hidden.data());
        }
        self.runner.release();
        let n = data.len() / dim;
        ensure!(n > 0, "the prompt produced no tokens");
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Tensor::from_vec(&[dim, n, 1], data)
    }
}
