//! From the files a context names to filled weights: the files are listed once (names
//! converted to the reference's internal ones), each weight's type is decided (the file's,
//! or `wtype` / `tensor_type_rules`), and every model's `ParamStore` is filled tensor by
//! tensor straight from the file, so a checkpoint is never held in memory as a whole.

use crate::params::CtxParams;
use crate::error::{Context as _, Result};
use crate::graph::params::{HostRegion, TensorSpec};
use crate::graph::params::Int8Groups;
use crate::graph::{Backend, Loaded, ParamStore, Placement, Runner, Scope, TypeMap, WeightSource};
use std::sync::Arc;
use crate::io::type_rules::{target_type, TypeRules};
use crate::io::{Component, ModelFiles, SdVersion, TensorStorage};
use crate::types::SdType;
use std::time::Instant;

/// The model files of a context, listed and typed.
pub struct Weights {
    files: ModelFiles,
    types: TypeMap,
    /// ComfyUI `int8_tensorwise` weights and their ConvRot groups.
    int8: Int8Groups,
    version: SdVersion,
    /// The context's opt-in fast path (`runtime::args::fast_path`): every network loaded from
    /// these files takes Winograd's convolutions.
    fast: bool,
}

/// The component files of `params` with the prefix the reference gives each.
fn sources(params: &CtxParams) -> Vec<(Component, &str, &'static str)> {
    let named = [
        (Component::Model, &params.model_path, "model"),
        (Component::DiffusionModel, &params.diffusion_model_path, "diffusion model"),
        (Component::HighNoiseDiffusionModel, &params.high_noise_diffusion_model_path, "high noise diffusion model"),
        (Component::UncondDiffusionModel, &params.uncond_diffusion_model_path, "unconditional diffusion model"),
        (Component::ClipL, &params.clip_l_path, "clip_l"),
        (Component::ClipG, &params.clip_g_path, "clip_g"),
        (Component::ClipVision, &params.clip_vision_path, "clip_vision"),
        (Component::T5xxl, &params.t5xxl_path, "t5xxl"),
        (Component::PulidWeights, &params.pulid_weights_path, "PuLID weights"),
        (Component::Llm, &params.llm_path, "llm"),
        (Component::LlmVision, &params.llm_vision_path, "llm vision"),
        (Component::Vae, &params.vae_path, "vae"),
        (Component::Taesd, &params.taesd_path, "tae"),
        (Component::EmbeddingsConnectors, &params.embeddings_connectors_path, "embeddings connectors"),
        (Component::MotionModule, &params.motion_module_path, "motion module (AnimateDiff)"),
        (Component::IpAdapter, &params.ip_adapter_path, "ip-adapter"),
    ];
    named
        .into_iter()
        .filter_map(|(c, p, what)| p.as_deref().filter(|p| !p.is_empty()).map(|p| (c, p, what)))
        .collect()
}

impl Weights {
    /// The weights of `files` typed as `types`, with the files' `int8_tensorwise` weights.
    fn assemble(files: ModelFiles, types: TypeMap, version: SdVersion) -> Weights {
        let int8 = files.tensors().iter().filter_map(|ts| ts.int8_group().map(|g| (ts.name().to_string(), g))).collect();
        Weights { files, types, int8, version, fast: false }
    }

    /// Lists every file of `params` and detects the model family. A file that cannot be
    /// read, or a set of files whose family is unknown, is an error naming the file.
    pub fn open(params: &CtxParams) -> Result<Weights> {
        let list = sources(params);
        ensure!(!list.is_empty(), "no model file given (model_path or diffusion_model_path)");
        let mut files = ModelFiles::new();
        files.set_mmap(params.enable_mmap);
        for (component, path, what) in &list {
            sd_info!("loading {what} from '{path}'");
            let added = files.add(path, component.prefix());
            // Like the reference, an unreadable PuLID file leaves the model without PuLID.
            if let (Component::PulidWeights, Err(e)) = (component, &added) {
                sd_warn!("loading PuLID weights from '{path}' failed: {e}");
                continue;
            }
            if let (Component::EmbeddingsConnectors, Err(e)) = (component, &added) {
                sd_warn!("loading embeddings connectors from '{path}' failed: {e}");
                continue;
            }
            added.map_err(|e| loader_error(&path, e))?;
        }
        let version = files.detect_version().with_context(|| {
            let main = list.first().map(|s| s.1).unwrap_or("");
            format!("get sd version from file failed: '{main}'")
        })?;
        sd_info!("Version: {}", version.name());
        files.convert_names(Some(version));
        let weights = Self::for_context(files, version, params);
        if weights.fast {
            sd_info!("fast path on: 3x3 convolutions by Winograd in every network (pictures move from the reference's by float rounding)");
        }
        Ok(weights)
    }

