//! Linear layers of ComfyUI `int8_tensorwise` checkpoints (with or without ConvRot), as the
//! reference's ggml fork computes them on the CPU (`ggml_quantize_i8_convrot` followed by
//! `ggml_mul_mat_i8_tensorwise`), here one custom op:
//!
//! - each activation row, with a ConvRot group `G` (a power of 4), is rotated group by group
//!   by the normalized regular Hadamard matrix (the Kronecker power of H4 / 2 that the
//!   checkpoint's weights were rotated by): scaled by `1/sqrt(G)` first, then radix-4
//!   butterflies with strides 1, 4, 16, … summed left to right in f32;
//! - the row gets one dynamic scale `s = max|v| / 127` and is rounded to i8 as
//!   `rint(v · (1/s))` (ties to even) within ±127 (all zeros when `s` is 0);
//! - each output is the exact i32 sum of products with the weight's I8 row, then
//!   `(sum · s) · row_scale + bias`, the last step one fused multiply-add as GCC contracts
//!   the fork's two statements on x86.
//!
//! The work splits by rows and outputs; every value comes from one thread, so the result
//! does not depend on the thread count.

use super::context::{Graph, F32, I8, T};
use ggml_sys as g;
use std::ffi::{c_int, c_void};

/// `x` [K, rows…] (f32, contiguous) times the I8 weight `w` [K, N] with row scales
/// `scales` [N] and `bias` [N] → [N, rows…]. `scale_by` ≠ 1 scales the input before and the
/// output after (the bias added last), as the reference's `Linear` does with its `scale`.
pub(crate) fn linear<'g>(g: &'g Graph, x: T<'g>, w: T<'g>, scales: T<'g>, bias: Option<T<'g>>, group: u32, scale_by: f32) -> T<'g> {
    debug_assert!(w.ty() == I8 && x.ty() == F32 && x.is_contiguous());
    let x = if scale_by != 1.0 { super::nn::scale(x, scale_by, false) } else { x };
    let fused = if scale_by == 1.0 { bias } else { None };
    let ne = x.ne();
    let n = w.ne()[1];
    let mut args: Vec<*mut g::ggml_tensor> = vec![x.raw(), w.raw(), scales.raw()];
    args.extend(fused.map(|b| b.raw()));
    // SAFETY: a live context and sources; the callback reads its sources and writes only its
    // own output; the group travels by value in the user-data word.
    let y = unsafe { g::ggml_custom_4d(g.ctx(), F32, n, ne[1], ne[2], ne[3], args.as_mut_ptr(), args.len() as c_int, Some(compute), -1, group as usize as *mut c_void) };
    let y = x.wrap(y);
    if scale_by == 1.0 {
        return y;
    }
    let y = super::nn::scale(y, 1.0 / scale_by, false);
    match bias {
        Some(b) => y.add_inplace(b),
        None => y,
    }
}

/// Outputs one piece of work covers.
const OUT_BLOCK: usize = 64;

pub(super) unsafe extern "C" fn compute(dst: *mut g::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `linear`: contiguous f32 x [K, rows],
        // contiguous I8 w [K, N], f32 scales [N], optional f32 bias [N], f32 output [N, rows].
        unsafe {
            let d = &*dst;
            let (x, w, s) = (&*d.src[0], &*d.src[1], &*d.src[2]);
            let (k, n) = (x.ne[0] as usize, d.ne[0] as usize);
            let rows = (d.ne[1] * d.ne[2] * d.ne[3]) as usize;
            let layer = Layer {
                x: std::slice::from_raw_parts(x.data as *const f32, k * rows),
                w: std::slice::from_raw_parts(w.data as *const i8, k * n),
                scales: std::slice::from_raw_parts(s.data as *const f32, n),
                bias: (!d.src[3].is_null()).then(|| std::slice::from_raw_parts((*d.src[3]).data as *const f32, n)),
                k,
                group: userdata as usize,
            };
            let y = std::slice::from_raw_parts_mut(d.data as *mut f32, n * rows);
            let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
            // Pieces (row, block of outputs) in row order, a contiguous run per thread, so
            // each thread quantizes a row once.
            let blocks = n.div_ceil(OUT_BLOCK);
            let pieces = rows * blocks;
            let (first, last) = (pieces * ith / nth, pieces * (ith + 1) / nth);
            let mut q = vec![0i8; k];
            let mut work = vec![0f32; k];
            let mut quantized: Option<(usize, f32)> = None;
            for piece in first..last {
                let (row, block) = (piece / blocks, piece % blocks);
                let row_scale = match quantized {
                    Some((r, s)) if r == row => s,
                    _ => {
                        let s = quantize_row(&layer.x[row * k..(row + 1) * k], layer.group, &mut work, &mut q);
                        quantized = Some((row, s));
                        s
                    }
                };
                let outs = block * OUT_BLOCK..((block + 1) * OUT_BLOCK).min(n);
                layer.outputs(&q, row_scale, outs.clone(), &mut y[row * n + outs.start..row * n + outs.end]);
            }
        }
    });
}

