//! The update math as ggml graphs, in the reference's op order and types (f32 factors,
//! `mul_mat` products, Kronecker by nearest upscaling), so merged weights match its own.
//! Every op's shape precondition is checked first: a LoRA that does not fit is an error
//! naming the weight, not a ggml abort.

use super::{n_dims, Factor, Patch, Piece, Update};
use crate::error::Result;
use crate::graph::nn::{conv_2d, linear, scale};
use crate::graph::{GgmlType, Graph, LayerOp, F16, F32, T};
use ggml_sys as g;

fn is_float_or_quantized(ty: GgmlType) -> bool {
    // SAFETY: pure lookup for any type value ggml declares.
    ty == F32 || ty == F16 || ty == g::GGML_TYPE_BF16 || unsafe { g::ggml_is_quantized(ty) }
}

/// `t` as f32 (the reference casts every factor before multiplying).
fn f32_of(t: T<'_>) -> Result<T<'_>> {
    ensure!(is_float_or_quantized(t.ty()), "tensor of ggml type {} holds no numbers to merge", t.ty());
    Ok(if t.ty() == F32 { t } else { t.cast(F32) })
}

/// `t` as f16 (convolution kernels are f16, like the reference's).
fn f16_of(t: T<'_>) -> Result<T<'_>> {
    ensure!(is_float_or_quantized(t.ty()), "tensor of ggml type {} holds no numbers to convolve", t.ty());
    Ok(if t.ty() == F16 { t } else { t.cast(F16) })
}

/// `ggml_mul_mat(a, b)` after checking ggml's conditions.
fn mul_mat<'g>(a: T<'g>, b: T<'g>) -> Result<T<'g>> {
    let (an, bn) = (a.ne(), b.ne());
    ensure!(
        an[0] == bn[0] && bn[2] % an[2] == 0 && bn[3] % an[3] == 0,
        "factors of shapes {an:?} and {bn:?} cannot be multiplied"
    );
    Ok(a.mul_mat(b))
}

fn reshape<'g>(t: T<'g>, ne: &[i64]) -> Result<T<'g>> {
    ensure!(ne.iter().all(|&d| d > 0) && ne.iter().product::<i64>() == t.nelements(), "cannot reshape {:?} to {ne:?}", t.ne());
    Ok(t.contiguous().reshape(ne))
}

/// `ggml_concat` after checking that the other dimensions agree.
fn concat<'g>(a: T<'g>, b: T<'g>, dim: usize) -> Result<T<'g>> {
    let (an, bn) = (a.ne(), b.ne());
    ensure!(
        a.ty() == b.ty() && (0..4).all(|i| i == dim || an[i] == bn[i]),
        "pieces of shapes {an:?} and {bn:?} cannot be stacked along dimension {dim}"
    );
    Ok(a.concat(b, dim as i32))
}

/// The n-mode product of tensor `a` with matrix `b` (ggml [k, m]): axis `mode` of `a`
/// (length k) becomes length m.
fn mul_n_mode<'g>(a: T<'g>, b: T<'g>, mode: i32) -> Result<T<'g>> {
    let axes = [mode, if mode != 1 { 1 } else { 0 }, if mode != 2 { 2 } else { 0 }, if mode != 3 { 3 } else { 0 }];
    let a = a.permute(axes[0], axes[1], axes[2], axes[3]).cont();
    let [k, ne1, ne2, ne3] = a.ne();
    let a = a.reshape(&[k, ne1 * ne2 * ne3]);
    let r = mul_mat(a, b)?.transpose().cont();
    let m = r.ne()[0];
    Ok(r.reshape(&[m, ne1, ne2, ne3]).permute(axes[0], axes[1], axes[2], axes[3]))
}

/// `up · down` as a weight (the reference's `ggml_ext_merge_lora`); with `mid`, the Tucker
/// core is multiplied by `down` along its axis 3 and by `up` along its axis 2.
pub fn merge_lora<'g>(down: T<'g>, up: T<'g>, mid: Option<T<'g>>) -> Result<T<'g>> {
    let up_rows = up.ne()[n_dims(up.ne()) - 1];
    let up = reshape(up, &[up.nelements() / up_rows, up_rows])?;
    let nd = n_dims(down.ne());
    let down_rows = down.ne()[nd + nd % 2 - 1];
    let down = reshape(down, &[down.nelements() / down_rows, down_rows])?;
    match mid {
        // The reference takes a `mul_mat` of up and down (one dot product of rank length per
        // element) and transposes it; the sum of rank outer products gives the same
        // numbers (to the last bit of f32) in the weight's layout, several times faster.
        None => {
            let up_t = up.transpose().cont();
            ensure!(down.ne()[1] == up_t.ne()[1], "factors of shapes {:?} and {:?} cannot be multiplied", down.ne(), up.ne());
            Ok(down.out_prod(up_t))
        }
        Some(mid) => Ok(mul_n_mode(mul_n_mode(mid, down.transpose().cont(), 3)?, up, 2)?.cont()),
    }
}

