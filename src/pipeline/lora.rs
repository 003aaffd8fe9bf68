//! The LoRAs of a generation request, like the reference's `apply_loras`: before each
//! generation the wanted list is compared with the one in effect; when it differs every
//! LoRA file is read again and each model component is brought to the new list, all at
//! once or, on any error, none (the previous LoRAs stay in effect).
//!
//! One seam for every family: a component's LoRA updates are found by the names its
//! `ParamStore` declares (the model files' internal names, which `io::lora` maps every LoRA
//! naming scheme onto), so a family only extends the name tables of `io::names`.
//!
//! Per component, `immediately` rewrites the weights in its store (originals re-read from the
//! model files, or pointed at the mapped file again, when a LoRA goes away); `at_runtime`
//! sets an adapter on its runner (cleared when no LoRA updates it). Weights that do not stay
//! on the compute device between phases (`params_backend=cpu|disk`, a layer split) are
//! re-read or copied for each phase, so there the LoRAs are applied by the runner's adapter,
//! which stays with the runner whatever happens to the weights: at run time, except that a
//! text encoder read per conditioning phase in `immediately` mode gets its updates merged
//! into its weights in each graph (the merge's values, see [`RuntimeLoras::merging`]).

use super::loader::Weights;
use crate::error::Result;
use crate::graph::params::TensorSpec;
use crate::graph::{Module, ParamStore, Runner, WeightAdapter, WeightHome, WeightsMut};
use crate::io::lora::LoraFile;
use crate::models::adapter::lora::{patch_from, Lora, Merged, PieceTensors, RuntimeLoras, TensorDecl, TENSOR_PARTS};
use crate::params::Lora as LoraRequest;
use crate::types::{LoraApplyMode, SdType};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// The LoRAs in effect on a model set.
#[derive(Debug)]
pub struct LoraSet {
    immediately: bool,
    applied: Vec<LoraRequest>,
    /// Per component (`immediately`): which weights hold merged updates.
    merged: Vec<Merged>,
    /// The "applied at run time instead" note was logged.
    noted_runtime: bool,
}

/// Whether the weights of a component stay on its compute device, where merging into them
/// lasts: also a diffusion model read at its first use (`ModelSet::apply_loras` reads it
/// before LoRAs are merged; a first stage read at first use gets them at run time).
fn mergeable(t: &WeightsMut) -> bool {
    let kept = match t.placement.weights {
        WeightHome::Compute => true,
        WeightHome::FirstUse => t.placement.module == Module::Diffusion,
        _ => false,
    };
    kept && t.placement.split.is_empty() && t.placement.max_vram == 0
}

/// Whether `immediately` LoRAs are merged into a component's weights in each of its graphs:
/// a text encoder read for each conditioning phase (the store's merge would not outlive the
/// phase; its graphs run once or twice a generation, so merging each time costs little).
fn merges_per_use(t: &WeightsMut) -> bool {
    t.placement.module == Module::Te && matches!(t.placement.weights, WeightHome::Disk) && t.placement.split.is_empty()
}

impl LoraSet {
    /// The mode `mode` resolves to for the model `weights` loaded as `components` say.
    /// `auto` applies LoRAs at run time, like the reference, when the model files hold
    /// quantized weights or the diffusion model keeps its weights off the compute device
    /// (another backend, disk, a layer split, streamed layers).
    pub fn new(mode: LoraApplyMode, weights: &Weights, components: &[WeightsMut]) -> LoraSet {
        let constrained = components.iter().any(|c| c.placement.module == Module::Diffusion && (!mergeable(c) || c.placement.stream_layers));
        let immediately = match mode {
            LoraApplyMode::Immediately if weights.has_int8() => {
                sd_warn!("INT8 tensorwise weights do not support the immediately LoRA apply mode; using at_runtime instead");
                false
            }
            LoraApplyMode::Immediately => true,
            LoraApplyMode::AtRuntime => false,
            _ => !weights.has_quantized_storage() && !constrained,
        };
        LoraSet { immediately, applied: Vec::new(), merged: Vec::new(), noted_runtime: false }
    }

    pub fn applies_immediately(&self) -> bool {
        self.immediately
    }

