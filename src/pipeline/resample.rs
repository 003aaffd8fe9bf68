//! Resizing of latents and images over their first two dimensions with the filters the
//! hires fix offers: PyTorch-style nearest-exact, (bi)linear, bicubic (a = -0.75) and
//! Lanczos-3, optionally antialiased (the filter stretched by the downscale factor and its
//! weights normalised). Like the reference, these run on the host in f64: each output
//! value is the sum over the row contributors (outer) and column contributors (inner) of
//! `input · wx · wy`, rounded to f32 once.

use crate::error::Result;
use crate::tensor::Tensor;

/// A separable resampling filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
    Lanczos,
}

impl Filter {
    /// Half-width of the kernel at scale 1.
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Bicubic => {
                // Keys' cubic with a = -0.75, PyTorch's choice.
                const A: f64 = -0.75;
                if x <= 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if x >= 3.0 {
                    0.0
                } else {
                    sinc(x) * sinc(x / 3.0)
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x.abs() < 1e-12 {
        return 1.0;
    }
    let px = std::f64::consts::PI * x;
    px.sin() / px
}

/// For every output index along one axis: the (clamped) input indices and their weights.
fn contributors(input: usize, output: usize, filter: Filter, antialias: bool) -> Vec<Vec<(usize, f64)>> {
    let scale = input as f64 / output as f64;
    let filter_scale = if antialias { scale.max(1.0) } else { 1.0 };
    let support = filter.support() * filter_scale;
    let last = input as i64 - 1;
    (0..output)
        .map(|o| {
            let center = (o as f64 + 0.5) * scale - 0.5;
            let (start, end) = ((center - support).ceil() as i64, (center + support).floor() as i64);
            let mut axis = Vec::with_capacity((end - start + 1).max(0) as usize);
            let mut sum = 0.0;
            for i in start..=end {
                let w = filter.weight((center - i as f64) / filter_scale);
                if w == 0.0 {
                    continue;
                }
                axis.push((i.clamp(0, last) as usize, w));
                sum += w;
            }
            // Plain bilinear and bicubic weights already sum to one; Lanczos and stretched
            // kernels do not.
            if (antialias || filter == Filter::Lanczos) && sum.abs() > 1e-12 {
                for c in &mut axis {
                    c.1 /= sum;
                }
            }
            if axis.is_empty() {
                axis.push((((center + 0.5).floor() as i64).clamp(0, last) as usize, 1.0));
            }
            axis
        })
        .collect()
}

fn check(t: &Tensor, out_w: usize, out_h: usize) -> Result<(usize, usize, usize)> {
    let (w, h) = (t.ne(0), t.ne(1));
    ensure!(t.shape().len() >= 2 && w > 0 && h > 0 && !t.is_empty(), "cannot resize a tensor of shape {:?}", t.shape());
    ensure!(out_w > 0 && out_h > 0, "cannot resize {w}x{h} to {out_w}x{out_h}");
    Ok((w, h, t.len() / (w * h)))
}

fn with_size(t: &Tensor, out_w: usize, out_h: usize) -> Vec<usize> {
    let mut shape = t.shape().to_vec();
    shape[0] = out_w;
    shape[1] = out_h;
    shape
}

/// Resizes dimensions 0 and 1 of `t` to `out_w`×`out_h` with `filter`; the other
/// dimensions are independent planes. Same size: `t` unchanged.
pub fn resize_filtered(t: &Tensor, out_w: usize, out_h: usize, filter: Filter, antialias: bool) -> Result<Tensor> {
    let (w, h, planes) = check(t, out_w, out_h)?;
    if (w, h) == (out_w, out_h) {
        return Ok(t.clone());
    }
    let xs = contributors(w, out_w, filter, antialias);
    let ys = contributors(h, out_h, filter, antialias);
    let src = t.data();
    let mut out = Vec::with_capacity(out_w * out_h * planes);
    for plane in src.chunks_exact(w * h) {
        for y_axis in &ys {
            for x_axis in &xs {
                let mut v = 0.0f64;
                for &(iy, wy) in y_axis {
                    let row = &plane[iy * w..(iy + 1) * w];
                    for &(ix, wx) in x_axis {
                        v += row[ix] as f64 * wx * wy;
                    }
                }
                out.push(v as f32);
            }
        }
    }
    Tensor::from_vec(&with_size(t, out_w, out_h), out)
}

/// PyTorch's `nearest-exact` over dimensions 0 and 1: output `o` reads input
/// `floor((o + 0.5) · in / out)` (clamped), i.e. the pixel whose centre is nearest.
pub fn resize_nearest_exact(t: &Tensor, out_w: usize, out_h: usize) -> Result<Tensor> {
    let (w, h, _) = check(t, out_w, out_h)?;
    if (w, h) == (out_w, out_h) {
        return Ok(t.clone());
    }
    let index = |o: usize, input: usize, output: usize| {
        let center = (o as f64 + 0.5) * (input as f64 / output as f64) - 0.5;
        ((center + 0.5).floor() as i64).clamp(0, input as i64 - 1) as usize
    };
    let xs: Vec<usize> = (0..out_w).map(|o| index(o, w, out_w)).collect();
    let ys: Vec<usize> = (0..out_h).map(|o| index(o, h, out_h)).collect();
    let mut out = Vec::with_capacity(out_w * out_h * (t.len() / (w * h)));
    for plane in t.data().chunks_exact(w * h) {
        for &iy in &ys {
            out.extend(xs.iter().map(|&ix| plane[iy * w + ix]));
        }
    }
    Tensor::from_vec(&with_size(t, out_w, out_h), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(w: usize, h: usize, c: usize) -> Tensor {
        Tensor::from_vec(&[w, h, c, 1], (0..w * h * c).map(|i| (i * 7 % 23) as f32 / 4.0).collect()).unwrap()
    }

    #[test]
    fn constants_stay_constant_and_same_size_is_identity() {
        let flat = Tensor::full(&[5, 3, 2, 1], 0.75);
        for f in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos] {
            for aa in [false, true] {
                for (ow, oh) in [(10, 6), (2, 2), (7, 1)] {
                    let out = resize_filtered(&flat, ow, oh, f, aa).unwrap();
                    assert_eq!(out.shape(), &[ow, oh, 2, 1]);
                    assert!(out.data().iter().all(|&v| (v - 0.75).abs() < 1e-6), "{f:?} {aa} {ow}x{oh}: {:?}", out.data());
                }
            }
            let t = ramp(4, 3, 2);
            assert_eq!(resize_filtered(&t, 4, 3, f, false).unwrap().data(), t.data());
        }
    }

    #[test]
    fn bilinear_doubling_matches_torch() {
        // torch.nn.functional.interpolate([[0, 1, 2, 3]], size=8, mode="linear",
        // align_corners=False) over one row.
        let t = Tensor::from_vec(&[4, 1, 1, 1], vec![0.0, 1.0, 2.0, 3.0]).unwrap();
        let out = resize_filtered(&t, 8, 1, Filter::Bilinear, false).unwrap();
        assert_eq!(out.data(), &[0.0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3.0]);
    }

    #[test]
    fn bicubic_doubling_matches_torch() {
        // torch: interpolate(x, size=8, mode="bicubic", align_corners=False) on one row
        // (height 1) of [0, 1, 4, 9]: the borders replicate.
        let t = Tensor::from_vec(&[4, 1, 1, 1], vec![0.0, 1.0, 4.0, 9.0]).unwrap();
        let out = resize_filtered(&t, 8, 1, Filter::Bicubic, false).unwrap();
        // (Values from PyTorch's own formulation: floor index, fraction t, four clamped taps.)
        let want = [-0.10546875f64, 0.12109375, 0.45703125, 1.609375, 2.828125, 5.44921875, 7.97265625, 9.52734375];
        for (g, w) in out.data().iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{:?}", out.data());
        }
    }

    #[test]
    fn lanczos_and_antialiasing_normalise_their_weights() {
        for (f, aa) in [(Filter::Lanczos, false), (Filter::Bilinear, true), (Filter::Bicubic, true)] {
            for c in contributors(9, 4, f, aa).into_iter().chain(contributors(4, 9, f, aa)) {
                let sum: f64 = c.iter().map(|x| x.1).sum();
                assert!((sum - 1.0).abs() < 1e-12, "{f:?} {aa}: {c:?}");
            }
        }
        // Antialiased downscaling by 2 with the linear filter: taps 1/8, 3/8, 3/8, 1/8.
        let c = &contributors(8, 4, Filter::Bilinear, true)[1];
        assert_eq!(c, &[(1, 0.125), (2, 0.375), (3, 0.375), (4, 0.125)]);
    }

    #[test]
    fn nearest_exact_picks_the_nearest_centre() {
        let t = Tensor::from_vec(&[3, 1, 1, 1], vec![10.0, 20.0, 30.0]).unwrap();
        // torch nearest-exact 3 → 5: indices floor((o + 0.5) * 0.6) = 0, 0, 1, 2, 2.
        assert_eq!(resize_nearest_exact(&t, 5, 1).unwrap().data(), &[10.0, 10.0, 20.0, 30.0, 30.0]);
        // 3 → 2: floor((o + 0.5) * 1.5) = 0, 2.
        assert_eq!(resize_nearest_exact(&t, 2, 1).unwrap().data(), &[10.0, 30.0]);
        let t = ramp(3, 2, 4);
        let out = resize_nearest_exact(&t, 6, 4).unwrap();
        assert_eq!(out.shape(), &[6, 4, 4, 1]);
        // Plane 1, x 2 (→ 1), y 0 (→ 0).
        assert_eq!(out.data()[6 * 4 + 2], t.data()[3 * 2 + 1]);
    }

    #[test]
    fn bad_sizes_are_errors() {
        let t = ramp(2, 2, 1);
        assert!(resize_filtered(&t, 0, 2, Filter::Bicubic, false).is_err());
        assert!(resize_nearest_exact(&t, 2, 0).is_err());
        assert!(resize_filtered(&Tensor::zeros(&[0, 2, 1, 1]), 2, 2, Filter::Bilinear, false).is_err());
    }
}
