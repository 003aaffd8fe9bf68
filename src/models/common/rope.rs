//! Rotary position embeddings of the diffusion transformers, as the reference's `Rope`
//! namespace computes them: integer position ids per token (text, image patches, reference
//! images), turned on the host into a table of 2×2 rotations (`[[cos, -sin], [sin, cos]]`
//! per frequency, f32 like the reference), applied to q and k in the graph before attention.

use crate::graph::{nn, Graph, T};

/// How reference images (Kontext, edit models) are numbered on the first id axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RefIndexMode {
    /// All references share index 1 and are placed side by side instead.
    #[default]
    Fixed,
    Increase,
    Decrease,
}

/// Position ids: `n_axes` numbers per token.
#[derive(Clone, Debug, PartialEq)]
pub struct Ids {
    pub n_axes: usize,
    pub data: Vec<f32>,
}

impl Ids {
    pub fn new(n_axes: usize) -> Ids {
        Ids { n_axes, data: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.data.len() / self.n_axes
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    fn push(&mut self, axes: &[f32]) {
        let mut row = vec![0.0; self.n_axes];
        row[..axes.len()].copy_from_slice(axes);
        self.data.extend(row);
    }

    fn extend(&mut self, other: &Ids) {
        self.data.extend_from_slice(&other.data);
    }

    fn axis(&self, a: usize) -> impl Iterator<Item = f32> + '_ {
        self.data.chunks(self.n_axes).map(move |r| r[a])
    }
}

/// Tokens per side of an image of `len` latent pixels cut into patches of `p`.
fn patches(len: usize, p: usize) -> usize {
    (len + p / 2) / p
}

/// Ids of an image's patch tokens, row by row: `[index, row, col]` with rows from `h_offset`
/// and columns from `w_offset` (`h`, `w` in latent pixels).
pub fn image_ids(n_axes: usize, h: usize, w: usize, p: usize, index: f32, h_offset: i64, w_offset: i64) -> Ids {
    let (h_len, w_len) = (patches(h, p), patches(w, p));
    let mut ids = Ids::new(n_axes);
    for i in 0..h_len {
        for j in 0..w_len {
            ids.push(&[index, (h_offset + i as i64) as f32, (w_offset + j as i64) as f32]);
        }
    }
    ids
}

/// [`image_ids`] with the rows and columns centred on 0 (Qwen-Image's `scale_rope`): they
/// start at `offset - len / 2`.
fn centred_image_ids(n_axes: usize, h: usize, w: usize, p: usize, index: f32, h_offset: i64, w_offset: i64) -> Ids {
    let (h_len, w_len) = (patches(h, p) as i64, patches(w, p) as i64);
    image_ids(n_axes, h, w, p, index, h_offset - h_len / 2, w_offset - w_len / 2)
}

/// Ids of reference images (`(h, w)` latent sizes): index `start_index` (changed per image
/// by `mode`, scaled by `index_scale`); with `Fixed` each image is placed after the previous
/// ones, down or to the right, whichever keeps the layout squarer.
pub fn reference_ids(n_axes: usize, p: usize, start_index: i32, refs: &[(usize, usize)], mode: RefIndexMode, index_scale: f32) -> Ids {
    placed_reference_ids(n_axes, p, start_index, refs, mode, index_scale, false, 0)
}

/// [`reference_ids`], each image's rows and columns centred on 0 when `centred` (Qwen-Image;
/// never with `Fixed`, whose placement needs the offsets) and moved by `base` (LongCat).
#[allow(clippy::too_many_arguments)]
fn placed_reference_ids(n_axes: usize, p: usize, start_index: i32, refs: &[(usize, usize)], mode: RefIndexMode, index_scale: f32, centred: bool, base: i64) -> Ids {
    let mut ids = Ids::new(n_axes);
    let (mut cur_h, mut cur_w) = (0i64, 0i64);
    let mut index = start_index;
    let centred = centred && mode != RefIndexMode::Fixed;
    for &(h, w) in refs {
        let (mut h_off, mut w_off) = (0, 0);
        match mode {
            RefIndexMode::Fixed => {
                if h as i64 + cur_h > w as i64 + cur_w {
                    w_off = cur_w;
                } else {
                    h_off = cur_h;
                }
            }
            RefIndexMode::Decrease => index -= 1,
            RefIndexMode::Increase => {}
        }
        let idx = (index as f32 * index_scale) as i32 as f32;
        let place = if centred { centred_image_ids } else { image_ids };
        ids.extend(&place(n_axes, h, w, p, idx, h_off + base, w_off + base));
        if mode == RefIndexMode::Increase {
            index += 1;
        }
        cur_h = cur_h.max(h as i64 + h_off);
        cur_w = cur_w.max(w as i64 + w_off);
    }
    ids
}

/// The text tokens of a Flux-style sequence: how many, and the axes on which they count up
/// (Flux.2 numbers them on its fourth axis; elsewhere their ids are all zero).
#[derive(Clone, Copy, Debug)]
pub struct TextIds<'a> {
    pub len: usize,
    pub arange_axes: &'a [usize],
    /// The images are numbered after the text (LongCat): the image at index 1 and the
    /// references from 2, their rows and columns starting at `len`.
    pub images_after: bool,
}

