//! Mage-Flow: the Qwen-Image transformer ([`super::qwen_image`]) with the sizes the
//! reference's `mage_flow.hpp` fixes, whatever the file holds: 12 blocks of 24 heads × 128,
//! 128 latent channels taken one latent pixel per token, the 2560-wide hidden states of
//! Qwen3-VL-4B. Two things differ from Qwen-Image and live here:
//!
//! - the sinusoidal timestep projection is computed on the host with bf16 rounding (the
//!   frequencies, `t / 1000` and each cos / sin), as the model was trained;
//! - positions: text tokens all at 0, the image's pixels `[0, row, col]` with rows and
//!   columns centred (from `-(h - h/2)`), reference latents the same with index 1, 2, ….

use super::qwen_image::QwenImageConfig;
use crate::models::common::rope::{embed_nd, image_ids, Ids};

/// Width of the sinusoidal timestep projection.
pub const TIMESTEP_DIM: usize = 256;
const LAYERS: usize = 12;
const HEADS: i64 = 24;
const HEAD_DIM: i64 = 128;
const LATENT_CHANNELS: i64 = 128;
const TEXT_WIDTH: i64 = 2560;

/// The configuration the reference declares for Mage-Flow (it reads none from the file).
pub fn config() -> QwenImageConfig {
    QwenImageConfig {
        patch_size: 1,
        in_channels: LATENT_CHANNELS,
        out_channels: LATENT_CHANNELS,
        num_layers: LAYERS,
        hidden_size: HEADS * HEAD_DIM,
        head_dim: HEAD_DIM,
        num_heads: HEADS,
        joint_attention_dim: TEXT_WIDTH,
        theta: 10000.0,
        axes_dim: vec![16, 56, 56],
        zero_cond_t: false,
        use_additional_t_cond: false,
        mage_flow: true,
    }
}

/// `x` rounded to bf16 (nearest, ties to even) and back, like ggml's conversion.
pub fn bf16_round(x: f32) -> f32 {
    let u = x.to_bits();
    if x.is_nan() {
        return f32::from_bits((u | 0x0040_0000) & 0xffff_0000);
    }
    let r = (u.wrapping_add(0x7fff + ((u >> 16) & 1))) >> 16;
    f32::from_bits(r << 16)
}

/// The timestep projection `[256, N]` of timesteps `t` (`sigma · 1000`): cos then sin of
/// `bf16(t / 1000) · f_i · 1000` for the 128 bf16-rounded frequencies, each rounded to bf16.
pub fn timestep_projection(t: &[f32]) -> Vec<f32> {
    let half = TIMESTEP_DIM / 2;
    let freqs: Vec<f32> = (0..half).map(|i| bf16_round((-(10000f32).ln() * i as f32 / half as f32).exp())).collect();
    let mut out = vec![0.0; TIMESTEP_DIM * t.len()];
    for (b, &t) in t.iter().enumerate() {
        let sigma = bf16_round(t / 1000.0);
        let row = &mut out[b * TIMESTEP_DIM..(b + 1) * TIMESTEP_DIM];
        for (i, &f) in freqs.iter().enumerate() {
            let arg = sigma * f * 1000.0;
            row[i] = bf16_round(arg.cos());
            row[half + i] = bf16_round(arg.sin());
        }
    }
    out
}

/// Mage-Flow's position ids: `context_len` text tokens at 0, the `h`×`w` latent's pixels
/// with index 0, then each reference latent (`(h, w)`) with index 1, 2, ….
pub fn ids(h: usize, w: usize, context_len: usize, refs: &[(usize, usize)]) -> Ids {
    let mut ids = Ids { n_axes: 3, data: vec![0.0; 3 * context_len] };
    let centred = |h: usize, w: usize, index: usize| {
        let (h, w) = (h as i64, w as i64);
        image_ids(3, h as usize, w as usize, 1, index as f32, -(h - h / 2), -(w - w / 2)).data
    };
    ids.data.extend(centred(h, w, 0));
    for (i, &(rh, rw)) in refs.iter().enumerate() {
        ids.data.extend(centred(rh, rw, i + 1));
    }
    ids
}

/// The rotation table of [`ids`].
pub fn pe(h: usize, w: usize, context_len: usize, refs: &[(usize, usize)], cfg: &QwenImageConfig) -> Vec<f32> {
    embed_nd(&ids(h, w, context_len, refs), cfg.theta, &cfg.axes_dim, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(bf16_round(1.0), 1.0);
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even (1).
        assert_eq!(bf16_round(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(bf16_round(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert!(bf16_round(f32::NAN).is_nan());
    }

    #[test]
    fn projection_starts_with_cos_then_sin() {
        let p = timestep_projection(&[0.0, 1000.0]);
        assert_eq!(p.len(), 512);
        assert!(p[..128].iter().all(|&v| v == 1.0) && p[128..256].iter().all(|&v| v == 0.0));
        // t = 1000: sigma 1, the first frequency is 1: cos(1000), sin(1000) in bf16.
        assert_eq!(p[256], bf16_round(1000f32.cos()));
        assert_eq!(p[256 + 128], bf16_round(1000f32.sin()));
    }

    #[test]
    fn ids_centre_odd_sizes_like_the_reference() {
        // 3 rows, 2 columns: rows from -(3 - 1) = -2, columns from -1; one text token at 0.
        let ids = ids(3, 2, 1, &[(1, 1)]);
        assert_eq!(ids.len(), 1 + 6 + 1);
        assert_eq!(&ids.data[..3], &[0.0, 0.0, 0.0]);
        assert_eq!(&ids.data[3..9], &[0.0, -2.0, -1.0, 0.0, -2.0, 0.0]);
        assert_eq!(&ids.data[18..21], &[0.0, 0.0, 0.0]);
        assert_eq!(&ids.data[21..], &[1.0, -1.0, -1.0]);
    }
}
