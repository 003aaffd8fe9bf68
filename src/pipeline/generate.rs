//! `generate_image` for the UNet models: resolving the request like the reference (size
//! alignment, seed, guidance, sampler, schedule), preparing the latents (txt2img,
//! img2img, masks, inpainting), the conditioning, the sampling loop with classifier-free
//! guidance, and decoding.

use super::callbacks::{self, CancelFlag, PreviewConfig};
use super::imageops::{concat_channels, image_to_tensor, max_pool_3x3, resize_nearest_max, tensor_to_image, zip_channels};
use super::sd::{Loaded, StableDiffusion};
use crate::params::{GuidanceParams, ImgGenParams, TilingParams as ApiTiling};
use crate::error::{Error, Result};
use crate::image::Image;
use crate::models::diffusion::unet;
use crate::models::vae::{self, Vae};
use crate::runtime::defaults::{default_sample_method, default_scheduler, resolve_eta, unset_if_infinite};
use crate::runtime::denoiser::Denoiser;
use crate::runtime::preview;
use crate::runtime::rng::{randn_like, resolve_seed, GenerationRngs, Rng};
use crate::runtime::samplers::{self, ModelOutput};
use crate::runtime::schedulers;
use crate::runtime::tiling::{retry_tiling, TilingParams};
use crate::tensor::Tensor;
use crate::types::{Preview, SampleMethod};
use std::cell::RefCell;
use std::time::Instant;

/// Pixels per latent pixel times the UNet's total downsampling: sizes are aligned to this.
const SIZE_MULTIPLE: i32 = (vae::SCALE as i32) * 8;
/// Largest side accepted (before alignment).
const MAX_SIDE: i32 = 16384;

thread_local! {
    static FINAL_LATENTS: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
}

/// Runs `f` and returns, with its result, the final latents (before decoding) of every
/// image the generations on this thread produced meanwhile. A testing and debugging aid.
pub fn capture_final_latents<R>(f: impl FnOnce() -> R) -> (R, Vec<Tensor>) {
    let previous = FINAL_LATENTS.with(|c| c.borrow_mut().replace(Vec::new()));
    let r = f();
    let latents = FINAL_LATENTS.with(|c| std::mem::replace(&mut *c.borrow_mut(), previous)).unwrap_or_default();
    (r, latents)
}

fn record_final_latent(t: &Tensor) {
    FINAL_LATENTS.with(|c| {
        if let Some(v) = c.borrow_mut().as_mut() {
            v.push(t.clone());
        }
    });
}

/// The request after the reference's adjustments.
struct Request {
    width: usize,
    height: usize,
    seed: i64,
    guidance: GuidanceParams,
    use_uncond: bool,
    use_img_uncond: bool,
    shifted_timestep: i32,
}

/// Sampler, schedule and eta.
struct Plan {
    method: SampleMethod,
    sample_steps: usize,
    sigmas: Vec<f32>,
    eta: f32,
}

/// Text conditioning plus the UNet's concatenated latent channels (inpainting).
#[derive(Clone)]
struct Condition {
    context: Tensor,
    concat: Option<Tensor>,
}

/// What the sampling of every image of a batch shares.
struct Prepared {
    init_latent: Tensor,
    denoise_mask: Tensor,
    cond: Condition,
    uncond: Option<Condition>,
    img_uncond: Option<Condition>,
}

fn check_params(sd: &StableDiffusion, p: &ImgGenParams) -> Result<()> {
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
    if p.hires.enabled && p.hires.upscaler != crate::types::HiresUpscaler::None {
        bail!("the hires fix is not supported yet in this build of libstable-diffusion");
    }
    if p.cache.mode != crate::types::CacheMode::Disabled {
        sd_warn!("step caching ({}) is not supported for this model; ignoring it", p.cache.mode.name());
    }
    if p.control_image.is_some() {
        sd_warn!("a control image was given but no ControlNet is loaded; ignoring it");
    }
    if !p.ref_images.is_empty() {
        sd_warn!("{} does not use reference images; ignoring them", sd.version.name());
    }
    for (what, img) in [("init image", &p.init_image), ("mask image", &p.mask_image)] {
        if let Some(img) = img {
            ensure!(
                img.width > 0 && img.height > 0 && img.data.len() == img.width as usize * img.height as usize * img.channels as usize,
                "{what}: {}x{} with {} channels does not match its {} bytes",
                img.width,
                img.height,
                img.channels,
                img.data.len()
            );
        }
    }
    if let Some(img) = &p.init_image {
        ensure!(img.channels == 1 || img.channels >= 3, "init image with {} channels is not supported", img.channels);
    }
    if let Some(img) = &p.mask_image {
        ensure!(img.channels == 1 || img.channels >= 3, "mask image with {} channels is not supported", img.channels);
    }
    Ok(())
}

