//! Graph execution: allocate a graph's intermediate tensors, upload inputs, compute on a
//! backend, read outputs back to the host.
//!
//! The compute buffer is kept between runs so a sampling loop does not reallocate it at
//! every step. A graph with an op the device cannot run, or whose weights are spread over
//! several devices (a layer split), runs through ggml's scheduler with the CPU as the
//! fallback device instead of failing. Weights the device cannot read where they live
//! (host memory, `params_backend=cpu`) are copied to it for the graph. With a `max_vram`
//! budget, graphs that mark cut points run in segments that fit it (`graph::cut`).

use super::adapter::WeightAdapter;
use super::backend::Backend;
use super::context::{Graph, GraphOptions, MAX_NODES, T};
use super::devices::Placement;
use super::params::Staged;
use crate::error::{Context as _, Result};
use crate::tensor::Tensor;
use ggml_sys as g;
use std::collections::{HashMap, HashSet};
use std::ptr::NonNull;
use std::sync::Arc;

pub struct Runner {
    pub(crate) backend: Arc<Backend>,
    /// Further devices of a layer split.
    split: Vec<Arc<Backend>>,
    /// The scheduler's CPU fallback (created when first needed).
    cpu: Option<Arc<Backend>>,
    n_threads: i32,
    galloc: Option<NonNull<g::ggml_gallocr>>,
    sched: Option<NonNull<g::ggml_backend_sched>>,
    /// Size of the compute buffer last reported, so growth is logged once.
    buffer_bytes: usize,
    /// `max_vram` in bytes (0: off).
    pub max_vram: usize,
    /// Keep the leading segments' weights on the device between runs (`stream_layers`).
    pub stream_layers: bool,
    /// Weights kept on the device for `stream_layers`.
    pub(crate) resident: Option<Staged>,
    /// Most device memory the last segmented runs held at once (compute + weights + cache).
    pub(crate) peak_device_bytes: usize,
    /// The segment plan of the last segmented graph, by graph signature.
    pub(crate) cut_plan: Option<(String, Vec<(usize, usize)>)>,
    /// Tests: segment on the CPU too (normally a budget only applies to other devices).
    #[cfg(test)]
    pub(crate) segment_on_cpu: bool,
    pub options: GraphOptions,
    /// The scheduler's "evaluation callback ignored" warning was given.
    eval_callback_warned: bool,
    /// Handed to every graph this runner builds (run-time LoRAs).
    adapter: Option<Arc<dyn WeightAdapter>>,
}

// SAFETY: the allocator and scheduler are owned exclusively by the runner.
unsafe impl Send for Runner {}

impl Runner {
    pub fn new(backend: Arc<Backend>, n_threads: i32) -> Runner {
        Runner {
            backend,
            split: Vec::new(),
            cpu: None,
            n_threads: n_threads.max(1),
            galloc: None,
            sched: None,
            buffer_bytes: 0,
            max_vram: 0,
            stream_layers: false,
            resident: None,
            peak_device_bytes: 0,
            cut_plan: None,
            #[cfg(test)]
            segment_on_cpu: false,
            options: GraphOptions::default(),
            eval_callback_warned: false,
            adapter: None,
        }
    }

    /// A runner computing where `placement` says (devices, budget).
    pub fn for_placement(placement: &Placement, n_threads: i32) -> Runner {
        let mut r = Runner::new(placement.compute.clone(), n_threads);
        r.split = placement.split.clone();
        r.max_vram = placement.max_vram;
        r.stream_layers = placement.stream_layers;
        r
    }

    /// Sets (or clears) the adapter the layers of every later graph consult.
    pub fn set_adapter(&mut self, adapter: Option<Arc<dyn WeightAdapter>>) {
        self.adapter = adapter;
    }

    pub fn adapter(&self) -> Option<&Arc<dyn WeightAdapter>> {
        self.adapter.as_ref()
    }

    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    pub fn n_threads(&self) -> i32 {
        self.n_threads
    }

    /// Most device bytes held at once by the segmented runs since the last `release`.
    pub fn peak_device_bytes(&self) -> usize {
        self.peak_device_bytes
    }

    /// Builds a graph with `build` and computes its single output.
    pub fn compute<F>(&mut self, build: F) -> Result<Tensor>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<T<'g>>,
    {
        let mut out = self.compute_many(|g| Ok(vec![build(g)?]))?;
        Ok(out.pop().expect("one output"))
    }

    /// Builds a graph with `build` and computes all its outputs (each as a 4-D host tensor).
    pub fn compute_many<F>(&mut self, build: F) -> Result<Vec<Tensor>>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<Vec<T<'g>>>,
    {
        self.run(build)
    }

    /// Builds a graph with `build` and returns the raw bytes of each output in its own type
    /// (e.g. weights computed in f16 or q8_0).
    pub fn compute_bytes<F>(&mut self, build: F) -> Result<Vec<Vec<u8>>>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<Vec<T<'g>>>,
    {
        self.run(build)
    }

