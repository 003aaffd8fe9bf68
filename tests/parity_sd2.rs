//! Golden parity of SD 2.x generation (`golden/sd2/`), run with `SD_PARITY=full`.

mod common;

use common::parity::{full, report, run};

#[test]
fn sd2_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("sd2", |_| true));
}
