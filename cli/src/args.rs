//! sd-cli's options, accepted with the reference program's syntax.
//!
//! Every option is one whole argument (`--steps`, never `--steps=20`), and an option that
//! takes a value reads it from the next argument. Options are declared once, in `options()`,
//! together with the code that applies them: parsing, the usage text and the tests all read
//! that table. `resolve` then fills in what depends on several options (defaults, the
//! embeddings directory, LoRA tags in the prompt) and rejects inconsistent requests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use stable_diffusion::api::{CtxParams, Embedding, ImgGenParams, SampleParams, VidGenParams};
use stable_diffusion::types::{
    CacheMode, HiresUpscaler, LoraApplyMode, Prediction, Preview, RngType, SampleMethod, Scheduler, SdType, VaeFormat,
};

/// What sd-cli does with the models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    ImgGen,
    Adetailer,
    VidGen,
    Convert,
    Upscale,
    Metadata,
}

impl Mode {
    pub const ALL: [Mode; 6] = [Mode::ImgGen, Mode::Adetailer, Mode::VidGen, Mode::Convert, Mode::Upscale, Mode::Metadata];

    pub fn name(self) -> &'static str {
        match self {
            Mode::ImgGen => "img_gen",
            Mode::Adetailer => "adetailer",
            Mode::VidGen => "vid_gen",
            Mode::Convert => "convert",
            Mode::Upscale => "upscale",
            Mode::Metadata => "metadata",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// Options about the program itself: mode, output, preview, logging.
#[derive(Debug, Clone)]
pub struct CliOpts {
    pub mode: Mode,
    pub output: String,
    /// First index of numbered outputs; negative means 0.
    pub output_begin_idx: i32,
    pub preview: Preview,
    pub preview_path: String,
    pub preview_interval: i32,
    pub preview_noisy: bool,
    pub taesd_preview_only: bool,
    pub canny: bool,
    pub convert_name: bool,
    pub verbose: bool,
    pub color: bool,
    pub imatrix_out: String,
    pub imatrix_in: Vec<String>,
    /// `--image`: the file `-M metadata` inspects.
    pub image_path: String,
    /// `--metadata-format`: `text` or `json`.
    pub metadata_format: String,
    pub metadata_raw: bool,
    pub metadata_brief: bool,
    pub metadata_all: bool,
    /// Every option given, by its long name, in order (metadata mode names those it does not use).
    pub given: Vec<String>,
}

impl Default for CliOpts {
    fn default() -> Self {
        CliOpts {
            mode: Mode::ImgGen,
            output: "output.png".into(),
            output_begin_idx: -1,
            preview: Preview::None,
            preview_path: "preview.png".into(),
            preview_interval: 1,
            preview_noisy: false,
            taesd_preview_only: false,
            canny: false,
            convert_name: false,
            verbose: false,
            color: false,
            imatrix_out: String::new(),
            imatrix_in: Vec::new(),
            image_path: String::new(),
            metadata_format: "text".into(),
            metadata_raw: false,
            metadata_brief: false,
            metadata_all: false,
            given: Vec::new(),
        }
    }
}

/// Options of the model context. Paths and switches go straight into `params`.
#[derive(Debug, Clone)]
pub struct CtxOpts {
    pub params: CtxParams,
    pub embd_dir: String,
    pub lora_model_dir: String,
    pub hires_upscalers_dir: String,
    pub upscale_model: String,
    pub vae_format: String,
    pub offload_to_cpu: bool,
    pub control_net_cpu: bool,
    pub clip_on_cpu: bool,
    pub vae_on_cpu: bool,
    /// Set by `resolve` when no model was named and the default model is used.
    pub default_model: Option<PathBuf>,
}

impl Default for CtxOpts {
    fn default() -> Self {
        CtxOpts {
            params: CtxParams { n_threads: -1, max_vram: Some("0".into()), ..CtxParams::default() },
            embd_dir: String::new(),
            lora_model_dir: ".".into(),
            hires_upscalers_dir: String::new(),
            upscale_model: String::new(),
            vae_format: "auto".into(),
            offload_to_cpu: false,
            control_net_cpu: false,
            clip_on_cpu: false,
            vae_on_cpu: false,
            default_model: None,
        }
    }
}

/// Options of one generation request. Plain values go straight into `params`.
#[derive(Debug, Clone)]
pub struct GenOpts {
    pub params: ImgGenParams,
    /// -1 (unset) until given or taken from the init image; 512 when still unset.
    pub width: i32,
    pub height: i32,
    pub init_img: String,
    pub mask: String,
    pub control_image: String,
    pub ip_adapter_image: String,
    pub ref_images: Vec<String>,
    pub pm_id_images_dir: String,
    pub skip_layers: Vec<i32>,
    pub ad_model: String,
    pub ad_prompt: String,
    pub ad_negative_prompt: String,
    pub extra_ad_args: String,
    pub upscale_repeats: i32,
    pub upscale_tile_size: i32,
    pub circular: bool,
    pub circular_x: bool,
    pub circular_y: bool,
    /// The name given to --hires-upscaler (a built-in upscaler or a model name).
    pub hires_upscaler: String,
    pub cache_mode: String,
    pub cache_option: String,
    pub scm_policy_dynamic: bool,
    pub auto_resize_ref_image: bool,
    pub increase_ref_index: bool,
    pub embed_metadata: bool,
    /// LoRA file → multiplier, from `<lora:name:mult>` tags in the prompt.
    pub loras: BTreeMap<String, f32>,
    pub high_noise_loras: BTreeMap<String, f32>,
    /// The prompt as given, tags included (what the image metadata records).
    pub prompt_with_lora: String,
    /// The video request's own options (vid_gen mode).
    pub video: VideoOpts,
}

/// What only a video request uses: the end image, control and reference videos, the
/// high-noise expert's sampling (Wan2.2 MoE), frame count and rate.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoOpts {
    pub end_img: String,
    /// A folder of frames (pictures in file name order).
    pub control_video: String,
    pub ref_videos: Vec<String>,
    /// WAV soundtracks, paired by index with `ref_videos`.
    pub ref_video_audios: Vec<String>,
    pub ref_audios: Vec<String>,
    pub video_frames: i32,
    pub fps: i32,
    pub moe_boundary: f32,
    pub vace_strength: f32,
    /// Steps <= 0 become -1: the library splits the steps at `moe_boundary`.
    pub high_noise: SampleParams,
    pub high_noise_skip_layers: Vec<i32>,
}

impl Default for VideoOpts {
    fn default() -> Self {
        // The reference program's defaults (its high-noise steps start at 20, like --steps).
        VideoOpts {
            end_img: String::new(),
            control_video: String::new(),
            ref_videos: Vec::new(),
            ref_video_audios: Vec::new(),
            ref_audios: Vec::new(),
            video_frames: 1,
            fps: 16,
            moe_boundary: 0.875,
            vace_strength: 1.0,
            high_noise: SampleParams::default(),
            high_noise_skip_layers: vec![7, 8, 9],
        }
    }
}

impl Default for GenOpts {
    fn default() -> Self {
        GenOpts {
            params: ImgGenParams { seed: 42, ..ImgGenParams::default() },
            width: -1,
            height: -1,
            init_img: String::new(),
            mask: String::new(),
            control_image: String::new(),
            ip_adapter_image: String::new(),
            ref_images: Vec::new(),
            pm_id_images_dir: String::new(),
            skip_layers: vec![7, 8, 9],
            ad_model: String::new(),
            ad_prompt: String::new(),
            ad_negative_prompt: String::new(),
            extra_ad_args: String::new(),
            upscale_repeats: 1,
            upscale_tile_size: 128,
            circular: false,
            circular_x: false,
            circular_y: false,
            hires_upscaler: "Latent".into(),
            cache_mode: String::new(),
            cache_option: String::new(),
            scm_policy_dynamic: true,
            auto_resize_ref_image: true,
            increase_ref_index: false,
            embed_metadata: true,
            loras: BTreeMap::new(),
            high_noise_loras: BTreeMap::new(),
            prompt_with_lora: String::new(),
            video: VideoOpts::default(),
        }
    }
}

impl GenOpts {
    pub fn size_is_set(&self) -> bool {
        self.width > 0 && self.height > 0
    }

    /// Takes the size of an input image when -W/-H did not set both.
    pub fn set_size_if_unset(&mut self, width: i32, height: i32) {
        if !self.size_is_set() {
            stable_diffusion::sd_info!("set width x height to {width} x {height}");
            self.width = width;
            self.height = height;
        }
    }

    pub fn resolved_width(&self) -> i32 {
        if self.width > 0 {
            self.width
        } else {
            512
        }
    }

