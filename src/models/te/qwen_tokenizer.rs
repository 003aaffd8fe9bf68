//! The Qwen2 byte-level BPE tokenizer of the LLM text encoders (Qwen3 for Z-Image and
//! Flux.2 klein, Qwen2.5-VL for Qwen-Image), as the reference runs it, which is not what
//! Hugging Face `tokenizers` does for every text:
//!
//! - the vocabulary is rebuilt from the 256 byte characters (GPT-2 order), one token per
//!   merge (its two halves joined) and the special tokens, in that order; the merges table is
//!   the reference's (`qwen_merges.hpp`, embedded at build time);
//! - the text is split at special tokens, then by the reference's own pre-tokenizer (a hand
//!   written version of Qwen2's split regex with its quirks, see [`pre_tokenize`]): runs of
//!   whitespace are one piece (so `"a  b"` keeps both spaces apart from `b`), a lone space
//!   before CJK text ends up as its own `Ġ` once BPE has run, contractions are lower-cased;
//! - characters outside the Basic Multilingual Plane (emoji) that do not follow a letter
//!   run's lead character are dropped: the reference classifies them with C's `isspace` past
//!   its table (undefined; under the C.UTF-8 locale the README's `🌃` counts as a space);
//!   this implementation treats every such character so, and logs what it drops.
//!
//! No BOS / EOS are added; `<|endoftext|>` (151643) is the padding token.

use super::tokenizer::{byte_chars_in_vocab_order, split_specials};
use crate::error::Result;
use once_cell::sync::{Lazy, OnceCell};
use std::collections::HashMap;

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

pub struct Qwen2Tokenizer {
    /// Token bytes → id (a later token with the same bytes wins, like the reference's map).
    ids: HashMap<Box<[u8]>, u32>,
    /// Id → token bytes.
    tokens: Vec<Box<[u8]>>,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_ids: [u32; 256],
}

impl std::fmt::Debug for Qwen2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Qwen2Tokenizer({} tokens, {} merges)", self.tokens.len(), self.merges.len())
    }
}

