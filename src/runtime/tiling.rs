//! Spatial tiling of VAE encode/decode (and other image-to-image networks): the input is
//! cut into overlapping tiles, each tile runs through a closure, and the results are
//! blended back with smootherstep weights.
//!
//! The grid, the tile placement and the blend weights follow the reference exactly
//! (`sd_tiling_calc_tiles`, `process_tiles_2d` and the VAE's tile-size defaults), because
//! tiled pictures are compared against it pixel by pixel.

use crate::error::Result;
use crate::tensor::Tensor;
use std::time::Instant;

/// `sd_tiling_params_t` without the video-only extra arguments.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TilingParams {
    pub enabled: bool,
    /// Video VAEs only; kept so the C struct round-trips.
    pub temporal_tiling: bool,
    /// Tile size in latent pixels; values below 4 mean "default" (32).
    pub tile_size_x: i32,
    pub tile_size_y: i32,
    /// Wanted overlap as a fraction of the tile, clamped to [0, 0.5].
    pub target_overlap: f32,
    /// When > 0, overrides `tile_size_*`: ≤ 1 is a fraction of the latent size, > 1 a
    /// number of tiles across.
    pub rel_size_x: f32,
    pub rel_size_y: f32,
    /// Encode tiles are this much larger than decode tiles: a fact of the model family
    /// (`FamilySpec::encode_tile_factor`), not of the request.
    pub encode_factor: f32,
    /// The temporal tiles of `temporal_tiling` where the VAE takes their size (the LTX VAE,
    /// from `extra_tiling_args`).
    pub temporal_tiles: TemporalTiles,
}

/// Temporal tiles of a video decode: latent frames per tile, and how many of them each tile
/// shares with the next (decoded twice, the first tile's copy dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemporalTiles {
    pub frames: i32,
    pub overlap: i32,
}

impl Default for TemporalTiles {
    /// The LTX VAE's defaults.
    fn default() -> Self {
        TemporalTiles { frames: 4, overlap: 1 }
    }
}

impl TemporalTiles {
    /// `temporal_tile_frames` / `temporal_tile_overlap` from `extra_tiling_args` (other keys
    /// and values that are not integers draw a warning, as the reference's LTX VAE gives).
    pub fn from_args(args: Option<&str>) -> TemporalTiles {
        let mut t = TemporalTiles::default();
        for (key, value) in crate::runtime::args::parse_key_value_args(args, "LTX VAE extra tiling arg") {
            match (key.as_str(), crate::runtime::args::parse_strict_int(&value)) {
                (_, None) => sd_warn!("ignoring invalid LTX VAE extra tiling arg '{key}={value}'"),
                ("temporal_tile_frames", Some(v)) => t.frames = v.max(1),
                ("temporal_tile_overlap", Some(v)) => t.overlap = v.max(0),
                _ => sd_warn!("ignoring unknown LTX VAE extra tiling arg '{key}'"),
            }
        }
        t
    }
}

impl Default for TilingParams {
    /// The C API's default (`sd_img_gen_params_init`).
    fn default() -> Self {
        TilingParams {
            enabled: false,
            temporal_tiling: false,
            tile_size_x: 0,
            tile_size_y: 0,
            target_overlap: 0.5,
            rel_size_x: 0.0,
            rel_size_y: 0.0,
            encode_factor: ENCODE_TILE_FACTOR,
            temporal_tiles: TemporalTiles::default(),
        }
    }
}

/// Encode tiles are this much larger than decode tiles for the image families (more context:
/// a 512² SD picture is one tile); the reference keeps smaller factors for its video families.
pub const ENCODE_TILE_FACTOR: f32 = 2.0;
/// The encode tile factor of Wan, HunyuanVideo and LTX-2.3 (whatever VAE they load).
pub const VIDEO_ENCODE_TILE_FACTOR: f32 = 1.30539;

const DEFAULT_TILE_SIZE: i32 = 32;
const MIN_TILE_SIZE: i32 = 4;

