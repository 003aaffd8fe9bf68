//! Golden parity of PuLID for Flux through the C ABI (`golden/pulid/`): the identity
//! cross-attentions after double block 0 and single block 0 of the tiny Flux fixture, fed
//! from a GGUF `pulid_id` embedding (f32, f16, 8 tokens), scaled by `id_weight` (1, 0.5, 0),
//! in both guidance passes, sitting out the skip-layer pass; and the reference's warnings
//! that leave the picture plain (no embedding file, a missing file, no `pulid_id` tensor, an
//! unreadable PuLID file, an embedding without PuLID weights, PuLID weights on Z-Image).
//! PuLID weights of another width than the model's are refused at new_sd_ctx like the
//! reference's; an embedding of another width than 2048 aborts the reference and is a
//! clean error here.
//!
//! Without `SD_PARITY=full` only the plain identity case runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn pulid_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in pulid_all_cases");
        return;
    }
    report(&run("pulid", |c| c.name == "pulid_w1"));
}

#[test]
fn pulid_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("pulid", |_| true));
}
