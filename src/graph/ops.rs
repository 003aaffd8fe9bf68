//! ggml operations as methods on graph tensors. Names and argument orders follow ggml
//! (`a.mul_mat(b)` is `ggml_mul_mat(ctx, a, b)`), so model code reads like the graphs it
//! must reproduce.

use super::context::{GgmlType, T};
use ggml_sys as g;

macro_rules! unary {
    ($($name:ident => $f:ident),* $(,)?) => {
        $(
            pub fn $name(self) -> T<'g> {
                // SAFETY: self belongs to a live graph context.
                self.wrap(unsafe { g::$f(self.ctx(), self.raw()) })
            }
        )*
    };
}

macro_rules! binary {
    ($($name:ident => $f:ident),* $(,)?) => {
        $(
            pub fn $name(self, b: T<'g>) -> T<'g> {
                // SAFETY: both operands are tensors usable in this graph.
                self.wrap(unsafe { g::$f(self.ctx(), self.raw(), b.raw()) })
            }
        )*
    };
}

/// The parameters of ggml's rotary embeddings (`ggml_rope_ext`, YaRN fields included).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub n_dims: i32,
    /// `GGML_ROPE_TYPE_*`.
    pub mode: i32,
    pub n_ctx_orig: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

impl<'g> T<'g> {
    unary!(
        cont => ggml_cont,
        transpose => ggml_transpose,
        gelu => ggml_gelu,
        gelu_inplace => ggml_gelu_inplace,
        gelu_erf => ggml_gelu_erf,
        gelu_quick => ggml_gelu_quick,
        gelu_quick_inplace => ggml_gelu_quick_inplace,
        silu => ggml_silu,
        silu_inplace => ggml_silu_inplace,
        relu => ggml_relu,
        relu_inplace => ggml_relu_inplace,
        tanh => ggml_tanh,
        tanh_inplace => ggml_tanh_inplace,
        sigmoid => ggml_sigmoid,
        exp => ggml_exp,
        log => ggml_log,
        sqr => ggml_sqr,
        sqrt => ggml_sqrt,
        neg => ggml_neg,
        abs => ggml_abs,
        sin => ggml_sin,
        cos => ggml_cos,
        sum => ggml_sum,
        sum_rows => ggml_sum_rows,
        mean => ggml_mean,
        soft_max => ggml_soft_max,
        soft_max_inplace => ggml_soft_max_inplace,
        dup => ggml_dup,
        geglu => ggml_geglu,
    );

    binary!(
        add => ggml_add,
        add_inplace => ggml_add_inplace,
        sub => ggml_sub,
        sub_inplace => ggml_sub_inplace,
        mul => ggml_mul,
        mul_inplace => ggml_mul_inplace,
        div => ggml_div,
        div_inplace => ggml_div_inplace,
        mul_mat => ggml_mul_mat,
        out_prod => ggml_out_prod,
        repeat => ggml_repeat,
        get_rows => ggml_get_rows,
        cpy => ggml_cpy,
        swiglu_split => ggml_swiglu_split,
    );

    /// `ggml_mul_mat` computed with f32 accumulation where the backend distinguishes it.
    pub fn mul_mat_f32(self, b: T<'g>) -> T<'g> {
        let r = self.mul_mat(b);
        // SAFETY: r is a MUL_MAT node.
        unsafe { g::ggml_mul_mat_set_prec(r.raw(), g::GGML_PREC_F32) };
        r
    }

    pub fn scale(self, s: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_scale(self.ctx(), self.raw(), s) })
    }

    pub fn scale_inplace(self, s: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_scale_inplace(self.ctx(), self.raw(), s) })
    }

    pub fn scale_bias(self, s: f32, b: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_scale_bias(self.ctx(), self.raw(), s, b) })
    }

    pub fn clamp(self, min: f32, max: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_clamp(self.ctx(), self.raw(), min, max) })
    }

    pub fn leaky_relu(self, slope: f32, inplace: bool) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_leaky_relu(self.ctx(), self.raw(), slope, inplace) })
    }

    pub fn cast(self, ty: GgmlType) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_cast(self.ctx(), self.raw(), ty) })
    }

    pub fn norm(self, eps: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_norm(self.ctx(), self.raw(), eps) })
    }

    pub fn rms_norm(self, eps: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_rms_norm(self.ctx(), self.raw(), eps) })
    }

    /// Each row divided by its Euclidean norm (at least `eps`).
    pub fn l2_norm(self, eps: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_l2_norm(self.ctx(), self.raw(), eps) })
    }

    pub fn group_norm(self, groups: i32, eps: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_group_norm(self.ctx(), self.raw(), groups, eps) })
    }

    pub fn soft_max_ext(self, mask: Option<T<'g>>, scale: f32, max_bias: f32) -> T<'g> {
        let m = mask.map_or(std::ptr::null_mut(), |m| m.raw());
        // SAFETY: live tensors (mask optional).
        self.wrap(unsafe { g::ggml_soft_max_ext(self.ctx(), self.raw(), m, scale, max_bias) })
    }

    pub fn diag_mask_inf(self, n_past: i32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_diag_mask_inf(self.ctx(), self.raw(), n_past) })
    }

    pub fn diag_mask_inf_inplace(self, n_past: i32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_diag_mask_inf_inplace(self.ctx(), self.raw(), n_past) })
    }

    pub fn reshape(self, ne: &[i64]) -> T<'g> {
        // SAFETY: live tensor; ggml checks the element count.
        unsafe {
            let p = match *ne {
                [a] => g::ggml_reshape_1d(self.ctx(), self.raw(), a),
                [a, b] => g::ggml_reshape_2d(self.ctx(), self.raw(), a, b),
                [a, b, c] => g::ggml_reshape_3d(self.ctx(), self.raw(), a, b, c),
                [a, b, c, d] => g::ggml_reshape_4d(self.ctx(), self.raw(), a, b, c, d),
                _ => panic!("reshape to {} dims", ne.len()),
            };
            self.wrap(p)
        }
    }

    /// A strided view. `nb` holds the strides of dims 1.. (bytes), `offset` in bytes.
    pub fn view(self, ne: &[i64], nb: &[usize], offset: usize) -> T<'g> {
        // SAFETY: live tensor; ggml checks the view lies within the source.
        unsafe {
            let p = match (ne, nb) {
                ([a], []) => g::ggml_view_1d(self.ctx(), self.raw(), *a, offset),
                ([a, b], [n1]) => g::ggml_view_2d(self.ctx(), self.raw(), *a, *b, *n1, offset),
                ([a, b, c], [n1, n2]) => g::ggml_view_3d(self.ctx(), self.raw(), *a, *b, *c, *n1, *n2, offset),
                ([a, b, c, d], [n1, n2, n3]) => {
                    g::ggml_view_4d(self.ctx(), self.raw(), *a, *b, *c, *d, *n1, *n2, *n3, offset)
                }
                _ => panic!("view with {} dims and {} strides", ne.len(), nb.len()),
            };
            self.wrap(p)
        }
    }

    pub fn permute(self, a0: i32, a1: i32, a2: i32, a3: i32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_permute(self.ctx(), self.raw(), a0, a1, a2, a3) })
    }

    /// torch's `permute` in ggml's dimension order: output dimension `i` is input dimension
    /// `axes[i]` (`ggml_permute` takes the inverse: where each input dimension goes).
    pub fn permute_axes(self, axes: [i32; 4]) -> T<'g> {
        let mut to = [0i32; 4];
        for (i, &a) in axes.iter().enumerate() {
            to[a as usize] = i as i32;
        }
        self.permute(to[0], to[1], to[2], to[3])
    }

    /// `cont` only when needed.
    pub fn contiguous(self) -> T<'g> {
        if self.is_contiguous() {
            self
        } else {
            self.cont()
        }
    }

    /// Writes `b` into the view of `self` with strides `nb1..nb3` at byte `offset`; the
    /// result is that view of `self` (no copy of `self`).
    pub fn set_inplace(self, b: T<'g>, nb1: usize, nb2: usize, nb3: usize, offset: usize) -> T<'g> {
        // SAFETY: live tensors; ggml checks the view lies within `self`.
        self.wrap(unsafe { g::ggml_set_inplace(self.ctx(), self.raw(), b.raw(), nb1, nb2, nb3, offset) })
    }

    pub fn concat(self, b: T<'g>, dim: i32) -> T<'g> {
        // SAFETY: live tensors.
        self.wrap(unsafe { g::ggml_concat(self.ctx(), self.raw(), b.raw(), dim) })
    }

    pub fn repeat_4d(self, ne: [i64; 4]) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_repeat_4d(self.ctx(), self.raw(), ne[0], ne[1], ne[2], ne[3]) })
    }

    /// `ggml_conv_1d` (im2col + product): `self` is the kernel [K, IC, OC], `x` is [L, IC, N].
    pub fn conv_1d(self, x: T<'g>, s0: i32, p0: i32, d0: i32) -> T<'g> {
        // SAFETY: live tensors; ggml checks the sizes.
        self.wrap(unsafe { g::ggml_conv_1d(self.ctx(), self.raw(), x.raw(), s0, p0, d0) })
    }

    /// `ggml_conv_1d_dw`: `self` is the kernel [K, 1, C], `x` is [L, C, 1].
    pub fn conv_1d_dw(self, x: T<'g>, s0: i32, p0: i32, d0: i32) -> T<'g> {
        // SAFETY: live tensors; ggml checks the sizes.
        self.wrap(unsafe { g::ggml_conv_1d_dw(self.ctx(), self.raw(), x.raw(), s0, p0, d0) })
    }

    /// `ggml_conv_transpose_1d` without padding: `self` is the kernel [K, OC, IC], `x` is
    /// the matrix [L, IC].
    pub fn conv_transpose_1d(self, x: T<'g>, s0: i32) -> T<'g> {
        // SAFETY: live tensors; ggml checks the sizes (padding 0, dilation 1 are all it takes).
        self.wrap(unsafe { g::ggml_conv_transpose_1d(self.ctx(), self.raw(), x.raw(), s0, 0, 1) })
    }

    /// im2col-based 2D convolution: `self` is the kernel [KW, KH, IC, OC], `x` is [W, H, IC, N].
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d(self, x: T<'g>, s0: i32, s1: i32, p0: i32, p1: i32, d0: i32, d1: i32) -> T<'g> {
        // SAFETY: live tensors.
        self.wrap(unsafe { g::ggml_conv_2d(self.ctx(), self.raw(), x.raw(), s0, s1, p0, p1, d0, d1) })
    }

    /// Depthwise 2D convolution (im2col per channel): `self` is the kernel [KW, KH, 1, C],
    /// `x` is [W, H, C, N].
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_dw(self, x: T<'g>, s0: i32, s1: i32, p0: i32, p1: i32, d0: i32, d1: i32) -> T<'g> {
        // SAFETY: live tensors.
        self.wrap(unsafe { g::ggml_conv_2d_dw(self.ctx(), self.raw(), x.raw(), s0, s1, p0, p1, d0, d1) })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_dw_direct(self, x: T<'g>, s0: i32, s1: i32, p0: i32, p1: i32, d0: i32, d1: i32) -> T<'g> {
        // SAFETY: live tensors.
        self.wrap(unsafe { g::ggml_conv_2d_dw_direct(self.ctx(), self.raw(), x.raw(), s0, s1, p0, p1, d0, d1) })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_direct(self, x: T<'g>, s0: i32, s1: i32, p0: i32, p1: i32, d0: i32, d1: i32) -> T<'g> {
        // SAFETY: live tensors.
        self.wrap(unsafe { g::ggml_conv_2d_direct(self.ctx(), self.raw(), x.raw(), s0, s1, p0, p1, d0, d1) })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn im2col(self, x: T<'g>, s0: i32, s1: i32, p0: i32, p1: i32, d0: i32, d1: i32, is_2d: bool, ty: GgmlType) -> T<'g> {
        // SAFETY: live tensors.
        self.wrap(unsafe { g::ggml_im2col(self.ctx(), self.raw(), x.raw(), s0, s1, p0, p1, d0, d1, is_2d, ty) })
    }

    /// 3-D im2col: `self` is the kernel [KW, KH, KD, OC·IC], `x` is [W, H, D, N·IC] →
    /// [KW·KH·KD·IC, OW, OH, OD·N]. Strides, paddings and dilations in (w, h, d) order.
    pub fn im2col_3d(self, x: T<'g>, ic: i64, s: [i32; 3], p: [i32; 3], d: [i32; 3], ty: GgmlType) -> T<'g> {
        // SAFETY: live tensors; ggml checks the sizes.
        self.wrap(unsafe {
            g::ggml_im2col_3d(self.ctx(), self.raw(), x.raw(), ic, s[0], s[1], s[2], p[0], p[1], p[2], d[0], d[1], d[2], ty)
        })
    }

    /// `ggml_conv_3d` itself (`nn::conv_3d` composes the same ops around our products).
    pub fn conv_3d(self, x: T<'g>, ic: i64, s: [i32; 3], p: [i32; 3], d: [i32; 3]) -> T<'g> {
        // SAFETY: live tensors; ggml checks the sizes.
        self.wrap(unsafe { g::ggml_conv_3d(self.ctx(), self.raw(), x.raw(), ic, s[0], s[1], s[2], p[0], p[1], p[2], d[0], d[1], d[2]) })
    }

    /// Nearest-neighbour upscale of dims 0 and 1 by an integer factor.
    pub fn upscale(self, factor: i32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_upscale(self.ctx(), self.raw(), factor, g::GGML_SCALE_MODE_NEAREST) })
    }

    pub fn interpolate(self, ne: [i64; 4], mode: u32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_interpolate(self.ctx(), self.raw(), ne[0], ne[1], ne[2], ne[3], mode) })
    }

    /// Zero padding after the data in each dim.
    pub fn pad(self, p0: i32, p1: i32, p2: i32, p3: i32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_pad(self.ctx(), self.raw(), p0, p1, p2, p3) })
    }

    /// Zero padding before (`l`) and after (`r`) each dim.
    pub fn pad_ext(self, l: [i32; 4], r: [i32; 4]) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe {
            g::ggml_pad_ext(self.ctx(), self.raw(), l[0], r[0], l[1], r[1], l[2], r[2], l[3], r[3])
        })
    }

    /// Wrap-around padding before/after each dim (seamless tiling).
    pub fn pad_ext_circular(self, l: [i32; 4], r: [i32; 4]) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe {
            g::ggml_pad_ext_circular(self.ctx(), self.raw(), l[0], r[0], l[1], r[1], l[2], r[2], l[3], r[3])
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn pool_2d(self, op: u32, k0: i32, k1: i32, s0: i32, s1: i32, p0: f32, p1: f32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_pool_2d(self.ctx(), self.raw(), op, k0, k1, s0, s1, p0, p1) })
    }

    /// Sinusoidal embedding of the timesteps in `self` (1-D f32).
    pub fn timestep_embedding(self, dim: i32, max_period: i32) -> T<'g> {
        // SAFETY: live tensor.
        self.wrap(unsafe { g::ggml_timestep_embedding(self.ctx(), self.raw(), dim, max_period) })
    }

    pub fn flash_attn_ext(self, k: T<'g>, v: T<'g>, mask: Option<T<'g>>, scale: f32) -> T<'g> {
        let m = mask.map_or(std::ptr::null_mut(), |m| m.raw());
        // SAFETY: live tensors.
        let r = self.wrap(unsafe { g::ggml_flash_attn_ext(self.ctx(), self.raw(), k.raw(), v.raw(), m, scale, 0.0, 0.0) });
        // SAFETY: r is a FLASH_ATTN_EXT node.
        unsafe { g::ggml_flash_attn_ext_set_prec(r.raw(), g::GGML_PREC_F32) };
        r
    }

    /// Rotary position embedding of `self` `[d, heads, L, N]` by the i32 positions `pos`
    /// (`[L]`); the caller checks the shapes (ggml asserts them).
    pub fn rope_ext(self, pos: T<'g>, p: &RopeParams) -> T<'g> {
        // SAFETY: live tensors; no frequency factors.
        self.wrap(unsafe {
            g::ggml_rope_ext(
                self.ctx(),
                self.raw(),
                pos.raw(),
                std::ptr::null_mut(),
                p.n_dims,
                p.mode,
                p.n_ctx_orig,
                p.freq_base,
                p.freq_scale,
                p.ext_factor,
                p.attn_factor,
                p.beta_fast,
                p.beta_slow,
            )
        })
    }

    /// Multi-section rotary embedding (M-RoPE: `pos` holds 4 position rows, `[4·L]`).
    pub fn rope_multi(self, pos: T<'g>, sections: [i32; 4], p: &RopeParams) -> T<'g> {
        let mut sections = sections;
        // SAFETY: live tensors; ggml copies the four sections.
        self.wrap(unsafe {
            g::ggml_rope_multi(
                self.ctx(),
                self.raw(),
                pos.raw(),
                std::ptr::null_mut(),
                p.n_dims,
                sections.as_mut_ptr(),
                p.mode,
                p.n_ctx_orig,
                p.freq_base,
                p.freq_scale,
                p.ext_factor,
                p.attn_factor,
                p.beta_fast,
                p.beta_slow,
            )
        })
    }

    pub fn set_output(self) -> T<'g> {
        // SAFETY: live tensor.
        unsafe { g::ggml_set_output(self.raw()) };
        self
    }
}
