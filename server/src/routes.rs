//! The HTTP endpoints: the OpenAI-style `/v1/*`, the WebUI-compatible `/sdapi/v1/*` and the
//! native `/sdcpp/v1/*` APIs, and the page at `/`. Every error is a JSON object with an
//! `error` message (and `message` with detail where there is one).

use std::path::Path as FsPath;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use axum::extract::multipart::MultipartRejection;
use axum::extract::{DefaultBodyLimit, Multipart, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use sd_cli::args::Opts;
use sd_cli::metadata::basename;
use stable_diffusion::api::{HiresUpscaler, SampleMethod, SampleParams};
use futures_util::FutureExt;
use stable_diffusion::{sd_error, sd_warn};
use std::panic::AssertUnwindSafe;

use crate::jobs::{job_json, now, Job, Outcome, Server, Status};
use crate::request::{
    self, apply_extra_args, apply_native, finish, list_loras, parse_object, ApiError, Draft, Env, Fields, Kind, Prepared, IMAGE_FORMATS,
    VIDEO_FORMATS,
};

pub struct App {
    pub server: Arc<Server>,
    /// `--serve-html-path`, read at each request (edit the page without a restart).
    pub html_path: String,
}

type AppState = State<Arc<App>>;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.json())).into_response()
    }
}

/// The body, or 413 / 400 as JSON when it is too large or unreadable. Past the limit the
/// body is still read (up to four times the limit, not kept) so that the client, still
/// sending, gets the answer rather than a reset connection.
async fn body(app: &App, body: Body) -> Result<Bytes, ApiError> {
    let limit = app.server.limits.max_body_bytes;
    let mut body = body;
    let (mut buf, mut total) = (Vec::new(), 0usize);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::bad(format!("could not read the request body: {e}")))?;
        let Ok(data) = frame.into_data() else { continue };
        total += data.len();
        if total <= limit {
            buf.extend_from_slice(&data);
        } else if total > limit.saturating_mul(4) {
            break;
        }
    }
    if total > limit {
        return Err(too_large(app));
    }
    Ok(buf.into())
}

fn too_large(app: &App) -> ApiError {
    ApiError::new(413, format!("request body is larger than {} MiB (--max-request-mb)", app.server.limits.max_body_bytes >> 20))
}

fn env<'a>(app: &'a App) -> Env<'a> {
    let s = &app.server;
    Env { ctx: &s.ctx, limits: &s.limits, lora_dir: &s.defaults.ctx.lora_model_dir }
}

/// The model file shown to clients: the full model, else the diffusion model.
fn model_path(o: &Opts) -> String {
    let p = &o.ctx.params;
    [&p.model_path, &p.diffusion_model_path].into_iter().flatten().find(|s| !s.is_empty()).cloned().unwrap_or_default()
}

fn stem(path: &str) -> String {
    FsPath::new(path).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

pub fn router(app: Arc<App>) -> Router {
    let limit = app.server.limits.max_body_bytes;
    Router::new()
        .route("/", get(index))
        .route("/v1/models", get(openai_models))
        .route("/v1/images/generations", post(openai_generations))
        .route("/v1/images/edits", post(openai_edits))
        .route("/sdapi/v1/txt2img", post(sdapi_txt2img))
        .route("/sdapi/v1/img2img", post(sdapi_img2img))
        .route("/sdapi/v1/loras", get(sdapi_loras))
        .route("/sdapi/v1/upscalers", get(sdapi_upscalers))
        .route("/sdapi/v1/latent-upscale-modes", get(sdapi_latent_modes))
        .route("/sdapi/v1/samplers", get(sdapi_samplers))
        .route("/sdapi/v1/schedulers", get(sdapi_schedulers))
        .route("/sdapi/v1/sd-models", get(sdapi_models))
        .route("/sdapi/v1/options", get(sdapi_options))
        .route("/sdapi/v1/progress", get(sdapi_progress))
        .route("/sdapi/v1/interrupt", post(sdapi_interrupt))
        .route("/sdcpp/v1/capabilities", get(capabilities))
        .route("/sdcpp/v1/img_gen", post(native_img_gen))
        .route("/sdcpp/v1/vid_gen", post(native_vid_gen))
        .route("/sdcpp/v1/jobs/{id}", get(job_status))
        .route("/sdcpp/v1/jobs/{id}/cancel", post(job_cancel))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(cors))
        .with_state(app)
}

