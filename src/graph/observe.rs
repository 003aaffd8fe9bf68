//! Computing a graph piece by piece for whoever watches it: the backend evaluation callback
//! (`sd_set_backend_eval_callback`, imatrix collection) and the profiler (`SD_PROFILE`).
//!
//! Like the reference's runner, a watched graph is computed up to each node the callback asks
//! for, the callback then sees that node's data and may stop the computation (the graph then
//! fails as aborted). The profiler times every node on its own. Nobody watching: one call to
//! the backend, as always.

use super::{eval_callback, profile, Backend};
use ggml_sys as g;
use std::ffi::c_int;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

/// ggml's graph struct as `ggml_graph_view` returns it (ggml-impl.h of the pinned ggml). Only
/// passed back to ggml; [`View::of`] checks the layout against the public accessors first.
#[repr(C)]
struct RawView {
    size: c_int,
    n_nodes: c_int,
    n_leafs: c_int,
    nodes: *mut *mut g::ggml_tensor,
    grads: *mut *mut g::ggml_tensor,
    grad_accs: *mut *mut g::ggml_tensor,
    leafs: *mut *mut g::ggml_tensor,
    use_counts: *mut i32,
    hash_size: usize,
    hash_used: *mut u32,
    hash_keys: *mut *mut g::ggml_tensor,
    order: c_int,
    uid: u64,
}

unsafe extern "C" {
    /// Nodes `[i0, i1)` of a graph, sharing its use counts (so fusions see the whole graph).
    fn ggml_graph_view(cgraph: *mut g::ggml_cgraph, i0: c_int, i1: c_int) -> RawView;
}

/// A slice of a graph's nodes that a backend can compute on its own.
struct View(RawView);

impl View {
    /// Nodes `[i0, i1)` of `gf`, or None when ggml's struct is not laid out as [`RawView`]
    /// says (another ggml than the pinned one).
    fn of(gf: *mut g::ggml_cgraph, i0: c_int, i1: c_int) -> Option<View> {
        // SAFETY: gf is a valid graph and 0 <= i0 <= i1 <= its node count (callers).
        let v = unsafe { ggml_graph_view(gf, i0, i1) };
        // SAFETY: as above; nodes() points at the graph's node array.
        let nodes = unsafe { g::ggml_graph_nodes(gf) };
        (v.n_nodes == i1 - i0 && v.n_leafs == 0 && v.nodes == nodes.wrapping_add(i0 as usize)).then_some(View(v))
    }

    fn as_graph(&mut self) -> *mut g::ggml_cgraph {
        (&mut self.0 as *mut RawView).cast()
    }
}

/// Nodes that compute nothing (ggml skips them): timed together with the next real one.
fn computes_nothing(t: *mut g::ggml_tensor) -> bool {
    // SAFETY: a node of a live graph.
    let op = unsafe { (*t).op };
    matches!(op, g::GGML_OP_NONE | g::GGML_OP_VIEW | g::GGML_OP_RESHAPE | g::GGML_OP_PERMUTE | g::GGML_OP_TRANSPOSE)
}

