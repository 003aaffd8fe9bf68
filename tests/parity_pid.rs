//! Golden parity of PiD through the C ABI (`golden/pid/`): Gemma 2 (`llm_path`, the normed
//! final state of the prompt after a space, padded to the reference's fixed length), the PiD
//! transformer (`diffusion_model_path`, 1536 wide, 14 patch and 2 pixel blocks) on pixels,
//! and the VAE that encodes its required low-quality reference image (`vae_path`, 16
//! channels by default): defaults (lcm, flow shift 1.5, cfg 7), cfg 1, cfg 3 with a negative
//! prompt and attention weights, euler at 96×64, 72×56 (padded to the patches), a prompt
//! past the fixed length, and every `vae_format` (flux, sd3, wan, flux2 with a PiD whose LQ
//! projection takes 128 channels). PiD 1.5 (`lq_proj.pit_head`: replicate-padded LQ
//! convolutions, the pit head gated in after the patch blocks, RoPE against a 128 grid) at cfg
//! 1, at 72×56 with cfg 3 and a negative prompt, and with a 32-channel LQ projection over
//! Flux.2's unpatchified latent and per-token gates. Flux.2's latent into a 16-channel LQ
//! projection, an init image (img2img) and a PiD 1.5 LQ projection of 128 channels abort the
//! reference: ours fail cleanly; without a reference image both fail.
//!
//! The files are large in count (the reference fixes PiD's widths and Gemma's vocabulary),
//! so without `SD_PARITY=full` only cfg 1 and the img2img and PiD 1.5 refusals run.

mod common;

use common::parity::{full, report, run};

#[test]
fn pid_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in pid_all_cases");
        return;
    }
    report(&run("pid", |c| matches!(c.name.as_str(), "pid_cfg1" | "pid_img2img" | "pid15_lq128")));
}

#[test]
fn pid_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("pid", |_| true));
}
