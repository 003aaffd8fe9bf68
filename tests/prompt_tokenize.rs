//! CLIP tokenization against ids produced by the reference's own tokenizer (run outside
//! this repository). Where noted, HF's CLIPTokenizer gives the same ids; it differs on
//! non-ASCII letters and non-ASCII whitespace, which the reference treats as punctuation.

use stable_diffusion::models::te::tokenizer::ClipTokenizer;

const CASES: &[(&str, &[u32])] = &[
    ("a photo of a cat", &[320, 1125, 539, 320, 2368]),
    ("A Photo Of A CAT, highly detailed!!!", &[320, 1125, 539, 320, 2368, 267, 5302, 12609, 995]),
    (
        "masterpiece, best quality, 1girl, solo, looking at viewer",
        &[12066, 267, 949, 3027, 267, 272, 1611, 267, 5797, 267, 1312, 536, 15061],
    ),
    ("  extra   whitespace\tand\nnewlines  ", &[4231, 4699, 2138, 537, 1218, 3418]),
    (
        "I'm sure it's what they'd've wanted, we'll see; you're OK? I've",
        &[328, 880, 1650, 585, 568, 768, 889, 1896, 1200, 3146, 267, 649, 1342, 862, 282, 592, 982, 2481, 286, 328, 1200],
    ),
    (
        "numbers 12345 and 3.14159 and 1,000,000",
        &[6121, 272, 273, 274, 275, 276, 537, 274, 269, 272, 275, 272, 276, 280, 537, 272, 267, 271, 271, 271, 267, 271, 271, 271],
    ),
    (
        "punctuation: (parens) [brackets] {braces} <angles> \"quotes\" ... --- ___ /slash\\ @#$%^&*",
        &[
            47051, 281, 263, 3106, 338, 264, 314, 36183, 316, 346, 19249, 348, 283, 18627, 285, 257, 5808, 257, 678, 11079,
            13530, 270, 19749, 315, 31, 2, 3, 4, 61, 5, 265,
        ],
    ),
    ("emoji \u{1f525}\u{1f680} test \u{1f44d}\u{1f3fd} done", &[16327, 3191, 13542, 1628, 43722, 1700]),
    // Not HF's ids: é, ï, ü, É are not letters here.
    (
        "unicode caf\u{e9} na\u{ef}ve Z\u{fc}rich \u{c9}COLE",
        &[7648, 19639, 20867, 4166, 1272, 127, 363, 563, 345, 47177, 4021, 127, 487, 8166],
    ),
    (
        "\u{65e5}\u{672c}\u{8a9e}\u{306e}\u{30c6}\u{30ad}\u{30b9}\u{30c8} and \u{4e2d}\u{6587}",
        &[39121, 44353, 34002, 252, 21575, 2429, 228, 47121, 32421, 486, 537, 19759, 255, 29032, 485],
    ),
    // Not HF's ids: no lower-casing of Greek capitals.
    (
        "\u{395}\u{3bb}\u{3bb}\u{3b7}\u{3bd}\u{3b9}\u{3ba}\u{3ac} \u{43a}\u{438}\u{440}\u{438}\u{43b}\u{43b}\u{438}\u{446}\u{430}",
        &[
            138, 243, 138, 119, 138, 119, 138, 115, 138, 121, 138, 117, 138, 118, 138, 361, 27152, 16701, 16370, 29503, 119,
            47611, 16701, 141, 228, 27080,
        ],
    ),
    ("<|startoftext|>hello<|endoftext|>world", &[49406, 3306, 49407, 1002]),
    (
        "supercalifragilisticexpialidocious antidisestablishmentarianism",
        &[1642, 2857, 13093, 2076, 5868, 26850, 835, 639, 38466, 3120, 4262, 7726, 12658, 1585, 44351],
    ),
    (
        "don't DON'T 'S 'tis o'clock rock'n'roll",
        &[847, 713, 847, 713, 568, 713, 533, 334, 262, 6716, 2172, 262, 333, 262, 3341],
    ),
    ("x", &[343]),
    ("", &[]),
    ("tab\tseparated\u{b}vertical\u{c}formfeed", &[14724, 22163, 14293, 1157, 5839]),
    // Not HF's ids: U+00A0 and U+3000 are not whitespace here.
    ("a\u{a0}nbsp and\u{3000}ideographic space", &[320, 126, 510, 6459, 4393, 537, 4092, 478, 1909, 78, 4245, 2138]),
    (
        "8k uhd, dslr, soft lighting, high quality, film grain, Fujifilm XT3",
        &[279, 330, 84, 4414, 267, 33740, 267, 3773, 5799, 267, 1400, 3027, 267, 1860, 12109, 267, 24765, 1052, 274],
    ),
];

#[test]
fn matches_reference_ids() {
    let tok = ClipTokenizer::shared().unwrap();
    for (prompt, expected) in CASES {
        assert_eq!(tok.encode(prompt), *expected, "prompt {prompt:?}");
        // The cache gives the same answer the second time.
        assert_eq!(tok.encode(prompt), *expected, "prompt {prompt:?} (cached)");
    }
}

#[test]
fn decode_round_trips_cleaned_text() {
    let tok = ClipTokenizer::shared().unwrap();
    let cases = [
        ("A Photo Of A CAT, highly detailed!!!", "a photo of a cat, highly detailed !!!"),
        ("emoji \u{1f525} caf\u{e9}", "emoji \u{1f525} caf \u{e9}"),
        ("I'm here", "i 'm here"),
    ];
    for (prompt, text) in cases {
        assert_eq!(tok.decode(&tok.encode(prompt)), text);
    }
    assert_eq!(tok.decode(&[49406, 320, 49408, 49407]), "a <|49408|>");
}
