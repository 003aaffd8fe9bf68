use super::testutil::{cpu, load_kl, load_tae, read_bin, TempDir};
use super::*;
use crate::graph::{Component, ParamStore, Scope, TypeMap};
use std::path::PathBuf;

fn golden_dir(set: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden").join(set)
}

/// A reference picture (`set/name`) as [W, H, 3, 1] of 0..255 values.
fn golden_png(set: &str, name: &str) -> Tensor {
    let dir = TempDir::new("png");
    let out = dir.0.join("png.bin");
    let ok = std::process::Command::new(crate::testutil::numpy_python())
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tools/vae_ref.py"))
        .arg("png")
        .arg(golden_dir(set).join(name))
        .arg("-")
        .arg(&out)
        .status()
        .expect("python3 needed to read PNGs")
        .success();
    assert!(ok, "reading {name}");
    read_bin(&out)
}

/// Like the reference's float → byte conversion of output pictures.
fn to_u8(v: f32) -> f32 {
    if v <= 0.0 {
        0.0
    } else if v >= 1.0 {
        255.0
    } else {
        (v * 255.0 + 0.5) as u8 as f32
    }
}

/// Decodes the reference's final latent of sd1 case `latent` and compares the picture
/// with the reference's `png` (a path under golden/): max and mean |diff| in grey levels.
fn decode_golden(vae: &dyn VaeNet, latent: &str, png: (&str, &str), tiling: &TilingParams) -> (f32, f32) {
    let latent = read_bin(&golden_dir("sd1").join(format!("latents/{latent}.bin")));
    let mut runner = Runner::new(cpu(), 2);
    let mut steps = 0;
    let mut progress = |_: i32, _: i32, _: f32| steps += 1;
    let img = decode_image(vae, &mut runner, &vae.diffusion_to_vae(&latent), tiling, (false, false), Some(&mut progress)).unwrap();
    assert!(!tiling.enabled || steps > 1);
    let want = golden_png(png.0, png.1);
    assert_eq!(img.shape(), want.shape());
    let diffs: Vec<f32> = img.data().iter().zip(want.data()).map(|(&a, &b)| (to_u8(a) - b).abs()).collect();
    let max = diffs.iter().fold(0f32, |m, &d| m.max(d));
    let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
    eprintln!("{}: max |diff| {max}, mean |diff| {mean:.4} grey levels", png.1);
    (max, mean)
}

#[test]
fn decode_matches_reference_pictures() {
    // The stores must outlive the models: their weights live there.
    let (_kl_store, kl, _) = load_kl(true);
    let (max, mean) = decode_golden(&kl, "defaults_0", ("sd1", "defaults_0.png"), &TilingParams::default());
    assert!(max <= 3.0 && mean <= 0.25, "max {max}, mean {mean}");
    // sd1-extra/taesd_txt2img samples exactly like sd1/sampler_euler, then decodes with TAESD.
    let (_tae_store, tae, _) = load_tae(true);
    let (max, mean) = decode_golden(&tae, "sampler_euler_0", ("sd1-extra", "taesd_txt2img_0.png"), &TilingParams::default());
    assert!(max <= 3.0 && mean <= 0.25, "max {max}, mean {mean}");
}

/// 16×16 latent in 3×3 tiles of 8 with overlap 0.5 (slow: run with SD_PARITY set).
#[test]
fn tiled_decode_matches_reference_picture() {
    if std::env::var_os("SD_PARITY").is_none() {
        eprintln!("skipped: set SD_PARITY to run the tiled golden decode");
        return;
    }
    let tiling = TilingParams { enabled: true, tile_size_x: 8, tile_size_y: 8, target_overlap: 0.5, ..Default::default() };
    let (_store, vae, _) = load_kl(true);
    let (max, mean) = decode_golden(&vae, "vae_tiling_0", ("sd1", "vae_tiling_0.png"), &tiling);
    assert!(max <= 3.0 && mean <= 0.25, "max {max}, mean {mean}");
}

