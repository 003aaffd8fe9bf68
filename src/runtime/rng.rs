//! Noise generators that reproduce the reference's numbers bit for bit.
//!
//! Three generators, chosen by [`RngType`]:
//! - `std_default`: libstdc++'s `std::default_random_engine` (minstd_rand0) feeding
//!   `std::normal_distribution<float>` (Marsaglia polar method). A fresh distribution is
//!   used for every `randn` call, so a pending second value is dropped between calls.
//! - `cuda`: Philox 4x32-10 + Box-Muller, imitating torch's CUDA `randn`. Every `randn` call
//!   uses the next counter offset.
//! - `cpu`: MT19937 + torch's CPU `randn` (16-wide float Box-Muller for n >= 16, the
//!   double-precision path otherwise).
//!
//! Where the reference calls C's double-precision `log`/`sin` on float arguments the code
//! below does the same in f64, so results round exactly like the reference's.

use crate::tensor::Tensor;
use crate::types::RngType;

/// A seeded normal-noise source.
pub trait Rng {
    /// Restarts the stream for `seed`.
    fn manual_seed(&mut self, seed: u64);
    /// The next `n` standard-normal values.
    fn randn(&mut self, n: usize) -> Vec<f32>;
}

/// A generator of the given type, seeded with `seed`.
pub fn new_rng(kind: RngType, seed: u64) -> Box<dyn Rng> {
    let mut rng: Box<dyn Rng> = match kind {
        RngType::StdDefault => Box::new(StdDefaultRng::new(0)),
        RngType::Cuda => Box::new(PhiloxRng::new(0)),
        RngType::Cpu => Box::new(Mt19937Rng::new(0)),
    };
    rng.manual_seed(seed);
    rng
}

/// The generators of one generation: initial noise and sampler noise.
///
/// Like the reference, when the sampler's type is unset or equal to the noise type both
/// are ONE generator: the sampler continues the stream after the initial noise (and after
/// anything else drawn from it, such as VAE sampling). A different sampler type gets its
/// own generator, seeded with the same seed.
pub struct GenerationRngs {
    noise: Box<dyn Rng>,
    sampler: Option<Box<dyn Rng>>,
}

impl GenerationRngs {
    /// `sampler_type`: `None` for the C API's `RNG_TYPE_COUNT` (same as `noise_type`).
    pub fn new(noise_type: RngType, sampler_type: Option<RngType>) -> Self {
        let sampler = sampler_type.filter(|&t| t != noise_type).map(|t| new_rng(t, 0));
        GenerationRngs { noise: new_rng(noise_type, 0), sampler }
    }

    /// Seeds both generators (before each image of a batch, with [`batch_seed`]).
    pub fn manual_seed(&mut self, seed: u64) {
        self.noise.manual_seed(seed);
        if let Some(s) = &mut self.sampler {
            s.manual_seed(seed);
        }
    }

    /// The initial-noise generator.
    pub fn noise(&mut self) -> &mut dyn Rng {
        self.noise.as_mut()
    }

    /// The sampler's generator (the noise generator itself when shared).
    pub fn sampler(&mut self) -> &mut dyn Rng {
        match &mut self.sampler {
            Some(s) => s.as_mut(),
            None => self.noise.as_mut(),
        }
    }
}

/// A tensor of `shape` filled from `rng` in flat (ggml, `ne[0]` fastest) order.
pub fn randn(shape: &[usize], rng: &mut dyn Rng) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(shape, rng.randn(n)).expect("randn returns exactly n values")
}

/// Noise shaped like `like`.
pub fn randn_like(like: &Tensor, rng: &mut dyn Rng) -> Tensor {
    randn(like.shape(), rng)
}

/// The seed of image `index` of a batch: consecutive seeds, like the reference.
pub fn batch_seed(seed: i64, index: usize) -> i64 {
    seed.wrapping_add(index as i64)
}

