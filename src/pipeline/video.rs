//! `generate_video` for the video families (Wan 2.x; SD 1.x with AnimateDiff motion modules
//! goes to `animatediff`): the request resolved like the
//! reference (sizes aligned up, frames aligned down to whole latent frames), the latents and
//! conditions of the model's mode (text-to-video; TI2V's first and last frames fixed in the
//! latent; I2V's and FLF2V's encoded frames and CLIP-vision tokens; VACE's control video),
//! then one sampling stage, or two when a high-noise expert takes the first part of the
//! schedule, then the video decoder.

use super::callbacks::{self, CancelFlag};
use super::conditioning::{CondRequest, Shown};
use super::families::{FamilySpec, FirstStageKind, FrameRule, ModelSet, VideoCond, VideoFormat};
use super::imageops::{image_to_tensor, tensor_to_image};
use super::ref_images::RefImageParams;
use super::request::{align_up, check_image_bytes, resolve_guidance, runtime_tiling, schedule, MAX_SIDE};
use super::sampling::{self, cancelled, latent_layer, Job, Prepared, Previewer, Stage};
use crate::error::{Error, Result};
use crate::image::Image;
use crate::models::diffusion::{RefRole, VideoInput};
use crate::models::Condition;
use crate::params::{Audio, GuidanceParams, RefVideo, SampleParams, VidGenParams};
use crate::runtime::args::ExtraArgs;
use crate::runtime::defaults::{default_sample_method, resolve_eta, unset_if_infinite};
use crate::runtime::rng::{randn_like, resolve_seed, GenerationRngs};
use crate::runtime::tiling::TilingParams;
use crate::tensor::Tensor;
use crate::types::{CancelMode, SampleMethod};
use std::time::Instant;

/// Most frames one request may ask for (the latent and the decoder's output grow with it).
pub const MAX_FRAMES: i32 = 4096;

/// A video request after the reference's adjustments.
struct VideoRequest {
    width: usize,
    height: usize,
    /// Frames after alignment to whole latent frames.
    frames: usize,
    seed: i64,
    guidance: GuidanceParams,
    use_uncond: bool,
    high_noise_guidance: GuidanceParams,
    use_high_noise_uncond: bool,
}

/// The sampling plan of a video: one schedule over all steps, the first `high_noise_steps`
/// of it for the high-noise expert.
struct VideoPlan {
    sigmas: Vec<f32>,
    method: SampleMethod,
    eta: f32,
    extra: ExtraArgs,
    high_noise_steps: usize,
    high_noise_method: SampleMethod,
    high_noise_eta: f32,
    high_noise_extra: ExtraArgs,
}

fn check_params(p: &VidGenParams) -> Result<()> {
    ensure!(
        (1..=MAX_SIDE).contains(&p.width) && (1..=MAX_SIDE).contains(&p.height),
        "video size {}x{} is not supported (each side must be 1 to {MAX_SIDE})",
        p.width,
        p.height
    );
    ensure!((1..=MAX_FRAMES).contains(&p.video_frames), "video_frames must be 1 to {MAX_FRAMES}, got {}", p.video_frames);
    for (what, sp) in [("sample_params", &p.sample_params), ("high_noise_sample_params", &p.high_noise_sample_params)] {
        ensure!(sp.sample_steps <= 10000, "{what}.sample_steps {} is too large", sp.sample_steps);
        ensure!(sp.guidance.txt_cfg.is_finite(), "{what}: cfg scale must be a finite number");
    }
    ensure!(
        !p.sample_params.custom_sigmas.is_empty() || p.sample_params.sample_steps >= 1,
        "sample_steps must be at least 1, got {}",
        p.sample_params.sample_steps
    );
    ensure!(p.moe_boundary.is_finite(), "moe_boundary must be a finite number");
    let images = [("init image", p.init_image.as_ref()), ("end image", p.end_image.as_ref())];
    for (what, img) in images.into_iter().chain(p.control_frames.iter().map(|f| ("control frame", Some(f)))) {
        if let Some(img) = img {
            check_image_bytes(what, img)?;
            ensure!(img.channels == 1 || img.channels >= 3, "{what} with {} channels is not supported", img.channels);
        }
    }
    Ok(())
}

/// What MiniMax-H3 takes here: text, start and end pictures (keyframes), or Ref2VA references
/// (pictures, videos with or without sound, sound); keyframes with references and control
/// frames are refused as by the reference. Its frames are at 24 fps.
fn check_minimax_h3(p: &VidGenParams) -> Result<()> {
    let references = !p.ref_images.is_empty() || !p.ref_videos.is_empty() || !p.ref_audios.is_empty();
    ensure!(
        !references || (p.init_image.is_none() && p.end_image.is_none()),
        "MiniMax-H3 keyframes and Ref2VA references cannot be used together"
    );
    ensure!(p.control_frames.is_empty(), "MiniMax-H3 control_frames are not implemented");
    for (i, img) in p.ref_images.iter().enumerate() {
        check_image_bytes(&format!("reference image {}", i + 1), img)?;
    }
    for (i, v) in p.ref_videos.iter().enumerate() {
        for img in &v.frames {
            check_image_bytes(&format!("a frame of reference video {}", i + 1), img)?;
        }
    }

    if p.fps != 24 {
        sd_warn!("MiniMax-H3 uses 24 fps; overriding requested fps {}", p.fps.max(1));
    }
    Ok(())
}

/// What LTX-2.3 refuses: control frames (as the reference does) and a strength that is no
/// number. Reference clips (ref_videos, ref_audios) are MiniMax-H3's alone: the reference
/// ignores them here, and `fields::video_warnings` says so.
fn check_ltx(p: &VidGenParams) -> Result<()> {
    ensure!(p.control_frames.is_empty(), "LTXAV control_frames are not implemented");
    ensure!(p.strength.is_finite(), "strength must be a finite number, got {}", p.strength);
    Ok(())
}

/// Reference images draw a warning: the Wan models do not read them (the reference ignores
/// them). The other ignored fields are warned about by `fields::warn_video`.
fn warn_unused(ms: &ModelSet, p: &VidGenParams) {
    if !p.ref_images.is_empty() && ms.video_cond != VideoCond::RefKeyframes {
        sd_warn!("{} does not use reference images; ignoring ref_images ({})", ms.version.name(), p.ref_images.len());
    }
}

fn resolve_request(ms: &ModelSet, p: &VidGenParams, format: &VideoFormat) -> VideoRequest {
    let multiple = ms.spec.latent.size_multiple() as i32;
    let (width, height) = (align_up(p.width, multiple), align_up(p.height, multiple));
    if (width, height) != (p.width, p.height) {
        sd_warn!("align generation request up {}x{} to {width}x{height} (multiple={multiple})", p.width, p.height);
    }
    let requested = p.video_frames.max(1) as usize;
    let frames = format.align_frames(requested);
    let (guidance, use_uncond, _) = resolve_guidance(&p.sample_params.guidance, ms.spec.supports_img_cfg(false), "");
    let (high_noise_guidance, use_high_noise_uncond) = if ms.high_noise.is_some() {
        let (g, u, _) = resolve_guidance(&p.high_noise_sample_params.guidance, ms.spec.supports_img_cfg(false), "high noise: ");
        (g, u)
    } else {
        (GuidanceParams::default(), false)
    };
    if frames != requested {
        sd_warn!("align video frames from {requested} to {frames} for {}", ms.version.name());
    }
    VideoRequest {
        width: width as usize,
        height: height as usize,
        frames,
        seed: resolve_seed(p.seed),
        guidance,
        use_uncond,
        high_noise_guidance,
        use_high_noise_uncond,
    }
}

/// The sampler of `sp`, or the family's default.
fn method_of(ms: &ModelSet, sp: &SampleParams) -> SampleMethod {
    sp.sample_method.unwrap_or_else(|| default_sample_method(Some(ms.family())))
}

