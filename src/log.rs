//! Diagnostics go through one sink so the C log callback sees every message.
//!
//! Messages are formatted like the reference's (`file:line - text\n`). With no sink
//! installed they go to stderr (debug messages only when `SD_LOG_DEBUG` is set).

use crate::types::LogLevel;
use parking_lot::RwLock;
use std::sync::Arc;

pub type Sink = Arc<dyn Fn(LogLevel, &str) + Send + Sync>;

static SINK: RwLock<Option<Sink>> = RwLock::new(None);

/// Installs (or, with `None`, removes) the process-wide log sink.
pub fn set_sink(sink: Option<Sink>) {
    *SINK.write() = sink;
}

/// Formats and delivers one message. Never panics, even if the sink does.
pub fn emit(level: LogLevel, file: &str, line: u32, msg: std::fmt::Arguments<'_>) {
    let base = file.rsplit(['/', '\\']).next().unwrap_or(file);
    let mut text = format!("{base}:{line:<4} - {msg}");
    if !text.ends_with('\n') {
        text.push('\n');
    }
    let sink = SINK.read().clone();
    match sink {
        Some(sink) => {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(level, &text)));
        }
        None => {
            if level == LogLevel::Debug && std::env::var_os("SD_LOG_DEBUG").is_none() {
                return;
            }
            let tag = match level {
                LogLevel::Debug => "DEBUG",
                LogLevel::Info => "INFO ",
                LogLevel::Warn => "WARN ",
                LogLevel::Error => "ERROR",
            };
            eprint!("[{tag}] {text}");
        }
    }
}

#[macro_export]
macro_rules! sd_log {
    ($level:expr, $($arg:tt)*) => {
        $crate::log::emit($level, file!(), line!(), format_args!($($arg)*))
    };
}
#[macro_export]
macro_rules! sd_debug { ($($arg:tt)*) => { $crate::sd_log!($crate::types::LogLevel::Debug, $($arg)*) }; }
#[macro_export]
macro_rules! sd_info { ($($arg:tt)*) => { $crate::sd_log!($crate::types::LogLevel::Info, $($arg)*) }; }
#[macro_export]
macro_rules! sd_warn { ($($arg:tt)*) => { $crate::sd_log!($crate::types::LogLevel::Warn, $($arg)*) }; }
#[macro_export]
macro_rules! sd_error { ($($arg:tt)*) => { $crate::sd_log!($crate::types::LogLevel::Error, $($arg)*) }; }
