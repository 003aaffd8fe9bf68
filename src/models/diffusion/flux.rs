//! Flux.1 (dev, schnell, Fill, Controls, Flex.2, Kontext through reference latents),
//! Chroma, Chroma1-Radiance, Ovis-Image, Flux.2 and SeFi-Image: the rectified-flow
//! transformer of Black Forest Labs and its relatives, like the reference's `flux.hpp`.
//!
//! - Weights under `model.diffusion_model.` with the original names (`img_in`, `txt_in`,
//!   `time_in`, `vector_in`, `guidance_in`, `double_blocks.N.{img,txt}_{mod,attn,mlp}`,
//!   `single_blocks.N.{linear1,linear2,norm,modulation}`, `final_layer`); Chroma replaces
//!   the modulations by `distilled_guidance_layer` (the approximator) and reads them at
//!   fixed offsets of its output.
//! - The latent `[W, H, C, 1]` is cut into 2×2 patches (plus Fill's masked image and mask,
//!   the control latent, and reference latents appended as extra tokens), text and image
//!   tokens attend jointly with rotary position embeddings, and the output keeps the
//!   latent's own tokens, unpatchified.
//! - The conditioning: `context` (T5 hidden states), `y` (pooled CLIP-L, or Chroma's T5
//!   attention mask), the distilled guidance value (dev), the timestep in [0, 1].
//! - Chroma1-Radiance works on pixels: `img_in_patch` (a strided convolution) makes the
//!   tokens, and instead of `final_layer` a small per-pixel network (`nerf_*`) whose weights
//!   each token generates decodes every patch from its pixels and a DCT position code.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::matmul::mul_mat;
use crate::graph::nn::{Conv2d, LayerNorm, Linear};
use crate::graph::{Component, Components, Graph, Loaded, Scope, TypeMap, F32, T};
use crate::models::common::dit::{
    block_index, by_token_chunks, chunk, modulate, pad_and_patchify, pad_to_patch, patchify, timestep_embedding, token_cols, unpatchify,
    unpatchify_and_crop, RmsNorm, TOKEN_CHUNK,
};
use crate::models::adapter::pulid::{self, PulidCa};
use crate::models::common::rope::{self, RefIndexMode};
use super::sefi_image::{DualTimeEmbed, SEMANTIC_CHANNELS};
use crate::tensor::Tensor;

/// Which Flux-family network (they differ in the input channels they concatenate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FluxVariant {
    Flux,
    /// Inpainting: the masked image's latent and the 8×8-pixel mask patches.
    Fill,
    /// Canny / depth: the control image's latent.
    Controls,
    /// Flex.2: masked latent, latent mask and control latent.
    Flex2,
    /// Flux.2 (dev, klein): 128-channel latents (the VAE patchifies), shared modulations,
    /// SwiGLU MLPs, no biases, four rotary axes with the text tokens numbered on the last.
    Flux2,
    /// Chroma1-Radiance: Chroma on RGB pixels in [-1, 1] (no autoencoder), 16×16 patches.
    ChromaRadiance,
    /// Ovis-Image: LLM text RMS-normalised before `txt_in`, gate/up/down MLPs, no pooled
    /// vector, text tokens numbered on rotary axes 1 and 2.
    Ovis,
    /// LongCat-Image: Flux.1 reading Qwen2.5-VL's 3584-wide hidden states, no pooled vector;
    /// text tokens numbered on rotary axes 1 and 2 and the images after them.
    LongCat,
    /// SeFi-Image: Flux.2 on 144 channels (16 semantic + 128 texture) with two timesteps
    /// (`dual_time_embed`, see [`super::sefi_image`]) instead of `time_in`.
    Sefi,
}

/// Chroma1-Radiance's pixel decoder. Its sizes are fixed (the reference does not read them
/// from the weights); the markers and the patch kernel are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RadianceConfig {
    pub nerf_hidden: i64,
    pub nerf_mlp_ratio: i64,
    pub nerf_depth: usize,
    pub nerf_max_freqs: i64,
    /// The network predicts the clean image (`__x0__` marker): the velocity is
    /// `(x - prediction) / t`.
    pub use_x0: bool,
    /// Side of `img_in_patch`'s kernel: the patch size, or half of it when the input is
    /// first downscaled 2× ("fake" 32×32 patches).
    pub in_kernel: i64,
}

impl RadianceConfig {
    fn new(patch_size: i64) -> RadianceConfig {
        RadianceConfig { nerf_hidden: 64, nerf_mlp_ratio: 4, nerf_depth: 4, nerf_max_freqs: 8, use_x0: false, in_kernel: patch_size }
    }

    fn halves_input(&self, patch_size: i64) -> bool {
        self.in_kernel != patch_size
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct FluxConfig {
    pub variant: FluxVariant,
    pub is_chroma: bool,
    pub patch_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub vec_in_dim: i64,
    pub context_in_dim: i64,
    pub hidden_size: i64,
    pub mlp_ratio: f32,
    pub num_heads: i64,
    pub depth: usize,
    pub depth_single_blocks: usize,
    pub axes_dim: Vec<usize>,
    pub theta: f32,
    pub qkv_bias: bool,
    pub guidance_embed: bool,
    /// Input width of Chroma's approximator.
    pub approximator_in_dim: i64,
    /// No linear layer has a bias (Flux.2).
    pub disable_bias: bool,
    /// One modulation per stream kind for all blocks instead of one per block (Flux.2).
    pub share_modulation: bool,
    /// The MLPs are SwiGLU (`silu(gate) · x`, twice the hidden width in) instead of GELU.
    pub mlp_silu_act: bool,
    /// Reference images' first rotary id is their index times this.
    pub ref_index_scale: f32,
    /// Rotary axes on which text tokens count up (0, 1, 2, …) instead of being all zero.
    pub txt_arange_axes: Vec<usize>,
    /// The text is RMS-normalised (`txt_norm`) before `txt_in` (Ovis).
    pub semantic_txt_norm: bool,
    /// The MLPs are `down(up(x) · silu(gate(x)))` (`gate_proj`, `up_proj`, `down_proj`; Ovis).
    pub yak_mlp: bool,
    /// Chroma1-Radiance's pixel input and decoder.
    pub radiance: Option<RadianceConfig>,
    /// PuLID's identity modules (`pulid_ca.N`, from `pulid_weights_path`) are in the weights.
    pub pulid: bool,
}

/// Tokens of Chroma's modulation table (3 per single block, 2 × 6 per double block of the
/// full model, 2 for the final layer: the reference fixes them to Chroma's 19 + 38 blocks).
const CHROMA_MOD_INDEX_LEN: usize = 344;
const CHROMA_SINGLE_BLOCKS: i64 = 38;
const CHROMA_DOUBLE_BLOCKS: i64 = 19;
/// Width of Chroma's approximator.
const CHROMA_INNER: i64 = 5120;
const CHROMA_LAYERS: usize = 5;

impl FluxConfig {
    /// The reference's defaults of `variant` before anything is read from the weights.
    fn defaults(variant: FluxVariant) -> FluxConfig {
        FluxConfig {
            variant,
            is_chroma: false,
            patch_size: 2,
            in_channels: match variant {
                FluxVariant::Flux => 64,
                FluxVariant::Fill => 384,
                FluxVariant::Controls => 128,
                FluxVariant::Flex2 => 196,
                FluxVariant::Flux2 => 128,
                FluxVariant::Sefi => 128 + SEMANTIC_CHANNELS,
                FluxVariant::ChromaRadiance => 3,
                FluxVariant::Ovis | FluxVariant::LongCat => 64,
            },
            out_channels: 64,
            vec_in_dim: 768,
            context_in_dim: 4096,
            hidden_size: 3072,
            mlp_ratio: 4.0,
            num_heads: 24,
            depth: 0,
            depth_single_blocks: 0,
            axes_dim: vec![16, 56, 56],
            theta: 10000.0,
            qkv_bias: true,
            guidance_embed: false,
            approximator_in_dim: 64,
            disable_bias: false,
            share_modulation: false,
            mlp_silu_act: false,
            ref_index_scale: 1.0,
            txt_arange_axes: Vec::new(),
            semantic_txt_norm: false,
            yak_mlp: false,
            radiance: None,
            pulid: false,
        }
    }

    /// Flux's blocks at `hidden_size` with `num_heads` heads and an MLP `mlp_ratio` times as
    /// wide (GELU, biases), for transformers built from them (HunyuanVideo).
    pub(crate) fn for_blocks(hidden_size: i64, num_heads: i64, mlp_ratio: f32, qkv_bias: bool) -> FluxConfig {
        FluxConfig { hidden_size, num_heads, mlp_ratio, qkv_bias, ..FluxConfig::defaults(FluxVariant::Flux) }
    }

    /// The configuration of the network under `prefix`, read from the weights like the
    /// reference (block counts, widths, head size, guidance embedding, Chroma).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str, variant: FluxVariant) -> FluxConfig {
        let mut cfg = FluxConfig::defaults(variant);
        if matches!(variant, FluxVariant::Flux2 | FluxVariant::Sefi) {
            cfg.patch_size = 1;
            cfg.out_channels = cfg.in_channels;
            cfg.mlp_ratio = 3.0;
            cfg.theta = 2000.0;
            cfg.axes_dim = vec![32, 32, 32, 32];
            cfg.vec_in_dim = 0;
            cfg.qkv_bias = false;
            cfg.disable_bias = true;
            cfg.share_modulation = true;
            cfg.ref_index_scale = 10.0;
            cfg.mlp_silu_act = true;
            cfg.txt_arange_axes = vec![3];
        }
        if variant == FluxVariant::ChromaRadiance {
            cfg.patch_size = 16;
        }
        if variant == FluxVariant::Ovis {
            cfg.semantic_txt_norm = true;
            cfg.yak_mlp = true;
            cfg.vec_in_dim = 0;
            cfg.txt_arange_axes = vec![1, 2];
        }
        if variant == FluxVariant::LongCat {
            cfg.context_in_dim = 3584;
            cfg.vec_in_dim = 0;
            cfg.txt_arange_axes = vec![1, 2];
        }
        let radiance = variant == FluxVariant::ChromaRadiance;
        let (mut use_x0, mut in_kernel) = (false, None);
        let mut head_dim = 0;
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            if radiance && name.contains("__x0__") {
                sd_debug!("using x0 prediction");
                use_x0 = true;
            }
            if radiance && name.contains("__32x32__") {
                sd_debug!("using patch size 32");
                cfg.patch_size = 32;
            }
            if radiance && name.contains("img_in_patch.weight") {
                if let Some(ne) = shape_of(name) {
                    sd_debug!("actual radiance patch size: {}", ne[0]);
                    in_kernel = Some(ne[0]);
                }
            }
            if name.contains("guidance_in.in_layer.weight") {
                cfg.guidance_embed = true;
            }
            if name.contains("distilled_guidance_layer.in_proj.weight") {
                cfg.is_chroma = true;
            }
            if name.contains("pulid_ca.") {
                cfg.pulid = true;
            }
            if let Some(i) = block_index(name, "double_blocks.") {
                cfg.depth = cfg.depth.max(i + 1);
            }
            if let Some(i) = block_index(name, "single_blocks.") {
                cfg.depth_single_blocks = cfg.depth_single_blocks.max(i + 1);
            }
            if name.ends_with("txt_in.weight") {
                if let Some(ne) = shape_of(name).filter(|ne| ne.len() >= 2) {
                    cfg.context_in_dim = ne[0];
                    cfg.hidden_size = ne[1];
                }
            }
            if name.ends_with("single_blocks.0.norm.key_norm.scale") || name.ends_with("double_blocks.0.txt_attn.norm.key_norm.scale") {
                if let Some(ne) = shape_of(name) {
                    head_dim = ne[0];
                }
            }
        }
        if head_dim > 0 {
            cfg.num_heads = cfg.hidden_size / head_dim;
        }
        if radiance {
            let mut r = RadianceConfig::new(cfg.patch_size);
            r.use_x0 = use_x0;
            if let Some(k) = in_kernel.filter(|&k| k > 0) {
                r.in_kernel = k;
            }
            if r.halves_input(cfg.patch_size) {
                sd_debug!("using fake x2 patch size");
            }
            cfg.radiance = Some(r);
        }
        sd_debug!(
            "flux: depth = {}, depth_single_blocks = {}, guidance_embed = {}, context_in_dim = {}, hidden_size = {}, num_heads = {}",
            cfg.depth,
            cfg.depth_single_blocks,
            cfg.guidance_embed,
            cfg.context_in_dim,
            cfg.hidden_size,
            cfg.num_heads
        );
        cfg
    }

    fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads
    }

    /// What the weights say that the network cannot be built from (the reference asserts).
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.num_heads > 0 && self.hidden_size > 0 && self.hidden_size % self.num_heads == 0,
            "Flux hidden size {} does not split into {} heads",
            self.hidden_size,
            self.num_heads
        );
        if self.variant == FluxVariant::Sefi {
            ensure!(self.hidden_size % 2 == 0, "SeFi-Image's hidden size {} does not split into its two timestep embeddings", self.hidden_size);
        }
        if let Some(r) = &self.radiance {
            ensure!(
                r.in_kernel == self.patch_size || 2 * r.in_kernel == self.patch_size,
                "Chroma Radiance: img_in_patch has a {k}x{k} kernel, which does not fit patches of {p} (nor half of them)",
                k = r.in_kernel,
                p = self.patch_size
            );
        }
        Ok(())
    }

    fn mlp_hidden(&self) -> i64 {
        (self.hidden_size as f32 * self.mlp_ratio) as i64
    }

    /// Latent channels of the image tokens (before the variant's extra channels).
    pub fn latent_channels(&self) -> i64 {
        if self.radiance.is_some() {
            return self.in_channels;
        }
        self.out_channels / (self.patch_size * self.patch_size)
    }

    /// Channels the variant concatenates to the latent (`c_concat`).
    pub fn concat_channels(&self) -> i64 {
        let c = self.latent_channels();
        match self.variant {
            FluxVariant::Flux | FluxVariant::Flux2 | FluxVariant::Sefi | FluxVariant::ChromaRadiance | FluxVariant::Ovis | FluxVariant::LongCat => 0,
            FluxVariant::Fill => c + 64,
            FluxVariant::Controls => c,
            FluxVariant::Flex2 => 2 * c + 1,
        }
    }
}

/// Linear, SiLU, linear (`in_layer`, `out_layer`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MlpEmbedder {
    in_layer: Linear,
    out_layer: Linear,
}

impl MlpEmbedder {
    pub(crate) fn new(s: &mut Scope, name: &str, in_dim: i64, hidden: i64, bias: bool) -> MlpEmbedder {
        let mut s = s.sub(name);
        MlpEmbedder { in_layer: Linear::new(&mut s, "in_layer", in_dim, hidden, bias), out_layer: Linear::new(&mut s, "out_layer", hidden, hidden, bias) }
    }

    pub(crate) fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.out_layer.forward(g, self.in_layer.forward(g, x).silu_inplace())
    }
}

/// Flux's RMSNorm: f32 `scale`, applied out of place.
fn flux_rms_norm(s: &mut Scope, name: &str, dim: i64) -> RmsNorm {
    RmsNorm::new(s, name, "scale", dim, 1e-6, false)
}

/// `norm.query_norm` and `norm.key_norm` of a head.
fn qk_norm(s: &mut Scope, head_dim: i64) -> (RmsNorm, RmsNorm) {
    let mut norm = s.sub("norm");
    (flux_rms_norm(&mut norm, "query_norm", head_dim), flux_rms_norm(&mut norm, "key_norm", head_dim))
}

/// Shift, scale and (except for the final layer) gate of one adaLN modulation.
#[derive(Clone, Copy)]
pub(crate) struct ModOut<'g> {
    shift: T<'g>,
    scale: T<'g>,
    gate: Option<T<'g>>,
}

impl<'g> ModOut<'g> {
    /// The three consecutive `[dim, N]` planes of `vec` `[dim, N, K]` from plane `offset`
    /// (two, without the gate, when `gated` is false).
    fn planes(vec: T<'g>, offset: i64, gated: bool) -> ModOut<'g> {
        let [ne0, ne1, _, _] = vec.ne();
        let nb = vec.nb();
        let stride = nb[1] * ne1 as usize;
        let plane = |k: i64| vec.view(&[ne0, ne1], &[nb[1]], stride * (offset + k) as usize);
        ModOut { shift: plane(0), scale: plane(1), gate: gated.then(|| plane(2)) }
    }

    fn at(vec: T<'g>, offset: i64) -> ModOut<'g> {
        Self::planes(vec, offset, true)
    }
}

/// `lin(silu(vec))` cut into 3 (single) or 6 (double) modulations.
#[derive(Clone, Copy, Debug)]
struct Modulation {
    lin: Linear,
    multiplier: i64,
}

impl Modulation {
    fn new(s: &mut Scope, name: &str, dim: i64, double: bool, bias: bool) -> Modulation {
        let multiplier = if double { 6 } else { 3 };
        Modulation { lin: Linear::new(&mut s.sub(name), "lin", dim, dim * multiplier, bias), multiplier }
    }

    fn forward<'g>(&self, g: &'g Graph, vec: T<'g>) -> (ModOut<'g>, Option<ModOut<'g>>) {
        let [dim, n, _, _] = vec.ne();
        let out = self.lin.forward(g, vec.silu());
        let m = out.reshape(&[dim, self.multiplier, n]).permute(0, 2, 1, 3).cont();
        (ModOut::at(m, 0), (self.multiplier == 6).then(|| ModOut::at(m, 3)))
    }
}

/// `ggml_gelu` in place (tanh approximation), made dense first when needed.
fn gelu_inplace<'g>(x: T<'g>) -> T<'g> {
    x.contiguous().gelu_inplace()
}

/// The activation between an MLP's two products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MlpAct {
    /// tanh-GELU.
    Gelu,
    /// SwiGLU on `[2·d, …]`: the first half (made dense) through SiLU gates the second.
    SwiGlu,
    /// SwiGLU with the gate in the second half (Ovis's single blocks).
    SwiGluGateLast,
}

