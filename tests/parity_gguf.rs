//! Golden parity of GGUF loading (`golden/sd1-gguf/`): the reference rendered these from its
//! own q8_0 conversion of the synthetic sd1 checkpoint; ours converts with `convert()` and
//! must render the same pictures. Runs with `SD_PARITY=full` (the conversion reads 2 GB).

mod common;

use common::parity::{full, report, run};

#[test]
fn sd1_gguf_q8_0_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("sd1-gguf", |_| true));
}
