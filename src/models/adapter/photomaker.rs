//! PhotoMaker's ID encoder (the reference's `pmid.hpp`): it turns ID pictures into
//! embeddings and fuses them into the prompt's class-token embeddings, which then stand in
//! for those tokens in the cross-attention context.
//!
//! - v1: the OpenAI CLIP ViT-L/14 vision tower's post-normed class token of each picture,
//!   through `visual_projection` (768) and `visual_projection_2` (1280), side by side: one
//!   2048-wide embedding per picture.
//! - v2: the tower's last hidden states (before the post-norm) and a face-analysis
//!   embedding per picture (512, from `id_embed_path`) go through a Q-Former perceiver
//!   (`qformer_perceiver`): two 2048-wide embeddings per picture.
//!
//! The fuse module (`fuse_module`) maps each class-token embedding concatenated with its ID
//! embedding through two MLP blocks and a layer norm. The reference then multiplies the
//! prompt embeddings by a 0/1 mask and adds the fused rows between zero blocks, which leaves
//! every other row as it was and puts the fused rows in place of the class tokens' rows:
//! here the rows are taken out and put back on the host ([`replace_rows`]).
//!
//! Every size is fixed by the reference (a 2048-wide SDXL context, the ViT-L/14 tower, a
//! 4-layer resampler of 16 heads of 128); weights live under `pmid.` with the reference's
//! names (its name conversion maps the released checkpoint's `token_proj.0`/`.2` and
//! `layers.N.1.1`/`.1.3` onto `fc1`/`fc2`).

use crate::error::{Context as _, Result};
use crate::graph::nn::{scale, LayerNorm, Linear};
use crate::graph::{Graph, Runner, Scope, T};
use crate::models::te::clip_vision::{ClipVisionConfig, ClipVisionModel};
use crate::tensor::Tensor;

/// Where the PhotoMaker file's tensors land.
pub const PHOTOMAKER_PREFIX: &str = "pmid.";
/// Width of the context the fuse module works in (SDXL's two text encoders side by side).
pub const PM_CONTEXT_DIM: usize = 2048;
/// Width of v2's face-analysis embedding per picture.
pub const PM_ID_EMBED_DIM: usize = 512;
const VISION_HIDDEN: i64 = 1024;
const EPS: f32 = 1e-5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmVersion {
    V1,
    V2,
}

impl PmVersion {
    /// The reference's rule: a file whose path contains "v2" is PhotoMaker v2.
    pub fn of_path(path: &str) -> PmVersion {
        if path.contains("v2") {
            PmVersion::V2
        } else {
            PmVersion::V1
        }
    }

    /// Class-token rows each ID picture fills.
    pub fn tokens_per_image(self) -> usize {
        match self {
            PmVersion::V1 => 1,
            PmVersion::V2 => 2,
        }
    }
}

/// torch `nn.Sequential(Linear, GELU(tanh), Linear)` (the reference's `Mlp`).
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(s: &mut Scope, name: &str, dims: (i64, i64, i64), bias: bool) -> Mlp {
        let mut s = s.sub(name);
        Mlp { fc1: Linear::new(&mut s, "fc1", dims.0, dims.1, bias), fc2: Linear::new(&mut s, "fc2", dims.1, dims.2, bias) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.fc1.forward(g, x).gelu_inplace();
        self.fc2.forward(g, x)
    }
}

/// Layer norm, then [`Mlp`], optionally plus the input.
struct FuseBlock {
    norm: LayerNorm,
    mlp: Mlp,
    residual: bool,
}

impl FuseBlock {
    fn new(s: &mut Scope, name: &str, dims: (i64, i64, i64), residual: bool) -> FuseBlock {
        let mut s = s.sub(name);
        let norm = LayerNorm::new(&mut s, "layernorm", dims.0, EPS, true, true);
        let mlp = Mlp { fc1: Linear::new(&mut s, "fc1", dims.0, dims.1, true), fc2: Linear::new(&mut s, "fc2", dims.1, dims.2, true) };
        FuseBlock { norm, mlp, residual }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let y = self.mlp.forward(g, self.norm.forward(g, x));
        if self.residual {
            y.add(x)
        } else {
            y
        }
    }
}

struct FuseModule {
    mlp1: FuseBlock,
    mlp2: FuseBlock,
    norm: LayerNorm,
}

impl FuseModule {
    fn new(s: &mut Scope) -> FuseModule {
        let d = PM_CONTEXT_DIM as i64;
        let mut s = s.sub("fuse_module");
        FuseModule {
            mlp1: FuseBlock::new(&mut s, "mlp1", (2 * d, d, d), false),
            mlp2: FuseBlock::new(&mut s, "mlp2", (d, d, d), true),
            norm: LayerNorm::new(&mut s, "layer_norm", d, EPS, true, true),
        }
    }

