//! Sigma schedules: the 16 schedulers of the reference, each producing the list of noise
//! levels a sampler walks through (usually `steps + 1` values ending in 0).
//!
//! Arithmetic follows the reference's types (f32 unless it uses f64) so the schedules agree
//! with it to the last bit or close to it. Where the reference produces NaN or crashes
//! (Karras / exponential / GITS at one step, AYS for unsupported models) we return a
//! sensible schedule or an error instead.

// The published tables keep their printed digits (they parse to the same f32 values).
#![allow(clippy::excessive_precision)]

use super::args::{parse_strict_float, set_bool, set_float, ExtraArgs};
use super::defaults::ModelFamily;
use crate::error::Result;
use crate::types::Scheduler;

/// Number of discrete training timesteps of the diffusion models.
pub const TIMESTEPS: usize = 1000;
const T_MAX: f32 = (TIMESTEPS - 1) as f32;

/// What a scheduler may need from the denoiser and the request.
pub struct ScheduleInput<'a> {
    pub sigma_min: f32,
    pub sigma_max: f32,
    /// The denoiser's timestep → sigma map.
    pub t_to_sigma: &'a dyn Fn(f32) -> f32,
    /// Latent pixels of the image (`(h / vae_scale) * (w / vae_scale)`, times latent frames
    /// for video); used by the flux, flux2, ltx2 and logit-normal schedules.
    pub image_seq_len: i32,
    pub family: ModelFamily,
    /// The request's `extra_sample_args` (scheduler options are read from it).
    pub extra_args: &'a ExtraArgs,
}

/// The sigma schedule of `scheduler` for `steps` steps.
pub fn scheduler_sigmas(
    scheduler: Scheduler,
    steps: u32,
    input: &ScheduleInput,
) -> Result<Vec<f32>> {
    ensure!(steps > 0, "the number of sample steps must be at least 1");
    sd_info!("get_sigmas with {} scheduler", scheduler.name());
    let n = steps;
    let t2s = input.t_to_sigma;
    Ok(match scheduler {
        Scheduler::Discrete => discrete(n, t2s),
        Scheduler::Karras => karras(n, input.sigma_min, input.sigma_max),
        Scheduler::Exponential => exponential(n, input.sigma_min, input.sigma_max),
        Scheduler::Ays => ays(n, input.family)?,
        Scheduler::Gits => gits(n, input.sigma_max),
        Scheduler::SgmUniform => sgm_uniform(n, t2s),
        Scheduler::Simple => simple(n, t2s),
        Scheduler::Smoothstep => smoothstep(n, t2s),
        Scheduler::KlOptimal => kl_optimal(n, input.sigma_min, input.sigma_max),
        Scheduler::Lcm => lcm(n, t2s),
        Scheduler::BongTangent => bong_tangent(n, input.sigma_min, input.sigma_max),
        Scheduler::Ltx2 => Ltx2Options::parse(input.image_seq_len, input.extra_args).sigmas(n),
        Scheduler::LogitNormal => {
            LogitNormalOptions::parse(input.image_seq_len, input.extra_args).sigmas(n)
        }
        Scheduler::Flux2 => flux2(n, input.image_seq_len),
        Scheduler::Flux => FluxOptions::parse(input.extra_args).sigmas(n, input.image_seq_len),
        Scheduler::Beta => BetaOptions::parse(input.extra_args).sigmas(n, t2s),
    })
}

/// `num` evenly spaced values from `start` to `end`, accumulated step by step in f32 like
/// the reference (so the last value may miss `end` by rounding).
fn accumulated_linspace(start: f32, end: f32, num: usize) -> Vec<f32> {
    let inc = (end - start) / num.wrapping_sub(1) as f32;
    let mut out = Vec::with_capacity(num);
    let mut v = start;
    for i in 0..num {
        if i > 0 {
            v += inc;
        }
        out.push(v);
    }
    out
}

