//! Golden parity of ADetailer (`golden/adetailer/`) through the C ABI: `new_adetailer_ctx`
//! with the synthetic YOLOv8 (`yolov8_tiny.safetensors`), then `adetail_image` on an input PNG
//! with the tiny SD 1.x model inpainting every detection. Per case, `adetailer` gives the
//! detector, the input and the `sd_adetailer_params_t` strings; `params` the inpainting
//! request. Cases: one, two (the defaults), three and none detected, the k largest sorted,
//! dilation / erosion / blur / offsets, merged and inverted masks, per-detection prompts with
//! the inpainting overrides, a skipped detection, another detector input size; and what the
//! reference refuses (`"ok": false`): a file that is not a YOLOv8 detector, a missing file,
//! out-of-range, unknown and malformed `extra_ad_args`.
//!
//! Without `SD_PARITY=full` only `ad_one` and the refused cases (no inpainting) run, plus the
//! NULL / bad-argument checks.

mod common;

use common::parity::{compare_image, ctx_params, ensure_fixtures, fixture, full, gen_params, print_result, read_png, report, Arena, CaseResult};
use common::logs::{errors_of, SERIAL};
use common::root;
use serde_json::Value;
use stable_diffusion::capi::*;
use std::ffi::{c_int, CString};
use std::ptr::{null, null_mut};
use std::time::Instant;

fn new_detector(path: &str) -> *mut adetailer_ctx_t {
    // A fixture is made first when missing (this test may run before any case made it).
    let path = match path.strip_prefix("{fx}/") {
        Some(f) => common::parity::fixture(f).to_string_lossy().into_owned(),
        None => path.to_string(),
    };
    let p = CString::new(path).unwrap();
    // SAFETY: NUL-terminated path alive during the call; NULL backends mean the default.
    unsafe { new_adetailer_ctx(p.as_ptr(), 2, null(), null()) }
}

/// The `sd_adetailer_params_t` of a case's `adetailer` object (strings kept in `arena`).
fn ad_params(ad: &Value, arena: &mut Arena) -> sd_adetailer_params_t {
    let mut s = |k: &str| ad[k].as_str().map_or(null(), |v| arena.str(v));
    sd_adetailer_params_t { prompt: s("prompt"), negative_prompt: s("negative_prompt"), extra_ad_args: s("extra_ad_args") }
}

/// `adetail_image`: the return value and the returned images (freed here).
fn run_detail(
    det: *mut adetailer_ctx_t,
    sd: *mut sd_ctx_t,
    img: sd_image_t,
    ad: *const sd_adetailer_params_t,
    inpaint: *const sd_img_gen_params_t,
    golden: &[std::path::PathBuf],
) -> (bool, c_int, Vec<common::parity::Diff>) {
    let mut out: *mut sd_image_t = null_mut();
    let mut n: c_int = -1;
    // SAFETY: the pointers are NULL or valid; the out-pointers are writable.
    let ok = unsafe { adetail_image(det, sd, img, ad, inpaint, &mut out, &mut n) }.0 != 0;
    let diffs = if ok && n as usize == golden.len() {
        // SAFETY: n images were returned.
        golden.iter().enumerate().map(|(i, g)| compare_image(g, unsafe { &*out.add(i) }, Some((1.0, 0.25)))).collect()
    } else {
        vec![]
    };
    // SAFETY: what adetail_image returned, freed once.
    unsafe { free_sd_images(out, n) };
    (ok, n, diffs)
}

struct Golden {
    model: String,
    cases: Vec<Value>,
}

fn golden() -> Golden {
    let dir = root().join("tests/fixtures/golden/adetailer");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    Golden { model: v["model"].as_str().unwrap().to_string(), cases: v["cases"].as_array().unwrap().clone() }
}