    /// Builds, allocates and computes a graph and reads its outputs as `R`.
    fn run<F, R: Readout>(&mut self, build: F) -> Result<Vec<R>>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<Vec<T<'g>>>,
    {
        let extra = self.adapter.as_ref().map_or(0, |a| a.extra_nodes());
        let mut graph = Graph::with_nodes(MAX_NODES + extra)?;
        graph.options = self.options;
        graph.backend = self.backend.raw();
        // A layer split schedules the graph over other devices: our CPU-only ops (custom ops
        // included, which a remote RPC device would run as nothing) must not be built then.
        graph.on_cpu = self.backend.is_cpu() && self.split.is_empty();
        graph.adapter = self.adapter.clone();
        let outputs = build(&graph)?;
        ensure!(!outputs.is_empty(), "graph has no output");
        let unread = graph.unread_weights.get();
        ensure!(unread == 0, "{unread} weights of this graph were not read yet (a network computed outside its phase)");
        // SAFETY: the graph context was sized for max_nodes nodes.
        let gf = unsafe { g::ggml_new_graph_custom(graph.ctx(), graph.max_nodes, false) };
        ensure!(!gf.is_null(), "could not create a compute graph");
        let raw_outputs: Vec<*mut g::ggml_tensor> = outputs.iter().map(|t| t.set_output().raw()).collect();
        for &o in &raw_outputs {
            // SAFETY: o belongs to the graph context.
            unsafe { g::ggml_build_forward_expand(gf, o) };
        }

        #[cfg(test)]
        let device = !self.backend.is_cpu() || self.segment_on_cpu;
        #[cfg(not(test))]
        let device = !self.backend.is_cpu();
        if self.max_vram > 0 && device && self.split.is_empty() && super::cut::has_cuts(gf) {
            let out = super::cut::compute_segments(self, &graph, gf, &raw_outputs)?;
            return R::from_segments(self.checked(out)?);
        }

        // Weights the devices cannot read where they are: a copy for this graph.
        let foreign: Vec<*mut g::ggml_tensor> =
            weight_leaves(gf).into_iter().filter(|&t| !self.usable_here(unsafe { (*t).buffer })).collect();
        let staged_now = if foreign.is_empty() { None } else { Some(Staged::new(&self.backend, &foreign)?) };

        let scheduled = !self.split.is_empty() || (!self.backend.is_cpu() && !all_supported(&self.backend, gf));
        if scheduled {
            self.run_scheduled(gf)?;
        } else {
            self.run_allocated(gf)?;
        }
        upload_inputs(&graph);
        // The device holds them now: their host bytes (a video decoder's feature cache, a
        // VAE's input) need not stay alive through the computation and the readback.
        graph.inputs.borrow_mut().clear();
        self.backend.set_n_threads(self.n_threads);
        let status = if let Some(s) = self.sched {
            if let Some(cpu) = &self.cpu {
                cpu.set_n_threads(self.n_threads);
            }
            if super::eval_callback::is_set() && !self.eval_callback_warned {
                sd_warn!("the backend evaluation callback is not supported on graphs scheduled over several devices; ignoring it");
                self.eval_callback_warned = true;
            }
            let start = std::time::Instant::now();
            // SAFETY: graph allocated by this scheduler.
            let st = unsafe { g::ggml_backend_sched_graph_compute(s.as_ptr(), gf) };
            unsafe { g::ggml_backend_sched_synchronize(s.as_ptr()) };
            if super::profile::enabled() {
                super::profile::record_whole(gf, start.elapsed());
            }
            st
        } else {
            super::observe::compute(&self.backend, gf, self.n_threads)
        };
        failed_unless(status, &self.backend)?;
        let out = raw_outputs.into_iter().map(R::read).collect::<Result<Vec<R>>>()?;
        if self.max_vram > 0 && !self.backend.is_cpu() && self.sched.is_none() {
            let held = self.buffer_bytes + staged_now.as_ref().map_or(0, |s| s.bytes);
            self.peak_device_bytes = self.peak_device_bytes.max(held);
            super::cut::PEAK.fetch_max(held, std::sync::atomic::Ordering::Relaxed);
        }
        R::check(self, out)
    }

    /// Whether the runner's devices can read weights stored in `buffer` as they are.
    fn usable_here(&self, buffer: g::ggml_backend_buffer_t) -> bool {
        self.backend.can_use_buffer(buffer) || self.split.iter().any(|b| b.can_use_buffer(buffer))
    }

    /// A device that computes garbage tends to give NaN/Inf or one value everywhere (a
    /// black or white picture): report it instead of returning it. The CPU is trusted.
    fn checked(&self, out: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if self.backend.is_cpu() && self.split.is_empty() {
            return Ok(out);
        }
        for t in &out {
            let d = t.data();
            if let Some(i) = d.iter().position(|v| !v.is_finite()) {
                bail!(
                    "{} computed a non-finite value ({} at index {i} of {}): the device's result is wrong; try another device or --backend cpu",
                    self.backend.device_name(),
                    d[i],
                    d.len()
                );
            }
            if d.len() >= 256 && d.iter().all(|v| *v == d[0]) {
                bail!(
                    "{} computed the same value ({}) for all {} outputs: the device's result is wrong; try another device or --backend cpu",
                    self.backend.device_name(),
                    d[0],
                    d.len()
                );
            }
        }
        Ok(out)
    }

