//! MiniMax-H3's video VAE, like the reference's `minimax_h3_vae.hpp`.
//!
//! - Latents: 24 channels at 1/16 of the pixels, one latent frame per 4 frames in the
//!   decoder's patches; normalised per channel with the model's mean and std tables.
//! - The decoder is a transformer of fixed size: `post_quant_conv` (1×1×1), `x_embedder` to
//!   2048, 4 register tokens and one zero token after the latent's tokens, 36 blocks
//!   (RMS-normed attention of 32 heads of 64 with per-head RMS norms and a RoPE over
//!   (time, height, width) on 48 of the 64 dimensions, a SwiGLU MLP of 8192, both scaled per
//!   channel), a LayerNorm and `proj_out` to 16×16×4 RGB patches, then ImageNet's mean and
//!   std undone and clamped to [0, 1].
//! - Videos are decoded in chunks of 5 latent frames plus 2 of overlap (after the latent is
//!   padded with copies of its last frame), each tiled spatially in tiles of 16 latent pixels;
//!   the chunks' first 3 frames are dropped and 5 frames cross-fade into the next chunk.
//! - The encoder (`encoder.rs`, when the file has one) turns pictures (keyframes, reference
//!   pictures) and reference videos (in chunks of 17 frames) into latents, over the same
//!   forced tiles.

mod encoder;

use super::{per_channel, Progress};
use crate::error::{Error, Result};
use crate::graph::nn::{self, LayerNorm, Linear};
use crate::graph::{Graph, Loaded, Runner, Scope, F16, F32, T, W};
use crate::models::common::dit::{chunk, RmsNorm};
use crate::models::common::rope;
use crate::models::diffusion::minimax_h3::partial_rope;
use crate::runtime::tiling::{self, TileSpec, TilingParams};
use crate::tensor::Tensor;

/// Where the VAE's weights live (`vae_path` files get this prefix).
pub const PREFIX: &str = "first_stage_model.";
/// Pixels per latent pixel, latent channels, frames per latent frame in the decoder.
pub const SCALE: usize = 16;
pub const CHANNELS: usize = 24;
const PATCH_T: usize = 4;
/// Latent frames a decoder chunk adds to the video (17 frames; the first chunk's 5).
pub const CHUNK_LATENTS: usize = 5;
const DIM: i64 = 2048;
const HEADS: i64 = 32;
const HEAD_DIM: i64 = 64;
const LAYERS: usize = 36;
const REGISTERS: i64 = 4;

#[allow(clippy::excessive_precision)] // the reference's table as it prints it
pub const LATENT_MEAN: [f32; 24] = [
    0.858090341091156, -0.960659146308899, 1.066164016723633, -0.509032547473907, -0.272758185863495, -1.367541432380676, -0.255325496196747, -0.269075542688370,
    -0.537684082984924, -0.046409729868174, 0.665737032890320, 0.196901276707649, -0.546060800552368, -0.403534203767776, -0.236830249428749, 0.259284526109695,
    -0.301339447498322, 0.211341992020607, -1.120684862136841, 0.358193337917328, -0.042251437902451, 0.260482996702194, 0.228640928864479, 0.705603182315826,
];
#[allow(clippy::excessive_precision)] // the reference's table as it prints it
pub const LATENT_STD: [f32; 24] = [
    1.222377419471741, 1.276726365089417, 1.683177471160889, 1.754945516586304, 1.563621640205383, 2.194143533706665, 0.965313792228699, 1.056988596916199,
    0.841948926448822, 0.772995293140411, 1.895593762397766, 0.946841835975647, 0.799680948257446, 0.449889004230499, 0.719739973545075, 0.693629324436188,
    2.961095094680786, 2.769419908523560, 3.049618482589722, 2.108805418014527, 3.276226282119751, 3.162735700607300, 2.281681299209595, 2.612784385681153,
];
const PIXEL_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const PIXEL_STD: [f32; 3] = [0.229, 0.224, 0.225];

#[derive(Clone, Copy, Debug)]
struct Block {
    norm1: RmsNorm,
    to_qkv: Linear,
    to_out: Linear,
    norm2: RmsNorm,
    w1: Linear,
    w2: Linear,
    scale1: W,
    scale2: W,
}

