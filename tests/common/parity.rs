//! The golden-output harness: runs the cases of `tests/fixtures/golden/<folder>/cases.json`
//! through the C ABI exactly as they are written (context fields, generation fields with
//! dotted names and enum names, input PNGs) and compares every returned picture with the
//! reference's, and for `sd1/` the final latents too.
#![allow(dead_code)]

use super::{enum_constant, manifest, root};
use serde_json::Value;
use stable_diffusion::capi::*;
use std::ffi::{c_int, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Picture tolerance (tests/fixtures/README.md): max and mean |diff| in grey levels.
pub const MAX_DIFF: f64 = 3.0;
pub const MEAN_DIFF: f64 = 0.25;
/// Latent tolerance relative to the golden latent's largest magnitude.
pub const LATENT_REL: f64 = 0.0015;
/// Sound tolerance (tests/fixtures/README.md): max |difference| of the float samples in [-1, 1].
pub const SOUND_MAX_DIFF: f64 = 1e-3;

/// `SD_PARITY=full` runs every case; otherwise only a quick subset.
pub fn full() -> bool {
    std::env::var("SD_PARITY").is_ok_and(|v| v == "full")
}

/// `SD_PARITY_ONLY=case,case` runs exactly the named cases of any folder a test opens,
/// whatever the test selects (for checking a few cases by hand).
fn chosen(case: &Case, select: &impl Fn(&Case) -> bool) -> bool {
    match std::env::var("SD_PARITY_ONLY") {
        Ok(names) => names.split(',').any(|n| n.trim() == case.name),
        Err(_) => select(case),
    }
}

pub fn fixture_dir() -> PathBuf {
    std::env::var_os("SD_FIXTURE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| ".".into())).join(".cache/sd-rs-fixtures"))
}

/// A synthetic checkpoint in the fixture cache (tests/fixtures/recipes.tsv), made on first
/// use by scripts/fixtures.sh (one writer per file across processes, renamed into place).
pub fn fixture(file: &str) -> PathBuf {
    let path = fixture_dir().join(file);
    if path.exists() {
        mark_used(&path);
        return path;
    }
    // The reference's own q8_0 conversion is not distributed: without it, ours stands in.
    if file == "sd1_ref_q8_0.gguf" {
        return our_q8_0();
    }
    eprintln!("generating fixture {file} (scripts/fixtures.sh; may take minutes)");
    let out = Command::new(root().join("scripts/fixtures.sh")).arg(file).output().expect("run scripts/fixtures.sh");
    assert!(
        out.status.success() && path.exists(),
        "scripts/fixtures.sh {file} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    path
}

/// Stamps a cached fixture's access time, which orders what scripts/fixtures.sh removes
/// first when the disk runs short.
pub fn mark_used(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.set_times(std::fs::FileTimes::new().set_accessed(std::time::SystemTime::now()));
    }
}

/// The synthetic sd1 checkpoint converted to q8_0 GGUF by our `convert()`.
pub fn our_q8_0() -> PathBuf {
    converted_fixture("sd1.safetensors", "sd1_q8_0.gguf", sd_type_t(8)) // SD_TYPE_Q8_0
}

/// `source` converted by our `convert()` into `file` in the fixture cache (made on first
/// use; convert itself writes a temporary file and renames it).
pub fn converted_fixture(source: &str, file: &str, ty: sd_type_t) -> PathBuf {
    let path = fixture_dir().join(file);
    if path.exists() {
        mark_used(&path);
        return path;
    }
    let input = CString::new(fixture(source).to_string_lossy().as_bytes()).unwrap();
    let output = CString::new(path.to_string_lossy().as_bytes()).unwrap();
    eprintln!("converting {source} to {file}");
    // SAFETY: NUL-terminated strings alive during the call; NULLs where optional.
    let ok = unsafe { convert(input.as_ptr(), std::ptr::null(), output.as_ptr(), ty, std::ptr::null(), CBool::FALSE) };
    assert!(ok.0 != 0 && path.exists(), "convert {source} -> {file} failed");
    path
}

/// An 8-bit PNG (grey or RGB) as (width, height, channels, bytes).
pub fn read_png(path: &Path) -> (u32, u32, u32, Vec<u8>) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut reader = png::Decoder::new(std::io::BufReader::new(file)).read_info().expect("PNG header");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("PNG data");
    assert_eq!(info.bit_depth, png::BitDepth::Eight, "{}: 8-bit PNGs only", path.display());
    let channels = match info.color_type {
        png::ColorType::Grayscale => 1,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Indexed => panic!("{}: indexed PNG", path.display()),
    };
    buf.truncate(info.buffer_size());
    (info.width, info.height, channels, buf)
}

/// A golden latent: int32 ndim, int64 shape[ndim], f32 data.
pub fn read_latent(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ndim = i32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
    let mut shape = Vec::new();
    for i in 0..ndim {
        let o = 4 + 8 * i;
        shape.push(i64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize);
    }
    let data = b[4 + 8 * ndim..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    (shape, data)
}

#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub ctx: Value,
    pub params: Value,
    pub ok: Option<bool>,
    pub images: Vec<String>,
    pub crashed: bool,
    /// The case's own picture tolerance (max, mean), when cases.json gives one.
    pub tolerance: Option<(f64, f64)>,
    /// A `generate_video` case (cases.json gives its frame count); `params` are then
    /// `sd_vid_gen_params_t` fields.
    pub video: bool,
    /// The golden sound of a video case (a WAV beside the frames), when the reference made one.
    pub audio: Option<String>,
}

pub struct Folder {
    pub name: String,
    pub model: String,
    pub cases: Vec<Case>,
}

pub fn folder(name: &str) -> Folder {
    let dir = root().join("tests/fixtures/golden").join(name);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).expect("cases.json")).expect("JSON");
    let cases = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_string(),
            ctx: c["ctx"].clone(),
            params: c["params"].clone(),
            ok: c["ok"].as_bool(),
            images: c["images"].as_array().map(|a| a.iter().map(|i| i.as_str().unwrap().to_string()).collect()).unwrap_or_default(),
            crashed: c["reference_crashed"].as_bool().unwrap_or(false),
            tolerance: c["tolerance"].as_object().map(|t| {
                (t["max"].as_f64().expect("tolerance.max"), t["mean"].as_f64().expect("tolerance.mean"))
            }),
            video: c.get("frames").is_some(),
            audio: c["audio"]["file"].as_str().map(str::to_string),
        })
        .collect();
    Folder { name: name.to_string(), model: v["model"].as_str().expect("model").to_string(), cases }
}

