//! Generation extensions (the reference's `GenerationExtension`): networks loaded with the
//! context that act on a request through hooks instead of being wired into the pipeline.
//! PhotoMaker, PuLID, the IP-Adapter and the ControlNet use the hooks here; the sampling loop
//! knows none of them by name:
//!
//! - [`Extension::loras`]: LoRAs its file carries, in effect for every request (before the
//!   request's own);
//! - [`Extension::prepare`]: before the request's prompts are encoded, with the conditioner
//!   in its phase: it may prepare a condition of its own and rewrite the prompt text;
//! - [`Extension::conditioned`]: once the prompt's condition is encoded (the IP-Adapter
//!   encodes its image here);
//! - [`Extension::begin_run`] / [`Extension::end_run`]: around each sampling run (a stage;
//!   the ControlNet runs its hint blocks once per run);
//! - [`Extension::residuals`]: per model evaluation, residuals the UNet adds (ControlNet);
//! - [`Extension::image_tokens`]: image tokens the cross-attentions read (IP-Adapter);
//! - [`Extension::step_condition`]: per sampling step, a condition the prompt's pass uses
//!   instead of the plain one (the first extension that gives one wins, as in the reference);
//! - [`Extension::identity`]: an identity embedding every pass of the diffusion model reads
//!   (PuLID's, for Flux);
//! - [`Extension::end_request`]: the request's state is dropped.
//!
//! An extension also says whether it reads the request's control image and checks that its
//! file did not change ([`Extension::validate`]).

use super::conditioning::Conditioner;
use crate::error::Result;
use crate::graph::Components;
use crate::models::Condition;
use crate::params::{ImgGenParams, Lora};
use crate::tensor::Tensor;

/// What an extension sees of a request before its prompts are encoded.
pub struct ExtRequest<'a> {
    pub cond: &'a mut dyn Conditioner,
    pub params: &'a ImgGenParams,
    /// The prompt the request's condition will be encoded from (an extension may rewrite it).
    pub text: String,
    pub clip_skip: i32,
    pub width: usize,
    pub height: usize,
    /// Sampling steps of the request (before img2img's strength cut: the reference's total).
    pub total_steps: usize,
    /// The request's control image `[W, H, 3, 1]` in [0, 1] at the request's size.
    pub control_image: Option<&'a Tensor>,
}

/// What an extension sees once the prompt's condition is encoded.
pub struct Conditioned<'a> {
    pub cond: &'a Condition,
    pub params: &'a ImgGenParams,
}

pub trait Extension: Components + Send {
    fn name(&self) -> &'static str;

    /// The file the extension was loaded from, for messages.
    fn file(&self) -> Option<&str> {
        None
    }

    fn loras(&self) -> Vec<Lora> {
        Vec::new()
    }

    fn prepare(&mut self, _req: &mut ExtRequest<'_>) -> Result<()> {
        Ok(())
    }

    fn conditioned(&mut self, _req: &Conditioned<'_>) -> Result<()> {
        Ok(())
    }

    /// Whether a control image given with a request is read (a ControlNet).
    fn reads_control_image(&self) -> bool {
        false
    }

    /// Fails, naming the file, when the extension's file changed since it was opened.
    fn validate(&self) -> Result<()> {
        Ok(())
    }

    fn begin_run(&mut self) -> Result<()> {
        Ok(())
    }

    fn end_run(&mut self) {}

    /// Residuals for the evaluation of `x` (the scaled noisy latent) under `cond`.
    fn residuals(&mut self, _x: &Tensor, _timesteps: &[f32], _cond: &Condition) -> Result<Option<Vec<Tensor>>> {
        Ok(None)
    }

    /// Image tokens and their strength for the prompt's passes (`negative` false) or the
    /// negative and image-unconditioned ones.
    fn image_tokens(&self, _negative: bool) -> Option<(&Tensor, f32)> {
        None
    }

    fn step_condition(&self, _step: i32) -> Option<&Condition> {
        None
    }

    fn identity(&self) -> Option<(&Tensor, f32)> {
        None
    }

    fn end_request(&mut self) {}
}

/// The condition the prompt's pass of `step` uses: the first extension's, else `plain`.
pub fn step_condition<'c>(extensions: &'c [Box<dyn Extension>], step: i32, plain: &'c Condition) -> &'c Condition {
    extensions.iter().find_map(|e| e.step_condition(step)).unwrap_or(plain)
}

