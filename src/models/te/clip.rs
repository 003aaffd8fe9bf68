//! CLIP text transformers: OpenAI CLIP ViT-L/14 (SD 1.x, SDXL's first encoder), OpenCLIP
//! ViT-H/14 (SD 2.x) and OpenCLIP ViT-bigG/14 (SDXL's second encoder, with the pooled,
//! projected output SDXL's label embedding needs).
//!
//! Weights use the reference's internal names under the prefix of the scope they are
//! declared in (e.g. [`SD_CLIP_PREFIX`]); `embeddings.token_embedding.weight`,
//! `embeddings.position_embedding.weight`, `encoder.layers.N.{self_attn.{q,k,v,out}_proj |
//! self_attn.in_proj, layer_norm1, layer_norm2, mlp.fc1, mlp.fc2}`, `final_layer_norm` and,
//! for bigG, `text_projection`. OpenCLIP checkpoints map onto these names with a fused
//! `self_attn.in_proj` (see the test loader at the bottom for the mapping).
//!
//! How the pipeline uses it, like the reference's conditioner:
//! - SD 1.x: `ClipConfig::detect(types, SD_CLIP_PREFIX, OpenAiVitL14)`; default clip skip 1.
//! - SD 2.x: same prefix, `OpenClipVitH14`, `default_clip_skip = 2`.
//! - SDXL: `OpenAiVitL14` under [`SD_CLIP_PREFIX`] and `OpenClipVitBigG14` under
//!   [`SDXL_CLIP_G_PREFIX`], both with `with_final_ln = false` and `default_clip_skip = 2`;
//!   the pooled vector comes from the bigG encoder at the first EOS token of the chunk.
//! - `force_f32_token_embedding` is set when textual-inversion embeddings are configured.

use crate::error::Result;
use crate::graph::nn::{attention, embedding_lookup, linear, split_qkv, supports_get_rows, LayerNorm, Linear};
use crate::graph::{GgmlType, Graph, Runner, Scope, TypeMap, F32, T, W};
use crate::tensor::Tensor;

