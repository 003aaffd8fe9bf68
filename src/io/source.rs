//! A model as a set of files: which tensors exist, where their bytes are, and reading
//! one tensor on demand into a caller's buffer in the type the caller wants.

use super::dtype::{self, SourceDtype};
use super::storage::TensorStorage;
use super::version::SdVersion;
use super::{gguf, names, safetensors, torch, version};
use crate::error::{Context, Error, Result};
use crate::types::SdType;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// File formats we read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    Safetensors,
    Gguf,
    TorchZip,
    TorchLegacy,
}

impl FileFormat {
    pub fn name(self) -> &'static str {
        match self {
            FileFormat::Safetensors => "safetensors",
            FileFormat::Gguf => "gguf",
            FileFormat::TorchZip => "torch zip",
            FileFormat::TorchLegacy => "torch legacy",
        }
    }
}

/// The parts of a model a file can provide, with the name prefix the reference gives
/// their tensors so that they land where a single-file checkpoint would put them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Component {
    /// A full checkpoint (names used as they are).
    Model,
    DiffusionModel,
    HighNoiseDiffusionModel,
    UncondDiffusionModel,
    ClipL,
    ClipG,
    ClipVision,
    T5xxl,
    PulidWeights,
    Llm,
    LlmVision,
    Vae,
    Taesd,
    EmbeddingsConnectors,
    AudioVae,
    MotionModule,
    ControlNet,
    IpAdapter,
    PhotoMaker,
    Lora,
    Embedding,
    Upscaler,
}

impl Component {
    /// The prefix `new_sd_ctx` (and the adapters) give this component's tensors.
    pub fn prefix(self) -> &'static str {
        match self {
            Component::Model
            | Component::EmbeddingsConnectors
            | Component::AudioVae
            | Component::ControlNet
            | Component::IpAdapter
            | Component::Embedding
            | Component::Upscaler => "",
            Component::DiffusionModel | Component::PulidWeights => "model.diffusion_model.",
            Component::HighNoiseDiffusionModel => "model.high_noise_diffusion_model.",
            Component::UncondDiffusionModel => "model.diffusion_model.uncond.",
            Component::ClipL => "clip_l.",
            Component::ClipG => "clip_g.",
            Component::ClipVision => "clip_vision.",
            Component::T5xxl => "text_encoders.t5xxl.transformer.",
            Component::Llm => "text_encoders.llm.",
            Component::LlmVision => "text_encoders.llm.visual.",
            Component::Vae => "vae.",
            Component::Taesd => "tae.",
            Component::MotionModule => "model.diffusion_model.motion_module.",
            Component::PhotoMaker => "pmid.",
            Component::Lora => "lora.",
        }
    }

    /// The prefix `convert` gives this component (text encoders go straight to their
    /// `text_encoders.*` home there).
    pub fn convert_prefix(self) -> &'static str {
        match self {
            Component::ClipL => "text_encoders.clip_l.transformer.",
            Component::ClipG => "text_encoders.clip_g.transformer.",
            c => c.prefix(),
        }
    }
}

/// One input: a file (or diffusers folder, or sharded index) and the prefix its tensor
/// names get when they do not already start with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    pub path: PathBuf,
    pub prefix: String,
}

impl ModelSource {
    pub fn new(path: impl Into<PathBuf>, prefix: impl Into<String>) -> Self {
        ModelSource { path: path.into(), prefix: prefix.into() }
    }

    /// A component file with the reference's prefix for it.
    pub fn component(kind: Component, path: impl Into<PathBuf>) -> Self {
        Self::new(path, kind.prefix())
    }

    /// A component file with the prefix `convert` gives it.
    pub fn for_convert(kind: Component, path: impl Into<PathBuf>) -> Self {
        Self::new(path, kind.convert_prefix())
    }
}

/// Parts of a model, for counting weight types like the reference's `get_*_wtype_stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelPart {
    All,
    Conditioner,
    DiffusionModel,
    Vae,
}

/// Names the reference never loads (training state, buffers recomputed at run time).
const UNUSED_TENSOR_PREFIXES: &[&str] = &[
    "betas",
    "alphas_cumprod_prev",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
    "cond_stage_model.transformer.text_model.embeddings.position_ids",
    "cond_stage_model.1.model.text_model.embeddings.position_ids",
    "cond_stage_model.transformer.vision_model.embeddings.position_ids",
    "cond_stage_model.model.logit_scale",
    "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
    "conditioner.embedders.0.model.logit_scale",
    "conditioner.embedders.1.model.logit_scale",
    "model.diffusion_model.time_embedding.cond_proj.weight",
    "unet.time_embedding.cond_proj.weight",
    "model_ema.decay",
    "model_ema.num_updates",
    "model_ema.diffusion_model",
    "embedding_manager",
    "denoiser.sigmas",
    "text_encoders.t5xxl.transformer.encoder.embed_tokens.weight",
    "ztsnr",
    "edm_vpred.sigma_min",
    "text_encoders.llm.output.weight",
    "text_encoders.llm.lm_head.",
];

