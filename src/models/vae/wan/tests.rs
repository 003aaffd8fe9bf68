use super::*;
use crate::graph::{Backend, ParamStore, TypeMap, F16};
use std::sync::Arc;

/// The declared names are the reference's (and the synthetic file's): 2 × 11 encoder levels
/// and 15 decoder levels, time convolutions at the temporal resamplers.
#[test]
fn declares_the_reference_layout() {
    let names = declared_names(&WanVaeConfig::wan21(false));
    let has = |n: &str| names.iter().any(|x| x == &format!("first_stage_model.{n}"));
    for n in [
        "encoder.conv1.weight",
        "encoder.downsamples.2.resample.1.weight",
        "encoder.downsamples.5.time_conv.bias",
        "encoder.downsamples.10.residual.6.weight",
        "encoder.middle.1.to_qkv.weight",
        "encoder.head.2.bias",
        "conv1.weight",
        "conv2.weight",
        "decoder.upsamples.3.time_conv.weight",
        "decoder.upsamples.4.shortcut.weight",
        "decoder.upsamples.11.resample.1.weight",
        "decoder.upsamples.14.residual.3.gamma",
        "decoder.head.0.gamma",
    ] {
        assert!(has(n), "{n}");
    }
    assert!(!has("encoder.downsamples.2.time_conv.weight") && !has("decoder.upsamples.11.time_conv.weight"));
    assert!(!has("decoder.upsamples.15.residual.0.gamma"));
    let decode_only = declared_names(&WanVaeConfig::wan21(true));
    assert!(decode_only.iter().all(|n| !n.contains("encoder.") && n != "first_stage_model.conv1.weight"));
}

/// Wan2.2's levels nest their blocks (`downsamples.L.downsamples.N`), the resampler follows
/// the residual blocks, time convolutions sit at levels 1-2 (encoder) and 0-1 (decoder),
/// and the shortcuts have no weights; 12 channels at the pixel end, 48 latent.
#[test]
fn declares_the_wan22_layout() {
    let cfg = WanVaeConfig::wan22(false);
    let mut store = ParamStore::new(4096).unwrap();
    WanVae::new(&mut Scope::new(&mut store, &TypeMap::new(), "first_stage_model."), &cfg, &|_| None);
    let ne = |n: &str| store.get(&format!("first_stage_model.{n}")).map(|w| w.ne());
    assert_eq!(ne("encoder.conv1.weight"), Some([3, 3, 3, 12 * 160]));
    assert_eq!(ne("encoder.downsamples.1.downsamples.0.shortcut.weight"), Some([1, 1, 1, 160 * 320]));
    assert_eq!(ne("encoder.downsamples.1.downsamples.2.time_conv.weight"), Some([1, 1, 3, 320 * 320]));
    assert_eq!(ne("encoder.downsamples.0.downsamples.2.resample.1.weight"), Some([3, 3, 160, 160]));
    assert!(ne("encoder.downsamples.0.downsamples.2.time_conv.weight").is_none());
    assert!(ne("encoder.downsamples.3.downsamples.2.resample.1.weight").is_none());
    assert_eq!(ne("encoder.head.2.weight"), Some([3, 3, 3, 640 * 96]));
    assert_eq!(ne("conv1.weight"), Some([1, 1, 1, 96 * 96]));
    assert_eq!(ne("decoder.conv1.weight"), Some([3, 3, 3, 48 * 1024]));
    assert_eq!(ne("decoder.upsamples.0.upsamples.3.time_conv.weight"), Some([1, 1, 3, 1024 * 2048]));
    assert_eq!(ne("decoder.upsamples.0.upsamples.3.resample.1.weight"), Some([3, 3, 1024, 1024]));
    assert_eq!(ne("decoder.upsamples.2.upsamples.0.shortcut.weight"), Some([1, 1, 1, 1024 * 512]));
    assert!(ne("decoder.upsamples.2.upsamples.3.time_conv.weight").is_none());
    assert!(ne("decoder.upsamples.3.upsamples.3.resample.1.weight").is_none());
    assert_eq!(ne("decoder.head.2.weight"), Some([3, 3, 3, 256 * 12]));
    assert_eq!(store.len(), 196); // every tensor of the synthetic file (synth_video.py)
    assert_eq!(cfg.scale(), 16);
}

