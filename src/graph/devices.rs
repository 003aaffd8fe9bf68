//! Device policy in one place: which ggml device each part of a model computes on, where
//! its weights live between uses, memory budgets, and remote (RPC) devices.
//!
//! The spec strings are the reference's (`backend`, `params_backend`, `split_mode`,
//! `max_vram`, `rpc_servers` of `sd_ctx_params_t`): a bare device name applies to every
//! module, `module=DEVICE` entries (comma-separated, module aliases as in the reference's
//! docs/backend.md) override it. Device names resolve like the reference: `auto`/`default`/
//! empty is the best device (GPU, then integrated GPU, then CPU), `gpu` the first GPU, a
//! registry name (`vulkan`, `cuda`, `rpc`) its first device, otherwise the exact device name
//! or a prefix of one, case-insensitively.

use super::backend::{self, Backend, DeviceInfo, DeviceKind};
use crate::error::{Context as _, Result};
use ggml_sys as g;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::sync::Arc;

/// The parts of a generation that get a device of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Module {
    Diffusion,
    Te,
    ClipVision,
    Vae,
    ControlNet,
    PhotoMaker,
    Upscaler,
    Detector,
}

impl Module {
    pub const ALL: [Module; 8] = [
        Module::Diffusion,
        Module::Te,
        Module::ClipVision,
        Module::Vae,
        Module::ControlNet,
        Module::PhotoMaker,
        Module::Upscaler,
        Module::Detector,
    ];

    /// A module by any of its accepted names (case-insensitive, `-` and `_` ignored).
    pub fn parse(key: &str) -> Option<Module> {
        let k: String = key.trim().to_ascii_lowercase().chars().filter(|c| *c != '-' && *c != '_').collect();
        Some(match k.as_str() {
            "diffusion" | "model" | "unet" | "dit" => Module::Diffusion,
            "te" | "clip" | "text" | "textencoder" | "textencoders" | "conditioner" | "cond" | "llm" | "t5" | "t5xxl" => Module::Te,
            "clipvision" | "vision" => Module::ClipVision,
            "vae" | "firststage" | "autoencoder" | "tae" => Module::Vae,
            "controlnet" | "control" => Module::ControlNet,
            "photomaker" | "photomakerid" | "pmid" | "photo" => Module::PhotoMaker,
            "upscaler" | "esrgan" | "hires" => Module::Upscaler,
            "detector" | "adetailer" | "yolo" => Module::Detector,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Module::Diffusion => "diffusion",
            Module::Te => "te",
            Module::ClipVision => "clip_vision",
            Module::Vae => "vae",
            Module::ControlNet => "controlnet",
            Module::PhotoMaker => "photomaker",
            Module::Upscaler => "upscaler",
            Module::Detector => "detector",
        }
    }

    /// Modules whose blocks can be spread over several devices (`diffusion=dev0&dev1`).
    fn can_layer_split(self) -> bool {
        matches!(self, Module::Diffusion | Module::Te)
    }
}

/// A parsed `DEVICE` / `module=DEVICE,...` string.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Assignment {
    default: String,
    modules: HashMap<Module, String>,
}

impl Assignment {
    /// Parses a spec; `what` names the option in errors ("backend", "params_backend", …).
    pub fn parse(spec: Option<&str>, what: &str) -> Result<Assignment> {
        let mut out = Assignment::default();
        for part in spec.unwrap_or("").split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                out.default = part.to_string();
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            ensure!(!key.is_empty() && !value.is_empty(), "{what}: invalid backend assignment '{part}'");
            if matches!(key.to_ascii_lowercase().as_str(), "all" | "default" | "*") {
                out.default = value.to_string();
                continue;
            }
            let module = Module::parse(key).with_context(|| format!("{what}: unknown backend module '{key}'"))?;
            out.modules.insert(module, value.to_string());
        }
        Ok(out)
    }

    /// The value for `module` (its own entry, else the default; empty when neither).
    pub fn get(&self, module: Module) -> &str {
        self.modules.get(&module).unwrap_or(&self.default)
    }

    fn values(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.default.as_str()).chain(self.modules.values().map(String::as_str))
    }
}

fn is_default_token(name: &str) -> bool {
    matches!(name.trim().to_ascii_lowercase().as_str(), "" | "default" | "auto")
}

fn is_disk_token(name: &str) -> bool {
    name.trim().eq_ignore_ascii_case("disk")
}

/// The first device of a kind, in registry order.
fn first_of_kind(list: &[DeviceInfo], kind: DeviceKind) -> Option<String> {
    list.iter().find(|d| d.kind == kind).map(|d| d.name.clone())
}

