//! Golden parity of the SD 1.x inpainting model (`golden/sd1-inpaint/`), run with
//! `SD_PARITY=full`.

mod common;

use common::parity::{full, report, run};

#[test]
fn sd1_inpaint_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("sd1-inpaint", |_| true));
}