/// Internal prefix of the SD 1.x / SD 2.x text encoder and of SDXL's CLIP-L.
pub const SD_CLIP_PREFIX: &str = "cond_stage_model.transformer.text_model.";
/// Internal prefix of SDXL's OpenCLIP bigG (`conditioner.embedders.1.` in SDXL files).
pub const SDXL_CLIP_G_PREFIX: &str = "cond_stage_model.1.transformer.text_model.";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipVersion {
    /// SD 1.x and SDXL's first encoder.
    OpenAiVitL14,
    /// SD 2.x.
    OpenClipVitH14,
    /// SDXL's second encoder (CLIPTextModelWithProjection).
    OpenClipVitBigG14,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClipConfig {
    pub version: ClipVersion,
    pub vocab_size: i64,
    /// Tokens per chunk (max position embeddings).
    pub n_token: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub n_head: i64,
    pub n_layer: i32,
    /// Declared for bigG only.
    pub projection_dim: Option<i64>,
    /// tanh-approximated GELU (OpenCLIP) instead of quick GELU (OpenAI).
    pub gelu: bool,
    /// Whether the hidden states (not only the pooled output) go through the final norm.
    pub with_final_ln: bool,
    /// Keeps the token table in f32 (the reference does so when embeddings are configured).
    pub force_f32_token_embedding: bool,
    /// Fused q/k/v projection (`self_attn.in_proj`), as OpenCLIP checkpoints have it.
    pub proj_in: bool,
    /// What a clip_skip <= 0 means: 1 for SD 1.x, 2 for SD 2.x and SDXL.
    pub default_clip_skip: i32,
}

impl ClipConfig {
    /// The version's hyper-parameters, separate q/k/v projections, final norm on.
    pub fn new(version: ClipVersion) -> ClipConfig {
        let (hidden_size, intermediate_size, n_head, n_layer) = match version {
            ClipVersion::OpenAiVitL14 => (768, 3072, 12, 12),
            ClipVersion::OpenClipVitH14 => (1024, 4096, 16, 24),
            ClipVersion::OpenClipVitBigG14 => (1280, 5120, 20, 32),
        };
        ClipConfig {
            version,
            vocab_size: 49408,
            n_token: 77,
            hidden_size,
            intermediate_size,
            n_head,
            n_layer,
            projection_dim: (version == ClipVersion::OpenClipVitBigG14).then_some(1280),
            gelu: uses_gelu(hidden_size),
            with_final_ln: true,
            force_f32_token_embedding: false,
            proj_in: false,
            default_clip_skip: if version == ClipVersion::OpenAiVitL14 { 1 } else { 2 },
        }
    }

    /// `new(version)` plus what the files decide: a fused in_proj anywhere under `prefix`.
    pub fn detect(types: &TypeMap, prefix: &str, version: ClipVersion) -> ClipConfig {
        let mut cfg = Self::new(version);
        cfg.proj_in = types.keys().any(|n| n.starts_with(prefix) && n.contains("self_attn.in_proj"));
        cfg
    }

    /// The clip_skip a request means (<= 0: this model's default).
    pub fn resolve_clip_skip(&self, clip_skip: i32) -> i32 {
        if clip_skip <= 0 {
            self.default_clip_skip
        } else {
            clip_skip
        }
    }

    /// How many encoder layers run for a (resolved) clip_skip (see [`layers_to_run`]).
    pub fn layers_to_run(&self, clip_skip: i32) -> i32 {
        layers_to_run(self.n_layer, clip_skip)
    }
}

/// How many of `n_layer` encoder layers run for `clip_skip`, counted like the reference's
/// CLIP encoder (text and vision alike): a skip of k > 0 stops after layer n_layer - k, so
/// exactly n_layer + 1 runs none and a larger one runs them all; any skip <= 0 (the vision
/// tower's -2 included) runs them all.
pub(crate) fn layers_to_run(n_layer: i32, clip_skip: i32) -> i32 {
    let last = if clip_skip > 0 { n_layer - clip_skip } else { n_layer - 1 };
    if (0..=n_layer).contains(&(last + 1)) {
        last + 1
    } else {
        n_layer
    }
}

/// Self-attention with torch's `nn.MultiheadAttention` layout (separate or fused q/k/v).
#[derive(Clone, Copy, Debug)]
pub struct MultiheadAttention {
    qkv: QkvProj,
    out_proj: Linear,
    n_head: i64,
}

#[derive(Clone, Copy, Debug)]
enum QkvProj {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

impl MultiheadAttention {
    pub fn new(s: &mut Scope, dim: i64, n_head: i64, proj_in: bool) -> MultiheadAttention {
        let qkv = if proj_in {
            QkvProj::Fused(Linear::new(s, "in_proj", dim, dim * 3, true))
        } else {
            QkvProj::Separate {
                q: Linear::new(s, "q_proj", dim, dim, true),
                k: Linear::new(s, "k_proj", dim, dim, true),
                v: Linear::new(s, "v_proj", dim, dim, true),
            }
        };
        let out_proj = Linear::new(s, "out_proj", dim, dim, true);
        MultiheadAttention { qkv, out_proj, n_head }
    }

    /// x: [dim, n_token, N]; `mask` is added to the scores. Never uses flash attention
    /// (the reference's CLIP does not).
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let (q, k, v) = match self.qkv {
            QkvProj::Separate { q, k, v } => (q.forward(g, x), k.forward(g, x), v.forward(g, x)),
            QkvProj::Fused(p) => split_qkv(p.forward(g, x)),
        };
        let x = attention(g, q, k, v, self.n_head, mask, false, false, 1.0);
        self.out_proj.forward(g, x)
    }
}

/// The reference picks a CLIP layer's activation by its width alone: tanh GELU at 1024 and
/// 1280 (OpenCLIP's text towers, but also the OpenAI ViT-L/14 and OpenCLIP ViT-H/14 vision
/// towers), quick GELU otherwise.
pub(crate) fn uses_gelu(width: i64) -> bool {
    width == 1024 || width == 1280
}

/// One pre-norm encoder layer, shared by the text and vision towers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClipLayer {
    self_attn: MultiheadAttention,
    layer_norm1: LayerNorm,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    gelu: bool,
}

impl ClipLayer {
    /// `d` wide with `n_head` heads and an MLP of `intermediate`; `gelu` as [`uses_gelu`]
    /// says unless a test overrides it.
    pub(crate) fn new(s: &mut Scope, d: i64, n_head: i64, intermediate: i64, proj_in: bool, gelu: bool) -> ClipLayer {
        let self_attn = MultiheadAttention::new(&mut s.sub("self_attn"), d, n_head, proj_in);
        let layer_norm1 = LayerNorm::new(s, "layer_norm1", d, 1e-5, true, true);
        let layer_norm2 = LayerNorm::new(s, "layer_norm2", d, 1e-5, true, true);
        let mut mlp = s.sub("mlp");
        let fc1 = Linear::new(&mut mlp, "fc1", d, intermediate, true);
        let fc2 = Linear::new(&mut mlp, "fc2", intermediate, d, true);
        ClipLayer { self_attn, layer_norm1, layer_norm2, fc1, fc2, gelu }
    }

