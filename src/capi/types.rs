//! The C ABI: `#[repr(C)]` mirrors of every struct of `stable-diffusion.h`, newtypes for its
//! enums and bools, the opaque handles and the callback types.
//!
//! Enum-typed values arrive from C untrusted (a caller may pass 9999 or -1), so they are
//! `#[repr(transparent)]` newtypes over the raw integer, checked when converted to
//! `crate::types`. C `bool` is `CBool(u8)` for the same reason (ctypes may send 2..255).
//! The `*_decl` enums only exist so cbindgen writes the C enum definitions into the header.
//! cbindgen reads this file as written (no macro expansion): structs, enums and callbacks
//! stay literal here.
#![allow(non_camel_case_types, non_snake_case)]

use crate::types::{
    CacheMode, CancelMode, HiresUpscaler, LogLevel, LoraApplyMode, Prediction, Preview, RngType,
    SampleMethod, Scheduler, SdType, VaeFormat,
};
use libc::{c_char, c_int, c_void};

/// A C `bool`: any non-zero byte is true.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CBool(pub u8);

impl CBool {
    pub const TRUE: CBool = CBool(1);
    pub const FALSE: CBool = CBool(0);

    pub fn get(self) -> bool {
        self.0 != 0
    }
}

impl From<bool> for CBool {
    fn from(b: bool) -> Self {
        CBool(b as u8)
    }
}

