//! sd-bench: the same generation on the reference stable-diffusion.cpp and on
//! libstable-diffusion, each in its own process, alternating reference/ours/... for every
//! repetition, then medians, ranges and ratios. See BENCHMARKS.md.
//!
//! ```sh
//! cargo run --release --manifest-path bench/Cargo.toml -- --quick   # minutes
//! cargo run --release --manifest-path bench/Cargo.toml              # the matrix of BENCHMARKS.md
//! cargo run --release --manifest-path bench/Cargo.toml -- --steps 20 --reps 3   # all 20 steps
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

  --quick              256x256, f16, 3 steps, 1 repetition, no load workloads
  --reps N|LIST        repetitions (A/B pairs) of every generation workload, one number or
                       per size as SIZE:N,... (default 256:3,512:1)
  --load-reps N        repetitions of the load workloads (default 3)
  --sizes LIST         square sizes, comma-separated (default 256,512)
  --wtypes LIST        weight types at load (default f16,q8_0; `file` keeps the files' own
                       types, e.g. LTX-2.3's f32 DiT next to f16 text encoder files)
  --steps N|LIST       sampling steps actually run, one number or per size as SIZE:N,...
                       (default 256:4,512:2); the UNet step time is the median of steps
                       2..n and the total wall time is also extrapolated to --nominal-steps
  --nominal-steps N    the step count the totals are extrapolated to (default 20)
  --threads N          threads (default 2)
  --sides LIST         runners, first is the baseline of the ratios
                       (default reference,ours; ours-native builds ours with -march=native,
                       ours-vulkan computes on the first Vulkan device (lavapipe without a GPU),
                       ours-rpc on this CPU through ggml's RPC server on loopback,
                       and the NAMEs of --ref-lib); SIDE+fa is SIDE with flash attention
                       (flash_attn of sd_ctx_params_t), e.g. ours+fa,ref97+fa; SIDE+fast
                       (after +fa or alone) is SIDE with fast=1 in model_args (our fast path)
  --ref-lib NAME=PATH  a side NAME that runs the stable-diffusion.cpp shared library PATH
                       (loaded at run time through the C API of stable-diffusion.h), e.g.
                       the exact reference built by bench/build-reference.sh; repeatable
  --model PATH         checkpoint (default $SD_FIXTURE_CACHE/sd1.safetensors,
                       SD_FIXTURE_CACHE defaulting to ~/.cache/sd-rs-fixtures)
  --component KEY=PATH a component file held apart, repeatable (KEY: diffusion_model,
                       clip_l, clip_g, t5xxl, llm, vae, embeddings_connectors,
                       audio_vae), as DiT models come; with
                       --model '' there is no checkpoint
  --video-frames N     generation workloads are videos of N frames (generate_video, e.g.
                       Wan with --model '' and diffusion_model, t5xxl, vae components);
                       only --ref-lib sides (ours too: --ref-lib ours=.../libstable_diffusion.so)
  --sampler NAME       sample method (default euler_a)
  --cfg X              CFG scale (default 7)
  --ref-image          image jobs pass one reference image (ref_images: the bench's test
                       picture at the generation size; PiD and edit models); --ref-lib sides
  --mmap               generation workloads with enable_mmap on (default off; e.g. LTX-2.3,
                       whose Gemma 3 and connector files may share bytes)
  --no-load            skip the load-only workloads (mmap on / off)
  --no-gen             skip the generation workloads
  --upscale-model PATH ESRGAN model of the upscale workloads (default
                       $SD_FIXTURE_CACHE/esrgan_x4.safetensors)
  --upscale-sizes LIST input sizes upscaled x4 (default 512; --quick: 128)
  --upscale-tile N     tile_size of new_upscaler_ctx (default 128, the reference's)
  --no-upscale         skip the upscale workloads
  --upscale-only       only the upscale workloads (no SD checkpoint needed)
  --no-build           use the runners already built
  --timeout SECS       per run (default 3600)
  --out DIR            reports, logs and images (default bench/target/sd-bench)
  --verbose            runners echo the libraries' logs into their log files
  --profile            instead of timing: each side once under `perf record`, CPU time
                       per op category (first size and weight type, 2 steps unless --steps)
";

struct Options {
    /// `(size, n)`; `size` 0 is the default for sizes not listed.
    reps: Vec<(i32, usize)>,
    load_reps: usize,
    sizes: Vec<i32>,
    wtypes: Vec<String>,
    steps: Vec<(i32, i32)>,
    nominal_steps: i32,
    threads: i32,
    sides: Vec<String>,
    /// `--ref-lib` sides: name and library path.
    ref_libs: Vec<(String, String)>,
    model: PathBuf,
    components: Vec<(String, String)>,
    /// Frames of the video workloads; 0: image workloads.
    video_frames: i32,
    ref_image: bool,
    sampler: String,
    cfg: f32,
    /// `enable_mmap` of the generation workloads.
    mmap: bool,
    load: bool,
    gen: bool,
    upscale_model: PathBuf,
    upscale_sizes: Vec<i32>,
    upscale_tile: i32,
    upscale: bool,
    build: bool,
    timeout: Duration,
    out: PathBuf,
    verbose: bool,
    quick: bool,
    profile: bool,
}

fn fixture(file: &str) -> PathBuf {
    let cache = std::env::var_os("SD_FIXTURE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures"));
    cache.join(file)
}

fn list(v: &str) -> Vec<String> {
    v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

/// `N` (every size) or `SIZE:N,SIZE:N` (size 0 stands for the sizes not listed).
fn per_size(v: &str) -> Result<Vec<(i32, u64)>, String> {
    list(v)
        .into_iter()
        .map(|item| {
            let (size, n) = item.split_once(':').unwrap_or(("0", &item));
            let size = size.parse::<i32>().map_err(|_| format!("not a size: {size:?}"))?;
            let n = n.parse::<u64>().map_err(|_| format!("not a number: {n:?}"))?;
            Ok((size, n))
        })
        .collect()
}

/// The value for `size` in a per-size list, else the default entry, else `fallback`.
fn for_size<T: Copy>(v: &[(i32, T)], size: i32, fallback: T) -> T {
    v.iter().find(|(s, _)| *s == size).or_else(|| v.iter().find(|(s, _)| *s == 0)).map_or(fallback, |(_, n)| *n)
}

fn parse_args() -> Result<Options, String> {
    parse_args_from(std::env::args().skip(1).collect())
}

/// The options of a command line (without the program name).
fn parse_args_from(args: Vec<String>) -> Result<Options, String> {
    let mut o = Options {
        reps: vec![(256, 3), (512, 1), (0, 1)],
        load_reps: 3,
        sizes: vec![256, 512],
        wtypes: list("f16,q8_0"),
        steps: vec![(256, 4), (512, 2), (0, 2)],
        nominal_steps: 20,
        threads: 2,
        sides: list("reference,ours"),
        ref_libs: Vec::new(),
        model: fixture("sd1.safetensors"),
        components: Vec::new(),
        video_frames: 0,
        ref_image: false,
        sampler: Job::default().sampler,
        cfg: Job::default().cfg,
        mmap: false,
        load: true,
        gen: true,
        upscale_model: fixture("esrgan_x4.safetensors"),
        upscale_sizes: vec![512],
        upscale_tile: 128,
        upscale: true,
        build: true,
        timeout: Duration::from_secs(3600),
        out: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/sd-bench"),
        verbose: false,
        quick: false,
        profile: false,
    };
    o.profile = args.iter().any(|a| a == "--profile");
    if o.profile || args.iter().any(|a| a == "--quick") {
        o.quick = true;
        o.reps = vec![(0, 1)];
        o.sizes = vec![256];
        o.wtypes = list("f16");
        o.steps = vec![(0, if o.profile { 2 } else { 3 })];
        o.load = false;
        o.upscale_sizes = vec![128];
    }
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|_| format!("not a number: {v:?}"));
        match flag.as_str() {
            "--quick" | "--profile" => {}
            "--reps" => o.reps = per_size(&value()?)?.into_iter().map(|(s, n)| (s, n.max(1) as usize)).collect(),
            "--load-reps" => o.load_reps = num(value()?)?.max(1) as usize,
            "--sizes" => o.sizes = list(&value()?).into_iter().map(|s| num(s).map(|n| n as i32)).collect::<Result<_, _>>()?,
            "--wtypes" => o.wtypes = list(&value()?),
            "--steps" => o.steps = per_size(&value()?)?.into_iter().map(|(s, n)| (s, n.max(1) as i32)).collect(),
            "--nominal-steps" => o.nominal_steps = num(value()?)?.max(1) as i32,
            "--threads" => o.threads = num(value()?)? as i32,
            "--sides" => o.sides = list(&value()?),
            "--ref-lib" => {
                let v = value()?;
                match v.split_once('=') {
                    Some((name, path)) if !name.is_empty() && !path.is_empty() => o.ref_libs.push((name.into(), path.into())),
                    _ => return Err(format!("--ref-lib: want NAME=PATH, got {v:?}")),
                }
            }
            "--model" => o.model = PathBuf::from(value()?),
            "--component" => o.components.push(sd_bench_common::parse_component(&value()?)?),
            "--video-frames" => o.video_frames = num(value()?)? as i32,
            "--sampler" => o.sampler = value()?,
            "--cfg" => o.cfg = value()?.parse().map_err(|_| "--cfg: not a number".to_string())?,
            "--mmap" => o.mmap = true,
            "--ref-image" => o.ref_image = true,
            "--no-load" => o.load = false,
            "--load" => o.load = true,
            "--no-gen" => o.gen = false,
            "--upscale-model" => o.upscale_model = PathBuf::from(value()?),
            "--upscale-sizes" => {
                o.upscale_sizes = list(&value()?).into_iter().map(|s| num(s).map(|n| n as i32)).collect::<Result<_, _>>()?
            }
            "--upscale-tile" => o.upscale_tile = num(value()?)? as i32,
            "--no-upscale" => o.upscale = false,
            "--upscale-only" => {
                o.upscale = true;
                o.load = false;
                o.gen = false;
            }
            "--no-build" => o.build = false,
            "--timeout" => o.timeout = Duration::from_secs(num(value()?)?),
            "--out" => o.out = PathBuf::from(value()?),
            "--verbose" => o.verbose = true,
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown option {flag:?}")),
        }
    }
    for s in &o.sides {
        let s = base_side(s);
        if !BUILT_SIDES.contains(&s) && o.library(s).is_none() {
            return Err(format!("unknown side {s:?} ({}, or a --ref-lib NAME)", BUILT_SIDES.join(", ")));
        }
        // Only sd-bench-lib calls generate_video (through the C API).
        if o.video_frames > 0 && o.library(s).is_none() {
            return Err(format!("--video-frames: side {s:?} is not a --ref-lib library (give ours as --ref-lib ours=PATH)"));
        }
        if o.ref_image && o.library(s).is_none() {
            return Err(format!("--ref-image: side {s:?} is not a --ref-lib library (give ours as --ref-lib ours=PATH)"));
        }
    }
    Ok(o)
}

