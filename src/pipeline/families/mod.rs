//! Model families as plug-ins. One table, keyed by the detected [`SdVersion`], says for each
//! version which parts to build, its latent format, preview projection, prediction rule and
//! what it supports; each family group has one builder file that assembles a [`ModelSet`]
//! from the files. The sampling pipeline talks to the set's three parts (conditioner,
//! diffusion model, first stage) through traits and reads family facts from the table, so
//! it never asks which version it runs. Adding a family: its networks under `models/`, a
//! conditioner under `conditioning/` when it needs a new one, an [`Arch`] variant with a
//! builder file here, and its rows in [`spec`].

mod anima;
mod boogu;
mod ernie;
mod first_stage;
mod flux;
mod flux2;
mod hidream_o1;
mod hunyuan_video;
mod ideogram4;
mod krea2;
mod lens;
mod lingbot;
mod mage_flow;
mod ltx;
mod minimax_h3;
mod minit2i;
mod mmdit;
mod pid;
mod qwen_image;
mod sefi;
mod unet;
mod wan;
mod zimage;

use super::conditioning::clip::ClipSet;
use super::conditioning::clip_vision::ClipVision;
use super::ip_adapter::IpAdapterModel;
use super::conditioning::Conditioner;
use super::control::{self, ControlNetModel};
use super::extensions::Extension;
use super::loader::Weights;
use super::lora::LoraSet;
use crate::error::Result;
use crate::graph::{Components, DeviceMap, DeviceOptions, Loaded, Module, Placement, Runner, Scope, WeightsMut};
use crate::io::SdVersion;
use crate::models::diffusion::flux::FluxVariant;
use crate::models::diffusion::sefi_image::SEMANTIC_CHANNELS as SEFI_SEMANTIC_CHANNELS;
use crate::models::diffusion::unet::UNetVersion;
use crate::models::diffusion::DiffusionModel;
use crate::models::vae::FirstStage;
use crate::runtime::tiling;
use crate::params::CtxParams;
use crate::runtime::defaults::ModelFamily;
use crate::runtime::cache::Backbone;
use crate::runtime::denoiser::Denoiser;
use super::sampling::TimestepRule;
use crate::runtime::preview::{self, Projection};
use crate::types::{Prediction, RngType};
use std::sync::Arc;

/// How diffusion latents look.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentFormat {
    pub channels: usize,
    /// Pixels per latent pixel (the autoencoder's downsampling).
    pub vae_scale: usize,
    /// The diffusion model's own downsampling of the latent (8 for the UNets).
    pub down_factor: usize,
    /// diffusion latent = (VAE latent - shift) · scale.
    pub scale_factor: f32,
    pub shift_factor: f32,
}

impl LatentFormat {
    /// Image sides are aligned up to a multiple of this.
    pub fn size_multiple(&self) -> usize {
        self.vae_scale * self.down_factor
    }
}

/// Which networks a family is built from (one builder per variant).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arch {
    /// The LDM UNet with CLIP text encoders and an AutoencoderKL (or TAESD).
    Unet { unet: UNetVersion, text: ClipSet },
    /// Flux.1 / Chroma: CLIP-L + T5 (Chroma: T5 only) and a 16-channel AutoencoderKL;
    /// Ovis-Image: a Qwen3 LLM instead; Chroma1-Radiance: T5 and no autoencoder (pixels).
    Flux { variant: FluxVariant },
    /// SD3 / SD3.5: CLIP-L + CLIP-G + T5 and a 16-channel AutoencoderKL.
    Mmdit,
    /// Flux.2 (dev: Mistral Small 3.2, klein: Qwen3), the Flux.2 transformer and the
    /// 32-channel AutoencoderKL with 2×2-patchified, normalised latents.
    Flux2,
    /// SeFi-Image: a Qwen3-VL LLM, the Flux.2 transformer with two timesteps and Flux.2's
    /// AutoencoderKL for the texture part of its latents.
    Sefi,
    /// Z-Image: a Qwen3 LLM and Flux.1's 16-channel AutoencoderKL.
    ZImage,
    /// Qwen-Image: the Qwen2.5-VL LLM and the Wan2.1 VAE (single frames).
    QwenImage,
    /// Krea2: twelve layers of a Qwen3-VL LLM, the Krea2 transformer and the Wan2.1 VAE.
    Krea2,
    /// Wan 2.x video: UMT5, one or two (high/low-noise) Wan transformers, the Wan VAE.
    Wan,
    /// HunyuanVideo 1.5: the Qwen2.5-VL LLM, the HunyuanVideo transformer and its VAE.
    HunyuanVideo,
    /// LingBot Video: a Qwen3-VL LLM (and its vision tower for the init image), the LingBot
    /// Video transformer (a mixture of experts) and the Wan2.1 VAE.
    LingbotVideo,
    /// ERNIE-Image: a Ministral 3B LLM, the ERNIE-Image transformer and Flux.2's VAE.
    ErnieImage,
    /// Lens: the GPT-OSS-20B LLM (mixture-of-experts), the Lens transformer and Flux.2's VAE.
    Lens,
    /// Anima: a Qwen3 LLM plus T5 token ids, the Anima DiT with its LLM adapter, the Wan2.1 VAE.
    Anima,
    /// Boogu Image: a Qwen3-VL LLM, the Boogu Image transformer and Flux.1's VAE.
    Boogu,
    /// HiDream-O1: a Qwen3-VL language model that denoises pixels itself (no text encoder
    /// apart from its tokenizer, no autoencoder).
    HidreamO1,
    /// MiniT2I: T5 and the MiniT2I transformer on pixels (no autoencoder).
    MiniT2i,
    /// PiD: Gemma 2 and the PiD transformer on pixels, an autoencoder that encodes its
    /// low-quality reference image only.
    Pid,
    /// Mage-Flow: a Qwen3-VL LLM, the Qwen-Image transformer at Mage-Flow's sizes and the
    /// Mage VAE.
    MageFlow,
    /// Ideogram 4: 13 layers of a Qwen3-VL LLM, the Ideogram 4 transformer (and its
    /// unconditional twin) and Flux.2's AutoencoderKL.
    Ideogram4,
    /// MiniMax-H3: layer 50 of a Qwen3-VL LLM, the joint audio-video transformer and its
    /// transformer-decoder video VAE.
    MinimaxH3,
    /// LTX-2.3: every state of Gemma 3 projected, the joint audio-video transformer and the
    /// LTX video VAE.
    Ltx,
}

/// Extra latent channels the diffusion model takes next to the noisy latent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Concat {
    None,
    /// Inpainting: the latent mask and the masked image's latent.
    Inpaint,
    /// Instruct-pix2pix: the reference image's latent.
    Edit,
    /// Flux Fill: the masked image's latent and the mask as 8×8-pixel patches.
    FluxFill,
    /// Flux Controls: the control image's latent.
    FluxControls,
    /// Flex.2: masked latent, latent mask, control latent.
    Flex2,
}

/// Which autoencoder family the first stage is (the reference picks it by version, not by
/// the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstStageKind {
    /// AutoencoderKL (with the family's latent format) or a tiny autoencoder.
    Kl,
    /// The Wan2.1 VAE: causal 3-D convolutions, 16 channels at 1/8 (Wan 2.1, Wan2.2 A14B,
    /// Qwen-Image on single frames).
    Wan21,
    /// The Wan2.2 VAE: 48 channels at 1/16 over 2×2-patchified pixels (Wan2.2 TI2V 5B).
    Wan22,
    /// The Mage VAE: 128 channels at 1/16 (Mage-Flow).
    Mage,
    /// MiniMax-H3's video VAE: 24 channels at 1/16, a transformer decoder over chunks of
    /// 5 latent frames.
    MinimaxH3,
    /// HunyuanVideo 1.5's VAE: 32 channels at 1/16, frames in groups of 4.
    Hunyuan,
    /// The LTX video VAE: 128 channels at 1/32, frames in groups of 8.
    Ltx,
}

/// How the prediction type is chosen when the context does not set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PredictionRule {
    Fixed(Prediction),
    /// SD 2.x: run the UNet once and look (the reference's v-parameterisation probe).
    ProbeV,
    /// SDXL: `edm_vpred.sigma_max` → EDM-v (CosXL), `v_pred` → v, else eps.
    SdxlMarkers,
}