/// Keeps the C strings and arrays a params struct points into alive.
#[derive(Default)]
pub struct Arena {
    strings: Vec<CString>,
    bytes: Vec<Vec<u8>>,
    floats: Vec<Vec<f32>>,
    ints: Vec<Vec<c_int>>,
    images: Vec<Vec<sd_image_t>>,
    embeddings: Vec<Vec<sd_embedding_t>>,
    loras: Vec<Vec<sd_lora_t>>,
    videos: Vec<Vec<sd_ref_video_t>>,
    audios: Vec<Vec<sd_audio_t>>,
}

impl Arena {
    /// A test sound from {"sample_rate", "channels", "samples", "period"}: a sawtooth per
    /// channel, as tests/tools/sd_capi.py's synth_audio makes it.
    pub fn audio(&mut self, spec: &Value) -> sd_audio_t {
        let (rate, ch, n, period) = (num(&spec["sample_rate"]) as u32, num(&spec["channels"]) as u64, num(&spec["samples"]) as u64, num(&spec["period"]) as u64);
        let mut data: Vec<f32> = (0..n).flat_map(|k| (0..ch).map(move |c| (((k * (7 + 3 * c)) % period) as f64 / period as f64 * 1.6 - 0.8) as f32)).collect();
        let audio = sd_audio_t { sample_rate: rate, channels: ch as u32, sample_count: n, data: data.as_mut_ptr() };
        self.floats.push(data);
        audio
    }

    /// `path` with a `{fx}/` fixture made first when missing.
    pub fn fixture_path(&mut self, path: &str) -> *const std::ffi::c_char {
        if let Some(f) = path.strip_prefix("{fx}/") {
            fixture(f);
        }
        self.str(path)
    }

    pub fn str(&mut self, s: &str) -> *const std::ffi::c_char {
        let c = CString::new(s.replace("{fx}", &fixture_dir().to_string_lossy())).expect("no NUL");
        let p = c.as_ptr();
        self.strings.push(c);
        p
    }

    fn image(&mut self, file: &str) -> sd_image_t {
        let (w, h, c, mut data) = read_png(&root().join("tests/fixtures/inputs").join(file));
        let p = data.as_mut_ptr();
        self.bytes.push(data);
        sd_image_t { width: w, height: h, channel: c, data: p }
    }
}

fn enum_value(v: &Value) -> u32 {
    let name = v.as_str().expect("enum name");
    enum_constant(&manifest(), name).unwrap_or_else(|| panic!("unknown enum constant {name}")) as u32
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// Files a context's fields refer to (`{fx}/...`), generated when missing.
pub fn ensure_fixtures(model: &str, ctx: &Value) {
    if !model.is_empty() && ctx["model_path"].as_str() != Some("") {
        fixture(model);
    }
    let mut refs = Vec::new();
    for v in ctx.as_object().expect("ctx object").values() {
        match v {
            Value::String(s) => refs.push(s.clone()),
            Value::Array(a) => refs.extend(a.iter().filter_map(|e| e["path"].as_str().map(str::to_string))),
            _ => {}
        }
    }
    for r in refs {
        if let Some(f) = r.strip_prefix("{fx}/") {
            fixture(f);
        }
    }
}

pub fn ctx_params(model: &str, ctx: &Value, arena: &mut Arena) -> sd_ctx_params_t {
    let mut p = std::mem::MaybeUninit::<sd_ctx_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_ctx_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    if !model.is_empty() {
        p.model_path = arena.str(&fixture(model).to_string_lossy());
    }
    p.n_threads = 2;
    for (k, v) in ctx.as_object().expect("ctx object") {
        match k.as_str() {
            "prediction" => p.prediction = prediction_t(enum_value(v)),
            "rng_type" => p.rng_type = rng_type_t(enum_value(v)),
            "sampler_rng_type" => p.sampler_rng_type = rng_type_t(enum_value(v)),
            "model_path" => p.model_path = arena.str(v.as_str().unwrap()),
            "taesd_path" => p.taesd_path = arena.str(v.as_str().unwrap()),
            "vae_path" => p.vae_path = arena.str(v.as_str().unwrap()),
            "diffusion_model_path" => p.diffusion_model_path = arena.str(v.as_str().unwrap()),
            "high_noise_diffusion_model_path" => p.high_noise_diffusion_model_path = arena.str(v.as_str().unwrap()),
            "uncond_diffusion_model_path" => p.uncond_diffusion_model_path = arena.str(v.as_str().unwrap()),
            "clip_vision_path" => p.clip_vision_path = arena.str(v.as_str().unwrap()),
            "clip_l_path" => p.clip_l_path = arena.str(v.as_str().unwrap()),
            "clip_g_path" => p.clip_g_path = arena.str(v.as_str().unwrap()),
            "t5xxl_path" => p.t5xxl_path = arena.str(v.as_str().unwrap()),
            "llm_path" => p.llm_path = arena.str(v.as_str().unwrap()),
            "llm_vision_path" => p.llm_vision_path = arena.str(v.as_str().unwrap()),
            "control_net_path" => p.control_net_path = arena.str(v.as_str().unwrap()),
            "ip_adapter_path" => p.ip_adapter_path = arena.str(v.as_str().unwrap()),
            "photo_maker_path" => p.photo_maker_path = arena.str(v.as_str().unwrap()),
            "pulid_weights_path" => p.pulid_weights_path = arena.str(v.as_str().unwrap()),
            "motion_module_path" => p.motion_module_path = arena.str(v.as_str().unwrap()),
            "audio_vae_path" => p.audio_vae_path = arena.str(v.as_str().unwrap()),
            "embeddings_connectors_path" => p.embeddings_connectors_path = arena.str(v.as_str().unwrap()),
            "wtype" => p.wtype = sd_type_t(enum_value(v)),
            "force_sdxl_vae_conv_scale" => p.force_sdxl_vae_conv_scale = CBool(v.as_bool().unwrap() as u8),
            "tae_preview_only" => p.tae_preview_only = CBool(v.as_bool().unwrap() as u8),
            "flash_attn" => p.flash_attn = CBool(v.as_bool().unwrap() as u8),
            "lora_apply_mode" => p.lora_apply_mode = lora_apply_mode_t(enum_value(v)),
            "model_args" => p.model_args = arena.str(v.as_str().unwrap()),
            "eager_load" => p.eager_load = CBool(v.as_bool().unwrap() as u8),
            "enable_mmap" => p.enable_mmap = CBool(v.as_bool().unwrap() as u8),
            "diffusion_conv_direct" => p.diffusion_conv_direct = CBool(v.as_bool().unwrap() as u8),
            "vae_conv_direct" => p.vae_conv_direct = CBool(v.as_bool().unwrap() as u8),
            "vae_format" => p.vae_format = sd_vae_format_t(enum_value(v) as i32),
            "embeddings" => {
                let list: Vec<sd_embedding_t> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| sd_embedding_t { name: arena.str(e["name"].as_str().unwrap()), path: arena.str(e["path"].as_str().unwrap()) })
                    .collect();
                p.embeddings = list.as_ptr();
                p.embedding_count = list.len() as u32;
                arena.embeddings.push(list);
            }
            other => panic!("ctx field {other} is not handled by the harness"),
        }
    }
    p
}

