//! The LoRAs of a generation request, like the reference's `apply_loras`: before each
//! generation the wanted list is compared with the one in effect; when it differs every
//! LoRA file is read again and the model parts are brought to the new list, all parts at
//! once or, on any error, none (the previous LoRAs stay in effect).
//!
//! What a model set does with it:
//! - at load: `LoraSet::new(params.lora_apply_mode, &weights)`, and keep the `Weights`
//!   (merged weights are restored by reading the model files again);
//! - per generation, before encoding the prompt: [`LoraSet::apply`] with one
//!   [`LoraTarget`] (weights + the runner computing with them) per model part a LoRA may
//!   update, always the same parts in the same order (e.g. text encoders, diffusion
//!   model(s), first stage). `immediately` rewrites the stores' weights; `at_runtime` sets
//!   an adapter on each runner (cleared when no LoRA updates that part).

use super::loader::Weights;
use crate::error::Result;
use crate::graph::params::TensorSpec;
use crate::graph::{ParamStore, Runner, WeightAdapter};
use crate::io::lora::LoraFile;
use crate::models::adapter::lora::{patch_from, Lora, Merged, PieceTensors, RuntimeLoras, TensorDecl, TENSOR_PARTS};
use crate::params::Lora as LoraRequest;
use crate::types::{LoraApplyMode, SdType};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// A model part LoRAs may update: its weights and the runner that computes with them.
pub struct LoraTarget<'a> {
    pub store: &'a mut ParamStore,
    pub runner: &'a mut Runner,
}

/// The LoRAs in effect on a model set.
#[derive(Debug)]
pub struct LoraSet {
    immediately: bool,
    applied: Vec<LoraRequest>,
    /// Per target (`immediately`): which weights hold merged updates.
    merged: Vec<Merged>,
}

impl LoraSet {
    /// `auto` applies LoRAs at run time when the model files hold quantized weights and
    /// merges them otherwise, like the reference.
    pub fn new(mode: LoraApplyMode, weights: &Weights) -> LoraSet {
        let immediately = match mode {
            LoraApplyMode::Immediately => true,
            LoraApplyMode::AtRuntime => false,
            _ => !weights.has_quantized_storage(),
        };
        LoraSet { immediately, applied: Vec::new(), merged: Vec::new() }
    }

    pub fn applies_immediately(&self) -> bool {
        self.immediately
    }

    /// The LoRAs in effect.
    pub fn applied(&self) -> &[LoraRequest] {
        &self.applied
    }

    /// Brings `targets` to the LoRAs of `wanted` (in order). Nothing changes when they are
    /// the ones in effect, or when any of them fails.
    pub fn apply(&mut self, wanted: &[LoraRequest], weights: &Weights, targets: &mut [LoraTarget], n_threads: i32) -> Result<()> {
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
        sd_info!("TIMING loras loaded in {:.2}s", start.elapsed().as_secs_f32());
        if self.immediately {
            self.merge(per_target, weights, targets, n_threads)?;
        } else {
            if !wanted.is_empty() {
                sd_info!("apply lora at runtime");
            }
            let adapters = per_target
                .into_iter()
                .zip(targets.iter())
                .map(|(loras, t)| if loras.is_empty() { Ok(None) } else { RuntimeLoras::new(loras, t.store).map(Some) })
                .collect::<Result<Vec<_>>>()?;
            for (t, a) in targets.iter_mut().zip(adapters) {
                t.runner.set_adapter(a.map(|a| Arc::new(a) as Arc<dyn WeightAdapter>));
            }
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

    /// Stages every target, then reserves and commits them all.
    fn merge(&mut self, per_target: Vec<Vec<Lora>>, weights: &Weights, targets: &mut [LoraTarget], n_threads: i32) -> Result<()> {
        self.merged.resize_with(targets.len(), Merged::default);
        let read = |name: &str, spec: &TensorSpec, dst: &mut [u8]| weights.read_weight(name, spec, dst);
        let mut staged = Vec::with_capacity(targets.len());
        for ((t, merged), loras) in targets.iter().zip(&self.merged).zip(&per_target) {
            staged.push(merged.stage(t.store, t.runner.backend(), n_threads, loras, &read)?);
        }
        for i in 0..staged.len() {
            if let Err(e) = staged[i].reserve(targets[i].store, targets[i].runner.backend()) {
                for j in 0..i {
                    staged[j].unreserve(targets[j].store);
                }
                return Err(e);
            }
        }
        for ((s, t), merged) in staged.into_iter().zip(targets.iter_mut()).zip(&mut self.merged) {
            let mapped = s.moved_count();
            let r = s.commit(merged, t.store);
            if r.patched + r.restored > 0 {
                sd_debug!("LoRA merge: {} weights updated, {} restored, {:.1} MB written", r.patched, r.restored, r.written as f64 / 1e6);
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
