//! Safe equivalents of the C parameter structs.
//!
//! `Default` is exactly what the reference's `*_init` functions write. Strings, arrays and
//! images are owned; enums are `crate::types` enums, with `None` where the C value is the
//! `*_COUNT` sentinel meaning "choose for the model". Floats keep the reference's convention
//! of `f32::INFINITY` for "automatic" (e.g. `img_cfg`, `eta`, `flow_shift`).

use crate::image::Image;
use crate::types::{CacheMode, HiresUpscaler, LoraApplyMode, Prediction, RngType, SampleMethod, Scheduler, SdType, VaeFormat};

/// A textual-inversion embedding file and the token it is bound to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embedding {
    pub name: String,
    pub path: String,
}

/// Everything `new_sd_ctx` needs: model files, precision, devices and run-time options.
#[derive(Debug, Clone, PartialEq)]
pub struct CtxParams {
    pub model_path: Option<String>,
    pub clip_l_path: Option<String>,
    pub clip_g_path: Option<String>,
    pub clip_vision_path: Option<String>,
    pub t5xxl_path: Option<String>,
    pub llm_path: Option<String>,
    pub llm_vision_path: Option<String>,
    pub diffusion_model_path: Option<String>,
    pub high_noise_diffusion_model_path: Option<String>,
    pub uncond_diffusion_model_path: Option<String>,
    pub embeddings_connectors_path: Option<String>,
    pub vae_path: Option<String>,
    pub audio_vae_path: Option<String>,
    pub taesd_path: Option<String>,
    pub control_net_path: Option<String>,
    pub ip_adapter_path: Option<String>,
    pub motion_module_path: Option<String>,
    pub embeddings: Vec<Embedding>,
    pub photo_maker_path: Option<String>,
    pub pulid_weights_path: Option<String>,
    pub tensor_type_rules: Option<String>,
    /// Worker threads; the default is the number of physical cores.
    pub n_threads: i32,
    /// Weight type to convert to on load; `None` keeps the file's types.
    pub wtype: Option<SdType>,
    pub rng_type: RngType,
    /// Sampler noise generator; `None` uses `rng_type`.
    pub sampler_rng_type: Option<RngType>,
    /// `None` detects the prediction type from the model.
    pub prediction: Option<Prediction>,
    pub lora_apply_mode: LoraApplyMode,
    pub enable_mmap: bool,
    pub flash_attn: bool,
    pub diffusion_flash_attn: bool,
    pub tae_preview_only: bool,
    pub diffusion_conv_direct: bool,
    pub vae_conv_direct: bool,
    pub force_sdxl_vae_conv_scale: bool,
    pub vae_format: VaeFormat,
    /// GiB budget or backend assignment spec for segmented parameter offload.
    pub max_vram: Option<String>,
    pub stream_layers: bool,
    pub eager_load: bool,
    pub backend: Option<String>,
    pub params_backend: Option<String>,
    pub split_mode: Option<String>,
    pub auto_fit: bool,
    pub rpc_servers: Option<String>,
    pub model_args: Option<String>,
}

impl Default for CtxParams {
    fn default() -> Self {
        CtxParams {
            model_path: None,
            clip_l_path: None,
            clip_g_path: None,
            clip_vision_path: None,
            t5xxl_path: None,
            llm_path: None,
            llm_vision_path: None,
            diffusion_model_path: None,
            high_noise_diffusion_model_path: None,
            uncond_diffusion_model_path: None,
            embeddings_connectors_path: None,
            vae_path: None,
            audio_vae_path: None,
            taesd_path: None,
            control_net_path: None,
            ip_adapter_path: None,
            motion_module_path: None,
            embeddings: Vec::new(),
            photo_maker_path: None,
            pulid_weights_path: None,
            tensor_type_rules: None,
            n_threads: crate::graph::backend::physical_cores(),
            wtype: None,
            rng_type: RngType::Cuda,
            sampler_rng_type: None,
            prediction: None,
            lora_apply_mode: LoraApplyMode::Auto,
            enable_mmap: false,
            flash_attn: false,
            diffusion_flash_attn: false,
            tae_preview_only: false,
            diffusion_conv_direct: false,
            vae_conv_direct: false,
            force_sdxl_vae_conv_scale: false,
            vae_format: VaeFormat::Auto,
            max_vram: None,
            stream_layers: false,
            eager_load: false,
            backend: None,
            params_backend: None,
            split_mode: None,
            auto_fit: false,
            rpc_servers: None,
            model_args: None,
        }
    }
}