/// Runs the selected cases with one `sd_ctx_t` (every case has the same context fields),
/// then `after` with that context.
fn run(select: impl Fn(&Value) -> bool, after: impl FnOnce(*mut sd_ctx_t)) -> Vec<CaseResult> {
    let g = golden();
    let dir = root().join("tests/fixtures/golden/adetailer");
    ensure_fixtures(&g.model, &Value::Object(Default::default()));
    fixture("yolov8_tiny.safetensors");
    let mut arena = Arena::default();
    let cp = ctx_params(&g.model, &Value::Object(Default::default()), &mut arena);
    // SAFETY: cp and everything it points to are alive during the call.
    let sd = unsafe { new_sd_ctx(&cp) };
    assert!(!sd.is_null(), "new_sd_ctx failed");
    let mut results = Vec::new();
    for case in g.cases.iter().filter(|c| select(c)) {
        let start = Instant::now();
        let name = case["name"].as_str().unwrap().to_string();
        assert!(case["ctx"].as_object().unwrap().is_empty(), "{name}: every case shares the context");
        let ad = &case["adetailer"];
        let want_ok = case["ok"].as_bool().unwrap();
        let golden: Vec<_> = case["images"].as_array().unwrap().iter().map(|i| dir.join(i.as_str().unwrap())).collect();
        let mut r = CaseResult { folder: "adetailer".into(), name: name.clone(), diffs: vec![], pass: false, note: String::new(), seconds: 0.0, pixels: vec![], latent_bits: vec![] };
        let path = ad["detector"].as_str().unwrap();
        if let Some(f) = path.strip_prefix("{fx}/") {
            fixture(f);
        }
        let (det, errs) = errors_of(|| new_detector(path));
        if det.is_null() {
            r.pass = !want_ok && !errs.is_empty();
            r.note = format!("new_adetailer_ctx failed: {}", errs.join(" / "));
        } else {
            let mut a = Arena::default();
            let p = gen_params(&case["params"], &mut a);
            let adp = ad_params(ad, &mut a);
            let (w, h, c, mut data) = read_png(&root().join("tests/fixtures/inputs").join(ad["input"].as_str().unwrap()));
            let img = sd_image_t { width: w, height: h, channel: c, data: data.as_mut_ptr() };
            let ((ok, n, diffs), errs) = errors_of(|| run_detail(det, sd, img, &adp, &p, &golden));
            if ok != want_ok || (ok && n as usize != golden.len()) {
                r.note = format!("returned {ok} with {n} images, reference {want_ok} with {}: {}", golden.len(), errs.join(" / "));
            } else if !ok {
                r.pass = !errs.is_empty();
                r.note = format!("refused like the reference: {}", errs.join(" / "));
            } else {
                r.pass = diffs.iter().all(|d| d.pass);
                r.diffs = diffs;
            }
            free_adetailer_ctx(det);
        }
        r.seconds = start.elapsed().as_secs_f32();
        print_result(&r);
        results.push(r);
    }
    after(sd);
    free_sd_ctx(sd);
    results
}

#[test]
fn adetailer_quick_subset() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in adetailer_all_cases");
        return;
    }
    report(&run(|c| c["name"] == "ad_one" || c["ok"] == false, null_parameters_with_a_model));
}

#[test]
fn adetailer_all_cases() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    report(&run(|_| true, null_parameters_with_a_model));
}

