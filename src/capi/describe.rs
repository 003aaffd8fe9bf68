//! Text of `sd_ctx_params_to_str`, `sd_sample_params_to_str` and `sd_img_gen_params_to_str`.
//!
//! The lines the reference prints come first, formatted as it formats them (printf `%.2f`,
//! "true"/"false", "NONE" for undeclared enum values, "" for NULL strings); the fields it
//! leaves out follow in the same style, so every field is listed. These read the raw C
//! structs: describing garbage must not fail.

use super::guard::lossy_str;
use super::types::*;
use std::fmt::Write;

/// printf("%.Nf") of a float promoted to double, including inf / nan spelling.
pub(crate) fn fixed(v: f32, decimals: usize) -> String {
    let v = v as f64;
    if v.is_nan() {
        return if v.is_sign_negative() { "-nan".into() } else { "nan".into() };
    }
    if v.is_infinite() {
        return if v < 0.0 { "-inf".into() } else { "inf".into() };
    }
    format!("{v:.decimals$}")
}

fn f2(v: f32) -> String {
    fixed(v, 2)
}

fn yes_no(b: CBool) -> &'static str {
    if b.get() {
        "true"
    } else {
        "false"
    }
}

/// `WxHxC` of an image, or "none" without pixels.
fn image_dims(img: &sd_image_t) -> String {
    if img.data.is_null() {
        "none".into()
    } else {
        format!("{}x{}x{}", img.width, img.height, img.channel)
    }
}

/// # Safety
/// The string pointers of `p` are NULL or NUL-terminated.
pub(crate) unsafe fn ctx_params(p: &sd_ctx_params_t) -> String {
    // SAFETY (every `s`): the caller's contract on the string pointers.
    let s = |ptr| unsafe { lossy_str(ptr) };
    let mut out = String::new();
    let lines: [(&str, String); 34] = [
        ("model_path", s(p.model_path)),
        ("clip_l_path", s(p.clip_l_path)),
        ("clip_g_path", s(p.clip_g_path)),
        ("clip_vision_path", s(p.clip_vision_path)),
        ("t5xxl_path", s(p.t5xxl_path)),
        ("llm_path", s(p.llm_path)),
        ("llm_vision_path", s(p.llm_vision_path)),
        ("diffusion_model_path", s(p.diffusion_model_path)),
        ("high_noise_diffusion_model_path", s(p.high_noise_diffusion_model_path)),
        ("uncond_diffusion_model_path", s(p.uncond_diffusion_model_path)),
        ("embeddings_connectors_path", s(p.embeddings_connectors_path)),
        ("vae_path", s(p.vae_path)),
        ("audio_vae_path", s(p.audio_vae_path)),
        ("taesd_path", s(p.taesd_path)),
        ("control_net_path", s(p.control_net_path)),
        ("photo_maker_path", s(p.photo_maker_path)),
        ("pulid_weights_path", s(p.pulid_weights_path)),
        ("tensor_type_rules", s(p.tensor_type_rules)),
        ("n_threads", p.n_threads.to_string()),
        ("wtype", p.wtype.name().into()),
        ("rng_type", p.rng_type.name().into()),
        ("sampler_rng_type", p.sampler_rng_type.name().into()),
        ("prediction", p.prediction.name().into()),
        ("max_vram", s(p.max_vram)),
        ("stream_layers", yes_no(p.stream_layers).into()),
        ("eager_load", yes_no(p.eager_load).into()),
        ("backend", s(p.backend)),
        ("params_backend", s(p.params_backend)),
        ("split_mode", s(p.split_mode)),
        ("model_args", s(p.model_args)),
        ("auto_fit", yes_no(p.auto_fit).into()),
        ("flash_attn", yes_no(p.flash_attn).into()),
        ("diffusion_flash_attn", yes_no(p.diffusion_flash_attn).into()),
        ("vae_format", p.vae_format.name().into()),
    ];
    let extra: [(&str, String); 11] = [
        ("ip_adapter_path", s(p.ip_adapter_path)),
        ("motion_module_path", s(p.motion_module_path)),
        ("embedding_count", p.embedding_count.to_string()),
        ("lora_apply_mode", p.lora_apply_mode.name().into()),
        ("enable_mmap", yes_no(p.enable_mmap).into()),
        ("tae_preview_only", yes_no(p.tae_preview_only).into()),
        ("diffusion_conv_direct", yes_no(p.diffusion_conv_direct).into()),
        ("vae_conv_direct", yes_no(p.vae_conv_direct).into()),
        ("force_sdxl_vae_conv_scale", yes_no(p.force_sdxl_vae_conv_scale).into()),
        ("rpc_servers", s(p.rpc_servers)),
        ("embeddings", {
            // SAFETY: the caller's contract covers the embeddings array.
            let list = unsafe { super::guard::slice(p.embeddings, p.embedding_count as i64, "embeddings") };
            match list {
                Ok(list) => list.iter().map(|e| format!("{}={}", s(e.name), s(e.path))).collect::<Vec<_>>().join(", "),
                Err(_) => String::new(),
            }
        }),
    ];
    for (name, value) in lines.iter().chain(extra.iter()) {
        let _ = writeln!(out, "{name}: {value}");
    }
    out
}

