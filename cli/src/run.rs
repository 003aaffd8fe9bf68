//! Carrying out a parsed command line: convert, generate (with ADetailer and ESRGAN passes),
//! upscale, and save the results.

use std::path::Path;
use std::sync::Arc;

use stable_diffusion::api::{
    self, AdetailerContext, AdetailerCtxParams, AdetailerParams, Audio, CannyParams, Context, ConvertParams, Image, ImgGenParams,
    RefVideo, UpscalerContext, UpscalerParams, VidGenParams,
};
use stable_diffusion::pipeline::callbacks::{self, PreviewConfig};
use stable_diffusion::types::Preview;
use stable_diffusion::{sd_debug, sd_error, sd_info, sd_warn};

use crate::args::{GenOpts, Mode, Opts};
use crate::avi;
use crate::image_io::{load_image, write_image};
use crate::metadata::image_parameters;
use crate::output::{audio_sidecar_path, has_number_field, image_paths, video_path};

/// A failure already worth a message; the caller logs it and exits with status 1.
pub type Failure = String;

fn given(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

fn convert(o: &Opts) -> Result<(), Failure> {
    let c = &o.ctx.params;
    let params = ConvertParams {
        model_path: c.model_path.clone(),
        clip_l_path: c.clip_l_path.clone(),
        clip_g_path: c.clip_g_path.clone(),
        t5xxl_path: c.t5xxl_path.clone(),
        diffusion_model_path: c.diffusion_model_path.clone(),
        vae_path: c.vae_path.clone(),
        output_path: o.cli.output.clone(),
        output_type: c.wtype,
        tensor_type_rules: c.tensor_type_rules.clone(),
        convert_name: o.cli.convert_name,
        n_threads: c.n_threads,
    };
    let what = format!("'{}'/'{}' to '{}'", given(&c.model_path).unwrap_or(""), given(&c.vae_path).unwrap_or(""), o.cli.output);
    match api::convert(&params) {
        Ok(()) => {
            sd_info!("convert {what} success");
            Ok(())
        }
        Err(e) => {
            sd_error!("{e}");
            Err(format!("convert {what} failed"))
        }
    }
}

/// Where previews go, and their frame rate: like the reference, a video of more than 4
/// frames previews into an AVI when the path is a PNG, at the video's fps (a quarter of it
/// for the latent projection, whose frames are latent frames). Preview videos are MJPEG
/// AVIs, so WebM / WebP names become `.avi` ones.
pub fn preview_target(o: &Opts) -> (String, i32) {
    let path = &o.cli.preview_path;
    let video = o.cli.mode == Mode::VidGen;
    let ext = Path::new(path).extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
    let path = match ext.as_str() {
        "png" if video && o.gen.video.video_frames > 4 => video_path(path).0,
        "webm" | "webp" if video => {
            let avi = video_path(path).0;
            sd_warn!("preview videos are written as MJPEG AVI by this sd-cli: previewing to '{avi}' instead of '{path}'");
            avi
        }
        _ => path.clone(),
    };
    let fps = o.gen.video.fps;
    (path, if o.cli.preview == Preview::Proj { fps / 4 } else { fps })
}

/// Writes each preview over the preview path: one frame as a picture, several as a video.
fn install_preview(o: &Opts) {
    if o.cli.preview == Preview::None {
        return;
    }
    let (path, fps) = preview_target(o);
    let callback: callbacks::PreviewFn = Arc::new(move |_step: i32, frames: &[Image], _noisy: bool| {
        let result = match frames {
            [] => return,
            [one] => write_image(Path::new(&path), one, "").map_err(|e| format!("save preview image to '{path}' failed: {e}")),
            many => avi::write(Path::new(&path), many, fps.max(1), None).map_err(|e| format!("save preview video to '{path}' failed: {e}")),
        };
        if let Err(e) = result {
            sd_error!("{e}");
        }
    });
    callbacks::set_preview(PreviewConfig {
        callback: Some(callback),
        mode: o.cli.preview,
        interval: o.cli.preview_interval,
        denoised: !o.cli.preview_noisy,
        noisy: o.cli.preview_noisy,
    });
}

fn dims(w: i32, h: i32) -> Option<(u32, u32)> {
    (w > 0 && h > 0).then_some((w as u32, h as u32))
}

/// An init or end image: resized to -W/-H when both are given, else giving the size.
fn load_sized(gen: &mut GenOpts, path: &str) -> Result<Option<Image>, Failure> {
    if path.is_empty() {
        return Ok(None);
    }
    let size = if gen.size_is_set() { dims(gen.width, gen.height) } else { None };
    let img = load_image(path, size, 3)?;
    gen.set_size_if_unset(img.width as i32, img.height as i32);
    Ok(Some(img))
}

/// The reference images, as they are (each may give the size).
fn load_ref_images(gen: &mut GenOpts) -> Result<Vec<Image>, Failure> {
    let mut out = Vec::new();
    for path in &gen.ref_images.clone() {
        let img = load_image(path, None, 3)?;
        gen.set_size_if_unset(img.width as i32, img.height as i32);
        out.push(img);
    }
    Ok(out)
}

/// Loads every input image the request names, resized like the reference does.
fn load_inputs(o: &mut Opts, params: &mut ImgGenParams) -> Result<(), Failure> {
    let gen = &mut o.gen;
    params.init_image = load_sized(gen, &gen.init_img.clone())?;
    params.ref_images = load_ref_images(gen)?;
    let (w, h) = (gen.resolved_width(), gen.resolved_height());
    params.mask_image = Some(if gen.mask.is_empty() {
        Image { width: w as u32, height: h as u32, channels: 1, data: vec![255; w as usize * h as usize] }
    } else {
        load_image(&gen.mask, dims(w, h), 1)?
    });
    if !gen.control_image.is_empty() {
        let mut img = load_image(&gen.control_image, dims(w, h), 3)?;
        if o.cli.canny {
            let canny = CannyParams { high_threshold: 0.08, low_threshold: 0.08, weak: 0.8, strong: 1.0, inverse: false };
            api::preprocess_canny(&mut img.data, img.width, img.height, img.channels, &canny).map_err(|e| e.to_string())?;
        }
        params.control_image = Some(img);
    }
    if !gen.ip_adapter_image.is_empty() {
        params.ip_adapter_image = Some(load_image(&gen.ip_adapter_image, None, 3)?);
    }
    if !gen.pm_id_images_dir.is_empty() {
        params.pm_params.id_images = load_image_dir(&gen.pm_id_images_dir, None, 0)?;
    }
    Ok(())
}

/// Loads what a video request names, in the reference's order: first and last frame
/// (resized to -W/-H when both are given), reference images and videos, WAV audio, and the
/// control video's first --video-frames frames, resized to the video size.
pub fn load_video_inputs(o: &mut Opts, params: &mut VidGenParams) -> Result<(), Failure> {
    let gen = &mut o.gen;
    params.init_image = load_sized(gen, &gen.init_img.clone())?;
    params.end_image = load_sized(gen, &gen.video.end_img.clone())?;
    params.ref_images = load_ref_images(gen)?;
    let v = &gen.video;
    for (i, dir) in v.ref_videos.iter().enumerate() {
        let frames = load_image_dir(dir, None, 0)?;
        if frames.is_empty() {
            return Err(format!("load reference video frames from '{dir}' failed: no picture in it"));
        }
        let audio = v.ref_video_audios.get(i).map(|wav| avi::read_wav(Path::new(wav))).transpose()?;
        params.ref_videos.push(RefVideo { frames, fps: 24, audio });
    }
    for wav in &v.ref_audios {
        params.ref_audios.push(avi::read_wav(Path::new(wav))?);
    }
    if !v.control_video.is_empty() {
        let size = dims(gen.resolved_width(), gen.resolved_height());
        params.control_frames = load_image_dir(&v.control_video, size, v.video_frames.max(0) as usize)?;
    }
    Ok(())
}

/// The image files directly in `dir` (by extension), in file name order, each resized to
/// `size` when given; at most `max` of them when `max` > 0.
fn load_image_dir(dir: &str, size: Option<(u32, u32)>, max: usize) -> Result<Vec<Image>, Failure> {
    let entries = std::fs::read_dir(dir).map_err(|_| format!("'{dir}' is not a valid directory"))?;
    let mut files: Vec<_> = entries.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
    files.sort_by_key(|p| p.file_name().map(|n| n.to_os_string()));
    let image_ext = |p: &Path| {
        let ext = p.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
        ["jpg", "jpeg", "png", "bmp", "webp"].contains(&ext.as_str())
    };
    let mut out = Vec::new();
    for f in files.iter().filter(|p| image_ext(p)) {
        if max > 0 && out.len() >= max {
            break;
        }
        sd_debug!("load image {} from '{}'", out.len(), f.display());
        out.push(load_image(&f.to_string_lossy(), size, 3)?);
    }
    Ok(out)
}

/// Replaces each result by its ADetailer-inpainted version when --ad-model is given.
fn apply_adetailer(o: &Opts, sd: &Context, base: &ImgGenParams, results: &mut [Image]) -> Result<(), Failure> {
    let g = &o.gen;
    if g.ad_model.is_empty() {
        return Ok(());
    }
    let ctx = o.ctx_params();
    let ad = AdetailerContext::new(&AdetailerCtxParams {
        detector_path: g.ad_model.clone(),
        n_threads: ctx.n_threads,
        backend: ctx.backend.clone(),
        params_backend: ctx.params_backend.clone(),
    })
    .map_err(|e| format!("new_adetailer_ctx failed: {e}"))?;
    let opts = AdetailerParams {
        prompt: (!g.ad_prompt.is_empty()).then(|| g.ad_prompt.clone()),
        negative_prompt: (!g.ad_negative_prompt.is_empty()).then(|| g.ad_negative_prompt.clone()),
        extra_ad_args: Some(g.extra_ad_args.clone()),
    };
    for (i, img) in results.iter_mut().enumerate().filter(|(_, img)| !img.is_empty()) {
        let mut request = base.clone();
        request.seed = base.seed + i as i64;
        if o.cli.mode == Mode::ImgGen {
            request.width = 512;
            request.height = 512;
            request.strength = 0.4;
        }
        *img = ad.detail(sd, img, &opts, &request).map_err(|e| format!("ADetailer failed for image {}: {e}", i + 1))?;
    }
    Ok(())
}

/// Runs the ESRGAN model --upscale-repeats times over each result. A model that does not load
/// leaves the results as they are; a failed pass keeps the last good image.
fn upscale(o: &Opts, results: &mut [Image]) {
    let ctx = o.ctx_params();
    let upscaler = match UpscalerContext::new(&UpscalerParams {
        esrgan_path: o.ctx.upscale_model.clone(),
        direct: ctx.diffusion_conv_direct,
        n_threads: ctx.n_threads,
        tile_size: o.gen.upscale_tile_size,
        backend: ctx.backend.clone(),
        params_backend: ctx.params_backend.clone(),
    }) {
        Ok(u) => u,
        Err(e) => {
            sd_error!("new_upscaler_ctx failed: {e}");
            return;
        }
    };
    for img in results.iter_mut().filter(|img| !img.is_empty()) {
        for _ in 0..o.gen.upscale_repeats {
            match upscaler.upscale(img, 4) {
                Ok(up) if !up.is_empty() => *img = up,
                Ok(_) => {
                    sd_error!("upscale failed");
                    break;
                }
                Err(e) => {
                    sd_error!("upscale failed: {e}");
                    break;
                }
            }
        }
    }
}

/// Writes the results under the output name; succeeds when at least one image was written.
pub fn save_results(o: &Opts, results: &[Image]) -> Result<(), Failure> {
    if results.is_empty() {
        return Err("no image to save".into());
    }
    if let Some(dir) = Path::new(&o.cli.output).parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("failed to create directory '{}': {e}", dir.display()))?;
    }
    let batch = o.gen.params.batch_count;
    let per_batch = if batch > 0 { (results.len() / batch as usize).max(1) } else { 1 };
    let paths = image_paths(&o.cli.output, results.len(), o.cli.output_begin_idx);
    let mut saved = 0;
    for (i, (img, path)) in results.iter().zip(&paths).enumerate() {
        if img.is_empty() {
            continue;
        }
        // Every frame of a video has the request's seed.
        let seed = if o.cli.mode == Mode::VidGen { o.gen.params.seed } else { o.gen.params.seed + (i / per_batch) as i64 };
        let params = if o.gen.embed_metadata { image_parameters(o, seed, o.cli.mode) } else { String::new() };
        match write_image(Path::new(path), img, &params) {
            Ok(()) => {
                sd_info!("save result image {i} to '{path}' (success)");
                saved += 1;
            }
            Err(e) => sd_error!("save result image {i} to '{path}' (failure): {e}"),
        }
    }
    sd_info!("{saved}/{} images saved", results.len());
    if saved == 0 {
        return Err("no image was saved".into());
    }
    Ok(())
}

