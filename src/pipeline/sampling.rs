//! The one sampling loop every family and medium shares: classifier-free guidance (and its
//! 3-way and skip-layer variants), step caches, the extensions' per-evaluation inputs
//! (ControlNet residuals, image tokens, identity), previews, progress and cancellation around
//! the samplers of `runtime::samplers`.
//!
//! A run is split in two: the [`Job`] holds what every stage of one generation shares (the
//! prepared conditions and latents, the denoiser, the preview decoder, the extensions), and a
//! [`Stage`] is one call of [`sample`] with one diffusion model, its sigmas, sampler and
//! guidance. An image is one stage; hires runs a second one; Wan 2.2's high-noise and
//! low-noise experts are two stages over consecutive parts of one schedule.

use super::callbacks::{self, CancelFlag, PreviewConfig};
use super::extensions::{self, Extension};
use super::guidance::{Guider, SkipLayerGuidance};
use super::imageops::tensor_to_image;
use super::request::Request;
use crate::error::{Error, Result};
use crate::models::diffusion::{DiffusionInput, DiffusionModel, VideoInput};
use crate::models::vae::FirstStage;
use crate::models::Condition;
use crate::params::GuidanceParams;
use crate::runtime::args::ExtraArgs;
use crate::runtime::cache::{Backbone, Pass, StepCache};
use crate::runtime::denoiser::Denoiser;
use crate::runtime::preview;
use crate::runtime::rng::Rng;
use crate::runtime::samplers::{self, ModelOutput};
use crate::runtime::tiling::TilingParams;
use crate::tensor::Tensor;
use crate::types::{Preview, SampleMethod};
use std::borrow::Cow;
use std::time::Instant;

/// What the stages of one generation share.
pub(super) struct Prepared {
    /// The latent the first stage starts from (zeros, or the encoded init image) and that
    /// masked regions keep.
    pub(super) init_latent: Tensor,
    /// Where the model may change the latent (1) and where the init latent stays (0),
    /// broadcast over the channels: `[W, H, 1, 1]` for pictures, `[W, H, T, 1, 1]` for video
    /// (per frame). `None`: everywhere.
    pub(super) denoise_mask: Option<Tensor>,
    /// Reference latents the diffusion model takes as extra tokens (empty otherwise).
    pub(super) ref_latents: Vec<Tensor>,
    pub(super) cond: Condition,
    pub(super) uncond: Option<Condition>,
    pub(super) img_uncond: Option<Condition>,
}

/// How the model timestep of an evaluation is formed from the sigma's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimestepRule {
    /// One timestep for the whole latent.
    Scalar,
    /// One per latent frame, 0 for the frames the denoise mask keeps (Wan2.2 TI2V); the
    /// model's input is also masked to the init latent there.
    PerFrameMasked,
    /// One timestep; the model's input is masked to the init latent where the denoise mask
    /// keeps it (LingBot Video's first frame).
    MaskedInput,
    /// The step's timestep for the latent as a whole and, with a denoise mask, one per video
    /// token (latent cell): the mask's first channel times it; the model's input is blended
    /// with the init latent by the mask (LTX-2.3's start and end pictures).
    PerToken,
}

/// Where previews go: the decoder (the first stage or a preview-only one), the family's
/// latent → RGB projection and the decode options.
pub(super) struct Previewer<'a> {
    pub(super) decoder: &'a mut dyn FirstStage,
    pub(super) projection: Option<&'static preview::Projection>,
    pub(super) tiling: &'a TilingParams,
    pub(super) circular: (bool, bool),
    /// The latents are videos: a decoded preview is the decoded video's frames.
    pub(super) video: bool,
}

/// Everything of a generation that does not change between its stages.
pub(super) struct Job<'a> {
    pub(super) request: &'a Request,
    pub(super) prepared: &'a Prepared,
    pub(super) denoiser: &'a Denoiser,
    pub(super) preview: Previewer<'a>,
    /// Which step caches apply (the family's backbone).
    pub(super) backbone: Backbone,
    pub(super) slg_supported: bool,
    /// Kontext's image-unconditional pass sees no reference latents.
    pub(super) ref_latent_img_cfg: bool,
    pub(super) timesteps: TimestepRule,
    pub(super) video: Option<VideoInput<'a>>,
    /// The context's extensions (their per-run, per-step and per-evaluation hooks).
    pub(super) extensions: &'a mut [Box<dyn Extension>],
    pub(super) cancel: &'a CancelFlag,
}