    pub fn resolved_height(&self) -> i32 {
        if self.height > 0 {
            self.height
        } else {
            512
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Opts {
    pub cli: CliOpts,
    pub ctx: CtxOpts,
    pub gen: GenOpts,
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Parsed {
    Run(Box<Opts>),
    Help,
    Version,
    Info,
    ListDevices,
}

/// A rejected command line; each line is one error message.
#[derive(Debug, Clone, PartialEq)]
pub struct ArgError(pub String);

impl std::fmt::Display for ArgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

type Setter = fn(&mut Opts, &str) -> Result<(), String>;

#[derive(Clone, Copy)]
enum Apply {
    Flag(fn(&mut Opts)),
    /// Takes the next argument; the usage text shows the hint (`<int>` ...) when not empty.
    Value(&'static str, Setter),
    Action(fn() -> Parsed),
}

/// The usage groups, printed in this order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Group {
    Cli,
    Context,
    Generation,
}

pub struct Opt {
    pub short: &'static str,
    pub long: &'static str,
    pub group: Group,
    help: String,
    apply: Apply,
}

impl Opt {
    pub fn takes_value(&self) -> bool {
        matches!(self.apply, Apply::Value(..))
    }

    /// `<string>`, `<int>`, `<float>`, or empty for switches and free-form values.
    pub fn hint(&self) -> &'static str {
        match self.apply {
            Apply::Value(h, _) => h,
            _ => "",
        }
    }

    pub fn help(&self) -> &str {
        &self.help
    }

    fn names(&self) -> String {
        let hint = match self.apply {
            Apply::Value(h, _) if !h.is_empty() => format!(" {h}"),
            _ => String::new(),
        };
        match (self.short.is_empty(), self.long.is_empty()) {
            (false, false) => format!("{}, {}{hint}", self.short, self.long),
            (true, _) => format!("{}{hint}", self.long),
            (false, true) => format!("{}{hint}", self.short),
        }
    }

    /// Order inside a usage group: strings, ints, floats, switches, then the rest.
    fn rank(&self) -> u8 {
        match self.apply {
            Apply::Value("<string>", _) => 0,
            Apply::Value("<int>", _) => 1,
            Apply::Value("<float>", _) => 2,
            Apply::Flag(_) => 3,
            _ => 4,
        }
    }
}

// ---- value parsing ----

/// A whole-argument integer (the reference crashes on "abc"; we say what is wrong).
pub fn parse_int(v: &str) -> Result<i32, String> {
    v.trim().parse::<i32>().map_err(|_| format!("'{v}' is not an integer"))
}

pub fn parse_i64(v: &str) -> Result<i64, String> {
    v.trim().parse::<i64>().map_err(|_| format!("'{v}' is not an integer"))
}

pub fn parse_float(v: &str) -> Result<f32, String> {
    v.trim().parse::<f32>().map_err(|_| format!("'{v}' is not a number"))
}

/// The longest leading number of `s`, like C's `strtof` (used for LoRA multipliers).
fn leading_float(s: &str) -> Option<f32> {
    let t = s.trim_start();
    (1..=t.len()).rev().filter(|&n| t.is_char_boundary(n)).find_map(|n| t[..n].parse::<f32>().ok())
}

fn path(target: &mut Option<String>, v: &str) {
    *target = (!v.is_empty()).then(|| v.to_string());
}

/// Repeated options of this kind accumulate, separated by commas.
fn concat(target: &mut Option<String>, v: &str) {
    match target {
        Some(t) if !t.is_empty() => {
            t.push(',');
            t.push_str(v);
        }
        _ => *target = Some(v.to_string()),
    }
}

fn concat_string(target: &mut String, v: &str) {
    if !target.is_empty() {
        target.push(',');
    }
    target.push_str(v);
}

fn enum_value<T>(v: &str, parse: impl Fn(&str) -> Option<T>, what: &str) -> Result<T, String> {
    parse(v).ok_or_else(|| format!("invalid {what} {v}"))
}

fn parse_scheduler(v: &str) -> Option<Scheduler> {
    if v == "normal" {
        Some(Scheduler::Discrete)
    } else {
        Scheduler::parse(v)
    }
}

/// A comma-separated list of sigmas, optionally in brackets.
pub fn parse_sigmas(v: &str) -> Result<Vec<f32>, String> {
    let inner = v.strip_prefix('[').unwrap_or(v);
    let inner = inner.strip_suffix(']').unwrap_or(inner);
    let mut out = Vec::new();
    for item in inner.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        out.push(item.parse::<f32>().map_err(|_| format!("invalid float value '{item}' in sigmas"))?);
    }
    if out.is_empty() && !inner.is_empty() {
        return Err(format!("could not parse any sigma values from '{v}'"));
    }
    Ok(out)
}

/// `[7,8,9]` or `[7 8 9]`.
pub fn parse_layers(v: &str) -> Result<Vec<i32>, String> {
    let inner = v
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .ok_or_else(|| format!("'{v}' is not a bracketed list like [7,8,9]"))?;
    inner.split([',', ' ']).filter(|s| !s.is_empty()).map(parse_int).collect()
}

/// `N` or `XxY`.
fn parse_pair<T: std::str::FromStr + Copy>(v: &str) -> Result<(T, T), String> {
    let one = |s: &str| s.trim().parse::<T>().map_err(|_| format!("'{v}' is not N or XxY"));
    match v.split_once('x') {
        Some((x, y)) => Ok((one(x)?, one(y)?)),
        None => one(v).map(|n| (n, n)),
    }
}

fn read_text_file(v: &str) -> Result<String, String> {
    std::fs::read(v).map(|b| String::from_utf8_lossy(&b).into_owned()).map_err(|e| format!("failed to read prompt file '{v}': {e}"))
}

// ---- the option table ----

macro_rules! flag {
    ($($f:ident).+ = $val:expr) => {
        Apply::Flag(|o: &mut Opts| o.$($f).+ = $val)
    };
}
macro_rules! int {
    ($($f:ident).+) => {
        Apply::Value("<int>", |o: &mut Opts, v: &str| {
            o.$($f).+ = parse_int(v)?;
            Ok(())
        })
    };
}
macro_rules! float {
    ($($f:ident).+) => {
        Apply::Value("<float>", |o: &mut Opts, v: &str| {
            o.$($f).+ = parse_float(v)?;
            Ok(())
        })
    };
}
/// A string option stored in a `String`.
macro_rules! string {
    ($($f:ident).+) => {
        Apply::Value("<string>", |o: &mut Opts, v: &str| {
            o.$($f).+ = v.to_string();
            Ok(())
        })
    };
}
/// A string option stored in an `Option<String>` (empty is unset).
macro_rules! opt_path {
    ($($f:ident).+) => {
        Apply::Value("<string>", |o: &mut Opts, v: &str| {
            path(&mut o.$($f).+, v);
            Ok(())
        })
    };
}
macro_rules! opt_concat {
    ($($f:ident).+) => {
        Apply::Value("<string>", |o: &mut Opts, v: &str| {
            concat(&mut o.$($f).+, v);
            Ok(())
        })
    };
}
/// A value option whose parsing is written out (no type hint in the usage text).
macro_rules! manual {
    (|$o:ident, $v:ident| $body:expr) => {
        Apply::Value("", |$o: &mut Opts, $v: &str| $body)
    };
}

fn opt(short: &'static str, long: &'static str, group: Group, help: impl Into<String>, apply: Apply) -> Opt {
    Opt { short, long, group, help: help.into(), apply }
}

fn names_of<T: Copy>(all: &[T], name: fn(T) -> &'static str) -> String {
    all.iter().map(|&v| name(v)).collect::<Vec<_>>().join(", ")
}

/// Every option sd-cli accepts.
pub fn options() -> Vec<Opt> {
    use Group::*;
    let previews = names_of(Preview::ALL, Preview::name);
    let samplers = names_of(SampleMethod::ALL, SampleMethod::name);
    let schedulers = names_of(Scheduler::ALL, Scheduler::name);
    let rngs = names_of(RngType::ALL, RngType::name);
    let predictions = names_of(Prediction::ALL, Prediction::name);
    let modes = names_of(&Mode::ALL, Mode::name);
    vec![
        // -- program --
        opt("-o", "--output", Cli, "where to write the result; a printf-style %d (e.g. output_%03d.png) numbers the images (default: ./output.png, ./output.gguf in convert mode)", string!(cli.output)),
        opt("", "--image", Cli, "path to the image to inspect (metadata mode)", string!(cli.image_path)),
        opt("", "--metadata-format", Cli, "metadata output format, one of [text, json] (default: text)", string!(cli.metadata_format)),
        opt("", "--metadata-raw", Cli, "include raw hex previews for unparsed metadata payloads", flag!(cli.metadata_raw = true)),
        opt("", "--metadata-brief", Cli, "truncate long metadata text values in text output", flag!(cli.metadata_brief = true)),
        opt("", "--metadata-all", Cli, "include structural/container entries such as IHDR, IDAT, and non-metadata JPEG segments", flag!(cli.metadata_all = true)),
        opt("", "--preview-path", Cli, "where to write preview images (default: ./preview.png)", string!(cli.preview_path)),
        opt("", "--imat-out", Cli, "collect an importance matrix during this run and write it to this file", string!(cli.imatrix_out)),
        opt("", "--preview-interval", Cli, "denoising steps between preview updates (default: 1, every step)", int!(cli.preview_interval)),
        opt("", "--output-begin-idx", Cli, "first index of numbered outputs (default: 0)", int!(cli.output_begin_idx)),
        opt("", "--canny", Cli, "run the Canny edge detector on the control image", flag!(cli.canny = true)),
        opt("", "--convert-name", Cli, "convert tensor names to the reference layout (convert mode)", flag!(cli.convert_name = true)),
        opt("-v", "--verbose", Cli, "also print debug messages", flag!(cli.verbose = true)),
        opt("", "--color", Cli, "color the log level tags", flag!(cli.color = true)),
        opt("", "--taesd-preview-only", Cli, format!("use TAESD only for previews, not for the final image (with --preview {})", Preview::Tae.name()), flag!(cli.taesd_preview_only = true)),
        opt("", "--preview-noisy", Cli, "preview the noisy latent instead of the denoised prediction", flag!(cli.preview_noisy = true)),
        opt("-M", "--mode", Cli, format!("run mode, one of [{modes}] (default: img_gen)"), manual!(|o, v| {
            o.cli.mode = Mode::parse(v).ok_or_else(|| format!("invalid mode {v}, must be one of [{}]", names_of(&Mode::ALL, Mode::name)))?;
            Ok(())
        })),
        opt("", "--preview", Cli, format!("preview method, one of [{previews}] (default: none)"), manual!(|o, v| {
            o.cli.preview = enum_value(v, Preview::parse, "preview method")?;
            Ok(())
        })),
        opt("", "--imat-in", Cli, "load an importance matrix first (repeatable)", manual!(|o, v| {
            o.cli.imatrix_in.push(v.to_string());
            Ok(())
        })),
        opt("-h", "--help", Cli, "print this help and exit", Apply::Action(|| Parsed::Help)),
        opt("", "--version", Cli, "print the version and exit", Apply::Action(|| Parsed::Version)),
        opt("", "--info", Cli, "print the version, system information and devices, then exit", Apply::Action(|| Parsed::Info)),
        // -- context --
        opt("-m", "--model", Context, "full model file (without one, see SD_CLI_MODEL in the README)", opt_path!(ctx.params.model_path)),
        opt("", "--clip_l", Context, "CLIP-L text encoder", opt_path!(ctx.params.clip_l_path)),
        opt("", "--clip_g", Context, "CLIP-G text encoder", opt_path!(ctx.params.clip_g_path)),
        opt("", "--clip_vision", Context, "CLIP vision encoder", opt_path!(ctx.params.clip_vision_path)),
        opt("", "--t5xxl", Context, "T5-XXL text encoder", opt_path!(ctx.params.t5xxl_path)),
        opt("", "--llm", Context, "LLM text encoder (e.g. Qwen2.5-VL for Qwen-Image)", opt_path!(ctx.params.llm_path)),
        opt("", "--llm_vision", Context, "LLM vision tower", opt_path!(ctx.params.llm_vision_path)),
        opt("", "--qwen2vl", Context, "deprecated name of --llm", opt_path!(ctx.params.llm_path)),
        opt("", "--qwen2vl_vision", Context, "deprecated name of --llm_vision", opt_path!(ctx.params.llm_vision_path)),
        opt("", "--diffusion-model", Context, "standalone diffusion model", opt_path!(ctx.params.diffusion_model_path)),
        opt("", "--high-noise-diffusion-model", Context, "standalone high-noise diffusion model", opt_path!(ctx.params.high_noise_diffusion_model_path)),
        opt("", "--uncond-diffusion-model", Context, "standalone unconditional diffusion model", opt_path!(ctx.params.uncond_diffusion_model_path)),
        opt("", "--embeddings-connectors", Context, "LTXAV embeddings connectors", opt_path!(ctx.params.embeddings_connectors_path)),
        opt("", "--vae", Context, "standalone VAE", opt_path!(ctx.params.vae_path)),
        opt("", "--vae-format", Context, "VAE latent format: auto, flux, sd3, flux2 or wan (default: auto)", string!(ctx.vae_format)),
        opt("", "--audio-vae", Context, "standalone LTX audio VAE", opt_path!(ctx.params.audio_vae_path)),
        opt("", "--taesd", Context, "TAESD tiny autoencoder: fast, lower quality decoding", opt_path!(ctx.params.taesd_path)),
        opt("", "--tae", Context, "same as --taesd", opt_path!(ctx.params.taesd_path)),
        opt("", "--control-net", Context, "ControlNet model", opt_path!(ctx.params.control_net_path)),
        opt("", "--ip-adapter", Context, "IP-Adapter model (needs --clip_vision)", opt_path!(ctx.params.ip_adapter_path)),
        opt("", "--motion-module", Context, "AnimateDiff motion module (SD 1.5)", opt_path!(ctx.params.motion_module_path)),
        opt("", "--embd-dir", Context, "textual inversion embeddings directory (each file's name is its token)", string!(ctx.embd_dir)),
        opt("", "--lora-model-dir", Context, "directory of the LoRAs named by <lora:name:multiplier> in the prompt (default: .)", string!(ctx.lora_model_dir)),
        opt("", "--hires-upscalers-dir", Context, "directory of hires-fix upscaler models", string!(ctx.hires_upscalers_dir)),
        opt("", "--tensor-type-rules", Context, "weight type per tensor name pattern, e.g. \"^vae\\.=f16,model\\.=q8_0\" (repeatable)", opt_concat!(ctx.params.tensor_type_rules)),
        opt("", "--model-args", Context, "extra model arguments, key=value list (repeatable)", opt_concat!(ctx.params.model_args)),
        opt("", "--photo-maker", Context, "PhotoMaker model", opt_path!(ctx.params.photo_maker_path)),
        opt("", "--pulid-weights", Context, "PuLID Flux weights", opt_path!(ctx.params.pulid_weights_path)),
        opt("", "--upscale-model", Context, "ESRGAN model applied to the results", string!(ctx.upscale_model)),
        opt("", "--backend", Context, "compute backend assignment, e.g. cpu or te=cpu,vae=cuda0,diffusion=vulkan0 (repeatable)", opt_concat!(ctx.params.backend)),
        opt("", "--params-backend", Context, "where weights live, e.g. disk, cpu or diffusion=disk,te=cpu (repeatable)", opt_concat!(ctx.params.params_backend)),
        opt("", "--split-mode", Context, "how a module assigned several devices is split: layer or row, or per module (repeatable)", opt_concat!(ctx.params.split_mode)),
        opt("", "--rpc-servers", Context, "RPC servers to offload to, host:port list (repeatable)", opt_concat!(ctx.params.rpc_servers)),
        opt("", "--max-vram", Context, "VRAM budget in GiB for segmented execution, one value or per device (e.g. cuda0=6); 0 disables", opt_path!(ctx.params.max_vram)),
        opt("-t", "--threads", Context, "worker threads; <= 0 means the number of physical cores (default: -1)", int!(ctx.params.n_threads)),
        opt("", "--stream-layers", Context, "stream weights layer by layer on top of --max-vram", flag!(ctx.params.stream_layers = true)),
        opt("", "--eager-load", Context, "load every weight when the model is loaded instead of on first use", flag!(ctx.params.eager_load = true)),
        opt("", "--auto-fit", Context, "choose device placements from the model size and the memory budgets", flag!(ctx.params.auto_fit = true)),
        opt("", "--force-sdxl-vae-conv-scale", Context, "force the conv scale of the SDXL VAE", flag!(ctx.params.force_sdxl_vae_conv_scale = true)),
        opt("", "--offload-to-cpu", Context, "keep weights in RAM and move them to the device when needed", flag!(ctx.offload_to_cpu = true)),
        opt("", "--mmap", Context, "memory-map model files", flag!(ctx.params.enable_mmap = true)),
        opt("", "--control-net-cpu", Context, "deprecated: --backend controlnet=cpu", flag!(ctx.control_net_cpu = true)),
        opt("", "--clip-on-cpu", Context, "deprecated: --backend te=cpu", flag!(ctx.clip_on_cpu = true)),
        opt("", "--vae-on-cpu", Context, "deprecated: --backend vae=cpu", flag!(ctx.vae_on_cpu = true)),
        opt("", "--fa", Context, "flash attention", flag!(ctx.params.flash_attn = true)),
        opt("", "--diffusion-fa", Context, "flash attention in the diffusion model only", flag!(ctx.params.diffusion_flash_attn = true)),
        opt("", "--diffusion-conv-direct", Context, "direct 2D convolutions in the diffusion model", flag!(ctx.params.diffusion_conv_direct = true)),
        opt("", "--vae-conv-direct", Context, "direct 2D convolutions in the VAE", flag!(ctx.params.vae_conv_direct = true)),
        opt("", "--type", Context, "weight type to convert to (f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, ...); default: the file's types", manual!(|o, v| {
            o.ctx.params.wtype = Some(enum_value(v, SdType::parse, "weight format")?);
            Ok(())
        })),
        opt("", "--rng", Context, format!("noise generator, one of [{rngs}] (default: cuda)"), manual!(|o, v| {
            o.ctx.params.rng_type = enum_value(v, RngType::parse, "rng type")?;
            Ok(())
        })),
        opt("", "--sampler-rng", Context, format!("sampler noise generator, one of [{rngs}] (default: as --rng)"), manual!(|o, v| {
            o.ctx.params.sampler_rng_type = Some(enum_value(v, RngType::parse, "sampler rng type")?);
            Ok(())
        })),
        opt("", "--prediction", Context, format!("prediction type override, one of [{predictions}]"), manual!(|o, v| {
            o.ctx.params.prediction = Some(enum_value(v, Prediction::parse, "prediction type")?);
            Ok(())
        })),
        opt("", "--lora-apply-mode", Context, "how LoRAs are applied: auto, immediately or at_runtime (default: auto, at_runtime for quantized weights)", manual!(|o, v| {
            o.ctx.params.lora_apply_mode = enum_value(v, LoraApplyMode::parse, "lora apply mode")?;
            Ok(())
        })),
        opt("", "--list-devices", Context, "print the backend devices ('name<TAB>description' lines; the names --backend accepts) and exit", Apply::Action(|| Parsed::ListDevices)),
        // -- generation --
        opt("-p", "--prompt", Generation, "the prompt", string!(gen.params.prompt)),
        opt("-n", "--negative-prompt", Generation, "the negative prompt (default: \"\")", string!(gen.params.negative_prompt)),
        opt("", "--ad-model", Generation, "YOLOv8 detector for ADetailer (converted)", string!(gen.ad_model)),
        opt("", "--ad-prompt", Generation, "ADetailer prompt (default: the prompt)", string!(gen.ad_prompt)),
        opt("", "--ad-negative-prompt", Generation, "ADetailer negative prompt (default: the negative prompt)", string!(gen.ad_negative_prompt)),
        opt("", "--extra-ad-args", Generation, "extra ADetailer arguments, key=value list (repeatable)", Apply::Value("<string>", |o, v| {
            concat_string(&mut o.gen.extra_ad_args, v);
            Ok(())
        })),
        opt("-i", "--init-img", Generation, "init image (image to image; the first frame of image-to-video)", string!(gen.init_img)),
        opt("", "--end-img", Generation, "end image: the last frame of first-last-frame-to-video (vid_gen)", string!(gen.video.end_img)),
        opt("", "--control-video", Generation, "folder of control video frames, pictures taken in file name order (e.g. 00.png, 01.png, ...), at most --video-frames of them, resized to the video size (vid_gen, Wan VACE)", string!(gen.video.control_video)),
        opt("", "--mask", Generation, "inpainting mask image", string!(gen.mask)),
        opt("", "--control-image", Generation, "ControlNet condition image", string!(gen.control_image)),
        opt("", "--ip-adapter-image", Generation, "IP-Adapter reference image", string!(gen.ip_adapter_image)),
        opt("", "--pm-id-images-dir", Generation, "directory of PhotoMaker identity images", string!(gen.pm_id_images_dir)),
        opt("", "--pm-id-embed-path", Generation, "PhotoMaker v2 identity embedding", opt_path!(gen.params.pm_params.id_embed_path)),
        opt("", "--pulid-id-embedding", Generation, "PuLID identity embedding", opt_path!(gen.params.pulid_params.id_embedding_path)),
        opt("", "--hires-upscaler", Generation, format!("hires-fix upscaler: {} or a model name in --hires-upscalers-dir (default: Latent)", names_of(&HiresUpscaler::ALL[1..HiresUpscaler::ALL.len() - 1], HiresUpscaler::name)), string!(gen.hires_upscaler)),
        opt("", "--extra-sample-args", Generation, "extra sampler/scheduler/guidance arguments, key=value list (repeatable)", opt_concat!(gen.params.sample_params.extra_sample_args)),
        opt("", "--extra-tiling-args", Generation, "extra VAE tiling arguments, key=value list (repeatable); the LTX video VAE reads temporal_tile_frames (default 4) and temporal_tile_overlap (default 1)", opt_concat!(gen.params.vae_tiling_params.extra_tiling_args)),
        opt("", "--ref-image-args", Generation, "how reference images are processed, key=value list (default: from the model)", Apply::Value("<string>", |o, v| {
            concat_string(&mut o.gen.params.ref_image_args, v);
            Ok(())
        })),
        opt("-H", "--height", Generation, "image height in pixels (default: 512, or the init image's)", int!(gen.height)),
        opt("-W", "--width", Generation, "image width in pixels (default: 512, or the init image's)", int!(gen.width)),
        opt("", "--steps", Generation, "sampling steps (default: 20)", int!(gen.params.sample_params.sample_steps)),
        opt("", "--clip-skip", Generation, "CLIP layers to skip at the end; <= 0 means the model's default (1 for SD1, 2 for SD2) (default: -1)", int!(gen.params.clip_skip)),
        opt("-b", "--batch-count", Generation, "number of images (default: 1)", int!(gen.params.batch_count)),
        opt("", "--video-frames", Generation, "number of video frames (vid_gen; default: 1)", int!(gen.video.video_frames)),
        opt("", "--fps", Generation, "frames per second of the video written (vid_gen; default: 16)", int!(gen.video.fps)),
        opt("", "--high-noise-steps", Generation, "(high noise) sampling steps; <= 0 lets the library split --steps at --moe-boundary (default: 20)", int!(gen.video.high_noise.sample_steps)),
        opt("", "--qwen-image-layers", Generation, "Qwen-Image-Layered layer count (default: 3)", int!(gen.params.qwen_image_layers)),
        opt("", "--timestep-shift", Generation, "timestep shift for NitroFusion models, 0..1000 (default: 0)", int!(gen.params.sample_params.shifted_timestep)),
        opt("", "--upscale-repeats", Generation, "how many times the ESRGAN upscaler runs (default: 1)", int!(gen.upscale_repeats)),
        opt("", "--upscale-tile-size", Generation, "ESRGAN tile size (default: 128)", int!(gen.upscale_tile_size)),
        opt("", "--hires-width", Generation, "hires-fix target width; 0 uses --hires-scale (default: 0)", int!(gen.params.hires.target_width)),
        opt("", "--hires-height", Generation, "hires-fix target height; 0 uses --hires-scale (default: 0)", int!(gen.params.hires.target_height)),
        opt("", "--hires-steps", Generation, "hires-fix second pass steps; 0 reuses --steps (default: 0)", int!(gen.params.hires.steps)),
        opt("", "--hires-upscale-tile-size", Generation, "tile size of model-based hires-fix upscalers (default: 128)", int!(gen.params.hires.upscale_tile_size)),
        opt("", "--cfg-scale", Generation, "classifier-free guidance scale (default: 7.0)", float!(gen.params.sample_params.guidance.txt_cfg)),
        opt("", "--img-cfg-scale", Generation, "image guidance scale for inpainting/edit models (default: --cfg-scale)", float!(gen.params.sample_params.guidance.img_cfg)),
        opt("", "--guidance", Generation, "distilled guidance scale (default: 3.5)", float!(gen.params.sample_params.guidance.distilled_guidance)),
        opt("", "--slg-scale", Generation, "skip-layer guidance scale, DiT models only; 0 disables (default: 0)", float!(gen.params.sample_params.guidance.slg.scale)),
        opt("", "--skip-layer-start", Generation, "where skip-layer guidance starts (default: 0.01)", float!(gen.params.sample_params.guidance.slg.layer_start)),
        opt("", "--skip-layer-end", Generation, "where skip-layer guidance ends (default: 0.2)", float!(gen.params.sample_params.guidance.slg.layer_end)),
        opt("", "--eta", Generation, "noise multiplier (default: the sampler's: 0 for ddim_trailing, tcd, res_multistep, res_2s; 1 for the ancestral/SDE samplers)", float!(gen.params.sample_params.eta)),
        opt("", "--flow-shift", Generation, "shift of flow models such as SD3 or Wan (default: the model's)", float!(gen.params.sample_params.flow_shift)),
        opt("", "--high-noise-cfg-scale", Generation, "(high noise) classifier-free guidance scale (default: 7.0)", float!(gen.video.high_noise.guidance.txt_cfg)),
        opt("", "--high-noise-img-cfg-scale", Generation, "(high noise) image guidance scale (default: --high-noise-cfg-scale)", float!(gen.video.high_noise.guidance.img_cfg)),
        opt("", "--high-noise-guidance", Generation, "(high noise) distilled guidance scale (default: 3.5)", float!(gen.video.high_noise.guidance.distilled_guidance)),
        opt("", "--high-noise-slg-scale", Generation, "(high noise) skip-layer guidance scale; 0 disables (default: 0)", float!(gen.video.high_noise.guidance.slg.scale)),
        opt("", "--high-noise-skip-layer-start", Generation, "(high noise) where skip-layer guidance starts (default: 0.01)", float!(gen.video.high_noise.guidance.slg.layer_start)),
        opt("", "--high-noise-skip-layer-end", Generation, "(high noise) where skip-layer guidance ends (default: 0.2)", float!(gen.video.high_noise.guidance.slg.layer_end)),
        opt("", "--high-noise-eta", Generation, "(high noise) noise multiplier (default: the sampler's)", float!(gen.video.high_noise.eta)),
        opt("", "--moe-boundary", Generation, "timestep boundary between the high-noise and the low-noise Wan2.2 experts, used when --high-noise-steps <= 0 (default: 0.875)", float!(gen.video.moe_boundary)),
        opt("", "--vace-strength", Generation, "strength of the Wan VACE control (default: 1.0)", float!(gen.video.vace_strength)),
        opt("", "--strength", Generation, "how much the init image is noised, 0..1 (default: 0.75)", float!(gen.params.strength)),
        opt("", "--pm-style-strength", Generation, "PhotoMaker style strength (default: 20)", float!(gen.params.pm_params.style_strength)),
        opt("", "--pulid-id-weight", Generation, "PuLID identity weight (default: 1.0)", float!(gen.params.pulid_params.id_weight)),
        opt("", "--control-strength", Generation, "ControlNet strength (default: 0.9)", float!(gen.params.control_strength)),
        opt("", "--ip-adapter-strength", Generation, "IP-Adapter strength (default: 1.0)", float!(gen.params.ip_adapter_strength)),
        opt("", "--vae-tile-overlap", Generation, "VAE tile overlap, fraction of the tile size (default: 0.5)", float!(gen.params.vae_tiling_params.target_overlap)),
        opt("", "--hires-scale", Generation, "hires-fix scale when no target size is given (default: 2.0)", float!(gen.params.hires.scale)),
        opt("", "--hires-denoising-strength", Generation, "hires-fix second pass strength (default: 0.7)", float!(gen.params.hires.denoising_strength)),
        opt("", "--increase-ref-index", Generation, "deprecated: --ref-image-args ref_index_mode=increase", flag!(gen.increase_ref_index = true)),
        opt("", "--disable-auto-resize-ref-image", Generation, "deprecated: --ref-image-args resize_before_vae=0", flag!(gen.auto_resize_ref_image = false)),
        opt("", "--circular", Generation, "circular padding on both axes (tileable images)", flag!(gen.circular = true)),
        opt("", "--circularx", Generation, "circular padding on the x axis only", flag!(gen.circular_x = true)),
        opt("", "--circulary", Generation, "circular padding on the y axis only", flag!(gen.circular_y = true)),
        opt("", "--disable-image-metadata", Generation, "do not write the generation parameters into the images", flag!(gen.embed_metadata = false)),
        opt("", "--vae-tiling", Generation, "decode with the VAE in tiles (less memory)", flag!(gen.params.vae_tiling_params.enabled = true)),
        opt("", "--temporal-tiling", Generation, "temporal tiling in the video VAE decode", flag!(gen.params.vae_tiling_params.temporal_tiling = true)),
        opt("", "--hires", Generation, "enable the hires fix", flag!(gen.params.hires.enabled = true)),
        opt("-s", "--seed", Generation, "noise seed; < 0 picks a random one (default: 42)", manual!(|o, v| {
            o.gen.params.seed = parse_i64(v)?;
            Ok(())
        })),
        opt("", "--sampling-method", Generation, format!("sampler, one of [{samplers}] (default: the model's, euler_a for SD1/SD2/SDXL)"), manual!(|o, v| {
            o.gen.params.sample_params.sample_method = Some(enum_value(v, SampleMethod::parse, "sample method")?);
            Ok(())
        })),
        opt("", "--high-noise-sampling-method", Generation, format!("(high noise) sampler, one of [{samplers}] (default: the model's)"), manual!(|o, v| {
            o.gen.video.high_noise.sample_method = Some(enum_value(v, SampleMethod::parse, "high noise sample method")?);
            Ok(())
        })),
        opt("", "--scheduler", Generation, format!("sigma schedule, one of [{schedulers}]; normal means discrete (default: the model's)"), manual!(|o, v| {
            o.gen.params.sample_params.scheduler = Some(enum_value(v, parse_scheduler, "scheduler")?);
            Ok(())
        })),
        opt("", "--sigmas", Generation, "custom sigmas instead of the scheduler, comma-separated (e.g. \"14.61,7.8,3.5,0.0\")", manual!(|o, v| {
            o.gen.params.sample_params.custom_sigmas.extend(parse_sigmas(v)?);
            Ok(())
        })),
        opt("", "--hires-sigmas", Generation, "custom sigmas of the hires-fix second pass, comma-separated", manual!(|o, v| {
            o.gen.params.hires.custom_sigmas.extend(parse_sigmas(v)?);
            Ok(())
        })),
        opt("", "--skip-layers", Generation, "layers skipped by skip-layer guidance (default: [7,8,9])", manual!(|o, v| {
            o.gen.skip_layers = parse_layers(v)?;
            Ok(())
        })),
        opt("", "--high-noise-skip-layers", Generation, "(high noise) layers skipped by skip-layer guidance (default: [7,8,9])", manual!(|o, v| {
            o.gen.video.high_noise_skip_layers = parse_layers(v)?;
            Ok(())
        })),
        opt("", "--ref-video", Generation, "folder of reference video frames at 24 fps (vid_gen, repeatable)", manual!(|o, v| {
            o.gen.video.ref_videos.push(v.to_string());
            Ok(())
        })),
        opt("", "--ref-video-audio", Generation, "WAV soundtrack of the --ref-video of the same position (vid_gen, repeatable)", manual!(|o, v| {
            o.gen.video.ref_video_audios.push(v.to_string());
            Ok(())
        })),
        opt("", "--ref-audio", Generation, "reference WAV audio (vid_gen, repeatable)", manual!(|o, v| {
            o.gen.video.ref_audios.push(v.to_string());
            Ok(())
        })),
        opt("-r", "--ref-image", Generation, "reference image, e.g. for Flux Kontext (repeatable)", manual!(|o, v| {
            o.gen.ref_images.push(v.to_string());
            Ok(())
        })),
        opt("", "--cache-mode", Generation, "step caching: ucache (UNet models), easycache (DiT), spectrum (UNet and DiT forecasting); dbcache, taylorseer, cache-dit (DiT block-level, not supported yet: ignored)", manual!(|o, v| {
            if !["easycache", "ucache", "dbcache", "taylorseer", "cache-dit", "spectrum"].contains(&v) {
                return Err(format!("invalid cache mode '{v}', must be 'easycache', 'ucache', 'dbcache', 'taylorseer', 'cache-dit', or 'spectrum'"));
            }
            o.gen.cache_mode = v.to_string();
            Ok(())
        })),
        opt("", "--cache-option", Generation, "cache parameters, key=value list: threshold, start, end, decay, relative, reset (easycache/ucache); Fn, Bn, threshold, warmup (dbcache/taylorseer/cache-dit); w, m, lam, window, flex, warmup, stop (spectrum)", manual!(|o, v| {
            o.gen.cache_option = v.to_string();
            Ok(())
        })),
        opt("", "--scm-mask", Generation, "cache-dit step mask, comma-separated 0/1 (1 computes, 0 may reuse)", manual!(|o, v| {
            o.gen.params.cache.scm_mask = Some(v.to_string());
            Ok(())
        })),
        opt("", "--scm-policy", Generation, "cache-dit step mask policy: dynamic (default) or static", manual!(|o, v| {
            o.gen.scm_policy_dynamic = match v {
                "dynamic" => true,
                "static" => false,
                _ => return Err(format!("invalid scm policy '{v}', must be 'dynamic' or 'static'")),
            };
            Ok(())
        })),
        opt("", "--vae-tile-size", Generation, "VAE tile size, N or XxY (default: 32x32)", manual!(|o, v| {
            let (x, y) = parse_pair::<i32>(v)?;
            o.gen.params.vae_tiling_params.tile_size_x = x;
            o.gen.params.vae_tiling_params.tile_size_y = y;
            Ok(())
        })),
        opt("", "--vae-relative-tile-size", Generation, "VAE tile size relative to the image, N or XxY: a fraction when < 1, a tile count when >= 1 (overrides --vae-tile-size)", manual!(|o, v| {
            let (x, y) = parse_pair::<f32>(v)?;
            o.gen.params.vae_tiling_params.rel_size_x = x;
            o.gen.params.vae_tiling_params.rel_size_y = y;
            Ok(())
        })),
        opt("", "--prompt-file", Generation, "read the prompt from this file", manual!(|o, v| {
            o.gen.params.prompt = read_text_file(v)?;
            Ok(())
        })),
        opt("", "--negative-prompt-file", Generation, "read the negative prompt from this file", manual!(|o, v| {
            o.gen.params.negative_prompt = read_text_file(v)?;
            Ok(())
        })),
    ]
}

/// The options metadata mode uses; it warns about any other.
const METADATA_OPTIONS: &[&str] = &["--mode", "--image", "--metadata-format", "--metadata-raw", "--metadata-brief", "--metadata-all", "--verbose", "--color"];

/// Reads the command line (without the program name).
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Parsed, ArgError> {
    let table = options();
    let mut opts = Opts::default();
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_ref();
        let found = table.iter().find(|o| (!o.short.is_empty() && o.short == arg) || (!o.long.is_empty() && o.long == arg));
        if let Some(o) = found {
            opts.cli.given.push(if o.long.is_empty() { o.short } else { o.long }.to_string());
        }
        match found.map(|o| o.apply) {
            Some(Apply::Flag(set)) => set(&mut opts),
            Some(Apply::Action(action)) => return Ok(action()),
            Some(Apply::Value(_, set)) => {
                let invalid = format!("error: invalid parameter for argument: {arg}");
                let Some(value) = args.get(i + 1) else { return Err(ArgError(invalid)) };
                set(&mut opts, value.as_ref()).map_err(|why| ArgError(format!("error: {why}\n{invalid}")))?;
                i += 1;
            }
            None => return Err(ArgError(format!("error: unknown argument: {arg}"))),
        }
        i += 1;
    }
    Ok(Parsed::Run(Box::new(opts)))
}

// ---- usage ----

/// Breaks `text` into lines of at most `width` characters (longer words are cut), every line
/// after the first indented by `indent` spaces.
fn wrap(text: &str, width: usize, indent: usize) -> String {
    let mut lines: Vec<String> = vec![String::new()];
    for word in text.split_whitespace() {
        let mut word: Vec<char> = word.chars().collect();
        while !word.is_empty() {
            let line = lines.last_mut().expect("never empty");
            let used = line.chars().count();
            let sep = usize::from(used > 0);
            if used + sep + word.len() <= width {
                if sep == 1 {
                    line.push(' ');
                }
                line.extend(word.drain(..));
            } else if used > 0 {
                lines.push(String::new());
            } else {
                line.extend(word.drain(..width.min(word.len())));
                if !word.is_empty() {
                    lines.push(String::new());
                }
            }
        }
    }
    lines.join(&format!("\n{}", " ".repeat(indent)))
}

fn print_group(out: &mut String, table: &[Opt], group: Group) {
    const LINE: usize = 120;
    let mut entries: Vec<&Opt> = table.iter().filter(|o| o.group == group).collect();
    entries.sort_by_key(|o| o.rank());
    let name_width = entries.iter().map(|o| o.names().len()).max().unwrap_or(0);
    let indent = 2 + name_width + 4;
    for o in entries {
        let names = o.names();
        out.push_str(&format!("  {names:<w$}{}\n", wrap(&o.help, LINE.saturating_sub(indent).max(40), indent), w = name_width + 4));
    }
}

/// The full usage text.
pub fn usage(program: &str) -> String {
    let table = options();
    let mut out = format!("{}\nUsage: {program} [options]\n\nCLI Options:\n", version_string());
    print_group(&mut out, &table, Group::Cli);
    out.push_str("\nContext Options:\n");
    print_group(&mut out, &table, Group::Context);
    out.push_str("\nGeneration Options:\n");
    print_group(&mut out, &table, Group::Generation);
    out.push_str(&format!(
        "\nWithout --model/--diffusion-model, image generation uses the model named by ${DEFAULT_MODEL_ENV},\nor {}.\n",
        default_model_path(&|k| std::env::var(k).ok()).display()
    ));
    out
}

pub fn version_string() -> String {
    format!("stable-diffusion.cpp version {}, commit {}", stable_diffusion::api::version(), stable_diffusion::api::commit())
}

// ---- resolution and validation ----

/// The environment variable naming the model used when none is given.
pub const DEFAULT_MODEL_ENV: &str = "SD_CLI_MODEL";

/// Where the default model is looked for: `$SD_CLI_MODEL`, else `sd1.safetensors` in the
/// fixture cache (`$SD_FIXTURE_CACHE`, default `~/.cache/sd-rs-fixtures`), where
/// `tests/fixtures/synth_model.py sd1` puts the synthetic SD1 checkpoint.
pub fn default_model_path(env: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    let set = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(p) = set(DEFAULT_MODEL_ENV) {
        return PathBuf::from(p);
    }
    let cache = set("SD_FIXTURE_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = set("HOME").unwrap_or_else(|| ".".into());
        Path::new(&home).join(".cache").join("sd-rs-fixtures")
    });
    cache.join("sd1.safetensors")
}

const MODEL_EXTS: [&str; 4] = [".gguf", ".safetensors", ".pt", ".ckpt"];

/// Token → file for every embedding file (by extension) directly in `dir`; nothing when
/// `dir` is not a directory.
pub fn embeddings_in(dir: &str) -> Vec<Embedding> {
    let mut found = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let p = entry.path();
            if !p.is_file() {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(ext) = MODEL_EXTS.iter().find(|e| name.len() > e.len() && name.ends_with(*e)) else { continue };
            found.insert(name[..name.len() - ext.len()].to_string(), p.to_string_lossy().into_owned());
        }
    }
    found.into_iter().map(|(name, path)| Embedding { name, path }).collect()
}