    /// `class_rows` `[2048, n]`, `id` `[2048, n]` → the fused rows `[2048, n]`.
    fn forward<'g>(&self, g: &'g Graph, class_rows: T<'g>, id: T<'g>) -> T<'g> {
        let x = self.mlp1.forward(g, class_rows.concat(id, 0)).add(class_rows);
        let x = self.mlp2.forward(g, x);
        self.norm.forward(g, x)
    }
}

/// The resampler's attention of the latents over the image states and themselves.
struct PerceiverAttention {
    norm1: LayerNorm,
    norm2: LayerNorm,
    to_q: Linear,
    to_kv: Linear,
    to_out: Linear,
    heads: i64,
    head_dim: i64,
}

impl PerceiverAttention {
    fn new(s: &mut Scope, name: &str, dim: i64, head_dim: i64, heads: i64) -> PerceiverAttention {
        let mut s = s.sub(name);
        let inner = head_dim * heads;
        PerceiverAttention {
            norm1: LayerNorm::new(&mut s, "norm1", dim, EPS, true, true),
            norm2: LayerNorm::new(&mut s, "norm2", dim, EPS, true, true),
            to_q: Linear::new(&mut s, "to_q", dim, inner, false),
            to_kv: Linear::new(&mut s, "to_kv", dim, 2 * inner, false),
            to_out: Linear::new(&mut s, "to_out", inner, dim, false),
            heads,
            head_dim,
        }
    }

    /// `[heads·d, n, b]` → `[d, n, heads, b]`.
    fn split_heads<'g>(&self, x: T<'g>) -> T<'g> {
        let ne = x.ne();
        x.reshape(&[ne[0] / self.heads, self.heads, ne[1], ne[2]]).permute(0, 2, 1, 3).cont()
    }

    /// `x` `[dim, n1, b]` image states, `latents` `[dim, n2, b]` → `[dim, n2, b]`.
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, latents: T<'g>) -> T<'g> {
        let lat_ne = latents.ne();
        let x = self.norm1.forward(g, x);
        let latents = self.norm2.forward(g, latents);
        let q = self.to_q.forward(g, latents);
        let kv = self.to_kv.forward(g, x.concat(latents, 1));
        // The reference takes k and v as views with halved strides: consecutive halves of
        // the kv rows in memory order (k from the first, v from the second half-row on).
        let ne = kv.ne();
        let nb = kv.nb();
        let half = [ne[0] / 2, ne[1], ne[2], ne[3]];
        let strides = [nb[1] / 2, nb[2] / 2, nb[3] / 2];
        let k = kv.view(&half, &strides, 0).cont();
        let v = kv.view(&half, &strides, nb[0] * (ne[0] / 2) as usize).cont();
        let s = 1.0 / (self.head_dim as f32).sqrt().sqrt();
        let q = scale(self.split_heads(q), s, true);
        let k = scale(self.split_heads(k), s, true);
        let v = self.split_heads(v);
        let w = k.mul_mat(q).soft_max_inplace();
        let v = v.transpose().cont();
        let out = v.mul_mat(w).permute(0, 2, 1, 3).cont();
        let n = out.nelements() / (lat_ne[0] * lat_ne[1]);
        self.to_out.forward(g, out.reshape(&[lat_ne[0], lat_ne[1], n]))
    }
}

/// v2's Q-Former: the ID embedding projected to two tokens, refined by a perceiver
/// resampler over the vision tower's hidden states.
struct QFormerPerceiver {
    token_proj: Mlp,
    token_norm: LayerNorm,
    proj_in: Linear,
    proj_out: Linear,
    norm_out: LayerNorm,
    layers: Vec<(PerceiverAttention, LayerNorm, Mlp)>,
}

impl QFormerPerceiver {
    fn new(s: &mut Scope) -> QFormerPerceiver {
        let d = PM_CONTEXT_DIM as i64;
        let id = PM_ID_EMBED_DIM as i64;
        let mut s = s.sub("qformer_perceiver");
        let token_proj = Mlp::new(&mut s, "token_proj", (id, id * 4, d * 2), true);
        let token_norm = LayerNorm::new(&mut s, "token_norm", d, EPS, true, true);
        let mut r = s.sub("perceiver_resampler");
        let proj_in = Linear::new(&mut r, "proj_in", VISION_HIDDEN, d, true);
        let proj_out = Linear::new(&mut r, "proj_out", d, d, true);
        let norm_out = LayerNorm::new(&mut r, "norm_out", d, EPS, true, true);
        let layers = (0..4)
            .map(|i| {
                let mut l = r.sub(&format!("layers.{i}"));
                let attn = PerceiverAttention::new(&mut l, "0", d, 128, d / 128);
                let mut ff = l.sub("1");
                let norm = LayerNorm::new(&mut ff, "0", d, EPS, true, true);
                let mlp = Mlp::new(&mut ff, "1", (d, d * 4, d), false);
                (attn, norm, mlp)
            })
            .collect();
        QFormerPerceiver { token_proj, token_norm, proj_in, proj_out, norm_out, layers }
    }

