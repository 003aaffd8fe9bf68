//! ESRGAN upscaling (`upscaler_ctx_t`, and the hires fix's model upscaler): a model file
//! loaded into an RRDBNet with its own runner, and images run through it whole or, when
//! larger than the tile size, in tiles overlapping by a quarter that are blended back
//! together, like the reference's `UpscalerGGML`.

use super::callbacks;
use super::imageops::{image_to_tensor, tensor_to_image};
use super::loader::Weights;
use crate::graph::{Component, DeviceMap, DeviceOptions, Loaded, Module};
use crate::error::{Context as _, Error, Result};
use crate::image::Image;
use crate::io::SdVersion;
use crate::models::upscaler::esrgan::{self, Esrgan, EsrganConfig};
use crate::params::UpscalerParams;
use crate::runtime::tiling::{self, TileSpec};
use crate::tensor::Tensor;
use std::time::Instant;

/// Overlap of neighbouring tiles, as a fraction of the tile.
const TILE_OVERLAP: f32 = 0.25;
/// Largest output (pixels) we allocate: 16384² (3 GB of f32 RGB before conversion).
const MAX_OUTPUT_PIXELS: usize = 1 << 28;

/// A loaded ESRGAN model.
pub struct Upscaler {
    net: Loaded<Esrgan>,
    /// Input pixels per tile side; `<= 0` runs every image whole.
    tile_size: i32,
}

impl Upscaler {
    /// Loads `params.esrgan_path` (safetensors, GGUF or PyTorch; RealESRGAN or original
    /// ESRGAN names) on the backend `params.backend` assigns to the upscaler.
    pub fn load(params: &UpscalerParams) -> Result<Upscaler> {
        let path = params.esrgan_path.as_str();
        let n_threads = if params.n_threads <= 0 { crate::graph::backend::physical_cores() } else { params.n_threads };
        let devices = DeviceMap::new(&DeviceOptions {
            backend: params.backend.as_deref(),
            params_backend: params.params_backend.as_deref(),
            ..Default::default()
        })
        .context("upscaler backend config failed")?;
        Upscaler::load_on(path, &devices, n_threads, params.tile_size, params.direct)
    }

    /// Loads the ESRGAN model `path` where `devices` puts the upscaler (the hires fix uses
    /// its context's device options).
    pub fn load_on(path: &str, devices: &DeviceMap, n_threads: i32, tile_size: i32, direct: bool) -> Result<Upscaler> {
        ensure!(!path.is_empty(), "esrgan_path is empty");
        let placement = devices.placement(Module::Upscaler)?;
        let weights = std::sync::Arc::new(Weights::open_file(path, SdVersion::Esrgan)?);
        // Convolutions are always f16 (`graph::nn::Conv2d`), whatever the file holds.
        sd_info!("Upscaler weight type: f16");
        let cfg = EsrganConfig::detect(weights.names(), &|n| weights.shape_of(n))
            .with_context(|| format!("init esrgan model from metadata failed: '{path}'"))?;
        let mut net = weights
            .load_model(placement, n_threads, "", "ESRGAN", |s| Esrgan::new(s, &cfg))
            .with_context(|| format!("load esrgan weights from '{path}' failed"))?;
        net.runner.options.conv_direct = direct;
        net.runner.options.cpu_winograd = weights.winograd_for_decoding();
        if direct {
            sd_info!("Using Conv2d direct in the upscaler");
        }
        Ok(Upscaler { net, tile_size })
    }

    /// The model's own factor (1, 2 or 4).
    pub fn scale(&self) -> u32 {
        self.net.model.cfg.scale
    }

    pub fn config(&self) -> &EsrganConfig {
        &self.net.model.cfg
    }

    /// Image tensor [W, H, C, N] in [0, 1] → [W·scale, H·scale, C_out, N] (unclamped), tiled
    /// when a side exceeds the tile size. The compute buffer (and weights read for the call)
    /// are released afterwards.
    pub fn upscale_tensor(&mut self, input: &Tensor) -> Result<Tensor> {
        let cfg = &self.net.model.cfg;
        // Checked before tiling too: a tile has the whole input's channels and batch.
        crate::models::vae::autoencoder_kl::check_input(input, cfg.num_in_ch, 1, "esrgan")?;
        let (w, h) = (input.ne(0), input.ne(1));
        let scale = cfg.scale as usize;
        let (out_w, out_h) = (w * scale, h * scale);
        ensure!(
            out_w.checked_mul(out_h).is_some_and(|p| p <= MAX_OUTPUT_PIXELS),
            "esrgan: {w}x{h} upscaled ×{scale} is larger than the supported {MAX_OUTPUT_PIXELS} pixels"
        );
        let tile = self.tile_size;
        let whole = tile <= 0 || (w <= tile as usize && h <= tile as usize);
        Component::begin(&mut self.net)?;
        let (model, runner) = self.net.parts();
        let out = if whole {
            esrgan::compute(runner, model, input)
        } else {
            let spec = TileSpec { tile_size_x: tile, tile_size_y: tile, overlap: TILE_OVERLAP, circular_x: false, circular_y: false };
            let mut progress = |s: i32, n: i32, secs: f32| callbacks::progress(s, n, secs);
            tiling::process_tiles(input, out_w, out_h, scale, &spec, Some(&mut progress), |t| {
                esrgan::compute(runner, model, t)
                    .map_err(|e| Error::new(format!("esrgan compute failed while processing a tile: {e}")))
            })
        };
        Component::end(&mut self.net);
        out.map_err(|e| Error::new(format!("esrgan compute failed: {e}")))
    }

