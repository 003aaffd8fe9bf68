//! Process-wide progress and preview callbacks, and the per-context cancel flag.
//!
//! The C API installs these (`sd_set_progress_callback`, `sd_set_preview_callback`,
//! `sd_cancel_generation`); the sampling loop reports through `progress` / `preview` and polls
//! its context's `CancelFlag`. Callbacks never unwind into the caller: a panicking callback is
//! logged and ignored.

use crate::image::Image;
use crate::types::{CancelMode, Preview};
use parking_lot::RwLock;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// `(step, steps, seconds for this step)`.
pub type ProgressFn = Arc<dyn Fn(i32, i32, f32) + Send + Sync>;

/// `(step, frames, is_noisy)`: the frames are only valid during the call.
pub type PreviewFn = Arc<dyn Fn(i32, &[Image], bool) + Send + Sync>;

/// What `sd_set_preview_callback` configured.
#[derive(Clone)]
pub struct PreviewConfig {
    pub callback: Option<PreviewFn>,
    /// How previews are decoded; `Preview::None` disables them.
    pub mode: Preview,
    /// Preview every `interval` steps (values below 1 mean every step).
    pub interval: i32,
    /// Preview the denoised prediction.
    pub denoised: bool,
    /// Preview the noisy latent.
    pub noisy: bool,
}

impl Default for PreviewConfig {
    fn default() -> Self {
        PreviewConfig { callback: None, mode: Preview::None, interval: 1, denoised: false, noisy: false }
    }
}

impl PreviewConfig {
    /// True when a callback is installed and a preview mode chosen.
    pub fn enabled(&self) -> bool {
        self.callback.is_some() && self.mode != Preview::None
    }

    /// Whether step `step` (1-based) should produce a preview.
    pub fn due(&self, step: i32) -> bool {
        self.enabled() && step % self.interval.max(1) == 0
    }
}

static PROGRESS: RwLock<Option<ProgressFn>> = RwLock::new(None);
static PREVIEW: RwLock<Option<PreviewConfig>> = RwLock::new(None);

/// Installs (or with `None` removes) the progress callback.
pub fn set_progress(cb: Option<ProgressFn>) {
    *PROGRESS.write() = cb;
}

/// True when a progress callback is installed.
pub fn has_progress() -> bool {
    PROGRESS.read().is_some()
}

/// Reports progress to the installed callback, if any.
pub fn progress(step: i32, steps: i32, seconds: f32) {
    let cb = PROGRESS.read().clone();
    if let Some(cb) = cb {
        if catch_unwind(AssertUnwindSafe(|| cb(step, steps, seconds))).is_err() {
            sd_error!("the progress callback panicked");
        }
    }
}

/// Replaces the preview configuration.
pub fn set_preview(config: PreviewConfig) {
    *PREVIEW.write() = Some(config);
}

/// The current preview configuration.
pub fn preview_config() -> PreviewConfig {
    PREVIEW.read().clone().unwrap_or_default()
}

/// Hands preview frames to the installed callback, if any.
pub fn preview(step: i32, frames: &[Image], is_noisy: bool) {
    let cb = PREVIEW.read().as_ref().and_then(|c| c.callback.clone());
    if let Some(cb) = cb {
        if catch_unwind(AssertUnwindSafe(|| cb(step, frames, is_noisy))).is_err() {
            sd_error!("the preview callback panicked");
        }
    }
}

/// A context's pending cancellation request, set from any thread.
#[derive(Debug, Default)]
pub struct CancelFlag(AtomicU8);

const NOT_CANCELLED: u8 = 0;
const CANCEL_ALL: u8 = 1;
const CANCEL_NEW_LATENTS: u8 = 2;

impl CancelFlag {
    pub fn new() -> Self {
        CancelFlag(AtomicU8::new(NOT_CANCELLED))
    }

    /// Records a request; `CancelMode::Reset` clears a pending one.
    pub fn request(&self, mode: CancelMode) {
        let v = match mode {
            CancelMode::All => CANCEL_ALL,
            CancelMode::NewLatents => CANCEL_NEW_LATENTS,
            CancelMode::Reset => NOT_CANCELLED,
        };
        self.0.store(v, Ordering::SeqCst);
    }

    /// Clears any request (done when a generation starts).
    pub fn reset(&self) {
        self.0.store(NOT_CANCELLED, Ordering::SeqCst);
    }

    /// The pending request, if any (`All` or `NewLatents`).
    pub fn pending(&self) -> Option<CancelMode> {
        match self.0.load(Ordering::SeqCst) {
            CANCEL_ALL => Some(CancelMode::All),
            CANCEL_NEW_LATENTS => Some(CancelMode::NewLatents),
            _ => None,
        }
    }

    /// Stop the current sampling loop as soon as possible.
    pub fn stop_now(&self) -> bool {
        self.pending() == Some(CancelMode::All)
    }

    /// Do not start another latent of the batch.
    pub fn skip_new_latents(&self) -> bool {
        self.pending().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancel_flag_modes() {
        let f = CancelFlag::new();
        assert_eq!(f.pending(), None);
        f.request(CancelMode::NewLatents);
        assert!(f.skip_new_latents() && !f.stop_now());
        f.request(CancelMode::All);
        assert!(f.stop_now() && f.skip_new_latents());
        f.request(CancelMode::Reset);
        assert_eq!(f.pending(), None);
    }

    #[test]
    fn preview_interval() {
        let mut c = PreviewConfig::default();
        assert!(!c.due(1));
        c.callback = Some(Arc::new(|_, _, _| {}));
        c.mode = Preview::Proj;
        c.interval = 3;
        assert!(!c.due(2) && c.due(3));
        c.interval = 0;
        assert!(c.due(1));
    }
}