/// One schedule of `sample_steps` (+ the high-noise expert's explicit steps) steps; without
/// explicit high-noise steps the expert takes the steps whose sigma is at least
/// `moe_boundary`, like the reference.
fn resolve_plan(ms: &mut ModelSet, p: &VidGenParams, r: &VideoRequest) -> Result<VideoPlan> {
    let sp = &p.sample_params;
    let hp = &p.high_noise_sample_params;
    let family = ms.family();
    let has_expert = ms.high_noise.is_some();
    let method = method_of(ms, sp);
    let extra = ExtraArgs::parse(sp.extra_sample_args.as_deref());
    let mut sample_steps = sp.sample_steps.max(0) as usize;
    // -1 (the default): split at the boundary.
    let mut high_steps: i64 = if has_expert { hp.sample_steps as i64 } else { 0 };
    let total = sample_steps + high_steps.max(0) as usize;
    let mut seq_len = ((r.width / ms.spec.latent.vae_scale) * (r.height / ms.spec.latent.vae_scale)) as i32;
    if let Some(f) = ms.spec.video().filter(|f| matches!(f.frame_rule, FrameRule::MinimaxH3 | FrameRule::Ltx)) {
        // MiniMax-H3's and LTX-2.3's schedules see every latent frame's tokens.
        seq_len *= f.latent_frames(r.frames) as i32;
    }
    let sigmas = schedule(ms, sp, method, total, seq_len, &extra)?;
    if !sp.custom_sigmas.is_empty() {
        let total = sigmas.len() - 1;
        if sample_steps >= total {
            sample_steps = total;
            sd_warn!("total_steps != custom_sigmas_count - 1, set sample_steps to {sample_steps}");
        }
        if high_steps > 0 {
            high_steps = (total - sample_steps) as i64;
            sd_warn!("total_steps != custom_sigmas_count - 1, set high_noise_sample_steps to {high_steps}");
        }
    }
    let eta = resolve_eta(unset_if_infinite(sp.eta), method, family);
    if high_steps < 0 {
        high_steps = sigmas.iter().position(|&s| s < p.moe_boundary).unwrap_or(0) as i64;
        sd_debug!("switching from high noise model at step {high_steps}");
    }
    let high_noise_steps = (high_steps.max(0) as usize).min(sigmas.len().saturating_sub(1));
    sd_info!("sampling using {} method", method.name());
    let high_noise_method = method_of(ms, hp);
    let high_noise_eta = resolve_eta(unset_if_infinite(hp.eta), high_noise_method, family);
    if high_noise_steps > 0 {
        sd_info!("sampling(high noise) using {} method", high_noise_method.name());
    }
    Ok(VideoPlan {
        sigmas,
        method,
        eta,
        extra,
        high_noise_steps,
        high_noise_method,
        high_noise_eta,
        high_noise_extra: ExtraArgs::parse(hp.extra_sample_args.as_deref()),
    })
}

/// An image as `[W, H, 3, 1]` in [0, 1] at the request's size.
pub(super) fn frame_tensor(img: &Image, w: usize, h: usize) -> Result<Tensor> {
    let t = image_to_tensor(img, Some((w, h)))?;
    ensure!(t.ne(2) == 1 || t.ne(2) >= 3, "a picture with {} channels is not supported", t.ne(2));
    let plane = w * h;
    let data = match t.ne(2) {
        1 => t.data().repeat(3),
        _ => t.data()[..3 * plane].to_vec(),
    };
    Tensor::from_vec(&[w, h, 3, 1], data)
}

/// What preparing a video's latents gives besides the shared `Prepared`.
struct VideoLatents {
    init_latent: Tensor,
    denoise_mask: Option<Tensor>,
    /// I2V: mask channels and encoded frames concatenated to the noisy latent.
    concat: Option<Tensor>,
    /// I2V / FLF2V: CLIP-vision hidden states of the pictures.
    clip_tokens: Option<Tensor>,
    /// VACE's context, and the reference latent frames in front of the video to drop.
    vace_context: Option<Tensor>,
    ref_frames: usize,
    /// LingBot: pictures `[W, H, 3, 1]` the conditioner reads (its LLM's vision tower).
    ref_images: Vec<Tensor>,
    /// LTX-2.3's end picture: its latent frames appended behind the video's (dropped before
    /// the decode) and the pixel frame they stand for.
    keyframes: usize,
    keyframe_at: Option<usize>,
    /// MiniMax-H3's keyframes and reference pictures: latents the transformer sees as extra
    /// tokens, and what each stands for.
    ref_latents: Vec<Tensor>,
    ref_roles: Vec<RefRole>,
    /// Ref2VA's reference sound latents (the roles index them).
    ref_audio_latents: Vec<Tensor>,
    /// Ref2VA: the references as the conditioner's vision tower is shown them, in order.
    shown: Vec<Shown>,
}

/// A picture `[W, H, 3, 1]` as a one-frame video `[W, H, 1, 3, 1]`.
pub(super) fn one_frame(img: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(&[img.ne(0), img.ne(1), 1, 3, 1], img.data().to_vec())
}

/// Runs `f` on the first stage between its phase hooks.
pub(super) fn with_first_stage<T>(ms: &mut ModelSet, f: impl FnOnce(&mut dyn crate::models::vae::FirstStage) -> Result<T>) -> Result<T> {
    let fs = ms.first_stage.as_mut();
    fs.begin()?;
    let out = f(fs);
    fs.end();
    out
}

/// Concatenates `a` and `b` `[W, H, T, C, 1]` along axis `axis` (2: frames, 3: channels).
pub(super) fn concat5(a: &Tensor, b: &Tensor, axis: usize) -> Result<Tensor> {
    let (w, h) = (a.ne(0), a.ne(1));
    ensure!((b.ne(0), b.ne(1)) == (w, h), "concat of {:?} and {:?}", a.shape(), b.shape());
    let plane = w * h;
    match axis {
        3 => {
            ensure!(a.ne(2) == b.ne(2), "concat of {:?} and {:?} over channels", a.shape(), b.shape());
            let mut d = a.data().to_vec();
            d.extend_from_slice(b.data());
            Tensor::from_vec(&[w, h, a.ne(2), a.ne(3) + b.ne(3), 1], d)
        }
        2 => {
            ensure!(a.ne(3) == b.ne(3), "concat of {:?} and {:?} over frames", a.shape(), b.shape());
            let (ta, tb) = (a.ne(2), b.ne(2));
            let mut d = Vec::with_capacity(a.len() + b.len());
            for c in 0..a.ne(3) {
                d.extend_from_slice(&a.data()[c * ta * plane..(c + 1) * ta * plane]);
                d.extend_from_slice(&b.data()[c * tb * plane..(c + 1) * tb * plane]);
            }
            Tensor::from_vec(&[w, h, ta + tb, a.ne(3), 1], d)
        }
        _ => bail!("concat over axis {axis} is not supported"),
    }
}

/// Latent frames `from..to` of `[W, H, T, C, 1]`.
pub(super) fn frame_range(x: &Tensor, from: usize, to: usize) -> Result<Tensor> {
    let (w, h, t, c) = (x.ne(0), x.ne(1), x.ne(2), x.ne(3));
    ensure!(from < to && to <= t, "latent frames {from}..{to} of {t}");
    let plane = w * h;
    let mut d = Vec::with_capacity(plane * (to - from) * c);
    for ch in 0..c {
        d.extend_from_slice(&x.data()[(ch * t + from) * plane..(ch * t + to) * plane]);
    }
    Tensor::from_vec(&[w, h, to - from, c, 1], d)
}

/// A denoise mask `[W, H, T, 1, 1]` for a latent of `channels` video channels with `extra`
/// channels of packed audio behind them: the mask on every video channel, ones (the model's)
/// on the audio's.
pub(super) fn mask_with_audio(mask: &Tensor, channels: usize, extra: usize) -> Result<Tensor> {
    let (w, h, t) = (mask.ne(0), mask.ne(1), mask.ne(2));
    let video = Tensor::from_vec(&[w, h, t, channels, 1], mask.data()[..w * h * t].repeat(channels))?;
    concat5(&video, &Tensor::full(&[w, h, t, extra, 1], 1.0), 3)
}

/// The grey video `[W, H, frames, 3, 1]` (0.5) with `pictures` (frame index, picture) put in.
fn grey_video(w: usize, h: usize, frames: usize, pictures: &[(usize, &Tensor)]) -> Result<Tensor> {
    let mut v = Tensor::full(&[w, h, frames, 3, 1], 0.5);
    for (i, pic) in pictures {
        let frame = Tensor::from_vec(&[w, h, 1, 3, 1], pic.data().to_vec())?;
        put_frame(&mut v, &frame, *i)?;
    }
    Ok(v)
}

