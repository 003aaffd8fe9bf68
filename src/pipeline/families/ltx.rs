//! LTX-2.3 (the reference's LTXAV): Gemma 3's every hidden state projected to the text
//! context (the `LTXAVEmbedder`), the joint audio-video transformer and the LTX video VAE.
//! Flow prediction (the reference's Flux-flow denoiser, default shift 2.37) and its own
//! schedule (`ltx2`). The audio latent rides behind the video's channels through sampling
//! and, with an audio VAE (`audio_vae_path`), becomes the sound (`models::vae::ltx_audio`);
//! keyframes, reference audio and the latent-upscale refine pass are not built here.
//!
//! The embedder: the prompt's attention syntax parsed, Gemma 3's tokens behind `<bos>`,
//! padded in front with masked `<pad>` to 1024; the hidden states of the real tokens
//! (embeddings, every layer, the normed last; `3840 × 49` per token), each state normalised
//! over the prompt (mean and range to 8), interleaved state-fastest and projected by
//! `text_embedding_projection.projection` (from `embeddings_connectors_path`) to 3840, or by
//! its `video_aggregate_embed` / `audio_aggregate_embed` pair (each state RMS-normalised per
//! token) to 4096 + 2048. Padding is never attended to, so unless the prompt has token
//! weights only the real tokens are computed, at the positions they have in the 1024 and
//! attending over 1024 keys (zeros for the padding), so every sum is the reference's.

use super::{first_stage, flow_parts, BuildCtx, Parts, VideoCond};
use crate::error::Result;
use crate::graph::nn::Linear;
use crate::graph::{Component, Components, Graph, Loaded, Module, Placement, Scope, T};
use crate::models::diffusion::ltx::{LtxConfig, LtxModel};
use crate::models::vae::audio::AudioStage;
use crate::models::vae::ltx_audio::{LtxAudioConfig, LtxAudioVae};
use crate::models::te::gemma3::{self, Gemma3Config, Gemma3Model, PREFIX};
use crate::models::te::gemma_tokenizer::{self, GemmaTokenizer, BOS_TOKEN, PAD_TOKEN};
use crate::models::Condition;
use crate::pipeline::conditioning::{CondRequest, Conditioner};
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::{apply_token_weights, parse_prompt_attention};
use crate::types::Prediction;
use std::sync::Arc;
use std::time::Instant;

const DEFAULT_FLOW_SHIFT: f32 = 2.37;
const DIT_PREFIX: &str = "model.diffusion_model.";
const PROJECTION_PREFIX: &str = "text_embedding_projection.";
/// The embedder's fixed sizes: states of 3840 values, 49 per token, prompts padded to 1024.
pub const STATE_WIDTH: usize = 3840;
pub const STATES: usize = 49;
pub const MIN_TOKENS: usize = 1024;

/// The prompt's tokens: ids, weights and which are real (not padding).
#[derive(Clone, Debug, PartialEq)]
pub struct LtxTokens {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub real: usize,
}

/// Tokens of `text` as the LTXAV embedder feeds Gemma 3: pads, `<bos>`, the prompt.
pub fn tokenize(tok: &GemmaTokenizer, text: &str) -> LtxTokens {
    let mut ids = vec![BOS_TOKEN];
    let mut weights = vec![1.0];
    for (piece, weight) in parse_prompt_attention(text) {
        let t = tok.encode(&piece);
        weights.extend(std::iter::repeat_n(weight, t.len()));
        ids.extend(t);
    }
    let real = ids.len();
    let pad = MIN_TOKENS.saturating_sub(real);
    let mut all = vec![PAD_TOKEN; pad];
    all.extend(ids);
    let mut w = vec![1.0; pad];
    w.extend(weights);
    LtxTokens { ids: all, weights: w, real }
}

/// The projection of the stacked states: one to the text width, or the video's and audio's.
pub enum Projection {
    Single(Linear),
    Dual { video: Linear, audio: Linear },
}

