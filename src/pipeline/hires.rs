//! The hires fix (`sd_hires_params_t`): after the first sampling, every final latent is
//! upscaled (in latent space, or decoded, resized as an image or by an ESRGAN model, and
//! encoded again) and denoised a second time from part way down a longer schedule, like
//! img2img, before the final decode. Works the same for every family; the request checks
//! and the schedule follow the reference.

use super::families::ModelSet;
use super::image::{decode_latent, encode_first_stage, sample_image as sample};
use super::request::{align_up, scheduler_for, Plan, Request, MAX_SIDE};
use super::sampling::{cancelled, Prepared};
use super::imageops::{resize_nearest, resize_nearest_max};
use super::resample::{resize_filtered, resize_nearest_exact, Filter};
use super::upscaler::Upscaler;
use super::callbacks::CancelFlag;
use crate::error::{Error, Result};
use crate::params::{HiresParams, ImgGenParams};
use crate::runtime::rng::{randn_like, GenerationRngs};
use crate::runtime::schedulers;
use crate::runtime::tiling::TilingParams;
use crate::tensor::Tensor;
use crate::types::HiresUpscaler;
use std::time::Instant;

/// Longest schedule the second pass may be cut from (`steps / denoising_strength`).
const MAX_SCHEDULER_STEPS: usize = 1_000_000;

/// A hires fix that will run: the request's parameters after the reference's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Hires {
    pub upscaler: HiresUpscaler,
    pub model_path: String,
    /// Target size in pixels, aligned like the request's size.
    pub width: usize,
    pub height: usize,
    /// Second-pass steps; 0 reuses the first pass's.
    pub steps: usize,
    /// In [0.0001, 1].
    pub denoising_strength: f32,
    pub tile_size: i32,
    /// At least two values, or empty.
    pub custom_sigmas: Vec<f32>,
}

impl Hires {
    /// The upscaler works on the latents (no decoding and encoding again).
    pub fn in_latent_space(&self) -> bool {
        use HiresUpscaler as U;
        matches!(self.upscaler, U::Latent | U::LatentNearest | U::LatentNearestExact | U::LatentAntialiased | U::LatentBicubic | U::LatentBicubicAntialiased)
    }
}

/// The hires fix `h` asks for on a request of `width`×`height` (already aligned), or None
/// when it is off. Like the reference, unusable settings turn it off with a warning
/// (model upscaler without a model, no scale and no target, a target below one pixel);
/// sizes beyond what a generation accepts and a denoising strength that is not a number
/// are errors.
pub fn resolve(h: &HiresParams, width: i32, height: i32, multiple: i32) -> Result<Option<Hires>> {
    if !h.enabled || h.upscaler == HiresUpscaler::None {
        return Ok(None);
    }
    let model_path = h.model_path.clone().unwrap_or_default();
    if h.upscaler == HiresUpscaler::Model && model_path.is_empty() {
        sd_warn!("hires model upscaler requires a model path, disabling hires");
        return Ok(None);
    }
    if h.scale <= 0.0 && h.target_width <= 0 && h.target_height <= 0 {
        sd_warn!("hires scale must be positive when no target size is set, disabling hires");
        return Ok(None);
    }
    let mut custom_sigmas = h.custom_sigmas.clone();
    if custom_sigmas.len() == 1 {
        sd_warn!("hires custom sigmas requires at least two values, ignoring custom sigmas");
        custom_sigmas.clear();
    }
    ensure!(!h.denoising_strength.is_nan(), "hires denoising_strength must be a number, got {}", h.denoising_strength);
    let denoising_strength = h.denoising_strength.clamp(0.0001, 1.0);
    let (tw, th) = match (h.target_width > 0, h.target_height > 0) {
        (true, true) => (h.target_width, h.target_height),
        (true, false) => (h.target_width, h.target_width),
        (false, true) => (h.target_height, h.target_height),
        // `as` saturates where the reference's cast is undefined (NaN → 0, ∞ → i32::MAX).
        (false, false) => ((width as f32 * h.scale).round() as i32, (height as f32 * h.scale).round() as i32),
    };
    if tw <= 0 || th <= 0 {
        sd_warn!("hires target size is not positive, disabling hires");
        return Ok(None);
    }
    ensure!(
        tw <= MAX_SIDE && th <= MAX_SIDE,
        "hires target size {tw}x{th} is not supported (each side must be at most {MAX_SIDE}; scale {}, request {width}x{height})",
        h.scale
    );
    let (aw, ah) = (align_up(tw, multiple), align_up(th, multiple));
    if (aw, ah) != (tw, th) {
        sd_warn!("align hires target up {tw}x{th} to {aw}x{ah} (multiple={multiple})");
    }
    Ok(Some(Hires {
        upscaler: h.upscaler,
        model_path,
        width: aw as usize,
        height: ah as usize,
        steps: h.steps.max(0) as usize,
        denoising_strength,
        tile_size: h.upscale_tile_size,
        custom_sigmas,
    }))
}

