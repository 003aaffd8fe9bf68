//! Text encoders (conditioning networks) and their tokenizers, like the reference's
//! `src/model/te/`.

pub mod bpe;
pub mod clip;
pub mod clip_vision;
pub mod gpt_oss;
pub mod gpt_oss_tokenizer;
pub mod gemma2;
pub mod gemma3;
pub mod gemma_tokenizer;
pub mod llm;
pub mod mistral_tokenizer;
pub mod qwen_tokenizer;
pub mod qwen_vision;
#[cfg(test)]
mod test_weights;
pub mod t5;
pub mod t5_tokenizer;
pub mod tokenizer;
