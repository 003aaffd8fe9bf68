//! Layers shared by every network: they declare their weights with the reference's types
//! and build the reference's op sequence, so pictures match it.

use super::adapter::LayerOp;
use super::context::{GgmlType, Graph, F16, F32, I8, T, W};
use super::params::Scope;
use ggml_sys as g;

fn blck_size(ty: GgmlType) -> i64 {
    // SAFETY: pure lookup.
    unsafe { g::ggml_blck_size(ty) }
}

/// `x * s` after making `x` dense where ggml's scale needs it.
pub fn scale<'g>(x: T<'g>, s: f32, inplace: bool) -> T<'g> {
    let nb = x.nb();
    let ne = x.ne();
    // SAFETY: pure lookup.
    let ts = unsafe { g::ggml_type_size(x.ty()) };
    let padded_1d = nb[0] == ts && nb[2] == nb[1] * ne[1] as usize && nb[3] == nb[2] * ne[2] as usize;
    let x = if padded_1d { x } else { x.cont() };
    if inplace {
        x.scale_inplace(s)
    } else {
        x.scale(s)
    }
}

/// `w @ x + b` (torch Linear). Batches over dims 2×3 beyond 1024 are flattened first.
pub fn linear<'g>(g: &'g Graph, x: T<'g>, w: T<'g>, b: Option<T<'g>>, force_prec_f32: bool, scale_by: f32) -> T<'g> {
    let mut x = x;
    if scale_by != 1.0 {
        x = scale(x, scale_by, false);
    }
    let ne = x.ne();
    let mm = |w: T<'g>, x: T<'g>| super::matmul::mul_mat(g, w, x, force_prec_f32);
    if ne[2] * ne[3] > 1024 {
        let flat = x.reshape(&[ne[0], ne[1] * ne[2] * ne[3]]);
        let y = mm(w, flat);
        let yne = y.ne();
        x = y.reshape(&[yne[0], yne[1] / ne[2] / ne[3], ne[2], ne[3]]);
    } else {
        x = mm(w, x);
    }
    if scale_by != 1.0 {
        x = scale(x, 1.0 / scale_by, false);
    }
    match b {
        Some(b) => x.add_inplace(b),
        None => x,
    }
}

/// Fully connected layer.
#[derive(Clone, Copy, Debug)]
pub struct Linear {
    pub weight: W,
    pub bias: Option<W>,
    pub force_prec_f32: bool,
    pub scale: f32,
    /// A ComfyUI `int8_tensorwise` weight: its row scales and ConvRot group.
    pub int8: Option<(W, u32)>,
}

impl Linear {
    /// Weight in the file's type (f32 when absent, forced, or rows don't fit its blocks).
    pub fn new(s: &mut Scope, name: &str, in_f: i64, out_f: i64, bias: bool) -> Linear {
        Self::with_options(s, name, in_f, out_f, bias, false)
    }

    /// A ComfyUI `int8_tensorwise` weight keeps its I8 rows whatever is asked (the reference
    /// asserts on a forced type).
    pub fn with_options(s: &mut Scope, name: &str, in_f: i64, out_f: i64, bias: bool, force_f32: bool) -> Linear {
        let mut s = s.sub(name);
        let mut ty = s.file_type("weight").unwrap_or(F32);
        let int8 = if ty == I8 { s.int8_scale("weight", out_f) } else { None };
        if int8.is_none() && (force_f32 || in_f % blck_size(ty) != 0 || ty == I8) {
            ty = F32;
        }
        let weight = s.tensor("weight", ty, &[in_f, out_f]);
        let bias = bias.then(|| s.tensor("bias", F32, &[out_f]));
        Linear { weight, bias, force_prec_f32: false, scale: 1.0, int8 }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let adapter = g.adapter_for(&[Some(self.weight), self.bias]);
        let op = LayerOp::Linear { force_prec_f32: self.force_prec_f32, scale: self.scale };
        if let Some((row_scales, group)) = self.int8 {
            let x = if x.ty() == F32 { x } else { x.cast(F32) };
            let x = if x.is_contiguous() { x } else { x.cont() };
            let b = self.bias.map(|b| adapter.map_or(g.param(b), |a| a.patch(g, b, g.param(b), false)));
            let out = super::int8::linear(g, x, g.param(self.weight), g.param(row_scales), b, group, self.scale);
            return adapter.map_or(out, |a| a.add_to_unpatched_output(g, self.weight, x, out, op));
        }
        let Some(a) = adapter else {
            return linear(g, x, g.param(self.weight), g.opt_param(self.bias), self.force_prec_f32, self.scale);
        };
        let w = a.patch(g, self.weight, g.param(self.weight), false);
        let b = self.bias.map(|b| a.patch(g, b, g.param(b), false));
        let out = linear(g, x, w, b, self.force_prec_f32, self.scale);
        a.add_to_output(g, self.weight, x, out, op)
    }