impl Block {
    fn new(s: &mut Scope) -> Block {
        let mut attn = s.sub("attn");
        let (to_qkv, to_out) = (Linear::new(&mut attn, "to_qkv", DIM, 3 * DIM, true), Linear::new(&mut attn, "to_out", DIM, DIM, true));
        let mut ff = s.sub("ff");
        let (w1, w2) = (Linear::new(&mut ff, "w1", DIM, 8 * DIM, true), Linear::new(&mut ff, "w2", 4 * DIM, DIM, true));
        Block {
            norm1: RmsNorm::new(s, "norm1", "weight", DIM, 1e-5, true),
            to_qkv,
            to_out,
            norm2: RmsNorm::new(s, "norm2", "weight", DIM, 1e-5, true),
            w1,
            w2,
            scale1: s.tensor("scale1", F32, &[DIM]),
            scale2: s.tensor("scale2", F32, &[DIM]),
        }
    }

    fn attention<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let [_, l, n, _] = x.ne();
        let qkv = self.to_qkv.forward(g, x).reshape(&[3 * HEAD_DIM, HEADS, l, n]);
        let qkv = chunk(qkv, 3, 0, true);
        let shape = [HEAD_DIM, HEADS, l, n];
        let q = qkv[0].reshape(&shape).rms_norm(1e-5);
        let k = qkv[1].reshape(&shape).rms_norm(1e-5);
        let v = qkv[2].reshape(&shape);
        let (q, k) = (partial_rope(g, q, pe), partial_rope(g, k, pe));
        let out = nn::attention(g, q, k, v, HEADS, None, true, g.options.flash_attn, 1.0);
        self.to_out.forward(g, out)
    }

    fn forward<'g>(&self, g: &'g Graph, x: T<'g>, pe: T<'g>) -> T<'g> {
        let x = x.add(self.attention(g, self.norm1.forward(g, x), pe).mul(g.param(self.scale1)));
        let gate = chunk(self.w1.forward(g, self.norm2.forward(g, x)), 2, 0, true);
        let ff = self.w2.forward(g, gate[0].silu().mul(gate[1]));
        x.add(ff.mul(g.param(self.scale2)))
    }
}

/// MiniMax-H3's video VAE (its decoder) whose weights live in a `ParamStore`.
pub struct MinimaxH3Vae {
    post_quant_w: W,
    post_quant_b: W,
    x_embedder: Linear,
    blocks: Vec<Block>,
    norm_out: LayerNorm,
    proj_out: Linear,
    register_tokens: W,
    /// `None`: the file has no `encoder.` (decode only).
    encoder: Option<encoder::Encoder>,
}

impl MinimaxH3Vae {
    pub fn new(s: &mut Scope) -> MinimaxH3Vae {
        let mut pq = s.sub("post_quant_conv");
        let post_quant_w = pq.tensor("weight", F16, &[1, 1, 1, (CHANNELS * CHANNELS) as i64]);
        let post_quant_b = pq.tensor("bias", F32, &[CHANNELS as i64]);
        let mut d = s.sub("decoder");
        let x_embedder = Linear::new(&mut d, "x_embedder", CHANNELS as i64, DIM, true);
        let blocks = (0..LAYERS).map(|i| Block::new(&mut d.sub(&format!("transformer_blocks.{i}")))).collect();
        let norm_out = LayerNorm::new(&mut d, "norm_out", DIM, 1e-5, true, true);
        let proj_out = Linear::with_options(&mut d, "proj_out", DIM, (3 * PATCH_T * SCALE * SCALE) as i64, true, true);
        let register_tokens = d.tensor("register_tokens", F32, &[DIM, REGISTERS]);
        // Declared by the reference (and so needed in the file), never read.
        d.tensor("mask_token", F32, &[DIM]);
        let encoder = s.has("encoder.conv_in.weight").then(|| encoder::Encoder::new(s));
        MinimaxH3Vae { post_quant_w, post_quant_b, x_embedder, blocks, norm_out, proj_out, register_tokens, encoder }
    }

