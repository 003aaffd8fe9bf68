//! T5 text encoding for the DiT conditioners (SD3, Flux, Chroma; UMT5 for Wan), like the
//! T5 parts of the reference's `SD3CLIPEmbedder`, `FluxCLIPEmbedder` and `T5CLIPEmbedder`:
//!
//! - [`tokenize_weighted_t5`]: prompt → weighted tokens, EOS, padding / chunks and the
//!   attention mask (each attention-weighted piece of the prompt is tokenized on its own);
//! - [`T5Encoder`]: the encoder as a component whose weights are loaded when needed and,
//!   unless it is [`Residency::Resident`], freed again after each encoding (T5-XXL is about
//!   9 GB in f16: it must not stay in memory through sampling).
//!
//! What each conditioner does with them (chunk lengths and masks are the reference's):
//! - SD3: `PadOptions::t5_chunks(77)`, no mask; each chunk re-weighted with
//!   `apply_token_weights(.., 77)`.
//! - Flux: `PadOptions::t5_chunks(256)`, no mask; same re-weighting.
//! - Chroma (`T5CLIPEmbedder`): `PadOptions::t5_chunks(512)`; the mask goes to the encoder
//!   only with `chroma_use_t5_mask`, the conditioning's vector is the whole mask after
//!   [`attend_padding`]`(mask, chroma_t5_mask_pad)`, and `zero_out_masked` applies
//!   [`zero_masked`] per chunk.

use super::loader::Weights;
use super::prompt::{is_break, parse_prompt_attention, PadOptions, WeightedTokens};
use crate::error::Result;
use crate::graph::{Component, Loaded, Placement, Runner, WeightsMut};
use crate::models::te::t5::{self, T5Config, T5Model};
use crate::models::te::t5_tokenizer::{T5Tokenizer, T5Vocab};
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// Weighted T5 tokens with their additive attention mask.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct T5Tokens {
    pub tokens: WeightedTokens,
    /// One per token: 0 for prompt tokens and EOS, -inf for padding.
    pub mask: Vec<f32>,
}

/// Prompt → T5 tokens, as the reference's T5 conditioners: the attention syntax splits the
/// prompt, each piece is tokenized separately (so each starts a word) with its weight, then
/// EOS, padding and chunks come from `opts` (see [`PadOptions::t5_chunks`]). `BREAK` has no
/// meaning for T5: it is tokenized as text, with the weight the parser gave it (-1).
pub fn tokenize_weighted_t5(tokenizer: &T5Tokenizer, text: &str, opts: &PadOptions) -> T5Tokens {
    let parsed = parse_prompt_attention(text);
    sd_debug!("parse '{}' to [{}]", text, parsed.iter().map(|(t, w)| format!("['{t}', {w}], ")).collect::<String>());
    let mut tokens = WeightedTokens::default();
    for (piece, weight) in &parsed {
        if is_break(piece, *weight) {
            sd_debug!("T5 tokenizes BREAK as text");
        }
        let ids = tokenizer.encode(piece);
        tokens.weights.extend(std::iter::repeat_n(*weight, ids.len()));
        tokens.tokens.extend(ids);
    }
    let keep = tokens.pad_with_mask(opts);
    let mask = keep.iter().map(|&k| if k > 0.0 { 0.0 } else { f32::NEG_INFINITY }).collect();
    T5Tokens { tokens, mask }
}

/// Lets the first `extra` padding positions of an additive mask be attended (Chroma's
/// `chroma_t5_mask_pad`, applied to the mask it passes to the diffusion model).
pub fn attend_padding(mask: &mut [f32], extra: usize) {
    for m in mask.iter_mut().filter(|m| m.is_infinite()).take(extra) {
        *m = 0.0;
    }
}