    /// Output features `rows` alone, through row views of the weight and bias: each output
    /// is the same product as in [`Linear::forward`], so a caller may split a wide layer's
    /// outputs (or its tokens) to keep fewer of them alive at once. `None` where the layer
    /// needs its whole weight (an adapter's update, int8 row scales).
    pub fn forward_rows<'g>(&self, g: &'g Graph, x: T<'g>, rows: std::ops::Range<i64>) -> Option<T<'g>> {
        if self.int8.is_some() || g.adapter_for(&[Some(self.weight), self.bias]).is_some() {
            return None;
        }
        let n = rows.end - rows.start;
        let w = g.param(self.weight);
        let nb1 = w.nb()[1];
        let w = w.view(&[w.ne()[0], n], &[nb1], rows.start as usize * nb1);
        let b = self.bias.map(|b| {
            let b = g.param(b);
            b.view(&[n], &[], rows.start as usize * b.nb()[0])
        });
        Some(linear(g, x, w, b, self.force_prec_f32, self.scale))
    }
}

/// 2-D convolution; weights are always f16 like the reference's (im2col runs in f16).
#[derive(Clone, Copy, Debug)]
pub struct Conv2d {
    pub weight: W,
    pub bias: Option<W>,
    pub stride: (i32, i32),
    pub padding: (i32, i32),
    pub dilation: (i32, i32),
    pub scale: f32,
}

impl Conv2d {
    /// `kernel`, `stride`, `padding` as (height, width) like torch.
    pub fn new(
        s: &mut Scope,
        name: &str,
        in_ch: i64,
        out_ch: i64,
        kernel: (i64, i64),
        stride: (i32, i32),
        padding: (i32, i32),
        bias: bool,
    ) -> Conv2d {
        let mut s = s.sub(name);
        let weight = s.tensor("weight", F16, &[kernel.1, kernel.0, in_ch, out_ch]);
        let bias = bias.then(|| s.tensor("bias", F32, &[out_ch]));
        Conv2d { weight, bias, stride, padding, dilation: (1, 1), scale: 1.0 }
    }

    /// Square kernel shorthand: `k`×`k`, stride `st`, padding `p`.
    pub fn square(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, k: i64, st: i32, p: i32) -> Conv2d {
        Self::new(s, name, in_ch, out_ch, (k, k), (st, st), (p, p), true)
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let (stride, padding, dilation) =
            ((self.stride.1, self.stride.0), (self.padding.1, self.padding.0), (self.dilation.1, self.dilation.0));
        let Some(a) = g.adapter_for(&[Some(self.weight), self.bias]) else {
            return conv_2d(g, x, g.param(self.weight), g.opt_param(self.bias), stride, padding, dilation, self.scale);
        };
        let w = a.patch(g, self.weight, g.param(self.weight), false);
        let b = self.bias.map(|b| a.patch(g, b, g.param(b), false));
        let out = conv_2d(g, x, w, b, stride, padding, dilation, self.scale);
        a.add_to_output(g, self.weight, x, out, LayerOp::Conv2d { stride, padding, dilation, scale: self.scale })
    }

    /// The convolution of every frame of a video `x` [W, H, T, IC] → [OW, OH, T, OC] in
    /// place in that layout (no frames moved behind the channels and back), where the graph
    /// takes Winograd's sums for it: a 3×3 kernel is a 3×3×1 video kernel in the same bytes.
    /// The values are [`Conv2d::forward`]'s on the permuted frames bit for bit. None otherwise.
    pub fn forward_frames<'g>(&self, g: &'g Graph, x: T<'g>) -> Option<T<'g>> {
        let plain = self.stride == (1, 1) && self.dilation == (1, 1) && self.scale == 1.0 && !g.options.circular_x && !g.options.circular_y;
        if !plain || g.adapter_for(&[Some(self.weight), self.bias]).is_some() {
            return None;
        }
        let w = g.param(self.weight);
        let [kw, kh, ic, oc] = w.ne();
        super::winograd::conv3x3_frames(g, x, w.reshape(&[kw, kh, 1, ic * oc]), g.opt_param(self.bias), ic, (self.padding.1, self.padding.0))
    }
}

