//! Host-side image and latent operations of the generation pipeline: converting between
//! 8-bit images and [W, H, C, N] tensors, nearest resizing, mask reductions and pooling.
//! They follow the reference's element order and rounding, because their results feed
//! the networks whose outputs are compared pixel by pixel.

use crate::error::Result;
use crate::image::Image;
use crate::tensor::Tensor;

/// One 8-bit value in [0, 1] (the reference's float → byte conversion: round half up,
/// saturating).
pub fn float_to_u8(v: f32) -> u8 {
    if v <= 0.0 {
        0
    } else if v >= 1.0 {
        255
    } else {
        (v * 255.0 + 0.5) as u8
    }
}

/// An image as [W, H, C, 1] in [0, 1], resized with nearest sampling to `size` when given
/// and different.
pub fn image_to_tensor(image: &Image, size: Option<(usize, usize)>) -> Result<Tensor> {
    let (w, h, c) = (image.width as usize, image.height as usize, image.channels as usize);
    ensure!(w > 0 && h > 0 && c > 0, "image of {w}x{h} with {c} channels is empty");
    ensure!(
        image.data.len() == w * h * c,
        "image of {w}x{h}x{c} has {} bytes, expected {}",
        image.data.len(),
        w * h * c
    );
    let mut data = vec![0f32; w * h * c];
    for y in 0..h {
        for x in 0..w {
            for ch in 0..c {
                data[x + w * (y + h * ch)] = image.data[(y * w + x) * c + ch] as f32 / 255.0;
            }
        }
    }
    let t = Tensor::from_vec(&[w, h, c, 1], data)?;
    match size {
        Some((tw, th)) if (tw, th) != (w, h) => resize_nearest(&t, &[tw, th, c, 1]),
        _ => Ok(t),
    }
}

/// Item `index` of a [W, H, C, N] tensor in [0, 1] as an 8-bit image of C channels.
pub fn tensor_to_image(t: &Tensor, index: usize) -> Result<Image> {
    let (w, h, c, n) = (t.ne(0), t.ne(1), t.ne(2), t.ne(3));
    ensure!(t.shape().len() <= 4 && index < n, "no image {index} in a tensor of shape {:?}", t.shape());
    let plane = w * h;
    let item = &t.data()[index * plane * c..(index + 1) * plane * c];
    let mut data = vec![0u8; plane * c];
    for p in 0..plane {
        for ch in 0..c {
            data[p * c + ch] = float_to_u8(item[p + plane * ch]);
        }
    }
    Image::new(w as u32, h as u32, c as u32, data).ok_or_else(|| crate::error::Error::new("decoded image too large"))
}

fn padded_shape(t: &Tensor) -> [usize; 4] {
    [t.ne(0), t.ne(1), t.ne(2), t.ne(3)]
}

fn flat(shape: &[usize; 4], i: [usize; 4]) -> usize {
    i[0] + shape[0] * (i[1] + shape[1] * (i[2] + shape[2] * i[3]))
}

/// Nearest resize of every dimension: output index o reads input index `o * in / out`.
pub fn resize_nearest(t: &Tensor, out: &[usize; 4]) -> Result<Tensor> {
    let inp = padded_shape(t);
    ensure!(t.shape().len() <= 4, "cannot resize a tensor of shape {:?}", t.shape());
    ensure!(out.iter().all(|&d| d > 0) && inp.iter().all(|&d| d > 0), "cannot resize {inp:?} to {out:?}");
    let mut data = Vec::with_capacity(out.iter().product());
    for i3 in 0..out[3] {
        for i2 in 0..out[2] {
            for i1 in 0..out[1] {
                for i0 in 0..out[0] {
                    let src = [i0 * inp[0] / out[0], i1 * inp[1] / out[1], i2 * inp[2] / out[2], i3 * inp[3] / out[3]];
                    data.push(t.data()[flat(&inp, src)]);
                }
            }
        }
    }
    Tensor::from_vec(out, data)
}

/// Resize to `out` where every output element is the maximum of the input elements it
/// covers (windows `[o * in / out, ceil((o + 1) * in / out))` in every dimension). Without
/// any downsampling this is a nearest resize, like the reference.
pub fn resize_nearest_max(t: &Tensor, out: &[usize; 4]) -> Result<Tensor> {
    let inp = padded_shape(t);
    if (0..4).all(|d| inp[d] <= out[d]) {
        return resize_nearest(t, out);
    }
    ensure!(out.iter().all(|&d| d > 0) && inp.iter().all(|&d| d > 0), "cannot resize {inp:?} to {out:?}");
    let window = |d: usize, o: usize| (o * inp[d] / out[d], ((o + 1) * inp[d]).div_ceil(out[d]).min(inp[d]));
    let mut data = Vec::with_capacity(out.iter().product());
    for o3 in 0..out[3] {
        let r3 = window(3, o3);
        for o2 in 0..out[2] {
            let r2 = window(2, o2);
            for o1 in 0..out[1] {
                let r1 = window(1, o1);
                for o0 in 0..out[0] {
                    let r0 = window(0, o0);
                    let mut m = f32::MIN;
                    for i3 in r3.0..r3.1 {
                        for i2 in r2.0..r2.1 {
                            for i1 in r1.0..r1.1 {
                                for i0 in r0.0..r0.1 {
                                    m = m.max(t.data()[flat(&inp, [i0, i1, i2, i3])]);
                                }
                            }
                        }
                    }
                    data.push(m);
                }
            }
        }
    }
    Tensor::from_vec(out, data)
}

