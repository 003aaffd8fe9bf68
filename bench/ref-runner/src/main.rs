//! Benchmark runner for the reference stable-diffusion.cpp, through the C API of the
//! registry package `diffusion-rs-sys` (its own bindings, its own ggml). Prints one JSON
//! report on stdout; see `sd_bench_common`.

use diffusion_rs_sys as sys;
use sd_bench_common::{self as common, Job, Outcome, Picture};
use common::{cstr, lib_str};
use std::ffi::{c_char, c_void};
use std::process::ExitCode;

unsafe extern "C" fn log_cb(level: sys::sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    common::on_c_log(level as i64, text);
}

unsafe extern "C" fn progress_cb(step: i32, steps: i32, time: f32, _data: *mut c_void) {
    common::on_progress(step, steps, time);
}

/// An ESRGAN upscale of the test image (`job.upscale_model`).
///
/// # Safety
/// The callbacks are installed.
unsafe fn run_upscale(job: &Job, version: String, system_info: String) -> Result<Outcome<'static>, String> {
    let model = cstr(&job.upscale_model)?;
    // SAFETY: valid NUL-terminated path; NULL backends mean the default; the result is
    // checked for NULL and the context freed once.
    unsafe {
        let (load_s, ctx) =
            common::timed(|| sys::new_upscaler_ctx(model.as_ptr(), false, job.threads, job.tile_size, std::ptr::null(), std::ptr::null()));
        if ctx.is_null() {
            return Err("new_upscaler_ctx failed".into());
        }
        let mut outcome = Outcome { side: "reference", version, system_info, load_s, generate_s: None, picture: None, error: None };
        let mut pixels = common::test_image(job.width as u32, job.height as u32);
        let input = sys::sd_image_t { width: job.width as u32, height: job.height as u32, channel: 3, data: pixels.as_mut_ptr() };
        common::set_generating(true);
        let (upscale_s, img) = common::timed(|| sys::upscale(ctx, input, 4));
        common::set_generating(false);
        outcome.generate_s = Some(upscale_s);
        if img.data.is_null() {
            outcome.error = Some("upscale returned no image".into());
        } else {
            let len = (img.width * img.height * img.channel) as usize;
            // Copied; the library's buffer is left to the process exit.
            let data: &'static [u8] = Box::leak(std::slice::from_raw_parts(img.data, len).to_vec().into_boxed_slice());
            outcome.picture = Some(Picture { width: img.width, height: img.height, channels: img.channel, data });
        }
        sys::free_upscaler_ctx(ctx);
        Ok(outcome)
    }
}

fn run(job: &Job) -> Result<Outcome<'static>, String> {
    let model = cstr(&job.model)?;
    let prompt = cstr(&job.prompt)?;
    let negative = cstr(&job.negative_prompt)?;
    let wtype_name = cstr(&job.wtype)?;
    let sampler_name = cstr(&job.sampler)?;
    let components = job.components.iter().map(|(_, p)| cstr(p)).collect::<Result<Vec<_>, _>>()?;

    // SAFETY: plain C calls with valid, NUL-terminated strings and initialised structs that
    // outlive the calls; results are checked for NULL before use and freed by the library.
    unsafe {
        sys::sd_set_log_callback(Some(log_cb), std::ptr::null_mut());
        sys::sd_set_progress_callback(Some(progress_cb), std::ptr::null_mut());
        let version = lib_str(sys::sd_version());
        let system_info = lib_str(sys::sd_get_system_info());
        if job.is_upscale() {
            return run_upscale(job, version, system_info);
        }

        let mut cp: sys::sd_ctx_params_t = std::mem::zeroed();
        sys::sd_ctx_params_init(&mut cp);
        cp.model_path = model.as_ptr();
        for ((key, _), path) in job.components.iter().zip(&components) {
            let slot = common::component_slot(key, sd_bench_common::component_slots!(cp))?;
            *slot = path.as_ptr();
        }
        cp.n_threads = job.threads;
        cp.enable_mmap = job.mmap;
        cp.flash_attn = job.flash_attn;
        if !job.wtype.is_empty() {
            let wtype = sys::str_to_sd_type(wtype_name.as_ptr());
            if wtype == sys::sd_type_t::SD_TYPE_COUNT {
                return Err(format!("unknown weight type {:?}", job.wtype));
            }
            cp.wtype = wtype;
        }
        let (load_s, ctx) = common::timed(|| sys::new_sd_ctx(&cp));
        if ctx.is_null() {
            return Err("new_sd_ctx failed".into());
        }
        let mut outcome = Outcome {
            side: "reference",
            version,
            system_info,
            load_s,
            generate_s: None,
            picture: None,
            error: None,
        };
        let mut gp: sys::sd_img_gen_params_t = std::mem::zeroed();
        sys::sd_img_gen_params_init(&mut gp);
        gp.prompt = prompt.as_ptr();
        gp.negative_prompt = negative.as_ptr();
        gp.width = job.width;
        gp.height = job.height;
        gp.seed = job.seed;
        gp.batch_count = 1;
        gp.sample_params.sample_steps = job.steps;
        gp.sample_params.guidance.txt_cfg = job.cfg;
        let method = sys::str_to_sample_method(sampler_name.as_ptr());
        if method == sys::sample_method_t::SAMPLE_METHOD_COUNT {
            sys::free_sd_ctx(ctx);
            return Err(format!("unknown sampler {:?}", job.sampler));
        }
        gp.sample_params.sample_method = method;
        gp.sample_params.scheduler = sys::sd_get_default_scheduler(ctx, method);

        common::set_generating(true);
        let (generate_s, images) = common::timed(|| sys::generate_image(ctx, &gp));
        common::set_generating(false);
        outcome.generate_s = Some(generate_s);
        if images.is_null() || (*images).data.is_null() {
            outcome.error = Some("generate_image returned no image".into());
        } else {
            let img = &*images;
            let len = (img.width * img.height * img.channel) as usize;
            // Copied so the library's buffers are freed before the process reports.
            let data: &'static [u8] = Box::leak(std::slice::from_raw_parts(img.data, len).to_vec().into_boxed_slice());
            outcome.picture = Some(Picture { width: img.width, height: img.height, channels: img.channel, data });
            sys::free_sd_images(images, 1);
        }
        sys::free_sd_ctx(ctx);
        Ok(outcome)
    }
}

fn main() -> ExitCode {
    common::runner_main("reference", run)
}
