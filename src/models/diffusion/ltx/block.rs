//! LTX-2.3's attention and its joint audio-video transformer block.
//!
//! Every attention RMS-normalises its q and k over the whole inner width, may rotate them with
//! per-head tables, and with `to_gate_logits` scales each head's output by `2·sigmoid(gate)`.
//! A block runs, for video then audio: self-attention and text cross-attention (each
//! modulated by the stream's own timestep table, the text itself by the prompt table when the
//! model has `prompt_scale_shift_table`), then audio-to-video and video-to-audio attention
//! over time-only rotations, then each stream's feed-forward.

use crate::graph::nn::{self, Linear};
use crate::graph::{Graph, Scope, F32, T, W};
use crate::models::common::blocks::FeedForward;
use crate::models::common::dit::RmsNorm;

const EPS: f32 = 1e-6;

fn rms<'g>(x: T<'g>) -> T<'g> {
    x.rms_norm(EPS)
}

/// `x + x·scale + shift`, `shift` / `scale` `[C, 1, 1]`.
pub fn modulate<'g>(x: T<'g>, shift: T<'g>, scale: T<'g>) -> T<'g> {
    x.add(x.mul(scale)).add(shift)
}

/// A per-block (or output) table `[dim, rows]` plus the timesteps' projections
/// `[dim · rows, n]`: the `count` rows from `start`, each `[dim, 1, 1]` for one timestep or
/// `[dim, n]` for one per token. The sum takes the table's type.
pub fn table_rows<'g>(g: &'g Graph, table: T<'g>, projection: T<'g>, dim: i64, rows: i64, start: i64, count: i64) -> Vec<T<'g>> {
    let n = projection.ne()[1];
    let t = projection.reshape(&[dim, rows, n]);
    let s = table.reshape(&[dim, rows, 1]);
    let shape = g.new_tensor(projection.ty(), &[dim, rows, n]);
    let sum = s.repeat(shape).add(t.repeat(shape));
    let nb = sum.nb();
    let row = |r: i64| sum.view(&[dim, 1, n], &[nb[1], nb[2]], r as usize * nb[1]).cont();
    (start..start + count).map(|r| if n == 1 { row(r) } else { row(r).reshape(&[dim, n]) }).collect()
}

/// Rows `from..to` of a table `[dim, rows]`, dense.
pub fn table_slice<'g>(table: T<'g>, from: i64, to: i64) -> T<'g> {
    let [dim, _, _, _] = table.ne();
    let nb = table.nb();
    table.view(&[dim, to - from], &[nb[1]], from as usize * nb[1]).cont()
}

#[derive(Clone, Copy, Debug)]
pub struct Attention {
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    gate: Option<Linear>,
    to_out: Linear,
    heads: i64,
    head_dim: i64,
}

impl Attention {
    pub fn new(s: &mut Scope, query: i64, context: i64, heads: i64, head_dim: i64, gated: bool) -> Attention {
        let inner = heads * head_dim;
        Attention {
            q_norm: RmsNorm::new(s, "q_norm", "weight", inner, 1e-5, true),
            k_norm: RmsNorm::new(s, "k_norm", "weight", inner, 1e-5, true),
            to_q: Linear::new(s, "to_q", query, inner, true),
            to_k: Linear::new(s, "to_k", context, inner, true),
            to_v: Linear::new(s, "to_v", context, inner, true),
            gate: gated.then(|| Linear::new(s, "to_gate_logits", query, heads, true)),
            to_out: Linear::new(&mut s.sub("to_out"), "0", inner, query, true),
            heads,
            head_dim,
        }
    }

