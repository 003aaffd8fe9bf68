//! The opt-in fast path (issue 28, `fast=1` in `model_args` or `SD_FAST=1`): our fast
//! picture may be no further from our exact one than the reference's fastest build
//! (llamafile, -march=native) is from its default build on the same case. Each case of
//! `golden/fast-bound/` carries that distance (`fast_bound`, measured by
//! tests/tools/fast_bound.py); its pictures are the default build's. The sizes are large
//! enough that Winograd runs in the UNet (a convolution's output of 256 positions or more).
//! The float cases of the five DiT folders and two of `golden/wan/` carry theirs too (a
//! video's over all its frames), the transformers' products being the fast path's there.
//! Every case's largest difference is held to its bound (see `within_case_bound`); the mean
//! differences per folder (see `within_family_bound`, and tests/fixtures/README.md, "The
//! fast path's bound").
//! CI runs the SD 1.x text-to-image case; `SD_PARITY=full` every case;
//! `SD_FAST_BOUND_CASE=` a case or a folder.

mod common;

use common::parity::{diff_bytes, full, render_with, report, run, Case};
use serde_json::Value;

/// Golden folders with cases that carry a `fast_bound`.
const FOLDERS: [&str; 7] = ["fast-bound", "wan", "qwenimage", "sd3", "chroma", "zimage", "flux2"];

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

/// `SD_FAST_BOUND_CASE=name` runs that one case, `=folder` that folder's.
fn in_this_run(folder: &str, name: &str) -> bool {
    match std::env::var("SD_FAST_BOUND_CASE") {
        Ok(only) => only == name || only == folder,
        Err(_) => full() || name == "sd1_txt2img",
    }
}

/// Whether a folder's mean distance is no further than the fastest build's: `pairs` holds,
/// per case, (ours, the fastest build's) mean distance. Any reordering of a transformer's
/// sums moves these small fixtures' pictures by about the same amount, whatever the size
/// of the rounding change (tests/fixtures/README.md, "The fast path's bound"), so one
/// case's distance is a draw: the folder's mean difference may exceed zero by two standard
/// errors of the per-case differences (with one case, not at all).
fn within_family_bound(pairs: &[(f64, f64)]) -> (bool, f64, f64) {
    let n = pairs.len() as f64;
    let d: Vec<f64> = pairs.iter().map(|(o, r)| o - r).collect();
    let mean = d.iter().sum::<f64>() / n;
    let se = if pairs.len() < 2 { 0.0 } else { (d.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0) / n).sqrt() };
    (mean <= 2.0 * se + 1e-9, mean, se)
}

/// Whether a case's picture stays within the fastest build's largest difference `bound`:
/// the fastest build's largest difference is one draw too (its q8_0 cases' pictures move by
/// 1-3 in a few values), so at most one value in a thousand may pass it, and by 1 at most.
/// Returns (whether, how many values passed it).
fn within_case_bound(exact: &[u8], fast: &[u8], bound: f64) -> (bool, usize) {
    let d = exact.iter().zip(fast).map(|(&x, &y)| (x as f64 - y as f64).abs());
    let (past, max) = d.fold((0usize, 0f64), |(n, m), v| (n + (v > bound) as usize, m.max(v)));
    (max <= bound + 1.0 && past * 1000 <= exact.len(), past)
}

#[test]
fn case_bound_allows_one_value_in_a_thousand_past_it_by_one() {
    let exact = vec![10u8; 2000];
    let mut fast = exact.clone();
    fast[..500].fill(11);
    assert_eq!(within_case_bound(&exact, &fast, 1.0), (true, 0));
    fast[0] = 12;
    fast[1] = 8;
    assert_eq!(within_case_bound(&exact, &fast, 1.0), (true, 2));
    fast[2] = 12;
    assert_eq!(within_case_bound(&exact, &fast, 1.0), (false, 3));
    fast[2] = 10;
    fast[3] = 13;
    assert!(!within_case_bound(&exact, &fast, 1.0).0);
}

#[test]
fn family_bound_allows_two_standard_errors() {
    assert!(within_family_bound(&[(0.04, 0.04)]).0);
    assert!(!within_family_bound(&[(0.0401, 0.04)]).0);
    // Differences +0.003 and -0.001: mean 0.001, standard error 0.002.
    assert!(within_family_bound(&[(0.043, 0.04), (0.039, 0.04)]).0);
    assert!(!within_family_bound(&[(0.05, 0.04), (0.051, 0.04)]).0);
}

#[test]
fn fast_path_stays_within_the_reference_builds_distance() {
    let mut moved = false;
    let mut failures = Vec::new();
    let mut families: Vec<(&str, Vec<(f64, f64)>)> = Vec::new();
    for (folder, name, bound_max, bound_mean) in bounds().into_iter().filter(|b| in_this_run(b.0, &b.1)) {
        let select = |c: &Case| c.name == name;
        // `fast=0` wins over an SD_FAST in the environment. A video's frames count as one
        // picture.
        let exact = render_with(folder, select, |p, arena| p.model_args = arena.str("fast=0")).concat();
        let fast = render_with(folder, select, |p, arena| p.model_args = arena.str("fast=1")).concat();
        let (max, mean) = diff_bytes(&exact, &fast);
        eprintln!("{folder}/{name}: fast vs exact max {max} mean {mean:.4} (the reference's fastest vs default build: max {bound_max} mean {bound_mean})");
        let (ok, past) = within_case_bound(&exact, &fast, bound_max);
        if !ok {
            failures.push(format!("{folder}/{name}: the fast path moved {past} of {} values by more than the reference's fastest build moves any ({bound_max}; at most one in a thousand may pass it, by 1), the largest by {max}", exact.len()));
        }
        match families.iter_mut().find(|f| f.0 == folder) {
            Some(f) => f.1.push((mean, bound_mean)),
            None => families.push((folder, vec![(mean, bound_mean)])),
        }
        // The UNet cases' Winograd runs on every CPU; the fast products only
        // where fast kernels exist (not on AVX-512 CPUs without AMX).
        moved |= max > 0.0 || folder != "fast-bound";
    }
    for (folder, pairs) in &families {
        let (ok, diff, se) = within_family_bound(pairs);
        let (ours, theirs) = pairs.iter().fold((0.0, 0.0), |(a, b), (o, r)| (a + o, b + r));
        let n = pairs.len() as f64;
        eprintln!("{folder}: {} cases, mean distance fast vs exact {:.4}, the fastest build's {:.4} (difference {diff:+.4}, standard error {se:.4})", pairs.len(), ours / n, theirs / n);
        if !ok {
            failures.push(format!("{folder}: over {} cases the fast path moved the pictures by mean {:.4}, the reference's fastest build by {:.4}: {diff:+.4} more, past two standard errors ({se:.4})", pairs.len(), ours / n, theirs / n));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(moved, "the fast path changed no picture: its convolutions did not run");
}

/// The folder's pictures are the reference's default build's: our exact path within the
/// golden tolerance, like every golden folder.
#[test]
fn fast_bound_cases_match_the_reference() {
    report(&run("fast-bound", |c| in_this_run("fast-bound", &c.name)));
}
