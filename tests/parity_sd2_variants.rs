//! Golden parity of the SD 2.x variants through the C ABI: the inpainting UNet and the tiny
//! UNet (`sd2-variants/`: txt2img, img2img and inpainting, the probed prediction, eps and v),
//! SDXS-512-0.9 with its tiny autoencoder (`sdxs09/`) and a ControlNet on SD 2.x
//! (`sd2-control/`). Without `SD_PARITY=full` one inpainting case runs (a 0.95 GB model).

mod common;

use common::parity::{full, report, run};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn sd2_variants_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in sd2_variants_all_cases");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("sd2-variants", |c| c.name == "inpaint_v_euler"));
}

#[test]
fn sd2_variants_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut results = Vec::new();
    for f in ["sd2-variants", "sdxs09", "sd2-control"] {
        results.extend(run(f, |_| true));
    }
    report(&results);
}
