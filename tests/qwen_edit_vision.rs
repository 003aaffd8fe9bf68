//! Qwen-Image-Edit with the Qwen2.5-VL vision tower (`llm_vision_path`) through the C ABI,
//! against pictures the reference (97d29908, AVX2) rendered from the same files
//! (`golden/qwenimage-vision/`, made with tests/tools/sd_capi.py): the golden edit case with
//! the synthetic tower (`qwen25vl_vision_tiny`: 8 blocks, windowed and full attention), two
//! reference images (`Picture 1:`, `Picture 2:`, one of them not square), cfg 2.5 with a
//! weighted prompt and a negative prompt (the unconditioned pass sees the images too),
//! `vlm_resize_mode=longest_side,vlm_size=160`; and with the tower loaded but unused (no
//! reference image; `pass_to_vlm=false`), which the reference renders exactly as the
//! `qwenimage/` cfg 1 and edit cases.
//!
//! The same tower as a llama.cpp mmproj GGUF (`tests/tools/mmproj_gguf.py`: clip names,
//! separate q/k/v) gives the reference the same picture, bit for bit; ours must match it too.
//!
//! Without `SD_PARITY=full` the first case runs.

mod common;

use common::parity::{fixture, fixture_dir, full, golden_image, report, run, run_with};
use stable_diffusion::capi::*;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

const FOLDER: &str = "qwenimage-vision";

#[test]
fn vision_edit_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in vision_edit_all_cases");
        return;
    }
    report(&run(FOLDER, |c| c.name == "qwen_vision_edit_cfg1"));
}

#[test]
fn vision_edit_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run(FOLDER, |_| true));
}

/// What the tower is for: the reference's picture of the edit case moves when the LLM sees
/// the image (so matching it checks the tower, not only the transformer's reference latents).
#[test]
fn the_tower_changes_the_reference_picture() {
    let with = golden_image(FOLDER, "qwen_vision_edit_cfg1_0.png");
    let without = golden_image("qwenimage", "qwen_edit_ref_cfg1_0.png");
    let (max, mean) = common::parity::diff_bytes(&with, &without);
    assert!(max > 30.0 && mean > 3.0, "the vision tower barely moved the picture: max {max} mean {mean}");
}

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn capture(level: sd_log_level_t, text: *const c_char, _: *mut c_void) {
    if level.0 == 3 {
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
        LOG.lock().unwrap_or_else(|e| e.into_inner()).push(text);
    }
}

/// A tower whose output does not have the LLM's width is a clean `new_sd_ctx` failure whose
/// message names both files' widths (here the 64-wide Qwen3 file as `llm_path`).
#[test]
fn tower_width_must_match_the_llm() {
    let llm = fixture("qwen3_tiny.safetensors");
    sd_set_log_callback(Some(capture), std::ptr::null_mut());
    let results = run_with(FOLDER, |c| c.name == "qwen_vision_edit_cfg1", |p, arena| p.llm_path = arena.str(&llm.to_string_lossy()));
    sd_set_log_callback(None, std::ptr::null_mut());
    assert_eq!((results[0].pass, results[0].note.as_str()), (false, "new_sd_ctx failed"));
    let errors = LOG.lock().unwrap().join("\n");
    assert!(errors.contains("llm_vision_path") && errors.contains("3584") && errors.contains("64 wide"), "{errors}");
}

/// The tower in llama.cpp's mmproj layout, written beside the fixtures on first use.
fn mmproj_gguf() -> std::path::PathBuf {
    let out = fixture_dir().join("qwen25vl_vision_tiny_mmproj.gguf");
    if !out.exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let py = std::process::Command::new(root.join("scripts/fixtures.sh")).arg("--python").output().expect("scripts/fixtures.sh --python");
        let py = String::from_utf8(py.stdout).expect("python path").trim().to_string();
        let st = std::process::Command::new(py)
            .arg(root.join("tests/tools/mmproj_gguf.py"))
            .arg(fixture("qwen25vl_vision_tiny.safetensors"))
            .arg(&out)
            .status()
            .expect("mmproj_gguf.py");
        assert!(st.success() && out.exists(), "mmproj_gguf.py failed");
    }
    out
}

#[test]
fn mmproj_gguf_tower_renders_the_same() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let gguf = mmproj_gguf();
    report(&run_with(FOLDER, |c| c.name == "qwen_vision_two_refs_cfg1", |p, arena| p.llm_vision_path = arena.str(&gguf.to_string_lossy())));
}