/// Resamples a descending sigma list to `new_len` values, interpolating linearly in log
/// space (f64), as the reference does for AYS and long GITS schedules.
fn log_linear_resample(sigmas: &[f32], new_len: usize) -> Vec<f32> {
    let len = sigmas.len();
    let ref_x = accumulated_linspace(0.0, 1.0, len);
    let ref_y: Vec<f32> = sigmas.iter().rev().map(|s| s.ln()).collect();
    let mut new_x = accumulated_linspace(0.0, 1.0, new_len);
    if let (Some(first), Some(&lo)) = (new_x.first_mut(), ref_x.first()) {
        *first = first.max(lo);
    }
    if let (Some(last), Some(&hi)) = (new_x.last_mut(), ref_x.last()) {
        *last = last.min(hi);
    }
    let mut new_y = vec![0f64; new_len];
    let mut j = 0;
    for (i, &x) in new_x.iter().enumerate() {
        while j + 2 < len && !(ref_x[j] <= x && x <= ref_x[j + 1]) {
            j += 1;
        }
        let perc = (x - ref_x[j]) as f64 / (ref_x[j + 1] - ref_x[j]) as f64;
        new_y[i] = ref_y[j] as f64 * (1.0 - perc) + ref_y[j + 1] as f64 * perc;
    }
    new_y.iter().rev().map(|y| y.exp() as f32).collect()
}

fn discrete(n: u32, t2s: &dyn Fn(f32) -> f32) -> Vec<f32> {
    if n == 1 {
        return vec![t2s(T_MAX), 0.0];
    }
    let step = T_MAX / (n - 1) as f32;
    let mut out: Vec<f32> = (0..n).map(|i| t2s(T_MAX - step * i as f32)).collect();
    out.push(0.0);
    out
}

fn karras(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    if n == 1 {
        // The reference divides by zero here and returns NaN.
        return vec![sigma_max, 0.0];
    }
    let rho = 7.0f32;
    let sigma_min = if sigma_min <= 1e-6 { 1e-6 } else { sigma_min };
    let min_inv_rho = (sigma_min as f64).powf((1.0 / rho) as f64) as f32;
    let max_inv_rho = (sigma_max as f64).powf((1.0 / rho) as f64) as f32;
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let base = max_inv_rho + i as f32 / (n as f32 - 1.0) * (min_inv_rho - max_inv_rho);
            (base as f64).powf(rho as f64) as f32
        })
        .collect();
    out.push(0.0);
    out
}

fn exponential(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    if n == 1 {
        // The reference divides by zero here and returns NaN.
        return vec![sigma_max, 0.0];
    }
    let log_min = sigma_min.ln();
    let log_max = sigma_max.ln();
    let step = (log_max - log_min) / (n - 1) as f32;
    let mut out: Vec<f32> = (0..n).map(|i| (log_max - step * i as f32).exp()).collect();
    out.push(0.0);
    out
}

/// Align-Your-Steps reference noise levels (NVIDIA's published tables).
#[rustfmt::skip]
const AYS_SD15: [f32; 11] = [
    14.614_641_229_3, 6.474_576_095_6, 3.863_674_598_5, 2.694_615_152_0, 1.884_192_117_7,
    1.394_380_509_2, 0.964_258_390_4, 0.652_368_601_6, 0.397_745_627_2, 0.151_523_266_2,
    0.029_167_158_2,
];
#[rustfmt::skip]
const AYS_SDXL: [f32; 11] = [
    14.614_641_229_3, 6.318_448_528_7, 3.768_179_031_5, 2.181_148_076_9, 1.340_524_494_5,
    0.862_072_114_1, 0.555_069_328_9, 0.379_854_070_8, 0.233_236_413_4, 0.111_418_817_7,
    0.029_167_158_2,
];
#[rustfmt::skip]
const AYS_SVD: [f32; 11] = [700.00, 54.5, 15.886, 7.977, 4.248, 1.789, 0.981, 0.403, 0.173, 0.034, 0.002];

fn ays(n: u32, family: ModelFamily) -> Result<Vec<f32>> {
    let levels: &[f32] = match family {
        ModelFamily::Sd1 => {
            sd_info!("AYS_SCHEDULER using SD1.5 noise levels");
            &AYS_SD15
        }
        ModelFamily::Sd2 => {
            // The reference warns and then reads an empty table (undefined behaviour); the
            // SD1.5 levels are the closest meaningful choice.
            sd_warn!("AYS_SCHEDULER not designed for SD2.X models");
            &AYS_SD15
        }
        ModelFamily::Sdxl => {
            sd_info!("AYS_SCHEDULER using SDXL noise levels");
            &AYS_SDXL
        }
        ModelFamily::Svd => {
            sd_info!("AYS_SCHEDULER using SVD noise levels");
            &AYS_SVD
        }
        _ => bail!("Version not compatible with AYS_SCHEDULER scheduler"),
    };
    let len = n as usize + 1;
    let mut out =
        if len == levels.len() { levels.to_vec() } else { log_linear_resample(levels, len) };
    out[n as usize] = 0.0;
    Ok(out)
}

