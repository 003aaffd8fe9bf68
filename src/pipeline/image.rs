//! `generate_image` for every family: resolving the request like the reference (size
//! alignment, seed, guidance, sampler, schedule), preparing the latents (txt2img, img2img,
//! masks, inpainting, edit references), the conditioning, the sampling loop with
//! classifier-free guidance, and decoding. Family facts come from the model set's
//! [`FamilySpec`](super::families::FamilySpec); the networks are reached through the
//! conditioner, diffusion-model and first-stage traits.

use super::callbacks::{self, CancelFlag};
use super::conditioning::CondRequest;
use super::extensions::{Conditioned, ExtRequest};
use super::families::{Concat, ModelSet};
use super::imageops::{concat_channels, image_to_tensor, max_pool_3x3, resize_nearest, resize_nearest_max, tensor_to_image, zip_channels};
use super::request::{check_params, resolve_plan, resolve_request, runtime_tiling, Plan, Request};
use super::sampling::{self, cancelled, picture_latents, Job, Prepared, Previewer, Stage, TimestepRule};
use crate::error::{Error, Result};
use crate::image::Image;
use crate::models::vae::FirstStage;
use crate::models::Condition;
use crate::params::ImgGenParams;
use crate::runtime::defaults::unset_if_infinite;
use crate::runtime::rng::{randn_like, GenerationRngs, Rng};
use crate::runtime::tiling::{retry_tiling, vae_circular, TilingParams};
use crate::tensor::Tensor;
use crate::types::Prediction;
use std::borrow::Cow;
use std::cell::RefCell;
use std::time::Instant;

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

