//! Golden parity of LongCat-Image through the C ABI (`golden/longcat/`): the Qwen2.5-VL LLM
//! (`llm_path`, the normed final state after its captioning template), the Flux.1 transformer
//! in LongCat's layout (`diffusion_model_path`: 3584-wide text, no pooled vector, text ids on
//! rotary axes 1 and 2 and the images after them) and the 16-channel VAE: defaults (euler,
//! discrete, flow shift 3, cfg 7), cfg 1, quoted text spelled out, dpm++2m at 96×64 with a
//! negative prompt, img2img, a reference image as transformer tokens (the `longcat` preset)
//! with and without 3-way guidance; the edit prompt (`LongCatEditPipeline`: the reference
//! image also read by the LLM's vision tower, `llm_vision_path`) at cfg 1, cfg 3 with a
//! negative prompt, and with a reference of another size.
//!
//! Without `SD_PARITY=full` the quoted text, the reference image and the edit prompt at cfg 1
//! run.

mod common;

use common::parity::{full, report, run};

#[test]
fn longcat_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in longcat_all_cases");
        return;
    }
    report(&run("longcat", |c| matches!(c.name.as_str(), "longcat_quoted_text" | "longcat_ref_image" | "longcat_edit_cfg1")));
}

#[test]
fn longcat_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("longcat", |_| true));
}