    fn run_allocated(&mut self, gf: *mut g::ggml_cgraph) -> Result<()> {
        self.free_sched();
        let galloc = self.allocator()?;
        // SAFETY: allocator and graph are valid.
        let ok = unsafe { g::ggml_gallocr_alloc_graph(galloc.as_ptr(), gf) };
        if !ok {
            // The cached buffer may be for another graph shape; drop it and retry once.
            self.free_allocator();
            let galloc = self.allocator()?;
            // SAFETY: as above.
            let ok = unsafe { g::ggml_gallocr_alloc_graph(galloc.as_ptr(), gf) };
            ensure!(ok, "could not allocate the compute buffer on {} (out of memory?)", self.backend.device_name());
        }
        if let Some(a) = self.galloc {
            // SAFETY: valid allocator; buffer 0 is the only one (one backend).
            let bytes = unsafe { g::ggml_gallocr_get_buffer_size(a.as_ptr(), 0) };
            if bytes != self.buffer_bytes {
                self.buffer_bytes = bytes;
                sd_debug!("compute buffer size: {:.2} MB ({})", bytes as f64 / (1024.0 * 1024.0), self.backend.device_name());
            }
        }
        Ok(())
    }

    /// Allocates `gf` through ggml's scheduler over the runner's devices and the CPU.
    fn run_scheduled(&mut self, gf: *mut g::ggml_cgraph) -> Result<()> {
        self.free_allocator();
        if self.sched.is_none() {
            if self.cpu.is_none() && !self.backend.is_cpu() {
                self.cpu = Some(Arc::new(Backend::cpu()?));
            }
            let mut backends: Vec<g::ggml_backend_t> = vec![self.backend.raw()];
            backends.extend(self.split.iter().map(|b| b.raw()));
            if let Some(c) = &self.cpu {
                backends.push(c.raw());
            }
            // SAFETY: valid backends; the CPU one uses the main device's pinned host memory
            // when it has such a buffer type.
            let bufts: Vec<g::ggml_backend_buffer_type_t> = unsafe {
                let main_dev = g::ggml_backend_get_device(self.backend.raw());
                backends
                    .iter()
                    .map(|&b| {
                        let host = if Some(b) == self.cpu.as_ref().map(|c| c.raw()) && !main_dev.is_null() {
                            g::ggml_backend_dev_host_buffer_type(main_dev)
                        } else {
                            std::ptr::null_mut()
                        };
                        if host.is_null() {
                            g::ggml_backend_get_default_buffer_type(b)
                        } else {
                            host
                        }
                    })
                    .collect()
            };
            // SAFETY: arrays of equal length; the last backend is the CPU as ggml requires.
            let s = unsafe {
                g::ggml_backend_sched_new(backends.as_ptr() as *mut _, bufts.as_ptr() as *mut _, backends.len() as i32, MAX_NODES, false, false)
            };
            self.sched = Some(NonNull::new(s).context("could not create the backend scheduler")?);
            let unsupported = unsupported_ops(&self.backend, gf);
            if !unsupported.is_empty() && !self.backend.is_cpu() {
                sd_info!("{}: ops it cannot run go to the CPU: {}", self.backend.device_name(), unsupported.join(", "));
            }
        }
        let s = self.sched.expect("scheduler");
        // SAFETY: valid scheduler and graph.
        unsafe { g::ggml_backend_sched_reset(s.as_ptr()) };
        if !self.split.is_empty() {
            self.pin_to_weight_devices(s, gf);
        }
        // SAFETY: as above.
        let ok = unsafe { g::ggml_backend_sched_alloc_graph(s.as_ptr(), gf) };
        ensure!(ok, "could not allocate the compute graph over {} and the CPU (out of memory?)", self.backend.device_name());
        Ok(())
    }

