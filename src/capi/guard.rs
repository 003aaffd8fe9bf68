//! The boundary guard and the checked readers of C pointers.
//!
//! Every export runs its body through [`guard`]: an error or a panic is logged (naming the
//! function) and turned into the function's documented failure value, so nothing unwinds
//! into C and nothing aborts.

use crate::error::{Error, Result};
use libc::c_char;
use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `body`; on `Err` or panic logs `func: message` and returns `failure`.
pub(crate) fn guard<T>(func: &str, failure: T, body: impl FnOnce() -> Result<T>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            sd_error!("{func}: {e}");
            failure
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            // Logging itself must not unwind out of here either.
            let _ = catch_unwind(AssertUnwindSafe(|| sd_error!("{func}: internal error: {msg}")));
            failure
        }
    }
}

/// A C string as UTF-8; NULL is `None`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid during the call.
pub(crate) unsafe fn opt_str(p: *const c_char, what: &str) -> Result<Option<String>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, NUL-terminated per the caller's contract.
    let bytes = unsafe { CStr::from_ptr(p) }.to_bytes();
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok(Some(s.to_string())),
        Err(e) => Err(Error::new(format!("{what} is not valid UTF-8 (byte {})", e.valid_up_to()))),
    }
}

/// A C string as UTF-8; NULL is the empty string.
///
/// # Safety
/// As for [`opt_str`].
pub(crate) unsafe fn str_or_empty(p: *const c_char, what: &str) -> Result<String> {
    // SAFETY: forwarded contract.
    Ok(unsafe { opt_str(p, what) }?.unwrap_or_default())
}

/// A C string that must be present.
///
/// # Safety
/// As for [`opt_str`].
pub(crate) unsafe fn req_str(p: *const c_char, what: &str) -> Result<String> {
    // SAFETY: forwarded contract.
    unsafe { opt_str(p, what) }?.ok_or_else(|| Error::new(format!("{what} is NULL")))
}

/// A C string for display only: NULL is "", invalid UTF-8 is replaced.
///
/// # Safety
/// As for [`opt_str`].
pub(crate) unsafe fn lossy_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `count` elements at `p`: a negative count, or a NULL pointer with a positive count, is
/// an error; a zero count is an empty slice whatever the pointer.
///
/// # Safety
/// When `count > 0`, `p` points to `count` initialised elements valid during the call.
pub(crate) unsafe fn slice<'a, T>(p: *const T, count: i64, what: &str) -> Result<&'a [T]> {
    if count < 0 {
        bail!("{what}: negative count {count}");
    }
    if count == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        bail!("{what}: NULL pointer with count {count}");
    }
    let n = usize::try_from(count).map_err(|_| Error::new(format!("{what}: count {count} too large")))?;
    let bytes = n.checked_mul(std::mem::size_of::<T>().max(1));
    ensure!(bytes.is_some_and(|b| b <= isize::MAX as usize), "{what}: count {count} too large");
    ensure!(p.align_offset(std::mem::align_of::<T>()) == 0, "{what}: misaligned pointer");
    // SAFETY: non-null, aligned, and `n` elements per the caller's contract; size checked.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Writes `value` through an optional out-pointer.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
pub(crate) unsafe fn write_out<T>(p: *mut T, value: T) {
    if !p.is_null() {
        // SAFETY: non-null and writable per the caller's contract.
        unsafe { p.write(value) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_turns_errors_and_panics_into_failure() {
        assert_eq!(guard("t", -1, || Ok(5)), 5);
        assert_eq!(guard("t", -1, || Err(Error::new("no"))), -1);
        assert_eq!(guard("t", -1, || -> Result<i32> { panic!("boom") }), -1);
    }

    #[test]
    fn strings_and_slices() {
        unsafe {
            assert_eq!(opt_str(std::ptr::null(), "x").unwrap(), None);
            assert_eq!(opt_str(c"abc".as_ptr(), "x").unwrap().as_deref(), Some("abc"));
            let bad = [0xffu8 as c_char, 0];
            assert!(opt_str(bad.as_ptr(), "x").is_err());
            assert_eq!(lossy_str(bad.as_ptr()), "\u{fffd}");
            assert!(req_str(std::ptr::null(), "x").is_err());
            assert_eq!(str_or_empty(std::ptr::null(), "x").unwrap(), "");
            let v = [1i32, 2, 3];
            assert_eq!(slice(v.as_ptr(), 3, "v").unwrap(), &v);
            assert!(slice(v.as_ptr(), -1, "v").is_err());
            assert!(slice(std::ptr::null::<i32>(), 2, "v").is_err());
            assert!(slice(std::ptr::null::<i32>(), 0, "v").unwrap().is_empty());
            assert!(slice(v.as_ptr(), i64::MAX, "v").is_err());
        }
    }
}
