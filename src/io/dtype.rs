//! ggml type facts and the element conversions applied when tensor data is read or
//! converted.
//!
//! Everything here works on little-endian byte buffers (the on-disk order of every format
//! we read, and the only host order ggml supports). Conversions between ggml types go
//! through ggml's own row functions so our bytes match the reference's.

use crate::error::Result;
use crate::types::SdType;
use ggml_sys as g;
use once_cell::sync::Lazy;

/// Block geometry of a ggml type: `blck` elements are stored in `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeLayout {
    pub blck: u64,
    pub size: u64,
}

/// The block geometry of `ty`, or `None` for a type ggml cannot store.
pub fn layout(ty: SdType) -> Option<TypeLayout> {
    // SAFETY: `ty.raw()` is a declared ggml_type below GGML_TYPE_COUNT; both functions only
    // read ggml's static type table.
    let (blck, size) = unsafe { (g::ggml_blck_size(ty.raw()), g::ggml_type_size(ty.raw())) };
    if blck <= 0 || size == 0 {
        return None;
    }
    Some(TypeLayout { blck: blck as u64, size: size as u64 })
}

/// True for block-quantized types (more than one element per block).
pub fn is_quantized(ty: SdType) -> bool {
    layout(ty).is_some_and(|l| l.blck > 1)
}

/// Bytes taken by a tensor of type `ty` and shape `ne` (ggml order), or `None` when the
/// shape is invalid for the type (negative or overflowing sizes, a row that is not a
/// whole number of blocks).
pub fn nbytes(ty: SdType, ne: &[i64]) -> Option<u64> {
    let l = layout(ty)?;
    let n = nelements(ne)?;
    if let Some(&ne0) = ne.first() {
        if ne0 as u64 % l.blck != 0 {
            return None;
        }
    } else if l.blck != 1 {
        return None;
    }
    (n / l.blck).checked_mul(l.size)
}

/// Element count of a shape, or `None` when a dimension is negative or the product
/// does not fit an `i64` (ggml's element counter).
pub fn nelements(ne: &[i64]) -> Option<u64> {
    let mut n: i64 = 1;
    for &d in ne {
        if d < 0 {
            return None;
        }
        n = n.checked_mul(d)?;
    }
    Some(n as u64)
}

/// How the bytes in a file differ from the storage's ggml type; the reader converts
/// these on the fly, like the reference does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceDtype {
    /// The file holds the storage type itself.
    Native,
    /// float8 e4m3fn in the file, read as f16.
    F8E4M3,
    /// float8 e5m2 in the file, read as f16.
    F8E5M2,
    /// float64 in the file, read as f32.
    F64,
    /// int64 in the file, read as i32 (truncating, like a C cast).
    I64,
}

impl SourceDtype {
    /// Bytes in the file for `nbytes` bytes of the storage type.
    pub fn file_bytes(self, nbytes: u64) -> Option<u64> {
        match self {
            SourceDtype::Native => Some(nbytes),
            SourceDtype::F8E4M3 | SourceDtype::F8E5M2 => Some(nbytes / 2),
            SourceDtype::F64 | SourceDtype::I64 => nbytes.checked_mul(2),
        }
    }

    /// The file dtype's name, for messages ("f8_e4m3" ...); `None` for `Native`.
    pub fn name(self) -> Option<&'static str> {
        match self {
            SourceDtype::Native => None,
            SourceDtype::F8E4M3 => Some("f8_e4m3"),
            SourceDtype::F8E5M2 => Some("f8_e5m2"),
            SourceDtype::F64 => Some("f64"),
            SourceDtype::I64 => Some("i64"),
        }
    }
}

/// f16 bits of every float8 e4m3fn value. Every e4m3 value is exact in f16; ggml's
/// f32→f16 conversion produces the bits (and the NaN encoding) the reference uses.
static E4M3_TO_F16: Lazy<[u16; 256]> = Lazy::new(|| {
    let mut values = [0f32; 256];
    for (byte, v) in values.iter_mut().enumerate() {
        *v = e4m3_value(byte as u8);
    }
    let mut out = [0u16; 256];
    // SAFETY: both buffers hold 256 elements, the count passed.
    unsafe { g::ggml_fp32_to_fp16_row(values.as_ptr(), out.as_mut_ptr(), 256) };
    out
});

fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    if b & 0x7f == 0x7f {
        return sign * f32::NAN;
    }
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Turns file bytes of dtype `src` into bytes of the storage type (`out`, which must be
/// exactly `nelements` elements of it).
pub fn decode_source(src: SourceDtype, raw: &[u8], out: &mut [u8]) -> Result<()> {
    let expect = |file: usize, store: usize| -> Result<()> {
        ensure!(
            raw.len() == file && out.len() == store,
            "internal: {} conversion of {} bytes into {} bytes",
            src.name().unwrap_or("native"),
            raw.len(),
            out.len()
        );
        Ok(())
    };
    match src {
        SourceDtype::Native => {
            expect(out.len(), raw.len())?;
            out.copy_from_slice(raw);
        }
        SourceDtype::F8E4M3 => {
            expect(raw.len(), raw.len() * 2)?;
            let table = &*E4M3_TO_F16;
            for (o, &b) in out.chunks_exact_mut(2).zip(raw) {
                o.copy_from_slice(&table[b as usize].to_le_bytes());
            }
        }
        SourceDtype::F8E5M2 => {
            expect(raw.len(), raw.len() * 2)?;
            for (o, &b) in out.chunks_exact_mut(2).zip(raw) {
                o.copy_from_slice(&((b as u16) << 8).to_le_bytes());
            }
        }
        SourceDtype::F64 => {
            expect(out.len() * 2, out.len())?;
            for (o, i) in out.chunks_exact_mut(4).zip(raw.chunks_exact(8)) {
                let v = f64::from_le_bytes(i.try_into().expect("8-byte chunk"));
                o.copy_from_slice(&(v as f32).to_le_bytes());
            }
        }
        SourceDtype::I64 => {
            expect(out.len() * 2, out.len())?;
            for (o, i) in out.chunks_exact_mut(4).zip(raw.chunks_exact(8)) {
                let v = i64::from_le_bytes(i.try_into().expect("8-byte chunk"));
                o.copy_from_slice(&(v as i32).to_le_bytes());
            }
        }
    }
    Ok(())
}

fn traits(ty: SdType) -> &'static g::ggml_type_traits {
    // SAFETY: ggml returns a pointer into its static, never-freed type table for every
    // type below GGML_TYPE_COUNT.
    unsafe { &*g::ggml_get_type_traits(ty.raw()) }
}

/// True when ggml can turn rows of `ty` into f32.
pub fn can_dequantize(ty: SdType) -> bool {
    ty == SdType::F32 || traits(ty).to_float.is_some()
}

/// True when `ggml_quantize_chunk` can produce `ty` from f32 (other targets make it abort).
pub fn can_quantize_to(ty: SdType) -> bool {
    use SdType::*;
    matches!(
        ty,
        F32 | F16
            | Bf16
            | Q1_0
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Mxfp4
            | Nvfp4
            | Q2K
            | Q3K
            | Q4K
            | Q5K
            | Q6K
            | Tq1_0
            | Tq2_0
            | Iq2Xxs
            | Iq2Xs
            | Iq3Xxs
            | Iq3S
            | Iq2S
            | Iq1S
            | Iq1M
            | Iq4Nl
            | Iq4Xs
    )
}

/// The grid-search quantizers assert on non-finite input; we refuse such data instead.
fn needs_finite_input(ty: SdType) -> bool {
    use SdType::*;
    matches!(ty, Iq2Xxs | Iq2Xs | Iq3Xxs | Iq3S | Iq2S | Iq1S | Iq1M | Iq4Nl | Iq4Xs)
}

/// Checks that `src` rows of `n_per_row` elements can become `dst` rows.
pub fn check_conversion(src: SdType, dst: SdType, n_per_row: u64) -> Result<()> {
    if src == dst {
        return Ok(());
    }
    ensure!(
        can_dequantize(src),
        "type {} cannot be converted: ggml has no dequantization for it",
        src.name()
    );
    ensure!(can_quantize_to(dst), "cannot convert to type {}", dst.name());
    let l = layout(dst).ok_or_else(|| crate::error::Error::new(format!("type {} has no layout", dst.name())))?;
    ensure!(
        n_per_row % l.blck == 0,
        "rows of {} elements cannot be stored as {} (block size {})",
        n_per_row,
        dst.name(),
        l.blck
    );
    Ok(())
}