/// GITS schedules for coefficient 1.20 (the only one the reference uses) and 2..=20 steps;
/// row k has k + 3 sigmas. Values from the GITS paper's released tables.
#[rustfmt::skip]
const GITS_1_20: [&[f32]; 19] = [
    &[14.61464119, 0.803307, 0.02916753],
    &[14.61464119, 1.56271636, 0.52423614, 0.02916753],
    &[14.61464119, 2.36326075, 0.92192322, 0.36617002, 0.02916753],
    &[14.61464119, 2.84484982, 1.24153244, 0.59516323, 0.25053367, 0.02916753],
    &[14.61464119, 5.85520077, 2.05039096, 0.95350921, 0.45573691, 0.17026083, 0.02916753],
    &[14.61464119, 5.85520077, 2.45070267, 1.24153244, 0.64427125, 0.29807833, 0.09824532, 0.02916753],
    &[14.61464119, 5.85520077, 2.45070267, 1.36964464, 0.803307, 0.45573691, 0.25053367, 0.09824532, 0.02916753],
    &[14.61464119, 5.85520077, 2.84484982, 1.61558151, 0.95350921, 0.59516323, 0.36617002, 0.19894916, 0.09824532, 0.02916753],
    &[14.61464119, 5.85520077, 2.84484982, 1.67050016, 1.08895338, 0.74807048, 0.50118381, 0.32104823, 0.19894916, 0.09824532, 0.02916753],
    &[14.61464119, 5.85520077, 2.95596409, 1.84880662, 1.24153244, 0.83188516, 0.59516323, 0.41087446, 0.27464288, 0.17026083, 0.09824532, 0.02916753],
    &[14.61464119, 5.85520077, 3.07277966, 1.98035145, 1.36964464, 0.95350921, 0.69515091, 0.50118381, 0.36617002, 0.25053367, 0.17026083, 0.09824532, 0.02916753],
    &[14.61464119, 6.77309084, 3.46139455, 2.36326075, 1.56271636, 1.08895338, 0.803307, 0.59516323, 0.45573691, 0.34370604, 0.25053367, 0.17026083, 0.09824532, 0.02916753],
    &[14.61464119, 6.77309084, 3.46139455, 2.45070267, 1.61558151, 1.162866, 0.86115354, 0.64427125, 0.50118381, 0.38853383, 0.29807833, 0.22545385, 0.17026083, 0.09824532, 0.02916753],
    &[14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.12350607, 1.51179266, 1.08895338, 0.83188516, 0.64427125, 0.50118381, 0.38853383, 0.29807833, 0.22545385, 0.17026083, 0.09824532, 0.02916753],
    &[14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.12350607, 1.51179266, 1.08895338, 0.83188516, 0.64427125, 0.50118381, 0.41087446, 0.32104823, 0.25053367, 0.19894916, 0.13792117, 0.09824532, 0.02916753],
    &[14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.12350607, 1.51179266, 1.08895338, 0.83188516, 0.64427125, 0.50118381, 0.41087446, 0.34370604, 0.27464288, 0.22545385, 0.17026083, 0.13792117, 0.09824532, 0.02916753],
    &[14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.19988537, 1.61558151, 1.20157266, 0.92192322, 0.72133851, 0.57119018, 0.45573691, 0.36617002, 0.29807833, 0.25053367, 0.19894916, 0.17026083, 0.13792117, 0.09824532, 0.02916753],
    &[14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.19988537, 1.61558151, 1.24153244, 0.95350921, 0.74807048, 0.59516323, 0.4783645, 0.38853383, 0.32104823, 0.27464288, 0.22545385, 0.19894916, 0.17026083, 0.13792117, 0.09824532, 0.02916753],
    &[14.61464119, 7.49001646, 4.65472794, 3.07277966, 2.19988537, 1.61558151, 1.24153244, 0.95350921, 0.74807048, 0.59516323, 0.50118381, 0.41087446, 0.34370604, 0.29807833, 0.25053367, 0.22545385, 0.19894916, 0.17026083, 0.13792117, 0.09824532, 0.02916753],
];