/// # Safety
/// `p.extra_sample_args` is NULL or NUL-terminated.
pub(crate) unsafe fn sample_params(p: &sd_sample_params_t) -> String {
    let g = &p.guidance;
    let img_cfg = if g.img_cfg.is_finite() { g.img_cfg } else { g.txt_cfg };
    format!(
        "(txt_cfg: {}, img_cfg: {}, distilled_guidance: {}, slg.layer_count: {}, slg.layer_start: {}, \
         slg.layer_end: {}, slg.scale: {}, scheduler: {}, sample_method: {}, sample_steps: {}, eta: {}, \
         shifted_timestep: {}, flow_shift: {}, extra_sample_args: {}, custom_sigmas_count: {})",
        f2(g.txt_cfg),
        f2(img_cfg),
        f2(g.distilled_guidance),
        g.slg.layer_count,
        f2(g.slg.layer_start),
        f2(g.slg.layer_end),
        f2(g.slg.scale),
        p.scheduler.name(),
        p.sample_method.name(),
        p.sample_steps,
        f2(p.eta),
        p.shifted_timestep,
        f2(p.flow_shift),
        // SAFETY: the caller's contract.
        unsafe { lossy_str(p.extra_sample_args) },
        p.custom_sigmas_count,
    )
}

/// # Safety
/// The string pointers of `p` are NULL or NUL-terminated.
pub(crate) unsafe fn img_gen_params(p: &sd_img_gen_params_t) -> String {
    // SAFETY (every `s`): the caller's contract on the string pointers.
    let s = |ptr| unsafe { lossy_str(ptr) };
    let pm = &p.pm_params;
    let t = &p.vae_tiling_params;
    let h = &p.hires;
    let c = &p.cache;
    let mut out = String::new();
    let _ = writeln!(out, "prompt: {}", s(p.prompt));
    let _ = writeln!(out, "negative_prompt: {}", s(p.negative_prompt));
    let _ = writeln!(out, "clip_skip: {}", p.clip_skip);
    let _ = writeln!(out, "width: {}", p.width);
    let _ = writeln!(out, "height: {}", p.height);
    // SAFETY: the caller's contract.
    let _ = writeln!(out, "sample_params: {}", unsafe { sample_params(&p.sample_params) });
    let _ = writeln!(out, "strength: {}", f2(p.strength));
    let _ = writeln!(out, "seed: {}", p.seed);
    let _ = writeln!(out, "batch_count: {}", p.batch_count);
    let _ = writeln!(out, "qwen_image_layers: {}", p.qwen_image_layers);
    let _ = writeln!(out, "ref_images_count: {}", p.ref_images_count);
    let _ = writeln!(out, "ref_image_args: {}", s(p.ref_image_args));
    let _ = writeln!(out, "control_strength: {}", f2(p.control_strength));
    let _ = writeln!(
        out,
        "photo maker: {{style_strength = {}, id_images_count = {}, id_embed_path = {}}}",
        f2(pm.style_strength),
        pm.id_images_count,
        s(pm.id_embed_path)
    );
    let _ = writeln!(
        out,
        "VAE tiling: {} (temporal={}, extra_tiling_args={})",
        yes_no(t.enabled),
        yes_no(t.temporal_tiling),
        s(t.extra_tiling_args)
    );
    let _ = writeln!(out, "circular_x: {}", yes_no(p.circular_x));
    let _ = writeln!(out, "circular_y: {}", yes_no(p.circular_y));
    let _ = writeln!(
        out,
        "hires: {{enabled={}, upscaler={}, model_path={}, scale={}, target={}x{}, steps={}, denoising_strength={}}}",
        yes_no(h.enabled),
        h.upscaler.name(),
        s(h.model_path),
        f2(h.scale),
        h.target_width,
        h.target_height,
        h.steps,
        f2(h.denoising_strength)
    );
    let mode = c.mode.get().map_or("NONE", |m| m.name());
    let _ = writeln!(
        out,
        "cache: {} (threshold={}, start={}, end={})",
        mode,
        fixed(crate::api::cache_reuse_threshold(c.mode.get(), c.reuse_threshold), 3),
        f2(c.start_percent),
        f2(c.end_percent)
    );
    // Fields the reference leaves out.
    let _ = writeln!(out, "lora_count: {}", p.lora_count);
    let _ = writeln!(out, "init_image: {}", image_dims(&p.init_image));
    let _ = writeln!(out, "mask_image: {}", image_dims(&p.mask_image));
    let _ = writeln!(out, "control_image: {}", image_dims(&p.control_image));
    let _ = writeln!(
        out,
        "ip_adapter: {{image = {}, strength = {}}}",
        image_dims(&p.ip_adapter_image),
        f2(p.ip_adapter_strength)
    );
    let _ = writeln!(
        out,
        "pulid: {{id_embedding_path = {}, id_weight = {}}}",
        s(p.pulid_params.id_embedding_path),
        f2(p.pulid_params.id_weight)
    );
    let _ = writeln!(
        out,
        "VAE tile: {}x{} (target_overlap={}, rel_size={}x{})",
        t.tile_size_x,
        t.tile_size_y,
        f2(t.target_overlap),
        f2(t.rel_size_x),
        f2(t.rel_size_y)
    );
    let _ = writeln!(
        out,
        "hires extra: {{upscale_tile_size={}, custom_sigmas_count={}}}",
        h.upscale_tile_size, h.custom_sigmas_count
    );
    let _ = writeln!(
        out,
        "cache extra: {{error_decay_rate={}, use_relative_threshold={}, reset_error_on_compute={}, Fn_compute_blocks={}, \
         Bn_compute_blocks={}, residual_diff_threshold={}, max_warmup_steps={}, max_cached_steps={}, \
         max_continuous_cached_steps={}, taylorseer_n_derivatives={}, taylorseer_skip_interval={}, scm_mask={}, \
         scm_policy_dynamic={}, spectrum_w={}, spectrum_m={}, spectrum_lam={}, spectrum_window_size={}, \
         spectrum_flex_window={}, spectrum_warmup_steps={}, spectrum_stop_percent={}}}",
        f2(c.error_decay_rate),
        yes_no(c.use_relative_threshold),
        yes_no(c.reset_error_on_compute),
        c.Fn_compute_blocks,
        c.Bn_compute_blocks,
        f2(c.residual_diff_threshold),
        c.max_warmup_steps,
        c.max_cached_steps,
        c.max_continuous_cached_steps,
        c.taylorseer_n_derivatives,
        c.taylorseer_skip_interval,
        s(c.scm_mask),
        yes_no(c.scm_policy_dynamic),
        f2(c.spectrum_w),
        c.spectrum_m,
        f2(c.spectrum_lam),
        c.spectrum_window_size,
        f2(c.spectrum_flex_window),
        c.spectrum_warmup_steps,
        f2(c.spectrum_stop_percent)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printf_like_floats() {
        assert_eq!(fixed(7.0, 2), "7.00");
        assert_eq!(fixed(0.01, 2), "0.01");
        assert_eq!(fixed(f32::INFINITY, 2), "inf");
        assert_eq!(fixed(f32::NEG_INFINITY, 2), "-inf");
        assert_eq!(fixed(f32::NAN, 2), "nan");
        assert_eq!(fixed(0.125, 2), "0.12");
        assert_eq!(fixed(0.2, 3), "0.200");
    }
}