    /// Runs each op without weights on the device of the weights used last (layer split):
    /// the activations then cross devices once per block range. An in-place op writes into
    /// the memory of the tensor it modifies, so it runs where that tensor was computed; left
    /// to ggml's expansion it can land on the other device, which then cannot reach that
    /// memory (an RPC server drops such a graph and the output stays zero).
    fn pin_to_weight_devices(&self, s: NonNull<g::ggml_backend_sched>, gf: *mut g::ggml_cgraph) {
        let devices: Vec<&Arc<Backend>> = std::iter::once(&self.backend).chain(self.split.iter()).collect();
        let mut current = self.backend.raw();
        let mut placed: HashMap<*mut g::ggml_tensor, g::ggml_backend_t> = HashMap::new();
        // SAFETY: nodes of a valid graph; backends outlive the call.
        unsafe {
            for i in 0..g::ggml_graph_n_nodes(gf) {
                let node = g::ggml_graph_node(gf, i);
                for src in (*node).src {
                    let Some(b) = weight_buffer(src) else { continue };
                    if let Some(d) = devices.iter().find(|d| d.can_use_buffer(b) && !g::ggml_backend_buffer_is_host(b)) {
                        current = d.raw();
                    }
                }
                if matches!((*node).op, g::GGML_OP_NONE | g::GGML_OP_VIEW | g::GGML_OP_RESHAPE | g::GGML_OP_PERMUTE | g::GGML_OP_TRANSPOSE) {
                    // Views live where their source does: the scheduler places them itself.
                    continue;
                }
                let mut root = (*node).view_src;
                while !root.is_null() && !(*root).view_src.is_null() {
                    root = (*root).view_src;
                }
                let target = if root.is_null() {
                    current
                } else {
                    match placed.get(&root) {
                        Some(&b) => b,
                        None => continue,
                    }
                };
                if g::ggml_backend_supports_op(target, node) {
                    g::ggml_backend_sched_set_tensor_backend(s.as_ptr(), node, target);
                    placed.insert(node, target);
                }
            }
        }
    }

    fn allocator(&mut self) -> Result<NonNull<g::ggml_gallocr>> {
        if let Some(a) = self.galloc {
            return Ok(a);
        }
        // SAFETY: valid backend; the allocator is freed in Drop.
        let a = unsafe { g::ggml_gallocr_new(g::ggml_backend_get_default_buffer_type(self.backend.raw())) };
        let a = NonNull::new(a).context("could not create a graph allocator")?;
        self.galloc = Some(a);
        Ok(a)
    }

    fn free_allocator(&mut self) {
        if let Some(a) = self.galloc.take() {
            // SAFETY: we own the allocator.
            unsafe { g::ggml_gallocr_free(a.as_ptr()) };
        }
        self.buffer_bytes = 0;
    }

    fn free_sched(&mut self) {
        if let Some(s) = self.sched.take() {
            // SAFETY: we own the scheduler.
            unsafe { g::ggml_backend_sched_free(s.as_ptr()) };
        }
    }

    /// Frees the compute buffer and scheduler (kept between runs otherwise).
    pub(crate) fn release_compute_buffers(&mut self) {
        self.free_allocator();
        self.free_sched();
    }

    /// Releases the compute buffer (e.g. after the last sampling step) and any weights kept
    /// on the device for `stream_layers`.
    pub fn release(&mut self) {
        self.release_compute_buffers();
        self.resident = None;
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.release();
    }
}

/// The error of a graph computation that did not succeed.
pub(crate) fn failed_unless(status: g::ggml_status, backend: &Backend) -> Result<()> {
    if status == g::GGML_STATUS_ABORTED {
        bail!("the graph computation on {} was stopped by the backend evaluation callback (aborted)", backend.device_name());
    }
    ensure!(status == g::GGML_STATUS_SUCCESS, "graph computation failed on {} (status {status})", backend.device_name());
    Ok(())
}

/// The tensor whose storage `t` uses: its view source, or itself.
///
/// # Safety
/// `t` must be a live tensor.
pub(crate) unsafe fn view_base(t: *mut g::ggml_tensor) -> *mut g::ggml_tensor {
    // SAFETY: per the contract.
    unsafe { if (*t).view_src.is_null() { t } else { (*t).view_src } }
}

/// The buffer holding a tensor's data when that buffer holds weights.
pub(crate) fn weight_buffer(t: *mut g::ggml_tensor) -> Option<g::ggml_backend_buffer_t> {
    if t.is_null() {
        return None;
    }
    // SAFETY: live tensor of a graph or store.
    unsafe {
        let base = view_base(t);
        let b = (*base).buffer;
        (!b.is_null() && g::ggml_backend_buffer_get_usage(b) == g::GGML_BACKEND_BUFFER_USAGE_WEIGHTS).then_some(b)
    }
}

/// Every distinct weight tensor (not a view) the graph reads.
pub(crate) fn weight_leaves(gf: *mut g::ggml_cgraph) -> Vec<*mut g::ggml_tensor> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    // SAFETY: nodes of a valid graph.
    unsafe {
        for i in 0..g::ggml_graph_n_nodes(gf) {
            let node = g::ggml_graph_node(gf, i);
            for src in (*node).src {
                if weight_buffer(src).is_none() {
                    continue;
                }
                let base = view_base(src);
                if seen.insert(base) {
                    out.push(base);
                }
            }
        }
    }
    out
}

fn all_supported(backend: &Backend, gf: *mut g::ggml_cgraph) -> bool {
    // SAFETY: nodes of a valid graph.
    unsafe { (0..g::ggml_graph_n_nodes(gf)).all(|i| g::ggml_backend_supports_op(backend.raw(), g::ggml_graph_node(gf, i))) }
}

