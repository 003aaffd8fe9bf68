//! 3×3 convolutions with stride 1 on the CPU by Winograd's F(2×2, 3×3) as our own ggml op:
//! 16 products per 2×2 outputs and channel instead of 36, and no im2col matrix. It is not
//! ggml's summation: the values move by float rounding (well within the golden tolerance,
//! tests/parity_*), so contexts with quantized weights, whose pictures are the reference's
//! bit for bit, keep the im2col path (`GraphOptions::cpu_winograd`, set by the loader).
//!
//! Per output tile, `Y = Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A` with g the 3×3 kernel and d the 4×4
//! input patch; summed over input channels, each of the 16 positions of the transformed
//! tile is one matrix product (tiles × channels times channels × output channels). A task is
//! a block of output channels × a run of tiles in one tile row: its transformed kernels stay
//! in L2 while its tiles are transformed, multiplied and transformed back.
//!
//! The video VAE's 3×3×KD causal convolutions take the same op ([`conv3x3_frames`]): an
//! output frame sums KD input frames, so the KD frames' channels are one longer channel
//! axis of the same products (KD·C "virtual" channels), read in place from the video's
//! [W, H, T, C] layout and written straight into it.

use super::context::{store_in_ctx, Graph, F16, F32, T};
use super::gemm::{Lines, TaskQueue};
use ggml_sys as g;
use std::cell::RefCell;
use std::ffi::{c_int, c_void};

/// Tiles per vector: the transforms work on 8 tiles of a tile row at once.
const TV: usize = 8;
/// Tiles per kernel panel (two vectors).
const MT: usize = 16;
/// Output channels per kernel panel (broadcast one at a time).
const NO: usize = 6;
/// Output channels per task.
const OCB: usize = 8 * NO;
/// Tiles per task, at most: a run of consecutive tiles of one image, row-major.
const SEG: usize = 3 * MT;
/// Input channels per pass of the kernel (its panels stay in L1).
const KC: usize = 256;

/// How the tensors are laid out: a batch of images, or one video whose output frames each
/// read `taps` input frames.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct Layout {
    /// Input frames per output frame (1 for images).
    taps: i16,
    /// Zero frames (fewer than `taps`) before the first one read: a causal convolution's
    /// time padding, whose products are skipped (adding zeros changes no sum).
    zeros: i16,
    /// Video: x [W, H, T, C], w [3, 3, taps, OC·C], out [OW, OH, T', OC]; images: x [W, H,
    /// C, N], w [3, 3, C, OC], out [OW, OH, OC, N].
    video: bool,
    /// The spatial padding repeats the border (zero beyond it, as around a padded copy)
    /// instead of being zeros.
    replicate: bool,
}

impl Layout {
    const IMAGES: Layout = Layout { taps: 1, zeros: 0, video: false, replicate: false };
}

#[repr(C)]
struct OpData {
    queue: TaskQueue,
    pad: [i32; 2],
    layout: Layout,
}

#[repr(C)]
struct KernelData {
    queue: TaskQueue,
    layout: Layout,
}

/// `x` [W, H, C, N] (f32) convolved with `w` [3, 3, C, OC] (f16 or f32), stride 1, dilation
/// 1, zero padding `padding` (x, y) → [OW, OH, OC, N], when the graph runs on a CPU with AVX2
/// and the convolution is large enough to gain; otherwise None.
pub(crate) fn conv3x3<'g>(g: &'g Graph, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, stride: (i32, i32), padding: (i32, i32), dilation: (i32, i32)) -> Option<T<'g>> {
    if !g.on_cpu || !g.options.cpu_winograd || !super::gemm::vector_kernels_available() || super::eval_callback::is_set() {
        return None;
    }
    let [kw, kh, c, oc] = w.ne();
    let [wi, hi, xc, n] = x.ne();
    let (p0, p1) = padding;
    if (kw, kh) != (3, 3) || stride != (1, 1) || dilation != (1, 1) || !(0..=2).contains(&p0) || !(0..=2).contains(&p1) {
        return None;
    }
    if (w.ty() != F16 && w.ty() != F32) || x.ty() != F32 || !x.is_contiguous() || xc != c || c < 16 || oc < 16 {
        return None;
    }
    let (ow, oh) = (wi + 2 * p0 as i64 - 2, hi + 2 * p1 as i64 - 2);
    if ow * oh < 256 || usize::BITS < 64 {
        return None;
    }
    build(g, x, None, w, bias, [p0, p1], Layout::IMAGES, c, oc, [ow, oh, oc, n])
}

/// A video's 3×3×KD convolution, stride 1: `x` [W, H, T, C] (f32, contiguous, its time
/// padding already in front) with `w` [3, 3, KD, OC·C] (f16 or f32, `ggml_conv_3d`'s
/// layout), zero spatial padding `padding` (x, y) → [OW, OH, T - KD + 1, OC], under the
/// conditions of [`conv3x3`]; otherwise None.
pub(crate) fn conv3x3_frames<'g>(g: &'g Graph, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, ic: i64, padding: (i32, i32)) -> Option<T<'g>> {
    frames(g, 0, None, x, w, bias, ic, padding)
}

/// [`conv3x3_frames`] of `x` after `zeros` zero frames (fewer than KD): a causal
/// convolution's first chunk, without the padded copy and without the zero frames'
/// products, which add nothing (the same sums bit for bit).
pub(crate) fn conv3x3_frames_zero_front<'g>(g: &'g Graph, zeros: i64, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, ic: i64, padding: (i32, i32)) -> Option<T<'g>> {
    frames(g, zeros, None, x, w, bias, ic, padding)
}

/// [`conv3x3_frames`] over the frames of `before` (f32 [W, H, T', C], contiguous: a causal
/// convolution's cached frames) followed by those of `x`, read where they are: the two
/// joined in time, without the joined copy.
pub(crate) fn conv3x3_frames_after<'g>(g: &'g Graph, before: Option<T<'g>>, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, ic: i64, padding: (i32, i32)) -> Option<T<'g>> {
    frames(g, 0, before, x, w, bias, ic, padding)
}

/// [`conv3x3_frames_after`] with one pixel of replicate padding all round in space, read in
/// place: the values (and the sums, bit for bit) of the convolution of a padded copy.
pub(crate) fn conv3x3_frames_after_replicated<'g>(g: &'g Graph, before: Option<T<'g>>, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, ic: i64) -> Option<T<'g>> {
    frames_with(g, 0, before, x, w, bias, ic, (1, 1), true)
}

/// The video convolutions: `zeros` zero frames, then `before`'s, then `x`'s.
#[allow(clippy::too_many_arguments)]
fn frames<'g>(g: &'g Graph, zeros: i64, before: Option<T<'g>>, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, ic: i64, padding: (i32, i32)) -> Option<T<'g>> {
    frames_with(g, zeros, before, x, w, bias, ic, padding, false)
}

