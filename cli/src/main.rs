//! sd-cli: generates images with libstable-diffusion from the command line, accepting the
//! reference stable-diffusion.cpp program's options.

use std::process::ExitCode;

use sd_cli::args::{self, Parsed};
use sd_cli::{run, term};
use stable_diffusion::sd_error;

/// Version, system information and devices (what `--info` and a bare `sd-cli` print).
fn print_info() {
    println!("{}", args::version_string());
    let backend = stable_diffusion::graph::backend::system_info();
    println!("{}", backend.trim_end());
    println!("physical cores: {}", stable_diffusion::graph::backend::physical_cores());
    println!("devices:");
    for line in stable_diffusion::graph::backend::device_listing().lines() {
        let (name, desc) = line.split_once('\t').unwrap_or((line, ""));
        println!("  {name:<12} {desc}");
    }
}

fn report(message: &str) {
    for line in message.lines() {
        sd_error!("{line}");
    }
}

fn main() -> ExitCode {
    term::install_log_sink();
    let program = std::env::args_os().next().map(|p| p.to_string_lossy().into_owned()).unwrap_or_else(|| "sd-cli".into());
    let argv: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    if argv.is_empty() {
        print_info();
        println!("\nUsage: {program} [options]   ({program} -h lists them)");
        return ExitCode::SUCCESS;
    }
    let mut opts = match args::parse(&argv) {
        Ok(Parsed::Run(opts)) => opts,
        Ok(Parsed::Help) => {
            print!("{}", args::usage(&program));
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            println!("{}", args::version_string());
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Info) => {
            print_info();
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::ListDevices) => {
            print!("{}", stable_diffusion::graph::backend::device_listing());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            report(&e.0);
            print!("{}", args::usage(&program));
            return ExitCode::FAILURE;
        }
    };
    term::set_verbosity(opts.cli.verbose, opts.cli.color);
    if opts.cli.mode == args::Mode::Metadata {
        term::log_to_stderr_only();
    }
    if let Err(e) = opts.resolve(&|k| std::env::var(k).ok()) {
        report(&format!("error: {e}"));
        print!("{}", args::usage(&program));
        return ExitCode::FAILURE;
    }
    term::install_progress_bar();
    match run::run(*opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::FAILURE
        }
    }
}
