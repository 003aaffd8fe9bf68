//! Golden parity of SeFi-Image through the C ABI (`golden/sefi/`): the Flux.2 transformer
//! with two timesteps on 144-channel latents, Qwen3-VL's text model (1024 tokens), Flux.2's
//! VAE on the texture channels. Cases: cfg 1, the defaults (cfg 7), 96×64 with another seed,
//! cfg 3 with a negative prompt, `sefi_alpha` / `sefi_delta_t`, a named sampler and
//! scheduler (SeFi's own Euler and schedule run regardless), the hires fix in latent space,
//! a reference image kept out of the transformer; and what the reference crashes on (init
//! image, a reference image in the transformer, the hires fix re-encoding a picture), where
//! ours must fail cleanly. Components are separate files as users hold them.
//!
//! Without `SD_PARITY=full` one cfg-1 case runs.

mod common;

use common::parity::{full, report, run};

#[test]
fn sefi_quick_subset() {
    if full() {
        eprintln!("skipped: SD_PARITY=full runs every case in sefi_all_cases");
        return;
    }
    report(&run("sefi", |c| c.name == "sefi_cfg1"));
}

#[test]
fn sefi_all_cases() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let results = run("sefi", |_| true);
    // Where the reference crashes, ours refuses the request.
    for r in results.iter().filter(|r| r.note.starts_with("reference crashed")) {
        assert!(r.note.ends_with("false"), "{}: {}", r.name, r.note);
    }
    report(&results);
}

/// The cases `SD_SEFI_CASE=name[,name…]` names, for debugging.
#[test]
fn sefi_selected_cases() {
    let Ok(names) = std::env::var("SD_SEFI_CASE") else {
        eprintln!("skipped: set SD_SEFI_CASE=name[,name...]");
        return;
    };
    let names: Vec<&str> = names.split(',').collect();
    report(&run("sefi", |c| names.contains(&c.name.as_str())));
}
