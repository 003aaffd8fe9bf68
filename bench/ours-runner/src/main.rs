//! Benchmark runner for libstable-diffusion, through its Rust API (`stable_diffusion::api`)
//! with the same callbacks the C API installs. Prints one JSON report on stdout; see
//! `sd_bench_common`.

use sd_bench_common::{self as common, Job, Outcome, Picture};
use stable_diffusion::api::{self, Context, CtxParams, Image, ImgGenParams, SampleMethod, SdType, UpscalerContext, UpscalerParams};
use stable_diffusion::pipeline::callbacks;
use stable_diffusion::types::LogLevel;
use std::process::ExitCode;
use std::sync::Arc;

const SIDE: &str = if cfg!(feature = "native") { "ours-native" } else { "ours" };

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
        model_path: Some(job.model.clone()),
        n_threads: job.threads,
        enable_mmap: job.mmap,
        ..CtxParams::default()
    };
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
    common::runner_main(SIDE, run)
}
