//! Weight declarations: every model declares its tensors (name, type, shape) once in a
//! `ParamStore`; loading, LoRA and conversion all work from that declaration.

use super::backend::Backend;
use super::context::{Ctx, GgmlType, W};
use super::devices::{Placement, WeightHome};
use crate::error::{Context as _, Result};
use ggml_sys as g;
use std::collections::HashMap;
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

/// Bytes that already hold some weights (a memory-mapped model file), shared with the store
/// so they outlive every tensor placed in them.
pub type HostRegion = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// What a declared tensor looks like (for loaders).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub ty: GgmlType,
    pub ne: Vec<i64>,
    pub nbytes: usize,
}

impl TensorSpec {
    /// The shape padded to 4 dimensions with 1s, as model files report it.
    pub fn ne4(&self) -> [i64; 4] {
        let mut ne = [1i64; 4];
        ne[..self.ne.len()].copy_from_slice(&self.ne);
        ne
    }
}

/// Tensor types found in the model files (after wtype / tensor_type_rules), by name.
pub type TypeMap = HashMap<String, GgmlType>;

/// ComfyUI `int8_tensorwise` weights by full name: the group size of their ConvRot rotation
/// (0: none).
pub type Int8Groups = HashMap<String, u32>;

/// Where a declared tensor's data lives.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Home {
    /// The store's buffer.
    Buffer,
    /// A borrowed region (a mapped model file), read-only: `data` inside `wrapper`.
    Mapped { data: *mut std::ffi::c_void, wrapper: NonNull<g::ggml_backend_buffer> },
    /// Was mapped; now holds modified bytes in a buffer of its own (freed on restore).
    Own { own: NonNull<g::ggml_backend_buffer>, data: *mut std::ffi::c_void, wrapper: NonNull<g::ggml_backend_buffer> },
}

pub struct ParamStore {
    ctx: Ctx,
    capacity: usize,
    entries: Vec<(String, W)>,
    index: HashMap<String, usize>,
    /// Entry index by handle, so a weight's full name is known (ggml truncates its own).
    by_handle: HashMap<W, usize>,
    buffer: Option<NonNull<g::ggml_backend_buffer>>,
    allocated: bool,
    /// Per entry: where its data lives.
    homes: Vec<Home>,
    /// Buffers wrapping borrowed regions (they do not own the memory) and the regions.
    borrowed: Vec<NonNull<g::ggml_backend_buffer>>,
    regions: Vec<HostRegion>,
    /// The regions are read-only file mappings (`regions_are_file_mappings`): when the
    /// weights are freed, their pages leave the process (the file stays mapped for the
    /// context's life, so a network read per phase kept every page it touched resident).
    file_regions: bool,
    /// Further buffers of a layer split (tensors spread over several devices).
    split_buffers: Vec<NonNull<g::ggml_backend_buffer>>,
    /// A copy of the weights on the compute device for the current phase.
    staged: Option<Staged>,
}

// SAFETY: the store exclusively owns its context and buffer.
unsafe impl Send for ParamStore {}

impl ParamStore {
    /// A store for up to `capacity` tensors.
    pub fn new(capacity: usize) -> Result<ParamStore> {
        Ok(ParamStore {
            ctx: Ctx::metadata(capacity)?,
            capacity,
            entries: Vec::new(),
            index: HashMap::new(),
            by_handle: HashMap::new(),
            buffer: None,
            allocated: false,
            homes: Vec::new(),
            borrowed: Vec::new(),
            regions: Vec::new(),
            file_regions: false,
            split_buffers: Vec::new(),
            staged: None,
        })
    }

    /// Whether the weights have storage (false before `alloc` and after `release`).
    pub fn is_allocated(&self) -> bool {
        self.allocated
    }

    /// Allocates the tensors on several devices (a layer split): contiguous ranges in
    /// declaration order (the network's block order) sized in proportion to `shares`.
    /// Placed and host-region tensors are not supported here.
    pub fn alloc_split(&mut self, backends: &[std::sync::Arc<Backend>], shares: &[f64]) -> Result<()> {
        ensure!(!self.allocated && self.borrowed.is_empty(), "weights allocated twice");
        ensure!(!backends.is_empty() && backends.len() == shares.len(), "layer split needs one share per device");
        let total: usize = self.nbytes();
        let share_sum: f64 = shares.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let mut groups: Vec<Vec<*mut g::ggml_tensor>> = vec![Vec::new(); backends.len()];
        let (mut done, mut dev) = (0usize, 0usize);
        let mut limit = (total as f64 * shares[0] / share_sum) as usize;
        for (_, w) in &self.entries {
            while dev + 1 < backends.len() && done >= limit {
                dev += 1;
                limit += (total as f64 * shares[dev] / share_sum) as usize;
            }
            groups[dev].push(w.raw());
            done += Self::spec(*w).nbytes;
        }
        for (b, group) in backends.iter().zip(&groups) {
            if group.is_empty() {
                continue;
            }
            let bytes: usize = group.iter().map(|&t| unsafe { g::ggml_nbytes(t) }).sum();
            sd_info!("layer split: {} tensors ({:.1} MB) on {}", group.len(), bytes as f64 / (1024.0 * 1024.0), b.device_name());
            let bufs = alloc_in_buffers(b, group)?;
            self.split_buffers.extend(bufs);
        }
        self.allocated = true;
        Ok(())
    }

