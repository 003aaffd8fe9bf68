//! Portable reproductions of ggml's CPU dot products as its AVX2 build computes them
//! (`ggml_vec_dot_f16`, `ggml_vec_dot_f32`, `quantize_row_q8_0` + `ggml_vec_dot_q8_0_q8_0`
//! in the `haswell` variant): the same products, the same per-lane fused multiply-adds in
//! the same order, the same reduction tree, so every result is bit-identical to ggml's.
//! They are the fallback on CPUs without AVX2 and the yardstick of the vector kernels.

/// Exact f16 → f32.
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            // Subnormal: man · 2⁻²⁴, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// f32 → f16 rounding to nearest even (what F16C's `vcvtps2ph` and ggml's software
/// conversion do; NaNs stay NaNs).
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        // Subnormal result: shift the full mantissa (with its hidden bit) into place.
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1u32 << shift) - 1);
        let mut h = (m >> shift) as u16;
        if rest > half || (rest == half && (h & 1) == 1) {
            h += 1;
        }
        return sign | h;
    }
    let mut h = ((e as u32) << 10 | (man >> 13)) as u16;
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
        h += 1; // may carry into the exponent, up to infinity: still correct
    }
    sign | h
}

/// ggml's AVX2 reduction of four 8-lane accumulators (`GGML_F32x8_REDUCE`):
/// (s0 + s2) + (s1 + s3), then the two 128-bit halves, then two horizontal adds.
pub(crate) fn reduce_4x8(acc: &[f32; 32]) -> f32 {
    let v: [f32; 8] = std::array::from_fn(|l| (acc[l] + acc[16 + l]) + (acc[8 + l] + acc[24 + l]));
    let t: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

/// 32 lanes (4 accumulators × 8) of fused multiply-adds over the whole 32-element blocks.
fn lanes(k32: usize, a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32) -> [f32; 32] {
    let mut acc = [0f32; 32];
    for c in (0..k32).step_by(32) {
        for (t, s) in acc.iter_mut().enumerate() {
            *s = a(c + t).mul_add(b(c + t), *s);
        }
    }
    acc
}

/// The f16 dot's tail (elements past the last whole 32-block), summed in double.
pub(crate) fn tail_f16(r: f32, a: &[f32], b: &[f32]) -> f32 {
    let mut s = r as f64;
    for (x, y) in a.iter().zip(b) {
        s += (x * y) as f64;
    }
    s as f32
}

/// The f32 dot's tail as GCC compiled it: groups of four products rounded then added, the
/// last `len % 4` elements fused multiply-adds.
pub(crate) fn tail_f32(r: f32, a: &[f32], b: &[f32]) -> f32 {
    let q = a.len() & !3;
    let mut s = r;
    for i in 0..q {
        s += a[i] * b[i];
    }
    for i in q..a.len() {
        s = a[i].mul_add(b[i], s);
    }
    s
}

/// `ggml_vec_dot_f16` (both rows already f16).
pub(crate) fn dot_f16(a: &[u16], b: &[u16]) -> f32 {
    let k32 = a.len() & !31;
    let acc = lanes(k32, |i| f16_to_f32(a[i]), |i| f16_to_f32(b[i]));
    let ta: Vec<f32> = a[k32..].iter().map(|&h| f16_to_f32(h)).collect();
    let tb: Vec<f32> = b[k32..].iter().map(|&h| f16_to_f32(h)).collect();
    tail_f16(reduce_4x8(&acc), &ta, &tb)
}

/// `ggml_vec_dot_f32`.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let k32 = a.len() & !31;
    let acc = lanes(k32, |i| a[i], |i| b[i]);
    tail_f32(reduce_4x8(&acc), &a[k32..], &b[k32..])
}

/// One q8_0 block: f16 scale and 32 signed bytes (ggml's `block_q8_0`, 34 bytes).
pub(crate) const Q8_0_BYTES: usize = 34;

/// `quantize_row_q8_0` (AVX2 version) of one 32-element block into `out` (34 bytes):
/// d = amax / 127 stored as f16, quants = round-half-even(x · (127 / amax)).
pub(crate) fn quantize_q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = x[..32].iter().fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (o, &v) in out[2..34].iter_mut().zip(&x[..32]) {
        *o = (v * id).round_ties_even().clamp(-128.0, 127.0) as i32 as i8 as u8;
    }
}

/// `ggml_vec_dot_q8_0_q8_0` (AVX2): per block, lane l holds the exact integer sum of
/// elements 4l..4l+3, scaled by the product of the two block scales into one fused
/// multiply-add; then `hsum_float_8`.
pub(crate) fn dot_q8_0(a: &[u8], b: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for (xa, xb) in a.chunks_exact(Q8_0_BYTES).zip(b.chunks_exact(Q8_0_BYTES)) {
        let d = f16_to_f32(u16::from_le_bytes([xa[0], xa[1]])) * f16_to_f32(u16::from_le_bytes([xb[0], xb[1]]));
        for (l, s) in acc.iter_mut().enumerate() {
            let q: i32 = (0..4).map(|t| xa[2 + 4 * l + t] as i8 as i32 * xb[2 + 4 * l + t] as i8 as i32).sum();
            *s = d.mul_add(q as f32, *s);
        }
    }
    hsum_q8(&acc)
}

/// `hsum_float_8`: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
pub(crate) fn hsum_q8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}
