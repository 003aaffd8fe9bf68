//! Golden parity of Qwen-Image through the C ABI (`golden/qwenimage/`): the Qwen2.5-VL LLM
//! text encoder (`llm_path`), the Qwen-Image transformer (`diffusion_model_path`) and the
//! Wan2.1 VAE (`vae_path`) as separate files: defaults (cfg 7 with the empty negative prompt),
//! cfg 1, cfg 2.5 with a negative prompt, dpm++2m + karras, 96×64, img2img, flow shift 6, a
//! reference-image edit (EDIT mode without a vision tower: the reference latents only) and
//! q8_0 at load (its own tolerance). `golden/qwenimage-taehv/`: the tiny video autoencoder
//! taew2_1 (`taesd_path`) as the first stage instead of the VAE, txt2img and img2img.
//!
//! Without `SD_PARITY=full` the cfg 1 case and the TAEHV img2img case run; `SD_QWENIMAGE_CASE=name,...` runs the named
//! cases.

mod common;

use common::parity::{full, report, run};

/// The golden folders of Qwen-Image (the layered and vision variants have their own tests).
const FOLDERS: [&str; 2] = ["qwenimage", "qwenimage-taehv"];

#[test]
fn qwenimage_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in qwenimage_all_cases");
        return;
    }
    let pick = ["qwen_cfg1", "qwen_taehv_img2img"];
    report(&FOLDERS.iter().flat_map(|f| run(f, |c| pick.contains(&c.name.as_str()))).collect::<Vec<_>>());
}

#[test]
fn qwenimage_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&FOLDERS.iter().flat_map(|f| run(f, |_| true)).collect::<Vec<_>>());
}

/// The cases `SD_QWENIMAGE_CASE=name[,name…]` names, for debugging.
#[test]
fn qwenimage_selected_cases() {
    let Ok(names) = std::env::var("SD_QWENIMAGE_CASE") else {
        eprintln!("skipped: set SD_QWENIMAGE_CASE=name[,name...]");
        return;
    };
    let names: Vec<&str> = names.split(',').collect();
    report(&FOLDERS.iter().flat_map(|f| run(f, |c| names.contains(&c.name.as_str()))).collect::<Vec<_>>());
}

/// Missing components are clean `new_sd_ctx` failures, like the reference's ("model metadata
/// validation failed"): no LLM, no VAE. (The harness prints them as FAIL lines against the
/// golden case; the assertions below are the test.)
#[test]
fn qwenimage_missing_components() {
    use common::parity::run_with;
    let cfg1 = |c: &common::parity::Case| c.name == "qwen_cfg1";
    let without_llm = run_with("qwenimage", cfg1, |p, _| p.llm_path = std::ptr::null());
    assert_eq!((without_llm[0].pass, without_llm[0].note.as_str()), (false, "new_sd_ctx failed"));
    let without_vae = run_with("qwenimage", cfg1, |p, _| p.vae_path = std::ptr::null());
    assert_eq!((without_vae[0].pass, without_vae[0].note.as_str()), (false, "new_sd_ctx failed"));
}
