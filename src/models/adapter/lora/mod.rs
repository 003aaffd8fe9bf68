//! LoRA and its LyCORIS relatives, like the reference's `LoraModel`: one file's updates of
//! one model's weights, applied either by merging them into the weights (`immediately`,
//! [`merge`]) or in every graph that uses the weights (`at_runtime`, [`runtime`]).
//!
//! Formats (the part names after the reference's renaming, see `io::lora`):
//! - LoRA / LoCon (kohya, PEFT, diffusers): `lora_down`, `lora_up`, optional Tucker
//!   `lora_mid`; scale = `scale` if present, else `alpha` / rank, else 1.
//! - full difference: `diff` (and `diff_b` for biases, as the bias's `diff`); scale 1.
//! - LoHa: `hada_w1_a/b`, `hada_w2_a/b`, optional Tucker `hada_t1/t2`; alpha / rank.
//! - LoKr: `lokr_w1` or `lokr_w1_a/b`, `lokr_w2` or `lokr_w2_a/b`; alpha / rank of the
//!   factored parts, 1 when none is factored.
//!
//! Every scale is then multiplied by the LoRA's multiplier. A weight may be updated in
//! pieces (`<weight>.1`, `.2`, … or q/k/v of a fused `in_proj`), stacked along its last
//! dimension. Updates that do not fit their weight are an error, never a ggml abort.

pub mod delta;
pub mod merge;
pub mod runtime;
#[cfg(test)]
mod tests;

use crate::error::{Context as _, Result};
use crate::graph::params::TensorSpec;
use crate::graph::{Backend, GgmlType, ParamStore, W};
use std::collections::{BTreeMap, HashMap};

pub use merge::Merged;
pub use runtime::RuntimeLoras;

/// The part names that hold tensors (the rest of a LoRA's parts are the scalars `alpha`
/// and `scale`).
pub const TENSOR_PARTS: &[&str] = &[
    "lora_up", "lora_down", "lora_mid", "diff", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lokr_w1",
    "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b",
];

/// One update of a weight piece.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    Lora { down: W, up: W, mid: Option<W> },
    Diff(W),
    LoHa { w1a: W, w1b: W, t1: Option<W>, w2a: W, w2b: W, t2: Option<W> },
    LoKr { w1: Factor, w2: Factor },
}

/// A LoKr Kronecker factor, whole or as a product `a · b`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Factor {
    Full(W),
    LowRank { a: W, b: W },
}

impl Update {
    /// LoRA and LoKr apply to a layer's output at run time; the others patch the weight.
    pub fn is_low_rank(&self) -> bool {
        matches!(self, Update::Lora { .. } | Update::LoKr { .. })
    }
}

/// An update with its final scale (rank rule × multiplier).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Piece {
    pub update: Update,
    pub scale: f32,
}

/// What one LoRA does to one weight: its pieces, stacked along the weight's last dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct Patch {
    pub pieces: Vec<Piece>,
}

/// The tensors of one piece by part name, and its scalars.
#[derive(Clone, Debug, Default)]
pub struct PieceTensors {
    pub tensors: BTreeMap<String, W>,
    pub alpha: Option<f32>,
    pub scale: Option<f32>,
}

/// `ggml_n_dims`: dimensions up to the last one larger than 1.
pub(crate) fn n_dims(ne: [i64; 4]) -> usize {
    ne.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1)
}

/// The rank a LoRA-family factor implies: its last dimension (ggml order), like the reference.
fn rank_of(w: W) -> f32 {
    let ne = w.ne();
    ne[n_dims(ne) - 1] as f32
}

/// The kinds in the order the reference looks for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Lora,
    Diff,
    LoHa,
    LoKr,
}

