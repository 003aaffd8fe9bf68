//! sd-cli: the command-line front end of libstable-diffusion.
//!
//! For now it reports what the library is and which devices it sees, through the same
//! C API a C program uses (the exported `sd_*` functions); image generation comes later.

use std::ffi::{c_char, CStr};

// The public C API (stable-diffusion.h), linked from the stable-diffusion crate.
extern "C" {
    fn sd_version() -> *const c_char;
    fn sd_commit() -> *const c_char;
    fn sd_get_system_info() -> *const c_char;
    fn sd_get_num_physical_cores() -> i32;
    fn sd_list_devices(buffer: *mut c_char, buffer_size: usize) -> usize;
}

// Keeps the library crate (which defines the symbols above) in the link.
use stable_diffusion as _;

fn text(p: *const c_char) -> String {
    if p.is_null() {
        return "(null)".into();
    }
    // SAFETY: the library returns NUL-terminated static strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn devices() -> String {
    // SAFETY: a NULL buffer asks for the size; then a buffer of size + 1 receives the text.
    unsafe {
        let need = sd_list_devices(std::ptr::null_mut(), 0);
        let mut buf = vec![0u8; need + 1];
        sd_list_devices(buf.as_mut_ptr().cast(), buf.len());
        CStr::from_bytes_until_nul(&buf).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("usage: sd-cli [--version]\n\nPrints the library version, commit, system info and devices.");
        return;
    }
    // SAFETY: plain calls into the C API.
    let (version, commit) = unsafe { (text(sd_version()), text(sd_commit())) };
    if args.iter().any(|a| a == "-v" || a == "--version") {
        println!("sd-cli {version} (commit {commit})");
        return;
    }
    println!("libstable-diffusion {version} (commit {commit})");
    // SAFETY: plain calls into the C API.
    let (info, cores) = unsafe { (text(sd_get_system_info()), sd_get_num_physical_cores()) };
    println!("{}", info.trim_end());
    println!("physical cores: {cores}");
    println!("devices:");
    for line in devices().lines() {
        let (name, desc) = line.split_once('\t').unwrap_or((line, ""));
        println!("  {name:<12} {desc}");
    }
}
