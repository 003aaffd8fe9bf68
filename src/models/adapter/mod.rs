//! Adapters that change a model's weights or layers without being a model themselves.

pub mod controlnet;
pub mod ip_adapter;
pub mod lora;
pub mod photomaker;
pub mod pulid;
