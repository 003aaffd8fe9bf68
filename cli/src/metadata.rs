//! The generation parameters written into each image, in the reference program's layout.
//!
//! The text is A1111-style (prompt line, `Negative prompt:` line, then `Key: value, ...`),
//! ending with `SDCPP: ` and a compact JSON object (keys sorted, numbers formatted as
//! nlohmann::json prints them), so tools that read the reference's images read ours.

use serde_json::{json, Map, Value};

use crate::args::{Mode, Opts};
use stable_diffusion::api::SampleParams;

/// The file name part of a path (after the last `/`, else after the last `\`).
pub fn basename(path: &str) -> &str {
    path.rsplit_once('/').or_else(|| path.rsplit_once('\\')).map_or(path, |(_, b)| b)
}

/// C's `%f` (six decimals, `inf`/`nan` spelled as C does).
pub fn c_fixed(x: f32) -> String {
    match x {
        _ if x.is_nan() => if x.is_sign_negative() { "-nan" } else { "nan" }.into(),
        _ if x.is_infinite() => if x < 0.0 { "-inf" } else { "inf" }.into(),
        _ => format!("{:.6}", f64::from(x)),
    }
}

/// C++ `ostream << float` with default settings (`%g`, 6 significant digits).
pub fn c_general(x: f32) -> String {
    if !x.is_finite() {
        return c_fixed(x);
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    let sci = format!("{:.5e}", f64::from(x));
    let (mantissa, exp) = sci.split_once('e').expect("exponent form");
    let exp: i32 = exp.parse().expect("integer exponent");
    let trim = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    if !(-4..6).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa.to_string()), exp.abs())
    } else {
        trim(format!("{:.*}", (5 - exp) as usize, f64::from(x)))
    }
}

