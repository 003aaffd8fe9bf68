//! PuLID for Flux (the reference's `pulid.hpp`): small cross-attention modules
//! (`pulid_ca.N`) between the Flux transformer blocks through which the image tokens read a
//! precomputed identity embedding, added back scaled by the request's `id_weight`.
//!
//! The reference fixes the attention to 16 heads of 128 over a 2048-wide embedding (the
//! width of PuLID's ID encoder); only the query/output width follows the Flux model. One
//! module runs after every second double block and one after every fourth single block,
//! numbered in that order. The embedding itself is not computed here: like the reference,
//! it is read from a GGUF file's `pulid_id` tensor (`[2048, tokens]`, f32, f16 or bf16),
//! made once per face by an external tool.

use crate::error::Result;
use crate::graph::nn::{attention, scale, LayerNorm, Linear};
use crate::graph::{Graph, Scope, T};
use crate::io::gguf;
use crate::tensor::Tensor;
use crate::types::SdType;
use std::io::{Read, Seek, SeekFrom};

/// Width of the identity embedding the modules' keys and values are made from.
pub const ID_DIM: i64 = 2048;
const HEADS: i64 = 16;
const HEAD_DIM: i64 = 128;
const EPS: f32 = 1e-5;
/// A module after every this many double blocks, and after every this many single blocks.
pub const DOUBLE_INTERVAL: usize = 2;
pub const SINGLE_INTERVAL: usize = 4;
/// Name of the embedding tensor in an identity file.
pub const ID_TENSOR: &str = "pulid_id";

/// Modules a Flux model of `depth` double and `single` single blocks carries.
pub fn module_count(depth: usize, single: usize) -> usize {
    depth.div_ceil(DOUBLE_INTERVAL) + single.div_ceil(SINGLE_INTERVAL)
}

/// One `pulid_ca.N`: image tokens attend to the identity tokens.
#[derive(Clone, Debug)]
pub struct PulidCa {
    norm1: LayerNorm,
    norm2: LayerNorm,
    to_q: Linear,
    to_kv: Linear,
    to_out: Linear,
}

impl PulidCa {
    /// The module in scope `s` for image tokens `dim` wide.
    pub fn new(s: &mut Scope, dim: i64) -> PulidCa {
        let inner = HEADS * HEAD_DIM;
        PulidCa {
            norm1: LayerNorm::new(s, "norm1", ID_DIM, EPS, true, true),
            norm2: LayerNorm::new(s, "norm2", dim, EPS, true, true),
            to_q: Linear::new(s, "to_q", dim, inner, false),
            to_kv: Linear::new(s, "to_kv", ID_DIM, 2 * inner, false),
            to_out: Linear::new(s, "to_out", inner, dim, false),
        }
    }

    /// `img + weight · attn(img → id)`: image tokens `[dim, L, N]`, identity `[2048, T, 1]`.
    pub fn apply<'g>(&self, g: &'g Graph, img: T<'g>, id: T<'g>, weight: f32) -> T<'g> {
        let inner = HEADS * HEAD_DIM;
        let q = self.to_q.forward(g, self.norm2.forward(g, img));
        let kv = self.to_kv.forward(g, self.norm1.forward(g, id));
        let [_, tokens, n, _] = kv.ne();
        let nb = kv.nb();
        let half = |i: usize| kv.view(&[inner, tokens, n], &[nb[1], nb[2]], i * inner as usize * nb[0]).cont();
        let out = attention(g, q, half(0), half(1), HEADS, None, false, false, 1.0);
        img.add(scale(self.to_out.forward(g, out), weight, false))
    }
}

/// The identity embedding of the GGUF file at `path` as `[width, tokens, 1]`, or `None`
/// with the reference's warning when the file cannot be read, has no `pulid_id` tensor, or
/// that tensor has an implausible shape or a type other than f32 / f16 / bf16 (the request
/// then runs without identity).
pub fn read_id_embedding(path: &str) -> Option<Tensor> {
    match read_embedding(path) {
        Ok(Some(t)) => {
            sd_info!("PuLID id-embedding: loaded [{}, {}] from '{path}'", t.ne(0), t.ne(1));
            Some(t)
        }
        Ok(None) => None,
        Err(e) => {
            sd_warn!("PuLID id-embedding: cannot read gguf '{path}': {e}");
            None
        }
    }
}

fn read_embedding(path: &str) -> Result<Option<Tensor>> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let file = gguf::read(&mut f, len, path)?;
    let Some(ts) = file.tensors.iter().find(|t| t.name() == ID_TENSOR) else {
        sd_warn!("PuLID id-embedding: no '{ID_TENSOR}' tensor in '{path}'");
        return Ok(None);
    };
    let ne = ts.ne();
    let (width, tokens) = (ne[0], ne[1]);
    if !(1..=65536).contains(&width) || !(1..=1024).contains(&tokens) || ne[2] != 1 || ne[3] != 1 {
        sd_warn!("PuLID id-embedding: implausible shape [{width}, {tokens}] in '{path}'");
        return Ok(None);
    }
    if !matches!(ts.ty(), SdType::F32 | SdType::F16 | SdType::Bf16) {
        sd_warn!("PuLID id-embedding: unsupported tensor type {} in '{path}'", ts.ty().name());
        return Ok(None);
    }
    let mut raw = vec![0u8; ts.nbytes() as usize];
    f.seek(SeekFrom::Start(ts.offset))?;
    f.read_exact(&mut raw)?;
    let n = (width * tokens) as u64;
    let mut out = vec![0u8; n as usize * 4];
    crate::io::dtype::convert_rows(&raw, ts.ty(), &mut out, SdType::F32, 1, n)?;
    Ok(Some(Tensor::from_vec(&[width as usize, tokens as usize, 1], crate::io::dtype::f32_values(&out))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_follow_the_block_counts() {
        assert_eq!(module_count(19, 38), 20);
        assert_eq!(module_count(2, 2), 2);
        assert_eq!(module_count(1, 0), 1);
    }

    fn gguf_file(name: &str, ne: &[i64], ty: u32, data: &[u8]) -> Vec<u8> {
        gguf::tests::file(3, &[], &[(name, ne, ty, 0)], data)
    }

    fn temp(bytes: &[u8], tag: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("pulid-{tag}-{}.gguf", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn embeddings_are_read_from_f16_and_f32() {
        let vals: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let p = temp(&gguf_file(ID_TENSOR, &[4, 3], 0, &f32_bytes), "f32");
        let t = read_id_embedding(p.to_str().unwrap()).unwrap();
        assert_eq!((t.ne(0), t.ne(1), t.ne(2)), (4, 3, 1));
        assert_eq!(t.data(), vals.as_slice());
        let f16_bytes: Vec<u8> = vals.iter().flat_map(|v| half_bits(*v).to_le_bytes()).collect();
        let p16 = temp(&gguf_file(ID_TENSOR, &[4, 3], 1, &f16_bytes), "f16");
        assert_eq!(read_id_embedding(p16.to_str().unwrap()).unwrap().data(), vals.as_slice());
        let other = temp(&gguf_file("face", &[4, 3], 0, &f32_bytes), "other");
        assert!(read_id_embedding(other.to_str().unwrap()).is_none());
        assert!(read_id_embedding("/nonexistent/pulid.gguf").is_none());
        for p in [p, p16, other] {
            let _ = std::fs::remove_file(p);
        }
    }

    /// f16 bits of small multiples of 0.5 (exact in f16).
    fn half_bits(v: f32) -> u16 {
        if v == 0.0 {
            return 0;
        }
        let b = v.to_bits();
        let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
        ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
    }
}
