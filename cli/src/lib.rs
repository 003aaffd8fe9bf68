//! sd-cli, the command-line front end of libstable-diffusion, as a library so that its parts
//! are tested directly; `main.rs` is the program.

pub mod args;
pub mod avi;
pub mod image_io;
pub mod inspect;
pub mod jpeg;
pub mod metadata;
pub mod output;
pub mod run;
pub mod term;
