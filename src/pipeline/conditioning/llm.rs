//! LLM conditioning (the reference's `LLMEmbedder`): the prompt is put into the family's
//! chat template, tokenized with the LLM's tokenizer (Qwen2's, or Mistral's for Mistral
//! Small / Ministral; the template's text around the prompt and each attention-weighted
//! piece of the prompt separately), run through the LLM, and the hidden states of the
//! family's layers become the cross-attention context, re-weighted by the attention syntax.
//! The families differ only in their [`LlmTemplate`].
//!
//! The LLM's weights are not kept through sampling: unless `eager_load`, its placement keeps
//! them on disk, so the conditioner's phase reads them and its end frees them again (the
//! 4B Qwen3 is 8 GB in f16).

use super::qwen_edit::{self, EditTemplate, VisionTower};
use super::{CondRequest, Conditioner};
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, Loaded, Placement};
use crate::models::te::bpe::BpeTokenizer;
use crate::models::te::llm::{self, causal_mask, LlmArch, LlmConfig, LlmModel, LLM_PREFIX};
use crate::models::te::qwen_vision::VisionArch;
use crate::models::te::{mistral_tokenizer, qwen_tokenizer};
use crate::models::Condition;
use crate::pipeline::loader::Weights;
use crate::pipeline::prompt::{apply_token_weights, parse_prompt_attention, spell_quoted};
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// How a family asks its LLM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmTemplate {
    pub arch: LlmArch,
    /// Text before and after the prompt.
    pub prefix: &'static str,
    pub suffix: &'static str,
    /// Put before the prompt inside its attention-weighted part (Ovis: a space).
    pub lead: &'static str,
    /// Hidden states read (1-based layer outputs, see `models::te::llm`).
    pub out_layers: &'static [i32],
    /// Token sequences shorter than this are padded with the tokenizer's padding token,
    /// masked out.
    pub min_length: usize,
    /// Tokens dropped from the front of the hidden states (a system prompt).
    pub drop_first: usize,
    /// Hidden states (after `drop_first`) shorter than this get zero rows appended.
    pub zero_pad_to: usize,
    /// Longer token sequences (template included) are cut to this many, the end dropped
    /// (0: never; Mage-Flow: 2048 after the system prompt).
    pub max_length: usize,
}

/// Z-Image: the user turn of Qwen3's chat template, the output of layer 35 (`[-2]` of 36).
pub const ZIMAGE_TEMPLATE: LlmTemplate = LlmTemplate {
    arch: LlmArch::Qwen3,
    prefix: "<|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
    lead: "",
    out_layers: &[35],
    min_length: 0,
    drop_first: 0,
    zero_pad_to: 0,
    max_length: 0,
};

/// What an LLM without a vision tower reads instead of the prompt in its template when
/// reference images come along (`pass_to_vlm`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefImageTemplate {
    /// Logged when it is used (the reference's pipeline name).
    pub pipeline: &'static str,
    /// The whole text encoded (weight 1, no attention syntax).
    pub text: &'static str,
}

/// Z-Image with reference images (the reference's omni pipeline): the user turn up to its
/// first picture. The reference encodes the rest (the pictures' separators, then the prompt
/// and the assistant turn) as further pieces that the Z-Image transformer never reads, and
/// the LLM sees no image embeddings: the context does not depend on the prompt.
pub const ZIMAGE_OMNI_TEMPLATE: RefImageTemplate = RefImageTemplate { pipeline: "ZImageOmniPipeline", text: "<|im_start|>user\n<|vision_start|>" };

/// A prompt as LLM tokens: ids, per-token weights and which tokens are real (not padding).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LlmTokens {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub keep: Vec<bool>,
}