impl Projection {
    fn new(s: &mut Scope, dual: bool) -> Projection {
        let k = (STATE_WIDTH * STATES) as i64;
        if dual {
            Projection::Dual { video: Linear::new(s, "video_aggregate_embed", k, 4096, true), audio: Linear::new(s, "audio_aggregate_embed", k, 2048, true) }
        } else {
            Projection::Single(Linear::new(s, "projection", k, STATE_WIDTH as i64, false))
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            Projection::Single(p) => p.forward(g, x),
            Projection::Dual { video, audio } => {
                let v = video.forward(g, x.scale((4096.0 / STATE_WIDTH as f32).sqrt()));
                let a = audio.forward(g, x.scale((2048.0 / STATE_WIDTH as f32).sqrt()));
                v.concat(a, 0)
            }
        }
    }

    fn dual(&self) -> bool {
        matches!(self, Projection::Dual { .. })
    }
}

/// The states `[3840 · 49, tokens]` as the embedder reads them (each token's values taken as
/// 49 states of 3840), normalised per state and interleaved state-fastest.
pub fn normalise_states(h: &[f32], tokens: usize, dual: bool) -> Vec<f32> {
    let (w, n) = (STATE_WIDTH, STATES);
    let at = |s: usize, i: usize, t: usize| h[t * w * n + s * w + i];
    let mut out = vec![0.0f32; h.len()];
    let mut put = |s: usize, i: usize, t: usize, v: f32| out[t * w * n + i * n + s] = v;
    for s in 0..n {
        if dual {
            for t in 0..tokens {
                let sq: f64 = (0..w).map(|i| (at(s, i, t) as f64) * (at(s, i, t) as f64)).sum();
                let inv = 1.0 / ((sq / w as f64) as f32 + 1e-6).sqrt();
                for i in 0..w {
                    put(s, i, t, at(s, i, t) * inv);
                }
            }
        } else {
            let (mut sum, mut lo, mut hi) = (0.0f64, f32::INFINITY, f32::NEG_INFINITY);
            for t in 0..tokens {
                for i in 0..w {
                    let v = at(s, i, t);
                    sum += v as f64;
                    lo = lo.min(v);
                    hi = hi.max(v);
                }
            }
            let mean = (sum / (w * tokens) as f64) as f32;
            let scale = 8.0 / (hi - lo + 1e-6);
            for t in 0..tokens {
                for i in 0..w {
                    put(s, i, t, (at(s, i, t) - mean) * scale);
                }
            }
        }
    }
    out
}

pub struct LtxConditioner {
    llm: Loaded<Gemma3Model>,
    projection: Loaded<Projection>,
    tokenizer: &'static GemmaTokenizer,
}

impl LtxConditioner {
    pub fn new(weights: &Arc<Weights>, place: &Placement, n_threads: i32, resident: bool) -> Result<LtxConditioner> {
        ensure!(weights.has_prefix(PREFIX), "LTX-2.3 needs its Gemma 3 text encoder (llm_path): no '{PREFIX}' weights in the model files");
        let cfg = Gemma3Config::detect(weights.types(), &|n| weights.shape_of(n), PREFIX);
        ensure!(cfg.num_layers > 0, "the Gemma 3 text encoder has no layers under '{PREFIX}model.layers.'");
        ensure!(
            cfg.hidden_size as usize * cfg.states() == STATE_WIDTH * STATES,
            "the LTX-2.3 text projection reads {STATES} states of {STATE_WIDTH} per token; this Gemma 3 gives {} of {}",
            cfg.states(),
            cfg.hidden_size
        );
        let dual = weights.shape_of(&format!("{PROJECTION_PREFIX}video_aggregate_embed.weight")).is_some();
        let single = weights.shape_of(&format!("{PROJECTION_PREFIX}projection.weight")).is_some();
        ensure!(
            dual || single,
            "LTX-2.3 needs its text projection ({PROJECTION_PREFIX}projection or video_aggregate_embed / audio_aggregate_embed, usually in embeddings_connectors_path)"
        );
        let llm = weights.load_model(place.resident_or_per_phase(resident), n_threads, PREFIX, "llm", |s| Gemma3Model::new(s, &cfg))?;
        let projection = weights.load_model(place.resident_or_per_phase(resident), n_threads, PROJECTION_PREFIX, "text projection", |s| Projection::new(s, dual))?;
        Ok(LtxConditioner { llm, projection, tokenizer: gemma_tokenizer::gemma3()? })
    }

