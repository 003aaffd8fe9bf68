//! pipeline

pub mod prompt;