impl LlmTokens {
    /// The reference's cut to `max_length` tokens (0: none): the end goes, template included,
    /// with a warning (the reference says nothing).
    pub fn cut(mut self, max_length: usize) -> LlmTokens {
        if max_length > 0 && self.ids.len() > max_length {
            sd_warn!(
                "the prompt is {} tokens with its template; this model reads the first {max_length}, the rest is cut",
                self.ids.len()
            );
            self.ids.truncate(max_length);
            self.weights.truncate(max_length);
            self.keep.truncate(max_length);
        }
        self
    }
}

/// The tokenizer of `arch`'s LLM.
pub fn tokenizer_for(arch: LlmArch) -> Result<&'static BpeTokenizer> {
    match arch {
        LlmArch::MistralSmall32 | LlmArch::Ministral3b => mistral_tokenizer::shared(),
        LlmArch::Qwen3 | LlmArch::Qwen3Vl | LlmArch::Qwen25Vl => qwen_tokenizer::shared(),
    }
}

/// `text` in `template`, tokenized like the reference: the prefix and the suffix (weight 1)
/// and each piece of the prompt's attention syntax are tokenized separately, then the
/// tokenizer's BOS (if it has one) goes in front and padding up to `min_length` behind.
pub fn tokenize(tokenizer: &BpeTokenizer, template: &LlmTemplate, text: &str) -> LlmTokens {
    tokenize_in(tokenizer, template, text, false)
}

/// [`tokenize`], with the prompt's quoted text spelled out character by character when
/// `spell_quotes` (`spell_quoted`, LongCat).
fn tokenize_in(tokenizer: &BpeTokenizer, template: &LlmTemplate, text: &str, spell_quotes: bool) -> LlmTokens {
    tokenize_pieces(tokenizer, template.prefix, &format!("{}{text}", template.lead), template.suffix, template.min_length, spell_quotes).cut(template.max_length)
}

/// [`tokenize`] with an explicit prefix and suffix (weight 1) around `text`.
pub fn tokenize_parts(tokenizer: &BpeTokenizer, prefix: &str, text: &str, suffix: &str, min_length: usize) -> LlmTokens {
    tokenize_pieces(tokenizer, prefix, text, suffix, min_length, false)
}

/// [`tokenize_parts`], with `text`'s quoted text spelled out when `spell_quotes`.
pub(super) fn tokenize_pieces(tokenizer: &BpeTokenizer, prefix: &str, text: &str, suffix: &str, min_length: usize, spell_quotes: bool) -> LlmTokens {
    let mut pieces: Vec<(String, f32)> = Vec::new();
    if !prefix.is_empty() {
        pieces.push((prefix.to_string(), 1.0));
    }
    if !text.is_empty() {
        let parsed = parse_prompt_attention(text);
        pieces.extend(if spell_quotes { spell_quoted(parsed) } else { parsed });
    }
    if !suffix.is_empty() {
        pieces.push((suffix.to_string(), 1.0));
    }
    sd_debug!("parse '{prefix}{text}{suffix}' to [{}]", pieces.iter().map(|(t, w)| format!("['{t}', {w}], ")).collect::<String>());
    let ids = tokenizer.special_ids();
    let mut t = LlmTokens::default();
    if let Some(bos) = ids.bos {
        t.ids.push(bos);
        t.weights.push(1.0);
    }
    for (piece, weight) in &pieces {
        let ids = tokenizer.encode(piece);
        t.weights.extend(std::iter::repeat_n(*weight, ids.len()));
        t.ids.extend(ids);
    }
    t.keep = vec![true; t.ids.len()];
    if t.ids.len() < min_length {
        let pad = min_length - t.ids.len();
        t.ids.extend(std::iter::repeat_n(ids.pad, pad));
        t.weights.extend(std::iter::repeat_n(1.0, pad));
        t.keep.extend(std::iter::repeat_n(false, pad));
    }
    t
}

/// An LLM text encoder with its tokenizer, as a conditioner's component.
pub struct LlmText {
    net: Loaded<LlmModel>,
    tokenizer: &'static BpeTokenizer,
}