/// Tile sizes (latent pixels) and overlap for a latent of `latent_w`×`latent_h`.
///
/// `encoding_factor` scales the tile size before clamping: the reference uses 1 for decode
/// and 2 for image encode (encode is more sensitive to missing context, and 2 makes a
/// 512² SD image a single tile with the default 32).
#[allow(clippy::manual_clamp)]
pub fn tile_sizes(params: &TilingParams, latent_w: i64, latent_h: i64, encoding_factor: f32) -> (i32, i32, f32) {
    let overlap = params.target_overlap.clamp(0.0, 0.5);
    let size = |requested: i32, rel: f32, latent: i64| -> i32 {
        let mut tile = DEFAULT_TILE_SIZE;
        let mut factor = rel;
        if factor > 0.0 {
            if factor > 1.0 {
                factor = 1.0 / (factor - factor * overlap + overlap);
            }
            tile = (latent as f32 * factor).round() as i32;
        } else if requested >= MIN_TILE_SIZE {
            tile = requested;
        }
        tile = (tile as f32 * encoding_factor) as i32;
        // Not `clamp`: a latent smaller than the minimum still gets the minimum.
        tile.min(latent.clamp(0, i32::MAX as i64) as i32).max(MIN_TILE_SIZE)
    };
    (
        size(params.tile_size_x, params.rel_size_x, latent_w),
        size(params.tile_size_y, params.rel_size_y, latent_h),
        overlap,
    )
}

/// Tiling to retry a decode that failed (e.g. out of memory) without tiling: tiles of half
/// the latent size (at least the minimum), so each graph needs about a quarter of the
/// memory. `None` when tiling was already on — then there is nothing smaller to try here.
///
/// The reference at 97d29908 (with `auto_fit`) only switches tiling on with 256-pixel
/// tiles, which its clamp turns into one full-size tile; halving is the newer behaviour.
pub fn retry_tiling(params: &TilingParams, latent_w: i64, latent_h: i64) -> Option<TilingParams> {
    if params.enabled {
        return None;
    }
    let half = |latent: i64| ((latent / 2).clamp(0, i32::MAX as i64) as i32).max(MIN_TILE_SIZE);
    Some(TilingParams {
        enabled: true,
        tile_size_x: half(latent_w),
        tile_size_y: half(latent_h),
        rel_size_x: 0.0,
        rel_size_y: 0.0,
        ..*params
    })
}

/// How circular padding reaches an image autoencoder, per axis: by its convolutions
/// padding (`conv`) or by tiles that wrap around the edges (`tiles`), never both. Untiled,
/// the convolutions wrap; tiled, an axis that one decode tile covers wraps in the
/// convolutions, and an axis cut into several tiles wraps by its tiles alone (the tiles then
/// pad as usual), as the reference decides it from the decode tile size of the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VaeCircular {
    pub conv: (bool, bool),
    pub tiles: (bool, bool),
}

pub fn vae_circular(params: &TilingParams, circular: (bool, bool), latent_w: i64, latent_h: i64) -> VaeCircular {
    if !params.enabled {
        return VaeCircular { conv: circular, tiles: circular };
    }
    let (tx, ty, _) = tile_sizes(params, latent_w, latent_h, 1.0);
    let one_x = i64::from(tx) >= latent_w;
    let one_y = i64::from(ty) >= latent_h;
    VaeCircular {
        conv: (circular.0 && one_x, circular.1 && one_y),
        tiles: (circular.0 && !one_x, circular.1 && !one_y),
    }
}

/// Number of tiles along one axis and the overlap factor actually used
/// (`sd_tiling_calc_tiles`). `small` is the latent-side size of the axis.
pub fn calc_tiles(small: i32, tile_size: i32, overlap_factor: f32, circular: bool) -> (i32, f32) {
    let overlap = (tile_size as f32 * overlap_factor) as i32;
    let step = tile_size - overlap;
    if step <= 0 || small <= 0 {
        return (1, 0.0);
    }
    if circular {
        // The last tile wraps around onto the first.
        let n = (small / step).max(1);
        let factor = (tile_size - small / n) as f32 / tile_size as f32;
        if n == 1 && factor > 0.0 {
            return (2, 0.5);
        }
        return (n, factor);
    }
    let mut n = (small - overlap) / step;
    let overshoot = ((n + 1) * step + overlap) % small;
    if overshoot != step && overshoot <= n * (tile_size / 2 - overlap) {
        // Squeeze in one more tile when that keeps the overlap at most one half.
        n += 1;
    }
    let factor = (tile_size * n - small) as f32 / (tile_size * (n - 1)) as f32;
    if n <= 2 {
        if small <= tile_size {
            return (1, 0.0);
        }
        return (2, (2 * tile_size - small) as f32 / tile_size as f32);
    }
    (n, factor)
}

