//! From a request body to a checked generation request.
//!
//! Every API starts from the server's default options (sd-cli's `Opts`, from the command
//! line), applies the request's fields, and then goes through sd-cli's own resolution and
//! checks (`Opts::resolve`), so a request means what the same sd-cli command line means.
//! Unlike the reference, which skips fields of the wrong type and unknown sampler names
//! silently, every field that is present must have its documented type and a known value,
//! and fields we do not know draw a warning.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde_json::{Map, Value};

use sd_cli::args::{self, Mode, Opts};
use sd_cli::image_io::decode_image;
use stable_diffusion::api::{Context, Image, SampleMethod, SampleParams, Scheduler};
use stable_diffusion::sd_warn;

use crate::options::Limits;

/// Sets `target` from the field `key`, read as `kind` (`str`, `i32`, `f32`, ...), when the
/// request has it.
macro_rules! read {
    ($f:expr, $kind:ident $key:literal => $target:expr) => {
        if let Some(v) = $f.$kind($key)? {
            $target = v;
        }
    };
}

/// A refused request: the HTTP status and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub error: String,
    /// Detail, e.g. the JSON parser's message.
    pub message: Option<String>,
}

impl ApiError {
    pub fn new(status: u16, error: impl Into<String>) -> Self {
        ApiError { status, error: error.into(), message: None }
    }

    pub fn bad(error: impl Into<String>) -> Self {
        ApiError::new(400, error)
    }

    pub fn json(&self) -> Value {
        let mut v = serde_json::json!({ "error": self.error });
        if let Some(m) = &self.message {
            v["message"] = m.clone().into();
        }
        v
    }
}

impl From<String> for ApiError {
    fn from(e: String) -> Self {
        ApiError::bad(e)
    }
}

pub type Result<T> = std::result::Result<T, ApiError>;

/// What a job generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    ImgGen,
    VidGen,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::ImgGen => "img_gen",
            Kind::VidGen => "vid_gen",
        }
    }

    fn mode(self) -> Mode {
        match self {
            Kind::ImgGen => Mode::ImgGen,
            Kind::VidGen => Mode::VidGen,
        }
    }
}

/// The encoded outputs this server writes: pictures as PNG, JPEG or (lossless) WebP, videos
/// as MJPEG AVI (no WebM / animated WebP encoder here).
pub const IMAGE_FORMATS: [&str; 3] = ["png", "jpeg", "webp"];
pub const VIDEO_FORMATS: [&str; 1] = ["avi"];

/// How results are encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub format: String,
    /// 0..=100: the JPEG quality (0 means 90, as stb does).
    pub compression: i32,
}

/// The pictures a request carries, as file bytes (decoded once the size is known).
#[derive(Debug, Clone, Default)]
pub struct ImageBytes {
    pub init: Option<Vec<u8>>,
    pub end: Option<Vec<u8>>,
    pub refs: Vec<Vec<u8>>,
    pub mask: Option<Vec<u8>>,
    pub control: Option<Vec<u8>>,
    pub ip_adapter: Option<Vec<u8>>,
    pub control_frames: Vec<Vec<u8>>,
    /// sdapi `inpainting_mask_invert`.
    pub invert_mask: bool,
}

/// The decoded pictures, sized as the request needs them.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    pub init: Option<Image>,
    pub end: Option<Image>,
    pub refs: Vec<Image>,
    pub mask: Option<Image>,
    pub control: Option<Image>,
    pub ip_adapter: Option<Image>,
    pub control_frames: Vec<Image>,
}

/// A LoRA named by a request (`lora` field or a prompt tag), before it is looked up.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRequest {
    pub name: String,
    pub multiplier: f32,
    pub high_noise: bool,
}

/// A request being built: the options so far, its pictures and LoRAs.
#[derive(Debug, Clone)]
pub struct Draft {
    pub kind: Kind,
    pub opts: Opts,
    pub images: ImageBytes,
    pub loras: Vec<LoraRequest>,
    pub output: Output,
}

impl Draft {
    pub fn new(defaults: &Opts, kind: Kind) -> Draft {
        let mut opts = defaults.clone();
        opts.cli.mode = kind.mode();
        let format = if kind == Kind::ImgGen { IMAGE_FORMATS[0] } else { VIDEO_FORMATS[0] };
        Draft { kind, opts, images: ImageBytes::default(), loras: Vec::new(), output: Output { format: format.into(), compression: 100 } }
    }

