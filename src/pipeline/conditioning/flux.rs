//! Flux and Chroma conditioning, like the reference's `FluxCLIPEmbedder` and
//! `T5CLIPEmbedder`:
//!
//! - Flux: T5-XXL hidden states in 256-token chunks (zeros without T5) and the pooled
//!   CLIP-L vector of the prompt's first 77 tokens (zeros without CLIP-L). At least one of
//!   the two is needed.
//! - Chroma (and Wan, with UMT5): T5 only, 512-token chunks; the vector is the T5 attention
//!   mask (0 attend, -inf padding) with the first `mask_pad` padding tokens attended, which
//!   Chroma's transformer uses as its text mask. `use_t5_mask` also masks the encoder
//!   itself (Chroma: `chroma_use_t5_mask`, default off; Wan: always). Without T5 the context
//!   is zeros and the mask masks every text token.

use super::clip::ClipPart;
use super::t5::{attend_padding, T5Text, T5Vocab};
use super::{sd3::CLIP_L_PREFIX, CondRequest, Conditioner};
use crate::error::Result;
use crate::graph::{Component, Components, Placement};
use crate::models::te::clip::ClipVersion;
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::{apply_token_weights, parse_prompt_attention};
use crate::runtime::args::{parse_key_value_args, parse_strict_bool, parse_strict_int};
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

const T5_WIDTH: usize = 4096;
const CLIP_L_WIDTH: usize = 768;
const FLUX_CHUNK: usize = 256;
const CHROMA_CHUNK: usize = 512;
/// Text tokens Chroma sees without a T5 encoder.
const CHROMA_EMPTY_TOKENS: usize = 256;

/// T5 hidden states of one chunk `[4096, L]`, re-weighted.
fn t5_chunk(t5: &mut T5Text, ids: &[u32], weights: &[f32], mask: Option<&[f32]>) -> Result<Tensor> {
    let h = t5.encode(ids, mask)?;
    let n = ids.len();
    ensure!(h.len() == T5_WIDTH * n, "the T5 encoder is {} wide, Flux needs {T5_WIDTH}", h.len() / n.max(1));
    let mut h = h.reshape(&[T5_WIDTH, n])?;
    apply_token_weights(&mut h, weights, n)?;
    Ok(h)
}

pub struct FluxConditioner {
    clip_l: Option<ClipPart>,
    t5: Option<T5Text>,
}

impl FluxConditioner {
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, t5_resident: bool) -> Result<FluxConditioner> {
        // Like T5, CLIP-L is read per conditioning phase unless resident.
        let clip_l = ClipPart::open(weights, CLIP_L_PREFIX, ClipVersion::OpenAiVitL14, true, &place.resident_or_per_phase(t5_resident), n_threads)?;
        let t5 = T5Text::open(weights, T5Vocab::T5, place, n_threads, t5_resident)?;
        ensure!(clip_l.is_some() || t5.is_some(), "no text encoders provided (clip_l_path or t5xxl_path): Flux cannot process prompts");
        if clip_l.is_none() {
            sd_warn!("clip_l text encoder not found! Prompt adherence might be degraded.");
        }
        if t5.is_none() {
            sd_warn!("t5xxl text encoder not found! Prompt adherence might be degraded.");
        }
        Ok(FluxConditioner { clip_l, t5 })
    }
}

impl Components for FluxConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let clip = self.clip_l.iter_mut().map(|c| c.component());
        clip.chain(self.t5.iter_mut().map(|t| t.component())).collect()
    }
}

impl Conditioner for FluxConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let pieces = parse_prompt_attention(req.text);
        let tok_l = self.clip_l.as_ref().map(|c| c.tokenize(&pieces));
        let tok_t5 = self.t5.as_ref().map(|t| t.tokenize(req.text, FLUX_CHUNK));
        let chunks = tok_l.as_ref().map_or(0, |_| FLUX_CHUNK).max(tok_t5.as_ref().map_or(0, |t| t.tokens.tokens.len())) / FLUX_CHUNK;
        let pooled = match (&mut self.clip_l, &tok_l) {
            (Some(c), Some(t)) => c.pooled(&t.tokens[..77])?,
            _ => Tensor::zeros(&[CLIP_L_WIDTH]),
        };
        let mut data = Vec::with_capacity(chunks * FLUX_CHUNK * T5_WIDTH);
        for c in 0..chunks {
            let range = c * FLUX_CHUNK..(c + 1) * FLUX_CHUNK;
            match (&mut self.t5, &tok_t5) {
                (Some(t5), Some(t)) => {
                    let mut h = t5_chunk(t5, &t.tokens.tokens[range.clone()], &t.tokens.weights[range], None)?;
                    if req.zero_out_masked {
                        h.data_mut().fill(0.0);
                    }
                    data.extend_from_slice(h.data());
                }
                _ => data.resize(data.len() + FLUX_CHUNK * T5_WIDTH, 0.0),
            }
        }
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        let n = data.len() / T5_WIDTH;
        Ok(Condition { crossattn: Some(Tensor::from_vec(&[T5_WIDTH, n, 1], data)?), vector: Some(pooled), concat: None, extra_context: None, token_types: None })
    }

}

