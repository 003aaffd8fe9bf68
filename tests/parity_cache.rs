//! Golden parity of the step caches on a UNet (`golden/sd1-cache/`): UCache with its
//! defaults, a threshold of 0.5 and an absolute threshold without reset, Spectrum, and
//! DBCache (DiT-only: refused, the run is uncached) against the uncached run; and of the DiT
//! caches (`golden/dit-caches/`: DBCache, TaylorSeer and cache-dit on Z-Image and Flux).
//! Besides the pictures, the number of skipped steps the reference logged is checked from
//! our log.

mod common;

use common::parity::{report, run};
use stable_diffusion::capi::{sd_log_level_t, sd_set_log_callback};
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

/// The tests of this file share the log capture: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn capture(_level: sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: the library passes a NUL-terminated string valid during the call.
    let line = unsafe { CStr::from_ptr(text) }.to_string_lossy().trim_end().to_string();
    // Lines read `file.rs:LINE - message`.
    let line = line.split_once(" - ").map_or(line.clone(), |(_, m)| m.to_string());
    LOG.lock().unwrap_or_else(|e| e.into_inner()).push(line);
}

/// The log lines of each generation, in order: split where a generation starts.
fn per_generation(lines: &[String]) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = Vec::new();
    for l in lines {
        if l.starts_with("generate_image ") && !l.starts_with("generate_image completed") {
            out.push(Vec::new());
        }
        if let Some(cur) = out.last_mut() {
            cur.push(l.clone());
        }
    }
    out
}

/// Runs the cases of `folder` with the log captured: the results, each case's log lines, and
/// the problems found in the skipped-step counts against `expected` (what the reference
/// logged for each case: the start of its "... skipped N/M steps" line, or none).
/// Without `SD_PARITY=full` only the cases named in `quick` run (CI's time).
fn run_logged(folder: &str, expected: &[(&str, Option<&str>)], quick: &[&str]) -> (Vec<common::parity::CaseResult>, Vec<Vec<String>>, Vec<String>) {
    sd_set_log_callback(Some(capture), std::ptr::null_mut());
    let results = run(folder, |c| common::parity::full() || quick.contains(&c.name.as_str()));
    sd_set_log_callback(None, std::ptr::null_mut());
    let lines = std::mem::take(&mut *LOG.lock().unwrap_or_else(|e| e.into_inner()));
    let logs = per_generation(&lines);
    let mut problems = Vec::new();
    if logs.len() != results.len() {
        report(&results);
        panic!("{} generations logged for {} cases", logs.len(), results.len());
    }
    for (r, log) in results.iter().zip(&logs) {
        let (_, want) = expected.iter().find(|(n, _)| *n == r.name).unwrap_or_else(|| panic!("unexpected case {}", r.name));
        let skipped: Vec<&String> = log.iter().filter(|l| l.contains(" skipped ") && l.contains(" steps")).collect();
        match want {
            Some(w) => {
                if !skipped.iter().any(|l| l.starts_with(w)) {
                    problems.push(format!("{}: expected '{w}', logged {skipped:?}", r.name));
                }
            }
            None if !skipped.is_empty() => problems.push(format!("{}: expected no skipped steps, logged {skipped:?}", r.name)),
            None => {}
        }
        eprintln!("{}: {}", r.name, skipped.first().map_or("no steps skipped", |s| s.as_str()));
    }
    (results, logs, problems)
}