/// Skip-layer guidance.
#[derive(Debug, Clone, PartialEq)]
pub struct SlgParams {
    pub layers: Vec<i32>,
    pub layer_start: f32,
    pub layer_end: f32,
    pub scale: f32,
}

impl Default for SlgParams {
    fn default() -> Self {
        SlgParams { layers: Vec::new(), layer_start: 0.01, layer_end: 0.2, scale: 0.0 }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GuidanceParams {
    pub txt_cfg: f32,
    /// Image guidance; non-finite means "same as `txt_cfg`".
    pub img_cfg: f32,
    pub distilled_guidance: f32,
    pub slg: SlgParams,
}

impl Default for GuidanceParams {
    fn default() -> Self {
        GuidanceParams { txt_cfg: 7.0, img_cfg: f32::INFINITY, distilled_guidance: 3.5, slg: SlgParams::default() }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SampleParams {
    pub guidance: GuidanceParams,
    /// `None`: the model's default scheduler.
    pub scheduler: Option<Scheduler>,
    /// `None`: the model's default sampler.
    pub sample_method: Option<SampleMethod>,
    pub sample_steps: i32,
    /// Non-finite: the sampler's default eta.
    pub eta: f32,
    pub shifted_timestep: i32,
    /// Replaces the scheduler when not empty.
    pub custom_sigmas: Vec<f32>,
    /// Non-finite: the model's default shift.
    pub flow_shift: f32,
    pub extra_sample_args: Option<String>,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            guidance: GuidanceParams::default(),
            scheduler: None,
            sample_method: None,
            sample_steps: 20,
            eta: f32::INFINITY,
            shifted_timestep: 0,
            custom_sigmas: Vec::new(),
            flow_shift: f32::INFINITY,
            extra_sample_args: None,
        }
    }
}

/// PhotoMaker identity conditioning.
#[derive(Debug, Clone, PartialEq)]
pub struct PmParams {
    pub id_images: Vec<Image>,
    pub id_embed_path: Option<String>,
    pub style_strength: f32,
}

impl Default for PmParams {
    fn default() -> Self {
        PmParams { id_images: Vec::new(), id_embed_path: None, style_strength: 20.0 }
    }
}

/// PuLID identity conditioning.
#[derive(Debug, Clone, PartialEq)]
pub struct PulidParams {
    pub id_embedding_path: Option<String>,
    pub id_weight: f32,
}

impl Default for PulidParams {
    fn default() -> Self {
        PulidParams { id_embedding_path: None, id_weight: 1.0 }
    }
}

/// VAE tiling.
#[derive(Debug, Clone, PartialEq)]
pub struct TilingParams {
    pub enabled: bool,
    pub temporal_tiling: bool,
    pub tile_size_x: i32,
    pub tile_size_y: i32,
    pub target_overlap: f32,
    pub rel_size_x: f32,
    pub rel_size_y: f32,
    pub extra_tiling_args: Option<String>,
}

impl Default for TilingParams {
    fn default() -> Self {
        TilingParams {
            enabled: false,
            temporal_tiling: false,
            tile_size_x: 0,
            tile_size_y: 0,
            target_overlap: 0.5,
            rel_size_x: 0.0,
            rel_size_y: 0.0,
            extra_tiling_args: None,
        }
    }
}

/// Step caching (EasyCache, UCache, DBCache, TaylorSeer, cache-dit, Spectrum).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheParams {
    pub mode: CacheMode,
    /// Non-finite: the mode's default threshold.
    pub reuse_threshold: f32,
    pub start_percent: f32,
    pub end_percent: f32,
    pub error_decay_rate: f32,
    pub use_relative_threshold: bool,
    pub reset_error_on_compute: bool,
    pub fn_compute_blocks: i32,
    pub bn_compute_blocks: i32,
    pub residual_diff_threshold: f32,
    pub max_warmup_steps: i32,
    pub max_cached_steps: i32,
    pub max_continuous_cached_steps: i32,
    pub taylorseer_n_derivatives: i32,
    pub taylorseer_skip_interval: i32,
    pub scm_mask: Option<String>,
    pub scm_policy_dynamic: bool,
    pub spectrum_w: f32,
    pub spectrum_m: i32,
    pub spectrum_lam: f32,
    pub spectrum_window_size: i32,
    pub spectrum_flex_window: f32,
    pub spectrum_warmup_steps: i32,
    pub spectrum_stop_percent: f32,
}

impl Default for CacheParams {
    fn default() -> Self {
        CacheParams {
            mode: CacheMode::Disabled,
            reuse_threshold: f32::INFINITY,
            start_percent: 0.15,
            end_percent: 0.95,
            error_decay_rate: 1.0,
            use_relative_threshold: true,
            reset_error_on_compute: true,
            fn_compute_blocks: 8,
            bn_compute_blocks: 0,
            residual_diff_threshold: 0.08,
            max_warmup_steps: 8,
            max_cached_steps: -1,
            max_continuous_cached_steps: -1,
            taylorseer_n_derivatives: 1,
            taylorseer_skip_interval: 1,
            scm_mask: None,
            scm_policy_dynamic: true,
            spectrum_w: 0.40,
            spectrum_m: 3,
            spectrum_lam: 1.0,
            spectrum_window_size: 2,
            spectrum_flex_window: 0.50,
            spectrum_warmup_steps: 4,
            spectrum_stop_percent: 0.9,
        }
    }
}

impl CacheParams {
    /// The reuse threshold in effect.
    pub fn effective_reuse_threshold(&self) -> f32 {
        cache_reuse_threshold(Some(self.mode), self.reuse_threshold)
    }
}

/// The reuse threshold a cache mode uses: the mode's default when unset (infinite), never
/// negative.
pub fn cache_reuse_threshold(mode: Option<CacheMode>, reuse_threshold: f32) -> f32 {
    let t = match (reuse_threshold == f32::INFINITY, mode) {
        (true, Some(CacheMode::EasyCache)) => 0.2,
        (true, Some(CacheMode::UCache)) => 1.0,
        _ => reuse_threshold,
    };
    t.max(0.0)
}

/// The hires fix: upscale, then a second denoising pass.
#[derive(Debug, Clone, PartialEq)]
pub struct HiresParams {
    pub enabled: bool,
    pub upscaler: HiresUpscaler,
    pub model_path: Option<String>,
    pub scale: f32,
    pub target_width: i32,
    pub target_height: i32,
    pub steps: i32,
    pub denoising_strength: f32,
    pub upscale_tile_size: i32,
    pub custom_sigmas: Vec<f32>,
}

impl Default for HiresParams {
    fn default() -> Self {
        HiresParams {
            enabled: false,
            upscaler: HiresUpscaler::Latent,
            model_path: None,
            scale: 2.0,
            target_width: 0,
            target_height: 0,
            steps: 0,
            denoising_strength: 0.7,
            upscale_tile_size: 128,
            custom_sigmas: Vec::new(),
        }
    }
}

/// A LoRA to apply for one generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lora {
    pub is_high_noise: bool,
    pub multiplier: f32,
    pub path: String,
}