pub fn gen_params(params: &Value, arena: &mut Arena) -> sd_img_gen_params_t {
    let mut p = std::mem::MaybeUninit::<sd_img_gen_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_img_gen_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    for (k, v) in params.as_object().expect("params object") {
        if let Some(f) = k.strip_prefix("sample_params.") {
            if sample_field(&mut p.sample_params, f, v, arena) {
                continue;
            }
        }
        let sp = &mut p.sample_params;
        match k.as_str() {
            "prompt" => p.prompt = arena.str(v.as_str().unwrap()),
            "negative_prompt" => p.negative_prompt = arena.str(v.as_str().unwrap()),
            "width" => p.width = num(v) as c_int,
            "height" => p.height = num(v) as c_int,
            "seed" => p.seed = num(v) as i64,
            "batch_count" => p.batch_count = num(v) as c_int,
            "qwen_image_layers" => p.qwen_image_layers = num(v) as c_int,
            "clip_skip" => p.clip_skip = num(v) as c_int,
            "strength" => p.strength = num(v) as f32,
            "init_image" => p.init_image = arena.image(v.as_str().unwrap()),
            "ref_images" => {
                let list: Vec<sd_image_t> = v.as_array().unwrap().iter().map(|f| arena.image(f.as_str().unwrap())).collect();
                p.ref_images = list.as_ptr() as *mut sd_image_t;
                p.ref_images_count = list.len() as c_int;
                arena.images.push(list);
            }
            "mask_image" => p.mask_image = arena.image(v.as_str().unwrap()),
            "control_image" => p.control_image = arena.image(v.as_str().unwrap()),
            "control_strength" => p.control_strength = num(v) as f32,
            "ip_adapter_image" => p.ip_adapter_image = arena.image(v.as_str().unwrap()),
            "ip_adapter_strength" => p.ip_adapter_strength = num(v) as f32,
            "pm_params.id_images" => {
                let list: Vec<sd_image_t> = v.as_array().unwrap().iter().map(|f| arena.image(f.as_str().unwrap())).collect();
                p.pm_params.id_images = list.as_ptr() as *mut sd_image_t;
                p.pm_params.id_images_count = list.len() as c_int;
                arena.images.push(list);
            }
            "pm_params.id_embed_path" => {
                let path = v.as_str().unwrap();
                if let Some(f) = path.strip_prefix("{fx}/") {
                    fixture(f);
                }
                p.pm_params.id_embed_path = arena.str(path);
            }
            "pm_params.style_strength" => p.pm_params.style_strength = num(v) as f32,
            "pulid_params.id_embedding_path" => {
                let path = v.as_str().unwrap();
                if let Some(f) = path.strip_prefix("{fx}/") {
                    fixture(f);
                }
                p.pulid_params.id_embedding_path = arena.str(path);
            }
            "pulid_params.id_weight" => p.pulid_params.id_weight = num(v) as f32,
            "ref_image_args" => p.ref_image_args = arena.str(v.as_str().unwrap()),
            "sample_params.guidance.slg.scale" => sp.guidance.slg.scale = num(v) as f32,
            "sample_params.guidance.slg.layer_start" => sp.guidance.slg.layer_start = num(v) as f32,
            "sample_params.guidance.slg.layer_end" => sp.guidance.slg.layer_end = num(v) as f32,
            "sample_params.guidance.slg.layers" => {
                let mut l: Vec<c_int> = v.as_array().unwrap().iter().map(|x| num(x) as c_int).collect();
                sp.guidance.slg.layers = l.as_mut_ptr();
                sp.guidance.slg.layer_count = l.len();
                arena.ints.push(l);
            }
            "custom_sigmas" => {
                let mut s: Vec<f32> = v.as_array().unwrap().iter().map(|x| num(x) as f32).collect();
                sp.custom_sigmas = s.as_mut_ptr();
                sp.custom_sigmas_count = s.len() as c_int;
                arena.floats.push(s);
            }
            "loras" => {
                let list: Vec<sd_lora_t> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|l| sd_lora_t {
                        is_high_noise: CBool(l["is_high_noise"].as_bool().unwrap_or(false) as u8),
                        multiplier: l["multiplier"].as_f64().unwrap_or(1.0) as f32,
                        path: arena.str(l["path"].as_str().unwrap()),
                    })
                    .collect();
                p.loras = list.as_ptr();
                p.lora_count = list.len() as u32;
                arena.loras.push(list);
            }
            "circular_x" => p.circular_x = CBool(v.as_bool().unwrap() as u8),
            "circular_y" => p.circular_y = CBool(v.as_bool().unwrap() as u8),
            "hires.enabled" => p.hires.enabled = CBool(v.as_bool().unwrap() as u8),
            "hires.upscaler" => p.hires.upscaler = sd_hires_upscaler_t(enum_value(v)),
            "hires.model_path" => p.hires.model_path = arena.fixture_path(v.as_str().unwrap()),
            "hires.scale" => p.hires.scale = num(v) as f32,
            "hires.target_width" => p.hires.target_width = num(v) as c_int,
            "hires.target_height" => p.hires.target_height = num(v) as c_int,
            "hires.steps" => p.hires.steps = num(v) as c_int,
            "hires.denoising_strength" => p.hires.denoising_strength = num(v) as f32,
            "hires.upscale_tile_size" => p.hires.upscale_tile_size = num(v) as c_int,
            "hires.custom_sigmas" => {
                let mut s: Vec<f32> = v.as_array().unwrap().iter().map(|x| num(x) as f32).collect();
                p.hires.custom_sigmas = s.as_mut_ptr();
                p.hires.custom_sigmas_count = s.len() as c_int;
                arena.floats.push(s);
            }
            "cache.mode" => p.cache.mode = sd_cache_mode_t(enum_value(v)),
            "cache.reuse_threshold" => p.cache.reuse_threshold = num(v) as f32,
            "cache.start_percent" => p.cache.start_percent = num(v) as f32,
            "cache.end_percent" => p.cache.end_percent = num(v) as f32,
            "cache.error_decay_rate" => p.cache.error_decay_rate = num(v) as f32,
            "cache.use_relative_threshold" => p.cache.use_relative_threshold = CBool(v.as_bool().unwrap() as u8),
            "cache.reset_error_on_compute" => p.cache.reset_error_on_compute = CBool(v.as_bool().unwrap() as u8),
            "cache.spectrum_w" => p.cache.spectrum_w = num(v) as f32,
            "cache.spectrum_m" => p.cache.spectrum_m = num(v) as c_int,
            "cache.spectrum_lam" => p.cache.spectrum_lam = num(v) as f32,
            "cache.spectrum_window_size" => p.cache.spectrum_window_size = num(v) as c_int,
            "cache.spectrum_flex_window" => p.cache.spectrum_flex_window = num(v) as f32,
            "cache.spectrum_warmup_steps" => p.cache.spectrum_warmup_steps = num(v) as c_int,
            "cache.spectrum_stop_percent" => p.cache.spectrum_stop_percent = num(v) as f32,
            "cache.residual_diff_threshold" => p.cache.residual_diff_threshold = num(v) as f32,
            "cache.Fn_compute_blocks" => p.cache.Fn_compute_blocks = num(v) as c_int,
            "cache.Bn_compute_blocks" => p.cache.Bn_compute_blocks = num(v) as c_int,
            "cache.max_warmup_steps" => p.cache.max_warmup_steps = num(v) as c_int,
            "cache.max_cached_steps" => p.cache.max_cached_steps = num(v) as c_int,
            "cache.max_continuous_cached_steps" => p.cache.max_continuous_cached_steps = num(v) as c_int,
            "cache.scm_policy_dynamic" => p.cache.scm_policy_dynamic = CBool(v.as_bool().unwrap() as u8),
            "vae_tiling_params.enabled" => p.vae_tiling_params.enabled = CBool(v.as_bool().unwrap() as u8),
            "vae_tiling_params.tile_size_x" => p.vae_tiling_params.tile_size_x = num(v) as c_int,
            "vae_tiling_params.tile_size_y" => p.vae_tiling_params.tile_size_y = num(v) as c_int,
            "vae_tiling_params.target_overlap" => p.vae_tiling_params.target_overlap = num(v) as f32,
            other => panic!("params field {other} is not handled by the harness"),
        }
    }
    p
}

