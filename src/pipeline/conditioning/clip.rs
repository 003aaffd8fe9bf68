//! CLIP conditioning of the UNet families, like the reference's
//! `FrozenCLIPEmbedderWithCustomWords`: the weighted prompt is cut into 77-token chunks and
//! each chunk is encoded on its own, re-weighted, and the chunks are concatenated.
//!
//! - SD 1.x: CLIP ViT-L (padding with EOS), clip skip 1 by default;
//! - SD 2.x: OpenCLIP ViT-H (padding with 0), clip skip 2;
//! - SDXL: CLIP ViT-L and OpenCLIP bigG side by side (their hidden states concatenated per
//!   token, both without the final norm, clip skip 2); bigG sees every token after the first
//!   EOS as 0 and gives the pooled, projected vector of the first chunk, which with the
//!   image size forms SDXL's vector conditioning.

use super::{CondRequest, Conditioner};
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, Loaded, Placement};
use crate::models::te::clip::{self, ClipConfig, ClipTextModel, ClipVersion, SDXL_CLIP_G_PREFIX, SD_CLIP_PREFIX};
use crate::models::te::tokenizer::{ClipTokenizer, EOS_TOKEN};
use crate::models::Condition;
use crate::params::Embedding;
use crate::pipeline::loader::{read_all_f32, Weights};
use crate::pipeline::prompt::{apply_token_weights, tokenize_weighted, zero_after_first_eos, EmbeddingSet, PadOptions, WeightedTokens, CHUNK_LEN};
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// The text encoders of a UNet family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipSet {
    /// SD 1.x: OpenAI CLIP ViT-L/14.
    L,
    /// SD 2.x: OpenCLIP ViT-H/14.
    H,
    /// SDXL: CLIP ViT-L/14 and OpenCLIP ViT-bigG/14.
    LBigG,
}

/// Width of SDXL's vector conditioning: pooled bigG output + three size embeddings.
pub const SDXL_ADM_CHANNELS: usize = 2816;
/// Width of each of SDXL's size embeddings (one per number).
const SIZE_EMBED_DIM: usize = 256;

pub struct ClipConditioner {
    set: ClipSet,
    encoders: Vec<Loaded<ClipTextModel>>,
    tokenizer: &'static ClipTokenizer,
    pad_token: u32,
    embeddings: EmbeddingSet,
}

impl ClipConditioner {
    /// The encoders of `set` from `weights`, with the textual-inversion `embeddings` (files
    /// of any float type; each encoder gets the rows of its own width).
    pub fn new(weights: &Arc<Weights>, set: ClipSet, embeddings: &[Embedding], placement: &Placement, n_threads: i32) -> Result<Self> {
        let specs: &[(ClipVersion, &str)] = match set {
            ClipSet::L => &[(ClipVersion::OpenAiVitL14, SD_CLIP_PREFIX)],
            ClipSet::H => &[(ClipVersion::OpenClipVitH14, SD_CLIP_PREFIX)],
            ClipSet::LBigG => &[(ClipVersion::OpenAiVitL14, SD_CLIP_PREFIX), (ClipVersion::OpenClipVitBigG14, SDXL_CLIP_G_PREFIX)],
        };
        let mut encoders = Vec::new();
        for &(version, prefix) in specs {
            let mut cfg = ClipConfig::detect(weights.types(), prefix, version);
            if set == ClipSet::LBigG {
                // SDXL reads the penultimate layer of both encoders, without the final norm.
                cfg.with_final_ln = false;
                cfg.default_clip_skip = 2;
            }
            // Like the reference: with embeddings configured the token table stays f32.
            cfg.force_f32_token_embedding = !embeddings.is_empty();
            ensure!(
                weights.get(&format!("{prefix}embeddings.token_embedding.weight")).is_some(),
                "the model has no {} text encoder ({prefix}*)",
                match version {
                    ClipVersion::OpenAiVitL14 => "CLIP ViT-L",
                    ClipVersion::OpenClipVitH14 => "OpenCLIP ViT-H",
                    ClipVersion::OpenClipVitBigG14 => "OpenCLIP ViT-bigG",
                }
            );
            encoders.push(weights.load_model(placement.clone(), n_threads, prefix, "text encoder", |s| ClipTextModel::new(s, &cfg))?);
        }

        let dims: Vec<usize> = encoders.iter().map(|e| e.model.cfg.hidden_size as usize).collect();
        let mut set_ = EmbeddingSet::new(&dims);
        for e in embeddings {
            let tensors: Vec<Tensor> =
                read_all_f32(&e.path).with_context(|| format!("embedding '{}'", e.name))?.into_iter().map(|(_, t)| t).collect();
            set_.register_tensors(&e.name, &tensors).with_context(|| format!("embedding '{}' from '{}'", e.name, e.path))?;
            sd_debug!("embedding '{}' loaded from '{}'", e.name, e.path);
        }
        Ok(ClipConditioner {
            set,
            encoders,
            tokenizer: ClipTokenizer::shared()?,
            // The reference's tokenizer pads SD 2.x with 0 and everything else with EOS.
            pad_token: if set == ClipSet::H { 0 } else { EOS_TOKEN },
            embeddings: set_,
        })
    }