    /// `id_embeds` `[512, N]`, `hidden` `[1024, 257, N]` → `[2048, 2, N]`.
    fn forward<'g>(&self, g: &'g Graph, id_embeds: T<'g>, hidden: T<'g>) -> T<'g> {
        let d = PM_CONTEXT_DIM as i64;
        let x = self.token_proj.forward(g, id_embeds);
        let n = x.nelements() / (d * 2);
        let x = self.token_norm.forward(g, x.reshape(&[d, 2, n]));
        let states = self.proj_in.forward(g, hidden);
        let mut latents = x;
        for (attn, norm, mlp) in &self.layers {
            latents = attn.forward(g, states, latents).add(latents);
            latents = mlp.forward(g, norm.forward(g, latents)).add(latents);
        }
        let out = self.norm_out.forward(g, self.proj_out.forward(g, latents));
        x.add(out)
    }
}

/// The ID encoder of one PhotoMaker file.
pub struct PhotoMakerIdEncoder {
    pub version: PmVersion,
    vision: ClipVisionModel,
    visual_projection: Linear,
    visual_projection_2: Linear,
    fuse: FuseModule,
    qformer: Option<QFormerPerceiver>,
}

impl PhotoMakerIdEncoder {
    /// Declares every weight under the scope's prefix ([`PHOTOMAKER_PREFIX`]).
    pub fn new(s: &mut Scope, version: PmVersion) -> PhotoMakerIdEncoder {
        let cfg = ClipVisionConfig { projection_dim: None, ..ClipVisionConfig::vit_l14() };
        let vision = ClipVisionModel::new(s, &cfg);
        PhotoMakerIdEncoder {
            version,
            vision,
            visual_projection: Linear::new(s, "visual_projection", VISION_HIDDEN, 768, false),
            visual_projection_2: Linear::new(s, "visual_projection_2", VISION_HIDDEN, 1280, false),
            fuse: FuseModule::new(s),
            qformer: (version == PmVersion::V2).then(|| QFormerPerceiver::new(s)),
        }
    }

    /// Side of the square pictures the tower takes.
    pub fn image_size(&self) -> usize {
        self.vision.cfg.image_size as usize
    }

    /// `pixels` `[224, 224, 3, N]` (preprocessed), `class_rows` `[2048, rows]`, v2's
    /// `id_embeds` `[512, N]` → the fused rows `[2048, rows]`.
    fn forward<'g>(&self, g: &'g Graph, pixels: T<'g>, class_rows: T<'g>, id_embeds: Option<T<'g>>) -> T<'g> {
        let d = PM_CONTEXT_DIM as i64;
        let id = match (&self.qformer, id_embeds) {
            (Some(q), Some(e)) => {
                let hidden = self.vision.forward(g, pixels, -1, false);
                q.forward(g, e, hidden)
            }
            _ => {
                let pooled = self.vision.forward(g, pixels, -1, true);
                self.visual_projection.forward(g, pooled).concat(self.visual_projection_2.forward(g, pooled), 0)
            }
        };
        let rows = id.nelements() / d;
        self.fuse.forward(g, class_rows, id.reshape(&[d, rows]))
    }
}

/// Runs the encoder: `class_rows` `[2048, rows]` must hold as many rows as the pictures give
/// (one per picture for v1, two for v2).
pub fn fuse(runner: &mut Runner, model: &PhotoMakerIdEncoder, pixels: &Tensor, class_rows: &Tensor, id_embeds: Option<&Tensor>) -> Result<Tensor> {
    let images = pixels.ne(3);
    let rows = class_rows.len() / PM_CONTEXT_DIM;
    ensure!(class_rows.ne(0) == PM_CONTEXT_DIM, "PhotoMaker fuses into a {PM_CONTEXT_DIM}-wide context, the prompt's is {} wide", class_rows.ne(0));
    ensure!(
        rows == images * model.version.tokens_per_image(),
        "PhotoMaker has {rows} class-token positions for {images} ID images (it needs {} per image)",
        model.version.tokens_per_image()
    );
    if model.version == PmVersion::V2 {
        let e = id_embeds.context("PhotoMaker v2 needs ID embeddings")?;
        ensure!(e.ne(0) == PM_ID_EMBED_DIM && e.len() == PM_ID_EMBED_DIM * images, "PhotoMaker v2's ID embeddings have shape {:?}, expected [{PM_ID_EMBED_DIM}, {images}]", e.shape());
    }
    let out = runner
        .compute(|g| {
            let e = id_embeds.filter(|_| model.version == PmVersion::V2).map(|e| g.input(e));
            Ok(model.forward(g, g.input(pixels), g.input(class_rows), e))
        })
        .context("Photomaker ID Stacking failed")?;
    out.reshape(&[PM_CONTEXT_DIM, rows])
}

