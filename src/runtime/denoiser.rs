//! Denoiser parameterisations: how a noise level (sigma) maps to the model's timestep, how
//! the network output becomes a denoised estimate (`denoised = out * c_out + x * c_skip`,
//! input scaled by `c_in`), how noise is mixed into a latent, and the sigma schedules.
//!
//! - CompVis EPS / V: discrete sigmas from the scaled-linear beta schedule (or the
//!   checkpoint's `alphas_cumprod`), timestep ↔ sigma by interpolating log sigma.
//! - EDM-V (CosXL): continuous sigma in [0.002, 120], t = log(sigma) / 4.
//! - Flow (SD3 style, shifted) and Flux flow (exponential time shift); SeFi's dual
//!   semantic/texture schedule; MiniT2I's x0-predicting linear flow.

use super::args::{parse_strict_bool, set_float, ExtraArgs};
use super::defaults::ModelFamily;
use super::schedulers::{flux_time_shift, scheduler_sigmas, ScheduleInput, TIMESTEPS};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::types::{Prediction, Scheduler};

/// Which parameterisation a [`Denoiser`] implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenoiserKind {
    /// CompVis, epsilon prediction.
    Eps,
    /// CompVis, v prediction.
    V,
    /// EDM v prediction (continuous sigma).
    EdmV,
    /// Discrete flow with SD3's time shift.
    Flow,
    /// Flow with Flux's exponential time shift.
    FluxFlow,
    /// SeFi-Image: Flux flow with separate semantic / texture schedules.
    SefiFlow,
    /// MiniT2I: predicts x0 directly, linear sigmas 1 → 0.
    MiniT2iFlow,
}

/// Output scalings of the denoiser at one sigma.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalings {
    pub c_skip: f32,
    pub c_out: f32,
    pub c_in: f32,
}

/// SeFi's per-step semantic and texture sigmas / timesteps (set by `get_sigmas`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SefiSchedule {
    pub sem_sigmas: Vec<f32>,
    pub tex_sigmas: Vec<f32>,
    pub sem_timesteps: Vec<f32>,
    pub tex_timesteps: Vec<f32>,
}

/// Channels of SeFi's latent that follow the semantic schedule (the rest are texture).
pub const SEFI_SEM_CHANNELS: usize = 16;

#[derive(Debug, Clone)]
pub struct Denoiser {
    kind: DenoiserKind,
    /// Discrete sigmas of timesteps 0..1000 and their logs (CompVis kinds).
    sigmas: Vec<f32>,
    log_sigmas: Vec<f32>,
    shift: f32,
    sefi_alpha: f32,
    sefi_delta_t: f32,
    sefi: SefiSchedule,
}

const SIGMA_DATA: f32 = 1.0;
const EDM_SIGMA_MIN: f32 = 0.002;
const EDM_SIGMA_MAX: f32 = 120.0;

/// The scaled-linear beta schedule of SD (beta from 0.00085 to 0.012 on a sqrt scale) as
/// cumulative alpha products, in f32 like the reference.
pub fn default_alphas_cumprod() -> Vec<f32> {
    let ls = 0.00085f32.sqrt();
    let le = 0.0120f32.sqrt();
    let amount = le - ls;
    let mut product = 1.0f32;
    (0..TIMESTEPS)
        .map(|i| {
            let beta = ls + amount * (i as f32 / (TIMESTEPS - 1) as f32);
            product *= 1.0 - beta * beta;
            product
        })
        .collect()
}

impl Denoiser {
    /// The denoiser for a resolved prediction type. `alphas_cumprod` is the checkpoint's
    /// table when it has one with 1000 entries (otherwise the default schedule is used).
    /// Flow kinds start with shift 3; call [`Denoiser::set_flow_shift`].
    /// (For LTX-AV the reference uses [`DenoiserKind::FluxFlow`] with flow prediction:
    /// construct it with [`Denoiser::with_kind`].)
    pub fn new(prediction: Prediction, alphas_cumprod: Option<&[f32]>) -> Denoiser {
        let kind = match prediction {
            Prediction::Eps => DenoiserKind::Eps,
            Prediction::V => DenoiserKind::V,
            Prediction::EdmV => DenoiserKind::EdmV,
            Prediction::Flow => DenoiserKind::Flow,
            Prediction::FluxFlow => DenoiserKind::FluxFlow,
            Prediction::SefiFlow => DenoiserKind::SefiFlow,
            Prediction::Minit2iFlow => DenoiserKind::MiniT2iFlow,
        };
        Self::with_kind(kind, alphas_cumprod)
    }

