//! How one evaluation's predictions become the guided prediction: classifier-free guidance
//! (with its 3-way image variant), adaptive projected guidance (APG), a per-step guidance
//! schedule, and skip-layer guidance, as the reference combines them.
//!
//! The `extra_sample_args` keys read here: `apg_eta`, `apg_momentum`, `apg_norm_threshold`,
//! `apg_norm_threshold_smoothing` (APG is on when any of them moves away from its neutral
//! value), `guidance_schedule` (`<scale>x<count>+<scale>x<count>...`) and `slg_uncond`.

use crate::params::{GuidanceParams, SlgParams};
use crate::runtime::args::{parse_strict_bool, parse_strict_float, parse_strict_int, ExtraArgs};
use crate::tensor::Tensor;

/// APG's options (neutral values: plain classifier-free guidance).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ApgParams {
    pub eta: f32,
    pub momentum: f32,
    pub norm_threshold: f32,
    pub norm_threshold_smoothing: f32,
}

impl Default for ApgParams {
    fn default() -> Self {
        ApgParams { eta: 1.0, momentum: 0.0, norm_threshold: 0.0, norm_threshold_smoothing: 0.0 }
    }
}

impl ApgParams {
    /// The APG keys of `extra` (the last of a repeated key wins; invalid values warn).
    pub fn parse(extra: &ExtraArgs) -> ApgParams {
        let mut p = ApgParams::default();
        for (k, v) in extra.pairs() {
            let slot = match k {
                "apg_eta" => &mut p.eta,
                "apg_momentum" => &mut p.momentum,
                "apg_norm_threshold" => &mut p.norm_threshold,
                "apg_norm_threshold_smoothing" => &mut p.norm_threshold_smoothing,
                _ => continue,
            };
            crate::runtime::args::set_float(slot, "APG extra sample arg", k, v);
        }
        p
    }

    /// Whether these options change anything (the smoothing alone does not).
    pub fn enabled(&self) -> bool {
        self.eta != 1.0 || self.momentum != 0.0 || self.norm_threshold > 0.0
    }
}

/// Parses a guidance schedule `<scale>x<count>[+<scale>x<count>...]` into one scale per
/// step; a malformed schedule is an error message (the reference logs it and runs without).
pub fn parse_schedule(spec: &str) -> Result<Vec<f32>, String> {
    let mut out = Vec::new();
    // One trailing `+` ends the list; an empty segment anywhere else is malformed.
    for segment in spec.strip_suffix('+').unwrap_or(spec).split('+') {
        let Some((scale, count)) = segment.split_once('x') else {
            return Err(format!("Invalid guidance schedule segment: '{segment}' (expected <guidance>x<count>)"));
        };
        // `std::stof` / `std::stoi` that must read the whole text (no trailing space either).
        let whole = |s: &str| !s.ends_with(|c: char| c.is_ascii_whitespace());
        let scale = parse_strict_float(scale).filter(|_| whole(scale)).ok_or_else(|| format!("Invalid guidance value in guidance schedule: '{scale}'"))?;
        let count = parse_strict_int(count).filter(|_| whole(count)).ok_or_else(|| format!("Invalid count in guidance schedule: '{count}'"))?;
        if count <= 0 {
            return Err("Guidance schedule count must be positive".into());
        }
        out.extend(std::iter::repeat(scale).take(count as usize));
    }
    Ok(out)
}

/// The per-step guidance scales of one stage of `steps` steps: empty when none was asked for
/// (or it was malformed); longer than `steps + 1` is cut to `steps`, shorter than `steps` is
/// padded with `cfg`, as the reference fits it.
fn fit_schedule(extra: &ExtraArgs, steps: usize, cfg: f32) -> Vec<f32> {
    let Some(spec) = extra.pairs().filter(|(k, _)| *k == "guidance_schedule").map(|(_, v)| v).last() else {
        return Vec::new();
    };
    if spec.is_empty() {
        return Vec::new();
    }
    let mut schedule = match parse_schedule(spec) {
        Ok(s) => s,
        Err(e) => {
            sd_error!("{e}");
            return Vec::new();
        }
    };
    if schedule.len() > steps + 1 {
        sd_warn!("guidance_schedule length ({}) is greater than number of steps ({steps})", schedule.len());
        sd_warn!("truncating guidance_schedule to match step count");
        schedule.truncate(steps);
    } else if schedule.len() < steps {
        sd_info!("padding guidance_schedule with cfg_scale");
        schedule.resize(steps, cfg);
    }
    let listed: Vec<String> = schedule.iter().map(|v| format!("{v:.6}")).collect();
    sd_debug!("using guidance schedule: [{}]", listed.join(", "));
    schedule
}

