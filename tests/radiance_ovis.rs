//! Chroma1-Radiance and Ovis-Image through the C ABI, on this project's synthetic files
//! (tests/fixtures/synth_flux_variants.py). There is no golden data for them: each model
//! must render repeatable, structured pictures that follow the prompt (and for Radiance the
//! init image), and a missing or wrong component must fail cleanly at `new_sd_ctx`.
//!
//! Radiance works on pixels: the init image itself is the starting "latent", so img2img from
//! a low noise level stays close to it. Its x0 / patch-32 file (another 636 MB fixture) is
//! added by `SD_PARITY=full`.

mod common;

use common::parity::{ctx_params, diff_bytes, ensure_fixtures, full, gen_params, read_png, Arena};
use common::root;
use serde_json::{json, Value};
use stable_diffusion::capi::*;
use std::ffi::c_int;

/// A context from `ctx` (fixture paths as `{fx}/file`), or None when `new_sd_ctx` fails.
fn open(ctx: &Value) -> Option<*mut sd_ctx_t> {
    ensure_fixtures("", ctx);
    let mut arena = Arena::default();
    let p = ctx_params("", ctx, &mut arena);
    // SAFETY: p and everything it points to are alive during the call.
    let c = unsafe { new_sd_ctx(&p) };
    (!c.is_null()).then_some(c)
}

/// The pictures of one generation as (width, height, RGB bytes).
fn generate(ctx: *mut sd_ctx_t, params: &Value) -> Vec<(u32, u32, Vec<u8>)> {
    let mut arena = Arena::default();
    let p = gen_params(params, &mut arena);
    let mut images: *mut sd_image_t = std::ptr::null_mut();
    let mut n: c_int = 0;
    // SAFETY: a live context and params; out-pointers are writable.
    let ok = unsafe { generate_image(ctx, &p, &mut images, &mut n) };
    assert!(ok.0 != 0 && n > 0, "generate_image failed for {params}");
    let out = (0..n as usize)
        .map(|i| {
            // SAFETY: n images were returned, each width * height * channel bytes.
            let img = unsafe { &*images.add(i) };
            assert_eq!(img.channel, 3);
            let bytes = unsafe { std::slice::from_raw_parts(img.data, (img.width * img.height * 3) as usize) }.to_vec();
            (img.width, img.height, bytes)
        })
        .collect();
    // SAFETY: freed once, as returned.
    unsafe { free_sd_images(images, n) };
    out
}

/// One picture of `params` (seed 42, cfg 1, 2 euler steps unless `params` says otherwise:
/// Chroma's approximator is 5120 wide whatever the synthetic transformer's size, so each
/// Radiance evaluation takes seconds).
fn render(ctx: *mut sd_ctx_t, params: Value) -> (u32, u32, Vec<u8>) {
    let mut p = json!({
        "prompt": "a lovely cat",
        "width": 64,
        "height": 64,
        "seed": 42,
        "sample_params.sample_steps": 2,
        "sample_params.guidance.txt_cfg": 1.0,
    });
    p.as_object_mut().unwrap().extend(params.as_object().unwrap().clone());
    generate(ctx, &p).remove(0)
}

/// Not a flat or nearly flat picture: many grey levels and a real spread.
fn assert_structured(what: &str, px: &[u8]) {
    let mut seen = [false; 256];
    px.iter().for_each(|&v| seen[v as usize] = true);
    let levels = seen.iter().filter(|&&s| s).count();
    let mean = px.iter().map(|&v| v as f64).sum::<f64>() / px.len() as f64;
    let sd = (px.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / px.len() as f64).sqrt();
    eprintln!("{what}: {levels} grey levels, mean {mean:.1}, sd {sd:.1}");
    assert!(levels >= 32 && sd >= 4.0, "{what} is degenerate: {levels} levels, sd {sd:.1}");
}

/// The slower extra cases run with `SD_PARITY=full`.
fn full_only(what: &str) -> bool {
    let on = full();
    if !on {
        eprintln!("skipped {what}: set SD_PARITY=full");
    }
    on
}

fn radiance_ctx(dit: &str) -> Value {
    json!({ "diffusion_model_path": format!("{{fx}}/{dit}"), "t5xxl_path": "{fx}/t5xxl_tiny.safetensors" })
}