    pub fn set_output(&mut self, format: &str, compression: Option<i64>) -> Result<()> {
        let format = format.to_ascii_lowercase();
        let allowed: &[&str] = if self.kind == Kind::ImgGen { &IMAGE_FORMATS } else { &VIDEO_FORMATS };
        if !allowed.contains(&format.as_str()) {
            return Err(ApiError::bad(format!("invalid output_format '{format}', must be one of [{}]", allowed.join(", "))));
        }
        self.output.format = format;
        if let Some(c) = compression {
            self.output.compression = c.clamp(0, 100) as i32;
        }
        Ok(())
    }
}

/// A checked request, ready for the generation thread.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub kind: Kind,
    pub opts: Opts,
    pub inputs: Inputs,
    pub output: Output,
}

// ---- JSON fields ----

/// The fields of one JSON object, read by name with their type checked; `path` names the
/// object in messages (`sample_params.` ...).
pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: String,
    used: BTreeSet<&'static str>,
}

impl<'a> Fields<'a> {
    pub fn new(obj: &'a Map<String, Value>, path: &str) -> Self {
        Fields { obj, path: path.to_string(), used: BTreeSet::new() }
    }

    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.path)
    }

    /// The value of `key`, `None` when absent or null.
    pub fn get(&mut self, key: &'static str) -> Option<&'a Value> {
        self.used.insert(key);
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn typed<T>(&mut self, key: &'static str, what: &str, read: impl Fn(&'a Value) -> Option<T>) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| ApiError::bad(format!("field '{}' must be {what}", self.name(key)))),
        }
    }

    pub fn str(&mut self, key: &'static str) -> Result<Option<String>> {
        self.typed(key, "a string", |v| v.as_str().map(str::to_string))
    }

    pub fn i64(&mut self, key: &'static str) -> Result<Option<i64>> {
        self.typed(key, "an integer", |v| v.as_i64().or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15).map(|f| f as i64)))
    }

    pub fn i32(&mut self, key: &'static str) -> Result<Option<i32>> {
        let name = self.name(key);
        self.i64(key)?.map(|n| i32::try_from(n).map_err(|_| ApiError::bad(format!("field '{name}' is out of range: {n}")))).transpose()
    }

    pub fn f32(&mut self, key: &'static str) -> Result<Option<f32>> {
        self.typed(key, "a number", |v| v.as_f64().map(|f| f as f32))
    }

    pub fn bool(&mut self, key: &'static str) -> Result<Option<bool>> {
        self.typed(key, "true or false", Value::as_bool)
    }

    /// A boolean also given as 0/1 (sdapi's `inpainting_mask_invert`).
    pub fn flag(&mut self, key: &'static str) -> Result<Option<bool>> {
        self.typed(key, "true, false, 0 or 1", |v| v.as_bool().or_else(|| v.as_i64().map(|n| n != 0)))
    }

    pub fn object(&mut self, key: &'static str) -> Result<Option<Fields<'a>>> {
        let path = format!("{}.", self.name(key));
        self.typed(key, "an object", |v| v.as_object()).map(|o| o.map(|o| Fields::new(o, &path)))
    }

    pub fn array(&mut self, key: &'static str) -> Result<Option<&'a Vec<Value>>> {
        self.typed(key, "an array", Value::as_array)
    }

    pub fn f32s(&mut self, key: &'static str) -> Result<Option<Vec<f32>>> {
        self.typed(key, "an array of numbers", |v| v.as_array()?.iter().map(|x| x.as_f64().map(|f| f as f32)).collect())
    }

    pub fn i32s(&mut self, key: &'static str) -> Result<Option<Vec<i32>>> {
        self.typed(key, "an array of integers", |v| v.as_array()?.iter().map(|x| x.as_i64().and_then(|n| i32::try_from(n).ok())).collect())
    }

    /// A picture: base64 or a data URL.
    pub fn image(&mut self, key: &'static str) -> Result<Option<Vec<u8>>> {
        let name = self.name(key);
        self.str(key)?.map(|s| base64_image(&s, &name)).transpose()
    }

    pub fn images(&mut self, key: &'static str) -> Result<Option<Vec<Vec<u8>>>> {
        let name = self.name(key);
        let Some(items) = self.array(key)? else { return Ok(None) };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let s = item.as_str().ok_or_else(|| ApiError::bad(format!("field '{name}[{i}]' must be a base64 string")))?;
            out.push(base64_image(s, &format!("{name}[{i}]"))?);
        }
        Ok(Some(out))
    }

    /// Warns about the fields no reader asked for (a client's typo should not pass unseen).
    pub fn warn_unused(&self, api: &str) {
        let unknown: Vec<&str> = self.obj.keys().map(String::as_str).filter(|k| !self.used.contains(k)).collect();
        if !unknown.is_empty() {
            sd_warn!("{api}: {} not used by this server: ignored", unknown.iter().map(|k| format!("'{}'", self.name(k))).collect::<Vec<_>>().join(", "));
        }
    }

    /// Marks fields as known without reading them (what an API reads elsewhere or accepts
    /// and ignores by design).
    pub fn accept(&mut self, keys: &[&'static str]) {
        self.used.extend(keys);
    }
}

/// The bytes of a base64 picture, with or without a `data:...;base64,` prefix.
pub fn base64_image(s: &str, name: &str) -> Result<Vec<u8>> {
    let data = match s.split_once(',') {
        Some((head, rest)) if head.starts_with("data:") => rest,
        _ => s,
    };
    let clean: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(clean.as_bytes())
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(clean.trim_end_matches('=').as_bytes()))
        .map_err(|e| ApiError::bad(format!("field '{name}' is not valid base64: {e}")))?;
    if bytes.is_empty() {
        return Err(ApiError::bad(format!("field '{name}' is an empty picture")));
    }
    Ok(bytes)
}

