//! PiD: Gemma 2 ([`PidConditioner`]), the PiD transformer on pixels, and an autoencoder
//! that only encodes: its reference image (required: the low-quality picture PiD sharpens)
//! becomes the latent of the transformer's LQ projection, and the result is decoded like
//! pixel-space models (no network). The autoencoder is a 16-channel AutoencoderKL with
//! unscaled latents unless `vae_format` names another family's (flux, sd3: 16 channels with
//! their scale and shift; flux2: Flux.2's 128 patchified channels; wan: the Wan2.1 VAE), like
//! the reference. Flow prediction with the default shift 1.5; the default sampler is LCM.

use super::{dit16_latent, dit_family, first_stage, flow_parts, Arch, BuildCtx, Concat, FamilySpec, Parts, FLUX, FLUX2, SD3, WAN};
use crate::error::Result;
use crate::graph::{Component, Components, Module};
use crate::io::SdVersion;
use crate::models::diffusion::pid::{PidConfig, PidModel, TXT_DIM};
use crate::models::vae::{FirstStage, PixelSpace, Progress};
use crate::pipeline::conditioning::pid::PidConditioner;
use crate::runtime::defaults::ModelFamily;
use crate::runtime::preview;
use crate::runtime::tiling::TilingParams;
use crate::tensor::Tensor;
use crate::types::{Prediction, VaeFormat};

/// Where the transformer's weights live (`diffusion_model_path` files hold `net.`).
const DIT_PREFIX: &str = "model.diffusion_model.net.";
const DEFAULT_FLOW_SHIFT: f32 = 1.5;

/// The reference's own first stage for PiD: 16 channels, latents neither scaled nor shifted.
static PID_VAE: FamilySpec = dit_family(ModelFamily::OtherDit, Arch::Pid, dit16_latent(1.0, 0.0), &preview::FLUX, Concat::None, Prediction::Flow);

/// The autoencoder (as the family whose first stage it is) for `format`.
fn vae_family(format: VaeFormat) -> (SdVersion, &'static FamilySpec) {
    match format {
        VaeFormat::Auto => (SdVersion::Pid, &PID_VAE),
        VaeFormat::Flux => (SdVersion::Flux, &FLUX),
        VaeFormat::Sd3 => (SdVersion::Sd3, &SD3),
        VaeFormat::Flux2 => (SdVersion::Flux2, &FLUX2),
        VaeFormat::Wan => (SdVersion::Wan2, &WAN),
    }
}

pub(super) fn build(ctx: &mut BuildCtx<'_>) -> Result<Parts> {
    let (params, weights, n_threads) = (ctx.params, ctx.weights, ctx.n_threads);
    let te_place = ctx.devices.placement(Module::Te)?;
    let vae_place = ctx.devices.placement(Module::Vae)?;
    let cfg = PidConfig::detect(weights.types(), &|n| weights.shape_of(n), DIT_PREFIX);
    cfg.validate()?;
    let cond = PidConditioner::new(weights, &te_place, n_threads, params.eager_load)?;
    let width = cond.context_width();
    ensure!(width == TXT_DIM, "the text encoder's states are {width} wide, PiD takes Gemma 2 2B's {TXT_DIM}");
    let model = ctx.load_transformer(DIT_PREFIX, |s| PidModel::new(s, &cfg))?;

    let (version, spec) = vae_family(params.vae_format);
    let latent_channels = spec.latent.channels as i64;
    ensure!(
        latent_channels == cfg.lq_channels,
        "PiD's LQ projection takes latents of {} channels, the {} autoencoder (vae_format {}) makes {latent_channels}",
        cfg.lq_channels,
        version.name(),
        params.vae_format.name()
    );
    let vae_ctx = BuildCtx { params, weights, version, spec, devices: ctx.devices, n_threads };
    let (vae, _preview) = first_stage::build(&vae_ctx, vae_place)?;
    sd_info!("using FakeVAE for decoding");
    let first = Box::new(EncodeOnly { vae });
    Ok(flow_parts(params, Box::new(cond), Box::new(model), (first, None), Prediction::Flow, DEFAULT_FLOW_SHIFT))
}

/// An autoencoder for pictures in (the reference image), pixels out.
struct EncodeOnly {
    vae: Box<dyn FirstStage>,
}

impl Components for EncodeOnly {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        self.vae.components()
    }
}

impl FirstStage for EncodeOnly {
    fn encode(&mut self, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        self.vae.encode(image, tiling, circular)
    }

    fn output_to_latents(&self, out: &Tensor, randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        self.vae.output_to_latents(out, randn)
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        self.vae.vae_to_diffusion(z)
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        z.clone()
    }

    fn decode(&mut self, latents: &Tensor, tiling: &TilingParams, circular: (bool, bool), progress: Progress<'_>) -> Result<Tensor> {
        PixelSpace.decode(latents, tiling, circular, progress)
    }
}