#[test]
fn chroma_radiance_renders_in_pixel_space() {
    let ctx = open(&radiance_ctx("chroma_radiance.safetensors")).expect("new_sd_ctx for Chroma Radiance");
    let (w, h, a) = render(ctx, json!({}));
    assert_eq!((w, h), (64, 64));
    assert_structured("radiance txt2img", &a);
    let other = render(ctx, json!({ "prompt": "a red apple on a table" })).2;
    eprintln!("radiance: another prompt differs by {:?} (max, mean)", diff_bytes(&a, &other));
    assert_ne!(other, a, "the prompt reaches the picture");

    // img2img: the init image (in [-1, 1]) is the latent. One step from noise level 0.05
    // stays near it; strength 0.5 of 4 steps starts from a noisier mix (3 steps).
    let init = read_png(&root().join("tests/fixtures/inputs/init_64.png")).3;
    let low_noise = json!({
        "init_image": "init_64.png",
        "strength": 0.05,
        "sample_params.extra_sample_args": "strength_as_noise_level=true,force_first_sigma=true",
    });
    let near = render(ctx, low_noise.clone()).2;
    let far = render(ctx, json!({ "init_image": "init_64.png", "strength": 0.5, "sample_params.sample_steps": 4 })).2;
    let (d_near, d_far) = (diff_bytes(&near, &init), diff_bytes(&far, &init));
    eprintln!(
        "radiance img2img vs init (max, mean): noise level 0.05 {d_near:?}, strength 0.5 {d_far:?}; txt2img {:?}",
        diff_bytes(&a, &init)
    );
    assert_structured("radiance img2img 0.5", &far);
    assert!(d_near.1 < 16.0 && d_near.1 < d_far.1 / 2.0, "img2img from noise level 0.05 should stay near the init image");
    assert_eq!(render(ctx, low_noise).2, near, "the same request renders the same picture");

    // Sides that are not multiples of the 16-pixel patches: padded, then cropped back.
    let (w, h, odd) = render(ctx, json!({ "width": 72, "height": 40, "sample_params.sample_steps": 1 }));
    assert_eq!((w, h, odd.len()), (72, 40, 72 * 40 * 3));
    assert_structured("radiance 72x40", &odd);
    free_sd_ctx(ctx);
}

/// `__x0__` (the network predicts the image) and `__32x32__` with a 16×16 input convolution
/// (the image halved before it).
#[test]
fn chroma_radiance_x0_with_halved_input_renders() {
    if !full_only("Chroma Radiance x0") {
        return;
    }
    let ctx = open(&radiance_ctx("chroma_radiance_x0.safetensors")).expect("new_sd_ctx for Chroma Radiance x0");
    let (w, h, a) = render(ctx, json!({}));
    assert_eq!((w, h), (64, 64));
    assert_structured("radiance x0 txt2img", &a);
    assert_eq!(render(ctx, json!({})).2, a);
    free_sd_ctx(ctx);
}

/// Like Chroma, Radiance renders without T5 (a zero text context, like the reference).
#[test]
fn chroma_radiance_without_t5_renders() {
    let ctx = open(&json!({ "diffusion_model_path": "{fx}/chroma_radiance.safetensors" })).expect("new_sd_ctx without T5");
    assert_structured("radiance without T5", &render(ctx, json!({ "sample_params.sample_steps": 1 })).2);
    free_sd_ctx(ctx);
}

fn ovis_ctx() -> Value {
    json!({
        "diffusion_model_path": "{fx}/ovis_image.safetensors",
        "llm_path": "{fx}/qwen3_ovis_tiny.safetensors",
        "vae_path": "{fx}/vae16.safetensors",
    })
}

#[test]
fn ovis_image_renders() {
    let ctx = open(&ovis_ctx()).expect("new_sd_ctx for Ovis-Image");
    let (w, h, a) = render(ctx, json!({}));
    assert_eq!((w, h), (64, 64));
    assert_structured("ovis txt2img", &a);
    assert_eq!(render(ctx, json!({})).2, a, "the same request renders the same picture");
    let other = render(ctx, json!({ "prompt": "a red apple on a table" })).2;
    eprintln!("ovis: another prompt differs by {:?} (max, mean)", diff_bytes(&a, &other));
    assert_ne!(other, a, "the prompt reaches the picture");
    let cfg = render(ctx, json!({ "negative_prompt": "blurry", "sample_params.guidance.txt_cfg": 3.0 })).2;
    assert_structured("ovis cfg 3", &cfg);
    assert_ne!(cfg, a);
    free_sd_ctx(ctx);
}

#[test]
fn ovis_image_without_a_usable_llm_fails_cleanly() {
    let mut no_llm = ovis_ctx();
    no_llm.as_object_mut().unwrap().remove("llm_path");
    assert!(open(&no_llm).is_none(), "Ovis-Image without llm_path must fail at new_sd_ctx");
    let mut t5_as_llm = ovis_ctx();
    t5_as_llm["llm_path"] = json!("{fx}/t5xxl_tiny.safetensors");
    assert!(open(&t5_as_llm).is_none(), "a T5 file as the LLM must fail at new_sd_ctx");
    let mut no_vae = ovis_ctx();
    no_vae.as_object_mut().unwrap().remove("vae_path");
    assert!(open(&no_vae).is_none(), "Ovis-Image without its VAE must fail at new_sd_ctx");
}
