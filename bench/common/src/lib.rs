//! What both benchmark runners share, so that the two sides are measured the same way.
//!
//! A runner loads one model, optionally generates one image, and prints one JSON object on
//! stdout. Phase times come from the library's own callbacks on both sides: the log
//! callback (the reference logs how long conditioning, sampling and decoding took, and our
//! library keeps those messages) and the progress callback (seconds per sampling step).
//! Load and `generate_image` are timed around the calls by the runner itself.
//!
//! The reference prepares its weights lazily: `new_sd_ctx` only reads the metadata and each
//! module's weights are read (or mapped) the first time the module runs, inside
//! `generate_image`, logging "loading tensors completed, taking Xs". Those seconds are
//! summed (`lazy_load_s`), added to the load time (`load_total_s`) and taken out of the
//! phase they happened in, so that the phases compare compute with compute. Our library
//! loads most weights in `new_sd_ctx`, but reads some again for each phase that uses them
//! (T5 / UMT5 and the LLM text encoders are freed after conditioning unless `eager_load`),
//! logging "<what>: loaded N tensors (X MB) in Ys": those reads count the same way.
//!
//! The machine may be shared, so the process's CPU time is noted with every progress
//! callback and at the decode's start and end: CPU seconds per step and per decode do not
//! grow with the load of other processes the way wall seconds do.
//!
//! The VAE decode's memory is measured apart: when sampling completes the runner notes the
//! resident set and resets the kernel's high-water mark (`/proc/self/clear_refs`), and
//! reads the mark again when the decode completes. The process peak before the reset is
//! kept, so `peak_rss_kb` is still the whole run's peak. With an audio VAE (LTX-2.3) the
//! sound is decoded in that window too, before the frames.

use serde_json::{json, Value};
use std::ffi::{c_char, CStr, CString};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// One benchmark job, passed from the driver to a runner as command-line flags.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub model: String,
    pub width: i32,
    pub height: i32,
    pub steps: i32,
    pub threads: i32,
    /// Weight type to convert to at load (`f16`, `q8_0`, ...); empty keeps the file's types.
    pub wtype: String,
    pub mmap: bool,
    pub seed: i64,
    pub cfg: f32,
    pub sampler: String,
    pub prompt: String,
    pub negative_prompt: String,
    /// Load the model, then one 64×64 single-step generation so that lazily loaded weights
    /// are in memory too (load time and memory only).
    pub load_only: bool,
    /// Write the generated image here (binary PPM) for a side-by-side comparison.
    pub out: Option<String>,
    /// Echo every log line of the library on stderr.
    pub verbose: bool,
    /// An ESRGAN model: the job upscales a `width`×`height` test image ([`test_image`])
    /// with it instead of generating (empty: a generation job).
    pub upscale_model: String,
    /// The `tile_size` of `new_upscaler_ctx`.
    pub tile_size: i32,
    /// Component files held apart (`KEY=PATH`, KEY one of [`COMPONENTS`]), as DiT models
    /// come; `model` may then be empty.
    pub components: Vec<(String, String)>,
    /// A shared library with the C API of `stable-diffusion.h` that the `sd-bench-lib`
    /// runner loads (the other runners ignore it).
    pub library: String,
    /// `flash_attn` of `sd_ctx_params_t`: flash attention in every model (a side named
    /// `NAME+fa`).
    pub flash_attn: bool,
    /// Our opt-in fast path (`fast=1` in `model_args`; a side named `NAME+fast`).
    pub fast: bool,
    /// Frames of a video job (`generate_video` instead of `generate_image`); 0 is an image
    /// job.
    pub video_frames: i32,
    /// An image job with one reference image (`ref_images`): [`test_image`] at the job's
    /// size (PiD, edit models).
    pub ref_image: bool,
}

/// Component keys of [`Job::components`], named after the `sd_ctx_params_t` fields
/// (`diffusion_model` is `diffusion_model_path`, ...).
pub const COMPONENTS: &[&str] =
    &["diffusion_model", "clip_l", "clip_g", "t5xxl", "llm", "vae", "embeddings_connectors", "audio_vae"];

