//! Safe wrappers over ggml: backends, contexts, tensors, weights and graph execution.

pub mod adapter;
pub mod backend;
pub(crate) mod channel_norm;
pub(crate) mod int8;
pub mod context;
pub(crate) mod cut;
pub mod devices;
pub mod eval_callback;
pub(crate) mod flash;
pub(crate) mod gemm;
pub(crate) mod im2col;
pub mod loaded;
pub(crate) mod matmul;
#[cfg(target_arch = "x86_64")]
pub(crate) mod winograd;
/// Winograd convolutions are x86-64 only (AVX2 kernels); elsewhere convolutions keep im2col.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) mod winograd {
    use super::context::{Graph, T};
    pub(crate) fn conv3x3<'g>(_: &'g Graph, _: T<'g>, _: T<'g>, _: Option<T<'g>>, _: (i32, i32), _: (i32, i32), _: (i32, i32)) -> Option<T<'g>> {
        None
    }
    pub(crate) fn conv3x3_frames<'g>(_: &'g Graph, _: T<'g>, _: T<'g>, _: Option<T<'g>>, _: i64, _: (i32, i32)) -> Option<T<'g>> {
        None
    }
    pub(crate) fn conv3x3_frames_zero_front<'g>(_: &'g Graph, _: i64, _: T<'g>, _: T<'g>, _: Option<T<'g>>, _: i64, _: (i32, i32)) -> Option<T<'g>> {
        None
    }
    pub(crate) fn conv3x3_frames_after<'g>(_: &'g Graph, _: Option<T<'g>>, _: T<'g>, _: T<'g>, _: Option<T<'g>>, _: i64, _: (i32, i32)) -> Option<T<'g>> {
        None
    }
    pub(crate) fn conv3x3_frames_after_replicated<'g>(_: &'g Graph, _: Option<T<'g>>, _: T<'g>, _: T<'g>, _: Option<T<'g>>, _: i64) -> Option<T<'g>> {
        None
    }
}
pub mod nn;
pub(crate) mod observe;
pub mod ops;
pub mod params;
pub mod profile;
pub(crate) mod rope_pairs;
pub mod runner;

pub use adapter::{LayerOp, WeightAdapter};
pub use backend::Backend;
pub use cut::take_peak_device_bytes;
pub use devices::{DeviceMap, DeviceOptions, Module, Placement, WeightHome};
pub use context::{is_block_quantized, GgmlType, Graph, GraphOptions, F16, F32, I32, T, W};
pub use loaded::{Component, Components, Loaded, WeightSource, WeightsMut};
pub use params::{ParamStore, Scope, TensorSpec, TypeMap};
pub use ops::RopeParams;
pub use runner::Runner;

/// The name of one of our own operations (`ggml_custom_4d` nodes) by its function, for the
/// profiler.
pub(crate) fn own_op_name(fun: usize) -> Option<&'static str> {
    let mut ours: Vec<(usize, &'static str)> = vec![
        (matmul::compute as *const () as usize, "matrix product (ours)"),
        (int8::compute as *const () as usize, "int8 matrix product (ours)"),
        (channel_norm::compute as *const () as usize, "channel norm (ours)"),
        (im2col::im2col_rows as *const () as usize, "im2col (ours)"),
        (rope_pairs::compute as *const () as usize, "rotary embedding (ours)"),
        (flash::compute as *const () as usize, "flash attention (ours)"),
    ];
    #[cfg(target_arch = "x86_64")]
    ours.extend([(winograd::compute as *const () as usize, "winograd 3x3 convolution (ours)"), (winograd::compute_kernels as *const () as usize, "winograd kernel transform (ours)")]);
    ours.into_iter().find(|&(f, _)| f == fun).map(|(_, name)| name)
}
