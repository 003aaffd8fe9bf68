//! Golden parity of LongCat-Image through the C ABI (`golden/longcat/`): the Qwen2.5-VL LLM
//! (`llm_path`, the normed final state after its captioning template), the Flux.1 transformer
//! in LongCat's layout (`diffusion_model_path`: 3584-wide text, no pooled vector, text ids on
//! rotary axes 1 and 2 and the images after them) and the 16-channel VAE: defaults (euler,
//! discrete, flow shift 3, cfg 7), cfg 1, quoted text spelled out, dpm++2m at 96×64 with a
//! negative prompt, img2img, a reference image as transformer tokens (the `longcat` preset)
//! with and without 3-way guidance.
//!
//! Without `SD_PARITY=full` the quoted text and the reference image run.

mod common;

use common::parity::{full, report, run};

#[test]
fn longcat_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in longcat_all_cases");
        return;
    }
    report(&run("longcat", |c| c.name == "longcat_quoted_text" || c.name == "longcat_ref_image"));
}

#[test]
fn longcat_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("longcat", |_| true));
}
