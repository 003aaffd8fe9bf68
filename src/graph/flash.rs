//! Fused attention on the CPU as our own ggml op: the values of ggml's `flash_attn_ext` as
//! its AVX2 (`haswell`) CPU variant computes them for f32 queries, f16 keys and values and
//! 64 or more query rows per head (its tiled kernel), on CPUs with AVX-512, faster.
//!
//! ggml's tiled kernel takes 64 query rows and 64 keys at a time: scores are f32 sums over
//! the head's values in order (one fused multiply-add each, from zero), scaled; each row's
//! running maximum and sum are updated once per key tile (the sum in f64 per 8 keys, its own
//! 8-lane exponential); the values join in order of keys, one fused multiply-add each, onto
//! the row's accumulator. Every step is per output element and in a fixed order, so vectors
//! of 16 give the same bits as its vectors of 8. What costs ggml the time — keys converted
//! and transposed one value at a time for every tile of queries, 8-lane products — is done
//! here once per task and with 16 lanes.

use super::context::{Graph, F16, F32, T};
use super::gemm::TaskQueue;
use ggml_sys as g;
use std::ffi::{c_int, c_void};

/// Keys per tile (ggml's `GGML_FA_TILE_KV`): where the running maximum is updated.
const KV_TILE: usize = 64;
/// Query rows per task (rows are independent: any blocking gives the same values).
const Q_BLOCK: usize = 64;
/// ggml's tiled kernel runs for at least this many query rows per head (its `GGML_FA_TILE_Q`).
const MIN_ROWS: i64 = 64;
/// The most bytes of converted keys and values a thread keeps for a head (see `task`; the
/// unit tests' shapes take both ways with their smaller value).
const HEAD_BYTES: usize = if cfg!(test) { 64 << 10 } else { 4 << 20 };

/// What the op's user-data word points at.
#[repr(C)]
struct OpData {
    queue: TaskQueue,
    scale: f32,
}

/// Whether the kernels run here: x86-64 with AVX-512 (F, DQ, VL allowed) and F16C, and
/// `SD_CPU_OWN_ATTENTION` not `0`.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            !matches!(std::env::var("SD_CPU_OWN_ATTENTION").as_deref().map(str::trim), Ok("0" | "off"))
                && super::gemm::x86::avx512vl_allowed()
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `q.flash_attn_ext(k, v, mask, scale)` (q `[D, L_q, H, B]` f32, k/v `[D, L_k, H_kv, B_kv]`
/// f16, an f16 mask `[L_k, ≥ L_q, H or 1, B or 1]` added to the scaled scores, output
/// `[D_v, H, L_q, B]`) by our op, when it reproduces ggml's for these shapes and the graph
/// runs on a CPU that has the kernels; otherwise None (the caller keeps ggml's).
pub(crate) fn flash_attn<'g>(g: &'g Graph, q: T<'g>, k: T<'g>, v: T<'g>, mask: Option<T<'g>>, scale: f32) -> Option<T<'g>> {
    if !g.on_cpu || !available() || super::eval_callback::is_set() {
        return None;
    }
    let (qn, kn, vn) = (q.ne(), k.ne(), v.ne());
    let ok = q.ty() == F32
        && k.ty() == F16
        && v.ty() == F16
        && qn[0] == kn[0]
        && kn[1] == vn[1]
        && kn[2] == vn[2]
        && kn[3] == vn[3]
        && qn[1] >= MIN_ROWS
        && kn[1] > 0
        && vn[0] > 0
        && kn[2] > 0
        && qn[2] % kn[2] == 0
        && kn[3] > 0
        && qn[3] % kn[3] == 0
        && rows_contiguous(q)
        && rows_contiguous(k)
        && rows_contiguous(v)
        && mask.is_none_or(|m| {
            let mn = m.ne();
            m.ty() == F16 && mn[0] == kn[1] && mn[1] >= qn[1] && mn[2] > 0 && qn[2] % mn[2] == 0 && mn[3] > 0 && qn[3] % mn[3] == 0 && rows_contiguous(m)
        });
    if !ok {
        return None;
    }
    let data = super::context::store_in_ctx(q.ctx(), OpData { queue: TaskQueue::new(), scale })?;
    let mut args = [q.raw(), k.raw(), v.raw(), mask.map_or(std::ptr::null_mut(), |m| m.raw())];
    let n_args = if mask.is_some() { 4 } else { 3 };
    // SAFETY: a live context and sources; the callback reads the sources and writes only its
    // own output; the user-data word points into the same context.
    let out = unsafe { g::ggml_custom_4d(q.ctx(), F32, vn[0], qn[2], qn[1], qn[3], args.as_mut_ptr(), n_args, Some(compute), -1, data as *mut c_void) };
    Some(q.wrap(out))
}

