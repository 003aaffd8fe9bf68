//! IP-Adapter in the pipeline, a generation extension like the reference's
//! `compute_ip_adapter_tokens`: after the conditioning, the request's `ip_adapter_image` goes
//! through the CLIP vision tower (`clip_vision_path`) and the adapter's image projection
//! once; its tokens, and those of all-zero features for the negative passes, reach every UNet
//! evaluation with `ip_adapter_strength`. Without an image the UNet runs as it would without
//! an adapter.

use super::conditioning::clip_vision::ClipVision;
use super::extensions::{Conditioned, Extension};
use super::loader::Weights;
use crate::error::{Context as _, Result};
use crate::graph::{Component, Components, Loaded, Placement};
use crate::models::adapter::ip_adapter::{self, IpAdapter, IpAdapterConfig, IMAGE_PROJ_PREFIX};
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// The reference's CLIP-vision layer choices: the Plus adapters read the hidden states of the
/// penultimate layer (clip_skip 2), the plain ones the pooled projection of the last.
const PLUS_CLIP_SKIP: i32 = 2;
const PLAIN_CLIP_SKIP: i32 = -1;

/// A loaded IP-Adapter image projection and the CLIP vision tower it reads.
pub struct IpAdapterModel {
    net: Loaded<IpAdapter>,
    clip: ClipVision,
    /// The current request's tokens.
    tokens: Option<ImageTokens>,
}

/// The extension's name, which the field rule looks for.
pub const NAME: &str = "ip_adapter";

/// One request's image tokens: for the prompt's passes and for the negative ones (features
/// of zeros), with the strength the cross-attentions add them at.
struct ImageTokens {
    cond: Tensor,
    uncond: Tensor,
    strength: f32,
}

impl IpAdapterModel {
    /// The adapter in the context's files (an `ip_adapter_path` file joins them, its names
    /// converted for the model) for a UNet whose image attentions read `unet_width`-wide
    /// tokens (`None`: no attention of the model has image projections), with the CLIP
    /// vision tower of `clip_vision_path` placed at `clip_place`. Mismatching widths are
    /// refused here; the reference aborts in its first evaluation.
    pub fn load(weights: &Arc<Weights>, place: Placement, clip_place: Placement, n_threads: i32, unet_width: Option<i64>) -> Result<IpAdapterModel> {
        let cfg = IpAdapterConfig::detect(&|n| weights.shape_of(n), IMAGE_PROJ_PREFIX).context("init IP-Adapter failed")?;
        match unet_width {
            Some(w) => ensure!(
                w == cfg.token_width(),
                "the IP-Adapter makes {}-wide image tokens, the model's image attentions (to_k_ip) read {w}: the adapter is for another model",
                cfg.token_width()
            ),
            None => sd_warn!("no cross-attention of this model has IP-Adapter image projections (to_k_ip); the adapter's image tokens stay unread"),
        }
        let clip = ClipVision::load(weights, clip_place, n_threads, None, "IP-Adapter")?;
        let clip_cfg = clip.config();
        let (gives, what) = if cfg.is_plus() {
            (Some(clip_cfg.hidden_size), "hidden states")
        } else {
            (clip_cfg.projection_dim, "pooled projection (visual_projection)")
        };
        ensure!(
            gives == Some(cfg.input_width()),
            "the IP-Adapter reads {}-wide CLIP-vision {what}, the CLIP vision model (clip_vision_path) gives {}",
            cfg.input_width(),
            gives.map_or("none".to_string(), |w| format!("{w}-wide ones"))
        );
        sd_debug!("ip_adapter: {} image tokens of {} from {}-wide features", cfg.tokens(), cfg.token_width(), cfg.input_width());
        let net = weights.load_model(place, n_threads, IMAGE_PROJ_PREFIX, "ip_adapter", |s| IpAdapter::new(s, &cfg))?;
        Ok(IpAdapterModel { net, clip, tokens: None })
    }

    pub fn config(&self) -> &IpAdapterConfig {
        &self.net.model.config
    }

    /// The tokens of `image` (`[W, H, 3, 1]` in [0, 1]) and of zero features.
    fn tokens(&mut self, image: &Tensor, strength: f32) -> Result<ImageTokens> {
        let start = Instant::now();
        let features = if self.config().is_plus() {
            self.clip.encode_hidden(image, PLUS_CLIP_SKIP)?
        } else {
            self.clip.encode_pooled(image, PLAIN_CLIP_SKIP)?
        };
        let zeros = Tensor::zeros(features.shape());
        let (cond, uncond) = self.net.run_in_phase(|model, runner| {
            let cond = ip_adapter::compute(runner, model, &features).context("IP-Adapter conditional image projection failed")?;
            let uncond = ip_adapter::compute(runner, model, &zeros).context("IP-Adapter unconditional image projection failed")?;
            Ok((cond, uncond))
        })?;
        sd_info!("IP-Adapter: {} image tokens, strength {strength:.2}, taking {} ms", cond.ne(1), start.elapsed().as_millis());
        Ok(ImageTokens { cond, uncond, strength })
    }
}

impl Extension for IpAdapterModel {
    fn name(&self) -> &'static str {
        NAME
    }

    fn conditioned(&mut self, req: &Conditioned<'_>) -> Result<()> {
        self.tokens = None;
        if let Some(img) = &req.params.ip_adapter_image {
            let image = super::image::rgb_tensor(img, img.width as usize, img.height as usize)?;
            self.tokens = Some(self.tokens(&image, req.params.ip_adapter_strength)?);
        }
        Ok(())
    }

    fn image_tokens(&self, negative: bool) -> Option<(&Tensor, f32)> {
        self.tokens.as_ref().map(|t| (if negative { &t.uncond } else { &t.cond }, t.strength))
    }

    fn end_request(&mut self) {
        self.tokens = None;
    }
}

impl Components for IpAdapterModel {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        let mut v = self.clip.components();
        v.push(&mut self.net);
        v
    }
}
