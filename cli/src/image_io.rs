//! Reading input images (PNG, JPEG, WebP) and writing PNG, JPEG or WebP results.
//!
//! Inputs are converted to the channel count the request needs and, when a target size is
//! given, centre-cropped to its aspect ratio and resampled with a box filter in linear light,
//! as the reference program does. PNG outputs carry the generation parameters in a `tEXt`
//! chunk with the key `parameters`, right after the header (JPEG outputs in a COM segment,
//! WebP outputs in the reference's XMP packet); every output is written to a temporary file
//! that is renamed into place.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use stable_diffusion::api::Image;

/// The largest decoded image accepted (bytes of 8-bit samples).
const MAX_DECODED_BYTES: usize = 1 << 30;

/// Output formats recognised by extension (case-insensitive), like the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Png,
    Jpeg,
    Webp,
    Unknown,
}

pub fn format_of(path: &Path) -> Format {
    let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    match ext.as_str() {
        "png" => Format::Png,
        "jpg" | "jpeg" | "jpe" => Format::Jpeg,
        "webp" => Format::Webp,
        _ => Format::Unknown,
    }
}

/// Decodes to 8-bit samples, keeping the file's channel count (palettes expanded).
fn decode_png(bytes: &[u8]) -> Result<Image, String> {
    let mut dec = png::Decoder::new_with_limits(bytes, png::Limits { bytes: MAX_DECODED_BYTES });
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().map_err(|e| e.to_string())?;
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).map_err(|e| e.to_string())?;
    buf.truncate(info.buffer_size());
    let channels = match info.color_type {
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Indexed => return Err("unexpanded palette".into()),
    };
    Ok(Image::new(info.width, info.height, channels, buf).ok_or("inconsistent PNG size")?)
}

fn decode_jpeg(bytes: &[u8]) -> Result<Image, String> {
    let mut dec = jpeg_decoder::Decoder::new(bytes);
    dec.set_max_decoding_buffer_size(MAX_DECODED_BYTES);
    let pixels = dec.decode().map_err(|e| e.to_string())?;
    let info = dec.info().ok_or("no JPEG header")?;
    let (w, h) = (u32::from(info.width), u32::from(info.height));
    let (channels, data) = match info.pixel_format {
        jpeg_decoder::PixelFormat::L8 => (1, pixels),
        jpeg_decoder::PixelFormat::L16 => (1, pixels.chunks_exact(2).map(|c| c[0]).collect()),
        jpeg_decoder::PixelFormat::RGB24 => (3, pixels),
        jpeg_decoder::PixelFormat::CMYK32 => (
            3,
            pixels
                .chunks_exact(4)
                .flat_map(|p| {
                    let k = u16::from(p[3]);
                    [0, 1, 2].map(|i| (u16::from(p[i]) * k / 255) as u8)
                })
                .collect(),
        ),
    };
    Ok(Image::new(w, h, channels, data).ok_or("inconsistent JPEG size")?)
}

/// Decodes a still WebP (the first frame of an animated one) to RGB or RGBA.
fn decode_webp(bytes: &[u8]) -> Result<Image, String> {
    let mut dec = image_webp::WebPDecoder::new(std::io::Cursor::new(bytes)).map_err(|e| e.to_string())?;
    dec.set_memory_limit(MAX_DECODED_BYTES);
    let size = dec.output_buffer_size().ok_or("WebP image too large")?;
    if size > MAX_DECODED_BYTES {
        return Err("WebP image too large".into());
    }
    let mut buf = vec![0; size];
    dec.read_image(&mut buf).map_err(|e| e.to_string())?;
    let (w, h) = dec.dimensions();
    let channels = if dec.has_alpha() { 4 } else { 3 };
    Ok(Image::new(w, h, channels, buf).ok_or("inconsistent WebP size")?)
}

/// The luma stb_image uses when it drops colour.
fn luma(r: u8, g: u8, b: u8) -> u8 {
    ((u32::from(r) * 77 + u32::from(g) * 150 + u32::from(b) * 29) >> 8) as u8
}

