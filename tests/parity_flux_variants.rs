//! Golden parity of the Flux.1 variants that widen the DiT's input with concatenated latent
//! channels, through the C ABI: Flux Fill (`flux-fill/`: masked init image + the 8x8 pixel
//! mask per latent pixel), Flux Controls (`flux-controls/`: the encoded control image) and
//! Flex.2 (`flex2/`: masked init latent + latent mask + encoded control image), each with
//! txt2img, its inputs, strength and 3-way guidance. Without `SD_PARITY=full` one Flex.2
//! case (init image, mask and control image) runs.

mod common;

use common::parity::{full, report, run};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn flux_variants_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in flux_variants_all_cases");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("flex2", |c| c.name == "flex2_inpaint_control"));
}

#[test]
fn flux_variants_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut results = Vec::new();
    for f in ["flux-fill", "flux-controls", "flex2"] {
        results.extend(run(f, |_| true));
    }
    report(&results);
}
