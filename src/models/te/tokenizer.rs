//! The CLIP byte-level BPE tokenizer used by the SD1/SD2/SDXL text encoders.
//!
//! It reproduces the reference's tokens, which differ from OpenAI's/HF's for non-ASCII text:
//! text cleaning, lower-casing and the pre-tokenizer's character classes are ASCII-only
//! (the reference runs them on bytes in the "C" locale), so `é` or `日` are never letters
//! and end up in punctuation runs. Everything else (vocabulary, merges, `</w>`) is the
//! standard OpenAI CLIP vocabulary, taken from `bpe_simple_vocab_16e6.txt`.

use crate::error::{Context, Result};
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use std::collections::HashMap;

/// Token ids in the vocabulary: 256 bytes, 256 bytes + `</w>`, the merges, BOS, EOS.
pub const VOCAB_SIZE: u32 = 49408;
/// `<|startoftext|>`
pub const BOS_TOKEN: u32 = 49406;
/// `<|endoftext|>`; also SD1/SDXL's padding token.
pub const EOS_TOKEN: u32 = 49407;

const BOS_TEXT: &str = "<|startoftext|>";
const EOS_TEXT: &str = "<|endoftext|>";
const END_OF_WORD: &str = "</w>";
/// CLIP uses the first 49152 - 256 - 2 merges of the file (after its header line).
const MERGE_COUNT: usize = VOCAB_SIZE as usize - 512 - 2;
const FIRST_MERGE_ID: u32 = 512;
/// Pre-token cache bound; prompts rarely have more than a few hundred distinct words.
const CACHE_LIMIT: usize = 1 << 16;

// Only the header and the merges CLIP uses are kept in the binary (about 0.5 MB of the
// file's 3.2 MB): the whole file is read at compile time only.
const VOCAB_FILE: &[u8] = include_bytes!(env!("SD_CLIP_VOCAB"));
const USED_LEN: usize = used_prefix_len(VOCAB_FILE);
static USED_MERGES: [u8; USED_LEN] = prefix(VOCAB_FILE);

const fn used_prefix_len(file: &[u8]) -> usize {
    let mut lines = 0;
    let mut i = 0;
    while i < file.len() {
        if file[i] == b'\n' {
            lines += 1;
            if lines == MERGE_COUNT + 1 {
                return i + 1;
            }
        }
        i += 1;
    }
    file.len() // short file: parsing reports the missing merges
}

const fn prefix<const N: usize>(file: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let mut i = 0;
    while i < N {
        out[i] = file[i];
        i += 1;
    }
    out
}

/// Words that stand for custom token ids (textual-inversion embeddings).
///
/// The tokenizer finds the words as substrings of the cleaned, lower-cased text (like the
/// reference, which treats them as special tokens), and asks for their ids.
pub trait CustomWords {
    /// The words, lower-cased. When two start at the same place the earlier one wins.
    fn words(&self) -> Vec<&str>;
    /// Appends the ids `word` stands for; false when it is not a custom word.
    fn append_tokens(&self, word: &str, out: &mut Vec<u32>) -> bool;
}

/// No custom words.
impl CustomWords for () {
    fn words(&self) -> Vec<&str> {
        Vec::new()
    }
    fn append_tokens(&self, _: &str, _: &mut Vec<u32>) -> bool {
        false
    }
}

pub struct ClipTokenizer {
    /// Id → vocabulary entry (byte-level unicode text, `</w>` marking word ends).
    vocab: Vec<String>,
    /// (left id, right id) → merge rank; merge `r` produces id `FIRST_MERGE_ID + r`.
    ranks: HashMap<(u32, u32), u32>,
    /// Id of each byte as a token, without and with `</w>`.
    byte_ids: [u32; 256],
    /// The character each byte stands for in vocabulary text, and back.
    byte_chars: [char; 256],
    char_bytes: HashMap<char, u8>,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer").field("vocab", &self.vocab.len()).finish()
    }
}

/// One BPE round: every occurrence of `pair` in `word`, left to right, becomes `merged`.
pub(crate) fn merge_pair(word: &[u32], pair: (u32, u32), merged: u32) -> Vec<u32> {
    let mut next = Vec::with_capacity(word.len());
    let mut i = 0;
    while i < word.len() {
        if i + 1 < word.len() && (word[i], word[i + 1]) == pair {
            next.push(merged);
            i += 2;
        } else {
            next.push(word[i]);
            i += 1;
        }
    }
    next
}

