//! Graph execution: allocate a graph's intermediate tensors, upload inputs, compute on a
//! backend, read outputs back to the host.
//!
//! The compute buffer is kept between runs so a sampling loop does not reallocate it at
//! every step.

use super::adapter::WeightAdapter;
use super::backend::Backend;
use super::context::{Graph, GraphOptions, MAX_NODES, T};
use crate::error::{Context as _, Result};
use crate::tensor::Tensor;
use ggml_sys as g;
use std::ptr::NonNull;
use std::sync::Arc;

pub struct Runner {
    backend: Arc<Backend>,
    n_threads: i32,
    galloc: Option<NonNull<g::ggml_gallocr>>,
    /// Size of the compute buffer last reported, so growth is logged once.
    buffer_bytes: usize,
    pub options: GraphOptions,
    /// Handed to every graph this runner builds (run-time LoRAs).
    adapter: Option<Arc<dyn WeightAdapter>>,
}

// SAFETY: the allocator is owned exclusively by the runner.
unsafe impl Send for Runner {}

impl Runner {
    pub fn new(backend: Arc<Backend>, n_threads: i32) -> Runner {
        Runner { backend, n_threads: n_threads.max(1), galloc: None, buffer_bytes: 0, options: GraphOptions::default(), adapter: None }
    }

    /// Sets (or clears) the adapter the layers of every later graph consult.
    pub fn set_adapter(&mut self, adapter: Option<Arc<dyn WeightAdapter>>) {
        self.adapter = adapter;
    }

    pub fn adapter(&self) -> Option<&Arc<dyn WeightAdapter>> {
        self.adapter.as_ref()
    }

    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    pub fn n_threads(&self) -> i32 {
        self.n_threads
    }

    /// Builds a graph with `build` and computes its single output.
    pub fn compute<F>(&mut self, build: F) -> Result<Tensor>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<T<'g>>,
    {
        let mut out = self.compute_many(|g| Ok(vec![build(g)?]))?;
        Ok(out.pop().expect("one output"))
    }

    /// Builds a graph with `build` and computes all its outputs (each as a 4-D host tensor).
    pub fn compute_many<F>(&mut self, build: F) -> Result<Vec<Tensor>>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<Vec<T<'g>>>,
    {
        self.run(build, read_f32)
    }

    /// Builds a graph with `build` and returns the raw bytes of each output in its own type
    /// (e.g. weights computed in f16 or q8_0).
    pub fn compute_bytes<F>(&mut self, build: F) -> Result<Vec<Vec<u8>>>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<Vec<T<'g>>>,
    {
        self.run(build, read_bytes)
    }

