//! Matrix products on the CPU that give bit for bit what ggml's default `mul_mat` gives on
//! an AVX2 machine (ggml's `haswell` CPU variant), whatever this CPU is, but faster: ggml
//! computes each output with one `vec_dot` call, which reloads both rows for every output;
//! these kernels keep each output's summation (the lanes, their order, the reduction) and
//! share loaded values across a register tile of outputs (see `x86`).

pub(crate) mod scalar;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use std::cell::RefCell;

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

    /// Rows of `a` per task.
    fn rows_per_block(&self) -> usize {
        match self.dot {
            Dot::Q8_0 => ((192 << 10) / (self.k / 32 * 36).max(1)).clamp(4, 128) / 4 * 4,
            _ => 64,
        }
    }

    /// The task grid: (row block size, column chunk size, row blocks, column chunks, count).
    fn grid(&self, nth: usize) -> (usize, usize, usize, usize, usize) {
        let mc = self.rows_per_block();
        let batches = self.batch[0] * self.batch[1];
        let mblocks = self.m.div_ceil(mc);
        // Column chunks of at most 48, narrower when that leaves a thread without tasks.
        let want = (4 * nth).div_ceil((batches * mblocks).max(1)).max(1);
        let nc = (self.n.div_ceil(want).div_ceil(6).max(1) * 6).min(48);
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

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Imp {
    /// AVX2 when the CPU has it, else scalar.
    Auto,
    Scalar,
}

thread_local! {
    #[cfg(target_arch = "x86_64")]
    static SCRATCH: RefCell<x86::Scratch> = RefCell::new(x86::Scratch::default());
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

/// Thread `ith` of `nth`: its share of the tasks (a contiguous run).
///
/// # Safety
/// `p` must describe live memory: `a`, `b` readable over every row and batch it names, the
/// output writable, and no other thread may write the outputs of this thread's share.
pub(crate) unsafe fn run(p: &Problem, ith: usize, nth: usize, imp: Imp) {
    let nth = nth.max(1);
    let grid = p.grid(nth);
    let count = grid.4;
    let mine = (count * ith / nth..count * (ith + 1) / nth).map(|i| p.task(grid, i));
    #[cfg(target_arch = "x86_64")]
    {
        if imp == Imp::Auto && x86::available() {
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