    /// Width of the cross-attention context (both encoders for SDXL).
    pub fn context_dim(&self) -> usize {
        self.encoders.iter().map(|e| e.model.cfg.hidden_size as usize).sum()
    }

    fn custom_rows(&self, encoder: usize) -> Result<Option<Tensor>> {
        if self.embeddings.token_count() == 0 {
            return Ok(None);
        }
        self.embeddings.custom_rows(encoder).map(Some)
    }

    /// SDXL's vector: the pooled bigG output, then sinusoidal embeddings of the original
    /// size (h, w), the crop offset (0, 0) and the target size (h, w).
    fn sdxl_vector(pooled: &Tensor, width: usize, height: usize) -> Result<Tensor> {
        let mut v = pooled.data().to_vec();
        for pair in [[height as f32, width as f32], [0.0, 0.0], [height as f32, width as f32]] {
            v.extend(size_embedding(&pair, SIZE_EMBED_DIM));
        }
        ensure!(v.len() == SDXL_ADM_CHANNELS, "SDXL vector has {} values, expected {SDXL_ADM_CHANNELS}", v.len());
        Tensor::from_vec(&[SDXL_ADM_CHANNELS], v)
    }
}

/// The reference's host-side `timestep_embedding` (cos half first): `dim` values per number.
fn size_embedding(values: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half).map(|i| (-(10000f64.ln()) * i as f64 / half as f64).exp() as f32).collect();
    let mut out = vec![0.0f32; values.len() * dim];
    for (v, row) in values.iter().zip(out.chunks_mut(dim)) {
        for (j, f) in freqs.iter().enumerate() {
            let arg = v * f;
            row[j] = arg.cos();
            row[j + half] = arg.sin();
        }
    }
    out
}

impl Components for ClipConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        self.encoders.iter_mut().map(|e| e as &mut dyn Component).collect()
    }
}

impl ClipConditioner {
    /// The prompt's weighted tokens between one BOS and one EOS, unpadded (the reference's
    /// `tokenize(text)` without lengths; `BREAK` still fills its chunk).
    pub fn tokenize_unpadded(&self, text: &str) -> WeightedTokens {
        let opts = PadOptions { min_length: 0, max_length: 0, ..PadOptions::clip_chunks(self.pad_token) };
        tokenize_weighted(self.tokenizer, text, &self.embeddings, &opts)
    }

    /// Pads tokens (without BOS/EOS) into 77-token chunks.
    pub fn pad_chunks(&self, tokens: &mut WeightedTokens) {
        tokens.pad(&PadOptions::clip_chunks(self.pad_token));
    }

