//! Golden parity of Boogu Image through the C ABI (`golden/boogu/`): Qwen3-VL's text model
//! (`llm_path`, its normed final state after Boogu's system prompt; a blank prompt gets the
//! edit system prompt), the Boogu Image transformer (`diffusion_model_path`: double-stream
//! and single-stream layers, grouped K/V heads) and Flux.1's 16-channel VAE (`vae_path`):
//! cfg 1, defaults (euler, discrete, flow shift 3.16, cfg 7 with the empty negative prompt),
//! cfg 3 with a negative prompt, 96×64 with another seed, img2img, reference images as
//! transformer tokens (the `z_image_omni` preset: one, one with 3-way guidance, two of other
//! sizes); the same with a Qwen3-VL vision tower (`llm_vision_path`: the edit prompt with the
//! pictures' embeddings; one, one with 3-way guidance, two, and `pass_to_vlm=false`); a DiT
//! whose heads do not split into its three RoPE axes (the reference aborts) must fail
//! cleanly.
//!
//! Without `SD_PARITY=full` cfg 1, the reference image with 3-way guidance and the reference
//! image through the vision tower run, and the refusal of a Qwen2.5-VL vision tower.

mod common;

use common::parity::{full, report, run};

#[test]
fn boogu_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in boogu_all_cases");
        return;
    }
    report(&run("boogu", |c| matches!(c.name.as_str(), "boogu_cfg1" | "boogu_ref1_img_cfg" | "boogu_vision_ref1_cfg1")));
}

#[test]
fn boogu_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("boogu", |_| true));
}

/// A Qwen2.5-VL vision tower beside Boogu's Qwen3-VL LLM: the reference declares Qwen3-VL's
/// tower and refuses the file's names ("model metadata validation failed" in new_sd_ctx);
/// ours refuses the tower's kind there too.
#[test]
fn boogu_qwen25_vision_tower_is_refused() {
    use common::parity::{fixture, run_with};
    fixture("qwen25vl_vision_tiny.safetensors");
    let with_tower = |p: &mut stable_diffusion::capi::sd_ctx_params_t, arena: &mut common::parity::Arena| {
        p.llm_vision_path = arena.str("{fx}/qwen25vl_vision_tiny.safetensors");
    };
    let refs = run_with("boogu", |c| c.name == "boogu_ref1_cfg1", with_tower);
    assert_eq!((refs[0].pass, refs[0].note.as_str()), (false, "new_sd_ctx failed"));
}
