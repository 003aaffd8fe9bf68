//! LTX-2.3's latent-upscale refine pass (`hires` of `generate_video`, as the reference runs
//! it): the sampled video latent is un-normalised with the VAE's statistics, doubled in
//! space by the latent upsampler (`hires.model_path`, `models/upscaler/ltx_latent.rs`),
//! normalised again, the audio packed behind it as before; the start and end pictures are
//! encoded again at the new size and kept (mask 0); new noise, and a third sampling stage from
//! the tail of a longer schedule (`hires.steps / hires.denoising_strength` steps cut by the
//! strength, as sd-webui's hires fix), or the hires custom sigmas.

use super::families::ModelSet;
use super::request::scheduler_for;
use super::video::{frame_range, frame_tensor, mask_with_audio, one_frame, put_frame, with_first_stage};
use crate::error::{Context as _, Error, Result};
use crate::graph::Module;
use crate::models::upscaler::ltx_latent::{LtxUpsampler, LtxUpsamplerConfig};
use super::hires::Hires;
use crate::params::{SampleParams, VidGenParams};
use crate::runtime::args::ExtraArgs;
use crate::runtime::schedulers;
use crate::runtime::tiling::TilingParams;
use crate::tensor::Tensor;
use crate::types::{HiresUpscaler, SampleMethod};

/// The VAE's per-channel statistics the latents are normalised with.
const STD: &str = "first_stage_model.per_channel_statistics.std-of-means";
const MEAN: &str = "first_stage_model.per_channel_statistics.mean-of-means";
/// Schedules longer than this are refused (a tiny strength would ask for millions of steps).
const MAX_SCHEDULER_STEPS: usize = 10_000;

/// What the reference refuses of a hires fix that resolved to run.
pub(super) fn check(h: &Hires) -> Result<()> {
    ensure!(h.upscaler == HiresUpscaler::Model, "LTX latent spatial upscale currently requires hires upscaler MODEL");
    ensure!(!h.model_path.is_empty(), "LTX latent spatial upscale is enabled but hires model path was not provided");
    Ok(())
}

/// `[W, H, T, C, 1]` with `video` channels of video, the rest packed audio → (video, the
/// audio's `audio_values` values).
fn unpack(latent: &Tensor, video: usize, audio_values: usize) -> Result<(Tensor, Vec<f32>)> {
    let (w, h, t) = (latent.ne(0), latent.ne(1), latent.ne(2));
    let n = w * h * t * video;
    ensure!(latent.len() >= n + audio_values, "the latent {:?} holds no {audio_values} audio values", latent.shape());
    let v = Tensor::from_vec(&[w, h, t, video, 1], latent.data()[..n].to_vec())?;
    Ok((v, latent.data()[n..n + audio_values].to_vec()))
}

/// The audio's values behind `video` `[W, H, T, C, 1]`, zero-padded to whole channels.
fn pack(video: Tensor, audio: &[f32]) -> Result<Tensor> {
    if audio.is_empty() {
        return Ok(video);
    }
    let (w, h, t, c) = (video.ne(0), video.ne(1), video.ne(2), video.ne(3));
    let extra = audio.len().div_ceil(w * h * t);
    let mut d = video.data().to_vec();
    d.extend_from_slice(audio);
    d.resize(w * h * t * (c + extra), 0.0);
    Tensor::from_vec(&[w, h, t, c + extra, 1], d)
}

/// The packed `latent` with its audio `[bins, from steps, channels]` cut or zero-padded to
/// `to` steps (per channel).
pub(super) fn resize_audio(latent: &Tensor, video: usize, bins: usize, channels: usize, from: usize, to: usize) -> Result<Tensor> {
    let (v, audio) = unpack(latent, video, bins * from * channels)?;
    pack(v, &resize_steps(&audio, bins, channels, from, to))
}

/// Audio `[bins, from, channels]` → `[bins, to, channels]`: the common steps copied, zeros after.
fn resize_steps(audio: &[f32], bins: usize, channels: usize, from: usize, to: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; bins * to * channels];
    let keep = from.min(to) * bins;
    for c in 0..channels {
        out[c * to * bins..c * to * bins + keep].copy_from_slice(&audio[c * from * bins..c * from * bins + keep]);
    }
    out
}

