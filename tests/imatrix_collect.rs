//! The backend evaluation callback while generating: imatrix collection gives the entries the
//! reference collected on the same Z-Image run (`golden/imatrix-quant/zimage.imatrix`), and a
//! callback of one's own (`sd_set_backend_eval_callback`) sees the products it asks for and can
//! stop the generation. Its own process: the callback and the collector are process-wide.

mod common;

use common::parity::{ctx_params, ensure_fixtures, gen_params, generate, Arena};
use serde_json::{json, Value};
use stable_diffusion::capi::*;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// One test at a time: the callback and the collector belong to the process.
static ONE: Mutex<()> = Mutex::new(());

/// The reference's collection run (`tests/tools/imatrix_golden.py collect`).
fn z_image_ctx() -> Value {
    json!({"diffusion_model_path": "{fx}/z_image.safetensors", "llm_path": "{fx}/qwen3_tiny.safetensors",
           "vae_path": "{fx}/zimage_vae.safetensors"})
}

fn z_image_request() -> Value {
    json!({"prompt": "a lovely cat", "width": 64, "height": 64, "seed": 42, "sample_params.sample_steps": 2})
}

/// Generates once; (ok, the first picture's bytes).
fn run() -> (bool, Vec<u8>) {
    let ctx = z_image_ctx();
    ensure_fixtures("", &ctx);
    let mut arena = Arena::default();
    let cp = ctx_params("", &ctx, &mut arena);
    // SAFETY: params valid for the call.
    let sd = unsafe { new_sd_ctx(&cp) };
    assert!(!sd.is_null(), "new_sd_ctx failed");
    let gp = gen_params(&z_image_request(), &mut arena);
    let (ok, pictures) = generate(sd, &gp);
    // SAFETY: the context made above, freed once.
    unsafe { free_sd_ctx(sd) };
    (ok, pictures.into_iter().next().map(|p| p.3).unwrap_or_default())
}

/// name → (ncall, values) of an imatrix file.
fn read_imatrix(path: &Path) -> HashMap<String, (i32, Vec<f32>)> {
    let b = std::fs::read(path).unwrap();
    let i32_at = |at: usize| i32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let mut out = HashMap::new();
    let mut at = 4;
    for _ in 0..i32_at(0) {
        let len = i32_at(at) as usize;
        let name = String::from_utf8(b[at + 4..at + 4 + len].to_vec()).unwrap();
        at += 4 + len;
        let (ncall, n) = (i32_at(at), i32_at(at + 4) as usize);
        at += 8;
        let values = b[at..at + 4 * n].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        at += 4 * n;
        out.insert(name, (ncall, values));
    }
    out
}

#[test]
fn collection_gives_the_references_imatrix() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    enable_imatrix_collection();
    let (ok, _) = run();
    disable_imatrix_collection();
    assert!(ok, "generation failed");
    let out = std::env::temp_dir().join(format!("sd-imatrix-collect-{}.dat", std::process::id()));
    let c_out = CString::new(out.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: NUL-terminated path alive during the call.
    unsafe { save_imatrix(c_out.as_ptr()) };
    let ours = read_imatrix(&out);
    std::fs::remove_file(&out).unwrap();
    let golden = read_imatrix(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/imatrix-quant/zimage.imatrix"));
    // The golden file keeps the diffusion model's entries (the text encoder's were collected
    // too, and are here).
    assert!(ours.keys().any(|k| k.starts_with("text_encoders.")), "the text encoder's products were not collected");
    let kept: Vec<&String> = ours.keys().filter(|k| k.starts_with("model.diffusion_model.")).collect();
    assert_eq!(kept.len(), golden.len(), "entries of the diffusion model");
    for (name, (ncall, values)) in &golden {
        let (n, v) = ours.get(name).unwrap_or_else(|| panic!("{name} was not collected"));
        assert_eq!(n, ncall, "{name}: calls");
        assert_eq!(v.len(), values.len(), "{name}: values");
        // Sums of squared activations: bit for bit on the golden machine, float rounding of
        // other CPUs' products elsewhere.
        for (i, (a, b)) in v.iter().zip(values).enumerate() {
            assert!((a - b).abs() <= 1e-3 * b.abs().max(1e-6), "{name}[{i}]: {a} vs the reference's {b}");
        }
    }
}

static ASKED: AtomicUsize = AtomicUsize::new(0);
static SHOWN: AtomicUsize = AtomicUsize::new(0);
/// Calls with other user data than given, or shown nodes that were not asked for.
static WRONG: AtomicUsize = AtomicUsize::new(0);
/// Stop after this many products were shown (0: never).
static STOP_AFTER: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" {
    /// ggml's name of a node's operation, as a C program would ask it.
    fn ggml_op_desc(t: *const ggml_tensor) -> *const std::ffi::c_char;
}

unsafe extern "C" fn watch(t: *mut ggml_tensor, ask: CBool, user_data: *mut c_void) -> CBool {
    // No panics here: they cannot unwind out of a C callback.
    if user_data as usize != 7 {
        WRONG.fetch_add(1, Ordering::SeqCst);
    }
    // SAFETY: a node of the graph being computed; ggml's names are static strings.
    let is_mul_mat = unsafe { std::ffi::CStr::from_ptr(ggml_op_desc(t)) }.to_bytes() == b"MUL_MAT";
    if ask.0 != 0 {
        ASKED.fetch_add(1, Ordering::SeqCst);
        return CBool(is_mul_mat as u8);
    }
    if !is_mul_mat {
        WRONG.fetch_add(1, Ordering::SeqCst);
    }
    let shown = SHOWN.fetch_add(1, Ordering::SeqCst) + 1;
    let stop = STOP_AFTER.load(Ordering::SeqCst);
    CBool((stop == 0 || shown < stop) as u8)
}

#[test]
fn an_evaluation_callback_watches_and_can_stop_a_generation() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let (ok, plain) = run();
    assert!(ok);

    // SAFETY: a callback valid for the process, its user data a plain number.
    unsafe { sd_set_backend_eval_callback(Some(watch), 7 as *mut c_void) };
    let (ok, watched) = run();
    let (asked, shown) = (ASKED.swap(0, Ordering::SeqCst), SHOWN.swap(0, Ordering::SeqCst));
    assert!(ok, "a watching callback that goes on leaves the generation alone");
    assert!(shown > 10 && asked > shown, "asked about {asked} nodes, shown {shown}");
    // Watched graphs are ggml's own operations (the callback sees the reference's products),
    // not our kernels: the same picture up to their rounding.
    assert_eq!(watched.len(), plain.len());
    let max = watched.iter().zip(&plain).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
    assert!(max <= 2, "the picture moved by {max} while watched");

    STOP_AFTER.store(3, Ordering::SeqCst);
    let (ok, _) = run();
    STOP_AFTER.store(0, Ordering::SeqCst);
    // SAFETY: removing the callback.
    unsafe { sd_set_backend_eval_callback(None, std::ptr::null_mut()) };
    assert!(!ok, "the callback stopped the generation");
    assert_eq!(SHOWN.swap(0, Ordering::SeqCst), 3, "nothing is computed after the stop");
    assert_eq!(WRONG.load(Ordering::SeqCst), 0, "calls with the wrong user data or node");
}