/// Computes `gf` on `backend` (allocated, inputs uploaded), in pieces when an evaluation
/// callback is installed or the profiler is on.
pub(crate) fn compute(backend: &Backend, gf: *mut g::ggml_cgraph, n_threads: i32) -> g::ggml_status {
    let watcher = eval_callback::installed();
    let timing = profile::enabled();
    if watcher.is_none() && !timing {
        // SAFETY: an allocated graph on this backend.
        return unsafe { g::ggml_backend_graph_compute(backend.raw(), gf) };
    }
    // SAFETY: valid graph.
    let n = unsafe { g::ggml_graph_n_nodes(gf) };
    if View::of(gf, 0, n).is_none() {
        warn_once_unviewable();
        // SAFETY: as above.
        return unsafe { g::ggml_backend_graph_compute(backend.raw(), gf) };
    }
    // ggml would start and join its threads for every piece: lend it a pool for the graph.
    let _pool = if backend.is_cpu() { PoolLoan::new(backend, n_threads) } else { None };
    if timing {
        // Wakes the pool's threads before the first node is timed.
        let mut none = View::of(gf, 0, 0).expect("the layout was checked above");
        // SAFETY: an empty slice of an allocated graph.
        unsafe { g::ggml_backend_graph_compute(backend.raw(), none.as_graph()) };
    }
    let start = Instant::now();
    let mut times: Vec<(*mut g::ggml_tensor, Duration)> = Vec::new();
    let mut j0 = 0;
    while j0 < n {
        let mut j1 = j0;
        let mut wanted;
        loop {
            // SAFETY: j1 < n.
            let t = unsafe { g::ggml_graph_node(gf, j1) };
            wanted = watcher.as_ref().is_some_and(|w| ask(w, t));
            if wanted || j1 == n - 1 || (timing && !computes_nothing(t)) {
                break;
            }
            j1 += 1;
        }
        let mut view = View::of(gf, j0, j1 + 1).expect("the layout was checked above");
        let t0 = Instant::now();
        // SAFETY: a slice of an allocated graph on this backend.
        let status = unsafe { g::ggml_backend_graph_compute(backend.raw(), view.as_graph()) };
        // SAFETY: j1 < n.
        let last = unsafe { g::ggml_graph_node(gf, j1) };
        if timing {
            times.push((last, t0.elapsed()));
        }
        if status != g::GGML_STATUS_SUCCESS {
            return status;
        }
        if wanted && !watcher.as_ref().is_some_and(|w| tell(w, last)) {
            sd_debug!("the evaluation callback stopped the computation at node {j1} of {n}");
            return g::GGML_STATUS_ABORTED;
        }
        j0 = j1 + 1;
    }
    if timing {
        profile::record(gf, &times, start.elapsed());
    }
    g::GGML_STATUS_SUCCESS
}

fn ask(w: &eval_callback::EvalFn, t: *mut g::ggml_tensor) -> bool {
    NonNull::new(t).is_some_and(|t| eval_callback::call(w, t, true))
}

fn tell(w: &eval_callback::EvalFn, t: *mut g::ggml_tensor) -> bool {
    NonNull::new(t).is_some_and(|t| eval_callback::call(w, t, false))
}

fn warn_once_unviewable() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        sd_warn!("this ggml's graph layout is not the pinned one: graphs are computed whole, without the evaluation callback or the profiler")
    });
}

/// A thread pool the CPU backend uses while it is held.
struct PoolLoan {
    backend: g::ggml_backend_t,
    pool: *mut g::ggml_threadpool,
    free: unsafe extern "C" fn(*mut g::ggml_threadpool),
    set: unsafe extern "C" fn(g::ggml_backend_t, *mut g::ggml_threadpool),
}

impl PoolLoan {
    fn new(backend: &Backend, n_threads: i32) -> Option<PoolLoan> {
        type New = unsafe extern "C" fn(*mut g::ggml_threadpool_params) -> *mut g::ggml_threadpool;
        let new = backend.proc_address(c"ggml_threadpool_new");
        let free = backend.proc_address(c"ggml_threadpool_free");
        let set = backend.proc_address(c"ggml_backend_cpu_set_threadpool");
        if new.is_null() || free.is_null() || set.is_null() {
            return None;
        }
        // SAFETY: ggml-cpu's documented signatures for these names.
        unsafe {
            let new: New = std::mem::transmute(new);
            let mut params = g::ggml_threadpool_params_default(n_threads.max(1));
            let pool = new(&mut params);
            if pool.is_null() {
                return None;
            }
            let loan = PoolLoan { backend: backend.raw(), pool, free: std::mem::transmute(free), set: std::mem::transmute(set) };
            (loan.set)(loan.backend, pool);
            Some(loan)
        }
    }
}

