//! LoRAs `at_runtime`, like the reference's `MultiLoraAdapter`: the model's weights stay as
//! loaded and every graph adds the updates. Full-size updates (diff, LoHa) are added to the
//! weight a layer multiplies with; LoRA and LoKr factors are applied to the layer's input
//! and their output added to the layer's (cheap at low rank, and exact for quantized
//! weights, which are never rewritten).

use super::delta::{merged_weight, output_delta, weight_delta};
use super::{n_dims, Lora, Patch};
use crate::error::Result;
use crate::graph::nn::linear;
use crate::graph::{Graph, LayerOp, ParamStore, WeightAdapter, F16, F32, T, W};
use std::collections::HashMap;

/// The graph nodes the reference reserves for LoRAs, plus 10 per LoRA tensor.
const BASE_NODES: usize = 10240;

/// Several LoRAs for one model store, consulted by its layers.
pub struct RuntimeLoras {
    loras: Vec<Lora>,
    /// Model weight → its name and the LoRAs updating it (indices, in order).
    weights: HashMap<W, (String, Vec<usize>)>,
    /// Every update merged into its weight in the graph (the `immediately` values for weights
    /// read per phase), instead of low-rank factors applied to the layer's input.
    merge: bool,
}

// SAFETY: after construction nothing is modified: graphs only read the LoRA tensors'
// metadata and ggml reads their data while computing; the stores are freed with `self`.
unsafe impl Sync for RuntimeLoras {}

impl RuntimeLoras {
    /// The adapter for `loras` (in order) over the weights of `model`. Every update is built
    /// once on a throwaway graph first, so one that does not fit its weight is an error
    /// here and never during a generation.
    pub fn new(loras: Vec<Lora>, model: &ParamStore) -> Result<RuntimeLoras> {
        let mut weights: HashMap<W, (String, Vec<usize>)> = HashMap::new();
        for (i, lora) in loras.iter().enumerate() {
            for &w in lora.weights() {
                let name = model.name_of(w).unwrap_or("?").to_string();
                weights.entry(w).or_insert_with(|| (name, Vec::new())).1.push(i);
            }
        }
        let adapter = RuntimeLoras { loras, weights, merge: false };
        adapter.check()?;
        Ok(adapter)
    }

    /// The adapter for `loras` that merges every update into its weight in each graph, in
    /// the weight's type one LoRA after the other (the same values as the `immediately`
    /// merge into the store): for weights read anew each phase (a text encoder off the
    /// compute device between conditionings), where a merge into the store would not last.
    pub fn merging(loras: Vec<Lora>, model: &ParamStore) -> Result<RuntimeLoras> {
        Ok(RuntimeLoras { merge: true, ..Self::new(loras, model)? })
    }

    fn patches(&self, w: W) -> impl Iterator<Item = (&str, &Patch)> {
        let entry = self.weights.get(&w);
        entry.into_iter().flat_map(move |(name, idx)| idx.iter().filter_map(move |&i| Some((name.as_str(), self.loras[i].patch(w)?))))
    }

    /// Builds every update the layers will ask for on dummy inputs.
    fn check(&self) -> Result<()> {
        let mut ws: Vec<&W> = self.weights.keys().collect();
        ws.sort_by_key(|w| self.weights[w].0.as_str());
        for chunk in ws.chunks(256) {
            let g = Graph::new()?;
            for &&w in chunk {
                let ne = w.ne();
                for (lora, (name, patch)) in self.weights[&w].1.iter().zip(self.patches(w)) {
                    let label = &self.loras[*lora].label;
                    let with_context = |e: crate::error::Error| crate::error::Error::new(format!("LoRA '{label}': {e}"));
                    let is_layer = matches!(n_dims(ne), 2 | 4);
                    weight_delta(&g, patch, ne, !is_layer, name).map_err(with_context)?;
                    if !is_layer {
                        continue;
                    }
                    let (x, out, op) = if n_dims(ne) == 2 {
                        let op = LayerOp::Linear { force_prec_f32: false, scale: 1.0 };
                        (g.new_tensor(F32, &[ne[0], 3]), g.new_tensor(F32, &[ne[1], 3]), op)
                    } else {
                        let op = LayerOp::Conv2d { stride: (1, 1), padding: (0, 0), dilation: (1, 1), scale: 1.0 };
                        (g.new_tensor(F32, &[ne[0] + 4, ne[1] + 4, ne[2], 1]), g.new_tensor(F32, &[5, 5, ne[3], 1]), op)
                    };
                    output_delta(&g, patch, ne, x, out, op, name).map_err(with_context)?;
                }
            }
        }
        Ok(())
    }