impl MlpAct {
    fn of(cfg: &FluxConfig) -> MlpAct {
        if cfg.yak_mlp {
            MlpAct::SwiGluGateLast
        } else if cfg.mlp_silu_act {
            MlpAct::SwiGlu
        } else {
            MlpAct::Gelu
        }
    }

    /// Inputs of the second product per output of the first (2 for SwiGLU).
    fn input_factor(self) -> i64 {
        if self == MlpAct::Gelu {
            1
        } else {
            2
        }
    }

    fn apply<'g>(self, x: T<'g>) -> T<'g> {
        let (gate, value) = match self {
            MlpAct::Gelu => return gelu_inplace(x),
            MlpAct::SwiGlu => (0, 1),
            MlpAct::SwiGluGateLast => (1, 0),
        };
        let halves = chunk(x, 2, 0, false);
        let gate = halves[gate].cont().silu_inplace();
        halves[value].mul(gate)
    }
}

/// A double block stream's MLP.
#[derive(Clone, Copy, Debug)]
enum StreamMlp {
    /// `2(act(0(x)))`.
    Plain { mlp_0: Linear, mlp_2: Linear, act: MlpAct },
    /// `down(up(x) · silu(gate(x)))` (Ovis).
    Yak { gate: Linear, up: Linear, down: Linear },
}

impl StreamMlp {
    fn new(s: &mut Scope, cfg: &FluxConfig) -> StreamMlp {
        let (h, mlp, bias) = (cfg.hidden_size, cfg.mlp_hidden(), !cfg.disable_bias);
        if cfg.yak_mlp {
            return StreamMlp::Yak {
                gate: Linear::new(s, "gate_proj", h, mlp, bias),
                up: Linear::new(s, "up_proj", h, mlp, bias),
                down: Linear::new(s, "down_proj", mlp, h, bias),
            };
        }
        let act = MlpAct::of(cfg);
        StreamMlp::Plain { mlp_0: Linear::new(s, "0", h, mlp * act.input_factor(), bias), mlp_2: Linear::new(s, "2", mlp, h, bias), act }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            StreamMlp::Plain { mlp_0, mlp_2, act } => mlp_2.forward(g, act.apply(mlp_0.forward(g, x))),
            StreamMlp::Yak { gate, up, down } => {
                let gate = gate.forward(g, x).silu_inplace();
                down.forward(g, up.forward(g, x).mul(gate))
            }
        }
    }
}

/// Self-attention projections with RMS-normalised q and k.
#[derive(Clone, Copy, Debug)]
struct SelfAttention {
    qkv: Linear,
    query_norm: RmsNorm,
    key_norm: RmsNorm,
    proj: Linear,
    num_heads: i64,
}

impl SelfAttention {
    fn new(s: &mut Scope, name: &str, dim: i64, num_heads: i64, qkv_bias: bool, proj_bias: bool) -> SelfAttention {
        let mut s = s.sub(name);
        let head_dim = dim / num_heads;
        let qkv = Linear::new(&mut s, "qkv", dim, dim * 3, qkv_bias);
        let (query_norm, key_norm) = qk_norm(&mut s, head_dim);
        SelfAttention { qkv, query_norm, key_norm, proj: Linear::new(&mut s, "proj", dim, dim, proj_bias), num_heads }
    }

    /// q, k, v `[d_head, n_head, L, N]` (q, k normalised; v a view).
    fn pre_attention<'g>(&self, g: &'g Graph, x: T<'g>) -> [T<'g>; 3] {
        let qkv = self.qkv.forward(g, x);
        let [d, l, n, _] = qkv.ne();
        let head_dim = d / 3 / self.num_heads;
        let nb = qkv.nb();
        let part = |k: usize| qkv.view(&[head_dim, self.num_heads, l, n], &[nb[0] * head_dim as usize, nb[1], nb[2]], nb[0] * k * d as usize / 3);
        [self.query_norm.forward(g, part(0)), self.key_norm.forward(g, part(1)), part(2)]
    }
}

/// One stream's half of a double block.
#[derive(Clone, Copy, Debug)]
struct Stream {
    modulation: Option<Modulation>,
    norm1: LayerNorm,
    attn: SelfAttention,
    norm2: LayerNorm,
    mlp: StreamMlp,
}

impl Stream {
    fn new(s: &mut Scope, prefix: &str, cfg: &FluxConfig) -> Stream {
        let h = cfg.hidden_size;
        let bias = !cfg.disable_bias;
        let modulation = (!cfg.is_chroma && !cfg.share_modulation).then(|| Modulation::new(s, &format!("{prefix}_mod"), h, true, true));
        let norm1 = LayerNorm::new(s, &format!("{prefix}_norm1"), h, 1e-6, false, false);
        let attn = SelfAttention::new(s, &format!("{prefix}_attn"), h, cfg.num_heads, cfg.qkv_bias, bias);
        let norm2 = LayerNorm::new(s, &format!("{prefix}_norm2"), h, 1e-6, false, false);
        let mlp = StreamMlp::new(&mut s.sub(&format!("{prefix}_mlp")), cfg);
        Stream { modulation, norm1, attn, norm2, mlp }
    }

    /// After attention: gated attention output and gated MLP added to `x`, the MLP half
    /// `chunk` tokens at a time (the same values; its hidden layer lives one chunk at a time).
    fn post<'g>(&self, g: &'g Graph, x: T<'g>, attn_out: T<'g>, m1: &ModOut<'g>, m2: &ModOut<'g>, chunk: i64) -> T<'g> {
        let x = x.add(self.attn.proj.forward(g, attn_out).mul(m1.gate.expect("gate")));
        let mlp_half = |x: T<'g>| {
            let h = modulate(self.norm2.forward(g, x), m2.shift, m2.scale);
            x.add(self.mlp.forward(g, h).mul(m2.gate.expect("gate")))
        };
        let [_, l, n, _] = x.ne();
        if l <= chunk || n != 1 {
            return mlp_half(x);
        }
        by_token_chunks(l, chunk, |c0, lc| Some(mlp_half(token_cols(x, c0, lc)))).expect("chunks")
    }
}

/// The two modulations (attention, MLP) of one stream of a double block.
type DoubleMods<'g> = (ModOut<'g>, ModOut<'g>);

/// Flux.2's modulations, computed once and used by every block.
pub(crate) struct SharedMods<'g> {
    img: DoubleMods<'g>,
    txt: DoubleMods<'g>,
    single: ModOut<'g>,
}

/// The modulation layers of [`SharedMods`].
#[derive(Clone, Copy, Debug)]
struct SharedModulation {
    img: Modulation,
    txt: Modulation,
    single: Modulation,
}

impl SharedModulation {
    fn new(s: &mut Scope, dim: i64, bias: bool) -> SharedModulation {
        SharedModulation {
            img: Modulation::new(s, "double_stream_modulation_img", dim, true, bias),
            txt: Modulation::new(s, "double_stream_modulation_txt", dim, true, bias),
            single: Modulation::new(s, "single_stream_modulation", dim, false, bias),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, vec: T<'g>) -> SharedMods<'g> {
        let double = |m: &Modulation| {
            let (a, b) = m.forward(g, vec);
            (a, b.expect("double modulation"))
        };
        SharedMods { img: double(&self.img), txt: double(&self.txt), single: self.single.forward(g, vec).0 }
    }
}

/// Image and text streams with their own weights attending jointly.
#[derive(Clone, Debug)]
pub(crate) struct DoubleStreamBlock {
    img: Stream,
    txt: Stream,
    idx: i64,
}

impl DoubleStreamBlock {
    pub(crate) fn new(s: &mut Scope, cfg: &FluxConfig, idx: usize) -> DoubleStreamBlock {
        DoubleStreamBlock { img: Stream::new(s, "img", cfg), txt: Stream::new(s, "txt", cfg), idx: idx as i64 }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<'g>(
        &self,
        g: &'g Graph,
        img: T<'g>,
        txt: T<'g>,
        vec: T<'g>,
        pe: T<'g>,
        mask: Option<T<'g>>,
        shared: Option<&SharedMods<'g>>,
    ) -> (T<'g>, T<'g>) {
        let mods = |stream: &Stream, shared: Option<DoubleMods<'g>>, chroma_offset: i64| match (shared, &stream.modulation) {
            (Some(m), _) => m,
            (None, Some(m)) => {
                let (a, b) = m.forward(g, vec);
                (a, b.expect("double modulation"))
            }
            (None, None) => (ModOut::at(vec, chroma_offset), ModOut::at(vec, chroma_offset + 3)),
        };
        let (img_m1, img_m2) = mods(&self.img, shared.map(|s| s.img), 6 * self.idx + 3 * CHROMA_SINGLE_BLOCKS);
        let (txt_m1, txt_m2) = mods(&self.txt, shared.map(|s| s.txt), 6 * self.idx + 6 * CHROMA_DOUBLE_BLOCKS + 3 * CHROMA_SINGLE_BLOCKS);

        let img_in = modulate(self.img.norm1.forward(g, img), img_m1.shift, img_m1.scale);
        let [img_q, img_k, img_v] = self.img.attn.pre_attention(g, img_in);
        let txt_in = modulate(self.txt.norm1.forward(g, txt), txt_m1.shift, txt_m1.scale);
        let [txt_q, txt_k, txt_v] = self.txt.attn.pre_attention(g, txt_in);

        let q = txt_q.concat(img_q, 2);
        let k = txt_k.concat(img_k, 2);
        let v = txt_v.concat(img_v, 2);
        let attn = rope::attention(g, q, k, v, pe, mask);
        let [d, _, n, _] = attn.ne();
        let nb = attn.nb();
        let n_txt = txt.ne()[1];
        let txt_attn = attn.view(&[d, n_txt, n], &[nb[1], nb[2]], 0);
        let img_attn = attn.view(&[d, img.ne()[1], n], &[nb[1], nb[2]], n_txt as usize * nb[1]);

        let img = self.img.post(g, img, img_attn, &img_m1, &img_m2, TOKEN_CHUNK);
        let txt = self.txt.post(g, txt, txt_attn, &txt_m1, &txt_m2, TOKEN_CHUNK);
        (img, txt)
    }
}

/// Text and image tokens through shared weights: attention and MLP in parallel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SingleStreamBlock {
    linear1: Linear,
    linear2: Linear,
    query_norm: RmsNorm,
    key_norm: RmsNorm,
    pre_norm: LayerNorm,
    modulation: Option<Modulation>,
    hidden: i64,
    num_heads: i64,
    mlp_hidden: i64,
    act: MlpAct,
    idx: i64,
}