/// The host steps around the networks, on a VAE that is declared but not loaded.
#[test]
fn latent_conversions_and_sampling() {
    let types = TypeMap::new();
    let mut store = ParamStore::new(1024).unwrap();
    let cfg = VaeConfig::sd(0.13025, false);
    let vae = AutoEncoderKL::new(&mut Scope::new(&mut store, &types, autoencoder_kl::PREFIX), &cfg);
    assert_eq!(vae.encoder_output_channels(), 8);
    let z = Tensor::from_vec(&[1, 1, 4, 1], vec![0.13025, -0.2605, 0.0, 1.0]).unwrap();
    let v = vae.diffusion_to_vae(&z);
    assert_eq!(&v.data()[..3], &[1.0, -2.0, 0.0]);
    let back = vae.vae_to_diffusion(&v);
    assert!(back.data().iter().zip(z.data()).all(|(a, b)| (a - b).abs() < 1e-6));

    // Moments of two batch items: mean channels first, then logvar, per item.
    let mut m = Vec::new();
    for b in 0..2 {
        m.extend([1.0 + b as f32, 2.0, 3.0, 4.0]); // mean
        m.extend([0.0, 2.0f32.ln() * 2.0, -100.0, 100.0]); // logvar
    }
    let moments = Tensor::from_vec(&[1, 1, 8, 2], m).unwrap();
    let (mean, logvar) = split_moments(&moments).unwrap();
    assert_eq!(mean.data(), &[1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 3.0, 4.0]);
    assert_eq!(logvar.shape(), &[1, 1, 4, 2]);
    let lat = vae.output_to_latents(&moments, &mut |n| vec![1.0; n]).unwrap();
    let want = [2.0, 4.0, 3.0 + (-15f32).exp(), 4.0 + 10f32.exp()];
    for (a, b) in lat.data()[..4].iter().zip(want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
    }
    assert!(vae.output_to_latents(&moments, &mut |_| vec![0.0; 3]).is_err());
    assert!(split_moments(&Tensor::zeros(&[1, 1, 3, 1])).is_err());
    // A picture autoencoder has no video.
    let mut runner = Runner::new(cpu(), 1);
    assert!(!vae.supports_video());
    assert!(encode_video(&vae, &mut runner, &Tensor::zeros(&[8, 8, 1, 3, 1]), &TilingParams::default(), (false, false)).is_err());
}

/// Flux.2: the encoder output is the latent (no noise drawn), normalised per channel
/// with the fixed table, and back.
#[test]
fn flux2_latent_normalisation() {
    let types = TypeMap::new();
    let mut store = ParamStore::new(1024).unwrap();
    let cfg = VaeConfig::sd(0.18215, false).into_flux2();
    let vae = AutoEncoderKL::new(&mut Scope::new(&mut store, &types, autoencoder_kl::PREFIX), &cfg);
    assert_eq!((vae.scale(), vae.encoder_output_channels()), (16, 128));
    let z = Tensor::from_vec(&[2, 1, 128, 1], (0..256).map(|v| v as f32 / 100.0).collect()).unwrap();
    let lat = vae.output_to_latents(&z, &mut |_| panic!("Flux.2 draws no noise")).unwrap();
    assert_eq!(lat, z);
    let d = vae.vae_to_diffusion(&z);
    let c = 5;
    assert_eq!(d.data()[2 * c + 1], (z.data()[2 * c + 1] - FLUX2_LATENT_MEAN[c]) / FLUX2_LATENT_STD[c]);
    let back = vae.diffusion_to_vae(&d);
    assert!(back.data().iter().zip(z.data()).all(|(a, b)| (a - b).abs() < 1e-5));

    // SeFi-Image: 16 semantic channels in front, which the decoder never sees.
    let sefi = AutoEncoderKL::new(&mut Scope::new(&mut ParamStore::new(1024).unwrap(), &types, autoencoder_kl::PREFIX), &VaeConfig { leading_channels: 16, ..cfg });
    let semantic = Tensor::full(&[2, 1, 16, 1], 7.0);
    let with_semantic = Tensor::from_vec(&[2, 1, 144, 1], [semantic.data(), d.data()].concat()).unwrap();
    assert_eq!(sefi.diffusion_to_vae(&with_semantic), back);
}

