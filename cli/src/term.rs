//! What sd-cli prints while it works: log lines with `[INFO ]`-style tags and the progress bar.
//!
//! Like the reference program, messages go to stdout and errors to stderr; debug messages only
//! with `-v`. The progress bar is drawn on stderr from the library's progress callback.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use stable_diffusion::types::LogLevel;

static VERBOSE: AtomicBool = AtomicBool::new(false);
static COLOR: AtomicBool = AtomicBool::new(false);
/// Set in metadata mode, whose report owns stdout: every message goes to stderr.
static ALL_TO_STDERR: AtomicBool = AtomicBool::new(false);

/// The tag printed before a message, padded to five characters.
pub fn tag(level: LogLevel, color: bool) -> String {
    let (name, code) = match level {
        LogLevel::Debug => ("DEBUG", 37),
        LogLevel::Info => ("INFO", 34),
        LogLevel::Warn => ("WARN", 35),
        LogLevel::Error => ("ERROR", 31),
    };
    if color {
        format!("\x1b[{code};1m[{name:<5}]\x1b[0m ")
    } else {
        format!("[{name:<5}] ")
    }
}

/// Formats one message as it is printed, or `None` when it is filtered out.
pub fn format_log(level: LogLevel, text: &str, verbose: bool, color: bool) -> Option<String> {
    if level == LogLevel::Debug && !verbose {
        return None;
    }
    let mut line = tag(level, color);
    line.push_str(text);
    if !line.ends_with('\n') {
        line.push('\n');
    }
    Some(line)
}

fn print_log(level: LogLevel, text: &str) {
    let Some(line) = format_log(level, text, VERBOSE.load(Ordering::Relaxed), COLOR.load(Ordering::Relaxed)) else { return };
    if level == LogLevel::Error || ALL_TO_STDERR.load(Ordering::Relaxed) {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(line.as_bytes());
        let _ = err.flush();
    } else {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(line.as_bytes());
        let _ = out.flush();
    }
}

/// Routes the library's messages (and sd-cli's own, which use the same macros) to the terminal.
pub fn install_log_sink() {
    stable_diffusion::log::set_sink(Some(Arc::new(print_log)));
}

/// Sends every message to stderr, keeping stdout for a report (metadata mode).
pub fn log_to_stderr_only() {
    ALL_TO_STDERR.store(true, Ordering::Relaxed);
}

pub fn set_verbosity(verbose: bool, color: bool) {
    VERBOSE.store(verbose, Ordering::Relaxed);
    COLOR.store(color, Ordering::Relaxed);
}

/// `  |=====>    | 3/20 - 1.25s/it`: a 50-character bar, then the speed (iterations per
/// second when a step takes less than a second).
pub fn progress_line(step: i32, steps: i32, seconds: f32) -> String {
    const WIDTH: i32 = 50;
    let filled = if steps > 0 { (step as f32 * WIDTH as f32 / steps as f32) as i32 } else { 0 };
    let bar: String = (0..WIDTH)
        .map(|i| match i.cmp(&filled) {
            std::cmp::Ordering::Greater => ' ',
            std::cmp::Ordering::Equal if i != WIDTH - 1 => '>',
            _ => '=',
        })
        .collect();
    let (speed, unit) = if seconds > 0.0 && seconds < 1.0 { (1.0 / seconds, "it/s") } else { (seconds, "s/it") };
    format!("  |{bar}| {step}/{steps} - {speed:.2}{unit}")
}

/// Installs the progress callback that redraws the bar in place (a new line after the last
/// step). Step 0 only announces a phase and draws nothing.
pub fn install_progress_bar() {
    let tty = std::io::stderr().is_terminal();
    stable_diffusion::pipeline::callbacks::set_progress(Some(Arc::new(move |step: i32, steps: i32, seconds: f32| {
        if step == 0 {
            return;
        }
        let clear = if tty { "\x1b[K" } else { "" };
        let end = if step == steps { "\n" } else { "" };
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{}{clear}{end}", progress_line(step, steps, seconds));
        let _ = err.flush();
    })));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_filtering() {
        assert_eq!(format_log(LogLevel::Info, "a.rs:1 - hi", false, false).as_deref(), Some("[INFO ] a.rs:1 - hi\n"));
        assert_eq!(format_log(LogLevel::Debug, "x\n", false, false), None);
        assert_eq!(format_log(LogLevel::Debug, "x\n", true, false).as_deref(), Some("[DEBUG] x\n"));
        assert_eq!(format_log(LogLevel::Error, "e\n", false, true).as_deref(), Some("\x1b[31;1m[ERROR]\x1b[0m e\n"));
    }

    #[test]
    fn progress_bar_shape() {
        let half = progress_line(10, 20, 2.5);
        assert_eq!(half, format!("  |{}>{}| 10/20 - 2.50s/it", "=".repeat(25), " ".repeat(24)));
        let done = progress_line(4, 4, 0.25);
        assert_eq!(done, format!("  |{}| 4/4 - 4.00it/s", "=".repeat(50)));
        assert!(progress_line(1, 3, 0.0).ends_with(" 1/3 - 0.00s/it"));
    }
}
