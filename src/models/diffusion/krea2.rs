//! Krea2: a single-stream DiT on the Wan2.1 VAE's latents, conditioned by twelve layers of
//! Qwen3-VL's text model, like the reference's `krea2.hpp`.
//!
//! - Weights under `model.diffusion_model.` (diffusers names are mapped by `io::names`):
//!   `first` (2×2 patches → hidden), `tmlp.{0,2}` (timestep MLP), `tproj.1` (the six shared
//!   modulation vectors), `txtfusion` (text fusion: two blocks across the LLM's layers of each
//!   token, a linear `projector` mixing the layers into one, two blocks across the tokens),
//!   `txtmlp.{0,1,3}`, `blocks.N` and `last`.
//! - Every norm is an RMS norm whose `scale` is stored minus one. Attention has per-head q/k
//!   norms, grouped key/value heads and a sigmoid gate from the block's input; the MLPs are
//!   SwiGLU of width `⌈(2·d/3)·4⌉₁₂₈`.
//! - Each block adds its own `mod.lin` offsets to the shared modulation (scale, shift, gate of
//!   the attention, then of the MLP). The text tokens come first, then the image, then the
//!   reference latents; 3-axis RoPE (θ 1000) over Flux's ids (text all zero, references
//!   numbered from 1). In the reference's `force_ref_timestep_zero` mode the reference tokens
//!   are modulated for timestep 0.
//! - The reference reads the text fusion's heads with the same rule as the blocks', and the
//!   blocks' rule sees the text fusion's names too: the text fusion always has 20 heads and
//!   the blocks' head width is whichever q-norm the reference reads last. Both are 128 wide
//!   in the released model; [`Krea2Config::detect`] takes the blocks' own q-norm and the 20
//!   text heads.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{chunk, pad_and_patchify, timestep_embedding, unpatchify_and_crop};
use crate::models::common::rope;
use crate::tensor::Tensor;

/// Heads of the text fusion's attention: the reference never reads them from the weights.
pub const TEXT_HEADS: i64 = 20;

#[derive(Clone, Debug, PartialEq)]
pub struct Krea2Config {
    pub patch_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub features: i64,
    pub timestep_dim: i64,
    /// Width of one LLM layer's hidden states.
    pub text_dim: i64,
    /// LLM layers side by side in the context.
    pub text_layers: i64,
    pub layers: usize,
    pub heads: i64,
    pub kv_heads: i64,
    pub text_heads: i64,
    pub text_kv_heads: i64,
    pub mlp_multiplier: i64,
    pub theta: f32,
    pub eps: f32,
    pub axes_dim: Vec<usize>,
}