impl LlmText {
    /// The LLM of the context's files (`llm_path`, under [`LLM_PREFIX`]); its weights are
    /// read per conditioning phase unless `resident`.
    pub fn open(weights: &Arc<Weights>, arch: LlmArch, place: &Placement, n_threads: i32, resident: bool) -> Result<LlmText> {
        ensure!(weights.has_prefix(LLM_PREFIX), "no LLM text encoder weights (llm_path) in the model files");
        let cfg = LlmConfig::detect(weights.types(), &|n| weights.shape_of(n), LLM_PREFIX, arch);
        ensure!(cfg.num_layers > 0, "the LLM text encoder has no layers under '{LLM_PREFIX}model.layers.'");
        let mut net = weights.load_model(place.resident_or_per_phase(resident), n_threads, LLM_PREFIX, "llm", |s| LlmModel::new(s, &cfg))?;
        // On the fast path its float products sum in the fast kernels' order (a 7B prompt
        // encode 0.8x the time); its q8_0 products keep ggml's: on AMX-INT8 tiles their
        // rounding, through the LLM and the DiT, moved a q8_0 picture past the fastest
        // build's distance (`tests/fast_path.rs`).
        net.runner.options.cpu_fast_products = net.runner.options.fast;
        Ok(LlmText { net, tokenizer: tokenizer_for(arch)? })
    }

    pub fn config(&self) -> &LlmConfig {
        &self.net.model.cfg
    }

    pub fn tokenizer(&self) -> &'static BpeTokenizer {
        self.tokenizer
    }

    /// Hidden states `[width, L, 1]` of `tokens` at `out_layers`, re-weighted by the tokens'
    /// weights. Outside a conditioning phase the weights are read and freed around the call.
    pub fn encode(&mut self, tokens: &LlmTokens, out_layers: &[i32]) -> Result<Tensor> {
        self.encode_with_images(tokens, out_layers, &[])
    }

    /// [`LlmText::encode`] with image embeddings (`[width, n]`, token order) in place of the
    /// token embeddings from their index on.
    pub fn encode_with_images(&mut self, tokens: &LlmTokens, out_layers: &[i32], images: &[(usize, Tensor)]) -> Result<Tensor> {
        self.encode_vl(tokens, out_layers, &llm::VlInputs { images, ..Default::default() })
    }

    /// [`LlmText::encode_with_images`] with deepstack embeddings and picture grids.
    pub fn encode_vl(&mut self, tokens: &LlmTokens, out_layers: &[i32], vl: &llm::VlInputs<'_>) -> Result<Tensor> {
        let start = Instant::now();
        let ids: Vec<i32> = tokens.ids.iter().map(|&t| i32::try_from(t).unwrap_or(-1)).collect();
        let mask = causal_mask(&tokens.keep);
        let mut h = self.net.run_in_phase(|model, runner| llm::hidden_states_vl(runner, model, &ids, Some(&mask), out_layers, vl))?;
        let (width, n) = (h.ne(0), tokens.ids.len());
        h = h.reshape(&[width, n])?;
        apply_token_weights(&mut h, &tokens.weights, n)?;
        sd_debug!("llm: {n} tokens encoded in {} ms", start.elapsed().as_millis());
        h.reshape(&[width, n, 1])
    }

    pub fn component(&mut self) -> &mut dyn Component {
        &mut self.net
    }

    /// Whether the weights are in memory (between a phase's begin and end, or resident).
    pub fn is_loaded(&self) -> bool {
        self.net.store().is_allocated()
    }
}

/// The conditioner of the LLM families.
pub struct LlmConditioner {
    llm: LlmText,
    template: LlmTemplate,
    /// Qwen-Image-Edit, LongCat-Image-Edit, Krea2, Boogu Image: reference images through the
    /// LLM's vision tower, in the family's edit prompt.
    vision: Option<VisionTower>,
    edit: EditTemplate,
    /// Z-Image: what the LLM reads when reference images come along (no vision tower).
    ref_image_template: Option<RefImageTemplate>,
    /// LongCat: quoted text in the prompt is tokenized character by character.
    spell_quotes: bool,
    /// Boogu: the prefix a blank prompt is put after instead of the template's.
    blank_prefix: Option<&'static str>,
}

