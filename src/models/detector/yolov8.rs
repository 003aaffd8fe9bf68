//! YOLOv8 object detection (ultralytics' `yolov8*.pt` converted to safetensors / GGUF with
//! the batch norms fused), as ADetailer runs it: the CSP-Darknet backbone with C2f blocks and
//! SPPF, the PAN neck, and the anchor-free detect head over strides 8, 16 and 32. The graph
//! returns the raw head outputs [anchors, 4·reg_max + classes]; the box distributions (DFL),
//! scores and NMS are decoded on the CPU by `pipeline::adetailer`, like the reference.
//!
//! Weights keep ultralytics' names (`model.N...`, every Conv as `conv.weight` + `conv.bias`);
//! the layout (widths, C2f repeats, head widths, reg_max, class count) is read from their
//! shapes, so any model size (n/s/m/l/x) loads.

use crate::error::{Error, Result};
use crate::graph::nn::Conv2d;
use crate::graph::{Graph, Runner, Scope, T};
use crate::tensor::Tensor;
use std::collections::BTreeMap;

/// The layers with a C2f block.
const C2F_LAYERS: [usize; 8] = [2, 4, 6, 8, 12, 15, 18, 21];
/// The plain (strided 3×3) convolution layers.
const CONV_LAYERS: [usize; 7] = [0, 1, 3, 5, 7, 16, 19];
/// Strides of the three detection scales (P3, P4, P5).
pub const STRIDES: [usize; 3] = [8, 16, 32];
/// More bottlenecks per C2f than any published model (ultralytics' largest has 6).
const MAX_REPEATS: usize = 64;

/// The network's layout, read from the weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Yolov8Config {
    /// Output channels of layer N (0 where the layer has none).
    pub out_channels: [i64; 23],
    /// Half the width of each C2f's first convolution.
    pub hidden_channels: BTreeMap<usize, i64>,
    /// Bottlenecks of each C2f.
    pub repeats: BTreeMap<usize, usize>,
    pub box_channels: i64,
    pub cls_channels: i64,
    pub reg_max: i64,
    pub num_classes: i64,
}

impl Yolov8Config {
    /// Reads the layout from the tensors' ggml-order shapes (`shape_of`). Fails with "not a
    /// YOLOv8 detection model" when a part the network needs is missing.
    pub fn detect(shape_of: &dyn Fn(&str) -> Option<Vec<i64>>) -> Result<Yolov8Config> {
        // Output channels of a convolution weight [kw, kh, in, out]; 0 when absent.
        let conv_out = |name: &str| shape_of(name).filter(|s| s.len() == 4).map_or(0, |s| s[3]);
        let mut out_channels = [0i64; 23];
        for l in CONV_LAYERS {
            out_channels[l] = conv_out(&format!("model.{l}.conv.weight"));
        }
        let (mut hidden_channels, mut repeats) = (BTreeMap::new(), BTreeMap::new());
        for l in C2F_LAYERS {
            out_channels[l] = conv_out(&format!("model.{l}.cv2.conv.weight"));
            hidden_channels.insert(l, conv_out(&format!("model.{l}.cv1.conv.weight")) / 2);
            let n = (0..=MAX_REPEATS).find(|i| shape_of(&format!("model.{l}.m.{i}.cv1.conv.weight")).is_none()).unwrap_or(MAX_REPEATS + 1);
            repeats.insert(l, n);
        }
        out_channels[9] = conv_out("model.9.cv2.conv.weight");
        let box_outputs = conv_out("model.22.cv2.0.2.weight");
        let cfg = Yolov8Config {
            out_channels,
            hidden_channels,
            repeats,
            box_channels: conv_out("model.22.cv2.0.0.conv.weight"),
            cls_channels: conv_out("model.22.cv3.0.0.conv.weight"),
            reg_max: box_outputs / 4,
            num_classes: conv_out("model.22.cv3.0.2.weight"),
        };
        let valid = [0, 9, 15, 18, 21].iter().all(|&l| cfg.out_channels[l] > 0)
            && cfg.box_channels > 0
            && cfg.cls_channels > 0
            && box_outputs > 0
            && box_outputs % 4 == 0
            && cfg.num_classes > 0
            && C2F_LAYERS.iter().all(|l| cfg.hidden_channels[l] > 0 && cfg.repeats[l] > 0);
        if !valid {
            return Err(Error::new("not a YOLOv8 detection model: it needs ultralytics' model.0 ... model.22 tensors (fused Conv, C2f, SPPF, Detect)"));
        }
        ensure!(
            cfg.repeats.values().all(|&n| n <= MAX_REPEATS),
            "YOLOv8 model with more than {MAX_REPEATS} bottlenecks in a C2f block is not supported"
        );
        sd_debug!(
            "yolov8: classes={}, reg_max={}, p3={}, p4={}, p5={}",
            cfg.num_classes,
            cfg.reg_max,
            cfg.out_channels[15],
            cfg.out_channels[18],
            cfg.out_channels[21]
        );
        Ok(cfg)
    }

