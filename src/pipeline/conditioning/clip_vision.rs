//! The CLIP vision tower of a context (`clip_vision_path`), as the pipeline uses it: Wan2.1
//! I2V / FLF2V read its hidden states of the init (and end) image, like the reference's
//! `get_clip_vision_output(image, return_pooled = false, clip_skip = -2)`.
//!
//! A clip_skip of -2 is not "the penultimate layer" there: the reference's encoder treats
//! any skip <= 0 as "all layers", so the output is the last layer's hidden states, before
//! the post-layernorm. Without an image the reference does not run the tower at all: its
//! `zero_out_masked` flag returns zeros of the output's shape.

use crate::error::Result;
use crate::graph::{Component, Components, Loaded, Placement};
use crate::models::te::clip_vision::{self, ClipVisionConfig, ClipVisionModel, CLIP_VISION_PREFIX};
use crate::pipeline::loader::Weights;
use crate::tensor::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// The clip_skip Wan's image conditioning asks for (all layers, see the module docs).
pub const WAN_CLIP_SKIP: i32 = -2;

/// A loaded CLIP vision tower.
pub struct ClipVision {
    net: Loaded<ClipVisionModel>,
}

impl ClipVision {
    /// Whether the context's files hold a vision tower (a `clip_vision_path` file).
    pub fn present(weights: &Weights) -> bool {
        weights.has_prefix(&format!("{CLIP_VISION_PREFIX}vision_model."))
    }

    /// The tower in the context's files, placed as `place` says (the caller picks
    /// `Module::ClipVision`'s placement, resident or read per phase). `width`: the hidden
    /// size the consumer reads (Wan's `img_emb` takes 1280), checked against the file's.
    /// `user`: what needs the tower, for the error when it is missing.
    pub fn load(weights: &Arc<Weights>, place: Placement, n_threads: i32, width: Option<i64>, user: &str) -> Result<ClipVision> {
        let Some(cfg) = ClipVisionConfig::detect(weights.types(), &|n| weights.shape_of(n), CLIP_VISION_PREFIX) else {
            bail!("{user} needs a CLIP vision model (clip_vision_path, e.g. clip_vision_h.safetensors): no vision_model tensors were found");
        };
        cfg.validate()?;
        if let Some(w) = width {
            ensure!(
                cfg.hidden_size == w,
                "the CLIP vision model (clip_vision_path) is {} wide, {user} reads {w} wide image features (OpenCLIP ViT-H/14)",
                cfg.hidden_size
            );
        }
        sd_debug!(
            "clip_vision: {} layers of {}, {} heads, {}x{} input, patch {}",
            cfg.n_layer,
            cfg.hidden_size,
            cfg.n_head,
            cfg.image_size,
            cfg.image_size,
            cfg.patch_size
        );
        let net = weights.load_model(place, n_threads, CLIP_VISION_PREFIX, "clip_vision", |s| ClipVisionModel::new(s, &cfg))?;
        Ok(ClipVision { net })
    }

    pub fn config(&self) -> &ClipVisionConfig {
        &self.net.model.cfg
    }

    /// Wan's image features of `image` (`[W, H, 3, 1]` in [0, 1]): the hidden states
    /// `[hidden, positions, 1]` (`[1280, 257, 1]` for ViT-H/14), zeros without an image.
    /// FLF2V concatenates the start and end images' along dim 1.
    pub fn encode(&mut self, image: Option<&Tensor>) -> Result<Tensor> {
        let cfg = self.config();
        let Some(image) = image else {
            return Ok(Tensor::zeros(&[cfg.hidden_size as usize, cfg.num_positions() as usize, 1]));
        };
        self.encode_hidden(image, WAN_CLIP_SKIP)
    }

    /// Hidden states `[hidden, positions, 1]` of `image` after the layers `clip_skip`
    /// selects. Outside a conditioning phase the weights are made usable for the call.
    pub fn encode_hidden(&mut self, image: &Tensor, clip_skip: i32) -> Result<Tensor> {
        let start = Instant::now();
        let pixels = clip_vision::preprocess(self.config(), image)?;
        let out = self.net.run_in_phase(|model, runner| clip_vision::encode(runner, model, &pixels, clip_skip))?;
        sd_debug!("clip_vision: encoded a {}x{} image in {} ms", image.ne(0), image.ne(1), start.elapsed().as_millis());
        Ok(out)
    }

    /// The pooled, projected vector `[proj]` of `image` (IP-Adapter's non-plus models).
    pub fn encode_pooled(&mut self, image: &Tensor, clip_skip: i32) -> Result<Tensor> {
        let pixels = clip_vision::preprocess(self.config(), image)?;
        self.net.run_in_phase(|model, runner| clip_vision::encode_pooled(runner, model, &pixels, clip_skip))
    }
}

