//! ADetailer (`adetailer_ctx_t`): a YOLOv8 detector finds objects (faces, hands) in a picture;
//! each one found is cut out with a margin, scaled to the inpainting size, inpainted by an
//! ordinary image generation through the caller's context (the mask being the detection's
//! box, shifted, dilated or eroded), and blended back through a blurred copy of its mask.
//!
//! This is a job above the image pipeline: it never reaches into sampling, it hands
//! `generate` one inpainting request per detection. The numbers follow the reference's
//! `detailer.cpp` step for step (letterboxing, box decoding, NMS, masks, crop geometry,
//! blending) in the same f32 arithmetic, so its detections and pixels come out the same.

use super::loader::Weights;
use crate::error::{Context as _, Error, Result};
use crate::graph::{Component, DeviceMap, DeviceOptions, Loaded, Module};
use crate::image::Image;
use crate::models::detector::yolov8::{self, Yolov8, Yolov8Config, STRIDES};
use crate::params::{AdetailerCtxParams, AdetailerParams, ImgGenParams, PmParams, PulidParams};
use crate::tensor::Tensor;
use crate::types::{SampleMethod, Scheduler};
use std::time::Instant;

/// One object found: a box in image pixels, its score and class.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Detection {
    pub x1: f32,
    pub y1: f32,
    pub x2: f32,
    pub y2: f32,
    pub confidence: f32,
    pub class_id: usize,
}

impl Detection {
    fn area(&self) -> f32 {
        (self.x2 - self.x1).max(0.0) * (self.y2 - self.y1).max(0.0)
    }

    fn iou(&self, o: &Detection) -> f32 {
        let w = (self.x2.min(o.x2) - self.x1.max(o.x1)).max(0.0);
        let h = (self.y2.min(o.y2) - self.y1.max(o.y1)).max(0.0);
        let inter = w * h;
        let union = self.area() + o.area() - inter;
        if union > 0.0 {
            inter / union
        } else {
            0.0
        }
    }
}

/// The order masks are inpainted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortBy {
    /// As detected (by confidence).
    None,
    LeftToRight,
    CenterToEdge,
    Area,
}

/// Everything `extra_ad_args` can set, with the reference's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub input_size: i32,
    pub confidence: f32,
    pub nms_threshold: f32,
    pub max_detections: i32,
    pub mask_k_largest: i32,
    pub mask_min_ratio: f32,
    pub mask_max_ratio: f32,
    /// Positive: dilate the mask by a square of this side; negative: erode.
    pub dilate_erode: i32,
    pub x_offset: i32,
    /// Positive moves the mask up.
    pub y_offset: i32,
    pub merge_masks: bool,
    pub invert_mask: bool,
    /// Gaussian sigma (pixels) of the blending mask.
    pub mask_blur: i32,
    pub inpaint_padding: i32,
    pub inpaint_width: i32,
    pub inpaint_height: i32,
    pub denoising_strength: f32,
    /// 0: the request's.
    pub steps: i32,
    /// Negative: the request's.
    pub cfg_scale: f32,
    pub sample_method: Option<SampleMethod>,
    pub scheduler: Option<Scheduler>,
    pub sort_by: SortBy,
}

impl Settings {
    /// The defaults for an inpainting request (its size and strength).
    fn for_request(inpaint: &ImgGenParams) -> Settings {
        Settings {
            input_size: 640,
            confidence: 0.3,
            nms_threshold: 0.45,
            max_detections: 100,
            mask_k_largest: 0,
            mask_min_ratio: 0.0,
            mask_max_ratio: 1.0,
            dilate_erode: 4,
            x_offset: 0,
            y_offset: 0,
            merge_masks: false,
            invert_mask: false,
            mask_blur: 4,
            inpaint_padding: 32,
            inpaint_width: inpaint.width,
            inpaint_height: inpaint.height,
            denoising_strength: inpaint.strength,
            steps: 0,
            cfg_scale: -1.0,
            sample_method: None,
            scheduler: None,
            sort_by: SortBy::None,
        }
    }

