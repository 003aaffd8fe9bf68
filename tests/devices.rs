//! Devices other than the CPU, through the C API: golden SD 1.x cases rendered on a Vulkan
//! device (Mesa's software lavapipe on machines without a GPU) and on ggml RPC devices
//! served by our `rpc-server` on loopback, with weights off the device (`params_backend`
//! cpu / disk), a memory budget (`max_vram`) and a layer split over two devices.
//!
//! The suites are switched on by `SD_TEST_VULKAN=1` / `SD_TEST_RPC=1` (scripts/test.sh's
//! `vulkan` and `rpc` suites). RPC needs a build with `--features rpc` (a default feature);
//! Vulkan needs ggml's Vulkan module, either from `--features vulkan` or loaded into the
//! default build from `SD_GGML_BACKEND_DIR` (scripts/build-backend.sh vulkan, as test.sh
//! does); lavapipe is a CPU-type Vulkan device that ggml lists only with
//! `GGML_VK_VISIBLE_DEVICES=0`. Elsewhere they say why they were skipped.

mod common;

use common::parity::{report, run_with, Arena};
use stable_diffusion::capi::*;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The model is large and lavapipe slow: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Representative and quick on the RPC (CPU) devices: eps and v prediction, img2img, a
/// single-pass case.
const SUBSET: &[&str] = &["defaults_eps", "img2img", "cfg_1"];

/// lavapipe is slow (on 2 cores: the CLIP text encoder about a minute, a 64×64 tiny-UNet
/// evaluation half a minute): with `SD_TEST_VULKAN=1` the suite renders one golden case of
/// the tiny SD 1.x UNet entirely on the device and one with the text encoder on the CPU;
/// `SD_TEST_VULKAN=full` adds the other tiny-UNet cases, the full SD 1.x subset, weights off
/// the device and the memory budget.
fn vulkan_full() -> bool {
    std::env::var("SD_TEST_VULKAN").as_deref() == Ok("full")
}

fn enabled(var: &str, feature: bool, what: &str) -> bool {
    if !feature {
        eprintln!("skipped {what}: build with the feature");
        return false;
    }
    if !matches!(std::env::var(var).as_deref(), Ok("1") | Ok("full")) {
        eprintln!("skipped {what}: set {var}=1 (scripts/test.sh does)");
        return false;
    }
    true
}

/// On when asked for: the Vulkan module may come from SD_GGML_BACKEND_DIR rather than the
/// build's features, and then a missing device is a failure, not a skip.
fn vulkan() -> bool {
    enabled("SD_TEST_VULKAN", true, "Vulkan suite")
}

/// The parts of the Vulkan suite that only `SD_TEST_VULKAN=full` runs.
fn vulkan_full_only(what: &str) -> bool {
    if !vulkan() {
        return false;
    }
    if !vulkan_full() {
        eprintln!("skipped {what}: SD_TEST_VULKAN=full runs it (lavapipe is slow)");
        return false;
    }
    true
}

fn rpc() -> bool {
    enabled("SD_TEST_RPC", cfg!(feature = "rpc"), "RPC suite")
}

fn set(p: &mut sd_ctx_params_t, arena: &mut Arena, backend: &str, params_backend: Option<&str>, max_vram: Option<&str>) {
    p.backend = arena.str(backend);
    if let Some(pb) = params_backend {
        p.params_backend = arena.str(pb);
    }
    if let Some(m) = max_vram {
        p.max_vram = arena.str(m);
    }
}

