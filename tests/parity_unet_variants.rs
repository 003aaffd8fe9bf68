//! Golden parity of the smaller UNet variants through the C ABI: SD 1.x instruct-pix2pix
//! (`sd1_pix2pix/`), the tiny SD 1.x UNet (`sd1_tiny/`) and SDXS-512-DS with its own tiny
//! autoencoder (`sdxs/`). Without `SD_PARITY=full` one case of each of the two small
//! models runs.

mod common;

use common::parity::{full, report, run};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn unet_variants_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in unet_variants_all_cases");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut results = run("sd1_tiny", |c| c.name == "txt2img_v_euler");
    results.extend(run("sdxs", |c| c.name == "txt2img_eps_1step"));
    report(&results);
}

#[test]
fn unet_variants_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut results = Vec::new();
    for f in ["sd1_pix2pix", "sd1_tiny", "sdxs"] {
        results.extend(run(f, |_| true));
    }
    report(&results);
}