/// The `sd_ctx_params_t` path field of a component key: `slots` are the fields named by
/// [`COMPONENTS`], in that order (each runner has its own binding of the struct).
pub fn component_slot<'a, T>(key: &str, slots: [&'a mut T; 8]) -> Result<&'a mut T, String> {
    let i = COMPONENTS.iter().position(|k| *k == key).ok_or_else(|| format!("unknown component {key:?}"))?;
    Ok(slots.into_iter().nth(i).expect("one slot per component"))
}

/// The path fields of an `sd_ctx_params_t` (any binding of it) in [`COMPONENTS`] order, for
/// [`component_slot`].
#[macro_export]
macro_rules! component_slots {
    ($p:expr) => {
        [
            &mut $p.diffusion_model_path,
            &mut $p.clip_l_path,
            &mut $p.clip_g_path,
            &mut $p.t5xxl_path,
            &mut $p.llm_path,
            &mut $p.vae_path,
            &mut $p.embeddings_connectors_path,
            &mut $p.audio_vae_path,
        ]
    };
}

/// A C string of a job's text.
pub fn cstr(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} contains a NUL byte"))
}

/// A static string of a library (version, system info); empty for NULL.
pub fn lib_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the C API returns NUL-terminated strings it owns for the process lifetime.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// [`on_log`] for a C log callback: `sd_log_level_t`'s raw value (DEBUG, INFO, WARN,
/// ERROR) and the library's text (NULL is ignored).
pub fn on_c_log(level: i64, text: *const c_char) {
    if text.is_null() {
        return;
    }
    // SAFETY: the library passes a NUL-terminated buffer valid during the call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let level = match level {
        0 => "debug",
        1 => "info",
        2 => "warn",
        _ => "error",
    };
    on_log(level, &text);
}

/// `KEY=PATH` with a known key.
pub fn parse_component(v: &str) -> Result<(String, String), String> {
    match v.split_once('=') {
        Some((k, p)) if COMPONENTS.contains(&k) && !p.is_empty() => Ok((k.to_string(), p.to_string())),
        _ => Err(format!("--component: want KEY=PATH with KEY one of {}, got {v:?}", COMPONENTS.join(", "))),
    }
}

impl Default for Job {
    fn default() -> Self {
        Job {
            model: String::new(),
            width: 256,
            height: 256,
            steps: 20,
            threads: 2,
            wtype: "f16".into(),
            mmap: false,
            seed: 42,
            cfg: 7.0,
            sampler: "euler_a".into(),
            prompt: "a lovely cat sitting on a wooden table, photograph, detailed".into(),
            negative_prompt: String::new(),
            load_only: false,
            out: None,
            verbose: false,
            upscale_model: String::new(),
            tile_size: 128,
            components: Vec::new(),
            library: String::new(),
            flash_attn: false,
            fast: false,
            video_frames: 0,
            ref_image: false,
        }
    }
}

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{flag}: not a number: {v:?}"))
}

