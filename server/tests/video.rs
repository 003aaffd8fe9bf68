//! `/sdcpp/v1/vid_gen` on the synthetic Wan2.1 T2V model: the job runs and its result is an
//! MJPEG AVI of the frames. Loading Wan and generating take minutes on two cores, so this
//! runs only with SD_PARITY set and the fixtures made (scripts/fixtures.sh wan21-t2v
//! umt5-tiny wan-vae), like sd-cli's video test.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

#[test]
fn vid_gen_job_returns_an_avi() {
    let cache = fixture_cache();
    let files = ["wan21_t2v.safetensors", "umt5_tiny.safetensors", "wan_vae.safetensors"].map(|f| cache.join(f));
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        eprintln!("skipped: {} is missing (scripts/fixtures.sh wan21-t2v umt5-tiny wan-vae writes it)", missing.display());
        return;
    }
    if std::env::var_os("SD_PARITY").is_none() {
        eprintln!("skipped: a Wan video takes minutes here; set SD_PARITY=1 to run it");
        return;
    }
    let [dit, umt5, vae] = files.map(|f| f.to_string_lossy().into_owned());
    let srv = start(&["--diffusion-model", &dit, "--t5xxl", &umt5, "--vae", &vae, "--cfg-scale", "1"]);
    let b = srv.base.as_str();
    let caps = get(b, "/sdcpp/v1/capabilities").1;
    assert_eq!(caps["supported_modes"], json!(["vid_gen"]), "{caps}");
    assert_eq!(caps["output_formats_by_mode"]["vid_gen"], json!(["avi"]));
    let (s, e) = post(b, "/sdcpp/v1/img_gen", &json!({"prompt": "x"}));
    assert_eq!((s, e["error"].as_str()), (400, Some("loaded model does not support img_gen")));
    let (s, e) = post(b, "/sdcpp/v1/vid_gen", &json!({"prompt": "x", "output_format": "webm"}));
    assert!(s == 400 && e["error"].as_str().unwrap().contains("invalid output_format 'webm'"), "{e}");
    let req = json!({"prompt": "a lovely cat", "width": 64, "height": 64, "seed": 42, "video_frames": 5, "fps": 12, "sample_params": {"sample_steps": 2}});
    let (s, sub) = post(b, "/sdcpp/v1/vid_gen", &req);
    assert_eq!(s, 202, "{sub}");
    let id = sub["id"].as_str().unwrap();
    let t0 = Instant::now();
    let job = loop {
        let job = get(b, &format!("/sdcpp/v1/jobs/{id}")).1;
        if job["status"] != "queued" && job["status"] != "generating" {
            break job;
        }
        assert!(t0.elapsed() < Duration::from_secs(1200), "{job}");
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(job["status"], "completed", "{job}");
    let r = &job["result"];
    assert_eq!((r["output_format"].clone(), r["mime_type"].clone(), r["fps"].clone(), r["frame_count"].clone()), (json!("avi"), json!("video/x-msvideo"), json!(12), json!(5)));
    let avi = sd_server::request::base64_image(r["b64_json"].as_str().unwrap(), "video").unwrap();
    let info = sd_cli::avi::read(&avi).unwrap();
    assert_eq!((info.width, info.height, info.fps, info.frames.len()), (64, 64, 12, 5));
}