/// True for tensors the reference skips when it lists a file.
pub fn is_unused_tensor(name: &str) -> bool {
    UNUSED_TENSOR_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// What identifies the contents of a file we opened: its size and modification time, and
/// which file (device, inode) it is. A file rewritten, truncated or extended after we read
/// its header has another size or time; one replaced by rename, or removed, is another
/// file (or none) at its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    id: Option<(u64, u64)>,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        #[cfg(unix)]
        let id = {
            use std::os::unix::fs::MetadataExt;
            Some((meta.dev(), meta.ino()))
        };
        #[cfg(not(unix))]
        let id = None;
        Stamp { len: meta.len(), modified: meta.modified().ok(), id }
    }

    /// How `now` differs from the stamp taken at open, in words (None: unchanged).
    fn change(&self, now: &Stamp) -> Option<String> {
        if now.id != self.id {
            Some("it was replaced by another file".into())
        } else if now.len != self.len {
            Some(format!("size {} -> {} bytes", self.len, now.len))
        } else if now.modified != self.modified {
            Some("it was modified".into())
        } else {
            None
        }
    }
}

/// One opened file. Data is read lazily; the file's [`Stamp`] is remembered so that a file
/// changed behind our back is an error rather than garbage (or a crash: see `validate`).
struct ModelFile {
    path: PathBuf,
    format: FileFormat,
    len: u64,
    stamp: Stamp,
    /// Every read goes through this handle, so the header we parsed and the data we read
    /// come from the same file even if the path is later made to name another one.
    handle: File,
    map: OnceCell<Option<std::sync::Arc<memmap2::Mmap>>>,
    zip: Mutex<Option<zip::ZipArchive<File>>>,
}

impl ModelFile {
    fn open(path: &Path, format: FileFormat) -> Result<(Self, File)> {
        let f = File::open(path).with_context(|| format!("failed to open '{}'", path.display()))?;
        let meta = f.metadata().with_context(|| format!("failed to stat '{}'", path.display()))?;
        let mf = ModelFile {
            path: path.to_path_buf(),
            format,
            len: meta.len(),
            stamp: Stamp::of(&meta),
            handle: f.try_clone().with_context(|| format!("failed to open '{}'", path.display()))?,
            map: OnceCell::new(),
            zip: Mutex::new(None),
        };
        Ok((mf, f))
    }

    fn changed(&self, how: &str) -> Error {
        Error::new(format!(
            "model file '{}' changed since it was opened ({how}); create the context again to use the new file",
            self.path.display()
        ))
    }

    /// The open file's size and time are still those we read its header with (one
    /// `fstat`, done before every read).
    fn check_unchanged(&self) -> Result<()> {
        let meta = self.handle.metadata().with_context(|| format!("failed to stat '{}'", self.path.display()))?;
        match self.stamp.change(&Stamp::of(&meta)) {
            Some(how) => Err(self.changed(&how)),
            None => Ok(()),
        }
    }

    /// [`check_unchanged`](Self::check_unchanged), and the path still names this file.
    fn validate(&self) -> Result<()> {
        self.check_unchanged()?;
        match std::fs::metadata(&self.path) {
            Ok(meta) => match self.stamp.change(&Stamp::of(&meta)) {
                Some(how) => Err(self.changed(&how)),
                None => Ok(()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(self.changed("it was removed")),
            Err(e) => Err(self.changed(&format!("cannot stat it: {e}"))),
        }
    }

    /// Whether loaded weights compute from this file's mapping in place (a clone of it is
    /// held outside this set), so that the file is read again at every use.
    fn mapped_in_use(&self) -> bool {
        self.map.get().and_then(Option::as_ref).is_some_and(|m| std::sync::Arc::strong_count(m) > 1)
    }

    fn mapping(&self) -> Result<Option<&std::sync::Arc<memmap2::Mmap>>> {
        self.check_unchanged()?;
        let map = self.map.get_or_init(|| {
            // SAFETY: the mapping is read-only and private to us. A file truncated while it
            // is mapped faults whoever touches the lost pages (SIGBUS): we only map files
            // whose weights are computed from in place, check the file before each load and
            // generation (`ModelFiles::validate`), and DESIGN.md tells users not to modify
            // model files in use; every mmap-based loader has to accept this.
            match unsafe { memmap2::Mmap::map(&self.handle) } {
                Ok(m) if m.len() as u64 == self.len => {
                    sd_info!("using mmap for '{}'", self.path.display());
                    Some(std::sync::Arc::new(m))
                }
                _ => {
                    sd_warn!("failed to memory-map '{}' (falling back to read())", self.path.display());
                    None
                }
            }
        });
        Ok(map.as_ref())
    }

    /// Copies are read with `pread`, never through the mapping: a file truncated meanwhile
    /// is then a read error, not a fault.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= self.len);
        ensure!(end.is_some(), "'{}': read of {} bytes at {} is beyond the end of the file", self.path.display(), buf.len(), offset);
        self.check_unchanged()?;
        read_exact_at(&self.handle, buf, offset).with_context(|| format!("read tensor data failed: '{}'", self.path.display()))?;
        // A file shrunk during the read failed above; one rewritten in place is caught here.
        self.check_unchanged()
    }

    fn read_zip(&self, entry: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_unchanged()?;
        let mut guard = self.zip.lock();
        if guard.is_none() {
            let f = self.handle.try_clone()?;
            *guard = Some(zip::ZipArchive::new(f).map_err(|e| Error::new(format!("'{}': {e}", self.path.display())))?);
        }
        let zip = guard.as_mut().expect("opened above");
        torch::read_zip_range(zip, entry, offset, buf).map_err(|e| Error::new(format!("'{}': {e}", self.path.display())))?;
        self.check_unchanged()
    }
}

#[cfg(unix)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(f: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match f.seek_read(buf, offset) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What a path holds, judged from its first bytes (and its name for indexes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Detected {
    Diffusers,
    Index,
    File(FileFormat),
}

