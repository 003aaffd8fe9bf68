//! The page at `/` in a real browser: headless Chromium loads it with `autogen=1`, the page
//! generates through the API, and the screenshot must show the very picture the API returns
//! for the same settings. Skipped with a notice when no Chromium is installed
//! (`apt-get install chromium`; `$CHROMIUM` names another binary).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use serde_json::json;
use stable_diffusion::api::Image;

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|p| p.is_file())
}

/// Where `want` (RGB) sits in `shot` (RGB), as the offset of its top-left corner.
fn find(shot: &Image, want: &Image) -> Option<(u32, u32)> {
    let (sw, ww, wh) = (shot.width as usize, want.width as usize, want.height as usize);
    let px = |img: &Image, x: usize, y: usize| -> [u8; 3] {
        let i = (y * img.width as usize + x) * 3;
        [img.data[i], img.data[i + 1], img.data[i + 2]]
    };
    let close = |a: [u8; 3], b: [u8; 3]| a.iter().zip(b).all(|(p, q)| p.abs_diff(q) <= 3);
    for y in 0..=(shot.height as usize).checked_sub(wh)? {
        for x in 0..=sw.checked_sub(ww)? {
            if !close(px(shot, x, y), px(want, 0, 0)) || !close(px(shot, x + 1, y), px(want, 1, 0)) {
                continue;
            }
            let mut diff = 0u64;
            for j in 0..wh {
                for i in 0..ww {
                    let (a, b) = (px(shot, x + i, y + j), px(want, i, j));
                    diff += a.iter().zip(b).map(|(p, q)| u64::from(p.abs_diff(q))).sum::<u64>();
                }
            }
            if diff as f64 / (ww * wh * 3) as f64 <= 2.0 {
                return Some((x as u32, y as u32));
            }
        }
    }
    None
}

#[test]
fn page_generates_a_picture_in_headless_chromium() {
    let Some(browser) = chromium() else {
        eprintln!("skipped: no chromium binary on PATH (apt-get install chromium, or set CHROMIUM)");
        return;
    };
    let Some(_) = default_model() else { return };
    let srv = start(&[]);
    let dir = std::env::temp_dir().join(format!("sd-server-page-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shot = dir.join("page.png");
    let url = format!("{}/?prompt=a%20lovely%20cat&width=64&height=64&steps=1&seed=42&cfg_scale=7&autogen=1", srv.base);
    // The page makes one request and shows its answer; virtual time waits for the request.
    let out = Command::new(&browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--window-size=800,600", "--virtual-time-budget=120000"])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .expect("chromium runs");
    assert!(shot.is_file(), "no screenshot: {}", String::from_utf8_lossy(&out.stderr));
    let page = sd_cli::image_io::decode_image(&std::fs::read(&shot).unwrap(), "screenshot", None, 3).unwrap();
    // The same request through the API: the page must show exactly this picture.
    let same = json!({"prompt": "a lovely cat", "negative_prompt": "", "width": 64, "height": 64, "seed": 42, "steps": 1, "cfg_scale": 7, "sampler_name": "default"});
    let (status, answer) = post(&srv.base, "/sdapi/v1/txt2img", &same);
    assert_eq!(status, 200, "{answer}");
    let want_bytes = sd_server::request::base64_image(answer["images"][0].as_str().unwrap(), "answer").unwrap();
    let want = sd_cli::image_io::decode_image(&want_bytes, "answer", None, 3).unwrap();
    let at = find(&page, &want);
    assert!(at.is_some(), "the generated picture is not in the screenshot {}", shot.display());
    eprintln!("the picture is at {:?} in the {}x{} screenshot", at.unwrap(), page.width, page.height);
    std::fs::remove_dir_all(&dir).ok();
}
