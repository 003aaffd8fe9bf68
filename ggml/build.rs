//! Builds ggml from the pinned upstream tree and generates its bindings.
//!
//! The tree is not committed: it comes from a pinned crates.io package (scripts/third-party.tsv),
//! unpacked into `third_party/ggml` by `scripts/fetch-sources.sh` or, when missing, by this
//! script (`cargo fetch --locked` first if the archive is not in cargo's cache).
//! `GGML_SOURCE_DIR` points the build at a ggml tree of the user's own instead.
//!
//! Default build: ggml as shared libraries with the CPU backend compiled once per ISA
//! level (`libggml-cpu-<variant>.so`), the best of which ggml picks at run time. Feature
//! `native`: one static CPU backend tuned for the build machine.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../scripts/third_party.rs"]
mod third_party;

/// CPU variants built by default on x86_64: a baseline for any x86_64 and AVX2 (most
/// machines since 2013). AVX2 is what the reference's pictures are made with: ggml's
/// AVX-512 variants (skylakex, zen4) sum softmax, norms and products on 16 lanes, which
/// SDXL amplifies past the golden tolerance, so AVX-512 machines run the AVX2 variant too
/// (our own matrix kernels do the heavy products either way). Override with
/// SD_GGML_CPU_VARIANTS (comma list of ggml variant names, or "all").
/// Tensor names in diffusion checkpoints exceed ggml's default 64 bytes; the reference
/// builds with 160 and GGUF files it writes need it to be read back.
const GGML_MAX_NAME: u32 = 160;

const DEFAULT_X86_VARIANTS: &[&str] = &["x64", "haswell"];

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=cmake/CMakeLists.txt");
    println!("cargo:rerun-if-changed=cmake/vulkan-compat.hpp");
    println!("cargo:rerun-if-env-changed=GGML_SOURCE_DIR");
    println!("cargo:rerun-if-env-changed=SD_GGML_CPU_VARIANTS");
    println!("cargo:rustc-check-cfg=cfg(ggml_generated_bindings)");

    let user_source = env::var_os("GGML_SOURCE_DIR").map(PathBuf::from);
    let (src, pinned) = match &user_source {
        Some(p) => (p.clone(), None),
        None => locate_pinned_tree(&manifest_dir),
    };
    // One spelling per tree, so a shared build folder is not reconfigured by symlinked paths.
    let src = fs::canonicalize(&src).unwrap_or(src);
    if !src.join("include/ggml.h").exists() {
        fail(&format!("{} does not look like a ggml source tree (no include/ggml.h)", src.display()));
    }
    println!("cargo:rerun-if-changed={}", src.join("include").display());
    println!("cargo:rerun-if-changed={}", src.join("src").display());

    let lib_dir = build_ggml(&manifest_dir, &src, pinned.as_deref(), &out_dir);
    generate_bindings(&manifest_dir, &src, &out_dir);
    if user_source.is_some() {
        // A foreign tree may differ from the committed bindings: use the fresh ones.
        println!("cargo:rustc-cfg=ggml_generated_bindings");
    }
    println!("cargo:rustc-env=GGML_SYS_LIB_DIR={}", lib_dir.display());
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:include_dir={}", src.join("include").display());
    println!("cargo:source_dir={}", src.display());
}

fn fail(msg: &str) -> ! {
    eprintln!("\nggml-sys: {msg}\n");
    panic!("ggml-sys: {msg}");
}

/// `third_party/ggml`, unpacked from the pinned package when missing, and the package's
/// `name-version`.
fn locate_pinned_tree(manifest_dir: &Path) -> (PathBuf, Option<String>) {
    let root = manifest_dir.join("..");
    third_party::ensure(&root, |e| e.dest == "ggml").unwrap_or_else(|e| fail(&format!("the ggml sources are missing: {e}")));
    let list = third_party::list(&root).unwrap_or_else(|e| fail(&e));
    let pinned = list.iter().find(|e| e.dest == "ggml").map(|e| format!("{}-{}", e.package, e.version));
    (root.join("third_party/ggml"), pinned)
}