    /// Files of the context `params` describes: weights typed by its `wtype` and
    /// `tensor_type_rules`, on its fast path or not.
    fn for_context(files: ModelFiles, version: SdVersion, params: &CtxParams) -> Weights {
        let mut weights = Self::from_files(files, version, params.wtype, params.tensor_type_rules.as_deref().unwrap_or(""));
        weights.fast = crate::runtime::args::fast_path(params.model_args.as_deref());
        weights
    }

    /// Files already listed with internal names, each weight typed by `wtype` and the
    /// `tensor_type_rules` text.
    pub fn from_files(mut files: ModelFiles, version: SdVersion, wtype: Option<SdType>, type_rules: &str) -> Weights {
        let rules = TypeRules::parse(type_rules);
        let mut quantizing = false;
        let types = files
            .tensors()
            .iter()
            .map(|ts| {
                let ty = target_type(ts, wtype, &rules).unwrap_or(ts.ty());
                quantizing |= ty != ts.ty() && crate::io::dtype::is_quantized(ty);
                (ts.name().to_string(), ty.raw())
            })
            .collect();
        if quantizing {
            files.set_importance(crate::runtime::imatrix::importance());
        }
        Weights::assemble(files, types, version)
    }

    /// Lists one file of a family the caller already knows (an upscaler model), names
    /// converted for `version`; weights keep the file's types. Read without mmap, like the
    /// reference loads upscalers.
    pub fn open_file(path: &str, version: SdVersion) -> Result<Weights> {
        let mut files = ModelFiles::new();
        files.set_mmap(false);
        files
            .add(path, "")
            .map_err(|e| loader_error(&path, e))?;
        files.convert_names(Some(version));
        let types = files.tensors().iter().map(|ts| (ts.name().to_string(), ts.ty().raw())).collect();
        Ok(Weights::assemble(files, types, version))
    }

    /// Lists one file whose tensors keep the names they are stored under: the ADetailer
    /// detector, which the reference reads without converting names. Weights keep the file's
    /// types; read without mmap. The file belongs to no diffusion family: `version()` then
    /// reports `Esrgan`, the one non-diffusion value (nothing reads it for such a file).
    pub fn open_file_as_stored(path: &str) -> Result<Weights> {
        let mut files = ModelFiles::new();
        files.set_mmap(false);
        files
            .add(path, "")
            .map_err(|e| loader_error(&path, e))?;
        let types = files.tensors().iter().map(|ts| (ts.name().to_string(), ts.ty().raw())).collect();
        Ok(Weights::assemble(files, types, SdVersion::Esrgan))
    }

    /// String metadata of the safetensors files (`__metadata__`).
    pub fn metadata(&self) -> &std::collections::BTreeMap<String, String> {
        self.files.metadata()
    }

    /// Lists an add-on network's file (a ControlNet) for a context of `version`: names
    /// converted for it, weights typed by the context's `wtype` and `tensor_type_rules` and on
    /// its fast path, like the files of the model itself.
    pub fn open_addon(path: &str, version: SdVersion, params: &CtxParams) -> Result<Weights> {
        Self::open_addon_under(path, "", version, params)
    }

    /// [`open_addon`](Self::open_addon) with `prefix` in front of every name (PhotoMaker's `pmid.`).
    pub fn open_addon_under(path: &str, prefix: &str, version: SdVersion, params: &CtxParams) -> Result<Weights> {
        let mut files = ModelFiles::new();
        files.set_mmap(params.enable_mmap);
        files
            .add(path, prefix)
            .map_err(|e| loader_error(&path, e))?;
        files.convert_names(Some(version));
        Ok(Self::for_context(files, version, params))
    }