fn video_latents(ms: &mut ModelSet, p: &VidGenParams, r: &mut VideoRequest, format: &VideoFormat, tiling: &TilingParams, circular: (bool, bool)) -> Result<VideoLatents> {
    let latent = ms.spec.latent;
    let (lw, lh) = (r.width / latent.vae_scale, r.height / latent.vae_scale);
    let start = Instant::now();
    let start_image = p.init_image.as_ref().map(|i| frame_tensor(i, r.width, r.height)).transpose()?;
    let end_image = p.end_image.as_ref().map(|i| frame_tensor(i, r.width, r.height)).transpose()?;
    let mut out = VideoLatents {
        init_latent: Tensor::default(),
        denoise_mask: None,
        concat: None,
        clip_tokens: None,
        vace_context: None,
        ref_frames: 0,
        ref_images: Vec::new(),
        keyframes: 0,
        keyframe_at: None,
        ref_latents: Vec::new(),
        ref_roles: Vec::new(),
        ref_audio_latents: Vec::new(),
        shown: Vec::new(),
    };
    let cond = ms.video_cond;
    let name = ms.version.name();
    let unused = |what: &str, given: bool| {
        if given {
            sd_warn!("this {name} model does not use {what}; ignoring it");
        }
    };
    match cond {
        VideoCond::ConcatFrames { clip, end_clip } => {
            sd_info!("IMG2VID");
            if clip {
                let cv = ms.clip_vision.as_mut().ok_or_else(|| Error::new("this Wan model needs a CLIP vision model (clip_vision_path)"))?;
                let mut tokens = cv.encode(start_image.as_ref()).map_err(|e| Error::new(format!("failed to compute clip vision output for init image: {e}")))?;
                if end_clip {
                    let end = cv.encode(end_image.as_ref()).map_err(|e| Error::new(format!("failed to compute clip vision output for end image: {e}")))?;
                    tokens = concat_tokens(&tokens, &end)?;
                }
                sd_info!("get_clip_vision_output completed, taking {} ms", start.elapsed().as_millis());
                out.clip_tokens = Some(tokens);
            }
            let t1 = Instant::now();
            let mut pictures = Vec::new();
            if let Some(s) = &start_image {
                pictures.push((0, s));
            }
            if let Some(e) = &end_image {
                pictures.push((r.frames - 1, e));
            }
            let video = grey_video(r.width, r.height, r.frames, &pictures)?;
            let encoded = with_first_stage(ms, |fs| fs.encode_video(&video, tiling, circular))
                .map_err(|e| Error::new(format!("failed to encode video conditioning frames: {e}")))?;
            sd_info!("encode_first_stage completed, taking {} ms", t1.elapsed().as_millis());
            let lt = encoded.ne(2);
            let mut mask = Tensor::zeros(&[lw, lh, lt, 4, 1]);
            if start_image.is_some() {
                put_frame(&mut mask, &Tensor::full(&[lw, lh, 1, 4, 1], 1.0), 0)?;
            }
            if end_image.is_some() {
                // Only the last of the 4 mask channels marks the end frame.
                let plane = lw * lh;
                let at = (3 * lt + lt - 1) * plane;
                mask.data_mut()[at..at + plane].fill(1.0);
            }
            out.concat = Some(concat5(&mask, &encoded, 3)?);
        }
        VideoCond::FixedFrames | VideoCond::FirstFrame if start_image.is_some() => {
            let first_only = cond == VideoCond::FirstFrame;
            if first_only {
                sd_info!("{name} IMG2VID");
                unused("an end image (end_image)", end_image.is_some());
            } else {
                sd_info!("IMG2VID");
            }
            let start_image = start_image.expect("checked");
            let lt = format.latent_frames(r.frames);
            let first = with_first_stage(ms, |fs| fs.encode_video(&one_frame(&start_image)?, tiling, circular))
                .map_err(|e| Error::new(format!("failed to encode init video frame: {e}")))?;
            out.init_latent = Tensor::zeros(&[lw, lh, lt, latent.channels, 1]);
            let mut mask = Tensor::full(&[lw, lh, lt, 1, 1], 1.0);
            put_frame(&mut out.init_latent, &first, 0)?;
            put_frame(&mut mask, &Tensor::zeros(&[lw, lh, 1, 1, 1]), 0)?;
            if first_only {
                out.ref_images.push(start_image);
            } else if let Some(end) = &end_image {
                let last = with_first_stage(ms, |fs| fs.encode_video(&one_frame(end)?, tiling, circular))
                    .map_err(|e| Error::new(format!("failed to encode end video frame: {e}")))?;
                put_frame(&mut out.init_latent, &last, lt - 1)?;
                put_frame(&mut mask, &Tensor::zeros(&[lw, lh, 1, 1, 1]), lt - 1)?;
            }
            out.denoise_mask = Some(mask);
            sd_info!("encode_first_stage completed, taking {} ms", start.elapsed().as_millis());
        }
        VideoCond::ConcatKeyFrames if start_image.is_some() || end_image.is_some() => {
            sd_info!("{name} IMG2VID");
            let lt = format.latent_frames(r.frames);
            let mut latents = Tensor::zeros(&[lw, lh, lt, latent.channels, 1]);
            let mut mask = Tensor::zeros(&[lw, lh, lt, 1, 1]);
            // The end picture's frame is the last latent frame (the start's, too, for one).
            for (image, frame, what) in [(&start_image, 0, "start"), (&end_image, lt - 1, "end")] {
                if let Some(image) = image {
                    let encoded = with_first_stage(ms, |fs| fs.encode_video(&one_frame(image)?, tiling, circular))
                        .map_err(|e| Error::new(format!("failed to encode {name} {what} conditioning frame: {e}")))?;
                    put_frame(&mut latents, &encoded, frame)?;
                    put_frame(&mut mask, &Tensor::full(&[lw, lh, 1, 1, 1], 1.0), frame)?;
                }
            }
            out.concat = Some(concat5(&latents, &mask, 3)?);
            sd_info!("encode_first_stage completed, taking {} ms", start.elapsed().as_millis());
        }
        VideoCond::Keyframes if start_image.is_some() || end_image.is_some() => {
            sd_info!("{}", match (&start_image, &end_image) {
                (Some(_), Some(_)) => "FLF2V",
                (Some(_), None) => "IMG2VID",
                _ => "END2VID",
            });
            let lt = format.latent_frames(r.frames);
            // Conditioned frames start (and stay, at strength 1) this close to their picture.
            let kept = 1.0 - p.strength.clamp(0.0, 1.0);
            let mut latents = Tensor::zeros(&[lw, lh, lt, latent.channels, 1]);
            let mut mask = Tensor::full(&[lw, lh, lt, 1, 1], 1.0);
            let mut encode = |image: &Tensor, what: &str| -> Result<Tensor> {
                let enc = with_first_stage(ms, |fs| fs.encode_video(&one_frame(image)?, tiling, circular))
                    .map_err(|e| Error::new(format!("failed to encode LTXAV {what} image: {e}")))?;
                ensure!(
                    (enc.ne(0), enc.ne(1), enc.ne(3)) == (lw, lh, latent.channels),
                    "invalid LTXAV {what} condition latent shape: the VAE encoded the picture to {:?}, the video's latent is {lw}x{lh}x{}",
                    enc.shape(),
                    latent.channels
                );
                Ok(enc)
            };
            let condition = |latents: &mut Tensor, mask: &mut Tensor, enc: &Tensor, at: usize, what: &str| -> Result<()> {
                ensure!(enc.ne(2) <= lt - at, "invalid LTXAV {what} image latent range: start={at}, length={}, latent_frames={lt}", enc.ne(2));
                for f in 0..enc.ne(2) {
                    put_frame(latents, &frame_range(enc, f, f + 1)?, at + f)?;
                    put_frame(mask, &Tensor::full(&[lw, lh, 1, 1, 1], kept), at + f)?;
                }
                Ok(())
            };
            if let Some(image) = &start_image {
                let enc = encode(image, "init")?;
                condition(&mut latents, &mut mask, &enc, 0, "init")?;
            }
            if let Some(image) = &end_image {
                let enc = encode(image, "end")?;
                if r.frames == 1 {
                    condition(&mut latents, &mut mask, &enc, 0, "end")?;
                } else {
                    out.keyframes = enc.ne(2);
                    out.keyframe_at = Some(r.frames - 1);
                    latents = concat5(&latents, &enc, 2)?;
                    mask = concat5(&mask, &Tensor::full(&[lw, lh, enc.ne(2), 1, 1], kept), 2)?;
                }
            }
            out.init_latent = latents;
            out.denoise_mask = Some(mask);
            sd_info!("encode_first_stage completed, taking {} ms", start.elapsed().as_millis());
        }
        VideoCond::RefKeyframes if !p.ref_images.is_empty() || !p.ref_videos.is_empty() || !p.ref_audios.is_empty() => {
            sd_info!("MiniMax-H3 Ref2VA: {} image(s), {} video(s), {} audio clip(s)", p.ref_images.len(), p.ref_videos.len(), p.ref_audios.len());
            for (i, img) in p.ref_images.iter().enumerate() {
                let picture = reference_picture(img, r.width, r.height)?;
                let latent = with_first_stage(ms, |fs| fs.encode_video(&one_frame(&picture)?, tiling, circular))
                    .map_err(|e| Error::new(format!("failed to encode MiniMax-H3 reference image {}: {e}", i + 1)))?;
                out.ref_latents.push(keyframe_noise(&latent, r.seed));
                out.ref_roles.push(RefRole::Picture);
                out.shown.push(Shown::Picture(picture));
            }
            for (i, v) in p.ref_videos.iter().enumerate() {
                let video = reference_video(v, r.frames, i + 1)?;
                let latent = with_first_stage(ms, |fs| fs.encode_video(&video, tiling, circular))
                    .map_err(|e| Error::new(format!("failed to encode MiniMax-H3 reference video {}: {e}", i + 1)))?;
                let audio = match v.audio.as_ref().filter(|a| !a.data.is_empty()) {
                    Some(a) => Some(encode_reference_audio(ms, a, &mut out.ref_audio_latents)?),
                    None => None,
                };
                if audio.is_some() {
                    out.shown.push(Shown::Audio);
                }
                // The vision tower sees every twelfth frame (half a second at 24 fps).
                let frames = (0..video.ne(2))
                    .step_by(12)
                    .map(|f| Ok((frame_range(&video, f, f + 1)?.reshape(&[video.ne(0), video.ne(1), 3, 1])?, f as f32 / 24.0)))
                    .collect::<Result<Vec<_>>>()?;
                out.shown.push(Shown::Video(frames));
                out.ref_latents.push(keyframe_noise(&latent, r.seed));
                out.ref_roles.push(RefRole::Video { audio });
            }
            for a in &p.ref_audios {
                let index = encode_reference_audio(ms, a, &mut out.ref_audio_latents)?;
                out.ref_roles.push(RefRole::Audio(index));
                out.shown.push(Shown::Audio);
            }
            sd_info!("encode_first_stage completed, taking {} ms", start.elapsed().as_millis());
        }
        VideoCond::RefKeyframes if start_image.is_some() || end_image.is_some() => {
            sd_info!("{}", match (&start_image, &end_image) {
                (Some(_), Some(_)) => "MiniMax-H3 FL2VA",
                (Some(_), None) => "MiniMax-H3 I2VA",
                _ => "MiniMax-H3 end-frame conditioning",
            });
            for (image, frame, what) in [(start_image, 0, "start"), (end_image, r.frames - 1, "end")] {
                let Some(image) = image else { continue };
                let latent = with_first_stage(ms, |fs| fs.encode_video(&one_frame(&image)?, tiling, circular))
                    .map_err(|e| Error::new(format!("failed to encode MiniMax-H3 {what} keyframe: {e}")))?;
                out.ref_latents.push(keyframe_noise(&latent, r.seed));
                out.ref_roles.push(RefRole::Keyframe(frame));
                // The conditioner's vision tower is shown the pictures too.
                out.ref_images.push(image);
            }
            sd_info!("encode_first_stage completed, taking {} ms", start.elapsed().as_millis());
        }
        VideoCond::Vace => {
            sd_info!("VACE");
            unused("an end image (end_image)", end_image.is_some());
            // The init image is a reference frame in front of the video.
            let reference = match &start_image {
                Some(img) => {
                    let enc = with_first_stage(ms, |fs| fs.encode_video(&one_frame(img)?, tiling, circular))
                        .map_err(|e| Error::new(format!("failed to encode VACE reference image: {e}")))?;
                    Some(concat5(&enc, &Tensor::zeros(enc.shape()), 3)?)
                }
                None => None,
            };
            let mut control = Tensor::full(&[r.width, r.height, r.frames, 3, 1], 0.5);
            let used = r.frames.min(p.control_frames.len());
            if p.control_frames.len() > r.frames {
                sd_warn!("{} control frames for a {}-frame video; using the first {used}", p.control_frames.len(), r.frames);
            }
            for (i, f) in p.control_frames.iter().take(used).enumerate() {
                put_frame(&mut control, &one_frame(&frame_tensor(f, r.width, r.height)?)?, i)?;
            }
            // Everything is "reactive" (mask 1): the inactive part is all grey. Same float
            // operations as the reference: (v - 0.5)·(1 - m) + 0.5 and (v - 0.5)·m + 0.5.
            let mask = 1.0f32;
            let centred = control.map(|v| v - 0.5f32);
            let inactive = centred.map(|v| v * (1.0 - mask) + 0.5);
            let reactive = centred.map(|v| v * mask + 0.5);
            let (inactive, reactive) = with_first_stage(ms, |fs| {
                let i = fs.encode_video(&inactive, tiling, circular).map_err(|e| Error::new(format!("failed to encode VACE inactive context: {e}")))?;
                let r = fs.encode_video(&reactive, tiling, circular).map_err(|e| Error::new(format!("failed to encode VACE reactive context: {e}")))?;
                Ok((i, r))
            })?;
            let lt = inactive.ne(2);
            let patches = latent.vae_scale * latent.vae_scale;
            let mut context = concat5(&inactive, &reactive, 3)?;
            let mut mask = Tensor::full(&[lw, lh, lt, patches, 1], 1.0);
            if let Some(reference) = reference {
                context = concat5(&reference, &context, 2)?;
                mask = concat5(&Tensor::zeros(&[lw, lh, 1, patches, 1]), &mask, 2)?;
                out.ref_frames = 1;
                r.frames = lt * format.time_scale + 1;
            }
            out.vace_context = Some(concat5(&context, &mask, 3)?);
            sd_info!("encode_first_stage completed, taking {} ms", start.elapsed().as_millis());
        }
        _ => {
            unused("an init image (init_image)", start_image.is_some());
            unused("an end image (end_image)", end_image.is_some());
            if cond == VideoCond::Keyframes && p.strength != VidGenParams::default().strength {
                sd_warn!("strength only acts on LTX-2.3's start and end pictures (init_image, end_image); ignoring strength {}", p.strength);
            }
        }
    }
    if !matches!(cond, VideoCond::Vace) && !p.control_frames.is_empty() {
        sd_warn!("this {name} model does not use control frames; ignoring control_frames ({})", p.control_frames.len());
    }
    // An audio latent goes behind the video's channels (over all latent frames, appended
    // keyframes too), zero-padded to whole channels; the denoise mask leaves it all to the model.
    let audio = format.audio_latents(r.frames, p.fps.max(1) as f32) * format.audio_step_values();
    if out.init_latent.is_empty() {
        let lt = format.latent_frames(r.frames);
        let extra = audio.div_ceil((lw * lh * lt).max(1));
        out.init_latent = Tensor::zeros(&[lw, lh, lt, latent.channels + extra, 1]);
    } else if audio > 0 {
        let lt = out.init_latent.ne(2);
        let extra = audio.div_ceil(lw * lh * lt);
        out.init_latent = concat5(&out.init_latent, &Tensor::zeros(&[lw, lh, lt, extra, 1]), 3)?;
        if let Some(mask) = out.denoise_mask.take() {
            out.denoise_mask = Some(mask_with_audio(&mask, latent.channels, extra)?);
        }
    }
    Ok(out)
}