impl TextIds<'_> {
    /// `len` tokens with all-zero ids.
    pub fn zeros(len: usize) -> TextIds<'static> {
        TextIds { len, arange_axes: &[], images_after: false }
    }
}

/// Flux's ids: the text tokens, the image's patches, then the reference images'.
pub fn flux_ids(n_axes: usize, h: usize, w: usize, p: usize, text: TextIds<'_>, refs: &[(usize, usize)], mode: RefIndexMode, index_scale: f32) -> Ids {
    let mut ids = Ids::new(n_axes);
    for i in 0..text.len {
        let mut row = vec![0.0; n_axes];
        for &a in text.arange_axes.iter().filter(|&&a| a < n_axes) {
            row[a] = i as f32;
        }
        ids.push(&row);
    }
    let (index, offset) = if text.images_after { (1, text.len as i64) } else { (0, 0) };
    ids.extend(&image_ids(n_axes, h, w, p, index as f32, offset, offset));
    if !refs.is_empty() {
        ids.extend(&placed_reference_ids(n_axes, p, index + 1, refs, mode, index_scale, false, offset));
    }
    ids
}

/// Rotation angles → `[cos, -sin, sin, cos]` per position and frequency for one axis of
/// `dim` dimensions. A position with a wrap length > 0 uses the nearest frequency that is
/// periodic over it (seamless tiling).
fn axis_table(pos: &[f32], wrap: Option<&[usize]>, dim: usize, theta: f32) -> Vec<Vec<f32>> {
    let half = dim / 2;
    // linspace(0, (dim - 2) / dim, half) in f32, like the reference.
    let end = (dim as f32 - 2.0) / dim as f32;
    let step = if half > 1 { end / (half - 1) as f32 } else { 0.0 };
    let omega: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf(if half == 1 { 0.0 } else { i as f32 * step })).collect();
    pos.iter()
        .enumerate()
        .map(|(i, &p)| {
            let wrap_len = wrap.map_or(0, |w| w[i]);
            let mut row = Vec::with_capacity(half * 4);
            for &om in &omega {
                let angle = if wrap_len > 0 {
                    const TWO_PI: f32 = std::f32::consts::TAU;
                    let cycles = om * wrap_len as f32 / TWO_PI;
                    p * TWO_PI * cycles.round() / wrap_len as f32
                } else {
                    p * om
                };
                let (s, c) = (angle.sin(), angle.cos());
                row.extend_from_slice(&[c, -s, s, c]);
            }
            row
        })
        .collect()
}

