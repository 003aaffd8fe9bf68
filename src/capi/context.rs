//! Contexts and the work they do: `new_sd_ctx`, generation, upscaling, ADetailer, convert.
//!
//! Each export checks and converts its arguments, then calls `api`; handles are looked up
//! in registries (see `handles`), never dereferenced.

use super::convert::{self, images_to_c};
use super::guard::{guard, opt_str, req_str, write_out};
use super::handles::Registry;
use super::types::*;
use crate::api::{self, AdetailerContext, AdetailerCtxParams, ConvertParams, Context, UpscalerContext, UpscalerParams};
use crate::error::{Error, Result};
use crate::types::CancelMode;
use libc::{c_char, c_int};
use std::sync::Arc;

static CONTEXTS: Registry<Context> = Registry::new();
static UPSCALERS: Registry<UpscalerContext> = Registry::new();
static ADETAILERS: Registry<AdetailerContext> = Registry::new();

fn context(p: *const sd_ctx_t) -> Result<Arc<Context>> {
    ensure!(!p.is_null(), "sd_ctx is NULL");
    CONTEXTS.get(p).ok_or_else(|| Error::new("sd_ctx is not a live context (already freed, or not from new_sd_ctx)"))
}

fn upscaler(p: *const upscaler_ctx_t) -> Result<Arc<UpscalerContext>> {
    ensure!(!p.is_null(), "upscaler_ctx is NULL");
    UPSCALERS.get(p).ok_or_else(|| Error::new("upscaler_ctx is not a live context (already freed, or not from new_upscaler_ctx)"))
}

fn adetailer(p: *const adetailer_ctx_t) -> Result<Arc<AdetailerContext>> {
    ensure!(!p.is_null(), "adetailer_ctx is NULL");
    ADETAILERS.get(p).ok_or_else(|| Error::new("adetailer_ctx is not a live context (already freed, or not from new_adetailer_ctx)"))
}

/// Results are "none" until a call succeeds (also when it fails early).
///
/// # Safety
/// `images_out` / `num_out` are NULL or writable.
unsafe fn clear_images(images_out: *mut *mut sd_image_t, num_out: *mut c_int) {
    // SAFETY: forwarded contract.
    unsafe {
        write_out(images_out, std::ptr::null_mut());
        write_out(num_out, 0);
    }
}

/// Hands images to the caller through the out-pointers (freed again if nobody takes them).
///
/// # Safety
/// `images_out` / `num_out` are NULL or writable.
unsafe fn give_images(images: &[api::Image], images_out: *mut *mut sd_image_t, num_out: *mut c_int) -> Result<()> {
    let (arr, n) = images_to_c(images)?;
    if images_out.is_null() {
        // SAFETY: just allocated by images_to_c.
        unsafe { convert::free_images(arr, n) };
    } else {
        // SAFETY: non-null, writable per the caller's contract.
        unsafe { images_out.write(arr) };
    }
    // SAFETY: forwarded contract.
    unsafe { write_out(num_out, n) };
    Ok(())
}

/// # Safety
/// `sd_ctx_params` is NULL or a valid `sd_ctx_params_t`.
#[no_mangle]
pub unsafe extern "C" fn new_sd_ctx(sd_ctx_params: *const sd_ctx_params_t) -> *mut sd_ctx_t {
    guard("new_sd_ctx", std::ptr::null_mut(), || {
        ensure!(!sd_ctx_params.is_null(), "sd_ctx_params is NULL");
        // SAFETY: non-null and valid per the caller's contract.
        let params = unsafe { convert::ctx_params(&*sd_ctx_params) }?;
        let ctx = Context::new(&params)?;
        Ok(CONTEXTS.insert(ctx, sd_ctx_t::new_tag()))
    })
}

#[no_mangle]
pub extern "C" fn free_sd_ctx(sd_ctx: *mut sd_ctx_t) {
    guard("free_sd_ctx", (), || {
        if sd_ctx.is_null() {
            return Ok(());
        }
        CONTEXTS.remove(sd_ctx).map(drop).ok_or_else(|| Error::new("sd_ctx is not a live context (double free?)"))
    })
}

#[no_mangle]
pub extern "C" fn sd_ctx_supports_image_generation(sd_ctx: *const sd_ctx_t) -> CBool {
    guard("sd_ctx_supports_image_generation", CBool::FALSE, || Ok(context(sd_ctx)?.supports_image_generation().into()))
}

