//! Split component files land where a single checkpoint's tensors do: the synthetic SD1
//! checkpoint, split into a standalone UNet, VAE and CLIP-L file (each with its usual
//! standalone names), loaded through `diffusion_model_path` + `vae_path` + `clip_l_path`,
//! renders the golden pictures of the single file. Runs with `SD_PARITY=full` (it writes
//! 2 GB of split files into the fixture cache once).

mod common;

use common::parity::{fixture, fixture_dir, full, mark_used, report, run_with};
use safetensors::SafeTensors;
use std::path::PathBuf;

/// (file in the fixture cache, prefix stripped from the single checkpoint's names).
const PARTS: [(&str, &str); 3] = [
    ("sd1_split_unet.safetensors", "model.diffusion_model."),
    ("sd1_split_vae.safetensors", "first_stage_model."),
    ("sd1_split_clip_l.safetensors", "cond_stage_model.transformer."),
];

fn split_parts() -> Vec<PathBuf> {
    let paths: Vec<PathBuf> = PARTS.iter().map(|(f, _)| fixture_dir().join(f)).collect();
    if paths.iter().all(|p| p.exists()) {
        paths.iter().for_each(|p| mark_used(p));
        return paths;
    }
    let file = std::fs::File::open(fixture("sd1.safetensors")).expect("open sd1.safetensors");
    // SAFETY: the fixture is not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.expect("map sd1.safetensors");
    let st = SafeTensors::deserialize(&map).expect("parse sd1.safetensors");
    for ((_, prefix), path) in PARTS.iter().zip(&paths) {
        let part: Vec<(String, safetensors::tensor::TensorView)> = st
            .tensors()
            .into_iter()
            .filter_map(|(name, view)| name.strip_prefix(prefix).map(|n| (n.to_string(), view)))
            .collect();
        assert!(!part.is_empty(), "no tensors under {prefix}");
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        safetensors::serialize_to_file(part, None, &tmp).expect("write split file");
        std::fs::rename(&tmp, path).expect("rename split file");
    }
    paths
}

#[test]
fn sd1_from_split_components() {
    if !full() {
        eprintln!("skipped: set SD_PARITY=full");
        return;
    }
    let parts = split_parts();
    let pick = ["sampler_euler", "img2img"];
    report(&run_with(
        "sd1",
        |c| pick.contains(&c.name.as_str()),
        |p, arena| {
            p.model_path = std::ptr::null();
            p.diffusion_model_path = arena.str(&parts[0].to_string_lossy());
            p.vae_path = arena.str(&parts[1].to_string_lossy());
            p.clip_l_path = arena.str(&parts[2].to_string_lossy());
        },
    ));
}
