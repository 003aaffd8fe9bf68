//! `generate_image` for every family: resolving the request like the reference (size
//! alignment, seed, guidance, sampler, schedule), preparing the latents (txt2img, img2img,
//! masks, inpainting, edit references), the conditioning, the sampling loop with
//! classifier-free guidance, and decoding. Family facts come from the model set's
//! [`FamilySpec`](super::families::FamilySpec); the networks are reached through the
//! conditioner, diffusion-model and first-stage traits.

use super::callbacks::{self, CancelFlag, PreviewConfig};
use super::conditioning::CondRequest;
use super::families::{Concat, ModelSet};
use super::imageops::{concat_channels, image_to_tensor, max_pool_3x3, resize_nearest, resize_nearest_max, tensor_to_image, zip_channels};
use crate::error::{Error, Result};
use crate::image::Image;
use crate::models::diffusion::DiffusionInput;
use crate::models::vae::FirstStage;
use crate::models::Condition;
use crate::params::{CacheParams, GuidanceParams, ImgGenParams, SampleParams, TilingParams as ApiTiling};
use crate::runtime::defaults::{default_sample_method, default_scheduler, resolve_eta, unset_if_infinite};
use crate::runtime::denoiser::Denoiser;
use crate::runtime::args::ExtraArgs;
use crate::runtime::cache::{Backbone, Pass, StepCache};
use super::ref_images::RefImageParams;
use crate::runtime::preview;
use crate::runtime::rng::{randn_like, resolve_seed, GenerationRngs, Rng};
use crate::runtime::samplers::{self, ModelOutput};
use crate::runtime::schedulers;
use crate::runtime::tiling::{retry_tiling, TilingParams};
use crate::tensor::Tensor;
use crate::types::{Prediction, Preview, SampleMethod, Scheduler};
use std::borrow::Cow;
use std::cell::RefCell;
use std::time::Instant;

/// Largest side accepted (before alignment).
pub(super) const MAX_SIDE: i32 = 16384;

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
pub(super) struct Request {
    width: usize,
    height: usize,
    pub(super) seed: i64,
    guidance: GuidanceParams,
    use_uncond: bool,
    use_img_uncond: bool,
    shifted_timestep: i32,
    /// `extra_sample_args`, parsed once.
    pub(super) extra: ExtraArgs,
    /// `ref_image_args` over the family's preset, parsed once.
    refs: RefImageParams,
    cache: CacheParams,
    control_strength: f32,
    /// Layers of a layered family's latent beyond the first (`qwen_image_layers`, at least 0).
    layers: usize,
}

/// Sampler, schedule and eta.
pub(super) struct Plan {
    pub(super) method: SampleMethod,
    pub(super) sample_steps: usize,
    pub(super) sigmas: Vec<f32>,
    pub(super) eta: f32,
}

/// What the sampling of every image of a batch shares.
pub(super) struct Prepared {
    pub(super) init_latent: Tensor,
    pub(super) denoise_mask: Tensor,
    /// Reference latents the diffusion model takes as extra tokens (empty otherwise).
    ref_latents: Vec<Tensor>,
    pub(super) cond: Condition,
    pub(super) uncond: Option<Condition>,
    pub(super) img_uncond: Option<Condition>,
    /// The control image [W, H, 3, 1] in [0, 1] when a ControlNet will read it.
    control_hint: Option<Tensor>,
}

fn check_params(p: &ImgGenParams) -> Result<()> {
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
    for img in &p.ref_images {
        ensure!(img.channels == 1 || img.channels >= 3, "reference image with {} channels is not supported", img.channels);
    }
    Ok(())
}

pub(super) fn align_up(v: i32, multiple: i32) -> i32 {
    v + (multiple - v % multiple) % multiple
}

