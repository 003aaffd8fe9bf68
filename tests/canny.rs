//! `preprocess_canny` reproduces the reference's control maps (tests/fixtures/golden/canny):
//! each case runs in place on its input PNG through the C entry point; every pixel must
//! match within one grey level (and the bulk exactly).

mod common;

use stable_diffusion::capi::{preprocess_canny, sd_image_t, CBool};
use std::path::Path;

fn read_png(path: &Path) -> (u32, u32, u32, Vec<u8>) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Grayscale => 1,
        other => panic!("{}: unexpected colour type {other:?}", path.display()),
    };
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    (info.width, info.height, channels, buf)
}

#[test]
fn canny_matches_the_reference_outputs() {
    let root = common::root().join("tests/fixtures");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("golden/canny/cases.json")).unwrap()).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let (w, h, c, mut pixels) = read_png(&root.join("inputs").join(case["input"].as_str().unwrap()));
        let image = sd_image_t { width: w, height: h, channel: c, data: pixels.as_mut_ptr() };
        let f = |k: &str| case[k].as_f64().unwrap() as f32;
        // SAFETY: `pixels` holds w × h × c bytes and outlives the call.
        let ok = unsafe {
            preprocess_canny(
                image,
                f("high_threshold"),
                f("low_threshold"),
                f("weak"),
                f("strong"),
                CBool::from(case["inverse"].as_bool().unwrap()),
            )
        };
        assert_eq!(ok.get(), case["ok"].as_bool().unwrap(), "{name}");

        let (gw, gh, gc, golden) = read_png(&root.join("golden/canny").join(case["output"].as_str().unwrap()));
        assert_eq!((gw, gh, gc), (w, h, c), "{name}: golden size");
        let diffs: Vec<usize> = pixels
            .iter()
            .zip(&golden)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| i)
            .collect();
        let worst = pixels.iter().zip(&golden).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
        eprintln!("{name}: {} of {} values differ (worst {worst})", diffs.len(), pixels.len());
        assert!(
            worst <= 1,
            "{name}: {} of {} values differ, worst by {worst} (first at byte {:?})",
            diffs.len(),
            pixels.len(),
            diffs.first()
        );
        assert!(diffs.len() * 100 <= pixels.len(), "{name}: {} values off by one", diffs.len());
    }
}
