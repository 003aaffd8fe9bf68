//! The backend evaluation callback (`sd_set_backend_eval_callback`, imatrix collection).
//!
//! ggml's scheduler asks, node by node, whether the callback wants a tensor (`ask = true`),
//! then hands over the computed tensor (`ask = false`). The graph runner registers
//! [`sched_eval_callback`] with `ggml_backend_sched_set_eval_callback` when [`is_set`] says a
//! callback is installed; it forwards to whatever callback was installed here.

use ggml_sys as g;
use parking_lot::RwLock;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// `(tensor, ask) -> wanted / continue`.
pub type EvalFn = Arc<dyn Fn(EvalTensor<'_>, bool) -> bool + Send + Sync>;

static CALLBACK: RwLock<Option<EvalFn>> = RwLock::new(None);

/// Installs (or with `None` removes) the evaluation callback.
pub fn set(cb: Option<EvalFn>) {
    *CALLBACK.write() = cb;
}

/// True when an evaluation callback is installed.
pub fn is_set() -> bool {
    CALLBACK.read().is_some()
}

/// The function to give ggml's scheduler; forwards to the installed callback.
///
/// # Safety
/// `t` must be null or a tensor that ggml keeps valid for the duration of the call.
pub unsafe extern "C" fn sched_eval_callback(t: *mut g::ggml_tensor, ask: bool, _user_data: *mut libc::c_void) -> bool {
    let Some(tensor) = std::ptr::NonNull::new(t) else { return false };
    let cb = CALLBACK.read().clone();
    let Some(cb) = cb else {
        // Nothing installed: want nothing, and keep computing.
        return !ask;
    };
    let view = EvalTensor { raw: tensor, _life: std::marker::PhantomData };
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
        set(Some(Arc::new(|t: EvalTensor<'_>, ask: bool| ask && t.is_mul_mat() && t.name() == "blk.0")));
        // SAFETY: t lives on the stack for the call.
        assert!(unsafe { sched_eval_callback(&mut t, true, std::ptr::null_mut()) });
        set(None);
        assert!(!unsafe { sched_eval_callback(&mut t, true, std::ptr::null_mut()) });
        assert!(unsafe { sched_eval_callback(&mut t, false, std::ptr::null_mut()) });
    }
}