/// A negative seed asks for a random one; like the reference's `rand()` it is in
/// `[0, 2^31 - 1]`.
pub fn resolve_seed(seed: i64) -> i64 {
    if seed >= 0 {
        return seed;
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    (h.finish() & 0x7fff_ffff) as i64
}

// ---------------------------------------------------------------------------------------
// std_default: minstd_rand0 + libstdc++ normal_distribution<float>

/// `std::default_random_engine` + `std::normal_distribution<float>` as libstdc++ has them.
pub struct StdDefaultRng {
    state: u32,
}

const MINSTD_M: u64 = 2_147_483_647;
const MINSTD_A: u64 = 16_807;

impl StdDefaultRng {
    pub fn new(seed: u64) -> Self {
        let mut r = StdDefaultRng { state: 1 };
        r.manual_seed(seed);
        r
    }

    fn next_u32(&mut self) -> u32 {
        self.state = ((self.state as u64 * MINSTD_A) % MINSTD_M) as u32;
        self.state
    }

    /// `generate_canonical<float, 24>`: one draw suffices (the engine gives ~31 bits);
    /// the range 2^31 - 2 rounds to 2^31 as a float divisor.
    fn canonical(&mut self) -> f32 {
        let sum = (self.next_u32() - 1) as f32;
        let divisor = (MINSTD_M - 1) as f32;
        let r = sum / divisor;
        if r >= 1.0 {
            // nextafter(1.0f, 0.0f)
            f32::from_bits(0x3f7f_ffff)
        } else {
            r
        }
    }
}

impl Rng for StdDefaultRng {
    fn manual_seed(&mut self, seed: u64) {
        // The reference passes the seed through `unsigned int`.
        let s = (seed as u32) as u64 % MINSTD_M;
        self.state = if s == 0 { 1 } else { s as u32 };
    }

    fn randn(&mut self, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        let mut saved: Option<f32> = None;
        while out.len() < n {
            if let Some(v) = saved.take() {
                out.push(v);
                continue;
            }
            let (x, y, r2) = loop {
                let x = 2.0f32 * self.canonical() - 1.0;
                let y = 2.0f32 * self.canonical() - 1.0;
                let r2 = x * x + y * y;
                if r2 <= 1.0 && r2 != 0.0 {
                    break (x, y, r2);
                }
            };
            let mult = (-2.0f32 * r2.ln() / r2).sqrt();
            saved = Some(x * mult);
            out.push(y * mult);
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// cuda: Philox 4x32-10 + Box-Muller

/// Philox 4x32-10 imitating torch's CUDA `randn`.
pub struct PhiloxRng {
    seed: u64,
    offset: u32,
}

const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
const TWO_POW32_INV: f32 = 2.328_306_4e-10;

impl PhiloxRng {
    pub fn new(seed: u64) -> Self {
        PhiloxRng { seed, offset: 0 }
    }

    fn round(c: &mut [u32; 4], k: [u32; 2]) {
        let v1 = c[0] as u64 * PHILOX_M[0] as u64;
        let v2 = c[2] as u64 * PHILOX_M[1] as u64;
        *c = [
            (v2 >> 32) as u32 ^ c[1] ^ k[0],
            v2 as u32,
            (v1 >> 32) as u32 ^ c[3] ^ k[1],
            v1 as u32,
        ];
    }

    fn philox10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
        for _ in 0..9 {
            Self::round(&mut c, k);
            k[0] = k[0].wrapping_add(PHILOX_W[0]);
            k[1] = k[1].wrapping_add(PHILOX_W[1]);
        }
        Self::round(&mut c, k);
        c
    }

    fn box_muller(x: f32, y: f32) -> f32 {
        let two_pi_inv = TWO_POW32_INV * 6.283_185_5f32;
        let u = x * TWO_POW32_INV + TWO_POW32_INV / 2.0;
        let v = y * two_pi_inv + two_pi_inv / 2.0;
        // C `log`, `sqrt` and `sin` in double precision on float arguments.
        let s = (-2.0f64 * (u as f64).ln()).sqrt() as f32;
        (s as f64 * (v as f64).sin()) as f32
    }
}

impl Rng for PhiloxRng {
    fn manual_seed(&mut self, seed: u64) {
        self.seed = seed;
        self.offset = 0;
    }

    fn randn(&mut self, n: usize) -> Vec<f32> {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let offset = self.offset;
        self.offset = self.offset.wrapping_add(1);
        (0..n)
            .map(|i| {
                let g = Self::philox10([offset, 0, i as u32, 0], key);
                Self::box_muller(g[0] as f32, g[1] as f32)
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------
// cpu: MT19937 + torch CPU randn

const MT_N: usize = 624;
const MT_M: usize = 397;

/// MT19937 with torch's CPU normal sampling.
pub struct Mt19937Rng {
    state: Box<[u32; MT_N]>,
    left: usize,
    next: usize,
    next_gauss: Option<f64>,
}

impl Mt19937Rng {
    pub fn new(seed: u64) -> Self {
        let mut r = Mt19937Rng { state: Box::new([0; MT_N]), left: 1, next: 0, next_gauss: None };
        r.manual_seed(seed);
        r
    }

    fn twist(u: u32, v: u32) -> u32 {
        let mixed = (u & 0x8000_0000) | (v & 0x7fff_ffff);
        (mixed >> 1) ^ if v & 1 != 0 { 0x9908_b0df } else { 0 }
    }

    fn regenerate(&mut self) {
        let s = &mut self.state;
        for j in 0..MT_N {
            let follow = s[(j + 1) % MT_N];
            s[j] = s[(j + MT_M) % MT_N] ^ Self::twist(s[j], follow);
        }
        self.left = MT_N;
        self.next = 0;
    }

    /// One tempered 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        self.left -= 1;
        if self.left == 0 {
            self.regenerate();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        let lo = self.next_u32() as u64;
        (hi << 32) | lo
    }

    /// Uniform float in [0, 1) from the low 24 bits.
    fn uniform_f32(&mut self) -> f32 {
        (self.next_u32() & 0x00ff_ffff) as f32 * (1.0 / 16_777_216.0)
    }

    /// Uniform double in [0, 1) from the low 53 bits.
    fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.next_gauss.take() {
            return v;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_gauss = Some(r * theta.sin());
        r * theta.cos()
    }

    /// Box-Muller over 16 uniforms: pairs (j, j + 8).
    fn normal_fill_16(data: &mut [f32]) {
        let two_pi = 2.0f32 * std::f32::consts::PI;
        for j in 0..8 {
            let u1 = 1.0f32 - data[j];
            let u2 = data[j + 8];
            let r = (-2.0f32 * u1.ln()).sqrt();
            let theta = two_pi * u2;
            data[j] = r * theta.cos();
            data[j + 8] = r * theta.sin();
        }
    }
}

impl Rng for Mt19937Rng {
    fn manual_seed(&mut self, seed: u64) {
        self.state[0] = seed as u32;
        for j in 1..MT_N {
            let prev = self.state[j - 1];
            self.state[j] =
                1_812_433_253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(j as u32);
        }
        self.left = 1;
        self.next = 0;
        self.next_gauss = None;
    }

    fn randn(&mut self, n: usize) -> Vec<f32> {
        if n < 16 {
            return (0..n).map(|_| self.normal_f64() as f32).collect();
        }
        let mut data: Vec<f32> = (0..n).map(|_| self.uniform_f32()).collect();
        for start in (0..=n - 16).step_by(16) {
            Self::normal_fill_16(&mut data[start..start + 16]);
        }
        if !n.is_multiple_of(16) {
            // The tail block is redrawn over the last 16 positions.
            let tail = &mut data[n - 16..];
            for v in tail.iter_mut() {
                *v = self.uniform_f32();
            }
            Self::normal_fill_16(tail);
        }
        data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    fn round4(v: &[f32]) -> Vec<f32> {
        v.iter().map(|f| (f * 10_000.0).round() / 10_000.0).collect()
    }

    #[test]
    fn cpu_matches_published_torch_values() {
        // torch.manual_seed(42); torch.randn(5)
        let mut r = Mt19937Rng::new(42);
        assert_eq!(round4(&r.randn(5)), vec![0.3367, 0.1288, 0.2345, 0.2303, -1.1229]);
        // torch.manual_seed(0); torch.randn(5)
        let mut r = Mt19937Rng::new(0);
        assert_eq!(round4(&r.randn(5)), vec![1.5410, -0.2934, -2.1788, 0.5684, -1.0845]);
        // torch.manual_seed(0); torch.randn(4, 4) (the 16-wide float path)
        let mut r = Mt19937Rng::new(0);
        assert_eq!(
            round4(&r.randn(16)),
            vec![
                -1.1258, -1.1524, -0.2506, -0.4339, 0.8487, 0.6920, -0.3160, -2.1152, 0.3223,
                -1.2633, 0.3500, 0.3081, 0.1198, 1.2377, 1.1168, -0.2473
            ]
        );
    }

    #[test]
    fn mt19937_raw_stream_matches_numpy() {
        // numpy's RandomState(5489) raw stream (= std::mt19937 with its default seed).
        let mut r = Mt19937Rng::new(5489);
        assert_eq!(r.next_u32(), 3_499_211_612);
        assert_eq!(r.next_u32(), 581_869_302);
        // The 10000th output of std::mt19937 (default seed) is 4123659995 (C++ standard).
        let mut r = Mt19937Rng::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = r.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn minstd_rand0_matches_the_standard() {
        // The C++ standard: the 10000th output of default-seeded minstd_rand0 is 1043618065.
        let mut r = StdDefaultRng::new(1);
        let mut last = 0;
        for _ in 0..10_000 {
            last = r.next_u32();
        }
        assert_eq!(last, 1_043_618_065);
        // seed 0 behaves like seed 1 (0 mod m is not a valid state).
        let mut a = StdDefaultRng::new(0);
        let mut b = StdDefaultRng::new(1);
        assert_eq!(a.randn(7), b.randn(7));
    }

    // Expected bit patterns were produced by g++ 12 / libstdc++ / glibc 2.36 on x86-64 with
    // the reference's generator classes (outside this repository).
    #[test]
    fn matches_reference_bits() {
        let cases: &[(RngType, u64, &[&[u32]])] = &[
            (
                RngType::StdDefault,
                0,
                &[
                    &[0xbe84a7dd, 0x3fcd00f8, 0xbfbfddf6, 0x3e32f644, 0x3df440b4],
                    &[0x3eea96b9, 0x3e41852b, 0x3eca3a1a],
                ],
            ),
            (
                RngType::StdDefault,
                42,
                &[
                    &[0xbf66b831, 0x3f657b0a, 0xbf99f285, 0xbefaf5a3, 0x3c3bed31],
                    &[0xbfd6a967, 0x3e574663, 0xbde1abe2],
                ],
            ),
            (
                RngType::Cpu,
                0,
                &[
                    &[0x3fc53f5c, 0xbe963c50, 0xc00b7149, 0x3f1184b6, 0xbf8ad1a1],
                    &[0xbfb3052d, 0x3ece837a, 0x3f5688e5],
                    &[
                        0xbfad23c2, 0xbfd91446, 0x3f111004, 0x3f4b235d, 0x3ee11fd0, 0x3de637d6,
                        0x3f240af8, 0x3ee1df3c, 0xbe5d0b42, 0xbf3e17a3, 0x3f100e82, 0x3e84ede2,
                        0x3f05da2f, 0x40135755, 0xbfbc04b7, 0xbfcb189e, 0x3f9a033c, 0x3dad2087,
                        0xbf999e2b, 0xbb9cd1ae,
                    ],
                ],
            ),
            (
                RngType::Cuda,
                0,
                &[
                    &[0xbf6cb6ae, 0xbed9c6af, 0xc02934c5, 0x3e14ab14, 0xbdf788e4],
                    &[0x3e392a67, 0xbf0d6116, 0x3f6c7f09],
                ],
            ),
            (
                RngType::Cuda,
                42,
                &[
                    &[0x3e46ace2, 0x400a53f3, 0xbe302e08, 0x3f595c01, 0xbff652b6],
                    &[0x3e0e7a13, 0xbddda045, 0xbf37a8f8],
                ],
            ),
        ];
        for (kind, seed, calls) in cases {
            let mut r = new_rng(*kind, *seed);
            for (i, want) in calls.iter().enumerate() {
                assert_eq!(
                    bits(&r.randn(want.len())),
                    want.to_vec(),
                    "{kind} seed {seed} call {i}"
                );
            }
        }
    }

    #[test]
    fn reseeding_restarts_and_randn_fills_in_order() {
        for &kind in RngType::ALL {
            let mut r = new_rng(kind, 7);
            let a = r.randn(40);
            r.manual_seed(7);
            let t = randn(&[5, 4, 2], r.as_mut());
            assert_eq!(t.data(), &a[..], "{kind}");
        }
        assert_eq!(batch_seed(42, 1), 43);

        // Shared generator: the sampler continues after the initial noise.
        let mut g = GenerationRngs::new(RngType::Cuda, Some(RngType::Cuda));
        g.manual_seed(3);
        let _ = g.noise().randn(4);
        let after = g.sampler().randn(4);
        let mut solo = new_rng(RngType::Cuda, 3);
        let _ = solo.randn(4);
        assert_eq!(after, solo.randn(4));
        // Separate generator: starts fresh at the seed.
        let mut g = GenerationRngs::new(RngType::Cpu, Some(RngType::Cuda));
        g.manual_seed(3);
        let _ = g.noise().randn(4);
        assert_eq!(g.sampler().randn(4), new_rng(RngType::Cuda, 3).randn(4));
        assert_eq!(resolve_seed(5), 5);
        let s = resolve_seed(-1);
        assert!((0..=i32::MAX as i64).contains(&s));
    }
}