    /// The defaults, then the `key=value` items of `extra` (comma-separated); any unknown
    /// key, unreadable value or setting out of range is an error naming it.
    pub fn parse(extra: Option<&str>, inpaint: &ImgGenParams) -> Result<Settings> {
        let mut s = Settings::for_request(inpaint);
        for item in extra.unwrap_or("").split(',').map(trim) {
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| Error::new(format!("invalid --extra-ad-args item '{item}'; expected key=value")))?;
            let (key, value) = (trim(key).to_lowercase(), trim(value));
            s.set(&key, value).map_err(|e| Error::new(e.unwrap_or_else(|| format!("invalid --extra-ad-args value '{key}={value}'"))))?;
        }
        ensure!(s.in_range(), "invalid --extra-ad-args parameter range");
        Ok(s)
    }

    /// Sets one key; `Err(None)` for an unreadable value, `Err(Some(message))` otherwise.
    fn set(&mut self, key: &str, value: &str) -> std::result::Result<(), Option<String>> {
        fn int(v: &str, to: &mut i32) -> std::result::Result<(), Option<String>> {
            *to = v.parse().map_err(|_| None)?;
            Ok(())
        }
        fn float(v: &str, to: &mut f32) -> std::result::Result<(), Option<String>> {
            *to = v.parse::<f32>().ok().filter(|f| f.is_finite()).ok_or(None)?;
            Ok(())
        }
        fn boolean(v: &str, to: &mut bool) -> std::result::Result<(), Option<String>> {
            *to = match v.to_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" => false,
                _ => return Err(None),
            };
            Ok(())
        }
        match key {
            "input_size" => int(value, &mut self.input_size),
            "confidence" => float(value, &mut self.confidence),
            "nms" | "nms_threshold" => float(value, &mut self.nms_threshold),
            "max_detections" => int(value, &mut self.max_detections),
            "mask_k_largest" => int(value, &mut self.mask_k_largest),
            "mask_min_ratio" => float(value, &mut self.mask_min_ratio),
            "mask_max_ratio" => float(value, &mut self.mask_max_ratio),
            "dilate_erode" => int(value, &mut self.dilate_erode),
            "x_offset" => int(value, &mut self.x_offset),
            "y_offset" => int(value, &mut self.y_offset),
            "merge_masks" => boolean(value, &mut self.merge_masks),
            "invert_mask" => boolean(value, &mut self.invert_mask),
            "mask_blur" => int(value, &mut self.mask_blur),
            "inpaint_padding" => int(value, &mut self.inpaint_padding),
            "inpaint_width" => int(value, &mut self.inpaint_width),
            "inpaint_height" => int(value, &mut self.inpaint_height),
            "denoising_strength" => float(value, &mut self.denoising_strength),
            "steps" => int(value, &mut self.steps),
            "cfg_scale" => float(value, &mut self.cfg_scale),
            "sample_method" => {
                self.sample_method = Some(SampleMethod::parse(value).ok_or(None)?);
                Ok(())
            }
            "scheduler" => {
                self.scheduler = Some(Scheduler::parse(value).ok_or(None)?);
                Ok(())
            }
            "sort_by" => {
                self.sort_by = match value.to_lowercase().as_str() {
                    "none" => SortBy::None,
                    "left_to_right" | "left-to-right" => SortBy::LeftToRight,
                    "center_to_edge" | "center-to-edge" => SortBy::CenterToEdge,
                    "area" => SortBy::Area,
                    _ => return Err(None),
                };
                Ok(())
            }
            "mask_mode" => {
                (self.merge_masks, self.invert_mask) = match value.to_lowercase().as_str() {
                    "none" => (false, false),
                    "merge" => (true, false),
                    "merge_invert" | "merge-invert" => (true, true),
                    _ => return Err(None),
                };
                Ok(())
            }
            _ => Err(Some(format!("unknown --extra-ad-args key '{key}'"))),
        }
    }

    fn in_range(&self) -> bool {
        let unit = |v: f32| (0.0..=1.0).contains(&v);
        self.input_size >= 32
            && self.input_size % 32 == 0
            && unit(self.confidence)
            && unit(self.nms_threshold)
            && self.max_detections > 0
            && self.mask_k_largest >= 0
            && self.mask_min_ratio >= 0.0
            && self.mask_max_ratio <= 1.0
            && self.mask_min_ratio <= self.mask_max_ratio
            && self.mask_blur >= 0
            && self.inpaint_padding >= 0
            && self.inpaint_width > 0
            && self.inpaint_height > 0
            && unit(self.denoising_strength)
            && self.steps >= 0
    }
}

