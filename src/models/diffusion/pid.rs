//! PiD: a pixel-space DiT that sharpens a low-quality picture given as a reference image
//! (the reference's `pid.hpp`, PixelDiT), guided by Gemma 2's hidden states.
//!
//! - Weights under `model.diffusion_model.net.`: `s_embedder` (16×16 RGB patches to the hidden
//!   size), `t_embedder`, `y_embedder` (the 2304-wide text states, RMS-normed) and the learned
//!   `y_pos_embedding` of the first 300 text tokens, `patch_blocks.N` (MM-DiT blocks: separate
//!   image / text weights and modulations, one joint attention with text first),
//!   `pixel_blocks.N` (per-pixel tokens 16 wide, modulated per patch, attending between
//!   patches through a compressed 1152-wide view), `final_layer`, and `lq_proj`: convolutions
//!   over the reference image's VAE latent (resized to the patch grid, nearest), whose heads
//!   are gated into the patch tokens before every `lq_interval`-th block.
//! - PiD 1.5 (`lq_proj.pit_head`): one more head, gated (`pit_lq_gate`) into the patch tokens
//!   after the last block, where they condition the pixel blocks; its LQ convolutions pad by
//!   repeating the edge, its gates may be one scalar per token, its RoPE grid reference is
//!   128, and a 32-channel projection reads Flux.2's 128-channel latent unpatchified 2×2.
//! - Sizes are the reference's fixed values apart from the block counts (at least 14 / 2), the
//!   MLP width and the LQ projection's width and input channels, read from the weights.
//! - RoPE turns interleaved pairs: text tokens by index, patches by their normalised grid
//!   position (0..16 across the picture) with an NTK-scaled base relative to a 64×64 grid.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, Conv2d, GroupNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{block_index, chunk, modulate, pad_to_patch, patchify, unpatchify, RmsNorm};
use crate::models::common::rope::{self, Ids};
use crate::tensor::Tensor;

pub const HIDDEN: i64 = 1536;
const HEADS: i64 = 24;
const PIXEL_DIM: i64 = 16;
const PIXEL_ATTN: i64 = 1152;
const PIXEL_HEADS: i64 = 16;
const PATCH: i64 = 16;
/// Width of the text states it takes (Gemma 2 2B's).
pub const TXT_DIM: i64 = 2304;
/// Text tokens it reads at most (its learned positions).
pub const TXT_MAX: usize = 300;
const LQ_RES_BLOCKS: usize = 4;
const LQ_SR_SCALE: i64 = 4;
const EPS: f32 = 1e-6;

#[derive(Clone, Debug, PartialEq)]
pub struct PidConfig {
    pub patch_depth: usize,
    pub pixel_depth: usize,
    pub mlp_hidden: i64,
    pub lq_channels: i64,
    pub lq_hidden: i64,
    pub lq_down_factor: i64,
    pub lq_interval: usize,
    /// PiD 1.5's extra LQ head into the pixel stream (`lq_proj.pit_head`).
    pub pit_lq_inject: bool,
    /// Channels of the convolutions' input: the latent's, or a quarter of them when the
    /// latent is unpatchified 2×2 first (`lq_unpatchify` 2).
    pub lq_in: i64,
    pub lq_unpatchify: i64,
    /// The LQ convolutions pad by repeating the edge instead of zeros (PiD 1.5).
    pub lq_replicate_padding: bool,
    /// One gate value per token instead of per channel (PiD 1.5 checkpoints that say so).
    pub lq_gate_per_token: bool,
    /// The patch grid the RoPE bases are scaled against.
    pub rope_ref_grid: usize,
}

