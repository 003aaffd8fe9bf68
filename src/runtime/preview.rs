//! Cheap previews of latents during sampling (`PREVIEW_PROJ`): every latent pixel is
//! mapped to RGB by a fixed linear projection fitted to the model family's VAE, so no
//! network runs.

use crate::error::Result;
use crate::image::Image;
use crate::tensor::Tensor;

/// A latent-channel → RGB projection: `rgb = Σ_c latent[c] · weights[c] + bias`, applied to
/// the latents the sampler sees (already multiplied by the VAE scale factor).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Projection {
    pub weights: &'static [[f32; 3]],
    pub bias: Option<[f32; 3]>,
    /// Latent channels packed as `patch_size`² sub-pixels (1 for SD-family latents).
    pub patch_size: usize,
}

/// SD 1.x / 2.x latents.
pub const SD: Projection = Projection {
    weights: &[
        [0.337366, 0.216344, 0.257386],
        [0.165636, 0.386828, 0.046994],
        [-0.267803, 0.237036, 0.223517],
        [-0.178022, -0.200862, -0.678514],
    ],
    bias: Some([-0.017478, -0.055834, -0.105825]),
    patch_size: 1,
};

/// SDXL latents.
pub const SDXL: Projection = Projection {
    weights: &[
        [0.258303, 0.277640, 0.329699],
        [-0.299701, 0.105446, 0.014194],
        [0.050522, 0.186163, -0.143257],
        [-0.211938, -0.149892, -0.080036],
    ],
    bias: Some([0.144381, -0.033313, 0.007061]),
    patch_size: 1,
};

/// SD3 / SD3.5 latents (16 channels).
pub const SD3: Projection = Projection {
    weights: &[
        [-0.0645, 0.0177, 0.1052],
        [0.0028, 0.0312, 0.0650],
        [0.1848, 0.0762, 0.0360],
        [0.0944, 0.0360, 0.0889],
        [0.0897, 0.0506, -0.0364],
        [-0.0020, 0.1203, 0.0284],
        [0.0855, 0.0118, 0.0283],
        [-0.0539, 0.0658, 0.1047],
        [-0.0057, 0.0116, 0.0700],
        [-0.0412, 0.0281, -0.0039],
        [0.1106, 0.1171, 0.1220],
        [-0.0248, 0.0682, -0.0481],
        [0.0815, 0.0846, 0.1207],
        [-0.0120, -0.0055, -0.0867],
        [-0.0749, -0.0634, -0.0456],
        [-0.1418, -0.1457, -0.1259],
    ],
    bias: Some([0.0, 0.0, 0.0]),
    patch_size: 1,
};

/// Flux.1 / Chroma latents (16 channels).
pub const FLUX: Projection = Projection {
    weights: &[
        [-0.041168, 0.019917, 0.097253],
        [0.028096, 0.026730, 0.129576],
        [0.065618, -0.067950, -0.014651],
        [-0.012998, -0.014762, 0.081251],
        [0.078567, 0.059296, -0.024687],
        [-0.015987, -0.003697, 0.005012],
        [0.033605, 0.138999, 0.068517],
        [-0.024450, -0.063567, -0.030101],
        [-0.040194, -0.016710, 0.127185],
        [0.112681, 0.088764, -0.041940],
        [-0.023498, 0.093664, 0.025543],
        [0.082899, 0.048320, 0.007491],
        [0.075712, 0.074139, 0.081965],
        [-0.143501, 0.018263, -0.136138],
        [-0.025767, -0.082035, -0.040023],
        [-0.111849, -0.055589, -0.032361],
    ],
    bias: Some([0.024600, -0.006937, -0.008089]),
    patch_size: 1,
};