/// Everything the pipeline needs to know about a model version.
#[derive(Debug)]
pub struct FamilySpec {
    /// Key of the sampler / scheduler defaults.
    pub defaults: ModelFamily,
    pub arch: Arch,
    pub latent: LatentFormat,
    /// Latent → RGB projection for `PREVIEW_PROJ` (none: the latent's channels are RGB).
    pub preview: Option<&'static Projection>,
    pub concat: Concat,
    pub prediction: PredictionRule,
    /// `shifted_timestep` is honoured (SDXL only, as in the reference).
    pub shifted_timestep: bool,
    /// An empty negative prompt becomes a zero context (SDXL, unless EDM-v).
    pub zero_empty_negative: bool,
    /// Its first stage is its own tiny autoencoder (SDXS).
    pub tae_first_stage: bool,
    /// The AutoencoderKL has `quant_conv` / `post_quant_conv` (not the SD3 / Flux one).
    pub vae_quant_convs: bool,
    /// Latent channels in front that the first stage neither makes nor decodes (SeFi's
    /// semantic channels): pictures cannot become the diffusion model's latents (init
    /// images, reference latents, the hires fix's pixel upscalers).
    pub unencoded_channels: usize,
    /// Reference images become extra tokens of the diffusion model (Flux Kontext, Flux.2,
    /// Qwen-Image, Z-Image).
    pub ref_latents: bool,
    /// With reference images, an unconditional pass without them gives 3-way guidance.
    pub ref_latent_img_cfg: bool,
    /// The `ref_image_args` preset used when the request names none.
    pub ref_image_preset: Option<&'static str>,
    /// Reference images resized before encoding get sides that are multiples of this (0:
    /// they are encoded at their own size, PiD).
    pub ref_image_multiple: usize,
    /// Skip-layer guidance applies (transformers).
    pub skip_layer_guidance: bool,
    /// Channels of the pictures the first stage takes and gives (4: RGBA).
    pub image_channels: usize,
    /// Pictures, a stack of layers or video: what the latent's third axis means.
    pub media: Media,
    pub first_stage: FirstStageKind,
    /// The starting noise is scaled by the sampler's eta (HiDream-O1).
    pub noise_times_eta: bool,
    /// Takes AnimateDiff motion modules (`motion_module_path`: SD 1.x, its inpaint and
    /// instruct-pix2pix UNets); `generate_video` then renders frames as one batch.
    pub motion_modules: bool,
    /// Tiled encodes use tiles this much larger than decodes: the reference decides it by
    /// model version, so Qwen-Image's Wan VAE takes the image factor and Wan's the video one.
    pub encode_tile_factor: f32,
}

/// How a loaded video model takes pictures (decided by its file, like the reference's
/// model descriptions; text alone for the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VideoCond {
    /// Text only (T2V): init and end images are ignored with a warning.
    Text,
    /// Wan2.2 TI2V: the first (and last) latent frame is the encoded picture, kept fixed.
    FixedFrames,
    /// Wan I2V / FLF2V: a video of the start (and end) picture over grey is encoded and
    /// concatenated with a 4-channel frame mask; `clip`: CLIP-vision tokens of the start
    /// picture (Wan2.1), `end_clip`: and of the end picture (FLF2V 14B).
    ConcatFrames { clip: bool, end_clip: bool },
    /// Wan VACE: the control video (and the init image as a reference frame) as context.
    Vace,
    /// HunyuanVideo: the start (and end) picture, each encoded alone, as the first (last)
    /// frame of an otherwise zero latent, with a one-channel frame mask, concatenated.
    ConcatKeyFrames,
    /// LingBot Video: the first latent frame is the encoded start picture, kept fixed, and the
    /// picture goes to the conditioner as a reference image (its LLM's vision tower, if any);
    /// no end picture.
    FirstFrame,
    /// LTX-2.3: the encoded start picture is latent frame 0 and the end picture's latent
    /// frames are appended behind the video as keyframes with their own positions (frame 0
    /// for a one-frame video); both are denoised from `1 - strength` (the denoise mask).
    Keyframes,
    /// MiniMax-H3: the start (and end) picture, each encoded alone and moved 0.1% towards
    /// noise, as extra tokens the transformer sees at the time of their frame and does not
    /// denoise.
    RefKeyframes,
}

/// What a family generates, and so how its latent is laid out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Media {
    /// One picture per latent `[W, H, C, 1]`.
    Image,
    /// A stack of layers `[W, H, layers + 1, C, 1]`, each decoded to its own picture
    /// (Qwen-Image-Layered; `qwen_image_layers`).
    Layered,
    /// A video `[W, H, T, C, 1]` (`generate_video`).
    Video(VideoFormat),
}

/// How a video family maps frames to latent frames and times its frames.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VideoFormat {
    /// Frames per latent frame after the first: latent frames = (frames - 1) / time_scale + 1,
    /// and requests are aligned down to a whole number of them.
    pub time_scale: usize,
    /// How each evaluation's timesteps are formed (per frame for Wan2.2 TI2V).
    pub timesteps: TimestepRule,
    /// How frames map to latent frames (and what else the latent carries).
    pub frame_rule: FrameRule,
}

/// How a video family counts latent frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameRule {
    /// `(frames - 1) / time_scale + 1`, requests aligned down to whole latent frames.
    Causal,
    /// MiniMax-H3: 2 latent frames for up to 5 frames, then 5 per 17; requests aligned up to
    /// 17k + 5 frames. The audio latent of the video (at 24 fps) is packed behind the video's
    /// channels.
    MinimaxH3,
    /// LTX-2.3: `(frames - 1) / 8 + 1` like [`FrameRule::Causal`]; the audio latent of the
    /// video at the request's fps is packed behind the video's channels.
    Ltx,
}

impl VideoFormat {
    /// Latent frames of a request for `frames` (at least one), as the first stage counts them.
    pub fn latent_frames(&self, frames: usize) -> usize {
        match self.frame_rule {
            FrameRule::Causal | FrameRule::Ltx => crate::models::vae::latent_frames(frames.max(1), self.time_scale),
            FrameRule::MinimaxH3 => crate::models::diffusion::minimax_h3::latent_frames(frames),
        }
    }

    /// The frame count a request for `frames` gets (the reference aligns down to 4k + 1).
    pub fn align_frames(&self, frames: usize) -> usize {
        match self.frame_rule {
            FrameRule::Causal | FrameRule::Ltx => (self.latent_frames(frames) - 1) * self.time_scale + 1,
            FrameRule::MinimaxH3 => crate::models::diffusion::minimax_h3::align_frames(frames),
        }
    }

    /// Video frames of `latent` latent frames: the aligned request that makes them.
    pub fn video_frames(&self, latent: usize) -> usize {
        match self.frame_rule {
            FrameRule::Causal | FrameRule::Ltx => (latent.max(1) - 1) * self.time_scale + 1,
            FrameRule::MinimaxH3 => latent.saturating_sub(2) / 5 * 17 + 5,
        }
    }

    /// Audio latent steps packed behind the video's channels for `frames` frames at `fps`
    /// (none but MiniMax-H3's, which is always at 24 fps, and LTX-2.3's).
    pub fn audio_latents(&self, frames: usize, fps: f32) -> usize {
        match self.frame_rule {
            FrameRule::Causal => 0,
            FrameRule::MinimaxH3 => crate::models::diffusion::minimax_h3::audio_latents(frames),
            FrameRule::Ltx => crate::models::diffusion::ltx::audio_steps(frames, fps),
        }
    }

    /// Latent frames per chunk of the family's VAE when its tiny video autoencoder's frames
    /// are trimmed by chunks like the VAE's (MiniMax-H3).
    pub fn tae_decode_chunk(&self) -> Option<usize> {
        match self.frame_rule {
            FrameRule::Causal | FrameRule::Ltx => None,
            FrameRule::MinimaxH3 => Some(crate::models::vae::minimax_h3::CHUNK_LATENTS),
        }
    }

    /// Values of one audio latent step.
    pub fn audio_step_values(&self) -> usize {
        match self.frame_rule {
            FrameRule::Causal => 0,
            FrameRule::MinimaxH3 => crate::models::diffusion::minimax_h3::AUDIO_CHANNELS * crate::models::diffusion::minimax_h3::AUDIO_ROWS,
            FrameRule::Ltx => crate::models::diffusion::ltx::AUDIO_CHANNELS * crate::models::diffusion::ltx::AUDIO_BINS,
        }
    }
}

impl FamilySpec {
    /// 3-way guidance (`img_cfg`) applies: models with concatenated image channels, and
    /// those that take reference latents when the request has reference images.
    pub fn supports_img_cfg(&self, has_ref_images: bool) -> bool {
        self.concat != Concat::None || (has_ref_images && self.ref_latent_img_cfg)
    }

    pub fn is_layered(&self) -> bool {
        self.media == Media::Layered
    }

    /// The video format of a video family (`generate_video` serves these only).
    pub fn video(&self) -> Option<&VideoFormat> {
        match &self.media {
            Media::Video(v) => Some(v),
            _ => None,
        }
    }

    /// Which step caches apply: UCache to UNets, EasyCache to transformers.
    pub fn backbone(&self) -> Backbone {
        match self.arch {
            Arch::Unet { .. } => Backbone::UNet,
            _ => Backbone::DiT,
        }
    }
}