impl PidConfig {
    /// The configuration under `prefix` (ending in '.'), like the reference's detection.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> PidConfig {
        let mut cfg = PidConfig {
            patch_depth: 14,
            pixel_depth: 2,
            mlp_hidden: 4096,
            lq_channels: 16,
            lq_hidden: 512,
            lq_down_factor: 8,
            lq_interval: 2,
            pit_lq_inject: false,
            lq_in: 16,
            lq_unpatchify: 1,
            lq_replicate_padding: false,
            lq_gate_per_token: false,
            rope_ref_grid: 64,
        };
        let lq = format!("{prefix}lq_proj.");
        let mut gates = 0;
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            if let Some(i) = block_index(name, "patch_blocks.") {
                cfg.patch_depth = cfg.patch_depth.max(i + 1);
            }
            if let Some(i) = block_index(name, "pixel_blocks.") {
                cfg.pixel_depth = cfg.pixel_depth.max(i + 1);
            }
            let shape = shape_of(name).unwrap_or_default();
            if *name == format!("{lq}latent_proj.0.weight") && shape.len() == 4 {
                (cfg.lq_in, cfg.lq_hidden) = (shape[2], shape[3]);
            }
            if *name == format!("{lq}gate_modules.0.content_proj.weight") && shape.len() >= 2 {
                cfg.lq_gate_per_token = shape[1] == 1;
            }
            if let Some(i) = name.strip_prefix(&format!("{lq}gate_modules.")).and_then(|r| r.split('.').next()?.parse::<usize>().ok()) {
                gates = gates.max(i + 1);
            }
            if name.contains("patch_blocks.0.mlp_x.w1.weight") && shape.len() >= 2 {
                cfg.mlp_hidden = shape[1];
            }
            if *name == format!("{lq}pit_head.weight") {
                cfg.pit_lq_inject = true;
            }
        }
        if gates > 0 {
            cfg.lq_interval = cfg.patch_depth.div_ceil(gates);
        }
        if cfg.pit_lq_inject {
            // 16 channels: an SD3/Flux latent at 1/8; 32: Flux.2's 128 at 1/16, unpatchified.
            // Other widths are refused by `validate` (the reference aborts).
            (cfg.lq_channels, cfg.lq_down_factor, cfg.lq_unpatchify) = if cfg.lq_in == 32 { (128, 16, 2) } else { (cfg.lq_in, 8, 1) };
            (cfg.lq_replicate_padding, cfg.rope_ref_grid) = (true, 128);
        } else {
            cfg.lq_channels = cfg.lq_in;
            cfg.lq_down_factor = if cfg.lq_channels >= 64 { 16 } else { 8 };
            cfg.lq_gate_per_token = false;
        }
        sd_debug!(
            "pid: version = {}, patch_depth = {}, pixel_depth = {}, patch_mlp_hidden_dim = {}, lq_latent_channels = {}, lq_hidden_dim = {}, lq_latent_down_factor = {}, lq_latent_unpatchify_factor = {}, lq_interval = {}",
            if cfg.pit_lq_inject { "1.5" } else { "1" },
            cfg.patch_depth,
            cfg.pixel_depth,
            cfg.mlp_hidden,
            cfg.lq_channels,
            cfg.lq_hidden,
            cfg.lq_down_factor,
            cfg.lq_unpatchify,
            cfg.lq_interval
        );
        cfg
    }

    /// What this implementation does not run.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            !self.pit_lq_inject || matches!(self.lq_in, 16 | 32),
            "PiD 1.5's LQ projection reads 16 or 32 channels (a 16-channel latent, or Flux.2's 128 unpatchified), not {} (stable-diffusion.cpp aborts here)",
            self.lq_in
        );
        ensure!(self.lq_hidden % 4 == 0, "PiD's LQ projection groups its {} channels in 4 groups", self.lq_hidden);
        ensure!(LQ_SR_SCALE * self.lq_down_factor / self.lq_unpatchify >= PATCH, "PiD's LQ latent is coarser than its patches");
        Ok(())
    }

    /// Gated LQ heads: one per `lq_interval` patch blocks.
    fn lq_outputs(&self) -> usize {
        self.patch_depth.div_ceil(self.lq_interval)
    }
}

/// `w2(silu(w1 x) · w3 x)`.
#[derive(Clone, Copy, Debug)]
struct FeedForward {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl FeedForward {
    fn new(s: &mut Scope, name: &str, dim: i64, hidden: i64) -> FeedForward {
        let mut s = s.sub(name);
        FeedForward { w1: Linear::new(&mut s, "w1", dim, hidden, false), w2: Linear::new(&mut s, "w2", hidden, dim, false), w3: Linear::new(&mut s, "w3", dim, hidden, false) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.w1.forward(g, x).silu_inplace().mul_inplace(self.w3.forward(g, x));
        self.w2.forward(g, h)
    }
}

fn norm(s: &mut Scope, name: &str, dim: i64) -> RmsNorm {
    RmsNorm::new(s, name, "weight", dim, EPS, true)
}

/// q, k, v of a fused projection, each `[d, heads, L, N]`.
fn qkv_heads<'g>(qkv: T<'g>, heads: i64) -> [T<'g>; 3] {
    let (q, k, v) = nn::split_qkv(qkv);
    let [c, l, n, _] = q.ne();
    let r = |t: T<'g>| t.reshape(&[c / heads, heads, l, n]);
    [r(q), r(k), r(v)]
}

/// Tokens `[from, to)` of `x` `[C, L, N]`, dense.
fn tokens<'g>(x: T<'g>, from: i64, to: i64) -> T<'g> {
    let [c, _, n, m] = x.ne();
    let nb = x.nb();
    x.view(&[c, to - from, n, m], &[nb[1], nb[2], nb[3]], nb[1] * from as usize).cont()
}

