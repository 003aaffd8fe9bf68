//! The fast path's float products (issue 28, `fast=1`; never on the exact path). Every
//! output is a sum of `SUB`-value chunks' sums, each in order, in f32, by outer-product
//! register tiles: 16 weight rows (two 8-lane vectors) × 6 columns, one column value
//! broadcast at a time. The
//! exact kernels keep ggml's four lane groups per output and its reduction, which costs
//! passes, stores and horizontal sums; here nothing is reduced and the tile is bound by the
//! FMA ports. Operands are rounded as ggml rounds them (activations to f16 for f16
//! weights), so only the summation order differs from the exact path, as the reference's
//! llamafile build differs from its default build.
//!
//! Blocking: a task's A block (≤ 128 rows) is packed once, row panels of 16 stored
//! k-major; columns go in chunks of `NC`, each over K chunks of `KC` (the A slice of a K
//! chunk stays in L2 across the chunk's column groups, a group's packed columns in L1),
//! each `SUB` values' sums added to the outputs.

use super::{scalar, Dot, Elem, Problem, Task};
use std::arch::x86_64::*;

/// Rows of a tile (two vectors).
const MR: usize = 16;
/// Columns of a tile: 12 accumulators, 2 weight vectors and a broadcast in 16 registers.
const NR: usize = 6;
/// K values per packed chunk.
const KC: usize = 256;
/// K values summed in registers before they join the output (see `tile`).
const SUB: usize = 64;
/// Columns per chunk (their outputs stay in L2 across the K chunks).
const NC: usize = 96;

/// Per-thread buffers, kept between calls.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The packed A block: panel q's k-th row of 16 at vector 2·(q·k_len + k).
    a: Vec<__m256>,
    /// One column group's K chunk: column j at `j · KC`.
    b: Vec<f32>,
    /// (batch, first row) of the A block now packed.
    a_key: Option<(usize, usize)>,
}

/// Whether these kernels run on this CPU: AVX2 without AVX-512VL, whose exact 16-lane
/// kernels outrun these 8-lane tiles.
pub(crate) fn available() -> bool {
    super::x86::available() && !super::x86::avx512vl_allowed()
}

/// Whether these kernels compute `p`: float dots (q8_0 keeps its exact kernel).
pub(crate) fn supports(p: &Problem) -> bool {
    matches!(p.dot, Dot::F16 | Dot::F32)
}

/// Runs the thread's tasks (consecutive ones over the same rows pack them once).
///
/// # Safety
/// AVX2, FMA and F16C present; `p` describes live memory (see `gemm::run`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn run(p: &Problem, tasks: impl Iterator<Item = Task>, s: &mut Scratch) {
    s.a_key = None;
    for t in tasks {
        task(p, &t, s);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task(p: &Problem, t: &Task, s: &mut Scratch) {
    let k = p.k;
    let (rows, cols) = (t.m1 - t.m0, t.n1 - t.n0);
    let panels = rows.div_ceil(MR);
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let arow = arow.wrapping_add(t.m0 * p.a.nb[0]);
    if s.a.len() < panels * 2 * k {
        s.a.resize(panels * 2 * k, _mm256_setzero_ps());
    }
    if s.b.len() < NR * KC {
        s.b.resize(NR * KC, 0.0);
    }
    let a = s.a.as_mut_ptr() as *mut f32;
    if s.a_key != Some((t.batch, t.m0)) {
        for q in 0..panels {
            let src = arow.wrapping_add(q * MR * p.a.nb[0]);
            pack_a(p.a.ty == Elem::F16, src, p.a.nb[0], (rows - q * MR).min(MR), k, a.add(q * MR * k));
        }
        s.a_key = Some((t.batch, t.m0));
    }
    let b_kind = match (p.dot, p.b.ty) {
        (Dot::F16, Elem::F32) => BKind::F32AsF16,
        (_, Elem::F16) => BKind::F16,
        _ => BKind::F32,
    };
    let b = s.b.as_mut_ptr();
    let ldc = p.out_nb[0];
    for c0 in (0..cols).step_by(NC) {
        let c1 = (c0 + NC).min(cols);
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            for g0 in (c0..c1).step_by(NR) {
                let nr = NR.min(c1 - g0);
                let n = t.n0 + g0;
                pack_b(b_kind, brow.wrapping_add(n * p.b.nb[0]), p.b.nb[0], nr, k0, kc, b);
                let col = out.add(n * ldc);
                for q in 0..panels {
                    let mr = MR.min(rows - q * MR);
                    let dst = col.add(4 * (t.m0 + q * MR));
                    for s0 in (0..kc).step_by(SUB) {
                        tile(a.add(q * MR * k + (k0 + s0) * MR), b.add(s0), SUB.min(kc - s0), dst, ldc, mr, nr, k0 + s0 == 0);
                    }
                }
            }
        }
    }
}