impl Krea2Config {
    /// The configuration under `prefix`, read from the weights like the reference (what is
    /// missing keeps the released model's value: 28 blocks of 6144, 48 heads, 12 kv heads).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Krea2Config {
        let mut cfg = Krea2Config {
            patch_size: 2,
            in_channels: 16,
            out_channels: 16,
            features: 6144,
            timestep_dim: 256,
            text_dim: 2560,
            text_layers: 12,
            layers: 28,
            heads: 48,
            kv_heads: 12,
            text_heads: TEXT_HEADS,
            text_kv_heads: TEXT_HEADS,
            mlp_multiplier: 4,
            theta: 1000.0,
            eps: 1e-5,
            axes_dim: vec![32, 48, 48],
        };
        let shape = |leaf: &str| shape_of(&format!("{prefix}{leaf}"));
        let p2 = cfg.patch_size * cfg.patch_size;
        if let Some(s) = shape("first.weight").filter(|s| s.len() == 2) {
            cfg.in_channels = s[0] / p2;
            cfg.out_channels = cfg.in_channels;
            cfg.features = s[1];
        }
        if let Some(s) = shape("txtfusion.projector.weight").filter(|s| s.len() == 2) {
            cfg.text_layers = s[0];
        }
        if let Some(s) = shape("txtfusion.layerwise_blocks.0.prenorm.scale").filter(|s| s.len() == 1) {
            cfg.text_dim = s[0];
        }
        if let Some(s) = shape("last.linear.weight").filter(|s| s.len() == 2) {
            cfg.out_channels = s[1] / p2;
        }
        let blocks = format!("{prefix}blocks.");
        let layers = types.keys().filter_map(|n| n.strip_prefix(&blocks)?.split('.').next()?.parse::<usize>().ok()).max();
        cfg.layers = layers.map_or(1, |l| l + 1);
        if let Some(hd) = shape("blocks.0.attn.qknorm.qnorm.scale").and_then(|s| s.first().copied()).filter(|&d| d > 0) {
            cfg.heads = cfg.features / hd;
            if let Some(s) = shape("blocks.0.attn.wk.weight").filter(|s| s.len() == 2) {
                cfg.kv_heads = s[1] / hd;
            }
        }
        let hd = cfg.head_dim();
        let unit = hd / 16;
        cfg.axes_dim = vec![(hd - 12 * unit) as usize, (6 * unit) as usize, (6 * unit) as usize];
        sd_debug!(
            "krea2: layers={}, features={}, heads={}, kv_heads={}, text_dim={}, text_layers={}, text_heads={}, text_kv_heads={}, channels={}",
            cfg.layers,
            cfg.features,
            cfg.heads,
            cfg.kv_heads,
            cfg.text_dim,
            cfg.text_layers,
            cfg.text_heads,
            cfg.text_kv_heads,
            cfg.in_channels
        );
        cfg
    }

    pub fn head_dim(&self) -> i64 {
        self.features / self.heads.max(1)
    }

    /// Width of the context the transformer takes: `text_layers` LLM layers side by side.
    pub fn context_width(&self) -> i64 {
        self.text_dim * self.text_layers
    }

    /// What the graphs need that the reference asserts while computing.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.heads > 0 && self.features % self.heads == 0, "Krea2: {} heads do not divide the hidden size {}", self.heads, self.features);
        ensure!(
            self.kv_heads > 0 && self.heads % self.kv_heads == 0,
            "Krea2: {} key/value heads do not divide its {} heads",
            self.kv_heads,
            self.heads
        );
        ensure!(self.head_dim() % 2 == 0, "Krea2: heads of {} dimensions cannot be rotated in pairs", self.head_dim());
        ensure!(
            self.text_dim % self.text_heads == 0,
            "Krea2: its text fusion has {} heads (fixed, as in stable-diffusion.cpp), which do not divide the text width {}",
            self.text_heads,
            self.text_dim
        );
        ensure!(self.text_layers > 0, "Krea2: a text projector over {} layers", self.text_layers);
        ensure!(
            self.out_channels == self.in_channels,
            "Krea2 with {} input and {} output channels",
            self.in_channels,
            self.out_channels
        );
        Ok(())
    }
}

fn ceil_to_multiple(v: i64, m: i64) -> i64 {
    (v + m - 1) / m * m
}

/// RMS norm whose stored `scale` is one less than the factor applied.
#[derive(Clone, Copy, Debug)]
struct KreaNorm {
    scale: W,
    eps: f32,
}

impl KreaNorm {
    fn new(s: &mut Scope, name: &str, dim: i64, eps: f32) -> KreaNorm {
        KreaNorm { scale: s.sub(name).tensor("scale", F32, &[dim]), eps }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        // Not adapted at runtime: the reference's runtime LoRA asks for `<name>.weight` of these
        // raw parameters (the norm scales and the modulation offsets), which no LoRA names;
        // merged LoRAs reach them at load like every weight.
        let factor = g.param(self.scale).scale_bias(1.0, 1.0);
        x.rms_norm(self.eps).mul_inplace(factor)
    }
}