/// The Kronecker product `a ⊗ b` (each element of `a` scales a copy of `b`).
pub fn kronecker<'g>(a: T<'g>, b: T<'g>) -> T<'g> {
    let (an, bn) = (a.ne(), b.ne());
    let big = a.interpolate([an[0] * bn[0], an[1] * bn[1], an[2] * bn[2], an[3] * bn[3]], g::GGML_SCALE_MODE_NEAREST);
    big.mul(b)
}

fn factor<'g>(g: &'g Graph, f: &Factor) -> Result<T<'g>> {
    match *f {
        Factor::Full(w) => f32_of(g.param(w)),
        Factor::LowRank { a, b } => merge_lora(f32_of(g.param(b))?, f32_of(g.param(a))?, None),
    }
}

/// The full-size f32 update of one piece, scaled.
pub fn piece_delta<'g>(g: &'g Graph, piece: &Piece) -> Result<T<'g>> {
    match piece.update {
        // Scaling the small factor saves a pass over the full-size update (the numbers
        // differ from scaling the product in the last bit of f32 only).
        Update::Lora { down, up, mid: None } => merge_lora(f32_of(g.param(down))?, f32_of(g.param(up))?.scale(piece.scale), None),
        _ => Ok(scaled(update_delta(g, &piece.update)?, piece)),
    }
}

/// The full-size f32 update of one piece, before its scale.
pub fn update_delta<'g>(g: &'g Graph, u: &Update) -> Result<T<'g>> {
    let p = |w| f32_of(g.param(w));
    match *u {
        Update::Lora { down, up, mid } => merge_lora(p(down)?, p(up)?, mid.map(p).transpose()?),
        Update::Diff(d) => p(d),
        Update::LoHa { w1a, w1b, t1, w2a, w2b, t2 } => {
            // With a Tucker core the `a` factor is stored the other way round.
            let half = |a, b, t: Option<_>| -> Result<T<'g>> {
                let mut up = p(a)?;
                if t.is_some() {
                    up = up.transpose().cont();
                }
                merge_lora(p(b)?, up, t.map(p).transpose()?)
            };
            let (h1, h2) = (half(w1a, w1b, t1)?, half(w2a, w2b, t2)?);
            ensure!(h1.ne() == h2.ne(), "LoHa halves of shapes {:?} and {:?} differ", h1.ne(), h2.ne());
            Ok(h1.mul_inplace(h2))
        }
        Update::LoKr { w1, w2 } => Ok(kronecker(factor(g, &w1)?, factor(g, &w2)?)),
    }
}

fn scaled<'g>(t: T<'g>, piece: &Piece) -> T<'g> {
    scale(t, piece.scale, true)
}

/// The f32 update of a weight of shape `ne` (ggml order, 4 dims) by `patch`: its pieces
/// stacked along the last dimension, shorter 2-D updates padded with zero rows, reshaped
/// to the weight. Without `low_rank` only the pieces that patch weights count (diff, LoHa).
pub fn weight_delta<'g>(g: &'g Graph, patch: &Patch, ne: [i64; 4], low_rank: bool, name: &str) -> Result<Option<T<'g>>> {
    let build = || -> Result<Option<T<'g>>> {
        let mut acc: Option<T<'g>> = None;
        for piece in patch.pieces.iter().filter(|p| low_rank || !p.update.is_low_rank()) {
            let d = piece_delta(g, piece)?;
            acc = Some(match acc {
                None => d,
                Some(a) => concat(a, d, n_dims(a.ne()) - 1)?,
            });
        }
        let Some(mut d) = acc else { return Ok(None) };
        let (want, have) = (ne.iter().product::<i64>(), d.nelements());
        if have < want && n_dims(d.ne()) == 2 && n_dims(ne) == 2 && d.ne()[0] == ne[0] {
            sd_warn!("LoRA update of '{name}' covers {} of {} rows; the others stay", d.ne()[1], ne[1]);
            d = d.pad(0, (ne[1] - d.ne()[1]) as i32, 0, 0);
        }
        ensure!(d.nelements() == want, "update of shape {:?} does not fit the weight's {ne:?}", d.ne());
        Ok(Some(d.reshape(&ne)))
    };
    build().map_err(|e| crate::error::Error::new(format!("weight '{name}': {e}")))
}

