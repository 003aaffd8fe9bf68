//! Every sigma schedule the reference computed for the sd1 model (eps and EDM-v
//! prediction, every scheduler × steps {1,2,3,4,8,20,30} × sizes {64², 256²}) is reproduced
//! to a relative error of 1e-5. Where the reference produced NaN (Karras / exponential at
//! one step) or crashed (GITS at one step) we must give a finite schedule or a clean error.

use serde_json::Value;
use stable_diffusion::runtime::args::ExtraArgs;
use stable_diffusion::runtime::defaults::ModelFamily;
use stable_diffusion::runtime::denoiser::Denoiser;
use stable_diffusion::types::{Prediction, Scheduler};

const STEPS: [u32; 7] = [1, 2, 3, 4, 8, 20, 30];
const SIZES: [usize; 2] = [64, 256];

fn scheduler_from_golden(name: &str) -> Scheduler {
    let short = name.trim_end_matches("_SCHEDULER").to_ascii_lowercase();
    Scheduler::parse(&short).unwrap_or_else(|| panic!("unknown scheduler {name}"))
}

fn sigmas_for(
    pred: Prediction,
    scheduler: Scheduler,
    steps: u32,
    size: usize,
) -> stable_diffusion::error::Result<Vec<f32>> {
    let mut d = Denoiser::new(pred, None);
    let seq_len = ((size / 8) * (size / 8)) as i32;
    d.get_sigmas(steps, seq_len, scheduler, ModelFamily::Sd1, &ExtraArgs::default())
}

fn check_file(file: &str, pred: Prediction) -> (usize, usize, f64) {
    let path = format!("{}/tests/fixtures/golden/sigmas/{file}", env!("CARGO_MANIFEST_DIR"));
    // The generator wrote NaN as a bare `NaN` token, which is not JSON: read it as null.
    let text = std::fs::read_to_string(&path).unwrap().replace("NaN", "null");
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), Scheduler::ALL.len() * STEPS.len() * SIZES.len());
    let (mut matched, mut sanitized, mut max_rel) = (0, 0, 0f64);
    for (index, case) in cases.iter().enumerate() {
        if case["reference_crashed"].as_bool() == Some(true) {
            let idx = case["config_index"].as_u64().unwrap() as usize;
            let scheduler = Scheduler::ALL[idx / 14];
            let steps = STEPS[(idx % 14) / 2];
            let size = SIZES[idx % 2];
            if let Ok(s) = sigmas_for(pred, scheduler, steps, size) {
                assert!(
                    s.iter().all(|v| v.is_finite()) && s.len() >= 2,
                    "{scheduler} {steps}: {s:?}"
                );
                assert_eq!(*s.last().unwrap(), 0.0);
            }
            sanitized += 1;
            continue;
        }
        let scheduler = scheduler_from_golden(case["scheduler"].as_str().unwrap());
        let steps = case["steps"].as_u64().unwrap() as u32;
        let size = case["width"].as_u64().unwrap() as usize;
        assert_eq!(STEPS[(index % 14) / 2], steps);
        let want: Vec<Option<f64>> =
            case["sigmas"].as_array().unwrap().iter().map(|v| v.as_f64()).collect();
        let got = sigmas_for(pred, scheduler, steps, size).unwrap();
        if want.iter().any(|v| v.is_none()) {
            // The reference divided by zero: ours must be finite, start at sigma_max, end at 0.
            assert_eq!(got.len(), want.len(), "{scheduler} {steps}");
            assert!(got.iter().all(|v| v.is_finite()), "{scheduler} {steps}: {got:?}");
            assert_eq!(*got.last().unwrap(), 0.0);
            sanitized += 1;
            continue;
        }
        assert_eq!(got.len(), want.len(), "{file}: {scheduler} steps {steps} size {size}: {got:?}");
        for (g, w) in got.iter().zip(&want) {
            let w = w.unwrap();
            let err = if w == 0.0 { (*g as f64).abs() } else { ((*g as f64 - w) / w).abs() };
            max_rel = max_rel.max(err);
            assert!(
                err <= 1e-5,
                "{file}: {scheduler} steps {steps} size {size}: got {got:?}, want {want:?}"
            );
        }
        matched += 1;
    }
    (matched, sanitized, max_rel)
}

#[test]
fn golden_sigmas_eps() {
    let (matched, sanitized, max_rel) = check_file("sd1_eps.json", Prediction::Eps);
    eprintln!("sd1_eps: {matched} matched, {sanitized} sanitized, max rel err {max_rel:e}");
    assert_eq!(matched + sanitized, 224);
}

#[test]
fn golden_sigmas_edm_v() {
    let (matched, sanitized, max_rel) = check_file("sd1_edm_v.json", Prediction::EdmV);
    eprintln!("sd1_edm_v: {matched} matched, {sanitized} sanitized, max rel err {max_rel:e}");
    assert_eq!(matched + sanitized, 224);
}