impl SingleStreamBlock {
    pub(crate) fn new(s: &mut Scope, cfg: &FluxConfig, idx: usize) -> SingleStreamBlock {
        let h = cfg.hidden_size;
        let mlp = cfg.mlp_hidden();
        let bias = !cfg.disable_bias;
        let act = MlpAct::of(cfg);
        let mlp_in = mlp * act.input_factor();
        let (query_norm, key_norm) = qk_norm(s, cfg.head_dim());
        SingleStreamBlock {
            linear1: Linear::new(s, "linear1", h, h * 3 + mlp_in, bias),
            linear2: Linear::new(s, "linear2", h + mlp, h, bias),
            query_norm,
            key_norm,
            pre_norm: LayerNorm::new(s, "pre_norm", h, 1e-6, false, false),
            modulation: (!cfg.is_chroma && !cfg.share_modulation).then(|| Modulation::new(s, "modulation", h, false, true)),
            hidden: h,
            num_heads: cfg.num_heads,
            mlp_hidden: mlp_in,
            act,
            idx: idx as i64,
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<'g>(&self, g: &'g Graph, x: T<'g>, vec: T<'g>, pe: T<'g>, mask: Option<T<'g>>, shared: Option<ModOut<'g>>) -> T<'g> {
        let m = match (shared, &self.modulation) {
            (Some(m), _) => m,
            (None, Some(m)) => m.forward(g, vec).0,
            (None, None) => ModOut::at(vec, 3 * self.idx),
        };
        let x_mod = modulate(self.pre_norm.forward(g, x), m.shift, m.scale);
        if let Some(y) = self.forward_in_chunks(g, x, x_mod, &m, pe, mask, TOKEN_CHUNK) {
            return y;
        }
        let qkv_mlp = self.linear1.forward(g, x_mod);
        let [_, l, n, _] = qkv_mlp.ne();
        let nb = qkv_mlp.nb();
        let attn = self.attention(g, qkv_mlp, pe, mask);
        let mlp = qkv_mlp.view(&[self.mlp_hidden, l, n], &[nb[1], nb[2]], 3 * self.hidden as usize * nb[0]);
        let attn_mlp = attn.concat(self.act.apply(mlp), 0);
        let out = self.linear2.forward(g, attn_mlp);
        x.add(out.mul(m.gate.expect("gate")))
    }

    /// Attention over Q, K and V, the first three hidden widths of each token of `qkv`
    /// (`linear1`'s output, whole or its first rows alone).
    fn attention<'g>(&self, g: &'g Graph, qkv: T<'g>, pe: T<'g>, mask: Option<T<'g>>) -> T<'g> {
        let [_, l, n, _] = qkv.ne();
        let nb = qkv.nb();
        let head_dim = self.hidden / self.num_heads;
        let part = |k: usize| qkv.view(&[head_dim, self.num_heads, l, n], &[nb[0] * head_dim as usize, nb[1], nb[2]], nb[0] * k * self.hidden as usize);
        let q = self.query_norm.forward(g, part(0));
        let k = self.key_norm.forward(g, part(1));
        rope::attention(g, q, k, part(2), pe, mask)
    }

    /// The block with its MLP half run `chunk` tokens at a time: Q, K and V of every token
    /// first (attention needs them all), then per chunk of tokens the MLP's input rows of
    /// `linear1`, the activation, `linear2` and the residual, concatenated at the end. The
    /// same products and element-wise ops as [`Self::forward`], so the same values, but the
    /// widest intermediates (`linear1`'s output is 3 + 2·3 hidden widths per token in
    /// Flux.2) live for one chunk at a time: about half of SeFi-Image's compute buffer at
    /// 1,280 tokens. `None` (build the whole block) for one chunk's tokens, a batch, or a
    /// `linear1` that must be applied whole.
    #[allow(clippy::too_many_arguments)]
    fn forward_in_chunks<'g>(&self, g: &'g Graph, x: T<'g>, x_mod: T<'g>, m: &ModOut<'g>, pe: T<'g>, mask: Option<T<'g>>, chunk: i64) -> Option<T<'g>> {
        let [h, l, n, _] = x_mod.ne();
        if l <= chunk || n != 1 || !x.is_contiguous() || !x_mod.is_contiguous() {
            return None;
        }
        let attn = self.attention(g, self.linear1.forward_rows(g, x_mod, 0..3 * h)?, pe, mask);
        let gate = m.gate.expect("gate");
        by_token_chunks(l, chunk, |c0, lc| {
            let mlp = self.linear1.forward_rows(g, token_cols(x_mod, c0, lc), 3 * h..3 * h + self.mlp_hidden)?;
            let attn_mlp = token_cols(attn, c0, lc).concat(self.act.apply(mlp), 0);
            let out = self.linear2.forward(g, attn_mlp);
            Some(token_cols(x, c0, lc).add(out.mul(gate)))
        })
    }
}

/// Final norm, modulation and projection to patch pixels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LastLayer {
    linear: Linear,
    ada_ln: Option<Linear>,
}

impl LastLayer {
    /// `final_layer`: `out` values per token, its own modulation (`adaLN_modulation.1`).
    pub(crate) fn new(s: &mut Scope, hidden: i64, out: i64, bias: bool) -> LastLayer {
        let mut fl = s.sub("final_layer");
        LastLayer { linear: Linear::new(&mut fl, "linear", hidden, out, bias), ada_ln: Some(Linear::new(&mut fl, "adaLN_modulation.1", hidden, 2 * hidden, bias)) }
    }

    pub(crate) fn forward<'g>(&self, g: &'g Graph, x: T<'g>, c: T<'g>) -> T<'g> {
        let (shift, scale) = match &self.ada_ln {
            Some(l) => {
                let m = l.forward(g, c.silu());
                let parts = chunk(m, 2, 0, true);
                (parts[0], parts[1])
            }
            None => {
                let m = ModOut::planes(c, c.ne()[2] - 2, false);
                (m.shift, m.scale)
            }
        };
        let x = modulate(x.norm(1e-6), shift, scale);
        self.linear.forward(g, x)
    }
}

/// Chroma's distilled guidance layer: the modulation table from timestep, guidance and the
/// modulation index.
#[derive(Clone, Debug)]
struct ChromaApproximator {
    in_proj: Linear,
    norms: Vec<RmsNorm>,
    layers: Vec<MlpEmbedder>,
    out_proj: Linear,
}

impl ChromaApproximator {
    fn new(s: &mut Scope, in_dim: i64, hidden: i64) -> ChromaApproximator {
        let mut s = s.sub("distilled_guidance_layer");
        ChromaApproximator {
            in_proj: Linear::new(&mut s, "in_proj", in_dim, CHROMA_INNER, true),
            norms: (0..CHROMA_LAYERS).map(|i| flux_rms_norm(&mut s, &format!("norms.{i}"), CHROMA_INNER)).collect(),
            layers: (0..CHROMA_LAYERS).map(|i| MlpEmbedder::new(&mut s, &format!("layers.{i}"), CHROMA_INNER, CHROMA_INNER, true)).collect(),
            out_proj: Linear::new(&mut s, "out_proj", CHROMA_INNER, hidden, true),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = self.in_proj.forward(g, x);
        for (norm, layer) in self.norms.iter().zip(&self.layers) {
            x = x.add_inplace(layer.forward(g, norm.forward(g, x)));
        }
        self.out_proj.forward(g, x)
    }
}

/// One block of Chroma1-Radiance's pixel network: a gated MLP over each patch's pixels whose
/// three weight matrices the patch's transformer token generates (`param_generator`), each
/// row L2-normalised.
#[derive(Clone, Copy, Debug)]
struct NerfGluBlock {
    param_generator: Linear,
    norm: RmsNorm,
    hidden: i64,
    mlp_ratio: i64,
}

impl NerfGluBlock {
    fn new(s: &mut Scope, token_dim: i64, hidden: i64, mlp_ratio: i64) -> NerfGluBlock {
        NerfGluBlock {
            param_generator: Linear::new(s, "param_generator", token_dim, 3 * hidden * hidden * mlp_ratio, true),
            norm: flux_rms_norm(s, "norm", hidden),
            hidden,
            mlp_ratio,
        }
    }

