//! generate_image's behaviour through the C ABI on the synthetic SD1 checkpoint, beyond the
//! pictures (those are the parity tests): the progress callback after every step, previews,
//! the three cancel modes, seeds, and the refusals of bad requests and bad files.
//! Everything runs in one test: the callbacks are process-wide.

mod common;

use common::parity::{fixture, generate};
use stable_diffusion::capi::*;
use std::ffi::{c_int, c_void, CString};
use std::ptr::{null, null_mut};
use std::sync::Mutex;

static PROGRESS: Mutex<Vec<(i32, i32)>> = Mutex::new(Vec::new());
static PREVIEWS: Mutex<Vec<(i32, i32, u32, u32, bool)>> = Mutex::new(Vec::new());
static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// (step at which to cancel, mode) for the progress callback.
static CANCEL_AT: Mutex<Option<(i32, u32)>> = Mutex::new(None);

unsafe extern "C" fn on_progress(step: c_int, steps: c_int, _time: f32, data: *mut c_void) {
    PROGRESS.lock().unwrap().push((step, steps));
    // In the log too, so that a test sees what was logged before and after a step.
    LOG.lock().unwrap().push(format!("<progress {step}/{steps}>"));
    if let Some((at, mode)) = *CANCEL_AT.lock().unwrap() {
        if step == at {
            sd_cancel_generation(data as *mut sd_ctx_t, sd_cancel_mode_t(mode));
        }
    }
}

unsafe extern "C" fn on_preview(step: c_int, n: c_int, frames: *mut sd_image_t, noisy: CBool, _data: *mut c_void) {
    // SAFETY: n frames from the library, valid during the call.
    let f = unsafe { &*frames };
    assert!(n >= 1 && !f.data.is_null());
    PREVIEWS.lock().unwrap().push((step, n, f.width, f.height, noisy.get()));
}

unsafe extern "C" fn on_log(_level: sd_log_level_t, text: *const std::ffi::c_char, _data: *mut c_void) {
    // SAFETY: a NUL-terminated message from the library.
    let s = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned();
    LOG.lock().unwrap().push(s);
}