/// Zeroes the hidden states ([dim, L, ..]) of the tokens the additive mask excludes.
pub fn zero_masked(hidden: &mut Tensor, mask: &[f32]) -> Result<()> {
    let dim = Tensor::ne(hidden, 0);
    ensure!(
        dim > 0 && hidden.len() == dim * mask.len(),
        "T5 mask of {} tokens does not fit hidden states {:?}",
        mask.len(),
        hidden.shape()
    );
    for (token, &m) in hidden.data_mut().chunks_mut(dim).zip(mask) {
        if m < 0.0 {
            token.fill(0.0);
        }
    }
    Ok(())
}

/// How long a [`T5Encoder`] keeps its weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Residency {
    /// Loaded by each encoding call that finds them absent and freed at its end; [`T5Encoder::load`]
    /// keeps them across calls until [`T5Encoder::unload`] (e.g. for a prompt and its negative).
    #[default]
    OnDemand,
    /// Loaded at creation and kept.
    Resident,
}

/// A T5 encoder over the context's model files, with its tokenizer. On demand, its
/// placement keeps the weights on disk: a phase (`Component::begin` .. `end`, or one
/// encoding call outside a phase) reads them and frees them at its end.
pub struct T5Encoder {
    net: Loaded<T5Model>,
    tokenizer: &'static T5Tokenizer,
    residency: Residency,
    /// Inside a phase begun by [`load`](Self::load) or `Component::begin`.
    in_phase: bool,
}

impl T5Encoder {
    /// The encoder whose weights are under `prefix` (usually [`t5::T5XXL_PREFIX`]) on the
    /// text encoders' `placement`; sizes come from the files. Loads the weights now only
    /// when `Resident`.
    pub fn new(
        weights: &Arc<Weights>,
        prefix: &str,
        vocab: T5Vocab,
        placement: &Placement,
        n_threads: i32,
        residency: Residency,
    ) -> Result<T5Encoder> {
        ensure!(weights.has_prefix(prefix), "no T5 weights under '{prefix}' in the model files");
        let cfg = T5Config::detect(weights.types(), &|n| weights.shape_of(n), prefix, vocab == T5Vocab::Umt5);
        sd_debug!("T5: {cfg:?}");
        let place = placement.resident_or_per_phase(residency != Residency::OnDemand);
        let net = weights.load_model(place, n_threads, prefix, "t5", |s| T5Model::new(s, &cfg))?;
        Ok(T5Encoder { net, tokenizer: T5Tokenizer::shared(vocab)?, residency, in_phase: false })
    }

    pub fn config(&self) -> &T5Config {
        &self.net.model.cfg
    }

    pub fn tokenizer(&self) -> &'static T5Tokenizer {
        self.tokenizer
    }

    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// Graph options (e.g. flash attention, which T5's attention never uses anyway).
    pub fn runner_mut(&mut self) -> &mut Runner {
        &mut self.net.runner
    }

    pub fn is_loaded(&self) -> bool {
        self.net.store().is_allocated()
    }

    /// Brings the weights into memory and keeps them across calls until [`unload`](Self::unload).
    pub fn load(&mut self) -> Result<()> {
        Component::begin(self)
    }

    /// Frees the compute buffer, and the weights unless resident.
    pub fn unload(&mut self) {
        Component::end(self)
    }

    /// Hidden states [model_dim, L, 1] of each chunk of token ids (with its additive mask, if
    /// any). The compute buffer is released at the end, and outside a phase the weights too
    /// (unless resident).
    pub fn encode_chunks(&mut self, chunks: &[(&[u32], Option<&[f32]>)]) -> Result<Vec<Tensor>> {
        let start = Instant::now();
        let own_phase = !self.in_phase;
        if own_phase {
            self.load()?;
        }
        let (model, runner) = self.net.parts();
        let result = chunks
            .iter()
            .map(|&(ids, mask)| {
                let ids: Vec<i32> = ids.iter().map(|&t| i32::try_from(t).unwrap_or(-1)).collect();
                t5::encode(runner, model, &ids, mask)
            })
            .collect::<Result<Vec<Tensor>>>();
        runner.release();
        if own_phase {
            self.unload();
        }
        sd_debug!("t5: {} chunk(s) encoded in {} ms", chunks.len(), start.elapsed().as_millis());
        result
    }

    /// One chunk; see [`encode_chunks`](Self::encode_chunks).
    pub fn encode(&mut self, ids: &[u32], mask: Option<&[f32]>) -> Result<Tensor> {
        let mut out = self.encode_chunks(&[(ids, mask)])?;
        Ok(out.pop().expect("one chunk"))
    }
}

