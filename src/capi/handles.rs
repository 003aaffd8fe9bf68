//! Opaque handles handed to C.
//!
//! A handle is the address of a small heap tag, used only as a key into a registry of live
//! objects; the library never dereferences a handle it is given. A stale, foreign or garbage
//! pointer is therefore just "not a live handle" (an error), not undefined behaviour, and a
//! context freed while another thread still uses it stays alive until that call returns.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

pub(crate) struct Registry<T> {
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new() -> Self {
        Registry { live: Mutex::new(BTreeMap::new()) }
    }

    /// Registers `value` and returns its new handle (a fresh `tag` allocation).
    pub(crate) fn insert<H>(&self, value: T, tag: H) -> *mut H {
        let handle = Box::into_raw(Box::new(tag));
        self.live.lock().insert(handle as usize, Arc::new(value));
        handle
    }

    /// The object behind a live handle.
    pub(crate) fn get<H>(&self, handle: *const H) -> Option<Arc<T>> {
        if handle.is_null() {
            return None;
        }
        self.live.lock().get(&(handle as usize)).cloned()
    }

    /// Unregisters a live handle and frees its tag; the object is dropped once no call uses it.
    pub(crate) fn remove<H>(&self, handle: *mut H) -> Option<Arc<T>> {
        if handle.is_null() {
            return None;
        }
        let value = self.live.lock().remove(&(handle as usize))?;
        // SAFETY: the address was registered by `insert`, which got it from Box::into_raw,
        // and removing it from the map guarantees it is freed only once.
        drop(unsafe { Box::from_raw(handle) });
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_keys() {
        static R: Registry<String> = Registry::new();
        let h = R.insert("a".to_string(), 0u64);
        assert_eq!(R.get(h).as_deref().map(String::as_str), Some("a"));
        let bogus = 0x1234usize as *mut u64;
        assert!(R.get(bogus).is_none());
        assert!(R.remove(bogus).is_none());
        let v = R.remove(h).unwrap();
        assert_eq!(*v, "a");
        assert!(R.get(h).is_none());
        assert!(R.remove(std::ptr::null_mut::<u64>()).is_none());
    }
}
