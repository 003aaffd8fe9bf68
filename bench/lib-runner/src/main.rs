//! Benchmark runner for a stable-diffusion.cpp shared library chosen at run time
//! (`--library PATH`): e.g. the reference at the exact commit we follow, built by
//! `bench/build-reference.sh` with or without llamafile. The library is opened with
//! `dlopen` and called through the C API of `stable-diffusion.h`, whose struct layouts are
//! this repository's `capi` types (checked against the reference header by tests/abi.rs).
//! Runs image jobs (`generate_image`), video jobs (`generate_video`, `--video-frames N`; the
//! frames come back stacked into one picture) and upscale jobs; our own library is run the
//! same way through its C API (`target/release/libstable_diffusion.so`).
//! Prints one JSON report on stdout; see `sd_bench_common`.

use sd_bench_common::{self as common, Job, Outcome, Picture};
use stable_diffusion::capi::{
    sample_method_t, sd_audio_t, sd_ctx_params_t, sd_ctx_t, sd_image_t, sd_img_gen_params_t, sd_log_cb_t,
    sd_log_level_t, sd_progress_cb_t, sd_sample_params_t, sd_type_t, sd_vid_gen_params_t, upscaler_ctx_t, scheduler_t,
};
use common::{cstr, lib_str};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::process::ExitCode;

/// The entry points the runner calls, resolved from the library.
struct Api {
    set_log_callback: unsafe extern "C" fn(sd_log_cb_t, *mut c_void),
    set_progress_callback: unsafe extern "C" fn(sd_progress_cb_t, *mut c_void),
    version: unsafe extern "C" fn() -> *const c_char,
    system_info: unsafe extern "C" fn() -> *const c_char,
    ctx_params_init: unsafe extern "C" fn(*mut sd_ctx_params_t),
    new_ctx: unsafe extern "C" fn(*const sd_ctx_params_t) -> *mut sd_ctx_t,
    free_ctx: unsafe extern "C" fn(*mut sd_ctx_t),
    img_gen_params_init: unsafe extern "C" fn(*mut sd_img_gen_params_t),
    generate_image: unsafe extern "C" fn(*mut sd_ctx_t, *const sd_img_gen_params_t, *mut *mut sd_image_t, *mut c_int) -> bool,
    vid_gen_params_init: unsafe extern "C" fn(*mut sd_vid_gen_params_t),
    generate_video:
        unsafe extern "C" fn(*mut sd_ctx_t, *const sd_vid_gen_params_t, *mut *mut sd_image_t, *mut c_int, *mut *mut sd_audio_t) -> bool,
    free_images: unsafe extern "C" fn(*mut sd_image_t, c_int),
    str_to_type: unsafe extern "C" fn(*const c_char) -> sd_type_t,
    str_to_sample_method: unsafe extern "C" fn(*const c_char) -> sample_method_t,
    default_scheduler: unsafe extern "C" fn(*const sd_ctx_t, sample_method_t) -> scheduler_t,
    new_upscaler: unsafe extern "C" fn(*const c_char, bool, c_int, c_int, *const c_char, *const c_char) -> *mut upscaler_ctx_t,
    upscale: unsafe extern "C" fn(*mut upscaler_ctx_t, sd_image_t, u32, *mut *mut sd_image_t, *mut c_int) -> bool,
    free_upscaler: unsafe extern "C" fn(*mut upscaler_ctx_t),
}

impl Api {
    fn open(path: &str) -> Result<Api, String> {
        let c = CString::new(path).map_err(|_| "the library path contains a NUL byte".to_string())?;
        // SAFETY: dlopen with a valid path; the handle is kept for the process lifetime.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or NULL.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() { String::new() } else { unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned() };
            return Err(format!("dlopen {path}: {why}"));
        }
        let sym = |name: &str| -> Result<*mut c_void, String> {
            let n = CString::new(name).unwrap();
            // SAFETY: a valid handle and symbol name.
            let p = unsafe { libc::dlsym(handle, n.as_ptr()) };
            if p.is_null() {
                Err(format!("{path} has no symbol {name}"))
            } else {
                Ok(p)
            }
        };
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: the symbol is the C function of stable-diffusion.h with this
                // signature (the field's type).
                unsafe { std::mem::transmute(sym($name)?) }
            };
        }
        Ok(Api {
            set_log_callback: f!("sd_set_log_callback"),
            set_progress_callback: f!("sd_set_progress_callback"),
            version: f!("sd_version"),
            system_info: f!("sd_get_system_info"),
            ctx_params_init: f!("sd_ctx_params_init"),
            new_ctx: f!("new_sd_ctx"),
            free_ctx: f!("free_sd_ctx"),
            img_gen_params_init: f!("sd_img_gen_params_init"),
            generate_image: f!("generate_image"),
            vid_gen_params_init: f!("sd_vid_gen_params_init"),
            generate_video: f!("generate_video"),
            free_images: f!("free_sd_images"),
            str_to_type: f!("str_to_sd_type"),
            str_to_sample_method: f!("str_to_sample_method"),
            default_scheduler: f!("sd_get_default_scheduler"),
            new_upscaler: f!("new_upscaler_ctx"),
            upscale: f!("upscale"),
            free_upscaler: f!("free_upscaler_ctx"),
        })
    }
}