/// The rows at `positions` of `context` `[dim, n, ...]`, as `[dim, positions]`.
pub fn take_rows(context: &Tensor, positions: &[usize]) -> Result<Tensor> {
    let dim = context.ne(0);
    let n = context.len() / dim.max(1);
    let mut out = Vec::with_capacity(dim * positions.len());
    for &p in positions {
        ensure!(p < n, "class-token position {p} is beyond the prompt's {n} tokens");
        out.extend_from_slice(&context.data()[p * dim..(p + 1) * dim]);
    }
    Tensor::from_vec(&[dim, positions.len()], out)
}

/// `context` with its rows at `positions` replaced by the rows of `rows` `[dim, positions]`.
pub fn replace_rows(context: &mut Tensor, positions: &[usize], rows: &Tensor) -> Result<()> {
    let dim = context.shape()[0];
    ensure!(rows.len() == dim * positions.len(), "{} fused values for {} rows of {dim}", rows.len(), positions.len());
    let n = context.len() / dim.max(1);
    let data = context.data_mut();
    for (i, &p) in positions.iter().enumerate() {
        ensure!(p < n, "class-token position {p} is beyond the prompt's {n} tokens");
        data[p * dim..(p + 1) * dim].copy_from_slice(&rows.data()[i * dim..(i + 1) * dim]);
    }
    Ok(())
}

/// v2's ID embeddings from ggml's tensor file (the reference's `load_tensor_from_file_as_tensor`):
/// i32 dimension count, name length and type (0, f32), the dimensions (ggml order), the name,
/// then the values.
pub fn read_id_embeds(path: &str) -> Result<Tensor> {
    let bytes = std::fs::read(path).with_context(|| format!("failed to open tensor file: {path}"))?;
    let int = |i: usize| -> Result<i32> {
        let b = bytes.get(i * 4..i * 4 + 4).with_context(|| format!("incomplete tensor file header: {path}"))?;
        Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let (n_dims, name_len, ty) = (int(0)?, int(1)?, int(2)?);
    ensure!(ty == 0, "tensor file type does not match requested sd::Tensor type");
    ensure!((0..=4).contains(&n_dims) && name_len >= 0, "incomplete tensor file header: {path}");
    let mut shape = Vec::new();
    for i in 0..n_dims as usize {
        let d = int(3 + i)?;
        ensure!(d >= 0, "incomplete tensor file header: {path}");
        shape.push(d as usize);
    }
    let start = (3 + n_dims as usize) * 4 + name_len as usize;
    let n: usize = shape.iter().product();
    let data = bytes.get(start..start + n * 4).with_context(|| format!("incomplete tensor file data: {path}"))?;
    let values = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Tensor::from_vec(&shape, values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_follows_the_path() {
        assert_eq!(PmVersion::of_path("/m/photomaker-v1.safetensors"), PmVersion::V1);
        assert_eq!(PmVersion::of_path("/m/photomaker-v2.safetensors"), PmVersion::V2);
        assert_eq!(PmVersion::of_path("/v2/pm.bin"), PmVersion::V2);
    }

    #[test]
    fn rows_come_out_and_go_back() {
        let mut ctx = Tensor::from_vec(&[2, 4, 1], (0..8).map(|v| v as f32).collect()).unwrap();
        let rows = take_rows(&ctx, &[1, 2]).unwrap();
        assert_eq!(rows.data(), &[2., 3., 4., 5.]);
        replace_rows(&mut ctx, &[1, 2], &Tensor::from_vec(&[2, 2], vec![9., 9., 8., 8.]).unwrap()).unwrap();
        assert_eq!(ctx.data(), &[0., 1., 9., 9., 8., 8., 6., 7.]);
        assert!(take_rows(&ctx, &[4]).is_err());
    }

    #[test]
    fn id_embeds_file_is_read() {
        let dir = std::env::temp_dir().join(format!("pm-embeds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("e.bin");
        let mut b = Vec::new();
        for v in [2i32, 1, 0, 3, 2] {
            b.extend(v.to_le_bytes());
        }
        b.push(b'x');
        for v in 0..6 {
            b.extend((v as f32).to_le_bytes());
        }
        std::fs::write(&path, &b).unwrap();
        let t = read_id_embeds(path.to_str().unwrap()).unwrap();
        assert_eq!(t.shape(), &[3, 2]);
        assert_eq!(t.data()[5], 5.0);
        std::fs::write(&path, &b[..20]).unwrap();
        assert!(read_id_embeds(path.to_str().unwrap()).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