/// The rotation table of `ids` (batch 1): per token, the axes' tables side by side,
/// `sum(axes_dim) / 2 · 4` values. `wrap[axis][token]` are optional wrap lengths.
pub fn embed_nd(ids: &Ids, theta: f32, axes_dim: &[usize], wrap: Option<&[Vec<usize>]>) -> Vec<f32> {
    let n = ids.len();
    let tables: Vec<Vec<Vec<f32>>> = axes_dim
        .iter()
        .enumerate()
        .map(|(a, &dim)| {
            let pos: Vec<f32> = ids.axis(a).collect();
            axis_table(&pos, wrap.and_then(|w| w.get(a)).map(|v| v.as_slice()), dim, theta)
        })
        .collect();
    let mut out = Vec::with_capacity(n * axes_dim.iter().sum::<usize>() * 2);
    for t in 0..n {
        for table in &tables {
            out.extend_from_slice(&table[t]);
        }
    }
    out
}

/// Flux's rotation table for a latent of `h`×`w` with the `text` tokens and the reference
/// latents `refs` (`(h, w)` each); on circular axes image tokens wrap around.
#[allow(clippy::too_many_arguments)]
pub fn flux_pe(
    h: usize,
    w: usize,
    p: usize,
    text: TextIds<'_>,
    refs: &[(usize, usize)],
    mode: RefIndexMode,
    index_scale: f32,
    theta: f32,
    axes_dim: &[usize],
    circular: (bool, bool),
) -> Vec<f32> {
    let context_len = text.len;
    let ids = flux_ids(axes_dim.len(), h, w, p, text, refs, mode, index_scale);
    let images: Vec<(usize, usize, usize)> = std::iter::once((h, w)).chain(refs.iter().copied()).map(|(h, w)| (h, w, 1)).collect();
    let wrap = image_wraps(ids.len(), axes_dim.len(), p, context_len, &images, circular);
    embed_nd(&ids, theta, axes_dim, wrap.as_deref())
}

/// Per-axis wrap lengths for seamless tiling (`None` when no axis is circular): the tokens
/// of each image `(h, w, frames)`, laid out one after the other from token `first`, wrap
/// their rows (axis 1) and columns (axis 2) around; all other tokens keep 0 (no wrap).
fn image_wraps(n_tokens: usize, n_axes: usize, p: usize, first: usize, images: &[(usize, usize, usize)], circular: (bool, bool)) -> Option<Vec<Vec<usize>>> {
    let (circ_x, circ_y) = circular;
    let &(h, w, _) = images.first()?;
    if !(circ_x || circ_y) || n_axes < 3 || patches(h, p) == 0 || patches(w, p) == 0 {
        return None;
    }
    let mut dims = vec![vec![0usize; n_tokens]; n_axes];
    let mut cursor = first;
    for &(h, w, frames) in images {
        let (h_len, w_len) = (patches(h, p), patches(w, p));
        let tokens = cursor..(cursor + h_len * w_len * frames).min(n_tokens);
        if circ_y {
            dims[1][tokens.clone()].fill(h_len);
        }
        if circ_x {
            dims[2][tokens.clone()].fill(w_len);
        }
        cursor = tokens.end;
    }
    Some(dims)
}

/// Tokens that pad `len` up to a multiple of `multiple`.
pub fn pad_to_multiple(len: usize, multiple: usize) -> usize {
    (multiple - len % multiple) % multiple
}