/// The reference's default device: the first GPU, else the first integrated GPU, else the
/// CPU. `SD_VK_DEVICE=N` picks `VulkanN` when it exists, as in the reference.
fn default_device(list: &[DeviceInfo]) -> Option<String> {
    if let Ok(v) = std::env::var("SD_VK_DEVICE") {
        match v.trim().parse::<u64>() {
            Ok(n) => {
                let want = format!("Vulkan{n}");
                if let Some(d) = list.iter().find(|d| d.name.eq_ignore_ascii_case(&want)) {
                    sd_info!("Selecting {} as main device by env var SD_VK_DEVICE", d.name);
                    return Some(d.name.clone());
                }
                sd_warn!("Device {want} requested by SD_VK_DEVICE was not found. Falling back to the default device.");
            }
            Err(_) => sd_warn!("SD_VK_DEVICE environment variable is not a valid integer ({v}). Falling back to the default device."),
        }
    }
    first_of_kind(list, DeviceKind::Gpu)
        .or_else(|| first_of_kind(list, DeviceKind::IntegratedGpu))
        .or_else(|| first_of_kind(list, DeviceKind::Cpu))
}

/// A device name as the user wrote it → the registry's device name (None: no such device).
pub fn resolve_in(list: &[DeviceInfo], name: &str) -> Option<String> {
    let lower = name.trim().to_ascii_lowercase();
    if is_default_token(&lower) {
        return default_device(list);
    }
    if lower == "gpu" {
        return first_of_kind(list, DeviceKind::Gpu).or_else(|| first_of_kind(list, DeviceKind::IntegratedGpu));
    }
    let registry = if lower == "metal" { "mtl".to_string() } else { lower.clone() };
    if let Some(d) = list.iter().find(|d| d.registry.to_ascii_lowercase() == registry) {
        return Some(d.name.clone());
    }
    if let Some(d) = list.iter().find(|d| d.name.to_ascii_lowercase() == lower) {
        return Some(d.name.clone());
    }
    list.iter().find(|d| d.name.to_ascii_lowercase().starts_with(&lower)).map(|d| d.name.clone())
}

/// [`resolve_in`] over the devices loaded now.
pub fn resolve(name: &str) -> Option<String> {
    resolve_in(&backend::devices(), name)
}

fn device_list(value: &str) -> Vec<&str> {
    value.split('&').map(str::trim).filter(|n| !n.is_empty()).collect()
}

/// Where a module's weights stay between uses.
#[derive(Clone)]
pub enum WeightHome {
    /// On the compute device (the default).
    Compute,
    /// On another backend (`params_backend=cpu`): each phase uploads them to the compute
    /// device and frees the copy afterwards.
    Backend(Arc<Backend>),
    /// Nowhere: read from the model files for each phase and freed after it.
    Disk,
    /// On the compute device once first used: read from the model files at the start of the
    /// first phase and kept (the reference's loading without `eager_load`).
    FirstUse,
}

impl std::fmt::Debug for WeightHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightHome::Compute => write!(f, "compute device"),
            WeightHome::Backend(b) => write!(f, "{}", b.device_name()),
            WeightHome::Disk => write!(f, "disk"),
            WeightHome::FirstUse => write!(f, "compute device, from first use"),
        }
    }
}

/// Where one module computes and keeps its weights.
#[derive(Clone)]
pub struct Placement {
    pub module: Module,
    pub compute: Arc<Backend>,
    /// Further devices of a layer split (`diffusion=dev0&dev1`): the module's weights are
    /// spread over `compute` and these in contiguous ranges; empty normally.
    pub split: Vec<Arc<Backend>>,
    pub weights: WeightHome,
    /// Graph budget in bytes on the compute device (`max_vram`), 0 when off: graphs larger
    /// than this run in segments with each segment's weights uploaded for it.
    pub max_vram: usize,
    /// Keep the weights of leading segments resident between runs (`stream_layers`).
    pub stream_layers: bool,
}

impl Placement {
    /// A placement on one backend with weights on it and no budget (tests, simple callers).
    pub fn on(module: Module, compute: Arc<Backend>) -> Placement {
        Placement { module, compute, split: Vec::new(), weights: WeightHome::Compute, max_vram: 0, stream_layers: false }
    }

    /// This placement, or with `resident` false its weights read from the model files for
    /// each phase and freed at its end (the large text encoders between conditionings).
    pub fn resident_or_per_phase(&self, resident: bool) -> Placement {
        let mut place = self.clone();
        if !resident {
            place.weights = WeightHome::Disk;
        }
        place
    }