#[allow(clippy::too_many_arguments)]
fn frames_with<'g>(g: &'g Graph, zeros: i64, before: Option<T<'g>>, x: T<'g>, w: T<'g>, bias: Option<T<'g>>, ic: i64, padding: (i32, i32), replicate: bool) -> Option<T<'g>> {
    if !g.on_cpu || !g.options.cpu_winograd || !super::gemm::vector_kernels_available() || super::eval_callback::is_set() {
        return None;
    }
    let [kw, kh, kd, ocic] = w.ne();
    let [wi, hi, tx, xc] = x.ne();
    let t = zeros + tx + before.map_or(0, |b| b.ne()[2]);
    let (p0, p1) = padding;
    if (kw, kh) != (3, 3) || kd < 1 || t < kd || !(0..kd).contains(&zeros) || xc != ic || ic < 4 || ocic % ic != 0 || !(0..=2).contains(&p0) || !(0..=2).contains(&p1) {
        return None;
    }
    // From 4 input channels (LTX's last convolutions, 8 → 32 and 4 → 48 at full size, were
    // most of its decode through im2col_3d: its matrix is 27 values per channel and pixel).
    // Any number of output channels: the alternative is ggml's im2col_3d after a padded copy
    // (a Wan VAE's last convolution, 96 → 3 channels, took a third of a 512² decode so).
    let oc = ocic / ic;
    if (w.ty() != F16 && w.ty() != F32) || x.ty() != F32 || !x.is_contiguous() {
        return None;
    }
    if let Some(b) = before {
        let [bw, bh, _, bc] = b.ne();
        if b.ty() != F32 || !b.is_contiguous() || (bw, bh, bc) != (wi, hi, xc) {
            return None;
        }
    }
    let (ow, oh) = (wi + 2 * p0 as i64 - 2, hi + 2 * p1 as i64 - 2);
    if ow * oh < 256 || usize::BITS < 64 {
        return None;
    }
    let layout = Layout { taps: i16::try_from(kd).ok()?, zeros: zeros as i16, video: true, replicate };
    build(g, x, before, w, bias, [p0, p1], layout, kd * ic, oc, [ow, oh, t - kd + 1, oc])
}

/// Bytes of transformed kernels one convolution node holds at most: 16 f32 values per
/// kernel and (virtual) input channel, so HunyuanVideo's 1024 → 4096 upsampler over three
/// frames would need 805 MB, most of its decode's compute buffer. Larger convolutions run as
/// several nodes over groups of output channels (each output's sums unchanged).
const KERNEL_BUDGET: usize = 64 << 20;

#[cfg(test)]
thread_local! {
    /// Tests set a small budget to split small convolutions.
    static TEST_BUDGET: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

fn kernel_budget() -> usize {
    #[cfg(test)]
    if let Some(b) = TEST_BUDGET.with(|b| b.get()) {
        return b;
    }
    KERNEL_BUDGET
}

/// Output channels per node: all of them when their transformed kernels fit the budget,
/// else whole tasks' worth (multiples of `OCB`) that do.
fn channels_per_node(c: i64, oc: i64) -> i64 {
    let per_channel = (c.max(1) as usize) * 16 * 4;
    let fit = (kernel_budget() / per_channel / OCB * OCB).max(OCB) as i64;
    if fit >= oc {
        oc
    } else {
        fit
    }
}

/// The convolution of `before`'s frames and `x`'s into a tensor of `out` elements, plus
/// `bias` per output channel, as one pair of nodes (`build_group`) or, past the kernel budget,
/// one pair per group of output channels, each written into its part of the output.
#[allow(clippy::too_many_arguments)]
fn build<'g>(g: &'g Graph, x: T<'g>, before: Option<T<'g>>, w: T<'g>, bias: Option<T<'g>>, pad: [i32; 2], layout: Layout, c: i64, oc: i64, out: [i64; 4]) -> Option<T<'g>> {
    let per_node = channels_per_node(c, oc);
    if per_node >= oc {
        return build_group(g, x, before, w, bias, pad, layout, c, oc, out);
    }
    // The output channel axis: 3 for video, 2 for images; a group's kernels are the
    // contiguous run of its output channels' (video: `C` rows of the last axis each).
    let axis = if layout.video { 3 } else { 2 };
    let rows_per_oc = if layout.video { w.ne()[3] / oc } else { 1 };
    let folded = foldable(bias, oc);
    let whole = g.new_tensor(F32, &out);
    let nb = whole.nb();
    let (wne, wnb) = (w.ne(), w.nb());
    let mut result = whole;
    for o0 in (0..oc).step_by(per_node as usize) {
        let n = per_node.min(oc - o0);
        let wg = w.view(&[wne[0], wne[1], wne[2], n * rows_per_oc], &[wnb[1], wnb[2], wnb[3]], o0 as usize * rows_per_oc as usize * wnb[3]);
        let bg = folded.map(|b| b.view(&[n], &[], o0 as usize * 4));
        let mut part_out = out;
        part_out[axis] = n;
        let part = build_group(g, x, before, wg, bg, pad, layout, c, n, part_out)?;
        result = result.set_inplace(part, nb[1], nb[2], nb[3], o0 as usize * nb[axis]);
    }
    Some(with_unfolded_bias(result, bias, folded, layout))
}

/// The two nodes: the kernels transformed (`c` channels, virtual ones for video), then the
/// convolution of `before`'s frames and `x`'s into a tensor of `out` elements, plus `bias`
/// per output channel: added in the output pass when it is f32 [OC] (the same f32 sums as a
/// separate `add`, one pass over the output less), else by ggml's `add`.
#[allow(clippy::too_many_arguments)]
fn build_group<'g>(g: &'g Graph, x: T<'g>, before: Option<T<'g>>, w: T<'g>, bias: Option<T<'g>>, pad: [i32; 2], layout: Layout, c: i64, oc: i64, out: [i64; 4]) -> Option<T<'g>> {
    let opan = (oc as usize).div_ceil(NO) as i64;
    let kq = store_in_ctx(g.ctx(), KernelData { queue: TaskQueue::new(), layout })?;
    let data = store_in_ctx(g.ctx(), OpData { queue: TaskQueue::new(), pad, layout })?;
    let mut wargs = [w.raw()];
    // SAFETY: a live context and sources; each callback reads its sources and writes only its
    // own output; the user data lives in the same context as the nodes.
    let u = unsafe { g::ggml_custom_4d(g.ctx(), F32, NO as i64, c, opan, 16, wargs.as_mut_ptr(), 1, Some(compute_kernels), -1, kq as *mut c_void) };
    let folded = foldable(bias, oc);
    let null = std::ptr::null_mut();
    let mut args = [x.raw(), u, before.map_or(null, |b| b.raw()), folded.map_or(null, |b| b.raw())];
    let n_args = if folded.is_some() { 4 } else if before.is_some() { 3 } else { 2 };
    let [ow, oh, o2, o3] = out;
    let y = x.wrap(unsafe { g::ggml_custom_4d(g.ctx(), F32, ow, oh, o2, o3, args.as_mut_ptr(), n_args, Some(compute), -1, data as *mut c_void) });
    Some(with_unfolded_bias(y, bias, folded, layout))
}

/// The bias the output pass adds: f32 [OC], contiguous.
fn foldable<'g>(bias: Option<T<'g>>, oc: i64) -> Option<T<'g>> {
    bias.filter(|b| b.ty() == F32 && b.is_contiguous() && b.nelements() == oc)
}

/// `y` plus `bias` per output channel by ggml's `add` when the output pass did not add it
/// (`folded` is what it added).
fn with_unfolded_bias<'g>(y: T<'g>, bias: Option<T<'g>>, folded: Option<T<'g>>, layout: Layout) -> T<'g> {
    match (bias, folded) {
        (Some(b), None) => {
            let per_channel: [i64; 4] = if layout.video { [1, 1, 1, b.nelements()] } else { [1, 1, b.nelements(), 1] };
            y.add_inplace(b.reshape(&per_channel))
        }
        _ => y,
    }
}