pub fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A request body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad("empty body"));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("the request body must be a JSON object")),
        Err(e) => Err(ApiError { status: 400, error: "invalid json".into(), message: Some(e.to_string()) }),
    }
}

// ---- names ----

/// A sampler name: the library's names, "default" (the model's), and for sdapi also the
/// WebUI's display names and k-diffusion aliases the reference's server maps.
pub fn sample_method(name: &str, webui_names: bool) -> Result<Option<SampleMethod>> {
    if name.is_empty() || name == "default" {
        return Ok(None);
    }
    if let Some(m) = SampleMethod::parse(name) {
        return Ok(Some(m));
    }
    if webui_names {
        let lower = name.to_ascii_lowercase();
        let found = WEBUI_SAMPLERS.iter().find(|(n, _)| *n == lower).map(|&(_, m)| m);
        if found.is_some() {
            return Ok(found);
        }
    }
    let names: Vec<&str> = SampleMethod::ALL.iter().map(|m| m.name()).collect();
    Err(ApiError::bad(format!("unknown sampler '{name}', must be 'default' or one of [{}]", names.join(", "))))
}

/// WebUI sampler names and k-diffusion aliases, lower case.
const WEBUI_SAMPLERS: &[(&str, SampleMethod)] = &[
    ("euler a", SampleMethod::EulerA),
    ("k_euler_a", SampleMethod::EulerA),
    ("euler", SampleMethod::Euler),
    ("k_euler", SampleMethod::Euler),
    ("heun", SampleMethod::Heun),
    ("k_heun", SampleMethod::Heun),
    ("dpm2", SampleMethod::Dpm2),
    ("k_dpm_2", SampleMethod::Dpm2),
    ("lcm", SampleMethod::Lcm),
    ("ddim", SampleMethod::DdimTrailing),
    ("dpm++ 2m", SampleMethod::Dpmpp2m),
    ("k_dpmpp_2m", SampleMethod::Dpmpp2m),
    ("dpm++ 2m sde", SampleMethod::Dpmpp2mSde),
    ("k_dpmpp_2m_sde", SampleMethod::Dpmpp2mSde),
    ("dpm++ 2m sde gpu", SampleMethod::Dpmpp2mSdeBt),
    ("k_dpmpp_2m_sde_gpu", SampleMethod::Dpmpp2mSdeBt),
    ("res multistep", SampleMethod::ResMultistep),
    ("k_res_multistep", SampleMethod::ResMultistep),
    ("res 2s", SampleMethod::Res2s),
    ("k_res_2s", SampleMethod::Res2s),
    ("k_euler_cfg_pp", SampleMethod::EulerCfgPp),
    ("k_euler_a_cfg_pp", SampleMethod::EulerCfgPp),
];

/// A scheduler name: the library's names, "normal" (= discrete, as sd-cli) and "default".
pub fn scheduler(name: &str) -> Result<Option<Scheduler>> {
    match name {
        "" | "default" => Ok(None),
        "normal" => Ok(Some(Scheduler::Discrete)),
        _ => Scheduler::parse(name).map(Some).ok_or_else(|| {
            let names: Vec<&str> = Scheduler::ALL.iter().map(|s| s.name()).collect();
            ApiError::bad(format!("unknown scheduler '{name}', must be 'default', 'normal' or one of [{}]", names.join(", ")))
        }),
    }
}

/// The scheduler names listed to clients (the reference lists "normal" after "discrete").
pub fn scheduler_names() -> Vec<&'static str> {
    let mut out = Vec::new();
    for s in Scheduler::ALL {
        out.push(s.name());
        if *s == Scheduler::Discrete {
            out.push("normal");
        }
    }
    out
}

// ---- the native (sdcpp) schema ----