/// `down(silu(gate(x)) · up(x))`.
#[derive(Clone, Copy, Debug)]
struct SwiGlu {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl SwiGlu {
    fn new(s: &mut Scope, features: i64, multiplier: i64) -> SwiGlu {
        let hidden = ceil_to_multiple((2 * features / 3) * multiplier, 128);
        SwiGlu {
            gate: Linear::new(s, "gate", features, hidden, false),
            up: Linear::new(s, "up", features, hidden, false),
            down: Linear::new(s, "down", hidden, features, false),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let gated = self.gate.forward(g, x).silu();
        self.down.forward(g, gated.mul(self.up.forward(g, x)))
    }
}

/// Attention with per-head q/k norms, grouped key/value heads and a sigmoid output gate.
#[derive(Clone, Copy, Debug)]
struct Attention {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    gate: Linear,
    qnorm: KreaNorm,
    knorm: KreaNorm,
    wo: Linear,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(s: &mut Scope, features: i64, heads: i64, kv_heads: i64, eps: f32) -> Attention {
        let head_dim = features / heads;
        let mut qk = s.sub("qknorm");
        let (qnorm, knorm) = (KreaNorm::new(&mut qk, "qnorm", head_dim, eps), KreaNorm::new(&mut qk, "knorm", head_dim, eps));
        Attention {
            wq: Linear::new(s, "wq", features, heads * head_dim, false),
            wk: Linear::new(s, "wk", features, kv_heads * head_dim, false),
            wv: Linear::new(s, "wv", features, kv_heads * head_dim, false),
            gate: Linear::new(s, "gate", features, features, false),
            qnorm,
            knorm,
            wo: Linear::new(s, "wo", features, features, false),
            heads,
            kv_heads,
            head_dim,
        }
    }

    /// x: `[features, L, N]`; rotated by `pe` when given (the blocks), else plain (the text
    /// fusion).
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: Option<T<'g>>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let d = self.head_dim;
        let q = self.qnorm.forward(g, self.wq.forward(g, x).reshape(&[d, self.heads, l, n]));
        let k = self.knorm.forward(g, self.wk.forward(g, x).reshape(&[d, self.kv_heads, l, n]));
        let v = self.wv.forward(g, x).reshape(&[d, self.kv_heads, l, n]);
        let out = match pe {
            Some(pe) => rope::attention(g, q, k, v, pe, None),
            None => {
                let q = q.cont().reshape(&[d * self.heads, l, n]);
                let k = k.cont().reshape(&[d * self.kv_heads, l, n]);
                let v = v.cont().reshape(&[d * self.kv_heads, l, n]);
                nn::attention(g, q, k, v, self.heads, None, false, g.options.flash_attn, 1.0)
            }
        };
        let out = out.mul(self.gate.forward(g, x).sigmoid());
        self.wo.forward(g, out)
    }
}

/// A text fusion block: attention then SwiGLU, each after its own norm, no modulation.
#[derive(Clone, Copy, Debug)]
struct TextFusionBlock {
    prenorm: KreaNorm,
    postnorm: KreaNorm,
    attn: Attention,
    mlp: SwiGlu,
}

impl TextFusionBlock {
    fn new(s: &mut Scope, cfg: &Krea2Config) -> TextFusionBlock {
        let (dim, eps) = (cfg.text_dim, cfg.eps);
        TextFusionBlock {
            prenorm: KreaNorm::new(s, "prenorm", dim, eps),
            postnorm: KreaNorm::new(s, "postnorm", dim, eps),
            attn: Attention::new(&mut s.sub("attn"), dim, cfg.text_heads, cfg.text_kv_heads, eps),
            mlp: SwiGlu::new(&mut s.sub("mlp"), dim, cfg.mlp_multiplier),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = x.add(self.attn.forward(g, self.prenorm.forward(g, x), None));
        x.add(self.mlp.forward(g, self.postnorm.forward(g, x)))
    }
}

/// Scale, shift, gate of the attention, then of the MLP: each `[features, 1, N]`.
type Mods<'g> = Vec<T<'g>>;

/// `x + x·scale + shift` with `[features, 1, N]` vectors broadcast over the tokens.
fn modulate<'g>(x: T<'g>, scale: T<'g>, shift: T<'g>) -> T<'g> {
    x.add(x.mul(scale)).add(shift)
}

/// A single-stream block over text, image and reference tokens.
#[derive(Clone, Copy, Debug)]
struct Block {
    mod_lin: W,
    prenorm: KreaNorm,
    postnorm: KreaNorm,
    attn: Attention,
    mlp: SwiGlu,
}

impl Block {
    fn new(s: &mut Scope, cfg: &Krea2Config) -> Block {
        let (f, eps) = (cfg.features, cfg.eps);
        Block {
            mod_lin: s.sub("mod").tensor("lin", F32, &[6 * f]),
            prenorm: KreaNorm::new(s, "prenorm", f, eps),
            postnorm: KreaNorm::new(s, "postnorm", f, eps),
            attn: Attention::new(&mut s.sub("attn"), f, cfg.heads, cfg.kv_heads, eps),
            mlp: SwiGlu::new(&mut s.sub("mlp"), f, cfg.mlp_multiplier),
        }
    }

