//! The defaults the reference picks when a request leaves the sampler, scheduler or eta
//! unset, as pure functions of the model family, its prediction and the sampler.

use crate::types::{Prediction, SampleMethod, Scheduler};

/// The model families whose sampling defaults or schedules differ. The pipeline maps its
/// detected model version onto one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// SD 1.x and its inpaint / pix2pix / tiny-UNet / SDXS-512 variants.
    Sd1,
    /// SD 2.x and its inpaint / tiny-UNet / SDXS-0.9 variants.
    Sd2,
    /// SDXL and its inpaint / pix2pix / SSD-1B / Vega variants.
    Sdxl,
    Svd,
    Flux,
    Flux2,
    /// LTX audio-video.
    Ltxav,
    Ideogram4,
    Pid,
    HidreamO1,
    /// Any other DiT (SD3, Wan, Qwen-Image, Z-Image, ...).
    OtherDit,
    /// Anything else (UNet models not listed above).
    Other,
}

impl ModelFamily {
    /// Transformer-based model (the reference's `sd_version_is_dit`).
    pub fn is_dit(self) -> bool {
        matches!(
            self,
            ModelFamily::Flux
                | ModelFamily::Flux2
                | ModelFamily::Ltxav
                | ModelFamily::Ideogram4
                | ModelFamily::Pid
                | ModelFamily::HidreamO1
                | ModelFamily::OtherDit
        )
    }
}

/// The sampler used when the request does not name one; `None` means no model is loaded.
pub fn default_sample_method(family: Option<ModelFamily>) -> SampleMethod {
    match family {
        Some(ModelFamily::Pid) => SampleMethod::Lcm,
        Some(f) if f.is_dit() => SampleMethod::Euler,
        _ => SampleMethod::EulerA,
    }
}

/// The scheduler used when the request does not name one. `model` is the loaded model's
/// family and resolved prediction (`None` without a model).
pub fn default_scheduler(
    model: Option<(ModelFamily, Prediction)>,
    method: SampleMethod,
) -> Scheduler {
    if let Some((_, Prediction::EdmV)) = model {
        return Scheduler::Exponential;
    }
    match (method, model.map(|m| m.0)) {
        (SampleMethod::Lcm | SampleMethod::Tcd, _) => Scheduler::Lcm,
        (SampleMethod::DdimTrailing, _) => Scheduler::Simple,
        (_, Some(ModelFamily::Flux)) => Scheduler::Flux,
        (_, Some(ModelFamily::Flux2)) => Scheduler::Flux2,
        (_, Some(ModelFamily::Ltxav)) => Scheduler::Ltx2,
        (_, Some(ModelFamily::Ideogram4)) => Scheduler::LogitNormal,
        _ => Scheduler::Discrete,
    }
}

/// The sampler's eta when the request leaves it unset (`None`, the C API's INFINITY).
pub fn resolve_eta(eta: Option<f32>, method: SampleMethod, family: ModelFamily) -> f32 {
    if let Some(eta) = eta {
        return eta;
    }
    if family == ModelFamily::HidreamO1 {
        return 8.0;
    }
    match method {
        SampleMethod::EulerA
        | SampleMethod::Dpmpp2sA
        | SampleMethod::ErSde
        | SampleMethod::EulerACfgPp
        | SampleMethod::Dpmpp2mSde
        | SampleMethod::Dpmpp2mSdeBt => 1.0,
        _ => 0.0,
    }
}

/// The C API's "unset" float (INFINITY) as an `Option`.
pub fn unset_if_infinite(v: f32) -> Option<f32> {
    (v != f32::INFINITY).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_reference() {
        assert_eq!(default_sample_method(None), SampleMethod::EulerA);
        assert_eq!(default_sample_method(Some(ModelFamily::Sd1)), SampleMethod::EulerA);
        assert_eq!(default_sample_method(Some(ModelFamily::Flux)), SampleMethod::Euler);
        assert_eq!(default_sample_method(Some(ModelFamily::Pid)), SampleMethod::Lcm);

        let sd1 = Some((ModelFamily::Sd1, Prediction::Eps));
        assert_eq!(default_scheduler(sd1, SampleMethod::EulerA), Scheduler::Discrete);
        assert_eq!(default_scheduler(sd1, SampleMethod::Lcm), Scheduler::Lcm);
        assert_eq!(default_scheduler(sd1, SampleMethod::Tcd), Scheduler::Lcm);
        assert_eq!(default_scheduler(sd1, SampleMethod::DdimTrailing), Scheduler::Simple);
        assert_eq!(
            default_scheduler(Some((ModelFamily::Sd1, Prediction::EdmV)), SampleMethod::Lcm),
            Scheduler::Exponential
        );
        assert_eq!(
            default_scheduler(Some((ModelFamily::Flux, Prediction::FluxFlow)), SampleMethod::Euler),
            Scheduler::Flux
        );
        assert_eq!(
            default_scheduler(
                Some((ModelFamily::Flux2, Prediction::FluxFlow)),
                SampleMethod::Euler
            ),
            Scheduler::Flux2
        );
        assert_eq!(
            default_scheduler(Some((ModelFamily::Ltxav, Prediction::Flow)), SampleMethod::Euler),
            Scheduler::Ltx2
        );
        assert_eq!(
            default_scheduler(
                Some((ModelFamily::Ideogram4, Prediction::Flow)),
                SampleMethod::Euler
            ),
            Scheduler::LogitNormal
        );
        assert_eq!(default_scheduler(None, SampleMethod::Euler), Scheduler::Discrete);

        assert_eq!(resolve_eta(None, SampleMethod::EulerA, ModelFamily::Sd1), 1.0);
        assert_eq!(resolve_eta(None, SampleMethod::DdimTrailing, ModelFamily::Sd1), 0.0);
        assert_eq!(resolve_eta(None, SampleMethod::Euler, ModelFamily::HidreamO1), 8.0);
        assert_eq!(resolve_eta(Some(0.3), SampleMethod::EulerA, ModelFamily::Sd1), 0.3);
        assert_eq!(unset_if_infinite(f32::INFINITY), None);
    }
}
