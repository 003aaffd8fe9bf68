//! The Wan VAEs at full size on the synthetic files (`wan-vae`: Wan2.1, `wan22-vae`:
//! Wan2.2, 1.41 GB), CPU.
//!
//! - `wan21_vae_video`, `wan22_vae_video` (with `SD_PARITY` set; the Wan2.2 file takes a
//!   minute to write once): every tensor of the files is declared with its shape, a short
//!   video encodes to the latent frame count and decodes back to frames in [0, 1], and the
//!   streamed decode / encode (one chunk per graph, temporal tiling) equal the one-graph ones
//!   bit for bit.
//! - `wan_vae_video_memory` (with `SD_VAE_MEMORY`): peak memory and time of video decodes
//!   and encodes, streamed one chunk per graph (the default), with temporal tiling, and the
//!   reference's one graph over all frames for comparison. Each case runs in a process of
//!   its own, so its peak RSS (`VmHWM`) is its own; the weights' share is printed too.
//!   `SD_VAE_MEMORY=1 cargo test --release --test vae_wan_video -- --nocapture` runs the
//!   default cases; `SD_VAE_MEMORY=case,case` names cases (`wan21:decode:stream:256x256x17`:
//!   net wan21 / wan22, op decode / encode, mode stream / temporal / graph). Slow: minutes
//!   per case at 256² on two cores.

use stable_diffusion::graph::{Backend, Loaded, Module, Placement};
use stable_diffusion::io::{Component, ModelFiles, SdVersion};
use stable_diffusion::models::vae::{autoencoder_kl::PREFIX, FirstStage, VaeNet, WanVae, WanVaeConfig};
use stable_diffusion::runtime::tiling::TemporalTiles;
use stable_diffusion::pipeline::loader::Weights;
use stable_diffusion::runtime::tiling::TilingParams;
use stable_diffusion::tensor::Tensor;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

mod common;

fn pattern(shape: &[usize], lo: f32, hi: f32, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect();
    Tensor::from_vec(shape, data).unwrap()
}

/// The VAE of `file` loaded on the CPU as the pipeline loads it (names under
/// `first_stage_model.`, every declared tensor checked against the file).
fn load(file: &str, wan22: bool, decode_only: bool) -> (Loaded<WanVae>, usize) {
    let path = common::parity::fixture(file);
    let version = if wan22 { SdVersion::Wan2_2Ti2v } else { SdVersion::Wan2 };
    let mut files = ModelFiles::new();
    files.set_mmap(false);
    files.add(path.to_str().unwrap(), Component::Vae.prefix()).expect("list the VAE file");
    files.convert_names(Some(version));
    let weights = Arc::new(Weights::from_files(files, version, None, ""));
    let in_file = weights.names().count();
    let cfg = WanVaeConfig::detect(&|n| weights.shape_of(n), PREFIX, decode_only, 3, wan22);
    let backend = Arc::new(Backend::cpu().unwrap());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as i32;
    let mut vae = weights
        .load_model(Placement::on(Module::Vae, backend), threads, PREFIX, "VAE", |s| WanVae::new(s, &cfg, &|n| weights.shape_of(n)))
        .expect("load the VAE");
    // As the pipeline configures first stages (float weights).
    vae.runner.options.cpu_winograd = true;
    (vae, in_file)
}

fn check(file: &str, wan22: bool) {
    let (mut vae, in_file) = load(file, wan22, false);
    assert_eq!(vae.store().len(), in_file, "{file}: declared tensors vs the file's");
    let s = vae.model.scale();
    assert_eq!((s, vae.model.cfg.z_dim), if wan22 { (16, 48) } else { (8, 16) });
    let z_dim = vae.model.cfg.z_dim as usize;

    // 5 frames → 2 latent frames → 5 frames in [0, 1].
    let video = pattern(&[2 * s, 2 * s, 5, 3, 1], 0.0, 1.0, 1);
    let plain = TilingParams::default();
    let z = vae.encode_video(&video, &plain, (false, false)).unwrap();
    assert_eq!(z.shape(), &[2, 2, 2, z_dim, 1]);
    assert!(z.data().iter().all(|v| v.is_finite()));
    let out = vae.decode_video(&z, &plain, (false, false), None).unwrap();
    assert_eq!(out.shape(), &[2 * s, 2 * s, 5, 3, 1]);
    assert!(out.data().iter().all(|v| (0.0..=1.0).contains(v)));

    // Streamed = one graph, bit for bit, with the real weights: decode 3 latent frames.
    let zv = pattern(&[2, 2, 3, z_dim], -2.0, 2.0, 2);
    let (model, runner) = (&vae.model, &mut vae.runner);
    let whole = runner.compute(|g| Ok(model.decode_graph(g, g.input(&zv)))).unwrap();
    let bits = |t: &Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for temporal in [false, true] {
        let streamed = model.decode_frames(runner, &zv, temporal, None).unwrap();
        assert!(bits(&streamed) == bits(&whole), "{file}: streamed decode (temporal {temporal}) differs");
    }
    // The encoder runs with ggml's convolution sums (`encode_frames`), so one graph does too.
    let x = pattern(&[2 * s, 2 * s, 9, 3], -1.0, 1.0, 3);
    runner.options.cpu_winograd = false;
    let whole = runner.compute(|g| model.encode_graph(g, g.input(&x))).unwrap();
    runner.options.cpu_winograd = true;
    let streamed = model.encode_frames(runner, &x).unwrap();
    assert!(bits(&streamed) == bits(&whole), "{file}: streamed encode differs");
}

