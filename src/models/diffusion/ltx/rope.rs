//! LTX-2.3's rotary tables, computed on the host in f32 like the reference's: fractional
//! positions (seconds for time, pixels for space, each divided by its maximum) mapped to
//! `[-1, 1]` and multiplied by frequencies spaced geometrically from π/2 to θ·π/2; the unused
//! leading dimensions get angle 0. Tables are per head: the frequencies of a token are cut into
//! one run per head, and each (token, head) pair is a row `[[cos, -sin], [sin, cos]]` per pair
//! of dimensions (`[2, 2, head_dim / 2, tokens · heads]`, head fastest).

use std::f32::consts::FRAC_PI_2;

/// Video latent frames are this many pixel frames apart; the latent's pixels 32 apart.
pub const TIME_SCALE: i64 = 8;
pub const SPACE_SCALE: i64 = 32;
/// The positions' maxima (time in seconds, space in pixels) and θ.
pub const MAX_POS: [f32; 3] = [20.0, 2048.0, 2048.0];
pub const THETA: f32 = 10000.0;

/// The frequencies of `dim` dimensions over `axes` axes: `dim / (2·axes)` of them.
fn freq_grid(theta: f32, axes: usize, dim: usize) -> Vec<f32> {
    let count = dim / (2 * axes);
    match count {
        0 => Vec::new(),
        1 => vec![FRAC_PI_2],
        _ => {
            let log_theta = theta.ln();
            (0..count).map(|i| (log_theta * (i as f32 / (count - 1) as f32)).exp() * FRAC_PI_2).collect()
        }
    }
}

/// Per-token angles `[tokens][dim / 2]` → the per-head rotation table.
fn table(angles: &[Vec<f32>], dim: usize, heads: usize) -> Vec<f32> {
    let half = dim / 2;
    let per_head = half / heads;
    let mut out = Vec::with_capacity(angles.len() * half * 4);
    for token in angles {
        for head in 0..heads {
            for &a in &token[head * per_head..(head + 1) * per_head] {
                let (s, c) = (a.sin(), a.cos());
                out.extend_from_slice(&[c, -s, s, c]);
            }
        }
    }
    out
}

/// Angles of one token: zeros for the leading `dim / 2 - freqs · coords` dimensions, then for
/// each frequency the coordinates (each in `[0, 1]` of its maximum) in order.
fn angles(freqs: &[f32], coords: &[f32], dim: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; dim / 2 - freqs.len() * coords.len()];
    for &f in freqs {
        for &c in coords {
            out.push(f * (c * 2.0 - 1.0));
        }
    }
    out
}

/// Seconds of a latent frame's start (`corner`) at `fps`: causal, the first latent frame is one
/// pixel frame.
fn frame_seconds(corner: i64, fps: f32) -> f32 {
    let pixel = (corner * TIME_SCALE) as f32;
    (pixel + 1.0 - TIME_SCALE as f32).max(0.0) / fps
}

/// Mid-time (seconds) of each latent frame.
pub fn frame_times(frames: i64, fps: f32) -> Vec<f32> {
    (0..frames).map(|t| 0.5 * (frame_seconds(t, fps) + frame_seconds(t + 1, fps))).collect()
}

/// Mid-times (seconds) of `count` keyframe latent frames standing for the picture at pixel
/// frame `at`: each one pixel frame long, the next 8 frames on.
pub fn keyframe_times(at: usize, count: usize, fps: f32) -> Vec<f32> {
    (0..count)
        .map(|k| {
            let start = (at + k * TIME_SCALE as usize) as f32;
            0.5 * (start / fps + (start + 1.0) / fps)
        })
        .collect()
}