/// The sides whose runners cargo builds; `--ref-lib` adds named ones.
const BUILT_SIDES: &[&str] = &["reference", "ours", "ours-native", "ours-vulkan", "ours-rpc"];

/// The suffix of a side that runs with flash attention on.
const FLASH_ATTN_SUFFIX: &str = "+fa";
/// The suffix (last) of a side that runs our fast path (`fast=1` in `model_args`).
const FAST_SUFFIX: &str = "+fast";

/// A side's runner without its flash-attention and fast-path suffixes.
fn base_side(side: &str) -> &str {
    let side = side.strip_suffix(FAST_SUFFIX).unwrap_or(side);
    side.strip_suffix(FLASH_ATTN_SUFFIX).unwrap_or(side)
}

impl Options {
    /// The library of a `--ref-lib` side.
    fn library(&self, side: &str) -> Option<&str> {
        self.ref_libs.iter().find(|(n, _)| n == side).map(|(_, p)| p.as_str())
    }

    /// The runner of a side and the job it runs (a `--ref-lib` side's names its library).
    fn runner(&self, side: &str, job: &Job) -> (PathBuf, Job) {
        let fast = side.ends_with(FAST_SUFFIX);
        let flash_attn = side.strip_suffix(FAST_SUFFIX).unwrap_or(side).ends_with(FLASH_ATTN_SUFFIX);
        let side = base_side(side);
        match self.library(side) {
            Some(lib) => (runner_path("library"), Job { library: lib.to_string(), flash_attn, fast, ..job.clone() }),
            None => (runner_path(side), Job { flash_attn, fast, ..job.clone() }),
        }
    }
}