fn sample_params(f: &mut Fields, sp: &mut SampleParams, layers: &mut Vec<i32>, with_sigmas: bool) -> Result<()> {
    read!(f, i32 "sample_steps" => sp.sample_steps);
    read!(f, f32 "eta" => sp.eta);
    read!(f, i32 "shifted_timestep" => sp.shifted_timestep);
    read!(f, f32 "flow_shift" => sp.flow_shift);
    if let Some(s) = f.str("extra_sample_args")? {
        sp.extra_sample_args = (!s.is_empty()).then_some(s);
    }
    if with_sigmas {
        read!(f, f32s "custom_sigmas" => sp.custom_sigmas);
    }
    if let Some(name) = f.str("sample_method")? {
        sp.sample_method = sample_method(&name, false)?;
    }
    if let Some(name) = f.str("scheduler")? {
        sp.scheduler = scheduler(&name)?;
    }
    if let Some(mut g) = f.object("guidance")? {
        let gp = &mut sp.guidance;
        read!(g, f32 "txt_cfg" => gp.txt_cfg);
        read!(g, f32 "img_cfg" => gp.img_cfg);
        read!(g, f32 "distilled_guidance" => gp.distilled_guidance);
        if let Some(mut slg) = g.object("slg")? {
            if let Some(l) = slg.i32s("layers")? {
                *layers = l;
            }
            read!(slg, f32 "layer_start" => gp.slg.layer_start);
            read!(slg, f32 "layer_end" => gp.slg.layer_end);
            read!(slg, f32 "scale" => gp.slg.scale);
            slg.warn_unused("request");
        }
        g.warn_unused("request");
    }
    f.warn_unused("request");
    Ok(())
}

/// The `lora` array: `{path, multiplier, is_high_noise}` entries.
pub fn lora_field(f: &mut Fields, out: &mut Vec<LoraRequest>) -> Result<()> {
    let Some(items) = f.array("lora")? else { return Ok(()) };
    out.retain(|_| false);
    for (i, item) in items.iter().enumerate() {
        let obj = item.as_object().ok_or_else(|| ApiError::bad(format!("field 'lora[{i}]' must be an object")))?;
        let mut l = Fields::new(obj, &format!("lora[{i}]."));
        let name = l.str("path")?.filter(|p| !p.is_empty()).ok_or_else(|| ApiError::bad(format!("field 'lora[{i}].path' is required")))?;
        let multiplier = l.f32("multiplier")?.unwrap_or(1.0);
        let high_noise = l.bool("is_high_noise")?.unwrap_or(false);
        l.warn_unused("request");
        out.push(LoraRequest { name, multiplier, high_noise });
    }
    Ok(())
}

