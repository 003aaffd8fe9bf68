//! The fast path's q8_0 products on CPUs with AMX-INT8 (issue 28, `fast=1`; never on the
//! exact path). The activations are quantized to q8_0 as ggml quantizes them (the same
//! quants and scales as the exact path's), and a tile multiply gives each block's integer
//! sum of quant products exactly, for 16 tokens × 16 weight rows at once; every output is
//! then the f32 sum, block after block, of its block sums times the two blocks' scales (one
//! fused multiply-add each). ggml sums each block in eight lanes of four products, scaled
//! and summed lane by lane, so the outputs differ from the exact path's by the rounding of
//! the sums only (as the reference's fastest build's q8_0 products differ from its default
//! build's).
//!
//! Layout: token tiles are 16 quantized tokens in plain rows (a block's 32 quants = one
//! tile load of 32 bytes per row), then their scales block-major; weight tiles are AMX's
//! quad-interleaved layout (tile row j: values 4j..4j + 3 of each of 16 weight rows) with
//! the rows' 16 scales after each block's tile, packed once per task. Tiles: tmm0/1 two
//! blocks' integer sums, tmm2/3 their token tiles, tmm4/5 their weight tiles. The sums go
//! through memory (tiles have no path to vector registers) into 16 accumulators that stay
//! in registers over the whole K.

use super::amx::{lanes, TileConfig};
use super::{Dot, Elem, Lines, Problem, Task};
use std::arch::asm;
use std::arch::x86_64::*;

/// Tokens per tile, and weight rows per tile (16 i32 = one 64-byte row).
const T: usize = 16;
/// Values per q8_0 block: one tile multiply.
const QK: usize = 32;
/// Bytes per packed weight block: its tile (8 rows of 64 bytes), then 16 f32 scales.
const W_BLOCK: usize = 512 + 64;

/// Per-thread buffers, kept between calls.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The task's weight rows packed: group g of 16 rows, block b at `(g · nb + b) · W_BLOCK`.
    w: Lines,
    /// (batch, first row) of the weights now packed (this call's: `run` forgets it).
    w_key: Option<(usize, usize)>,
    /// Quantized token tiles of this batch (`tile_bytes` each, while `gemm::Q8_CACHE_BYTES`
    /// last; later ones are quantized again per task, into the spare after them).
    x: Lines,
    /// Which of `x`'s tiles hold their tokens (this call's).
    x_made: super::QuantizedPanels,
    /// Two blocks' integer sums on their way from the tiles (i32).
    c: Lines,
}

/// Whether these kernels run: AVX-512 (BW, VL), AMX-INT8 and tile permission
/// (`amx::tile_unit`), and `SD_CPU_AMX` not `0`.
pub(crate) fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // CPUID leaf 7, EDX bit 25: AMX-INT8.
    *ON.get_or_init(|| super::amx::tile_unit(25))
}

/// Whether these kernels compute `p`: q8_0 weights times f32 activations.
pub(crate) fn supports(p: &Problem) -> bool {
    p.dot == Dot::Q8_0 && p.a.ty == Elem::Q8_0 && p.b.ty == Elem::F32 && p.k.is_multiple_of(QK)
}

/// Distance of a token tile's rows: one cache line more than the quants, so that 16 rows
/// do not fall in a few L1 sets when k is a multiple of 4096.
fn row_bytes(k: usize) -> usize {
    k + 64
}

/// Bytes of one quantized token tile: 16 rows, then `nb` × 16 f32 scales.
fn tile_bytes(k: usize) -> usize {
    T * row_bytes(k) + k / QK * T * 4
}