#[test]
fn leading_channels_are_dropped_per_batch_item() {
    // [W=1, H=2, C=3, N=2]: value = 10·n + c.
    let z = Tensor::from_vec(&[1, 2, 3, 2], vec![0., 0., 1., 1., 2., 2., 10., 10., 11., 11., 12., 12.]).unwrap();
    let out = drop_leading_channels(&z, 2);
    assert_eq!((out.shape(), out.data()), (&[1, 2, 1, 2][..], &[2., 2., 12., 12.][..]));
    assert_eq!(drop_leading_channels(&z, 0), z);
}

#[test]
fn latent_frames_and_video_channels() {
    assert_eq!([0, 1, 4, 5, 8, 9, 81].map(|f| latent_frames(f, 4)), [0, 1, 1, 2, 2, 3, 21]);
    assert_eq!(latent_frames(7, 1), 7);
    // Channel axis 3 of a video [w, h, T, C, 1]: channel 1 of frame 1 is scaled.
    let z = Tensor::from_vec(&[1, 1, 2, 2, 1], vec![1.0, 1.0, 1.0, 1.0]).unwrap();
    let out = per_channel(&z, 2, |v, c| v * (c as f32 + 1.0));
    assert_eq!(out.data(), &[1.0, 1.0, 2.0, 2.0]);
    let img = Tensor::from_vec(&[1, 2, 2, 1], vec![1.0, 1.0, 1.0, 1.0]).unwrap();
    assert_eq!(per_channel(&img, 2, |v, c| v * (c as f32 + 1.0)).data(), &[1.0, 1.0, 2.0, 2.0]);
}

/// A first stage whose video decode fails until its tiling satisfies `ok`, recording each
/// attempt.
struct Flaky {
    ok: fn(&TilingParams) -> bool,
    temporal: bool,
    attempts: Vec<TilingParams>,
}

impl Components for Flaky {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        Vec::new()
    }
}

impl FirstStage for Flaky {
    fn encode(&mut self, image: &Tensor, _: &TilingParams, _: (bool, bool)) -> Result<Tensor> {
        Ok(image.clone())
    }
    fn output_to_latents(&self, out: &Tensor, _: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        Ok(out.clone())
    }
    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        z.clone()
    }
    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        z.clone()
    }
    fn decode(&mut self, z: &Tensor, _: &TilingParams, _: (bool, bool), _: Progress<'_>) -> Result<Tensor> {
        Ok(z.clone())
    }
    fn supports_temporal_tiling(&self) -> bool {
        self.temporal
    }
    fn decode_video(&mut self, z: &Tensor, tiling: &TilingParams, _: (bool, bool), progress: Progress<'_>) -> Result<Tensor> {
        self.attempts.push(*tiling);
        if let Some(p) = progress {
            p(1, 1, 0.0);
        }
        ensure!((self.ok)(tiling), "injected out of memory");
        Ok(z.clone())
    }
}

/// A failed video decode is retried with temporal tiling first (where the first stage has
/// it), then with half-size spatial tiles as well; when everything fails, the last error.
#[test]
fn video_decode_retries_temporal_then_spatial() {
    let z = Tensor::zeros(&[20, 12, 3, 16, 1]);
    let plain = TilingParams::default();
    let mut calls = 0;
    let mut progress = |_: i32, _: i32, _: f32| calls += 1;
    let mut fs = Flaky { ok: |t| t.enabled && t.temporal_tiling, temporal: true, attempts: Vec::new() };
    assert!(decode_video_with_retry(&mut fs, &z, &plain, (false, false), Some(&mut progress)).is_ok());
    assert_eq!(calls, 3);
    let a = &fs.attempts;
    assert_eq!(a.len(), 3);
    assert_eq!((a[0].temporal_tiling, a[0].enabled), (false, false));
    assert_eq!((a[1].temporal_tiling, a[1].enabled), (true, false));
    assert_eq!((a[2].temporal_tiling, a[2].enabled, a[2].tile_size_x, a[2].tile_size_y), (true, true, 10, 6));

    // Temporal tiling alone suffices: no spatial tiles.
    let mut fs = Flaky { ok: |t| t.temporal_tiling, temporal: true, attempts: Vec::new() };
    decode_video_with_retry(&mut fs, &z, &plain, (false, false), None).unwrap();
    assert_eq!(fs.attempts.len(), 2);
    // Without temporal tiling the retry goes straight to spatial tiles.
    let mut fs = Flaky { ok: |t| t.enabled, temporal: false, attempts: Vec::new() };
    decode_video_with_retry(&mut fs, &z, &plain, (false, false), None).unwrap();
    assert_eq!(fs.attempts.iter().map(|t| (t.enabled, t.temporal_tiling)).collect::<Vec<_>>(), [(false, false), (true, false)]);
    // Nothing helps: three attempts, then the error.
    let mut fs = Flaky { ok: |_| false, temporal: true, attempts: Vec::new() };
    let err = decode_video_with_retry(&mut fs, &z, &plain, (false, false), None).unwrap_err();
    assert!(err.to_string().contains("injected"), "{err}");
    assert_eq!(fs.attempts.len(), 3);
    // Spatial tiling asked for already: temporal is added, then nothing is left.
    let spatial = TilingParams { enabled: true, ..plain };
    assert_eq!(video_retry_tiling(&spatial, true, 20, 12).map(|(t, m)| (t.temporal_tiling, m)), Some((true, "spatial+temporal")));
    assert!(video_retry_tiling(&TilingParams { temporal_tiling: true, ..spatial }, true, 20, 12).is_none());
}

