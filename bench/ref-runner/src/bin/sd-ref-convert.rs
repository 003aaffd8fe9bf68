//! Converts a model with the reference's own `convert()` (diffusion-rs-sys), e.g. to make
//! `sd1_ref_q8_0.gguf`, the file `golden/sd1-gguf/` was rendered from, for the parity test
//! `tests/parity_gguf.rs`:
//!
//!   sd-ref-convert INPUT OUTPUT TYPE        (TYPE as the reference names it: q8_0, f16, ...)

use diffusion_rs_sys as sys;
use std::ffi::CString;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, ty] = args.as_slice() else {
        eprintln!("usage: sd-ref-convert INPUT OUTPUT TYPE");
        return ExitCode::from(2);
    };
    let (Ok(input), Ok(output), Ok(ty_name), Ok(empty)) =
        (CString::new(input.as_str()), CString::new(output.as_str()), CString::new(ty.as_str()), CString::new(""))
    else {
        eprintln!("arguments must not contain NUL bytes");
        return ExitCode::from(2);
    };
    // SAFETY: NUL-terminated strings that outlive the calls. This reference version throws a
    // C++ exception on NULL strings, so the optional ones are passed empty.
    let ok = unsafe {
        let sd_type = sys::str_to_sd_type(ty_name.as_ptr());
        if sd_type == sys::sd_type_t::SD_TYPE_COUNT {
            eprintln!("unknown type {ty:?}");
            return ExitCode::from(2);
        }
        sys::convert(input.as_ptr(), empty.as_ptr(), output.as_ptr(), sd_type, empty.as_ptr(), false)
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("convert failed");
        ExitCode::FAILURE
    }
}