fn trim(s: &str) -> &str {
    s.trim_matches([' ', '\t', '\r', '\n'])
}

// ------------------------------------------------------------------------------ pixels

/// Channel `c` of pixel (x, y) in [0, 1], coordinates clamped to the image; a grey image
/// gives its one channel for all three, others their last channel for the missing ones.
fn channel(img: &Image, x: i32, y: i32, c: usize) -> f32 {
    let x = x.clamp(0, img.width as i32 - 1) as usize;
    let y = y.clamp(0, img.height as i32 - 1) as usize;
    let ch = img.channels as usize;
    let source = if ch == 1 { 0 } else { c.min(ch - 1) };
    img.data[(y * img.width as usize + x) * ch + source] as f32 / 255.0
}

fn bilinear(img: &Image, x: f32, y: f32, c: usize) -> f32 {
    let (x0, y0) = (x.floor() as i32, y.floor() as i32);
    let (wx, wy) = (x - x0 as f32, y - y0 as f32);
    let a = channel(img, x0, y0, c) * (1.0 - wx) + channel(img, x0 + 1, y0, c) * wx;
    let b = channel(img, x0, y0 + 1, c) * (1.0 - wx) + channel(img, x0 + 1, y0 + 1, c) * wx;
    a * (1.0 - wy) + b * wy
}

fn to_byte(v: f32) -> u8 {
    (v.clamp(0.0, 255.0) + 0.5) as u8
}

/// A region of whole pixels, `x2`/`y2` exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Crop {
    x1: i32,
    y1: i32,
    x2: i32,
    y2: i32,
}

/// `crop` of `img` resized (bilinear, pixel centres) to `w`×`h` RGB.
fn resize_crop(img: &Image, crop: Crop, w: i32, h: i32) -> Image {
    let sx = (crop.x2 - crop.x1) as f32 / w as f32;
    let sy = (crop.y2 - crop.y1) as f32 / h as f32;
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        let fy = crop.y1 as f32 + (y as f32 + 0.5) * sy - 0.5;
        for x in 0..w {
            let fx = crop.x1 as f32 + (x as f32 + 0.5) * sx - 0.5;
            data.extend((0..3).map(|c| to_byte(bilinear(img, fx, fy, c) * 255.0)));
        }
    }
    Image { width: w as u32, height: h as u32, channels: 3, data }
}

/// A one-channel mask (0 or 255, or blurred in between) of the image's size.
#[derive(Clone, Debug, PartialEq)]
struct Mask {
    w: i32,
    h: i32,
    data: Vec<u8>,
}

impl Mask {
    fn at(&self, x: i32, y: i32) -> u8 {
        self.data[(y * self.w + x) as usize]
    }

    /// The box's pixels (rounded outwards) set.
    fn of_box(d: &Detection, w: i32, h: i32) -> Mask {
        let mut data = vec![0u8; (w * h) as usize];
        let (x1, y1) = ((d.x1.floor() as i32).clamp(0, w), (d.y1.floor() as i32).clamp(0, h));
        let (x2, y2) = ((d.x2.ceil() as i32).clamp(0, w), (d.y2.ceil() as i32).clamp(0, h));
        for y in y1..y2 {
            data[(y * w + x1) as usize..(y * w + x2) as usize].fill(255);
        }
        Mask { w, h, data }
    }

    /// Moved right by `dx` and up by `dy`.
    fn shifted(&self, dx: i32, dy: i32) -> Mask {
        let mut data = vec![0u8; self.data.len()];
        for y in 0..self.h {
            let ty = y - dy;
            if !(0..self.h).contains(&ty) {
                continue;
            }
            for x in 0..self.w {
                let tx = x + dx;
                if (0..self.w).contains(&tx) {
                    data[(ty * self.w + tx) as usize] = self.at(x, y);
                }
            }
        }
        Mask { data, ..*self }
    }