/// Converts between 1 (grey), 2 (grey+alpha), 3 (RGB) and 4 (RGBA) channels.
pub fn convert_channels(img: &Image, to: u32) -> Image {
    let from = img.channels;
    if from == to {
        return img.clone();
    }
    let mut data = Vec::with_capacity(img.width as usize * img.height as usize * to as usize);
    for px in img.data.chunks_exact(from as usize) {
        let (grey, rgb, alpha) = match from {
            1 => (px[0], [px[0]; 3], 255),
            2 => (px[0], [px[0]; 3], px[1]),
            3 => (luma(px[0], px[1], px[2]), [px[0], px[1], px[2]], 255),
            _ => (luma(px[0], px[1], px[2]), [px[0], px[1], px[2]], px[3]),
        };
        match to {
            1 => data.push(grey),
            2 => data.extend([grey, alpha]),
            3 => data.extend(rgb),
            _ => data.extend([rgb[0], rgb[1], rgb[2], alpha]),
        }
    }
    Image { width: img.width, height: img.height, channels: to, data }
}

fn srgb_to_linear(v: u8) -> f32 {
    let s = f32::from(v) / 255.0;
    if s <= 0.04045 {
        s / 12.92
    } else {
        ((s + 0.055) / 1.055).powf(2.4)
    }
}

fn linear_to_srgb(l: f32) -> u8 {
    let l = l.clamp(0.0, 1.0);
    let s = if l <= 0.003_130_8 { l * 12.92 } else { 1.055 * l.powf(1.0 / 2.4) - 0.055 };
    (s * 255.0 + 0.5).clamp(0.0, 255.0) as u8
}

/// For each output position, the (source index, weight) pairs of a box filter that maps
/// `src` samples onto `dst` (each output sample averages the source area it covers).
fn box_weights(src: usize, dst: usize) -> Vec<Vec<(usize, f32)>> {
    let scale = src as f64 / dst as f64;
    (0..dst)
        .map(|j| {
            let (lo, hi) = (j as f64 * scale, (j + 1) as f64 * scale);
            let first = lo.floor() as usize;
            let last = (hi.ceil() as usize).min(src);
            (first..last)
                .filter_map(|i| {
                    let overlap = (hi.min(i as f64 + 1.0) - lo.max(i as f64)).max(0.0);
                    (overlap > 0.0).then_some((i, (overlap / scale) as f32))
                })
                .collect()
        })
        .collect()
}

/// Box-filter resampling in linear light (inputs and outputs are sRGB-encoded).
pub fn resize(img: &Image, width: u32, height: u32) -> Image {
    let c = img.channels as usize;
    let (sw, sh, dw, dh) = (img.width as usize, img.height as usize, width as usize, height as usize);
    let linear: Vec<f32> = img.data.iter().map(|&v| srgb_to_linear(v)).collect();
    let wx = box_weights(sw, dw);
    let wy = box_weights(sh, dh);
    let mut rows = vec![0f32; sh * dw * c];
    for y in 0..sh {
        for (x, taps) in wx.iter().enumerate() {
            for ch in 0..c {
                rows[(y * dw + x) * c + ch] = taps.iter().map(|&(i, w)| linear[(y * sw + i) * c + ch] * w).sum();
            }
        }
    }
    let mut data = vec![0u8; dw * dh * c];
    for (y, taps) in wy.iter().enumerate() {
        for x in 0..dw {
            for ch in 0..c {
                let v: f32 = taps.iter().map(|&(i, w)| rows[(i * dw + x) * c + ch] * w).sum();
                data[(y * dw + x) * c + ch] = linear_to_srgb(v);
            }
        }
    }
    Image { width, height, channels: img.channels, data }
}

/// The centred region of `img` with the aspect ratio `w:h`, or `img` when it already has it.
pub fn crop_to_aspect(img: &Image, w: u32, h: u32) -> Image {
    let (iw, ih) = (img.width as f32, img.height as f32);
    let dst = w as f32 / h as f32;
    let src = iw / ih;
    let (cw, chh) = if src > dst {
        (((ih * dst) as u32).max(1), img.height)
    } else if src < dst {
        (img.width, ((iw / dst) as u32).max(1))
    } else {
        return img.clone();
    };
    let (x0, y0) = ((img.width - cw) / 2, (img.height - chh) / 2);
    if x0 == 0 && y0 == 0 {
        return img.clone();
    }
    stable_diffusion::sd_info!("crop input image from {}x{} to {cw}x{chh}", img.width, img.height);
    let c = img.channels as usize;
    let mut data = Vec::with_capacity(cw as usize * chh as usize * c);
    for row in y0..y0 + chh {
        let start = (row as usize * img.width as usize + x0 as usize) * c;
        data.extend_from_slice(&img.data[start..start + cw as usize * c]);
    }
    Image { width: cw, height: chh, channels: img.channels, data }
}