/// The sample parameters of a video request: `sample_params.` or `high_noise_sample_params.`
/// fields (the same names as for pictures).
fn sample_field(sp: &mut sd_sample_params_t, k: &str, v: &Value, arena: &mut Arena) -> bool {
    match k {
        "extra_sample_args" => sp.extra_sample_args = arena.str(v.as_str().unwrap()),
        "sample_steps" => sp.sample_steps = num(v) as c_int,
        "sample_method" => sp.sample_method = sample_method_t(enum_value(v)),
        "scheduler" => sp.scheduler = scheduler_t(enum_value(v)),
        "eta" => sp.eta = num(v) as f32,
        "guidance.txt_cfg" => sp.guidance.txt_cfg = num(v) as f32,
        "guidance.img_cfg" => sp.guidance.img_cfg = num(v) as f32,
        "guidance.distilled_guidance" => sp.guidance.distilled_guidance = num(v) as f32,
        "flow_shift" => sp.flow_shift = num(v) as f32,
        "shifted_timestep" => sp.shifted_timestep = num(v) as c_int,
        "custom_sigmas" => {
            let mut s: Vec<f32> = v.as_array().unwrap().iter().map(|x| num(x) as f32).collect();
            sp.custom_sigmas = s.as_mut_ptr();
            sp.custom_sigmas_count = s.len() as c_int;
            arena.floats.push(s);
        }
        _ => return false,
    }
    true
}