/// Applies the native request fields (the `/sdcpp/v1/*` body, or an `sd_cpp_extra_args`
/// block) to the draft. The top-level unknown fields are warned about by the caller.
pub fn apply_native(d: &mut Draft, f: &mut Fields) -> Result<()> {
    let video = d.kind == Kind::VidGen;
    let g = &mut d.opts.gen;
    read!(f, str "prompt" => g.params.prompt);
    read!(f, str "negative_prompt" => g.params.negative_prompt);
    read!(f, i32 "clip_skip" => g.params.clip_skip);
    read!(f, i32 "width" => g.width);
    read!(f, i32 "height" => g.height);
    read!(f, f32 "strength" => g.params.strength);
    read!(f, i64 "seed" => g.params.seed);
    let mut layers = g.skip_layers.clone();
    if let Some(mut sp) = f.object("sample_params")? {
        sample_params(&mut sp, &mut g.params.sample_params, &mut layers, true)?;
    }
    g.skip_layers = layers;
    if let Some(mut vt) = f.object("vae_tiling_params")? {
        let t = &mut g.params.vae_tiling_params;
        read!(vt, bool "enabled" => t.enabled);
        read!(vt, bool "temporal_tiling" => t.temporal_tiling);
        read!(vt, i32 "tile_size_x" => t.tile_size_x);
        read!(vt, i32 "tile_size_y" => t.tile_size_y);
        read!(vt, f32 "target_overlap" => t.target_overlap);
        read!(vt, f32 "rel_size_x" => t.rel_size_x);
        read!(vt, f32 "rel_size_y" => t.rel_size_y);
        if let Some(s) = vt.str("extra_tiling_args")? {
            t.extra_tiling_args = (!s.is_empty()).then_some(s);
        }
        vt.warn_unused("request");
    }
    if let Some(s) = f.str("cache_mode")? {
        if s != "disabled" && !s.is_empty() && stable_diffusion::api::CacheMode::parse(&s).is_none() {
            return Err(ApiError::bad(format!("invalid cache_mode '{s}', must be 'disabled', 'easycache', 'ucache', 'dbcache', 'taylorseer', 'cache-dit' or 'spectrum'")));
        }
        g.cache_mode = if s == "disabled" { String::new() } else { s };
    }
    read!(f, str "cache_option" => g.cache_option);
    if let Some(s) = f.str("scm_mask")? {
        g.params.cache.scm_mask = (!s.is_empty()).then_some(s);
    }
    read!(f, bool "scm_policy_dynamic" => g.scm_policy_dynamic);
    lora_field(f, &mut d.loras)?;
    let im = &mut d.images;
    if let Some(b) = f.image("init_image")? {
        im.init = Some(b);
    }
    if video {
        let v = &mut g.video;
        read!(f, i32 "video_frames" => v.video_frames);
        read!(f, i32 "fps" => v.fps);
        read!(f, f32 "moe_boundary" => v.moe_boundary);
        read!(f, f32 "vace_strength" => v.vace_strength);
        let mut layers = v.high_noise_skip_layers.clone();
        if let Some(mut sp) = f.object("high_noise_sample_params")? {
            sample_params(&mut sp, &mut v.high_noise, &mut layers, false)?;
        }
        v.high_noise_skip_layers = layers;
        if let Some(b) = f.image("end_image")? {
            im.end = Some(b);
        }
        read!(f, images "control_frames" => im.control_frames);
    } else {
        read!(f, i32 "batch_count" => g.params.batch_count);
        read!(f, i32 "qwen_image_layers" => g.params.qwen_image_layers);
        read!(f, bool "auto_resize_ref_image" => g.auto_resize_ref_image);
        read!(f, bool "increase_ref_index" => g.increase_ref_index);
        read!(f, f32 "control_strength" => g.params.control_strength);
        read!(f, f32 "ip_adapter_strength" => g.params.ip_adapter_strength);
        read!(f, bool "embed_image_metadata" => g.embed_metadata);
        if let Some(mut h) = f.object("hires")? {
            let hp = &mut g.params.hires;
            read!(h, bool "enabled" => hp.enabled);
            read!(h, str "upscaler" => g.hires_upscaler);
            read!(h, f32 "scale" => hp.scale);
            read!(h, i32 "target_width" => hp.target_width);
            read!(h, i32 "target_height" => hp.target_height);
            read!(h, i32 "steps" => hp.steps);
            read!(h, f32 "denoising_strength" => hp.denoising_strength);
            read!(h, f32s "custom_sigmas" => hp.custom_sigmas);
            read!(h, i32 "upscale_tile_size" => hp.upscale_tile_size);
            h.warn_unused("request");
        }
        read!(f, images "ref_images" => im.refs);
        if let Some(b) = f.image("mask_image")? {
            im.mask = Some(b);
        }
        if let Some(b) = f.image("control_image")? {
            im.control = Some(b);
        }
        if let Some(b) = f.image("ip_adapter_image")? {
            im.ip_adapter = Some(b);
        }
    }
    Ok(())
}

/// Takes the `<sd_cpp_extra_args>{...}</sd_cpp_extra_args>` block out of the prompt (the
/// compatibility APIs' way to reach native fields) and applies it.
pub fn apply_extra_args(d: &mut Draft) -> Result<()> {
    const OPEN: &str = "<sd_cpp_extra_args>";
    const CLOSE: &str = "</sd_cpp_extra_args>";
    let prompt = &d.opts.gen.params.prompt;
    let Some(start) = prompt.find(OPEN) else { return Ok(()) };
    let Some(len) = prompt[start + OPEN.len()..].find(CLOSE) else {
        return Err(ApiError::bad("invalid sd_cpp_extra_args: no closing </sd_cpp_extra_args>"));
    };
    let block = prompt[start + OPEN.len()..start + OPEN.len() + len].to_string();
    let rest = format!("{}{}", &prompt[..start], &prompt[start + OPEN.len() + len + CLOSE.len()..]);
    d.opts.gen.params.prompt = rest;
    let obj = parse_object(block.as_bytes()).map_err(|e| ApiError { error: format!("invalid sd_cpp_extra_args: {}", e.error), ..e })?;
    let mut f = Fields::new(&obj, "sd_cpp_extra_args.");
    apply_native(d, &mut f)?;
    if let Some(fmt) = f.str("output_format")? {
        let c = f.i64("output_compression")?;
        d.set_output(&fmt, c)?;
    }
    f.accept(&["output_compression"]);
    f.warn_unused("sd_cpp_extra_args");
    Ok(())
}

// ---- LoRAs ----