    pub fn with_kind(kind: DenoiserKind, alphas_cumprod: Option<&[f32]>) -> Denoiser {
        let mut d = Denoiser {
            kind,
            sigmas: Vec::new(),
            log_sigmas: Vec::new(),
            shift: 3.0,
            sefi_alpha: 1.0,
            sefi_delta_t: 0.1,
            sefi: SefiSchedule::default(),
        };
        if matches!(kind, DenoiserKind::Eps | DenoiserKind::V | DenoiserKind::EdmV) {
            let table = match alphas_cumprod {
                Some(a) if a.len() == TIMESTEPS => a.to_vec(),
                _ => default_alphas_cumprod(),
            };
            d.sigmas = table.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect();
            d.log_sigmas = d.sigmas.iter().map(|s| s.ln()).collect();
        }
        d
    }

    pub fn kind(&self) -> DenoiserKind {
        self.kind
    }

    /// A flow-matching denoiser in the reference's sense (the samplers' `is_flow`): flow,
    /// Flux flow and SeFi; MiniT2I is not.
    pub fn is_flow(&self) -> bool {
        matches!(self.kind, DenoiserKind::Flow | DenoiserKind::FluxFlow | DenoiserKind::SefiFlow)
    }

    /// Sets the flow shift: the request's value, else the model's default. No effect on
    /// non-flow denoisers.
    pub fn set_flow_shift(&mut self, flow_shift: Option<f32>, model_default: Option<f32>) {
        if self.is_flow() {
            if let Some(s) = flow_shift.or(model_default) {
                self.shift = s;
            }
        }
    }

    pub fn flow_shift(&self) -> f32 {
        self.shift
    }

    pub fn sigma_min(&self) -> f32 {
        match self.kind {
            DenoiserKind::Eps | DenoiserKind::V => self.sigmas[0],
            DenoiserKind::EdmV => EDM_SIGMA_MIN,
            DenoiserKind::Flow | DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => {
                self.t_to_sigma(0.0)
            }
            DenoiserKind::MiniT2iFlow => 0.0,
        }
    }

    pub fn sigma_max(&self) -> f32 {
        match self.kind {
            DenoiserKind::Eps | DenoiserKind::V => self.sigmas[TIMESTEPS - 1],
            DenoiserKind::EdmV => EDM_SIGMA_MAX,
            DenoiserKind::Flow | DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => {
                self.t_to_sigma((TIMESTEPS - 1) as f32)
            }
            DenoiserKind::MiniT2iFlow => 1.0,
        }
    }

    /// The model timestep for a noise level.
    pub fn sigma_to_t(&self, sigma: f32) -> f32 {
        match self.kind {
            DenoiserKind::Eps | DenoiserKind::V => self.discrete_sigma_to_t(sigma),
            DenoiserKind::EdmV => 0.25 * sigma.ln(),
            DenoiserKind::Flow => sigma * 1000.0,
            DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => sigma,
            DenoiserKind::MiniT2iFlow => 1.0 - sigma,
        }
    }

    /// The noise level of a (fractional) timestep.
    pub fn t_to_sigma(&self, t: f32) -> f32 {
        match self.kind {
            DenoiserKind::Eps | DenoiserKind::V => self.discrete_t_to_sigma(t),
            DenoiserKind::EdmV => (t * 4.0 / TIMESTEPS as f32).exp(),
            DenoiserKind::Flow => time_snr_shift(self.shift, (t + 1.0) / 1000.0),
            DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => {
                flux_time_shift(self.shift, 1.0, (t + 1.0) / TIMESTEPS as f32)
            }
            DenoiserKind::MiniT2iFlow => 1.0 - t,
        }
    }

    /// Fractional timestep whose interpolated log sigma equals log(sigma).
    fn discrete_sigma_to_t(&self, sigma: f32) -> f32 {
        let log_sigma = sigma.ln();
        let at_or_above =
            self.log_sigmas.iter().filter(|&&ls| log_sigma - ls >= 0.0).count() as i32;
        let low_idx = (at_or_above - 1).clamp(0, TIMESTEPS as i32 - 2) as usize;
        let high_idx = low_idx + 1;
        let low = self.log_sigmas[low_idx];
        let high = self.log_sigmas[high_idx];
        let w = ((low - log_sigma) / (low - high)).clamp(0.0, 1.0);
        (1.0 - w) * low_idx as f32 + w * high_idx as f32
    }