unsafe extern "C" fn log_cb(level: sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    common::on_c_log(level.0 as i64, text);
}

unsafe extern "C" fn progress_cb(step: c_int, steps: c_int, time: f32, _data: *mut c_void) {
    common::on_progress(step, steps, time);
}

/// A call's `images_out` / `num_images_out` into the outcome: the first picture, or with
/// `all` every frame stacked top to bottom (a video compares frame by frame that way); the
/// error that `what` gave none otherwise. The images are freed.
///
/// # Safety
/// `images` holds `count` images of the library when not NULL.
unsafe fn take_picture(api: &Api, outcome: &mut Outcome<'static>, ok: bool, images: *mut sd_image_t, count: c_int, what: &str, all: bool) {
    let frames: &[sd_image_t] = if ok && !images.is_null() && count >= 1 {
        // SAFETY: per the contract, `images` points to `count` valid images.
        unsafe { std::slice::from_raw_parts(images, if all { count as usize } else { 1 }) }
    } else {
        &[]
    };
    let same_shape = frames.windows(2).all(|w| (w[0].width, w[0].height, w[0].channel) == (w[1].width, w[1].height, w[1].channel));
    match frames.first() {
        Some(first) if same_shape && frames.iter().all(|f| !f.data.is_null()) => {
            // A copy, so that the library's buffers can be freed before the report.
            let mut data = Vec::new();
            for f in frames {
                // SAFETY: a frame's buffer is width × height × channel bytes.
                data.extend_from_slice(unsafe { std::slice::from_raw_parts(f.data, (f.width * f.height * f.channel) as usize) });
            }
            let data: &'static [u8] = Box::leak(data.into_boxed_slice());
            let height = first.height * frames.len() as u32;
            outcome.picture = Some(Picture { width: first.width, height, channels: first.channel, data });
        }
        _ => outcome.error = Some(format!("{what} returned no image")),
    }
    if !images.is_null() {
        unsafe { (api.free_images)(images, count) };
    }
}

