//! The page served at `/`: a prompt box, a few settings and the picture, in plain HTML and
//! JavaScript on the native API (no build step, nothing fetched from elsewhere).
//! `/?prompt=...&width=64&height=64&steps=1&autogen=1` fills the fields and generates once
//! through `/sdapi/v1/txt2img` (one request, no polling: what a headless browser's
//! screenshot waits for).

pub const INDEX_HTML: &str = include_str!("index.html");