/// The first node: `G g Gᵀ` of every kernel into [16][oc panel][c][NO], panels of output
/// channels shared out among the threads.
pub(super) unsafe extern "C" fn compute_kernels(dst: *mut g::ggml_tensor, _ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `build`: source w (its layout's),
        // output [NO, C, panels, 16] f32, both allocated; the user data is its `KernelData`.
        unsafe {
            let data = &*(userdata as *const KernelData);
            let queue = &data.queue;
            let d = &*dst;
            let w = KernelGeo::new(&*d.src[0], d.ne[1] as usize, data.layout);
            let _finish = queue.finish_guard(nth.max(1) as usize);
            let panels = d.ne[2] as usize;
            loop {
                let p = queue.claim();
                if p >= panels {
                    break;
                }
                transform_kernels(&w, p, panels, d.data as *mut f32);
            }
        }
    });
}
/// Where the kernels' values are: channel `ci` (virtual for video: frame `ci / cr`,
/// channel `ci % cr`) of output channel `o` at `o·o_nb + (ci % cr)·c_nb + (ci / cr)·t_nb`.
struct KernelGeo {
    data: *const u8,
    f16: bool,
    nb: [usize; 2],
    o_nb: usize,
    c_nb: usize,
    t_nb: usize,
    /// Channels (virtual), real channels per frame, output channels.
    c: usize,
    cr: usize,
    oc: usize,
}

impl KernelGeo {
    /// # Safety
    /// `w` a live kernel tensor of `layout` with `c` (virtual) channels.
    unsafe fn new(w: &g::ggml_tensor, c: usize, layout: Layout) -> KernelGeo {
        let taps = layout.taps.max(1) as usize;
        let cr = c / taps;
        let (o_nb, c_nb, t_nb, oc) = if layout.video { (cr * w.nb[3], w.nb[3], w.nb[2], w.ne[3] as usize / cr) } else { (w.nb[3], w.nb[2], 0, w.ne[3] as usize) };
        KernelGeo { data: w.data as *const u8, f16: w.type_ == F16, nb: [w.nb[0], w.nb[1]], o_nb, c_nb, t_nb, c, cr, oc }
    }
}

/// Sizes of one convolution, from its tensors.
struct Geo {
    x: *const u8,
    /// Row stride of the input, and the strides of its (real) channels and its frames (or
    /// images).
    x_row: usize,
    x_c: usize,
    x_n: usize,
    /// The frames read before `x`'s (a causal convolution's cache; `b_frames` 0 without),
    /// with their channel and frame strides.
    b: *const u8,
    b_frames: usize,
    b_c: usize,
    b_n: usize,
    /// Real channels per input frame (`c` / taps).
    cr: usize,
    /// Zero frames before the first one read (`Layout::zeros`).
    zeros: usize,
    /// `Layout::replicate`.
    replicate: bool,
    /// Per output channel, added to the outputs (null: none).
    bias: *const f32,
    /// Transformed kernels: [16][oc panel][c][NO].
    u: *const f32,
    opan: usize,
    out: *mut u8,
    /// Row stride of the output, and the strides of its channels and its frames (images).
    o_row: usize,
    o_c: usize,
    o_n: usize,
    wi: usize,
    hi: usize,
    c: usize,
    oc: usize,
    ow: usize,
    oh: usize,
    pad: [isize; 2],
    tw: usize,
    /// Tiles per image.
    tiles: usize,
    segs: usize,
    n: usize,
    /// Whether the products take 16-lane registers (same values, see `kernel_avx512`).
    avx512: bool,
}

impl Geo {
    /// # Safety
    /// A node built by `conv3x3`.
    unsafe fn new(d: &g::ggml_tensor, pad: [i32; 2], layout: Layout) -> Geo {
        let (x, w) = unsafe { (&*d.src[0], &*d.src[1]) };
        let before = unsafe { d.src[2].as_ref() };
        let bias = d.src[3] as *const g::ggml_tensor;
        let us = |v: i64| v as usize;
        let (ow, oh) = (us(d.ne[0]), us(d.ne[1]));
        let (tw, th) = (ow.div_ceil(2), oh.div_ceil(2));
        // Channels and frames (images) are axes 3 and 2 of video tensors, 2 and 3 otherwise.
        let (ca, na) = if layout.video { (3, 2) } else { (2, 3) };
        let oc = us(d.ne[ca]);
        Geo {
            x: x.data as *const u8,
            x_row: x.nb[1],
            x_c: x.nb[ca],
            x_n: x.nb[na],
            b: before.map_or(std::ptr::null(), |b| b.data as *const u8),
            b_frames: before.map_or(0, |b| us(b.ne[na])),
            b_c: before.map_or(0, |b| b.nb[ca]),
            b_n: before.map_or(0, |b| b.nb[na]),
            cr: us(x.ne[ca]),
            zeros: layout.zeros.max(0) as usize,
            replicate: layout.replicate,
            bias: if bias.is_null() { std::ptr::null() } else { unsafe { (*bias).data as *const f32 } },
            u: w.data as *const f32,
            opan: us(w.ne[2]),
            out: d.data as *mut u8,
            o_row: d.nb[1],
            o_c: d.nb[ca],
            o_n: d.nb[na],
            wi: us(x.ne[0]),
            hi: us(x.ne[1]),
            c: us(w.ne[1]),
            oc,
            ow,
            oh,
            pad: [pad[0] as isize, pad[1] as isize],
            tw,
            tiles: tw * th,
            segs: (tw * th).div_ceil(SEG),
            n: us(d.ne[na]),
            avx512: super::gemm::x86::avx512_allowed(),
        }
    }

    /// Tasks: runs of SEG tiles of one image, each with every output channel (its input
    /// rows are read and transformed once).
    fn count(&self) -> usize {
        self.n * self.segs
    }

    /// The first (virtual) channel of output frame `n` that is not a zero frame's.
    fn first_channel(&self, n: usize) -> usize {
        self.zeros.saturating_sub(n) * self.cr
    }

    /// The plane of (virtual) channel `ci` (from `first_channel(n)` on) read for output
    /// frame (image) `n`.
    fn plane(&self, n: usize, ci: usize) -> *const u8 {
        let (f, c) = (n + ci / self.cr - self.zeros, ci % self.cr);
        if f < self.b_frames {
            self.b.wrapping_add(f * self.b_n + c * self.b_c)
        } else {
            self.x.wrapping_add((f - self.b_frames) * self.x_n + c * self.x_c)
        }
    }
}

#[derive(Default)]
struct Scratch {
    /// Transformed tiles: [16][SEG / MT][c][MT].
    v: Lines,
    /// Products of one block of output channels: [16][OCB][SEG].
    m: Lines,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

pub(super) unsafe extern "C" fn compute(dst: *mut g::ggml_tensor, _ith: c_int, nth: c_int, userdata: *mut c_void) {
    // A panic must not unwind into ggml's C threads.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: ggml calls this with the node built by `conv3x3`, its sources and output
        // allocated, its user data that node's `OpData`, on all of its threads.
        unsafe {
            let data = &*(userdata as *const OpData);
            let geo = Geo::new(&*dst, data.pad, data.layout);
            let count = geo.count();
            let _finish = data.queue.finish_guard(nth.max(1) as usize);
            SCRATCH.with(|s| {
                let s = &mut *s.borrow_mut();
                loop {
                    let i = data.queue.claim();
                    if i >= count {
                        break;
                    }
                    task(&geo, i, s);
                }
            });
        }
    });
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task(geo: &Geo, i: usize, s: &mut Scratch) {
    let (n, seg) = (i / geo.segs, i % geo.segs);
    let c = geo.c;
    let t0 = seg * SEG;
    let tiles = SEG.min(geo.tiles - t0);
    let tpan = tiles.div_ceil(MT);
    let v = s.v.at_least::<f32>(16 * tpan * c * MT);
    let m = s.m.at_least::<f32>(16 * OCB * SEG);
    let c_lo = geo.first_channel(n);
    transform_tiles(geo, n, c_lo, t0, tiles, tpan, v);
    let v = v as *const f32;
    for oc0 in (0..geo.oc).step_by(OCB) {
        let ocs = OCB.min(geo.oc - oc0);
        let (p0, p1) = (oc0 / NO, (oc0 + ocs).div_ceil(NO));
        for pos in 0..16 {
            let (u, v, m) = (geo.u.add(pos * geo.opan * c * NO), v.add(pos * tpan * c * MT), m.add(pos * OCB * SEG));
            for c0 in (c_lo..c).step_by(KC) {
                let kc = KC.min(c - c0);
                let resume = c0 > c_lo;
                let mut p = p0;
                if geo.avx512 {
                    while p + 4 <= p1 {
                        let up: [*const f32; 4] = std::array::from_fn(|q| u.add(((p + q) * c + c0) * NO));
                        for t in 0..tpan {
                            kernel_avx512(v.add((t * c + c0) * MT), up, kc, m.add((p - p0) * NO * SEG + t * MT), SEG, resume);
                        }
                        p += 4;
                    }
                }
                for p in p..p1 {
                    let up = u.add((p * c + c0) * NO);
                    for t in 0..tpan {
                        kernel(v.add((t * c + c0) * MT), up, kc, m.add((p - p0) * NO * SEG + t * MT), SEG, resume);
                    }
                }
            }
        }
        untransform(geo, n, t0, tiles, oc0, ocs, m);
    }
}

