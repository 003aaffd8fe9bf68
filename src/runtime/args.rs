//! The `key=value,key=value` option strings the reference accepts for samplers and
//! schedulers (`extra_sample_args`), with its strict number and boolean parsing.
//!
//! Entries are separated by `,` or `;`, surrounding whitespace is ignored, an entry without
//! `=` is skipped with a warning. The same string is shared by schedulers, samplers, guidance
//! and img2img options, so each reads its own keys and passes over the rest; a key that none
//! of them reads draws one warning per request (`pipeline::fields`), where the reference is
//! silent.

/// A request's `extra_sample_args`, parsed once where the request enters the pipeline:
/// schedulers, samplers, img2img and guidance each read their typed options from these pairs
/// (malformed entries were warned about once, at parse time).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExtraArgs {
    pairs: Vec<(String, String)>,
}

impl ExtraArgs {
    pub fn parse(args: Option<&str>) -> ExtraArgs {
        ExtraArgs { pairs: parse_key_value_args(args, "extra sample arg") }
    }

    /// The (key, value) pairs in the order written.
    pub fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

/// C's `isspace` in the "C" locale.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\u{0b}' | '\u{0c}' | '\r')
}

fn trim(s: &str) -> &str {
    s.trim_matches(is_c_space)
}

/// Splits `args` into (key, value) pairs in order; `context` names the option list in the
/// warning for malformed entries.
pub fn parse_key_value_args(args: Option<&str>, context: &str) -> Vec<(String, String)> {
    let Some(args) = args else { return Vec::new() };
    let mut pairs = Vec::new();
    for token in args.split([',', ';']) {
        let token = trim(token);
        if token.is_empty() {
            continue;
        }
        match token.split_once('=') {
            Some((k, v)) => pairs.push((trim(k).to_string(), trim(v).to_string())),
            None => sd_warn!("ignoring malformed {} '{}'", context, token),
        }
    }
    pairs
}

/// Length of the longest prefix of `s` that `strtof`/`strtod` would read as a decimal
/// number (after leading whitespace was removed), or `None` when there is none.
fn float_prefix_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = 0;
    if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
        i += 1;
    }
    let rest = s[i..].to_ascii_lowercase();
    for word in ["infinity", "inf", "nan"] {
        if rest.starts_with(word) {
            return Some(i + word.len());
        }
    }
    let digits_start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    let mut ndigits = i - digits_start;
    if i < b.len() && b[i] == b'.' {
        i += 1;
        let frac_start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        ndigits += i - frac_start;
    }
    if ndigits == 0 {
        return None;
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        let mut j = i + 1;
        if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
            j += 1;
        }
        let exp_start = j;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        if j > exp_start {
            i = j;
        }
    }
    Some(i)
}

/// Like the reference's `parse_strict_float` (`std::stof` that must consume everything
/// but trailing whitespace; out-of-range values are rejected).
pub fn parse_strict_float(text: &str) -> Option<f32> {
    let s = text.trim_start_matches(is_c_space);
    let n = float_prefix_len(s)?;
    if !trim(&s[n..]).is_empty() {
        return None;
    }
    let num = &s[..n];
    let v: f32 = num.parse().ok()?;
    let lower = num.to_ascii_lowercase();
    let special = lower.contains("inf") || lower.contains("nan");
    if !special {
        let mantissa = num.split(['e', 'E']).next().unwrap_or("");
        let nonzero_input = mantissa.bytes().any(|c| matches!(c, b'1'..=b'9'));
        if v.is_infinite() || (nonzero_input && (v == 0.0 || v.is_subnormal())) {
            return None;
        }
    }
    Some(v)
}

/// Like the reference's `parse_strict_int` (`std::stoi`, base 10, int range).
pub fn parse_strict_int(text: &str) -> Option<i32> {
    let s = text.trim_start_matches(is_c_space);
    let b = s.as_bytes();
    let mut i = 0;
    if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
        i += 1;
    }
    let start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    if i == start || !trim(&s[i..]).is_empty() {
        return None;
    }
    s[..i].parse::<i32>().ok()
}