/// Writes a video request's results, as the reference does: with a printf-style number in
/// the output name, every frame as a picture; else several frames as one MJPEG AVI (audio
/// muxed in) at --fps, and a single frame as a picture (audio beside it as a WAV file).
pub fn save_video_results(o: &Opts, frames: &[Image], audio: Option<&Audio>) -> Result<(), Failure> {
    if frames.is_empty() {
        return Err("no frame to save".into());
    }
    let output = &o.cli.output;
    if has_number_field(output) {
        if audio.is_some() {
            sd_warn!("the generated audio is not saved with numbered frames (name the output .avi to keep it)");
        }
        return save_results(o, frames);
    }
    if frames.len() > 1 {
        if let Some(dir) = Path::new(output).parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("failed to create directory '{}': {e}", dir.display()))?;
        }
        let (path, unsupported) = video_path(output);
        if let Some(ext) = unsupported {
            sd_warn!("{ext} video is not written by this sd-cli: writing an MJPEG AVI to '{path}' instead");
        }
        return match avi::write(Path::new(&path), frames, o.gen.video.fps, audio) {
            Ok(()) => {
                sd_info!("save result video to '{path}'");
                Ok(())
            }
            Err(e) => Err(format!("Failed to save result video to '{path}': {e}")),
        };
    }
    save_results(o, frames)?;
    if let Some(a) = audio {
        let wav = audio_sidecar_path(output);
        match avi::write_wav(Path::new(&wav), a) {
            Ok(()) => sd_info!("save result audio to '{wav}'"),
            Err(e) => sd_warn!("failed to save result audio to '{wav}': {e}"),
        }
    }
    Ok(())
}

