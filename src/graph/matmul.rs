//! Matrix products on the CPU as our own ggml op: the values of ggml's default `mul_mat`
//! as its AVX2 (`haswell`) CPU variant computes them, on every x86-64 CPU with AVX2, faster
//! (see `gemm`). ggml's own product picks its kernels by CPU (an AVX-512 machine sums in 16
//! lanes), so pictures would depend on the machine; these kernels do not.

use super::context::{GgmlType, Graph, F16, F32, T};
use super::gemm::{self, Dot, Elem, Imp, Operand, Problem};
use ggml_sys as g;
use std::ffi::{c_int, c_void};

/// What the op's user-data word says.
const IMP_AUTO: usize = 0;
const IMP_SCALAR: usize = 1;
const IMP_FAST: usize = 2;

fn elem(ty: GgmlType) -> Option<Elem> {
    match ty {
        F16 => Some(Elem::F16),
        F32 => Some(Elem::F32),
        g::GGML_TYPE_Q8_0 => Some(Elem::Q8_0),
        _ => None,
    }
}

/// The dot product ggml uses for weights of type `ty` (its `vec_dot_type` logic).
fn dot_for(ty: GgmlType) -> Option<Dot> {
    match ty {
        F16 => Some(Dot::F16),
        F32 => Some(Dot::F32),
        g::GGML_TYPE_Q8_0 => Some(Dot::Q8_0),
        _ => None,
    }
}

/// The problem of `mul_mat(a, b)` into `dst`, or None when these kernels do not reproduce it
/// (other types, transposed rows, shapes ggml would reject).
fn problem(a: &g::ggml_tensor, b: &g::ggml_tensor, out: Option<&g::ggml_tensor>) -> Option<Problem> {
    let dot = dot_for(a.type_)?;
    let (ea, eb) = (elem(a.type_)?, elem(b.type_)?);
    let [k, m, a2, a3] = a.ne;
    let [kb, n, b2, b3] = b.ne;
    if k != kb || k <= 0 || m <= 0 || n <= 0 || a2 <= 0 || a3 <= 0 || b2 % a2 != 0 || b3 % a3 != 0 {
        return None;
    }
    // SAFETY: pure lookups.
    let (tsa, tsb) = unsafe { (g::ggml_type_size(a.type_), g::ggml_type_size(b.type_)) };
    if a.nb[0] != tsa || b.nb[0] != tsb {
        return None;
    }
    let us = |v: i64| v as usize;
    let (out_ptr, out_nb) = match out {
        Some(d) => (d.data as *mut u8, [d.nb[1], d.nb[2], d.nb[3]]),
        None => (std::ptr::null_mut(), [0; 3]),
    };
    let p = Problem {
        dot,
        k: us(k),
        m: us(m),
        n: us(n),
        a: Operand { ptr: a.data as *const u8, ty: ea, nb: [a.nb[1], a.nb[2], a.nb[3]] },
        b: Operand { ptr: b.data as *const u8, ty: eb, nb: [b.nb[1], b.nb[2], b.nb[3]] },
        batch: [us(b2), us(b3)],
        bcast: [us(b2 / a2), us(b3 / a3)],
        out: out_ptr,
        out_nb,
    };
    p.supported().then_some(p)
}

/// `a.mul_mat(b)` (`[K, M, ..] × [K, N, ..] → [M, N, ..]`, f32) by our kernels when the graph
/// runs on a CPU with AVX2 and the types are ones they reproduce; otherwise ggml's `mul_mat`.
/// In diffusion networks and LLM text encoders on the fast path float products sum in their
/// own order (`gemm::fast`, or `gemm::amx` for f16 weights where the CPU has AMX), and the
/// diffusion networks' q8_0 products too where it has AMX-INT8 (`gemm::amx_q8`).
/// `prec_f32` asks other backends for f32 accumulation (the CPU always accumulates in f32).
pub(crate) fn mul_mat<'g>(g: &'g Graph, a: T<'g>, b: T<'g>, prec_f32: bool) -> T<'g> {
    // An evaluation callback (imatrix collection) looks for ggml's MUL_MAT nodes.
    if g.on_cpu && g.options.cpu_own_matmul && gemm::vector_kernels_available() && !super::eval_callback::is_set() && !few_columns(a, b) {
        let fast = g.options.cpu_fast_products && (g.options.cpu_fast_q8_0 || a.ty() != g::GGML_TYPE_Q8_0);
        let imp = if fast && gemm::fast_kernels_available() { IMP_FAST } else { IMP_AUTO };
        // The fast kernels read activations again for every block of weight rows: converted
        // to f16 once (by ggml, as its own product does), they are half the bytes and need
        // no rounding each time. The values are the ones the kernels would round to.
        let b = if imp == IMP_FAST && a.ty() == F16 && b.ty() == F32 { b.cast(F16) } else { b };
        if let Some(t) = flat(a, b, imp).or_else(|| custom(a, b, imp)) {
            return t;
        }
    }
    if prec_f32 {
        a.mul_mat_f32(b)
    } else {
        a.mul_mat(b)
    }
}