fn unsupported_ops(backend: &Backend, gf: *mut g::ggml_cgraph) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    // SAFETY: nodes of a valid graph; op descriptions are static strings.
    unsafe {
        for i in 0..g::ggml_graph_n_nodes(gf) {
            let node = g::ggml_graph_node(gf, i);
            if !g::ggml_backend_supports_op(backend.raw(), node) {
                let n = std::ffi::CStr::from_ptr(g::ggml_op_desc(node)).to_string_lossy().into_owned();
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
    }
    names
}

/// Writes the graph's inputs into the storage the allocator gave them.
pub(crate) fn upload_inputs(graph: &Graph) {
    for input in graph.inputs.borrow().iter() {
        // An input the graph never reads gets no memory; there is nothing to upload.
        // SAFETY: input.tensor belongs to the graph context.
        if unsafe { (*input.tensor).buffer.is_null() && (*input.tensor).data.is_null() } {
            continue;
        }
        // SAFETY: the allocator placed the input; sizes were checked on creation.
        unsafe { g::ggml_backend_tensor_set(input.tensor, input.bytes.as_ptr() as *const _, 0, input.bytes.len()) };
    }
}

/// How a graph's outputs are read back.
trait Readout: Sized {
    fn read(t: *mut g::ggml_tensor) -> Result<Self>;
    /// Outputs of a graph computed in segments (always read as f32).
    fn from_segments(out: Vec<Tensor>) -> Result<Vec<Self>>;
    fn check(runner: &Runner, out: Vec<Self>) -> Result<Vec<Self>>;
}

impl Readout for Tensor {
    fn read(t: *mut g::ggml_tensor) -> Result<Self> {
        read_f32(t)
    }
    fn from_segments(out: Vec<Tensor>) -> Result<Vec<Self>> {
        Ok(out)
    }
    fn check(runner: &Runner, out: Vec<Self>) -> Result<Vec<Self>> {
        runner.checked(out)
    }
}

/// Raw bytes in the output's own type.
impl Readout for Vec<u8> {
    fn read(t: *mut g::ggml_tensor) -> Result<Self> {
        read_bytes(t)
    }
    fn from_segments(_: Vec<Tensor>) -> Result<Vec<Self>> {
        bail!("raw graph outputs cannot be read from a graph computed in segments")
    }
    fn check(_: &Runner, out: Vec<Self>) -> Result<Vec<Self>> {
        Ok(out)
    }
}

/// Reads a computed tensor's bytes as they are.
fn read_bytes(t: *mut g::ggml_tensor) -> Result<Vec<u8>> {
    // SAFETY: t is a computed tensor of an allocated graph.
    let (nbytes, contiguous) = unsafe { (g::ggml_nbytes(t), g::ggml_is_contiguous(t)) };
    ensure!(contiguous, "graph output is not contiguous");
    let mut bytes = vec![0u8; nbytes];
    // SAFETY: bytes holds nbytes.
    unsafe { g::ggml_backend_tensor_get(t, bytes.as_mut_ptr() as *mut _, 0, nbytes) };
    Ok(bytes)
}

/// Reads a computed tensor as f32 (converting f16/bf16), always as 4 dims.
pub(crate) fn read_f32(t: *mut g::ggml_tensor) -> Result<Tensor> {
    // SAFETY: t is a computed tensor of an allocated graph.
    let (ty, ne, nbytes, contiguous) =
        unsafe { ((*t).type_, (*t).ne, g::ggml_nbytes(t), g::ggml_is_contiguous(t)) };
    ensure!(contiguous, "graph output is not contiguous");
    let n: i64 = ne.iter().product();
    let n = n as usize;
    let mut bytes = vec![0u8; nbytes];
    // SAFETY: bytes holds nbytes.
    unsafe { g::ggml_backend_tensor_get(t, bytes.as_mut_ptr() as *mut _, 0, nbytes) };
    let data: Vec<f32> = match ty {
        g::GGML_TYPE_F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        g::GGML_TYPE_F16 => {
            let mut out = vec![0f32; n];
            // SAFETY: bytes holds n f16 values.
            unsafe { g::ggml_fp16_to_fp32_row(bytes.as_ptr() as *const u16, out.as_mut_ptr(), n as i64) };
            out
        }
        g::GGML_TYPE_I32 => bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect(),
        other => bail!("cannot read a graph output of ggml type {other}"),
    };
    let shape: Vec<usize> = ne.iter().map(|&d| d as usize).collect();
    Tensor::from_vec(&shape, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::nn::{Conv2d, GroupNorm, Linear};
    use crate::graph::params::{ParamStore, Scope, TypeMap};
    use crate::graph::{take_peak_device_bytes, F32};
    use crate::testutil::pattern;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// `v` as the bytes of a weight of type `ty` (f32, else ggml's f16 conversion).
    fn weight_bytes(ty: crate::graph::GgmlType, v: &[f32]) -> Vec<u8> {
        if ty == F32 {
            return f32_bytes(v);
        }
        let mut h = vec![0u16; v.len()];
        // SAFETY: h holds v.len() values.
        unsafe { g::ggml_fp32_to_fp16_row(v.as_ptr(), h.as_mut_ptr(), v.len() as i64) };
        h.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn linear_conv_and_norm_compute_like_torch() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut store = ParamStore::new(16).unwrap();
        let mut types = TypeMap::new();
        types.insert("lin.weight".into(), F32);
        let (lin, conv, gn) = {
            let mut s = Scope::new(&mut store, &types, "");
            let lin = Linear::new(&mut s, "lin", 3, 2, true);
            let conv = Conv2d::square(&mut s, "conv", 1, 1, 3, 1, 1);
            let gn = GroupNorm::new(&mut s, "gn", 1, 2, true);
            (lin, conv, gn)
        };
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                match name {
                    // rows of W: [1,2,3], [4,5,6]
                    "lin.weight" => dst.copy_from_slice(&f32_bytes(&[1., 2., 3., 4., 5., 6.])),
                    "lin.bias" => dst.copy_from_slice(&f32_bytes(&[0.5, -0.5])),
                    "conv.weight" => {
                        // f16 ones
                        let one = 0x3C00u16.to_le_bytes();
                        for c in dst.chunks_exact_mut(2) {
                            c.copy_from_slice(&one);
                        }
                        assert_eq!(n, 9);
                    }
                    "conv.bias" => dst.copy_from_slice(&f32_bytes(&[1.0])),
                    "gn.weight" => dst.copy_from_slice(&f32_bytes(&[1.0, 2.0])),
                    "gn.bias" => dst.copy_from_slice(&f32_bytes(&[0.0, 1.0])),
                    other => panic!("unexpected {other}"),
                }
                Ok(())
            })
            .unwrap();

        let mut runner = Runner::new(backend, 2);
        let y = runner
            .compute(|g| {
                let x = g.input_f32(&[1.0, 1.0, 1.0, 2.0, 0.0, 1.0], &[3, 2]);
                Ok(lin.forward(g, x))
            })
            .unwrap();
        assert_eq!(y.shape(), &[2, 2, 1, 1]);
        assert_eq!(y.data(), &[6.5, 14.5, 5.5, 13.5]);

        // 3x3 box filter with zero padding on a 3x3 image of ones, plus bias 1.
        let y = runner
            .compute(|g| {
                let x = g.input_f32(&[1.0; 9], &[3, 3, 1, 1]);
                Ok(conv.forward(g, x))
            })
            .unwrap();
        assert_eq!(y.data(), &[5., 7., 5., 7., 10., 7., 5., 7., 5.]);

        // Group norm with one group over two channels.
        let y = runner
            .compute(|g| {
                let x = g.input_f32(&[0.0, 2.0, 0.0, 2.0], &[2, 1, 2, 1]);
                Ok(gn.forward(g, x))
            })
            .unwrap();
        let d = y.data();
        assert!((d[0] + 1.0).abs() < 1e-3 && (d[1] - 1.0).abs() < 1e-3, "{d:?}");
        assert!((d[2] + 1.0).abs() < 1e-3 && (d[3] - 3.0).abs() < 1e-3, "{d:?}");
    }

    /// A graph using weights that were never read (a network read at its first use, run
    /// outside its phase) is refused with an error instead of computing with garbage.
    #[test]
    fn unread_weights_are_refused() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut store = ParamStore::new(4).unwrap();
        let types = TypeMap::new();
        let lin = Linear::new(&mut Scope::new(&mut store, &types, ""), "lin", 3, 2, true);
        let mut runner = Runner::new(backend.clone(), 1);
        let run = |runner: &mut Runner| runner.compute(|g| Ok(lin.forward(g, g.input_f32(&[1.0; 3], &[3, 1]))));
        let err = run(&mut runner).expect_err("computed with unread weights");
        assert!(err.to_string().contains("2 weights of this graph were not read yet"), "{err:#}");
        store.alloc(&backend).unwrap();
        store.load(|_, _, dst| Ok(dst.fill(0))).unwrap();
        assert_eq!(run(&mut runner).unwrap().data(), &[0.0, 0.0]);
    }

    /// Scores computed a few query rows at a time, and convolutions whose im2col matrix is
    /// built piecewise, give exactly the numbers of the one-piece graphs.
    #[test]
    fn split_attention_and_direct_conv_are_bit_identical() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let (c, l_q, l_k, heads) = (16i64, 37i64, 29i64, 2i64);
        let q = pattern((c * l_q) as usize, 1);
        let k = pattern((c * l_k) as usize, 2);
        let v = pattern((c * l_k) as usize, 3);
        let attend = |limit: usize| {
            let mut runner = Runner::new(backend.clone(), 2);
            runner.options.cpu_scores_limit = limit;
            runner
                .compute(|g| {
                    let q = g.input_f32(&q, &[c, l_q, 1]);
                    let k = g.input_f32(&k, &[c, l_k, 1]);
                    let v = g.input_f32(&v, &[c, l_k, 1]);
                    Ok(crate::graph::nn::attention(g, q, k, v, heads, None, false, false, 1.0))
                })
                .unwrap()
        };
        let whole = attend(usize::MAX);
        // 5 rows of scores per chunk: 8 chunks, the last one shorter.
        let split = attend((5 * l_k * heads * 4) as usize);
        assert_eq!(whole.shape(), split.shape());
        assert!(whole.data().iter().zip(split.data()).all(|(a, b)| a.to_bits() == b.to_bits()));

        let mut store = ParamStore::new(4).unwrap();
        let types = TypeMap::new();
        let conv = {
            let mut s = Scope::new(&mut store, &types, "");
            Conv2d::new(&mut s, "conv", 6, 5, (3, 3), (2, 1), (1, 1), true)
        };
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let vals = pattern(n, if name.ends_with("bias") { 4 } else { 5 });
                dst.copy_from_slice(&weight_bytes(spec.ty, &vals));
                Ok(())
            })
            .unwrap();
        let x = pattern(11 * 9 * 6 * 2, 6);
        let convolve = |limit: usize, fast: bool, threads: i32| {
            let mut runner = Runner::new(backend.clone(), threads);
            runner.options.cpu_im2col_limit = limit;
            runner.options.cpu_fast_im2col = fast;
            runner.compute(|g| Ok(conv.forward(g, g.input_f32(&x, &[11, 9, 6, 2])))).unwrap()
        };
        let same = |a: &Tensor, b: &Tensor| a.shape() == b.shape() && a.data().iter().zip(b.data()).all(|(x, y)| x.to_bits() == y.to_bits());
        let ggml_im2col = convolve(usize::MAX, false, 2);
        assert!(same(&ggml_im2col, &convolve(0, false, 2)), "direct convolution");
        // Our im2col feeds our matrix kernels, which sum like ggml's AVX2 build: against ggml's
        // own product only where ggml is that build, else against our first result.
        let ours = convolve(usize::MAX, true, 2);
        let base = if crate::graph::backend::cpu_variant().as_deref() == Some("haswell") { &ggml_im2col } else { &ours };
        assert!(same(base, &ours), "our im2col");
        assert!(same(base, &convolve(usize::MAX, true, 3)), "our im2col, 3 threads");
        // In bands of output rows: 1 row (limit 0), and 2 + 2 + 1 rows (K = 54, OW = 11, N = 2).
        assert!(same(base, &convolve(0, true, 2)), "bands of 1 row");
        assert!(same(base, &convolve(2 * 11 * 2 * 54 * 2, true, 3)), "bands of 2 rows");
    }

    /// The 3-D convolution (the Wan VAE's) is ggml's `ggml_conv_3d`: the same ops with ggml's
    /// products, the same bits with ours in bands of output rows or whole, and (on the
    /// `haswell` variant, whose sums ours reproduce) ggml's bits with ours. Strided and padded.
    #[test]
    fn conv_3d_matches_ggml_whole_and_in_bands() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let (ic, oc) = (4i64, 3i64);
        let w = weight_bytes(crate::graph::F16, &pattern(3 * 3 * 2 * ic as usize * oc as usize, 5));
        let x = pattern(9 * 7 * 3 * ic as usize, 6);
        let haswell = crate::graph::backend::cpu_variant().as_deref() == Some("haswell");
        let bits = |t: &Tensor| (t.shape().to_vec(), t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        for (stride, padding) in [([1, 1, 1], [0, 0, 0]), ([2, 2, 1], [0, 0, 0]), ([1, 2, 2], [1, 1, 0])] {
            let convolve = |limit: usize, own_matmul: bool, ours: bool| {
                let mut runner = Runner::new(backend.clone(), 2);
                runner.options.cpu_im2col_limit = limit;
                runner.options.cpu_own_matmul = own_matmul;
                let out = runner
                    .compute(|g| {
                        let wt = g.input_bytes(crate::graph::F16, &[3, 3, 2, ic * oc], w.clone());
                        let xt = g.input_f32(&x, &[9, 7, 3, ic]);
                        Ok(if ours { crate::graph::nn::conv_3d(g, xt, wt, None, ic, stride, padding, [1; 3]) } else { wt.conv_3d(xt, ic, stride, padding, [1; 3]) })
                    })
                    .unwrap();
                bits(&out)
            };
            let ggml = convolve(usize::MAX, false, false);
            assert!(convolve(usize::MAX, false, true) == ggml, "ggml's products, stride {stride:?}");
            let ours = convolve(usize::MAX, true, true);
            assert!(convolve(0, true, true) == ours, "bands of 1 row, stride {stride:?}");
            assert!(convolve(2 * 72 * 4 * 2 * 2, true, true) == ours, "bands of 2 rows, stride {stride:?}");
            assert!(!haswell || ours == ggml, "our products, stride {stride:?}");
        }
    }

    /// Our im2col op against ggml's on dilated, strided, padded and 1×1 kernels, on images
    /// narrower and wider than one block of output pixels.
    #[test]
    fn our_im2col_matches_ggml_bit_for_bit() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let kernels = [(3, 3, (1, 1), (1, 1), (1, 1)), (3, 2, (2, 3), (2, 0), (2, 1)), (1, 1, (1, 1), (0, 0), (1, 1)), (4, 4, (2, 2), (3, 1), (1, 2))];
        for ((kw, kh, st, pad, dil), (w, h)) in kernels.into_iter().flat_map(|k| [(k, (13, 10)), (k, (41, 7))]) {
            let x = pattern(w as usize * h as usize * 3 * 2, 9);
            let run = |fast: bool| {
                let mut runner = Runner::new(backend.clone(), 2);
                runner.options.cpu_fast_im2col = fast;
                runner
                    .compute(|g| {
                        let xt = g.input_f32(&x, &[w, h, 3, 2]);
                        let shape = g.new_tensor(F32, &[kw, kh, 3, 1]);
                        Ok(match crate::graph::im2col::im2col_f16(g, shape.ne(), xt, st, pad, dil, None).filter(|_| fast) {
                            Some(t) => t,
                            None => shape.im2col(xt, st.0, st.1, pad.0, pad.1, dil.0, dil.1, true, crate::graph::F16),
                        })
                    })
                    .unwrap()
            };
            let (ours, theirs) = (run(true), run(false));
            assert_eq!(ours.shape(), theirs.shape(), "kernel {kw}x{kh} on {w}x{h}");
            assert!(ours.data().iter().zip(theirs.data()).all(|(a, b)| a.to_bits() == b.to_bits()), "kernel {kw}x{kh} {st:?} {pad:?} {dil:?} on {w}x{h}");
        }
    }

    /// A chain of layers with cut points and a long skip connection, run whole and in
    /// segments under a small budget: the same numbers, and the segments stay under it.
    #[test]
    fn segments_under_a_budget_compute_the_same_numbers() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut store = ParamStore::new(64).unwrap();
        let types = TypeMap::new();
        let layers: Vec<Linear> = {
            let mut s = Scope::new(&mut store, &types, "");
            (0..6).map(|i| Linear::new(&mut s, &format!("l{i}"), 64, 64, true)).collect()
        };
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let v: Vec<f32> = pattern(n, name.len() as u32 + name.as_bytes()[1] as u32).iter().map(|x| x * 0.1).collect();
                dst.copy_from_slice(&weight_bytes(spec.ty, &v));
                Ok(())
            })
            .unwrap();
        let x = pattern(64 * 5, 7);
        let run = |budget: usize| {
            let mut r = Runner::new(backend.clone(), 2);
            r.max_vram = budget;
            r.segment_on_cpu = true;
            let out = r
                .compute(|g| {
                    let mut h = g.input_f32(&x, &[64, 5]);
                    let mut first = None;
                    for (i, l) in layers.iter().enumerate() {
                        h = g.mark_cut(l.forward(g, h).gelu(), &format!("layer.{i}"));
                        first.get_or_insert(h);
                    }
                    Ok(h.add(first.unwrap()))
                })
                .unwrap();
            (out, r.cut_plan.take().map_or(0, |(_, ranges)| ranges.len()))
        };
        let (whole, _) = run(0);
        take_peak_device_bytes();
        let budget = 40 * 1024;
        let (split, segments) = run(budget);
        let peak = take_peak_device_bytes();
        assert!(segments > 2, "{segments} segments");
        assert!(peak > 0 && peak <= budget, "peak {peak} over budget {budget}");
        assert_eq!(whole.shape(), split.shape());
        assert!(whole.data().iter().zip(split.data()).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// Weights moved to another buffer for a while compute the same and are bound back.
    #[test]
    fn staged_weights_compute_the_same_and_return_home() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut store = ParamStore::new(4).unwrap();
        let types = TypeMap::new();
        let lin = {
            let mut s = Scope::new(&mut store, &types, "");
            Linear::new(&mut s, "lin", 8, 4, true)
        };
        store.alloc(&backend).unwrap();
        store.load(|_, spec, dst| {
            let n = spec.ne.iter().product::<i64>() as usize;
            let v = pattern(n, 3);
            dst.copy_from_slice(&weight_bytes(spec.ty, &v));
            Ok(())
        })
        .unwrap();
        let x = pattern(16, 9);
        let mut r = Runner::new(backend.clone(), 2);
        let before = r.compute(|g| Ok(lin.forward(g, g.input_f32(&x, &[8, 2])))).unwrap();
        let w = store.entries().next().unwrap().1;
        let home = unsafe { (*w.raw()).data };
        let tensors: Vec<*mut g::ggml_tensor> = store.entries().map(|(_, w)| w.raw()).collect();
        let staged = Staged::new(&backend, &tensors).unwrap();
        assert_ne!(unsafe { (*w.raw()).data }, home);
        let during = r.compute(|g| Ok(lin.forward(g, g.input_f32(&x, &[8, 2])))).unwrap();
        drop(staged);
        assert_eq!(unsafe { (*w.raw()).data }, home);
        assert_eq!(before.data(), during.data());
    }
}
