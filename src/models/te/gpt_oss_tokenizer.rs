//! The GPT-OSS tokenizer (o200k) as the reference runs it for Lens's text encoder: byte-level
//! BPE over the reference's tables (`gpt_oss_vocab.hpp`, a token → id JSON of 199998
//! tokens, and `gpt_oss_merges.hpp`, embedded at build time), split and merged like Qwen2's
//! (see [`super::bpe`]: the reference uses its Qwen2-style pre-tokenizer here too, not
//! o200k's own split rule). The 21 special tokens (`<|startoftext|>`, `<|endoftext|>`, …,
//! `<|channel|>`, `<|start|>`, `<|end|>`, `<|message|>`, …, `<|endofprompt|>`) follow the
//! vocabulary, ids 199998-200018. No BOS; `<|endoftext|>` (199999) pads and stands for
//! unknown strings.

use super::bpe::{parse_merges, BpeTokenizer, ByteChars, SpecialIds};
use crate::error::{Context as _, Result};
use once_cell::sync::OnceCell;
use std::collections::HashMap;

const MERGES: &[u8] = include_bytes!(env!("SD_GPT_OSS_MERGES"));
const VOCAB: &[u8] = include_bytes!(env!("SD_GPT_OSS_VOCAB"));

pub const END_OF_TEXT: u32 = 199999;

/// The special tokens in the reference's order; they take the ids after the vocabulary's.
const SPECIALS: [&str; 21] = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|reserved_200000|>",
    "<|reserved_200001|>",
    "<|return|>",
    "<|constrain|>",
    "<|reserved_200004|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|reserved_200009|>",
    "<|reserved_200010|>",
    "<|reserved_200011|>",
    "<|call|>",
    "<|reserved_200013|>",
    "<|reserved_200014|>",
    "<|reserved_200015|>",
    "<|reserved_200016|>",
    "<|reserved_200017|>",
    "<|endofprompt|>",
];

/// The tokenizer over the bundled tables, built once per process.
pub fn shared() -> Result<&'static BpeTokenizer> {
    static SHARED: OnceCell<BpeTokenizer> = OnceCell::new();
    SHARED.get_or_try_init(|| {
        let merges = std::str::from_utf8(MERGES).map_err(|e| crate::error::Error::new(format!("bundled GPT-OSS merges are not UTF-8: {e}")))?;
        from_tables(merges, VOCAB)
    })
}

/// The tokenizer of a merges table (`left right` lines) and a vocabulary JSON object
/// (token → id, tokens in GPT-2 byte characters); the specials get the ids after the
/// vocabulary's, in [`SPECIALS`] order.
pub fn from_tables(merges: &str, vocab_json: &[u8]) -> Result<BpeTokenizer> {
    let vocab: HashMap<String, u32> = serde_json::from_slice(vocab_json).context("GPT-OSS vocabulary is not a JSON object of token ids")?;
    let size = vocab.values().max().map_or(0, |&m| m as usize + 1);
    ensure!(size == vocab.len() && size < 1 << 24, "GPT-OSS vocabulary: {} tokens with ids up to {}", vocab.len(), size as i64 - 1);
    let chars = ByteChars::new();
    let mut tokens: Vec<Box<[u8]>> = vec![Box::default(); size + SPECIALS.len()];
    for (text, &id) in &vocab {
        tokens[id as usize] = chars.bytes(text).unwrap_or_else(|| Box::from(text.as_bytes()));
    }
    let mut special_ids = HashMap::new();
    for (i, s) in SPECIALS.iter().enumerate() {
        tokens[size + i] = Box::from(s.as_bytes());
        special_ids.insert(s.to_string(), (size + i) as u32);
    }
    let pairs = parse_merges("GPT-OSS", merges)?;
    let ids = SpecialIds { unk: END_OF_TEXT, bos: None, pad: END_OF_TEXT };
    let specials = SPECIALS.iter().map(|s| s.to_string()).collect();
    BpeTokenizer::new("gpt_oss", tokens, &pairs, specials, &|s| special_ids.get(s).copied(), ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_layout() {
        let t = shared().unwrap();
        assert_eq!(t.vocab_size(), 200019);
        assert_eq!(t.encode("<|startoftext|><|endoftext|><|channel|><|start|><|end|><|message|><|endofprompt|>"), [199998, 199999, 200005, 200006, 200007, 200008, 200018]);
        assert_eq!(t.special_ids(), SpecialIds { unk: 199999, bos: None, pad: 199999 });
    }

    /// Ids the reference's `GPTOSSTokenizer::encode` gives (its log of a Lens prompt and
    /// negative prompt, token strings looked up in its vocabulary): Qwen2's split (digits
    /// one by one, lower-cased contractions), accents, CJK, Cyrillic, Arabic, emoji, CR LF,
    /// runs of spaces, a tab and a special token inside the text. (Emoji such as `😀` are
    /// left out: whether the reference's split counts them as spaces is undefined, see
    /// `bpe::c_isspace`.)
    #[test]
    fn reference_tokens() {
        let cases: &[(&str, &[u32])] = &[
            (
                "Hello world! IT'S we'RE I'd don't  東京タワーの夜景 Привет мир مرحبا 🌃city a,🌃b naïve résumé ÅÄÖ\n\nline two\r\nx 2024!! ? price: $12.50 ",
                &[
                    13225, 2375, 0, 8734, 885, 581, 4118, 357, 11062, 1700, 1507, 256, 108713, 12288, 34022, 3022, 3385, 10267, 34564, 14917, 131903, 37934, 60397, 26537, 220,
                    64364, 225, 17500, 261, 11, 64364, 225, 65, 153475, 737, 140184, 49805, 12921, 9146, 279, 1137, 1920, 370, 87, 220, 17, 15, 17, 19, 2618, 1423, 3911, 25,
                    548, 16, 17, 13, 20, 15, 220,
                ],
            ),
            ("approx.", &[76945, 13]),
            (
                "  leading spaces, trailing   \t tab ½ ñandú <|end|> CamelCaseWord HTTPServer 1234567890",
                &[256, 51812, 18608, 11, 57985, 271, 7758, 11957, 1322, 121, 47973, 427, 1042, 220, 200007, 112127, 6187, 12929, 21929, 6444, 220, 16, 17, 18, 19, 20, 21, 22, 23, 24, 15],
            ),
            ("a lovely cat", &[64, 16334, 9059]),
        ];
        for (text, ids) in cases {
            assert_eq!(&shared().unwrap().encode(text), ids, "{text:?}");
        }
    }
}