/// Lets pages served elsewhere call the API, as the reference does: the caller's origin is
/// allowed, and a preflight `OPTIONS` is answered with 204. A handler that panics answers 500
/// (the server goes on).
async fn cors(req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).cloned().unwrap_or(HeaderValue::from_static("*"));
    let mut res = if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else {
        let path = req.uri().path().to_string();
        match AssertUnwindSafe(next.run(req)).catch_unwind().await {
            Ok(res) => res,
            Err(_) => {
                sd_error!("the handler of {path} panicked");
                ApiError::new(500, format!("internal error while handling {path}")).into_response()
            }
        }
    };
    let h = res.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("*"));
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, HeaderValue::from_static("*"));
    res
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(404, format!("no such endpoint: {} {}", req.method(), req.uri().path()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(405, format!("method {} is not allowed on {}", req.method(), req.uri().path()))
}

async fn index(State(app): AppState) -> Response {
    if app.html_path.is_empty() {
        return Html(crate::page::INDEX_HTML).into_response();
    }
    match std::fs::read_to_string(&app.html_path) {
        Ok(s) => Html(s).into_response(),
        Err(e) => ApiError::new(500, format!("unable to read the HTML file '{}': {e}", app.html_path)).into_response(),
    }
}

// ---- running a job for a synchronous API ----

/// Cancels a synchronous job whose client went away before it finished.
struct CancelOnDrop {
    server: Arc<Server>,
    id: String,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut q = self.server.queue.lock();
        let queued = q.jobs.get(&self.id).is_some_and(|j| j.status == Status::Queued);
        self.server.cancel(&mut q, &self.id);
        if queued {
            q.jobs.remove(&self.id);
        }
    }
}

/// Queues the request and waits for it; a failed generation is a 500, a cancelled one 409.
async fn run_sync(app: &App, p: Prepared) -> Result<Job, ApiError> {
    let (id, rx) = app.server.submit(p, true)?;
    let mut guard = CancelOnDrop { server: Arc::clone(&app.server), id: id.clone(), armed: true };
    if let Some(rx) = rx {
        let _ = rx.await;
    }
    guard.armed = false;
    let job = app.server.take(&id).ok_or_else(|| ApiError::new(500, "the job disappeared"))?;
    match job.status {
        Status::Completed => Ok(job),
        Status::Cancelled => Err(ApiError::new(409, "generation cancelled")),
        _ => Err(ApiError::new(500, job.error.map_or_else(|| "generation failed".to_string(), |(_, m)| m))),
    }
}

fn images_of(job: &Job) -> &[crate::jobs::EncodedImage] {
    match &job.result {
        Some(Outcome::Images { images, .. }) => images,
        _ => &[],
    }
}

// ---- OpenAI ----

async fn openai_models() -> Json<Value> {
    Json(json!({"data": [{"id": "sd-cpp-local", "object": "model", "owned_by": "local"}]}))
}

/// `WIDTHxHEIGHT`; "auto" leaves the default size.
fn parse_size(size: &str) -> Result<Option<(i32, i32)>, ApiError> {
    if size.is_empty() || size == "auto" {
        return Ok(None);
    }
    let parsed = size.split_once('x').and_then(|(w, h)| Some((w.trim().parse::<i32>().ok()?, h.trim().parse::<i32>().ok()?)));
    parsed.map(Some).ok_or_else(|| ApiError::bad(format!("invalid size '{size}', must be WIDTHxHEIGHT (e.g. 512x512)")))
}