#[no_mangle]
pub extern "C" fn sd_ctx_supports_video_generation(sd_ctx: *const sd_ctx_t) -> CBool {
    guard("sd_ctx_supports_video_generation", CBool::FALSE, || Ok(context(sd_ctx)?.supports_video_generation().into()))
}

/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn sd_ctx_load_control_net(sd_ctx: *mut sd_ctx_t, path: *const c_char) -> CBool {
    guard("sd_ctx_load_control_net", CBool::FALSE, || {
        let ctx = context(sd_ctx)?;
        // SAFETY: forwarded contract.
        let path = unsafe { req_str(path, "path") }?;
        ctx.load_control_net(&path)?;
        Ok(CBool::TRUE)
    })
}

#[no_mangle]
pub extern "C" fn sd_ctx_unload_control_net(sd_ctx: *mut sd_ctx_t) -> CBool {
    guard("sd_ctx_unload_control_net", CBool::FALSE, || {
        context(sd_ctx)?.unload_control_net()?;
        Ok(CBool::TRUE)
    })
}

#[no_mangle]
pub extern "C" fn sd_ctx_has_control_net(sd_ctx: *const sd_ctx_t) -> CBool {
    guard("sd_ctx_has_control_net", CBool::FALSE, || Ok(context(sd_ctx)?.has_control_net().into()))
}

/// Without a context (NULL) this is the model-independent default, like the reference.
#[no_mangle]
pub extern "C" fn sd_get_default_sample_method(sd_ctx: *const sd_ctx_t) -> sample_method_t {
    guard("sd_get_default_sample_method", sample_method_t::COUNT, || {
        let ctx = if sd_ctx.is_null() { None } else { Some(context(sd_ctx)?) };
        Ok(api::default_sample_method(ctx.as_deref()).into())
    })
}

/// Without a context (NULL) this is the model-independent default, like the reference.
#[no_mangle]
pub extern "C" fn sd_get_default_scheduler(sd_ctx: *const sd_ctx_t, sample_method: sample_method_t) -> scheduler_t {
    guard("sd_get_default_scheduler", scheduler_t::COUNT, || {
        let ctx = if sd_ctx.is_null() { None } else { Some(context(sd_ctx)?) };
        Ok(api::default_scheduler(ctx.as_deref(), sample_method.get()).into())
    })
}

/// # Safety
/// `sd_img_gen_params` is NULL or valid; the out-pointers are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn generate_image(
    sd_ctx: *mut sd_ctx_t,
    sd_img_gen_params: *const sd_img_gen_params_t,
    images_out: *mut *mut sd_image_t,
    num_images_out: *mut c_int,
) -> CBool {
    // SAFETY: forwarded contract.
    unsafe { clear_images(images_out, num_images_out) };
    guard("generate_image", CBool::FALSE, || {
        let ctx = context(sd_ctx)?;
        ensure!(!sd_img_gen_params.is_null(), "sd_img_gen_params is NULL");
        // SAFETY: non-null and valid per the caller's contract.
        let params = unsafe { convert::img_gen_params(&*sd_img_gen_params) }?;
        let images = ctx.generate_image(&params)?;
        // SAFETY: forwarded contract.
        unsafe { give_images(&images, images_out, num_images_out) }?;
        Ok(CBool::TRUE)
    })
}

/// An undeclared mode cancels everything, like the reference.
#[no_mangle]
pub extern "C" fn sd_cancel_generation(sd_ctx: *mut sd_ctx_t, mode: sd_cancel_mode_t) {
    guard("sd_cancel_generation", (), || {
        if sd_ctx.is_null() {
            return Ok(());
        }
        let ctx = context(sd_ctx)?;
        let mode = mode.get().unwrap_or_else(|| {
            sd_warn!("sd_cancel_generation: invalid mode {}, cancelling everything", mode.0);
            CancelMode::All
        });
        ctx.cancel(mode);
        Ok(())
    })
}

