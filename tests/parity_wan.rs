//! Golden parity of Wan 2.x video through the C ABI (`golden/wan/`, rendered by the
//! reference's `generate_video`): the Wan2.1 T2V 1.3B transformer (`diffusion_model_path`),
//! UMT5-XXL (`t5xxl_path`) and the Wan2.1 VAE (`vae_path`) as separate full-size synthetic
//! files — API defaults (cfg 7, flow shift 5, 6 frames → 5), cfg 1 with 9 frames, cfg 4 with a
//! negative prompt, dpm++2m + karras, 96×64 with flow shift 3, no UMT5 (zero context), a
//! high/low-noise expert pair; Wan2.2 TI2V 5B text- and image-to-video with the 48-channel VAE;
//! a T5 given as UMT5 (a clean `new_sd_ctx` failure) and `generate_image` on Wan (the
//! reference crashes; ours must return false).
//!
//! Our own golden sets, rendered by the exact reference build (tests/fixtures/README.md,
//! "Wan modes"): `wan-i2v/` (Wan2.1 I2V 1.3B with the CLIP-vision tower), `wan-flf2v/`,
//! `wan-vace/`, `wan-lora/` (LoRA formats on the Wan transformer), `wan-moe/` (the expert
//! switch at `moe_boundary` with high-noise parameters and LoRAs) and `taehv/` (the tiny video
//! autoencoders from `taesd_path`: taew2_1 decoding T2V without a VAE file, encoding I2V's
//! conditioning video too, and `tae_preview_only`, where the VAE still decodes; a wide
//! decoder; taew2_2 on Wan2.2 TI2V, with and without an init image).
//!
//! The files are large (the 1.3B transformer alone is 2.8 GB, TI2V 10 GB, UMT5 needs ~16 GB
//! of memory to write): every case runs only with `SD_PARITY=full` (or the names in
//! `SD_WAN_CASE=name,...`). Each case takes about a minute on two cores.

mod common;

use common::logs::SERIAL;
use common::parity::{full, report, run};

/// Every golden folder of the Wan family.
const FOLDERS: [&str; 7] = ["wan", "wan-i2v", "wan-flf2v", "wan-vace", "wan-lora", "wan-moe", "taehv"];

#[test]
fn wan_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full (the Wan fixtures are several GB)");
        return;
    }
    // The progress and preview callbacks are process-wide: the behaviour test must not count
    // this test's steps.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&FOLDERS.iter().flat_map(|f| run(f, |_| true)).collect::<Vec<_>>());
}

/// The cases `SD_WAN_CASE=name[,name…]` names, for debugging.
#[test]
fn wan_selected_cases() {
    let Ok(names) = std::env::var("SD_WAN_CASE") else {
        eprintln!("skipped: set SD_WAN_CASE=name[,name...]");
        return;
    };
    let names: Vec<&str> = names.split(',').collect();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&FOLDERS.iter().flat_map(|f| run(f, |c| names.contains(&c.name.as_str()))).collect::<Vec<_>>());
}

mod behaviour {
    //! Progress, previews (one picture per frame; VAE and TAEHV ones) and cancel during
    //! `generate_video`, on the Wan2.1 T2V files without UMT5 (heavy: with `SD_PARITY=full` only).
    use super::common::parity::{ctx_params, ensure_fixtures, fixture_dir, full, vid_params, Arena};
    use stable_diffusion::capi::*;
    use std::ffi::{c_int, c_void};
    use std::sync::Mutex;

    static PROGRESS: Mutex<Vec<(i32, i32)>> = Mutex::new(Vec::new());
    static PREVIEWS: Mutex<Vec<(i32, i32, u32, u32)>> = Mutex::new(Vec::new());
    static CANCEL_AT: Mutex<Option<i32>> = Mutex::new(None);

    unsafe extern "C" fn on_progress(step: c_int, steps: c_int, _time: f32, data: *mut c_void) {
        PROGRESS.lock().unwrap().push((step, steps));
        if *CANCEL_AT.lock().unwrap() == Some(step) {
            sd_cancel_generation(data as *mut sd_ctx_t, sd_cancel_mode_t(0)); // SD_CANCEL_ALL
        }
    }

    unsafe extern "C" fn on_preview(step: c_int, n: c_int, frames: *mut sd_image_t, _noisy: CBool, _data: *mut c_void) {
        // SAFETY: n frames from the library, valid during the call.
        let f = unsafe { &*frames };
        assert!(!f.data.is_null());
        PREVIEWS.lock().unwrap().push((step, n, f.width, f.height));
    }

    fn run(ctx: *mut sd_ctx_t, params: &serde_json::Value) -> (bool, c_int) {
        let mut arena = Arena::default();
        let p = vid_params(params, &mut arena);
        let (mut frames, mut n, mut audio) = (std::ptr::null_mut(), 0, std::ptr::null_mut());
        // SAFETY: valid context and params, writable out-pointers.
        let ok = unsafe { generate_video(ctx, &p, &mut frames, &mut n, &mut audio) }.get();
        // SAFETY: freed once, as returned.
        unsafe { free_sd_images(frames, n) };
        (ok, n)
    }

