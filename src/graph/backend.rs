//! ggml backends: loading the dynamic backend modules, enumerating devices, CPU facts.
//!
//! In the default build the CPU backend (one variant per ISA level) and any GPU backend are
//! shared modules that ggml loads at run time; they are looked up next to libggml first.

use crate::error::{Context, Result};
use ggml_sys as g;
use once_cell::sync::OnceCell;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

static LOADED: OnceCell<()> = OnceCell::new();

/// Loads the backend modules once per process (no-op for static builds).
pub fn ensure_loaded() {
    LOADED.get_or_init(|| {
        route_ggml_log();
        if !g::DYNAMIC_BACKENDS {
            return;
        }
        let dirs = candidate_dirs();
        let chosen = dirs.iter().find(|d| has_cpu_module(d));
        match chosen {
            Some(dir) => {
                sd_debug!("loading ggml backends from {}", dir.display());
                if let Ok(c) = CString::new(dir.to_string_lossy().as_bytes()) {
                    // SAFETY: c is a valid NUL-terminated path for the duration of the call.
                    unsafe { g::ggml_backend_load_all_from_path(c.as_ptr()) };
                }
            }
            None => {
                sd_warn!(
                    "no ggml CPU backend module (libggml-cpu-*.so) found in {}; set SD_GGML_BACKEND_DIR",
                    dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
                );
                // SAFETY: plain call; ggml searches its default locations.
                unsafe { g::ggml_backend_load_all() };
            }
        }
    });
}

/// ggml's own messages (backend loading, allocation failures) join our log stream.
fn route_ggml_log() {
    unsafe extern "C" fn on_log(level: g::ggml_log_level, text: *const libc::c_char, _: *mut libc::c_void) {
        let msg = cstr(text);
        let msg = msg.trim_end();
        if msg.is_empty() {
            return;
        }
        let _ = std::panic::catch_unwind(|| match level {
            g::GGML_LOG_LEVEL_ERROR => sd_error!("ggml: {msg}"),
            g::GGML_LOG_LEVEL_WARN => sd_warn!("ggml: {msg}"),
            _ => sd_debug!("ggml: {msg}"),
        });
    }
    // SAFETY: registers a callback that never unwinds into C.
    unsafe { g::ggml_log_set(Some(on_log), std::ptr::null_mut()) };
}

fn has_cpu_module(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten().any(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with("libggml-cpu") && n.contains(".so")
            })
        })
        .unwrap_or(false)
}

/// SD_GGML_BACKEND_DIR, then the folder of libggml, of our own module, and of this build.
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("SD_GGML_BACKEND_DIR") {
        dirs.push(PathBuf::from(d));
    }
    if let Some(d) = module_dir(g::ggml_backend_load_all_from_path as *const libc::c_void) {
        dirs.push(d);
    }
    if let Some(d) = module_dir(ensure_loaded as *const libc::c_void) {
        dirs.push(d);
    }
    dirs.push(PathBuf::from(g::GGML_BUILD_LIB_DIR));
    dirs
}

/// Folder of the shared object (or executable) that contains `addr`.
fn module_dir(addr: *const libc::c_void) -> Option<PathBuf> {
    let path = module_path(addr)?;
    let path = std::fs::canonicalize(&path).unwrap_or(path);
    path.parent().map(Path::to_path_buf)
}

/// The shared object (or executable) that contains `addr`, as it was loaded.
fn module_path(addr: *const libc::c_void) -> Option<PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    Some(PathBuf::from(unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().to_string()))
}

/// What kind of device ggml reports (its `ggml_backend_dev_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
    IntegratedGpu,
    Accelerator,
    Other,
}

/// One ggml device as listed by the registry.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub name: String,
    pub description: String,
    pub is_cpu: bool,
    pub kind: DeviceKind,
    /// The name of the backend registry the device belongs to ("CPU", "Vulkan", "RPC", …).
    pub registry: String,
    /// Free and total memory as the device reports them (bytes).
    pub memory_free: usize,
    pub memory_total: usize,
}