impl Components for ClipVision {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![&mut self.net]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Backend, Module};
    use crate::io::{Component as Source, ModelFiles, SdVersion};
    use std::collections::BTreeSet;
    use std::path::Path;
    use std::process::Command;

    /// `clip_vision_h.safetensors` listed the way a context lists a `clip_vision_path` file.
    fn fixture_weights() -> (std::path::PathBuf, Arc<Weights>) {
        let path = crate::testutil::synthetic_fixture("clip_vision_h.safetensors").expect("clip_vision_h fixture");
        let mut files = ModelFiles::new();
        files.add(&path, Source::ClipVision.prefix()).unwrap();
        files.convert_names(Some(SdVersion::Wan2));
        (path, Arc::new(Weights::from_files(files, SdVersion::Wan2, None, "")))
    }

    fn cpu() -> Placement {
        Placement::on(Module::ClipVision, Arc::new(Backend::cpu().unwrap()))
    }

    /// A 300×200 picture: red and green gradients, a blue wave (also written by hand in the
    /// numpy check's history, see synth_video.py).
    fn picture() -> Tensor {
        let (w, h) = (300usize, 200usize);
        let data = (0..3)
            .flat_map(|c| {
                (0..h).flat_map(move |y| {
                    (0..w).map(move |x| match c {
                        0 => x as f32 / w as f32,
                        1 => y as f32 / h as f32,
                        _ => 0.5 + 0.5 * (x as f32 / 17.0 + y as f32 / 9.0).sin(),
                    })
                })
            })
            .collect();
        Tensor::from_vec(&[w, h, 3, 1], data).unwrap()
    }

    /// tests/tools/clip_vision_ref.py on `image` for each (name, layers, pooled) case.
    fn numpy(weights: &Path, image: &Tensor, cases: &[(&str, i32, bool)]) -> Vec<Vec<f32>> {
        let dir = std::env::temp_dir().join(format!("sd-rs-clip-vision-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let raw: Vec<u8> = image.data().iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join("image.f32"), raw).unwrap();
        let json: Vec<serde_json::Value> = cases
            .iter()
            .map(|(name, layers, pooled)| {
                serde_json::json!({"name": name, "image": dir.join("image.f32"), "width": image.ne(0), "height": image.ne(1), "layers": layers, "pooled": pooled})
            })
            .collect();
        std::fs::write(dir.join("cases.json"), serde_json::Value::from(json).to_string()).unwrap();
        let script = crate::testutil::repo().join("tests/tools/clip_vision_ref.py");
        let st = Command::new(crate::testutil::numpy_python()).arg(script).arg("run").arg(weights).arg(dir.join("cases.json")).arg(&dir).status().unwrap();
        assert!(st.success(), "clip_vision_ref.py failed");
        let out = cases
            .iter()
            .map(|(name, ..)| std::fs::read(dir.join(format!("{name}.f32"))).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    /// max |got - want| within 1e-2 of max |want| (f16 weights, f16 matmul inputs).
    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        crate::testutil::assert_close_rel(what, got, want, 1e-2);
    }

    /// The synthetic OpenCLIP ViT-H/14 as a `clip_vision_path` file: every tensor of the file
    /// is declared (none missing, none left over), and the Wan output (all 32 layers, no
    /// post-layernorm), a 1-layer output and a pooled one match the numpy model.
    #[test]
    fn vit_h_fixture_matches_numpy() {
        if !crate::testutil::model_tests_enabled("CLIP vision tower") {
            return;
        }
        let (path, weights) = fixture_weights();
        assert!(ClipVision::present(&weights));
        let mut cv = ClipVision::load(&weights, cpu(), 2, Some(1280), "Wan2.1 I2V").unwrap();
        assert_eq!(cv.config(), &ClipVisionConfig::vit_h14());
        let in_file: BTreeSet<&str> = weights.names().collect();
        let declared: BTreeSet<&str> = cv.net.store().entries().map(|(n, _)| n).collect();
        assert_eq!(in_file.len(), 520);
        assert_eq!(in_file, declared);

        let zeros = cv.encode(None).unwrap();
        assert_eq!(zeros.shape(), &[1280, 257, 1]);
        assert!(zeros.data().iter().all(|&v| v == 0.0));

        let image = picture();
        let start = Instant::now();
        let all = cv.encode(Some(&image)).unwrap();
        eprintln!("clip_vision: 32 layers of ViT-H/14 in {:.2} s", start.elapsed().as_secs_f32());
        assert_eq!(all.shape(), &[1280, 257, 1]);
        let one = cv.encode_hidden(&image, 32).unwrap();
        let pooled = cv.encode_pooled(&image, 31).unwrap();
        assert_eq!(pooled.shape(), &[1024]);
        let want = numpy(&path, &image, &[("all", 32, false), ("one", 1, false), ("pooled", 2, true)]);
        assert_close("32 layers", all.data(), &want[0]);
        assert_close("1 layer", one.data(), &want[1]);
        assert_close("pooled after 2 layers", pooled.data(), &want[2]);

        // Another picture moves the features (the fixture is not degenerate).
        let flipped = Tensor::from_vec(image.shape(), image.data().iter().rev().copied().collect()).unwrap();
        let other = cv.encode(Some(&flipped)).unwrap();
        let rms = |v: &mut dyn Iterator<Item = f32>| {
            let (s, n) = v.fold((0f64, 0usize), |(s, n), x| (s + (x as f64).powi(2), n + 1));
            (s / n as f64).sqrt()
        };
        let size = rms(&mut all.data().iter().copied());
        let moved = rms(&mut all.data().iter().zip(other.data()).map(|(a, b)| a - b));
        eprintln!("clip_vision: rms {size:.3}, another picture moves it by rms {moved:.3}");
        assert!(moved > 0.3 * size);

        let err = ClipVision::load(&weights, cpu(), 2, Some(1024), "IP-Adapter").err().unwrap().to_string();
        assert!(err.contains("clip_vision_path") && err.contains("1280"), "{err}");
    }

    #[test]
    fn missing_tower_names_clip_vision_path() {
        let weights = Arc::new(Weights::from_files(ModelFiles::new(), SdVersion::Wan2, None, ""));
        assert!(!ClipVision::present(&weights));
        let err = ClipVision::load(&weights, cpu(), 1, Some(1280), "Wan2.1-I2V-1.3B").err().unwrap().to_string();
        assert!(err.contains("Wan2.1-I2V-1.3B") && err.contains("clip_vision_path"), "{err}");
    }
}
