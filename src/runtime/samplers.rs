//! The 21 samplers: ODE/SDE solvers that walk a latent down a sigma schedule, calling the
//! denoising model once or twice per step.
//!
//! Every update is written element by element in the same order of f32 operations as the
//! reference (scalars are rounded to f32 where it rounds them, C's double-precision `log`
//! and `exp` are used where it calls them on floats), so that with the same model outputs
//! and noise the result matches it bit for bit.
//!
//! The model callback returns the *denoised* estimate (guidance and the denoiser's
//! scalings already applied) and, for the CFG++ samplers, the unconditional one. Its step
//! argument follows the reference: `i + 1` for the call that completes step `i`, `-(i + 1)`
//! for an extra evaluation earlier in the same step (Heun, DPM2, DPM++ 2S, RES 2S). An
//! error from the callback (e.g. cancellation) ends sampling with that error.

use super::args::{parse_strict_float, parse_strict_int, ExtraArgs};
use super::denoiser::{Denoiser, DenoiserKind, SEFI_SEM_CHANNELS};
use super::rng::{Rng, StdDefaultRng};
use crate::error::{Context, Result};
use crate::tensor::Tensor;
use crate::types::SampleMethod;
use std::collections::HashMap;

/// What the model callback returns for one evaluation.
#[derive(Debug, Clone)]
pub struct ModelOutput {
    /// The guided denoised estimate.
    pub denoised: Tensor,
    /// The unconditional denoised estimate; required by the CFG++ samplers only.
    pub uncond_denoised: Option<Tensor>,
}

impl From<Tensor> for ModelOutput {
    fn from(denoised: Tensor) -> Self {
        ModelOutput { denoised, uncond_denoised: None }
    }
}

/// The denoising model as the samplers see it: `(x, sigma, step) -> denoised`.
pub type Model<'a> = dyn FnMut(&Tensor, f32, i32) -> Result<ModelOutput> + 'a;

/// Whether the sampler needs `uncond_denoised` from the model callback.
pub fn needs_uncond_denoised(method: SampleMethod) -> bool {
    matches!(method, SampleMethod::EulerCfgPp | SampleMethod::EulerACfgPp)
}

/// Samples `x` (already noised to `sigmas[0]`) down the schedule `sigmas`.
///
/// `rng` supplies ancestral / SDE noise, `eta` its amount (resolve unset values with
/// [`super::defaults::resolve_eta`]), `is_flow` selects the flow-matching variants
/// ([`Denoiser::is_flow`]), `extra_args` the request's `extra_sample_args`. `denoiser` is
/// needed for SeFi models, whose dual schedule replaces `sigmas` (any `method`); pass it
/// whenever available.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    method: SampleMethod,
    model: &mut Model,
    x: Tensor,
    sigmas: &[f32],
    rng: &mut dyn Rng,
    eta: f32,
    is_flow: bool,
    extra_args: &ExtraArgs,
    denoiser: Option<&Denoiser>,
) -> Result<Tensor> {
    if let Some(d) = denoiser.filter(|d| d.kind() == DenoiserKind::SefiFlow) {
        let s = d.sefi_schedule();
        return sefi_euler(model, x, &s.sem_sigmas, &s.tex_sigmas);
    }
    let mut s = Sampler { model, x, sigmas, rng, eta, is_flow };
    match method {
        SampleMethod::Euler => s.euler(),
        SampleMethod::EulerA | SampleMethod::DdimTrailing => s.euler_ancestral(),
        SampleMethod::Heun => s.heun(),
        SampleMethod::Dpm2 => s.dpm2(),
        SampleMethod::Dpmpp2sA if is_flow => s.dpmpp_2s_ancestral_flow(),
        SampleMethod::Dpmpp2sA => s.dpmpp_2s_ancestral(),
        SampleMethod::Dpmpp2m => s.dpmpp_2m(false),
        SampleMethod::Dpmpp2mV2 => s.dpmpp_2m(true),
        SampleMethod::Ipndm => s.ipndm(false),
        SampleMethod::IpndmV => s.ipndm(true),
        SampleMethod::Lcm => s.lcm(extra_args),
        SampleMethod::Tcd => s.tcd(),
        SampleMethod::ResMultistep => s.res_multistep(),
        SampleMethod::Res2s => s.res_2s(),
        SampleMethod::ErSde => s.er_sde(),
        SampleMethod::EulerCfgPp => s.euler_cfg_pp(),
        SampleMethod::EulerACfgPp => s.euler_ancestral_cfg_pp(),
        SampleMethod::EulerGe => s.gradient_estimation(extra_args),
        SampleMethod::Dpmpp2mSde => s.dpmpp_2m_sde(None),
        SampleMethod::Dpmpp2mSdeBt => s.dpmpp_2m_sde_bt(),
        SampleMethod::Lms => s.lms(extra_args),
    }?;
    Ok(s.x)
}

/// Splits a step from `sigma_from` to `sigma_to` into a deterministic part down to
/// `sigma_down` and fresh noise of std `sigma_up` (k-diffusion's ancestral step).
pub fn ancestral_step(sigma_from: f32, sigma_to: f32, eta: f32) -> (f32, f32) {
    if eta <= 0.0 {
        return (sigma_to, 0.0);
    }
    let from_sq = sigma_from * sigma_from;
    let to_sq = sigma_to * sigma_to;
    let mut up = 0.0f32;
    if from_sq > 0.0 {
        let term = to_sq * (from_sq - to_sq) / from_sq;
        up = sigma_to.min(eta * term.max(0.0).sqrt());
    }
    let down_sq = to_sq - up * up;
    let down = if down_sq > 0.0 { down_sq.sqrt() } else { 0.0 };
    (down, up)
}

/// The flow-matching ancestral step: `(sigma_down, sigma_up, alpha_scale)`; the latent is
/// rescaled by `alpha_scale` before the noise is added. eta is capped at 1.
pub fn ancestral_step_flow(sigma_from: f32, sigma_to: f32, eta: f32) -> (f32, f32, f32) {
    if eta <= 0.0 || sigma_from <= 0.0 || sigma_to <= 0.0 {
        return (sigma_to, 0.0, 1.0);
    }
    let eta = eta.min(1.0);
    let ratio = sigma_to / sigma_from;
    let down = (sigma_to * (1.0 + (ratio - 1.0) * eta)).min(sigma_to).max(0.0);
    let denom = 1.0f32 - down;
    if denom <= 0.0 {
        return (sigma_to, 0.0, 1.0);
    }
    let alpha_scale = (1.0 - sigma_to) / denom;
    let term = ((down / sigma_to) * alpha_scale).clamp(-1.0, 1.0);
    let up = sigma_to * (1.0 - term * term).max(0.0).sqrt();
    (down, up, alpha_scale)
}

