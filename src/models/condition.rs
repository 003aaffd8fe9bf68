//! What a conditioner hands the diffusion model: the reference's `SDCondition`. Every field
//! is optional; each family fills what its diffusion model reads.

use crate::tensor::Tensor;

#[derive(Clone, Debug, Default)]
pub struct Condition {
    /// Cross-attention context `[dim, tokens, 1]`.
    pub crossattn: Option<Tensor>,
    /// Vector conditioning `[dim]` (SDXL's label embedding input `y`); for Wan I2V / FLF2V the
    /// CLIP-vision hidden states `[1280, 257 or 514, 1]` its image embedder reads.
    pub vector: Option<Tensor>,
    /// Latent channels concatenated to the noisy latent `[W, H, C, 1]` (inpainting, edit), or
    /// `[W, H, T, C, 1]` for video (Wan I2V: 4 mask channels then the encoded frames).
    pub concat: Option<Tensor>,
    /// A second text context `[dim, tokens, 1]`: HunyuanVideo's ByT5 hidden states of the
    /// prompt's quoted text (the reference's `extra_c_crossattns[0]`).
    pub extra_context: Option<Tensor>,
    /// Per token of `crossattn`: 1 text, 0 a picture's (its embeddings with the vision
    /// markers around them); MiniMax-H3 modulates the two kinds apart (the reference's
    /// `c_token_types`). None: all text.
    pub token_types: Option<Vec<i32>>,
}

impl Condition {
    pub fn is_empty(&self) -> bool {
        self.crossattn.is_none() && self.vector.is_none() && self.concat.is_none() && self.extra_context.is_none()
    }
}
