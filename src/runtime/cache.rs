//! Step caches (`sd_cache_params_t`): ways to skip diffusion-model evaluations on steps
//! whose result can be predicted from earlier ones, deciding exactly as the reference does
//! so that the same steps are skipped and the pictures match.
//!
//! Two kinds work on the model's outputs and need nothing from the network:
//! - output reuse: every pass of a step (cond, uncond, img-uncond) remembers
//!   `output - input`; when the first pass of a step (the anchor) decides to reuse, every
//!   pass of the step returns `input + remembered difference` instead of running the model.
//!   Only steps whose sigma lies inside a window take part. UCache (UNets) and EasyCache
//!   (DiTs) estimate the output's change from the input's and accumulate it against the
//!   threshold; cache-dit (DBCache, TaylorSeer and their combination, DiTs) compares the
//!   anchor input's relative L1 change with `residual_diff_threshold` (scaled by `Fn`/`Bn`)
//!   in the fixed 15-95 % window. The reference decides cache-dit this way, per step and not
//!   inside the transformer's blocks (its block-level state is never consulted), and its
//!   three modes decide alike.
//! - whole-step forecasting (Spectrum, UNets and DiTs): after a warm-up, some evaluations'
//!   denoised latents are extrapolated from the last few (a ridge fit on Chebyshev features
//!   of the step counter, blended with a first-order Taylor step), skipping every pass.
//!
//! How the sampling loop drives a [`StepCache`], once per model evaluation:
//! 1. [`StepCache::forecast`]: `Some(denoised)` replaces the whole evaluation;
//! 2. [`StepCache::begin_step`] with the sampler's step argument and sigma;
//! 3. per pass, [`StepCache::reuse`] (`Some(output)` replaces the model call), else the
//!    model runs and [`StepCache::store`] sees its output;
//! 4. [`StepCache::observe`] with the guided denoised latent (before inpainting masks);
//!
//! and [`StepCache::log_summary`] after the sampler finished.

use super::denoiser::Denoiser;
use super::schedulers::TIMESTEPS;
use crate::params::CacheParams;
use crate::tensor::Tensor;
use crate::types::CacheMode;

/// What kind of network denoises: the caches each support some.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Backbone {
    UNet,
    DiT,
    Other,
}

/// Which pass of a step a model output belongs to (each keeps its own difference).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Pass {
    Cond,
    Uncond,
    ImgUncond,
}

impl Pass {
    fn index(self) -> usize {
        self as usize
    }
}

/// The step cache of one sampling run.
pub struct StepCache {
    kind: Kind,
    /// The sampler's step argument minus one; negative for the extra evaluations inside a
    /// step (Heun, DPM2, ...), which the reuse caches leave alone.
    step_index: i32,
}

enum Kind {
    Off,
    Reuse(Box<ReuseCache>),
    Spectrum(Box<Spectrum>),
}

impl StepCache {
    pub fn disabled() -> StepCache {
        StepCache { kind: Kind::Off, step_index: -1 }
    }