/// Converts `nrows` rows of `n_per_row` elements from `src_ty` to `dst_ty` with ggml's
/// functions (quantizing with a unit importance matrix, as the reference does).
pub fn convert_rows(src: &[u8], src_ty: SdType, dst: &mut [u8], dst_ty: SdType, nrows: u64, n_per_row: u64) -> Result<()> {
    convert_rows_weighted(src, src_ty, dst, dst_ty, nrows, n_per_row, &[])
}

/// [`convert_rows`] quantizing with the column importances `importance` (an importance
/// matrix's values): the first `n_per_row` of them, missing ones 1, as the reference passes
/// them to ggml.
pub fn convert_rows_weighted(
    src: &[u8],
    src_ty: SdType,
    dst: &mut [u8],
    dst_ty: SdType,
    nrows: u64,
    n_per_row: u64,
    importance: &[f32],
) -> Result<()> {
    let n = nrows.checked_mul(n_per_row).ok_or_else(|| crate::error::Error::new("element count overflows"))?;
    let shape = [n_per_row as i64, nrows as i64];
    let src_len = nbytes(src_ty, &shape);
    let dst_len = nbytes(dst_ty, &shape);
    ensure!(
        src_len == Some(src.len() as u64) && dst_len == Some(dst.len() as u64),
        "internal: buffer sizes {}/{} do not match {} x {} elements of {} -> {}",
        src.len(),
        dst.len(),
        nrows,
        n_per_row,
        src_ty.name(),
        dst_ty.name()
    );
    if src_ty == dst_ty {
        dst.copy_from_slice(src);
        return Ok(());
    }
    check_conversion(src_ty, dst_ty, n_per_row)?;
    if n == 0 {
        return Ok(());
    }
    let n_i64 = n as i64;
    if dst_ty == SdType::F32 {
        to_f32(src, src_ty, dst, n_i64);
        return Ok(());
    }
    // Other targets are made from f32, a band of rows at a time: every type converts rows
    // independently, so the bands give the same bytes as one pass, and a large tensor (a
    // 152k-token embedding) needs no f32 copy of itself.
    let src_row = (src.len() as u64 / nrows) as usize;
    let dst_row = (dst.len() as u64 / nrows) as usize;
    let band = (CONVERT_BAND_VALUES / n_per_row).clamp(1, nrows) as usize;
    let mut tmp: Vec<u8> = Vec::new();
    for (i, (s, d)) in src.chunks(band * src_row).zip(dst.chunks_mut(band * dst_row)).enumerate() {
        let rows = (s.len() / src_row) as u64;
        let f32_src: &[u8] = if src_ty == SdType::F32 {
            s
        } else {
            tmp.resize((rows * n_per_row) as usize * 4, 0);
            to_f32(s, src_ty, &mut tmp, (rows * n_per_row) as i64);
            &tmp
        };
        from_f32(f32_src, d, dst_ty, rows, n_per_row, (i * band) as u64 * n_per_row, importance)?;
    }
    Ok(())
}

/// Values converted per band of rows (4 MiB of f32).
const CONVERT_BAND_VALUES: u64 = 1 << 20;

/// `dst` holds `n` f32 values; `src` holds `n` values of `src_ty` (checked by the caller).
fn to_f32(src: &[u8], src_ty: SdType, dst: &mut [u8], n: i64) {
    match src_ty {
        SdType::F32 => dst.copy_from_slice(src),
        // SAFETY (both arms): the caller checked that `src` holds n elements of `src_ty`
        // and `dst` n f32 values; ggml reads/writes exactly that many (unaligned access is
        // fine for ggml's row functions, which use memcpy-style loads).
        SdType::F16 => unsafe {
            g::ggml_fp16_to_fp32_row(src.as_ptr() as *const g::ggml_fp16_t, dst.as_mut_ptr() as *mut f32, n)
        },
        _ => {
            let f = traits(src_ty).to_float.expect("checked by check_conversion");
            unsafe { f(src.as_ptr() as *const _, dst.as_mut_ptr() as *mut f32, n) }
        }
    }
}

