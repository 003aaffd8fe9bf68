//! LoRAs `immediately`: merged into the weights, reversibly. Each updated weight becomes
//! original + updates (one LoRA after another, in the weight's own type, quantized types
//! through f32 like the reference). Nothing is written until every new weight is computed
//! (a [`Staged`] set), so a LoRA that fails leaves the model as it was; weights no longer
//! updated get their original bytes back — re-read from the model files, or, for weights
//! computed in place from a mapped file (never written: a patched one gets a buffer of its
//! own), by pointing them at the file again.

use super::delta::merged_weight;
use super::{Lora, Patch};
use crate::error::Result;
use crate::graph::params::TensorSpec;
use crate::graph::{Backend, ParamStore, Runner, W};
use std::collections::HashSet;
use std::sync::Arc;

/// Weight bytes merged in one graph: bounds the compute buffer (f32 updates are twice an
/// f16 weight).
const BATCH_BYTES: usize = 32 << 20;

/// Reads a weight's original bytes (as loaded) from the model files: `(name, spec, dst)`.
pub type ReadOriginal<'a> = &'a (dyn Fn(&str, &TensorSpec, &mut [u8]) -> Result<()> + Sync);

/// What one merge did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MergeReport {
    /// Weights now holding updates.
    pub patched: usize,
    /// Weights given back their original bytes.
    pub restored: usize,
    /// Bytes written into weights.
    pub written: usize,
}

/// The LoRA state of one model store in `immediately` mode: which weights hold updates.
#[derive(Debug, Default)]
pub struct Merged {
    patched: Vec<W>,
}

/// The new bytes of one store's weights, computed but not written yet.
pub struct Staged {
    targets: Vec<W>,
    writes: Vec<(W, Vec<u8>)>,
    /// Weights to point at their mapped file bytes again.
    remap: Vec<W>,
    /// Weights [`reserve`](Staged::reserve) gave a buffer of their own.
    moved: Vec<W>,
}

impl Merged {
    pub fn is_empty(&self) -> bool {
        self.patched.is_empty()
    }

    /// Weights now holding updates.
    pub fn patched(&self) -> &[W] {
        &self.patched
    }

    /// Computes the weights of `store` as their originals plus the updates of `loras` (in
    /// order; none: all originals), on `backend`. Changes nothing.
    pub fn stage(&self, store: &ParamStore, backend: &Arc<Backend>, n_threads: i32, loras: &[Lora], original: ReadOriginal) -> Result<Staged> {
        let mut targets: Vec<W> = Vec::new();
        let mut seen = HashSet::new();
        for w in loras.iter().flat_map(|l| l.weights().iter().copied()) {
            if seen.insert(w) {
                targets.push(w);
            }
        }
        let was: HashSet<W> = self.patched.iter().copied().collect();
        let read_original = |w: W| -> Result<Vec<u8>> {
            let spec = ParamStore::spec(w);
            let mut bytes = vec![0u8; spec.nbytes];
            original(store.name_of(w).unwrap_or("?"), &spec, &mut bytes)?;
            Ok(bytes)
        };

        let mut writes: Vec<(W, Vec<u8>)> = Vec::with_capacity(targets.len());
        let mut runner = Runner::new(backend.clone(), n_threads);
        let t0 = std::time::Instant::now();
        let (mut t_read, mut t_comp) = (0f32, 0f32);
        for batch in batches(&targets) {
            let tr = std::time::Instant::now();
            // Weights holding an earlier merge start again from the file's bytes.
            let inputs: Vec<Option<Vec<u8>>> =
                batch.iter().map(|&w| was.contains(&w).then(|| read_original(w)).transpose()).collect::<Result<_>>()?;
            t_read += tr.elapsed().as_secs_f32();
            let tc = std::time::Instant::now();
            let outputs = runner.compute_bytes(|g| {
                let mut outs = Vec::with_capacity(batch.len());
                for (&w, input) in batch.iter().zip(inputs) {
                    let patches: Vec<&Patch> = loras.iter().filter_map(|l| l.patch(w)).collect();
                    let (t, is_param) = match input {
                        Some(b) => (g.input_bytes(w.ty(), &w.ne(), b), false),
                        None => (g.param(w), true),
                    };
                    outs.push(merged_weight(g, t, is_param, &patches, store.name_of(w).unwrap_or("?"))?);
                }
                Ok(outs)
            })?;
            t_comp += tc.elapsed().as_secs_f32();
            writes.extend(batch.iter().copied().zip(outputs));
        }
        sd_debug!("LoRA merge: {} weights computed in {:.2}s (originals read {:.2}s, compute {:.2}s)", targets.len(), t0.elapsed().as_secs_f32(), t_read, t_comp);
        let mut remap = Vec::new();
        for &w in self.patched.iter().filter(|w| !seen.contains(w)) {
            if store.has_mapping(w) {
                remap.push(w);
            } else {
                writes.push((w, read_original(w)?));
            }
        }
        for (w, bytes) in &writes {
            let want = ParamStore::spec(*w).nbytes;
            ensure!(bytes.len() == want, "merged '{}' has {} bytes, expected {want}", store.name_of(*w).unwrap_or("?"), bytes.len());
        }
        Ok(Staged { targets, writes, remap, moved: Vec::new() })
    }