/// How a tensor is cut into tiles (sizes in latent pixels).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TileSpec {
    pub tile_size_x: i32,
    pub tile_size_y: i32,
    /// Target overlap fraction (see `calc_tiles`).
    pub overlap: f32,
    /// Tiles wrap around the edges (seamless pictures).
    pub circular_x: bool,
    pub circular_y: bool,
}

/// One placed tile, in latent pixels (the side with the smaller resolution).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TilePos {
    pub x: i32,
    pub y: i32,
    /// Columns/rows at the start of this tile that an earlier tile already covers fully
    /// (the last tile of a row/column is moved back to end at the border).
    pub skip_x: i32,
    pub skip_y: i32,
}

/// The tile grid of `process_tiles`: tile positions in processing order, the clamped tile
/// size and the overlaps (latent pixels).
#[derive(Clone, Debug, PartialEq)]
pub struct TileGrid {
    pub num_x: i32,
    pub num_y: i32,
    pub factor_x: f32,
    pub factor_y: f32,
    pub tile_w: i32,
    pub tile_h: i32,
    pub overlap_x: i32,
    pub overlap_y: i32,
    pub tiles: Vec<TilePos>,
}

impl TileGrid {
    pub fn new(small_w: i32, small_h: i32, spec: &TileSpec) -> Result<TileGrid> {
        ensure!(small_w > 0 && small_h > 0, "cannot tile an empty {small_w}x{small_h} tensor");
        ensure!(
            spec.tile_size_x > 0 && spec.tile_size_y > 0,
            "invalid tile size {}x{}",
            spec.tile_size_x,
            spec.tile_size_y
        );
        let (num_x, factor_x) = calc_tiles(small_w, spec.tile_size_x, spec.overlap, spec.circular_x);
        let (num_y, factor_y) = calc_tiles(small_h, spec.tile_size_y, spec.overlap, spec.circular_y);
        let overlap_x = (spec.tile_size_x as f32 * factor_x) as i32;
        let overlap_y = (spec.tile_size_y as f32 * factor_y) as i32;
        let step_x = spec.tile_size_x - overlap_x;
        let step_y = spec.tile_size_y - overlap_y;
        ensure!(step_x > 0 && step_y > 0, "tile overlap {} leaves no progress between tiles", spec.overlap);
        let tile_w = spec.tile_size_x.min(small_w);
        let tile_h = spec.tile_size_y.min(small_h);

        let xs = axis_positions(small_w, tile_w, step_x, spec.circular_x);
        let ys = axis_positions(small_h, tile_h, step_y, spec.circular_y);
        let tiles = ys
            .iter()
            .flat_map(|&(y, skip_y)| xs.iter().map(move |&(x, skip_x)| TilePos { x, y, skip_x, skip_y }))
            .collect();
        Ok(TileGrid { num_x, num_y, factor_x, factor_y, tile_w, tile_h, overlap_x, overlap_y, tiles })
    }
}

/// Tile starts along one axis with the part each repeats of its predecessor: tiles advance
/// by `step`; without wrap-around the last one is moved back to end at the border.
fn axis_positions(small: i32, tile: i32, step: i32, circular: bool) -> Vec<(i32, i32)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < small {
        if !circular && pos + tile >= small {
            let moved = small - tile;
            out.push((moved, pos - moved));
            break;
        }
        out.push((pos, 0));
        pos += step;
    }
    out
}

