//! The field rule: every field of `sd_ctx_params_t`, `sd_img_gen_params_t` and
//! `sd_vid_gen_params_t` (and of the structs inside them) acts or draws a warning naming it.
//! The ABI manifest's field list is walked against `pipeline::fields::FIELDS`, so a field
//! added to the header without a row fails here; each warned field is then set (by its
//! manifest offset and type, on top of the `*_init` defaults) on the synthetic SD1 model and
//! its name must reach the log callback. Warnings come before a request is checked, so each
//! field is tried in a request refused afterwards (picture: batch_count 0; video: SD1 makes
//! no video, so no video model is needed) and all picture fields together in one real
//! 64x64, 1-step generation.

mod common;

use common::manifest;
use common::parity::fixture;
use serde_json::Value;
use stable_diffusion::capi::*;
use stable_diffusion::pipeline::fields::{rule, Use, EXTRA_SAMPLE_ARGS, FIELDS, MODEL_ARGS};
use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_void, CString};
use std::ptr::{null, null_mut};
use std::sync::Mutex;

const TOP: [&str; 3] = ["sd_ctx_params_t", "sd_img_gen_params_t", "sd_vid_gen_params_t"];

/// One field reached from a top-level struct.
#[derive(Clone, Debug)]
struct Field {
    /// Dotted path from the top-level struct ("pm_params.id_images").
    path: String,
    /// The C struct holding it and its name there.
    strukt: String,
    name: String,
    /// The canonical C type.
    ty: String,
    offset: usize,
    /// Rows of the path's prefixes, outermost first.
    uses: Vec<(String, Use)>,
}

/// The struct a field's type names (by value or through a pointer), when the manifest has it.
fn struct_of(m: &Value, ty: &str) -> Option<String> {
    let base = ty.trim_end_matches('*').trim().trim_start_matches("const ").trim_start_matches("struct ").trim();
    (base != "sd_image_t" && m["structs"].get(base).is_some()).then(|| base.to_string())
}

fn walk(m: &Value, strukt: &str, prefix: &str, base: usize, uses: &[(String, Use)], out: &mut Vec<Field>) {
    for f in m["structs"][strukt]["fields"].as_array().expect("fields") {
        let name = f["name"].as_str().unwrap().to_string();
        let ty = f["canonical"].as_str().unwrap().to_string();
        let path = format!("{prefix}{name}");
        let mut here = uses.to_vec();
        here.push((path.clone(), rule(strukt, &name).unwrap_or(Use::Acts)));
        let offset = base + f["offset"].as_u64().unwrap() as usize;
        out.push(Field { path: path.clone(), strukt: strukt.to_string(), name, ty: ty.clone(), offset, uses: here.clone() });
        if let Some(inner) = struct_of(m, &ty) {
            // Fields behind a pointer have no offset in the top-level struct.
            let inner_base = if ty.ends_with('*') { usize::MAX / 2 } else { offset };
            walk(m, &inner, &format!("{path}."), inner_base, &here, out);
        }
    }
}

fn fields_of(m: &Value, top: &str) -> Vec<Field> {
    let mut out = Vec::new();
    walk(m, top, "", 0, &[], &mut out);
    out
}

/// The outermost prefix of `f` that warns, and the name its warning must contain.
fn warned_by(f: &Field) -> Option<String> {
    f.uses.iter().find_map(|(path, u)| match u {
        Use::Acts | Use::Covered => None,
        _ => Some(path.clone()),
    })
}

