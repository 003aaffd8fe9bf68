//! Byte-level BPE as the reference's `BPETokenizer` runs it for the LLM text encoders
//! (Qwen2 in `qwen_tokenizer`, Mistral in `mistral_tokenizer`): the families differ only in
//! their tables, special tokens and BOS / padding ids.
//!
//! - the text is split at special tokens (the earliest match; at one position the first
//!   listed), each special becoming its id;
//! - the rest goes through the reference's own pre-tokenizer ([`pre_tokenize`], a hand-written
//!   version of Qwen2's split regex with its quirks: Mistral's tokenizer uses it too, not
//!   Mistral's own regex), then each piece's bytes are merged by rank;
//! - merges work on strings, so a merge may form a string that is no vocabulary token (the
//!   reference then looks it up and emits the unknown id): those strings get symbols of their
//!   own past the vocabulary while merging.

use super::tokenizer::{byte_chars_in_vocab_order, merge_pair, split_specials};
use crate::error::{Context as _, Result};
use once_cell::sync::Lazy;
use std::collections::HashMap;

/// Token ids the tokenizer uses for itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialIds {
    /// Emitted for a merged string that is no vocabulary token.
    pub unk: u32,
    /// Put in front of every sequence when padding (Mistral), or none (Qwen2).
    pub bos: Option<u32>,
    /// Fills sequences up to a minimum length.
    pub pad: u32,
}

pub struct BpeTokenizer {
    name: &'static str,
    /// Id → token bytes.
    tokens: Vec<Box<[u8]>>,
    /// (left symbol, right symbol) → (rank, merged symbol). Symbols below `tokens.len()` are
    /// token ids; the others are strings only a merge forms.
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_ids: [u32; 256],
    /// Special tokens in the reference's order, with their ids.
    specials: Vec<String>,
    special_ids: HashMap<String, u32>,
    ids: SpecialIds,
}

impl std::fmt::Debug for BpeTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}Tokenizer({} tokens, {} merges)", self.name, self.tokens.len(), self.merges.len())
    }
}

/// The GPT-2 byte characters of a merges / vocabulary table → bytes.
pub(crate) struct ByteChars(HashMap<char, u8>);

impl ByteChars {
    pub(crate) fn new() -> ByteChars {
        ByteChars(byte_chars_in_vocab_order().iter().map(|&(b, c)| (c, b)).collect())
    }

    /// The bytes `s` spells, or `None` if it holds a character that is no byte character.
    pub(crate) fn bytes(&self, s: &str) -> Option<Box<[u8]>> {
        s.chars().map(|c| self.0.get(&c).copied()).collect()
    }
}

/// The pairs of a merges table (`left right` per line, each line ending in '\n'; like the
/// reference, text after the last newline is ignored).
pub(crate) fn parse_merges(name: &str, text: &str) -> Result<Vec<(Box<[u8]>, Box<[u8]>)>> {
    let chars = ByteChars::new();
    let lines: Vec<&str> = text.split('\n').collect();
    let lines = &lines[..lines.len() - 1];
    let mut pairs = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        let (a, b) = line.split_once(' ').with_context(|| format!("{name} merges: line {} has no space", i + 1))?;
        let bytes = |s: &str| chars.bytes(s).with_context(|| format!("{name} merges: line {} holds a character that is no byte character", i + 1));
        pairs.push((bytes(a)?, bytes(b)?));
    }
    Ok(pairs)
}

impl BpeTokenizer {
    /// A tokenizer over the vocabulary `tokens` (id order; a later token with the same bytes
    /// wins, like the reference's map), the ranked `merges`, and the specials with the ids
    /// `special_ids` gives them (a special that has none gets 0, as the reference's map does).
    pub(crate) fn new(
        name: &'static str,
        tokens: Vec<Box<[u8]>>,
        merges: &[(Box<[u8]>, Box<[u8]>)],
        specials: Vec<String>,
        special_ids: &dyn Fn(&str) -> Option<u32>,
        ids: SpecialIds,
    ) -> Result<BpeTokenizer> {
        let mut symbols: HashMap<Box<[u8]>, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut next = tokens.len() as u32;
        let mut intern = |s: &[u8]| -> u32 {
            *symbols.entry(Box::from(s)).or_insert_with(|| {
                next += 1;
                next - 1
            })
        };
        let mut byte_ids = [0u32; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = intern(&[b as u8]);
        }
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let joined = intern(&[&a[..], &b[..]].concat());
            // A pair listed twice keeps its last rank (the reference's map is overwritten).
            table.insert((intern(a), intern(b)), (rank as u32, joined));
        }
        let special_ids = specials.iter().map(|s| (s.clone(), special_ids(s).unwrap_or(0))).collect();
        ensure!((ids.pad as usize) < tokens.len() && (ids.unk as usize) < tokens.len(), "{name} tokenizer: {} tokens, padding id {}", tokens.len(), ids.pad);
        Ok(BpeTokenizer { name, tokens, merges: table, byte_ids, specials, special_ids, ids })
    }

    /// Number of token ids.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn special_ids(&self) -> SpecialIds {
        self.ids
    }

    /// Token ids of `text`: special tokens by their ids, everything else pre-tokenized and
    /// merged. No BOS, EOS or padding.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for (piece, special) in split_specials(text, &self.specials) {
            if special {
                out.push(self.special_ids.get(piece).copied().unwrap_or(0));
                continue;
            }
            let (words, dropped) = pre_tokenize(piece);
            if !dropped.is_empty() {
                sd_debug!("{} tokenizer: dropped {dropped:?} from \"{piece}\"", self.name);
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
            word = merge_pair(&word, (l, r), self.merges[&(l, r)].1);
        }
        let n = self.tokens.len() as u32;
        out.extend(word.into_iter().map(|s| if s < n { s } else { self.ids.unk }));
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

/// C's `isspace` as the reference calls it on code points: the ASCII spaces, and characters
/// beyond the BMP. Past 255 the reference reads C's table out of range (undefined: what it
/// finds depends on the C library and locale; under glibc's C.UTF-8, the locale the golden
/// cases ran in, `🌃` counts as a space but `😀` does not). This implementation treats every
/// such character as a space and BMP symbols as none, which is what it finds for the emoji
/// the golden cases use and for the usual punctuation (dashes, quotes, CJK punctuation).
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

    fn split(text: &str) -> Vec<String> {
        pre_tokenize(text).0
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

    /// Strings a merge forms that are no token become the unknown id; pairs of such strings
    /// still merge (the reference merges strings, not ids).
    #[test]
    fn merges_beyond_the_vocabulary() {
        let tokens: Vec<Box<[u8]>> = [&b"<unk>"[..], b"a", b"b", b"c", b"abc"].iter().map(|&t| Box::from(t)).collect();
        let merges: Vec<(Box<[u8]>, Box<[u8]>)> = vec![(Box::from(&b"a"[..]), Box::from(&b"b"[..])), (Box::from(&b"ab"[..]), Box::from(&b"c"[..]))];
        let ids = SpecialIds { unk: 0, bos: None, pad: 0 };
        let t = BpeTokenizer::new("test", tokens, &merges, vec!["<unk>".into()], &|s| (s == "<unk>").then_some(0), ids).unwrap();
        assert_eq!(t.encode("abc"), [4]);
        // "ab" is formed but is no token; bytes outside the vocabulary are unknown too.
        assert_eq!(t.encode("ab"), [0]);
        assert_eq!(t.encode("cab"), [3, 0]);
        assert_eq!(t.encode("d<unk>"), [0, 0]);
    }
}
