//! A network together with the store holding its weights and the runner computing its
//! graphs: the unit every model component of a pipeline is made of.

use super::params::ParamStore;
use super::runner::Runner;

/// A network `M` whose weight handles point into `store`: keeping them in one value ties
/// the handles' validity to the store's lifetime.
pub struct Loaded<M> {
    pub model: M,
    store: ParamStore,
    pub runner: Runner,
}

impl<M> Loaded<M> {
    /// `model` must have been declared in `store`.
    pub fn new(model: M, store: ParamStore, runner: Runner) -> Loaded<M> {
        Loaded { model, store, runner }
    }

    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The weights, for in-place patching (e.g. merging a LoRA).
    pub fn store_mut(&mut self) -> &mut ParamStore {
        &mut self.store
    }

    /// Model and runner at once (a graph needs `&model` while the runner is borrowed mutably).
    pub fn parts(&mut self) -> (&M, &mut Runner) {
        (&self.model, &mut self.runner)
    }
}
