//! Golden parity of the DiT families through the C ABI: `golden/flux/` (dev defaults and API
//! defaults, samplers and schedulers, distilled guidance, real CFG with a negative prompt,
//! non-square, img2img, discrete flow shift, CLIP-L, long prompts, Kontext reference image,
//! q8_0 at load, schnell), `golden/chroma/` and `golden/sd3/` (SD3 and SD3.5 Medium-style,
//! SLG, T5 only). Components are separate files (diffusion model, T5, CLIP-L/G, VAE) as users
//! hold them. The cases that crash the reference must fail cleanly or render here.
//!
//! Without `SD_PARITY=full` one small Flux case and one SD3 case run.

mod common;

use common::parity::{full, report, run};
use std::sync::Mutex;

/// One model set at a time (CLIP-G alone is 1.4 GB).
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn dit_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in dit_all_cases");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut results = run("flux", |c| c.name == "flux_defaults");
    results.extend(run("sd3", |c| c.name == "sd3_t5_only"));
    report(&results);
}

#[test]
fn dit_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut results = Vec::new();
    for folder in ["flux", "chroma", "sd3"] {
        results.extend(run(folder, |_| true));
    }
    report(&results);
}

/// The cases `SD_DIT_CASE=folder[/name]` names (a whole folder without a name), for debugging.
#[test]
fn dit_selected_cases() {
    let Ok(spec) = std::env::var("SD_DIT_CASE") else {
        eprintln!("skipped: set SD_DIT_CASE=folder[/name]");
        return;
    };
    let (folder, name) = spec.split_once('/').unwrap_or((spec.as_str(), ""));
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run(folder, |c| name.is_empty() || c.name == name));
}
