//! sd-server: serves one loaded model over HTTP (see the README).

fn main() -> std::process::ExitCode {
    let program = std::env::args_os().next().map(|p| p.to_string_lossy().into_owned()).unwrap_or_else(|| "sd-server".into());
    let argv: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    // Nothing unwinds out of the program: a panic is reported and the exit status is 1.
    std::panic::catch_unwind(|| sd_server::main_with_args(&program, &argv)).unwrap_or_else(|_| {
        eprintln!("[ERROR] sd-server: internal error (panic); stopping");
        std::process::ExitCode::FAILURE
    })
}
