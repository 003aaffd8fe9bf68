//! LoRAs through the C API: golden parity (`golden/sd1-lora/`, `golden/sd1-lora-formats/`),
//! switching LoRAs on one context (removing one gives the picture without it, bit for
//! bit), and failing LoRAs leaving the model as it was, in both apply modes. Without
//! `SD_PARITY=full` only a quick subset of the golden cases runs.

mod common;

use common::parity::{diff_bytes, fixture, fixture_dir, full, golden_image, report, run, run_with, Arena, CaseResult};
use stable_diffusion::capi::*;
use std::ffi::{c_int, CString};
use std::sync::Mutex;
use std::time::Instant;

/// The tests of this file load the same multi-GB model: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Golden cases of `folder`: those of `quick` in the default run, all with `SD_PARITY=full`.
fn golden(folder: &str, quick: &[&str]) -> Vec<CaseResult> {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let results = run(folder, |c| full() || quick.contains(&c.name.as_str()));
    report(&results);
    results
}

/// A kohya LoRA immediately and at run time, and the picture without it afterwards on the
/// same context (removal gives the plain picture back).
#[test]
fn sd1_lora_cases() {
    golden("sd1-lora", &["lora_1_0", "lora_none_after", "lora_runtime_1_0"]);
}

/// Every format; the q8_0 case (immediately merged into q8_0 weights: the reference aborts)
/// must render.
#[test]
fn sd1_lora_formats_cases() {
    let results = golden("sd1-lora-formats", &["lokr_1_0", "q8_0_peft_immediate"]);
    let q8 = results.iter().find(|r| r.name == "q8_0_peft_immediate").expect("q8_0 case");
    assert!(q8.pixels.len() == 1 && !q8.pixels[0].is_empty(), "the LoRA on q8_0 weights must render: {}", q8.note);
}

#[test]
fn sdxl_lora_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    golden("sdxl-lora", &[]);
}

/// With mmap on, merged weights get buffers of their own and come back from the file.
#[test]
fn sd1_lora_with_mmap() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pick = ["lora_1_0", "lora_neg_0_7", "lora_none_after"];
    report(&run_with("sd1-lora", |c| pick.contains(&c.name.as_str()), |p, _| p.enable_mmap = true.into()));
}

/// A context on the synthetic sd1 model with v prediction.
fn context(mode: &str, mmap: bool) -> *mut sd_ctx_t {
    context_on(mode, mmap, None, None)
}

/// [`context`] with the weights kept where `params_backend` says (e.g. `disk`), and
/// converted to `wtype` at load.
fn context_on(mode: &str, mmap: bool, params_backend: Option<&str>, wtype: Option<u32>) -> *mut sd_ctx_t {
    let mut arena = Arena::default();
    let mut p = std::mem::MaybeUninit::<sd_ctx_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_ctx_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    p.model_path = arena.str(&fixture("sd1.safetensors").to_string_lossy());
    p.n_threads = 2;
    p.prediction = prediction_t(1); // V_PRED
    p.enable_mmap = mmap.into();
    if let Some(pb) = params_backend {
        p.params_backend = arena.str(pb);
    }
    if let Some(t) = wtype {
        p.wtype = sd_type_t(t);
    }
    p.lora_apply_mode = lora_apply_mode_t(match mode {
        "immediately" => 1,
        "at_runtime" => 2,
        _ => 0,
    });
    // SAFETY: p and its strings are alive during the call.
    let ctx = unsafe { new_sd_ctx(&p) };
    assert!(!ctx.is_null(), "new_sd_ctx failed");
    ctx
}

/// One 64×64 picture with `loras` (path, multiplier), or None when generation fails.
fn generate(ctx: *mut sd_ctx_t, loras: &[(&str, f32)], steps: i32) -> Option<Vec<u8>> {
    generate_sized(ctx, loras, steps, 64)
}