    /// Internal names of every tensor in the files.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.files.tensors().iter().map(TensorStorage::name)
    }

    pub fn version(&self) -> SdVersion {
        self.version
    }

    /// Whether decoders and upscalers of these files take Winograd's convolutions: not when
    /// any weight is quantized, unless on the fast path (see `graph::context::winograd_wanted`).
    pub fn winograd_for_decoding(&self) -> bool {
        crate::graph::context::winograd_wanted(self.types().values().any(|&t| crate::graph::context::is_block_quantized(t)), self.fast)
    }

    /// Internal name → type the weight will have.
    pub fn types(&self) -> &TypeMap {
        &self.types
    }

    /// Shape (ggml order, as many dimensions as stored) of a tensor in the files.
    pub fn shape_of(&self, name: &str) -> Option<Vec<i64>> {
        self.files.get(name).map(|ts| ts.shape().to_vec())
    }

    /// Whether any tensor name starts with `prefix`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.files.tensors().iter().any(|t| t.name().starts_with(prefix))
    }

    /// A tensor's values as f32.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.files.read_f32(name)
    }

    pub fn get(&self, name: &str) -> Option<&TensorStorage> {
        self.files.get(name)
    }

    /// Reads weight `name` again exactly as [`load`](Self::load) filled it (e.g. to undo a
    /// LoRA merged into it).
    pub fn read_weight(&self, name: &str, spec: &TensorSpec, dst: &mut [u8]) -> Result<()> {
        fill_one(&self.files, name, spec, dst)
    }

    /// Whether any tensor is stored in a block-quantized type in the files: the reference's
    /// test for applying LoRAs at run time in `auto` mode (it looks at the files' types, not
    /// at `wtype`, so an f16 file loaded as q8_0 still merges them).
    pub fn has_quantized_storage(&self) -> bool {
        self.has_int8() || self.files.tensors().iter().any(|ts| crate::graph::is_block_quantized(ts.ty().raw()))
    }

    /// Whether the files hold ComfyUI `int8_tensorwise` weights (LoRAs apply to them at run
    /// time only).
    pub fn has_int8(&self) -> bool {
        !self.int8.is_empty()
    }

    /// Fails, naming the file, when a file that loaded weights compute from in place (mmap)
    /// changed since it was opened: call it before every use of the weights, as a truncated
    /// file would fault the computation instead (DESIGN.md, "Model files").
    pub fn validate(&self) -> Result<()> {
        self.files.validate_in_use()
    }

    /// Allocates `store` on `backend` and fills every declared tensor from the files. With
    /// mmap on a CPU backend, tensors stored in the wanted type are computed from the mapped
    /// file in place (no copy; pages are read when first used), like the reference.
    pub fn load(&self, store: &mut ParamStore, backend: &Backend, what: &str, threads: usize) -> Result<()> {
        let start = Instant::now();
        self.files.validate()?;
        let placed = store.place_in_host_regions(backend, |name, spec| {
            let ts = self.files.get(name)?;
            let ty = SdType::from_raw(spec.ty)?;
            // A mismatching shape is left to `fill`, which names it.
            if ts.ne() != spec.ne4() {
                return None;
            }
            let (map, offset) = self.files.shared_mapping(ts, ty).ok()??;
            Some((map as HostRegion, offset))
        })?;
        if placed > 0 {
            store.regions_are_file_mappings();
            sd_debug!("{what}: {placed} tensors used in place from the mapped file");
        }
        store.alloc(backend).with_context(|| format!("{what}: allocating weights"))?;
        fill(&self.files, store, threads)?;
        sd_info!(
            "{what}: loaded {} tensors ({:.2} MB) in {:.2}s",
            store.len(),
            store.nbytes() as f64 / (1024.0 * 1024.0),
            start.elapsed().as_secs_f32()
        );
        Ok(())
    }
}

/// Weight tensors one network may declare beyond those of its files under its prefix
/// (optional and derived ones). A network holds its files' tensors: the SD UNet about 700,
/// SDXL's 1,700, LTX-2.3's transformer over 4,000.
const STORE_SLACK: usize = 4096;