/// `[C, N]` → `[C, 1, N]`, broadcast over tokens.
fn per_item(t: T<'_>) -> T<'_> {
    let ne = t.ne();
    t.reshape(&[ne[0], 1, ne[1]])
}

#[derive(Clone, Copy, Debug)]
struct JointAttention {
    qkv_x: Linear,
    qkv_y: Linear,
    q_norm_x: RmsNorm,
    k_norm_x: RmsNorm,
    q_norm_y: RmsNorm,
    k_norm_y: RmsNorm,
    proj_x: Linear,
    proj_y: Linear,
}

impl JointAttention {
    fn new(s: &mut Scope) -> JointAttention {
        let d = HIDDEN / HEADS;
        JointAttention {
            qkv_x: Linear::new(s, "qkv_x", HIDDEN, 3 * HIDDEN, false),
            qkv_y: Linear::new(s, "qkv_y", HIDDEN, 3 * HIDDEN, false),
            q_norm_x: norm(s, "q_norm_x", d),
            k_norm_x: norm(s, "k_norm_x", d),
            q_norm_y: norm(s, "q_norm_y", d),
            k_norm_y: norm(s, "k_norm_y", d),
            proj_x: Linear::new(s, "proj_x", HIDDEN, HIDDEN, true),
            proj_y: Linear::new(s, "proj_y", HIDDEN, HIDDEN, true),
        }
    }

    /// Text first in the joint sequence; `pe` covers text then image tokens.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, y: T<'g>, pe: T<'g>) -> (T<'g>, T<'g>) {
        let (nx, ny) = (x.ne()[1], y.ne()[1]);
        let [qx, kx, vx] = qkv_heads(self.qkv_x.forward(g, x), HEADS);
        let (qx, kx) = (self.q_norm_x.forward(g, qx), self.k_norm_x.forward(g, kx));
        let [qy, ky, vy] = qkv_heads(self.qkv_y.forward(g, y), HEADS);
        let (qy, ky) = (self.q_norm_y.forward(g, qy), self.k_norm_y.forward(g, ky));
        let out = rope::attention(g, qy.concat(qx, 2), ky.concat(kx, 2), vy.concat(vx, 2), pe, None);
        let (out_y, out_x) = (tokens(out, 0, ny), tokens(out, ny, ny + nx));
        (self.proj_x.forward(g, out_x), self.proj_y.forward(g, out_y))
    }
}

#[derive(Clone, Copy, Debug)]
struct PatchBlock {
    norm_x1: RmsNorm,
    norm_y1: RmsNorm,
    attn: JointAttention,
    norm_x2: RmsNorm,
    norm_y2: RmsNorm,
    mlp_x: FeedForward,
    mlp_y: FeedForward,
    ada_img: Linear,
    ada_txt: Linear,
}

impl PatchBlock {
    fn new(s: &mut Scope, cfg: &PidConfig) -> PatchBlock {
        PatchBlock {
            norm_x1: norm(s, "norm_x1", HIDDEN),
            norm_y1: norm(s, "norm_y1", HIDDEN),
            attn: JointAttention::new(&mut s.sub("attn")),
            norm_x2: norm(s, "norm_x2", HIDDEN),
            norm_y2: norm(s, "norm_y2", HIDDEN),
            mlp_x: FeedForward::new(s, "mlp_x", HIDDEN, cfg.mlp_hidden),
            mlp_y: FeedForward::new(s, "mlp_y", HIDDEN, cfg.mlp_hidden),
            ada_img: Linear::new(s, "adaLN_modulation_img.0", HIDDEN, 6 * HIDDEN, true),
            ada_txt: Linear::new(s, "adaLN_modulation_txt.0", HIDDEN, 6 * HIDDEN, true),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, y: T<'g>, c: T<'g>, pe: T<'g>) -> (T<'g>, T<'g>) {
        let mx = chunk(self.ada_img.forward(g, c), 6, 0, true);
        let my = chunk(self.ada_txt.forward(g, c), 6, 0, true);
        let x_norm = modulate(self.norm_x1.forward(g, x), mx[0], mx[1]);
        let y_norm = modulate(self.norm_y1.forward(g, y), my[0], my[1]);
        let (ax, ay) = self.attn.forward(g, x_norm, y_norm, pe);
        let x = x.add(ax.mul(per_item(mx[2])));
        let y = y.add(ay.mul(per_item(my[2])));
        let x_mlp = self.mlp_x.forward(g, modulate(self.norm_x2.forward(g, x), mx[3], mx[4]));
        let y_mlp = self.mlp_y.forward(g, modulate(self.norm_y2.forward(g, y), my[3], my[4]));
        (x.add(x_mlp.mul(per_item(mx[5]))), y.add(y_mlp.mul(per_item(my[5]))))
    }
}

/// Self-attention between the compressed patches of the pixel stream.
#[derive(Clone, Copy, Debug)]
struct RotaryAttention {
    qkv: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    proj: Linear,
}

impl RotaryAttention {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [q, k, v] = qkv_heads(self.qkv.forward(g, x), PIXEL_HEADS);
        let (q, k) = (self.q_norm.forward(g, q), self.k_norm.forward(g, k));
        self.proj.forward(g, rope::attention_scaled(g, q, k, v, pe, None, 1.0 / 128.0))
    }
}

