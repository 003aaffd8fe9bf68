//! Where the time goes, per ggml op type: each runner under `perf record` (software clock
//! events, which work in VMs without hardware counters), its self time per symbol grouped
//! into op categories by the ggml kernel names.

use std::fmt::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Op categories, first match wins (symbols lower-cased). Order matters: `mul_mat` before
/// the element-wise `mul`, attention before `soft_max`'s generic vector helpers.
const CATEGORIES: &[(&str, &[&str])] = &[
    ("mul_mat (GEMM kernels, activation quantisation)", &["mul_mat", "vec_dot", "gemm", "gemv", "sgemm", "tinyblas", "quantize_row", "quantize_mat", "repack"]),
    ("conv / im2col / Winograd", &["im2col", "conv_2d", "conv_transpose", "conv2d", "winograd"]),
    ("attention / softmax", &["soft_max", "flash_attn", "softmax", "vec_max", "ggml_v_expf"]),
    ("norms (group / layer)", &["norm"]),
    (
        "element-wise (add, mul, act., copies, casts)",
        &["_add", "_mul", "_sub", "_div", "scale", "gelu", "silu", "unary", "glu", "cpy", "dup", "cont", "get_rows", "concat", "upscale", "pad", "fp16_to_fp32", "fp32_to_fp16", "bf16", "ggml_vec_", "timestep", "arange", "clamp", "sum", "repeat"],
    ),
    ("threads: barrier / spin / scheduler", &["barrier", "graph_compute_thread", "sched_yield", "futex", "pthread", "do_sched", "spin", "cpu_relax", "__schedule"]),
    ("memory: copies, page faults, allocation", &["memcpy", "memmove", "memset", "page", "fault", "alloc", "free", "mmap", "clear_user", "copy_user", "rep_movs", "rep_stos"]),
];

fn category(sym: &str) -> &'static str {
    let s = sym.to_lowercase();
    CATEGORIES.iter().find(|(_, keys)| keys.iter().any(|k| s.contains(k))).map_or("other", |(name, _)| name)
}

/// `(percent, symbol)` of `perf report`, self time, descending.
fn symbols(data: &Path) -> Result<Vec<(f64, String)>, String> {
    let out = Command::new("perf")
        .arg("report")
        .arg("-i")
        .arg(data)
        .args(["--stdio", "--no-children", "--sort", "symbol", "-q", "--percent-limit", "0"])
        .stderr(Stdio::null())
        .output()
        .map_err(|e| format!("perf report: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut v = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some((pct, rest)) = line.split_once('%') else { continue };
        let Ok(pct) = pct.trim().parse::<f64>() else { continue };
        // "[.] name" (user) or "[k] name" (kernel)
        // then perf's empty columns ("-"), which are not part of the name
        let mut words: Vec<&str> = rest.split_whitespace().skip(1).collect();
        while words.last() == Some(&"-") {
            words.pop();
        }
        let sym = words.join(" ");
        v.push((pct, sym));
    }
    Ok(v)
}

/// The `perf record` command line (program `perf`) that samples `exe args` into `data`.
pub fn record_args(data: &Path, exe: &Path, args: &[String]) -> Vec<String> {
    let mut v: Vec<String> = ["record", "-e", "cpu-clock", "-F", "499", "-o"].map(String::from).to_vec();
    v.push(data.display().to_string());
    v.push("--".into());
    v.push(exe.display().to_string());
    v.extend(args.iter().cloned());
    v
}

/// The shares of CPU time per op category (percent, in `CATEGORIES` order) and the symbols.
pub fn categorise(data: &Path) -> Result<(Vec<(&'static str, f64)>, Vec<(f64, String)>), String> {
    let syms = symbols(data)?;
    let mut cats: Vec<(&'static str, f64)> = Vec::new();
    for (pct, sym) in &syms {
        let c = category(sym);
        match cats.iter_mut().find(|(n, _)| *n == c) {
            Some(e) => e.1 += pct,
            None => cats.push((c, *pct)),
        }
    }
    let order = |name: &str| CATEGORIES.iter().position(|(n, _)| *n == name).unwrap_or(CATEGORIES.len());
    cats.sort_by_key(|(n, _)| order(n));
    Ok((cats, syms))
}

/// The category table of several sides, with each side's total CPU seconds so that shares
/// can be read as seconds too.
pub fn render(title: &str, sides: &[(String, Vec<(&'static str, f64)>, f64)]) -> String {
    let mut out = format!("#### {title}\n\n| op category |");
    for (s, _, secs) in sides {
        write!(out, " {s}: % of CPU time | {s}: CPU s ({secs:.1} s in all) |").unwrap();
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|---:|".repeat(sides.len()));
    out.push('\n');
    let names = CATEGORIES.iter().map(|(n, _)| *n).chain(["other"]);
    for name in names {
        write!(out, "| {name} |").unwrap();
        for (_, cats, secs) in sides {
            let pct = cats.iter().find(|(n, _)| *n == name).map_or(0.0, |c| c.1);
            write!(out, " {pct:.1} % | {:.1} |", pct / 100.0 * secs).unwrap();
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_of_ggml_kernels() {
        assert_eq!(category("ggml_compute_forward_mul_mat"), CATEGORIES[0].0);
        assert_eq!(category("ggml_vec_dot_f16"), CATEGORIES[0].0);
        assert_eq!(category("ggml_compute_forward_im2col_f16"), CATEGORIES[1].0);
        assert_eq!(category("ggml_compute_forward_soft_max_f32"), CATEGORIES[2].0);
        assert_eq!(category("ggml_compute_forward_group_norm"), CATEGORIES[3].0);
        assert_eq!(category("ggml_compute_forward_mul"), CATEGORIES[4].0);
        assert_eq!(category("ggml_barrier"), CATEGORIES[5].0);
        assert_eq!(category("__memmove_avx_unaligned_erms"), CATEGORIES[6].0);
        assert_eq!(category("main"), "other");
    }
}