/// How a column's values become the f32 the products take.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BKind {
    F16,
    F32,
    /// f32 rounded to f16 (what ggml converts activations to for f16 weights).
    F32AsF16,
}

/// Packs `rows` (≤ 16) rows of `k` values into a panel `[k][16]`, zeros past `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_a(f16: bool, src: *const u8, stride: usize, rows: usize, k: usize, dst: *mut f32) {
    let k8 = if rows == MR { k & !7 } else { 0 };
    let load = |r: usize, i: usize| -> __m256 {
        let row = src.add(r * stride);
        if f16 {
            _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * i) as *const __m128i))
        } else {
            _mm256_loadu_ps(row.add(4 * i) as *const f32)
        }
    };
    for i in (0..k8).step_by(8) {
        for half in 0..2 {
            let v: [__m256; 8] = std::array::from_fn(|r| load(half * 8 + r, i));
            let cols = transpose8(v);
            for (j, c) in cols.iter().enumerate() {
                _mm256_storeu_ps(dst.add((i + j) * MR + half * 8), *c);
            }
        }
    }
    for i in k8..k {
        for r in 0..MR {
            *dst.add(i * MR + r) = if r < rows {
                let row = src.add(r * stride);
                if f16 {
                    scalar::f16_to_f32((row.add(2 * i) as *const u16).read_unaligned())
                } else {
                    (row.add(4 * i) as *const f32).read_unaligned()
                }
            } else {
                0.0
            };
        }
    }
}

/// The columns of an 8 × 8 block of rows.
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// Packs values k0..k0 + kc of `nr` (≤ 6) columns into `dst` (column j at j · KC), zeros
/// for the columns past `nr`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_b(kind: BKind, src: *const u8, stride: usize, nr: usize, k0: usize, kc: usize, dst: *mut f32) {
    let k8 = kc & !7;
    for j in 0..NR {
        let out = dst.add(j * KC);
        if j >= nr {
            std::ptr::write_bytes(out, 0, kc);
            continue;
        }
        let row = src.add(j * stride);
        for i in (0..k8).step_by(8) {
            let at = k0 + i;
            let v = match kind {
                BKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * at) as *const __m128i)),
                BKind::F32 => _mm256_loadu_ps(row.add(4 * at) as *const f32),
                BKind::F32AsF16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(row.add(4 * at) as *const f32))),
            };
            _mm256_storeu_ps(out.add(i), v);
        }
        for i in k8..kc {
            let at = k0 + i;
            *out.add(i) = match kind {
                BKind::F16 => scalar::f16_to_f32((row.add(2 * at) as *const u16).read_unaligned()),
                BKind::F32 => (row.add(4 * at) as *const f32).read_unaligned(),
                BKind::F32AsF16 => scalar::f16_to_f32(scalar::f32_to_f16((row.add(4 * at) as *const f32).read_unaligned())),
            };
        }
    }
}

/// One k of a tile: 12 fused multiply-adds.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // j indexes both halves of the tile
unsafe fn step(a: *const f32, b: *const f32, part: &mut [[__m256; NR]; 2], i: usize) {
    let a0 = _mm256_loadu_ps(a.add(i * MR));
    let a1 = _mm256_loadu_ps(a.add(i * MR + 8));
    for j in 0..NR {
        let bj = _mm256_broadcast_ss(&*b.add(j * KC + i));
        part[0][j] = _mm256_fmadd_ps(a0, bj, part[0][j]);
        part[1][j] = _mm256_fmadd_ps(a1, bj, part[1][j]);
    }
}