#[test]
fn the_table_covers_exactly_the_manifest_fields() {
    let m = manifest();
    let mut reached = BTreeSet::new();
    for top in TOP {
        for f in fields_of(&m, top) {
            reached.insert((f.strukt.clone(), f.name.clone()));
        }
    }
    let rows: BTreeSet<(String, String)> =
        FIELDS.iter().flat_map(|(s, fs)| fs.iter().map(move |(f, _)| (s.to_string(), f.to_string()))).collect();
    let missing: Vec<String> = reached.difference(&rows).map(|(s, f)| format!("{s}.{f}")).collect();
    let extra: Vec<String> = rows.difference(&reached).map(|(s, f)| format!("{s}.{f}")).collect();
    assert!(missing.is_empty(), "fields without a row in pipeline::fields::FIELDS: {missing:?}");
    assert!(extra.is_empty(), "rows of pipeline::fields::FIELDS the manifest does not have: {extra:?}");
    let n: usize = FIELDS.iter().map(|(_, fs)| fs.len()).sum();
    assert_eq!(n, rows.len(), "a field has two rows");
    // A field is covered only where something else decides for it.
    for top in TOP {
        for f in fields_of(&m, top) {
            if matches!(f.uses.last().unwrap().1, Use::Covered) {
                let counted = ["_count", "_size"].iter().any(|s| f.name.ends_with(s));
                assert!(counted || warned_by(&f).is_some(), "{top}.{} is Covered but nothing warns for it", f.path);
            }
        }
    }
}

