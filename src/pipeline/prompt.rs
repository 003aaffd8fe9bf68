//! From prompt text to what the CLIP text encoders consume, like the reference's
//! `FrozenCLIPEmbedderWithCustomWords`: A1111 attention syntax, weighted tokens split
//! into 77-token chunks, textual-inversion embeddings as custom token ids, and the
//! re-weighting of the encoder output.

use crate::error::{Context, Result};
use crate::models::te::t5_tokenizer;
use crate::models::te::tokenizer::{ClipTokenizer, CustomWords, BOS_TOKEN, EOS_TOKEN, VOCAB_SIZE};
use crate::tensor::Tensor;
use std::ops::Range;

/// The weight the attention parser gives a `BREAK` keyword.
pub const BREAK_WEIGHT: f32 = -1.0;
/// Prompt tokens per chunk between BOS and EOS; `BREAK` pads to a multiple of it.
pub const CHUNK_CONTENT: usize = 75;
/// Tokens per text-encoder chunk: BOS + 75 + EOS.
pub const CHUNK_LEN: usize = CHUNK_CONTENT + 2;
/// Padding of SD1 (CLIP ViT-L) and SDXL chunks.
pub const SD1_PAD_TOKEN: u32 = EOS_TOKEN;
/// Padding of SD2 (OpenCLIP ViT-H) chunks.
pub const SD2_PAD_TOKEN: u32 = 0;

const ROUND_MULTIPLIER: f32 = 1.1;

/// Whether a parsed piece is a `BREAK`: only the bare keyword with its marker weight
/// (weighting or merging it with a `-1` neighbour turns it back into text, as in the reference).
pub fn is_break(text: &str, weight: f32) -> bool {
    text == "BREAK" && weight == BREAK_WEIGHT
}