/// Declares the raw-integer newtype of one C enum and ties it to its `crate::types` enum.
macro_rules! c_enum_newtype {
    ($(#[$meta:meta])* $name:ident($raw:ty) => $rust:ty) => {
        $(#[$meta])*
        #[repr(transparent)]
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub struct $name(pub $raw);

        impl $name {
            /// The `*_COUNT` sentinel (for enums without one in C: the first unused value).
            pub const COUNT: $name = $name(<$rust>::COUNT);

            /// The declared value this raw integer stands for, if any.
            pub fn get(self) -> Option<$rust> {
                <$rust>::from_raw(self.0)
            }

            /// The reference's name, or "NONE" for anything that is not a declared value.
            pub fn name(self) -> &'static str {
                self.get().map_or("NONE", |v| v.name())
            }

            /// `name` as a static C string.
            pub fn c_name(self) -> *const libc::c_char {
                self.get().map_or(c"NONE", |v| v.c_name()).as_ptr()
            }

            /// The sentinel passes through as `None`; other undeclared values are errors.
            pub fn get_or_auto(self, what: &str) -> crate::error::Result<Option<$rust>> {
                if self == Self::COUNT {
                    return Ok(None);
                }
                self.require(what).map(Some)
            }

            /// The declared value, or an error naming the parameter and the raw value.
            pub fn require(self, what: &str) -> crate::error::Result<$rust> {
                self.get().ok_or_else(|| {
                    crate::error::Error::new(format!("invalid {what}: {} is not a valid {}", self.0, stringify!($name)))
                })
            }
        }

        impl From<$rust> for $name {
            fn from(v: $rust) -> Self {
                $name(v.raw())
            }
        }
    };
}

c_enum_newtype!(rng_type_t(u32) => RngType);
c_enum_newtype!(sample_method_t(u32) => SampleMethod);
c_enum_newtype!(scheduler_t(u32) => Scheduler);
c_enum_newtype!(prediction_t(u32) => Prediction);
c_enum_newtype!(sd_type_t(u32) => SdType);
c_enum_newtype!(sd_log_level_t(u32) => LogLevel);
c_enum_newtype!(preview_t(u32) => Preview);
c_enum_newtype!(lora_apply_mode_t(u32) => LoraApplyMode);
c_enum_newtype!(sd_vae_format_t(i32) => VaeFormat);
c_enum_newtype!(sd_cache_mode_t(u32) => CacheMode);
c_enum_newtype!(sd_hires_upscaler_t(u32) => HiresUpscaler);
c_enum_newtype!(sd_cancel_mode_t(u32) => CancelMode);

// ---- Opaque handles. The pointers handed to C are only keys into `capi::handles`;
// ---- the library never dereferences a handle pointer it receives.

/// An image-generation context.
pub struct sd_ctx_t {
    _tag: u8,
}

/// An ESRGAN upscaler context.
pub struct upscaler_ctx_t {
    _tag: u8,
}

/// An ADetailer (detect-and-inpaint) context.
pub struct adetailer_ctx_t {
    _tag: u8,
}

impl sd_ctx_t {
    pub(crate) fn new_tag() -> Self {
        sd_ctx_t { _tag: 0 }
    }
}

impl upscaler_ctx_t {
    pub(crate) fn new_tag() -> Self {
        upscaler_ctx_t { _tag: 0 }
    }
}

impl adetailer_ctx_t {
    pub(crate) fn new_tag() -> Self {
        adetailer_ctx_t { _tag: 0 }
    }
}

/// ggml's tensor, only ever seen through a pointer.
#[repr(C)]
pub struct ggml_tensor {
    _opaque: [u8; 0],
}

// ---- Callbacks.

pub type sd_log_cb_t = Option<unsafe extern "C" fn(level: sd_log_level_t, text: *const c_char, data: *mut c_void)>;
pub type sd_progress_cb_t = Option<unsafe extern "C" fn(step: c_int, steps: c_int, time: f32, data: *mut c_void)>;
pub type sd_preview_cb_t = Option<
    unsafe extern "C" fn(step: c_int, frame_count: c_int, frames: *mut sd_image_t, is_noisy: CBool, data: *mut c_void),
>;
pub type sd_graph_eval_callback_t =
    Option<unsafe extern "C" fn(t: *mut ggml_tensor, ask: CBool, user_data: *mut c_void) -> CBool>;

// ---- Structs (field order, types and names exactly as in the reference header).

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_tiling_params_t {
    pub enabled: CBool,
    pub temporal_tiling: CBool,
    pub tile_size_x: c_int,
    pub tile_size_y: c_int,
    pub target_overlap: f32,
    pub rel_size_x: f32,
    pub rel_size_y: f32,
    pub extra_tiling_args: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_embedding_t {
    pub name: *const c_char,
    pub path: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_ctx_params_t {
    pub model_path: *const c_char,
    pub clip_l_path: *const c_char,
    pub clip_g_path: *const c_char,
    pub clip_vision_path: *const c_char,
    pub t5xxl_path: *const c_char,
    pub llm_path: *const c_char,
    pub llm_vision_path: *const c_char,
    pub diffusion_model_path: *const c_char,
    pub high_noise_diffusion_model_path: *const c_char,
    pub uncond_diffusion_model_path: *const c_char,
    pub embeddings_connectors_path: *const c_char,
    pub vae_path: *const c_char,
    pub audio_vae_path: *const c_char,
    pub taesd_path: *const c_char,
    pub control_net_path: *const c_char,
    pub ip_adapter_path: *const c_char,
    pub motion_module_path: *const c_char,
    pub embeddings: *const sd_embedding_t,
    pub embedding_count: u32,
    pub photo_maker_path: *const c_char,
    pub pulid_weights_path: *const c_char,
    pub tensor_type_rules: *const c_char,
    pub n_threads: c_int,
    pub wtype: sd_type_t,
    pub rng_type: rng_type_t,
    pub sampler_rng_type: rng_type_t,
    pub prediction: prediction_t,
    pub lora_apply_mode: lora_apply_mode_t,
    pub enable_mmap: CBool,
    pub flash_attn: CBool,
    pub diffusion_flash_attn: CBool,
    pub tae_preview_only: CBool,
    pub diffusion_conv_direct: CBool,
    pub vae_conv_direct: CBool,
    pub force_sdxl_vae_conv_scale: CBool,
    pub vae_format: sd_vae_format_t,
    pub max_vram: *const c_char,
    pub stream_layers: CBool,
    pub eager_load: CBool,
    pub backend: *const c_char,
    pub params_backend: *const c_char,
    pub split_mode: *const c_char,
    pub auto_fit: CBool,
    pub rpc_servers: *const c_char,
    pub model_args: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_audio_t {
    pub sample_rate: u32,
    pub channels: u32,
    pub sample_count: u64,
    pub data: *mut f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_image_t {
    pub width: u32,
    pub height: u32,
    pub channel: u32,
    pub data: *mut u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_ref_video_t {
    pub frames: *mut sd_image_t,
    pub frame_count: c_int,
    pub fps: c_int,
    pub audio: sd_audio_t,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_slg_params_t {
    pub layers: *mut c_int,
    pub layer_count: usize,
    pub layer_start: f32,
    pub layer_end: f32,
    pub scale: f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_guidance_params_t {
    pub txt_cfg: f32,
    pub img_cfg: f32,
    pub distilled_guidance: f32,
    pub slg: sd_slg_params_t,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_sample_params_t {
    pub guidance: sd_guidance_params_t,
    pub scheduler: scheduler_t,
    pub sample_method: sample_method_t,
    pub sample_steps: c_int,
    pub eta: f32,
    pub shifted_timestep: c_int,
    pub custom_sigmas: *mut f32,
    pub custom_sigmas_count: c_int,
    pub flow_shift: f32,
    pub extra_sample_args: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_pm_params_t {
    pub id_images: *mut sd_image_t,
    pub id_images_count: c_int,
    pub id_embed_path: *const c_char,
    pub style_strength: f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_pulid_params_t {
    pub id_embedding_path: *const c_char,
    pub id_weight: f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_cache_params_t {
    pub mode: sd_cache_mode_t,
    pub reuse_threshold: f32,
    pub start_percent: f32,
    pub end_percent: f32,
    pub error_decay_rate: f32,
    pub use_relative_threshold: CBool,
    pub reset_error_on_compute: CBool,
    pub Fn_compute_blocks: c_int,
    pub Bn_compute_blocks: c_int,
    pub residual_diff_threshold: f32,
    pub max_warmup_steps: c_int,
    pub max_cached_steps: c_int,
    pub max_continuous_cached_steps: c_int,
    pub taylorseer_n_derivatives: c_int,
    pub taylorseer_skip_interval: c_int,
    pub scm_mask: *const c_char,
    pub scm_policy_dynamic: CBool,
    pub spectrum_w: f32,
    pub spectrum_m: c_int,
    pub spectrum_lam: f32,
    pub spectrum_window_size: c_int,
    pub spectrum_flex_window: f32,
    pub spectrum_warmup_steps: c_int,
    pub spectrum_stop_percent: f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_lora_t {
    pub is_high_noise: CBool,
    pub multiplier: f32,
    pub path: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_hires_params_t {
    pub enabled: CBool,
    pub upscaler: sd_hires_upscaler_t,
    pub model_path: *const c_char,
    pub scale: f32,
    pub target_width: c_int,
    pub target_height: c_int,
    pub steps: c_int,
    pub denoising_strength: f32,
    pub upscale_tile_size: c_int,
    pub custom_sigmas: *mut f32,
    pub custom_sigmas_count: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_img_gen_params_t {
    pub loras: *const sd_lora_t,
    pub lora_count: u32,
    pub prompt: *const c_char,
    pub negative_prompt: *const c_char,
    pub clip_skip: c_int,
    pub init_image: sd_image_t,
    pub ref_images: *mut sd_image_t,
    pub ref_images_count: c_int,
    pub ref_image_args: *const c_char,
    pub mask_image: sd_image_t,
    pub width: c_int,
    pub height: c_int,
    pub sample_params: sd_sample_params_t,
    pub strength: f32,
    pub seed: i64,
    pub batch_count: c_int,
    pub control_image: sd_image_t,
    pub control_strength: f32,
    pub ip_adapter_image: sd_image_t,
    pub ip_adapter_strength: f32,
    pub pm_params: sd_pm_params_t,
    pub pulid_params: sd_pulid_params_t,
    pub vae_tiling_params: sd_tiling_params_t,
    pub cache: sd_cache_params_t,
    pub hires: sd_hires_params_t,
    pub qwen_image_layers: c_int,
    pub circular_x: CBool,
    pub circular_y: CBool,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_vid_gen_params_t {
    pub loras: *const sd_lora_t,
    pub lora_count: u32,
    pub prompt: *const c_char,
    pub negative_prompt: *const c_char,
    pub clip_skip: c_int,
    pub init_image: sd_image_t,
    pub end_image: sd_image_t,
    pub ref_images: *mut sd_image_t,
    pub ref_images_count: c_int,
    pub ref_videos: *mut sd_ref_video_t,
    pub ref_videos_count: c_int,
    pub ref_audios: *mut sd_audio_t,
    pub ref_audios_count: c_int,
    pub control_frames: *mut sd_image_t,
    pub control_frames_size: c_int,
    pub width: c_int,
    pub height: c_int,
    pub sample_params: sd_sample_params_t,
    pub high_noise_sample_params: sd_sample_params_t,
    pub moe_boundary: f32,
    pub strength: f32,
    pub seed: i64,
    pub video_frames: c_int,
    pub fps: c_int,
    pub vace_strength: f32,
    pub vae_tiling_params: sd_tiling_params_t,
    pub cache: sd_cache_params_t,
    pub hires: sd_hires_params_t,
    pub circular_x: CBool,
    pub circular_y: CBool,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct sd_adetailer_params_t {
    pub prompt: *const c_char,
    pub negative_prompt: *const c_char,
    pub extra_ad_args: *const c_char,
}

// ---- C enum definitions for the header only (see cbindgen.toml).

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum rng_type_t_decl {
    STD_DEFAULT_RNG = 0,
    CUDA_RNG = 1,
    CPU_RNG = 2,
    RNG_TYPE_COUNT = 3,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sample_method_t_decl {
    EULER_SAMPLE_METHOD = 0,
    EULER_A_SAMPLE_METHOD = 1,
    HEUN_SAMPLE_METHOD = 2,
    DPM2_SAMPLE_METHOD = 3,
    DPMPP2S_A_SAMPLE_METHOD = 4,
    DPMPP2M_SAMPLE_METHOD = 5,
    DPMPP2Mv2_SAMPLE_METHOD = 6,
    IPNDM_SAMPLE_METHOD = 7,
    IPNDM_V_SAMPLE_METHOD = 8,
    LCM_SAMPLE_METHOD = 9,
    DDIM_TRAILING_SAMPLE_METHOD = 10,
    TCD_SAMPLE_METHOD = 11,
    RES_MULTISTEP_SAMPLE_METHOD = 12,
    RES_2S_SAMPLE_METHOD = 13,
    ER_SDE_SAMPLE_METHOD = 14,
    EULER_CFG_PP_SAMPLE_METHOD = 15,
    EULER_A_CFG_PP_SAMPLE_METHOD = 16,
    EULER_GE_SAMPLE_METHOD = 17,
    DPMPP2M_SDE_SAMPLE_METHOD = 18,
    DPMPP2M_SDE_BT_SAMPLE_METHOD = 19,
    LMS_SAMPLE_METHOD = 20,
    SAMPLE_METHOD_COUNT = 21,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum scheduler_t_decl {
    DISCRETE_SCHEDULER = 0,
    KARRAS_SCHEDULER = 1,
    EXPONENTIAL_SCHEDULER = 2,
    AYS_SCHEDULER = 3,
    GITS_SCHEDULER = 4,
    SGM_UNIFORM_SCHEDULER = 5,
    SIMPLE_SCHEDULER = 6,
    SMOOTHSTEP_SCHEDULER = 7,
    KL_OPTIMAL_SCHEDULER = 8,
    LCM_SCHEDULER = 9,
    BONG_TANGENT_SCHEDULER = 10,
    LTX2_SCHEDULER = 11,
    LOGIT_NORMAL_SCHEDULER = 12,
    FLUX2_SCHEDULER = 13,
    FLUX_SCHEDULER = 14,
    BETA_SCHEDULER = 15,
    SCHEDULER_COUNT = 16,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum prediction_t_decl {
    EPS_PRED = 0,
    V_PRED = 1,
    EDM_V_PRED = 2,
    FLOW_PRED = 3,
    FLUX_FLOW_PRED = 4,
    SEFI_FLOW_PRED = 5,
    MINIT2I_FLOW_PRED = 6,
    PREDICTION_COUNT = 7,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sd_type_t_decl {
    SD_TYPE_F32 = 0,
    SD_TYPE_F16 = 1,
    SD_TYPE_Q4_0 = 2,
    SD_TYPE_Q4_1 = 3,
    SD_TYPE_Q5_0 = 6,
    SD_TYPE_Q5_1 = 7,
    SD_TYPE_Q8_0 = 8,
    SD_TYPE_Q8_1 = 9,
    SD_TYPE_Q2_K = 10,
    SD_TYPE_Q3_K = 11,
    SD_TYPE_Q4_K = 12,
    SD_TYPE_Q5_K = 13,
    SD_TYPE_Q6_K = 14,
    SD_TYPE_Q8_K = 15,
    SD_TYPE_IQ2_XXS = 16,
    SD_TYPE_IQ2_XS = 17,
    SD_TYPE_IQ3_XXS = 18,
    SD_TYPE_IQ1_S = 19,
    SD_TYPE_IQ4_NL = 20,
    SD_TYPE_IQ3_S = 21,
    SD_TYPE_IQ2_S = 22,
    SD_TYPE_IQ4_XS = 23,
    SD_TYPE_I8 = 24,
    SD_TYPE_I16 = 25,
    SD_TYPE_I32 = 26,
    SD_TYPE_I64 = 27,
    SD_TYPE_F64 = 28,
    SD_TYPE_IQ1_M = 29,
    SD_TYPE_BF16 = 30,
    SD_TYPE_TQ1_0 = 34,
    SD_TYPE_TQ2_0 = 35,
    SD_TYPE_MXFP4 = 39,
    SD_TYPE_NVFP4 = 40,
    SD_TYPE_Q1_0 = 41,
    SD_TYPE_COUNT = 42,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sd_log_level_t_decl {
    SD_LOG_DEBUG = 0,
    SD_LOG_INFO = 1,
    SD_LOG_WARN = 2,
    SD_LOG_ERROR = 3,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum preview_t_decl {
    PREVIEW_NONE = 0,
    PREVIEW_PROJ = 1,
    PREVIEW_TAE = 2,
    PREVIEW_VAE = 3,
    PREVIEW_COUNT = 4,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum lora_apply_mode_t_decl {
    LORA_APPLY_AUTO = 0,
    LORA_APPLY_IMMEDIATELY = 1,
    LORA_APPLY_AT_RUNTIME = 2,
    LORA_APPLY_MODE_COUNT = 3,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sd_vae_format_t_decl {
    SD_VAE_FORMAT_AUTO = -1,
    SD_VAE_FORMAT_FLUX = 0,
    SD_VAE_FORMAT_SD3 = 1,
    SD_VAE_FORMAT_FLUX2 = 2,
    SD_VAE_FORMAT_WAN = 3,
    SD_VAE_FORMAT_COUNT = 4,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sd_cache_mode_t_decl {
    SD_CACHE_DISABLED = 0,
    SD_CACHE_EASYCACHE = 1,
    SD_CACHE_UCACHE = 2,
    SD_CACHE_DBCACHE = 3,
    SD_CACHE_TAYLORSEER = 4,
    SD_CACHE_CACHE_DIT = 5,
    SD_CACHE_SPECTRUM = 6,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sd_hires_upscaler_t_decl {
    SD_HIRES_UPSCALER_NONE = 0,
    SD_HIRES_UPSCALER_LATENT = 1,
    SD_HIRES_UPSCALER_LATENT_NEAREST = 2,
    SD_HIRES_UPSCALER_LATENT_NEAREST_EXACT = 3,
    SD_HIRES_UPSCALER_LATENT_ANTIALIASED = 4,
    SD_HIRES_UPSCALER_LATENT_BICUBIC = 5,
    SD_HIRES_UPSCALER_LATENT_BICUBIC_ANTIALIASED = 6,
    SD_HIRES_UPSCALER_LANCZOS = 7,
    SD_HIRES_UPSCALER_NEAREST = 8,
    SD_HIRES_UPSCALER_MODEL = 9,
    SD_HIRES_UPSCALER_COUNT = 10,
}

#[repr(C)]
#[allow(non_camel_case_types, dead_code)]
pub enum sd_cancel_mode_t_decl {
    SD_CANCEL_ALL = 0,
    SD_CANCEL_NEW_LATENTS = 1,
    SD_CANCEL_RESET = 2,
}

