//! The T5 v1.1 encoder (T5-XXL for SD3, Flux, Chroma) and UMT5's (Wan), like the reference's
//! `src/model/te/t5.hpp`.
//!
//! Pre-norm blocks with RMS norms (f32 weights, eps 1e-6), attention without score scaling
//! (K is scaled by √d_head to cancel the usual 1/√d_head) plus a learned relative position
//! bias, and a gated-GELU feed-forward whose output projection runs on inputs scaled by 1/32
//! (the reference does so to keep f16 backends from overflowing). T5 has one bias table in
//! the first block, shared by all; UMT5 has one per block (`shared_relative_bias = false`).
//!
//! Weights use the Hugging Face `T5EncoderModel` names under a prefix, e.g.
//! [`T5XXL_PREFIX`]`encoder.block.0.layer.0.SelfAttention.q.weight`, `shared.weight`,
//! `encoder.final_layer_norm.weight`; a standalone `t5xxl_path` file gets that prefix from io.
//! Sizes come from the weights ([`T5Config::detect`]).

use crate::error::Result;
use crate::graph::nn::{attention, embedding_lookup, scale, Embedding, Linear};
use crate::graph::{Graph, Runner, Scope, TypeMap, F32, T, W};
use crate::tensor::Tensor;

/// Where the reference puts the T5 of SD3 / Flux / Chroma / Wan (also UMT5).
pub const T5XXL_PREFIX: &str = "text_encoders.t5xxl.transformer.";

const RELATIVE_BUCKETS: i32 = 32;
const RELATIVE_MAX_DISTANCE: i32 = 128;
const NORM_EPS: f32 = 1e-6;
/// The scale the feed-forward output projection's input gets (undone after it).
const FF_OUT_SCALE: f32 = 1.0 / 32.0;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct T5Config {
    pub n_layer: usize,
    pub model_dim: i64,
    /// Width of q/k/v (n_head · 64).
    pub inner_dim: i64,
    pub ff_dim: i64,
    pub n_head: i64,
    /// Rows of the token table (may exceed the tokenizer's pieces).
    pub vocab_size: i64,
    /// T5: the first block's relative position bias serves every block. UMT5: each block
    /// has its own.
    pub shared_relative_bias: bool,
}

impl T5Config {
    /// T5-XXL v1.1 (or UMT5-XXL with `umt5`), before looking at any weight.
    pub fn xxl(umt5: bool) -> T5Config {
        T5Config {
            n_layer: 24,
            model_dim: 4096,
            inner_dim: 4096,
            ff_dim: 10240,
            n_head: 64,
            vocab_size: if umt5 { 256384 } else { 32128 },
            shared_relative_bias: !umt5,
        }
    }

    /// The sizes of the weights under `prefix` (ending in '.'), like the reference: width and
    /// vocabulary from `shared.weight`, inner width (and heads of 64) from the first q,
    /// feed-forward width from the first `wi_0`, layers from the highest block index; what is
    /// missing keeps its [`xxl`](Self::xxl) value. `shape_of` gives ggml-order shapes.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str, umt5: bool) -> T5Config {
        let mut cfg = T5Config::xxl(umt5);
        let matrix = |leaf: &str| shape_of(&format!("{prefix}{leaf}")).filter(|s| s.len() == 2);
        if let Some(s) = matrix("shared.weight") {
            cfg.model_dim = s[0];
            cfg.vocab_size = s[1];
        }
        if let Some(s) = matrix("encoder.block.0.layer.0.SelfAttention.q.weight") {
            cfg.model_dim = s[0];
            cfg.inner_dim = s[1];
            if s[1] % 64 == 0 {
                cfg.n_head = s[1] / 64;
            }
        }
        if let Some(s) = matrix("encoder.block.0.layer.1.DenseReluDense.wi_0.weight") {
            cfg.model_dim = s[0];
            cfg.ff_dim = s[1];
        }
        let blocks = format!("{prefix}encoder.block.");
        let layers = types
            .keys()
            .filter_map(|n| n.strip_prefix(&blocks)?.split_once('.')?.0.parse::<usize>().ok())
            .map(|i| i + 1)
            .max();
        if let Some(n) = layers {
            cfg.n_layer = n;
        }
        cfg
    }

    fn d_head(&self) -> i64 {
        self.inner_dim / self.n_head
    }
}

/// T5's norm: x / rms(x) · weight (no mean, no bias).
#[derive(Clone, Copy, Debug)]
struct RmsNorm(W);

