//! Our `*_init`, name, parse functions and name tables reproduce tests/abi/defaults.json
//! (what the reference writes), field by field. Fields are located with the offsets of the
//! ABI manifest, over a buffer pre-filled with 0xAB like the reference's dump.

mod common;

use serde_json::Value;
use stable_diffusion::capi::*;
use std::ffi::{c_char, CStr};

fn read<T: Copy>(base: *const u8, offset: usize) -> T {
    // SAFETY: offsets come from the manifest and lie inside the initialised buffer.
    unsafe { base.add(offset).cast::<T>().read_unaligned() }
}

fn expect_f32(actual: f32, want: &Value) -> bool {
    match want {
        Value::String(s) if s == "Infinity" => actual == f32::INFINITY,
        Value::String(s) if s == "-Infinity" => actual == f32::NEG_INFINITY,
        Value::String(s) if s == "NaN" => actual.is_nan(),
        v => v.as_f64().is_some_and(|w| actual == w as f32),
    }
}

/// Compares one struct in memory against the expected JSON object; collects mismatches.
fn check_struct(m: &Value, name: &str, base: *const u8, want: &Value, path: &str, errors: &mut Vec<String>) {
    let layout = &m["structs"][name];
    let fields = layout["fields"].as_array().unwrap_or_else(|| panic!("{name} not in the manifest"));
    let wanted = want.as_object().unwrap_or_else(|| panic!("{path}: expected an object"));
    assert_eq!(fields.len(), wanted.len(), "{path}: field count differs from defaults.json");
    for f in fields {
        let fname = f["name"].as_str().unwrap();
        let off = f["offset"].as_u64().unwrap() as usize;
        let ty = f["type"].as_str().unwrap();
        let w = &wanted[fname];
        let here = format!("{path}.{fname}");
        let ok = if m["structs"].get(ty).is_some() {
            // SAFETY: inside the buffer (manifest offsets).
            check_struct(m, ty, unsafe { base.add(off) }, w, &here, errors);
            true
        } else if ty.ends_with('*') {
            let p: usize = read(base, off);
            match w {
                Value::Null => p == 0,
                Value::String(s) => {
                    // SAFETY: a non-null string pointer written by *_init.
                    p != 0 && unsafe { CStr::from_ptr(p as *const c_char) }.to_str() == Ok(s.as_str())
                }
                _ => panic!("{here}: unexpected JSON {w}"),
            }
        } else if here.ends_with(".n_threads") {
            read::<i32>(base, off) == sd_get_num_physical_cores()
        } else {
            match ty {
                "_Bool" => w.as_bool().is_some_and(|b| read::<u8>(base, off) == b as u8),
                "int" | "int32_t" => w.as_i64() == Some(read::<i32>(base, off) as i64),
                "uint32_t" => w.as_i64() == Some(read::<u32>(base, off) as i64),
                "int64_t" => w.as_i64() == Some(read::<i64>(base, off)),
                "uint64_t" | "size_t" => w.as_u64() == Some(read::<u64>(base, off)),
                "float" => expect_f32(read::<f32>(base, off), w),
                t if t.starts_with("enum ") => {
                    let signed = m["enums"][&t[5..]]["underlying"] == "int";
                    let v = if signed { read::<i32>(base, off) as i64 } else { read::<u32>(base, off) as i64 };
                    w.as_i64() == Some(v)
                }
                other => panic!("{here}: unhandled field type {other}"),
            }
        };
        if !ok {
            errors.push(format!("{here}: want {w}"));
        }
    }
}

/// Calls `init` on a 0xAB-filled buffer of the struct's manifest size and checks it.
fn check_init(m: &Value, d: &Value, func: &str, name: &str, init: impl FnOnce(*mut u8), errors: &mut Vec<String>) {
    let size = m["structs"][name]["size"].as_u64().unwrap() as usize;
    let mut buf = vec![0xABu64; size.div_ceil(8)];
    let base = buf.as_mut_ptr().cast::<u8>();
    init(base);
    check_struct(m, name, base, &d["init"][func], func, errors);
}