/// One lexeme of the attention syntax.
enum Lexeme<'a> {
    OpenRound,
    OpenSquare,
    /// `:<number>)`, carrying the number's text.
    CloseWeighted(&'a str),
    CloseRound,
    CloseSquare,
    /// `\(`, the only escape the reference turns into its character.
    EscapedOpenRound,
    Break,
    Text(&'a str),
}

/// ECMAScript `\w` on bytes in the "C" locale.
fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Length of `:[+-]?[.0-9]+\)` at the start of `b`, if there.
fn weighted_close_len(b: &[u8]) -> Option<usize> {
    let mut i = 1;
    if matches!(b.get(i), Some(b'+' | b'-')) {
        i += 1;
    }
    let start = i;
    while matches!(b.get(i), Some(c) if *c == b'.' || c.is_ascii_digit()) {
        i += 1;
    }
    (i > start && b.get(i) == Some(&b')')).then_some(i + 1)
}

/// The next lexeme of non-empty `s` and its length in bytes. Mirrors the reference's
/// alternation (tried in order at the start of the remaining text, so `\b` before `BREAK`
/// always holds there).
fn next_lexeme(s: &str) -> (Lexeme<'_>, usize) {
    let b = s.as_bytes();
    match b[0] {
        b'\\' => match b.get(1) {
            Some(b'(') => (Lexeme::EscapedOpenRound, 2),
            Some(b')' | b'[' | b']' | b'\\') => (Lexeme::Text(&s[..2]), 2),
            _ => (Lexeme::Text(&s[..1]), 1),
        },
        b'(' => (Lexeme::OpenRound, 1),
        b'[' => (Lexeme::OpenSquare, 1),
        b':' => match weighted_close_len(b) {
            Some(n) => (Lexeme::CloseWeighted(&s[1..n - 1]), n),
            None => (Lexeme::Text(&s[..1]), 1),
        },
        b')' => (Lexeme::CloseRound, 1),
        b']' => (Lexeme::CloseSquare, 1),
        b'B' if s.starts_with("BREAK") && !b.get(5).copied().is_some_and(is_word_byte) => (Lexeme::Break, 5),
        b'B' => (Lexeme::Text(&s[..1]), 1),
        _ => {
            let n = b.iter().take_while(|c| !matches!(c, b'\\' | b'(' | b')' | b'[' | b']' | b':' | b'B')).count();
            (Lexeme::Text(&s[..n]), n)
        }
    }
}

/// `strtof`-style: the longest `[+-]digits[.digits]` prefix; `None` when there is none or
/// it overflows (cases where the reference's `std::stof` throws).
fn parse_weight(text: &str) -> Option<f32> {
    let b = text.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let int_digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
    i += int_digits;
    let mut frac_digits = 0;
    if b.get(i) == Some(&b'.') {
        frac_digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if int_digits > 0 || frac_digits > 0 {
            i += 1 + frac_digits;
        }
    }
    if int_digits + frac_digits == 0 {
        return None;
    }
    text[..i].parse::<f32>().ok().filter(|v| v.is_finite())
}

/// Splits a prompt into `(text, weight)` pieces with A1111's attention syntax, exactly as
/// the reference does: `(x)` ×1.1, `[x]` ÷1.1, `(x:w)` ×w, unclosed brackets apply to the
/// end, unmatched closers stay text, `BREAK` becomes `("BREAK", -1)`, and neighbours of
/// equal weight are merged. Reference quirks kept: only `\(` is unescaped (`\)`, `\[`,
/// `\]`, `\\` stay as written), `:w)` without an open `(` is dropped, and `BREAK` needs no
/// word boundary before it. A weight the reference cannot parse (`(x:.)`, which aborts
/// it) closes the bracket with ×1.
pub fn parse_prompt_attention(text: &str) -> Vec<(String, f32)> {
    let mut res: Vec<(String, f32)> = Vec::new();
    let mut round: Vec<usize> = Vec::new();
    let mut square: Vec<usize> = Vec::new();
    let square_multiplier = 1.0f32 / ROUND_MULTIPLIER;
    let multiply = |res: &mut Vec<(String, f32)>, from: usize, m: f32| {
        for piece in &mut res[from..] {
            piece.1 *= m;
        }
    };

    let mut rest = text;
    while !rest.is_empty() {
        let (lexeme, len) = next_lexeme(rest);
        match lexeme {
            Lexeme::OpenRound => round.push(res.len()),
            Lexeme::OpenSquare => square.push(res.len()),
            Lexeme::CloseWeighted(number) => {
                if let Some(from) = round.pop() {
                    let m = parse_weight(number).unwrap_or_else(|| {
                        sd_warn!("prompt weight '{number}' is not a number, using 1");
                        1.0
                    });
                    multiply(&mut res, from, m);
                }
            }
            Lexeme::CloseRound if !round.is_empty() => {
                let from = round.pop().unwrap_or_default();
                multiply(&mut res, from, ROUND_MULTIPLIER);
            }
            Lexeme::CloseSquare if !square.is_empty() => {
                let from = square.pop().unwrap_or_default();
                multiply(&mut res, from, square_multiplier);
            }
            Lexeme::CloseRound => res.push((")".into(), 1.0)),
            Lexeme::CloseSquare => res.push(("]".into(), 1.0)),
            Lexeme::EscapedOpenRound => res.push(("(".into(), 1.0)),
            Lexeme::Break => res.push(("BREAK".into(), BREAK_WEIGHT)),
            Lexeme::Text(t) => res.push((t.to_string(), 1.0)),
        }
        rest = &rest[len..];
    }
    for from in round {
        multiply(&mut res, from, ROUND_MULTIPLIER);
    }
    for from in square {
        multiply(&mut res, from, square_multiplier);
    }
    if res.is_empty() {
        res.push((String::new(), 1.0));
    }

    let mut merged: Vec<(String, f32)> = Vec::with_capacity(res.len());
    for (t, w) in res {
        match merged.last_mut() {
            Some(last) if last.1 == w => last.0.push_str(&t),
            _ => merged.push((t, w)),
        }
    }
    merged
}

/// How a token sequence gets BOS/EOS, padding and chunks (the reference's `pad_tokens`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PadOptions {
    /// Pad every sequence (or chunk) to at least this many tokens.
    pub min_length: usize,
    /// Longer sequences are truncated or, with `allow_overflow_expand`, chunked; 0: no limit.
    pub max_length: usize,
    /// Split long sequences into `min_length` chunks, each with its own BOS/EOS.
    pub allow_overflow_expand: bool,
    pub pad_token: u32,
    /// Starts every sequence (CLIP's BOS; T5 has none).
    pub bos: Option<u32>,
    /// Ends every sequence, also a truncated one.
    pub eos: Option<u32>,
}

impl PadOptions {
    /// SD1/SD2/SDXL: one or more 77-token chunks (BOS + 75 + EOS, padded).
    pub const fn clip_chunks(pad_token: u32) -> PadOptions {
        PadOptions {
            min_length: CHUNK_LEN,
            max_length: CHUNK_LEN,
            allow_overflow_expand: true,
            pad_token,
            bos: Some(BOS_TOKEN),
            eos: Some(EOS_TOKEN),
        }
    }

    /// T5 (SD3: 77, Flux: 256, Chroma: 512): chunks of `len` tokens, each ending in EOS and
    /// padded with `<pad>`; no BOS.
    pub const fn t5_chunks(len: usize) -> PadOptions {
        PadOptions {
            min_length: len,
            max_length: len,
            allow_overflow_expand: true,
            pad_token: t5_tokenizer::PAD_TOKEN,
            bos: None,
            eos: Some(t5_tokenizer::EOS_TOKEN),
        }
    }

    fn special_count(&self) -> usize {
        usize::from(self.bos.is_some()) + usize::from(self.eos.is_some())
    }
}

/// Token ids with one weight each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WeightedTokens {
    pub tokens: Vec<u32>,
    pub weights: Vec<f32>,
}

impl WeightedTokens {
    /// Consecutive `(tokens, weights)` chunks of `chunk_len` (a trailing partial one is left out).
    pub fn chunks(&self, chunk_len: usize) -> impl Iterator<Item = (&[u32], &[f32])> {
        self.tokens.chunks_exact(chunk_len.max(1)).zip(self.weights.chunks_exact(chunk_len.max(1)))
    }