fn ancestral_step_any(sigma_from: f32, sigma_to: f32, eta: f32, is_flow: bool) -> (f32, f32, f32) {
    if is_flow {
        ancestral_step_flow(sigma_from, sigma_to, eta)
    } else {
        let (down, up) = ancestral_step(sigma_from, sigma_to, eta);
        (down, up, 1.0)
    }
}

/// C's double-precision `log` on a float, rounded back.
fn c_log(v: f32) -> f32 {
    (v as f64).ln() as f32
}

/// `exp(v) - 1` with C's double-precision `exp` on a float, rounded once at the end.
fn c_exp_minus_one(v: f32) -> f32 {
    ((v as f64).exp() - 1.0) as f32
}

fn phi1(t: f32) -> f32 {
    if t.abs() < 1e-6 {
        return 1.0 + t * 0.5 + (t * t) / 6.0;
    }
    (t.exp() - 1.0) / t
}

fn phi2(t: f32) -> f32 {
    if t.abs() < 1e-6 {
        return 0.5 + t / 6.0 + (t * t) / 24.0;
    }
    (phi1(t) - 1.0) / t
}

/// Element-wise map over two same-length slices into a new vector.
fn zip_map(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
}

/// `(x - denoised) / sigma`: the ODE derivative.
fn derivative(x: &[f32], denoised: &[f32], sigma: f32) -> Vec<f32> {
    zip_map(x, denoised, |x, d| (x - d) / sigma)
}

struct Sampler<'s, 'm> {
    model: &'s mut Model<'m>,
    x: Tensor,
    sigmas: &'s [f32],
    rng: &'s mut dyn Rng,
    eta: f32,
    is_flow: bool,
}

impl Sampler<'_, '_> {
    fn steps(&self) -> usize {
        self.sigmas.len().saturating_sub(1)
    }

    fn call_full(&mut self, x: &Tensor, sigma: f32, step: i32) -> Result<ModelOutput> {
        let out = (self.model)(x, sigma, step)?;
        ensure!(
            out.denoised.len() == x.len(),
            "the model returned {} values for a latent of {}",
            out.denoised.len(),
            x.len()
        );
        Ok(out)
    }

    fn call(&mut self, x: &Tensor, sigma: f32, step: i32) -> Result<Vec<f32>> {
        Ok(self.call_full(x, sigma, step)?.denoised.into_data())
    }

    /// Evaluates the model at the current latent.
    fn call_x(&mut self, sigma: f32, step: i32) -> Result<Vec<f32>> {
        let x = std::mem::take(&mut self.x);
        let r = self.call(&x, sigma, step);
        self.x = x;
        r
    }

    fn with_shape(&self, data: Vec<f32>) -> Result<Tensor> {
        Tensor::from_vec(self.x.shape(), data)
    }

    fn set_x(&mut self, data: Vec<f32>) {
        let shape = self.x.shape().to_vec();
        self.x = Tensor::from_vec(&shape, data).expect("same length as the latent");
    }

    fn noise(&mut self) -> Vec<f32> {
        self.rng.randn(self.x.len())
    }

    /// `x += noise * scale` with fresh noise.
    fn add_noise(&mut self, scale: f32) {
        let noise = self.noise();
        for (x, n) in self.x.data_mut().iter_mut().zip(noise) {
            *x += n * scale;
        }
    }

    fn scale_x(&mut self, factor: f32) {
        for x in self.x.data_mut() {
            *x *= factor;
        }
    }

    /// `x += d * dt`.
    fn step_x(&mut self, d: &[f32], dt: f32) {
        for (x, &d) in self.x.data_mut().iter_mut().zip(d) {
            *x += d * dt;
        }
    }

    /// `x = x * a + d * b`.
    fn blend_x(&mut self, a: f32, d: &[f32], b: f32) {
        for (x, &d) in self.x.data_mut().iter_mut().zip(d) {
            *x = *x * a + d * b;
        }
    }

