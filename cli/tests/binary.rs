//! The built sd-cli program: exit codes and what it prints.

use std::process::{Command, Output};

fn sd_cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sd-cli"))
        .args(args)
        .env("SD_CLI_MODEL", "/nonexistent/sd-cli-test/sd1.safetensors")
        .output()
        .expect("sd-cli runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn version() {
    let out = sd_cli(&["--version"]);
    assert!(out.status.success());
    let v = text(&out.stdout);
    assert!(v.starts_with("stable-diffusion.cpp version ") && v.contains(", commit "), "{v}");
}

#[test]
fn list_devices() {
    let out = sd_cli(&["--list-devices"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    assert!(listing.lines().any(|l| l.starts_with("CPU\t")), "{listing}");
}

#[test]
fn info_and_bare_invocation() {
    for args in [&["--info"][..], &[][..]] {
        let out = sd_cli(args);
        assert!(out.status.success());
        let s = text(&out.stdout);
        assert!(s.contains("stable-diffusion.cpp version") && s.contains("devices:") && s.contains("CPU"), "{s}");
    }
}

#[test]
fn help_lists_the_options() {
    let out = sd_cli(&["--help"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    for flag in ["--cfg-scale", "--sampling-method", "euler_a", "--list-devices", "SD_CLI_MODEL"] {
        assert!(s.contains(flag), "{flag} not in the help");
    }
}

#[test]
fn unknown_argument_fails_with_usage() {
    let out = sd_cli(&["-p", "cat", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("[ERROR] ") && text(&out.stderr).contains("unknown argument: --no-such-flag"));
    assert!(text(&out.stdout).contains("Usage: "));
}

#[test]
fn bad_values_fail() {
    for (args, msg) in [
        (&["--sampling-method", "nope"][..], "invalid sample method nope"),
        (&["-W", "abc"][..], "invalid parameter for argument: -W"),
        (&["-M", "metadata", "--image", "x.png", "--metadata-format", "yaml"][..], "invalid metadata format yaml"),
        (&["-M", "vid_gen", "-m", "w.gguf", "--video-frames", "0"][..], "video_frames must be greater than 0"),
        (&["-M", "vid_gen", "-m", "w.gguf", "--fps", "0"][..], "fps must be greater than 0"),
        (&["--ref-audio", "a.wav", "-m", "w.gguf"][..], "reference video and audio inputs require vid_gen mode"),
    ] {
        let out = sd_cli(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(text(&out.stderr).contains(msg), "{args:?}: {}", text(&out.stderr));
    }
}

#[test]
fn convert_without_input_is_a_clean_error() {
    let out = sd_cli(&["-M", "convert"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("convert mode needs at least one model input path"), "{}", text(&out.stderr));
    let dir = std::env::temp_dir().join(format!("sd-cli-convert-{}", std::process::id()));
    let target = dir.join("out.gguf");
    let out = sd_cli(&["-M", "convert", "-m", "/nonexistent/model.safetensors", "-o", target.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("failed"), "{}", text(&out.stderr));
    assert!(!target.exists());
}

#[test]
fn generation_without_model_names_the_default() {
    let out = sd_cli(&["-p", "a lovely cat"]);
    assert_eq!(out.status.code(), Some(1));
    let e = text(&out.stderr);
    assert!(e.contains("model_path/diffusion_model") && e.contains("/nonexistent/sd-cli-test/sd1.safetensors"), "{e}");
}

#[test]
fn generation_failure_exits_non_zero() {
    let dir = std::env::temp_dir().join(format!("sd-cli-gen-{}", std::process::id()));
    let output = dir.join("o.png");
    let out = sd_cli(&["-m", "/nonexistent/model.safetensors", "-p", "x", "-W", "64", "-H", "64", "-o", output.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("[ERROR]"), "{}", text(&out.stderr));
    assert!(!output.exists());
}

#[test]
fn metadata_mode_needs_no_model() {
    // The reference checks only --image in metadata mode (tests/metadata.rs covers the rest).
    let out = sd_cli(&["-M", "metadata", "-m", "x.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("metadata mode needs an image path (--image)"), "{}", text(&out.stderr));
}

/// The synthetic ESRGAN x4 model in the fixture cache, made by scripts/fixtures.sh if
/// missing (None when it cannot be made here).
fn esrgan_fixture() -> Option<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cache = fixture_cache();
    let path = cache.join("esrgan_x4.safetensors");
    if !path.exists() {
        let made = Command::new(root.join("scripts/fixtures.sh")).arg("esrgan_x4.safetensors").status();
        if !made.is_ok_and(|s| s.success()) {
            return None;
        }
    }
    Some(path.to_string_lossy().into_owned())
}

/// The synthetic fixture cache (`SD_FIXTURE_CACHE`, default ~/.cache/sd-rs-fixtures).
fn fixture_cache() -> std::path::PathBuf {
    std::env::var_os("SD_FIXTURE_CACHE").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures")
    })
}

/// The PNG at `path` against golden picture `golden` (under tests/fixtures/golden/),
/// within the tolerance of tests/fixtures/README.md.
fn assert_like_golden(path: &std::path::Path, golden: &str) {
    let got = sd_cli::image_io::decode_png_file(path).unwrap();
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden").join(golden);
    let want = sd_cli::image_io::decode_png_file(&golden).unwrap();
    assert_eq!((got.width, got.height, got.channels), (want.width, want.height, want.channels));
    let d: Vec<f64> = got.data.iter().zip(&want.data).map(|(&a, &b)| (a as f64 - b as f64).abs()).collect();
    let (max, mean) = (d.iter().cloned().fold(0.0, f64::max), d.iter().sum::<f64>() / d.len() as f64);
    assert!(max <= 3.0 && mean <= 0.25, "max {max} mean {mean}");
}

/// Width and height of a PNG file.
fn png_size(path: &std::path::Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let be = |o: usize| u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    (be(16), be(20))
}

#[test]
fn upscale_mode_runs_the_model_repeatedly() {
    let Some(model) = esrgan_fixture() else {
        eprintln!("skipped: the ESRGAN fixture cannot be made here (scripts/fixtures.sh esrgan_x4.safetensors)");
        return;
    };
    let init = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/inputs/init_64.png");
    let dir = std::env::temp_dir().join(format!("sd-cli-upscale-{}", std::process::id()));
    let output = dir.join("up.png");
    let o = output.to_str().unwrap();
    // -W/-H resize the input first (12x8), then two x4 passes in 16-pixel tiles.
    let args = ["-M", "upscale", "-i", init, "-W", "12", "-H", "8", "--upscale-model", &model, "--upscale-repeats", "2"];
    let out = sd_cli(&[&args[..], &["--upscale-tile-size", "16", "-o", o]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(png_size(&output), (192, 128));
    assert!(text(&out.stdout).contains("upscaling from (48 x 32) to (192 x 128)"), "{}", text(&out.stdout));

    // A model that does not load leaves the image as it was, like the reference.
    let out = sd_cli(&["-M", "upscale", "-i", init, "--upscale-model", "/nonexistent/x4.pth", "-o", o]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("new_upscaler_ctx failed"), "{}", text(&out.stderr));
    assert_eq!(png_size(&output), (64, 64));
    std::fs::remove_dir_all(&dir).ok();

    let out = sd_cli(&["-M", "upscale", "-i", init, "-o", o]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("needs an upscaler model (--upscale-model)"), "{}", text(&out.stderr));
}

/// `SD_PROFILE=1`: the upscale's graphs are timed node by node and the log ends with their
/// profile (phase, operations, blocks, layers); the picture is the same as without it.
#[test]
fn profile_reports_where_an_upscale_went() {
    let Some(model) = esrgan_fixture() else {
        eprintln!("skipped: the ESRGAN fixture cannot be made here (scripts/fixtures.sh esrgan_x4.safetensors)");
        return;
    };
    let init = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/inputs/init_64.png");
    let dir = std::env::temp_dir().join(format!("sd-cli-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |profile: &str, name: &str| {
        let output = dir.join(name);
        let args = ["-M", "upscale", "-i", init, "-W", "16", "-H", "16", "--upscale-model", &model, "-o", output.to_str().unwrap()];
        let out = Command::new(env!("CARGO_BIN_EXE_sd-cli")).args(args).env("SD_PROFILE", profile).output().expect("sd-cli runs");
        assert!(out.status.success(), "{}", text(&out.stderr));
        (text(&out.stdout), std::fs::read(output).unwrap())
    };
    let (log, profiled) = run("1", "on.png");
    assert!(log.contains("profile of upscale:"), "{log}");
    for part in ["graph computations", "operations (the", "blocks (the", "layers (the"] {
        assert!(log.contains(part), "no {part:?} in\n{log}");
    }
    let (log, plain) = run("0", "off.png");
    assert!(!log.contains("profile of"), "{log}");
    assert_eq!(profiled, plain, "the same picture with the profiler on");
    std::fs::remove_dir_all(&dir).ok();
}

/// `<lora:name:multiplier>` in the prompt with `--lora-model-dir`: the tag is removed from the
/// prompt and the LoRA file of that directory applied, giving golden case sd1-lora/lora_1_0.
#[test]
fn lora_tags_apply_the_lora_model_dir_files() {
    let cache = fixture_cache();
    let (model, loras) = (cache.join("sd1.safetensors"), cache.join("loras"));
    if !model.exists() || !loras.join("lora_sd1.safetensors").exists() {
        eprintln!("skipped: sd1.safetensors and loras/lora_sd1.safetensors are made by scripts/fixtures.sh");
        return;
    }
    let dir = std::env::temp_dir().join(format!("sd-cli-lora-{}", std::process::id()));
    let output = dir.join("lora.png");
    let args = [
        "-m", model.to_str().unwrap(), "-p", "a lovely cat<lora:lora_sd1:1>", "--lora-model-dir", loras.to_str().unwrap(),
        "--lora-apply-mode", "immediately", "--prediction", "v", "-W", "64", "-H", "64", "-s", "42", "--steps", "4",
        "--sampling-method", "euler", "-t", "2", "-o", output.to_str().unwrap(),
    ];
    let out = sd_cli(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = text(&out.stdout) + &text(&out.stderr);
    assert!(log.contains("(792 / 792) LoRA tensors have been applied"), "{log}");
    assert_like_golden(&output, "sd1-lora/lora_1_0_0.png");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--hires` with a model named in `--hires-upscalers-dir` (the fixture cache holds
/// esrgan_x4.safetensors): golden case sd1-hires/hires_model_esrgan.
#[test]
fn hires_fix_with_a_model_from_the_upscalers_dir() {
    let cache = fixture_cache();
    let model = cache.join("sd1.safetensors");
    if !model.exists() || esrgan_fixture().is_none() {
        eprintln!("skipped: sd1.safetensors and esrgan_x4.safetensors are made by scripts/fixtures.sh");
        return;
    }
    let dir = std::env::temp_dir().join(format!("sd-cli-hires-{}", std::process::id()));
    let output = dir.join("hires.png");
    let args = [
        "-m", model.to_str().unwrap(), "-p", "a lovely cat", "--prediction", "v", "-W", "64", "-H", "64", "-s", "42",
        "--steps", "4", "--sampling-method", "euler", "-t", "2", "--hires", "--hires-upscalers-dir", cache.to_str().unwrap(),
        "--hires-upscaler", "esrgan_x4", "--hires-steps", "3", "--hires-denoising-strength", "0.5", "-o", output.to_str().unwrap(),
    ];
    let out = sd_cli(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = text(&out.stdout) + &text(&out.stderr);
    assert!(log.contains("hires fix: loading model upscaler from"), "{log}");
    assert_like_golden(&output, "sd1-hires/hires_model_esrgan_0.png");
    std::fs::remove_dir_all(&dir).ok();

    // A name that is not in the directory is refused before anything loads.
    let out = sd_cli(&["-m", model.to_str().unwrap(), "--hires", "--hires-upscalers-dir", cache.to_str().unwrap(), "--hires-upscaler", "no_such_x4"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("can not find hires upscaler no_such_x4"), "{}", text(&out.stderr));
}

/// vid_gen reads its inputs before loading any model (as the reference does), so a bad input
/// fails at once with a message naming it.
#[test]
fn vid_gen_input_errors_come_first() {
    let dir = std::env::temp_dir().join(format!("sd-cli-vid-{}", std::process::id()));
    let out = sd_cli(&["-M", "vid_gen", "-m", "/nonexistent/wan.gguf", "--control-video", "/nonexistent/frames", "-o", dir.join("v.avi").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("'/nonexistent/frames' is not a valid directory"), "{}", text(&out.stderr));
    let out = sd_cli(&["-M", "vid_gen", "-m", "/nonexistent/wan.gguf", "--ref-video", "/nonexistent/rv", "--ref-audio", "/nonexistent/a.wav"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("/nonexistent/rv"), "{}", text(&out.stderr));
    // Then the model: a clean failure, nothing written.
    let out = sd_cli(&["-M", "vid_gen", "-m", "/nonexistent/wan.gguf", "--video-frames", "5", "--mask", "m.png", "-o", dir.join("v.avi").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let log = text(&out.stdout) + &text(&out.stderr);
    assert!(log.contains("--mask is not used in vid_gen mode: ignored"), "{log}");
    assert!(log.contains("new_sd_ctx_t failed"), "{log}");
    assert!(!dir.join("v.avi").exists());
}