/// A weight matrix times one vector (a DiT's modulation, a timestep embedding): packing the
/// rows would cost more than the product, while ggml's own kernel reads each row once and
/// gives the same bits (one dot per output). Measured on HunyuanVideo's 2048-wide DiT step:
/// 0.079 s with our kernels, 0.062 s with ggml's for single columns, worse again from 8.
fn few_columns(a: T<'_>, b: T<'_>) -> bool {
    let [_, _, a2, a3] = a.ne();
    let [_, n, b2, b3] = b.ne();
    a2 == 1 && a3 == 1 && n * b2 * b3 == 1
}

/// A matrix without batch dims times a dense batched `b` as one product over all of b's
/// columns: the kernels then pack `a` once, not once per batch (Chroma's approximator runs
/// 5120×5120 weights on 344 batches of one column). Every output keeps its sum.
fn flat<'g>(a: T<'g>, b: T<'g>, imp: usize) -> Option<T<'g>> {
    let [_, m, a2, a3] = a.ne();
    let [k, n, b2, b3] = b.ne();
    if a2 != 1 || a3 != 1 || b2 * b3 == 1 || !b.is_contiguous() {
        return None;
    }
    custom(a, b.reshape(&[k, n * b2 * b3]), imp).map(|t| t.reshape(&[m, n, b2, b3]))
}

/// What the op's user-data word points at: the node's task queue and implementation.
#[repr(C)]
struct OpData {
    queue: gemm::TaskQueue,
    imp: usize,
}

/// The user-data word of a new node: its `OpData` in the graph's context (which lives as
/// long as the node), or the bare implementation number when the context has no room left
/// (the threads then take fixed shares).
fn op_data(ctx: *mut g::ggml_context, imp: usize) -> *mut c_void {
    match super::context::store_in_ctx(ctx, OpData { queue: gemm::TaskQueue::new(), imp }) {
        Some(d) => d as *mut c_void,
        None => imp as *mut c_void,
    }
}

/// The custom op node, or None when the kernels do not apply.
fn custom<'g>(a: T<'g>, b: T<'g>, imp: usize) -> Option<T<'g>> {
    // SAFETY: live tensors of this graph; only metadata is read.
    let ok = unsafe { problem(&*a.raw(), &*b.raw(), None).is_some() };
    if !ok || usize::BITS < 64 {
        return None;
    }
    let [_, m, _, _] = a.ne();
    let [_, n, b2, b3] = b.ne();
    let mut args = [a.raw(), b.raw()];
    let data = op_data(a.ctx(), imp);
    // SAFETY: a live context and sources; the callback reads the sources and writes only its
    // own output; the user-data word is a plain integer or points into the same context.
    let p = unsafe { g::ggml_custom_4d(a.ctx(), F32, m, n, b2, b3, args.as_mut_ptr(), 2, Some(compute), -1, data) };
    Some(a.wrap(p))
}

