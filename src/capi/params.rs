//! `sd_*_params_init` (the api defaults written into C structs) and `sd_*_params_to_str`.

use super::convert::{self, malloc_cstring};
use super::describe;
use super::guard::guard;
use super::types::*;
use crate::api::{CacheParams, CtxParams, HiresParams, ImgGenParams, SampleParams, VidGenParams};
use libc::c_char;

/// Writes `value` to `p`, logging when `p` is NULL.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
unsafe fn init_into<T>(func: &str, p: *mut T, value: impl FnOnce() -> T) {
    guard(func, (), || {
        ensure!(!p.is_null(), "params pointer is NULL");
        // SAFETY: non-null and writable per the caller's contract (the write does not read
        // the old, possibly uninitialised contents).
        unsafe { p.write(value()) };
        Ok(())
    })
}

/// # Safety
/// `cache_params` is NULL or points to writable memory for an `sd_cache_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_cache_params_init(cache_params: *mut sd_cache_params_t) {
    // SAFETY: forwarded contract.
    unsafe { init_into("sd_cache_params_init", cache_params, || convert::cache_params_to_c(&CacheParams::default())) }
}

/// # Safety
/// `hires_params` is NULL or points to writable memory for an `sd_hires_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_hires_params_init(hires_params: *mut sd_hires_params_t) {
    // SAFETY: forwarded contract.
    unsafe { init_into("sd_hires_params_init", hires_params, || convert::hires_params_to_c(&HiresParams::default())) }
}

/// # Safety
/// `sd_ctx_params` is NULL or points to writable memory for an `sd_ctx_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_ctx_params_init(sd_ctx_params: *mut sd_ctx_params_t) {
    // SAFETY: forwarded contract.
    unsafe { init_into("sd_ctx_params_init", sd_ctx_params, || convert::ctx_params_to_c(&CtxParams::default())) }
}

/// # Safety
/// `sample_params` is NULL or points to writable memory for an `sd_sample_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_sample_params_init(sample_params: *mut sd_sample_params_t) {
    // SAFETY: forwarded contract.
    unsafe {
        init_into("sd_sample_params_init", sample_params, || convert::sample_params_to_c(&SampleParams::default()))
    }
}

/// # Safety
/// `sd_img_gen_params` is NULL or points to writable memory for an `sd_img_gen_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_img_gen_params_init(sd_img_gen_params: *mut sd_img_gen_params_t) {
    // SAFETY: forwarded contract.
    unsafe {
        init_into("sd_img_gen_params_init", sd_img_gen_params, || convert::img_gen_params_to_c(&ImgGenParams::default()))
    }
}

/// # Safety
/// `sd_vid_gen_params` is NULL or points to writable memory for an `sd_vid_gen_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_vid_gen_params_init(sd_vid_gen_params: *mut sd_vid_gen_params_t) {
    // SAFETY: forwarded contract.
    unsafe {
        init_into("sd_vid_gen_params_init", sd_vid_gen_params, || convert::vid_gen_params_to_c(&VidGenParams::default()))
    }
}

/// Describes `*p` with `describe` into a `malloc`ed string (NULL when `p` is NULL).
///
/// # Safety
/// `p` is NULL or points to a valid `T` whose string pointers are NULL or NUL-terminated.
unsafe fn describe_into<T>(func: &str, p: *const T, describe: unsafe fn(&T) -> String) -> *mut c_char {
    guard(func, std::ptr::null_mut(), || {
        ensure!(!p.is_null(), "params pointer is NULL");
        // SAFETY: non-null and valid per the caller's contract.
        let text = unsafe { describe(&*p) };
        malloc_cstring(&text)
    })
}

/// Returns a `malloc`ed description (release it with `free`).
///
/// # Safety
/// `sd_ctx_params` is NULL or a valid `sd_ctx_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_ctx_params_to_str(sd_ctx_params: *const sd_ctx_params_t) -> *mut c_char {
    // SAFETY: forwarded contract.
    unsafe { describe_into("sd_ctx_params_to_str", sd_ctx_params, describe::ctx_params) }
}