/// One sampling run with one diffusion model.
pub(super) struct Stage<'a> {
    pub(super) diffusion: &'a mut dyn DiffusionModel,
    pub(super) sigmas: &'a [f32],
    pub(super) method: SampleMethod,
    pub(super) eta: f32,
    pub(super) guidance: &'a GuidanceParams,
    /// Run the negative prompt's pass (when the job prepared one).
    pub(super) use_uncond: bool,
    pub(super) extra: &'a ExtraArgs,
    /// The noise the run starts from (scaled onto `x` with the first sigma); `None`: `x` is
    /// already noisy (a later stage of the same schedule).
    pub(super) noise: Option<&'a Tensor>,
    /// `shifted_timestep` (SDXL): the model sees this coarser timestep grid when > 0.
    pub(super) shifted_timestep: i32,
    /// Undo the denoiser's noise scaling on the result (the last stage).
    pub(super) last: bool,
}

/// A pass's input with what the extensions give it: the identity embedding, and the image
/// tokens of the prompt's pass or of the negative ones.
fn with_extensions<'a>(exts: &'a [Box<dyn Extension>], pass: Pass, input: DiffusionInput<'a>) -> DiffusionInput<'a> {
    DiffusionInput { identity: extensions::identity(exts), image_tokens: extensions::image_tokens(exts, pass != Pass::Cond), ..input }
}

fn compute_failed(e: Error) -> Error {
    Error::new(format!("diffusion model compute failed: {e}"))
}

/// The error of a cancelled generation.
pub fn cancelled() -> Error {
    Error::new("generation cancelled")
}

