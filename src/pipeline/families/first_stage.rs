//! The first stage every latent family shares, chosen by the family table
//! (`FamilySpec::first_stage`): an AutoencoderKL shaped by the family's latent format (4, 16
//! or Flux.2's 32 channels, with or without quant convolutions, scale and shift), or a tiny
//! autoencoder (TAESD / TAESDXL / TAESD3 / TAEF1, TAEF2 for Flux.2's latents) when one is
//! given; the Wan2.1 VAE (Qwen-Image, Wan 2.1) or the Wan2.2 VAE (Wan2.2 TI2V), HunyuanVideo
//! 1.5's, LTX-2.3's or MiniMax-H3's VAE, or their tiny video autoencoder (TAEHV: taew2_1 /
//! taew2_2 / the others') when one is given.

use super::{BuildCtx, FirstStageKind};
use crate::error::Result;
use crate::graph::{Loaded, Placement};
use crate::io::SdVersion;
use crate::models::vae::{self, AutoEncoderKL, FirstStage, HunyuanVae, MageVae, TaeConfig, Taehv, TaehvConfig, TinyAutoEncoder, VaeConfig, VaeNet, WanVae, WanVaeConfig};

/// The reference scales every VAE convolution's input by this for SDXL when no separate
/// VAE is given: the original SDXL VAE overflows f16.
const SDXL_VAE_CONV_SCALE: f32 = 1.0 / 32.0;