    /// Width of the context it gives.
    pub fn context_width(&self) -> i64 {
        if self.projection.model.dual() {
            4096 + 2048
        } else {
            STATE_WIDTH as i64
        }
    }
}

impl Components for LtxConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.llm, &mut self.projection]
    }
}

impl Conditioner for LtxConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let t = tokenize(self.tokenizer, req.text);
        let ids: Vec<i32> = t.ids.iter().map(|&i| i as i32).collect();
        let len = ids.len();
        let width = STATE_WIDTH * STATES;
        let weighted = t.weights.iter().any(|&w| w != 1.0);
        // Token weights rescale by the mean over every token, padding included.
        let first = if weighted { 0 } else { len - t.real };
        let attend: Vec<bool> = (0..len).map(|i| i >= len - t.real).collect();
        let states = self.llm.run_in_phase(|model, runner| gemma3::all_hidden_states(runner, model, &ids[first..], &attend[first..], len - first, first))?;
        if self.llm.store().maps_files() {
            // Mapped in place, the text model costs nothing to place again (an unconditional
            // prompt's encode does so in a phase of its own): its pages leave the process now,
            // before the projection's are read (with LTX-2.3's 12B Gemma and 188160-wide
            // projection the two together were the run's peak).
            Component::end(&mut self.llm);
        }
        let mut states = states.reshape(&[width, len - first])?;
        if weighted {
            apply_token_weights(&mut states, &t.weights, len)?;
        }
        let real = &states.data()[(len - first - t.real) * width..];
        let dual = self.projection.model.dual();
        let x = normalise_states(real, t.real, dual);
        let out = self.projection.run_in_phase(|model, runner| {
            runner.compute(|g| {
                let x = g.input_f32(&x, &[width as i64, t.real as i64]);
                Ok(model.forward(g, x))
            })
        })?;
        let (w, n) = (out.ne(0), t.real);
        sd_debug!("computing LTXAV condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition { crossattn: Some(out.reshape(&[w, n, 1])?), vector: None, concat: None, extra_context: None, token_types: None })
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;
    let cfg = LtxConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    ctx.ensure_latent_channels(cfg.in_channels, "the LTX-2.3 transformer", "the LTX VAE's latents have")?;
    let cond = LtxConditioner::new(weights, &te_place, n_threads, params.eager_load)?;
    let width = cond.context_width();
    ensure!(
        width == cfg.cross_dim + cfg.audio_cross_dim
            || (width == cfg.cross_dim && width == cfg.audio_cross_dim)
            || (width == 2 * 3840 && cfg.cross_dim == 3840 && cfg.audio_cross_dim == 3840),
        "the LTX-2.3 text context is {width} wide, the transformer's cross-attentions read {} (video) and {} (audio)",
        cfg.cross_dim,
        cfg.audio_cross_dim
    );
    let model = ctx.load_transformer(DIT_PREFIX, |s| LtxModel::new(s, &cfg))?;
    let first = first_stage::build(ctx, vae_place)?;
    let mut parts = flow_parts(params, Box::new(cond), Box::new(model), first, Prediction::FluxFlow, DEFAULT_FLOW_SHIFT);
    parts.video_cond = VideoCond::Keyframes;
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_is_padded_in_front() {
        let tok = gemma_tokenizer::gemma3().unwrap();
        let t = tokenize(tok, "a (lovely:1.5) cat");
        assert_eq!(t.ids.len(), MIN_TOKENS);
        assert_eq!(t.ids[0], PAD_TOKEN);
        assert_eq!(t.ids[MIN_TOKENS - t.real], BOS_TOKEN);
        assert!(t.weights.contains(&1.5));
        assert_eq!(tokenize(tok, "").real, 1);
    }

    #[test]
    fn states_are_normalised_to_a_range_of_eight() {
        let tokens = 2;
        let h: Vec<f32> = (0..STATE_WIDTH * STATES * tokens).map(|i| ((i * 7919) % 1000) as f32).collect();
        let x = normalise_states(&h, tokens, false);
        // State 0 of token 0, value 1: interleaved to index 49.
        let s0: Vec<f32> = (0..tokens).flat_map(|t| (0..STATE_WIDTH).map(move |i| (t, i))).map(|(t, i)| x[t * STATE_WIDTH * STATES + i * STATES]).collect();
        let (lo, hi) = s0.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        assert!((hi - lo - 8.0).abs() < 1e-3);
        let mean = s0.iter().map(|&v| v as f64).sum::<f64>() / s0.len() as f64;
        assert!(mean.abs() < 1e-3);
    }

    /// The synthetic audio VAEs (16 and 48 kHz) decode a pattern latent; with
    /// `SD_LTX_AUDIO_REF_OUT` (the outputs of tests/tools/ltx_audio_ref.cpp) the sound must be
    /// the reference's.
    #[test]
    fn the_audio_vae_decodes_as_the_reference() {
        let Ok(dir) = std::env::var("SD_LTX_AUDIO_REF_OUT") else {
            eprintln!("skipped: set SD_LTX_AUDIO_REF_OUT (tests/tools/ltx_audio_ref.cpp)");
            return;
        };
        let steps = 15;
        let latent = crate::tensor::Tensor::from_vec(&[16, steps, 8], crate::testutil::pattern(16 * steps * 8, 31)).unwrap();
        for file in ["ltx_audio_vae", "ltx_audio_vae_bwe"] {
            let path = crate::testutil::fixture_cache().join(format!("{file}.safetensors"));
            let devices = crate::graph::DeviceMap::new(&Default::default()).unwrap();
            let mut stage = load_audio_vae(path.to_str().unwrap(), &devices, 2).unwrap().expect("readable file");
            stage.begin().unwrap();
            let w = stage.decode_audio(&latent).unwrap();
            stage.end();
            let bytes = std::fs::read(std::path::Path::new(&dir).join(format!("{file}.bin"))).unwrap();
            let want: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            assert_eq!(w.interleaved.len(), want.len(), "{file}");
            let n = want.len() / 2;
            let max = (0..n).flat_map(|i| (0..2).map(move |c| (i, c))).map(|(i, c)| (w.interleaved[2 * i + c] - want[c * n + i]).abs()).fold(0f32, f32::max);
            eprintln!("{file}: {n} samples at {} Hz, max difference {max:e}", w.sample_rate);
            assert!(max <= 1e-5, "{file}: max difference {max:e}");
        }
    }
}

