//! Weight declarations: every model declares its tensors (name, type, shape) once in a
//! `ParamStore`; loading, LoRA and conversion all work from that declaration.

use super::backend::Backend;
use super::context::{Ctx, GgmlType, W};
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
        })
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
        let Some(buf) = self.buffer else { return Ok(()) };
        // SAFETY: valid buffer.
        let host = unsafe { g::ggml_backend_buffer_is_host(buf.as_ptr()) };
        let mut staging = Vec::new();
        for (name, w) in self.to_fill() {
            let spec = Self::spec(*w);
            if host {
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
        ensure!(self.allocated, "parameters loaded before allocation");
        let Some(buf) = self.buffer else { return Ok(()) };
        // SAFETY: valid buffer.
        let host = unsafe { g::ggml_backend_buffer_is_host(buf.as_ptr()) };
        let threads = threads.clamp(1, self.entries.len().max(1));
        if !host || threads == 1 {
            return self.load(|name, spec, dst| fill(name, spec, dst));
        }
        /// A tensor's bytes in the host buffer: disjoint from every other tensor's.
        struct Dst(*mut u8, usize);
        // SAFETY: each Dst is handed to exactly one worker (by the shared counter).
        unsafe impl Sync for Dst {}
        let jobs: Vec<(&str, TensorSpec, Dst)> = self
            .to_fill()
            .map(|(name, w)| {
                let spec = Self::spec(*w);
                // SAFETY: allocated host tensor.
                let data = unsafe { (*w.raw()).data as *mut u8 };
                let n = spec.nbytes;
                (name.as_str(), spec, Dst(data, n))
            })
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failed: parking_lot::Mutex<Option<(usize, crate::error::Error)>> = parking_lot::Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= jobs.len() || failed.lock().is_some() {
                        break;
                    }
                    let (name, spec, dst) = &jobs[i];
                    // SAFETY: this worker alone took index i; the range is the tensor's data.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(dst.0, dst.1) };
                    if let Err(e) = fill(name, spec, bytes) {
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
        if let Some(b) = self.buffer.take() {
            // SAFETY: we own the buffer; the context's tensors point into it and die with it.
            unsafe { g::ggml_backend_buffer_free(b.as_ptr()) };
        }
        for h in &self.homes {
            if let Home::Own { own, .. } = h {
                // SAFETY: a buffer we allocated for one tensor, which dies with the store.
                unsafe { g::ggml_backend_buffer_free(own.as_ptr()) };
            }
        }
        for b in self.borrowed.drain(..) {
            // SAFETY: wrapper buffers we created; freeing one leaves the region untouched.
            unsafe { g::ggml_backend_buffer_free(b.as_ptr()) };
        }
        // Only now may the regions (dropped with the store) go away.
        self.regions.clear();
    }
}

/// Declares tensors under a name prefix, resolving types like the reference: the type the
/// file has (after wtype/rules) unless the layer forces one.
pub struct Scope<'s> {
    store: &'s mut ParamStore,
    types: &'s TypeMap,
    prefix: String,
}

impl<'s> Scope<'s> {
    pub fn new(store: &'s mut ParamStore, types: &'s TypeMap, prefix: &str) -> Scope<'s> {
        Scope { store, types, prefix: prefix.to_string() }
    }

    /// A nested scope `prefix + name + "."`.
    pub fn sub(&mut self, name: &str) -> Scope<'_> {
        let prefix = format!("{}{}.", self.prefix, name);
        Scope { store: self.store, types: self.types, prefix }
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