    /// An 8-bit image → the image upscaled by the model's factor, with the model's output
    /// channels.
    pub fn upscale(&mut self, image: &Image) -> Result<Image> {
        let scale = self.scale();
        let (out_w, out_h) = (image.width as u64 * scale as u64, image.height as u64 * scale as u64);
        sd_info!("upscaling from ({} x {}) to ({} x {})", image.width, image.height, out_w, out_h);
        let start = Instant::now();
        let input = image_to_tensor(image, None)?;
        let out = self.upscale_tensor(&input)?;
        let img = tensor_to_image(&out, 0)?;
        sd_info!("input_image_tensor upscaled, taking {:.2}s", start.elapsed().as_secs_f32());
        Ok(img)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::pickle::tests::P;
    use crate::io::{ModelFiles, ModelSource};
    use crate::testutil::synthetic_fixture;
    use crate::types::SdType;
    use std::io::Write;
    use std::path::{Path, PathBuf};

    /// A file removed when dropped.
    struct Temp(PathBuf);
    impl Temp {
        fn new(name: &str) -> Temp {
            Temp(std::env::temp_dir().join(format!("sd-esrgan-{}-{name}", std::process::id())))
        }
        fn path(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }
    impl Drop for Temp {
        fn drop(&mut self) {
            std::fs::remove_file(&self.0).ok();
        }
    }

    fn fixture() -> PathBuf {
        synthetic_fixture("esrgan_x4.safetensors").unwrap()
    }

    fn params(path: &str, tile_size: i32) -> UpscalerParams {
        UpscalerParams { esrgan_path: path.into(), direct: false, n_threads: 2, tile_size, backend: None, params_backend: None }
    }

    /// (name, ggml shape, f16 bytes) of every tensor of `path`.
    fn tensors(path: &Path) -> Vec<(String, Vec<i64>, Vec<u8>)> {
        let m = ModelFiles::open(&[ModelSource::new(path, "")]).unwrap();
        m.tensors()
            .iter()
            .map(|ts| {
                let mut b = vec![0u8; ts.nelements() as usize * 2];
                m.read_tensor(ts, SdType::F16, &mut b).unwrap();
                (ts.name().to_string(), ts.shape().to_vec(), b)
            })
            .collect()
    }

    /// A torch zip checkpoint of f16 tensors; `wrapper` nests the state dict under a key
    /// (RealESRGAN saves `{"params_ema": state_dict}`).
    fn write_pth(path: &str, entries: &[(String, Vec<i64>, Vec<u8>)], wrapper: Option<&str>) {
        let mut p = P::new();
        if let Some(key) = wrapper {
            p.op(b"}(").s(key);
        }
        p.global("collections", "OrderedDict").op(b")R(");
        for (i, (name, ne, _)) in entries.iter().enumerate() {
            let shape: Vec<i64> = ne.iter().rev().copied().collect();
            let mut stride = vec![1i64; shape.len()];
            for d in (0..shape.len().saturating_sub(1)).rev() {
                stride[d] = stride[d + 1] * shape[d + 1];
            }
            let numel = shape.iter().product();
            p.s(name).tensor("HalfStorage", &i.to_string(), numel, 0, &shape, &stride);
        }
        p.op(b"u");
        if wrapper.is_some() {
            p.op(b"u");
        }
        let mut w = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
        w.start_file("archive/data.pkl", opts).unwrap();
        w.write_all(&p.done()).unwrap();
        w.start_file("archive/byteorder", opts).unwrap();
        w.write_all(b"little").unwrap();
        for (i, (_, _, bytes)) in entries.iter().enumerate() {
            w.start_file(format!("archive/data/{i}"), opts).unwrap();
            w.write_all(bytes).unwrap();
        }
        w.finish().unwrap();
    }

    /// The original ESRGAN (`model.N` Sequential) name of a ×4 RealESRGAN tensor.
    fn original_name(name: &str, num_block: usize) -> String {
        let (layer, leaf) = name.rsplit_once('.').unwrap();
        let prefix = match layer {
            "conv_first" => "model.0".to_string(),
            "conv_body" => format!("model.1.sub.{num_block}"),
            "conv_up1" => "model.3".into(),
            "conv_up2" => "model.6".into(),
            "conv_hr" => "model.8".into(),
            "conv_last" => "model.10".into(),
            body => {
                let parts: Vec<&str> = body.split('.').collect();
                let rdb = parts[2].trim_start_matches("rdb");
                format!("model.1.sub.{}.RDB{rdb}.{}.0", parts[1], parts[3])
            }
        };
        format!("{prefix}.{leaf}")
    }

    fn pattern(w: usize, h: usize) -> Tensor {
        let data = (0..w * h * 3).map(|i| ((i * 37 % 101) as f32) / 100.0).collect();
        Tensor::from_vec(&[w, h, 3, 1], data).unwrap()
    }

    fn upscaled(path: &str, x: &Tensor) -> Tensor {
        let mut up = Upscaler::load(&params(path, 0)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(up.scale(), 4);
        up.upscale_tensor(x).unwrap()
    }

    #[test]
    fn safetensors_pth_original_names_and_gguf_upscale_alike() {
        let fx = fixture();
        let up = Upscaler::load(&params(fx.to_str().unwrap(), 0)).unwrap();
        let cfg = up.config().clone();
        assert_eq!((cfg.scale, cfg.num_block, cfg.num_feat, cfg.num_grow_ch, cfg.num_in_ch, cfg.num_out_ch), (4, 6, 64, 32, 3, 3));
        drop(up);
        let x = pattern(12, 10);
        let want = upscaled(fx.to_str().unwrap(), &x);
        assert_eq!(want.shape(), &[48, 40, 3, 1]);

        let entries = tensors(&fx);
        let pth = Temp::new("realesrgan.pth");
        write_pth(pth.path(), &entries, Some("params_ema"));
        let original: Vec<_> = entries.iter().map(|(n, s, b)| (original_name(n, cfg.num_block), s.clone(), b.clone())).collect();
        let old = Temp::new("esrgan-original.pth");
        write_pth(old.path(), &original, None);
        let gguf = Temp::new("esrgan.gguf");
        crate::io::convert::convert(&[ModelSource::new(&fx, "")], &gguf.0, Some(SdType::F16), "", false, 2).unwrap();
        for path in [pth.path(), old.path(), gguf.path()] {
            assert!(upscaled(path, &x).data() == want.data(), "{path} upscales differently");
        }
    }

    #[test]
    fn missing_other_and_incomplete_models_are_refused_with_reasons() {
        let err = |path: &str| Upscaler::load(&params(path, 128)).err().map(|e| e.to_string()).expect("must fail");
        let e = err("/no/such/esrgan.pth");
        assert!(e.contains("/no/such/esrgan.pth"), "{e}");
        let junk = Temp::new("junk.safetensors");
        std::fs::write(&junk.0, b"not a model at all").unwrap();
        assert!(err(junk.path()).contains(junk.path()));
        let entries = tensors(&fixture());
        let other = Temp::new("other.pth");
        write_pth(other.path(), &[("model.diffusion_model.out.2.weight".into(), vec![3, 3, 4, 2], vec![0; 144])], None);
        assert!(err(other.path()).contains("not an ESRGAN model"));
        let partial = Temp::new("partial.pth");
        let missing = "body.3.rdb2.conv4.weight";
        write_pth(partial.path(), &entries.iter().filter(|e| e.0 != missing).cloned().collect::<Vec<_>>(), None);
        let e = err(partial.path());
        assert!(e.contains(missing), "{e}");
        assert!(err("").contains("empty"));
    }

    #[test]
    fn inputs_the_model_cannot_take_are_errors() {
        let mut up = Upscaler::load(&params(fixture().to_str().unwrap(), 32)).unwrap();
        let rgba = Tensor::zeros(&[8, 8, 4, 1]);
        assert!(up.upscale_tensor(&rgba).unwrap_err().to_string().contains("got 4"));
        let grey = Image::new(4, 4, 1, vec![0; 16]).unwrap();
        assert!(up.upscale(&grey).is_err());
        let tall = Tensor::zeros(&[1, 1 << 17, 3, 1]);
        assert!(up.upscale_tensor(&tall).is_err());
        // Still usable afterwards.
        let img = Image::new(5, 3, 3, vec![128; 45]).unwrap();
        let out = up.upscale(&img).unwrap();
        assert_eq!((out.width, out.height, out.channels), (20, 12, 3));
    }
}