fn openai_common(d: &mut Draft, prompt: String, n: Option<i64>, size: &str) -> Result<(), ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt required"));
    }
    d.opts.gen.params.prompt = prompt;
    if let Some(n) = n {
        d.opts.gen.params.batch_count = i32::try_from(n).map_err(|_| ApiError::bad(format!("n is out of range: {n}")))?;
    }
    if let Some((w, h)) = parse_size(size)? {
        d.opts.gen.width = w;
        d.opts.gen.height = h;
    }
    Ok(())
}

fn openai_response(job: &Job) -> Value {
    let format = match &job.result {
        Some(Outcome::Images { format, .. }) => format.as_str(),
        _ => "png",
    };
    json!({
        "created": now(),
        "output_format": format,
        "data": images_of(job).iter().map(|im| json!({"b64_json": im.b64})).collect::<Vec<_>>(),
    })
}

async fn openai_generations(State(app): AppState, b: Body) -> Result<Json<Value>, ApiError> {
    let obj = parse_object(&body(&app, b).await?)?;
    let mut f = Fields::new(&obj, "");
    let mut d = Draft::new(&app.server.defaults, Kind::ImgGen);
    let prompt = f.str("prompt")?.unwrap_or_default();
    let n = f.i64("n")?;
    let size = f.str("size")?.unwrap_or_default();
    openai_common(&mut d, prompt, n, &size)?;
    if let Some(rf) = f.str("response_format")? {
        if rf != "b64_json" {
            return Err(ApiError::bad(format!("response_format '{rf}' is not supported: this server answers b64_json only")));
        }
    }
    d.set_output(&f.str("output_format")?.unwrap_or_else(|| "png".into()), f.i64("output_compression")?)?;
    f.warn_unused("/v1/images/generations");
    apply_extra_args(&mut d)?;
    let p = finish(d, &env(&app))?;
    Ok(Json(openai_response(&run_sync(&app, p).await?)))
}

async fn openai_edits(State(app): AppState, mp: Result<Multipart, MultipartRejection>) -> Result<Json<Value>, ApiError> {
    let mut mp = mp.map_err(|_| ApiError::bad("Content-Type must be multipart/form-data"))?;
    let mut text: Map<String, Value> = Map::new();
    let (mut images, mut legacy, mut mask) = (Vec::new(), None, None);
    loop {
        let field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_large(&app)),
            Err(e) => return Err(ApiError::bad(format!("invalid multipart body: {}", e.body_text()))),
        };
        let name = field.name().unwrap_or_default().to_string();
        let bytes = match field.bytes().await {
            Ok(b) => b.to_vec(),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_large(&app)),
            Err(e) => return Err(ApiError::bad(format!("invalid multipart body: {}", e.body_text()))),
        };
        match name.as_str() {
            "image[]" => images.push(bytes),
            "image" => legacy = Some(bytes),
            "mask" => mask = Some(bytes),
            _ => {
                text.insert(name, Value::String(String::from_utf8_lossy(&bytes).into_owned()));
            }
        }
    }
    if images.is_empty() {
        images.extend(legacy);
    }
    if images.is_empty() {
        return Err(ApiError::bad("at least one image[] required"));
    }
    let mut f = Fields::new(&text, "");
    let mut d = Draft::new(&app.server.defaults, Kind::ImgGen);
    let number = |f: &mut Fields, key: &'static str| -> Result<Option<i64>, ApiError> {
        f.str(key)?.map(|s| s.trim().parse::<i64>().map_err(|_| ApiError::bad(format!("field '{key}' must be an integer, got '{s}'")))).transpose()
    };
    let n = number(&mut f, "n")?;
    let prompt = f.str("prompt")?.unwrap_or_default();
    let size = f.str("size")?.unwrap_or_default();
    openai_common(&mut d, prompt, n, &size)?;
    let compression = number(&mut f, "output_compression")?;
    d.set_output(&f.str("output_format")?.unwrap_or_else(|| "png".into()), compression)?;
    f.warn_unused("/v1/images/edits");
    // As the reference: the pictures are the reference images, the first also the init image.
    d.images.init = images.first().cloned();
    d.images.refs = images;
    d.images.mask = mask;
    apply_extra_args(&mut d)?;
    let p = finish(d, &env(&app))?;
    Ok(Json(openai_response(&run_sync(&app, p).await?)))
}