struct Layer<'a> {
    x: &'a [f32],
    w: &'a [i8],
    scales: &'a [f32],
    bias: Option<&'a [f32]>,
    k: usize,
    group: usize,
}

impl Layer<'_> {
    /// Outputs `outs` of one quantized row `q` with scale `row_scale`.
    fn outputs(&self, q: &[i8], row_scale: f32, outs: std::ops::Range<usize>, y: &mut [f32]) {
        for (o, out) in outs.zip(y.iter_mut()) {
            let sum = dot(q, &self.w[o * self.k..(o + 1) * self.k]);
            let v = sum as f32 * row_scale;
            *out = match self.bias {
                Some(b) => v.mul_add(self.scales[o], b[o]),
                None => v * self.scales[o],
            };
        }
    }
}

/// Rotates `x` into `work` (with `group` > 0), then quantizes it into `q`; the row's scale.
pub(crate) fn quantize_row(x: &[f32], group: usize, work: &mut [f32], q: &mut [i8]) -> f32 {
    work.copy_from_slice(x);
    if group > 0 {
        for chunk in work.chunks_exact_mut(group) {
            rotate(chunk);
        }
    }
    let mut amax = 0f32;
    for &v in work.iter() {
        let a = v.abs();
        // The fork's MAX(a, b): `a > b ? a : b`, NaN included.
        amax = if amax > a { amax } else { a };
    }
    let scale = amax / 127.0;
    if scale == 0.0 {
        q.fill(0);
        return scale;
    }
    let inv = 1.0 / scale;
    for (o, &v) in q.iter_mut().zip(work.iter()) {
        *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// The normalized regular Hadamard transform of one group (its length a power of 4), in
/// place, in the fork's order of operations.
pub(crate) fn rotate(v: &mut [f32]) {
    let n = v.len();
    let norm = 1.0 / (n as f32).sqrt();
    for x in v.iter_mut() {
        *x *= norm;
    }
    let mut stride = 1;
    while stride < n {
        for base in (0..n).step_by(4 * stride) {
            for j in base..base + stride {
                let (a, b, c, d) = (v[j], v[j + stride], v[j + 2 * stride], v[j + 3 * stride]);
                v[j] = a + b + c - d;
                v[j + stride] = a + b - c + d;
                v[j + 2 * stride] = a - b + c + d;
                v[j + 3 * stride] = -a + b + c + d;
            }
        }
        stride *= 4;
    }
}

/// The exact i32 dot product of two I8 rows.
fn dot(a: &[i8], b: &[i8]) -> i32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
}

fn dot_portable(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// The same sum, compiled for AVX2 (integer sums are exact in any order).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[i8], b: &[i8]) -> i32 {
    dot_portable(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, ParamStore, Runner, Scope, TypeMap};
    use std::sync::Arc;

    /// The regular Hadamard matrix entry (row, col) of size 4^levels, from H4's digits.
    fn hadamard(row: usize, col: usize, levels: u32) -> f64 {
        const H4: [[f64; 4]; 4] = [[1., 1., 1., -1.], [1., 1., -1., 1.], [1., -1., 1., 1.], [-1., 1., 1., 1.]];
        (0..levels).map(|l| H4[(row >> (2 * l)) & 3][(col >> (2 * l)) & 3]).product::<f64>() / 2f64.powi(levels as i32)
    }

    #[test]
    fn rotation_is_the_regular_hadamard_matrix() {
        for levels in 0..=4u32 {
            let n = 4usize.pow(levels);
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25).collect();
            let mut v = x.clone();
            rotate(&mut v);
            for (r, &got) in v.iter().enumerate() {
                let want: f64 = (0..n).map(|c| hadamard(r, c, levels) * x[c] as f64).sum();
                assert!((got as f64 - want).abs() < 1e-5, "n {n} row {r}: {got} vs {want}");
            }
            // orthogonal and symmetric: rotating twice gives the input back
            rotate(&mut v);
            for (a, b) in v.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn quantization_rounds_ties_to_even_and_scales_by_the_row_maximum() {
        let (mut work, mut q) = (vec![0f32; 4], vec![0i8; 4]);
        let s = quantize_row(&[127.0, -63.5, 0.5, 1.5], 0, &mut work, &mut q);
        assert_eq!((s, q.as_slice()), (1.0, &[127, -64, 0, 2][..]));
        let s = quantize_row(&[0.0; 4], 4, &mut work, &mut q);
        assert_eq!((s, q.as_slice()), (0.0, &[0, 0, 0, 0][..]));
        // a NaN never wins the maximum once a number follows it, and quantizes to 0
        let s = quantize_row(&[f32::NAN, 2.0, -1.0, 0.0], 0, &mut work, &mut q);
        assert_eq!(s, 2.0 / 127.0);
        assert_eq!(q[0], 0);
    }

    /// The layer through the graph against the formulas in f64 (the products are exact).
    #[test]
    fn the_op_matches_the_formulas_for_every_thread_count() {
        let (k, n, rows) = (64usize, 70usize, 3usize);
        let x: Vec<f32> = (0..k * rows).map(|i| ((i * 7919 % 97) as f32 - 48.0) / 17.0).collect();
        let w: Vec<i8> = (0..k * n).map(|i| ((i * 31 % 255) as i32 - 127) as i8).collect();
        let scales: Vec<f32> = (0..n).map(|o| 0.001 + o as f32 * 1e-4).collect();
        let bias: Vec<f32> = (0..n).map(|o| o as f32 * 0.01 - 0.3).collect();
        for group in [0u32, 1, 16, 64] {
            let mut want = vec![0f32; n * rows];
            for r in 0..rows {
                let (mut work, mut q) = (vec![0f32; k], vec![0i8; k]);
                let s = quantize_row(&x[r * k..(r + 1) * k], group as usize, &mut work, &mut q);
                for o in 0..n {
                    let sum: i64 = (0..k).map(|i| q[i] as i64 * w[o * k + i] as i64).sum();
                    want[r * n + o] = (sum as f32 * s).mul_add(scales[o], bias[o]);
                }
            }
            for threads in [1, 2, 3] {
                let mut store = ParamStore::new(8).unwrap();
                let types: TypeMap = [("l.weight".to_string(), I8)].into_iter().collect();
                let int8 = [("l.weight".to_string(), group)].into_iter().collect();
                let lin = crate::graph::nn::Linear::new(&mut Scope::new(&mut store, &types, "").with_int8(&int8), "l", k as i64, n as i64, true);
                let backend = Arc::new(Backend::cpu().unwrap());
                store.alloc(&backend).unwrap();
                let bytes: Vec<u8> = w.iter().map(|&v| v as u8).collect();
                let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
                store.set_data(lin.weight, &bytes).unwrap();
                store.set_data(lin.int8.unwrap().0, &f32_bytes(&scales)).unwrap();
                store.set_data(lin.bias.unwrap(), &f32_bytes(&bias)).unwrap();
                let mut runner = Runner::new(backend, threads);
                let y = runner.compute(|g| Ok(lin.forward(g, g.input_f32(&x, &[k as i64, rows as i64])))).unwrap();
                assert_eq!(y.data(), want.as_slice(), "group {group}, {threads} threads");
            }
        }
    }
}
