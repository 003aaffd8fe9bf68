//! Video output: the JPEG encoder and the MJPEG AVI / WAV writers against the reference
//! program's bytes, AVI files parsed back, and where `-M vid_gen` puts its results.
//!
//! The digests are FNV-1a 64 of the files the reference's own writers (stb_image_write and
//! examples/common/media_io.cpp at 97d29908, built with g++) produce from the same pixels.

use sd_cli::args::{parse, Opts, Parsed};
use sd_cli::{avi, jpeg};
use stable_diffusion::api::{Audio, Image};

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Test pixels: gradients plus xorshift noise, clamped (the generator the digests were
/// made with).
fn pixels(w: u32, h: u32, c: u32, seed: u32) -> Image {
    let mut s = seed;
    let mut data = Vec::with_capacity((w * h * c) as usize);
    for y in 0..h as i32 {
        for x in 0..w as i32 {
            for k in 0..c as i32 {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let mut v = (x * 255 / if w > 1 { w as i32 - 1 } else { 1 }) * (k + 1) / 3 + y * 7 + (s % 64) as i32 - 32;
                if k == 2 {
                    v = 255 - v;
                }
                data.push(v.clamp(0, 255) as u8);
            }
        }
    }
    Image::new(w, h, c, data).unwrap()
}

fn decode_jpeg(bytes: &[u8]) -> (u16, u16, Vec<u8>) {
    let mut d = jpeg_decoder::Decoder::new(bytes);
    let px = d.decode().expect("a decodable JPEG");
    let info = d.info().unwrap();
    (info.width, info.height, px)
}

#[test]
fn jpeg_bytes_are_the_reference_writers() {
    // (width, height, channels, quality, seed, length, digest)
    let cases: [(u32, u32, u32, i32, u32, usize, u64); 9] = [
        (64, 48, 3, 90, 1, 1634, 0xb4635c14506940cf),
        (17, 13, 3, 90, 2, 815, 0xe1710500641c1390),
        (33, 20, 4, 90, 3, 1154, 0xd2f91221dcaf8a1f),
        (8, 8, 1, 90, 4, 670, 0x3dc1e1fa5106bb34),
        (2, 2, 3, 90, 5, 684, 0x92e25f56683429d1),
        (40, 24, 3, 95, 6, 1965, 0xcba32f13f42fbd60),
        (40, 24, 3, 30, 7, 749, 0x95681f5f43d14d5d),
        (100, 75, 3, 90, 8, 2316, 0x5e92cd2548fcc097),
        (16, 16, 2, 90, 9, 739, 0x2a1adfdce07f8516),
    ];
    for (w, h, c, q, seed, len, digest) in cases {
        let img = pixels(w, h, c, seed);
        let bytes = jpeg::encode(&img, q, "").unwrap();
        assert_eq!((bytes.len(), fnv1a(&bytes)), (len, digest), "{w}x{h}x{c} q{q}");
        let (dw, dh, px) = decode_jpeg(&bytes);
        assert_eq!((u32::from(dw), u32::from(dh)), (w, h));
        if c == 3 && q == 90 && w >= 16 {
            // Decodes near the pixels: the error stays below that of dropping the ±32 noise
            // (mean 16) though chroma is at half resolution.
            let sum: i32 = px.iter().zip(&img.data).map(|(&a, &b)| (i32::from(a) - i32::from(b)).abs()).sum();
            let mean = f64::from(sum) / px.len() as f64;
            assert!(mean <= 14.0, "{w}x{h} mean error {mean}");
        }
    }
    let with_params = jpeg::encode(&pixels(20, 12, 3, 11), 90, "a cat\nSteps: 4").unwrap();
    assert_eq!((with_params.len(), fnv1a(&with_params)), (874, 0x0210c7bae4f36ba5));
}

fn frames(n: u32, w: u32, h: u32, first_seed: u32) -> Vec<Image> {
    (0..n).map(|i| pixels(w, h, 3, first_seed + i)).collect()
}

fn stereo_sine() -> Audio {
    Audio { sample_rate: 8000, channels: 2, data: (0..2 * 301).map(|i| (i as f32 * 0.05).sin() * 1.2).collect() }
}

#[test]
fn avi_and_wav_bytes_are_the_reference_writers() {
    let video = frames(5, 24, 17, 100);
    let plain = avi::encode(&video, 16, None).unwrap();
    assert_eq!((plain.len(), fnv1a(&plain)), (5118, 0xdecbc8cafd10cde5));
    let with_audio = avi::encode(&video[..3], 24, Some(&stereo_sine())).unwrap();
    assert_eq!((with_audio.len(), fnv1a(&with_audio)), (4470, 0xb2ad253405be749e));
    let wav = avi::encode_wav(&stereo_sine()).unwrap();
    assert_eq!((wav.len(), fnv1a(&wav)), (1248, 0x240955569fb0cf4e));
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

#[test]
fn avi_parses_back() {
    let video = frames(7, 40, 24, 7);
    let bytes = avi::encode(&video, 12, None).unwrap();
    // RIFF size, then the structure as parsed.
    assert_eq!(le32(&bytes, 4) as usize, bytes.len() - 8);
    let info = avi::read(&bytes).unwrap();
    assert_eq!((info.width, info.height, info.fps, info.micro_sec_per_frame), (40, 24, 12, 1_000_000 / 12));
    assert_eq!((info.total_frames, info.streams, info.frames.len()), (7, 1, 7));
    assert!(info.audio.is_none());
    // One key-frame index entry per frame, at absolute offsets, increasing, each chunk padded
    // to an even length.
    assert_eq!(info.index.len(), 7);
    let movi = bytes.windows(4).position(|w| w == b"movi").unwrap();
    let mut next = movi + 4;
    for ((id, flags, offset, size), (frame, jpeg)) in info.index.iter().zip(video.iter().zip(&info.frames)) {
        assert_eq!((id, *flags, *offset as usize, *size as usize), (b"00dc", 0x10, next, jpeg.len()));
        next += 8 + jpeg.len() + jpeg.len() % 2;
        let (w, h, px) = decode_jpeg(jpeg);
        assert_eq!((u32::from(w), u32::from(h), px.len()), (frame.width, frame.height, frame.data.len()));
    }
    // The movi list ends where idx1 starts.
    assert_eq!(le32(&bytes, movi - 4) as usize, next - movi);
    assert_eq!(&bytes[next..next + 4], b"idx1");
    assert_eq!(le32(&bytes, next + 4), 7 * 16);

    let with_audio = avi::read(&avi::encode(&video[..2], 8, Some(&stereo_sine())).unwrap()).unwrap();
    assert_eq!((with_audio.streams, with_audio.fps, with_audio.frames.len()), (2, 8, 2));
    assert_eq!(with_audio.audio.as_ref().map(Vec::len), Some(301 * 2 * 2));
    assert_eq!(with_audio.index.last().map(|e| (e.0, e.1)), Some((*b"01wb", 0)));

    // A corrupted size is caught.
    let mut bad = bytes.clone();
    let at = info.index[3].2 as usize;
    bad[at + 4] ^= 2;
    assert!(avi::read(&bad).is_err());
}

fn opts(argv: &[&str]) -> Opts {
    let Ok(Parsed::Run(mut o)) = parse(argv) else { panic!("{argv:?}") };
    o.resolve(&|_| None).unwrap();
    *o
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-video-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn video_results_are_named_like_the_reference() {
    use sd_cli::run::save_video_results;
    let video = frames(3, 16, 16, 1);
    let dir = tmpdir("names");
    let out = |n: &str| dir.join(n).to_string_lossy().into_owned();

    // An image name becomes an AVI next to it (output.png -> output.avi) ...
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "--fps", "8", "-o", &out("output.png")]);
    save_video_results(&o, &video, None).unwrap();
    assert_eq!(names(&dir), vec!["output.avi"]);
    let info = avi::read(&std::fs::read(dir.join("output.avi")).unwrap()).unwrap();
    assert_eq!((info.fps, info.frames.len()), (8, 3));
    // ... an unknown extension keeps it (clip.mp4 -> clip.mp4.avi), .avi stays, and
    // WebM / WebP video (not written by this sd-cli) falls back to an AVI.
    for (given, written) in [("clip.mp4", "clip.mp4.avi"), ("v.AVI", "v.AVI"), ("w.webm", "w.avi"), ("p.webp", "p.avi")] {
        let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-o", &out(given)]);
        save_video_results(&o, &video, None).unwrap();
        assert!(dir.join(written).is_file(), "{given} -> {written}: {:?}", names(&dir));
    }

    // A printf-style number writes the frames as pictures, numbered from --output-begin-idx,
    // each with the same seed in its parameters.
    let frames_dir = tmpdir("frames");
    let pattern = frames_dir.join("frame_%03d.png").to_string_lossy().into_owned();
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-s", "7", "--video-frames", "3", "-o", &pattern, "--output-begin-idx", "4"]);
    save_video_results(&o, &video, None).unwrap();
    assert_eq!(names(&frames_dir), vec!["frame_004.png", "frame_005.png", "frame_006.png"]);
    for n in names(&frames_dir) {
        let text = sd_cli::image_io::png_text_chunks(&std::fs::read(frames_dir.join(&n)).unwrap()).unwrap();
        let params = String::from_utf8(text[0].1.clone()).unwrap();
        assert!(params.contains("Seed: 7,") && params.contains("\"mode\":\"vid_gen\""), "{params}");
        assert!(params.contains("\"video\":{\"fps\":16,\"frame_count\":3}"), "{params}");
    }
    // JPEG frames too (quality 90, parameters in a COM segment).
    let jpg_dir = tmpdir("jpg");
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-o", &jpg_dir.join("f%d.jpg").to_string_lossy()]);
    save_video_results(&o, &video[..2], None).unwrap();
    assert_eq!(names(&jpg_dir), vec!["f0.jpg", "f1.jpg"]);
    let (w, h, _) = decode_jpeg(&std::fs::read(jpg_dir.join("f0.jpg")).unwrap());
    assert_eq!((w, h), (16, 16));

    // One frame is a picture, as for images.
    let one_dir = tmpdir("one");
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-o", &one_dir.join("single.avi").to_string_lossy()]);
    save_video_results(&o, &video[..1], None).unwrap();
    assert_eq!(names(&one_dir), vec!["single.png"]);

    // Audio: muxed into the AVI; not saved with numbered frames (the reference drops it there
    // too; a warning says so).
    let audio_dir = tmpdir("audio");
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-o", &audio_dir.join("a.avi").to_string_lossy()]);
    save_video_results(&o, &video, Some(&stereo_sine())).unwrap();
    assert!(avi::read(&std::fs::read(audio_dir.join("a.avi")).unwrap()).unwrap().audio.is_some());
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-o", &audio_dir.join("s_%d.png").to_string_lossy()]);
    save_video_results(&o, &video[..2], Some(&stereo_sine())).unwrap();
    assert_eq!(names(&audio_dir), vec!["a.avi", "s_0.png", "s_1.png"]);
    // One frame with audio: the picture and a WAV file beside it.
    let o = opts(&["-M", "vid_gen", "-m", "w.gguf", "-o", &audio_dir.join("one.avi").to_string_lossy()]);
    save_video_results(&o, &video[..1], Some(&stereo_sine())).unwrap();
    assert_eq!(avi::read_wav(&audio_dir.join("one.wav")).unwrap().channels, 2);
    assert!(audio_dir.join("one.png").is_file());

    assert!(save_video_results(&o, &[], None).is_err());
    for d in [dir, frames_dir, jpg_dir, one_dir, audio_dir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// The synthetic fixture cache (`SD_FIXTURE_CACHE`, default ~/.cache/sd-rs-fixtures).
fn fixture_cache() -> std::path::PathBuf {
    std::env::var_os("SD_FIXTURE_CACHE").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures")
    })
}

/// The Wan golden frames: tests/fixtures/golden/wan, else shared/fixtures/golden/wan beside
/// the repository.
fn wan_golden() -> Option<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    [root.join("tests/fixtures/golden/wan"), root.join("../shared/fixtures/golden/wan")].into_iter().find(|d| d.join("cases.json").is_file())
}