    /// `x` `[hidden, p·p, B]` (the pixels of B patches), `tokens` `[token_dim, B]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, tokens: T<'g>) -> T<'g> {
        let (d, r, b) = (self.hidden, self.mlp_ratio, x.ne()[2]);
        let params = chunk(self.param_generator.forward(g, tokens), 3, 0, true);
        // Generated as [out, in] per patch; the products want [in, out] rows.
        let matrix = |t: T<'g>, out: i64, inp: i64| t.reshape(&[out, inp, b]).permute(1, 0, 2, 3).cont().l2_norm(1e-12);
        let fc1_gate = matrix(params[0], d * r, d);
        let fc1_value = matrix(params[1], d * r, d);
        let fc2 = matrix(params[2], d, r * d);
        let h = self.norm.forward(g, x);
        let gate = mul_mat(g, fc1_gate, h, false).silu_inplace();
        let value = mul_mat(g, fc1_value, h, false);
        mul_mat(g, fc2, gate.mul_inplace(value), false).add_inplace(x)
    }
}

/// Chroma1-Radiance's decoder from transformer tokens to pixels (`nerf_image_embedder`,
/// `nerf_blocks.N`, `nerf_final_layer_conv`).
#[derive(Clone, Debug)]
struct NerfHead {
    cfg: RadianceConfig,
    embedder: Linear,
    blocks: Vec<NerfGluBlock>,
    final_norm: RmsNorm,
    final_conv: Conv2d,
}

impl NerfHead {
    fn new(s: &mut Scope, cfg: &FluxConfig, r: RadianceConfig) -> NerfHead {
        let freqs = r.nerf_max_freqs * r.nerf_max_freqs;
        let embedder = Linear::new(&mut s.sub("nerf_image_embedder"), "embedder.0", cfg.in_channels + freqs, r.nerf_hidden, true);
        let blocks = (0..r.nerf_depth)
            .map(|i| NerfGluBlock::new(&mut s.sub(&format!("nerf_blocks.{i}")), cfg.hidden_size, r.nerf_hidden, r.nerf_mlp_ratio))
            .collect();
        let mut f = s.sub("nerf_final_layer_conv");
        let final_norm = flux_rms_norm(&mut f, "norm", r.nerf_hidden);
        let final_conv = Conv2d::square(&mut f, "conv", r.nerf_hidden, cfg.in_channels, 3, 1, 1);
        NerfHead { cfg: r, embedder, blocks, final_norm, final_conv }
    }

    /// The padded image `[W', H', C, 1]`, its tokens after the transformer `[hidden, L, 1]`
    /// and the DCT code `[freqs², p·p]` → prediction `[W', H', C, 1]`.
    fn forward<'g>(&self, g: &'g Graph, img: T<'g>, tokens: T<'g>, dct: T<'g>, p: i64) -> T<'g> {
        let [w, h, c, _] = img.ne();
        let pixels = patchify(img, p, true);
        let [_, patches, n, _] = pixels.ne();
        // Each patch's pixels as a sequence of C-vectors: [C, p·p, patches·N].
        let pixels = pixels.reshape(&[p * p, c, patches * n]).permute(1, 0, 2, 3).cont();
        let [d, l, tn, _] = tokens.ne();
        let tokens = tokens.reshape(&[d, l * tn]);
        let [f, pp, _, _] = dct.ne();
        let dct = dct.repeat_4d([f, pp, patches * n, 1]);
        let mut x = self.embedder.forward(g, pixels.concat(dct, 0));
        for block in &self.blocks {
            x = block.forward(g, x, tokens);
        }
        let nh = self.cfg.nerf_hidden;
        let x = x.permute(1, 0, 2, 3).cont().reshape(&[p * p * nh, patches, n]);
        let x = unpatchify(x, h / p, w / p, p, true);
        // RMS norm over the channels of each pixel, then the 3×3 convolution to RGB.
        let x = x.permute(1, 2, 0, 3).cont();
        let x = self.final_norm.forward(g, x).permute(2, 0, 1, 3).cont();
        self.final_conv.forward(g, x)
    }
}

/// Chroma1-Radiance's position code of a p×p patch: for each pixel the products of cosines
/// `cos(π·fx·x)·cos(π·fy·y) / (1 + fx·fy)` over `max_freqs²` frequency pairs, with x, y in
/// [0, 1] across the patch (`[max_freqs², p·p]`, computed in f32 like the reference).
pub fn dct_positions(p: usize, max_freqs: usize) -> Vec<f32> {
    const PI: f32 = std::f32::consts::PI;
    let pos: Vec<f32> = (0..p).map(|i| i as f32 / (p as f32 - 1.0)).collect();
    let freqs: Vec<f32> = (0..max_freqs).map(|i| i as f32).collect();
    let features = max_freqs * max_freqs;
    let mut out = vec![0f32; p * p * features];
    for (k, row) in out.chunks_mut(features).enumerate() {
        let (px, py) = (pos[k % p], pos[k / p]);
        for fx in 0..max_freqs {
            let cx = (px * freqs[fx] * PI).cos();
            for fy in 0..max_freqs {
                let cy = (py * freqs[fy] * PI).cos();
                let coeff = 1.0 / (1.0 + freqs[fx] * freqs[fy]);
                row[fx * max_freqs + fy] = cx * cy * coeff;
            }
        }
    }
    out
}

/// The Flux / Chroma network.
#[derive(Clone, Debug)]
pub struct FluxModel {
    pub config: FluxConfig,
    /// Token projection of latent patches (all but Chroma1-Radiance).
    img_in: Option<Linear>,
    /// Chroma1-Radiance: pixels to tokens by a strided convolution.
    img_in_patch: Option<Conv2d>,
    /// Ovis: RMS norm of the text before `txt_in`.
    txt_norm: Option<RmsNorm>,
    txt_in: Linear,
    time_in: Option<MlpEmbedder>,
    /// SeFi: the semantic and texture timesteps' embeddings instead of `time_in`.
    dual_time_embed: Option<DualTimeEmbed>,
    vector_in: Option<MlpEmbedder>,
    guidance_in: Option<MlpEmbedder>,
    approximator: Option<ChromaApproximator>,
    shared_modulation: Option<SharedModulation>,
    double_blocks: Vec<DoubleStreamBlock>,
    single_blocks: Vec<SingleStreamBlock>,
    /// Tokens to patch pixels (all but Chroma1-Radiance).
    final_layer: Option<LastLayer>,
    nerf: Option<NerfHead>,
    /// PuLID's identity cross-attentions, in the order they run (empty without PuLID).
    pulid: Vec<PulidCa>,
}

