//! C structs ⇄ `api` types.
//!
//! C → api checks everything a caller controls (enum values, counts, NULL pointers, UTF-8)
//! and names the offending field. api → C is used by the `*_init` functions (defaults only
//! hold NULL or empty strings, which map to static C strings) and for results, whose
//! buffers are `malloc`ed because callers release them with `free` / `free_sd_images`.

use super::guard::{opt_str, slice, str_or_empty};
use super::types::*;
use crate::api::*;
use crate::error::{Error, Result};
use libc::c_char;

// ---------------------------------------------------------------- C → api

/// An image; NULL data (or a zero size) is "no image".
///
/// # Safety
/// `img.data` is NULL or points to `width × height × channel` bytes.
pub(crate) unsafe fn image(img: &sd_image_t, what: &str) -> Result<Option<Image>> {
    if img.data.is_null() {
        return Ok(None);
    }
    let n = (img.width as u64)
        .checked_mul(img.height as u64)
        .and_then(|n| n.checked_mul(img.channel as u64))
        .filter(|&n| n <= isize::MAX as u64)
        .ok_or_else(|| Error::new(format!("{what}: size {}x{}x{} too large", img.width, img.height, img.channel)))?;
    if n == 0 {
        return Ok(None);
    }
    // SAFETY: caller's contract: `n` bytes at `data`.
    let data = unsafe { std::slice::from_raw_parts(img.data, n as usize) }.to_vec();
    Ok(Image::new(img.width, img.height, img.channel, data))
}

/// An array of images, each of which must hold pixels.
///
/// # Safety
/// `p` points to `count` images, each valid as for [`image`].
pub(crate) unsafe fn images(p: *const sd_image_t, count: i64, what: &str) -> Result<Vec<Image>> {
    // SAFETY: forwarded contract.
    let items = unsafe { slice(p, count, what) }?;
    items
        .iter()
        .enumerate()
        .map(|(i, img)| {
            let name = format!("{what}[{i}]");
            // SAFETY: forwarded contract.
            unsafe { image(img, &name) }?.ok_or_else(|| Error::new(format!("{name} has no pixel data")))
        })
        .collect()
}

/// Audio; NULL data is "no audio".
///
/// # Safety
/// `a.data` is NULL or points to `sample_count × channels` floats.
pub(crate) unsafe fn audio(a: &sd_audio_t, what: &str) -> Result<Option<Audio>> {
    if a.data.is_null() {
        return Ok(None);
    }
    let n = a
        .sample_count
        .checked_mul(a.channels as u64)
        .and_then(|n| i64::try_from(n).ok())
        .ok_or_else(|| Error::new(format!("{what}: {} samples × {} channels too large", a.sample_count, a.channels)))?;
    // SAFETY: forwarded contract.
    let data = unsafe { slice(a.data as *const f32, n, what) }?.to_vec();
    Ok(Some(Audio { sample_rate: a.sample_rate, channels: a.channels, data }))
}

/// # Safety
/// `p` points to `count` valid `sd_audio_t`.
unsafe fn audios(p: *const sd_audio_t, count: i64, what: &str) -> Result<Vec<Audio>> {
    // SAFETY: forwarded contract.
    let items = unsafe { slice(p, count, what) }?;
    let mut out = Vec::with_capacity(items.len());
    for (i, a) in items.iter().enumerate() {
        let name = format!("{what}[{i}]");
        // SAFETY: forwarded contract.
        out.push(unsafe { audio(a, &name) }?.ok_or_else(|| Error::new(format!("{name} has no samples")))?);
    }
    Ok(out)
}

/// # Safety
/// `p` points to `count` valid `sd_ref_video_t`.
unsafe fn ref_videos(p: *const sd_ref_video_t, count: i64, what: &str) -> Result<Vec<RefVideo>> {
    // SAFETY: forwarded contract.
    let items = unsafe { slice(p, count, what) }?;
    let mut out = Vec::with_capacity(items.len());
    for (i, v) in items.iter().enumerate() {
        let name = format!("{what}[{i}]");
        out.push(RefVideo {
            // SAFETY: forwarded contract.
            frames: unsafe { images(v.frames, v.frame_count as i64, &format!("{name}.frames")) }?,
            fps: v.fps,
            // SAFETY: forwarded contract.
            audio: unsafe { audio(&v.audio, &format!("{name}.audio")) }?,
        });
    }
    Ok(out)
}