/// Z-Image's rotation table: `context_len` text tokens padded to a multiple of
/// `seq_multiple` (ids `[i + 1, 0, 0]`), then the image's patches at index
/// `padded_context_len + 1`, then `ref_tokens` reference-image tokens and the padding of
/// both, all with id 0: the reference gives reference images no positions of their own
/// (their tokens take the image padding's ids; where they outgrow it, it asserts and this
/// goes on with id 0). On circular axes the image tokens wrap around.
#[allow(clippy::too_many_arguments)]
pub fn zimage_pe(h: usize, w: usize, p: usize, context_len: usize, ref_tokens: usize, seq_multiple: usize, theta: f32, axes_dim: &[usize], circular: (bool, bool)) -> Vec<f32> {
    let n_axes = axes_dim.len();
    let padded_context = context_len + pad_to_multiple(context_len, seq_multiple);
    let mut ids = Ids::new(n_axes);
    for i in 0..padded_context {
        ids.push(&[(i + 1) as f32]);
    }
    let img = image_ids(n_axes, h, w, p, (padded_context + 1) as f32, 0, 0);
    let img_tokens = img.len() + ref_tokens;
    ids.extend(&img);
    for _ in 0..ref_tokens + pad_to_multiple(img_tokens, seq_multiple) {
        ids.push(&[]);
    }
    let wrap = image_wraps(ids.len(), n_axes, p, padded_context, &[(h, w, 1)], circular);
    embed_nd(&ids, theta, axes_dim, wrap.as_deref())
}

/// ERNIE-Image's rotation table for an `h`×`w` latent (patch `p`) and `context_len` text
/// tokens: the image's patches first (ids `[context_len, row, col]`), then the text
/// (`[i, 0, 0]`); on circular axes the image tokens wrap around. Laid out as two planes,
/// all cosines then all sines, `sum(axes_dim)` per token, each frequency filling two
/// neighbouring positions.
pub fn ernie_pe(h: usize, w: usize, p: usize, context_len: usize, theta: f32, axes_dim: &[usize], circular: (bool, bool)) -> Vec<f32> {
    let n_axes = axes_dim.len();
    let mut ids = image_ids(n_axes, h, w, p, context_len as f32, 0, 0);
    for i in 0..context_len {
        ids.push(&[i as f32]);
    }
    let wrap = image_wraps(ids.len(), n_axes, p, 0, &[(h, w, 1)], circular);
    let table = embed_nd(&ids, theta, axes_dim, wrap.as_deref());
    let freqs: usize = axes_dim.iter().sum::<usize>() / 2;
    let (mut cos, mut sin) = (Vec::with_capacity(ids.len() * freqs * 2), Vec::with_capacity(ids.len() * freqs * 2));
    for rotations in table.chunks(4) {
        // [[cos, -sin], [sin, cos]] per frequency.
        cos.extend([rotations[0]; 2]);
        sin.extend([rotations[2]; 2]);
    }
    cos.extend(sin);
    cos
}

/// Qwen-Image's ids: the `context_len` text tokens count up from `max(h_len, w_len) / 2` on
/// every axis, then the image's patches frame by frame (`[frame, row, col]`, rows and
/// columns centred on 0), then the reference latents (centred too, indexed from 1, or
/// from 0 downwards with `Decrease`).
pub fn qwen_image_ids(frames: usize, h: usize, w: usize, p: usize, context_len: usize, refs: &[(usize, usize)], mode: RefIndexMode) -> Ids {
    let n_axes = 3;
    let txt_start = patches(h, p).max(patches(w, p)) / 2;
    let mut ids = Ids::new(n_axes);
    for i in 0..context_len {
        let v = (txt_start + i) as f32;
        ids.push(&[v, v, v]);
    }
    for t in 0..frames {
        ids.extend(&centred_image_ids(n_axes, h, w, p, t as f32, 0, 0));
    }
    if !refs.is_empty() {
        let start = if mode == RefIndexMode::Decrease { 0 } else { 1 };
        ids.extend(&placed_reference_ids(n_axes, p, start, refs, mode, 1.0, true, 0));
    }
    ids
}

