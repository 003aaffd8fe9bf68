//! Every export, called the way a careless or hostile C caller would: NULL pointers,
//! undeclared and negative enum values (through the raw newtypes), non-UTF-8 strings,
//! zero / negative / huge sizes, foreign handles. Each call must return its documented
//! failure value, log why, and never panic or abort.

use stable_diffusion::capi::*;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::MaybeUninit;
use std::ptr::{null, null_mut};
use std::sync::Mutex;

/// The log sink is process-wide: tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());
static LOG: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn capture_log(level: sd_log_level_t, text: *const c_char, data: *mut c_void) {
    assert_eq!(data as usize, 0x5eed);
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
    LOG.lock().unwrap_or_else(|e| e.into_inner()).push((level.0, text));
}

fn take_log() -> Vec<(u32, String)> {
    std::mem::take(&mut *LOG.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Runs `f` with the log captured; returns the error messages it logged.
fn errors_of(f: impl FnOnce()) -> Vec<String> {
    take_log();
    sd_set_log_callback(Some(capture_log), 0x5eed as *mut c_void);
    f();
    sd_set_log_callback(None, null_mut());
    take_log().into_iter().filter(|(l, _)| *l == 3).map(|(_, t)| t).collect()
}

fn assert_logs(what: &str, f: impl FnOnce()) {
    let errs = errors_of(f);
    assert!(!errs.is_empty(), "{what}: no error was logged");
}

const BAD_UTF8: &[u8] = b"bad \xff\xfe path\0";
fn bad_utf8() -> *const c_char {
    BAD_UTF8.as_ptr().cast()
}

fn garbage<T>() -> *mut T {
    0xdead_beef_usize as *mut T
}

fn text(p: *const c_char) -> String {
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Raw enum values nobody declared: the sentinel's neighbour, 9999, and "-1".
const BAD_RAW: [u32; 3] = [9999, u32::MAX, 0x8000_0000];

fn inited<T>(init: unsafe extern "C" fn(*mut T)) -> T {
    let mut v = MaybeUninit::<T>::uninit();
    unsafe {
        init(v.as_mut_ptr());
        v.assume_init()
    }
}

fn no_image() -> sd_image_t {
    sd_image_t { width: 0, height: 0, channel: 0, data: null_mut() }
}

#[test]
fn names_and_parsing_never_fail() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for raw in BAD_RAW {
        for name in [
            sd_type_name(sd_type_t(raw)),
            sd_rng_type_name(rng_type_t(raw)),
            sd_sample_method_name(sample_method_t(raw)),
            sd_scheduler_name(scheduler_t(raw)),
            sd_prediction_name(prediction_t(raw)),
            sd_preview_name(preview_t(raw)),
            sd_lora_apply_mode_name(lora_apply_mode_t(raw)),
            sd_hires_upscaler_name(sd_hires_upscaler_t(raw)),
        ] {
            assert_eq!(text(name), "NONE");
        }
    }
    for s in [null(), bad_utf8(), c"".as_ptr(), c"EULER".as_ptr()] {
        unsafe {
            assert_eq!(str_to_sd_type(s), sd_type_t::COUNT);
            assert_eq!(str_to_rng_type(s), rng_type_t::COUNT);
            assert_eq!(str_to_sample_method(s), sample_method_t::COUNT);
            assert_eq!(str_to_scheduler(s), scheduler_t::COUNT);
            assert_eq!(str_to_prediction(s), prediction_t::COUNT);
            assert_eq!(str_to_preview(s), preview_t::COUNT);
            assert_eq!(str_to_lora_apply_mode(s), lora_apply_mode_t::COUNT);
            assert_eq!(str_to_sd_hires_upscaler(s), sd_hires_upscaler_t::COUNT);
        }
    }
    assert_logs("str_to_sample_method(NULL)", || unsafe {
        str_to_sample_method(null());
    });
    assert_logs("str_to_scheduler(non-UTF-8)", || unsafe {
        str_to_scheduler(bad_utf8());
    });
}

#[test]
fn params_functions_survive_bad_input() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    unsafe {
        assert_logs("sd_ctx_params_init(NULL)", || sd_ctx_params_init(null_mut()));
        assert_logs("sd_sample_params_init(NULL)", || sd_sample_params_init(null_mut()));
        assert_logs("sd_img_gen_params_init(NULL)", || sd_img_gen_params_init(null_mut()));
        assert_logs("sd_vid_gen_params_init(NULL)", || sd_vid_gen_params_init(null_mut()));
        assert_logs("sd_cache_params_init(NULL)", || sd_cache_params_init(null_mut()));
        assert_logs("sd_hires_params_init(NULL)", || sd_hires_params_init(null_mut()));
        assert!(sd_ctx_params_to_str(null()).is_null());
        assert!(sd_sample_params_to_str(null()).is_null());
        assert!(sd_img_gen_params_to_str(null()).is_null());

        // Garbage enums and strings are described, not rejected.
        let mut c = inited(sd_ctx_params_init);
        c.wtype = sd_type_t(9999);
        c.rng_type = rng_type_t(u32::MAX);
        c.vae_format = sd_vae_format_t(-7);
        c.model_path = bad_utf8();
        c.flash_attn = CBool(200);
        let p = sd_ctx_params_to_str(&c);
        let t = text(p);
        libc::free(p.cast());
        assert!(t.contains("wtype: NONE\nrng_type: NONE\n"), "{t}");
        assert!(t.contains("vae_format: NONE\n") && t.contains("flash_attn: true\n"), "{t}");
        assert!(t.starts_with("model_path: bad \u{fffd}\u{fffd} path\n"), "{t}");

        let mut g = inited(sd_img_gen_params_init);
        g.sample_params.scheduler = scheduler_t(u32::MAX);
        g.sample_params.sample_method = sample_method_t(9999);
        g.hires.upscaler = sd_hires_upscaler_t(77);
        g.cache.mode = sd_cache_mode_t(12345);
        g.ref_images_count = -5;
        let p = sd_img_gen_params_to_str(&g);
        let t = text(p);
        libc::free(p.cast());
        assert!(t.contains("scheduler: NONE, sample_method: NONE"), "{t}");
        assert!(t.contains("upscaler=NONE") && t.contains("cache: NONE"), "{t}");
    }
}

#[test]
fn contexts_reject_bad_input() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    unsafe {
        assert_logs("new_sd_ctx(NULL)", || assert!(new_sd_ctx(null()).is_null()));

        let base = inited(sd_ctx_params_init);
        let errs = errors_of(|| assert!(new_sd_ctx(&base).is_null()));
        assert!(errs.iter().any(|e| e.contains("not supported yet")), "{errs:?}");

        let setters: [fn(&mut sd_ctx_params_t, u32); 6] = [
            |p, raw| p.wtype = sd_type_t(raw),
            |p, raw| p.rng_type = rng_type_t(raw),
            |p, raw| p.sampler_rng_type = rng_type_t(raw),
            |p, raw| p.prediction = prediction_t(raw),
            |p, raw| p.lora_apply_mode = lora_apply_mode_t(raw),
            // -1 is SD_VAE_FORMAT_AUTO, a declared value: use -2 instead.
            |p, raw| p.vae_format = sd_vae_format_t(if raw as i32 == -1 { -2 } else { raw as i32 }),
        ];
        let mut bad_enums = Vec::new();
        for raw in BAD_RAW {
            for set in setters {
                let mut p = base;
                set(&mut p, raw);
                bad_enums.push(p);
            }
        }
        for p in &bad_enums {
            let errs = errors_of(|| assert!(new_sd_ctx(p).is_null()));
            assert!(errs.iter().any(|e| e.contains("invalid")), "{errs:?}");
        }
        let mut p = base;
        p.diffusion_model_path = bad_utf8();
        let errs = errors_of(|| assert!(new_sd_ctx(&p).is_null()));
        assert!(errs.iter().any(|e| e.contains("diffusion_model_path is not valid UTF-8")), "{errs:?}");
        let mut p = base;
        p.embedding_count = 1 << 31;
        let errs = errors_of(|| assert!(new_sd_ctx(&p).is_null()));
        assert!(errs.iter().any(|e| e.contains("embeddings: NULL pointer")), "{errs:?}");

        free_sd_ctx(null_mut());
        assert_logs("free_sd_ctx(garbage)", || free_sd_ctx(garbage()));

        for ctx in [null_mut(), garbage::<sd_ctx_t>()] {
            assert_eq!(sd_ctx_supports_image_generation(ctx), CBool::FALSE);
            assert_eq!(sd_ctx_supports_video_generation(ctx), CBool::FALSE);
            assert_eq!(sd_ctx_load_control_net(ctx, null()), CBool::FALSE);
            assert_eq!(sd_ctx_load_control_net(ctx, bad_utf8()), CBool::FALSE);
            assert_eq!(sd_ctx_unload_control_net(ctx), CBool::FALSE);
            assert_eq!(sd_ctx_has_control_net(ctx), CBool::FALSE);
            for raw in BAD_RAW {
                sd_cancel_generation(ctx, sd_cancel_mode_t(raw));
            }
        }
        // Like the reference: without a context the defaults are model independent.
        assert_eq!(sd_get_default_sample_method(null()), sample_method_t(1));
        assert_eq!(sd_get_default_scheduler(null(), sample_method_t(9)), scheduler_t(9));
        assert_eq!(sd_get_default_scheduler(null(), sample_method_t(10)), scheduler_t(6));
        for raw in BAD_RAW {
            assert_eq!(sd_get_default_scheduler(null(), sample_method_t(raw)), scheduler_t(0));
        }
        assert_eq!(sd_get_default_sample_method(garbage()), sample_method_t::COUNT);
        assert_eq!(sd_get_default_scheduler(garbage(), sample_method_t(0)), scheduler_t::COUNT);

        // Generation: out-params are cleared, NULLs and foreign handles refused.
        let g = inited(sd_img_gen_params_init);
        let mut out: *mut sd_image_t = garbage();
        let mut n: c_int = 77;
        assert_eq!(generate_image(null_mut(), &g, &mut out, &mut n), CBool::FALSE);
        assert!(out.is_null() && n == 0);
        assert_eq!(generate_image(garbage(), null(), null_mut(), null_mut()), CBool::FALSE);
        assert_eq!(generate_image(garbage(), &g, &mut out, &mut n), CBool::FALSE);
        let v = inited(sd_vid_gen_params_init);
        let mut audio: *mut sd_audio_t = garbage();
        n = 5;
        assert_eq!(generate_video(null_mut(), &v, &mut out, &mut n, &mut audio), CBool::FALSE);
        assert!(out.is_null() && n == 0 && audio.is_null());
        assert_eq!(generate_video(garbage(), null(), null_mut(), null_mut(), null_mut()), CBool::FALSE);

        // Upscaler.
        assert!(new_upscaler_ctx(null(), CBool(2), -1, -1, null(), null()).is_null());
        assert!(new_upscaler_ctx(bad_utf8(), CBool(0), 0, 0, null(), null()).is_null());
        let errs = errors_of(|| {
            assert!(new_upscaler_ctx(c"/no/such/esrgan.pth".as_ptr(), CBool(255), i32::MIN, i32::MAX, bad_utf8(), null()).is_null())
        });
        assert!(!errs.is_empty());
        free_upscaler_ctx(null_mut());
        free_upscaler_ctx(garbage());
        let img = sd_image_t { width: u32::MAX, height: u32::MAX, channel: u32::MAX, data: garbage() };
        for up in [null_mut(), garbage::<upscaler_ctx_t>()] {
            out = garbage();
            n = 3;
            assert_eq!(upscale(up, no_image(), 0, &mut out, &mut n), CBool::FALSE);
            assert!(out.is_null() && n == 0);
            assert_eq!(upscale(up, img, u32::MAX, null_mut(), null_mut()), CBool::FALSE);
            assert_eq!(get_upscale_factor(up), 1);
        }

        // ADetailer.
        assert!(new_adetailer_ctx(null(), 0, null(), null()).is_null());
        assert!(new_adetailer_ctx(c"".as_ptr(), -4, null(), null()).is_null());
        assert!(new_adetailer_ctx(c"/no/such/detector".as_ptr(), 1, bad_utf8(), bad_utf8()).is_null());
        free_adetailer_ctx(null_mut());
        free_adetailer_ctx(garbage());
        let ad = sd_adetailer_params_t { prompt: bad_utf8(), negative_prompt: null(), extra_ad_args: null() };
        out = garbage();
        n = 9;
        assert_eq!(adetail_image(null_mut(), null_mut(), no_image(), null(), null(), &mut out, &mut n), CBool::FALSE);
        assert!(out.is_null() && n == 0);
        assert_eq!(adetail_image(garbage(), garbage(), img, &ad, &g, null_mut(), null_mut()), CBool::FALSE);

        // Conversion.
        assert_eq!(convert(null(), null(), null(), sd_type_t(9999), null(), CBool(3)), CBool::FALSE);
        let errs = errors_of(|| {
            assert_eq!(convert(c"in.safetensors".as_ptr(), null(), c"out.gguf".as_ptr(), sd_type_t(u32::MAX), null(), CBool(0)), CBool::FALSE)
        });
        assert!(errs.iter().any(|e| e.contains("invalid output_type")), "{errs:?}");
        let errs = errors_of(|| {
            let r = convert_with_components(
                null(),
                null(),
                null(),
                null(),
                null(),
                null(),
                c"out.gguf".as_ptr(),
                sd_type_t::COUNT,
                null(),
                CBool(0),
                -8,
            );
            assert_eq!(r, CBool::FALSE);
        });
        assert!(errs.iter().any(|e| e.contains("no input model path")), "{errs:?}");
        assert_eq!(
            convert_with_components(
                bad_utf8(),
                bad_utf8(),
                null(),
                null(),
                null(),
                null(),
                bad_utf8(),
                sd_type_t(8),
                bad_utf8(),
                CBool(1),
                0
            ),
            CBool::FALSE
        );
    }
}

