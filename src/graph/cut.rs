//! Running a graph in segments under a device memory budget (`max_vram`), like the
//! reference's graph cut.
//!
//! Model code marks tensors after which a graph may be cut (`Graph::mark_cut`: the UNet's
//! block outputs, say). With a budget, the runner groups consecutive cut groups into the
//! largest segments whose compute buffer, weights, cut inputs and outputs fit the budget,
//! then runs them one after another: each segment's weights are copied to the device for
//! it (when they live in host memory) and freed after, and the cut outputs later segments
//! read are kept in small device buffers in between. Tensors a segment needs that are not
//! cut outputs (the time embedding, say) are recomputed in it, as in the reference.

use super::backend::Backend;
use super::context::{Ctx, Graph, MAX_NODES, T};
use super::params::Staged;
use super::runner::{read_f32, upload_inputs, weight_buffer, Runner};
use crate::error::{Context as _, Result};
use crate::tensor::Tensor;
use ggml_sys as g;
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::ptr::NonNull;

const CUT_PREFIX: &str = "sd_cut:";

/// Most device bytes any run under a `max_vram` budget held at once since the last call
/// (compute buffer, uploaded weights and kept cut outputs): what the budget bounds.
pub(crate) static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Returns and resets the peak device memory of runs under a budget (0: none ran).
pub fn take_peak_device_bytes() -> usize {
    PEAK.swap(0, std::sync::atomic::Ordering::Relaxed)
}

impl Graph {
    /// Marks `t` as the output `group` hands to the rest of the graph: with a `max_vram`
    /// budget the graph may be cut after it. Tensors marked with one group form one piece.
    pub fn mark_cut<'g>(&'g self, t: T<'g>, group: &str) -> T<'g> {
        // Views share storage with their source and cannot be cached on their own.
        // SAFETY: t belongs to this graph.
        if unsafe { (*t.raw()).view_src.is_null() } {
            if let Ok(name) = std::ffi::CString::new(format!("{CUT_PREFIX}{group}")) {
                // SAFETY: ggml copies (and truncates to GGML_MAX_NAME) the name.
                unsafe { g::ggml_set_name(t.raw(), name.as_ptr()) };
            }
        }
        t
    }
}

fn cut_group(t: *mut g::ggml_tensor) -> Option<String> {
    // SAFETY: live tensor; its name is NUL-terminated.
    let name = unsafe { CStr::from_ptr((*t).name.as_ptr()) }.to_string_lossy();
    name.strip_prefix(CUT_PREFIX).map(str::to_string)
}

/// Whether the graph has cut marks.
pub(crate) fn has_cuts(gf: *mut g::ggml_cgraph) -> bool {
    // SAFETY: nodes of a valid graph.
    unsafe { (0..g::ggml_graph_n_nodes(gf)).any(|i| cut_group(g::ggml_graph_node(gf, i)).is_some()) }
}

/// One piece of the graph between cut points.
struct Piece {
    group: String,
    outputs: Vec<*mut g::ggml_tensor>,
}

/// What computing `outputs` needs when `available` tensors are already computed.
struct Closure {
    internal: Vec<*mut g::ggml_tensor>,
    weights: Vec<*mut g::ggml_tensor>,
    cut_inputs: Vec<*mut g::ggml_tensor>,
    /// Leaves that are neither weights nor cut inputs (graph inputs, shape operands).
    leaves: Vec<*mut g::ggml_tensor>,
}

fn closure(outputs: &[*mut g::ggml_tensor], produced: &HashSet<*mut g::ggml_tensor>, available: &HashSet<*mut g::ggml_tensor>) -> Closure {
    let mut c = Closure { internal: Vec::new(), weights: Vec::new(), cut_inputs: Vec::new(), leaves: Vec::new() };
    let mut seen = HashSet::new();
    let mut stack: Vec<*mut g::ggml_tensor> = outputs.to_vec();
    while let Some(t) = stack.pop() {
        if t.is_null() || !seen.insert(t) {
            continue;
        }
        if available.contains(&t) {
            c.cut_inputs.push(t);
            continue;
        }
        if !produced.contains(&t) {
            if weight_buffer(t).is_some() {
                // SAFETY: live tensor.
                let base = unsafe { super::runner::view_base(t) };
                c.weights.push(base);
            } else {
                c.leaves.push(t);
            }
            continue;
        }
        c.internal.push(t);
        // SAFETY: live tensor; its sources are live tensors of the same graph.
        unsafe {
            stack.extend((*t).src.iter().copied().filter(|s| !s.is_null()));
            if !(*t).view_src.is_null() {
                stack.push((*t).view_src);
            }
        }
    }
    c.weights.sort();
    c.weights.dedup();
    c
}

