//! AVX2 kernels. Every output is accumulated exactly as ggml's AVX2 `vec_dot` does it (the
//! same 8-lane fused multiply-adds, in the same order, the same reduction), but a register
//! tile of MR rows × NR columns shares each loaded vector, and the operands are repacked
//! once into f32 panels so that the inner loop only loads and multiplies.
//!
//! Panel layout (float dots): the k elements of a row are split into 32-element blocks; lane
//! group j (0..4) of every block feeds ggml's accumulator j. A panel of R rows stores, for
//! j = 0..4, for each block c, the R rows' 8 values of group j — so the pass of accumulator
//! j reads one contiguous stretch — followed by the rows' tails (k mod 32 values each).
//! With AVX-512, groups j and j + 1 are packed side by side and share a 16-lane register
//! (lanes 8-15 are group j + 1's accumulator): the same operations per lane.

use super::{Dot, Elem, Lines, Problem, Task};
use std::arch::x86_64::*;

/// Rows of a float register tile; its columns are the entry point's `NR` (3 with 16 AVX2
/// registers, 6 with AVX-512's 32: each block then loads 10 vectors for 24 products, and the
/// weight panel streamed from L2 serves twice the columns).
pub(crate) const MR: usize = 4;

/// Whether this CPU runs the vector kernels.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// How a source row becomes f32 lanes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Load {
    F16,
    F32,
    /// f32 rounded to f16 first (ggml converts f32 activations for f16 weights).
    F32AsF16,
}

#[inline(always)]
unsafe fn load8(kind: Load, row: *const u8, i: usize) -> __m256 {
    match kind {
        Load::F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * i) as *const __m128i)),
        Load::F32 => _mm256_loadu_ps(row.add(4 * i) as *const f32),
        Load::F32AsF16 => {
            let v = _mm256_loadu_ps(row.add(4 * i) as *const f32);
            _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
        }
    }
}

#[inline(always)]
unsafe fn load1(kind: Load, row: *const u8, i: usize) -> f32 {
    match kind {
        Load::F16 => super::scalar::f16_to_f32((row.add(2 * i) as *const u16).read_unaligned()),
        Load::F32 => (row.add(4 * i) as *const f32).read_unaligned(),
        Load::F32AsF16 => {
            let v = (row.add(4 * i) as *const f32).read_unaligned();
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v))))
        }
    }
}

/// Packs every lane group of `tiles` tiles of R rows (`rows` real ones, `stride` bytes apart;
/// zeros beyond) into panels: per lane-group set jj (groups jj·g..jj·g + g), per K chunk of
/// `kc` blocks starting at c0, per tile t, the layout [c][r][8 · g]. Each row is read once,
/// front to back (one pass per lane group read every cache line of a weight row four times,
/// and stalled on memory).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_panels<const R: usize>(kind: Load, src: *const u8, stride: usize, rows: usize, tiles: usize, g: usize, cs: usize, kc: usize, dst: *mut f32) {
    for t in 0..tiles {
        for r in 0..R {
            let i = t * R + r;
            let row = src.wrapping_add(i * stride);
            for c0 in (0..cs).step_by(kc) {
                let c1 = (c0 + kc).min(cs);
                for c in c0..c1 {
                    for j in 0..4 {
                        let at = panel_at(R, tiles, g, cs, j, c0) + t * R * (c1 - c0) * 8 * g + (c - c0) * R * 8 * g + r * 8 * g + (j % g) * 8;
                        let v = if i < rows { load8(kind, row, c * 32 + j * 8) } else { _mm256_setzero_ps() };
                        _mm256_storeu_ps(dst.add(at), v);
                    }
                }
            }
        }
    }
}

/// Where the panels of `pack_panels` put lane-group set j / g's K chunk from block c0 (tiles
/// of R rows, `tiles` of them, `cs` blocks): tile t of that chunk follows at
/// t · R · (chunk length) · 8g.
#[inline(always)]
fn panel_at(r: usize, tiles: usize, g: usize, cs: usize, j: usize, c0: usize) -> usize {
    (j / g) * tiles * r * cs * 8 * g + c0 * tiles * r * 8 * g
}

/// The elements past the last whole block of `rows` rows, as [r][tail].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_tail(kind: Load, src: *const u8, stride: usize, rows: usize, k32: usize, tail: usize, dst: *mut f32) {
    for r in 0..rows {
        for i in 0..tail {
            *dst.add(r * tail + i) = load1(kind, src.add(r * stride), k32 + i);
        }
    }
}

/// One accumulator pass of an MR × NR tile over `cs` blocks: the tile's accumulators of
/// L::N / 8 consecutive lane groups (one register per output: lanes 8-15 of a 16-lane one are
/// the next group's), started from zero or from `st` (`resume`, the previous K chunk) and
/// stored back to `st`. Every accumulator sees its fused multiply-adds in block order, as in
/// ggml; 16 lanes take half the instructions and loads.
#[inline(always)]
unsafe fn tile_pass<L: Lanes, const NR: usize>(a: *const f32, b: *const f32, cs: usize, st: *mut __m256, resume: bool) {
    let mut c = [[L::zero(); NR]; MR];
    if resume {
        for (i, row) in c.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = L::load_groups(st.add(i * NR + j), MR * NR);
            }
        }
    }
    if L::N == 16 && NR == 6 && MR == 4 {
        // SAFETY: the same types (16-lane registers, MR × 6 of them), only spelled out so that
        // the 24 accumulators stay in registers.
        let c = &mut *(c.as_mut_ptr() as *mut [__m512; 24]);
        tile_loop_4x6(a, b, cs, c);
    } else {
        tile_loop::<L, NR>(a, b, cs, &mut c);
    }
    for (i, row) in c.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            L::store_groups(st.add(i * NR + j), MR * NR, *v);
        }
    }
}

