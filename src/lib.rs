//! libstable-diffusion: the stable-diffusion.cpp C API implemented in Rust on ggml.
//!
//! Layers, imported one way only:
//! `capi` → `api` → `pipeline` → `models` / `runtime` → `graph` → `ggml_sys`;
//! `io` reads and writes model files. `types`, `error` and `log` are shared by all.

#[macro_use]
pub mod log;
#[macro_use]
pub mod error;
pub mod types;
pub mod tensor;
pub mod image;

pub mod graph;
pub mod io;
pub mod runtime;
pub mod models;
pub mod pipeline;
pub mod api;
pub mod capi;
