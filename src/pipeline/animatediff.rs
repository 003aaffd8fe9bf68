//! `generate_video` on an SD 1.x model with AnimateDiff motion modules, as the reference
//! renders it: the picture job with one latent of `video_frames` frames (at most 32, the
//! motion modules' positional table) that the UNet samples as one batch, each frame decoded
//! on its own. The request's picture fields carry over; what only the video families read is
//! warned about here.

use super::callbacks::CancelFlag;
use super::families::ModelSet;
use super::image;
use crate::error::Result;
use crate::image::Image;
use crate::models::diffusion::unet::motion::MAX_FRAMES;
use crate::params::{ImgGenParams, VidGenParams};

/// The picture request the reference makes of a video request (one batch, no control image).
fn picture_request(p: &VidGenParams) -> ImgGenParams {
    ImgGenParams {
        loras: p.loras.clone(),
        prompt: p.prompt.clone(),
        negative_prompt: p.negative_prompt.clone(),
        clip_skip: p.clip_skip,
        width: p.width,
        height: p.height,
        sample_params: p.sample_params.clone(),
        strength: p.strength,
        init_image: p.init_image.clone(),
        seed: p.seed,
        batch_count: 1,
        control_strength: 1.0,
        vae_tiling_params: p.vae_tiling_params.clone(),
        cache: p.cache.clone(),
        hires: p.hires.clone(),
        qwen_image_layers: 0,
        circular_x: p.circular_x,
        circular_y: p.circular_y,
        ..ImgGenParams::default()
    }
}

/// The frames a request gets: `video_frames`, capped at the positional table's length.
fn frame_count(requested: i32) -> Result<usize> {
    ensure!(requested >= 1, "AnimateDiff: video_frames must be >= 1, got {requested}");
    if requested as i64 > MAX_FRAMES {
        sd_warn!("AnimateDiff motion modules have a {MAX_FRAMES}-frame positional-encoding context; capping to {MAX_FRAMES}");
        return Ok(MAX_FRAMES as usize);
    }
    Ok(requested as usize)
}

/// The video's frames.
pub fn generate_video(ms: &mut ModelSet, p: &VidGenParams, cancel: &CancelFlag) -> Result<Vec<Image>> {
    sd_info!("AnimateDiff dispatch: {} frames, {}x{}", p.video_frames, p.width, p.height);
    let frames = frame_count(p.video_frames)?;
    let unused = [
        ("an end image", "end_image", p.end_image.is_some()),
        ("reference images", "ref_images", !p.ref_images.is_empty()),
        ("control frames", "control_frames", !p.control_frames.is_empty()),
    ];
    for (what, field, given) in unused {
        if given {
            sd_warn!("AnimateDiff does not use {what}; ignoring {field}");
        }
    }
    image::generate_frames(ms, &picture_request(p), frames, cancel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_capped_at_the_positional_table() {
        assert_eq!(frame_count(16).unwrap(), 16);
        assert_eq!(frame_count(1).unwrap(), 1);
        assert_eq!(frame_count(40).unwrap(), 32);
        assert!(frame_count(0).unwrap_err().to_string().contains("video_frames"));
    }

    #[test]
    fn the_picture_request_keeps_the_video_request_fields_it_reads() {
        let v = VidGenParams { prompt: "a cat".into(), width: 64, height: 96, seed: 7, strength: 0.5, clip_skip: 2, ..VidGenParams::default() };
        let p = picture_request(&v);
        assert_eq!((p.prompt.as_str(), p.width, p.height, p.seed, p.strength, p.clip_skip), ("a cat", 64, 96, 7, 0.5, 2));
        assert_eq!((p.batch_count, p.control_strength, p.qwen_image_layers), (1, 1.0, 0));
        assert!(p.control_image.is_none() && p.mask_image.is_none());
    }
}