/// A MiniMax-H3 reference picture `[W, H, 3, 1]` in [0, 1], scaled (nearest, like every
/// resize of [`frame_tensor`]) to the request's area at most, keeping its aspect, each side a
/// multiple of 32 (at least 32), as the reference sizes it.
fn reference_picture(img: &Image, width: usize, height: usize) -> Result<Tensor> {
    let (sw, sh) = (img.width as usize, img.height as usize);
    let scale = (((width * height) as f64) / ((sw * sh) as f64)).sqrt().min(1.0);
    let side = |s: usize| (((s as f64 * scale / 32.0).round() as usize) * 32).max(32);
    frame_tensor(img, side(sw), side(sh))
}

/// A MiniMax-H3 reference video `[W, H, T, 3, 1]` in [0, 1] as the reference prepares it: its
/// frames resampled to 24 fps (the frame at or before each time), as many as the request's
/// and 17k + 5 of them, each scaled by nearest neighbour to a size near 768 on the short side
/// (within 768×1344 pixels), or the first frame's own size rounded to 32 when that is smaller.
fn reference_video(v: &RefVideo, max_frames: usize, index: usize) -> Result<Tensor> {
    ensure!(!v.frames.is_empty(), "invalid MiniMax-H3 reference video {index}");
    let fps = if v.fps > 0 { v.fps as f64 } else { 24.0 };
    let mut n = ((v.frames.len() as f64 * 24.0 / fps).round() as usize).min(max_frames);
    ensure!(n >= 5, "MiniMax-H3 reference video {index} needs at least 5 frames at 24 fps");
    while n % 17 != 5 {
        n -= 1;
    }
    let (sw, sh) = (v.frames[0].width as usize, v.frames[0].height as usize);
    ensure!(sw > 0 && sh > 0, "invalid first frame in MiniMax-H3 reference video {index}");
    let ratio = sw as f64 / sh as f64;
    let (mut nw, mut nh) = if ratio >= 1.0 { (768.0 * ratio, 768.0) } else { (768.0, 768.0 / ratio) };
    if nw * nh > 768.0 * 1344.0 {
        let scale = ((768.0 * 1344.0) / (nw * nh)).sqrt();
        nw *= scale;
        nh *= scale;
    }
    let round32 = |x: f64| (((x / 32.0).round() as usize) * 32).max(32);
    let (mut w, mut h) = (round32(nw), round32(nh));
    if sw * sh < w * h {
        (w, h) = (round32(sw as f64), round32(sh as f64));
    }
    let plane = w * h;
    let mut out = vec![0.0f32; plane * n * 3];
    for f in 0..n {
        let source = (((f as f64) * fps / 24.0).floor() as usize).min(v.frames.len() - 1);
        let frame = frame_tensor(&v.frames[source], w, h)?;
        let frame = frame.data();
        for c in 0..3 {
            out[(c * n + f) * plane..(c * n + f + 1) * plane].copy_from_slice(&frame[c * plane..(c + 1) * plane]);
        }
    }
    Tensor::from_vec(&[w, h, n, 3, 1], out)
}

