//! IP-Adapter's image projection (the reference's `IPAdapter::IPAdapterRunner`): CLIP-vision
//! features of a picture → image tokens the UNet's cross-attentions read next to the text
//! through their `to_k_ip` / `to_v_ip` projections (`blocks::CrossAttention::with_image`).
//!
//! Two kinds, told apart by the weights like the reference does:
//! - plain (`ImageProjModel`): the pooled, projected CLIP-vision vector through one linear
//!   layer, cut into `tokens` rows of the context width and layer-normed;
//! - Plus (`Resampler`, when `image_proj.latents` exists): learned queries that attend, in
//!   `depth` Perceiver layers, to the CLIP-vision hidden states of the penultimate layer (and
//!   to themselves), then a projection to the context width and a layer norm. Heads are 64
//!   wide, as the reference fixes them.
//!
//! An `ip_adapter_path` file's names land under [`IMAGE_PROJ_PREFIX`] (`image_proj.*`) and in
//! the UNet (`ip_adapter.<i>.to_k_ip.weight` → the i-th cross-attention's `attn2.to_k_ip`),
//! see `io::names`.

use crate::error::{Context as _, Result};
use crate::graph::nn::{self, LayerNorm, Linear};
use crate::graph::{Graph, Runner, Scope, F32, T, W};
use crate::tensor::Tensor;

/// Where the image projection's tensors live after name conversion.
pub const IMAGE_PROJ_PREFIX: &str = "ip_adapter.image_proj.";

/// The reference's layer norms (torch's default eps).
const LN_EPS: f32 = 1e-5;
/// The Resampler's head width (the reference fixes it).
const HEAD_DIM: i64 = 64;

/// The sizes of an IP-Adapter's image projection, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IpAdapterConfig {
    /// `proj`: `clip_dim` → `tokens` × `ctx_dim`, then `norm` over `ctx_dim`.
    Plain { clip_dim: i64, ctx_dim: i64, tokens: i64 },
    /// The Resampler: `queries` learned latents of `dim`, `depth` layers with a feed-forward
    /// of `ff_inner`, reading `embed_dim`-wide hidden states and giving `output_dim`-wide tokens.
    Plus { dim: i64, depth: usize, queries: i64, embed_dim: i64, output_dim: i64, ff_inner: i64 },
}

impl IpAdapterConfig {
    /// The projection under `prefix` ([`IMAGE_PROJ_PREFIX`]); an error when the files hold
    /// none or its sizes do not fit together.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Result<IpAdapterConfig> {
        let shape = |leaf: &str| shape_of(&format!("{prefix}{leaf}"));
        let matrix = |leaf: &str| -> Result<(i64, i64)> {
            match shape(leaf).as_deref() {
                Some(&[i, o]) => Ok((i, o)),
                Some(other) => bail!("the IP-Adapter's image_proj.{leaf} has shape {other:?}, expected a matrix"),
                None => bail!("the IP-Adapter file has no image_proj.{leaf}"),
            }
        };
        if let Some(latents) = shape("latents") {
            let (dim, queries) = match latents[..] {
                [d, q] | [d, q, 1] => (d, q),
                _ => bail!("the IP-Adapter's image_proj.latents has shape {latents:?}, expected [dim, queries, 1]"),
            };
            let (embed_dim, _) = matrix("proj_in.weight")?;
            let (_, output_dim) = matrix("proj_out.weight")?;
            let (_, ff_inner) = matrix("layers.0.1.1.weight")?;
            let depth = (0..).take_while(|i| shape(&format!("layers.{i}.0.to_q.weight")).is_some()).count();
            ensure!(
                dim > 0 && dim % HEAD_DIM == 0 && queries > 0,
                "the IP-Adapter's Resampler is {dim} wide with {queries} queries: it needs heads of {HEAD_DIM}"
            );
            return Ok(IpAdapterConfig::Plus { dim, depth, queries, embed_dim, output_dim, ff_inner });
        }
        let (clip_dim, out) = matrix("proj.weight")?;
        let ctx_dim = match shape("norm.weight").as_deref() {
            Some(&[c]) => c,
            _ => bail!("the IP-Adapter file has no image_proj.norm.weight"),
        };
        ensure!(
            ctx_dim > 0 && out % ctx_dim == 0,
            "the IP-Adapter's image_proj.proj gives {out} values, not a whole number of {ctx_dim}-wide tokens"
        );
        Ok(IpAdapterConfig::Plain { clip_dim, ctx_dim, tokens: out / ctx_dim })
    }

    pub fn is_plus(&self) -> bool {
        matches!(self, IpAdapterConfig::Plus { .. })
    }

    /// Width of the CLIP-vision features it reads: the pooled projection (plain) or the
    /// hidden states (Plus).
    pub fn input_width(&self) -> i64 {
        match *self {
            IpAdapterConfig::Plain { clip_dim, .. } => clip_dim,
            IpAdapterConfig::Plus { embed_dim, .. } => embed_dim,
        }
    }

    /// Width of the image tokens it gives (the UNet's `to_k_ip` input).
    pub fn token_width(&self) -> i64 {
        match *self {
            IpAdapterConfig::Plain { ctx_dim, .. } => ctx_dim,
            IpAdapterConfig::Plus { output_dim, .. } => output_dim,
        }
    }

    /// How many image tokens it gives.
    pub fn tokens(&self) -> i64 {
        match *self {
            IpAdapterConfig::Plain { tokens, .. } => tokens,
            IpAdapterConfig::Plus { queries, .. } => queries,
        }
    }
}