    /// Dilated (`amount` > 0) or eroded (< 0) by a square of side |amount|; outside the
    /// image counts as unmasked.
    fn morphed(&self, amount: i32) -> Mask {
        if amount == 0 {
            return self.clone();
        }
        let k = amount.abs();
        let (before, after) = (k / 2, k - k / 2 - 1);
        let dilate = amount > 0;
        let mut data = vec![0u8; self.data.len()];
        for y in 0..self.h {
            for x in 0..self.w {
                let mut v = if dilate { 0u8 } else { 255 };
                for ky in -before..=after {
                    for kx in -before..=after {
                        let (sx, sy) = (x + kx, y + ky);
                        let s = if (0..self.w).contains(&sx) && (0..self.h).contains(&sy) { self.at(sx, sy) } else { 0 };
                        v = if dilate { v.max(s) } else { v.min(s) };
                    }
                }
                data[(y * self.w + x) as usize] = v;
            }
        }
        Mask { data, ..*self }
    }

    /// Separable Gaussian blur of sigma `radius` (kernel radius ⌈2.5σ⌉, edges clamped).
    fn blurred(&self, radius: i32) -> Mask {
        if radius <= 0 {
            return self.clone();
        }
        let sigma = radius as f32;
        let kr = ((2.5 * sigma).ceil() as i32).max(1);
        let mut kernel: Vec<f32> = (-kr..=kr).map(|i| (-((i * i) as f32) / (2.0 * sigma * sigma)).exp()).collect();
        let sum = kernel.iter().fold(0.0f32, |a, &v| a + v);
        kernel.iter_mut().for_each(|v| *v /= sum);
        let mut horizontal = vec![0f32; self.data.len()];
        for y in 0..self.h {
            for x in 0..self.w {
                let mut v = 0f32;
                for k in -kr..=kr {
                    v += self.at((x + k).clamp(0, self.w - 1), y) as f32 * kernel[(k + kr) as usize];
                }
                horizontal[(y * self.w + x) as usize] = v;
            }
        }
        let mut data = vec![0u8; self.data.len()];
        for y in 0..self.h {
            for x in 0..self.w {
                let mut v = 0f32;
                for k in -kr..=kr {
                    v += horizontal[((y + k).clamp(0, self.h - 1) * self.w + x) as usize] * kernel[(k + kr) as usize];
                }
                data[(y * self.w + x) as usize] = to_byte(v);
            }
        }
        Mask { data, ..*self }
    }

    /// The smallest region holding every set pixel; None for an empty mask.
    fn bounds(&self) -> Option<Crop> {
        let mut c = Crop { x1: self.w, y1: self.h, x2: 0, y2: 0 };
        for y in 0..self.h {
            for x in 0..self.w {
                if self.at(x, y) != 0 {
                    c = Crop { x1: c.x1.min(x), y1: c.y1.min(y), x2: c.x2.max(x + 1), y2: c.y2.max(y + 1) };
                }
            }
        }
        (c.x2 > c.x1 && c.y2 > c.y1).then_some(c)
    }

    /// `crop` resized to `w`×`h` by nearest neighbour, as a one-channel image.
    fn resize_crop(&self, crop: Crop, w: i32, h: i32) -> Image {
        let sx = (crop.x2 - crop.x1) as f32 / w as f32;
        let sy = (crop.y2 - crop.y1) as f32 / h as f32;
        let mut data = Vec::with_capacity((w * h) as usize);
        for y in 0..h {
            let fy = (crop.y1 + ((y as f32 + 0.5) * sy) as i32).clamp(0, self.h - 1);
            for x in 0..w {
                let fx = (crop.x1 + ((x as f32 + 0.5) * sx) as i32).clamp(0, self.w - 1);
                data.push(self.at(fx, fy));
            }
        }
        Image { width: w as u32, height: h as u32, channels: 1, data }
    }
}

/// One mask per detection (box, offset, dilation/erosion; empty ones dropped), merged into
/// one and/or inverted as asked.
fn masks(detections: &[Detection], w: i32, h: i32, s: &Settings) -> Vec<Mask> {
    let mut out: Vec<Mask> = detections
        .iter()
        .map(|d| {
            let mut m = Mask::of_box(d, w, h);
            if s.x_offset != 0 || s.y_offset != 0 {
                m = m.shifted(s.x_offset, s.y_offset);
            }
            m.morphed(s.dilate_erode)
        })
        .filter(|m| m.data.iter().any(|&v| v != 0))
        .collect();
    if s.merge_masks && !out.is_empty() {
        let mut merged = Mask { w, h, data: vec![0; (w * h) as usize] };
        for m in &out {
            merged.data.iter_mut().zip(&m.data).for_each(|(a, &b)| *a = (*a).max(b));
        }
        out = vec![merged];
    }
    if s.invert_mask {
        out.iter_mut().for_each(|m| m.data.iter_mut().for_each(|v| *v = 255 - *v));
    }
    out
}