const SD_LATENT: LatentFormat = LatentFormat { channels: 4, vae_scale: 8, down_factor: 8, scale_factor: 0.18215, shift_factor: 0.0 };
const SDXL_LATENT: LatentFormat = LatentFormat { scale_factor: 0.13025, ..SD_LATENT };

const fn unet_family(defaults: ModelFamily, unet: UNetVersion, concat: Concat) -> FamilySpec {
    let sdxl = matches!(defaults, ModelFamily::Sdxl);
    let sd2 = matches!(defaults, ModelFamily::Sd2);
    FamilySpec {
        defaults,
        arch: Arch::Unet { unet, text: if sdxl { ClipSet::LBigG } else if sd2 { ClipSet::H } else { ClipSet::L } },
        latent: if sdxl { SDXL_LATENT } else { SD_LATENT },
        preview: Some(if sdxl { &preview::SDXL } else { &preview::SD }),
        concat,
        prediction: if sdxl {
            PredictionRule::SdxlMarkers
        } else if sd2 {
            PredictionRule::ProbeV
        } else {
            PredictionRule::Fixed(Prediction::Eps)
        },
        shifted_timestep: sdxl,
        zero_empty_negative: sdxl,
        tae_first_stage: false,
        vae_quant_convs: true,
        unencoded_channels: 0,
        ref_latents: false,
        ref_latent_img_cfg: false,
        ref_image_preset: None,
        ref_image_multiple: 16,
        skip_layer_guidance: false,
        image_channels: 3,
        media: Media::Image,
        first_stage: FirstStageKind::Kl,
        noise_times_eta: false,
        motion_modules: false,
        encode_tile_factor: tiling::ENCODE_TILE_FACTOR,
    }
}

/// SD3's and Flux's 16-channel latents (no further downsampling in the transformer).
const fn dit16_latent(scale_factor: f32, shift_factor: f32) -> LatentFormat {
    LatentFormat { channels: 16, vae_scale: 8, down_factor: 1, scale_factor, shift_factor }
}

const fn dit_family(defaults: ModelFamily, arch: Arch, latent: LatentFormat, preview: &'static Projection, concat: Concat, prediction: Prediction) -> FamilySpec {
    FamilySpec {
        defaults,
        arch,
        latent,
        preview: Some(preview),
        concat,
        prediction: PredictionRule::Fixed(prediction),
        shifted_timestep: false,
        zero_empty_negative: false,
        tae_first_stage: false,
        vae_quant_convs: false,
        unencoded_channels: 0,
        ref_latents: false,
        ref_latent_img_cfg: false,
        ref_image_preset: None,
        ref_image_multiple: 16,
        skip_layer_guidance: true,
        image_channels: 3,
        media: Media::Image,
        first_stage: FirstStageKind::Kl,
        noise_times_eta: false,
        motion_modules: false,
        encode_tile_factor: tiling::ENCODE_TILE_FACTOR,
    }
}

const FLUX_LATENT: LatentFormat = dit16_latent(0.3611, 0.1159);

const fn flux_family(variant: FluxVariant, concat: Concat) -> FamilySpec {
    let plain = matches!(variant, FluxVariant::Flux);
    FamilySpec {
        ref_latents: true,
        ref_latent_img_cfg: plain,
        ref_image_preset: Some("flux_kontext"),
        ..dit_family(ModelFamily::Flux, Arch::Flux { variant }, FLUX_LATENT, &preview::FLUX, concat, Prediction::FluxFlow)
    }
}

/// Z-Image: reference images (the `z_image_omni` preset) as extra tokens, with 3-way
/// guidance; its LLM takes them as a template of their own (`conditioning::llm`).
const fn zimage_family() -> FamilySpec {
    FamilySpec {
        ref_latents: true,
        ref_latent_img_cfg: true,
        ref_image_preset: Some("z_image_omni"),
        ..dit_family(ModelFamily::OtherDit, Arch::ZImage, FLUX_LATENT, &preview::FLUX, Concat::None, Prediction::Flow)
    }
}

/// Boogu Image: Z-Image's latents, reference images and 3-way guidance with them.
const fn boogu_family() -> FamilySpec {
    FamilySpec { arch: Arch::Boogu, ..zimage_family() }
}

/// Flux.2's 128 channels: 32 VAE channels × 2×2 patches, at 1/16 of the image.
const FLUX2_LATENT: LatentFormat = LatentFormat { channels: 128, vae_scale: 16, down_factor: 1, scale_factor: 1.0, shift_factor: 0.0 };

/// ERNIE-Image: Flux.2's latents, no reference images.
const fn ernie_image_family() -> FamilySpec {
    FamilySpec { vae_quant_convs: true, ..dit_family(ModelFamily::OtherDit, Arch::ErnieImage, FLUX2_LATENT, &preview::FLUX2, Concat::None, Prediction::Flow) }
}

/// Lens: Flux.2's latents, Flux's flow (sigma as the timestep), no reference images.
const fn lens_family() -> FamilySpec {
    FamilySpec { arch: Arch::Lens, prediction: PredictionRule::Fixed(Prediction::FluxFlow), ..ernie_image_family() }
}

/// Ideogram 4: Flux.2's latents, no reference images.
const fn ideogram4_family() -> FamilySpec {
    FamilySpec { vae_quant_convs: true, ..dit_family(ModelFamily::Ideogram4, Arch::Ideogram4, FLUX2_LATENT, &preview::FLUX2, Concat::None, Prediction::Flow) }
}

const fn flux2_family() -> FamilySpec {
    FamilySpec {
        vae_quant_convs: true,
        ref_latents: true,
        ref_latent_img_cfg: true,
        ref_image_preset: Some("flux2"),
        ..dit_family(ModelFamily::Flux2, Arch::Flux2, FLUX2_LATENT, &preview::FLUX2, Concat::None, Prediction::FluxFlow)
    }
}

/// SeFi-Image's 144 channels: 16 semantic ones in front of Flux.2's 128 (the VAE's).
const SEFI_LATENT: LatentFormat = LatentFormat { channels: FLUX2_LATENT.channels + SEFI_SEMANTIC_CHANNELS as usize, ..FLUX2_LATENT };

/// SeFi-Image: no projection for previews (the reference knows none for 144 channels) and
/// no 3-way guidance with reference images.
const fn sefi_family() -> FamilySpec {
    FamilySpec {
        vae_quant_convs: true,
        unencoded_channels: SEFI_SEMANTIC_CHANNELS as usize,
        ref_latents: true,
        ref_image_preset: Some("flux2"),
        preview: None,
        ..dit_family(ModelFamily::OtherDit, Arch::Sefi, SEFI_LATENT, &preview::FLUX2, Concat::None, Prediction::SefiFlow)
    }
}

/// Chroma1-Radiance's "latent": the RGB image in [-1, 1] (no autoencoder, no alignment:
/// the transformer pads to its patches).
const PIXEL_LATENT: LatentFormat = LatentFormat { channels: 3, vae_scale: 1, down_factor: 1, scale_factor: 1.0, shift_factor: 0.0 };

/// LongCat-Image: not a Flux version to the reference's sampler defaults (euler, discrete
/// schedule); reference images as tokens after the image (the `longcat` preset), with 3-way
/// guidance.
const fn longcat_family() -> FamilySpec {
    FamilySpec {
        defaults: ModelFamily::OtherDit,
        ref_latent_img_cfg: true,
        ref_image_preset: Some("longcat"),
        ..flux_family(FluxVariant::LongCat, Concat::None)
    }
}

/// Reference images are not passed to Chroma1-Radiance: its pixel decoder has no place for
/// their tokens (the reference would fail in the attention).
const fn chroma_radiance_family() -> FamilySpec {
    FamilySpec { latent: PIXEL_LATENT, preview: None, ref_latents: false, ..flux_family(FluxVariant::ChromaRadiance, Concat::None) }
}

/// MiniT2I: pixels like Chroma1-Radiance, x0 predicted, no reference images.
const fn minit2i_family() -> FamilySpec {
    FamilySpec { preview: None, ..dit_family(ModelFamily::OtherDit, Arch::MiniT2i, PIXEL_LATENT, &preview::FLUX, Concat::None, Prediction::Minit2iFlow) }
}

/// PiD: pixels, its reference image encoded at its own size into the transformer's LQ
/// projection (not as tokens), no 3-way guidance.
const fn pid_family() -> FamilySpec {
    FamilySpec {
        preview: None,
        ref_latents: true,
        ref_image_multiple: 0,
        ..dit_family(ModelFamily::Pid, Arch::Pid, PIXEL_LATENT, &preview::FLUX, Concat::None, Prediction::Flow)
    }
}

/// HiDream-O1: pixels (32×32 patches in the network, which the reference does not align
/// to), its own eta-scaled starting noise, no reference latents (edit's reference images
/// reach the network through its conditioner).
const fn hidream_o1_family() -> FamilySpec {
    FamilySpec {
        preview: None,
        noise_times_eta: true,
        ..dit_family(ModelFamily::HidreamO1, Arch::HidreamO1, PIXEL_LATENT, &preview::FLUX, Concat::None, Prediction::Flow)
    }
}

