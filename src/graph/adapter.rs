//! The run-time weight adapter seam, like the reference's `WeightAdapter`: a layer that owns
//! weights (Linear, Conv2d, the norms) asks the graph's adapter, by weight identity, whether
//! it changes them; if so the layer lets it patch the weights it multiplies with and add to
//! its output. LoRAs applied `at_runtime` implement it (`models::adapter::lora`), and so can
//! any later per-layer adapter.
//!
//! Weights are identified by their `W` handle, not by ggml's tensor names (ggml truncates
//! those); an adapter built for a `ParamStore` maps the store's handles to what it does.

use super::context::{Graph, T, W};

/// The op of the layer being adapted, with what is needed to repeat it on other weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LayerOp {
    Linear { force_prec_f32: bool, scale: f32 },
    /// Stride, padding and dilation in ggml's (x, y) order.
    Conv2d { stride: (i32, i32), padding: (i32, i32), dilation: (i32, i32), scale: f32 },
}

pub trait WeightAdapter: Send + Sync {
    /// Whether the adapter changes `w` (a weight or a bias) at all; other layers are built
    /// exactly as without an adapter.
    fn adapts(&self, w: W) -> bool;

    /// `t` (the graph's tensor of `w`) with the full-size updates added that must be in the
    /// weight itself. With `low_rank` the low-rank updates are merged in too (layers that
    /// cannot apply them to their output, e.g. norms); without it those are left to
    /// [`add_to_output`](Self::add_to_output).
    fn patch<'g>(&self, g: &'g Graph, w: W, t: T<'g>, low_rank: bool) -> T<'g>;

    /// The output `out` of a layer with weight `weight` and input `x`, plus the low-rank
    /// updates of `weight` applied to `x`.
    fn add_to_output<'g>(&self, g: &'g Graph, weight: W, x: T<'g>, out: T<'g>, op: LayerOp) -> T<'g>;

    /// [`add_to_output`](Self::add_to_output) for a linear layer whose weight cannot be
    /// patched (ComfyUI INT8 rows): per adapter, its full-size updates multiplied with `x`
    /// as a product of their own, then its low-rank ones.
    fn add_to_unpatched_output<'g>(&self, g: &'g Graph, weight: W, x: T<'g>, out: T<'g>, op: LayerOp) -> T<'g>;

    /// Graph nodes the adapter may add to one graph (on top of the model's own).
    fn extra_nodes(&self) -> usize;
}

impl Graph {
    /// The adapter when it changes any of `ws`.
    pub fn adapter_for(&self, ws: &[Option<W>]) -> Option<&dyn WeightAdapter> {
        let a = self.adapter.as_deref()?;
        ws.iter().flatten().any(|&w| a.adapts(w)).then_some(a)
    }

    /// A weight as the graph computes with it: patched by the adapter when it has one for it
    /// (low-rank updates merged in), otherwise the stored tensor.
    pub fn adapted_param(&self, w: W) -> T<'_> {
        match self.adapter_for(&[Some(w)]) {
            Some(a) => a.patch(self, w, self.param(w), true),
            None => self.param(w),
        }
    }
}