impl Job {
    /// The flags that reproduce this job (`from_args` reads them back).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--model".into(),
            self.model.clone(),
            "--width".into(),
            self.width.to_string(),
            "--height".into(),
            self.height.to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--threads".into(),
            self.threads.to_string(),
            "--wtype".into(),
            self.wtype.clone(),
            "--mmap".into(),
            (self.mmap as u8).to_string(),
            "--seed".into(),
            self.seed.to_string(),
            "--cfg".into(),
            self.cfg.to_string(),
            "--sampler".into(),
            self.sampler.clone(),
            "--prompt".into(),
            self.prompt.clone(),
            "--negative-prompt".into(),
            self.negative_prompt.clone(),
        ];
        if self.load_only {
            a.push("--load-only".into());
        }
        if let Some(out) = &self.out {
            a.push("--out".into());
            a.push(out.clone());
        }
        if self.verbose {
            a.push("--verbose".into());
        }
        if !self.upscale_model.is_empty() {
            a.extend(["--upscale-model".into(), self.upscale_model.clone(), "--tile-size".into(), self.tile_size.to_string()]);
        }
        for (k, p) in &self.components {
            a.extend(["--component".into(), format!("{k}={p}")]);
        }
        if !self.library.is_empty() {
            a.extend(["--library".into(), self.library.clone()]);
        }
        if self.flash_attn {
            a.push("--flash-attn".into());
        }
        if self.fast {
            a.push("--fast".into());
        }
        if self.is_video() {
            a.extend(["--video-frames".into(), self.video_frames.to_string()]);
        }
        if self.ref_image {
            a.push("--ref-image".into());
        }
        a
    }

    pub fn from_args<I: IntoIterator<Item = String>>(args: I) -> Result<Job, String> {
        let mut job = Job::default();
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--model" => job.model = value()?,
                "--width" => job.width = parse_num(&flag, &value()?)?,
                "--height" => job.height = parse_num(&flag, &value()?)?,
                "--steps" => job.steps = parse_num(&flag, &value()?)?,
                "--threads" => job.threads = parse_num(&flag, &value()?)?,
                "--wtype" => job.wtype = value()?,
                "--mmap" => job.mmap = value()? != "0",
                "--seed" => job.seed = parse_num(&flag, &value()?)?,
                "--cfg" => job.cfg = parse_num(&flag, &value()?)?,
                "--sampler" => job.sampler = value()?,
                "--prompt" => job.prompt = value()?,
                "--negative-prompt" => job.negative_prompt = value()?,
                "--out" => job.out = Some(value()?),
                "--load-only" => job.load_only = true,
                "--verbose" => job.verbose = true,
                "--upscale-model" => job.upscale_model = value()?,
                "--tile-size" => job.tile_size = parse_num(&flag, &value()?)?,
                "--component" => job.components.push(parse_component(&value()?)?),
                "--library" => job.library = value()?,
                "--flash-attn" => job.flash_attn = true,
                "--fast" => job.fast = true,
                "--video-frames" => job.video_frames = parse_num(&flag, &value()?)?,
                "--ref-image" => job.ref_image = true,
                _ => return Err(format!("unknown flag {flag:?}")),
            }
        }
        if job.model.is_empty() && job.upscale_model.is_empty() && job.components.is_empty() {
            return Err("--model, --component or --upscale-model is required".into());
        }
        Ok(job)
    }

    pub fn is_upscale(&self) -> bool {
        !self.upscale_model.is_empty()
    }

    pub fn is_video(&self) -> bool {
        self.video_frames > 0
    }
}

/// The RGB image upscale jobs start from: smooth gradients with some detail, the same
/// bytes on both sides (row-major, interleaved).
pub fn test_image(width: u32, height: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(width as usize * height as usize * 3);
    for y in 0..height {
        for x in 0..width {
            let (fx, fy) = (x as f32 / width.max(1) as f32, y as f32 / height.max(1) as f32);
            let ripple = ((x as f32 * 0.21).sin() * (y as f32 * 0.17).cos() * 0.5 + 0.5) * 60.0;
            out.push((fx * 180.0 + ripple) as u8);
            out.push((fy * 180.0 + 60.0 - ripple * 0.5) as u8);
            out.push(((1.0 - fx * fy) * 200.0 + (x ^ y) as f32 % 16.0) as u8);
        }
    }
    out
}

/// Everything the callbacks saw, with the time (seconds since the recorder started).
#[derive(Default)]
struct Events {
    /// `(t, level, text, generating)`
    logs: Vec<(f64, String, String, bool)>,
    /// `(t, step, steps, seconds, process CPU seconds)` reported while `generate_image` ran.
    progress: Vec<(f64, i32, i32, f32, f64)>,
    generating: bool,
    /// The decode's memory, see [`DecodeMemory`].
    decode: DecodeMemory,
}

/// Resident memory (kB, from `/proc/self/status`) and process CPU time around the VAE
/// decode.
#[derive(Default, Clone, Copy)]
struct DecodeMemory {
    cpu_start_s: Option<f64>,
    cpu_end_s: Option<f64>,
    /// The resident set when sampling completed (the decode's start).
    rss_start_kb: Option<u64>,
    /// The process's peak before the high-water mark was reset for the decode.
    hwm_before_kb: Option<u64>,
    /// The peak from the decode's start to its end.
    peak_kb: Option<u64>,
}