/// The Wan2.1 VAE's 16 channels at 1/8 (normalised per channel by the VAE itself).
const WAN21_LATENT: LatentFormat = LatentFormat { channels: 16, vae_scale: 8, down_factor: 1, scale_factor: 1.0, shift_factor: 0.0 };

const fn qwen_image_family() -> FamilySpec {
    FamilySpec {
        ref_latents: true,
        ref_latent_img_cfg: true,
        ref_image_preset: Some("qwen"),
        ref_image_multiple: 32,
        first_stage: FirstStageKind::Wan21,
        ..dit_family(ModelFamily::OtherDit, Arch::QwenImage, WAN21_LATENT, &preview::WAN21, Concat::None, Prediction::Flow)
    }
}

/// Krea2: the Wan2.1 VAE's latents, reference images as tokens (`krea2_ostris_edit`), no
/// 3-way guidance with them.
const fn krea2_family() -> FamilySpec {
    FamilySpec {
        ref_latents: true,
        ref_image_preset: Some("krea2_ostris_edit"),
        first_stage: FirstStageKind::Wan21,
        ..dit_family(ModelFamily::OtherDit, Arch::Krea2, WAN21_LATENT, &preview::WAN21, Concat::None, Prediction::FluxFlow)
    }
}

/// Anima: the Wan2.1 VAE's latents, reference images as tokens (`cosmos_reference`), no
/// 3-way guidance with them.
const fn anima_family() -> FamilySpec {
    FamilySpec {
        ref_latents: true,
        ref_image_preset: Some("cosmos_reference"),
        first_stage: FirstStageKind::Wan21,
        ..dit_family(ModelFamily::OtherDit, Arch::Anima, WAN21_LATENT, &preview::WAN21, Concat::None, Prediction::Flow)
    }
}

/// The Mage VAE's 128 channels at 1/16, one token per latent pixel.
const MAGE_LATENT: LatentFormat = LatentFormat { channels: 128, vae_scale: 16, down_factor: 1, scale_factor: 1.0, shift_factor: 0.0 };

/// Mage-Flow: reference images as tokens after the image's (the `mage_flow` preset: resized
/// to the request's size), with 3-way guidance; previews through Flux.2's projection of 128
/// channels.
const fn mage_flow_family() -> FamilySpec {
    FamilySpec {
        ref_latents: true,
        ref_latent_img_cfg: true,
        ref_image_preset: Some("mage_flow"),
        first_stage: FirstStageKind::Mage,
        ..dit_family(ModelFamily::OtherDit, Arch::MageFlow, MAGE_LATENT, &preview::FLUX2, Concat::None, Prediction::Flow)
    }
}

/// Qwen-Image-Layered: Qwen-Image decomposing a picture (a reference image, numbered
/// downwards) into RGBA layers.
const fn qwen_image_layered_family() -> FamilySpec {
    FamilySpec { ref_image_preset: Some("qwen_layered"), image_channels: 4, media: Media::Layered, ..qwen_image_family() }
}

/// Wan2.1's latent: the Wan2.1 VAE's 16 channels at 1/8, patches of 2×2 in the transformer.
const WAN_LATENT: LatentFormat = LatentFormat { down_factor: 2, ..WAN21_LATENT };
/// Wan2.2 TI2V's: the Wan2.2 VAE's 48 channels at 1/16.
const WAN22_LATENT: LatentFormat = LatentFormat { channels: 48, vae_scale: 16, down_factor: 2, scale_factor: 1.0, shift_factor: 0.0 };

/// Wan 2.x: frames in groups of 4 after the first.
const fn wan_family(latent: LatentFormat, projection: &'static Projection, first_stage: FirstStageKind, timesteps: TimestepRule) -> FamilySpec {
    FamilySpec {
        media: Media::Video(VideoFormat { time_scale: 4, timesteps, frame_rule: FrameRule::Causal }),
        first_stage,
        encode_tile_factor: tiling::VIDEO_ENCODE_TILE_FACTOR,
        ..dit_family(ModelFamily::OtherDit, Arch::Wan, latent, projection, Concat::None, Prediction::Flow)
    }
}

/// HunyuanVideo 1.5's latent: its VAE's 32 channels at 1/16, patches of 2×2 in the transformer.
const HUNYUAN_VIDEO_LATENT: LatentFormat = LatentFormat { channels: 32, vae_scale: 16, down_factor: 2, scale_factor: 1.0, shift_factor: 0.0 };

/// HunyuanVideo 1.5: frames in groups of 4 after the first, no preview projection (the
/// reference has none for its latents).
const fn hunyuan_video_family() -> FamilySpec {
    FamilySpec {
        arch: Arch::HunyuanVideo,
        preview: None,
        ..wan_family(HUNYUAN_VIDEO_LATENT, &preview::WAN21, FirstStageKind::Hunyuan, TimestepRule::Scalar)
    }
}

/// MiniMax-H3's latent: its VAE's 24 channels at 1/16, patches of 2×2 in the transformer.
const MINIMAX_H3_LATENT: LatentFormat = LatentFormat { channels: 24, vae_scale: 16, down_factor: 2, scale_factor: 1.0, shift_factor: 0.0 };

/// MiniMax-H3: 17-frame chunks of 5 latent frames with the audio packed behind the video, no
/// preview projection here.
const fn minimax_h3_family() -> FamilySpec {
    FamilySpec {
        media: Media::Video(VideoFormat { time_scale: 4, timesteps: TimestepRule::Scalar, frame_rule: FrameRule::MinimaxH3 }),
        first_stage: FirstStageKind::MinimaxH3,
        preview: None,
        encode_tile_factor: 1.0,
        ..dit_family(ModelFamily::OtherDit, Arch::MinimaxH3, MINIMAX_H3_LATENT, &preview::WAN21, Concat::None, Prediction::Flow)
    }
}

/// LTX-2.3's latent: its VAE's 128 channels at 1/32, one token per latent cell.
const LTX_LATENT: LatentFormat = LatentFormat { channels: 128, vae_scale: 32, down_factor: 1, scale_factor: 1.0, shift_factor: 0.0 };

/// LTX-2.3: frames in groups of 8 with the audio packed behind the video, no preview
/// projection here.
const fn ltx_family() -> FamilySpec {
    FamilySpec {
        media: Media::Video(VideoFormat { time_scale: 8, timesteps: TimestepRule::PerToken, frame_rule: FrameRule::Ltx }),
        first_stage: FirstStageKind::Ltx,
        preview: None,
        encode_tile_factor: tiling::VIDEO_ENCODE_TILE_FACTOR,
        ..dit_family(ModelFamily::Ltxav, Arch::Ltx, LTX_LATENT, &preview::WAN21, Concat::None, Prediction::FluxFlow)
    }
}

const fn with_tae(spec: FamilySpec) -> FamilySpec {
    FamilySpec { tae_first_stage: true, ..spec }
}

const fn with_motion_modules(spec: FamilySpec) -> FamilySpec {
    FamilySpec { motion_modules: true, ..spec }
}

use Concat::{Edit, Inpaint};
use ModelFamily as F;
use UNetVersion as U;