/// # Safety
/// The callbacks are installed.
unsafe fn run_upscale(api: &Api, job: &Job, mut outcome: Outcome<'static>) -> Result<Outcome<'static>, String> {
    let model = cstr(&job.upscale_model)?;
    // SAFETY: valid strings; NULL backends are the defaults; results checked for NULL.
    unsafe {
        let (load_s, ctx) =
            common::timed(|| (api.new_upscaler)(model.as_ptr(), false, job.threads, job.tile_size, std::ptr::null(), std::ptr::null()));
        if ctx.is_null() {
            return Err("new_upscaler_ctx failed".into());
        }
        outcome.load_s = load_s;
        let mut pixels = common::test_image(job.width as u32, job.height as u32);
        let input = sd_image_t { width: job.width as u32, height: job.height as u32, channel: 3, data: pixels.as_mut_ptr() };
        common::set_generating(true);
        let (mut images, mut count) = (std::ptr::null_mut(), 0);
        let (upscale_s, ok) = common::timed(|| (api.upscale)(ctx, input, 4, &mut images, &mut count));
        common::set_generating(false);
        outcome.generate_s = Some(upscale_s);
        take_picture(api, &mut outcome, ok, images, count, "upscale", false);
        (api.free_upscaler)(ctx);
        Ok(outcome)
    }
}

fn run(job: &Job) -> Result<Outcome<'static>, String> {
    if job.library.is_empty() {
        return Err("--library PATH is required".into());
    }
    let api = Api::open(&job.library)?;
    let model = cstr(&job.model)?;
    let prompt = cstr(&job.prompt)?;
    let negative = cstr(&job.negative_prompt)?;
    let wtype_name = cstr(&job.wtype)?;
    let sampler_name = cstr(&job.sampler)?;
    let components = job.components.iter().map(|(_, p)| cstr(p)).collect::<Result<Vec<_>, _>>()?;

    // SAFETY: C calls with valid, NUL-terminated strings and initialised structs that
    // outlive the calls; results are checked for NULL before use and freed by the library.
    unsafe {
        (api.set_log_callback)(Some(log_cb), std::ptr::null_mut());
        (api.set_progress_callback)(Some(progress_cb), std::ptr::null_mut());
        let mut outcome = Outcome {
            side: "library",
            version: lib_str((api.version)()),
            system_info: lib_str((api.system_info)()),
            load_s: 0.0,
            generate_s: None,
            picture: None,
            error: None,
        };
        if job.is_upscale() {
            return run_upscale(&api, job, outcome);
        }

        let mut cp: sd_ctx_params_t = std::mem::zeroed();
        (api.ctx_params_init)(&mut cp);
        cp.model_path = model.as_ptr();
        for ((key, _), path) in job.components.iter().zip(&components) {
            *common::component_slot(key, sd_bench_common::component_slots!(cp))? = path.as_ptr();
        }
        cp.n_threads = job.threads;
        cp.enable_mmap = job.mmap.into();
        cp.flash_attn = job.flash_attn.into();
        let fast_arg = cstr("fast=1")?;
        if job.fast {
            cp.model_args = fast_arg.as_ptr();
        }
        if !job.wtype.is_empty() {
            let wtype = (api.str_to_type)(wtype_name.as_ptr());
            if wtype == sd_type_t::COUNT {
                return Err(format!("unknown weight type {:?}", job.wtype));
            }
            cp.wtype = wtype;
        }
        let (load_s, ctx) = common::timed(|| (api.new_ctx)(&cp));
        if ctx.is_null() {
            return Err("new_sd_ctx failed".into());
        }
        outcome.load_s = load_s;
        let method = (api.str_to_sample_method)(sampler_name.as_ptr());
        if method == sample_method_t::COUNT {
            (api.free_ctx)(ctx);
            return Err(format!("unknown sampler {:?}", job.sampler));
        }
        let sample = |sp: &mut sd_sample_params_t| {
            sp.sample_steps = job.steps;
            sp.guidance.txt_cfg = job.cfg;
            sp.sample_method = method;
            sp.scheduler = (api.default_scheduler)(ctx, method);
        };
        let (mut images, mut count) = (std::ptr::null_mut(), 0);
        let (what, (generate_s, ok)) = if job.is_video() {
            let mut vp: sd_vid_gen_params_t = std::mem::zeroed();
            (api.vid_gen_params_init)(&mut vp);
            vp.prompt = prompt.as_ptr();
            vp.negative_prompt = negative.as_ptr();
            vp.width = job.width;
            vp.height = job.height;
            vp.seed = job.seed;
            vp.video_frames = job.video_frames;
            sample(&mut vp.sample_params);
            common::set_generating(true);
            ("generate_video", common::timed(|| (api.generate_video)(ctx, &vp, &mut images, &mut count, std::ptr::null_mut())))
        } else {
            let mut gp: sd_img_gen_params_t = std::mem::zeroed();
            (api.img_gen_params_init)(&mut gp);
            gp.prompt = prompt.as_ptr();
            gp.negative_prompt = negative.as_ptr();
            gp.width = job.width;
            gp.height = job.height;
            gp.seed = job.seed;
            gp.batch_count = 1;
            let mut reference = common::test_image(job.width as u32, job.height as u32);
            let mut refs = [sd_image_t { width: job.width as u32, height: job.height as u32, channel: 3, data: reference.as_mut_ptr() }];
            if job.ref_image {
                gp.ref_images = refs.as_mut_ptr();
                gp.ref_images_count = 1;
            }
            sample(&mut gp.sample_params);
            common::set_generating(true);
            ("generate_image", common::timed(|| (api.generate_image)(ctx, &gp, &mut images, &mut count)))
        };
        common::set_generating(false);
        outcome.generate_s = Some(generate_s);
        take_picture(&api, &mut outcome, ok, images, count, what, job.is_video());
        (api.free_ctx)(ctx);
        Ok(outcome)
    }
}

fn main() -> ExitCode {
    common::runner_main("library", run)
}
