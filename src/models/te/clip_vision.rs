//! The CLIP vision transformer (the reference's `CLIPVisionModelProjection`): Wan2.1 I2V and
//! FLF2V read its hidden states of the init (and end) image; IP-Adapter and PhotoMaker use
//! the same tower.
//!
//! The image is preprocessed on the host like the reference's `clip_preprocess` (scaled by
//! nearest neighbour to cover the square input, centre-cropped, clamped, normalised with
//! CLIP's mean and deviation). In the graph, a 14×14 strided convolution makes one token
//! per patch; the class embedding goes in front, the position embedding is added, then a
//! pre-layernorm and the encoder layers (the text tower's [`ClipLayer`], no mask). The hidden
//! states the reference returns are those of the last layer run, *before* the
//! post-layernorm; the pooled output is the post-normed class token through
//! `visual_projection`.
//!
//! Weights use the reference's internal names under [`CLIP_VISION_PREFIX`]:
//! `vision_model.embeddings.{patch_embedding.weight, class_embedding,
//! position_embedding.weight}`, `vision_model.pre_layernorm`, `vision_model.encoder.layers.N.*`,
//! `vision_model.post_layernorm`, `visual_projection.weight`. A `clip_vision_path` file in
//! Hugging Face naming (`vision_model.pre_layrnorm.*`, as Comfy's `clip_vision_h.safetensors`)
//! lands there through `io::names`.
//!
//! The reference fixes the OpenCLIP ViT-H/14 sizes; here they are read from the weights
//! ([`ClipVisionConfig::detect`]), which gives the same tower for a ViT-H file and also
//! takes the OpenAI ViT-L/14 of IP-Adapter / PhotoMaker. The head count is 16 for every
//! version, as in the reference.

use super::clip::{layers_to_run, uses_gelu, ClipLayer};
use crate::error::{Context as _, Result};
use crate::graph::nn::{Conv2d, LayerNorm, Linear};
use crate::graph::{Graph, Runner, Scope, TypeMap, F32, T, W};
use crate::tensor::Tensor;

/// Where a `clip_vision_path` file's tensors land (`clip_vision.` → this, as in the reference).
pub const CLIP_VISION_PREFIX: &str = "cond_stage_model.transformer.";

/// The reference gives every CLIP vision tower 16 heads.
const N_HEAD: i64 = 16;

#[derive(Clone, Debug, PartialEq)]
pub struct ClipVisionConfig {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub n_head: i64,
    pub n_layer: i32,
    pub num_channels: i64,
    pub patch_size: i64,
    /// Side of the square input in pixels.
    pub image_size: i64,
    /// Width of the pooled output (`visual_projection`); `None` when the file has none.
    pub projection_dim: Option<i64>,
    /// tanh GELU instead of quick GELU (the reference decides by width alone).
    pub gelu: bool,
    /// Fused q/k/v projection (`self_attn.in_proj`).
    pub proj_in: bool,
}

impl ClipVisionConfig {
    /// OpenCLIP ViT-H/14, the tower the reference builds for `clip_vision_path`.
    pub fn vit_h14() -> ClipVisionConfig {
        Self::sized(1280, 5120, 32, 1024)
    }

    /// OpenAI ViT-L/14 (IP-Adapter, PhotoMaker).
    pub fn vit_l14() -> ClipVisionConfig {
        Self::sized(1024, 4096, 24, 768)
    }

    fn sized(hidden_size: i64, intermediate_size: i64, n_layer: i32, projection_dim: i64) -> ClipVisionConfig {
        ClipVisionConfig {
            hidden_size,
            intermediate_size,
            n_head: N_HEAD,
            n_layer,
            num_channels: 3,
            patch_size: 14,
            image_size: 224,
            projection_dim: Some(projection_dim),
            gelu: uses_gelu(hidden_size),
            proj_in: false,
        }
    }

    /// Patches per side.
    pub fn grid(&self) -> i64 {
        self.image_size / self.patch_size
    }

    /// Tokens of the hidden states: the class token and one per patch (257 for ViT-*/14).
    pub fn num_positions(&self) -> i64 {
        self.grid() * self.grid() + 1
    }

    /// How many encoder layers run for `clip_skip` (the reference's count: -2 runs them all).
    pub fn layers_to_run(&self, clip_skip: i32) -> i32 {
        layers_to_run(self.n_layer, clip_skip)
    }