fn gits(n: u32, sigma_max: f32) -> Vec<f32> {
    if sigma_max <= 0.0 {
        return Vec::new();
    }
    let longest = GITS_1_20[GITS_1_20.len() - 1];
    let mut out = match n {
        // The reference indexes before the table here and crashes.
        1 => vec![longest[0], 0.0],
        2..=20 => GITS_1_20[n as usize - 2].to_vec(),
        _ => log_linear_resample(longest, n as usize + 1),
    };
    out[n as usize] = 0.0;
    out
}

fn sgm_uniform(n: u32, t2s: &dyn Fn(f32) -> f32) -> Vec<f32> {
    let ts = accumulated_linspace(T_MAX, 0.0, n as usize + 1);
    let mut out: Vec<f32> = ts[..n as usize].iter().map(|&t| t2s(t)).collect();
    out.push(0.0);
    out
}

fn simple(n: u32, t2s: &dyn Fn(f32) -> f32) -> Vec<f32> {
    let step_factor = TIMESTEPS as f32 / n as f32;
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let offset = (i as f32 * step_factor) as i32;
            let t = (TIMESTEPS as i32 - 1 - offset).max(0);
            t2s(t as f32)
        })
        .collect();
    out.push(0.0);
    out
}

fn smoothstep(n: u32, t2s: &dyn Fn(f32) -> f32) -> Vec<f32> {
    if n == 1 {
        return vec![t2s(T_MAX), 0.0];
    }
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let u = 1.0f32 - i as f32 / n as f32;
            let s = u * u * (3.0f32 - 2.0 * u);
            t2s((s * T_MAX).round())
        })
        .collect();
    out.push(0.0);
    out
}

fn kl_optimal(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    if n == 1 {
        return vec![sigma_max, 0.0];
    }
    let sigma_min = if sigma_min <= 1e-6 { 1e-6 } else { sigma_min };
    let alpha_min = sigma_min.atan();
    let alpha_max = sigma_max.atan();
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let t = i as f32 / (n - 1) as f32;
            (t * alpha_min + (1.0 - t) * alpha_max).tan()
        })
        .collect();
    out.push(0.0);
    out
}

fn lcm(n: u32, t2s: &dyn Fn(f32) -> f32) -> Vec<f32> {
    const ORIGINAL_STEPS: u32 = 50;
    let k = TIMESTEPS as u32 / ORIGINAL_STEPS;
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            // Integer rounding keeps the timesteps on the LCM training grid.
            let index = (i * ORIGINAL_STEPS) / n;
            let t = (ORIGINAL_STEPS - index) as i32 * k as i32 - 1;
            t2s(t as f32)
        })
        .collect();
    out.push(0.0);
    out
}

const PI_F32: f32 = std::f32::consts::PI;

/// One arctangent-shaped stage of the bong_tangent schedule, from `start` to `end`.
fn bong_tangent_stage(steps: i32, slope: f32, pivot: f32, start: f32, end: f32) -> Vec<f32> {
    if steps <= 0 {
        return Vec::new();
    }
    let curve = |x: f32| ((2.0f32 / PI_F32) * (-slope * (x - pivot)).atan() + 1.0) * 0.5;
    let smax = curve(0.0);
    let smin = curve((steps - 1) as f32);
    let srange = smax - smin;
    let sscale = start - end;
    if srange.abs() < 1e-8 {
        if steps == 1 {
            return vec![start];
        }
        return (0..steps)
            .map(|i| start + (end - start) * (i as f32 / (steps - 1) as f32))
            .collect();
    }
    let inv_srange = 1.0f32 / srange;
    (0..steps).map(|x| ((curve(x as f32) - smin) * inv_srange) * sscale + end).collect()
}

fn bong_tangent(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    let (start, end) = (sigma_max, sigma_min);
    let middle = sigma_min + (sigma_max - sigma_min) * 0.5;
    let (pivot_1, pivot_2) = (0.6f32, 0.6f32);
    let steps = n as i32 + 2;
    let midpoint = ((steps as f32 * pivot_1 + steps as f32 * pivot_2) * 0.5) as i32;
    let pivot_1_i = (steps as f32 * pivot_1) as i32;
    let pivot_2_i = (steps as f32 * pivot_2) as i32;
    let slope_scale = steps as f32 / 40.0;
    let slope_1 = 0.2f32 / slope_scale;
    let slope_2 = 0.2f32 / slope_scale;
    let stage_2_len = steps - midpoint;
    let stage_1_len = steps - stage_2_len;

    let mut out = bong_tangent_stage(stage_1_len, slope_1, pivot_1_i as f32, start, middle);
    out.pop();
    out.extend(bong_tangent_stage(
        stage_2_len,
        slope_2,
        (pivot_2_i - stage_1_len) as f32,
        middle,
        end,
    ));
    out.resize(n as usize + 1, end);
    out[n as usize] = 0.0;
    out
}