impl Qwen2Tokenizer {
    /// The tokenizer over the bundled merges, built once per process.
    pub fn shared() -> Result<&'static Qwen2Tokenizer> {
        static SHARED: OnceCell<Qwen2Tokenizer> = OnceCell::new();
        SHARED.get_or_try_init(|| {
            let text = std::str::from_utf8(MERGES)
                .map_err(|e| crate::error::Error::new(format!("bundled Qwen2 merges are not UTF-8: {e}")))?;
            Qwen2Tokenizer::from_merges(text)
        })
    }

    /// Builds the vocabulary from merges (`left right` per line, each line ending in '\n';
    /// like the reference, text after the last newline is ignored).
    pub fn from_merges(text: &str) -> Result<Qwen2Tokenizer> {
        let byte_chars = byte_chars_in_vocab_order();
        let char_byte: HashMap<char, u8> = byte_chars.iter().map(|&(b, c)| (c, b)).collect();
        let to_bytes = |s: &str| -> Result<Box<[u8]>> {
            s.chars()
                .map(|c| char_byte.get(&c).copied().with_context(|| format!("Qwen2 merges: character {c:?} is not a byte character")))
                .collect()
        };
        let lines: Vec<&str> = text.split('\n').collect();
        let lines = &lines[..lines.len() - 1];
        let mut pairs = Vec::with_capacity(lines.len());
        for (i, line) in lines.iter().enumerate() {
            let (a, b) = line.split_once(' ').with_context(|| format!("Qwen2 merges: line {} has no space", i + 1))?;
            pairs.push((to_bytes(a)?, to_bytes(b)?));
        }
        let mut tokens: Vec<Box<[u8]>> = Vec::with_capacity(256 + pairs.len() + SPECIAL_TOKENS.len());
        tokens.extend(byte_chars.iter().map(|&(b, _)| Box::from([b].as_slice())));
        tokens.extend(pairs.iter().map(|(a, b)| [&a[..], &b[..]].concat().into_boxed_slice()));
        tokens.extend(SPECIAL_TOKENS.iter().map(|s| Box::from(s.as_bytes())));
        let ids: HashMap<Box<[u8]>, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut byte_ids = [0u32; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = ids[&[b as u8][..]];
        }
        let mut merges = HashMap::with_capacity(pairs.len());
        for (rank, (a, b)) in pairs.iter().enumerate() {
            let (Some(&l), Some(&r)) = (ids.get(a), ids.get(b)) else {
                // A half that is no token can never be formed, so neither can the pair.
                continue;
            };
            let joined = ids[&[&a[..], &b[..]].concat()[..]];
            merges.insert((l, r), (rank as u32, joined));
        }
        ensure!(
            ids.get(SPECIAL_TOKENS[0].as_bytes()) == Some(&PAD_TOKEN),
            "Qwen2 merges: {} merges give <|endoftext|> id {}, expected {PAD_TOKEN}",
            pairs.len(),
            256 + pairs.len()
        );
        Ok(Qwen2Tokenizer { ids, tokens, merges, byte_ids })
    }

    /// Number of token ids (151674).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Token ids of `text`: special tokens by their ids, everything else pre-tokenized and
    /// merged. No BOS, EOS or padding.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for (piece, special) in split_specials(text, &SPECIAL_TOKENS) {
            if special {
                out.push(self.ids[piece.as_bytes()]);
                continue;
            }
            let (words, dropped) = pre_tokenize(piece);
            if !dropped.is_empty() {
                sd_debug!("qwen2 tokenizer: dropped {dropped:?} from \"{piece}\"");
            }
            for w in words {
                self.bpe(w.as_bytes(), &mut out);
            }
        }
        sd_debug!("split prompt \"{}\" to {} tokens {}", text, out.len(), self.describe(&out));
        out
    }

    /// Merges the bytes of one pre-token, lowest rank first, every occurrence of the chosen
    /// pair left to right per round, and appends the resulting ids.
    fn bpe(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let mut word: Vec<u32> = bytes.iter().map(|&b| self.byte_ids[b as usize]).collect();
        while word.len() > 1 {
            let best = word.windows(2).filter_map(|p| self.merges.get(&(p[0], p[1])).map(|&(rank, _)| (rank, p[0], p[1]))).min();
            let Some((_, l, r)) = best else { break };
            let joined = self.merges[&(l, r)].1;
            let mut next = Vec::with_capacity(word.len());
            let mut i = 0;
            while i < word.len() {
                if i + 1 < word.len() && word[i] == l && word[i + 1] == r {
                    next.push(joined);
                    i += 2;
                } else {
                    next.push(word[i]);
                    i += 1;
                }
            }
            word = next;
        }
        out.extend(word);
    }

    /// The bytes of token `id`.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.tokens.get(id as usize).map(|t| &t[..])
    }

    /// Text of `ids` (special tokens included as written).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&id| self.token_bytes(id)).flatten().copied().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn describe(&self, ids: &[u32]) -> String {
        let parts: Vec<String> = ids.iter().map(|&id| format!("\"{}\"", self.decode(&[id]))).collect();
        format!("[{}]", parts.join(", "))
    }
}

use crate::error::Context as _;

/// `\p{L}` (Unicode letters).
fn is_letter(c: char) -> bool {
    static LETTER: Lazy<regex::Regex> = Lazy::new(|| regex::Regex::new(r"^\p{L}$").expect("letter class"));
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    let mut buf = [0u8; 4];
    LETTER.is_match(c.encode_utf8(&mut buf))
}

/// The reference's `\p{N}`: ASCII digits only.
fn is_number(c: char) -> bool {
    c.is_ascii_digit()
}

/// The Unicode spaces the reference's whitespace rule knows.
fn is_space(c: char) -> bool {
    matches!(
        c as u32,
        0x09..=0x0d | 0x20 | 0xa0 | 0x1680 | 0x2000..=0x200a | 0x202f | 0x205f | 0x3000
    )
}

/// C's `isspace` as the reference calls it on code points: the ASCII spaces, and (its table
/// read out of range) characters beyond the BMP, see the module documentation.
fn c_isspace(c: char) -> bool {
    matches!(c as u32, 0x09..=0x0d | 0x20) || c as u32 >= 0x10000
}

