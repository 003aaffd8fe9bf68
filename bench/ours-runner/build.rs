//! The default build links ggml's shared libraries: let the runner find them where ggml-sys
//! built them (cargo only sets this rpath for ggml-sys's own targets).
fn main() {
    if let Ok(dir) = std::env::var("DEP_GGML_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