    /// The LoRAs in effect.
    pub fn applied(&self) -> &[LoraRequest] {
        &self.applied
    }

    /// Brings `targets` (always the same components in the same order) to the LoRAs of
    /// `wanted` (in order). Nothing changes when they are the ones in effect, or when any of
    /// them fails.
    pub fn apply(&mut self, wanted: &[LoraRequest], weights: &Weights, targets: &mut [WeightsMut], n_threads: i32) -> Result<()> {
        if wanted == self.applied.as_slice() {
            return Ok(());
        }
        let start = Instant::now();
        let files = wanted
            .iter()
            .map(|l| {
                sd_debug!("lora {}{}:{:.2}", if l.is_high_noise { "|high_noise|" } else { "" }, l.path, l.multiplier);
                LoraFile::open(&l.path, weights.version(), l.is_high_noise)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut used: Vec<HashSet<String>> = vec![HashSet::new(); files.len()];
        let mut per_target = Vec::with_capacity(targets.len());
        for t in targets.iter() {
            let mut loras = Vec::new();
            for ((file, request), used) in files.iter().zip(wanted).zip(&mut used) {
                if let Some(l) = lora_for(file, request.multiplier, t.store, t.runner, used)? {
                    loras.push(l);
                }
            }
            per_target.push(loras);
        }
        let merge: Vec<bool> = targets.iter().map(|t| self.immediately && mergeable(t)).collect();
        if self.immediately && !wanted.is_empty() && !self.noted_runtime {
            // Only components some LoRA changes (a first stage read at first use is never
            // merged into, and most LoRAs leave it alone).
            for ((t, _), _) in targets.iter().zip(&merge).zip(&per_target).filter(|((_, m), loras)| !**m && !loras.is_empty()) {
                if merges_per_use(t) {
                    sd_info!("{}: its weights are read for each conditioning, so LoRAs are merged into them for each use", t.what);
                } else {
                    let why = if matches!(t.placement.weights, WeightHome::FirstUse) { "are read when first used" } else { "are not kept on the compute device" };
                    sd_info!("{}: its weights {why}, so LoRAs are applied to it at run time", t.what);
                }
                self.noted_runtime = true;
            }
        }
        if !self.immediately && !wanted.is_empty() {
            sd_info!("apply lora at runtime");
        }

        // Everything that can fail first: the run-time adapters and the merged weights.
        let mut adapters: Vec<Option<Arc<dyn WeightAdapter>>> = Vec::with_capacity(targets.len());
        let mut to_merge: Vec<Vec<Lora>> = Vec::with_capacity(targets.len());
        for ((loras, t), &m) in per_target.into_iter().zip(targets.iter()).zip(&merge) {
            ensure!(!m || loras.is_empty() || t.store.is_allocated(), "{}: its weights are not read yet, so LoRAs cannot be merged into them", t.what);
            if m || loras.is_empty() {
                adapters.push(None);
                to_merge.push(if m { loras } else { Vec::new() });
                continue;
            }
            let adapter = if self.immediately && merges_per_use(t) { RuntimeLoras::merging(loras, t.store)? } else { RuntimeLoras::new(loras, t.store)? };
            adapters.push(Some(Arc::new(adapter)));
            to_merge.push(Vec::new());
        }
        self.merge(to_merge, &merge, weights, targets, n_threads)?;
        for (t, a) in targets.iter_mut().zip(adapters) {
            t.runner.set_adapter(a);
        }
        for (file, used) in files.iter().zip(&used) {
            report_use(file, used);
        }
        self.applied = wanted.to_vec();
        if !wanted.is_empty() {
            sd_info!("apply_loras completed, taking {:.2}s", start.elapsed().as_secs_f32());
        }
        Ok(())
    }

    /// Stages every component merged into, then reserves and commits them all.
    fn merge(&mut self, per_target: Vec<Vec<Lora>>, merge: &[bool], weights: &Weights, targets: &mut [WeightsMut], n_threads: i32) -> Result<()> {
        self.merged.resize_with(targets.len(), Merged::default);
        let read = |name: &str, spec: &TensorSpec, dst: &mut [u8]| weights.read_weight(name, spec, dst);
        let mut staged = Vec::with_capacity(targets.len());
        for (((t, merged), loras), &m) in targets.iter().zip(&self.merged).zip(&per_target).zip(merge) {
            // Components not merged into hold no merged update (their placement is fixed).
            staged.push(if m { Some(merged.stage(t.store, t.runner.backend(), n_threads, loras, &read)?) } else { None });
        }
        for i in 0..staged.len() {
            let Some(s) = staged[i].as_mut() else { continue };
            if let Err(e) = s.reserve(targets[i].store, targets[i].runner.backend()) {
                for j in 0..i {
                    if let Some(s) = staged[j].as_mut() {
                        s.unreserve(targets[j].store);
                    }
                }
                return Err(e);
            }
        }
        for ((s, t), merged) in staged.into_iter().zip(targets.iter_mut()).zip(&mut self.merged) {
            let Some(s) = s else { continue };
            let mapped = s.moved_count();
            let r = s.commit(merged, t.store);
            if r.patched + r.restored > 0 {
                sd_debug!("{}: LoRA merge: {} weights updated, {} restored, {:.1} MB written", t.what, r.patched, r.restored, r.written as f64 / 1e6);
            }
            if mapped > 0 {
                sd_warn!("in mode 'immediately', LoRAs use extra memory with mmap ({mapped} weights copied out of the mapped file)");
            }
        }
        Ok(())
    }
}

/// The updates of LoRA `file` for the weights of `store`, loaded on the runner's backend;
/// `None` when it has none for them. Adds the file tensors it uses to `used`.
fn lora_for(file: &LoraFile, multiplier: f32, store: &ParamStore, runner: &Runner, used: &mut HashSet<String>) -> Result<Option<Lora>> {
    let targets = file.targets(&|n| store.get(n).is_some());
    if targets.is_empty() {
        return Ok(None);
    }
    let count = targets.iter().flat_map(|t| t.pieces.values()).map(|p| p.len()).sum();
    let mut lora = Lora::new(file.path(), count)?;
    for t in &targets {
        let Some(weight) = store.get(&t.weight) else { continue };
        let mut pieces = BTreeMap::new();
        for (&i, parts) in &t.pieces {
            let mut p = PieceTensors::default();
            for (part, name) in parts {
                match part.as_str() {
                    "alpha" => p.alpha = Some(file.scalar(name)?),
                    "scale" => p.scale = Some(file.scalar(name)?),
                    part if TENSOR_PARTS.contains(&part) => {
                        let Some(ts) = file.get(name) else { continue };
                        let w = lora.declare(&TensorDecl { name, ty: ts.ty().raw(), ne: ts.shape() })?;
                        p.tensors.insert(part.to_string(), w);
                    }
                    _ => {}
                }
            }
            pieces.insert(i, p);
        }
        if let Some((patch, parts)) = patch_from(&pieces, multiplier) {
            lora.add_patch(weight, patch);
            used.extend(parts.into_iter().filter_map(|(i, part)| t.pieces.get(&i)?.get(part).cloned()));
        }
    }
    if lora.is_empty() {
        return Ok(None);
    }
    lora.load(runner.backend(), |name, spec, dst| {
        let ty = SdType::from_raw(spec.ty).ok_or_else(|| crate::error::Error::new(format!("tensor '{name}': unknown ggml type")))?;
        file.read(name, ty, dst)
    })?;
    Ok(Some(lora))
}

/// Logs how much of a LoRA file was used, like the reference; a file that updates nothing
/// is a warning naming it.
fn report_use(file: &LoraFile, used: &HashSet<String>) {
    let total = file.tensors().len();
    let applied = used.len();
    if applied == 0 {
        sd_warn!("LoRA '{}' matches no weight of this model: it has no effect ({total} tensors)", file.path());
    } else if applied < total {
        sd_warn!("Only ({applied} / {total}) LoRA tensors have been applied, lora_file_path = {}", file.path());
        for ts in file.tensors().iter().filter(|ts| !used.contains(ts.name())).take(8) {
            sd_debug!("unused lora tensor |{}|", ts.name());
        }
    } else {
        sd_info!("({applied} / {total}) LoRA tensors have been applied, lora_file_path = {}", file.path());
    }
}