impl Weights {
    /// A network declared by `declare` under `prefix`, its weights placed as `placement`
    /// says (on the compute device, on another backend, spread over a layer split, or left
    /// on disk to be read for each phase), with a runner of `n_threads`. `what` names it in
    /// logs and errors.
    pub fn load_model<M>(
        self: &Arc<Self>,
        placement: Placement,
        n_threads: i32,
        prefix: &str,
        what: &'static str,
        declare: impl FnOnce(&mut Scope) -> M,
    ) -> Result<Loaded<M>> {
        let in_files = self.files.tensors().iter().filter(|t| t.name().starts_with(prefix)).count();
        let mut store = ParamStore::new(in_files + STORE_SLACK)?;
        let model = declare(&mut Scope::new(&mut store, self.types(), prefix).with_int8(&self.int8));
        check_int8(&store, &self.int8, &placement, what)?;
        let threads = n_threads.max(1) as usize;
        if !placement.split.is_empty() {
            let (devices, shares) = placement.split_devices();
            store.alloc_split(&devices, &shares).with_context(|| format!("{what}: allocating weights"))?;
            self.fill(&mut store, threads)?;
        } else if let Some(b) = placement.weights_backend() {
            self.load(&mut store, b, what, threads)?;
        } else if matches!(placement.weights, crate::graph::WeightHome::FirstUse) {
            // Read later (where an eager load read them before): what that load would refuse
            // is refused now, with the context.
            check_declared(&self.files, &store).with_context(|| format!("{what}: checking weights"))?;
            sd_debug!("{what}: weights will be read from the model files when first used");
        } else {
            sd_info!("{what}: weights are read from the model files for each use");
        }
        let mut runner = Runner::for_placement(&placement, n_threads);
        if self.fast {
            runner.options.fast = true;
            runner.options.cpu_winograd = self.winograd_for_decoding();
        }
        let source: Arc<dyn WeightSource> = self.clone();
        Ok(Loaded::new(model, store, placement, runner, Some(source), what))
    }

    /// Fills an allocated `store` (e.g. one spread over several devices) from the files.
    pub fn fill(&self, store: &mut ParamStore, threads: usize) -> Result<()> {
        fill(&self.files, store, threads)
    }
}

impl WeightSource for Weights {
    fn load(&self, store: &mut ParamStore, backend: &Backend, what: &str, threads: usize) -> Result<()> {
        Weights::load(self, store, backend, what, threads)
    }
}

/// The size of the pieces a large tensor that needs no conversion is read in.
const READ_PIECE: usize = 64 << 20;

/// Fills every tensor of an allocated `store` from `files`, checking presence and shape. A
/// tensor larger than [`READ_PIECE`] whose bytes need no conversion is read in pieces by all
/// `threads` (UMT5's 2 GB token table would otherwise be read by one while the others idle).
pub fn fill(files: &ModelFiles, store: &mut ParamStore, threads: usize) -> Result<()> {
    fill_in_pieces(files, store, threads, READ_PIECE)
}

fn fill_in_pieces(files: &ModelFiles, store: &mut ParamStore, threads: usize, piece: usize) -> Result<()> {
    let raw = |name: &str, spec: &TensorSpec| {
        let (Some(ts), Some(ty)) = (files.get(name), SdType::from_raw(spec.ty)) else { return None };
        (ts.ne() == spec.ne4() && files.stored_as(ts, ty)).then_some((ts, ty))
    };
    store.load_parallel_pieces(
        threads,
        piece,
        |name, spec| raw(name, spec).is_some(),
        |name, spec, offset, dst| match raw(name, spec) {
            Some((ts, ty)) if dst.len() < spec.nbytes => files.read_tensor_bytes(ts, ty, offset as u64, dst),
            _ => fill_one(files, name, spec, dst),
        },
    )
}

/// Fails, naming it, on a declared tensor of `store` that `files` lack or hold in another
/// shape: a load's checks without reading (the reference validates its registered tensors
/// when the context is made, its weights are read later).
fn check_declared(files: &ModelFiles, store: &ParamStore) -> Result<()> {
    for (name, w) in store.entries() {
        declared(files, name, ParamStore::spec(w).ne4())?;
    }
    Ok(())
}

/// The files' tensor `name`, when it has the declared shape `want`.
fn declared<'f>(files: &'f ModelFiles, name: &str, want: [i64; 4]) -> Result<&'f TensorStorage> {
    let ts = files.get(name).with_context(|| format!("tensor '{name}' not found in the model files"))?;
    ensure!(ts.ne() == want, "tensor '{name}' has wrong shape in model file: got {:?}, expected {:?}", ts.ne(), want);
    Ok(ts)
}

/// Reads the declared tensor `name` (`spec`) from `files` into `dst`.
fn fill_one(files: &ModelFiles, name: &str, spec: &TensorSpec, dst: &mut [u8]) -> Result<()> {
    let ts = declared(files, name, spec.ne4())?;
    let ty = SdType::from_raw(spec.ty).with_context(|| format!("tensor '{name}': unknown ggml type {}", spec.ty))?;
    files.read_tensor(ts, ty, dst)
}