/// Notes the decode's start (sampling completed: resident set, peak so far, then the peak
/// reset to the current resident set) or its end (the peak since), from a log line.
fn track_decode_memory(text: &str, mem: &mut DecodeMemory) {
    if seconds_in(text, "sampling").is_some() {
        mem.cpu_start_s = Some(cpu_s());
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        mem.hwm_before_kb = status_kb(&status, "VmHWM").max(mem.hwm_before_kb);
        mem.rss_start_kb = status_kb(&status, "VmRSS");
        // "5" resets VmHWM to VmRSS (Linux 4.0+); without it the decode's peak is unknown.
        if std::fs::write("/proc/self/clear_refs", "5").is_err() {
            mem.rss_start_kb = None;
        }
    } else if seconds_in(text, "decode_first_stage").is_some() && mem.cpu_start_s.is_some() {
        mem.cpu_end_s = Some(cpu_s());
        mem.peak_kb = mem.rss_start_kb.and(vm_hwm_kb());
    }
}

/// User + system CPU seconds of this process so far (every thread).
pub fn cpu_s() -> f64 {
    // SAFETY: an all-zero rusage is valid for getrusage to fill in.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

struct Recorder {
    t0: Instant,
    events: Mutex<Events>,
    verbose: bool,
}

static RECORDER: OnceLock<Recorder> = OnceLock::new();

/// Starts recording (call first thing in `main`).
pub fn start(verbose: bool) {
    let _ = RECORDER.set(Recorder { t0: Instant::now(), events: Mutex::new(Events::default()), verbose });
}

fn with_events<R>(f: impl FnOnce(f64, &mut Events) -> R) -> Option<R> {
    let r = RECORDER.get()?;
    let t = r.t0.elapsed().as_secs_f64();
    let mut ev = r.events.lock().unwrap_or_else(|e| e.into_inner());
    Some(f(t, &mut ev))
}

/// The log callback of either library.
pub fn on_log(level: &str, text: &str) {
    if RECORDER.get().is_some_and(|r| r.verbose) {
        eprint!("[{level}] {text}");
    }
    with_events(|t, ev| {
        let generating = ev.generating;
        if generating {
            track_decode_memory(text, &mut ev.decode);
        }
        ev.logs.push((t, level.to_string(), text.trim_end().to_string(), generating))
    });
}

/// The progress callback of either library. Loading and tiling report progress too: only
/// what arrives while `generate_image` runs is kept.
pub fn on_progress(step: i32, steps: i32, seconds: f32) {
    with_events(|t, ev| {
        if ev.generating {
            ev.progress.push((t, step, steps, seconds, cpu_s()));
        }
    });
}

/// Marks the start and the end of `generate_image`.
pub fn set_generating(on: bool) {
    with_events(|_, ev| ev.generating = on);
}

/// Times `f` in seconds.
pub fn timed<R>(f: impl FnOnce() -> R) -> (f64, R) {
    let t = Instant::now();
    let r = f();
    (t.elapsed().as_secs_f64(), r)
}

/// The seconds of a log line containing `"<what> completed, taking <x>s"`.
fn seconds_in(text: &str, what: &str) -> Option<f64> {
    let key = format!("{what} completed, taking ");
    let rest = &text[text.find(&key)? + key.len()..];
    let num: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    let v: f64 = num.parse().ok()?;
    // The reference logs some phases in ms ("taking 12 ms"), most in seconds.
    Some(if rest[num.len()..].trim_start().starts_with("ms") { v / 1000.0 } else { v })
}

/// The seconds of our library's weight-loading line, "<what>: loaded N tensors (X MB) in Ys".
fn our_load_seconds(text: &str) -> Option<f64> {
    let rest = &text[text.find(": loaded ")? + ": loaded ".len()..];
    let rest = &rest[rest.find(" tensors (")?..];
    let rest = &rest[rest.find(" MB) in ")? + " MB) in ".len()..];
    let num: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    rest[num.len()..].starts_with('s').then_some(())?;
    num.parse().ok()
}

type Log = (f64, String, String, bool);

/// The seconds in the last log line containing `"<what> completed, taking <x>s"`.
fn logged_seconds(logs: &[Log], what: &str) -> Option<f64> {
    logs.iter().rev().find_map(|(_, _, text, _)| seconds_in(text, what))
}

/// The weight loading logged while `generate_image` ran (the reference's lazy loading), in
/// all and within each phase: `(all, [(phase, seconds)])`. A load counts towards the next
/// phase that completes after it.
fn lazy_loads(logs: &[Log], phases: &[&str]) -> (f64, Vec<(String, f64)>) {
    let (mut all, mut pending) = (0.0, 0.0);
    let mut per_phase = Vec::new();
    for (_, _, text, generating) in logs {
        if !generating {
            continue;
        }
        if let Some(s) = seconds_in(text, "loading tensors").or_else(|| our_load_seconds(text)) {
            all += s;
            pending += s;
        } else if let Some(p) = phases.iter().find(|p| seconds_in(text, p).is_some()) {
            per_phase.push((p.to_string(), pending));
            pending = 0.0;
        }
    }
    (all, per_phase)
}

/// A `kB` field (`VmHWM`, `VmRSS`, ...) of a `/proc/<pid>/status` text.
fn status_kb(status: &str, field: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The peak resident set of this process (kB) since start or the last reset.
pub fn vm_hwm_kb() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/self/status").ok()?, "VmHWM")
}

/// A generated image, for the report (size and a fingerprint) and the optional PPM.
pub struct Picture<'a> {
    pub width: u32,
    pub height: u32,
    pub channels: u32,
    pub data: &'a [u8],
}