static SD1: FamilySpec = with_motion_modules(unet_family(F::Sd1, U::Sd1, Concat::None));
static SD1_INPAINT: FamilySpec = with_motion_modules(unet_family(F::Sd1, U::Sd1, Inpaint));
static SD1_PIX2PIX: FamilySpec = with_motion_modules(unet_family(F::Sd1, U::Sd1, Edit));
static SD1_TINY: FamilySpec = unet_family(F::Sd1, U::Sd1Tiny, Concat::None);
static SDXS_512: FamilySpec = with_tae(unet_family(F::Sd1, U::Sdxs512Ds, Concat::None));
static SD2: FamilySpec = unet_family(F::Sd2, U::Sd2, Concat::None);
static SD2_INPAINT: FamilySpec = unet_family(F::Sd2, U::Sd2, Inpaint);
static SD2_TINY: FamilySpec = unet_family(F::Sd2, U::Sd2Tiny, Concat::None);
static SDXS_09: FamilySpec = with_tae(unet_family(F::Sd2, U::Sdxs09, Concat::None));
static SDXL: FamilySpec = unet_family(F::Sdxl, U::Sdxl, Concat::None);
static SDXL_INPAINT: FamilySpec = unet_family(F::Sdxl, U::Sdxl, Inpaint);
static SDXL_PIX2PIX: FamilySpec = unet_family(F::Sdxl, U::Sdxl, Edit);
static SDXL_VEGA: FamilySpec = unet_family(F::Sdxl, U::SdxlVega, Concat::None);
static SDXL_SSD1B: FamilySpec = unet_family(F::Sdxl, U::SdxlSsd1b, Concat::None);
static SD3: FamilySpec = dit_family(F::OtherDit, Arch::Mmdit, dit16_latent(1.5305, 0.0609), &preview::SD3, Concat::None, Prediction::Flow);
static FLUX: FamilySpec = flux_family(FluxVariant::Flux, Concat::None);
static FLUX_FILL: FamilySpec = flux_family(FluxVariant::Fill, Concat::FluxFill);
static FLUX_CONTROLS: FamilySpec = flux_family(FluxVariant::Controls, Concat::FluxControls);
static FLEX_2: FamilySpec = flux_family(FluxVariant::Flex2, Concat::Flex2);
static CHROMA_RADIANCE: FamilySpec = chroma_radiance_family();
static OVIS_IMAGE: FamilySpec = flux_family(FluxVariant::Ovis, Concat::None);
static LONGCAT: FamilySpec = longcat_family();
static FLUX2: FamilySpec = flux2_family();
static SEFI_IMAGE: FamilySpec = sefi_family();
static Z_IMAGE: FamilySpec = zimage_family();
static ERNIE_IMAGE: FamilySpec = ernie_image_family();
static LENS: FamilySpec = lens_family();
static IDEOGRAM4: FamilySpec = ideogram4_family();
static BOOGU_IMAGE: FamilySpec = boogu_family();
static QWEN_IMAGE: FamilySpec = qwen_image_family();
static QWEN_IMAGE_LAYERED: FamilySpec = qwen_image_layered_family();
static MAGE_FLOW: FamilySpec = mage_flow_family();
static KREA2: FamilySpec = krea2_family();
static HIDREAM_O1: FamilySpec = hidream_o1_family();
static ANIMA: FamilySpec = anima_family();
static MINIT2I: FamilySpec = minit2i_family();
static PID: FamilySpec = pid_family();
static MINIMAX_H3: FamilySpec = minimax_h3_family();
static LTX: FamilySpec = ltx_family();
static WAN: FamilySpec = wan_family(WAN_LATENT, &preview::WAN21, FirstStageKind::Wan21, TimestepRule::Scalar);
static WAN22_TI2V: FamilySpec = wan_family(WAN22_LATENT, &preview::WAN22, FirstStageKind::Wan22, TimestepRule::PerFrameMasked);
static HUNYUAN_VIDEO: FamilySpec = hunyuan_video_family();
static LINGBOT_VIDEO: FamilySpec = FamilySpec {
    arch: Arch::LingbotVideo,
    encode_tile_factor: tiling::ENCODE_TILE_FACTOR,
    ..wan_family(WAN_LATENT, &preview::WAN21, FirstStageKind::Wan21, TimestepRule::MaskedInput)
};

/// The family of `version`, if this build can generate with it.
pub fn spec(version: SdVersion) -> Option<&'static FamilySpec> {
    use SdVersion as V;
    Some(match version {
        V::Sd1 => &SD1,
        V::Sd1Inpaint => &SD1_INPAINT,
        V::Sd1Pix2Pix => &SD1_PIX2PIX,
        V::Sd1TinyUnet => &SD1_TINY,
        V::Sdxs512Ds => &SDXS_512,
        V::Sd2 => &SD2,
        V::Sd2Inpaint => &SD2_INPAINT,
        V::Sd2TinyUnet => &SD2_TINY,
        V::Sdxs09 => &SDXS_09,
        V::Sdxl => &SDXL,
        V::SdxlInpaint => &SDXL_INPAINT,
        V::SdxlPix2Pix => &SDXL_PIX2PIX,
        V::SdxlVega => &SDXL_VEGA,
        V::SdxlSsd1b => &SDXL_SSD1B,
        V::Sd3 => &SD3,
        V::Flux => &FLUX,
        V::FluxFill => &FLUX_FILL,
        V::FluxControls => &FLUX_CONTROLS,
        V::Flex2 => &FLEX_2,
        V::ChromaRadiance => &CHROMA_RADIANCE,
        V::OvisImage => &OVIS_IMAGE,
        V::Longcat => &LONGCAT,
        V::Flux2 | V::Flux2Klein => &FLUX2,
        V::SefiImage => &SEFI_IMAGE,
        V::ZImage => &Z_IMAGE,
        V::ErnieImage => &ERNIE_IMAGE,
        V::Lens => &LENS,
        V::Ideogram4 => &IDEOGRAM4,
        V::BooguImage => &BOOGU_IMAGE,
        V::QwenImage => &QWEN_IMAGE,
        V::QwenImageLayered => &QWEN_IMAGE_LAYERED,
        V::MageFlow => &MAGE_FLOW,
        V::Krea2 => &KREA2,
        V::HidreamO1 => &HIDREAM_O1,
        V::Anima => &ANIMA,
        V::Minit2i => &MINIT2I,
        V::Pid => &PID,
        V::MinimaxH3 => &MINIMAX_H3,
        V::Ltxav => &LTX,
        V::Wan2 | V::Wan2_2I2v => &WAN,
        V::Wan2_2Ti2v => &WAN22_TI2V,
        V::HunyuanVideo => &HUNYUAN_VIDEO,
        V::LingbotVideo => &LINGBOT_VIDEO,
        _ => return None,
    })
}

/// What a family builder gets.
pub struct BuildCtx<'a> {
    pub params: &'a CtxParams,
    /// Shared with components that load their weights later (T5).
    pub weights: &'a Arc<Weights>,
    pub version: SdVersion,
    pub spec: &'static FamilySpec,
    pub devices: &'a DeviceMap,
    pub n_threads: i32,
}

impl BuildCtx<'_> {
    /// A transformer declared under `prefix`, placed where the context puts the diffusion
    /// model, with the context's attention and convolution options. On the fast path its
    /// float products sum in their own order (`gemm::fast`, `gemm::amx`): a transformer's
    /// step is nearly all products. (The UNet's products do too, beside its Winograd
    /// convolutions, and the LLM text encoders' float ones; other encoders and the VAEs keep
    /// ggml's order: the pictures stay within the reference's own builds' distance,
    /// `tests/fast_path.rs`.) Without `eager_load` its
    /// weights are read when it first samples, as the reference prepares them: a 24 GB
    /// Flux DiT is not resident beside the 9 GB T5 while the prompt is encoded.
    pub fn load_transformer<M>(&self, prefix: &str, declare: impl FnOnce(&mut Scope) -> M) -> Result<Loaded<M>> {
        let mut model = self.weights.load_model(self.diffusion_placement()?, self.n_threads, prefix, "diffusion model", declare)?;
        model.runner.options.flash_attn = self.params.flash_attn || self.params.diffusion_flash_attn;
        model.runner.options.conv_direct = self.params.diffusion_conv_direct;
        model.runner.options.cpu_fast_products = model.runner.options.fast;
        model.runner.options.cpu_fast_q8_0 = model.runner.options.fast;
        Ok(model)
    }

    /// Where the diffusion model (a UNet or a transformer) computes; without `eager_load` its
    /// weights are read when it first samples.
    pub fn diffusion_placement(&self) -> Result<Placement> {
        Ok(self.devices.placement(Module::Diffusion)?.loaded_at_first_use(!self.params.eager_load))
    }

    /// The transformer (`model`, e.g. "the Lens transformer") must take the latent channels the
    /// family's first stage makes (`makes`, e.g. "the Flux.2 VAE's patchified latents have").
    pub fn ensure_latent_channels(&self, takes: i64, model: &str, makes: &str) -> Result<()> {
        let have = self.spec.latent.channels;
        ensure!(takes as usize == have, "{model} takes {takes} latent channels, {makes} {have}");
        Ok(())
    }
}

/// The text encoder must give states as wide as the transformer reads (the reference fails an
/// assertion in the first product otherwise). `reader` names what reads them; `hint` says what
/// the family pairs with.
pub fn ensure_text_width(gives: i64, takes: i64, reader: &str, hint: &str) -> Result<()> {
    let hint = if hint.is_empty() { String::new() } else { format!(" ({hint})") };
    ensure!(gives == takes, "the LLM's hidden states are {gives} wide, {reader} takes {takes}{hint}");
    Ok(())
}

/// The parts of a flow family. Like the reference, the family's default flow shift applies
/// only when the request left the prediction to the model.
pub fn flow_parts(
    params: &CtxParams,
    cond: Box<dyn Conditioner>,
    diffusion: Box<dyn DiffusionModel>,
    (first_stage, preview): (Box<dyn FirstStage>, Option<Box<dyn FirstStage>>),
    default_prediction: Prediction,
    default_shift: f32,
) -> Parts {
    let prediction = params.prediction.unwrap_or(default_prediction);
    Parts {
        cond,
        diffusion,
        first_stage,
        preview,
        prediction,
        denoiser: Denoiser::new(prediction, None),
        default_flow_shift: params.prediction.is_none().then_some(default_shift),
        high_noise: None,
        video_cond: VideoCond::Text,
        clip_vision: None,
        ip_adapter: None,
    }
}