    pub fn chunk_count(&self, chunk_len: usize) -> usize {
        self.tokens.len() / chunk_len.max(1)
    }

    /// Adds BOS/EOS and padding, truncating or chunking long sequences, as the reference
    /// (which leaves mismatched tokens and weights as they are, after logging it).
    pub fn pad(&mut self, opts: &PadOptions) {
        self.pad_with_mask(opts);
    }

    /// [`pad`](Self::pad), also returning the attention mask: 1 for each token and BOS/EOS,
    /// 0 for padding (and for the zero fill of a truncation to more than the tokens).
    pub fn pad_with_mask(&mut self, opts: &PadOptions) -> Vec<f32> {
        if self.tokens.len() != self.weights.len() {
            sd_error!("tokens size != weights size");
            return Vec::new();
        }
        let n = self.tokens.len();
        let mut mask = Vec::new();
        let sequence = |range: Range<usize>, target: usize, out: &mut WeightedTokens, mask: &mut Vec<f32>| {
            let start = out.tokens.len();
            if let Some(bos) = opts.bos {
                out.tokens.push(bos);
                out.weights.push(1.0);
            }
            out.tokens.extend_from_slice(&self.tokens[range.clone()]);
            out.weights.extend_from_slice(&self.weights[range]);
            if let Some(eos) = opts.eos {
                out.tokens.push(eos);
                out.weights.push(1.0);
            }
            mask.resize(out.tokens.len(), 1.0);
            let short = target.saturating_sub(out.tokens.len() - start);
            out.tokens.extend(std::iter::repeat_n(opts.pad_token, short));
            out.weights.extend(std::iter::repeat_n(1.0, short));
            mask.resize(out.tokens.len(), 0.0);
        };
        let specials = opts.special_count();
        let single = opts.min_length.max(n + specials);
        let exceeds = opts.max_length > 0 && single > opts.max_length;
        let mut out = WeightedTokens::default();
        if !exceeds {
            sequence(0..n, opts.min_length, &mut out, &mut mask);
        } else if !opts.allow_overflow_expand {
            sequence(0..n, 0, &mut out, &mut mask);
            out.tokens.resize(opts.max_length, 0);
            out.weights.resize(opts.max_length, 0.0);
            mask.resize(opts.max_length, 0.0);
            if let Some(eos) = opts.eos {
                if let (Some(t), Some(w), Some(m)) = (out.tokens.last_mut(), out.weights.last_mut(), mask.last_mut()) {
                    (*t, *w, *m) = (eos, 1.0, 1.0);
                }
            }
        } else if opts.min_length > specials {
            let per_chunk = opts.min_length - specials;
            let mut start = 0;
            while start < n {
                let end = (start + per_chunk).min(n);
                sequence(start..end, opts.min_length, &mut out, &mut mask);
                start = end;
            }
        } else {
            sequence(0..n, opts.min_length, &mut out, &mut mask);
        }
        *self = out;
        mask
    }
}

/// Prompt → weighted, padded, chunked tokens for one CLIP text encoder (the reference's
/// `tokenize`). `BREAK` fills the current 75-token chunk with EOS tokens (not the pad
/// token, also for SD2). Always at least one chunk.
pub fn tokenize_weighted(
    tokenizer: &ClipTokenizer,
    text: &str,
    words: &dyn CustomWords,
    opts: &PadOptions,
) -> WeightedTokens {
    let parsed = parse_prompt_attention(text);
    sd_debug!("parse '{}' to [{}]", text, parsed.iter().map(|(t, w)| format!("['{t}', {w}], ")).collect::<String>());
    let mut out = WeightedTokens::default();
    for (piece, weight) in &parsed {
        if is_break(piece, *weight) {
            let fill = (CHUNK_CONTENT - out.tokens.len() % CHUNK_CONTENT) % CHUNK_CONTENT;
            if fill > 0 {
                sd_debug!("BREAK token encountered, padding current chunk by {fill} tokens.");
                out.tokens.extend(std::iter::repeat_n(EOS_TOKEN, fill));
                out.weights.extend(std::iter::repeat_n(1.0, fill));
            }
            continue;
        }
        let ids = tokenizer.encode_with(piece, words);
        out.weights.extend(std::iter::repeat_n(*weight, ids.len()));
        out.tokens.extend(ids);
    }
    out.pad(opts);
    out
}

/// SDXL's second encoder (OpenCLIP bigG) sees a chunk with every token after the first EOS
/// set to 0. Returns those ids and the first EOS's index (the last index when there is
/// none), where the pooled output is read.
pub fn zero_after_first_eos(chunk: &[u32]) -> (Vec<u32>, usize) {
    let eos = chunk.iter().position(|&t| t == EOS_TOKEN);
    let mut ids = chunk.to_vec();
    if let Some(at) = eos {
        ids[at + 1..].iter_mut().for_each(|t| *t = 0);
    }
    let last = chunk.len().saturating_sub(1);
    (ids, eos.unwrap_or(last).min(last))
}

