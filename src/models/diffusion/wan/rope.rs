//! Wan's rotary positions: one token per `(frame, row, column)` patch, numbered from 0 on
//! each axis (the reference's `gen_wan_pe`: video ids, no text tokens, no wrapping).

use crate::models::common::rope::{embed_nd, Ids};

/// Patches along an axis of `len` latent pixels for a patch of `p` (rounded like the
/// reference: `(len + p / 2) / p`).
fn patches(len: usize, p: usize) -> usize {
    (len + p / 2) / p
}

/// Position ids `[frame, row, col]` of a `t`×`h`×`w` latent cut into `patch` `(t, h, w)`
/// patches, frame by frame, row by row.
pub fn wan_ids(t: usize, h: usize, w: usize, patch: [usize; 3]) -> Ids {
    let (t_len, h_len, w_len) = (patches(t, patch[0]), patches(h, patch[1]), patches(w, patch[2]));
    let mut data = Vec::with_capacity(t_len * h_len * w_len * 3);
    for f in 0..t_len {
        for r in 0..h_len {
            for c in 0..w_len {
                data.extend_from_slice(&[f as f32, r as f32, c as f32]);
            }
        }
    }
    Ids { n_axes: 3, data }
}

/// The rotation table `[2, 2, Σaxes / 2, tokens]` (f32, host) of a `t`×`h`×`w` latent.
pub fn wan_pe(t: usize, h: usize, w: usize, patch: [usize; 3], theta: f32, axes_dim: &[usize]) -> Vec<f32> {
    embed_nd(&wan_ids(t, h, w, patch), theta, axes_dim, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_count_frames_rows_and_columns() {
        // 2 frames of a 6×4 latent (W×H) in 1×2×2 patches: 2 × 2 × 3 tokens.
        let ids = wan_ids(2, 4, 6, [1, 2, 2]);
        assert_eq!(ids.len(), 12);
        let row = |i: usize| ids.data[i * 3..i * 3 + 3].to_vec();
        assert_eq!(row(0), vec![0., 0., 0.]);
        assert_eq!(row(2), vec![0., 0., 2.]);
        assert_eq!(row(3), vec![0., 1., 0.]);
        assert_eq!(row(11), vec![1., 1., 2.]);
        // Odd sizes round up like the reference (5 pixels → 3 patches).
        assert_eq!(wan_ids(1, 5, 5, [1, 2, 2]).len(), 9);
    }

    #[test]
    fn rotation_table_layout() {
        let axes = [44usize, 42, 42];
        let pe = wan_pe(2, 2, 2, [1, 2, 2], 10000.0, &axes);
        // 2 tokens × 64 frequencies × [cos, -sin, sin, cos].
        assert_eq!(pe.len(), 2 * 64 * 4);
        // Token 0 has id (0, 0, 0): identity rotations.
        assert!(pe[..256].chunks(4).all(|r| r == [1.0, -0.0, 0.0, 1.0]));
        // Token 1 is frame 1: the first frequency of the frame axis (1) turns by 1 rad, the
        // row and column axes (from frequency 22 on) do not turn.
        let t1 = &pe[256..];
        assert_eq!(&t1[..4], &[1f32.cos(), -(1f32.sin()), 1f32.sin(), 1f32.cos()]);
        // Frequency i of the 44-dim axis is 10000^(-i·(42/44)/21).
        let f1 = 1.0 / 10000f32.powf(42.0 / 44.0 / 21.0);
        assert_eq!(t1[4], f1.cos());
        assert!(t1[22 * 4..].chunks(4).all(|r| r == [1.0, -0.0, 0.0, 1.0]));
    }
}
