//! The Mistral tokenizer of Mistral Small 3.2 (Flux.2 dev's text encoder) as the reference
//! runs it: byte-level BPE over the reference's tables (`mistral_vocab.hpp`, a token → id
//! JSON of 131072 tokens, and `mistral_merges.hpp`, embedded at build time), split and merged
//! like Qwen2's (see [`super::bpe`]: the reference uses its Qwen2-style pre-tokenizer here
//! too, not Mistral's own split rule, so digits come one by one and contractions are
//! lower-cased). The special tokens are the first 1000 ids: `<unk>`, `<s>`, `</s>`, `[INST]`,
//! …, `[SYSTEM_PROMPT]`, …, `<SPECIAL_20>` … `<SPECIAL_999>`. Sequences start with BOS `<s>`
//! (1) when padded; `<pad>` (11) pads.

use super::bpe::{parse_merges, BpeTokenizer, ByteChars, SpecialIds};
use crate::error::{Context as _, Result};
use once_cell::sync::OnceCell;
use std::collections::HashMap;

const MERGES: &[u8] = include_bytes!(env!("SD_MISTRAL_MERGES"));
const VOCAB: &[u8] = include_bytes!(env!("SD_MISTRAL_VOCAB"));

pub const UNK_TOKEN: u32 = 0;
pub const BOS_TOKEN: u32 = 1;
pub const PAD_TOKEN: u32 = 11;
pub const INST: u32 = 3;
pub const INST_END: u32 = 4;
pub const SYSTEM_PROMPT: u32 = 17;
pub const SYSTEM_PROMPT_END: u32 = 18;

/// The named special tokens, ids 0-19; `<SPECIAL_20>` … `<SPECIAL_999>` follow.
const NAMED_SPECIALS: [&str; 20] = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// The special tokens in the reference's order.
pub fn special_tokens() -> Vec<String> {
    NAMED_SPECIALS.iter().map(|s| s.to_string()).chain((20..1000).map(|i| format!("<SPECIAL_{i}>"))).collect()
}

/// The tokenizer over the bundled tables, built once per process.
pub fn shared() -> Result<&'static BpeTokenizer> {
    static SHARED: OnceCell<BpeTokenizer> = OnceCell::new();
    SHARED.get_or_try_init(|| {
        let merges = std::str::from_utf8(MERGES).map_err(|e| crate::error::Error::new(format!("bundled Mistral merges are not UTF-8: {e}")))?;
        from_tables(merges, VOCAB)
    })
}

