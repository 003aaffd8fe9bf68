//! Golden parity of HiDream-O1 through the C ABI (`golden/hidream-o1/`): one file holding
//! the network, a Qwen3-VL-8B language model that denoises 32×32 RGB patches itself (the
//! conditioner only tokenizes the prompt), no autoencoder. The reference fixes every size,
//! so the fixture is a full-size 8B model whose tensors share one 1.25 GB region of bytes,
//! loaded with mmap. Cases: cfg 1, the defaults (euler, discrete, flow shift 3, cfg 7, eta
//! 8 scaling the starting noise), 96×64, cfg 3 with a negative prompt, eta 1, img2img, edit
//! (`pass_to_vlm=true`: reference images through the checkpoint's Qwen3-VL vision tower and as
//! patch tokens) with one image at 64² and 32² and two images; sides that are no multiple of
//! 32 and a reference image too small for one patch (the reference aborts) must fail cleanly.
//!
//! Each network evaluation takes about 14 s on two cores (about 60 s with an edit prompt's
//! 144 vision tokens): without `SD_PARITY=full` only the 80×64 request and the too-small
//! reference image run (the file detected, mapped and refused before any evaluation).

mod common;

use common::parity::{full, report, run};

#[test]
fn hidream_o1_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in hidream_o1_all_cases");
        return;
    }
    report(&run("hidream-o1", |c| c.name == "hidream_o1_80x64" || c.name == "hidream_o1_edit_32_wide"));
}

#[test]
fn hidream_o1_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("hidream-o1", |_| true));
}