    /// Channels of the head's output: the box distributions, then the class logits.
    pub fn output_channels(&self) -> i64 {
        self.reg_max * 4 + self.num_classes
    }
}

/// A convolution with its fused batch norm (a bias), then SiLU; "same" padding.
struct YoloConv {
    conv: Conv2d,
}

impl YoloConv {
    fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, k: i64, stride: i32) -> YoloConv {
        let mut s = s.sub(name);
        YoloConv { conv: Conv2d::square(&mut s, "conv", in_ch, out_ch, k, stride, (k / 2) as i32) }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        self.conv.forward(g, x).silu_inplace()
    }
}

/// Two 3×3 convolutions, with the input added back where `shortcut`.
struct Bottleneck {
    cv1: YoloConv,
    cv2: YoloConv,
    shortcut: bool,
}

impl Bottleneck {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let out = self.cv2.forward(g, self.cv1.forward(g, x));
        if self.shortcut {
            x.add(out)
        } else {
            out
        }
    }
}

/// CSP bottleneck with two convolutions: a 1×1 split into halves, the second half through
/// the bottlenecks, every intermediate concatenated and mixed by a last 1×1.
struct C2f {
    cv1: YoloConv,
    cv2: YoloConv,
    m: Vec<Bottleneck>,
    hidden: i64,
}

impl C2f {
    fn new(s: &mut Scope, name: &str, in_ch: i64, out_ch: i64, hidden: i64, repeats: usize, shortcut: bool) -> C2f {
        let mut s = s.sub(name);
        let cv1 = YoloConv::new(&mut s, "cv1", in_ch, hidden * 2, 1, 1);
        let cv2 = YoloConv::new(&mut s, "cv2", hidden * (2 + repeats as i64), out_ch, 1, 1);
        let m = (0..repeats)
            .map(|i| {
                let mut s = s.sub(&format!("m.{i}"));
                let cv1 = YoloConv::new(&mut s, "cv1", hidden, hidden, 3, 1);
                let cv2 = YoloConv::new(&mut s, "cv2", hidden, hidden, 3, 1);
                Bottleneck { cv1, cv2, shortcut }
            })
            .collect();
        C2f { cv1, cv2, m, hidden }
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let split = self.cv1.forward(g, x);
        let [w, h, _, n] = split.ne();
        let nb = split.nb();
        let half = |i: i64| split.view(&[w, h, self.hidden, n], &[nb[1], nb[2], nb[3]], i as usize * self.hidden as usize * nb[2]);
        let (y0, y1) = (half(0), half(1));
        let mut joined = y0.concat(y1, 2);
        let mut last = y1;
        for b in &self.m {
            last = b.forward(g, last);
            joined = joined.concat(last, 2);
        }
        self.cv2.forward(g, joined)
    }
}

/// Spatial pyramid pooling (fast): three chained 5×5 max pools, concatenated.
struct Sppf {
    cv1: YoloConv,
    cv2: YoloConv,
}

impl Sppf {
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let x = self.cv1.forward(g, x);
        let pool = |t: T<'g>| t.pool_2d(ggml_sys::GGML_OP_POOL_MAX, 5, 5, 1, 1, 2.0, 2.0);
        let y1 = pool(x);
        let y2 = pool(y1);
        let y3 = pool(y2);
        self.cv2.forward(g, x.concat(y1, 2).concat(y2, 2).concat(y3, 2))
    }
}

/// One scale of the detect head: a box branch (4·reg_max distribution bins) and a class
/// branch (logits), each two 3×3 convolutions and a plain 1×1.
struct DetectScale {
    box_convs: [YoloConv; 2],
    box_out: Conv2d,
    cls_convs: [YoloConv; 2],
    cls_out: Conv2d,
}