/// `crop` grown by `padding`, then widened or heightened to the inpainting aspect ratio
/// around its centre, kept inside the image.
fn expand_crop(c: Crop, w: i32, h: i32, padding: i32, tw: i32, th: i32) -> Crop {
    let c = Crop { x1: (c.x1 - padding).max(0), y1: (c.y1 - padding).max(0), x2: (c.x2 + padding).min(w), y2: (c.y2 + padding).min(h) };
    let aspect = tw as f32 / th as f32;
    let (cw, ch) = (c.x2 - c.x1, c.y2 - c.y1);
    let (mut dw, mut dh) = (cw, ch);
    if (cw as f32 / ch as f32) < aspect {
        dw = (ch as f32 * aspect).ceil() as i32;
    } else {
        dh = (cw as f32 / aspect).ceil() as i32;
    }
    let (dw, dh) = (dw.min(w), dh.min(h));
    let (cx, cy) = ((c.x1 + c.x2) / 2, (c.y1 + c.y2) / 2);
    let x1 = (cx - dw / 2).clamp(0, w - dw);
    let y1 = (cy - dh / 2).clamp(0, h - dh);
    Crop { x1, y1, x2: x1 + dw, y2: y1 + dh }
}

/// Blends `generated` (the inpainted crop, any size) into `dst` over `crop`, weighted by
/// `feather`.
fn composite(dst: &mut Image, generated: &Image, feather: &Mask, crop: Crop) {
    let sx = generated.width as f32 / (crop.x2 - crop.x1) as f32;
    let sy = generated.height as f32 / (crop.y2 - crop.y1) as f32;
    for y in crop.y1..crop.y2 {
        let fy = ((y - crop.y1) as f32 + 0.5) * sy - 0.5;
        for x in crop.x1..crop.x2 {
            let alpha = feather.at(x, y) as f32 / 255.0;
            if alpha <= 0.0 {
                continue;
            }
            let fx = ((x - crop.x1) as f32 + 0.5) * sx - 0.5;
            let i = ((y * dst.width as i32 + x) * 3) as usize;
            for c in 0..3 {
                let g = bilinear(generated, fx, fy, c) * 255.0;
                let o = dst.data[i + c] as f32;
                dst.data[i + c] = to_byte(o * (1.0 - alpha) + g * alpha);
            }
        }
    }
}

/// Prompt `index` of a template: its `[SEP]`-separated parts (the last one repeating), with
/// `[PROMPT]` replaced by `base`; an empty part is `base` itself.
fn resolve_prompt(template: Option<&str>, base: &str, index: usize) -> String {
    let parts: Vec<&str> = template.unwrap_or("").split("[SEP]").map(trim).collect();
    let part = parts[index.min(parts.len() - 1)];
    if part.is_empty() {
        base.to_string()
    } else {
        part.replace("[PROMPT]", base)
    }
}

// ------------------------------------------------------------------------------ detector

/// The image scaled to fit `size`×`size` (bilinear, aspect kept), centred on grey.
struct Letterbox {
    tensor: Tensor,
    scale: f32,
    pad_x: i32,
    pad_y: i32,
}

fn letterbox(img: &Image, size: i32) -> Letterbox {
    let s = size as usize;
    let mut data = vec![114.0f32 / 255.0; s * s * 3];
    let scale = (size as f32 / img.width as f32).min(size as f32 / img.height as f32);
    let rw = ((img.width as f32 * scale).round() as i32).max(1);
    let rh = ((img.height as f32 * scale).round() as i32).max(1);
    let (pad_x, pad_y) = ((size - rw) / 2, (size - rh) / 2);
    for y in 0..rh {
        let fy = (y as f32 + 0.5) / scale - 0.5;
        for x in 0..rw {
            let fx = (x as f32 + 0.5) / scale - 0.5;
            for c in 0..3 {
                let (tx, ty) = ((x + pad_x) as usize, (y + pad_y) as usize);
                if tx < s && ty < s {
                    data[tx + s * (ty + s * c)] = bilinear(img, fx, fy, c);
                }
            }
        }
    }
    let tensor = Tensor::from_vec(&[s, s, 3, 1], data).expect("letterbox size");
    Letterbox { tensor, scale, pad_x, pad_y }
}

