//! Matrix products on the CPU that give bit for bit what ggml's default `mul_mat` gives on
//! an AVX2 machine (ggml's `haswell` CPU variant), whatever this CPU is, but faster: ggml
//! computes each output with one `vec_dot` call, which reloads both rows for every output;
//! these kernels keep each output's summation (the lanes, their order, the reduction) and
//! share loaded values across a register tile of outputs (see `x86`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx_q8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod fast;
pub(crate) mod scalar;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Element type of an operand's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    F16,
    F32,
    Q8_0,
}

/// Which ggml dot product every output reproduces (`ggml_vec_dot_f16`, `_f32`, `_q8_0_q8_0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dot {
    F16,
    F32,
    Q8_0,
}

/// Rows of `k` elements: row i of batch (i2, i3) at `ptr + i·nb[0] + i2·nb[1] + i3·nb[2]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    pub ptr: *const u8,
    pub ty: Elem,
    pub nb: [usize; 3],
}

/// `out[n][m] = dot(a row m, b row n)` for every batch, with ggml's `mul_mat` conventions:
/// `a` is src0 (`m` rows per batch, broadcast over `bcast`), `b` is src1 (`n` rows), the
/// output f32 with m contiguous. `b` is converted as ggml converts src1 for the dot: f32 →
/// f16 for `Dot::F16`, f32 → q8_0 for `Dot::Q8_0`, f16 → f32 for `Dot::F32`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub dot: Dot,
    pub k: usize,
    pub m: usize,
    pub n: usize,
    pub a: Operand,
    pub b: Operand,
    /// Output batches (ggml's ne2, ne3).
    pub batch: [usize; 2],
    /// How many output batches share one `a` matrix, per dimension (ggml's r2, r3).
    pub bcast: [usize; 2],
    pub out: *mut u8,
    pub out_nb: [usize; 3],
}

// SAFETY: a Problem only describes memory the caller keeps alive and that threads access
// disjointly (each output element has one owner).
unsafe impl Send for Problem {}
unsafe impl Sync for Problem {}

/// A block of outputs: rows m0..m1 × columns n0..n1 of one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Task {
    pub batch: usize,
    pub m0: usize,
    pub m1: usize,
    pub n0: usize,
    pub n1: usize,
}

impl Problem {
    /// Whether the combination is one these kernels reproduce.
    pub(crate) fn supported(&self) -> bool {
        let types_ok = match self.dot {
            Dot::F16 => self.a.ty == Elem::F16 && matches!(self.b.ty, Elem::F16 | Elem::F32),
            Dot::F32 => self.a.ty == Elem::F32 && matches!(self.b.ty, Elem::F16 | Elem::F32),
            Dot::Q8_0 => self.a.ty == Elem::Q8_0 && self.b.ty == Elem::F32 && self.k.is_multiple_of(32),
        };
        types_ok && self.k > 0 && self.bcast[0] > 0 && self.bcast[1] > 0
    }

    /// Rows of `a` and `b` and the output of batch index `bi` (i2 + i3·batch[0]).
    pub(crate) fn batch_ptrs(&self, bi: usize) -> (*const u8, *const u8, *mut u8) {
        let (i2, i3) = (bi % self.batch[0], bi / self.batch[0]);
        let a = self.a.ptr.wrapping_add((i2 / self.bcast[0]) * self.a.nb[1] + (i3 / self.bcast[1]) * self.a.nb[2]);
        let b = self.b.ptr.wrapping_add(i2 * self.b.nb[1] + i3 * self.b.nb[2]);
        let o = self.out.wrapping_add(i2 * self.out_nb[1] + i3 * self.out_nb[2]);
        (a, b, o)
    }

    /// Rows of `a` per task: a multiple of `align`.
    fn rows_per_block(&self, align: usize) -> usize {
        match self.dot {
            Dot::Q8_0 => (((192 << 10) / (self.k / 32 * 36).max(1)).clamp(4, 128) / 4 * 4).next_multiple_of(align),
            _ => 128,
        }
    }