/// Reads every tensor of a small file (e.g. a textual-inversion embedding) as f32 host
/// tensors in ggml order, names converted like the reference does.
pub fn read_all_f32(path: &str) -> Result<Vec<(String, crate::tensor::Tensor)>> {
    let mut files = ModelFiles::new();
    files.add(path, "").map_err(|e| crate::error::Error::new(format!("cannot read '{path}': {e}")))?;
    files.convert_names(None);
    let mut out = Vec::new();
    for ts in files.tensors() {
        ensure!(ts.nelements() <= 1 << 26, "'{path}': tensor '{}' is too large for an embedding", ts.name());
        let values = files.read_f32(ts.name())?;
        let shape: Vec<usize> = ts.shape().iter().map(|&d| d as usize).collect();
        out.push((ts.name().to_string(), crate::tensor::Tensor::from_vec(&shape, values)?));
    }
    Ok(out)
}

/// Fails, naming it, when an `int8_tensorwise` weight of `store` went to a layer that
/// cannot multiply with it (only linear layers take their row scales), or is to compute on
/// another device than the CPU (the op is a CPU one).
fn check_int8(store: &ParamStore, int8: &Int8Groups, placement: &Placement, what: &str) -> Result<()> {
    for name in int8.keys().filter(|n| store.get(n).is_some()) {
        ensure!(
            store.get(&format!("{name}_scale")).is_some(),
            "{what}: '{name}' is a ComfyUI int8_tensorwise weight of a layer that takes no INT8 weights (only linear layers do)"
        );
        ensure!(
            placement.compute.is_cpu(),
            "{what}: ComfyUI int8_tensorwise weights compute on the CPU only, not on {} (use --backend cpu for this model, or an f16/bf16/GGUF version of it)",
            placement.compute.device_name()
        );
    }
    Ok(())
}

