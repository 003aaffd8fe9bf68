//! The fast path's f16 products on CPUs with AMX-BF16 (issue 28, `fast=1`; never on the
//! exact path). A tile multiply takes bf16 operands, which hold 8 of an f16 value's 11
//! significant bits; each operand is therefore split into a bf16 high part (its top bits)
//! and a bf16 low part (the exact rest), and the four products hi·hi, hi·lo, lo·hi, lo·lo
//! are each exact in f32: every output is the f32 sum of the exact products of the f16
//! operands (activations rounded to f16 first, as ggml rounds them), like the other fast
//! kernels. A tile multiply does 16 times the multiply-adds of AVX-512's f32 FMAs per cycle;
//! with four of them per product and the conversions, these kernels measured 1.7-3× the
//! exact kernels' rate on Wan's shapes (Emerald Rapids, whose tile unit's speed varied from
//! run to run).
//!
//! Sums: the hi·hi products of `SUB` values accumulate in one tile, the three small cross
//! products in another (so their many additions do not round the large sum), and both join
//! the output once per `SUB` values, as the AVX2 tiles' stretches do. Stretches of 128 were
//! faster but moved Wan's frames as far from the exact path's as the reference's fastest
//! build moves them from its default build; 64 stay inside that.
//!
//! Layout: C tiles are 16 tokens × 16 weight rows (an output row segment each, stored
//! where ggml's product puts it); token tiles are 16 tokens × 32 values (plain rows); weight
//! tiles are AMX's pair-interleaved layout (16 value pairs × 16 rows), packed once per task
//! for its block of weight rows. Tiles: tmm0/1 the hi·hi sums of two token tiles, tmm2/3
//! their cross sums, tmm4/5 the token tiles, tmm6/7 a weight tile's hi and lo.

use super::{Dot, Elem, Lines, Problem, Task};
use std::arch::asm;
use std::arch::x86_64::*;

/// Tokens per tile, and weight rows per tile (16 f32 = one 64-byte row).
const T: usize = 16;
/// Values per tile step (32 bf16 = one 64-byte row).
const KS: usize = 32;
/// Values whose products sum in the tiles before they join the output.
const SUB: usize = 64;
/// Values per block of converted tokens (two token tiles' rows over a block stay in L2).
const KB: usize = 1024;
/// Distance of token rows in the buffer, in u16: one cache line more than a block, so that
/// a tile's 16 rows do not share a few L1 sets (rows 2 KiB apart would).
const XS: usize = KB + 32;
/// Bytes of a 16 × 64-byte tile, in u16.
const TILE_U16: usize = 512;

/// Per-thread buffers, kept between calls.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The task's weight rows packed: group g of 16 rows, step s, half h (0 hi, 1 lo) is a
    /// tile at `((g · steps + s) · 2 + h) · TILE_U16`.
    w: Lines,
    /// (batch, first row) of the weights now packed (this call's: `run` forgets it).
    w_key: Option<(usize, usize)>,
    /// Two token tiles over one K block: half h, token r at `(h · 2T + r) · XS`.
    x: Lines,
    /// Four C tiles for the flush (f32).
    c: Lines,
    /// The outputs of two token tiles over the task's weight groups while a K block is
    /// summed (f32): group g, token r at `(g · 2T + r) · T`. Output rows lie a whole row of
    /// the product apart (often a multiple of 4 KiB, so the 32 rows of a flush shared an L1
    /// set); here they are 2 KiB in one piece.
    acc: Lines,
}

/// A tile configuration (palette 1: tiles 0-7, each up to 16 rows of 64 bytes).
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    tail: [u8; 16],
}

impl TileConfig {
    /// Tile i: `shape[i]` = (rows, bytes per row); the entries past them zero, as palette 1
    /// requires.
    pub(crate) fn new(shape: &[(u8, u16)]) -> TileConfig {
        let (mut colsb, mut rows) = ([0u16; 16], [0u8; 16]);
        for (i, &(r, c)) in shape.iter().enumerate() {
            rows[i] = r;
            colsb[i] = c;
        }
        TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb, rows, tail: [0; 16] }
    }
}

/// Whether these kernels run: AVX-512 (BW, VL) and AMX-BF16 on the CPU, the kernel's
/// permission for tile data granted, and `SD_CPU_AMX` not `0` (for comparisons).
pub(crate) fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // CPUID leaf 7, EDX bit 22: AMX-BF16.
    *ON.get_or_init(|| tile_unit(22))
}