/// Collapses `.` and `..` components and repeated separators without touching the disk.
pub fn lexically_normal(p: &str) -> String {
    let absolute = p.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." if parts.last().is_some_and(|l| *l != "..") => {
                parts.pop();
            }
            ".." if absolute => {}
            _ => parts.push(c),
        }
    }
    let joined = parts.join("/");
    match (absolute, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".into(),
        (false, false) => joined,
    }
}

/// Finds the `<lora:name:multiplier>` tags of `prompt`: returns the prompt without them and
/// (name, multiplier-text) for each, in order.
pub fn split_lora_tags(prompt: &str) -> (String, Vec<(String, String)>) {
    let mut rest = prompt;
    let mut kept = String::new();
    let mut tags = Vec::new();
    while let Some(at) = rest.find("<lora:") {
        let after = &rest[at + "<lora:".len()..];
        let tag = after.find(['>', ':']).filter(|&n| n > 0 && after.as_bytes()[n] == b':').and_then(|name_len| {
            let mult = &after[name_len + 1..];
            let end = mult.find('>').filter(|&n| n > 0)?;
            Some((after[..name_len].to_string(), mult[..end].to_string(), name_len + 1 + end + 1))
        });
        match tag {
            Some((name, mult, len)) => {
                kept.push_str(&rest[..at]);
                tags.push((name, mult));
                rest = &after[len..];
            }
            None => {
                kept.push_str(&rest[..at + 1]);
                rest = &rest[at + 1..];
            }
        }
    }
    kept.push_str(rest);
    (kept, tags)
}