    /// [`stage`](Self::stage), [`Staged::reserve`] and [`Staged::commit`] for one store.
    pub fn apply(
        &mut self,
        store: &mut ParamStore,
        backend: &Arc<Backend>,
        n_threads: i32,
        loras: &[Lora],
        original: ReadOriginal,
    ) -> Result<MergeReport> {
        let mut staged = self.stage(store, backend, n_threads, loras, original)?;
        staged.reserve(store, backend)?;
        Ok(staged.commit(self, store))
    }
}

/// Consecutive runs of `ws` of at most BATCH_BYTES (at least one weight each).
fn batches(ws: &[W]) -> Vec<&[W]> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < ws.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < ws.len() && (end == start || bytes + ParamStore::spec(ws[end]).nbytes <= BATCH_BYTES) {
            bytes += ParamStore::spec(ws[end]).nbytes;
            end += 1;
        }
        out.push(&ws[start..end]);
        start = end;
    }
    out
}

impl Staged {
    /// Gives the weights computed from a mapped file that will be written a buffer of their
    /// own (the one step of a commit that can fail; all or nothing).
    pub fn reserve(&mut self, store: &mut ParamStore, backend: &Backend) -> Result<()> {
        self.moved = store.make_writable(&self.targets, backend)?;
        Ok(())
    }

    /// How many weights [`reserve`](Self::reserve) copied out of a mapped file.
    pub fn moved_count(&self) -> usize {
        self.moved.len()
    }

    /// Undoes [`reserve`](Self::reserve) (when another store's reservation failed).
    pub fn unreserve(&mut self, store: &mut ParamStore) {
        for w in self.moved.drain(..) {
            store.restore_mapped(w);
        }
    }

    /// Writes the staged weights into `store` (reserved first) and records the new state.
    pub fn commit(self, merged: &mut Merged, store: &mut ParamStore) -> MergeReport {
        let targets: HashSet<W> = self.targets.iter().copied().collect();
        let mut report = MergeReport { patched: self.targets.len(), restored: self.remap.len(), written: 0 };
        for (w, bytes) in self.writes {
            // Sizes were checked when staging and every target is writable now.
            if let Err(e) = store.set_data(w, &bytes) {
                sd_error!("LoRA merge: {e}");
                continue;
            }
            report.written += bytes.len();
            report.restored += usize::from(!targets.contains(&w));
        }
        for w in self.remap {
            store.restore_mapped(w);
        }
        merged.patched = self.targets;
        report
    }
}
