//! ggml contexts and tensor handles.
//!
//! A `Graph` owns a metadata-only ggml context in which a computation is described; `T<'g>`
//! is a copyable handle to a tensor of that graph. Weights live in a `ParamStore` and enter
//! a graph through `Graph::param`. Building never touches tensor data, so every operation
//! here is safe as long as the shapes are valid — shape errors are programming errors of
//! the model code and ggml reports them by aborting, so model code checks user-controlled
//! shapes (image sizes, token counts) before building.

use crate::error::{Context as _, Result};
use crate::tensor::Tensor;
use ggml_sys as g;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

pub type GgmlType = g::ggml_type;
pub const F32: GgmlType = g::GGML_TYPE_F32;
pub const F16: GgmlType = g::GGML_TYPE_F16;
pub const I8: GgmlType = g::GGML_TYPE_I8;
pub const I32: GgmlType = g::GGML_TYPE_I32;

/// Whether `ty` stores blocks of elements (q8_0, q4_K, …) rather than single values.
pub fn is_block_quantized(ty: GgmlType) -> bool {
    // SAFETY: pure lookup.
    unsafe { g::ggml_blck_size(ty) > 1 }
}

/// An owned ggml context.
pub struct Ctx {
    raw: NonNull<g::ggml_context>,
}

// SAFETY: a context is only mutated through the owner.
unsafe impl Send for Ctx {}

impl Ctx {
    /// A context that holds tensor metadata only (`no_alloc`), for `n_tensors` tensors.
    pub fn metadata(n_tensors: usize) -> Result<Ctx> {
        Self::with_size(n_tensors * unsafe_overhead() + 1024, true)
    }

    pub fn with_size(mem_size: usize, no_alloc: bool) -> Result<Ctx> {
        let params = g::ggml_init_params { mem_size, mem_buffer: std::ptr::null_mut(), no_alloc };
        // SAFETY: ggml_init copies the params; returns null on allocation failure.
        let raw = unsafe { g::ggml_init(params) };
        Ok(Ctx { raw: NonNull::new(raw).context("ggml_init failed (out of memory?)")? })
    }

    pub fn raw(&self) -> *mut g::ggml_context {
        self.raw.as_ptr()
    }
}

/// Room an op's data takes in the graph's context (ggml's object header included): one
/// such record per node is budgeted in every graph's context.
pub(crate) const OP_DATA_ROOM: usize = 64;

/// Moves `v` into the context's own memory, where it lives as long as the context's nodes
/// (custom ops point their user data at it); None when the context has no room left (a
/// type larger than a node's room does not compile). `v` is never dropped, so it must not
/// own anything.
pub(crate) fn store_in_ctx<V>(ctx: *mut g::ggml_context, v: V) -> Option<*mut V> {
    // A type too large for the room a node keeps would be refused at run time, and its op
    // would quietly fall back to ggml's: make that a compile error instead.
    const { assert!(std::mem::size_of::<V>() + 32 <= OP_DATA_ROOM && std::mem::align_of::<V>() <= 16) };
    let size = std::mem::size_of::<V>();
    if std::mem::needs_drop::<V>() {
        return None;
    }
    // SAFETY: a live context; the buffer is new, aligned to 16 by ggml and `size` long, and
    // initialised before anyone reads it.
    unsafe {
        if g::ggml_get_mem_size(ctx).saturating_sub(g::ggml_used_mem(ctx)) < OP_DATA_ROOM {
            return None;
        }
        let d = g::ggml_new_buffer(ctx, size) as *mut V;
        d.write(v);
        Some(d)
    }
}

fn unsafe_overhead() -> usize {
    // SAFETY: pure function.
    unsafe { g::ggml_tensor_overhead() }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: we own the context.
        unsafe { g::ggml_free(self.raw.as_ptr()) };
    }
}

/// Data to upload into a graph input once the graph's buffer is allocated.
pub(crate) struct PendingInput {
    pub tensor: *mut g::ggml_tensor,
    pub bytes: Vec<u8>,
}