impl GenOpts {
    /// Moves `<lora:...>` tags from the prompt into the LoRA lists, looking the files up in
    /// `dir` (a name without extension tries the model extensions).
    fn extract_loras(&mut self, dir: &str) {
        let (prompt, tags) = split_lora_tags(&self.params.prompt);
        self.params.prompt = prompt;
        for (name, mult) in tags {
            let Some(mult) = leading_float(&mult) else { continue };
            let (name, high_noise) = match name.strip_prefix("|high_noise|") {
                Some(n) => (n.to_string(), true),
                None => (name, false),
            };
            let base = if name.starts_with('/') { PathBuf::from(&name) } else { Path::new(dir).join(&name) };
            let file = if base.exists() {
                Some(base.clone())
            } else {
                MODEL_EXTS.iter().map(|e| PathBuf::from(format!("{}{e}", base.display()))).find(|p| p.exists())
            };
            let Some(file) = file else {
                stable_diffusion::sd_warn!("can not found lora {}", lexically_normal(&base.to_string_lossy()));
                continue;
            };
            let key = lexically_normal(&file.to_string_lossy());
            let map = if high_noise { &mut self.high_noise_loras } else { &mut self.loras };
            *map.entry(key).or_insert(0.0) += mult;
        }
    }

    /// Reads --cache-mode / --cache-option into the cache parameters.
    fn resolve_cache(&mut self) -> Result<(), String> {
        let c = &mut self.params.cache;
        if !self.cache_mode.is_empty() {
            c.mode = CacheMode::parse(&self.cache_mode).ok_or_else(|| format!("invalid cache mode '{}'", self.cache_mode))?;
        }
        let per_reuse = matches!(self.cache_mode.as_str(), "easycache" | "ucache");
        let spectrum = self.cache_mode == "spectrum";
        let options = self.cache_option.strip_suffix(',').unwrap_or(&self.cache_option);
        for item in options.split(',').filter(|_| !self.cache_option.is_empty()) {
            let (key, val) = item.split_once('=').ok_or_else(|| format!("cache option '{item}' missing '=' separator"))?;
            let bad = || format!("invalid value '{val}' for parameter '{key}'");
            let f = || val.trim().parse::<f32>().map_err(|_| bad());
            let i = || val.trim().parse::<i32>().map_err(|_| bad());
            match key {
                "threshold" if per_reuse => c.reuse_threshold = f()?,
                "threshold" => c.residual_diff_threshold = f()?,
                "start" => c.start_percent = f()?,
                "end" => c.end_percent = f()?,
                "decay" => c.error_decay_rate = f()?,
                "relative" => c.use_relative_threshold = f()? != 0.0,
                "reset" => c.reset_error_on_compute = f()? != 0.0,
                "Fn" | "fn" => c.fn_compute_blocks = i()?,
                "Bn" | "bn" => c.bn_compute_blocks = i()?,
                "warmup" if spectrum => c.spectrum_warmup_steps = i()?,
                "warmup" => c.max_warmup_steps = i()?,
                "w" => c.spectrum_w = f()?,
                "m" => c.spectrum_m = i()?,
                "lam" => c.spectrum_lam = f()?,
                "window" => c.spectrum_window_size = i()?,
                "flex" => c.spectrum_flex_window = f()?,
                "stop" => c.spectrum_stop_percent = f()?,
                _ => return Err(format!("unknown cache parameter '{key}'")),
            }
        }
        if matches!(c.mode, CacheMode::DbCache | CacheMode::TaylorSeer | CacheMode::CacheDit) {
            c.scm_policy_dynamic = self.scm_policy_dynamic;
        }
        Ok(())
    }

