//! `rpc-server`: serves this machine's ggml devices to libstable-diffusion contexts on other
//! hosts (`rpc_servers=host:port`), with ggml's RPC protocol. Our own front end to ggml's
//! server function, with the options of ggml's program.

use std::process::ExitCode;

const USAGE: &str = "usage: rpc-server [-H HOST] [-p PORT] [-d DEV[,DEV...]] [-t THREADS] [-c CACHE_DIR]
  -H HOST     address to listen on (default 127.0.0.1; 0.0.0.0 exposes the devices to the network,
              and the protocol has no authentication: only do so on a trusted network)
  -p PORT     port (default 50052)
  -d DEVS     devices to serve, by name (default: the best local device; see sd-cli --list-devices)
  -t THREADS  CPU threads (default: physical cores)
  -c DIR      keep large tensors received in DIR and reuse them across connections";

fn main() -> ExitCode {
    let mut host = "127.0.0.1".to_string();
    let mut port = "50052".to_string();
    let mut devices = Vec::new();
    let mut threads = stable_diffusion::graph::backend::physical_cores().max(1) as usize;
    let mut cache = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| match args.next() {
            Some(v) => Ok(v),
            None => Err(format!("{name} needs a value")),
        };
        let r = match a.as_str() {
            "-H" | "--host" => value(&a).map(|v| host = v),
            "-p" | "--port" => value(&a).map(|v| port = v),
            "-d" | "--device" => value(&a).map(|v| devices.extend(v.split(',').map(|d| d.trim().to_string()).filter(|d| !d.is_empty()))),
            "-t" | "--threads" => value(&a).and_then(|v| v.parse().map(|n| threads = n).map_err(|_| format!("bad thread count '{v}'"))),
            "-c" | "--cache" => value(&a).map(|v| cache = Some(v)),
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => Err(format!("unknown option '{other}'")),
        };
        if let Err(e) = r {
            eprintln!("rpc-server: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    let endpoint = format!("{host}:{port}");
    match stable_diffusion::graph::devices::serve_rpc(&endpoint, &devices, threads, cache.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rpc-server: {e}");
            ExitCode::FAILURE
        }
    }
}