/// Combines the predictions of one evaluation into the guided prediction; holds APG's
/// momentum between the evaluations of one stage.
pub(super) struct Guider {
    txt_cfg: f32,
    img_cfg: f32,
    apg: Option<ApgParams>,
    momentum: Vec<f32>,
    schedule: Vec<f32>,
    warned_schedule_gap: bool,
}

impl Guider {
    /// The guider of a stage of `steps` steps.
    pub(super) fn new(g: &GuidanceParams, extra: &ExtraArgs, steps: usize) -> Guider {
        let schedule = fit_schedule(extra, steps, g.txt_cfg);
        let apg = Some(ApgParams::parse(extra)).filter(ApgParams::enabled);
        if apg.is_some() {
            sd_info!("using Adaptive Projected Guidance (APG)");
        }
        Guider { txt_cfg: g.txt_cfg, img_cfg: g.img_cfg, apg, momentum: Vec::new(), schedule, warned_schedule_gap: false }
    }

    /// The text guidance scale at sampler step `step` (1-based; negative for a step's first
    /// evaluation in some samplers). The reference reads its schedule from the end
    /// (`schedule[len - 1 - step]`); where that index falls before the start it reads the
    /// 4 bytes in front of the list, which are 0 with glibc's allocator, and past the end it
    /// reads whatever follows: there we use the configured scale.
    fn scale_at(&mut self, step: i32) -> f32 {
        if self.schedule.is_empty() {
            return self.txt_cfg;
        }
        let index = self.schedule.len() as i64 - 1 - i64::from(step);
        match usize::try_from(index).ok().and_then(|i| self.schedule.get(i)) {
            Some(&v) => v,
            None if index == -1 => 0.0,
            None => {
                if !self.warned_schedule_gap {
                    sd_warn!("guidance_schedule has no entry for sampler step {step}; using cfg_scale {}", self.txt_cfg);
                    self.warned_schedule_gap = true;
                }
                self.txt_cfg
            }
        }
    }

    /// The guided prediction of step `step` from the conditional prediction and the
    /// unconditional / image-unconditional ones that were run.
    pub(super) fn guide(&mut self, step: i32, cond: &Tensor, uncond: Option<&Tensor>, img_uncond: Option<&Tensor>) -> Tensor {
        let scale = self.scale_at(step);
        match self.apg {
            Some(apg) if uncond.is_some() || img_uncond.is_some() => self.apg_guide(&apg, scale, cond, uncond, img_uncond),
            _ => cfg(scale, self.img_cfg, cond, uncond, img_uncond),
        }
    }

    /// APG: the guidance direction (with momentum across evaluations), limited in norm and
    /// with its component along the conditional prediction scaled by `eta`. Sums are taken in
    /// double precision, as the reference's tensor sums are.
    fn apg_guide(&mut self, apg: &ApgParams, scale: f32, cond: &Tensor, uncond: Option<&Tensor>, img_uncond: Option<&Tensor>) -> Tensor {
        let (c, img_cfg) = (cond.data(), self.img_cfg);
        let mut d: Vec<f32> = match (uncond, img_uncond) {
            (Some(u), Some(i)) if scale == 1.0 => u.data().iter().zip(i.data()).map(|(&u, &i)| u - i).collect(),
            (Some(u), Some(i)) => {
                let e = c.iter().zip(u.data()).zip(i.data());
                e.map(|((&c, &u), &i)| c + (u * (img_cfg - scale) + i * (1.0 - img_cfg)) / (scale - 1.0)).collect()
            }
            (None, Some(i)) => c.iter().zip(i.data()).map(|(&c, &i)| c - i).collect(),
            (Some(u), None) => c.iter().zip(u.data()).map(|(&c, &u)| c - u).collect(),
            (None, None) => unreachable!("APG runs with an unconditional prediction"),
        };
        if apg.momentum != 0.0 {
            if self.momentum.len() != d.len() {
                self.momentum = vec![0.0; d.len()];
            }
            for (v, &m) in d.iter_mut().zip(&self.momentum) {
                *v += apg.momentum * m;
            }
            self.momentum.clone_from(&d);
        }
        // A sum of products in double precision, returned as float.
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&x, &y)| f64::from(x * y)).sum::<f64>() as f32;
        let mut factor = 1.0f32;
        if apg.norm_threshold > 0.0 {
            // The norm per element, relative to an SDXL 1024² latent's element count.
            const STANDARD_RES: f32 = (2 * 1024 / 8) as f32;
            let norm = dot(&d, &d).sqrt() * STANDARD_RES / (d.len() as f32).sqrt();
            if norm > 0.0 {
                let x = apg.norm_threshold / norm;
                factor = if apg.norm_threshold_smoothing <= 0.0 {
                    x.min(1.0)
                } else {
                    x / (1.0 + x.powf(1.0 / apg.norm_threshold_smoothing)).powf(apg.norm_threshold_smoothing)
                };
            }
        }
        for v in &mut d {
            *v *= factor;
        }
        if apg.eta != 1.0 {
            let cond_sq = dot(c, c);
            if cond_sq != 0.0 {
                let projection = dot(c, &d) / cond_sq;
                for (v, &cv) in d.iter_mut().zip(c) {
                    *v += (apg.eta - 1.0) * (projection * cv);
                }
            }
        }
        // The step combines with the configured scales, not the scheduled one (as the reference).
        let out: Vec<f32> = match (uncond, img_uncond) {
            (Some(_), _) if self.txt_cfg != 1.0 => c.iter().zip(&d).map(|(&c, &d)| c + (self.txt_cfg - 1.0) * d).collect(),
            (Some(_), Some(_)) => c.iter().zip(&d).map(|(&c, &d)| c + (img_cfg - 1.0) * d).collect(),
            (Some(_), None) => c.to_vec(),
            (None, Some(i)) => i.data().iter().zip(&d).map(|(&i, &d)| i + self.txt_cfg * d).collect(),
            (None, None) => unreachable!(),
        };
        Tensor::from_vec(cond.shape(), out).expect("same shape")
    }
}

