//! sd-server end to end: the built program on the synthetic SD1 checkpoint (the default
//! model), on a free loopback port, driven over HTTP. One server runs the whole sequence
//! (loading the model once): every endpoint, LoRAs, a job cancelled mid-run, a full queue,
//! two clients at once, each kind of bad input, and a good request afterwards.

mod common;

use std::time::{Duration, Instant};

use common::*;

use serde_json::{json, Value};

fn ok(r: (u16, Value)) -> Value {
    assert!((200..300).contains(&r.0), "status {}: {}", r.0, r.1);
    r.1
}

/// A 4xx answer whose `error` says `what`.
fn refused(r: (u16, Value), status: u16, what: &str) {
    assert_eq!(r.0, status, "{}", r.1);
    let e = r.1["error"].as_str().unwrap_or_else(|| panic!("no error message: {}", r.1));
    assert!(e.contains(what), "'{e}' does not say '{what}'");
}

fn b64(s: &str) -> Vec<u8> {
    sd_server::request::base64_image(s, "test").unwrap()
}

/// Decodes a PNG or JPEG answer: (width, height, parameters text).
fn picture(b64_text: &str) -> (u32, u32, String, Vec<u8>) {
    let bytes = b64(b64_text);
    let img = sd_cli::image_io::decode_image(&bytes, "answer", None, 3).unwrap();
    let params = sd_cli::image_io::png_text_chunks(&bytes).ok().and_then(|c| c.into_iter().find(|(k, _)| k == "parameters")).map(|(_, v)| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default();
    (img.width, img.height, params, bytes)
}

fn small(prompt: &str) -> Value {
    json!({"prompt": prompt, "width": 64, "height": 64, "steps": 1, "seed": 42})
}

/// A WebUI request for `batch` 64x64 pictures in one step from seed 42.
fn webui(batch: i32, prompt: &str) -> Value {
    let mut r = small(prompt);
    r["sampler_name"] = "Euler a".into();
    r["scheduler"] = "karras".into();
    r["batch_size"] = batch.into();
    r
}

fn wait_job(base: &str, id: &str, until: &dyn Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let job = ok(get(base, &format!("/sdcpp/v1/jobs/{id}")));
        if until(&job) {
            return job;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "job never got there: {job}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn multipart(parts: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "sdserverTestBoundary7";
    let mut body = Vec::new();
    for (name, file, data) in parts {
        body.extend(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"").as_bytes());
        if let Some(f) = file {
            body.extend(format!("; filename=\"{f}\"\r\nContent-Type: image/png").as_bytes());
        }
        body.extend(b"\r\n\r\n");
        body.extend(*data);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

#[test]
fn serves_every_api_on_one_model() {
    let Some(_) = default_model() else { return };
    let loras = fixture_cache().join("loras");
    let lora = loras.join("lora_sd1.safetensors").is_file();
    if !lora {
        eprintln!("notice: no loras/lora_sd1.safetensors in the fixture cache: the LoRA checks are skipped");
    }
    let loras = loras.to_string_lossy().into_owned();
    let t0 = Instant::now();
    let srv = start(&["--lora-model-dir", &loras, "--max-queue-size", "3", "--max-request-mb", "1", "--max-steps", "40", "--max-batch-count", "2"]);
    let base = srv.base.clone();
    let b = base.as_str();
    eprintln!("model loaded in {:.1}s", t0.elapsed().as_secs_f32());

    // -- the page and discovery --
    let (s, page) = answer(agent().get(&format!("{b}/")).call());
    assert_eq!(s, 200);
    assert!(page.contains("<textarea id=\"prompt\"") && page.contains("/sdcpp/v1/img_gen"), "{page}");
    let pre = agent().request("OPTIONS", &format!("{b}/sdapi/v1/txt2img")).set("Origin", "http://example.test").call().unwrap();
    assert_eq!((pre.status(), pre.header("access-control-allow-origin")), (204, Some("http://example.test")));
    assert_eq!(ok(get(b, "/v1/models"))["data"][0]["id"], "sd-cpp-local");
    let samplers = ok(get(b, "/sdapi/v1/samplers"));
    assert!(samplers.as_array().unwrap().iter().any(|s| s["name"] == "euler_a") && samplers[0]["name"] == "default");
    let schedulers = ok(get(b, "/sdapi/v1/schedulers"));
    assert!(schedulers.as_array().unwrap().iter().any(|s| s["name"] == "karras" && s["label"] == "karras"));
    assert_eq!(ok(get(b, "/sdapi/v1/sd-models"))[0]["title"], "sd1");
    assert_eq!(ok(get(b, "/sdapi/v1/options"))["sd_model_checkpoint"], "sd1");
    assert!(ok(get(b, "/sdapi/v1/upscalers")).as_array().unwrap().iter().any(|u| u["name"] == "Lanczos"));
    assert_eq!(ok(get(b, "/sdapi/v1/latent-upscale-modes"))[0]["name"], "Latent");
    let listed = ok(get(b, "/sdapi/v1/loras"));
    if lora {
        assert!(listed.as_array().unwrap().iter().any(|l| l["name"] == "lora_sd1" && l["path"] == "lora_sd1.safetensors"), "{listed}");
    }
    let caps = ok(get(b, "/sdcpp/v1/capabilities"));
    assert_eq!((caps["supported_modes"].clone(), caps["current_mode"].clone()), (json!(["img_gen"]), json!("img_gen")));
    assert_eq!((caps["limits"]["max_queue_size"].clone(), caps["model"]["name"].clone()), (json!(3), json!("sd1.safetensors")));
    assert_eq!(caps["defaults"]["sample_params"]["sample_steps"], 20);
    assert_eq!(ok(get(b, "/sdapi/v1/progress"))["state"]["sampling_steps"], 0);

    eprintln!("[{:.1}s] OpenAI --", t0.elapsed().as_secs_f32());
    // -- OpenAI --
    let gen = |fmt: &str| json!({"prompt": "a cat <sd_cpp_extra_args>{\"sample_params\":{\"sample_steps\":1},\"seed\":5}</sd_cpp_extra_args>", "size": "64x64", "n": 1, "output_format": fmt});
    let out = ok(post(b, "/v1/images/generations", &gen("png")));
    assert_eq!(out["output_format"], "png");
    let (w, h, params, png) = picture(out["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h), (64, 64));
    assert!(params.starts_with("a cat") && params.contains("Steps: 1,") && params.contains("Seed: 5,"), "{params}");
    let edit_prompt = b"a dog <sd_cpp_extra_args>{\"sample_params\":{\"sample_steps\":1}}</sd_cpp_extra_args>";
    let (ct, body) = multipart(&[("prompt", None, edit_prompt), ("size", None, b"64x64"), ("output_format", None, b"webp"), ("image[]", Some("in.png"), &png)]);
    let edited = ok(post_raw(b, "/v1/images/edits", &ct, &body));
    assert_eq!(edited["output_format"], "webp");
    let webp = edited["data"][0]["b64_json"].as_str().unwrap();
    assert!(b64(webp).starts_with(b"RIFF") && picture(webp).0 == 64);

    eprintln!("[{:.1}s] sdapi --", t0.elapsed().as_secs_f32());
    // -- sdapi --
    let out = ok(post(b, "/sdapi/v1/txt2img", &webui(2, "a lovely cat")));
    assert_eq!(out["images"].as_array().unwrap().len(), 2);
    assert_eq!(out["parameters"]["sampler_name"], "Euler a", "the request is echoed");
    let info: Value = serde_json::from_str(out["info"].as_str().unwrap()).unwrap();
    assert_eq!((info["all_seeds"].clone(), info["sampler_name"].clone()), (json!([42, 43]), json!("euler_a")));
    assert_eq!(info["extra_generation_params"]["Schedule type"], "karras");
    let pixels = |b64_text: &str| sd_cli::image_io::decode_image(&b64(b64_text), "x", None, 3).unwrap().data;
    let plain = pixels(out["images"][0].as_str().unwrap());
    if lora {
        // The LoRA field and the prompt tag reach the model: the picture changes, the same way.
        let mut with_field = webui(1, "a lovely cat");
        with_field["lora"] = json!([{"path": "lora_sd1", "multiplier": 1.0}]);
        let by_field = ok(post(b, "/sdapi/v1/txt2img", &with_field))["images"][0].as_str().unwrap().to_string();
        let by_tag = ok(post(b, "/sdapi/v1/txt2img", &webui(1, "a lovely cat<lora:lora_sd1:1>")))["images"][0].as_str().unwrap().to_string();
        assert_ne!(pixels(&by_field), plain, "the LoRA changed nothing");
        assert_eq!(pixels(&by_field), pixels(&by_tag), "field and tag give different pictures");
        let tag_params = picture(&by_tag).2;
        assert!(tag_params.contains("<lora:lora_sd1:1>"), "the parameters keep the tag: {tag_params}");
    }
    let mut i2i = small("a lovely cat");
    i2i["init_images"] = json!([format!("data:image/png;base64,{}", sd_server::request::base64(&png))]);
    i2i["denoising_strength"] = 0.5.into();
    let out = ok(post(b, "/sdapi/v1/img2img", &i2i));
    assert_eq!(picture(out["images"][0].as_str().unwrap()).0, 64);
    let info: Value = serde_json::from_str(out["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["denoising_strength"], 0.5);

    eprintln!("[{:.1}s] native", t0.elapsed().as_secs_f32());
    // -- native: a job from queue to result --
    let native = json!({"prompt": "a cat", "width": 64, "height": 64, "seed": 3, "sample_params": {"sample_steps": 1, "sample_method": "euler"}});
    let mut as_jpeg = native.clone();
    as_jpeg["output_format"] = "jpeg".into();
    let (s, sub) = post(b, "/sdcpp/v1/img_gen", &as_jpeg);
    assert_eq!(s, 202, "{sub}");
    let id = sub["id"].as_str().unwrap().to_string();
    assert_eq!((sub["kind"].clone(), sub["poll_url"].clone()), (json!("img_gen"), json!(format!("/sdcpp/v1/jobs/{id}"))));
    let job = wait_job(b, &id, &|j| j["status"] == "completed" || j["status"] == "failed");
    assert_eq!(job["status"], "completed", "{job}");
    assert!(job["started"].is_i64() && job["completed"].is_i64() && job["error"].is_null());
    assert_eq!((job["result"]["output_format"].clone(), job["result"]["images"][0]["index"].clone()), (json!("jpeg"), json!(0)));
    let jpeg = job["result"]["images"][0]["b64_json"].as_str().unwrap();
    assert!(b64(jpeg).starts_with(&[0xff, 0xd8]) && picture(jpeg).0 == 64);
    refused(post(b, "/sdcpp/v1/vid_gen", &json!({"prompt": "x"})), 400, "does not support vid_gen");

    eprintln!("[{:.1}s] cancel a running", t0.elapsed().as_secs_f32());
    // -- cancel a running job; a full queue; cancel a queued one --
    let long = json!({"prompt": "a long one", "width": 128, "height": 128, "sample_params": {"sample_steps": 40}});
    let long_id = ok(post(b, "/sdcpp/v1/img_gen", &long))["id"].as_str().unwrap().to_string();
    let running = wait_job(b, &long_id, &|j| j["status"] == "generating" && j["progress"]["step"].as_i64() >= Some(1));
    assert_eq!(running["progress"]["steps"], 40);
    let progress = ok(get(b, "/sdapi/v1/progress"));
    assert_eq!((progress["state"]["sampling_steps"].clone(), progress["state"]["job"].clone()), (json!(40), json!(long_id)));
    let queued: Vec<String> = (0..2).map(|i| ok(post(b, "/sdcpp/v1/img_gen", &native))["id"].as_str().map(|s| s.to_string()).unwrap_or_else(|| panic!("{i}"))).collect();
    assert_eq!(ok(get(b, &format!("/sdcpp/v1/jobs/{}", queued[1])))["queue_position"], 2);
    refused(post(b, "/sdcpp/v1/img_gen", &native), 429, "job queue is full");
    refused(post(b, "/sdapi/v1/txt2img", &small("x")), 429, "job queue is full");
    let cancelled = ok(post(b, &format!("/sdcpp/v1/jobs/{}/cancel", queued[0]), &json!({})));
    assert_eq!((cancelled["status"].clone(), cancelled["error"]["code"].clone()), (json!("cancelled"), json!("cancelled")));
    assert_eq!(ok(post(b, &format!("/sdcpp/v1/jobs/{}/cancel", queued[1]), &json!({})))["status"], "cancelled");
    let t_cancel = Instant::now();
    let c = ok(post(b, &format!("/sdcpp/v1/jobs/{long_id}/cancel"), &json!({})));
    assert_eq!(c["cancel_requested"], true, "{c}");
    let done = wait_job(b, &long_id, &|j| j["status"] != "generating");
    assert_eq!((done["status"].clone(), done["error"]["message"].clone()), (json!("cancelled"), json!("job cancelled by client")));
    assert!(done["progress"]["step"].as_i64().unwrap() < 40, "it ran to the end: {done}");
    eprintln!("cancelled after {:.1}s", t_cancel.elapsed().as_secs_f32());

    eprintln!("[{:.1}s] two clients", t0.elapsed().as_secs_f32());
    // -- two clients at once --
    let clients: Vec<_> = [11, 12]
        .map(|seed| {
            let b = base.clone();
            std::thread::spawn(move || {
                let mut r = small("two at once");
                r["seed"] = seed.into();
                let out = ok(post(&b, "/sdapi/v1/txt2img", &r));
                let info: Value = serde_json::from_str(out["info"].as_str().unwrap()).unwrap();
                (info["all_seeds"][0].as_i64(), out["images"].as_array().unwrap().len())
            })
        })
        .into_iter()
        .collect();
    let results: Vec<_> = clients.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(results, vec![(Some(11), 1), (Some(12), 1)]);

    eprintln!("[{:.1}s] bad input", t0.elapsed().as_secs_f32());
    // -- bad input: every one a 4xx JSON answer that says what is wrong --
    let big = vec![b' '; 2 << 20];
    refused(post_raw(b, "/sdapi/v1/txt2img", "application/json", &big), 413, "larger than 1 MiB");
    refused(post_raw(b, "/sdcpp/v1/img_gen", "application/json", b"{\"prompt\": "), 400, "invalid json");
    refused(post_raw(b, "/sdcpp/v1/img_gen", "application/json", b""), 400, "empty body");
    refused(post(b, "/sdcpp/v1/img_gen", &json!([1, 2])), 400, "must be a JSON object");
    refused(post(b, "/sdcpp/v1/img_gen", &json!({"sample_params": {"sample_method": "nope"}})), 400, "unknown sampler 'nope'");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "sampler_name": "nope"})), 400, "unknown sampler 'nope'");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "scheduler": "nope"})), 400, "unknown scheduler 'nope'");
    refused(post(b, "/sdcpp/v1/img_gen", &json!({"sample_params": {"scheduler": "nope"}})), 400, "unknown scheduler 'nope'");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "width": 100000, "height": 64})), 400, "width must be in [64, 4096]");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "width": 32, "height": 64})), 400, "width must be in [64, 4096]");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "batch_size": 3})), 400, "batch_count must be in [1, 2]");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "steps": 41})), 400, "sample_steps must be in [1, 40]");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "steps": 0})), 400, "sample_steps must be greater than 0");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "width": "64"})), 400, "field 'width' must be an integer");
    refused(post(b, "/sdcpp/v1/img_gen", &json!({"sample_params": {"guidance": {"txt_cfg": "high"}}})), 400, "field 'sample_params.guidance.txt_cfg' must be a number");
    refused(post(b, "/sdapi/v1/img2img", &json!({"prompt": "x", "init_images": ["%%%"]})), 400, "not valid base64");
    refused(post(b, "/sdapi/v1/img2img", &json!({"prompt": "x", "init_images": ["aGVsbG8="]})), 400, "load image from 'init_image' failed: not a PNG");
    refused(post(b, "/sdapi/v1/img2img", &json!({"prompt": "x"})), 400, "img2img needs init_images");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x", "lora": [{"path": "no_such_lora"}]})), 400, "unknown lora 'no_such_lora'");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x <lora:../../etc/passwd:1>"})), 400, "unknown lora");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"width": 64})), 400, "prompt required");
    refused(post(b, "/v1/images/generations", &json!({"prompt": "x", "size": "big"})), 400, "invalid size 'big'");
    refused(post(b, "/v1/images/generations", &json!({"prompt": "x", "response_format": "url"})), 400, "b64_json only");
    refused(post(b, "/v1/images/generations", &json!({"prompt": "x", "output_format": "gif"})), 400, "invalid output_format 'gif'");
    refused(post(b, "/v1/images/generations", &json!({"prompt": "x", "n": 0})), 400, "batch_count must be greater than 0");
    refused(post(b, "/v1/images/edits", &json!({"prompt": "x"})), 400, "multipart/form-data");
    let (ct, body) = multipart(&[("prompt", None, b"x")]);
    refused(post_raw(b, "/v1/images/edits", &ct, &body), 400, "at least one image[] required");
    refused(post(b, "/sdcpp/v1/img_gen", &json!({"prompt": "x <sd_cpp_extra_args>{</sd_cpp_extra_args>", "strength": 2})), 400, "strength in [0.0, 1.0]");
    refused(post(b, "/sdapi/v1/txt2img", &json!({"prompt": "x <sd_cpp_extra_args>{bad</sd_cpp_extra_args>"})), 400, "invalid sd_cpp_extra_args");
    refused(get(b, "/sdapi/v1/txt2img"), 405, "not allowed");
    refused(get(b, "/no/such/endpoint"), 404, "no such endpoint");
    refused(get(b, "/sdcpp/v1/jobs/job_nope"), 404, "job not found");
    refused(post(b, "/sdcpp/v1/jobs/job_nope/cancel", &json!({})), 404, "job not found");

    eprintln!("[{:.1}s] and it still", t0.elapsed().as_secs_f32());
    // -- and it still serves --
    let out = ok(post(b, "/sdapi/v1/txt2img", &webui(1, "a lovely cat")));
    assert_eq!(pixels(out["images"][0].as_str().unwrap()), plain, "the same seed and settings give the same picture");
    eprintln!("whole sequence in {:.1}s", t0.elapsed().as_secs_f32());
}
