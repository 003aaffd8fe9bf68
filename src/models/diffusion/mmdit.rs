//! SD3 / SD3.5's MMDiT, like the reference's `mmdit.hpp`: joint blocks in which the text
//! (`context_block`) and image (`x_block`) streams attend together, adaLN modulation from the
//! timestep and pooled text embedding, a learned positional table cropped to the latent,
//! optional RMS / layer-norm q-k normalisation (SD3.5) and MMDiT-X's extra image
//! self-attention (`attn2`, SD3.5 Medium).
//!
//! Weights under `model.diffusion_model.` with the original names (`x_embedder.proj`,
//! `pos_embed`, `t_embedder.mlp.{0,2}`, `y_embedder.mlp.{0,2}`, `context_embedder`,
//! `joint_blocks.N.{context_block,x_block}.{adaLN_modulation.1,attn,attn2,mlp.fc1,mlp.fc2}`,
//! `final_layer`). Like the reference, the head count equals the block count.

use super::{DiffusionInput, DiffusionModel};
use crate::error::{Context as _, Result};
use crate::graph::nn::{self, Conv2d, LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Scope, TypeMap, F32, T, W};
use crate::models::common::dit::{chunk, modulate, timestep_embedding, unpatchify_and_crop, MlpEmbedder, RmsNorm};
use crate::tensor::Tensor;

/// q/k normalisation of the attention heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    Rms,
    Layer,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MmditConfig {
    pub patch_size: i64,
    pub in_channels: i64,
    pub out_channels: i64,
    pub depth: usize,
    /// Blocks `0..=d_self` have MMDiT-X's image self-attention (`None`: none).
    pub d_self: Option<usize>,
    pub mlp_ratio: f32,
    pub adm_in_channels: i64,
    pub pos_embed_max_size: i64,
    pub num_patches: i64,
    pub context_size: i64,
    pub context_embedder_out_dim: i64,
    pub hidden_size: i64,
    pub qk_norm: QkNorm,
}

impl MmditConfig {
    /// The configuration under `prefix`, read from the weights like the reference (at least
    /// 24 blocks, widths, patch size, q-k norm, MMDiT-X blocks).
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> MmditConfig {
        let mut cfg = MmditConfig {
            patch_size: 2,
            in_channels: 16,
            out_channels: 16,
            depth: 24,
            d_self: None,
            mlp_ratio: 4.0,
            adm_in_channels: 2048,
            pos_embed_max_size: 192,
            num_patches: 192 * 192,
            context_size: 4096,
            context_embedder_out_dim: 1536,
            hidden_size: 1536,
            qk_norm: QkNorm::None,
        };
        let (mut has_pos, mut has_hidden, mut has_context) = (false, false, false);
        let mut names: Vec<&String> = types.keys().filter(|n| n.starts_with(prefix)).collect();
        names.sort();
        for name in names {
            let ne = shape_of(name).unwrap_or_default();
            let dims = ne.len();
            if name.contains("x_embedder.proj.weight") && dims == 4 {
                has_hidden = true;
                cfg.patch_size = ne[0];
                cfg.in_channels = ne[2];
                cfg.hidden_size = ne[3];
            } else if name.contains("t_embedder.mlp.0.weight") && dims == 2 {
                has_hidden = true;
                cfg.hidden_size = ne[1];
            } else if name.contains("y_embedder.mlp.0.weight") && dims == 2 {
                has_hidden = true;
                cfg.adm_in_channels = ne[0];
                cfg.hidden_size = ne[1];
            } else if name.contains("context_embedder.weight") && dims == 2 {
                has_context = true;
                cfg.context_size = ne[0];
                cfg.context_embedder_out_dim = ne[1];
            } else if name.contains("final_layer.linear.weight") && dims == 2 {
                has_hidden = true;
                cfg.hidden_size = ne[0];
                let area = cfg.patch_size * cfg.patch_size;
                if area > 0 {
                    cfg.out_channels = ne[1] / area;
                }
            } else if name.contains("pos_embed") && dims == 3 {
                has_pos = true;
                has_hidden = true;
                cfg.hidden_size = ne[0];
                cfg.num_patches = ne[1];
                if let Some(s) = (1..).take_while(|s| s * s <= cfg.num_patches).find(|s| s * s == cfg.num_patches) {
                    cfg.pos_embed_max_size = s;
                }
            }
            let Some(at) = name.find("joint_blocks.") else { continue };
            let block = &name[at..];
            let Some(idx) = block[13..].split('.').next().and_then(|v| v.parse::<usize>().ok()) else { continue };
            cfg.depth = cfg.depth.max(idx + 1);
            if block.contains("attn.ln") {
                cfg.qk_norm = if block.contains(".bias") { QkNorm::Layer } else { QkNorm::Rms };
            }
            if block.contains("attn2") {
                cfg.d_self = Some(cfg.d_self.map_or(idx, |d| d.max(idx)));
            }
        }
        if !has_pos && cfg.d_self.is_some() {
            cfg.pos_embed_max_size *= 2;
            cfg.num_patches *= 4;
        }
        if !has_hidden || cfg.hidden_size <= 0 {
            cfg.hidden_size = 64 * cfg.depth as i64;
        }
        if !has_context || cfg.context_embedder_out_dim <= 0 {
            cfg.context_embedder_out_dim = cfg.hidden_size;
        }
        sd_debug!(
            "mmdit: num_layers = {}, num_mmdit_x_layers = {}, hidden_size = {}, patch_size = {}, in_channels = {}, out_channels = {}, context_size = {}, adm_in_channels = {}, qk_norm = {:?}",
            cfg.depth,
            cfg.d_self.map_or(0, |d| d + 1),
            cfg.hidden_size,
            cfg.patch_size,
            cfg.in_channels,
            cfg.out_channels,
            cfg.context_size,
            cfg.adm_in_channels,
            cfg.qk_norm
        );
        cfg
    }

