//! Golden parity of LingBot Video through the C ABI (`golden/lingbot/`, rendered by the
//! reference's `generate_video`): the LingBot Video transformer (`diffusion_model_path`: a dense
//! block and a mixture-of-experts block with the reference's fixed 128 experts), Qwen3-VL's
//! text model (`llm_path`) and the Wan2.1 VAE — defaults (euler, discrete, flow shift 3, cfg 7
//! with the empty negative prompt), cfg 1, cfg 4 with a negative prompt, 96×64 with 9 frames;
//! image-to-video (the init image's latent as the kept first frame) without a vision tower and
//! with an end image (not used), with the Qwen3-VL vision tower (`llm_vision_path`: the init
//! image also read by the LLM) at cfg 1 and at cfg 3 with a negative prompt at 96×64; and an
//! LLM narrower than the text embedder (the reference aborts; ours fails cleanly).
//!
//! Without `SD_PARITY=full` only the image-to-video case with the vision tower runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn lingbot_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in lingbot_all_cases");
        return;
    }
    report(&run("lingbot", |c| c.name == "lingbot_i2v_vision"));
}

#[test]
fn lingbot_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("lingbot", |_| true));
}
