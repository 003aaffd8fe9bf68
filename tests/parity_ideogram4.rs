//! Golden parity of Ideogram 4 through the C ABI (`golden/ideogram4/`): the transformer
//! (`diffusion_model_path`, one layer at the released widths, which the reference fixes), its
//! unconditional twin (`uncond_diffusion_model_path`), Qwen3-VL's text model (`llm_path`: 36
//! layers of 4096, 13 of them read) and Flux.2's VAE; the large tensors of the first three
//! share bytes, loaded with mmap. Cases: cfg 1, the defaults (euler, logit-normal schedule,
//! flow shift 1, cfg 7 with a text-free unconditional pass), cfg 3 with a negative prompt
//! (never encoded), the unconditional twin at cfg 3 and at cfg 1, dpm++2m + karras at 96×64,
//! img2img with the twin, flow shift 3 on the discrete schedule with seamless tiling; an LLM
//! of width 80 (the reference aborts) must fail cleanly.
//!
//! A transformer evaluation takes about 2 s and the LLM several on two cores: without
//! `SD_PARITY=full` only cfg 1 (two steps) and the refused LLM run.

mod common;

use common::parity::{full, report, run};

#[test]
fn ideogram4_cases() {
    report(&run("ideogram4", |c| full() || matches!(c.name.as_str(), "ideogram4_cfg1" | "ideogram4_llm_width80")));
}
