//! Golden parity of Flux.2 klein through the C ABI (`golden/flux2/`): defaults (euler +
//! `flux2` scheduler, cfg 7), cfg 1, cfg 3 with a negative prompt, dpm++2m, discrete with
//! flow shift 3, 96×64, img2img, a reference-image edit, q8_0 (its own tolerance), and an
//! LLM with fewer layers than klein reads (the reference crashes; ours must fail cleanly).
//! Components are separate files (diffusion model, Qwen3 LLM, VAE) as users hold them.
//!
//! `golden/taef2/`: the same model with TAEF2 (`taesd_path`) decoding and encoding (txt2img,
//! img2img, a reference image, 96×64 without the VAE, defaults), and the reference's refusal
//! of a 4-channel TAESD for Flux.2 and of TAEF2 for SD 1.x.
//!
//! Without `SD_PARITY=full` one cfg-1 case of each runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn flux2_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in flux2_all_cases");
        return;
    }
    report(&run("flux2", |c| c.name == "klein_cfg1"));
    report(&run("taef2", |c| c.name == "taef2_img2img_cfg1"));
}

#[test]
fn flux2_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("flux2", |_| true));
    report(&run("taef2", |_| true));
}

/// The cases `SD_FLUX2_CASE=name[,name…]` names, for debugging.
#[test]
fn flux2_selected_cases() {
    let Ok(names) = std::env::var("SD_FLUX2_CASE") else {
        eprintln!("skipped: set SD_FLUX2_CASE=name[,name...]");
        return;
    };
    let names: Vec<&str> = names.split(',').collect();
    report(&run("flux2", |c| names.contains(&c.name.as_str())));
}
