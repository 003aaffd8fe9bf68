//! im2col for the CPU as a ggml custom op, with exactly the values of ggml's `im2col` (each
//! element a copy of the input rounded to f16, zero outside the image) but a faster layout
//! of the work: ggml hands the channels of one output pixel to different threads, which then
//! write into the same cache lines, and converts element by element. Here each thread owns
//! whole output rows; for a block of output pixels it converts the source row segments they
//! read once, in vector passes, then writes each pixel's patch sequentially.

use super::context::{Graph, F16, F32, T};
use ggml_sys as g;
use std::ffi::{c_int, c_void};

/// Stride, padding, dilation (x, y) and kernel size (w, h), each 0..=63, and the first
/// output row `y0` (0..=65535), packed into the op's user-data word so that the op owns no
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    s: (u8, u8),
    p: (u8, u8),
    d: (u8, u8),
    k: (u8, u8),
    y0: u16,
}

impl Geometry {
    fn pack(self) -> usize {
        let six = [self.s.0, self.s.1, self.p.0, self.p.1, self.d.0, self.d.1, self.k.0, self.k.1];
        let word = six.iter().enumerate().fold(0u64, |w, (i, &v)| w | ((v as u64 & 63) << (6 * i)));
        (word | ((self.y0 as u64) << 48)) as usize
    }

    fn unpack(word: usize) -> Geometry {
        let w = word as u64;
        let f = |i: u32| ((w >> (6 * i)) & 63) as u8;
        Geometry { s: (f(0), f(1)), p: (f(2), f(3)), d: (f(4), f(5)), k: (f(6), f(7)), y0: (w >> 48) as u16 }
    }
}

/// Output width and height of a convolution.
pub(crate) fn output_size(x_ne: [i64; 4], kernel_ne: [i64; 4], stride: (i32, i32), padding: (i32, i32), dilation: (i32, i32)) -> (i64, i64) {
    let out = |i: i64, k: i64, s: i32, p: i32, d: i32| (i + 2 * p as i64 - d as i64 * (k - 1) - 1) / (s as i64).max(1) + 1;
    (out(x_ne[0], kernel_ne[0], stride.0, padding.0, dilation.0), out(x_ne[1], kernel_ne[1], stride.1, padding.1, dilation.1))
}

/// `[IC·KH·KW, OW, rows.1, N]` f16 patches of `x` (f32 `[W, H, IC, N]`) for a kernel of
/// `kernel_ne` (`[KW, KH, IC, OC]`) and the output rows `rows.0 .. rows.0 + rows.1` (all rows
/// when None), like `ggml_im2col(.., is_2D = true, F16)`. None when the op does not apply
/// (other types, geometry beyond 63, 32-bit targets): the caller then uses ggml's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn im2col_f16<'g>(
    g: &'g Graph,
    kernel_ne: [i64; 4],
    x: T<'g>,
    stride: (i32, i32),
    padding: (i32, i32),
    dilation: (i32, i32),
    rows: Option<(i64, i64)>,
) -> Option<T<'g>> {
    let six = |v: i64, min: i64| u8::try_from(v).ok().filter(|&b| b as i64 >= min && b < 64);
    let (ow, full_oh) = output_size(x.ne(), kernel_ne, stride, padding, dilation);
    let (y0, oh) = rows.unwrap_or((0, full_oh));
    let geo = Geometry {
        s: (six(stride.0 as i64, 1)?, six(stride.1 as i64, 1)?),
        p: (six(padding.0 as i64, 0)?, six(padding.1 as i64, 0)?),
        d: (six(dilation.0 as i64, 1)?, six(dilation.1 as i64, 1)?),
        k: (six(kernel_ne[0], 1)?, six(kernel_ne[1], 1)?),
        y0: u16::try_from(y0).ok()?,
    };
    if usize::BITS < 64 || x.ty() != F32 || !x.is_contiguous() {
        return None;
    }
    let [_, _, ic, n] = x.ne();
    if ow <= 0 || oh <= 0 || y0 < 0 || y0 + oh > full_oh || ic != kernel_ne[2] {
        return None;
    }
    let k = ic * geo.k.0 as i64 * geo.k.1 as i64;
    let mut args = [x.raw()];
    // SAFETY: a live context and source; the callback only reads the source and writes its
    // own output; the geometry travels by value in the user-data word.
    let p = unsafe {
        g::ggml_custom_4d(
            g.ctx(),
            F16,
            k,
            ow,
            oh,
            n,
            args.as_mut_ptr(),
            1,
            Some(im2col_rows),
            -1, // GGML_N_TASKS_MAX: every thread
            geo.pack() as *mut c_void,
        )
    };
    Some(x.wrap(p))
}

/// The op body: thread `ith` of `nth` fills its share of the output rows (n, oy).
pub(super) unsafe extern "C" fn im2col_rows(dst: *mut g::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the tensor built by `im2col_f16`: an f16 output of
        // [K, OW, OH, N] elements and a contiguous f32 source [W, H, IC, N], both allocated.
        unsafe { fill_rows(dst, ith as i64, nth.max(1) as i64, Geometry::unpack(userdata as usize)) }
    });
}

/// Output pixels of a row handled together: every source row segment they read is
/// converted once into a small buffer, from which each pixel's patch is then written in one
/// sequential pass (ESRGAN's 192-channel 3×3 convolutions otherwise spend about as long
/// gathering patches as multiplying them).
const BLOCK: i64 = 16;