/// Wan2.2 VAE latents (Wan2.2 TI2V, 48 channels).
pub const WAN22: Projection = Projection {
    weights: &[
        [0.017126, -0.027230, -0.019257],
        [-0.113739, -0.028715, -0.022885],
        [-0.000106, 0.021494, 0.004629],
        [-0.013273, -0.107137, -0.033638],
        [-0.000381, 0.000279, 0.025877],
        [-0.014216, -0.003975, 0.040528],
        [0.001638, -0.000748, 0.011022],
        [0.029238, -0.006697, 0.035933],
        [0.021641, -0.015874, 0.040531],
        [-0.101984, -0.070160, -0.028855],
        [0.033207, -0.021068, 0.002663],
        [-0.104711, 0.121673, 0.102981],
        [0.082647, -0.004991, 0.057237],
        [-0.027375, 0.031581, 0.006868],
        [-0.045434, 0.029444, 0.019287],
        [-0.046572, -0.012537, 0.006675],
        [0.074709, 0.033690, 0.025289],
        [-0.008251, -0.002745, -0.006999],
        [0.012685, -0.061856, -0.048658],
        [0.042304, -0.007039, 0.000295],
        [-0.007644, -0.060843, -0.033142],
        [0.159909, 0.045628, 0.367541],
        [0.095171, 0.086438, 0.010271],
        [0.006812, 0.019643, 0.029637],
        [0.003467, -0.010705, 0.014252],
        [-0.099681, -0.066272, -0.006243],
        [0.047357, 0.037040, 0.000185],
        [-0.041797, -0.089225, -0.032257],
        [0.008928, 0.017028, 0.018684],
        [-0.042255, 0.016045, 0.006849],
        [0.011268, 0.036462, 0.037387],
        [0.011553, -0.016375, -0.048589],
        [0.046266, -0.027189, 0.056979],
        [0.009640, -0.017576, 0.030324],
        [-0.045794, -0.036083, -0.010616],
        [0.022418, 0.039783, -0.032939],
        [-0.052714, -0.015525, 0.007438],
        [0.193004, 0.223541, 0.264175],
        [-0.059406, -0.008188, 0.022867],
        [-0.156742, -0.263791, -0.007385],
        [-0.015717, 0.016570, 0.033969],
        [0.037969, 0.109835, 0.200449],
        [-0.000782, -0.009566, -0.008058],
        [0.010709, 0.052960, -0.044195],
        [0.017271, 0.045839, 0.034569],
        [0.009424, 0.013088, -0.001714],
        [-0.024805, -0.059378, -0.033756],
        [-0.078293, 0.029070, 0.026129],
    ],
    bias: Some([0.013160, -0.096492, -0.071323]),
    patch_size: 1,
};

/// Wan2.1 VAE latents (Qwen-Image, 16 channels).
pub const WAN21: Projection = Projection {
    weights: &[
        [0.015123, -0.148418, 0.479828],
        [0.003652, -0.010680, -0.037142],
        [0.212264, 0.063033, 0.016779],
        [0.232999, 0.406476, 0.220125],
        [-0.051864, -0.082384, -0.069396],
        [0.085005, -0.161492, 0.010689],
        [-0.245369, -0.506846, -0.117010],
        [-0.151145, 0.017721, 0.007207],
        [-0.293239, -0.207936, -0.421135],
        [-0.187721, 0.050783, 0.177649],
        [-0.013067, 0.265964, 0.166578],
        [0.028327, 0.109329, 0.108642],
        [-0.205343, 0.043991, 0.148914],
        [0.014307, -0.048647, -0.007219],
        [0.217150, 0.053074, 0.319923],
        [0.155357, 0.083156, 0.064780],
    ],
    bias: Some([-0.270270, -0.234976, -0.456853]),
    patch_size: 1,
};

/// Flux.2 latents (128 channels: 32 VAE channels × 2×2 sub-pixels).
pub const FLUX2: Projection = Projection {
    weights: &[
        [0.000736, -0.008385, -0.019710],
        [-0.001352, -0.016392, 0.020693],
        [-0.006376, 0.002428, 0.036736],
        [0.039384, 0.074167, 0.119789],
        [0.007464, -0.005705, -0.004734],
        [-0.004086, 0.005287, -0.000409],
        [-0.032835, 0.050802, -0.028120],
        [-0.003158, -0.000835, 0.000406],
        [-0.112840, -0.084337, -0.023083],
        [0.001462, -0.006656, 0.000549],
        [-0.009980, -0.007480, 0.009702],
        [0.032540, 0.000214, -0.061388],
        [0.011023, 0.000694, 0.007143],
        [-0.001468, -0.006723, -0.001678],
        [-0.005921, -0.010320, -0.003907],
        [-0.028434, 0.027584, 0.018457],
        [0.014349, 0.011523, 0.000441],
        [0.009874, 0.003081, 0.001507],
        [0.002218, 0.005712, 0.001563],
        [0.053010, -0.019844, 0.008683],
        [-0.002507, 0.005384, 0.000938],
        [-0.002177, -0.011366, 0.003559],
        [-0.000261, 0.015121, -0.003240],
        [-0.003944, -0.002083, 0.005043],
        [-0.009138, 0.011336, 0.003781],
        [0.011429, 0.003985, -0.003855],
        [0.010518, -0.005586, 0.010131],
        [0.007883, 0.002912, -0.001473],
        [-0.003318, -0.003160, 0.003684],
        [-0.034560, -0.008740, 0.012996],
        [0.000166, 0.001079, -0.012153],
        [0.017772, 0.000937, -0.011953],
    ],
    bias: Some([-0.028738, -0.098463, -0.107619]),
    patch_size: 2,
};