    /// `[inner, L, N]` rotated per head by `pe` `[2, 2, head_dim / 2, L · heads]`.
    fn rotate<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [inner, l, n, _] = x.ne();
        let flat = x.reshape(&[self.head_dim, 1, l * self.heads, n]);
        crate::models::common::rope::apply_rope_halves(g, flat, pe).reshape(&[inner, l, n])
    }

    /// `x` `[query, Lq, N]` attending to `context` (`x` itself when `None`); `pe` rotates the
    /// queries, `k_pe` the keys (`pe` when `None`).
    pub fn forward<'g>(&self, g: &'g Graph, x: T<'g>, context: Option<T<'g>>, pe: Option<T<'g>>, k_pe: Option<T<'g>>) -> T<'g> {
        let ctx = context.unwrap_or(x);
        let q = self.q_norm.forward(g, self.to_q.forward(g, x));
        let k = self.k_norm.forward(g, self.to_k.forward(g, ctx));
        let v = self.to_v.forward(g, ctx);
        let (q, k) = match pe {
            Some(pe) => (self.rotate(g, q, pe), self.rotate(g, k, k_pe.unwrap_or(pe))),
            None => (q, k),
        };
        let mut out = nn::attention(g, q, k, v, self.heads, None, false, g.options.flash_attn, 1.0);
        if let Some(gate) = self.gate {
            let logits = gate.forward(g, x);
            let [_, l, n, _] = logits.ne();
            let gates = logits.sigmoid().scale_inplace(2.0).reshape(&[1, self.heads, l, n]);
            let out4 = out.reshape(&[self.head_dim, self.heads, l, n]);
            out = out4.mul(gates.repeat(out4)).reshape(&[self.head_dim * self.heads, l, n]);
        }
        self.to_out.forward(g, out)
    }
}

/// The sizes one block needs.
#[derive(Clone, Copy, Debug)]
pub struct BlockDims {
    pub video: i64,
    pub audio: i64,
    pub video_heads: i64,
    pub audio_heads: i64,
    pub video_head_dim: i64,
    pub audio_head_dim: i64,
    pub video_context: i64,
    pub audio_context: i64,
    pub gated: bool,
    /// The text is modulated too (`prompt_scale_shift_table`); 9 timestep rows instead of 6.
    pub prompt_adaln: bool,
}

impl BlockDims {
    pub fn rows(&self) -> i64 {
        if self.prompt_adaln {
            9
        } else {
            6
        }
    }
}

/// One stream's modulation projections of a step.
#[derive(Clone, Copy)]
pub struct StreamTimes<'g> {
    /// The timestep projection `[dim · rows, 1]` and the prompt's `[dim · 2, 1]`.
    pub main: T<'g>,
    pub prompt: Option<T<'g>>,
    /// The cross-attention projections: scale/shift `[dim · 4, 1]`, gate `[dim, 1]`.
    pub cross_scale_shift: T<'g>,
    pub cross_gate: T<'g>,
}

/// One stream's inputs of a block.
#[derive(Clone, Copy)]
pub struct Stream<'g> {
    pub x: T<'g>,
    pub context: T<'g>,
    pub pe: T<'g>,
    pub cross_pe: T<'g>,
    pub times: StreamTimes<'g>,
}

#[derive(Clone, Copy, Debug)]
struct Tables {
    main: W,
    prompt: Option<W>,
    cross: W,
}

#[derive(Clone, Copy, Debug)]
pub struct AvBlock {
    dims: BlockDims,
    video: Tables,
    audio: Tables,
    attn1: Attention,
    audio_attn1: Attention,
    attn2: Attention,
    audio_attn2: Attention,
    audio_to_video: Attention,
    video_to_audio: Attention,
    ff: FeedForward,
    audio_ff: FeedForward,
}

impl AvBlock {
    pub fn new(s: &mut Scope, d: &BlockDims) -> AvBlock {
        let mut table = |name: &str, dim: i64, rows: i64| {
            let ty = s.file_type(name).unwrap_or(F32);
            s.tensor(name, ty, &[dim, rows])
        };
        let video = Tables {
            main: table("scale_shift_table", d.video, d.rows()),
            prompt: d.prompt_adaln.then(|| table("prompt_scale_shift_table", d.video, 2)),
            cross: table("scale_shift_table_a2v_ca_video", d.video, 5),
        };
        let audio = Tables {
            main: table("audio_scale_shift_table", d.audio, d.rows()),
            prompt: d.prompt_adaln.then(|| table("audio_prompt_scale_shift_table", d.audio, 2)),
            cross: table("scale_shift_table_a2v_ca_audio", d.audio, 5),
        };
        let (vh, ah, vd, ad) = (d.video_heads, d.audio_heads, d.video_head_dim, d.audio_head_dim);
        AvBlock {
            dims: *d,
            video,
            audio,
            attn1: Attention::new(&mut s.sub("attn1"), d.video, d.video, vh, vd, d.gated),
            audio_attn1: Attention::new(&mut s.sub("audio_attn1"), d.audio, d.audio, ah, ad, d.gated),
            attn2: Attention::new(&mut s.sub("attn2"), d.video, d.video_context, vh, vd, d.gated),
            audio_attn2: Attention::new(&mut s.sub("audio_attn2"), d.audio, d.audio_context, ah, ad, d.gated),
            audio_to_video: Attention::new(&mut s.sub("audio_to_video_attn"), d.video, d.audio, ah, ad, d.gated),
            video_to_audio: Attention::new(&mut s.sub("video_to_audio_attn"), d.audio, d.video, ah, ad, d.gated),
            ff: FeedForward::gelu(&mut s.sub("ff"), d.video, d.video, 4, 1.0),
            audio_ff: FeedForward::gelu(&mut s.sub("audio_ff"), d.audio, d.audio, 4, 1.0),
        }
    }