fn params(prompt: &CString, steps: i32, batch: i32, seed: i64) -> sd_img_gen_params_t {
    let mut p = std::mem::MaybeUninit::<sd_img_gen_params_t>::uninit();
    // SAFETY: init writes every field.
    let mut p = unsafe {
        sd_img_gen_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    p.prompt = prompt.as_ptr();
    p.width = 64;
    p.height = 64;
    p.seed = seed;
    p.batch_count = batch;
    p.sample_params.sample_steps = steps;
    p.sample_params.sample_method = sample_method_t(0); // EULER
    p
}

fn reset_records() {
    PROGRESS.lock().unwrap().clear();
    PREVIEWS.lock().unwrap().clear();
    LOG.lock().unwrap().clear();
    *CANCEL_AT.lock().unwrap() = None;
}

#[test]
fn generation_behaviour() {
    let model = CString::new(fixture("sd1.safetensors").to_string_lossy().as_bytes()).unwrap();
    sd_set_log_callback(Some(on_log), null_mut());

    // A file that is not a model: NULL and a log line naming it.
    let bogus = std::env::temp_dir().join(format!("not-a-model-{}.safetensors", std::process::id()));
    std::fs::write(&bogus, b"this is not a checkpoint").unwrap();
    let bogus_c = CString::new(bogus.to_string_lossy().as_bytes()).unwrap();
    let mut cp = std::mem::MaybeUninit::<sd_ctx_params_t>::uninit();
    // SAFETY: init writes every field.
    let mut cp = unsafe {
        sd_ctx_params_init(cp.as_mut_ptr());
        cp.assume_init()
    };
    cp.n_threads = 2;
    cp.model_path = bogus_c.as_ptr();
    // SAFETY: valid params.
    assert!(unsafe { new_sd_ctx(&cp) }.is_null());
    let name = bogus.to_string_lossy().into_owned();
    assert!(LOG.lock().unwrap().iter().any(|l| l.contains(&name)), "no log line names {name}: {:?}", LOG.lock().unwrap());
    std::fs::remove_file(&bogus).ok();

    cp.model_path = model.as_ptr();
    LOG.lock().unwrap().clear();
    // SAFETY: valid params.
    let ctx = unsafe { new_sd_ctx(&cp) };
    assert!(!ctx.is_null(), "new_sd_ctx(sd1) failed: {:?}", LOG.lock().unwrap());
    let vae_loads = || LOG.lock().unwrap().iter().filter(|l| l.contains(" - VAE: loaded")).count();
    assert_eq!(vae_loads(), 0, "without eager_load the VAE is read when first used");
    assert!(sd_ctx_supports_image_generation(ctx).get());
    assert!(!sd_ctx_supports_video_generation(ctx).get());
    // An image model given to generate_video: false, nothing returned, an error naming why.
    {
        let mut v = std::mem::MaybeUninit::<sd_vid_gen_params_t>::uninit();
        // SAFETY: init writes every field.
        let mut v = unsafe {
            sd_vid_gen_params_init(v.as_mut_ptr());
            v.assume_init()
        };
        v.width = 64;
        v.height = 64;
        let (mut frames, mut n, mut audio) = (std::ptr::dangling_mut::<sd_image_t>(), -1, std::ptr::dangling_mut::<sd_audio_t>());
        LOG.lock().unwrap().clear();
        // SAFETY: valid context and params, writable out-pointers.
        assert!(!unsafe { generate_video(ctx, &v, &mut frames, &mut n, &mut audio) }.get());
        assert!(frames.is_null() && n == 0 && audio.is_null());
        assert!(LOG.lock().unwrap().iter().any(|l| l.contains("image model") && l.contains("generate_image")), "{:?}", LOG.lock().unwrap());
    }
    sd_set_progress_callback(Some(on_progress), ctx as *mut c_void);
    let prompt = CString::new("a lovely cat").unwrap();

    // Progress after every step of every batch item; the same seed gives the same picture.
    reset_records();
    let (ok, a) = generate(ctx, &params(&prompt, 3, 2, 7));
    assert!(ok && a.len() == 2);
    assert_eq!(*PROGRESS.lock().unwrap(), vec![(0, 3), (1, 3), (2, 3), (3, 3), (0, 3), (1, 3), (2, 3), (3, 3)]);
    // The VAE was read for the first decode, after the first item's sampling, once.
    {
        let log = LOG.lock().unwrap();
        let loaded = log.iter().position(|l| l.contains(" - VAE: loaded")).expect("the VAE is loaded for the decode");
        assert!(log[..loaded].iter().any(|l| l == "<progress 3/3>"), "the VAE was read before sampling: {log:?}");
        assert_eq!(log.iter().filter(|l| l.contains(" - VAE: loaded")).count(), 1);
    }
    assert!(a.iter().all(|(w, h, c, d)| (*w, *h, *c) == (64, 64, 3) && d.len() == 64 * 64 * 3));
    assert_ne!(a[0].3, a[1].3, "batch items use different seeds");
    let (_, b) = generate(ctx, &params(&prompt, 3, 1, 7));
    assert_eq!(a[0].3, b[0].3, "seed 7 renders the same picture twice");
    assert_eq!(vae_loads(), 1, "the VAE stays loaded after its first use");
    let (_, c) = generate(ctx, &params(&prompt, 3, 1, 8));
    assert_eq!(a[1].3, c[0].3, "batch item 2 uses seed + 1");

    // seed -1 picks a random seed and still renders.
    let (ok, r) = generate(ctx, &params(&prompt, 1, 1, -1));
    assert!(ok && r.len() == 1);

    // Previews (projection of the latents) every step.
    reset_records();
    sd_set_preview_callback(Some(on_preview), preview_t(1), 1, CBool::TRUE, CBool::FALSE, null_mut());
    let (ok, _) = generate(ctx, &params(&prompt, 2, 1, 1));
    sd_set_preview_callback(None, preview_t(0), 1, CBool::FALSE, CBool::FALSE, null_mut());
    assert!(ok);
    let previews = PREVIEWS.lock().unwrap().clone();
    assert_eq!(previews.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2], "{previews:?}");
    assert!(previews.iter().all(|p| p.1 == 1 && p.2 > 0 && p.3 > 0 && !p.4));

    // Cancel everything during the first item: false, no images.
    reset_records();
    *CANCEL_AT.lock().unwrap() = Some((1, 0));
    let (ok, imgs) = generate(ctx, &params(&prompt, 3, 2, 1));
    assert!(!ok && imgs.is_empty());
    // Cancel new latents during the first item: that item finishes, the second never starts.
    reset_records();
    *CANCEL_AT.lock().unwrap() = Some((2, 1));
    let (ok, imgs) = generate(ctx, &params(&prompt, 3, 3, 1));
    assert!(ok && imgs.len() == 1, "ok {ok}, {} images", imgs.len());
    // A new generation starts uncancelled.
    reset_records();
    let (ok, imgs) = generate(ctx, &params(&prompt, 1, 1, 1));
    assert!(ok && imgs.len() == 1);

    // Bad requests: false with a logged reason, outputs cleared.
    for bad in [
        {
            let mut p = params(&prompt, 1, 1, 1);
            p.width = 0;
            p
        },
        {
            let mut p = params(&prompt, 1, 1, 1);
            p.prompt = null();
            p
        },
        {
            let mut p = params(&prompt, 1, 1, 1);
            p.batch_count = 0;
            p
        },
        {
            let mut p = params(&prompt, 1, 1, 1);
            p.sample_params.sample_method = sample_method_t(9999);
            p
        },
    ] {
        reset_records();
        let (ok, imgs) = generate(ctx, &bad);
        if ok {
            // A NULL prompt is the empty prompt for the reference; anything else must fail.
            assert!(bad.prompt.is_null(), "a bad request succeeded");
            assert_eq!(imgs.len(), 1);
        } else {
            assert!(imgs.is_empty());
            assert!(!LOG.lock().unwrap().is_empty(), "no reason logged");
        }
    }

    sd_set_progress_callback(None, null_mut());
    free_sd_ctx(ctx);

    // With eager_load the VAE is read with the context.
    LOG.lock().unwrap().clear();
    cp.eager_load = CBool::TRUE;
    // SAFETY: valid params.
    let eager = unsafe { new_sd_ctx(&cp) };
    assert!(!eager.is_null());
    assert_eq!(vae_loads(), 1, "eager_load reads the VAE with the context");
    free_sd_ctx(eager);
    sd_set_log_callback(None, null_mut());
}
