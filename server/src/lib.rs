//! sd-server: one loaded model served over HTTP with the reference server's three APIs
//! (OpenAI-style `/v1`, WebUI-compatible `/sdapi/v1`, native `/sdcpp/v1`) and a page at `/`.
//! A library so that its parts are tested directly; `main.rs` is the program.

pub mod jobs;
pub mod options;
pub mod page;
#[macro_use]
pub mod request;
pub mod routes;

use std::process::ExitCode;
use std::sync::Arc;

use sd_cli::args;
use sd_cli::term;
use stable_diffusion::api::Context;
use stable_diffusion::{sd_debug, sd_error, sd_info};

use crate::options::Command;

fn report(message: &str) {
    for line in message.lines() {
        sd_error!("{line}");
    }
}

/// Runs the program with `argv` (without the program name); returns when the server stops.
pub fn main_with_args(program: &str, argv: &[String]) -> ExitCode {
    term::install_log_sink();
    let (server_opts, mut opts) = match options::parse(argv) {
        Ok(Command::Serve(s, o)) => (s, o),
        Ok(Command::Help) => {
            print!("{}", options::usage(program));
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("{}", args::version_string());
            return ExitCode::SUCCESS;
        }
        Ok(Command::ListDevices) => {
            print!("{}", stable_diffusion::graph::backend::device_listing());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            report(&format!("error: {e}"));
            print!("{}", options::usage(program));
            return ExitCode::FAILURE;
        }
    };
    term::set_verbosity(server_opts.verbose, server_opts.color);
    if let Err(e) = options::resolve_defaults(&mut opts, &|k| std::env::var(k).ok()) {
        report(&format!("error: {e}"));
        print!("{}", options::usage(program));
        return ExitCode::FAILURE;
    }
    if let Some(model) = &opts.ctx.default_model {
        sd_info!("no --model given: using the default model '{}' (set {} to change it)", model.display(), args::DEFAULT_MODEL_ENV);
    }
    sd_debug!("{}", args::version_string());
    sd_debug!("{}", stable_diffusion::graph::backend::system_info());
    sd_debug!("{server_opts:#?}");
    let ctx = match Context::new(&opts.ctx_params()) {
        Ok(c) => c,
        Err(e) => {
            report(&format!("new_sd_ctx_t failed: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            report(&format!("cannot start the HTTP runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let server = jobs::Server::new(ctx, *opts, server_opts.limits.clone());
    let worker = jobs::start_worker(&server);
    let app = Arc::new(routes::App { server: Arc::clone(&server), html_path: server_opts.serve_html_path.clone() });
    let result = runtime.block_on(serve(app, &server_opts.listen_ip, server_opts.listen_port));
    server.stop();
    let _ = worker.join();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::FAILURE
        }
    }
}

/// Listens until Ctrl-C or SIGTERM. The address actually bound (a port of 0 picks a free
/// one) is printed on stdout as `listening on: http://IP:PORT`.
async fn serve(app: Arc<routes::App>, ip: &str, port: u16) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind((ip, port)).await.map_err(|e| format!("cannot listen on {ip}:{port}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    sd_info!("listening on: http://{addr}");
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on: http://{addr}");
        let _ = out.flush();
    }
    axum::serve(listener, routes::router(app)).with_graceful_shutdown(shutdown()).await.map_err(|e| format!("server error: {e}"))
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    sd_info!("shutting down");
}
