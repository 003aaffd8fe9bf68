//! Safe Rust API: typed params, contexts and images that the C layer converts to and from.

pub use crate::types::*;

/// The library version reported by `sd_version`.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The commit reported by `sd_commit`.
pub fn commit() -> &'static str {
    env!("SD_GIT_COMMIT")
}