    /// The ids `word` tokenizes to (textual-inversion words included).
    pub fn word_ids(&self, word: &str) -> Vec<u32> {
        self.tokenizer.encode_with(word, &self.embeddings)
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids)
    }

    /// The condition of padded, chunked tokens (the reference's `get_learned_condition_common`).
    pub fn encode_tokens(&mut self, tokens: &WeightedTokens, clip_skip: i32, width: usize, height: usize, zero_out_masked: bool) -> Result<Condition> {
        let start = Instant::now();
        let customs = (0..self.encoders.len()).map(|e| self.custom_rows(e)).collect::<Result<Vec<_>>>()?;
        let dim = self.context_dim();
        let mut data = Vec::with_capacity(tokens.tokens.len() * dim);
        let mut pooled = None;
        for (chunk_idx, (ids, weights)) in tokens.chunks(CHUNK_LEN).enumerate() {
            let ids_l: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
            let (model, runner) = self.encoders[0].parts();
            let mut hidden = clip::encode(runner, model, &ids_l, customs[0].as_ref(), clip_skip)?;
            if self.set == ClipSet::LBigG {
                let (ids_g, eos) = zero_after_first_eos(ids);
                let ids_g: Vec<i32> = ids_g.iter().map(|&t| t as i32).collect();
                let (model, runner) = self.encoders[1].parts();
                let hidden_g = clip::encode(runner, model, &ids_g, customs[1].as_ref(), clip_skip)?;
                if chunk_idx == 0 {
                    pooled = Some(clip::encode_pooled(runner, model, &ids_g, customs[1].as_ref(), eos)?);
                }
                hidden = concat_features(&hidden, &hidden_g)?;
            }
            apply_token_weights(&mut hidden, weights, CHUNK_LEN)?;
            if zero_out_masked {
                hidden.data_mut().fill(0.0);
            }
            data.extend_from_slice(hidden.data());
        }
        let n = data.len() / dim;
        ensure!(n > 0, "the prompt produced no tokens");
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        let vector = match &pooled {
            Some(p) => Some(Self::sdxl_vector(p, width, height)?),
            None => None,
        };
        Ok(Condition { crossattn: Some(Tensor::from_vec(&[dim, n, 1], data)?), vector, concat: None, extra_context: None, token_types: None })
    }
}

impl Conditioner for ClipConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let tokens = tokenize_weighted(self.tokenizer, req.text, &self.embeddings, &PadOptions::clip_chunks(self.pad_token));
        self.encode_tokens(&tokens, req.clip_skip, req.width, req.height, req.zero_out_masked)
    }

    fn as_clip(&mut self) -> Option<&mut ClipConditioner> {
        Some(self)
    }
}

/// One CLIP text encoder of a DiT conditioner (SD3's CLIP-L and CLIP-G, Flux's CLIP-L), as
/// the reference's `SD3CLIPEmbedder` / `FluxCLIPEmbedder` use them: prompts tokenized piece by
/// piece without `BREAK` or embeddings, 77-token chunks, hidden states at the clip skip
/// (default 2), the pooled vector from the first chunk's first EOS.
pub(super) struct ClipPart {
    encoder: Loaded<ClipTextModel>,
    tokenizer: &'static ClipTokenizer,
    pad_token: u32,
}

impl ClipPart {
    /// The encoder under `prefix` when the files hold it. `with_final_ln`: whether the
    /// hidden states go through the final norm (Flux's CLIP-L only uses the pooled vector).
    pub(super) fn open(
        weights: &Arc<Weights>,
        prefix: &str,
        version: ClipVersion,
        with_final_ln: bool,
        place: &Placement,
        n_threads: i32,
    ) -> Result<Option<ClipPart>> {
        if !weights.has_prefix(prefix) {
            return Ok(None);
        }
        let mut cfg = ClipConfig::detect(weights.types(), prefix, version);
        cfg.with_final_ln = with_final_ln;
        cfg.default_clip_skip = 2;
        let encoder = weights.load_model(place.clone(), n_threads, prefix, "text encoder", |s| ClipTextModel::new(s, &cfg))?;
        // The reference's bigG tokenizer pads with 0, the ViT-L one with EOS.
        let pad_token = if version == ClipVersion::OpenClipVitBigG14 { 0 } else { EOS_TOKEN };
        Ok(Some(ClipPart { encoder, tokenizer: ClipTokenizer::shared()?, pad_token }))
    }

