//! Control-image preprocessing: the Canny edge map of `preprocess_canny`.
//!
//! The arithmetic follows the reference step by step in f32 (grey conversion, 5×5 Gaussian
//! with σ = 1.4, Sobel, gradient magnitude normalised by its maximum, non-maximum
//! suppression, double threshold with hysteresis), including its quirks, so that control
//! maps come out the same byte for byte.

use crate::error::Result;

const PI: f32 = std::f32::consts::PI;

/// Parameters of [`canny`] (those of the C function).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CannyParams {
    /// Strong-edge threshold, relative to the strongest gradient.
    pub high_threshold: f32,
    /// Weak-edge threshold, relative to the strong one.
    pub low_threshold: f32,
    /// Value given to weak edges before hysteresis.
    pub weak: f32,
    /// Value given to strong edges.
    pub strong: f32,
    /// Write `1 - edge` instead of `edge`.
    pub inverse: bool,
}

/// A single-channel f32 plane, row-major.
struct Plane {
    w: usize,
    h: usize,
    v: Vec<f32>,
}

impl Plane {
    fn zeros(w: usize, h: usize) -> Plane {
        Plane { w, h, v: vec![0.0; w * h] }
    }

    fn at(&self, x: usize, y: usize) -> f32 {
        self.v[y * self.w + x]
    }

    fn set(&mut self, x: usize, y: usize, value: f32) {
        self.v[y * self.w + x] = value;
    }

    fn max(&self) -> f32 {
        self.v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }

    /// Zero-padded 2-D correlation with a square `k × k` kernel (row-major), centred.
    fn convolve(&self, kernel: &[f32], k: usize) -> Plane {
        let pad = (k / 2) as isize;
        let mut out = Plane::zeros(self.w, self.h);
        for y in 0..self.h {
            for x in 0..self.w {
                let mut sum = 0.0f32;
                for ky in 0..k {
                    let iy = y as isize + ky as isize - pad;
                    if iy < 0 || iy >= self.h as isize {
                        continue;
                    }
                    for kx in 0..k {
                        let ix = x as isize + kx as isize - pad;
                        if ix < 0 || ix >= self.w as isize {
                            continue;
                        }
                        sum += self.at(ix as usize, iy as usize) * kernel[ky * k + kx];
                    }
                }
                out.set(x, y, sum);
            }
        }
        out
    }
}

fn gaussian_kernel_5x5() -> [f32; 25] {
    let sigma = 1.4f32;
    let var = sigma * sigma;
    let norm = 1.0f32 / (2.0f32 * PI * var);
    let mut k = [0.0f32; 25];
    for y in 0..5 {
        for x in 0..5 {
            let (dy, dx) = (y as f32 - 2.0, x as f32 - 2.0);
            k[y * 5 + x] = (-((dy * dy + dx * dx) / (2.0f32 * var))).exp() * norm;
        }
    }
    k
}

const SOBEL_X: [f32; 9] = [-1.0, 0.0, 1.0, -2.0, 0.0, 2.0, -1.0, 0.0, 1.0];
const SOBEL_Y: [f32; 9] = [1.0, 2.0, 1.0, 0.0, 0.0, 0.0, -1.0, -2.0, -1.0];

/// Keeps a gradient only where it is a local maximum across the edge.
///
/// The reference's direction test only ever selects the vertical neighbours (for angles up
/// to 157.5°); steeper-than-157.5° gradients compare against 1.0, i.e. survive only at the
/// global maximum. Kept as is: control maps must match.
fn non_max_suppression(g: &Plane, theta: &Plane) -> Plane {
    let mut out = Plane::zeros(g.w, g.h);
    for y in 1..g.h.saturating_sub(1) {
        for x in 1..g.w.saturating_sub(1) {
            let mut angle = theta.at(x, y) * 180.0f32 / PI;
            if angle < 0.0 {
                angle += 180.0;
            }
            let (q, r) = if angle <= 157.5 { (g.at(x, y + 1), g.at(x, y - 1)) } else { (1.0, 1.0) };
            let cur = g.at(x, y);
            out.set(x, y, if cur >= q && cur >= r { cur } else { 0.0 });
        }
    }
    out
}

/// Double threshold, a 3-pixel border cleared, then weak pixels kept next to strong ones
/// (in scan order, in place, looking at six of the eight neighbours like the reference).
fn hysteresis(img: &mut Plane, p: &CannyParams) {
    if img.v.is_empty() {
        return;
    }
    let ht = img.max() * p.high_threshold;
    let lt = ht * p.low_threshold;
    for v in img.v.iter_mut() {
        if *v >= ht {
            *v = p.strong;
        } else if *v >= lt {
            *v = p.weak;
        }
    }
    let (w, h) = (img.w as isize, img.h as isize);
    for y in 0..img.h {
        for x in 0..img.w {
            let (xi, yi) = (x as isize, y as isize);
            if !(xi >= 3 && xi <= w - 3 && yi >= 3 && yi <= h - 3) {
                img.set(x, y, 0.0);
            }
        }
    }
    for y in 1..img.h.saturating_sub(1) {
        for x in 1..img.w.saturating_sub(1) {
            if img.at(x, y) != p.weak {
                continue;
            }
            let neighbours = [(x + 1, y - 1), (x + 1, y), (x, y - 1), (x, y + 1), (x - 1, y - 1), (x - 1, y)];
            let strong = neighbours.iter().any(|&(nx, ny)| img.at(nx, ny) == p.strong);
            img.set(x, y, if strong { p.strong } else { 0.0 });
        }
    }
}

