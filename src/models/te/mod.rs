//! Text encoders and their tokenizers.

pub mod tokenizer;