/// MiniMax-H3's reference sound `a` through the audio VAE's encoder (its latent appended to
/// `latents`; its index returned), after [`reference_waveform`].
fn encode_reference_audio(ms: &mut ModelSet, a: &Audio, latents: &mut Vec<Tensor>) -> Result<usize> {
    let stage = ms.audio.as_mut().ok_or_else(|| Error::new("MiniMax-H3 Ref2VA audio requires --audio-vae with encoder weights (audio_vae_path)"))?;
    let rate = stage.input_sample_rate().ok_or_else(|| Error::new("MiniMax-H3 Ref2VA audio requires --audio-vae with encoder weights (audio_vae_path)"))?;
    let wave = reference_waveform(a, rate)?;
    stage.begin()?;
    let latent = stage.encode_audio(&wave);
    stage.end();
    let latent = latent.map_err(|e| Error::new(format!("failed to encode MiniMax-H3 reference audio: {e}")))?;
    latents.push(latent);
    Ok(latents.len() - 1)
}

/// `num / den` rounded as an x87 long double (a 64-bit significand, to nearest even), then
/// less its integer part and rounded to f32: the reference's resampling fraction, exactly.
fn long_double_fraction(num: u128, den: u128) -> f32 {
    if num % den == 0 {
        return 0.0;
    }
    // Exponent e of the quotient: 2^e <= num / den < 2^(e + 1).
    let mut e: i32 = (128 - num.leading_zeros() as i32) - (128 - den.leading_zeros() as i32);
    let ge = |e: i32| if e >= 0 { num >= den << e } else { num << -e >= den };
    while !ge(e) {
        e -= 1;
    }
    while ge(e + 1) {
        e += 1;
    }
    // The significand M (64 bits): num / den = M · 2^(e - 63), rounded to nearest even.
    let shift = 63 - e;
    let (n, d) = if shift >= 0 { (num << shift, den) } else { (num, den << -shift) };
    let (mut m, rem) = (n / d, n % d);
    if rem * 2 > d || (rem * 2 == d && m & 1 == 1) {
        m += 1;
    }
    // Less the integer part: F · 2^(e - 63).
    let frac = if shift > 0 { m & ((1u128 << shift) - 1) } else { 0 };
    if frac == 0 {
        return 0.0;
    }
    // F to 24 bits, to nearest even.
    let bits = 128 - frac.leading_zeros() as i32;
    let drop = (bits - 24).max(0);
    let mut f = frac >> drop;
    if drop > 0 {
        let rest = frac & ((1u128 << drop) - 1);
        let half = 1u128 << (drop - 1);
        if rest > half || (rest == half && f & 1 == 1) {
            f += 1;
        }
    }
    (f as f64 * 2f64.powi(drop - shift)) as f32
}

/// Reference sound as the reference feeds the audio encoder: resampled linearly to `rate`
/// (positions and fractions as its long double arithmetic gives them), two channels (mono
/// doubled, a third and more dropped), clamped to [-1, 1] and zero-padded to whole latent
/// steps of 800 samples: `[samples, 2]`.
fn reference_waveform(a: &Audio, rate: u32) -> Result<Tensor> {
    let channels = a.channels as usize;
    let count = if channels > 0 { a.data.len() / channels } else { 0 };
    ensure!(count > 0 && a.sample_rate > 0 && rate > 0, "invalid MiniMax-H3 reference audio");
    let (sr, rate) = (a.sample_rate as u128, rate as u128);
    // llround(count · rate / sr), halves away from zero.
    let out = ((2 * count as u128 * rate + sr) / (2 * sr)).max(1) as usize;
    let padded = out.div_ceil(800) * 800;
    let mut wave = vec![0.0f32; padded * 2];
    for i in 0..out {
        let num = i as u128 * sr;
        let s0 = ((num / rate) as usize).min(count - 1);
        let s1 = (s0 + 1).min(count - 1);
        // Past the last sample the two are the same and the fraction does not matter.
        let fraction = if (num / rate) as usize == s0 { long_double_fraction(num, rate) } else { 0.0 };
        for c in 0..2 {
            let src = if channels == 1 { 0 } else { c.min(channels - 1) };
            let (x, y) = (a.data[s0 * channels + src], a.data[s1 * channels + src]);
            wave[c * padded + i] = (x + (y - x) * fraction).clamp(-1.0, 1.0);
        }
    }
    Tensor::from_vec(&[padded, 2], wave)
}

/// A MiniMax-H3 keyframe latent moved slightly towards noise: `0.999·z + 0.001·n`, the noise
/// from a Philox generator seeded with the request's seed for each keyframe (so the start
/// and end pictures get the same noise), as the reference's visual conditioning timestep.
fn keyframe_noise(latent: &Tensor, seed: i64) -> Tensor {
    const KEEP: f32 = crate::models::diffusion::minimax_h3::VISUAL_COND_TIMESTEP;
    let noise = randn_like(latent, &mut crate::runtime::rng::PhiloxRng::new(seed as u64));
    let mut out = latent.clone();
    for (v, n) in out.data_mut().iter_mut().zip(noise.data()) {
        *v = *v * KEEP + *n * (1.0 - KEEP);
    }
    out
}

/// Two CLIP-vision outputs `[D, N, 1]` one after the other along the tokens.
fn concat_tokens(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    ensure!(a.ne(0) == b.ne(0), "CLIP vision outputs of widths {} and {}", a.ne(0), b.ne(0));
    let mut d = a.data().to_vec();
    d.extend_from_slice(b.data());
    Tensor::from_vec(&[a.ne(0), a.ne(1) + b.ne(1), 1], d)
}

/// The conditions of the prompt and (when a stage's guidance needs it) the negative prompt,
/// each with the pictures' concat latent and CLIP tokens.
fn conditions(ms: &mut ModelSet, p: &VidGenParams, r: &VideoRequest, lat: &VideoLatents) -> Result<(Condition, Option<Condition>)> {
    let start = Instant::now();
    let base = CondRequest {
        text: &p.prompt,
        clip_skip: p.clip_skip,
        width: r.width,
        height: r.height,
        zero_out_masked: true,
        ref_images: &lat.ref_images,
        refs: RefImageParams::default(),
        shown: &lat.shown,
    };
    let negative = CondRequest { text: &p.negative_prompt, ..base.clone() };
    let needs_uncond = r.use_uncond || r.use_high_noise_uncond;
    let with_pictures = |c: Condition| Condition { crossattn: c.crossattn, vector: lat.clip_tokens.clone(), concat: lat.concat.clone(), extra_context: c.extra_context, token_types: c.token_types };
    ms.cond.begin()?;
    let conds = (|| -> Result<(Condition, Option<Condition>)> {
        let cond = with_pictures(ms.cond.encode(&base)?);
        let uncond = if needs_uncond { Some(with_pictures(ms.cond.encode(&negative)?)) } else { None };
        Ok((cond, uncond))
    })();
    ms.cond.end();
    sd_info!("get_learned_condition completed, taking {:.2}s", start.elapsed().as_secs_f32());
    conds
}

/// Writes `frame` `[w, h, 1, C, 1]` into latent frame `t` of `video` `[w, h, T, C, 1]`.
pub(super) fn put_frame(video: &mut Tensor, frame: &Tensor, t: usize) -> Result<()> {
    let shape: &Tensor = video;
    let (w, h, frames, c) = (shape.ne(0), shape.ne(1), shape.ne(2), shape.ne(3));
    ensure!(
        frame.ne(0) == w && frame.ne(1) == h && frame.ne(2) == 1 && frame.ne(3) == c && t < frames,
        "a frame of shape {:?} does not fit frame {t} of a latent video {:?}",
        frame.shape(),
        video.shape()
    );
    let plane = w * h;
    let src = frame.data().to_vec();
    let dst = video.data_mut();
    for ch in 0..c {
        let at = (ch * frames + t) * plane;
        dst[at..at + plane].copy_from_slice(&src[ch * plane..(ch + 1) * plane]);
    }
    Ok(())
}