/// Options of the LTX-2 schedule (`max_shift`, `base_shift`, `terminal`, `stretch`).
struct Ltx2Options {
    token_count: i32,
    max_shift: f32,
    base_shift: f32,
    stretch: bool,
    terminal: f32,
}

impl Ltx2Options {
    fn parse(image_seq_len: i32, extra_args: &ExtraArgs) -> Self {
        let mut o = Ltx2Options {
            token_count: if image_seq_len > 0 { image_seq_len } else { 4096 },
            max_shift: 2.05,
            base_shift: 0.95,
            stretch: true,
            terminal: 0.1,
        };
        const WHAT: &str = "ltx2 scheduler arg";
        for (key, value) in extra_args.pairs() {
            match key {
                "max_shift" => set_float(&mut o.max_shift, WHAT, key, value),
                "base_shift" => set_float(&mut o.base_shift, WHAT, key, value),
                "terminal" => set_float(&mut o.terminal, WHAT, key, value),
                "stretch" => set_bool(&mut o.stretch, WHAT, key, value),
                _ => {}
            }
        }
        o
    }

    fn sigmas(&self, n: u32) -> Vec<f32> {
        let m = (self.max_shift - self.base_shift) / (4096.0f32 - 1024.0);
        let b = self.base_shift - m * 1024.0;
        let shift = self.token_count as f32 * m + b;
        let exp_shift = shift.exp();
        let terminal = self.terminal.clamp(0.0, 0.99);
        sd_debug!(
            "LTX2 scheduler: tokens={}, shift={:.4}, stretch={}, terminal={:.4}",
            self.token_count,
            shift,
            self.stretch as i32,
            terminal
        );
        let mut out: Vec<f32> = (0..=n)
            .map(|i| {
                let s = 1.0f32 - i as f32 / n as f32;
                if s != 0.0 {
                    exp_shift / (exp_shift + (1.0 / s - 1.0))
                } else {
                    s
                }
            })
            .collect();
        if self.stretch && out.len() > 2 {
            let scale = (1.0f32 - out[n as usize - 1]) / (1.0 - terminal);
            if scale > 1e-8 {
                for s in &mut out[..n as usize] {
                    *s = 1.0 - (1.0 - *s) / scale;
                }
            }
        }
        out[n as usize] = 0.0;
        out
    }
}

/// `exp(mu) / (exp(mu) + (1/t - 1)^sigma)`: the resolution-dependent time shift of Flux.
pub fn flux_time_shift(mu: f32, sigma: f32, t: f32) -> f32 {
    mu.exp() / (mu.exp() + (1.0f32 / t - 1.0).powf(sigma))
}

/// Options of the Flux schedule (`base_shift`, `max_shift`).
struct FluxOptions {
    base_shift: f32,
    max_shift: f32,
}

impl FluxOptions {
    fn parse(extra_args: &ExtraArgs) -> Self {
        let mut o = FluxOptions { base_shift: 0.5, max_shift: 1.15 };
        const WHAT: &str = "flux scheduler arg";
        for (key, value) in extra_args.pairs() {
            match key {
                "base_shift" => set_float(&mut o.base_shift, WHAT, key, value),
                "max_shift" => set_float(&mut o.max_shift, WHAT, key, value),
                _ => {}
            }
        }
        o
    }

    fn sigmas(&self, n: u32, image_seq_len: i32) -> Vec<f32> {
        let m = (self.max_shift - self.base_shift) / (4096.0f32 - 256.0);
        let b = self.base_shift - m * 256.0;
        let mu = image_seq_len as f32 * m + b;
        sd_debug!("Flux scheduler: image_seq_len={}, steps={}, mu={:.3}", image_seq_len, n, mu);
        let mut out: Vec<f32> = (0..=n)
            .map(|i| {
                let t = 1.0f32 - i as f32 / n as f32;
                if t <= 0.0 {
                    0.0
                } else {
                    flux_time_shift(mu, 1.0, t)
                }
            })
            .collect();
        out[n as usize] = 0.0;
        out
    }
}