/// Options a graph is built with (set per model / context).
#[derive(Clone, Copy, Debug)]
pub struct GraphOptions {
    /// Whether attention may use ggml_flash_attn_ext.
    pub flash_attn: bool,
    /// Whether convolutions use ggml_conv_2d_direct instead of im2col.
    pub conv_direct: bool,
    pub circular_x: bool,
    pub circular_y: bool,
    /// On the CPU, bytes above which a convolution's im2col matrix is built in bands.
    pub cpu_im2col_limit: usize,
    /// On the CPU, bytes of attention scores materialised at once.
    pub cpu_scores_limit: usize,
    /// On the CPU, build im2col matrices with our op (`graph::im2col`) instead of ggml's.
    pub cpu_fast_im2col: bool,
    /// On the CPU, matrix products by our kernels (`graph::matmul`: ggml's AVX2 values on
    /// every CPU, faster) instead of ggml's `mul_mat`.
    pub cpu_own_matmul: bool,
    /// On the CPU, 3×3 convolutions by Winograd's F(2×2, 3×3) (`graph::winograd`): float
    /// rounding differs from ggml's, so only where nothing amplifies it (decoders and
    /// upscalers, see `winograd_wanted`).
    pub cpu_winograd: bool,
    /// The context's opt-in fast path (`runtime::args::fast_path`): the UNet takes Winograd
    /// too, the diffusion networks (transformers and UNets) `cpu_fast_products` and
    /// `cpu_fast_q8_0`, the LLM text encoders `cpu_fast_products`.
    pub fast: bool,
    /// Float products by the fast path's kernels (`gemm::fast`: sums in their own order).
    pub cpu_fast_products: bool,
    /// q8_0 products by the fast path's tiles (`gemm::amx_q8`) too, with `cpu_fast_products`.
    pub cpu_fast_q8_0: bool,
}

/// Whether a network takes Winograd's convolutions (`GraphOptions::cpu_winograd`). By
/// default only decoders and upscalers do, of float contexts: not networks whose output is
/// sampled further (UNet, encoders), as SDXL's sampling amplifies the rounding past the
/// golden tolerance (its img2img case moved by max 8 with a Winograd VAE encoder), and not
/// contexts with quantized weights, whose pictures are the reference's bit for bit. On the
/// `fast` path the UNet takes it too, in every context (encoders stay off,
/// `encoder_winograd`). `SD_CPU_WINOGRAD=0` switches it off (fast path included), `=all` on
/// for decoders of quantized contexts too.
pub fn winograd_wanted(quantized_context: bool, fast: bool) -> bool {
    match std::env::var("SD_CPU_WINOGRAD").as_deref().map(str::trim) {
        Ok("0" | "off") => false,
        Ok("all") => true,
        _ => fast || !quantized_context,
    }
}

impl Default for GraphOptions {
    /// Our CPU graph changes (memory bounds, our im2col op) as configured, unless
    /// `SD_CPU_MEMORY_BOUNDS` says otherwise: `off` builds the reference's graphs (nothing
    /// split, ggml's im2col), `tight` splits everything as finely as possible (bands of one
    /// output row, one query row of scores at a time). None changes a number with ggml's
    /// reference kernels; tests/parity_kernels.rs holds them to that. `SD_CPU_OWN_MATMUL=0`
    /// (or `off`) computes matrix products with ggml's `mul_mat` instead of `graph::matmul`.
    fn default() -> Self {
        let (im2col_limit, scores_limit, fast_im2col) = match std::env::var("SD_CPU_MEMORY_BOUNDS").as_deref().map(str::trim) {
            Ok("off") => (usize::MAX, usize::MAX, false),
            Ok("tight") => (0, 0, true),
            _ => (super::nn::CPU_IM2COL_LIMIT, super::nn::CPU_SCORES_LIMIT, true),
        };
        GraphOptions {
            flash_attn: false,
            conv_direct: false,
            circular_x: false,
            circular_y: false,
            cpu_im2col_limit: im2col_limit,
            cpu_scores_limit: scores_limit,
            cpu_fast_im2col: fast_im2col,
            cpu_own_matmul: !matches!(std::env::var("SD_CPU_OWN_MATMUL").as_deref().map(str::trim), Ok("0" | "off")),
            cpu_winograd: false,
            fast: false,
            cpu_fast_products: false,
            cpu_fast_q8_0: false,
        }
    }
}