/// `G g Gᵀ` of the kernels of output channel panel `p` into [16][panel][c][NO] (zero past
/// the last channel). f32 kernels are rounded to f16 first: ggml's product with the f16
/// im2col matrix does. Eight channels at a time on vectors (the same operations per value as
/// `tests::transform_kernels_scalar`, so the same bits): done once per compute, it was 6 %
/// of a fast-path UNet run as scalar code.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transform_kernels(w: &KernelGeo, p: usize, panels: usize, u: *mut f32) {
    let (c, oc) = (w.c, w.oc);
    let half = _mm256_set1_ps(0.5);
    // The three values of Gᵀ's action on (a, b, d): a, (a + b + d) / 2, (a - b + d) / 2, d.
    let g = |a: __m256, b: __m256, d: __m256| [a, _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(a, b), d), half), _mm256_mul_ps(_mm256_add_ps(_mm256_sub_ps(a, b), d), half), d];
    for lane in 0..NO {
        let o = p * NO + lane;
        for c0 in (0..c).step_by(8) {
            let live = (c - c0).min(8);
            // taps[ky·3 + kx][i]: channel c0 + i's value as f16 bits.
            let mut taps = [[0u16; 8]; 9];
            if o < oc {
                for i in 0..live {
                    let ci = c0 + i;
                    let base = w.data.add(o * w.o_nb + (ci % w.cr) * w.c_nb + (ci / w.cr) * w.t_nb);
                    for (t, tap) in taps.iter_mut().enumerate() {
                        let at = base.add((t / 3) * w.nb[1] + (t % 3) * w.nb[0]);
                        tap[i] = if w.f16 { (at as *const u16).read_unaligned() } else { super::gemm::scalar::f32_to_f16((at as *const f32).read_unaligned()) };
                    }
                }
            }
            let k: [__m256; 9] = std::array::from_fn(|t| _mm256_cvtph_ps(_mm_loadu_si128(taps[t].as_ptr() as *const __m128i)));
            // Rows (G g), column by column, then each row's columns.
            let cols: [[__m256; 4]; 3] = std::array::from_fn(|col| g(k[col], k[3 + col], k[6 + col]));
            for r in 0..4 {
                for (q, v) in g(cols[0][r], cols[1][r], cols[2][r]).into_iter().enumerate() {
                    let mut vals = [0f32; 8];
                    _mm256_storeu_ps(vals.as_mut_ptr(), v);
                    let dst = u.add((((r * 4 + q) * panels + p) * c + c0) * NO + lane);
                    for (i, &x) in vals.iter().enumerate().take(live) {
                        *dst.add(i * NO) = x;
                    }
                }
            }
        }
    }
}

use std::arch::x86_64::*;

/// Rounds 8 values to f16 and back, as ggml's im2col stores its inputs (f16 and f32
/// kernels alike).
#[inline(always)]
unsafe fn round_f16(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// The 4×4 input values of 8 tiles (lane = tile), rounded to f16: `d[r][q]`.
#[inline(always)]
unsafe fn gather_tiles(geo: &Geo, plane: *const u8, first: usize, live: usize, d: &mut [[__m256; 4]; 4]) {
    let (ty, tx) = (first / geo.tw, first % geo.tw);
    let y0 = (2 * ty) as isize - geo.pad[1];
    let x0 = (2 * tx) as isize - geo.pad[0];
    // The input row / column read for padded coordinate v (None: a zero).
    let at = |v: isize, len: usize, pad: isize| -> Option<usize> {
        if (0..len as isize).contains(&v) {
            Some(v as usize)
        } else if geo.replicate && v >= -pad && v < len as isize + pad {
            Some(v.clamp(0, len as isize - 1) as usize)
        } else {
            None
        }
    };
    if live == TV && tx + TV <= geo.tw {
        // One tile row: per input row, 18 values (zero outside the image) de-interleaved,
        // read in place inside the image and through a padded copy at its edges.
        let inside = x0 >= 0 && x0 + 18 <= geo.wi as isize;
        let mut buf = [0f32; 24];
        for (r, dr) in d.iter_mut().enumerate() {
            let y = y0 + r as isize;
            let row = at(y, geo.hi, geo.pad[1]);
            let p = match row {
                Some(yr) if inside => (plane.add(yr * geo.x_row) as *const f32).offset(x0),
                _ => {
                    buf[..18].fill(0.0);
                    if let Some(yr) = row {
                        let src = plane.add(yr * geo.x_row) as *const f32;
                        for (i, b) in buf.iter_mut().enumerate().take(18) {
                            if let Some(xc) = at(x0 + i as isize, geo.wi, geo.pad[0]) {
                                *b = *src.add(xc);
                            }
                        }
                    }
                    buf.as_ptr()
                }
            };
            for (q, half) in [(0usize, 0usize), (2, 2)] {
                let (a, b) = (_mm256_loadu_ps(p.add(half)), _mm256_loadu_ps(p.add(half + 8)));
                let even = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_shuffle_ps::<0x88>(a, b))));
                let odd = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_shuffle_ps::<0xDD>(a, b))));
                dr[q] = round_f16(even);
                dr[q + 1] = round_f16(odd);
            }
        }
        return;
    }
    // Tiles across a row end, or past the last tile: lane by lane.
    let mut lanes = [[[0f32; TV]; 4]; 4];
    for l in 0..live {
        let (ty, tx) = ((first + l) / geo.tw, (first + l) % geo.tw);
        for (r, lr) in lanes.iter_mut().enumerate() {
            let Some(y) = at((2 * ty + r) as isize - geo.pad[1], geo.hi, geo.pad[1]) else { continue };
            let src = plane.add(y * geo.x_row) as *const f32;
            for (q, lq) in lr.iter_mut().enumerate() {
                if let Some(x) = at((2 * tx + q) as isize - geo.pad[0], geo.wi, geo.pad[0]) {
                    lq[l] = *src.add(x);
                }
            }
        }
    }
    for (dr, lr) in d.iter_mut().zip(&lanes) {
        for (dq, lq) in dr.iter_mut().zip(lr) {
            *dq = round_f16(_mm256_loadu_ps(lq.as_ptr()));
        }
    }
}