/// Above this size an im2col matrix is not materialised on the CPU: the direct convolution
/// builds it in small pieces instead. Its values and dot products are the same, so the
/// result is bit-identical, while the VAE's full-resolution layers need ~1 GB less.
pub(crate) const CPU_IM2COL_LIMIT: usize = 128 << 20;

/// On the CPU, the im2col matrix of an f16/f32 kernel by our faster op (same values).
fn cpu_im2col<'g>(g: &'g Graph, w: T<'g>, x: T<'g>, stride: (i32, i32), padding: (i32, i32), dilation: (i32, i32)) -> Option<T<'g>> {
    if !g.on_cpu || !g.options.cpu_fast_im2col || (w.ty() != F16 && w.ty() != F32) {
        return None;
    }
    super::im2col::im2col_f16(g, w.ne(), x, stride, padding, dilation, None)
}

/// ggml_conv_2d's composition around an im2col matrix `[K, OW, OH, N]`: the same matrix
/// product, giving `[OW, OH, OC, N]`.
fn product_with_kernel<'g>(g: &'g Graph, cols: T<'g>, w: T<'g>) -> T<'g> {
    let [kw, kh, ic, oc] = w.ne();
    let [k, ow, oh, n] = cols.ne();
    let y = super::matmul::mul_mat(g, cols.reshape(&[k, ow * oh * n]), w.reshape(&[kw * kh * ic, oc]), false);
    y.reshape(&[ow, oh, n, oc]).permute(0, 1, 3, 2).cont()
}

/// Size of the im2col matrix of one band of a banded convolution.
const BAND_IM2COL_BYTES: usize = 32 << 20;

/// A convolution whose im2col matrix is too large, as bands of output rows each within
/// `cpu_im2col_limit`, written into one output: every element is the same dot product.
/// (With the tiled GEMM kernels, a band whose pixel count is a multiple of 4 while the whole
/// image's is not takes the tiled path: last-bit differences, as with any float weights.)
fn conv_in_bands<'g>(g: &'g Graph, w: T<'g>, x: T<'g>, stride: (i32, i32), padding: (i32, i32), dilation: (i32, i32)) -> Option<T<'g>> {
    if !g.options.cpu_fast_im2col || (w.ty() != F16 && w.ty() != F32) {
        return None;
    }
    let [kw, kh, ic, oc] = w.ne();
    let n = x.ne()[3];
    let (ow, oh) = super::im2col::output_size(x.ne(), w.ne(), stride, padding, dilation);
    let row_bytes = (ow * n * kw * kh * ic).max(1) as usize * 2;
    let band = ((g.options.cpu_im2col_limit.min(BAND_IM2COL_BYTES) / row_bytes) as i64).clamp(1, oh.max(1));
    let first = super::im2col::im2col_f16(g, w.ne(), x, stride, padding, dilation, Some((0, band)))?;
    // The output grows out of the first band (zero rows appended), so it is allocated only
    // when the convolution runs, not for the whole graph like a fresh tensor would be.
    let mut acc = product_with_kernel(g, first, w).pad(0, (oh - band) as i32, 0, 0);
    let nb = acc.nb();
    debug_assert_eq!(acc.ne(), [ow, oh, oc, n]);
    let mut y0 = band;
    while y0 < oh {
        let rows = band.min(oh - y0);
        let cols = super::im2col::im2col_f16(g, w.ne(), x, stride, padding, dilation, Some((y0, rows)))?;
        acc = acc.set_inplace(product_with_kernel(g, cols, w), nb[1], nb[2], nb[3], y0 as usize * nb[1]);
        y0 += rows;
    }
    Some(acc)
}

/// Bytes of the im2col matrix `ggml_conv_2d` would build for kernel `w` over `x`.
fn im2col_bytes(w: T<'_>, x: T<'_>, stride: (i32, i32), padding: (i32, i32), dilation: (i32, i32)) -> usize {
    let [kw, kh, ic, _] = w.ne();
    let n = x.ne()[3];
    let (ow, oh) = super::im2col::output_size(x.ne(), w.ne(), stride, padding, dilation);
    let (ow, oh) = (ow.max(0), oh.max(0));
    let elem = if w.ty() == F32 { 4 } else { 2 };
    (ow * oh * n * kw * kh * ic) as usize * elem
}