impl Component for T5Encoder {
    fn runner(&mut self) -> &mut Runner {
        &mut self.net.runner
    }

    fn weights_mut(&mut self) -> WeightsMut<'_> {
        self.net.weights_mut()
    }

    fn begin(&mut self) -> Result<()> {
        if !self.in_phase {
            Component::begin(&mut self.net)?;
            self.in_phase = true;
        }
        Ok(())
    }

    fn end(&mut self) {
        if std::mem::take(&mut self.in_phase) {
            Component::end(&mut self.net);
            if !self.is_loaded() {
                sd_debug!("t5: weights freed");
            }
        } else {
            self.net.runner.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{Component, ModelFiles, SdVersion};
    use crate::models::te::t5_tokenizer::{EOS_TOKEN, PAD_TOKEN};
    use crate::testutil::{model_tests_enabled, synthetic_fixture};

    fn tok() -> &'static T5Tokenizer {
        T5Tokenizer::shared(T5Vocab::T5).unwrap()
    }

    #[test]
    fn encoder_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<T5Encoder>();
    }

    #[test]
    fn masks() {
        let mut m = vec![0.0, 0.0, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY];
        attend_padding(&mut m, 2);
        assert_eq!(m[..4], [0.0; 4]);
        assert!(m[4].is_infinite());
        let mut h = Tensor::full(&[2, 3, 1], 1.0);
        zero_masked(&mut h, &[0.0, f32::NEG_INFINITY, 0.0]).unwrap();
        assert_eq!(h.data(), [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]);
        assert!(zero_masked(&mut h, &[0.0]).is_err());
    }

    #[test]
    fn weighted_pieces_are_tokenized_separately() {
        // "a " + "lovely" (×1.2) + " cat": each piece starts with its own ▁ (3).
        let t = tokenize_weighted_t5(tok(), "a (lovely:1.2) cat", &PadOptions::t5_chunks(16));
        assert_eq!(t.tokens.tokens[..7], [3, 9, 3061, 3, 1712, EOS_TOKEN, PAD_TOKEN]);
        assert_eq!(t.tokens.tokens.len(), 16);
        assert_eq!(t.tokens.weights[..7], [1.0, 1.0, 1.2, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(t.mask[..6], [0.0; 6]);
        assert!(t.mask[6..].iter().all(|m| *m == f32::NEG_INFINITY));
        // The same words unweighted are one piece.
        let plain = tokenize_weighted_t5(tok(), "a lovely cat", &PadOptions::t5_chunks(16));
        assert_eq!(plain.tokens.tokens[..5], [3, 9, 3061, 1712, EOS_TOKEN]);
        // BREAK is text for T5, weighted -1 as the parser leaves it.
        let t = tokenize_weighted_t5(tok(), "cat BREAK dog", &PadOptions::t5_chunks(8));
        assert_eq!(t.tokens.tokens[..4], [1712, 3, 25582, 12396]);
        assert_eq!(t.tokens.weights[..4], [1.0, -1.0, -1.0, -1.0]);
        // The empty prompt is ▁ and EOS.
        let t = tokenize_weighted_t5(tok(), "", &PadOptions::t5_chunks(77));
        assert_eq!(t.tokens.tokens[..3], [3, EOS_TOKEN, PAD_TOKEN]);
        assert_eq!(t.mask[..3], [0.0, 0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn long_prompts_become_chunks_each_ending_in_eos() {
        // "a lovely cat " is 4 tokens: 19 of them plus EOS fill one SD3 chunk exactly.
        let t = tokenize_weighted_t5(tok(), &"a lovely cat ".repeat(19), &PadOptions::t5_chunks(77));
        assert_eq!(t.tokens.tokens.len(), 77);
        assert_eq!(t.tokens.tokens[76], EOS_TOKEN);
        assert!(t.mask.iter().all(|m| *m == 0.0));
        // 80 tokens: 76 + EOS, then 4 + EOS + padding.
        let t = tokenize_weighted_t5(tok(), &"a lovely cat ".repeat(20), &PadOptions::t5_chunks(77));
        assert_eq!(t.tokens.chunk_count(77), 2);
        assert_eq!((t.tokens.tokens[75], t.tokens.tokens[76]), (1712, EOS_TOKEN));
        assert_eq!(t.tokens.tokens[77..83], [3, 9, 3061, 1712, EOS_TOKEN, PAD_TOKEN]);
        assert_eq!(t.mask[77 + 4], 0.0);
        assert_eq!(t.mask[77 + 5], f32::NEG_INFINITY);
        // Flux and Chroma chunk lengths.
        let t = tokenize_weighted_t5(tok(), &"a lovely cat ".repeat(100), &PadOptions::t5_chunks(256));
        assert_eq!(t.tokens.tokens.len(), 2 * 256);
        let t = tokenize_weighted_t5(tok(), &"a lovely cat ".repeat(100), &PadOptions::t5_chunks(512));
        assert_eq!((t.tokens.tokens.len(), t.tokens.tokens[400]), (512, EOS_TOKEN));
        // Truncation without chunking keeps EOS last.
        let opts = PadOptions { allow_overflow_expand: false, ..PadOptions::t5_chunks(10) };
        let t = tokenize_weighted_t5(tok(), &"a lovely cat ".repeat(5), &opts);
        assert_eq!(t.tokens.tokens, [3, 9, 3061, 1712, 3, 9, 3061, 1712, 3, EOS_TOKEN]);
        assert!(t.mask.iter().all(|m| *m == 0.0));
    }

    /// Loads the synthetic T5 the way a context names a `t5xxl_path` file, encodes on demand
    /// and frees the weights again; a resident encoder keeps them.
    #[test]
    fn encoder_loads_on_demand() {
        if !model_tests_enabled("T5 encoder component") {
            return;
        }
        let path = synthetic_fixture("t5xxl_tiny.safetensors").expect("t5xxl_tiny fixture");
        let mut files = ModelFiles::new();
        files.add(&path, Component::T5xxl.prefix()).unwrap();
        files.convert_names(Some(SdVersion::Flux));
        let weights = Arc::new(Weights::from_files(files, SdVersion::Flux, None, ""));
        let place = Placement::on(crate::graph::Module::Te, Arc::new(crate::graph::Backend::cpu().unwrap()));
        let mut enc = T5Encoder::new(&weights, t5::T5XXL_PREFIX, T5Vocab::T5, &place, 2, Residency::OnDemand).unwrap();
        assert_eq!(enc.config().n_layer, 2);
        assert!(!enc.is_loaded());
        let t = tokenize_weighted_t5(enc.tokenizer(), "a (lovely:1.2) cat", &PadOptions::t5_chunks(16));
        let chunk = (&t.tokens.tokens[..], Some(&t.mask[..]));
        let a = enc.encode_chunks(&[chunk, (&t.tokens.tokens[..], None)]).unwrap();
        assert!(!enc.is_loaded(), "on-demand weights are freed after encoding");
        assert_eq!(a[0].shape(), &[4096, 16, 1]);
        assert_ne!(a[0], a[1]);

        enc.load().unwrap();
        let b = enc.encode(&t.tokens.tokens, Some(&t.mask)).unwrap();
        assert!(enc.is_loaded(), "weights loaded explicitly stay");
        assert_eq!(a[0], b);
        enc.unload();
        assert!(!enc.is_loaded());

        let resident = T5Encoder::new(&weights, t5::T5XXL_PREFIX, T5Vocab::T5, &place, 2, Residency::Resident).unwrap();
        assert!(resident.is_loaded());
        assert!(enc.encode(&[40000], None).is_err());
        assert!(!enc.is_loaded(), "weights are freed after a failed encoding too");
    }
}