    /// The block's modulation for the shared vectors `vec` `[6·features, 1, N]`.
    fn mods<'g>(&self, g: &'g Graph, vec: T<'g>) -> Mods<'g> {
        let lin = g.param(self.mod_lin).repeat(vec); // not adapted at runtime (see KreaNorm)
        chunk(vec.add(lin), 6, 0, true)
    }

    /// `refs`: the reference tokens from `ref_start` on and their own vectors (timestep 0).
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, vec: T<'g>, pe: T<'g>, refs: Option<(T<'g>, i64)>) -> T<'g> {
        let m = self.mods(g, vec);
        let Some((ref_vec, ref_start)) = refs else {
            let h = modulate(self.prenorm.forward(g, x), m[0], m[1]);
            let x = x.add(self.attn.forward(g, h, Some(pe)).mul(m[2]));
            let h = modulate(self.postnorm.forward(g, x), m[3], m[4]);
            return x.add(self.mlp.forward(g, h).mul(m[5]));
        };
        let r = self.mods(g, ref_vec);
        let [d, l, n, _] = x.ne();
        // The tokens before `ref_start` and from it, as views of `t`.
        let split = |t: T<'g>| {
            let nb = t.nb();
            (t.view(&[d, ref_start, n], &[nb[1], nb[2]], 0), t.view(&[d, l - ref_start, n], &[nb[1], nb[2]], ref_start as usize * nb[1]))
        };
        let (main, rest) = split(self.prenorm.forward(g, x));
        let h = modulate(main, m[0], m[1]).concat(modulate(rest, r[0], r[1]), 1);
        let (main, rest) = split(self.attn.forward(g, h, Some(pe)));
        let x = x.add(main.mul(m[2]).concat(rest.mul(r[2]), 1));
        let (main, rest) = split(self.postnorm.forward(g, x));
        let h = modulate(main, m[3], m[4]).concat(modulate(rest, r[3], r[4]), 1);
        let (main, rest) = split(self.mlp.forward(g, h));
        x.add(main.mul(m[5]).concat(rest.mul(r[5]), 1))
    }
}

/// The reference latents of an evaluation, and whether their tokens are modulated for
/// timestep 0 (`force_ref_timestep_zero`) instead of the step's.
#[derive(Clone, Copy)]
pub struct RefTokens<'a, 'g> {
    pub latents: &'a [T<'g>],
    pub at_zero: bool,
}

/// A Krea2 transformer whose weights live in a `ParamStore`.
pub struct Krea2Model {
    pub config: Krea2Config,
    first: Linear,
    tmlp_0: Linear,
    tmlp_2: Linear,
    tproj: Linear,
    layerwise: [TextFusionBlock; 2],
    refiner: [TextFusionBlock; 2],
    projector: Linear,
    txt_norm: KreaNorm,
    txt_1: Linear,
    txt_3: Linear,
    blocks: Vec<Block>,
    last_norm: KreaNorm,
    last_linear: Linear,
    last_mod: W,
}

impl Krea2Model {
    pub fn new(s: &mut Scope, cfg: &Krea2Config) -> Krea2Model {
        let (f, p) = (cfg.features, cfg.patch_size);
        let first = Linear::new(s, "first", p * p * cfg.in_channels, f, true);
        let tmlp_0 = Linear::new(s, "tmlp.0", cfg.timestep_dim, f, true);
        let tmlp_2 = Linear::new(s, "tmlp.2", f, f, true);
        let tproj = Linear::new(s, "tproj.1", f, 6 * f, true);
        let mut tf = s.sub("txtfusion");
        let fusion = |tf: &mut Scope, kind: &str, i: usize| TextFusionBlock::new(&mut tf.sub(&format!("{kind}.{i}")), cfg);
        let layerwise = [fusion(&mut tf, "layerwise_blocks", 0), fusion(&mut tf, "layerwise_blocks", 1)];
        let refiner = [fusion(&mut tf, "refiner_blocks", 0), fusion(&mut tf, "refiner_blocks", 1)];
        let projector = Linear::new(&mut tf, "projector", cfg.text_layers, 1, false);
        let mut tm = s.sub("txtmlp");
        let txt_norm = KreaNorm::new(&mut tm, "0", cfg.text_dim, cfg.eps);
        let txt_1 = Linear::new(&mut tm, "1", cfg.text_dim, f, true);
        let txt_3 = Linear::new(&mut tm, "3", f, f, true);
        let blocks = (0..cfg.layers).map(|i| Block::new(&mut s.sub(&format!("blocks.{i}")), cfg)).collect();
        let mut last = s.sub("last");
        let last_norm = KreaNorm::new(&mut last, "norm", f, cfg.eps);
        let last_linear = Linear::new(&mut last, "linear", f, p * p * cfg.out_channels, true);
        let last_mod = last.sub("modulation").tensor("lin", F32, &[f, 2]);
        Krea2Model {
            config: cfg.clone(),
            first,
            tmlp_0,
            tmlp_2,
            tproj,
            layerwise,
            refiner,
            projector,
            txt_norm,
            txt_1,
            txt_3,
            blocks,
            last_norm,
            last_linear,
            last_mod,
        }
    }

