//! Baseline JPEG encoding that gives the reference program's bytes.
//!
//! The reference writes JPEG pictures and the frames of its MJPEG AVIs with stb_image_write
//! (quality 90: 4:2:0 chroma, the Annex K tables scaled the IJG way). This encoder makes the
//! same choices and does the same single-precision arithmetic in the same order (RGB to
//! YCbCr, 2×2 chroma averages, the separable AAN float DCT, quantisation rounded half away
//! from zero), so for the same pixels the files are identical byte for byte, which the
//! tests check against digests of the reference writer's output. Frames whose size is not a
//! multiple of the block size repeat their last row and column, as the reference does.
//! The constants are written with the reference's digits: each literal must round to the
//! same f32.

#![allow(clippy::excessive_precision, clippy::unreadable_literal)]

use stable_diffusion::api::Image;

/// The quality the reference writes pictures and video frames with.
pub const REFERENCE_QUALITY: i32 = 90;

/// Annex K.1: luminance quantisation, row-major.
const LUMA_QUANT: [u16; 64] = [
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56, 14, 17, 22, 29, 51, 87, 80,
    62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92, 49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98,
    112, 100, 103, 99,
];

/// Annex K.2: chrominance quantisation, row-major.
const CHROMA_QUANT: [u16; 64] = {
    let mut t = [99u16; 64];
    let head: [[u16; 4]; 4] = [[17, 18, 24, 47], [18, 21, 26, 66], [24, 26, 56, 99], [47, 66, 99, 99]];
    let mut r = 0;
    while r < 4 {
        let mut c = 0;
        while c < 4 {
            t[r * 8 + c] = head[r][c];
            c += 1;
        }
        r += 1;
    }
    t
};

