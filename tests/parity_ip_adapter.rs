//! Golden parity of IP-Adapter through the C ABI (`golden/ip-adapter/` on the SD 1.x fixture,
//! `golden/ip-adapter-sdxl/` on the SDXL one): the adapter file (`ip_adapter_path`: the image
//! projection and `to_k_ip` / `to_v_ip` in the UNet's cross-attentions) and the OpenCLIP
//! ViT-H/14 vision tower (`clip_vision_path`) the reference always builds. Plain adapters
//! (pooled projection → 4 tokens) at strength 1 and 0.5, with img2img; Plus adapters
//! (Resampler over the penultimate hidden states → 16 tokens), also at cfg 1; the adapter
//! without an image (the picture without an adapter); and the refusals the reference makes in
//! new_sd_ctx: no CLIP vision file, an adapter for the other model family.
//!
//! Without `SD_PARITY=full` only the SD 1.x plain adapter at strength 1 runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn ip_adapter_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in ip_adapter_all_cases");
        return;
    }
    report(&run("ip-adapter", |c| c.name == "ip_strength_1"));
}

#[test]
fn ip_adapter_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("ip-adapter", |_| true));
}

#[test]
fn ip_adapter_sdxl_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("ip-adapter-sdxl", |_| true));
}