    /// Turns --hires-upscaler into an upscaler (or a model file in `dir`).
    fn resolve_hires(&mut self, dir: &str) -> Result<(), String> {
        let h = &mut self.params.hires;
        if !h.enabled {
            return Ok(());
        }
        if self.hires_upscaler.is_empty() {
            self.hires_upscaler = "Latent".into();
        }
        match HiresUpscaler::parse(&self.hires_upscaler) {
            Some(HiresUpscaler::None) => h.enabled = false,
            Some(u) => h.upscaler = u,
            None => {
                let name = &self.hires_upscaler;
                if dir.is_empty() {
                    return Err("hires upscaler directory is empty".into());
                }
                let lower = name.to_ascii_lowercase();
                if name.contains(['/', '\\']) || [".gguf", ".safetensors", ".pt", ".pth"].iter().any(|e| lower.ends_with(e)) {
                    return Err(format!("hires upscaler must be a model name without path or extension: {name}"));
                }
                let file = [".gguf", ".safetensors", ".pt", ".pth"]
                    .iter()
                    .map(|e| Path::new(dir).join(format!("{name}{e}")))
                    .find(|p| p.is_file())
                    .ok_or_else(|| format!("can not find hires upscaler {name} in {}", lexically_normal(dir)))?;
                h.model_path = Some(lexically_normal(&file.to_string_lossy()));
                h.upscaler = HiresUpscaler::Model;
            }
        }
        Ok(())
    }