    /// VAE-space latent `[w, h, t, 24]` → patch rows `[3·4·16·16, w·h·t]` (tokens w fastest).
    fn forward<'g>(&self, g: &'g Graph, z: T<'g>, pe: T<'g>) -> T<'g> {
        let [w, h, t, _] = z.ne();
        let z = nn::conv_3d(g, z, g.param(self.post_quant_w), Some(g.param(self.post_quant_b)), CHANNELS as i64, [1; 3], [0; 3], [1; 3]);
        let z = z.permute(1, 2, 3, 0).cont().reshape(&[CHANNELS as i64, w * h * t, 1]);
        let x = self.x_embedder.forward(g, z);
        let patches = x.ne()[1];
        let x = x.concat(g.param(self.register_tokens), 1);
        let nb = x.nb();
        let zero = x.view(&[DIM, 1, 1, 1], &[nb[1], nb[2], nb[3]], 0).cont().scale(0.0);
        let mut x = x.concat(zero, 1);
        for b in &self.blocks {
            x = b.forward(g, x, pe);
        }
        let x = self.proj_out.forward(g, self.norm_out.forward(g, x));
        let nb = x.nb();
        x.view(&[x.ne()[0], patches, 1, 1], &[nb[1], nb[2], nb[3]], 0).cont()
    }

    /// The decoder's rotation table for a `w`×`h`×`t` latent (and the 5 extra tokens at 0).
    fn rope_table(w: usize, h: usize, t: usize) -> Vec<f32> {
        let two_pi = std::f32::consts::TAU;
        let mut data = Vec::with_capacity((w * h * t + 5) * 3);
        let at = |i: usize, n: usize| (2.0 * ((i as f32 + 0.5) / n as f32) - 1.0) * two_pi;
        for ti in 0..t {
            for hi in 0..h {
                for wi in 0..w {
                    data.extend_from_slice(&[at(ti, t), at(hi, h), at(wi, w)]);
                }
            }
        }
        data.extend(std::iter::repeat_n(0.0, 5 * 3));
        rope::embed_nd(&rope::Ids { n_axes: 3, data }, 100.0, &[16, 16, 16], None)
    }

    /// One VAE-space latent video `[w, h, t, 24, ..]` → pixels `[16w, 16h, 4t, 3]` in [0, 1].
    fn run(&self, runner: &mut Runner, z: &Tensor) -> Result<Tensor> {
        let (w, h, t) = (z.ne(0), z.ne(1), z.ne(2));
        ensure!(z.ne(3) == CHANNELS, "the MiniMax-H3 VAE decodes {CHANNELS}-channel latents, got {:?}", z.shape());
        let pe = Self::rope_table(w, h, t);
        let tokens = w * h * t;
        let rows = runner.compute(|g| {
            let x = g.input_f32(z.data(), &[w as i64, h as i64, t as i64, CHANNELS as i64]);
            let pe = g.input_f32(&pe, &[2, 2, 24, (tokens + 5) as i64]);
            Ok(self.forward(g, x, pe))
        })?;
        let rows = rows.data();
        let (ow, oh, ot) = (w * SCALE, h * SCALE, t * PATCH_T);
        let mut out = vec![0.0f32; ow * oh * ot * 3];
        let feat = 3 * PATCH_T * SCALE * SCALE;
        for ti in 0..t {
            for hi in 0..h {
                for wi in 0..w {
                    let token = (ti * h + hi) * w + wi;
                    for c in 0..3 {
                        for pt in 0..PATCH_T {
                            for ph in 0..SCALE {
                                for pw in 0..SCALE {
                                    let v = rows[token * feat + c * PATCH_T * SCALE * SCALE + (pt * SCALE + ph) * SCALE + pw];
                                    let (x, y, f) = (wi * SCALE + pw, hi * SCALE + ph, ti * PATCH_T + pt);
                                    out[((c * ot + f) * oh + y) * ow + x] = (v * PIXEL_STD[c] + PIXEL_MEAN[c]).clamp(0.0, 1.0);
                                }
                            }
                        }
                    }
                }
            }
        }
        Tensor::from_vec(&[ow, oh, ot, 3], out)
    }

    /// Pictures `[W, H, T, 3, ..]` in [0, 1] → VAE-space latent means `[W/16, H/16, t, 24]`;
    /// ImageNet's mean and std are taken out first, as the reference's graph does. Without
    /// Winograd: the keyframes condition every step, where rounding differences would spread.
    fn run_encoder(&self, runner: &mut Runner, pixels: &Tensor) -> Result<Tensor> {
        let Some(enc) = &self.encoder else { bail!("MiniMax-H3 VAE encode requires encoder weights (this file has no encoder.*)") };
        let (w, h, t) = (pixels.ne(0), pixels.ne(1), pixels.ne(2));
        ensure!(pixels.shape().len() >= 4 && pixels.ne(3) == 3, "the MiniMax-H3 VAE encodes RGB frames [W, H, T, 3], got {:?}", pixels.shape());
        let plane = w * h * t;
        let data: Vec<f32> = (0..3).flat_map(|c| pixels.data()[c * plane..(c + 1) * plane].iter().map(move |&v| (v - PIXEL_MEAN[c]) / PIXEL_STD[c])).collect();
        let winograd = runner.options.encoder_winograd();
        let out = runner.compute(|g| Ok(enc.forward(g, g.input_f32(&data, &[w as i64, h as i64, t as i64, 3]))));
        runner.options.cpu_winograd = winograd;
        out
    }
}