/// Decodes the final latent video (retried with temporal, then spatial tiling when a whole
/// decode fails, e.g. out of memory: the first stage's one retry chain); the frames beyond
/// the request's are cut.
fn decode(ms: &mut ModelSet, latent: &Tensor, frames: usize, tiling: &TilingParams, circular: (bool, bool), cancel: &CancelFlag) -> Result<Vec<Image>> {
    if cancel.pending() == Some(CancelMode::All) {
        sd_error!("cancelling generation before video decode");
        return Err(cancelled());
    }
    let start = Instant::now();
    let fs = ms.first_stage.as_mut();
    fs.begin()?;
    let mut progress = |s: i32, n: i32, secs: f32| callbacks::progress(s, n, secs);
    let video = crate::models::vae::decode_video_with_retry(fs, latent, tiling, circular, Some(&mut progress));
    fs.end();
    let video = video.map_err(|e| Error::new(format!("decode_first_stage failed for video: {e}")))?;
    sd_info!("decode_first_stage completed, taking {:.2}s", start.elapsed().as_secs_f32());
    let n = video.ne(2).min(frames);
    (0..n).map(|i| latent_layer(&video, i).and_then(|f| tensor_to_image(&f, 0))).collect()
}

/// The sound of a sampled latent whose audio is packed behind the video's channels, when an
/// audio VAE is loaded (MiniMax-H3, LTX-2.3): decoded before the video, like the reference. A failed
/// decode leaves the video silent with a warning, as there; cancelling stops the generation.
fn decode_sound(ms: &mut ModelSet, latent: &Tensor, steps: usize, cancel: &CancelFlag) -> Result<Option<Audio>> {
    let Some(stage) = ms.audio.as_mut() else { return Ok(None) };
    if steps == 0 {
        return Ok(None);
    }
    if cancel.pending() == Some(CancelMode::All) {
        sd_error!("cancelling generation before audio decode");
        return Err(cancelled());
    }
    let start = Instant::now();
    let s = latent.shape();
    let video = s[..3].iter().product::<usize>() * ms.spec.latent.channels;
    let shape = stage.latent_shape(steps);
    let values = shape.iter().product::<usize>();
    // The reference decodes nothing (and says nothing) when the latent holds no audio.
    let Some(packed) = latent.data().get(video..video + values) else { return Ok(None) };
    sd_debug!("decode audio latent {}x{}x{}x1", shape[0], shape[1], shape[2]);
    let audio_latent = Tensor::from_vec(&shape, packed.to_vec())?;
    let decoded = stage.begin().and_then(|()| {
        let w = stage.decode_audio(&audio_latent);
        stage.end();
        w
    });
    let audio = match decoded {
        Ok(w) => Some(Audio { sample_rate: w.sample_rate, channels: w.channels, data: w.interleaved }),
        Err(e) => {
            sd_warn!("audio latent decode failed ({e}); continuing with silent video output");
            None
        }
    };
    sd_info!("decoding audio latent completed, taking {:.2}s", start.elapsed().as_secs_f32());
    Ok(audio)
}

/// Text (and image) to video: the frames, as many as the request after alignment, and the
/// sound when the model makes one and its audio VAE is loaded.
pub fn generate_video(ms: &mut ModelSet, p: &VidGenParams, cancel: &CancelFlag) -> Result<(Vec<Image>, Option<Audio>)> {
    if ms.animates_frames() {
        check_params(p)?;
        return Ok((super::animatediff::generate_video(ms, p, cancel)?, None));
    }
    ms.weights.validate()?;
    let format = *ms
        .spec
        .video()
        .ok_or_else(|| Error::new(format!("{} is an image model and cannot generate video; use generate_image", ms.version.name())))?;
    check_params(p)?;
    match format.frame_rule {
        FrameRule::MinimaxH3 => check_minimax_h3(p)?,
        FrameRule::Ltx => check_ltx(p)?,
        FrameRule::Causal => {}
    }
    warn_unused(ms, p);
    let t0 = Instant::now();
    let tiling = runtime_tiling(&p.vae_tiling_params, ms.spec.encode_tile_factor, ms.spec.first_stage == FirstStageKind::Ltx);
    let circular = (p.circular_x, p.circular_y);
    for runner in ms.runners() {
        runner.options.circular_x = p.circular_x;
        runner.options.circular_y = p.circular_y;
    }
    let mut r = resolve_request(ms, p, &format);
    let multiple = ms.spec.latent.size_multiple() as i32;
    let hires = super::hires::resolve(&p.hires, r.width as i32, r.height as i32, multiple)?;
    if let Some(h) = &hires {
        ensure!(format.frame_rule == FrameRule::Ltx, "LTX latent spatial upscale is only supported for LTX video models");
        super::ltx_refine::check(h)?;
    }
    let mut rngs = GenerationRngs::new(ms.rng_type, ms.sampler_rng_type);
    rngs.manual_seed(r.seed as u64);
    let default_shift = ms.default_flow_shift;
    ms.denoiser.set_flow_shift(unset_if_infinite(p.sample_params.flow_shift), default_shift);
    ms.diffusion.set_flow_shift(unset_if_infinite(p.sample_params.flow_shift).or(default_shift).unwrap_or(f32::INFINITY));
    ms.apply_loras(&p.loras)?;

    let plan = resolve_plan(ms, p, &r)?;
    let lat = video_latents(ms, p, &mut r, &format, &tiling, circular)?;
    let (cond, uncond) = conditions(ms, p, &r, &lat)?;
    let prepared = Prepared {
        init_latent: lat.init_latent,
        denoise_mask: lat.denoise_mask,
        ref_latents: lat.ref_latents,
        cond,
        uncond,
        img_uncond: None,
    };
    sd_info!("generate_video {}x{}x{}", r.width, r.height, r.frames);
    let latent_start = Instant::now();
    let noise = randn_like(&prepared.init_latent, rngs.noise());

    let request = super::request::Request::for_video(r.seed, &p.cache);
    let vace = VideoInput {
        vace_context: lat.vace_context.as_ref(),
        vace_strength: p.vace_strength,
        fps: p.fps.max(1) as f32,
        frames: r.frames,
        keyframes: lat.keyframes,
        keyframe_at: lat.keyframe_at,
        ref_roles: &lat.ref_roles,
        ref_audio_latents: &lat.ref_audio_latents,
    };
    let ModelSet { diffusion, high_noise, denoiser, first_stage, preview, spec, .. } = ms;
    let mut job = video_job(&request, &prepared, denoiser, first_stage, preview, spec, &format, &tiling, circular, vace, cancel);
    let mut x = prepared.init_latent.clone();
    let mut noise = Some(&noise);
    let split = plan.high_noise_steps;
    if let (Some(expert), true) = (high_noise.as_mut(), split > 0) {
        if cancel.pending() == Some(CancelMode::All) {
            sd_error!("cancelling generation before high-noise sampling");
            return Err(cancelled());
        }
        let start = Instant::now();
        let stage = Stage {
            diffusion: expert.as_mut(),
            sigmas: &plan.sigmas[..=split],
            method: plan.high_noise_method,
            eta: plan.high_noise_eta,
            guidance: &r.high_noise_guidance,
            use_uncond: r.use_high_noise_uncond,
            extra: &plan.high_noise_extra,
            noise: noise.take(),
            shifted_timestep: 0,
            last: false,
        };
        x = sampling::sample(&mut job, stage, &x, rngs.sampler())
            .map_err(|e| Error::new(format!("sampling(high noise) failed after {:.2}s: {e}", start.elapsed().as_secs_f32())))?;
        sd_info!("sampling(high noise) completed, taking {:.2}s", start.elapsed().as_secs_f32());
    }
    let sigmas = if high_noise.is_some() { &plan.sigmas[split..] } else { &plan.sigmas[..] };
    if cancel.pending() == Some(CancelMode::All) {
        sd_error!("cancelling generation before sampling");
        return Err(cancelled());
    }
    let start = Instant::now();
    let stage = Stage {
        diffusion: diffusion.as_mut(),
        sigmas,
        method: plan.method,
        eta: plan.eta,
        guidance: &r.guidance,
        use_uncond: r.use_uncond,
        extra: &plan.extra,
        noise,
        shifted_timestep: p.sample_params.shifted_timestep,
        last: true,
    };
    let latent = sampling::sample(&mut job, stage, &x, rngs.sampler())
        .map_err(|e| Error::new(format!("sampling failed after {:.2}s: {e}", start.elapsed().as_secs_f32())))?;
    sd_info!("sampling completed, taking {:.2}s", start.elapsed().as_secs_f32());
    drop(job);
    let mut audio_steps = format.audio_latents(r.frames, p.fps.max(1) as f32);
    let mut frames = r.frames;
    let latent = match &hires {
        Some(h) => {
            let refine = Refine { hires: h, request: &request, plan: &plan, keyframes: lat.keyframes, audio_steps };
            let out = refine.run(ms, p, &r, prepared, latent, &format, &tiling, circular, &mut rngs, cancel)?;
            (frames, audio_steps) = (out.frames, out.audio_steps);
            out.latent
        }
        None => latent,
    };
    sd_info!("generating latent video completed, taking {:.2}s", latent_start.elapsed().as_secs_f32());
    let audio = decode_sound(ms, &latent, audio_steps, cancel)?;
    let latent = if lat.ref_frames > 0 { frame_range(&latent, lat.ref_frames, latent.ne(2))? } else { latent };
    let latent = if lat.keyframes > 0 { frame_range(&latent, 0, latent.ne(2) - lat.keyframes)? } else { latent };
    let frames = decode(ms, &latent, frames, &tiling, circular, cancel)?;
    sd_info!("generate_video completed in {:.2}s", t0.elapsed().as_secs_f32());
    Ok((frames, audio))
}