/// Convolution with (x, y)-ordered stride/padding/dilation, honouring the graph's
/// circular-padding and direct-convolution options.
#[allow(clippy::too_many_arguments)]
pub fn conv_2d<'g>(
    g: &'g Graph,
    x: T<'g>,
    w: T<'g>,
    b: Option<T<'g>>,
    stride: (i32, i32),
    padding: (i32, i32),
    dilation: (i32, i32),
    scale_by: f32,
) -> T<'g> {
    let mut x = x;
    let mut w = w;
    if scale_by != 1.0 {
        x = scale(x, scale_by, false);
    }
    if w.ne()[2] != x.ne()[2] && w.n_dims() == 2 {
        let wn = w.ne();
        w = w.reshape(&[1, 1, wn[0], wn[1]]);
    }
    let (mut p0, mut p1) = padding;
    if (p0 != 0 || p1 != 0) && (g.options.circular_x || g.options.circular_y) {
        x = pad_circular(g, x, [p0, p1, 0, 0], [p0, p1, 0, 0]);
        p0 = 0;
        p1 = 0;
    }
    let big = g.on_cpu && im2col_bytes(w, x, stride, (p0, p1), dilation) > g.options.cpu_im2col_limit;
    let direct = |x: T<'g>| w.conv_2d_direct(x, stride.0, stride.1, p0, p1, dilation.0, dilation.1);
    // Winograd's op adds the bias itself (in its output pass), unless the output is scaled
    // back first.
    let mut b = b;
    x = if g.options.conv_direct {
        direct(x)
    } else if let Some(y) = super::winograd::conv3x3(g, x, w, b.filter(|_| scale_by == 1.0), stride, (p0, p1), dilation) {
        if scale_by == 1.0 {
            b = None;
        }
        y
    } else if big {
        conv_in_bands(g, w, x, stride, (p0, p1), dilation).unwrap_or_else(|| direct(x))
    } else if let Some(cols) = cpu_im2col(g, w, x, stride, (p0, p1), dilation) {
        product_with_kernel(g, cols, w)
    } else {
        w.conv_2d(x, stride.0, stride.1, p0, p1, dilation.0, dilation.1)
    };
    if scale_by != 1.0 {
        x = scale(x, 1.0 / scale_by, false);
    }
    match b {
        Some(b) => {
            let c = b.ne()[0];
            x.add_inplace(b.reshape(&[1, 1, c, 1]))
        }
        None => x,
    }
}