    /// This placement, or with `at_first_use` its weights read when first used instead of
    /// at load time, where they would stay on the compute device (no other home, layer
    /// split, budget or streaming).
    pub fn loaded_at_first_use(&self, at_first_use: bool) -> Placement {
        let mut place = self.clone();
        if at_first_use && matches!(place.weights, WeightHome::Compute) && place.split.is_empty() && place.max_vram == 0 && !place.stream_layers {
            place.weights = WeightHome::FirstUse;
        }
        place
    }

    /// The backend a `ParamStore` of this module is allocated on at load time (None: the
    /// weights are read later, per phase with `params_backend=disk`, or at first use).
    pub fn weights_backend(&self) -> Option<&Arc<Backend>> {
        match &self.weights {
            WeightHome::Compute => Some(&self.compute),
            WeightHome::Backend(b) => Some(b),
            WeightHome::Disk | WeightHome::FirstUse => None,
        }
    }

    /// Every compute device (the main one first) and each one's share of a layer split:
    /// its free memory, as the reference sizes the ranges.
    pub fn split_devices(&self) -> (Vec<Arc<Backend>>, Vec<f64>) {
        let devices: Vec<Arc<Backend>> = std::iter::once(self.compute.clone()).chain(self.split.iter().cloned()).collect();
        let shares = devices.iter().map(|b| backend::device_memory(&b.device_name()).0.max(1) as f64).collect();
        (devices, shares)
    }

    /// Whether the weights live somewhere else than the compute device between phases.
    pub fn weights_off_device(&self) -> bool {
        !matches!(self.weights, WeightHome::Compute | WeightHome::FirstUse)
    }

    pub fn describe(&self) -> String {
        let mut s = self.compute.device_name();
        for b in &self.split {
            s.push('&');
            s.push_str(&b.device_name());
        }
        if self.weights_off_device() {
            s.push_str(&format!(", weights on {:?}", self.weights));
        }
        if self.max_vram > 0 {
            s.push_str(&format!(", max_vram {:.2} GiB", self.max_vram as f64 / GIB));
        }
        s
    }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// `max_vram`: a GiB budget for every device, or `DEVICE=GiB` entries; a negative value
/// means "free memory minus that many GiB" (-1 = auto with 1 GiB spare).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct MaxVram {
    default_gib: f32,
    devices: Vec<(String, f32)>,
}

impl MaxVram {
    pub fn parse(spec: Option<&str>) -> Result<MaxVram> {
        let mut out = MaxVram::default();
        let value = |text: &str| -> Result<f32> {
            let v: f32 = text.trim().parse().map_err(|_| crate::error::Error::new(format!("invalid --max-vram value '{text}'")))?;
            ensure!(v.is_finite(), "invalid --max-vram value '{text}'");
            Ok(v)
        };
        for part in spec.unwrap_or("").split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                None => out.default_gib = value(part)?,
                Some((k, v)) => {
                    let (k, v) = (k.trim(), v.trim());
                    ensure!(!k.is_empty() && !v.is_empty(), "invalid --max-vram assignment '{part}'");
                    let gib = value(v)?;
                    if matches!(k.to_ascii_lowercase().as_str(), "all" | "default" | "*") {
                        out.default_gib = gib;
                    } else {
                        out.devices.push((k.to_string(), gib));
                    }
                }
            }
        }
        Ok(out)
    }

    pub fn is_off(&self) -> bool {
        self.default_gib == 0.0 && self.devices.iter().all(|(_, v)| *v == 0.0)
    }

    /// Replaces the device keys by registry names; an unknown device is an error.
    fn canonicalize(&mut self, list: &[DeviceInfo]) -> Result<()> {
        for (key, _) in &mut self.devices {
            *key = resolve_in(list, key).with_context(|| format!("unknown --max-vram backend '{key}'"))?;
        }
        Ok(())
    }

    /// The budget in bytes for a device (0 = no budget).
    pub fn bytes_for(&self, device: &DeviceInfo) -> usize {
        let gib = self.devices.iter().find(|(k, _)| k.eq_ignore_ascii_case(&device.name)).map_or(self.default_gib, |(_, v)| *v);
        if gib >= 0.0 {
            return (gib as f64 * GIB) as usize;
        }
        if device.is_cpu {
            sd_warn!("--max-vram < 0 requested, but the main backend is CPU; disabling graph splitting");
            return 0;
        }
        let spare = (-gib as f64 * GIB) as usize;
        if device.memory_free <= spare {
            sd_warn!(
                "--max-vram < 0 requested, but free VRAM is {:.2} GiB; reserving {:.2} GiB leaves no graph budget",
                device.memory_free as f64 / GIB,
                -gib
            );
            return 0;
        }
        let bytes = device.memory_free - spare;
        sd_info!(
            "--max-vram < 0 auto-detected {:.2} GiB free VRAM ({:.2} GiB total), reserving {:.2} GiB; using {:.2} GiB",
            device.memory_free as f64 / GIB,
            device.memory_total as f64 / GIB,
            -gib,
            bytes as f64 / GIB
        );
        bytes
    }
}