    /// The text fusion: `context` `[text_dim·text_layers, L, 1]` → `[text_dim, L, 1]`.
    fn fuse_text<'g>(&self, g: &'g Graph, context: T<'g>) -> T<'g> {
        let cfg = &self.config;
        let [_, tokens, batch, _] = context.ne();
        let mut x = context.reshape(&[cfg.text_dim, cfg.text_layers, tokens * batch]);
        for b in &self.layerwise {
            x = b.forward(g, x);
        }
        let x = self.projector.forward(g, x.permute(1, 0, 2, 3).cont());
        let mut x = x.reshape(&[cfg.text_dim, tokens, batch]);
        for b in &self.refiner {
            x = b.forward(g, x);
        }
        x
    }

    /// The timestep MLP's output `[features, 1, N]` and the shared modulation vectors made
    /// from it `[6·features, 1, N]`.
    fn time<'g>(&self, g: &'g Graph, t: T<'g>) -> (T<'g>, T<'g>) {
        let emb = timestep_embedding(t, self.config.timestep_dim as i32, 10000, 1000.0);
        let t = self.tmlp_2.forward(g, self.tmlp_0.forward(g, emb).gelu());
        let t = t.reshape(&[t.ne()[0], 1, t.ne()[1]]);
        (t, self.tproj.forward(g, t.gelu()))
    }

    /// One evaluation: the latent `x` `[W, H, C, 1]`, the model timestep `t` `[1]`, the LLM
    /// `context`, the RoPE table `pe` and the reference latents → `[W, H, C, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, pe: T<'g>, refs: RefTokens<'_, 'g>) -> T<'g> {
        let RefTokens { latents: refs, at_zero: refs_at_zero } = refs;
        let p = self.config.patch_size;
        let [w, h, _, _] = x.ne();
        let mut img = pad_and_patchify(g, x, p, true);
        let img_len = img.ne()[1];
        for r in refs {
            img = img.concat(pad_and_patchify(g, *r, p, true), 1);
        }
        let ref_len = img.ne()[1] - img_len;
        let img = self.first.forward(g, img);

        let (temb, tvec) = self.time(g, t);
        let ref_vec = (!refs.is_empty() && refs_at_zero).then(|| self.time(g, t.scale(0.0)).1);

        let txt = self.fuse_text(g, context);
        let txt = self.txt_3.forward(g, self.txt_1.forward(g, self.txt_norm.forward(g, txt)).gelu_inplace());
        let txt_len = txt.ne()[1];
        let mut x = txt.concat(img, 1);
        let ref_start = x.ne()[1] - ref_len;
        for b in &self.blocks {
            x = b.forward(g, x, tvec, pe, ref_vec.map(|v| (v, ref_start)));
        }

        let [d, _, n, _] = x.ne();
        let nb = x.nb();
        let x = x.view(&[d, img_len, n], &[nb[1], nb[2]], txt_len as usize * nb[1]).cont();
        let m = chunk(g.param(self.last_mod).add(temb), 2, 1, true); // not adapted at runtime (see KreaNorm)
        let x = modulate(self.last_norm.forward(g, x), m[0], m[1]);
        let x = self.last_linear.forward(g, x);
        unpatchify_and_crop(x, h, w, p, true)
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor, refs: &[Tensor]) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.in_channels as usize;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c && x.ne(0) > 0 && x.ne(1) > 0, "Krea2 takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        for r in refs {
            ensure!(r.ne(2) == c && r.ne(3) == 1, "Krea2's reference latents must be [W, H, {c}, 1], got {:?}", r.shape());
        }
        ensure!(
            context.ne(0) as i64 == cfg.context_width() && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "Krea2's text context must be [{}, L, 1] ({} LLM layers of {}), got {:?}",
            cfg.context_width(),
            cfg.text_layers,
            cfg.text_dim,
            context.shape()
        );
        Ok(())
    }
}