/// Whether tile kernels using the multiply of CPUID leaf 7 EDX bit `multiply` may run:
/// AVX-512 (BW, VL; their flushes use it), the tile unit, that multiply, the kernel's
/// permission for tile data, and `SD_CPU_AMX` not `0`.
pub(crate) fn tile_unit(multiply: u32) -> bool {
    if matches!(std::env::var("SD_CPU_AMX").as_deref().map(str::trim), Ok("0" | "off")) {
        return false;
    }
    if !(super::x86::avx512vl_allowed() && is_x86_feature_detected!("avx512bw")) {
        return false;
    }
    // CPUID leaf 7: EDX bit 24 AMX-TILE.
    let edx = __cpuid_count(7, 0).edx;
    if edx & (1 << multiply) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    // Linux hands tile data to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA; asking
    // again is harmless); without it the first tile load faults.
    // SAFETY: a plain system call with integer arguments.
    unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1023 as libc::c_long, 18 as libc::c_long) == 0 }
}

/// Whether these kernels compute `p`: f16 weights (f32 weights keep their kernels, q8_0
/// weights take `amx_q8`).
pub(crate) fn supports(p: &Problem) -> bool {
    p.dot == Dot::F16 && p.a.ty == Elem::F16 && matches!(p.b.ty, Elem::F16 | Elem::F32)
}

/// Runs the thread's tasks (consecutive ones over the same rows pack them once).
///
/// # Safety
/// `available()`; `p` describes live memory (see `gemm::run`) and `supports(p)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn run(p: &Problem, tasks: impl Iterator<Item = Task>, s: &mut Scratch) {
    let cfg = TileConfig::new(&[(16, 64); 8]);
    asm!("ldtilecfg [{0}]", in(reg) &cfg, options(nostack, readonly));
    s.w_key = None;
    for t in tasks {
        task(p, &t, s);
    }
    asm!("tilerelease", options(nostack, nomem));
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn task(p: &Problem, t: &Task, s: &mut Scratch) {
    let k = p.k;
    let kp = k.div_ceil(KS) * KS;
    let steps = kp / KS;
    let (rows, cols) = (t.m1 - t.m0, t.n1 - t.n0);
    let groups = rows.div_ceil(T);
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let w = s.w.at_least::<u16>(groups * steps * 2 * TILE_U16);
    let x = s.x.at_least::<u16>(4 * T * XS);
    let c = s.c.at_least::<f32>(2 * 4 * T * T);
    let acc = s.acc.at_least::<f32>(groups * 2 * T * T);
    if s.w_key != Some((t.batch, t.m0)) {
        for g in 0..groups {
            let first = t.m0 + g * T;
            pack_weights(arow.wrapping_add(first * p.a.nb[0]), p.a.nb[0], (rows - g * T).min(T), k, steps, w.add(g * steps * 2 * TILE_U16));
        }
        s.w_key = Some((t.batch, t.m0));
    }
    let b_f32 = p.b.ty == Elem::F32;
    let ldc = p.out_nb[0];
    let sx = 2 * XS;
    for kb0 in (0..kp).step_by(KB) {
        let kbl = KB.min(kp - kb0);
        for tp in (0..cols).step_by(2 * T) {
            let nt = (cols - tp).min(2 * T);
            convert_tokens(b_f32, brow.wrapping_add((t.n0 + tp) * p.b.nb[0]), p.b.nb[0], nt, k, kb0, kbl, x);
            let two = nt > T;
            // The outputs are summed in `acc` over the K block: the same additions in the
            // same order as on the outputs themselves, so the same bits.
            let dst = |g: usize| out.add((t.n0 + tp) * ldc + 4 * (t.m0 + g * T));
            let acc_at = |g: usize| acc.add(g * 2 * T * T);
            if kb0 > 0 {
                for g in 0..groups {
                    copy_rows(dst(g), ldc, acc_at(g) as *mut u8, 4 * T, nt, (rows - g * T).min(T));
                }
            }
            // The stretch's token tiles (16 KiB) stay in L1 across the weight groups.
            for sub0 in (0..kbl).step_by(SUB) {
                for g in 0..groups {
                    let wg = w.add(g * steps * 2 * TILE_U16);
                    for k0 in (sub0..(sub0 + SUB).min(kbl)).step_by(KS) {
                        let xs = x.add(k0);
                        let ws = wg.add((kb0 + k0) / KS * 2 * TILE_U16);
                        step(xs, sx, ws, two);
                    }
                    flush(c, acc_at(g), nt, (rows - g * T).min(T), kb0 + sub0 == 0);
                }
            }
            for g in 0..groups {
                copy_rows(acc_at(g) as *const u8, 4 * T, dst(g), ldc, nt, (rows - g * T).min(T));
            }
        }
    }
}