    fn discrete_t_to_sigma(&self, t: f32) -> f32 {
        let last = TIMESTEPS as f32 - 1.0;
        let low = t.floor().clamp(0.0, last);
        let high = t.ceil().clamp(0.0, last);
        let w = t - low;
        let log_sigma =
            (1.0 - w) * self.log_sigmas[low as usize] + w * self.log_sigmas[high as usize];
        log_sigma.exp()
    }

    /// Scalings of the network input and output at `sigma`.
    pub fn scalings(&self, sigma: f32) -> Scalings {
        let sd2 = SIGMA_DATA * SIGMA_DATA;
        match self.kind {
            DenoiserKind::Eps => {
                Scalings { c_skip: 1.0, c_out: -sigma, c_in: 1.0 / (sigma * sigma + sd2).sqrt() }
            }
            DenoiserKind::V | DenoiserKind::EdmV => Scalings {
                c_skip: sd2 / (sigma * sigma + sd2),
                c_out: -sigma * SIGMA_DATA / (sigma * sigma + sd2).sqrt(),
                c_in: 1.0 / (sigma * sigma + sd2).sqrt(),
            },
            DenoiserKind::Flow | DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => {
                Scalings { c_skip: 1.0, c_out: -sigma, c_in: 1.0 }
            }
            DenoiserKind::MiniT2iFlow => Scalings { c_skip: 0.0, c_out: 1.0, c_in: 1.0 },
        }
    }

    /// The noised latent the sampler starts from: `latent + noise * sigma`, for flows
    /// `latent * (1 - sigma) + noise * sigma`, for MiniT2I `noise * 2`.
    pub fn noise_scaling(&self, sigma: f32, noise: &Tensor, latent: &Tensor) -> Result<Tensor> {
        ensure!(
            noise.len() == latent.len(),
            "noise has {} values but the latent has {}",
            noise.len(),
            latent.len()
        );
        let out: Vec<f32> = match self.kind {
            DenoiserKind::Eps | DenoiserKind::V | DenoiserKind::EdmV => {
                latent.data().iter().zip(noise.data()).map(|(&l, &n)| l + n * sigma).collect()
            }
            DenoiserKind::Flow | DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => {
                let keep = 1.0 - sigma;
                latent
                    .data()
                    .iter()
                    .zip(noise.data())
                    .map(|(&l, &n)| l * keep + n * sigma)
                    .collect()
            }
            DenoiserKind::MiniT2iFlow => noise.data().iter().map(|&n| n * 2.0).collect(),
        };
        Tensor::from_vec(latent.shape(), out)
    }

    /// Undoes the flow's latent scaling after sampling (identity for other kinds).
    pub fn inverse_noise_scaling(&self, sigma: f32, latent: Tensor) -> Tensor {
        if self.is_flow() {
            let scale = 1.0 / (1.0 - sigma);
            latent.map(|v| v * scale)
        } else {
            latent
        }
    }

    /// The sigma of an img2img "noise level" (strength interpreted as relative noise).
    pub fn noise_level_to_sigma(&self, noise_level: f32) -> f32 {
        match self.kind {
            DenoiserKind::Eps | DenoiserKind::V | DenoiserKind::EdmV => {
                noise_level / (1.0 - noise_level)
            }
            DenoiserKind::Flow | DenoiserKind::FluxFlow | DenoiserKind::SefiFlow => noise_level,
            DenoiserKind::MiniT2iFlow => 1.0,
        }
    }

    /// The timestep fed to the model at `sigma`. With `shifted_timestep > 0` (SDXL only in
    /// the reference) the timestep is rescaled to that many training steps and rounded.
    /// Family-specific remaps (e.g. `t / 1000` for Anima) are the pipeline's.
    pub fn model_timestep(&self, sigma: f32, shifted_timestep: i32) -> f32 {
        let t = self.sigma_to_t(sigma);
        if shifted_timestep > 0 {
            let shifted = (t * (shifted_timestep as f32 / TIMESTEPS as f32)).round() as i64;
            return shifted.clamp(0, TIMESTEPS as i64 - 1) as f32;
        }
        t
    }

    /// The timesteps the model sees at `step` (1-based, as the samplers number their
    /// evaluations) when the sigma's timestep is `t`: `[t]`, except for SeFi, whose model
    /// takes the semantic and the texture timestep of that step of its dual schedule (the
    /// last one past its end), whatever the sigma.
    pub fn step_timesteps(&self, t: f32, step: i32) -> Vec<f32> {
        let s = &self.sefi;
        if self.kind != DenoiserKind::SefiFlow || s.tex_timesteps.is_empty() {
            return vec![t];
        }
        let i = ((step.max(1) - 1) as usize).min(s.tex_timesteps.len() - 1);
        vec![s.sem_timesteps[i], s.tex_timesteps[i]]
    }