/// The tokenizer of a merges table (`left right` lines) and a vocabulary JSON object
/// (token → id; tokens in GPT-2 byte characters, the special tokens as written).
pub fn from_tables(merges: &str, vocab_json: &[u8]) -> Result<BpeTokenizer> {
    let vocab: HashMap<String, u32> = serde_json::from_slice(vocab_json).context("Mistral vocabulary is not a JSON object of token ids")?;
    let size = vocab.values().max().map_or(0, |&m| m as usize + 1);
    ensure!(size <= 1 << 24, "Mistral vocabulary: token id {} is too large", size - 1);
    let chars = ByteChars::new();
    let mut tokens: Vec<Box<[u8]>> = vec![Box::default(); size];
    for (text, &id) in &vocab {
        // Special tokens are plain ASCII, which spells itself in byte characters.
        tokens[id as usize] = chars.bytes(text).unwrap_or_else(|| Box::from(text.as_bytes()));
    }
    let pairs = parse_merges("Mistral", merges)?;
    let ids = SpecialIds { unk: UNK_TOKEN, bos: Some(BOS_TOKEN), pad: PAD_TOKEN };
    BpeTokenizer::new("mistral", tokens, &pairs, special_tokens(), &|s| vocab.get(s).copied(), ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_layout() {
        let t = shared().unwrap();
        assert_eq!(t.vocab_size(), 131072);
        assert_eq!(t.encode("<s></s><unk><pad>[IMG]<SPECIAL_20><SPECIAL_999>"), [BOS_TOKEN, 2, UNK_TOKEN, PAD_TOKEN, 10, 20, 999]);
        assert_eq!(t.encode("[INST][/INST][SYSTEM_PROMPT][/SYSTEM_PROMPT]"), [INST, INST_END, SYSTEM_PROMPT, SYSTEM_PROMPT_END]);
        // The byte tokens follow the specials, in GPT-2 byte order ('!' first).
        assert_eq!(t.encode("!"), [1000 + 33]);
        assert_eq!(t.decode(&[1000 + 33]), "!");
        // Specials inside text.
        assert_eq!(t.encode("a<s>b"), [1097, BOS_TOKEN, 1098]);
        assert_eq!(t.special_ids(), SpecialIds { unk: 0, bos: Some(1), pad: 11 });
    }

    /// Ids the reference's `MistralTokenizer::encode` gives (its sources from diffusion-rs-sys
    /// 0.1.20, identical to 97d29908's, built against these tables and run under C.UTF-8).
    #[test]
    fn reference_tokens() {
        let cases: &[(&str, &[u32])] = &[
            ("a lovely cat", &[1097, 45988, 7990]),
            ("Hello world", &[22177, 4304]),
            // Runs of spaces stay together; a lone space before CJK text is its own token.
            ("a  b", &[1097, 1256, 1098]),
            (" 东京", &[1032, 34196, 12513]),
            ("東京タワーの夜景", &[18629, 6912, 20108, 2474, 2439, 21721, 79088]),
            // Digits one by one, punctuation runs with their leading space.
            ("x 2024!! ?", &[1120, 1032, 1050, 1048, 1050, 1052, 7290, 3082]),
            ("price: $12.50 (approx.)", &[12698, 1058, 1659, 1049, 1050, 1046, 1053, 1048, 1319, 32727, 5203]),
            (" ,  . ;", &[3897, 1256, 1046, 4295]),
            // Contractions lower-cased, "'d" is none.
            ("IT'S we'RE I'd", &[4778, 1681, 1729, 6185, 1362, 6813]),
            ("don't stop", &[21797, 2405, 5304]),
            // Newlines, tabs, CR.
            ("\n a", &[1010, 1032, 1261]),
            ("line one\nline two\n\n  indented\ttab", &[2839, 1925, 1010, 2839, 2295, 1267, 1032, 1256, 1629, 38498, 1009, 8710]),
            ("a\r\nb", &[1097, 1013, 1010, 1098]),
            ("(red", &[1040, 2338]),
            ("a ", &[1097, 1032]),
            (" red apple", &[4804, 46227]),
            ("CamelCaseWord HTTPServer iPhone", &[38487, 1299, 11139, 24469, 23733, 11473, 1623, 16742]),
            ("café naïve résumé", &[3173, 1102, 1337, 98355, 7677, 35088]),
            ("ÅÄÖ åäö ÆØ", &[62927, 86169, 30773, 7611, 1654, 1792, 1492, 1134, 1195, 1152]),
            ("Привет мир", &[45497, 13745, 50430]),
            ("مرحبا", &[4341, 1708, 26986]),
            // An emoji that leads a letter run stays (as bytes); after a space it is dropped.
            ("🌃city", &[1240, 1159, 1140, 1131, 29363]),
            ("a,🌃b", &[1097, 1044, 1240, 1159, 1140, 1131, 1098]),
            (" 🌃", &[1032]),
            ("The quick brown fox, 3 times!", &[1784, 7586, 22980, 94137, 1044, 1032, 1051, 5213, 1033]),
        ];
        for (text, ids) in cases {
            assert_eq!(&shared().unwrap().encode(text), ids, "{text:?}");
        }
    }

    /// Flux.2 dev's template around a prompt, as the reference tokenizes it.
    #[test]
    fn flux2_dev_template() {
        let prefix = "[SYSTEM_PROMPT]You are an AI that reasons about image descriptions. You give structured responses focusing on object relationships, object\nattribution and actions without speculation.[/SYSTEM_PROMPT][INST]";
        let ids = shared().unwrap().encode(prefix);
        assert_eq!(
            ids,
            [
                17, 4568, 1584, 1420, 26554, 1455, 12738, 2314, 3937, 38340, 1046, 3213, 5628, 37253, 11688, 30557, 1408, 3481, 14608, 1044, 3481,
                1010, 2452, 5604, 1321, 10636, 3816, 67813, 1046, 18, 3
            ]
        );
        assert_eq!(shared().unwrap().encode("[/INST]"), [4]);
    }
}