/// Every acting key is read somewhere in the library (as a string literal).
#[test]
fn acting_keys_are_read() {
    let mut sources = String::new();
    let mut dirs = vec![common::root().join("src")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("pipeline/fields.rs") {
                sources.push_str(&std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    for (key, u) in EXTRA_SAMPLE_ARGS.iter().chain(MODEL_ARGS) {
        if *u == Use::Acts {
            assert!(sources.contains(&format!("\"{key}\"")), "key {key} is marked as acting but nothing reads it");
        }
    }
}

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn on_log(_level: sd_log_level_t, text: *const c_char, _data: *mut c_void) {
    // SAFETY: a NUL-terminated message from the library.
    let s = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned();
    LOG.lock().unwrap().push(s);
}

/// Keeps what the params point to alive.
#[derive(Default)]
struct Arena {
    strings: Vec<CString>,
    bytes: Vec<Vec<u8>>,
    floats: Vec<Vec<f32>>,
    images: Vec<Vec<sd_image_t>>,
}

impl Arena {
    fn image(&mut self) -> sd_image_t {
        let mut data = vec![128u8; 8 * 8 * 3];
        let p = data.as_mut_ptr();
        self.bytes.push(data);
        sd_image_t { width: 8, height: 8, channel: 3, data: p }
    }
}

/// A file that loads as an (empty) component: one tensor nobody reads.
fn tiny_safetensors() -> String {
    tiny_safetensors_with("unused_tensor", "")
}

/// A one-tensor safetensors file whose tensor is `name` (`tag` tells files apart).
fn tiny_safetensors_with(name: &str, tag: &str) -> String {
    let path = std::env::temp_dir().join(format!("field-rule-{}{tag}.safetensors", std::process::id()));
    let header = format!(r#"{{"{name}":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#);
    let header = header.as_bytes();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&0f32.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    path.to_string_lossy().into_owned()
}

/// Sets field `f` (of the struct at `base`) to a value other than its current (default) one;
/// arrays get one element and their count. `siblings` are the fields of the same struct.
///
/// # Safety
/// `base` points to the top-level struct `f` was walked from.
unsafe fn set_field(base: *mut u8, f: &Field, siblings: &[Field], file: &str, arena: &mut Arena) {
    let at = unsafe { base.add(f.offset) };
    // SAFETY (all writes): `at` is the field's address inside the struct.
    unsafe {
        match f.ty.as_str() {
            "_Bool" => *at ^= 1,
            "int" | "unsigned int" => {
                let v = (at as *mut c_int).read_unaligned();
                (at as *mut c_int).write_unaligned(v + 1);
            }
            "long" | "unsigned long" => {
                let v = (at as *mut i64).read_unaligned();
                (at as *mut i64).write_unaligned(v + 1);
            }
            "float" => {
                let v = (at as *mut f32).read_unaligned();
                (at as *mut f32).write_unaligned(if v.is_finite() { v + 0.25 } else { 0.5 });
            }
            "const char *" | "char *" => {
                let c = CString::new(file).unwrap();
                (at as *mut *const c_char).write_unaligned(c.as_ptr());
                arena.strings.push(c);
            }
            t if t.starts_with("enum ") => {
                let v = (at as *mut i32).read_unaligned();
                (at as *mut i32).write_unaligned(v + 1);
            }
            "sd_image_t" => (at as *mut sd_image_t).write_unaligned(arena.image()),
            t if t.ends_with('*') => {
                let count_names = [format!("{}_count", f.name), format!("{}_size", f.name), "frame_count".into(), "layer_count".into()];
                let count = siblings
                    .iter()
                    .find(|s| s.strukt == f.strukt && count_names.contains(&s.name))
                    .unwrap_or_else(|| panic!("no count field for {}", f.path));
                let ptr: *mut c_void = match t.trim_end_matches('*').trim() {
                    "sd_image_t" => {
                        let mut v = vec![arena.image()];
                        let p = v.as_mut_ptr() as *mut c_void;
                        arena.images.push(v);
                        p
                    }
                    "sd_audio_t" => {
                        let mut samples = vec![0.0f32; 2];
                        let a = sd_audio_t { sample_rate: 16000, channels: 1, sample_count: 2, data: samples.as_mut_ptr() };
                        arena.floats.push(samples);
                        let mut raw = vec![0u8; std::mem::size_of::<sd_audio_t>()];
                        (raw.as_mut_ptr() as *mut sd_audio_t).write_unaligned(a);
                        let p = raw.as_mut_ptr() as *mut c_void;
                        arena.bytes.push(raw);
                        p
                    }
                    _ => {
                        // One zeroed element (a reference video without frames, a 0 / 0.0 value).
                        let mut raw = vec![0u8; 256];
                        let p = raw.as_mut_ptr() as *mut c_void;
                        arena.bytes.push(raw);
                        p
                    }
                };
                (at as *mut *mut c_void).write_unaligned(ptr);
                let c = base.add(count.offset);
                match count.ty.as_str() {
                    "unsigned long" | "long" => (c as *mut u64).write_unaligned(1),
                    _ => (c as *mut u32).write_unaligned(1),
                }
            }
            other => panic!("{}: no test value for type {other}", f.path),
        }
    }
}

/// For each warned field of `top`: the field to set (itself, or its first settable leaf).
fn warned_fields(m: &Value, top: &str) -> Vec<(Field, String)> {
    let all = fields_of(m, top);
    let mut out: Vec<(Field, String)> = Vec::new();
    for f in &all {
        let Some(by) = warned_by(f) else { continue };
        let settable = f.offset < usize::MAX / 4 && struct_of(m, &f.ty).is_none_or(|_| f.ty.ends_with('*'));
        if settable && !out.iter().any(|(_, b)| *b == by) {
            out.push((f.clone(), by));
        }
    }
    out
}

/// Sets every warned field of `v` (a `top`); returns the names their warnings must carry.
fn set_all_warned<T>(m: &Value, top: &str, v: &mut T, file: &str, arena: &mut Arena) -> Vec<String> {
    let all = fields_of(m, top);
    let warned = warned_fields(m, top);
    for (f, _) in &warned {
        // SAFETY: f was walked from `top`, which `v` is.
        unsafe { set_field(v as *mut T as *mut u8, f, &all, file, arena) };
    }
    warned.into_iter().map(|(_, by)| by).collect()
}

fn assert_all_named(names: &[String], what: &str) {
    let log = LOG.lock().unwrap();
    for by in names {
        assert!(log.iter().any(|l| l.contains(&format!("ignoring {by}"))), "{what}: no warning naming {by}; log: {log:#?}");
    }
}

/// A struct as its `*_init` function writes it.
fn init<T>(f: unsafe extern "C" fn(*mut T)) -> T {
    let mut v = std::mem::MaybeUninit::<T>::uninit();
    // SAFETY: the init functions write every field.
    unsafe {
        f(v.as_mut_ptr());
        v.assume_init()
    }
}

fn new_ctx(cp: &sd_ctx_params_t) -> *mut sd_ctx_t {
    // SAFETY: valid params whose pointers outlive the call.
    let ctx = unsafe { new_sd_ctx(cp) };
    assert!(!ctx.is_null(), "context creation failed: {:?}", LOG.lock().unwrap());
    ctx
}

fn ctx_params(model: &CString) -> sd_ctx_params_t {
    let mut cp = init(sd_ctx_params_init);
    cp.model_path = model.as_ptr();
    cp.n_threads = 2;
    cp
}

fn img_params(prompt: &CString) -> sd_img_gen_params_t {
    let mut p = init(sd_img_gen_params_init);
    p.prompt = prompt.as_ptr();
    (p.width, p.height, p.seed) = (64, 64, 42);
    p.sample_params.sample_steps = 1;
    p
}

fn vid_params(prompt: &CString) -> sd_vid_gen_params_t {
    let mut p = init(sd_vid_gen_params_init);
    p.prompt = prompt.as_ptr();
    (p.width, p.height, p.seed, p.video_frames) = (64, 64, 42, 1);
    p.sample_params.sample_steps = 1;
    p
}

/// Generates (`real`), or sends a request refused after its warnings (batch_count 0), which
/// is much faster.
fn generate_img(ctx: *mut sd_ctx_t, p: &sd_img_gen_params_t, real: bool) {
    let mut p = *p;
    if !real {
        p.batch_count = 0;
    }
    let mut images = null_mut();
    let mut n: c_int = 0;
    // SAFETY: valid context and params, writable out-pointers.
    let ok = unsafe { generate_image(ctx, &p, &mut images, &mut n) }.get();
    assert_eq!(ok, real, "generate_image: {:?}", LOG.lock().unwrap());
    // SAFETY: what generate_image returned.
    unsafe { free_sd_images(images, n) };
}

fn generate_vid(ctx: *mut sd_ctx_t, p: &sd_vid_gen_params_t) {
    let mut frames = null_mut();
    let mut n: c_int = 0;
    let mut audio = null_mut();
    // SAFETY: valid context and params, writable out-pointers (SD1 refuses video).
    let ok = unsafe { generate_video(ctx, p, &mut frames, &mut n, &mut audio) }.get();
    assert!(!ok, "SD1 generated a video");
}

/// Runs `f` with the log cleared and asserts a warning names `name`.
fn expect_warning(what: &str, name: &str, f: impl FnOnce()) {
    LOG.lock().unwrap().clear();
    f();
    let log = LOG.lock().unwrap();
    assert!(
        log.iter().any(|l| l.contains(&format!("ignoring {name}"))),
        "{what}: no warning naming {name}; log: {log:#?}"
    );
}

#[test]
fn every_warned_field_and_key_warns_on_sd1() {
    let m = manifest();
    sd_set_log_callback(Some(on_log), null_mut());
    let model = CString::new(fixture("sd1.safetensors").to_string_lossy().as_bytes()).unwrap();
    let prompt = CString::new("a photo of a cat").unwrap();
    let file = tiny_safetensors();
    let mut arena = Arena::default();
    let mut checked = Vec::new();

    // Context fields: all in one context (each warning names its own field; a context per
    // field would cost a model load each).
    let mut cp = ctx_params(&model);
    let mut ctx_warned = set_all_warned(&m, "sd_ctx_params_t", &mut cp, &file, &mut arena);
    // SD 1.x takes IP-Adapters: its ip_adapter_path is loaded, not warned about (and the
    // tiny file, which holds no adapter, would fail the context as in the reference).
    cp.ip_adapter_path = null();
    ctx_warned.retain(|by| by != "ip_adapter_path");
    // A family without sound reads audio_vae_path as LTX-2.3's audio VAE, like the reference:
    // an LTX-2.3 one is ignored with the warning, any other file fails the context.
    let ltx_audio = CString::new(tiny_safetensors_with("vocoder.conv_pre.weight", "-ltx-audio")).unwrap();
    cp.audio_vae_path = ltx_audio.as_ptr();
    let mut refused = ctx_params(&model);
    let other_audio = CString::new(file.as_bytes()).unwrap();
    refused.audio_vae_path = other_audio.as_ptr();
    // SAFETY: valid params whose pointers outlive the call.
    assert!(unsafe { new_sd_ctx(&refused) }.is_null(), "SD 1.x with an audio VAE that is not LTX-2.3's must fail new_sd_ctx");
    LOG.lock().unwrap().clear();
    let all_ctx = new_ctx(&cp);
    generate_img(all_ctx, &img_params(&prompt), false);
    free_sd_ctx(all_ctx);
    assert_all_named(&ctx_warned, "sd_ctx_params_t");
    checked.extend(ctx_warned);

    let ctx = new_ctx(&ctx_params(&model));
    // Every warned picture field at once, in a real generation: all warnings, one picture.
    let mut all_set = img_params(&prompt);
    let warned = set_all_warned(&m, "sd_img_gen_params_t", &mut all_set, &file, &mut arena);
    LOG.lock().unwrap().clear();
    generate_img(ctx, &all_set, true);
    assert_all_named(&warned, "the joint sd_img_gen_params_t run");
    for top in ["sd_img_gen_params_t", "sd_vid_gen_params_t"] {
        let all = fields_of(&m, top);
        for (f, by) in warned_fields(&m, top) {
            expect_warning(&format!("{top}.{}", f.path), &by, || {
                if top == "sd_img_gen_params_t" {
                    let mut p = img_params(&prompt);
                    // SAFETY: f was walked from sd_img_gen_params_t.
                    unsafe { set_field(&mut p as *mut _ as *mut u8, &f, &all, &file, &mut arena) };
                    generate_img(ctx, &p, false);
                } else {
                    let mut p = vid_params(&prompt);
                    // SAFETY: f was walked from sd_vid_gen_params_t.
                    unsafe { set_field(&mut p as *mut _ as *mut u8, &f, &all, &file, &mut arena) };
                    generate_vid(ctx, &p);
                }
            });
            checked.push(format!("{top}.{by}"));
        }
    }

    // Keys: each warned extra_sample_args key, in a picture and a video request.
    for (key, u) in EXTRA_SAMPLE_ARGS {
        if *u == Use::Acts {
            continue;
        }
        let args = CString::new(format!("{key}=1")).unwrap();
        expect_warning(key, &format!("sample_params.extra_sample_args key {key}"), || {
            let mut p = img_params(&prompt);
            p.sample_params.extra_sample_args = args.as_ptr();
            generate_img(ctx, &p, false);
        });
        expect_warning(key, &format!("sample_params.extra_sample_args key {key}"), || {
            let mut p = vid_params(&prompt);
            p.sample_params.extra_sample_args = args.as_ptr();
            generate_vid(ctx, &p);
        });
        checked.push(key.to_string());
    }
    assert!(MODEL_ARGS.iter().all(|(_, u)| *u == Use::Acts), "a warned model_args key needs a case here");
    // A key no option reads (a misspelling) warns too, where the reference is silent.
    let misspelt = CString::new("shedule_shift=2").unwrap();
    expect_warning("shedule_shift", "sample_params.extra_sample_args key shedule_shift", || {
        let mut p = img_params(&prompt);
        p.sample_params.extra_sample_args = misspelt.as_ptr();
        generate_img(ctx, &p, false);
    });

    // PhotoMaker's own warnings (no ID images, no trigger word) come from the extension, with
    // a PhotoMaker file: golden/photomaker-v1 and -v2 render those requests.
    free_sd_ctx(ctx);
    sd_set_log_callback(None, null_mut());
    let _ = std::fs::remove_file(&file);
    eprintln!("checked {} warned fields and keys: {checked:?}", checked.len());
}