    /// The task grid: (row block size, column chunk size, row blocks, column chunks, count),
    /// row blocks a multiple of `align` rows.
    fn grid(&self, nth: usize, align: usize) -> (usize, usize, usize, usize, usize) {
        let mc = self.rows_per_block(align);
        let batches = self.batch[0] * self.batch[1];
        let mblocks = self.m.div_ceil(mc);
        // With row blocks enough for every thread, a task is a whole row block (its columns
        // are computed 48 at a time by the one thread that packed the block); else column
        // chunks of at most 48, narrower when that leaves a thread without tasks.
        let nc = if batches * mblocks >= 4 * nth {
            self.n.max(1)
        } else {
            let want = (4 * nth).div_ceil((batches * mblocks).max(1)).max(1);
            (self.n.div_ceil(want).div_ceil(6).max(1) * 6).min(48)
        };
        let nchunks = self.n.div_ceil(nc);
        (mc, nc, mblocks, nchunks, batches * mblocks * nchunks)
    }

    /// Task `i` of the grid: batch-major, then row block, then column chunk, so that a
    /// thread's consecutive tasks share their rows of `a`.
    fn task(&self, grid: (usize, usize, usize, usize, usize), i: usize) -> Task {
        let (mc, nc, mblocks, nchunks, _) = grid;
        let (batch, rest) = (i / (mblocks * nchunks), i % (mblocks * nchunks));
        let (m0, n0) = (rest / nchunks * mc, rest % nchunks * nc);
        Task { batch, m0, m1: (m0 + mc).min(self.m), n0, n1: (n0 + nc).min(self.n) }
    }
}

/// Bytes of quantized activations a thread keeps per q8_0 product (`x86`'s column pairs,
/// `amx_q8`'s token tiles): quantizing them again for every block of rows cost as much as
/// the products (k = 3840, 44-row blocks). Small in unit tests, so that their products also
/// quantize past it; `kernel_throughput` sets the real size.
pub(crate) static Q8_CACHE_BYTES: AtomicUsize = AtomicUsize::new(if cfg!(test) { 64 << 10 } else { 16 << 20 });

/// Which panels of a q8_0 product's quantized activations a thread has made and keeps for
/// its later row blocks (panel i = columns `i · width` onwards, while `Q8_CACHE_BYTES`
/// last), for one batch of one product; the kernels own the panels' bytes.
#[derive(Default)]
pub(crate) struct QuantizedPanels {
    done: Vec<bool>,
    batch: Option<usize>,
}

impl QuantizedPanels {
    /// A new product: nothing kept.
    pub(crate) fn forget(&mut self) {
        self.batch = None;
    }

    /// How many panels of `bytes` each are kept for `batch` (at most `panels`); a new batch
    /// starts with none made.
    pub(crate) fn room(&mut self, batch: usize, bytes: usize, panels: usize) -> usize {
        if self.batch != Some(batch) {
            let room = (Q8_CACHE_BYTES.load(Ordering::Relaxed) / bytes.max(1)).min(panels);
            self.done.clear();
            self.done.resize(room, false);
            self.batch = Some(batch);
        }
        self.done.len()
    }

    /// The slot of the panel of `width` columns starting at column `n0`, if it has one (a
    /// start off a multiple of `width` has none), and whether it is made.
    pub(crate) fn slot(&self, n0: usize, width: usize) -> (Option<usize>, bool) {
        let slot = (n0 % width == 0).then_some(n0 / width).filter(|&i| i < self.done.len());
        (slot, slot.is_some_and(|i| self.done[i]))
    }