/// Weight `w` (`is_param`: a model tensor, never written) with the updates of `patches`
/// added one after the other in its own type, rounding after each like the reference
/// merging one LoRA after another; quantized weights go through f32 and back.
pub fn merged_weight<'g>(g: &'g Graph, w: T<'g>, is_param: bool, patches: &[&Patch], name: &str) -> Result<T<'g>> {
    let (ty, ne) = (w.ty(), w.ne());
    let mut cur = w;
    let mut fresh = !is_param;
    for patch in patches {
        let Some(d) = weight_delta(g, patch, ne, true, name)? else { continue };
        cur = if ty == F32 || ty == F16 {
            if fresh {
                cur.add_inplace(d)
            } else {
                cur.add(d)
            }
        } else {
            let sum = f32_of(cur)?.add_inplace(d);
            let back = sum.cpy(g.new_tensor(ty, &ne));
            ensure!(g.supports(back), "weight '{name}': ggml cannot write type {ty} (apply this LoRA at_runtime)");
            back
        };
        fresh = true;
    }
    Ok(cur)
}

/// Output size of a convolution along one axis.
fn conv_out(size: i64, k: i64, s: i32, p: i32, d: i32) -> i64 {
    (size + 2 * p as i64 - d as i64 * (k - 1) - 1) / s as i64 + 1
}

/// A kernel for a convolution over `channels` input channels (2-D factors are 1×1).
fn conv_kernel<'g>(w: T<'g>, channels: i64) -> Result<T<'g>> {
    let w = f16_of(w)?;
    let ne = w.ne();
    let w = if ne[2] != channels && n_dims(ne) <= 2 { reshape(w, &[1, 1, ne[0], ne[1]])? } else { w };
    ensure!(w.ne()[2] == channels, "kernel {:?} does not take {channels} input channels", w.ne());
    Ok(w)
}

/// A matrix for a linear layer over `inputs` features (1×1 kernels become matrices).
fn linear_factor<'g>(w: T<'g>, inputs: i64) -> Result<T<'g>> {
    let ne = w.ne();
    let w = if ne[0] != inputs && ne[0] == 1 && ne[1] == 1 { reshape(w, &[ne[2], ne[3]])? } else { w };
    ensure!(w.ne()[0] == inputs && n_dims(w.ne()) <= 2, "factor {:?} does not take {inputs} inputs", w.ne());
    Ok(w)
}

/// `W1 ⊗ W2` applied to `x` without forming it: `x` seen as [in2, in1] blocks gets W2 on
/// one axis and W1 on the other.
fn lokr_linear<'g>(g: &'g Graph, w1: &Factor, w2: &Factor, x: T<'g>, out_rows: i64) -> Result<T<'g>> {
    let apply = |f: &Factor, x: T<'g>| -> Result<(T<'g>, i64)> {
        match *f {
            Factor::Full(w) => {
                let w = g.param(w);
                Ok((mul_mat(w, x)?, w.ne()[1]))
            }
            Factor::LowRank { a, b } => {
                let (a, b) = (g.param(a), g.param(b));
                Ok((mul_mat(a, mul_mat(b, x)?)?, a.ne()[1]))
            }
        }
    };
    let in1 = match *w1 {
        Factor::Full(w) => w.ne()[0],
        Factor::LowRank { b, .. } => b.ne()[0],
    };
    let inputs = x.ne()[0];
    ensure!(in1 > 0 && inputs % in1 == 0, "LoKr factor with {in1} inputs does not divide {inputs}");
    let (in2, rest) = (inputs / in1, x.nelements() / inputs);
    let (h, out2) = apply(w2, reshape(x, &[in2, in1 * rest])?)?;
    let h = h.reshape(&[out2, in1, rest]).permute(1, 0, 2, 3).cont();
    let (y, out1) = apply(w1, h.reshape(&[in1, out2 * rest]))?;
    ensure!(out1 * out2 == out_rows, "LoKr update has {} outputs, the layer {out_rows}", out1 * out2);
    let y = y.reshape(&[out1, out2, rest]).permute(1, 0, 2, 3).cont();
    reshape(y, &[out_rows, rest])
}