/// The device options of a context, as the C API passes them.
#[derive(Debug, Default, Clone)]
pub struct DeviceOptions<'a> {
    pub backend: Option<&'a str>,
    pub params_backend: Option<&'a str>,
    pub split_mode: Option<&'a str>,
    pub max_vram: Option<&'a str>,
    pub rpc_servers: Option<&'a str>,
    pub stream_layers: bool,
    pub auto_fit: bool,
}

/// The device assignment of one context: parses and checks every option once, initialises
/// each device once (modules on the same device share its backend) and answers where each
/// module goes.
pub struct DeviceMap {
    runtime: Assignment,
    params: Assignment,
    max_vram: MaxVram,
    stream_layers: bool,
    backends: Mutex<HashMap<String, Arc<Backend>>>,
}

impl DeviceMap {
    pub fn new(opts: &DeviceOptions) -> Result<DeviceMap> {
        if let Some(servers) = opts.rpc_servers.filter(|s| !s.trim().is_empty()) {
            add_rpc_servers(servers)?;
        }
        let runtime = Assignment::parse(opts.backend, "backend")?;
        let params = Assignment::parse(opts.params_backend, "params_backend")?;
        let split = Assignment::parse(opts.split_mode, "split_mode")?;
        let mut max_vram = MaxVram::parse(opts.max_vram)?;
        let list = backend::devices();
        for name in runtime.values() {
            if name.contains('&') {
                let names = device_list(name);
                ensure!(!names.is_empty(), "invalid backend device list '{name}'");
                for n in names {
                    ensure!(!is_default_token(n), "default backend token is not allowed in a device list '{name}'");
                    check_runtime_name(&list, n)?;
                }
            } else {
                check_runtime_name(&list, name)?;
            }
        }
        for name in params.values() {
            ensure!(!name.contains('&'), "params_backend does not accept device lists ('{name}')");
            if !is_disk_token(name) {
                check_runtime_name(&list, name)?;
            }
        }
        for mode in split.values() {
            match mode.trim().to_ascii_lowercase().as_str() {
                "" | "layer" => {}
                "row" => sd_warn!("split_mode row is not supported by this build (it needs CUDA split buffers); using layer split"),
                _ => bail!("invalid split mode '{mode}' (expected layer or row)"),
            }
        }
        max_vram.canonicalize(&list)?;
        if opts.auto_fit {
            sd_warn!("auto_fit is not supported by this build; using the backend / params_backend assignments as given");
        }
        let mut stream_layers = opts.stream_layers;
        let map = DeviceMap { runtime, params, max_vram, stream_layers: false, backends: Mutex::new(HashMap::new()) };
        if stream_layers {
            let p = map.placement_inner(Module::Diffusion, false)?;
            if !matches!(&p.weights, WeightHome::Backend(b) if b.is_cpu()) {
                sd_warn!("--stream-layers has no effect unless diffusion params backend is cpu; ignoring");
                stream_layers = false;
            } else if p.max_vram == 0 {
                sd_warn!("--stream-layers has no effect without --max-vram; ignoring");
                stream_layers = false;
            } else {
                sd_warn!("--stream-layers: leading segments' weights stay on the device; prefetching the next segment's weights during compute is not supported yet");
            }
        }
        Ok(DeviceMap { stream_layers, ..map })
    }

    /// The backend of a device (initialised on first use, shared afterwards).
    fn backend(&self, name: &str) -> Result<Arc<Backend>> {
        let resolved = resolve(name).with_context(|| format!("backend '{name}' was not found"))?;
        let key = resolved.to_ascii_lowercase();
        let mut cache = self.backends.lock();
        if let Some(b) = cache.get(&key) {
            return Ok(b.clone());
        }
        let b = Arc::new(Backend::by_name(&resolved)?);
        sd_debug!("initialized backend {resolved}");
        cache.insert(key, b.clone());
        Ok(b)
    }

    /// Every backend initialised so far (to apply per-backend settings once).
    pub fn backends(&self) -> Vec<Arc<Backend>> {
        self.backends.lock().values().cloned().collect()
    }

    /// Where `module` computes and keeps its weights.
    pub fn placement(&self, module: Module) -> Result<Placement> {
        self.placement_inner(module, true)
    }

