//! Golden parity of Lens through the C ABI (`golden/lens/`): the GPT-OSS-20B LLM
//! (`llm_path`: the synthetic one is full width and depth, its large tensors sharing bytes,
//! loaded with mmap; layers 6/12/18/24 read), the Lens transformer (`diffusion_model_path`)
//! and Flux.2's VAE (`vae_path`) as separate files: defaults (cfg 7 with the empty negative
//! prompt, flow shift 1.83), cfg 1, cfg 3 with a negative prompt and attention weights,
//! dpm++2m + karras at 96×64, img2img, a prompt long enough for the sliding-window layers to
//! hide tokens, a prompt of accents, CJK, an emoji, digits and runs of spaces, flow shift 3 with
//! seamless tiling, a LoRA on every block linear in the DiT's own names, a reference image (which
//! neither library gives the transformer: the picture is cfg 1's). Without the LLM both
//! libraries refuse the context (the reference in its metadata validation).

mod common;

use common::parity::{report, run};

/// Every case under `SD_PARITY=full` (each encodes its prompts with a 24-layer LLM of width
/// 2880: seconds per prompt); otherwise cfg 1 alone.
#[test]
fn lens_cases() {
    report(&run("lens", |c| common::parity::full() || c.name == "lens_cfg1"));
}

/// Without its LLM the transformer has no text: a clean `new_sd_ctx` failure.
#[test]
fn lens_without_llm() {
    use common::parity::run_with;
    let cfg1 = |c: &common::parity::Case| c.name == "lens_cfg1";
    let without = run_with("lens", cfg1, |p, _| p.llm_path = std::ptr::null());
    assert_eq!((without[0].pass, without[0].note.as_str()), (false, "new_sd_ctx failed"));
}
