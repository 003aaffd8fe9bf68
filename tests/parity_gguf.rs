//! Golden parity of GGUF loading (`golden/sd1-gguf/`): the reference rendered these from its
//! own q8_0 conversion of the synthetic sd1 checkpoint (`sd1_ref_q8_0.gguf`). Our q8_0
//! conversion must render the same pictures; so must the reference's file when it is in the
//! fixture cache (BENCHMARKS.md says how to make it with the reference's `convert`). Runs
//! with `SD_PARITY=full` (the conversion reads 2 GB).

mod common;

use common::parity::{fixture_dir, full, our_q8_0, report, run, run_with};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn sd1_gguf_from_our_conversion() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ours = our_q8_0();
    report(&run_with("sd1-gguf", |_| true, |p, arena| p.model_path = arena.str(&ours.to_string_lossy())));
}

#[test]
fn sd1_gguf_from_the_reference_conversion() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    if !fixture_dir().join("sd1_ref_q8_0.gguf").exists() {
        eprintln!("skipped: no sd1_ref_q8_0.gguf (the reference's conversion) in the fixture cache");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("sd1-gguf", |_| true));
}