/// Returns a `malloc`ed description (release it with `free`).
///
/// # Safety
/// `sample_params` is NULL or a valid `sd_sample_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_sample_params_to_str(sample_params: *const sd_sample_params_t) -> *mut c_char {
    // SAFETY: forwarded contract.
    unsafe { describe_into("sd_sample_params_to_str", sample_params, describe::sample_params) }
}

/// Returns a `malloc`ed description (release it with `free`).
///
/// # Safety
/// `sd_img_gen_params` is NULL or a valid `sd_img_gen_params_t`.
#[no_mangle]
pub unsafe extern "C" fn sd_img_gen_params_to_str(sd_img_gen_params: *const sd_img_gen_params_t) -> *mut c_char {
    // SAFETY: forwarded contract.
    unsafe { describe_into("sd_img_gen_params_to_str", sd_img_gen_params, describe::img_gen_params) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::convert::read_cstr;
    use std::mem::MaybeUninit;

    #[test]
    fn defaults_describe_like_the_reference() {
        let mut s = MaybeUninit::<sd_sample_params_t>::uninit();
        // SAFETY: init writes the whole struct.
        let s = unsafe {
            sd_sample_params_init(s.as_mut_ptr());
            s.assume_init()
        };
        let p = unsafe { sd_sample_params_to_str(&s) };
        let text = read_cstr(p);
        unsafe { libc::free(p.cast()) };
        assert_eq!(
            text,
            "(txt_cfg: 7.00, img_cfg: 7.00, distilled_guidance: 3.50, slg.layer_count: 0, slg.layer_start: 0.01, \
             slg.layer_end: 0.20, slg.scale: 0.00, scheduler: NONE, sample_method: NONE, sample_steps: 20, eta: inf, \
             shifted_timestep: 0, flow_shift: inf, extra_sample_args: , custom_sigmas_count: 0)"
        );

        let mut c = MaybeUninit::<sd_ctx_params_t>::uninit();
        let c = unsafe {
            sd_ctx_params_init(c.as_mut_ptr());
            c.assume_init()
        };
        let p = unsafe { sd_ctx_params_to_str(&c) };
        let text = read_cstr(p);
        unsafe { libc::free(p.cast()) };
        assert!(text.starts_with("model_path: \nclip_l_path: \n"), "{text}");
        assert!(text.contains("\nwtype: NONE\nrng_type: cuda\nsampler_rng_type: NONE\nprediction: NONE\n"), "{text}");
        assert!(text.contains("\nvae_format: auto\nip_adapter_path: \n"), "{text}");

        let mut g = MaybeUninit::<sd_img_gen_params_t>::uninit();
        let g = unsafe {
            sd_img_gen_params_init(g.as_mut_ptr());
            g.assume_init()
        };
        let p = unsafe { sd_img_gen_params_to_str(&g) };
        let text = read_cstr(p);
        unsafe { libc::free(p.cast()) };
        assert!(text.starts_with("prompt: \nnegative_prompt: \nclip_skip: -1\nwidth: 512\nheight: 512\nsample_params: (txt_cfg: 7.00"), "{text}");
        assert!(text.contains("\nseed: -1\nbatch_count: 1\nqwen_image_layers: 3\nref_images_count: 0\nref_image_args: \n"), "{text}");
        assert!(
            text.contains(
                "hires: {enabled=false, upscaler=Latent, model_path=, scale=2.00, target=0x0, steps=0, denoising_strength=0.70}\n\
                 cache: disabled (threshold=inf, start=0.15, end=0.95)\n"
            ),
            "{text}"
        );
        assert!(unsafe { sd_img_gen_params_to_str(std::ptr::null()) }.is_null());
    }
}