/// The sampled packed latent → the upscaled packed latent.
pub(super) fn upscale(ms: &mut ModelSet, path: &str, latent: &Tensor, audio_values: usize) -> Result<Tensor> {
    let channels = ms.spec.latent.channels;
    let (video, audio) = unpack(latent, channels, audio_values)?;
    sd_info!("LTX latent spatial upscale: latent {}x{}x{}x{} -> model output", video.ne(0), video.ne(1), video.ne(2), video.ne(3));
    let stats = |name: &str| ms.weights.read_f32(name).ok().filter(|v| v.len() == channels);
    let (Some(std), Some(mean)) = (stats(STD), stats(MEAN)) else {
        bail!("LTX latent un-normalization requires LTX video VAE (its per_channel_statistics)")
    };
    let plane = video.ne(0) * video.ne(1) * video.ne(2);
    let per_channel = |x: &Tensor, f: &dyn Fn(f32, usize) -> f32| -> Result<Tensor> {
        let d = x.data().iter().enumerate().map(|(i, &v)| f(v, i / plane)).collect();
        Tensor::from_vec(&[x.ne(0), x.ne(1), x.ne(2), channels], d)
    };
    let raw = per_channel(&video, &|v, c| v * std[c] + mean[c])?;
    let weights = std::sync::Arc::new(crate::pipeline::loader::Weights::open_file(path, ms.version).with_context(|| format!("init LTX latent upsampler model loader from file failed: '{path}'"))?);
    let cfg = LtxUpsamplerConfig::detect(weights.names(), &|n| weights.shape_of(n)).context("init LTX latent upsampler from metadata failed")?;
    ensure!(cfg.in_channels as usize == channels, "LTX latent upsampler expected {} channels, got {channels}", cfg.in_channels);
    let placement = ms.devices.placement(Module::Upscaler)?;
    let mut net = weights
        .load_model(placement, ms.n_threads, "", "LTX latent upsampler", |s| LtxUpsampler::new(s, &cfg))
        .context("register LTX latent upsampler tensors with model manager failed")?;
    // Exact sums (no Winograd): the result is sampled again.
    net.runner.options.cpu_winograd = false;
    let (model, runner) = net.parts();
    let ne = [raw.ne(0) as i64, raw.ne(1) as i64, raw.ne(2) as i64, channels as i64];
    let up = runner.compute(|g| Ok(model.forward(g, g.input_f32(raw.data(), &ne))))?;
    let plane = up.ne(0) * up.ne(1) * up.ne(2);
    let d = up.data().iter().enumerate().map(|(i, &v)| (v - mean[i / plane]) / std[i / plane]).collect();
    let normalised = Tensor::from_vec(&[up.ne(0), up.ne(1), up.ne(2), channels, 1], d)?;
    pack(normalised, &audio)
}

/// The start and end pictures encoded again at the upscaled size into `latent` (packed),
/// kept there (mask 0); the mask (packed with ones for the audio) when there are pictures.
/// `target`: the video's latent frames (an end picture's keyframe sits behind them).
#[allow(clippy::too_many_arguments)]
pub(super) fn condition(
    ms: &mut ModelSet,
    p: &VidGenParams,
    latent: Tensor,
    frames: usize,
    target: usize,
    audio_values: usize,
    tiling: &TilingParams,
    circular: (bool, bool),
) -> Result<(Tensor, Option<Tensor>)> {
    if p.init_image.is_none() && p.end_image.is_none() {
        return Ok((latent, None));
    }
    let channels = ms.spec.latent.channels;
    let (mut video, audio) = unpack(&latent, channels, audio_values)?;
    let (lw, lh, lt) = (video.ne(0), video.ne(1), video.ne(2));
    let scale = ms.spec.latent.vae_scale;
    let (width, height) = (lw * scale, lh * scale);
    let mut mask = Tensor::full(&[lw, lh, lt, 1, 1], 1.0);
    let mut put = |image: &crate::image::Image, at: usize, what: &str, video: &mut Tensor, mask: &mut Tensor| -> Result<()> {
        let picture = frame_tensor(image, width, height)?;
        let enc = with_first_stage(ms, |fs| fs.encode_video(&one_frame(&picture)?, tiling, circular))
            .map_err(|e| Error::new(format!("failed to encode LTXAV {what} image: {e}")))?;
        ensure!(
            (enc.ne(0), enc.ne(1), enc.ne(3)) == (lw, lh, channels) && at + enc.ne(2) <= lt,
            "invalid LTXAV {what} condition latent shape: {:?} at latent frame {at} of {lw}x{lh}x{lt}",
            enc.shape()
        );
        for f in 0..enc.ne(2) {
            put_frame(video, &frame_range(&enc, f, f + 1)?, at + f)?;
            put_frame(mask, &Tensor::zeros(&[lw, lh, 1, 1, 1]), at + f)?;
        }
        Ok(())
    };
    if let Some(image) = &p.init_image {
        put(image, 0, "init", &mut video, &mut mask)?;
    }
    if let Some(image) = &p.end_image {
        let at = if frames == 1 { 0 } else { target };
        ensure!(frames == 1 || lt > target, "LTXV FLF2V refine conditioning requires low-resolution keyframe conditioning metadata");
        put(image, at, "end", &mut video, &mut mask)?;
    }
    sd_info!("LTXV refine image conditioning applied at {width}x{height}");
    let latent = pack(video, &audio)?;
    let extra = latent.ne(3) - channels;
    let mask = if extra > 0 { mask_with_audio(&mask, channels, extra)? } else { mask };
    Ok((latent, Some(mask)))
}