/// 3-D convolution as `ggml_conv_3d` composes it (im2col, then one matrix product with the
/// kernel): kernel `w` [KW, KH, KD, OC·IC] (f16) over `x` [W, H, D, N·IC] →
/// [OW, OH, OD, N·OC], plus the bias `b` [OC]. Strides, paddings and dilations in (w, h, d)
/// order. (The causal video convolutions pad `x` in time themselves.) On the CPU an im2col
/// matrix beyond `cpu_im2col_limit` is built and multiplied in bands of output rows written
/// into one output: every element is the same dot product. Where the graph takes Winograd's
/// convolutions (decoders), 3×3×KD kernels with stride 1 and no time padding go through
/// `winograd::conv3x3_frames` instead: no im2col matrix, 16 products per 2×2 outputs
/// instead of 36.
#[allow(clippy::too_many_arguments)]
pub fn conv_3d<'g>(g: &'g Graph, x: T<'g>, w: T<'g>, b: Option<T<'g>>, ic: i64, stride: [i32; 3], padding: [i32; 3], dilation: [i32; 3]) -> T<'g> {
    let bias = |y: T<'g>| add_channel_bias(y, b);
    if stride == [1; 3] && dilation == [1; 3] && padding[2] == 0 {
        if let Some(y) = super::winograd::conv3x3_frames(g, x, w, b, ic, (padding[0], padding[1])) {
            return y;
        }
    }
    // Bands of output rows need the rows' padding in the input.
    let (x, padding) = if g.on_cpu && padding[1] != 0 && padding.iter().all(|&p| p >= 0) {
        let [p0, p1, p2] = padding;
        (x.pad_ext([p0, p1, p2, 0], [p0, p1, p2, 0]), [0; 3])
    } else {
        (x, padding)
    };
    let col_ty = if w.ty() == g::GGML_TYPE_BF16 { F32 } else { F16 };
    let product = |x: T<'g>| {
        let cols = w.im2col_3d(x, ic, stride, padding, dilation, col_ty);
        let [k, ow, oh, odn] = cols.ne();
        let oc = w.ne()[3] / ic;
        let n = x.ne()[3] / ic;
        let od = odn / n;
        let y = super::matmul::mul_mat(g, cols.reshape(&[k, ow * oh * odn]), w.reshape(&[k, oc]), false);
        y.reshape(&[ow * oh, od, n, oc]).permute(0, 1, 3, 2).cont().reshape(&[ow, oh, od, oc * n])
    };
    let [kw, kh, kd, _] = w.ne();
    let out_len = |len: i64, k: i64, i: usize| (len + 2 * padding[i] as i64 - dilation[i] as i64 * (k - 1) - 1) / stride[i] as i64 + 1;
    let (ow, oh, od) = (out_len(x.ne()[0], kw, 0), out_len(x.ne()[1], kh, 1), out_len(x.ne()[2], kd, 2));
    let n = x.ne()[3] / ic;
    let row_bytes = (kw * kh * kd * ic * ow * od * n).max(1) as usize * 2;
    let y = if g.on_cpu && padding[1] == 0 && oh > 1 && row_bytes * oh as usize > g.options.cpu_im2col_limit {
        let band = ((g.options.cpu_im2col_limit.min(BAND_IM2COL_BYTES) / row_bytes) as i64).clamp(1, oh);
        let (s1, d1) = (stride[1] as i64, dilation[1] as i64);
        let rows = |y0: i64, len: i64| {
            let nb = x.nb();
            let [xw, _, xd, xc] = x.ne();
            let in_rows = (len - 1) * s1 + (kh - 1) * d1 + 1;
            product(x.view(&[xw, in_rows, xd, xc], &[nb[1], nb[2], nb[3]], (y0 * s1) as usize * nb[1]))
        };
        // The output grows out of the first band, like the banded 2-D convolution's.
        let mut acc = rows(0, band).pad(0, (oh - band) as i32, 0, 0);
        let nb = acc.nb();
        let mut y0 = band;
        while y0 < oh {
            let len = band.min(oh - y0);
            acc = acc.set_inplace(rows(y0, len), nb[1], nb[2], nb[3], y0 as usize * nb[1]);
            y0 += len;
        }
        acc
    } else {
        product(x)
    };
    bias(y)
}

/// [`conv_3d`] with stride and dilation 1 and no time padding over the frames of `before`
/// (a causal convolution's cached frames, [W, H, T', IC]) followed by those of `x`: where
/// Winograd takes it, both are read where they are instead of joined into a copy first.
#[allow(clippy::too_many_arguments)]
pub fn conv_3d_after<'g>(g: &'g Graph, before: T<'g>, x: T<'g>, w: T<'g>, b: Option<T<'g>>, ic: i64, padding: [i32; 3]) -> T<'g> {
    if padding[2] == 0 {
        if let Some(y) = super::winograd::conv3x3_frames_after(g, Some(before), x, w, b, ic, (padding[0], padding[1])) {
            return y;
        }
    }
    conv_3d(g, before.concat(x, 2), w, b, ic, [1; 3], padding, [1; 3])
}

/// A 3×3×3 convolution (stride 1, no time padding) over the frames of `before` then those of
/// `x`, with one pixel of replicate padding all round in space, read in place where
/// Winograd's convolution takes it (the padded copies' values, bit for bit); None elsewhere:
/// the caller pads copies.
pub fn conv_3d_after_replicated<'g>(g: &'g Graph, before: T<'g>, x: T<'g>, w: T<'g>, b: Option<T<'g>>, ic: i64) -> Option<T<'g>> {
    super::winograd::conv3x3_frames_after_replicated(g, Some(before), x, w, b, ic)
}