    /// With a shifted timestep, the output scalings are those of the shifted timestep's
    /// sigma (c_skip corrected for the input scaling actually used).
    pub fn shifted_scalings(&self, shifted_timestep: i32, timestep: f32, s: Scalings) -> Scalings {
        if shifted_timestep <= 0 {
            return s;
        }
        let shifted_sigma = self.t_to_sigma(timestep.round() as i64 as f32);
        let sh = self.scalings(shifted_sigma);
        Scalings { c_skip: sh.c_skip * s.c_in / sh.c_in, c_out: sh.c_out, c_in: s.c_in }
    }

    /// The sigma schedule for `steps` steps. SeFi and MiniT2I have their own schedules and
    /// ignore `scheduler`.
    pub fn get_sigmas(
        &mut self,
        steps: u32,
        image_seq_len: i32,
        scheduler: Scheduler,
        family: ModelFamily,
        extra_args: &ExtraArgs,
    ) -> Result<Vec<f32>> {
        ensure!(steps > 0, "the number of sample steps must be at least 1");
        match self.kind {
            DenoiserKind::SefiFlow => Ok(self.sefi_sigmas(steps, extra_args)),
            DenoiserKind::MiniT2iFlow => {
                let mut s: Vec<f32> = (0..steps).map(|i| 1.0 - i as f32 / steps as f32).collect();
                s.push(0.0);
                Ok(s)
            }
            _ => {
                let t_to_sigma = |t: f32| self.t_to_sigma(t);
                let input = ScheduleInput {
                    sigma_min: self.sigma_min(),
                    sigma_max: self.sigma_max(),
                    t_to_sigma: &t_to_sigma,
                    image_seq_len,
                    family,
                    extra_args,
                };
                scheduler_sigmas(scheduler, steps, &input)
            }
        }
    }

    /// SeFi's schedules from the last `get_sigmas` (empty before).
    pub fn sefi_schedule(&self) -> &SefiSchedule {
        &self.sefi
    }

    /// Semantic and texture schedules: the semantic one runs `delta_t` ahead. Options
    /// `sefi_alpha` and `sefi_delta_t` persist across calls like the reference's.
    fn sefi_sigmas(&mut self, n: u32, extra_args: &ExtraArgs) -> Vec<f32> {
        const WHAT: &str = "sefi scheduler arg";
        for (key, value) in extra_args.pairs() {
            match key {
                "sefi_alpha" => set_float(&mut self.sefi_alpha, WHAT, key, value),
                "sefi_delta_t" => set_float(&mut self.sefi_delta_t, WHAT, key, value),
                _ => {}
            }
        }
        let (alpha, delta_t) = (self.sefi_alpha, self.sefi_delta_t);
        let last = TIMESTEPS as i32 - 1;
        let index = |u: f32| ((u * last as f32) as i32).clamp(0, last);
        let mut s = SefiSchedule::default();
        for i in 0..=n {
            let u = i as f32 / n as f32;
            let shifted = if alpha == 1.0 { u } else { (alpha * u) / (1.0 + (alpha - 1.0) * u) };
            let sem_raw = shifted * (1.0 + delta_t);
            let u_sem = sem_raw.min(1.0);
            let u_tex = (sem_raw - delta_t).clamp(0.0, 1.0);
            let t_sem = (TIMESTEPS as i32 - index(u_sem)) as f32;
            let t_tex = (TIMESTEPS as i32 - index(u_tex)) as f32;
            s.sem_timesteps.push(t_sem);
            s.tex_timesteps.push(t_tex);
            s.sem_sigmas.push(t_sem / TIMESTEPS as f32);
            s.tex_sigmas.push(t_tex / TIMESTEPS as f32);
        }
        sd_debug!(
            "SefiFlowDenoiser: built {}-step dual schedule (alpha={:.2} delta_t={:.2})",
            n,
            alpha,
            delta_t
        );
        self.sefi = s;
        self.sefi.tex_sigmas.clone()
    }

