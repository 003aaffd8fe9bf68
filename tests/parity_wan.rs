//! Golden parity of Wan 2.x video through the C ABI (`golden/wan/`, rendered by the
//! reference's `generate_video`): the Wan2.1 T2V 1.3B transformer (`diffusion_model_path`),
//! UMT5-XXL (`t5xxl_path`) and the Wan2.1 VAE (`vae_path`) as separate full-size synthetic
//! files — API defaults (cfg 7, flow shift 5, 6 frames → 5), cfg 1 with 9 frames, cfg 4 with a
//! negative prompt, dpm++2m + karras, 96×64 with flow shift 3, no UMT5 (zero context), a
//! high/low-noise expert pair; Wan2.2 TI2V 5B text- and image-to-video with the 48-channel VAE;
//! a T5 given as UMT5 (a clean `new_sd_ctx` failure) and `generate_image` on Wan (the
//! reference crashes; ours must return false).
//!
//! The files are large (the 1.3B transformer alone is 2.8 GB, TI2V 10 GB, UMT5 needs ~16 GB
//! of memory to write): every case runs only with `SD_PARITY=full` (or the names in
//! `SD_WAN_CASE=name,...`). Each case takes about a minute on two cores.

mod common;

use common::parity::{full, report, run};

#[test]
fn wan_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full (the Wan fixtures are several GB)");
        return;
    }
    report(&run("wan", |_| true));
}

/// The cases `SD_WAN_CASE=name[,name…]` names, for debugging.
#[test]
fn wan_selected_cases() {
    let Ok(names) = std::env::var("SD_WAN_CASE") else {
        eprintln!("skipped: set SD_WAN_CASE=name[,name...]");
        return;
    };
    let names: Vec<&str> = names.split(',').collect();
    report(&run("wan", |c| names.contains(&c.name.as_str())));
}