    /// Copies every weight the compute backend cannot read where it lives onto it, for a
    /// phase (`params_backend=cpu`). [`unstage`](Self::unstage) frees the copy.
    pub fn stage_on(&mut self, compute: &Backend) -> Result<()> {
        ensure!(self.allocated, "weights staged before allocation");
        if self.staged.is_some() {
            return Ok(());
        }
        let tensors: Vec<*mut g::ggml_tensor> =
            self.entries.iter().map(|(_, w)| w.raw()).filter(|&t| unsafe { !(*t).buffer.is_null() && !compute.can_use_buffer((*t).buffer) }).collect();
        if tensors.is_empty() {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let staged = Staged::new(compute, &tensors)?;
        sd_debug!(
            "uploaded {} weights ({:.1} MB) to {} in {:.2}s",
            tensors.len(),
            staged.bytes as f64 / (1024.0 * 1024.0),
            compute.device_name(),
            start.elapsed().as_secs_f32()
        );
        self.staged = Some(staged);
        Ok(())
    }

    /// Makes the weights usable on `placement`'s compute device for a phase (a sampling
    /// run, a decode): `params_backend=disk` reads them (`reload` allocates and fills the
    /// store on the backend it is given), a separate weights backend (`params_backend=cpu`)
    /// copies them to the device, unless a `max_vram` budget uploads them per segment.
    pub fn begin_phase(&mut self, placement: &Placement, reload: impl FnOnce(&mut ParamStore, &Backend) -> Result<()>) -> Result<()> {
        match &placement.weights {
            WeightHome::Compute => Ok(()),
            WeightHome::Disk | WeightHome::FirstUse => {
                if !self.allocated {
                    reload(self, &placement.compute)?;
                }
                Ok(())
            }
            WeightHome::Backend(_) if placement.max_vram > 0 => Ok(()),
            WeightHome::Backend(_) => self.stage_on(&placement.compute),
        }
    }

    /// Ends a phase begun with [`begin_phase`](Self::begin_phase): frees the device copy,
    /// or (disk) the weights themselves.
    pub fn end_phase(&mut self, placement: &Placement) {
        self.unstage();
        if matches!(placement.weights, WeightHome::Disk) {
            self.release();
        }
    }

    /// Frees the phase copy made by [`stage_on`](Self::stage_on).
    pub fn unstage(&mut self) {
        self.staged = None;
    }

    /// Frees every weight's storage (`params_backend=disk` after a phase); `alloc` and a
    /// load make them usable again.
    pub fn release(&mut self) {
        self.staged = None;
        self.free_buffers();
        for (_, w) in &self.entries {
            // SAFETY: the tensor's storage was just freed; clear the dangling binding.
            unsafe {
                (*w.raw()).buffer = std::ptr::null_mut();
                (*w.raw()).data = std::ptr::null_mut();
            }
        }
        self.homes.iter_mut().for_each(|h| *h = Home::Buffer);
        self.allocated = false;
    }

    fn free_buffers(&mut self) {
        self.staged = None;
        for b in self.buffer.take().into_iter().chain(self.split_buffers.drain(..)) {
            // SAFETY: we own the buffer; the context's tensors point into it and are unbound or die with it.
            unsafe { g::ggml_backend_buffer_free(b.as_ptr()) };
        }
        for h in &mut self.homes {
            if let Home::Own { own, data, wrapper } = *h {
                // SAFETY: a buffer we allocated for one tensor, unbound with the others.
                unsafe { g::ggml_backend_buffer_free(own.as_ptr()) };
                *h = Home::Mapped { data, wrapper };
            }
        }
        for b in self.borrowed.drain(..) {
            // SAFETY: wrapper buffers we created; freeing one leaves the region untouched.
            unsafe { g::ggml_backend_buffer_free(b.as_ptr()) };
        }
        if self.file_regions {
            self.drop_mapped_pages();
        }
        // Only now may the regions go away.
        self.regions.clear();
    }

    /// Declares a tensor. Declaring a name twice is a bug in the model code.
    pub fn declare(&mut self, name: &str, ty: GgmlType, ne: &[i64]) -> W {
        assert!(!self.index.contains_key(name), "parameter {name} declared twice");
        assert!(self.entries.len() < self.capacity, "parameter store full");
        assert!(!self.allocated && self.borrowed.is_empty(), "parameter {name} declared after allocation");
        assert!(!ne.is_empty() && ne.len() <= 4 && ne.iter().all(|&d| d > 0), "bad shape {ne:?} for {name}");
        // SAFETY: metadata-only context with room for the tensor (checked above).
        let p = unsafe { g::ggml_new_tensor(self.ctx.raw(), ty, ne.len() as i32, ne.as_ptr()) };
        let w = W(NonNull::new(p).expect("ggml_new_tensor failed"));
        if let Ok(c) = CString::new(name) {
            // SAFETY: ggml copies (and truncates) the name; our index keeps the full one.
            unsafe { g::ggml_set_name(p, c.as_ptr()) };
        }
        super::profile::name_weight(p, name);
        self.index.insert(name.to_string(), self.entries.len());
        self.by_handle.insert(w, self.entries.len());
        self.entries.push((name.to_string(), w));
        self.homes.push(Home::Buffer);
        w
    }

    pub fn get(&self, name: &str) -> Option<W> {
        self.index.get(name).map(|&i| self.entries[i].1)
    }

    /// The full name `w` was declared with, if it is one of this store's tensors.
    pub fn name_of(&self, w: W) -> Option<&str> {
        self.by_handle.get(&w).map(|&i| self.entries[i].0.as_str())
    }

    /// Whether `w` was placed in a mapped file (and can get those bytes back by
    /// [`restore_mapped`](Self::restore_mapped)).
    pub fn has_mapping(&self, w: W) -> bool {
        self.by_handle.get(&w).is_some_and(|&i| self.homes[i] != Home::Buffer)
    }

    /// Whether `w` is computed in place from a mapped file (unmodified).
    pub fn is_mapped(&self, w: W) -> bool {
        self.by_handle.get(&w).is_some_and(|&i| matches!(self.homes[i], Home::Mapped { .. }))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// How many tensors the store can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Declared tensors in declaration order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, W)> {
        self.entries.iter().map(|(n, w)| (n.as_str(), *w))
    }

    pub fn spec(w: W) -> TensorSpec {
        // SAFETY: w belongs to a live store.
        let nbytes = unsafe { g::ggml_nbytes(w.raw()) };
        let ne = w.ne();
        // SAFETY: as above.
        let dims = unsafe { g::ggml_n_dims(w.raw()) } as usize;
        TensorSpec { ty: w.ty(), ne: ne[..dims.max(1)].to_vec(), nbytes }
    }

    /// Total bytes of all declared tensors.
    pub fn nbytes(&self) -> usize {
        self.entries.iter().map(|(_, w)| Self::spec(*w).nbytes).sum()
    }

    /// Before [`alloc`](Self::alloc), on the CPU: lets tensors use bytes that already hold
    /// them exactly (a mapped model file, no type conversion) instead of a copy, like the
    /// reference does with mmap. `find` gives the region and the tensor's offset in it; a
    /// tensor it declines, or that does not fit, is allocated and filled as usual.
    /// Returns how many tensors were placed.
    pub fn place_in_host_regions(
        &mut self,
        backend: &Backend,
        find: impl Fn(&str, &TensorSpec) -> Option<(HostRegion, usize)>,
    ) -> Result<usize> {
        ensure!(!self.allocated, "weights placed after allocation");
        if !backend.is_cpu() {
            return Ok(0);
        }
        // SAFETY: valid backend.
        let dev = unsafe { g::ggml_backend_get_device(backend.raw()) };
        if dev.is_null() {
            return Ok(0);
        }
        let mut buffers: HashMap<usize, NonNull<g::ggml_backend_buffer>> = HashMap::new();
        let mut placed = 0;
        for (i, (name, w)) in self.entries.iter().enumerate() {
            let spec = Self::spec(*w);
            let Some((region, offset)) = find(name, &spec) else { continue };
            let bytes: &[u8] = (*region).as_ref();
            if offset.checked_add(spec.nbytes).is_none_or(|end| end > bytes.len()) {
                continue;
            }
            let base = bytes.as_ptr() as usize;
            // ggml wraps only 32-byte aligned memory (a mapping starts on a page).
            if base % 32 != 0 {
                continue;
            }
            let buf = match buffers.get(&base) {
                Some(b) => *b,
                None => {
                    // SAFETY: the region stays alive (kept in `regions`) as long as the buffer,
                    // which never frees or writes the memory it wraps.
                    let b = unsafe {
                        g::ggml_backend_dev_buffer_from_host_ptr(dev, bytes.as_ptr() as *mut _, bytes.len(), bytes.len())
                    };
                    let Some(b) = NonNull::new(b) else { continue };
                    // SAFETY: valid buffer.
                    unsafe { g::ggml_backend_buffer_set_usage(b.as_ptr(), g::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
                    self.borrowed.push(b);
                    self.regions.push(region.clone());
                    buffers.insert(base, b);
                    b
                }
            };
            // SAFETY: an unallocated tensor of the store's context; [offset, offset + nbytes)
            // lies inside the buffer (checked above), as ggml requires.
            let data = unsafe { bytes.as_ptr().add(offset) as *mut std::ffi::c_void };
            // SAFETY: as above.
            let status = unsafe { g::ggml_backend_tensor_alloc(buf.as_ptr(), w.raw(), data) };
            if status == g::GGML_STATUS_SUCCESS {
                self.homes[i] = Home::Mapped { data, wrapper: buf };
                placed += 1;
            }
        }
        Ok(placed)
    }

    /// Whether some weights are computed in place from a mapped model file (placing them
    /// again costs no read).
    pub fn maps_files(&self) -> bool {
        self.file_regions && !self.regions.is_empty()
    }

    /// Marks the regions of [`place_in_host_regions`](Self::place_in_host_regions) as
    /// read-only mappings of files: their pages may be dropped from the process when the
    /// weights are freed (they are read again from the file, or the page cache, if touched).
    pub fn regions_are_file_mappings(&mut self) {
        self.file_regions = true;
    }

    /// `MADV_DONTNEED` over the pages of every tensor placed in a region: a per-phase text
    /// encoder's pages (LTX-2.3's Gemma 3 and connectors, GBs) no longer count in the resident
    /// set while the transformer samples. Only for file mappings: on anonymous memory the
    /// call would discard the data.
    fn drop_mapped_pages(&self) {
        #[cfg(unix)]
        {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
            for (i, h) in self.homes.iter().enumerate() {
                let data = match *h {
                    Home::Mapped { data, .. } | Home::Own { data, .. } => data as usize,
                    Home::Buffer => continue,
                };
                let len = Self::spec(self.entries[i].1).nbytes;
                let (start, end) = (data & !(page - 1), (data + len).div_ceil(page) * page);
                // SAFETY: the range lies in a live read-only file mapping (the region is still
                // held; a mapping covers whole pages). Nothing is written there, so dropping
                // the pages loses nothing: a later read faults them in from the file again.
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
            }
        }
    }

    /// Allocates one backend buffer holding every declared tensor (but those placed in
    /// host regions).
    pub fn alloc(&mut self, backend: &Backend) -> Result<()> {
        if self.allocated || self.entries.is_empty() {
            return Ok(());
        }
        if self.homes.iter().all(|h| *h != Home::Buffer) {
            self.allocated = true;
            return Ok(());
        }
        // SAFETY: context and backend are valid; returns null on failure.
        let buf = unsafe { g::ggml_backend_alloc_ctx_tensors(self.ctx.raw(), backend.raw()) };
        let buf = NonNull::new(buf).with_context(|| {
            format!("could not allocate {:.1} MB for model weights on {}", self.nbytes() as f64 / 1e6, backend.name())
        })?;
        // SAFETY: valid buffer.
        unsafe { g::ggml_backend_buffer_set_usage(buf.as_ptr(), g::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) };
        self.buffer = Some(buf);
        self.allocated = true;
        Ok(())
    }

    /// Declared tensors that still need their bytes written (not placed in a host region).
    fn to_fill(&self) -> impl Iterator<Item = &(String, W)> {
        self.entries.iter().zip(&self.homes).filter(|(_, h)| **h == Home::Buffer).map(|(e, _)| e)
    }

    /// Fills every tensor: `fill(name, spec, dst)` writes exactly `spec.nbytes` bytes.
    /// Host buffers are filled in place; device buffers through a staging copy.
    pub fn load(&mut self, mut fill: impl FnMut(&str, &TensorSpec, &mut [u8]) -> Result<()>) -> Result<()> {
        ensure!(self.allocated, "parameters loaded before allocation");
        let mut staging = Vec::new();
        for (name, w) in self.to_fill() {
            let spec = Self::spec(*w);
            // Per tensor: a layer split spreads the store over buffers of several devices.
            // SAFETY: an allocated tensor of this store.
            let buffer = unsafe { (*w.raw()).buffer };
            ensure!(!buffer.is_null(), "tensor '{name}' has no buffer");
            // SAFETY: valid buffer.
            if unsafe { g::ggml_backend_buffer_is_host(buffer) } {
                // SAFETY: the tensor's data lives in a host buffer of nbytes bytes, exclusively ours.
                let dst = unsafe { std::slice::from_raw_parts_mut((*w.raw()).data as *mut u8, spec.nbytes) };
                fill(name, &spec, dst)?;
            } else {
                staging.resize(spec.nbytes, 0);
                fill(name, &spec, &mut staging)?;
                // SAFETY: staging holds nbytes bytes for this tensor.
                unsafe { g::ggml_backend_tensor_set(w.raw(), staging.as_ptr() as *const _, 0, spec.nbytes) };
            }
        }
        Ok(())
    }

    /// [`load`](Self::load) with up to `threads` workers filling host tensors at once:
    /// reading, converting and quantizing weights (e.g. `wtype = q8_0`) is CPU-bound.
    /// Device buffers are filled one by one through a staging copy.
    pub fn load_parallel(&mut self, threads: usize, fill: impl Fn(&str, &TensorSpec, &mut [u8]) -> Result<()> + Sync) -> Result<()> {
        self.load_parallel_pieces(threads, usize::MAX, |_, _| false, |name, spec, _, dst| fill(name, spec, dst))
    }

    /// [`load_parallel`](Self::load_parallel) where a host tensor larger than `piece` bytes
    /// that `split` accepts is filled in pieces of at most `piece` bytes, each by whichever
    /// worker is free: `fill(name, spec, offset, dst)` writes bytes `offset..offset +
    /// dst.len()` of the tensor (every tensor not split in one call, offset 0). A single very
    /// large tensor (UMT5's 256k-token embedding table, 2 GB in f16) is otherwise read by one
    /// worker while the others have finished.
    pub fn load_parallel_pieces(
        &mut self,
        threads: usize,
        piece: usize,
        split: impl Fn(&str, &TensorSpec) -> bool,
        fill: impl Fn(&str, &TensorSpec, usize, &mut [u8]) -> Result<()> + Sync,
    ) -> Result<()> {
        ensure!(self.allocated, "parameters loaded before allocation");
        // SAFETY: valid buffer.
        let host = self.buffer.is_some_and(|b| unsafe { g::ggml_backend_buffer_is_host(b.as_ptr()) });
        // A layer split has no single buffer: its device buffers are filled one by one.
        if !host || !self.split_buffers.is_empty() || threads <= 1 {
            return self.load(|name, spec, dst| fill(name, spec, 0, dst));
        }
        /// A tensor's bytes in the host buffer: disjoint from every other tensor's.
        struct Dst(*mut u8, usize);
        // SAFETY: each Dst is handed to exactly one worker (by the shared counter).
        unsafe impl Sync for Dst {}
        let piece = piece.max(1);
        let mut jobs: Vec<(&str, TensorSpec, usize, Dst)> = Vec::new();
        for (name, w) in self.to_fill() {
            let spec = Self::spec(*w);
            // SAFETY: allocated host tensor.
            let data = unsafe { (*w.raw()).data as *mut u8 };
            let n = spec.nbytes;
            let step = if n > piece && split(name, &spec) { piece } else { n.max(1) };
            for offset in (0..n.max(1)).step_by(step) {
                let len = step.min(n - offset);
                // SAFETY: offset + len <= n, inside the tensor's data.
                jobs.push((name.as_str(), spec.clone(), offset, Dst(unsafe { data.add(offset) }, len)));
            }
        }
        let threads = threads.clamp(1, jobs.len().max(1));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failed: parking_lot::Mutex<Option<(usize, crate::error::Error)>> = parking_lot::Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= jobs.len() || failed.lock().is_some() {
                        break;
                    }
                    let (name, spec, offset, dst) = &jobs[i];
                    // SAFETY: this worker alone took index i; the range is part of the tensor's data.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(dst.0, dst.1) };
                    if let Err(e) = fill(name, spec, *offset, bytes) {
                        let mut f = failed.lock();
                        if f.as_ref().is_none_or(|(j, _)| i < *j) {
                            *f = Some((i, e));
                        }
                    }
                });
            }
        });
        match failed.into_inner() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    fn entry_of(&self, w: W) -> Result<usize> {
        self.by_handle.get(&w).copied().context("tensor does not belong to this parameter store")
    }

    /// Writes one tensor's data. A tensor computed from a mapped file is read-only: call
    /// [`make_writable`](Self::make_writable) first.
    pub fn set_data(&self, w: W, bytes: &[u8]) -> Result<()> {
        let spec = Self::spec(w);
        ensure!(bytes.len() == spec.nbytes, "tensor data size mismatch: {} != {}", bytes.len(), spec.nbytes);
        ensure!(self.allocated, "parameters written before allocation");
        // During a phase the tensor is bound to a copy that is dropped at its end.
        ensure!(self.staged.is_none(), "parameters written while a phase copy of them is in use");
        let i = self.entry_of(w)?;
        ensure!(
            !matches!(self.homes[i], Home::Mapped { .. }),
            "tensor '{}' is a read-only mapping of the model file",
            self.entries[i].0
        );
        // SAFETY: allocated, writable tensor of exactly this size.
        unsafe { g::ggml_backend_tensor_set(w.raw(), bytes.as_ptr() as *const _, 0, bytes.len()) };
        Ok(())
    }

    /// Gives each of `ws` that is computed from a mapped file a buffer of its own on
    /// `backend` (contents undefined until written), so it can be modified without touching
    /// the file; returns those it moved. All or nothing: on failure no tensor changed.
    pub fn make_writable(&mut self, ws: &[W], backend: &Backend) -> Result<Vec<W>> {
        let mut done = Vec::new();
        for &w in ws {
            let i = self.entry_of(w)?;
            let Home::Mapped { data, wrapper } = self.homes[i] else { continue };
            match Self::own_buffer(w, backend) {
                Ok(own) => {
                    self.homes[i] = Home::Own { own, data, wrapper };
                    done.push(w);
                }
                Err(e) => {
                    for w in done {
                        self.restore_mapped(w);
                    }
                    return Err(crate::error::Error::new(format!("weight '{}': {e}", self.entries[i].0)));
                }
            }
        }
        Ok(done)
    }

    /// Allocates a buffer for `w` alone and moves the tensor into it.
    fn own_buffer(w: W, backend: &Backend) -> Result<NonNull<g::ggml_backend_buffer>> {
        // SAFETY: valid backend and tensor; the buffer type reports the size it needs.
        let (buft, size) = unsafe {
            let buft = g::ggml_backend_get_default_buffer_type(backend.raw());
            (buft, g::ggml_backend_buft_get_alloc_size(buft, w.raw()))
        };
        // SAFETY: valid buffer type; returns null on failure.
        let buf = NonNull::new(unsafe { g::ggml_backend_buft_alloc_buffer(buft, size) })
            .with_context(|| format!("could not allocate {size} bytes on {}", backend.name()))?;
        // SAFETY: the tensor is not part of any graph being computed; detaching it from its
        // borrowed region and allocating it at the start of the new buffer (large enough,
        // checked by ggml) only changes its data pointer.
        unsafe {
            g::ggml_backend_buffer_set_usage(buf.as_ptr(), g::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            (*w.raw()).buffer = std::ptr::null_mut();
            (*w.raw()).data = std::ptr::null_mut();
            let status = g::ggml_backend_tensor_alloc(buf.as_ptr(), w.raw(), g::ggml_backend_buffer_get_base(buf.as_ptr()));
            if status != g::GGML_STATUS_SUCCESS {
                g::ggml_backend_buffer_free(buf.as_ptr());
                bail!("could not place a weight in its own buffer (status {status})");
            }
        }
        Ok(buf)
    }

    /// Puts a tensor made writable back onto its mapped file bytes (its original data),
    /// freeing its own buffer. True when `w` now holds the file's bytes this way (also when
    /// it never left them); false for tensors of the store's buffer, whose original bytes
    /// the caller must write back.
    pub fn restore_mapped(&mut self, w: W) -> bool {
        let Some(&i) = self.by_handle.get(&w) else { return false };
        match self.homes[i] {
            Home::Buffer => false,
            Home::Mapped { .. } => true,
            Home::Own { own, data, wrapper } => {
                // SAFETY: the tensor is not in use by a graph; it goes back to the region it
                // was placed in (kept alive by the store), then its own buffer is freed.
                unsafe {
                    (*w.raw()).buffer = wrapper.as_ptr();
                    (*w.raw()).data = data;
                    g::ggml_backend_buffer_free(own.as_ptr());
                }
                self.homes[i] = Home::Mapped { data, wrapper };
                true
            }
        }
    }

    /// Reads one tensor's raw bytes.
    pub fn get_data(&self, w: W) -> Result<Vec<u8>> {
        let spec = Self::spec(w);
        ensure!(self.allocated, "parameters read before allocation");
        let mut out = vec![0u8; spec.nbytes];
        // SAFETY: allocated tensor of exactly this size.
        unsafe { g::ggml_backend_tensor_get(w.raw(), out.as_mut_ptr() as *mut _, 0, out.len()) };
        Ok(out)
    }
}

