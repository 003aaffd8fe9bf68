//! models

pub mod te;