    fn num_heads(&self) -> i64 {
        self.depth as i64
    }
}

#[derive(Clone, Copy, Debug)]
enum HeadNorm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl HeadNorm {
    fn new(s: &mut Scope, name: &str, kind: QkNorm, d_head: i64) -> Option<HeadNorm> {
        match kind {
            QkNorm::None => None,
            QkNorm::Rms => Some(HeadNorm::Rms(RmsNorm::new(s, name, "weight", d_head, 1e-6, true))),
            QkNorm::Layer => Some(HeadNorm::Layer(LayerNorm::new(s, name, d_head, 1e-6, true, true))),
        }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        match self {
            HeadNorm::Rms(n) => n.forward(g, x),
            HeadNorm::Layer(n) => n.forward(g, x),
        }
    }
}

/// `qkv` projection (split q | k | v), optional head norms, output projection.
#[derive(Clone, Copy, Debug)]
struct SelfAttention {
    qkv: Linear,
    proj: Option<Linear>,
    ln_q: Option<HeadNorm>,
    ln_k: Option<HeadNorm>,
    num_heads: i64,
}

impl SelfAttention {
    fn new(s: &mut Scope, name: &str, dim: i64, num_heads: i64, qk_norm: QkNorm, pre_only: bool) -> SelfAttention {
        let mut s = s.sub(name);
        let d_head = dim / num_heads;
        SelfAttention {
            qkv: Linear::new(&mut s, "qkv", dim, dim * 3, true),
            proj: (!pre_only).then(|| Linear::new(&mut s, "proj", dim, dim, true)),
            ln_q: HeadNorm::new(&mut s, "ln_q", qk_norm, d_head),
            ln_k: HeadNorm::new(&mut s, "ln_k", qk_norm, d_head),
            num_heads,
        }
    }

    /// q, k, v `[C, L, N]`.
    fn pre_attention<'g>(&self, g: &'g Graph, x: T<'g>) -> [T<'g>; 3] {
        let qkv = self.qkv.forward(g, x);
        let [d, l, n, _] = qkv.ne();
        let c = d / 3;
        let qkv = qkv.reshape(&[c, 3, l, n]).permute(0, 3, 1, 2).cont();
        let nb = qkv.nb();
        let part = |i: usize| qkv.view(&[c, l, n], &[nb[1], nb[2]], nb[2] * n as usize * i);
        let d_head = c / self.num_heads;
        let heads = |t: T<'g>, norm: &Option<HeadNorm>| {
            let t = t.reshape(&[d_head, self.num_heads, l, n]);
            let t = match norm {
                Some(norm) => norm.forward(g, t),
                None => t,
            };
            t.reshape(&[c, l, n])
        };
        [heads(part(0), &self.ln_q), heads(part(1), &self.ln_k), part(2)]
    }

    fn attend<'g>(&self, g: &'g Graph, [q, k, v]: [T<'g>; 3]) -> T<'g> {
        nn::attention(g, q, k, v, self.num_heads, None, false, g.options.flash_attn, 1.0)
    }
}