/// `conv_3d` (stride 1, zero spatial padding) of `x` after `zeros` zero frames: a causal
/// convolution's first chunk. Where Winograd's convolution takes it, without the padded
/// copy and the zero frames' products (the same values: adding zeros changes no sum).
pub fn conv_3d_zero_front<'g>(g: &'g Graph, zeros: i32, x: T<'g>, w: T<'g>, b: Option<T<'g>>, ic: i64, padding: [i32; 3]) -> T<'g> {
    if padding[2] == 0 {
        if let Some(y) = super::winograd::conv3x3_frames_zero_front(g, zeros as i64, x, w, b, ic, (padding[0], padding[1])) {
            return y;
        }
    }
    let x = if zeros > 0 { x.pad_ext([0, 0, zeros, 0], [0; 4]) } else { x };
    conv_3d(g, x, w, b, ic, [1; 3], padding, [1; 3])
}

/// `y` [W, H, T, C] plus a bias per channel `b` [C] (none: `y`).
fn add_channel_bias<'g>(y: T<'g>, b: Option<T<'g>>) -> T<'g> {
    match b {
        Some(b) => y.add_inplace(b.reshape(&[1, 1, 1, b.ne()[0]])),
        None => y,
    }
}

/// RMS normalisation of `x` [W, H, T, C] over its channels times `gamma` [C], without
/// moving the channels innermost, where the graph runs on the CPU (`graph::channel_norm`:
/// ggml's values bit for bit); None otherwise.
pub fn rms_norm_channels<'g>(g: &'g Graph, x: T<'g>, gamma: T<'g>, eps: f32) -> Option<T<'g>> {
    super::channel_norm::rms_norm_channels(g, x, gamma, eps)
}

/// Padding that wraps around on the graph's circular axes and is zero elsewhere.
pub fn pad_circular<'g>(g: &'g Graph, x: T<'g>, l: [i32; 4], r: [i32; 4]) -> T<'g> {
    let (mut l, mut r) = (l, r);
    let mut x = x;
    if g.options.circular_x && g.options.circular_y {
        return x.pad_ext_circular(l, r);
    }
    if g.options.circular_x && (l[0] != 0 || r[0] != 0) {
        x = x.pad_ext_circular([l[0], 0, 0, 0], [r[0], 0, 0, 0]);
        l[0] = 0;
        r[0] = 0;
    }
    if g.options.circular_y && (l[1] != 0 || r[1] != 0) {
        x = x.pad_ext_circular([0, l[1], 0, 0], [0, r[1], 0, 0]);
        l[1] = 0;
        r[1] = 0;
    }
    if l.iter().chain(r.iter()).any(|&p| p != 0) {
        x = x.pad_ext(l, r);
    }
    x
}

/// Layer normalisation over dim 0 with f32 affine weights.
#[derive(Clone, Copy, Debug)]
pub struct LayerNorm {
    pub weight: Option<W>,
    pub bias: Option<W>,
    pub eps: f32,
}

impl LayerNorm {
    pub fn new(s: &mut Scope, name: &str, dim: i64, eps: f32, affine: bool, bias: bool) -> LayerNorm {
        let mut s = s.sub(name);
        let weight = affine.then(|| s.tensor("weight", F32, &[dim]));
        let bias = (affine && bias).then(|| s.tensor("bias", F32, &[dim]));
        LayerNorm { weight, bias, eps }
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut x = x.norm(self.eps);
        if let Some(w) = self.weight {
            x = x.mul_inplace(g.adapted_param(w));
            if let Some(b) = self.bias {
                x = x.add_inplace(g.adapted_param(b));
            }
        }
        x
    }
}

/// Group normalisation over channels (dim 2); eps 1e-6 (the reference's VAEs) unless set.
#[derive(Clone, Copy, Debug)]
pub struct GroupNorm {
    pub weight: Option<W>,
    pub bias: Option<W>,
    pub groups: i32,
    pub eps: f32,
}

pub const GROUP_NORM_EPS: f32 = 1e-6;

impl GroupNorm {
    pub fn new(s: &mut Scope, name: &str, groups: i32, channels: i64, affine: bool) -> GroupNorm {
        let mut s = s.sub(name);
        let weight = affine.then(|| s.tensor("weight", F32, &[channels]));
        let bias = affine.then(|| s.tensor("bias", F32, &[channels]));
        GroupNorm { weight, bias, groups, eps: GROUP_NORM_EPS }
    }

    /// The same with another epsilon (torch's default 1e-5 where a model keeps it).
    pub fn with_eps(self, eps: f32) -> GroupNorm {
        GroupNorm { eps, ..self }
    }