fn flux2(n: u32, image_seq_len: i32) -> Vec<f32> {
    // Empirical fit of mu over sequence length and step count (Flux.2 reference code).
    let (a1, b1) = (8.738_095_24e-05f32, 1.898_333_33f32);
    let (a2, b2) = (0.000_169_27f32, 0.456_666_66f32);
    let seq = image_seq_len as f32;
    let mu = if image_seq_len > 4300 {
        a2 * seq + b2
    } else {
        let m_200 = a2 * seq + b2;
        let m_10 = a1 * seq + b1;
        let a = (m_200 - m_10) / 190.0;
        let b = m_200 - 200.0 * a;
        a * n as f32 + b
    };
    sd_debug!("Flux2 scheduler: image_seq_len={}, steps={}, mu={:.3}", image_seq_len, n, mu);
    let mut out: Vec<f32> = (0..=n)
        .map(|i| {
            let t = 1.0f32 - i as f32 / n as f32;
            if t <= 0.0 {
                0.0
            } else if t >= 1.0 {
                1.0
            } else {
                flux_time_shift(mu, 1.0, t)
            }
        })
        .collect();
    out[n as usize] = 0.0;
    out
}

/// Options of the logit-normal schedule (`mu`, `std`, `logsnr_min`, `logsnr_max`,
/// `resolution_aware`).
struct LogitNormalOptions {
    mean: f32,
    std: f32,
    one_minus_t_min: f32,
    one_minus_t_max: f32,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl LogitNormalOptions {
    fn parse(image_seq_len: i32, extra_args: &ExtraArgs) -> Self {
        let (mut mean, mut std, mut logsnr_min, mut logsnr_max) =
            (0.0f32, 1.75f32, -15.0f32, 18.0f32);
        let mut resolution_aware = true;
        const WHAT: &str = "logit-normal scheduler arg";
        for (key, value) in extra_args.pairs() {
            match key {
                "mu" => set_float(&mut mean, WHAT, key, value),
                "std" => set_float(&mut std, WHAT, key, value),
                "logsnr_min" => set_float(&mut logsnr_min, WHAT, key, value),
                "logsnr_max" => set_float(&mut logsnr_max, WHAT, key, value),
                "resolution_aware" => set_bool(&mut resolution_aware, WHAT, key, value),
                _ => {}
            }
        }
        // Sequence length of a 512x512 image at 16x downsampling: the calibration point.
        const KNOWN_SEQ_LEN: f32 = 1024.0;
        if image_seq_len > 0 && resolution_aware {
            mean += 0.5f32 * (image_seq_len as f32 / KNOWN_SEQ_LEN).ln();
        }
        sd_info!(
            "LOGIT_NORMAL_SCHEDULER using mean={:.4}, std={:.4}, logsnr_min={:.4}, logsnr_max={:.4}",
            mean,
            std,
            logsnr_min,
            logsnr_max
        );
        LogitNormalOptions {
            mean,
            std,
            one_minus_t_min: sigmoid(0.5 * logsnr_max),
            one_minus_t_max: sigmoid(0.5 * logsnr_min),
        }
    }

    fn sigmas(&self, n: u32) -> Vec<f32> {
        let mut out: Vec<f32> = (0..=n)
            .map(|i| {
                let t = i as f32 / n as f32;
                let z = -normal_quantile(t as f64) as f32;
                let mut s = sigmoid(self.mean + self.std * z);
                if s > self.one_minus_t_min {
                    s = self.one_minus_t_min;
                }
                if s < self.one_minus_t_max {
                    s = self.one_minus_t_max;
                }
                s
            })
            .collect();
        out[n as usize] = 0.0;
        out
    }
}

fn polynomial(coeffs: &[f64], x: f64) -> f64 {
    coeffs.iter().skip(1).fold(coeffs[0], |acc, &c| acc * x + c)
}

/// Inverse of the standard normal CDF (Acklam's rational approximation, no refinement).
fn normal_quantile(p: f64) -> f64 {
    if p <= 0.0 {
        return f64::NEG_INFINITY;
    }
    if p >= 1.0 {
        return f64::INFINITY;
    }
    #[rustfmt::skip]
    const A: [f64; 6] = [
        -3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
        1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00,
    ];
    #[rustfmt::skip]
    const B: [f64; 6] = [
        -5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
        6.680131188771972e+01, -1.328068155288572e+01, 1.0,
    ];
    #[rustfmt::skip]
    const C: [f64; 6] = [
        -7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
        -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00,
    ];
    #[rustfmt::skip]
    const D: [f64; 5] = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00, 1.0];
    const P_LOW: f64 = 0.02425;
    if p < P_LOW {
        let q = (-2.0 * p.ln()).sqrt();
        polynomial(&C, q) / polynomial(&D, q)
    } else if p > 1.0 - P_LOW {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(polynomial(&C, q) / polynomial(&D, q))
    } else {
        let q = p - 0.5;
        let r = q * q;
        polynomial(&A, r) * q / polynomial(&B, r)
    }
}

