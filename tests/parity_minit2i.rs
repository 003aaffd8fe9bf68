//! Golden parity of MiniT2I through the C ABI (`golden/minit2i/`): T5 (`t5xxl_path`, the
//! prompt's tokens without EOS padded to 256, padding masked) and the MiniT2I transformer
//! (`diffusion_model_path`) on pixels, no autoencoder: cfg 1, defaults (euler on MiniT2I's
//! linear sigmas, cfg 7 whose unconditional pass masks the whole prompt), cfg 3 with a
//! negative prompt (never encoded), 48×48 with another seed, dpm++2m + karras (the scheduler
//! is not read), img2img (the init picture does not reach the latent), and without T5 (zeros
//! and a zero mask, for a transformer that takes 1024-wide text). Where the reference aborts,
//! ours must fail cleanly: a non-square picture, sides that are not multiples of the patch,
//! an f16 mask token, T5 states of another width than the transformer's, no T5 for a
//! transformer that is not 1024 wide.
//!
//! Without `SD_PARITY=full` the defaults and the run without T5 run.

mod common;

use common::parity::{full, report, run};

#[test]
fn minit2i_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in minit2i_all_cases");
        return;
    }
    report(&run("minit2i", |c| matches!(c.name.as_str(), "minit2i_defaults" | "minit2i_no_t5")));
}

#[test]
fn minit2i_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("minit2i", |_| true));
}