fn cstr(p: *const libc::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: ggml returns NUL-terminated strings that live as long as the device.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Facts about one registered device.
fn device_info(dev: g::ggml_backend_dev_t) -> DeviceInfo {
    // SAFETY: `dev` comes from the registry and lives as long as the process.
    unsafe {
        let kind = match g::ggml_backend_dev_type(dev) {
            g::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
            g::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
            g::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::IntegratedGpu,
            g::GGML_BACKEND_DEVICE_TYPE_ACCEL => DeviceKind::Accelerator,
            _ => DeviceKind::Other,
        };
        let reg = g::ggml_backend_dev_backend_reg(dev);
        let registry = if reg.is_null() { String::new() } else { cstr(g::ggml_backend_reg_name(reg)) };
        // An RPC device's memory is a round trip to its server, which may be gone since it
        // was added (ggml aborts then): asked for only where needed (`device_memory`).
        let (mut free, mut total) = (0usize, 0usize);
        if registry != "RPC" {
            g::ggml_backend_dev_memory(dev, &mut free, &mut total);
        }
        DeviceInfo {
            name: cstr(g::ggml_backend_dev_name(dev)),
            description: cstr(g::ggml_backend_dev_description(dev)),
            is_cpu: kind == DeviceKind::Cpu,
            kind,
            registry,
            memory_free: free,
            memory_total: total,
        }
    }
}

/// Every device ggml knows: the loaded backend modules' and the RPC servers added so far.
pub fn devices() -> Vec<DeviceInfo> {
    ensure_loaded();
    // SAFETY: registry calls with indices below the reported count.
    unsafe { (0..g::ggml_backend_dev_count()).map(|i| device_info(g::ggml_backend_dev_get(i))).collect() }
}

/// Free and total memory of a device by exact name (asks an RPC device's server).
pub fn device_memory(name: &str) -> (usize, usize) {
    let (mut free, mut total) = (0usize, 0usize);
    if let Some(dev) = device_handle(name) {
        // SAFETY: a registered device.
        unsafe { g::ggml_backend_dev_memory(dev, &mut free, &mut total) };
    }
    (free, total)
}

/// The registry's device handle of a device listed by [`devices`], by exact name.
pub(crate) fn device_handle(name: &str) -> Option<g::ggml_backend_dev_t> {
    ensure_loaded();
    let c = CString::new(name).ok()?;
    // SAFETY: lookup by a valid C string; null is checked.
    let dev = unsafe { g::ggml_backend_dev_by_name(c.as_ptr()) };
    (!dev.is_null()).then_some(dev)
}

/// `name<TAB>description` per device, one per line, like the reference's sd_list_devices.
pub fn device_listing() -> String {
    devices().iter().map(|d| format!("{}\t{}\n", d.name, d.description)).collect()
}

fn cpu_reg() -> Option<g::ggml_backend_reg_t> {
    ensure_loaded();
    // SAFETY: registry lookups; null results are checked.
    unsafe {
        let dev = g::ggml_backend_dev_by_type(g::GGML_BACKEND_DEVICE_TYPE_CPU);
        if dev.is_null() {
            return None;
        }
        let reg = g::ggml_backend_dev_backend_reg(dev);
        (!reg.is_null()).then_some(reg)
    }
}

/// The CPU features the loaded CPU backend reports, as (name, value) pairs.
pub fn cpu_features() -> Vec<(String, String)> {
    let Some(reg) = cpu_reg() else { return Vec::new() };
    type GetFeatures = unsafe extern "C" fn(g::ggml_backend_reg_t) -> *mut g::ggml_backend_feature;
    // SAFETY: the symbol, when present, has ggml's documented signature; the feature list
    // is terminated by an entry with a null name.
    unsafe {
        let p = g::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_get_features".as_ptr());
        if p.is_null() {
            return Vec::new();
        }
        let f: GetFeatures = std::mem::transmute(p);
        let mut feat = f(reg);
        let mut out = Vec::new();
        while !feat.is_null() && !(*feat).name.is_null() && !(*feat).value.is_null() {
            out.push((cstr((*feat).name), cstr((*feat).value)));
            feat = feat.add(1);
        }
        out
    }
}

/// The CPU backend variant ggml loaded: `haswell`, `skylakex`, `x64`, ... from the module's
/// file name `libggml-cpu-<variant>.so` (ggml picks the best one the CPU runs); `None` for a
/// CPU backend linked into the library (feature `native`). Kernels of different variants
/// sum in different orders, so results differ in the last bits between them.
pub fn cpu_variant() -> Option<String> {
    let reg = cpu_reg()?;
    // SAFETY: registry lookup; any function the module exports lies in its file.
    let p = unsafe { g::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_get_features".as_ptr()) };
    if p.is_null() {
        return None;
    }
    let file = module_path(p as *const libc::c_void)?;
    let stem = file.file_name()?.to_str()?.split(".so").next()?.split(".dll").next()?.to_string();
    let variant = stem.strip_prefix("libggml-cpu").or_else(|| stem.strip_prefix("ggml-cpu"))?;
    Some(variant.strip_prefix('-').unwrap_or(variant).to_string())
}

/// The reference's system-info text: "System Info: \n" then `   NAME = value | ` per feature.
pub fn system_info() -> String {
    let mut s = String::from("System Info: \n");
    let feats = cpu_features();
    if feats.is_empty() {
        sd_warn!("unable to get CPU features");
    }
    for (name, value) in feats {
        s.push_str(&format!("   {name} = {value} | "));
    }
    s
}

/// Number of physical cores, like the reference (thread-sibling sets on Linux).
pub fn physical_cores() -> i32 {
    let mut siblings = std::collections::HashSet::new();
    for cpu in 0.. {
        let p = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings");
        match std::fs::read_to_string(&p) {
            Ok(s) => {
                siblings.insert(s.lines().next().unwrap_or("").to_string());
            }
            Err(_) => break,
        }
    }
    if !siblings.is_empty() {
        return siblings.len() as i32;
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    (if n <= 4 { n } else { n / 2 }) as i32
}

/// An initialised ggml backend (CPU or a device), freed on drop.
pub struct Backend {
    raw: NonNull<g::ggml_backend>,
    is_cpu: bool,
    /// `host:port` of an RPC device (its connection is open while the backend lives).
    rpc_endpoint: Option<String>,
}

/// RPC endpoints with live backends in this process, and how many.
static LIVE_RPC: parking_lot::Mutex<Vec<(String, usize)>> = parking_lot::Mutex::new(Vec::new());

/// Endpoints that some live backend of this process is connected to.
pub fn live_rpc_endpoints() -> std::collections::HashSet<String> {
    LIVE_RPC.lock().iter().filter(|(_, n)| *n > 0).map(|(e, _)| e.clone()).collect()
}

// SAFETY: a ggml backend may be used from any thread as long as calls are not concurrent.
// Backends are shared (`Arc`) only between the parts of one context (its `DeviceMap`,
// placements and runners), and the C API lets one thread use a context at a time.
unsafe impl Send for Backend {}
unsafe impl Sync for Backend {}

impl Backend {
    /// The CPU backend.
    pub fn cpu() -> Result<Backend> {
        ensure_loaded();
        // SAFETY: plain init call; null is checked.
        let raw = unsafe { g::ggml_backend_init_by_type(g::GGML_BACKEND_DEVICE_TYPE_CPU, std::ptr::null()) };
        let raw = NonNull::new(raw).context("could not initialise the ggml CPU backend (no CPU backend module loaded?)")?;
        Ok(Backend { raw, is_cpu: true, rpc_endpoint: None })
    }

    /// A backend by device name (as listed by `devices()`), e.g. "CPU" or "CUDA0".
    pub fn by_name(name: &str) -> Result<Backend> {
        ensure_loaded();
        let c = CString::new(name).context("device name contains a NUL byte")?;
        // SAFETY: lookups by a valid C string; null results are checked.
        unsafe {
            let dev = g::ggml_backend_dev_by_name(c.as_ptr());
            if dev.is_null() {
                let known: Vec<String> = devices().into_iter().map(|d| d.name).collect();
                bail!("unknown backend device '{name}' (available: {})", known.join(", "));
            }
            let info = device_info(dev);
            let rpc_endpoint = (info.registry == "RPC").then(|| info.description.clone());
            let raw = g::ggml_backend_dev_init(dev, std::ptr::null());
            let raw = NonNull::new(raw).with_context(|| format!("could not initialise backend device '{name}'"))?;
            if let Some(ep) = &rpc_endpoint {
                let mut live = LIVE_RPC.lock();
                match live.iter_mut().find(|(e, _)| e == ep) {
                    Some((_, n)) => *n += 1,
                    None => live.push((ep.clone(), 1)),
                }
            }
            Ok(Backend { raw, is_cpu: info.is_cpu, rpc_endpoint })
        }
    }

    pub fn raw(&self) -> g::ggml_backend_t {
        self.raw.as_ptr()
    }

    /// The device this backend computes on (its registry name, e.g. "Vulkan0", "RPC1").
    pub fn device_name(&self) -> String {
        // SAFETY: valid backend; the device may be null for exotic backends.
        unsafe {
            let dev = g::ggml_backend_get_device(self.raw.as_ptr());
            if dev.is_null() {
                self.name()
            } else {
                cstr(g::ggml_backend_dev_name(dev))
            }
        }
    }

    /// Whether this backend can compute on tensors stored in `buffer` (null, or a live
    /// buffer of some tensor) as they are.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn can_use_buffer(&self, buffer: g::ggml_backend_buffer_t) -> bool {
        if buffer.is_null() {
            return false;
        }
        // SAFETY: valid backend and buffer.
        unsafe { g::ggml_backend_supports_buft(self.raw.as_ptr(), g::ggml_backend_buffer_get_type(buffer)) }
    }

    pub fn is_cpu(&self) -> bool {
        self.is_cpu
    }

    pub fn name(&self) -> String {
        // SAFETY: valid backend.
        cstr(unsafe { g::ggml_backend_name(self.raw.as_ptr()) })
    }

    /// A function this backend's module exports by name (null when it has none).
    pub(crate) fn proc_address(&self, name: &std::ffi::CStr) -> *mut libc::c_void {
        // SAFETY: registry lookups on a valid backend; nulls are checked.
        unsafe {
            let dev = g::ggml_backend_get_device(self.raw.as_ptr());
            if dev.is_null() {
                return std::ptr::null_mut();
            }
            let reg = g::ggml_backend_dev_backend_reg(dev);
            if reg.is_null() {
                return std::ptr::null_mut();
            }
            g::ggml_backend_reg_get_proc_address(reg, name.as_ptr()) as *mut libc::c_void
        }
    }

    /// Sets the thread count where the backend has one (CPU).
    pub fn set_n_threads(&self, n: i32) {
        type SetThreads = unsafe extern "C" fn(g::ggml_backend_t, libc::c_int);
        let p = self.proc_address(c"ggml_backend_set_n_threads");
        if !p.is_null() {
            // SAFETY: ggml's documented signature for this name.
            unsafe {
                let f: SetThreads = std::mem::transmute(p);
                f(self.raw.as_ptr(), n.max(1));
            }
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: we own the backend.
        unsafe { g::ggml_backend_free(self.raw.as_ptr()) };
        if let Some(ep) = &self.rpc_endpoint {
            if let Some((_, n)) = LIVE_RPC.lock().iter_mut().find(|(e, _)| e == ep) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_device_is_listed_and_usable() {
        let list = device_listing();
        assert!(list.lines().any(|l| l.starts_with("CPU\t")), "{list}");
        let b = Backend::cpu().unwrap();
        b.set_n_threads(2);
        assert!(b.is_cpu());
        assert!(system_info().starts_with("System Info: \n"));
        // The default build loads one of its variants; `native` links the backend in.
        assert_eq!(cpu_variant().is_some(), g::DYNAMIC_BACKENDS, "{:?}", cpu_variant());
        assert!(physical_cores() >= 1);
    }
}