/// GPT-2's reversible byte → printable character map, in vocabulary order: printable
/// Latin-1 bytes map to themselves, the others to U+0100 upwards.
pub(crate) fn byte_chars_in_vocab_order() -> Vec<(u8, char)> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut pairs: Vec<(u8, char)> =
        (0u32..256).filter(|&b| printable(b)).map(|b| (b as u8, char::from_u32(b).unwrap_or('\0'))).collect();
    for (k, b) in (0u32..256).filter(|&b| !printable(b)).enumerate() {
        pairs.push((b as u8, char::from_u32(256 + k as u32).unwrap_or('\0')));
    }
    pairs
}

impl ClipTokenizer {
    /// The tokenizer over the bundled OpenAI vocabulary, built once per process.
    pub fn shared() -> Result<&'static ClipTokenizer> {
        static SHARED: OnceCell<ClipTokenizer> = OnceCell::new();
        SHARED.get_or_try_init(|| {
            let text = std::str::from_utf8(&USED_MERGES)
                .map_err(|e| crate::error::Error::new(format!("bundled CLIP vocabulary is not UTF-8: {e}")))?;
            ClipTokenizer::from_merges(text)
        })
    }

    /// Builds the vocabulary from a CLIP merges file (header line, then `left right` lines).
    pub fn from_merges(text: &str) -> Result<ClipTokenizer> {
        let lines: Vec<&str> = text.split('\n').skip(1).take(MERGE_COUNT).collect();
        ensure!(
            lines.len() == MERGE_COUNT,
            "CLIP merges: expected {MERGE_COUNT} merges after the header, found {}",
            lines.len()
        );
        let byte_pairs = byte_chars_in_vocab_order();
        let mut vocab: Vec<String> = Vec::with_capacity(VOCAB_SIZE as usize);
        vocab.extend(byte_pairs.iter().map(|&(_, c)| c.to_string()));
        vocab.extend(byte_pairs.iter().map(|&(_, c)| format!("{c}{END_OF_WORD}")));
        let mut ids: HashMap<String, u32> = vocab.iter().enumerate().map(|(i, s)| (s.clone(), i as u32)).collect();
        let mut ranks = HashMap::with_capacity(MERGE_COUNT);
        for (rank, line) in lines.iter().enumerate() {
            let (left, right) = line
                .split_once(' ')
                .with_context(|| format!("CLIP merges: line {} has no space: {line:?}", rank + 2))?;
            let id_of = |part: &str| {
                ids.get(part)
                    .copied()
                    .with_context(|| format!("CLIP merges: line {}: unknown token {part:?}", rank + 2))
            };
            let pair = (id_of(left)?, id_of(right)?);
            let merged = format!("{left}{right}");
            let id = FIRST_MERGE_ID + rank as u32;
            ensure!(
                ids.insert(merged.clone(), id).is_none(),
                "CLIP merges: line {}: duplicate token {merged:?}",
                rank + 2
            );
            ensure!(ranks.insert(pair, rank as u32).is_none(), "CLIP merges: line {}: duplicate merge", rank + 2);
            vocab.push(merged);
        }
        vocab.push(BOS_TEXT.to_string());
        vocab.push(EOS_TEXT.to_string());
        debug_assert_eq!(vocab.len(), VOCAB_SIZE as usize);

        let mut byte_ids = [0u32; 256];
        let mut byte_chars = ['\0'; 256];
        let mut char_bytes = HashMap::with_capacity(256);
        for (id, &(b, c)) in byte_pairs.iter().enumerate() {
            byte_ids[b as usize] = id as u32;
            byte_chars[b as usize] = c;
            char_bytes.insert(c, b);
        }
        Ok(ClipTokenizer { vocab, ranks, byte_ids, byte_chars, char_bytes, cache: Mutex::new(HashMap::new()) })
    }

    /// Token ids of `text`, without BOS/EOS.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, &())
    }

    /// Token ids of `text`, without BOS/EOS; `words` found in the text become their custom ids.
    pub fn encode_with(&self, text: &str, words: &dyn CustomWords) -> Vec<u32> {
        let normalized = normalize(text);
        let mut specials = vec![BOS_TEXT, EOS_TEXT];
        specials.extend(words.words());
        let mut out = Vec::new();
        for (piece, is_special) in split_specials(&normalized, &specials) {
            if is_special {
                if !words.append_tokens(piece, &mut out) {
                    out.push(match piece {
                        BOS_TEXT => BOS_TOKEN,
                        EOS_TEXT => EOS_TOKEN,
                        // Unreachable with consistent `words`; the reference yields id 0 here.
                        _ => 0,
                    });
                }
                continue;
            }
            for word in pre_tokenize(piece) {
                if !words.append_tokens(word, &mut out) {
                    self.append_word(word, &mut out);
                }
            }
        }
        sd_debug!("split prompt \"{}\" to {} tokens [{}]", text, out.len(), self.describe(&out));
        out
    }

    /// BPE of one pre-token (with `</w>` at its end), through the cache.
    fn append_word(&self, word: &str, out: &mut Vec<u32>) {
        if let Some(ids) = self.cache.lock().get(word) {
            out.extend_from_slice(ids);
            return;
        }
        let ids = self.bpe(word.as_bytes());
        out.extend_from_slice(&ids);
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(word.to_string(), ids);
    }

    fn bpe(&self, bytes: &[u8]) -> Vec<u32> {
        let Some((&last, head)) = bytes.split_last() else { return Vec::new() };
        let mut word: Vec<u32> = head.iter().map(|&b| self.byte_ids[b as usize]).collect();
        word.push(self.byte_ids[last as usize] + 256);
        while word.len() > 1 {
            let best = word.windows(2).filter_map(|w| self.ranks.get(&(w[0], w[1])).map(|&r| (r, w[0], w[1]))).min();
            let Some((rank, left, right)) = best else { break };
            word = merge_pair(&word, (left, right), FIRST_MERGE_ID + rank);
        }
        word
    }

    /// Vocabulary entry of `id` (byte-level text), if `id` is in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.get(id as usize).map(String::as_str)
    }

    /// Readable text of token ids, for debugging: BOS/EOS skipped, word ends become spaces,
    /// ids beyond the vocabulary (custom embeddings) shown as `<|id|>`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if id == BOS_TOKEN || id == EOS_TOKEN {
                continue;
            }
            let Some(text) = self.token_text(id) else {
                bytes.extend_from_slice(format!("<|{id}|> ").as_bytes());
                continue;
            };
            let (body, word_end) = match text.strip_suffix(END_OF_WORD) {
                Some(body) => (body, true),
                None => (text, false),
            };
            bytes.extend(body.chars().map(|c| self.char_bytes.get(&c).copied().unwrap_or(b'?')));
            if word_end {
                bytes.push(b' ');
            }
        }
        String::from_utf8_lossy(&bytes).replace(" ,", ",").trim().to_string()
    }

    /// `"tok", "tok", ...` for debug logs.
    fn describe(&self, ids: &[u32]) -> String {
        let names: Vec<String> = ids
            .iter()
            .map(|&id| match self.token_text(id) {
                Some(t) => format!("\"{t}\""),
                None => format!("<|{id}|>"),
            })
            .collect();
        names.join(", ")
    }

    /// The vocabulary character standing for byte `b`.
    pub fn byte_char(&self, b: u8) -> char {
        self.byte_chars[b as usize]
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r')
}

