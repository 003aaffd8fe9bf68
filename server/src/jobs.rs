//! The job queue and the one generation thread.
//!
//! Every generation, from any API, is a job: the synchronous APIs (OpenAI, sdapi) queue one
//! and wait for it, the native API returns its id at once. One thread takes jobs in order and
//! runs them on the loaded model (the library is synchronous and one context generates one
//! thing at a time). The queue is bounded: past `--max-queue-size` jobs queued or running, a
//! new one is refused (429). A running job is cancelled through the context's cancel flag;
//! progress comes from the library's progress callback.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use sd_cli::args::{Mode, Opts};
use sd_cli::metadata::image_parameters;
use stable_diffusion::api::{CancelMode, Context, Image, ImgGenParams, VidGenParams};
use stable_diffusion::pipeline::callbacks;
use stable_diffusion::{sd_error, sd_info};

use crate::options::Limits;
use crate::request::{base64, ApiError, Kind, Prepared};

pub fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Queued,
    Generating,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Generating => "generating",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    pub fn finished(self) -> bool {
        matches!(self, Status::Completed | Status::Failed | Status::Cancelled)
    }
}

/// One encoded picture and what it was made with.
#[derive(Debug, Clone)]
pub struct EncodedImage {
    pub b64: String,
    pub seed: i64,
    /// The parameters text (A1111 style), embedded or not.
    pub infotext: String,
}

#[derive(Debug, Clone)]
pub enum Outcome {
    Images { format: String, images: Vec<EncodedImage> },
    Video { format: String, mime: &'static str, fps: i32, frame_count: usize, b64: String },
}

#[derive(Debug)]
pub struct Job {
    pub id: String,
    pub kind: Kind,
    pub status: Status,
    pub created: i64,
    pub started: Option<i64>,
    pub completed: Option<i64>,
    /// Taken by the generation thread when the job starts.
    pub request: Option<Box<Prepared>>,
    /// What the request resolved to (for sdapi's `info`).
    pub opts: Box<Opts>,
    pub result: Option<Outcome>,
    /// (code, message)
    pub error: Option<(String, String)>,
    /// (step, steps) of the running sampling loop.
    pub progress: (i32, i32),
    pub cancel_requested: bool,
    /// A synchronous API waiting for this job; such jobs are not listed by id.
    waiter: Option<oneshot::Sender<()>>,
    pub listed: bool,
}

impl Job {
    fn fail(&mut self, code: &str, message: String) {
        self.error = Some((code.into(), message));
        self.result = None;
    }
}

#[derive(Default)]
pub struct Queue {
    pub jobs: HashMap<String, Job>,
    order: VecDeque<String>,
    /// Ids of finished jobs dropped after their time to live, until when they answer 410.
    expired: HashMap<String, i64>,
    pub current: Option<String>,
    next_id: u64,
    stop: bool,
}

impl Queue {
    /// 1-based position among the queued jobs.
    pub fn position(&self, id: &str) -> usize {
        self.order.iter().position(|j| j == id).map_or(0, |p| p + 1)
    }

    pub fn pending(&self) -> usize {
        self.jobs.values().filter(|j| !j.status.finished()).count()
    }

    pub fn queued(&self) -> usize {
        self.order.len()
    }

    fn purge(&mut self, ttl: i64) {
        let t = now();
        self.expired.retain(|_, until| *until > t);
        let old: Vec<String> = self.jobs.values().filter(|j| j.listed && j.completed.is_some_and(|c| t - c >= ttl)).map(|j| j.id.clone()).collect();
        for id in old {
            self.jobs.remove(&id);
            self.expired.insert(id, t + ttl.max(60));
        }
    }

    /// The job by id: 404 when unknown, 410 when it finished and was dropped.
    pub fn lookup(&mut self, id: &str, ttl: i64) -> Result<&mut Job, ApiError> {
        self.purge(ttl);
        if self.expired.contains_key(id) {
            return Err(ApiError::new(410, "job expired"));
        }
        self.jobs.get_mut(id).filter(|j| j.listed).ok_or_else(|| ApiError::new(404, "job not found"))
    }
}

/// The loaded model, the defaults and the queue, shared by the handlers and the thread.
pub struct Server {
    pub ctx: Context,
    pub defaults: Opts,
    pub limits: Limits,
    pub queue: Mutex<Queue>,
    wake: Condvar,
}

impl Server {
    pub fn new(ctx: Context, defaults: Opts, limits: Limits) -> Arc<Server> {
        Arc::new(Server { ctx, defaults, limits, queue: Mutex::new(Queue::default()), wake: Condvar::new() })
    }