/// The blocks of a tile pass, generic (AVX2's 4 × 3 tile).
#[inline(always)]
unsafe fn tile_loop<L: Lanes, const NR: usize>(a: *const f32, b: *const f32, cs: usize, c: &mut [[L::V; NR]; MR]) {
    let w = L::N;
    let (mut pa, mut pb) = (a, b);
    for _ in 0..cs {
        let bv: [L::V; NR] = std::array::from_fn(|j| L::load(pb.add(j * w)));
        for (i, row) in c.iter_mut().enumerate() {
            let av = L::load(pa.add(w * i));
            for (v, bj) in row.iter_mut().zip(bv) {
                *v = L::fmadd(av, bj, *v);
            }
        }
        pa = pa.add(MR * w);
        pb = pb.add(NR * w);
    }
}

/// The blocks of a tile pass for AVX-512's 4 × 6 tile: 24 accumulators, 6 column vectors and
/// one row vector in 31 of the 32 registers (written out: the generic arrays were spilled).
#[inline(always)]
unsafe fn tile_loop_4x6(a: *const f32, b: *const f32, cs: usize, c: &mut [__m512; 24]) {
    let [mut c00, mut c01, mut c02, mut c03, mut c04, mut c05, mut c10, mut c11, mut c12, mut c13, mut c14, mut c15, mut c20, mut c21, mut c22, mut c23, mut c24, mut c25, mut c30, mut c31, mut c32, mut c33, mut c34, mut c35] = *c;
    let (mut pa, mut pb) = (a, b);
    for _ in 0..cs {
        let (b0, b1, b2) = (_mm512_loadu_ps(pb), _mm512_loadu_ps(pb.add(16)), _mm512_loadu_ps(pb.add(32)));
        let (b3, b4, b5) = (_mm512_loadu_ps(pb.add(48)), _mm512_loadu_ps(pb.add(64)), _mm512_loadu_ps(pb.add(80)));
        macro_rules! row {
            ($i:expr, $x0:ident, $x1:ident, $x2:ident, $x3:ident, $x4:ident, $x5:ident) => {
                let av = _mm512_loadu_ps(pa.add(16 * $i));
                $x0 = _mm512_fmadd_ps(av, b0, $x0);
                $x1 = _mm512_fmadd_ps(av, b1, $x1);
                $x2 = _mm512_fmadd_ps(av, b2, $x2);
                $x3 = _mm512_fmadd_ps(av, b3, $x3);
                $x4 = _mm512_fmadd_ps(av, b4, $x4);
                $x5 = _mm512_fmadd_ps(av, b5, $x5);
            };
        }
        row!(0, c00, c01, c02, c03, c04, c05);
        row!(1, c10, c11, c12, c13, c14, c15);
        row!(2, c20, c21, c22, c23, c24, c25);
        row!(3, c30, c31, c32, c33, c34, c35);
        pa = pa.add(MR * 16);
        pb = pb.add(6 * 16);
    }
    *c = [c00, c01, c02, c03, c04, c05, c10, c11, c12, c13, c14, c15, c20, c21, c22, c23, c24, c25, c30, c31, c32, c33, c34, c35];
}

/// `GGML_F32x8_REDUCE` of one output's four accumulators.
#[inline(always)]
unsafe fn reduce(s0: __m256, s1: __m256, s2: __m256, s3: __m256) -> f32 {
    let x = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    let t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

/// Per-thread buffers, kept between calls (ggml's worker threads live as long as the
/// thread pool).
#[derive(Default)]
pub(crate) struct Scratch {
    a: Lines,
    b: Lines,
    st: Vec<__m256>,
    q: Vec<u8>,
    /// (batch, first row) of the A block now packed in `a`.
    a_key: Option<(usize, usize)>,
    /// B chunks packed during this product for the thread's later row blocks: slot i of
    /// `COLUMN_CHUNK · k` values holds columns `b_slots[i]` of batch `b_batch`.
    bc: Lines,
    b_slots: Vec<(usize, usize)>,
    b_batch: Option<usize>,
    /// Slots `bc` may hold in this product (`B_CACHE_BYTES`, and no more than its chunks).
    b_room: usize,
    /// q8_0 products: the column pairs quantized during this product, kept for the thread's
    /// later row blocks (pair i at byte `i` × its panel size), and which of them are made.
    qb: Vec<u8>,
    qb_made: super::QuantizedPanels,
}

/// Bytes of packed B chunks a thread keeps per product: a weight matrix of 128-row blocks
/// packed its columns again for every block (a quarter of a DiT product's time with 200
/// tokens); chunks past the cap are packed per block as before.
const B_CACHE_BYTES: usize = 8 << 20;

fn grow<T: Copy>(v: &mut Vec<T>, n: usize, zero: T) {
    if v.len() < n {
        v.resize(n, zero);
    }
}

/// Runs the thread's tasks (consecutive, so that tasks sharing an A block pack it once),
/// each in chunks of at most `COLUMN_CHUNK` columns.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn run(p: &Problem, tasks: impl Iterator<Item = Task>, s: &mut Scratch) {
    s.a_key = None;
    s.b_batch = None;
    s.b_room = 0;
    s.qb_made.forget();
    for whole in tasks {
        if s.b_room == 0 {
            // The grid's column chunks all have the first task's width (but the last).
            let chunk = (whole.n1 - whole.n0).clamp(1, COLUMN_CHUNK);
            s.b_room = (B_CACHE_BYTES / (4 * COLUMN_CHUNK * p.k).max(1)).min(p.n.div_ceil(chunk)).max(1);
        }
        // A task of few columns reads each weight once: f16 weights are then read in place
        // (`direct_task`), not packed first (from 32 columns packing gains again).
        let one_chunk = whole.n1 - whole.n0 <= DIRECT_COLUMNS;
        for n0 in (whole.n0..whole.n1).step_by(COLUMN_CHUNK) {
            let t = &Task { n0, n1: (n0 + COLUMN_CHUNK).min(whole.n1), ..whole };
            match p.dot {
                Dot::F16 | Dot::F32 if p.k < SMALL_K => small_task(p, t, s),
                Dot::F16 if one_chunk && p.a.ty == Elem::F16 && !avx512vl_allowed() => direct_task(p, t, s),
                Dot::F16 | Dot::F32 => float_task(p, t, s),
                Dot::Q8_0 => q8_task(p, t, s),
            }
        }
    }
}