/// `first` is the index of `src`'s first value in the whole tensor (for the error message).
fn from_f32(src: &[u8], dst: &mut [u8], dst_ty: SdType, nrows: u64, n_per_row: u64, first: u64, importance: &[f32]) -> Result<()> {
    let n = (nrows * n_per_row) as usize;
    // ggml wants aligned f32 input; copy when the caller's bytes are not.
    let aligned: Vec<f32>;
    let values: &[f32] = match bytemuck_f32(src) {
        Some(v) => v,
        None => {
            aligned = src.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            &aligned
        }
    };
    debug_assert_eq!(values.len(), n);
    if needs_finite_input(dst_ty) {
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            bail!("element {} is not finite; it cannot be quantized to {}", first + i as u64, dst_ty.name());
        }
    }
    if dst_ty == SdType::F16 {
        // SAFETY: `values` has n elements and `dst` n f16 slots (checked by convert_rows).
        unsafe { g::ggml_fp32_to_fp16_row(values.as_ptr(), dst.as_mut_ptr() as *mut g::ggml_fp16_t, n as i64) };
        return Ok(());
    }
    let mut imatrix: Vec<f32> = importance.iter().copied().take(n_per_row as usize).collect();
    imatrix.resize(n_per_row as usize, 1.0);
    // SAFETY: `dst_ty` is one of the types ggml_quantize_chunk handles (checked), rows are
    // whole blocks (checked), `values` holds nrows*n_per_row floats, `dst` exactly the
    // quantized size of that, and the importance matrix has n_per_row entries.
    let written = unsafe {
        g::ggml_quantize_chunk(
            dst_ty.raw(),
            values.as_ptr(),
            dst.as_mut_ptr() as *mut _,
            0,
            nrows as i64,
            n_per_row as i64,
            imatrix.as_ptr(),
        )
    };
    ensure!(written == dst.len(), "quantizing to {} wrote {} of {} bytes", dst_ty.name(), written, dst.len());
    Ok(())
}

/// Views little-endian bytes as f32 when they are suitably aligned.
fn bytemuck_f32(b: &[u8]) -> Option<&[f32]> {
    if b.len() % 4 != 0 || b.as_ptr() as usize % std::mem::align_of::<f32>() != 0 {
        return None;
    }
    // SAFETY: length and alignment checked; every bit pattern is a valid f32.
    Some(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4) })
}

