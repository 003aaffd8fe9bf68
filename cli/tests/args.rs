//! Option parsing and resolution: every option, the values the library receives, and the
//! errors for bad command lines.

use sd_cli::args::{self, options, parse, Mode, Opts, Parsed};
use stable_diffusion::types::{HiresUpscaler, LoraApplyMode, Prediction, Preview, RngType, SampleMethod, Scheduler, SdType, VaeFormat};

fn run_opts(argv: &[&str]) -> Opts {
    match parse(argv) {
        Ok(Parsed::Run(o)) => *o,
        other => panic!("{argv:?} did not parse as a run: {other:?}"),
    }
}

fn err(argv: &[&str]) -> String {
    match parse(argv) {
        Err(e) => e.0,
        other => panic!("{argv:?} should be rejected, got {other:?}"),
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A value that differs from the option's default.
fn sample_value(long: &str, hint: &str, prompt_file: &str) -> String {
    let manual = [
        ("--mode", "convert"),
        ("--preview", "proj"),
        ("--imat-in", "in.dat"),
        ("--type", "q8_0"),
        ("--rng", "cpu"),
        ("--sampler-rng", "cpu"),
        ("--prediction", "v"),
        ("--lora-apply-mode", "at_runtime"),
        ("--seed", "7"),
        ("--sampling-method", "euler"),
        ("--scheduler", "karras"),
        ("--sigmas", "14.6,7.8,0"),
        ("--hires-sigmas", "[0.8, 0.4, 0]"),
        ("--skip-layers", "[1,2]"),
        ("--high-noise-skip-layers", "[1,2]"),
        ("--high-noise-sampling-method", "euler"),
        ("--ref-image", "ref.png"),
        ("--cache-mode", "ucache"),
        ("--cache-option", "threshold=1.5"),
        ("--scm-mask", "1,0,1"),
        ("--scm-policy", "static"),
        ("--vae-tile-size", "64x32"),
        ("--vae-relative-tile-size", "0.5"),
    ];
    if long == "--prompt-file" || long == "--negative-prompt-file" {
        return prompt_file.to_string();
    }
    if let Some((_, v)) = manual.iter().find(|(n, _)| *n == long) {
        return v.to_string();
    }
    match hint {
        "<int>" => "5".into(),
        "<float>" => "0.25".into(),
        _ => "some_value".into(),
    }
}

#[test]
fn every_option_parses_and_changes_something() {
    let dir = tmpdir("every");
    let prompt_file = dir.join("prompt.txt");
    std::fs::write(&prompt_file, "from a file").unwrap();
    let default = format!("{:?}", Opts::default());
    let mut count = 0;
    for o in options() {
        let name = if o.long.is_empty() { o.short } else { o.long };
        let mut argv = vec![name.to_string()];
        if o.takes_value() {
            argv.push(sample_value(o.long, o.hint(), prompt_file.to_str().unwrap()));
        }
        match parse(&argv) {
            Ok(Parsed::Run(opts)) => assert_ne!(format!("{opts:?}"), default, "{argv:?} changed nothing"),
            Ok(action) => assert!(["--help", "--version", "--info", "--list-devices"].contains(&o.long), "{argv:?} gave {action:?}"),
            Err(e) => panic!("{argv:?}: {e}"),
        }
        if !o.short.is_empty() && !o.long.is_empty() {
            let mut short = argv.clone();
            short[0] = o.short.to_string();
            assert_eq!(format!("{:?}", parse(&short)), format!("{:?}", parse(&argv)), "{} and {} differ", o.short, o.long);
        }
        count += 1;
    }
    assert!(count >= 140, "only {count} options");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_reference_option_is_known() {
    // The reference sd-cli's options (97d29908); each is accepted and in the usage text.
    let reference = "-o --output --image --metadata-format --preview-path --imat-out --preview-interval --output-begin-idx \
        --canny --convert-name -v --verbose --color --taesd-preview-only --preview-noisy --metadata-raw --metadata-brief \
        --metadata-all -M --mode --preview -h --help --imat-in -m --model --clip_l --clip_g --clip_vision --t5xxl --llm \
        --llm_vision --qwen2vl --qwen2vl_vision --diffusion-model --high-noise-diffusion-model --uncond-diffusion-model \
        --embeddings-connectors --vae --vae-format --audio-vae --taesd --tae --control-net --ip-adapter --motion-module \
        --embd-dir --lora-model-dir --hires-upscalers-dir --tensor-type-rules --model-args --photo-maker --pulid-weights \
        --upscale-model --backend --params-backend --split-mode --rpc-servers --max-vram -t --threads --stream-layers \
        --eager-load --auto-fit --force-sdxl-vae-conv-scale --offload-to-cpu --mmap --control-net-cpu --clip-on-cpu \
        --vae-on-cpu --fa --diffusion-fa --diffusion-conv-direct --vae-conv-direct --type --rng --sampler-rng --prediction \
        --lora-apply-mode --list-devices -p --prompt -n --negative-prompt --ad-model --ad-prompt --ad-negative-prompt \
        --extra-ad-args -i --init-img --end-img --mask --control-image --ip-adapter-image --control-video \
        --pm-id-images-dir --pm-id-embed-path --pulid-id-embedding --hires-upscaler --extra-sample-args \
        --extra-tiling-args --ref-image-args -H --height -W --width --steps --high-noise-steps --clip-skip -b \
        --batch-count --qwen-image-layers --video-frames --fps --timestep-shift --upscale-repeats --upscale-tile-size \
        --hires-width --hires-height --hires-steps --hires-upscale-tile-size --cfg-scale --img-cfg-scale --guidance \
        --slg-scale --skip-layer-start --skip-layer-end --eta --flow-shift --high-noise-cfg-scale \
        --high-noise-img-cfg-scale --high-noise-guidance --high-noise-slg-scale --high-noise-skip-layer-start \
        --high-noise-skip-layer-end --high-noise-eta --strength --pm-style-strength --pulid-id-weight --control-strength \
        --ip-adapter-strength --moe-boundary --vace-strength --vae-tile-overlap --hires-scale --hires-denoising-strength \
        --increase-ref-index --disable-auto-resize-ref-image --circular --circularx --circulary --disable-image-metadata \
        --vae-tiling --temporal-tiling --hires -s --seed --sampling-method --high-noise-sampling-method --scheduler \
        --sigmas --hires-sigmas --skip-layers --high-noise-skip-layers -r --ref-image --ref-video --ref-video-audio \
        --ref-audio --cache-mode --cache-option --scm-mask --scm-policy --vae-tile-size --vae-relative-tile-size \
        --prompt-file --negative-prompt-file";
    let table = options();
    let usage = args::usage("sd-cli");
    for flag in reference.split_whitespace() {
        assert!(table.iter().any(|o| o.short == flag || o.long == flag), "{flag} is not an option");
        assert!(usage.contains(flag), "{flag} missing from the usage text");
    }
}

#[test]
fn values_reach_the_library_parameters() {
    let o = run_opts(&[
        "-m", "/m/sd.safetensors", "--vae", "v.safetensors", "--clip_l", "cl.safetensors", "--t5xxl", "t5.gguf",
        "--taesd", "taesd.safetensors", "--control-net", "cn.safetensors", "--diffusion-model", "unet.gguf",
        "-p", "a lovely cat", "-n", "ugly", "-W", "64", "-H", "48", "--steps", "4", "--cfg-scale", "5.5",
        "--img-cfg-scale", "1.5", "--guidance", "2", "--sampling-method", "dpm++2m", "--scheduler", "normal",
        "--sigmas", "[1.5, 0.5,0]", "--eta", "0.3", "-s", "-1", "-b", "3", "--strength", "0.4", "--control-strength", "0.6",
        "--clip-skip", "2", "--rng", "std_default", "--sampler-rng", "cpu", "--prediction", "edm_v", "--type", "q4_K",
        "--tensor-type-rules", "^vae\\.=f16", "--tensor-type-rules", "model\\.=q8_0", "-t", "3", "-o", "out/x.png",
        "-v", "--color", "--vae-tiling", "--vae-tile-size", "40", "--vae-tile-overlap", "0.25", "--fa", "--diffusion-fa",
        "--diffusion-conv-direct", "--vae-conv-direct", "--backend", "cpu", "--params-backend", "disk", "--mmap",
        "--lora-apply-mode", "immediately", "--vae-format", "flux", "-i", "init.png", "--mask", "mask.png",
        "--control-image", "c.png", "--preview", "tae", "--preview-path", "p.png", "--preview-interval", "2",
        "--hires", "--hires-scale", "1.5", "--upscale-model", "esr.pth", "--upscale-repeats", "2", "--circularx",
    ]);
    let c = &o.ctx.params;
    assert_eq!(c.model_path.as_deref(), Some("/m/sd.safetensors"));
    assert_eq!(c.vae_path.as_deref(), Some("v.safetensors"));
    assert_eq!(c.clip_l_path.as_deref(), Some("cl.safetensors"));
    assert_eq!(c.t5xxl_path.as_deref(), Some("t5.gguf"));
    assert_eq!(c.taesd_path.as_deref(), Some("taesd.safetensors"));
    assert_eq!(c.control_net_path.as_deref(), Some("cn.safetensors"));
    assert_eq!(c.diffusion_model_path.as_deref(), Some("unet.gguf"));
    assert_eq!(c.tensor_type_rules.as_deref(), Some("^vae\\.=f16,model\\.=q8_0"));
    assert_eq!((c.rng_type, c.sampler_rng_type, c.prediction, c.wtype), (RngType::StdDefault, Some(RngType::Cpu), Some(Prediction::EdmV), Some(SdType::Q4K)));
    assert_eq!(c.n_threads, 3);
    assert!(c.flash_attn && c.diffusion_flash_attn && c.diffusion_conv_direct && c.vae_conv_direct && c.enable_mmap);
    assert_eq!((c.backend.as_deref(), c.params_backend.as_deref()), (Some("cpu"), Some("disk")));
    assert_eq!(c.lora_apply_mode, LoraApplyMode::Immediately);
    assert_eq!(o.ctx.vae_format, "flux");
    assert_eq!(o.ctx.upscale_model, "esr.pth");

    let g = &o.gen;
    let p = &g.params;
    let sp = &p.sample_params;
    assert_eq!((p.prompt.as_str(), p.negative_prompt.as_str()), ("a lovely cat", "ugly"));
    assert_eq!((g.width, g.height, sp.sample_steps), (64, 48, 4));
    assert_eq!((sp.guidance.txt_cfg, sp.guidance.img_cfg, sp.guidance.distilled_guidance), (5.5, 1.5, 2.0));
    assert_eq!((sp.sample_method, sp.scheduler), (Some(SampleMethod::Dpmpp2m), Some(Scheduler::Discrete)));
    assert_eq!(sp.custom_sigmas, vec![1.5, 0.5, 0.0]);
    assert_eq!((sp.eta, p.seed, p.batch_count, p.strength, p.control_strength, p.clip_skip), (0.3, -1, 3, 0.4, 0.6, 2));
    let t = &p.vae_tiling_params;
    assert!(t.enabled);
    assert_eq!((t.tile_size_x, t.tile_size_y, t.target_overlap), (40, 40, 0.25));
    assert_eq!((g.init_img.as_str(), g.mask.as_str(), g.control_image.as_str()), ("init.png", "mask.png", "c.png"));
    assert!(p.hires.enabled);
    assert_eq!(p.hires.scale, 1.5);
    assert_eq!((g.upscale_repeats, g.circular_x, g.circular_y), (2, true, false));

    let cli = &o.cli;
    assert_eq!((cli.output.as_str(), cli.verbose, cli.color), ("out/x.png", true, true));
    assert_eq!((cli.preview, cli.preview_path.as_str(), cli.preview_interval), (Preview::Tae, "p.png", 2));
    assert_eq!(cli.mode, Mode::ImgGen);
}

#[test]
fn bad_values_are_rejected_with_a_reason() {
    assert!(err(&["--sampling-method", "euler_x"]).contains("invalid sample method euler_x"));
    assert!(err(&["--scheduler", "fast"]).contains("invalid scheduler fast"));
    assert!(err(&["--rng", "gpu"]).contains("invalid rng type gpu"));
    assert!(err(&["--type", "Q8_0"]).contains("invalid weight format Q8_0"));
    assert!(err(&["--prediction", "x"]).contains("invalid prediction type x"));
    assert!(err(&["-M", "paint"]).contains("invalid mode paint"));
    assert!(err(&["--preview", "all"]).contains("invalid preview method all"));
    let e = err(&["-W", "wide"]);
    assert!(e.contains("'wide' is not an integer") && e.contains("invalid parameter for argument: -W"), "{e}");
    assert!(err(&["--cfg-scale", "high"]).contains("not a number"));
    assert!(err(&["-s", "1.5"]).contains("not an integer"));
    assert!(err(&["--sigmas", "1,x"]).contains("invalid float value 'x'"));
    assert!(err(&["--skip-layers", "7,8"]).contains("bracketed"));
    assert!(err(&["--vae-tile-size", "axb"]).contains("XxY"));
    assert!(err(&["--cache-mode", "fast"]).contains("invalid cache mode"));
    assert!(err(&["--scm-policy", "x"]).contains("invalid scm policy"));
    assert!(err(&["--prompt-file", "/nonexistent/prompt.txt"]).contains("failed to read prompt file"));
    assert_eq!(err(&["-p", "x", "--steps"]), "error: invalid parameter for argument: --steps");
    assert_eq!(err(&["--bogus"]), "error: unknown argument: --bogus");
    assert_eq!(err(&["--steps=4"]), "error: unknown argument: --steps=4");
    assert_eq!(err(&["-p", "cat", "extra"]), "error: unknown argument: extra");
}

#[test]
fn actions_stop_parsing() {
    assert!(matches!(parse(&["-h", "--bogus"]), Ok(Parsed::Help)));
    assert!(matches!(parse(&["-p", "x", "--list-devices", "--bogus"]), Ok(Parsed::ListDevices)));
    assert!(matches!(parse(&["--version"]), Ok(Parsed::Version)));
    assert!(matches!(parse(&["--info"]), Ok(Parsed::Info)));
    assert!(parse(&["--bogus", "-h"]).is_err());
}

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn resolution_checks_like_the_reference() {
    let resolve = |argv: &[&str]| {
        let mut o = run_opts(argv);
        o.resolve(&no_env).map(|_| o)
    };
    let m = ["-m", "model.safetensors"];
    let with = |extra: &[&'static str]| [&m[..], extra].concat();
    assert!(resolve(&with(&["--strength", "1.5"])).unwrap_err().contains("strength in [0.0, 1.0]"));
    assert!(resolve(&with(&["--steps", "0"])).unwrap_err().contains("sample_steps"));
    assert!(resolve(&with(&["-b", "0"])).unwrap_err().contains("batch_count"));
    assert!(resolve(&with(&["--cfg-scale", "-1"])).unwrap_err().contains("cfg_scale"));
    assert!(resolve(&with(&["--vae-format", "xyz"])).unwrap_err().contains("vae_format"));
    assert!(resolve(&with(&["--timestep-shift", "2000"])).unwrap_err().contains("shifted_timestep"));
    assert!(resolve(&with(&["--cache-mode", "ucache", "--cache-option", "threshold"])).unwrap_err().contains("missing '='"));
    assert!(resolve(&with(&["--cache-mode", "ucache", "--cache-option", "speed=1"])).unwrap_err().contains("unknown cache parameter"));
    assert!(resolve(&with(&["--hires", "--hires-upscaler", "my/model"])).unwrap_err().contains("hires upscaler"));
    assert!(resolve(&with(&["-M", "upscale", "-i", "x.png"])).unwrap_err().contains("--upscale-model"));
    assert!(resolve(&with(&["-M", "upscale", "--upscale-model", "e.pth"])).unwrap_err().contains("init image"));
    assert!(resolve(&with(&["-M", "adetailer", "-i", "x.png"])).unwrap_err().contains("--ad-model"));
    assert!(resolve(&["-M", "convert"]).unwrap_err().contains("at least one model input"));
    assert!(resolve(&["-o", ""]).is_err());

    let o = resolve(&["-M", "convert", "--vae", "v.safetensors"]).unwrap();
    assert_eq!(o.cli.output, "output.gguf");
    let o = resolve(&with(&["-s", "-5", "-t", "0", "--cache-mode", "ucache", "--cache-option", "threshold=1.5,start=0.2,"])).unwrap();
    assert!((0..=i64::from(i32::MAX)).contains(&o.gen.params.seed));
    assert!(o.ctx.params.n_threads > 0);
    assert_eq!((o.gen.params.cache.reuse_threshold, o.gen.params.cache.start_percent), (1.5, 0.2));
    let o = resolve(&with(&["--hires", "--hires-upscaler", "None"])).unwrap();
    assert!(!o.gen.params.hires.enabled);
    let o = resolve(&with(&["--hires", "--hires-upscaler", "Lanczos"])).unwrap();
    assert_eq!(o.gen.params.hires.upscaler, HiresUpscaler::Lanczos);
    assert_eq!(o.ctx.params.vae_format, VaeFormat::Auto);
}

#[test]
fn default_model_only_without_a_model() {
    let dir = tmpdir("default-model");
    let model = dir.join("sd1.safetensors");
    std::fs::write(&model, b"x").unwrap();
    let model_s = model.to_str().unwrap().to_string();
    let env = move |k: &str| (k == "SD_CLI_MODEL").then(|| model_s.clone());
    let mut o = run_opts(&["-p", "a lovely cat"]);
    o.resolve(&env).unwrap();
    assert_eq!(o.ctx.params.model_path.as_deref(), model.to_str());
    assert_eq!(o.ctx.default_model.as_deref(), Some(model.as_path()));
    let mut o = run_opts(&["--diffusion-model", "unet.gguf"]);
    o.resolve(&env).unwrap();
    assert_eq!((o.ctx.params.model_path.as_deref(), o.ctx.default_model.as_ref()), (None, None));
    let mut o = run_opts(&["-p", "x"]);
    let missing = |k: &str| (k == "SD_CLI_MODEL").then(|| "/nonexistent/sd1.safetensors".to_string());
    let e = o.resolve(&missing).unwrap_err();
    assert!(e.contains("model_path/diffusion_model") && e.contains("/nonexistent/sd1.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn loras_and_embeddings_come_from_their_directories() {
    let dir = tmpdir("lora");
    for f in ["cat.safetensors", "dog.ckpt", "emb_a.pt", "emb_b.gguf", "notes.txt"] {
        std::fs::write(dir.join(f), b"x").unwrap();
    }
    let d = dir.to_str().unwrap();
    let prompt = "a <lora:cat:0.5> and <lora:dog:1> <lora:cat:0.25> <lora:|high_noise|dog:2> <lora:missing:1> x";
    let mut o = run_opts(&["-m", "m.gguf", "-p", prompt, "--lora-model-dir", d, "--embd-dir", d]);
    o.resolve(&no_env).unwrap();
    assert_eq!(o.gen.params.prompt, "a  and     x");
    assert_eq!(o.gen.prompt_with_lora, prompt);
    let cat = format!("{d}/cat.safetensors");
    let dog = format!("{d}/dog.ckpt");
    assert_eq!(o.gen.loras.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(), vec![(cat.as_str(), 0.75), (dog.as_str(), 1.0)]);
    assert_eq!(o.gen.high_noise_loras.get(&dog), Some(&2.0));
    let names: Vec<_> = o.ctx.params.embeddings.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, vec!["cat", "dog", "emb_a", "emb_b"]);
    let p = o.img_gen_params();
    assert_eq!(p.loras.len(), 3);
    assert!(p.loras[2].is_high_noise && p.loras[2].multiplier == 2.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn request_parameters() {
    let mut o = run_opts(&["-m", "m.gguf", "--circular", "--skip-layers", "[3 4]", "--clip-on-cpu", "--vae-on-cpu", "--backend", "cuda0", "--offload-to-cpu", "--taesd-preview-only", "--disable-auto-resize-ref-image"]);
    o.resolve(&no_env).unwrap();
    let p = o.img_gen_params();
    assert!(p.circular_x && p.circular_y);
    assert_eq!((p.width, p.height, p.seed), (512, 512, 42));
    assert_eq!(p.sample_params.guidance.slg.layers, vec![3, 4]);
    assert_eq!(p.ref_image_args, "resize_before_vae=0");
    let c = o.ctx_params();
    assert_eq!(c.backend.as_deref(), Some("vae=cpu,te=cpu,cuda0"));
    assert_eq!(c.params_backend.as_deref(), Some("*=cpu"));
    assert!(c.tae_preview_only);
    assert_eq!(c.max_vram.as_deref(), Some("0"));
}

#[test]
fn video_options_reach_the_request() {
    let mut o = run_opts(&[
        "-M", "vid_gen", "--diffusion-model", "low.gguf", "--high-noise-diffusion-model", "high.gguf", "--t5xxl", "umt5.gguf",
        "--clip_vision", "cv.safetensors", "-p", "a cat", "-n", "blurry", "-W", "832", "-H", "480", "-i", "first.png",
        "--end-img", "last.png", "--control-video", "frames", "--video-frames", "33", "--fps", "24", "--steps", "8",
        "--cfg-scale", "1", "--skip-layers", "[9]", "--high-noise-steps", "4", "--high-noise-cfg-scale", "3.5",
        "--high-noise-img-cfg-scale", "2", "--high-noise-guidance", "4", "--high-noise-slg-scale", "1.5",
        "--high-noise-skip-layer-start", "0.1", "--high-noise-skip-layer-end", "0.3", "--high-noise-skip-layers", "[1 2]",
        "--high-noise-eta", "0.5", "--high-noise-sampling-method", "dpm++2m", "--moe-boundary", "0.9", "--vace-strength", "0.6",
        "--temporal-tiling", "--vae-tiling", "--flow-shift", "5", "--strength", "0.5", "-s", "11", "--circulary",
        "--ref-video", "rv1", "--ref-video", "rv2", "--ref-video-audio", "a1.wav", "--ref-audio", "x.wav",
    ]);
    o.resolve(&no_env).unwrap();
    let c = &o.ctx.params;
    assert_eq!((c.diffusion_model_path.as_deref(), c.high_noise_diffusion_model_path.as_deref()), (Some("low.gguf"), Some("high.gguf")));
    assert_eq!((c.t5xxl_path.as_deref(), c.clip_vision_path.as_deref()), (Some("umt5.gguf"), Some("cv.safetensors")));
    let v = &o.gen.video;
    assert_eq!((v.end_img.as_str(), v.control_video.as_str()), ("last.png", "frames"));
    assert_eq!((v.ref_videos.clone(), v.ref_video_audios.clone(), v.ref_audios.clone()), (vec!["rv1".to_string(), "rv2".into()], vec!["a1.wav".to_string()], vec!["x.wav".to_string()]));

    let p = o.vid_gen_params();
    assert_eq!((p.prompt.as_str(), p.negative_prompt.as_str(), p.width, p.height, p.seed), ("a cat", "blurry", 832, 480, 11));
    assert_eq!((p.video_frames, p.fps, p.moe_boundary, p.vace_strength, p.strength), (33, 24, 0.9, 0.6, 0.5));
    assert!(p.vae_tiling_params.enabled && p.vae_tiling_params.temporal_tiling && p.circular_y && !p.circular_x);
    let sp = &p.sample_params;
    assert_eq!((sp.sample_steps, sp.guidance.txt_cfg, sp.flow_shift, sp.guidance.slg.layers.clone()), (8, 1.0, 5.0, vec![9]));
    let hp = &p.high_noise_sample_params;
    assert_eq!((hp.sample_steps, hp.sample_method, hp.eta), (4, Some(SampleMethod::Dpmpp2m), 0.5));
    let g = &hp.guidance;
    assert_eq!((g.txt_cfg, g.img_cfg, g.distilled_guidance, g.slg.scale, g.slg.layer_start, g.slg.layer_end), (3.5, 2.0, 4.0, 1.5, 0.1, 0.3));
    assert_eq!(g.slg.layers, vec![1, 2]);
    // Inputs are loaded by the program, not here.
    assert!(p.init_image.is_none() && p.end_image.is_none() && p.control_frames.is_empty() && p.ref_videos.is_empty());
}

#[test]
fn video_defaults_and_checks() {
    let resolve = |argv: &[&str]| {
        let mut o = run_opts(argv);
        o.resolve(&no_env).map(|_| o)
    };
    let o = resolve(&["-M", "vid_gen", "-m", "w.gguf"]).unwrap();
    let p = o.vid_gen_params();
    // The reference program's defaults, not the library's (video_frames 6, high-noise steps -1).
    assert_eq!((p.video_frames, p.fps, p.moe_boundary, p.vace_strength), (1, 16, 0.875, 1.0));
    assert_eq!((p.high_noise_sample_params.sample_steps, p.high_noise_sample_params.guidance.slg.layers.clone()), (20, vec![7, 8, 9]));
    assert_eq!((p.width, p.height, p.seed), (512, 512, 42));
    // --high-noise-steps <= 0 asks the library to split at the boundary.
    for steps in ["0", "-5"] {
        let o = resolve(&["-M", "vid_gen", "-m", "w.gguf", "--high-noise-steps", steps]).unwrap();
        assert_eq!(o.vid_gen_params().high_noise_sample_params.sample_steps, -1);
    }
    let vid = |extra: &[&'static str]| [&["-M", "vid_gen", "-m", "w.gguf"][..], extra].concat();
    assert!(resolve(&vid(&["--video-frames", "0"])).unwrap_err().contains("video_frames must be greater than 0"));
    assert!(resolve(&vid(&["--fps", "-1"])).unwrap_err().contains("fps must be greater than 0"));
    assert!(resolve(&vid(&["--ref-video-audio", "a.wav"])).unwrap_err().contains("needs a corresponding --ref-video"));
    assert!(resolve(&vid(&["--ad-model", "yolo.gguf"])).unwrap_err().contains("--ad-model"));
    assert!(resolve(&["-m", "w.gguf", "--ref-video", "dir"]).unwrap_err().contains("require vid_gen mode"));
    assert!(err(&["--high-noise-sampling-method", "nope"]).contains("invalid high noise sample method nope"));
    assert!(err(&["--high-noise-skip-layers", "1,2"]).contains("bracketed"));
    // --fps 0 outside vid_gen is not checked (the reference does not either).
    assert!(resolve(&["-m", "w.gguf", "--fps", "0"]).is_ok());
}

#[test]
fn options_a_mode_does_not_use_are_named() {
    let unused = |argv: &[&str]| {
        let mut o = run_opts(argv);
        o.resolve(&no_env).unwrap();
        o.gen.unused_options(o.cli.mode)
    };
    assert!(unused(&["-M", "vid_gen", "-m", "w.gguf"]).is_empty());
    assert!(unused(&["-m", "w.gguf"]).is_empty());
    assert_eq!(
        unused(&["-M", "vid_gen", "-m", "w.gguf", "--mask", "m.png", "--control-image", "c.png", "-b", "2", "--control-strength", "0.5"]),
        vec!["--mask", "--control-image", "--batch-count", "--control-strength"]
    );
    assert_eq!(
        unused(&["-m", "w.gguf", "--end-img", "e.png", "--video-frames", "9", "--fps", "8", "--high-noise-cfg-scale", "2", "--vace-strength", "0.5"]),
        vec!["--end-img", "--video-frames", "--fps", "--vace-strength", "--high-noise-*"]
    );
}

#[test]
fn metadata_mode_options() {
    let Ok(Parsed::Run(mut o)) =
        parse(&["-M", "metadata", "--image", "x.webp", "--metadata-format", "json", "--metadata-raw", "--metadata-brief", "--metadata-all"])
    else {
        panic!()
    };
    assert_eq!((o.cli.image_path.as_str(), o.cli.metadata_format.as_str()), ("x.webp", "json"));
    assert!(o.cli.metadata_raw && o.cli.metadata_brief && o.cli.metadata_all);
    // No model, output or default model is needed; nothing else is resolved.
    o.resolve(&|_| Some("/nonexistent/sd1.safetensors".into())).unwrap();
    assert_eq!(o.ctx.params.model_path, None);
    let Ok(Parsed::Run(mut o)) = parse(&["-M", "metadata"]) else { panic!() };
    assert!(o.resolve(&|_| None).unwrap_err().contains("needs an image path (--image)"));
    let Ok(Parsed::Run(mut o)) = parse(&["-M", "metadata", "--image", "x", "--metadata-format", "yaml"]) else { panic!() };
    assert!(o.resolve(&|_| None).unwrap_err().contains("invalid metadata format yaml, must be one of [text, json]"));
}