/// Loads an image file with `channels` channels; with `size`, crops and resizes it to that
/// size. A file with fewer channels than asked (e.g. a grey init image) is refused, like the
/// reference does.
pub fn load_image(path: &str, size: Option<(u32, u32)>, channels: u32) -> Result<Image, String> {
    let mut bytes = Vec::new();
    File::open(path).and_then(|f| BufReader::new(f).read_to_end(&mut bytes)).map_err(|e| format!("load image from '{path}' failed: {e}"))?;
    decode_image(&bytes, path, size, channels)
}

/// `load_image` on the bytes of a file already read (or received: sd-server's requests);
/// `path` names them in the messages.
pub fn decode_image(bytes: &[u8], path: &str, size: Option<(u32, u32)>, channels: u32) -> Result<Image, String> {
    let img = if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        decode_png(bytes)
    } else if bytes.starts_with(&[0xff, 0xd8]) {
        decode_jpeg(bytes)
    } else if bytes.len() >= 12 && bytes.starts_with(b"RIFF") && &bytes[8..12] == b"WEBP" {
        decode_webp(bytes)
    } else {
        Err("not a PNG, JPEG or WebP file".into())
    }
    .map_err(|e| format!("load image from '{path}' failed: {e}"))?;
    if img.channels < channels {
        return Err(format!(
            "the number of channels for the input image must be >= {channels}, but got {} channels, image_path = {path}",
            img.channels
        ));
    }
    if img.width == 0 || img.height == 0 {
        return Err(format!("error: the size of image must be greater than 0, image_path = {path}"));
    }
    let mut img = convert_channels(&img, channels);
    if let Some((w, h)) = size.filter(|&(w, h)| w > 0 && h > 0 && (w, h) != (img.width, img.height)) {
        img = crop_to_aspect(&img, w, h);
        stable_diffusion::sd_info!("resize input image from {}x{} to {w}x{h}", img.width, img.height);
        img = resize(&img, w, h);
    }
    Ok(img)
}

/// Writes `bytes` to `path` through a temporary file in the same directory, so that `path`
/// is either untouched or complete.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp: PathBuf = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = BufWriter::new(File::create(&tmp)?);
        f.write_all(bytes)?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Encodes a PNG; `parameters`, when not empty, goes into a `tEXt` chunk named `parameters`
/// (its bytes as given, UTF-8 included, as the reference writes them).
pub fn encode_png(img: &Image, parameters: &str) -> Result<Vec<u8>, String> {
    let color = match img.channels {
        1 => png::ColorType::Grayscale,
        2 => png::ColorType::GrayscaleAlpha,
        3 => png::ColorType::Rgb,
        4 => png::ColorType::Rgba,
        n => return Err(format!("cannot write an image with {n} channels")),
    };
    let expected = img.width as usize * img.height as usize * img.channels as usize;
    if img.data.len() != expected || img.width == 0 || img.height == 0 {
        return Err(format!("invalid image {}x{}x{} with {} bytes", img.width, img.height, img.channels, img.data.len()));
    }
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, img.width, img.height);
    enc.set_color(color);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().map_err(|e| e.to_string())?;
    if !parameters.is_empty() {
        let mut chunk = b"parameters\0".to_vec();
        chunk.extend_from_slice(parameters.as_bytes());
        w.write_chunk(png::chunk::tEXt, &chunk).map_err(|e| e.to_string())?;
    }
    w.write_image_data(&img.data).map_err(|e| e.to_string())?;
    w.finish().map_err(|e| e.to_string())?;
    Ok(out)
}

/// The XMP packet the reference puts in a WebP's `XMP ` chunk: the parameters, XML-escaped,
/// as `sdcpp:parameters`.
pub fn webp_xmp_packet(parameters: &str) -> String {
    let mut escaped = String::with_capacity(parameters.len());
    for c in parameters.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            c => escaped.push(c),
        }
    }
    format!(
        "<?xpacket begin=\"\" id=\"W5M0MpCehiHzreSzNTczkc9d\"?>\n<x:xmpmeta xmlns:x=\"adobe:ns:meta/\">\n  \
         <rdf:RDF xmlns:rdf=\"http://www.w3.org/1999/02/22-rdf-syntax-ns#\">\n    \
         <rdf:Description xmlns:sdcpp=\"https://github.com/leejet/stable-diffusion.cpp/ns/1.0/\">\n      \
         <sdcpp:parameters>{escaped}</sdcpp:parameters>\n    </rdf:Description>\n  </rdf:RDF>\n</x:xmpmeta>\n<?xpacket end=\"w\"?>"
    )
}

