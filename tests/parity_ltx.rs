//! Golden parity of LTX-2.3 through the C ABI (`golden/ltx/`, rendered by the reference's
//! `generate_video`): the joint audio-video transformer (`diffusion_model_path`), Gemma 3 at
//! the width and depth the LTXAV embedder fixes (`llm_path`, 2.3e9 weights sharing bytes:
//! mmap) with its text projection (`embeddings_connectors_path`) and the LTX video VAE
//! (`vae_path`) — cfg 1 with 9 frames, cfg 3 with a negative prompt at 96×64 with 17 frames,
//! one frame at 24 fps. No audio VAE: no sound, as the reference (sound: `parity_ltx_audio.rs`).
//! With `ltx_vae_i2v` (a VAE whose encoder compresses as its decoder expands): start and end
//! pictures (the start in latent frame 0, the end appended as a keyframe), at strengths 0.75,
//! 1 and 0.5. With `ltx_connectors_full`: the embeddings connectors; `ltx_vae_ts`: the
//! timestep-conditioned decoder; `ltx_upscaler`: the latent-upscale refine pass (`hires`).
//!
//! The reference pads every prompt to 1024 tokens and runs Gemma 3 over all of them (about
//! seven minutes per prompt here); ours computes only the prompt's tokens (seconds). Without
//! `SD_PARITY=full` only `ltx_cfg1_9frames` and `ltx_end_image_9frames` run.

mod common;

use common::parity::{full, report, run};

#[test]
fn ltx_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in ltx_all_cases");
        return;
    }
    report(&run("ltx", |c| c.name == "ltx_cfg1_9frames" || c.name == "ltx_end_image_9frames"));
}

#[test]
fn ltx_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("ltx", |_| true));
}
