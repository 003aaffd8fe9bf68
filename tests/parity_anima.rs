//! Golden parity of Anima through the C ABI (`golden/anima/`): the Qwen3 LLM (`llm_path`,
//! 1024 wide, its normed final state), the Anima DiT with its LLM adapter reading the
//! prompt's T5 token ids (`diffusion_model_path`) and the Wan2.1 VAE (`vae_path`): cfg 1,
//! defaults (euler, discrete, flow shift 3, cfg 7 with the empty negative prompt), cfg 3 with
//! a negative prompt and attention weights, dpm++2m + karras at 96×64, 72×56 (padded to whole
//! patches), img2img, reference images as transformer tokens (the `cosmos_reference` preset;
//! one of another size at cfg 3); an LLM of the wrong width (the reference aborts) must fail
//! cleanly.
//!
//! The files are large (a 2048-wide DiT, 445 MB; a 1024-wide LLM with the real vocabulary,
//! 334 MB), so without `SD_PARITY=full` only cfg 1 runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn anima_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in anima_all_cases");
        return;
    }
    report(&run("anima", |c| c.name == "anima_cfg1"));
}

#[test]
fn anima_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("anima", |_| true));
}