/// The pinned tree `src` (package `pinned`) copied once next to a shared build, the copy
/// every checkout builds: CMake ties a build folder to one source path, so checkouts
/// building from their own `third_party/ggml` would rebuild ggml each time another one
/// built. Called under the build lock.
fn shared_source(shared_root: &Path, pinned: &str, src: &Path) -> PathBuf {
    let dest = shared_root.join("sources").join(pinned);
    if dest.join("include/ggml.h").exists() {
        return dest;
    }
    let staging = shared_root.join("sources").join(format!(".{pinned}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(staging.parent().unwrap()).unwrap();
    run(Command::new("cp").arg("-R").arg(src).arg(&staging));
    // Copies are renamed into place whole: a folder without ggml.h is a broken leftover.
    if !dest.join("include/ggml.h").exists() {
        let _ = fs::remove_dir_all(&dest);
    }
    match fs::rename(&staging, &dest) {
        Ok(()) => {}
        // Another configuration's build was first.
        Err(_) if dest.join("include/ggml.h").exists() => {
            let _ = fs::remove_dir_all(&staging);
        }
        Err(e) => fail(&format!("cannot move {} to {}: {e}", staging.display(), dest.display())),
    }
    dest
}

/// Distinguishes shared build folders of different configurations.
fn config_tag() -> String {
    // r2: llamafile off (the first configuration had it on); r3: x64 + haswell only.
    let mut tag = format!("ggml-r3-n{GGML_MAX_NAME}");
    for f in ["native", "openmp", "cuda", "vulkan", "metal", "rpc"] {
        if feature(f) {
            tag.push('-');
            tag.push_str(f);
        }
    }
    if let Ok(v) = env::var("SD_GGML_CPU_VARIANTS") {
        tag.push('-');
        tag.push_str(&v.replace(',', "_"));
    }
    tag
}

/// Serialises builds that share one folder.
fn lock_dir(dir: &Path) -> fs::File {
    let f = fs::File::create(dir.join(".build-lock")).unwrap();
    f.lock().unwrap();
    f
}

fn feature(name: &str) -> bool {
    env::var_os(format!("CARGO_FEATURE_{}", name.to_uppercase())).is_some()
}

fn on_off(b: bool) -> &'static str {
    if b {
        "ON"
    } else {
        "OFF"
    }
}

fn run(cmd: &mut Command) {
    eprintln!("running {cmd:?}");
    let status = cmd.status().unwrap_or_else(|e| fail(&format!("could not run {cmd:?}: {e}")));
    if !status.success() {
        fail(&format!("{cmd:?} failed with {status}"));
    }
}

fn build_ggml(manifest_dir: &Path, src: &Path, pinned: Option<&str>, out_dir: &Path) -> PathBuf {
    let native = feature("native");
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap();
    // SD_GGML_BUILD_DIR lets several checkouts share one ggml build (it takes minutes).
    println!("cargo:rerun-if-env-changed=SD_GGML_BUILD_DIR");
    // Empty counts as unset (a relative "" would put the build inside this crate).
    let shared_root = env::var_os("SD_GGML_BUILD_DIR").filter(|v| !v.is_empty()).map(PathBuf::from);
    let (build_dir, wrapper_dir) = match &shared_root {
        Some(root) => {
            // CMake ties a build folder to one source folder: give every checkout the same
            // copy of our wrapper project, next to the shared build.
            (root.join(config_tag()), root.join("wrapper"))
        }
        None => (out_dir.join("cmake-build"), manifest_dir.join("cmake")),
    };
    fs::create_dir_all(&build_dir).unwrap();
    let _lock = lock_dir(&build_dir);
    let src = match (&shared_root, pinned) {
        (Some(root), Some(pinned)) => shared_source(root, pinned, src),
        _ => src.to_path_buf(),
    };
    if wrapper_dir != manifest_dir.join("cmake") {
        fs::create_dir_all(&wrapper_dir).unwrap();
        for file in ["CMakeLists.txt", "vulkan-compat.hpp"] {
            let wrapper = fs::read(manifest_dir.join("cmake").join(file)).unwrap();
            let dest = wrapper_dir.join(file);
            if fs::read(&dest).ok().as_deref() != Some(&wrapper[..]) {
                fs::write(&dest, wrapper).unwrap();
            }
        }
    }

    let variants: Vec<String> = if native || target_arch != "x86_64" {
        Vec::new()
    } else {
        match env::var("SD_GGML_CPU_VARIANTS") {
            Ok(v) if v.trim() == "all" => vec!["all".into()],
            Ok(v) if !v.trim().is_empty() => v.split(',').map(|s| s.trim().to_string()).collect(),
            _ => DEFAULT_X86_VARIANTS.iter().map(|s| s.to_string()).collect(),
        }
    };
    let dynamic = !native;

    let mut cfg = Command::new("cmake");
    cfg.current_dir(&build_dir)
        .arg(&wrapper_dir)
        .arg("-G")
        .arg("Unix Makefiles")
        .arg(format!("-DGGML_SOURCE_DIR={}", src.display()))
        .arg("-DCMAKE_BUILD_TYPE=Release")
        .arg("-DCMAKE_POSITION_INDEPENDENT_CODE=ON")
        .arg(format!("-DBUILD_SHARED_LIBS={}", on_off(dynamic)))
        .arg(format!("-DGGML_BACKEND_DL={}", on_off(dynamic)))
        .arg(format!("-DGGML_CPU_ALL_VARIANTS={}", on_off(dynamic && !variants.is_empty())))
        .arg(format!("-DGGML_NATIVE={}", on_off(native)))
        // Like stable-diffusion.cpp's build: one dot product per output (llamafile's tiled
        // GEMM sums in another order, which SDXL amplifies past the golden tolerance).
        .arg("-DGGML_LLAMAFILE=OFF")
        .arg(format!("-DGGML_OPENMP={}", on_off(feature("openmp"))))
        .arg(format!("-DGGML_CUDA={}", on_off(feature("cuda"))))
        .arg(format!("-DGGML_VULKAN={}", on_off(feature("vulkan"))))
        .arg(format!("-DGGML_METAL={}", on_off(feature("metal"))))
        .arg(format!("-DGGML_RPC={}", on_off(feature("rpc"))))
        .arg("-DGGML_BUILD_TESTS=OFF")
        .arg("-DGGML_BUILD_EXAMPLES=OFF")
        .arg("-DGGML_CCACHE=OFF")
        .arg("-DCMAKE_BUILD_RPATH=$ORIGIN")
        .arg(format!("-DCMAKE_C_FLAGS=-DGGML_MAX_NAME={GGML_MAX_NAME}"))
        .arg(format!("-DCMAKE_CXX_FLAGS=-DGGML_MAX_NAME={GGML_MAX_NAME}"))
        .arg(format!("-DCMAKE_CUDA_FLAGS=-DGGML_MAX_NAME={GGML_MAX_NAME}"));
    run(&mut cfg);

    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    let mut targets: Vec<String> = vec!["ggml-base".into()];
    if dynamic {
        if variants.is_empty() {
            targets.push("ggml-cpu".into());
        } else if variants[0] != "all" {
            targets.extend(variants.iter().map(|v| format!("ggml-cpu-{v}")));
        }
        for (feat, tgt) in [("cuda", "ggml-cuda"), ("vulkan", "ggml-vulkan"), ("metal", "ggml-metal"), ("rpc", "ggml-rpc")] {
            if feature(feat) {
                targets.push(tgt.into());
            }
        }
    }
    let build_all = !dynamic || variants.first().map(|v| v == "all").unwrap_or(false);
    let mut b = Command::new("cmake");
    b.current_dir(&build_dir).arg("--build").arg(".").arg("-j").arg(&jobs);
    if !build_all {
        b.arg("--target").args(&targets);
    }
    run(&mut b);
    if dynamic && !build_all {
        // libggml depends on every configured backend; build it alone, the chosen ones exist.
        run(Command::new("make")
            .current_dir(build_dir.join("ggml/src"))
            .arg(format!("-j{jobs}"))
            .arg("ggml/fast"));
    }

    let lib_dir = out_dir.join("lib");
    let _ = fs::remove_dir_all(&lib_dir);
    fs::create_dir_all(&lib_dir).unwrap();
    collect_libraries(&build_dir, &lib_dir, dynamic);

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    if dynamic {
        println!("cargo:rustc-link-lib=dylib=ggml");
        println!("cargo:rustc-link-lib=dylib=ggml-base");
        // Dev builds (tests, examples) find the ggml libraries where they were built.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    } else {
        for lib in ["ggml", "ggml-cpu", "ggml-base"] {
            println!("cargo:rustc-link-lib=static={lib}");
        }
        for (feat, lib) in [("cuda", "ggml-cuda"), ("vulkan", "ggml-vulkan"), ("metal", "ggml-metal"), ("rpc", "ggml-rpc")] {
            if feature(feat) {
                println!("cargo:rustc-link-lib=static={lib}");
            }
        }
        println!("cargo:rustc-link-lib=dylib=stdc++");
        if feature("openmp") {
            println!("cargo:rustc-link-lib=dylib=gomp");
        }
        if feature("cuda") {
            for l in ["cudart", "cublas", "cublasLt", "cuda"] {
                println!("cargo:rustc-link-lib=dylib={l}");
            }
        }
        if feature("vulkan") {
            println!("cargo:rustc-link-lib=dylib=vulkan");
        }
    }
    println!("cargo:dynamic={}", if dynamic { 1 } else { 0 });
    lib_dir
}

/// Gathers every library the build produced into one flat folder (sonames kept), the
/// layout we ship: ggml's loader finds the CPU variants next to libggml.
fn collect_libraries(build_dir: &Path, lib_dir: &Path, dynamic: bool) {
    let mut stack = vec![build_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            let ft = entry.file_type().unwrap();
            if ft.is_dir() {
                if name != "CMakeFiles" {
                    stack.push(path);
                }
                continue;
            }
            let wanted = if dynamic {
                name.starts_with("libggml") && name.contains(".so")
            } else {
                name.starts_with("libggml") && name.ends_with(".a")
            };
            if !wanted {
                continue;
            }
            let dest = lib_dir.join(&name);
            if ft.is_symlink() {
                let target = fs::read_link(&path).unwrap();
                let _ = fs::remove_file(&dest);
                std::os::unix::fs::symlink(target, &dest).unwrap();
            } else {
                fs::copy(&path, &dest).unwrap();
            }
        }
    }
}

fn generate_bindings(manifest_dir: &Path, src: &Path, out_dir: &Path) {
    let bindings = bindgen::Builder::default()
        .header(manifest_dir.join("wrapper.h").to_string_lossy())
        .clang_arg(format!("-I{}", src.join("include").display()))
        .clang_arg(format!("-DGGML_MAX_NAME={GGML_MAX_NAME}"))
        .allowlist_function("(ggml|gguf)_.*")
        .allowlist_type("(ggml|gguf)_.*")
        .allowlist_var("(GGML|GGUF)_.*")
        .derive_default(true)
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen failed: {e}")));
    bindings.write_to_file(out_dir.join("bindings.rs")).unwrap();
}