#[test]
fn process_wide_functions_survive_bad_input() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    unsafe {
        // Callbacks: NULL, and preview modes nobody declared.
        sd_set_progress_callback(None, garbage());
        sd_set_backend_eval_callback(None, garbage());
        for raw in BAD_RAW {
            assert_logs("sd_set_preview_callback(bad mode)", || {
                sd_set_preview_callback(None, preview_t(raw), -5, CBool(200), CBool(7), null_mut())
            });
        }
        sd_set_preview_callback(None, preview_t(0), 0, CBool(0), CBool(0), null_mut());

        assert!(sd_get_num_physical_cores() >= 1);
        assert!(text(sd_get_system_info()).starts_with("System Info: \n"));
        assert!(!text(sd_version()).is_empty());
        assert!(!text(sd_commit()).is_empty());

        // Devices: query, truncate, zero-size buffers.
        let need = sd_list_devices(null_mut(), 0);
        assert!(need > 0);
        assert_eq!(sd_list_devices(null_mut(), 1000), need);
        let mut buf = [0x55 as c_char; 8];
        assert_eq!(sd_list_devices(buf.as_mut_ptr(), 0), need);
        assert_eq!(buf[0], 0x55);
        assert_eq!(sd_list_devices(buf.as_mut_ptr(), 1), need);
        assert_eq!(buf[0], 0);
        assert_eq!(sd_list_devices(buf.as_mut_ptr(), 4), need);
        assert_eq!(buf[3], 0);
        assert_eq!(text(buf.as_ptr()).len(), 3.min(need));
        let mut full = vec![0 as c_char; need + 1];
        assert_eq!(sd_list_devices(full.as_mut_ptr(), full.len()), need);
        assert!(text(full.as_ptr()).starts_with("CPU\t"));

        // Freeing: NULLs, negative counts, NULL data.
        free_sd_images(null_mut(), 5);
        free_sd_images(null_mut(), -3);
        let arr = libc::calloc(2, std::mem::size_of::<sd_image_t>()) as *mut sd_image_t;
        free_sd_images(arr, -1);
        let arr = libc::calloc(2, std::mem::size_of::<sd_image_t>()) as *mut sd_image_t;
        (*arr).data = libc::malloc(12) as *mut u8;
        free_sd_images(arr, 2);
        free_sd_audio(null_mut());
        let a = libc::calloc(1, std::mem::size_of::<sd_audio_t>()) as *mut sd_audio_t;
        free_sd_audio(a);

        // Canny: no pixels, zero channels, grey images, sizes that overflow, empty images.
        let mut px = [0u8; 12];
        let img = |w, h, c, data: *mut u8| sd_image_t { width: w, height: h, channel: c, data };
        assert_eq!(preprocess_canny(no_image(), 0.1, 0.1, 0.5, 1.0, CBool(0)), CBool::FALSE);
        assert_eq!(preprocess_canny(img(2, 2, 0, px.as_mut_ptr()), 0.1, 0.1, 0.5, 1.0, CBool(9)), CBool::FALSE);
        assert_eq!(preprocess_canny(img(2, 2, 1, px.as_mut_ptr()), 0.1, 0.1, 0.5, 1.0, CBool(9)), CBool::TRUE);
        assert_eq!(
            preprocess_canny(img(u32::MAX, u32::MAX, u32::MAX, px.as_mut_ptr()), f32::NAN, -1.0, f32::INFINITY, 0.0, CBool(0)),
            CBool::FALSE
        );
        assert_eq!(preprocess_canny(img(0, 0, 3, px.as_mut_ptr()), 0.1, 0.1, 0.5, 1.0, CBool(0)), CBool::TRUE);
        assert_eq!(preprocess_canny(img(2, 2, 3, px.as_mut_ptr()), f32::NAN, f32::NAN, f32::NAN, f32::NAN, CBool(1)), CBool::TRUE);

        // imatrix: NULL, non-UTF-8, missing files, unwritable destinations.
        assert_eq!(load_imatrix(null()), CBool::FALSE);
        assert_eq!(load_imatrix(bad_utf8()), CBool::FALSE);
        assert_eq!(load_imatrix(c"/no/such/imatrix.dat".as_ptr()), CBool::FALSE);
        assert_logs("save_imatrix(NULL)", || save_imatrix(null()));
        assert_logs("save_imatrix(unwritable)", || save_imatrix(c"/no/such/dir/imatrix.dat".as_ptr()));
        enable_imatrix_collection();
        disable_imatrix_collection();
    }
}

#[test]
fn log_callback_gets_errors_with_their_level() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    take_log();
    sd_set_log_callback(Some(capture_log), 0x5eed as *mut c_void);
    unsafe {
        assert!(new_sd_ctx(null()).is_null());
        sd_set_preview_callback(None, preview_t(9999), 1, CBool(1), CBool(1), null_mut());
    }
    sd_set_log_callback(None, null_mut());
    unsafe { new_sd_ctx(null()) }; // after removal: not captured
    let log = take_log();
    assert_eq!(log.len(), 2, "{log:?}");
    let (level, text) = &log[0];
    assert_eq!(*level, 3, "SD_LOG_ERROR");
    assert!(text.contains("new_sd_ctx: sd_ctx_params is NULL") && text.ends_with('\n'), "{text:?}");
    let (level, text) = &log[1];
    assert_eq!(*level, 3);
    assert!(text.contains("invalid preview mode: 9999"), "{text:?}");
}