/// Tasks of at most this many columns read f16 weights in place (`direct_task`).
const DIRECT_COLUMNS: usize = 24;

/// Columns computed at once (their accumulators and packed B stay in L2).
const COLUMN_CHUNK: usize = 48;

/// Blocks of 32 elements per K chunk: a chunk of one lane group is 8 · KC_BLOCKS values
/// per row, so that one tile's chunk stays in L1 while the other operand's chunk (the
/// block's rows, or the task's ≤ 48 columns) streams from L2 (see `passes`).
const KC_BLOCKS: usize = 64;

/// The float products: lane groups two at a time in 16-lane registers where AVX-512 is
/// allowed (the same values), else one at a time.
unsafe fn float_task(p: &Problem, t: &Task, s: &mut Scratch) {
    if avx512vl_allowed() {
        float_task16(p, t, s)
    } else {
        float_task8(p, t, s)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_task8(p: &Problem, t: &Task, s: &mut Scratch) {
    float_body::<W8, 3>(p, t, s)
}

/// With AVX-512VL the 256-bit halves the accumulators are stored through may live in any of
/// the 32 registers (VEX-encoded AVX2 reaches only 16, which spilled the tile).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn float_task16(p: &Problem, t: &Task, s: &mut Scratch) {
    float_body::<W16, 6>(p, t, s)
}

/// L::N / 8 lane groups per accumulator pass, MR × NR tiles.
#[inline(always)]
unsafe fn float_body<L: Lanes, const NR: usize>(p: &Problem, t: &Task, s: &mut Scratch) {
    let g = L::N / 8;
    let k = p.k;
    let (k32, tail) = (k & !31, k % 32);
    let cs = k32 / 32;
    let a_kind = if p.a.ty == Elem::F16 { Load::F16 } else { Load::F32 };
    let b_kind = match (p.dot, p.b.ty) {
        (Dot::F16, Elem::F32) => Load::F32AsF16,
        (_, Elem::F16) => Load::F16,
        _ => Load::F32,
    };
    let (rows, cols) = (t.m1 - t.m0, t.n1 - t.n0);
    let (pm, pn) = (rows.div_ceil(MR), cols.div_ceil(NR));
    let kc = KC_BLOCKS.min(cs).max(1);
    // The A block is packed whole (every lane group and K chunk, see `passes`) and kept for
    // the thread's next tasks over the same rows, the other token columns of a product (a
    // weight matrix was packed again for every 48 columns). B (this task's columns) is
    // packed whole too, in the same layout. (Halves in the A panels, widened in the tile
    // loop, halve the bytes but ran at 0.6× here: the conversions outnumber the FMA ports.)
    let a_len = pm * MR * cs * 32;
    let b_len = pn * NR * cs * 32;
    let ap = s.a.at_least::<f32>(a_len + rows * tail);
    let (bp, b_packed) = b_panels(s, t, k, b_len + cols * tail);
    grow(&mut s.st, pn * pm * 4 * MR * NR, _mm256_setzero_ps());
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let arow = arow.wrapping_add(t.m0 * p.a.nb[0]);
    let brow = brow.wrapping_add(t.n0 * p.b.nb[0]);
    let st = s.st.as_mut_ptr();
    let ta = ap.add(a_len);
    if s.a_key != Some((t.batch, t.m0)) {
        pack_panels::<MR>(a_kind, arow, p.a.nb[0], rows, pm, g, cs, kc, ap);
        if tail > 0 {
            pack_tail(a_kind, arow, p.a.nb[0], rows, k32, tail, ta);
        }
        s.a_key = Some((t.batch, t.m0));
    }
    let tb = bp.add(b_len);
    if !b_packed {
        pack_panels::<NR>(b_kind, brow, p.b.nb[0], cols, pn, g, cs, kc, bp);
        if tail > 0 {
            pack_tail(b_kind, brow, p.b.nb[0], cols, k32, tail, tb);
        }
    }
    passes::<L, NR>(&Panels { a: ap, b: bp, st, g, cs, kc, pm, pn });
    write_outputs::<MR, NR>(p, t, out, st, pm, [ta, tb], tail);
}

/// Where task `t`'s packed B (`len` values) lives, and whether an earlier row block of this
/// product already packed it there: a slot of the thread's chunk cache while it has room,
/// else the per-task buffer.
unsafe fn b_panels(s: &mut Scratch, t: &Task, k: usize, len: usize) -> (*mut f32, bool) {
    if s.b_batch != Some(t.batch) {
        s.b_slots.clear();
        s.b_batch = Some(t.batch);
    }
    let slot = COLUMN_CHUNK * k;
    debug_assert!(len <= slot);
    if let Some(i) = s.b_slots.iter().position(|&c| c == (t.n0, t.n1)) {
        return (s.bc.at_least::<f32>(0).add(i * slot), true);
    }
    if s.b_slots.len() < s.b_room {
        // Sized for every slot at once: growing later would move the chunks already packed.
        let base = s.bc.at_least::<f32>(s.b_room * slot);
        s.b_slots.push((t.n0, t.n1));
        return (base.add((s.b_slots.len() - 1) * slot), false);
    }
    (s.b.at_least::<f32>(len), false)
}

/// The outputs of a task from its tiles' accumulators `st` (the layout of `passes`), each
/// reduced as ggml reduces it, plus the products past the last whole block (`tails` of A
/// and B, [row][tail]).
#[inline(always)]
unsafe fn write_outputs<const MR: usize, const NR: usize>(p: &Problem, t: &Task, out: *mut u8, st: *const __m256, pm: usize, tails: [*const f32; 2], tail: usize) {
    let [ta, tb] = tails;
    let (rows, cols) = (t.m1 - t.m0, t.n1 - t.n0);
    for ni in 0..cols {
        let dst = (out.add((t.n0 + ni) * p.out_nb[0]) as *mut f32).add(t.m0);
        let (n, nn) = (ni / NR, ni % NR);
        for mi in 0..rows {
            let (q, mm) = (mi / MR, mi % MR);
            let sq = st.add((n * pm + q) * 4 * MR * NR + mm * NR + nn);
            let r = reduce(*sq, *sq.add(MR * NR), *sq.add(2 * MR * NR), *sq.add(3 * MR * NR));
            *dst.add(mi) = if tail == 0 {
                r
            } else {
                let a = std::slice::from_raw_parts(ta.add(mi * tail), tail);
                let b = std::slice::from_raw_parts(tb.add(ni * tail), tail);
                match p.dot {
                    Dot::F16 => super::scalar::tail_f16(r, a, b),
                    _ => super::scalar::tail_f32(r, a, b),
                }
            };
        }
    }
}

/// A task's packed operands: A panels and B panels of `pm` and `pn`
/// tiles, in K chunks of `kc` of the `cs` blocks, `g` lane groups per pass, and the
/// accumulators `st` of every tile and lane group.
struct Panels {
    a: *const f32,
    b: *const f32,
    st: *mut __m256,
    g: usize,
    cs: usize,
    kc: usize,
    pm: usize,
    pn: usize,
}

/// Every tile's accumulator passes: per lane-group set j and K chunk c0, A tile q's and B
/// tile n's chunks (`panel_at`). The tile that loads more vectors a block (B's NR = 6 with
/// AVX-512, A's MR = 4 with AVX2's NR = 3) stays in L1 while the other side's tiles stream
/// past it from L2.
#[inline(always)]
unsafe fn passes<L: Lanes, const NR: usize>(p: &Panels) {
    let Panels { a, b, st, g, cs, kc, pm, pn } = *p;
    for j in (0..4).step_by(g) {
        for c0 in (0..cs).step_by(kc) {
            let nc = (c0 + kc).min(cs) - c0;
            let achunk = a.add(panel_at(MR, pm, g, cs, j, c0));
            let bchunk = b.add(panel_at(NR, pn, g, cs, j, c0));
            let pass = |q: usize, n: usize| {
                tile_pass::<L, NR>(achunk.add(q * MR * nc * 8 * g), bchunk.add(n * NR * nc * 8 * g), nc, st.add(((n * pm + q) * 4 + j) * MR * NR), c0 > 0)
            };
            if NR >= MR {
                (0..pn).for_each(|n| (0..pm).for_each(|q| pass(q, n)));
            } else {
                (0..pm).for_each(|q| (0..pn).for_each(|n| pass(q, n)));
            }
        }
    }
}

/// A task of f16 weights over few columns (AVX2): B packed as in `float_body`, A's rows
/// read where they are and widened in the tile loop, 2 rows × 6 columns a tile (packing
/// them to f32 first cost as much as the products with 17 columns; a 4 × 3 tile widened
/// each A vector twice as often and ran slower than packing). Per A tile row and K chunk
/// the four lane-group passes read the same 8 KB of rows, which stay in L1; every
/// accumulator sees the packed path's operations in its order, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn direct_task(p: &Problem, t: &Task, s: &mut Scratch) {
    // Two rows: each A vector is widened once per 6 columns (12 products).
    const DR: usize = 2;
    const NR: usize = 6;
    let k = p.k;
    let (k32, tail) = (k & !31, k % 32);
    let cs = k32 / 32;
    let b_kind = if p.b.ty == Elem::F16 { Load::F16 } else { Load::F32AsF16 };
    let (rows, cols) = (t.m1 - t.m0, t.n1 - t.n0);
    let (pm, pn) = (rows.div_ceil(DR), cols.div_ceil(NR));
    let kc = KC_BLOCKS.min(cs).max(1);
    let b_len = pn * NR * cs * 32;
    // The A tails go where `float_body` keeps its packed A block, which is gone now.
    s.a_key = None;
    let ta = s.a.at_least::<f32>(rows * tail);
    let bp = s.b.at_least::<f32>(b_len + cols * tail);
    grow(&mut s.st, pn * pm * 4 * DR * NR, _mm256_setzero_ps());
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let arow = arow.wrapping_add(t.m0 * p.a.nb[0]);
    let brow = brow.wrapping_add(t.n0 * p.b.nb[0]);
    let st = s.st.as_mut_ptr();
    let tb = bp.add(b_len);
    pack_panels::<NR>(b_kind, brow, p.b.nb[0], cols, pn, 1, cs, kc, bp);
    if tail > 0 {
        pack_tail(Load::F16, arow, p.a.nb[0], rows, k32, tail, ta);
        pack_tail(b_kind, brow, p.b.nb[0], cols, k32, tail, tb);
    }
    for q in 0..pm {
        // A ragged last tile repeats its last row (its outputs are not written).
        let a_rows: [*const u8; DR] = std::array::from_fn(|r| arow.wrapping_add((q * DR + r).min(rows - 1) * p.a.nb[0]));
        for c0 in (0..cs).step_by(kc) {
            let nc = (c0 + kc).min(cs) - c0;
            for j in 0..4 {
                let bchunk = bp.add(panel_at(NR, pn, 1, cs, j, c0));
                for n in 0..pn {
                    direct_pass(a_rows, (c0 * 32 + j * 8) * 2, nc, bchunk.add(n * NR * nc * 8), st.add(((n * pm + q) * 4 + j) * DR * NR), c0 > 0);
                }
            }
        }
    }
    write_outputs::<DR, NR>(p, t, out, st, pm, [ta, tb], tail);
}