/// Encodes a lossless WebP (the reference writes lossy VP8 at quality 90 with libwebp; no
/// maintained pure-Rust lossy encoder exists). `parameters`, when not empty, goes into an
/// `XMP ` chunk after the image (with a VP8X header), as the reference's writer puts it. Grey
/// images are written as RGB, as the reference does; grey+alpha is refused like there.
pub fn encode_webp(img: &Image, parameters: &str) -> Result<Vec<u8>, String> {
    let expected = img.width as usize * img.height as usize * img.channels as usize;
    if img.data.len() != expected || img.width == 0 || img.height == 0 || img.width > 16384 || img.height > 16384 {
        return Err(format!("invalid image {}x{}x{} with {} bytes for WebP (at most 16384x16384)", img.width, img.height, img.channels, img.data.len()));
    }
    let (pixels, color) = match img.channels {
        1 => (convert_channels(img, 3).data, image_webp::ColorType::Rgb8),
        3 => (img.data.clone(), image_webp::ColorType::Rgb8),
        4 => (img.data.clone(), image_webp::ColorType::Rgba8),
        n => return Err(format!("cannot write an image with {n} channels as WebP")),
    };
    let mut out = Vec::new();
    let mut enc = image_webp::WebPEncoder::new(&mut out);
    if !parameters.is_empty() {
        enc.set_xmp_metadata(webp_xmp_packet(parameters).into_bytes());
    }
    enc.encode(&pixels, img.width, img.height, color).map_err(|e| format!("WebP encoding failed: {e}"))?;
    Ok(out)
}

