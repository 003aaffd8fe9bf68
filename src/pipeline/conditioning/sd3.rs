//! SD3 / SD3.5 conditioning, like the reference's `SD3CLIPEmbedder`: CLIP-L, CLIP-G and T5-XXL,
//! each optional (a missing encoder contributes zeros). Per 77-token chunk the two CLIP
//! outputs are concatenated per token (768 + 1280, zero-padded to 4096) and followed by the
//! chunk's 77 T5 tokens; the vector is the two pooled outputs of the first chunk (2048).

use super::clip::ClipPart;
use super::t5::{T5Text, T5Vocab};
use super::{CondRequest, Conditioner};
use crate::error::Result;
use crate::graph::{Component, Components, Placement};
use crate::models::te::clip::ClipVersion;
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::parse_prompt_attention;
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

const CHUNK: usize = 77;
const CLIP_L_WIDTH: usize = 768;
const CLIP_G_WIDTH: usize = 1280;
/// Width of the joint context (T5-XXL's).
pub const CONTEXT_WIDTH: usize = 4096;

pub const CLIP_L_PREFIX: &str = "text_encoders.clip_l.transformer.text_model.";
pub const CLIP_G_PREFIX: &str = "text_encoders.clip_g.transformer.text_model.";

pub struct Sd3Conditioner {
    clip_l: Option<ClipPart>,
    clip_g: Option<ClipPart>,
    t5: Option<T5Text>,
}

impl Sd3Conditioner {
    /// The encoders the files hold; at least one is needed (the reference cannot process
    /// prompts without any and crashes later).
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, t5_resident: bool) -> Result<Sd3Conditioner> {
        // Like T5, the CLIPs are read per conditioning phase unless resident (CLIP-G: 1.4 GB).
        let clip_place = place.resident_or_per_phase(t5_resident);
        let clip_l = ClipPart::open(weights, CLIP_L_PREFIX, ClipVersion::OpenAiVitL14, false, &clip_place, n_threads)?;
        let clip_g = ClipPart::open(weights, CLIP_G_PREFIX, ClipVersion::OpenClipVitBigG14, false, &clip_place, n_threads)?;
        let t5 = T5Text::open(weights, T5Vocab::T5, place, n_threads, t5_resident)?;
        ensure!(
            clip_l.is_some() || clip_g.is_some() || t5.is_some(),
            "no text encoders provided (clip_l_path, clip_g_path or t5xxl_path): SD3 cannot process prompts"
        );
        if let Some(t5) = &t5 {
            ensure!(t5.width() == CONTEXT_WIDTH, "SD3 needs a T5 encoder {CONTEXT_WIDTH} wide, this one is {}", t5.width());
        }
        if clip_l.is_some() != clip_g.is_some() {
            sd_warn!("SD3 uses both CLIP-L and CLIP-G; the missing one contributes zeros");
        }
        Ok(Sd3Conditioner { clip_l, clip_g, t5 })
    }
}

/// `[d1, n]` ‖ `[d2, n]` → `[width, n]` token by token, zero-padded up to `width`.
fn join_features(parts: &[&Tensor], width: usize, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(width * n);
    for t in 0..n {
        let start = out.len();
        for p in parts {
            let d = Tensor::ne(p, 0);
            out.extend_from_slice(&p.data()[t * d..(t + 1) * d]);
        }
        out.resize(start + width, 0.0);
    }
    out
}

impl Components for Sd3Conditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let clips = self.clip_l.iter_mut().chain(self.clip_g.iter_mut()).map(|c| c.component());
        clips.chain(self.t5.iter_mut().map(|t| t.component())).collect()
    }
}

impl Conditioner for Sd3Conditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let pieces = parse_prompt_attention(req.text);
        let tok_l = self.clip_l.as_ref().map(|c| c.tokenize(&pieces));
        let tok_g = self.clip_g.as_ref().map(|c| c.tokenize(&pieces));
        let tok_t5 = self.t5.as_ref().map(|t| t.tokenize(req.text, CHUNK));
        let len = |n: Option<usize>| n.unwrap_or(0);
        let chunks = len(tok_l.as_ref().map(|t| t.tokens.len()))
            .max(len(tok_g.as_ref().map(|t| t.tokens.len())))
            .max(len(tok_t5.as_ref().map(|t| t.tokens.tokens.len())))
            / CHUNK;
        let mut data = Vec::new();
        let mut pooled = Vec::new();
        for c in 0..chunks {
            let range = c * CHUNK..(c + 1) * CHUNK;
            let clip = |part: &mut Option<ClipPart>, tok: &Option<crate::pipeline::prompt::WeightedTokens>, width: usize| -> Result<(Tensor, Option<Tensor>)> {
                match (part, tok) {
                    (Some(p), Some(t)) if t.tokens.len() >= range.end => {
                        let ids = &t.tokens[range.clone()];
                        let h = p.hidden(ids, &t.weights[range.clone()], req.clip_skip)?;
                        let pooled = if c == 0 { Some(p.pooled(ids)?) } else { None };
                        Ok((h, pooled))
                    }
                    _ => Ok((Tensor::zeros(&[width, CHUNK]), (c == 0).then(|| Tensor::zeros(&[width])))),
                }
            };
            let (h_l, p_l) = clip(&mut self.clip_l, &tok_l, CLIP_L_WIDTH)?;
            let (h_g, p_g) = clip(&mut self.clip_g, &tok_g, CLIP_G_WIDTH)?;
            let h_t5 = match (&mut self.t5, &tok_t5) {
                (Some(t5), Some(t)) if t.tokens.tokens.len() >= range.end => {
                    let mut h = t5.encode(&t.tokens.tokens[range.clone()], None)?;
                    let n = h.len() / CONTEXT_WIDTH;
                    h = h.reshape(&[CONTEXT_WIDTH, n])?;
                    crate::pipeline::prompt::apply_token_weights(&mut h, &t.tokens.weights[range.clone()], CHUNK)?;
                    h
                }
                _ => Tensor::zeros(&[CONTEXT_WIDTH, CHUNK]),
            };
            let mut chunk = join_features(&[&h_l, &h_g], CONTEXT_WIDTH, CHUNK);
            chunk.extend_from_slice(h_t5.data());
            if let (Some(l), Some(g)) = (p_l, p_g) {
                pooled = [l.data(), g.data()].concat();
            }
            if req.zero_out_masked {
                chunk.fill(0.0);
            }
            data.extend(chunk);
        }
        ensure!(!data.is_empty(), "the prompt produced no tokens");
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        let n = data.len() / CONTEXT_WIDTH;
        Ok(Condition {
            crossattn: Some(Tensor::from_vec(&[CONTEXT_WIDTH, n, 1], data)?),
            vector: Some(Tensor::from_vec(&[CLIP_L_WIDTH + CLIP_G_WIDTH], pooled)?),
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
    fn clip_features_are_joined_and_padded_per_token() {
        let a = Tensor::from_vec(&[2, 2], vec![1., 2., 3., 4.]).unwrap();
        let b = Tensor::from_vec(&[1, 2], vec![9., 8.]).unwrap();
        assert_eq!(join_features(&[&a, &b], 4, 2), vec![1., 2., 9., 0., 3., 4., 8., 0.]);
    }
}