    /// The cache `p` asks for, for a `backbone` sampling over `sigmas`; modes the model
    /// does not support are refused with a warning (the run is uncached). `cfg_pp`: the
    /// sampler needs the unconditional prediction of every step, which Spectrum cannot give.
    pub fn new(p: &CacheParams, backbone: Backbone, sigmas: &[f32], denoiser: &Denoiser, cfg_pp: bool) -> StepCache {
        let off = StepCache::disabled();
        if p.mode == CacheMode::Disabled {
            return off;
        }
        let reuse_mode = matches!(p.mode, CacheMode::EasyCache | CacheMode::UCache);
        let valid_range = p.start_percent >= 0.0
            && p.start_percent < 1.0
            && p.end_percent > 0.0
            && p.end_percent <= 1.0
            && p.start_percent < p.end_percent;
        if reuse_mode && !valid_range {
            sd_warn!("Cache disabled due to invalid percent range (start={:.3}, end={:.3})", p.start_percent, p.end_percent);
            return off;
        }
        let kind = match p.mode {
            CacheMode::Disabled => Kind::Off,
            CacheMode::EasyCache => {
                if backbone != Backbone::DiT {
                    sd_warn!("EasyCache requested but not supported for this model type");
                    return off;
                }
                let cache = ReuseCache::easy(p, denoiser);
                sd_info!(
                    "EasyCache enabled - threshold: {:.3}, start: {:.2}, end: {:.2}",
                    cache.cfg.threshold,
                    p.start_percent,
                    p.end_percent
                );
                Kind::Reuse(Box::new(cache))
            }
            CacheMode::UCache => {
                if backbone != Backbone::UNet {
                    sd_warn!("UCache requested but not supported for this model type (only UNET models)");
                    return off;
                }
                let cache = ReuseCache::ucache(p, sigmas);
                let c = &cache.cfg;
                sd_info!(
                    "UCache enabled - threshold: {:.3}, start: {:.2}, end: {:.2}, decay: {:.2}, relative: {}, reset: {}",
                    c.threshold,
                    p.start_percent,
                    p.end_percent,
                    c.decay,
                    c.relative,
                    c.reset
                );
                Kind::Reuse(Box::new(cache))
            }
            CacheMode::DbCache | CacheMode::TaylorSeer | CacheMode::CacheDit => {
                if backbone != Backbone::DiT {
                    sd_warn!("CacheDIT requested but not supported for this model type (only DiT models)");
                    return off;
                }
                let mode = match p.mode {
                    CacheMode::CacheDit => "DBCache+TaylorSeer",
                    CacheMode::DbCache => "DBCache",
                    _ => "TaylorSeer",
                };
                sd_info!(
                    "CacheDIT enabled - mode: {mode}, Fn: {}, Bn: {}, threshold: {:.3}, warmup: {}",
                    p.fn_compute_blocks,
                    p.bn_compute_blocks,
                    p.residual_diff_threshold,
                    p.max_warmup_steps
                );
                Kind::Reuse(Box::new(ReuseCache::dit(p, sigmas)))
            }
            CacheMode::Spectrum => {
                if !matches!(backbone, Backbone::UNet | Backbone::DiT) {
                    sd_warn!("Spectrum requested but not supported for this model type (only UNET and DiT models)");
                    return off;
                }
                if p.spectrum_m < 0 {
                    sd_warn!("Spectrum disabled: its polynomial degree m must be at least 0, got {}", p.spectrum_m);
                    return off;
                }
                let s = Spectrum::new(p, sigmas.len().saturating_sub(1));
                sd_info!(
                    "Spectrum enabled - w: {:.2}, m: {}, lam: {:.2}, window: {}, flex: {:.2}, warmup: {}, stop: {:.0}%",
                    p.spectrum_w,
                    p.spectrum_m,
                    p.spectrum_lam,
                    p.spectrum_window_size,
                    p.spectrum_flex_window,
                    p.spectrum_warmup_steps,
                    p.spectrum_stop_percent * 100.0
                );
                if cfg_pp {
                    sd_warn!("Spectrum cache requested but not supported for CFG++ samplers");
                    return off;
                }
                Kind::Spectrum(Box::new(s))
            }
        };
        StepCache { kind, step_index: -1 }
    }

    pub fn is_enabled(&self) -> bool {
        !matches!(self.kind, Kind::Off)
    }

    /// Whether a pass's output may be reused instead of computed (decided pass by pass).
    pub fn reuses_passes(&self) -> bool {
        matches!(self.kind, Kind::Reuse(_))
    }

    /// The denoised latent of this evaluation when it is forecast instead of computed.
    pub fn forecast(&mut self) -> Option<Tensor> {
        match &mut self.kind {
            Kind::Spectrum(s) if s.should_predict() => s.predict(),
            _ => None,
        }
    }

    /// Starts the evaluation of the sampler's `step` (its step argument) at `sigma`.
    pub fn begin_step(&mut self, step: i32, sigma: f32) {
        self.step_index = if step > 0 { step - 1 } else { -1 };
        if self.step_index < 0 {
            return;
        }
        if let Kind::Reuse(c) = &mut self.kind {
            c.begin_step(self.step_index, sigma);
        }
    }

    /// The output of `pass` for `input` when it is reused instead of computed.
    pub fn reuse(&mut self, pass: Pass, input: &Tensor) -> Option<Tensor> {
        match &mut self.kind {
            Kind::Reuse(c) if self.step_index >= 0 => c.before(pass, input),
            _ => None,
        }
    }

    /// Sees the computed output of `pass`.
    pub fn store(&mut self, pass: Pass, input: &Tensor, output: &Tensor) {
        if self.step_index < 0 {
            return;
        }
        if let Kind::Reuse(c) = &mut self.kind {
            c.after(pass, input, output);
        }
    }

    /// Whether the current step reuses its outputs (its remaining passes do too; extra
    /// work such as skip-layer guidance is left out).
    pub fn step_skipped(&self) -> bool {
        match &self.kind {
            Kind::Reuse(c) => c.step_active && c.skip_current_step,
            _ => false,
        }
    }

    /// Sees the guided denoised latent of a computed evaluation.
    pub fn observe(&mut self, denoised: &Tensor) {
        if let Kind::Spectrum(s) = &mut self.kind {
            s.update(denoised);
        }
    }

