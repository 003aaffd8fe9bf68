//! Runs one runner process and measures it from the outside: wall time, peak RSS and CPU
//! time of the child (`wait4`'s rusage), the machine's load average before and after.

use serde_json::{json, Value};
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The 1-minute load average.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Runs `exe args`, its stdout to `out_path`, its stderr to `err_path`; kills it after
/// `timeout`. Returns the runner's JSON report with the outside measurements added
/// (`wall_s`, `maxrss_kb`, `cpu_s`, `exit`, `load_before`, `load_after`).
pub fn run(exe: &Path, args: &[String], out_path: &Path, err_path: &Path, timeout: Duration) -> Value {
    let load_before = loadavg();
    let spawn = || -> std::io::Result<std::process::Child> {
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(File::create(out_path)?)
            .stderr(File::create(err_path)?)
            .spawn()
    };
    let start = Instant::now();
    let child = match spawn() {
        Ok(c) => c,
        Err(e) => return json!({"error": format!("starting {}: {e}", exe.display())}),
    };
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut timed_out = false;
    loop {
        // SAFETY: `pid` is our own child, not yet reaped (std's Child is never waited on).
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break;
        }
        if r < 0 {
            return json!({"error": format!("wait4: {}", std::io::Error::last_os_error())});
        }
        if start.elapsed() > timeout && !timed_out {
            timed_out = true;
            // SAFETY: signalling our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall_s = start.elapsed().as_secs_f64();
    let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    let exit = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -libc::WTERMSIG(status) };

    let stdout = std::fs::read_to_string(out_path).unwrap_or_default();
    let mut report: Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| json!({"error": "the runner printed no report"}));
    if timed_out {
        report["error"] = json!(format!("killed after {}s", timeout.as_secs()));
    } else if exit != 0 && report["error"].is_null() {
        report["error"] = json!(format!("exit status {exit}"));
    }
    if !report["error"].is_null() {
        // The last lines of stderr usually say why.
        let err = std::fs::read_to_string(err_path).unwrap_or_default();
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        report["stderr_tail"] = json!(tail.into_iter().rev().collect::<Vec<_>>());
    }
    report["wall_s"] = json!(wall_s);
    // The runner resets the kernel's high-water mark for the VAE decode (which `ru_maxrss`
    // then no longer covers) and reports the whole run's peak itself.
    report["maxrss_kb"] = json!(report["peak_rss_kb"].as_i64().map_or(usage.ru_maxrss, |p| p.max(usage.ru_maxrss)));
    report["cpu_s"] = json!(secs(usage.ru_utime) + secs(usage.ru_stime));
    report["exit"] = json!(exit);
    report["load_before"] = json!(load_before);
    report["load_after"] = json!(loadavg());
    report
}