/// Deterministic f16/f32 weights for a narrow VAE: ~N(0, 0.2²)-ish kernels, norms near 1.
pub(crate) fn random_vae(cfg: &WanVaeConfig) -> (ParamStore, WanVae) {
    let mut store = ParamStore::new(4096).unwrap();
    let vae = WanVae::new(&mut Scope::new(&mut store, &TypeMap::new(), ""), cfg, &|_| None);
    let backend = Arc::new(Backend::cpu().unwrap());
    store.alloc(&backend).unwrap();
    store
        .load(|name, spec, dst| {
            let n = spec.ne.iter().product::<i64>() as usize;
            let seed = name.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
            let v: Vec<f32> = crate::testutil::pattern(n, seed).iter().map(|x| if name.ends_with("gamma") { 1.0 + x * 0.05 } else { x * 0.2 }).collect();
            if spec.ty == F16 {
                let h: Vec<u16> = v.iter().map(|&x| crate::testutil::f32_to_f16(x)).collect();
                dst.copy_from_slice(&h.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
            } else {
                dst.copy_from_slice(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
            }
            Ok(())
        })
        .unwrap();
    (store, vae)
}

fn runner() -> Runner {
    Runner::new(Arc::new(Backend::cpu().unwrap()), 2)
}

fn narrow_wan21() -> WanVaeConfig {
    WanVaeConfig { dim: 4, dec_dim: 4, ..WanVaeConfig::wan21(false) }
}

/// Wan2.2's structure at widths that keep its channel ratios (levels 4/8/16, decoder 16/8/4).
fn narrow_wan22() -> WanVaeConfig {
    WanVaeConfig { dim: 4, dec_dim: 4, ..WanVaeConfig::wan22(false) }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

/// The video path on a narrow VAE (dim 4): 5 frames encode to 2 latent frames (the first
/// alone, then 4 halved twice in time) and decode back to 5, through the feature caches and
/// the time convolutions; the first frame does not depend on the later ones.
#[test]
fn video_frames_round_trip_in_shape() {
    let (_store, vae) = random_vae(&narrow_wan21());
    let mut runner = runner();
    let video = crate::testutil::pattern(16 * 16 * 5 * 3, 9);
    let z = runner.compute(|g| vae.encode_graph(g, g.input_f32(&video, &[16, 16, 5, 3]))).unwrap();
    assert_eq!(z.shape(), &[2, 2, 2, 16]);
    let first = runner
        .compute(|g| {
            let frame = |c: usize| g.input_f32(&video[16 * 16 * 5 * c..16 * 16 * (5 * c + 1)], &[16, 16, 1, 1]);
            vae.encode_graph(g, frame(0).concat(frame(1), 3).concat(frame(2), 3))
        })
        .unwrap();
    assert_eq!(first.shape(), &[2, 2, 1, 16]);
    let out = runner.compute(|g| Ok(vae.decode_graph(g, g.input(&z)))).unwrap();
    assert_eq!(out.shape(), &[16, 16, 5, 3]);
    assert!(out.data().iter().chain(z.data()).all(|v| v.is_finite()));
    // The first latent frame is the first frame's alone.
    for c in 0..16 {
        assert_eq!(z.data()[c * 8..c * 8 + 4], first.data()[c * 4..c * 4 + 4], "channel {c}");
    }
}

/// Decoding one latent frame per computation (the cache on the host in between), and with
/// temporal tiling one frame per computation after each time upsampler, gives the one-graph
/// decode's values bit for bit; so does encoding one chunk per computation. 3 latent frames
/// (9 video frames), Wan2.1 and Wan2.2 structures; and a Wan2.1 structure wide enough for
/// Winograd's video convolutions (16 channels, 32×32 frames), whose sums do not depend on
/// the chunks either.
#[test]
fn streamed_video_matches_one_graph_bit_for_bit() {
    let wide = WanVaeConfig { dim: 16, dec_dim: 16, ..WanVaeConfig::wan21(false) };
    for (cfg, winograd) in [(narrow_wan21(), false), (narrow_wan22(), false), (wide, true)] {
        let (_store, vae) = random_vae(&cfg);
        let mut runner = runner();
        runner.options.cpu_winograd = winograd;
        let s = cfg.scale();
        let side = if winograd { 4 } else { 3 };
        let z = crate::models::vae::testutil::pattern(&[side, 2, 3, 48.min(cfg.z_dim as usize)], -2.0, 2.0, 5);
        let whole = runner.compute(|g| Ok(vae.decode_graph(g, g.input(&z)))).unwrap();
        assert_eq!(whole.shape(), &[side * s, 2 * s, 9, 3]);
        assert!(whole.data().iter().all(|v| v.is_finite()));
        let mut steps = Vec::new();
        let mut progress = |i: i32, n: i32, _: f32| steps.push((i, n));
        let streamed = vae.decode_frames(&mut runner, &z, false, Some(&mut progress)).unwrap();
        assert_eq!(steps, [(1, 3), (2, 3), (3, 3)]);
        assert_eq!(streamed.shape(), whole.shape());
        assert!(bits(&streamed) == bits(&whole), "streamed decode differs ({})", vae.name());
        let tiled = vae.decode_frames(&mut runner, &z, true, None).unwrap();
        assert!(bits(&tiled) == bits(&whole), "temporally tiled decode differs ({})", vae.name());
        if winograd {
            // The one-graph encode would take Winograd's sums; the streamed one never does.
            continue;
        }

        let video = crate::models::vae::testutil::pattern(&[2 * s, 2 * s, 9, 3], -1.0, 1.0, 6);
        let whole = runner.compute(|g| vae.encode_graph(g, g.input(&video))).unwrap();
        assert_eq!(whole.shape(), &[2, 2, 3, cfg.z_dim as usize]);
        let streamed = vae.encode_frames(&mut runner, &video).unwrap();
        assert!(bits(&streamed) == bits(&whole), "streamed encode differs ({})", vae.name());
    }
}

/// A single image is the first chunk alone: the per-item image path equals the video path
/// on one frame, and a decode-only VAE refuses to encode.
#[test]
fn images_are_single_frames() {
    let (_store, vae) = random_vae(&narrow_wan22());
    let mut runner = runner();
    let img = crate::models::vae::testutil::pattern(&[32, 16, 3, 2], -1.0, 1.0, 3);
    let z = VaeNet::encode(&vae, &mut runner, &img).unwrap();
    assert_eq!(z.shape(), &[2, 1, 48, 2]);
    let second = Tensor::from_vec(&[32, 16, 1, 3], img.data()[32 * 16 * 3..].to_vec()).unwrap();
    let z1 = vae.encode_frames(&mut runner, &second).unwrap();
    assert_eq!(z1.data(), &z.data()[2 * 48..]);
    let out = VaeNet::decode(&vae, &mut runner, &z).unwrap();
    assert_eq!(out.shape(), &[32, 16, 3, 2]);
    // Sides that the shortcuts cannot fold are refused, not a crash.
    assert!(VaeNet::encode(&vae, &mut runner, &Tensor::zeros(&[24, 16, 3, 1])).is_err());
    assert!(vae.encode_video(&mut runner, &Tensor::zeros(&[32, 16, 5, 3, 2])).is_err());
    assert!(vae.decode_video(&mut runner, &Tensor::zeros(&[2, 2, 2, 16, 1]), None, None).is_err());
    let (_s, decode_only) = random_vae(&WanVaeConfig { decode_only: true, ..narrow_wan21() });
    assert!(VaeNet::encode(&decode_only, &mut runner, &Tensor::zeros(&[16, 16, 3, 1])).is_err());
}

/// The Wan2.2 pixel patches are `rearrange(b c f (h q) (w r) -> b (c r q) f h w)` and
/// unpatchify undoes them; the shortcuts are the torch layer's: DupUp3D repeats each channel
/// and spreads runs over 2×2(×2) blocks, AvgDown3D (time padded in front) averages them.
#[test]
fn patches_and_shortcuts_follow_the_torch_layout() {
    let mut runner = runner();
    let (w, h, f, c, p) = (6usize, 4usize, 2usize, 3usize, 2usize);
    let x = crate::models::vae::testutil::pattern(&[w, h, f, c], -1.0, 1.0, 1);
    let ne = |t: &Tensor| -> Vec<i64> { t.shape().iter().map(|&d| d as i64).collect() };
    let at = |t: &Tensor, i: [usize; 4]| t.data()[i[0] + t.ne(0) * (i[1] + t.ne(1) * (i[2] + t.ne(2) * i[3]))];
    let patches = runner.compute(|g| Ok(blocks::patchify(g.input(&x), p as i64))).unwrap();
    assert_eq!(patches.shape(), &[w / p, h / p, f, c * p * p]);
    for (xi, yi, t, ch) in itertools(w, h, f, c) {
        let (r, q) = (xi % p, yi % p);
        assert_eq!(at(&patches, [xi / p, yi / p, t, ch * p * p + r * p + q]), at(&x, [xi, yi, t, ch]));
    }
    let back = runner.compute(|g| Ok(blocks::unpatchify(blocks::patchify(g.input(&x), 2), 2))).unwrap();
    assert_eq!(back, x);

    // DupUp3D (in 4 → out 2, 2 frames per frame, 2×2): repeats 4.
    let dup = blocks::DupUp3d::new(4, 2, 2, 2);
    let x = crate::models::vae::testutil::pattern(&[3, 2, 2, 4], -1.0, 1.0, 2);
    let y = runner.compute(|g| Ok(dup.forward(g.input(&x), false))).unwrap();
    assert_eq!(y.shape(), &[6, 4, 4, 2]);
    for (xo, yo, to, co) in itertools(6, 4, 4, 2) {
        let k = ((co * 2 + to % 2) * 2 + yo % 2) * 2 + xo % 2;
        assert_eq!(at(&y, [xo, yo, to, co]), at(&x, [xo / 2, yo / 2, to / 2, k / 4]));
    }
    let first = runner.compute(|g| Ok(dup.forward(g.input(&take_frames(&x, 0..1).unwrap()), true))).unwrap();
    assert_eq!(first, take_frames(&y, 1..2).unwrap());

    // AvgDown3D (in 2 → out 4, 2 frames to 1, 2×2): groups of 4; 3 frames pad one in front.
    let avg = blocks::AvgDown3d::new(2, 4, 2, 2);
    let x = crate::models::vae::testutil::pattern(&[4, 2, 3, 2], -1.0, 1.0, 3);
    let y = runner.compute(|g| Ok(avg.forward(g.input_f32(x.data(), &ne(&x))))).unwrap();
    assert_eq!(y.shape(), &[2, 1, 2, 4]);
    for (xo, yo, to, co) in itertools(2, 1, 2, 4) {
        let mut sum = 0.0;
        for g in 0..4 {
            let j = co * 4 + g;
            let (ci, kt, ky, kx) = (j / 8, (j / 4) % 2, (j / 2) % 2, j % 2);
            // Frame 0 of the padded video is zeros.
            let tp = to * 2 + kt;
            sum += if tp == 0 { 0.0 } else { at(&x, [xo * 2 + kx, yo * 2 + ky, tp - 1, ci]) };
        }
        let got = at(&y, [xo, yo, to, co]);
        assert!((got - sum / 4.0).abs() < 1e-6, "{got} vs {}", sum / 4.0);
    }
}

fn itertools(a: usize, b: usize, c: usize, d: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..d).flat_map(move |l| (0..c).flat_map(move |k| (0..b).flat_map(move |j| (0..a).map(move |i| (i, j, k, l)))))
}

#[test]
fn frame_slices() {
    let data: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let mut runner = runner();
    let out = runner.compute(|g| Ok(blocks::last_frames(g.input_f32(&data, &[2, 1, 3, 2]), 2))).unwrap();
    assert_eq!(out.data(), &[2., 3., 4., 5., 8., 9., 10., 11.]);
    let out = runner.compute(|g| Ok(blocks::frames(g.input_f32(&data, &[2, 1, 3, 2]), 0, 1))).unwrap();
    assert_eq!(out.data(), &[0., 1., 6., 7.]);
    // The host versions: frames 1..3 of [2, 1, 3, 2], and joined back.
    let x = Tensor::from_vec(&[2, 1, 3, 2], data).unwrap();
    let tail = take_frames(&x, 1..3).unwrap();
    assert_eq!(tail.data(), &[2., 3., 4., 5., 8., 9., 10., 11.]);
    assert_eq!(cat_frames(&[take_frames(&x, 0..1).unwrap(), tail]).unwrap(), x);
    assert_eq!(split_frames(&x).unwrap().len(), 3);
    assert!(take_frames(&x, 2..4).is_err());
}