#[test]
fn init_functions_write_the_reference_defaults() {
    let (m, d) = (common::manifest(), common::defaults());
    let mut errors = Vec::new();
    // SAFETY: each buffer is at least the manifest size of its struct, 8-byte aligned.
    unsafe {
        check_init(&m, &d, "sd_ctx_params_init", "sd_ctx_params_t", |p| sd_ctx_params_init(p.cast()), &mut errors);
        check_init(&m, &d, "sd_sample_params_init", "sd_sample_params_t", |p| sd_sample_params_init(p.cast()), &mut errors);
        check_init(&m, &d, "sd_img_gen_params_init", "sd_img_gen_params_t", |p| sd_img_gen_params_init(p.cast()), &mut errors);
        check_init(&m, &d, "sd_vid_gen_params_init", "sd_vid_gen_params_t", |p| sd_vid_gen_params_init(p.cast()), &mut errors);
        check_init(&m, &d, "sd_cache_params_init", "sd_cache_params_t", |p| sd_cache_params_init(p.cast()), &mut errors);
        check_init(&m, &d, "sd_hires_params_init", "sd_hires_params_t", |p| sd_hires_params_init(p.cast()), &mut errors);
    }
    let checked = d["init"].as_object().unwrap().len();
    assert_eq!(checked, 6, "defaults.json lists init functions this test does not call");
    assert!(errors.is_empty(), "{} mismatches:\n{}", errors.len(), errors.join("\n"));
}

fn c_text(p: *const c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: our name functions return static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn name_of(func: &str, raw: i64) -> String {
    let u = raw as u32;
    c_text(match func {
        "sd_type_name" => sd_type_name(sd_type_t(u)),
        "sd_rng_type_name" => sd_rng_type_name(rng_type_t(u)),
        "sd_sample_method_name" => sd_sample_method_name(sample_method_t(u)),
        "sd_scheduler_name" => sd_scheduler_name(scheduler_t(u)),
        "sd_prediction_name" => sd_prediction_name(prediction_t(u)),
        "sd_preview_name" => sd_preview_name(preview_t(u)),
        "sd_lora_apply_mode_name" => sd_lora_apply_mode_name(lora_apply_mode_t(u)),
        "sd_hires_upscaler_name" => sd_hires_upscaler_name(sd_hires_upscaler_t(u)),
        other => panic!("defaults.json names an unknown function {other}"),
    })
}

fn parse_with(func: &str, text: &std::ffi::CString) -> i64 {
    let s = text.as_ptr();
    // SAFETY: `s` is a NUL-terminated string.
    unsafe {
        match func {
            "str_to_sd_type" => str_to_sd_type(s).0 as i64,
            "str_to_rng_type" => str_to_rng_type(s).0 as i64,
            "str_to_sample_method" => str_to_sample_method(s).0 as i64,
            "str_to_scheduler" => str_to_scheduler(s).0 as i64,
            "str_to_prediction" => str_to_prediction(s).0 as i64,
            "str_to_preview" => str_to_preview(s).0 as i64,
            "str_to_lora_apply_mode" => str_to_lora_apply_mode(s).0 as i64,
            "str_to_sd_hires_upscaler" => str_to_sd_hires_upscaler(s).0 as i64,
            other => panic!("defaults.json names an unknown function {other}"),
        }
    }
}

#[test]
fn names_and_parsing_match_the_reference() {
    let (m, d) = (common::manifest(), common::defaults());
    let mut errors = Vec::new();
    for (func, cases) in d["names"].as_object().unwrap() {
        for (key, want) in cases.as_object().unwrap() {
            let raw = if key.starts_with("<out of range ") {
                key.trim_start_matches("<out of range ").trim_end_matches('>').parse::<i64>().unwrap()
            } else {
                common::enum_constant(&m, key).unwrap_or_else(|| panic!("{key} is not a manifest constant"))
            };
            let got = name_of(func, raw);
            if got != want.as_str().unwrap() {
                errors.push(format!("{func}({key}) = {got:?}, want {want}"));
            }
        }
    }
    for (func, cases) in d["parse"].as_object().unwrap() {
        for (key, want) in cases.as_object().unwrap() {
            let text = match key.as_str() {
                "<empty string>" => String::new(),
                k if k.starts_with("<unknown '") => k.trim_start_matches("<unknown '").trim_end_matches("'>").to_string(),
                k => k.to_string(),
            };
            let got = parse_with(func, &std::ffi::CString::new(text).unwrap());
            if Some(got) != want.as_i64() {
                errors.push(format!("{func}({key:?}) = {got}, want {want}"));
            }
        }
    }
    assert!(errors.is_empty(), "{} mismatches:\n{}", errors.len(), errors.join("\n"));
}

#[test]
fn name_tables_match_the_reference() {
    let d = common::defaults();
    // SAFETY: plain reads of the exported tables (nothing writes them in this test).
    let (methods, schedulers) =
        unsafe { (std::ptr::addr_of!(sample_method_to_str).read(), std::ptr::addr_of!(scheduler_to_str).read()) };
    let read = |table: &[*const c_char]| table.iter().map(|&p| c_text(p)).collect::<Vec<_>>();
    let want = |key: &str| d[key].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect::<Vec<_>>();
    assert_eq!(read(&methods), want("sample_method_to_str"));
    assert_eq!(read(&schedulers), want("scheduler_to_str"));
}
