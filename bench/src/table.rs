//! Aggregates the runs into medians, ranges and ratios, as Markdown tables.

use sd_bench_common::median;
use serde_json::Value;
use std::fmt::Write;

/// One row of a table: a label, the report field, and how to show it.
pub struct Metric {
    pub label: &'static str,
    pub field: &'static str,
    pub unit: Unit,
}

#[derive(Clone, Copy)]
pub enum Unit {
    Seconds,
    /// The field is in kB; shown in MiB.
    KiB,
}

/// The rows of a generation workload.
pub const GEN_METRICS: &[Metric] = &[
    Metric { label: "model load: `new_sd_ctx` (mmap as in the title)", field: "load_s", unit: Unit::Seconds },
    Metric { label: "lazy weight loading inside `generate_image`", field: "lazy_load_s", unit: Unit::Seconds },
    Metric { label: "model load, both together", field: "load_total_s", unit: Unit::Seconds },
    Metric { label: "text encoding (cond + uncond)", field: "cond_s", unit: Unit::Seconds },
    Metric { label: "UNet: one sampling step (median of steps 2…n)", field: "step_median_s", unit: Unit::Seconds },
    Metric { label: "sampling, all steps", field: "sampling_s", unit: Unit::Seconds },
    Metric { label: "VAE decode", field: "decode_s", unit: Unit::Seconds },
    Metric { label: "`generate_image`", field: "generate_s", unit: Unit::Seconds },
    Metric { label: "total wall (process, as run)", field: "wall_s", unit: Unit::Seconds },
    Metric { label: "total wall, extrapolated to the nominal steps", field: "wall_nominal_s", unit: Unit::Seconds },
    Metric { label: "CPU time (user + sys)", field: "cpu_s", unit: Unit::Seconds },
    Metric { label: "peak RSS", field: "maxrss_kb", unit: Unit::KiB },
];

/// The rows of a video workload (`generate_video`): a step is one sampling step of the video
/// transformer (one evaluation at CFG 1); the decode's memory is measured from the end of
/// sampling to the end of the decode (`sd_bench_common`), the audio decode included.
pub const VIDEO_METRICS: &[Metric] = &[
    Metric { label: "model load: `new_sd_ctx` (mmap as in the title)", field: "load_s", unit: Unit::Seconds },
    Metric { label: "lazy weight loading inside `generate_video`", field: "lazy_load_s", unit: Unit::Seconds },
    Metric { label: "text encoding", field: "cond_s", unit: Unit::Seconds },
    Metric { label: "transformer: one sampling step (median of steps 2…n)", field: "step_median_s", unit: Unit::Seconds },
    Metric { label: "transformer: CPU seconds of one step (steps 2…n)", field: "step_cpu_median_s", unit: Unit::Seconds },
    Metric { label: "sampling, all steps", field: "sampling_s", unit: Unit::Seconds },
    Metric { label: "VAE decode", field: "decode_s", unit: Unit::Seconds },
    Metric { label: "audio decode (audio VAE and vocoder; LTX-2.3 with `audio_vae_path`)", field: "audio_decode_s", unit: Unit::Seconds },
    Metric { label: "VAE decode: CPU seconds (with the audio decode, if any)", field: "decode_cpu_s", unit: Unit::Seconds },
    Metric { label: "`generate_video`", field: "generate_s", unit: Unit::Seconds },
    Metric { label: "total wall (process, as run)", field: "wall_s", unit: Unit::Seconds },
    Metric { label: "CPU time (user + sys)", field: "cpu_s", unit: Unit::Seconds },
    Metric { label: "peak RSS", field: "maxrss_kb", unit: Unit::KiB },
    Metric { label: "RSS at the decode's start", field: "decode_rss_start_kb", unit: Unit::KiB },
    Metric { label: "peak RSS during the VAE decode", field: "decode_peak_rss_kb", unit: Unit::KiB },
    Metric { label: "VAE decode: peak RSS above its start", field: "decode_rss_growth_kb", unit: Unit::KiB },
];

/// The rows of a load workload (load, then a 64×64 single-step generation that makes the
/// reference's lazily loaded weights resident too).
pub const LOAD_METRICS: &[Metric] = &[
    Metric { label: "`new_sd_ctx`", field: "load_s", unit: Unit::Seconds },
    Metric { label: "lazy weight loading inside `generate_image`", field: "lazy_load_s", unit: Unit::Seconds },
    Metric { label: "model load, both together", field: "load_total_s", unit: Unit::Seconds },
    Metric { label: "64×64 1-step `generate_image` (incl. lazy loading, page faults)", field: "generate_s", unit: Unit::Seconds },
    Metric { label: "total wall (process)", field: "wall_s", unit: Unit::Seconds },
    Metric { label: "peak RSS", field: "maxrss_kb", unit: Unit::KiB },
];