/// Frames `from..to` of a video `[W, H, T, C, ..]` as `[W, H, to - from, C]`.
fn frames(x: &Tensor, from: usize, to: usize) -> Result<Tensor> {
    let (w, h, t, c) = (x.ne(0), x.ne(1), x.ne(2), x.ne(3));
    ensure!(from < to && to <= t, "frames {from}..{to} of a {t}-frame video");
    let plane = w * h;
    let mut d = Vec::with_capacity(plane * (to - from) * c);
    for ch in 0..c {
        d.extend_from_slice(&x.data()[(ch * t + from) * plane..(ch * t + to) * plane]);
    }
    Tensor::from_vec(&[w, h, to - from, c], d)
}

/// `a` then `b` along the frames.
fn join_frames(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (w, h, ta, tb, c) = (a.ne(0), a.ne(1), a.ne(2), b.ne(2), a.ne(3));
    let plane = w * h;
    let mut d = Vec::with_capacity(a.len() + b.len());
    for ch in 0..c {
        d.extend_from_slice(&a.data()[ch * ta * plane..(ch + 1) * ta * plane]);
        d.extend_from_slice(&b.data()[ch * tb * plane..(ch + 1) * tb * plane]);
    }
    Tensor::from_vec(&[w, h, ta + tb, c], d)
}

/// `current` with its first `extent` frames faded in from the last ones of `previous`.
fn blend(previous: &Tensor, current: &Tensor, extent: usize) -> Tensor {
    let mut out = current.clone();
    let extent = extent.min(previous.ne(2)).min(current.ne(2));
    let (w, h, tc, tp, c) = (current.ne(0), current.ne(1), current.ne(2), previous.ne(2), current.ne(3));
    let plane = w * h;
    let start = tp - extent;
    for ch in 0..c {
        for t in 0..extent {
            let wb = t as f32 / extent as f32;
            let wa = 1.0 - wb;
            for i in 0..plane {
                let p = previous.data()[(ch * tp + start + t) * plane + i];
                let q = current.data()[(ch * tc + t) * plane + i];
                out.data_mut()[(ch * tc + t) * plane + i] = p * wa + q * wb;
            }
        }
    }
    out
}

/// The latent `[w, h, T, C, ..]` with its last frame repeated `n` more times.
fn repeat_last(x: &Tensor, n: usize) -> Result<Tensor> {
    let t = x.ne(2);
    let last = frames(x, t - 1, t)?;
    let mut out = frames(x, 0, t)?;
    for _ in 0..n {
        out = join_frames(&out, &last)?;
    }
    Ok(out)
}

