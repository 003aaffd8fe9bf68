//! AnimateDiff through the C ABI: the synthetic SD 1.x checkpoint with a synthetic motion
//! module (`motion_module_path`, the mm_sd_v15_v2 layout) rendering frames through
//! `generate_video`, against `golden/animatediff/` (rendered by the exact reference: 4 to 32
//! frames, cfg with a negative prompt, DPM++2M + Karras, img2img, more than 32 frames capped,
//! the latent hires fix, one frame, and 64×64 where the reference aborts), and its bad
//! inputs: a file without a motion module, one with wrong tensors, a model the reference runs
//! no AnimateDiff on.
//!
//! Without `SD_PARITY=full`: the 4-frame case and the two bad files (the fixtures are 2.1 and
//! 0.9 GB; a case takes 15 s to a few minutes on two cores).

mod common;

use common::parity::{ctx_params, ensure_fixtures, fixture, full, report, run, vid_params, Arena};
use stable_diffusion::capi::*;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());
static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_log(_level: sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    // SAFETY: a NUL-terminated message from the library.
    LOG.lock().unwrap().push(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned());
}

#[test]
fn animatediff_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in animatediff_all_cases");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("animatediff", |c| c.name == "ad_4frames_128x64"));
}

#[test]
fn animatediff_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("animatediff", |_| true));
}

/// A context of `fields` (`{fx}/` files made when missing), its log, and what it supports.
fn context(fields: serde_json::Value) -> (*mut sd_ctx_t, Vec<String>) {
    ensure_fixtures("", &fields);
    let mut arena = Arena::default();
    let p = ctx_params("", &fields, &mut arena);
    sd_set_log_callback(Some(on_log), std::ptr::null_mut());
    LOG.lock().unwrap().clear();
    // SAFETY: p and what it points to are alive during the call.
    let ctx = unsafe { new_sd_ctx(&p) };
    let log = std::mem::take(&mut *LOG.lock().unwrap());
    (ctx, log)
}

/// Runs `generate_video` for 2 frames; (ok, frames).
fn video(ctx: *mut sd_ctx_t, w: i32) -> (bool, i32) {
    let mut arena = Arena::default();
    let params = serde_json::json!({ "prompt": "a cat", "width": w, "height": 64, "video_frames": 2,
        "sample_params.sample_steps": 1, "sample_params.guidance.txt_cfg": 1.0, "seed": 1 });
    let p = vid_params(&params, &mut arena);
    let (mut frames, mut n, mut audio) = (std::ptr::null_mut(), 0, std::ptr::null_mut());
    // SAFETY: valid context and params, writable out-pointers.
    let ok = unsafe { generate_video(ctx, &p, &mut frames, &mut n, &mut audio) }.get();
    // SAFETY: freed once, as returned.
    unsafe { free_sd_images(frames, n) };
    (ok, n)
}

/// A context of `fields` loads, warns `why` and "ignoring motion_module_path", and makes
/// pictures but no video.
fn assert_motion_module_ignored(fields: serde_json::Value, why: &str) {
    let (ctx, log) = context(fields);
    assert!(!ctx.is_null(), "{log:#?}");
    let warned = |what: &str| log.iter().any(|l| l.contains(what));
    assert!(warned(why) && warned("ignoring motion_module_path"), "{log:#?}");
    assert!(sd_ctx_supports_image_generation(ctx).get() && !sd_ctx_supports_video_generation(ctx).get());
    assert_eq!(video(ctx, 128), (false, 0));
    free_sd_ctx(ctx);
}

/// A safetensors file of f32 zeros with the given (name, torch shape) tensors.
fn write_tensors(name: &str, tensors: &[(&str, &[usize])]) -> String {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (n, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * 4;
        header.insert(n.to_string(), serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes] }));
        offset += bytes;
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.resize(out.len() + offset, 0);
    let path = std::env::temp_dir().join(format!("{name}-{}.safetensors", std::process::id()));
    std::fs::write(&path, out).unwrap();
    path.to_string_lossy().into_owned()
}

/// A file with no motion module in it (a TAESD) is ignored with a warning naming the field,
/// as the reference ignores its tensors: pictures as before, no video.
#[test]
fn a_file_without_a_motion_module_is_ignored_with_a_warning() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let taesd = fixture("taesd.safetensors").to_string_lossy().into_owned();
    assert_motion_module_ignored(serde_json::json!({ "model_path": "{fx}/sd1.safetensors", "motion_module_path": taesd }), "holds no AnimateDiff motion module");
}

/// A motion module whose tensors are missing or of another shape (here the 24-frame table of
/// the v1 modules) fails `new_sd_ctx` naming a tensor, as the reference's loader does.
#[test]
fn a_motion_module_with_wrong_tensors_fails_the_context() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let block = "down_blocks.0.motion_modules.0.temporal_transformer";
    let pe = format!("{block}.transformer_blocks.0.attention_blocks.0.pos_encoder.pe");
    let proj_in = format!("{block}.proj_in.weight");
    let file = write_tensors("motion-v1-like", &[(proj_in.as_str(), &[320, 320]), (pe.as_str(), &[1, 24, 320])]);
    let (ctx, log) = context(serde_json::json!({ "model_path": "{fx}/sd1.safetensors", "motion_module_path": file }));
    let _ = std::fs::remove_file(&file);
    assert!(ctx.is_null(), "new_sd_ctx accepted an incomplete motion module");
    assert!(log.iter().any(|l| l.contains("motion_module.") && (l.contains("shape") || l.contains("not found"))), "{log:#?}");
}

/// Only SD 1.x (and its inpaint / instruct-pix2pix UNets) take motion modules in the
/// reference; another model warns at load and keeps generating pictures, not video.
#[test]
fn a_motion_module_on_another_model_is_ignored_with_a_warning() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full (loads the SD 1.x tiny UNet checkpoint)");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fields = serde_json::json!({ "model_path": "{fx}/sd1_tiny.safetensors", "motion_module_path": "{fx}/animatediff_sd15.safetensors" });
    assert_motion_module_ignored(fields, "apply to SD 1.x models only");
}

/// With a motion module loaded, pictures are unchanged (one frame: the modules do not run)
/// and the context generates video as well.
#[test]
fn pictures_are_unchanged_with_a_motion_module() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let params = serde_json::json!({ "prompt": "a lovely cat", "width": 64, "height": 64, "seed": 42, "sample_params.sample_steps": 2 });
    let mut pictures = Vec::new();
    for fields in [
        serde_json::json!({ "model_path": "{fx}/sd1.safetensors" }),
        serde_json::json!({ "model_path": "{fx}/sd1.safetensors", "motion_module_path": "{fx}/animatediff_sd15.safetensors" }),
    ] {
        let (ctx, log) = context(fields);
        assert!(!ctx.is_null(), "{log:#?}");
        assert!(sd_ctx_supports_image_generation(ctx).get());
        pictures.push((common::parity::render_params(ctx, &params), sd_ctx_supports_video_generation(ctx).get()));
        free_sd_ctx(ctx);
    }
    assert!(pictures[0].0 == pictures[1].0, "a motion module changed a picture");
    assert_eq!((pictures[0].1, pictures[1].1), (false, true));
}
