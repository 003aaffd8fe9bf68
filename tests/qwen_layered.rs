//! Qwen-Image-Layered through the C ABI (`golden/qwenimage-layered/`, rendered by the
//! reference 97d29908 through its C API with tests/tools/ref_ctypes_layered.py): the
//! Qwen-Image-Layered DiT (`qwen_image_layered`, the layer embedding), the Qwen2.5-VL LLM and
//! the RGBA Wan2.1 VAE (`wan_vae_rgba`). A request returns batch × (qwen_image_layers + 1)
//! RGBA pictures: 1 and 2 layers, 0, -1 (clamped to 0), the default 3, the picture to
//! decompose as a reference image (square and 80×48 into 96×64), cfg 2.5 with a negative
//! prompt, a batch of 2, and an init image (refused, as the reference fails to decode it).
//!
//! Without `SD_PARITY=full` four cases run; `SD_LAYERED_CASE=name,...` runs the named ones.
//! The tests share one lock: each context holds ~2 GB and the progress callback is global.

mod common;

use common::parity::{ctx_params, ensure_fixtures, folder, full, gen_params, generate, report, run, Arena};
use stable_diffusion::capi::*;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::Mutex;

const FOLDER: &str = "qwenimage-layered";
static SERIAL: Mutex<()> = Mutex::new(());
/// (step at which to cancel, mode) for the progress callback.
static CANCEL_AT: Mutex<Option<(i32, u32)>> = Mutex::new(None);
/// (step, pictures, channels of the first) of every preview.
static PREVIEWS: Mutex<Vec<(i32, i32, u32)>> = Mutex::new(Vec::new());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn layered_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in layered_all_cases");
        return;
    }
    let _g = serial();
    let quick = ["layered_l1_cfg1", "layered_l2_ref_cfg1", "layered_minus1_cfg1", "layered_init_image"];
    report(&run(FOLDER, |c| quick.contains(&c.name.as_str())));
}

#[test]
fn layered_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = serial();
    report(&run(FOLDER, |_| true));
}

#[test]
fn layered_selected_cases() {
    let Ok(names) = std::env::var("SD_LAYERED_CASE") else {
        eprintln!("skipped: set SD_LAYERED_CASE=name[,name...]");
        return;
    };
    let _g = serial();
    let names: Vec<&str> = names.split(',').collect();
    report(&run(FOLDER, |c| names.contains(&c.name.as_str())));
}

unsafe extern "C" fn on_progress(step: c_int, _steps: c_int, _time: f32, data: *mut c_void) {
    if let Some((at, mode)) = *CANCEL_AT.lock().unwrap() {
        if step == at {
            sd_cancel_generation(data as *mut sd_ctx_t, sd_cancel_mode_t(mode));
        }
    }
}

unsafe extern "C" fn on_preview(step: c_int, n: c_int, frames: *mut sd_image_t, _noisy: CBool, _data: *mut c_void) {
    // SAFETY: n frames from the library, valid during the call.
    let f = unsafe { &*frames };
    PREVIEWS.lock().unwrap().push((step, n, f.channel));
}

/// One context for the 1-layer case: repeated requests give the same bytes; the layer count
/// and batch make the image count; cancelling new latents of a batch keeps the layers of
/// the finished one; cancelling everything fails the request.
#[test]
fn layered_counts_determinism_and_cancel() {
    let _g = serial();
    let f = folder(FOLDER);
    let case = f.cases.iter().find(|c| c.name == "layered_l1_cfg1").expect("case layered_l1_cfg1");
    ensure_fixtures(&f.model, &case.ctx);
    let mut arena = Arena::default();
    let cp = ctx_params(&f.model, &case.ctx, &mut arena);
    // SAFETY: cp and what it points to are alive during the call.
    let ctx = unsafe { new_sd_ctx(&cp) };
    assert!(!ctx.is_null());
    let mut p = gen_params(&case.params, &mut arena);

    let (ok, a) = generate(ctx, &p);
    assert!(ok && a.len() == 2);
    assert!(a.iter().all(|i| (i.0, i.1, i.2) == (64, 64, 4)));
    assert_ne!(a[0].3, a[1].3, "the layers are different pictures");
    let (_, b) = generate(ctx, &p);
    assert_eq!(a, b, "same request, same pictures");

    for (layers, want) in [(0, 1), (-5, 1), (2, 3)] {
        p.qwen_image_layers = layers;
        let (ok, imgs) = generate(ctx, &p);
        assert!(ok && imgs.len() == want, "qwen_image_layers {layers}: {} images", imgs.len());
    }
    p.qwen_image_layers = 1;
    p.batch_count = 2;
    let (ok, batch) = generate(ctx, &p);
    assert!(ok && batch.len() == 4);
    assert_eq!(&batch[..2], &a[..], "the first item of a batch is the single request's");

    // Previews show every layer: projected latents (RGB), decoded ones (RGBA).
    for (mode, channels) in [(1, 3), (3, 4)] {
        PREVIEWS.lock().unwrap().clear();
        sd_set_preview_callback(Some(on_preview), preview_t(mode), 1, CBool::TRUE, CBool::FALSE, null_mut());
        let (ok, _) = generate(ctx, &p);
        sd_set_preview_callback(None, preview_t(0), 1, CBool::FALSE, CBool::FALSE, null_mut());
        assert!(ok);
        assert_eq!(*PREVIEWS.lock().unwrap(), vec![(1, 2, channels), (2, 2, channels), (1, 2, channels), (2, 2, channels)], "preview mode {mode}");
    }

    sd_set_progress_callback(Some(on_progress), ctx as *mut c_void);
    *CANCEL_AT.lock().unwrap() = Some((2, 1)); // SD_CANCEL_NEW_LATENTS after the first item
    let (ok, partial) = generate(ctx, &p);
    assert!(ok && partial.len() == 2, "cancelled new latents: {} images", partial.len());
    assert_eq!(&partial[..], &a[..]);
    *CANCEL_AT.lock().unwrap() = Some((1, 0)); // SD_CANCEL_ALL
    let (ok, none) = generate(ctx, &p);
    assert!(!ok && none.is_empty());
    *CANCEL_AT.lock().unwrap() = None;
    sd_set_progress_callback(None, null_mut());
    free_sd_ctx(ctx);
}