    fn placement_inner(&self, module: Module, log: bool) -> Result<Placement> {
        let spec = self.runtime.get(module);
        let mut names = device_list(spec);
        if names.is_empty() {
            names.push("");
        }
        let mut devices = Vec::new();
        for n in &names {
            let b = self.backend(n).with_context(|| format!("{} backend", module.name()))?;
            if !devices.iter().any(|d: &Arc<Backend>| Arc::ptr_eq(d, &b)) {
                devices.push(b);
            }
        }
        let compute = devices.remove(0);
        if !devices.is_empty() && !module.can_layer_split() {
            sd_warn!("{} module does not support multiple runtime backends; using {}", module.name(), compute.device_name());
            devices.clear();
        }
        if !devices.is_empty() && (compute.is_cpu() || devices.iter().any(|d| d.is_cpu())) {
            sd_warn!(
                "{}: layer split across a CPU device is not supported; using {} (use --params-backend {}=cpu to keep weights in RAM)",
                module.name(),
                compute.device_name(),
                module.name()
            );
            devices.clear();
        }
        let p = self.params.get(module);
        let weights = if p.trim().is_empty() {
            WeightHome::Compute
        } else if is_disk_token(p) {
            WeightHome::Disk
        } else {
            let home = self.backend(p).with_context(|| format!("{} params backend", module.name()))?;
            if Arc::ptr_eq(&home, &compute) {
                WeightHome::Compute
            } else {
                WeightHome::Backend(home)
            }
        };
        let mut info = backend::devices().into_iter().find(|d| d.name == compute.device_name());
        if let Some(d) = info.as_mut().filter(|d| d.memory_total == 0 && !self.max_vram.is_off()) {
            (d.memory_free, d.memory_total) = backend::device_memory(&d.name);
        }
        let mut max_vram = info.as_ref().map_or(0, |d| self.max_vram.bytes_for(d));
        if max_vram > 0 && (compute.is_cpu() || !devices.is_empty()) {
            if log && !compute.is_cpu() {
                sd_warn!("{}: --max-vram segmenting is not combined with a layer split; ignoring it", module.name());
            }
            max_vram = 0;
        }
        let placement = Placement { module, compute, split: devices, weights, max_vram, stream_layers: self.stream_layers && module == Module::Diffusion };
        if log {
            sd_debug!("{}: {}", module.name(), placement.describe());
        }
        Ok(placement)
    }
}