/// Interleaved audio samples.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Audio {
    pub sample_rate: u32,
    pub channels: u32,
    /// `sample_count × channels` values, channel-interleaved.
    pub data: Vec<f32>,
}

impl Audio {
    /// Samples per channel.
    pub fn sample_count(&self) -> u64 {
        if self.channels == 0 {
            0
        } else {
            (self.data.len() / self.channels as usize) as u64
        }
    }
}

/// A reference video (frames, frame rate, optional sound track).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RefVideo {
    pub frames: Vec<Image>,
    pub fps: i32,
    pub audio: Option<Audio>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ImgGenParams {
    pub loras: Vec<Lora>,
    pub prompt: String,
    pub negative_prompt: String,
    /// -1: the model's default.
    pub clip_skip: i32,
    pub init_image: Option<Image>,
    pub ref_images: Vec<Image>,
    pub ref_image_args: String,
    pub mask_image: Option<Image>,
    pub width: i32,
    pub height: i32,
    pub sample_params: SampleParams,
    pub strength: f32,
    /// Negative: a random seed.
    pub seed: i64,
    pub batch_count: i32,
    pub control_image: Option<Image>,
    pub control_strength: f32,
    pub ip_adapter_image: Option<Image>,
    pub ip_adapter_strength: f32,
    pub pm_params: PmParams,
    pub pulid_params: PulidParams,
    pub vae_tiling_params: TilingParams,
    pub cache: CacheParams,
    pub hires: HiresParams,
    pub qwen_image_layers: i32,
    pub circular_x: bool,
    pub circular_y: bool,
}

