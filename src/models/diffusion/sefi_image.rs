//! SeFi-Image's own part of its transformer (the reference's `sefi_image.hpp`): SeFi is the
//! Flux.2 transformer ([`super::flux::FluxVariant::Sefi`]) on a 144-channel latent (16
//! semantic channels in front of Flux.2's 128 texture channels, 32 VAE channels × 2×2) that
//! denoises the two parts on schedules of their own. So it embeds two timesteps instead of
//! one: `dual_time_embed.{semantic,texture}_embedder.linear_{1,2}` (no biases), each half as
//! wide as the transformer, side by side.

use crate::graph::nn::Linear;
use crate::graph::{Graph, Scope, T};
use crate::models::common::dit::timestep_embedding;

/// Latent channels that follow the semantic schedule (the rest are the texture's).
pub const SEMANTIC_CHANNELS: i64 = 16;
/// Width of the sinusoidal embedding of each timestep.
const TIME_IN_DIM: i64 = 256;

/// Linear, SiLU, linear.
#[derive(Clone, Copy, Debug)]
struct TimestepMlp {
    linear_1: Linear,
    linear_2: Linear,
}

impl TimestepMlp {
    fn new(s: &mut Scope, name: &str, in_dim: i64, dim: i64) -> TimestepMlp {
        let mut s = s.sub(name);
        TimestepMlp { linear_1: Linear::new(&mut s, "linear_1", in_dim, dim, false), linear_2: Linear::new(&mut s, "linear_2", dim, dim, false) }
    }

    fn forward<'g>(&self, g: &'g Graph, t: T<'g>) -> T<'g> {
        self.linear_2.forward(g, self.linear_1.forward(g, t).silu_inplace())
    }
}

/// The semantic and texture timestep embeddings, concatenated into the transformer's `vec`.
#[derive(Clone, Copy, Debug)]
pub struct DualTimeEmbed {
    semantic: TimestepMlp,
    texture: TimestepMlp,
}

impl DualTimeEmbed {
    /// `dual_time_embed` for a transformer `hidden` wide (each half `hidden / 2`).
    pub fn new(s: &mut Scope, hidden: i64) -> DualTimeEmbed {
        let mut s = s.sub("dual_time_embed");
        DualTimeEmbed {
            semantic: TimestepMlp::new(&mut s, "semantic_embedder", TIME_IN_DIM, hidden / 2),
            texture: TimestepMlp::new(&mut s, "texture_embedder", TIME_IN_DIM, hidden / 2),
        }
    }

    /// `timesteps` `[2]`: the semantic then the texture timestep, in 0..1000 (embedded as
    /// they are, not scaled like Flux's) → `[hidden, 1]`.
    pub fn forward<'g>(&self, g: &'g Graph, timesteps: T<'g>) -> T<'g> {
        let one = |i: usize| timesteps.view(&[1], &[], i * timesteps.nb()[0]);
        let sem = self.semantic.forward(g, timestep_embedding(one(0), TIME_IN_DIM as i32, 10000, 1.0));
        let tex = self.texture.forward(g, timestep_embedding(one(1), TIME_IN_DIM as i32, 10000, 1.0));
        sem.concat(tex, 0)
    }
}