/// Qwen-Image's rotation table ([`qwen_image_ids`]); on circular axes the image's and the
/// references' tokens wrap around.
#[allow(clippy::too_many_arguments)]
pub fn qwen_image_pe(
    frames: usize,
    h: usize,
    w: usize,
    p: usize,
    context_len: usize,
    refs: &[(usize, usize)],
    mode: RefIndexMode,
    theta: f32,
    axes_dim: &[usize],
    circular: (bool, bool),
) -> Vec<f32> {
    let ids = qwen_image_ids(frames, h, w, p, context_len, refs, mode);
    let images: Vec<(usize, usize, usize)> = std::iter::once((h, w, frames)).chain(refs.iter().map(|&(h, w)| (h, w, 1))).collect();
    let wrap = image_wraps(ids.len(), axes_dim.len(), p, context_len, &images, circular);
    embed_nd(&ids, theta, axes_dim, wrap.as_deref())
}

/// Rotates `x` `[d_head, n_head, L, N]` by `pe` `[2, 2, d_head / 2, L]` (interleaved pairs)
/// → `[d_head, L, n_head · N]`, ready for attention.
pub fn apply_rope<'g>(g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
    rotate(g, x, pe, true)
}

/// [`apply_rope`] pairing element `i` with `i + d_head / 2` instead of its neighbour (the
/// reference's `rope_interleaved = false`, Qwen2.5-VL's vision tower).
pub fn apply_rope_halves<'g>(g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
    rotate(g, x, pe, false)
}

/// On the CPU one op of our own (`graph::rope_pairs`, the same values); elsewhere the
/// reference's composition.
fn rotate<'g>(g: &'g Graph, x: T<'g>, pe: T<'g>, interleaved: bool) -> T<'g> {
    crate::graph::rope_pairs::rotate(g, x, pe, interleaved).unwrap_or_else(|| rotate_by_ops(g, x, pe, interleaved))
}

/// The reference's composition: permuted copies, repeats, products and a sum.
fn rotate_by_ops<'g>(g: &'g Graph, x: T<'g>, pe: T<'g>, interleaved: bool) -> T<'g> {
    let [d_head, n_head, l, n] = x.ne();
    let x = x.permute(0, 2, 1, 3).cont();
    let x = if interleaved {
        x.reshape(&[2, d_head / 2, l, n_head * n]).permute(3, 0, 1, 2).cont()
    } else {
        x.reshape(&[d_head / 2, 2, l, n_head * n]).permute_axes([0, 2, 3, 1]).cont()
    };
    let half = |t: T<'g>, i: usize| {
        let ne = t.ne();
        let nb = t.nb();
        t.view(&[ne[0], ne[1], ne[2]], &[nb[1], nb[2]], nb[2] * ne[2] as usize * i)
    };
    let shape = g.new_tensor(x.ty(), &[2, d_head / 2, l, n_head * n]);
    let part = |i: usize| {
        let v = half(x, i);
        let ne = v.ne();
        v.reshape(&[1, ne[0], ne[1], ne[2]]).repeat(shape)
    };
    let (x0, x1) = (part(0), part(1));
    let pe = pe.permute(3, 0, 1, 2).cont();
    let (pe0, pe1) = (half(pe, 0), half(pe, 1));
    let out = x0.mul(pe0).add_inplace(x1.mul(pe1));
    let out = if interleaved { out } else { out.permute(1, 0, 2, 3).cont() };
    out.reshape(&[d_head, l, n_head * n])
}

/// Attention of q, k, v `[d_head, n_head, L, N]` with q and k rotated by `pe`:
/// `[n_head · d_head, L, N]`. `mask` is added to the scores.
pub fn attention<'g>(g: &'g Graph, q: T<'g>, k: T<'g>, v: T<'g>, pe: T<'g>, mask: Option<T<'g>>) -> T<'g> {
    attention_scaled(g, q, k, v, pe, mask, 1.0)
}