/// Graph inputs of one Flux evaluation.
pub struct FluxInputs<'g, 'a> {
    /// Latent `[W, H, C, 1]`.
    pub x: T<'g>,
    /// `[N]`, in [0, 1]; SeFi: `[2]`, the semantic and the texture timestep in 0..1000.
    pub timesteps: T<'g>,
    /// `[context_in_dim, L, N]`.
    pub context: T<'g>,
    pub c_concat: Option<T<'g>>,
    /// Pooled text vector `[vec_in_dim, N]`; for Chroma the text attention mask `[L]`.
    pub y: Option<T<'g>>,
    /// `[N]`, Flux dev and Chroma.
    pub guidance: Option<T<'g>>,
    /// Rotation table `[2, 2, Σaxes/2, tokens]`.
    pub pe: T<'g>,
    /// Chroma: 0..344 as f32.
    pub mod_index: Option<T<'g>>,
    /// Chroma1-Radiance: [`dct_positions`] `[max_freqs², p·p]`.
    pub dct: Option<T<'g>>,
    /// Reference latents `[W', H', C, 1]` appended as tokens.
    pub refs: Vec<T<'g>>,
    pub skip_layers: &'a [i32],
    /// PuLID's identity embedding `[2048, tokens, 1]` and its weight.
    pub identity: Option<(T<'g>, f32)>,
}

impl FluxModel {
    pub fn new(s: &mut Scope, cfg: &FluxConfig) -> FluxModel {
        let h = cfg.hidden_size;
        let bias = !cfg.disable_bias;
        let sefi = cfg.variant == FluxVariant::Sefi;
        let dual_time_embed = sefi.then(|| DualTimeEmbed::new(s, h));
        let (time_in, vector_in, guidance_in, approximator) = if cfg.is_chroma {
            (None, None, None, Some(ChromaApproximator::new(s, cfg.approximator_in_dim, h)))
        } else if sefi {
            (None, None, None, None)
        } else {
            (
                Some(MlpEmbedder::new(s, "time_in", 256, h, bias)),
                (cfg.vec_in_dim > 0).then(|| MlpEmbedder::new(s, "vector_in", cfg.vec_in_dim, h, bias)),
                cfg.guidance_embed.then(|| MlpEmbedder::new(s, "guidance_in", 256, h, bias)),
                None,
            )
        };
        let (img_in, img_in_patch) = match &cfg.radiance {
            Some(r) => {
                let k = r.in_kernel;
                (None, Some(Conv2d::new(s, "img_in_patch", cfg.in_channels, h, (k, k), (k as i32, k as i32), (0, 0), true)))
            }
            None => (Some(Linear::new(s, "img_in", cfg.in_channels, h, bias)), None),
        };
        let txt_norm = cfg.semantic_txt_norm.then(|| flux_rms_norm(s, "txt_norm", cfg.context_in_dim));
        let txt_in = Linear::new(s, "txt_in", cfg.context_in_dim, h, bias);
        let double_blocks = (0..cfg.depth)
            .map(|i| {
                DoubleStreamBlock::new(&mut s.sub(&format!("double_blocks.{i}")), cfg, i)
            })
            .collect();
        let single_blocks = (0..cfg.depth_single_blocks).map(|i| SingleStreamBlock::new(&mut s.sub(&format!("single_blocks.{i}")), cfg, i)).collect();
        let final_layer = cfg.radiance.is_none().then(|| {
            let mut fl = s.sub("final_layer");
            LastLayer {
                // The reference declares it with patch size 1: out_channels already counts the patch.
                linear: Linear::new(&mut fl, "linear", h, cfg.out_channels, bias),
                ada_ln: (!cfg.is_chroma).then(|| Linear::new(&mut fl, "adaLN_modulation.1", h, 2 * h, bias)),
            }
        });
        let nerf = cfg.radiance.map(|r| NerfHead::new(s, cfg, r));
        let shared_modulation = cfg.share_modulation.then(|| SharedModulation::new(s, h, bias));
        let n_pulid = if cfg.pulid { pulid::module_count(cfg.depth, cfg.depth_single_blocks) } else { 0 };
        let pulid = (0..n_pulid).map(|i| PulidCa::new(&mut s.sub(&format!("pulid_ca.{i}")), h)).collect();
        FluxModel {
            config: cfg.clone(),
            img_in,
            img_in_patch,
            txt_norm,
            txt_in,
            time_in,
            dual_time_embed,
            vector_in,
            guidance_in,
            approximator,
            shared_modulation,
            double_blocks,
            single_blocks,
            final_layer,
            nerf,
            pulid,
        }
    }

    /// The model carries PuLID modules (it reads an identity embedding when given one).
    pub fn takes_identity(&self) -> bool {
        !self.pulid.is_empty()
    }

    /// The transformer on tokens: image tokens `[in_channels, L_img, N]` → `[p·p·C, L_img, N]`
    /// (Chroma1-Radiance: tokens `[hidden, L_img, N]` in and out).
    fn forward_tokens<'g>(&self, g: &'g Graph, img: T<'g>, i: &FluxInputs<'g, '_>) -> T<'g> {
        let (txt, timesteps, y, guidance, pe, mod_index, skip_layers) = (i.context, i.timesteps, i.y, i.guidance, i.pe, i.mod_index, i.skip_layers);
        let cfg = &self.config;
        let mut img = match &self.img_in {
            Some(l) => l.forward(g, img),
            None => img,
        };
        let mut mask = None;
        let vec = match (&self.approximator, &self.dual_time_embed) {
            (Some(approx), _) => {
                let t = timestep_embedding(timesteps, 16, 10000, 1000.0);
                let gd = timestep_embedding(guidance.expect("Chroma needs a guidance input"), 16, 10000, 1000.0);
                let mi = timestep_embedding(mod_index.expect("Chroma needs the modulation index"), 32, 10000, 1000.0);
                let mi_ne = mi.ne();
                let mi = mi.repeat(g.new_tensor(F32, &[mi_ne[0], mi_ne[1], img.ne()[2]]));
                let tg = t.concat(gd, 0).repeat(mi);
                let v = tg.concat(mi, 0).permute(0, 2, 1, 3).cont();
                if let Some(y) = y {
                    mask = Some(y.pad(img.ne()[1] as i32, 0, 0, 0));
                }
                approx.forward(g, v)
            }
            (None, Some(dual)) => dual.forward(g, timesteps),
            (None, None) => {
                let time_in = self.time_in.as_ref().expect("time_in");
                let mut v = time_in.forward(g, timestep_embedding(timesteps, 256, 10000, 1000.0));
                if let Some(gi) = &self.guidance_in {
                    let gd = guidance.expect("Flux dev needs a guidance input");
                    v = v.add(gi.forward(g, timestep_embedding(gd, 256, 10000, 1000.0)));
                }
                if let Some(vi) = &self.vector_in {
                    v = v.add(vi.forward(g, y.expect("Flux needs the pooled text vector")));
                }
                v
            }
        };
        let shared = self.shared_modulation.map(|m| m.forward(g, vec));
        let txt = match &self.txt_norm {
            Some(n) => n.forward(g, txt),
            None => txt,
        };
        let mut txt = self.txt_in.forward(g, txt);
        let skip = |i: usize| skip_layers.contains(&(i as i32));
        let identity = i.identity;
        let mut pulid = self.pulid.iter();
        for (i, block) in self.double_blocks.iter().enumerate() {
            if skip(i) {
                continue;
            }
            (img, txt) = block.forward(g, img, txt, vec, pe, mask, shared.as_ref());
            if let Some((id, w)) = identity.filter(|_| i % pulid::DOUBLE_INTERVAL == 0) {
                img = pulid.next().expect("a PuLID module per second double block").apply(g, img, id, w);
            }
        }
        let n_img = img.ne()[1];
        let n_txt = txt.ne()[1];
        let mut txt_img = txt.concat(img, 1);
        for (i, block) in self.single_blocks.iter().enumerate() {
            if skip(i + cfg.depth) {
                continue;
            }
            txt_img = block.forward(g, txt_img, vec, pe, mask, shared.as_ref().map(|m| m.single));
            if let Some((id, w)) = identity.filter(|_| i % pulid::SINGLE_INTERVAL == 0) {
                // The module reads and updates the image tokens only.
                let [d, _, n, _] = txt_img.ne();
                let nb = txt_img.nb();
                let txt_part = txt_img.view(&[d, n_txt, n], &[nb[1], nb[2]], 0).cont();
                let img_part = txt_img.view(&[d, n_img, n], &[nb[1], nb[2]], n_txt as usize * nb[1]).cont();
                let img_part = pulid.next().expect("a PuLID module per fourth single block").apply(g, img_part, id, w);
                txt_img = txt_part.concat(img_part, 1);
            }
        }
        let [d, _, n, _] = txt_img.ne();
        let nb = txt_img.nb();
        let img = txt_img.view(&[d, n_img, n], &[nb[1], nb[2]], n_txt as usize * nb[1]);
        match &self.final_layer {
            Some(f) => f.forward(g, img, vec),
            None => img,
        }
    }