fn generate_sized(ctx: *mut sd_ctx_t, loras: &[(&str, f32)], steps: i32, size: c_int) -> Option<Vec<u8>> {
    let paths: Vec<CString> = loras.iter().map(|(p, _)| CString::new(*p).unwrap()).collect();
    let list: Vec<sd_lora_t> =
        loras.iter().zip(&paths).map(|((_, m), p)| sd_lora_t { is_high_noise: CBool(0), multiplier: *m, path: p.as_ptr() }).collect();
    let prompt = CString::new("a lovely cat").unwrap();
    let mut p = std::mem::MaybeUninit::<sd_img_gen_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_img_gen_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    p.prompt = prompt.as_ptr();
    p.width = size;
    p.height = size;
    p.seed = 42;
    p.sample_params.sample_steps = steps;
    p.sample_params.sample_method = sample_method_t(0); // EULER
    p.loras = list.as_ptr();
    p.lora_count = list.len() as u32;
    let mut images: *mut sd_image_t = std::ptr::null_mut();
    let mut n: c_int = 0;
    // SAFETY: valid context and params; out-pointers are writable.
    let ok = unsafe { generate_image(ctx, &p, &mut images, &mut n) };
    if ok.0 == 0 {
        return None;
    }
    assert_eq!(n, 1);
    // SAFETY: one image of width * height * channel bytes.
    let img = unsafe { &*images };
    let bytes = unsafe { std::slice::from_raw_parts(img.data, (img.width * img.height * img.channel) as usize) }.to_vec();
    // SAFETY: the images generate_image returned, freed once.
    unsafe { free_sd_images(images, n) };
    Some(bytes)
}

fn lora(file: &str) -> String {
    fixture(&format!("loras/{file}")).to_string_lossy().into_owned()
}

/// A kohya LoRA whose proj_in factors are 100 wide where the model has 320 inputs.
fn wrong_shape_lora() -> String {
    let path = fixture_dir().join("loras/test_wrong_shape.safetensors");
    let down = vec![0u8; 4 * 100 * 2];
    let up = vec![0u8; 320 * 4 * 2];
    let views = [
        ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", vec![4usize, 100], &down),
        ("lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight", vec![320, 4], &up),
    ];
    write_safetensors(&path, &views);
    path.to_string_lossy().into_owned()
}

/// A kohya LoRA naming a layer no SD model has.
fn unmatched_lora() -> String {
    let path = fixture_dir().join("loras/test_unmatched.safetensors");
    let (down, up) = (vec![0u8; 4 * 320 * 2], vec![0u8; 320 * 4 * 2]);
    let views = [
        ("lora_unet_no_such_block_proj_in.lora_down.weight", vec![4usize, 320], &down),
        ("lora_unet_no_such_block_proj_in.lora_up.weight", vec![320, 4], &up),
    ];
    write_safetensors(&path, &views);
    path.to_string_lossy().into_owned()
}

/// Writes F16 tensors (name, shape, bytes) to `path` (through a temporary name).
fn write_safetensors(path: &std::path::Path, views: &[(&str, Vec<usize>, &Vec<u8>)]) {
    let tensors: Vec<(String, safetensors::tensor::TensorView)> = views
        .iter()
        .map(|(n, s, d)| (n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F16, s.clone(), d).unwrap()))
        .collect();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    safetensors::serialize_to_file(tensors, None, &tmp).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_log(_level: sd_log_level_t, text: *const std::ffi::c_char, _data: *mut std::ffi::c_void) {
    // SAFETY: a NUL-terminated message from the library.
    let s = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned();
    LOG.lock().unwrap().push(s);
}

fn corrupt_lora() -> String {
    let path = fixture_dir().join("loras/test_corrupt.safetensors");
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, b"\xff\x00\x00\x00\x00\x00\x00\x00{not json").unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    path.to_string_lossy().into_owned()
}