    fn validate(&self, mode: Mode) -> Result<(), String> {
        let p = &self.params;
        let sp = &p.sample_params;
        let checks: [(bool, &str); 6] = [
            (p.batch_count <= 0, "batch_count must be greater than 0"),
            (p.qwen_image_layers < 0, "qwen_image_layers must be non-negative"),
            (sp.sample_steps <= 0, "the sample_steps must be greater than 0"),
            (!(0.0..=1.0).contains(&p.strength), "can only work with strength in [0.0, 1.0]"),
            (sp.guidance.txt_cfg < 0.0, "cfg_scale must be positive"),
            (!(0..=1000).contains(&sp.shifted_timestep), "shifted_timestep must be in range [0, 1000]"),
        ];
        if let Some((_, msg)) = checks.iter().find(|(bad, _)| *bad) {
            return Err(msg.to_string());
        }
        if matches!(self.cache_mode.as_str(), "easycache" | "ucache") {
            let c = &p.cache;
            if c.reuse_threshold < 0.0 {
                return Err("cache threshold must be non-negative".into());
            }
            if c.start_percent < 0.0 || c.start_percent >= 1.0 || c.end_percent <= 0.0 || c.end_percent > 1.0 || c.start_percent >= c.end_percent {
                return Err("cache start/end percents must satisfy 0.0 <= start < end <= 1.0".into());
            }
        }
        if self.upscale_repeats < 1 {
            return Err("upscale_repeats must be at least 1".into());
        }
        if self.upscale_tile_size < 1 {
            return Err("upscale_tile_size must be at least 1".into());
        }
        let h = &p.hires;
        if h.enabled {
            let checks: [(bool, &str); 6] = [
                (h.target_width < 0 || h.target_height < 0, "hires target width and height must be >= 0"),
                (h.scale <= 0.0 && h.target_width <= 0 && h.target_height <= 0, "hires scale must be positive when target size is not set"),
                (h.steps < 0, "hires steps must be >= 0"),
                (h.denoising_strength <= 0.0 || h.denoising_strength > 1.0, "hires denoising strength must be in (0.0, 1.0]"),
                (h.custom_sigmas.len() == 1, "hires custom sigmas must contain at least two values"),
                (h.upscale_tile_size < 1, "hires upscale tile size must be positive"),
            ];
            if let Some((_, msg)) = checks.iter().find(|(bad, _)| *bad) {
                return Err(msg.to_string());
            }
        }
        if matches!(mode, Mode::Upscale | Mode::Adetailer) && self.init_img.is_empty() {
            return Err(format!("{} mode needs an init image (--init-img)", mode.name()));
        }
        if mode == Mode::Adetailer && self.ad_model.is_empty() {
            return Err("adetailer mode needs a detector model (--ad-model)".into());
        }
        if !self.ad_model.is_empty() && !matches!(mode, Mode::ImgGen | Mode::Adetailer) {
            return Err("--ad-model is only supported in image generation and adetailer modes".into());
        }
        let v = &self.video;
        if mode == Mode::VidGen {
            if v.video_frames <= 0 {
                return Err(format!("video_frames must be greater than 0, got {}", v.video_frames));
            }
            if v.fps <= 0 {
                return Err(format!("fps must be greater than 0, got {}", v.fps));
            }
        }
        if v.ref_video_audios.len() > v.ref_videos.len() {
            return Err("each --ref-video-audio needs a corresponding --ref-video".into());
        }
        if mode != Mode::VidGen && !(v.ref_videos.is_empty() && v.ref_video_audios.is_empty() && v.ref_audios.is_empty()) {
            return Err("reference video and audio inputs require vid_gen mode".into());
        }
        Ok(())
    }