    fn euler(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let sigma = self.sigmas[i];
            let den = self.call_x(sigma, i as i32 + 1)?;
            let d = derivative(self.x.data(), &den, sigma);
            self.step_x(&d, self.sigmas[i + 1] - sigma);
        }
        Ok(())
    }

    fn euler_ancestral(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let (sigma, sigma_to) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(sigma, i as i32 + 1)?;
            if sigma_to == 0.0 {
                self.set_x(den);
            } else if self.eta == 0.0 {
                let ratio = sigma_to / sigma;
                self.blend_x(ratio, &den, (1.0 - ratio as f64) as f32);
            } else {
                let (down, up, alpha) = ancestral_step_any(sigma, sigma_to, self.eta, self.is_flow);
                let ratio = down / sigma;
                self.blend_x(ratio, &den, 1.0 - ratio);
                if up > 0.0 {
                    if self.is_flow {
                        self.scale_x(alpha);
                    }
                    self.add_noise(up);
                }
            }
        }
        Ok(())
    }

    fn heun(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(s, -(i as i32 + 1))?;
            let d = derivative(self.x.data(), &den, s);
            let dt = s_next - s;
            if s_next == 0.0 {
                self.step_x(&d, dt);
            } else {
                let x2 = self.with_shape(zip_map(self.x.data(), &d, |x, d| x + d * dt))?;
                let den2 = self.call(&x2, s_next, i as i32 + 1)?;
                let d_avg: Vec<f32> = d
                    .iter()
                    .zip(x2.data().iter().zip(&den2))
                    .map(|(&d, (&x2, &den2))| (d + (x2 - den2) / s_next) / 2.0)
                    .collect();
                self.step_x(&d_avg, dt);
            }
        }
        Ok(())
    }

    fn dpm2(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(s, -(i as i32 + 1))?;
            let d = derivative(self.x.data(), &den, s);
            if s_next == 0.0 {
                self.step_x(&d, s_next - s);
            } else {
                let mid = (0.5 * ((s as f64).ln() + (s_next as f64).ln())).exp() as f32;
                let (dt_1, dt_2) = (mid - s, s_next - s);
                let x2 = self.with_shape(zip_map(self.x.data(), &d, |x, d| x + d * dt_1))?;
                let den2 = self.call(&x2, mid, i as i32 + 1)?;
                let d2 = derivative(x2.data(), &den2, mid);
                self.step_x(&d2, dt_2);
            }
        }
        Ok(())
    }

    fn dpmpp_2s_ancestral(&mut self) -> Result<()> {
        let t_fn = |sigma: f32| -c_log(sigma);
        let sigma_fn = |t: f32| ((-t) as f64).exp() as f32;
        for i in 0..self.steps() {
            let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(s, -(i as i32 + 1))?;
            let (down, up) = ancestral_step(s, s_next, self.eta);
            if down == 0.0 {
                self.set_x(den);
            } else {
                let t = t_fn(s);
                let t_next = t_fn(down);
                let h = t_next - t;
                let sigma_s = sigma_fn(t + 0.5 * h);
                let a = sigma_s / sigma_fn(t);
                let b = c_exp_minus_one(-h * 0.5);
                let x2 = self.with_shape(zip_map(self.x.data(), &den, |x, d| x * a - d * b))?;
                let den2 = self.call(&x2, sigma_s, i as i32 + 1)?;
                let a = sigma_fn(t_next) / sigma_fn(t);
                let b = c_exp_minus_one(-h);
                for (x, &d) in self.x.data_mut().iter_mut().zip(&den2) {
                    *x = *x * a - d * b;
                }
            }
            if s_next > 0.0 {
                self.add_noise(up);
            }
        }
        Ok(())
    }

    fn dpmpp_2s_ancestral_flow(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let (sigma, sigma_to) = (self.sigmas[i], self.sigmas[i + 1]);
            // At sigma = 1 the midpoint coincides with the current point: reuse the first
            // evaluation instead of a second model call.
            let first_step = 1.0 - (sigma as f64) < 1e-6;
            let step = if first_step { i as i32 + 1 } else { -(i as i32 + 1) };
            let den = self.call_x(sigma, step)?;
            if sigma_to == 0.0 {
                self.set_x(den);
                continue;
            }
            let (down, up, alpha) = ancestral_step_flow(sigma, sigma_to, self.eta);
            let d_i = if first_step {
                den
            } else {
                // Midpoint in lambda = log((1 - sigma) / sigma), written to avoid the
                // singularity at sigma = 1.
                let exp_s = (((1.0 - sigma) / sigma) * ((1.0 - down) / down)).sqrt();
                let sigma_s = 1.0 / (exp_s + 1.0);
                let r = sigma_s / sigma;
                let u =
                    self.with_shape(zip_map(self.x.data(), &den, |x, d| x * r + d * (1.0 - r)))?;
                self.call(&u, sigma_s, i as i32 + 1)?
            };
            let r = down / sigma;
            self.blend_x(r, &d_i, 1.0 - r);
            if sigma_to > 0.0 && self.eta > 0.0 {
                let noise = self.noise();
                for (x, n) in self.x.data_mut().iter_mut().zip(noise) {
                    *x = *x * alpha + n * up;
                }
            }
        }
        Ok(())
    }

    /// DPM-Solver++(2M); `v2` uses the mean step size for the second-order correction.
    fn dpmpp_2m(&mut self, v2: bool) -> Result<()> {
        let t_fn = |sigma: f32| -c_log(sigma);
        let mut old_den: Vec<f32> = self.x.data().to_vec();
        for i in 0..self.steps() {
            let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(s, i as i32 + 1)?;
            let t = t_fn(s);
            let t_next = t_fn(s_next);
            let h = t_next - t;
            let a = s_next / s;
            if i == 0 || s_next == 0.0 {
                let b = c_exp_minus_one(-h);
                for (x, &d) in self.x.data_mut().iter_mut().zip(&den) {
                    *x = *x * a - d * b;
                }
            } else {
                let h_last = t - t_fn(self.sigmas[i - 1]);
                let (r, b) = if v2 {
                    let (h_min, h_max) = (h_last.min(h), h_last.max(h));
                    (h_max / h_min, c_exp_minus_one(-((h_max + h_min) / 2.0)))
                } else {
                    (h_last / h, c_exp_minus_one(-h))
                };
                let c_new = 1.0 + 1.0 / (2.0 * r);
                let c_old = 1.0 / (2.0 * r);
                for ((x, &d), &o) in self.x.data_mut().iter_mut().zip(&den).zip(&old_den) {
                    let dd = d * c_new - o * c_old;
                    *x = *x * a - dd * b;
                }
            }
            old_den = den;
        }
        Ok(())
    }

    /// DPM-Solver++(2M) SDE, midpoint variant. Noise comes from the generator, or from a
    /// Brownian tree for the `_bt` variant.
    fn dpmpp_2m_sde(&mut self, mut tree: Option<&mut BrownianTree>) -> Result<()> {
        let mut old_den: Option<Vec<f32>> = None;
        let mut h_last = 0.0f32;
        for i in 0..self.steps() {
            let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(s, i as i32 + 1)?;
            if s_next == 0.0 {
                self.x.data_mut().copy_from_slice(&den);
            } else {
                let t = -s.ln();
                let t_next = -s_next.ln();
                let h = t_next - t;
                let eta_h = self.eta * h;
                let a = s_next / s * (-eta_h).exp();
                let b = -(-h - eta_h).exp_m1();
                self.blend_x(a, &den, b);
                if let Some(old) = &old_den {
                    let c = 0.5 * b / (h_last / h);
                    for ((x, &d), &o) in self.x.data_mut().iter_mut().zip(&den).zip(old) {
                        *x += (d - o) * c;
                    }
                }
                if self.eta > 0.0 {
                    let scale = s_next * (-(-2.0 * eta_h).exp_m1()).sqrt();
                    let noise = match tree.as_deref_mut() {
                        Some(tree) => tree.increment(s as f64, s_next as f64),
                        None => self.noise(),
                    };
                    for (x, n) in self.x.data_mut().iter_mut().zip(noise) {
                        *x += n * scale;
                    }
                }
                h_last = h;
            }
            old_den = Some(den);
        }
        Ok(())
    }

    fn dpmpp_2m_sde_bt(&mut self) -> Result<()> {
        let positive = self.sigmas.iter().filter(|&&s| s > 0.0).map(|&s| s as f64);
        let sigma_max = positive.clone().fold(0.0f64, f64::max);
        let sigma_min = positive.fold(f64::INFINITY, f64::min);
        if sigma_max <= sigma_min {
            return Ok(());
        }
        // The tree's seed is the bit pattern of two draws from the sampler generator.
        let draw = self.rng.randn(2);
        let seed = draw[0].to_bits() as u64 | ((draw[1].to_bits() as u64) << 32);
        let mut tree = BrownianTree::new(self.x.len(), sigma_min, sigma_max, seed);
        self.dpmpp_2m_sde(Some(&mut tree))
    }

    fn lcm(&mut self, extra: &ExtraArgs) -> Result<()> {
        let mut clip_std = 0.0f32;
        let (mut scale_start, mut scale_end) = (1.0f32, 1.0f32);
        let (mut start_set, mut end_set) = (false, false);
        for (key, value) in extra.pairs() {
            let (slot, flag) = match key {
                "noise_clip_std" => (&mut clip_std, None),
                "noise_scale_start" => (&mut scale_start, Some(&mut start_set)),
                "noise_scale_end" => (&mut scale_end, Some(&mut end_set)),
                _ => continue,
            };
            match parse_strict_float(value) {
                Some(v) => {
                    *slot = v;
                    if let Some(f) = flag {
                        *f = true;
                    }
                }
                None => sd_warn!("ignoring invalid lcm extra sample arg '{}={}'", key, value),
            }
        }
        if start_set && !end_set {
            scale_end = scale_start;
        }
        let steps = self.steps();
        for i in 0..steps {
            let s_next = self.sigmas[i + 1];
            let den = self.call_x(self.sigmas[i], i as i32 + 1)?;
            self.set_x(den);
            if s_next > 0.0 {
                if self.is_flow {
                    self.scale_x(1.0 - s_next);
                }
                let mut noise = self.noise();
                if clip_std > 0.0 && !noise.is_empty() {
                    let n = noise.len() as f64;
                    let mean = noise.iter().map(|&v| v as f64).sum::<f64>() / n;
                    let var =
                        noise.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)).sum::<f64>()
                            / n;
                    let clip = clip_std * var.sqrt() as f32;
                    for v in &mut noise {
                        *v = if *v < -clip {
                            -clip
                        } else if clip < *v {
                            clip
                        } else {
                            *v
                        };
                    }
                }
                let t = if steps > 1 { i as f32 / (steps - 1) as f32 } else { 0.0 };
                let scale = scale_start + (scale_end - scale_start) * t;
                let amount = s_next * scale;
                for (x, n) in self.x.data_mut().iter_mut().zip(noise) {
                    *x += n * amount;
                }
            }
        }
        Ok(())
    }

    /// Improved PNDM (Adams-Bashforth up to 4th order on the ODE derivative); `variable`
    /// adapts the 2nd-order weights to uneven step sizes (ipndm_v).
    fn ipndm(&mut self, variable: bool) -> Result<()> {
        const MAX_ORDER: usize = 4;
        let mut hist: Vec<Vec<f32>> = Vec::new();
        for i in 0..self.steps() {
            let (sigma, sigma_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(sigma, i as i32 + 1)?;
            let d = derivative(self.x.data(), &den, sigma);
            let order = MAX_ORDER.min(i + 1);
            let dt = sigma_next - sigma;
            let n = hist.len();
            let step: Vec<f32> = match order {
                1 => d.clone(),
                2 if variable => {
                    let h_prev = sigma - self.sigmas[i - 1];
                    let ratio = dt / h_prev;
                    let w = 2.0 + ratio;
                    zip_map(&d, &hist[n - 1], |d, h1| (d * w - h1 * ratio) / 2.0)
                }
                2 => zip_map(&d, &hist[n - 1], |d, h1| (3.0 * d - h1) / 2.0),
                3 => d
                    .iter()
                    .zip(hist[n - 1].iter().zip(&hist[n - 2]))
                    .map(|(&d, (&h1, &h2))| (23.0 * d - 16.0 * h1 + 5.0 * h2) / 12.0)
                    .collect(),
                _ => d
                    .iter()
                    .zip(hist[n - 1].iter().zip(hist[n - 2].iter().zip(&hist[n - 3])))
                    .map(|(&d, (&h1, (&h2, &h3)))| {
                        (55.0 * d - 59.0 * h1 + 37.0 * h2 - 9.0 * h3) / 24.0
                    })
                    .collect(),
            };
            self.step_x(&step, dt);
            if hist.len() == MAX_ORDER - 1 {
                hist.remove(0);
            }
            hist.push(d);
        }
        Ok(())
    }

    fn res_multistep(&mut self) -> Result<()> {
        let t_fn = |sigma: f32| -sigma.ln();
        let mut old_den: Vec<f32> = self.x.data().to_vec();
        let mut old_sigma_down: Option<f32> = None;
        for i in 0..self.steps() {
            let (from, to) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(from, i as i32 + 1)?;
            let (down, up, alpha) = ancestral_step_any(from, to, self.eta, self.is_flow);
            match old_sigma_down {
                Some(old_down) if down != 0.0 => {
                    let t = t_fn(from);
                    let t_old = t_fn(old_down);
                    let t_next = t_fn(down);
                    let t_prev = t_fn(self.sigmas[i - 1]);
                    let h = t_next - t;
                    let c2 = (t_prev - t_old) / h;
                    let (p1, p2) = (phi1(-h), phi2(-h));
                    let finite_or_zero = |v: f32| if v.is_finite() { v } else { 0.0 };
                    let b1 = finite_or_zero(p1 - p2 / c2);
                    let b2 = finite_or_zero(p2 / c2);
                    let decay = (-h).exp();
                    for ((x, &d), &o) in self.x.data_mut().iter_mut().zip(&den).zip(&old_den) {
                        *x = *x * decay + (d * b1 + o * b2) * h;
                    }
                }
                _ => {
                    let d = derivative(self.x.data(), &den, from);
                    self.step_x(&d, down - from);
                }
            }
            if to > 0.0 && up > 0.0 {
                if self.is_flow {
                    self.scale_x(alpha);
                }
                self.add_noise(up);
            }
            old_den = den;
            old_sigma_down = Some(down);
        }
        Ok(())
    }

    fn res_2s(&mut self) -> Result<()> {
        const C2: f32 = 0.5;
        for i in 0..self.steps() {
            let (from, to) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(from, -(i as i32 + 1))?;
            let (down, up, alpha) = ancestral_step_any(from, to, self.eta, self.is_flow);
            if down == 0.0 || from == 0.0 {
                self.set_x(den);
            } else {
                let t = -from.ln();
                let h = -down.ln() - t;
                let a21 = C2 * phi1(-h * C2);
                let b2 = phi2(-h) / C2;
                let b1 = phi1(-h) - b2;
                let sigma_c2 = (-(t + h * C2)).exp();
                let eps1 = zip_map(&den, self.x.data(), |d, x0| d - x0);
                let k = h * a21;
                let x2 = self.with_shape(zip_map(self.x.data(), &eps1, |x0, e| x0 + e * k))?;
                let den2 = self.call(&x2, sigma_c2, i as i32 + 1)?;
                for ((x0, &e1), &d2) in self.x.data_mut().iter_mut().zip(&eps1).zip(&den2) {
                    let e2 = d2 - *x0;
                    *x0 += (e1 * b1 + e2 * b2) * h;
                }
            }
            if to > 0.0 && up > 0.0 {
                if self.is_flow {
                    self.scale_x(alpha);
                }
                self.add_noise(up);
            }
        }
        Ok(())
    }

    /// ER-SDE-Solver-3 (extended reverse-time SDE, 3 stages, numerical integrals over 200
    /// points); `eta` scales the noise (0 turns it off).
    fn er_sde(&mut self) -> Result<()> {
        const MAX_STAGE: usize = 3;
        const POINTS: i32 = 200;
        let is_flow = self.is_flow;
        let flow_sigma = |s: f32| s.clamp(1e-6, 1.0 - 1e-4);
        let lambda = |s: f32| {
            if is_flow {
                let s = flow_sigma(s);
                s / (1.0 - s).max(1e-6)
            } else {
                s.max(1e-6)
            }
        };
        let alpha = |s: f32| if is_flow { 1.0 - flow_sigma(s) } else { 1.0 };
        let scaler = |x: f32| {
            let x = x.max(0.0);
            x * (x.powf(0.3).exp() + 10.0)
        };
        let mut sigmas = self.sigmas.to_vec();
        if is_flow {
            let n = sigmas.len();
            for s in sigmas.iter_mut().take(n.saturating_sub(1)) {
                if *s > 1.0 {
                    *s = flow_sigma(*s);
                }
            }
        }
        let lambdas: Vec<f32> = sigmas.iter().map(|&s| lambda(s)).collect();
        let mut old_den: Option<Vec<f32>> = None;
        let mut old_den_d: Option<Vec<f32>> = None;
        for i in 0..self.steps() {
            let den = self.call_x(sigmas[i], i as i32 + 1)?;
            let stage = MAX_STAGE.min(i + 1);
            if sigmas[i + 1] == 0.0 {
                self.x.data_mut().copy_from_slice(&den);
            } else {
                let (ls, lt) = (lambdas[i], lambdas[i + 1]);
                let (alpha_s, alpha_t) = (alpha(sigmas[i]), alpha(sigmas[i + 1]));
                let (scaled_s, scaled_t) = (scaler(ls), scaler(lt));
                let r_alpha = if alpha_s > 0.0 { alpha_t / alpha_s } else { 0.0 };
                let r = if scaled_s > 0.0 { scaled_t / scaled_s } else { 0.0 };
                self.blend_x(r_alpha * r, &den, alpha_t * (1.0 - r));

                if let (true, Some(old)) = (stage >= 2, &old_den) {
                    let dt = lt - ls;
                    let step = -dt / POINTS as f32;
                    let third = stage >= 3 && old_den_d.is_some();
                    let (mut s, mut s_u) = (0.0f32, 0.0f32);
                    for p in 0..POINTS {
                        let pos = lt + p as f32 * step;
                        let scaled = scaler(pos);
                        if scaled <= 0.0 {
                            continue;
                        }
                        s += 1.0 / scaled;
                        if third {
                            s_u += (pos - ls) / scaled;
                        }
                    }
                    s *= step;
                    let denom_d = ls - lambdas[i - 1];
                    if denom_d.abs() > 1e-12 {
                        let coeff_d = alpha_t * (dt + s * scaled_t);
                        let den_d = zip_map(&den, old, |d, o| (d - o) / denom_d);
                        self.step_x(&den_d, coeff_d);
                        if let (true, Some(old_d)) = (third, &old_den_d) {
                            let denom_u = (ls - lambdas[i - 2]) * 0.5;
                            if denom_u.abs() > 1e-12 {
                                s_u *= step;
                                let coeff_u = alpha_t * (0.5 * dt * dt + s_u * scaled_t);
                                let den_u = zip_map(&den_d, old_d, |d, o| (d - o) / denom_u);
                                self.step_x(&den_u, coeff_u);
                            }
                        }
                        old_den_d = Some(den_d);
                    }
                }

                let noise_sq = lt * lt - ls * ls * r * r;
                if self.eta > 0.0 && noise_sq > 0.0 {
                    self.add_noise(alpha_t * noise_sq.max(0.0).sqrt());
                }
            }
            old_den = Some(den);
        }
        Ok(())
    }

    /// Trajectory Consistency Distillation sampling; `eta` is the stochastic `gamma`.
    fn tcd(&mut self) -> Result<()> {
        // The SD scaled-linear schedule in double precision (the timestep lookup grid).
        let (bs, be) = (0.00085f32.sqrt(), 0.0120f32.sqrt());
        let mut alphas_cumprod = Vec::with_capacity(1000);
        let mut grid = Vec::with_capacity(1000);
        for i in 0..1000 {
            let base = (bs + (be - bs) * (i as f32 / 999.0)) as f64;
            let prev = if i == 0 { 1.0 } else { alphas_cumprod[i - 1] };
            let a: f64 = prev * (1.0 - base * base);
            alphas_cumprod.push(a);
            grid.push(((1.0 - a) / a).sqrt());
        }
        let timestep_of = |s: f32| -> usize {
            let s = s as f64;
            let idx = grid.partition_point(|&g| g < s);
            if idx == 0 {
                return 0;
            }
            if idx == grid.len() {
                return grid.len() - 1;
            }
            if (grid[idx] - s).abs() < (grid[idx - 1] - s).abs() {
                idx
            } else {
                idx - 1
            }
        };
        for i in 0..self.steps() {
            let (sigma, sigma_to) = (self.sigmas[i], self.sigmas[i + 1]);
            let prev_t = timestep_of(sigma_to);
            let t_s =
                (((1.0 - self.eta) * prev_t as f32) as f64).floor().clamp(0.0, 999.0) as usize;
            let den = self.call_x(sigma, i as i32 + 1)?;
            let d = derivative(self.x.data(), &den, sigma);
            let alpha_prev = 1.0 / (sigma_to * sigma_to + 1.0);
            let alpha_s = alphas_cumprod[t_s] as f32;
            let beta_s = 1.0 - alpha_s;
            let c_den = (alpha_s / alpha_prev).sqrt();
            let c_d = (beta_s / alpha_prev).sqrt();
            self.set_x(zip_map(&den, &d, |den, d| den * c_den + d * c_d));
            if self.eta > 0.0 && sigma_to > 0.0 {
                let keep = (alpha_prev / alpha_s).sqrt();
                let amount = (1.0 / alpha_prev - 1.0 / alpha_s).sqrt();
                let noise = self.noise();
                for (x, n) in self.x.data_mut().iter_mut().zip(noise) {
                    *x = *x * keep + n * amount;
                }
            }
        }
        Ok(())
    }

    /// Linear multistep with the reference's options: `lms_max_order` (default 4),
    /// `lms_shift` (history offset, default 1) and `lms_divisions` (integration points of
    /// the coefficients, default 1000).
    fn lms(&mut self, extra: &ExtraArgs) -> Result<()> {
        let (mut divisions, mut max_order, mut shift) = (1000i32, 4i32, 1i32);
        for (key, value) in extra.pairs() {
            let apply: fn(i32) -> i32 = match key {
                "lms_max_order" => |v| v.max(1),
                "lms_shift" => |v| v.max(0),
                "lms_divisions" => |v| v,
                _ => continue,
            };
            let Some(v) = parse_strict_int(value) else {
                sd_warn!("ignoring invalid lms extra sample arg '{}={}'", key, value);
                continue;
            };
            match key {
                "lms_max_order" => max_order = apply(v),
                "lms_shift" => shift = apply(v),
                _ => divisions = apply(v),
            }
        }
        let steps = self.steps();
        let max_order = (max_order as usize).min(steps);
        sd_debug!(
            "linear multi-step sampler: lms_max_order = {}, lms_shift = {}, lms_divisions = {}",
            max_order,
            shift,
            divisions
        );
        let sigmas = self.sigmas;
        // Integral of the j-th Lagrange basis polynomial over [sigma_m, sigma_m+1]
        // (midpoint rule).
        let coeff = |order: usize, m: usize, j: usize| -> f32 {
            if divisions == 0 {
                return sigmas[m + 1] - sigmas[m];
            }
            let a = sigmas[m];
            let dx = (sigmas[m + 1] - a) / divisions as f32;
            let s = sigmas[m - j];
            let b0 = a + 0.5 * dx;
            let mut sum = 0.0f32;
            for h in 0..divisions.max(0) {
                let b = h as f32 * dx + b0;
                let mut prod = 1.0f32;
                for k in (0..order).filter(|&k| k != j) {
                    let t = sigmas[m - k];
                    prod *= (b - t) / (s - t);
                }
                sum += prod;
            }
            sum * dx
        };
        let mut hist: Vec<Vec<f32>> = Vec::new();
        for (i, &sigma) in sigmas.iter().enumerate().take(steps) {
            let den = self.call_x(sigma, i as i32 + 1)?;
            let order = max_order.min(i + 1);
            let coeffs: Vec<f32> = (0..order).map(|c| coeff(order, i, c)).collect();
            let d = derivative(self.x.data(), &den, sigma);
            self.step_x(&d, coeffs[0]);
            if max_order > 1 {
                let hist_size_p1 = hist.len() + 1;
                if i > 0 {
                    let hist_max = hist.len() - 1;
                    for c in 2..=order {
                        let idx = hist_max.min(hist_size_p1 - c + shift as usize);
                        let h = std::mem::take(&mut hist[idx]);
                        self.step_x(&h, coeffs[c - 1]);
                        hist[idx] = h;
                    }
                }
                if hist_size_p1 == max_order {
                    hist.remove(0);
                }
                hist.push(d);
            }
        }
        Ok(())
    }

    fn cfg_pp_outputs(&mut self, sigma: f32, step: i32) -> Result<(Vec<f32>, Vec<f32>)> {
        let x = std::mem::take(&mut self.x);
        let out = self.call_full(&x, sigma, step);
        self.x = x;
        let out = out?;
        let uncond =
            out.uncond_denoised.context("the CFG++ samplers need the unconditional prediction")?;
        ensure!(uncond.len() == self.x.len(), "the unconditional prediction has the wrong size");
        Ok((out.denoised.into_data(), uncond.into_data()))
    }

    fn euler_cfg_pp(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let (sigma, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let (den, uncond) = self.cfg_pp_outputs(sigma, i as i32 + 1)?;
            for ((x, &d), &u) in self.x.data_mut().iter_mut().zip(&den).zip(&uncond) {
                *x = d + ((*x - u) / sigma) * s_next;
            }
        }
        Ok(())
    }

    fn euler_ancestral_cfg_pp(&mut self) -> Result<()> {
        for i in 0..self.steps() {
            let (sigma, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
            let (den, uncond) = self.cfg_pp_outputs(sigma, i as i32 + 1)?;
            let (down, up) = ancestral_step(sigma, s_next, self.eta);
            for ((x, &d), &u) in self.x.data_mut().iter_mut().zip(&den).zip(&uncond) {
                *x = d + ((*x - u) / sigma) * down;
            }
            if s_next > 0.0 {
                self.add_noise(up);
            }
        }
        Ok(())
    }

    /// Gradient-estimation sampler (euler_ge): the derivative is extrapolated from the
    /// previous one with weight `gamma` (option `gamma`, default 2).
    fn gradient_estimation(&mut self, extra: &ExtraArgs) -> Result<()> {
        let mut gamma = 2.0f32;
        for (key, value) in extra.pairs().filter(|(k, _)| *k == "gamma") {
            match parse_strict_float(value) {
                Some(v) => {
                    sd_debug!("setting euler_ge gamma to {:.2}", v);
                    gamma = v;
                }
                None => sd_warn!("ignoring invalid euler_ge extra sample arg '{}={}'", key, value),
            }
        }
        let mut old_d: Option<Vec<f32>> = None;
        for i in 0..self.steps() {
            let (sigma, sigma_to) = (self.sigmas[i], self.sigmas[i + 1]);
            let den = self.call_x(sigma, i as i32 + 1)?;
            if sigma_to == 0.0 {
                self.set_x(den);
                continue;
            }
            let (down, up, alpha) = ancestral_step_any(sigma, sigma_to, self.eta, self.is_flow);
            let d = derivative(self.x.data(), &den, sigma);
            let dt = down - sigma;
            match &old_d {
                Some(old) => {
                    let d_bar = zip_map(&d, old, |d, o| d * gamma + o * (1.0 - gamma));
                    self.step_x(&d_bar, dt);
                }
                None => self.step_x(&d, dt),
            }
            old_d = Some(d);
            if up > 0.0 {
                if self.is_flow {
                    self.scale_x(alpha);
                }
                self.add_noise(up);
            }
        }
        Ok(())
    }
}

/// Euler on SeFi's dual schedule: the first 16 channels move along the semantic sigmas,
/// the others along the texture sigmas (the model sees the texture sigma).
fn sefi_euler(model: &mut Model, mut x: Tensor, sem: &[f32], tex: &[f32]) -> Result<Tensor> {
    ensure!(sem.len() == tex.len(), "SeFi schedule is inconsistent");
    let plane = x.ne(0) * x.ne(1);
    let channels = x.ne(2);
    for i in 0..tex.len().saturating_sub(1) {
        let (tex_cur, tex_next) = (tex[i], tex[i + 1]);
        if tex_cur <= 1e-9 {
            continue;
        }
        let out = model(&x, tex_cur, i as i32 + 1)?;
        ensure!(out.denoised.len() == x.len(), "the model returned a tensor of the wrong size");
        let dt_sem = sem[i + 1] - sem[i];
        let dt_tex = tex_next - tex_cur;
        for (idx, (xv, &d)) in x.data_mut().iter_mut().zip(out.denoised.data()).enumerate() {
            let velocity = (*xv - d) / tex_cur;
            let c = (idx / plane.max(1)) % channels.max(1);
            *xv += velocity * if c < SEFI_SEM_CHANNELS { dt_sem } else { dt_tex };
        }
    }
    Ok(x)
}

/// Brownian motion on [t_min, t_max] sampled lazily by bisection with seeded noise, so
/// increments are the same whatever the step count (torchsde's BrownianTree idea).
struct BrownianTree {
    len: usize,
    t_min: f64,
    t_max: f64,
    root_seed: u64,
    w_at_max: Vec<f32>,
    cache: HashMap<u64, Vec<f32>>,
}

const TREE_MAX_DEPTH: u32 = 24;

/// SplitMix64's finaliser over `v + salt`.
fn mix64(v: u64, salt: u64) -> u64 {
    let mut z = v.wrapping_add(salt);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn std_normal(len: usize, seed: u64) -> Vec<f32> {
    StdDefaultRng::new(seed).randn(len)
}

impl BrownianTree {
    fn new(len: usize, t_min: f64, t_max: f64, seed: u64) -> Self {
        let scale = ((t_max - t_min) as f32).sqrt();
        let w_at_max = std_normal(len, mix64(seed, 0xBF58_476D_1CE4_E5B9))
            .into_iter()
            .map(|v| v * scale)
            .collect();
        BrownianTree {
            len,
            t_min,
            t_max,
            root_seed: mix64(seed, 0x9E37_79B9_7F4A_7C15),
            w_at_max,
            cache: HashMap::new(),
        }
    }

    /// Unit-variance noise for the interval between `a` and `b`: (W(b) - W(a)) / sqrt|b - a|.
    fn increment(&mut self, sigma_a: f64, sigma_b: f64) -> Vec<f32> {
        let clamp = |t: f64| t.max(self.t_min).min(self.t_max);
        let a = clamp(sigma_a.min(sigma_b));
        let b = clamp(sigma_a.max(sigma_b));
        let wb = self.w(b);
        let wa = self.w(a);
        let span = (sigma_b - sigma_a).abs().max(1e-12) as f32;
        let inv = 1.0 / span.sqrt();
        zip_map(&wb, &wa, |b, a| (b - a) * inv)
    }

    fn w(&mut self, t: f64) -> Vec<f32> {
        if let Some(v) = self.cache.get(&t.to_bits()) {
            return v.clone();
        }
        let zero = vec![0.0f32; self.len];
        let w_max = self.w_at_max.clone();
        let v =
            self.bridge(self.t_min, self.t_max, &zero, &w_max, t, self.root_seed, TREE_MAX_DEPTH);
        self.cache.insert(t.to_bits(), v.clone());
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn bridge(
        &self,
        a: f64,
        c: f64,
        w_a: &[f32],
        w_c: &[f32],
        t: f64,
        seed: u64,
        depth: u32,
    ) -> Vec<f32> {
        if depth == 0 || c - a < 1e-9 {
            let alpha = if c > a { ((t - a) / (c - a)) as f32 } else { 0.5 };
            return zip_map(w_a, w_c, |wa, wc| wa * (1.0 - alpha) + wc * alpha);
        }
        let m = 0.5 * (a + c);
        let std_dev = ((c - m) * (m - a) / (c - a)).sqrt() as f32;
        let z = std_normal(self.len, seed);
        let w_m: Vec<f32> = w_a
            .iter()
            .zip(w_c)
            .zip(&z)
            .map(|((&wa, &wc), &z)| (wa + wc) * 0.5 + z * std_dev)
            .collect();
        if t == m {
            w_m
        } else if t < m {
            self.bridge(a, m, w_a, &w_m, t, mix64(seed, 1), depth - 1)
        } else {
            self.bridge(m, c, &w_m, w_c, t, mix64(seed, 2), depth - 1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::rng::new_rng;
    use crate::types::RngType;

    fn toy(
        calls: &mut Vec<(f32, i32)>,
    ) -> impl FnMut(&Tensor, f32, i32) -> Result<ModelOutput> + '_ {
        move |x: &Tensor, sigma: f32, step: i32| {
            calls.push((sigma, step));
            Ok(ModelOutput {
                denoised: x.map(|v| 0.8 * v),
                uncond_denoised: Some(x.map(|v| 0.7 * v)),
            })
        }
    }

    #[test]
    fn model_error_stops_sampling() {
        let mut n = 0;
        let mut model = |x: &Tensor, _s: f32, _i: i32| -> Result<ModelOutput> {
            n += 1;
            if n == 2 {
                bail!("cancelled");
            }
            Ok(x.clone().into())
        };
        let mut rng = new_rng(RngType::Cuda, 1);
        let r = sample(
            SampleMethod::Euler,
            &mut model,
            Tensor::full(&[2, 2], 1.0),
            &[3.0, 2.0, 1.0, 0.0],
            rng.as_mut(),
            0.0,
            false,
            &ExtraArgs::default(),
            None,
        );
        assert_eq!(r.unwrap_err().message(), "cancelled");
    }

    #[test]
    fn cfg_pp_needs_uncond() {
        let mut model =
            |x: &Tensor, _s: f32, _i: i32| -> Result<ModelOutput> { Ok(x.clone().into()) };
        let mut rng = new_rng(RngType::Cuda, 1);
        let r = sample(
            SampleMethod::EulerCfgPp,
            &mut model,
            Tensor::full(&[2], 1.0),
            &[1.0, 0.0],
            rng.as_mut(),
            0.0,
            false,
            &ExtraArgs::default(),
            None,
        );
        assert!(r.is_err());
        assert!(needs_uncond_denoised(SampleMethod::EulerACfgPp));
    }

    #[test]
    fn euler_on_a_linear_model_is_exact_in_closed_form() {
        // denoised = 0.8 x: dx/dsigma = 0.2 x / sigma, Euler: x *= 1 + 0.2 (s' - s) / s.
        let mut calls = Vec::new();
        let mut rng = new_rng(RngType::Cuda, 1);
        let sig = [4.0f32, 2.0, 1.0, 0.0];
        let out = sample(
            SampleMethod::Euler,
            &mut toy(&mut calls),
            Tensor::full(&[3], 1.0),
            &sig,
            rng.as_mut(),
            0.0,
            false,
            &ExtraArgs::default(),
            None,
        )
        .unwrap();
        let mut want = 1.0f32;
        for w in sig.windows(2) {
            want += ((want - 0.8 * want) / w[0]) * (w[1] - w[0]);
        }
        assert_eq!(out.data(), &[want; 3]);
        assert_eq!(calls, vec![(4.0, 1), (2.0, 2), (1.0, 3)]);
    }

    #[test]
    fn sefi_moves_semantic_and_texture_channels_on_their_own_schedules() {
        use crate::runtime::defaults::ModelFamily;
        use crate::types::{Prediction, Scheduler};
        let mut d = Denoiser::new(Prediction::SefiFlow, None);
        d.get_sigmas(2, 0, Scheduler::Discrete, ModelFamily::OtherDit, &ExtraArgs::default()).unwrap();
        let sched = d.sefi_schedule().clone();
        let mut calls = Vec::new();
        let mut rng = new_rng(RngType::Cuda, 1);
        // 1x1 spatial, 18 channels: 16 semantic + 2 texture.
        let x = Tensor::full(&[1, 1, 18, 1], 1.0);
        let out = sample(
            SampleMethod::EulerA,
            &mut toy(&mut calls),
            x,
            &[],
            rng.as_mut(),
            1.0,
            true,
            &ExtraArgs::default(),
            Some(&d),
        )
        .unwrap();
        let mut sem = 1.0f32;
        let mut tex = 1.0f32;
        for i in 0..2 {
            let t = sched.tex_sigmas[i];
            sem += ((sem - 0.8 * sem) / t) * (sched.sem_sigmas[i + 1] - sched.sem_sigmas[i]);
            tex += ((tex - 0.8 * tex) / t) * (sched.tex_sigmas[i + 1] - t);
        }
        assert_eq!(out.data()[0], sem);
        assert_eq!(out.data()[17], tex);
        assert_eq!(calls.len(), 2);
    }

    #[test]
    fn ancestral_steps() {
        let (down, up) = ancestral_step(2.0, 1.0, 1.0);
        assert!((down * down + up * up - 1.0).abs() < 1e-6);
        assert_eq!(ancestral_step(2.0, 1.0, 0.0), (1.0, 0.0));
        let (down, up, alpha) = ancestral_step_flow(0.8, 0.5, 1.0);
        assert!(down < 0.5 && up > 0.0 && alpha > 0.0);
        assert_eq!(ancestral_step_flow(0.8, 0.0, 1.0), (0.0, 0.0, 1.0));
    }

    #[test]
    fn brownian_tree_is_consistent() {
        let mut tree = BrownianTree::new(64, 0.1, 10.0, 1234);
        let a = tree.increment(10.0, 5.0);
        let b = tree.increment(5.0, 0.1);
        let whole = tree.increment(10.0, 0.1);
        // W(10) - W(0.1) = (W(10) - W(5)) + (W(5) - W(0.1)), each scaled by 1/sqrt(span).
        for i in 0..64 {
            let lhs = whole[i] * 9.9f32.sqrt();
            let rhs = a[i] * 5.0f32.sqrt() + b[i] * 4.9f32.sqrt();
            assert!((lhs - rhs).abs() < 1e-4, "{lhs} {rhs}");
        }
        let var = whole.iter().map(|v| v * v).sum::<f32>() / 64.0;
        assert!(var > 0.4 && var < 2.0, "{var}");
    }
}
