//! The errors the library logs during a call, for tests that check a failure names its
//! reason. The log callback is process-wide: tests using it hold [`SERIAL`], as do tests
//! that set the (equally process-wide) progress and preview callbacks.

use stable_diffusion::capi::{sd_log_level_t, sd_set_log_callback};
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;
use std::sync::Mutex;

/// Held by every test of a file that captures the log or sets another process-wide callback.
pub static SERIAL: Mutex<()> = Mutex::new(());
static ERRORS: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_log(level: sd_log_level_t, text: *const c_char, _: *mut c_void) {
    if level.0 == 3 {
        // SAFETY: the library passes a NUL-terminated string.
        let t = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
        ERRORS.lock().unwrap_or_else(|e| e.into_inner()).push(t);
    }
}

/// Runs `f`; its result and the errors logged meanwhile.
pub fn errors_of<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    ERRORS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    sd_set_log_callback(Some(on_log), null_mut());
    let r = f();
    sd_set_log_callback(None, null_mut());
    (r, std::mem::take(&mut *ERRORS.lock().unwrap_or_else(|e| e.into_inner())))
}
