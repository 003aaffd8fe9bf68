//! ControlNet through the C API: golden parity (`golden/sd1-control/`: a control image and a
//! Canny map at several strengths, two samplers, img2img, no control image), and swapping
//! the ControlNet on a live context (`sd_ctx_load_control_net` / `unload` / `has`): an
//! unloaded ControlNet gives the picture of a context that never had one, a loaded one the
//! picture of a context created with it, and a file that fails to load changes nothing.

mod common;

use common::parity::{diff_bytes, ctx_params, ensure_fixtures, folder, fixture, full, golden_image, render_params, report, run, Arena, MAX_DIFF, MEAN_DIFF};
use stable_diffusion::capi::*;
use std::ffi::CString;
use std::sync::Mutex;

/// The tests of this file load the same 2 GB model: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn sd1_control_cases() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Without SD_PARITY=full: a Canny map at full strength and img2img (CI's time).
    report(&run("sd1-control", |c| full() || matches!(c.name.as_str(), "control_canny_1_0" | "control_img2img")));
}

/// A context for the `sd1-control` case `name`, with or without its ControlNet.
fn context(name: &str, with_control: bool) -> *mut sd_ctx_t {
    let f = folder("sd1-control");
    let case = f.cases.iter().find(|c| c.name == name).expect("case");
    let mut ctx = case.ctx.clone();
    if !with_control {
        ctx.as_object_mut().unwrap().remove("control_net_path");
    }
    let mut arena = Arena::default();
    let p = ctx_params(&f.model, &ctx, &mut arena);
    // SAFETY: p and everything it points to are alive during the call.
    let sd = unsafe { new_sd_ctx(&p) };
    assert!(!sd.is_null(), "new_sd_ctx failed");
    sd
}

/// The picture of the `sd1-control` case `name`'s parameters on `ctx`.
fn render(ctx: *mut sd_ctx_t, name: &str) -> Vec<u8> {
    let f = folder("sd1-control");
    let case = f.cases.iter().find(|c| c.name == name).expect("case");
    render_params(ctx, &case.params)
}

fn load(ctx: *mut sd_ctx_t, path: &str) -> bool {
    let c = CString::new(path).unwrap();
    // SAFETY: valid context, NUL-terminated path alive during the call.
    unsafe { sd_ctx_load_control_net(ctx, c.as_ptr()) }.0 != 0
}

fn has(ctx: *mut sd_ctx_t) -> bool {
    sd_ctx_has_control_net(ctx).0 != 0
}

#[test]
fn control_net_hot_swap() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const CASE: &str = "control_init_0_9";
    let control = fixture("control_sd1.safetensors").to_string_lossy().into_owned();

    let ctx = context(CASE, false);
    assert!(!has(ctx));
    let plain = render(ctx, CASE);

    assert!(load(ctx, &control), "loading the ControlNet failed");
    assert!(has(ctx));
    let controlled = render(ctx, CASE);
    let (max, mean) = diff_bytes(&controlled, &golden_image("sd1-control", &format!("{CASE}_0.png")));
    eprintln!("hot-loaded ControlNet vs golden {CASE}: max {max} mean {mean:.4}");
    assert!(max <= MAX_DIFF && mean <= MEAN_DIFF, "hot-loaded ControlNet is off the golden picture: max {max} mean {mean}");
    assert!(diff_bytes(&controlled, &plain).1 > 1.0, "the ControlNet must change the picture");

    // Files that fail to load leave the loaded ControlNet in place.
    let junk = std::env::temp_dir().join(format!("sd-control-junk-{}.safetensors", std::process::id()));
    std::fs::write(&junk, b"not a model at all").unwrap();
    let sd1 = fixture("sd1.safetensors").to_string_lossy().into_owned();
    for bad in ["/no/such/control_net.safetensors", junk.to_str().unwrap(), sd1.as_str(), ""] {
        assert!(!load(ctx, bad), "loading '{bad}' must fail");
        assert!(has(ctx), "a failed load of '{bad}' must keep the ControlNet");
    }
    std::fs::remove_file(&junk).ok();
    assert!(render(ctx, CASE) == controlled, "a failed load changed the picture");

    assert!(sd_ctx_unload_control_net(ctx).0 != 0);
    assert!(!has(ctx));
    assert!(render(ctx, CASE) == plain, "after unloading, the picture must be the one without ControlNet");
    assert!(sd_ctx_unload_control_net(ctx).0 != 0, "unloading twice is fine");
    assert!(!load(ctx, "/no/such/control_net.safetensors"));
    assert!(!has(ctx), "a failed load must not leave a ControlNet");

    assert!(load(ctx, &control));
    assert!(render(ctx, CASE) == controlled, "loading again must give the same picture");
    free_sd_ctx(ctx);

    let fresh = context(CASE, true);
    assert!(has(fresh));
    assert!(render(fresh, CASE) == controlled, "a context created with the ControlNet must render what the hot-loaded one did");
    free_sd_ctx(fresh);
}

/// An SDXL ControlNet (synthetic, no golden data: tests/fixtures/synth_control_sdxl.py) loads
/// with its layout read from the weights (label embedding, three levels, transformer depths
/// 0/2/10, 2048-wide context) and acts: it changes the picture, strength 0 gives the plain
/// picture, and unloading it gives the plain picture again. With `SD_PARITY=full` (7 GB).
#[test]
fn sdxl_controlnet_acts() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = folder("sdxl");
    let case = f.cases.iter().find(|c| c.name == "sdxl_euler_v").expect("case");
    ensure_fixtures(&f.model, &case.ctx);
    let control = fixture("control_sdxl.safetensors").to_string_lossy().into_owned();
    let mut arena = Arena::default();
    let p = ctx_params(&f.model, &case.ctx, &mut arena);
    // SAFETY: p and everything it points to are alive during the call.
    let ctx = unsafe { new_sd_ctx(&p) };
    assert!(!ctx.is_null(), "new_sd_ctx failed");
    let mut params = case.params.clone();
    params["control_image"] = "init_64.png".into();
    params["control_strength"] = 0.9.into();
    let plain = render_params(ctx, &params);
    assert!(load(ctx, &control), "loading the SDXL ControlNet failed");
    let controlled = render_params(ctx, &params);
    let (max, mean) = diff_bytes(&controlled, &plain);
    eprintln!("SDXL ControlNet vs none: max {max} mean {mean:.3}");
    assert!(mean > 0.5, "the SDXL ControlNet must change the picture (mean {mean})");
    params["control_strength"] = 0.0.into();
    assert!(render_params(ctx, &params) == plain, "strength 0 must give the plain picture");
    params["control_strength"] = 0.9.into();
    assert!(sd_ctx_unload_control_net(ctx).0 != 0);
    assert!(render_params(ctx, &params) == plain, "after unloading, the plain picture");
    free_sd_ctx(ctx);
}
