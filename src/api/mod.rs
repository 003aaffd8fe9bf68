//! Safe Rust API: typed params, contexts and images that the C layer converts to and from.

mod context;

pub use crate::types::*;
pub use context::*;
pub use crate::params::*;

pub use crate::image::Image;
pub use crate::runtime::preprocess::CannyParams;

use crate::error::Result;
use std::path::Path;

/// The library version reported by `sd_version`.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The commit reported by `sd_commit`.
pub fn commit() -> &'static str {
    env!("SD_GIT_COMMIT")
}

/// Replaces an interleaved 8-bit RGB(A) image by its Canny edge map, in place.
pub fn preprocess_canny(pixels: &mut [u8], width: u32, height: u32, channels: u32, params: &CannyParams) -> Result<()> {
    crate::runtime::preprocess::canny(pixels, width as usize, height as usize, channels as usize, params)
}

/// Merges an importance-matrix file into the collected statistics.
pub fn load_imatrix(path: &Path) -> Result<()> {
    crate::runtime::imatrix::collector().lock().load(path)
}

/// Writes the collected importance matrix.
pub fn save_imatrix(path: &Path) -> Result<()> {
    crate::runtime::imatrix::collector().lock().save(path)
}

/// Starts collecting matrix-product activations during graph evaluation.
pub fn enable_imatrix_collection() {
    crate::runtime::imatrix::enable_collection();
}

/// Stops collecting (removes the backend evaluation callback).
pub fn disable_imatrix_collection() {
    crate::runtime::imatrix::disable_collection();
}