/// Annex K.3-K.6: the typical Huffman tables as (code counts per length 1..16, symbols).
const DC_LUMA: ([u8; 16], &[u8]) = ([0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
const DC_CHROMA: ([u8; 16], &[u8]) = ([0, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
const AC_LUMA: ([u8; 16], &[u8]) = (
    [0, 2, 1, 3, 3, 2, 4, 3, 5, 5, 4, 4, 0, 0, 1, 0x7d],
    &[
        0x01, 0x02, 0x03, 0x00, 0x04, 0x11, 0x05, 0x12, 0x21, 0x31, 0x41, 0x06, 0x13, 0x51, 0x61, 0x07, 0x22, 0x71, 0x14, 0x32,
        0x81, 0x91, 0xa1, 0x08, 0x23, 0x42, 0xb1, 0xc1, 0x15, 0x52, 0xd1, 0xf0, 0x24, 0x33, 0x62, 0x72, 0x82, 0x09, 0x0a, 0x16,
        0x17, 0x18, 0x19, 0x1a, 0x25, 0x26, 0x27, 0x28, 0x29, 0x2a, 0x34, 0x35, 0x36, 0x37, 0x38, 0x39, 0x3a, 0x43, 0x44, 0x45,
        0x46, 0x47, 0x48, 0x49, 0x4a, 0x53, 0x54, 0x55, 0x56, 0x57, 0x58, 0x59, 0x5a, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, 0x69,
        0x6a, 0x73, 0x74, 0x75, 0x76, 0x77, 0x78, 0x79, 0x7a, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8a, 0x92, 0x93, 0x94,
        0x95, 0x96, 0x97, 0x98, 0x99, 0x9a, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6,
        0xb7, 0xb8, 0xb9, 0xba, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7, 0xc8, 0xc9, 0xca, 0xd2, 0xd3, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8,
        0xd9, 0xda, 0xe1, 0xe2, 0xe3, 0xe4, 0xe5, 0xe6, 0xe7, 0xe8, 0xe9, 0xea, 0xf1, 0xf2, 0xf3, 0xf4, 0xf5, 0xf6, 0xf7, 0xf8,
        0xf9, 0xfa,
    ],
);
const AC_CHROMA: ([u8; 16], &[u8]) = (
    [0, 2, 1, 2, 4, 4, 3, 4, 7, 5, 4, 4, 0, 1, 2, 0x77],
    &[
        0x00, 0x01, 0x02, 0x03, 0x11, 0x04, 0x05, 0x21, 0x31, 0x06, 0x12, 0x41, 0x51, 0x07, 0x61, 0x71, 0x13, 0x22, 0x32, 0x81,
        0x08, 0x14, 0x42, 0x91, 0xa1, 0xb1, 0xc1, 0x09, 0x23, 0x33, 0x52, 0xf0, 0x15, 0x62, 0x72, 0xd1, 0x0a, 0x16, 0x24, 0x34,
        0xe1, 0x25, 0xf1, 0x17, 0x18, 0x19, 0x1a, 0x26, 0x27, 0x28, 0x29, 0x2a, 0x35, 0x36, 0x37, 0x38, 0x39, 0x3a, 0x43, 0x44,
        0x45, 0x46, 0x47, 0x48, 0x49, 0x4a, 0x53, 0x54, 0x55, 0x56, 0x57, 0x58, 0x59, 0x5a, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68,
        0x69, 0x6a, 0x73, 0x74, 0x75, 0x76, 0x77, 0x78, 0x79, 0x7a, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8a, 0x92,
        0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9a, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xb2, 0xb3, 0xb4,
        0xb5, 0xb6, 0xb7, 0xb8, 0xb9, 0xba, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7, 0xc8, 0xc9, 0xca, 0xd2, 0xd3, 0xd4, 0xd5, 0xd6,
        0xd7, 0xd8, 0xd9, 0xda, 0xe2, 0xe3, 0xe4, 0xe5, 0xe6, 0xe7, 0xe8, 0xe9, 0xea, 0xf2, 0xf3, 0xf4, 0xf5, 0xf6, 0xf7, 0xf8,
        0xf9, 0xfa,
    ],
);

/// The AAN DCT's output scale per frequency (cos(kπ/16)·√2 for k > 0, 1 for k = 0), times
/// 2√2 for the 8-point normalisation. Each product is rounded to f32 once, as the
/// reference's constants are.
const AAN_SCALE: [f32; 8] = [
    1.0 * 2.828427125,
    1.387039845 * 2.828427125,
    1.306562965 * 2.828427125,
    1.175875602 * 2.828427125,
    1.0 * 2.828427125,
    0.785694958 * 2.828427125,
    0.541196100 * 2.828427125,
    0.275899379 * 2.828427125,
];

/// Position in the zig-zag scan of each row-major coefficient.
fn zigzag_positions() -> [usize; 64] {
    let mut pos = [0usize; 64];
    let mut n = 0;
    for diagonal in 0..15usize {
        let rows: Vec<usize> = (0..8).filter(|&r| diagonal >= r && diagonal - r < 8).collect();
        // Even diagonals run up and to the right (row falling), odd ones down and to the left.
        let ordered: Vec<usize> = if diagonal % 2 == 0 { rows.into_iter().rev().collect() } else { rows };
        for r in ordered {
            pos[r * 8 + (diagonal - r)] = n;
            n += 1;
        }
    }
    pos
}

/// A Huffman code per symbol: (code, length), from the counts per length (Annex C).
struct Codes([(u16, u8); 256]);

impl Codes {
    fn new(counts: &[u8; 16], symbols: &[u8]) -> Codes {
        let mut table = [(0u16, 0u8); 256];
        let mut code = 0u16;
        let mut k = 0;
        for (len, &count) in counts.iter().enumerate() {
            for _ in 0..count {
                table[usize::from(symbols[k])] = (code, len as u8 + 1);
                code += 1;
                k += 1;
            }
            code <<= 1;
        }
        Codes(table)
    }
}

/// Entropy-coded output: bits MSB first, a 0 stuffed after every 0xFF byte.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    buf: u32,
    count: u32,
}

impl BitWriter<'_> {
    fn put(&mut self, code: u16, len: u8) {
        self.count += u32::from(len);
        self.buf |= u32::from(code) << (24 - self.count);
        while self.count >= 8 {
            let byte = (self.buf >> 16) as u8;
            self.out.push(byte);
            if byte == 0xff {
                self.out.push(0);
            }
            self.buf <<= 8;
            self.count -= 8;
        }
    }

    /// Completes a partial last byte with 1 bits.
    fn finish(&mut self) {
        self.put(0x7f, 7);
    }
}

/// (magnitude category, the value's bits) of a non-zero coefficient or DC difference.
fn category(v: i32) -> (u8, u16) {
    let size = 32 - v.unsigned_abs().leading_zeros();
    let bits = if v < 0 { v - 1 } else { v };
    (size as u8, (bits & ((1 << size) - 1)) as u16)
}

/// One pass of the AAN forward DCT over eight samples `stride` apart, in place.
fn aan_dct(b: &mut [f32; 64], first: usize, stride: usize) {
    let at = |i: usize| first + i * stride;
    let d: [f32; 8] = std::array::from_fn(|i| b[at(i)]);
    let (s07, d07) = (d[0] + d[7], d[0] - d[7]);
    let (s16, d16) = (d[1] + d[6], d[1] - d[6]);
    let (s25, d25) = (d[2] + d[5], d[2] - d[5]);
    let (s34, d34) = (d[3] + d[4], d[3] - d[4]);

    // Even part.
    let (e0, e3) = (s07 + s34, s07 - s34);
    let (e1, e2) = (s16 + s25, s16 - s25);
    b[at(0)] = e0 + e1;
    b[at(4)] = e0 - e1;
    let z1 = (e2 + e3) * 0.707106781;
    b[at(2)] = e3 + z1;
    b[at(6)] = e3 - z1;

    // Odd part.
    let o10 = d34 + d25;
    let o11 = d25 + d16;
    let o12 = d16 + d07;
    let z5 = (o10 - o12) * 0.382683433;
    let z2 = o10 * 0.541196100 + z5;
    let z4 = o12 * 1.306562965 + z5;
    let z3 = o11 * 0.707106781;
    let z11 = d07 + z3;
    let z13 = d07 - z3;
    b[at(5)] = z13 + z2;
    b[at(3)] = z13 - z2;
    b[at(1)] = z11 + z4;
    b[at(7)] = z11 - z4;
}

/// One colour component's tables and running DC value.
struct Component<'t> {
    /// Row-major reciprocal of quantiser × DCT scale.
    scale: [f32; 64],
    dc: &'t Codes,
    ac: &'t Codes,
    last_dc: i32,
}

impl Component<'_> {
    /// Transforms, quantises and codes one 8×8 block (row-major samples).
    fn encode(&mut self, w: &mut BitWriter, zigzag: &[usize; 64], mut block: [f32; 64]) {
        for row in 0..8 {
            aan_dct(&mut block, row * 8, 1);
        }
        for col in 0..8 {
            aan_dct(&mut block, col, 8);
        }
        let mut q = [0i32; 64];
        for (k, (&v, &s)) in block.iter().zip(&self.scale).enumerate() {
            let v = v * s;
            q[zigzag[k]] = (if v < 0.0 { v - 0.5 } else { v + 0.5 }) as i32;
        }

        let diff = q[0] - self.last_dc;
        self.last_dc = q[0];
        if diff == 0 {
            let (code, len) = self.dc.0[0];
            w.put(code, len);
        } else {
            let (size, bits) = category(diff);
            let (code, len) = self.dc.0[usize::from(size)];
            w.put(code, len);
            w.put(bits, size);
        }

        let Some(last) = (1..64).rev().find(|&i| q[i] != 0) else {
            let (code, len) = self.ac.0[0x00];
            w.put(code, len);
            return;
        };
        let mut run = 0usize;
        for &v in &q[1..=last] {
            if v == 0 {
                run += 1;
                continue;
            }
            for _ in 0..run / 16 {
                let (code, len) = self.ac.0[0xf0];
                w.put(code, len);
            }
            let (size, bits) = category(v);
            let (code, len) = self.ac.0[((run % 16) << 4) | usize::from(size)];
            w.put(code, len);
            w.put(bits, size);
            run = 0;
        }
        if last != 63 {
            let (code, len) = self.ac.0[0x00];
            w.put(code, len);
        }
    }
}

