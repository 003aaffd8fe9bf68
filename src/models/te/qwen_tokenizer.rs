//! The Qwen2 byte-level BPE tokenizer of the LLM text encoders (Qwen3 for Z-Image and
//! Flux.2 klein, Qwen2.5-VL for Qwen-Image), as the reference runs it, which is not what
//! Hugging Face `tokenizers` does for every text (see [`super::bpe`] for the splitting and
//! merging shared with Mistral's):
//!
//! - the vocabulary is rebuilt from the 256 byte characters (GPT-2 order), one token per
//!   merge (its two halves joined) and the special tokens, in that order; the merges table is
//!   the reference's (`qwen_merges.hpp`, embedded at build time);
//! - runs of whitespace are one piece (so `"a  b"` keeps both spaces apart from `b`), a lone
//!   space before CJK text ends up as its own `Ġ` once BPE has run, contractions are
//!   lower-cased, characters beyond the BMP that do not lead a letter run are dropped.
//!
//! No BOS / EOS are added; `<|endoftext|>` (151643) is the padding token.

use super::bpe::{parse_merges, BpeTokenizer, SpecialIds};
use crate::error::Result;
use once_cell::sync::OnceCell;

const MERGES: &[u8] = include_bytes!(env!("SD_QWEN_MERGES"));

/// The special tokens after the merges, in id order (the first is 151643).
pub const SPECIAL_TOKENS: [&str; 31] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|boi_token|>",
    "<|bor_token|>",
    "<|eor_token|>",
    "<|bot_token|>",
    "<|tms_token|>",
];

/// `<|endoftext|>`: padding, and the id of anything not in the vocabulary.
pub const PAD_TOKEN: u32 = 151643;
pub const IM_START: u32 = 151644;
pub const IM_END: u32 = 151645;

/// The tokenizer over the bundled merges, built once per process.
pub fn shared() -> Result<&'static BpeTokenizer> {
    static SHARED: OnceCell<BpeTokenizer> = OnceCell::new();
    SHARED.get_or_try_init(|| {
        let text = std::str::from_utf8(MERGES).map_err(|e| crate::error::Error::new(format!("bundled Qwen2 merges are not UTF-8: {e}")))?;
        from_merges(text)
    })
}

/// Builds the vocabulary from merges (`left right` per line, each line ending in '\n').
pub fn from_merges(text: &str) -> Result<BpeTokenizer> {
    let pairs = parse_merges("Qwen2", text)?;
    let mut tokens: Vec<Box<[u8]>> = Vec::with_capacity(256 + pairs.len() + SPECIAL_TOKENS.len());
    tokens.extend(super::tokenizer::byte_chars_in_vocab_order().iter().map(|&(b, _)| Box::from([b].as_slice())));
    tokens.extend(pairs.iter().map(|(a, b)| [&a[..], &b[..]].concat().into_boxed_slice()));
    let first_special = tokens.len() as u32;
    ensure!(
        first_special == PAD_TOKEN,
        "Qwen2 merges: {} merges give <|endoftext|> id {first_special}, expected {PAD_TOKEN}",
        pairs.len()
    );
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| Box::from(s.as_bytes())));
    let special_id = |s: &str| SPECIAL_TOKENS.iter().position(|&t| t == s).map(|i| first_special + i as u32);
    let specials = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    BpeTokenizer::new("qwen2", tokens, &pairs, specials, &special_id, SpecialIds { unk: PAD_TOKEN, bos: None, pad: PAD_TOKEN })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> &'static BpeTokenizer {
        shared().unwrap()
    }

    #[test]
    fn vocabulary_layout() {
        let t = tok();
        assert_eq!(t.vocab_size(), 151643 + SPECIAL_TOKENS.len());
        // GPT-2 byte order: '!' is 0, 'a' 64, the space (mapped to Ġ) 220, '\n' (Ċ) 198.
        assert_eq!(t.encode("!"), [0]);
        assert_eq!(t.encode("a"), [64]);
        assert_eq!(t.encode(" "), [220]);
        assert_eq!(t.encode("\n"), [198]);
        // The first merge is "Ġ Ġ": two spaces are token 256.
        assert_eq!(t.encode("  "), [256]);
        assert_eq!(t.encode("<|endoftext|><|im_start|><|im_end|><|tms_token|>"), [PAD_TOKEN, IM_START, IM_END, 151673]);
        assert_eq!(t.decode(&[IM_START, 872, 198]), "<|im_start|>user\n");
    }

    #[test]
    fn chat_template_tokens() {
        // Ids every Qwen chat template shows: <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
        let ids = tok().encode("<|im_start|>user\na lovely cat<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(ids, [IM_START, 872, 198, 64, 16690, 8251, IM_END, 198, IM_START, 77091, 198]);
        assert_eq!(tok().encode("blurry, low quality"), [33542, 884, 11, 3347, 4271]);
    }

    #[test]
    fn reference_tokens_for_unusual_text() {
        let t = tok();
        // A space before CJK text stays its own Ġ: no merge joins it to ä¸ľäº¬ (东京).
        assert_eq!(t.encode(" 东京"), [220, 107513]);
        // The emoji is dropped, its space stays.
        assert_eq!(t.encode(" 🌃"), [220]);
        assert_eq!(t.encode("a (red"), [64, 320, 1151]);
        assert_eq!(t.encode(" red apple"), [2518, 23268]);
        // Unknown-free round trip of ordinary text.
        let text = "The quick brown fox, 3 times!";
        assert_eq!(t.decode(&t.encode(text)), text);
    }
}