pub fn vid_params(params: &Value, arena: &mut Arena) -> sd_vid_gen_params_t {
    let mut p = std::mem::MaybeUninit::<sd_vid_gen_params_t>::uninit();
    // SAFETY: the init function writes every field.
    let mut p = unsafe {
        sd_vid_gen_params_init(p.as_mut_ptr());
        p.assume_init()
    };
    for (k, v) in params.as_object().expect("params object") {
        if let Some(f) = k.strip_prefix("sample_params.") {
            if sample_field(&mut p.sample_params, f, v, arena) {
                continue;
            }
        }
        if let Some(f) = k.strip_prefix("high_noise_sample_params.") {
            if sample_field(&mut p.high_noise_sample_params, f, v, arena) {
                continue;
            }
        }
        match k.as_str() {
            "prompt" => p.prompt = arena.str(v.as_str().unwrap()),
            "negative_prompt" => p.negative_prompt = arena.str(v.as_str().unwrap()),
            "width" => p.width = num(v) as c_int,
            "height" => p.height = num(v) as c_int,
            "seed" => p.seed = num(v) as i64,
            "clip_skip" => p.clip_skip = num(v) as c_int,
            "strength" => p.strength = num(v) as f32,
            "video_frames" => p.video_frames = num(v) as c_int,
            "fps" => p.fps = num(v) as c_int,
            "moe_boundary" => p.moe_boundary = num(v) as f32,
            "vace_strength" => p.vace_strength = num(v) as f32,
            "init_image" => p.init_image = arena.image(v.as_str().unwrap()),
            "end_image" => p.end_image = arena.image(v.as_str().unwrap()),
            "ref_images" => {
                let list: Vec<sd_image_t> = v.as_array().unwrap().iter().map(|f| arena.image(f.as_str().unwrap())).collect();
                p.ref_images = list.as_ptr() as *mut sd_image_t;
                p.ref_images_count = list.len() as c_int;
                arena.images.push(list);
            }
            // [{"frames": [png, ...], "fps": n, "audio": sound spec (optional)}].
            "ref_videos" => {
                let mut list = Vec::new();
                for video in v.as_array().unwrap() {
                    let frames: Vec<sd_image_t> = video["frames"].as_array().unwrap().iter().map(|f| arena.image(f.as_str().unwrap())).collect();
                    let audio = match video.get("audio") {
                        Some(spec) if !spec.is_null() => arena.audio(spec),
                        _ => sd_audio_t { sample_rate: 0, channels: 0, sample_count: 0, data: std::ptr::null_mut() },
                    };
                    list.push(sd_ref_video_t { frames: frames.as_ptr() as *mut sd_image_t, frame_count: frames.len() as c_int, fps: num(&video["fps"]) as c_int, audio });
                    arena.images.push(frames);
                }
                p.ref_videos = list.as_ptr() as *mut sd_ref_video_t;
                p.ref_videos_count = list.len() as c_int;
                arena.videos.push(list);
            }
            "ref_audios" => {
                let list: Vec<sd_audio_t> = v.as_array().unwrap().iter().map(|spec| arena.audio(spec)).collect();
                p.ref_audios = list.as_ptr() as *mut sd_audio_t;
                p.ref_audios_count = list.len() as c_int;
                arena.audios.push(list);
            }
            "control_frames" => {
                let list: Vec<sd_image_t> = v.as_array().unwrap().iter().map(|f| arena.image(f.as_str().unwrap())).collect();
                p.control_frames = list.as_ptr() as *mut sd_image_t;
                p.control_frames_size = list.len() as c_int;
                arena.images.push(list);
            }
            "loras" => {
                let list: Vec<sd_lora_t> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|l| sd_lora_t {
                        is_high_noise: CBool(l["is_high_noise"].as_bool().unwrap_or(false) as u8),
                        multiplier: l["multiplier"].as_f64().unwrap_or(1.0) as f32,
                        path: arena.str(l["path"].as_str().unwrap()),
                    })
                    .collect();
                p.loras = list.as_ptr();
                p.lora_count = list.len() as u32;
                arena.loras.push(list);
            }
            "hires.enabled" => p.hires.enabled = CBool(v.as_bool().unwrap() as u8),
            "hires.upscaler" => p.hires.upscaler = sd_hires_upscaler_t(enum_value(v)),
            "hires.model_path" => p.hires.model_path = arena.fixture_path(v.as_str().unwrap()),
            "hires.scale" => p.hires.scale = num(v) as f32,
            "hires.steps" => p.hires.steps = num(v) as c_int,
            "hires.denoising_strength" => p.hires.denoising_strength = num(v) as f32,
            "hires.target_width" => p.hires.target_width = num(v) as c_int,
            "hires.target_height" => p.hires.target_height = num(v) as c_int,
            "vae_tiling_params.enabled" => p.vae_tiling_params.enabled = CBool(v.as_bool().unwrap() as u8),
            "vae_tiling_params.temporal_tiling" => p.vae_tiling_params.temporal_tiling = CBool(v.as_bool().unwrap() as u8),
            "vae_tiling_params.tile_size_x" => p.vae_tiling_params.tile_size_x = num(v) as c_int,
            "vae_tiling_params.tile_size_y" => p.vae_tiling_params.tile_size_y = num(v) as c_int,
            "vae_tiling_params.extra_tiling_args" => p.vae_tiling_params.extra_tiling_args = arena.str(v.as_str().unwrap()),
            "cache.mode" => p.cache.mode = sd_cache_mode_t(enum_value(v)),
            other => panic!("video params field {other} is not handled by the harness"),
        }
    }
    p
}

/// A returned picture: width, height, channels, bytes.
pub type Picture = (u32, u32, u32, Vec<u8>);

