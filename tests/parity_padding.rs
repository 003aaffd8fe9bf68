//! Golden parity of two convolution switches through the C ABI: circular padding
//! (`circular_x` / `circular_y`: `golden/circular/`, SD 1.x with img2img and a tiled VAE,
//! Flux, Z-Image and Flux.2 klein, whose patch embedding pads and rope positions wrap) and
//! the direct convolutions (`diffusion_conv_direct` / `vae_conv_direct`: `golden/conv-direct/`).
//! Without `SD_PARITY=full` one case of each folder runs.

mod common;

use common::parity::{full, report, run};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn circular_padding() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("circular", |c| full() || c.name == "sd1_circular_xy"));
}

#[test]
fn direct_convolutions() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    report(&run("conv-direct", |c| full() || c.name == "sd1_vae_conv_direct"));
}