    /// Panel `slot` (if any) is made.
    pub(crate) fn made(&mut self, slot: Option<usize>) {
        if let Some(i) = slot {
            self.done[i] = true;
        }
    }
}

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Imp {
    /// AVX2 when the CPU has it, else scalar.
    Auto,
    Scalar,
    /// The fast path's kernels (each output summed in order, not ggml's order): `amx` for
    /// f16 weights on a CPU with AMX-BF16, `amx_q8` for q8_0 weights on a CPU with
    /// AMX-INT8, `fast` for float dots on a CPU with AVX2 (not AVX-512VL); otherwise `Auto`.
    Fast,
}

thread_local! {
    #[cfg(target_arch = "x86_64")]
    static SCRATCH: RefCell<x86::Scratch> = RefCell::new(x86::Scratch::default());
    #[cfg(target_arch = "x86_64")]
    static FAST_SCRATCH: RefCell<fast::Scratch> = RefCell::new(fast::Scratch::default());
    #[cfg(target_arch = "x86_64")]
    static AMX_SCRATCH: RefCell<amx::Scratch> = RefCell::new(amx::Scratch::default());
    #[cfg(target_arch = "x86_64")]
    static AMX_Q8_SCRATCH: RefCell<amx_q8::Scratch> = RefCell::new(amx_q8::Scratch::default());
}

/// Whether the vector kernels run on this CPU (x86-64 with AVX2, FMA and F16C). Elsewhere
/// the scalar reproduction would be far slower than ggml's own kernels, so callers keep
/// ggml's `mul_mat` there; the scalar code is the tests' specification of the order.
pub(crate) fn vector_kernels_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the fast path's product kernels (`fast`, `amx` or `amx_q8`) run on this CPU;
/// elsewhere the fast path keeps the exact ones.
pub(crate) fn fast_kernels_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        fast::available() || amx::available() || amx_q8::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A growable buffer of 64-byte cache lines for packed operands: a vector load that straddles
/// two lines costs about twice one inside a line, and `Vec<f32>` gives 16-byte alignment
/// (the exact products' panels ran 15 % slower so, on an AVX-512 Xeon).
#[derive(Default)]
pub(crate) struct Lines(Vec<Line>);

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

impl Lines {
    /// At least `n` values of `T`, 64-byte aligned: contents kept, zeros where it grows (a
    /// grown buffer may move, so pointers from an earlier call are stale).
    pub(crate) fn at_least<T: Copy>(&mut self, n: usize) -> *mut T {
        let lines = (n * std::mem::size_of::<T>()).div_ceil(64);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0; 64]));
        }
        self.0.as_mut_ptr() as *mut T
    }
}

/// A product's tasks handed out to its threads as they ask for them: with a fixed share
/// each, a thread the OS delays (two vCPUs shared with anything else) leaves the others
/// spinning at ggml's barrier after every product. Lives in the graph's context, one per
/// node; ggml runs every node on all `nth` threads (or, when a compute is aborted, on
/// none), so the last thread to find the queue empty rewinds it for the next compute.
#[repr(C)]
pub(crate) struct TaskQueue {
    next: AtomicUsize,
    finished: AtomicUsize,
}

impl TaskQueue {
    pub(crate) const fn new() -> TaskQueue {
        TaskQueue { next: AtomicUsize::new(0), finished: AtomicUsize::new(0) }
    }

    /// The next task's index (past the end once all are taken).
    pub(crate) fn claim(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// What a thread holds while it claims tasks of one compute of `nth` threads.
    pub(crate) fn finish_guard(&self, nth: usize) -> Finish<'_> {
        Finish { queue: self, nth: nth.max(1) }
    }
}

/// Marks a thread done with a queue, also when its task panicked.
pub(crate) struct Finish<'q> {
    queue: &'q TaskQueue,
    nth: usize,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        if self.queue.finished.fetch_add(1, Ordering::AcqRel) + 1 == self.nth {
            self.queue.next.store(0, Ordering::Relaxed);
            self.queue.finished.store(0, Ordering::Release);
        }
    }
}

