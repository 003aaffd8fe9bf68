//! Golden parity of ERNIE-Image through the C ABI (`golden/ernie/`): the Ministral 3B LLM
//! (`llm_path`, layer 25 read), the ERNIE-Image transformer (`diffusion_model_path`) and
//! Flux.2's VAE (`vae_path`) as separate files: defaults (cfg 7 with the empty negative prompt,
//! flow shift 4), cfg 1, cfg 3 with a negative prompt and attention weights, dpm++2m + karras
//! at 96×64, img2img, flow shift 2 with seamless tiling; a DiT whose heads cannot hold its
//! RoPE (the reference aborts) must fail cleanly.

mod common;

use common::parity::{report, run};

/// Every case under `SD_PARITY=full` (the files are small and render in seconds, but CI's
/// time is short); otherwise the defaults, img2img and the DiT the reference aborts on.
#[test]
fn ernie_cases() {
    report(&run("ernie", |c| common::parity::full() || matches!(c.name.as_str(), "ernie_defaults" | "ernie_img2img" | "ernie_dit_heads64")));
}

/// Without its LLM the transformer has no text: a clean `new_sd_ctx` failure.
#[test]
fn ernie_llm_variants() {
    use common::parity::run_with;
    let cfg1 = |c: &common::parity::Case| c.name == "ernie_cfg1";
    let without = run_with("ernie", cfg1, |p, _| p.llm_path = std::ptr::null());
    assert_eq!((without[0].pass, without[0].note.as_str()), (false, "new_sd_ctx failed"));
}