impl Drop for ParamStore {
    fn drop(&mut self) {
        super::profile::forget_weights(self.entries.iter().map(|(_, w)| w.raw()));
        self.free_buffers();
    }
}

/// Allocates tensors that have no storage yet in new buffers of `backend`'s default type
/// (several when one would exceed the device's largest buffer), marked as weights.
pub(crate) fn alloc_in_buffers(backend: &Backend, tensors: &[*mut g::ggml_tensor]) -> Result<Vec<NonNull<g::ggml_backend_buffer>>> {
    // SAFETY: valid backend; buffer-type queries.
    let buft = unsafe { g::ggml_backend_get_default_buffer_type(backend.raw()) };
    let align = unsafe { g::ggml_backend_buft_get_alignment(buft) }.max(1);
    let max = unsafe { g::ggml_backend_buft_get_max_size(buft) }.max(1);
    let mut chunks: Vec<(Vec<(*mut g::ggml_tensor, usize)>, usize)> = vec![(Vec::new(), 0)];
    for &t in tensors {
        // SAFETY: t is a live tensor with no storage.
        let size = unsafe { g::ggml_backend_buft_get_alloc_size(buft, t) };
        let last = chunks.last_mut().expect("one chunk");
        let offset = last.1.div_ceil(align) * align;
        if !last.0.is_empty() && offset + size > max {
            chunks.push((vec![(t, 0)], size));
        } else {
            last.0.push((t, offset));
            last.1 = offset + size;
        }
    }
    let mut out: Vec<NonNull<g::ggml_backend_buffer>> = Vec::new();
    let free_all = |out: &mut Vec<NonNull<g::ggml_backend_buffer>>| {
        for b in out.drain(..) {
            // SAFETY: buffers created here.
            unsafe { g::ggml_backend_buffer_free(b.as_ptr()) };
        }
    };
    for (list, size) in chunks {
        if list.is_empty() {
            continue;
        }
        // SAFETY: valid buffer type; null is checked.
        let buf = unsafe { g::ggml_backend_buft_alloc_buffer(buft, size.max(1)) };
        let Some(buf) = NonNull::new(buf) else {
            free_all(&mut out);
            bail!("could not allocate {:.1} MB for weights on {} (out of memory?)", size as f64 / (1024.0 * 1024.0), backend.device_name());
        };
        out.push(buf);
        // SAFETY: valid buffer; each tensor gets a distinct aligned range inside it.
        unsafe {
            g::ggml_backend_buffer_set_usage(buf.as_ptr(), g::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            let base = g::ggml_backend_buffer_get_base(buf.as_ptr()) as *mut u8;
            for (t, offset) in list {
                let status = g::ggml_backend_tensor_alloc(buf.as_ptr(), t, base.add(offset) as *mut _);
                if status != g::GGML_STATUS_SUCCESS {
                    free_all(&mut out);
                    bail!("could not place a weight in its buffer on {}", backend.device_name());
                }
            }
        }
    }
    Ok(out)
}

/// Weights moved to another backend for a while: each tensor is rebound to a copy in new
/// buffers there, and bound back to its home storage (untouched meanwhile) on drop.
pub(crate) struct Staged {
    buffers: Vec<NonNull<g::ggml_backend_buffer>>,
    /// Each tensor and its home binding.
    saved: Vec<(*mut g::ggml_tensor, g::ggml_tensor)>,
    pub bytes: usize,
}

// SAFETY: the staged tensors belong to a store (or graph) owned by the same thread's owner.
unsafe impl Send for Staged {}

impl Staged {
    /// Copies `tensors` (weights with storage, no views) onto `backend`.
    pub fn new(backend: &Backend, tensors: &[*mut g::ggml_tensor]) -> Result<Staged> {
        // SAFETY: live tensors; their home binding is kept in `saved` and restored on drop.
        let saved: Vec<(*mut g::ggml_tensor, g::ggml_tensor)> = tensors.iter().map(|&t| (t, unsafe { *t })).collect();
        for &(t, _) in &saved {
            unsafe {
                (*t).buffer = std::ptr::null_mut();
                (*t).data = std::ptr::null_mut();
                (*t).extra = std::ptr::null_mut();
            }
        }
        let buffers = match alloc_in_buffers(backend, tensors) {
            Ok(b) => b,
            Err(e) => {
                drop(Staged { buffers: Vec::new(), saved, bytes: 0 });
                return Err(e);
            }
        };
        let mut staged = Staged { buffers, saved, bytes: 0 };
        let mut tmp = Vec::new();
        for (t, home) in &staged.saved {
            // SAFETY: `home` describes the untouched home storage of exactly this tensor's size;
            // `t` now has storage of the same size on `backend`.
            unsafe {
                let n = g::ggml_nbytes(*t);
                staged.bytes += n;
                let src = *home;
                if !home.buffer.is_null() && g::ggml_backend_buffer_is_host(home.buffer) {
                    g::ggml_backend_tensor_set(*t, home.data, 0, n);
                } else {
                    tmp.resize(n, 0u8);
                    g::ggml_backend_tensor_get(&src, tmp.as_mut_ptr() as *mut _, 0, n);
                    g::ggml_backend_tensor_set(*t, tmp.as_ptr() as *const _, 0, n);
                }
            }
        }
        Ok(staged)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for b in self.buffers.drain(..) {
            // SAFETY: buffers we allocated; the tensors are rebound below.
            unsafe { g::ggml_backend_buffer_free(b.as_ptr()) };
        }
        for (t, home) in &self.saved {
            // SAFETY: restores the binding saved in `new`.
            unsafe {
                (**t).buffer = home.buffer;
                (**t).data = home.data;
                (**t).extra = home.extra;
            }
        }
    }
}

/// Declares tensors under a name prefix, resolving types like the reference: the type the
/// file has (after wtype/rules) unless the layer forces one.
pub struct Scope<'s> {
    store: &'s mut ParamStore,
    types: &'s TypeMap,
    int8: Option<&'s Int8Groups>,
    prefix: String,
}