/// One accumulator pass of a 2 × 6 tile over `nc` blocks: A's f16 lanes at byte `at` of each
/// row (then every 64 bytes), B's packed panel `b`; started from zero or resumed from `st`.
#[inline(always)]
unsafe fn direct_pass(a: [*const u8; 2], at: usize, nc: usize, b: *const f32, st: *mut __m256, resume: bool) {
    let mut c = [[_mm256_setzero_ps(); 6]; 2];
    if resume {
        for (i, row) in c.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = *st.add(i * 6 + j);
            }
        }
    }
    let mut pb = b;
    for blk in 0..nc {
        let a0 = _mm256_cvtph_ps(_mm_loadu_si128(a[0].add(at + blk * 64) as *const __m128i));
        let a1 = _mm256_cvtph_ps(_mm_loadu_si128(a[1].add(at + blk * 64) as *const __m128i));
        for j in 0..6 {
            let bj = _mm256_loadu_ps(pb.add(8 * j));
            c[0][j] = _mm256_fmadd_ps(a0, bj, c[0][j]);
            c[1][j] = _mm256_fmadd_ps(a1, bj, c[1][j]);
        }
        pb = pb.add(48);
    }
    for (i, row) in c.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            *st.add(i * 6 + j) = *v;
        }
    }
}

