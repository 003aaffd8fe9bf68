//! Golden parity of Krea2 through the C ABI (`golden/krea2/`): twelve layers of Qwen3-VL's
//! text model (`llm_path`, outputs of layers 2, 5, …, 35 after Qwen-Image's system prompt),
//! the Krea2 transformer (`diffusion_model_path`, diffusers names) and the Wan2.1 VAE
//! (`vae_path`) as separate files: defaults (euler, discrete schedule, flow shift 1.15, cfg 7
//! with the empty negative prompt), cfg 1, 96×64, cfg 3 with a negative prompt, another prompt
//! with an attention weight, img2img, a reference image as transformer tokens with the
//! default `krea2_ostris_edit` preset (modulated for timestep 0) and with `krea2_edit`, two
//! references of different sizes at cfg 3; with a Qwen3-VL vision tower (`llm_vision_path`)
//! one reference and two (the pictures' embeddings in the user turn as well), and
//! `pass_to_vlm=false`; an LLM whose width is not the text fusion's (the reference aborts)
//! must fail cleanly.
//!
//! Without `SD_PARITY=full` cfg 1 and the default reference image run.

mod common;

use common::parity::{full, report, run};

#[test]
fn krea2_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in krea2_all_cases");
        return;
    }
    report(&run("krea2", |c| matches!(c.name.as_str(), "krea2_cfg1" | "krea2_ref_cfg1")));
}

#[test]
fn krea2_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("krea2", |_| true));
}