fn nbytes(t: *mut g::ggml_tensor) -> usize {
    // SAFETY: live tensor.
    unsafe { g::ggml_nbytes(t) }
}

/// Binding of a tensor while it stands for a computed value in a later segment.
struct Binding {
    t: *mut g::ggml_tensor,
    op: g::ggml_op,
    src: [*mut g::ggml_tensor; 10],
    data: *mut libc::c_void,
    buffer: g::ggml_backend_buffer_t,
}

/// Makes `t` a leaf with the given storage (restored by `unbind` while planning).
fn bind_as_leaf(t: *mut g::ggml_tensor, data: *mut libc::c_void, buffer: g::ggml_backend_buffer_t) -> Binding {
    // SAFETY: live tensor; fields are plain data.
    unsafe {
        let b = Binding { t, op: (*t).op, src: (*t).src, data: (*t).data, buffer: (*t).buffer };
        (*t).op = g::GGML_OP_NONE;
        (*t).src = [std::ptr::null_mut(); 10];
        (*t).data = data;
        (*t).buffer = buffer;
        b
    }
}

fn unbind(b: Binding) {
    // SAFETY: restores what `bind_as_leaf` saved.
    unsafe {
        (*b.t).op = b.op;
        (*b.t).src = b.src;
        (*b.t).data = b.data;
        (*b.t).buffer = b.buffer;
    }
}

/// A graph of `outputs` in its own small context (tensors stay in the big graph's).
struct SubGraph {
    _ctx: Ctx,
    gf: *mut g::ggml_cgraph,
}

fn subgraph(outputs: &[*mut g::ggml_tensor]) -> Result<SubGraph> {
    // SAFETY: pure size computation.
    let ctx = Ctx::with_size(unsafe { g::ggml_graph_overhead_custom(MAX_NODES, false) } + 4096, true)?;
    // SAFETY: the context has room for one graph of MAX_NODES nodes.
    let gf = unsafe { g::ggml_new_graph_custom(ctx.raw(), MAX_NODES, false) };
    ensure!(!gf.is_null(), "could not create a segment graph");
    for &o in outputs {
        // SAFETY: live tensors; expansion stops at leaves.
        unsafe {
            g::ggml_set_output(o);
            g::ggml_build_forward_expand(gf, o);
        }
    }
    Ok(SubGraph { _ctx: ctx, gf })
}

/// Compute buffer bytes of a segment, measured on `backend`'s buffer type.
fn measure(backend: &Backend, outputs: &[*mut g::ggml_tensor], cut_inputs: &[*mut g::ggml_tensor]) -> Result<usize> {
    // A dummy address: the allocator skips tensors that have data (they live elsewhere).
    let bindings: Vec<Binding> = cut_inputs.iter().map(|&t| bind_as_leaf(t, std::ptr::dangling_mut::<libc::c_void>(), std::ptr::null_mut())).collect();
    let result = (|| {
        let sg = subgraph(outputs)?;
        // SAFETY: valid backend; the allocator is freed below.
        let a = unsafe { g::ggml_gallocr_new(g::ggml_backend_get_default_buffer_type(backend.raw())) };
        let a = NonNull::new(a).context("could not create a graph allocator")?;
        let mut size = [0usize; 1];
        // SAFETY: valid allocator and graph; one buffer.
        unsafe {
            g::ggml_gallocr_reserve_n_size(a.as_ptr(), sg.gf, std::ptr::null(), std::ptr::null(), size.as_mut_ptr());
            g::ggml_gallocr_free(a.as_ptr());
        }
        Ok(size[0])
    })();
    bindings.into_iter().for_each(unbind);
    result
}