/// Thread `ith` of `nth` computes tasks: from `queue` until none is left, or without one
/// its fixed share (a contiguous run).
///
/// # Safety
/// `p` must describe live memory: `a`, `b` readable over every row and batch it names, the
/// output writable, and no other thread may write the outputs of this thread's tasks. With
/// a queue, all `nth` threads must call this for the same compute.
pub(crate) unsafe fn run(p: &Problem, ith: usize, nth: usize, imp: Imp, queue: Option<&TaskQueue>) {
    let nth = nth.max(1);
    #[cfg(target_arch = "x86_64")]
    let tiles_q8 = imp == Imp::Fast && amx_q8::available() && amx_q8::supports(p);
    #[cfg(not(target_arch = "x86_64"))]
    let tiles_q8 = false;
    // The q8_0 tile kernel computes 16 weight rows at once.
    let grid = p.grid(nth, if tiles_q8 { 16 } else { 1 });
    let count = grid.4;
    let _finish = queue.map(|queue| queue.finish_guard(nth));
    let mut fixed = count * ith / nth..count * (ith + 1) / nth;
    let mine = std::iter::from_fn(move || {
        let i = match queue {
            Some(q) => q.claim(),
            None => fixed.next()?,
        };
        (i < count).then(|| p.task(grid, i))
    });
    #[cfg(target_arch = "x86_64")]
    {
        if imp == Imp::Fast && amx::available() && amx::supports(p) {
            // SAFETY: features checked; memory per this function's contract.
            AMX_SCRATCH.with(|s| unsafe { amx::run(p, mine, &mut s.borrow_mut()) });
            return;
        }
        if tiles_q8 {
            // SAFETY: features checked; memory per this function's contract.
            AMX_Q8_SCRATCH.with(|s| unsafe { amx_q8::run(p, mine, &mut s.borrow_mut()) });
            return;
        }
        if imp == Imp::Fast && fast::available() && fast::supports(p) {
            // SAFETY: features checked; memory per this function's contract.
            FAST_SCRATCH.with(|s| unsafe { fast::run(p, mine, &mut s.borrow_mut()) });
            return;
        }
        if imp != Imp::Scalar && x86::available() {
            // SAFETY: features checked; memory per this function's contract.
            SCRATCH.with(|s| unsafe { x86::run(p, mine, &mut s.borrow_mut()) });
            return;
        }
    }
    for t in mine {
        // SAFETY: per this function's contract.
        unsafe { scalar_task(p, &t) };
    }
}

/// One task by the portable reproductions, one output at a time.
unsafe fn scalar_task(p: &Problem, t: &Task) {
    let (arow, brow, out) = p.batch_ptrs(t.batch);
    let k = p.k;
    // SAFETY (whole block): rows and outputs are inside the memory `p` describes.
    unsafe {
        let read_f32 = |row: *const u8| -> Vec<f32> { (0..k).map(|i| (row.add(4 * i) as *const f32).read_unaligned()).collect() };
        let read_f16 = |row: *const u8| -> Vec<u16> { (0..k).map(|i| (row.add(2 * i) as *const u16).read_unaligned()).collect() };
        for n in t.n0..t.n1 {
            let bsrc = brow.add(n * p.b.nb[0]);
            let dst = out.add(n * p.out_nb[0]) as *mut f32;
            match p.dot {
                Dot::F16 => {
                    let b: Vec<u16> = match p.b.ty {
                        Elem::F32 => read_f32(bsrc).into_iter().map(scalar::f32_to_f16).collect(),
                        _ => read_f16(bsrc),
                    };
                    for m in t.m0..t.m1 {
                        *dst.add(m) = scalar::dot_f16(&read_f16(arow.add(m * p.a.nb[0])), &b);
                    }
                }
                Dot::F32 => {
                    let b: Vec<f32> = match p.b.ty {
                        Elem::F16 => read_f16(bsrc).into_iter().map(scalar::f16_to_f32).collect(),
                        _ => read_f32(bsrc),
                    };
                    for m in t.m0..t.m1 {
                        *dst.add(m) = scalar::dot_f32(&read_f32(arow.add(m * p.a.nb[0])), &b);
                    }
                }
                Dot::Q8_0 => {
                    let x = read_f32(bsrc);
                    let nb = k / 32;
                    let mut b = vec![0u8; nb * scalar::Q8_0_BYTES];
                    for (blk, o) in x.chunks_exact(32).zip(b.chunks_exact_mut(scalar::Q8_0_BYTES)) {
                        scalar::quantize_q8_0_block(blk, o);
                    }
                    for m in t.m0..t.m1 {
                        let a = std::slice::from_raw_parts(arow.add(m * p.a.nb[0]), nb * scalar::Q8_0_BYTES);
                        *dst.add(m) = scalar::dot_q8_0(a, &b);
                    }
                }
            }
        }
    }
}