/// The sampling job of a video stage: previews through the preview decoder if any.
#[allow(clippy::too_many_arguments)]
fn video_job<'a>(
    request: &'a super::request::Request,
    prepared: &'a Prepared,
    denoiser: &'a crate::runtime::denoiser::Denoiser,
    first_stage: &'a mut Box<dyn crate::models::vae::FirstStage>,
    preview: &'a mut Option<Box<dyn crate::models::vae::FirstStage>>,
    spec: &FamilySpec,
    format: &VideoFormat,
    tiling: &'a TilingParams,
    circular: (bool, bool),
    video: VideoInput<'a>,
    cancel: &'a CancelFlag,
) -> Job<'a> {
    let decoder: &mut dyn crate::models::vae::FirstStage = match preview {
        Some(p) => p.as_mut(),
        None => first_stage.as_mut(),
    };
    Job {
        request,
        prepared,
        denoiser,
        preview: Previewer { decoder, projection: spec.preview, tiling, circular, video: true },
        backbone: spec.backbone(),
        slg_supported: spec.skip_layer_guidance,
        ref_latent_img_cfg: false,
        timesteps: format.timesteps,
        video: Some(video),
        extensions: &mut [],
        cancel,
    }
}

/// LTX-2.3's latent-upscale refine pass (`ltx_refine`): what it takes of the first pass.
struct Refine<'a> {
    hires: &'a super::hires::Hires,
    request: &'a super::request::Request,
    plan: &'a VideoPlan,
    keyframes: usize,
    audio_steps: usize,
}

/// The refined latent, and the video frames and audio steps it stands for.
struct Refined {
    latent: Tensor,
    frames: usize,
    audio_steps: usize,
}