#[derive(Clone, Copy, Debug)]
struct PixelBlock {
    compress: Linear,
    expand: Linear,
    norm1: RmsNorm,
    attn: RotaryAttention,
    norm2: RmsNorm,
    fc1: Linear,
    fc2: Linear,
    ada: Linear,
}

impl PixelBlock {
    fn new(s: &mut Scope) -> PixelBlock {
        let p2 = PATCH * PATCH;
        let mut a = s.sub("attn");
        let attn = RotaryAttention {
            qkv: Linear::new(&mut a, "qkv", PIXEL_ATTN, 3 * PIXEL_ATTN, false),
            q_norm: norm(&mut a, "q_norm", PIXEL_ATTN / PIXEL_HEADS),
            k_norm: norm(&mut a, "k_norm", PIXEL_ATTN / PIXEL_HEADS),
            proj: Linear::new(&mut a, "proj", PIXEL_ATTN, PIXEL_ATTN, true),
        };
        let mut m = s.sub("mlp");
        let (fc1, fc2) = (Linear::new(&mut m, "fc1", PIXEL_DIM, 4 * PIXEL_DIM, true), Linear::new(&mut m, "fc2", 4 * PIXEL_DIM, PIXEL_DIM, true));
        PixelBlock {
            compress: Linear::new(s, "compress_to_attn", p2 * PIXEL_DIM, PIXEL_ATTN, true),
            expand: Linear::new(s, "expand_from_attn", PIXEL_ATTN, p2 * PIXEL_DIM, true),
            norm1: norm(s, "norm1", PIXEL_DIM),
            attn,
            norm2: norm(s, "norm2", PIXEL_DIM),
            fc1,
            fc2,
            ada: Linear::new(s, "adaLN_modulation.0", HIDDEN, 6 * PIXEL_DIM * p2, true),
        }
    }

    /// `x` `[16, p², L·N]` (pixels of each patch), `s_cond` `[hidden, L·N]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, s_cond: T<'g>, l: i64, pe: T<'g>) -> T<'g> {
        let p2 = PATCH * PATCH;
        let bl = x.ne()[2];
        let ada = self.ada.forward(g, s_cond).reshape(&[6 * PIXEL_DIM, p2, bl]);
        let m = chunk(ada, 6, 0, true);
        let adaln = |x: T<'g>, shift: T<'g>, scale: T<'g>| x.add(x.mul(scale)).add(shift);
        let x_norm = adaln(self.norm1.forward(g, x), m[0], m[1]);
        let comp = self.compress.forward(g, x_norm.reshape(&[p2 * PIXEL_DIM, bl])).reshape(&[PIXEL_ATTN, l, bl / l]);
        let attn = self.attn.forward(g, comp, pe);
        let attn = self.expand.forward(g, attn.reshape(&[PIXEL_ATTN, bl])).reshape(&[PIXEL_DIM, p2, bl]);
        let x = x.add(attn.mul(m[2]));
        let h = self.fc1.forward(g, adaln(self.norm2.forward(g, x), m[3], m[4])).gelu_inplace();
        x.add(self.fc2.forward(g, h).mul(m[5]))
    }
}

/// A 3×3 convolution of the LQ projection: zero padding, or (PiD 1.5) none after the input's
/// edge is repeated once around it.
#[derive(Clone, Copy, Debug)]
struct LqConv {
    conv: Conv2d,
    replicate: bool,
}

impl LqConv {
    fn new(s: &mut Scope, name: &str, cin: i64, cout: i64, replicate: bool) -> LqConv {
        LqConv { conv: Conv2d::square(s, name, cin, cout, 3, 1, if replicate { 0 } else { 1 }), replicate }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.conv.forward(g, if self.replicate { replicate_pad(x) } else { x })
    }
}

