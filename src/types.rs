//! The enumerations of the C API as Rust enums, shared by every layer.
//!
//! Raw values coming from C are untrusted: convert with `from_raw`, which rejects
//! anything that is not a declared value instead of transmuting it.

macro_rules! c_enum {
    (
        $(#[$meta:meta])*
        $name:ident : $raw:ty, count = $count:expr, {
            $( $variant:ident = $value:expr => $text:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $variant, )*
        }

        impl $name {
            /// Every declared value, in declaration order.
            pub const ALL: &'static [$name] = &[$( $name::$variant, )*];
            /// The `*_COUNT` sentinel of the C enum (means "not set / unknown").
            pub const COUNT: $raw = $count;

            pub fn from_raw(raw: $raw) -> Option<Self> {
                match raw {
                    $( v if v == $value => Some($name::$variant), )*
                    _ => None,
                }
            }

            pub fn raw(self) -> $raw {
                match self {
                    $( $name::$variant => $value, )*
                }
            }

            /// The reference's name for this value.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )*
                }
            }

            /// `name` as a NUL-terminated static string (for C callers).
            pub fn c_name(self) -> &'static std::ffi::CStr {
                match self {
                    $( $name::$variant => match std::ffi::CStr::from_bytes_with_nul(concat!($text, "\0").as_bytes()) {
                        Ok(c) => c,
                        Err(_) => c"",
                    }, )*
                }
            }

            /// Exact (case-sensitive) inverse of `name`, like the reference's `str_to_*`.
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $( t if t == $text => Some($name::$variant), )*
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

c_enum!(
    /// Noise generator.
    RngType: u32, count = 3, {
        StdDefault = 0 => "std_default",
        Cuda = 1 => "cuda",
        Cpu = 2 => "cpu",
    }
);

c_enum!(
    SampleMethod: u32, count = 21, {
        Euler = 0 => "euler",
        EulerA = 1 => "euler_a",
        Heun = 2 => "heun",
        Dpm2 = 3 => "dpm2",
        Dpmpp2sA = 4 => "dpm++2s_a",
        Dpmpp2m = 5 => "dpm++2m",
        Dpmpp2mV2 = 6 => "dpm++2mv2",
        Ipndm = 7 => "ipndm",
        IpndmV = 8 => "ipndm_v",
        Lcm = 9 => "lcm",
        DdimTrailing = 10 => "ddim_trailing",
        Tcd = 11 => "tcd",
        ResMultistep = 12 => "res_multistep",
        Res2s = 13 => "res_2s",
        ErSde = 14 => "er_sde",
        EulerCfgPp = 15 => "euler_cfg_pp",
        EulerACfgPp = 16 => "euler_a_cfg_pp",
        EulerGe = 17 => "euler_ge",
        Dpmpp2mSde = 18 => "dpm++2m_sde",
        Dpmpp2mSdeBt = 19 => "dpm++2m_sde_bt",
        Lms = 20 => "lms",
    }
);

c_enum!(
    Scheduler: u32, count = 16, {
        Discrete = 0 => "discrete",
        Karras = 1 => "karras",
        Exponential = 2 => "exponential",
        Ays = 3 => "ays",
        Gits = 4 => "gits",
        SgmUniform = 5 => "sgm_uniform",
        Simple = 6 => "simple",
        Smoothstep = 7 => "smoothstep",
        KlOptimal = 8 => "kl_optimal",
        Lcm = 9 => "lcm",
        BongTangent = 10 => "bong_tangent",
        Ltx2 = 11 => "ltx2",
        LogitNormal = 12 => "logit_normal",
        Flux2 = 13 => "flux2",
        Flux = 14 => "flux",
        Beta = 15 => "beta",
    }
);

c_enum!(
    Prediction: u32, count = 7, {
        Eps = 0 => "eps",
        V = 1 => "v",
        EdmV = 2 => "edm_v",
        Flow = 3 => "sd3_flow",
        FluxFlow = 4 => "flux_flow",
        SefiFlow = 5 => "sefi_flow",
        Minit2iFlow = 6 => "minit2i_flow",
    }
);

c_enum!(
    /// Weight type; the values are ggml's `ggml_type` values.
    SdType: u32, count = 42, {
        F32 = 0 => "f32",
        F16 = 1 => "f16",
        Q4_0 = 2 => "q4_0",
        Q4_1 = 3 => "q4_1",
        Q5_0 = 6 => "q5_0",
        Q5_1 = 7 => "q5_1",
        Q8_0 = 8 => "q8_0",
        Q8_1 = 9 => "q8_1",
        Q2K = 10 => "q2_K",
        Q3K = 11 => "q3_K",
        Q4K = 12 => "q4_K",
        Q5K = 13 => "q5_K",
        Q6K = 14 => "q6_K",
        Q8K = 15 => "q8_K",
        Iq2Xxs = 16 => "iq2_xxs",
        Iq2Xs = 17 => "iq2_xs",
        Iq3Xxs = 18 => "iq3_xxs",
        Iq1S = 19 => "iq1_s",
        Iq4Nl = 20 => "iq4_nl",
        Iq3S = 21 => "iq3_s",
        Iq2S = 22 => "iq2_s",
        Iq4Xs = 23 => "iq4_xs",
        I8 = 24 => "i8",
        I16 = 25 => "i16",
        I32 = 26 => "i32",
        I64 = 27 => "i64",
        F64 = 28 => "f64",
        Iq1M = 29 => "iq1_m",
        Bf16 = 30 => "bf16",
        Tq1_0 = 34 => "tq1_0",
        Tq2_0 = 35 => "tq2_0",
        Mxfp4 = 39 => "mxfp4",
        Nvfp4 = 40 => "nvfp4",
        Q1_0 = 41 => "q1_0",
    }
);

c_enum!(
    LogLevel: u32, count = 4, {
        Debug = 0 => "DEBUG",
        Info = 1 => "INFO",
        Warn = 2 => "WARN",
        Error = 3 => "ERROR",
    }
);

c_enum!(
    Preview: u32, count = 4, {
        None = 0 => "none",
        Proj = 1 => "proj",
        Tae = 2 => "tae",
        Vae = 3 => "vae",
    }
);

c_enum!(
    LoraApplyMode: u32, count = 3, {
        Auto = 0 => "auto",
        Immediately = 1 => "immediately",
        AtRuntime = 2 => "at_runtime",
    }
);

c_enum!(
    /// The VAE latent layout to assume; `Auto` (-1) detects it from the weights.
    VaeFormat: i32, count = 4, {
        Auto = -1 => "auto",
        Flux = 0 => "flux",
        Sd3 = 1 => "sd3",
        Flux2 = 2 => "flux2",
        Wan = 3 => "wan",
    }
);

c_enum!(
    CacheMode: u32, count = 7, {
        Disabled = 0 => "disabled",
        EasyCache = 1 => "easycache",
        UCache = 2 => "ucache",
        DbCache = 3 => "dbcache",
        TaylorSeer = 4 => "taylorseer",
        CacheDit = 5 => "cache-dit",
        Spectrum = 6 => "spectrum",
    }
);

c_enum!(
    HiresUpscaler: u32, count = 10, {
        None = 0 => "None",
        Latent = 1 => "Latent",
        LatentNearest = 2 => "Latent (nearest)",
        LatentNearestExact = 3 => "Latent (nearest-exact)",
        LatentAntialiased = 4 => "Latent (antialiased)",
        LatentBicubic = 5 => "Latent (bicubic)",
        LatentBicubicAntialiased = 6 => "Latent (bicubic antialiased)",
        Lanczos = 7 => "Lanczos",
        Nearest = 8 => "Nearest",
        Model = 9 => "Model",
    }
);

c_enum!(
    CancelMode: u32, count = 3, {
        All = 0 => "all",
        NewLatents = 1 => "new_latents",
        Reset = 2 => "reset",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trip_and_rejects_unknown() {
        for &m in SampleMethod::ALL {
            assert_eq!(SampleMethod::from_raw(m.raw()), Some(m));
            assert_eq!(SampleMethod::parse(m.name()), Some(m));
        }
        assert_eq!(SampleMethod::from_raw(SampleMethod::COUNT), None);
        assert_eq!(SdType::from_raw(4), None);
        assert_eq!(SdType::parse("Q8_0"), None);
        assert_eq!(VaeFormat::from_raw(-1), Some(VaeFormat::Auto));
    }
}