    /// The options given that `mode` does not use (the reference ignores them silently).
    pub fn unused_options(&self, mode: Mode) -> Vec<&'static str> {
        let p = &self.params;
        let (v, d) = (&self.video, VideoOpts::default());
        let image = ImgGenParams::default();
        let checks: Vec<(bool, &'static str)> = if mode == Mode::VidGen {
            vec![
                (!self.mask.is_empty(), "--mask"),
                (!self.control_image.is_empty(), "--control-image"),
                (!self.ip_adapter_image.is_empty(), "--ip-adapter-image"),
                (!self.pm_id_images_dir.is_empty(), "--pm-id-images-dir"),
                (p.pm_params.id_embed_path.is_some(), "--pm-id-embed-path"),
                (p.pulid_params.id_embedding_path.is_some(), "--pulid-id-embedding"),
                (p.batch_count != 1, "--batch-count"),
                (p.control_strength != image.control_strength, "--control-strength"),
                (p.ip_adapter_strength != image.ip_adapter_strength, "--ip-adapter-strength"),
                (p.qwen_image_layers != image.qwen_image_layers, "--qwen-image-layers"),
                (!p.ref_image_args.is_empty() || !self.auto_resize_ref_image || self.increase_ref_index, "--ref-image-args"),
            ]
        } else {
            vec![
                (!v.end_img.is_empty(), "--end-img"),
                (!v.control_video.is_empty(), "--control-video"),
                (v.video_frames != d.video_frames, "--video-frames"),
                (v.fps != d.fps, "--fps"),
                (v.moe_boundary != d.moe_boundary, "--moe-boundary"),
                (v.vace_strength != d.vace_strength, "--vace-strength"),
                (v.high_noise != d.high_noise || v.high_noise_skip_layers != d.high_noise_skip_layers, "--high-noise-*"),
            ]
        };
        checks.into_iter().filter(|(given, _)| *given).map(|(_, name)| name).collect()
    }
}

/// A random seed for `-s` < 0 (31 bits, like C's `rand()`).
fn random_seed() -> i64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut x = t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    (x & 0x7fff_ffff) as i64
}

impl CliOpts {
    /// Metadata mode needs only the image and the report options, as in the reference
    /// (no model, no output); other options draw a warning.
    fn resolve_metadata(&self) -> Result<(), String> {
        if self.image_path.is_empty() {
            return Err("metadata mode needs an image path (--image)".into());
        }
        if !matches!(self.metadata_format.as_str(), "text" | "json") {
            return Err(format!("invalid metadata format {}, must be one of [text, json]", self.metadata_format));
        }
        let mut unused: Vec<&str> = Vec::new();
        for g in self.given.iter().map(String::as_str).filter(|g| !METADATA_OPTIONS.contains(g)) {
            if !unused.contains(&g) {
                unused.push(g);
            }
        }
        for name in unused {
            stable_diffusion::sd_warn!("{name} is not used in metadata mode: ignored");
        }
        Ok(())
    }
}