fn logistic(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let z = x.exp();
        z / (1.0 + z)
    }
}

/// Expected bin (0..reg_max) of the softmax over one side's distribution.
fn dfl(values: &[f32], anchors: usize, first: usize, reg_max: usize, anchor: usize) -> f32 {
    let bins = (0..reg_max).map(|i| values[anchor + anchors * (first + i)]);
    let max = bins.clone().fold(f32::NEG_INFINITY, f32::max);
    let (mut den, mut num) = (0f32, 0f32);
    for (i, v) in bins.enumerate() {
        let p = (v - max).exp();
        den += p;
        num += p * i as f32;
    }
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// Boxes above the confidence of the raw head output [anchors, 4·reg_max + classes], in
/// image pixels, by falling confidence, after per-class NMS.
fn decode(raw: &Tensor, cfg: &Yolov8Config, lb: &Letterbox, img: &Image, s: &Settings) -> Result<Vec<Detection>> {
    let (anchors, channels) = (raw.ne(0), raw.ne(1));
    let (reg_max, classes) = (cfg.reg_max as usize, cfg.num_classes as usize);
    ensure!(channels == reg_max * 4 + classes, "unexpected YOLOv8 output channels: {channels}");
    let grids = STRIDES.map(|st| s.input_size as usize / st);
    let expected: usize = grids.iter().map(|g| g * g).sum();
    ensure!(anchors == expected, "unexpected YOLOv8 anchor count: {anchors} (expected {expected})");
    let v = raw.data();
    let (w, h) = (img.width as f32, img.height as f32);
    let mut candidates = Vec::new();
    let mut offset = 0;
    for (&stride, &grid) in STRIDES.iter().zip(&grids) {
        for local in 0..grid * grid {
            let anchor = offset + local;
            let (mut confidence, mut class_id) = (0f32, 0usize);
            for c in 0..classes {
                let score = logistic(v[anchor + anchors * (reg_max * 4 + c)]);
                if score > confidence {
                    (confidence, class_id) = (score, c);
                }
            }
            if confidence < s.confidence {
                continue;
            }
            let side = |k: usize| dfl(v, anchors, k * reg_max, reg_max, anchor);
            let (left, top, right, bottom) = (side(0), side(1), side(2), side(3));
            let st = stride as f32;
            let cx = ((local % grid) as f32 + 0.5) * st;
            let cy = ((local / grid) as f32 + 0.5) * st;
            let d = Detection {
                x1: ((cx - left * st - lb.pad_x as f32) / lb.scale).clamp(0.0, w),
                y1: ((cy - top * st - lb.pad_y as f32) / lb.scale).clamp(0.0, h),
                x2: ((cx + right * st - lb.pad_x as f32) / lb.scale).clamp(0.0, w),
                y2: ((cy + bottom * st - lb.pad_y as f32) / lb.scale).clamp(0.0, h),
                confidence,
                class_id,
            };
            if d.x2 > d.x1 && d.y2 > d.y1 {
                candidates.push(d);
            }
        }
        offset += grid * grid;
    }
    // Equal confidences keep anchor order (the reference's unstable sort leaves them in an
    // order of its own; they only differ for exactly equal scores).
    candidates.sort_by(|a, b| b.confidence.partial_cmp(&a.confidence).unwrap_or(std::cmp::Ordering::Equal));
    let mut selected: Vec<Detection> = Vec::new();
    for c in candidates {
        if selected.iter().any(|k| k.class_id == c.class_id && c.iou(k) > s.nms_threshold) {
            continue;
        }
        selected.push(c);
        if selected.len() >= s.max_detections as usize {
            break;
        }
    }
    Ok(selected)
}

/// Drops boxes outside the area ratios, keeps the k largest, and orders them.
fn filter_and_sort(dets: &mut Vec<Detection>, w: u32, h: u32, s: &Settings) {
    let image_area = w as f32 * h as f32;
    dets.retain(|d| {
        let r = d.area() / image_area;
        r >= s.mask_min_ratio && r <= s.mask_max_ratio
    });
    let by_area = |a: &Detection, b: &Detection| b.area().partial_cmp(&a.area()).unwrap_or(std::cmp::Ordering::Equal);
    let k = s.mask_k_largest as usize;
    if k > 0 && dets.len() > k {
        dets.sort_by(by_area);
        dets.truncate(k);
    }
    let cmp = |a: f32, b: f32| a.partial_cmp(&b).unwrap_or(std::cmp::Ordering::Equal);
    match s.sort_by {
        SortBy::None => {}
        SortBy::LeftToRight => dets.sort_by(|a, b| cmp(a.x1, b.x1)),
        SortBy::CenterToEdge => {
            let (cx, cy) = (w as f32 * 0.5, h as f32 * 0.5);
            let dist = |d: &Detection| {
                let (dx, dy) = ((d.x1 + d.x2) * 0.5 - cx, (d.y1 + d.y2) * 0.5 - cy);
                dx * dx + dy * dy
            };
            dets.sort_by(|a, b| cmp(dist(a), dist(b)));
        }
        SortBy::Area => dets.sort_by(by_area),
    }
}

/// A loaded YOLOv8 detector (`adetailer_ctx_t`).
pub struct Detector {
    net: Loaded<Yolov8>,
    class_names: Vec<String>,
}

impl Detector {
    /// Loads the detector `params.detector_path` (safetensors or GGUF with ultralytics'
    /// names) on the backend `params.backend` assigns to the detector.
    pub fn load(params: &AdetailerCtxParams) -> Result<Detector> {
        let path = params.detector_path.as_str();
        ensure!(!path.is_empty(), "detector_path is empty");
        let n_threads = if params.n_threads <= 0 { 1 } else { params.n_threads };
        let devices = DeviceMap::new(&DeviceOptions {
            backend: params.backend.as_deref(),
            params_backend: params.params_backend.as_deref(),
            ..Default::default()
        })
        .context("ADetailer backend config failed")?;
        let placement = devices.placement(Module::Detector)?;
        let weights = std::sync::Arc::new(
            Weights::open_file_as_stored(path).map_err(|e| Error::new(format!("failed to load ADetailer detector: '{path}': {e}")))?,
        );
        let cfg = Yolov8Config::detect(&|n| weights.shape_of(n)).with_context(|| format!("unsupported YOLOv8 detection weights: '{path}'"))?;
        let class_names = class_names(weights.metadata().get("yolov8.names").map(String::as_str), cfg.num_classes as usize);
        let net = weights
            .load_model(placement, n_threads, "", "YOLOv8", |s| Yolov8::new(s, &cfg))
            .with_context(|| format!("failed to load the YOLOv8 detector weights of '{path}'"))?;
        Ok(Detector { net, class_names })
    }

    /// The objects found in `img` (any channel count), by falling confidence.
    pub fn predict(&mut self, img: &Image, s: &Settings) -> Result<Vec<Detection>> {
        let lb = letterbox(img, s.input_size);
        let start = Instant::now();
        Component::begin(&mut self.net)?;
        let (model, runner) = self.net.parts();
        let raw = yolov8::compute(runner, model, &lb.tensor);
        Component::end(&mut self.net);
        let raw = raw.map_err(|e| Error::new(format!("YOLOv8 detector inference failed: {e}")))?;
        let dets = decode(&raw, &self.net.model.cfg, &lb, img, s)?;
        sd_info!("ADetailer detected {} object(s), taking {:.2}s", dets.len(), start.elapsed().as_secs_f32());
        for (i, d) in dets.iter().enumerate() {
            let object = self.class_names.get(d.class_id).filter(|n| !n.is_empty()).cloned().unwrap_or_else(|| format!("class_{}", d.class_id));
            sd_info!(
                "ADetailer detection {}: object={object}, class_id={}, confidence={:.3}, bbox=[x1={:.1}, y1={:.1}, x2={:.1}, y2={:.1}]",
                i + 1,
                d.class_id,
                d.confidence,
                d.x1,
                d.y1,
                d.x2,
                d.y2
            );
        }
        Ok(dets)
    }
}

/// Class names from the `yolov8.names` metadata: a JSON list, or an object of index → name.
fn class_names(meta: Option<&str>, count: usize) -> Vec<String> {
    let mut names = vec![String::new(); count];
    match meta.and_then(|m| serde_json::from_str::<serde_json::Value>(m).ok()) {
        Some(serde_json::Value::Array(a)) => {
            for (n, v) in names.iter_mut().zip(&a) {
                if let Some(s) = v.as_str() {
                    *n = s.to_string();
                }
            }
        }
        Some(serde_json::Value::Object(o)) => {
            for (k, v) in &o {
                if let (Ok(i), Some(s)) = (trim(k).parse::<usize>(), v.as_str()) {
                    if i < count {
                        names[i] = s.to_string();
                    }
                }
            }
        }
        _ => {}
    }
    names
}

/// ADetailer on `image`: detect, then inpaint every mask in turn with `generate` (one
/// picture per request, the caller's image generation) and blend it in. Returns the
/// composited RGB picture (the input as RGB when nothing is found).
pub fn detail(
    detector: &mut Detector,
    image: &Image,
    ad: &AdetailerParams,
    inpaint: &ImgGenParams,
    mut generate: impl FnMut(&ImgGenParams) -> Result<Vec<Image>>,
) -> Result<Image> {
    ensure!(image.width > 0 && image.height > 0 && image.channels > 0, "input_image has no pixel data");
    let s = Settings::parse(ad.extra_ad_args.as_deref(), inpaint)?;
    let mut dets = detector.predict(image, &s)?;
    let (w, h) = (image.width as i32, image.height as i32);
    filter_and_sort(&mut dets, image.width, image.height, &s);
    let masks = masks(&dets, w, h, &s);
    let mut current = resize_crop(image, Crop { x1: 0, y1: 0, x2: w, y2: h }, w, h);
    let mut applied = 0;
    for (i, mask) in masks.iter().enumerate() {
        let prompt = resolve_prompt(ad.prompt.as_deref(), &inpaint.prompt, i);
        let negative_prompt = resolve_prompt(ad.negative_prompt.as_deref(), &inpaint.negative_prompt, i);
        if trim(&prompt) == "[SKIP]" {
            continue;
        }
        let Some(bounds) = mask.bounds() else { continue };
        let crop = expand_crop(bounds, w, h, s.inpaint_padding, s.inpaint_width, s.inpaint_height);
        let mut req = inpaint.clone();
        req.prompt = prompt;
        req.negative_prompt = negative_prompt;
        req.init_image = Some(resize_crop(&current, crop, s.inpaint_width, s.inpaint_height));
        req.mask_image = Some(mask.resize_crop(crop, s.inpaint_width, s.inpaint_height));
        req.width = s.inpaint_width;
        req.height = s.inpaint_height;
        req.strength = s.denoising_strength;
        req.seed = inpaint.seed.wrapping_add(i as i64);
        req.batch_count = 1;
        req.ref_images.clear();
        req.control_image = None;
        req.pm_params = PmParams::default();
        req.pulid_params = PulidParams::default();
        req.hires.enabled = false;
        if s.steps > 0 {
            req.sample_params.sample_steps = s.steps;
            req.sample_params.custom_sigmas.clear();
        }
        if s.cfg_scale >= 0.0 {
            req.sample_params.guidance.txt_cfg = s.cfg_scale;
        }
        if let Some(m) = s.sample_method {
            req.sample_params.sample_method = Some(m);
        }
        if let Some(sc) = s.scheduler {
            req.sample_params.scheduler = Some(sc);
        }
        let generated = generate(&req).with_context(|| format!("ADetailer: inpainting detection {} failed", i + 1))?;
        let generated = generated.into_iter().next().ok_or_else(|| Error::new(format!("ADetailer: inpainting detection {} gave no picture", i + 1)))?;
        composite(&mut current, &generated, &mask.blurred(s.mask_blur), crop);
        applied += 1;
    }
    sd_info!("ADetailer applied {applied} mask(s)");
    Ok(current)
}