/// Scales every token's hidden state by its weight, then the whole chunk so its mean is
/// what it was (the reference's `apply_token_weights`), chunk by chunk.
///
/// `hidden`: the encoder output `[dim, chunk_len * chunks]` (for SDXL both encoders'
/// outputs concatenated along `dim` first); `weights`: one per token.
pub fn apply_token_weights(hidden: &mut Tensor, weights: &[f32], chunk_len: usize) -> Result<()> {
    let dim = Tensor::ne(hidden, 0);
    ensure!(
        dim > 0 && hidden.len() == dim * weights.len(),
        "token weights: hidden states {:?} do not hold {} tokens",
        hidden.shape(),
        weights.len()
    );
    ensure!(
        chunk_len > 0 && weights.len().is_multiple_of(chunk_len),
        "token weights: {} tokens are not whole chunks of {chunk_len}",
        weights.len()
    );
    for (values, chunk_weights) in hidden.data_mut().chunks_mut(dim * chunk_len).zip(weights.chunks(chunk_len)) {
        if chunk_weights.iter().all(|&w| w == 1.0) {
            continue;
        }
        let original_mean = mean(values);
        for (token, &w) in values.chunks_mut(dim).zip(chunk_weights) {
            token.iter_mut().for_each(|v| *v *= w);
        }
        let new_mean = mean(values);
        if original_mean.is_finite() && new_mean.is_finite() && new_mean != 0.0 {
            let scale = original_mean / new_mean;
            values.iter_mut().for_each(|v| *v *= scale);
        }
    }
    Ok(())
}

/// Mean accumulated in f64, in order, then rounded to f32 (as the reference's tensors).
fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    (values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64) as f32
}

/// Textual-inversion embeddings for the CLIP text encoders.
///
/// Each embedding has rows for each text encoder (`[dim_e, n_e]`, SDXL's two encoders
/// have different dims). It occupies `max(n_e)` custom token ids, `vocab_size + k`, in
/// registration order; an encoder's shorter (or missing) rows are zero-padded, so the
/// same ids work for every encoder. Names are matched case-insensitively as substrings of
/// the cleaned prompt (the reference treats them as special tokens).
#[derive(Clone, Debug)]
pub struct EmbeddingSet {
    vocab_size: u32,
    dims: Vec<usize>,
    entries: Vec<Embedding>,
}

#[derive(Clone, Debug)]
struct Embedding {
    /// As registered: decides clashes and the order of names, like the reference's map.
    original: String,
    name: String,
    /// Per encoder `[dim, n]`, if the embedding has rows for it.
    rows: Vec<Option<Tensor>>,
    tokens: usize,
}

impl EmbeddingSet {
    /// An empty set for text encoders of the given hidden sizes (CLIP vocabulary).
    pub fn new(encoder_dims: &[usize]) -> EmbeddingSet {
        EmbeddingSet::with_vocab_size(VOCAB_SIZE, encoder_dims)
    }

    pub fn with_vocab_size(vocab_size: u32, encoder_dims: &[usize]) -> EmbeddingSet {
        EmbeddingSet { vocab_size, dims: encoder_dims.to_vec(), entries: Vec::new() }
    }

    /// The name as matched in prompts: ASCII lower-case.
    pub fn normalize_name(name: &str) -> String {
        name.to_ascii_lowercase()
    }

