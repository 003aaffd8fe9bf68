//! Benchmark runner for libstable-diffusion, through its Rust API (`stable_diffusion::api`)
//! with the same callbacks the C API installs. Prints one JSON report on stdout; see
//! `sd_bench_common`.

use sd_bench_common::{self as common, Job, Outcome, Picture};
use stable_diffusion::api::{self, Context, CtxParams, Image, ImgGenParams, SampleMethod, SdType, UpscalerContext, UpscalerParams};
use stable_diffusion::pipeline::callbacks;
use stable_diffusion::types::LogLevel;
use std::process::ExitCode;
use std::sync::Arc;

const SIDE: &str = if cfg!(feature = "native") {
    "ours-native"
} else if cfg!(feature = "vulkan") {
    "ours-vulkan"
} else if cfg!(feature = "rpc") {
    "ours-rpc"
} else {
    "ours"
};

/// Where the `ours-vulkan` / `ours-rpc` sides compute: the first Vulkan device (lavapipe is
/// listed only when asked for by index), or this machine's CPU served by ggml's RPC server
/// on a loopback port in a thread of this process (the cost of the protocol and the copies
/// over TCP, not of a second machine).
fn device_setup(cp: &mut CtxParams, threads: i32) -> Result<(), String> {
    if cfg!(feature = "vulkan") {
        cp.backend = Some("vulkan".into());
    } else if cfg!(feature = "rpc") {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let endpoint = format!("127.0.0.1:{port}");
        let ep = endpoint.clone();
        std::thread::spawn(move || stable_diffusion::graph::devices::serve_rpc(&ep, &["CPU".to_string()], threads.max(1) as usize, None));
        let start = std::time::Instant::now();
        while stable_diffusion::graph::devices::probe_rpc_server(&endpoint).is_err() {
            if start.elapsed().as_secs() > 60 {
                return Err(format!("the RPC server on {endpoint} did not start"));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        cp.rpc_servers = Some(endpoint);
        cp.backend = Some("rpc".into());
    }
    Ok(())
}

/// An ESRGAN upscale of the test image (`job.upscale_model`).
fn run_upscale(job: &Job) -> Result<Outcome<'static>, String> {
    let params = UpscalerParams {
        esrgan_path: job.upscale_model.clone(),
        direct: false,
        n_threads: job.threads,
        tile_size: job.tile_size,
        backend: None,
        params_backend: None,
    };
    let (load_s, up) = common::timed(|| UpscalerContext::new(&params));
    let up = up.map_err(|e| format!("new_upscaler_ctx: {e}"))?;
    let (w, h) = (job.width as u32, job.height as u32);
    let input = Image { width: w, height: h, channels: 3, data: common::test_image(w, h) };
    common::set_generating(true);
    let (upscale_s, result) = common::timed(|| up.upscale(&input, 4));
    common::set_generating(false);
    let mut outcome = outcome(load_s);
    outcome.generate_s = Some(upscale_s);
    match result {
        Ok(img) => outcome.picture = Some(picture(img)),
        Err(e) => outcome.error = Some(format!("upscale: {e}")),
    }
    Ok(outcome)
}

fn outcome(load_s: f64) -> Outcome<'static> {
    Outcome {
        side: SIDE,
        version: format!("{} ({})", api::version(), api::commit()),
        system_info: stable_diffusion::graph::backend::system_info(),
        load_s,
        generate_s: None,
        picture: None,
        error: None,
    }
}

fn picture(img: Image) -> Picture<'static> {
    let data: &'static [u8] = Box::leak(img.data.into_boxed_slice());
    Picture { width: img.width, height: img.height, channels: img.channels, data }
}

fn run(job: &Job) -> Result<Outcome<'static>, String> {
    stable_diffusion::log::set_sink(Some(Arc::new(|level: LogLevel, text: &str| {
        let level = match level {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        };
        common::on_log(level, text);
    })));
    callbacks::set_progress(Some(Arc::new(common::on_progress)));
    if job.is_upscale() {
        return run_upscale(job);
    }

    let mut cp = CtxParams {
        model_path: Some(job.model.clone()).filter(|m| !m.is_empty()),
        n_threads: job.threads,
        enable_mmap: job.mmap,
        flash_attn: job.flash_attn,
        model_args: job.fast.then(|| "fast=1".to_string()),
        ..CtxParams::default()
    };
    for (key, path) in &job.components {
        let slot = common::component_slot(key, sd_bench_common::component_slots!(cp))?;
        *slot = Some(path.clone());
    }
    device_setup(&mut cp, job.threads)?;
    if !job.wtype.is_empty() {
        cp.wtype = Some(SdType::parse(&job.wtype).ok_or_else(|| format!("unknown weight type {:?}", job.wtype))?);
    }
    let (load_s, ctx) = common::timed(|| Context::new(&cp));
    let ctx = ctx.map_err(|e| format!("loading: {e}"))?;
    let mut outcome = outcome(load_s);
    let method = SampleMethod::parse(&job.sampler).ok_or_else(|| format!("unknown sampler {:?}", job.sampler))?;
    let mut gp = ImgGenParams {
        prompt: job.prompt.clone(),
        negative_prompt: job.negative_prompt.clone(),
        width: job.width,
        height: job.height,
        seed: job.seed,
        batch_count: 1,
        ..ImgGenParams::default()
    };
    gp.sample_params.sample_steps = job.steps;
    gp.sample_params.guidance.txt_cfg = job.cfg;
    gp.sample_params.sample_method = Some(method);
    gp.sample_params.scheduler = Some(ctx.default_scheduler(Some(method)));

    common::set_generating(true);
    let (generate_s, images) = common::timed(|| ctx.generate_image(&gp));
    common::set_generating(false);
    outcome.generate_s = Some(generate_s);
    match images {
        Ok(images) if !images.is_empty() => {
            outcome.picture = Some(picture(images.into_iter().next().expect("checked non-empty")));
        }
        Ok(_) => outcome.error = Some("generate_image returned no image".into()),
        Err(e) => outcome.error = Some(format!("generate_image: {e}")),
    }
    Ok(outcome)
}

fn main() -> ExitCode {
    if cfg!(feature = "vulkan") && std::env::var_os("GGML_VK_VISIBLE_DEVICES").is_none() {
        // Before any thread or ggml exists: lists lavapipe too (ggml hides CPU-type devices).
        std::env::set_var("GGML_VK_VISIBLE_DEVICES", "0");
    }
    common::runner_main(SIDE, run)
}