/// What the fast kernels' unit tests share.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) mod testing {
    use super::{run, scalar, Dot, Elem, Imp, Operand, Problem, TaskQueue};

    /// Deterministic values in [-1, 1).
    pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `v` stored as `e` (f16 or f32).
    pub(crate) fn bytes(v: &[f32], e: Elem) -> Vec<u8> {
        match e {
            Elem::F16 => v.iter().flat_map(|&x| scalar::f32_to_f16(x).to_le_bytes()).collect(),
            _ => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        }
    }

    /// Runs the fast kernels on a `dot` product of `m` rows of `a` (one matrix, broadcast)
    /// and two batches of `n` rows of `b`, rows of `k` values stored as given: every output
    /// [bi][j][i] must be within `roundings · 2⁻²⁴ · Σ|terms|` of the f64 sum of
    /// `term(bi, j, i, x)` over x < k, and 2 and 3 threads must give one thread's bits.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_fast_sums(
        what: &str,
        dot: Dot,
        (ea, a): (Elem, &[u8]),
        (eb, b): (Elem, &[u8]),
        (k, m, n): (usize, usize, usize),
        roundings: usize,
        term: impl Fn(usize, usize, usize, usize) -> f64,
    ) {
        let row = |e: Elem| match e {
            Elem::F16 => 2 * k,
            Elem::F32 => 4 * k,
            Elem::Q8_0 => k / 32 * scalar::Q8_0_BYTES,
        };
        let (ra, rb) = (row(ea), row(eb));
        let problem = |out: &mut Vec<f32>| Problem {
            dot,
            k,
            m,
            n,
            a: Operand { ptr: a.as_ptr(), ty: ea, nb: [ra, ra * m, ra * m] },
            b: Operand { ptr: b.as_ptr(), ty: eb, nb: [rb, rb * n, rb * n * 2] },
            batch: [2, 1],
            bcast: [2, 1],
            out: out.as_mut_ptr() as *mut u8,
            out_nb: [4 * m, 4 * m * n, 4 * m * n * 2],
        };
        let mut one = vec![f32::NAN; m * n * 2];
        // SAFETY: the buffers outlive the call; one thread.
        unsafe { run(&problem(&mut one), 0, 1, Imp::Fast, None) };
        for bi in 0..2 {
            for j in 0..n {
                for i in 0..m {
                    let (sum, abs) = (0..k).map(|x| term(bi, j, i, x)).fold((0f64, 0f64), |(s, t), v| (s + v, t + v.abs()));
                    let got = one[bi * m * n + j * m + i] as f64;
                    let bound = roundings as f64 * 2f64.powi(-24) * abs * 1.01 + 1e-30;
                    assert!((got - sum).abs() <= bound, "{what} k{k} m{m} n{n}: out[{bi}][{j}][{i}] = {got}, exact sum {sum} (bound {bound})");
                }
            }
        }
        let queue = TaskQueue::new();
        for nth in [2, 3] {
            let mut got = vec![f32::NAN; m * n * 2];
            let p = problem(&mut got);
            std::thread::scope(|s| {
                for ith in 0..nth {
                    let (p, queue) = (&p, &queue);
                    // SAFETY: buffers outlive the scope; the queue gives each task to one thread.
                    s.spawn(move || unsafe { run(p, ith, nth, Imp::Fast, Some(queue)) });
                }
            });
            assert!(got.iter().zip(&one).all(|(x, y)| x.to_bits() == y.to_bits()), "{what} k{k} m{m} n{n}: {nth} threads changed the bits");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers start on a cache line, whatever the element type, and keep their contents
    /// when they grow.
    #[test]
    fn lines_are_aligned_and_keep_contents() {
        let mut lines = Lines::default();
        let p = lines.at_least::<f32>(5);
        assert_eq!(p as usize % 64, 0);
        // SAFETY: 5 f32 were asked for.
        unsafe { (0..5).for_each(|i| *p.add(i) = i as f32 + 0.5) };
        let q = lines.at_least::<f32>(100_000);
        assert_eq!(q as usize % 64, 0);
        // SAFETY: 100000 f32, zeros past what was written.
        let kept: Vec<f32> = unsafe { (0..7).map(|i| *q.add(i)).collect() };
        assert_eq!(kept, [0.5, 1.5, 2.5, 3.5, 4.5, 0.0, 0.0]);
        assert_eq!(lines.at_least::<u16>(3) as usize % 64, 0);
    }

    /// A queue shared by real threads computes every output once, compute after compute
    /// (the last thread rewinds it), and gives what fixed shares give.
    #[test]
    fn task_queue_covers_every_task_and_rewinds() {
        let (k, m, n) = (64, 70, 130);
        let a: Vec<f32> = (0..k * m).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5).collect();
        let problem = |out: &mut Vec<f32>| Problem {
            dot: Dot::F32,
            k,
            m,
            n,
            a: Operand { ptr: a.as_ptr() as *const u8, ty: Elem::F32, nb: [4 * k, 4 * k * m, 4 * k * m] },
            b: Operand { ptr: b.as_ptr() as *const u8, ty: Elem::F32, nb: [4 * k, 4 * k * n, 4 * k * n] },
            batch: [1, 1],
            bcast: [1, 1],
            out: out.as_mut_ptr() as *mut u8,
            out_nb: [4 * m, 4 * m * n, 4 * m * n],
        };
        let mut want = vec![0f32; m * n];
        let p = problem(&mut want);
        // SAFETY: the problem's buffers outlive the call; one thread.
        unsafe { run(&p, 0, 1, Imp::Auto, None) };
        let queue = TaskQueue::new();
        for nth in [3, 2, 3] {
            let mut got = vec![f32::NAN; m * n];
            let p = problem(&mut got);
            std::thread::scope(|s| {
                for ith in 0..nth {
                    let (p, queue) = (&p, &queue);
                    // SAFETY: buffers outlive the scope; the queue gives each task to one thread.
                    s.spawn(move || unsafe { run(p, ith, nth, Imp::Auto, Some(queue)) });
                }
            });
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            assert_eq!(queue.next.load(Ordering::Relaxed), 0);
        }
    }

    fn thread_cpu_s() -> f64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: a valid timespec to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    /// One thread's f32 FMA rate with independent chains in 16-lane registers, or 8-lane
    /// ones without AVX-512 (what no product can beat on this CPU).
    fn fma_peak() -> f64 {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chains8(reps: usize) -> f32 {
            use std::arch::x86_64::*;
            let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            let mut acc = [_mm256_set1_ps(1.0); 12];
            for _ in 0..reps {
                for v in acc.iter_mut() {
                    *v = _mm256_fmadd_ps(*v, m, c);
                }
            }
            let mut out = [0f32; 8];
            acc.iter().map(|v| {
                _mm256_storeu_ps(out.as_mut_ptr(), *v);
                out[0]
            }).sum()
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn chains(reps: usize) -> f32 {
            use std::arch::x86_64::*;
            let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            let mut acc = [_mm512_set1_ps(1.0); 12];
            for _ in 0..reps {
                for v in acc.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, m, c);
                }
            }
            acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        // GFLOP per CPU second of 12 chains of `lanes`-lane FMAs, `reps` rounds.
        #[cfg(target_arch = "x86_64")]
        let rate = |lanes: f64, reps: usize, chains: unsafe fn(usize) -> f32| {
            let t = thread_cpu_s();
            // SAFETY: called only after the chains' features were checked.
            std::hint::black_box(unsafe { chains(reps) });
            2.0 * lanes * 12.0 * reps as f64 / (thread_cpu_s() - t) / 1e9
        };
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") {
            return rate(16.0, 50_000_000, chains);
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return rate(8.0, 100_000_000, chains8);
        }
        0.0
    }

    /// One thread's GFLOP per CPU second on SD 1.x product shapes (kernels only; the CPU
    /// time, so other load on the machine does not count):
    /// `cargo test --release --lib kernel_throughput -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn kernel_throughput() {
        // (what, dot, a elem, b elem, k, m, n)
        let shapes = [
            ("conv 3x3 320, 64x64", Dot::F16, Elem::F16, Elem::F16, 2880, 4096, 320),
            ("conv 3x3 1280, 16x16", Dot::F16, Elem::F16, Elem::F16, 11520, 256, 1280),
            ("linear 320->2560", Dot::F16, Elem::F16, Elem::F32, 320, 2560, 1024),
            ("attn v.s d40", Dot::F32, Elem::F32, Elem::F32, 4096, 40, 1024),
            ("attn q.k d40", Dot::F32, Elem::F32, Elem::F32, 40, 4096, 512),
            ("q8_0 linear 320->2560", Dot::Q8_0, Elem::Q8_0, Elem::F32, 320, 2560, 1024),
            ("q8_0 z-image ffn 3840->10240, 1056 tokens", Dot::Q8_0, Elem::Q8_0, Elem::F32, 3840, 10240, 1056),
            ("sdxl ffn 1280->10240, 256 tokens", Dot::F16, Elem::F16, Elem::F32, 1280, 10240, 256),
            ("wan linear 1536->1536, 1280 tokens", Dot::F16, Elem::F16, Elem::F32, 1536, 1536, 1280),
            ("wan ffn 1536->8960", Dot::F16, Elem::F16, Elem::F32, 1536, 8960, 1280),
            ("wan ffn 8960->1536", Dot::F16, Elem::F16, Elem::F32, 8960, 1536, 1280),
            ("dit linear 4096->4096, 77 tokens", Dot::F16, Elem::F16, Elem::F32, 4096, 4096, 77),
            ("dit ffn 4096->12288, 77 tokens", Dot::F16, Elem::F16, Elem::F32, 4096, 12288, 77),
            ("dit ffn 12288->4096, 77 tokens", Dot::F16, Elem::F16, Elem::F32, 12288, 4096, 77),
            ("hunyuan refiner mlp 2048->8192, 17 tokens", Dot::F16, Elem::F16, Elem::F32, 2048, 8192, 17),
            ("hunyuan refiner mlp 8192->2048, 17 tokens", Dot::F16, Elem::F16, Elem::F32, 8192, 2048, 17),
            ("hunyuan linear 2048->2048, 48 tokens", Dot::F16, Elem::F16, Elem::F32, 2048, 2048, 48),
            ("hunyuan linear 2048->2048, 24 tokens", Dot::F16, Elem::F16, Elem::F32, 2048, 2048, 24),
            ("hunyuan linear 2048->2048, 32 tokens", Dot::F16, Elem::F16, Elem::F32, 2048, 2048, 32),
        ];
        Q8_CACHE_BYTES.store(16 << 20, Ordering::Relaxed);
        println!("this CPU's f32 FMA peak: {:.1} GFLOP per CPU s", fma_peak());
        // `SD_KERNEL_FAST=1`: the fast path's kernels.
        let imp = if std::env::var("SD_KERNEL_FAST").is_ok_and(|v| v == "1") { Imp::Fast } else { Imp::Auto };
        // `SD_KERNEL_SHAPES=wan` keeps the shapes whose name contains it.
        let only = std::env::var("SD_KERNEL_SHAPES").unwrap_or_default();
        for (what, dot, ea, eb, k, m, n) in shapes.into_iter().filter(|s| s.0.contains(only.as_str())) {
            // The fast path's graph gives f16 weights their activations as f16 (`matmul`).
            let eb = if imp == Imp::Fast && dot == Dot::F16 { Elem::F16 } else { eb };
            let bytes = |e: Elem, rows: usize| match e {
                Elem::F16 => (0..rows * k).flat_map(|i| scalar::f32_to_f16(((i * 7 % 13) as f32 - 6.0) * 0.01).to_le_bytes()).collect::<Vec<u8>>(),
                Elem::F32 => (0..rows * k).flat_map(|i| (((i * 5 % 11) as f32 - 5.0) * 0.01).to_le_bytes()).collect(),
                Elem::Q8_0 => (0..rows * k / 32).flat_map(|i| {
                    let mut blk = vec![0u8; scalar::Q8_0_BYTES];
                    blk[..2].copy_from_slice(&scalar::f32_to_f16(0.01).to_le_bytes());
                    for (j, q) in blk[2..].iter_mut().enumerate() {
                        *q = ((i + j) % 200) as u8;
                    }
                    blk
                }).collect(),
            };
            let (a, b) = (bytes(ea, m), bytes(eb, n));
            let mut out = vec![0f32; m * n];
            let row = |e: Elem| match e {
                Elem::F16 => 2 * k,
                Elem::F32 => 4 * k,
                Elem::Q8_0 => k / 32 * scalar::Q8_0_BYTES,
            };
            let p = Problem {
                dot,
                k,
                m,
                n,
                a: Operand { ptr: a.as_ptr(), ty: ea, nb: [row(ea), row(ea) * m, row(ea) * m] },
                b: Operand { ptr: b.as_ptr(), ty: eb, nb: [row(eb), row(eb) * n, row(eb) * n] },
                batch: [1, 1],
                bcast: [1, 1],
                out: out.as_mut_ptr() as *mut u8,
                out_nb: [4 * m, 4 * m * n, 4 * m * n],
            };
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = thread_cpu_s();
                // SAFETY: buffers outlive the call; one thread.
                unsafe { run(&p, 0, 1, imp, None) };
                best = best.min(thread_cpu_s() - t);
            }
            println!("{what}: {:.1} GFLOP per CPU s", 2.0 * (k * m * n) as f64 / best / 1e9);
            // `SD_KERNEL_THREADS=N`: also N threads sharing a task queue, per wall second.
            let nth: usize = std::env::var("SD_KERNEL_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            if nth > 1 {
                let queue = TaskQueue::new();
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = std::time::Instant::now();
                    std::thread::scope(|s| {
                        for ith in 0..nth {
                            let (p, queue) = (&p, &queue);
                            // SAFETY: buffers outlive the scope; the queue gives each task to one thread.
                            s.spawn(move || unsafe { run(p, ith, nth, imp, Some(queue)) });
                        }
                    });
                    best = best.min(t.elapsed().as_secs_f64());
                }
                println!("  {nth} threads: {:.1} GFLOP per wall s", 2.0 * (k * m * n) as f64 / best / 1e9);
            }
        }
    }
}
