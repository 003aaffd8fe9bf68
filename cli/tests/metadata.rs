//! `-M metadata`: the report of what sd-cli writes (PNG, JPEG, WebP), of files made by the
//! reference's own writer and of crafted files with every block kind, compared byte for byte
//! with what the reference program prints; damaged inputs give an error and status 1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::opts;
use sd_cli::image_io::{load_image, webp_xmp_packet};
use sd_cli::run::save_results;
use stable_diffusion::api::Image;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/metadata")
}

fn sd_cli_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sd-cli")).args(args).current_dir(dir).output().expect("sd-cli runs")
}

fn metadata(dir: &Path, image: &str, extra: &[&str]) -> Output {
    sd_cli_in(dir, &[&["-M", "metadata", "--image", image][..], extra].concat())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-metadata-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The files under tests/data/metadata and the reference's report of each, in three option
/// sets (see README.md there): the default, `--metadata-all --metadata-raw`, and JSON.
#[test]
fn reports_match_the_reference_program() {
    let dir = data_dir();
    for file in ["stb_writer.png", "stb_writer.jpg", "chunks.png", "segments.jpg", "chunks.webp"] {
        for (suffix, flags) in [
            ("txt", &[][..]),
            ("all-raw.txt", &["--metadata-all", "--metadata-raw"][..]),
            ("json", &["--metadata-format", "json", "--metadata-all", "--metadata-raw"][..]),
        ] {
            let expected = std::fs::read(dir.join(format!("{file}.{suffix}"))).unwrap();
            let out = metadata(&dir, file, flags);
            assert!(out.status.success(), "{file} {flags:?}: {}", text(&out.stderr));
            assert!(out.stdout == expected, "{file} {flags:?}:\n{}\n--- expected ---\n{}", text(&out.stdout), text(&expected));
        }
    }
}

fn picture() -> Image {
    // A smooth picture, as generated ones are (JPEG's error bound below assumes it).
    let px = |i: u32| {
        let (x, y, c) = ((i / 3) % 24, i / 72, i % 3);
        (20 + x * 4 + y * 3 + c * 30) as u8
    };
    Image::new(24, 16, 3, (0..24 * 16 * 3).map(px).collect()).unwrap()
}

/// What img_gen writes (its saving step, with the parameters text of a real request), read
/// back in each format: the reference's layout around the text, the pixels of the PNG.
#[test]
fn reads_what_img_gen_writes() {
    let dir = tmpdir("ours");
    let prompt = "a \"lovely\" cat & <dog>, 'quoted' ünïcode";
    let mut written = Vec::new();
    for name in ["out.png", "out.jpg", "out.webp"] {
        let o = opts(&["-m", "/models/sd1.safetensors", "-p", prompt, "-W", "24", "-H", "16", "--steps", "3", "-s", "5", "-o", dir.join(name).to_str().unwrap()]);
        save_results(&o, &[picture()]).unwrap();
        written.push(sd_cli::metadata::image_parameters(&o, 5, o.cli.mode));
    }
    assert!(written.windows(2).all(|w| w[0] == w[1]));
    let params = &written[0];
    assert!(params.starts_with(prompt) && params.contains("SDCPP: {"), "{params}");

    // PNG: one tEXt chunk; its CRC is read from the file.
    let png = std::fs::read(dir.join("out.png")).unwrap();
    let len = 11 + params.len();
    let crc_at = 33 + 8 + len;
    let crc = u32::from_be_bytes(png[crc_at..crc_at + 4].try_into().unwrap());
    let expected = format!(
        "File: out.png\nFormat: PNG\n\nChunk: tEXt\n  crc: {crc}\n  critical: false\n  data:\n    keyword: parameters\n    text: {params}\n  length: {len}\n\n"
    );
    assert_eq!(text(&metadata(&dir, "out.png", &[]).stdout), expected);
    // --metadata-brief cuts the text at 240 bytes.
    let brief = expected.replace(params.as_str(), &format!("{}...", &params[..240]));
    assert_eq!(text(&metadata(&dir, "out.png", &["--metadata-brief"]).stdout), brief);

    // JPEG: the COM segment (the text ends with the NUL the writer puts after it), after the
    // JFIF header.
    let expected = format!(
        "File: out.jpg\nFormat: JPEG\n\nSegment: APP0\n  data:\n    density_units: 0\n    identifier: JFIF\n    version_major: 1\n    \
         version_minor: 1\n    x_density: 1\n    y_density: 1\n  length: 14\n\nSegment: COM\n  data:\n    label: parameters\n    \
         text: {params}\0\n  length: {}\n\n",
        12 + params.len()
    );
    assert_eq!(text(&metadata(&dir, "out.jpg", &[]).stdout), expected);

    // WebP: the reference's XMP packet, XML-escaped.
    let escaped = params.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;").replace('\'', "&apos;");
    let packet = format!(
        "<?xpacket begin=\"\" id=\"W5M0MpCehiHzreSzNTczkc9d\"?>\n<x:xmpmeta xmlns:x=\"adobe:ns:meta/\">\n  <rdf:RDF \
         xmlns:rdf=\"http://www.w3.org/1999/02/22-rdf-syntax-ns#\">\n    <rdf:Description \
         xmlns:sdcpp=\"https://github.com/leejet/stable-diffusion.cpp/ns/1.0/\">\n      <sdcpp:parameters>{escaped}</sdcpp:parameters>\n    \
         </rdf:Description>\n  </rdf:RDF>\n</x:xmpmeta>\n<?xpacket end=\"w\"?>"
    );
    assert_eq!(webp_xmp_packet(params), packet);
    let expected = format!("File: out.webp\nFormat: WEBP\n\nChunk: XMP\n  data:\n    type: XMP\n    xml: {packet}\n  length: {}\n\n", packet.len());
    assert_eq!(text(&metadata(&dir, "out.webp", &[]).stdout), expected);
    // The container: VP8X (XMP flag, canvas size), the lossless image, then the packet.
    let all = text(&metadata(&dir, "out.webp", &["--metadata-all", "--metadata-format", "json"]).stdout);
    let at = |s: &str| all.find(s).unwrap_or_else(|| panic!("{s} not in {all}"));
    assert!(at("\"name\": \"VP8X\"") < at("\"name\": \"VP8L\"") && at("\"name\": \"VP8L\"") < at("\"name\": \"XMP\""), "{all}");
    assert!(all.contains("\"canvas_height\": 16,\n        \"canvas_width\": 24,") && all.contains("\"xmp\": true"), "{all}");

    // Pixels: PNG and WebP exactly, JPEG (quality 90, 4:2:0) within 8 levels per sample
    // and 2 on average.
    let want = picture();
    for (name, exact) in [("out.png", true), ("out.webp", true), ("out.jpg", false)] {
        let got = load_image(dir.join(name).to_str().unwrap(), None, 3).unwrap();
        assert_eq!((got.width, got.height), (want.width, want.height), "{name}");
        if exact {
            assert_eq!(got, want, "{name}");
        } else {
            let diffs: Vec<u32> = got.data.iter().zip(&want.data).map(|(&a, &b)| u32::from(a.abs_diff(b))).collect();
            let (max, mean) = (diffs.iter().max().copied().unwrap(), diffs.iter().sum::<u32>() as f64 / diffs.len() as f64);
            assert!(max <= 8 && mean <= 2.0, "{name}: max {max}, mean {mean}");
        }
    }

    // --disable-image-metadata: nothing to report in any format.
    for name in ["bare.png", "bare.jpg", "bare.webp"] {
        let o = opts(&["-m", "m.gguf", "--disable-image-metadata", "-o", dir.join(name).to_str().unwrap()]);
        save_results(&o, &[picture()]).unwrap();
        let expected = match &name[5..] {
            "png" => "Format: PNG\n\nNo metadata entries found.\n",
            // The JFIF header is an APPn segment, which the reference counts as metadata.
            "jpg" => "Format: JPEG\n\nSegment: APP0\n  data:\n    density_units: 0\n    identifier: JFIF\n    version_major: 1\n    \
                      version_minor: 1\n    x_density: 1\n    y_density: 1\n  length: 14\n\n",
            _ => "Format: WEBP\n\nNo metadata entries found.\n",
        };
        assert_eq!(text(&metadata(&dir, name, &[]).stdout), format!("File: {name}\n{expected}"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A real generation (the synthetic SD1 model, 2 steps) written as WebP, then inspected.
#[test]
fn img_gen_webp_output_end_to_end() {
    let cache = std::env::var_os("SD_FIXTURE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures"));
    let model = cache.join("sd1.safetensors");
    if !model.exists() {
        eprintln!("skipped: sd1.safetensors is made by scripts/fixtures.sh");
        return;
    }
    let dir = tmpdir("gen");
    let args = ["-m", model.to_str().unwrap(), "-p", "a lovely cat", "--prediction", "v", "-W", "64", "-H", "64", "--steps", "2", "-t", "2", "-o", "cat.webp"];
    let out = sd_cli_in(&dir, &args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let img = load_image(dir.join("cat.webp").to_str().unwrap(), None, 3).unwrap();
    assert_eq!((img.width, img.height), (64, 64));
    let report = metadata(&dir, "cat.webp", &[]);
    assert!(report.status.success());
    let report = text(&report.stdout);
    assert!(report.starts_with("File: cat.webp\nFormat: WEBP\n\nChunk: XMP\n  data:\n    type: XMP\n    xml: <?xpacket"), "{report}");
    assert!(report.contains("<sdcpp:parameters>a lovely cat\nSteps: 2, ") && report.contains("Size: 64x64, Model: sd1.safetensors"), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Damaged and missing inputs: the reference's error on stderr, status 1, never a panic.
#[test]
fn bad_files_are_errors() {
    let dir = tmpdir("bad");
    let good = std::fs::read(data_dir().join("chunks.png")).unwrap();
    std::fs::write(dir.join("truncated.png"), &good[..50]).unwrap();
    std::fs::write(dir.join("no_end.png"), &good[..good.len() - 20]).unwrap();
    let random: Vec<u8> = (0u32..300).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(dir.join("random.bin"), &random).unwrap();
    std::fs::write(dir.join("empty.png"), b"").unwrap();
    std::fs::write(dir.join("truncated.jpg"), &std::fs::read(data_dir().join("segments.jpg")).unwrap()[..60]).unwrap();
    std::fs::write(dir.join("truncated.webp"), &std::fs::read(data_dir().join("chunks.webp")).unwrap()[..70]).unwrap();
    std::fs::create_dir_all(dir.join("folder.png")).unwrap();
    for (name, error) in [
        ("truncated.png", "PNG chunk exceeds file size"),
        ("no_end.png", "PNG missing IEND chunk"),
        ("random.bin", "unsupported image format; only PNG, JPEG, and WebP are supported"),
        ("empty.png", "unsupported image format"),
        ("truncated.jpg", "JPEG segment exceeds file size"),
        ("truncated.webp", "WebP chunk exceeds file size"),
        ("folder.png", "failed to read file: folder.png"),
        ("missing.png", "failed to open file: missing.png"),
    ] {
        for format in ["text", "json"] {
            let out = metadata(&dir, name, &["--metadata-format", format]);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{name}: {err}");
            assert!(err.contains("[ERROR]") && err.contains(error) && !err.contains("panicked"), "{name}: {err}");
            assert!(out.stdout.is_empty(), "{name}: {}", text(&out.stdout));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The options of metadata mode: what the reference checks, and a warning (on stderr, so
/// that stdout is the report alone) for options the mode does not use.
#[test]
fn metadata_options() {
    let dir = data_dir();
    let out = sd_cli_in(&dir, &["-M", "metadata"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("metadata mode needs an image path (--image)"));
    let out = metadata(&dir, "chunks.png", &["--metadata-format", "xml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("invalid metadata format xml, must be one of [text, json]"));
    let out = metadata(&dir, "stb_writer.png", &["-m", "x.gguf", "--steps", "3"]);
    assert!(out.status.success());
    assert_eq!(out.stdout, std::fs::read(dir.join("stb_writer.png.txt")).unwrap());
    let err = text(&out.stderr);
    assert!(err.contains("--model is not used in metadata mode: ignored") && err.contains("--steps is not used"), "{err}");
}