// ---- sdapi (WebUI) ----

fn sdapi_request(app: &App, obj: &Map<String, Value>, img2img: bool) -> Result<Prepared, ApiError> {
    let mut f = Fields::new(obj, "");
    let mut d = Draft::new(&app.server.defaults, Kind::ImgGen);
    let prompt = f.str("prompt")?.unwrap_or_default();
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt required"));
    }
    let g = &mut d.opts.gen;
    g.params.prompt = prompt;
    read!(f, str "negative_prompt" => g.params.negative_prompt);
    read!(f, i32 "width" => g.width);
    read!(f, i32 "height" => g.height);
    read!(f, i32 "steps" => g.params.sample_params.sample_steps);
    read!(f, f32 "cfg_scale" => g.params.sample_params.guidance.txt_cfg);
    // The WebUI's default seed is -1: a new one each request.
    g.params.seed = f.i64("seed")?.unwrap_or(-1);
    read!(f, i32 "batch_size" => g.params.batch_count);
    if let Some(n) = f.i32("clip_skip")?.filter(|&n| n > 0) {
        g.params.clip_skip = n;
    }
    if let Some(name) = f.str("sampler_name")? {
        g.params.sample_params.sample_method = request::sample_method(&name, true)?;
    }
    if let Some(name) = f.str("scheduler")? {
        g.params.sample_params.scheduler = request::scheduler(&name)?;
    }
    if !img2img && f.bool("enable_hr")?.unwrap_or(false) {
        let h = &mut g.params.hires;
        h.enabled = true;
        read!(f, f32 "hr_scale" => h.scale);
        read!(f, i32 "hr_resize_x" => h.target_width);
        read!(f, i32 "hr_resize_y" => h.target_height);
        read!(f, i32 "hr_steps" => h.steps);
        read!(f, f32 "denoising_strength" => h.denoising_strength);
        read!(f, str "hr_upscaler" => g.hires_upscaler);
    }
    if img2img {
        let init = f.images("init_images")?.unwrap_or_default();
        if init.len() > 1 {
            sd_warn!("img2img: only the first of {} init_images is used", init.len());
        }
        d.images.init = Some(init.into_iter().next().ok_or_else(|| ApiError::bad("img2img needs init_images (one base64 picture)"))?);
        d.images.mask = f.image("mask")?;
        d.images.invert_mask = f.flag("inpainting_mask_invert")?.unwrap_or(false);
        read!(f, f32 "denoising_strength" => d.opts.gen.params.strength);
    }
    read!(f, images "extra_images" => d.images.refs);
    // The structured LoRA list, as in the native API.
    request::lora_field(&mut f, &mut d.loras)?;
    f.warn_unused(if img2img { "/sdapi/v1/img2img" } else { "/sdapi/v1/txt2img" });
    apply_extra_args(&mut d)?;
    finish(d, &env(app))
}