/// LoRAs come and go on one context: removing one gives back the picture without it
/// exactly, and a failing request (missing, corrupt, wrong-shaped LoRA) changes nothing.
#[test]
fn switching_and_failing_loras() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (kohya, loha) = (lora("lora_sd1.safetensors"), lora("loha_sd1.safetensors"));
    let (wrong, corrupt, none_matching) = (wrong_shape_lora(), corrupt_lora(), unmatched_lora());
    let modes: &[(&str, bool)] = if full() { &[("immediately", false), ("immediately", true), ("at_runtime", false)] } else { &[("immediately", true), ("at_runtime", false)] };
    for &(mode, mmap) in modes {
        eprintln!("mode {mode}, mmap {mmap}");
        let ctx = context(mode, mmap);
        let plain = generate(ctx, &[], 2).expect("no LoRA");
        let with = generate(ctx, &[(&kohya, 1.0)], 2).expect("kohya LoRA");
        assert_ne!(plain, with);
        for bad in [&[(kohya.as_str(), 0.5), ("/nonexistent/lora.safetensors", 1.0)][..], &[(&corrupt, 1.0)], &[(&loha, 1.0), (&wrong, 1.0)]] {
            assert!(generate(ctx, bad, 2).is_none(), "{mode}: {bad:?} must fail");
            // Still the kohya LoRA alone: the request above changed nothing.
            assert_eq!(generate(ctx, &[(&kohya, 1.0)], 2).as_ref(), Some(&with), "{mode}: after {bad:?}");
        }
        let both = generate(ctx, &[(&kohya, 1.0), (&loha, 0.6)], 2).expect("two LoRAs");
        assert_ne!(both, with);
        assert_eq!(generate(ctx, &[(&loha, 0.6), (&kohya, 1.0)], 2).map(|b| b != plain), Some(true));
        assert_eq!(generate(ctx, &[], 2).as_ref(), Some(&plain), "{mode}: LoRAs removed");
        // A LoRA for weights this model does not have: a warning naming it, no change.
        LOG.lock().unwrap().clear();
        sd_set_log_callback(Some(on_log), std::ptr::null_mut());
        let unmatched = generate(ctx, &[(&none_matching, 1.0)], 2);
        sd_set_log_callback(None, std::ptr::null_mut());
        assert_eq!(unmatched.as_ref(), Some(&plain), "{mode}: a LoRA matching nothing");
        let log = LOG.lock().unwrap().join("");
        assert!(log.contains("matches no weight") && log.contains(&none_matching), "{mode}: no warning naming the file:\n{log}");
        free_sd_ctx(ctx);
    }
}

/// Weights read from the model files for each phase (`params_backend=disk`) still get the
/// LoRA, in either mode (applied at run time there): the golden run-time picture, and the
/// plain one once it is removed.
#[test]
fn loras_on_weights_kept_on_disk() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let kohya = lora("lora_sd1.safetensors");
    let (with, plain) = (golden_image("sd1-lora", "lora_runtime_1_0_0.png"), golden_image("sd1-lora", "lora_none_after_0.png"));
    let modes: &[&str] = if full() { &["immediately", "auto", "at_runtime"] } else { &["immediately"] };
    for &mode in modes {
        let ctx = context_on(mode, false, Some("disk"), None);
        let got = generate(ctx, &[(&kohya, 1.0)], 4).expect("LoRA on disk weights");
        let (max, mean) = diff_bytes(&got, &with);
        eprintln!("{mode}, params_backend=disk: LoRA vs golden at_runtime: max {max} mean {mean:.4}");
        assert!(max <= 3.0 && mean <= 0.25, "{mode}: max {max} mean {mean}");
        let got = generate(ctx, &[], 4).expect("LoRA removed");
        let (max, mean) = diff_bytes(&got, &plain);
        eprintln!("{mode}, params_backend=disk: removed vs golden plain: max {max} mean {mean:.4}");
        assert!(max <= 3.0 && mean <= 0.25, "{mode}: removed: max {max} mean {mean}");
        free_sd_ctx(ctx);
    }
}