/// Loads the models, generates the video and returns its frames and sound.
fn generate_video(o: &mut Opts) -> Result<(Vec<Image>, Option<Audio>), Failure> {
    let mut inputs = VidGenParams::default();
    load_video_inputs(o, &mut inputs)?;
    let sd = Context::new(&o.ctx_params()).map_err(|e| format!("new_sd_ctx_t failed: {e}"))?;
    let default_method = sd.default_sample_method();
    let sp = &mut o.gen.params.sample_params;
    let method = *sp.sample_method.get_or_insert(default_method);
    sp.scheduler.get_or_insert_with(|| sd.default_scheduler(Some(method)));
    o.gen.video.high_noise.sample_method.get_or_insert(default_method);
    let request = VidGenParams {
        init_image: inputs.init_image,
        end_image: inputs.end_image,
        ref_images: inputs.ref_images,
        ref_videos: inputs.ref_videos,
        ref_audios: inputs.ref_audios,
        control_frames: inputs.control_frames,
        ..o.vid_gen_params()
    };
    let out = sd.generate_video(&request).map_err(|e| format!("generate failed: {e}"))?;
    if out.frames.is_empty() {
        return Err("generate failed".into());
    }
    Ok((out.frames, out.audio))
}

/// Everything after argument checking.
pub fn run(mut o: Opts) -> Result<(), Failure> {
    let mode = o.cli.mode;
    if mode == Mode::Metadata {
        let c = &o.cli;
        let opts = crate::inspect::Options { json: c.metadata_format == "json", raw: c.metadata_raw, brief: c.metadata_brief, all: c.metadata_all };
        return crate::inspect::print_report(&c.image_path, opts);
    }
    if let Some(model) = &o.ctx.default_model {
        sd_info!("no --model given: using the default model '{}' (set {} to change it)", model.display(), crate::args::DEFAULT_MODEL_ENV);
    }
    install_preview(&o);
    sd_debug!("{}", crate::args::version_string());
    sd_debug!("{}", stable_diffusion::graph::backend::system_info());
    sd_debug!("{:#?}", o);

    if !o.cli.imatrix_out.is_empty() {
        if Path::new(&o.cli.imatrix_out).exists() && !o.cli.imatrix_in.contains(&o.cli.imatrix_out) {
            sd_warn!("imatrix file '{}' already exists and will be overwritten", o.cli.imatrix_out);
        }
        api::enable_imatrix_collection();
    }
    for f in &o.cli.imatrix_in {
        sd_info!("loading imatrix from '{f}'");
        if let Err(e) = api::load_imatrix(Path::new(f)) {
            sd_warn!("failed to load imatrix from '{f}': {e}");
        }
    }

    if mode == Mode::Convert {
        return convert(&o);
    }

    if mode == Mode::VidGen {
        let (mut frames, audio) = generate_video(&mut o)?;
        if !o.ctx.upscale_model.is_empty() && o.gen.upscale_repeats > 0 {
            upscale(&o, &mut frames);
        }
        save_video_results(&o, &frames, audio.as_ref())?;
        save_imatrix(&o);
        return Ok(());
    }

    let mut params = ImgGenParams::default();
    load_inputs(&mut o, &mut params)?;

    let mut results = if mode == Mode::Upscale {
        params.init_image.take().into_iter().collect()
    } else {
        let sd = Context::new(&o.ctx_params()).map_err(|e| format!("new_sd_ctx_t failed: {e}"))?;
        let sp = &mut o.gen.params.sample_params;
        let method = *sp.sample_method.get_or_insert_with(|| sd.default_sample_method());
        sp.scheduler.get_or_insert_with(|| sd.default_scheduler(Some(method)));
        let request = ImgGenParams {
            init_image: params.init_image,
            ref_images: params.ref_images,
            mask_image: params.mask_image,
            control_image: params.control_image,
            ip_adapter_image: params.ip_adapter_image,
            pm_params: stable_diffusion::api::PmParams { id_images: params.pm_params.id_images, ..o.gen.params.pm_params.clone() },
            ..o.img_gen_params()
        };
        let mut results = match mode {
            Mode::Adetailer => request.init_image.clone().into_iter().collect(),
            _ => sd.generate_image(&request).map_err(|e| format!("generate failed: {e}"))?,
        };
        if results.is_empty() {
            return Err("generate failed".into());
        }
        apply_adetailer(&o, &sd, &request, &mut results)?;
        results
    };

    if !o.ctx.upscale_model.is_empty() && o.gen.upscale_repeats > 0 {
        upscale(&o, &mut results);
    }
    save_results(&o, &results)?;
    save_imatrix(&o);
    Ok(())
}

