//! pipeline
pub mod callbacks;
