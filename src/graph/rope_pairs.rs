//! The DiTs' rotary embedding by rotation matrices (`pe` [2, 2, d/2, L]: per position and
//! pair, the 2×2 matrix) as one CPU op. The reference builds it from a permuted copy of q or
//! k, a second one that splits the pairs, two `repeat`s, two products and a sum: six passes
//! over the tensor per projection and block (5 % of a Wan step). This op reads `x` where it
//! is and writes the same values, bit for bit: per output element the two products, each
//! rounded to f32, then their sum (ggml's `mul`, `mul` and `add`).

use super::context::{Graph, F32, T};
use ggml_sys as g;
use std::ffi::{c_int, c_void};

/// `x` [d, H, L, N] (f32) rotated by `pe` (f32 [2, 2, d/2, L]) → [d, L, H·N], pairing
/// elements 2i and 2i + 1 (`interleaved`) or i and i + d/2; on the CPU, else None.
pub(crate) fn rotate<'g>(g: &'g Graph, x: T<'g>, pe: T<'g>, interleaved: bool) -> Option<T<'g>> {
    if !g.on_cpu || super::eval_callback::is_set() || usize::BITS < 64 {
        return None;
    }
    let [d, h, l, n] = x.ne();
    if x.ty() != F32 || pe.ty() != F32 || d % 2 != 0 || pe.ne() != [2, 2, d / 2, l] {
        return None;
    }
    let mut args = [x.raw(), pe.raw()];
    // SAFETY: a live context and sources; the callback reads its sources and writes only its
    // own output; the pairing travels by value in the user-data word.
    let y = unsafe { g::ggml_custom_4d(g.ctx(), F32, d, l, h * n, 1, args.as_mut_ptr(), 2, Some(compute), -1, interleaved as usize as *mut c_void) };
    Some(x.wrap(y))
}

pub(super) unsafe extern "C" fn compute(dst: *mut g::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `rotate`: f32 x [d, H, L, N] (any
        // strides), f32 pe [2, 2, d/2, L] (any strides), a contiguous f32 output [d, L, H·N].
        unsafe {
            let dt = &*dst;
            let (x, pe) = (&*dt.src[0], &*dt.src[1]);
            let [d, h, l, n] = x.ne.map(|v| v as usize);
            let half = d / 2;
            let interleaved = userdata as usize != 0;
            let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
            let rows = l * h * n;
            let (r0, r1) = (rows * ith / nth, rows * (ith + 1) / nth);
            let xb = x.data as *const u8;
            let pb = pe.data as *const u8;
            let out = dt.data as *mut f32;
            // (where a, where b) of pair i: element indices in x's first axis and the output's.
            let pair = |i: usize| if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            for row in r0..r1 {
                // Output row `row` = position `li` of head-batch `hn` (h fastest).
                let (li, hn) = (row % l, row / l);
                let (hi, ni) = (hn % h, hn / h);
                let src = xb.add(hi * x.nb[1] + li * x.nb[2] + ni * x.nb[3]);
                let dst_row = out.add(row * d);
                for i in 0..half {
                    let (ia, ib) = pair(i);
                    let xa = *(src.add(ia * x.nb[0]) as *const f32);
                    let xv = *(src.add(ib * x.nb[0]) as *const f32);
                    // pe(b, a, i, l): the product with x's element a (b = 0) or b (b = 1) for
                    // output a of the pair.
                    let p = |b: usize, a: usize| *(pb.add(b * pe.nb[0] + a * pe.nb[1] + i * pe.nb[2] + li * pe.nb[3]) as *const f32);
                    *dst_row.add(ia) = xa * p(0, 0) + xv * p(1, 0);
                    *dst_row.add(ib) = xa * p(0, 1) + xv * p(1, 1);
                }
            }
        }
    });
}