/// LTX-2.3's audio VAE and vocoder from `path` (their own names, no prefix, the file's types).
/// A file of another layout is refused before any weight is read (the reference fails the
/// context on missing tensors and its graph on other widths).
pub(super) fn load_audio_vae(path: &str, devices: &crate::graph::DeviceMap, n_threads: i32) -> Result<Option<Box<dyn AudioStage>>> {
    let Some(weights) = super::open_audio_vae(path) else { return Ok(None) };
    let not_ours = |e: crate::error::Error| crate::error::Error::new(format!("the audio VAE '{path}' is not LTX-2.3's: {e}"));
    let cfg = LtxAudioConfig::detect(&|n| weights.shape_of(n)).map_err(not_ours)?;
    super::audio_vae_floats_only(&weights, path, "LTX-2.3", |n| !n.starts_with("audio_vae.encoder."))?;
    sd_debug!(
        "ltx_audio_vae: decoder {} x {:?} ({} blocks a level), vocoder {}, {} Hz",
        cfg.decoder_channels,
        cfg.multipliers,
        cfg.level_blocks,
        cfg.vocoder_channels,
        cfg.sample_rate()
    );
    let place = devices.placement(Module::Vae)?;
    let vae = Arc::new(weights).load_model(place, n_threads, "", "audio VAE", |s| LtxAudioVae::new(s, &cfg)).map_err(not_ours)?;
    Ok(Some(Box::new(vae)))
}