    pub fn encoder_dims(&self) -> &[usize] {
        &self.dims
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Registers an embedding with `rows[e]` (`[dim_e, n]`, or `None`) for each encoder.
    /// A name equal to a registered one after lower-casing keeps the entry whose
    /// registered name sorts last (first one on a tie), like the reference.
    pub fn register(&mut self, name: &str, rows: Vec<Option<Tensor>>) -> Result<()> {
        let key = EmbeddingSet::normalize_name(name);
        ensure!(!key.is_empty(), "embedding name is empty");
        ensure!(
            rows.len() == self.dims.len(),
            "embedding '{name}': {} row sets for {} text encoders",
            rows.len(),
            self.dims.len()
        );
        let mut tokens = 0;
        for (e, r) in rows.iter().enumerate() {
            let Some(t) = r else { continue };
            let n = t.shape().iter().skip(1).product::<usize>();
            ensure!(
                t.ne(0) == self.dims[e] && n == t.ne(1) && n > 0,
                "embedding '{name}': rows {:?} for text encoder {e} are not [{}, n]",
                t.shape(),
                self.dims[e]
            );
            tokens = tokens.max(n);
        }
        ensure!(tokens > 0, "embedding '{name}' has no rows for any text encoder");
        let entry = Embedding { original: name.to_string(), name: key, rows, tokens };
        match self.entries.iter_mut().find(|e| e.name == entry.name) {
            Some(old) if old.original < entry.original => *old = entry,
            Some(old) => sd_debug!("embedding '{}' ignored: '{}' has the same name", name, old.original),
            None => self.entries.push(entry),
        }
        Ok(())
    }

    /// Registers an embedding from the tensors of its file, the way the reference picks
    /// them: a tensor whose first dimension is an encoder's hidden size (the first such
    /// encoder) gives that encoder's rows; the last matching tensor wins.
    pub fn register_tensors(&mut self, name: &str, tensors: &[Tensor]) -> Result<()> {
        let mut rows: Vec<Option<Tensor>> = vec![None; self.dims.len()];
        for t in tensors {
            match self.dims.iter().position(|&d| d == t.ne(0)) {
                Some(e) => rows[e] = Some(t.clone()),
                None => sd_debug!("embedding wrong hidden size, got {}, expected {:?}", t.ne(0), self.dims),
            }
        }
        ensure!(rows.iter().any(Option::is_some), "embedding '{name}': no tensor with hidden size {:?}", self.dims);
        let rows = rows.into_iter().map(|r| r.map(as_rows).transpose()).collect::<Result<Vec<_>>>()?;
        self.register(name, rows)
    }

    /// Where each embedding's custom tokens start, counted from `vocab_size`.
    fn offsets(&self) -> impl Iterator<Item = (&Embedding, usize)> {
        self.entries.iter().scan(0usize, |next, e| {
            let start = *next;
            *next += e.tokens;
            Some((e, start))
        })
    }

    /// Total number of custom tokens (rows of each encoder's extra table).
    pub fn token_count(&self) -> usize {
        self.entries.iter().map(|e| e.tokens).sum()
    }

    /// The ids an embedding name (any case) stands for.
    pub fn token_ids(&self, name: &str) -> Option<Range<u32>> {
        let key = EmbeddingSet::normalize_name(name);
        self.offsets().find(|(e, _)| e.name == key).map(|(e, start)| {
            let first = self.vocab_size + start as u32;
            first..first + e.tokens as u32
        })
    }

    /// Encoder `encoder`'s extra embedding table `[dim, token_count]` (f32; the encoder
    /// converts it to its token-embedding type): row `k` is custom token `vocab_size + k`.
    pub fn custom_rows(&self, encoder: usize) -> Result<Tensor> {
        let dim = *self.dims.get(encoder).with_context(|| format!("no text encoder {encoder} for embeddings"))?;
        let mut data = Vec::with_capacity(dim * self.token_count());
        for e in &self.entries {
            let have = match &e.rows[encoder] {
                Some(t) => {
                    data.extend_from_slice(t.data());
                    t.len() / dim
                }
                None => 0,
            };
            data.resize(data.len() + (e.tokens - have) * dim, 0.0);
        }
        Tensor::from_vec(&[dim, self.token_count()], data)
    }
}

/// `[dim, n, 1, ..]` → `[dim, n]`.
fn as_rows(t: Tensor) -> Result<Tensor> {
    let n = t.shape().iter().skip(1).product::<usize>();
    let dim = t.ne(0);
    t.reshape(&[dim, n])
}

impl CustomWords for EmbeddingSet {
    fn words(&self) -> Vec<&str> {
        let mut entries: Vec<&Embedding> = self.entries.iter().collect();
        entries.sort_by(|a, b| a.original.cmp(&b.original));
        entries.into_iter().map(|e| e.name.as_str()).collect()
    }