/// The parts a builder returns.
pub struct Parts {
    pub cond: Box<dyn Conditioner>,
    pub diffusion: Box<dyn DiffusionModel>,
    pub first_stage: Box<dyn FirstStage>,
    /// A separate decoder for previews only (`tae_preview_only`).
    pub preview: Option<Box<dyn FirstStage>>,
    pub prediction: Prediction,
    pub denoiser: Denoiser,
    /// The flow shift a request without one gets (flow families).
    pub default_flow_shift: Option<f32>,
    /// The expert for the high-noise steps (Wan2.2 A14B), when one was given.
    pub high_noise: Option<Box<dyn DiffusionModel>>,
    pub video_cond: VideoCond,
    /// The CLIP vision tower (Wan2.1 I2V / FLF2V).
    pub clip_vision: Option<ClipVision>,
    /// The IP-Adapter (UNet families, `ip_adapter_path`) with its CLIP vision tower.
    pub ip_adapter: Option<IpAdapterModel>,
}

/// Everything `new_sd_ctx` loaded.
pub struct ModelSet {
    /// The model files (weights re-read per phase with `params_backend=disk`; checked
    /// before each generation).
    pub weights: Arc<Weights>,
    pub devices: DeviceMap,
    pub version: SdVersion,
    pub spec: &'static FamilySpec,
    pub prediction: Prediction,
    pub denoiser: Denoiser,
    pub default_flow_shift: Option<f32>,
    pub rng_type: RngType,
    pub sampler_rng_type: Option<RngType>,
    pub n_threads: i32,
    pub cond: Box<dyn Conditioner>,
    pub diffusion: Box<dyn DiffusionModel>,
    /// The expert for the high-noise steps (Wan2.2 A14B's pair), sampled before `diffusion`.
    pub high_noise: Option<Box<dyn DiffusionModel>>,
    pub video_cond: VideoCond,
    pub clip_vision: Option<ClipVision>,
    pub first_stage: Box<dyn FirstStage>,
    pub preview: Option<Box<dyn FirstStage>>,
    /// The LoRAs in effect on the conditioner, diffusion model and first stage.
    pub loras: LoraSet,
    /// Generation extensions: the IP-Adapter (`ip_adapter_path`), the ControlNet
    /// (`control_net_path`, or swapped later), PhotoMaker (`photo_maker_path`) and PuLID
    /// (with `pulid_weights_path`), in that order.
    pub extensions: Vec<Box<dyn Extension>>,
    /// The audio VAE that decodes the sound of a video (MiniMax-H3, `audio_vae_path`).
    pub audio: Option<Box<dyn crate::models::vae::audio::AudioStage>>,
    /// What add-on networks loaded later are read with (mmap, weight types, devices).
    ctx_params: CtxParams,
}

impl ModelSet {
    /// Opens the files of `params`, detects the version and builds its family.
    pub fn new(params: &CtxParams) -> Result<ModelSet> {
        let weights = Arc::new(Weights::open(params)?);
        let version = weights.version();
        let spec = spec(version)
            .ok_or_else(|| crate::error::Error::new(format!("{} models are not supported yet in this build of libstable-diffusion", version.name())))?;
        let n_threads = if params.n_threads <= 0 { crate::graph::backend::physical_cores() } else { params.n_threads };
        let devices = DeviceMap::new(&DeviceOptions {
            backend: params.backend.as_deref(),
            params_backend: params.params_backend.as_deref(),
            split_mode: params.split_mode.as_deref(),
            max_vram: params.max_vram.as_deref(),
            rpc_servers: params.rpc_servers.as_deref(),
            stream_layers: params.stream_layers,
            auto_fit: params.auto_fit,
        })?;
        // The sound's VAE first: a file the family cannot read fails the context early.
        let audio = match params.audio_vae_path.as_deref().filter(|p| !p.is_empty()) {
            Some(path) if spec.video().is_some_and(|v| v.frame_rule == FrameRule::MinimaxH3) => minimax_h3::load_audio_vae(path, &devices, n_threads)?,
            Some(path) if spec.video().is_some_and(|v| v.frame_rule == FrameRule::Ltx) => ltx::load_audio_vae(path, &devices, n_threads)?,
            Some(path) => {
                minimax_h3::audio_vae_without_sound(path, version)?;
                None
            }
            None => None,
        };
        let mut ctx = BuildCtx { params, weights: &weights, version, spec, devices: &devices, n_threads };
        let parts = match spec.arch {
            Arch::Unet { unet, text } => unet::build(&mut ctx, unet, text)?,
            Arch::Flux { variant } => flux::build(&mut ctx, variant)?,
            Arch::Mmdit => mmdit::build(&mut ctx)?,
            Arch::Flux2 => flux2::build(&mut ctx)?,
            Arch::Sefi => sefi::build(&mut ctx)?,
            Arch::ZImage => zimage::build(&mut ctx)?,
            Arch::QwenImage => qwen_image::build(&mut ctx)?,
            Arch::MageFlow => mage_flow::build(&mut ctx)?,
            Arch::Wan => wan::build(&mut ctx)?,
            Arch::HunyuanVideo => hunyuan_video::build(&mut ctx)?,
            Arch::LingbotVideo => lingbot::build(&mut ctx)?,
            Arch::Krea2 => krea2::build(&mut ctx)?,
            Arch::Anima => anima::build(&mut ctx)?,
            Arch::ErnieImage => ernie::build(&mut ctx)?,
            Arch::Lens => lens::build(&mut ctx)?,
            Arch::Boogu => boogu::build(&mut ctx)?,
            Arch::HidreamO1 => hidream_o1::build(&mut ctx)?,
            Arch::MiniT2i => minit2i::build(&mut ctx)?,
            Arch::Pid => pid::build(&mut ctx)?,
            Arch::Ideogram4 => ideogram4::build(&mut ctx)?,
            Arch::MinimaxH3 => minimax_h3::build(&mut ctx)?,
            Arch::Ltx => ltx::build(&mut ctx)?,
        };
        let given = |p: &Option<String>| p.as_deref().is_some_and(|p| !p.is_empty());
        if given(&params.ip_adapter_path) && parts.ip_adapter.is_none() {
            sd_warn!("{} models take no IP-Adapter here (SD 1.x and SDXL do); ignoring ip_adapter_path", version.name());
        }
        if given(&params.clip_vision_path) && parts.clip_vision.is_none() && parts.ip_adapter.is_none() {
            sd_warn!("{} models do not use a CLIP vision model here; ignoring clip_vision_path", version.name());
        }
        if given(&params.high_noise_diffusion_model_path) && parts.high_noise.is_none() {
            sd_warn!("{} models have no high noise expert; ignoring high_noise_diffusion_model_path", version.name());
        }
        if given(&params.uncond_diffusion_model_path) && spec.arch != Arch::Ideogram4 {
            sd_warn!("{} models have no unconditional diffusion model; ignoring uncond_diffusion_model_path", version.name());
        }
        if given(&params.motion_module_path) && !spec.motion_modules {
            sd_warn!("AnimateDiff motion modules apply to SD 1.x models only, not {}; ignoring motion_module_path", version.name());
        }
        if params.flash_attn {
            sd_info!("Using flash attention");
        }
        sd_info!(
            "running in {} mode",
            match parts.prediction {
                Prediction::Eps => "eps-prediction",
                Prediction::V => "v-prediction",
                Prediction::EdmV => "v-prediction EDM",
                Prediction::Flow | Prediction::FluxFlow | Prediction::SefiFlow | Prediction::Minit2iFlow => "flow",
            }
        );
        let mut set = ModelSet {
            loras: LoraSet::new(crate::types::LoraApplyMode::AtRuntime, &weights, &[]),
            weights,
            devices,
            version,
            spec,
            prediction: parts.prediction,
            denoiser: parts.denoiser,
            default_flow_shift: parts.default_flow_shift,
            rng_type: params.rng_type,
            sampler_rng_type: params.sampler_rng_type,
            n_threads,
            cond: parts.cond,
            diffusion: parts.diffusion,
            high_noise: parts.high_noise,
            video_cond: parts.video_cond,
            clip_vision: parts.clip_vision,
            audio,
            first_stage: parts.first_stage,
            preview: parts.preview,
            extensions: Vec::new(),
            ctx_params: params.clone(),
        };
        let targets = lora_targets(&mut *set.cond, &mut *set.diffusion, set.high_noise.as_deref_mut(), &mut *set.first_stage);
        set.loras = LoraSet::new(params.lora_apply_mode, &set.weights, &targets);
        if let Some(ip) = parts.ip_adapter {
            set.extensions.push(Box::new(ip));
        }
        if let Some(path) = params.control_net_path.as_deref().filter(|p| !p.is_empty()) {
            let net = set.read_control_net(path)?;
            set.extensions.push(Box::new(net));
        }
        if let Some(path) = params.photo_maker_path.as_deref().filter(|p| !p.is_empty()) {
            let pm = super::photomaker::PhotoMaker::load(path, version, params, &set.devices, n_threads)?;
            set.extensions.push(Box::new(pm));
        }
        if let Some(path) = params.pulid_weights_path.as_deref().filter(|p| !p.is_empty()) {
            if set.diffusion.takes_identity() {
                set.extensions.push(Box::<super::pulid::Pulid>::default());
            } else if set.weights.types().keys().any(|n| n.contains("pulid_ca.")) {
                sd_warn!("{} models take no PuLID identity (Flux models do); ignoring pulid_weights_path", version.name());
            } else {
                sd_warn!("no PuLID modules (pulid_ca.*) were loaded from '{path}'; ignoring pulid_weights_path");
            }
        }
        Ok(set)
    }

