//! sd-bench: the same generation on the reference stable-diffusion.cpp and on
//! libstable-diffusion, each in its own process, alternating reference/ours/... for every
//! repetition, then medians, ranges and ratios. See BENCHMARKS.md.
//!
//! ```sh
//! cargo run --release --manifest-path bench/Cargo.toml -- --quick   # minutes
//! cargo run --release --manifest-path bench/Cargo.toml              # the full matrix
//! ```

mod child;
mod profile;
mod table;

use sd_bench_common::Job;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

const USAGE: &str = "\
usage: sd-bench [--quick] [options]

  --quick              256x256, f16, 4 steps, 1 repetition, sides reference,ours
  --reps N             repetitions of every workload and side (default 3)
  --sizes LIST         square sizes, comma-separated (default 256,512)
  --wtypes LIST        weight types at load (default f16,q8_0)
  --steps N            sampling steps (default 20)
  --threads N          threads (default 2)
  --sides LIST         runners, first is the baseline of the ratios
                       (default reference,ours,ours-native)
  --model PATH         checkpoint (default $SD_FIXTURE_CACHE/sd1.safetensors,
                       SD_FIXTURE_CACHE defaulting to ~/.cache/sd-rs-fixtures)
  --no-load            skip the load-only workloads (mmap on / off)
  --no-gen             skip the generation workloads
  --no-build           use the runners already built
  --timeout SECS       per run (default 3600)
  --out DIR            reports, logs and images (default bench/target/sd-bench)
  --verbose            runners echo the libraries' logs into their log files
  --profile            instead of timing: each side once under `perf record`, CPU time
                       per op category (defaults as --quick: first size and weight type)
";

struct Options {
    reps: usize,
    sizes: Vec<i32>,
    wtypes: Vec<String>,
    steps: i32,
    threads: i32,
    sides: Vec<String>,
    model: PathBuf,
    load: bool,
    gen: bool,
    build: bool,
    timeout: Duration,
    out: PathBuf,
    verbose: bool,
    quick: bool,
    profile: bool,
}

fn default_model() -> PathBuf {
    let cache = std::env::var_os("SD_FIXTURE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures"));
    cache.join("sd1.safetensors")
}

fn list(v: &str) -> Vec<String> {
    v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        reps: 3,
        sizes: vec![256, 512],
        wtypes: list("f16,q8_0"),
        steps: 20,
        threads: 2,
        sides: list("reference,ours,ours-native"),
        model: default_model(),
        load: true,
        gen: true,
        build: true,
        timeout: Duration::from_secs(3600),
        out: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/sd-bench"),
        verbose: false,
        quick: false,
        profile: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    o.profile = args.iter().any(|a| a == "--profile");
    if o.profile || args.iter().any(|a| a == "--quick") {
        o.quick = true;
        o.reps = 1;
        o.sizes = vec![256];
        o.wtypes = list("f16");
        o.steps = 4;
        o.sides = list("reference,ours");
    }
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|_| format!("not a number: {v:?}"));
        match flag.as_str() {
            "--quick" | "--profile" => {}
            "--reps" => o.reps = num(value()?)?.max(1) as usize,
            "--sizes" => o.sizes = list(&value()?).into_iter().map(|s| num(s).map(|n| n as i32)).collect::<Result<_, _>>()?,
            "--wtypes" => o.wtypes = list(&value()?),
            "--steps" => o.steps = num(value()?)? as i32,
            "--threads" => o.threads = num(value()?)? as i32,
            "--sides" => o.sides = list(&value()?),
            "--model" => o.model = PathBuf::from(value()?),
            "--no-load" => o.load = false,
            "--no-gen" => o.gen = false,
            "--no-build" => o.build = false,
            "--timeout" => o.timeout = Duration::from_secs(num(value()?)?),
            "--out" => o.out = PathBuf::from(value()?),
            "--verbose" => o.verbose = true,
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown option {flag:?}")),
        }
    }
    for s in &o.sides {
        if !["reference", "ours", "ours-native"].contains(&s.as_str()) {
            return Err(format!("unknown side {s:?} (reference, ours, ours-native)"));
        }
    }
    Ok(o)
}

/// Where the runner binaries are: next to this program (cargo's target/<profile>), the
/// `native` build of ours in its own target folder so that neither build evicts the other.
fn runner_path(side: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new(".")).to_path_buf();
    match side {
        "reference" => dir.join("sd-bench-ref"),
        "ours" => dir.join("sd-bench-ours"),
        _ => {
            let profile = dir.file_name().map(PathBuf::from).unwrap_or_else(|| "release".into());
            dir.parent().unwrap_or(Path::new(".")).join("native").join(profile).join("sd-bench-ours")
        }
    }
}