/// What the second half of a block needs from the first.
struct Pending<'g> {
    x: T<'g>,
    gate_msa: T<'g>,
    shift_mlp: T<'g>,
    scale_mlp: T<'g>,
    gate_mlp: T<'g>,
    gate_msa2: Option<T<'g>>,
}

/// One stream of a joint block (DiT block with gated adaLN).
#[derive(Clone, Copy, Debug)]
struct DismantledBlock {
    norm1: LayerNorm,
    attn: SelfAttention,
    attn2: Option<SelfAttention>,
    norm2: LayerNorm,
    mlp: Option<(Linear, Linear)>,
    ada_ln: Linear,
    n_mods: i64,
    pre_only: bool,
}

impl DismantledBlock {
    fn new(s: &mut Scope, name: &str, cfg: &MmditConfig, pre_only: bool, self_attn: bool) -> DismantledBlock {
        let mut s = s.sub(name);
        let h = cfg.hidden_size;
        let heads = cfg.num_heads();
        let attn = SelfAttention::new(&mut s, "attn", h, heads, cfg.qk_norm, pre_only);
        let attn2 = self_attn.then(|| SelfAttention::new(&mut s, "attn2", h, heads, cfg.qk_norm, false));
        let mlp = (!pre_only).then(|| {
            let hidden = (h as f32 * cfg.mlp_ratio) as i64;
            let mut m = s.sub("mlp");
            (Linear::new(&mut m, "fc1", h, hidden, true), Linear::new(&mut m, "fc2", hidden, h, true))
        });
        let n_mods = if self_attn { 9 } else if pre_only { 2 } else { 6 };
        DismantledBlock {
            norm1: LayerNorm::new(&mut s, "norm1", h, 1e-6, false, false),
            attn,
            attn2,
            norm2: LayerNorm::new(&mut s, "norm2", h, 1e-6, false, false),
            mlp,
            ada_ln: Linear::new(&mut s, "adaLN_modulation.1", h, n_mods * h, true),
            n_mods,
            pre_only,
        }
    }

    /// q, k, v of the (first) attention, those of `attn2`, and what the second half needs.
    fn pre_attention<'g>(&self, g: &'g Graph, x: T<'g>, c: T<'g>) -> ([T<'g>; 3], Option<[T<'g>; 3]>, Option<Pending<'g>>) {
        let m = chunk(self.ada_ln.forward(g, c.silu()), self.n_mods, 0, true);
        if let Some(attn2) = &self.attn2 {
            let x_norm = self.norm1.forward(g, x);
            let qkv = self.attn.pre_attention(g, modulate(x_norm, m[0], m[1]));
            let qkv2 = attn2.pre_attention(g, modulate(x_norm, m[6], m[7]));
            let pending = Pending { x, gate_msa: m[2], shift_mlp: m[3], scale_mlp: m[4], gate_mlp: m[5], gate_msa2: Some(m[8]) };
            return (qkv, Some(qkv2), Some(pending));
        }
        let qkv = self.attn.pre_attention(g, modulate(self.norm1.forward(g, x), m[0], m[1]));
        let pending = (!self.pre_only).then(|| Pending { x, gate_msa: m[2], shift_mlp: m[3], scale_mlp: m[4], gate_mlp: m[5], gate_msa2: None });
        (qkv, None, pending)
    }

    fn post_attention<'g>(&self, g: &'g Graph, attn_out: T<'g>, attn2_out: Option<T<'g>>, p: Pending<'g>) -> T<'g> {
        let gate = |t: T<'g>| t.reshape(&[t.ne()[0], 1, t.ne()[1]]);
        let (gate_msa, gate_mlp) = (gate(p.gate_msa), gate(p.gate_mlp));
        let gate_msa2 = p.gate_msa2.map(gate);
        let proj = |a: &SelfAttention, t: T<'g>| a.proj.expect("attention projection").forward(g, t);
        let attn_out = proj(&self.attn, attn_out);
        let attn2_out = attn2_out.map(|t| proj(self.attn2.as_ref().expect("attn2"), t));
        let mut x = p.x.add(attn_out.mul(gate_msa));
        if let (Some(a2), Some(g2)) = (attn2_out, gate_msa2) {
            x = x.add(a2.mul(g2));
        }
        let (fc1, fc2) = self.mlp.expect("mlp");
        let h = modulate(self.norm2.forward(g, x), p.shift_mlp, p.scale_mlp);
        let h = fc2.forward(g, fc1.forward(g, h).contiguous().gelu_inplace());
        x.add(h.mul(gate_mlp))
    }
}