/// The video tokens' table (frame, row, column order) over time (each latent frame's
/// mid-time in seconds, `times`) and both spatial axes.
pub fn video(width: i64, height: i64, times: &[f32], dim: usize, heads: usize) -> Vec<f32> {
    let freqs = freq_grid(THETA, 3, dim);
    let mut all = Vec::with_capacity((width * height) as usize * times.len());
    for &t in times {
        for h in 0..height {
            let ph = (h * SPACE_SCALE) as f32 + 0.5 * SPACE_SCALE as f32;
            for w in 0..width {
                let pw = (w * SPACE_SCALE) as f32 + 0.5 * SPACE_SCALE as f32;
                all.push(angles(&freqs, &[t / MAX_POS[0], ph / MAX_POS[1], pw / MAX_POS[2]], dim));
            }
        }
    }
    table(&all, dim, heads)
}

/// A table over time alone, `coords` in seconds with maximum `max_pos`.
fn temporal(coords: &[f32], dim: usize, heads: usize, max_pos: f32) -> Vec<f32> {
    let freqs = freq_grid(THETA, 1, dim);
    let all: Vec<Vec<f32>> = coords.iter().map(|&c| angles(&freqs, &[c / max_pos], dim)).collect();
    table(&all, dim, heads)
}

/// The video tokens' table over time alone (the audio-video cross-attentions).
pub fn video_time(width: i64, height: i64, times: &[f32], dim: usize, heads: usize, max_pos: f32) -> Vec<f32> {
    let per_frame = (width * height) as usize;
    let coords: Vec<f32> = times.iter().flat_map(|&t| std::iter::repeat_n(t, per_frame)).collect();
    temporal(&coords, dim, heads, max_pos)
}

/// Seconds of an audio latent step's start: 4 mel frames of 160 samples at 16 kHz, causal.
fn audio_seconds(step: i64) -> f32 {
    let mel = ((step * 4) as f32 + 1.0 - 4.0).max(0.0);
    mel * 160.0 / 16000.0
}

/// The audio tokens' table (mid-times of the steps).
pub fn audio(steps: i64, dim: usize, heads: usize, max_pos: f32) -> Vec<f32> {
    let coords: Vec<f32> = (0..steps).map(|t| 0.5 * (audio_seconds(t) + audio_seconds(t + 1))).collect();
    temporal(&coords, dim, heads, max_pos)
}

/// The leading `len` values of `table`, zero-filled past its end: the reference builds the
/// cross-attention tables at the audio context's width and uploads as many values as the
/// attention's rotation takes.
pub fn leading(mut table: Vec<f32>, len: usize) -> Vec<f32> {
    table.resize(len, 0.0);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequencies_span_a_quarter_turn_to_theta_quarter_turns() {
        let f = freq_grid(THETA, 3, 64);
        assert_eq!(f.len(), 10);
        assert_eq!(f[0], FRAC_PI_2);
        assert!((f[9] / (THETA * FRAC_PI_2) - 1.0).abs() < 1e-5);
        assert_eq!(freq_grid(THETA, 3, 6), vec![FRAC_PI_2]);
    }

    #[test]
    fn frame_and_audio_times_are_causal_mid_points() {
        // Frame 0 covers pixel frame 0 alone, frame 1 pixel frames 1..=8.
        assert_eq!(frame_times(2, 24.0), vec![0.5 / 24.0, 0.5 * (1.0 + 9.0) / 24.0]);
        assert_eq!(audio_seconds(0), 0.0);
        assert_eq!(audio_seconds(2), 5.0 * 160.0 / 16000.0);
    }

    #[test]
    fn tables_hold_a_rotation_per_head_and_pair() {
        let t = video(2, 1, &frame_times(1, 24.0), 64, 4);
        assert_eq!(t.len(), 2 * 4 * 8 * 4);
        // The two leading dimensions of head 0 are padding: angle 0.
        assert_eq!(&t[..4], &[1.0, -0.0, 0.0, 1.0]);
        let a = audio(3, 32, 2, 20.0);
        assert_eq!(a.len(), 3 * 2 * 8 * 4);
        assert_eq!(leading(a.clone(), 8), a[..8].to_vec());
    }
}