#[test]
fn wan21_vae_video() {
    if std::env::var_os("SD_PARITY").is_none() {
        eprintln!("skipped: set SD_PARITY");
        return;
    }
    check("wan_vae.safetensors", false);
}

#[test]
fn wan22_vae_video() {
    if std::env::var_os("SD_PARITY").is_none() {
        eprintln!("skipped: set SD_PARITY");
        return;
    }
    check("wan22_vae.safetensors", true);
}

const DEFAULT_CASES: &[&str] = &[
    "wan21:decode:stream:64x64x5",
    "wan21:decode:graph:64x64x5",
    "wan21:decode:stream:256x256x17",
    "wan21:decode:temporal:256x256x17",
    "wan21:encode:stream:256x256x17",
];

/// Kibibytes of a `/proc/self/status` field.
fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()))
        .unwrap_or(0)
}

/// Runs one case in this process and prints its line.
fn run_case(case: &str) {
    let parts: Vec<&str> = case.split(':').collect();
    assert_eq!(parts.len(), 4, "case {case}: want net:op:mode:WxHxT");
    let (wan22, op, mode) = (parts[0] == "wan22", parts[1], parts[2]);
    let dims: Vec<usize> = parts[3].split('x').map(|d| d.parse().expect("size")).collect();
    let file = if wan22 { "wan22_vae.safetensors" } else { "wan_vae.safetensors" };
    let (mut vae, _) = load(file, wan22, op == "decode");
    let cfg = vae.model.cfg.clone();
    let weights_kib = status_kib("VmRSS:");
    let s = vae.model.scale();
    let (w, h, t) = (dims[0], dims[1], dims[2]);
    let start = Instant::now();
    let out = if op == "decode" {
        let lt = (t - 1) / 4 + 1;
        let z = pattern(&[w / s, h / s, lt, cfg.z_dim as usize, 1], -1.0, 1.0, 1);
        let (model, runner) = (&vae.model, &mut vae.runner);
        match mode {
            "graph" => runner.compute(|g| Ok(model.decode_graph(g, g.input(&z.clone().reshape(&[w / s, h / s, lt, cfg.z_dim as usize]).unwrap())))),
            _ => model.decode_video(runner, &z, (mode == "temporal").then(TemporalTiles::default), None),
        }
    } else {
        let x = pattern(&[w, h, t, 3, 1], -1.0, 1.0, 2);
        let (model, runner) = (&vae.model, &mut vae.runner);
        match mode {
            "graph" => runner.compute(|g| model.encode_graph(g, g.input(&x.clone().reshape(&[w, h, t, 3]).unwrap()))),
            _ => model.encode_video(runner, &x),
        }
    };
    let secs = start.elapsed().as_secs_f32();
    let out = out.expect("compute");
    assert!(out.data().iter().all(|v| v.is_finite()));
    let peak = status_kib("VmHWM:");
    println!(
        "CASE {case}: out {:?}, peak RSS {:.0} MiB (weights and runtime {:.0} MiB), {secs:.1} s",
        out.shape(),
        peak as f64 / 1024.0,
        weights_kib as f64 / 1024.0
    );
}

#[test]
fn wan_vae_video_memory() {
    let Ok(sel) = std::env::var("SD_VAE_MEMORY") else {
        eprintln!("skipped: set SD_VAE_MEMORY=1 (or cases) to measure");
        return;
    };
    if let Ok(case) = std::env::var("SD_VAE_MEMORY_CASE") {
        run_case(&case);
        return;
    }
    let cases: Vec<String> =
        if sel == "1" { DEFAULT_CASES.iter().map(|s| s.to_string()).collect() } else { sel.split(',').map(str::to_string).collect() };
    for case in cases {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "wan_vae_video_memory", "--nocapture", "--test-threads=1"])
            .env("SD_VAE_MEMORY_CASE", &case)
            .output()
            .expect("run the case");
        let text = String::from_utf8_lossy(&out.stdout);
        match text.lines().find_map(|l| l.find("CASE ").map(|i| &l[i..])) {
            Some(line) => println!("{line}"),
            None => println!("CASE {case}: failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).lines().rev().take(5).collect::<Vec<_>>().join(" | ")),
        }
    }
}
