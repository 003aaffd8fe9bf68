//! Safe wrappers over ggml: backends, contexts, tensors and graph execution.

pub mod backend;