/// A loaded Krea2 transformer.
pub type Krea2 = Loaded<Krea2Model>;

impl DiffusionModel for Loaded<Krea2Model> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("Krea2 needs a text context (no LLM produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context, input.ref_latents)?;
        ensure!(input.timesteps.len() == 1, "Krea2 takes one timestep, got {}", input.timesteps.len());
        let cfg = &model.config;
        let p = cfg.patch_size as usize;
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        let refs: Vec<(usize, usize)> = input.ref_latents.iter().map(|r| (r.ne(1), r.ne(0))).collect();
        // The reference's Krea2 numbers references one after the other and never wraps its RoPE.
        let pe = rope::flux_pe(h, w, p, rope::TextIds::zeros(context.ne(1)), &refs, input.ref_index_mode, 1.0, cfg.theta, &cfg.axes_dim, (false, false));
        let axes_sum: usize = cfg.axes_dim.iter().sum();
        let pos_len = pe.len() / axes_sum / 2;
        let t = [input.timesteps[0]];
        runner.compute(|g| {
            let x = g.input(input.x);
            let t = g.input_f32(&t, &[1]);
            let ctx = g.input(context);
            let pe = g.input_f32(&pe, &[2, 2, axes_sum as i64 / 2, pos_len as i64]);
            let refs: Vec<T> = input.ref_latents.iter().map(|r| g.input(r)).collect();
            Ok(model.forward(g, x, t, ctx, pe, RefTokens { latents: &refs, at_zero: input.ref_timestep_zero }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ParamStore;
    use std::collections::HashMap;

    #[test]
    fn config_from_weights() {
        let p = "model.diffusion_model.";
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let mut add = |n: &str, s: &[i64]| {
            types.insert(format!("{p}{n}"), F32);
            shapes.insert(format!("{p}{n}"), s.to_vec());
        };
        add("first.weight", &[64, 64]);
        add("txtfusion.projector.weight", &[12, 1]);
        add("txtfusion.layerwise_blocks.0.prenorm.scale", &[80]);
        add("txtfusion.layerwise_blocks.0.attn.qknorm.qnorm.scale", &[4]);
        add("blocks.0.attn.qknorm.qnorm.scale", &[16]);
        add("blocks.0.attn.wk.weight", &[64, 32]);
        add("blocks.1.attn.wk.weight", &[64, 32]);
        add("last.linear.weight", &[64, 64]);
        let cfg = Krea2Config::detect(&types, &|n| shapes.get(n).cloned(), p);
        assert_eq!((cfg.features, cfg.heads, cfg.kv_heads, cfg.layers, cfg.in_channels), (64, 4, 2, 2, 16));
        assert_eq!((cfg.text_dim, cfg.text_layers, cfg.text_heads, cfg.context_width()), (80, 12, 20, 960));
        assert_eq!(cfg.axes_dim, [4, 6, 6]);
        cfg.validate().unwrap();
        let mut store = ParamStore::new(4096).unwrap();
        Krea2Model::new(&mut Scope::new(&mut store, &types, p), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        for n in ["txtfusion.refiner_blocks.1.mlp.down.weight", "blocks.1.mod.lin", "last.modulation.lin", "txtmlp.0.scale", "tproj.1.bias"] {
            assert!(names.contains(&format!("{p}{n}").as_str()), "{n}");
        }
        // The SwiGLU width: ⌈(2·64/3)·4⌉ to 128.
        assert_eq!(ceil_to_multiple((2 * 64 / 3) * 4, 128), 256);
        let odd = Krea2Config { text_dim: 64, ..cfg };
        assert!(odd.validate().unwrap_err().to_string().contains("20 heads"));
    }
}
