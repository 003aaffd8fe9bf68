//! The hires fix through the C API: golden parity of every case of `golden/sd1-hires/`
//! (latent bilinear and bicubic, Lanczos and nearest image resizing, the ESRGAN model
//! upscaler), and settings the reference turns the fix off for or that fail cleanly.

mod common;

use common::parity::{ctx_params, report, run, Arena};
use stable_diffusion::capi::*;
use std::ffi::c_int;
use std::sync::Mutex;

/// The tests of this file load the same model: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn sd1_hires_cases() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Quick subset: a latent and a pixel-space upscaler; every case with SD_PARITY=full.
    report(&run("sd1-hires", |c| common::parity::full() || ["hires_latent", "hires_lanczos"].contains(&c.name.as_str())));
}

/// Changes to the hires parameters of a request.
type Setting = Box<dyn FnOnce(&mut sd_hires_params_t, &mut Arena)>;

/// A context on the synthetic sd1 model with v prediction (the golden cases' context).
fn context() -> *mut sd_ctx_t {
    let mut arena = Arena::default();
    let mut p = ctx_params("sd1.safetensors", &serde_json::json!({}), &mut arena);
    p.prediction = prediction_t(1); // V_PRED
    // SAFETY: p and its strings are alive during the call.
    let ctx = unsafe { new_sd_ctx(&p) };
    assert!(!ctx.is_null(), "new_sd_ctx failed");
    ctx
}

/// The pictures (width, height, RGB bytes) of a 64×64 request (one step, hires ×2 with one
/// step) with the hires fix as `hires` sets it, or None when generation fails.
fn generate(ctx: *mut sd_ctx_t, batch: c_int, hires: impl FnOnce(&mut sd_hires_params_t, &mut Arena)) -> Option<Vec<(u32, u32, Vec<u8>)>> {
    let mut arena = Arena::default();
    let mut p = std::mem::MaybeUninit::<sd_img_gen_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_img_gen_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    p.prompt = arena.str("a lovely cat");
    p.width = 64;
    p.height = 64;
    p.seed = 42;
    p.batch_count = batch;
    p.sample_params.sample_steps = 1;
    p.sample_params.sample_method = sample_method_t(0); // EULER
    p.hires.enabled = CBool(1);
    p.hires.scale = 2.0;
    p.hires.steps = 1;
    p.hires.denoising_strength = 0.5;
    hires(&mut p.hires, &mut arena);
    let mut images: *mut sd_image_t = std::ptr::null_mut();
    let mut n: c_int = 0;
    // SAFETY: valid context and params; out-pointers are writable.
    let ok = unsafe { generate_image(ctx, &p, &mut images, &mut n) };
    if ok.0 == 0 {
        return None;
    }
    let out = (0..n as usize)
        .map(|i| {
            // SAFETY: n images of width * height * channel bytes were returned.
            let img = unsafe { &*images.add(i) };
            let bytes = unsafe { std::slice::from_raw_parts(img.data, (img.width * img.height * img.channel) as usize) }.to_vec();
            (img.width, img.height, bytes)
        })
        .collect();
    // SAFETY: the images generate_image returned, freed once.
    unsafe { free_sd_images(images, n) };
    Some(out)
}

/// Settings the reference turns the fix off for give the plain 64×64 picture; a model
/// file that cannot be loaded, a target too large and a strength that is not a number
/// fail cleanly; a batch reseeds each image's second pass like its first.
#[test]
fn hires_settings_off_errors_and_batches() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = context();
    let size = |r: &Option<Vec<(u32, u32, Vec<u8>)>>| r.as_ref().map(|v| v.iter().map(|i| (i.0, i.1)).collect::<Vec<_>>());

    let plain = generate(ctx, 1, |h, _| h.enabled = CBool(0)).expect("plain picture");
    assert_eq!(size(&Some(plain.clone())), Some(vec![(64, 64)]));
    let off: [(&str, Setting); 4] = [
        ("upscaler None", Box::new(|h, _| h.upscaler = sd_hires_upscaler_t(0))),
        ("negative scale", Box::new(|h, _| h.scale = -2.0)),
        ("zero scale", Box::new(|h, _| h.scale = 0.0)),
        ("model upscaler without a model", Box::new(|h, _| h.upscaler = sd_hires_upscaler_t(9))),
    ];
    for (what, f) in off {
        let got = generate(ctx, 1, f);
        assert!(got.as_ref() == Some(&plain), "{what}: expected the plain picture, got {:?}", size(&got));
    }

    let missing = generate(ctx, 1, |h, a| {
        h.upscaler = sd_hires_upscaler_t(9);
        h.model_path = a.str("/no/such/dir/esrgan.safetensors");
    });
    assert!(missing.is_none(), "a missing upscaler model must fail the generation");
    assert!(generate(ctx, 1, |h, _| h.scale = 1000.0).is_none(), "a 64000² target must be refused");
    assert!(generate(ctx, 1, |h, _| h.denoising_strength = f32::NAN).is_none(), "NaN strength must be refused");

    // A target size instead of the scale, with the nearest-exact latent upscaler.
    let target = generate(ctx, 1, |h, _| {
        h.target_height = 128;
        h.target_width = 192;
        h.upscaler = sd_hires_upscaler_t(3);
    });
    assert_eq!(size(&target), Some(vec![(192, 128)]));

    // Image 0 of a batch is the single request's picture; image 1 differs.
    let batch = generate(ctx, 2, |_, _| {}).expect("batch");
    assert_eq!(size(&Some(batch.clone())), Some(vec![(128, 128), (128, 128)]));
    let single = generate(ctx, 1, |_, _| {}).expect("single");
    assert!(batch[0].2 == single[0].2, "image 0 of a batch differs from the single picture");
    assert!(batch[0].2 != batch[1].2);

    // Still usable after the failures.
    assert!(generate(ctx, 1, |h, _| h.enabled = CBool(0)).as_ref() == Some(&plain));
    free_sd_ctx(ctx);
}