    pub fn loras(&self) -> &[Lora] {
        &self.loras
    }
}

impl RuntimeLoras {
    /// `out` plus, per LoRA in order, its low-rank updates of `weight` applied to `x`; with
    /// `full_size` (a linear layer whose weight is not patched) first its full-size updates
    /// as a product of their own.
    fn add_updates<'g>(&self, g: &'g Graph, weight: W, x: T<'g>, out: T<'g>, op: LayerOp, full_size: bool) -> T<'g> {
        let mut out = out;
        for (name, patch) in self.patches(weight) {
            if let (true, LayerOp::Linear { force_prec_f32, scale }) = (full_size, op) {
                match weight_delta(g, patch, weight.ne(), false, name) {
                    Ok(Some(d)) => out = out.add_inplace(linear(g, x, d, None, force_prec_f32, scale)),
                    Ok(None) => {}
                    Err(e) => sd_error!("LoRA skipped: {e}"),
                }
            }
            match output_delta(g, patch, weight.ne(), x, out, op, name) {
                Ok(Some(y)) => out = out.add_inplace(y),
                Ok(None) => {}
                // Checked when the adapter was made; kept as a message, never an abort.
                Err(e) => sd_error!("LoRA skipped: {e}"),
            }
        }
        out
    }
}

impl WeightAdapter for RuntimeLoras {
    fn adapts(&self, w: W) -> bool {
        self.weights.contains_key(&w)
    }

    fn patch<'g>(&self, g: &'g Graph, w: W, t: T<'g>, low_rank: bool) -> T<'g> {
        if self.merge {
            let (name, patches): (Vec<&str>, Vec<&Patch>) = self.patches(w).unzip();

            return match merged_weight(g, t, true, &patches, name.first().copied().unwrap_or("?")) {
                Ok(m) => m,
                // Checked when the adapter was made; kept as a message, never an abort.
                Err(e) => {
                    sd_error!("LoRA skipped: {e}");
                    t
                }
            };
        }
        let mut t = t;
        for (name, patch) in self.patches(w) {
            match weight_delta(g, patch, w.ne(), low_rank, name) {
                Ok(Some(d)) => {
                    if t.ty() != F32 && t.ty() != F16 {
                        t = t.cast(F32);
                    }
                    t = t.add(d);
                }
                Ok(None) => {}
                // Checked when the adapter was made; kept as a message, never an abort.
                Err(e) => sd_error!("LoRA skipped: {e}"),
            }
        }
        t
    }

    fn add_to_output<'g>(&self, g: &'g Graph, weight: W, x: T<'g>, out: T<'g>, op: LayerOp) -> T<'g> {
        if self.merge {
            // Merged into the weight by `patch`.
            return out;
        }
        self.add_updates(g, weight, x, out, op, false)
    }

    fn add_to_unpatched_output<'g>(&self, g: &'g Graph, weight: W, x: T<'g>, out: T<'g>, op: LayerOp) -> T<'g> {
        self.add_updates(g, weight, x, out, op, matches!(op, LayerOp::Linear { .. }))
    }

    fn extra_nodes(&self) -> usize {
        BASE_NODES + 10 * self.loras.iter().map(Lora::tensor_count).sum::<usize>()
    }
}
