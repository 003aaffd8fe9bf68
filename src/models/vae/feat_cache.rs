//! The feature cache of video decoders that run one chunk of frames per graph: each
//! convolution that continues from the previous chunk reads and writes its own slot (the Wan
//! VAEs' causal convolutions, the LTX VAE's temporal tiles), kept on the host between graphs.

use crate::error::Result;
use crate::graph::{GgmlType, Graph, Runner, F16, F32, T};
use crate::tensor::Tensor;

/// A cache slot between computations: the frames' raw bytes, f16 where every reader rounds
/// them to f16 anyway (see [`FeatCache`]).
pub(crate) struct HostSlot {
    bytes: Vec<u8>,
    ne: [i64; 4],
    ty: GgmlType,
}

impl HostSlot {
    /// `bytes` of a computed `[W, H, T, C]` tensor of type `ty`.
    pub fn new(bytes: Vec<u8>, ne: [i64; 4], ty: GgmlType) -> HostSlot {
        HostSlot { bytes, ne, ty }
    }
}

/// A slot of the feature cache as one graph sees it.
enum Slot<'g> {
    Empty,
    /// Left by an earlier computation; uploaded when first read.
    Host(HostSlot),
    /// In this graph (read or written by it), as f32, with the type it is kept in.
    Live(T<'g>, GgmlType),
}

/// The frames each causal convolution continues from, by slot. Within one graph the slots
/// are graph tensors; between graphs (a video decoded one chunk per computation) they are
/// host bytes, uploaded when a graph first reads them and read back when it wrote them. The
/// frames only ever reach a convolution whose im2col rounds them to f16, so they are kept in
/// f16 (half the memory, the same sums) unless a convolution's columns are f32 (bf16 weights).
pub(crate) struct FeatCache<'g> {
    g: &'g Graph,
    slots: Vec<Slot<'g>>,
    /// Slots in the order this graph wrote them.
    written: Vec<usize>,
}

impl<'g> FeatCache<'g> {
    /// `n` empty slots (the first chunk).
    pub fn new(g: &'g Graph, n: usize) -> FeatCache<'g> {
        Self::from_host(g, Vec::new(), n)
    }

    /// The slots an earlier computation left (`None`: never written).
    pub fn from_host(g: &'g Graph, host: Vec<Option<HostSlot>>, n: usize) -> FeatCache<'g> {
        let mut slots: Vec<Slot<'g>> = host.into_iter().map(|s| s.map_or(Slot::Empty, Slot::Host)).collect();
        slots.resize_with(n.max(slots.len()), || Slot::Empty);
        FeatCache { g, slots, written: Vec::new() }
    }

    pub fn get(&mut self, i: usize) -> Option<T<'g>> {
        match std::mem::replace(&mut self.slots[i], Slot::Empty) {
            Slot::Empty => None,
            Slot::Host(h) => {
                let raw = self.g.input_bytes(h.ty, &h.ne, h.bytes);
                let x = if h.ty == F32 { raw } else { raw.cast(F32) };
                self.slots[i] = Slot::Live(x, h.ty);
                Some(x)
            }
            Slot::Live(t, ty) => {
                self.slots[i] = Slot::Live(t, ty);
                Some(t)
            }
        }
    }

    /// Writes slot `i`; `f16_columns`: every reader of it rounds to f16.
    pub fn set(&mut self, i: usize, t: T<'g>, f16_columns: bool) {
        self.slots[i] = Slot::Live(t, if f16_columns { F16 } else { F32 });
        if !self.written.contains(&i) {
            self.written.push(i);
        }
    }

    /// The tensors to read back — (slot, tensor in the type it is kept in), in the order
    /// the graph wrote them, then any it only read — and the host slots it left alone.
    pub fn finish(self) -> (Vec<(usize, T<'g>)>, Vec<Option<HostSlot>>) {
        let mut live: Vec<(usize, T<'g>)> = Vec::new();
        let mut host = Vec::with_capacity(self.slots.len());
        let mut read_only = Vec::new();
        for (i, s) in self.slots.into_iter().enumerate() {
            host.push(match s {
                Slot::Empty => None,
                Slot::Host(h) => Some(h),
                Slot::Live(t, ty) => {
                    let kept = if ty == F32 { t } else { t.cast(ty) };
                    live.push((i, kept));
                    if !self.written.contains(&i) {
                        read_only.push(i);
                    }
                    None
                }
            });
        }
        let rank = |i: usize| self.written.iter().position(|&w| w == i).unwrap_or(self.written.len() + read_only.iter().position(|&r| r == i).unwrap_or(0));
        live.sort_by_key(|(i, _)| rank(*i));
        (live, host)
    }
}

/// Whether a convolution with weights `w` rounds its input to f16 (`nn::conv_3d` builds f16
/// columns for every weight type but bf16).
pub(crate) fn f16_columns(w: T<'_>) -> bool {
    w.ty() == F16 || w.ty() == F32
}

/// Runs one graph whose causal convolutions continue from `cache` (host slots, `slots` of
/// them): `build` gets the graph and the cache. With `keep`, the slots the graph wrote come
/// back to `cache` for the next computation; otherwise (the last one) they are not read.
///
/// The slots are the graph's first outputs, in the order it wrote them: the graph then
/// computes each right after the frames it keeps, which can be freed then (read back last,
/// they would keep every layer's input alive to the end).
pub(crate) fn run_cached<F>(runner: &mut Runner, cache: &mut Vec<Option<HostSlot>>, slots: usize, keep: bool, build: F) -> Result<Tensor>
where
    F: for<'g> FnOnce(&'g Graph, &mut FeatCache<'g>) -> Result<T<'g>>,
{
    let host = std::mem::take(cache);
    let mut written: Vec<(usize, [i64; 4], GgmlType)> = Vec::new();
    let mut untouched: Vec<Option<HostSlot>> = Vec::new();
    let mut out_ne = [0i64; 4];
    let mut raw = runner.compute_bytes(|g| {
        let mut fc = FeatCache::from_host(g, host, slots);
        let out = build(g, &mut fc)?.contiguous();
        ensure!(out.ty() == F32, "vae: unexpected output type {}", out.ty());
        out_ne = out.ne();
        let (live, rest) = fc.finish();
        untouched = rest;
        let mut outs = Vec::new();
        if keep {
            for (i, t) in live {
                written.push((i, t.ne(), t.ty()));
                outs.push(t);
            }
        }
        outs.push(out);
        Ok(outs)
    })?;
    let bytes = raw.pop().ok_or_else(|| crate::error::Error::new("vae: the graph gave no output"))?;
    *cache = untouched;
    for ((i, ne, ty), b) in written.into_iter().zip(raw) {
        cache[i] = Some(HostSlot::new(b, ne, ty));
    }
    let data: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if !runner.backend().is_cpu() {
        ensure!(
            data.iter().all(|v| v.is_finite()),
            "{} computed a non-finite value: the device's result is wrong; try another device or --backend cpu",
            runner.backend().device_name()
        );
    }
    Tensor::from_vec(&out_ne.map(|d| d as usize), data)
}