// ---- q8_0 ----

const QMR: usize = 4;
const QNR: usize = 2;

/// q8_0 panel of R rows over `nb` blocks: per block the R rows' 32 quants, then (after all
/// blocks) the scales as f32, block-major. With `offset` the quants are stored plus 128, as
/// unsigned bytes (`q8_tile_zmm`).
unsafe fn q8_pack_rows<const R: usize>(src: *const u8, stride: usize, rows: usize, nb: usize, dst: *mut u8, offset: bool) {
    let d = dst.add(nb * R * 32) as *mut f32;
    for r in 0..R {
        for b in 0..nb {
            let q = dst.add((b * R + r) * 32);
            if r < rows {
                let blk = src.add(r * stride + b * super::scalar::Q8_0_BYTES);
                std::ptr::copy_nonoverlapping(blk.add(2), q, 32);
                if offset {
                    for i in 0..32 {
                        *q.add(i) ^= 0x80;
                    }
                }
                *d.add(b * R + r) = super::scalar::f16_to_f32(u16::from_le_bytes([*blk, *blk.add(1)]));
            } else {
                std::ptr::write_bytes(q, 0, 32);
                *d.add(b * R + r) = 0.0;
            }
        }
    }
}

/// `quantize_row_q8_0` (AVX2) of `rows` f32 columns into a q8 panel.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_quantize_cols<const R: usize>(src: *const u8, stride: usize, rows: usize, nb: usize, dst: *mut u8) {
    let d = dst.add(nb * R * 32) as *mut f32;
    let sign = _mm256_set1_ps(-0.0);
    for r in 0..R {
        for b in 0..nb {
            let q = dst.add((b * R + r) * 32);
            if r >= rows {
                std::ptr::write_bytes(q, 0, 32);
                *d.add(b * R + r) = 0.0;
                continue;
            }
            let x = src.add(r * stride + b * 128) as *const f32;
            let v = [_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)), _mm256_loadu_ps(x.add(16)), _mm256_loadu_ps(x.add(24))];
            let mut m = _mm256_andnot_ps(sign, v[0]);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[1]));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[2]));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[3]));
            let mut m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let dd = amax / 127.0;
            let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(dd));
            *d.add(b * R + r) = _mm_cvtss_f32(_mm_cvtph_ps(h));
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let i: [__m256i; 4] = std::array::from_fn(|t| {
                _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[t], id)))
            });
            let p01 = _mm256_packs_epi32(i[0], i[1]);
            let p23 = _mm256_packs_epi32(i[2], i[3]);
            let p = _mm256_packs_epi16(p01, p23);
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q as *mut __m256i, p);
        }
    }
}

fn q8_panel_len(r: usize, nb: usize) -> usize {
    nb * r * 36
}

/// Bytes of the lane corrections `q8_corrections` appends to a column panel.
fn q8_corrections_len(r: usize, nb: usize) -> usize {
    nb * r * 32
}

/// After a quantized panel of R columns (`q8_panel_len`): per block and column, each 8-lane
/// accumulator lane's −128 · (sum of its four quants), i32. A lane's `vpdpbusd` of the
/// offset weights (x + 128) starting from it gives the lane's integer sum of x · y exactly.
unsafe fn q8_corrections<const R: usize>(panel: *mut u8, nb: usize) {
    let out = panel.add(q8_panel_len(R, nb)) as *mut i32;
    for b in 0..nb {
        for r in 0..R {
            let q = panel.add((b * R + r) * 32) as *const i8;
            for lane in 0..8 {
                let sum: i32 = (0..4).map(|j| *q.add(4 * lane + j) as i32).sum();
                *out.add((b * R + r) * 8 + lane) = -128 * sum;
            }
        }
    }
}

/// Each lane's sum of four |x|·(±y) byte products (no closure: it would not inherit the
/// caller's target features).
#[inline(always)]
unsafe fn q8_isum<const VNNI: bool>(ax: __m256i, y: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, y)
    } else {
        _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, y))
    }
}