/// Which pieces run together: ranges of piece indices.
fn plan(runner: &Runner, pieces: &[Piece], produced: &HashSet<*mut g::ggml_tensor>) -> Result<Vec<(usize, usize)>> {
    let budget = runner.max_vram;
    // Cut outputs read by pieces after each piece.
    let mut base_inputs: Vec<HashSet<*mut g::ggml_tensor>> = Vec::new();
    let mut available = HashSet::new();
    for p in pieces {
        let c = closure(&p.outputs, produced, &available);
        base_inputs.push(c.cut_inputs.into_iter().collect());
        available.extend(p.outputs.iter().copied());
    }
    let needed_after = |j: usize| -> HashSet<*mut g::ggml_tensor> { base_inputs[j + 1..].iter().flatten().copied().collect() };
    let mut ranges = Vec::new();
    let mut available: HashSet<*mut g::ggml_tensor> = HashSet::new();
    let mut i = 0;
    while i < pieces.len() {
        let cost = |j: usize| -> Result<usize> {
            let later = needed_after(j);
            let mut outs: Vec<*mut g::ggml_tensor> = pieces[j].outputs.clone();
            for p in &pieces[i..j] {
                outs.extend(p.outputs.iter().filter(|o| later.contains(o)));
            }
            let c = closure(&outs, produced, &available);
            let compute = measure(&runner.backend, &outs, &c.cut_inputs)?;
            let weights: usize = c.weights.iter().map(|&w| nbytes(w)).sum();
            let cuts: usize = c.cut_inputs.iter().chain(&outs).map(|&t| nbytes(t)).sum();
            Ok(compute + weights + cuts)
        };
        let mut end = i;
        if cost(i)? <= budget {
            while end + 1 < pieces.len() && cost(end + 1)? <= budget {
                end += 1;
            }
        }
        ranges.push((i, end));
        for p in &pieces[i..=end] {
            available.extend(p.outputs.iter().copied());
        }
        i = end + 1;
    }
    Ok(ranges)
}

/// A device copy of computed cut outputs, kept until the last segment that reads them.
struct CacheBuffer {
    _ctx: Ctx,
    buffer: NonNull<g::ggml_backend_buffer>,
    bytes: usize,
    last_use: usize,
}

impl Drop for CacheBuffer {
    fn drop(&mut self) {
        // SAFETY: we own the buffer.
        unsafe { g::ggml_backend_buffer_free(self.buffer.as_ptr()) };
    }
}

