//! Enum names and parsing (`sd_*_name`, `str_to_*`) and the two exported name tables.
//!
//! Names of undeclared values (the `*_COUNT` sentinels, 9999, negative values) are "NONE";
//! unknown, NULL or non-UTF-8 names parse to the `*_COUNT` value. The reference matches
//! case-sensitively, and so do we.

use super::guard::{guard, opt_str};
use super::types::*;
use crate::types::*;
use libc::c_char;


/// Parses a C string with `parse`; failures (with a reason) give `None`.
///
/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn parse_name<T>(func: &str, s: *const c_char, parse: impl Fn(&str) -> Option<T>) -> Option<T> {
    guard(func, None, || {
        // SAFETY: forwarded contract.
        let Some(text) = (unsafe { opt_str(s, "str") })? else {
            bail!("str is NULL");
        };
        Ok(parse(&text))
    })
}

#[no_mangle]
pub extern "C" fn sd_type_name(r#type: sd_type_t) -> *const c_char {
    r#type.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_sd_type(str: *const c_char) -> sd_type_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_sd_type", str, SdType::parse) }.map_or(sd_type_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_rng_type_name(rng_type: rng_type_t) -> *const c_char {
    rng_type.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_rng_type(str: *const c_char) -> rng_type_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_rng_type", str, RngType::parse) }.map_or(rng_type_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_sample_method_name(sample_method: sample_method_t) -> *const c_char {
    sample_method.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_sample_method(str: *const c_char) -> sample_method_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_sample_method", str, SampleMethod::parse) }.map_or(sample_method_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_scheduler_name(scheduler: scheduler_t) -> *const c_char {
    scheduler.c_name()
}

/// "normal" is accepted as another name of the discrete scheduler.
///
/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_scheduler(str: *const c_char) -> scheduler_t {
    let parse = |s: &str| if s == "normal" { Some(Scheduler::Discrete) } else { Scheduler::parse(s) };
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_scheduler", str, parse) }.map_or(scheduler_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_prediction_name(prediction: prediction_t) -> *const c_char {
    prediction.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_prediction(str: *const c_char) -> prediction_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_prediction", str, Prediction::parse) }.map_or(prediction_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_preview_name(preview: preview_t) -> *const c_char {
    preview.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_preview(str: *const c_char) -> preview_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_preview", str, Preview::parse) }.map_or(preview_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_lora_apply_mode_name(mode: lora_apply_mode_t) -> *const c_char {
    mode.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_lora_apply_mode(str: *const c_char) -> lora_apply_mode_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_lora_apply_mode", str, LoraApplyMode::parse) }.map_or(lora_apply_mode_t::COUNT, Into::into)
}

#[no_mangle]
pub extern "C" fn sd_hires_upscaler_name(upscaler: sd_hires_upscaler_t) -> *const c_char {
    upscaler.c_name()
}

/// # Safety
/// `str` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn str_to_sd_hires_upscaler(str: *const c_char) -> sd_hires_upscaler_t {
    // SAFETY: forwarded contract.
    unsafe { parse_name("str_to_sd_hires_upscaler", str, HiresUpscaler::parse) }
        .map_or(sd_hires_upscaler_t::COUNT, Into::into)
}

/// Sampler names indexed by `sample_method_t` (C: `const char* sample_method_to_str[]`).
/// Mutable like the reference's array; this library never reads it.
#[no_mangle]
pub static mut sample_method_to_str: [*const c_char; 21] = [
    c"euler".as_ptr(),
    c"euler_a".as_ptr(),
    c"heun".as_ptr(),
    c"dpm2".as_ptr(),
    c"dpm++2s_a".as_ptr(),
    c"dpm++2m".as_ptr(),
    c"dpm++2mv2".as_ptr(),
    c"ipndm".as_ptr(),
    c"ipndm_v".as_ptr(),
    c"lcm".as_ptr(),
    c"ddim_trailing".as_ptr(),
    c"tcd".as_ptr(),
    c"res_multistep".as_ptr(),
    c"res_2s".as_ptr(),
    c"er_sde".as_ptr(),
    c"euler_cfg_pp".as_ptr(),
    c"euler_a_cfg_pp".as_ptr(),
    c"euler_ge".as_ptr(),
    c"dpm++2m_sde".as_ptr(),
    c"dpm++2m_sde_bt".as_ptr(),
    c"lms".as_ptr(),
];

/// Scheduler names indexed by `scheduler_t` (C: `const char* scheduler_to_str[]`).
#[no_mangle]
pub static mut scheduler_to_str: [*const c_char; 16] = [
    c"discrete".as_ptr(),
    c"karras".as_ptr(),
    c"exponential".as_ptr(),
    c"ays".as_ptr(),
    c"gits".as_ptr(),
    c"sgm_uniform".as_ptr(),
    c"simple".as_ptr(),
    c"smoothstep".as_ptr(),
    c"kl_optimal".as_ptr(),
    c"lcm".as_ptr(),
    c"bong_tangent".as_ptr(),
    c"ltx2".as_ptr(),
    c"logit_normal".as_ptr(),
    c"flux2".as_ptr(),
    c"flux".as_ptr(),
    c"beta".as_ptr(),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::convert::read_cstr;

    #[test]
    fn tables_match_the_enums() {
        // SAFETY: read-only copies of the tables in a test.
        let (methods, scheds) = unsafe { (std::ptr::addr_of!(sample_method_to_str).read(), std::ptr::addr_of!(scheduler_to_str).read()) };
        assert_eq!(methods.len(), SampleMethod::COUNT as usize);
        for (p, m) in methods.iter().zip(SampleMethod::ALL) {
            assert_eq!(read_cstr(*p), m.name());
        }
        assert_eq!(scheds.len(), Scheduler::COUNT as usize);
        for (p, s) in scheds.iter().zip(Scheduler::ALL) {
            assert_eq!(read_cstr(*p), s.name());
        }
    }

    #[test]
    fn names_and_parsing() {
        assert_eq!(read_cstr(sd_sample_method_name(sample_method_t(1))), "euler_a");
        assert_eq!(read_cstr(sd_sample_method_name(sample_method_t(9999))), "NONE");
        assert_eq!(read_cstr(sd_sample_method_name(sample_method_t(u32::MAX))), "NONE");
        assert_eq!(sd_type_name(sd_type_t(8)), sd_type_name(sd_type_t(8)));
        unsafe {
            assert_eq!(str_to_scheduler(c"normal".as_ptr()), scheduler_t(0));
            assert_eq!(str_to_scheduler(std::ptr::null()), scheduler_t::COUNT);
            assert_eq!(str_to_sd_type(c"Q8_0".as_ptr()), sd_type_t::COUNT);
        }
    }
}