/// The mask of a vector's first `n` of 16 lanes (all from 16 on).
#[inline(always)]
pub(crate) fn lanes(n: usize) -> __mmask16 {
    if n >= 16 { !0 } else { (1u16 << n) - 1 }
}

/// Copies `nt` rows of `mr` f32 (the first `mr` of 16) from `src` to `dst`, rows `ls` and
/// `ld` bytes apart.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn copy_rows(src: *const u8, ls: usize, dst: *mut u8, ld: usize, nt: usize, mr: usize) {
    let mask = lanes(mr);
    for r in 0..nt {
        let v = _mm512_maskz_loadu_ps(mask, src.add(r * ls) as *const f32);
        _mm512_mask_storeu_ps(dst.add(r * ld) as *mut f32, mask, v);
    }
}

/// One step of 32 values for one or two token tiles and one weight group: hi·hi into
/// tmm0/1, hi·lo, lo·hi, lo·lo into tmm2/3.
#[inline(always)]
unsafe fn step(x: *const u16, sx: usize, w: *const u16, two: bool) {
    let xl = x.add(2 * T * XS);
    let wl = w.add(TILE_U16);
    if two {
        asm!(
            "tileloadd tmm4, [{a0} + {sx}*1]",
            "tileloadd tmm5, [{a1} + {sx}*1]",
            "tileloadd tmm6, [{bh} + {s64}*1]",
            "tileloadd tmm7, [{bl} + {s64}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm5, tmm6",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tileloadd tmm4, [{l0} + {sx}*1]",
            "tileloadd tmm5, [{l1} + {sx}*1]",
            "tdpbf16ps tmm2, tmm4, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm6",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) x,
            a1 = in(reg) x.add(T * XS),
            l0 = in(reg) xl,
            l1 = in(reg) xl.add(T * XS),
            bh = in(reg) w,
            bl = in(reg) wl,
            sx = in(reg) sx,
            s64 = in(reg) 64usize,
            options(nostack, readonly),
        );
    } else {
        asm!(
            "tileloadd tmm4, [{a0} + {sx}*1]",
            "tileloadd tmm6, [{bh} + {s64}*1]",
            "tileloadd tmm7, [{bl} + {s64}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "tileloadd tmm4, [{l0} + {sx}*1]",
            "tdpbf16ps tmm2, tmm4, tmm6",
            "tdpbf16ps tmm2, tmm4, tmm7",
            a0 = in(reg) x,
            l0 = in(reg) xl,
            bh = in(reg) w,
            bl = in(reg) wl,
            sx = in(reg) sx,
            s64 = in(reg) 64usize,
            options(nostack, readonly),
        );
    }
}

/// Adds the tiles' sums (hi·hi + cross, per token tile) to the sums of `nt` tokens × `mr`
/// weight rows at `acc` (a token's 16 f32 after another's; stored instead when `first`),
/// and zeroes the tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn flush(c: *mut f32, acc: *mut f32, nt: usize, mr: usize, first: bool) {
    asm!(
        "tilestored [{c} + {s64}*1], tmm0",
        "tilestored [{c1} + {s64}*1], tmm1",
        "tilestored [{c2} + {s64}*1], tmm2",
        "tilestored [{c3} + {s64}*1], tmm3",
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        c = in(reg) c,
        c1 = in(reg) c.add(T * T),
        c2 = in(reg) c.add(2 * T * T),
        c3 = in(reg) c.add(3 * T * T),
        s64 = in(reg) 64usize,
        options(nostack),
    );
    let mask = lanes(mr);
    for r in 0..nt {
        let (tile, row) = (r / T, r % T);
        let big = _mm512_loadu_ps(c.add(tile * T * T + row * T));
        let small = _mm512_loadu_ps(c.add((2 + tile) * T * T + row * T));
        let sum = _mm512_add_ps(big, small);
        let o = acc.add(r * T);
        let v = if first { sum } else { _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), sum) };
        _mm512_mask_storeu_ps(o, mask, v);
    }
}