impl Drop for PoolLoan {
    fn drop(&mut self) {
        // SAFETY: the backend outlives the loan (held by the caller); the pool is ours and no
        // computation runs on it any more.
        unsafe {
            (self.set)(self.backend, std::ptr::null_mut());
            (self.free)(self.pool);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::graph::nn::Linear;
    use crate::graph::{eval_callback, profile, Backend, ParamStore, Runner, Scope, TypeMap, F32};
    use crate::tensor::Tensor;
    use std::sync::{Arc, Mutex};

    /// Two linear layers with a GELU between them, their weights named like a model's.
    struct Net {
        _store: ParamStore,
        layers: [Linear; 2],
    }

    fn net(backend: &Backend) -> Net {
        let mut store = ParamStore::new(8).unwrap();
        let mut types = TypeMap::new();
        for n in ["net.blocks.0.fc.weight", "net.blocks.1.fc.weight"] {
            types.insert(n.into(), F32);
        }
        let layers = {
            let mut s = Scope::new(&mut store, &types, "net.");
            [Linear::new(&mut s, "blocks.0.fc", 64, 48, true), Linear::new(&mut s, "blocks.1.fc", 48, 16, true)]
        };
        store.alloc(backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let v: Vec<f32> = (0..n).map(|i| ((i * 13 + name.len()) % 97) as f32 / 60.0 - 0.8).collect();
                dst.copy_from_slice(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                Ok(())
            })
            .unwrap();
        Net { _store: store, layers }
    }

    fn run(r: &mut Runner, n: &Net) -> Tensor {
        let x: Vec<f32> = (0..64 * 8).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        r.compute(|g| {
            let x = g.input_f32(&x, &[64, 8]);
            let h = n.layers[0].forward(g, x).gelu();
            Ok(n.layers[1].forward(g, h.add(h)).soft_max())
        })
        .unwrap()
    }

    #[test]
    fn watched_graphs_compute_the_same_and_the_callback_can_stop_them() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let n = net(&backend);
        let mut r = Runner::new(backend, 2);
        // Products by ggml, as in a watched graph.
        r.options.cpu_own_matmul = false;
        let plain = run(&mut r, &n);

        let seen: Arc<Mutex<Vec<(bool, [i64; 4])>>> = Arc::default();
        let s = seen.clone();
        eval_callback::set(Some(Arc::new(move |t, ask| {
            if !t.is_mul_mat() {
                return !ask;
            }
            s.lock().unwrap().push((ask, t.ne()));
            true
        })));
        let watched = run(&mut r, &n);
        eval_callback::set(None);
        assert_eq!(watched.data(), plain.data(), "a watched graph computes the same numbers");
        // Each product is asked about, then shown computed, in graph order.
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen, vec![(true, [48, 8, 1, 1]), (false, [48, 8, 1, 1]), (true, [16, 8, 1, 1]), (false, [16, 8, 1, 1])]);

        eval_callback::set(Some(Arc::new(|t, ask| if ask { t.is_mul_mat() } else { false })));
        let x = vec![0.5f32; 64 * 8];
        let stopped = r.compute(|g| {
            let x = g.input_f32(&x, &[64, 8]);
            Ok(n.layers[1].forward(g, n.layers[0].forward(g, x)))
        });
        eval_callback::set(None);
        let e = stopped.expect_err("the callback stopped it").to_string();
        assert!(e.contains("aborted"), "{e}");
    }

    #[test]
    fn profiled_graphs_compute_the_same_numbers_and_name_their_modules() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let forced = profile::Forced::on();
        // Weights are named for the profiler as they are declared.
        let n = net(&backend);
        let mut r = Runner::new(backend, 2);
        forced.set(false);
        let plain = run(&mut r, &n);
        forced.set(true);
        let _ = profile::take_report("before", Default::default());
        let profiled = run(&mut r, &n);
        assert_eq!(profiled.data(), plain.data(), "node by node, the same numbers");
        let report = profile::take_report("a test", Default::default()).join("\n");
        assert!(report.contains("  net.blocks: 1 computations"), "{report}");
        for row in ["matrix product (ours)", "gelu", "soft_max", "  0\n", "  1\n", "  0.fc\n", "  1.fc"] {
            assert!(report.contains(row) || report.ends_with(row.trim_end()), "no {row:?} in\n{report}");
        }
    }
}
