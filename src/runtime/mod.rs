//! runtime

pub mod preview;
pub mod tiling;