/// Classifier-free guidance with text scale `cfg` and image scale `img_cfg`, in the
/// reference's order of float operations.
pub(super) fn cfg(cfg: f32, img_cfg: f32, cond: &Tensor, uncond: Option<&Tensor>, img_uncond: Option<&Tensor>) -> Tensor {
    match (uncond, img_uncond) {
        (Some(u), Some(i)) => {
            let d = cond.data().iter().zip(u.data()).zip(i.data());
            let data = d.map(|((&c, &u), &i)| (i + img_cfg * (u - i)) + cfg * (c - u)).collect();
            Tensor::from_vec(cond.shape(), data).expect("same shape")
        }
        (Some(u), None) => cond.zip(u, |c, u| u + cfg * (c - u)),
        (None, Some(i)) => cond.zip(i, |c, i| i + cfg * (c - i)),
        (None, None) => cond.clone(),
    }
}

/// Skip-layer guidance: on the steps strictly between `layer_start` and `layer_end` (as
/// fractions of the schedule's length), the prediction moves away from a pass that skips
/// `layers` by `scale`; with `slg_uncond` (extra sample arg) the unconditional pass skips
/// them instead.
pub(super) struct SkipLayerGuidance {
    pub(super) layers: Vec<i32>,
    pub(super) scale: f32,
    pub(super) uncond: bool,
    start_step: i32,
    stop_step: i32,
}

impl SkipLayerGuidance {
    pub(super) fn new(p: &SlgParams, extra: &ExtraArgs, supported: bool, schedule_len: usize) -> SkipLayerGuidance {
        let mut uncond = false;
        for (k, v) in extra.pairs() {
            if k == "slg_uncond" {
                match parse_strict_bool(v) {
                    Some(b) => uncond = b,
                    None => sd_warn!("ignoring invalid SLG extra sample arg '{k}={v}'"),
                }
            }
        }
        let mut enabled = (p.scale != 0.0 || uncond) && !p.layers.is_empty();
        if enabled && !supported {
            sd_warn!("SLG is incompatible with this model type");
            enabled = false;
        }
        SkipLayerGuidance {
            layers: if enabled { p.layers.clone() } else { Vec::new() },
            scale: if enabled { p.scale } else { 0.0 },
            uncond,
            start_step: (p.layer_start * schedule_len as f32) as i32,
            stop_step: (p.layer_end * schedule_len as f32) as i32,
        }
    }

    pub(super) fn enabled_for_step(&self, step: i32) -> bool {
        !self.layers.is_empty() && step > self.start_step && step < self.stop_step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: f32) -> Tensor {
        Tensor::full(&[1, 1, 1, 1], v)
    }

    #[test]
    fn guidance_formulas() {
        assert_eq!(cfg(7.0, 1.5, &t(2.0), Some(&t(1.0)), None).data(), &[1.0 + 7.0 * (2.0 - 1.0)]);
        assert_eq!(cfg(7.0, 1.5, &t(2.0), None, Some(&t(0.5))).data(), &[0.5 + 7.0 * (2.0 - 0.5)]);
        let want = (0.5 + 1.5 * (1.0 - 0.5)) + 7.0 * (2.0 - 1.0);
        assert_eq!(cfg(7.0, 1.5, &t(2.0), Some(&t(1.0)), Some(&t(0.5))).data(), &[want]);
        assert_eq!(cfg(7.0, 1.5, &t(2.0), None, None).data(), &[2.0]);
    }