#[test]
fn sd1_cache_all_cases() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // What the reference logged for each case (tests/fixtures/README.md).
    let expected: &[(&str, Option<&str>)] = &[
        ("nocache_10_steps", None),
        ("ucache_default", Some("UCache skipped 5/10 steps")),
        ("ucache_thr_0_5", Some("UCache skipped 4/10 steps")),
        ("ucache_abs_noreset_thr_0_2", Some("UCache skipped 1/10 steps")),
        ("spectrum_default", Some("Spectrum skipped 3/10 steps")),
        ("dbcache_on_unet_ignored", None),
    ];
    let quick = ["nocache_10_steps", "ucache_default", "dbcache_on_unet_ignored"];
    let (results, logs, mut problems) = run_logged("sd1-cache", expected, &quick);
    let log_of = |name: &str| results.iter().position(|r| r.name == name).map(|i| &logs[i]);
    if let Some(log) = log_of("dbcache_on_unet_ignored") {
        if !log.iter().any(|l| l.contains("CacheDIT requested but not supported for this model type (only DiT models)")) {
            problems.push("dbcache_on_unet_ignored: no warning that the mode is DiT-only".into());
        }
    }
    // A refused cache leaves the run exactly as uncached.
    let pixels = |name: &str| results.iter().find(|r| r.name == name).map(|r| &r.pixels);
    if pixels("nocache_10_steps") != pixels("dbcache_on_unet_ignored") {
        problems.push("dbcache_on_unet_ignored differs from nocache_10_steps".into());
    }
    // A cache that skipped steps changes the picture.
    if pixels("nocache_10_steps") == pixels("ucache_default") {
        problems.push("ucache_default is identical to the uncached picture".into());
    }
    report(&results);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// DBCache, TaylorSeer and cache-dit on DiTs: which steps the reference skipped (its log), and
/// its pictures.
#[test]
fn dit_cache_all_cases() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let expected: &[(&str, Option<&str>)] = &[
        ("zimage_nocache", None),
        ("zimage_dbcache_default", None),
        ("zimage_dbcache_thr_0_3_cfg", Some("CacheDIT skipped 4/12 steps")),
        ("zimage_taylorseer_thr_0_2", Some("CacheDIT skipped 2/12 steps")),
        ("zimage_cache_dit_fn4_bn2_dpmpp2m", Some("CacheDIT skipped 1/12 steps")),
        ("zimage_cache_dit_heun", Some("CacheDIT skipped 1/8 steps")),
        ("flux_dbcache_thr_0_6", Some("CacheDIT skipped 2/8 steps")),
    ];
    let quick = ["zimage_nocache", "zimage_taylorseer_thr_0_2", "flux_dbcache_thr_0_6"];
    let (results, logs, mut problems) = run_logged("dit-caches", expected, &quick);
    for (r, log) in results.iter().zip(&logs) {
        if r.name != "zimage_nocache" && !log.iter().any(|l| l.starts_with("CacheDIT enabled - mode: ")) {
            problems.push(format!("{}: no 'CacheDIT enabled' line", r.name));
        }
    }
    let pixels = |name: &str| results.iter().find(|r| r.name == name).map(|r| &r.pixels);
    if pixels("zimage_nocache") == pixels("zimage_taylorseer_thr_0_2") {
        problems.push("zimage_taylorseer_thr_0_2 is identical to the uncached picture".into());
    }
    report(&results);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// EasyCache on the DiTs (`golden/dit-easycache/`: Z-Image with its default and four other
/// thresholds, one with CFG and one with a narrower window; Flux and Flux.2 klein): the
/// reference's skipped-step counts (none below a threshold of about 1 on these small
/// models) and pictures.
#[test]
fn dit_easycache_all_cases() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !common::parity::full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let expected: &[(&str, Option<&str>)] = &[
        ("zimage_easycache_default", None),
        ("zimage_easycache_thr_0_5", None),
        ("zimage_easycache_thr_2", Some("EasyCache skipped 5/12 steps")),
        ("zimage_easycache_thr_0_4_cfg", None),
        ("zimage_easycache_window_thr_1", Some("EasyCache skipped 1/12 steps")),
        ("flux_easycache_thr_0_5", Some("EasyCache skipped 3/8 steps")),
        ("klein_easycache_thr_0_5", None),
        ("klein_easycache_thr_2", Some("EasyCache skipped 2/8 steps")),
    ];
    let (results, _, problems) = run_logged("dit-easycache", expected, &[]);
    report(&results);
    assert!(problems.is_empty(), "{problems:#?}");
}