fn rows_contiguous(t: T<'_>) -> bool {
    // SAFETY: a pure lookup.
    t.nb()[0] == unsafe { g::ggml_type_size(t.ty()) }
}

/// The shapes and memory of one attention.
#[derive(Clone, Copy)]
struct Problem {
    dk: usize,
    dv: usize,
    lq: usize,
    lk: usize,
    heads: [usize; 2],
    /// Query heads per key head, per dimension (ggml's broadcast).
    bcast: [usize; 2],
    q: *const u8,
    qnb: [usize; 3],
    k: *const u8,
    knb: [usize; 3],
    v: *const u8,
    vnb: [usize; 3],
    /// The f16 mask (null without one), its rows' strides and its heads and batches.
    mask: *const u8,
    mnb: [usize; 3],
    mne: [usize; 2],
    out: *mut u8,
    /// Bytes between outputs of consecutive heads (rows of D_v f32).
    out_row: usize,
    scale: f32,
}

impl Problem {
    fn blocks(&self) -> usize {
        self.lq.div_ceil(Q_BLOCK)
    }

    fn tasks(&self) -> usize {
        self.heads[0] * self.heads[1] * self.blocks()
    }
}

pub(super) unsafe extern "C" fn compute(dst: *mut g::ggml_tensor, _ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `flash_attn`: sources q, k, v and an
        // f32 output, all allocated, shapes as checked there; the user-data word is that
        // node's `OpData`; ggml runs a custom op with n_tasks -1 on all of its threads.
        unsafe {
            let d = &*dst;
            let (q, k, v) = (&*d.src[0], &*d.src[1], &*d.src[2]);
            let data = &*(userdata as *const OpData);
            let us = |x: i64| x as usize;
            let p = Problem {
                dk: us(q.ne[0]),
                dv: us(v.ne[0]),
                lq: us(q.ne[1]),
                lk: us(k.ne[1]),
                heads: [us(q.ne[2]), us(q.ne[3])],
                bcast: [us(q.ne[2] / k.ne[2]), us(q.ne[3] / k.ne[3])],
                q: q.data as *const u8,
                qnb: [q.nb[1], q.nb[2], q.nb[3]],
                k: k.data as *const u8,
                knb: [k.nb[1], k.nb[2], k.nb[3]],
                v: v.data as *const u8,
                vnb: [v.nb[1], v.nb[2], v.nb[3]],
                mask: d.src[3].as_ref().map_or(std::ptr::null(), |m| m.data as *const u8),
                mnb: d.src[3].as_ref().map_or([0; 3], |m| [m.nb[1], m.nb[2], m.nb[3]]),
                mne: d.src[3].as_ref().map_or([1; 2], |m| [us(m.ne[2]), us(m.ne[3])]),
                out: d.data as *mut u8,
                out_row: d.nb[1],
                scale: data.scale,
            };
            let nth = nth.max(1) as usize;
            let _finish = data.queue.finish_guard(nth);
            #[cfg(target_arch = "x86_64")]
            SCRATCH.with(|s| {
                let s = &mut s.borrow_mut();
                s.forget();
                loop {
                    let i = data.queue.claim();
                    if i >= p.tasks() {
                        break;
                    }
                    kernels::task(&p, i, s);
                }
            });
        }
    });
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static SCRATCH: std::cell::RefCell<kernels::Scratch> = std::cell::RefCell::new(kernels::Scratch::default());
}