/// [`attention`] whose fused kernel sees K and V scaled by `kv_scale` (undone after it),
/// which keeps large activations within f16 (Z-Image uses 1/128).
pub fn attention_scaled<'g>(g: &'g Graph, q: T<'g>, k: T<'g>, v: T<'g>, pe: T<'g>, mask: Option<T<'g>>, kv_scale: f32) -> T<'g> {
    let n_head = q.ne()[1];
    let q = apply_rope(g, q, pe);
    let k = apply_rope(g, k, pe);
    nn::attention(g, q, k, v, n_head, mask, true, g.options.flash_attn, kv_scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU op gives the composition's values bit for bit: both pairings, a view of a
    /// larger tensor as `x` (strided, like q and k out of a fused projection), batch 2.
    #[test]
    fn the_rotation_op_is_the_composition() {
        use crate::graph::{Backend, Runner};
        let (d, h, l, n) = (16i64, 3i64, 5i64, 2i64);
        let xs: Vec<f32> = (0..d * 2 * h * l * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let pes: Vec<f32> = (0..4 * d / 2 * l).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
        let mut r = Runner::new(std::sync::Arc::new(Backend::cpu().unwrap()), 3);
        for interleaved in [true, false] {
            let out = r
                .compute_many(|g| {
                    let big = g.input_f32(&xs, &[d * 2, h, l, n]);
                    let nb = big.nb();
                    let x = big.view(&[d, h, l, n], &[nb[1], nb[2], nb[3]], 4 * d as usize);
                    let pe = g.input_f32(&pes, &[2, 2, d / 2, l]);
                    Ok(vec![rotate(g, x, pe, interleaved), rotate_by_ops(g, x, pe, interleaved)])
                })
                .unwrap();
            assert_eq!(out[0].shape(), out[1].shape());
            assert!(out[0].data().iter().map(|v| v.to_bits()).eq(out[1].data().iter().map(|v| v.to_bits())), "interleaved {interleaved}");
        }
    }

    #[test]
    fn flux_ids_place_text_image_and_references() {
        // 4x6 latent, patch 2: 2x3 image tokens after 2 text tokens; one 4x4 reference.
        let ids = flux_ids(3, 4, 6, 2, TextIds::zeros(2), &[(4, 4)], RefIndexMode::Fixed, 1.0);
        assert_eq!(ids.len(), 2 + 6 + 4);
        let row = |t: usize| ids.data[t * 3..t * 3 + 3].to_vec();
        assert_eq!(row(0), vec![0., 0., 0.]);
        assert_eq!(row(2), vec![0., 0., 0.]);
        assert_eq!(row(7), vec![0., 1., 2.]);
        assert_eq!(row(8), vec![1., 0., 0.]);
        assert_eq!(row(11), vec![1., 1., 1.]);
        // A second reference goes below the first (offsets in latent pixels).
        let r = reference_ids(3, 2, 1, &[(4, 4), (4, 4)], RefIndexMode::Fixed, 1.0);
        assert_eq!(&r.data[4 * 3..4 * 3 + 3], &[1., 4., 0.]);
        let r = reference_ids(3, 2, 1, &[(2, 2), (2, 2)], RefIndexMode::Increase, 1.0);
        assert_eq!(&r.data[3..6], &[2., 0., 0.]);
    }

    /// Flux.2: text tokens count up on the fourth axis; references get index 10, 20, … on
    /// the first (index × 10, increasing), images sit at 0 there.
    #[test]
    fn flux2_ids_number_text_on_the_last_axis() {
        let ids = flux_ids(4, 2, 2, 1, TextIds { len: 3, arange_axes: &[3], images_after: false }, &[(1, 1), (1, 1)], RefIndexMode::Increase, 10.0);
        assert_eq!(ids.len(), 3 + 4 + 2);
        let row = |t: usize| ids.data[t * 4..t * 4 + 4].to_vec();
        assert_eq!(row(2), vec![0., 0., 0., 2.]);
        assert_eq!(row(6), vec![0., 1., 1., 0.]);
        assert_eq!(row(7), vec![10., 0., 0., 0.]);
        assert_eq!(row(8), vec![20., 0., 0., 0.]);
    }

    /// LongCat: text tokens count up on axes 1 and 2; the image sits at index 1 with its rows
    /// and columns after the text's, a reference at index 2 likewise.
    #[test]
    fn longcat_ids_put_images_after_the_text() {
        let text = TextIds { len: 3, arange_axes: &[1, 2], images_after: true };
        let ids = flux_ids(3, 4, 4, 2, text, &[(2, 2)], RefIndexMode::Fixed, 1.0);
        assert_eq!(ids.len(), 3 + 4 + 1);
        let row = |t: usize| ids.data[t * 3..t * 3 + 3].to_vec();
        assert_eq!(row(2), vec![0., 2., 2.]);
        assert_eq!((row(3), row(6)), (vec![1., 3., 3.], vec![1., 4., 4.]));
        assert_eq!(row(7), vec![2., 3., 3.]);
    }

    /// Qwen-Image: text on the diagonal from max(h_len, w_len) / 2, image rows and columns
    /// centred on 0, references centred at index 1, 2, … (or 0, -1, … with `Decrease`).
    #[test]
    fn qwen_image_ids_centre_the_image() {
        // 4×6 latent, patch 2: 2×3 tokens; text from 3 / 2 = 1.
        let ids = qwen_image_ids(1, 4, 6, 2, 2, &[(2, 2), (4, 2)], RefIndexMode::Increase);
        assert_eq!(ids.len(), 2 + 6 + 1 + 2);
        let row = |t: usize| ids.data[t * 3..t * 3 + 3].to_vec();
        assert_eq!((row(0), row(1)), (vec![1., 1., 1.], vec![2., 2., 2.]));
        assert_eq!((row(2), row(4), row(7)), (vec![0., -1., -1.], vec![0., -1., 1.], vec![0., 0., 1.]));
        assert_eq!(row(8), vec![1., 0., 0.]);
        assert_eq!((row(9), row(10)), (vec![2., -1., 0.], vec![2., 0., 0.]));
        let down = qwen_image_ids(1, 4, 6, 2, 2, &[(2, 2)], RefIndexMode::Decrease);
        assert_eq!(&down.data[8 * 3..], &[-1., 0., 0.]);
        // Frames count up on the first axis.
        let video = qwen_image_ids(2, 2, 2, 2, 0, &[], RefIndexMode::Increase);
        assert_eq!(video.data, vec![0., 0., 0., 1., 0., 0.]);
        // Seamless tiling wraps the image and reference tokens, not the text.
        let axes = [16usize, 56, 56];
        let plain = qwen_image_pe(1, 4, 6, 2, 2, &[(2, 2)], RefIndexMode::Increase, 10000.0, &axes, (false, false));
        let circ = qwen_image_pe(1, 4, 6, 2, 2, &[(2, 2)], RefIndexMode::Increase, 10000.0, &axes, (true, true));
        let tok = 64 * 4;
        assert_eq!(&circ[..2 * tok], &plain[..2 * tok]);
        assert_ne!(&circ[2 * tok..3 * tok], &plain[2 * tok..3 * tok]);
    }

    #[test]
    fn rotation_table_layout() {
        let mut ids = Ids::new(2);
        ids.push(&[1.0, 2.0]);
        let pe = embed_nd(&ids, 10000.0, &[4, 2], None);
        // Axis 0 (dim 4): frequencies 1 and 10000^-0.5; axis 1 (dim 2): frequency 1.
        assert_eq!(pe.len(), (2 + 1) * 4);
        let f1 = 1.0f32 / 10000f32.powf(0.5);
        assert_eq!(&pe[0..4], &[1f32.cos(), -1f32.sin(), 1f32.sin(), 1f32.cos()]);
        assert_eq!(pe[4], f1.cos());
        assert_eq!(pe[8], 2f32.cos());
    }
}