    /// The tower under `prefix` ([`CLIP_VISION_PREFIX`]), sizes from the weights' shapes
    /// (ggml order from `shape_of`), or `None` when the files hold no vision tower.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Option<ClipVisionConfig> {
        let vision = format!("{prefix}vision_model.");
        let mut cfg = ClipVisionConfig::vit_h14();
        let mut layers = None;
        let mut any = false;
        for name in types.keys() {
            if let Some(rest) = name.strip_prefix(&vision) {
                any = true;
                if let Some(i) = rest.strip_prefix("encoder.layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<i32>().ok()) {
                    layers = Some(layers.unwrap_or(0).max(i.saturating_add(1)));
                }
                cfg.proj_in |= rest.contains("self_attn.in_proj");
            }
        }
        if !any {
            return None;
        }
        let shape = |leaf: &str| shape_of(&format!("{vision}{leaf}")).unwrap_or_default();
        if let [d] = shape("embeddings.class_embedding")[..] {
            cfg.hidden_size = d;
        }
        if let [pw, _, c, _] = shape("embeddings.patch_embedding.weight")[..] {
            (cfg.patch_size, cfg.num_channels) = (pw, c);
        }
        if let [_, n] = shape("embeddings.position_embedding.weight")[..] {
            // n = side² + 1; a count that is no square + 1 is refused by `validate`.
            let side = ((n - 1).max(0) as f64).sqrt().round() as i64;
            cfg.image_size = if side * side + 1 == n { side * cfg.patch_size } else { -1 };
        }
        if let [_, ff] = shape("encoder.layers.0.mlp.fc1.weight")[..] {
            cfg.intermediate_size = ff;
        }
        if let Some(n) = layers {
            cfg.n_layer = n;
        }
        cfg.projection_dim = match shape_of(&format!("{prefix}visual_projection.weight")).as_deref() {
            Some([_, p]) => Some(*p),
            _ => None,
        };
        cfg.gelu = uses_gelu(cfg.hidden_size);
        Some(cfg)
    }

    /// Checks what the graph relies on, so a strange file is an error, not an abort.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.n_layer > 0, "the CLIP vision tower has no encoder layers");
        ensure!(
            self.hidden_size > 0 && self.hidden_size % self.n_head == 0,
            "the CLIP vision tower's width {} is not a multiple of its {} heads",
            self.hidden_size,
            self.n_head
        );
        ensure!(self.intermediate_size > 0, "the CLIP vision tower's MLP width {} is unusable", self.intermediate_size);
        ensure!(self.num_channels == 3, "the CLIP vision tower takes {} channels, not RGB", self.num_channels);
        ensure!(
            self.patch_size > 0 && self.image_size > 0 && self.image_size % self.patch_size == 0 && self.image_size <= 4096,
            "the CLIP vision tower's position embedding does not fit a square grid of {}-pixel patches",
            self.patch_size
        );
        if let Some(p) = self.projection_dim {
            ensure!(p > 0, "the CLIP vision tower's visual_projection is empty");
        }
        Ok(())
    }
}

/// The vision tower whose weights live in a `ParamStore`.
pub struct ClipVisionModel {
    pub cfg: ClipVisionConfig,
    patch_embedding: Conv2d,
    class_embedding: W,
    position_embedding: W,
    pre_layernorm: LayerNorm,
    layers: Vec<ClipLayer>,
    post_layernorm: LayerNorm,
    visual_projection: Option<Linear>,
}

impl ClipVisionModel {
    /// Declares every weight under the scope's prefix ([`CLIP_VISION_PREFIX`]) with the
    /// reference's types: f16 patch kernel, f32 class and position embeddings and norms,
    /// the files' types for the linear layers.
    pub fn new(s: &mut Scope, cfg: &ClipVisionConfig) -> ClipVisionModel {
        let d = cfg.hidden_size;
        let (patch_embedding, class_embedding, position_embedding, pre_layernorm, layers, post_layernorm) = {
            let mut v = s.sub("vision_model");
            let (patch, class, pos) = {
                let mut e = v.sub("embeddings");
                let p = cfg.patch_size;
                let patch = Conv2d::new(&mut e, "patch_embedding", cfg.num_channels, d, (p, p), (p as i32, p as i32), (0, 0), false);
                let class = e.tensor("class_embedding", F32, &[d]);
                let pos = e.tensor("position_embedding.weight", F32, &[d, cfg.num_positions()]);
                (patch, class, pos)
            };
            let pre = LayerNorm::new(&mut v, "pre_layernorm", d, 1e-5, true, true);
            let layers = {
                let mut enc = v.sub("encoder");
                (0..cfg.n_layer)
                    .map(|i| ClipLayer::new(&mut enc.sub(&format!("layers.{i}")), d, cfg.n_head, cfg.intermediate_size, cfg.proj_in, cfg.gelu))
                    .collect()
            };
            let post = LayerNorm::new(&mut v, "post_layernorm", d, 1e-5, true, true);
            (patch, class, pos, pre, layers, post)
        };
        // Applied as `mul_mat(P, x)` like the reference's CLIPProjection (the file's
        // [proj, hidden] torch layout is ggml's [hidden, proj]).
        let visual_projection = cfg.projection_dim.map(|p| Linear::new(s, "visual_projection", d, p, false));
        ClipVisionModel {
            cfg: cfg.clone(),
            patch_embedding,
            class_embedding,
            position_embedding,
            pre_layernorm,
            layers,
            post_layernorm,
            visual_projection,
        }
    }

