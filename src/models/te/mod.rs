//! Text encoders and their tokenizers.

pub mod clip;
#[cfg(test)]
mod test_weights;
pub mod tokenizer;
