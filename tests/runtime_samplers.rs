//! All 21 samplers against the reference's sampler code run as an oracle (compiled outside
//! this repository with g++ 12 on x86-64): same toy model, same Philox noise, diffusion
//! and flow schedules, several eta values and extra options. The fixture
//! `tests/fixtures/runtime/sampler_reference.json` holds, per case, the model calls
//! (sigma bits and step number) and the bit patterns of the final latent.
//!
//! Toy model: denoised = x / (1 + 0.1 sigma) + 0.1 sin(x), unconditional = 0.7 x.

use serde_json::Value;
use stable_diffusion::error::Result;
use stable_diffusion::runtime::args::ExtraArgs;
use stable_diffusion::runtime::rng::{new_rng, randn};
use stable_diffusion::runtime::samplers::{sample, ModelOutput};
use stable_diffusion::tensor::Tensor;
use stable_diffusion::types::{RngType, SampleMethod};

fn bits(v: &Value) -> u32 {
    u32::from_str_radix(v.as_str().unwrap(), 16).unwrap()
}

#[test]
fn samplers_match_reference_bits() {
    let path =
        format!("{}/tests/fixtures/runtime/sampler_reference.json", env!("CARGO_MANIFEST_DIR"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let shape: Vec<usize> =
        doc["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let schedules: Vec<Vec<f32>> = doc["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect();
    let mut failures = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for case in doc["cases"].as_array().unwrap() {
        let method = SampleMethod::parse(case["method"].as_str().unwrap()).unwrap();
        seen.insert(method);
        let sigmas = &schedules[case["schedule"].as_u64().unwrap() as usize];
        let is_flow = case["flow"].as_bool().unwrap();
        let eta = case["eta"].as_f64().unwrap() as f32;
        let extra = case["extra"].as_str();
        let label = format!("{method} flow={is_flow} eta={eta} extra={extra:?}");

        let mut init = new_rng(RngType::Cuda, 7);
        let x = randn(&shape, init.as_mut()).map(|v| v * sigmas[0]);
        let mut rng = new_rng(RngType::Cuda, 42);
        let mut calls: Vec<(u32, i32)> = Vec::new();
        let mut model = |x: &Tensor, sigma: f32, step: i32| -> Result<ModelOutput> {
            calls.push((sigma.to_bits(), step));
            let k = 1.0f32 / (1.0 + 0.1 * sigma);
            Ok(ModelOutput {
                denoised: x.map(|v| v * k + 0.1 * v.sin()),
                uncond_denoised: Some(x.map(|v| v * 0.7)),
            })
        };
        let out =
            sample(method, &mut model, x, sigmas, rng.as_mut(), eta, is_flow, &ExtraArgs::parse(extra), None).unwrap();

        let want_calls: Vec<(u32, i32)> = case["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (bits(&c[0]), c[1].as_i64().unwrap() as i32))
            .collect();
        if calls != want_calls {
            failures.push(format!("{label}: calls {calls:x?} want {want_calls:x?}"));
            continue;
        }
        let want: Vec<f32> =
            case["out"].as_array().unwrap().iter().map(|h| f32::from_bits(bits(h))).collect();
        let exact =
            out.data().iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
        if exact != want.len() {
            let max_diff =
                out.data().iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            failures.push(format!(
                "{label}: {exact}/{} bit-exact, max |diff| {max_diff:e}",
                want.len()
            ));
        }
    }
    assert_eq!(seen.len(), SampleMethod::ALL.len(), "every sampler is covered");
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}