/// `Bᵀ d B` of tiles t0..t0+tiles of image `n` (zero beyond), channels c_lo.. (the ones
/// before are zero frames'), into [16][tile panel][c][MT].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transform_tiles(geo: &Geo, n: usize, c_lo: usize, t0: usize, tiles: usize, tpan: usize, v: *mut f32) {
    let c = geo.c;
    let pos_stride = tpan * c * MT;
    let mut d = [[_mm256_setzero_ps(); 4]; 4];
    for ci in c_lo..c {
        let plane = geo.plane(n, ci);
        for gi in 0..tpan * MT / TV {
            let live = tiles.saturating_sub(gi * TV).min(TV);
            gather_tiles(geo, plane, t0 + gi * TV, live, &mut d);
            let mut bt = [[_mm256_setzero_ps(); 4]; 4];
            for q in 0..4 {
                let (a, b, e, f) = (d[0][q], d[1][q], d[2][q], d[3][q]);
                bt[0][q] = _mm256_sub_ps(a, e);
                bt[1][q] = _mm256_add_ps(b, e);
                bt[2][q] = _mm256_sub_ps(e, b);
                bt[3][q] = _mm256_sub_ps(b, f);
            }
            let base = v.add(((gi * TV / MT) * c + ci) * MT + gi * TV % MT);
            for (r, row) in bt.iter().enumerate() {
                let (a, b, e, f) = (row[0], row[1], row[2], row[3]);
                let vals = [_mm256_sub_ps(a, e), _mm256_add_ps(b, e), _mm256_sub_ps(e, b), _mm256_sub_ps(b, f)];
                for (q, val) in vals.into_iter().enumerate() {
                    _mm256_storeu_ps(base.add((r * 4 + q) * pos_stride), val);
                }
            }
        }
    }
}

/// `Aᵀ M A` of the task's tiles and channels into the output.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn untransform(geo: &Geo, n: usize, t0: usize, tiles: usize, oc0: usize, ocs: usize, m: *const f32) {
    for o in 0..ocs {
        let out = geo.out.add(n * geo.o_n + (oc0 + o) * geo.o_c);
        let bias = (!geo.bias.is_null()).then(|| _mm256_set1_ps(*geo.bias.add(oc0 + o)));
        for gi in 0..tiles.div_ceil(TV) {
            let at = m.add(o * SEG + gi * TV);
            let mv = |r: usize, q: usize| _mm256_loadu_ps(at.add((r * 4 + q) * OCB * SEG));
            let s: [[__m256; 4]; 2] = [
                std::array::from_fn(|q| _mm256_add_ps(_mm256_add_ps(mv(0, q), mv(1, q)), mv(2, q))),
                std::array::from_fn(|q| _mm256_sub_ps(_mm256_sub_ps(mv(1, q), mv(2, q)), mv(3, q))),
            ];
            let first = t0 + gi * TV;
            let live = (tiles - gi * TV).min(TV);
            let (ty, tx) = (first / geo.tw, first % geo.tw);
            for (r, row) in s.iter().enumerate() {
                let mut y0 = _mm256_add_ps(_mm256_add_ps(row[0], row[1]), row[2]);
                let mut y1 = _mm256_sub_ps(_mm256_sub_ps(row[1], row[2]), row[3]);
                if let Some(b) = bias {
                    (y0, y1) = (_mm256_add_ps(y0, b), _mm256_add_ps(y1, b));
                }
                if live == TV && tx + TV <= geo.tw && 2 * (tx + TV) <= geo.ow {
                    let y = 2 * ty + r;
                    if y < geo.oh {
                        // Interleave the two output columns of each tile.
                        let (lo, hi) = (_mm256_unpacklo_ps(y0, y1), _mm256_unpackhi_ps(y0, y1));
                        let dst = out.add(y * geo.o_row) as *mut f32;
                        _mm256_storeu_ps(dst.add(2 * tx), _mm256_permute2f128_ps::<0x20>(lo, hi));
                        _mm256_storeu_ps(dst.add(2 * tx + 8), _mm256_permute2f128_ps::<0x31>(lo, hi));
                    }
                    continue;
                }
                let (mut a, mut b) = ([0f32; TV], [0f32; TV]);
                _mm256_storeu_ps(a.as_mut_ptr(), y0);
                _mm256_storeu_ps(b.as_mut_ptr(), y1);
                for l in 0..live {
                    let (ty, tx) = ((first + l) / geo.tw, (first + l) % geo.tw);
                    let (y, x) = (2 * ty + r, 2 * tx);
                    if y >= geo.oh {
                        continue;
                    }
                    let dst = out.add(y * geo.o_row) as *mut f32;
                    *dst.add(x) = a[l];
                    if x + 1 < geo.ow {
                        *dst.add(x + 1) = b[l];
                    }
                }
            }
        }
    }
}

