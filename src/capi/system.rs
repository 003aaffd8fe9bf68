//! Process-wide functions: callbacks, system facts, freeing results, Canny, imatrix.
//!
//! The callback setters wrap the C function pointer (and its user data) into Rust closures
//! stored in the low-level registries: `crate::log` (log), `pipeline::callbacks` (progress,
//! preview) and `graph::eval_callback` (backend evaluation), where the pipeline and graph
//! layers find them.

use super::convert;
use super::guard::{guard, req_str};
use super::types::*;
use crate::api::{self, CannyParams, Image};
use crate::graph::eval_callback::{self, EvalTensor};
use crate::pipeline::callbacks::{self, PreviewConfig};
use libc::{c_char, c_int, c_void};
use once_cell::sync::OnceCell;
use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;

/// The caller's `void* data`, handed back untouched on every call.
#[derive(Clone, Copy)]
struct UserData(*mut c_void);

// SAFETY: the pointer is opaque to us; the C API contract makes the caller responsible for
// its callbacks being callable from whichever thread reports.
unsafe impl Send for UserData {}
unsafe impl Sync for UserData {}

impl UserData {
    // A method (not field access) so that closures capture the whole Send wrapper.
    fn get(self) -> *mut c_void {
        self.0
    }
}

fn cstring_lossy(text: &str) -> CString {
    CString::new(text.replace('\0', " ")).unwrap_or_default()
}