    fn read_control_net(&self, path: &str) -> Result<ControlNetModel> {
        ControlNetModel::load(path, self.version, &self.ctx_params, &self.devices, self.n_threads)
    }

    /// Loads the ControlNet in `path`, replacing the one loaded; on failure the previous
    /// one (or none) stays in place. Nothing else is reloaded.
    pub fn load_control_net(&mut self, path: &str) -> Result<()> {
        let net = self.read_control_net(path)?;
        match self.extension_at(control::NAME) {
            Some(i) => {
                sd_info!("replacing control net '{}'", self.control_net_path().unwrap_or_default());
                self.extensions[i] = Box::new(net);
            }
            // After the IP-Adapter, before PhotoMaker and PuLID, as when loaded with the context.
            None => {
                let at = self.extension_at(super::ip_adapter::NAME).map_or(0, |i| i + 1);
                self.extensions.insert(at, Box::new(net));
            }
        }
        Ok(())
    }

    /// Drops the ControlNet (nothing to do without one).
    pub fn unload_control_net(&mut self) {
        if let Some(i) = self.extension_at(control::NAME) {
            sd_info!("unloaded control net '{}'", self.control_net_path().unwrap_or_default());
            self.extensions.remove(i);
        }
    }

    /// The file of the loaded ControlNet.
    fn control_net_path(&self) -> Option<String> {
        self.extension_at(control::NAME).and_then(|i| self.extensions[i].file()).map(str::to_string)
    }

    fn extension_at(&self, name: &str) -> Option<usize> {
        self.extensions.iter().position(|e| e.name() == name)
    }

    /// An extension of that name is loaded.
    pub fn has_extension(&self, name: &str) -> bool {
        self.extension_at(name).is_some()
    }

    /// Brings the model to the LoRAs of a request (see [`LoraSet::apply`]): nothing to do
    /// when they are the ones in effect; on failure the previous ones stay.
    pub fn apply_loras(&mut self, wanted: &[crate::params::Lora]) -> Result<()> {
        // The extensions' LoRAs (PhotoMaker's) are in effect for every request, first.
        let mut all: Vec<crate::params::Lora> = self.extensions.iter().flat_map(|e| e.loras()).collect();
        all.extend_from_slice(wanted);
        // A diffusion model read at its first use is read now when LoRAs are merged into it
        // (nothing to do once it has been read).
        if self.loras.applies_immediately() && !all.is_empty() {
            read_first_use(&mut *self.diffusion)?;
            if let Some(h) = self.high_noise.as_deref_mut() {
                read_first_use(h)?;
            }
        }
        let mut targets = lora_targets(&mut *self.cond, &mut *self.diffusion, self.high_noise.as_deref_mut(), &mut *self.first_stage);
        self.loras.apply(&all, &self.weights, &mut targets, self.n_threads)
    }

    pub fn family(&self) -> ModelFamily {
        self.spec.defaults
    }

    /// `generate_video` renders frames with AnimateDiff (a motion module is loaded).
    pub fn animates_frames(&self) -> bool {
        self.diffusion.has_motion_modules()
    }

    /// The runners of the first stage and of the preview decoder.
    pub fn first_stage_runners(&mut self) -> Vec<&mut Runner> {
        let mut v = self.first_stage.runners();
        if let Some(p) = self.preview.as_mut() {
            v.extend(p.runners());
        }
        v
    }

    /// Every graph runner of the set.
    pub fn runners(&mut self) -> Vec<&mut Runner> {
        let mut v = self.cond.runners();
        v.extend(self.diffusion.runners());
        if let Some(h) = self.high_noise.as_mut() {
            v.extend(h.runners());
        }
        if let Some(c) = self.clip_vision.as_mut() {
            v.extend(c.runners());
        }
        v.extend(self.first_stage.runners());
        if let Some(p) = self.preview.as_mut() {
            v.extend(p.runners());
        }
        for e in self.extensions.iter_mut() {
            v.extend(e.runners());
        }
        v
    }
}

/// The file of `audio_vae_path`, or none (with the reference's warning) when it cannot be read:
/// the reference then goes on without sound.
fn open_audio_vae(path: &str) -> Option<Weights> {
    sd_info!("loading audio VAE from '{path}'");
    Weights::open_file_as_stored(path).map_err(|e| sd_warn!("loading audio VAE weights from '{path}' failed: {e}")).ok()
}

/// Refuses an audio VAE with a block-quantized tensor among those `used` accepts: ggml's 1-D
/// convolutions take float kernels only (the reference would fail in its graph).
fn audio_vae_floats_only(weights: &Weights, path: &str, family: &str, used: impl Fn(&str) -> bool) -> Result<()> {
    match weights.types().iter().find(|(n, &t)| used(n) && crate::graph::is_block_quantized(t)) {
        Some((name, _)) => bail!("the audio VAE '{path}': tensor '{name}' is quantized; {family}'s audio VAE takes float weights only"),
        None => Ok(()),
    }
}

/// Reads the weights of `model`'s networks that are read at their first use (they stay).
fn read_first_use(model: &mut dyn DiffusionModel) -> Result<()> {
    for c in model.components() {
        if matches!(c.weights_mut().placement.weights, crate::graph::WeightHome::FirstUse) {
            c.begin()?;
        }
    }
    Ok(())
}