    /// `pixels`: preprocessed images `[S, S, 3, N]`. Returns the hidden states
    /// `[hidden, positions, N]` after [`ClipVisionConfig::layers_to_run`]`(clip_skip)`
    /// layers (no post-layernorm), or with `pooled` the projected class token `[proj, N]`
    /// (the hidden class token when the file has no projection).
    pub fn forward<'g>(&self, g: &'g Graph, pixels: T<'g>, clip_skip: i32, pooled: bool) -> T<'g> {
        let cfg = &self.cfg;
        let (d, n_pos) = (cfg.hidden_size, cfg.num_positions());
        let n_patch = n_pos - 1;
        let n = pixels.ne()[3];
        // [grid, grid, d, N] → one row of d per patch, class token in front, as the
        // reference's concat over a unit leading dimension lays them out.
        let patches = self.patch_embedding.forward(g, pixels).reshape(&[n_patch, d, n]).permute(1, 0, 2, 3).cont().reshape(&[1, d, n_patch, n]);
        let class = g.param(self.class_embedding).repeat(g.new_tensor(F32, &[d, n])).reshape(&[1, d, 1, n]);
        let x = class.concat(patches, 2).reshape(&[d, n_pos, n]).add(g.param(self.position_embedding));
        let mut x = g.mark_cut(self.pre_layernorm.forward(g, x), "clip_vision.prelude");
        let n_run = cfg.layers_to_run(clip_skip) as usize;
        for (i, layer) in self.layers.iter().enumerate().take(n_run) {
            x = g.mark_cut(layer.forward(g, x, None), &format!("clip_vision.layers.{i}"));
        }
        if !pooled {
            return x;
        }
        let x = self.post_layernorm.forward(g, x);
        let class = x.view(&[d, n], &[x.nb()[2]], 0).cont();
        match &self.visual_projection {
            Some(p) => p.forward(g, class),
            None => class,
        }
    }
}

/// Preprocesses an image `[W, H, 3, 1]` (RGB in [0, 1]) for the tower: the reference's
/// `clip_preprocess` to `image_size`² (the same arithmetic the Qwen vision tower's input gets).
pub fn preprocess(cfg: &ClipVisionConfig, image: &Tensor) -> Result<Tensor> {
    ensure!(
        image.shape().len() <= 4 && image.ne(0) > 0 && image.ne(1) > 0 && image.ne(2) == 3 && image.ne(3) == 1,
        "cannot prepare an image of shape {:?} for the CLIP vision tower (expected [W, H, 3, 1])",
        image.shape()
    );
    let s = cfg.image_size as usize;
    super::qwen_vision::preprocess(image, s, s)
}

fn check_pixels(cfg: &ClipVisionConfig, pixels: &Tensor) -> Result<()> {
    let s = cfg.image_size as usize;
    ensure!(
        pixels.shape().len() <= 4 && pixels.ne(0) == s && pixels.ne(1) == s && pixels.ne(2) == cfg.num_channels as usize && pixels.ne(3) == 1,
        "CLIP vision input has shape {:?}, expected [{s}, {s}, {}, 1]",
        pixels.shape(),
        cfg.num_channels
    );
    Ok(())
}

/// Hidden states `[hidden, positions, 1]` of preprocessed `pixels` ([`preprocess`]) after
/// the layers `clip_skip` selects (the reference's `return_pooled = false`).
pub fn encode(runner: &mut Runner, model: &ClipVisionModel, pixels: &Tensor, clip_skip: i32) -> Result<Tensor> {
    let cfg = &model.cfg;
    check_pixels(cfg, pixels)?;
    let out = runner.compute(|g| Ok(model.forward(g, g.input(pixels), clip_skip, false))).context("clip_vision compute failed")?;
    out.reshape(&[cfg.hidden_size as usize, cfg.num_positions() as usize, 1])
}