fn to_u8(v: f32) -> u8 {
    if v <= 0.0 {
        0
    } else if v >= 1.0 {
        255
    } else {
        (v * 255.0f32 + 0.5f32) as u8
    }
}

/// Replaces an interleaved 8-bit image by its Canny edge map, written to every channel.
/// RGB(A) images are converted to grey like the reference; a grey image (1 or 2 channels,
/// which the reference rejects by aborting) is used as it is.
pub fn canny(pixels: &mut [u8], width: usize, height: usize, channels: usize, p: &CannyParams) -> Result<()> {
    ensure!(channels >= 1, "canny needs at least one channel");
    let n = width
        .checked_mul(height)
        .and_then(|n| n.checked_mul(channels))
        .ok_or_else(|| crate::error::Error::new("canny: image size overflows"))?;
    ensure!(pixels.len() >= n, "canny: image buffer holds {} bytes, {width}x{height}x{channels} needs {n}", pixels.len());
    if n == 0 {
        return Ok(());
    }

    let mut grey = Plane::zeros(width, height);
    for (i, px) in pixels.chunks_exact(channels).take(width * height).enumerate() {
        grey.v[i] = if channels >= 3 {
            let (r, g, b) = (px[0] as f32 / 255.0f32, px[1] as f32 / 255.0f32, px[2] as f32 / 255.0f32);
            0.2989f32 * r + 0.5870f32 * g + 0.1140f32 * b
        } else {
            px[0] as f32 / 255.0f32
        };
    }
    let grey = grey.convolve(&gaussian_kernel_5x5(), 5);
    let ix = grey.convolve(&SOBEL_X, 3);
    let iy = grey.convolve(&SOBEL_Y, 3);

    let mut g = Plane::zeros(width, height);
    let mut theta = Plane::zeros(width, height);
    for i in 0..g.v.len() {
        g.v[i] = (ix.v[i] * ix.v[i] + iy.v[i] * iy.v[i]).sqrt();
        theta.v[i] = iy.v[i].atan2(ix.v[i]);
    }
    let max = g.max();
    if max != 0.0 && max.is_finite() {
        let scale = 1.0f32 / max;
        g.v.iter_mut().for_each(|v| *v *= scale);
    }

    let mut edges = non_max_suppression(&g, &theta);
    hysteresis(&mut edges, p);

    for (i, px) in pixels.chunks_exact_mut(channels).take(width * height).enumerate() {
        let e = edges.v[i];
        let v = to_u8(if p.inverse { 1.0 - e } else { e });
        px.fill(v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> CannyParams {
        CannyParams { high_threshold: 0.08, low_threshold: 0.08, weak: 0.8, strong: 1.0, inverse: false }
    }

    #[test]
    fn flat_image_has_no_edges_and_inverse_is_white() {
        let mut px = vec![77u8; 16 * 12 * 3];
        canny(&mut px, 16, 12, 3, &params()).unwrap();
        assert!(px.iter().all(|&v| v == 0));
        let mut px = vec![77u8; 16 * 12 * 4];
        canny(&mut px, 16, 12, 4, &CannyParams { inverse: true, ..params() }).unwrap();
        assert!(px.iter().all(|&v| v == 255));
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut px = vec![0u8; 8];
        canny(&mut px, 2, 2, 2, &params()).unwrap(); // grey + alpha is accepted
        assert!(canny(&mut px, 2, 2, 0, &params()).is_err());
        assert!(canny(&mut px, 2, 2, 3, &params()).is_err());
        assert!(canny(&mut px, usize::MAX, 2, 3, &params()).is_err());
        canny(&mut [], 0, 0, 3, &params()).unwrap();
        let mut tiny = vec![9u8; 3];
        canny(&mut tiny, 1, 1, 3, &params()).unwrap();
    }

    #[test]
    fn vertical_step_gives_an_edge() {
        let (w, h) = (20, 20);
        let mut px = vec![0u8; w * h * 3];
        for y in 0..h {
            for x in w / 2..w {
                px[(y * w + x) * 3..][..3].fill(255);
            }
        }
        canny(&mut px, w, h, 3, &params()).unwrap();
        let row = 10;
        let edge: Vec<u8> = (0..w).map(|x| px[(row * w + x) * 3]).collect();
        assert!(edge.contains(&255), "{edge:?}");
        assert_eq!(edge[2], 0);
    }
}
