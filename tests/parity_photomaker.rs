//! Golden parity of PhotoMaker v1 and v2 on SDXL through the C ABI (`golden/photomaker-v1/`,
//! `golden/photomaker-v2/`): the ID encoder (CLIP ViT-L/14 tower, fuse module; v2's Q-Former
//! perceiver over the face embeddings of `id_embed_path`), the trigger word's class tokens
//! replaced by the fused embeddings, the start-merge step from `style_strength`, the file's
//! LoRA on the UNet, and the reference's warnings that turn PhotoMaker off (no ID images, no
//! trigger word, no or mismatched ID embeddings for v2: those pictures carry only the LoRA).
//! ID images of other sizes are cropped and scaled to 224² like the reference's. A
//! PhotoMaker file with an SD 1.x model aborts the reference (its fuse module takes SDXL's
//! 2048-wide context): ours refuses the request.
//!
//! Without `SD_PARITY=full` only v1 with one ID image runs (the files are full size: the
//! tower alone is a ViT-L).

mod common;

use common::parity::{full, report, run};

#[test]
fn photomaker_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in photomaker_all_cases");
        return;
    }
    report(&run("photomaker-v1", |c| c.name == "pm_v1_trigger"));
}

#[test]
fn photomaker_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let mut results = run("photomaker-v1", |_| true);
    results.extend(run("photomaker-v2", |_| true));
    report(&results);
}
