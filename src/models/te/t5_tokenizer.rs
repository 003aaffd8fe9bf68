//! The SentencePiece unigram tokenizer of the T5 (SD3, Flux, Chroma) and UMT5 (Wan) text
//! encoders, as the reference runs it.
//!
//! Its tokens differ from Hugging Face's for some text, on purpose:
//! - no NFKC normalisation: only runs of ASCII spaces collapse to one (tabs, newlines and
//!   full-width characters stay as they are, and most of them become `<unk>`);
//! - the text is first split at the special tokens (`<pad>`, `</s>`, `<unk>`, and UMT5's `<s>`,
//!   which is dropped), and every other piece gets its own `▁` prefix, so `"a</s>b"` is
//!   `▁a </s> ▁b`; a piece's one trailing space is dropped, a leading one is an extra `▁`;
//! - the empty text is `▁` (id 3 for T5), not nothing;
//! - a character with no piece of its own is one `<unk>` per character (never fused).
//!
//! The pieces and scores are the reference's table (`src/tokenizers/vocab/t5.hpp`, a
//! Hugging Face `tokenizer.json`), embedded at build time.

use crate::error::{Context as _, Result};
use once_cell::sync::OnceCell;
use std::collections::HashMap;

/// `<pad>`: T5's padding token.
pub const PAD_TOKEN: u32 = 0;
/// `</s>`: ends every sequence.
pub const EOS_TOKEN: u32 = 1;
/// `<unk>` of the T5 table (UMT5's is 3).
pub const T5_UNK_TOKEN: u32 = 2;

/// The lattice's penalty below the lowest piece score for an unknown character.
const UNK_PENALTY: f32 = 10.0;
/// What an empty piece of the table is called (the reference's trie cannot hold empty keys).
const EMPTY_PIECE: &str = "<empty_token>";

const T5_TABLE: &[u8] = include_bytes!(env!("SD_T5_VOCAB"));
const UMT5_TABLE: &[u8] = include_bytes!(env!("SD_UMT5_VOCAB"));

/// Which table and special tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum T5Vocab {
    /// T5 v1.1 (32100 pieces; `<unk>` = 2).
    T5,
    /// UMT5 (256300 pieces; `<s>` = 2, `<unk>` = 3).
    Umt5,
}

pub struct T5Tokenizer {
    /// Id → piece and score.
    pieces: Vec<String>,
    scores: Vec<f32>,
    /// Piece bytes → id; of equal pieces the lowest id, as the reference's trie keeps.
    index: HashMap<Box<[u8]>, u32>,
    longest_piece: usize,
    min_score: f32,
    unk_id: u32,
    /// The Metaspace pre-tokenizer's word mark (`▁`) and whether text starts with one.
    replacement: String,
    add_prefix_space: bool,
    /// Special token text → id it stands for (`None`: dropped from the ids).
    specials: Vec<(&'static str, Option<u32>)>,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("T5Tokenizer").field("pieces", &self.pieces.len()).field("unk_id", &self.unk_id).finish()
    }
}