/// Options of the beta schedule (`alpha`, `beta`, both > 0).
struct BetaOptions {
    alpha: f64,
    beta: f64,
}

impl BetaOptions {
    fn parse(extra_args: &ExtraArgs) -> Self {
        let mut o = BetaOptions { alpha: 0.6, beta: 0.6 };
        const WHAT: &str = "beta scheduler arg";
        for (key, value) in extra_args.pairs() {
            let slot = match key {
                "alpha" => &mut o.alpha,
                "beta" => &mut o.beta,
                _ => continue,
            };
            match parse_strict_float(value) {
                Some(v) if v > 0.0 => *slot = v as f64,
                _ => sd_warn!("ignoring invalid {} '{}={}'", WHAT, key, value),
            }
        }
        sd_debug!("Beta scheduler: alpha={:.4}, beta={:.4}", o.alpha, o.beta);
        o
    }

    /// Timesteps at the quantiles of Beta(alpha, beta); repeated timesteps are dropped, so
    /// the schedule can be shorter than `n + 1`.
    fn sigmas(&self, n: u32, t2s: &dyn Fn(f32) -> f32) -> Vec<f32> {
        if n == 1 {
            return vec![t2s(T_MAX), 0.0];
        }
        let mut out = Vec::with_capacity(n as usize + 1);
        let mut last_t = -1i64;
        for i in 0..n {
            let u = 1.0 - i as f64 / n as f64;
            let t = (beta_ppf(u, self.alpha, self.beta) * T_MAX as f64).round() as i64;
            if t != last_t {
                out.push(t2s(t as f32));
                last_t = t;
            }
        }
        out.push(0.0);
        out
    }
}

/// ln Γ(x) for x > 0 (Lanczos approximation, g = 7; ~1e-15 relative).
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const COEF: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 - x) = π / sin(πx).
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).abs().ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut sum = COEF[0];
    for (i, c) in COEF.iter().enumerate().skip(1) {
        sum += c / (x + i as f64);
    }
    let t = x + G + 0.5;
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

fn ln_beta(a: f64, b: f64) -> f64 {
    ln_gamma(a) + ln_gamma(b) - ln_gamma(a + b)
}

/// Regularised incomplete beta by its continued fraction (modified Lentz), valid for
/// x < (a + 1) / (a + b + 2).
fn incomplete_beta_cf(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    const TINY: f64 = 1e-30;
    let guard = |v: f64| if v.abs() < TINY { TINY } else { v };
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 / guard(1.0 - qab * x / qap);
    let mut h = d;
    for m in 1..=200 {
        let m = m as f64;
        let m2 = 2.0 * m;
        let even = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1.0 / guard(1.0 + even * d);
        c = guard(1.0 + even / c);
        h *= d * c;
        let odd = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 / guard(1.0 + odd * d);
        c = guard(1.0 + odd / c);
        let del = d * c;
        h *= del;
        if (del - 1.0).abs() < 3.0e-7 {
            break;
        }
    }
    (a * x.ln() + b * (1.0 - x).ln() - ln_beta(a, b)).exp() / a * h
}

fn beta_cdf(x: f64, a: f64, b: f64) -> f64 {
    if x == 0.0 {
        return 0.0;
    }
    if x == 1.0 {
        return 1.0;
    }
    if x < (a + 1.0) / (a + b + 2.0) {
        incomplete_beta_cf(x, a, b)
    } else {
        1.0 - incomplete_beta_cf(1.0 - x, b, a)
    }
}