fn resolve_request(ms: &ModelSet, p: &ImgGenParams) -> Request {
    let multiple = ms.spec.latent.size_multiple() as i32;
    let (width, height) = (align_up(p.width, multiple), align_up(p.height, multiple));
    if (width, height) != (p.width, p.height) {
        sd_warn!("align generation request up {}x{} to {width}x{height} (multiple={multiple})", p.width, p.height);
    }
    let mut guidance = p.sample_params.guidance.clone();
    let img_cfg_set = guidance.img_cfg.is_finite();
    if !img_cfg_set {
        guidance.img_cfg = 1.0;
    }
    if !ms.spec.supports_img_cfg(!p.ref_images.is_empty()) {
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

fn resolve_plan(ms: &mut ModelSet, p: &ImgGenParams, r: &Request) -> Result<Plan> {
    let sp = &p.sample_params;
    let family = ms.family();
    let method = sp.sample_method.unwrap_or_else(|| default_sample_method(Some(family)));
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
        let scheduler = scheduler_for(ms, sp, method);
        let scale = ms.spec.latent.vae_scale;
        let seq_len = ((r.width / scale) * (r.height / scale)) as i32;
        ms.denoiser.get_sigmas(sample_steps as u32, seq_len, scheduler, family, &r.extra)?
    };
    let eta = resolve_eta(unset_if_infinite(sp.eta), method, family);
    sd_info!("sampling using {} method", method.name());
    Ok(Plan { method, sample_steps, sigmas, eta })
}

/// The requested scheduler, or the family's default for `method`.
pub(super) fn scheduler_for(ms: &ModelSet, sp: &SampleParams, method: SampleMethod) -> Scheduler {
    sp.scheduler.unwrap_or_else(|| default_scheduler(Some((ms.family(), ms.prediction)), method))
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
    image_tensor(img, w, h, 3)
}

/// An image as [W, H, `channels`, 1] in [0, 1] at the request's size, like the reference's
/// channel adjustment: grey becomes RGB, RGBA families get an opaque alpha where the image
/// has none, extra channels are dropped.
fn image_tensor(img: &Image, w: usize, h: usize, channels: usize) -> Result<Tensor> {
    let t = image_to_tensor(img, Some((w, h)))?;
    let plane = w * h;
    let mut data = match t.ne(2) {
        1 => t.data().repeat(3),
        _ => t.data()[..3.min(t.ne(2)) * plane].to_vec(),
    };
    if channels == 4 {
        match t.ne(2) {
            c if c >= 4 => data.extend_from_slice(&t.data()[3 * plane..4 * plane]),
            _ => data.extend(std::iter::repeat_n(1.0, plane)),
        }
    }
    Tensor::from_vec(&[w, h, channels, 1], data)
}

/// Image [W, H, 3, 1] in [0, 1] → diffusion latents, sampling the VAE's distribution with
/// the generation's noise generator.
pub(super) fn encode_first_stage(
    first_stage: &mut dyn FirstStage,
    image: &Tensor,
    tiling: &TilingParams,
    circular: (bool, bool),
    rng: &mut dyn Rng,
) -> Result<Tensor> {
    first_stage.begin()?;
    let out = first_stage.encode_latents(image, tiling, circular, &mut |n| rng.randn(n));
    first_stage.end();
    out
}

/// A reference image at the size the reference encodes it: with `resize_before_vae`, about
/// the request's area (at most `vae_input_max_pixels`, default 1024²) with its aspect ratio,
/// or the request's size (`resize_vae_to_target`), sides rounded to `multiple` (16, Qwen-Image 32).
fn ref_image_for_vae(img: &Image, r: &Request, multiple: usize, channels: usize) -> Result<Tensor> {
    let t = image_tensor(img, img.width as usize, img.height as usize, channels)?;
    if !r.refs.resize_before_vae {
        return Ok(t);
    }
    let (w, h) = (t.ne(0) as f64, t.ne(1) as f64);
    let (vae_w, vae_h) = if r.refs.resize_vae_to_target {
        (r.width as f64, r.height as f64)
    } else {
        // Integer pixel counts and a truncating integer division, as the reference computes them.
        let target = if r.refs.vae_input_max_pixels > 0 { r.refs.vae_input_max_pixels as i64 } else { 1024 * 1024 };
        let area = target.min((r.width * r.height) as i64);
        let vae_w = ((area * t.ne(0) as i64 / t.ne(1) as i64) as f64).sqrt();
        (vae_w, vae_w * h / w)
    };
    let m = multiple as f64;
    let round = |v: f64| ((v / m).round() * m) as usize;
    let (tw, th) = (round(vae_w), round(vae_h));
    ensure!(tw > 0 && th > 0, "reference image of {}x{} is too small", img.width, img.height);
    if (tw, th) == (t.ne(0), t.ne(1)) {
        return Ok(t);
    }
    sd_debug!("resize vae ref image from {}x{} to {th}x{tw}", t.ne(1), t.ne(0));
    resize_nearest(&t, &[tw, th, channels, 1])
}

fn prepare(
    ms: &mut ModelSet,
    p: &ImgGenParams,
    r: &mut Request,
    plan: &mut Plan,
    tiling: &TilingParams,
    circular: (bool, bool),
    rngs: &mut GenerationRngs,
) -> Result<Prepared> {
    let (w, h) = (r.width, r.height);
    let latent = ms.spec.latent;
    let (lw, lh) = (w / latent.vae_scale, h / latent.vae_scale);
    let concat_kind = ms.spec.concat;
    let channels = ms.spec.image_channels;
    let start = Instant::now();
    let mut init_image = None;
    if let Some(img) = &p.init_image {
        // The reference samples the init image's single latent and then fails to decode it
        // into layers: refused before any work (the picture to decompose is a reference image).
        ensure!(!ms.spec.layered, "qwen image layered expected at least {} latent layers, got shape dim=4 (give the picture to decompose as a reference image)", r.layers + 1);
        sd_info!("IMG2IMG");
        if p.strength < 1.0 {
            let sigmas =
                ms.denoiser.img2img_sigmas(&plan.sigmas, plan.sample_steps, p.strength, &r.extra);
            plan.sample_steps = sigmas.len() - 1;
            plan.sigmas = sigmas;
        }
        init_image = Some(image_tensor(img, w, h, channels)?);
    }
    let mask = match &p.mask_image {
        Some(m) => Some(image_to_tensor(m, Some((w, h)))?.map(f32::round)),
        None => None,
    };
    let inpaint = matches!(concat_kind, Concat::Inpaint | Concat::FluxFill | Concat::Flex2);
    if inpaint && (init_image.is_none() || mask.is_none()) {
        sd_warn!("inpainting model requires both an init image and a mask image.");
    }
    let mask = mask.unwrap_or_else(|| Tensor::full(&[w, h, 1, 1], 1.0));
    let latent_mask = resize_nearest_max(&mask, &[lw, lh, 1, 1])?;

    let mut encode = |what: &str, img: &Tensor| {
        encode_first_stage(ms.first_stage.as_mut(), img, tiling, circular, rngs.noise()).map_err(|e| Error::new(format!("failed to encode {what}: {e}")))
    };
    let init_latent = match &init_image {
        Some(img) => encode("init image", img)?,
        None if ms.spec.layered => Tensor::zeros(&[lw, lh, r.layers + 1, latent.channels, 1]),
        None => Tensor::zeros(&[lw, lh, latent.channels, 1]),
    };
    // Like the reference, a control image is encoded whenever one is given (before the
    // reference images; the encoding draws from the noise generator); only the control
    // families read the latent, a ControlNet reads the image itself.
    let takes_control = matches!(concat_kind, Concat::FluxControls | Concat::Flex2);
    let mut control_hint = None;
    let control_latent = match &p.control_image {
        Some(img) => {
            let image = rgb_tensor(img, w, h)?;
            let latent = encode("control image", &image)?;
            if ms.control_net.is_some() {
                control_hint = Some(image);
            } else if !takes_control {
                sd_warn!("a control image was given but no ControlNet is loaded; ignoring it");
            }
            Some(latent)
        }
        None => None,
    };

    // Reference images, in the reference's order (after the init and control images):
    // encoded for the families that read them.
    let mut ref_latents = Vec::new();
    if concat_kind == Concat::Edit || (ms.spec.ref_latents && !p.ref_images.is_empty()) {
        let mut refs: Vec<Tensor> = p.ref_images.iter().map(|img| ref_image_for_vae(img, r, ms.spec.ref_image_multiple, channels)).collect::<Result<_>>()?;
        if refs.is_empty() {
            sd_warn!("This model needs at least one reference image; using an empty reference");
            refs.push(Tensor::zeros(&[w, h, channels, 1]));
            r.guidance.img_cfg = r.guidance.txt_cfg;
            r.use_img_uncond = false;
        }
        sd_info!("EDIT mode");
        for (i, img) in refs.iter().enumerate() {
            ref_latents.push(encode(&format!("reference image {i}"), img)?);
        }
    } else if !p.ref_images.is_empty() {
        sd_warn!("{} does not use reference images; ignoring them", ms.version.name());
    }

    let mut concat = None;
    let mut img_uncond_concat = None;
    let masked_latent = |encode: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>| -> Result<Tensor> {
        match &init_image {
            Some(img) => encode("masked init image", &zip_channels(img, &mask, |i, m| (1.0 - m) * (i - 0.5) + 0.5)?),
            None => Ok(Tensor::zeros(init_latent.shape())),
        }
    };
    match concat_kind {
        Concat::Inpaint => {
            let masked_latent = masked_latent(&mut encode)?;
            concat = Some(concat_channels(&latent_mask, &masked_latent)?);
            img_uncond_concat = Some(concat_channels(&latent_mask, &Tensor::zeros(masked_latent.shape()))?);
        }
        Concat::FluxFill => {
            let masked_latent = masked_latent(&mut encode)?;
            let patches = mask_patches(&mask, latent.vae_scale)?;
            concat = Some(concat_channels(&masked_latent, &patches)?);
            img_uncond_concat = Some(concat_channels(&Tensor::zeros(masked_latent.shape()), &patches)?);
        }
        Concat::Flex2 => {
            let masked_latent = zip_channels(&init_latent, &latent_mask, |l, m| (1.0 - m) * l)?;
            let zeros = Tensor::zeros(masked_latent.shape());
            let control = control_latent.clone().unwrap_or_else(|| zeros.clone());
            concat = Some(concat_channels(&concat_channels(&masked_latent, &latent_mask)?, &control)?);
            img_uncond_concat = Some(concat_channels(&concat_channels(&zeros, &latent_mask)?, &zeros)?);
        }
        Concat::FluxControls => {
            let control = control_latent.clone().unwrap_or_else(|| Tensor::zeros(init_latent.shape()));
            img_uncond_concat = Some(Tensor::zeros(control.shape()));
            concat = Some(control);
        }
        Concat::Edit => {
            let first = &ref_latents[0];
            let shape = [init_latent.ne(0), init_latent.ne(1), first.ne(2), first.ne(3)];
            let edit = resize_nearest(first, &shape)?;
            img_uncond_concat = Some(Tensor::zeros(edit.shape()));
            concat = Some(edit);
        }
        Concat::None => {}
    }
    if p.init_image.is_some() || !p.ref_images.is_empty() {
        sd_info!("encode_first_stage completed, taking {:.2}s", start.elapsed().as_secs_f32());
    }
    let denoise_mask = if inpaint { max_pool_3x3(&latent_mask) } else { latent_mask };
    // Edit models read their reference through the concatenated channels instead.
    if concat_kind == Concat::Edit {
        ref_latents.clear();
    }

    let start = Instant::now();
    // Vision-language encoders see the reference images as given (RGB in [0, 1]).
    let vlm_images: Vec<Tensor> = if r.refs.pass_to_vlm {
        p.ref_images.iter().map(|img| rgb_tensor(img, img.width as usize, img.height as usize)).collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let base = CondRequest { text: &p.prompt, clip_skip: p.clip_skip, width: w, height: h, zero_out_masked: false, ref_images: &vlm_images, refs: r.refs };
    ms.cond.begin()?;
    let conds = encode_conditions(ms, &base, p, r, !ref_latents.is_empty(), concat, img_uncond_concat);
    ms.cond.end();
    let (cond, uncond, img_uncond) = conds?;
    sd_info!("get_learned_condition completed, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(Prepared { init_latent, denoise_mask, ref_latents, cond, uncond, img_uncond, control_hint })
}

/// The request's conditions: prompt, negative prompt (when guidance needs it) and the
/// image-unconditioned one (3-way guidance), with the concatenated latent channels.
fn encode_conditions(
    ms: &mut ModelSet,
    base: &CondRequest<'_>,
    p: &ImgGenParams,
    r: &Request,
    has_ref_latents: bool,
    concat: Option<Tensor>,
    img_uncond_concat: Option<Tensor>,
) -> Result<(Condition, Option<Condition>, Option<Condition>)> {
    let pass_concat = r.refs.pass_to_dit;
    let mut cond = ms.cond.encode(base)?;
    if cond.concat.is_none() && pass_concat {
        cond.concat = concat.clone();
    }
    // SDXL turns an empty negative prompt into a zero context (unless EDM-v).
    let zero_negative = ms.spec.zero_empty_negative && p.negative_prompt.is_empty() && ms.prediction != Prediction::EdmV;
    let negative = CondRequest { text: &p.negative_prompt, zero_out_masked: zero_negative, ..base.clone() };
    let uncond = if r.use_uncond {
        let mut u = ms.cond.encode(&negative)?;
        if u.concat.is_none() && pass_concat {
            u.concat = concat.clone();
        }
        Some(u)
    } else {
        None
    };
    // Kontext-style 3-way guidance needs its own pass without the reference latents.
    let ref_latent_img_cfg = r.use_img_uncond && has_ref_latents && ms.spec.ref_latent_img_cfg;
    let img_uncond = if r.use_img_uncond {
        Some(match &uncond {
            Some(u) if !ref_latent_img_cfg => Condition { concat: img_uncond_concat, ..u.clone() },
            _ => {
                // Without the reference latents, the LLM does not see the images either.
                let negative = if ref_latent_img_cfg { CondRequest { ref_images: &[], ..negative.clone() } } else { negative.clone() };
                let mut c = ms.cond.encode(&negative)?;
                if c.concat.is_none() && pass_concat {
                    c.concat = img_uncond_concat;
                }
                c
            }
        })
    } else {
        None
    };
    Ok((cond, uncond, img_uncond))
}

/// The full-resolution mask [W, H, 1, 1] as one channel per pixel of each `p`×`p` block:
/// [W/p, H/p, p·p, 1], channel `(y % p)·p + x % p` (Flux Fill).
fn mask_patches(mask: &Tensor, p: usize) -> Result<Tensor> {
    let (w, h) = (mask.ne(0), mask.ne(1));
    ensure!(w % p == 0 && h % p == 0, "mask of {w}x{h} is not a multiple of {p}");
    let (lw, lh) = (w / p, h / p);
    let src = mask.data();
    let mut out = vec![0f32; w * h];
    for y in 0..h {
        for x in 0..w {
            let ch = (y % p) * p + x % p;
            out[(ch * lh + y / p) * lw + x / p] = src[y * w + x];
        }
    }
    Tensor::from_vec(&[lw, lh, p * p, 1], out)
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

/// Skip-layer guidance: on the steps strictly between `layer_start` and `layer_end` (as
/// fractions of the schedule's length), the prediction moves away from a pass that skips
/// `layers` by `scale`; with `slg_uncond` (extra sample arg) the unconditional pass skips
/// them instead.
struct SkipLayerGuidance {
    layers: Vec<i32>,
    scale: f32,
    uncond: bool,
    start_step: i32,
    stop_step: i32,
}

impl SkipLayerGuidance {
    fn new(p: &crate::params::SlgParams, extra: &ExtraArgs, supported: bool, schedule_len: usize) -> SkipLayerGuidance {
        let mut uncond = false;
        for (k, v) in extra.pairs() {
            if k == "slg_uncond" {
                match crate::runtime::args::parse_strict_bool(v) {
                    Some(b) => uncond = b,
                    None => sd_warn!("ignoring invalid SLG extra sample arg '{k}={v}'"),
                }
            }
        }
        let mut enabled = (p.scale != 0.0 || uncond) && !p.layers.is_empty();
        if enabled && !supported {
            sd_warn!("SLG is incompatible with this model type");
            enabled = false;
        }
        SkipLayerGuidance {
            layers: if enabled { p.layers.clone() } else { Vec::new() },
            scale: if enabled { p.scale } else { 0.0 },
            uncond,
            start_step: (p.layer_start * schedule_len as f32) as i32,
            stop_step: (p.layer_end * schedule_len as f32) as i32,
        }
    }

    fn enabled_for_step(&self, step: i32) -> bool {
        !self.layers.is_empty() && step > self.start_step && step < self.stop_step
    }
}

/// Shows `latents` through the preview callback, decoded as configured.
fn send_preview(
    latents: &Tensor,
    step: i32,
    noisy: bool,
    config: &PreviewConfig,
    projection: Option<&preview::Projection>,
    decoder: &mut dyn FirstStage,
    tiling: &TilingParams,
    circular: (bool, bool),
) {
    if config.mode == Preview::None {
        return;
    }
    // A stack of layers is previewed as one picture per layer.
    let stacked = (latents.shape().len() == 5).then(|| latents.ne(2));
    let layers = match picture_latents(latents, stacked) {
        Ok(v) => v,
        Err(e) => {
            sd_error!("preview failed at step {step}: {e}");
            return;
        }
    };
    let images: Result<Vec<Image>> = match config.mode {
        Preview::Proj => layers.iter().map(|l| preview::project(l, projection)).collect(),
        _ => {
            let out = decoder.begin().and_then(|_| {
                layers
                    .iter()
                    .map(|l| decoder.decode(&decoder.diffusion_to_vae(l), tiling, circular, None).and_then(|t| tensor_to_image(&t, 0)))
                    .collect()
            });
            decoder.end();
            out
        }
    };
    match images {
        Ok(images) => callbacks::preview(step, &images, noisy),
        Err(e) => sd_error!("preview decode failed at step {step}: {e}"),
    }
}

/// The error of a cancelled generation.
pub fn cancelled() -> Error {
    Error::new("generation cancelled")
}

#[allow(clippy::too_many_arguments)]
pub(super) fn sample(
    ms: &mut ModelSet,
    prepared: &Prepared,
    noise: &Tensor,
    r: &Request,
    plan: &Plan,
    tiling: &TilingParams,
    circular: (bool, bool),
    rng: &mut dyn Rng,
    cancel: &CancelFlag,
) -> Result<Tensor> {
    let projection = ms.spec.preview;
    let ms_slg_supported = ms.spec.skip_layer_guidance;
    let ms_ref_latent_img_cfg = ms.spec.ref_latent_img_cfg;
    let backbone = match ms.version {
        v if v.is_unet() => Backbone::UNet,
        v if v.is_dit() => Backbone::DiT,
        _ => Backbone::Other,
    };
    let ModelSet { diffusion, denoiser, first_stage, preview: preview_vae, control_net, .. } = ms;
    let denoiser: &Denoiser = denoiser;
    let decoder: &mut dyn FirstStage = match preview_vae {
        Some(p) => p.as_mut(),
        None => first_stage.as_mut(),
    };
    let steps = plan.sigmas.len().saturating_sub(1) as i32;
    let needs_uncond = samplers::needs_uncond_denoised(plan.method);
    let preview = callbacks::preview_config();
    let init = &prepared.init_latent;
    let mask = &prepared.denoise_mask;
    let mut last_progress = Instant::now();

    let slg = SkipLayerGuidance::new(&r.guidance.slg, &r.extra, ms_slg_supported, plan.sigmas.len());
    let ref_latents: &[Tensor] = if r.refs.pass_to_dit { &prepared.ref_latents } else { &[] };
    // Kontext's image-unconditional pass sees no reference latents.
    let img_uncond_refs: &[Tensor] = if ms_ref_latent_img_cfg { &[] } else { ref_latents };

    let mut cache = StepCache::new(&r.cache, backbone, &plan.sigmas, denoiser, needs_uncond);

    let x_t = denoiser.noise_scaling(plan.sigmas[0], noise, init)?;
    // The ControlNet runs only with a control image.
    let mut control = match (control_net.as_mut(), &prepared.control_hint) {
        (Some(cn), Some(hint)) => {
            cn.begin_run(hint)?;
            Some(cn)
        }
        _ => None,
    };
    if let Err(e) = diffusion.begin() {
        if let Some(cn) = control.as_mut() {
            cn.end_run();
        }
        return Err(e);
    }
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
        // A forecast step skips the model (and the noisy preview) altogether.
        let forecast = cache.forecast();
        if forecast.is_none() && preview.noisy && preview.due(step.abs()) {
            send_preview(&input, step, true, &preview, projection, decoder, tiling, circular);
        }
        let timesteps = [t];
        let skip_step = slg.enabled_for_step(step);
        let (denoised, uncond_denoised) = match forecast {
            Some(denoised) => (denoised, None),
            None => {
                cache.begin_step(step, sigma);
                let mut run = |cache: &mut StepCache, pass: Pass, c: &Condition, refs: &[Tensor], skip_layers: &[i32], controls: Option<&[Tensor]>| {
                    if let Some(out) = cache.reuse(pass, &input) {
                        return Ok(out);
                    }
                    let dinput = DiffusionInput {
                        guidance: r.guidance.distilled_guidance,
                        ref_latents: refs,
                        ref_index_mode: r.refs.ref_index_mode,
                        skip_layers,
                        controls,
                        control_strength: r.control_strength,
                        ..DiffusionInput::new(&input, &timesteps, c)
                    };
                    let out = diffusion.compute(&dinput).map_err(|e| Error::new(format!("diffusion model compute failed: {e}")))?;
                    cache.store(pass, &input, &out);
                    Ok::<_, Error>(out)
                };
                // Like the reference, the ControlNet runs under the prompt's condition, then
                // under the negative one; the image-unconditioned pass reuses the last residuals.
                let mut controls = None;
                if let Some(cn) = control.as_mut() {
                    controls = Some(cn.controls(&input, &timesteps, &prepared.cond)?);
                }
                let cond_out = run(&mut cache, Pass::Cond, &prepared.cond, ref_latents, &[], controls.as_deref())?;
                let uncond_skip: &[i32] = if skip_step && slg.uncond { &slg.layers } else { &[] };
                if !uncond_skip.is_empty() {
                    sd_debug!("Skipping layers at uncond step {step}");
                }
                if let (Some(cn), Some(u)) = (control.as_mut(), prepared.uncond.as_ref()) {
                    controls = Some(cn.controls(&input, &timesteps, u)?);
                }
                let uncond_out = prepared
                    .uncond
                    .as_ref()
                    .map(|c| run(&mut cache, Pass::Uncond, c, ref_latents, uncond_skip, controls.as_deref()))
                    .transpose()?;
                let img_out = prepared
                    .img_uncond
                    .as_ref()
                    .map(|c| run(&mut cache, Pass::ImgUncond, c, img_uncond_refs, &[], controls.as_deref()))
                    .transpose()?;
                let mut guided = guide(&r.guidance, &cond_out, uncond_out.as_ref(), img_out.as_ref());
                // Like the reference, a step whose outputs are reused gets no skip-layer pass.
                if skip_step && slg.scale != 0.0 && !cache.step_skipped() {
                    sd_debug!("Skipping layers at step {step}");
                    let skipped = run(&mut cache, Pass::Cond, &prepared.cond, ref_latents, &slg.layers, controls.as_deref())?;
                    let scale = slg.scale;
                    let d: Vec<f32> = guided.data().iter().zip(cond_out.data()).zip(skipped.data()).map(|((&g, &c), &k)| g + (c - k) * scale).collect();
                    guided = Tensor::from_vec(guided.shape(), d)?;
                }

                let to_denoised = |pred: &Tensor| pred.zip(x, |p, xv| p * s.c_out + xv * s.c_skip);
                let denoised = to_denoised(&guided);
                let uncond_denoised = needs_uncond.then(|| to_denoised(img_out.as_ref().or(uncond_out.as_ref()).unwrap_or(&cond_out)));
                cache.observe(&denoised);
                (denoised, uncond_denoised)
            }
        };
        let denoised = blend(&denoised, init, mask)?;
        if preview.denoised && preview.due(step.abs()) {
            send_preview(&denoised, step, false, &preview, projection, decoder, tiling, circular);
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
        &r.extra,
        Some(denoiser),
    );
    diffusion.end();
    if let Some(cn) = control {
        cn.end_run();
    }
    let x0 = result?;
    cache.log_summary(plan.sigmas.len().saturating_sub(1));
    Ok(denoiser.inverse_noise_scaling(*plan.sigmas.last().unwrap_or(&0.0), x0))
}

/// `denoised * mask + init * (1 - mask)`, the mask [W, H, 1, 1] broadcast over channels
/// (and over the layers of a stack [W, H, T, C, 1]).
fn blend(denoised: &Tensor, init: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if let [w, h, rest @ ..] = denoised.shape() {
        if rest.len() > 2 {
            let planes = [*w, *h, rest.iter().product(), 1];
            let out = blend(&denoised.clone().reshape(&planes)?, &init.clone().reshape(&planes)?, mask)?;
            return out.reshape(denoised.shape());
        }
    }
    let kept = zip_channels(denoised, mask, |d, m| d * m)?;
    let orig = zip_channels(init, mask, |i, m| i * (1.0 - m))?;
    Ok(kept.zip(&orig, |a, b| a + b))
}

/// The latents of the pictures one final latent gives: with `layers`, each of the first
/// `layers` layers of a stack `[W, H, T, C, 1]` (the reference's message when it has fewer),
/// else the latent itself.
fn picture_latents(lat: &Tensor, layers: Option<usize>) -> Result<Vec<Cow<'_, Tensor>>> {
    let Some(n) = layers else {
        return Ok(vec![Cow::Borrowed(lat)]);
    };
    ensure!(lat.shape().len() == 5 && lat.ne(2) >= n, "qwen image layered expected at least {n} latent layers, got shape dim={}", lat.shape().len());
    (0..n).map(|i| latent_layer(lat, i).map(Cow::Owned)).collect()
}

/// Layer `i` `[W, H, C, 1]` of a stack of latents `[W, H, T, C, 1]`.
fn latent_layer(stack: &Tensor, i: usize) -> Result<Tensor> {
    let (w, h, t, c) = (stack.ne(0), stack.ne(1), stack.ne(2), stack.ne(3));
    ensure!(stack.shape().len() == 5 && i < t, "no layer {i} in latents of shape {:?}", stack.shape());
    let plane = w * h;
    let mut data = Vec::with_capacity(plane * c);
    for ch in 0..c {
        let at = (ch * t + i) * plane;
        data.extend_from_slice(&stack.data()[at..at + plane]);
    }
    Tensor::from_vec(&[w, h, c, 1], data)
}

/// Decodes final latents to images (`layers` pictures from each stack of a layered family);
/// fewer when cancelled meanwhile (none is an error).
fn decode_all(ms: &mut ModelSet, latents: &[Tensor], layers: Option<usize>, tiling: &TilingParams, circular: (bool, bool), cancel: &CancelFlag) -> Result<Vec<Image>> {
    sd_info!("decoding {} latents", latents.len());
    let start = Instant::now();
    let fs = ms.first_stage.as_mut();
    fs.begin()?;
    let images = decode_each(fs, latents, layers, tiling, circular, cancel);
    fs.end();
    let images = images?;
    sd_info!("decode_first_stage completed, taking {:.2}s", start.elapsed().as_secs_f32());
    ensure!(!images.is_empty(), "cancelled before any latent images were decoded");
    Ok(images)
}

/// Diffusion latent → image [W, H, 3, N] in [0, 1], retried in tiles when a whole decode
/// fails (e.g. out of memory). Between the first stage's phase hooks.
pub(super) fn decode_latent(fs: &mut dyn FirstStage, lat: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
    let vae_latent = fs.diffusion_to_vae(lat);
    let mut progress = |s: i32, n: i32, secs: f32| callbacks::progress(s, n, secs);
    match fs.decode(&vae_latent, tiling, circular, Some(&mut progress)) {
        Ok(d) => Ok(d),
        Err(e) => match retry_tiling(tiling, lat.ne(0) as i64, lat.ne(1) as i64) {
            Some(retry) => {
                sd_warn!("decode failed ({e}); retrying with {}x{} tiles", retry.tile_size_x, retry.tile_size_y);
                fs.decode(&vae_latent, &retry, circular, Some(&mut progress))
            }
            None => Err(e),
        },
    }
}

fn decode_each(
    fs: &mut dyn FirstStage,
    latents: &[Tensor],
    layers: Option<usize>,
    tiling: &TilingParams,
    circular: (bool, bool),
    cancel: &CancelFlag,
) -> Result<Vec<Image>> {
    let mut images = Vec::new();
    'latents: for (i, lat) in latents.iter().enumerate() {
        if cancel.stop_now() {
            sd_error!("cancelling latent decodings");
            break;
        }
        let t = Instant::now();
        let pieces = picture_latents(lat, layers)?;
        for (layer, piece) in pieces.iter().enumerate() {
            // Between the layers of a stack too.
            if layer > 0 && cancel.stop_now() {
                sd_error!("cancelling latent decodings");
                break 'latents;
            }
            let what = if layers.is_some() { format!("latent {} layer {}", i + 1, layer + 1) } else { format!("latent {}", i + 1) };
            let decoded = decode_latent(fs, piece, tiling, circular).map_err(|e| Error::new(format!("decode_first_stage failed for {what}: {e}")))?;
            images.push(tensor_to_image(&decoded, 0)?);
        }
        sd_info!("latent {} decoded, taking {:.2}s", i + 1, t.elapsed().as_secs_f32());
    }
    Ok(images)
}

/// Text/image to image: `batch_count` RGB images, fewer when new latents were cancelled.
pub fn generate(ms: &mut ModelSet, p: &ImgGenParams, cancel: &CancelFlag) -> Result<Vec<Image>> {
    ms.weights.validate()?;
    if let Some(cn) = &ms.control_net {
        cn.validate()?;
    }
    check_params(p)?;
    let t0 = Instant::now();
    ms.apply_loras(&p.loras)?;
    let mut r = resolve_request(ms, p);
    let multiple = ms.spec.latent.size_multiple() as i32;
    let hires = super::hires::resolve(&p.hires, r.width as i32, r.height as i32, multiple)?;
    ensure!(hires.is_none() || !ms.spec.layered, "the hires fix is not supported for {} models in this build", ms.version.name());
    sd_info!("generate_image {}x{}", r.width, r.height);
    let tiling = runtime_tiling(&p.vae_tiling_params);
    let circular = (p.circular_x, p.circular_y);
    for runner in ms.runners() {
        runner.options.circular_x = p.circular_x;
        runner.options.circular_y = p.circular_y;
    }

    let mut rngs = GenerationRngs::new(ms.rng_type, ms.sampler_rng_type);
    rngs.manual_seed(r.seed as u64);
    let default_shift = ms.default_flow_shift;
    ms.denoiser.set_flow_shift(unset_if_infinite(p.sample_params.flow_shift), default_shift);
    let mut plan = resolve_plan(ms, p, &r)?;
    let mut prepared = prepare(ms, p, &mut r, &mut plan, &tiling, circular, &mut rngs)?;

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
        let x0 = sample(ms, &prepared, &noise, &r, &plan, &tiling, circular, rngs.sampler(), cancel)
            .map_err(|e| Error::new(format!("sampling for image {}/{} failed: {e}", b + 1, p.batch_count)))?;
        sd_info!("sampling completed, taking {:.2}s", t.elapsed().as_secs_f32());
        finals.push(x0);
    }
    sd_info!("generating {} latent images completed, taking {:.2}s", finals.len(), start.elapsed().as_secs_f32());
    ensure!(!finals.is_empty(), "no latent images generated");
    if let Some(h) = &hires {
        finals = super::hires::run(ms, h, p, &r, &plan, &mut prepared, finals, &tiling, circular, &mut rngs, cancel)?;
    }
    finals.iter().for_each(record_final_latent);
    let layers = ms.spec.layered.then_some(r.layers + 1);
    let images = decode_all(ms, &finals, layers, &tiling, circular, cancel)?;
    sd_info!("generate_image completed in {:.2}s", t0.elapsed().as_secs_f32());
    Ok(images)
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
    fn stacks_of_layers_blend_per_plane_and_split_into_layers() {
        // [W=2, H=1, T=2, C=2, 1]: value = 10·c + 5·t + x.
        let stack = Tensor::from_vec(&[2, 1, 2, 2, 1], vec![0., 1., 5., 6., 10., 11., 15., 16.]).unwrap();
        assert_eq!(latent_layer(&stack, 1).unwrap().data(), &[5., 6., 15., 16.]);
        assert_eq!(latent_layer(&stack, 0).unwrap().shape(), &[2, 1, 2, 1]);
        assert!(latent_layer(&stack, 2).is_err());
        let init = Tensor::full(stack.shape(), 100.0);
        let mask = Tensor::from_vec(&[2, 1, 1, 1], vec![1.0, 0.0]).unwrap();
        let b = blend(&stack, &init, &mask).unwrap();
        assert_eq!(b.shape(), stack.shape());
        assert_eq!(b.data(), &[0., 100., 5., 100., 10., 100., 15., 100.]);
    }

    #[test]
    fn rgba_families_get_an_opaque_alpha() {
        let rgb = Image::new(1, 1, 3, vec![255, 0, 51]).unwrap();
        let grey = Image::new(1, 1, 1, vec![102]).unwrap();
        let rgba = Image::new(1, 1, 4, vec![0, 0, 0, 51]).unwrap();
        assert_eq!(image_tensor(&rgb, 1, 1, 4).unwrap().data(), &[1.0, 0.0, 0.2, 1.0]);
        assert_eq!(image_tensor(&grey, 1, 1, 4).unwrap().data(), &[0.4, 0.4, 0.4, 1.0]);
        assert_eq!(image_tensor(&rgba, 1, 1, 4).unwrap().data(), &[0.0, 0.0, 0.0, 0.2]);
        assert_eq!(image_tensor(&rgba, 1, 1, 3).unwrap().data(), &[0.0, 0.0, 0.0]);
    }

    #[test]
    fn mask_patches_put_each_block_in_channels() {
        let mask = Tensor::from_vec(&[4, 2, 1, 1], (0..8).map(|v| v as f32).collect()).unwrap();
        let p = mask_patches(&mask, 2).unwrap();
        assert_eq!(p.shape(), &[2, 1, 4, 1]);
        // Block 0 holds (0,0), (1,0), (0,1), (1,1) = 0, 1, 4, 5; block 1 holds 2, 3, 6, 7.
        assert_eq!(p.data(), &[0., 2., 1., 3., 4., 6., 5., 7.]);
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