impl Picture<'_> {
    fn write_ppm(&self, path: &str) -> std::io::Result<()> {
        let mut bytes = format!("P6\n{} {}\n255\n", self.width, self.height).into_bytes();
        let c = self.channels.max(1) as usize;
        for px in self.data.chunks(c) {
            for i in 0..3 {
                bytes.push(px[i.min(c - 1)]);
            }
        }
        let tmp = format!("{path}.tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(tmp, path)
    }
}

/// What a runner measured around the library calls.
pub struct Outcome<'a> {
    pub side: &'a str,
    pub version: String,
    pub system_info: String,
    pub load_s: f64,
    /// `generate_image` wall time (absent for load-only jobs).
    pub generate_s: Option<f64>,
    pub picture: Option<Picture<'a>>,
    /// Why the job failed, if it did.
    pub error: Option<String>,
}

impl Outcome<'_> {
    /// The outcome of a job that failed before anything was measured.
    pub fn failed(side: &str, error: String) -> Outcome<'_> {
        Outcome {
            side,
            version: String::new(),
            system_info: String::new(),
            load_s: f64::NAN,
            generate_s: None,
            picture: None,
            error: Some(error),
        }
    }
}

/// A runner's `main`: reads the job, runs it, prints the report; fails when the job did.
pub fn runner_main(side: &str, run: impl FnOnce(&Job) -> Result<Outcome<'static>, String>) -> std::process::ExitCode {
    let job = match Job::from_args(std::env::args().skip(1)) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("{side} runner: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let job = if job.load_only { Job { width: 64, height: 64, steps: 1, ..job } } else { job };
    start(job.verbose);
    let outcome = run(&job).unwrap_or_else(|e| Outcome::failed(side, e));
    println!("{}", report(&job, &outcome));
    if outcome.error.is_some() {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

/// The median (mean of the middle two for an even count).
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 })
}

