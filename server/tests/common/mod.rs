//! What the sd-server suites share: the built program on a free loopback port, and an
//! HTTP client that returns every answer, errors included, as (status, JSON).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

pub struct Server {
    child: Child,
    pub base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn fixture_cache() -> PathBuf {
    std::env::var_os("SD_FIXTURE_CACHE").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sd-rs-fixtures"))
}

/// The default model, or None (with a notice) when it has not been made.
pub fn default_model() -> Option<PathBuf> {
    let model = std::env::var_os("SD_CLI_MODEL").map(PathBuf::from).unwrap_or_else(|| fixture_cache().join("sd1.safetensors"));
    if !model.is_file() {
        eprintln!("skipped: no default model at {} (scripts/fixtures.sh sd1 makes it)", model.display());
        return None;
    }
    Some(model)
}

/// Starts sd-server on a free port and waits for its `listening on:` line.
pub fn start(args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sd-server"))
        .args(["--listen-port", "0", "-t", "2"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("sd-server starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("listening on: ") {
                let _ = tx.send(url.to_string());
            }
        }
    });
    let base = rx.recv_timeout(Duration::from_secs(300)).expect("sd-server says where it listens");
    Server { child, base }
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(300)).build()
}

/// (status, body) of any answer, errors included.
pub fn answer(r: Result<ureq::Response, ureq::Error>) -> (u16, String) {
    match r {
        Ok(resp) => (resp.status(), resp.into_string().unwrap()),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap()),
        Err(e) => panic!("transport error: {e}"),
    }
}

pub fn json_of(status: u16, body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("status {status}: not JSON ({e}): {body}"))
}

pub fn get(base: &str, path: &str) -> (u16, Value) {
    let (s, b) = answer(agent().get(&format!("{base}{path}")).call());
    (s, json_of(s, &b))
}

pub fn post_raw(base: &str, path: &str, content_type: &str, body: &[u8]) -> (u16, Value) {
    let (s, b) = answer(agent().post(&format!("{base}{path}")).set("Content-Type", content_type).send_bytes(body));
    (s, json_of(s, &b))
}

pub fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    post_raw(base, path, "application/json", body.to_string().as_bytes())
}