/// `kernel` for 4 panels of output channels at once in 16-lane registers (24 accumulators):
/// every lane sees the same fused multiply-adds in the same order, so the values are the
/// AVX2 kernel's bit for bit.
#[target_feature(enable = "avx512f")]
unsafe fn kernel_avx512(v: *const f32, u: [*const f32; 4], kc: usize, m: *mut f32, ldm: usize, resume: bool) {
    let mut acc = [_mm512_setzero_ps(); 4 * NO];
    if resume {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(m.add(j * ldm));
        }
    }
    for k in 0..kc {
        let vv = _mm512_loadu_ps(v.add(k * MT));
        for (q, up) in u.iter().enumerate() {
            let pu = up.add(k * NO);
            for j in 0..NO {
                let a = &mut acc[q * NO + j];
                *a = _mm512_fmadd_ps(vv, _mm512_set1_ps(*pu.add(j)), *a);
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(m.add(j * ldm), *a);
    }
}

/// `m[j][i] (+)= Σ_k v[k][i] · u[k][j]` for MT tiles × NO output channels over `kc`
/// channels; `m` rows (output channels) `ldm` floats apart.
#[inline(always)]
unsafe fn kernel(v: *const f32, u: *const f32, kc: usize, m: *mut f32, ldm: usize, resume: bool) {
    let mut acc = [[_mm256_setzero_ps(); 2]; NO];
    if resume {
        for (j, row) in acc.iter_mut().enumerate() {
            row[0] = _mm256_loadu_ps(m.add(j * ldm));
            row[1] = _mm256_loadu_ps(m.add(j * ldm + 8));
        }
    }
    let (mut pv, mut pu) = (v, u);
    for _ in 0..kc {
        let (v0, v1) = (_mm256_loadu_ps(pv), _mm256_loadu_ps(pv.add(8)));
        for (j, row) in acc.iter_mut().enumerate() {
            let b = _mm256_broadcast_ss(&*pu.add(j));
            row[0] = _mm256_fmadd_ps(v0, b, row[0]);
            row[1] = _mm256_fmadd_ps(v1, b, row[1]);
        }
        pv = pv.add(MT);
        pu = pu.add(NO);
    }
    for (j, row) in acc.iter().enumerate() {
        _mm256_storeu_ps(m.add(j * ldm), row[0]);
        _mm256_storeu_ps(m.add(j * ldm + 8), row[1]);
    }
}

#[cfg(test)]
mod tests {
    use super::{transform_kernels, KernelGeo, NO};
    use crate::graph::backend::Backend;

    /// The scalar specification of `transform_kernels` (its former code).
    unsafe fn transform_kernels_scalar(w: &KernelGeo, p: usize, panels: usize, u: *mut f32) {
        let (c, oc, f16) = (w.c, w.oc, w.f16);
        for lane in 0..NO {
            let o = p * NO + lane;
            for ci in 0..c {
                let mut k = [[0f32; 3]; 3];
                if o < oc {
                    let base = w.data.add(o * w.o_nb + (ci % w.cr) * w.c_nb + (ci / w.cr) * w.t_nb);
                    for (ky, row) in k.iter_mut().enumerate() {
                        for (kx, v) in row.iter_mut().enumerate() {
                            let at = base.add(ky * w.nb[1] + kx * w.nb[0]);
                            let h = if f16 { (at as *const u16).read_unaligned() } else { crate::graph::gemm::scalar::f32_to_f16((at as *const f32).read_unaligned()) };
                            *v = crate::graph::gemm::scalar::f16_to_f32(h);
                        }
                    }
                }
                // Rows: G g.
                let mut gk = [[0f32; 3]; 4];
                for col in 0..3 {
                    let (a, b, d) = (k[0][col], k[1][col], k[2][col]);
                    gk[0][col] = a;
                    gk[1][col] = (a + b + d) * 0.5;
                    gk[2][col] = (a - b + d) * 0.5;
                    gk[3][col] = d;
                }
                for (r, row) in gk.iter().enumerate() {
                    let (a, b, d) = (row[0], row[1], row[2]);
                    let vals = [a, (a + b + d) * 0.5, (a - b + d) * 0.5, d];
                    for (q, v) in vals.into_iter().enumerate() {
                        *u.add((((r * 4 + q) * panels + p) * c + ci) * NO + lane) = v;
                    }
                }
            }
        }
    }

    /// The vector kernel transform gives the scalar one's values bit for bit: f16 and f32
    /// kernels, channel counts that are not multiples of 8, output channels past the last.
    #[test]
    fn kernel_transform_matches_its_scalar_specification() {
        if !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let (c, oc) = (21usize, 8usize);
        let panels = oc.div_ceil(NO);
        for f16 in [true, false] {
            let n = 9 * c * oc;
            let vals: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.00731).collect();
            let bytes: Vec<u8> = if f16 {
                vals.iter().flat_map(|&v| crate::graph::gemm::scalar::f32_to_f16(v).to_le_bytes()).collect()
            } else {
                vals.iter().flat_map(|&v| v.to_le_bytes()).collect()
            };
            let es = if f16 { 2 } else { 4 };
            let w = KernelGeo { data: bytes.as_ptr(), f16, nb: [es, 3 * es], o_nb: 9 * c * es, c_nb: 9 * es, t_nb: 0, c, cr: c, oc };
            let len = 16 * panels * c * NO;
            let (mut got, mut want) = (vec![f32::NAN; len], vec![f32::NAN; len]);
            for p in 0..panels {
                // SAFETY: the buffers hold every panel's values; the kernels are `bytes`.
                unsafe {
                    transform_kernels(&w, p, panels, got.as_mut_ptr());
                    transform_kernels_scalar(&w, p, panels, want.as_mut_ptr());
                }
            }
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "f16 {f16}");
        }
    }

    /// The 16-lane kernel's values are the AVX2 kernel's, bit for bit (fresh and resumed).
    #[test]
    fn avx512_kernel_gives_the_avx2_values() {
        if !is_x86_feature_detected!("avx512f") || !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let kc = 37;
        let v: Vec<f32> = (0..kc * super::MT).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let u: Vec<Vec<f32>> = (0..4).map(|q| (0..kc * super::NO).map(|i| ((i * 11 + q * 7) % 29) as f32 * 0.07 - 1.0).collect()).collect();
        let ldm = 40;
        let mut want = vec![0.5f32; 4 * super::NO * ldm];
        let mut got = want.clone();
        for resume in [false, true] {
            // SAFETY: buffers hold kc rows of each panel and 24 output rows of 16.
            unsafe {
                for (q, uq) in u.iter().enumerate() {
                    super::kernel(v.as_ptr(), uq.as_ptr(), kc, want.as_mut_ptr().add(q * super::NO * ldm), ldm, resume);
                }
                let up: [*const f32; 4] = std::array::from_fn(|q| u[q].as_ptr());
                super::kernel_avx512(v.as_ptr(), up, kc, got.as_mut_ptr(), ldm, resume);
            }
            assert_eq!(want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), got.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }
    use crate::graph::context::{F16, F32};
    use crate::graph::gemm::scalar::f32_to_f16;
    use crate::graph::runner::Runner;
    use std::sync::Arc;

    /// Values in [-1, 1) from a linear congruential sequence.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        }
    }

    /// Kernel values as f16 or f32 bytes.
    fn kernel_bytes(v: &[f32], f16: bool) -> Vec<u8> {
        if f16 {
            v.iter().flat_map(|&v| f32_to_f16(v).to_le_bytes()).collect()
        } else {
            v.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
    }

    /// The graph `build` makes computed with ggml's convolution sums, then with Winograd's.
    fn both_ways(backend: &Arc<Backend>, build: impl Fn(&crate::graph::context::Graph) -> crate::graph::context::T<'_>) -> (crate::tensor::Tensor, crate::tensor::Tensor) {
        let run = |winograd: bool| {
            let mut r = Runner::new(backend.clone(), 3);
            r.options.cpu_winograd = winograd;
            r.compute(|g| Ok(build(g))).unwrap()
        };
        (run(false), run(true))
    }

    /// Same shape, and within float rounding of the largest value.
    fn assert_close(want: &crate::tensor::Tensor, got: &crate::tensor::Tensor, what: &str) {
        assert_eq!(want.shape(), got.shape());
        let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = want.data().iter().zip(got.data()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 2e-5 * scale.max(1.0), "{what}: off by {worst} (scale {scale})");
    }

    /// Against ggml's own convolution (im2col, f16 products summed in f32): shapes with odd
    /// sizes, both paddings, channels that fill no panel evenly, several K passes, several
    /// segments per tile row, a batch of two, f16 and f32 kernels.
    #[test]
    fn winograd_matches_ggml_convolution() {
        if !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut rnd = uniform(7);
        // (w, h, c, oc, n, padding, f16 kernel)
        let cases = [(19, 17, 24, 40, 1, 1, true), (103, 9, 300, 16, 2, 1, true), (20, 22, 16, 70, 1, 0, true), (20, 22, 16, 64, 1, 0, false), (20, 22, 16, 70, 1, 1, false), (33, 16, 64, 64, 1, 2, true)];
        for (wi, hi, c, oc, n, pad, f16) in cases {
            let x: Vec<f32> = (0..wi * hi * c * n).map(|_| rnd()).collect();
            let wv: Vec<f32> = (0..9 * c * oc).map(|_| rnd() * 0.2).collect();
            let wty = if f16 { F16 } else { F32 };
            let wbytes = kernel_bytes(&wv, f16);
            let (want, got) = both_ways(&backend, |g| {
                let xt = g.input_f32(&x, &[wi, hi, c, n]);
                let wt = g.input_bytes(wty, &[3, 3, c, oc], wbytes.clone());
                crate::graph::nn::conv_2d(g, xt, wt, None, (1, 1), (pad, pad), (1, 1), 1.0)
            });
            assert_close(&want, &got, &format!("case {wi}x{hi} c {c} oc {oc}"));
            assert_ne!(want.data(), got.data(), "case {wi}x{hi}: Winograd's convolution did not run");
            // The second compute of one graph gives the same (the task queue rewinds).
            let mut r = Runner::new(backend.clone(), 2);
            r.options.cpu_winograd = true;
            let twice = r
                .compute_many(|g| {
                    let xt = g.input_f32(&x, &[wi, hi, c, n]);
                    let wt = g.input_bytes(wty, &[3, 3, c, oc], wbytes.clone());
                    let y = crate::graph::nn::conv_2d(g, xt, wt, None, (1, 1), (pad, pad), (1, 1), 1.0);
                    Ok(vec![y])
                })
                .unwrap();
            assert_eq!(twice[0].data(), got.data());
        }
    }

    /// The video convolution (3×3×KD kernels over [W, H, T, C], `nn::conv_3d`) against
    /// ggml's `ggml_conv_3d` composition: one and three taps, spatial padding 0 to 2, channels
    /// that fill no panel evenly, f16 and f32 kernels.
    #[test]
    fn video_winograd_matches_ggml_convolution() {
        if !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut rnd = uniform(11);
        // (w, h, t, kd, c, oc, padding, f16 kernel)
        let cases = [
            (19, 17, 4, 3, 24, 40, 1, true),
            (18, 16, 3, 3, 16, 16, 0, true),
            (21, 13, 5, 3, 40, 20, 2, false),
            (17, 16, 2, 1, 300, 18, 1, true),
            // A video VAE's last convolutions: RGB, and RGB in 2×2 patches.
            (18, 17, 3, 3, 32, 3, 1, true),
            (16, 18, 4, 3, 24, 12, 1, false),
            // Few input channels (LTX's last convolutions: 8 → 32, 4 → 48).
            (18, 17, 3, 3, 4, 48, 1, true),
            (20, 16, 4, 3, 8, 32, 1, false),
        ];
        for (wi, hi, t, kd, c, oc, pad, f16) in cases {
            let x: Vec<f32> = (0..wi * hi * t * c).map(|_| rnd()).collect();
            let wv: Vec<f32> = (0..9 * kd * c * oc).map(|_| rnd() * 0.2).collect();
            let bias: Vec<f32> = (0..oc).map(|_| rnd()).collect();
            let (wi, hi, t, kd, c, oc): (i64, i64, i64, i64, i64, i64) = (wi, hi, t, kd, c, oc);
            let wty = if f16 { F16 } else { F32 };
            let wbytes = kernel_bytes(&wv, f16);
            let (want, got) = both_ways(&backend, |g| {
                let xt = g.input_f32(&x, &[wi, hi, t, c]);
                let wt = g.input_bytes(wty, &[3, 3, kd, c * oc], wbytes.clone());
                let bt = g.input_f32(&bias, &[oc]);
                crate::graph::nn::conv_3d(g, xt, wt, Some(bt), c, [1; 3], [pad, pad, 0], [1; 3])
            });
            let side = |v: i64| (v + 2 * pad as i64 - 2) as usize;
            assert_eq!(want.shape(), &[side(wi), side(hi), (t + 1 - kd) as usize, oc as usize]);
            assert_close(&want, &got, &format!("case {wi}x{hi}x{t} kd {kd} c {c} oc {oc}"));
            // Winograd's rounding differs from ggml's sums: where its conditions hold, it ran.
            if side(wi) * side(hi) >= 256 {
                assert_ne!(want.data(), got.data(), "case {wi}x{hi}x{t}: Winograd's convolution did not run");
            }
            // The first frames given apart (a causal convolution's cache): the same bits.
            let plane = (wi * hi) as usize;
            let split = |range: std::ops::Range<i64>| -> Vec<f32> {
                (0..c as usize).flat_map(|ch| range.clone().flat_map(move |f| (ch * t as usize + f as usize) * plane..(ch * t as usize + f as usize + 1) * plane)).map(|i| x[i]).collect()
            };
            let (lead, rest) = (split(0..1), split(1..t));
            let mut r = Runner::new(backend.clone(), 3);
            r.options.cpu_winograd = true;
            let after = r
                .compute(|g| {
                    let bt = g.input_f32(&lead, &[wi, hi, 1, c]);
                    let xt = g.input_f32(&rest, &[wi, hi, t - 1, c]);
                    let wt = g.input_bytes(wty, &[3, 3, kd, c * oc], wbytes.clone());
                    Ok(crate::graph::nn::conv_3d_after(g, bt, xt, wt, Some(g.input_f32(&bias, &[oc])), c, [pad, pad, 0]))
                })
                .unwrap();
            assert!(after.data().iter().map(|v| v.to_bits()).eq(got.data().iter().map(|v| v.to_bits())), "frames given apart differ");
            // Zero frames in front (a causal first chunk), skipped: the padded copy's bits.
            for zeros in 1..kd as i32 {
                let conv = |skip: bool| {
                    let mut r = Runner::new(backend.clone(), 2);
                    r.options.cpu_winograd = true;
                    r.compute(|g| {
                        let xt = g.input_f32(&x, &[wi, hi, t, c]);
                        let wt = g.input_bytes(wty, &[3, 3, kd, c * oc], wbytes.clone());
                        let bt = Some(g.input_f32(&bias, &[oc]));
                        Ok(if skip {
                            crate::graph::nn::conv_3d_zero_front(g, zeros, xt, wt, bt, c, [pad, pad, 0])
                        } else {
                            crate::graph::nn::conv_3d(g, xt.pad_ext([0, 0, zeros, 0], [0; 4]), wt, bt, c, [1; 3], [pad, pad, 0], [1; 3])
                        })
                    })
                    .unwrap()
                };
                let (padded, skipped) = (conv(false), conv(true));
                assert_eq!(padded.shape(), skipped.shape());
                assert!(padded.data().iter().map(|v| v.to_bits()).eq(skipped.data().iter().map(|v| v.to_bits())), "{zeros} zero frames skipped differ");
            }
        }
    }

    /// A video [W, H, T, C], 3×3×3 kernels to `oc` channels (small values) and a bias, from
    /// `seed`; and the sequence, for more.
    fn video_case(seed: u64, [wi, hi, t, c, oc]: [i64; 5]) -> (Vec<f32>, Vec<f32>, Vec<f32>, impl FnMut() -> f32) {
        let mut rnd = uniform(seed);
        let x: Vec<f32> = (0..wi * hi * t * c).map(|_| rnd()).collect();
        let wv: Vec<f32> = (0..27 * c * oc).map(|_| rnd() * 0.2).collect();
        let bias: Vec<f32> = (0..oc).map(|_| rnd()).collect();
        (x, wv, bias, rnd)
    }

    /// A bias added in the output pass gives the bits of ggml's `add` after the convolution
    /// (images, video, and a bias that is a view into a larger tensor).
    #[test]
    fn bias_in_the_output_pass_is_the_separate_add() {
        if !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let backend = Arc::new(Backend::cpu().unwrap());
        let (wi, hi, t, c, oc) = (19i64, 17i64, 3i64, 16i64, 20i64);
        let (x, wv, bias, _) = video_case(9, [wi, hi, t, c, oc]);
        let wbytes = kernel_bytes(&wv, true);
        let mut r = Runner::new(backend, 2);
        r.options.cpu_winograd = true;
        let out = r
            .compute_many(|g| {
                let img = g.input_f32(&x[..(wi * hi * c) as usize], &[wi, hi, c, 1]);
                let w2 = g.input_bytes(F16, &[3, 3, c, oc], wbytes[..(18 * c * oc) as usize].to_vec());
                let vid = g.input_f32(&x, &[wi, hi, t, c]);
                let w3 = g.input_bytes(F16, &[3, 3, 3, c * oc], wbytes.clone());
                let b = g.input_f32(&bias, &[oc]);
                let b2 = g.input_f32(&[bias.clone(), bias.clone()].concat(), &[oc, 2]);
                let conv2 = |b| super::conv3x3(g, img, w2, b, (1, 1), (1, 1), (1, 1)).unwrap();
                let conv3 = |b| super::conv3x3_frames(g, vid, w3, b, c, (1, 1)).unwrap();
                Ok(vec![
                    conv2(Some(b)),
                    conv2(None).add(b.reshape(&[1, 1, oc, 1])),
                    conv3(Some(b)),
                    conv3(None).add(b.reshape(&[1, 1, 1, oc])),
                    // A row of a larger tensor as the bias (read through its own data pointer).
                    conv3(Some(b2.view(&[oc], &[], 0))),
                    conv3(None).add(b2.view(&[oc], &[], 0).reshape(&[1, 1, 1, oc])),
                ])
            })
            .unwrap();
        for (k, pair) in out.chunks(2).enumerate() {
            assert!(pair[0].data().iter().map(|v| v.to_bits()).eq(pair[1].data().iter().map(|v| v.to_bits())), "case {k}: the bias differs");
        }
    }

    /// A convolution past the kernel budget, run as one node pair per group of output
    /// channels written into its part of the output, gives the one node's bits: images and
    /// video (cached frames, zero frames, replicated borders), biases folded, ragged groups.
    #[test]
    fn output_channel_groups_give_the_whole_convolution() {
        if !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let backend = Arc::new(Backend::cpu().unwrap());
        let (wi, hi, t, c, oc) = (19i64, 17i64, 3i64, 16i64, 100i64);
        let (x, wv, bias, mut rnd) = video_case(13, [wi, hi, t, c, oc]);
        let lead: Vec<f32> = (0..wi * hi * 2 * c).map(|_| rnd()).collect();
        let wbytes = kernel_bytes(&wv, true);
        let run = |budget: Option<usize>| {
            super::TEST_BUDGET.with(|b| b.set(budget));
            let mut r = Runner::new(backend.clone(), 2);
            r.options.cpu_winograd = true;
            let out = r
                .compute_many(|g| {
                    let img = g.input_f32(&x[..(wi * hi * c) as usize], &[wi, hi, c, 1]);
                    let w2 = g.input_bytes(F16, &[3, 3, c, oc], wbytes[..(18 * c * oc) as usize].to_vec());
                    let vid = g.input_f32(&x, &[wi, hi, t, c]);
                    let before = g.input_f32(&lead, &[wi, hi, 2, c]);
                    let w3 = g.input_bytes(F16, &[3, 3, 3, c * oc], wbytes.clone());
                    let b = g.input_f32(&bias, &[oc]);
                    Ok(vec![
                        super::conv3x3(g, img, w2, Some(b), (1, 1), (1, 1), (1, 1)).unwrap(),
                        super::conv3x3(g, img, w2, None, (1, 1), (0, 2), (1, 1)).unwrap(),
                        super::conv3x3_frames(g, vid, w3, Some(b), c, (1, 1)).unwrap(),
                        super::conv3x3_frames_zero_front(g, 2, vid, w3, None, c, (2, 0)).unwrap(),
                        super::conv3x3_frames_after_replicated(g, Some(before), vid, w3, Some(b), c).unwrap(),
                    ])
                })
                .unwrap();
            super::TEST_BUDGET.with(|b| b.set(None));
            out
        };
        // Groups of 48 output channels (48, 48 and 4): 16 values per channel and output.
        let whole = run(None);
        let grouped = run(Some(48 * 16 * 4 * (3 * c as usize)));
        assert_eq!(super::channels_per_node(3 * c, oc), oc, "the default budget holds these");
        for (k, (a, b)) in whole.iter().zip(&grouped).enumerate() {
            assert_eq!(a.shape(), b.shape(), "case {k}");
            assert!(a.data().iter().map(|v| v.to_bits()).eq(b.data().iter().map(|v| v.to_bits())), "case {k}: the groups differ");
        }
        super::TEST_BUDGET.with(|b| b.set(Some(48 * 16 * 4 * (3 * c as usize))));
        assert_eq!(super::channels_per_node(3 * c, oc), 48);
        assert_eq!(super::channels_per_node(c, oc), 144.min(oc));
        super::TEST_BUDGET.with(|b| b.set(None));
    }

    /// Replicate padding read in place (HunyuanVideo's VAE) gives the bits of Winograd's
    /// convolution of the padded copy: inside and at every edge, tile rows whole and ragged.
    #[test]
    fn replicated_borders_read_in_place_match_a_padded_copy() {
        if !crate::graph::gemm::vector_kernels_available() {
            return;
        }
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut rnd = uniform(5);
        for (wi, hi, tb, tx, c, oc) in [(20i64, 18i64, 2i64, 3i64, 16i64, 8i64), (17, 19, 1, 2, 24, 3), (33, 16, 2, 1, 16, 20)] {
            let before: Vec<f32> = (0..wi * hi * tb * c).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..wi * hi * tx * c).map(|_| rnd()).collect();
            let wv: Vec<f32> = (0..27 * c * oc).map(|_| rnd() * 0.2).collect();
            let bias: Vec<f32> = (0..oc).map(|_| rnd()).collect();
            let wbytes = kernel_bytes(&wv, true);
            let conv = |in_place: bool| {
                let mut r = Runner::new(backend.clone(), 2);
                r.options.cpu_winograd = true;
                r.compute(|g| {
                    let bt = g.input_f32(&before, &[wi, hi, tb, c]);
                    let xt = g.input_f32(&x, &[wi, hi, tx, c]);
                    let wt = g.input_bytes(F16, &[3, 3, 3, c * oc], wbytes.clone());
                    let b = Some(g.input_f32(&bias, &[oc]));
                    if in_place {
                        return Ok(crate::graph::nn::conv_3d_after_replicated(g, bt, xt, wt, b, c).expect("Winograd takes it"));
                    }
                    // The padded copy: edges repeated along x, then along y.
                    let joined = bt.concat(xt, 2);
                    fn edge(t: crate::graph::context::T<'_>, dim: usize, at: i64) -> crate::graph::context::T<'_> {
                        let mut ne = t.ne();
                        ne[dim] = 1;
                        let nb = t.nb();
                        t.view(&ne, &[nb[1], nb[2], nb[3]], nb[dim] * at as usize).cont()
                    }
                    let padx = edge(joined, 0, 0).concat(joined, 0).concat(edge(joined, 0, wi - 1), 0);
                    let pady = edge(padx, 1, 0).concat(padx, 1).concat(edge(padx, 1, hi - 1), 1);
                    Ok(crate::graph::nn::conv_3d(g, pady, wt, b, c, [1; 3], [0; 3], [1; 3]))
                })
                .unwrap()
            };
            let (copy, in_place) = (conv(false), conv(true));
            assert_eq!(copy.shape(), &[wi as usize, hi as usize, (tb + tx - 2) as usize, oc as usize]);
            assert_eq!(copy.shape(), in_place.shape());
            assert!(copy.data().iter().map(|v| v.to_bits()).eq(in_place.data().iter().map(|v| v.to_bits())), "{wi}x{hi}: in place differs from the padded copy");
        }
    }
}

