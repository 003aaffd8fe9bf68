//! Adapters that change a model's weights or layers without being a model themselves.

pub mod controlnet;
pub mod lora;
pub mod photomaker;