/// Quantile of Beta(a, b) by Newton's method from 0.5 (30 iterations at most).
fn beta_ppf(u: f64, a: f64, b: f64) -> f64 {
    let mut x = 0.5f64;
    for _ in 0..30 {
        let f = beta_cdf(x, a, b) - u;
        if f.abs() < 1e-10 {
            break;
        }
        let density = ((a - 1.0) * x.ln() + (b - 1.0) * (1.0 - x).ln() - ln_beta(a, b)).exp();
        x -= f / density;
        if x <= 0.0 {
            x = 1e-10;
        }
        if x >= 1.0 {
            x = 1.0 - 1e-10;
        }
    }
    x
}

/// Validates user-supplied sigmas (`custom_sigmas`): at least two finite values.
pub fn custom_sigmas(values: &[f32]) -> Result<Vec<f32>> {
    ensure!(values.len() >= 2, "custom sigmas need at least two values, got {}", values.len());
    ensure!(values.iter().all(|v| v.is_finite()), "custom sigmas must be finite numbers");
    Ok(values.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    static NO_ARGS: std::sync::LazyLock<ExtraArgs> = std::sync::LazyLock::new(ExtraArgs::default);

    fn input(t2s: &dyn Fn(f32) -> f32) -> ScheduleInput<'_> {
        ScheduleInput {
            sigma_min: 0.0292,
            sigma_max: 14.6146,
            t_to_sigma: t2s,
            image_seq_len: 64,
            family: ModelFamily::Sd1,
            extra_args: &NO_ARGS,
        }
    }

    #[test]
    fn every_scheduler_ends_in_zero_and_descends() {
        let t2s = |t: f32| 0.03 + t / 70.0;
        for &s in Scheduler::ALL {
            for n in [1u32, 2, 3, 7, 25] {
                let sig = scheduler_sigmas(s, n, &input(&t2s)).unwrap();
                assert_eq!(*sig.last().unwrap(), 0.0, "{s} {n}");
                assert!(sig.iter().all(|v| v.is_finite()), "{s} {n}: {sig:?}");
                if s != Scheduler::Beta {
                    assert_eq!(sig.len(), n as usize + 1, "{s} {n}");
                }
                assert!(sig.windows(2).all(|w| w[0] >= w[1]), "{s} {n}: {sig:?}");
            }
        }
        assert!(scheduler_sigmas(Scheduler::Discrete, 0, &input(&t2s)).is_err());
    }

    #[test]
    fn ays_rejects_unknown_families() {
        let t2s = |t: f32| t;
        let mut i = input(&t2s);
        i.family = ModelFamily::Flux;
        assert!(scheduler_sigmas(Scheduler::Ays, 4, &i).is_err());
        i.family = ModelFamily::Sd1;
        assert_eq!(scheduler_sigmas(Scheduler::Ays, 10, &i).unwrap()[..10], AYS_SD15[..10]);
    }

    #[test]
    fn beta_quantiles_are_symmetric() {
        // Beta(0.6, 0.6) is symmetric about 1/2.
        let lo = beta_ppf(0.25, 0.6, 0.6);
        let hi = beta_ppf(0.75, 0.6, 0.6);
        assert!((lo + hi - 1.0).abs() < 1e-8, "{lo} {hi}");
        assert!((beta_cdf(lo, 0.6, 0.6) - 0.25).abs() < 1e-9);
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-13);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-13);
    }

    #[test]
    fn normal_quantile_known_values() {
        assert!((normal_quantile(0.975) - 1.959964).abs() < 1e-6);
        assert!((normal_quantile(0.01) + 2.326348).abs() < 1e-6);
        assert_eq!(normal_quantile(0.5), 0.0);
    }

    #[test]
    fn beta_options_reject_nonpositive() {
        let o = BetaOptions::parse(&ExtraArgs::parse(Some("alpha=0.5,beta=-1")));
        assert_eq!((o.alpha, o.beta), (0.5, 0.6));
    }

    #[test]
    fn custom_sigmas_validation() {
        assert!(custom_sigmas(&[1.0]).is_err());
        assert!(custom_sigmas(&[1.0, f32::NAN]).is_err());
        assert_eq!(custom_sigmas(&[2.0, 0.0]).unwrap(), vec![2.0, 0.0]);
    }
}