    /// x: [d, n_token, N]; `mask` (the text tower's causal one) is added to the scores.
    pub(crate) fn forward<'g>(&self, g: &'g Graph, x: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let x = x.add(self.self_attn.forward(g, self.layer_norm1.forward(g, x), mask));
        let h = self.fc1.forward(g, self.layer_norm2.forward(g, x)).contiguous();
        let h = if self.gelu { h.gelu_inplace() } else { h.gelu_quick_inplace() };
        x.add(self.fc2.forward(g, h))
    }
}

/// A CLIP text transformer whose weights live in a `ParamStore`.
pub struct ClipTextModel {
    pub cfg: ClipConfig,
    token_embedding: W,
    position_embedding: W,
    layers: Vec<ClipLayer>,
    final_layer_norm: LayerNorm,
    text_projection: Option<W>,
}

impl ClipTextModel {
    /// Declares every weight under the scope's prefix (e.g. [`SD_CLIP_PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &ClipConfig) -> ClipTextModel {
        let d = cfg.hidden_size;
        let (token_embedding, position_embedding) = {
            let mut e = s.sub("embeddings");
            let mut ty = e.file_type("token_embedding.weight").unwrap_or(F32);
            if cfg.force_f32_token_embedding || !supports_get_rows(ty) {
                ty = F32;
            }
            let tok = e.tensor("token_embedding.weight", ty, &[d, cfg.vocab_size]);
            let pos = e.tensor("position_embedding.weight", F32, &[d, cfg.n_token]);
            (tok, pos)
        };
        let layers = {
            let mut enc = s.sub("encoder");
            (0..cfg.n_layer)
                .map(|i| {
                    let mut s = enc.sub(&format!("layers.{i}"));
                    ClipLayer::new(&mut s, d, cfg.n_head, cfg.intermediate_size, cfg.proj_in, cfg.gelu)
                })
                .collect()
        };
        let final_layer_norm = LayerNorm::new(s, "final_layer_norm", d, 1e-5, true, true);
        // Declared [projection_dim, hidden] in ggml order and applied as `mul_mat(P, x)`,
        // like the reference (for OpenCLIP's [width, proj] layout that is P·x, not x·P);
        // that only fits when projection_dim == hidden_size, as for bigG.
        let text_projection = cfg.projection_dim.map(|p| s.tensor("text_projection", F32, &[p, d]));
        ClipTextModel {
            cfg: cfg.clone(),
            token_embedding,
            position_embedding,
            layers,
            final_layer_norm,
            text_projection,
        }
    }

    pub fn token_embedding_type(&self) -> GgmlType {
        self.token_embedding.ty()
    }

    /// Hidden states and, with `pooled_index`, the pooled projected vector.
    ///
    /// - `input_ids`: i32 [n_token, N]. Ids must be below `vocab_size + n_custom`.
    /// - `custom`: textual-inversion rows [hidden, n_custom] (any float type) that ids
    ///   `vocab_size..` look up; they are appended to the token table.
    /// - `clip_skip`: <= 0 means `cfg.default_clip_skip`; 1 is the last layer.
    /// - `pooled_index`: the token (usually the first EOS) whose final-normed state of
    ///   batch item 0, after every layer, is projected with `text_projection` (identity
    ///   when the model has none).
    ///
    /// Returns hidden [hidden, n_token, N] and pooled [proj].
    pub fn forward<'g>(
        &self,
        g: &'g Graph,
        input_ids: T<'g>,
        custom: Option<T<'g>>,
        clip_skip: i32,
        pooled_index: Option<usize>,
    ) -> (T<'g>, Option<T<'g>>) {
        let cfg = &self.cfg;
        assert_eq!(input_ids.ne()[0], cfg.n_token, "CLIP input must be chunks of {} tokens", cfg.n_token);
        // Cut points for segmented runs under `max_vram`, as in the reference.
        let mut x = g.mark_cut(self.embed(g, input_ids, custom), "clip_text.prelude");
        let mask = causal_mask(g, cfg.n_token);

        let n_hidden = cfg.layers_to_run(cfg.resolve_clip_skip(clip_skip)) as usize;
        let n_all = if pooled_index.is_some() { self.layers.len() } else { n_hidden };
        let mut hidden = None;
        for (i, layer) in self.layers.iter().enumerate().take(n_all) {
            if i == n_hidden {
                hidden = Some(self.hidden_output(g, x));
            }
            x = g.mark_cut(layer.forward(g, x, Some(mask)), &format!("clip_text.layers.{i}"));
        }
        if n_hidden == n_all {
            hidden = Some(self.hidden_output(g, x));
        }
        let hidden = hidden.expect("hidden states were taken");

        let pooled = pooled_index.map(|idx| {
            assert!((idx as i64) < cfg.n_token, "pooled token index {idx} out of range");
            let x = self.final_layer_norm.forward(g, x);
            let nb1 = x.nb()[1];
            let v = x.view(&[cfg.hidden_size], &[], nb1 * idx);
            match self.text_projection {
                Some(p) => linear(g, v, g.param(p), None, false, 1.0),
                None => v,
            }
        });
        (hidden, pooled)
    }

    fn hidden_output<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        if self.cfg.with_final_ln {
            self.final_layer_norm.forward(g, x)
        } else {
            x
        }
    }

    /// Token + position embeddings: [hidden, n_token, N].
    fn embed<'g>(&self, g: &'g Graph, input_ids: T<'g>, custom: Option<T<'g>>) -> T<'g> {
        let mut table = g.param(self.token_embedding);
        if let Some(c) = custom {
            let c = if c.ty() == table.ty() { c } else { c.cast(table.ty()) };
            table = table.concat(c, 1);
        }
        embedding_lookup(table, input_ids).add(g.param(self.position_embedding))
    }
}