/// The rows of an ESRGAN upscale workload (the reference may load weights lazily inside
/// `upscale`; "upscale compute" leaves that out).
pub const UPSCALE_METRICS: &[Metric] = &[
    Metric { label: "model load: `new_upscaler_ctx`", field: "load_s", unit: Unit::Seconds },
    Metric { label: "lazy weight loading inside `upscale`", field: "lazy_load_s", unit: Unit::Seconds },
    Metric { label: "`upscale`", field: "generate_s", unit: Unit::Seconds },
    Metric { label: "upscale compute (without lazy loading)", field: "upscale_s", unit: Unit::Seconds },
    Metric { label: "total wall (process)", field: "wall_s", unit: Unit::Seconds },
    Metric { label: "CPU time (user + sys)", field: "cpu_s", unit: Unit::Seconds },
    Metric { label: "peak RSS", field: "maxrss_kb", unit: Unit::KiB },
];

fn show(v: f64, unit: Unit) -> String {
    match unit {
        Unit::Seconds if v < 1.0 => format!("{v:.3} s"),
        Unit::Seconds => format!("{v:.2} s"),
        Unit::KiB => format!("{:.0} MiB", v / 1024.0),
    }
}

/// `median (min–max)` of the successful runs, and the median alone.
fn cell(runs: &[&Value], m: &Metric) -> (String, Option<f64>) {
    let vals: Vec<f64> = runs.iter().filter_map(|r| r[m.field].as_f64()).filter(|v| v.is_finite()).collect();
    let Some(med) = median(&vals) else {
        return ("–".into(), None);
    };
    let (lo, hi) = vals.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    if vals.len() == 1 {
        return (show(med, m.unit), Some(med));
    }
    let range = match m.unit {
        Unit::Seconds if hi < 1.0 => format!("{lo:.3}–{hi:.3}"),
        Unit::Seconds => format!("{lo:.2}–{hi:.2}"),
        Unit::KiB => format!("{:.0}–{:.0}", lo / 1024.0, hi / 1024.0),
    };
    (format!("{} ({range})", show(med, m.unit)), Some(med))
}

/// A Markdown table: one row per metric, for each side its cell, for each side after the
/// first its ratio to the first (the reference).
pub fn render(title: &str, sides: &[String], runs_of: &dyn Fn(&str) -> Vec<Value>, metrics: &[Metric]) -> String {
    let runs: Vec<Vec<Value>> = sides.iter().map(|s| runs_of(s)).collect();
    let mut out = format!("#### {title}\n\n| metric |");
    for (i, s) in sides.iter().enumerate() {
        write!(out, " {s} |").unwrap();
        if i > 0 {
            write!(out, " {s} / {} |", sides[0]).unwrap();
        }
    }
    out.push_str("\n|---|");
    for i in 0..sides.len() {
        out.push_str(if i > 0 { "---:|---:|" } else { "---:|" });
    }
    out.push('\n');
    for m in metrics {
        write!(out, "| {} |", m.label).unwrap();
        let mut first = None;
        for (i, side_runs) in runs.iter().enumerate() {
            let ok: Vec<&Value> = side_runs.iter().filter(|r| r["error"].is_null()).collect();
            let (text, med) = cell(&ok, m);
            write!(out, " {text} |").unwrap();
            if i == 0 {
                first = med;
            } else {
                match (med, first) {
                    (Some(a), Some(b)) if b > 0.0 => write!(out, " {:.2}× |", a / b).unwrap(),
                    _ => out.push_str(" – |"),
                }
            }
        }
        out.push('\n');
    }
    // Failures are part of the result.
    for (side, side_runs) in sides.iter().zip(&runs) {
        let failed: Vec<&Value> = side_runs.iter().filter(|r| !r["error"].is_null()).collect();
        if let Some(f) = failed.first() {
            writeln!(out, "\n{side}: {} of {} runs failed: {}", failed.len(), side_runs.len(), f["error"]).unwrap();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table_has_medians_ranges_ratios_and_failures() {
        let sides = vec!["reference".to_string(), "ours".to_string()];
        let runs_of = |side: &str| -> Vec<Value> {
            if side == "reference" {
                vec![json!({"load_s": 2.0, "maxrss_kb": 2048, "error": null}), json!({"load_s": 4.0, "maxrss_kb": 4096, "error": null})]
            } else {
                vec![json!({"load_s": 1.5, "maxrss_kb": 1024, "error": null}), json!({"error": "not supported"})]
            }
        };
        let t = render("load", &sides, &runs_of, LOAD_METRICS);
        assert!(t.contains("| `new_sd_ctx` | 3.00 s (2.00–4.00) | 1.50 s | 0.50× |"), "{t}");
        assert!(t.contains("| peak RSS | 3 MiB (2–4) | 1 MiB | 0.33× |"), "{t}");
        assert!(t.contains("| total wall (process) | – | – | – |"), "{t}");
        assert!(t.contains("ours: 1 of 2 runs failed: \"not supported\""), "{t}");
    }
}
