//! Saving results: file names, pixels and the `parameters` text read back from the PNGs.

mod common;

use common::opts;
use sd_cli::image_io::{decode_png_file, png_text_chunks};
use sd_cli::run::save_results;
use stable_diffusion::api::Image;
use stable_diffusion::types::SampleMethod;

fn image(seed: u8) -> Image {
    Image::new(4, 2, 3, (0..24).map(|i| i as u8 * 10 + seed).collect()).unwrap()
}

fn parameters(path: &std::path::Path) -> String {
    let chunks = png_text_chunks(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].0, "parameters");
    String::from_utf8(chunks[0].1.clone()).unwrap()
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-save-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn single_image_with_reference_parameters_text() {
    let dir = tmpdir("single");
    let out = dir.join("sub/output.png");
    let o = opts(&["-m", "/models/sd1.safetensors", "-p", "a lovely cat", "-W", "64", "-H", "64", "--steps", "4", "-o", out.to_str().unwrap()]);
    save_results(&o, &[image(1)]).unwrap();
    assert_eq!(decode_png_file(&out).unwrap(), image(1));
    let (v, c) = (stable_diffusion::api::version(), stable_diffusion::api::commit());
    let expected = format!(
        "a lovely cat\nSteps: 4, CFG scale: 7.000000, Guidance: 3.500000, Eta: inf, Seed: 42, Size: 64x64, \
         Model: sd1.safetensors, RNG: cuda, Sampler: euler_a discrete, Version: stable-diffusion.cpp, SDCPP: \
         {{\"auto_resize_ref_image\":true,\"clip_skip\":-1,\"control_strength\":0.8999999761581421,\
         \"generator\":{{\"commit\":\"{c}\",\"name\":\"stable-diffusion.cpp\",\"version\":\"{v}\"}},\"height\":64,\
         \"increase_ref_index\":false,\"ip_adapter_strength\":1.0,\"mode\":\"img_gen\",\
         \"models\":{{\"model\":\"sd1.safetensors\"}},\"prompt\":{{\"negative\":\"\",\"positive\":\"a lovely cat\"}},\
         \"rng\":\"cuda\",\"sampling\":{{\"custom_sigmas\":[],\"eta\":null,\"extra_sample_args\":\"\",\"flow_shift\":null,\
         \"guidance\":{{\"distilled_guidance\":3.5,\"img_cfg\":null,\"slg\":{{\"end\":0.20000000298023224,\
         \"layers\":[7,8,9],\"scale\":0.0,\"start\":0.009999999776482582}},\"txt_cfg\":7.0}},\"method\":\"euler_a\",\
         \"scheduler\":\"discrete\",\"shifted_timestep\":0,\"steps\":4}},\"schema\":\"sdcpp.image.params/v1\",\
         \"seed\":42,\"strength\":0.75,\"width\":64}}"
    );
    assert_eq!(parameters(&out), expected);
    // Nothing but the image is left in the folder (no temporary file).
    let names: Vec<_> = std::fs::read_dir(dir.join("sub")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec!["output.png"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn batches_are_numbered_with_their_seeds() {
    let dir = tmpdir("batch");
    let out = dir.join("cat.png");
    let o = opts(&["-m", "m.gguf", "-p", "cat <lora:none:1>", "-n", "dog", "-b", "3", "-s", "100", "--sigmas", "1.5,0.25,0", "--clip-skip", "2", "--slg-scale", "2.5", "--vae", "/v/vae.safetensors", "--clip_l", "cl.safetensors", "--sampler-rng", "cpu", "-o", out.to_str().unwrap()]);
    save_results(&o, &[image(0), image(1), image(2)]).unwrap();
    for i in 0..3u8 {
        let p = dir.join(format!("cat_{i}.png"));
        assert_eq!(decode_png_file(&p).unwrap(), image(i));
        let text = parameters(&p);
        assert!(text.starts_with("cat <lora:none:1>\nNegative prompt: dog\nSteps: 20, CFG scale: 7.000000, SLG scale: 2.500000, Skip layers: [7, 8, 9, ], Skip layer start: 0.010000, Skip layer end: 0.200000, Guidance: 3.500000, Eta: inf, "), "{text}");
        assert!(text.contains(&format!(", Seed: {}, Size: 512x512, Model: m.gguf, RNG: cuda, Sampler RNG: cpu, Sampler: euler_a, Custom Sigmas: [1.5000, 0.2500, 0.0000], TE: cl.safetensors, VAE: vae.safetensors, Clip skip: 2, Version: stable-diffusion.cpp, SDCPP: {{", 100 + u32::from(i))), "{text}");
        assert!(text.contains(&format!("\"seed\":{},", 100 + u32::from(i))) && text.contains("\"sampler_rng\":\"cpu\""), "{text}");
        assert!(text.contains("\"prompt\":{\"negative\":\"dog\",\"positive\":\"cat \"}"), "{text}");
    }
    assert!(!dir.join("cat.png").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn numbered_pattern_and_no_metadata() {
    let dir = tmpdir("pattern");
    let pattern = dir.join("frame_%03d");
    let o = opts(&["-m", "m.gguf", "-o", pattern.to_str().unwrap(), "--output-begin-idx", "7", "--disable-image-metadata"]);
    save_results(&o, &[image(0), image(1)]).unwrap();
    for n in ["frame_007.png", "frame_008.png"] {
        let bytes = std::fs::read(dir.join(n)).unwrap();
        assert!(png_text_chunks(&bytes).unwrap().is_empty());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn failing_writes_are_reported() {
    let dir = tmpdir("fail");
    // The output's folder cannot be made: a file stands in its way.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("file"), b"").unwrap();
    let o = opts(&["-m", "m.gguf", "-o", dir.join("file/x.png").to_str().unwrap()]);
    assert!(save_results(&o, &[image(0)]).is_err());
    assert!(save_results(&o, &[]).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn video_frames_carry_the_video_parameters() {
    let dir = tmpdir("video");
    let out = dir.join("f_%d.png");
    let mut o = opts(&["-M", "vid_gen", "-m", "wan.gguf", "-p", "a cat", "--video-frames", "5", "--fps", "12", "--moe-boundary", "0.9",
                       "--high-noise-steps", "2", "--high-noise-cfg-scale", "3", "-s", "9", "-o", out.to_str().unwrap()]);
    o.gen.video.high_noise.sample_method = Some(SampleMethod::Euler);
    save_results(&o, &[image(0), image(1)]).unwrap();
    for n in 0..2 {
        let text = parameters(&dir.join(format!("f_{n}.png")));
        assert!(text.contains("Seed: 9, "), "{text}");
        for part in [
            "\"mode\":\"vid_gen\"",
            "\"video\":{\"fps\":12,\"frame_count\":5}",
            "\"moe_boundary\":0.8999999761581421",
            "\"vace_strength\":1.0",
            "\"high_noise_sampling\":{\"eta\":null,\"extra_sample_args\":\"\",\"flow_shift\":null,\"guidance\":{\"distilled_guidance\":3.5,\"img_cfg\":null,\"slg\":{\"end\":0.20000000298023224,\"layers\":[7,8,9],\"scale\":0.0,\"start\":0.009999999776482582},\"txt_cfg\":3.0},\"method\":\"euler\",\"shifted_timestep\":0,\"steps\":2}",
        ] {
            assert!(text.contains(part), "{part} not in {text}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