    /// Self-attention then text cross-attention of one stream.
    #[allow(clippy::too_many_arguments)]
    fn attend_self_and_text<'g>(&self, g: &'g Graph, st: &Stream<'g>, tables: &Tables, dim: i64, sa: &Attention, ca: &Attention) -> T<'g> {
        let rows = self.dims.rows();
        let table = g.param(tables.main);
        let m = table_rows(g, table, st.times.main, dim, rows, 0, rows);
        let h = modulate(rms(st.x), m[0], m[1]);
        let x = st.x.add(sa.forward(g, h, None, Some(st.pe), None).mul(m[2]));
        let text = if self.dims.prompt_adaln {
            let q = table_rows(g, table, st.times.main, dim, rows, 6, 3);
            let h = modulate(rms(x), q[0], q[1]);
            let context = match (tables.prompt, st.times.prompt) {
                (Some(pt), Some(pp)) => {
                    let p = table_rows(g, g.param(pt), pp, dim, 2, 0, 2);
                    modulate(st.context, p[0], p[1])
                }
                _ => st.context,
            };
            ca.forward(g, h, Some(context), None, None).mul(q[2])
        } else {
            ca.forward(g, rms(x), Some(st.context), None, None)
        };
        x.add(text)
    }

    /// The stream's feed-forward, modulated by rows 3..6.
    fn feed_forward<'g>(&self, g: &'g Graph, x: T<'g>, main: T<'g>, table: W, dim: i64, ff: &FeedForward) -> T<'g> {
        let m = table_rows(g, g.param(table), main, dim, self.dims.rows(), 3, 3);
        x.add(ff.forward(g, modulate(rms(x), m[0], m[1])).mul(m[2]))
    }

    /// (video, audio) after the block.
    pub fn forward<'g>(&self, g: &'g Graph, v: &Stream<'g>, a: &Stream<'g>) -> (T<'g>, T<'g>) {
        let (vd, ad) = (self.dims.video, self.dims.audio);
        let vx = self.attend_self_and_text(g, v, &self.video, vd, &self.attn1, &self.attn2);
        let ax = self.attend_self_and_text(g, a, &self.audio, ad, &self.audio_attn1, &self.audio_attn2);
        let (vn, an) = (rms(vx), rms(ax));
        let (vt, at) = (g.param(self.video.cross), g.param(self.audio.cross));
        let cross = |table: T<'g>, proj: T<'g>, dim: i64| table_rows(g, table_slice(table, 0, 4), proj, dim, 4, 0, 4);
        let gate = |table: T<'g>, proj: T<'g>, dim: i64| table_rows(g, table_slice(table, 4, 5), proj, dim, 1, 0, 1)[0];

        let (va, aa) = (cross(vt, v.times.cross_scale_shift, vd), cross(at, a.times.cross_scale_shift, ad));
        let a2v = self.audio_to_video.forward(g, modulate(vn, va[1], va[0]), Some(modulate(an, aa[1], aa[0])), Some(v.cross_pe), Some(a.cross_pe));
        let vx = vx.add(a2v.mul(gate(vt, v.times.cross_gate, vd)));

        let (va, aa) = (cross(vt, v.times.cross_scale_shift, vd), cross(at, a.times.cross_scale_shift, ad));
        let v2a = self.video_to_audio.forward(g, modulate(an, aa[3], aa[2]), Some(modulate(vn, va[3], va[2])), Some(a.cross_pe), Some(v.cross_pe));
        let ax = ax.add(v2a.mul(gate(at, a.times.cross_gate, ad)));

        let ax = self.feed_forward(g, ax, a.times.main, self.audio.main, ad, &self.audio_ff);
        let vx = self.feed_forward(g, vx, v.times.main, self.video.main, vd, &self.ff);
        (vx, ax)
    }
}