impl Opts {
    /// Fills in defaults that depend on several options and checks the request, like the
    /// reference does before loading anything. `env` reads environment variables.
    pub fn resolve(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
        let mode = self.cli.mode;
        if mode == Mode::Metadata {
            return self.cli.resolve_metadata();
        }
        for name in self.cli.given.iter().filter(|g| g.starts_with("--metadata-") || *g == "--image") {
            stable_diffusion::sd_warn!("{name} is only used in metadata mode: ignored");
        }
        if mode == Mode::Convert && self.cli.output == "output.png" {
            self.cli.output = "output.gguf".into();
        }
        if self.cli.output.is_empty() {
            return Err("the following arguments are required: output_path".into());
        }

        let ctx = &mut self.ctx;
        if ctx.params.n_threads <= 0 {
            ctx.params.n_threads = stable_diffusion::graph::backend::physical_cores();
        }
        ctx.params.embeddings = embeddings_in(&ctx.embd_dir);
        let p = &ctx.params;
        let given = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
        if mode == Mode::Convert {
            if ![&p.model_path, &p.clip_l_path, &p.clip_g_path, &p.t5xxl_path, &p.diffusion_model_path, &p.vae_path].into_iter().any(given) {
                return Err("convert mode needs at least one model input path".into());
            }
        } else if !matches!(mode, Mode::Upscale | Mode::Metadata) && !given(&p.model_path) && !given(&p.diffusion_model_path) {
            let default = default_model_path(env);
            if !default.is_file() {
                return Err(format!(
                    "the following arguments are required: model_path/diffusion_model\n\
                     (no default model at {0}: create it with `python3 tests/fixtures/synth_model.py sd1 {0}` or set ${DEFAULT_MODEL_ENV})",
                    default.display()
                ));
            }
            ctx.params.model_path = Some(default.to_string_lossy().into_owned());
            ctx.default_model = Some(default);
        }
        if mode == Mode::Upscale && ctx.upscale_model.is_empty() {
            return Err("upscale mode needs an upscaler model (--upscale-model)".into());
        }
        ctx.params.vae_format =
            VaeFormat::parse(&ctx.vae_format).ok_or("vae_format must be 'auto', 'flux', 'sd3', 'flux2', or 'wan'")?;

        let gen = &mut self.gen;
        gen.resolve_cache()?;
        if gen.params.seed < 0 {
            gen.params.seed = random_seed();
        }
        gen.resolve_hires(&ctx.hires_upscalers_dir)?;
        if gen.video.high_noise.sample_steps <= 0 {
            gen.video.high_noise.sample_steps = -1;
        }
        gen.prompt_with_lora = gen.params.prompt.clone();
        if !ctx.lora_model_dir.is_empty() {
            gen.extract_loras(&ctx.lora_model_dir);
        }
        gen.validate(mode)?;
        if !matches!(mode, Mode::Convert | Mode::Upscale | Mode::Metadata) {
            for name in gen.unused_options(mode) {
                stable_diffusion::sd_warn!("{name} is not used in {} mode: ignored", mode.name());
            }
        }
        Ok(())
    }

    /// The context parameters to load the models with (deprecated switches folded into the
    /// backend assignments).
    pub fn ctx_params(&self) -> CtxParams {
        let mut p = self.ctx.params.clone();
        let prepend = |spec: &mut Option<String>, a: &str| {
            *spec = Some(match spec.take().filter(|s| !s.is_empty()) {
                Some(s) => format!("{a},{s}"),
                None => a.to_string(),
            })
        };
        if self.ctx.offload_to_cpu {
            prepend(&mut p.params_backend, "*=cpu");
        }
        for (on, a) in [(self.ctx.clip_on_cpu, "te=cpu"), (self.ctx.vae_on_cpu, "vae=cpu"), (self.ctx.control_net_cpu, "controlnet=cpu")] {
            if on {
                prepend(&mut p.backend, a);
            }
        }
        p.tae_preview_only = self.cli.taesd_preview_only;
        p
    }

    /// The LoRAs of the prompt's tags, high-noise ones last.
    fn loras(&self) -> Vec<stable_diffusion::api::Lora> {
        let g = &self.gen;
        g.loras
            .iter()
            .map(|(path, &m)| (path, m, false))
            .chain(g.high_noise_loras.iter().map(|(path, &m)| (path, m, true)))
            .map(|(path, multiplier, is_high_noise)| stable_diffusion::api::Lora { is_high_noise, multiplier, path: path.clone() })
            .collect()
    }

    /// The video request, images, frames and audio excepted (the caller loads and adds them).
    pub fn vid_gen_params(&self) -> VidGenParams {
        let (g, v) = (&self.gen, &self.gen.video);
        let mut sample_params = g.params.sample_params.clone();
        sample_params.guidance.slg.layers = g.skip_layers.clone();
        let mut high_noise_sample_params = v.high_noise.clone();
        high_noise_sample_params.guidance.slg.layers = v.high_noise_skip_layers.clone();
        VidGenParams {
            loras: self.loras(),
            prompt: g.params.prompt.clone(),
            negative_prompt: g.params.negative_prompt.clone(),
            clip_skip: g.params.clip_skip,
            width: g.resolved_width(),
            height: g.resolved_height(),
            sample_params,
            high_noise_sample_params,
            moe_boundary: v.moe_boundary,
            strength: g.params.strength,
            seed: g.params.seed,
            video_frames: v.video_frames,
            fps: v.fps,
            vace_strength: v.vace_strength,
            vae_tiling_params: g.params.vae_tiling_params.clone(),
            cache: g.params.cache.clone(),
            hires: g.params.hires.clone(),
            circular_x: g.circular || g.circular_x,
            circular_y: g.circular || g.circular_y,
            ..VidGenParams::default()
        }
    }

    /// The generation request, images excepted (the caller loads and adds them).
    pub fn img_gen_params(&self) -> ImgGenParams {
        let g = &self.gen;
        let mut p = g.params.clone();
        p.loras = self.loras();
        p.sample_params.guidance.slg.layers = g.skip_layers.clone();
        if !g.auto_resize_ref_image {
            concat_string(&mut p.ref_image_args, "resize_before_vae=0");
            stable_diffusion::sd_warn!("Notice: --disable-auto-resize-ref-image is deprecated. Use --ref-image-args \"resize_before_vae=off\" instead.");
        }
        if g.increase_ref_index {
            concat_string(&mut p.ref_image_args, "ref_index_mode=increase");
            stable_diffusion::sd_warn!("Notice: --increase-ref-index is deprecated. Use --ref-image-args \"ref_index_mode=increase\" instead.");
        }
        p.width = g.resolved_width();
        p.height = g.resolved_height();
        p.circular_x = g.circular || g.circular_x;
        p.circular_y = g.circular || g.circular_y;
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_tags_are_found_like_the_reference_pattern() {
        let (p, t) = split_lora_tags("a <lora:cat:0.5> b <lora:x> c <lora:dog:1:2>");
        assert_eq!(p, "a  b <lora:x> c ");
        assert_eq!(t, vec![("cat".into(), "0.5".into()), ("dog".into(), "1:2".into())]);
        assert_eq!(split_lora_tags("<lora::1>").1, vec![]);
        assert_eq!(split_lora_tags("<lora:a:>").1, vec![]);
        assert_eq!(split_lora_tags("<lora:<lora:b:2>").1, vec![("<lora".into(), "b:2".into())]);
    }

    #[test]
    fn leading_float_is_strtof_like() {
        assert_eq!(leading_float(" 0.5x"), Some(0.5));
        assert_eq!(leading_float("x"), None);
        assert_eq!(leading_float("1:2"), Some(1.0));
    }

    #[test]
    fn lexical_normalization() {
        assert_eq!(lexically_normal("./a/../b//c.safetensors"), "b/c.safetensors");
        assert_eq!(lexically_normal("/x/./y/.."), "/x");
        assert_eq!(lexically_normal("../a"), "../a");
        assert_eq!(lexically_normal("."), ".");
    }

    #[test]
    fn wrapping() {
        assert_eq!(wrap("aa bb cc", 5, 2), "aa bb\n  cc");
        assert_eq!(wrap("abcdefgh", 3, 0), "abc\ndef\ngh");
    }

    #[test]
    fn default_model_location() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(default_model_path(&env(&[("SD_CLI_MODEL", "/m.gguf"), ("HOME", "/h")])), PathBuf::from("/m.gguf"));
        assert_eq!(default_model_path(&env(&[("SD_FIXTURE_CACHE", "/c")])), PathBuf::from("/c/sd1.safetensors"));
        assert_eq!(default_model_path(&env(&[("HOME", "/h")])), PathBuf::from("/h/.cache/sd-rs-fixtures/sd1.safetensors"));
    }
}