/// The projection for 4-channel latents of an SD 1.x/2.x (`sdxl == false`) or SDXL model.
pub fn for_sd_family(sdxl: bool) -> &'static Projection {
    if sdxl {
        &SDXL
    } else {
        &SD
    }
}

/// An RGB preview of the first latent of `latents` ([W, H, C, N]). `None`: the latent is
/// RGB (the 3-channel "latents" of pixel-space models); with more channels there is no
/// projection to show them (SeFi-Image's 144), as in the reference.
pub fn project(latents: &Tensor, proj: Option<&Projection>) -> Result<Image> {
    let (w, h, c) = (latents.ne(0), latents.ne(1), latents.ne(2));
    let patch = proj.map_or(1, |p| p.patch_size.max(1));
    match proj {
        Some(p) => ensure!(
            c / (patch * patch) >= p.weights.len() && c % (patch * patch) == 0,
            "latent preview: {c} channels do not fit a projection of {} channels with patch {patch}",
            p.weights.len()
        ),
        None => ensure!(c == 3, "No latent to RGB projection known for this model (dim = {c})"),
    }
    let (out_w, out_h) = (w * patch, h * patch);
    let plane = w * h;
    let src = latents.data();
    let mut data = vec![0u8; out_w * out_h * 3];
    for y in 0..out_h {
        for x in 0..out_w {
            let (lx, ly) = (x / patch, y / patch);
            let sub = if patch > 1 { (y % patch) * patch + x % patch } else { 0 };
            let at = |ch: usize| src[lx + w * ly + plane * ch];
            let mut rgb = [0f32; 3];
            match proj {
                Some(p) => {
                    for (d, row) in p.weights.iter().enumerate() {
                        let v = at(d * patch * patch + sub);
                        for k in 0..3 {
                            rgb[k] += v * row[k];
                        }
                    }
                    if let Some(b) = p.bias {
                        for k in 0..3 {
                            rgb[k] += b[k];
                        }
                    }
                }
                None => rgb = [at(0), at(1), at(2)],
            }
            let o = (y * out_w + x) * 3;
            for k in 0..3 {
                let v = (rgb[k] * 0.5 + 0.5).clamp(0.0, 1.0);
                data[o + k] = (v * 255.0) as u8;
            }
        }
    }
    Image::new(out_w as u32, out_h as u32, 3, data).ok_or_else(|| crate::error::Error::new("latent preview too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projects_like_the_reference_formula() {
        // 2×1 latent, 4 channels.
        let lat = Tensor::from_vec(&[2, 1, 4, 1], vec![1.0, 0.0, 0.5, 0.0, -1.0, 0.0, 0.25, 0.0]).unwrap();
        let img = project(&lat, Some(&SD)).unwrap();
        assert_eq!((img.width, img.height, img.channels), (2, 1, 3));
        let want: Vec<u8> = (0..3)
            .map(|k| {
                let mut v = 0f32;
                for (d, l) in [1.0f32, 0.5, -1.0, 0.25].iter().enumerate() {
                    v += l * SD.weights[d][k];
                }
                v += SD.bias.unwrap()[k];
                ((v * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0) as u8
            })
            .collect();
        assert_eq!(&img.data[..3], &want);
        // A zero latent shows the bias.
        let b = SD.bias.unwrap();
        assert_eq!(img.data[3], ((b[0] * 0.5 + 0.5) * 255.0) as u8);
        assert!(project(&lat, Some(for_sd_family(true))).is_ok());
        assert!(project(&Tensor::zeros(&[2, 2, 2, 1]), Some(&SD)).is_err());
        let rgb = project(&Tensor::full(&[1, 1, 3, 1], 5.0), None).unwrap();
        assert_eq!(rgb.data, vec![255, 255, 255]);
        // More channels than RGB and no projection (SeFi-Image): nothing to show.
        assert!(project(&Tensor::zeros(&[1, 1, 144, 1]), None).is_err());
    }
}
