//! Golden parity of SD 1.x generation (`golden/sd1/`, `golden/sd1-extra/`): pictures and
//! final latents against the reference's. Without `SD_PARITY=full` only a quick subset runs.

mod common;

use common::parity::{full, report, run, run_with};
use std::sync::Mutex;

/// The tests of this file load the same multi-GB model: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A few representative cases: eps and v, a sampler with and without noise, img2img,
/// a batch and a single-pass (cfg 1) case.
#[test]
fn sd1_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in sd1_all_cases");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pick = ["defaults", "sampler_euler", "img2img", "batch_2", "cfg_1"];
    report(&run("sd1", |c| pick.contains(&c.name.as_str())));
}

#[test]
fn sd1_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("sd1", |_| true));
}

#[test]
fn sd1_extra_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("sd1-extra", |_| true));
}

/// With mmap on, CPU weights stored in their final type are computed from the mapped file in
/// place (no copy); the pictures are the same.
#[test]
fn sd1_mmap_in_place() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pick = if full() { &["sampler_euler", "img2img", "batch_2"][..] } else { &["sampler_euler"][..] };
    report(&run_with("sd1", |c| pick.contains(&c.name.as_str()), |p, _| p.enable_mmap = true.into()));
}