/// One tile over at most `SUB` values of k: outputs (rows `dst`.., columns `ldc` bytes
/// apart) = their value so far (none when `first`) + this stretch's Σ a·b, summed on its
/// own first: a sum in stretches carries the rounding of about √64 + √(k/64) terms, not √k
/// (ggml's four 8-lane accumulators carry √(k/32), llamafile's one √(k/8)). Stretches of
/// 32 cost 8-12 % of the speed for no measurable gain in the pictures. Only `mr` × `nr`
/// is stored.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn tile(a: *const f32, b: *const f32, kc: usize, dst: *mut u8, ldc: usize, mr: usize, nr: usize, first: bool) {
    let full = mr == MR && nr == NR;
    let mut edge = [0f32; MR * NR];
    let mut c = [[_mm256_setzero_ps(); NR]; 2];
    if kc == SUB {
        for i in 0..SUB {
            step(a, b, &mut c, i);
        }
    } else {
        for i in 0..kc {
            step(a, b, &mut c, i);
        }
    }
    if full {
        for j in 0..NR {
            let col = dst.add(j * ldc) as *mut f32;
            if first {
                _mm256_storeu_ps(col, c[0][j]);
                _mm256_storeu_ps(col.add(8), c[1][j]);
            } else {
                _mm256_storeu_ps(col, _mm256_add_ps(_mm256_loadu_ps(col), c[0][j]));
                _mm256_storeu_ps(col.add(8), _mm256_add_ps(_mm256_loadu_ps(col.add(8)), c[1][j]));
            }
        }
    } else {
        for j in 0..NR {
            _mm256_storeu_ps(edge.as_mut_ptr().add(j * MR), c[0][j]);
            _mm256_storeu_ps(edge.as_mut_ptr().add(j * MR + 8), c[1][j]);
        }
        for j in 0..nr {
            let col = dst.add(j * ldc) as *mut f32;
            for i in 0..mr {
                let v = edge[j * MR + i];
                *col.add(i) = if first { v } else { *col.add(i) + v };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{bytes, check_fast_sums, values};
    use super::super::{scalar, Dot, Elem};

    /// What the kernels multiply: the value as stored, and activations of f16 weights as f16.
    fn seen(x: f32, e: Elem, round: bool) -> f64 {
        let h = |x: f32| scalar::f16_to_f32(scalar::f32_to_f16(x));
        (if e == Elem::F16 || round { h(x) } else { x }) as f64
    }

    /// Every output within the bound of f32 sums in K chunks of the operands the kernels
    /// see ((min(k, 64) + chunks) · 2⁻²⁴ · Σ|a·b|, from an f64 sum), over shapes with
    /// partial tiles, K chunks with tails, batches with a broadcast A, and any thread count
    /// giving the same bits.
    #[test]
    fn fast_products_are_chunked_f32_sums() {
        // Where these kernels do not run (no AVX2, or AVX-512VL's exact kernels instead).
        if !super::available() {
            return;
        }
        let shapes = [(1, 1, 1), (7, 5, 3), (300, 17, 13), (513, 40, 7), (256, 16, 6), (1000, 33, 50), (40, 130, 200)];
        let kinds = [(Dot::F16, Elem::F16, Elem::F32), (Dot::F16, Elem::F16, Elem::F16), (Dot::F32, Elem::F32, Elem::F32), (Dot::F32, Elem::F32, Elem::F16)];
        for (si, &(k, m, n)) in shapes.iter().enumerate() {
            for &(dot, ea, eb) in &kinds {
                // Two output batches sharing one A (ggml's broadcast), the second B shifted.
                let (a, b) = (values(si as u64 + 1, k * m), values(si as u64 + 100, k * n * 2));
                let (ab, bb) = (bytes(&a, ea), bytes(&b, eb));
                let round = dot == Dot::F16 && eb == Elem::F32;
                let term = |bi: usize, j: usize, i: usize, x: usize| seen(a[i * k + x], ea, false) * seen(b[bi * k * n + j * k + x], eb, round);
                let roundings = k.min(super::SUB) + k.div_ceil(super::SUB);
                check_fast_sums(&format!("{dot:?} {ea:?}×{eb:?}"), dot, (ea, &ab), (eb, &bb), (k, m, n), roundings, term);
            }
        }
    }
}