    /// The img2img part of a schedule: the last `t_enc + 1` steps, where
    /// `t_enc = steps * strength` (one step less at full strength), or, with the
    /// `strength_as_noise_level` option, starting at the first sigma at or below the
    /// strength's sigma (`force_first_sigma` replaces that first sigma by it).
    pub fn img2img_sigmas(
        &self,
        sigmas: &[f32],
        sample_steps: usize,
        strength: f32,
        extra_args: &ExtraArgs,
    ) -> Vec<f32> {
        let mut as_noise_level = false;
        let mut force_first_sigma = false;
        for (key, value) in extra_args.pairs() {
            let slot = match key {
                "strength_as_noise_level" => &mut as_noise_level,
                "force_first_sigma" => &mut force_first_sigma,
                _ => continue,
            };
            match parse_strict_bool(value) {
                Some(v) => *slot = v,
                None => sd_warn!("ignoring invalid img2img sample arg '{}={}'", key, value),
            }
        }
        if sigmas.len() < 2 {
            return sigmas.to_vec();
        }
        let mut target_sigma = -1.0f32;
        let t_enc = if !as_noise_level {
            let t = (sample_steps as f32 * strength) as usize;
            if t == sample_steps {
                t.saturating_sub(1)
            } else {
                t
            }
        } else {
            sd_debug!("Interpreting denoise strength as relative noise level");
            target_sigma = self.noise_level_to_sigma(strength);
            let start =
                sigmas.iter().position(|&s| s <= target_sigma).unwrap_or(0).min(sigmas.len() - 2);
            sample_steps.saturating_sub(start + 1)
        };
        sd_info!("target t_enc is {} steps", t_enc);
        let begin = sample_steps.saturating_sub(t_enc + 1).min(sigmas.len() - 2);
        let mut out = sigmas[begin..].to_vec();
        if target_sigma > 0.0 && force_first_sigma && as_noise_level {
            sd_debug!("force_first_sigma to {:.4} (from {:.4})", target_sigma, out[0]);
            out[0] = target_sigma;
        }
        out
    }
}

