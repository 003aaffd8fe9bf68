//! The three noise generators reproduce the reference's numbers bit for bit: expected
//! values come from the reference's generator classes compiled with g++ 12 / libstdc++ /
//! glibc on x86-64 (`tests/fixtures/runtime/rng_reference.json`: per generator and seed, the
//! bit patterns of successive `randn` calls of sizes 5, 3, 17, 16, 33 and 250).

use serde_json::Value;
use stable_diffusion::runtime::rng::new_rng;
use stable_diffusion::types::RngType;

#[test]
fn generators_match_reference_bits() {
    let path = format!("{}/tests/fixtures/runtime/rng_reference.json", env!("CARGO_MANIFEST_DIR"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 18);
    for case in cases {
        let kind = RngType::parse(case["rng"].as_str().unwrap()).unwrap();
        let seed: u64 = case["seed"].as_str().unwrap().parse().unwrap();
        let mut rng = new_rng(kind, seed);
        for (call, want) in case["calls"].as_array().unwrap().iter().enumerate() {
            let want: Vec<u32> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|h| u32::from_str_radix(h.as_str().unwrap(), 16).unwrap())
                .collect();
            let got: Vec<u32> = rng.randn(want.len()).iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{kind} seed {seed} call {call}");
        }
    }
}