/// An image as [W, H, 3, 1] in [0, 1] at the request's size (grey images become RGB,
/// extra channels such as alpha are dropped).
pub(super) fn rgb_tensor(img: &Image, w: usize, h: usize) -> Result<Tensor> {
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
/// or the request's size (`resize_vae_to_target`), sides rounded to `multiple` (16, Qwen-Image
/// 32; 0: never resized, PiD).
fn ref_image_for_vae(img: &Image, r: &Request, multiple: usize, channels: usize) -> Result<Tensor> {
    let t = image_tensor(img, img.width as usize, img.height as usize, channels)?;
    if !r.refs.resize_before_vae || multiple == 0 {
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

/// Families whose latents have channels in front that the first stage does not make
/// (SeFi-Image) cannot sample from encoded pictures: the reference's transformer then meets
/// latents short of those channels and crashes. Refused before any work; reference images
/// that stay out of the transformer (`pass_to_dit=false`) are harmless.
fn check_encodable_inputs(ms: &ModelSet, p: &ImgGenParams, r: &Request, hires: Option<&super::hires::Hires>) -> Result<()> {
    let n = ms.spec.unencoded_channels;
    if n == 0 {
        return Ok(());
    }
    let why = format!(
        "the VAE makes the last {} of the model's {} latent channels, not the {n} in front (stable-diffusion.cpp crashes here)",
        ms.spec.latent.channels - n,
        ms.spec.latent.channels
    );
    let name = ms.version.name();
    ensure!(p.init_image.is_none(), "{name} cannot start from an init image: {why}");
    ensure!(
        p.ref_images.is_empty() || !r.refs.pass_to_dit,
        "{name} cannot take reference images into its transformer: {why} (ref_image_args \"pass_to_dit=false\" leaves them out)"
    );
    if let Some(h) = hires.filter(|h| !h.in_latent_space()) {
        bail!("{name} cannot use the hires fix's {} upscaler, which encodes the upscaled picture again: {why} (the latent upscalers work)", h.upscaler.name());
    }
    Ok(())
}

/// The batch of `frames` latents `[W, H, C, frames]` that each start as `latent` `[W, H, C, 1]`.
fn repeat_frames(latent: Tensor, frames: usize) -> Result<Tensor> {
    if frames == 1 {
        return Ok(latent);
    }
    let shape = [latent.ne(0), latent.ne(1), latent.ne(2), frames];
    Tensor::from_vec(&shape, latent.data().repeat(frames))
}

/// `frames` > 1: AnimateDiff's batch of video frames, each starting from the init latent
/// (the encoded init image, or zeros); the other latents stay single frames the diffusion
/// model broadcasts.
#[allow(clippy::too_many_arguments)]
fn prepare(
    ms: &mut ModelSet,
    p: &ImgGenParams,
    r: &mut Request,
    plan: &mut Plan,
    tiling: &TilingParams,
    circular: (bool, bool),
    rngs: &mut GenerationRngs,
    frames: usize,
) -> Result<Prepared> {
    let (w, h) = (r.width, r.height);
    let latent = ms.spec.latent;
    let (lw, lh) = (w / latent.vae_scale, h / latent.vae_scale);
    let concat_kind = ms.spec.concat;
    let channels = ms.spec.image_channels;
    let start = Instant::now();
    let total_steps = plan.sample_steps;
    let mut init_image = None;
    if let Some(img) = &p.init_image {
        // The reference samples the init image's single latent and then fails to decode it
        // into layers: refused before any work (the picture to decompose is a reference image).
        ensure!(!ms.spec.is_layered(), "qwen image layered expected at least {} latent layers, got shape dim=4 (give the picture to decompose as a reference image)", r.layers + 1);
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
        None if ms.spec.is_layered() => Tensor::zeros(&[lw, lh, r.layers + 1, latent.channels, 1]),
        None => Tensor::zeros(&[lw, lh, latent.channels, 1]),
    };
    // Like the reference, a control image is encoded whenever one is given (before the
    // reference images; the encoding draws from the noise generator); only the control
    // families read the latent, a ControlNet reads the image itself.
    let takes_control = matches!(concat_kind, Concat::FluxControls | Concat::Flex2);
    let mut control_image = None;
    let control_latent = match &p.control_image {
        Some(img) => {
            let image = rgb_tensor(img, w, h)?;
            let latent = encode("control image", &image)?;
            if !takes_control && !ms.extensions.iter().any(|e| e.reads_control_image()) {
                sd_warn!("a control image was given but no ControlNet is loaded; ignoring it");
            }
            control_image = Some(image);
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
    } else if !p.ref_images.is_empty() && ms.cond.reads_ref_images() {
        if !r.refs.pass_to_vlm {
            sd_warn!("{} reads reference images only with ref_image_args \"pass_to_vlm=true\" (edit); ignoring ref_images", ms.version.name());
        }
    } else if !p.ref_images.is_empty() {
        sd_warn!("{} does not use reference images; ignoring ref_images", ms.version.name());
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
    ms.cond.begin()?;
    // Extensions act before the prompt is encoded (PhotoMaker fuses its ID embeddings into a
    // condition of its own and takes its trigger word out of the prompt).
    let mut ext = ExtRequest {
        cond: ms.cond.as_mut(),
        params: p,
        text: p.prompt.clone(),
        clip_skip: p.clip_skip,
        width: w,
        height: h,
        total_steps,
        control_image: control_image.as_ref(),
    };
    let mut prepared_ext = Ok(());
    for e in ms.extensions.iter_mut() {
        prepared_ext = prepared_ext.and_then(|_| e.prepare(&mut ext));
    }
    let text = ext.text;
    let base = CondRequest { text: &text, clip_skip: p.clip_skip, width: w, height: h, zero_out_masked: false, ref_images: &vlm_images, refs: r.refs, shown: &[] };
    let conds = prepared_ext.and_then(|_| encode_conditions(ms, &base, p, r, !ref_latents.is_empty(), concat, img_uncond_concat));
    ms.cond.end();
    let (cond, uncond, img_uncond) = conds?;
    sd_info!("get_learned_condition completed, taking {:.2}s", start.elapsed().as_secs_f32());
    // The IP-Adapter encodes its image here.
    let done = Conditioned { cond: &cond, params: p };
    for e in ms.extensions.iter_mut() {
        e.conditioned(&done)?;
    }
    let init_latent = repeat_frames(init_latent, frames)?;
    Ok(Prepared { init_latent, denoise_mask: Some(denoise_mask), ref_latents, cond, uncond, img_uncond })
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
        let mut u = ms.cond.unconditional(&cond, &negative)?;
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

/// One picture's sampling run: the model set's diffusion model over the whole plan, from
/// `noise` on the prepared init latent.
#[allow(clippy::too_many_arguments)]
pub(super) fn sample_image(
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
    let spec = ms.spec;
    // The reference scales HiDream-O1's starting noise by eta.
    let scaled;
    let noise = if spec.noise_times_eta {
        scaled = noise.map(|v| v * plan.eta);
        &scaled
    } else {
        noise
    };
    let ModelSet { diffusion, denoiser, first_stage, preview, extensions, .. } = ms;
    let decoder: &mut dyn FirstStage = match preview {
        Some(p) => p.as_mut(),
        None => first_stage.as_mut(),
    };
    let mut job = Job {
        request: r,
        prepared,
        denoiser,
        preview: Previewer { decoder, projection: spec.preview, tiling, circular, video: false },
        backbone: spec.backbone(),
        slg_supported: spec.skip_layer_guidance,
        ref_latent_img_cfg: spec.ref_latent_img_cfg,
        timesteps: TimestepRule::Scalar,
        video: None,
        extensions,
        cancel,
    };
    let stage = Stage {
        diffusion: diffusion.as_mut(),
        sigmas: &plan.sigmas,
        method: plan.method,
        eta: plan.eta,
        guidance: &r.guidance,
        use_uncond: true,
        extra: &r.extra,
        noise: Some(noise),
        shifted_timestep: r.shifted_timestep,
        last: true,
    };
    sampling::sample(&mut job, stage, &prepared.init_latent, rng)
}

/// How the pictures of one final latent are laid out.
#[derive(Clone, Copy)]
enum Pictures {
    One,
    /// The first `n` layers of a stack (layered families).
    Layers(usize),
    /// Each of a batch of `n` video frames (AnimateDiff).
    Frames(usize),
}

/// Decodes final latents to images; fewer when cancelled meanwhile (none is an error).
fn decode_all(ms: &mut ModelSet, latents: &[Tensor], pictures: Pictures, tiling: &TilingParams, circular: (bool, bool), cancel: &CancelFlag) -> Result<Vec<Image>> {
    sd_info!("decoding {} latents", latents.len());
    let start = Instant::now();
    let fs = ms.first_stage.as_mut();
    fs.begin()?;
    let images = decode_each(fs, latents, pictures, tiling, circular, cancel);
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
    pictures: Pictures,
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
        let pieces = match pictures {
            Pictures::Frames(n) => {
                ensure!(lat.shape().len() <= 4 && n <= lat.ne(3), "no frame {} in latents of shape {:?}", n.saturating_sub(1), lat.shape());
                lat.unstack(3)?.into_iter().take(n).map(Cow::Owned).collect()
            }
            Pictures::Layers(n) => picture_latents(lat, Some(n))?,
            Pictures::One => picture_latents(lat, None)?,
        };
        for (layer, piece) in pieces.iter().enumerate() {
            // Between the layers of a stack (the frames of a video) too.
            if layer > 0 && cancel.stop_now() {
                sd_error!("cancelling latent decodings");
                break 'latents;
            }
            let what = match pictures {
                Pictures::One => format!("latent {}", i + 1),
                Pictures::Layers(_) => format!("latent {} layer {}", i + 1, layer + 1),
                Pictures::Frames(n) => format!("AnimateDiff frame {}/{n}", layer + 1),
            };
            let decoded = decode_latent(fs, piece, tiling, circular).map_err(|e| Error::new(format!("decode_first_stage failed for {what}: {e}")))?;
            images.push(tensor_to_image(&decoded, 0)?);
        }
        sd_info!("latent {} decoded, taking {:.2}s", i + 1, t.elapsed().as_secs_f32());
    }
    Ok(images)
}

/// Text/image to image: `batch_count` RGB images, fewer when new latents were cancelled.
pub fn generate_image(ms: &mut ModelSet, p: &ImgGenParams, cancel: &CancelFlag) -> Result<Vec<Image>> {
    generate(ms, p, 1, cancel)
}

/// AnimateDiff's video: the request's one latent as a batch of `frames` frames that the
/// UNet's motion modules relate, each decoded to its picture (`p.batch_count` is 1).
pub(super) fn generate_frames(ms: &mut ModelSet, p: &ImgGenParams, frames: usize, cancel: &CancelFlag) -> Result<Vec<Image>> {
    generate(ms, p, frames, cancel)
}

/// One request; the extensions drop what they kept of it afterwards, whatever the outcome.
fn generate(ms: &mut ModelSet, p: &ImgGenParams, frames: usize, cancel: &CancelFlag) -> Result<Vec<Image>> {
    let out = run_request(ms, p, frames, cancel);
    ms.extensions.iter_mut().for_each(|e| e.end_request());
    out
}

fn run_request(ms: &mut ModelSet, p: &ImgGenParams, frames: usize, cancel: &CancelFlag) -> Result<Vec<Image>> {
    ms.weights.validate()?;
    for e in &ms.extensions {
        e.validate()?;
    }
    check_params(p)?;
    let t0 = Instant::now();
    ms.apply_loras(&p.loras)?;
    let mut r = resolve_request(ms, p);
    let multiple = ms.spec.latent.size_multiple() as i32;
    let hires = super::hires::resolve(&p.hires, r.width as i32, r.height as i32, multiple)?;
    ensure!(hires.is_none() || !ms.spec.is_layered(), "the hires fix is not supported for {} models in this build", ms.version.name());
    check_encodable_inputs(ms, p, &r, hires.as_ref())?;
    sd_info!("generate_image {}x{}", r.width, r.height);
    let tiling = runtime_tiling(&p.vae_tiling_params, ms.spec.encode_tile_factor, false);
    let vae_scale = ms.spec.latent.vae_scale as i64;
    let vae_axes = vae_circular(&tiling, (p.circular_x, p.circular_y), r.width as i64 / vae_scale, r.height as i64 / vae_scale);
    for runner in ms.runners() {
        runner.options.circular_x = p.circular_x;
        runner.options.circular_y = p.circular_y;
    }
    for runner in ms.first_stage_runners() {
        (runner.options.circular_x, runner.options.circular_y) = vae_axes.conv;
    }
    let circular = vae_axes.tiles;

    let mut rngs = GenerationRngs::new(ms.rng_type, ms.sampler_rng_type);
    rngs.manual_seed(r.seed as u64);
    let default_shift = ms.default_flow_shift;
    ms.denoiser.set_flow_shift(unset_if_infinite(p.sample_params.flow_shift), default_shift);
    let mut plan = resolve_plan(ms, p, &r)?;
    let mut prepared = prepare(ms, p, &mut r, &mut plan, &tiling, circular, &mut rngs, frames)?;

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
        let x0 = sample_image(ms, &prepared, &noise, &r, &plan, &tiling, circular, rngs.sampler(), cancel)
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
    let pictures = if frames > 1 {
        Pictures::Frames(frames)
    } else if ms.spec.is_layered() {
        Pictures::Layers(r.layers + 1)
    } else {
        Pictures::One
    };
    let images = decode_all(ms, &finals, pictures, &tiling, circular, cancel)?;
    sd_info!("generate_image completed in {:.2}s", t0.elapsed().as_secs_f32());
    Ok(images)
}

#[cfg(test)]
mod tests {
    use super::*;

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
