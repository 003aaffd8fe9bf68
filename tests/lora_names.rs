//! LoRA names → model weights: every tensor of the synthetic LoRA files (kohya, LoCon,
//! LoHa, LoKr, PEFT, old diffusers processors, full diffs, SDXL with its fused bigG q/k/v)
//! finds a weight of the synthetic checkpoint it was made for, as the part it is. Only the
//! files' headers are read.

mod common;

use common::parity::fixture;
use stable_diffusion::io::lora::{LoraFile, Target};
use stable_diffusion::io::{ModelFiles, SdVersion};
use stable_diffusion::models::adapter::lora::TENSOR_PARTS;
use std::collections::HashSet;

/// The internal weight names of a checkpoint and its version.
fn model(file: &str) -> (HashSet<String>, SdVersion) {
    let mut files = ModelFiles::new();
    files.add(fixture(file), "").expect("checkpoint header");
    let version = files.detect_version().expect("version");
    files.convert_names(Some(version));
    (files.tensors().iter().map(|t| t.name().to_string()).collect(), version)
}

fn targets(lora: &str, weights: &HashSet<String>, version: SdVersion) -> (LoraFile, Vec<Target>) {
    let file = LoraFile::open(&fixture(&format!("loras/{lora}")).to_string_lossy(), version, false).expect("LoRA header");
    let targets = file.targets(&|n| weights.contains(n));
    (file, targets)
}

fn find<'a>(targets: &'a [Target], weight: &str) -> &'a Target {
    targets.iter().find(|t| t.weight == weight).unwrap_or_else(|| panic!("no target {weight}"))
}

#[test]
fn every_sd1_lora_tensor_maps_to_a_weight() {
    let (weights, version) = model("sd1.safetensors");
    assert_eq!(version, SdVersion::Sd1);
    let files = [
        ("lora_sd1.safetensors", 792),
        ("locon_sd1.safetensors", 110),
        ("loha_sd1.safetensors", 214),
        ("lokr_sd1.safetensors", 205),
        ("peft_sd1.safetensors", 64),
        ("lora_diffusers_sd1.safetensors", 64),
        ("lora_diff_sd1.safetensors", 45),
    ];
    for (lora, count) in files {
        let (file, targets) = targets(lora, &weights, version);
        assert_eq!(file.tensors().len(), count, "{lora}");
        let mapped: usize = targets.iter().flat_map(|t| t.pieces.values()).map(|p| p.len()).sum();
        assert_eq!(mapped, count, "{lora}: every tensor maps");
        for t in &targets {
            assert!(weights.contains(&t.weight));
            for parts in t.pieces.values() {
                for part in parts.keys() {
                    assert!(TENSOR_PARTS.contains(&part.as_str()) || part == "alpha" || part == "scale", "{lora}: part {part}");
                }
            }
        }
    }
    let (_, t) = targets("peft_sd1.safetensors", &weights, version);
    let to_k = find(&t, "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_k.weight");
    assert_eq!(to_k.pieces[&0].keys().collect::<Vec<_>>(), ["lora_down", "lora_up"]);
    find(&t, "model.diffusion_model.middle_block.1.transformer_blocks.0.ff.net.0.proj.weight");
    let (_, t) = targets("lora_diffusers_sd1.safetensors", &weights, version);
    find(&t, "model.diffusion_model.middle_block.1.transformer_blocks.0.attn1.to_out.0.weight");
    let (_, t) = targets("lora_diff_sd1.safetensors", &weights, version);
    let bias = find(&t, "model.diffusion_model.output_blocks.10.1.transformer_blocks.0.ff.net.2.bias");
    assert_eq!(bias.pieces[&0].keys().collect::<Vec<_>>(), ["diff"]);
    find(&t, "cond_stage_model.transformer.text_model.encoder.layers.5.mlp.fc1.weight");
    let (_, t) = targets("lokr_sd1.safetensors", &weights, version);
    let v = find(&t, "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_v.weight");
    assert_eq!(v.pieces[&0].keys().collect::<Vec<_>>(), ["alpha", "lokr_w1_a", "lokr_w1_b", "lokr_w2"]);
    let (_, t) = targets("locon_sd1.safetensors", &weights, version);
    let conv = find(&t, "model.diffusion_model.input_blocks.1.0.in_layers.2.weight");
    assert_eq!(conv.pieces[&0].keys().collect::<Vec<_>>(), ["alpha", "lora_down", "lora_mid", "lora_up"]);
    find(&t, "model.diffusion_model.input_blocks.4.0.skip_connection.weight");
    let (_, t) = targets("lora_sd1.safetensors", &weights, version);
    find(&t, "cond_stage_model.transformer.text_model.encoder.layers.11.self_attn.q_proj.weight");
}

#[test]
fn sdxl_lora_reaches_both_text_encoders_and_the_fused_bigg_projections() {
    let (weights, version) = model("sdxl.safetensors");
    assert!(version.is_sdxl());
    let (file, t) = targets("lora_sdxl.safetensors", &weights, version);
    let mapped: usize = t.iter().flat_map(|t| t.pieces.values()).map(|p| p.len()).sum();
    assert_eq!((file.tensors().len(), mapped), (300, 300));
    let in_proj = find(&t, "cond_stage_model.1.transformer.text_model.encoder.layers.15.self_attn.in_proj.weight");
    assert_eq!(in_proj.pieces.keys().copied().collect::<Vec<_>>(), [0, 1, 2], "q, k, v");
    find(&t, "cond_stage_model.transformer.text_model.encoder.layers.6.self_attn.q_proj.weight");
    find(&t, "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight");
}