/// The odd 16-bit words of two vectors of 16 f32: their top halves, in order.
static HIGH_WORDS: [u16; 32] = {
    let mut w = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        w[i] = 2 * i as u16 + 1;
        i += 1;
    }
    w
};

/// 32 values from `row` (f16, or f32 rounded to f16) starting at `k0`, zeros past `k`.
#[inline(always)]
unsafe fn load32(f32_src: bool, row: *const u8, k0: usize, k: usize) -> (__m512, __m512) {
    let n = k.saturating_sub(k0).min(KS);
    if f32_src {
        let (m0, m1) = (lanes(n), lanes(n.saturating_sub(16)));
        let p = row.add(4 * k0) as *const f32;
        let round = |v: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v));
        (round(_mm512_maskz_loadu_ps(m0, p)), round(_mm512_maskz_loadu_ps(m1, p.add(16))))
    } else {
        let m: __mmask32 = if n >= 32 { !0 } else { (1u32 << n) - 1 };
        let v = _mm512_maskz_loadu_epi16(m, row.add(2 * k0) as *const i16);
        (_mm512_cvtph_ps(_mm512_castsi512_si256(v)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v)))
    }
}

/// 32 values as bf16 high parts (their top 16 bits) and low parts (the exact rest).
#[inline(always)]
unsafe fn split(x0: __m512, x1: __m512) -> (__m512i, __m512i) {
    let idx = _mm512_loadu_si512(HIGH_WORDS.as_ptr() as *const _);
    let top = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let (b0, b1) = (_mm512_castps_si512(x0), _mm512_castps_si512(x1));
    let l0 = _mm512_castps_si512(_mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_and_si512(b0, top))));
    let l1 = _mm512_castps_si512(_mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_and_si512(b1, top))));
    (_mm512_permutex2var_epi16(b0, idx, b1), _mm512_permutex2var_epi16(l0, idx, l1))
}

/// Converts `nt` (≤ 32) tokens' values kb0..kb0 + kbl into the token buffer (hi and lo
/// rows `XS` apart), zero rows for the tokens past `nt`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn convert_tokens(f32_src: bool, src: *const u8, stride: usize, nt: usize, k: usize, kb0: usize, kbl: usize, x: *mut u16) {
    for r in 0..2 * T {
        let (hi, lo) = (x.add(r * XS), x.add((2 * T + r) * XS));
        if r >= nt {
            std::ptr::write_bytes(hi, 0, kbl);
            std::ptr::write_bytes(lo, 0, kbl);
            continue;
        }
        let row = src.add(r * stride);
        for i in (0..kbl).step_by(KS) {
            let (x0, x1) = load32(f32_src, row, kb0 + i, k);
            let (h, l) = split(x0, x1);
            _mm512_storeu_si512(hi.add(i) as *mut _, h);
            _mm512_storeu_si512(lo.add(i) as *mut _, l);
        }
    }
}

/// Packs `rows` (≤ 16) f16 weight rows of `k` values into `steps` hi and lo tiles in AMX's
/// pair layout (tile row j: the values 2j and 2j + 1 of each of the 16 rows), zeros past
/// `rows` and `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn pack_weights(src: *const u8, stride: usize, rows: usize, k: usize, steps: usize, dst: *mut u16) {
    for s in 0..steps {
        let (hi, lo) = (dst.add(s * 2 * TILE_U16) as *mut __m512i, dst.add((s * 2 + 1) * TILE_U16) as *mut __m512i);
        let mut h = [_mm512_setzero_si512(); T];
        let mut l = [_mm512_setzero_si512(); T];
        for r in 0..rows {
            let (x0, x1) = load32(false, src.add(r * stride), s * KS, k);
            (h[r], l[r]) = split(x0, x1);
        }
        // Pair j of row r goes to 32-bit word j·16 + r of the tile: a 16 × 16 transpose of
        // 32-bit words (scattering them cost as much as the tile products over 256 tokens).
        for (t, words) in [(hi, h), (lo, l)] {
            for (j, v) in transpose16(&words).into_iter().enumerate() {
                _mm512_storeu_si512(t.add(j), v);
            }
        }
    }
}