impl LlmConditioner {
    pub fn new(weights: &Arc<Weights>, template: LlmTemplate, place: &Placement, n_threads: i32, resident: bool) -> Result<LlmConditioner> {
        let llm = LlmText::open(weights, template.arch, place, n_threads, resident)?;
        Ok(LlmConditioner { llm, template, vision: None, edit: qwen_edit::QWEN_EDIT, ref_image_template: None, spell_quotes: false, blank_prefix: None })
    }

    /// Quoted text in prompts is spelled out ([`spell_quoted`]).
    pub fn with_spelled_quotes(self) -> LlmConditioner {
        LlmConditioner { spell_quotes: true, ..self }
    }

    /// A prompt of nothing but spaces, tabs and line breaks is put after `prefix` instead of
    /// the template's prefix.
    pub fn with_blank_prompt_prefix(self, prefix: &'static str) -> LlmConditioner {
        LlmConditioner { blank_prefix: Some(prefix), ..self }
    }

    /// Reference images for the LLM (`pass_to_vlm`) make it read `template` instead of the
    /// prompt (when it has no vision tower).
    pub fn with_ref_image_template(self, template: RefImageTemplate) -> LlmConditioner {
        LlmConditioner { ref_image_template: Some(template), ..self }
    }

    /// Adds the vision tower of the context's files, if they hold one (Qwen3-VL's for a
    /// Qwen3-VL LLM, else Qwen2.5-VL's), for the edit prompt `edit`; whether one was found.
    pub fn open_vision(&mut self, weights: &Arc<Weights>, edit: EditTemplate, place: &Placement, n_threads: i32, resident: bool) -> Result<bool> {
        self.edit = edit;
        let arch = if self.template.arch == LlmArch::Qwen3Vl { VisionArch::Qwen3Vl } else { VisionArch::Qwen25Vl };
        self.vision = VisionTower::open(weights, arch, self.llm.config().hidden_size, place, n_threads, resident)?;
        Ok(self.vision.is_some())
    }

    /// Width of the context this conditioner produces.
    pub fn context_width(&self) -> usize {
        self.llm.config().output_width(self.template.out_layers)
    }
}

impl Components for LlmConditioner {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let mut parts = vec![self.llm.component()];
        if let Some(v) = &mut self.vision {
            parts.push(v.component());
        }
        parts
    }
}