/// Reads little-endian f32 values out of bytes.
pub fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_and_sizes() {
        assert_eq!(layout(SdType::F32), Some(TypeLayout { blck: 1, size: 4 }));
        assert_eq!(layout(SdType::Q8_0), Some(TypeLayout { blck: 32, size: 34 }));
        assert_eq!(nbytes(SdType::Q8_0, &[64, 3]), Some(2 * 34 * 3));
        assert_eq!(nbytes(SdType::Q8_0, &[33]), None);
        assert_eq!(nbytes(SdType::F16, &[-1]), None);
        assert_eq!(nbytes(SdType::F32, &[i64::MAX, 2]), None);
        for &t in SdType::ALL {
            assert!(layout(t).is_some(), "{t}");
        }
    }

    #[test]
    fn f8_decoding() {
        let mut out = [0u8; 8];
        decode_source(SourceDtype::F8E4M3, &[0x38, 0x40, 0xb8, 0x7f], &mut out).unwrap();
        let h: Vec<u16> = out.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(h[0], 0x3c00); // 1.0
        assert_eq!(h[1], 0x4000); // 2.0
        assert_eq!(h[2], 0xbc00); // -1.0
        assert_eq!(h[3] & 0x7c00, 0x7c00);
        assert_ne!(h[3] & 0x03ff, 0); // NaN
        // smallest subnormal 2^-9
        decode_source(SourceDtype::F8E4M3, &[0x01, 0, 0, 0], &mut out).unwrap();
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x1800);
        decode_source(SourceDtype::F8E5M2, &[0x3c, 0, 0, 0], &mut out).unwrap();
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3c00);
    }

    #[test]
    fn wide_to_narrow() {
        let raw: Vec<u8> = [1.5f64, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = [0u8; 8];
        decode_source(SourceDtype::F64, &raw, &mut out).unwrap();
        assert_eq!(f32_values(&out), vec![1.5, -2.0]);
        let raw: Vec<u8> = [5i64, (1i64 << 32) + 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        decode_source(SourceDtype::I64, &raw, &mut out).unwrap();
        assert_eq!(i32::from_le_bytes(out[4..].try_into().unwrap()), 7);
        assert!(decode_source(SourceDtype::I64, &raw[..8], &mut out).is_err());
    }

    #[test]
    fn row_conversions() {
        let vals: Vec<f32> = (0..64).map(|i| i as f32 / 8.0 - 4.0).collect();
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut h = vec![0u8; 128];
        convert_rows(&src, SdType::F32, &mut h, SdType::F16, 2, 32).unwrap();
        let mut back = vec![0u8; 256];
        convert_rows(&h, SdType::F16, &mut back, SdType::F32, 2, 32).unwrap();
        assert_eq!(f32_values(&back), vals);
        let mut q = vec![0u8; 68];
        convert_rows(&h, SdType::F16, &mut q, SdType::Q8_0, 2, 32).unwrap();
        convert_rows(&q, SdType::Q8_0, &mut back, SdType::F32, 2, 32).unwrap();
        for (a, b) in f32_values(&back).iter().zip(&vals) {
            assert!((a - b).abs() < 0.05, "{a} {b}");
        }
        let mut bf = vec![0u8; 128];
        convert_rows(&src, SdType::F32, &mut bf, SdType::Bf16, 2, 32).unwrap();
        convert_rows(&bf, SdType::Bf16, &mut back, SdType::F32, 2, 32).unwrap();
        assert_eq!(f32_values(&back), vals);
        // integer types cannot be dequantized, odd rows cannot be quantized
        let mut i = vec![0u8; 256];
        assert!(convert_rows(&back, SdType::F32, &mut i, SdType::I32, 2, 32).is_err());
        let mut q_bad = vec![0u8; 34];
        assert!(convert_rows(&src[..64], SdType::F32, &mut q_bad, SdType::Q8_0, 1, 16).is_err());
        let nan: Vec<u8> = (0..256).flat_map(|i| if i == 3 { f32::NAN } else { 0.5f32 }.to_le_bytes()).collect();
        let mut iq = vec![0u8; nbytes(SdType::Iq4Nl, &[256]).unwrap() as usize];
        assert!(convert_rows(&nan, SdType::F32, &mut iq, SdType::Iq4Nl, 1, 256).is_err());
    }

    /// A tensor of several bands converts to the same bytes as its rows one by one, and a
    /// bad value is named by its index in the whole tensor.
    #[test]
    fn bands_of_rows_convert_like_single_rows() {
        let n_per_row = 256u64;
        let nrows = CONVERT_BAND_VALUES / n_per_row * 2 + 3;
        let n = (nrows * n_per_row) as usize;
        let f32s: Vec<u8> = (0..n).flat_map(|i| (((i * 7919 % 1000) as f32 - 500.0) / 97.0).to_le_bytes()).collect();
        let mut src = vec![0u8; n * 2];
        convert_rows(&f32s, SdType::F32, &mut src, SdType::F16, nrows, n_per_row).unwrap();
        for ty in [SdType::Q8_0, SdType::Q4K, SdType::F32] {
            let row = nbytes(ty, &[n_per_row as i64]).unwrap() as usize;
            let mut whole = vec![0u8; row * nrows as usize];
            convert_rows(&src, SdType::F16, &mut whole, ty, nrows, n_per_row).unwrap();
            for r in [0usize, 4095, 4096, nrows as usize - 1] {
                let mut one = vec![0u8; row];
                convert_rows(&src[r * 512..(r + 1) * 512], SdType::F16, &mut one, ty, 1, n_per_row).unwrap();
                assert_eq!(&whole[r * row..(r + 1) * row], &one[..], "{ty:?} row {r}");
            }
        }
        let bad = n - 5;
        let f32s: Vec<u8> = (0..n).flat_map(|i| if i == bad { f32::INFINITY } else { 0.25f32 }.to_le_bytes()).collect();
        let mut iq = vec![0u8; nbytes(SdType::Iq4Nl, &[n_per_row as i64, nrows as i64]).unwrap() as usize];
        let e = convert_rows(&f32s, SdType::F32, &mut iq, SdType::Iq4Nl, nrows, n_per_row).unwrap_err();
        assert!(e.to_string().contains(&format!("element {bad} ")), "{e}");
    }
}