/// Builds the JSON report of one job from the outcome and the recorded callbacks.
pub fn report(job: &Job, outcome: &Outcome) -> Value {
    let (logs, progress, mem) = with_events(|_, ev| (ev.logs.clone(), ev.progress.clone(), ev.decode)).unwrap_or_default();
    let steps: Vec<_> = progress.iter().filter(|(_, step, steps, _, _)| *step >= 1 && *steps == job.steps).collect();
    let step_s: Vec<f64> = steps.iter().map(|(_, _, _, s, _)| *s as f64).collect();
    // CPU seconds between consecutive steps' callbacks: steps 2…n.
    let step_cpu_s: Vec<f64> = steps.windows(2).map(|w| w[1].4 - w[0].4).collect();
    // The first step also pays for first-use work (the reference's lazy UNet weights, graph
    // and buffer set-up on both sides): the per-step figure is the median of the others.
    let steady = if step_s.len() >= 2 { &step_s[1..] } else { &step_s[..] };
    // LTX-2.3 with an audio VAE decodes the sound between sampling and the frames' decode.
    const PHASES: [&str; 4] = ["get_learned_condition", "sampling", "decoding audio latent", "decode_first_stage"];
    let (lazy_load_s, lazy_per_phase) = lazy_loads(&logs, &PHASES);
    let phase = |name: &str| {
        let raw = logged_seconds(&logs, name)?;
        let lazy: f64 = lazy_per_phase.iter().filter(|(p, _)| p == name).map(|(_, s)| s).sum();
        Some((raw - lazy).max(0.0))
    };
    let mut error = outcome.error.clone();
    let picture = outcome.picture.as_ref().map(|p| {
        if let Some(out) = &job.out {
            if let Err(e) = p.write_ppm(out) {
                error.get_or_insert(format!("writing {out}: {e}"));
            }
        }
        let mean = p.data.iter().map(|&b| b as f64).sum::<f64>() / p.data.len().max(1) as f64;
        json!({"width": p.width, "height": p.height, "channels": p.channels, "mean": mean})
    });
    let errors: Vec<&str> = logs.iter().filter(|(_, l, _, _)| l == "error").map(|(_, _, t, _)| t.as_str()).collect();
    // An upscale's own compute: the call minus weights the reference loads lazily in it.
    let upscale_s = outcome.generate_s.filter(|_| job.is_upscale()).map(|g| (g - lazy_load_s).max(0.0));
    json!({
        "side": outcome.side,
        "version": outcome.version,
        "system_info": outcome.system_info,
        "job": job.to_args(),
        "load_s": outcome.load_s,
        "lazy_load_s": lazy_load_s,
        "load_total_s": outcome.load_s + lazy_load_s,
        "generate_s": outcome.generate_s,
        "cond_s": phase("get_learned_condition"),
        "sampling_s": phase("sampling"),
        "decode_s": phase("decode_first_stage"),
        "audio_decode_s": phase("decoding audio latent"),
        "step_s": step_s,
        "step_median_s": median(steady),
        "step_cpu_s": step_cpu_s,
        "step_cpu_median_s": median(&step_cpu_s),
        "decode_cpu_s": mem.cpu_end_s.zip(mem.cpu_start_s).map(|(e, s)| e - s),
        "upscale_s": upscale_s,
        "vm_hwm_kb": vm_hwm_kb(),
        "peak_rss_kb": vm_hwm_kb().max(mem.hwm_before_kb),
        "decode_rss_start_kb": mem.rss_start_kb,
        "decode_peak_rss_kb": mem.peak_kb,
        "decode_rss_growth_kb": mem.peak_kb.zip(mem.rss_start_kb).map(|(p, s)| p.saturating_sub(s)),
        "image": picture,
        "error": error,
        "error_logs": errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_round_trip() {
        let job = Job { model: "m.safetensors".into(), load_only: true, out: Some("x.ppm".into()), ..Job::default() };
        assert_eq!(Job::from_args(job.to_args()).unwrap(), job);
        let fa = Job { model: "m.safetensors".into(), flash_attn: true, library: "/x/lib.so".into(), ..Job::default() };
        assert_eq!(Job::from_args(fa.to_args()).unwrap(), fa);
        let up = Job { upscale_model: "x4.pth".into(), tile_size: 64, ..Job::default() };
        assert_eq!(Job::from_args(up.to_args()).unwrap(), up);
        let dit = Job { components: vec![("diffusion_model".into(), "flux.gguf".into()), ("vae".into(), "ae.safetensors".into())], ..Job::default() };
        assert_eq!(Job::from_args(dit.to_args()).unwrap(), dit);
        let ltx = Job { components: vec![("embeddings_connectors".into(), "c.safetensors".into()), ("audio_vae".into(), "a.safetensors".into())], mmap: true, ..Job::default() };
        assert_eq!(Job::from_args(ltx.to_args()).unwrap(), ltx);
        let video = Job { video_frames: 17, cfg: 1.0, ..dit };
        assert!(video.is_video() && video.to_args().contains(&"--video-frames".to_string()));
        let edit = Job { ref_image: true, ..video.clone() };
        assert!(Job::from_args(edit.to_args()).unwrap().ref_image);
        assert_eq!(Job::from_args(video.to_args()).unwrap(), video);
        assert!(parse_component("unet=x").is_err() && parse_component("vae=").is_err());
        assert_eq!(test_image(7, 5).len(), 105);
        assert!(Job::from_args(vec!["--bogus".to_string()]).is_err());
        assert!(Job::from_args(Vec::<String>::new()).is_err());
    }

    #[test]
    fn logged_phase_seconds() {
        let line = |t: &str| (0.0, "info".to_string(), t.to_string(), true);
        let logs = vec![
            line("stable-diffusion.cpp:4095 - get_learned_condition completed, taking 0.31s"),
            line("stable-diffusion.cpp:4637 - encode_first_stage completed, taking 12 ms"),
            line("stable-diffusion.cpp:4389 - sampling completed, taking 12.50s"),
        ];
        assert_eq!(logged_seconds(&logs, "get_learned_condition"), Some(0.31));
        assert_eq!(logged_seconds(&logs, "sampling"), Some(12.5));
        assert_eq!(logged_seconds(&logs, "encode_first_stage"), Some(0.012));
        assert_eq!(logged_seconds(&logs, "decode_first_stage"), None);
        let audio = [line("video.rs:561 - decoding audio latent completed, taking 0.84s")];
        assert_eq!(logged_seconds(&audio, "decoding audio latent"), Some(0.84));
    }

    #[test]
    fn lazy_loads_by_phase() {
        let line = |t: &str, g: bool| (0.0, "info".to_string(), t.to_string(), g);
        let logs = vec![
            line("loading tensors completed, taking 9.00s (read: 1s)", false),
            line("loading tensors completed, taking 0.40s (read: 0.26s)", true),
            line("get_learned_condition completed, taking 4.00s", true),
            line("loading tensors completed, taking 1.50s (read: 1.2s)", true),
            line("loading tensors completed, taking 0.25s (read: 0.2s)", true),
            line("sampling completed, taking 10.00s", true),
            line("decode_first_stage completed, taking 3.00s", true),
        ];
        let (all, per) = lazy_loads(&logs, &["get_learned_condition", "sampling", "decode_first_stage"]);
        assert!((all - 2.15).abs() < 1e-9);
        assert_eq!(per.len(), 3);
        assert!((per[0].1 - 0.4).abs() < 1e-9 && (per[1].1 - 1.75).abs() < 1e-9 && per[2].1 == 0.0);

        // Ours: the T5 read again for the conditioning phase counts; the loads in
        // `new_sd_ctx` do not.
        let ours = vec![
            line("loader.rs:189  - diffusion model: loaded 825 tensors (2708.92 MB) in 5.10s", false),
            line("loader.rs:189  - t5: loaded 22 tensors (2023.08 MB) in 6.82s", true),
            line("video.rs:428  - get_learned_condition completed, taking 7.42s", true),
            line("video.rs:578  - sampling completed, taking 19.22s", true),
        ];
        let (all, per) = lazy_loads(&ours, &["get_learned_condition", "sampling"]);
        assert!((all - 6.82).abs() < 1e-9 && (per[0].1 - 6.82).abs() < 1e-9 && per[1].1 == 0.0);
        assert_eq!(our_load_seconds("t5: loaded 22 tensors (2023.08 MB) in 0.00s"), Some(0.0));
        assert_eq!(our_load_seconds("lora: loaded 3 LoRAs in 1.0s"), None);
    }

    #[test]
    fn status_fields_and_decode_memory() {
        let status = "Name:\tsd\nVmHWMx:\t1 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!((status_kb(status, "VmHWM"), status_kb(status, "VmRSS")), (Some(2048), Some(1024)));
        assert_eq!(status_kb(status, "VmSwap"), None);
        let mut mem = DecodeMemory::default();
        track_decode_memory("decode_first_stage completed, taking 1.00s", &mut mem);
        assert!(mem.peak_kb.is_none(), "a decode without its start is not measured");
        track_decode_memory("sampling completed, taking 3.00s", &mut mem);
        let block = std::hint::black_box(vec![1u8; 32 << 20]);
        track_decode_memory("decode_first_stage completed, taking 2.00s", &mut mem);
        let (start, peak, before) = (mem.rss_start_kb.unwrap(), mem.peak_kb.unwrap(), mem.hwm_before_kb.unwrap());
        assert!(mem.cpu_end_s.unwrap() >= mem.cpu_start_s.unwrap());
        assert!(peak >= start + (30 << 10) && before > 0, "{start} {peak} {before}");
        drop(block);
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