/// The output of one low-rank piece for layer input `x`, or `None` when the piece's
/// factors cannot reproduce the layer's geometry (then the caller convolves with the
/// merged update instead).
fn piece_output<'g>(g: &'g Graph, u: &Update, x: T<'g>, out_ne: [i64; 4], op: LayerOp) -> Result<Option<T<'g>>> {
    match (*u, op) {
        (Update::Lora { down, up, mid }, LayerOp::Linear { force_prec_f32, scale }) => {
            let down = linear_factor(g.param(down), x.ne()[0])?;
            let mut h = linear(g, x, down, None, force_prec_f32, scale);
            if let Some(mid) = mid {
                h = linear(g, h, linear_factor(g.param(mid), h.ne()[0])?, None, force_prec_f32, scale);
            }
            Ok(Some(linear(g, h, linear_factor(g.param(up), h.ne()[0])?, None, force_prec_f32, scale)))
        }
        (Update::Lora { down, up, mid }, LayerOp::Conv2d { stride, padding, dilation, scale }) => {
            let down = conv_kernel(g.param(down), x.ne()[2])?;
            let mid = mid.map(|m| conv_kernel(g.param(m), down.ne()[3])).transpose()?;
            let up = conv_kernel(g.param(up), mid.unwrap_or(down).ne()[3])?;
            // Only when the factors give the layer's output size (a Tucker core after a
            // strided 1×1 does not).
            let mut w = conv_out(x.ne()[0], down.ne()[0], stride.0, padding.0, dilation.0);
            let mut h = conv_out(x.ne()[1], down.ne()[1], stride.1, padding.1, dilation.1);
            if let Some(m) = mid {
                (w, h) = (w - m.ne()[0] + 1, h - m.ne()[1] + 1);
            }
            (w, h) = (w - up.ne()[0] + 1, h - up.ne()[1] + 1);
            if [w, h] != [out_ne[0], out_ne[1]] {
                return Ok(None);
            }
            let mut y = conv_2d(g, x, down, None, stride, padding, dilation, scale);
            if let Some(m) = mid {
                y = conv_2d(g, y, m, None, (1, 1), (0, 0), (1, 1), scale);
            }
            Ok(Some(conv_2d(g, y, up, None, (1, 1), (0, 0), (1, 1), scale)))
        }
        (Update::LoKr { w1, w2 }, LayerOp::Linear { .. }) => {
            let rest = x.nelements() / x.ne()[0].max(1);
            let y = lokr_linear(g, &w1, &w2, x, out_ne[0])?;
            let mut ne = x.ne();
            ne[0] = out_ne[0];
            ensure!(ne[0] * rest == y.nelements(), "LoKr output size mismatch");
            Ok(Some(y.reshape(&ne)))
        }
        _ => Ok(None),
    }
}

/// What the low-rank pieces of `patch` add to the output `out` of a layer with weight shape
/// `weight_ne` and input `x` (pieces stacked along the output channels, missing rows zero).
pub fn output_delta<'g>(g: &'g Graph, patch: &Patch, weight_ne: [i64; 4], x: T<'g>, out: T<'g>, op: LayerOp, name: &str) -> Result<Option<T<'g>>> {
    let build = || -> Result<Option<T<'g>>> {
        let pieces: Vec<&Piece> = patch.pieces.iter().filter(|p| p.update.is_low_rank()).collect();
        if pieces.is_empty() {
            return Ok(None);
        }
        let channel = match op {
            LayerOp::Linear { .. } => 0,
            LayerOp::Conv2d { .. } => 2,
        };
        let out_ne = out.ne();
        let mut acc: Option<T<'g>> = None;
        for piece in &pieces {
            let Some(y) = piece_output(g, &piece.update, x, out_ne, op)? else {
                return merged_output(g, patch, weight_ne, x, op, name).map(Some);
            };
            let y = scaled(y, piece);
            acc = Some(match acc {
                None => y,
                Some(a) => concat(a, y, channel)?,
            });
        }
        let Some(mut y) = acc else { return Ok(None) };
        let missing = out_ne[channel] - y.ne()[channel];
        ensure!(missing >= 0, "update has {} output channels, the layer {}", y.ne()[channel], out_ne[channel]);
        if missing > 0 {
            let mut pad = [0; 4];
            pad[channel] = missing as i32;
            y = y.pad(pad[0], pad[1], pad[2], pad[3]);
        }
        ensure!(y.ne() == out_ne, "update output {:?} does not match the layer's {out_ne:?}", y.ne());
        Ok(Some(y))
    };
    build().map_err(|e| crate::error::Error::new(format!("weight '{name}': {e}")))
}

/// The layer's op applied to `x` with the merged low-rank update as its weight.
fn merged_output<'g>(g: &'g Graph, patch: &Patch, weight_ne: [i64; 4], x: T<'g>, op: LayerOp, name: &str) -> Result<T<'g>> {
    let low_rank = Patch { pieces: patch.pieces.iter().filter(|p| p.update.is_low_rank()).copied().collect() };
    let d = weight_delta(g, &low_rank, weight_ne, true, name)?.ok_or_else(|| crate::error::Error::new("no update"))?;
    Ok(match op {
        LayerOp::Linear { force_prec_f32, scale } => linear(g, x, d, None, force_prec_f32, scale),
        LayerOp::Conv2d { stride, padding, dilation, scale } => conv_2d(g, x, d.cast(F16), None, stride, padding, dilation, scale),
    })
}