/// The reference's hand-written Qwen2 split, on one piece of text without special tokens;
/// returns the pre-tokens and the characters it skipped. Rules, tried in order at each
/// character:
/// 1. `'` + `s`/`t`/`m`, or + `re`/`ve`/`ll` (ASCII case-insensitive): the contraction,
///    lower-cased;
/// 2. an ASCII digit, alone;
/// 3. one character that is no letter and no CR/LF, then a run of letters; or a run of letters;
/// 4. a space then a run of characters that are neither letters, digits nor C spaces, plus
///    trailing CR/LF; or such a run without the space;
/// 5. a run of Unicode spaces (up to the first non-newline after a newline, which is
///    included in the run and then also starts the next piece: a reference quirk);
/// 6. anything else is skipped.
pub fn pre_tokenize(text: &str) -> (Vec<String>, String) {
    let cps: Vec<char> = text.chars().collect();
    let n = cps.len();
    let mut out = Vec::new();
    let mut dropped = String::new();
    let punct = |c: char| !is_letter(c) && !is_number(c) && !c_isspace(c);
    let mut i = 0;
    while i < n {
        let c = cps[i];
        if c == '\'' && i + 1 < n {
            let lower = |c: char| c.to_ascii_lowercase();
            let one = lower(cps[i + 1]);
            if matches!(one, 's' | 't' | 'm') {
                out.push(format!("'{one}"));
                i += 2;
                continue;
            }
            if i + 2 < n {
                let two: String = [one, lower(cps[i + 2])].iter().collect();
                if matches!(two.as_str(), "re" | "ve" | "ll") {
                    out.push(format!("'{two}"));
                    i += 3;
                    continue;
                }
            }
        }
        if is_number(c) {
            out.push(c.to_string());
            i += 1;
            continue;
        }
        let lead = !is_letter(c) && c != '\r' && c != '\n' && i + 1 < n && is_letter(cps[i + 1]);
        if lead || is_letter(c) {
            let start = i;
            i += 1;
            while i < n && is_letter(cps[i]) {
                i += 1;
            }
            out.push(cps[start..i].iter().collect());
            continue;
        }
        if (c == ' ' && i + 1 < n && punct(cps[i + 1])) || punct(c) {
            let start = i;
            i += if c == ' ' { 2 } else { 1 };
            while i < n && punct(cps[i]) {
                i += 1;
            }
            while i < n && (cps[i] == '\r' || cps[i] == '\n') {
                i += 1;
            }
            out.push(cps[start..i].iter().collect());
            continue;
        }
        if is_space(c) {
            let mut token = String::new();
            let mut saw_newline = false;
            while i < n && is_space(cps[i]) {
                token.push(cps[i]);
                if cps[i] == '\r' || cps[i] == '\n' {
                    saw_newline = true;
                } else if saw_newline {
                    break;
                }
                i += 1;
            }
            out.push(token);
            continue;
        }
        dropped.push(c);
        i += 1;
    }
    (out, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> &'static Qwen2Tokenizer {
        Qwen2Tokenizer::shared().unwrap()
    }

    fn split(text: &str) -> Vec<String> {
        pre_tokenize(text).0
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
    fn pre_tokenizer_quirks() {
        assert_eq!(split("a lovely cat"), ["a", " lovely", " cat"]);
        // Runs of spaces stay together (no `\s+(?!\S)` look-ahead).
        assert_eq!(split("a  b"), ["a", "  ", "b"]);
        // Digits one by one; punctuation runs take a leading space.
        assert_eq!(split("x 2024!! ?"), ["x", " ", "2", "0", "2", "4", "!!", " ?"]);
        // Contractions are lower-cased; "'d" is no contraction there.
        assert_eq!(split("IT'S we'RE I'd"), ["IT", "'s", " we", "'re", " I", "'d"]);
        // After a newline, the next space both ends the run and starts the next piece.
        assert_eq!(split("\n a"), ["\n ", " a"]);
        // A punctuation character leads a letter run.
        assert_eq!(split("(red"), ["(red"]);
        // CJK characters are letters.
        assert_eq!(split(" 东京"), [" 东京"]);
        // Characters beyond the BMP are skipped unless they lead a letter run.
        assert_eq!(pre_tokenize(" 🌃"), (vec![" ".to_string()], "🌃".to_string()));
        assert_eq!(split("🌃city"), ["🌃city"]);
        assert_eq!(split("a,🌃b"), ["a", ",", "🌃b"]);
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
