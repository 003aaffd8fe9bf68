//! Golden parity of LTX-2.3 with sound through the C ABI (`golden/ltx-audio/`, rendered by the
//! reference's `generate_video`): the files of `golden/ltx` plus LTX-2.3's audio VAE and
//! vocoder (`audio_vae_path`): the frames and the sound `audio_out` returns, 16 kHz stereo,
//! and 48 kHz with the bandwidth extension.
//!
//! Without `SD_PARITY=full` only `ltxa_cfg1_9frames` runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn ltx_audio_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in ltx_audio_all_cases");
        return;
    }
    report(&run("ltx-audio", |c| c.name == "ltxa_cfg1_9frames"));
}

#[test]
fn ltx_audio_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("ltx-audio", |_| true));
}