/// Runs the thread's tasks (consecutive ones over the same rows pack them once).
///
/// # Safety
/// `available()`; `p` describes live memory (see `gemm::run`) and `supports(p)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn run(p: &Problem, tasks: impl Iterator<Item = Task>, s: &mut Scratch) {
    let cfg = TileConfig::new(&[(16, 64), (16, 64), (16, QK as u16), (16, QK as u16), (8, 64), (8, 64)]);
    asm!("ldtilecfg [{0}]", in(reg) &cfg, options(nostack, readonly));
    s.w_key = None;
    s.x_made.forget();
    for t in tasks {
        task(p, &t, s);
    }
    asm!("tilerelease", options(nostack, nomem));
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn task(p: &Problem, t: &Task, s: &mut Scratch) {
    let (k, nb) = (p.k, p.k / QK);
    let (rows, groups) = (t.m1 - t.m0, (t.m1 - t.m0).div_ceil(T));
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let w = s.w.at_least::<u8>(groups * nb * W_BLOCK);
    if s.w_key != Some((t.batch, t.m0)) {
        for g in 0..groups {
            let first = t.m0 + g * T;
            pack_weights(arow.wrapping_add(first * p.a.nb[0]), p.a.nb[0], (rows - g * T).min(T), nb, w.add(g * nb * W_BLOCK));
        }
        s.w_key = Some((t.batch, t.m0));
    }
    let tb = tile_bytes(k);
    let room = s.x_made.room(t.batch, tb, p.n.div_ceil(T));
    let x = s.x.at_least::<u8>((room + 1) * tb);
    let c = s.c.at_least::<i32>(2 * T * T);
    let ldc = p.out_nb[0];
    for n0 in (t.n0..t.n1).step_by(T) {
        let nt = T.min(t.n1 - n0);
        // A tile starting on a multiple of 16 has a slot; a task's odd start does not.
        let (slot, made) = s.x_made.slot(n0, T);
        let xt = x.add(slot.unwrap_or(room) * tb);
        if !made {
            // A cached tile holds all 16 of its tokens (or the product's last ones).
            let count = if slot.is_some() { T.min(p.n - n0) } else { nt };
            quantize_tokens(brow.wrapping_add(n0 * p.b.nb[0]), p.b.nb[0], count, k, xt);
            s.x_made.made(slot);
        }
        for g in 0..groups {
            let acc = sums(xt, xt.add(T * row_bytes(k)) as *const f32, row_bytes(k), w.add(g * nb * W_BLOCK), nb, c);
            let mr = (rows - g * T).min(T);
            let mask = lanes(mr);
            for (r, v) in acc.iter().enumerate().take(nt) {
                _mm512_mask_storeu_ps(out.add((n0 + r) * ldc + 4 * (t.m0 + g * T)) as *mut f32, mask, *v);
            }
        }
    }
}

/// The 16 × 16 outputs of one token tile and one weight group over `nb` blocks: row r holds
/// token r's outputs for the group's 16 weight rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn sums(xq: *const u8, xd: *const f32, xs: usize, w: *const u8, nb: usize, c: *mut i32) -> [__m512; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    let mut b = 0;
    while b < nb {
        let two = b + 1 < nb;
        if two {
            asm!(
                "tileloadd tmm2, [{x0} + {xs}*1]",
                "tileloadd tmm4, [{w0} + {s64}*1]",
                "tdpbssd tmm0, tmm2, tmm4",
                "tileloadd tmm3, [{x1} + {xs}*1]",
                "tileloadd tmm5, [{w1} + {s64}*1]",
                "tdpbssd tmm1, tmm3, tmm5",
                "tilestored [{c0} + {s64}*1], tmm0",
                "tilestored [{c1} + {s64}*1], tmm1",
                "tilezero tmm0",
                "tilezero tmm1",
                x0 = in(reg) xq.add(b * QK),
                x1 = in(reg) xq.add((b + 1) * QK),
                w0 = in(reg) w.add(b * W_BLOCK),
                w1 = in(reg) w.add((b + 1) * W_BLOCK),
                c0 = in(reg) c,
                c1 = in(reg) c.add(T * T),
                xs = in(reg) xs,
                s64 = in(reg) 64usize,
                options(nostack),
            );
        } else {
            asm!(
                "tileloadd tmm2, [{x0} + {xs}*1]",
                "tileloadd tmm4, [{w0} + {s64}*1]",
                "tdpbssd tmm0, tmm2, tmm4",
                "tilestored [{c0} + {s64}*1], tmm0",
                "tilezero tmm0",
                x0 = in(reg) xq.add(b * QK),
                w0 = in(reg) w.add(b * W_BLOCK),
                c0 = in(reg) c,
                xs = in(reg) xs,
                s64 = in(reg) 64usize,
                options(nostack),
            );
        }
        for h in 0..1 + two as usize {
            let bb = b + h;
            let dw = _mm512_loadu_ps(w.add(bb * W_BLOCK + 512) as *const f32);
            let ci = c.add(h * T * T);
            for (r, a) in acc.iter_mut().enumerate() {
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(bb * T + r)));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(ci.add(r * T) as *const _)), scale, *a);
            }
        }
        b += 2;
    }
    acc
}