    /// 32 groups, the Stable Diffusion default.
    pub fn gn32(s: &mut Scope, name: &str, channels: i64) -> GroupNorm {
        Self::new(s, name, 32, channels, true)
    }

    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let mut w = self.weight.map(|w| g.adapted_param(w));
        let mut b = self.bias.map(|b| g.adapted_param(b));
        if x.n_dims() >= 3 {
            if let (Some(wt), Some(bt)) = (w, b) {
                w = Some(wt.reshape(&[1, 1, wt.ne()[0], 1]));
                b = Some(bt.reshape(&[1, 1, bt.ne()[0], 1]));
            }
        }
        let mut x = x.group_norm(self.groups, self.eps);
        if let (Some(w), Some(b)) = (w, b) {
            x = x.mul_inplace(w).add_inplace(b);
        }
        x
    }
}

/// Token embedding table (row lookups). Kept in the file's type when ggml can get_rows it.
#[derive(Clone, Copy, Debug)]
pub struct Embedding {
    pub weight: W,
}

pub fn supports_get_rows(ty: GgmlType) -> bool {
    matches!(
        ty,
        g::GGML_TYPE_F16 | g::GGML_TYPE_Q8_0 | g::GGML_TYPE_Q5_1 | g::GGML_TYPE_Q5_0 | g::GGML_TYPE_Q4_1 | g::GGML_TYPE_Q4_0
    )
}

impl Embedding {
    pub fn new(s: &mut Scope, name: &str, num: i64, dim: i64) -> Embedding {
        let mut s = s.sub(name);
        let mut ty = s.file_type("weight").unwrap_or(F32);
        if !supports_get_rows(ty) {
            ty = F32;
        }
        Embedding { weight: s.tensor("weight", ty, &[dim, num]) }
    }

    /// ids: i32 [n_token, N] → [dim, n_token, N].
    pub fn forward<'g>(&self, g: &'g Graph, ids: T<'g>) -> T<'g> {
        embedding_lookup(g.param(self.weight), ids)
    }
}

/// Row lookup of `ids` (i32 [n_token, N]) in `table` [dim, rows] → [dim, n_token, N].
pub fn embedding_lookup<'g>(table: T<'g>, ids: T<'g>) -> T<'g> {
    let ne = ids.ne();
    let n = ne[1];
    let ids = ids.reshape(&[ne[0] * ne[1]]).reshape(&[ne[0] * ne[1], 1, 1]);
    let e = table.get_rows(ids);
    let en = e.ne();
    e.reshape(&[en[0], en[1] / n, n])
}

/// Bound on the f32 attention scores materialised at once on the CPU (the UNet at 512²
/// would otherwise hold 8 heads × 4096² scores = 512 MiB).
pub(crate) const CPU_SCORES_LIMIT: usize = 64 << 20;

/// How many query rows of scores fit in `limit` bytes (at least one).
fn score_rows_per_chunk(l_q: i64, l_k: i64, heads: i64, limit: usize) -> i64 {
    let per_row = (l_k * heads).max(1) as usize * 4;
    ((limit / per_row) as i64).clamp(1, l_q.max(1))
}

/// `[3C, L, N]` → three contiguous `[C, L, N]` views (q, k, v in that order), like the
/// reference's `split_qkv`.
pub fn split_qkv(qkv: T<'_>) -> (T<'_>, T<'_>, T<'_>) {
    let ne = qkv.ne();
    let qkv = qkv.reshape(&[ne[0] / 3, 3, ne[1], ne[2]]).permute(0, 3, 1, 2).cont();
    let ne = qkv.ne();
    let nb = qkv.nb();
    let part = |i: usize| qkv.view(&ne[..3], &nb[1..3], nb[2] * ne[2] as usize * i);
    (part(0), part(1), part(2))
}