/// Writes `img` to `path` with its generation parameters: PNG (a `tEXt` chunk), JPEG
/// (quality 90, a COM segment) or WebP (lossless, an XMP packet), chosen by the extension as
/// the reference does.
pub fn write_image(path: &Path, img: &Image, parameters: &str) -> Result<(), String> {
    let bytes = match format_of(path) {
        Format::Png => encode_png(img, parameters)?,
        Format::Jpeg => crate::jpeg::encode(img, crate::jpeg::REFERENCE_QUALITY, parameters)?,
        Format::Webp => encode_webp(img, parameters)?,
        Format::Unknown => return Err(format!("{}: unknown image format", path.display())),
    };
    write_atomically(path, &bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// The `tEXt` chunks of a PNG file as (key, raw text bytes), in file order.
pub fn png_text_chunks(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut rest = bytes.strip_prefix(b"\x89PNG\r\n\x1a\n".as_slice()).ok_or("not a PNG file")?;
    let mut out = Vec::new();
    while rest.len() >= 12 {
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let kind = &rest[4..8];
        let body = rest.get(8..8 + len).ok_or("truncated chunk")?;
        if kind == b"tEXt" {
            let nul = body.iter().position(|&b| b == 0).ok_or("tEXt chunk without a key")?;
            out.push((String::from_utf8_lossy(&body[..nul]).into_owned(), body[nul + 1..].to_vec()));
        }
        rest = rest.get(12 + len..).ok_or("truncated chunk")?;
    }
    Ok(out)
}

/// Decodes a PNG file's pixels (8-bit, channels as stored), for tests and previews.
pub fn decode_png_file(path: &Path) -> Result<Image, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    decode_png(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(w: u32, h: u32, c: u32, f: impl Fn(u32, u32, u32) -> u8) -> Image {
        let data = (0..h).flat_map(|y| (0..w).flat_map(move |x| (0..c).map(move |ch| (x, y, ch)))).map(|(x, y, ch)| f(x, y, ch)).collect();
        Image::new(w, h, c, data).unwrap()
    }

    #[test]
    fn png_round_trip_keeps_pixels_and_parameters() {
        let im = img(5, 3, 3, |x, y, c| (x * 40 + y * 7 + c) as u8);
        let params = "a cat, ünïcode\nSteps: 4, CFG scale: 7.000000";
        let bytes = encode_png(&im, params).unwrap();
        // The chunk sits right after IHDR (33 bytes in), before the pixel data.
        assert_eq!(&bytes[33 + 4..33 + 8], b"tEXt");
        assert_eq!(png_text_chunks(&bytes).unwrap(), vec![("parameters".to_string(), params.as_bytes().to_vec())]);
        assert_eq!(decode_png(&bytes).unwrap(), im);
        assert!(png_text_chunks(&encode_png(&im, "").unwrap()).unwrap().is_empty());
    }

    #[test]
    fn channel_conversions() {
        let rgba = img(2, 1, 4, |x, _, c| [10, 200, 30, 99][c as usize] + x as u8);
        assert_eq!(convert_channels(&rgba, 3).data, vec![10, 200, 30, 11, 201, 31]);
        assert_eq!(convert_channels(&rgba, 1).data, vec![luma(10, 200, 30), luma(11, 201, 31)]);
        let grey = img(1, 1, 1, |_, _, _| 7);
        assert_eq!(convert_channels(&grey, 4).data, vec![7, 7, 7, 255]);
    }

    #[test]
    fn resize_averages_and_preserves_flat_colour() {
        let flat = img(8, 6, 3, |_, _, c| [12, 128, 250][c as usize]);
        let small = resize(&flat, 3, 2);
        assert!(small.data.chunks(3).all(|p| p == [12, 128, 250]));
        let big = resize(&flat, 16, 12);
        assert!(big.data.chunks(3).all(|p| p == [12, 128, 250]));
        // Two pixels, black and white, average to mid grey in linear light (sRGB 188).
        let bw = img(2, 1, 1, |x, _, _| if x == 0 { 0 } else { 255 });
        assert_eq!(resize(&bw, 1, 1).data, vec![188]);
    }

    #[test]
    fn crop_keeps_the_centre() {
        let wide = img(8, 4, 1, |x, _, _| x as u8);
        let sq = crop_to_aspect(&wide, 1, 1);
        assert_eq!((sq.width, sq.height), (4, 4));
        assert_eq!(&sq.data[..4], &[2, 3, 4, 5]);
    }

    #[test]
    fn load_resizes_and_rejects_too_few_channels() {
        let dir = std::env::temp_dir().join(format!("sd-cli-img-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("in.png");
        write_image(&p, &img(16, 8, 4, |_, _, c| 50 + c as u8), "").unwrap();
        let loaded = load_image(p.to_str().unwrap(), Some((4, 4)), 3).unwrap();
        assert_eq!((loaded.width, loaded.height, loaded.channels), (4, 4, 3));
        assert!(loaded.data.chunks(3).all(|px| px == [50, 51, 52]));
        let as_is = load_image(p.to_str().unwrap(), None, 1).unwrap();
        assert_eq!((as_is.width, as_is.height, as_is.channels), (16, 8, 1));
        let g = dir.join("grey.png");
        write_image(&g, &img(2, 2, 1, |_, _, _| 9), "").unwrap();
        assert!(load_image(g.to_str().unwrap(), None, 3).unwrap_err().contains("must be >= 3"));
        assert!(load_image(dir.join("missing.png").to_str().unwrap(), None, 3).unwrap_err().contains("failed"));
        assert!(write_image(&dir.join("x.bmp"), &grey_px(), "").is_err());
        // WebP output is lossless: it reads back exactly, grey as RGB.
        let w = dir.join("x.webp");
        let rgba = img(7, 5, 4, |x, y, c| (x * 30 + y * 11 + c * 50) as u8);
        write_image(&w, &rgba, "p").unwrap();
        assert_eq!(load_image(w.to_str().unwrap(), None, 4).unwrap(), rgba);
        write_image(&w, &grey_px(), "").unwrap();
        assert_eq!(load_image(w.to_str().unwrap(), None, 3).unwrap().data, vec![0, 0, 0]);
        assert!(write_image(&w, &img(2, 2, 2, |_, _, _| 1), "").unwrap_err().contains("2 channels"));
        // JPEG output reads back through the JPEG input path.
        let j = dir.join("x.jpg");
        write_image(&j, &img(16, 8, 3, |_, _, c| 60 + 40 * c as u8), "params").unwrap();
        let back = load_image(j.to_str().unwrap(), None, 3).unwrap();
        assert_eq!((back.width, back.height), (16, 8));
        assert!(back.data.chunks(3).all(|px| px.iter().zip([60u8, 100, 140]).all(|(&a, b)| a.abs_diff(b) <= 2)), "{:?}", &back.data[..6]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn grey_px() -> Image {
        Image::new(1, 1, 1, vec![0]).unwrap()
    }
}
