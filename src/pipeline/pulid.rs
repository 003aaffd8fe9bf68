//! PuLID as a generation extension (the reference's `pulid_extension.cpp`), for Flux models
//! whose weights carry PuLID's identity modules (`pulid_weights_path`).
//!
//! Each request reads its identity embedding from `pulid_params.id_embedding_path` (a GGUF
//! file's `pulid_id` tensor) and every diffusion pass reads it, scaled by `id_weight`; the
//! prompt and its condition are left alone. Like the reference, a request without an
//! embedding file, or with one that cannot be read or has no usable `pulid_id` tensor, runs
//! without identity (with the reference's warning). An embedding of another width than the
//! modules' 2048 aborts the reference; here the request fails naming the widths.

use super::extensions::{ExtRequest, Extension};
use crate::error::Result;
use crate::graph::{Component, Components};
use crate::models::adapter::pulid::{self, ID_DIM};
use crate::tensor::Tensor;

#[derive(Default)]
pub struct Pulid {
    /// The request's embedding `[2048, tokens, 1]` and weight.
    identity: Option<(Tensor, f32)>,
}

impl Extension for Pulid {
    fn name(&self) -> &'static str {
        "pulid"
    }

    fn prepare(&mut self, req: &mut ExtRequest<'_>) -> Result<()> {
        self.end_request();
        let params = &req.params.pulid_params;
        let Some(path) = params.id_embedding_path.as_deref().filter(|p| !p.is_empty()) else {
            return Ok(());
        };
        let Some(embedding) = pulid::read_id_embedding(path) else {
            return Ok(());
        };
        ensure!(
            embedding.ne(0) as i64 == ID_DIM,
            "the PuLID identity embedding in '{path}' is {} wide, PuLID's modules take {ID_DIM} (stable-diffusion.cpp aborts here)",
            embedding.ne(0)
        );
        self.identity = Some((embedding, params.id_weight));
        Ok(())
    }

    fn identity(&self) -> Option<(&Tensor, f32)> {
        self.identity.as_ref().map(|(t, w)| (t, *w))
    }

    fn end_request(&mut self) {
        self.identity = None;
    }
}

/// PuLID's modules live in the diffusion model; the extension holds no network of its own.
impl Components for Pulid {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        Vec::new()
    }
}