/// The length of the full schedule and the index of its first sigma the second pass uses:
/// `steps / strength` steps (so that cutting by the strength leaves about `steps`, as
/// sd-webui does), `t_enc = total · strength` (at most `total - 1`).
pub fn schedule_cut(steps: usize, denoising_strength: f32) -> (usize, usize) {
    let total = ((steps.max(1) as f32 / denoising_strength) as usize).max(1);
    let t_enc = ((total as f32 * denoising_strength) as usize).min(total - 1);
    (total, total - t_enc - 1)
}

/// The second pass's sigmas (the custom ones as given, or the tail of a longer schedule)
/// and the length of the schedule they come from.
fn sigmas(ms: &mut ModelSet, hires: &Hires, p: &ImgGenParams, r: &Request, plan: &Plan) -> Result<(Vec<f32>, usize)> {
    if !hires.custom_sigmas.is_empty() {
        let s = schedulers::custom_sigmas(&hires.custom_sigmas).map_err(|e| Error::new(format!("hires {e}")))?;
        let n = s.len() - 1;
        return Ok((s, n));
    }
    let steps = if hires.steps > 0 { hires.steps } else { plan.sample_steps };
    let (total, start) = schedule_cut(steps, hires.denoising_strength);
    ensure!(
        total <= MAX_SCHEDULER_STEPS,
        "hires schedule of {total} steps ({steps} steps / denoising strength {}) is too long (at most {MAX_SCHEDULER_STEPS})",
        hires.denoising_strength
    );
    let scheduler = scheduler_for(ms, &p.sample_params, plan.method);
    let scale = ms.spec.latent.vae_scale;
    let seq_len = ((hires.height / scale) * (hires.width / scale)) as i32;
    let family = ms.family();
    let all = ms.denoiser.get_sigmas(total as u32, seq_len, scheduler, family, &r.extra)?;
    let start = start.min(all.len().saturating_sub(2));
    Ok((all[start..].to_vec(), total))
}

/// One final latent → the second pass's starting latent at the target size.
#[allow(clippy::too_many_arguments)]
fn upscale(
    ms: &mut ModelSet,
    latent: &Tensor,
    hires: &Hires,
    model: Option<&mut Upscaler>,
    tiling: &TilingParams,
    circular: (bool, bool),
    rngs: &mut GenerationRngs,
    cancel: &CancelFlag,
) -> Result<Tensor> {
    if cancel.stop_now() {
        sd_error!("cancelling hires latent upscale");
        return Err(cancelled());
    }
    let name = hires.upscaler.name();
    let (tw, th) = (hires.width, hires.height);
    let latent_filter = match hires.upscaler {
        HiresUpscaler::Latent => Some((Some(Filter::Bilinear), false)),
        HiresUpscaler::LatentNearest | HiresUpscaler::LatentNearestExact => Some((None, false)),
        HiresUpscaler::LatentAntialiased => Some((Some(Filter::Bilinear), true)),
        HiresUpscaler::LatentBicubic => Some((Some(Filter::Bicubic), false)),
        HiresUpscaler::LatentBicubicAntialiased => Some((Some(Filter::Bicubic), true)),
        _ => None,
    };
    if let Some((filter, antialias)) = latent_filter {
        let scale = ms.spec.latent.vae_scale;
        let (lw, lh) = (tw / scale, th / scale);
        sd_info!("hires {name} upscale {}x{} -> {lw}x{lh}", latent.ne(0), latent.ne(1));
        return match filter {
            Some(f) => resize_filtered(latent, lw, lh, f, antialias),
            None if hires.upscaler == HiresUpscaler::LatentNearestExact => resize_nearest_exact(latent, lw, lh),
            None => resize_nearest(latent, &[lw, lh, latent.ne(2), latent.ne(3)]),
        };
    }

    let fs = ms.first_stage.as_mut();
    fs.begin()?;
    let decoded = decode_latent(fs, latent, tiling, circular);
    fs.end();
    let decoded = decoded.map_err(|e| Error::new(format!("decode_first_stage failed before hires {name} upscale: {e}")))?;
    if cancel.stop_now() {
        sd_error!("cancelling hires image upscale");
        return Err(cancelled());
    }
    let (c, n) = (decoded.ne(2), decoded.ne(3));
    let image = match (hires.upscaler, model) {
        (HiresUpscaler::Model, Some(model)) => {
            let up = model.upscale_tensor(&decoded).map_err(|e| Error::new(format!("hires model upscale failed: {e}")))?;
            if (up.ne(0), up.ne(1)) == (tw, th) {
                up
            } else {
                resize_nearest(&up, &[tw, th, up.ne(2), up.ne(3)])?
            }
        }
        (HiresUpscaler::Model, None) => bail!("hires model upscaler context is null"),
        (u, _) => {
            sd_info!("hires {name} image upscale {}x{} -> {tw}x{th}", decoded.ne(0), decoded.ne(1));
            let up = if u == HiresUpscaler::Lanczos {
                resize_filtered(&decoded, tw, th, Filter::Lanczos, false)?
            } else {
                resize_nearest(&decoded, &[tw, th, c, n])?
            };
            up.map(|v| v.clamp(0.0, 1.0))
        }
    };
    if cancel.stop_now() {
        sd_error!("cancelling hires latent encode");
        return Err(cancelled());
    }
    encode_first_stage(ms.first_stage.as_mut(), &image, tiling, circular, rngs.noise())
        .map_err(|e| Error::new(format!("encode_first_stage failed after hires {name} upscale: {e}")))
}