/// sdapi's `info`: a JSON object in a string (the WebUI's format).
fn sdapi_info(app: &App, job: &Job, img2img: bool) -> String {
    let o = &job.opts;
    let (p, sp) = (&o.gen.params, &o.gen.params.sample_params);
    let mut info = json!({
        "prompt": p.prompt,
        "seed": p.seed,
        "cfg_scale": sp.guidance.txt_cfg,
        "width": o.gen.resolved_width(),
        "height": o.gen.resolved_height(),
        "steps": sp.sample_steps,
        "sampler_name": sp.sample_method.map_or("default", SampleMethod::name),
        "version": "stable-diffusion.cpp",
    });
    if !p.negative_prompt.is_empty() {
        info["negative_prompt"] = p.negative_prompt.clone().into();
    }
    if p.clip_skip != -1 {
        info["clip_skip"] = p.clip_skip.into();
    }
    if let Some(s) = sp.scheduler {
        info["extra_generation_params"] = json!({"Schedule type": s.name()});
    }
    if img2img {
        info["denoising_strength"] = p.strength.into();
    }
    let c = &app.server.defaults.ctx.params;
    let model = model_path(&app.server.defaults);
    if !model.is_empty() {
        info["sd_model_name"] = basename(c.diffusion_model_path.as_deref().filter(|s| !s.is_empty()).unwrap_or(&model)).into();
    }
    if let Some(vae) = c.vae_path.as_deref().filter(|s| !s.is_empty()) {
        info["sd_vae_name"] = basename(vae).into();
    }
    let images = images_of(job);
    info["infotexts"] = images.iter().map(|im| Value::from(im.infotext.clone())).collect();
    info["all_prompts"] = images.iter().map(|_| Value::from(p.prompt.clone())).collect();
    info["all_negative_prompts"] = images.iter().map(|_| Value::from(p.negative_prompt.clone())).collect();
    info["all_seeds"] = images.iter().map(|im| Value::from(im.seed)).collect();
    info.to_string()
}

async fn sdapi_generate(app: Arc<App>, b: Body, img2img: bool) -> Result<Json<Value>, ApiError> {
    let obj = parse_object(&body(&app, b).await?)?;
    let p = sdapi_request(&app, &obj, img2img)?;
    let job = run_sync(&app, p).await?;
    let images: Vec<&str> = images_of(&job).iter().map(|im| im.b64.as_str()).collect();
    Ok(Json(json!({"images": images, "parameters": obj, "info": sdapi_info(&app, &job, img2img)})))
}

async fn sdapi_txt2img(State(app): AppState, b: Body) -> Result<Json<Value>, ApiError> {
    sdapi_generate(app, b, false).await
}

async fn sdapi_img2img(State(app): AppState, b: Body) -> Result<Json<Value>, ApiError> {
    sdapi_generate(app, b, true).await
}

async fn sdapi_loras(State(app): AppState) -> Json<Value> {
    let files = list_loras(&app.server.defaults.ctx.lora_model_dir);
    Json(files.iter().map(|l| json!({"name": l.name, "path": l.path})).collect())
}

/// The ESRGAN models directly in `--hires-upscalers-dir`: (stem, absolute path).
fn upscaler_models(app: &App) -> Vec<(String, String)> {
    let dir = &app.server.defaults.ctx.hires_upscalers_dir;
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(if dir.is_empty() { "/nonexistent" } else { dir }) {
        for e in entries.flatten() {
            let p = e.path();
            let ext = p.extension().map(|x| x.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
            if p.is_file() && ["gguf", "safetensors", "pt", "pth"].contains(&ext.as_str()) {
                let full = std::path::absolute(&p).unwrap_or(p.clone());
                out.push((stem(&p.to_string_lossy()), full.to_string_lossy().into_owned()));
            }
        }
    }
    out.sort();
    out
}

async fn sdapi_upscalers(State(app): AppState) -> Json<Value> {
    let builtin = ["None", "Lanczos", "Nearest"].map(|n| json!({"name": n, "model_name": null, "model_path": null, "model_url": null, "scale": 4}));
    let models = upscaler_models(&app).into_iter().map(|(n, p)| json!({"name": n, "model_name": "ESRGAN_4x", "model_path": p, "model_url": null, "scale": 4}));
    Json(builtin.into_iter().chain(models).collect())
}

fn latent_modes() -> impl Iterator<Item = &'static str> {
    HiresUpscaler::ALL.iter().map(|u| u.name()).filter(|n| n.starts_with("Latent"))
}