/// `x` `[W, H, C, N]` with its first and last column, then row, repeated once outside.
fn replicate_pad(x: T<'_>) -> T<'_> {
    let [w, ..] = x.ne();
    let x = edge(x, 0, 0).concat(x, 0).concat(edge(x, 0, w - 1), 0);
    let [_, h, ..] = x.ne();
    edge(x, 1, 0).concat(x, 1).concat(edge(x, 1, h - 1), 1)
}

/// The slice of `x` at index `at` of dimension `dim`, dense.
fn edge(x: T<'_>, dim: usize, at: i64) -> T<'_> {
    let mut ne = x.ne();
    ne[dim] = 1;
    let nb = x.nb();
    x.view(&ne, &[nb[1], nb[2], nb[3]], nb[dim] * at as usize).cont()
}

/// GroupNorm, SiLU, conv, twice, plus the input. The reference declares its group norms with
/// eps 1e-5 but normalises with 1e-6 (its group-norm helper's own), so 1e-6 it is.
#[derive(Clone, Copy, Debug)]
struct ResBlock {
    norm1: GroupNorm,
    conv1: LqConv,
    norm2: GroupNorm,
    conv2: LqConv,
}

impl ResBlock {
    fn new(s: &mut Scope, ch: i64, replicate: bool) -> ResBlock {
        let mut b = s.sub("block");
        ResBlock {
            norm1: GroupNorm::new(&mut b, "0", 4, ch, true),
            conv1: LqConv::new(&mut b, "2", ch, ch, replicate),
            norm2: GroupNorm::new(&mut b, "3", 4, ch, true),
            conv2: LqConv::new(&mut b, "5", ch, ch, replicate),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let h = self.conv1.forward(g, self.norm1.forward(g, x).silu_inplace());
        let h = self.conv2.forward(g, self.norm2.forward(g, h).silu_inplace());
        x.add(h)
    }
}

/// `x + lq · σ(content_proj([x, lq]) - e^log_alpha · degrade_sigma)`; the projection gives
/// one value per channel, or one per token.
#[derive(Clone, Copy, Debug)]
struct Gate {
    content_proj: Linear,
    log_alpha: W,
}

impl Gate {
    fn new(s: &mut Scope, name: &str, per_token: bool) -> Gate {
        let mut gs = s.sub(name);
        let out = if per_token { 1 } else { HIDDEN };
        Gate { content_proj: Linear::new(&mut gs, "content_proj", 2 * HIDDEN, out, true), log_alpha: gs.tensor("log_alpha", F32, &[1]) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, lq: T<'g>, sigma: T<'g>) -> T<'g> {
        let logit = self.content_proj.forward(g, x.concat(lq, 0));
        let sigma = sigma.reshape(&[1, 1, sigma.ne()[0]]);
        let offset = g.param(self.log_alpha).exp().mul(sigma).neg();
        x.add(lq.mul(logit.add(offset).sigmoid()))
    }
}

#[derive(Debug)]
struct LqProjection {
    conv0: LqConv,
    conv2: LqConv,
    res: Vec<ResBlock>,
    heads: Vec<Linear>,
    gates: Vec<Gate>,
    /// PiD 1.5's head for the tokens after the patch blocks.
    pit_head: Option<Linear>,
    unpatchify: i64,
}

impl LqProjection {
    fn new(s: &mut Scope, cfg: &PidConfig) -> LqProjection {
        let (h, rep) = (cfg.lq_hidden, cfg.lq_replicate_padding);
        let conv0 = LqConv::new(s, "latent_proj.0", cfg.lq_in, h, rep);
        let conv2 = LqConv::new(s, "latent_proj.2", h, h, rep);
        let res = (0..LQ_RES_BLOCKS).map(|i| ResBlock::new(&mut s.sub(&format!("latent_proj.{}", 3 + i)), h, rep)).collect();
        let heads = (0..cfg.lq_outputs()).map(|i| Linear::new(s, &format!("output_heads.{i}"), h, HIDDEN, true)).collect();
        let gates = (0..cfg.lq_outputs()).map(|i| Gate::new(s, &format!("gate_modules.{i}"), cfg.lq_gate_per_token)).collect();
        let pit_head = cfg.pit_lq_inject.then(|| Linear::new(s, "pit_head", h, HIDDEN, true));
        LqProjection { conv0, conv2, res, heads, gates, pit_head, unpatchify: cfg.lq_unpatchify }
    }

    /// The heads' features `[hidden, hs·ws, N]` of the latent `[w, h, C, N]` (unpatchified
    /// first when the projection says so), resized to the patch grid; PiD 1.5's pixel-stream
    /// head last.
    fn forward<'g>(&self, g: &'g Graph, lq: T<'g>, hs: i64, ws: i64) -> Vec<T<'g>> {
        let lq = if self.unpatchify > 1 {
            let [w, h, c, n] = lq.ne();
            let rows = lq.permute_axes([2, 0, 1, 3]).cont().reshape(&[c, w * h, n]);
            unpatchify(rows, h, w, self.unpatchify, true)
        } else {
            lq
        };
        let [w, h, c, n] = lq.ne();
        let lq = if (w, h) != (ws, hs) { lq.interpolate([ws, hs, c, n], ggml_sys::GGML_SCALE_MODE_NEAREST) } else { lq };
        let feat = self.conv2.forward(g, self.conv0.forward(g, lq).silu_inplace());
        let feat = self.res.iter().fold(feat, |f, b| b.forward(g, f));
        let ch = feat.ne()[2];
        let tokens = feat.permute_axes([2, 0, 1, 3]).cont().reshape(&[ch, hs * ws, n]);
        self.heads.iter().chain(&self.pit_head).map(|head| head.forward(g, tokens)).collect()
    }
}

/// A PiD transformer whose weights live in a `ParamStore`.
pub struct PidModel {
    pub config: PidConfig,
    pixel_embedder: Linear,
    s_embedder: Linear,
    t_mlp_0: Linear,
    t_mlp_2: Linear,
    y_proj: Linear,
    y_norm: RmsNorm,
    y_pos: W,
    patch_blocks: Vec<PatchBlock>,
    pixel_blocks: Vec<PixelBlock>,
    final_norm: RmsNorm,
    final_linear: Linear,
    lq: LqProjection,
    /// PiD 1.5: gates the pixel-stream LQ head into the patch tokens after the blocks.
    pit_gate: Option<Gate>,
}

/// The position tables of one evaluation: text then patches for the joint attention, the
/// pixels' absolute positions, the patches for the pixel attention.
struct Tables {
    joint: Vec<f32>,
    pixel: Vec<f32>,
    pixel_comp: Vec<f32>,
}

impl PidModel {
    pub fn new(s: &mut Scope, cfg: &PidConfig) -> PidModel {
        let mut t = s.sub("t_embedder");
        let t_mlp_0 = Linear::with_options(&mut t, "mlp.0", 256, HIDDEN, true, true);
        let t_mlp_2 = Linear::with_options(&mut t, "mlp.2", HIDDEN, HIDDEN, true, true);
        let mut y = s.sub("y_embedder");
        let (y_proj, y_norm) = (Linear::new(&mut y, "proj", TXT_DIM, HIDDEN, true), norm(&mut y, "norm", HIDDEN));
        let mut f = s.sub("final_layer");
        let (final_norm, final_linear) = (norm(&mut f, "norm", PIXEL_DIM), Linear::new(&mut f, "linear", PIXEL_DIM, 3, true));
        PidModel {
            config: cfg.clone(),
            pixel_embedder: Linear::new(&mut s.sub("pixel_embedder"), "proj", 3, PIXEL_DIM, true),
            s_embedder: Linear::new(&mut s.sub("s_embedder"), "proj", 3 * PATCH * PATCH, HIDDEN, true),
            t_mlp_0,
            t_mlp_2,
            y_proj,
            y_norm,
            y_pos: s.tensor("y_pos_embedding", F32, &[HIDDEN, TXT_MAX as i64, 1]),
            patch_blocks: (0..cfg.patch_depth).map(|i| PatchBlock::new(&mut s.sub(&format!("patch_blocks.{i}")), cfg)).collect(),
            pixel_blocks: (0..cfg.pixel_depth).map(|i| PixelBlock::new(&mut s.sub(&format!("pixel_blocks.{i}")))).collect(),
            final_norm,
            final_linear,
            lq: LqProjection::new(&mut s.sub("lq_proj"), cfg),
            pit_gate: cfg.pit_lq_inject.then(|| Gate::new(s, "pit_lq_gate", cfg.lq_gate_per_token)),
        }
    }

    /// One evaluation: the picture `x` `[W, H, 3, 1]`, timestep `t` `[1]`, text `context`
    /// `[2304, Ltxt, 1]` (Ltxt ≤ 300), the LQ latent `[w, h, C, 1]`, the degradation level
    /// `[1]` and the tables → `[W, H, 3, 1]`.
    #[allow(clippy::too_many_arguments)]
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, context: T<'g>, lq: T<'g>, sigma: T<'g>, pe: T<'g>, pixel_pos: T<'g>, pixel_pe: T<'g>) -> T<'g> {
        let cfg = &self.config;
        let [w_orig, h_orig, _, _] = x.ne();
        let x = pad_to_patch(g, x, PATCH);
        let [w, h, _, n] = x.ne();
        let (hs, ws) = (h / PATCH, w / PATCH);
        let l = hs * ws;
        let p2 = PATCH * PATCH;

        let x_patches = patchify(x, PATCH, true);
        let t_emb = self.t_mlp_2.forward(g, self.t_mlp_0.forward(g, t.timestep_embedding(256, 10)).silu_inplace());
        let c = t_emb.silu();
        let ltxt = context.ne()[1];
        let y = self.y_norm.forward(g, self.y_proj.forward(g, context));
        let y_pos = g.param(self.y_pos);
        let y_pos = if ltxt == TXT_MAX as i64 { y_pos } else { tokens(y_pos, 0, ltxt) };
        let mut y = y.add(y_pos);

        let mut lq = self.lq.forward(g, lq, hs, ws);
        let pit_lq = if self.pit_gate.is_some() { lq.pop() } else { None };
        let mut s = self.s_embedder.forward(g, x_patches);
        for (i, block) in self.patch_blocks.iter().enumerate() {
            if i % cfg.lq_interval == 0 {
                let k = i / cfg.lq_interval;
                if k < lq.len() {
                    s = self.lq.gates[k].forward(g, s, lq[k], sigma);
                }
            }
            (s, y) = block.forward(g, s, y, c, pe);
        }
        let mut s = s.add(t_emb).silu();
        if let (Some(gate), Some(pit_lq)) = (&self.pit_gate, pit_lq) {
            s = gate.forward(g, s, pit_lq, sigma);
        }
        let s_cond = s.reshape(&[HIDDEN, l * n]);

        // Pixel tokens: [16, p², L·N], each patch's pixels with channels fastest.
        let px = x.permute_axes([2, 0, 1, 3]).cont().reshape(&[3, w * h, n]);
        let px = self.pixel_embedder.forward(g, px).add(pixel_pos).reshape(&[PIXEL_DIM, w, h, n]);
        let px = px.permute_axes([1, 2, 0, 3]).cont();
        let mut px = patchify(px, PATCH, false).reshape(&[PIXEL_DIM, p2, l * n]);
        for block in &self.pixel_blocks {
            px = block.forward(g, px, s_cond, l, pixel_pe);
        }
        let out = self.final_linear.forward(g, self.final_norm.forward(g, px)).reshape(&[3 * p2, l, n]);
        let out = unpatchify(out, hs, ws, PATCH, false);
        if (w, h) == (w_orig, h_orig) {
            return out;
        }
        let nb = out.nb();
        out.view(&[w_orig, h_orig, 3, n], &[nb[1], nb[2], nb[3]], 0).cont()
    }

    fn tables(&self, hs: usize, ws: usize, ltxt: usize) -> Tables {
        let head = (HIDDEN / HEADS) as usize;
        let mut joint = rope::embed_nd(&Ids { n_axes: 1, data: (0..ltxt).map(|i| i as f32).collect() }, 10000.0, &[head], None);
        let grid = self.config.rope_ref_grid;
        joint.extend(rope_2d(hs, ws, head, grid));
        let pixel_comp = rope_2d(hs, ws, (PIXEL_ATTN / PIXEL_HEADS) as usize, grid);
        Tables { joint, pixel: pixel_abs_pos(hs * PATCH as usize, ws * PATCH as usize, PIXEL_DIM as usize), pixel_comp }
    }
}

/// The patches' rotations (the reference's `embed_2d_interleaved`): per patch `dim / 2`
/// rotations alternating x and y, positions spread over 0..16 across the grid, each axis's
/// base scaled by (its patches / `ref_grid`)^(d / (d - 2)).
fn rope_2d(h: usize, w: usize, dim: usize, ref_grid: usize) -> Vec<f32> {
    let axis = dim / 2;
    let power = axis as f32 / (axis as f32 - 2.0);
    let h_ntk = (h as f32 / ref_grid as f32).powf(power);
    let w_ntk = (w as f32 / ref_grid as f32).powf(power);
    let coord = |i: usize, n: usize| if n == 1 { 0.0 } else { 16.0 * i as f32 / (n - 1) as f32 };
    let xs: Vec<f32> = (0..h).flat_map(|_| (0..w).map(move |ix| coord(ix, w))).collect();
    let ys: Vec<f32> = (0..h).flat_map(|iy| std::iter::repeat_n(coord(iy, h), w)).collect();
    let x_emb = rope::embed_nd(&Ids { n_axes: 1, data: xs }, 10000.0 * w_ntk, &[axis], None);
    let y_emb = rope::embed_nd(&Ids { n_axes: 1, data: ys }, 10000.0 * h_ntk, &[axis], None);
    let per = axis / 2 * 4;
    let mut out = Vec::with_capacity(h * w * dim / 2 * 4);
    for p in 0..h * w {
        for i in 0..axis / 2 {
            out.extend_from_slice(&x_emb[p * per + i * 4..p * per + i * 4 + 4]);
            out.extend_from_slice(&y_emb[p * per + i * 4..p * per + i * 4 + 4]);
        }
    }
    out
}

/// The pixels' absolute positions `[dim, h·w]`: sin-cos of the column, then of the row.
fn pixel_abs_pos(h: usize, w: usize, dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let quarter = half / 2;
    let freqs: Vec<f32> = (0..quarter).map(|i| (-(10000f64.ln()) * i as f64 / quarter as f64).exp() as f32).collect();
    let emb = |p: f32, out: &mut Vec<f32>| {
        out.extend(freqs.iter().map(|&f| (p * f).sin()));
        out.extend(freqs.iter().map(|&f| (p * f).cos()));
    };
    let mut out = Vec::with_capacity(h * w * dim);
    for iy in 0..h {
        for ix in 0..w {
            emb(ix as f32, &mut out);
            emb(iy as f32, &mut out);
        }
    }
    out
}

/// A loaded PiD transformer.
pub type Pid = Loaded<PidModel>;

impl DiffusionModel for Loaded<PidModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let context = input.cond.crossattn.as_ref().context("PiD needs a text context")?;
        let lq = input.ref_latents.first().context("PiD requires a reference image (ref_images)")?;
        let (model, runner) = self.parts();
        let x = input.x;
        ensure!(
            x.shape().len() <= 4 && x.ne(2) == 3 && x.ne(3) == 1,
            "PiD denoises one RGB picture [W, H, 3, 1], got {:?} (an init image becomes the VAE's latent, which PiD cannot start from: stable-diffusion.cpp aborts there)",
            x.shape()
        );
        ensure!(
            context.ne(0) as i64 == TXT_DIM && context.ne(2) == 1,
            "PiD takes text states {TXT_DIM} wide, got {:?} (its text encoder is Gemma 2 2B)",
            context.shape()
        );
        ensure!(
            lq.ne(2) as i64 == model.config.lq_channels && lq.ne(3) == 1,
            "PiD's LQ projection takes latents of {} channels, the reference image's latent is {:?} (see vae_format)",
            model.config.lq_channels,
            lq.shape()
        );
        let p = PATCH as usize;
        let (hs, ws) = (x.ne(1).div_ceil(p), x.ne(0).div_ceil(p));
        let ltxt = context.ne(1).min(TXT_MAX);
        let tables = model.tables(hs, ws, ltxt);
        let t = input.timesteps.first().copied().context("PiD needs a timestep")?;
        let (head, pixel_head) = (HIDDEN / HEADS / 2, PIXEL_ATTN / PIXEL_HEADS / 2);
        runner.compute(|g| {
            let xi = g.input(x);
            let t = g.input_f32(&[t], &[1]);
            let ctx = g.input(context);
            let ctx = if ltxt == context.ne(1) { ctx } else { tokens(ctx, 0, ltxt as i64) };
            let lq = g.input(lq);
            let sigma = g.input_f32(&[0.0], &[1]);
            let pe = g.input_f32(&tables.joint, &[2, 2, head, (ltxt + hs * ws) as i64]);
            let pixel_pos = g.input_f32(&tables.pixel, &[PIXEL_DIM, (hs * ws * p * p) as i64, 1]);
            let pixel_pe = g.input_f32(&tables.pixel_comp, &[2, 2, pixel_head, (hs * ws) as i64]);
            Ok(model.forward(g, xi, t, ctx, lq, sigma, pe, pixel_pos, pixel_pe))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The config of tensors `(name under "net.", ggml shape)`.
    fn detect(tensors: &[(&str, &[i64])]) -> PidConfig {
        let shapes: HashMap<String, Vec<i64>> = tensors.iter().map(|(n, s)| (format!("net.{n}"), s.to_vec())).collect();
        let types: TypeMap = shapes.keys().map(|n| (n.clone(), F32)).collect();
        PidConfig::detect(&types, &|n| shapes.get(n).cloned(), "net.")
    }

    #[test]
    fn pid_15_layouts() {
        let v1 = detect(&[("lq_proj.latent_proj.0.weight", &[3, 3, 16, 32]), ("lq_proj.gate_modules.0.content_proj.weight", &[3072, 1])]);
        assert!(!v1.pit_lq_inject && !v1.lq_gate_per_token && !v1.lq_replicate_padding);
        assert_eq!((v1.lq_channels, v1.lq_unpatchify, v1.rope_ref_grid), (16, 1, 64));
        let pit = [("lq_proj.pit_head.weight", &[32i64, 1536][..])];
        let v15 = detect(&[pit[0], ("lq_proj.latent_proj.0.weight", &[3, 3, 16, 32]), ("lq_proj.gate_modules.0.content_proj.weight", &[3072, 1536])]);
        assert!(v15.pit_lq_inject && !v15.lq_gate_per_token && v15.lq_replicate_padding);
        assert_eq!((v15.lq_channels, v15.lq_down_factor, v15.lq_unpatchify, v15.rope_ref_grid), (16, 8, 1, 128));
        v15.validate().unwrap();
        let flux2 = detect(&[pit[0], ("lq_proj.latent_proj.0.weight", &[3, 3, 32, 32]), ("lq_proj.gate_modules.0.content_proj.weight", &[3072, 1])]);
        assert!(flux2.lq_gate_per_token);
        assert_eq!((flux2.lq_channels, flux2.lq_down_factor, flux2.lq_unpatchify), (128, 16, 2));
        flux2.validate().unwrap();
        assert!(detect(&[pit[0], ("lq_proj.latent_proj.0.weight", &[3, 3, 128, 32])]).validate().is_err());
    }

    #[test]
    fn replicate_pad_repeats_the_edges() {
        use crate::graph::{Backend, Runner};
        let x: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let out = Runner::new(std::sync::Arc::new(Backend::cpu().unwrap()), 1).compute(|g| Ok(replicate_pad(g.input_f32(&x, &[3, 2, 1, 1])))).unwrap();
        assert_eq!(out.shape()[..2], [5, 4]);
        #[rustfmt::skip]
        assert_eq!(out.data(), &[
            0., 0., 1., 2., 2.,
            0., 0., 1., 2., 2.,
            3., 3., 4., 5., 5.,
            3., 3., 4., 5., 5.,
        ]);
    }
}