/// The 16 × 16 transpose of 32-bit words: word c of row r becomes word r of row c (pairs of
/// words, then pairs of pairs, then 128-bit lanes).
#[inline(always)]
unsafe fn transpose16(a: &[__m512i; T]) -> [__m512i; T] {
    // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved, words 0-1 and 2-3 of each lane.
    let t: [__m512i; T] = std::array::from_fn(|x| {
        let (i, hi) = (x / 2, x % 2 == 1);
        if hi { _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]) } else { _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]) }
    });
    // u[4i + q], lane L: word 4L + q of rows 4i..4i + 3.
    let u: [__m512i; T] = std::array::from_fn(|x| {
        let (i, q) = (x / 4, x % 4);
        let (p0, p1) = (t[4 * i + q / 2], t[4 * i + 2 + q / 2]);
        if q % 2 == 1 { _mm512_unpackhi_epi64(p0, p1) } else { _mm512_unpacklo_epi64(p0, p1) }
    });
    let mut out = [_mm512_setzero_si512(); T];
    for q in 0..4 {
        // Lanes 0 and 2 (v0, w0), 1 and 3 (v1, w1) of rows 0-7 and 8-15.
        let v0 = _mm512_shuffle_i32x4::<0x88>(u[q], u[4 + q]);
        let v1 = _mm512_shuffle_i32x4::<0xDD>(u[q], u[4 + q]);
        let w0 = _mm512_shuffle_i32x4::<0x88>(u[8 + q], u[12 + q]);
        let w1 = _mm512_shuffle_i32x4::<0xDD>(u[8 + q], u[12 + q]);
        out[q] = _mm512_shuffle_i32x4::<0x88>(v0, w0);
        out[8 + q] = _mm512_shuffle_i32x4::<0xDD>(v0, w0);
        out[4 + q] = _mm512_shuffle_i32x4::<0x88>(v1, w1);
        out[12 + q] = _mm512_shuffle_i32x4::<0xDD>(v1, w1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::{bytes, check_fast_sums, values};
    use super::super::{scalar, Dot, Elem};

    /// Word c of row r becomes word r of row c.
    #[test]
    fn transpose16_transposes_words() {
        if !super::available() {
            return;
        }
        let rows: [[u32; 16]; 16] = std::array::from_fn(|r| std::array::from_fn(|c| (r * 100 + c) as u32));
        // SAFETY: the CPU has AVX-512 (checked by `available`); plain loads and stores.
        let got = unsafe { transposed(&rows) };
        for (c, row) in got.iter().enumerate() {
            assert_eq!(*row, std::array::from_fn::<u32, 16, _>(|r| (r * 100 + c) as u32), "row {c}");
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn transposed(rows: &[[u32; 16]; 16]) -> [[u32; 16]; 16] {
        use std::arch::x86_64::*;
        let a: [__m512i; 16] = std::array::from_fn(|r| _mm512_loadu_si512(rows[r].as_ptr() as *const _));
        let t = super::transpose16(&a);
        let mut out = [[0u32; 16]; 16];
        for (o, v) in out.iter_mut().zip(t) {
            _mm512_storeu_si512(o.as_mut_ptr() as *mut _, v);
        }
        out
    }

    fn h(x: f32) -> f32 {
        scalar::f16_to_f32(scalar::f32_to_f16(x))
    }

    /// Every output within the bound of f32 sums in `SUB`-value stretches of the exact
    /// products of the f16 operands ((2·min(k, SUB) + stretches) · 2⁻²⁴ · Σ|a·b|, from an
    /// f64 sum: a stretch's large and small sums each round), over shapes with partial
    /// tiles, K tails, broadcast batches; f16 and f32 activations; 2 and 3 threads give the
    /// same bits as one.
    #[test]
    fn amx_products_are_stretched_f32_sums_of_exact_products() {
        if !super::available() {
            return;
        }
        let shapes = [(1, 1, 1), (7, 5, 3), (300, 17, 13), (513, 40, 7), (256, 16, 32), (1000, 33, 50), (40, 130, 200), (2100, 48, 40)];
        for (si, &(k, m, n)) in shapes.iter().enumerate() {
            for eb in [Elem::F32, Elem::F16] {
                let (a, b) = (values(si as u64 + 1, k * m), values(si as u64 + 100, k * n * 2));
                let (ab, bb) = (bytes(&a, Elem::F16), bytes(&b, eb));
                let term = |bi: usize, j: usize, i: usize, x: usize| h(a[i * k + x]) as f64 * h(b[bi * k * n + j * k + x]) as f64;
                let roundings = 2 * k.min(super::SUB) + k.div_ceil(super::SUB);
                check_fast_sums(&format!("{eb:?}"), Dot::F16, (Elem::F16, &ab), (eb, &bb), (k, m, n), roundings, term);
            }
        }
    }
}