async fn sdapi_latent_modes() -> Json<Value> {
    Json(latent_modes().map(|n| json!({"name": n})).collect())
}

async fn sdapi_samplers() -> Json<Value> {
    let names = std::iter::once("default").chain(SampleMethod::ALL.iter().map(|m| m.name()));
    Json(names.map(|n| json!({"name": n, "aliases": [n], "options": {}})).collect())
}

async fn sdapi_schedulers() -> Json<Value> {
    let names = std::iter::once("default").chain(request::scheduler_names());
    Json(names.map(|n| json!({"name": n, "label": n})).collect())
}

async fn sdapi_models(State(app): AppState) -> Json<Value> {
    let path = model_path(&app.server.defaults);
    // No hash is computed (a multi-GB read); the fields are there for clients that expect them.
    Json(json!([{
        "title": stem(&path), "model_name": stem(&path), "filename": basename(&path),
        "hash": "0000000000", "sha256": "0".repeat(64), "config": null,
    }]))
}

async fn sdapi_options(State(app): AppState) -> Json<Value> {
    Json(json!({"samples_format": "png", "sd_model_checkpoint": stem(&model_path(&app.server.defaults))}))
}

/// The WebUI's progress report, for the job running now (not in the reference's server).
async fn sdapi_progress(State(app): AppState) -> Json<Value> {
    let q = app.server.queue.lock();
    let running = q.current.as_ref().and_then(|id| q.jobs.get(id));
    let (step, steps) = running.map_or((0, 0), |j| j.progress);
    let progress = if steps > 0 { f64::from(step) / f64::from(steps) } else { 0.0 };
    let elapsed = running.and_then(|j| j.started).map_or(0, |s| now() - s) as f64;
    let eta = if progress > 0.0 { elapsed / progress - elapsed } else { 0.0 };
    Json(json!({
        "progress": progress,
        "eta_relative": eta,
        "state": {
            "skipped": false,
            "interrupted": running.is_some_and(|j| j.cancel_requested),
            "job": running.map_or("", |j| j.id.as_str()),
            "job_count": q.pending(),
            "job_timestamp": running.and_then(|j| j.started).unwrap_or(0).to_string(),
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": steps,
        },
        "current_image": null,
        "textinfo": null,
    }))
}

/// Stops the job running now, whichever API queued it (the WebUI's interrupt).
async fn sdapi_interrupt(State(app): AppState) -> Json<Value> {
    let mut q = app.server.queue.lock();
    if let Some(id) = q.current.clone() {
        app.server.cancel(&mut q, &id);
    }
    Json(json!({}))
}

// ---- sdcpp (native) ----

fn finite(x: f32) -> Value {
    if x.is_finite() {
        x.into()
    } else {
        Value::Null
    }
}

fn sample_params_json(sp: &SampleParams, layers: &[i32]) -> Value {
    let g = &sp.guidance;
    json!({
        "scheduler": sp.scheduler.map_or("default", |s| s.name()),
        "sample_method": sp.sample_method.map_or("default", |m| m.name()),
        "sample_steps": sp.sample_steps,
        "eta": finite(sp.eta),
        "shifted_timestep": sp.shifted_timestep,
        "flow_shift": finite(sp.flow_shift),
        "guidance": {
            "txt_cfg": g.txt_cfg,
            "img_cfg": finite(g.img_cfg),
            "distilled_guidance": g.distilled_guidance,
            "slg": {"layers": layers, "layer_start": g.slg.layer_start, "layer_end": g.slg.layer_end, "scale": g.slg.scale},
        },
    })
}