/// The first stage (AutoencoderKL or a Wan VAE, or the tiny autoencoder of the family's
/// latents when given and not for previews only) and the preview-only decoder, with the
/// reference's rules.
pub(super) fn build(ctx: &BuildCtx<'_>, place: Placement) -> Result<(Box<dyn FirstStage>, Option<Box<dyn FirstStage>>)> {
    let (params, weights, spec, n_threads) = (ctx.params, ctx.weights, ctx.spec, ctx.n_threads);
    // Without `eager_load` the first stage's weights are read when the first decode or encode
    // begins, as the reference prepares its weights: they are not resident while the text
    // encoders and the diffusion model run first (HunyuanVideo's VAE decoder is 1.7 GB).
    let place = place.loaded_at_first_use(!params.eager_load);
    let has_tae = weights.has_prefix(vae::tae::PREFIX);
    ensure!(!spec.tae_first_stage || has_tae, "{} models need their tiny autoencoder (taesd_path)", ctx.version.name());
    let tae_preview_only = params.tae_preview_only && !spec.tae_first_stage;
    let wan22 = spec.first_stage == FirstStageKind::Wan22;
    // The tiny autoencoder of the family's latents: TAESD-like for the KL families, the tiny
    // video autoencoder (TAEHV: taew2_1 / taew2_2) for the Wan VAEs'.
    let load_tiny = |decode_only: bool, place: Placement| -> Result<Box<dyn FirstStage>> {
        ensure!(spec.first_stage != FirstStageKind::Mage, "{} models have no tiny autoencoder (taesd_path)", ctx.version.name());
        if spec.first_stage != FirstStageKind::Kl {
            ensure!(spec.image_channels == 3, "{} models have no tiny autoencoder (taesd_path): TAEHV makes RGB pictures", ctx.version.name());
            let (time_scale, chunk) = spec.video().map_or((4, None), |v| (v.time_scale, v.tae_decode_chunk()));
            let cfg = TaehvConfig::for_latents(spec.latent.channels, spec.latent.vae_scale, time_scale, decode_only)
                .with_decode_chunk(chunk)
                .detect(vae::taehv::PREFIX, |n| weights.shape_of(n))?;
            return Ok(configure(weights.load_model(place, n_threads, vae::taehv::PREFIX, "TAE", |s| Taehv::new(s, &cfg))?, ctx));
        }
        let mut cfg = TaeConfig::detect(weights.types(), vae::tae::PREFIX, |n| weights.shape_of(n), decode_only);
        let file_channels = cfg.z_channels;
        if ctx.version.uses_flux2_vae() {
            cfg = cfg.into_flux2();
        }
        ensure!(
            file_channels == cfg.z_channels && cfg.latent_channels() as usize == spec.latent.channels,
            "the tiny autoencoder has {file_channels} latent channels, {} models use {}{}",
            ctx.version.name(),
            cfg.z_channels,
            if cfg.patch > 1 { " (TAEF2)" } else { "" }
        );
        Ok(configure(weights.load_model(place, n_threads, vae::tae::PREFIX, "TAE", |s| TinyAutoEncoder::new(s, &cfg))?, ctx))
    };
    if has_tae && !tae_preview_only {
        sd_info!("using TAE for encoding / decoding");
        return Ok((load_tiny(false, place)?, None));
    }
    sd_info!("using VAE for encoding / decoding");
    let first_stage = match spec.first_stage {
        FirstStageKind::Wan21 | FirstStageKind::Wan22 => {
            let prefix = vae::autoencoder_kl::PREFIX;
            ensure!(weights.has_prefix(&format!("{prefix}decoder.")), "{} needs its VAE (vae_path): no '{prefix}decoder.' weights", ctx.version.name());
            let cfg = WanVaeConfig::detect(&|n| weights.shape_of(n), prefix, false, spec.image_channels as i64, wan22);
            ensure!(
                cfg.z_dim as usize == spec.latent.channels && cfg.scale() == spec.latent.vae_scale,
                "the Wan VAE has {} latent channels at 1/{}, {} models use {} at 1/{}",
                cfg.z_dim,
                cfg.scale(),
                ctx.version.name(),
                spec.latent.channels,
                spec.latent.vae_scale
            );
            configure(weights.load_model(place.clone(), n_threads, prefix, "VAE", |s| WanVae::new(s, &cfg, &|n| weights.shape_of(n)))?, ctx)
        }
        FirstStageKind::Hunyuan => {
            let prefix = vae::hunyuan::PREFIX;
            ensure!(weights.has_prefix(&format!("{prefix}decoder.")), "{} needs its VAE (vae_path): no '{prefix}decoder.' weights", ctx.version.name());
            let has_encoder = weights.shape_of(&format!("{prefix}encoder.conv_in.conv.weight")).is_some();
            configure(weights.load_model(place.clone(), n_threads, prefix, "VAE", |s| HunyuanVae::new(s, &|n| weights.shape_of(n), has_encoder))?, ctx)
        }
        FirstStageKind::MinimaxH3 => {
            let prefix = vae::minimax_h3::PREFIX;
            ensure!(weights.has_prefix(&format!("{prefix}decoder.")), "{} needs its VAE (vae_path): no '{prefix}decoder.' weights", ctx.version.name());
            let mut v = weights.load_model(place.clone(), n_threads, prefix, "VAE", vae::minimax_h3::MinimaxH3Vae::new)?;
            v.runner.options.flash_attn = params.flash_attn;
            v.runner.options.conv_direct = params.vae_conv_direct;
            Box::new(v)
        }
        FirstStageKind::Ltx => {
            let prefix = vae::ltx::PREFIX;
            ensure!(weights.has_prefix(&format!("{prefix}decoder.")), "{} needs its VAE (vae_path): no '{prefix}decoder.' weights", ctx.version.name());
            let cfg = vae::ltx::LtxVaeConfig::detect(&|n| weights.shape_of(n), prefix)?;
            configure(weights.load_model(place.clone(), n_threads, prefix, "VAE", |s| vae::ltx::LtxVae::new(s, &cfg))?, ctx)
        }
        FirstStageKind::Mage => {
            let prefix = vae::mage::PREFIX;
            ensure!(weights.has_prefix(&format!("{prefix}pipeline.")), "{} needs its VAE (vae_path): no '{prefix}pipeline.' weights", ctx.version.name());
            configure(weights.load_model(place.clone(), n_threads, prefix, "VAE", MageVae::new)?, ctx)
        }
        FirstStageKind::Kl => {
            let prefix = vae::autoencoder_kl::PREFIX;
            let mut cfg = VaeConfig::detect(weights.types(), prefix, |n| weights.shape_of(n), spec.latent.scale_factor, false);
            cfg.shift_factor = spec.latent.shift_factor;
            cfg.z_channels = spec.latent.channels as i64;
            cfg.use_quant = spec.vae_quant_convs;
            // The family table has no fact for these two yet: Flux.2's patchified latents
            // (its 128 channels are 32 × 2×2) and instruct-pix2pix's unsampled latents.
            if ctx.version.uses_flux2_vae() {
                cfg = cfg.into_flux2();
            }
            cfg.leading_channels = spec.unencoded_channels;
            cfg.raw_encoder_latents = ctx.version == SdVersion::Sd1Pix2Pix;
            let conv_scale = (spec.defaults == crate::runtime::defaults::ModelFamily::Sdxl)
                && (params.vae_path.as_deref().unwrap_or("").is_empty() || params.force_sdxl_vae_conv_scale);
            let kl = weights.load_model(place.clone(), n_threads, prefix, "VAE", |s| {
                let mut m = AutoEncoderKL::new(s, &cfg);
                if conv_scale {
                    sd_warn!(
                        "No valid VAE specified with --vae or --force-sdxl-vae-conv-scale flag set, using Conv2D scale {:.3}",
                        SDXL_VAE_CONV_SCALE
                    );
                    m.set_conv2d_scale(SDXL_VAE_CONV_SCALE);
                }
                m
            })?;
            configure(kl, ctx)
        }
    };
    let preview = if has_tae {
        sd_info!("using TAE for preview");
        Some(load_tiny(true, place)?)
    } else {
        None
    };
    Ok((first_stage, preview))
}

/// The context's graph options on a loaded first stage, boxed for the pipeline.
fn configure<V: VaeNet + 'static>(mut v: Loaded<V>, ctx: &BuildCtx<'_>) -> Box<dyn FirstStage> {
    v.runner.options.flash_attn = ctx.params.flash_attn;
    v.runner.options.cpu_winograd = ctx.weights.winograd_for_decoding();
    v.runner.options.conv_direct = ctx.params.vae_conv_direct;
    Box::new(v)
}