/// The weights LoRAs apply to, like the reference: the conditioner's, the diffusion model's
/// (and the high-noise expert's: `is_high_noise` LoRAs name its tensors) and the first
/// stage's components (not a preview-only decoder).
fn lora_targets<'a>(
    cond: &'a mut dyn Conditioner,
    diffusion: &'a mut dyn DiffusionModel,
    high_noise: Option<&'a mut (dyn DiffusionModel + 'static)>,
    first_stage: &'a mut dyn FirstStage,
) -> Vec<WeightsMut<'a>> {
    let mut v = cond.components();
    v.extend(diffusion.components());
    if let Some(h) = high_noise {
        v.extend(h.components());
    }
    v.extend(first_stage.components());
    v.into_iter().map(|c| c.weights_mut()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference picks the encode tile factor by version: 1.30539 for Wan, HunyuanVideo
    /// and LTX-2.3, 1 for MiniMax-H3, 2 for the rest, even where they load a Wan VAE.
    #[test]
    fn encode_tile_factor_follows_the_version_not_the_vae() {
        use SdVersion as V;
        let factor = |v| spec(v).expect("a family").encode_tile_factor;
        for v in [V::Wan2, V::Wan2_2I2v, V::Wan2_2Ti2v, V::HunyuanVideo, V::Ltxav] {
            assert_eq!(factor(v), tiling::VIDEO_ENCODE_TILE_FACTOR, "{v:?}");
        }
        assert_eq!(factor(V::MinimaxH3), 1.0);
        for v in [V::QwenImage, V::Krea2, V::Anima, V::LingbotVideo, V::Sd1, V::Flux] {
            assert_eq!(factor(v), tiling::ENCODE_TILE_FACTOR, "{v:?}");
        }
    }

    #[test]
    fn every_unet_flux_sd3_zimage_qwen_version_has_a_family_and_later_families_are_refused() {
        for v in SdVersion::ALL {
            match spec(*v) {
                Some(s) if v.is_unet() => {
                    assert_eq!(s.latent.size_multiple(), 64);
                    // The reference's AnimateDiff versions.
                    assert_eq!(s.motion_modules, matches!(*v, SdVersion::Sd1 | SdVersion::Sd1Inpaint | SdVersion::Sd1Pix2Pix), "{v}");
                    assert_eq!(s.supports_img_cfg(false), v.is_inpaint() || matches!(v, SdVersion::Sd1Pix2Pix | SdVersion::SdxlPix2Pix));
                    assert!(s.vae_quant_convs && !s.skip_layer_guidance);
                }
                Some(s) if *v == SdVersion::ChromaRadiance => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (1, 3));
                    assert!(s.preview.is_none() && !s.ref_latents && !s.supports_img_cfg(true));
                }
                Some(s) if v.is_flux2() => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (16, 128));
                    assert!(s.vae_quant_convs && s.skip_layer_guidance && s.supports_img_cfg(true) && !s.supports_img_cfg(false));
                    assert_eq!((s.defaults, s.ref_image_preset), (ModelFamily::Flux2, Some("flux2")));
                }
                Some(s) if *v == SdVersion::SefiImage => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.unencoded_channels), (16, 144, 16));
                    assert!(s.vae_quant_convs && s.preview.is_none() && s.ref_latents && !s.supports_img_cfg(true));
                    assert_eq!((s.arch, s.ref_image_preset, s.prediction), (Arch::Sefi, Some("flux2"), PredictionRule::Fixed(Prediction::SefiFlow)));
                }
                Some(s) if v.is_qwen_image() => {
                    let layered = *v == SdVersion::QwenImageLayered;
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.ref_image_multiple), (8, 16, 32));
                    assert!(s.skip_layer_guidance && s.supports_img_cfg(true) && !s.supports_img_cfg(false));
                    let preset = if layered { "qwen_layered" } else { "qwen" };
                    assert_eq!((s.defaults, s.ref_image_preset), (ModelFamily::OtherDit, Some(preset)));
                    assert_eq!((s.image_channels, s.is_layered()), (if layered { 4 } else { 3 }, layered));
                }
                Some(s) if *v == SdVersion::MageFlow => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.ref_image_multiple), (16, 128, 16));
                    assert!(s.ref_latents && s.supports_img_cfg(true) && !s.supports_img_cfg(false) && s.first_stage == FirstStageKind::Mage);
                    assert_eq!((s.arch, s.ref_image_preset, s.defaults), (Arch::MageFlow, Some("mage_flow"), ModelFamily::OtherDit));
                }
                Some(s) if *v == SdVersion::Krea2 => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.ref_image_multiple), (8, 16, 16));
                    assert!(s.ref_latents && !s.supports_img_cfg(true) && s.first_stage == FirstStageKind::Wan21);
                    assert_eq!((s.arch, s.ref_image_preset, s.defaults), (Arch::Krea2, Some("krea2_ostris_edit"), ModelFamily::OtherDit));
                }
                Some(s) if *v == SdVersion::Anima => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (8, 16));
                    assert!(s.ref_latents && !s.supports_img_cfg(true) && s.first_stage == FirstStageKind::Wan21);
                    assert_eq!((s.arch, s.ref_image_preset, s.prediction), (Arch::Anima, Some("cosmos_reference"), PredictionRule::Fixed(Prediction::Flow)));
                }
                Some(s) if v.is_wan() => {
                    let ti2v = *v == SdVersion::Wan2_2Ti2v;
                    let video = s.video().expect("Wan generates video");
                    assert_eq!(video.time_scale, 4);
                    assert_eq!(video.timesteps == TimestepRule::PerFrameMasked, ti2v);
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), if ti2v { (32, 48) } else { (16, 16) });
                    assert_eq!(s.first_stage, if ti2v { FirstStageKind::Wan22 } else { FirstStageKind::Wan21 });
                    assert!(s.image_channels == 3 && !s.is_layered() && !s.supports_img_cfg(true));
                }
                Some(s) if *v == SdVersion::LingbotVideo => {
                    let video = s.video().expect("LingBot generates video");
                    assert_eq!((video.time_scale, video.timesteps), (4, TimestepRule::MaskedInput));
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.arch), (16, 16, Arch::LingbotVideo));
                    assert!(s.first_stage == FirstStageKind::Wan21 && !s.supports_img_cfg(true));
                }
                Some(s) if *v == SdVersion::HunyuanVideo => {
                    let video = s.video().expect("HunyuanVideo generates video");
                    assert_eq!((video.time_scale, video.timesteps), (4, TimestepRule::Scalar));
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.first_stage), (32, 32, FirstStageKind::Hunyuan));
                    assert!(s.preview.is_none() && !s.ref_latents && s.arch == Arch::HunyuanVideo);
                }
                Some(s) if *v == SdVersion::Longcat => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (8, 16));
                    assert!(!s.vae_quant_convs && s.skip_layer_guidance && s.supports_img_cfg(true) && !s.supports_img_cfg(false));
                    assert_eq!((s.defaults, s.ref_image_preset), (ModelFamily::OtherDit, Some("longcat")));
                }
                Some(s) if *v == SdVersion::Ideogram4 => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (16, 128));
                    assert!(s.vae_quant_convs && !s.ref_latents && !s.supports_img_cfg(true));
                    assert_eq!((s.defaults, s.arch), (ModelFamily::Ideogram4, Arch::Ideogram4));
                }
                Some(s) if *v == SdVersion::Lens => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.defaults), (16, 128, ModelFamily::OtherDit));
                    assert!(s.vae_quant_convs && !s.ref_latents && !s.supports_img_cfg(true));
                    assert_eq!((s.arch, s.prediction), (Arch::Lens, PredictionRule::Fixed(Prediction::FluxFlow)));
                }
                Some(s) if *v == SdVersion::ErnieImage => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (16, 128));
                    assert!(s.vae_quant_convs && !s.ref_latents && !s.supports_img_cfg(true));
                    assert_eq!((s.defaults, s.arch), (ModelFamily::OtherDit, Arch::ErnieImage));
                }
                Some(s) if *v == SdVersion::Minit2i => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (1, 3));
                    assert!(s.preview.is_none() && !s.ref_latents && !s.supports_img_cfg(true));
                    assert_eq!((s.arch, s.prediction), (Arch::MiniT2i, PredictionRule::Fixed(Prediction::Minit2iFlow)));
                }
                Some(s) if *v == SdVersion::Pid => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.ref_image_multiple), (1, 3, 0));
                    assert!(s.preview.is_none() && s.ref_latents && !s.supports_img_cfg(true));
                    assert_eq!((s.arch, s.defaults), (Arch::Pid, ModelFamily::Pid));
                }
                Some(s) if *v == SdVersion::HidreamO1 => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.defaults), (1, 3, ModelFamily::HidreamO1));
                    assert!(s.noise_times_eta && s.preview.is_none() && !s.ref_latents && !s.supports_img_cfg(true));
                }
                Some(s) if *v == SdVersion::Ltxav => {
                    let video = s.video().expect("LTX-2.3 generates video");
                    assert_eq!((video.frame_rule, video.align_frames(5), video.align_frames(17), video.latent_frames(9)), (FrameRule::Ltx, 1, 17, 2));
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.arch, s.first_stage), (32, 128, Arch::Ltx, FirstStageKind::Ltx));
                    assert_eq!(video.audio_latents(9, 16.0) * video.audio_step_values(), 15 * 128);
                }
                Some(s) if *v == SdVersion::MinimaxH3 => {
                    let video = s.video().expect("MiniMax-H3 generates video");
                    assert_eq!((video.frame_rule, video.align_frames(1), video.align_frames(9), video.latent_frames(22)), (FrameRule::MinimaxH3, 5, 22, 7));
                    assert_eq!((video.audio_latents(5, 24.0), video.latent_frames(39)), (8, 12));
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.arch, s.first_stage), (32, 24, Arch::MinimaxH3, FirstStageKind::MinimaxH3));
                }
                Some(s) if *v == SdVersion::BooguImage => {
                    assert_eq!((s.latent.size_multiple(), s.latent.channels, s.latent.scale_factor), (8, 16, 0.3611));
                    assert!(!s.vae_quant_convs && s.skip_layer_guidance && s.supports_img_cfg(true) && !s.supports_img_cfg(false));
                    assert_eq!((s.arch, s.ref_image_preset, s.prediction), (Arch::Boogu, Some("z_image_omni"), PredictionRule::Fixed(Prediction::Flow)));
                }
                Some(s) => {
                    assert!(s.image_channels == 3 && !s.is_layered() && s.video().is_none());
                    assert!(v.is_flux() || matches!(*v, SdVersion::Sd3 | SdVersion::ZImage), "{v}");
                    assert_eq!((s.latent.size_multiple(), s.latent.channels), (8, 16));
                    assert!(!s.vae_quant_convs && s.skip_layer_guidance);
                    let ref_cfg = (v.is_flux() && *v != SdVersion::OvisImage) || *v == SdVersion::ZImage;
                    assert_eq!(s.supports_img_cfg(true), ref_cfg, "{v}");
                    assert_eq!(s.ref_image_preset == Some("z_image_omni"), *v == SdVersion::ZImage, "{v}");
                }
                None => assert!(!v.is_unet() || *v == SdVersion::Svd, "{v}"),
            }
        }
        assert_eq!(spec(SdVersion::SdxlVega).unwrap().latent.scale_factor, 0.13025);
        assert_eq!(spec(SdVersion::Sd2).unwrap().prediction, PredictionRule::ProbeV);
        assert!(spec(SdVersion::Sdxs512Ds).unwrap().tae_first_stage);
    }
}