fn save_imatrix(o: &Opts) {
    if !o.cli.imatrix_out.is_empty() {
        sd_info!("saving imatrix to '{}'", o.cli.imatrix_out);
        if let Err(e) = api::save_imatrix(Path::new(&o.cli.imatrix_out)) {
            sd_error!("failed to save imatrix to '{}': {e}", o.cli.imatrix_out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{parse, Parsed};

    fn opts(argv: &[&str]) -> Opts {
        let Ok(Parsed::Run(o)) = parse(argv) else { panic!("{argv:?}") };
        *o
    }

    #[test]
    fn preview_targets() {
        // A still image previews to the path as given.
        assert_eq!(preview_target(&opts(&["--preview", "vae"])), ("preview.png".into(), 16));
        // More than 4 frames: a .png preview becomes an AVI (as the reference does), at the
        // video's fps, a quarter of it for the latent projection.
        let v = ["-M", "vid_gen", "--video-frames", "9", "--fps", "24", "--preview"];
        assert_eq!(preview_target(&opts(&[&v[..], &["vae"]].concat())), ("preview.avi".into(), 24));
        assert_eq!(preview_target(&opts(&[&v[..], &["proj"]].concat())), ("preview.avi".into(), 6));
        assert_eq!(preview_target(&opts(&[&v[..], &["tae", "--preview-path", "p.webm"]].concat())), ("p.avi".into(), 24));
        assert_eq!(preview_target(&opts(&["-M", "vid_gen", "--video-frames", "3", "--preview", "vae"])), ("preview.png".into(), 16));
    }
}