/// The refine stage's sigmas: the hires custom sigmas, or the tail of a schedule of
/// `steps / strength` steps (`steps`: `hires.steps`, else the request's) over `seq_len`
/// tokens.
pub(super) fn sigmas(ms: &mut ModelSet, h: &Hires, sp: &SampleParams, method: SampleMethod, default_steps: usize, seq_len: i32) -> Result<Vec<f32>> {
    if !h.custom_sigmas.is_empty() {
        return schedulers::custom_sigmas(&h.custom_sigmas).map_err(|e| Error::new(format!("hires {e}")));
    }
    let steps = if h.steps > 0 { h.steps } else { default_steps };
    let (total, start) = super::hires::schedule_cut(steps, h.denoising_strength);
    ensure!(total <= MAX_SCHEDULER_STEPS, "hires schedule of {total} steps ({steps} steps / denoising strength {}) is too long", h.denoising_strength);
    let scheduler = scheduler_for(ms, sp, method);
    let family = ms.family();
    let extra = ExtraArgs::parse(sp.extra_sample_args.as_deref());
    let all = ms.denoiser.get_sigmas(total as u32, seq_len, scheduler, family, &extra)?;
    sd_info!(
        "LTX latent spatial upscale refine: scheduler_steps={total}, denoising_strength={:.2}, sampler={}, sigma_sched_size={}",
        h.denoising_strength,
        method.name(),
        all.len() - start.min(all.len())
    );
    Ok(all[start.min(all.len().saturating_sub(2))..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The audio rides behind the video's channels, zero-padded to whole channels, and comes
    /// back out unchanged.
    #[test]
    fn audio_is_packed_behind_the_video_and_back() {
        let video = Tensor::from_vec(&[2, 1, 1, 2, 1], vec![1., 2., 3., 4.]).unwrap();
        let packed = pack(video.clone(), &[9., 8., 7.]).unwrap();
        assert_eq!(packed.shape(), &[2, 1, 1, 4, 1]);
        assert_eq!(packed.data(), &[1., 2., 3., 4., 9., 8., 7., 0.]);
        let (v, a) = unpack(&packed, 2, 3).unwrap();
        assert_eq!((v.data(), &a[..]), (video.data(), &[9., 8., 7.][..]));
        assert!(unpack(&packed, 2, 5).is_err());
        assert_eq!(pack(video.clone(), &[]).unwrap().data(), video.data());
        // Two channels of 2 bins × 2 steps, to 3 steps and to 1.
        let a = [1., 2., 3., 4., 5., 6., 7., 8.];
        assert_eq!(resize_steps(&a, 2, 2, 2, 3), vec![1., 2., 3., 4., 0., 0., 5., 6., 7., 8., 0., 0.]);
        assert_eq!(resize_steps(&a, 2, 2, 2, 1), vec![1., 2., 5., 6.]);
    }
}
