//! The opt-in fast path (issue 28, `fast=1` in `model_args` or `SD_FAST=1`): our fast
//! picture may be no further from our exact one than the reference's fastest build
//! (llamafile, -march=native) is from its default build on the same case. Each case of
//! `golden/fast-bound/` carries that distance (`fast_bound`, measured by
//! tests/tools/fast_bound.py); its pictures are the default build's. The sizes are large
//! enough that Winograd runs in the UNet (a convolution's output of 256 positions or more).
//! One case of the Qwen-Image, SD3 and Chroma folders and two of `golden/wan/` carry theirs
//! too (a video's over all its frames; tests/fixtures/README.md, "The fast path's bound"),
//! the transformers' products being the fast path's there.
//! CI runs the SD 1.x text-to-image case; `SD_PARITY=full` every case.

mod common;

use common::parity::{diff_bytes, full, render_with, report, run, Case};
use serde_json::Value;

/// Golden folders with cases that carry a `fast_bound`.
/// (`golden/zimage/` and `golden/flux2/` carry a measured bound too, which the fast products
/// exceed: tests/fixtures/README.md.)
const FOLDERS: [&str; 5] = ["fast-bound", "wan", "qwenimage", "sd3", "chroma"];

/// (folder, case name, max, mean) of every case's `fast_bound` (every case of `fast-bound`
/// must have one).
fn bounds() -> Vec<(&'static str, String, f64, f64)> {
    let mut out = Vec::new();
    for folder in FOLDERS {
        let path = common::root().join("tests/fixtures/golden").join(folder).join("cases.json");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("cases.json")).expect("JSON");
        for c in v["cases"].as_array().expect("cases") {
            let b = &c["fast_bound"];
            let name = c["name"].as_str().expect("name").to_string();
            if b.is_null() && folder != "fast-bound" {
                continue;
            }
            let (max, mean) = (b["max"].as_f64(), b["mean"].as_f64());
            out.push((folder, name.clone(), max.unwrap_or_else(|| panic!("{name}: no fast_bound.max")), mean.expect("fast_bound.mean")));
        }
    }
    out
}

/// `SD_FAST_BOUND_CASE=name` runs that one case.
fn in_this_run(name: &str) -> bool {
    match std::env::var("SD_FAST_BOUND_CASE") {
        Ok(only) => only == name,
        Err(_) => full() || name == "sd1_txt2img",
    }
}

#[test]
fn fast_path_stays_within_the_reference_builds_distance() {
    let mut moved = false;
    for (folder, name, bound_max, bound_mean) in bounds().into_iter().filter(|b| in_this_run(&b.1)) {
        let select = |c: &Case| c.name == name;
        // `fast=0` wins over an SD_FAST in the environment. A video's frames count as one
        // picture.
        let exact = render_with(folder, select, |p, arena| p.model_args = arena.str("fast=0")).concat();
        let fast = render_with(folder, select, |p, arena| p.model_args = arena.str("fast=1")).concat();
        let (max, mean) = diff_bytes(&exact, &fast);
        eprintln!("{folder}/{name}: fast vs exact max {max} mean {mean:.4} (the reference's fastest vs default build: max {bound_max} mean {bound_mean})");
        assert!(max <= bound_max && mean <= bound_mean, "{folder}/{name}: the fast path moved the picture by max {max} mean {mean:.4}, more than the reference's fastest build moves it (max {bound_max} mean {bound_mean})");
        // The UNet cases' Winograd runs on every CPU; the transformers' fast products only
        // where fast kernels exist (not on AVX-512 CPUs without AMX).
        moved |= max > 0.0 || folder != "fast-bound";
    }
    assert!(moved, "the fast path changed no picture: its convolutions did not run");
}

/// The folder's pictures are the reference's default build's: our exact path within the
/// golden tolerance, like every golden folder.
#[test]
fn fast_bound_cases_match_the_reference() {
    report(&run("fast-bound", |c| in_this_run(&c.name)));
}
