//! Helpers shared by the integration tests.

use sd_cli::args::{parse, Opts, Parsed};
use stable_diffusion::types::{SampleMethod, Scheduler};

/// Parsed and resolved options, with what the program takes from the loaded model when the
/// request leaves them unset.
pub fn opts(argv: &[&str]) -> Opts {
    let Ok(Parsed::Run(mut o)) = parse(argv) else { panic!("{argv:?}") };
    o.resolve(&|_| None).unwrap();
    let sp = &mut o.gen.params.sample_params;
    sp.sample_method.get_or_insert(SampleMethod::EulerA);
    sp.scheduler.get_or_insert(Scheduler::Discrete);
    *o
}
