//! Golden parity of ComfyUI INT8 checkpoints through the C ABI (`golden/int8/`): Krea2 with
//! 14 of its linear layers as `int8_tensorwise` rows (ConvRot groups 1, 4, 16, 64 and 256,
//! and rows without rotation, with and without a bias), rendered by the reference's AVX2
//! build with the fork's two INT8 ops (bench/build-reference.sh): cfg 1, the defaults (cfg 7),
//! 96×64, img2img, `wtype` q8_0 (the INT8 rows stay), a LoRA in `auto` mode and in
//! `immediately` mode (both at run time: the updates added to the layers' outputs); a file
//! whose ConvRot group does not divide its layer's inputs is refused.
//!
//! Without `SD_PARITY=full` cfg 1 and the LoRA run.

mod common;

use common::parity::{full, report, run};

#[test]
fn int8_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in int8_all_cases");
        return;
    }
    report(&run("int8", |c| matches!(c.name.as_str(), "int8_krea2_cfg1" | "int8_krea2_lora_1_0" | "int8_bad_group")));
}

#[test]
fn int8_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("int8", |_| true));
}
