//! RMS normalisation over the outermost axis of `[W, H, T, C]` (the video VAE's norm over
//! channels) as a ggml custom op on the CPU. ggml's `rms_norm` works on the innermost axis,
//! which costs a transposed copy of the tensor before and after (at a video decoder's full
//! resolution, 100 MB each); this op reads the channels where they are and writes ggml's
//! values followed by the product with γ, bit for bit: per pixel the squares (f32) summed in
//! f64 in channel order, the mean rounded to f32, `scale = 1 / sqrtf(mean + eps)`, then
//! `(x · scale) · γ` in f32.

use super::context::{Graph, F32, T};
use ggml_sys as g;
use std::ffi::{c_int, c_void};

/// Pixels whose sums one pass keeps.
const BLOCK: usize = 256;

/// `x` [W, H, T, C] (f32, contiguous) normalised over C and multiplied by `gamma` (f32, C
/// values), when the graph runs on the CPU; otherwise None (the caller permutes).
pub(crate) fn rms_norm_channels<'g>(g: &'g Graph, x: T<'g>, gamma: T<'g>, eps: f32) -> Option<T<'g>> {
    let c = x.ne()[3];
    let gamma_len: i64 = gamma.ne().iter().product();
    if !g.on_cpu || super::eval_callback::is_set() || usize::BITS < 64 || c < 1 {
        return None;
    }
    if x.ty() != F32 || gamma.ty() != F32 || !x.is_contiguous() || !gamma.is_contiguous() || gamma_len != c {
        return None;
    }
    let [w, h, t, _] = x.ne();
    let mut args = [x.raw(), gamma.raw()];
    // SAFETY: a live context and sources; the callback reads its sources and writes only its
    // own output; eps travels by value in the user-data word.
    let y = unsafe { g::ggml_custom_4d(g.ctx(), F32, w, h, t, c, args.as_mut_ptr(), 2, Some(compute), -1, eps.to_bits() as usize as *mut c_void) };
    Some(x.wrap(y))
}

pub(super) unsafe extern "C" fn compute(dst: *mut g::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `rms_norm_channels`: contiguous f32
        // x [W, H, T, C], γ of C values and an output shaped like x, all allocated.
        unsafe {
            let d = &*dst;
            let (x, gamma) = (&*d.src[0], &*d.src[1]);
            let c = d.ne[3] as usize;
            let pixels = (d.ne[0] * d.ne[1] * d.ne[2]) as usize;
            let x = std::slice::from_raw_parts(x.data as *const f32, pixels * c);
            let gamma = std::slice::from_raw_parts(gamma.data as *const f32, c);
            let y = std::slice::from_raw_parts_mut(d.data as *mut f32, pixels * c);
            let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
            let blocks = pixels.div_ceil(BLOCK);
            let eps = f32::from_bits(userdata as usize as u32);
            for b in (ith..blocks).step_by(nth) {
                let p0 = b * BLOCK;
                norm_block(x, gamma, y, pixels, p0..(p0 + BLOCK).min(pixels), eps);
            }
        }
    });
}

/// Pixels `range` of every channel (channel `ch` of pixel `p` at `ch · pixels + p`).
fn norm_block(x: &[f32], gamma: &[f32], y: &mut [f32], pixels: usize, range: std::ops::Range<usize>, eps: f32) {
    let n = range.len();
    let mut sums = [0f64; BLOCK];
    for ch in 0..gamma.len() {
        let row = &x[ch * pixels + range.start..][..n];
        for (s, &v) in sums.iter_mut().zip(row) {
            *s += (v * v) as f64;
        }
    }
    let mut scale = [0f32; BLOCK];
    for (k, s) in scale.iter_mut().zip(&sums).take(n) {
        let mean = (s / gamma.len() as f64) as f32;
        *k = 1.0 / (mean + eps).sqrt();
    }
    for (ch, &gm) in gamma.iter().enumerate() {
        let at = ch * pixels + range.start;
        for ((o, &v), &k) in y[at..at + n].iter_mut().zip(&x[at..at + n]).zip(&scale) {
            *o = v * k * gm;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::graph::backend::Backend;
    use crate::graph::runner::Runner;
    use std::sync::Arc;

    /// ggml's `rms_norm` over the channels moved innermost, times γ, moved back: the same
    /// bits, for pixel counts that fill no block evenly and a tail of one.
    #[test]
    fn matches_ggml_rms_norm_bit_for_bit() {
        let backend = Arc::new(Backend::cpu().unwrap());
        for (w, h, t, c) in [(7i64, 5i64, 3i64, 19i64), (16, 16, 1, 96), (257, 1, 1, 4)] {
            let n = (w * h * t * c) as usize;
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 - 500.0) * 0.0137).collect();
            let gamma: Vec<f32> = (0..c).map(|i| 1.0 + (i as f32) * 0.031).collect();
            let run = |ours: bool| {
                let mut r = Runner::new(backend.clone(), 3);
                r.compute(|g| {
                    let xt = g.input_f32(&x, &[w, h, t, c]);
                    let gt = g.input_f32(&gamma, &[c]);
                    Ok(if ours {
                        super::rms_norm_channels(g, xt, gt, 1e-12).expect("the op applies")
                    } else {
                        xt.permute_axes([3, 0, 1, 2]).contiguous().rms_norm(1e-12).mul(gt).permute_axes([1, 2, 3, 0]).contiguous()
                    })
                })
                .unwrap()
            };
            let (want, got) = (run(false), run(true));
            assert_eq!(want.shape(), got.shape());
            let bits = |t: &crate::tensor::Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&want) == bits(&got), "{w}x{h}x{t}x{c}");
        }
    }
}