/// One Perceiver layer of the Resampler: attention of the queries over the features and
/// themselves, then a GELU feed-forward, both residual.
#[derive(Clone, Copy, Debug)]
struct PerceiverLayer {
    norm1: LayerNorm,
    norm2: LayerNorm,
    to_q: Linear,
    to_kv: Linear,
    to_out: Linear,
    ff_norm: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
}

#[derive(Clone, Debug)]
enum Projection {
    Plain { proj: Linear, norm: LayerNorm, ctx_dim: i64, tokens: i64 },
    Plus { latents: W, proj_in: Linear, layers: Vec<PerceiverLayer>, proj_out: Linear, norm_out: LayerNorm, dim: i64 },
}

/// The declared image projection.
#[derive(Clone, Debug)]
pub struct IpAdapter {
    pub config: IpAdapterConfig,
    projection: Projection,
}

impl IpAdapter {
    /// Declares the projection's weights under `s`'s prefix ([`IMAGE_PROJ_PREFIX`]).
    pub fn new(s: &mut Scope, config: &IpAdapterConfig) -> IpAdapter {
        let norm = |s: &mut Scope, name: &str, dim: i64| LayerNorm::new(s, name, dim, LN_EPS, true, true);
        let projection = match *config {
            IpAdapterConfig::Plain { clip_dim, ctx_dim, tokens } => Projection::Plain {
                proj: Linear::new(s, "proj", clip_dim, tokens * ctx_dim, true),
                norm: norm(s, "norm", ctx_dim),
                ctx_dim,
                tokens,
            },
            IpAdapterConfig::Plus { dim, depth, queries, embed_dim, output_dim, ff_inner } => {
                let layers = (0..depth)
                    .map(|i| {
                        let mut l = s.sub(&format!("layers.{i}"));
                        PerceiverLayer {
                            norm1: norm(&mut l, "0.norm1", dim),
                            norm2: norm(&mut l, "0.norm2", dim),
                            to_q: Linear::new(&mut l, "0.to_q", dim, dim, false),
                            to_kv: Linear::new(&mut l, "0.to_kv", dim, 2 * dim, false),
                            to_out: Linear::new(&mut l, "0.to_out", dim, dim, false),
                            ff_norm: norm(&mut l, "1.0", dim),
                            ff_in: Linear::new(&mut l, "1.1", dim, ff_inner, false),
                            ff_out: Linear::new(&mut l, "1.3", ff_inner, dim, false),
                        }
                    })
                    .collect();
                Projection::Plus {
                    latents: s.tensor("latents", F32, &[dim, queries, 1]),
                    proj_in: Linear::new(s, "proj_in", embed_dim, dim, true),
                    layers,
                    proj_out: Linear::new(s, "proj_out", dim, output_dim, true),
                    norm_out: norm(s, "norm_out", output_dim),
                    dim,
                }
            }
        };
        IpAdapter { config: config.clone(), projection }
    }