/// A file that could not be listed, named once (the readers' messages often start with it).
fn loader_error(path: &str, e: impl std::fmt::Display) -> crate::error::Error {
    let e = e.to_string();
    if e.starts_with(&format!("'{path}'")) {
        crate::error::Error::new(format!("init model loader from file failed: {e}"))
    } else {
        crate::error::Error::new(format!("init model loader from file failed: '{path}': {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{F16, F32};

    /// An INT8 weight must reach a linear layer (which declares its row scales); any other
    /// layer would hand I8 rows to a product that cannot read them.
    #[test]
    fn int8_weights_outside_linear_layers_are_refused() {
        let types: TypeMap = [("a.weight".to_string(), crate::graph::context::I8), ("b.weight".to_string(), crate::graph::context::I8)].into_iter().collect();
        let int8: Int8Groups = [("a.weight".to_string(), 16), ("b.weight".to_string(), 0)].into_iter().collect();
        let mut store = ParamStore::new(8).unwrap();
        let cpu = Placement::on(crate::graph::Module::Diffusion, Arc::new(Backend::cpu().unwrap()));
        {
            let mut s = Scope::new(&mut store, &types, "").with_int8(&int8);
            let lin = crate::graph::nn::Linear::new(&mut s, "a", 16, 4, false);
            assert_eq!(lin.int8.map(|(_, g)| g), Some(16));
        }
        check_int8(&store, &int8, &cpu, "test").unwrap();
        Scope::new(&mut store, &types, "").with_int8(&int8).tensor("b.weight", crate::graph::context::I8, &[16, 4]);
        let e = check_int8(&store, &int8, &cpu, "test").unwrap_err().to_string();
        assert!(e.contains("'b.weight'") && e.contains("only linear layers"), "{e}");
    }

    /// A network of more tensors than the store's slack alone holds (LTX-2.3's transformer
    /// has over 4,000) is declared and filled.
    #[test]
    fn networks_of_many_tensors_load() {
        let n = STORE_SLACK + 500;
        let header = (0..n).map(|i| format!(r#""net.t{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}"#, 4 * i, 4 * i + 4)).collect::<Vec<_>>().join(",");
        let values: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let path = std::env::temp_dir().join(format!("sd-loader-many-{}.safetensors", std::process::id()));
        std::fs::write(&path, crate::io::safetensors::tests::file(&format!("{{{header}}}"), &values)).unwrap();
        let mut files = ModelFiles::new();
        files.add(&path, "").unwrap();
        let weights = Arc::new(Weights::from_files(files, SdVersion::Esrgan, None, ""));
        let cpu = Placement::on(crate::graph::Module::Diffusion, Arc::new(Backend::cpu().unwrap()));
        let loaded = weights.load_model(cpu, 1, "net.", "test", |s| (0..n).map(|i| s.tensor(&format!("t{i}"), F32, &[1])).collect::<Vec<_>>());
        let _ = std::fs::remove_file(&path);
        let loaded = loaded.unwrap();
        assert_eq!(loaded.store().len(), n);
        let last = loaded.store().get(&format!("net.t{}", n - 1)).unwrap();
        assert_eq!(loaded.store().get_data(last).unwrap(), ((n - 1) as f32).to_le_bytes());
    }

    /// Resident KiB of the mapping holding `addr` (/proc/self/smaps), 0 when none holds it.
    #[cfg(target_os = "linux")]
    fn mapping_rss_kb(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
            if let Some((Ok(a), Ok(b))) = range.map(|(a, b)| (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))) {
                inside = a <= addr && addr < b;
            } else if inside && line.starts_with("Rss:") {
                return line.split_whitespace().nth(1).unwrap().parse().unwrap();
            }
        }
        0
    }

    /// Weights computed in place from a mapped file leave the resident set when they are
    /// freed (a per-phase text encoder's GBs while the transformer samples), and read the
    /// same when loaded again.
    #[cfg(target_os = "linux")]
    #[test]
    fn freed_mapped_weights_leave_the_resident_set() {
        let n = 2usize << 20;
        let values: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let mut header = format!(r#"{{"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#, 4 * n);
        header.push_str(&" ".repeat((64 - (8 + header.len()) % 64) % 64));
        let path = std::env::temp_dir().join(format!("sd-loader-mapped-{}.safetensors", std::process::id()));
        std::fs::write(&path, crate::io::safetensors::tests::file(&header, &values)).unwrap();
        let mut files = ModelFiles::new();
        files.set_mmap(true);
        files.add(&path, "").unwrap();
        let weights = Weights::from_files(files, SdVersion::Esrgan, None, "");
        let backend = Backend::cpu().unwrap();
        let mut store = ParamStore::new(1).unwrap();
        store.declare("w", F32, &[n as i64]);
        let mut resident = Vec::new();
        for _ in 0..2 {
            weights.load(&mut store, &backend, "test", 1).unwrap();
            let w = store.get("w").unwrap();
            // SAFETY: a loaded tensor of the store.
            let data = unsafe { (*w.raw()).data } as usize;
            assert_eq!(store.get_data(w).unwrap(), values, "read in place from the mapping");
            resident.push(mapping_rss_kb(data));
            store.release();
            resident.push(mapping_rss_kb(data));
        }
        let _ = std::fs::remove_file(&path);
        let file_kb = 4 * n / 1024;
        assert!(resident[0] >= file_kb && resident[2] >= file_kb, "pages read: {resident:?} KiB");
        assert!(resident[1] < 64 && resident[3] < 64, "pages left after release: {resident:?} KiB");
    }

    /// Tensors read in pieces by several threads hold what the one-call read gives, those
    /// that need a conversion (f16 → f32) included.
    #[test]
    fn pieces_fill_like_whole_reads() {
        // Finite f16 bit patterns (exponent below 0x1f).
        let values: Vec<u8> = (0..1000u32).flat_map(|i| ((i * 37 % 0x7800) as u16).to_le_bytes()).collect();
        let header = r#"{"big":{"dtype":"F16","shape":[10,64],"data_offsets":[0,1280]},"conv":{"dtype":"F16","shape":[360],"data_offsets":[1280,2000]},"__metadata__":{}}"#;
        let path = std::env::temp_dir().join(format!("sd-loader-pieces-{}.safetensors", std::process::id()));
        std::fs::write(&path, crate::io::safetensors::tests::file(header, &values)).unwrap();
        let mut files = ModelFiles::new();
        files.add(&path, "").unwrap();
        let backend = Backend::cpu().unwrap();
        let stores: Vec<ParamStore> = [(1, usize::MAX), (3, 100), (2, 4096)]
            .into_iter()
            .map(|(threads, piece)| {
                let mut store = ParamStore::new(2).unwrap();
                store.declare("big", F16, &[64, 10]);
                store.declare("conv", F32, &[360]);
                store.alloc(&backend).unwrap();
                fill_in_pieces(&files, &mut store, threads, piece).unwrap();
                store
            })
            .collect();
        let _ = std::fs::remove_file(&path);
        for name in ["big", "conv"] {
            let data: Vec<Vec<u8>> = stores.iter().map(|s| s.get_data(s.get(name).unwrap()).unwrap()).collect();
            assert!(data.iter().all(|d| *d == data[0]), "{name}");
        }
        assert_eq!(stores[1].get_data(stores[1].get("big").unwrap()).unwrap(), values[..1280]);
    }
}