impl DetectScale {
    fn new(s: &mut Scope, i: usize, in_ch: i64, cfg: &Yolov8Config) -> DetectScale {
        let (bc, cc) = (cfg.box_channels, cfg.cls_channels);
        let mut sb = s.sub(&format!("cv2.{i}"));
        let box_convs = [YoloConv::new(&mut sb, "0", in_ch, bc, 3, 1), YoloConv::new(&mut sb, "1", bc, bc, 3, 1)];
        let box_out = Conv2d::square(&mut sb, "2", bc, cfg.reg_max * 4, 1, 1, 0);
        let mut sc = s.sub(&format!("cv3.{i}"));
        let cls_convs = [YoloConv::new(&mut sc, "0", in_ch, cc, 3, 1), YoloConv::new(&mut sc, "1", cc, cc, 3, 1)];
        let cls_out = Conv2d::square(&mut sc, "2", cc, cfg.num_classes, 1, 1, 0);
        DetectScale { box_convs, box_out, cls_convs, cls_out }
    }

    /// [gw, gh, C, 1] → [gw·gh, 4·reg_max + classes].
    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, channels: i64) -> T<'g> {
        let boxes = self.box_out.forward(g, self.box_convs.iter().fold(x, |h, c| c.forward(g, h)));
        let classes = self.cls_out.forward(g, self.cls_convs.iter().fold(x, |h, c| c.forward(g, h)));
        let out = boxes.concat(classes, 2);
        let [w, h, _, _] = out.ne();
        out.reshape(&[w * h, channels])
    }
}

/// The whole detector.
pub struct Yolov8 {
    pub cfg: Yolov8Config,
    convs: BTreeMap<usize, YoloConv>,
    c2fs: BTreeMap<usize, C2f>,
    sppf: Sppf,
    detect: [DetectScale; 3],
}

impl Yolov8 {
    /// Declares the weights (ultralytics' names, scope without prefix).
    pub fn new(s: &mut Scope, cfg: &Yolov8Config) -> Yolov8 {
        let oc = &cfg.out_channels;
        let conv_in = |l: usize| match l {
            0 => 3,
            16 => oc[15],
            19 => oc[18],
            _ => oc[l - 1],
        };
        let convs = CONV_LAYERS.iter().map(|&l| (l, YoloConv::new(s, &format!("model.{l}"), conv_in(l), oc[l], 3, 2))).collect();
        let c2f_in = |l: usize| match l {
            12 => oc[9] + oc[6],
            15 => oc[12] + oc[4],
            18 => oc[16] + oc[12],
            21 => oc[19] + oc[9],
            _ => oc[l - 1],
        };
        let c2fs = C2F_LAYERS
            .iter()
            .map(|&l| {
                // The backbone's C2f blocks add their bottlenecks' inputs back; the neck's do not.
                let shortcut = l <= 8;
                (l, C2f::new(s, &format!("model.{l}"), c2f_in(l), oc[l], cfg.hidden_channels[&l], cfg.repeats[&l], shortcut))
            })
            .collect();
        let sppf = {
            let mut s9 = s.sub("model.9");
            let cv1 = YoloConv::new(&mut s9, "cv1", oc[8], oc[8] / 2, 1, 1);
            let cv2 = YoloConv::new(&mut s9, "cv2", oc[8] * 2, oc[9], 1, 1);
            Sppf { cv1, cv2 }
        };
        let mut head = s.sub("model.22");
        let detect = std::array::from_fn(|i| DetectScale::new(&mut head, i, oc[[15, 18, 21][i]], cfg));
        Yolov8 { cfg: cfg.clone(), convs, c2fs, sppf, detect }
    }