impl Refine<'_> {
    /// The sampled latent → the refined latent at twice the size. Like the reference, the
    /// upscaled latent's frames (appended keyframes too) set the video frames of the pass and
    /// so its audio length and the keyframes' frame.
    #[allow(clippy::too_many_arguments)]
    fn run(&self, ms: &mut ModelSet, p: &VidGenParams, r: &VideoRequest, prepared: Prepared, latent: Tensor, format: &VideoFormat, tiling: &TilingParams, circular: (bool, bool), rngs: &mut GenerationRngs, cancel: &CancelFlag) -> Result<Refined> {
        if cancel.pending() == Some(CancelMode::All) {
            sd_error!("cancelling generation before latent upscale");
            return Err(cancelled());
        }
        let start = Instant::now();
        let step_values = format.audio_step_values();
        let up = super::ltx_refine::upscale(ms, &self.hires.model_path, &latent, self.audio_steps * step_values)?;
        sd_info!("LTX latent spatial upscale completed, taking {:.2}s", start.elapsed().as_secs_f32());
        let scale = ms.spec.latent.vae_scale;
        let (width, height) = (up.ne(0) * scale, up.ne(1) * scale);
        let frames = format.video_frames(up.ne(2));
        if frames != r.frames {
            sd_info!("LTX latent upsampler output latent frames {}, frames {} -> {frames}", up.ne(2), r.frames);
        }
        let fps = p.fps.max(1) as f32;
        let mut audio_steps = self.audio_steps;
        let up = if self.audio_steps > 0 && format.audio_latents(frames, fps) != self.audio_steps {
            audio_steps = format.audio_latents(frames, fps);
            sd_info!("LTX audio latent length adjusted for latent upscale: {} -> {audio_steps}", self.audio_steps);
            let (bins, channels) = (crate::models::diffusion::ltx::AUDIO_BINS, crate::models::diffusion::ltx::AUDIO_CHANNELS);
            super::ltx_refine::resize_audio(&up, ms.spec.latent.channels, bins, channels, self.audio_steps, audio_steps)?
        } else {
            up
        };
        if (self.hires.width, self.hires.height) != (width, height) {
            sd_warn!("LTX latent spatial upsampler output is {width}x{height}; ignoring hires target {}x{}", self.hires.width, self.hires.height);
        }
        if cancel.pending() == Some(CancelMode::All) {
            sd_error!("cancelling generation before latent upscale refine");
            return Err(cancelled());
        }
        let target = up.ne(2) - self.keyframes;
        let (x, mask) = super::ltx_refine::condition(ms, p, up, frames, target, audio_steps * step_values, tiling, circular)?;
        let noise = randn_like(&x, rngs.noise());
        let seq_len = (x.ne(0) * x.ne(1) * x.ne(2)) as i32;
        let sigmas = super::ltx_refine::sigmas(ms, self.hires, &p.sample_params, self.plan.method, self.plan.sigmas.len().saturating_sub(1), seq_len)?;
        let prepared = Prepared { init_latent: x, denoise_mask: mask, ..prepared };
        let keyframe_at = (self.keyframes > 0).then(|| frames - 1);
        let video = VideoInput { vace_context: None, vace_strength: p.vace_strength, fps, frames, keyframes: self.keyframes, keyframe_at, ref_roles: &[], ref_audio_latents: &[] };
        let start = Instant::now();
        let ModelSet { diffusion, denoiser, first_stage, preview, spec, .. } = ms;
        let mut job = video_job(self.request, &prepared, denoiser, first_stage, preview, spec, format, tiling, circular, video, cancel);
        let stage = Stage {
            diffusion: diffusion.as_mut(),
            sigmas: &sigmas,
            method: self.plan.method,
            eta: self.plan.eta,
            guidance: &r.guidance,
            use_uncond: r.use_uncond,
            extra: &self.plan.extra,
            noise: Some(&noise),
            shifted_timestep: p.sample_params.shifted_timestep,
            last: true,
        };
        let refined = sampling::sample(&mut job, stage, &prepared.init_latent, rngs.sampler())
            .map_err(|e| Error::new(format!("sampling(latent upscale) failed after {:.2}s: {e}", start.elapsed().as_secs_f32())))?;
        sd_info!("sampling(latent upscale) completed, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(Refined { latent: refined, frames, audio_steps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_concatenate_drop_and_are_written_in_place() {
        let a = Tensor::from_vec(&[1, 1, 1, 3, 1], vec![1., 2., 3.]).unwrap();
        let b = Tensor::from_vec(&[1, 1, 1, 3, 1], vec![4., 5., 6.]).unwrap();
        let v = concat5(&a, &b, 2).unwrap();
        assert_eq!(v.shape(), &[1, 1, 2, 3, 1]);
        assert_eq!(v.data(), &[1., 4., 2., 5., 3., 6.]);
        assert_eq!(frame_range(&v, 1, 2).unwrap().data(), &[4., 5., 6.]);
        assert_eq!(frame_range(&v, 0, 1).unwrap().data(), &[1., 2., 3.]);
        assert!(frame_range(&v, 1, 1).is_err() && frame_range(&v, 0, 3).is_err());
        let c = concat5(&a, &b, 3).unwrap();
        assert_eq!((c.shape(), c.data()), (&[1, 1, 1, 6, 1][..], &[1., 2., 3., 4., 5., 6.][..]));
        let g = grey_video(1, 1, 3, &[(2, &Tensor::from_vec(&[1, 1, 3, 1], vec![0., 1., 0.]).unwrap())]).unwrap();
        assert_eq!(g.data(), &[0.5, 0.5, 0., 0.5, 0.5, 1., 0.5, 0.5, 0.]);
        let mut lat = Tensor::zeros(&[1, 1, 3, 2, 1]);
        put_frame(&mut lat, &Tensor::from_vec(&[1, 1, 1, 2, 1], vec![7., 8.]).unwrap(), 2).unwrap();
        assert_eq!(lat.data(), &[0., 0., 7., 0., 0., 8.]);
        assert!(put_frame(&mut lat, &Tensor::zeros(&[1, 1, 1, 2, 1]), 3).is_err());
    }

    #[test]
    fn wan_frames_align_down_to_whole_latent_frames() {
        let f = VideoFormat { time_scale: 4, timesteps: sampling::TimestepRule::Scalar, frame_rule: FrameRule::Causal };
        assert_eq!([1, 5, 6, 7, 8, 9, 17].map(|n| f.align_frames(n)), [1, 5, 5, 5, 5, 9, 17]);
        assert_eq!([1, 5, 9].map(|n| f.latent_frames(n)), [1, 2, 3]);
        assert_eq!([1, 2, 3].map(|t| f.video_frames(t)), [1, 5, 9]);
        let m = VideoFormat { time_scale: 4, timesteps: sampling::TimestepRule::Scalar, frame_rule: FrameRule::MinimaxH3 };
        for frames in [5, 22, 39] {
            assert_eq!(m.video_frames(m.latent_frames(frames)), frames);
        }
    }

    #[test]
    fn bad_frame_counts_and_sizes_are_refused() {
        let ok = VidGenParams { width: 64, height: 64, video_frames: 5, ..VidGenParams::default() };
        assert!(check_params(&ok).is_ok());
        for frames in [0, -3, MAX_FRAMES + 1] {
            let e = check_params(&VidGenParams { video_frames: frames, ..ok.clone() }).unwrap_err().to_string();
            assert!(e.contains("video_frames"), "{e}");
        }
        assert!(check_params(&VidGenParams { width: 0, ..ok.clone() }).is_err());
        assert!(check_params(&VidGenParams { moe_boundary: f32::NAN, ..ok.clone() }).is_err());
        assert!(check_ltx(&VidGenParams { strength: f32::NAN, ..ok.clone() }).is_err());
        assert!(check_ltx(&VidGenParams { strength: 2.0, ..ok.clone() }).is_ok());
        // Reference audio is MiniMax-H3's alone: LTX-2.3 goes on (a field warning says so).
        let audio = Audio { sample_rate: 16000, channels: 1, data: vec![0.0; 16] };
        assert!(check_ltx(&VidGenParams { ref_audios: vec![audio.clone()], ..ok.clone() }).is_ok());
    }

    /// MiniMax-H3 takes keyframes; Ref2VA references are refused (with keyframes, as the
    /// reference refuses them; alone, as not built), and so are control frames.
    #[test]
    fn minimax_h3_keyframes_and_references() {
        let picture = Image::new(64, 64, 3, vec![128; 64 * 64 * 3]).unwrap();
        let ok = VidGenParams { width: 64, height: 64, video_frames: 5, fps: 24, ..VidGenParams::default() };
        let start = VidGenParams { init_image: Some(picture.clone()), ..ok.clone() };
        assert!(check_minimax_h3(&start).is_ok());
        assert!(check_minimax_h3(&VidGenParams { end_image: Some(picture.clone()), ..ok.clone() }).is_ok());
        let audio = Audio { sample_rate: 48000, channels: 2, data: vec![0.0; 32] };
        let both = check_minimax_h3(&VidGenParams { ref_audios: vec![audio.clone()], ..start.clone() }).unwrap_err().to_string();
        assert!(both.contains("cannot be used together"), "{both}");
        assert!(check_minimax_h3(&VidGenParams { ref_images: vec![picture.clone(); 2], ..ok.clone() }).is_ok());
        assert!(check_minimax_h3(&VidGenParams { ref_audios: vec![audio.clone()], ..ok.clone() }).is_ok());
        let silent = RefVideo { frames: vec![picture.clone(); 5], fps: 24, audio: None };
        let sound = RefVideo { audio: Some(audio.clone()), ..silent.clone() };
        assert!(check_minimax_h3(&VidGenParams { ref_videos: vec![silent, sound], ..ok.clone() }).is_ok());
        let control = check_minimax_h3(&VidGenParams { control_frames: vec![picture], ..ok }).unwrap_err().to_string();
        assert!(control.contains("control_frames"), "{control}");
    }

    /// Reference videos go to 24 fps, 17k + 5 frames within the request's, the first frame's
    /// size rounded to 32 when below the nominal 768 lines; pictures shrink to the request's
    /// area.
    #[test]
    fn minimax_h3_reference_sizes() {
        let frame = |v: u8| Image::new(40, 20, 3, vec![v; 40 * 20 * 3]).unwrap();
        let v = RefVideo { frames: (0..10).map(|i| frame(i * 20)).collect(), fps: 12, audio: None };
        let t = reference_video(&v, 22, 1).unwrap();
        assert_eq!(t.shape(), &[32, 32, 5, 3, 1]);
        // 12 fps: each source frame twice.
        let firsts: Vec<f32> = (0..5).map(|f| t.data()[f * 32 * 32]).collect();
        assert_eq!(firsts, [0.0, 0.0, 20.0, 20.0, 40.0].map(|v| v / 255.0));
        assert!(reference_video(&RefVideo { frames: vec![frame(0); 4], fps: 24, audio: None }, 22, 2).is_err());
        assert!(reference_video(&RefVideo { frames: vec![frame(0); 30], fps: 24, audio: None }, 5, 1).unwrap().ne(2) == 5);
        let big = Image::new(200, 100, 3, vec![0; 200 * 100 * 3]).unwrap();
        assert_eq!(reference_picture(&big, 64, 64).unwrap().shape(), &[96, 32, 3, 1]);
        assert_eq!(reference_picture(&frame(0), 64, 64).unwrap().shape(), &[32, 32, 3, 1]);
    }

    /// Reference sound goes to 32 kHz stereo by linear interpolation, padded to whole steps;
    /// the fraction is the long double's, rounded to f32.
    #[test]
    fn reference_sound_is_resampled_like_the_reference() {
        assert_eq!(long_double_fraction(1, 3), 1.0f32 / 3.0);
        assert_eq!(long_double_fraction(7, 2), 0.5);
        assert_eq!(long_double_fraction(8, 2), 0.0);
        for (n, d) in [(123_456_789u128, 32_000u128), (22_050 * 999, 32_000), (5, 7)] {
            let exact = (n % d) as f64 / d as f64;
            assert!((long_double_fraction(n, d) as f64 - exact).abs() <= exact * 1.2e-7, "{n}/{d}");
        }
        let mono = Audio { sample_rate: 16_000, channels: 1, data: (0..1000).map(|i| i as f32 / 1000.0).collect() };
        let w = reference_waveform(&mono, 32_000).unwrap();
        assert_eq!(w.shape(), &[2400, 2]);
        let d = w.data();
        assert_eq!((d[2], d[3], d[2400 + 3]), (0.001, 0.001 + (0.002 - 0.001) * 0.5, d[3]));
        // Past the last source sample: the last value; past the resampled end: zeros.
        assert_eq!((d[1999], d[2000]), (0.999, 0.0));
        let loud = Audio { sample_rate: 48_000, channels: 3, data: vec![2.0, -3.0, 0.5].repeat(48) };
        let w = reference_waveform(&loud, 32_000).unwrap();
        assert_eq!((w.ne(0), w.data()[0], w.data()[800]), (800, 1.0, -1.0));
        assert!(reference_waveform(&Audio { sample_rate: 16_000, channels: 0, data: vec![] }, 32_000).is_err());
        let two = Image::new(40, 20, 2, vec![0; 40 * 20 * 2]).unwrap();
        assert!(reference_picture(&two, 64, 64).is_err());
    }

    /// The keyframe noise is the seed's Philox noise at 0.1%, the same for every keyframe.
    #[test]
    fn keyframe_noise_is_the_seeds_philox_noise() {
        let z = Tensor::from_vec(&[2, 2, 1, 1, 1], vec![1.0, -2.0, 0.5, 0.0]).unwrap();
        let a = keyframe_noise(&z, 42);
        assert_eq!(a.data(), keyframe_noise(&z, 42).data());
        let n = randn_like(&z, &mut crate::runtime::rng::PhiloxRng::new(42));
        for ((v, z), n) in a.data().iter().zip(z.data()).zip(n.data()) {
            assert_eq!(*v, z * 0.999 + n * (1.0 - 0.999f32));
        }
        assert_ne!(a.data(), keyframe_noise(&z, 43).data());
    }
}