/// # Safety
/// `sd_vid_gen_params` is NULL or valid; the out-pointers are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn generate_video(
    sd_ctx: *mut sd_ctx_t,
    sd_vid_gen_params: *const sd_vid_gen_params_t,
    frames_out: *mut *mut sd_image_t,
    num_frames_out: *mut c_int,
    audio_out: *mut *mut sd_audio_t,
) -> CBool {
    // SAFETY: forwarded contract.
    unsafe {
        clear_images(frames_out, num_frames_out);
        write_out(audio_out, std::ptr::null_mut());
    }
    guard("generate_video", CBool::FALSE, || {
        let ctx = context(sd_ctx)?;
        ensure!(!sd_vid_gen_params.is_null(), "sd_vid_gen_params is NULL");
        // SAFETY: non-null and valid per the caller's contract.
        let params = unsafe { convert::vid_gen_params(&*sd_vid_gen_params) }?;
        let out = ctx.generate_video(&params)?;
        let audio = match (&out.audio, audio_out.is_null()) {
            (Some(a), false) => convert::audio_to_c(a)?,
            _ => std::ptr::null_mut(),
        };
        // SAFETY: forwarded contract.
        unsafe {
            if let Err(e) = give_images(&out.frames, frames_out, num_frames_out) {
                super::system::free_sd_audio(audio);
                return Err(e);
            }
            write_out(audio_out, audio);
        }
        Ok(CBool::TRUE)
    })
}

/// # Safety
/// The strings are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn new_upscaler_ctx(
    esrgan_path: *const c_char,
    direct: CBool,
    n_threads: c_int,
    tile_size: c_int,
    backend: *const c_char,
    params_backend: *const c_char,
) -> *mut upscaler_ctx_t {
    guard("new_upscaler_ctx", std::ptr::null_mut(), || {
        // SAFETY: forwarded contract.
        let params = unsafe {
            UpscalerParams {
                esrgan_path: req_str(esrgan_path, "esrgan_path")?,
                direct: direct.get(),
                n_threads,
                tile_size,
                backend: opt_str(backend, "backend")?,
                params_backend: opt_str(params_backend, "params_backend")?,
            }
        };
        let ctx = UpscalerContext::new(&params)?;
        Ok(UPSCALERS.insert(ctx, upscaler_ctx_t::new_tag()))
    })
}

#[no_mangle]
pub extern "C" fn free_upscaler_ctx(upscaler_ctx: *mut upscaler_ctx_t) {
    guard("free_upscaler_ctx", (), || {
        if upscaler_ctx.is_null() {
            return Ok(());
        }
        UPSCALERS.remove(upscaler_ctx).map(drop).ok_or_else(|| Error::new("upscaler_ctx is not a live context (double free?)"))
    })
}

/// # Safety
/// `input_image.data` is NULL or holds its pixels; the out-pointers are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn upscale(
    upscaler_ctx: *mut upscaler_ctx_t,
    input_image: sd_image_t,
    upscale_factor: u32,
    images_out: *mut *mut sd_image_t,
    num_images_out: *mut c_int,
) -> CBool {
    // SAFETY: forwarded contract.
    unsafe { clear_images(images_out, num_images_out) };
    guard("upscale", CBool::FALSE, || {
        let ctx = upscaler(upscaler_ctx)?;
        // SAFETY: forwarded contract.
        let image = unsafe { convert::image(&input_image, "input_image") }?
            .ok_or_else(|| Error::new("input_image has no pixel data"))?;
        let out = ctx.upscale(&image, upscale_factor)?;
        // SAFETY: forwarded contract.
        unsafe { give_images(std::slice::from_ref(&out), images_out, num_images_out) }?;
        Ok(CBool::TRUE)
    })
}

/// 1 without a live context, like the reference.
#[no_mangle]
pub extern "C" fn get_upscale_factor(upscaler_ctx: *mut upscaler_ctx_t) -> c_int {
    guard("get_upscale_factor", 1, || {
        if upscaler_ctx.is_null() {
            return Ok(1);
        }
        Ok(upscaler(upscaler_ctx)?.scale_factor())
    })
}

/// # Safety
/// The strings are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn new_adetailer_ctx(
    detector_path: *const c_char,
    n_threads: c_int,
    backend: *const c_char,
    params_backend: *const c_char,
) -> *mut adetailer_ctx_t {
    guard("new_adetailer_ctx", std::ptr::null_mut(), || {
        // SAFETY: forwarded contract.
        let params = unsafe {
            AdetailerCtxParams {
                detector_path: req_str(detector_path, "detector_path")?,
                n_threads,
                backend: opt_str(backend, "backend")?,
                params_backend: opt_str(params_backend, "params_backend")?,
            }
        };
        ensure!(!params.detector_path.is_empty(), "detector_path is empty");
        let ctx = AdetailerContext::new(&params)?;
        Ok(ADETAILERS.insert(ctx, adetailer_ctx_t::new_tag()))
    })
}