/// Generates, returning (ok, the pictures); the C images are freed.
pub fn generate(ctx: *mut sd_ctx_t, p: &sd_img_gen_params_t) -> (bool, Vec<Picture>) {
    let mut images = std::ptr::null_mut();
    let mut n: c_int = -1;
    // SAFETY: valid context and params, writable out-pointers.
    let ok = unsafe { generate_image(ctx, p, &mut images, &mut n) }.get();
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: n images were returned.
        let img = unsafe { &*images.add(i) };
        let len = (img.width * img.height * img.channel) as usize;
        // SAFETY: each image holds width*height*channel bytes.
        out.push((img.width, img.height, img.channel, unsafe { std::slice::from_raw_parts(img.data, len) }.to_vec()));
    }
    // SAFETY: the images generate_image returned, freed once.
    unsafe { free_sd_images(images, n) };
    (ok, out)
}

/// One compared picture (or latent): max and mean |diff|.
#[derive(Clone, Debug)]
pub struct Diff {
    pub what: String,
    pub max: f64,
    pub mean: f64,
    pub pass: bool,
}

#[derive(Clone, Debug)]
pub struct CaseResult {
    pub folder: String,
    pub name: String,
    pub diffs: Vec<Diff>,
    pub pass: bool,
    pub note: String,
    pub seconds: f32,
    /// What we rendered: the bytes of every returned picture and the bits of every final
    /// latent captured, to compare runs of our own with each other.
    pub pixels: Vec<Vec<u8>>,
    pub latent_bits: Vec<Vec<u32>>,
}

/// A returned picture against a golden PNG (within the fixtures' tolerance unless a
/// case sets its own).
pub fn compare_image(golden: &Path, got: &sd_image_t, tolerance: Option<(f64, f64)>) -> Diff {
    let (w, h, c, want) = read_png(golden);
    let what = golden.file_name().unwrap().to_string_lossy().to_string();
    if (got.width, got.height, got.channel) != (w, h, c) {
        return Diff {
            what: format!("{what} size {}x{}x{} != {w}x{h}x{c}", got.width, got.height, got.channel),
            max: f64::INFINITY,
            mean: f64::INFINITY,
            pass: false,
        };
    }
    // SAFETY: the library returned width * height * channel bytes.
    let data = unsafe { std::slice::from_raw_parts(got.data, want.len()) };
    let diffs: Vec<f64> = data.iter().zip(&want).map(|(&a, &b)| (a as f64 - b as f64).abs()).collect();
    let max = diffs.iter().cloned().fold(0.0, f64::max);
    let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
    let (max_ok, mean_ok) = tolerance.unwrap_or((MAX_DIFF, MEAN_DIFF));
    Diff { what, max, mean, pass: max <= max_ok && mean <= mean_ok }
}

fn compare_latent(golden: &Path, got: &stable_diffusion::tensor::Tensor) -> Diff {
    let (shape, want) = read_latent(golden);
    let what = format!("latent {}", golden.file_name().unwrap().to_string_lossy());
    let got_shape: Vec<usize> = (0..shape.len()).map(|i| got.ne(i)).collect();
    if got_shape != shape || got.len() != want.len() {
        return Diff { what: format!("{what} shape {:?} != {shape:?}", got.shape()), max: f64::INFINITY, mean: f64::INFINITY, pass: false };
    }
    let scale = want.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    let diffs: Vec<f64> = got.data().iter().zip(&want).map(|(&a, &b)| (a as f64 - b as f64).abs()).collect();
    let max = diffs.iter().cloned().fold(0.0, f64::max);
    let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
    // Reported relative to the golden latent's largest magnitude.
    let (max, mean) = (max / scale, mean / scale);
    Diff { what, max, mean, pass: max <= LATENT_REL }
}

/// A 32-bit float WAV (as tests/tools/sd_capi.py writes the reference's sound): sample rate,
/// channels, interleaved samples.
pub fn read_wav(path: &Path) -> (u32, u32, Vec<f32>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(b.len() >= 12 && &b[..4] == b"RIFF" && &b[8..12] == b"WAVE", "{}: not a WAV", path.display());
    let (mut at, mut fmt, mut data) = (12, None, None);
    while at + 8 <= b.len() {
        let len = u32::from_le_bytes(b[at + 4..at + 8].try_into().unwrap()) as usize;
        let body = &b[at + 8..(at + 8 + len).min(b.len())];
        match &b[at..at + 4] {
            b"fmt " => fmt = Some(body),
            b"data" => data = Some(body),
            _ => {}
        }
        at += 8 + len + (len & 1);
    }
    let fmt = fmt.expect("fmt chunk");
    let u16_at = |i: usize| u16::from_le_bytes([fmt[i], fmt[i + 1]]);
    assert_eq!((u16_at(0), u16_at(14)), (3, 32), "{}: not 32-bit float samples", path.display());
    let rate = u32::from_le_bytes(fmt[4..8].try_into().unwrap());
    let samples = data.expect("data chunk").chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    (rate, u16_at(2) as u32, samples)
}