/// Where the runner binaries are: next to this program (cargo's target/<profile>), the
/// `native` build of ours in its own target folder so that neither build evicts the other.
fn runner_path(side: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new(".")).to_path_buf();
    match side {
        "reference" => dir.join("sd-bench-ref"),
        "ours" => dir.join("sd-bench-ours"),
        "library" => dir.join("sd-bench-lib"),
        other => {
            let profile = dir.file_name().map(PathBuf::from).unwrap_or_else(|| "release".into());
            let variant = other.strip_prefix("ours-").unwrap_or("native");
            dir.parent().unwrap_or(Path::new(".")).join(variant).join(profile).join("sd-bench-ours")
        }
    }
}

/// Builds the runners the sides need with cargo (release).
fn build_runners(o: &Options) -> Result<(), String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut builds: Vec<Vec<String>> = Vec::new();
    let mut plain: Vec<String> = Vec::new();
    for side in &o.sides {
        match base_side(side) {
            s if o.library(s).is_some() => {
                if !plain.iter().any(|p| p == "sd-bench-lib") {
                    plain.extend(["-p".into(), "sd-bench-lib".into()]);
                }
            }
            "reference" => plain.extend(["-p".into(), "sd-bench-ref".into()]),
            "ours" => plain.extend(["-p".into(), "sd-bench-ours".into()]),
            other => {
                let target = runner_path(other);
                let target_dir = target.parent().and_then(Path::parent).unwrap_or(Path::new("."));
                builds.push(vec![
                    "-p".into(),
                    "sd-bench-ours".into(),
                    "--features".into(),
                    other.strip_prefix("ours-").unwrap_or("native").into(),
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

/// One row group of the result: a job, how often, and what it measures.
struct Workload {
    name: String,
    title: String,
    job: Job,
    reps: usize,
    metrics: &'static [table::Metric],
}

/// The `wtype` of a job for a `--wtypes` name: `file` is none (the files' own types).
fn job_wtype(name: &str) -> String {
    if name == "file" { String::new() } else { name.to_string() }
}

/// The load workloads first (short), then the sizes in order, so that a run cut short
/// still has the small results.
fn workloads(o: &Options) -> Vec<Workload> {
    let base = Job {
        model: o.model.display().to_string(),
        components: o.components.clone(),
        sampler: o.sampler.clone(),
        cfg: o.cfg,
        threads: o.threads,
        verbose: o.verbose,
        video_frames: o.video_frames,
        mmap: o.mmap,
        ref_image: o.ref_image,
        ..Job::default()
    };
    let video = o.video_frames > 0;
    let mut w = Vec::new();
    if o.load {
        for wtype in &o.wtypes {
            for mmap in [true, false] {
                let onoff = if mmap { "on" } else { "off" };
                w.push(Workload {
                    name: format!("load-{wtype}-mmap-{onoff}"),
                    title: format!("Model load, {wtype} weights, mmap {onoff} (then one 64×64 step)"),
                    job: Job { wtype: job_wtype(wtype), mmap, load_only: true, ..base.clone() },
                    reps: o.load_reps,
                    metrics: table::LOAD_METRICS,
                });
            }
        }
    }
    if o.gen {
        for &size in &o.sizes {
            for wtype in &o.wtypes {
                let steps = for_size(&o.steps, size, 2);
                let reps = for_size(&o.reps, size, 1);
                let job = Job { wtype: job_wtype(wtype), width: size, height: size, steps, ..base.clone() };
                w.push(if video {
                    Workload {
                        name: format!("video-{size}x{}-{wtype}", o.video_frames),
                        title: format!(
                            "Video {size}×{size}×{} frames, {wtype} weights, mmap {}, {steps} steps, {}, CFG {}, {} threads, {reps} repetition(s)",
                            o.video_frames,
                            if o.mmap { "on" } else { "off" },
                            base.sampler,
                            base.cfg,
                            base.threads
                        ),
                        job,
                        reps,
                        metrics: table::VIDEO_METRICS,
                    }
                } else {
                    Workload {
                        name: format!("gen-{size}-{wtype}"),
                        title: format!(
                            "{size}×{size}, {wtype} weights, mmap {}, {steps} steps run (totals also extrapolated to {}), {}, CFG {}, {} threads, {reps} A/B pair(s)",
                            if o.mmap { "on" } else { "off" },
                            o.nominal_steps,
                            base.sampler,
                            base.cfg,
                            base.threads
                        ),
                        job,
                        reps,
                        metrics: table::GEN_METRICS,
                    }
                });
            }
        }
    }
    if o.upscale {
        for &size in &o.upscale_sizes {
            w.push(Workload {
                name: format!("upscale-{size}"),
                title: format!(
                    "ESRGAN upscale of a {size}×{size} image (`{}`, tile size {}), {} threads",
                    o.upscale_model.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
                    o.upscale_tile,
                    base.threads
                ),
                job: Job {
                    model: String::new(),
                    upscale_model: o.upscale_model.display().to_string(),
                    tile_size: o.upscale_tile,
                    width: size,
                    height: size,
                    ..base.clone()
                },
                reps: for_size(&o.reps, size, 1),
                metrics: table::UPSCALE_METRICS,
            });
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
        if let Err(e) = build_runners(&o) {
            eprintln!("sd-bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    let parts: Vec<PathBuf> = o.components.iter().map(|(_, p)| PathBuf::from(p)).collect();
    let checkpoint = !o.model.as_os_str().is_empty();
    let models = [(checkpoint && (o.load || o.gen), &o.model), (o.upscale, &o.upscale_model)];
    let warm = models
        .into_iter()
        .filter(|(used, _)| *used)
        .map(|(_, m)| m)
        .chain(parts.iter().filter(|_| o.load || o.gen))
        .try_for_each(|m| warm_page_cache(m));
    if let Err(e) = warm.and_then(|_| std::fs::create_dir_all(&o.out).map_err(|e| e.to_string())) {
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
    let total: usize = work.iter().map(|w| w.reps * o.sides.len()).sum();
    let mut n = 0;
    for (wi, w) in work.iter().enumerate() {
        for rep in 0..w.reps {
            for side in &o.sides {
                n += 1;
                let stem = o.out.join(format!("{}-{side}-{rep}", w.name));
                let (exe, mut job) = o.runner(side, &w.job);
                if rep == 0 && !job.load_only {
                    job.out = Some(o.out.join(format!("{}-{side}.ppm", w.name)).display().to_string());
                }
                eprint!("sd-bench: [{n}/{total}] {} {side} #{} (load {:.2}) ... ", w.name, rep + 1, child::loadavg());
                let mut r = child::run(
                    &exe,
                    &job.to_args(),
                    &stem.with_extension("json"),
                    &stem.with_extension("log"),
                    o.timeout,
                );
                if !job.load_only {
                    // What the run would have taken with the nominal step count.
                    if let (Some(wall), Some(step)) = (r["wall_s"].as_f64(), r["step_median_s"].as_f64()) {
                        r["wall_nominal_s"] = json!(wall + f64::from(o.nominal_steps - job.steps) * step);
                    }
                }
                match r["error"].as_str() {
                    Some(e) => eprintln!("failed: {e}"),
                    None => eprintln!("{:.1}s", r["wall_s"].as_f64().unwrap_or(f64::NAN)),
                }
                runs.push((wi, side.clone(), r));
            }
        }
        // Written after every workload, so that an interrupted run keeps what it measured.
        if let Err(e) = write_results(&o, &machine, load_start, &work[..=wi], &runs) {
            eprintln!("sd-bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    match std::fs::read_to_string(o.out.join("results.md")) {
        Ok(md) => println!("{md}"),
        Err(e) => eprintln!("sd-bench: {e}"),
    }
    eprintln!("sd-bench: reports in {}", o.out.display());
    ExitCode::SUCCESS
}

/// Renders the Markdown tables of the workloads done so far and writes them with every raw
/// report to `results.md` and `results.json`.
fn write_results(o: &Options, machine: &Value, load_start: f64, work: &[Workload], runs: &[(usize, String, Value)]) -> Result<(), String> {
    let load_now = child::loadavg();
    let info = runs.iter().find(|(_, s, r)| s == "reference" && r["error"].is_null()).map(|(_, _, r)| r);
    let mut md = format!(
        "### sd-bench results\n\nMachine: {} ({} CPUs, {:.0} GiB), commit {}; load average (1 min) {load_start:.2} at start, {load_now:.2} at the last workload's end.\n",
        machine["cpu"].as_str().unwrap_or(""),
        machine["cpus"],
        machine["mem_gib"].as_f64().unwrap_or(0.0),
        machine["commit"].as_str().unwrap_or(""),
    );
    if let Some(r) = info {
        let version = r["version"].as_str().filter(|v| !v.is_empty() && *v != "unknown").unwrap_or("of diffusion-rs-sys 0.1.20");
        md += &format!("Reference: stable-diffusion.cpp {version}.\n");
    }
    md += &format!(
        "Sides run in the order {} for every repetition; median (min–max) over the repetitions.\n\n",
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
    let all = json!({
        "machine": machine,
        "load_start": load_start,
        "load_end": load_now,
        "quick": o.quick,
        "nominal_steps": o.nominal_steps,
        "runs": runs.iter().map(|(wi, side, r)| json!({"workload": work[*wi].name, "side": side, "report": r})).collect::<Vec<_>>(),
    });
    let results = o.out.join("results.json");
    std::fs::write(&results, serde_json::to_string_pretty(&all).unwrap_or_default())
        .and_then(|_| std::fs::write(o.out.join("results.md"), &md))
        .map_err(|e| format!("writing {}: {e}", results.display()))
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
        let (exe, job) = o.runner(side, &w.job);
        let args = profile::record_args(&data, &exe, &job.to_args());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_attention_sides_share_their_runner() {
        let o = Options { ref_libs: vec![("ref97".into(), "/r/lib.so".into())], ..parse_args_from(Vec::new()).unwrap() };
        let job = Job { model: "m".into(), ..Job::default() };
        let (exe, j) = o.runner("ref97+fa", &job);
        assert_eq!((exe, j.library.as_str(), j.flash_attn), (runner_path("library"), "/r/lib.so", true));
        let (exe, j) = o.runner("ours", &job);
        assert_eq!((exe, j.flash_attn), (runner_path("ours"), false));
        assert_eq!(o.runner("ours+fa", &job).0, runner_path("ours"));
        assert!(parse_args_from(["--sides", "ours+fa,reference+fa"].map(String::from).to_vec()).is_ok());
        assert!(parse_args_from(["--sides", "nobody+fa"].map(String::from).to_vec()).is_err());
        let (exe, j) = o.runner("ours+fa+fast", &job);
        assert_eq!((exe, j.flash_attn, j.fast), (runner_path("ours"), true, true));
        let (_, j) = o.runner("ours+fast", &job);
        assert_eq!((j.flash_attn, j.fast), (false, true));
        assert!(!o.runner("ours+fa", &job).1.fast);
        assert!(parse_args_from(["--sides", "ours+fa+fast,reference+fa"].map(String::from).to_vec()).is_ok());
    }

    #[test]
    fn video_workloads_need_library_sides() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let video = ["--video-frames", "17", "--cfg", "1", "--sizes", "256", "--wtypes", "f16", "--no-load", "--no-upscale"];
        assert!(parse_args_from(args(&video)).is_err(), "the default sides cannot make videos");
        let sides = ["--ref-lib", "ref97=/r.so", "--ref-lib", "ours=/o.so", "--sides", "ref97+fa,ours"];
        let o = parse_args_from(args(&[&video[..], &sides[..]].concat())).unwrap();
        let w = workloads(&o);
        assert_eq!(w.len(), 1);
        assert_eq!((w[0].name.as_str(), w[0].job.video_frames, w[0].job.cfg), ("video-256x17-f16", 17, 1.0));
        assert!(w[0].metrics.iter().any(|m| m.field == "decode_peak_rss_kb"));
        let (exe, job) = o.runner("ours", &w[0].job);
        assert_eq!((exe, job.library.as_str(), job.video_frames), (runner_path("library"), "/o.so", 17));
        assert!(!job.mmap && w[0].title.contains("mmap off"));
        // LTX-2.3 with sound: its Gemma 3 and connector files, mmap on.
        let ltx = ["--mmap", "--component", "embeddings_connectors=/c", "--component", "audio_vae=/a"];
        let o = parse_args_from(args(&[&video[..], &sides[..], &ltx[..]].concat())).unwrap();
        let w = workloads(&o);
        assert!(w[0].job.mmap && w[0].title.contains("mmap on") && w[0].job.components.len() == 2);
        assert!(w[0].metrics.iter().any(|m| m.field == "audio_decode_s"));
        let file = parse_args_from(args(&[&video[..], &sides[..], &["--wtypes", "file"][..]].concat())).unwrap();
        assert_eq!((workloads(&file)[0].name.as_str(), workloads(&file)[0].job.wtype.as_str()), ("video-256x17-file", ""));
    }
}