    /// Chroma1-Radiance: image `[W, H, 3, 1]` → velocity `[W, H, 3, 1]`.
    fn forward_radiance<'g>(&self, g: &'g Graph, i: &FluxInputs<'g, '_>) -> T<'g> {
        let cfg = &self.config;
        let (Some(r), Some(patch_in), Some(nerf)) = (&cfg.radiance, &self.img_in_patch, &self.nerf) else {
            unreachable!("a Radiance model has its patch input and pixel decoder")
        };
        let p = cfg.patch_size;
        let [w, h, c, n] = i.x.ne();
        let img = pad_to_patch(g, i.x, p);
        let mut tokens_in = img;
        if r.halves_input(p) {
            // Like the reference: bilinear (not nearest) to half the unpadded size.
            tokens_in = tokens_in.interpolate([w / 2, h / 2, c, n], ggml_sys::GGML_SCALE_MODE_BILINEAR);
        }
        let t = patch_in.forward(g, tokens_in);
        let [tw, th, hidden, tn] = t.ne();
        let t = t.reshape(&[tw * th, hidden, tn]).permute(1, 0, 2, 3).cont();
        let tokens = self.forward_tokens(g, t, i);
        let dct = i.dct.expect("Chroma Radiance needs the DCT position code");
        let mut out = nerf.forward(g, img, tokens, dct, p);
        if r.use_x0 {
            out = img.sub(out).div(i.timesteps);
        }
        // The reference returns the padded size; the request's size is what the sampler holds.
        let [ow, oh, oc, on] = out.ne();
        if (ow, oh) != (w, h) {
            let nb = out.nb();
            out = out.view(&[w, h, oc, on], &[nb[1], nb[2], nb[3]], 0).cont();
        }
        out
    }

    /// One evaluation: the latent's prediction `[W, H, C, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, i: &FluxInputs<'g, '_>) -> T<'g> {
        let cfg = &self.config;
        if cfg.radiance.is_some() {
            return self.forward_radiance(g, i);
        }
        let p = cfg.patch_size;
        let [w, h, c, _] = i.x.ne();
        let mut img = pad_and_patchify(g, i.x, p, true);
        let img_tokens = img.ne()[1];
        if let Some(cc) = i.c_concat {
            let nb = cc.nb();
            let [cw, ch, _, _] = cc.ne();
            let slice = |from: i64, len: i64| pad_and_patchify(g, cc.view(&[cw, ch, len, 1], &[nb[1], nb[2], nb[3]], nb[2] * from as usize), p, true);
            let extra = match cfg.variant {
                FluxVariant::Flux | FluxVariant::Flux2 | FluxVariant::Sefi | FluxVariant::ChromaRadiance | FluxVariant::Ovis | FluxVariant::LongCat => None,
                FluxVariant::Fill => Some(slice(0, c).concat(slice(c, 64), 0)),
                FluxVariant::Flex2 => Some(slice(0, c).concat(slice(c, 1), 0).concat(slice(c + 1, c), 0)),
                FluxVariant::Controls => Some(pad_and_patchify(g, cc, p, true)),
            };
            if let Some(e) = extra {
                img = img.concat(e, 0);
            }
        }
        for r in &i.refs {
            img = img.concat(pad_and_patchify(g, *r, p, true), 1);
        }
        let mut out = self.forward_tokens(g, img, i);
        if out.ne()[1] > img_tokens {
            let nb = out.nb();
            let ne = out.ne();
            out = out.view(&[ne[0], img_tokens, ne[2]], &[nb[1], nb[2]], 0).cont();
        }
        unpatchify_and_crop(out, h, w, p, true)
    }

    /// Checks host inputs against the configuration before a graph is built.
    fn check_inputs(&self, x: &Tensor, context: &Tensor, c_concat: Option<&Tensor>, y: Option<&Tensor>, refs: &[Tensor], identity: Option<(&Tensor, f32)>) -> Result<()> {
        let cfg = &self.config;
        let c = cfg.latent_channels() as usize;
        ensure!(x.shape().len() <= 4 && x.ne(3) == 1 && x.ne(2) == c, "Flux takes one latent [W, H, {c}, 1], got {:?}", x.shape());
        ensure!(
            context.ne(0) as i64 == cfg.context_in_dim && context.ne(1) > 0 && context.ne(2) == 1 && context.ne(3) == 1,
            "Flux context must be [{}, L, 1], got {:?}",
            cfg.context_in_dim,
            context.shape()
        );
        let extra = cfg.concat_channels() as usize;
        match c_concat {
            Some(cc) if extra > 0 => ensure!(
                cc.ne(0) == x.ne(0) && cc.ne(1) == x.ne(1) && cc.ne(2) == extra && cc.ne(3) == 1,
                "Flux c_concat must be [{}, {}, {extra}, 1], got {:?}",
                x.ne(0),
                x.ne(1),
                cc.shape()
            ),
            None if extra > 0 => bail!("this Flux model needs {extra} concatenated latent channels (c_concat)"),
            _ => {}
        }
        if cfg.radiance.is_none() {
            let in_ch = (c + extra) as i64 * cfg.patch_size * cfg.patch_size;
            ensure!(in_ch == cfg.in_channels, "Flux img_in takes {} channels, the inputs give {in_ch}", cfg.in_channels);
        }
        if cfg.is_chroma {
            if let Some(y) = y {
                ensure!(y.len() == context.ne(1), "Chroma's text mask has {} values for {} tokens", y.len(), context.ne(1));
            }
        } else if self.vector_in.is_some() {
            let y = y.context("Flux needs the pooled text vector (y)")?;
            ensure!(y.len() as i64 == cfg.vec_in_dim, "Flux y must have {} values, got {:?}", cfg.vec_in_dim, y.shape());
        }
        for r in refs {
            ensure!(r.ne(2) == c && r.ne(3) == 1 && r.ne(0) > 0 && r.ne(1) > 0, "Flux reference latent must be [W, H, {c}, 1], got {:?}", r.shape());
        }
        if let Some((id, _)) = identity.filter(|_| self.takes_identity()) {
            ensure!(
                id.ne(0) as i64 == pulid::ID_DIM && id.ne(2) == 1 && id.ne(3) == 1,
                "the PuLID identity embedding is {} wide, the PuLID modules take {} (shape {:?})",
                id.ne(0),
                pulid::ID_DIM,
                id.shape()
            );
        }
        Ok(())
    }
}

/// Options of a loaded Flux model.
#[derive(Clone, Copy, Debug)]
pub struct FluxOptions {
    /// Chroma: pass the text attention mask to the transformer (`chroma_use_dit_mask`).
    pub use_mask: bool,
}

/// A loaded Flux / Chroma network with its options.
pub struct Flux {
    pub model: Loaded<FluxModel>,
    pub options: FluxOptions,
}

impl Components for Flux {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.model]
    }
}