/// A loaded Wan VAE as the pipeline sees it: video in [0, 1] → normalised latents → video in
/// [0, 1], with spatial tiles spanning all frames and temporal tiling changing no value;
/// pictures still go through the picture path; picture-only first stages refuse video.
#[test]
fn wan_first_stage_encodes_and_decodes_video() {
    use crate::graph::{Module, Placement};
    let cfg = WanVaeConfig { dim: 4, dec_dim: 4, ..WanVaeConfig::wan21(false) };
    let (store, vae) = wan::tests::random_vae(&cfg);
    let backend = cpu();
    let mut fs = Loaded::new(vae, store, Placement::on(Module::Vae, backend.clone()), Runner::new(backend, 2), None, "VAE");
    assert_eq!((FirstStage::time_scale(&fs), fs.latent_frames(17), fs.supports_temporal_tiling()), (4, 5, true));
    let video = super::testutil::pattern(&[64, 48, 5, 3, 1], 0.0, 1.0, 4);
    let plain = TilingParams::default();
    let z = fs.encode_video(&video, &plain, (false, false)).unwrap();
    assert_eq!(z.shape(), &[8, 6, 2, 16, 1]);
    let mean = fs.model.encode_frames(&mut fs.runner, &video.map(|v| v * 2.0 - 1.0)).unwrap();
    let c = 3;
    let plane = 8 * 6 * 2;
    assert_eq!(z.data()[c * plane + 5], (mean.data()[c * plane + 5] - WAN21_LATENT_MEAN[c]) / WAN21_LATENT_STD[c]);

    let out = fs.decode_video(&z, &plain, (false, false), None).unwrap();
    assert_eq!(out.shape(), &[64, 48, 5, 3, 1]);
    assert!(out.data().iter().all(|v| (0.0..=1.0).contains(v)));
    let temporal = fs.decode_video(&z, &TilingParams { temporal_tiling: true, ..plain }, (false, false), None).unwrap();
    assert_eq!(temporal, out);
    let tiles = TilingParams { enabled: true, tile_size_x: 4, tile_size_y: 4, ..plain };
    let mut steps = 0;
    let mut progress = |_: i32, _: i32, _: f32| steps += 1;
    let tiled = fs.decode_video(&z, &tiles, (false, false), Some(&mut progress)).unwrap();
    assert_eq!(tiled.shape(), out.shape());
    assert!(steps > 2);
    let tiled_enc = fs.encode_video(&video, &tiles, (false, false)).unwrap();
    assert_eq!(tiled_enc.shape(), z.shape());
    // Video latents must be 5-D; picture latents go through the picture path.
    assert!(fs.decode_video(&Tensor::zeros(&[4, 3, 16, 1]), &plain, (false, false), None).is_err());
    let img = fs.decode(&Tensor::zeros(&[4, 3, 16, 1]), &plain, (false, false), None).unwrap();
    assert_eq!(img.shape(), &[32, 24, 3, 1]);

    let mut pixels = PixelSpace;
    assert!(pixels.decode_video(&z, &plain, (false, false), None).is_err());
    assert!(decode_video_with_retry(&mut pixels, &z, &plain, (false, false), None).is_err());
}