impl Kind {
    /// The update of `p` if it is of this kind, with the part names it uses.
    fn read(self, p: &PieceTensors, multiplier: f32) -> Option<(Piece, Vec<&'static str>)> {
        let t = |n: &str| p.tensors.get(n).copied();
        let mut used: Vec<&'static str> = Vec::new();
        let (update, scale) = match self {
            Kind::Lora => {
                let (down, up, mid) = (t("lora_down")?, t("lora_up")?, t("lora_mid"));
                used.extend(["lora_down", "lora_up"]);
                if mid.is_some() {
                    used.push("lora_mid");
                }
                let scale = match (p.scale, p.alpha) {
                    (Some(s), _) => {
                        used.push("scale");
                        s
                    }
                    (None, Some(a)) => {
                        used.push("alpha");
                        a / rank_of(down)
                    }
                    (None, None) => 1.0,
                };
                (Update::Lora { down, up, mid }, scale)
            }
            Kind::Diff => {
                used.push("diff");
                (Update::Diff(t("diff")?), 1.0)
            }
            Kind::LoHa => {
                let (w1a, w1b, w2a, w2b) = (t("hada_w1_a")?, t("hada_w1_b")?, t("hada_w2_a")?, t("hada_w2_b")?);
                let (t1, t2) = (t("hada_t1"), t("hada_t2"));
                used.extend(["hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"]);
                used.extend(t1.map(|_| "hada_t1"));
                used.extend(t2.map(|_| "hada_t2"));
                let scale = match p.alpha {
                    Some(a) => {
                        used.push("alpha");
                        a / rank_of(w1b)
                    }
                    None => 1.0,
                };
                (Update::LoHa { w1a, w1b, t1, w2a, w2b, t2 }, scale)
            }
            Kind::LoKr => {
                let factor = |full: &'static str, a: &'static str, b: &'static str, used: &mut Vec<&'static str>| {
                    if let Some(w) = t(full) {
                        used.push(full);
                        return Some((Factor::Full(w), None));
                    }
                    let (wa, wb) = (t(a)?, t(b)?);
                    used.extend([a, b]);
                    Some((Factor::LowRank { a: wa, b: wb }, Some(rank_of(wb))))
                };
                let (w1, r1) = factor("lokr_w1", "lokr_w1_a", "lokr_w1_b", &mut used)?;
                let (w2, r2) = factor("lokr_w2", "lokr_w2_a", "lokr_w2_b", &mut used)?;
                let rank = r2.or(r1).unwrap_or(1.0);
                let mut scale = 1.0;
                if let Some(a) = p.alpha {
                    used.push("alpha");
                    scale = a / rank;
                }
                if rank == 1.0 {
                    scale = 1.0;
                }
                (Update::LoKr { w1, w2 }, scale)
            }
        };
        Some((Piece { update, scale: scale * multiplier }, used))
    }
}

/// The patch of a weight from its pieces' tensors: the first kind (LoRA, diff, LoHa, LoKr)
/// that piece 0 has, over consecutive pieces of that kind. Also returns the (piece, part)
/// names it uses; the others are unused.
pub fn patch_from(pieces: &BTreeMap<usize, PieceTensors>, multiplier: f32) -> Option<(Patch, Vec<(usize, &'static str)>)> {
    for kind in [Kind::Lora, Kind::Diff, Kind::LoHa, Kind::LoKr] {
        let mut out = Vec::new();
        let mut used = Vec::new();
        for i in 0.. {
            let Some((piece, parts)) = pieces.get(&i).and_then(|p| kind.read(p, multiplier)) else { break };
            out.push(piece);
            used.extend(parts.into_iter().map(|n| (i, n)));
        }
        if !out.is_empty() {
            return Some((Patch { pieces: out }, used));
        }
    }
    None
}

/// One LoRA file's updates of the weights of one model store, with its tensors.
pub struct Lora {
    /// The file, for messages.
    pub label: String,
    store: ParamStore,
    /// By the model weight they update.
    patches: HashMap<W, Patch>,
    /// Model weights in the order they were added (for deterministic merging).
    order: Vec<W>,
}

/// A tensor to declare in a [`Lora`]'s store: file name, type, shape (ggml order).
pub struct TensorDecl<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub ne: &'a [i64],
}

impl Lora {
    /// A LoRA with room for `capacity` tensors.
    pub fn new(label: &str, capacity: usize) -> Result<Lora> {
        Ok(Lora { label: label.to_string(), store: ParamStore::new(capacity.max(1))?, patches: HashMap::new(), order: Vec::new() })
    }

    /// Declares a tensor of the file (once per name) and returns its handle.
    pub fn declare(&mut self, t: &TensorDecl) -> Result<W> {
        if let Some(w) = self.store.get(t.name) {
            return Ok(w);
        }
        ensure!(
            !t.ne.is_empty() && t.ne.len() <= 4 && t.ne.iter().all(|&d| d > 0),
            "LoRA '{}': tensor '{}' has an unusable shape {:?}",
            self.label,
            t.name,
            t.ne
        );
        ensure!(self.store.len() < self.store_capacity(), "LoRA '{}': too many tensors", self.label);
        Ok(self.store.declare(t.name, t.ty, t.ne))
    }

    fn store_capacity(&self) -> usize {
        self.store.capacity()
    }

    /// Sets the patch of model weight `weight`.
    pub fn add_patch(&mut self, weight: W, patch: Patch) {
        if self.patches.insert(weight, patch).is_none() {
            self.order.push(weight);
        }
    }

    /// Allocates the tensors on `backend` and fills them (`fill(name, spec, dst)`).
    pub fn load(&mut self, backend: &Backend, fill: impl FnMut(&str, &TensorSpec, &mut [u8]) -> Result<()>) -> Result<()> {
        self.store.alloc(backend).with_context(|| format!("LoRA '{}'", self.label))?;
        self.store.load(fill)
    }

    pub fn patch(&self, weight: W) -> Option<&Patch> {
        self.patches.get(&weight)
    }

    /// The updated model weights, in the order they were added.
    pub fn weights(&self) -> &[W] {
        &self.order
    }

    pub fn tensor_count(&self) -> usize {
        self.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.patches.is_empty()
    }
}