impl DiffusionModel for Flux {
    fn takes_identity(&self) -> bool {
        self.model.model.takes_identity()
    }

    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let cond = input.cond;
        let context = cond.crossattn.as_ref().context("Flux needs a text context (no text encoder produced one)")?;
        let (model, runner) = self.model.parts();
        let cfg = model.config.clone();
        let y = if cfg.is_chroma && !self.options.use_mask { None } else { cond.vector.as_ref() };
        model.check_inputs(input.x, context, cond.concat.as_ref(), y, input.ref_latents, input.identity)?;
        let p = cfg.patch_size as usize;
        let refs: Vec<(usize, usize)> = input.ref_latents.iter().map(|r| (r.ne(1), r.ne(0))).collect();
        let (w, h) = (input.x.ne(0), input.x.ne(1));
        let circular = (runner.options.circular_x, runner.options.circular_y);
        // Flux.2 (and SeFi) number references one after the other whatever the request says.
        let ref_index_mode = if matches!(cfg.variant, FluxVariant::Flux2 | FluxVariant::Sefi) { RefIndexMode::Increase } else { input.ref_index_mode };
        let images_after = cfg.variant == FluxVariant::LongCat;
        let text = rope::TextIds { len: context.ne(1), arange_axes: &cfg.txt_arange_axes, images_after };
        let pe = rope::flux_pe(h, w, p, text, &refs, ref_index_mode, cfg.ref_index_scale, cfg.theta, &cfg.axes_dim, circular);
        let axes_sum: usize = cfg.axes_dim.iter().sum();
        let pos_len = pe.len() / axes_sum / 2;
        let guidance = if cfg.is_chroma { Some(0.0) } else if cfg.guidance_embed { Some(input.guidance) } else { None };
        let timesteps = input.timesteps.to_vec();
        if cfg.variant == FluxVariant::Sefi {
            ensure!(timesteps.len() == 2, "SeFi-Image takes a semantic and a texture timestep, got {} timesteps", timesteps.len());
        }
        // Like the reference, PuLID sits out passes that skip layers (skip-layer guidance).
        let mut identity = input.identity.filter(|_| model.takes_identity());
        if identity.is_some() && !input.skip_layers.is_empty() {
            sd_warn!("PuLID + skip_layers is not supported; disabling PuLID for this generation.");
            identity = None;
        }
        let mod_index: Vec<f32> = (0..CHROMA_MOD_INDEX_LEN).map(|i| i as f32).collect();
        let dct = cfg.radiance.map(|r| (dct_positions(p, r.nerf_max_freqs as usize), r.nerf_max_freqs * r.nerf_max_freqs));
        runner.compute(|g| {
            let refs = input.ref_latents.iter().map(|r| g.input(r)).collect();
            let inputs = FluxInputs {
                x: g.input(input.x),
                timesteps: g.input_f32(&timesteps, &[timesteps.len() as i64]),
                context: g.input(context),
                c_concat: cond.concat.as_ref().filter(|_| cfg.concat_channels() > 0).map(|t| g.input(t)),
                y: y.map(|t| g.input_f32(t.data(), &[t.len() as i64])),
                guidance: guidance.map(|v| g.input_f32(&[v], &[1])),
                pe: g.input_f32(&pe, &[2, 2, axes_sum as i64 / 2, pos_len as i64]),
                mod_index: cfg.is_chroma.then(|| g.input_f32(&mod_index, &[CHROMA_MOD_INDEX_LEN as i64])),
                dct: dct.as_ref().map(|(v, f)| g.input_f32(v, &[*f, (p * p) as i64])),
                refs,
                skip_layers: input.skip_layers,
                identity: identity.map(|(t, w)| (g.input(t), w)),
            };
            Ok(model.forward(g, &inputs))
        })
    }

}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_indices_are_read_from_names() {
        assert_eq!(block_index("model.diffusion_model.double_blocks.12.img_attn.qkv.weight", "double_blocks."), Some(12));
        assert_eq!(block_index("single_blocks.3.linear1.weight", "single_blocks."), Some(3));
        assert_eq!(block_index("img_in.weight", "single_blocks."), None);
    }

    /// Names (with ggml shapes) of a small Flux-layout network plus `extra`.
    fn detect_with(variant: FluxVariant, extra: &[(&str, &[i64])]) -> FluxConfig {
        let p = "model.diffusion_model.";
        let mut shapes: Vec<(String, Vec<i64>)> = vec![
            (format!("{p}txt_in.weight"), vec![64, 256]),
            (format!("{p}double_blocks.0.txt_attn.norm.key_norm.scale"), vec![128]),
            (format!("{p}single_blocks.1.linear2.weight"), vec![1280, 256]),
        ];
        shapes.extend(extra.iter().map(|(n, s)| (format!("{p}{n}"), s.to_vec())));
        let types: TypeMap = shapes.iter().map(|(n, _)| (n.clone(), F32)).collect();
        let shape_of = |n: &str| shapes.iter().find(|(m, _)| m == n).map(|(_, s)| s.clone());
        FluxConfig::detect(&types, &shape_of, p, variant)
    }

    #[test]
    fn radiance_patches_and_markers_are_read_from_the_weights() {
        let plain = detect_with(FluxVariant::ChromaRadiance, &[("img_in_patch.weight", &[16, 16, 3, 256])]);
        assert_eq!((plain.patch_size, plain.in_channels, plain.latent_channels(), plain.concat_channels()), (16, 3, 3, 0));
        let r = plain.radiance.unwrap();
        assert_eq!((r.use_x0, r.in_kernel, r.halves_input(16)), (false, 16, false));
        assert_eq!((plain.depth, plain.depth_single_blocks, plain.num_heads), (1, 2, 2));
        plain.validate().unwrap();

        let x0 = detect_with(FluxVariant::ChromaRadiance, &[("__x0__", &[1]), ("__32x32__", &[1]), ("img_in_patch.weight", &[16, 16, 3, 256])]);
        let r = x0.radiance.unwrap();
        assert_eq!((x0.patch_size, r.use_x0, r.in_kernel, r.halves_input(32)), (32, true, 16, true));
        x0.validate().unwrap();

        // A kernel that is neither the patch nor half of it: the reference asserts.
        let bad = detect_with(FluxVariant::ChromaRadiance, &[("img_in_patch.weight", &[4, 4, 3, 256])]);
        assert!(bad.validate().unwrap_err().to_string().contains("img_in_patch"));
        // The markers mean nothing to other variants.
        assert_eq!(detect_with(FluxVariant::Flux, &[("__32x32__", &[1])]).patch_size, 2);
    }

    /// SeFi: Flux.2's layout on 144 channels, with `dual_time_embed` declared instead of
    /// `time_in` (half the width each).
    #[test]
    fn sefi_configuration() {
        let cfg = detect_with(FluxVariant::Sefi, &[]);
        assert_eq!((cfg.in_channels, cfg.out_channels, cfg.patch_size, cfg.latent_channels(), cfg.concat_channels()), (144, 144, 1, 144, 0));
        assert!(cfg.share_modulation && cfg.disable_bias && cfg.mlp_silu_act && !cfg.qkv_bias && cfg.vec_in_dim == 0);
        assert_eq!((cfg.txt_arange_axes.as_slice(), cfg.theta, cfg.ref_index_scale), (&[3usize][..], 2000.0, 10.0));
        cfg.validate().unwrap();
        let types: TypeMap = TypeMap::new();
        let mut store = crate::graph::ParamStore::new(4096).unwrap();
        FluxModel::new(&mut Scope::new(&mut store, &types, "model.diffusion_model."), &cfg);
        let names: Vec<&str> = store.entries().map(|e| e.0).collect();
        assert!(names.contains(&"model.diffusion_model.dual_time_embed.texture_embedder.linear_2.weight"));
        assert!(!names.iter().any(|n| n.contains("time_in.") && !n.contains("dual_time_embed")));
        let odd = FluxConfig { hidden_size: 129, num_heads: 1, ..cfg };
        assert!(odd.validate().is_err());
    }

    /// A single-stream block, and a double block stream's MLP half, run a few tokens at a
    /// time give the whole block's values bit for bit (f16 weights through the product
    /// kernels; GELU with biases, SwiGLU with the gate first and last, Ovis's gate / up /
    /// down MLP), with a chunk that leaves a shorter last one.
    #[test]
    fn single_blocks_in_token_chunks_are_the_whole_block() {
        use crate::graph::{Backend, ParamStore, Runner};
        use std::sync::Arc;
        let backend = Arc::new(Backend::cpu().unwrap());
        for variant in [FluxVariant::Flux, FluxVariant::Flux2, FluxVariant::Ovis] {
            let cfg = detect_with(variant, &[]);
            let (h, l) = (cfg.hidden_size, 7i64);
            // Declared once to learn the names, then again with f16 matrices.
            let mut names = ParamStore::new(64).unwrap();
            SingleStreamBlock::new(&mut Scope::new(&mut names, &TypeMap::new(), "b."), &cfg, 0);
            Stream::new(&mut Scope::new(&mut names, &TypeMap::new(), "s."), "img", &cfg);
            let types: TypeMap = names.entries().filter(|e| e.0.ends_with("weight") && e.1.ne()[1] > 1).map(|e| (e.0.to_string(), crate::graph::F16)).collect();
            let mut store = ParamStore::new(64).unwrap();
            let block = SingleStreamBlock::new(&mut Scope::new(&mut store, &types, "b."), &cfg, 0);
            let stream = Stream::new(&mut Scope::new(&mut store, &types, "s."), "img", &cfg);
            store.alloc(&backend).unwrap();
            store
                .load(|name, spec, dst| {
                    let n = spec.ne.iter().product::<i64>() as usize;
                    let seed = name.bytes().fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32));
                    let v: Vec<f32> = crate::testutil::pattern(n, seed).iter().map(|x| if name.contains("norm") { 1.0 + 0.1 * x } else { 0.1 * x }).collect();
                    let bytes: Vec<u8> = if spec.ty == crate::graph::F16 {
                        v.iter().flat_map(|&x| crate::graph::gemm::scalar::f32_to_f16(x).to_le_bytes()).collect()
                    } else {
                        v.iter().flat_map(|x| x.to_le_bytes()).collect()
                    };
                    dst.copy_from_slice(&bytes);
                    Ok(())
                })
                .unwrap();
            let xs = crate::testutil::pattern((h * l) as usize, 3);
            let vecs = crate::testutil::pattern((3 * h) as usize, 5);
            let d = cfg.head_dim();
            let pes = crate::testutil::pattern((4 * d / 2 * l) as usize, 9);
            let mut runner = Runner::new(backend.clone(), 2);
            let out = runner
                .compute_many(|g| {
                    let x = g.input_f32(&xs, &[h, l, 1]);
                    let pe = g.input_f32(&pes, &[2, 2, d / 2, l]);
                    let shared = || Some(ModOut::at(g.input_f32(&vecs, &[h, 1, 3]), 0));
                    let m = shared().unwrap();
                    let x_mod = modulate(block.pre_norm.forward(g, x), m.shift, m.scale);
                    let chunked = block.forward_in_chunks(g, x, x_mod, &m, pe, None, 3).expect("chunked");
                    // A double block stream's MLP half, on `x` as its attention output.
                    let (m1, m2) = (shared().unwrap(), shared().unwrap());
                    let posts = [3, l].map(|c| stream.post(g, x, x, &m1, &m2, c));
                    // (`vec` unused where the modulation is given.)
                    Ok(vec![block.forward(g, x, x, pe, None, shared()), chunked, posts[1], posts[0]])
                })
                .unwrap();
            for pair in out.chunks(2) {
                assert_eq!(pair[0].shape(), pair[1].shape());
                assert!(pair[0].data().iter().map(|v| v.to_bits()).eq(pair[1].data().iter().map(|v| v.to_bits())), "{variant:?}");
                assert!(pair[1].data().iter().all(|v| v.is_finite()) && pair[1].data().iter().any(|&v| v != 0.0));
            }
        }
    }

    #[test]
    fn ovis_configuration() {
        let cfg = detect_with(FluxVariant::Ovis, &[]);
        assert!(cfg.semantic_txt_norm && cfg.yak_mlp && cfg.radiance.is_none());
        assert_eq!((cfg.vec_in_dim, cfg.context_in_dim, cfg.latent_channels()), (0, 64, 16));
        assert_eq!(cfg.txt_arange_axes, [1, 2]);
        assert_eq!(MlpAct::of(&cfg), MlpAct::SwiGluGateLast);
    }

    /// Pixel 0 of the patch is at x = y = 0 (all cosines 1), the last at x = y = 1.
    #[test]
    fn dct_position_code() {
        let dct = dct_positions(16, 8);
        assert_eq!(dct.len(), 256 * 64);
        for fx in 0..8 {
            for fy in 0..8 {
                let coeff = 1.0 / (1.0 + (fx * fy) as f32);
                assert_eq!(dct[fx * 8 + fy], coeff);
                let last = dct[255 * 64 + fx * 8 + fy];
                let sign = if (fx + fy) % 2 == 0 { 1.0 } else { -1.0 };
                assert!((last - sign * coeff).abs() < 1e-5, "{fx} {fy}: {last}");
            }
        }
        // Pixel 1 moves along x only: frequency pair (1, 0) is cos(π/15).
        assert!((dct[64 + 8] - (std::f32::consts::PI / 15.0).cos()).abs() < 1e-6);
    }
}