/// The pooled, projected vector `[proj]` of preprocessed `pixels` (the reference's
/// `return_pooled = true`, used by IP-Adapter).
pub fn encode_pooled(runner: &mut Runner, model: &ClipVisionModel, pixels: &Tensor, clip_skip: i32) -> Result<Tensor> {
    let cfg = &model.cfg;
    check_pixels(cfg, pixels)?;
    let Some(p) = cfg.projection_dim else {
        bail!("the CLIP vision file has no visual_projection.weight: its pooled output is unavailable");
    };
    let out = runner.compute(|g| Ok(model.forward(g, g.input(pixels), clip_skip, true))).context("clip_vision compute failed")?;
    out.reshape(&[p as usize])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, Loaded, Module, ParamStore, Placement, F16};
    use std::collections::HashMap;
    use std::sync::Arc;

    /// The names, types and shapes `cfg` declares, as files holding that tower would list them.
    fn declared(cfg: &ClipVisionConfig) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut store = ParamStore::new(1024).unwrap();
        ClipVisionModel::new(&mut Scope::new(&mut store, &TypeMap::new(), CLIP_VISION_PREFIX), cfg);
        let types = store.entries().map(|(n, w)| (n.to_string(), w.ty())).collect();
        let shapes = store.entries().map(|(n, w)| (n.to_string(), ParamStore::spec(w).ne)).collect();
        (types, shapes)
    }

    fn detect(types: &TypeMap, shapes: &HashMap<String, Vec<i64>>) -> Option<ClipVisionConfig> {
        ClipVisionConfig::detect(types, &|n| shapes.get(n).cloned(), CLIP_VISION_PREFIX)
    }

    #[test]
    fn config_is_read_back_from_the_weights() {
        let h = ClipVisionConfig::vit_h14();
        assert_eq!((h.num_positions(), h.grid(), h.hidden_size / h.n_head), (257, 16, 80));
        assert!(h.gelu && ClipVisionConfig::vit_l14().gelu, "the reference's width rule gives both tanh GELU");
        let (types, shapes) = declared(&h);
        assert_eq!(types.len(), 520);
        assert_eq!(detect(&types, &shapes), Some(h.clone()));
        let l = ClipVisionConfig { proj_in: true, projection_dim: None, ..ClipVisionConfig::vit_l14() };
        let (types, shapes) = declared(&l);
        assert!(types.keys().all(|n| !n.contains("visual_projection")));
        assert_eq!(detect(&types, &shapes), Some(l));
        // A small tower: quick GELU, 42-pixel input.
        let tiny = ClipVisionConfig { hidden_size: 64, intermediate_size: 32, n_layer: 3, image_size: 42, projection_dim: Some(8), gelu: false, ..ClipVisionConfig::vit_h14() };
        let (types, shapes) = declared(&tiny);
        assert_eq!(detect(&types, &shapes), Some(tiny));
        // No tower, and position embeddings that are no square grid.
        assert_eq!(detect(&TypeMap::new(), &HashMap::new()), None);
        let (mut types, mut shapes) = declared(&h);
        let pos = format!("{CLIP_VISION_PREFIX}vision_model.embeddings.position_embedding.weight");
        shapes.insert(pos.clone(), vec![1280, 200]);
        types.insert("unrelated.weight".into(), F16);
        let bad = detect(&types, &shapes).unwrap();
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("square grid"), "{err}");
        assert!(ClipVisionConfig { hidden_size: 1000, ..h.clone() }.validate().is_err());
        assert!(ClipVisionConfig { num_channels: 4, ..h }.validate().is_err());
    }

    #[test]
    fn clip_skip_counts_like_the_reference() {
        let h = ClipVisionConfig::vit_h14();
        // -2 (Wan) and every skip <= 0 run all 32 layers; IP-Adapter plus's 2 runs 31.
        assert_eq!([-2, -1, 0, 1, 2, 32, 33, 34].map(|s| h.layers_to_run(s)), [32, 32, 32, 32, 31, 1, 0, 32]);
    }

    /// A 3×2 picture scaled ×112 to 336×224 and cropped to its middle 224 columns: source
    /// column 0 for x < 56, 1 for 56..168, 2 from 168; row 0 above y = 112, row 1 below.
    #[test]
    fn preprocess_by_hand() {
        let cfg = ClipVisionConfig::vit_h14();
        #[rustfmt::skip]
        let planes = vec![
            0.0, 0.5, 1.0,   0.25, 0.75, 2.0,      // R: rows 0 and 1 (2.0 is clamped to 1)
            0.1, 0.2, 0.3,   0.4, 0.5, 0.6,        // G
            -1.0, 0.0, 0.9,  1.0, 1.0, 1.0,        // B (-1 is clamped to 0)
        ];
        let img = Tensor::from_vec(&[3, 2, 3, 1], planes).unwrap();
        let t = preprocess(&cfg, &img).unwrap();
        assert_eq!(t.shape(), &[224, 224, 3, 1]);
        let at = |x: usize, y: usize, c: usize| t.data()[(c * 224 + y) * 224 + x];
        let norm = |v: f32, c: usize| (v - [0.481_454_66f32, 0.457_827_5, 0.408_210_73][c]) / [0.268_629_54f32, 0.261_302_6, 0.275_777_1][c];
        assert_eq!(at(0, 0, 0), norm(0.0, 0));
        assert_eq!(at(55, 111, 0), norm(0.0, 0));
        assert_eq!(at(56, 0, 0), norm(0.5, 0));
        assert_eq!(at(167, 0, 0), norm(0.5, 0));
        assert_eq!(at(168, 0, 0), norm(1.0, 0));
        assert_eq!(at(223, 112, 0), norm(1.0, 0));
        assert_eq!(at(100, 112, 0), norm(0.75, 0));
        assert_eq!(at(0, 223, 1), norm(0.4, 1));
        assert_eq!(at(0, 0, 2), norm(0.0, 2));
        assert_eq!(at(200, 0, 2), norm(0.9, 2));
        assert_eq!(at(200, 200, 2), norm(1.0, 2));
        assert!(preprocess(&cfg, &Tensor::zeros(&[4, 4, 4, 1])).is_err());
        assert!(preprocess(&cfg, &Tensor::zeros(&[0, 4, 3, 1])).is_err());
    }

    /// Deterministic values in [-0.5, 0.5) from a name and an index.
    fn value(name: &str, i: usize) -> f32 {
        let mut h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        h = (h ^ i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((h >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    fn tiny_tower(cfg: &ClipVisionConfig) -> Loaded<ClipVisionModel> {
        let mut store = ParamStore::new(256).unwrap();
        let model = ClipVisionModel::new(&mut Scope::new(&mut store, &TypeMap::new(), CLIP_VISION_PREFIX), cfg);
        let backend = Arc::new(Backend::cpu().unwrap());
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let norm = name.contains("norm") && !name.ends_with("bias");
                let v: Vec<f32> = (0..n).map(|i| if norm { 1.0 + 0.1 * value(name, i) } else { value(name, i) / 4.0 }).collect();
                let bytes: Vec<u8> = if spec.ty == F16 {
                    v.iter().flat_map(|&x| crate::testutil::f32_to_f16(x).to_le_bytes()).collect()
                } else {
                    v.iter().flat_map(|x| x.to_le_bytes()).collect()
                };
                dst.copy_from_slice(&bytes);
                Ok(())
            })
            .unwrap();
        let place = Placement::on(Module::ClipVision, backend.clone());
        Loaded::new(model, store, place, crate::graph::Runner::new(backend, 1), None, "clip_vision")
    }

    /// The layer count follows clip_skip; the pooled output is the projected class token of
    /// the same layers.
    #[test]
    fn tiny_tower_outputs() {
        let cfg = ClipVisionConfig { hidden_size: 64, intermediate_size: 32, n_layer: 3, image_size: 28, projection_dim: Some(8), gelu: false, ..ClipVisionConfig::vit_h14() };
        let mut tower = tiny_tower(&cfg);
        let (model, runner) = tower.parts();
        let img = Tensor::from_vec(&[40, 30, 3, 1], (0..3600).map(|i| value("image", i) + 0.5).collect()).unwrap();
        let px = preprocess(&cfg, &img).unwrap();
        let all = encode(runner, model, &px, -2).unwrap();
        assert_eq!(all.shape(), &[64, 5, 1]);
        assert!(all.data().iter().all(|v| v.is_finite()));
        assert_eq!(encode(runner, model, &px, 0).unwrap(), all);
        assert_eq!(encode(runner, model, &px, 1).unwrap(), all);
        let two = encode(runner, model, &px, 2).unwrap();
        let none = encode(runner, model, &px, 4).unwrap();
        assert_ne!(two, all);
        assert_ne!(none, two, "a skip of n_layer + 1 runs no layer");
        assert_eq!(encode(runner, model, &px, 5).unwrap(), all, "a larger one runs them all");
        let pooled = encode_pooled(runner, model, &px, -1).unwrap();
        assert_eq!(pooled.shape(), &[8]);
        assert_ne!(pooled, encode_pooled(runner, model, &px, 2).unwrap());
        assert!(encode(runner, model, &img, -2).is_err(), "unprocessed pixels are refused");
    }
}