fn align_up(v: i32) -> i32 {
    v + (SIZE_MULTIPLE - v % SIZE_MULTIPLE) % SIZE_MULTIPLE
}

fn resolve_request(sd: &StableDiffusion, p: &ImgGenParams) -> Request {
    let (width, height) = (align_up(p.width), align_up(p.height));
    if (width, height) != (p.width, p.height) {
        sd_warn!(
            "align generation request up {}x{} to {width}x{height} (multiple={SIZE_MULTIPLE})",
            p.width,
            p.height
        );
    }
    let mut guidance = p.sample_params.guidance.clone();
    let img_cfg_set = guidance.img_cfg.is_finite();
    if !img_cfg_set {
        guidance.img_cfg = 1.0;
    }
    if !sd.is_inpaint() {
        if img_cfg_set && guidance.img_cfg != 1.0 {
            sd_warn!("3-conditioning CFG is not supported with this model, disabling it for better performance");
        }
        guidance.img_cfg = 1.0;
    }
    let use_uncond = guidance.img_cfg != guidance.txt_cfg;
    let use_img_uncond = guidance.img_cfg != 1.0;
    if guidance.txt_cfg < 1.0 {
        if guidance.txt_cfg == 0.0 {
            sd_warn!("unconditioned mode, images won't follow the prompt (use cfg-scale=1 for distilled models)");
        } else {
            sd_warn!("cfg value out of expected range may produce unexpected results");
        }
    }
    let mut shifted_timestep = p.sample_params.shifted_timestep;
    if shifted_timestep > 0 {
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
    }
}

fn resolve_plan(sd: &mut StableDiffusion, p: &ImgGenParams, r: &Request) -> Result<Plan> {
    let sp = &p.sample_params;
    let method = sp.sample_method.unwrap_or_else(|| default_sample_method(Some(sd.family)));
    let mut sample_steps = sp.sample_steps.max(0) as usize;
    let sigmas = if !sp.custom_sigmas.is_empty() {
        let sigmas = schedulers::custom_sigmas(&sp.custom_sigmas)?;
        let total = sigmas.len() - 1;
        sd_warn!("total_steps != custom_sigmas_count - 1, set total_steps to {total}");
        if sample_steps >= total {
            sample_steps = total;
            sd_warn!("total_steps != custom_sigmas_count - 1, set sample_steps to {sample_steps}");
        }
        sigmas
    } else {
        let scheduler = sp.scheduler.unwrap_or_else(|| default_scheduler(Some((sd.family, sd.prediction)), method));
        let seq_len = ((r.width / vae::SCALE) * (r.height / vae::SCALE)) as i32;
        sd.denoiser.get_sigmas(sample_steps as u32, seq_len, scheduler, sd.family, sp.extra_sample_args.as_deref())?
    };
    let eta = resolve_eta(unset_if_infinite(sp.eta), method, sd.family);
    sd_info!("sampling using {} method", method.name());
    Ok(Plan { method, sample_steps, sigmas, eta })
}

fn runtime_tiling(t: &ApiTiling) -> TilingParams {
    TilingParams {
        enabled: t.enabled,
        temporal_tiling: t.temporal_tiling,
        tile_size_x: t.tile_size_x,
        tile_size_y: t.tile_size_y,
        target_overlap: t.target_overlap,
        rel_size_x: t.rel_size_x,
        rel_size_y: t.rel_size_y,
    }
}

/// An image as [W, H, 3, 1] in [0, 1] at the request's size (grey images become RGB,
/// extra channels such as alpha are dropped).
fn rgb_tensor(img: &Image, w: usize, h: usize) -> Result<Tensor> {
    let t = image_to_tensor(img, Some((w, h)))?;
    let plane = w * h;
    match t.ne(2) {
        3 => Ok(t),
        1 => Tensor::from_vec(&[w, h, 3, 1], t.data().repeat(3)),
        _ => Tensor::from_vec(&[w, h, 3, 1], t.data()[..3 * plane].to_vec()),
    }
}