    /// Image [S, S, 3, 1] (S a multiple of 32) → [anchors, 4·reg_max + classes], the anchors
    /// of P3, then P4, then P5, each row-major over its grid.
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>) -> T<'g> {
        let conv = |l: usize, t: T<'g>| self.convs[&l].forward(g, t);
        let c2f = |l: usize, t: T<'g>| self.c2fs[&l].forward(g, t);
        let x1 = conv(1, conv(0, x));
        let x4 = c2f(4, conv(3, c2f(2, x1)));
        let x6 = c2f(6, conv(5, x4));
        let x9 = self.sppf.forward(g, c2f(8, conv(7, x6)));
        let x12 = c2f(12, x9.upscale(2).concat(x6, 2));
        let x15 = c2f(15, x12.upscale(2).concat(x4, 2));
        let x18 = c2f(18, conv(16, x15).concat(x12, 2));
        let x21 = c2f(21, conv(19, x18).concat(x9, 2));
        let ch = self.cfg.output_channels();
        let p3 = self.detect[0].forward(g, x15, ch);
        let p4 = self.detect[1].forward(g, x18, ch);
        let p5 = self.detect[2].forward(g, x21, ch);
        p3.concat(p4, 0).concat(p5, 0)
    }
}

/// Runs the detector on a letterboxed image [S, S, 3, 1] with values in [0, 1].
pub fn compute(runner: &mut Runner, model: &Yolov8, x: &Tensor) -> Result<Tensor> {
    ensure!(
        x.shape().len() == 4 && x.ne(2) == 3 && x.ne(3) == 1 && x.ne(0).is_multiple_of(32) && x.ne(1).is_multiple_of(32),
        "yolov8: expected an RGB image whose sides are multiples of 32, got {:?}",
        x.shape()
    );
    runner.compute(|g| Ok(model.forward(g, g.input(x))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// ggml shapes of a tiny YOLOv8 (the synthetic fixture's layout).
    fn shapes() -> HashMap<String, Vec<i64>> {
        let mut m = HashMap::new();
        let mut conv = |n: &str, i: i64, o: i64, k: i64| {
            m.insert(format!("{n}.weight"), vec![k, k, i, o]);
            m.insert(format!("{n}.bias"), vec![o]);
        };
        let w: HashMap<usize, i64> = [(0, 4), (1, 8), (2, 8), (3, 16), (4, 16), (5, 16), (6, 16), (7, 16), (8, 16), (9, 16), (12, 16), (15, 8), (16, 8), (18, 16), (19, 16), (21, 16)].into();
        for l in CONV_LAYERS {
            conv(&format!("model.{l}.conv"), 1, w[&l], 3);
        }
        for l in C2F_LAYERS {
            conv(&format!("model.{l}.cv1.conv"), 1, w[&l], 1);
            conv(&format!("model.{l}.cv2.conv"), 1, w[&l], 1);
            conv(&format!("model.{l}.m.0.cv1.conv"), w[&l] / 2, w[&l] / 2, 3);
        }
        conv("model.9.cv2.conv", 32, 16, 1);
        for i in 0..3 {
            conv(&format!("model.22.cv2.{i}.0.conv"), 16, 16, 3);
            conv(&format!("model.22.cv2.{i}.2"), 16, 64, 1);
            conv(&format!("model.22.cv3.{i}.0.conv"), 16, 8, 3);
            conv(&format!("model.22.cv3.{i}.2"), 8, 2, 1);
        }
        m
    }

    #[test]
    fn layout_is_read_from_the_weights() {
        let m = shapes();
        let cfg = Yolov8Config::detect(&|n| m.get(n).cloned()).unwrap();
        assert_eq!((cfg.reg_max, cfg.num_classes, cfg.box_channels, cfg.cls_channels), (16, 2, 16, 8));
        assert_eq!((cfg.out_channels[15], cfg.out_channels[18], cfg.out_channels[21]), (8, 16, 16));
        assert_eq!((cfg.hidden_channels[&15], cfg.repeats[&15]), (4, 1));
        assert_eq!(cfg.output_channels(), 66);
    }

    #[test]
    fn other_models_are_refused() {
        let sd: HashMap<String, Vec<i64>> = [("model.diffusion_model.input_blocks.0.0.weight".to_string(), vec![3, 3, 4, 320])].into();
        assert!(Yolov8Config::detect(&|n| sd.get(n).cloned()).unwrap_err().to_string().contains("not a YOLOv8"));
        let mut m = shapes();
        m.remove("model.18.m.0.cv1.conv.weight");
        assert!(Yolov8Config::detect(&|n| m.get(n).cloned()).is_err());
        let mut m = shapes();
        m.insert("model.22.cv2.0.2.weight".into(), vec![1, 1, 16, 62]);
        assert!(Yolov8Config::detect(&|n| m.get(n).cloned()).is_err());
    }
}