impl RmsNorm {
    fn new(s: &mut Scope, name: &str, dim: i64) -> RmsNorm {
        RmsNorm(s.sub(name).tensor("weight", F32, &[dim]))
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        x.rms_norm(NORM_EPS).mul(g.param(self.0))
    }
}

/// What every block's attention sees besides its input: the relative position buckets
/// (i32 [L, L]) and the optional additive key mask ([L]).
#[derive(Clone, Copy)]
struct Positions<'g> {
    buckets: T<'g>,
    mask: Option<T<'g>>,
}

#[derive(Clone, Copy, Debug)]
struct SelfAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    relative_bias: Option<Embedding>,
    n_head: i64,
    d_head: i64,
}

impl SelfAttention {
    fn new(s: &mut Scope, cfg: &T5Config, with_bias: bool) -> SelfAttention {
        let (d, inner) = (cfg.model_dim, cfg.inner_dim);
        SelfAttention {
            q: Linear::new(s, "q", d, inner, false),
            k: Linear::new(s, "k", d, inner, false),
            v: Linear::new(s, "v", d, inner, false),
            o: Linear::new(s, "o", inner, d, false),
            relative_bias: with_bias
                .then(|| Embedding::new(s, "relative_attention_bias", RELATIVE_BUCKETS as i64, cfg.n_head)),
            n_head: cfg.n_head,
            d_head: cfg.d_head(),
        }
    }

    /// x: [model_dim, L, N]. Returns the output and the position bias [L, L, n_head] later
    /// blocks reuse (this block's own when it has a table, else `bias`).
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, bias: Option<T<'g>>, pos: Positions<'g>) -> (T<'g>, Option<T<'g>>) {
        let q = self.q.forward(g, x);
        let k = self.k.forward(g, x);
        let v = self.v.forward(g, x);
        let bias = match self.relative_bias {
            // [n_head, L_k, L_q] → [L_k, L_q, n_head]
            Some(table) => Some(embedding_lookup(g.param(table.weight), pos.buckets).permute(2, 0, 1, 3).cont()),
            None => bias,
        };
        let scores_mask = match (bias, pos.mask) {
            (Some(b), Some(m)) => Some(m.repeat(b).add(b)),
            (Some(b), None) => Some(b),
            (None, m) => m,
        };
        let k = scale(k, (self.d_head as f32).sqrt(), true);
        let x = attention(g, q, k, v, self.n_head, scores_mask, false, false, 1.0);
        (self.o.forward(g, x), bias)
    }
}

/// wo(gelu(wi_0 x) · wi_1 x)
#[derive(Clone, Copy, Debug)]
struct GatedFeedForward {
    wi_0: Linear,
    wi_1: Linear,
    wo: Linear,
}

impl GatedFeedForward {
    fn new(s: &mut Scope, cfg: &T5Config) -> GatedFeedForward {
        let (d, ff) = (cfg.model_dim, cfg.ff_dim);
        let mut wo = Linear::new(s, "wo", ff, d, false);
        wo.scale = FF_OUT_SCALE;
        GatedFeedForward { wi_0: Linear::new(s, "wi_0", d, ff, false), wi_1: Linear::new(s, "wi_1", d, ff, false), wo }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gate = self.wi_0.forward(g, x).contiguous().gelu_inplace();
        let h = gate.mul_inplace(self.wi_1.forward(g, x));
        self.wo.forward(g, h)
    }
}

#[derive(Clone, Copy, Debug)]
struct Block {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    ff_norm: RmsNorm,
    ff: GatedFeedForward,
}

impl Block {
    fn new(s: &mut Scope, cfg: &T5Config, with_bias: bool) -> Block {
        let (attn_norm, attn) = {
            let mut l = s.sub("layer.0");
            (RmsNorm::new(&mut l, "layer_norm", cfg.model_dim), SelfAttention::new(&mut l.sub("SelfAttention"), cfg, with_bias))
        };
        let mut l = s.sub("layer.1");
        let ff_norm = RmsNorm::new(&mut l, "layer_norm", cfg.model_dim);
        let ff = GatedFeedForward::new(&mut l.sub("DenseReluDense"), cfg);
        Block { attn_norm, attn, ff_norm, ff }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, bias: Option<T<'g>>, pos: Positions<'g>) -> (T<'g>, Option<T<'g>>) {
        let (out, bias) = self.attn.forward(g, self.attn_norm.forward(g, x), bias, pos);
        let x = out.add_inplace(x);
        let x = self.ff.forward(g, self.ff_norm.forward(g, x)).add_inplace(x);
        (x, bias)
    }
}

