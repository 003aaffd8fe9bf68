//! The backend evaluation callback (`sd_set_backend_eval_callback`, imatrix collection).
//!
//! Like the reference, a graph computed on one device is computed in pieces while a callback
//! is installed (`graph::observe`): the callback is asked about each node (`ask = true`), and
//! each node it wanted is handed over once computed (`ask = false`); returning false then
//! stops the computation. Graphs scheduled over several devices ignore it, with a warning.

use ggml_sys as g;
use parking_lot::RwLock;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// `(tensor, ask) -> wanted / continue`.
pub type EvalFn = Arc<dyn Fn(EvalTensor<'_>, bool) -> bool + Send + Sync>;

#[cfg(not(test))]
static CALLBACK: RwLock<Option<EvalFn>> = RwLock::new(None);

// Unit tests run side by side in one process: each test thread has its own callback.
#[cfg(test)]
thread_local! {
    static CALLBACK: RwLock<Option<EvalFn>> = const { RwLock::new(None) };
}

fn with_slot<R>(f: impl FnOnce(&RwLock<Option<EvalFn>>) -> R) -> R {
    #[cfg(not(test))]
    return f(&CALLBACK);
    #[cfg(test)]
    return CALLBACK.with(f);
}

/// Installs (or with `None` removes) the evaluation callback.
pub fn set(cb: Option<EvalFn>) {
    with_slot(|c| *c.write() = cb);
}

/// True when an evaluation callback is installed.
pub fn is_set() -> bool {
    with_slot(|c| c.read().is_some())
}

/// The installed callback.
pub fn installed() -> Option<EvalFn> {
    with_slot(|c| c.read().clone())
}

/// Calls `cb` on a node of the graph being computed; a panic counts as "not wanted" when
/// asked and as "go on" when shown.
pub(crate) fn call(cb: &EvalFn, t: std::ptr::NonNull<g::ggml_tensor>, ask: bool) -> bool {
    let view = EvalTensor { raw: t, _life: std::marker::PhantomData };
    match catch_unwind(AssertUnwindSafe(|| cb(view, ask))) {
        Ok(v) => v,
        Err(_) => {
            sd_error!("the backend evaluation callback panicked");
            !ask
        }
    }
}

/// A tensor of the graph being computed, valid for one callback invocation.
#[derive(Clone, Copy)]
pub struct EvalTensor<'a> {
    raw: std::ptr::NonNull<g::ggml_tensor>,
    _life: std::marker::PhantomData<&'a g::ggml_tensor>,
}

impl<'a> EvalTensor<'a> {
    /// Wraps a raw tensor pointer.
    ///
    /// # Safety
    /// The tensor (and its sources) must stay valid and unmodified for `'a`.
    pub unsafe fn from_raw(raw: std::ptr::NonNull<g::ggml_tensor>) -> Self {
        EvalTensor { raw, _life: std::marker::PhantomData }
    }

    /// The raw pointer, for foreign callbacks that take ggml tensors.
    pub fn as_ptr(&self) -> *mut g::ggml_tensor {
        self.raw.as_ptr()
    }

    fn t(&self) -> &'a g::ggml_tensor {
        // SAFETY: `from_raw` / the callback contract keep the tensor valid for 'a.
        unsafe { &*self.raw.as_ptr() }
    }

    pub fn op(&self) -> g::ggml_op {
        self.t().op
    }

    pub fn is_mul_mat(&self) -> bool {
        self.op() == g::GGML_OP_MUL_MAT
    }

    pub fn is_mul_mat_id(&self) -> bool {
        self.op() == g::GGML_OP_MUL_MAT_ID
    }

    pub fn ggml_type(&self) -> g::ggml_type {
        self.t().type_
    }

    pub fn name(&self) -> String {
        let name = &self.t().name;
        // SAFETY: ggml keeps `name` NUL-terminated within its fixed array; the slice cast
        // only reinterprets c_char as u8.
        let bytes = unsafe { std::slice::from_raw_parts(name.as_ptr().cast::<u8>(), name.len()) };
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    }

    /// Element counts per dimension (ggml order: innermost first).
    pub fn ne(&self) -> [i64; 4] {
        self.t().ne
    }

    /// Byte strides per dimension.
    pub fn nb(&self) -> [usize; 4] {
        self.t().nb
    }

    /// Source `i` of this node.
    pub fn src(&self, i: usize) -> Option<EvalTensor<'a>> {
        let p = *self.t().src.get(i)?;
        std::ptr::NonNull::new(p).map(|raw| EvalTensor { raw, _life: std::marker::PhantomData })
    }

    pub fn nbytes(&self) -> usize {
        // SAFETY: valid tensor.
        unsafe { g::ggml_nbytes(self.raw.as_ptr()) }
    }

    /// The tensor's bytes, copied from whichever backend holds them.
    pub fn read_bytes(&self) -> Option<Vec<u8>> {
        let t = self.t();
        let n = self.nbytes();
        let mut out = vec![0u8; n];
        if n == 0 {
            return Some(out);
        }
        // SAFETY: a computed tensor either lives in host memory (`data`, `n` bytes) or in a
        // backend buffer that ggml_backend_tensor_get copies from.
        unsafe {
            let host = t.buffer.is_null() || g::ggml_backend_buffer_is_host(t.buffer);
            if host {
                if t.data.is_null() {
                    return None;
                }
                std::ptr::copy_nonoverlapping(t.data.cast::<u8>(), out.as_mut_ptr(), n);
            } else {
                g::ggml_backend_tensor_get(self.raw.as_ptr(), out.as_mut_ptr().cast(), 0, n);
            }
        }
        Some(out)
    }

    /// The values of an f32 tensor (in memory order), or None for other types.
    pub fn read_f32(&self) -> Option<Vec<f32>> {
        if self.ggml_type() != g::GGML_TYPE_F32 {
            return None;
        }
        let bytes = self.read_bytes()?;
        Some(bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// The values of an i32 tensor (in memory order), or None for other types.
    pub fn read_i32(&self) -> Option<Vec<i32>> {
        if self.ggml_type() != g::GGML_TYPE_I32 {
            return None;
        }
        let bytes = self.read_bytes()?;
        Some(bytes.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_to_installed_callback() {
        let mut t: g::ggml_tensor = unsafe { std::mem::zeroed() };
        t.op = g::GGML_OP_MUL_MAT;
        for (d, s) in t.name.iter_mut().zip(b"blk.0\0") {
            *d = *s as libc::c_char;
        }
        let p = std::ptr::NonNull::from(&mut t);
        set(Some(Arc::new(|t: EvalTensor<'_>, ask: bool| ask && t.is_mul_mat() && t.name() == "blk.0")));
        let cb = installed().expect("installed");
        assert!(call(&cb, p, true));
        assert!(!call(&cb, p, false));
        set(None);
        assert!(installed().is_none() && !is_set());
        let panics: EvalFn = Arc::new(|_, _| panic!("boom"));
        assert!(!call(&panics, p, true) && call(&panics, p, false));
    }
}
