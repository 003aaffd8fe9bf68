//! Golden parity of ESRGAN upscaling (`golden/esrgan/`) through the C ABI: per case the
//! input PNG, `upscale_factor` and the `tile_size` given to `new_upscaler_ctx`; and how the
//! upscaler exports answer files and images they cannot use.

mod common;

use common::parity::{compare_image, fixture, print_result, read_png, report, CaseResult};
use common::logs::{errors_of, SERIAL};
use common::root;
use serde_json::Value;
use stable_diffusion::capi::*;
use std::ffi::{c_int, CString};
use std::ptr::{null, null_mut};
use std::time::Instant;

fn new_upscaler(path: &str, tile_size: c_int) -> *mut upscaler_ctx_t {
    let p = CString::new(path).unwrap();
    // SAFETY: NUL-terminated path alive during the call; NULL backends mean the default.
    unsafe { new_upscaler_ctx(p.as_ptr(), CBool::FALSE, 2, tile_size, null(), null()) }
}

/// Upscales an 8-bit image: the return value and copies of the returned images
/// (width, height, channels, pixels).
fn run_upscale(ctx: *mut upscaler_ctx_t, img: sd_image_t, factor: u32) -> (bool, Vec<(u32, u32, u32, Vec<u8>)>) {
    let mut out: *mut sd_image_t = null_mut();
    let mut n: c_int = -1;
    // SAFETY: img.data is NULL or holds its pixels; the out-pointers are writable.
    let ok = unsafe { upscale(ctx, img, factor, &mut out, &mut n) }.0 != 0;
    let images = (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: n images were returned, each with width*height*channel bytes.
            let im = unsafe { &*out.add(i) };
            let len = (im.width * im.height * im.channel) as usize;
            (im.width, im.height, im.channel, unsafe { std::slice::from_raw_parts(im.data, len) }.to_vec())
        })
        .collect();
    // SAFETY: what upscale returned, freed once.
    unsafe { free_sd_images(out, n) };
    (ok, images)
}

#[test]
fn esrgan_golden_cases() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = root().join("tests/fixtures/golden/esrgan");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let model = fixture(v["model"].as_str().unwrap());
    let model = model.to_string_lossy();
    let mut results = Vec::new();
    for case in v["cases"].as_array().unwrap() {
        let start = Instant::now();
        let name = case["name"].as_str().unwrap().to_string();
        let tile = case["tile_size"].as_i64().unwrap() as c_int;
        let factor = case["upscale_factor"].as_u64().unwrap() as u32;
        let (w, h, c, mut data) = read_png(&root().join("tests/fixtures/inputs").join(case["input"].as_str().unwrap()));
        let ctx = new_upscaler(&model, tile);
        assert!(!ctx.is_null(), "{name}: new_upscaler_ctx failed");
        assert_eq!(get_upscale_factor(ctx), 4);
        let img = sd_image_t { width: w, height: h, channel: c, data: data.as_mut_ptr() };
        let mut out: *mut sd_image_t = null_mut();
        let mut n: c_int = 0;
        // SAFETY: live context, image of w*h*c bytes, writable out-pointers.
        let ok = unsafe { upscale(ctx, img, factor, &mut out, &mut n) }.0 != 0;
        let mut r = CaseResult { folder: "esrgan".into(), name: name.clone(), diffs: vec![], pass: false, note: String::new(), seconds: 0.0, pixels: vec![], latent_bits: vec![] };
        let golden: Vec<&str> = case["images"].as_array().unwrap().iter().map(|i| i.as_str().unwrap()).collect();
        if Some(ok) != case["ok"].as_bool() || n as usize != golden.len() {
            r.note = format!("returned {ok} with {n} images, reference {:?} with {}", case["ok"], golden.len());
        } else {
            for (i, file) in golden.iter().enumerate() {
                // SAFETY: n images were returned.
                r.diffs.push(compare_image(&dir.join(file), unsafe { &*out.add(i) }, None));
            }
            r.pass = r.diffs.iter().all(|d| d.pass);
        }
        // SAFETY: what upscale returned, freed once; then the context.
        unsafe { free_sd_images(out, n) };
        free_upscaler_ctx(ctx);
        r.seconds = start.elapsed().as_secs_f32();
        print_result(&r);
        results.push(r);
    }
    report(&results);
}

#[test]
fn upscaler_refuses_what_it_cannot_use_and_says_why() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = fixture("esrgan_x4.safetensors").to_string_lossy().into_owned();

    // A missing file, a file that is not a model, a model that is not ESRGAN: NULL, and
    // an error naming the problem.
    let missing = "/no/such/dir/esrgan_x4.pth";
    let (_, errs) = errors_of(|| assert!(new_upscaler(missing, 128).is_null()));
    assert!(errs.iter().any(|e| e.contains(missing)), "{errs:?}");
    let junk = std::env::temp_dir().join(format!("not-esrgan-{}.safetensors", std::process::id()));
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let junk_s = junk.to_string_lossy().into_owned();
    let (_, errs) = errors_of(|| assert!(new_upscaler(&junk_s, 128).is_null()));
    std::fs::remove_file(&junk).ok();
    assert!(errs.iter().any(|e| e.contains(&junk_s)), "{errs:?}");
    let sd1 = fixture("vae.safetensors").to_string_lossy().into_owned();
    let (_, errs) = errors_of(|| assert!(new_upscaler(&sd1, 128).is_null()));
    assert!(errs.iter().any(|e| e.contains("not an ESRGAN model")), "{errs:?}");

    let ctx = new_upscaler(&model, 0);
    assert!(!ctx.is_null());
    assert_eq!(get_upscale_factor(ctx), 4);
    let mut px = vec![100u8; 6 * 4 * 3];
    let rgb = |data: *mut u8, w: u32, h: u32, c: u32| sd_image_t { width: w, height: h, channel: c, data };
    // No pixels, zero sizes, a channel count the model does not take: false, a reason, no
    // images.
    for (img, why) in [
        (rgb(null_mut(), 6, 4, 3), "no pixel data"),
        (rgb(px.as_mut_ptr(), 0, 4, 3), "no pixel data"),
        (rgb(px.as_mut_ptr(), 6, 0, 3), "no pixel data"),
        (rgb(px.as_mut_ptr(), 6, 4, 0), "no pixel data"),
        (rgb(px.as_mut_ptr(), 6, 4, 4), "channels"),
        (rgb(px.as_mut_ptr(), 6, 4, 1), "channels"),
    ] {
        let mut res = (true, vec![]);
        let (_, errs) = errors_of(|| res = run_upscale(ctx, img, 4));
        assert!(!res.0 && res.1.is_empty(), "{why}: upscale succeeded");
        assert!(errs.iter().any(|e| e.contains(why)), "{why}: {errs:?}");
    }
    // The factor does not change the result (the model decides), like the reference.
    let (ok, a) = run_upscale(ctx, rgb(px.as_mut_ptr(), 6, 4, 3), 0);
    assert!(ok && a.len() == 1 && (a[0].0, a[0].1, a[0].2) == (24, 16, 3));
    let (ok, b) = run_upscale(ctx, rgb(px.as_mut_ptr(), 6, 4, 3), 2);
    assert!(ok && a == b);
    // Without out-pointers the result is dropped, not leaked.
    // SAFETY: valid image; NULL out-pointers are allowed.
    assert_eq!(unsafe { upscale(ctx, rgb(px.as_mut_ptr(), 6, 4, 3), 4, null_mut(), null_mut()) }, CBool::TRUE);
    free_upscaler_ctx(ctx);
}