/// The q8_0 tile: QMR × QNR outputs, each one 8-lane accumulator as in ggml. With `VNNI`,
/// one `vpdpbusd` gives each lane's four-product integer sum that `maddubs` + `madd` give (no
/// pair can saturate: quantized activations lie in ±127), so the values are the same bit for
/// bit; that instantiation runs only inside `q8_tile_vnni`.
#[inline(always)]
unsafe fn q8_tile_with<const VNNI: bool>(a: *const u8, b: *const u8, nb: usize, acc: &mut [__m256; QMR * QNR]) {
    let ad = a.add(nb * QMR * 32) as *const f32;
    let bd = b.add(nb * QNR * 32) as *const f32;
    let mut c = [_mm256_setzero_ps(); QMR * QNR];
    for blk in 0..nb {
        let pa = a.add(blk * QMR * 32);
        let pb = b.add(blk * QNR * 32);
        let b0 = _mm256_loadu_si256(pb as *const __m256i);
        let b1 = _mm256_loadu_si256(pb.add(32) as *const __m256i);
        let db0 = _mm256_broadcast_ss(&*bd.add(blk * QNR));
        let db1 = _mm256_broadcast_ss(&*bd.add(blk * QNR + 1));
        for m in 0..QMR {
            let x = _mm256_loadu_si256(pa.add(m * 32) as *const __m256i);
            let ax = _mm256_sign_epi8(x, x);
            let da = _mm256_broadcast_ss(&*ad.add(blk * QMR + m));
            let s0 = _mm256_cvtepi32_ps(q8_isum::<VNNI>(ax, _mm256_sign_epi8(b0, x)));
            c[m * QNR] = _mm256_fmadd_ps(_mm256_mul_ps(da, db0), s0, c[m * QNR]);
            let s1 = _mm256_cvtepi32_ps(q8_isum::<VNNI>(ax, _mm256_sign_epi8(b1, x)));
            c[m * QNR + 1] = _mm256_fmadd_ps(_mm256_mul_ps(da, db1), s1, c[m * QNR + 1]);
        }
    }
    *acc = c;
}

#[target_feature(enable = "avx512vnni,avx512vl,avx512f,avx2,fma,f16c")]
unsafe fn q8_tile_vnni(a: *const u8, b: *const u8, nb: usize, acc: &mut [__m256; QMR * QNR]) {
    q8_tile_with::<true>(a, b, nb, acc)
}

/// The q8_0 tile with 512-bit registers: a register holds the 8-lane accumulators of both
/// columns (lanes 0-7 the first, 8-15 the second), so each `vpdpbusd`, conversion and FMA
/// serves two outputs. The weights are packed plus 128 (unsigned, as `vpdpbusd` takes them)
/// and each lane starts from its correction (`q8_corrections`), so a lane's integer sum is
/// exactly the 256-bit tile's and the accumulators are the same bit for bit; no sign
/// operations per product.
#[target_feature(enable = "avx512vnni,avx512bw,avx512vl,avx512f,avx2,fma,f16c")]
unsafe fn q8_tile_zmm(a: *const u8, b: *const u8, nb: usize, acc: &mut [__m256; QMR * QNR]) {
    const { assert!(QNR == 2) };
    let ad = a.add(nb * QMR * 32) as *const f32;
    let bd = b.add(nb * QNR * 32) as *const f32;
    let corr = b.add(q8_panel_len(QNR, nb));
    let mut c = [_mm512_setzero_ps(); QMR];
    for blk in 0..nb {
        let pa = a.add(blk * QMR * 32);
        // Both columns' 32 quants, and their lanes' corrections: one 64-byte load each.
        let y = _mm512_loadu_si512(b.add(blk * QNR * 32) as *const _);
        let start = _mm512_loadu_si512(corr.add(blk * QNR * 32) as *const _);
        let (db0, db1) = (_mm512_set1_ps(*bd.add(blk * QNR)), _mm256_set1_ps(*bd.add(blk * QNR + 1)));
        let db = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(db0), _mm256_castps_pd(db1)));
        for (m, cm) in c.iter_mut().enumerate() {
            let xu = _mm512_broadcast_i64x4(_mm256_loadu_si256(pa.add(m * 32) as *const __m256i));
            let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, xu, y));
            *cm = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(*ad.add(blk * QMR + m)), db), s, *cm);
        }
    }
    for (m, cm) in c.iter().enumerate() {
        acc[m * QNR] = _mm512_castps512_ps256(*cm);
        acc[m * QNR + 1] = upper8(*cm);
    }
}

/// Whether `q8_tile_vnni` runs (`SD_CPU_AVX512=0` keeps the AVX2 code).
fn vnni_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| avx512_allowed() && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl"))
}

/// Whether `q8_tile_zmm` runs (`SD_CPU_Q8_ZMM=0` keeps the 256-bit VNNI tile, for comparisons).
fn q8_zmm_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        vnni_allowed() && is_x86_feature_detected!("avx512bw") && !matches!(std::env::var("SD_CPU_Q8_ZMM").as_deref().map(str::trim), Ok("0" | "off"))
    })
}