    /// features: the pooled vector `[clip_dim, 1]` (plain) or the hidden states
    /// `[embed_dim, positions, 1]` (Plus) → image tokens `[token_width, tokens, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, features: T<'g>) -> T<'g> {
        match &self.projection {
            Projection::Plain { proj, norm, ctx_dim, tokens } => {
                let n = features.ne()[1];
                let x = proj.forward(g, features).reshape(&[*ctx_dim, *tokens, n]);
                norm.forward(g, x)
            }
            Projection::Plus { latents, proj_in, layers, proj_out, norm_out, dim } => {
                let x = proj_in.forward(g, features);
                let mut latents = g.param(*latents);
                for l in layers {
                    let xn = l.norm1.forward(g, x);
                    let ln = l.norm2.forward(g, latents);
                    let q = l.to_q.forward(g, ln);
                    let kv = l.to_kv.forward(g, xn.concat(ln, 1));
                    let [_, len, n, _] = kv.ne();
                    let nb = kv.nb();
                    let k = kv.view(&[*dim, len, n], &[nb[1], nb[2]], 0).cont();
                    let v = kv.view(&[*dim, len, n], &[nb[1], nb[2]], *dim as usize * nb[0]).cont();
                    let attn = nn::attention(g, q, k, v, dim / HEAD_DIM, None, false, false, 1.0);
                    latents = latents.add(l.to_out.forward(g, attn));
                    let h = l.ff_out.forward(g, l.ff_in.forward(g, l.ff_norm.forward(g, latents)).gelu_erf());
                    latents = latents.add(h);
                }
                norm_out.forward(g, proj_out.forward(g, latents))
            }
        }
    }
}

/// The image tokens `[token_width, tokens, 1]` of CLIP-vision `features` (see
/// [`IpAdapter::forward`]).
pub fn compute(runner: &mut Runner, adapter: &IpAdapter, features: &Tensor) -> Result<Tensor> {
    let cfg = &adapter.config;
    let width = cfg.input_width();
    let features = if cfg.is_plus() {
        ensure!(
            features.shape().len() <= 3 && features.ne(0) as i64 == width && features.ne(2) == 1,
            "the IP-Adapter reads [{width}, positions, 1] CLIP-vision hidden states, got {:?}",
            features.shape()
        );
        features.clone()
    } else {
        ensure!(features.len() as i64 == width, "the IP-Adapter reads a {width}-wide pooled CLIP-vision vector, got {:?}", features.shape());
        features.clone().reshape(&[width as usize, 1])?
    };
    let out = runner.compute(|g| Ok(adapter.forward(g, g.input(&features)))).context("IP-Adapter image projection failed")?;
    out.reshape(&[cfg.token_width() as usize, cfg.tokens() as usize, 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect(shapes: &[(&str, Vec<i64>)]) -> Result<IpAdapterConfig> {
        let map: HashMap<String, Vec<i64>> = shapes.iter().map(|(n, s)| (format!("{IMAGE_PROJ_PREFIX}{n}"), s.clone())).collect();
        IpAdapterConfig::detect(&|n| map.get(n).cloned(), IMAGE_PROJ_PREFIX)
    }

    #[test]
    fn kinds_and_sizes_come_from_the_weights() {
        let plain = detect(&[("proj.weight", vec![1024, 3072]), ("norm.weight", vec![768])]).unwrap();
        assert_eq!(plain, IpAdapterConfig::Plain { clip_dim: 1024, ctx_dim: 768, tokens: 4 });
        assert_eq!((plain.input_width(), plain.token_width(), plain.tokens(), plain.is_plus()), (1024, 768, 4, false));
        let plus = detect(&[
            ("latents", vec![768, 16, 1]),
            ("proj_in.weight", vec![1280, 768]),
            ("proj_out.weight", vec![768, 2048]),
            ("layers.0.1.1.weight", vec![768, 3072]),
            ("layers.0.0.to_q.weight", vec![768, 768]),
            ("layers.1.0.to_q.weight", vec![768, 768]),
        ])
        .unwrap();
        assert_eq!(plus, IpAdapterConfig::Plus { dim: 768, depth: 2, queries: 16, embed_dim: 1280, output_dim: 2048, ff_inner: 3072 });
        assert_eq!((plus.input_width(), plus.token_width(), plus.tokens(), plus.is_plus()), (1280, 2048, 16, true));
        let err = detect(&[("proj.weight", vec![1024, 3000]), ("norm.weight", vec![768])]).unwrap_err().to_string();
        assert!(err.contains("whole number"), "{err}");
        let err = detect(&[]).unwrap_err().to_string();
        assert!(err.contains("image_proj.proj.weight"), "{err}");
        let err = detect(&[("latents", vec![100, 16, 1]), ("proj_in.weight", vec![1280, 100]), ("proj_out.weight", vec![100, 768]), ("layers.0.1.1.weight", vec![100, 400])])
            .unwrap_err()
            .to_string();
        assert!(err.contains("heads of 64"), "{err}");
    }
}