/// Runs `f` on tiles of `input` ([W, H, C, N]) and blends the outputs into a tensor of
/// `output_w`×`output_h` (`process_tiles_2d`). One side is `scale` times the other: decode
/// when the output is larger, encode otherwise; tile sizes are in units of the smaller
/// side. `progress(step, steps, seconds_per_tile)` reports like the reference's progress bar.
pub fn process_tiles(
    input: &Tensor,
    output_w: usize,
    output_h: usize,
    scale: usize,
    spec: &TileSpec,
    mut progress: Option<&mut dyn FnMut(i32, i32, f32)>,
    mut f: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (in_w, in_h) = (input.ne(0), input.ne(1));
    ensure!(input.shape().len() >= 2 && !input.is_empty(), "cannot tile a tensor of shape {:?}", input.shape());
    ensure!(scale >= 1 && output_w > 0 && output_h > 0, "invalid tiling output {output_w}x{output_h} (scale {scale})");
    let decode = output_w > in_w;
    let (small_w, small_h) = if decode { (in_w, in_h) } else { (output_w, output_h) };
    let (big_w, big_h) = if decode { (output_w, output_h) } else { (in_w, in_h) };
    ensure!(
        big_w == small_w * scale && big_h == small_h * scale,
        "tiling: {in_w}x{in_h} → {output_w}x{output_h} is not a ×{scale} scaling"
    );
    ensure!(small_w <= i32::MAX as usize / scale && small_h <= i32::MAX as usize / scale, "tiling: tensor too large");
    let grid = TileGrid::new(small_w as i32, small_h as i32, spec)?;
    let s = scale as i32;
    let (in_tw, in_th, out_tw, out_th) = if decode {
        (grid.tile_w, grid.tile_h, grid.tile_w * s, grid.tile_h * s)
    } else {
        (grid.tile_w * s, grid.tile_h * s, grid.tile_w, grid.tile_h)
    };
    let big = |v: i32| if decode { v * s } else { v };
    let (in_scale, out_scale) = if decode { (1, s) } else { (s, 1) };

    let num_tiles = grid.num_x * grid.num_y;
    sd_debug!("num tiles : {}, {} ", grid.num_x, grid.num_y);
    sd_debug!("optimal overlap : {:.6}, {:.6} (targeting {:.6})", grid.factor_x, grid.factor_y, spec.overlap);
    sd_debug!("processing {} tiles", num_tiles);
    if let Some(p) = progress.as_mut() {
        p(0, num_tiles, 0.0);
    }

    let mut output: Option<Tensor> = None;
    let mut last_time = 0.0f32;
    let mut tile_count = 1;
    for t in &grid.tiles {
        let start = Instant::now();
        let tile = split_2d(input, in_tw as usize, in_th as usize, (t.x * in_scale) as usize, (t.y * in_scale) as usize);
        let out_tile = f(&tile)?;
        ensure!(
            out_tile.ne(0) == out_tw as usize && out_tile.ne(1) == out_th as usize,
            "tile output is {}x{}, expected {out_tw}x{out_th}",
            out_tile.ne(0),
            out_tile.ne(1)
        );
        let out = output.get_or_insert_with(|| {
            let mut shape = out_tile.shape().to_vec();
            shape[0] = output_w;
            shape[1] = output_h;
            Tensor::zeros(&shape)
        });
        let place = Blend {
            x: t.x * out_scale,
            y: t.y * out_scale,
            overlap_x: big(grid.overlap_x),
            overlap_y: big(grid.overlap_y),
            circular_x: spec.circular_x,
            circular_y: spec.circular_y,
            skip_x: big(t.skip_x),
            skip_y: big(t.skip_y),
        };
        merge_2d(&out_tile, out, &place)?;
        last_time = start.elapsed().as_secs_f32();
        if let Some(p) = progress.as_mut() {
            p(tile_count, num_tiles, last_time);
        }
        tile_count += 1;
    }
    if tile_count < num_tiles {
        if let Some(p) = progress.as_mut() {
            p(num_tiles, num_tiles, last_time);
        }
    }
    output.ok_or_else(|| crate::error::Error::new("tiling produced no tile"))
}

/// A `w`×`h` window of `t` at (`x`, `y`), wrapping around the edges, all planes.
pub fn split_2d(t: &Tensor, w: usize, h: usize, x: usize, y: usize) -> Tensor {
    let (iw, ih) = (t.ne(0), t.ne(1));
    let planes = t.len() / (iw * ih);
    let mut shape = t.shape().to_vec();
    shape[0] = w;
    shape[1] = h;
    let mut out = Tensor::zeros(&shape);
    let src = t.data();
    let dst = out.data_mut();
    for p in 0..planes {
        for oy in 0..h {
            let row = ((oy + y) % ih) * iw + p * iw * ih;
            for ox in 0..w {
                dst[p * w * h + oy * w + ox] = src[row + (ox + x) % iw];
            }
        }
    }
    out
}

/// Where a tile goes and how it fades in (output pixels).
struct Blend {
    x: i32,
    y: i32,
    overlap_x: i32,
    overlap_y: i32,
    circular_x: bool,
    circular_y: bool,
    skip_x: i32,
    skip_y: i32,
}