#[cfg(test)]
mod bench {
    use crate::graph::backend::Backend;
    use crate::graph::context::F16;
    use crate::graph::runner::Runner;
    use std::sync::Arc;

    /// `cargo test --release --lib winograd_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn winograd_speed() {
        let backend = Arc::new(Backend::cpu().unwrap());
        for (wi, c, oc) in [(128i64, 512i64, 512i64), (64, 320, 320), (256, 256, 256), (16, 1280, 1280)] {
            let x: Vec<f32> = (0..wi * wi * c).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            let wb: Vec<u8> = (0..9 * c * oc).flat_map(|i| crate::graph::gemm::scalar::f32_to_f16(((i * 5 % 11) as f32 - 5.0) * 0.01).to_le_bytes()).collect();
            for wino in [false, true] {
                let mut r = Runner::new(backend.clone(), 1);
                r.options.cpu_winograd = wino;
                let mut best = f64::MAX;
                for _ in 0..2 {
                    let t = std::time::Instant::now();
                    r.compute(|g| {
                        let xt = g.input_f32(&x, &[wi, wi, c, 1]);
                        let wt = g.input_bytes(F16, &[3, 3, c, oc], wb.clone());
                        Ok(crate::graph::nn::conv_2d(g, xt, wt, None, (1, 1), (1, 1), (1, 1), 1.0))
                    })
                    .unwrap();
                    best = best.min(t.elapsed().as_secs_f64());
                }
                let flop = 2.0 * (9 * c * oc * wi * wi) as f64;
                println!("{wi}x{wi} c {c} oc {oc} winograd {wino}: {:.0} ms, {:.1} effective GFLOP/s", best * 1e3, flop / best / 1e9);
            }
        }
    }
}
