//! Golden parity of MiniMax-H3 through the C ABI (`golden/minimax-h3/`, rendered by the
//! reference's `generate_video`): the joint audio-video transformer (`diffusion_model_path`),
//! layer 50 of a 51-layer Qwen3-VL text model (`llm_path`) and the transformer-decoder video
//! VAE (`vae_path`, its 2.9e9 weights sharing bytes: mmap) — cfg 1, cfg 4 with a negative
//! prompt, 96×64 with 9 frames aligned up to 22, flow shift 5 with fps 16 (overridden to 24),
//! 39 frames (two decoder chunks cross-faded), an LLM as wide as the transformer (no
//! condition_proj); the defaults (cfg 7 with the empty negative prompt: the reference aborts,
//! ours fails cleanly) and a Qwen2.5-VL text model (refused). Without an audio VAE no sound,
//! as the reference; with its audio VAE (`audio_vae_path`, `mm_sound_*`) the sound too (the
//! WAV beside the frames, within `SOUND_MAX_DIFF`): 5 frames at two settings and 22 frames,
//! and the files the reference refuses in `new_sd_ctx` (a layout not MiniMax-H3's, an audio
//! VAE for LingBot, a family without sound). With the tiny video autoencoder (`taesd_path`,
//! `mm_tae*`): 5 frames without a VAE file, 39 frames trimmed by chunks, 22 frames with sound.
//! Keyframes (`init_image`, `end_image`) through the VAE's encoder: I2VA, FL2VA at cfg 3 with a
//! negative prompt, the end frame alone over 22 frames at 96×64, I2VA with sound; Ref2VA
//! reference pictures (`ref_images`: one, three at 96×64 with cfg 3, one scaled down),
//! reference videos (`ref_videos`: 5 frames at 24 fps; a picture and 5 frames at 12 fps),
//! reference sound (`ref_audios`, a video's sound; without an audio VAE refused by both) and a
//! keyframe with a reference picture (refused by both); keyframes and a reference video through
//! the tiny video autoencoder's encoder (`mm_tae_fl2va`, `mm_tae_ref2va_video_96x64`).
//!
//! Without `SD_PARITY=full` only `mm_sound_i2va_seed3` (a start picture through the encoder,
//! the frames and their sound: about two minutes, the VAE's decoder is 2.4e9 weights whatever
//! the video's size, the audio decoder's seven upsamplings run on ggml's plain 1-D
//! convolutions), `mm_tae` (seconds) and the refused layout run.

mod common;

use common::parity::{full, report, run};

#[test]
fn minimax_h3_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in minimax_h3_all_cases");
        return;
    }
    report(&run("minimax-h3", |c| matches!(c.name.as_str(), "mm_sound_i2va_seed3" | "mm_tae" | "mm_sound_vae_wrong_layout")));
}

#[test]
fn minimax_h3_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run("minimax-h3", |_| true));
}