    /// Queues a job. `wait` gives the receiver a synchronous API awaits.
    pub fn submit(&self, p: Prepared, wait: bool) -> Result<(String, Option<oneshot::Receiver<()>>), ApiError> {
        let mut q = self.queue.lock();
        q.purge(self.limits.job_ttl_seconds);
        let pending = q.pending();
        if pending >= self.limits.max_queue_size {
            return Err(ApiError::new(429, format!("job queue is full: {pending} jobs queued or generating (--max-queue-size {}); try again later", self.limits.max_queue_size)));
        }
        let created = now();
        let id = format!("job_{created:x}_{:08x}", q.next_id);
        q.next_id += 1;
        let (tx, rx) = if wait {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let job = Job {
            id: id.clone(),
            kind: p.kind,
            status: Status::Queued,
            created,
            started: None,
            completed: None,
            opts: Box::new(p.opts.clone()),
            request: Some(Box::new(p)),
            result: None,
            error: None,
            progress: (0, 0),
            cancel_requested: false,
            waiter: tx,
            listed: !wait,
        };
        q.jobs.insert(id.clone(), job);
        q.order.push_back(id.clone());
        drop(q);
        self.wake.notify_one();
        Ok((id, rx))
    }

    /// Cancels a job: a queued one leaves the queue at once, a running one stops at the next
    /// sampling step. Returns false when it had already finished.
    pub fn cancel(&self, q: &mut Queue, id: &str) -> bool {
        let Some(job) = q.jobs.get_mut(id) else { return false };
        match job.status {
            Status::Queued => {
                job.status = Status::Cancelled;
                job.completed = Some(now());
                job.request = None;
                job.fail("cancelled", "job cancelled by client".into());
                if let Some(w) = job.waiter.take() {
                    let _ = w.send(());
                }
                q.order.retain(|j| j != id);
                true
            }
            Status::Generating => {
                job.cancel_requested = true;
                self.ctx.cancel(CancelMode::All);
                true
            }
            _ => false,
        }
    }

    /// Takes a synchronous job's finished state out of the table.
    pub fn take(&self, id: &str) -> Option<Job> {
        self.queue.lock().jobs.remove(id)
    }

    /// Stops the generation thread after the running job (which is cancelled).
    pub fn stop(&self) {
        let mut q = self.queue.lock();
        q.stop = true;
        if q.current.is_some() {
            self.ctx.cancel(CancelMode::All);
        }
        drop(q);
        self.wake.notify_all();
    }
}

/// Installs the progress callback and starts the generation thread.
pub fn start_worker(server: &Arc<Server>) -> std::thread::JoinHandle<()> {
    let s = Arc::clone(server);
    callbacks::set_progress(Some(Arc::new(move |step: i32, steps: i32, _seconds: f32| {
        let mut q = s.queue.lock();
        let Some(id) = q.current.clone() else { return };
        if let Some(job) = q.jobs.get_mut(&id) {
            job.progress = (step, steps);
            // A cancel that arrived between the job's start and the library's flag reset
            // (each generation clears it) is repeated here.
            if job.cancel_requested {
                s.ctx.cancel(CancelMode::All);
            }
        }
    })));
    let s = Arc::clone(server);
    std::thread::Builder::new().name("generation".into()).spawn(move || worker(&s)).expect("start the generation thread")
}

fn worker(s: &Server) {
    loop {
        let (id, request) = {
            let mut q = s.queue.lock();
            loop {
                if q.stop {
                    return;
                }
                if let Some(id) = q.order.pop_front() {
                    let job = q.jobs.get_mut(&id).expect("queued jobs are in the table");
                    job.status = Status::Generating;
                    job.started = Some(now());
                    let request = job.request.take().expect("a queued job has its request");
                    q.current = Some(id.clone());
                    break (id, request);
                }
                s.wake.wait(&mut q);
            }
        };
        sd_info!("{id}: generating ({})", request.kind.name());
        let outcome = catch_unwind(AssertUnwindSafe(|| execute(&s.ctx, &request))).unwrap_or_else(|_| Err("the generation panicked".into()));
        let mut q = s.queue.lock();
        q.current = None;
        let Some(job) = q.jobs.get_mut(&id) else { continue };
        job.completed = Some(now());
        match outcome {
            _ if job.cancel_requested => {
                job.status = Status::Cancelled;
                job.fail("cancelled", "job cancelled by client".into());
                sd_info!("{id}: cancelled");
            }
            Ok(result) => {
                job.status = Status::Completed;
                job.result = Some(result);
                sd_info!("{id}: completed");
            }
            Err(e) => {
                sd_error!("{id}: {e}");
                job.status = Status::Failed;
                job.fail("generation_failed", e);
            }
        }
        // A synchronous client that went away leaves nothing behind.
        if job.waiter.take().is_some_and(|w| w.send(()).is_err()) {
            q.jobs.remove(&id);
        }
        q.purge(s.limits.job_ttl_seconds);
    }
}

/// Encodes one picture in the requested format.
pub fn encode_image(img: &Image, format: &str, compression: i32, parameters: &str) -> Result<Vec<u8>, String> {
    match format {
        "jpeg" => sd_cli::jpeg::encode(img, compression, parameters),
        "webp" => sd_cli::image_io::encode_webp(img, parameters),
        _ => sd_cli::image_io::encode_png(img, parameters),
    }
}

/// Runs one request on the model and encodes what it made.
fn execute(ctx: &Context, p: &Prepared) -> Result<Outcome, String> {
    let o = &p.opts;
    let inputs = p.inputs.clone();
    match p.kind {
        Kind::ImgGen => {
            let (w, h) = (o.gen.resolved_width(), o.gen.resolved_height());
            let mask = inputs.mask.or_else(|| Some(Image { width: w as u32, height: h as u32, channels: 1, data: vec![255; w as usize * h as usize] }));
            let request = ImgGenParams {
                init_image: inputs.init,
                ref_images: inputs.refs,
                mask_image: mask,
                control_image: inputs.control,
                ip_adapter_image: inputs.ip_adapter,
                ..o.img_gen_params()
            };
            let results = ctx.generate_image(&request).map_err(|e| format!("generate_image failed: {e}"))?;
            let results: Vec<&Image> = results.iter().filter(|i| !i.is_empty()).collect();
            if results.is_empty() {
                return Err("generate_image returned no results".into());
            }
            let batch = o.gen.params.batch_count.max(1) as usize;
            let per_batch = (results.len() / batch).max(1);
            let mut images = Vec::new();
            for (i, img) in results.iter().enumerate() {
                let seed = o.gen.params.seed + (i / per_batch) as i64;
                let infotext = image_parameters(o, seed, Mode::ImgGen);
                let embedded = if o.gen.embed_metadata { infotext.as_str() } else { "" };
                let bytes = encode_image(img, &p.output.format, p.output.compression, embedded)?;
                images.push(EncodedImage { b64: base64(&bytes), seed, infotext });
            }
            Ok(Outcome::Images { format: p.output.format.clone(), images })
        }
        Kind::VidGen => {
            let request = VidGenParams {
                init_image: inputs.init,
                end_image: inputs.end,
                ref_images: inputs.refs,
                control_frames: inputs.control_frames,
                ..o.vid_gen_params()
            };
            let out = ctx.generate_video(&request).map_err(|e| format!("generate_video failed: {e}"))?;
            if out.frames.is_empty() {
                return Err("generate_video returned no results".into());
            }
            let fps = o.gen.video.fps;
            let bytes = sd_cli::avi::encode(&out.frames, fps, out.audio.as_ref()).map_err(|e| format!("failed to encode the video: {e}"))?;
            Ok(Outcome::Video { format: p.output.format.clone(), mime: "video/x-msvideo", fps, frame_count: out.frames.len(), b64: base64(&bytes) })
        }
    }
}

/// A job as the native API shows it (the reference's shape, plus `progress` and
/// `cancel_requested`).
pub fn job_json(q: &Queue, job: &Job) -> Value {
    let result = match (&job.status, &job.result) {
        (Status::Completed, Some(Outcome::Images { format, images })) => json!({
            "output_format": format,
            "images": images.iter().enumerate().map(|(i, im)| json!({"index": i, "b64_json": im.b64})).collect::<Vec<_>>(),
        }),
        (Status::Completed, Some(Outcome::Video { format, mime, fps, frame_count, b64 })) => json!({
            "output_format": format, "mime_type": mime, "fps": fps, "frame_count": frame_count, "b64_json": b64,
        }),
        _ => Value::Null,
    };
    let error = job.error.as_ref().map_or(Value::Null, |(code, message)| json!({"code": code, "message": message}));
    json!({
        "id": job.id,
        "kind": job.kind.name(),
        "status": job.status.name(),
        "created": job.created,
        "started": job.started,
        "completed": job.completed,
        "queue_position": if job.status == Status::Queued { q.position(&job.id) } else { 0 },
        "progress": {"step": job.progress.0, "steps": job.progress.1},
        "cancel_requested": job.cancel_requested,
        "result": result,
        "error": error,
    })
}