fn defaults_json(o: &Opts, kind: Kind) -> Value {
    let (g, p) = (&o.gen, &o.gen.params);
    let t = &p.vae_tiling_params;
    let h = &p.hires;
    let mut v = json!({
        "prompt": p.prompt,
        "negative_prompt": p.negative_prompt,
        "clip_skip": p.clip_skip,
        "width": g.resolved_width(),
        "height": g.resolved_height(),
        "strength": p.strength,
        "seed": p.seed,
        "sample_params": sample_params_json(&p.sample_params, &g.skip_layers),
        "hires": {
            "enabled": h.enabled, "upscaler": g.hires_upscaler, "scale": h.scale, "target_width": h.target_width,
            "target_height": h.target_height, "steps": h.steps, "denoising_strength": h.denoising_strength,
            "custom_sigmas": h.custom_sigmas, "upscale_tile_size": h.upscale_tile_size,
        },
        "vae_tiling_params": {
            "enabled": t.enabled, "temporal_tiling": t.temporal_tiling, "tile_size_x": t.tile_size_x, "tile_size_y": t.tile_size_y,
            "target_overlap": t.target_overlap, "rel_size_x": t.rel_size_x, "rel_size_y": t.rel_size_y,
            "extra_tiling_args": t.extra_tiling_args.clone().unwrap_or_default(),
        },
        "cache_mode": if g.cache_mode.is_empty() { "disabled" } else { g.cache_mode.as_str() },
        "cache_option": g.cache_option,
        "scm_mask": p.cache.scm_mask.clone().unwrap_or_default(),
        "scm_policy_dynamic": g.scm_policy_dynamic,
        "output_compression": 100,
    });
    match kind {
        Kind::ImgGen => {
            for (k, x) in [
                ("batch_count", json!(p.batch_count)),
                ("qwen_image_layers", json!(p.qwen_image_layers)),
                ("auto_resize_ref_image", json!(g.auto_resize_ref_image)),
                ("increase_ref_index", json!(g.increase_ref_index)),
                ("control_strength", json!(p.control_strength)),
                ("ip_adapter_strength", json!(p.ip_adapter_strength)),
                ("output_format", json!(IMAGE_FORMATS[0])),
            ] {
                v[k] = x;
            }
        }
        Kind::VidGen => {
            let vd = &g.video;
            for (k, x) in [
                ("video_frames", json!(vd.video_frames)),
                ("fps", json!(vd.fps)),
                ("moe_boundary", json!(vd.moe_boundary)),
                ("vace_strength", json!(vd.vace_strength)),
                ("high_noise_sample_params", sample_params_json(&vd.high_noise, &vd.high_noise_skip_layers)),
                ("output_format", json!(VIDEO_FORMATS[0])),
            ] {
                v[k] = x;
            }
        }
    }
    v
}

fn features_json(kind: Kind) -> Value {
    match kind {
        Kind::ImgGen => json!({
            "init_image": true, "mask_image": true, "control_image": true, "ip_adapter_image": true, "ref_images": true,
            "lora": true, "vae_tiling": true, "hires": true, "cache": true, "cancel_queued": true, "cancel_generating": true,
        }),
        Kind::VidGen => json!({
            "init_image": true, "end_image": true, "control_frames": true, "high_noise_sample_params": true, "lora": true,
            "vae_tiling": true, "cache": true, "cancel_queued": true, "cancel_generating": true,
        }),
    }
}

