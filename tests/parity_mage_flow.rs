//! Golden parity of Mage-Flow through the C ABI (`golden/mage-flow/`): the Qwen3-VL-4B text
//! model (`llm_path`, Qwen-Image's captioning template, the normed final state), the
//! Qwen-Image transformer at the sizes the reference fixes for Mage-Flow (12 blocks of 3072,
//! 128 latent channels one token per latent pixel, bf16-rounded timestep projection, its own
//! positions; `diffusion_model_path`, a 4.1e9-weight file whose tensors share one region of
//! bytes, loaded with mmap) and the Mage VAE (`vae_path`). Cases: cfg 1, the defaults
//! (euler, discrete, flow shift 6, cfg 7), 96×64, cfg 3 with a negative prompt, img2img
//! (the VAE's encoder), 80×48 (odd latent sides), a reference image as transformer tokens
//! (the `mage_flow` preset) at cfg 1 and with 3-way guidance, and with a Qwen3-VL vision
//! tower (`llm_vision_path`: the images also in the LLM's edit prompt) at cfg 1, cfg 3 and
//! with two images; an LLM of the wrong width (the reference aborts) must fail cleanly.
//!
//! Each transformer evaluation takes about 5 s on two cores: without `SD_PARITY=full` cfg 1
//! and the refused LLM run.

mod common;

use common::parity::{full, report, run};

#[test]
fn mage_flow_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in mage_flow_all_cases");
        return;
    }
    report(&run("mage-flow", |c| matches!(c.name.as_str(), "mage_cfg1" | "mage_llm80")));
}

#[test]
fn mage_flow_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("mage-flow", |_| true));
}