/// Runs `gf` (built in `graph`, outputs `outputs`) segment by segment on the runner's device.
pub(crate) fn compute_segments(runner: &mut Runner, graph: &Graph, gf: *mut g::ggml_cgraph, outputs: &[*mut g::ggml_tensor]) -> Result<Vec<Tensor>> {
    runner.release_compute_buffers();
    // SAFETY: nodes of a valid graph.
    let nodes: Vec<*mut g::ggml_tensor> = unsafe { (0..g::ggml_graph_n_nodes(gf)).map(|i| g::ggml_graph_node(gf, i)).collect() };
    let produced: HashSet<*mut g::ggml_tensor> = nodes.iter().copied().collect();
    let mut pieces: Vec<Piece> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for &n in &nodes {
        let Some(group) = cut_group(n) else { continue };
        match index.get(&group) {
            Some(&i) => pieces[i].outputs.push(n),
            None => {
                index.insert(group.clone(), pieces.len());
                pieces.push(Piece { group, outputs: vec![n] });
            }
        }
    }
    pieces.push(Piece { group: "final".into(), outputs: outputs.to_vec() });

    let signature = format!(
        "{}|{}|{:?}",
        nodes.len(),
        pieces.iter().map(|p| p.group.as_str()).collect::<Vec<_>>().join(","),
        graph.inputs.borrow().iter().map(|i| unsafe { (*i.tensor).ne }).collect::<Vec<_>>()
    );
    let ranges = match &runner.cut_plan {
        Some((sig, r)) if *sig == signature => r.clone(),
        _ => {
            let start = std::time::Instant::now();
            let r = plan(runner, &pieces, &produced)?;
            sd_info!(
                "graph cut max_vram={:.2} MB: {} pieces -> {} segments ({:.2}s)",
                runner.max_vram as f64 / (1024.0 * 1024.0),
                pieces.len(),
                r.len(),
                start.elapsed().as_secs_f32()
            );
            runner.cut_plan = Some((signature, r.clone()));
            r
        }
    };

    // Which segment reads each cut output last.
    let mut available: HashSet<*mut g::ggml_tensor> = HashSet::new();
    let mut last_use: HashMap<*mut g::ggml_tensor, usize> = HashMap::new();
    let mut seg_outputs: Vec<Vec<*mut g::ggml_tensor>> = Vec::new();
    for (k, &(i, j)) in ranges.iter().enumerate() {
        let outs: Vec<*mut g::ggml_tensor> = if j + 1 == pieces.len() {
            outputs.to_vec()
        } else {
            pieces[i..=j].iter().flat_map(|p| p.outputs.iter().copied()).collect()
        };
        let c = closure(&outs, &produced, &available);
        for t in c.cut_inputs {
            last_use.insert(t, k);
        }
        available.extend(pieces[i..=j].iter().flat_map(|p| p.outputs.iter().copied()));
        seg_outputs.push(outs);
    }

    if runner.stream_layers && runner.resident.is_none() {
        keep_leading_weights_resident(runner, &ranges, &pieces, &produced)?;
    }
    let resident_bytes = runner.resident.as_ref().map_or(0, |r| r.bytes);

    let backend = runner.backend.clone();
    let mut caches: Vec<CacheBuffer> = Vec::new();
    let mut cached: HashMap<*mut g::ggml_tensor, *mut g::ggml_tensor> = HashMap::new();
    let mut available: HashSet<*mut g::ggml_tensor> = HashSet::new();
    let mut peak = 0usize;
    let mut result = Vec::new();
    for (k, outs) in seg_outputs.iter().enumerate() {
        let last = k + 1 == seg_outputs.len();
        let c = closure(outs, &produced, &available);
        // Computed values from earlier segments become leaves bound to their cached copy.
        for &t in &c.cut_inputs {
            let src = *cached.get(&t).with_context(|| format!("graph cut: no cached value for segment {k}"))?;
            // SAFETY: src is a live cache tensor with storage.
            let _ = unsafe { bind_as_leaf(t, (*src).data, (*src).buffer) };
        }
        // Everything this segment computes, and its other leaves, get fresh storage.
        for &t in c.internal.iter().chain(&c.leaves) {
            // SAFETY: live graph tensor; its old storage (an earlier segment's) is gone.
            unsafe {
                (*t).data = std::ptr::null_mut();
                (*t).buffer = std::ptr::null_mut();
                (*t).extra = std::ptr::null_mut();
            }
        }
        for input in graph.inputs.borrow().iter() {
            // SAFETY: graph inputs are leaves of this graph; allocated anew where used.
            unsafe {
                (*input.tensor).data = std::ptr::null_mut();
                (*input.tensor).buffer = std::ptr::null_mut();
            }
        }
        let foreign: Vec<*mut g::ggml_tensor> = c.weights.iter().copied().filter(|&w| unsafe { !backend.can_use_buffer((*w).buffer) }).collect();
        let staged = if foreign.is_empty() { None } else { Some(Staged::new(&backend, &foreign)?) };
        let sg = subgraph(outs)?;
        // SAFETY: valid backend; freed at the end of this iteration.
        let a = unsafe { g::ggml_gallocr_new(g::ggml_backend_get_default_buffer_type(backend.raw())) };
        let a = NonNull::new(a).context("could not create a graph allocator")?;
        struct FreeAlloc(NonNull<g::ggml_gallocr>);
        impl Drop for FreeAlloc {
            fn drop(&mut self) {
                // SAFETY: we own the allocator.
                unsafe { g::ggml_gallocr_free(self.0.as_ptr()) };
            }
        }
        let a = FreeAlloc(a);
        // SAFETY: valid allocator and graph.
        let ok = unsafe { g::ggml_gallocr_alloc_graph(a.0.as_ptr(), sg.gf) };
        ensure!(ok, "graph cut: could not allocate segment {} on {} (out of memory?)", k + 1, backend.device_name());
        let compute_bytes = unsafe { g::ggml_gallocr_get_buffer_size(a.0.as_ptr(), 0) };
        upload_inputs(graph);
        backend.set_n_threads(runner.n_threads());
        let status = super::observe::compute(&backend, sg.gf, runner.n_threads());
        super::runner::failed_unless(status, &backend).with_context(|| format!("segment {}", k + 1))?;

        // Keep the cut outputs later segments read.
        let keep: Vec<*mut g::ggml_tensor> = outs.iter().copied().filter(|t| last_use.get(t).is_some_and(|&u| u > k)).collect();
        let mut cache_bytes_new = 0;
        if !keep.is_empty() && !last {
            let ctx = Ctx::metadata(keep.len() + 1)?;
            let copies: Vec<*mut g::ggml_tensor> = keep.iter().map(|&t| unsafe { g::ggml_dup_tensor(ctx.raw(), t) }).collect();
            // SAFETY: metadata context of fresh tensors; null is checked.
            let buf = unsafe { g::ggml_backend_alloc_ctx_tensors(ctx.raw(), backend.raw()) };
            let buffer = NonNull::new(buf).with_context(|| format!("graph cut: could not keep segment {} outputs on {}", k + 1, backend.device_name()))?;
            for (&t, &c) in keep.iter().zip(&copies) {
                // SAFETY: same shapes and types; both on this backend.
                unsafe { g::ggml_backend_tensor_copy(t, c) };
                cached.insert(t, c);
                cache_bytes_new += nbytes(c);
            }
            let last_use = keep.iter().filter_map(|t| last_use.get(t)).copied().max().unwrap_or(k);
            caches.push(CacheBuffer { _ctx: ctx, buffer, bytes: cache_bytes_new, last_use });
        }
        let cache_bytes: usize = caches.iter().map(|c| c.bytes).sum();
        let held = compute_bytes + staged.as_ref().map_or(0, |s| s.bytes) + cache_bytes + resident_bytes;
        peak = peak.max(held);
        sd_debug!(
            "graph cut segment {}/{}: compute {:.2} MB, weights {:.2} MB, cached {:.2} MB",
            k + 1,
            seg_outputs.len(),
            compute_bytes as f64 / 1048576.0,
            staged.as_ref().map_or(0, |s| s.bytes) as f64 / 1048576.0,
            cache_bytes as f64 / 1048576.0
        );
        if last {
            result = outputs.iter().map(|&o| read_f32(o)).collect::<Result<Vec<_>>>()?;
        }
        drop(a);
        drop(staged);
        caches.retain(|c| c.last_use > k);
        available.extend(outs.iter().copied());
    }
    runner.peak_device_bytes = runner.peak_device_bytes.max(peak);
    PEAK.fetch_max(peak, std::sync::atomic::Ordering::Relaxed);
    Ok(result)
}