/// NULL restores the default sink (stderr).
#[no_mangle]
pub extern "C" fn sd_set_log_callback(sd_log_cb: sd_log_cb_t, data: *mut c_void) {
    guard("sd_set_log_callback", (), || {
        let data = UserData(data);
        let sink = sd_log_cb.map(|f| -> crate::log::Sink {
            Arc::new(move |level: crate::types::LogLevel, text: &str| {
                let c = cstring_lossy(text);
                // SAFETY: a C function pointer from the caller, called with its own data
                // and a NUL-terminated string that lives for the call.
                unsafe { f(level.into(), c.as_ptr(), data.get()) }
            })
        });
        crate::log::set_sink(sink);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn sd_set_progress_callback(cb: sd_progress_cb_t, data: *mut c_void) {
    guard("sd_set_progress_callback", (), || {
        let data = UserData(data);
        callbacks::set_progress(cb.map(|f| -> callbacks::ProgressFn {
            // SAFETY: the caller's function with the caller's data.
            Arc::new(move |step, steps, time| unsafe { f(step, steps, time, data.get()) })
        }));
        Ok(())
    })
}

/// An undeclared `mode` is refused (logged) and leaves the previous settings in place.
#[no_mangle]
pub extern "C" fn sd_set_preview_callback(
    cb: sd_preview_cb_t,
    mode: preview_t,
    interval: c_int,
    denoised: CBool,
    noisy: CBool,
    data: *mut c_void,
) {
    guard("sd_set_preview_callback", (), || {
        let mode = mode.require("preview mode")?;
        let data = UserData(data);
        let callback = cb.map(|f| -> callbacks::PreviewFn {
            Arc::new(move |step: i32, frames: &[Image], is_noisy: bool| {
                // The caller gets its own copies: it may write through the pointers.
                let mut buffers: Vec<Vec<u8>> = frames.iter().map(|f| f.data.clone()).collect();
                let mut records: Vec<sd_image_t> = frames
                    .iter()
                    .zip(buffers.iter_mut())
                    .map(|(f, b)| sd_image_t { width: f.width, height: f.height, channel: f.channels, data: b.as_mut_ptr() })
                    .collect();
                let n = c_int::try_from(records.len()).unwrap_or(c_int::MAX);
                // SAFETY: the caller's function; `records` and `buffers` outlive the call.
                unsafe { f(step, n, records.as_mut_ptr(), is_noisy.into(), data.get()) }
            })
        });
        callbacks::set_preview(PreviewConfig { callback, mode, interval, denoised: denoised.get(), noisy: noisy.get() });
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn sd_set_backend_eval_callback(cb: sd_graph_eval_callback_t, data: *mut c_void) {
    guard("sd_set_backend_eval_callback", (), || {
        let data = UserData(data);
        eval_callback::set(cb.map(|f| -> eval_callback::EvalFn {
            Arc::new(move |t: EvalTensor<'_>, ask: bool| {
                // SAFETY: the caller's function gets ggml's tensor for the duration of the
                // scheduler's callback, as in the reference.
                unsafe { f(t.as_ptr().cast::<ggml_tensor>(), ask.into(), data.get()) }.get()
            })
        }));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn sd_get_num_physical_cores() -> i32 {
    guard("sd_get_num_physical_cores", 1, || Ok(crate::graph::backend::physical_cores()))
}

/// A static string built once: the CPU features of the loaded CPU backend.
#[no_mangle]
pub extern "C" fn sd_get_system_info() -> *const c_char {
    static INFO: OnceCell<CString> = OnceCell::new();
    guard("sd_get_system_info", c"".as_ptr(), || {
        Ok(INFO.get_or_init(|| cstring_lossy(&crate::graph::backend::system_info())).as_ptr())
    })
}

#[no_mangle]
pub extern "C" fn sd_version() -> *const c_char {
    static VERSION: OnceCell<CString> = OnceCell::new();
    VERSION.get_or_init(|| cstring_lossy(api::version())).as_ptr()
}

#[no_mangle]
pub extern "C" fn sd_commit() -> *const c_char {
    static COMMIT: OnceCell<CString> = OnceCell::new();
    COMMIT.get_or_init(|| cstring_lossy(api::commit())).as_ptr()
}

/// Writes `name<TAB>description\n` per device into `buffer` (truncated, always
/// NUL-terminated when `buffer_size > 0`) and returns the full length without the NUL.
///
/// # Safety
/// `buffer` is NULL or writable for `buffer_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn sd_list_devices(buffer: *mut c_char, buffer_size: usize) -> usize {
    guard("sd_list_devices", 0, || {
        let listing = crate::graph::backend::device_listing();
        if !buffer.is_null() && buffer_size > 0 {
            let n = listing.len().min(buffer_size - 1);
            // SAFETY: `n + 1 <= buffer_size` bytes are writable per the caller's contract.
            unsafe {
                std::ptr::copy_nonoverlapping(listing.as_ptr(), buffer.cast::<u8>(), n);
                buffer.add(n).write(0);
            }
        }
        Ok(listing.len())
    })
}

/// Frees what generation / upscaling returned: each image's data, then the array.
///
/// # Safety
/// `result_images` is NULL or a `malloc`ed array of at least `num_images` images.
#[no_mangle]
pub unsafe extern "C" fn free_sd_images(result_images: *mut sd_image_t, num_images: c_int) {
    guard("free_sd_images", (), || {
        // SAFETY: forwarded contract.
        unsafe { convert::free_images(result_images, num_images) };
        Ok(())
    })
}

/// # Safety
/// `audio` is NULL or a `malloc`ed `sd_audio_t` whose data is NULL or `malloc`ed.
#[no_mangle]
pub unsafe extern "C" fn free_sd_audio(audio: *mut sd_audio_t) {
    guard("free_sd_audio", (), || {
        if audio.is_null() {
            return Ok(());
        }
        // SAFETY: malloc'ed per the caller's contract.
        unsafe {
            libc::free((*audio).data.cast());
            (*audio).data = std::ptr::null_mut();
            libc::free(audio.cast());
        }
        Ok(())
    })
}

/// Replaces the RGB(A) image's pixels by its Canny edge map.
///
/// # Safety
/// `image.data` is NULL or writable for `width × height × channel` bytes.
#[no_mangle]
pub unsafe extern "C" fn preprocess_canny(
    image: sd_image_t,
    high_threshold: f32,
    low_threshold: f32,
    weak: f32,
    strong: f32,
    inverse: CBool,
) -> CBool {
    guard("preprocess_canny", CBool::FALSE, || {
        ensure!(!image.data.is_null(), "image has no pixel data");
        let n = (image.width as u64)
            .checked_mul(image.height as u64)
            .and_then(|n| n.checked_mul(image.channel as u64))
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or_else(|| crate::error::Error::new("image size too large"))?;
        // SAFETY: `n` writable bytes per the caller's contract; checked not to overflow.
        let pixels = unsafe { std::slice::from_raw_parts_mut(image.data, n as usize) };
        let params = CannyParams { high_threshold, low_threshold, weak, strong, inverse: inverse.get() };
        api::preprocess_canny(pixels, image.width, image.height, image.channel, &params)?;
        Ok(CBool::TRUE)
    })
}

/// # Safety
/// `imatrix_path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn load_imatrix(imatrix_path: *const c_char) -> CBool {
    guard("load_imatrix", CBool::FALSE, || {
        // SAFETY: forwarded contract.
        let path = unsafe { req_str(imatrix_path, "imatrix_path") }?;
        api::load_imatrix(Path::new(&path))?;
        Ok(CBool::TRUE)
    })
}

/// # Safety
/// `imatrix_path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn save_imatrix(imatrix_path: *const c_char) {
    guard("save_imatrix", (), || {
        // SAFETY: forwarded contract.
        let path = unsafe { req_str(imatrix_path, "imatrix_path") }?;
        api::save_imatrix(Path::new(&path))
    })
}

#[no_mangle]
pub extern "C" fn enable_imatrix_collection() {
    guard("enable_imatrix_collection", (), || {
        api::enable_imatrix_collection();
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn disable_imatrix_collection() {
    guard("disable_imatrix_collection", (), || {
        api::disable_imatrix_collection();
        Ok(())
    })
}