/// Appends a COM segment carrying the generation parameters the way the reference does:
/// "parameters", NUL, the text, NUL (the text cut to fit one segment), padded to an even
/// length with a 0xFF fill byte after the segment.
fn push_parameters(out: &mut Vec<u8>, parameters: &str) {
    const KEY: &[u8] = b"parameters\0";
    let len = (2 + KEY.len() + parameters.len() + 1).min(0xffff);
    out.extend_from_slice(&[0xff, 0xfe, (len >> 8) as u8, len as u8]);
    out.extend_from_slice(KEY);
    let text = parameters.as_bytes();
    let room = len.min(0xfffe) - 2 - KEY.len();
    if room <= text.len() {
        out.extend_from_slice(&text[..room]);
    } else {
        out.extend_from_slice(text);
        out.push(0);
    }
    if len > 0xfffe {
        out.push(0);
    }
    if len % 2 == 1 {
        out.push(0xff);
    }
}

/// Encodes `img` (1 to 4 channels: grey, grey + alpha, RGB, RGBA; alpha is dropped) as a
/// baseline JPEG. `quality` is 1..=100 (0 means 90); at 90 and below the chroma is
/// subsampled 2×2. A non-empty `parameters` goes into a COM segment.
pub fn encode(img: &Image, quality: i32, parameters: &str) -> Result<Vec<u8>, String> {
    let (w, h, c) = (img.width as usize, img.height as usize, img.channels as usize);
    if w == 0 || h == 0 || !(1..=4).contains(&c) || img.data.len() != w * h * c {
        return Err(format!("cannot encode a {}x{}x{} image with {} bytes as JPEG", img.width, img.height, img.channels, img.data.len()));
    }
    if w > 0xffff || h > 0xffff {
        return Err(format!("{w}x{h} is larger than JPEG allows (65535x65535)"));
    }
    let quality = if quality == 0 { 90 } else { quality };
    let subsample = quality <= 90;
    let quality = quality.clamp(1, 100);
    let scale = if quality < 50 { 5000 / quality } else { 200 - quality * 2 };
    let zigzag = zigzag_positions();
    let quantiser = |base: &[u16; 64]| -> [u8; 64] { std::array::from_fn(|i| ((i32::from(base[i]) * scale + 50) / 100).clamp(1, 255) as u8) };
    let (luma_q, chroma_q) = (quantiser(&LUMA_QUANT), quantiser(&CHROMA_QUANT));
    let reciprocal = |q: &[u8; 64]| -> [f32; 64] { std::array::from_fn(|k| 1.0 / (f32::from(q[k]) * AAN_SCALE[k / 8] * AAN_SCALE[k % 8])) };

    let mut out = Vec::with_capacity(w * h / 4 + 1024);
    out.extend_from_slice(&[0xff, 0xd8]);
    out.extend_from_slice(&[0xff, 0xe0, 0, 16, b'J', b'F', b'I', b'F', 0, 1, 1, 0, 0, 1, 0, 1, 0, 0]);
    out.extend_from_slice(&[0xff, 0xdb, 0, 0x84]);
    for (id, table) in [(0u8, &luma_q), (1, &chroma_q)] {
        out.push(id);
        let mut zz = [0u8; 64];
        for (k, &q) in table.iter().enumerate() {
            zz[zigzag[k]] = q;
        }
        out.extend_from_slice(&zz);
    }
    if !parameters.is_empty() {
        push_parameters(&mut out, parameters);
    }
    let luma_sampling = if subsample { 0x22 } else { 0x11 };
    out.extend_from_slice(&[0xff, 0xc0, 0, 17, 8, (h >> 8) as u8, h as u8, (w >> 8) as u8, w as u8, 3]);
    out.extend_from_slice(&[1, luma_sampling, 0, 2, 0x11, 1, 3, 0x11, 1]);
    out.extend_from_slice(&[0xff, 0xc4, 0x01, 0xa2]);
    for (class_id, (counts, symbols)) in [(0x00u8, DC_LUMA), (0x10, AC_LUMA), (0x01, DC_CHROMA), (0x11, AC_CHROMA)] {
        out.push(class_id);
        out.extend_from_slice(&counts);
        out.extend_from_slice(symbols);
    }
    out.extend_from_slice(&[0xff, 0xda, 0, 12, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 0x3f, 0]);

    let codes = [Codes::new(&DC_LUMA.0, DC_LUMA.1), Codes::new(&AC_LUMA.0, AC_LUMA.1), Codes::new(&DC_CHROMA.0, DC_CHROMA.1), Codes::new(&AC_CHROMA.0, AC_CHROMA.1)];
    let mut y = Component { scale: reciprocal(&luma_q), dc: &codes[0], ac: &codes[1], last_dc: 0 };
    let mut cb = Component { scale: reciprocal(&chroma_q), dc: &codes[2], ac: &codes[3], last_dc: 0 };
    let mut cr = Component { scale: reciprocal(&chroma_q), dc: &codes[2], ac: &codes[3], last_dc: 0 };
    let (g_off, b_off) = if c > 2 { (1, 2) } else { (0, 0) };
    // The YCbCr samples of the `n`×`n` pixels from (x0, y0), edges repeated.
    let convert = |x0: usize, y0: usize, n: usize, ys: &mut [f32], us: &mut [f32], vs: &mut [f32]| {
        for row in 0..n {
            let line = (y0 + row).min(h - 1) * w;
            for col in 0..n {
                let p = (line + (x0 + col).min(w - 1)) * c;
                let (r, g, b) = (f32::from(img.data[p]), f32::from(img.data[p + g_off]), f32::from(img.data[p + b_off]));
                let i = row * n + col;
                ys[i] = 0.299 * r + 0.587 * g + 0.114 * b - 128.0;
                us[i] = -0.16874 * r - 0.33126 * g + 0.5 * b;
                vs[i] = 0.5 * r - 0.41869 * g - 0.08131 * b;
            }
        }
    };
    let mut bits = BitWriter { out: &mut out, buf: 0, count: 0 };
    if subsample {
        let (mut ys, mut us, mut vs) = ([0f32; 256], [0f32; 256], [0f32; 256]);
        for y0 in (0..h).step_by(16) {
            for x0 in (0..w).step_by(16) {
                convert(x0, y0, 16, &mut ys, &mut us, &mut vs);
                for (bx, by) in [(0, 0), (8, 0), (0, 8), (8, 8)] {
                    y.encode(&mut bits, &zigzag, std::array::from_fn(|i| ys[(by + i / 8) * 16 + bx + i % 8]));
                }
                let average = |s: &[f32; 256]| -> [f32; 64] {
                    std::array::from_fn(|i| {
                        let j = (i / 8) * 32 + (i % 8) * 2;
                        (s[j] + s[j + 1] + s[j + 16] + s[j + 17]) * 0.25
                    })
                };
                cb.encode(&mut bits, &zigzag, average(&us));
                cr.encode(&mut bits, &zigzag, average(&vs));
            }
        }
    } else {
        let (mut ys, mut us, mut vs) = ([0f32; 64], [0f32; 64], [0f32; 64]);
        for y0 in (0..h).step_by(8) {
            for x0 in (0..w).step_by(8) {
                convert(x0, y0, 8, &mut ys, &mut us, &mut vs);
                y.encode(&mut bits, &zigzag, ys);
                cb.encode(&mut bits, &zigzag, us);
                cr.encode(&mut bits, &zigzag, vs);
            }
        }
    }
    bits.finish();
    out.extend_from_slice(&[0xff, 0xd9]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_order() {
        let z = zigzag_positions();
        // Row-major index -> scan position for the start and end of the scan.
        assert_eq!([z[0], z[1], z[8], z[16], z[9], z[2], z[3]], [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!([z[63], z[62], z[55], z[47]], [63, 62, 61, 60]);
        let mut seen = z.to_vec();
        seen.sort_unstable();
        assert_eq!(seen, (0..64).collect::<Vec<_>>());
    }

    #[test]
    fn canonical_codes_of_the_typical_tables() {
        let dc = Codes::new(&DC_LUMA.0, DC_LUMA.1);
        assert_eq!(&dc.0[..12], &[(0, 2), (2, 3), (3, 3), (4, 3), (5, 3), (6, 3), (14, 4), (30, 5), (62, 6), (126, 7), (254, 8), (510, 9)]);
        let ac = Codes::new(&AC_LUMA.0, AC_LUMA.1);
        assert_eq!([ac.0[0x00], ac.0[0x01], ac.0[0xf0], ac.0[0xfa]], [(10, 4), (0, 2), (2041, 11), (65534, 16)]);
        let ac = Codes::new(&AC_CHROMA.0, AC_CHROMA.1);
        assert_eq!([ac.0[0x00], ac.0[0xe1], ac.0[0xf0]], [(0, 2), (16352, 14), (1018, 10)]);
    }

    #[test]
    fn categories() {
        assert_eq!(category(1), (1, 1));
        assert_eq!(category(-1), (1, 0));
        assert_eq!(category(5), (3, 5));
        assert_eq!(category(-5), (3, 2));
        assert_eq!(category(-1024), (11, 1023));
    }

    #[test]
    fn parameters_segment() {
        let mut out = Vec::new();
        push_parameters(&mut out, "abc");
        // Length 2 + 11 + 3 + 1 = 17 (odd): one fill byte after the segment.
        assert_eq!(out, [&[0xff, 0xfe, 0, 17][..], b"parameters\0abc\0", &[0xff]].concat());
        let mut long = Vec::new();
        push_parameters(&mut long, &"x".repeat(70000));
        assert_eq!(&long[2..4], &[0xff, 0xff]);
        assert_eq!(long.len(), 2 + 0xffff + 1);
        assert_eq!(&long[long.len() - 2..], &[0, 0xff]);
    }

    #[test]
    fn bad_images_are_refused() {
        assert!(encode(&Image { width: 2, height: 2, channels: 3, data: vec![0; 5] }, 90, "").is_err());
        assert!(encode(&Image { width: 0, height: 2, channels: 3, data: vec![] }, 90, "").is_err());
        assert!(encode(&Image { width: 1, height: 1, channels: 5, data: vec![0; 5] }, 90, "").is_err());
    }
}
