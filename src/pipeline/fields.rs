//! What every field of `sd_ctx_params_t`, `sd_img_gen_params_t` and `sd_vid_gen_params_t`
//! (and of the structs inside them) does here, and the `extra_sample_args` / `model_args`
//! keys: each acts, or draws a warning naming it when set, so nothing a caller passes is
//! dropped silently. `tests/field_rule.rs` walks the ABI manifest against [`FIELDS`].

use super::families::{Arch, ModelSet, VideoCond};
use crate::params::{CtxParams, HiresParams, ImgGenParams, SampleParams, VidGenParams};

/// What a field does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Read and applied (where the reference applies it; fields of a struct-valued field
    /// have their own rows).
    Acts,
    /// No effect of its own: an array's length or a field inside a warned field, whose
    /// row decides.
    Covered,
    /// Ignored; set to a non-default value, it draws "<why>; ignoring <field>" once per call.
    Warns(&'static str),
    /// Acts only with a high-noise expert loaded; warns like `Warns` otherwise.
    NeedsHighNoise(&'static str),
    /// Acts only on Wan VACE models; warns like `Warns` otherwise.
    NeedsVace(&'static str),
    /// Acts only with AnimateDiff motion modules loaded; warns like `Warns` otherwise.
    NeedsMotionModules(&'static str),
    /// Acts only with an IP-Adapter loaded; warns like `Warns` otherwise.
    NeedsIpAdapter(&'static str),
    /// Acts only with PuLID's modules loaded (a Flux model); warns like `Warns` otherwise.
    NeedsPulid(&'static str),
    /// Acts only with PhotoMaker loaded (`photo_maker_path`); warns like `Warns` otherwise.
    NeedsPhotoMaker(&'static str),
    /// Acts only on LTX-2.3 models; warns like `Warns` otherwise.
    NeedsLtx(&'static str),
    /// Acts only on LTX-2.3 models or with motion modules loaded; warns like `Warns` otherwise.
    NeedsLtxOrMotionModules(&'static str),
    /// Warned about where the context is built (`families::ModelSet::new`) when the loaded
    /// family has no use for it.
    AtLoad,
}

use Use::*;

const LTX: Use = NeedsLtx("only LTX-2.3 video models read it");
/// Read by the LTX VAE's temporal tiling alone.
const LTX_TEMPORAL: Use = NeedsLtx("only the LTX VAE's temporal tiling reads it");
/// Reference clips: MiniMax-H3's Ref2VA reads them (refused there, not built here); every
/// other family ignores them, as the reference does.
const REF_CLIPS: Use = Warns("only MiniMax-H3's Ref2VA reads it, which this build does not take");
const IP_ADAPTER: Use = NeedsIpAdapter("no IP-Adapter is loaded (ip_adapter_path, SD 1.x and SDXL models)");
/// Read by the reference's cache-dit but without effect on its step decision (its limits and
/// mask checks change nothing; its TaylorSeer terms are never used): no effect here either.
const DIT_CACHE_UNREAD: Use = Warns("cache-dit decides each step from the input change alone (as the reference does), this option has no effect");
const EXPERT: Use = NeedsHighNoise("no high noise diffusion model is loaded");
/// Read by AnimateDiff's picture job (its hires fix) and by LTX-2.3's latent-upscale refine pass.
const LTX_OR_ANIMATEDIFF: Use = NeedsLtxOrMotionModules("only AnimateDiff and LTX-2.3 read it");
/// How far LTX-2.3's start and end pictures are denoised; AnimateDiff's img2img strength.
const KEYFRAME_STRENGTH: Use = NeedsLtxOrMotionModules("only AnimateDiff and LTX-2.3's start and end pictures read it");

/// Every field of the three request structs and the structs they hold, by C struct.
pub const FIELDS: &[(&str, &[(&str, Use)])] = &[
    (
        "sd_ctx_params_t",
        &[
            ("model_path", Acts), ("clip_l_path", Acts), ("clip_g_path", Acts), ("clip_vision_path", AtLoad),
            ("t5xxl_path", Acts), ("llm_path", Acts), ("llm_vision_path", Acts), ("diffusion_model_path", Acts),
            ("high_noise_diffusion_model_path", AtLoad),
            ("uncond_diffusion_model_path", AtLoad),
            ("embeddings_connectors_path", LTX), ("vae_path", Acts), ("audio_vae_path", AtLoad), ("taesd_path", Acts),
            ("control_net_path", Acts), ("ip_adapter_path", AtLoad),
            ("motion_module_path", AtLoad),
            ("embeddings", Acts), ("embedding_count", Acts), ("photo_maker_path", Acts), ("pulid_weights_path", AtLoad),
            ("tensor_type_rules", Acts), ("n_threads", Acts), ("wtype", Acts), ("rng_type", Acts),
            ("sampler_rng_type", Acts), ("prediction", Acts), ("lora_apply_mode", Acts), ("enable_mmap", Acts),
            ("flash_attn", Acts), ("diffusion_flash_attn", Acts), ("tae_preview_only", Acts),
            ("diffusion_conv_direct", Acts), ("vae_conv_direct", Acts), ("force_sdxl_vae_conv_scale", Acts),
            ("vae_format", Acts), ("max_vram", Acts),
            ("stream_layers", Acts), ("eager_load", Acts), ("backend", Acts), ("params_backend", Acts),
            ("split_mode", Acts), ("auto_fit", Acts), ("rpc_servers", Acts), ("model_args", Acts),
        ],
    ),
    ("sd_embedding_t", &[("name", Acts), ("path", Acts)]),
    (
        "sd_img_gen_params_t",
        &[
            ("loras", Acts), ("lora_count", Acts), ("prompt", Acts), ("negative_prompt", Acts), ("clip_skip", Acts),
            ("init_image", Acts), ("ref_images", Acts), ("ref_images_count", Acts), ("ref_image_args", Acts),
            ("mask_image", Acts), ("width", Acts), ("height", Acts), ("sample_params", Acts), ("strength", Acts),
            ("seed", Acts), ("batch_count", Acts), ("control_image", Acts), ("control_strength", Acts),
            ("ip_adapter_image", IP_ADAPTER), ("ip_adapter_strength", IP_ADAPTER), ("pm_params", NeedsPhotoMaker("no PhotoMaker is loaded (photo_maker_path, SDXL models)")),
            ("pulid_params", NeedsPulid("no PuLID weights are in effect (pulid_weights_path with a Flux model)")), ("vae_tiling_params", Acts), ("cache", Acts), ("hires", Acts),
            ("qwen_image_layers", Acts), ("circular_x", Acts), ("circular_y", Acts),
        ],
    ),
    (
        "sd_vid_gen_params_t",
        &[
            ("loras", Acts), ("lora_count", Acts), ("prompt", Acts), ("negative_prompt", Acts), ("clip_skip", Acts),
            ("init_image", Acts), ("end_image", Acts), ("ref_images", Acts), ("ref_images_count", Acts),
            ("ref_videos", REF_CLIPS), ("ref_videos_count", Covered), ("ref_audios", REF_CLIPS), ("ref_audios_count", Covered),
            ("control_frames", Acts), ("control_frames_size", Acts), ("width", Acts), ("height", Acts),
            ("sample_params", Acts), ("high_noise_sample_params", EXPERT), ("moe_boundary", EXPERT),
            ("strength", KEYFRAME_STRENGTH), ("seed", Acts), ("video_frames", Acts), ("fps", LTX),
            ("vace_strength", NeedsVace("only Wan VACE models read it")), ("vae_tiling_params", Acts),
            ("cache", Acts), ("hires", LTX_OR_ANIMATEDIFF), ("circular_x", Acts), ("circular_y", Acts),
        ],
    ),
    ("sd_lora_t", &[("is_high_noise", Acts), ("multiplier", Acts), ("path", Acts)]),
    (
        "sd_sample_params_t",
        &[
            ("guidance", Acts), ("scheduler", Acts), ("sample_method", Acts), ("sample_steps", Acts), ("eta", Acts),
            ("shifted_timestep", Acts), ("custom_sigmas", Acts), ("custom_sigmas_count", Acts), ("flow_shift", Acts),
            ("extra_sample_args", Acts),
        ],
    ),
    ("sd_guidance_params_t", &[("txt_cfg", Acts), ("img_cfg", Acts), ("distilled_guidance", Acts), ("slg", Acts)]),
    ("sd_slg_params_t", &[("layers", Acts), ("layer_count", Acts), ("layer_start", Acts), ("layer_end", Acts), ("scale", Acts)]),
    ("sd_pm_params_t", &[("id_images", Covered), ("id_images_count", Covered), ("id_embed_path", Covered), ("style_strength", Covered)]),
    ("sd_pulid_params_t", &[("id_embedding_path", Covered), ("id_weight", Covered)]),
    (
        "sd_tiling_params_t",
        &[
            ("enabled", Acts), ("temporal_tiling", Acts), ("tile_size_x", Acts), ("tile_size_y", Acts),
            ("target_overlap", Acts), ("rel_size_x", Acts), ("rel_size_y", Acts), ("extra_tiling_args", LTX_TEMPORAL),
        ],
    ),
    (
        "sd_cache_params_t",
        &[
            ("mode", Acts), ("reuse_threshold", Acts), ("start_percent", Acts), ("end_percent", Acts),
            ("error_decay_rate", Acts), ("use_relative_threshold", Acts), ("reset_error_on_compute", Acts),
            ("Fn_compute_blocks", Acts), ("Bn_compute_blocks", Acts), ("residual_diff_threshold", Acts),
            ("max_warmup_steps", DIT_CACHE_UNREAD), ("max_cached_steps", DIT_CACHE_UNREAD),
            ("max_continuous_cached_steps", DIT_CACHE_UNREAD), ("taylorseer_n_derivatives", DIT_CACHE_UNREAD),
            ("taylorseer_skip_interval", DIT_CACHE_UNREAD), ("scm_mask", DIT_CACHE_UNREAD),
            ("scm_policy_dynamic", DIT_CACHE_UNREAD), ("spectrum_w", Acts), ("spectrum_m", Acts), ("spectrum_lam", Acts),
            ("spectrum_window_size", Acts), ("spectrum_flex_window", Acts), ("spectrum_warmup_steps", Acts),
            ("spectrum_stop_percent", Acts),
        ],
    ),
    (
        "sd_hires_params_t",
        &[
            ("enabled", Acts), ("upscaler", Acts), ("model_path", Acts), ("scale", Acts), ("target_width", Acts),
            ("target_height", Acts), ("steps", Acts), ("denoising_strength", Acts), ("upscale_tile_size", Acts),
            ("custom_sigmas", Acts), ("custom_sigmas_count", Acts),
        ],
    ),
    ("sd_ref_video_t", &[("frames", Covered), ("frame_count", Covered), ("fps", Covered), ("audio", Covered)]),
    ("sd_audio_t", &[("sample_rate", Covered), ("channels", Covered), ("sample_count", Covered), ("data", Covered)]),
];

/// The reference's `extra_sample_args` keys (schedulers, samplers, img2img, guidance).
pub const EXTRA_SAMPLE_ARGS: &[(&str, Use)] = &[
    ("alpha", Acts), ("beta", Acts), ("max_shift", Acts), ("base_shift", Acts), ("terminal", Acts), ("stretch", Acts),
    ("mu", Acts), ("std", Acts), ("logsnr_min", Acts), ("logsnr_max", Acts), ("resolution_aware", Acts),
    ("sefi_alpha", Acts), ("sefi_delta_t", Acts), ("noise_clip_std", Acts), ("noise_scale_start", Acts),
    ("noise_scale_end", Acts), ("lms_max_order", Acts), ("lms_shift", Acts), ("lms_divisions", Acts), ("gamma", Acts),
    ("slg_uncond", Acts), ("strength_as_noise_level", Acts), ("force_first_sigma", Acts),
    ("apg_eta", Acts), ("apg_momentum", Acts), ("apg_norm_threshold", Acts), ("apg_norm_threshold_smoothing", Acts),
    ("guidance_schedule", Acts),
];

/// The reference's `model_args` keys (read by the family they name), and ours: `fast`, the
/// opt-in fast path (`runtime::args::fast_path`).
pub const MODEL_ARGS: &[(&str, Use)] =
    &[("chroma_use_t5_mask", Acts), ("chroma_t5_mask_pad", Acts), ("chroma_use_dit_mask", Acts), ("qwen_image_zero_cond_t", Acts), ("fast", Acts)];

/// The row of `field` of C struct `strukt`.
pub fn rule(strukt: &str, field: &str) -> Option<Use> {
    FIELDS.iter().find(|(s, _)| *s == strukt)?.1.iter().find(|(f, _)| *f == field).map(|r| r.1)
}

/// What the warnings depend on besides the request.
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelFacts {
    pub high_noise: bool,
    pub vace: bool,
    /// AnimateDiff motion modules are loaded.
    pub motion_modules: bool,
    /// An IP-Adapter is loaded.
    pub ip_adapter: bool,
    /// PuLID's modules are loaded.
    pub pulid: bool,
    /// PhotoMaker is loaded.
    pub photomaker: bool,
    /// The model is LTX-2.3.
    pub ltx: bool,
}

impl ModelFacts {
    pub fn of(ms: &ModelSet) -> ModelFacts {
        ModelFacts {
            high_noise: ms.high_noise.is_some(),
            vace: matches!(ms.video_cond, VideoCond::Vace),
            motion_modules: ms.animates_frames(),
            ip_adapter: ms.has_extension(super::ip_adapter::NAME),
            pulid: ms.diffusion.takes_identity(),
            photomaker: ms.has_extension(super::photomaker::NAME),
            ltx: ms.spec.arch == Arch::Ltx,
        }
    }
}

/// The warning for `path` (the row of `field` in `strukt`) when it is set, if any.
fn warning(strukt: &str, field: &str, path: &str, set: bool, facts: ModelFacts) -> Option<String> {
    let why = match rule(strukt, field)? {
        Warns(why) => why,
        NeedsHighNoise(why) if !facts.high_noise => why,
        NeedsVace(why) if !facts.vace => why,
        NeedsMotionModules(why) if !facts.motion_modules => why,
        NeedsIpAdapter(why) if !facts.ip_adapter => why,
        NeedsLtx(why) if !facts.ltx => why,
        NeedsLtxOrMotionModules(why) if !facts.ltx && !facts.motion_modules => why,
        NeedsPulid(why) if !facts.pulid => why,
        NeedsPhotoMaker(why) if !facts.photomaker => why,
        _ => return None,
    };
    set.then(|| format!("{why}; ignoring {path}"))
}

fn given(s: &Option<String>) -> bool {
    s.as_deref().is_some_and(|s| !s.is_empty())
}

/// Warnings for the context's fields (the at-load ones are warned by the loader).
fn ctx_warnings(c: &CtxParams, facts: ModelFacts) -> Vec<String> {
    let d = CtxParams::default();
    let set = [
        ("uncond_diffusion_model_path", given(&c.uncond_diffusion_model_path)),
        ("embeddings_connectors_path", given(&c.embeddings_connectors_path)),
        ("ip_adapter_path", given(&c.ip_adapter_path)),
        ("photo_maker_path", given(&c.photo_maker_path)),
        ("vae_format", c.vae_format != d.vae_format),
    ];
    set.into_iter().filter_map(|(f, s)| warning("sd_ctx_params_t", f, f, s, facts)).collect()
}

/// Warnings for the fields of one `sd_sample_params_t` (the fields themselves act; the
/// `extra_sample_args` keys may not).
fn sample_warnings(sp: &SampleParams, path: &str) -> Vec<String> {
    let keys = arg_keys(sp.extra_sample_args.as_deref());
    key_warnings(EXTRA_SAMPLE_ARGS, keys.iter().map(String::as_str), &format!("{path}.extra_sample_args"))
}

fn key_warnings<'a>(table: &[(&str, Use)], keys: impl Iterator<Item = &'a str>, what: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for key in keys {
        let w = match table.iter().find(|(k, _)| *k == key) {
            Some((_, Warns(why))) => format!("{why}; ignoring {what} key {key}"),
            Some(_) => continue,
            // The reference skips keys nobody reads without a word; a misspelt key deserves one.
            None => format!("no option is named '{key}'; ignoring {what} key {key}"),
        };
        if !out.contains(&w) {
            out.push(w);
        }
    }
    out
}

fn cache_warnings(c: &crate::params::CacheParams, facts: ModelFacts) -> Vec<String> {
    let d = crate::params::CacheParams::default();
    let set = [
        ("Fn_compute_blocks", c.fn_compute_blocks != d.fn_compute_blocks),
        ("Bn_compute_blocks", c.bn_compute_blocks != d.bn_compute_blocks),
        ("residual_diff_threshold", c.residual_diff_threshold != d.residual_diff_threshold),
        ("max_warmup_steps", c.max_warmup_steps != d.max_warmup_steps),
        ("max_cached_steps", c.max_cached_steps != d.max_cached_steps),
        ("max_continuous_cached_steps", c.max_continuous_cached_steps != d.max_continuous_cached_steps),
        ("taylorseer_n_derivatives", c.taylorseer_n_derivatives != d.taylorseer_n_derivatives),
        ("taylorseer_skip_interval", c.taylorseer_skip_interval != d.taylorseer_skip_interval),
        ("scm_mask", given(&c.scm_mask)),
        ("scm_policy_dynamic", c.scm_policy_dynamic != d.scm_policy_dynamic),
    ];
    set.into_iter().filter_map(|(f, s)| warning("sd_cache_params_t", f, &format!("cache.{f}"), s, facts)).collect()
}

/// Every warning an image request draws, in field order (PhotoMaker's own come from the
/// extension, where the reference gives them).
pub fn image_warnings(ctx: &CtxParams, p: &ImgGenParams, facts: ModelFacts) -> Vec<String> {
    let d = ImgGenParams::default();
    let mut out = ctx_warnings(ctx, facts);
    out.extend(key_warnings(MODEL_ARGS, arg_keys(ctx.model_args.as_deref()).iter().map(String::as_str), "model_args"));
    out.extend(sample_warnings(&p.sample_params, "sample_params"));
    let set = [
        ("ip_adapter_image", p.ip_adapter_image.is_some()),
        ("ip_adapter_strength", p.ip_adapter_strength != d.ip_adapter_strength),
        ("pm_params", p.pm_params != d.pm_params),
        ("pulid_params", p.pulid_params != d.pulid_params),
    ];
    out.extend(set.into_iter().filter_map(|(f, s)| warning("sd_img_gen_params_t", f, f, s, facts)));
    if given(&p.vae_tiling_params.extra_tiling_args) {
        out.extend(warning("sd_tiling_params_t", "extra_tiling_args", "vae_tiling_params.extra_tiling_args", true, facts));
    }
    out.extend(cache_warnings(&p.cache, facts));
    out
}

/// Every warning a video request draws, in field order.
pub fn video_warnings(ctx: &CtxParams, p: &VidGenParams, facts: ModelFacts) -> Vec<String> {
    let d = VidGenParams::default();
    let mut out = ctx_warnings(ctx, facts);
    out.extend(key_warnings(MODEL_ARGS, arg_keys(ctx.model_args.as_deref()).iter().map(String::as_str), "model_args"));
    out.extend(sample_warnings(&p.sample_params, "sample_params"));
    if facts.high_noise {
        out.extend(sample_warnings(&p.high_noise_sample_params, "high_noise_sample_params"));
    }
    let set = [
        ("ref_videos", !p.ref_videos.is_empty()),
        ("ref_audios", !p.ref_audios.is_empty()),
        ("high_noise_sample_params", p.high_noise_sample_params != d.high_noise_sample_params),
        ("moe_boundary", p.moe_boundary != d.moe_boundary),
        ("strength", p.strength != d.strength),
        ("fps", p.fps != d.fps),
        ("vace_strength", p.vace_strength != d.vace_strength),
        ("hires", p.hires != HiresParams::default()),
    ];
    out.extend(set.into_iter().filter_map(|(f, s)| warning("sd_vid_gen_params_t", f, f, s, facts)));
    if given(&p.vae_tiling_params.extra_tiling_args) {
        out.extend(warning("sd_tiling_params_t", "extra_tiling_args", "vae_tiling_params.extra_tiling_args", true, facts));
    }
    out.extend(cache_warnings(&p.cache, facts));
    out
}

/// The keys of a `key=value` list (malformed entries are warned about where the list is
/// read for its values).
fn arg_keys(args: Option<&str>) -> Vec<String> {
    let Some(args) = args else { return Vec::new() };
    args.split([',', ';']).filter_map(|t| t.split_once('=')).map(|(k, _)| k.trim().to_string()).collect()
}

/// Logs the warnings of an image request (once per call).
pub fn warn_image(ms: &ModelSet, ctx: &CtxParams, p: &ImgGenParams) {
    for w in image_warnings(ctx, p, ModelFacts::of(ms)) {
        sd_warn!("{w}");
    }
}

/// Logs the warnings of a video request (once per call).
pub fn warn_video(ms: &ModelSet, ctx: &CtxParams, p: &VidGenParams) {
    for w in video_warnings(ctx, p, ModelFacts::of(ms)) {
        sd_warn!("{w}");
    }
}