    /// Builds, allocates and computes a graph and reads its outputs with `read`.
    fn run<F, R>(&mut self, build: F, read: fn(*mut g::ggml_tensor) -> Result<R>) -> Result<Vec<R>>
    where
        F: for<'g> FnOnce(&'g Graph) -> Result<Vec<T<'g>>>,
    {
        let extra = self.adapter.as_ref().map_or(0, |a| a.extra_nodes());
        let mut graph = Graph::with_nodes(MAX_NODES + extra)?;
        graph.options = self.options;
        graph.backend = self.backend.raw();
        graph.on_cpu = self.backend.is_cpu();
        graph.adapter = self.adapter.clone();
        let outputs = build(&graph)?;
        ensure!(!outputs.is_empty(), "graph has no output");
        // SAFETY: the graph context was sized for max_nodes nodes.
        let gf = unsafe { g::ggml_new_graph_custom(graph.ctx(), graph.max_nodes, false) };
        ensure!(!gf.is_null(), "could not create a compute graph");
        let raw_outputs: Vec<*mut g::ggml_tensor> = outputs.iter().map(|t| t.set_output().raw()).collect();
        for &o in &raw_outputs {
            // SAFETY: o belongs to the graph context.
            unsafe { g::ggml_build_forward_expand(gf, o) };
        }

        let galloc = self.allocator()?;
        // SAFETY: allocator and graph are valid.
        let ok = unsafe { g::ggml_gallocr_alloc_graph(galloc.as_ptr(), gf) };
        if !ok {
            // The cached buffer may be for another graph shape; drop it and retry once.
            self.free_allocator();
            let galloc = self.allocator()?;
            // SAFETY: as above.
            let ok = unsafe { g::ggml_gallocr_alloc_graph(galloc.as_ptr(), gf) };
            ensure!(ok, "could not allocate the compute buffer on {} (out of memory?)", self.backend.name());
        }
        if let Some(a) = self.galloc {
            // SAFETY: valid allocator; buffer 0 is the only one (one backend).
            let bytes = unsafe { g::ggml_gallocr_get_buffer_size(a.as_ptr(), 0) };
            if bytes != self.buffer_bytes {
                self.buffer_bytes = bytes;
                sd_debug!("compute buffer size: {:.2} MB ({})", bytes as f64 / (1024.0 * 1024.0), self.backend.name());
            }
        }

        for input in graph.inputs.borrow().iter() {
            // An input the graph never reads gets no memory; there is nothing to upload.
            // SAFETY: input.tensor belongs to the graph context.
            if unsafe { (*input.tensor).buffer.is_null() } {
                continue;
            }
            // SAFETY: the allocator placed the input; sizes were checked on creation.
            unsafe { g::ggml_backend_tensor_set(input.tensor, input.bytes.as_ptr() as *const _, 0, input.bytes.len()) };
        }

        self.backend.set_n_threads(self.n_threads);
        // SAFETY: allocated graph on this backend.
        let status = unsafe { g::ggml_backend_graph_compute(self.backend.raw(), gf) };
        ensure!(status == g::GGML_STATUS_SUCCESS, "graph computation failed on {} (status {status})", self.backend.name());
        raw_outputs.into_iter().map(read).collect()
    }

    fn allocator(&mut self) -> Result<NonNull<g::ggml_gallocr>> {
        if let Some(a) = self.galloc {
            return Ok(a);
        }
        // SAFETY: valid backend; the allocator is freed in Drop.
        let a = unsafe { g::ggml_gallocr_new(g::ggml_backend_get_default_buffer_type(self.backend.raw())) };
        let a = NonNull::new(a).context("could not create a graph allocator")?;
        self.galloc = Some(a);
        Ok(a)
    }

    fn free_allocator(&mut self) {
        if let Some(a) = self.galloc.take() {
            // SAFETY: we own the allocator.
            unsafe { g::ggml_gallocr_free(a.as_ptr()) };
        }
        self.buffer_bytes = 0;
    }

    /// Releases the compute buffer (e.g. after the last sampling step).
    pub fn release(&mut self) {
        self.free_allocator();
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.free_allocator();
    }
}

/// Reads a computed tensor's bytes as they are.
fn read_bytes(t: *mut g::ggml_tensor) -> Result<Vec<u8>> {
    // SAFETY: t is a computed tensor of an allocated graph.
    let (nbytes, contiguous) = unsafe { (g::ggml_nbytes(t), g::ggml_is_contiguous(t)) };
    ensure!(contiguous, "graph output is not contiguous");
    let mut bytes = vec![0u8; nbytes];
    // SAFETY: bytes holds nbytes.
    unsafe { g::ggml_backend_tensor_get(t, bytes.as_mut_ptr() as *mut _, 0, nbytes) };
    Ok(bytes)
}