/// SD3's shift of the flow time: `alpha t / (1 + (alpha - 1) t)`.
pub fn time_snr_shift(alpha: f32, t: f32) -> f32 {
    if alpha == 1.0 {
        return t;
    }
    alpha * t / (1.0 + (alpha - 1.0) * t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compvis_table_and_round_trip() {
        let d = Denoiser::new(Prediction::Eps, None);
        assert!((d.sigma_min() - 0.029_167_5).abs() < 1e-6);
        assert!((d.sigma_max() - 14.614_65).abs() < 1e-4);
        for t in [0.0f32, 1.0, 17.25, 500.0, 998.5, 999.0] {
            let back = d.sigma_to_t(d.t_to_sigma(t));
            assert!((back - t).abs() < 2e-3, "{t} -> {back}");
        }
        // Outside the table the timestep clamps.
        assert_eq!(d.sigma_to_t(1000.0), 999.0);
        assert_eq!(d.sigma_to_t(1e-6), 0.0);
    }

    #[test]
    fn scalings_reconstruct_x0() {
        // For v: x = x0 + sigma n; v-target = (n - sigma x0) / sqrt(sigma²+1) scaled... check
        // that a perfect v prediction yields x0.
        let d = Denoiser::new(Prediction::V, None);
        let (x0, n, sigma) = (0.7f32, -1.3f32, 2.5f32);
        let x = x0 + sigma * n;
        let s = d.scalings(sigma);
        let c_in_x = x * s.c_in;
        let alpha = 1.0 / (sigma * sigma + 1.0).sqrt();
        let v = alpha * n - (sigma * alpha) * x0; // v = alpha*eps - sigma_t*x0 in scaled space
        let denoised = v * s.c_out + x * s.c_skip;
        assert!((denoised - x0).abs() < 1e-5, "{denoised} {c_in_x}");

        let e = Denoiser::new(Prediction::Eps, None);
        let s = e.scalings(sigma);
        assert!((n * s.c_out + x * s.c_skip - x0).abs() < 1e-5);

        let f = Denoiser::new(Prediction::Flow, None);
        let s = f.scalings(0.4);
        let xf = 0.6 * x0 + 0.4 * n;
        assert!(((n - x0) * s.c_out + xf * s.c_skip - x0).abs() < 1e-6);
    }

    #[test]
    fn flow_mappings() {
        let mut d = Denoiser::new(Prediction::Flow, None);
        d.set_flow_shift(None, Some(1.0));
        assert_eq!(d.t_to_sigma(999.0), 1.0);
        assert_eq!(d.sigma_to_t(0.5), 500.0);
        d.set_flow_shift(Some(3.0), Some(1.0));
        assert!((d.t_to_sigma(499.0) - 0.75).abs() < 1e-6);
        assert!(d.is_flow());
        assert!(!Denoiser::new(Prediction::Minit2iFlow, None).is_flow());
        let lat = Tensor::full(&[2], 1.0);
        let noise = Tensor::full(&[2], 3.0);
        let x = d.noise_scaling(0.25, &noise, &lat).unwrap();
        assert_eq!(x.data(), &[1.5, 1.5]);
        assert_eq!(d.inverse_noise_scaling(0.5, lat).data(), &[2.0, 2.0]);
        let mut flux = Denoiser::new(Prediction::FluxFlow, None);
        flux.set_flow_shift(Some(1.15), None);
        assert_eq!(flux.sigma_to_t(0.3), 0.3);
        assert!((flux.t_to_sigma(999.0) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn edm_v_mapping() {
        let d = Denoiser::new(Prediction::EdmV, None);
        assert_eq!((d.sigma_min(), d.sigma_max()), (0.002, 120.0));
        let t = d.sigma_to_t(5.0);
        assert!((t - 0.25 * 5f32.ln()).abs() < 1e-7);
        assert!((d.t_to_sigma(999.0) - 54.380_196).abs() < 1e-4);
    }

    #[test]
    fn shifted_timestep() {
        let d = Denoiser::new(Prediction::Eps, None);
        let sigma = d.t_to_sigma(800.0);
        let t = d.model_timestep(sigma, 500);
        assert_eq!(t, 400.0);
        let s = d.scalings(sigma);
        let sh = d.shifted_scalings(500, t, s);
        assert_eq!(sh.c_out, -d.t_to_sigma(400.0));
        assert_eq!(sh.c_in, s.c_in);
        assert_eq!(d.shifted_scalings(0, t, s), s);
    }

    #[test]
    fn sefi_and_minit2i_schedules() {
        let mut d = Denoiser::new(Prediction::SefiFlow, None);
        let tex = d.get_sigmas(4, 0, Scheduler::Discrete, ModelFamily::OtherDit, &ExtraArgs::default()).unwrap();
        assert_eq!(tex.len(), 5);
        let s = d.sefi_schedule();
        assert_eq!(s.tex_sigmas, tex);
        assert!(s.sem_sigmas.iter().zip(&s.tex_sigmas).all(|(a, b)| a <= b));
        // The model sees the step's pair of timesteps, not the sigma's; the last past the end.
        assert_eq!(d.step_timesteps(0.5, 1), vec![s.sem_timesteps[0], s.tex_timesteps[0]]);
        assert_eq!(d.step_timesteps(0.5, 2), vec![s.sem_timesteps[1], s.tex_timesteps[1]]);
        assert_eq!(d.step_timesteps(0.5, 9), vec![s.sem_timesteps[4], s.tex_timesteps[4]]);
        assert_eq!(Denoiser::new(Prediction::FluxFlow, None).step_timesteps(0.5, 2), vec![0.5]);
        let mut m = Denoiser::new(Prediction::Minit2iFlow, None);
        assert_eq!(
            m.get_sigmas(4, 0, Scheduler::Karras, ModelFamily::OtherDit, &ExtraArgs::default()).unwrap(),
            vec![1.0, 0.75, 0.5, 0.25, 0.0]
        );
    }

    #[test]
    fn img2img_slices_the_tail() {
        let d = Denoiser::new(Prediction::Eps, None);
        let sig = [10.0, 5.0, 2.0, 1.0, 0.0];
        assert_eq!(d.img2img_sigmas(&sig, 4, 0.5, &ExtraArgs::default()), vec![5.0, 2.0, 1.0, 0.0]);
        assert_eq!(d.img2img_sigmas(&sig, 4, 1.0, &ExtraArgs::default()), sig.to_vec());
        assert_eq!(d.img2img_sigmas(&sig, 4, 0.1, &ExtraArgs::default()), vec![1.0, 0.0]);
        // noise level 0.75 -> sigma 3: first sigma <= 3 is 2.0 (index 2)
        assert_eq!(
            d.img2img_sigmas(&sig, 4, 0.75, &ExtraArgs::parse(Some("strength_as_noise_level=1"))),
            vec![2.0, 1.0, 0.0]
        );
        assert_eq!(
            d.img2img_sigmas(
                &sig,
                4,
                0.75,
                &ExtraArgs::parse(Some("strength_as_noise_level=1,force_first_sigma=true"))
            ),
            vec![3.0, 1.0, 0.0]
        );
    }
}
