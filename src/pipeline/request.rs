//! A request after the reference's adjustments (sizes aligned to what the family needs, the
//! seed drawn, guidance and timestep shifting resolved) and the sampling plan (sampler,
//! schedule, eta), for pictures and videos alike.

use super::families::ModelSet;
use super::ref_images::RefImageParams;
use crate::error::Result;
use crate::params::{CacheParams, GuidanceParams, ImgGenParams, SampleParams, TilingParams as ApiTiling};
use crate::runtime::args::ExtraArgs;
use crate::runtime::defaults::{default_sample_method, default_scheduler, resolve_eta, unset_if_infinite};
use crate::runtime::rng::resolve_seed;
use crate::runtime::schedulers;
use crate::runtime::tiling::{TemporalTiles, TilingParams};
use crate::types::{SampleMethod, Scheduler};

/// Largest side accepted (before alignment).
pub(super) const MAX_SIDE: i32 = 16384;

/// The request after the reference's adjustments.
pub(super) struct Request {
    pub(super) width: usize,
    pub(super) height: usize,
    pub(super) seed: i64,
    pub(super) guidance: GuidanceParams,
    pub(super) use_uncond: bool,
    pub(super) use_img_uncond: bool,
    pub(super) shifted_timestep: i32,
    /// `extra_sample_args`, parsed once.
    pub(super) extra: ExtraArgs,
    /// `ref_image_args` over the family's preset, parsed once.
    pub(super) refs: RefImageParams,
    pub(super) cache: CacheParams,
    pub(super) control_strength: f32,
    /// Layers of a layered family's latent beyond the first (`qwen_image_layers`, at least 0).
    pub(super) layers: usize,
}

impl Request {
    /// What the sampling loop reads of a video request: no reference images, ControlNet or
    /// layers; guidance, sampler and timestep shift come per stage.
    pub(super) fn for_video(seed: i64, cache: &CacheParams) -> Request {
        Request {
            width: 0,
            height: 0,
            seed,
            guidance: GuidanceParams::default(),
            use_uncond: false,
            use_img_uncond: false,
            shifted_timestep: 0,
            extra: ExtraArgs::default(),
            refs: RefImageParams::default(),
            cache: cache.clone(),
            control_strength: 0.0,
            layers: 0,
        }
    }

    /// Latent pixels of one frame: the sequence length flow schedules shift by.
    pub(super) fn seq_len(&self, ms: &ModelSet) -> i32 {
        let scale = ms.spec.latent.vae_scale;
        ((self.width / scale) * (self.height / scale)) as i32
    }
}

/// Sampler, schedule and eta.
pub(super) struct Plan {
    pub(super) method: SampleMethod,
    pub(super) sample_steps: usize,
    pub(super) sigmas: Vec<f32>,
    pub(super) eta: f32,
}


pub(super) fn check_params(p: &ImgGenParams) -> Result<()> {
    ensure!(
        (1..=MAX_SIDE).contains(&p.width) && (1..=MAX_SIDE).contains(&p.height),
        "image size {}x{} is not supported (each side must be 1 to {MAX_SIDE})",
        p.width,
        p.height
    );
    ensure!((1..=10000).contains(&p.batch_count), "batch_count must be 1 to 10000, got {}", p.batch_count);
    ensure!(
        !p.sample_params.custom_sigmas.is_empty() || p.sample_params.sample_steps >= 1,
        "sample_steps must be at least 1, got {}",
        p.sample_params.sample_steps
    );
    ensure!(p.sample_params.sample_steps <= 10000, "sample_steps {} is too large", p.sample_params.sample_steps);
    ensure!(
        p.init_image.is_none() || p.strength.is_finite() && p.strength >= 0.0,
        "strength must be a number of at least 0, got {}",
        p.strength
    );
    ensure!(p.sample_params.guidance.txt_cfg.is_finite(), "cfg scale must be a finite number");
    let images = [("init image", p.init_image.as_ref()), ("mask image", p.mask_image.as_ref())];
    for (what, img) in images.into_iter().chain(p.ref_images.iter().map(|r| ("reference image", Some(r)))) {
        if let Some(img) = img {
            check_image_bytes(what, img)?;
        }
    }
    if let Some(img) = &p.init_image {
        ensure!(img.channels == 1 || img.channels >= 3, "init image with {} channels is not supported", img.channels);
    }
    if let Some(img) = &p.mask_image {
        ensure!(img.channels == 1 || img.channels >= 3, "mask image with {} channels is not supported", img.channels);
    }
    for img in &p.ref_images {
        ensure!(img.channels == 1 || img.channels >= 3, "reference image with {} channels is not supported", img.channels);
    }
    Ok(())
}

/// A picture from the caller: its size and channel count account for its bytes.
pub(super) fn check_image_bytes(what: &str, img: &crate::image::Image) -> Result<()> {
    ensure!(
        img.width > 0 && img.height > 0 && img.data.len() == img.width as usize * img.height as usize * img.channels as usize,
        "{what}: {}x{} with {} channels does not match its {} bytes",
        img.width,
        img.height,
        img.channels,
        img.data.len()
    );
    Ok(())
}

pub(super) fn align_up(v: i32, multiple: i32) -> i32 {
    v + (multiple - v % multiple) % multiple
}