fn check_runtime_name(list: &[DeviceInfo], name: &str) -> Result<()> {
    if is_default_token(name) {
        return Ok(());
    }
    ensure!(!is_disk_token(name), "backend 'disk' is only supported by params_backend");
    if resolve_in(list, name).is_none() {
        let known: Vec<&str> = list.iter().map(|d| d.name.as_str()).collect();
        bail!("backend '{name}' was not found (devices: {})", known.join(", "));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// RPC

/// The RPC protocol of the pinned ggml (`RPC_PROTO_*_VERSION` in ggml-rpc.h); a unit test
/// checks these against the header.
const RPC_PROTO_MAJOR: u8 = 7;
const RPC_PROTO_MINOR: u8 = 0;
/// `RPC_CMD_HELLO` and the size of its request (`conn_caps`, all zero: plain TCP).
const RPC_CMD_HELLO: u8 = 14;
const RPC_CONN_CAPS: usize = 24;
const RPC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

static RPC_ADDED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// `host:port` endpoints of a `rpc_servers` spec.
pub fn parse_rpc_servers(spec: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for ep in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (host, port) = ep.rsplit_once(':').with_context(|| format!("invalid RPC server '{ep}' (expected host:port)"))?;
        ensure!(!host.is_empty(), "invalid RPC server '{ep}' (expected host:port)");
        let port: u16 = port.parse().ok().filter(|p| *p > 0).with_context(|| format!("invalid port in RPC server '{ep}'"))?;
        let _ = port;
        out.push(ep.to_string());
    }
    ensure!(!out.is_empty(), "invalid RPC servers specification: '{spec}'");
    Ok(out)
}

/// Says hello to an rpc-server the way ggml's client does and checks its protocol version,
/// so that a host that is down, busy or of another version is an error naming it (ggml's
/// client aborts the process in those cases).
pub fn probe_rpc_server(endpoint: &str) -> Result<(u8, u8, u8)> {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let addrs: Vec<_> = endpoint
        .to_socket_addrs()
        .map_err(|e| crate::error::Error::new(format!("RPC server {endpoint}: cannot resolve the address: {e}")))?
        .collect();
    let mut last = None;
    let mut stream = None;
    for a in &addrs {
        match std::net::TcpStream::connect_timeout(a, RPC_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut s = stream.with_context(|| {
        format!("RPC server {endpoint} is not reachable: {}", last.map_or("no address".to_string(), |e| e.to_string()))
    })?;
    let _ = s.set_read_timeout(Some(RPC_TIMEOUT));
    let _ = s.set_write_timeout(Some(RPC_TIMEOUT));
    let _ = s.set_nodelay(true);
    let mut req = vec![RPC_CMD_HELLO];
    req.extend_from_slice(&(RPC_CONN_CAPS as u64).to_le_bytes());
    req.extend_from_slice(&[0u8; RPC_CONN_CAPS]);
    let io = |e: std::io::Error| {
        let hint = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            " (no answer: busy with another client, or not an rpc-server?)"
        } else {
            " (not an rpc-server, or one of another ggml version?)"
        };
        crate::error::Error::new(format!("RPC server {endpoint}: hello handshake failed: {e}{hint}"))
    };
    s.write_all(&req).map_err(io)?;
    let mut size = [0u8; 8];
    s.read_exact(&mut size).map_err(io)?;
    let size = u64::from_le_bytes(size);
    ensure!(
        size == 4 + RPC_CONN_CAPS as u64,
        "RPC server {endpoint} answered the hello with {size} bytes (expected {}): it speaks another RPC protocol version than this build ({RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR})",
        4 + RPC_CONN_CAPS
    );
    let mut rsp = [0u8; 4 + RPC_CONN_CAPS];
    s.read_exact(&mut rsp).map_err(io)?;
    let (major, minor, patch) = (rsp[0], rsp[1], rsp[2]);
    ensure!(
        major == RPC_PROTO_MAJOR && minor.cmp(&RPC_PROTO_MINOR) != std::cmp::Ordering::Greater,
        "RPC server {endpoint} speaks RPC protocol {major}.{minor}.{patch}; this build needs {RPC_PROTO_MAJOR}.x (at most {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}): use an rpc-server built from the same ggml"
    );
    Ok((major, minor, patch))
}

/// Endpoints some live backend of this process is connected to: an rpc-server serves one
/// client at a time, so probing it then would wait for our own connection to close.
fn rpc_endpoints_in_use() -> HashSet<String> {
    backend::live_rpc_endpoints()
}

/// Adds the devices of every `host:port` rpc-server to ggml's device list (once per
/// endpoint and process), after checking each one answers with our protocol.
pub fn add_rpc_servers(spec: &str) -> Result<Vec<String>> {
    let endpoints = parse_rpc_servers(spec)?;
    backend::ensure_loaded();
    // SAFETY: lookup by a valid C string; null is checked.
    let reg = unsafe { g::ggml_backend_reg_by_name(c"RPC".as_ptr()) };
    ensure!(
        !reg.is_null(),
        "rpc_servers given, but ggml's RPC backend is not available (build with --features rpc, or put libggml-rpc.so next to libggml.so)"
    );
    type AddServer = unsafe extern "C" fn(*const libc::c_char) -> g::ggml_backend_reg_t;
    // SAFETY: registry lookup; null is checked.
    let p = unsafe { g::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_rpc_add_server".as_ptr()) };
    ensure!(!p.is_null(), "ggml's RPC backend has no ggml_backend_rpc_add_server function");
    // SAFETY: ggml's documented signature for this name.
    let add: AddServer = unsafe { std::mem::transmute(p) };
    let in_use = rpc_endpoints_in_use();
    let mut added = RPC_ADDED.lock();
    let added = added.get_or_insert_with(HashSet::new);
    for ep in &endpoints {
        if in_use.contains(ep) {
            continue;
        }
        let (major, minor, patch) = probe_rpc_server(ep)?;
        if added.contains(ep) {
            continue;
        }
        sd_info!("Adding RPC server: {ep} (protocol {major}.{minor}.{patch})");
        let c = CString::new(ep.as_str()).context("RPC endpoint contains a NUL byte")?;
        // SAFETY: valid C string; ggml copies it. The server answered our hello just now.
        let r = unsafe { add(c.as_ptr()) };
        ensure!(!r.is_null(), "RPC server {ep} reports no devices");
        // SAFETY: a registry ggml created for this endpoint, registered once (tracked above).
        unsafe { g::ggml_backend_register(r) };
        added.insert(ep.clone());
    }
    Ok(endpoints)
}

/// Serves this machine's `devices` (registry names; empty: the default device) to RPC
/// clients on `endpoint` (`host:port`), with ggml's RPC server. Returns only on error.
pub fn serve_rpc(endpoint: &str, devices: &[String], threads: usize, cache_dir: Option<&str>) -> Result<()> {
    parse_rpc_servers(endpoint)?;
    backend::ensure_loaded();
    // SAFETY: lookup by a valid C string; null is checked.
    let reg = unsafe { g::ggml_backend_reg_by_name(c"RPC".as_ptr()) };
    ensure!(!reg.is_null(), "ggml's RPC backend is not available (build with --features rpc)");
    type StartServer = unsafe extern "C" fn(*const libc::c_char, *const libc::c_char, usize, usize, *mut g::ggml_backend_dev_t);
    // SAFETY: registry lookup; null is checked.
    let p = unsafe { g::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_rpc_start_server".as_ptr()) };
    ensure!(!p.is_null(), "ggml's RPC backend has no ggml_backend_rpc_start_server function");
    let list = backend::devices();
    let names: Vec<String> = if devices.is_empty() {
        vec![default_device(&list.iter().filter(|d| d.registry != "RPC").cloned().collect::<Vec<_>>()).context("no device to serve")?]
    } else {
        devices.iter().map(|d| resolve_in(&list, d).with_context(|| format!("device '{d}' was not found"))).collect::<Result<_>>()?
    };
    let mut handles = Vec::new();
    for n in &names {
        let info = list.iter().find(|d| &d.name == n).expect("resolved device");
        ensure!(info.registry != "RPC", "cannot serve the remote device {n}");
        handles.push(backend::device_handle(n).with_context(|| format!("device '{n}' was not found"))?);
    }
    let ep = CString::new(endpoint).context("endpoint contains a NUL byte")?;
    let cache = cache_dir.map(CString::new).transpose().context("cache folder contains a NUL byte")?;
    // SAFETY: ggml's documented signature; the strings and the device array outlive the call
    // (it serves until the process ends).
    let start: StartServer = unsafe { std::mem::transmute(p) };
    unsafe {
        start(ep.as_ptr(), cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()), threads.max(1), handles.len(), handles.as_mut_ptr());
    }
    bail!("the RPC server on {endpoint} stopped (address in use?)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, registry: &str, kind: DeviceKind) -> DeviceInfo {
        DeviceInfo {
            name: name.into(),
            description: String::new(),
            is_cpu: kind == DeviceKind::Cpu,
            kind,
            registry: registry.into(),
            memory_free: 8 << 30,
            memory_total: 16 << 30,
        }
    }

    #[test]
    fn assignments_parse_like_the_reference() {
        let a = Assignment::parse(Some("CUDA0, vae = CPU,text-encoder=Vulkan0,Clip_Vision=cpu"), "backend").unwrap();
        assert_eq!(a.get(Module::Diffusion), "CUDA0");
        assert_eq!(a.get(Module::Vae), "CPU");
        assert_eq!(a.get(Module::Te), "Vulkan0");
        assert_eq!(a.get(Module::ClipVision), "cpu");
        let a = Assignment::parse(Some("all=cuda0,te=cpu"), "backend").unwrap();
        assert_eq!(a.get(Module::Upscaler), "cuda0");
        assert_eq!(Assignment::parse(None, "backend").unwrap().get(Module::Vae), "");
        assert!(Assignment::parse(Some("bogus=CPU"), "backend").unwrap_err().to_string().contains("unknown backend module 'bogus'"));
        assert!(Assignment::parse(Some("vae="), "backend").is_err());
        for alias in ["unet", "DiT", "t5xxl", "llm", "first_stage", "pmid", "hires", "yolo", "control"] {
            assert!(Module::parse(alias).is_some(), "{alias}");
        }
    }

    #[test]
    fn device_names_resolve_like_the_reference() {
        let list = vec![
            dev("CPU", "CPU", DeviceKind::Cpu),
            dev("Vulkan0", "Vulkan", DeviceKind::Gpu),
            dev("Vulkan1", "Vulkan", DeviceKind::Gpu),
            dev("RPC0", "RPC", DeviceKind::Gpu),
        ];
        assert_eq!(resolve_in(&list, "auto").as_deref(), Some("Vulkan0"));
        assert_eq!(resolve_in(&list, "").as_deref(), Some("Vulkan0"));
        assert_eq!(resolve_in(&list, "gpu").as_deref(), Some("Vulkan0"));
        assert_eq!(resolve_in(&list, "vulkan").as_deref(), Some("Vulkan0"));
        assert_eq!(resolve_in(&list, "VULKAN1").as_deref(), Some("Vulkan1"));
        assert_eq!(resolve_in(&list, "rpc").as_deref(), Some("RPC0"));
        assert_eq!(resolve_in(&list, "cpu").as_deref(), Some("CPU"));
        assert_eq!(resolve_in(&list, "cuda0"), None);
        let cpu_only = vec![dev("CPU", "CPU", DeviceKind::Cpu)];
        assert_eq!(resolve_in(&cpu_only, "default").as_deref(), Some("CPU"));
        assert_eq!(resolve_in(&cpu_only, "gpu"), None);
    }

    #[test]
    fn max_vram_budgets() {
        let gpu = dev("Vulkan0", "Vulkan", DeviceKind::Gpu);
        let m = MaxVram::parse(Some("2")).unwrap();
        assert_eq!(m.bytes_for(&gpu), 2 << 30);
        let m = MaxVram::parse(Some("0.5,vulkan0=1")).unwrap();
        assert_eq!(m.bytes_for(&gpu), 1 << 30);
        assert_eq!(m.bytes_for(&dev("CPU", "CPU", DeviceKind::Cpu)), 1 << 29);
        // -1: free (8 GiB) minus 1 GiB.
        assert_eq!(MaxVram::parse(Some("-1")).unwrap().bytes_for(&gpu), 7 << 30);
        assert!(MaxVram::parse(Some("lots")).is_err());
        assert!(MaxVram::parse(None).unwrap().is_off());
    }

    #[test]
    fn the_cpu_build_places_everything_on_the_cpu_and_rejects_unknown_devices() {
        let map = DeviceMap::new(&DeviceOptions { backend: Some("cpu,te=cpu"), params_backend: Some("vae=disk"), ..Default::default() }).unwrap();
        let te = map.placement(Module::Te).unwrap();
        let vae = map.placement(Module::Vae).unwrap();
        assert!(te.compute.is_cpu());
        assert!(Arc::ptr_eq(&te.compute, &vae.compute), "one backend per device");
        assert!(matches!(vae.weights, WeightHome::Disk));
        assert!(vae.weights_backend().is_none());
        let err = DeviceMap::new(&DeviceOptions { backend: Some("diffusion=NoSuchDevice7"), ..Default::default() }).err().unwrap();
        assert!(err.to_string().contains("backend 'NoSuchDevice7' was not found"), "{err}");
        let err = DeviceMap::new(&DeviceOptions { backend: Some("disk"), ..Default::default() }).err().unwrap();
        assert!(err.to_string().contains("only supported by params_backend"), "{err}");
        let err = DeviceMap::new(&DeviceOptions { params_backend: Some("cpu&cpu"), ..Default::default() }).err().unwrap();
        assert!(err.to_string().contains("does not accept device lists"), "{err}");
        assert!(DeviceMap::new(&DeviceOptions { split_mode: Some("diagonal"), ..Default::default() }).is_err());
        assert!(DeviceMap::new(&DeviceOptions { max_vram: Some("nope=1"), ..Default::default() }).is_err());
    }

    #[test]
    fn rpc_servers_are_checked_before_ggml_sees_them() {
        assert!(parse_rpc_servers("localhost").is_err());
        assert!(parse_rpc_servers("host:0").is_err());
        assert_eq!(parse_rpc_servers(" a:1 , b:2 ").unwrap(), vec!["a:1", "b:2"]);
        // A port nobody listens on: a clean error naming the endpoint.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let err = probe_rpc_server(&format!("127.0.0.1:{port}")).unwrap_err().to_string();
        assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("not reachable"), "{err}");
        // Something that accepts and answers in another protocol.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ep = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 33];
            s.read_exact(&mut req).unwrap();
            assert_eq!(req[0], RPC_CMD_HELLO);
            let mut rsp = 28u64.to_le_bytes().to_vec();
            rsp.extend_from_slice(&[6, 1, 0, 0]);
            rsp.extend_from_slice(&[0u8; 24]);
            s.write_all(&rsp).unwrap();
        });
        let err = probe_rpc_server(&ep).unwrap_err().to_string();
        t.join().unwrap();
        assert!(err.contains("speaks RPC protocol 6.1.0"), "{err}");
    }

    #[test]
    fn rpc_protocol_constants_match_the_pinned_header() {
        let header = crate::testutil::repo().join("third_party/ggml/include/ggml-rpc.h");
        let Ok(text) = std::fs::read_to_string(&header) else { return };
        let value = |name: &str| -> u8 {
            let line = text.lines().find(|l| l.contains(name)).unwrap_or_else(|| panic!("{name} in ggml-rpc.h"));
            line.split_whitespace().last().unwrap().parse().unwrap()
        };
        assert_eq!(value("RPC_PROTO_MAJOR_VERSION"), RPC_PROTO_MAJOR);
        assert_eq!(value("RPC_PROTO_MINOR_VERSION"), RPC_PROTO_MINOR);
    }
}