    #[test]
    fn wan_progress_previews_and_cancel() {
        if !full() {
            eprintln!("skipped: set SD_PARITY=full (the Wan fixtures are several GB)");
            return;
        }
        let _serial = super::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let _ = fixture_dir();
        let ctx_fields = serde_json::json!({
            "model_path": "",
            "diffusion_model_path": "{fx}/wan21_t2v.safetensors",
            "vae_path": "{fx}/wan_vae.safetensors"
        });
        ensure_fixtures("", &ctx_fields);
        let mut arena = Arena::default();
        let cp = ctx_params("", &ctx_fields, &mut arena);
        // SAFETY: valid params.
        let ctx = unsafe { new_sd_ctx(&cp) };
        assert!(!ctx.is_null());
        assert!(sd_ctx_supports_video_generation(ctx).get() && !sd_ctx_supports_image_generation(ctx).get());
        let params = serde_json::json!({ "prompt": "a cat", "width": 64, "height": 64, "video_frames": 5,
            "sample_params.sample_steps": 2, "sample_params.guidance.txt_cfg": 1.0, "seed": 1 });
        sd_set_progress_callback(Some(on_progress), ctx as *mut c_void);
        // Projected previews: one picture per latent frame (2), every step.
        sd_set_preview_callback(Some(on_preview), preview_t(1), 1, CBool::TRUE, CBool::FALSE, std::ptr::null_mut());
        let (ok, n) = run(ctx, &params);
        assert!(ok && n == 5);
        assert_eq!(*PROGRESS.lock().unwrap(), vec![(0, 2), (1, 2), (2, 2)]);
        let previews = std::mem::take(&mut *PREVIEWS.lock().unwrap());
        assert_eq!(previews.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(), vec![(1, 2), (2, 2)], "{previews:?}");
        // VAE previews: the decoded video's 5 frames at full size.
        sd_set_preview_callback(Some(on_preview), preview_t(2), 2, CBool::TRUE, CBool::FALSE, std::ptr::null_mut());
        let (ok, _) = run(ctx, &params);
        assert!(ok);
        let previews = std::mem::take(&mut *PREVIEWS.lock().unwrap());
        assert_eq!(previews, vec![(2, 5, 64, 64)]);
        sd_set_preview_callback(None, preview_t(0), 1, CBool::FALSE, CBool::FALSE, std::ptr::null_mut());
        // Cancel after the first step: false and no frames.
        PROGRESS.lock().unwrap().clear();
        *CANCEL_AT.lock().unwrap() = Some(1);
        let (ok, n) = run(ctx, &params);
        *CANCEL_AT.lock().unwrap() = None;
        assert!(!ok && n == 0);
        sd_set_progress_callback(None, std::ptr::null_mut());
        // Bad requests on a live context: false, nothing returned.
        for bad in [serde_json::json!({ "video_frames": 0 }), serde_json::json!({ "video_frames": -4 }), serde_json::json!({ "video_frames": 100000 }), serde_json::json!({ "width": 0 })] {
            let (ok, n) = run(ctx, &bad);
            assert!(!ok && n == 0, "{bad}");
        }
        free_sd_ctx(ctx);

        // tae_preview_only with a TAEHV (taesd_path): the Wan VAE decodes, the tiny video
        // autoencoder makes every step's preview, the video's 5 frames at full size.
        let tae = serde_json::json!({ "model_path": "", "diffusion_model_path": "{fx}/wan21_t2v.safetensors",
            "vae_path": "{fx}/wan_vae.safetensors", "taesd_path": "{fx}/taew2_1.safetensors", "tae_preview_only": true });
        ensure_fixtures("", &tae);
        let mut arena = Arena::default();
        let cp = ctx_params("", &tae, &mut arena);
        // SAFETY: valid params.
        let ctx = unsafe { new_sd_ctx(&cp) };
        assert!(!ctx.is_null());
        sd_set_preview_callback(Some(on_preview), preview_t(2), 1, CBool::TRUE, CBool::FALSE, std::ptr::null_mut());
        let (ok, n) = run(ctx, &params);
        assert!(ok && n == 5);
        let previews = std::mem::take(&mut *PREVIEWS.lock().unwrap());
        assert_eq!(previews, vec![(1, 5, 64, 64), (2, 5, 64, 64)]);
        sd_set_preview_callback(None, preview_t(0), 1, CBool::FALSE, CBool::FALSE, std::ptr::null_mut());
        free_sd_ctx(ctx);

        // Contexts the reference cannot use either are clean failures: no VAE, and a
        // high-noise expert that is not a Wan transformer (the SD 1.x checkpoint).
        let no_vae = serde_json::json!({ "model_path": "", "diffusion_model_path": "{fx}/wan21_t2v.safetensors" });
        let mut arena = Arena::default();
        let cp = ctx_params("", &no_vae, &mut arena);
        // SAFETY: valid params.
        assert!(unsafe { new_sd_ctx(&cp) }.is_null());
        let foreign = serde_json::json!({ "model_path": "", "diffusion_model_path": "{fx}/wan21_t2v.safetensors",
            "high_noise_diffusion_model_path": "{fx}/sd1.safetensors", "vae_path": "{fx}/wan_vae.safetensors" });
        ensure_fixtures("", &foreign);
        let mut arena = Arena::default();
        let cp = ctx_params("", &foreign, &mut arena);
        // SAFETY: valid params.
        assert!(unsafe { new_sd_ctx(&cp) }.is_null());
    }
}
