//! models

pub mod vae;