/// [n, n] additive mask: 0 where the key (dim 0) is at or before the query (dim 1), -inf after.
fn causal_mask(g: &Graph, n: i64) -> T<'_> {
    let n = n as usize;
    let data: Vec<f32> =
        (0..n * n).map(|i| if i % n > i / n { f32::NEG_INFINITY } else { 0.0 }).collect();
    g.input_f32(&data, &[n as i64, n as i64])
}

/// Checks host inputs before building a graph (ggml aborts on out-of-range rows).
fn check_inputs(model: &ClipTextModel, tokens: &[i32], custom: Option<&Tensor>) -> Result<(i64, Option<i64>)> {
    let cfg = &model.cfg;
    let n_token = cfg.n_token as usize;
    ensure!(
        !tokens.is_empty() && tokens.len().is_multiple_of(n_token),
        "CLIP input has {} tokens, expected a non-zero multiple of {n_token}",
        tokens.len()
    );
    let n_custom = match custom {
        Some(t) => {
            ensure!(
                t.ne(0) as i64 == cfg.hidden_size && t.ne(1) > 0 && t.ne(2) == 1 && t.ne(3) == 1,
                "custom embeddings have shape {:?}, expected [{}, n]",
                t.shape(),
                cfg.hidden_size
            );
            Some(t.ne(1) as i64)
        }
        None => None,
    };
    let rows = cfg.vocab_size + n_custom.unwrap_or(0);
    if let Some(&bad) = tokens.iter().find(|&&t| t < 0 || t as i64 >= rows) {
        bail!("token id {bad} is outside the text encoder's {rows} embeddings");
    }
    Ok(((tokens.len() / n_token) as i64, n_custom))
}

/// Hidden states of `tokens` (chunks of `n_token` ids, one batch item each):
/// [hidden, n_token, n_chunks, 1]. `clip_skip` <= 0 means the model's default.
pub fn encode(
    runner: &mut Runner,
    model: &ClipTextModel,
    tokens: &[i32],
    custom: Option<&Tensor>,
    clip_skip: i32,
) -> Result<Tensor> {
    let (n, n_custom) = check_inputs(model, tokens, custom)?;
    runner.compute(|g| {
        let ids = g.input_i32(tokens, &[model.cfg.n_token, n]);
        let c = custom.zip(n_custom).map(|(t, k)| g.input(t).reshape(&[model.cfg.hidden_size, k]));
        Ok(model.forward(g, ids, c, clip_skip, None).0)
    })
}

