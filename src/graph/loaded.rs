//! A network together with the store holding its weights, where it computes and the runner
//! computing its graphs: the unit every model component of a pipeline is made of.

use super::backend::Backend;
use super::devices::Placement;
use super::params::ParamStore;
use super::runner::Runner;
use crate::error::Result;
use std::sync::Arc;

/// Where a component's weights can be (re)read from: the model files, for weights that do
/// not stay on a device between phases (`params_backend=disk`).
pub trait WeightSource: Send + Sync {
    /// Allocates `store` on `backend` and fills every declared tensor.
    fn load(&self, store: &mut ParamStore, backend: &Backend, what: &str, threads: usize) -> Result<()>;
}

/// One loaded network, as the pipeline drives it: a runner and phase hooks around each use
/// (weights uploaded or read for the phase, compute buffer and phase copies freed after).
pub trait Component: Send {
    fn runner(&mut self) -> &mut Runner;
    fn begin(&mut self) -> Result<()>;
    fn end(&mut self);
    /// The weights with where they live and the runner computing with them, for code that
    /// changes them between phases (LoRAs merged in, or applied by the runner's adapter).
    fn weights_mut(&mut self) -> WeightsMut<'_>;
}

/// A component's weights as [`Component::weights_mut`] lends them.
pub struct WeightsMut<'a> {
    pub store: &'a mut ParamStore,
    pub placement: &'a Placement,
    pub runner: &'a mut Runner,
    /// The component's name, for messages.
    pub what: &'static str,
}

/// A network `M` whose weight handles point into `store`: keeping them in one value ties
/// the handles' validity to the store's lifetime.
pub struct Loaded<M> {
    pub model: M,
    store: ParamStore,
    pub placement: Placement,
    source: Option<Arc<dyn WeightSource>>,
    what: &'static str,
    pub runner: Runner,
}

impl<M> Loaded<M> {
    /// `model` must have been declared in `store`; `source` re-reads the weights of a
    /// placement whose weights live on disk.
    pub fn new(model: M, store: ParamStore, placement: Placement, runner: Runner, source: Option<Arc<dyn WeightSource>>, what: &'static str) -> Loaded<M> {
        Loaded { model, store, placement, source, what, runner }
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

    /// `f` on the model and runner with the weights usable: inside a phase as they are,
    /// outside one in a phase of its own (the weights read for the call and freed after).
    /// The compute buffer is released after either way.
    pub fn run_in_phase<R>(&mut self, f: impl FnOnce(&M, &mut Runner) -> Result<R>) -> Result<R>
    where
        M: Send,
    {
        let own_phase = !self.store.is_allocated();
        if own_phase {
            Component::begin(self)?;
        }
        let result = f(&self.model, &mut self.runner);
        self.runner.release();
        if own_phase {
            Component::end(self);
        }
        result
    }
}

impl<M: Send> Component for Loaded<M> {
    fn runner(&mut self) -> &mut Runner {
        &mut self.runner
    }

    /// Makes the weights usable on the compute device (see `ParamStore::begin_phase`).
    fn begin(&mut self) -> Result<()> {
        let threads = self.runner.n_threads().max(1) as usize;
        let (source, what) = (self.source.clone(), self.what);
        self.store.begin_phase(&self.placement, |store, b| match &source {
            Some(s) => s.load(store, b, what, threads),
            None => bail!("{what}: no model files to read the weights from"),
        })
    }

    /// Frees the compute buffer and any phase copy of the weights.
    fn end(&mut self) {
        self.runner.release();
        self.store.end_phase(&self.placement);
    }

    fn weights_mut(&mut self) -> WeightsMut<'_> {
        WeightsMut { store: &mut self.store, placement: &self.placement, runner: &mut self.runner, what: self.what }
    }
}

/// What the pipeline's stages (conditioner, diffusion model, first stage) share: their loaded
/// networks, driven together.
pub trait Components {
    fn components(&mut self) -> Vec<&mut dyn Component>;

    fn runners(&mut self) -> Vec<&mut Runner> {
        self.components().into_iter().map(|c| c.runner()).collect()
    }

    /// Begins a phase on every network (on failure the ones begun are ended again).
    fn begin(&mut self) -> Result<()> {
        let mut comps = self.components();
        for i in 0..comps.len() {
            if let Err(e) = comps[i].begin() {
                comps[..i].iter_mut().for_each(|c| c.end());
                return Err(e);
            }
        }
        Ok(())
    }

    fn end(&mut self) {
        for c in self.components() {
            c.end();
        }
    }
}

impl<M: Send> Components for Loaded<M> {
    fn components(&mut self) -> Vec<&mut dyn Component> {
        vec![self]
    }
}