    pub(super) fn width(&self) -> usize {
        self.encoder.model.cfg.hidden_size as usize
    }

    /// Parsed prompt pieces → weighted tokens in 77-token chunks.
    pub(super) fn tokenize(&self, pieces: &[(String, f32)]) -> WeightedTokens {
        let mut out = WeightedTokens::default();
        for (piece, weight) in pieces {
            let ids = self.tokenizer.encode(piece);
            out.weights.extend(std::iter::repeat_n(*weight, ids.len()));
            out.tokens.extend(ids);
        }
        out.pad(&PadOptions::clip_chunks(self.pad_token));
        out
    }

    /// Hidden states `[width, 77]` of one chunk, re-weighted.
    pub(super) fn hidden(&mut self, ids: &[u32], weights: &[f32], clip_skip: i32) -> Result<Tensor> {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let (model, runner) = self.encoder.parts();
        let mut h = clip::encode(runner, model, &ids, None, clip_skip)?;
        let width = self.width();
        h = h.reshape(&[width, ids.len()])?;
        apply_token_weights(&mut h, weights, ids.len())?;
        Ok(h)
    }

    /// The pooled (final-normed, projected when the model has a projection) state of the
    /// chunk's first EOS: `[width]`.
    pub(super) fn pooled(&mut self, ids: &[u32]) -> Result<Tensor> {
        let at = ids.iter().position(|&t| t == EOS_TOKEN).unwrap_or(ids.len()).min(ids.len().saturating_sub(1));
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let (model, runner) = self.encoder.parts();
        let p = clip::encode_pooled(runner, model, &ids, None, at)?;
        let n = p.len();
        p.reshape(&[n])
    }

    pub(super) fn component(&mut self) -> &mut dyn Component {
        &mut self.encoder
    }
}

/// `[d1, n]` and `[d2, n]` → `[d1 + d2, n]`, token by token.
fn concat_features(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (d1, d2) = (a.ne(0), b.ne(0));
    let n = a.len() / d1.max(1);
    ensure!(b.len() == d2 * n, "text encoder outputs of {n} and {} tokens", b.len() / d2.max(1));
    let mut out = Vec::with_capacity((d1 + d2) * n);
    for (x, y) in a.data().chunks(d1).zip(b.data().chunks(d2)) {
        out.extend_from_slice(x);
        out.extend_from_slice(y);
    }
    Tensor::from_vec(&[d1 + d2, n], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_embeddings_follow_the_reference_layout() {
        let e = size_embedding(&[64.0, 0.0], 8);
        // First number: cos of each frequency, then sin; second (0): cos 1, sin 0.
        let freqs = [1.0f32, 0.1, 0.01, 0.001];
        for (j, f) in freqs.iter().enumerate() {
            assert!((e[j] - (64.0f32 * f).cos()).abs() < 1e-6, "{j}");
            assert!((e[j + 4] - (64.0 * f).sin()).abs() < 1e-6, "{j}");
            assert_eq!(e[8 + j], 1.0);
            assert_eq!(e[12 + j], 0.0);
        }
        let pooled = Tensor::zeros(&[1280]);
        let v = ClipConditioner::sdxl_vector(&pooled, 96, 64).unwrap();
        assert_eq!(v.len(), SDXL_ADM_CHANNELS);
        // Original size is (height, width): the first embedding is of 64, the second of 96
        // (libm's cosf at run time, like the reference; not a compile-time constant).
        let cos = |x: f32| std::hint::black_box(x).cos();
        assert_eq!(v.data()[1280], cos(64.0));
        assert_eq!(v.data()[1280 + 256], cos(96.0));
    }

    #[test]
    fn features_concatenate_per_token() {
        let a = Tensor::from_vec(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let b = Tensor::from_vec(&[1, 2], vec![9.0, 8.0]).unwrap();
        assert_eq!(concat_features(&a, &b).unwrap().data(), &[1.0, 2.0, 9.0, 3.0, 4.0, 8.0]);
    }
}