/// Quantizes `count` (≤ 16) tokens of `k` f32 (rows `stride` bytes apart) into a token tile
/// as ggml's `quantize_row_q8_0` does (scale amax / 127 through f16, quants round(x · 127 /
/// amax) to nearest even); zero rows and scales past `count`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn quantize_tokens(src: *const u8, stride: usize, count: usize, k: usize, dst: *mut u8) {
    let xs = row_bytes(k);
    let d = dst.add(T * xs) as *mut f32;
    for r in 0..T {
        let q = dst.add(r * xs) as *mut i8;
        if r >= count {
            std::ptr::write_bytes(q, 0, k);
            for b in 0..k / QK {
                *d.add(b * T + r) = 0.0;
            }
            continue;
        }
        let row = src.add(r * stride) as *const f32;
        for b in 0..k / QK {
            let (v0, v1) = (_mm512_loadu_ps(row.add(b * QK)), _mm512_loadu_ps(row.add(b * QK + 16)));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(amax / 127.0));
            *d.add(b * T + r) = _mm_cvtss_f32(_mm_cvtph_ps(h));
            let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let round = |v: __m512| _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(v, id));
            _mm_storeu_si128(q.add(b * QK) as *mut __m128i, _mm512_cvtsepi32_epi8(round(v0)));
            _mm_storeu_si128(q.add(b * QK + 16) as *mut __m128i, _mm512_cvtsepi32_epi8(round(v1)));
        }
    }
}

/// Packs `rows` (≤ 16) q8_0 weight rows of `nb` blocks (rows `stride` bytes apart) into
/// `nb` weight tiles with their scales: tile row j holds values 4j..4j + 3 of each row,
/// zero quants and scales past `rows`.
unsafe fn pack_weights(src: *const u8, stride: usize, rows: usize, nb: usize, dst: *mut u8) {
    for b in 0..nb {
        let tile = dst.add(b * W_BLOCK);
        let scales = tile.add(512) as *mut f32;
        for r in 0..T {
            if r >= rows {
                for j in 0..8 {
                    (tile.add((j * T + r) * 4) as *mut u32).write_unaligned(0);
                }
                *scales.add(r) = 0.0;
                continue;
            }
            let blk = src.add(r * stride + b * super::scalar::Q8_0_BYTES);
            for j in 0..8 {
                let quad = (blk.add(2 + 4 * j) as *const u32).read_unaligned();
                (tile.add((j * T + r) * 4) as *mut u32).write_unaligned(quad);
            }
            *scales.add(r) = super::scalar::f16_to_f32(u16::from_le_bytes([*blk, *blk.add(1)]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check_fast_sums, values};
    use super::super::{scalar, Dot, Elem};

    /// `v` (a multiple of 32 values) as q8_0 blocks, and each value's (scale, quant).
    fn quantized(v: &[f32]) -> (Vec<u8>, Vec<(f64, f64)>) {
        let mut bytes = vec![0u8; v.len() / 32 * scalar::Q8_0_BYTES];
        let mut each = Vec::with_capacity(v.len());
        for (blk, o) in v.chunks_exact(32).zip(bytes.chunks_exact_mut(scalar::Q8_0_BYTES)) {
            scalar::quantize_q8_0_block(blk, o);
            let d = scalar::f16_to_f32(u16::from_le_bytes([o[0], o[1]])) as f64;
            each.extend(o[2..].iter().map(|&q| (d, q as i8 as f64)));
        }
        (bytes, each)
    }

    /// Every output within the bound of an f32 sum, block after block, of the exact block
    /// sums times their scales ((blocks + 2) · 2⁻²⁴ · Σ|a·b|, from an f64 sum of the
    /// quantized values' products: the activations quantized as ggml quantizes them), over
    /// shapes with partial tiles, odd block counts, broadcast batches, tokens past the
    /// thread's cache of quantized tiles (64 KiB in tests); 2 and 3 threads give one's bits.
    #[test]
    fn amx_q8_products_are_f32_sums_of_exact_block_sums() {
        if !super::available() {
            return;
        }
        let shapes = [(32, 1, 1), (96, 5, 3), (320, 17, 13), (64, 40, 70), (1024, 33, 50), (3840, 48, 40), (160, 130, 300)];
        for (si, &(k, m, n)) in shapes.iter().enumerate() {
            let (a, b) = (values(si as u64 + 1, k * m), values(si as u64 + 100, k * n * 2));
            // Some blocks of zeros (scale 0) and of one large value.
            let mut b = b;
            let zeros = 32.min(b.len());
            b[..zeros].fill(0.0);
            if b.len() > 64 {
                b[40] = 1e4;
            }
            let ((aq, ae), (_, be)) = (quantized(&a), quantized(&b));
            let bb: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
            let term = |bi: usize, j: usize, i: usize, x: usize| {
                let ((da, qa), (db, qb)) = (ae[i * k + x], be[bi * k * n + j * k + x]);
                da * db * qa * qb
            };
            check_fast_sums("q8_0", Dot::Q8_0, (Elem::Q8_0, &aq), (Elem::F32, &bb), (k, m, n), k / 32 + 2, term);
        }
    }
}