impl T5Tokenizer {
    /// The tokenizer over the bundled table, built once per process.
    pub fn shared(vocab: T5Vocab) -> Result<&'static T5Tokenizer> {
        static T5: OnceCell<T5Tokenizer> = OnceCell::new();
        static UMT5: OnceCell<T5Tokenizer> = OnceCell::new();
        let (cell, table) = match vocab {
            T5Vocab::T5 => (&T5, T5_TABLE),
            T5Vocab::Umt5 => (&UMT5, UMT5_TABLE),
        };
        cell.get_or_try_init(|| {
            let json = std::str::from_utf8(table).context("bundled T5 tokenizer table is not UTF-8")?;
            T5Tokenizer::from_json(json, vocab)
        })
    }

    /// Builds the tokenizer from a Hugging Face `tokenizer.json` with a Unigram model and a
    /// Metaspace pre-tokenizer.
    pub fn from_json(json: &str, vocab: T5Vocab) -> Result<T5Tokenizer> {
        let data: serde_json::Value = serde_json::from_str(json).context("T5 tokenizer table: invalid JSON")?;
        let model = &data["model"];
        let entries = model["vocab"].as_array().context("T5 tokenizer table: no model.vocab array")?;
        let mut unk_id = match vocab {
            T5Vocab::T5 => T5_UNK_TOKEN,
            T5Vocab::Umt5 => 3,
        };
        if let Some(id) = model.get("unk_id") {
            unk_id = id.as_u64().and_then(|v| u32::try_from(v).ok()).context("T5 tokenizer table: bad unk_id")?;
        }
        let pre = &data["pre_tokenizer"];
        let replacement = pre["replacement"].as_str().context("T5 tokenizer table: no pre_tokenizer.replacement")?;
        let add_prefix_space =
            pre["add_prefix_space"].as_bool().context("T5 tokenizer table: no pre_tokenizer.add_prefix_space")?;

        let mut pieces = Vec::with_capacity(entries.len());
        let mut scores = Vec::with_capacity(entries.len());
        let mut index = HashMap::with_capacity(entries.len());
        for (id, item) in entries.iter().enumerate() {
            let pair = item.as_array().filter(|p| p.len() == 2);
            let (piece, score) = pair
                .and_then(|p| Some((p[0].as_str()?, p[1].as_f64().filter(|_| p[1].is_f64())?)))
                .with_context(|| format!("T5 tokenizer table: entry {id} is not [piece, score]"))?;
            let piece = if piece.is_empty() { EMPTY_PIECE } else { piece };
            index.entry(piece.as_bytes().into()).or_insert(id as u32);
            pieces.push(piece.to_string());
            scores.push(score as f32);
        }
        ensure!(!pieces.is_empty(), "T5 tokenizer table has no pieces");
        ensure!((unk_id as usize) < pieces.len(), "T5 tokenizer table: unk_id {unk_id} is not a piece");
        let longest_piece = pieces.iter().map(String::len).max().unwrap_or(0);
        let min_score = scores.iter().copied().fold(f32::MAX, f32::min);
        let mut specials = vec![("<pad>", Some(PAD_TOKEN)), ("</s>", Some(EOS_TOKEN)), ("<unk>", Some(unk_id))];
        if vocab == T5Vocab::Umt5 {
            specials.push(("<s>", None));
        }
        Ok(T5Tokenizer {
            pieces,
            scores,
            index,
            longest_piece,
            min_score,
            unk_id,
            replacement: replacement.to_string(),
            add_prefix_space,
            specials,
        })
    }

    /// Number of pieces in the table (the model's embedding table may have more rows).
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    pub fn unk_id(&self) -> u32 {
        self.unk_id
    }

    /// The piece of `id` (with `▁` for word starts), if `id` is in the table.
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Token ids of `text`, without the final `</s>` (padding adds it).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let normalized = collapse_spaces(text);
        let special_texts: Vec<&str> = self.specials.iter().map(|s| s.0).collect();
        let mut parts = super::tokenizer::split_specials(&normalized, &special_texts);
        if parts.is_empty() {
            parts.push((normalized.as_str(), false));
        }
        let mut ids = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        for (part, is_special) in parts {
            if is_special {
                if let Some(&(name, Some(id))) = self.specials.iter().find(|s| s.0 == part) {
                    ids.push(id);
                    names.push(name);
                }
                continue;
            }
            let words = self.pre_tokenize(part);
            let start = ids.len();
            self.segment(&words, &mut ids);
            names.extend(ids[start..].iter().map(|&id| self.piece(id).unwrap_or("")));
        }
        sd_debug!(
            "split prompt \"{}\" to tokens [{}]",
            text,
            names.iter().map(|n| format!("\"{n}\", ")).collect::<String>()
        );
        ids
    }

    /// The Metaspace pre-tokenizer: spaces become `▁`, the text starts with one, and a
    /// trailing space is dropped (the reference splits with `std::getline`).
    fn pre_tokenize(&self, text: &str) -> String {
        let body = text.strip_suffix(' ').unwrap_or(text);
        let mut out = String::with_capacity(body.len() + 3);
        if self.add_prefix_space {
            out.push_str(&self.replacement);
        }
        out.push_str(&body.replace(' ', &self.replacement));
        out
    }

    /// Viterbi segmentation of `text` into the pieces of highest total score. Candidates are
    /// visited by start then length and only a strictly better one replaces the best, so
    /// ties go the reference's way; scores add up in f32 as there.
    fn segment(&self, text: &str, out: &mut Vec<u32>) {
        #[derive(Clone, Copy)]
        struct Best {
            id: u32,
            score: f32,
            start: Option<usize>,
        }
        let bytes = text.as_bytes();
        let n = bytes.len();
        if n == 0 {
            return;
        }
        let unk_score = self.min_score - UNK_PENALTY;
        let mut best = vec![Best { id: 0, score: 0.0, start: None }; n + 1];
        let offer = |best: &mut [Best], end: usize, id: u32, score: f32, start: usize| {
            let node = &mut best[end];
            if node.start.is_none() || score > node.score {
                *node = Best { id, score, start: Some(start) };
            }
        };
        let mut start = 0;
        while start < n {
            let so_far = best[start].score;
            let char_len = utf8_len(bytes[start]).min(n - start);
            let mut has_char_piece = false;
            for end in start + 1..=n.min(start + self.longest_piece) {
                if let Some(&id) = self.index.get(&bytes[start..end]) {
                    offer(&mut best, end, id, self.scores[id as usize] + so_far, start);
                    has_char_piece |= end - start == char_len;
                }
            }
            if !has_char_piece {
                offer(&mut best, start + char_len, self.unk_id, unk_score + so_far, start);
            }
            start += char_len;
        }
        let first = out.len();
        let mut end = n;
        while end > 0 {
            let node = best[end];
            out.push(node.id);
            // Every char boundary is reached (at worst by <unk>), so `start` is set.
            end = node.start.unwrap_or(0);
        }
        out[first..].reverse();
    }
}