/// `sd-cli -M vid_gen` end to end on the synthetic Wan2.1 T2V model: golden case
/// wan/wan_cfg1_9frames (64x64, 9 frames, 3 steps, cfg 1) written as an AVI. Minutes on two
/// cores, so it runs only with SD_PARITY set and the fixtures made
/// (scripts/fixtures.sh wan21-t2v umt5-tiny wan-vae).
#[test]
fn vid_gen_writes_the_wan_video() {
    let cache = fixture_cache();
    let files = ["wan21_t2v.safetensors", "umt5_tiny.safetensors", "wan_vae.safetensors"].map(|f| cache.join(f));
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        eprintln!("skipped: {} is missing (scripts/fixtures.sh wan21-t2v umt5-tiny wan-vae writes it)", missing.display());
        return;
    }
    if std::env::var_os("SD_PARITY").is_none() {
        eprintln!("skipped: a Wan video takes minutes here; set SD_PARITY=1 to run it");
        return;
    }
    let dir = tmpdir("wan");
    let output = dir.join("cat.avi");
    let [dit, umt5, vae] = files.map(|f| f.to_string_lossy().into_owned());
    let args = [
        "-M", "vid_gen", "--diffusion-model", &dit, "--t5xxl", &umt5, "--vae", &vae, "-p", "a lovely cat", "-W", "64", "-H", "64",
        "-s", "42", "--video-frames", "9", "--steps", "3", "--cfg-scale", "1", "--fps", "12", "-t", "2", "-o",
        output.to_str().unwrap(),
    ];
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sd-cli")).args(args).output().unwrap();
    let log = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains(&format!("save result video to '{}'", output.display())), "{log}");
    let info = avi::read(&std::fs::read(&output).unwrap()).unwrap();
    assert_eq!((info.width, info.height, info.fps, info.total_frames, info.frames.len()), (64, 64, 12, 9, 9));
    // Each frame against the golden frame put through the same JPEG encoding. The frames
    // themselves are within max 1 / mean 0.05 of golden (measured with `-o f_%d.png`), but
    // quantisation turns a grey level here and there into a different coefficient: through
    // JPEG that measured up to mean 1.04. A real error moves these frames by 8 or more
    // (fixtures README: prompt 9.6, seed 51).
    let golden = wan_golden();
    for (i, jpeg_bytes) in info.frames.iter().enumerate() {
        let (w, h, px) = decode_jpeg(jpeg_bytes);
        assert_eq!((w, h, px.len()), (64, 64, 64 * 64 * 3));
        let Some(golden) = &golden else { continue };
        let want = sd_cli::image_io::decode_png_file(&golden.join(format!("wan_cfg1_9frames_{i}.png"))).unwrap();
        let (_, _, want_px) = decode_jpeg(&jpeg::encode(&want, jpeg::REFERENCE_QUALITY, "").unwrap());
        let sum: u64 = px.iter().zip(&want_px).map(|(&a, &b)| u64::from(a.abs_diff(b))).sum();
        let mean = sum as f64 / px.len() as f64;
        assert!(mean <= 2.0, "frame {i}: mean |diff| {mean} against the golden frame through JPEG");
    }
    std::fs::remove_dir_all(&dir).ok();
}
