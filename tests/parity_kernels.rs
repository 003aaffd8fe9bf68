//! With ggml's reference matrix kernels (`SD_CPU_REFERENCE_KERNELS=1`; quantized models use
//! them automatically) every product is summed as in stable-diffusion.cpp's build, so the
//! pictures and latents are bit-identical to golden. This also holds our CPU memory bounds
//! (attention scores split by query rows, large im2col matrices built piecewise) to changing
//! where numbers are kept, never the numbers.

mod common;

use common::parity::{report, run};

#[test]
fn reference_kernels_render_golden_bit_for_bit() {
    // This file holds one test, so its process sets the variable before any context exists.
    std::env::set_var("SD_CPU_REFERENCE_KERNELS", "1");
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