/// Multi-head attention like the reference's.
///
/// Without `skip_reshape`: q [C, L_q, N], k/v [C_kv, L_k, N] → [C, L_q, N].
/// `mask` is added to the scores ([L_k, L_q, ...]). With `flash` the fused kernel is used
/// when possible (K/V in f16, f32 precision), otherwise scores are materialised.
#[allow(clippy::too_many_arguments)]
pub fn attention<'g>(
    g: &'g Graph,
    q: T<'g>,
    k: T<'g>,
    v: T<'g>,
    n_head: i64,
    mask: Option<T<'g>>,
    skip_reshape: bool,
    flash: bool,
    kv_scale: f32,
) -> T<'g> {
    let (mut q, mut k, mut v) = (q, k, v);
    let (l_q, l_k, d_head, n, n_kv_head);
    if !skip_reshape {
        let qn = q.ne();
        l_q = qn[1];
        l_k = k.ne()[1];
        let c = qn[0];
        n = qn[2];
        d_head = c / n_head;
        n_kv_head = k.ne()[0] / d_head;
        q = q.reshape(&[d_head, n_head, l_q, n]).permute(0, 2, 1, 3).contiguous().reshape(&[d_head, l_q, n_head * n]);
        k = k
            .reshape(&[d_head, n_kv_head, l_k, n])
            .permute(0, 2, 1, 3)
            .contiguous()
            .reshape(&[d_head, l_k, n_kv_head * n]);
        v = v.reshape(&[d_head, n_kv_head, l_k, n]);
    } else {
        l_q = q.ne()[1];
        l_k = k.ne()[1];
        d_head = v.ne()[0];
        n = v.ne()[3];
        n_kv_head = k.ne()[2] / n;
    }
    let sc = 1.0 / (d_head as f32).sqrt();

    let mut kqv = None;
    if flash && mask.map_or(true, |m| m.ne()[3] == 1) {
        let mut kf = k;
        if kv_scale != 1.0 {
            kf = scale(kf, kv_scale, false);
        }
        let kf = kf.cast(F16);
        let mut vf = v.permute(0, 2, 1, 3).contiguous().reshape(&[d_head, l_k, n_kv_head * n]);
        if kv_scale != 1.0 {
            vf = scale(vf, kv_scale, false);
        }
        let vf = vf.cast(F16);
        let m = mask.map(|m| {
            let mn = m.ne();
            let m = if mn[1] != l_q { m.repeat(g.new_tensor(m.ty(), &[mn[0], l_q, mn[2], mn[3]])) } else { m };
            m.cast(F16)
        });
        // Our op gives ggml's values faster where it runs (`flash`).
        let ours = super::flash::flash_attn(g, q, kf, vf, m, sc / kv_scale);
        let mut out = ours.unwrap_or_else(|| q.flash_attn_ext(kf, vf, m, sc / kv_scale));
        // Backends without the fused kernel fall back to materialised scores below.
        if g.supports(out) {
            if kv_scale != 1.0 {
                out = scale(out, 1.0 / kv_scale, false);
            }
            let nb = out.nb();
            kqv = Some(out.view(&[d_head, n_head, l_q, n], &[nb[1], nb[2], nb[1] * n_head as usize], 0));
        }
    }
    let kqv = match kqv {
        Some(x) => x,
        None => {
            let v = v.permute(1, 2, 0, 3).contiguous().reshape(&[l_k, d_head, n_kv_head * n]);
            let scores = |q: T<'g>| {
                let mut kq = super::matmul::mul_mat(g, k, q, true);
                kq = kq.scale_inplace(sc);
                if let Some(m) = mask {
                    kq = kq.add_inplace(m);
                }
                super::matmul::mul_mat(g, v, kq.soft_max_inplace(), false)
            };
            let rows = score_rows_per_chunk(l_q, l_k, n_head * n, g.options.cpu_scores_limit);
            let out = if g.on_cpu && mask.is_none() && rows < l_q {
                // Query rows are independent: computing them in chunks gives the same
                // numbers while only one chunk's scores exist at a time.
                let qn = q.ne();
                let nb = q.nb();
                // Each chunk's rows are written in place into one output (a chain of
                // concatenations would copy the rows gathered so far once per chunk).
                let mut out = g.new_tensor(F32, &[d_head, l_q, n_head * n]);
                let (onb1, onb2, onb3) = (out.nb()[1], out.nb()[2], out.nb()[3]);
                let mut start = 0;
                while start < l_q {
                    let len = rows.min(l_q - start);
                    let qc = q.view(&[qn[0], len, qn[2], qn[3]], &[nb[1], nb[2], nb[3]], start as usize * nb[1]).cont();
                    out = out.set_inplace(scores(qc), onb1, onb2, onb3, start as usize * onb1);
                    start += len;
                }
                out
            } else {
                scores(q)
            };
            out.reshape(&[d_head, l_q, n_head, n]).permute(0, 2, 1, 3)
        }
    };
    kqv.contiguous().reshape(&[d_head * n_head, l_q, n])
}
