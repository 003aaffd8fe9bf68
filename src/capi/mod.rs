//! The C API of `stable-diffusion.h`: the only `extern "C"` / `#[repr(C)]` layer.
//!
//! Thin by design: each export checks its arguments (NULL pointers, enum values, counts,
//! UTF-8), converts C structs to `api` types, calls `api`, and converts results back. All of
//! it runs inside [`guard::guard`], so an error or a panic becomes the function's documented
//! failure value plus a logged message. `include/stable-diffusion.h` is generated from these
//! declarations by cbindgen (see cbindgen.toml).

mod context;
mod convert;
mod describe;
pub(crate) mod guard;
mod handles;
mod names;
mod params;
mod system;
pub mod types;

pub use context::*;
pub use names::*;
pub use params::*;
pub use system::*;
pub use types::*;