/// The guidance of one stage after the reference's adjustments: `img_cfg` unset means 1 (and
/// is forced to 1 where the model has no image conditioning), and which unconditional passes
/// run. `stage` prefixes the warnings ("high noise: ").
pub(super) fn resolve_guidance(g: &GuidanceParams, img_cfg_supported: bool, stage: &str) -> (GuidanceParams, bool, bool) {
    let mut guidance = g.clone();
    let img_cfg_set = guidance.img_cfg.is_finite();
    if !img_cfg_set {
        guidance.img_cfg = 1.0;
    }
    if !img_cfg_supported {
        if img_cfg_set && guidance.img_cfg != 1.0 {
            sd_warn!("{stage}3-conditioning CFG is not supported with this model, disabling it for better performance");
        }
        guidance.img_cfg = 1.0;
    }
    let use_uncond = guidance.img_cfg != guidance.txt_cfg;
    let use_img_uncond = guidance.img_cfg != 1.0;
    if guidance.txt_cfg < 1.0 {
        if guidance.txt_cfg == 0.0 {
            sd_warn!("{stage}unconditioned mode, images won't follow the prompt (use cfg-scale=1 for distilled models)");
        } else {
            sd_warn!("{stage}cfg value out of expected range may produce unexpected results");
        }
    }
    (guidance, use_uncond, use_img_uncond)
}

pub(super) fn resolve_request(ms: &ModelSet, p: &ImgGenParams) -> Request {
    let multiple = ms.spec.latent.size_multiple() as i32;
    let (width, height) = (align_up(p.width, multiple), align_up(p.height, multiple));
    if (width, height) != (p.width, p.height) {
        sd_warn!("align generation request up {}x{} to {width}x{height} (multiple={multiple})", p.width, p.height);
    }
    let (guidance, use_uncond, use_img_uncond) = resolve_guidance(&p.sample_params.guidance, ms.spec.supports_img_cfg(!p.ref_images.is_empty()), "");
    let mut shifted_timestep = p.sample_params.shifted_timestep;
    if shifted_timestep > 0 && !ms.spec.shifted_timestep {
        sd_warn!("timestep shifting is only supported for SDXL models!");
        shifted_timestep = 0;
    }
    Request {
        width: width as usize,
        height: height as usize,
        seed: resolve_seed(p.seed),
        guidance,
        use_uncond,
        use_img_uncond,
        shifted_timestep,
        extra: ExtraArgs::parse(p.sample_params.extra_sample_args.as_deref()),
        refs: RefImageParams::resolve(&p.ref_image_args, ms.spec.ref_image_preset),
        cache: p.cache.clone(),
        control_strength: p.control_strength,
        layers: p.qwen_image_layers.max(0) as usize,
    }
}

pub(super) fn resolve_plan(ms: &mut ModelSet, p: &ImgGenParams, r: &Request) -> Result<Plan> {
    let sp = &p.sample_params;
    let family = ms.family();
    let method = sp.sample_method.unwrap_or_else(|| default_sample_method(Some(family)));
    let mut sample_steps = sp.sample_steps.max(0) as usize;
    let sigmas = schedule(ms, sp, method, sample_steps, r.seq_len(ms), &r.extra)?;
    if !sp.custom_sigmas.is_empty() && sample_steps >= sigmas.len() - 1 {
        sample_steps = sigmas.len() - 1;
        sd_warn!("total_steps != custom_sigmas_count - 1, set sample_steps to {sample_steps}");
    }
    let eta = resolve_eta(unset_if_infinite(sp.eta), method, family);
    sd_info!("sampling using {} method", method.name());
    Ok(Plan { method, sample_steps, sigmas, eta })
}

/// The sigmas of `steps` steps with the request's (or the family's default) scheduler, or
/// the request's custom sigmas (which then set the step count).
pub(super) fn schedule(ms: &mut ModelSet, sp: &SampleParams, method: SampleMethod, steps: usize, seq_len: i32, extra: &ExtraArgs) -> Result<Vec<f32>> {
    if !sp.custom_sigmas.is_empty() {
        let sigmas = schedulers::custom_sigmas(&sp.custom_sigmas)?;
        sd_warn!("total_steps != custom_sigmas_count - 1, set total_steps to {}", sigmas.len() - 1);
        return Ok(sigmas);
    }
    let scheduler = scheduler_for(ms, sp, method);
    let family = ms.family();
    ms.denoiser.get_sigmas(steps as u32, seq_len, scheduler, family, extra)
}

/// The requested scheduler, or the family's default for `method`.
pub(super) fn scheduler_for(ms: &ModelSet, sp: &SampleParams, method: SampleMethod) -> Scheduler {
    sp.scheduler.unwrap_or_else(|| default_scheduler(Some((ms.family(), ms.prediction)), method))
}

/// The request's tiling with the family's encode tile factor.
/// `reads_temporal_args`: the family's VAE sizes its temporal tiles from `extra_tiling_args`.
pub(super) fn runtime_tiling(t: &ApiTiling, encode_factor: f32, reads_temporal_args: bool) -> TilingParams {
    TilingParams {
        enabled: t.enabled,
        temporal_tiling: t.temporal_tiling,
        tile_size_x: t.tile_size_x,
        tile_size_y: t.tile_size_y,
        target_overlap: t.target_overlap,
        rel_size_x: t.rel_size_x,
        rel_size_y: t.rel_size_y,
        encode_factor,
        temporal_tiles: if reads_temporal_args { TemporalTiles::from_args(t.extra_tiling_args.as_deref()) } else { TemporalTiles::default() },
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_align_up_to_the_multiple() {
        assert_eq!(align_up(64, 64), 64);
        assert_eq!(align_up(96, 64), 128);
        assert_eq!(align_up(1, 64), 64);
        assert_eq!(align_up(129, 64), 192);
        assert_eq!(align_up(100, 16), 112);
    }
}