/// `stream_layers`: the weights of the leading segments that fit next to the largest
/// segment stay on the device between runs; the others are uploaded per segment.
fn keep_leading_weights_resident(runner: &mut Runner, ranges: &[(usize, usize)], pieces: &[Piece], produced: &HashSet<*mut g::ggml_tensor>) -> Result<()> {
    let mut available = HashSet::new();
    let mut per_segment: Vec<Vec<*mut g::ggml_tensor>> = Vec::new();
    for &(i, j) in ranges {
        let outs: Vec<*mut g::ggml_tensor> = pieces[i..=j].iter().flat_map(|p| p.outputs.iter().copied()).collect();
        let c = closure(&outs, produced, &available);
        per_segment.push(c.weights.into_iter().filter(|&w| unsafe { !runner.backend.can_use_buffer((*w).buffer) }).collect());
        available.extend(outs);
    }
    let worst = per_segment.iter().map(|w| w.iter().map(|&t| nbytes(t)).sum::<usize>()).max().unwrap_or(0);
    // Room left after the largest streamed segment's weights and its compute (about as big).
    let room = runner.max_vram.saturating_sub(2 * worst);
    let mut chosen: Vec<*mut g::ggml_tensor> = Vec::new();
    let mut total = 0;
    for w in &per_segment {
        let bytes: usize = w.iter().filter(|t| !chosen.contains(t)).map(|&t| nbytes(t)).sum();
        if total + bytes > room {
            break;
        }
        total += bytes;
        chosen.extend(w.iter().copied().filter(|t| !chosen.contains(t)).collect::<Vec<_>>());
    }
    if !chosen.is_empty() {
        sd_info!("stream layers: {:.2} MB of weights stay on {}", total as f64 / 1048576.0, runner.backend.device_name());
        runner.resident = Some(Staged::new(&runner.backend, &chosen)?);
    }
    Ok(())
}
