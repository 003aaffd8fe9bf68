//! Generation orchestration: prompts to conditioning, the sampling loop, decoding.

pub mod callbacks;
pub mod prompt;
