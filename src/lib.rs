//! libstable-diffusion: the stable-diffusion.cpp C API implemented in Rust on ggml.
//!
//! Layers, imported one way only:
//! `capi` → `api` → `pipeline` → `models` / `runtime` → `graph` → `ggml_sys`;
//! `io` reads and writes model files. `types`, `error`, `log` and `params` (the safe
//! parameter structs `api` re-exports and `pipeline` consumes) are shared by all.

#[macro_use]
pub mod log;
#[macro_use]
pub mod error;
pub mod types;
pub mod tensor;
pub mod image;
#[cfg(test)]
pub(crate) mod testutil;

// Only `capi` declares the C interface; cbindgen skips the other modules.
/// cbindgen:ignore
pub mod graph;
/// cbindgen:ignore
pub mod io;
/// cbindgen:ignore
pub mod runtime;
/// cbindgen:ignore
pub mod models;
/// cbindgen:ignore
pub mod params;
/// cbindgen:ignore
pub mod pipeline;
/// cbindgen:ignore
pub mod api;
pub mod capi;