/// # Safety
/// Every pointer of `p` is NULL or valid for its count.
pub(crate) unsafe fn ctx_params(p: &sd_ctx_params_t) -> Result<CtxParams> {
    // SAFETY (all reads below): the caller's contract on `p`'s pointers.
    unsafe {
        let s = |ptr: *const c_char, what: &str| opt_str(ptr, what);
        let embeddings = slice(p.embeddings, p.embedding_count as i64, "embeddings")?
            .iter()
            .enumerate()
            .map(|(i, e)| {
                Ok(Embedding {
                    name: str_or_empty(e.name, &format!("embeddings[{i}].name"))?,
                    path: str_or_empty(e.path, &format!("embeddings[{i}].path"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CtxParams {
            model_path: s(p.model_path, "model_path")?,
            clip_l_path: s(p.clip_l_path, "clip_l_path")?,
            clip_g_path: s(p.clip_g_path, "clip_g_path")?,
            clip_vision_path: s(p.clip_vision_path, "clip_vision_path")?,
            t5xxl_path: s(p.t5xxl_path, "t5xxl_path")?,
            llm_path: s(p.llm_path, "llm_path")?,
            llm_vision_path: s(p.llm_vision_path, "llm_vision_path")?,
            diffusion_model_path: s(p.diffusion_model_path, "diffusion_model_path")?,
            high_noise_diffusion_model_path: s(p.high_noise_diffusion_model_path, "high_noise_diffusion_model_path")?,
            uncond_diffusion_model_path: s(p.uncond_diffusion_model_path, "uncond_diffusion_model_path")?,
            embeddings_connectors_path: s(p.embeddings_connectors_path, "embeddings_connectors_path")?,
            vae_path: s(p.vae_path, "vae_path")?,
            audio_vae_path: s(p.audio_vae_path, "audio_vae_path")?,
            taesd_path: s(p.taesd_path, "taesd_path")?,
            control_net_path: s(p.control_net_path, "control_net_path")?,
            ip_adapter_path: s(p.ip_adapter_path, "ip_adapter_path")?,
            motion_module_path: s(p.motion_module_path, "motion_module_path")?,
            embeddings,
            photo_maker_path: s(p.photo_maker_path, "photo_maker_path")?,
            pulid_weights_path: s(p.pulid_weights_path, "pulid_weights_path")?,
            tensor_type_rules: s(p.tensor_type_rules, "tensor_type_rules")?,
            n_threads: p.n_threads,
            wtype: p.wtype.get_or_auto("wtype")?,
            rng_type: p.rng_type.require("rng_type")?,
            sampler_rng_type: p.sampler_rng_type.get_or_auto("sampler_rng_type")?,
            prediction: p.prediction.get_or_auto("prediction")?,
            lora_apply_mode: p.lora_apply_mode.require("lora_apply_mode")?,
            enable_mmap: p.enable_mmap.get(),
            flash_attn: p.flash_attn.get(),
            diffusion_flash_attn: p.diffusion_flash_attn.get(),
            tae_preview_only: p.tae_preview_only.get(),
            diffusion_conv_direct: p.diffusion_conv_direct.get(),
            vae_conv_direct: p.vae_conv_direct.get(),
            force_sdxl_vae_conv_scale: p.force_sdxl_vae_conv_scale.get(),
            vae_format: p.vae_format.require("vae_format")?,
            max_vram: s(p.max_vram, "max_vram")?,
            stream_layers: p.stream_layers.get(),
            eager_load: p.eager_load.get(),
            backend: s(p.backend, "backend")?,
            params_backend: s(p.params_backend, "params_backend")?,
            split_mode: s(p.split_mode, "split_mode")?,
            auto_fit: p.auto_fit.get(),
            rpc_servers: s(p.rpc_servers, "rpc_servers")?,
            model_args: s(p.model_args, "model_args")?,
        })
    }
}

/// # Safety
/// Every pointer of `p` is NULL or valid for its count.
pub(crate) unsafe fn sample_params(p: &sd_sample_params_t, what: &str) -> Result<SampleParams> {
    let g = &p.guidance;
    let layer_count = i64::try_from(g.slg.layer_count).unwrap_or(i64::MAX);
    // SAFETY (pointer reads): the caller's contract on `p`'s pointers.
    unsafe {
        Ok(SampleParams {
            guidance: GuidanceParams {
                txt_cfg: g.txt_cfg,
                img_cfg: g.img_cfg,
                distilled_guidance: g.distilled_guidance,
                slg: SlgParams {
                    layers: slice(g.slg.layers as *const i32, layer_count, &format!("{what}.guidance.slg.layers"))?.to_vec(),
                    layer_start: g.slg.layer_start,
                    layer_end: g.slg.layer_end,
                    scale: g.slg.scale,
                },
            },
            scheduler: p.scheduler.get_or_auto(&format!("{what}.scheduler"))?,
            sample_method: p.sample_method.get_or_auto(&format!("{what}.sample_method"))?,
            sample_steps: p.sample_steps,
            eta: p.eta,
            shifted_timestep: p.shifted_timestep,
            custom_sigmas: slice(p.custom_sigmas as *const f32, p.custom_sigmas_count as i64, &format!("{what}.custom_sigmas"))?
                .to_vec(),
            flow_shift: p.flow_shift,
            extra_sample_args: opt_str(p.extra_sample_args, &format!("{what}.extra_sample_args"))?,
        })
    }
}

/// # Safety
/// Every pointer of `p` is NULL or valid.
unsafe fn tiling_params(p: &sd_tiling_params_t) -> Result<TilingParams> {
    Ok(TilingParams {
        enabled: p.enabled.get(),
        temporal_tiling: p.temporal_tiling.get(),
        tile_size_x: p.tile_size_x,
        tile_size_y: p.tile_size_y,
        target_overlap: p.target_overlap,
        rel_size_x: p.rel_size_x,
        rel_size_y: p.rel_size_y,
        // SAFETY: the caller's contract.
        extra_tiling_args: unsafe { opt_str(p.extra_tiling_args, "vae_tiling_params.extra_tiling_args") }?,
    })
}

/// # Safety
/// Every pointer of `p` is NULL or valid.
unsafe fn cache_params(p: &sd_cache_params_t) -> Result<CacheParams> {
    Ok(CacheParams {
        mode: p.mode.require("cache.mode")?,
        reuse_threshold: p.reuse_threshold,
        start_percent: p.start_percent,
        end_percent: p.end_percent,
        error_decay_rate: p.error_decay_rate,
        use_relative_threshold: p.use_relative_threshold.get(),
        reset_error_on_compute: p.reset_error_on_compute.get(),
        fn_compute_blocks: p.Fn_compute_blocks,
        bn_compute_blocks: p.Bn_compute_blocks,
        residual_diff_threshold: p.residual_diff_threshold,
        max_warmup_steps: p.max_warmup_steps,
        max_cached_steps: p.max_cached_steps,
        max_continuous_cached_steps: p.max_continuous_cached_steps,
        taylorseer_n_derivatives: p.taylorseer_n_derivatives,
        taylorseer_skip_interval: p.taylorseer_skip_interval,
        // SAFETY: the caller's contract.
        scm_mask: unsafe { opt_str(p.scm_mask, "cache.scm_mask") }?,
        scm_policy_dynamic: p.scm_policy_dynamic.get(),
        spectrum_w: p.spectrum_w,
        spectrum_m: p.spectrum_m,
        spectrum_lam: p.spectrum_lam,
        spectrum_window_size: p.spectrum_window_size,
        spectrum_flex_window: p.spectrum_flex_window,
        spectrum_warmup_steps: p.spectrum_warmup_steps,
        spectrum_stop_percent: p.spectrum_stop_percent,
    })
}

/// # Safety
/// Every pointer of `p` is NULL or valid for its count.
unsafe fn hires_params(p: &sd_hires_params_t) -> Result<HiresParams> {
    Ok(HiresParams {
        enabled: p.enabled.get(),
        upscaler: p.upscaler.require("hires.upscaler")?,
        // SAFETY (pointer reads): the caller's contract.
        model_path: unsafe { opt_str(p.model_path, "hires.model_path") }?,
        scale: p.scale,
        target_width: p.target_width,
        target_height: p.target_height,
        steps: p.steps,
        denoising_strength: p.denoising_strength,
        upscale_tile_size: p.upscale_tile_size,
        custom_sigmas: unsafe { slice(p.custom_sigmas as *const f32, p.custom_sigmas_count as i64, "hires.custom_sigmas") }?
            .to_vec(),
    })
}

/// # Safety
/// `p` points to `count` valid `sd_lora_t`.
unsafe fn loras(p: *const sd_lora_t, count: u32) -> Result<Vec<Lora>> {
    // SAFETY (pointer reads): the caller's contract.
    unsafe {
        slice(p, count as i64, "loras")?
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(Lora {
                    is_high_noise: l.is_high_noise.get(),
                    multiplier: l.multiplier,
                    path: opt_str(l.path, &format!("loras[{i}].path"))?
                        .ok_or_else(|| Error::new(format!("loras[{i}].path is NULL")))?,
                })
            })
            .collect()
    }
}

/// # Safety
/// Every pointer of `p` is NULL or valid for its count.
pub(crate) unsafe fn img_gen_params(p: &sd_img_gen_params_t) -> Result<ImgGenParams> {
    // SAFETY (all reads below): the caller's contract on `p`'s pointers.
    unsafe {
        Ok(ImgGenParams {
            loras: loras(p.loras, p.lora_count)?,
            prompt: str_or_empty(p.prompt, "prompt")?,
            negative_prompt: str_or_empty(p.negative_prompt, "negative_prompt")?,
            clip_skip: p.clip_skip,
            init_image: image(&p.init_image, "init_image")?,
            ref_images: images(p.ref_images, p.ref_images_count as i64, "ref_images")?,
            ref_image_args: str_or_empty(p.ref_image_args, "ref_image_args")?,
            mask_image: image(&p.mask_image, "mask_image")?,
            width: p.width,
            height: p.height,
            sample_params: sample_params(&p.sample_params, "sample_params")?,
            strength: p.strength,
            seed: p.seed,
            batch_count: p.batch_count,
            control_image: image(&p.control_image, "control_image")?,
            control_strength: p.control_strength,
            ip_adapter_image: image(&p.ip_adapter_image, "ip_adapter_image")?,
            ip_adapter_strength: p.ip_adapter_strength,
            pm_params: PmParams {
                id_images: images(p.pm_params.id_images, p.pm_params.id_images_count as i64, "pm_params.id_images")?,
                id_embed_path: opt_str(p.pm_params.id_embed_path, "pm_params.id_embed_path")?,
                style_strength: p.pm_params.style_strength,
            },
            pulid_params: PulidParams {
                id_embedding_path: opt_str(p.pulid_params.id_embedding_path, "pulid_params.id_embedding_path")?,
                id_weight: p.pulid_params.id_weight,
            },
            vae_tiling_params: tiling_params(&p.vae_tiling_params)?,
            cache: cache_params(&p.cache)?,
            hires: hires_params(&p.hires)?,
            qwen_image_layers: p.qwen_image_layers,
            circular_x: p.circular_x.get(),
            circular_y: p.circular_y.get(),
        })
    }
}

/// # Safety
/// Every pointer of `p` is NULL or valid for its count.
pub(crate) unsafe fn vid_gen_params(p: &sd_vid_gen_params_t) -> Result<VidGenParams> {
    // SAFETY (all reads below): the caller's contract on `p`'s pointers.
    unsafe {
        Ok(VidGenParams {
            loras: loras(p.loras, p.lora_count)?,
            prompt: str_or_empty(p.prompt, "prompt")?,
            negative_prompt: str_or_empty(p.negative_prompt, "negative_prompt")?,
            clip_skip: p.clip_skip,
            init_image: image(&p.init_image, "init_image")?,
            end_image: image(&p.end_image, "end_image")?,
            ref_images: images(p.ref_images, p.ref_images_count as i64, "ref_images")?,
            ref_videos: ref_videos(p.ref_videos, p.ref_videos_count as i64, "ref_videos")?,
            ref_audios: audios(p.ref_audios, p.ref_audios_count as i64, "ref_audios")?,
            control_frames: images(p.control_frames, p.control_frames_size as i64, "control_frames")?,
            width: p.width,
            height: p.height,
            sample_params: sample_params(&p.sample_params, "sample_params")?,
            high_noise_sample_params: sample_params(&p.high_noise_sample_params, "high_noise_sample_params")?,
            moe_boundary: p.moe_boundary,
            strength: p.strength,
            seed: p.seed,
            video_frames: p.video_frames,
            fps: p.fps,
            vace_strength: p.vace_strength,
            vae_tiling_params: tiling_params(&p.vae_tiling_params)?,
            cache: cache_params(&p.cache)?,
            hires: hires_params(&p.hires)?,
            circular_x: p.circular_x.get(),
            circular_y: p.circular_y.get(),
        })
    }
}

/// # Safety
/// Every pointer of `p` is NULL or valid.
pub(crate) unsafe fn adetailer_params(p: &sd_adetailer_params_t) -> Result<AdetailerParams> {
    // SAFETY: the caller's contract.
    unsafe {
        Ok(AdetailerParams {
            prompt: opt_str(p.prompt, "adetailer_params.prompt")?,
            negative_prompt: opt_str(p.negative_prompt, "adetailer_params.negative_prompt")?,
            extra_ad_args: opt_str(p.extra_ad_args, "adetailer_params.extra_ad_args")?,
        })
    }
}

// ---------------------------------------------------------------- api → C (defaults)

/// A default string: NULL for `None`, a static "" for the empty string. The reference's
/// `*_init` functions set no other strings, so nothing here allocates.
fn default_str(s: Option<&str>) -> *const c_char {
    match s {
        Some("") => c"".as_ptr(),
        Some(other) => {
            debug_assert!(false, "non-empty default string {other:?}");
            std::ptr::null()
        }
        None => std::ptr::null(),
    }
}

/// Empty strings are NULL (prompts: the reference's defaults leave them unset).
fn default_text(s: &str) -> *const c_char {
    default_str(Some(s).filter(|s| !s.is_empty()))
}

const NO_IMAGE: sd_image_t = sd_image_t { width: 0, height: 0, channel: 0, data: std::ptr::null_mut() };

fn check_default_empty<T>(v: &[T], what: &str) {
    debug_assert!(v.is_empty(), "{what}: *_init only writes defaults, which hold no arrays");
}

pub(crate) fn ctx_params_to_c(p: &CtxParams) -> sd_ctx_params_t {
    check_default_empty(&p.embeddings, "embeddings");
    let s = |v: &Option<String>| default_str(v.as_deref());
    sd_ctx_params_t {
        model_path: s(&p.model_path),
        clip_l_path: s(&p.clip_l_path),
        clip_g_path: s(&p.clip_g_path),
        clip_vision_path: s(&p.clip_vision_path),
        t5xxl_path: s(&p.t5xxl_path),
        llm_path: s(&p.llm_path),
        llm_vision_path: s(&p.llm_vision_path),
        diffusion_model_path: s(&p.diffusion_model_path),
        high_noise_diffusion_model_path: s(&p.high_noise_diffusion_model_path),
        uncond_diffusion_model_path: s(&p.uncond_diffusion_model_path),
        embeddings_connectors_path: s(&p.embeddings_connectors_path),
        vae_path: s(&p.vae_path),
        audio_vae_path: s(&p.audio_vae_path),
        taesd_path: s(&p.taesd_path),
        control_net_path: s(&p.control_net_path),
        ip_adapter_path: s(&p.ip_adapter_path),
        motion_module_path: s(&p.motion_module_path),
        embeddings: std::ptr::null(),
        embedding_count: 0,
        photo_maker_path: s(&p.photo_maker_path),
        pulid_weights_path: s(&p.pulid_weights_path),
        tensor_type_rules: s(&p.tensor_type_rules),
        n_threads: p.n_threads,
        wtype: p.wtype.map_or(sd_type_t::COUNT, sd_type_t::from),
        rng_type: p.rng_type.into(),
        sampler_rng_type: p.sampler_rng_type.map_or(rng_type_t::COUNT, rng_type_t::from),
        prediction: p.prediction.map_or(prediction_t::COUNT, prediction_t::from),
        lora_apply_mode: p.lora_apply_mode.into(),
        enable_mmap: p.enable_mmap.into(),
        flash_attn: p.flash_attn.into(),
        diffusion_flash_attn: p.diffusion_flash_attn.into(),
        tae_preview_only: p.tae_preview_only.into(),
        diffusion_conv_direct: p.diffusion_conv_direct.into(),
        vae_conv_direct: p.vae_conv_direct.into(),
        force_sdxl_vae_conv_scale: p.force_sdxl_vae_conv_scale.into(),
        vae_format: p.vae_format.into(),
        max_vram: s(&p.max_vram),
        stream_layers: p.stream_layers.into(),
        eager_load: p.eager_load.into(),
        backend: s(&p.backend),
        params_backend: s(&p.params_backend),
        split_mode: s(&p.split_mode),
        auto_fit: p.auto_fit.into(),
        rpc_servers: s(&p.rpc_servers),
        model_args: s(&p.model_args),
    }
}

pub(crate) fn sample_params_to_c(p: &SampleParams) -> sd_sample_params_t {
    check_default_empty(&p.guidance.slg.layers, "slg.layers");
    check_default_empty(&p.custom_sigmas, "custom_sigmas");
    let g = &p.guidance;
    sd_sample_params_t {
        guidance: sd_guidance_params_t {
            txt_cfg: g.txt_cfg,
            img_cfg: g.img_cfg,
            distilled_guidance: g.distilled_guidance,
            slg: sd_slg_params_t {
                layers: std::ptr::null_mut(),
                layer_count: 0,
                layer_start: g.slg.layer_start,
                layer_end: g.slg.layer_end,
                scale: g.slg.scale,
            },
        },
        scheduler: p.scheduler.map_or(scheduler_t::COUNT, scheduler_t::from),
        sample_method: p.sample_method.map_or(sample_method_t::COUNT, sample_method_t::from),
        sample_steps: p.sample_steps,
        eta: p.eta,
        shifted_timestep: p.shifted_timestep,
        custom_sigmas: std::ptr::null_mut(),
        custom_sigmas_count: 0,
        flow_shift: p.flow_shift,
        extra_sample_args: default_str(p.extra_sample_args.as_deref()),
    }
}

fn tiling_params_to_c(p: &TilingParams) -> sd_tiling_params_t {
    sd_tiling_params_t {
        enabled: p.enabled.into(),
        temporal_tiling: p.temporal_tiling.into(),
        tile_size_x: p.tile_size_x,
        tile_size_y: p.tile_size_y,
        target_overlap: p.target_overlap,
        rel_size_x: p.rel_size_x,
        rel_size_y: p.rel_size_y,
        extra_tiling_args: default_str(p.extra_tiling_args.as_deref()),
    }
}

pub(crate) fn cache_params_to_c(p: &CacheParams) -> sd_cache_params_t {
    sd_cache_params_t {
        mode: p.mode.into(),
        reuse_threshold: p.reuse_threshold,
        start_percent: p.start_percent,
        end_percent: p.end_percent,
        error_decay_rate: p.error_decay_rate,
        use_relative_threshold: p.use_relative_threshold.into(),
        reset_error_on_compute: p.reset_error_on_compute.into(),
        Fn_compute_blocks: p.fn_compute_blocks,
        Bn_compute_blocks: p.bn_compute_blocks,
        residual_diff_threshold: p.residual_diff_threshold,
        max_warmup_steps: p.max_warmup_steps,
        max_cached_steps: p.max_cached_steps,
        max_continuous_cached_steps: p.max_continuous_cached_steps,
        taylorseer_n_derivatives: p.taylorseer_n_derivatives,
        taylorseer_skip_interval: p.taylorseer_skip_interval,
        scm_mask: default_str(p.scm_mask.as_deref()),
        scm_policy_dynamic: p.scm_policy_dynamic.into(),
        spectrum_w: p.spectrum_w,
        spectrum_m: p.spectrum_m,
        spectrum_lam: p.spectrum_lam,
        spectrum_window_size: p.spectrum_window_size,
        spectrum_flex_window: p.spectrum_flex_window,
        spectrum_warmup_steps: p.spectrum_warmup_steps,
        spectrum_stop_percent: p.spectrum_stop_percent,
    }
}

pub(crate) fn hires_params_to_c(p: &HiresParams) -> sd_hires_params_t {
    check_default_empty(&p.custom_sigmas, "hires.custom_sigmas");
    sd_hires_params_t {
        enabled: p.enabled.into(),
        upscaler: p.upscaler.into(),
        model_path: default_str(p.model_path.as_deref()),
        scale: p.scale,
        target_width: p.target_width,
        target_height: p.target_height,
        steps: p.steps,
        denoising_strength: p.denoising_strength,
        upscale_tile_size: p.upscale_tile_size,
        custom_sigmas: std::ptr::null_mut(),
        custom_sigmas_count: 0,
    }
}

pub(crate) fn img_gen_params_to_c(p: &ImgGenParams) -> sd_img_gen_params_t {
    check_default_empty(&p.loras, "loras");
    check_default_empty(&p.ref_images, "ref_images");
    check_default_empty(&p.pm_params.id_images, "pm_params.id_images");
    sd_img_gen_params_t {
        loras: std::ptr::null(),
        lora_count: 0,
        prompt: default_text(&p.prompt),
        negative_prompt: default_text(&p.negative_prompt),
        clip_skip: p.clip_skip,
        init_image: NO_IMAGE,
        ref_images: std::ptr::null_mut(),
        ref_images_count: 0,
        // Unlike the prompts, the reference initialises this one to "".
        ref_image_args: default_str(Some(&p.ref_image_args)),
        mask_image: NO_IMAGE,
        width: p.width,
        height: p.height,
        sample_params: sample_params_to_c(&p.sample_params),
        strength: p.strength,
        seed: p.seed,
        batch_count: p.batch_count,
        control_image: NO_IMAGE,
        control_strength: p.control_strength,
        ip_adapter_image: NO_IMAGE,
        ip_adapter_strength: p.ip_adapter_strength,
        pm_params: sd_pm_params_t {
            id_images: std::ptr::null_mut(),
            id_images_count: 0,
            id_embed_path: default_str(p.pm_params.id_embed_path.as_deref()),
            style_strength: p.pm_params.style_strength,
        },
        pulid_params: sd_pulid_params_t {
            id_embedding_path: default_str(p.pulid_params.id_embedding_path.as_deref()),
            id_weight: p.pulid_params.id_weight,
        },
        vae_tiling_params: tiling_params_to_c(&p.vae_tiling_params),
        cache: cache_params_to_c(&p.cache),
        hires: hires_params_to_c(&p.hires),
        qwen_image_layers: p.qwen_image_layers,
        circular_x: p.circular_x.into(),
        circular_y: p.circular_y.into(),
    }
}

pub(crate) fn vid_gen_params_to_c(p: &VidGenParams) -> sd_vid_gen_params_t {
    check_default_empty(&p.loras, "loras");
    check_default_empty(&p.ref_images, "ref_images");
    check_default_empty(&p.ref_videos, "ref_videos");
    check_default_empty(&p.ref_audios, "ref_audios");
    check_default_empty(&p.control_frames, "control_frames");
    sd_vid_gen_params_t {
        loras: std::ptr::null(),
        lora_count: 0,
        prompt: default_text(&p.prompt),
        negative_prompt: default_text(&p.negative_prompt),
        clip_skip: p.clip_skip,
        init_image: NO_IMAGE,
        end_image: NO_IMAGE,
        ref_images: std::ptr::null_mut(),
        ref_images_count: 0,
        ref_videos: std::ptr::null_mut(),
        ref_videos_count: 0,
        ref_audios: std::ptr::null_mut(),
        ref_audios_count: 0,
        control_frames: std::ptr::null_mut(),
        control_frames_size: 0,
        width: p.width,
        height: p.height,
        sample_params: sample_params_to_c(&p.sample_params),
        high_noise_sample_params: sample_params_to_c(&p.high_noise_sample_params),
        moe_boundary: p.moe_boundary,
        strength: p.strength,
        seed: p.seed,
        video_frames: p.video_frames,
        fps: p.fps,
        vace_strength: p.vace_strength,
        vae_tiling_params: tiling_params_to_c(&p.vae_tiling_params),
        cache: cache_params_to_c(&p.cache),
        hires: hires_params_to_c(&p.hires),
        circular_x: p.circular_x.into(),
        circular_y: p.circular_y.into(),
    }
}

// ---------------------------------------------------------------- results → C

/// Copies `bytes` into a `malloc`ed buffer (NULL for an empty slice).
fn malloc_copy<T: Copy>(items: &[T]) -> Result<*mut T> {
    if items.is_empty() {
        return Ok(std::ptr::null_mut());
    }
    let bytes = std::mem::size_of_val(items);
    // SAFETY: plain allocation; checked for NULL before use.
    let p = unsafe { libc::malloc(bytes) } as *mut T;
    ensure!(!p.is_null(), "out of memory allocating {bytes} bytes");
    // SAFETY: `p` holds `bytes` bytes and does not overlap `items`.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), p, items.len()) };
    Ok(p)
}

/// Images as a `malloc`ed array of `malloc`ed pixel buffers (`free_sd_images` releases it).
pub(crate) fn images_to_c(images: &[Image]) -> Result<(*mut sd_image_t, i32)> {
    let n = i32::try_from(images.len()).map_err(|_| Error::new("too many images"))?;
    if n == 0 {
        return Ok((std::ptr::null_mut(), 0));
    }
    // SAFETY: zeroed allocation of `n` image records, checked for NULL.
    let arr = unsafe { libc::calloc(images.len(), std::mem::size_of::<sd_image_t>()) } as *mut sd_image_t;
    ensure!(!arr.is_null(), "out of memory allocating {n} image records");
    for (i, img) in images.iter().enumerate() {
        match malloc_copy(&img.data) {
            Ok(data) => {
                let rec = sd_image_t { width: img.width, height: img.height, channel: img.channels, data };
                // SAFETY: `i < n`, inside the calloc'ed array.
                unsafe { arr.add(i).write(rec) };
            }
            Err(e) => {
                // SAFETY: the records written so far hold malloc'ed data (or NULL).
                unsafe { free_images(arr, i as i32) };
                return Err(e);
            }
        }
    }
    Ok((arr, n))
}

/// Frees what `images_to_c` (or the reference) allocated.
///
/// # Safety
/// `arr` is NULL or a `malloc`ed array of at least `n` images with `malloc`ed data.
pub(crate) unsafe fn free_images(arr: *mut sd_image_t, n: i32) {
    if arr.is_null() {
        return;
    }
    for i in 0..n.max(0) as usize {
        // SAFETY: within the array per the caller's contract.
        let rec = unsafe { &mut *arr.add(i) };
        if !rec.data.is_null() {
            // SAFETY: malloc'ed per the contract; cleared so it cannot be freed twice.
            unsafe { libc::free(rec.data.cast()) };
            rec.data = std::ptr::null_mut();
        }
    }
    // SAFETY: malloc'ed per the contract.
    unsafe { libc::free(arr.cast()) };
}

/// Audio as a `malloc`ed `sd_audio_t` with `malloc`ed samples (`free_sd_audio` releases it).
pub(crate) fn audio_to_c(a: &Audio) -> Result<*mut sd_audio_t> {
    let data = malloc_copy(&a.data)?;
    // SAFETY: plain allocation, checked for NULL.
    let p = unsafe { libc::malloc(std::mem::size_of::<sd_audio_t>()) } as *mut sd_audio_t;
    if p.is_null() {
        // SAFETY: malloc'ed above (or NULL).
        unsafe { libc::free(data.cast()) };
        bail!("out of memory allocating audio");
    }
    let rec = sd_audio_t { sample_rate: a.sample_rate, channels: a.channels, sample_count: a.sample_count(), data };
    // SAFETY: `p` holds one sd_audio_t.
    unsafe { p.write(rec) };
    Ok(p)
}

/// A `malloc`ed NUL-terminated copy of `s` (interior NULs are dropped).
pub(crate) fn malloc_cstring(s: &str) -> Result<*mut c_char> {
    let mut bytes: Vec<u8> = s.bytes().filter(|&b| b != 0).collect();
    bytes.push(0);
    Ok(malloc_copy(&bytes)?.cast())
}

/// For tests: reads back a C string written by this module.
#[cfg(test)]
pub(crate) fn read_cstr(p: *const c_char) -> String {
    // SAFETY: test helper on our own NUL-terminated strings.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_round_trip_through_malloc() {
        let imgs = vec![Image::new(2, 1, 3, vec![1, 2, 3, 4, 5, 6]).unwrap(), Image::new(1, 1, 1, vec![9]).unwrap()];
        let (arr, n) = images_to_c(&imgs).unwrap();
        assert_eq!(n, 2);
        // SAFETY: arr came from images_to_c.
        unsafe {
            let back = images(arr, n as i64, "out").unwrap();
            assert_eq!(back, imgs);
            free_images(arr, n);
        }
        assert_eq!(images_to_c(&[]).unwrap().1, 0);
        let s = malloc_cstring("a\0b").unwrap();
        assert_eq!(read_cstr(s), "ab");
        // SAFETY: malloc'ed above.
        unsafe { libc::free(s.cast()) };
    }

    #[test]
    fn audio_round_trip() {
        let a = Audio { sample_rate: 8000, channels: 2, data: vec![0.5; 6] };
        let p = audio_to_c(&a).unwrap();
        // SAFETY: p came from audio_to_c.
        unsafe {
            assert_eq!((*p).sample_count, 3);
            assert_eq!(audio(&*p, "a").unwrap(), Some(a));
            libc::free((*p).data.cast());
            libc::free(p.cast());
        }
    }

    fn err_of(r: Result<ImgGenParams>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn img_gen_params_are_checked_field_by_field() {
        let base = img_gen_params_to_c(&ImgGenParams::default());
        // SAFETY: every pointer below is NULL, static or points into locals.
        unsafe {
            assert_eq!(img_gen_params(&base).unwrap(), ImgGenParams::default());

            let mut p = base;
            p.ref_images_count = -1;
            assert!(err_of(img_gen_params(&p)).contains("ref_images: negative count"));
            let mut p = base;
            p.lora_count = 3;
            assert!(err_of(img_gen_params(&p)).contains("loras: NULL pointer"));
            let mut p = base;
            p.sample_params.sample_method = sample_method_t(9999);
            assert!(err_of(img_gen_params(&p)).contains("invalid sample_params.sample_method"));
            let mut p = base;
            p.hires.upscaler = sd_hires_upscaler_t(u32::MAX);
            assert!(err_of(img_gen_params(&p)).contains("invalid hires.upscaler"));
            let mut p = base;
            p.cache.mode = sd_cache_mode_t(7);
            assert!(err_of(img_gen_params(&p)).contains("invalid cache.mode"));
            let bad = [0xc3u8 as c_char, 0x28, 0];
            let mut p = base;
            p.negative_prompt = bad.as_ptr();
            assert!(err_of(img_gen_params(&p)).contains("negative_prompt is not valid UTF-8"));
            let mut p = base;
            p.sample_params.guidance.slg.layer_count = usize::MAX;
            assert!(err_of(img_gen_params(&p)).contains("slg.layers"));

            // A hole in an image array, and a huge image.
            let empty = sd_image_t { width: 0, height: 0, channel: 0, data: std::ptr::null_mut() };
            let mut refs = [empty];
            let mut p = base;
            p.ref_images = refs.as_mut_ptr();
            p.ref_images_count = 1;
            assert!(err_of(img_gen_params(&p)).contains("ref_images[0] has no pixel data"));
            let mut px = [0u8; 4];
            let mut p = base;
            p.init_image = sd_image_t { width: u32::MAX, height: u32::MAX, channel: 3, data: px.as_mut_ptr() };
            assert!(err_of(img_gen_params(&p)).contains("init_image: size"));

            // Good values come through.
            let sigmas = [1.0f32, 0.5, 0.0];
            let lora = sd_lora_t { is_high_noise: CBool(7), multiplier: 0.5, path: c"a.safetensors".as_ptr() };
            let mut p = base;
            p.sample_params.custom_sigmas = sigmas.as_ptr() as *mut f32;
            p.sample_params.custom_sigmas_count = 3;
            p.sample_params.scheduler = scheduler_t(1);
            p.loras = &lora;
            p.lora_count = 1;
            p.init_image = sd_image_t { width: 2, height: 2, channel: 1, data: px.as_mut_ptr() };
            p.prompt = c"a cat".as_ptr();
            let g = img_gen_params(&p).unwrap();
            assert_eq!(g.sample_params.custom_sigmas, sigmas);
            assert_eq!(g.sample_params.scheduler, Some(crate::types::Scheduler::Karras));
            assert_eq!(g.loras, vec![Lora { is_high_noise: true, multiplier: 0.5, path: "a.safetensors".into() }]);
            assert_eq!(g.init_image.map(|i| i.data.len()), Some(4));
            assert_eq!(g.prompt, "a cat");
        }
    }

    #[test]
    fn vid_gen_defaults_round_trip() {
        let base = vid_gen_params_to_c(&VidGenParams::default());
        // SAFETY: defaults hold only NULL or static pointers.
        unsafe {
            assert_eq!(vid_gen_params(&base).unwrap(), VidGenParams::default());
            let mut p = base;
            p.ref_audios_count = 2;
            assert!(vid_gen_params(&p).is_err());
            let c = ctx_params_to_c(&CtxParams::default());
            assert_eq!(ctx_params(&c).unwrap(), CtxParams::default());
        }
    }
}