/// The sound `generate_video` returned against the case's golden WAV (none expected when the
/// case has none): rate, channels and length must match, then max and mean |diff|.
fn compare_sound(dir: &Path, golden: Option<&str>, got: *const sd_audio_t) -> Option<Diff> {
    let failed = |what: String| Some(Diff { what, max: f64::INFINITY, mean: f64::INFINITY, pass: false });
    // SAFETY: NULL or the sd_audio_t generate_video returned.
    let got = unsafe { got.as_ref() };
    let (file, got) = match (golden, got) {
        (None, None) => return None,
        (None, Some(_)) => return failed("sound returned, the reference returned none".into()),
        (Some(f), None) => return failed(format!("sound {f}: none returned")),
        (Some(f), Some(a)) => (f, a),
    };
    let (rate, channels, want) = read_wav(&dir.join(file));
    let what = format!("sound {file}");
    if (got.sample_rate, got.channels, got.sample_count * got.channels as u64) != (rate, channels, want.len() as u64) || got.data.is_null() {
        return failed(format!(
            "{what}: {} Hz x {} x {} samples, reference {rate} Hz x {channels} x {}",
            got.sample_rate,
            got.channels,
            got.sample_count,
            want.len() / channels.max(1) as usize
        ));
    }
    // SAFETY: the library returned sample_count * channels floats.
    let data = unsafe { std::slice::from_raw_parts(got.data, want.len()) };
    let diffs: Vec<f64> = data.iter().zip(&want).map(|(&a, &b)| (a as f64 - b as f64).abs()).collect();
    let max = diffs.iter().cloned().fold(0.0, f64::max);
    let mean = diffs.iter().sum::<f64>() / diffs.len().max(1) as f64;
    Some(Diff { what, max, mean, pass: max <= SOUND_MAX_DIFF })
}

/// Runs the cases of `folder` accepted by `select`, in file order; consecutive cases with
/// the same context fields share one `sd_ctx_t`.
pub fn run(folder_name: &str, select: impl Fn(&Case) -> bool) -> Vec<CaseResult> {
    run_with(folder_name, select, |_, _| {})
}

/// [`run`], with `setup` adjusting every context's parameters after the case's own (e.g. to
/// load the same weights from split component files instead of the single checkpoint).
pub fn run_with(
    folder_name: &str,
    select: impl Fn(&Case) -> bool,
    setup: impl Fn(&mut sd_ctx_params_t, &mut Arena),
) -> Vec<CaseResult> {
    let f = folder(folder_name);
    let dir = root().join("tests/fixtures/golden").join(folder_name);
    let mut results = Vec::new();
    let mut current: Option<(Value, *mut sd_ctx_t)> = None;
    for case in f.cases.iter().filter(|c| chosen(c, &select)) {
        let start = Instant::now();
        if current.as_ref().is_none_or(|(ctx, _)| *ctx != case.ctx) {
            if let Some((_, old)) = current.take() {
                free_sd_ctx(old);
            }
            ensure_fixtures(&f.model, &case.ctx);
            let mut arena = Arena::default();
            let mut p = ctx_params(&f.model, &case.ctx, &mut arena);
            setup(&mut p, &mut arena);
            // SAFETY: p and everything it points to are alive during the call.
            let ctx = unsafe { new_sd_ctx(&p) };
            if ctx.is_null() {
                // Failing cleanly at new_sd_ctx is a valid answer to a case that crashes the
                // reference or that the reference refuses (`"ok": false`, e.g. its model
                // metadata validation in new_sd_ctx).
                let refused = case.ok == Some(false);
                let r = CaseResult {
                    folder: folder_name.into(),
                    name: case.name.clone(),
                    diffs: vec![],
                    pass: case.crashed || refused,
                    note: match (case.crashed, refused) {
                        (true, _) => "reference crashed; new_sd_ctx failed cleanly".into(),
                        (_, true) => "refused like the reference (new_sd_ctx failed)".into(),
                        _ => "new_sd_ctx failed".into(),
                    },
                    seconds: start.elapsed().as_secs_f32(),
                    pixels: vec![],
                    latent_bits: vec![],
                };
                print_result(&r);
                results.push(r);
                continue;
            }
            current = Some((case.ctx.clone(), ctx));
        }
        let ctx = current.as_ref().unwrap().1;
        for path in case.params["loras"].as_array().into_iter().flatten().filter_map(|l| l["path"].as_str()) {
            if let Some(f) = path.strip_prefix("{fx}/") {
                fixture(f);
            }
        }
        let mut arena = Arena::default();
        let mut images: *mut sd_image_t = std::ptr::null_mut();
        let mut n: c_int = 0;
        let mut sound = None;
        let (ok, latents) = if case.video {
            let p = vid_params(&case.params, &mut arena);
            let mut audio: *mut sd_audio_t = std::ptr::null_mut();
            // SAFETY: valid context and params; out-pointers are writable.
            let ok = unsafe { generate_video(ctx, &p, &mut images, &mut n, &mut audio) };
            sound = compare_sound(&dir, case.audio.as_deref(), audio);
            // SAFETY: NULL or the sound generate_video returned, freed once.
            unsafe { free_sd_audio(audio) };
            (ok, Vec::new())
        } else {
            let p = gen_params(&case.params, &mut arena);
            // SAFETY: valid context and params; out-pointers are writable.
            stable_diffusion::pipeline::capture_final_latents(|| unsafe { generate_image(ctx, &p, &mut images, &mut n) })
        };
        let ok = ok.0 != 0;
        let mut diffs = Vec::new();
        let mut note = String::new();
        let latent_bits = latents.iter().map(|t| t.data().iter().map(|v| v.to_bits()).collect()).collect();
        let pixels = (0..if ok { n.max(0) as usize } else { 0 })
            // SAFETY: n images of width * height * channel bytes were returned.
            .map(|i| unsafe {
                let img = &*images.add(i);
                if img.data.is_null() {
                    return Vec::new();
                }
                std::slice::from_raw_parts(img.data, (img.width * img.height * img.channel) as usize).to_vec()
            })
            .collect();
        let pass;
        if case.crashed {
            note = format!("reference crashed; ours returned {}", if ok { "images" } else { "false" });
            pass = true;
        } else if Some(ok) != case.ok {
            note = format!("returned {ok}, reference {:?}", case.ok);
            pass = false;
        } else if n as usize != case.images.len() {
            note = format!("{n} images, reference {}", case.images.len());
            pass = false;
        } else {
            for (i, file) in case.images.iter().enumerate() {
                // SAFETY: n images were returned.
                let img = unsafe { &*images.add(i) };
                diffs.push(compare_image(&dir.join(file), img, case.tolerance));
                let lat = dir.join("latents").join(file.replace(".png", ".bin"));
                if lat.exists() {
                    match latents.get(i) {
                        Some(t) => diffs.push(compare_latent(&lat, t)),
                        None => note = "no final latent captured".into(),
                    }
                }
            }
            diffs.extend(sound);
            pass = note.is_empty() && diffs.iter().all(|d| d.pass);
        }
        // SAFETY: the images generate_image returned, freed once.
        unsafe { free_sd_images(images, n) };
        let r = CaseResult {
            folder: folder_name.into(),
            name: case.name.clone(),
            diffs,
            pass,
            note,
            seconds: start.elapsed().as_secs_f32(),
            pixels,
            latent_bits,
        };
        print_result(&r);
        results.push(r);
    }
    if let Some((_, ctx)) = current {
        free_sd_ctx(ctx);
    }
    results
}

