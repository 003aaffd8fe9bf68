//! Contexts: a loaded model set and what can be done with it.
//!
//! These are the boundary the C layer calls. Every method takes `&self`: the C API lets a
//! caller cancel from another thread while a generation runs, so the model set lives
//! behind a lock and the cancel flag is shared.

use crate::params::*;
use crate::error::Result;
use crate::graph::profile;
use crate::image::Image;
use crate::pipeline::callbacks::CancelFlag;
use crate::pipeline::{ModelSet, Upscaler};
use crate::runtime::defaults::{self, ModelFamily};
use crate::types::{CancelMode, Prediction, SampleMethod, Scheduler};
use parking_lot::Mutex;
use std::sync::Arc;

/// What a video generation returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VideoOutput {
    pub frames: Vec<Image>,
    pub audio: Option<Audio>,
}

/// A loaded model set (`sd_ctx_t`).
pub struct Context {
    cancel: Arc<CancelFlag>,
    family: ModelFamily,
    prediction: Prediction,
    /// The family generates video (`generate_video`) rather than pictures.
    video: bool,
    /// An SD 1.x model with AnimateDiff motion modules: pictures, and video frames too.
    animated: bool,
    /// What the context was created with: requests warn about its ignored fields.
    params: CtxParams,
    sd: Mutex<ModelSet>,
}

impl Context {
    /// Loads the models named by `params`.
    pub fn new(params: &CtxParams) -> Result<Context> {
        let sd = ModelSet::new(params)?;
        let video = sd.spec.video().is_some();
        let animated = sd.animates_frames();
        let (family, prediction) = (sd.family(), sd.prediction);
        Ok(Context { cancel: Arc::new(CancelFlag::new()), family, prediction, video, animated, params: params.clone(), sd: Mutex::new(sd) })
    }

    /// Like the reference: every family that does not generate video generates pictures.
    pub fn supports_image_generation(&self) -> bool {
        !self.video
    }

    pub fn supports_video_generation(&self) -> bool {
        self.video || self.animated
    }

    /// Loads (or replaces) the ControlNet without reloading anything else. Not safe while a
    /// generation runs (the call waits for it). On failure the previous state stays.
    pub fn load_control_net(&self, path: &str) -> Result<()> {
        self.sd.lock().load_control_net(path)
    }

    /// Drops the ControlNet; later generations run without one.
    pub fn unload_control_net(&self) -> Result<()> {
        self.sd.lock().unload_control_net();
        Ok(())
    }

    pub fn has_control_net(&self) -> bool {
        self.sd.lock().has_extension(crate::pipeline::control::NAME)
    }

    /// The sampler used when a request leaves it unset.
    pub fn default_sample_method(&self) -> SampleMethod {
        defaults::default_sample_method(Some(self.family))
    }

    /// The scheduler used with `method` when a request leaves it unset.
    pub fn default_scheduler(&self, method: Option<SampleMethod>) -> Scheduler {
        let method = method.unwrap_or_else(|| self.default_sample_method());
        defaults::default_scheduler(Some((self.family, self.prediction)), method)
    }

    /// Text/image to image. Returns `batch_count` images (fewer when cancelled).
    pub fn generate_image(&self, params: &ImgGenParams) -> Result<Vec<Image>> {
        let _profile = profile::Session::start("generate_image");
        self.cancel.reset();
        // The reference crashes here (Wan: a division by zero in its 3-D convolution).
        ensure!(!self.video, "this is a video model and cannot be run by generate_image; use generate_video");
        let mut sd = self.sd.lock();
        crate::pipeline::fields::warn_image(&sd, &self.params, params);
        crate::pipeline::image::generate_image(&mut sd, params, &self.cancel)
    }

    /// Text (and images) to video: the frames, and the sound when the model makes one and its
    /// audio VAE is loaded (MiniMax-H3 with `audio_vae_path`).
    pub fn generate_video(&self, params: &VidGenParams) -> Result<VideoOutput> {
        let _profile = profile::Session::start("generate_video");
        self.cancel.reset();
        let mut sd = self.sd.lock();
        crate::pipeline::fields::warn_video(&sd, &self.params, params);
        let (frames, audio) = crate::pipeline::video::generate_video(&mut sd, params, &self.cancel)?;
        Ok(VideoOutput { frames, audio })
    }

    /// Requests cancellation of the running generation (any thread).
    pub fn cancel(&self, mode: CancelMode) {
        self.cancel.request(mode);
    }

    /// The flag the sampling loop polls.
    pub fn cancel_flag(&self) -> &Arc<CancelFlag> {
        &self.cancel
    }
}

/// The default sampler for a context, or without one (Euler A, like the reference).
pub fn default_sample_method(ctx: Option<&Context>) -> SampleMethod {
    ctx.map_or(SampleMethod::EulerA, Context::default_sample_method)
}