    #[test]
    fn schedules_parse_like_the_reference() {
        assert_eq!(parse_schedule("7x2+3.5x1").unwrap(), vec![7.0, 7.0, 3.5]);
        assert_eq!(parse_schedule("4x1+").unwrap(), vec![4.0]);
        assert!(parse_schedule("7x0").is_err());
        assert!(parse_schedule("7").is_err());
        assert!(parse_schedule("7 x2").is_err());
        assert!(parse_schedule("ax2").is_err());
        assert!(parse_schedule("7x2.5").is_err());
        assert!(parse_schedule("+7x2").is_err());
        assert!(parse_schedule("7x2++3x1").is_err());
        let extra = ExtraArgs::parse(Some("guidance_schedule=9x1"));
        // Padded with cfg to the step count; longer than steps + 1 is cut to steps.
        assert_eq!(fit_schedule(&extra, 3, 5.0), vec![9.0, 5.0, 5.0]);
        assert_eq!(fit_schedule(&ExtraArgs::parse(Some("guidance_schedule=9x5")), 3, 5.0), vec![9.0; 3]);
        assert_eq!(fit_schedule(&ExtraArgs::parse(Some("guidance_schedule=9x4")), 3, 5.0), vec![9.0; 4]);
        assert!(fit_schedule(&ExtraArgs::parse(Some("guidance_schedule=bad")), 3, 5.0).is_empty());
    }

    #[test]
    fn the_schedule_is_read_from_its_end() {
        let g = GuidanceParams { txt_cfg: 5.0, ..Default::default() };
        let mut guider = Guider::new(&g, &ExtraArgs::parse(Some("guidance_schedule=1x1+2x1+3x1+4x1")), 3);
        // Four entries for three steps: step s reads entry 3 - s.
        assert_eq!([1, 2, 3].map(|s| guider.scale_at(s)), [3.0, 2.0, 1.0]);
        // A step's first evaluation (negative) has no entry: the configured scale.
        assert_eq!(guider.scale_at(-1), 5.0);
        let mut exact = Guider::new(&g, &ExtraArgs::parse(Some("guidance_schedule=1x1+2x1+3x1")), 3);
        assert_eq!([1, 2, 3].map(|s| exact.scale_at(s)), [2.0, 1.0, 0.0]);
    }

    #[test]
    fn apg_neutral_values_are_plain_cfg_and_the_norm_limit_scales_the_direction() {
        assert!(!ApgParams::parse(&ExtraArgs::parse(Some("apg_norm_threshold_smoothing=2"))).enabled());
        let p = ApgParams::parse(&ExtraArgs::parse(Some("apg_eta=0.5,apg_momentum=bad")));
        assert_eq!(p, ApgParams { eta: 0.5, ..Default::default() });
        let g = GuidanceParams { txt_cfg: 3.0, ..Default::default() };
        let cond = Tensor::from_vec(&[2, 1, 1, 1], vec![1.0, 0.0]).unwrap();
        let uncond = Tensor::from_vec(&[2, 1, 1, 1], vec![0.0, 1.0]).unwrap();
        // eta 0: the direction (1, -1) loses its component along cond (1, 0): (0, -1).
        let mut apg = Guider::new(&g, &ExtraArgs::parse(Some("apg_eta=0")), 2);
        assert_eq!(apg.guide(1, &cond, Some(&uncond), None).data(), &[1.0, -2.0]);
        // eta 1 with momentum 0.5: the second evaluation's direction adds half the first.
        let mut apg = Guider::new(&g, &ExtraArgs::parse(Some("apg_momentum=0.5")), 2);
        assert_eq!(apg.guide(1, &cond, Some(&uncond), None).data(), &[3.0, -2.0]);
        assert_eq!(apg.guide(2, &cond, Some(&uncond), None).data(), &[4.0, -3.0]);
        // A norm threshold far below the direction's norm shrinks it to the threshold.
        let mut apg = Guider::new(&g, &ExtraArgs::parse(Some("apg_norm_threshold=1")), 2);
        let out = apg.guide(1, &cond, Some(&uncond), None);
        let norm = 2f32.sqrt() * 256.0 / 2f32.sqrt();
        assert_eq!(out.data(), &[1.0 + 2.0 * (1.0 / norm), 0.0 + 2.0 * (-1.0 / norm)]);
        // Without an unconditional prediction nothing is guided.
        assert_eq!(apg.guide(1, &cond, None, None).data(), cond.data());
    }
}