const MODEL_EXTS: [&str; 5] = [".safetensors", ".gguf", ".ckpt", ".pt", ".pth"];

/// One LoRA file under the LoRA directory.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraFile {
    /// The file stem.
    pub name: String,
    /// Relative to the LoRA directory, with `/`.
    pub path: String,
    pub full: PathBuf,
}

/// The LoRA files under `dir` (recursively, at most 4 levels and 5000 files: the default
/// directory is the working directory), sorted by path.
pub fn list_loras(dir: &str) -> Vec<LoraFile> {
    fn walk(root: &Path, dir: &Path, depth: usize, out: &mut Vec<LoraFile>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            if out.len() >= 5000 {
                return;
            }
            let p = e.path();
            let file_name = e.file_name().to_string_lossy().into_owned();
            if file_name.starts_with('.') {
                continue;
            }
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() && depth < 4 {
                walk(root, &p, depth + 1, out);
            } else if ft.is_file() {
                let lower = file_name.to_ascii_lowercase();
                let Some(ext) = MODEL_EXTS.iter().find(|x| lower.ends_with(*x)) else { continue };
                let rel = p.strip_prefix(root).unwrap_or(&p).to_string_lossy().replace('\\', "/");
                out.push(LoraFile { name: file_name[..file_name.len() - ext.len()].to_string(), path: rel, full: p.clone() });
            }
        }
    }
    let mut out = Vec::new();
    if !dir.is_empty() {
        walk(Path::new(dir), Path::new(dir), 0, &mut out);
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Finds a requested LoRA among the files: its relative path, that path without the
/// extension, or its name when only one file has it. Nothing outside the directory can be
/// named (no absolute paths, no `..`), unlike sd-cli's prompt tags.
pub fn find_lora<'a>(files: &'a [LoraFile], name: &str) -> Option<&'a LoraFile> {
    let name = name.trim_start_matches("./");
    let by_path = files.iter().find(|f| f.path == name || f.path.strip_suffix(&f.path[f.path.len() - ext_len(&f.path)..]) == Some(name));
    by_path.or_else(|| {
        let mut same = files.iter().filter(|f| f.name == name);
        let first = same.next();
        first.filter(|_| same.next().is_none())
    })
}

fn ext_len(path: &str) -> usize {
    let lower = path.to_ascii_lowercase();
    MODEL_EXTS.iter().find(|x| lower.ends_with(*x)).map_or(0, |x| x.len())
}

/// A tag's multiplier: its leading number, as C's `strtof` reads it.
fn tag_multiplier(s: &str) -> Option<f32> {
    let t = s.trim_start();
    (1..=t.len()).rev().filter(|&n| t.is_char_boundary(n)).find_map(|n| t[..n].parse::<f32>().ok())
}

/// Moves the prompt's `<lora:name:multiplier>` tags into the LoRA list.
fn take_prompt_tags(d: &mut Draft) -> Result<()> {
    let (prompt, tags) = args::split_lora_tags(&d.opts.gen.params.prompt);
    for (name, mult) in tags {
        let multiplier = tag_multiplier(&mult).ok_or_else(|| ApiError::bad(format!("invalid LoRA multiplier '{mult}' in <lora:{name}:{mult}>")))?;
        let (name, high_noise) = match name.strip_prefix("|high_noise|") {
            Some(n) => (n.to_string(), true),
            None => (name, false),
        };
        d.loras.push(LoraRequest { name, multiplier, high_noise });
    }
    d.opts.gen.params.prompt = prompt;
    Ok(())
}

// ---- finishing ----

/// What `finish` needs from the server: the loaded model and the LoRA directory.
pub struct Env<'a> {
    pub ctx: &'a Context,
    pub limits: &'a Limits,
    pub lora_dir: &'a str,
}

fn check_range(what: &str, value: i32, min: i32, max: i32, option: &str) -> Result<()> {
    if value < min || value > max {
        let hint = if option.is_empty() { String::new() } else { format!(" ({option})") };
        return Err(ApiError::bad(format!("{what} must be in [{min}, {max}]{hint}, got {value}")));
    }
    Ok(())
}

