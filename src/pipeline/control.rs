//! ControlNet in the pipeline: loading one for a context (at creation from
//! `control_net_path`, or swapped in and out later), and, as a generation extension, the
//! residuals it adds to each UNet evaluation while sampling, like the reference's
//! `compute_sample_controls`. It acts only on requests with a control image.

use super::extensions::{ExtRequest, Extension};
use super::loader::Weights;
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, DeviceMap, Loaded, Module};
use crate::io::SdVersion;
use crate::models::adapter::controlnet::{self, ControlNet, ControlNetConfig};
use crate::models::Condition;
use crate::params::CtxParams;
use crate::tensor::Tensor;
use std::sync::Arc;

/// A loaded ControlNet and the file its weights come from.
pub struct ControlNetModel {
    net: Loaded<ControlNet>,
    /// Kept open: weights living on disk are re-read from it for each sampling run.
    weights: Arc<Weights>,
    path: String,
    /// The request's control image.
    image: Option<Tensor>,
    /// The guided hint of the current sampling run's control image.
    hint: Option<Tensor>,
}

/// The extension's name (the context asks for its ControlNet by it).
pub const NAME: &str = "controlnet";

impl ControlNetModel {
    /// Loads the ControlNet in `path` for a context of `version` (SD 1.x, SD 2.x or SDXL;
    /// the network must be of the same family) on the device the `controlnet` module is
    /// assigned to. Errors name the file.
    pub fn load(path: &str, version: SdVersion, params: &CtxParams, devices: &DeviceMap, n_threads: i32) -> Result<ControlNetModel> {
        ensure!(!path.is_empty(), "empty ControlNet path");
        sd_info!("loading control net from '{path}'");
        ensure!(version.is_unet(), "ControlNet is only supported with SD 1.x, SD 2.x and SDXL models, not {}", version.name());
        let weights = Arc::new(Weights::open_addon(path, version, params)?);
        let shape_of = |n: &str| weights.shape_of(n);
        let cfg = ControlNetConfig::detect(&shape_of).with_context(|| format!("init control net model from file failed: '{path}'"))?;
        let same_family = cfg.unet.version.is_sdxl() == version.is_sdxl() && cfg.unet.version.is_sd2() == version.is_sd2();
        ensure!(same_family, "'{path}' is an {} ControlNet, which does not fit a {} model", cfg.family_name(), version.name());
        let placement = devices.placement(Module::ControlNet)?;
        let mut net = weights
            .load_model(placement, n_threads, "", "control net", |s| ControlNet::new(s, &cfg))
            .with_context(|| format!("load control net weights from '{path}' failed"))?;
        net.runner.options.conv_direct = params.diffusion_conv_direct;
        if params.diffusion_conv_direct {
            sd_info!("Using Conv2d direct in the control net");
        }
        sd_info!("control net model loaded");
        Ok(ControlNetModel { net, weights, path: path.to_string(), image: None, hint: None })
    }

    pub fn config(&self) -> &ControlNetConfig {
        &self.net.model.config
    }
}

impl Extension for ControlNetModel {
    fn name(&self) -> &'static str {
        NAME
    }

    fn file(&self) -> Option<&str> {
        Some(&self.path)
    }

    fn prepare(&mut self, req: &mut ExtRequest<'_>) -> Result<()> {
        self.image = req.control_image.cloned();
        Ok(())
    }

    fn reads_control_image(&self) -> bool {
        true
    }

    /// Fails, naming the file, when it changed since it was opened (see `Weights::validate`).
    fn validate(&self) -> Result<()> {
        self.weights.validate()
    }

    /// With a control image, the weights are made usable and the hint blocks run once.
    fn begin_run(&mut self) -> Result<()> {
        let Some(image) = &self.image else {
            return Ok(());
        };
        Component::begin(&mut self.net)?;
        let (model, runner) = self.net.parts();
        match controlnet::compute_hint(runner, model, image).context("controlnet compute failed") {
            Ok(h) => {
                self.hint = Some(h);
                Ok(())
            }
            Err(e) => {
                Component::end(&mut self.net);
                Err(e)
            }
        }
    }

    /// Compute buffers, phase copies of weights and the hint are freed.
    fn end_run(&mut self) {
        if self.hint.take().is_some() {
            Component::end(&mut self.net);
        }
    }

    fn residuals(&mut self, x: &Tensor, timesteps: &[f32], cond: &Condition) -> Result<Option<Vec<Tensor>>> {
        let Some(hint) = self.hint.as_ref() else {
            return Ok(None);
        };
        let context = cond.crossattn.as_ref().context("the ControlNet needs a cross-attention context")?;
        let (model, runner) = self.net.parts();
        controlnet::compute(runner, model, x, hint, timesteps, context, cond.vector.as_ref()).context("controlnet compute failed").map(Some)
    }

    fn end_request(&mut self) {
        self.image = None;
    }
}

impl Components for ControlNetModel {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.net]
    }
}