/// The op body: thread `ith` of `nth` computes output tasks until none is left.
pub(super) unsafe extern "C" fn compute(dst: *mut g::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `custom`: sources a, b and an f32
        // output of [M, N, ne12, ne13], all allocated; `problem` accepted these shapes. A
        // user-data word above the implementation numbers is that node's `OpData`, and
        // ggml runs a custom op with n_tasks -1 on all of its threads.
        unsafe {
            let d = &*dst;
            let Some(p) = problem(&*d.src[0], &*d.src[1], Some(d)) else { return };
            let (imp, queue) = match userdata as usize {
                word @ (IMP_AUTO | IMP_SCALAR | IMP_FAST) => (word, None),
                _ => {
                    let data = &*(userdata as *const OpData);
                    (data.imp, Some(&data.queue))
                }
            };
            let imp = match imp {
                IMP_SCALAR => Imp::Scalar,
                IMP_FAST => Imp::Fast,
                _ => Imp::Auto,
            };
            gemm::run(&p, ith.max(0) as usize, nth.max(1) as usize, imp, queue);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::backend::Backend;
    use crate::graph::runner::Runner;
    use std::sync::Arc;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            self.0 >> 33
        }
        fn f(&mut self) -> f32 {
            (self.next() as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        }
        fn u(&mut self, n: i64) -> i64 {
            (self.next() % n as u64) as i64
        }
    }

    /// Random bytes of a tensor of `ty` and shape `ne`, values in ±`scale`.
    fn data(r: &mut Rng, ty: GgmlType, ne: [i64; 4], scale: f32) -> Vec<u8> {
        let n = ne.iter().product::<i64>() as usize;
        match ty {
            F32 => (0..n).flat_map(|_| (r.f() * scale).to_le_bytes()).collect(),
            F16 => (0..n).flat_map(|_| gemm::scalar::f32_to_f16(r.f() * scale).to_le_bytes()).collect(),
            _ => {
                let mut v = Vec::with_capacity(n / 32 * 34);
                for _ in 0..n / 32 {
                    v.extend(gemm::scalar::f32_to_f16(r.f() * 0.02 * scale).to_le_bytes());
                    v.extend((0..32).map(|_| (r.u(255) - 127) as i8 as u8));
                }
                v
            }
        }
    }

    /// How a product sees an operand's data.
    #[derive(Clone, Copy, Debug)]
    enum Layout {
        Contiguous,
        /// Rows `pad` elements longer than k, viewed (a weight's or activation's sub-rows).
        RowsPadded(i64),
        /// Dims 1 and 2 stored swapped, then permuted back (attention's heads).
        Permuted,
    }

    impl Layout {
        /// The shape of the data behind a view of shape `ne`.
        fn stored(self, ne: [i64; 4]) -> [i64; 4] {
            match self {
                Layout::Contiguous => ne,
                Layout::RowsPadded(p) => [ne[0] + p, ne[1], ne[2], ne[3]],
                Layout::Permuted => [ne[0], ne[2], ne[1], ne[3]],
            }
        }

        fn view(self, t: T<'_>, ne: [i64; 4]) -> T<'_> {
            match self {
                Layout::Contiguous => t,
                Layout::RowsPadded(_) => {
                    let nb = t.nb();
                    t.view(&ne, &[nb[1], nb[2], nb[3]], 0)
                }
                Layout::Permuted => t.permute(0, 2, 1, 3),
            }
        }
    }

    /// One operand of a test product.
    #[derive(Clone, Copy, Debug)]
    struct Side {
        ty: GgmlType,
        ne: [i64; 4],
        layout: Layout,
    }

    fn side(ty: GgmlType, ne: [i64; 4]) -> Side {
        Side { ty, ne, layout: Layout::Contiguous }
    }

    /// Whether ggml's own `mul_mat` here sums like golden's (its AVX2 `haswell` variant). On
    /// other variants (AVX-512, x64, a native build) its sums differ from golden's, so the
    /// tests hold our kernels to their scalar reproduction of the AVX2 order only.
    fn ggml_sums_like_avx2() -> bool {
        let v = crate::graph::backend::cpu_variant();
        if v.as_deref() != Some("haswell") {
            eprintln!("note: ggml's CPU variant is {v:?}, not haswell: products compared with the scalar reproduction only");
        }
        v.as_deref() == Some("haswell")
    }

    /// Computes ggml's mul_mat, ours (vector kernels) and ours (scalar) on the CPU backend
    /// with `threads` threads and returns their bits.
    fn three_ways(a: Side, b: Side, seed: u64, scale: f32, threads: i32) -> [Vec<u32>; 3] {
        let mut r = Rng(seed);
        let (sa, sb) = (a.layout.stored(a.ne), b.layout.stored(b.ne));
        let (da, db) = (data(&mut r, a.ty, sa, scale), data(&mut r, b.ty, sb, 1.0));
        let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), threads);
        let outs = runner
            .compute_many(|g| {
                let ta = a.layout.view(g.input_bytes(a.ty, &sa, da.clone()), a.ne);
                let tb = b.layout.view(g.input_bytes(b.ty, &sb, db.clone()), b.ne);
                assert_eq!((ta.ne(), tb.ne()), (a.ne, b.ne));
                let ours = custom(ta, tb, IMP_AUTO).expect("supported");
                let scalar = custom(ta, tb, IMP_SCALAR).expect("supported");
                Ok(vec![ta.mul_mat(tb), ours, scalar])
            })
            .unwrap();
        let bits = |i: usize| outs[i].data().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        [bits(0), bits(1), bits(2)]
    }

    /// Our vector kernels equal their scalar reproduction, and ggml's AVX2 `mul_mat` where
    /// ggml runs that (`vs_ggml`), bit for bit.
    fn check(a: Side, b: Side, seed: u64, scale: f32, threads: i32, vs_ggml: bool) {
        let [ggml, ours, scalar] = three_ways(a, b, seed, scale, threads);
        let what = format!("a {a:?} b {b:?}, {threads} threads");
        let first_diff = |x: &[u32], y: &[u32]| x.iter().zip(y).position(|(p, q)| p != q);
        assert_eq!(first_diff(&scalar, &ours), None, "vector kernels differ from the scalar ones: {what}");
        if vs_ggml {
            assert_eq!(first_diff(&ggml, &ours), None, "our kernels differ from ggml: {what}");
        }
    }

    fn random_layout(r: &mut Rng, pad_unit: i64) -> Layout {
        match r.u(3) {
            0 => Layout::Contiguous,
            1 => Layout::RowsPadded(pad_unit * (1 + r.u(3))),
            _ => Layout::Permuted,
        }
    }

    const FLOAT_PAIRS: [(GgmlType, GgmlType); 4] = [(F16, F32), (F16, F16), (F32, F32), (F32, F16)];

    /// A batch-free matrix times a batched input is computed as one product (packed once):
    /// the same bits as per batch, and as ggml's.
    #[test]
    fn batched_columns_share_one_product() {
        let vs_ggml = ggml_sums_like_avx2();
        let mut r = Rng(5);
        for (ty, a_ne, b_ne) in [(F16, [96, 40, 1, 1], [96, 1, 7, 1]), (F32, [70, 33, 1, 1], [70, 3, 2, 2]), (F16, [64, 8, 1, 1], [64, 5, 1, 3])] {
            let (da, db) = (data(&mut r, ty, a_ne, 1.0), data(&mut r, F32, b_ne, 1.0));
            let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), 2);
            let outs = runner
                .compute_many(|g| {
                    let ta = g.input_bytes(ty, &a_ne, da.clone());
                    let tb = g.input_bytes(F32, &b_ne, db.clone());
                    let flat = mul_mat(g, ta, tb, false);
                    assert_eq!(flat.ne(), [a_ne[1], b_ne[1], b_ne[2], b_ne[3]]);
                    Ok(vec![flat, custom(ta, tb, IMP_AUTO).expect("supported"), ta.mul_mat(tb)])
                })
                .unwrap();
            let bits = |i: usize| outs[i].data().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(0), bits(1), "{a_ne:?} x {b_ne:?}: flattened and per-batch products differ");
            if vs_ggml {
                assert_eq!(bits(0), bits(2), "{a_ne:?} x {b_ne:?}: differs from ggml");
            }
        }
    }

    /// Several batches of several row blocks each: the columns a thread packed for one batch
    /// are not those of the next.
    #[test]
    fn batches_of_row_blocks_equal_ggml() {
        let vs_ggml = ggml_sums_like_avx2();
        for (i, (ta, tb)) in FLOAT_PAIRS.into_iter().enumerate() {
            check(side(ta, [200, 300, 2, 1]), side(tb, [200, 70, 2, 3]), 40 + i as u64, 1.0, 1 + (i % 2) as i32, vs_ggml);
        }
    }

    #[test]
    fn float_products_equal_ggml_bit_for_bit() {
        let vs_ggml = ggml_sums_like_avx2();
        let mut r = Rng(11);
        // Shapes of the networks (k a multiple of 32 or not, small and large k, one column),
        // then ones spanning several row blocks, column chunks and K chunks, with tails.
        let fixed: &[(i64, i64, i64)] = &[
            (320, 40, 77),
            (2880, 24, 50),
            (40, 70, 33),
            (80, 17, 9),
            (64, 9, 64),
            (4096, 40, 7),
            (36, 30, 5),
            (330, 5, 1),
            (1, 3, 2),
            (191, 130, 61),
            (2085, 150, 100),
            // Row blocks enough for a task each (4 threads, then 1), columns in chunks of 48.
            (64, 2100, 60),
            (300, 600, 100),
            // Packed column chunks kept across row blocks, a thread's cache full (k · 48 · 4
            // bytes a chunk: 8 MB hold 3 of 5 at k = 11000).
            (11000, 260, 230),
            // One column chunk, f16 weights read in place on AVX2: K tails and chunks, ragged
            // row tiles.
            (2085, 150, 17),
            (4100, 9, 48),
        ];
        for (i, &(k, m, n)) in fixed.iter().enumerate() {
            for (ta, tb) in FLOAT_PAIRS {
                check(side(ta, [k, m, 1, 1]), side(tb, [k, n, 1, 1]), i as u64, 1.0, 1 + (i % 4) as i32, vs_ggml);
            }
        }
        // Random shapes with broadcasting over dims 2 and 3, strided operands, thread counts.
        for case in 0..48 {
            let (ta, tb) = FLOAT_PAIRS[case % 4];
            let k = if case % 5 == 0 { 1 + r.u(5000) } else { 1 + r.u(300) };
            let (m, n) = (1 + r.u(80), 1 + r.u(80));
            let (a2, a3) = (1 + r.u(2), 1 + r.u(2));
            let (b2, b3) = (a2 * (1 + r.u(3)), a3 * (1 + r.u(2)));
            let a = Side { ty: ta, ne: [k, m, a2, a3], layout: random_layout(&mut r, 1) };
            let b = Side { ty: tb, ne: [k, n, b2, b3], layout: random_layout(&mut r, 1) };
            let scale = if case % 3 == 0 { 300.0 } else { 1.0 };
            check(a, b, 100 + case as u64, scale, 1 + r.u(4) as i32, vs_ggml);
        }
    }

    #[test]
    fn q8_0_products_equal_ggml_bit_for_bit() {
        let vs_ggml = ggml_sums_like_avx2();
        let mut r = Rng(5);
        // Several row blocks (k = 6400 gives 24-row blocks) and column pairs with tails.
        check(side(g::GGML_TYPE_Q8_0, [6400, 70, 1, 1]), side(F32, [6400, 13, 1, 1]), 7, 1.0, 3, vs_ggml);
        for case in 0..32 {
            let k = 32 * (1 + r.u(if case % 4 == 0 { 120 } else { 12 }));
            let (m, n) = (1 + r.u(60), 1 + r.u(60));
            let (a2, a3) = (1 + r.u(2), 1 + r.u(2));
            let (b2, b3) = (a2 * (1 + r.u(3)), a3 * (1 + r.u(2)));
            let a = Side { ty: g::GGML_TYPE_Q8_0, ne: [k, m, a2, a3], layout: random_layout(&mut r, 32) };
            let b = Side { ty: F32, ne: [k, n, b2, b3], layout: random_layout(&mut r, 1) };
            check(a, b, 200 + case as u64, 1.0, 1 + r.u(4) as i32, vs_ggml);
        }
    }

    #[test]
    fn unsupported_types_and_shapes_fall_back() {
        let mut runner = Runner::new(Arc::new(Backend::cpu().unwrap()), 1);
        runner
            .compute(|g| {
                // A type the kernels do not reproduce.
                let a = g.new_tensor(g::GGML_TYPE_Q4_K, &[256, 4]);
                let b = g.new_tensor(F32, &[256, 2]);
                assert!(custom(a, b, IMP_AUTO).is_none());
                // q8_0 weights with f16 activations (ggml converts only f32 to q8_0).
                let a = g.new_tensor(g::GGML_TYPE_Q8_0, &[64, 4]);
                let b = g.new_tensor(F16, &[64, 2]);
                assert!(custom(a, b, IMP_AUTO).is_none());
                // Transposed rows (elements not adjacent), on either side.
                let a = g.new_tensor(F16, &[64, 4]).permute(1, 0, 2, 3);
                let b = g.new_tensor(F32, &[4, 2]);
                assert!(custom(a, b, IMP_AUTO).is_none());
                let a = g.new_tensor(F32, &[4, 3]);
                let b = g.new_tensor(F32, &[2, 4]).permute(1, 0, 2, 3);
                assert!(custom(a, b, IMP_AUTO).is_none());
                // Batches that do not broadcast.
                let a = g.new_tensor(F32, &[8, 3, 2]);
                let b = g.new_tensor(F32, &[8, 3, 3]);
                assert!(custom(a, b, IMP_AUTO).is_none());
                Ok(g.input_f32(&[0.0], &[1]))
            })
            .unwrap();
    }

    /// Speed next to ggml's `mul_mat` on the shapes of the SD 1.x UNet and VAE at 512×512
    /// (`cargo test --release --lib bench_products -- --ignored --nocapture`, on a quiet
    /// machine). Each product runs alternately on both sides; the best of the runs counts.
    #[test]
    #[ignore]
    fn bench_products_vs_ggml() {
        let q8 = g::GGML_TYPE_Q8_0;
        // (what, a type, b type, a ne, b ne)
        type Product = (&'static str, GgmlType, GgmlType, [i64; 4], [i64; 4]);
        let shapes: &[Product] = &[
            ("Wan linear 1536->8960, 1280 tok", F16, F32, [1536, 8960, 1, 1], [1536, 1280, 1, 1]),
            ("Wan linear 8960->1536, 1280 tok", F16, F32, [8960, 1536, 1, 1], [8960, 1280, 1, 1]),
            ("DiT linear 2048->8192, 200 tok", F16, F32, [2048, 8192, 1, 1], [2048, 200, 1, 1]),
            ("DiT linear 4608->12288, 1034 tok", F16, F32, [4608, 12288, 1, 1], [4608, 1034, 1, 1]),
            ("DiT linear 12288->4608, 1034 tok", F16, F32, [12288, 4608, 1, 1], [12288, 1034, 1, 1]),
            ("conv 3x3 320, 64x64", F16, F16, [2880, 4096, 1, 1], [2880, 320, 1, 1]),
            ("conv 3x3 640, 32x32", F16, F16, [5760, 1024, 1, 1], [5760, 640, 1, 1]),
            ("conv 3x3 1280, 16x16", F16, F16, [11520, 256, 1, 1], [11520, 1280, 1, 1]),
            ("conv 3x3 128, VAE band", F16, F16, [1152, 16384, 1, 1], [1152, 128, 1, 1]),
            ("linear 320->2560, 4096 tok", F16, F32, [320, 2560, 1, 1], [320, 4096, 1, 1]),
            ("linear 1280->320, 4096 tok", F16, F32, [1280, 320, 1, 1], [1280, 4096, 1, 1]),
            ("attn q.k d40, 8 heads", F32, F32, [40, 4096, 8, 1], [40, 512, 8, 1]),
            ("attn v.s d40, 8 heads", F32, F32, [4096, 40, 8, 1], [4096, 512, 8, 1]),
            ("attn q.k d64, 10 heads", F32, F32, [64, 1024, 10, 1], [64, 1024, 10, 1]),
            ("q8_0 linear 320->2560", q8, F32, [320, 2560, 1, 1], [320, 4096, 1, 1]),
            ("q8_0 linear 1280->320", q8, F32, [1280, 320, 1, 1], [1280, 4096, 1, 1]),
        ];
        let threads: i32 = std::env::var("SD_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
        let backend = Arc::new(Backend::cpu().unwrap());
        println!("| product | ggml ms | ours ms | ggml GFLOP/s | ours GFLOP/s | ggml / ours |");
        println!("|---|---:|---:|---:|---:|---:|");
        let only = std::env::var("SD_BENCH_ONLY").unwrap_or_default();
        for &(what, ta, tb, ne_a, ne_b) in shapes.iter().filter(|s| s.0.contains(only.as_str())) {
            let mut r = Rng(1);
            let (da, db) = (data(&mut r, ta, ne_a, 1.0), data(&mut r, tb, ne_b, 1.0));
            let mut best = [f64::MAX; 2];
            for _ in 0..3 {
                for (side, own) in [false, true].into_iter().enumerate() {
                    let mut runner = Runner::new(backend.clone(), threads);
                    runner.options.cpu_own_matmul = own;
                    let run = |runner: &mut Runner| {
                        runner
                            .compute(|g| {
                                let a = g.input_bytes(ta, &ne_a, da.clone());
                                let b = g.input_bytes(tb, &ne_b, db.clone());
                                Ok(mul_mat(g, a, b, false))
                            })
                            .unwrap()
                    };
                    run(&mut runner); // allocation, first touch
                    let t = std::time::Instant::now();
                    run(&mut runner);
                    best[side] = best[side].min(t.elapsed().as_secs_f64());
                }
            }
            let flop = 2.0 * (ne_a[0] * ne_a[1] * ne_b[1] * ne_b[2] * ne_b[3]) as f64;
            println!(
                "| {what} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}× |",
                best[0] * 1e3,
                best[1] * 1e3,
                flop / best[0] / 1e9,
                flop / best[1] / 1e9,
                best[0] / best[1]
            );
        }
    }
}