/// Like the reference's `parse_strict_bool`: 1/true/yes/on and 0/false/no/off, any case.
pub fn parse_strict_bool(text: &str) -> Option<bool> {
    match trim(text).to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Whether a context takes the opt-in fast path (issue 28): `fast=<bool>` in its
/// `model_args`, else `SD_FAST=<bool>` in the environment; off by default. The fast path
/// trades the reference's float sums for speed (its pictures move by rounding), so it is
/// never on unless asked for. An invalid value is warned about and leaves it off.
pub fn fast_path(model_args: Option<&str>) -> bool {
    let mut fast = None;
    for (k, v) in parse_key_value_args(model_args, "model arg") {
        if k == "fast" {
            match parse_strict_bool(&v) {
                Some(b) => fast = Some(b),
                None => sd_warn!("ignoring invalid model arg 'fast={v}' (expected 1/0, true/false, yes/no or on/off)"),
            }
        }
    }
    fast.unwrap_or_else(|| match std::env::var("SD_FAST") {
        Ok(v) if !trim(&v).is_empty() => parse_strict_bool(&v).unwrap_or_else(|| {
            sd_warn!("ignoring invalid SD_FAST='{v}' (expected 1/0, true/false, yes/no or on/off)");
            false
        }),
        _ => false,
    })
}

/// Reads a float option into `slot`, warning (with the reference's wording) when invalid.
pub(crate) fn set_float(slot: &mut f32, what: &str, key: &str, value: &str) {
    match parse_strict_float(value) {
        Some(v) => *slot = v,
        None => sd_warn!("ignoring invalid {} '{}={}'", what, key, value),
    }
}

/// Reads a boolean option into `slot`, warning when invalid.
pub(crate) fn set_bool(slot: &mut bool, what: &str, key: &str, value: &str) {
    match parse_strict_bool(value) {
        Some(v) => *slot = v,
        None => sd_warn!("ignoring invalid {} '{}={}'", what, key, value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_trims() {
        let p = parse_key_value_args(Some(" a = 1 ; b=2,, bogus , c= x y "), "extra sample arg");
        assert_eq!(
            p,
            vec![
                ("a".to_string(), "1".to_string()),
                ("b".to_string(), "2".to_string()),
                ("c".to_string(), "x y".to_string())
            ]
        );
        assert!(parse_key_value_args(None, "x").is_empty());
        assert!(parse_key_value_args(Some(""), "x").is_empty());
        assert_eq!(parse_key_value_args(Some("k="), "x"), vec![("k".to_string(), String::new())]);
    }

    #[test]
    fn strict_numbers() {
        assert_eq!(parse_strict_float(" 1.5 "), Some(1.5));
        assert_eq!(parse_strict_float("-2e1"), Some(-20.0));
        assert_eq!(parse_strict_float(".5"), Some(0.5));
        assert_eq!(parse_strict_float("3."), Some(3.0));
        assert_eq!(parse_strict_float("1e"), None); // "e" left over
        assert_eq!(parse_strict_float("1.5x"), None);
        assert_eq!(parse_strict_float(""), None);
        assert_eq!(parse_strict_float("abc"), None);
        assert_eq!(parse_strict_float("1e50"), None);
        assert_eq!(parse_strict_float("1e-60"), None);
        assert_eq!(parse_strict_float("0e5"), Some(0.0));
        assert!(parse_strict_float("inf").unwrap().is_infinite());
        assert!(parse_strict_float("NaN").unwrap().is_nan());
        assert_eq!(parse_strict_int("42"), Some(42));
        assert_eq!(parse_strict_int(" -7 "), Some(-7));
        assert_eq!(parse_strict_int("4.2"), None);
        assert_eq!(parse_strict_int("0x10"), None);
        assert_eq!(parse_strict_int("99999999999"), None);
        assert_eq!(parse_strict_bool(" Yes "), Some(true));
        assert_eq!(parse_strict_bool("OFF"), Some(false));
        assert_eq!(parse_strict_bool("2"), None);
    }

    /// `fast` in `model_args` decides whatever SD_FAST says (the environment is only read
    /// without it, and is left alone here: tests share it).
    #[test]
    fn fast_path_from_model_args() {
        assert!(fast_path(Some("fast=1")));
        assert!(fast_path(Some("chroma_use_dit_mask=false, fast = On")));
        assert!(!fast_path(Some("fast=0")));
        assert!(!fast_path(Some("fast=1;fast=no")));
    }
}