/// Reads a computed tensor as f32 (converting f16/bf16), always as 4 dims.
fn read_f32(t: *mut g::ggml_tensor) -> Result<Tensor> {
    // SAFETY: t is a computed tensor of an allocated graph.
    let (ty, ne, nbytes, contiguous) =
        unsafe { ((*t).type_, (*t).ne, g::ggml_nbytes(t), g::ggml_is_contiguous(t)) };
    ensure!(contiguous, "graph output is not contiguous");
    let n: i64 = ne.iter().product();
    let n = n as usize;
    let mut bytes = vec![0u8; nbytes];
    // SAFETY: bytes holds nbytes.
    unsafe { g::ggml_backend_tensor_get(t, bytes.as_mut_ptr() as *mut _, 0, nbytes) };
    let data: Vec<f32> = match ty {
        g::GGML_TYPE_F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        g::GGML_TYPE_F16 => {
            let mut out = vec![0f32; n];
            // SAFETY: bytes holds n f16 values.
            unsafe { g::ggml_fp16_to_fp32_row(bytes.as_ptr() as *const u16, out.as_mut_ptr(), n as i64) };
            out
        }
        g::GGML_TYPE_I32 => bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect(),
        other => bail!("cannot read a graph output of ggml type {other}"),
    };
    let shape: Vec<usize> = ne.iter().map(|&d| d as usize).collect();
    Tensor::from_vec(&shape, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::nn::{Conv2d, GroupNorm, Linear};
    use crate::graph::params::{ParamStore, Scope, TypeMap};
    use crate::graph::F32;
    use crate::testutil::pattern;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn linear_conv_and_norm_compute_like_torch() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let mut store = ParamStore::new(16).unwrap();
        let mut types = TypeMap::new();
        types.insert("lin.weight".into(), F32);
        let (lin, conv, gn) = {
            let mut s = Scope::new(&mut store, &types, "");
            let lin = Linear::new(&mut s, "lin", 3, 2, true);
            let conv = Conv2d::square(&mut s, "conv", 1, 1, 3, 1, 1);
            let gn = GroupNorm::new(&mut s, "gn", 1, 2, true);
            (lin, conv, gn)
        };
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                match name {
                    // rows of W: [1,2,3], [4,5,6]
                    "lin.weight" => dst.copy_from_slice(&f32_bytes(&[1., 2., 3., 4., 5., 6.])),
                    "lin.bias" => dst.copy_from_slice(&f32_bytes(&[0.5, -0.5])),
                    "conv.weight" => {
                        // f16 ones
                        let one = 0x3C00u16.to_le_bytes();
                        for c in dst.chunks_exact_mut(2) {
                            c.copy_from_slice(&one);
                        }
                        assert_eq!(n, 9);
                    }
                    "conv.bias" => dst.copy_from_slice(&f32_bytes(&[1.0])),
                    "gn.weight" => dst.copy_from_slice(&f32_bytes(&[1.0, 2.0])),
                    "gn.bias" => dst.copy_from_slice(&f32_bytes(&[0.0, 1.0])),
                    other => panic!("unexpected {other}"),
                }
                Ok(())
            })
            .unwrap();

        let mut runner = Runner::new(backend, 2);
        let y = runner
            .compute(|g| {
                let x = g.input_f32(&[1.0, 1.0, 1.0, 2.0, 0.0, 1.0], &[3, 2]);
                Ok(lin.forward(g, x))
            })
            .unwrap();
        assert_eq!(y.shape(), &[2, 2, 1, 1]);
        assert_eq!(y.data(), &[6.5, 14.5, 5.5, 13.5]);

        // 3x3 box filter with zero padding on a 3x3 image of ones, plus bias 1.
        let y = runner
            .compute(|g| {
                let x = g.input_f32(&[1.0; 9], &[3, 3, 1, 1]);
                Ok(conv.forward(g, x))
            })
            .unwrap();
        assert_eq!(y.data(), &[5., 7., 5., 7., 10., 7., 5., 7., 5.]);

        // Group norm with one group over two channels.
        let y = runner
            .compute(|g| {
                let x = g.input_f32(&[0.0, 2.0, 0.0, 2.0], &[2, 1, 2, 1]);
                Ok(gn.forward(g, x))
            })
            .unwrap();
        let d = y.data();
        assert!((d[0] + 1.0).abs() < 1e-3 && (d[1] - 1.0).abs() < 1e-3, "{d:?}");
        assert!((d[2] + 1.0).abs() < 1e-3 && (d[3] - 3.0).abs() < 1e-3, "{d:?}");
    }

    /// Scores computed a few query rows at a time, and convolutions whose im2col matrix is
    /// built piecewise, give exactly the numbers of the one-piece graphs.
    #[test]
    fn split_attention_and_direct_conv_are_bit_identical() {
        let backend = Arc::new(Backend::cpu().unwrap());
        // One dot product per output: the tiled kernels pick their code path by the row
        // count (a multiple of 4 or not), which a band of rows can change.
        assert!(backend.set_reference_kernels(true));
        let (c, l_q, l_k, heads) = (16i64, 37i64, 29i64, 2i64);
        let q = pattern((c * l_q) as usize, 1);
        let k = pattern((c * l_k) as usize, 2);
        let v = pattern((c * l_k) as usize, 3);
        let attend = |limit: usize| {
            let mut runner = Runner::new(backend.clone(), 2);
            runner.options.cpu_scores_limit = limit;
            runner
                .compute(|g| {
                    let q = g.input_f32(&q, &[c, l_q, 1]);
                    let k = g.input_f32(&k, &[c, l_k, 1]);
                    let v = g.input_f32(&v, &[c, l_k, 1]);
                    Ok(crate::graph::nn::attention(g, q, k, v, heads, None, false, false, 1.0))
                })
                .unwrap()
        };
        let whole = attend(usize::MAX);
        // 5 rows of scores per chunk: 8 chunks, the last one shorter.
        let split = attend((5 * l_k * heads * 4) as usize);
        assert_eq!(whole.shape(), split.shape());
        assert!(whole.data().iter().zip(split.data()).all(|(a, b)| a.to_bits() == b.to_bits()));

        let mut store = ParamStore::new(4).unwrap();
        let types = TypeMap::new();
        let conv = {
            let mut s = Scope::new(&mut store, &types, "");
            Conv2d::new(&mut s, "conv", 6, 5, (3, 3), (2, 1), (1, 1), true)
        };
        store.alloc(&backend).unwrap();
        store
            .load(|name, spec, dst| {
                let n = spec.ne.iter().product::<i64>() as usize;
                let vals = pattern(n, if name.ends_with("bias") { 4 } else { 5 });
                if spec.ty == F32 {
                    dst.copy_from_slice(&f32_bytes(&vals));
                } else {
                    let mut h = vec![0u16; n];
                    // SAFETY: h holds n values.
                    unsafe { g::ggml_fp32_to_fp16_row(vals.as_ptr(), h.as_mut_ptr(), n as i64) };
                    dst.copy_from_slice(&h.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
                }
                Ok(())
            })
            .unwrap();
        let x = pattern(11 * 9 * 6 * 2, 6);
        let convolve = |limit: usize, fast: bool, threads: i32| {
            let mut runner = Runner::new(backend.clone(), threads);
            runner.options.cpu_im2col_limit = limit;
            runner.options.cpu_fast_im2col = fast;
            runner.compute(|g| Ok(conv.forward(g, g.input_f32(&x, &[11, 9, 6, 2])))).unwrap()
        };
        let same = |a: &Tensor, b: &Tensor| a.shape() == b.shape() && a.data().iter().zip(b.data()).all(|(x, y)| x.to_bits() == y.to_bits());
        let ggml_im2col = convolve(usize::MAX, false, 2);
        assert!(same(&ggml_im2col, &convolve(0, false, 2)), "direct convolution");
        assert!(same(&ggml_im2col, &convolve(usize::MAX, true, 2)), "our im2col");
        assert!(same(&ggml_im2col, &convolve(usize::MAX, true, 3)), "our im2col, 3 threads");
        // In bands of output rows: 1 row (limit 0), and 2 + 2 + 1 rows (K = 54, OW = 11, N = 2).
        assert!(same(&ggml_im2col, &convolve(0, true, 2)), "bands of 1 row");
        assert!(same(&ggml_im2col, &convolve(2 * 11 * 2 * 54 * 2, true, 3)), "bands of 2 rows");
    }

    /// Our im2col op against ggml's on dilated, strided, padded and 1×1 kernels.
    #[test]
    fn our_im2col_matches_ggml_bit_for_bit() {
        let backend = Arc::new(Backend::cpu().unwrap());
        let x = pattern(13 * 10 * 3 * 2, 9);
        for (kw, kh, st, pad, dil) in [(3, 3, (1, 1), (1, 1), (1, 1)), (3, 2, (2, 3), (2, 0), (2, 1)), (1, 1, (1, 1), (0, 0), (1, 1)), (4, 4, (2, 2), (3, 1), (1, 2))] {
            let run = |fast: bool| {
                let mut runner = Runner::new(backend.clone(), 2);
                runner.options.cpu_fast_im2col = fast;
                runner
                    .compute(|g| {
                        let xt = g.input_f32(&x, &[13, 10, 3, 2]);
                        let shape = g.new_tensor(F32, &[kw, kh, 3, 1]);
                        Ok(match crate::graph::im2col::im2col_f16(g, shape.ne(), xt, st, pad, dil, None).filter(|_| fast) {
                            Some(t) => t,
                            None => shape.im2col(xt, st.0, st.1, pad.0, pad.1, dil.0, dil.1, true, crate::graph::F16),
                        })
                    })
                    .unwrap()
            };
            let (ours, theirs) = (run(true), run(false));
            assert_eq!(ours.shape(), theirs.shape(), "kernel {kw}x{kh}");
            assert!(ours.data().iter().zip(theirs.data()).all(|(a, b)| a.to_bits() == b.to_bits()), "kernel {kw}x{kh} {st:?} {pad:?} {dil:?}");
        }
    }
}