/// Runs of ASCII whitespace become one space, ends are trimmed, ASCII letters lower-cased.
pub fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut pending_space = false;
    for c in text.chars() {
        if c.is_ascii() && is_space(c as u8) {
            pending_space = true;
            continue;
        }
        if pending_space && !out.is_empty() {
            out.push(' ');
        }
        pending_space = false;
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// Splits at the earliest occurrence of any special; at equal positions the first listed wins.
/// Yields `(piece, is_special)`; empty specials are ignored.
pub fn split_specials<'t, S: AsRef<str>>(text: &'t str, specials: &[S]) -> Vec<(&'t str, bool)> {
    let mut parts = Vec::new();
    let mut pos = 0;
    while pos < text.len() {
        let found = specials
            .iter()
            .map(AsRef::as_ref)
            .filter(|s| !s.is_empty())
            .filter_map(|s| text[pos..].find(s).map(|at| (pos + at, s.len())))
            .fold(None, |best: Option<(usize, usize)>, cand| match best {
                Some(b) if b.0 <= cand.0 => Some(b),
                _ => Some(cand),
            });
        let Some((at, len)) = found else {
            parts.push((&text[pos..], false));
            break;
        };
        if at > pos {
            parts.push((&text[pos..at], false));
        }
        parts.push((&text[at..at + len], true));
        pos = at + len;
    }
    parts
}