/// The identity embedding and weight the diffusion passes read: the first extension's.
pub fn identity(extensions: &[Box<dyn Extension>]) -> Option<(&Tensor, f32)> {
    extensions.iter().find_map(|e| e.identity())
}

/// The image tokens a pass reads: the first extension's.
pub fn image_tokens(extensions: &[Box<dyn Extension>], negative: bool) -> Option<(&Tensor, f32)> {
    extensions.iter().find_map(|e| e.image_tokens(negative))
}

/// The residuals of one evaluation: the first extension's that gives some.
pub fn residuals(extensions: &mut [Box<dyn Extension>], x: &Tensor, timesteps: &[f32], cond: &Condition) -> Result<Option<Vec<Tensor>>> {
    for e in extensions.iter_mut() {
        if let Some(r) = e.residuals(x, timesteps, cond)? {
            return Ok(Some(r));
        }
    }
    Ok(None)
}

/// Begins a sampling run on every extension; on failure the ones begun are ended again.
pub fn begin_run(extensions: &mut [Box<dyn Extension>]) -> Result<()> {
    for i in 0..extensions.len() {
        if let Err(e) = extensions[i].begin_run() {
            end_run(&mut extensions[..i]);
            return Err(e);
        }
    }
    Ok(())
}

pub fn end_run(extensions: &mut [Box<dyn Extension>]) {
    extensions.iter_mut().for_each(|e| e.end_run());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Component;

    /// Records its hooks; gives residuals and tokens when told to.
    struct Probe {
        name: &'static str,
        fail_begin: bool,
        residual: Option<f32>,
        tokens: Option<Tensor>,
        log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    }

    impl Probe {
        fn new(name: &'static str, log: &std::sync::Arc<std::sync::Mutex<Vec<String>>>) -> Probe {
            Probe { name, fail_begin: false, residual: None, tokens: None, log: log.clone() }
        }
    }

    impl Components for Probe {
        fn components(&mut self) -> Vec<&mut dyn Component> {
            Vec::new()
        }
    }

    impl Extension for Probe {
        fn name(&self) -> &'static str {
            self.name
        }
        fn begin_run(&mut self) -> Result<()> {
            self.log.lock().unwrap().push(format!("begin {}", self.name));
            ensure!(!self.fail_begin, "{} cannot begin", self.name);
            Ok(())
        }
        fn end_run(&mut self) {
            self.log.lock().unwrap().push(format!("end {}", self.name));
        }
        fn residuals(&mut self, _x: &Tensor, _t: &[f32], _c: &Condition) -> Result<Option<Vec<Tensor>>> {
            Ok(self.residual.map(|v| vec![Tensor::full(&[1], v)]))
        }
        fn image_tokens(&self, negative: bool) -> Option<(&Tensor, f32)> {
            self.tokens.as_ref().map(|t| (t, if negative { 0.0 } else { 1.0 }))
        }
    }

    #[test]
    fn a_failed_begin_ends_the_runs_already_begun() {
        let log = Default::default();
        let mut b = Probe::new("b", &log);
        b.fail_begin = true;
        let mut exts: Vec<Box<dyn Extension>> = vec![Box::new(Probe::new("a", &log)), Box::new(b), Box::new(Probe::new("c", &log))];
        let err = begin_run(&mut exts).unwrap_err();
        assert!(err.to_string().contains("b cannot begin"), "{err}");
        assert_eq!(*log.lock().unwrap(), ["begin a", "begin b", "end a"]);
    }

    #[test]
    fn the_first_extension_that_gives_an_input_wins() {
        let log = Default::default();
        let mut second = Probe::new("second", &log);
        second.residual = Some(2.0);
        second.tokens = Some(Tensor::full(&[1], 5.0));
        let mut third = Probe::new("third", &log);
        third.residual = Some(3.0);
        let mut exts: Vec<Box<dyn Extension>> = vec![Box::new(Probe::new("first", &log)), Box::new(second), Box::new(third)];
        let x = Tensor::zeros(&[1]);
        let r = residuals(&mut exts, &x, &[0.0], &Condition::default()).unwrap().unwrap();
        assert_eq!(r[0].data(), &[2.0]);
        assert_eq!(image_tokens(&exts, true).map(|(t, s)| (t.data()[0], s)), Some((5.0, 0.0)));
        assert_eq!(image_tokens(&exts, false).map(|(_, s)| s), Some(1.0));
        assert!(residuals(&mut exts[..1], &x, &[0.0], &Condition::default()).unwrap().is_none());
    }
}
