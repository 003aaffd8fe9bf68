//! Name conversion against ~14k conversions the reference made (every naming scheme,
//! many model versions): tests/fixtures/io/names_reference.tsv.

use stable_diffusion::io::{convert_tensor_name, SdVersion};

#[test]
fn matches_reference_conversions() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/io/names_reference.tsv");
    let text = std::fs::read_to_string(path).expect("fixture");
    let mut checked = 0;
    let mut failures = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let mut fields = line.split('\t');
        let input = fields.next().expect("input");
        for group in fields {
            let (versions, expected) = group.split_once('=').expect("group");
            let expected = if expected == "@" { input } else { expected };
            for v in versions.split(',') {
                let raw: u32 = v.parse().expect("version");
                let version = SdVersion::from_raw(raw);
                assert!(version.is_some() || raw == 47, "bad version {raw}");
                let got = convert_tensor_name(input, version);
                checked += 1;
                if got != expected {
                    failures.push(format!("{input} @ {raw}: got {got}, want {expected}"));
                }
            }
        }
    }
    assert!(checked > 10000, "only {checked} cases");
    assert!(failures.is_empty(), "{} of {checked} differ:\n{}", failures.len(), failures[..failures.len().min(40)].join("\n"));
}

#[test]
fn names_the_reference_crashes_on_are_kept() {
    for n in ["cond_stage_model.model.transformer.resblocks.5", "conditioner.embedders.1.model.transformer.resblocks."] {
        let v = Some(SdVersion::Sd2);
        assert!(!convert_tensor_name(n, v).is_empty());
    }
}
