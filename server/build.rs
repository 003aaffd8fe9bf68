//! sd-server is installed in PREFIX/bin next to PREFIX/lib, where the ggml libraries are.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-arg-bins=-Wl,-rpath,$ORIGIN/../lib");
}