impl GraphOptions {
    /// Sets Winograd for an encoder's graphs and returns the setting to restore after them:
    /// off, as an encoder's latent is sampled further (see `winograd_wanted`); on the fast path
    /// too, where it moved Flux img2img's picture further from the exact one than the
    /// reference's fastest build moves it, for a one-off convolution.
    pub fn encoder_winograd(&mut self) -> bool {
        let was = self.cpu_winograd;
        self.cpu_winograd = false;
        was
    }
}

/// A computation being described.
pub struct Graph {
    ctx: Ctx,
    pub(crate) inputs: RefCell<Vec<PendingInput>>,
    pub options: GraphOptions,
    /// Whether the graph runs on the CPU backend, where large intermediates are split up to
    /// bound the compute buffer (see `nn::conv_2d` and `nn::attention`).
    pub on_cpu: bool,
    /// The backend the graph will run on (null while unknown), to ask what it supports.
    pub(crate) backend: g::ggml_backend_t,
    /// Changes the layers' weights or outputs at run time (e.g. LoRAs `at_runtime`).
    pub(crate) adapter: Option<Arc<dyn super::adapter::WeightAdapter>>,
    /// How many nodes the graph may hold.
    pub(crate) max_nodes: usize,
    /// Weights used while they had no storage (read at first use or per phase, outside the
    /// phase): the runner refuses to compute such a graph (ggml would take them for
    /// intermediates and compute with garbage).
    pub(crate) unread_weights: std::cell::Cell<usize>,
}

/// Upper bound of nodes in one graph (the UNet at 1024² needs a few thousand).
pub const MAX_NODES: usize = 32768;

impl Graph {
    pub fn new() -> Result<Graph> {
        Self::with_nodes(MAX_NODES)
    }

    /// A graph with room for `max_nodes` nodes.
    pub fn with_nodes(max_nodes: usize) -> Result<Graph> {
        // SAFETY: pure functions.
        let size = max_nodes * (unsafe_overhead() + OP_DATA_ROOM) + unsafe { g::ggml_graph_overhead_custom(max_nodes, false) };
        Ok(Graph {
            ctx: Ctx::with_size(size, true)?,
            inputs: RefCell::new(Vec::new()),
            options: GraphOptions::default(),
            on_cpu: false,
            backend: std::ptr::null_mut(),
            adapter: None,
            max_nodes,
            unread_weights: std::cell::Cell::new(0),
        })
    }

    /// Whether the target backend can compute `t` (true when the backend is not known).
    pub fn supports(&self, t: T<'_>) -> bool {
        // SAFETY: backend, when set, outlives the graph (the runner owns both).
        self.backend.is_null() || unsafe { g::ggml_backend_supports_op(self.backend, t.raw()) }
    }

    pub fn ctx(&self) -> *mut g::ggml_context {
        self.ctx.raw()
    }