    fn append_tokens(&self, word: &str, out: &mut Vec<u32>) -> bool {
        match self.token_ids(word) {
            Some(ids) => {
                out.extend(ids);
                true
            }
            None => false,
        }
    }
}

/// Quoted text spelled out (LongCat's `spell_quotes`): within each weighted piece, text in
/// matching quotes (`'…'`, `"…"`, `‘…’`, `“…”`, quotes included) becomes one piece per
/// character, so the tokenizer sees every letter of the words to be drawn; the rest stays
/// whole. An apostrophe between two ASCII letters is not a quote; an opening curly quote
/// seen again before its closing one, or a quote never closed, leaves the text as it is.
pub fn spell_quoted(pieces: Vec<(String, f32)>) -> Vec<(String, f32)> {
    let mut out = Vec::new();
    for (text, weight) in pieces {
        for (part, quoted) in quoted_spans(&text) {
            if quoted {
                out.extend(part.chars().map(|c| (c.to_string(), weight)));
            } else {
                out.push((part.to_string(), weight));
            }
        }
    }
    out
}

/// `text` cut into unquoted and quoted spans (`true`), in order, none empty.
fn quoted_spans<'t>(text: &'t str) -> Vec<(&'t str, bool)> {
    const PAIRS: [(&str, &str); 4] = [("'", "'"), ("\"", "\""), ("\u{2018}", "\u{2019}"), ("\u{201C}", "\u{201D}")];
    let bytes = text.as_bytes();
    let inner_apostrophe = |i: usize| i > 0 && i + 1 < bytes.len() && bytes[i - 1].is_ascii_alphabetic() && bytes[i + 1].is_ascii_alphabetic();
    let mut spans = Vec::new();
    let push = |spans: &mut Vec<(&'t str, bool)>, from: usize, to: usize, quoted: bool| {
        if to > from {
            spans.push((&text[from..to], quoted));
        }
    };
    let (mut start, mut i) = (0, 0);
    while i < text.len() {
        let found = PAIRS.iter().find_map(|&(open, close)| {
            if !text[i..].starts_with(open) || (open == "'" && inner_apostrophe(i)) {
                return None;
            }
            let mut j = i + open.len();
            while j < text.len() {
                if open != close && text[j..].starts_with(open) {
                    return None;
                }
                if text[j..].starts_with(close) {
                    if close == "'" && inner_apostrophe(j) {
                        j += close.len();
                        continue;
                    }
                    return Some(j + close.len());
                }
                j += text[j..].chars().next().map_or(1, char::len_utf8);
            }
            None
        });
        match found {
            Some(end) => {
                push(&mut spans, start, i, false);
                push(&mut spans, i, end, true);
                start = end;
                i = end;
            }
            None => i += text[i..].chars().next().map_or(1, char::len_utf8),
        }
    }
    push(&mut spans, start, text.len(), false);
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected pieces with weights as f32 bit patterns, produced by running the
    /// reference's parser on these prompts.
    fn check(prompt: &str, expected: &[(&str, u32)]) {
        let got = parse_prompt_attention(prompt);
        let got: Vec<(&str, u32)> = got.iter().map(|(t, w)| (t.as_str(), w.to_bits())).collect();
        assert_eq!(got, expected, "prompt {prompt:?}");
    }

    const ONE: u32 = 0x3f80_0000;
    const UP: u32 = 0x3f8c_cccd; // 1.1
    const BREAK: u32 = 0xbf80_0000;

    #[test]
    fn attention_basics() {
        check("normal text", &[("normal text", ONE)]);
        check("an (important) word", &[("an ", ONE), ("important", UP), (" word", ONE)]);
        check("(unbalanced", &[("unbalanced", UP)]);
        check("(unnecessary)(parens)", &[("unnecessaryparens", UP)]);
        check(
            "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
            &[
                ("a ", ONE),
                ("house", 0x3fc9_5810),
                (" ", UP),
                ("on", ONE),
                (" a ", UP),
                ("hill", 0x3f0c_cccd),
                (", sun, ", UP),
                ("sky", 0x3fbb_67a2),
                (".", UP),
            ],
        );
        check("[[a]] b] (c", &[("a", 0x3f53_91fb), (" b] ", ONE), ("c", UP)]);
        check("[(a)]", &[("a", ONE)]);
        check(
            "((a) (b:0.8)) [c:0.5]",
            &[("a", 0x3f9a_e148), (" ", UP), ("b", 0x3f61_47af), (" ", ONE), ("c:0.5", 0x3f68_ba2e)],
        );
        check("(a:1.30)(b:1.3)", &[("ab", 0x3fa6_6666)]);
        check("((a:0.5)", &[("a", 0x3f0c_cccd)]);
        check("(x:0)", &[("x", 0)]);
        check("", &[("", ONE)]);
    }

    #[test]
    fn attention_weights_and_colons() {
        check("x:1.3) y", &[("x y", ONE)]);
        check("a:b (c :1.2)", &[("a:b ", ONE), ("c ", 0x3f99_999a)]);
        check("(a:1.2.3)", &[("a", 0x3f99_999a)]);
        check("((a:+.5))", &[("a", 0x3f0c_cccd)]);
        check("(a:5.)", &[("a", 0x40a0_0000)]);
        check("(a:1e5)", &[("a:1e5", UP)]);
        // The reference aborts on these; we close the bracket with ×1.
        check("(a:.)", &[("a", ONE)]);
        check("((a:99999999999999999999999999999999999999999999))", &[("a", UP)]);
    }

    #[test]
    fn attention_escapes() {
        check("\\(literal\\]", &[("(literal\\]", ONE)]);
        check("\\\\ \\) \\[ \\] \\ z", &[("\\\\ \\) \\[ \\] \\ z", ONE)]);
        check("a\\\\\\\\(b)", &[("a\\\\\\\\", ONE), ("b", UP)]);
        check("c:\\\\path\\\\to(x)", &[("c:\\\\path\\\\to", ONE), ("x", UP)]);
    }

    #[test]
    fn attention_break() {
        check("a BREAK b", &[("a ", ONE), ("BREAK", BREAK), (" b", ONE)]);
        check("aBREAK b", &[("a", ONE), ("BREAK", BREAK), (" b", ONE)]);
        check("xBREAK", &[("x", ONE), ("BREAK", BREAK)]);
        check("BREAK", &[("BREAK", BREAK)]);
        check("BREAK\u{e9}", &[("BREAK", BREAK), ("\u{e9}", ONE)]);
        check("BREAKFAST", &[("BREAKFAST", ONE)]);
        check("BREAK_x", &[("BREAK_x", ONE)]);
        check("Bob and Bill", &[("Bob and Bill", ONE)]);
        check("(x:-1)BREAK", &[("xBREAK", BREAK)]);
        check("(BREAK)", &[("BREAK", 0xbf8c_cccd)]);
        check("B(BREAK)B", &[("B", ONE), ("BREAK", 0xbf8c_cccd), ("B", ONE)]);
        check("x BREAK  BREAK y", &[("x ", ONE), ("BREAK", BREAK), ("  ", ONE), ("BREAK", BREAK), (" y", ONE)]);
        assert!(is_break("BREAK", -1.0));
        assert!(!is_break("BREAK", -1.1));
    }

    fn seq(n: usize) -> WeightedTokens {
        WeightedTokens { tokens: (0..n as u32).map(|i| 1000 + i).collect(), weights: vec![2.0; n] }
    }

    #[test]
    fn padding_and_chunks() {
        let opts = PadOptions::clip_chunks(SD2_PAD_TOKEN);
        let mut w = seq(0);
        w.pad(&opts);
        assert_eq!(w.tokens.len(), 77);
        assert_eq!(&w.tokens[..3], &[BOS_TOKEN, EOS_TOKEN, 0]);
        assert!(w.weights.iter().all(|&x| x == 1.0));

        let mut w = seq(75);
        w.pad(&opts);
        assert_eq!(w.chunk_count(CHUNK_LEN), 1);
        assert_eq!((w.tokens[0], w.tokens[75], w.tokens[76]), (BOS_TOKEN, 1074, EOS_TOKEN));
        assert_eq!((w.weights[0], w.weights[1], w.weights[76]), (1.0, 2.0, 1.0));

        let mut w = seq(76);
        w.pad(&opts);
        assert_eq!(w.tokens.len(), 2 * 77);
        let chunks: Vec<_> = w.chunks(CHUNK_LEN).collect();
        assert_eq!((chunks[0].0[75], chunks[0].0[76]), (1074, EOS_TOKEN));
        assert_eq!(&chunks[1].0[..4], &[BOS_TOKEN, 1075, EOS_TOKEN, 0]);
        assert_eq!(&chunks[1].1[..4], &[1.0, 2.0, 1.0, 1.0]);

        for (n, chunks) in [(150, 2), (151, 3)] {
            let mut w = seq(n);
            w.pad(&opts);
            assert_eq!(w.tokens.len(), chunks * 77, "{n} tokens");
        }
    }

    #[test]
    fn padding_other_modes() {
        // Truncation keeps BOS, the first 75 tokens and EOS.
        let mut w = seq(80);
        w.pad(&PadOptions { allow_overflow_expand: false, ..PadOptions::clip_chunks(EOS_TOKEN) });
        assert_eq!(w.tokens.len(), 77);
        assert_eq!((w.tokens[75], w.tokens[76]), (1074, EOS_TOKEN));
        // No length limit: one sequence.
        let mut w = seq(100);
        w.pad(&PadOptions { min_length: 77, max_length: 0, allow_overflow_expand: false, ..PadOptions::clip_chunks(0) });
        assert_eq!(w.tokens.len(), 102);
        // min_length above max_length without expansion: zero-filled, EOS last (as the reference).
        let mut w = seq(3);
        w.pad(&PadOptions { min_length: 10, max_length: 8, allow_overflow_expand: false, ..PadOptions::clip_chunks(7) });
        assert_eq!(w.tokens, [BOS_TOKEN, 1000, 1001, 1002, EOS_TOKEN, 0, 0, EOS_TOKEN]);
        assert_eq!(w.weights, [1.0, 2.0, 2.0, 2.0, 1.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn second_encoder_ids() {
        let chunk = [BOS_TOKEN, 320, EOS_TOKEN, EOS_TOKEN, EOS_TOKEN];
        assert_eq!(zero_after_first_eos(&chunk), (vec![BOS_TOKEN, 320, EOS_TOKEN, 0, 0], 2));
        assert_eq!(zero_after_first_eos(&[BOS_TOKEN, 1, 2]), (vec![BOS_TOKEN, 1, 2], 2));
    }

    #[test]
    fn token_weights_keep_the_mean() {
        // dim 2, two chunks of 3 tokens; the second chunk has all weights 1.
        let mut h = Tensor::from_vec(&[2, 6], vec![1., 2., 3., 4., 5., 6., 1., 2., 3., 4., 5., 6.]).unwrap();
        apply_token_weights(&mut h, &[1.0, 2.0, 0.5, 1.0, 1.0, 1.0], 3).unwrap();
        // Weighted: 1 2 6 8 2.5 3 (mean 3.75), scaled by 3.5 / 3.75.
        let s = 3.5f32 / 3.75f32;
        let expected = [1.0 * s, 2.0 * s, 6.0 * s, 8.0 * s, 2.5 * s, 3.0 * s, 1., 2., 3., 4., 5., 6.];
        assert_eq!(h.data(), &expected);
        assert!((mean(&h.data()[..6]) - 3.5).abs() < 1e-6);

        // A zero new mean leaves the multiplied values as they are.
        let mut h = Tensor::from_vec(&[1, 2], vec![1.0, -2.0]).unwrap();
        apply_token_weights(&mut h, &[2.0, 1.0], 2).unwrap();
        assert_eq!(h.data(), &[2.0, -2.0]);

        let mut h = Tensor::zeros(&[4, 5]);
        assert!(apply_token_weights(&mut h, &[1.0; 4], 4).is_err());
        assert!(apply_token_weights(&mut h, &[1.0; 5], 2).is_err());
    }

    fn rows(dim: usize, n: usize, base: f32) -> Tensor {
        Tensor::from_vec(&[dim, n], (0..dim * n).map(|i| base + i as f32).collect()).unwrap()
    }

    #[test]
    fn embeddings_ids_and_tables() {
        let mut set = EmbeddingSet::new(&[4, 6]);
        set.register("Style", vec![Some(rows(4, 2, 0.0)), Some(rows(6, 3, 100.0))]).unwrap();
        set.register("other", vec![Some(rows(4, 1, 50.0)), None]).unwrap();
        assert_eq!(set.token_count(), 4);
        assert_eq!(set.token_ids("STYLE"), Some(VOCAB_SIZE..VOCAB_SIZE + 3));
        assert_eq!(set.token_ids("other"), Some(VOCAB_SIZE + 3..VOCAB_SIZE + 4));
        assert_eq!(set.token_ids("none"), None);

        let t0 = set.custom_rows(0).unwrap();
        assert_eq!(t0.shape(), &[4, 4]);
        assert_eq!(&t0.data()[..8], rows(4, 2, 0.0).data());
        assert!(t0.data()[8..12].iter().all(|&v| v == 0.0));
        assert_eq!(&t0.data()[12..], rows(4, 1, 50.0).data());
        let t1 = set.custom_rows(1).unwrap();
        assert_eq!(t1.shape(), &[6, 4]);
        assert_eq!(&t1.data()[..18], rows(6, 3, 100.0).data());
        assert!(t1.data()[18..].iter().all(|&v| v == 0.0));
        assert!(set.custom_rows(2).is_err());

        assert!(set.register("", vec![Some(rows(4, 1, 0.0)), None]).is_err());
        assert!(set.register("bad", vec![Some(rows(5, 1, 0.0)), None]).is_err());
        assert!(set.register("bad", vec![None, None]).is_err());
        assert!(set.register("bad", vec![None]).is_err());
    }

    #[test]
    fn embedding_name_clashes_and_order() {
        let mut set = EmbeddingSet::new(&[2]);
        set.register("foo", vec![Some(rows(2, 1, 0.0))]).unwrap();
        set.register("Foo", vec![Some(rows(2, 2, 0.0))]).unwrap();
        // "foo" sorts after "Foo", so it stays.
        assert_eq!(set.token_ids("foo").map(|r| r.len()), Some(1));
        set.register("fOO", vec![Some(rows(2, 3, 0.0))]).unwrap();
        assert_eq!(set.token_ids("foo").map(|r| r.len()), Some(1));
        assert_eq!(set.len(), 1);

        let mut set = EmbeddingSet::new(&[2]);
        set.register("catdog", vec![Some(rows(2, 1, 0.0))]).unwrap();
        set.register("Cat", vec![Some(rows(2, 1, 0.0))]).unwrap();
        set.register("CATS", vec![Some(rows(2, 1, 0.0))]).unwrap();
        assert_eq!(set.words(), ["cats", "cat", "catdog"]);
    }

    #[test]
    fn embeddings_from_file_tensors() {
        let mut set = EmbeddingSet::new(&[4, 6]);
        let file = [
            Tensor::from_vec(&[6, 2, 1], vec![1.0; 12]).unwrap(),
            Tensor::zeros(&[5, 2]),
            Tensor::from_vec(&[4], vec![2.0; 4]).unwrap(),
        ];
        set.register_tensors("emb", &file).unwrap();
        assert_eq!(set.token_ids("emb"), Some(VOCAB_SIZE..VOCAB_SIZE + 2));
        assert_eq!(&set.custom_rows(0).unwrap().data()[..4], &[2.0; 4]);
        assert_eq!(set.custom_rows(1).unwrap().shape(), &[6, 2]);
        assert!(set.register_tensors("nothing", &[Tensor::zeros(&[3, 1])]).is_err());
    }

    #[test]
    fn quoted_text_is_spelled_out() {
        let spelled = |t: &str| spell_quoted(vec![(t.to_string(), 1.5)]).into_iter().map(|(p, _)| p).collect::<Vec<_>>();
        assert_eq!(spelled("a sign 'OK' here"), ["a sign ", "'", "O", "K", "'", " here"]);
        assert_eq!(spelled("say \u{201C}hé\u{201D}"), ["say ", "\u{201C}", "h", "é", "\u{201D}"]);
        // Apostrophes inside words are not quotes; an unclosed quote stays text.
        assert_eq!(spelled("don't \"stop"), ["don't \"stop"]);
        assert_eq!(spelled("it's 'x'"), ["it's ", "'", "x", "'"]);
        // A second opening curly quote before the closing one: not a quotation.
        assert_eq!(spelled("\u{2018}a \u{2018}b\u{2019}"), ["\u{2018}a ", "\u{2018}", "b", "\u{2019}"]);
        assert!(spell_quoted(vec![("'ab'".into(), 1.5)]).iter().all(|(_, w)| *w == 1.5));
    }
}