/// Runs one stage from `x` (the init latent, or the previous stage's result) and returns the
/// denoised latent.
pub(super) fn sample(job: &mut Job<'_>, stage: Stage<'_>, x: &Tensor, rng: &mut dyn Rng) -> Result<Tensor> {
    let Job { request: r, prepared, denoiser, preview: previewer, backbone, slg_supported, ref_latent_img_cfg, timesteps: rule, video, extensions: exts, cancel } = job;
    let (r, prepared, denoiser, cancel): (&Request, &Prepared, &Denoiser, &CancelFlag) = (r, prepared, denoiser, cancel);
    let Stage { diffusion, sigmas, method, eta, guidance, use_uncond, extra, noise, shifted_timestep, last } = stage;
    let steps = sigmas.len().saturating_sub(1) as i32;
    let needs_uncond = samplers::needs_uncond_denoised(method);
    let preview = callbacks::preview_config();
    let mask = prepared.denoise_mask.as_ref();
    let mut last_progress = Instant::now();

    let slg = SkipLayerGuidance::new(&guidance.slg, extra, *slg_supported, sigmas.len());
    let mut guider = Guider::new(guidance, extra, steps.max(0) as usize);
    let ref_latents: &[Tensor] = if r.refs.pass_to_dit { &prepared.ref_latents } else { &[] };
    let img_uncond_refs: &[Tensor] = if *ref_latent_img_cfg { &[] } else { ref_latents };
    let uncond_cond = prepared.uncond.as_ref().filter(|_| use_uncond);

    let mut cache = StepCache::new(&r.cache, *backbone, sigmas, denoiser, needs_uncond);

    let x_t = match noise {
        Some(noise) => denoiser.noise_scaling(sigmas[0], noise, x)?,
        None => x.clone(),
    };
    // Masked inputs and denoised latents keep the stage's starting latent where the mask is 0.
    let init = x;
    extensions::begin_run(exts)?;
    if let Err(e) = diffusion.begin() {
        extensions::end_run(exts);
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
        let t = denoiser.model_timestep(sigma, shifted_timestep);
        let s = denoiser.shifted_scalings(shifted_timestep, t, s);
        let mut input = x.map(|v| v * s.c_in);
        let mut token_timesteps = None;
        let timesteps = match (*rule, mask) {
            (TimestepRule::PerFrameMasked, Some(m)) => {
                input = blend(&input, init, m)?;
                frame_timesteps(t, m, x)?
            }
            (TimestepRule::PerFrameMasked, None) => vec![t; x.ne(2)],
            (TimestepRule::MaskedInput, Some(m)) => {
                input = blend(&input, init, m)?;
                denoiser.step_timesteps(t, step)
            }
            (TimestepRule::PerToken, Some(m)) => {
                input = blend(&input, init, m)?;
                token_timesteps = Some(mask_timesteps(t, m, x)?);
                denoiser.step_timesteps(t, step)
            }
            (TimestepRule::Scalar | TimestepRule::MaskedInput | TimestepRule::PerToken, _) => denoiser.step_timesteps(t, step),
        };
        // A forecast step skips the model (and the noisy preview) altogether.
        let forecast = cache.forecast();
        if forecast.is_none() && preview.noisy && preview.due(step.abs()) {
            send_preview(&input, step, true, &preview, previewer);
        }
        let skip_step = slg.enabled_for_step(step);
        let (denoised, uncond_denoised) = match forecast {
            Some(denoised) => (denoised, None),
            None => {
                cache.begin_step(step, sigma);
                // What every pass of this evaluation shares; a pass sets its condition,
                // references, skipped layers and residuals (`with_extensions` the rest).
                let base = DiffusionInput {
                    guidance: guidance.distilled_guidance,
                    ref_index_mode: r.refs.ref_index_mode,
                    ref_timestep_zero: r.refs.force_ref_timestep_zero,
                    control_strength: r.control_strength,
                    video: video.as_ref(),
                    timestep_r: usize::try_from(step + 1).ok().and_then(|i| sigmas.get(i).copied()),
                    token_timesteps: token_timesteps.as_deref(),
                    ..DiffusionInput::new(&input, &timesteps, &prepared.cond)
                };
                let run = |diffusion: &mut dyn DiffusionModel, exts: &[Box<dyn Extension>], cache: &mut StepCache, pass: Pass, dinput: DiffusionInput<'_>| {
                    if let Some(out) = cache.reuse(pass, &input) {
                        return Ok(out);
                    }
                    let out = diffusion.compute(&with_extensions(exts, pass, dinput)).map_err(compute_failed)?;
                    cache.store(pass, &input, &out);
                    Ok::<_, Error>(out)
                };
                // Like the reference, the ControlNet runs under the prompt's condition, then
                // under the negative one; the image-unconditioned pass reuses the last residuals.
                let mut controls = extensions::residuals(exts, &input, &timesteps, &prepared.cond)?;
                // An extension may swap the prompt's condition for this step (PhotoMaker after
                // its merge step); the ControlNet and skip-layer passes keep the plain one.
                let step_cond = extensions::step_condition(exts, step, &prepared.cond);
                let cond_in = DiffusionInput { cond: step_cond, ref_latents, controls: controls.as_deref(), ..base };
                let uncond_skip: &[i32] = if skip_step && slg.uncond { &slg.layers } else { &[] };
                if !uncond_skip.is_empty() {
                    sd_debug!("Skipping layers at uncond step {step}");
                }
                // The prompt's and the negative prompt's passes in one batch where the model
                // can (the outputs of two passes, with the weights read once). Not with
                // per-pass reuse, decided pass by pass, nor with ControlNet residuals, which
                // are made per pass.
                let pair = match uncond_cond {
                    Some(u) if controls.is_none() && !cache.reuses_passes() => {
                        let uncond_in = DiffusionInput { cond: u, skip_layers: uncond_skip, ..cond_in };
                        let (a, b) = (with_extensions(exts, Pass::Cond, cond_in), with_extensions(exts, Pass::Uncond, uncond_in));
                        // A batch needs twice one pass's activations: where it fails (a
                        // device out of memory), the passes run one by one, as they would
                        // without it.
                        let pair = diffusion.compute_pair(&a, &b).unwrap_or_else(|e| {
                            sd_warn!("the prompt's and the negative prompt's passes failed as one batch ({e}); computing them one by one");
                            None
                        });
                        if let Some([c, u]) = &pair {
                            cache.store(Pass::Cond, &input, c);
                            cache.store(Pass::Uncond, &input, u);
                        }
                        pair
                    }
                    _ => None,
                };
                let (cond_out, uncond_out) = match pair {
                    Some([c, u]) => (c, Some(u)),
                    None => {
                        let cond_out = run(&mut *diffusion, exts, &mut cache, Pass::Cond, cond_in)?;
                        if let (Some(_), Some(u)) = (&controls, uncond_cond) {
                            controls = extensions::residuals(exts, &input, &timesteps, u)?;
                        }
                        let uncond_out = uncond_cond
                            .map(|c| {
                                let uncond_in = DiffusionInput { cond: c, ref_latents, skip_layers: uncond_skip, controls: controls.as_deref(), ..base };
                                run(&mut *diffusion, exts, &mut cache, Pass::Uncond, uncond_in)
                            })
                            .transpose()?;
                        (cond_out, uncond_out)
                    }
                };
                let img_out = prepared
                    .img_uncond
                    .as_ref()
                    .map(|c| {
                        let img_in = DiffusionInput { cond: c, ref_latents: img_uncond_refs, controls: controls.as_deref(), ..base };
                        run(&mut *diffusion, exts, &mut cache, Pass::ImgUncond, img_in)
                    })
                    .transpose()?;
                let mut guided = guider.guide(step, &cond_out, uncond_out.as_ref(), img_out.as_ref());
                // Like the reference, a step whose outputs are reused gets no skip-layer pass.
                if skip_step && slg.scale != 0.0 && !cache.step_skipped() {
                    sd_debug!("Skipping layers at step {step}");
                    let skip_in = DiffusionInput { ref_latents, skip_layers: &slg.layers, controls: controls.as_deref(), ..base };
                    let skipped = run(&mut *diffusion, exts, &mut cache, Pass::Cond, skip_in)?;
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
        let denoised = match mask {
            Some(m) => blend(&denoised, init, m)?,
            None => denoised,
        };
        if preview.denoised && preview.due(step.abs()) {
            send_preview(&denoised, step, false, &preview, previewer);
        }
        if step > 0 || step == -steps {
            let now = Instant::now();
            callbacks::progress(step.abs(), steps, (now - last_progress).as_secs_f32());
            last_progress = now;
        }
        Ok(ModelOutput { denoised, uncond_denoised })
    };
    let result = samplers::sample(method, &mut model, x_t, sigmas, rng, eta, denoiser.is_flow(), extra, Some(denoiser));
    diffusion.end();
    extensions::end_run(exts);
    let x0 = result?;
    cache.log_summary(sigmas.len().saturating_sub(1));
    Ok(if last { denoiser.inverse_noise_scaling(*sigmas.last().unwrap_or(&0.0), x0) } else { x0 })
}

/// The model timestep of each latent frame of `x` `[W, H, T, C, 1]`: `t`, or 0 where the
/// per-frame mask `[W, H, T, 1, 1]` keeps the frame (its first pixel is 0).
fn frame_timesteps(t: f32, mask: &Tensor, x: &Tensor) -> Result<Vec<f32>> {
    let frames = x.ne(2);
    ensure!(mask.ne(2) == frames, "the denoise mask has {} frames, the latent {frames}", mask.ne(2));
    let plane = mask.ne(0) * mask.ne(1);
    Ok((0..frames).map(|f| if mask.data()[f * plane] == 0.0 { 0.0 } else { t }).collect())
}

/// One timestep per latent cell `[W, H, T]`: the mask's first channel times `t`.
fn mask_timesteps(t: f32, mask: &Tensor, x: &Tensor) -> Result<Vec<f32>> {
    let cells = x.ne(0) * x.ne(1) * x.ne(2);
    ensure!(
        (mask.ne(0), mask.ne(1), mask.ne(2)) == (x.ne(0), x.ne(1), x.ne(2)),
        "the denoise mask {:?} does not cover the latent {:?}",
        mask.shape(),
        x.shape()
    );
    Ok(mask.data()[..cells].iter().map(|m| m * t).collect())
}

/// Shows `latents` through the preview callback, decoded as configured: one picture per
/// layer of a stack, or per latent frame of a video.
fn send_preview(latents: &Tensor, step: i32, noisy: bool, config: &PreviewConfig, to: &mut Previewer<'_>) {
    if config.mode == Preview::None {
        return;
    }
    let stacked = (latents.shape().len() == 5).then(|| latents.ne(2));
    let layers = match picture_latents(latents, stacked) {
        Ok(v) => v,
        Err(e) => {
            sd_error!("preview failed at step {step}: {e}");
            return;
        }
    };
    let images: Result<Vec<crate::image::Image>> = match config.mode {
        Preview::Proj => layers.iter().map(|l| preview::project(l, to.projection)).collect(),
        _ if to.video => {
            let decoder = &mut *to.decoder;
            let out = decoder.begin().and_then(|_| {
                let video = decoder.decode_video(latents, to.tiling, to.circular, None)?;
                (0..video.ne(2)).map(|i| latent_layer(&video, i).and_then(|f| tensor_to_image(&f, 0))).collect()
            });
            decoder.end();
            out
        }
        _ => {
            let decoder = &mut *to.decoder;
            let out = decoder.begin().and_then(|_| {
                layers
                    .iter()
                    .map(|l| decoder.decode(&decoder.diffusion_to_vae(l), to.tiling, to.circular, None).and_then(|t| tensor_to_image(&t, 0)))
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

/// `denoised * mask + init * (1 - mask)`, the mask broadcast over every axis where it has
/// size 1 (the channels of `[W, H, C, N]` pictures and of layer stacks, the channels of a
/// video `[W, H, T, C, 1]` with a per-frame mask `[W, H, T, 1, 1]`).
pub(super) fn blend(denoised: &Tensor, init: &Tensor, mask: &Tensor) -> Result<Tensor> {
    ensure!(denoised.shape() == init.shape(), "blend of latents {:?} and {:?}", denoised.shape(), init.shape());
    let shape = denoised.shape();
    ensure!(mask.shape().len() <= shape.len().max(4), "denoise mask {:?} for latents {:?}", mask.shape(), shape);
    // The mask's stride along each axis of the latent (0 where it broadcasts).
    let mut strides = Vec::with_capacity(shape.len());
    let mut stride = 1usize;
    for (d, &n) in shape.iter().enumerate() {
        let m = mask.ne(d);
        ensure!(m == n || m == 1, "denoise mask {:?} does not broadcast over latents {:?}", mask.shape(), shape);
        strides.push(if m == 1 { 0 } else { stride });
        stride *= m;
    }
    let (m, d, i) = (mask.data(), denoised.data(), init.data());
    let mut out = Vec::with_capacity(d.len());
    let mut index = vec![0usize; shape.len()];
    let mut at = 0usize;
    for k in 0..d.len() {
        let mv = m[at];
        out.push(d[k] * mv + i[k] * (1.0 - mv));
        // Advance the multi-index and the mask offset.
        for (axis, idx) in index.iter_mut().enumerate() {
            *idx += 1;
            at += strides[axis];
            if *idx < shape[axis] {
                break;
            }
            at -= strides[axis] * shape[axis];
            *idx = 0;
        }
    }
    Tensor::from_vec(shape, out)
}

/// The latents of the pictures one final latent gives: with `layers`, each of the first
/// `layers` layers of a stack `[W, H, T, C, 1]` (the reference's message when it has fewer),
/// else the latent itself.
pub(super) fn picture_latents(lat: &Tensor, layers: Option<usize>) -> Result<Vec<Cow<'_, Tensor>>> {
    let Some(n) = layers else {
        return Ok(vec![Cow::Borrowed(lat)]);
    };
    ensure!(lat.shape().len() == 5 && lat.ne(2) >= n, "qwen image layered expected at least {n} latent layers, got shape dim={}", lat.shape().len());
    (0..n).map(|i| latent_layer(lat, i).map(Cow::Owned)).collect()
}

/// Layer `i` `[W, H, C, 1]` of a stack of latents `[W, H, T, C, 1]`.
pub(super) fn latent_layer(stack: &Tensor, i: usize) -> Result<Tensor> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn video_masks_keep_whole_frames_and_zero_their_timesteps() {
        // [W=1, H=1, T=3, C=2, 1] with frame 0 kept.
        let x = Tensor::from_vec(&[1, 1, 3, 2, 1], vec![1., 2., 3., 4., 5., 6.]).unwrap();
        let init = Tensor::full(x.shape(), 9.0);
        let mask = Tensor::from_vec(&[1, 1, 3, 1, 1], vec![0., 1., 1.]).unwrap();
        assert_eq!(blend(&x, &init, &mask).unwrap().data(), &[9., 2., 3., 9., 5., 6.]);
        assert_eq!(frame_timesteps(500.0, &mask, &x).unwrap(), vec![0.0, 500.0, 500.0]);
        let soft = Tensor::from_vec(&[1, 1, 3, 2, 1], vec![0.25, 1., 1., 1., 1., 1.]).unwrap();
        assert_eq!(mask_timesteps(0.5, &soft, &x).unwrap(), vec![0.125, 0.5, 0.5]);
        let bad = Tensor::from_vec(&[1, 1, 2, 1, 1], vec![0., 1.]).unwrap();
        assert!(blend(&x, &init, &bad).is_err());
    }
}