/// The reference's CLIP pre-tokenizer on cleaned text: contractions (`'s 't 're 've 'm 'll 'd`),
/// runs of ASCII letters, single ASCII digits, and runs of anything else but whitespace
/// (non-ASCII characters included). Whitespace separates and is dropped.
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    const CONTRACTIONS: [&str; 7] = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"];
    let bytes = text.as_bytes();
    let other = |b: u8| !is_space(b) && !b.is_ascii_alphanumeric();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let len = if let Some(c) = CONTRACTIONS.iter().find(|c| bytes[i..].starts_with(c.as_bytes())) {
            c.len()
        } else if b.is_ascii_alphabetic() {
            bytes[i..].iter().take_while(|b| b.is_ascii_alphabetic()).count()
        } else if b.is_ascii_digit() {
            1
        } else if other(b) {
            bytes[i..].iter().take_while(|&&b| other(b)).count()
        } else {
            i += 1;
            continue;
        };
        // Boundaries are at ASCII bytes or the text's ends, hence at char boundaries.
        out.push(&text[i..i + len]);
        i += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> &'static ClipTokenizer {
        ClipTokenizer::shared().expect("bundled vocabulary")
    }

    #[test]
    fn vocabulary_layout() {
        let t = tok();
        assert_eq!(t.vocab.len(), VOCAB_SIZE as usize);
        assert_eq!(t.token_text(0), Some("!"));
        assert_eq!(t.token_text(256), Some("!</w>"));
        assert_eq!(t.token_text(BOS_TOKEN), Some("<|startoftext|>"));
        assert_eq!(t.token_text(EOS_TOKEN), Some("<|endoftext|>"));
        assert_eq!(t.token_text(FIRST_MERGE_ID), Some("in"));
        assert_eq!(t.token_text(49405), Some("jekyll</w>"));
        assert_eq!(t.byte_char(b' '), '\u{120}');
        assert_eq!(USED_MERGES.iter().filter(|&&b| b == b'\n').count(), MERGE_COUNT + 1);
    }

    #[test]
    fn cleaning() {
        assert_eq!(normalize("  A\t\tPhoto\nOF \u{c9}  "), "a photo of \u{c9}");
        assert_eq!(normalize("\u{a0}x\u{3000}y"), "\u{a0}x\u{3000}y");
        assert_eq!(normalize(" \n "), "");
    }

    #[test]
    fn pre_tokenizer() {
        assert_eq!(pre_tokenize("i'm a cat's 'tis ''s"), ["i", "'m", "a", "cat", "'s", "'t", "is", "''", "s"]);
        assert_eq!(
            pre_tokenize("abc123 x,y!? caf\u{e9}s"),
            ["abc", "1", "2", "3", "x", ",", "y", "!?", "caf", "\u{e9}", "s"]
        );
        assert_eq!(pre_tokenize("a\u{3000}b \u{1f525}!"), ["a", "\u{3000}", "b", "\u{1f525}!"]);
    }

    #[test]
    fn specials_split() {
        let s = split_specials("a<|endoftext|>cat catdog", &["<|endoftext|>", "cat", "catdog"]);
        assert_eq!(
            s,
            [("a", false), ("<|endoftext|>", true), ("cat", true), (" ", false), ("cat", true), ("dog", false)]
        );
        let s = split_specials("catdog", &["catdog", "cat"]);
        assert_eq!(s, [("catdog", true)]);
    }

    #[test]
    fn encode_and_decode() {
        let t = tok();
        let ids = t.encode("a photo of a cat");
        assert_eq!(ids, [320, 1125, 539, 320, 2368]);
        assert_eq!(t.decode(&ids), "a photo of a cat");
        assert_eq!(t.encode("<|startoftext|>x<|endoftext|>"), [BOS_TOKEN, 343, EOS_TOKEN]);
        assert!(t.encode(" \t ").is_empty());
        assert_eq!(t.decode(&t.encode("Caf\u{e9}, \u{1f525}!")), "caf \u{e9}, \u{1f525}!");
    }
}