/// sd-cli's resolution and checks, this server's limits, the LoRAs looked up, the sampler
/// defaults of the model filled in and the pictures decoded.
pub fn finish(mut d: Draft, env: &Env) -> Result<Prepared> {
    let mode = d.kind.mode();
    if d.kind == Kind::ImgGen && !env.ctx.supports_image_generation() {
        return Err(ApiError::bad("loaded model does not support img_gen"));
    }
    if d.kind == Kind::VidGen && !env.ctx.supports_video_generation() {
        return Err(ApiError::bad("loaded model does not support vid_gen"));
    }
    let o = &mut d.opts;
    // sd-cli would look the prompt's tags up itself, anywhere on disk: the server does it
    // below, inside the LoRA directory only.
    let lora_dir = std::mem::take(&mut o.ctx.lora_model_dir);
    let resolved = o.resolve(&|k| std::env::var(k).ok());
    o.ctx.lora_model_dir = lora_dir;
    resolved.map_err(|e| ApiError::bad(format!("invalid generation parameters: {e}")))?;
    take_prompt_tags(&mut d)?;

    let lim = env.limits;
    let o = &mut d.opts;
    let g = &o.gen;
    check_range("sample_steps", g.params.sample_params.sample_steps, 1, lim.max_steps, "--max-steps")?;
    if mode == Mode::ImgGen {
        check_range("batch_count", g.params.batch_count, 1, lim.max_batch_count, "--max-batch-count")?;
        if g.params.hires.enabled {
            check_range("hires.steps", g.params.hires.steps, 0, lim.max_steps, "--max-steps")?;
        }
    } else {
        check_range("video_frames", g.video.video_frames, 1, lim.max_video_frames, "--max-video-frames")?;
        if g.video.high_noise.sample_steps > 0 {
            check_range("high_noise_sample_params.sample_steps", g.video.high_noise.sample_steps, 1, lim.max_steps, "--max-steps")?;
        }
    }

    // LoRAs: summed per file, like sd-cli's tags.
    if !d.loras.is_empty() {
        let files = list_loras(env.lora_dir);
        for l in &d.loras {
            let Some(file) = find_lora(&files, &l.name) else {
                return Err(ApiError::bad(format!("unknown lora '{}': not a file under the LoRA directory '{}' (GET /sdapi/v1/loras lists them)", l.name, env.lora_dir)));
            };
            let key = file.full.to_string_lossy().into_owned();
            let map = if l.high_noise { &mut o.gen.high_noise_loras } else { &mut o.gen.loras };
            *map.entry(key).or_insert(0.0) += l.multiplier;
        }
    }

    // The model's sampler and scheduler where the request left them to it (recorded in the
    // pictures' parameters, as sd-cli does).
    let sp = &mut o.gen.params.sample_params;
    let method = *sp.sample_method.get_or_insert_with(|| env.ctx.default_sample_method());
    sp.scheduler.get_or_insert_with(|| env.ctx.default_scheduler(Some(method)));
    if mode == Mode::VidGen {
        o.gen.video.high_noise.sample_method.get_or_insert_with(|| env.ctx.default_sample_method());
    }

    let inputs = decode_inputs(o, &d.images)?;
    let g = &o.gen;
    check_range("width", g.resolved_width(), lim.min_side, lim.max_width, "--max-width")?;
    check_range("height", g.resolved_height(), lim.min_side, lim.max_height, "--max-height")?;
    let h = &g.params.hires;
    if mode == Mode::ImgGen && h.enabled {
        let (tw, th) = if h.target_width > 0 || h.target_height > 0 {
            (h.target_width, h.target_height)
        } else {
            ((g.resolved_width() as f32 * h.scale) as i32, (g.resolved_height() as f32 * h.scale) as i32)
        };
        check_range("hires width", tw, 0, lim.max_width, "--max-width")?;
        check_range("hires height", th, 0, lim.max_height, "--max-height")?;
    }
    Ok(Prepared { kind: d.kind, opts: d.opts, inputs, output: d.output })
}