    fn wrap(&self, p: *mut g::ggml_tensor) -> T<'_> {
        T { ptr: NonNull::new(p).expect("ggml returned a null tensor"), graph: PhantomData, ctx: self.ctx.raw() }
    }

    /// A new uninitialised tensor (e.g. the shape operand of `repeat`).
    pub fn new_tensor(&self, ty: GgmlType, ne: &[i64]) -> T<'_> {
        assert!(!ne.is_empty() && ne.len() <= 4);
        // SAFETY: valid context; ne has 1..=4 entries.
        self.wrap(unsafe { g::ggml_new_tensor(self.ctx(), ty, ne.len() as i32, ne.as_ptr()) })
    }

    /// An input whose data is uploaded before the graph runs.
    pub fn input_bytes(&self, ty: GgmlType, ne: &[i64], bytes: Vec<u8>) -> T<'_> {
        let t = self.new_tensor(ty, ne);
        assert_eq!(t.nbytes(), bytes.len(), "input byte size mismatch");
        // SAFETY: valid tensor of this graph.
        unsafe { g::ggml_set_input(t.raw()) };
        self.inputs.borrow_mut().push(PendingInput { tensor: t.raw(), bytes });
        t
    }

    /// A host f32 tensor as a graph input (same shape, ggml order).
    pub fn input(&self, t: &Tensor) -> T<'_> {
        let ne: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let bytes = t.data().iter().flat_map(|v| v.to_le_bytes()).collect();
        self.input_bytes(F32, &ne, bytes)
    }

    pub fn input_f32(&self, data: &[f32], ne: &[i64]) -> T<'_> {
        self.input_bytes(F32, ne, data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    pub fn input_i32(&self, data: &[i32], ne: &[i64]) -> T<'_> {
        self.input_bytes(I32, ne, data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    /// A weight from a parameter store, usable in this graph.
    pub fn param(&self, w: W) -> T<'_> {
        // SAFETY: the tensor is alive while its store is.
        if unsafe { (*w.raw()).data.is_null() && (*w.raw()).buffer.is_null() } {
            self.unread_weights.set(self.unread_weights.get() + 1);
        }
        self.wrap(w.0.as_ptr())
    }

    pub fn opt_param(&self, w: Option<W>) -> Option<T<'_>> {
        w.map(|w| self.param(w))
    }
}

/// A weight tensor declared in a `ParamStore`; valid while the store lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct W(pub(crate) NonNull<g::ggml_tensor>);

// SAFETY: W is an identifier of a tensor owned by a ParamStore; it is only dereferenced
// by ggml while building or running graphs on the thread that owns the store.
unsafe impl Send for W {}
unsafe impl Sync for W {}

impl W {
    pub fn raw(self) -> *mut g::ggml_tensor {
        self.0.as_ptr()
    }

    pub fn ne(self) -> [i64; 4] {
        // SAFETY: the tensor is alive while its store is.
        unsafe { (*self.raw()).ne }
    }

    pub fn ty(self) -> GgmlType {
        // SAFETY: as above.
        unsafe { (*self.raw()).type_ }
    }
}

/// A tensor of a graph being built.
#[derive(Clone, Copy)]
pub struct T<'g> {
    ptr: NonNull<g::ggml_tensor>,
    ctx: *mut g::ggml_context,
    graph: PhantomData<&'g Graph>,
}

impl<'g> T<'g> {
    pub fn raw(self) -> *mut g::ggml_tensor {
        self.ptr.as_ptr()
    }

    pub(crate) fn ctx(self) -> *mut g::ggml_context {
        self.ctx
    }

    /// Wraps a tensor produced by a ggml call on this tensor's context.
    pub(crate) fn wrap(self, p: *mut g::ggml_tensor) -> T<'g> {
        T { ptr: NonNull::new(p).expect("ggml returned a null tensor"), ctx: self.ctx, graph: PhantomData }
    }

    pub fn ne(self) -> [i64; 4] {
        // SAFETY: the tensor lives as long as its graph ('g).
        unsafe { (*self.raw()).ne }
    }

    pub fn nb(self) -> [usize; 4] {
        // SAFETY: as above.
        unsafe { (*self.raw()).nb }
    }

    pub fn ty(self) -> GgmlType {
        // SAFETY: as above.
        unsafe { (*self.raw()).type_ }
    }

    pub fn nbytes(self) -> usize {
        // SAFETY: as above.
        unsafe { g::ggml_nbytes(self.raw()) }
    }

    pub fn n_dims(self) -> i32 {
        // SAFETY: as above.
        unsafe { g::ggml_n_dims(self.raw()) }
    }

    pub fn is_contiguous(self) -> bool {
        // SAFETY: as above.
        unsafe { g::ggml_is_contiguous(self.raw()) }
    }

    pub fn nelements(self) -> i64 {
        self.ne().iter().product()
    }

    pub fn set_name(self, name: &str) -> T<'g> {
        if let Ok(c) = std::ffi::CString::new(name) {
            // SAFETY: ggml copies (and truncates) the name.
            unsafe { g::ggml_set_name(self.raw(), c.as_ptr()) };
        }
        self
    }
}