/// The second pass over every final latent of a batch (image `b` reseeded with seed + b,
/// as its first pass was); returns the latents to decode.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    ms: &mut ModelSet,
    hires: &Hires,
    p: &ImgGenParams,
    r: &Request,
    plan: &Plan,
    prepared: &mut Prepared,
    latents: Vec<Tensor>,
    tiling: &TilingParams,
    circular: (bool, bool),
    rngs: &mut GenerationRngs,
    cancel: &CancelFlag,
) -> Result<Vec<Tensor>> {
    if cancel.stop_now() {
        sd_error!("cancelling generation before hires fix");
        return Err(cancelled());
    }
    sd_info!("hires fix: upscaling to {}x{}", hires.width, hires.height);
    let mut model = None;
    if hires.upscaler == HiresUpscaler::Model {
        sd_info!("hires fix: loading model upscaler from '{}'", hires.model_path);
        let up = Upscaler::load_on(&hires.model_path, &ms.devices, ms.n_threads, hires.tile_size, false)
            .map_err(|e| Error::new(format!("load hires model upscaler failed: {e}")))?;
        model = Some(up);
    }
    let (sigmas, total) = sigmas(ms, hires, p, r, plan)?;
    sd_info!(
        "hires fix: scheduler_steps={total}, denoising_strength={:.2}, sigma_sched_size={}{}",
        hires.denoising_strength,
        sigmas.len(),
        if hires.custom_sigmas.is_empty() { "" } else { ", custom_sigmas=true" }
    );
    let second = Plan { method: plan.method, sample_steps: sigmas.len() - 1, sigmas, eta: plan.eta };
    let mask = prepared.denoise_mask.clone().unwrap_or_else(|| Tensor::full(&[prepared.init_latent.ne(0), prepared.init_latent.ne(1), 1, 1], 1.0));

    let start = Instant::now();
    let mut out = Vec::with_capacity(latents.len());
    for (b, latent) in latents.iter().enumerate() {
        if cancel.stop_now() {
            sd_error!("cancelling generation during hires fix");
            return Err(cancelled());
        }
        rngs.manual_seed(r.seed.wrapping_add(b as i64) as u64);
        let upscaled = upscale(ms, latent, hires, model.as_mut(), tiling, circular, rngs, cancel)?;
        let (lw, lh) = (upscaled.ne(0), upscaled.ne(1));
        let conds = [Some(&prepared.cond), prepared.uncond.as_ref(), prepared.img_uncond.as_ref()];
        if let Some(c) = conds.into_iter().flatten().filter_map(|c| c.concat.as_ref()).find(|&c| (c.ne(0), c.ne(1)) != (lw, lh)) {
            bail!(
                "the hires fix is not supported with {}: its image latents (concatenated channels) are {}x{}, the upscaled latent {lw}x{lh}",
                ms.version.name(),
                c.ne(0),
                c.ne(1)
            );
        }
        let noise = randn_like(&upscaled, rngs.noise());
        prepared.denoise_mask = Some(resize_nearest_max(&mask, &[lw, lh, mask.ne(2), mask.ne(3)])?);
        prepared.init_latent = upscaled;
        let t = Instant::now();
        let x0 = sample(ms, prepared, &noise, r, &second, tiling, circular, rngs.sampler(), cancel)
            .map_err(|e| Error::new(format!("hires sampling for image {}/{} failed: {e}", b + 1, latents.len())))?;
        sd_info!("hires sampling {}/{} completed, taking {:.2}s", b + 1, latents.len(), t.elapsed().as_secs_f32());
        out.push(x0);
    }
    sd_info!("hires fix completed, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut HiresParams)) -> HiresParams {
        let mut h = HiresParams { enabled: true, ..Default::default() };
        f(&mut h);
        h
    }

    fn size(h: &HiresParams, w: i32, ht: i32) -> Option<(usize, usize)> {
        resolve(h, w, ht, 64).unwrap().map(|r| (r.width, r.height))
    }

    #[test]
    fn target_size_from_scale_or_sides() {
        assert_eq!(size(&params(|_| {}), 64, 64), Some((128, 128)));
        // round(96 · 1.5) = 144 → aligned up to 192; round(64 · 1.5) = 96 → 128.
        assert_eq!(size(&params(|h| h.scale = 1.5), 96, 64), Some((192, 128)));
        // Half rounds away from zero: 64 · 1.0078125 = 64.5 → 65 → 128.
        assert_eq!(resolve(&params(|h| h.scale = 1.0078125), 64, 64, 1).unwrap().map(|r| r.width), Some(65));
        // One side given: square; both: as given; the scale is then ignored (even when ≤ 0).
        assert_eq!(size(&params(|h| h.target_width = 256), 64, 64), Some((256, 256)));
        assert_eq!(size(&params(|h| h.target_height = 192), 64, 64), Some((192, 192)));
        assert_eq!(size(&params(|h| (h.target_width, h.target_height, h.scale) = (320, 128, -1.0)), 64, 64), Some((320, 128)));
        assert_eq!(size(&params(|h| (h.target_width, h.target_height) = (100, 0)), 64, 64), Some((128, 128)));
    }

    #[test]
    fn defaults_and_clamps() {
        let r = resolve(&params(|h| (h.steps, h.denoising_strength) = (-3, 7.0)), 64, 64, 8).unwrap().unwrap();
        assert_eq!((r.steps, r.denoising_strength, r.upscaler, r.tile_size), (0, 1.0, HiresUpscaler::Latent, 128));
        let r = resolve(&params(|h| h.denoising_strength = -1.0), 64, 64, 8).unwrap().unwrap();
        assert_eq!(r.denoising_strength, 0.0001);
        let r = resolve(&params(|h| h.custom_sigmas = vec![1.0]), 64, 64, 8).unwrap().unwrap();
        assert!(r.custom_sigmas.is_empty());
    }

    #[test]
    fn unusable_settings_turn_it_off_and_bad_values_are_errors() {
        // Off, none, model without a path, no scale and no target, a sub-pixel target.
        assert_eq!(size(&params(|h| h.enabled = false), 64, 64), None);
        assert_eq!(size(&params(|h| h.upscaler = HiresUpscaler::None), 64, 64), None);
        assert_eq!(size(&params(|h| h.upscaler = HiresUpscaler::Model), 64, 64), None);
        assert_eq!(size(&params(|h| (h.upscaler, h.model_path) = (HiresUpscaler::Model, Some(String::new()))), 64, 64), None);
        assert_eq!(size(&params(|h| h.scale = -2.0), 64, 64), None);
        assert_eq!(size(&params(|h| h.scale = 0.0), 64, 64), None);
        assert_eq!(size(&params(|h| h.scale = 0.001), 64, 64), None);
        assert_eq!(size(&params(|h| h.scale = f32::NAN), 64, 64), None);
        assert_eq!(size(&params(|h| (h.target_width, h.target_height) = (-5, -5)), 64, 64), Some((128, 128)));
        assert_eq!(size(&params(|h| (h.target_width, h.target_height, h.scale) = (0, -5, -1.0)), 64, 64), None);
        // Too large, and not a number: errors naming the value.
        let err = |h: HiresParams| resolve(&h, 64, 64, 64).unwrap_err().to_string();
        assert!(err(params(|h| h.scale = 1000.0)).contains("64000x64000"));
        assert!(err(params(|h| h.scale = f32::INFINITY)).contains("not supported"));
        assert!(err(params(|h| h.target_width = 20000)).contains("20000x20000"));
        assert!(err(params(|h| h.denoising_strength = f32::NAN)).contains("denoising_strength"));
        let m = resolve(&params(|h| (h.upscaler, h.model_path) = (HiresUpscaler::Model, Some("x.pth".into()))), 64, 64, 64).unwrap();
        assert_eq!(m.map(|m| m.model_path), Some("x.pth".into()));
    }

    #[test]
    fn schedule_is_cut_like_sd_webui() {
        // steps / strength total steps, starting t_enc = total · strength from the end.
        assert_eq!(schedule_cut(3, 0.5), (6, 2));
        assert_eq!(schedule_cut(3, 0.3), (10, 6));
        assert_eq!(schedule_cut(4, 1.0), (4, 0));
        assert_eq!(schedule_cut(20, 0.7), (28, 8));
        // At least one step; 1 / 0.0001 and 10000 · 0.0001 round to 10000 and 1 in f32.
        assert_eq!(schedule_cut(0, 0.0001), (10000, 9998));
        assert_eq!(schedule_cut(1, 0.9), (1, 0));
    }
}