/// How a T5-only conditioner (the reference's `T5CLIPEmbedder`) runs: Chroma's from the
/// context's `model_args`, Wan's fixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct T5TextOptions {
    /// Mask the padding inside the T5 encoder too (`chroma_use_t5_mask`, default false).
    pub use_t5_mask: bool,
    /// Padding tokens the transformer still attends (`chroma_t5_mask_pad`, default 1).
    pub mask_pad: usize,
    pub vocab: T5Vocab,
}

impl T5TextOptions {
    /// Wan's: UMT5, the encoder masked, no padding attended (model args are not read).
    pub const WAN: T5TextOptions = T5TextOptions { use_t5_mask: true, mask_pad: 0, vocab: T5Vocab::Umt5 };

    /// Chroma's, from the context's `model_args`.
    pub fn parse(model_args: Option<&str>) -> T5TextOptions {
        let mut o = T5TextOptions { use_t5_mask: false, mask_pad: 1, vocab: T5Vocab::T5 };
        for (k, v) in parse_key_value_args(model_args, "model arg") {
            match k.as_str() {
                "chroma_use_t5_mask" => match parse_strict_bool(&v) {
                    Some(b) => o.use_t5_mask = b,
                    None => sd_warn!("ignoring invalid Chroma T5 model arg '{k}={v}'"),
                },
                "chroma_t5_mask_pad" => match parse_strict_int(&v) {
                    Some(n) => o.mask_pad = n.max(0) as usize,
                    None => sd_warn!("ignoring invalid Chroma T5 model arg '{k}={v}'"),
                },
                _ => {}
            }
        }
        o
    }
}

pub struct T5Conditioner {
    t5: Option<T5Text>,
    options: T5TextOptions,
}

impl T5Conditioner {
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, t5_resident: bool, options: T5TextOptions) -> Result<T5Conditioner> {
        let t5 = T5Text::open(weights, options.vocab, place, n_threads, t5_resident)?;
        if t5.is_none() {
            sd_warn!("IMPORTANT NOTICE: No text encoders provided, cannot process prompts!");
        }
        Ok(T5Conditioner { t5, options })
    }
}

impl Components for T5Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        self.t5.iter_mut().map(|t| t.component()).collect()
    }
}

impl Conditioner for T5Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let Some(t5) = &mut self.t5 else {
            return Ok(Condition {
                crossattn: Some(Tensor::zeros(&[T5_WIDTH, CHROMA_EMPTY_TOKENS, 1])),
                vector: Some(Tensor::full(&[CHROMA_EMPTY_TOKENS], f32::NEG_INFINITY)),
                concat: None,
                extra_context: None,
                token_types: None,
            });
        };
        let start = Instant::now();
        let tok = t5.tokenize(req.text, CHROMA_CHUNK);
        let n = tok.tokens.tokens.len();
        ensure!(n > 0 && n.is_multiple_of(CHROMA_CHUNK), "the prompt produced {n} T5 tokens");
        let mut data = Vec::with_capacity(n * T5_WIDTH);
        for c in 0..n / CHROMA_CHUNK {
            let range = c * CHROMA_CHUNK..(c + 1) * CHROMA_CHUNK;
            let mask = &tok.mask[range.clone()];
            let mut h = t5_chunk(t5, &tok.tokens.tokens[range.clone()], &tok.tokens.weights[range], self.options.use_t5_mask.then_some(mask))?;
            if req.zero_out_masked {
                for (token, &m) in h.data_mut().chunks_mut(T5_WIDTH).zip(mask) {
                    if m < 0.0 {
                        token.fill(0.0);
                    }
                }
            }
            data.extend_from_slice(h.data());
        }
        let mut mask = tok.mask;
        attend_padding(&mut mask, self.options.mask_pad);
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition {
            crossattn: Some(Tensor::from_vec(&[T5_WIDTH, n, 1], data)?),
            vector: Some(Tensor::from_vec(&[n], mask)?),
            concat: None,
            extra_context: None,
            token_types: None,
        })
    }

}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chroma_model_args() {
        assert_eq!(T5TextOptions::parse(None), T5TextOptions { use_t5_mask: false, mask_pad: 1, vocab: T5Vocab::T5 });
        let o = T5TextOptions::parse(Some("chroma_use_t5_mask=true, chroma_t5_mask_pad=3, chroma_use_dit_mask=false"));
        assert_eq!(o, T5TextOptions { use_t5_mask: true, mask_pad: 3, vocab: T5Vocab::T5 });
        assert_eq!(T5TextOptions::parse(Some("chroma_t5_mask_pad=x")).mask_pad, 1);
    }

    #[test]
    fn padding_is_attended_from_the_start() {
        let mut m = vec![0.0, f32::NEG_INFINITY, f32::NEG_INFINITY];
        attend_padding(&mut m, 1);
        assert_eq!(m[1], 0.0);
        assert!(m[2].is_infinite());
    }
}