    /// How many evaluations were skipped (forecast or reused).
    pub fn steps_skipped(&self) -> usize {
        match &self.kind {
            Kind::Off => 0,
            Kind::Reuse(c) => c.skipped,
            Kind::Spectrum(s) => s.skipped,
        }
    }

    /// Logs how many of the run's `total_steps` steps were skipped, like the reference.
    pub fn log_summary(&self, total_steps: usize) {
        let skipped = self.steps_skipped();
        let name = match &self.kind {
            Kind::Off => return,
            Kind::Reuse(c) => match c.cfg.flavor {
                Flavor::Easy => "EasyCache",
                Flavor::U => "UCache",
                Flavor::Dit => "CacheDIT",
            },
            Kind::Spectrum(_) => "Spectrum",
        };
        if total_steps == 0 {
            return;
        }
        if skipped == 0 {
            if !matches!(self.kind, Kind::Spectrum(_)) {
                sd_info!("{name} completed without skipping steps");
            }
        } else if skipped < total_steps || matches!(self.kind, Kind::Spectrum(_)) {
            let speedup = total_steps as f64 / (total_steps as f64 - skipped as f64);
            sd_info!("{name} skipped {skipped}/{total_steps} steps ({speedup:.2}x estimated speedup)");
        } else {
            sd_info!("{name} skipped {skipped}/{total_steps} steps");
        }
    }
}