impl Default for ImgGenParams {
    fn default() -> Self {
        ImgGenParams {
            loras: Vec::new(),
            prompt: String::new(),
            negative_prompt: String::new(),
            clip_skip: -1,
            init_image: None,
            ref_images: Vec::new(),
            ref_image_args: String::new(),
            mask_image: None,
            width: 512,
            height: 512,
            sample_params: SampleParams::default(),
            strength: 0.75,
            seed: -1,
            batch_count: 1,
            control_image: None,
            control_strength: 0.9,
            ip_adapter_image: None,
            ip_adapter_strength: 1.0,
            pm_params: PmParams::default(),
            pulid_params: PulidParams::default(),
            vae_tiling_params: TilingParams::default(),
            cache: CacheParams::default(),
            hires: HiresParams::default(),
            qwen_image_layers: 3,
            circular_x: false,
            circular_y: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct VidGenParams {
    pub loras: Vec<Lora>,
    pub prompt: String,
    pub negative_prompt: String,
    pub clip_skip: i32,
    pub init_image: Option<Image>,
    pub end_image: Option<Image>,
    pub ref_images: Vec<Image>,
    pub ref_videos: Vec<RefVideo>,
    pub ref_audios: Vec<Audio>,
    pub control_frames: Vec<Image>,
    pub width: i32,
    pub height: i32,
    pub sample_params: SampleParams,
    pub high_noise_sample_params: SampleParams,
    pub moe_boundary: f32,
    pub strength: f32,
    pub seed: i64,
    pub video_frames: i32,
    pub fps: i32,
    pub vace_strength: f32,
    pub vae_tiling_params: TilingParams,
    pub cache: CacheParams,
    pub hires: HiresParams,
    pub circular_x: bool,
    pub circular_y: bool,
}

impl Default for VidGenParams {
    fn default() -> Self {
        VidGenParams {
            loras: Vec::new(),
            prompt: String::new(),
            negative_prompt: String::new(),
            clip_skip: 0,
            init_image: None,
            end_image: None,
            ref_images: Vec::new(),
            ref_videos: Vec::new(),
            ref_audios: Vec::new(),
            control_frames: Vec::new(),
            width: 512,
            height: 512,
            sample_params: SampleParams::default(),
            high_noise_sample_params: SampleParams { sample_steps: -1, ..SampleParams::default() },
            moe_boundary: 0.875,
            strength: 0.75,
            seed: -1,
            video_frames: 6,
            fps: 16,
            vace_strength: 1.0,
            vae_tiling_params: TilingParams::default(),
            cache: CacheParams::default(),
            hires: HiresParams::default(),
            circular_x: false,
            circular_y: false,
        }
    }
}

/// Per-call ADetailer options (prompts override the inpainting prompts when set).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdetailerParams {
    pub prompt: Option<String>,
    pub negative_prompt: Option<String>,
    pub extra_ad_args: Option<String>,
}

/// What `new_upscaler_ctx` needs.
#[derive(Debug, Clone, PartialEq)]
pub struct UpscalerParams {
    pub esrgan_path: String,
    pub direct: bool,
    pub n_threads: i32,
    pub tile_size: i32,
    pub backend: Option<String>,
    pub params_backend: Option<String>,
}

/// What `new_adetailer_ctx` needs.
#[derive(Debug, Clone, PartialEq)]
pub struct AdetailerCtxParams {
    pub detector_path: String,
    pub n_threads: i32,
    pub backend: Option<String>,
    pub params_backend: Option<String>,
}

/// A model conversion (`convert` / `convert_with_components`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConvertParams {
    pub model_path: Option<String>,
    pub clip_l_path: Option<String>,
    pub clip_g_path: Option<String>,
    pub t5xxl_path: Option<String>,
    pub diffusion_model_path: Option<String>,
    pub vae_path: Option<String>,
    pub output_path: String,
    /// `None` keeps each tensor's type.
    pub output_type: Option<SdType>,
    pub tensor_type_rules: Option<String>,
    pub convert_name: bool,
    /// Threads; 0 or less means the number of physical cores.
    pub n_threads: i32,
}