fn detect(path: &Path) -> Result<Detected> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!("file '{}' not found", path.display()),
        Err(e) => bail!("failed to open '{}': {}", path.display(), e),
    };
    if meta.is_dir() {
        return Ok(Detected::Diffusers);
    }
    let mut head = Vec::with_capacity(512);
    File::open(path)
        .with_context(|| format!("failed to open '{}'", path.display()))?
        .take(512)
        .read_to_end(&mut head)
        .with_context(|| format!("failed to read '{}'", path.display()))?;
    let name = path.to_string_lossy().to_ascii_lowercase();
    Ok(if head.starts_with(gguf::MAGIC) {
        Detected::File(FileFormat::Gguf)
    } else if name.ends_with(".json") {
        Detected::Index
    } else if safetensors::probe(&head, meta.len()) || name.ends_with(".safetensors") {
        Detected::File(FileFormat::Safetensors)
    } else if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        Detected::File(FileFormat::TorchZip)
    } else if head.first() == Some(&0x80) || name.ends_with(".pt") || name.ends_with(".pth") || name.ends_with(".ckpt") {
        Detected::File(FileFormat::TorchLegacy)
    } else if name.ends_with(".gguf") {
        Detected::File(FileFormat::Gguf)
    } else {
        bail!("unknown format {}", path.display())
    })
}

/// Everything a file added to a [`ModelFiles`]; committed only when the whole input
/// (all shards, every part of a diffusers folder) was read.
#[derive(Default)]
struct Staged {
    files: Vec<ModelFile>,
    tensors: Vec<TensorStorage>,
    metadata: BTreeMap<String, String>,
}

/// Per-column importances of a weight for quantization (an importance matrix), looked up by
/// the weight's internal name; empty when it has none.
pub type Importance = std::sync::Arc<dyn Fn(&str) -> Vec<f32> + Send + Sync>;