impl Loaded<MinimaxH3Vae> {
    /// Frames `[W, H, T, 3, ..]` in [0, 1] → their VAE-space latent `[W/16, H/16, t, 24, 1]`,
    /// each encoding over the reference's forced tiles of 16 latent pixels. A picture gives the
    /// last latent frame of its encoding; a video is padded with copies of its last frame to
    /// whole chunks of 17 frames, each encoded alone (5 latent frames), and the last 3 latent
    /// frames are dropped, as the reference does.
    fn encode_frames(&mut self, video: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        const CHUNK: usize = 17;
        let (pw, ph, t) = (video.ne(0), video.ne(1), video.ne(2));
        ensure!(video.shape().len() >= 4 && video.ne(3) == 3 && t >= 1, "the MiniMax-H3 VAE encodes RGB frames [W, H, T, 3], got {:?}", video.shape());
        ensure!(pw % SCALE == 0 && ph % SCALE == 0, "the MiniMax-H3 VAE encodes sizes in multiples of {SCALE}, got {pw}x{ph}");
        let (w, h) = (pw / SCALE, ph / SCALE);
        ensure!(w >= 2 && h >= 2, "the MiniMax-H3 VAE encodes pictures of at least {0}x{0} pixels, got {pw}x{ph}", 2 * SCALE);
        let forced = TilingParams { enabled: true, tile_size_x: 16, tile_size_y: 16, target_overlap: 0.25, ..*tiling };
        let (tx, ty, overlap) = tiling::tile_sizes(&forced, w as i64, h as i64, 1.0);
        let spec = TileSpec { tile_size_x: tx, tile_size_y: ty, overlap, circular_x: circular.0, circular_y: circular.1 };
        let mut encode = |frames: &Tensor| -> Result<Tensor> {
            sd_debug!("VAE Tile size: {tx}x{ty}");
            let start = std::time::Instant::now();
            let (net, runner) = self.parts();
            let out = tiling::process_tiles(frames, w, h, SCALE, &spec, None, |t| {
                net.run_encoder(runner, t).map_err(|e| Error::new(format!("vae encode compute failed while processing a tile: {e}")))
            });
            runner.release();
            let out = out.map_err(|e| Error::new(format!("vae encode compute failed: {e}")))?;
            sd_debug!("computing vae encode graph completed, taking {:.2}s", start.elapsed().as_secs_f32());
            Ok(out)
        };
        let latent = if t == 1 {
            let out = encode(&frames(video, 0, 1)?)?;
            let n = out.ne(2);
            frames(&out, n - 1, n)?
        } else {
            let pad = (CHUNK - t % CHUNK) % CHUNK;
            let input = if pad > 0 { repeat_last(video, pad)? } else { frames(video, 0, t)? };
            let mut joined: Option<Tensor> = None;
            for start in (0..input.ne(2)).step_by(CHUNK) {
                let out = encode(&frames(&input, start, start + CHUNK)?)?;
                joined = Some(match joined {
                    Some(j) => join_frames(&j, &out)?,
                    None => out,
                });
            }
            let joined = joined.expect("at least one chunk");
            let n = joined.ne(2);
            if n > 3 {
                frames(&joined, 0, n - 3)?
            } else {
                joined
            }
        };
        let shape = [w, h, latent.ne(2), CHANNELS, 1];
        latent.reshape(&shape)
    }

    /// VAE-space latents `[w, h, T, 24]` → the video's frames, the reference's chunks.
    fn decode_chunks(&mut self, z: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        const TOKENS: usize = CHUNK_LATENTS;
        const DROP: usize = 3;
        const OVERLAP: usize = 2;
        const FRAMES: usize = 20;
        const PRE: usize = 3;
        const FADE: usize = 5;
        let latent_t = z.ne(2);
        let pseudo = latent_t + DROP;
        let mut pad = (TOKENS - pseudo % TOKENS) % TOKENS;
        let mut chunks = (pseudo + pad) / TOKENS - 1;
        if chunks < 1 {
            pad += TOKENS;
            chunks += 1;
        }
        let input = if pad > 0 { repeat_last(z, pad)? } else { frames(z, 0, latent_t)? };
        let forced = TilingParams { enabled: true, tile_size_x: 16, tile_size_y: 16, target_overlap: 0.25, ..*tiling };
        let (w, h) = (input.ne(0), input.ne(1));
        let (tx, ty, overlap) = tiling::tile_sizes(&forced, w as i64, h as i64, 1.0);
        let spec = TileSpec { tile_size_x: tx, tile_size_y: ty, overlap, circular_x: circular.0, circular_y: circular.1 };
        sd_debug!("VAE Tile size: {tx}x{ty}");
        let (net, runner) = self.parts();
        let mut result: Option<Tensor> = None;
        let mut carry: Option<Tensor> = None;
        for i in 0..chunks {
            let start = i * TOKENS;
            let end = (start + TOKENS + OVERLAP).min(input.ne(2));
            let chunk = frames(&input, start, end)?;
            let decoded = tiling::process_tiles(&chunk, w * SCALE, h * SCALE, SCALE, &spec, None, |t| {
                net.run(runner, t).map_err(|e| Error::new(format!("vae decode compute failed while processing a tile: {e}")))
            });
            runner.release();
            let decoded = decoded?;
            let n = decoded.ne(2);
            let first_end = FRAMES.min(n);
            let mut first = frames(&decoded, PRE.min(first_end), first_end)?;
            if let Some(prev) = carry.take() {
                first = blend(&prev, &first, FADE);
            }
            result = Some(match result {
                Some(r) => join_frames(&r, &first)?,
                None => first,
            });
            if n > FRAMES + PRE {
                carry = Some(frames(&decoded, FRAMES + PRE, n)?);
            }
            if i == chunks - 1 {
                if let Some(rest) = carry.take() {
                    result = Some(join_frames(result.as_ref().expect("a chunk"), &rest)?);
                }
            }
        }
        let result = result.ok_or_else(|| Error::new("no chunk decoded"))?;
        let expected = if input.ne(2) <= 1 { 1 } else { (latent_t.saturating_sub(2) / 5 * 17 + 5).max(1) };
        if result.ne(2) > expected {
            return frames(&result, 0, expected);
        }
        Ok(result)
    }
}