/// Mean of |a - b| (or of |a| without `b`), summed in order in f32 as the reference does,
/// so that threshold decisions fall the same way.
fn mean_abs(a: &[f32], b: Option<&[f32]>) -> f32 {
    let mut sum = 0f32;
    match b {
        Some(b) => a.iter().zip(b).for_each(|(x, y)| sum += (x - y).abs()),
        None => a.iter().for_each(|x| sum += x.abs()),
    }
    if a.is_empty() {
        sum
    } else {
        sum / a.len() as f32
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flavor {
    /// EasyCache: the plain relative change, reset after every computed step.
    Easy,
    /// UCache: the adaptive, decaying, optionally absolute variant.
    U,
    /// cache-dit: the anchor input's relative L1 change alone.
    Dit,
}

#[derive(Clone, Debug)]
struct ReuseConfig {
    flavor: Flavor,
    threshold: f32,
    decay: f32,
    relative: bool,
    reset: bool,
}

/// UCache's fixed tuning.
const EARLY_STEP_MULTIPLIER: f32 = 0.5;
const LATE_STEP_MULTIPLIER: f32 = 1.5;
const RELATIVE_NORM_GAIN: f32 = 1.6;

/// Output reuse (UCache / EasyCache / cache-dit).
struct ReuseCache {
    cfg: ReuseConfig,
    /// Steps take part while `end_sigma < sigma <= start_sigma`.
    start_sigma: f32,
    end_sigma: f32,
    /// The run's step count (UCache's adaptive threshold), 0 when unknown.
    expected_total_steps: i32,
    current_step_index: i32,
    step_active: bool,
    skip_current_step: bool,
    /// The pass that decides for its step: the first one of the first active step.
    anchor: Option<Pass>,
    /// `output - input` of each pass's last computed evaluation.
    diffs: [Option<Vec<f32>>; 3],
    prev_input: Option<Vec<f32>>,
    prev_output: Option<Vec<f32>>,
    /// Mean |output| of the anchor's last computed evaluation.
    output_prev_norm: f32,
    /// Output change per input change, measured between the last two computed steps.
    rate: Option<f32>,
    last_input_change: Option<f32>,
    output_change_ema: Option<f32>,
    accumulated: f32,
    skipped: usize,
    computed_since_active: i32,
    consecutive_skipped: i32,
}

impl ReuseCache {
    fn with(cfg: ReuseConfig, start_sigma: f32, end_sigma: f32) -> ReuseCache {
        ReuseCache {
            cfg,
            start_sigma,
            end_sigma,
            expected_total_steps: 0,
            current_step_index: -1,
            step_active: false,
            skip_current_step: false,
            anchor: None,
            diffs: [None, None, None],
            prev_input: None,
            prev_output: None,
            output_prev_norm: 0.0,
            rate: None,
            last_input_change: None,
            output_change_ema: None,
            accumulated: 0.0,
            skipped: 0,
            computed_since_active: 0,
            consecutive_skipped: 0,
        }
    }

    /// EasyCache: the window comes from the denoiser's timestep → sigma map.
    fn easy(p: &CacheParams, denoiser: &Denoiser) -> ReuseCache {
        let percent_to_sigma = |percent: f32| {
            if percent <= 0.0 {
                f32::MAX
            } else if percent >= 1.0 {
                0.0
            } else {
                denoiser.t_to_sigma((1.0 - percent) * (TIMESTEPS - 1) as f32)
            }
        };
        let cfg = ReuseConfig { flavor: Flavor::Easy, threshold: p.effective_reuse_threshold(), decay: 1.0, relative: true, reset: true };
        ReuseCache::with(cfg, percent_to_sigma(p.start_percent), percent_to_sigma(p.end_percent))
    }

    /// UCache: the window is the sigmas of the steps at the start and end fractions.
    fn ucache(p: &CacheParams, sigmas: &[f32]) -> ReuseCache {
        let cfg = ReuseConfig {
            flavor: Flavor::U,
            threshold: p.effective_reuse_threshold(),
            decay: p.error_decay_rate.clamp(0.0, 1.0),
            relative: p.use_relative_threshold,
            reset: p.reset_error_on_compute,
        };
        // The percents were checked to lie in [0, 1].
        ReuseCache::over_steps(cfg, sigmas, p.start_percent, p.end_percent)
    }

    /// cache-dit: `residual_diff_threshold` scaled by the front (`Fn`) and back (`Bn`) block
    /// counts; the window is the steps at 15 % and 95 % of the schedule (fixed).
    fn dit(p: &CacheParams, sigmas: &[f32]) -> ReuseCache {
        let mut threshold = p.residual_diff_threshold;
        if p.fn_compute_blocks > 0 {
            threshold *= (1.0 + 0.02 * (p.fn_compute_blocks - 8) as f32).clamp(0.5, 2.0);
        }
        if p.bn_compute_blocks > 0 {
            threshold *= (1.0 - 0.03 * p.bn_compute_blocks as f32).clamp(0.5, 1.0);
        }
        let cfg = ReuseConfig { flavor: Flavor::Dit, threshold, decay: 1.0, relative: true, reset: true };
        ReuseCache::over_steps(cfg, sigmas, 0.15, 0.95)
    }

    /// A cache whose window is the sigmas of the steps at the `start` and `end` fractions of
    /// the schedule.
    fn over_steps(cfg: ReuseConfig, sigmas: &[f32], start: f32, end: f32) -> ReuseCache {
        let mut c = ReuseCache::with(cfg, f32::MAX, 0.0);
        if sigmas.len() >= 2 {
            let n = sigmas.len() - 1;
            let step_at = |percent: f32| ((percent * n as f32) as usize).min(n - 1);
            let (a, b) = (sigmas[step_at(start)], sigmas[step_at(end)]);
            c.start_sigma = a.max(b);
            c.end_sigma = a.min(b);
            c.expected_total_steps = n as i32;
        }
        c
    }

    fn begin_step(&mut self, step_index: i32, sigma: f32) {
        if step_index == self.current_step_index {
            return;
        }
        self.current_step_index = step_index;
        self.skip_current_step = false;
        self.last_input_change = None;
        self.step_active = sigma <= self.start_sigma && sigma > self.end_sigma;
    }

    fn adaptive_threshold(&self) -> f32 {
        let mut total = self.expected_total_steps;
        if total <= 0 {
            total = 20.max(self.computed_since_active * 2);
        }
        let progress = (self.computed_since_active as f32 / total as f32).clamp(0.0, 1.0);
        let multiplier = if progress < 0.2 {
            EARLY_STEP_MULTIPLIER
        } else if progress > 0.8 {
            LATE_STEP_MULTIPLIER
        } else {
            1.0
        };
        self.cfg.threshold * multiplier
    }

    fn apply(&self, pass: Pass, input: &Tensor) -> Option<Tensor> {
        let diff = self.diffs[pass.index()].as_ref()?;
        if diff.len() != input.len() || diff.is_empty() {
            return None;
        }
        let data = input.data().iter().zip(diff).map(|(x, d)| x + d).collect();
        Tensor::from_vec(input.shape(), data).ok()
    }

    /// Marks the current step as reused and returns `pass`'s output.
    fn skip(&mut self, pass: Pass, input: &Tensor) -> Option<Tensor> {
        self.skip_current_step = true;
        self.skipped += 1;
        self.consecutive_skipped += 1;
        self.apply(pass, input)
    }

    fn before(&mut self, pass: Pass, input: &Tensor) -> Option<Tensor> {
        if !self.step_active {
            return None;
        }
        let anchor = *self.anchor.get_or_insert(pass);
        if self.skip_current_step {
            return self.apply(pass, input);
        }
        if pass != anchor || self.diffs[pass.index()].is_none() || self.prev_output.is_none() {
            return None;
        }
        let prev_input = self.prev_input.as_ref()?;
        if prev_input.len() != input.len() {
            return None;
        }
        if self.cfg.flavor == Flavor::Dit {
            // Relative L1 change, summed in order in f32 as the reference does.
            let (mut change, mut size) = (0f32, 0f32);
            for (p, x) in prev_input.iter().zip(input.data()) {
                change += (p - x).abs();
                size += p.abs();
            }
            return (change / (size + 1e-6) < self.cfg.threshold).then(|| self.skip(pass, input)).flatten();
        }
        let input_change = mean_abs(input.data(), Some(prev_input));
        self.last_input_change = Some(input_change);
        let norm = self.output_prev_norm;
        let rate = match self.rate {
            Some(r) if norm > 0.0 && input_change > 0.0 => r,
            _ => return None,
        };
        let skip = match self.cfg.flavor {
            Flavor::Easy => {
                self.accumulated += (rate * input_change) / norm;
                self.accumulated < self.cfg.threshold
            }
            Flavor::Dit => unreachable!("decided above"),
            Flavor::U => {
                let approx_change = rate * input_change;
                let mut change_rate = if self.cfg.relative {
                    let base = norm.max(1e-6);
                    let dynamic = match self.output_change_ema {
                        Some(ema) => (ema * RELATIVE_NORM_GAIN.max(1.0)).max(1e-6),
                        None => base,
                    };
                    approx_change / (base * dynamic).sqrt()
                } else {
                    approx_change
                };
                // Longer streaks of reuse count for more.
                change_rate *= 1.0 + 0.5 * self.consecutive_skipped as f32;
                self.accumulated = self.accumulated * self.cfg.decay + change_rate;
                let mut threshold = self.adaptive_threshold();
                if !self.cfg.relative {
                    threshold *= norm;
                }
                self.accumulated < threshold
            }
        };
        if skip {
            return self.skip(pass, input);
        }
        if self.cfg.flavor == Flavor::Easy || self.cfg.reset {
            self.accumulated = 0.0;
        }
        None
    }

    fn after(&mut self, pass: Pass, input: &Tensor, output: &Tensor) {
        if !self.step_active {
            return;
        }
        let diff = &mut self.diffs[pass.index()];
        *diff = (!input.is_empty() && input.len() == output.len()).then(|| output.data().iter().zip(input.data()).map(|(o, i)| o - i).collect());
        if Some(pass) != self.anchor {
            return;
        }
        self.computed_since_active += 1;
        self.consecutive_skipped = 0;
        self.prev_input = Some(input.data().to_vec());
        let out = output.data();
        let output_change = match &self.prev_output {
            Some(prev) if prev.len() == out.len() => mean_abs(out, Some(prev)),
            _ => 0.0,
        };
        if self.cfg.flavor == Flavor::U && output_change.is_finite() && output_change > 0.0 {
            self.output_change_ema = Some(match self.output_change_ema {
                None => output_change,
                Some(ema) => 0.8 * ema + 0.2 * output_change,
            });
        }
        self.prev_output = Some(out.to_vec());
        self.output_prev_norm = mean_abs(out, None);
        if let Some(input_change) = self.last_input_change {
            if input_change > 0.0 && output_change > 0.0 {
                let rate = output_change / input_change;
                if rate.is_finite() {
                    self.rate = Some(rate);
                }
            }
        }
        if self.cfg.flavor == Flavor::Easy {
            self.accumulated = 0.0;
        }
        self.last_input_change = None;
    }
}

/// Spectrum: forecasts denoised latents from the last `k` computed ones.
struct Spectrum {
    /// Weight of the Chebyshev fit against the Taylor step.
    w: f32,
    /// Polynomial degree of the fit.
    m: usize,
    /// Ridge regularisation.
    lam: f32,
    flex_window: f32,
    warmup_steps: i32,
    /// Evaluations from this one on are always computed (0: none).
    stop_step: i32,
    /// Evaluations so far, computed or forecast.
    cnt: i32,
    /// Forecasts since the last computed evaluation.
    num_cached: i32,
    /// Every `floor(window)`-th evaluation is computed; the window widens after warm-up.
    window: f32,
    /// History length kept.
    k: usize,
    history: std::collections::VecDeque<(f32, Vec<f32>)>,
    shape: Vec<usize>,
    skipped: usize,
}

impl Spectrum {
    fn new(p: &CacheParams, total_steps: usize) -> Spectrum {
        let m = p.spectrum_m.max(0) as usize;
        Spectrum {
            w: p.spectrum_w,
            m,
            lam: p.spectrum_lam,
            flex_window: p.spectrum_flex_window,
            warmup_steps: p.spectrum_warmup_steps,
            stop_step: (p.spectrum_stop_percent * total_steps as f32) as i32,
            cnt: 0,
            num_cached: 0,
            window: p.spectrum_window_size as f32,
            k: (m + 1).max(6),
            history: Default::default(),
            shape: Vec::new(),
            skipped: 0,
        }
    }

    /// The fit's abscissa for evaluation `cnt` (as if over 50 steps, in [-1, 1]).
    fn tau(cnt: i32) -> f32 {
        (cnt as f32 / 50.0) * 2.0 - 1.0
    }

    fn should_predict(&self) -> bool {
        if self.cnt < self.warmup_steps || (self.stop_step > 0 && self.cnt >= self.stop_step) || self.history.len() < 2 {
            return false;
        }
        let ws = (self.window.floor() as i32).max(1);
        (self.num_cached + 1) % ws != 0
    }

    fn update(&mut self, denoised: &Tensor) {
        self.history.push_back((Self::tau(self.cnt), denoised.data().to_vec()));
        self.shape = denoised.shape().to_vec();
        while self.history.len() > self.k {
            self.history.pop_front();
        }
        if self.cnt >= self.warmup_steps {
            self.window += self.flex_window;
        }
        self.num_cached = 0;
        self.cnt += 1;
    }

    /// Chebyshev features T_0..T_m at `tau`.
    fn features(&self, tau: f32) -> Vec<f32> {
        let mut f = vec![0f32; self.m + 1];
        f[0] = 1.0;
        if self.m >= 1 {
            f[1] = tau;
        }
        for j in 2..=self.m {
            f[j] = 2.0 * tau * f[j - 1] - f[j - 2];
        }
        f
    }

    fn predict(&mut self) -> Option<Tensor> {
        let n = self.m + 1;
        let rows: Vec<Vec<f32>> = self.history.iter().map(|(t, _)| self.features(*t)).collect();
        let target = self.features(Self::tau(self.cnt));
        // Ridge normal equations (X^T X + lam I) v = x*, solved by Cholesky.
        let mut xtx = vec![0f32; n * n];
        for i in 0..n {
            for j in 0..n {
                let mut sum = 0f32;
                for r in &rows {
                    sum += r[i] * r[j];
                }
                xtx[i * n + j] = sum + if i == j { self.lam } else { 0.0 };
            }
        }
        let l = match cholesky(&xtx, n) {
            Ok(l) => l,
            Err(_) => {
                let mut trace = 0f32;
                for i in 0..n {
                    trace += xtx[i * n + i];
                }
                for i in 0..n {
                    xtx[i * n + i] += 1e-4 * trace / n as f32;
                }
                cholesky(&xtx, n).unwrap_or_else(|partial| partial)
            }
        };
        let v = cholesky_solve(&l, &target, n);
        let weights: Vec<f32> = rows
            .iter()
            .map(|r| {
                let mut w = 0f32;
                for j in 0..n {
                    w += r[j] * v[j];
                }
                w
            })
            .collect();
        let (last, prev) = (&self.history[self.history.len() - 1].1, &self.history[self.history.len() - 2].1);
        let (w_cheb, w_taylor) = (self.w, 1.0 - self.w);
        let out: Vec<f32> = (0..last.len())
            .map(|f| {
                let mut cheb = 0f32;
                for (k, (_, h)) in self.history.iter().enumerate() {
                    cheb += weights[k] * h[f];
                }
                let taylor = last[f] + 0.5 * (last[f] - prev[f]);
                w_taylor * taylor + w_cheb * cheb
            })
            .collect();
        let out = Tensor::from_vec(&self.shape, out).ok()?;
        self.num_cached += 1;
        self.skipped += 1;
        self.cnt += 1;
        Some(out)
    }
}

/// Lower Cholesky factor of the symmetric `n`×`n` matrix `a`; `Err` with the partial
/// factor when `a` is not positive definite.
fn cholesky(a: &[f32], n: usize) -> std::result::Result<Vec<f32>, Vec<f32>> {
    let mut l = vec![0f32; n * n];
    for i in 0..n {
        for j in 0..=i {
            let mut sum = 0f32;
            for k in 0..j {
                sum += l[i * n + k] * l[j * n + k];
            }
            if i == j {
                let diag = a[i * n + i] - sum;
                if diag <= 0.0 {
                    return Err(l);
                }
                l[i * n + j] = diag.sqrt();
            } else {
                l[i * n + j] = (a[i * n + j] - sum) / l[j * n + j];
            }
        }
    }
    Ok(l)
}

/// Solves `L L^T x = b`.
fn cholesky_solve(l: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    for i in 0..n {
        let mut sum = 0f32;
        for j in 0..i {
            sum += l[i * n + j] * y[j];
        }
        y[i] = (b[i] - sum) / l[i * n + i];
    }
    let mut x = vec![0f32; n];
    for i in (0..n).rev() {
        let mut sum = 0f32;
        for j in i + 1..n {
            sum += l[j * n + i] * x[j];
        }
        x[i] = (y[i] - sum) / l[i * n + i];
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Prediction;

    fn params(mode: CacheMode) -> CacheParams {
        CacheParams { mode, ..CacheParams::default() }
    }

    fn denoiser() -> Denoiser {
        Denoiser::new(Prediction::Eps, None)
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_vec(&[v.len()], v.to_vec()).unwrap()
    }

    #[test]
    fn modes_a_model_does_not_support_leave_the_run_uncached() {
        let sigmas = [14.6, 7.0, 3.0, 1.0, 0.0];
        let d = denoiser();
        let on = |mode, backbone| StepCache::new(&params(mode), backbone, &sigmas, &d, false).is_enabled();
        assert!(on(CacheMode::UCache, Backbone::UNet));
        assert!(!on(CacheMode::UCache, Backbone::DiT));
        assert!(on(CacheMode::EasyCache, Backbone::DiT));
        assert!(!on(CacheMode::EasyCache, Backbone::UNet));
        for m in [CacheMode::DbCache, CacheMode::TaylorSeer, CacheMode::CacheDit] {
            assert!(!on(m, Backbone::UNet));
            assert!(on(m, Backbone::DiT));
        }
        assert!(on(CacheMode::Spectrum, Backbone::UNet) && on(CacheMode::Spectrum, Backbone::DiT));
        assert!(!on(CacheMode::Spectrum, Backbone::Other));
        assert!(!StepCache::new(&params(CacheMode::Spectrum), Backbone::UNet, &sigmas, &d, true).is_enabled());
        assert!(!on(CacheMode::Disabled, Backbone::UNet));
        let bad = CacheParams { start_percent: 0.9, end_percent: 0.5, ..params(CacheMode::UCache) };
        assert!(!StepCache::new(&bad, Backbone::UNet, &sigmas, &d, false).is_enabled());
    }

    /// cache-dit: a small relative change of the anchor's input reuses every pass of the
    /// step; the window is the steps at 15 % and 95 % of the schedule.
    #[test]
    fn cache_dit_reuses_a_step_whose_input_barely_changed() {
        let sigmas: Vec<f32> = (0..=10).rev().map(|v| v as f32).collect();
        let p = CacheParams { residual_diff_threshold: 0.1, ..params(CacheMode::DbCache) };
        let mut c = StepCache::new(&p, Backbone::DiT, &sigmas, &denoiser(), false);
        // Step 1 (sigma 10) lies before the window: nothing is remembered.
        c.begin_step(1, 10.0);
        assert!(c.reuse(Pass::Cond, &t(&[1.0, 1.0])).is_none());
        c.store(Pass::Cond, &t(&[1.0, 1.0]), &t(&[2.0, 3.0]));
        // Step 2 (sigma 9, inside): computed and remembered for both passes.
        c.begin_step(2, 9.0);
        assert!(c.reuse(Pass::Cond, &t(&[1.0, 1.0])).is_none());
        c.store(Pass::Cond, &t(&[1.0, 1.0]), &t(&[2.0, 3.0]));
        assert!(c.reuse(Pass::Uncond, &t(&[1.0, 1.0])).is_none());
        c.store(Pass::Uncond, &t(&[1.0, 1.0]), &t(&[0.5, 0.5]));
        // Step 3: the input moved by 5 % (< 0.1): both passes reuse their differences.
        c.begin_step(3, 8.0);
        assert_eq!(c.reuse(Pass::Cond, &t(&[1.05, 1.05])).unwrap().data(), &[1.05 + 1.0, 1.05 + 2.0]);
        assert!(c.step_skipped());
        assert_eq!(c.reuse(Pass::Uncond, &t(&[1.05, 1.05])).unwrap().data(), &[1.05 - 0.5, 1.05 - 0.5]);
        // Step 4: moved by 50 % against the last computed input: computed.
        c.begin_step(4, 7.0);
        assert!(c.reuse(Pass::Cond, &t(&[1.5, 1.5])).is_none());
        assert_eq!(c.steps_skipped(), 1);
        // Fn and Bn scale the threshold: Fn 18 raises it by 20 %, Bn 10 lowers it by 30 %.
        let scaled = ReuseCache::dit(&CacheParams { fn_compute_blocks: 18, bn_compute_blocks: 10, ..p.clone() }, &sigmas);
        assert!((scaled.cfg.threshold - 0.1 * 1.2 * 0.7).abs() < 1e-7);
        assert_eq!((scaled.start_sigma, scaled.end_sigma), (9.0, 1.0));
    }

    #[test]
    fn ucache_window_is_the_steps_at_the_start_and_end_fractions() {
        let sigmas: Vec<f32> = (0..=10).rev().map(|v| v as f32).collect();
        let c = ReuseCache::ucache(&params(CacheMode::UCache), &sigmas);
        // 10 steps: steps 1 (0.15 · 10) to 9 (0.95 · 10).
        assert_eq!((c.start_sigma, c.end_sigma, c.expected_total_steps), (9.0, 1.0, 10));
        assert_eq!(c.cfg.threshold, 1.0);
    }

    /// A model whose output changes little once the input does: after the first two
    /// computed steps of the window, the anchor's decision reuses both passes.
    #[test]
    fn ucache_reuses_every_pass_of_a_skipped_step() {
        let sigmas: Vec<f32> = (0..=10).rev().map(|v| v as f32).collect();
        let mut c = StepCache::new(&params(CacheMode::UCache), Backbone::UNet, &sigmas, &denoiser(), false);
        let mut computed = 0;
        for step in 1..=10 {
            let sigma = sigmas[step - 1];
            c.begin_step(step as i32, sigma);
            let input = t(&[sigma, 2.0 * sigma]);
            for pass in [Pass::Cond, Pass::Uncond] {
                match c.reuse(pass, &input) {
                    Some(out) => {
                        assert!(c.step_skipped());
                        // input + the difference remembered for this pass.
                        let off = if pass == Pass::Cond { 1.0 } else { -1.0 };
                        assert_eq!(out.data(), &[sigma + off, 2.0 * sigma + off]);
                    }
                    None => {
                        computed += 1;
                        let off = if pass == Pass::Cond { 1.0 } else { -1.0 };
                        c.store(pass, &input, &input.map(|v| v + off));
                    }
                }
            }
        }
        assert!(c.steps_skipped() > 0);
        assert_eq!(computed, 2 * (10 - c.steps_skipped()));
    }

    #[test]
    fn extra_evaluations_inside_a_step_are_left_alone() {
        let sigmas: Vec<f32> = (0..=10).rev().map(|v| v as f32).collect();
        let mut c = StepCache::new(&params(CacheMode::UCache), Backbone::UNet, &sigmas, &denoiser(), false);
        c.begin_step(-3, 8.0);
        assert!(c.reuse(Pass::Cond, &t(&[1.0])).is_none());
        c.store(Pass::Cond, &t(&[1.0]), &t(&[2.0]));
        match &c.kind {
            Kind::Reuse(r) => assert!(r.anchor.is_none() && r.prev_input.is_none()),
            _ => unreachable!(),
        }
    }

    #[test]
    fn spectrum_forecasts_on_the_reference_schedule() {
        // 10 steps with the defaults: warm-up 4, window 2 widening by 0.5, stop at 9.
        let sigmas: Vec<f32> = (0..=10).rev().map(|v| v as f32).collect();
        let mut c = StepCache::new(&params(CacheMode::Spectrum), Backbone::UNet, &sigmas, &denoiser(), false);
        let mut forecast = Vec::new();
        for step in 0..10 {
            match c.forecast() {
                Some(_) => forecast.push(step),
                None => c.observe(&t(&[step as f32, 1.0])),
            }
        }
        assert_eq!(forecast, [4, 6, 8]);
        assert_eq!(c.steps_skipped(), 3);
    }

    #[test]
    fn spectrum_extrapolates_a_linear_trend() {
        let p = CacheParams { spectrum_warmup_steps: 2, spectrum_w: 0.0, ..params(CacheMode::Spectrum) };
        let mut s = Spectrum::new(&p, 50);
        s.update(&t(&[1.0]));
        s.update(&t(&[2.0]));
        // The Taylor step alone (w = 0): last + (last - previous) / 2.
        assert!(s.should_predict());
        assert_eq!(s.predict().unwrap().data(), &[2.5]);
    }

    #[test]
    fn cholesky_solves_a_small_system() {
        let a = [4.0, 2.0, 2.0, 3.0];
        let l = cholesky(&a, 2).unwrap();
        let x = cholesky_solve(&l, &[6.0, 5.0], 2);
        assert!((x[0] - 1.0).abs() < 1e-6 && (x[1] - 1.0).abs() < 1e-6);
        assert!(cholesky(&[-1.0], 1).is_err());
    }
}