/// The tensors of one or more model files, by name, in the order the reference lists
/// them; a later file's tensor replaces an earlier one of the same name in place.
#[derive(Default)]
pub struct ModelFiles {
    files: Vec<ModelFile>,
    tensors: Vec<TensorStorage>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
    mmap: bool,
    importance: Option<Importance>,
    /// The version names are converted with to look up importances (detected once).
    importance_version: OnceCell<Option<SdVersion>>,
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles")
            .field("files", &self.files.iter().map(|m| &m.path).collect::<Vec<_>>())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl ModelFiles {
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens every source in order (see [`add`](Self::add)).
    pub fn open(sources: &[ModelSource]) -> Result<Self> {
        let mut m = Self::new();
        for s in sources {
            m.add_source(s)?;
        }
        Ok(m)
    }

    pub fn add_source(&mut self, source: &ModelSource) -> Result<()> {
        self.add(&source.path, &source.prefix)
    }

    /// Lists the tensors of a file, a diffusers folder or a sharded-safetensors index,
    /// prefixing names that do not start with `prefix`. On error nothing is added.
    pub fn add(&mut self, path: impl AsRef<Path>, prefix: &str) -> Result<()> {
        let path = path.as_ref();
        let mut staged = Staged::default();
        match detect(path)? {
            Detected::Diffusers => {
                sd_info!("load {} using diffusers format", path.display());
                self.stage_diffusers(path, &mut staged)?;
            }
            Detected::Index => {
                sd_info!("load {} using safetensors index format", path.display());
                for shard in safetensors::read_index(path)? {
                    let fmt = match detect(&shard)? {
                        Detected::File(f) => f,
                        _ => bail!("'{}': shard '{}' is not a model file", path.display(), shard.display()),
                    };
                    self.stage_file(&shard, prefix, fmt, &mut staged)?;
                }
            }
            Detected::File(fmt) => {
                sd_info!("load {} using {} format", path.display(), fmt.name());
                self.stage_file(path, prefix, fmt, &mut staged)?;
            }
        }
        self.commit(staged);
        Ok(())
    }

    fn stage_diffusers(&self, dir: &Path, staged: &mut Staged) -> Result<()> {
        let unet = dir.join("unet/diffusion_pytorch_model.safetensors");
        self.stage_file(&unet, "unet.", FileFormat::Safetensors, staged)
            .with_context(|| format!("'{}' is not a diffusers folder with a unet", dir.display()))?;
        let optional = [
            ("vae/diffusion_pytorch_model.safetensors", "vae.", "VAE"),
            ("text_encoder/model.safetensors", "te.", "text encoder"),
            ("text_encoder_2/model.safetensors", "te.1.", "second text encoder"),
        ];
        for (rel, prefix, what) in optional {
            let p = dir.join(rel);
            let mut part = Staged { files: Vec::new(), tensors: Vec::new(), metadata: BTreeMap::new() };
            // File indexes continue after what is already staged.
            let base = staged.files.len();
            match self.stage_file_at(&p, prefix, FileFormat::Safetensors, &mut part, base) {
                Ok(()) => {
                    staged.files.append(&mut part.files);
                    staged.tensors.append(&mut part.tensors);
                    staged.metadata.append(&mut part.metadata);
                }
                Err(e) if what == "second text encoder" => sd_debug!("Couldn't find working {} in {}: {}", what, dir.display(), e),
                Err(e) => sd_warn!("Couldn't find working {} in {}: {}", what, dir.display(), e),
            }
        }
        Ok(())
    }

    fn stage_file(&self, path: &Path, prefix: &str, fmt: FileFormat, staged: &mut Staged) -> Result<()> {
        let base = staged.files.len();
        self.stage_file_at(path, prefix, fmt, staged, base)
    }

    fn stage_file_at(&self, path: &Path, prefix: &str, fmt: FileFormat, staged: &mut Staged, base: usize) -> Result<()> {
        sd_debug!("init from '{}', prefix = '{}'", path.display(), prefix);
        let what = path.display().to_string();
        let (mf, f) = ModelFile::open(path, fmt)?;
        let len = mf.len;
        let mut metadata = BTreeMap::new();
        let tensors = match fmt {
            FileFormat::Safetensors => {
                let st = safetensors::read(&mut BufReader::new(f), len, &what)?;
                metadata = st.metadata;
                st.tensors
            }
            FileFormat::Gguf => gguf::read(&mut BufReader::with_capacity(1 << 16, f), len, &what)?.tensors,
            FileFormat::TorchZip => torch::read_zip(BufReader::new(f), len, &what)?,
            FileFormat::TorchLegacy => torch::read_legacy(&mut BufReader::new(f), len, &what)?,
        };
        let file_index = self.files.len() + base;
        for mut ts in tensors {
            if is_unused_tensor(ts.name()) {
                continue;
            }
            if !ts.name().starts_with(prefix) {
                ts.set_name(format!("{prefix}{}", ts.name()));
            }
            ts.file_index = file_index;
            staged.tensors.push(ts);
        }
        staged.metadata.append(&mut metadata);
        staged.files.push(mf);
        Ok(())
    }

    fn commit(&mut self, staged: Staged) {
        self.files.extend(staged.files);
        let mut metadata = staged.metadata;
        self.metadata.append(&mut metadata);
        for ts in staged.tensors {
            self.insert(ts);
        }
    }

    fn insert(&mut self, ts: TensorStorage) {
        self.importance_version = OnceCell::new();
        match self.index.get(ts.name()) {
            Some(&i) => self.tensors[i] = ts,
            None => {
                self.index.insert(ts.name().to_string(), self.tensors.len());
                self.tensors.push(ts);
            }
        }
    }

    /// Lets tensors stored in the type wanted be used from a memory map of their file in
    /// place ([`shared_mapping`](Self::shared_mapping)); copies are always read with `read()`.
    pub fn set_mmap(&mut self, enable: bool) {
        self.mmap = enable;
    }

    /// All tensors, in listing order.
    pub fn tensors(&self) -> &[TensorStorage] {
        &self.tensors
    }

    pub fn get(&self, name: &str) -> Option<&TensorStorage> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// String metadata of the safetensors files (later files win).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The files opened, in order, with their formats.
    pub fn files(&self) -> Vec<(&Path, FileFormat)> {
        self.files.iter().map(|f| (f.path.as_path(), f.format)).collect()
    }

    /// Fails, naming the file, when any file changed since it was opened: rewritten,
    /// truncated, extended, replaced or removed. Reads check their own file too; this is
    /// for the start of a pass over many tensors.
    pub fn validate(&self) -> Result<()> {
        self.files.iter().try_for_each(ModelFile::validate)
    }

    /// [`validate`](Self::validate) for the files that loaded weights still compute from
    /// (mapped in place): the only ones read after loading. A truncated one would fault the
    /// next computation, so a generation checks them first.
    pub fn validate_in_use(&self) -> Result<()> {
        self.files.iter().filter(|f| f.mapped_in_use()).try_for_each(ModelFile::validate)
    }

    /// Removes tensors for which `keep` returns false.
    pub fn retain(&mut self, mut keep: impl FnMut(&TensorStorage) -> bool) {
        self.tensors.retain(|t| keep(t));
        self.reindex();
    }

    fn reindex(&mut self) {
        self.index = self.tensors.iter().enumerate().map(|(i, t)| (t.name().to_string(), i)).collect();
    }

    /// The model family, decided from names and shapes like the reference does.
    pub fn detect_version(&self) -> Option<SdVersion> {
        version::detect(&self.tensors)
    }

    /// Renames every tensor to the internal naming (see [`names::convert_tensor_name`]),
    /// for `version` or, if `None`, the detected one. Two tensors that map to the same name
    /// keep the first one's position and the last one's data, like the reference.
    pub fn convert_names(&mut self, version: Option<SdVersion>) {
        let version = version.or_else(|| self.detect_version());
        let old = std::mem::take(&mut self.tensors);
        self.index.clear();
        for mut ts in old {
            let new = names::convert_tensor_name(ts.name(), version);
            ts.set_name(new);
            self.insert(ts);
        }
    }

    /// Counts tensors per type in a part of the model, skipping unused tensors.
    pub fn type_stats(&self, part: ModelPart) -> Vec<(SdType, usize)> {
        let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
        for ts in &self.tensors {
            let n = ts.name();
            let keep = match part {
                ModelPart::All => true,
                ModelPart::Conditioner => {
                    n.contains("text_encoders")
                        || n.contains("cond_stage_model")
                        || n.contains("te.text_model.")
                        || n.contains("conditioner")
                }
                ModelPart::DiffusionModel => n.contains("model.diffusion_model.") || n.contains("unet."),
                ModelPart::Vae => n.contains("vae.") || n.contains("first_stage_model"),
            };
            if keep && !is_unused_tensor(n) {
                *counts.entry(ts.ty().raw()).or_default() += 1;
            }
        }
        counts.into_iter().filter_map(|(t, c)| SdType::from_raw(t).map(|t| (t, c))).collect()
    }

    /// Reads `ts` (one of this set's storages) into `dst` as type `ty`; `dst` must be
    /// exactly the tensor's size in that type. Safe to call from several threads.
    pub fn read_tensor(&self, ts: &TensorStorage, ty: SdType, dst: &mut [u8]) -> Result<()> {
        let file = self.files.get(ts.file_index).ok_or_else(|| Error::new(format!("tensor '{}' has no file", ts.name())))?;
        self.read_tensor_inner(file, ts, ty, dst)
            .map_err(|e| Error::new(format!("load tensor '{}' from '{}' failed: {e}", ts.name(), file.path.display())))
    }

    fn read_tensor_inner(&self, file: &ModelFile, ts: &TensorStorage, ty: SdType, dst: &mut [u8]) -> Result<()> {
        let (row, nrows) = ts.rows();
        let want = ts.nbytes_as(ty).ok_or_else(|| {
            Error::new(format!("its rows of {} elements cannot be stored as {}", row, ty.name()))
        })?;
        ensure!(dst.len() as u64 == want, "destination has {} bytes, {} as {} needs {}", dst.len(), ts.describe(), ty.name(), want);
        dtype::check_conversion(ts.ty(), ty, row)?;
        if ts.source() == SourceDtype::Native && ts.ty() == ty {
            return self.read_raw(file, ts, dst);
        }
        let mut raw = vec![0u8; ts.file_nbytes() as usize];
        self.read_raw(file, ts, &mut raw)?;
        let stored = if ts.source() == SourceDtype::Native {
            raw
        } else {
            let mut s = vec![0u8; ts.nbytes() as usize];
            dtype::decode_source(ts.source(), &raw, &mut s)?;
            s
        };
        if ts.ty() == ty {
            dst.copy_from_slice(&stored);
            return Ok(());
        }
        // Like the reference, the importances are looked up under the converted name of the
        // stored name (whether or not the names were converted already).
        let importance = match &self.importance {
            Some(lookup) if dtype::is_quantized(ty) => {
                let version = *self.importance_version.get_or_init(|| self.detect_version());
                lookup(&names::convert_tensor_name(ts.name(), version))
            }
            _ => Vec::new(),
        };
        dtype::convert_rows_weighted(&stored, ts.ty(), dst, ty, nrows, row, &importance)
    }

    /// Quantizations made by [`read_tensor`](Self::read_tensor) weigh each column by
    /// `importance` (an importance matrix) instead of equally.
    pub fn set_importance(&mut self, importance: Option<Importance>) {
        self.importance = importance;
    }

    /// Whether `ts` is stored in its file exactly as `ty` (native dtype, not compressed in
    /// a zip): its bytes can then be read in pieces with [`read_tensor_bytes`](Self::read_tensor_bytes).
    pub fn stored_as(&self, ts: &TensorStorage, ty: SdType) -> bool {
        ts.source() == SourceDtype::Native && ts.zip_entry.is_none() && ts.ty() == ty && self.files.get(ts.file_index).is_some()
    }

    /// Bytes `start..start + dst.len()` of a tensor [`stored_as`](Self::stored_as) `ty`: what
    /// [`read_tensor`](Self::read_tensor) writes there, read by the caller's threads in pieces.
    pub fn read_tensor_bytes(&self, ts: &TensorStorage, ty: SdType, start: u64, dst: &mut [u8]) -> Result<()> {
        let file = self.files.get(ts.file_index).ok_or_else(|| Error::new(format!("tensor '{}' has no file", ts.name())))?;
        let whole = ts.nbytes_as(ty);
        let fits = start.checked_add(dst.len() as u64).zip(whole).is_some_and(|(end, n)| end <= n);
        let result = if !self.stored_as(ts, ty) {
            Err(Error::new(format!("{} is not stored as {}", ts.describe(), ty.name())))
        } else if !fits {
            Err(Error::new(format!("bytes {start}..+{} are outside {} as {}", dst.len(), ts.describe(), ty.name())))
        } else {
            file.read_at(ts.offset + start, dst)
        };
        result.map_err(|e| Error::new(format!("load tensor '{}' from '{}' failed: {e}", ts.name(), file.path.display())))
    }

    fn read_raw(&self, file: &ModelFile, ts: &TensorStorage, buf: &mut [u8]) -> Result<()> {
        match ts.zip_entry {
            Some(entry) => file.read_zip(entry, ts.offset, buf),
            None => file.read_at(ts.offset, buf),
        }
    }

    /// The whole mapping of the file holding `ts` and the tensor's offset in it, when its
    /// stored bytes are already `ty` (mmap on, native dtype, not compressed in a zip): a
    /// CPU backend can compute from them directly. The mapping lives as long as any clone.
    pub fn shared_mapping(&self, ts: &TensorStorage, ty: SdType) -> Result<Option<(std::sync::Arc<memmap2::Mmap>, usize)>> {
        if !self.mmap || ts.source() != SourceDtype::Native || ts.zip_entry.is_some() || ts.ty() != ty {
            return Ok(None);
        }
        let Some(file) = self.files.get(ts.file_index) else { return Ok(None) };
        let Some(m) = file.mapping()? else { return Ok(None) };
        let start = ts.offset as usize;
        let fits = start.checked_add(ts.nbytes() as usize).is_some_and(|end| end <= m.len());
        Ok(fits.then(|| (m.clone(), start)))
    }

    /// Reads a tensor by name as f32 values.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let ts = self.get(name).ok_or_else(|| Error::new(format!("tensor '{name}' not found")))?;
        let mut buf = vec![0u8; ts.nelements() as usize * 4];
        self.read_tensor(ts, SdType::F32, &mut buf)?;
        Ok(dtype::f32_values(&buf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{gguf, safetensors, torch};

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let p = std::env::temp_dir().join(format!("sd-io-{tag}-{}-{:?}", std::process::id(), std::thread::current().id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        fn write(&self, name: &str, b: &[u8]) -> PathBuf {
            let p = self.0.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b).unwrap();
            p
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn f16(v: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; v.len() * 2];
        dtype::convert_rows(
            &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>(),
            SdType::F32,
            &mut out,
            SdType::F16,
            1,
            v.len() as u64,
        )
        .unwrap();
        out
    }

    fn st_file(names: &[&str]) -> Vec<u8> {
        // each tensor: f16 [2, 32] with values i/8
        let vals: Vec<f32> = (0..64).map(|i| i as f32 / 8.0).collect();
        let mut header = String::from("{");
        let mut data = Vec::new();
        for (i, n) in names.iter().enumerate() {
            if i > 0 {
                header.push(',');
            }
            header.push_str(&format!(
                r#""{n}":{{"dtype":"F16","shape":[2,32],"data_offsets":[{},{}]}}"#,
                data.len(),
                data.len() + 128
            ));
            data.extend(f16(&vals));
        }
        header.push_str(r#","__metadata__":{"modelspec.title":"t"}}"#);
        safetensors::tests::file(&header, &data)
    }

    #[test]
    fn safetensors_read_and_convert() {
        let d = TempDir::new("st");
        let p = d.write("m.safetensors", &st_file(&["w", "betas"]));
        for mmap in [false, true] {
            let mut m = ModelFiles::new();
            m.set_mmap(mmap);
            m.add(&p, "model.").unwrap();
            assert_eq!(m.len(), 1, "unused tensors are skipped");
            let ts = m.get("model.w").unwrap().clone();
            assert_eq!(m.read_f32("model.w").unwrap()[9], 9.0 / 8.0);
            let mut q = vec![0u8; 68];
            m.read_tensor(&ts, SdType::Q8_0, &mut q).unwrap();
            let mut bf = vec![0u8; 128];
            m.read_tensor(&ts, SdType::Bf16, &mut bf).unwrap();
            assert!(m.read_tensor(&ts, SdType::F32, &mut bf).unwrap_err().to_string().contains("destination has 128 bytes"));
            assert!(m.read_tensor(&ts, SdType::Q4K, &mut q).unwrap_err().to_string().contains("cannot be stored as q4_K"));
            assert_eq!(m.shared_mapping(&ts, ts.ty()).unwrap().is_some(), mmap);
            assert!(m.shared_mapping(&ts, SdType::Q8_0).unwrap().is_none(), "a converted type is never mapped");
            assert_eq!(m.metadata()["modelspec.title"], "t");
            // Read in pieces, a tensor stored as it is wanted gives the bytes read_tensor does.
            let mut whole = vec![0u8; 128];
            m.read_tensor(&ts, SdType::F16, &mut whole).unwrap();
            assert!(m.stored_as(&ts, SdType::F16) && !m.stored_as(&ts, SdType::Bf16));
            let mut pieces = vec![0u8; 128];
            for (i, piece) in pieces.chunks_mut(48).enumerate() {
                m.read_tensor_bytes(&ts, SdType::F16, 48 * i as u64, piece).unwrap();
            }
            assert_eq!(pieces, whole);
            assert!(m.read_tensor_bytes(&ts, SdType::F16, 100, &mut [0u8; 29]).is_err(), "past the tensor's end");
            assert!(m.read_tensor_bytes(&ts, SdType::Bf16, 0, &mut [0u8; 8]).is_err(), "needs a conversion");
        }
    }

    #[test]
    fn later_files_override_and_prefixes() {
        let d = TempDir::new("ovr");
        let a = d.write("a.safetensors", &st_file(&["first_stage_model.x", "model.diffusion_model.y"]));
        let b = d.write("b.safetensors", &st_file(&["x"]));
        let m = ModelFiles::open(&[
            ModelSource::component(Component::Model, &a),
            ModelSource::new(&b, "first_stage_model."),
        ])
        .unwrap();
        let names: Vec<_> = m.tensors().iter().map(|t| t.name()).collect();
        assert_eq!(names, ["first_stage_model.x", "model.diffusion_model.y"]);
        assert_eq!(m.get("first_stage_model.x").unwrap().file_index(), 1);
        assert_eq!(m.files().len(), 2);
    }

    #[test]
    fn all_formats_read_the_same_values() {
        let d = TempDir::new("fmt");
        let zip = d.write("m.ckpt", &torch::tests::zip_file(zip::CompressionMethod::Stored));
        let zipd = d.write("md.pt", &torch::tests::zip_file(zip::CompressionMethod::Deflated));
        let leg = d.write("m.pt", &torch::tests::legacy_file());
        for p in [&zip, &zipd, &leg] {
            let m = ModelFiles::open(&[ModelSource::new(p, "")]).unwrap();
            assert_eq!(m.read_f32("b").unwrap(), vec![1.0, 2.0, 3.0, 4.0], "{}", p.display());
            let a = m.read_f32("a").unwrap();
            assert_eq!(a[0], 1.0);
            assert_eq!(m.get("a").unwrap().shape(), &[3, 2]);
        }
        let data: Vec<u8> = f16(&[0.5; 64]);
        let g = d.write("m.gguf", &gguf::tests::file(3, &[], &[("w", &[32, 2], 1, 0)], &data));
        let m = ModelFiles::open(&[ModelSource::new(&g, "x.")]).unwrap();
        assert_eq!(m.read_f32("x.w").unwrap(), vec![0.5; 64]);
    }

    #[test]
    fn sharded_and_diffusers() {
        let d = TempDir::new("shard");
        d.write("s1.safetensors", &st_file(&["a"]));
        d.write("s2.safetensors", &st_file(&["b"]));
        let idx = d.write("m.safetensors.index.json", br#"{"weight_map":{"b":"s2.safetensors","a":"s1.safetensors"}}"#);
        let m = ModelFiles::open(&[ModelSource::new(&idx, "p.")]).unwrap();
        assert_eq!(m.tensors().iter().map(|t| t.name()).collect::<Vec<_>>(), ["p.a", "p.b"]);
        assert_eq!(m.read_f32("p.b").unwrap()[1], 0.125);
        // a missing shard fails the whole index and adds nothing
        let idx2 = d.write("n.safetensors.index.json", br#"{"weight_map":{"a":"s1.safetensors","z":"gone.safetensors"}}"#);
        let mut m = ModelFiles::new();
        assert!(m.add(&idx2, "").unwrap_err().to_string().contains("not found"));
        assert!(m.is_empty());

        let df = TempDir::new("diff");
        df.write("unet/diffusion_pytorch_model.safetensors", &st_file(&["conv_in.weight"]));
        df.write("text_encoder/model.safetensors", &st_file(&["text_model.x"]));
        let m = ModelFiles::open(&[ModelSource::new(&df.0, "")]).unwrap();
        let names: Vec<_> = m.tensors().iter().map(|t| t.name()).collect();
        assert_eq!(names, ["unet.conv_in.weight", "te.text_model.x"]);
        assert_eq!(m.read_f32("te.text_model.x").unwrap().len(), 64);
        let empty = TempDir::new("diff2");
        assert!(ModelFiles::open(&[ModelSource::new(&empty.0, "")]).unwrap_err().to_string().contains("diffusers"));
    }

    #[test]
    fn changed_and_bad_files() {
        let d = TempDir::new("chg");
        let p = d.write("m.safetensors", &st_file(&["w"]));
        let m = ModelFiles::open(&[ModelSource::new(&p, "")]).unwrap();
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        std::io::Write::write_all(&mut f, b"xx").unwrap();
        drop(f);
        let e = m.read_f32("w").unwrap_err().to_string();
        assert!(e.contains("changed since it was opened") && e.contains("'w'"), "{e}");

        let e = ModelFiles::open(&[ModelSource::new(d.0.join("nope.safetensors"), "")]).unwrap_err().to_string();
        assert!(e.contains("not found"), "{e}");
        let junk = d.write("junk.bin", b"hello world, not a model");
        assert!(ModelFiles::open(&[ModelSource::new(&junk, "")]).unwrap_err().to_string().contains("unknown format"));
        let trunc = d.write("t.safetensors", &st_file(&["w"])[..100]);
        let e = ModelFiles::open(&[ModelSource::new(&trunc, "")]).unwrap_err().to_string();
        assert!(e.contains("t.safetensors"), "{e}");
    }

    /// A file changed after `open` is a clean error naming it, at the next read and at
    /// `validate`; never a fault, also with mmap on.
    #[test]
    fn files_changed_after_open_are_clean_errors() {
        let d = TempDir::new("val");
        let bytes = st_file(&["w", "v"]);
        let open = |p: &Path, mmap: bool| {
            let mut m = ModelFiles::new();
            m.set_mmap(mmap);
            m.add(p, "").unwrap();
            m
        };
        let set_time = |p: &Path, t: SystemTime| std::fs::File::options().write(true).open(p).unwrap().set_modified(t).unwrap();
        let epoch = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
        for mmap in [false, true] {
            // Truncated: reads and validation fail, also after the file was mapped.
            let p = d.write("t.safetensors", &bytes);
            let m = open(&p, mmap);
            m.validate().unwrap();
            let ts = m.get("w").unwrap().clone();
            let mapped = m.shared_mapping(&ts, ts.ty()).unwrap();
            assert_eq!(mapped.is_some(), mmap);
            m.validate_in_use().unwrap();
            std::fs::File::options().write(true).open(&p).unwrap().set_len(bytes.len() as u64 - 100).unwrap();
            for e in [m.validate().unwrap_err(), m.read_f32("v").unwrap_err()] {
                let e = e.to_string();
                assert!(e.contains("t.safetensors' changed since it was opened") && e.contains("-> "), "{e}");
            }
            // A mapping in use is what a generation must check first; unused ones not.
            assert_eq!(m.validate_in_use().is_err(), mmap);
            drop(mapped);
            m.validate_in_use().unwrap();

            // Rewritten in place with the same size: only the time tells.
            let p = d.write("r.safetensors", &bytes);
            set_time(&p, epoch);
            let m = open(&p, mmap);
            let mut other = bytes.clone();
            *other.last_mut().unwrap() ^= 1;
            std::fs::write(&p, &other).unwrap();
            set_time(&p, epoch + std::time::Duration::from_secs(1));
            let e = m.read_f32("v").unwrap_err().to_string();
            assert!(e.contains("r.safetensors' changed since it was opened (it was modified)"), "{e}");

            // Replaced by rename, or removed: reads still see the opened file, validation
            // (the start of every load) refuses.
            let p = d.write("n.safetensors", &bytes);
            let m = open(&p, mmap);
            let tmp = d.write("n.tmp", &bytes);
            std::fs::rename(&tmp, &p).unwrap();
            assert_eq!(m.read_f32("w").unwrap()[9], 9.0 / 8.0);
            let e = m.validate().unwrap_err().to_string();
            assert!(e.contains("n.safetensors' changed since it was opened (it was replaced by another file)"), "{e}");
            std::fs::remove_file(&p).unwrap();
            assert!(m.validate().unwrap_err().to_string().contains("(it was removed)"));
        }
    }

    #[test]
    fn stats_and_component_prefixes() {
        assert_eq!(Component::ClipL.prefix(), "clip_l.");
        assert_eq!(Component::ClipL.convert_prefix(), "text_encoders.clip_l.transformer.");
        assert_eq!(Component::T5xxl.prefix(), "text_encoders.t5xxl.transformer.");
        assert!(is_unused_tensor("model_ema.diffusion_modelinput_blocks"));
        let d = TempDir::new("stats");
        let p = d.write("m.safetensors", &st_file(&["model.diffusion_model.a", "first_stage_model.b", "cond_stage_model.c"]));
        let m = ModelFiles::open(&[ModelSource::new(&p, "")]).unwrap();
        assert_eq!(m.type_stats(ModelPart::All), vec![(SdType::F16, 3)]);
        assert_eq!(m.type_stats(ModelPart::Vae), vec![(SdType::F16, 1)]);
    }
}