impl Conditioner for LlmConditioner {
    fn encode(&mut self, req: &CondRequest<'_>) -> Result<Condition> {
        let start = Instant::now();
        let (h, drop) = match (&mut self.vision, self.ref_image_template) {
            (Some(vision), _) if !req.ref_images.is_empty() => {
                let images = qwen_edit::image_prompt(vision, req.ref_images, &req.refs, &self.edit)?;
                let text = format!("{}{}", self.template.lead, req.text);
                let h = qwen_edit::encode(&mut self.llm, &self.edit, images, &text, self.template.suffix, self.template.out_layers, self.spell_quotes)?;
                (h, self.edit.drop_first)
            }
            (None, Some(t)) if !req.ref_images.is_empty() => {
                sd_info!("{}", t.pipeline);
                if !req.text.trim().is_empty() {
                    // The reference reads no prompt here either; say so rather than drop it quietly.
                    sd_warn!(
                        "{}: with reference images passed to the text encoder (pass_to_vlm) the prompt \"{}\" is not read, as in stable-diffusion.cpp; ref_image_args \"pass_to_vlm=false\" conditions on it",
                        t.pipeline,
                        req.text
                    );
                }
                let tokens = tokenize_parts(self.llm.tokenizer(), t.text, "", "", self.template.min_length);
                (self.llm.encode(&tokens, self.template.out_layers)?, self.template.drop_first)
            }
            _ => {
                let blank = req.text.chars().all(|c| matches!(c, ' ' | '\t' | '\r' | '\n'));
                let template = match self.blank_prefix {
                    Some(prefix) if blank => LlmTemplate { prefix, ..self.template },
                    _ => self.template,
                };
                let tokens = tokenize_in(self.llm.tokenizer(), &template, req.text, self.spell_quotes);
                (self.llm.encode(&tokens, self.template.out_layers)?, self.template.drop_first)
            }
        };
        let (width, n) = (h.ne(0), h.ne(1));
        ensure!(n > drop, "the prompt gave {n} LLM tokens, the template drops the first {drop}");
        let mut data = h.data().get(drop * width..).context("LLM hidden states")?.to_vec();
        let len = (n - drop).max(self.template.zero_pad_to);
        data.resize(len * width, 0.0);
        // `zero_out_masked` is not read: the reference's LLM embedder ignores it (generate_video
        // always sets it, for the T5 conditioners' padding).
        let context = Tensor::from_vec(&[width, len, 1], data)?;
        sd_debug!("computing condition graph completed, taking {} ms", start.elapsed().as_millis());
        Ok(Condition { crossattn: Some(context), vector: None, concat: None, extra_context: None, token_types: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::te::qwen_tokenizer::{IM_END, IM_START, PAD_TOKEN};

    #[test]
    fn zimage_prompt_tokens() {
        let tok = qwen_tokenizer::shared().unwrap();
        let t = tokenize(tok, &ZIMAGE_TEMPLATE, "a lovely cat");
        assert_eq!(t.ids, [IM_START, 872, 198, 64, 16690, 8251, IM_END, 198, IM_START, 77091, 198]);
        assert!(t.weights.iter().all(|&w| w == 1.0) && t.keep.iter().all(|&k| k));
        // Weighted pieces are tokenized apart: "a " ends in a lone Ġ before the cut.
        let t = tokenize(tok, &ZIMAGE_TEMPLATE, "a (red:1.4) apple");
        assert_eq!(t.ids[3..7], [64, 220, 1151, 23268]);
        assert_eq!(t.weights[3..7], [1.0, 1.0, 1.4, 1.0]);
        // The empty prompt is the template alone.
        assert_eq!(tokenize(tok, &ZIMAGE_TEMPLATE, "").ids.len(), 8);
        // Padding to a minimum length is masked out.
        let padded = LlmTemplate { min_length: 16, ..ZIMAGE_TEMPLATE };
        let t = tokenize(tok, &padded, "a lovely cat");
        assert_eq!(t.ids.len(), 16);
        assert_eq!((t.ids[11], t.keep[10], t.keep[11]), (PAD_TOKEN, true, false));
        // With reference images: the omni template's text alone, <|vision_start|> last.
        let t = tokenize_parts(tok, ZIMAGE_OMNI_TEMPLATE.text, "", "", 0);
        assert_eq!(t.ids, [IM_START, 872, 198, 151652]);
    }

    fn llm_weights(file: &str) -> Arc<Weights> {
        use crate::io::{Component as Source, ModelFiles, SdVersion};
        let path = crate::testutil::synthetic_fixture(file).expect("LLM fixture");
        let mut files = ModelFiles::new();
        files.add(&path, Source::Llm.prefix()).unwrap();
        files.convert_names(Some(SdVersion::ZImage));
        Arc::new(Weights::from_files(files, SdVersion::ZImage, None, ""))
    }

    /// The synthetic Mistral Small 3.2 (30 layers × 96) under a Flux.2 dev-like template:
    /// Mistral's tokenizer with BOS, three layers side by side, and the hidden states of the
    /// real tokens followed by zero rows up to `zero_pad_to`.
    #[test]
    fn mistral_hidden_states_are_zero_padded() {
        if !crate::testutil::model_tests_enabled("Mistral text encoder") {
            return;
        }
        let place = Placement::on(crate::graph::Module::Te, Arc::new(crate::graph::Backend::cpu().unwrap()));
        let template = LlmTemplate {
            arch: LlmArch::MistralSmall32,
            prefix: "[INST]",
            suffix: "[/INST]",
            lead: "",
            out_layers: &[10, 20, 30],
            min_length: 0,
            drop_first: 0,
            zero_pad_to: 64,
            max_length: 0,
        };
        let mut cond = LlmConditioner::new(&llm_weights("mistral_small_tiny.safetensors"), template, &place, 2, false).unwrap();
        let cfg = cond.llm.config();
        assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.qk_norm, cfg.qkv_bias), (30, 96, 131072, false, false));
        assert_eq!(cond.context_width(), 288);
        let tokens = tokenize(cond.llm.tokenizer(), &template, "a lovely cat");
        assert_eq!(tokens.ids, [1, 3, 1097, 45988, 7990, 4]);
        let req = CondRequest { text: "a lovely cat", clip_skip: 0, width: 64, height: 64, zero_out_masked: false, ref_images: &[], refs: Default::default(), shown: &[] };
        let c = cond.encode(&req).unwrap().crossattn.unwrap();
        assert_eq!(c.shape(), &[288, 64, 1]);
        let (real, pad) = c.data().split_at(288 * 6);
        assert!(real.chunks(288).all(|row| row.iter().any(|&v| v != 0.0)) && pad.iter().all(|&v| v == 0.0));
        // The layers are the LLM's own: its hidden states at layers 10, 20, 30.
        let h = cond.llm.encode(&tokens, &[10, 20, 30]).unwrap();
        assert_eq!(h.data(), real);
    }

    /// The synthetic Qwen3 (36 layers × 64) read the way a context names an `llm_path` file:
    /// its weights are read for a phase and freed after it; the layers read decide the width,
    /// and an 8-layer LLM falls back to the normed final state.
    #[test]
    fn llm_weights_are_read_per_phase() {
        if !crate::testutil::model_tests_enabled("LLM text encoder") {
            return;
        }
        let place = Placement::on(crate::graph::Module::Te, Arc::new(crate::graph::Backend::cpu().unwrap()));
        let mut llm = LlmText::open(&llm_weights("qwen3_tiny.safetensors"), LlmArch::Qwen3, &place, 2, false).unwrap();
        assert_eq!((llm.config().num_layers, llm.config().hidden_size, llm.config().vocab_size), (36, 64, 151936));
        assert!(!llm.is_loaded());
        let tokens = tokenize(llm.tokenizer(), &ZIMAGE_TEMPLATE, "a lovely cat");
        let a = llm.encode(&tokens, &[35]).unwrap();
        assert_eq!(a.shape(), &[64, 11, 1]);
        assert!(!llm.is_loaded(), "weights are freed after an encoding outside a phase");
        Component::begin(llm.component()).unwrap();
        assert!(llm.is_loaded());
        assert_eq!(llm.encode(&tokens, &[35]).unwrap(), a);
        let three = llm.encode(&tokens, &[27, 9, 18]).unwrap();
        assert_eq!(three.shape(), &[192, 11, 1]);
        assert_ne!(&three.data()[..64], &a.data()[..64]);
        Component::end(llm.component());
        assert!(!llm.is_loaded(), "weights are freed at the phase's end");

        let mut short = LlmText::open(&llm_weights("qwen3_8layers.safetensors"), LlmArch::Qwen3, &place, 2, true).unwrap();
        assert!(short.is_loaded(), "resident weights are loaded at creation");
        assert_eq!(short.config().output_width(&[35]), 64);
        let normed = short.encode(&tokens, &[35]).unwrap();
        assert_eq!(normed, short.encode(&tokens, &[9]).unwrap());
        assert_eq!(normed.shape(), &[64, 11, 1]);
        assert!(short.encode(&LlmTokens { ids: vec![151936], weights: vec![1.0], keep: vec![true] }, &[35]).is_err());
    }
}