#[derive(Clone, Copy, Debug)]
struct JointBlock {
    context_block: DismantledBlock,
    x_block: DismantledBlock,
}

impl JointBlock {
    /// (context, x) after the block; the last block's context stream ends (None).
    fn forward<'g>(&self, g: &'g Graph, context: T<'g>, x: T<'g>, c: T<'g>) -> (Option<T<'g>>, T<'g>) {
        let (ctx_qkv, _, ctx_pending) = self.context_block.pre_attention(g, context, c);
        let (x_qkv, x_qkv2, x_pending) = self.x_block.pre_attention(g, x, c);
        let qkv = [0, 1, 2].map(|i| ctx_qkv[i].concat(x_qkv[i], 1));
        let attn = self.x_block.attn.attend(g, qkv);
        let [d, _, n, _] = attn.ne();
        let nb = attn.nb();
        let n_ctx = context.ne()[1];
        let ctx_attn = attn.view(&[d, n_ctx, n], &[nb[1], nb[2]], 0);
        let x_attn = attn.view(&[d, x.ne()[1], n], &[nb[1], nb[2]], n_ctx as usize * nb[1]);
        let context = ctx_pending.map(|p| self.context_block.post_attention(g, ctx_attn, None, p));
        let attn2 = x_qkv2.map(|qkv2| self.x_block.attn2.expect("attn2").attend(g, qkv2));
        let x = self.x_block.post_attention(g, x_attn, attn2, x_pending.expect("the image stream continues"));
        (context, x)
    }
}

/// The MMDiT network.
#[derive(Clone, Debug)]
pub struct MmditModel {
    pub config: MmditConfig,
    x_embedder: Conv2d,
    pos_embed: W,
    t_embedder: MlpEmbedder,
    y_embedder: MlpEmbedder,
    context_embedder: Linear,
    blocks: Vec<JointBlock>,
    final_linear: Linear,
    final_ada_ln: Linear,
}

impl MmditModel {
    pub fn new(s: &mut Scope, cfg: &MmditConfig) -> MmditModel {
        let h = cfg.hidden_size;
        let p = cfg.patch_size;
        let x_embedder = Conv2d::new(&mut s.sub("x_embedder"), "proj", cfg.in_channels, h, (p, p), (p as i32, p as i32), (0, 0), true);
        let pos_embed = s.tensor("pos_embed", F32, &[h, cfg.num_patches, 1]);
        let t_embedder = MlpEmbedder::new(s, "t_embedder", 256, h, h);
        let y_embedder = MlpEmbedder::new(s, "y_embedder", cfg.adm_in_channels, h, h);
        let context_embedder = Linear::with_options(s, "context_embedder", cfg.context_size, cfg.context_embedder_out_dim, true, true);
        let blocks = (0..cfg.depth)
            .map(|i| {
                let mut b = s.sub(&format!("joint_blocks.{i}"));
                let context_block = DismantledBlock::new(&mut b, "context_block", cfg, i + 1 == cfg.depth, false);
                let x_block = DismantledBlock::new(&mut b, "x_block", cfg, false, cfg.d_self.is_some_and(|d| i <= d));
                JointBlock { context_block, x_block }
            })
            .collect();
        let mut fl = s.sub("final_layer");
        let final_linear = Linear::with_options(&mut fl, "linear", h, p * p * cfg.out_channels, true, true);
        let final_ada_ln = Linear::new(&mut fl, "adaLN_modulation.1", h, 2 * h, true);
        MmditModel { config: cfg.clone(), x_embedder, pos_embed, t_embedder, y_embedder, context_embedder, blocks, final_linear, final_ada_ln }
    }

    /// Patches per side of a latent side of `len`.
    fn patches(&self, len: i64) -> i64 {
        (len + 1) / self.config.patch_size
    }