async fn capabilities(State(app): AppState) -> Json<Value> {
    let s = &app.server;
    let o = &s.defaults;
    let path = model_path(o);
    let kinds: Vec<Kind> =
        [(Kind::ImgGen, s.ctx.supports_image_generation()), (Kind::VidGen, s.ctx.supports_video_generation())].into_iter().filter(|(_, on)| *on).map(|(k, _)| k).collect();
    let formats = |k: Kind| if k == Kind::ImgGen { json!(IMAGE_FORMATS) } else { json!(VIDEO_FORMATS) };
    let by_mode = |f: &dyn Fn(Kind) -> Value| Value::Object(kinds.iter().map(|&k| (k.name().to_string(), f(k))).collect());
    let current = kinds.first().copied();
    let upscalers: Vec<Value> = ["None", "Lanczos", "Nearest"]
        .into_iter()
        .map(str::to_string)
        .chain(latent_modes().map(str::to_string))
        .chain(upscaler_models(&app).into_iter().map(|(n, _)| n))
        .map(|n| json!({"name": n}))
        .collect();
    let l = &s.limits;
    Json(json!({
        "model": {"name": basename(&path), "stem": stem(&path), "path": path},
        "current_mode": current.map_or("", Kind::name),
        "supported_modes": kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        "defaults": current.map_or(json!({}), |k| defaults_json(o, k)),
        "defaults_by_mode": by_mode(&|k| defaults_json(o, k)),
        "output_formats": current.map_or(json!([]), formats),
        "output_formats_by_mode": by_mode(&formats),
        "features": current.map_or(json!({"cancel_queued": true, "cancel_generating": true}), features_json),
        "features_by_mode": by_mode(&features_json),
        "samplers": SampleMethod::ALL.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "schedulers": request::scheduler_names(),
        "loras": list_loras(&o.ctx.lora_model_dir).iter().map(|l| json!({"name": l.name, "path": l.path})).collect::<Vec<_>>(),
        "upscalers": upscalers,
        "limits": {
            "min_width": l.min_side, "max_width": l.max_width, "min_height": l.min_side, "max_height": l.max_height,
            "max_batch_count": l.max_batch_count, "max_queue_size": l.max_queue_size,
            "max_steps": l.max_steps, "max_video_frames": l.max_video_frames, "max_request_bytes": l.max_body_bytes,
        },
    }))
}

async fn native_submit(app: Arc<App>, b: Body, kind: Kind) -> Result<Response, ApiError> {
    let obj = parse_object(&body(&app, b).await?)?;
    let mut f = Fields::new(&obj, "");
    let mut d = Draft::new(&app.server.defaults, kind);
    apply_native(&mut d, &mut f)?;
    let format = f.str("output_format")?;
    let compression = f.i64("output_compression")?;
    let default_format = d.output.format.clone();
    d.set_output(format.as_deref().unwrap_or(&default_format), compression)?;
    f.warn_unused(if kind == Kind::ImgGen { "/sdcpp/v1/img_gen" } else { "/sdcpp/v1/vid_gen" });
    let p = finish(d, &env(&app))?;
    let (id, _) = app.server.submit(p, false)?;
    let created = app.server.queue.lock().jobs.get(&id).map_or_else(now, |j| j.created);
    let out = json!({"id": id, "kind": kind.name(), "status": "queued", "created": created, "poll_url": format!("/sdcpp/v1/jobs/{id}")});
    Ok((StatusCode::ACCEPTED, Json(out)).into_response())
}

async fn native_img_gen(State(app): AppState, b: Body) -> Result<Response, ApiError> {
    native_submit(app, b, Kind::ImgGen).await
}

async fn native_vid_gen(State(app): AppState, b: Body) -> Result<Response, ApiError> {
    native_submit(app, b, Kind::VidGen).await
}

async fn job_status(State(app): AppState, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let mut q = app.server.queue.lock();
    q.lookup(&id, app.server.limits.job_ttl_seconds)?;
    let job = &q.jobs[&id];
    Ok(Json(job_json(&q, job)))
}

/// Cancels a queued or running job (the reference cancels queued jobs only: 409 for a
/// running one). A finished job is returned as it is.
async fn job_cancel(State(app): AppState, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let mut q = app.server.queue.lock();
    q.lookup(&id, app.server.limits.job_ttl_seconds)?;
    app.server.cancel(&mut q, &id);
    let job = &q.jobs[&id];
    Ok(Json(job_json(&q, job)))
}