/// Byte length of the UTF-8 sequence starting with `lead`.
fn utf8_len(lead: u8) -> usize {
    match lead >> 4 {
        0xC | 0xD => 2,
        0xE => 3,
        0xF => 4,
        _ => 1,
    }
}

/// Runs of two or more ASCII spaces become one (the reference's whole normaliser).
fn collapse_spaces(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut prev_space = false;
    for c in text.chars() {
        if c == ' ' && prev_space {
            continue;
        }
        prev_space = c == ' ';
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> &'static T5Tokenizer {
        T5Tokenizer::shared(T5Vocab::T5).expect("bundled T5 table")
    }

    #[test]
    fn table_layout() {
        let t = tok();
        assert_eq!(t.len(), 32100);
        assert_eq!(t.piece(0), Some("<pad>"));
        assert_eq!(t.piece(1), Some("</s>"));
        assert_eq!(t.piece(2), Some("<unk>"));
        assert_eq!(t.piece(3), Some("▁"));
        assert_eq!(t.piece(8), Some("▁the"));
        assert_eq!(t.piece(32099), Some("<extra_id_0>"));
        assert_eq!(t.unk_id(), T5_UNK_TOKEN);
        assert_eq!(t.replacement, "▁");
        assert!(t.add_prefix_space);
        assert_eq!(t.min_score, -13.590_116);
        assert_eq!(t.longest_piece, 20);
    }

    /// The scores are f32 values printed as doubles; reading them as f64 and rounding to f32
    /// (what the reference does) must give exactly those values, whatever last-bit error the
    /// f64 parser makes.
    #[test]
    fn scores_are_exact_f32_values() {
        let t = tok();
        let data: serde_json::Value = serde_json::from_slice(T5_TABLE).unwrap();
        for (i, item) in data["model"]["vocab"].as_array().unwrap().iter().enumerate() {
            let v = item[1].as_f64().unwrap();
            let f = t.scores[i];
            assert!((f as f64 - v).abs() <= v.abs() * 1e-15, "score {i}: {v} is not an f32 value ({f})");
        }
    }

    /// Ids the reference's tokenizer gives (its sources built on their own, fed these
    /// strings): spaces, punctuation, digits, accents, CJK and emoji (`<unk>` = 2 per
    /// character), full-width forms (no NFKC), special tokens inside text, tabs and newlines.
    #[test]
    fn ids_match_the_reference() {
        let cases: &[(&str, &[u32])] = &[
        ("a lovely cat", &[3, 9, 3061, 1712]),
        ("", &[3]),
        (" ", &[3]),
        ("   leading and trailing   ", &[3, 1374, 11, 5032, 53]),
        ("a  b   c", &[3, 9, 3, 115, 3, 75]),
        ("Hello, World! It's 3:45pm.", &[8774, 6, 1150, 55, 94, 31, 7, 220, 10, 2128, 2028, 5]),
        ("numbers 1234567890 and 3.14159 and 1,000,000", &[2302, 586, 3710, 4834, 3940, 2394, 11, 1877, 2534, 27904, 11, 209, 23916]),
        ("tab\tand\nnewline", &[3808, 2, 232, 2, 5534, 747]),
        ("café naïve résumé", &[11949, 3, 29, 9, 2, 162, 1417, 4078, 154]),
        ("日本語のテキスト", &[3, 2, 2, 2, 2, 2, 2, 2, 2]),
        ("emoji 🐱🚀 test", &[3, 15, 51, 21892, 3, 2, 2, 794]),
        ("a</s>b<pad>c<unk>d", &[3, 9, 1, 3, 115, 0, 3, 75, 2, 3, 26]),
        ("</s>", &[1]),
        ("<extra_id_0> x", &[3, 32099, 3, 226]),
        ("UPPER lower MiXeD", &[3, 6880, 8742, 1364, 2133, 4, 15, 308]),
        ("photo of a cat, 8k, highly detailed, (masterpiece:1.2)", &[1202, 13, 3, 9, 1712, 6, 505, 157, 6, 1385, 3117, 6, 41, 7429, 8424, 10, 10917, 61]),
        ("full-width ＡＢＣ１２３", &[423, 18, 12018, 189, 3, 2, 2, 2, 2, 2, 2]),
        ("quotes \"double\" 'single' `back`", &[7599, 96, 25761, 121, 3, 31, 7, 53, 109, 31, 3, 2, 1549, 2]),
        ("email@example.com http://x.y/z?q=1&r=2", &[791, 1741, 994, 9, 9208, 5, 287, 2649, 1303, 226, 5, 63, 87, 172, 58, 1824, 2423, 536, 184, 52, 2423, 357]),
        ("ß Ω ∑ ∞ → ©®™", &[3, 5202, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 1732, 2]),
        ("a</sb <s> <unk", &[3, 9, 2, 87, 7, 115, 3, 2, 7, 3155, 3, 2, 6513]),
        ("\u{a0}nbsp", &[3, 2, 29, 115, 7, 102]),
        ("ending with space ", &[7784, 28, 628]),
        ("under_score and hy-phen and dots...", &[365, 834, 7, 9022, 11, 3, 107, 63, 18, 19017, 11, 21940, 233]),
        (" lovely", &[3, 3061]),
        ("lovely", &[3061]),
        ("BREAK", &[3, 25582, 12396]),
        ("A cinematic shot of a baby racoon wearing an intricate italian priest robe.", &[71, 10276, 1225, 2538, 13, 3, 9, 1871, 3, 3738, 32, 106, 5119, 46, 19760, 24168, 12966, 3, 9598, 5]),
        ];
        let t = tok();
        for (text, want) in cases {
            assert_eq!(t.encode(text), *want, "{text:?}");
        }
        // Long text (the reference gives exactly this too).
        assert_eq!(t.encode(&"a lovely cat ".repeat(200)), [3, 9, 3061, 1712].repeat(200));
    }

    /// UMT5's table through the same code: `<s>` is special and dropped, `<unk>` is 3, the
    /// table's two empty pieces are one `<empty_token>` (the lower id), as the reference has it.
    #[test]
    fn umt5_ids_match_the_reference() {
        let json = std::fs::read_to_string(env!("SD_UMT5_VOCAB")).expect("decoded UMT5 table");
        let t = T5Tokenizer::from_json(&json, T5Vocab::Umt5).unwrap();
        assert_eq!((t.len(), t.unk_id()), (256300, 3));
        let cases: &[(&str, &[u32])] = &[
            ("a lovely cat", &[289, 51486, 6283]),
            ("", &[273]),
            ("a<s>b</s>c<unk>d<pad>e", &[289, 748, 1, 618, 3, 365, 0, 311]),
            ("日本語のテキスト", &[91001, 343, 84442]),
            ("<empty_token>", &[273, 100426]),
            ("café  naïve\tx", &[12831, 317, 3252, 819, 3, 464]),
            ("Ein Foto von einer Katze, 8k", &[2216, 2338, 598, 1588, 158519, 275, 273, 288, 380]),
        ];
        for (text, want) in cases {
            assert_eq!(t.encode(text), *want, "{text:?}");
        }
        // The bundled table is the same one.
        let bundled = T5Tokenizer::shared(T5Vocab::Umt5).expect("UMT5 table is bundled");
        assert_eq!(bundled.encode(cases[0].0), t.encode(cases[0].0));
    }

    #[test]
    fn metaspace_like_getline() {
        let t = tok();
        assert_eq!(t.pre_tokenize(""), "▁");
        assert_eq!(t.pre_tokenize(" "), "▁");
        assert_eq!(t.pre_tokenize("a b"), "▁a▁b");
        assert_eq!(t.pre_tokenize("a "), "▁a");
        assert_eq!(t.pre_tokenize(" a"), "▁▁a");
        assert_eq!(t.pre_tokenize("a\tb\n"), "▁a\tb\n");
        assert_eq!(collapse_spaces("a   b  \t  c "), "a b \t c ");
    }
}