/// Builds the runners the sides need with cargo (release).
fn build_runners(sides: &[String]) -> Result<(), String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut builds: Vec<Vec<String>> = Vec::new();
    let mut plain: Vec<String> = Vec::new();
    for side in sides {
        match side.as_str() {
            "reference" => plain.extend(["-p".into(), "sd-bench-ref".into()]),
            "ours" => plain.extend(["-p".into(), "sd-bench-ours".into()]),
            _ => {
                let target = runner_path("ours-native");
                let target_dir = target.parent().and_then(Path::parent).unwrap_or(Path::new("."));
                builds.push(vec![
                    "-p".into(),
                    "sd-bench-ours".into(),
                    "--features".into(),
                    "native".into(),
                    "--target-dir".into(),
                    target_dir.display().to_string(),
                ]);
            }
        }
    }
    if !plain.is_empty() {
        builds.insert(0, plain);
    }
    for extra in builds {
        eprintln!("sd-bench: building runners: cargo build --release {}", extra.join(" "));
        let status = Command::new(&cargo)
            .args(["build", "--release", "--manifest-path"])
            .arg(&manifest)
            .args(&extra)
            .status()
            .map_err(|e| format!("running cargo: {e}"))?;
        if !status.success() {
            return Err(format!("cargo build --release {} failed", extra.join(" ")));
        }
    }
    Ok(())
}

/// One row group of the result: a job and what it measures.
struct Workload {
    name: String,
    title: String,
    job: Job,
    metrics: &'static [table::Metric],
}

fn workloads(o: &Options) -> Vec<Workload> {
    let base = Job {
        model: o.model.display().to_string(),
        steps: o.steps,
        threads: o.threads,
        verbose: o.verbose,
        ..Job::default()
    };
    let mut w = Vec::new();
    for wtype in &o.wtypes {
        if o.load {
            for mmap in [true, false] {
                let onoff = if mmap { "on" } else { "off" };
                w.push(Workload {
                    name: format!("load-{wtype}-mmap-{onoff}"),
                    title: format!("Model load only, {wtype} weights, mmap {onoff}"),
                    job: Job { wtype: wtype.clone(), mmap, load_only: true, ..base.clone() },
                    metrics: table::LOAD_METRICS,
                });
            }
        }
        if o.gen {
            for &size in &o.sizes {
                w.push(Workload {
                    name: format!("gen-{size}-{wtype}"),
                    title: format!(
                        "{size}×{size}, {wtype} weights, {} steps {}, CFG {}, {} threads",
                        base.steps, base.sampler, base.cfg, base.threads
                    ),
                    job: Job { wtype: wtype.clone(), width: size, height: size, ..base.clone() },
                    metrics: table::GEN_METRICS,
                });
            }
        }
    }
    w
}

/// Reads the checkpoint once so that every run starts with it in the page cache.
fn warm_page_cache(path: &Path) -> Result<(), String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf).map_err(|e| format!("{}: {e}", path.display()))? > 0 {}
    Ok(())
}

/// A binary PPM as written by the runners: (width, height, RGB bytes).
fn read_ppm(path: &Path) -> Option<(usize, usize, Vec<u8>)> {
    let bytes = std::fs::read(path).ok()?;
    let mut fields = Vec::new();
    let mut pos = 0;
    while fields.len() < 4 {
        while bytes.get(pos)?.is_ascii_whitespace() {
            pos += 1;
        }
        let start = pos;
        while !bytes.get(pos)?.is_ascii_whitespace() {
            pos += 1;
        }
        fields.push(String::from_utf8_lossy(&bytes[start..pos]).to_string());
    }
    let (w, h) = (fields[1].parse().ok()?, fields[2].parse().ok()?);
    let data = bytes.get(pos + 1..)?.to_vec();
    (fields[0] == "P6" && data.len() == w * h * 3).then_some((w, h, data))
}

/// Mean absolute difference (0–255) between the first-run images of two sides.
fn image_diff(a: &Path, b: &Path) -> Option<f64> {
    let (wa, ha, da) = read_ppm(a)?;
    let (wb, hb, db) = read_ppm(b)?;
    if (wa, ha) != (wb, hb) {
        return None;
    }
    Some(da.iter().zip(&db).map(|(&x, &y)| (x as f64 - y as f64).abs()).sum::<f64>() / da.len() as f64)
}

fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown")
        .trim()
        .to_string();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mem_kb: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next()?.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    let commit = Command::new("git")
        .args(["rev-parse", "--short=8", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    json!({"cpu": cpu, "cpus": cores, "mem_gib": mem_kb as f64 / 1048576.0, "commit": commit})
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("sd-bench: {e}\n");
            }
            eprint!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if o.build {
        if let Err(e) = build_runners(&o.sides) {
            eprintln!("sd-bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Err(e) = warm_page_cache(&o.model).and_then(|_| std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())) {
        eprintln!("sd-bench: {e}");
        return ExitCode::FAILURE;
    }

    if o.profile {
        return run_profile(&o);
    }
    let machine = machine();
    let load_start = child::loadavg();
    let work = workloads(&o);
    let mut runs: Vec<(usize, String, Value)> = Vec::new();
    let total = work.len() * o.reps * o.sides.len();
    let mut n = 0;
    for (wi, w) in work.iter().enumerate() {
        for rep in 0..o.reps {
            for side in &o.sides {
                n += 1;
                let stem = o.out.join(format!("{}-{side}-{rep}", w.name));
                let mut job = w.job.clone();
                if rep == 0 && !job.load_only {
                    job.out = Some(o.out.join(format!("{}-{side}.ppm", w.name)).display().to_string());
                }
                eprint!("sd-bench: [{n}/{total}] {} {side} #{} (load {:.2}) ... ", w.name, rep + 1, child::loadavg());
                let r = child::run(
                    &runner_path(side),
                    &job.to_args(),
                    &stem.with_extension("json"),
                    &stem.with_extension("log"),
                    o.timeout,
                );
                match r["error"].as_str() {
                    Some(e) => eprintln!("failed: {e}"),
                    None => eprintln!("{:.1}s", r["wall_s"].as_f64().unwrap_or(f64::NAN)),
                }
                runs.push((wi, side.clone(), r));
            }
        }
    }
    let load_end = child::loadavg();

    let info = runs.iter().find(|(_, s, r)| s == "reference" && r["error"].is_null()).map(|(_, _, r)| r);
    let mut md = format!(
        "### sd-bench results\n\nMachine: {} ({} CPUs, {:.0} GiB), commit {}; load average (1 min) {load_start:.2} at start, {load_end:.2} at end.\n",
        machine["cpu"].as_str().unwrap_or(""),
        machine["cpus"],
        machine["mem_gib"].as_f64().unwrap_or(0.0),
        machine["commit"].as_str().unwrap_or(""),
    );
    if let Some(r) = info {
        md += &format!("Reference: stable-diffusion.cpp {} (diffusion-rs-sys 0.1.20).\n", r["version"].as_str().unwrap_or(""));
    }
    md += &format!(
        "{} repetition(s), sides run in the order {} for every repetition; median (min–max).\n\n",
        o.reps,
        o.sides.join(", ")
    );
    for (wi, w) in work.iter().enumerate() {
        let runs_of = |side: &str| runs.iter().filter(|(i, s, _)| *i == wi && s == side).map(|(_, _, r)| r.clone()).collect();
        md += &table::render(&w.title, &o.sides, &runs_of, w.metrics);
        if !w.job.load_only {
            let img = |side: &str| o.out.join(format!("{}-{side}.ppm", w.name));
            for side in o.sides.iter().skip(1) {
                if let Some(d) = image_diff(&img(&o.sides[0]), &img(side)) {
                    md += &format!("\nImage {side} vs {}: mean |difference| {d:.2} / 255.\n", o.sides[0]);
                }
            }
        }
        md.push('\n');
    }
    println!("{md}");

    let all = json!({
        "machine": machine,
        "load_start": load_start,
        "load_end": load_end,
        "quick": o.quick,
        "runs": runs.iter().map(|(wi, side, r)| json!({"workload": work[*wi].name, "side": side, "report": r})).collect::<Vec<_>>(),
    });
    let results = o.out.join("results.json");
    let md_path = o.out.join("results.md");
    if let Err(e) = std::fs::write(&results, serde_json::to_string_pretty(&all).unwrap_or_default()).and_then(|_| std::fs::write(&md_path, &md)) {
        eprintln!("sd-bench: writing {}: {e}", results.display());
        return ExitCode::FAILURE;
    }
    eprintln!("sd-bench: reports in {}", o.out.display());
    ExitCode::SUCCESS
}

/// `--profile`: one generation per side under perf, CPU time per op category.
fn run_profile(o: &Options) -> ExitCode {
    let Some(w) = workloads(o).into_iter().find(|w| !w.job.load_only) else {
        eprintln!("sd-bench: --profile needs a generation workload");
        return ExitCode::from(2);
    };
    let mut rows = Vec::new();
    let mut md = format!("### sd-bench profile: {}\n\n", w.title);
    for side in &o.sides {
        let stem = o.out.join(format!("profile-{}-{side}", w.name));
        let data = stem.with_extension("perf.data");
        let args = profile::record_args(&data, &runner_path(side), &w.job.to_args());
        eprint!("sd-bench: profiling {side} (load {:.2}) ... ", child::loadavg());
        let r = child::run(Path::new("perf"), &args, &stem.with_extension("json"), &stem.with_extension("log"), o.timeout);
        if let Some(e) = r["error"].as_str() {
            eprintln!("failed: {e}");
            md += &format!("{side}: failed: {e}\n\n");
            continue;
        }
        eprintln!("{:.1}s", r["wall_s"].as_f64().unwrap_or(f64::NAN));
        match profile::categorise(&data) {
            Ok((cats, syms)) => {
                md += &format!("{side} top symbols (self time):\n\n");
                for (pct, sym) in syms.iter().take(12) {
                    md += &format!("    {pct:6.2} %  {sym}\n");
                }
                md.push('\n');
                rows.push((side.clone(), cats, r["cpu_s"].as_f64().unwrap_or(0.0)));
            }
            Err(e) => md += &format!("{side}: {e}\n\n"),
        }
    }
    md += &profile::render(&w.title, &rows);
    println!("{md}");
    if let Err(e) = std::fs::write(o.out.join("profile.md"), &md) {
        eprintln!("sd-bench: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