    /// The centre `h`×`w` patches of the positional table: `[hidden, h·w, 1]`.
    fn cropped_pos_embed<'g>(&self, g: &'g Graph, h: i64, w: i64) -> T<'g> {
        let cfg = &self.config;
        let (hid, max) = (cfg.hidden_size, cfg.pos_embed_max_size);
        let (h, w) = (self.patches(h), self.patches(w));
        let (top, left) = ((max - h) / 2, (max - w) / 2);
        let t = g.param(self.pos_embed).reshape(&[hid, max, max]);
        let nb = t.nb();
        let t = t.view(&[hid, max, h], &[nb[1], nb[2]], nb[2] * top as usize).permute(0, 2, 1, 3).cont();
        let nb = t.nb();
        let t = t.view(&[hid, h, w], &[nb[1], nb[2]], nb[2] * left as usize).permute(0, 2, 1, 3).cont();
        t.reshape(&[hid, h * w, 1])
    }

    /// x `[W, H, C, N]`, t `[N]`, y `[adm, N]`, context `[context_size, L, N]` → `[W, H, C_out, N]`.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, t: T<'g>, y: Option<T<'g>>, context: T<'g>, skip_layers: &[i32]) -> T<'g> {
        let cfg = &self.config;
        let p = cfg.patch_size;
        let [w, h, _, _] = x.ne();
        let (pad_w, pad_h) = ((p - w % p) % p, (p - h % p) % p);
        let xp = if pad_w > 0 || pad_h > 0 { x.pad(pad_w as i32, pad_h as i32, 0, 0) } else { x };
        let e = self.x_embedder.forward(g, xp);
        let [ew, eh, ec, en] = e.ne();
        let patches = e.reshape(&[ew * eh, ec, en]).permute(1, 0, 2, 3).cont();
        let mut x = patches.add(self.cropped_pos_embed(g, h, w));
        let mut c = self.t_embedder.forward(g, timestep_embedding(t, 256, 10000, 1.0));
        if let Some(y) = y {
            c = c.add(self.y_embedder.forward(g, y));
        }
        let mut context = Some(self.context_embedder.forward(g, context));
        for (i, block) in self.blocks.iter().enumerate() {
            if skip_layers.contains(&(i as i32)) {
                continue;
            }
            let ctx = context.expect("only the last block ends the context stream");
            (context, x) = block.forward(g, ctx, x, c);
        }
        let m = chunk(self.final_ada_ln.forward(g, c.silu()), 2, 0, true);
        let x = self.final_linear.forward(g, modulate(x.norm(1e-6), m[0], m[1]));
        unpatchify_and_crop(x, h, w, p, false)
    }

    fn check_inputs(&self, x: &Tensor, context: &Tensor, y: Option<&Tensor>) -> Result<()> {
        let cfg = &self.config;
        ensure!(x.shape().len() <= 4 && x.ne(2) as i64 == cfg.in_channels, "MMDiT takes latents [W, H, {}, N], got {:?}", cfg.in_channels, x.shape());
        let n = x.ne(3);
        for (side, len) in [("width", x.ne(0) as i64), ("height", x.ne(1) as i64)] {
            let patches = self.patches(len);
            ensure!(
                patches > 0 && patches <= cfg.pos_embed_max_size,
                "latent {side} {len} is outside this SD3 model's positional table ({} patches of {})",
                cfg.pos_embed_max_size,
                cfg.patch_size
            );
        }
        ensure!(
            context.ne(0) as i64 == cfg.context_size && context.ne(1) > 0 && (context.ne(2) == n || context.ne(2) == 1),
            "MMDiT context must be [{}, L, {n}], got {:?} (SD3 needs a 4096-wide T5 or none)",
            cfg.context_size,
            context.shape()
        );
        if let Some(y) = y {
            ensure!(y.ne(0) as i64 == cfg.adm_in_channels && y.len() as i64 % cfg.adm_in_channels == 0, "MMDiT y must be [{}, N], got {:?}", cfg.adm_in_channels, y.shape());
        }
        Ok(())
    }
}

impl DiffusionModel for Loaded<MmditModel> {
    fn compute(&mut self, input: &DiffusionInput<'_>) -> Result<Tensor> {
        let cond = input.cond;
        let context = cond.crossattn.as_ref().context("SD3 needs a text context (no text encoder produced one)")?;
        let (model, runner) = self.parts();
        model.check_inputs(input.x, context, cond.vector.as_ref())?;
        let n = input.x.ne(3);
        let timesteps: Vec<f32> = if input.timesteps.len() == 1 && n > 1 { vec![input.timesteps[0]; n] } else { input.timesteps.to_vec() };
        ensure!(timesteps.len() == n, "MMDiT got {} timesteps for a batch of {n}", timesteps.len());
        runner.compute(|g| {
            let x = g.input(input.x);
            let t = g.input_f32(&timesteps, &[n as i64]);
            let y = cond.vector.as_ref().map(|v| g.input_f32(v.data(), &[v.ne(0) as i64, (v.len() / v.ne(0)) as i64]));
            let ctx = g.input(context);
            Ok(model.forward(g, x, t, y, ctx, input.skip_layers))
        })
    }

}