/// A T5 encoder whose weights live in a `ParamStore`.
pub struct T5Model {
    pub cfg: T5Config,
    shared: Embedding,
    blocks: Vec<Block>,
    final_norm: RmsNorm,
}

impl T5Model {
    /// Declares every weight under the scope's prefix (e.g. [`T5XXL_PREFIX`]).
    pub fn new(s: &mut Scope, cfg: &T5Config) -> T5Model {
        let shared = Embedding::new(s, "shared", cfg.vocab_size, cfg.model_dim);
        let mut enc = s.sub("encoder");
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::new(&mut enc.sub(&format!("block.{i}")), cfg, i == 0 || !cfg.shared_relative_bias))
            .collect();
        let final_norm = RmsNorm::new(&mut enc, "final_layer_norm", cfg.model_dim);
        T5Model { cfg: cfg.clone(), shared, blocks, final_norm }
    }

    /// Weights a store needs room for.
    pub fn tensor_count(cfg: &T5Config) -> usize {
        2 + 10 * cfg.n_layer
    }

    /// Hidden states [model_dim, L, N] of `input_ids` (i32 [L, N]).
    ///
    /// - `buckets`: i32 [L, L], [`relative_position_buckets`] of L.
    /// - `mask`: added to every block's attention scores, broadcast over queries and heads:
    ///   [L] (0 to attend a key, -inf to ignore it; Chroma's padding mask).
    pub fn forward<'g>(&self, g: &'g Graph, input_ids: T<'g>, buckets: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let pos = Positions { buckets, mask };
        let mut x = self.shared.forward(g, input_ids);
        let mut bias = None;
        for block in &self.blocks {
            (x, bias) = block.forward(g, x, bias, pos);
        }
        self.final_norm.forward(g, x)
    }
}

/// The relative position bucket of every (query i, key j) pair, key fastest ([L, L] in ggml
/// order), bidirectional with 32 buckets up to distance 128, computed in f32 like the
/// reference (so the log-spaced boundaries fall where they do there).
pub fn relative_position_buckets(len: usize) -> Vec<i32> {
    let half = RELATIVE_BUCKETS / 2;
    let max_exact = half / 2;
    let log_base = (RELATIVE_MAX_DISTANCE as f32 / max_exact as f32).ln();
    let bucket = |rel: i32| {
        let base = if rel > 0 { half } else { 0 };
        let dist = rel.abs();
        if dist < max_exact {
            return base + dist;
        }
        let log_pos = (dist as f32 / max_exact as f32).ln();
        let large = max_exact + ((log_pos / log_base) * (half - max_exact) as f32) as i32;
        base + large.min(half - 1)
    };
    let n = len as i32;
    (0..n).flat_map(|i| (0..n).map(move |j| bucket(j - i))).collect()
}

/// Checks host inputs before building a graph (ggml aborts on out-of-range rows).
fn check_inputs(model: &T5Model, ids: &[i32], mask: Option<&[f32]>) -> Result<()> {
    ensure!(!ids.is_empty(), "T5 input has no tokens");
    let rows = model.cfg.vocab_size;
    if let Some(&bad) = ids.iter().find(|&&t| t < 0 || t as i64 >= rows) {
        bail!("token id {bad} is outside the T5 encoder's {rows} embeddings");
    }
    if let Some(m) = mask {
        ensure!(m.len() == ids.len(), "T5 attention mask has {} values for {} tokens", m.len(), ids.len());
    }
    Ok(())
}