/// LoRAs on q8_0 and q4_K weights (converted at load) in both modes: a picture in each
/// (the reference aborts merging into q8_0), close to each other (merging requantizes the
/// updated weights, so they are not identical), and the plain picture back on removal.
#[test]
fn quantized_models_take_loras_in_both_modes() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let peft = lora("peft_sd1.safetensors");
    for (name, wtype) in [("q8_0", 8u32), ("q4_K", 12)] {
        let mut pictures = Vec::new();
        for mode in ["immediately", "at_runtime"] {
            let ctx = context_on(mode, false, None, Some(wtype));
            let plain = generate(ctx, &[], 4).expect("plain");
            let with = generate(ctx, &[(&peft, 1.0)], 4).unwrap_or_else(|| panic!("{name} {mode}: no picture"));
            assert_ne!(with, plain, "{name} {mode}: the LoRA changed nothing");
            assert_eq!(generate(ctx, &[], 4).as_ref(), Some(&plain), "{name} {mode}: LoRA removed");
            free_sd_ctx(ctx);
            pictures.push(with);
        }
        let (max, mean) = diff_bytes(&pictures[0], &pictures[1]);
        eprintln!("{name}: immediately vs at_runtime: max {max} mean {mean:.4}");
        assert!(mean <= 2.0, "{name}: immediately and at_runtime differ by mean {mean}");
    }
}

/// Timings (not a check): model load, switching LoRAs, and time per step with the LoRA
/// merged against applied at run time. `cargo test --release --test parity_lora lora_costs -- --ignored --nocapture`
#[test]
#[ignore]
fn lora_costs() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (kohya, locon) = (lora("lora_sd1.safetensors"), lora("locon_sd1.safetensors"));
    for (mode, mmap) in [("immediately", false), ("immediately", true), ("at_runtime", false)] {
        let t = Instant::now();
        let ctx = context(mode, mmap);
        let load = t.elapsed().as_secs_f32();
        let time = |loras: &[(&str, f32)], steps| {
            let t = Instant::now();
            generate(ctx, loras, steps).expect("generation");
            t.elapsed().as_secs_f32()
        };
        time(&[], 1);
        let base = time(&[], 1);
        let first = time(&[(&kohya, 1.0)], 1) - base;
        let same = time(&[(&kohya, 1.0)], 1) - base;
        let switch = time(&[(&locon, 1.0)], 1) - base;
        let back = time(&[(&kohya, 0.5)], 1) - base;
        let off = time(&[], 1) - base;
        eprintln!(
            "{mode} mmap={mmap}: load {load:.2}s; with 1 step {base:.2}s; apply: first {first:.2}s, unchanged {same:.2}s, switch {switch:.2}s, multiplier {back:.2}s, remove {off:.2}s"
        );
        // Wall and CPU time (this process's user + system: less disturbed by other load).
        let sized = |loras: &[(&str, f32)], steps| {
            let (t, c) = (Instant::now(), cpu_seconds());
            generate_sized(ctx, loras, steps, 256).expect("generation");
            (t.elapsed().as_secs_f32(), cpu_seconds() - c)
        };
        let per_step = |loras: &[(&str, f32)]| {
            sized(loras, 1);
            let (one, four) = (sized(loras, 1), sized(loras, 4));
            ((four.0 - one.0) / 3.0, (four.1 - one.1) / 3.0)
        };
        let (without, with) = (per_step(&[]), per_step(&[(&kohya, 1.0)]));
        eprintln!(
            "{mode} mmap={mmap}: 256², per step without LoRA {:.3}s (CPU {:.3}s), with {:.3}s (CPU {:.3}s)",
            without.0, without.1, with.0, with.1
        );
        free_sd_ctx(ctx);
    }
}

/// CPU time (user + system) of this process so far, in seconds.
fn cpu_seconds() -> f32 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let secs = |t: libc::timeval| t.tv_sec as f32 + t.tv_usec as f32 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}