/// Decodes the pictures as sd-cli loads its files: the init and end images resized to the
/// size when it is set (else giving it), reference images as they are, the mask and control
/// pictures at the final size.
fn decode_inputs(o: &mut Opts, im: &ImageBytes) -> Result<Inputs> {
    let g = &mut o.gen;
    let sized = |g: &sd_cli::args::GenOpts| if g.size_is_set() { Some((g.width as u32, g.height as u32)) } else { None };
    let one = |g: &mut sd_cli::args::GenOpts, bytes: &Option<Vec<u8>>, name: &str| -> Result<Option<Image>> {
        let Some(b) = bytes else { return Ok(None) };
        let img = decode_image(b, name, sized(g), 3)?;
        g.set_size_if_unset(img.width as i32, img.height as i32);
        Ok(Some(img))
    };
    let init = one(g, &im.init, "init_image")?;
    let end = one(g, &im.end, "end_image")?;
    let mut refs = Vec::new();
    for (i, b) in im.refs.iter().enumerate() {
        let img = decode_image(b, &format!("ref_images[{i}]"), None, 3)?;
        g.set_size_if_unset(img.width as i32, img.height as i32);
        refs.push(img);
    }
    let size = Some((g.resolved_width().max(1) as u32, g.resolved_height().max(1) as u32));
    let mut mask = im.mask.as_ref().map(|b| decode_image(b, "mask_image", size, 1)).transpose()?;
    if im.invert_mask {
        if let Some(m) = &mut mask {
            m.data.iter_mut().for_each(|v| *v = 255 - *v);
        }
    }
    let control = im.control.as_ref().map(|b| decode_image(b, "control_image", size, 3)).transpose()?;
    let ip_adapter = im.ip_adapter.as_ref().map(|b| decode_image(b, "ip_adapter_image", None, 3)).transpose()?;
    let control_frames = im.control_frames.iter().enumerate().map(|(i, b)| decode_image(b, &format!("control_frames[{i}]"), size, 3)).collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Inputs { init, end, refs, mask, control, ip_adapter, control_frames })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(sample_method("Euler a", true).unwrap(), Some(SampleMethod::EulerA));
        assert_eq!(sample_method("euler_a", false).unwrap(), Some(SampleMethod::EulerA));
        assert_eq!(sample_method("default", false).unwrap(), None);
        assert!(sample_method("Euler a", false).unwrap_err().error.contains("unknown sampler 'Euler a'"));
        assert_eq!(scheduler("normal").unwrap(), Some(Scheduler::Discrete));
        assert!(scheduler("nope").unwrap_err().error.contains("unknown scheduler 'nope'"));
        assert_eq!(scheduler_names()[..2], ["discrete", "normal"]);
    }

    #[test]
    fn fields_are_typed() {
        let obj = parse_object(br#"{"a": 1, "b": "x", "c": 2.5, "d": null, "e": 3.0}"#).unwrap();
        let mut f = Fields::new(&obj, "");
        assert_eq!(f.i32("a").unwrap(), Some(1));
        assert_eq!(f.i32("e").unwrap(), Some(3));
        assert!(f.i32("b").unwrap_err().error.contains("field 'b' must be an integer"));
        assert!(f.i32("c").is_err());
        assert_eq!(f.f32("c").unwrap(), Some(2.5));
        assert_eq!(f.str("d").unwrap(), None);
        assert!(parse_object(b"{").unwrap_err().error == "invalid json");
        assert!(parse_object(b"[1]").unwrap_err().error.contains("JSON object"));
        assert!(parse_object(b" ").unwrap_err().error == "empty body");
    }

    #[test]
    fn base64_pictures() {
        assert_eq!(base64_image("aGk=", "x").unwrap(), b"hi");
        assert_eq!(base64_image("data:image/png;base64,aGk", "x").unwrap(), b"hi");
        assert!(base64_image("%%%", "init_image").unwrap_err().error.contains("'init_image' is not valid base64"));
    }

    #[test]
    fn lora_lookup_stays_inside_the_directory() {
        let f = |p: &str| LoraFile { name: Path::new(p).file_stem().unwrap().to_string_lossy().into(), path: p.into(), full: PathBuf::from("/l").join(p) };
        let files = [f("a.safetensors"), f("sub/b.gguf"), f("x/c.safetensors"), f("y/c.safetensors")];
        assert_eq!(find_lora(&files, "a").map(|l| l.path.as_str()), Some("a.safetensors"));
        assert_eq!(find_lora(&files, "sub/b").map(|l| l.path.as_str()), Some("sub/b.gguf"));
        assert_eq!(find_lora(&files, "b").map(|l| l.path.as_str()), Some("sub/b.gguf"));
        assert_eq!(find_lora(&files, "x/c.safetensors").map(|l| l.path.as_str()), Some("x/c.safetensors"));
        assert_eq!(find_lora(&files, "c"), None, "ambiguous");
        assert_eq!(find_lora(&files, "/l/a.safetensors"), None);
        assert_eq!(find_lora(&files, "../a"), None);
    }

    #[test]
    fn extra_args_block_is_taken_out_of_the_prompt() {
        let mut d = Draft::new(&Opts::default(), Kind::ImgGen);
        d.opts.gen.params.prompt = r#"a cat <sd_cpp_extra_args>{"sample_params":{"sample_steps":3},"seed":7}</sd_cpp_extra_args>"#.into();
        apply_extra_args(&mut d).unwrap();
        assert_eq!((d.opts.gen.params.prompt.as_str(), d.opts.gen.params.sample_params.sample_steps, d.opts.gen.params.seed), ("a cat ", 3, 7));
        d.opts.gen.params.prompt = "<sd_cpp_extra_args>{oops</sd_cpp_extra_args>".into();
        assert!(apply_extra_args(&mut d).unwrap_err().error.starts_with("invalid sd_cpp_extra_args"));
    }
}