impl super::FirstStage for Loaded<MinimaxH3Vae> {
    /// Picture `[W, H, 3, 1]` → VAE-space latent `[W/16, H/16, 24, 1]`.
    fn encode(&mut self, image: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        let (w, h, c, n) = (image.ne(0), image.ne(1), image.ne(2), image.ne(3));
        ensure!(c == 3 && n == 1, "the MiniMax-H3 VAE encodes one RGB picture at a time, got {:?}", image.shape());
        let z = self.encode_frames(&Tensor::from_vec(&[w, h, 1, 3, 1], image.data().to_vec())?, tiling, circular)?;
        let shape = [z.ne(0), z.ne(1), CHANNELS, 1];
        z.reshape(&shape)
    }

    fn output_to_latents(&self, out: &Tensor, _randn: &mut dyn FnMut(usize) -> Vec<f32>) -> Result<Tensor> {
        Ok(out.clone())
    }

    fn vae_to_diffusion(&self, z: &Tensor) -> Tensor {
        per_channel(z, CHANNELS, |v, c| (v - LATENT_MEAN[c]) / LATENT_STD[c])
    }

    fn diffusion_to_vae(&self, z: &Tensor) -> Tensor {
        per_channel(z, CHANNELS, |v, c| v * LATENT_STD[c] + LATENT_MEAN[c])
    }

    fn decode(&mut self, _latents: &Tensor, _tiling: &TilingParams, _circular: (bool, bool), _progress: Progress<'_>) -> Result<Tensor> {
        bail!("the MiniMax-H3 VAE decodes videos (generate_video), not pictures")
    }

    /// A video `[W, H, T, 3, 1]` (a picture: T = 1) → its normalised latent `[W/16, H/16, t, 24, 1]`.
    fn encode_video(&mut self, frames: &Tensor, tiling: &TilingParams, circular: (bool, bool)) -> Result<Tensor> {
        let z = self.encode_frames(frames, tiling, circular)?;
        Ok(self.vae_to_diffusion(&z))
    }

    /// Diffusion latents `[w, h, t, C, 1]` (channels past the video's 24, the packed audio,
    /// are dropped) → video `[16w, 16h, T, 3, 1]` in [0, 1].
    fn decode_video(&mut self, latents: &Tensor, tiling: &TilingParams, circular: (bool, bool), _progress: Progress<'_>) -> Result<Tensor> {
        let s = latents.shape();
        ensure!(s.len() == 5 && s[4] == 1 && s[3] >= CHANNELS, "vae decode: expected a video latent [w, h, t, {CHANNELS}+, 1], got {s:?}");
        let video = frames(latents, 0, s[2])?;
        let video = Tensor::from_vec(&[s[0], s[1], s[2], CHANNELS, 1], video.data()[..s[0] * s[1] * s[2] * CHANNELS].to_vec())?;
        let z = self.diffusion_to_vae(&video);
        let start = std::time::Instant::now();
        let out = self.decode_chunks(&z, tiling, circular).map_err(|e| Error::new(format!("vae decode compute failed: {e}")))?;
        sd_debug!("computing vae decode graph completed, taking {:.2}s", start.elapsed().as_secs_f32());
        let shape = [out.ne(0), out.ne(1), out.ne(2), out.ne(3), 1];
        out.reshape(&shape)
    }
}