unsafe fn fill_rows(dst: *mut g::ggml_tensor, ith: i64, nth: i64, geo: Geometry) {
    // SAFETY (whole function): see `im2col_rows`; every index below stays inside the shapes.
    unsafe {
        let src = (*dst).src[0];
        let [iw, ih, ic, _] = (*src).ne;
        let snb = (*src).nb;
        let [k, ow, oh, n] = (*dst).ne;
        let (kw, kh) = (geo.k.0 as usize, geo.k.1 as i64);
        let (sx, sy, dx, dy, px, py) = (geo.s.0 as i64, geo.s.1 as i64, geo.d.0 as usize, geo.d.1 as i64, geo.p.0 as i64, geo.p.1 as i64);
        let rows = oh * n;
        let per = (rows + nth - 1) / nth;
        let (first, last) = ((ith * per).min(rows), ((ith + 1) * per).min(rows));
        let src_base = (*src).data as *const u8;
        let dst_base = (*dst).data as *mut u16;
        // Source columns one block of output pixels reads on one kernel row, and those
        // segments (as f16) for every channel and kernel row.
        let span = ((BLOCK - 1) * sx) as usize + (kw - 1) * dx + 1;
        let segments = (ic * kh) as usize;
        let mut wide = vec![0f32; span];
        let mut halves = vec![0u16; segments * span];
        for r in first..last {
            let (b, oy) = (r / oh, r % oh + geo.y0 as i64);
            let out_row = dst_base.add((r * ow * k) as usize);
            let mut ox0 = 0;
            while ox0 < ow {
                let nb = BLOCK.min(ow - ox0);
                let x_start = ox0 * sx - px;
                let len = ((nb - 1) * sx) as usize + (kw - 1) * dx + 1;
                // The part of [x_start, x_start + len) inside the image.
                let lo = (-x_start).clamp(0, len as i64) as usize;
                let hi = (iw - x_start).clamp(lo as i64, len as i64) as usize;
                for c in 0..ic {
                    let plane = src_base.add((b as usize) * snb[3] + (c as usize) * snb[2]);
                    for ky in 0..kh {
                        let iy = oy * sy + ky * dy - py;
                        let half = &mut halves[(c * kh + ky) as usize * span..][..len];
                        if iy < 0 || iy >= ih {
                            half.fill(0);
                            continue;
                        }
                        let row = plane.add(iy as usize * snb[1]) as *const f32;
                        if lo == 0 && hi == len {
                            to_f16(std::slice::from_raw_parts(row.offset(x_start as isize), len), half);
                            continue;
                        }
                        wide[..lo].fill(0.0);
                        for (t, w) in wide[lo..hi].iter_mut().enumerate() {
                            *w = *row.offset(x_start as isize + (lo + t) as isize);
                        }
                        wide[hi..len].fill(0.0);
                        to_f16(&wide[..len], half);
                    }
                }
                for j in 0..nb {
                    let out = std::slice::from_raw_parts_mut(out_row.add((ox0 + j) as usize * k as usize), k as usize);
                    let first_col = (j * sx) as usize;
                    if kw == 3 && dx == 1 {
                        for (o, seg) in out.chunks_exact_mut(3).zip(halves.chunks_exact(span)) {
                            o.copy_from_slice(&seg[first_col..first_col + 3]);
                        }
                    } else {
                        for (o, seg) in out.chunks_exact_mut(kw).zip(halves.chunks_exact(span)) {
                            for (kx, v) in o.iter_mut().enumerate() {
                                *v = seg[first_col + kx * dx];
                            }
                        }
                    }
                }
                ox0 += nb;
            }
        }
    }
}

/// f32 → f16, rounding to nearest even like ggml's CPU conversion (F16C when the CPU has it,
/// otherwise ggml's own software conversion, which rounds the same way).
fn to_f16(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the features were just detected.
            unsafe { to_f16_f16c(src, dst) };
            return;
        }
    }
    // SAFETY: both slices hold src.len() elements.
    unsafe { g::ggml_fp32_to_fp16_row(src.as_ptr(), dst.as_mut_ptr(), src.len() as i64) };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn to_f16_f16c(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    // SAFETY: every access is below n; unaligned loads and stores.
    unsafe {
        while i + 8 <= n {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            i += 8;
        }
        while i < n {
            let v = _mm_set_ss(src[i]);
            let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            dst[i] = _mm_extract_epi16::<0>(h) as u16;
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_round_trips_through_the_user_data_word() {
        let g = Geometry { s: (1, 2), p: (0, 3), d: (1, 1), k: (3, 63), y0: 65535 };
        assert_eq!(Geometry::unpack(g.pack()), g);
    }

    #[test]
    fn vector_and_software_f16_conversions_agree() {
        let vals: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37e-3 + (i % 7) as f32 * 1e3).chain([65504.0, 65520.0, 1e-8, -0.0, 6.1e-5]).collect();
        let mut a = vec![0u16; vals.len()];
        let mut b = vec![0u16; vals.len()];
        to_f16(&vals, &mut a);
        // SAFETY: both hold vals.len() elements.
        unsafe { g::ggml_fp32_to_fp16_row(vals.as_ptr(), b.as_mut_ptr(), vals.len() as i64) };
        assert_eq!(a, b);
    }
}