/// `hsum_float_8`.
#[inline(always)]
unsafe fn hsum8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_task(p: &Problem, t: &Task, s: &mut Scratch) {
    let nb = p.k / 32;
    let rows = t.m1 - t.m0;
    let npan = rows.div_ceil(QMR);
    let zmm = q8_zmm_allowed();
    let apanel = q8_panel_len(QMR, nb);
    let bpanel = q8_panel_len(QNR, nb) + if zmm { q8_corrections_len(QNR, nb) } else { 0 };
    grow(&mut s.q, npan * apanel + bpanel, 0);
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let (aq, bq) = s.q.split_at_mut(npan * apanel);
    if s.a_key != Some((t.batch, t.m0)) {
        for q in 0..npan {
            let r0 = t.m0 + q * QMR;
            q8_pack_rows::<QMR>(arow.add(r0 * p.a.nb[0]), p.a.nb[0], QMR.min(t.m1 - r0), nb, aq.as_mut_ptr().add(q * apanel), zmm);
        }
        s.a_key = Some((t.batch, t.m0));
    }
    let mut acc = [_mm256_setzero_ps(); QMR * QNR];
    let vnni = vnni_allowed();
    let room = s.qb_made.room(t.batch, bpanel, p.n.div_ceil(QNR));
    grow(&mut s.qb, room * bpanel, 0);
    for n0 in (t.n0..t.n1).step_by(QNR) {
        let cols = QNR.min(t.n1 - n0);
        // A pair without a slot is quantized into `bq` for this task alone.
        let (slot, made) = s.qb_made.slot(n0, QNR);
        let at = slot.map_or(bq.as_mut_ptr(), |i| s.qb.as_mut_ptr().add(i * bpanel));
        if !made {
            q8_quantize_cols::<QNR>(brow.add(n0 * p.b.nb[0]), p.b.nb[0], cols, nb, at);
            if zmm {
                q8_corrections::<QNR>(at, nb);
            }
            s.qb_made.made(slot);
        }
        let b = at as *const u8;
        for q in 0..npan {
            let r0 = t.m0 + q * QMR;
            if zmm {
                // SAFETY: the CPU has AVX-512 VNNI, BW and VL (checked).
                unsafe { q8_tile_zmm(aq.as_ptr().add(q * apanel), b, nb, &mut acc) };
            } else if vnni {
                // SAFETY: the CPU has AVX-512 VNNI and VL (checked).
                unsafe { q8_tile_vnni(aq.as_ptr().add(q * apanel), b, nb, &mut acc) };
            } else {
                q8_tile_with::<false>(aq.as_ptr().add(q * apanel), b, nb, &mut acc);
            }
            for ni in 0..cols {
                let dst = out.add((n0 + ni) * p.out_nb[0]) as *mut f32;
                for mi in 0..QMR.min(t.m1 - r0) {
                    *dst.add(r0 + mi) = hsum8(acc[mi * QNR + ni]);
                }
            }
        }
    }
}

// ---- small k: one vector = 8 or 16 outputs (rows of one column) ----

pub(crate) const SMALL_K: usize = 192;

/// A register width for the small-k products. Every lane runs ggml's 8-lane operations in
/// the same order, so 16 lanes give the 8-lane values bit for bit. The methods are
/// `inline(always)` so that they compile with the features of the `target_feature` entry
/// point that inlines them (`small_task8` / `small_task16`).
trait Lanes {
    const N: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// ggml's f16 dot tail: `r` plus the products t = k32..k, summed per lane in f64.
    unsafe fn f16_tail(r: Self::V, a: *const f32, b: *const f32, k32: usize, k: usize) -> Self::V;
    /// The 8-lane accumulators at `st`, `st + next`, ... as one register (N / 8 of them).
    unsafe fn load_groups(st: *const __m256, next: usize) -> Self::V;
    /// `load_groups`' inverse.
    unsafe fn store_groups(st: *mut __m256, next: usize, v: Self::V);
}

struct W8;
struct W16;

#[inline(always)]
unsafe fn upper8(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

impl Lanes for W8 {
    const N: usize = 8;
    type V = __m256;
    #[inline(always)]
    unsafe fn load_groups(st: *const __m256, _next: usize) -> __m256 {
        _mm256_loadu_ps(st as *const f32)
    }
    #[inline(always)]
    unsafe fn store_groups(st: *mut __m256, _next: usize, v: __m256) {
        _mm256_storeu_ps(st as *mut f32, v)
    }
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn f16_tail(r: __m256, a: *const f32, b: *const f32, k32: usize, k: usize) -> __m256 {
        let mut lo = _mm256_cvtps_pd(_mm256_castps256_ps128(r));
        let mut hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(r));
        for t in k32..k {
            let p = _mm256_mul_ps(_mm256_loadu_ps(a.add(t * 8)), _mm256_set1_ps(*b.add(t)));
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(p)));
        }
        _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo))
    }
}

impl Lanes for W16 {
    const N: usize = 16;
    type V = __m512;
    #[inline(always)]
    unsafe fn load_groups(st: *const __m256, next: usize) -> __m512 {
        let (lo, hi) = (_mm256_loadu_ps(st as *const f32), _mm256_loadu_ps(st.add(next) as *const f32));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi)))
    }
    #[inline(always)]
    unsafe fn store_groups(st: *mut __m256, next: usize, v: __m512) {
        _mm256_storeu_ps(st as *mut f32, _mm512_castps512_ps256(v));
        _mm256_storeu_ps(st.add(next) as *mut f32, upper8(v));
    }
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn f16_tail(r: __m512, a: *const f32, b: *const f32, k32: usize, k: usize) -> __m512 {
        let mut lo = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
        let mut hi = _mm512_cvtps_pd(upper8(r));
        for t in k32..k {
            let p = _mm512_mul_ps(_mm512_loadu_ps(a.add(t * 16)), _mm512_set1_ps(*b.add(t)));
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(upper8(p)));
        }
        let lo = _mm512_castps256_ps512(_mm512_cvtpd_ps(lo));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(lo), _mm256_castps_pd(_mm512_cvtpd_ps(hi))))
    }
}

/// A block transposed: per L::N rows, element t of those rows at [t][L::N] (zeros past `rows`).
#[inline(always)]
unsafe fn pack_t<L: Lanes>(kind: Load, src: *const u8, stride: usize, rows: usize, k: usize, dst: *mut f32) {
    for t in 0..k {
        for r in 0..L::N {
            *dst.add(t * L::N + r) = if r < rows { load1(kind, src.add(r * stride), t) } else { 0.0 };
        }
    }
}

#[inline(always)]
unsafe fn pack_row(kind: Load, src: *const u8, k: usize, dst: *mut f32) {
    for t in 0..k {
        *dst.add(t) = load1(kind, src, t);
    }
}