/// `std::min` semantics (the first argument wins unless the second is smaller), so NaN
/// weights behave like the reference's.
fn cmin(a: f32, b: f32) -> f32 {
    if b < a {
        b
    } else {
        a
    }
}

fn smootherstep(v: f32) -> Result<f32> {
    ensure!((0.0..=1.0).contains(&v), "tile blend weight {v} out of range (tile overlap of 0 on a circular axis?)");
    Ok(v * v * v * (v * (6.0 * v - 15.0) + 10.0))
}

/// Accumulates `tile` into `out`: weights ramp over the overlap on every side that has a
/// neighbour (every side on circular axes); without overlap the tile is copied.
fn merge_2d(tile: &Tensor, out: &mut Tensor, b: &Blend) -> Result<()> {
    let (w, h) = (tile.ne(0) as i32, tile.ne(1) as i32);
    let (img_w, img_h) = (Tensor::ne(out, 0) as i32, Tensor::ne(out, 1) as i32);
    let planes = tile.len() / (w * h) as usize;
    ensure!(out.len() / (img_w * img_h) as usize == planes, "tile and output have different channel counts");
    let blend = b.overlap_x > 0 || b.overlap_y > 0;
    let ramp_left = b.circular_x || (b.overlap_x > 0 && b.x > 0);
    let ramp_right = b.circular_x || (b.overlap_x > 0 && b.x < img_w - w);
    let ramp_top = b.circular_y || (b.overlap_y > 0 && b.y > 0);
    let ramp_bottom = b.circular_y || (b.overlap_y > 0 && b.y < img_h - h);
    let (ow, oh) = (b.overlap_x as f32, b.overlap_y as f32);
    let src = tile.data();
    let (tile_plane, out_plane) = ((w * h) as usize, (img_w * img_h) as usize);
    let dst = out.data_mut();
    for iy in b.skip_y..h {
        let oy = (b.y + iy) % img_h;
        let y_f = if blend {
            let f0 = if ramp_top { (iy - b.skip_y) as f32 / oh } else { 1.0 };
            let f1 = if ramp_bottom { (h - iy) as f32 / oh } else { 1.0 };
            smootherstep(cmin(cmin(f0, f1), 1.0))?
        } else {
            1.0
        };
        for ix in b.skip_x..w {
            let ox = (b.x + ix) % img_w;
            let s = (ix + w * iy) as usize;
            let d = (ox + img_w * oy) as usize;
            if blend {
                let f0 = if ramp_left { (ix - b.skip_x) as f32 / ow } else { 1.0 };
                let f1 = if ramp_right { (w - ix) as f32 / ow } else { 1.0 };
                let x_f = smootherstep(cmin(cmin(f0, f1), 1.0))?;
                for p in 0..planes {
                    // Same evaluation order as the reference: (value * wy) * wx.
                    dst[p * out_plane + d] += src[p * tile_plane + s] * y_f * x_f;
                }
            } else {
                for p in 0..planes {
                    dst[p * out_plane + d] = src[p * tile_plane + s];
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `extra_tiling_args` as the reference's LTX VAE reads it: its two keys, at least one
    /// frame and no negative overlap; others ignored (with a warning).
    #[test]
    fn temporal_tiles_come_from_the_extra_args() {
        assert_eq!(TemporalTiles::from_args(None), TemporalTiles { frames: 4, overlap: 1 });
        assert_eq!(TemporalTiles::from_args(Some("temporal_tile_frames=2,temporal_tile_overlap=0")), TemporalTiles { frames: 2, overlap: 0 });
        let odd = TemporalTiles::from_args(Some("temporal_tile_frames=0;temporal_tile_overlap=-3;tile_frames=9;temporal_tile_overlap=x"));
        assert_eq!(odd, TemporalTiles { frames: 1, overlap: 0 });
    }

    /// Cases computed by the reference's own code (see the file's header).
    const CASES: &str = include_str!("../../tests/fixtures/tiling/reference_cases.txt");

    fn lines(kind: &str) -> impl Iterator<Item = Vec<&'static str>> + '_ {
        CASES
            .lines()
            .filter(move |l| l.split_whitespace().next() == Some(kind))
            .map(|l| l.split_whitespace().skip(1).filter(|t| *t != "->" && *t != ":").collect())
    }

    #[test]
    fn circular_goes_to_the_convolutions_or_to_the_tiles() {
        let off = TilingParams::default();
        assert_eq!(vae_circular(&off, (true, false), 16, 16), VaeCircular { conv: (true, false), tiles: (true, false) });
        // Tiles of 8 on a 16 x 8 latent: x is cut (the tiles wrap), y is one tile (the convolutions wrap).
        let tiled = TilingParams { enabled: true, tile_size_x: 8, tile_size_y: 8, ..off };
        assert_eq!(vae_circular(&tiled, (true, true), 16, 8), VaeCircular { conv: (false, true), tiles: (true, false) });
        assert_eq!(vae_circular(&tiled, (false, false), 16, 8), VaeCircular { conv: (false, false), tiles: (false, false) });
        // The default tile (32) covers a 16² latent.
        let default_tiles = TilingParams { enabled: true, ..off };
        assert_eq!(vae_circular(&default_tiles, (true, true), 16, 16), VaeCircular { conv: (true, true), tiles: (false, false) });
    }

    #[test]
    fn calc_tiles_matches_reference() {
        let mut n = 0;
        for f in lines("calc") {
            let (small, tile, ov, circ): (i32, i32, f32, bool) =
                (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap(), f[3] == "1");
            let want = (f[4].parse::<i32>().unwrap(), f[5].parse::<f32>().unwrap());
            assert_eq!(calc_tiles(small, tile, ov, circ), want, "calc_tiles({small}, {tile}, {ov}, {circ})");
            n += 1;
        }
        assert!(n > 800);
    }

    #[test]
    fn tile_sizes_match_reference() {
        let mut n = 0;
        for f in lines("sizes") {
            let v: Vec<f32> = f.iter().map(|t| t.parse::<f32>().unwrap()).collect();
            let p = TilingParams {
                enabled: true,
                tile_size_x: v[0] as i32,
                tile_size_y: v[1] as i32,
                target_overlap: v[2],
                rel_size_x: v[3],
                rel_size_y: v[4],
                ..Default::default()
            };
            let got = tile_sizes(&p, v[5] as i64, v[6] as i64, v[7]);
            assert_eq!(got, (v[8] as i32, v[9] as i32, v[10]), "{f:?}");
            n += 1;
        }
        assert!(n > 90);
    }

    #[test]
    fn grid_matches_reference() {
        let mut n = 0;
        for l in CASES.lines().filter(|l| l.starts_with("grid ")) {
            let (head, tail) = l.split_once(" : ").unwrap();
            let h: Vec<&str> = head.split_whitespace().skip(1).collect();
            let spec = TileSpec {
                tile_size_x: h[2].parse().unwrap(),
                tile_size_y: h[3].parse().unwrap(),
                overlap: h[4].parse().unwrap(),
                circular_x: h[6] == "1",
                circular_y: h[7] == "1",
            };
            let grid = TileGrid::new(h[0].parse().unwrap(), h[1].parse().unwrap(), &spec).unwrap();
            let desc = format!(
                "n={},{} f={},{} ov={},{} tiles={}",
                grid.num_x,
                grid.num_y,
                grid.factor_x,
                grid.factor_y,
                grid.overlap_x,
                grid.overlap_y,
                grid.tiles.iter().map(|t| format!("({},{},{},{})", t.x, t.y, t.skip_x, t.skip_y)).collect::<String>()
            );
            // %.9g prints 0.416666657 where Rust prints 0.41666666: compare numerically.
            let norm = |s: &str| -> Vec<String> {
                s.split([' ', ',', '='])
                    .map(|t| t.parse::<f32>().map(|v| v.to_string()).unwrap_or(t.to_string()))
                    .collect()
            };
            assert_eq!(norm(&desc), norm(tail), "{l}");
            n += 1;
        }
        assert!(n >= 7);
    }

    fn ramp(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(shape, (0..n).map(|i| ((i * 7919) % 1013) as f32 / 101.0 - 3.0).collect()).unwrap()
    }

    /// Nearest ×s upscale followed by a pointwise map: any tile of it equals the same
    /// window of the untiled result.
    fn up(t: &Tensor, s: usize) -> Tensor {
        let (w, h) = (t.ne(0), t.ne(1));
        let planes = t.len() / (w * h);
        let mut shape = t.shape().to_vec();
        shape[0] = w * s;
        shape[1] = h * s;
        let mut out = Tensor::zeros(&shape);
        for p in 0..planes {
            for y in 0..h * s {
                for x in 0..w * s {
                    let v = t.data()[p * w * h + (y / s) * w + x / s];
                    out.data_mut()[p * w * h * s * s + y * w * s + x] = 0.5 * v + 1.0;
                }
            }
        }
        out
    }

    fn down(t: &Tensor, s: usize) -> Tensor {
        let (w, h) = (t.ne(0) / s, t.ne(1) / s);
        let planes = t.len() / (t.ne(0) * t.ne(1));
        let mut shape = t.shape().to_vec();
        shape[0] = w;
        shape[1] = h;
        let mut out = Tensor::zeros(&shape);
        for p in 0..planes {
            for y in 0..h {
                for x in 0..w {
                    out.data_mut()[p * w * h + y * w + x] = 2.0 * t.data()[p * t.ne(0) * t.ne(1) + y * s * t.ne(0) + x * s] - 1.0;
                }
            }
        }
        out
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.shape(), b.shape());
        a.data().iter().zip(b.data()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn tiled_pointwise_equals_untiled() {
        // (latent w, h, tile x, tile y, overlap, circular x, circular y)
        let configs = [
            (16, 16, 8, 8, 0.5, false, false), // the golden vae_tiling case (128² image, tile 8)
            (20, 13, 8, 6, 0.25, false, false),
            (40, 24, 16, 16, 0.5, false, false),
            (12, 9, 4, 4, 0.0, false, false),
            (16, 16, 8, 8, 0.5, true, true),
            (16, 12, 8, 8, 0.5, true, false),
            (8, 8, 32, 32, 0.5, false, false),
        ];
        for (w, h, tx, ty, ov, cx, cy) in configs {
            let spec = TileSpec { tile_size_x: tx, tile_size_y: ty, overlap: ov, circular_x: cx, circular_y: cy };
            let latent = ramp(&[w, h, 4, 2]);
            let mut steps = Vec::new();
            let mut progress = |s: i32, n: i32, _: f32| steps.push((s, n));
            let tiled = process_tiles(&latent, w * 8, h * 8, 8, &spec, Some(&mut progress), |t| Ok(up(t, 8))).unwrap();
            let d = max_diff(&tiled, &up(&latent, 8));
            assert!(d < 1e-5, "decode {w}x{h} tile {tx}x{ty} ov {ov} circ {cx},{cy}: max diff {d}");
            assert_eq!(steps.first(), Some(&(0, steps[0].1)));

            let image = ramp(&[w * 8, h * 8, 3, 1]);
            let tiled = process_tiles(&image, w, h, 8, &spec, None, |t| Ok(down(t, 8))).unwrap();
            let d = max_diff(&tiled, &down(&image, 8));
            assert!(d < 1e-5, "encode {w}x{h} tile {tx}x{ty} ov {ov}: max diff {d}");
        }
    }

    #[test]
    fn bad_tiles_are_errors() {
        let spec = TileSpec { tile_size_x: 8, tile_size_y: 8, overlap: 0.5, circular_x: false, circular_y: false };
        let latent = ramp(&[16, 16, 4, 1]);
        // Output of the wrong size.
        assert!(process_tiles(&latent, 128, 128, 8, &spec, None, |t| Ok(t.clone())).is_err());
        // Sizes that are not a ×scale relation.
        assert!(process_tiles(&latent, 100, 128, 8, &spec, None, |t| Ok(up(t, 8))).is_err());
        // Tile closure failures propagate.
        assert!(process_tiles(&latent, 128, 128, 8, &spec, None, |_| bail!("oom")).is_err());
        let zero = TileSpec { tile_size_x: 0, ..spec };
        assert!(process_tiles(&latent, 128, 128, 8, &zero, None, |t| Ok(up(t, 8))).is_err());
    }

    #[test]
    fn retry_uses_half_tiles() {
        let p = TilingParams::default();
        let r = retry_tiling(&p, 64, 48).unwrap();
        assert!(r.enabled);
        assert_eq!((r.tile_size_x, r.tile_size_y), (32, 24));
        assert_eq!(tile_sizes(&r, 64, 48, 1.0), (32, 24, 0.5));
        assert_eq!(retry_tiling(&p, 6, 6).map(|r| r.tile_size_x), Some(4));
        assert!(retry_tiling(&r, 64, 48).is_none());
    }
}