impl<'s> Scope<'s> {
    pub fn new(store: &'s mut ParamStore, types: &'s TypeMap, prefix: &str) -> Scope<'s> {
        Scope { store, types, int8: None, prefix: prefix.to_string() }
    }

    /// This scope knowing the files' `int8_tensorwise` weights.
    pub fn with_int8(self, int8: &'s Int8Groups) -> Scope<'s> {
        Scope { int8: Some(int8), ..self }
    }

    /// A nested scope `prefix + name + "."`.
    pub fn sub(&mut self, name: &str) -> Scope<'_> {
        let prefix = format!("{}{}.", self.prefix, name);
        Scope { store: self.store, types: self.types, int8: self.int8, prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn full_name(&self, leaf: &str) -> String {
        format!("{}{}", self.prefix, leaf)
    }

    /// The type of `leaf` in the model files, if present.
    pub fn file_type(&self, leaf: &str) -> Option<GgmlType> {
        self.types.get(&self.full_name(leaf)).copied()
    }

    /// Whether the files contain `leaf` under this scope.
    pub fn has(&self, leaf: &str) -> bool {
        self.types.contains_key(&self.full_name(leaf))
    }

    pub fn tensor(&mut self, leaf: &str, ty: GgmlType, ne: &[i64]) -> W {
        let name = self.full_name(leaf);
        self.store.declare(&name, ty, ne)
    }

    /// For an `int8_tensorwise` weight `leaf` (I8 `[in, out]`), its row scales
    /// (`<leaf>_scale`, `out` values) and ConvRot group; None for any other weight.
    pub fn int8_scale(&mut self, leaf: &str, out: i64) -> Option<(W, u32)> {
        let group = *self.int8?.get(&self.full_name(leaf))?;
        Some((self.tensor(&format!("{leaf}_scale"), super::context::F32, &[out]), group))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::context::F32;

    fn store(n: usize) -> (ParamStore, Backend) {
        let backend = Backend::cpu().unwrap();
        let mut s = ParamStore::new(n).unwrap();
        for i in 0..n {
            s.declare(&format!("t{i}"), F32, &[3 + i as i64]);
        }
        s.alloc(&backend).unwrap();
        (s, backend)
    }

    #[test]
    fn parallel_load_fills_every_tensor_like_the_serial_one() {
        let fill = |name: &str, spec: &TensorSpec, dst: &mut [u8]| -> Result<()> {
            let i: f32 = name[1..].parse().unwrap();
            for (k, v) in dst.chunks_exact_mut(4).enumerate() {
                v.copy_from_slice(&(i * 100.0 + k as f32).to_le_bytes());
            }
            assert_eq!(dst.len(), spec.nbytes);
            Ok(())
        };
        let (mut a, _ba) = store(37);
        let (mut b, _bb) = store(37);
        a.load(fill).unwrap();
        b.load_parallel(4, fill).unwrap();
        for i in 0..37 {
            let name = format!("t{i}");
            assert_eq!(a.get_data(a.get(&name).unwrap()).unwrap(), b.get_data(b.get(&name).unwrap()).unwrap(), "{name}");
        }
    }

    #[test]
    fn a_large_tensor_is_filled_in_pieces_like_the_serial_load() {
        let value = |name: &str, offset: usize, dst: &mut [u8]| {
            let i: f32 = name[1..].parse().unwrap();
            for (k, v) in dst.chunks_exact_mut(4).enumerate() {
                v.copy_from_slice(&(i * 100.0 + (offset / 4 + k) as f32).to_le_bytes());
            }
        };
        let (mut a, _ba) = store(6);
        let (mut b, _bb) = store(6);
        a.load(|name, _, dst| {
            value(name, 0, dst);
            Ok(())
        })
        .unwrap();
        let calls = parking_lot::Mutex::new(Vec::new());
        // t4: 7 floats = 28 bytes in pieces of 12; t5 (32 bytes) is not accepted, t0 (12)
        // fits in one piece.
        b.load_parallel_pieces(3, 12, |name, _| name == "t4" || name == "t0", |name, spec, offset, dst| {
            assert!(offset + dst.len() <= spec.nbytes);
            calls.lock().push((name.to_string(), offset, dst.len()));
            value(name, offset, dst);
            Ok(())
        })
        .unwrap();
        for i in 0..6 {
            let name = format!("t{i}");
            assert_eq!(a.get_data(a.get(&name).unwrap()).unwrap(), b.get_data(b.get(&name).unwrap()).unwrap(), "{name}");
        }
        let mut calls = calls.into_inner();
        calls.sort();
        let t4: Vec<_> = calls.iter().filter(|c| c.0 == "t4").map(|c| (c.1, c.2)).collect();
        assert_eq!(t4, [(0, 12), (12, 12), (24, 4)]);
        assert_eq!(calls.iter().filter(|c| c.0 != "t4").map(|c| (c.1, c.2)).collect::<Vec<_>>(), [(0, 12), (0, 16), (0, 20), (0, 24), (0, 32)]);
    }

    /// A layer split has no single buffer: every tensor of every device's range is filled
    /// (the devices' weights once stayed all zero).
    #[test]
    fn a_layer_split_store_is_filled_on_every_device() {
        let fill = |name: &str, _: &TensorSpec, dst: &mut [u8]| -> Result<()> {
            let i: f32 = name[1..].parse().unwrap();
            dst.chunks_exact_mut(4).for_each(|v| v.copy_from_slice(&(i + 1.0).to_le_bytes()));
            Ok(())
        };
        let devices = [Arc::new(Backend::cpu().unwrap()), Arc::new(Backend::cpu().unwrap())];
        let mut s = ParamStore::new(9).unwrap();
        for i in 0..9 {
            s.declare(&format!("t{i}"), F32, &[4]);
        }
        s.alloc_split(&devices, &[1.0, 2.0]).unwrap();
        s.load_parallel(3, fill).unwrap();
        for i in 0..9 {
            let bytes = s.get_data(s.get(&format!("t{i}")).unwrap()).unwrap();
            assert_eq!(bytes, vec![(i as f32 + 1.0).to_le_bytes(); 4].concat(), "t{i}");
        }
    }

    #[test]
    fn parallel_load_reports_the_first_failing_tensor() {
        let (mut s, _b) = store(20);
        let err = s
            .load_parallel(3, |name, _, _| match name {
                "t5" | "t11" => Err(crate::error::Error::new(format!("{name} is broken"))),
                _ => Ok(()),
            })
            .unwrap_err();
        assert!(err.to_string().contains("t5 is broken"), "{err}");
    }

    #[test]
    fn tensors_placed_in_a_host_region_are_read_from_it_and_never_copied_or_written() {
        let backend = Backend::cpu().unwrap();
        let mut s = ParamStore::new(3).unwrap();
        for (name, n) in [("a", 4), ("b", 2), ("c", 3)] {
            s.declare(name, F32, &[n]);
        }
        // "a" at byte offset 12 (not aligned: mapped tensors need not be), "c" past the end.
        let vals: Vec<u8> = [1.5f32, -2.0, 3.25, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let region: HostRegion = Arc::new(crate::testutil::MappedBytes::new(128, 12, &vals));
        let placed = s
            .place_in_host_regions(&backend, |name, _| match name {
                "a" => Some((region.clone(), 12)),
                "c" => Some((region.clone(), 120)),
                _ => None,
            })
            .unwrap();
        assert_eq!(placed, 1);
        s.alloc(&backend).unwrap();
        let mut filled = Vec::new();
        // Both fill paths skip the placed tensor (writing it would change `vals`).
        s.load_parallel(2, |_, _, dst| {
            dst.fill(7);
            Ok(())
        })
        .unwrap();
        s.load(|name, _, dst| {
            filled.push(name.to_string());
            dst.fill(7);
            Ok(())
        })
        .unwrap();
        assert_eq!(filled, ["b", "c"]);
        let a = s.get("a").unwrap();
        assert_eq!(s.get_data(a).unwrap(), vals);
        assert_eq!(s.get_data(s.get("b").unwrap()).unwrap(), vec![7u8; 8]);
        assert!(s.set_data(a, &[0u8; 16]).is_err());
        drop(region);
        // The store still holds the region.
        assert_eq!(s.get_data(a).unwrap(), vals);
    }
}