/// Hidden states [model_dim, L, 1] of one token sequence, with an optional additive key mask
/// (see [`T5Model::forward`]).
pub fn encode(runner: &mut Runner, model: &T5Model, ids: &[i32], mask: Option<&[f32]>) -> Result<Tensor> {
    check_inputs(model, ids, mask)?;
    let len = ids.len();
    let buckets = relative_position_buckets(len);
    let out = runner.compute(|g| {
        let ids = g.input_i32(ids, &[len as i64, 1]);
        let buckets = g.input_i32(&buckets, &[len as i64, len as i64]);
        let mask = mask.map(|m| g.input_f32(m, &[len as i64]));
        Ok(model.forward(g, ids, buckets, mask))
    })?;
    out.reshape(&[model.cfg.model_dim as usize, len, 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, ParamStore};
    use crate::models::te::test_weights::{numpy_python, run_cases, Weights};
    use crate::testutil::{model_tests_enabled, repo, synthetic_fixture};
    use serde_json::json;
    use std::process::Command;
    use std::sync::Arc;

    /// The exact buckets: 8 + ⌊2·log2(d/8)⌋ for distances from 8, from integer arithmetic.
    fn exact_bucket(rel: i32) -> i32 {
        let base = if rel > 0 { 16 } else { 0 };
        let d = rel.unsigned_abs() as u64;
        if d < 8 {
            return base + d as i32;
        }
        // ⌊log2(d² / 64)⌋ = ⌊log2(d²)⌋ - 6
        let j = (63 - (d * d).leading_zeros() as i32) - 6;
        base + (8 + j).min(15)
    }

    #[test]
    fn buckets_match_exact_arithmetic() {
        let n = 600;
        let b = relative_position_buckets(n);
        assert_eq!(b.len(), n * n);
        for i in 0..n {
            for j in 0..n {
                let rel = j as i32 - i as i32;
                assert_eq!(b[i * n + j], exact_bucket(rel), "query {i}, key {j}");
            }
        }
        let row: Vec<i32> = relative_position_buckets(20)[..20].to_vec();
        assert_eq!(row, [0, 17, 18, 19, 20, 21, 22, 23, 24, 24, 24, 24, 25, 25, 25, 25, 26, 26, 26, 26]);
        assert_eq!(relative_position_buckets(3), [0, 17, 18, 1, 0, 17, 2, 1, 0]);
    }

    fn tiny_types() -> (TypeMap, std::collections::HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = std::collections::HashMap::new();
        let p = T5XXL_PREFIX;
        let mut add = |n: String, s: &[i64]| {
            types.insert(n.clone(), crate::graph::F16);
            shapes.insert(n, s.to_vec());
        };
        add(format!("{p}shared.weight"), &[64, 100]);
        for i in 0..3 {
            add(format!("{p}encoder.block.{i}.layer.0.SelfAttention.q.weight"), &[64, 128]);
            add(format!("{p}encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight"), &[64, 96]);
        }
        (types, shapes)
    }

    #[test]
    fn config_from_weights() {
        let (types, shapes) = tiny_types();
        let cfg = T5Config::detect(&types, &|n| shapes.get(n).cloned(), T5XXL_PREFIX, false);
        assert_eq!(
            cfg,
            T5Config {
                n_layer: 3,
                model_dim: 64,
                inner_dim: 128,
                ff_dim: 96,
                n_head: 2,
                vocab_size: 100,
                shared_relative_bias: true
            }
        );
        let umt5 = T5Config::detect(&types, &|n| shapes.get(n).cloned(), T5XXL_PREFIX, true);
        assert!(!umt5.shared_relative_bias);
        assert_eq!(T5Config::detect(&TypeMap::new(), &|_| None, T5XXL_PREFIX, false), T5Config::xxl(false));
        assert_eq!(T5Config::xxl(true).vocab_size, 256384);

        // Declared weights: one bias table for T5, one per block for UMT5.
        for (c, tables) in [(cfg, 1), (umt5, 3)] {
            let mut store = ParamStore::new(T5Model::tensor_count(&c)).unwrap();
            T5Model::new(&mut Scope::new(&mut store, &types, T5XXL_PREFIX), &c);
            let names: Vec<&str> = store.entries().map(|e| e.0).collect();
            assert_eq!(names.iter().filter(|n| n.contains("relative_attention_bias")).count(), tables);
            assert!(names.contains(&"text_encoders.t5xxl.transformer.encoder.block.2.layer.1.DenseReluDense.wo.weight"));
            assert!(names.contains(&"text_encoders.t5xxl.transformer.encoder.final_layer_norm.weight"));
            assert_eq!(store.len(), T5Model::tensor_count(&c) - 3 + tables);
        }
    }

    /// Runs tests/tools/t5_ref.py on `cases` and returns each case's hidden states.
    fn numpy_reference(python: &std::path::Path, weights: &std::path::Path, cases: &serde_json::Value) -> Vec<Vec<f32>> {
        run_cases("t5", cases, |cases_path, dir| {
            let status = Command::new(python)
                .arg(repo().join("tests/tools/t5_ref.py"))
                .args([weights.as_os_str(), cases_path.as_os_str(), dir.as_os_str()])
                .status()
                .expect("run t5_ref.py");
            assert!(status.success(), "t5_ref.py failed");
        })
    }

    /// max |got - want| / max |want| and mean |got - want| / rms(want).
    fn errors(got: &[f32], want: &[f32]) -> (f32, f32) {
        assert_eq!(got.len(), want.len());
        let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let rms = (want.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / want.len() as f64).sqrt();
        let max_err = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let mean_err = got.iter().zip(want).map(|(a, b)| f64::from((a - b).abs())).sum::<f64>() / want.len() as f64;
        (max_err / max_ref, (mean_err / rms) as f32)
    }

    /// The 2-layer, 4096-wide synthetic T5 (f16, real vocabulary) against the numpy model,
    /// with and without a padding mask, on sequences long enough to reach the log-spaced
    /// and the last relative-position buckets.
    #[test]
    fn t5xxl_tiny_matches_numpy() {
        if !model_tests_enabled("T5 vs numpy") {
            return;
        }
        let Some(python) = numpy_python() else {
            eprintln!("skipped T5 vs numpy: no python with numpy");
            return;
        };
        let path = synthetic_fixture("t5xxl_tiny.safetensors").expect("t5xxl_tiny fixture");
        let weights = Weights::open_mapped(&path, |n| Some(format!("{T5XXL_PREFIX}{n}"))).unwrap();
        let types = weights.types();
        let cfg = T5Config::detect(&types, &|n| weights.shape(n), T5XXL_PREFIX, false);
        assert_eq!((cfg.n_layer, cfg.model_dim, cfg.inner_dim, cfg.n_head, cfg.ff_dim, cfg.vocab_size), (2, 4096, 128, 2, 256, 32128));
        let mut store = ParamStore::new(T5Model::tensor_count(&cfg)).unwrap();
        let model = T5Model::new(&mut Scope::new(&mut store, &types, T5XXL_PREFIX), &cfg);
        store.alloc(&Backend::cpu().unwrap()).unwrap();
        weights.load_into(&mut store).unwrap();

        // "a lovely cat</s>" padded to 12, and 200 tokens (distances past 128).
        let mut short = vec![3, 9, 3061, 1712, 1];
        let short_mask: Vec<f32> = (0..12).map(|i| if i < short.len() { 0.0 } else { f32::NEG_INFINITY }).collect();
        short.resize(12, 0);
        let long: Vec<i32> = (0..200).map(|i| (i * 7919 + 13) % 32128).collect();
        let mask_json = |m: &[f32]| m.iter().map(|&v| if v == 0.0 { 1 } else { 0 }).collect::<Vec<i32>>();
        let want = numpy_reference(
            &python,
            &path,
            &json!([
                {"name": "short", "tokens": short},
                {"name": "short_masked", "tokens": short, "mask": mask_json(&short_mask)},
                {"name": "long", "tokens": long},
            ]),
        );
        let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), 2);
        let y = encode(&mut runner, &model, &short, None).unwrap();
        assert_eq!(y.shape(), &[4096, 12, 1]);
        let masked = encode(&mut runner, &model, &short, Some(&short_mask)).unwrap();
        let y_long = encode(&mut runner, &model, &long, None).unwrap();
        // f16 activations (inputs of the f16 matrix products, GELU's table) round in both
        // models, but values that differ in the last f32 bits upstream round to different
        // f16 neighbours: the outputs differ by about 5e-4 on average, so that is the bar.
        for (what, got, want) in [("short", &y, &want[0]), ("short_masked", &masked, &want[1]), ("long", &y_long, &want[2])] {
            assert!(got.data().iter().all(|v| v.is_finite()), "{what}: non-finite output");
            let (max_err, mean_err) = errors(got.data(), want);
            eprintln!("{what}: max |err| / max |ref| = {max_err:.2e}, mean |err| / rms(ref) = {mean_err:.2e}");
            assert!(max_err < 5e-3 && mean_err < 1.5e-3, "{what}: errors {max_err} (max), {mean_err} (mean)");
        }
        // The mask changes every token's state (the unmasked tokens see fewer keys).
        let (diff, _) = errors(&masked.data()[..4096 * 5], &want[0][..4096 * 5]);
        assert!(diff > 0.1, "mask had no effect ({diff})");

        assert!(encode(&mut runner, &model, &[32128], None).is_err());
        assert!(encode(&mut runner, &model, &[], None).is_err());
        assert!(encode(&mut runner, &model, &short, Some(&short_mask[..3])).is_err());
    }
}