/// The CUDA module loaded from SD_GGML_BACKEND_DIR (scripts/device-check.sh).
#[test]
fn cuda_renders_the_golden_subset() {
    if std::env::var("SD_TEST_CUDA").as_deref() != Ok("1") {
        eprintln!("skipped CUDA suite: set SD_TEST_CUDA=1 (scripts/device-check.sh does)");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = stable_diffusion::graph::backend::devices().into_iter().find(|d| d.registry == "CUDA").map(|d| d.name).expect("a CUDA device");
    report(&run_with("sd1", |c| SUBSET.contains(&c.name.as_str()), |p, a| set(p, a, &dev, None, None)));
    report(&run_with("sd1", |c| c.name == "defaults_eps", |p, a| set(p, a, &dev, Some("cpu"), Some("0.25"))));
}

fn vulkan_device() -> String {
    let d = stable_diffusion::graph::backend::devices().into_iter().find(|d| d.registry == "Vulkan");
    d.map(|d| d.name).expect("a Vulkan device (on lavapipe: GGML_VK_VISIBLE_DEVICES=0 and mesa-vulkan-drivers)")
}

#[test]
fn vulkan_renders_the_golden_subset() {
    if !vulkan() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = vulkan_device();
    // img2img: text encoder, UNet, VAE encoder and decoder all on the device; with
    // SD_TEST_VULKAN=full also txt2img eps and v (euler).
    let full = vulkan_full();
    report(&run_with("sd1_tiny", |c| full || c.name == "img2img_v_0_6", |p, a| set(p, a, &dev, None, None)));
    if full {
        report(&run_with("sd1", |c| SUBSET.contains(&c.name.as_str()), |p, a| set(p, a, &dev, None, None)));
    }
}

/// The tiny UNet's eps case with `backend` / `params_backend` / `max_vram` as given.
fn tiny_case(backend: &str, params_backend: Option<&str>, max_vram: Option<&str>) {
    report(&run_with("sd1_tiny", |c| c.name == "txt2img_eps_default", |p, a| set(p, a, backend, params_backend, max_vram)));
}

#[test]
fn vulkan_with_the_text_encoder_on_the_cpu() {
    if !vulkan() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = vulkan_device();
    tiny_case(&format!("te=cpu,diffusion={dev},vae={dev}"), None, None);
}

/// Weights in host memory (uploaded per phase) or read from the file per phase: same pictures.
#[test]
fn vulkan_with_weights_off_the_device() {
    if !vulkan_full_only("weights off the device") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = vulkan_device();
    tiny_case(&dev, Some("cpu"), None);
    tiny_case(&dev, Some("disk"), None);
}

/// A small `max_vram`: the UNet and text encoder run in segments whose weights are uploaded
/// for each; same picture, and the device never holds more than the budget for them.
#[test]
fn vulkan_under_a_small_memory_budget() {
    if !vulkan_full_only("the memory budget") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = vulkan_device();
    let budget_gib = 0.25;
    stable_diffusion::graph::take_peak_device_bytes();
    tiny_case(&dev, Some("cpu"), Some(&budget_gib.to_string()));
    let peak = stable_diffusion::graph::take_peak_device_bytes();
    let budget = (budget_gib * (1u64 << 30) as f64) as usize;
    eprintln!("runs under the budget held at most {:.1} MB on {dev} (budget {:.1} MB)", peak as f64 / 1048576.0, budget as f64 / 1048576.0);
    assert!(peak > 0, "no graph ran under the budget");
    assert!(peak <= budget, "peak device memory {peak} exceeds the budget {budget}");
}

/// An rpc-server child serving this machine's CPU on a free loopback port, stopped on drop.
struct RpcServer {
    child: Child,
    endpoint: String,
}

impl RpcServer {
    fn start() -> RpcServer {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let endpoint = format!("127.0.0.1:{port}");
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rpc-server"));
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string(), "-d", "CPU", "-t", "2"]).stdout(Stdio::null()).stderr(Stdio::inherit());
        // SAFETY: only async-signal-safe calls between fork and exec. The server dies with
        // this process (even when it aborts) and keeps none of its descriptors (a held
        // `flock` on a lock file, say).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                for fd in 3..1024 {
                    libc::close(fd);
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start rpc-server");
        let mut s = RpcServer { child, endpoint };
        let start = Instant::now();
        while stable_diffusion::graph::devices::probe_rpc_server(&s.endpoint).is_err() {
            assert!(start.elapsed() < Duration::from_secs(60), "rpc-server did not come up on {}", s.endpoint);
            assert!(s.child.try_wait().unwrap().is_none(), "rpc-server exited early");
            std::thread::sleep(Duration::from_millis(200));
        }
        s
    }

    /// The ggml device name the endpoint's (first) device got once added.
    fn device(&self) -> String {
        stable_diffusion::graph::devices::add_rpc_servers(&self.endpoint).unwrap();
        let list = stable_diffusion::graph::backend::devices();
        list.into_iter().find(|d| d.registry == "RPC" && d.description == self.endpoint).map(|d| d.name).expect("RPC device")
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn rpc_renders_the_golden_subset_like_locally() {
    if !rpc() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = RpcServer::start();
    let dev = server.device();
    let ep = server.endpoint.clone();
    report(&run_with(
        "sd1",
        |c| SUBSET.contains(&c.name.as_str()),
        |p, a| {
            p.rpc_servers = a.str(&ep);
            set(p, a, &dev, None, None);
        },
    ));
}

/// `diffusion=A&B`: the UNet's blocks spread over two devices (two rpc-servers here).
#[test]
fn rpc_layer_split_over_two_servers() {
    if !rpc() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = (RpcServer::start(), RpcServer::start());
    let (da, db) = (a.device(), b.device());
    let servers = format!("{},{}", a.endpoint, b.endpoint);
    let spec = format!("te=cpu,vae=cpu,diffusion={da}&{db}");
    report(&run_with(
        "sd1",
        |c| c.name == "defaults_eps",
        |p, ar| {
            p.rpc_servers = ar.str(&servers);
            set(p, ar, &spec, None, None);
        },
    ));
}

/// A host that is down, or something that is not an rpc-server: new_sd_ctx fails cleanly
/// (ggml's client would abort the process).
#[test]
fn rpc_unreachable_host_is_a_clean_error() {
    if !rpc() {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut arena = Arena::default();
    let mut p = std::mem::MaybeUninit::<sd_ctx_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_ctx_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    p.model_path = arena.str(&common::parity::fixture("sd1_tiny.safetensors").to_string_lossy());
    p.rpc_servers = arena.str(&format!("127.0.0.1:{port}"));
    // SAFETY: valid params.
    let ctx = unsafe { new_sd_ctx(&p) };
    assert!(ctx.is_null(), "a context with an unreachable RPC server");
    let err = stable_diffusion::graph::devices::add_rpc_servers(&format!("127.0.0.1:{port}")).unwrap_err().to_string();
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
}

/// What happens when an RPC host disappears mid-generation: ggml's RPC client aborts the
/// process ("Remote RPC server crashed or returned malformed response"); it offers no way
/// to fail one call. This runs a generation in a child process, stops the server while it
/// samples and checks that the child died that way (and did not hang or return a picture).
#[test]
fn rpc_host_lost_mid_generation_aborts_the_process() {
    if std::env::var("SD_RPC_CHILD").is_ok() {
        return rpc_child();
    }
    if !rpc() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut server = RpcServer::start();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "rpc_host_lost_mid_generation_aborts_the_process", "--nocapture", "--test-threads=1"])
        .env("SD_RPC_CHILD", &server.endpoint)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::sync::Arc::new(Mutex::new(String::new()));
    let mut child = child;
    let err_pipe = child.stderr.take().unwrap();
    let sink = out.clone();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(err_pipe).lines().map_while(Result::ok) {
            sink.lock().unwrap().push_str(&line);
            sink.lock().unwrap().push('\n');
        }
    });
    let start = Instant::now();
    while !out.lock().unwrap().contains("SAMPLING") {
        assert!(start.elapsed() < Duration::from_secs(900), "child never started sampling:\n{}", out.lock().unwrap());
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = server.child.kill();
    let _ = server.child.wait();
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let text = out.lock().unwrap().clone();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGABRT), "child ended with {status}:\n{text}");
    assert!(text.contains("RPC server crashed") || text.contains("Remote RPC"), "{text}");
}

fn rpc_child() {
    let endpoint = std::env::var("SD_RPC_CHILD").unwrap();
    unsafe extern "C" fn on_progress(step: std::ffi::c_int, _: std::ffi::c_int, _: f32, _: *mut std::ffi::c_void) {
        if step >= 1 {
            eprintln!("SAMPLING {step}");
        }
    }
    sd_set_progress_callback(Some(on_progress), std::ptr::null_mut());
    let dev = RpcServer { child: Command::new("true").spawn().unwrap(), endpoint: endpoint.clone() };
    let name = dev.device();
    std::mem::forget(dev);
    let results = run_with(
        "sd1",
        |c| c.name == "defaults_eps",
        |p, a| {
            p.rpc_servers = a.str(&endpoint);
            set(p, a, &name, None, None);
        },
    );
    eprintln!("child finished: {:?}", results.iter().map(|r| r.pass).collect::<Vec<_>>());
}