/// Image [W, H, 3, 1] in [0, 1] → diffusion latents, sampling the VAE's distribution with
/// the generation's noise generator.
fn encode_first_stage(
    first_stage: &mut Loaded<Vae>,
    image: &Tensor,
    tiling: &TilingParams,
    circular: (bool, bool),
    rng: &mut dyn Rng,
) -> Result<Tensor> {
    let out = first_stage.model.encode(&mut first_stage.runner, image, tiling, circular)?;
    let latents = first_stage.model.output_to_latents(&out, |n| rng.randn(n))?;
    Ok(first_stage.model.vae_to_diffusion_latents(&latents))
}

fn prepare(
    sd: &mut StableDiffusion,
    p: &ImgGenParams,
    r: &Request,
    plan: &mut Plan,
    tiling: &TilingParams,
    circular: (bool, bool),
    rngs: &mut GenerationRngs,
) -> Result<Prepared> {
    let (w, h) = (r.width, r.height);
    let (lw, lh) = (w / vae::SCALE, h / vae::SCALE);
    let start = Instant::now();
    let mut init_image = None;
    if let Some(img) = &p.init_image {
        sd_info!("IMG2IMG");
        if p.strength < 1.0 {
            let sigmas =
                sd.denoiser.img2img_sigmas(&plan.sigmas, plan.sample_steps, p.strength, p.sample_params.extra_sample_args.as_deref());
            plan.sample_steps = sigmas.len() - 1;
            plan.sigmas = sigmas;
        }
        init_image = Some(rgb_tensor(img, w, h)?);
    }
    let mask = match &p.mask_image {
        Some(m) => Some(image_to_tensor(m, Some((w, h)))?.map(f32::round)),
        None => None,
    };
    if sd.is_inpaint() && (init_image.is_none() || mask.is_none()) {
        sd_warn!("inpainting model requires both an init image and a mask image.");
    }
    let mask = mask.unwrap_or_else(|| Tensor::full(&[w, h, 1, 1], 1.0));
    let latent_mask = resize_nearest_max(&mask, &[lw, lh, 1, 1])?;

    let init_latent = match &init_image {
        Some(img) => encode_first_stage(&mut sd.first_stage, img, tiling, circular, rngs.noise())
            .map_err(|e| Error::new(format!("failed to encode init image: {e}")))?,
        None => Tensor::zeros(&[lw, lh, 4, 1]),
    };

    let mut concat = None;
    let mut img_uncond_concat = None;
    if sd.is_inpaint() {
        let masked_latent = match &init_image {
            Some(img) => {
                let masked = zip_channels(img, &mask, |i, m| (1.0 - m) * (i - 0.5) + 0.5)?;
                encode_first_stage(&mut sd.first_stage, &masked, tiling, circular, rngs.noise())
                    .map_err(|e| Error::new(format!("failed to encode masked init image: {e}")))?
            }
            None => Tensor::zeros(init_latent.shape()),
        };
        concat = Some(concat_channels(&latent_mask, &masked_latent)?);
        img_uncond_concat = Some(concat_channels(&latent_mask, &Tensor::zeros(masked_latent.shape()))?);
    }
    if p.init_image.is_some() {
        sd_info!("encode_first_stage completed, taking {:.2}s", start.elapsed().as_secs_f32());
    }
    let denoise_mask = if sd.is_inpaint() { max_pool_3x3(&latent_mask) } else { latent_mask };

    let start = Instant::now();
    let pass_concat = passes_concat(p.ref_image_args.as_str());
    let cond = Condition { context: sd.cond.encode(&p.prompt, p.clip_skip)?, concat: concat.clone().filter(|_| pass_concat) };
    let uncond = if r.use_uncond {
        Some(Condition { context: sd.cond.encode(&p.negative_prompt, p.clip_skip)?, concat: concat.filter(|_| pass_concat) })
    } else {
        None
    };
    let img_uncond = if r.use_img_uncond {
        let context = match &uncond {
            Some(u) => u.context.clone(),
            None => sd.cond.encode(&p.negative_prompt, p.clip_skip)?,
        };
        Some(Condition { context, concat: img_uncond_concat })
    } else {
        None
    };
    sd_info!("get_learned_condition completed, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(Prepared { init_latent, denoise_mask, cond, uncond, img_uncond })
}

/// `pass_to_dit` of the request's reference-image arguments (default true): whether the
/// concatenated latent channels reach the diffusion model.
fn passes_concat(ref_image_args: &str) -> bool {
    let mut pass = true;
    for (k, v) in crate::runtime::args::parse_key_value_args(Some(ref_image_args), "reference image args") {
        if k == "pass_to_dit" {
            match crate::runtime::args::parse_strict_bool(&v) {
                Some(b) => pass = b,
                None => sd_warn!("ignoring invalid reference image arg '{k}={v}'"),
            }
        }
    }
    pass
}

/// Classifier-free guidance, in the reference's order of float operations.
fn guide(g: &GuidanceParams, cond: &Tensor, uncond: Option<&Tensor>, img_uncond: Option<&Tensor>) -> Tensor {
    let (cfg, img_cfg) = (g.txt_cfg, g.img_cfg);
    match (uncond, img_uncond) {
        (Some(u), Some(i)) => {
            let d = cond.data().iter().zip(u.data()).zip(i.data());
            let data = d.map(|((&c, &u), &i)| (i + img_cfg * (u - i)) + cfg * (c - u)).collect();
            Tensor::from_vec(cond.shape(), data).expect("same shape")
        }
        (Some(u), None) => cond.zip(u, |c, u| u + cfg * (c - u)),
        (None, Some(i)) => cond.zip(i, |c, i| i + cfg * (c - i)),
        (None, None) => cond.clone(),
    }
}

/// Shows `latent` through the preview callback, decoded as configured.
fn send_preview(sd_family_latents: &Tensor, step: i32, noisy: bool, config: &PreviewConfig, decoder: &mut Loaded<Vae>, tiling: &TilingParams, circular: (bool, bool)) {
    let image = match config.mode {
        Preview::Proj => preview::project(sd_family_latents, Some(preview::for_sd_family(false))),
        Preview::Vae | Preview::Tae => {
            let lat = decoder.model.diffusion_to_vae_latents(sd_family_latents);
            decoder
                .model
                .decode(&mut decoder.runner, &lat, tiling, circular, None)
                .and_then(|t| tensor_to_image(&t, 0))
        }
        Preview::None => return,
    };
    match image {
        Ok(img) => callbacks::preview(step, std::slice::from_ref(&img), noisy),
        Err(e) => sd_error!("preview decode failed at step {step}: {e}"),
    }
}

/// The error of a cancelled generation.
pub fn cancelled() -> Error {
    Error::new("generation cancelled")
}

#[allow(clippy::too_many_arguments)]
fn sample(
    sd: &mut StableDiffusion,
    prepared: &Prepared,
    noise: &Tensor,
    r: &Request,
    plan: &Plan,
    extra_args: Option<&str>,
    tiling: &TilingParams,
    circular: (bool, bool),
    rng: &mut dyn Rng,
    cancel: &CancelFlag,
) -> Result<Tensor> {
    let StableDiffusion { unet, denoiser, first_stage, preview_vae, .. } = sd;
    let denoiser: &Denoiser = denoiser;
    let decoder = match preview_vae {
        Some(p) => p,
        None => first_stage,
    };
    let steps = plan.sigmas.len().saturating_sub(1) as i32;
    let needs_uncond = samplers::needs_uncond_denoised(plan.method);
    let preview = callbacks::preview_config();
    let init = &prepared.init_latent;
    let mask = &prepared.denoise_mask;
    let mut last_progress = Instant::now();

    let x_t = denoiser.noise_scaling(plan.sigmas[0], noise, init)?;
    let mut model = |x: &Tensor, sigma: f32, step: i32| -> Result<ModelOutput> {
        if cancel.stop_now() {
            sd_debug!("cancelling generation");
            return Err(cancelled());
        }
        if step == 1 || step == -1 {
            callbacks::progress(0, steps, 0.0);
            last_progress = Instant::now();
        }
        let s = denoiser.scalings(sigma);
        let t = denoiser.model_timestep(sigma, r.shifted_timestep);
        let s = denoiser.shifted_scalings(r.shifted_timestep, t, s);
        let input = x.map(|v| v * s.c_in);
        if preview.noisy && preview.due(step.abs()) {
            send_preview(&input, step, true, &preview, decoder, tiling, circular);
        }
        let mut run = |c: &Condition| {
            unet::compute(&mut unet.runner, &unet.model, &input, &[t], &c.context, c.concat.as_ref(), None, None, 1.0)
                .map_err(|e| Error::new(format!("diffusion model compute failed: {e}")))
        };
        let cond_out = run(&prepared.cond)?;
        let uncond_out = prepared.uncond.as_ref().map(&mut run).transpose()?;
        let img_out = prepared.img_uncond.as_ref().map(&mut run).transpose()?;
        let guided = guide(&r.guidance, &cond_out, uncond_out.as_ref(), img_out.as_ref());

        let to_denoised = |pred: &Tensor| pred.zip(x, |p, xv| p * s.c_out + xv * s.c_skip);
        let denoised = to_denoised(&guided);
        let uncond_denoised = needs_uncond.then(|| to_denoised(img_out.as_ref().or(uncond_out.as_ref()).unwrap_or(&cond_out)));
        let denoised = blend(&denoised, init, mask)?;
        if preview.denoised && preview.due(step.abs()) {
            send_preview(&denoised, step, false, &preview, decoder, tiling, circular);
        }
        if step > 0 || step == -steps {
            let now = Instant::now();
            callbacks::progress(step.abs(), steps, (now - last_progress).as_secs_f32());
            last_progress = now;
        }
        Ok(ModelOutput { denoised, uncond_denoised })
    };
    let result = samplers::sample(
        plan.method,
        &mut model,
        x_t,
        &plan.sigmas,
        rng,
        plan.eta,
        denoiser.is_flow(),
        extra_args,
        Some(denoiser),
    );
    unet.runner.release();
    let x0 = result?;
    Ok(denoiser.inverse_noise_scaling(*plan.sigmas.last().unwrap_or(&0.0), x0))
}

/// `denoised * mask + init * (1 - mask)`, the mask [W, H, 1, 1] broadcast over channels.
fn blend(denoised: &Tensor, init: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let kept = zip_channels(denoised, mask, |d, m| d * m)?;
    let orig = zip_channels(init, mask, |i, m| i * (1.0 - m))?;
    Ok(kept.zip(&orig, |a, b| a + b))
}

/// Decodes final latents to images; fewer when cancelled meanwhile (none is an error).
fn decode_all(sd: &mut StableDiffusion, latents: &[Tensor], tiling: &TilingParams, circular: (bool, bool), cancel: &CancelFlag) -> Result<Vec<Image>> {
    sd_info!("decoding {} latents", latents.len());
    let start = Instant::now();
    let fs = &mut sd.first_stage;
    let mut images = Vec::new();
    for (i, lat) in latents.iter().enumerate() {
        if cancel.stop_now() {
            sd_error!("cancelling latent decodings");
            break;
        }
        let t = Instant::now();
        let vae_latent = fs.model.diffusion_to_vae_latents(lat);
        let mut progress = |s: i32, n: i32, secs: f32| callbacks::progress(s, n, secs);
        let decoded = match fs.model.decode(&mut fs.runner, &vae_latent, tiling, circular, Some(&mut progress)) {
            Ok(d) => d,
            Err(e) => match retry_tiling(tiling, lat.ne(0) as i64, lat.ne(1) as i64) {
                Some(retry) => {
                    sd_warn!("decode failed ({e}); retrying with {}x{} tiles", retry.tile_size_x, retry.tile_size_y);
                    fs.model.decode(&mut fs.runner, &vae_latent, &retry, circular, Some(&mut progress))?
                }
                None => return Err(Error::new(format!("decode_first_stage failed for latent {}: {e}", i + 1))),
            },
        };
        images.push(tensor_to_image(&decoded, 0)?);
        sd_info!("latent {} decoded, taking {:.2}s", i + 1, t.elapsed().as_secs_f32());
    }
    sd_info!("decode_first_stage completed, taking {:.2}s", start.elapsed().as_secs_f32());
    ensure!(!images.is_empty(), "cancelled before any latent images were decoded");
    Ok(images)
}

/// Text/image to image: `batch_count` RGB images, fewer when new latents were cancelled.
pub fn generate(sd: &mut StableDiffusion, p: &ImgGenParams, cancel: &CancelFlag) -> Result<Vec<Image>> {
    check_params(sd, p)?;
    let t0 = Instant::now();
    sd.apply_loras(&p.loras)?;
    let r = resolve_request(sd, p);
    sd_info!("generate_image {}x{}", r.width, r.height);
    let tiling = runtime_tiling(&p.vae_tiling_params);
    let circular = (p.circular_x, p.circular_y);
    for runner in [&mut sd.unet.runner, &mut sd.first_stage.runner].into_iter().chain(sd.preview_vae.as_mut().map(|v| &mut v.runner)) {
        runner.options.circular_x = p.circular_x;
        runner.options.circular_y = p.circular_y;
    }

    let mut rngs = GenerationRngs::new(sd.rng_type, sd.sampler_rng_type);
    rngs.manual_seed(r.seed as u64);
    let mut plan = resolve_plan(sd, p, &r)?;
    let prepared = prepare(sd, p, &r, &mut plan, &tiling, circular, &mut rngs)?;

    let mut finals = Vec::new();
    let start = Instant::now();
    for b in 0..p.batch_count as usize {
        match cancel.pending() {
            Some(crate::types::CancelMode::All) => {
                sd_error!("cancelling generation");
                return Err(cancelled());
            }
            Some(_) => {
                sd_info!("cancelling new latent generation, returning {}/{} completed latents", finals.len(), p.batch_count);
                break;
            }
            None => {}
        }
        let seed = r.seed.wrapping_add(b as i64);
        sd_info!("generating image: {}/{} - seed {seed}", b + 1, p.batch_count);
        let t = Instant::now();
        rngs.manual_seed(seed as u64);
        let noise = randn_like(&prepared.init_latent, rngs.noise());
        let extra = p.sample_params.extra_sample_args.as_deref();
        let x0 = sample(sd, &prepared, &noise, &r, &plan, extra, &tiling, circular, rngs.sampler(), cancel)
            .map_err(|e| Error::new(format!("sampling for image {}/{} failed: {e}", b + 1, p.batch_count)))?;
        sd_info!("sampling completed, taking {:.2}s", t.elapsed().as_secs_f32());
        record_final_latent(&x0);
        finals.push(x0);
    }
    sd_info!("generating {} latent images completed, taking {:.2}s", finals.len(), start.elapsed().as_secs_f32());
    ensure!(!finals.is_empty(), "no latent images generated");
    let images = decode_all(sd, &finals, &tiling, circular, cancel)?;
    sd_info!("generate_image completed in {:.2}s", t0.elapsed().as_secs_f32());
    Ok(images)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_align_up_to_64() {
        assert_eq!(align_up(64), 64);
        assert_eq!(align_up(96), 128);
        assert_eq!(align_up(1), 64);
        assert_eq!(align_up(129), 192);
    }

    #[test]
    fn guidance_formulas() {
        let t = |v: f32| Tensor::full(&[1, 1, 1, 1], v);
        let g = GuidanceParams { txt_cfg: 7.0, img_cfg: 1.5, ..Default::default() };
        assert_eq!(guide(&g, &t(2.0), Some(&t(1.0)), None).data(), &[1.0 + 7.0 * (2.0 - 1.0)]);
        assert_eq!(guide(&g, &t(2.0), None, Some(&t(0.5))).data(), &[0.5 + 7.0 * (2.0 - 0.5)]);
        let want = (0.5 + 1.5 * (1.0 - 0.5)) + 7.0 * (2.0 - 1.0);
        assert_eq!(guide(&g, &t(2.0), Some(&t(1.0)), Some(&t(0.5))).data(), &[want]);
        assert_eq!(guide(&g, &t(2.0), None, None).data(), &[2.0]);
    }

    #[test]
    fn mask_blending_broadcasts_over_channels() {
        let d = Tensor::from_vec(&[2, 1, 2, 1], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let init = Tensor::from_vec(&[2, 1, 2, 1], vec![10.0, 20.0, 30.0, 40.0]).unwrap();
        let mask = Tensor::from_vec(&[2, 1, 1, 1], vec![1.0, 0.0]).unwrap();
        assert_eq!(blend(&d, &init, &mask).unwrap().data(), &[1.0, 20.0, 3.0, 40.0]);
    }

    #[test]
    fn reference_image_args() {
        assert!(passes_concat(""));
        assert!(!passes_concat("pass_to_dit=false"));
        assert!(passes_concat("pass_to_dit=maybe"));
    }

    #[test]
    fn final_latents_are_captured_per_thread() {
        let ((), got) = capture_final_latents(|| record_final_latent(&Tensor::zeros(&[1])));
        assert_eq!(got.len(), 1);
        record_final_latent(&Tensor::zeros(&[1]));
        let ((), none) = capture_final_latents(|| ());
        assert!(none.is_empty());
    }
}