/// 3×3 max pooling over dimensions 0 and 1 with stride 1 and padding 1 (same size).
pub fn max_pool_3x3(t: &Tensor) -> Tensor {
    let s = padded_shape(t);
    let mut out = t.clone();
    for i3 in 0..s[3] {
        for i2 in 0..s[2] {
            for i1 in 0..s[1] {
                for i0 in 0..s[0] {
                    let mut m = f32::MIN;
                    for j1 in i1.saturating_sub(1)..(i1 + 2).min(s[1]) {
                        for j0 in i0.saturating_sub(1)..(i0 + 2).min(s[0]) {
                            m = m.max(t.data()[flat(&s, [j0, j1, i2, i3])]);
                        }
                    }
                    out.data_mut()[flat(&s, [i0, i1, i2, i3])] = m;
                }
            }
        }
    }
    out
}

/// Concatenation of two [W, H, C, 1] tensors along the channels.
pub fn concat_channels(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    ensure!(
        a.ne(0) == b.ne(0) && a.ne(1) == b.ne(1) && a.ne(3) == 1 && b.ne(3) == 1,
        "cannot concatenate {:?} and {:?} along channels",
        a.shape(),
        b.shape()
    );
    let mut data = a.data().to_vec();
    data.extend_from_slice(b.data());
    Tensor::from_vec(&[a.ne(0), a.ne(1), a.ne(2) + b.ne(2), 1], data)
}

/// `f(a, b)` elementwise where `b` has one channel (broadcast) or as many as `a`.
pub fn zip_channels(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32) -> Result<Tensor> {
    let plane = a.ne(0) * a.ne(1);
    ensure!(
        b.ne(0) == a.ne(0) && b.ne(1) == a.ne(1) && b.ne(3) == a.ne(3) && (b.ne(2) == 1 || b.ne(2) == a.ne(2)),
        "shapes {:?} and {:?} do not broadcast",
        a.shape(),
        b.shape()
    );
    let (ca, cb) = (a.ne(2), b.ne(2));
    let data = a
        .data()
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let (p, ch, n) = (i % plane, (i / plane) % ca, i / (plane * ca));
            let bc = if cb == 1 { 0 } else { ch };
            f(x, b.data()[p + plane * (bc + cb * n)])
        })
        .collect();
    Tensor::from_vec(a.shape(), data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_round_trip_and_rounding() {
        let img = Image::new(2, 1, 3, vec![0, 128, 255, 10, 20, 30]).unwrap();
        let t = image_to_tensor(&img, None).unwrap();
        assert_eq!(t.shape(), &[2, 1, 3, 1]);
        assert_eq!(t.data()[1], 10.0 / 255.0);
        assert_eq!(tensor_to_image(&t, 0).unwrap(), img);
        assert_eq!(float_to_u8(0.5), 128);
        assert_eq!(float_to_u8(-1.0), 0);
        assert_eq!(float_to_u8(2.0), 255);
        let big = image_to_tensor(&img, Some((4, 2))).unwrap();
        assert_eq!(big.shape(), &[4, 2, 3, 1]);
        assert_eq!(big.data()[0..4], [0.0, 0.0, 10.0 / 255.0, 10.0 / 255.0]);
        assert!(image_to_tensor(&Image { width: 2, height: 2, channels: 1, data: vec![0; 3] }, None).is_err());
    }

    #[test]
    fn mask_reductions() {
        // 4x2 single channel, downsample to 2x1 with max.
        let t = Tensor::from_vec(&[4, 2, 1, 1], vec![0., 1., 0., 0., 0., 0., 0., 0.5]).unwrap();
        let m = resize_nearest_max(&t, &[2, 1, 1, 1]).unwrap();
        assert_eq!(m.data(), &[1.0, 0.5]);
        // Channels are reduced as well.
        let t3 = Tensor::from_vec(&[1, 1, 3, 1], vec![0.2, 0.9, 0.1]).unwrap();
        assert_eq!(resize_nearest_max(&t3, &[1, 1, 1, 1]).unwrap().data(), &[0.9]);
        let p = max_pool_3x3(&Tensor::from_vec(&[3, 3, 1, 1], vec![0., 0., 0., 0., 0., 0., 0., 0., 1.]).unwrap());
        assert_eq!(p.data(), &[0., 0., 0., 0., 1., 1., 0., 1., 1.]);
        let a = Tensor::full(&[1, 1, 2, 1], 2.0);
        let b = Tensor::full(&[1, 1, 1, 1], 3.0);
        assert_eq!(zip_channels(&a, &b, |x, y| x * y).unwrap().data(), &[6.0, 6.0]);
        assert_eq!(concat_channels(&b, &a).unwrap().shape(), &[1, 1, 3, 1]);
    }
}