/// A double as nlohmann::json dumps it: shortest round-trip digits, written plainly when the
/// decimal point falls after between -3 and 15 digits and as `d.ddde+XX` otherwise; a whole
/// number keeps `.0`.
pub fn json_number(x: f64) -> String {
    if !x.is_finite() {
        return "null".into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').expect("exponent form");
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let k = digits.len() as i32;
    // The decimal point sits after the first `n` digits.
    let n = exp.parse::<i32>().expect("integer exponent") + 1;
    let body = if k <= n && n <= 15 {
        format!("{digits}{}.0", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 15 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -4 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n - 1;
        let frac = if k == 1 { String::new() } else { format!(".{}", &digits[1..]) };
        format!("{}{frac}e{}{:02}", &digits[..1], if e < 0 { '-' } else { '+' }, e.abs())
    };
    if x < 0.0 {
        format!("-{body}")
    } else {
        body
    }
}

/// serde_json output with nlohmann's number format.
struct NlohmannFormatter;

impl serde_json::ser::Formatter for NlohmannFormatter {
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, value: f64) -> std::io::Result<()> {
        w.write_all(json_number(value).as_bytes())
    }
    fn write_f32<W: ?Sized + std::io::Write>(&mut self, w: &mut W, value: f32) -> std::io::Result<()> {
        w.write_all(json_number(f64::from(value)).as_bytes())
    }
}

pub fn dump_json(v: &Value) -> String {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, NlohmannFormatter);
    serde::Serialize::serialize(v, &mut ser).expect("writing to memory");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// A float field: `null` when not finite, else the float widened to a double.
fn num(x: f32) -> Value {
    serde_json::Number::from_f64(f64::from(x)).map_or(Value::Null, Value::Number)
}

fn nums(xs: &[f32]) -> Value {
    Value::Array(xs.iter().map(|&x| num(x)).collect())
}

fn opt_str(s: &Option<String>) -> &str {
    s.as_deref().unwrap_or("")
}

/// A sampling object; `custom_sigmas` is written only when given (the high-noise object of a
/// video has none).
fn sampling_json(sp: &SampleParams, layers: &[i32], custom_sigmas: Option<&[f32]>) -> Value {
    let g = &sp.guidance;
    let mut s = json!({
        "steps": sp.sample_steps,
        "eta": num(sp.eta),
        "shifted_timestep": sp.shifted_timestep,
        "flow_shift": num(sp.flow_shift),
        "extra_sample_args": opt_str(&sp.extra_sample_args),
        "guidance": {
            "txt_cfg": num(g.txt_cfg),
            "img_cfg": num(g.img_cfg),
            "distilled_guidance": num(g.distilled_guidance),
            "slg": {
                "scale": num(g.slg.scale),
                "layers": layers,
                "start": num(g.slg.layer_start),
                "end": num(g.slg.layer_end),
            },
        },
    });
    if let Some(sigmas) = custom_sigmas {
        s["custom_sigmas"] = nums(sigmas);
    }
    if let Some(m) = sp.sample_method {
        s["method"] = m.name().into();
    }
    if let Some(sch) = sp.scheduler {
        s["scheduler"] = sch.name().into();
    }
    s
}

/// The `SDCPP:` JSON object.
pub fn sdcpp_json(o: &Opts, seed: i64, mode: Mode) -> Value {
    let (ctx, gen) = (&o.ctx.params, &o.gen);
    let p = &gen.params;
    let mode_name = match mode {
        Mode::VidGen => "vid_gen",
        Mode::Adetailer => "adetailer",
        _ => "img_gen",
    };
    let mut root = json!({
        "schema": "sdcpp.image.params/v1",
        "mode": mode_name,
        "generator": {
            "name": "stable-diffusion.cpp",
            "version": stable_diffusion::api::version(),
            "commit": stable_diffusion::api::commit(),
        },
        "seed": seed,
        "width": gen.resolved_width(),
        "height": gen.resolved_height(),
        "prompt": { "positive": p.prompt, "negative": p.negative_prompt },
        "sampling": sampling_json(&p.sample_params, &gen.skip_layers, Some(&p.sample_params.custom_sigmas)),
        "clip_skip": p.clip_skip,
        "strength": num(p.strength),
        "control_strength": num(p.control_strength),
        "ip_adapter_strength": num(p.ip_adapter_strength),
        "auto_resize_ref_image": gen.auto_resize_ref_image,
        "increase_ref_index": gen.increase_ref_index,
        "rng": ctx.rng_type.name(),
    });
    if mode == Mode::VidGen {
        let v = &gen.video;
        root["video"] = json!({ "frame_count": v.video_frames, "fps": v.fps });
        root["moe_boundary"] = num(v.moe_boundary);
        root["vace_strength"] = num(v.vace_strength);
        root["high_noise_sampling"] = sampling_json(&v.high_noise, &v.high_noise_skip_layers, None);
    }
    if !gen.ad_model.is_empty() {
        root["adetailer"] = json!({
            "model": basename(&gen.ad_model),
            "prompt": gen.ad_prompt,
            "negative_prompt": gen.ad_negative_prompt,
            "extra_args": gen.extra_ad_args,
        });
    }
    let mut models = Map::new();
    for (key, path) in [
        ("model", &ctx.model_path),
        ("clip_l", &ctx.clip_l_path),
        ("clip_g", &ctx.clip_g_path),
        ("clip_vision", &ctx.clip_vision_path),
        ("t5xxl", &ctx.t5xxl_path),
        ("llm", &ctx.llm_path),
        ("llm_vision", &ctx.llm_vision_path),
        ("diffusion_model", &ctx.diffusion_model_path),
        ("high_noise_diffusion_model", &ctx.high_noise_diffusion_model_path),
        ("uncond_diffusion_model", &ctx.uncond_diffusion_model_path),
        ("vae", &ctx.vae_path),
        ("taesd", &ctx.taesd_path),
        ("control_net", &ctx.control_net_path),
    ] {
        if let Some(path) = path.as_deref().filter(|s| !s.is_empty()) {
            models.insert(key.into(), basename(path).into());
        }
    }
    // An empty object dumps as `null` in the reference (a json value never assigned).
    root["models"] = if models.is_empty() { Value::Null } else { Value::Object(models) };
    if let Some(r) = ctx.sampler_rng_type {
        root["sampler_rng"] = r.name().into();
    }
    let loras: Vec<Value> = gen
        .loras
        .iter()
        .map(|(k, &m)| (k, m, false))
        .chain(gen.high_noise_loras.iter().map(|(k, &m)| (k, m, true)))
        .map(|(k, m, high)| json!({ "name": basename(k), "multiplier": num(m), "is_high_noise": high }))
        .collect();
    if !loras.is_empty() {
        root["loras"] = Value::Array(loras);
    }
    let h = &p.hires;
    if h.enabled {
        root["hires"] = json!({
            "enabled": true,
            "upscaler": gen.hires_upscaler,
            "model": h.model_path.as_deref().map(basename).unwrap_or(""),
            "scale": num(h.scale),
            "target_width": h.target_width,
            "target_height": h.target_height,
            "steps": h.steps,
            "denoising_strength": num(h.denoising_strength),
            "custom_sigmas": nums(&h.custom_sigmas),
            "upscale_tile_size": h.upscale_tile_size,
        });
    }
    let c = &p.cache;
    if c.mode != stable_diffusion::types::CacheMode::Disabled {
        root["cache"] = json!({
            "requested_mode": gen.cache_mode,
            "requested_option": gen.cache_option,
            "mode": c.mode.raw(),
            "scm_mask": opt_str(&c.scm_mask),
            "scm_policy_dynamic": gen.scm_policy_dynamic,
            "reuse_threshold": num(c.reuse_threshold),
            "start_percent": num(c.start_percent),
            "end_percent": num(c.end_percent),
            "error_decay_rate": num(c.error_decay_rate),
            "use_relative_threshold": c.use_relative_threshold,
            "reset_error_on_compute": c.reset_error_on_compute,
            "Fn_compute_blocks": c.fn_compute_blocks,
            "Bn_compute_blocks": c.bn_compute_blocks,
            "residual_diff_threshold": num(c.residual_diff_threshold),
            "max_warmup_steps": c.max_warmup_steps,
            "max_cached_steps": c.max_cached_steps,
            "max_continuous_cached_steps": c.max_continuous_cached_steps,
            "taylorseer_n_derivatives": c.taylorseer_n_derivatives,
            "taylorseer_skip_interval": c.taylorseer_skip_interval,
            "spectrum_w": num(c.spectrum_w),
            "spectrum_m": c.spectrum_m,
            "spectrum_lam": num(c.spectrum_lam),
            "spectrum_window_size": c.spectrum_window_size,
            "spectrum_flex_window": num(c.spectrum_flex_window),
            "spectrum_warmup_steps": c.spectrum_warmup_steps,
            "spectrum_stop_percent": num(c.spectrum_stop_percent),
        });
    }
    let t = &p.vae_tiling_params;
    let extra_tiling = opt_str(&t.extra_tiling_args);
    if t.enabled || t.temporal_tiling || !extra_tiling.is_empty() {
        root["vae_tiling"] = json!({
            "enabled": t.enabled,
            "temporal_tiling": t.temporal_tiling,
            "tile_size_x": t.tile_size_x,
            "tile_size_y": t.tile_size_y,
            "target_overlap": num(t.target_overlap),
            "rel_size_x": num(t.rel_size_x),
            "rel_size_y": num(t.rel_size_y),
            "extra_tiling_args": extra_tiling,
        });
    }
    root
}

/// The text stored under the `parameters` key of image `seed`.
pub fn image_parameters(o: &Opts, seed: i64, mode: Mode) -> String {
    let (ctx, gen) = (&o.ctx.params, &o.gen);
    let p = &gen.params;
    let sp = &p.sample_params;
    let g = &sp.guidance;
    let mut s = String::new();
    let prompt = if gen.prompt_with_lora.is_empty() { &p.prompt } else { &gen.prompt_with_lora };
    s += &format!("{prompt}\n");
    if !p.negative_prompt.is_empty() {
        s += &format!("Negative prompt: {}\n", p.negative_prompt);
    }
    s += &format!("Steps: {}, CFG scale: {}, ", sp.sample_steps, c_fixed(g.txt_cfg));
    if g.slg.scale != 0.0 && !gen.skip_layers.is_empty() {
        s += &format!("SLG scale: {}, Skip layers: [", c_fixed(g.slg.scale));
        for l in &gen.skip_layers {
            s += &format!("{l}, ");
        }
        s += &format!("], Skip layer start: {}, Skip layer end: {}, ", c_fixed(g.slg.layer_start), c_fixed(g.slg.layer_end));
    }
    s += &format!("Guidance: {}, Eta: {}, ", c_fixed(g.distilled_guidance), c_fixed(sp.eta));
    if let Some(extra) = sp.extra_sample_args.as_deref().filter(|e| !e.is_empty()) {
        s += &format!("Extra sample args: {extra}, ");
    }
    if !gen.ad_model.is_empty() {
        s += &format!("ADetailer model: {}, ", basename(&gen.ad_model));
        for (label, v) in [("ADetailer prompt", &gen.ad_prompt), ("ADetailer negative prompt", &gen.ad_negative_prompt), ("ADetailer args", &gen.extra_ad_args)] {
            if !v.is_empty() {
                s += &format!("{label}: {v}, ");
            }
        }
    }
    s += &format!("Seed: {seed}, Size: {}x{}, ", gen.resolved_width(), gen.resolved_height());
    s += &format!("Model: {}, RNG: {}, ", basename(opt_str(&ctx.model_path)), ctx.rng_type.name());
    if let Some(r) = ctx.sampler_rng_type {
        s += &format!("Sampler RNG: {}, ", r.name());
    }
    s += &format!("Sampler: {}", sp.sample_method.map_or("NONE", |m| m.name()));
    if !sp.custom_sigmas.is_empty() {
        let list: Vec<String> = sp.custom_sigmas.iter().map(|v| format!("{:.4}", f64::from(*v))).collect();
        s += &format!(", Custom Sigmas: [{}]", list.join(", "));
    } else if let Some(sch) = sp.scheduler {
        s += &format!(" {}", sch.name());
    }
    s += ", ";
    for te in [&ctx.clip_l_path, &ctx.clip_g_path, &ctx.t5xxl_path, &ctx.llm_path, &ctx.llm_vision_path] {
        if let Some(te) = te.as_deref().filter(|t| !t.is_empty()) {
            s += &format!("TE: {}, ", basename(te));
        }
    }
    for (label, path) in [("Unet", &ctx.diffusion_model_path), ("Uncond Unet", &ctx.uncond_diffusion_model_path), ("VAE", &ctx.vae_path)] {
        if let Some(path) = path.as_deref().filter(|t| !t.is_empty()) {
            s += &format!("{label}: {}, ", basename(path));
        }
    }
    if p.clip_skip != -1 {
        s += &format!("Clip skip: {}, ", p.clip_skip);
    }
    let h = &p.hires;
    if h.enabled {
        s += &format!("Hires upscale: {}, Hires scale: {}, ", gen.hires_upscaler, c_fixed(h.scale));
        s += &format!("Hires resize: {}x{}, Hires steps: {}, ", h.target_width, h.target_height, h.steps);
        s += &format!("Denoising strength: {}, ", c_fixed(h.denoising_strength));
        if !h.custom_sigmas.is_empty() {
            let list: Vec<String> = h.custom_sigmas.iter().map(|&v| c_general(v)).collect();
            s += &format!("Hires custom sigmas: [{}], ", list.join(", "));
        }
    }
    s += "Version: stable-diffusion.cpp";
    s += &format!(", SDCPP: {}", dump_json(&sdcpp_json(o, seed, mode)));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formats() {
        assert_eq!(json_number(7.0), "7.0");
        assert_eq!(json_number(f64::from(0.9f32)), "0.8999999761581421");
        assert_eq!(json_number(0.5), "0.5");
        assert_eq!(json_number(0.0001), "0.0001");
        assert_eq!(json_number(0.00001), "1e-05");
        assert_eq!(json_number(-1.25e-7), "-1.25e-07");
        assert_eq!(json_number(1e14), "100000000000000.0");
        assert_eq!(json_number(1e15), "1e+15");
        assert_eq!(json_number(1e16), "1e+16");
        assert_eq!(json_number(f64::from(2.5e-5f32)), "2.499999936844688e-05");
        assert_eq!(json_number(f64::from(14.61f32)), "14.609999656677246");
        assert_eq!(json_number(f64::from(0.01f32)), "0.009999999776482582");
        assert_eq!(json_number(123.456), "123.456");
        assert_eq!(json_number(f64::INFINITY), "null");
        assert_eq!(c_fixed(7.0), "7.000000");
        assert_eq!(c_fixed(f32::INFINITY), "inf");
        assert_eq!(c_general(0.85), "0.85");
        assert_eq!(c_general(14.61), "14.61");
        assert_eq!(c_general(0.0), "0");
        assert_eq!(c_general(1234567.0), "1.23457e+06");
        assert_eq!(c_general(0.00001), "1e-05");
        assert_eq!(c_general(100000.0), "100000");
    }

    #[test]
    fn json_keys_are_sorted_and_compact() {
        let v = json!({"b": 1, "a": {"d": num(0.75), "c": num(f32::INFINITY)}});
        assert_eq!(dump_json(&v), r#"{"a":{"c":null,"d":0.75},"b":1}"#);
    }

    #[test]
    fn basenames() {
        assert_eq!(basename("/a/b/c.safetensors"), "c.safetensors");
        assert_eq!(basename("c:\\m\\x.ckpt"), "x.ckpt");
        assert_eq!(basename(""), "");
    }
}