/// Renders the first case of `folder` accepted by `select` (context from `setup` after the
/// case's own fields) and returns each image's (a video case: each frame's) RGB bytes.
pub fn render_with(folder_name: &str, select: impl Fn(&Case) -> bool, setup: impl Fn(&mut sd_ctx_params_t, &mut Arena)) -> Vec<Vec<u8>> {
    let f = folder(folder_name);
    let case = f.cases.iter().find(|c| select(c)).expect("a case");
    ensure_fixtures(&f.model, &case.ctx);
    let mut arena = Arena::default();
    let mut p = ctx_params(&f.model, &case.ctx, &mut arena);
    setup(&mut p, &mut arena);
    // SAFETY: p and everything it points to are alive during the call.
    let ctx = unsafe { new_sd_ctx(&p) };
    assert!(!ctx.is_null(), "new_sd_ctx failed for {folder_name}/{}", case.name);
    let mut g_arena = Arena::default();
    let mut images: *mut sd_image_t = std::ptr::null_mut();
    let mut n: c_int = 0;
    let ok = if case.video {
        let vp = vid_params(&case.params, &mut g_arena);
        let mut audio: *mut sd_audio_t = std::ptr::null_mut();
        // SAFETY: valid context and params; out-pointers are writable; the sound (if any)
        // is freed once, as returned.
        unsafe {
            let ok = generate_video(ctx, &vp, &mut images, &mut n, &mut audio);
            free_sd_audio(audio);
            ok
        }
    } else {
        let gp = gen_params(&case.params, &mut g_arena);
        // SAFETY: valid context and params; out-pointers are writable.
        unsafe { generate_image(ctx, &gp, &mut images, &mut n) }
    };
    let out = (0..n as usize)
        .map(|i| {
            // SAFETY: n images were returned, each width * height * channel bytes.
            let img = unsafe { &*images.add(i) };
            unsafe { std::slice::from_raw_parts(img.data, (img.width * img.height * img.channel) as usize) }.to_vec()
        })
        .collect();
    // SAFETY: freed once, as returned.
    unsafe { free_sd_images(images, n) };
    free_sd_ctx(ctx);
    assert!(ok.0 != 0, "generating failed for {folder_name}/{}", case.name);
    out
}

/// The RGB bytes of the one picture generation parameters `params` (golden-case JSON) give
/// on `ctx`.
pub fn render_params(ctx: *mut sd_ctx_t, params: &Value) -> Vec<u8> {
    let mut arena = Arena::default();
    let p = gen_params(params, &mut arena);
    let mut images: *mut sd_image_t = std::ptr::null_mut();
    let mut n: c_int = 0;
    // SAFETY: valid context and params; out-pointers are writable.
    let ok = unsafe { generate_image(ctx, &p, &mut images, &mut n) };
    assert!(ok.0 != 0 && n == 1, "generate_image failed for {params}");
    // SAFETY: one image of width * height * channel bytes, freed once.
    let img = unsafe { &*images };
    let bytes = unsafe { std::slice::from_raw_parts(img.data, (img.width * img.height * img.channel) as usize) }.to_vec();
    unsafe { free_sd_images(images, n) };
    bytes
}

/// A golden picture's bytes.
pub fn golden_image(folder_name: &str, file: &str) -> Vec<u8> {
    read_png(&root().join("tests/fixtures/golden").join(folder_name).join(file)).3
}

/// (max, mean) |difference| of two byte images of the same size.
pub fn diff_bytes(a: &[u8], b: &[u8]) -> (f64, f64) {
    assert_eq!(a.len(), b.len(), "image sizes differ");
    let d: Vec<f64> = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).abs()).collect();
    (d.iter().cloned().fold(0.0, f64::max), d.iter().sum::<f64>() / d.len() as f64)
}

pub fn print_result(r: &CaseResult) {
    let mut line = format!("{:<5} {}/{} ({:.1}s)", if r.pass { "PASS" } else { "FAIL" }, r.folder, r.name, r.seconds);
    for d in &r.diffs {
        if d.what.starts_with("sound") {
            line.push_str(&format!(" | {}: max {:.2e} mean {:.2e}", d.what, d.max, d.mean));
        } else if d.what.starts_with("latent") {
            line.push_str(&format!(" | {}: max {:.5} mean {:.6} (×max|golden|)", d.what, d.max, d.mean));
        } else {
            line.push_str(&format!(" | {}: max {} mean {:.4}", d.what, d.max, d.mean));
        }
    }
    if !r.note.is_empty() {
        line.push_str(&format!(" | {}", r.note));
    }
    eprintln!("{line}");
}

/// Prints the table and fails listing every failed case.
pub fn report(results: &[CaseResult]) {
    eprintln!("\n==== parity: {} cases ====", results.len());
    for r in results {
        print_result(r);
    }
    let failed: Vec<String> = results.iter().filter(|r| !r.pass).map(|r| format!("{}/{}", r.folder, r.name)).collect();
    eprintln!("==== {} passed, {} failed ====", results.len() - failed.len(), failed.len());
    assert!(failed.is_empty(), "parity failures: {failed:?}");
}