#[cfg(target_arch = "x86_64")]
mod kernels {
    use super::{Problem, HEAD_BYTES, KV_TILE, Q_BLOCK};
    use crate::graph::gemm::scalar::f16_to_f32;
    use crate::graph::gemm::Lines;
    use std::arch::x86_64::*;

    /// Per-thread buffers, kept between calls.
    #[derive(Default)]
    pub(super) struct Scratch {
        /// The keys of one head as f32, tile t transposed at `t · dk · KV_TILE`: value d of
        /// key j at `d · KV_TILE + j` (a thread's consecutive tasks share a head).
        kt: Lines,
        /// That head's values as f32 rows, zero rows past the last key.
        v: Lines,
        /// (keys, values) of the head now converted (this compute's: `forget` clears it).
        head: Option<(usize, usize)>,
        /// Scores, then probabilities: row r, key j at `r · KV_TILE + j`.
        kq: Lines,
        /// The rows' accumulated values: row r at `r · dv`.
        acc: Lines,
    }

    impl Scratch {
        /// Forgets the converted head: another compute's tensors may live at its address.
        pub(super) fn forget(&mut self) {
            self.head = None;
        }
    }

    /// Task `i`: one head's block of query rows.
    pub(super) fn task(p: &Problem, i: usize, s: &mut Scratch) {
        // SAFETY: `available()` checked the features before the op was built; `p` describes
        // the node's live tensors.
        unsafe { task_avx512(p, i, s) }
    }

    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn task_avx512(p: &Problem, i: usize, s: &mut Scratch) {
        // Values and accumulators are held 16 wide: zero columns past d_v.
        let (dk, dv) = (p.dk, p.dv.div_ceil(16) * 16);
        let head = i / p.blocks();
        let r0 = (i % p.blocks()) * Q_BLOCK;
        let rows = Q_BLOCK.min(p.lq - r0);
        let (h2, h3) = (head % p.heads[0], head / p.heads[0]);
        let q = p.q.add(r0 * p.qnb[0] + h2 * p.qnb[1] + h3 * p.qnb[2]);
        let kh = p.k.add(h2 / p.bcast[0] * p.knb[1] + h3 / p.bcast[1] * p.knb[2]);
        let vh = p.v.add(h2 / p.bcast[0] * p.vnb[1] + h3 / p.bcast[1] * p.vnb[2]);
        let mask = (!p.mask.is_null()).then(|| p.mask.add(h2 % p.mne[0] * p.mnb[1] + h3 % p.mne[1] * p.mnb[2]));
        let tiles = p.lk.div_ceil(KV_TILE);
        // A head's keys and values are converted once per thread while they fit in
        // `HEAD_BYTES`; a longer one's tile by tile per task (as ggml does).
        let whole = tiles * KV_TILE * (dk + dv) * 4 <= HEAD_BYTES;
        let held = if whole { tiles } else { 1 };
        let (kts, vs) = (s.kt.at_least::<f32>(held * dk * KV_TILE), s.v.at_least::<f32>(held * KV_TILE * dv));
        let pack = |t: usize, at: usize| {
            let (c0, n) = (t * KV_TILE, KV_TILE.min(p.lk - t * KV_TILE));
            pack_keys(kh.add(c0 * p.knb[0]), p.knb[0], n, dk, kts.add(at * dk * KV_TILE));
            pack_values(vh.add(c0 * p.vnb[0]), p.vnb[0], n, p.dv, vs.add(at * KV_TILE * dv));
        };
        if !whole {
            s.head = None;
        } else if s.head != Some((kh as usize, vh as usize)) {
            for t in 0..tiles {
                pack(t, t);
            }
            s.head = Some((kh as usize, vh as usize));
        }
        let kq = s.kq.at_least::<f32>(Q_BLOCK * KV_TILE);
        let acc = s.acc.at_least::<f32>(Q_BLOCK * dv);
        std::ptr::write_bytes(acc, 0, Q_BLOCK * dv);
        let mut m = [f32::NEG_INFINITY; Q_BLOCK];
        let mut sum = [0f32; Q_BLOCK];
        for t in 0..tiles {
            let (c0, n) = (t * KV_TILE, KV_TILE.min(p.lk - t * KV_TILE));
            let at = if whole { t } else { 0 };
            if !whole {
                pack(t, 0);
            }
            let (kt, vt) = (kts.add(at * dk * KV_TILE) as *const f32, vs.add(at * KV_TILE * dv) as *const f32);
            scores(q, p.qnb[0], rows, dk, kt, kq);
            let scale = _mm512_set1_ps(p.scale);
            let pad = _mm512_set1_ps(f32::NEG_INFINITY);
            for r in 0..rows {
                let row = kq.add(r * KV_TILE);
                let mrow = mask.map(|m| m.add((r0 + r) * p.mnb[0] + c0 * 2) as *const i16);
                for j in (0..KV_TILE).step_by(16) {
                    let keep = lanes(n.saturating_sub(j));
                    let x = _mm512_mul_ps(_mm512_loadu_ps(row.add(j)), scale);
                    let mut x = _mm512_mask_blend_ps(keep, pad, x);
                    if let Some(m) = mrow {
                        x = _mm512_add_ps(x, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, m.add(j))));
                    }
                    _mm512_storeu_ps(row.add(j), x);
                }
                softmax_row(row, &mut m[r], &mut sum[r], acc.add(r * dv), dv);
            }
            weigh_values(kq, rows, vt, dv, acc);
        }
        for r in 0..rows {
            let inv = if sum[r] == 0.0 { 0.0 } else { 1.0 / sum[r] };
            let a = acc.add(r * dv);
            let o = p.out.add(((h3 * p.lq + r0 + r) * p.heads[0] + h2) * p.out_row) as *mut f32;
            let vinv = _mm512_set1_ps(inv);
            for d in (0..dv).step_by(16) {
                _mm512_mask_storeu_ps(o.add(d), lanes(p.dv - d), _mm512_mul_ps(_mm512_loadu_ps(a.add(d)), vinv));
            }
        }
    }

    /// `n` f16 key rows (`stride` bytes apart) of `dk` values as f32 into `kt` transposed,
    /// zeros for the keys past `n`.
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn pack_keys(src: *const u8, stride: usize, n: usize, dk: usize, kt: *mut f32) {
        for j in 0..KV_TILE {
            if j >= n {
                for d in 0..dk {
                    *kt.add(d * KV_TILE + j) = 0.0;
                }
                continue;
            }
            let row = src.add(j * stride) as *const u16;
            let mut d = 0;
            while d + 16 <= dk {
                let v = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(d) as *const __m256i));
                let mut tmp = [0f32; 16];
                _mm512_storeu_ps(tmp.as_mut_ptr(), v);
                for (x, t) in tmp.iter().enumerate() {
                    *kt.add((d + x) * KV_TILE + j) = *t;
                }
                d += 16;
            }
            for d in d..dk {
                *kt.add(d * KV_TILE + j) = f16_to_f32(*row.add(d));
            }
        }
    }

    /// The first `n` (of 16) lanes.
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            !0
        } else {
            (1u16 << n) - 1
        }
    }

    /// `n` f16 value rows of `dv` values as f32 rows of `dv` rounded up to 16, zeros past `n`
    /// and past `dv`.
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn pack_values(src: *const u8, stride: usize, n: usize, dv: usize, vt: *mut f32) {
        let width = dv.div_ceil(16) * 16;
        for j in 0..KV_TILE {
            let out = vt.add(j * width);
            for d in (0..width).step_by(16) {
                let v = if j < n { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(dv - d), src.add(j * stride + 2 * d) as *const i16)) } else { _mm512_setzero_ps() };
                _mm512_storeu_ps(out.add(d), v);
            }
        }
    }

    /// Rows of scores: `kq[r][j] = Σ_d q[r][d] · kt[d][j]`, each a chain of fused
    /// multiply-adds from zero over d in order (ggml's `simd_gemm` per output).
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn scores(q: *const u8, qstride: usize, rows: usize, dk: usize, kt: *const f32, kq: *mut f32) {
        let mut r = 0;
        while r + 6 <= rows {
            scores_rows::<6>(q.add(r * qstride), qstride, dk, kt, kq.add(r * KV_TILE));
            r += 6;
        }
        while r < rows {
            scores_rows::<1>(q.add(r * qstride), qstride, dk, kt, kq.add(r * KV_TILE));
            r += 1;
        }
    }

    #[inline(always)]
    unsafe fn scores_rows<const RM: usize>(q: *const u8, qstride: usize, dk: usize, kt: *const f32, kq: *mut f32) {
        let mut acc = [[_mm512_setzero_ps(); 4]; RM];
        let rows: [*const f32; RM] = std::array::from_fn(|i| q.add(i * qstride) as *const f32);
        for d in 0..dk {
            let b: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(kt.add(d * KV_TILE + 16 * c)));
            for i in 0..RM {
                let a = _mm512_set1_ps(*rows[i].add(d));
                for c in 0..4 {
                    acc[i][c] = _mm512_fmadd_ps(b[c], a, acc[i][c]);
                }
            }
        }
        for i in 0..RM {
            for c in 0..4 {
                _mm512_storeu_ps(kq.add(i * KV_TILE + 16 * c), acc[i][c]);
            }
        }
    }

    /// One row's tile of scaled scores (padding at -inf): updates the running maximum `m`
    /// and sum `sum`, rescales the row's accumulator `acc` when the maximum grows, and
    /// leaves the row's probabilities in place (zeros for a row whose scores are all -inf).
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn softmax_row(row: *mut f32, m: &mut f32, sum: &mut f32, acc: *mut f32, dv: usize) {
        // ggml takes the maximum in order; any order gives the same value (up to the sign
        // of a zero maximum, which changes no difference from it).
        let mut vmax = _mm512_loadu_ps(row);
        for j in (16..KV_TILE).step_by(16) {
            vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row.add(j)));
        }
        let tile_max = _mm512_reduce_max_ps(vmax);
        if tile_max == f32::NEG_INFINITY {
            std::ptr::write_bytes(row, 0, KV_TILE);
            return;
        }
        let new = m.max(tile_max);
        if new > *m {
            let ms = (*m - new).exp();
            let v = _mm512_set1_ps(ms);
            for d in (0..dv).step_by(16) {
                _mm512_storeu_ps(acc.add(d), _mm512_mul_ps(_mm512_loadu_ps(acc.add(d)), v));
            }
            *sum *= ms;
        }
        *m = new;
        let mut total = 0f64;
        let vm = _mm512_set1_ps(new);
        for j in (0..KV_TILE).step_by(16) {
            let e = expf16(_mm512_sub_ps(_mm512_loadu_ps(row.add(j)), vm));
            _mm512_storeu_ps(row.add(j), e);
            // ggml sums 8 at a time: halves, then pairs, then the two, each in f32.
            for half in [_mm512_castps512_ps256(e), _mm512_extractf32x8_ps::<1>(e)] {
                let v = _mm_add_ps(_mm256_extractf128_ps::<1>(half), _mm256_castps256_ps128(half));
                let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
                let v = _mm_add_ss(v, _mm_movehdup_ps(v));
                total += _mm_cvtss_f32(v) as f64;
            }
        }
        *sum = (*sum as f64 + total) as f32;
    }

    /// ggml's 8-lane exponential (`ggml_v_expf`, AVX2 with FMA), 16 lanes at a time: the
    /// same operations on every lane, so the same bits.
    #[inline(always)]
    unsafe fn expf16(x: __m512) -> __m512 {
        let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
        let r = c(0x4b40_0000);
        let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
        let e = _mm512_slli_epi32::<23>(_mm512_castps_si512(z));
        let k = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_castps_si512(_mm512_set1_ps(1.0))));
        let abs_n = _mm512_andnot_ps(_mm512_set1_ps(-0.0), n);
        let big: __mmask16 = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs_n, _mm512_set1_ps(126.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(_mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)), u, _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb))),
            u,
            _mm512_mul_ps(c(0x3f7f_fff6), b),
        );
        let plain = _mm512_fmadd_ps(k, j, k);
        if big == 0 {
            return plain;
        }
        let neg: __mmask16 = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
        let g = _mm512_maskz_mov_epi32(neg, _mm512_set1_epi32(0x8200_0000u32 as i32));
        let s1 = _mm512_castsi512_ps(_mm512_add_epi32(g, _mm512_set1_epi32(0x7f00_0000)));
        let s2 = _mm512_castsi512_ps(_mm512_sub_epi32(e, g));
        let huge: __mmask16 = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(abs_n, _mm512_set1_ps(192.0));
        let scaled = _mm512_mul_ps(_mm512_fmadd_ps(s2, j, s2), s1);
        let out = _mm512_mask_blend_ps(big, plain, scaled);
        _mm512_mask_blend_ps(huge, out, _mm512_mul_ps(s1, s1))
    }

    /// `acc[r][d] += Σ_j kq[r][j] · v[j][d]`, each a chain of fused multiply-adds over j in
    /// order onto the accumulator (ggml's `simd_gemm` per output).
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma,f16c")]
    unsafe fn weigh_values(kq: *const f32, rows: usize, v: *const f32, dv: usize, acc: *mut f32) {
        let mut d = 0;
        while d + 64 <= dv {
            weigh_columns::<4>(kq, rows, v.add(d), dv, acc.add(d));
            d += 64;
        }
        while d < dv {
            weigh_columns::<1>(kq, rows, v.add(d), dv, acc.add(d));
            d += 16;
        }
    }

    /// `weigh_values` for the `RN` vectors of values at `v` (and `acc`), 6 rows at a time.
    #[inline(always)]
    unsafe fn weigh_columns<const RN: usize>(kq: *const f32, rows: usize, v: *const f32, dv: usize, acc: *mut f32) {
        let mut r = 0;
        while r + 6 <= rows {
            weigh_rows::<6, RN>(kq.add(r * KV_TILE), v, dv, acc.add(r * dv));
            r += 6;
        }
        while r < rows {
            weigh_rows::<1, RN>(kq.add(r * KV_TILE), v, dv, acc.add(r * dv));
            r += 1;
        }
    }

    #[inline(always)]
    unsafe fn weigh_rows<const RM: usize, const RN: usize>(kq: *const f32, v: *const f32, dv: usize, acc: *mut f32) {
        let mut c: [[__m512; RN]; RM] = std::array::from_fn(|i| std::array::from_fn(|n| _mm512_loadu_ps(acc.add(i * dv + 16 * n))));
        for j in 0..KV_TILE {
            let b: [__m512; RN] = std::array::from_fn(|n| _mm512_loadu_ps(v.add(j * dv + 16 * n)));
            for i in 0..RM {
                let a = _mm512_set1_ps(*kq.add(i * KV_TILE + j));
                for n in 0..RN {
                    c[i][n] = _mm512_fmadd_ps(b[n], a, c[i][n]);
                }
            }
        }
        for i in 0..RM {
            for n in 0..RN {
                _mm512_storeu_ps(acc.add(i * dv + 16 * n), c[i][n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::backend::Backend;
    use crate::graph::gemm::scalar::f32_to_f16;
    use crate::graph::runner::Runner;
    use std::sync::Arc;

    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f16_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| f32_to_f16(*x).to_le_bytes()).collect()
    }

    /// Our op gives ggml's `flash_attn_ext` bit for bit (its AVX2 variant, the one ggml runs
    /// on every machine we support), over query rows that fill and do not fill a block, key
    /// counts with and without a partial tile, shared key heads, a batch dimension, scores
    /// large enough for the exponential's far range, masks (one for all heads or one per
    /// head, causal, with key tiles and whole rows masked out), and 1 or 3 threads.
    #[test]
    fn flash_attention_gives_ggmls_values() {
        if !available() {
            eprintln!("note: no AVX-512 here: our attention op does not run");
            return;
        }
        if crate::graph::backend::cpu_variant().as_deref().is_some_and(|v| v != "haswell") {
            eprintln!("note: ggml's CPU variant is not haswell: nothing to compare with");
            return;
        }
        // (d, d_v, l_q, l_k, heads, kv heads, batch, q scale, threads, mask heads (0: none))
        let cases = [
            (128, 128, 64, 64, 2, 2, 1, 1.0, 1, 0),
            (128, 128, 100, 130, 3, 1, 1, 1.0, 3, 0),
            (64, 64, 200, 300, 2, 2, 2, 4.0, 2, 0),
            (96, 40, 70, 1, 1, 1, 1, 1.0, 1, 0),
            (40, 40, 300, 200, 2, 2, 1, 1.0, 2, 0),
            (128, 128, 65, 63, 2, 1, 1, 40.0, 3, 0),
            (40, 48, 128, 257, 4, 2, 1, 2.0, 2, 0),
            (80, 24, 150, 150, 2, 2, 1, 1.0, 2, 1),
            (64, 64, 100, 200, 3, 3, 1, 3.0, 3, 3),
        ];
        for (ci, &(d, dv, lq, lk, h, hk, b, qs, threads, mh)) in cases.iter().enumerate() {
            let seed = ci as u64 * 10;
            let qv = values(seed + 1, d * lq * h * b, qs);
            let kv = values(seed + 2, d * lk * hk * b, 1.0);
            let vv = values(seed + 3, dv * lk * hk * b, 1.0);
            let scale = 1.0 / (d as f32).sqrt();
            // Causal for one head, random with masked-out stretches for the others; rows 3
            // and 7 masked out entirely, and the first key tile for rows past 90.
            let noise = values(seed + 4, lk * lq * mh.max(1), 2.0);
            let mask: Vec<f32> = (0..lk * lq * mh.max(1))
                .map(|i| {
                    let (j, r, hh) = (i % lk, i / lk % lq, i / (lk * lq));
                    let out = r == 3 || r == 7 || (r > 90 && j < 64) || if hh == 0 { j > r + 20 } else { noise[i] > 1.5 };
                    if out { f32::NEG_INFINITY } else { noise[i] }
                })
                .collect();
            let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), threads);
            let outs = runner
                .compute_many(|g| {
                    let q = g.input_bytes(F32, &[d as i64, lq as i64, h as i64, b as i64], f32_bytes(&qv));
                    let k = g.input_bytes(F16, &[d as i64, lk as i64, hk as i64, b as i64], f16_bytes(&kv));
                    let v = g.input_bytes(F16, &[dv as i64, lk as i64, hk as i64, b as i64], f16_bytes(&vv));
                    let m = (mh > 0).then(|| g.input_bytes(F16, &[lk as i64, lq as i64, mh as i64, 1], f16_bytes(&mask)));
                    let ours = flash_attn(g, q, k, v, m, scale).expect("our op takes these shapes");
                    Ok(vec![q.flash_attn_ext(k, v, m, scale), ours])
                })
                .unwrap();
            let bits = |i: usize| outs[i].data().iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            let (theirs, ours) = (bits(0), bits(1));
            assert_eq!(theirs.len(), ours.len());
            let first = theirs.iter().zip(&ours).position(|(a, b)| a != b);
            assert_eq!(first, None, "case {ci}: ours {:?} ggml {:?}", first.map(|i| f32::from_bits(ours[i])), first.map(|i| f32::from_bits(theirs[i])));
        }
    }

    /// Speed next to ggml's kernel on Wan 2.1 1.3B's self-attention at 256²×17 frames
    /// (`cargo test --release --lib bench_flash -- --ignored --nocapture`; `SD_BENCH_THREADS`).
    #[test]
    #[ignore]
    fn bench_flash_vs_ggml() {
        if !available() {
            return;
        }
        let (d, l, h) = (128usize, 1280usize, 12usize);
        let threads: i32 = std::env::var("SD_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
        let (qv, kv, vv) = (values(1, d * l * h, 1.0), values(2, d * l * h, 1.0), values(3, d * l * h, 1.0));
        let shape = [d as i64, l as i64, h as i64, 1];
        let mut best = [f64::MAX; 2];
        for _ in 0..3 {
            for (side, own) in [false, true].into_iter().enumerate() {
                let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), threads);
                let mut run = || {
                    runner
                        .compute(|g| {
                            let q = g.input_bytes(F32, &shape, f32_bytes(&qv));
                            let k = g.input_bytes(F16, &shape, f16_bytes(&kv));
                            let v = g.input_bytes(F16, &shape, f16_bytes(&vv));
                            let scale = 1.0 / (d as f32).sqrt();
                            Ok(if own { flash_attn(g, q, k, v, None, scale).unwrap() } else { q.flash_attn_ext(k, v, None, scale) })
                        })
                        .unwrap()
                };
                run();
                let t = std::time::Instant::now();
                run();
                best[side] = best[side].min(t.elapsed().as_secs_f64());
            }
        }
        let flop = 4.0 * (d * l * l * h) as f64;
        println!("ggml {:.1} ms ({:.1} GFLOP/s), ours {:.1} ms ({:.1} GFLOP/s): {:.2}x", best[0] * 1e3, flop / best[0] / 1e9, best[1] * 1e3, flop / best[1] / 1e9, best[0] / best[1]);
    }

    /// Shapes the op does not reproduce are left to ggml.
    #[test]
    fn other_shapes_keep_ggmls_kernel() {
        let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), 1);
        runner
            .compute_many(|g| {
                let q = g.input_bytes(F32, &[64, 63, 1, 1], f32_bytes(&values(1, 64 * 63, 1.0)));
                let k = g.input_bytes(F16, &[64, 10, 1, 1], f16_bytes(&values(2, 640, 1.0)));
                let v = g.input_bytes(F16, &[64, 10, 1, 1], f16_bytes(&values(3, 640, 1.0)));
                assert!(flash_attn(g, q, k, v, None, 0.125).is_none(), "fewer than 64 query rows: ggml's other kernel");
                let k32 = g.input_bytes(F32, &[64, 10, 1, 1], f32_bytes(&values(2, 640, 1.0)));
                let q64 = g.input_bytes(F32, &[64, 64, 1, 1], f32_bytes(&values(1, 64 * 64, 1.0)));
                assert!(flash_attn(g, q64, k32, v, None, 0.125).is_none(), "f32 keys");
                let m32 = g.input_bytes(F32, &[10, 64, 1, 1], f32_bytes(&values(4, 640, 1.0)));
                assert!(flash_attn(g, q64, k, v, Some(m32), 0.125).is_none(), "an f32 mask");
                Ok(vec![q.flash_attn_ext(k, v, None, 0.125)])
            })
            .unwrap();
    }
}
