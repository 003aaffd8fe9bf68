//! ggml is built like stable-diffusion.cpp's (no llamafile kernels): every product is summed
//! as in its build, so the
//! pictures and latents are bit-identical to golden. This also holds our CPU memory bounds
//! (attention scores split by query rows, large im2col matrices built piecewise) to changing
//! where numbers are kept, never the numbers.

mod common;

use common::parity::{report, run};

#[test]
fn reference_kernels_render_golden_bit_for_bit() {
    let results = run("sd1", |c| {
        ["sampler_euler", "img2img"].contains(&c.name.as_str())
    });
    report(&results);
    for r in &results {
        for d in &r.diffs {
            assert_eq!(
                d.max, 0.0,
                "{}/{}: {} differs (max {}, mean {})",
                r.folder, r.name, d.what, d.max, d.mean
            );
        }
    }
}
