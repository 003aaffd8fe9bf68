//! Safe wrappers over ggml: backends, contexts, tensors and graph execution.

pub mod backend;
pub mod eval_callback;