/// Lane l of the L::N-row × NB tile: v_l = (x0 + x2) + (x1 + x3) of its four chains.
#[allow(clippy::needless_range_loop)] // indices are ggml's accumulator lanes
#[inline(always)]
unsafe fn small_lane<L: Lanes, const NB: usize>(a: *const f32, b: &[*const f32; NB], cs: usize, l: usize) -> [L::V; NB] {
    let mut x = [[L::zero(); 4]; NB];
    for j in 0..4 {
        let mut acc = [L::zero(); NB];
        for c in 0..cs {
            let t = c * 32 + j * 8 + l;
            let av = L::load(a.add(t * L::N));
            for q in 0..NB {
                acc[q] = L::fmadd(av, L::splat(*b[q].add(t)), acc[q]);
            }
        }
        for q in 0..NB {
            x[q][j] = acc[q];
        }
    }
    let mut out = [L::zero(); NB];
    for q in 0..NB {
        out[q] = L::add(L::add(x[q][0], x[q][2]), L::add(x[q][1], x[q][3]));
    }
    out
}

/// L::N rows × NB columns with k < SMALL_K: every lane chain of ggml's dot (32 per output) is
/// vectorised across the rows.
#[allow(clippy::needless_range_loop)] // indices are ggml's accumulator lanes
#[inline(always)]
unsafe fn small_tile<L: Lanes, const NB: usize>(dot: Dot, a: *const f32, b: [*const f32; NB], k: usize, out: &mut [L::V; NB]) {
    let k32 = k & !31;
    let cs = k32 / 32;
    let mut tt = [[L::zero(); 4]; NB];
    for i in 0..4 {
        let (lo, hi) = (small_lane::<L, NB>(a, &b, cs, i), small_lane::<L, NB>(a, &b, cs, i + 4));
        for q in 0..NB {
            tt[q][i] = L::add(lo[q], hi[q]);
        }
    }
    for q in 0..NB {
        let w = &tt[q];
        let mut r = L::add(L::add(w[0], w[1]), L::add(w[2], w[3]));
        match dot {
            Dot::F16 if k > k32 => r = L::f16_tail(r, a, b[q], k32, k),
            Dot::F32 => {
                let q4 = k32 + ((k - k32) & !3);
                for t in k32..q4 {
                    r = L::add(r, L::mul(L::load(a.add(t * L::N)), L::splat(*b[q].add(t))));
                }
                for t in q4..k {
                    r = L::fmadd(L::load(a.add(t * L::N)), L::splat(*b[q].add(t)), r);
                }
            }
            _ => {}
        }
        out[q] = r;
    }
}

/// Whether 16-lane registers take the small-k products and Winograd's products (the same
/// values: every lane runs the 8-lane code's operations in the same order).
/// `SD_CPU_AVX512=0` keeps AVX2, for comparisons.
pub(crate) fn avx512_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| is_x86_feature_detected!("avx512f") && !matches!(std::env::var("SD_CPU_AVX512").as_deref().map(str::trim), Ok("0" | "off")))
}

/// `avx512_allowed` on a CPU that also has AVX-512VL.
pub(crate) fn avx512vl_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| avx512_allowed() && is_x86_feature_detected!("avx512vl"))
}

/// Products with k < SMALL_K, one vector = L::N outputs (rows m..m+L::N of one column).
#[allow(clippy::needless_range_loop)] // indices are ggml's accumulator lanes
#[inline(always)]
unsafe fn small_body<L: Lanes>(p: &Problem, t: &Task, s: &mut Scratch) {
    const NB: usize = 4;
    let n_l = L::N;
    let k = p.k;
    let a_kind = if p.a.ty == Elem::F16 { Load::F16 } else { Load::F32 };
    let b_kind = match (p.dot, p.b.ty) {
        (Dot::F16, Elem::F32) => Load::F32AsF16,
        (_, Elem::F16) => Load::F16,
        _ => Load::F32,
    };
    let rows = t.m1 - t.m0;
    let npan = rows.div_ceil(n_l);
    let ap = s.a.at_least::<f32>(npan * n_l * k);
    let bp = s.b.at_least::<f32>((t.n1 - t.n0) * k);
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    if s.a_key != Some((t.batch, t.m0)) {
        for q in 0..npan {
            let r0 = t.m0 + q * n_l;
            pack_t::<L>(a_kind, arow.wrapping_add(r0 * p.a.nb[0]), p.a.nb[0], n_l.min(t.m1 - r0), k, ap.add(q * n_l * k));
        }
        s.a_key = Some((t.batch, t.m0));
    }
    for n in t.n0..t.n1 {
        pack_row(b_kind, brow.wrapping_add(n * p.b.nb[0]), k, bp.add((n - t.n0) * k));
    }
    let ap = ap as *const f32;
    let mut res = [L::zero(); NB];
    let mut n = t.n0;
    while n < t.n1 {
        let cnt = NB.min(t.n1 - n);
        // Columns past the end repeat the last one (computed, not stored).
        let mut cols = [bp as *const f32; NB];
        for q in 0..NB {
            cols[q] = bp.add((n + q.min(cnt - 1) - t.n0) * k);
        }
        for pan in 0..npan {
            let r0 = t.m0 + pan * n_l;
            small_tile::<L, NB>(p.dot, ap.add(pan * n_l * k), cols, k, &mut res);
            let live = n_l.min(t.m1 - r0);
            for q in 0..cnt {
                let dst = (out.add((n + q) * p.out_nb[0]) as *mut f32).add(r0);
                if live == n_l {
                    L::store(dst, res[q]);
                } else {
                    let mut tmp = [0f32; 16];
                    L::store(tmp.as_mut_ptr(), res[q]);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, live);
                }
            }
        }
        n += cnt;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn small_task8(p: &Problem, t: &Task, s: &mut Scratch) {
    small_body::<W8>(p, t, s)
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn small_task16(p: &Problem, t: &Task, s: &mut Scratch) {
    small_body::<W16>(p, t, s)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn small_task(p: &Problem, t: &Task, s: &mut Scratch) {
    if avx512_allowed() {
        // SAFETY: the CPU has AVX-512F (checked).
        unsafe { small_task16(p, t, s) }
    } else {
        small_task8(p, t, s)
    }
}