#[no_mangle]
pub extern "C" fn free_adetailer_ctx(adetailer_ctx: *mut adetailer_ctx_t) {
    guard("free_adetailer_ctx", (), || {
        if adetailer_ctx.is_null() {
            return Ok(());
        }
        ADETAILERS
            .remove(adetailer_ctx)
            .map(drop)
            .ok_or_else(|| Error::new("adetailer_ctx is not a live context (double free?)"))
    })
}

/// # Safety
/// Pointers are NULL or valid; the out-pointers are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn adetail_image(
    adetailer_ctx: *mut adetailer_ctx_t,
    sd_ctx: *mut sd_ctx_t,
    input_image: sd_image_t,
    adetailer_params: *const sd_adetailer_params_t,
    inpaint_params: *const sd_img_gen_params_t,
    images_out: *mut *mut sd_image_t,
    num_images_out: *mut c_int,
) -> CBool {
    // SAFETY: forwarded contract.
    unsafe { clear_images(images_out, num_images_out) };
    guard("adetail_image", CBool::FALSE, || {
        let detailer = adetailer(adetailer_ctx)?;
        let sd = context(sd_ctx)?;
        ensure!(!adetailer_params.is_null(), "adetailer_params is NULL");
        ensure!(!inpaint_params.is_null(), "inpaint_params is NULL");
        // SAFETY (conversions): non-null and valid per the caller's contract.
        let image = unsafe { convert::image(&input_image, "input_image") }?
            .ok_or_else(|| Error::new("input_image has no pixel data"))?;
        let params = unsafe { convert::adetailer_params(&*adetailer_params) }?;
        let inpaint = unsafe { convert::img_gen_params(&*inpaint_params) }?;
        let out = detailer.detail(&sd, &image, &params, &inpaint)?;
        // SAFETY: forwarded contract.
        unsafe { give_images(std::slice::from_ref(&out), images_out, num_images_out) }?;
        Ok(CBool::TRUE)
    })
}

/// # Safety
/// The strings are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn convert(
    input_path: *const c_char,
    vae_path: *const c_char,
    output_path: *const c_char,
    output_type: sd_type_t,
    tensor_type_rules: *const c_char,
    convert_name: CBool,
) -> CBool {
    // SAFETY: forwarded contract.
    unsafe {
        convert_with_components(
            input_path,
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            vae_path,
            output_path,
            output_type,
            tensor_type_rules,
            convert_name,
            0,
        )
    }
}

/// # Safety
/// The strings are NULL or NUL-terminated.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn convert_with_components(
    model_path: *const c_char,
    clip_l_path: *const c_char,
    clip_g_path: *const c_char,
    t5xxl_path: *const c_char,
    diffusion_model_path: *const c_char,
    vae_path: *const c_char,
    output_path: *const c_char,
    output_type: sd_type_t,
    tensor_type_rules: *const c_char,
    convert_name: CBool,
    n_threads: c_int,
) -> CBool {
    guard("convert", CBool::FALSE, || {
        // SAFETY: forwarded contract.
        let params = unsafe {
            ConvertParams {
                model_path: opt_str(model_path, "model_path")?,
                clip_l_path: opt_str(clip_l_path, "clip_l_path")?,
                clip_g_path: opt_str(clip_g_path, "clip_g_path")?,
                t5xxl_path: opt_str(t5xxl_path, "t5xxl_path")?,
                diffusion_model_path: opt_str(diffusion_model_path, "diffusion_model_path")?,
                vae_path: opt_str(vae_path, "vae_path")?,
                output_path: req_str(output_path, "output_path")?,
                output_type: output_type.get_or_auto("output_type")?,
                tensor_type_rules: opt_str(tensor_type_rules, "tensor_type_rules")?,
                convert_name: convert_name.get(),
                n_threads,
            }
        };
        api::convert(&params)?;
        Ok(CBool::TRUE)
    })
}
