//! Image upscaling networks, like the reference's `src/model/upscaler/`.

pub mod esrgan;