#[test]
fn adetailer_refuses_null_and_bad_arguments() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // No detector path: NULL with a reason; freeing NULL is a no-op.
    let (det, errs) = errors_of(|| unsafe { new_adetailer_ctx(null(), 1, null(), null()) });
    assert!(det.is_null() && !errs.is_empty());
    let (det, errs) = errors_of(|| new_detector(""));
    assert!(det.is_null() && errs.iter().any(|e| e.contains("empty")), "{errs:?}");
    free_adetailer_ctx(null_mut());

    let det = new_detector("{fx}/yolov8_tiny.safetensors");
    assert!(!det.is_null());
    let mut arena = Arena::default();
    let p = gen_params(&serde_json::json!({"prompt": "a cat", "width": 64, "height": 64}), &mut arena);
    let adp = ad_params(&serde_json::json!({"extra_ad_args": "confidence=0.9"}), &mut arena);
    let mut px = vec![100u8; 8 * 8 * 3];
    let img = sd_image_t { width: 8, height: 8, channel: 3, data: px.as_mut_ptr() };
    // A NULL or unknown context: false, a reason, no images (out-pointers cleared).
    let fake_sd = 0x10 as *mut sd_ctx_t;
    for (d, sd, im, a, q, why) in [
        (null_mut(), fake_sd, img, &adp as *const _, &p as *const _, "adetailer_ctx is NULL"),
        (det, null_mut(), img, &adp as *const _, &p as *const _, "NULL"),
        (det, fake_sd, img, &adp as *const _, &p as *const _, "not a live"),
    ] {
        let ((ok, n, _), errs) = errors_of(|| run_detail(d, sd, im, a, q, &[]));
        assert!(!ok && n == 0, "{why}: succeeded");
        assert!(errs.iter().any(|e| e.contains(why)), "{why}: {errs:?}");
    }
    free_adetailer_ctx(det);
    // Freed twice: an error, no crash.
    let (_, errs) = errors_of(|| free_adetailer_ctx(det));
    assert!(!errs.is_empty());
}

/// With a live model: NULL parameters and an image without pixels fail with a reason; an
/// RGBA input where nothing is detected comes back as RGB; NULL out-pointers are allowed.
fn null_parameters_with_a_model(sd: *mut sd_ctx_t) {
    let det = new_detector("{fx}/yolov8_tiny.safetensors");
    assert!(!det.is_null());
    let mut arena = Arena::default();
    let p = gen_params(&serde_json::json!({"prompt": "a cat", "width": 64, "height": 64, "sample_params.sample_steps": 1}), &mut arena);
    let adp = ad_params(&serde_json::json!({"extra_ad_args": "confidence=0.9"}), &mut arena);
    let px: Vec<u8> = (0..12 * 8 * 4).map(|i| (i * 7 % 251) as u8).collect();
    let mut data = px.clone();
    let rgba = sd_image_t { width: 12, height: 8, channel: 4, data: data.as_mut_ptr() };
    for (im, a, q, why) in [
        (sd_image_t { data: null_mut(), ..rgba }, &adp as *const _, &p as *const _, "no pixel data"),
        (rgba, null(), &p as *const _, "adetailer_params is NULL"),
        (rgba, &adp as *const _, null(), "inpaint_params is NULL"),
    ] {
        let ((ok, n, _), errs) = errors_of(|| run_detail(det, sd, im, a, q, &[]));
        assert!(!ok && n == 0, "{why}: succeeded");
        assert!(errs.iter().any(|e| e.contains(why)), "{why}: {errs:?}");
    }
    let mut out: *mut sd_image_t = null_mut();
    let mut n: c_int = 0;
    // SAFETY: valid arguments, writable out-pointers.
    assert_eq!(unsafe { adetail_image(det, sd, rgba, &adp, &p, &mut out, &mut n) }, CBool::TRUE);
    assert_eq!(n, 1);
    // SAFETY: one image returned.
    let im = unsafe { &*out };
    assert_eq!((im.width, im.height, im.channel), (12, 8, 3));
    // SAFETY: 12 * 8 * 3 bytes.
    let rgb = unsafe { std::slice::from_raw_parts(im.data, 12 * 8 * 3) };
    assert!(rgb.chunks(3).zip(px.chunks(4)).all(|(a, b)| a == &b[..3]));
    // SAFETY: returned above, freed once.
    unsafe { free_sd_images(out, n) };
    // SAFETY: NULL out-pointers are allowed.
    assert_eq!(unsafe { adetail_image(det, sd, rgba, &adp, &p, null_mut(), null_mut()) }, CBool::TRUE);
    free_adetailer_ctx(det);
}