/// The default scheduler for a sampler, with or without a context.
pub fn default_scheduler(ctx: Option<&Context>, method: Option<SampleMethod>) -> Scheduler {
    ctx.map_or_else(|| scheduler_for_method(method), |c| c.default_scheduler(method))
}

/// The scheduler a sampler needs regardless of the model.
fn scheduler_for_method(method: Option<SampleMethod>) -> Scheduler {
    match method {
        Some(SampleMethod::Lcm) | Some(SampleMethod::Tcd) => Scheduler::Lcm,
        Some(SampleMethod::DdimTrailing) => Scheduler::Simple,
        _ => Scheduler::Discrete,
    }
}

/// An ESRGAN upscaler (`upscaler_ctx_t`). Upscaling takes `&self` like every context
/// method; concurrent calls on one context run one after another.
pub struct UpscalerContext {
    upscaler: Mutex<Upscaler>,
    scale: u32,
}

impl UpscalerContext {
    /// Loads the ESRGAN model `params.esrgan_path`; `tile_size` (input pixels, `<= 0`: never
    /// tile) is used by every `upscale`.
    pub fn new(params: &UpscalerParams) -> Result<UpscalerContext> {
        let upscaler = Upscaler::load(params)?;
        Ok(UpscalerContext { scale: upscaler.scale(), upscaler: Mutex::new(upscaler) })
    }

    /// The model's native scale factor (1, 2 or 4).
    pub fn scale_factor(&self) -> i32 {
        self.scale as i32
    }

    /// Upscales `image` (RGB) by the model's factor. `factor` is accepted and ignored, like
    /// the reference does: the model decides the output size.
    pub fn upscale(&self, image: &Image, factor: u32) -> Result<Image> {
        if factor != 0 && factor != self.scale {
            sd_debug!("upscale factor {factor} ignored: the model upscales x{}", self.scale);
        }
        let _profile = profile::Session::start("upscale");
        self.upscaler.lock().upscale(image)
    }
}

/// A face/hand detector that inpaints what it finds (`adetailer_ctx_t`). Detailing takes
/// `&self`; concurrent calls on one context run one after another.
pub struct AdetailerContext {
    detector: Mutex<crate::pipeline::adetailer::Detector>,
}

impl AdetailerContext {
    /// Loads the YOLOv8 detector `params.detector_path`.
    pub fn new(params: &AdetailerCtxParams) -> Result<AdetailerContext> {
        let detector = crate::pipeline::adetailer::Detector::load(params)?;
        Ok(AdetailerContext { detector: Mutex::new(detector) })
    }

    /// Detects regions in `image` and inpaints each with `sd` using `inpaint` as the base
    /// request (`generate_image` of `sd`, once per region). Returns the composited image.
    pub fn detail(&self, sd: &Context, image: &Image, params: &AdetailerParams, inpaint: &ImgGenParams) -> Result<Image> {
        let _profile = profile::Session::start("ADetailer");
        let mut detector = self.detector.lock();
        crate::pipeline::adetailer::detail(&mut detector, image, params, inpaint, |req| sd.generate_image(req))
    }
}

/// Converts model files into one GGUF / safetensors file.
pub fn convert(params: &ConvertParams) -> Result<()> {
    ensure!(
        [&params.model_path, &params.clip_l_path, &params.clip_g_path, &params.t5xxl_path, &params.diffusion_model_path, &params.vae_path]
            .iter()
            .any(|p| p.as_deref().is_some_and(|s| !s.is_empty())),
        "no input model path provided for convert"
    );
    ensure!(!params.output_path.is_empty(), "no output path provided for convert");
    use crate::io::source::{Component, ModelSource};
    let inputs: Vec<ModelSource> = [
        (Component::Model, &params.model_path),
        (Component::ClipL, &params.clip_l_path),
        (Component::ClipG, &params.clip_g_path),
        (Component::T5xxl, &params.t5xxl_path),
        (Component::DiffusionModel, &params.diffusion_model_path),
        (Component::Vae, &params.vae_path),
    ]
    .into_iter()
    .filter_map(|(c, p)| p.as_deref().filter(|p| !p.is_empty()).map(|p| ModelSource::for_convert(c, p)))
    .collect();
    let n_threads = if params.n_threads > 0 { params.n_threads as usize } else { crate::graph::backend::physical_cores() as usize };
    crate::io::convert::convert_with_importance(
        &inputs,
        std::path::Path::new(&params.output_path),
        params.output_type,
        params.tensor_type_rules.as_deref().unwrap_or(""),
        params.convert_name,
        n_threads,
        crate::runtime::imatrix::importance(),
    )
}