/// The pooled (projected) vector of the first chunk at token `pooled_index`: [proj, 1, 1, 1].
pub fn encode_pooled(
    runner: &mut Runner,
    model: &ClipTextModel,
    tokens: &[i32],
    custom: Option<&Tensor>,
    pooled_index: usize,
) -> Result<Tensor> {
    let (n, n_custom) = check_inputs(model, tokens, custom)?;
    ensure!((pooled_index as i64) < model.cfg.n_token, "pooled token index {pooled_index} out of range");
    runner.compute(|g| {
        let ids = g.input_i32(tokens, &[model.cfg.n_token, n]);
        let c = custom.zip(n_custom).map(|(t, k)| g.input(t).reshape(&[model.cfg.hidden_size, k]));
        let (_, pooled) = model.forward(g, ids, c, 1, Some(pooled_index));
        Ok(pooled.expect("pooled output requested"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, ParamStore};
    use crate::models::te::test_weights::{clip_weights, have_numpy, reference, Weights};
    use serde_json::json;
    use std::sync::Arc;

    /// Loads `clip_<arch>.safetensors` into a model built from `cfg(types)`.
    fn load(arch: &str, prefix: &str, cfg: impl FnOnce(&TypeMap) -> ClipConfig) -> (ParamStore, ClipTextModel) {
        let weights = Weights::open(&clip_weights(arch)).unwrap();
        let types = weights.types();
        let cfg = cfg(&types);
        let mut store = ParamStore::new(1024).unwrap();
        let model = ClipTextModel::new(&mut Scope::new(&mut store, &types, prefix), &cfg);
        store.alloc(&Backend::cpu().unwrap()).unwrap();
        weights.load_into(&mut store).unwrap();
        (store, model)
    }

    fn runner() -> Runner {
        Runner::new(Arc::new(Backend::cpu().unwrap()), 2)
    }

    /// `prefix` followed by `pad` up to 77 tokens.
    fn chunk(prefix: &[i32], pad: i32) -> Vec<i32> {
        let mut t = prefix.to_vec();
        t.resize(77, pad);
        t
    }

    /// The rows `tests/tools/clip_reference.py` appends for "custom_n": [dim, n].
    fn custom_table(n: usize, dim: usize) -> Tensor {
        let data = (0..n * dim).map(|k| 0.02 * (1.0 + 0.37 * (k % dim) as f32 + 1.3 * (k / dim) as f32).sin()).collect();
        Tensor::from_vec(&[dim, n], data).unwrap()
    }

    /// max |got - want| relative to max |want| (f16 weights and f16 matmul inputs).
    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        crate::testutil::assert_close_rel(what, got, want, 1e-2);
    }

    /// The cases a test tells apart must differ by far more than its tolerance.
    fn assert_differ(what: &str, a: &[f32], b: &[f32]) {
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff > 0.1 * scale, "{what}: references too close ({diff} vs {scale})");
    }

    #[test]
    fn clip_skip_counts_layers_like_the_reference() {
        let cfg = ClipConfig::new(ClipVersion::OpenAiVitL14);
        assert_eq!(cfg.layers_to_run(cfg.resolve_clip_skip(0)), 12);
        assert_eq!(cfg.layers_to_run(2), 11);
        assert_eq!(cfg.layers_to_run(12), 1);
        assert_eq!(cfg.layers_to_run(13), 0);
        assert_eq!(cfg.layers_to_run(14), 12);
        let h = ClipConfig::new(ClipVersion::OpenClipVitH14);
        assert_eq!(h.layers_to_run(h.resolve_clip_skip(-1)), 23);
        assert!(h.gelu && !cfg.gelu);
    }

    #[test]
    fn sd1_clip_l_matches_numpy() {
        if !have_numpy() {
            return;
        }
        let (_store, model) =
            load("sd1", SD_CLIP_PREFIX, |t| ClipConfig::detect(t, SD_CLIP_PREFIX, ClipVersion::OpenAiVitL14));
        assert!(!model.cfg.proj_in);
        assert_eq!(model.token_embedding_type(), crate::graph::F16);
        let a = chunk(&[49406, 320, 1000, 49407], 49407);
        let b = chunk(&[49406, 49408, 2368, 49409, 49407], 49407);
        let want = reference(
            "sd1",
            &clip_weights("sd1"),
            &json!([
                {"name": "a1", "tokens": a, "clip_skip": 1},
                {"name": "a2", "tokens": a, "clip_skip": 2},
                {"name": "b2", "tokens": b, "clip_skip": 2, "custom_n": 2},
            ]),
        );
        assert_differ("sd1 clip_skip 1 vs 2", &want[0], &want[1]);
        let mut r = runner();
        // clip_skip 0 is SD 1.x's default: the last layer.
        let y = encode(&mut r, &model, &a, None, 0).unwrap();
        assert_eq!(y.shape(), &[768, 77, 1, 1]);
        assert_close("sd1 clip_skip 1", y.data(), &want[0]);
        // Two chunks in one batch, the second using textual-inversion rows.
        let ab: Vec<i32> = a.iter().chain(&b).copied().collect();
        let y = encode(&mut r, &model, &ab, Some(&custom_table(2, 768)), 2).unwrap();
        assert_eq!(y.shape(), &[768, 77, 2, 1]);
        let (ya, yb) = y.data().split_at(768 * 77);
        assert_close("sd1 clip_skip 2", ya, &want[1]);
        assert_close("sd1 clip_skip 2 + custom", yb, &want[2]);

        assert!(encode(&mut r, &model, &b, None, 1).is_err(), "ids beyond the vocabulary need custom rows");
        assert!(encode(&mut r, &model, &a[..76], None, 1).is_err());
    }

    #[test]
    fn sd2_open_clip_h_matches_numpy() {
        if !have_numpy() {
            return;
        }
        let (_store, model) =
            load("sd2", SD_CLIP_PREFIX, |t| ClipConfig::detect(t, SD_CLIP_PREFIX, ClipVersion::OpenClipVitH14));
        assert!(model.cfg.proj_in);
        let a = chunk(&[49406, 320, 1000, 49407], 0);
        let want = reference(
            "sd2",
            &clip_weights("sd2"),
            &json!([
                {"name": "a1", "tokens": a, "clip_skip": 1},
                {"name": "a2", "tokens": a, "clip_skip": 2},
            ]),
        );
        assert_differ("sd2 clip_skip 1 vs 2", &want[0], &want[1]);
        let mut r = runner();
        let y = encode(&mut r, &model, &a, None, 1).unwrap();
        assert_eq!(y.shape(), &[1024, 77, 1, 1]);
        assert_close("sd2 clip_skip 1", y.data(), &want[0]);
        // SD 2.x's default skips the last layer.
        let y = encode(&mut r, &model, &a, None, -1).unwrap();
        assert_close("sd2 clip_skip 2", y.data(), &want[1]);
    }

    /// The bigG path (fused q/k/v, gelu, no final norm on the hidden states, pooled output
    /// through text_projection, f32 token table with custom rows) on a 3-layer, 64-wide model.
    #[test]
    fn bigg_style_pooled_and_hidden_match_numpy() {
        if !have_numpy() {
            return;
        }
        let (_store, model) = load("tiny-g", SDXL_CLIP_G_PREFIX, |t| {
            let mut c = ClipConfig::detect(t, SDXL_CLIP_G_PREFIX, ClipVersion::OpenClipVitBigG14);
            c.hidden_size = 64;
            c.intermediate_size = 256;
            c.n_head = 4;
            c.n_layer = 3;
            c.projection_dim = Some(64);
            c.with_final_ln = false;
            c.force_f32_token_embedding = true;
            c
        });
        assert!(model.cfg.proj_in && model.cfg.gelu);
        assert_eq!(model.token_embedding_type(), F32);
        let a = chunk(&[49406, 49408, 320, 49407], 0);
        let want = reference(
            "tiny-g",
            &clip_weights("tiny-g"),
            &json!([
                {"name": "h", "tokens": a, "clip_skip": 2, "final_ln": false, "custom_n": 1},
                {"name": "p", "tokens": a, "pooled": 3, "custom_n": 1},
            ]),
        );
        let custom = custom_table(1, 64);
        let mut r = runner();
        let y = encode(&mut r, &model, &a, Some(&custom), 0).unwrap();
        assert_eq!(y.shape(), &[64, 77, 1, 1]);
        assert_close("tiny-g hidden", y.data(), &want[0]);
        let p = encode_pooled(&mut r, &model, &a, Some(&custom), 3).unwrap();
        assert_eq!(p.shape(), &[64, 1, 1, 1]);
        assert_close("tiny-g pooled", p.data(), &want[1]);

        // Both outputs from one graph equal the separate runs.
        let both = r
            .compute_many(|g| {
                let ids = g.input_i32(&a, &[77, 1]);
                let c = g.input(&custom);
                let (h, p) = model.forward(g, ids, Some(c), 0, Some(3));
                Ok(vec![h, p.unwrap()])
            })
            .unwrap();
        assert_eq!(both[0].data(), y.data());
        assert_eq!(both[1].data(), p.data());
    }
}
