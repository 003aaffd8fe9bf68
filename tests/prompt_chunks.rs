//! Weighted tokenization for the CLIP text encoders: chunking of long prompts, `BREAK`,
//! padding per model, and textual-inversion embeddings in the prompt. Token ids from the
//! reference's tokenizer ("a" 320, "cat" 2368, "dog" 1929, "photo" 1125, "in" 530,
//! "style" 1844).

use stable_diffusion::models::te::tokenizer::{ClipTokenizer, BOS_TOKEN, EOS_TOKEN, VOCAB_SIZE};
use stable_diffusion::pipeline::prompt::{
    apply_token_weights, tokenize_weighted, EmbeddingSet, PadOptions, CHUNK_LEN, SD1_PAD_TOKEN, SD2_PAD_TOKEN,
};
use stable_diffusion::tensor::Tensor;

fn tok() -> &'static ClipTokenizer {
    ClipTokenizer::shared().unwrap()
}

/// BOS, `body`, EOS, then `pad` up to 77.
fn chunk(body: &[u32], pad: u32) -> Vec<u32> {
    let mut c = vec![BOS_TOKEN];
    c.extend_from_slice(body);
    c.push(EOS_TOKEN);
    c.resize(CHUNK_LEN, pad);
    c
}

#[test]
fn short_prompt_is_one_padded_chunk() {
    let sd1 = tokenize_weighted(tok(), "a cat", &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    assert_eq!(sd1.tokens, chunk(&[320, 2368], EOS_TOKEN));
    assert!(sd1.weights.iter().all(|&w| w == 1.0));
    let sd2 = tokenize_weighted(tok(), "a cat", &(), &PadOptions::clip_chunks(SD2_PAD_TOKEN));
    assert_eq!(sd2.tokens, chunk(&[320, 2368], 0));
    let empty = tokenize_weighted(tok(), "", &(), &PadOptions::clip_chunks(SD2_PAD_TOKEN));
    assert_eq!(empty.tokens, chunk(&[], 0));
}

#[test]
fn long_prompt_is_split_every_75_tokens() {
    let prompt = vec!["a"; 80].join(" ");
    let t = tokenize_weighted(tok(), &prompt, &(), &PadOptions::clip_chunks(SD2_PAD_TOKEN));
    assert_eq!(t.chunk_count(CHUNK_LEN), 2);
    let chunks: Vec<_> = t.chunks(CHUNK_LEN).collect();
    assert_eq!(chunks[0].0, chunk(&[320; 75], 0).as_slice());
    assert_eq!(chunks[1].0, chunk(&[320; 5], 0).as_slice());

    let exactly = vec!["a"; 75].join(" ");
    let t = tokenize_weighted(tok(), &exactly, &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    assert_eq!(t.tokens, chunk(&[320; 75], EOS_TOKEN));
}

#[test]
fn weights_follow_tokens_across_chunks() {
    let prompt = format!("{} (a cat:1.5) [dog]", vec!["a"; 74].join(" "));
    let t = tokenize_weighted(tok(), &prompt, &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    let chunks: Vec<_> = t.chunks(CHUNK_LEN).collect();
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0].0[75], 320);
    assert_eq!(chunks[0].1[75], 1.5);
    assert_eq!(chunks[0].1[76], 1.0); // EOS
    assert_eq!(&chunks[1].0[..4], &[BOS_TOKEN, 2368, 1929, EOS_TOKEN]);
    assert_eq!(&chunks[1].1[..5], &[1.0, 1.5, 1.0f32 / 1.1, 1.0, 1.0]);
}

#[test]
fn break_fills_the_chunk_with_eos() {
    // SD2: BREAK fills with EOS although the padding token is 0.
    let t = tokenize_weighted(tok(), "a cat BREAK a dog", &(), &PadOptions::clip_chunks(SD2_PAD_TOKEN));
    let mut first = vec![320, 2368];
    first.resize(75, EOS_TOKEN);
    let mut expected = chunk(&first, 0);
    expected.extend(chunk(&[320, 1929], 0));
    assert_eq!(t.tokens, expected);

    // BREAK at the start, twice in a row, or at a chunk boundary adds nothing.
    let plain = tokenize_weighted(tok(), "a cat", &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    for prompt in ["BREAK a cat", "a cat BREAK", "a cat BREAK BREAK", "BREAK BREAK a cat"] {
        let t = tokenize_weighted(tok(), prompt, &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
        let expected = if prompt.starts_with("BREAK") {
            plain.tokens.clone()
        } else {
            let mut first = vec![320, 2368];
            first.resize(75, EOS_TOKEN);
            chunk(&first, EOS_TOKEN)
        };
        assert_eq!(t.tokens, expected, "{prompt}");
    }
    let full = format!("{} BREAK a", vec!["a"; 75].join(" "));
    let t = tokenize_weighted(tok(), &full, &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    assert_eq!(t.chunk_count(CHUNK_LEN), 2);
    assert_eq!(&t.tokens[77..80], &[BOS_TOKEN, 320, EOS_TOKEN]);
    // A weighted BREAK is just the word "break".
    let t = tokenize_weighted(tok(), "(BREAK)", &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    assert_eq!(t.tokens[1], tok().encode("break")[0]);
    assert_eq!(t.weights[1], -1.1);
}

#[test]
fn embeddings_become_custom_tokens() {
    let mut set = EmbeddingSet::new(&[768]);
    set.register("MyStyle", vec![Some(Tensor::zeros(&[768, 2]))]).unwrap();
    let opts = PadOptions::clip_chunks(SD1_PAD_TOKEN);
    let t = tokenize_weighted(tok(), "a photo in (MYSTYLE:1.2) style", &set, &opts);
    assert_eq!(&t.tokens[..8], &[BOS_TOKEN, 320, 1125, 530, VOCAB_SIZE, VOCAB_SIZE + 1, 1844, EOS_TOKEN]);
    assert_eq!(&t.weights[..8], &[1.0, 1.0, 1.0, 1.0, 1.2, 1.2, 1.0, 1.0]);
    // Matched inside words too, like the reference's special tokens.
    let t = tokenize_weighted(tok(), "a photo in mystyle style", &set, &opts);
    assert_eq!(&t.tokens[..7], &[BOS_TOKEN, 320, 1125, 530, VOCAB_SIZE, VOCAB_SIZE + 1, 1844]);
    let ids = tok().encode_with("xmystylex", &set);
    assert_eq!(ids, [&tok().encode("x")[..], &[VOCAB_SIZE, VOCAB_SIZE + 1], &tok().encode("x")[..]].concat());
    assert_eq!(set.custom_rows(0).unwrap().shape(), &[768, 2]);
}

#[test]
fn sdxl_embeddings_share_ids_and_pad_rows() {
    let mut set = EmbeddingSet::new(&[768, 1280]);
    let clip_l = Tensor::full(&[768, 1], 0.5);
    let clip_g = Tensor::full(&[1280, 2], 0.25);
    set.register_tensors("xl", &[clip_l, clip_g]).unwrap();
    let t = tokenize_weighted(tok(), "xl cat", &set, &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    assert_eq!(&t.tokens[..5], &[BOS_TOKEN, VOCAB_SIZE, VOCAB_SIZE + 1, 2368, EOS_TOKEN]);
    let l = set.custom_rows(0).unwrap();
    assert_eq!(l.shape(), &[768, 2]);
    assert!(l.data()[..768].iter().all(|&v| v == 0.5) && l.data()[768..].iter().all(|&v| v == 0.0));
    assert_eq!(set.custom_rows(1).unwrap().shape(), &[1280, 2]);
}

#[test]
fn reweighting_a_two_chunk_output() {
    let prompt = format!("{} (cat:2)", vec!["a"; 75].join(" "));
    let t = tokenize_weighted(tok(), &prompt, &(), &PadOptions::clip_chunks(SD1_PAD_TOKEN));
    let dim = 3;
    let mut hidden = Tensor::full(&[dim, t.tokens.len()], 1.0);
    hidden.data_mut()[dim * 77 + dim..dim * 77 + 2 * dim].copy_from_slice(&[2.0, 2.0, 2.0]);
    apply_token_weights(&mut hidden, &t.weights, CHUNK_LEN).unwrap();
    // First chunk: all weights 1, untouched.
    assert!(hidden.data()[..dim * 77].iter().all(|&v| v == 1.0));
    // Second chunk: "cat" ×2, then everything scaled back to the original mean.
    let second = &hidden.data()[dim * 77..];
    let mean: f64 = second.iter().map(|&v| v as f64).sum::<f64>() / second.len() as f64;
    assert!((mean - 78.0 / 77.0).abs() < 1e-6, "{mean}");
    assert!(second[dim] > second[0] * 3.9);
}
