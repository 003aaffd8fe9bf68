//! Golden parity of the guidance variants (`golden/apg/`): adaptive projected guidance and
//! per-step guidance schedules (`extra_sample_args`) on SD 1.x and Z-Image, against the
//! reference's pictures. Without `SD_PARITY=full` one case runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn apg_and_schedules() {
    let pick = |name: &str| full() || name == "apg_eta0";
    report(&run("apg", |c| pick(&c.name)));
}
