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
        (&["--video-frames", "4"][..], "not supported by this sd-cli yet"),
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
fn unsupported_modes_say_so() {
    let out = sd_cli(&["-M", "vid_gen", "-m", "x.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("mode vid_gen is not supported"), "{}", text(&out.stderr));
}
