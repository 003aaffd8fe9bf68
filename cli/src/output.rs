//! Output file names, as the reference names them.
//!
//! `-o out.png` with one image writes `out.png`; with several, `out_0.png`, `out_1.png` ...
//! (numbering from --output-begin-idx). A printf-style `%d` / `%03d` in the name numbers every
//! image instead. A name without a known image extension gets `.png` appended. A video
//! (`-M vid_gen`, several frames, no number field) is one AVI file.

use crate::image_io::{format_of, Format};
use std::path::Path;

/// A `%d`-style field in an output pattern: zero padding and width.
#[derive(Debug, PartialEq)]
enum Piece {
    Text(String),
    Number { zero: bool, width: usize },
}

/// Splits a name into text and `%[0-9]{0,3}d` fields; `%%` is a literal `%`.
fn pieces(pattern: &str) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut rest = pattern;
    while let Some(at) = rest.find('%') {
        text.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('%') {
            text.push('%');
            rest = tail;
            continue;
        }
        let digits = after.bytes().take(3).take_while(u8::is_ascii_digit).count();
        if after.as_bytes().get(digits) == Some(&b'd') {
            out.push(Piece::Text(std::mem::take(&mut text)));
            let spec = &after[..digits];
            out.push(Piece::Number { zero: spec.starts_with('0'), width: spec.parse().unwrap_or(0) });
            rest = &after[digits + 1..];
        } else {
            text.push('%');
            rest = after;
        }
    }
    text.push_str(rest);
    out.push(Piece::Text(text));
    out
}

/// True when `pattern` has a number field.
pub fn has_number_field(pattern: &str) -> bool {
    pieces(pattern).iter().any(|p| matches!(p, Piece::Number { .. }))
}

/// `pattern` with every number field replaced by `n`.
pub fn format_number(pattern: &str, n: i64) -> String {
    pieces(pattern)
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => t,
            Piece::Number { zero: true, width } => format!("{n:0width$}"),
            Piece::Number { zero: false, width } => format!("{n:width$}"),
        })
        .collect()
}

/// `output` without its extension when that is an image or video one, and the extension.
fn split_known_extension(output: &str) -> (&str, String) {
    let path = Path::new(output);
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    let known = format_of(path) != Format::Unknown || [".avi", ".webm"].contains(&ext.to_ascii_lowercase().as_str());
    let base = if known && !ext.is_empty() { &output[..output.len() - ext.len()] } else { output };
    (base, ext)
}

/// Where a video (several frames, no number field in the name) goes: `output` with its
/// extension when that is `.avi`, else with `.avi` in place of an image or video
/// extension, or added to any other name (`clip.mp4` -> `clip.mp4.avi`). The second value
/// is the video extension asked for that this sd-cli does not write (`.webm`, `.webp`:
/// the reference encodes VP8 there), whose file becomes an AVI instead.
pub fn video_path(output: &str) -> (String, Option<String>) {
    let (base, ext) = split_known_extension(output);
    match ext.to_ascii_lowercase().as_str() {
        ".avi" => (output.to_string(), None),
        ".webm" | ".webp" => (format!("{base}.avi"), Some(ext)),
        _ => (format!("{base}.avi"), None),
    }
}

/// The WAV file written beside the pictures of a video with sound: the output name with
/// `.wav` in place of an image or video extension.
pub fn audio_sidecar_path(output: &str) -> String {
    format!("{}.wav", split_known_extension(output).0)
}

/// The file names for `count` images written to `output`.
pub fn image_paths(output: &str, count: usize, begin_idx: i32) -> Vec<String> {
    let format = format_of(Path::new(output));
    let (base, ext) = split_known_extension(output);
    let ext = if format == Format::Unknown { ".png".to_string() } else { ext };
    let first = i64::from(begin_idx.max(0));
    if has_number_field(output) {
        let pattern = format!("{base}{ext}");
        return (0..count as i64).map(|i| format_number(&pattern, first + i)).collect();
    }
    if count == 1 {
        return vec![format!("{base}{ext}")];
    }
    (0..count as i64).map(|i| format!("{base}_{}{ext}", first + i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_names() {
        assert_eq!(image_paths("output.png", 1, -1), vec!["output.png"]);
        assert_eq!(image_paths("output.png", 3, -1), vec!["output_0.png", "output_1.png", "output_2.png"]);
        assert_eq!(image_paths("dir/x.PNG", 2, 5), vec!["dir/x_5.PNG", "dir/x_6.PNG"]);
        assert_eq!(image_paths("out", 1, -1), vec!["out.png"]);
        assert_eq!(image_paths("out.bmp", 1, -1), vec!["out.bmp.png"]);
        assert_eq!(image_paths("a.b/out", 2, 0), vec!["a.b/out_0.png", "a.b/out_1.png"]);
    }

    #[test]
    fn video_names() {
        assert_eq!(video_path("output.png"), ("output.avi".into(), None));
        assert_eq!(video_path("dir/v.AVI"), ("dir/v.AVI".into(), None));
        assert_eq!(video_path("clip.mp4"), ("clip.mp4.avi".into(), None));
        assert_eq!(video_path("noext"), ("noext.avi".into(), None));
        assert_eq!(video_path("x.jpeg"), ("x.avi".into(), None));
        assert_eq!(video_path("w.webm"), ("w.avi".into(), Some(".webm".into())));
        assert_eq!(video_path("a.b/p.WEBP"), ("a.b/p.avi".into(), Some(".WEBP".into())));
        assert_eq!(audio_sidecar_path("out.png"), "out.wav");
        assert_eq!(audio_sidecar_path("out.avi"), "out.wav");
        assert_eq!(audio_sidecar_path("out.mp4"), "out.mp4.wav");
        assert_eq!(audio_sidecar_path("f_%03d.png"), "f_%03d.wav");
    }

    #[test]
    fn numbered_patterns() {
        assert_eq!(image_paths("img_%03d.png", 2, -1), vec!["img_000.png", "img_001.png"]);
        assert_eq!(image_paths("img_%d", 2, 1), vec!["img_1.png", "img_2.png"]);
        assert_eq!(image_paths("f_%3d.png", 1, 7), vec!["f_  7.png"]);
        assert_eq!(image_paths("100%%_%d.png", 1, 0), vec!["100%_0.png"]);
        assert!(!has_number_field("100%%d.png"));
        assert!(!has_number_field("50%x.png"));
        assert!(has_number_field("%%%d"));
        assert_eq!(format_number("%%%d-%5x", 4), "%4-%5x");
    }
}
