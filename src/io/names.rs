//! Tensor-name conversion: every naming scheme the reference accepts (diffusers,
//! open_clip, llama.cpp-style GGUF names, kohya/PEFT/LyCORIS LoRA keys, SD3/Flux/Lumina2
//! diffusers transformers, ...) mapped onto the one internal (original LDM/BFL) naming
//! that model declarations use.
//!
//! The tables are facts about those naming schemes. The order in which they are applied,
//! and which of two overlapping prefixes wins, follows the reference exactly (checked in
//! tests against names the reference converted).

use super::version::SdVersion;
use once_cell::sync::Lazy;
use std::collections::HashMap;

type Pairs = Vec<(String, String)>;

fn pairs(p: &[(&str, &str)]) -> Pairs {
    p.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

/// Replaces the first occurrence of `from` with `to`; true if found.
fn replace_first(s: &mut String, from: &str, to: &str) -> bool {
    match s.find(from) {
        Some(pos) => {
            s.replace_range(pos..pos + from.len(), to);
            true
        }
        None => false,
    }
}

/// For each pair in order, replaces the first occurrence of `.0` with `.1`.
fn replace_each_str(s: &mut String, map: &[(&str, &str)]) {
    for (from, to) in map {
        replace_first(s, from, to);
    }
}

/// Replaces the first prefix (in order) that `s` starts with; true if one matched.
fn replace_prefix<'a>(s: &mut String, map: impl IntoIterator<Item = (&'a str, &'a str)>) -> bool {
    for (from, to) in map {
        if s.starts_with(from) {
            s.replace_range(..from.len(), to);
            return true;
        }
    }
    false
}

fn replace_prefix_pairs(s: &mut String, map: &[(String, String)]) -> bool {
    replace_prefix(s, map.iter().map(|(a, b)| (a.as_str(), b.as_str())))
}

// ---------------------------------------------------------------------------------------
// Text encoders

static OPEN_CLIP_MODEL: Lazy<HashMap<&'static str, &'static str>> = Lazy::new(|| {
    HashMap::from([
        ("model.ln_final.bias", "transformer.text_model.final_layer_norm.bias"),
        ("model.ln_final.weight", "transformer.text_model.final_layer_norm.weight"),
        ("model.positional_embedding", "transformer.text_model.embeddings.position_embedding.weight"),
        ("model.token_embedding.weight", "transformer.text_model.embeddings.token_embedding.weight"),
        ("model.text_projection", "transformer.text_model.text_projection"),
        ("model.visual.class_embedding", "transformer.vision_model.embeddings.class_embedding"),
        ("model.visual.conv1.weight", "transformer.vision_model.embeddings.patch_embedding.weight"),
        ("model.visual.ln_post.bias", "transformer.vision_model.post_layernorm.bias"),
        ("model.visual.ln_post.weight", "transformer.vision_model.post_layernorm.weight"),
        ("model.visual.ln_pre.bias", "transformer.vision_model.pre_layernorm.bias"),
        ("model.visual.ln_pre.weight", "transformer.vision_model.pre_layernorm.weight"),
        ("model.visual.positional_embedding", "transformer.vision_model.embeddings.position_embedding.weight"),
        ("model.visual.proj", "transformer.visual_projection.weight"),
    ])
});

static OPEN_CLIP_RESBLOCK: Lazy<HashMap<&'static str, &'static str>> = Lazy::new(|| {
    HashMap::from([
        ("attn.in_proj_bias", "self_attn.in_proj.bias"),
        ("attn.in_proj_weight", "self_attn.in_proj.weight"),
        ("attn.out_proj.bias", "self_attn.out_proj.bias"),
        ("attn.out_proj.weight", "self_attn.out_proj.weight"),
        ("ln_1.bias", "layer_norm1.bias"),
        ("ln_1.weight", "layer_norm1.weight"),
        ("ln_2.bias", "layer_norm2.bias"),
        ("ln_2.weight", "layer_norm2.weight"),
        ("mlp.c_fc.bias", "mlp.fc1.bias"),
        ("mlp.c_fc.weight", "mlp.fc1.weight"),
        ("mlp.c_proj.bias", "mlp.fc2.bias"),
        ("mlp.c_proj.weight", "mlp.fc2.weight"),
    ])
});

/// open_clip (SD 2.x / SDXL bigG) names to Hugging Face CLIP names.
fn open_clip_to_hf_clip(mut name: String) -> String {
    if let Some(n) = OPEN_CLIP_MODEL.get(name.as_str()) {
        name = n.to_string();
    }
    match name.as_str() {
        "transformer.vision_model.pre_layrnorm.weight" => name = "transformer.vision_model.pre_layernorm.weight".into(),
        "transformer.vision_model.pre_layrnorm.bias" => name = "transformer.vision_model.pre_layernorm.bias".into(),
        _ => {}
    }
    for (open_prefix, hf_prefix) in [
        ("model.transformer.resblocks.", "transformer.text_model.encoder.layers."),
        ("model.visual.transformer.resblocks.", "transformer.vision_model.encoder.layers."),
    ] {
        if let Some(rest) = name.strip_prefix(open_prefix) {
            if let Some((idx, suffix)) = rest.split_once('.') {
                if let Some(new_suffix) = OPEN_CLIP_RESBLOCK.get(suffix) {
                    name = format!("{hf_prefix}{idx}.{new_suffix}");
                }
            }
        }
    }
    name
}

const CLIP_NAMES: &[(&str, &str)] = &[
    ("transformer.text_projection.weight", "transformer.text_model.text_projection"),
    ("model.text_projection.weight", "transformer.text_model.text_projection"),
    ("vision_model.visual_projection.weight", "visual_projection.weight"),
];

/// llama.cpp T5 names to the original ones.
const T5_NAMES: &[(&str, &str)] = &[
    ("enc.", "encoder."),
    ("blk.", "block."),
    ("output_norm.", "final_layer_norm."),
    ("attn_q.", "layer.0.SelfAttention.q."),
    ("attn_k.", "layer.0.SelfAttention.k."),
    ("attn_v.", "layer.0.SelfAttention.v."),
    ("attn_o.", "layer.0.SelfAttention.o."),
    ("attn_norm.", "layer.0.layer_norm."),
    ("ffn_norm.", "layer.1.layer_norm."),
    ("ffn_up.", "layer.1.DenseReluDense.wi_1."),
    ("ffn_down.", "layer.1.DenseReluDense.wo."),
    ("ffn_gate.", "layer.1.DenseReluDense.wi_0."),
    ("attn_rel_b.", "layer.0.SelfAttention.relative_attention_bias."),
    ("token_embd.", "shared."),
];

/// llama.cpp LLM names to Hugging Face ones.
const LLM_NAMES: &[(&str, &str)] = &[
    ("attn_sinks.weight", "self_attn.sinks"),
    ("token_embd.", "model.embed_tokens."),
    ("blk.", "model.layers."),
    ("attn_q.", "self_attn.q_proj."),
    ("attn_k.", "self_attn.k_proj."),
    ("attn_v.", "self_attn.v_proj."),
    ("attn_q_norm.", "self_attn.q_norm."),
    ("attn_k_norm.", "self_attn.k_norm."),
    ("attn_output.", "self_attn.o_proj."),
    ("attn_norm.", "input_layernorm."),
    ("attn_post_norm.", "post_attention_norm."),
    ("ffn_gate_inp.", "mlp.router."),
    ("ffn_gate_exps.", "mlp.experts.gate_proj."),
    ("ffn_up_exps.", "mlp.experts.up_proj."),
    ("ffn_down_exps.", "mlp.experts.down_proj."),
    ("ffn_down.", "mlp.down_proj."),
    ("ffn_gate.", "mlp.gate_proj."),
    ("ffn_up.", "mlp.up_proj."),
    ("ffn_post_norm.", "post_ffw_norm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("output_norm.", "model.norm."),
];

const LLM_VISION_NAMES: &[(&str, &str)] = &[
    ("mm.", "merger.mlp."),
    ("v.post_ln.", "merger.ln_q."),
    ("v.patch_embd.weight", "patch_embed.proj.0.weight"),
    ("patch_embed.proj.0.weight.1", "patch_embed.proj.1.weight"),
    ("v.patch_embd.weight.1", "patch_embed.proj.1.weight"),
    ("v.blk.", "blocks."),
    ("attn_q.", "attn.q_proj."),
    ("attn_k.", "attn.k_proj."),
    ("attn_v.", "attn.v_proj."),
    ("attn_out.", "attn.proj."),
    ("ffn_down.", "mlp.down_proj."),
    ("ffn_gate.", "mlp.gate_proj."),
    ("ffn_up.", "mlp.up_proj."),
    ("ln1.", "norm1."),
    ("ln2.", "norm2."),
];

fn convert_cond_stage_name(mut name: String) -> String {
    if name.contains("t5xxl") {
        replace_each_str(&mut name, T5_NAMES);
    } else if name.contains("llm") {
        if name.contains("llm.visual") {
            replace_each_str(&mut name, LLM_VISION_NAMES);
        } else {
            replace_each_str(&mut name, LLM_NAMES);
        }
    } else {
        name = open_clip_to_hf_clip(name);
        replace_each_str(&mut name, CLIP_NAMES);
    }
    name
}

const QWEN3_VL_DEEPSTACK: &[(&str, &str)] = &[
    ("v.deepstack_merger_list.", "deepstack_merger_list."),
    ("v.deepstack.5.", "deepstack_merger_list.0."),
    ("v.deepstack.8.", "deepstack_merger_list.0."),
    ("v.deepstack.11.", "deepstack_merger_list.1."),
    ("v.deepstack.16.", "deepstack_merger_list.1."),
    ("v.deepstack.17.", "deepstack_merger_list.2."),
    ("v.deepstack.24.", "deepstack_merger_list.2."),
    ("fc1.", "linear_fc1."),
    ("fc2.", "linear_fc2."),
    ("ffn_up.", "linear_fc1."),
    ("ffn_down.", "linear_fc2."),
    ("ffn_norm.", "norm."),
];

const QWEN3_VL_VISION: &[(&str, &str)] = &[
    ("mm.0.", "merger.linear_fc1."),
    ("mm.2.", "merger.linear_fc2."),
    ("v.post_ln.", "merger.norm."),
    ("v.position_embd.weight", "pos_embed.weight"),
    ("v.patch_embd.weight.1", "patch_embed.proj.1.weight"),
    ("v.patch_embd.weight", "patch_embed.proj.0.weight"),
    ("v.patch_embd.bias", "patch_embed.bias"),
    ("v.blk.", "blocks."),
    ("attn_qkv.", "attn.qkv."),
    ("attn_out.", "attn.proj."),
    ("ffn_up.", "mlp.linear_fc1."),
    ("ffn_down.", "mlp.linear_fc2."),
    ("ln1.", "norm1."),
    ("ln2.", "norm2."),
];

fn convert_qwen3_vl_vision(mut name: String) -> String {
    if name.contains("v.deepstack_merger_list.") || name.contains("v.deepstack.") {
        replace_each_str(&mut name, QWEN3_VL_DEEPSTACK);
    } else {
        replace_each_str(&mut name, QWEN3_VL_VISION);
    }
    name
}

// ---------------------------------------------------------------------------------------
// UNets (diffusers → LDM), after diffusers' own conversion scripts

const UNET_TOP: &[(&str, &str)] = &[
    ("time_embed.0.weight", "time_embedding.linear_1.weight"),
    ("time_embed.0.bias", "time_embedding.linear_1.bias"),
    ("time_embed.2.weight", "time_embedding.linear_2.weight"),
    ("time_embed.2.bias", "time_embedding.linear_2.bias"),
    ("input_blocks.0.0.weight", "conv_in.weight"),
    ("input_blocks.0.0.bias", "conv_in.bias"),
    ("out.0.weight", "conv_norm_out.weight"),
    ("out.0.bias", "conv_norm_out.bias"),
    ("out.2.weight", "conv_out.weight"),
    ("out.2.bias", "conv_out.bias"),
];

const UNET_TOP_SDXL_EXTRA: &[(&str, &str)] = &[
    ("label_emb.0.0.weight", "add_embedding.linear_1.weight"),
    ("label_emb.0.0.bias", "add_embedding.linear_1.bias"),
    ("label_emb.0.2.weight", "add_embedding.linear_2.weight"),
    ("label_emb.0.2.bias", "add_embedding.linear_2.bias"),
];

const UNET_RESNET: &[(&str, &str)] = &[
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("emb_layers.1", "time_emb_proj"),
    ("skip_connection", "conv_shortcut"),
];

/// (LDM prefix, diffusers prefix) pairs for the SD 1.x/2.x UNet.
static UNET_LAYERS_SD1: Lazy<Pairs> = Lazy::new(|| {
    let mut m = Vec::new();
    for i in 0..4 {
        for j in 0..2 {
            m.push((format!("input_blocks.{}.0.", 3 * i + j + 1), format!("down_blocks.{i}.resnets.{j}.")));
            if i < 3 {
                m.push((format!("input_blocks.{}.1.", 3 * i + j + 1), format!("down_blocks.{i}.attentions.{j}.")));
            }
        }
        for j in 0..3 {
            m.push((format!("output_blocks.{}.0.", 3 * i + j), format!("up_blocks.{i}.resnets.{j}.")));
            // Also for block 0, which tiny UNets give attention layers.
            m.push((format!("output_blocks.{}.1.", 3 * i + j), format!("up_blocks.{i}.attentions.{j}.")));
        }
        if i < 3 {
            m.push((format!("input_blocks.{}.0.op.", 3 * (i + 1)), format!("down_blocks.{i}.downsamplers.0.conv.")));
            m.push((
                format!("output_blocks.{}.{}.", 3 * i + 2, if i == 0 { 1 } else { 2 }),
                format!("up_blocks.{i}.upsamplers.0."),
            ));
        }
    }
    m.push(("middle_block.1.".into(), "mid_block.attentions.0.".into()));
    for j in 0..2 {
        m.push((format!("middle_block.{}.", 2 * j), format!("mid_block.resnets.{j}.")));
    }
    m
});

static UNET_LAYERS_SDXL: Lazy<Pairs> = Lazy::new(|| {
    let mut m = Vec::new();
    for i in 0..3 {
        for j in 0..2 {
            m.push((format!("input_blocks.{}.0.", 3 * i + j + 1), format!("down_blocks.{i}.resnets.{j}.")));
            if i > 0 {
                m.push((format!("input_blocks.{}.1.", 3 * i + j + 1), format!("down_blocks.{i}.attentions.{j}.")));
            }
        }
        for j in 0..4 {
            m.push((format!("output_blocks.{}.0.", 3 * i + j), format!("up_blocks.{i}.resnets.{j}.")));
            if i < 2 {
                m.push((format!("output_blocks.{}.1.", 3 * i + j), format!("up_blocks.{i}.attentions.{j}.")));
            }
        }
        m.push((format!("input_blocks.{}.0.op.", 3 * (i + 1)), format!("down_blocks.{i}.downsamplers.0.conv.")));
        m.push((
            format!("output_blocks.{}.{}.", 3 * i + 2, if i == 0 { 1 } else { 2 }),
            format!("up_blocks.{i}.upsamplers.0."),
        ));
    }
    m.push(("output_blocks.2.2.conv.".into(), "output_blocks.2.1.conv.".into()));
    m.push(("middle_block.1.".into(), "mid_block.attentions.0.".into()));
    for j in 0..2 {
        m.push((format!("middle_block.{}.", 2 * j), format!("mid_block.resnets.{j}.")));
    }
    m
});

fn diffusers_unet_to_ldm(name: &str, sdxl: bool) -> String {
    let exact = UNET_TOP.iter().chain(if sdxl { UNET_TOP_SDXL_EXTRA } else { &[] });
    for (ldm, hf) in exact {
        if name == *hf {
            return ldm.to_string();
        }
    }
    let mut r = name.to_string();
    if r.contains("resnets") {
        for (ldm, hf) in UNET_RESNET {
            replace_first(&mut r, hf, ldm);
        }
    }
    let layers = if sdxl { &*UNET_LAYERS_SDXL } else { &*UNET_LAYERS_SD1 };
    for (ldm, hf) in layers {
        replace_first(&mut r, hf, ldm);
    }
    replace_each_str(&mut r, &[("to_out.weight", "to_out.0.weight"), ("to_out.bias", "to_out.0.bias")]);
    r
}

// ---------------------------------------------------------------------------------------
// DiT transformers (diffusers → original)

/// SD3 MMDiT: diffusers names of the first 38 blocks to the original ones.
static SD3_NAMES: Lazy<Pairs> = Lazy::new(|| {
    let mut m = pairs(&[
        ("time_text_embed.timestep_embedder.linear_1.weight", "t_embedder.mlp.0.weight"),
        ("time_text_embed.timestep_embedder.linear_1.bias", "t_embedder.mlp.0.bias"),
        ("time_text_embed.timestep_embedder.linear_2.weight", "t_embedder.mlp.2.weight"),
        ("time_text_embed.timestep_embedder.linear_2.bias", "t_embedder.mlp.2.bias"),
        ("time_text_embed.text_embedder.linear_1.weight", "y_embedder.mlp.0.weight"),
        ("time_text_embed.text_embedder.linear_1.bias", "y_embedder.mlp.0.bias"),
        ("time_text_embed.text_embedder.linear_2.weight", "y_embedder.mlp.2.weight"),
        ("time_text_embed.text_embedder.linear_2.bias", "y_embedder.mlp.2.bias"),
        ("pos_embed.pos_embed", "pos_embed"),
        ("pos_embed.proj.weight", "x_embedder.proj.weight"),
        ("pos_embed.proj.bias", "x_embedder.proj.bias"),
        ("proj_out.weight", "final_layer.linear.weight"),
        ("proj_out.bias", "final_layer.linear.bias"),
        ("norm_out.linear.weight", "final_layer.adaLN_modulation.1.weight"),
        ("norm_out.linear.bias", "final_layer.adaLN_modulation.1.bias"),
    ]);
    for i in 0..38 {
        let b = format!("transformer_blocks.{i}.");
        let d = format!("joint_blocks.{i}.");
        let per_block: &[(&str, &str)] = &[
            ("norm1.linear.weight", "x_block.adaLN_modulation.1.weight"),
            ("norm1.linear.bias", "x_block.adaLN_modulation.1.bias"),
            ("norm1_context.linear.weight", "context_block.adaLN_modulation.1.weight"),
            ("norm1_context.linear.bias", "context_block.adaLN_modulation.1.bias"),
            ("attn.to_q.weight", "x_block.attn.qkv.weight"),
            ("attn.to_q.bias", "x_block.attn.qkv.bias"),
            ("attn.to_k.weight", "x_block.attn.qkv.weight.1"),
            ("attn.to_k.bias", "x_block.attn.qkv.bias.1"),
            ("attn.to_v.weight", "x_block.attn.qkv.weight.2"),
            ("attn.to_v.bias", "x_block.attn.qkv.bias.2"),
            ("attn.add_q_proj.weight", "context_block.attn.qkv.weight"),
            ("attn.add_q_proj.bias", "context_block.attn.qkv.bias"),
            ("attn.add_k_proj.weight", "context_block.attn.qkv.weight.1"),
            ("attn.add_k_proj.bias", "context_block.attn.qkv.bias.1"),
            ("attn.add_v_proj.weight", "context_block.attn.qkv.weight.2"),
            ("attn.add_v_proj.bias", "context_block.attn.qkv.bias.2"),
            ("attn2.to_q.weight", "x_block.attn2.qkv.weight"),
            ("attn2.to_q.bias", "x_block.attn2.qkv.bias"),
            ("attn2.to_k.weight", "x_block.attn2.qkv.weight.1"),
            ("attn2.to_k.bias", "x_block.attn2.qkv.bias.1"),
            ("attn2.to_v.weight", "x_block.attn2.qkv.weight.2"),
            ("attn2.to_v.bias", "x_block.attn2.qkv.bias.2"),
            ("attn2.add_q_proj.weight", "context_block.attn2.qkv.weight"),
            ("attn2.add_q_proj.bias", "context_block.attn2.qkv.bias"),
            ("attn2.add_k_proj.weight", "context_block.attn2.qkv.weight.1"),
            ("attn2.add_k_proj.bias", "context_block.attn2.qkv.bias.1"),
            ("attn2.add_v_proj.weight", "context_block.attn2.qkv.weight.2"),
            ("attn2.add_v_proj.bias", "context_block.attn2.qkv.bias.2"),
            ("attn.norm_q.weight", "x_block.attn.ln_q.weight"),
            ("attn.norm_k.weight", "x_block.attn.ln_k.weight"),
            ("attn.norm_added_q.weight", "context_block.attn.ln_q.weight"),
            ("attn.norm_added_k.weight", "context_block.attn.ln_k.weight"),
            ("attn2.norm_q.weight", "x_block.attn2.ln_q.weight"),
            ("attn2.norm_k.weight", "x_block.attn2.ln_k.weight"),
            ("ff.net.0.proj.weight", "x_block.mlp.fc1.weight"),
            ("ff.net.0.proj.bias", "x_block.mlp.fc1.bias"),
            ("ff.net.2.weight", "x_block.mlp.fc2.weight"),
            ("ff.net.2.bias", "x_block.mlp.fc2.bias"),
            ("ff_context.net.0.proj.weight", "context_block.mlp.fc1.weight"),
            ("ff_context.net.0.proj.bias", "context_block.mlp.fc1.bias"),
            ("ff_context.net.2.weight", "context_block.mlp.fc2.weight"),
            ("ff_context.net.2.bias", "context_block.mlp.fc2.bias"),
            ("attn.to_out.0.weight", "x_block.attn.proj.weight"),
            ("attn.to_out.0.bias", "x_block.attn.proj.bias"),
            ("attn.to_add_out.weight", "context_block.attn.proj.weight"),
            ("attn.to_add_out.bias", "context_block.attn.proj.bias"),
            ("attn2.to_out.0.weight", "x_block.attn2.proj.weight"),
            ("attn2.to_out.0.bias", "x_block.attn2.proj.bias"),
            ("attn2.to_add_out.weight", "context_block.attn2.proj.weight"),
            ("attn2.to_add_out.bias", "context_block.attn2.proj.bias"),
        ];
        for (from, to) in per_block {
            m.push((format!("{b}{from}"), format!("{d}{to}")));
        }
    }
    m
});

/// Flux (and Flux.2, LongCat, SeFi): diffusers names of the first 19 double and 38
/// single blocks to the BFL ones.
static FLUX_NAMES: Lazy<Pairs> = Lazy::new(|| {
    let mut m = pairs(&[
        ("time_embed.timestep_embedder.linear_1.weight", "time_in.in_layer.weight"),
        ("time_embed.timestep_embedder.linear_1.bias", "time_in.in_layer.bias"),
        ("time_embed.timestep_embedder.linear_2.weight", "time_in.out_layer.weight"),
        ("time_embed.timestep_embedder.linear_2.bias", "time_in.out_layer.bias"),
        ("time_text_embed.timestep_embedder.linear_1.weight", "time_in.in_layer.weight"),
        ("time_text_embed.timestep_embedder.linear_1.bias", "time_in.in_layer.bias"),
        ("time_text_embed.timestep_embedder.linear_2.weight", "time_in.out_layer.weight"),
        ("time_text_embed.timestep_embedder.linear_2.bias", "time_in.out_layer.bias"),
        ("time_text_embed.text_embedder.linear_1.weight", "vector_in.in_layer.weight"),
        ("time_text_embed.text_embedder.linear_1.bias", "vector_in.in_layer.bias"),
        ("time_text_embed.text_embedder.linear_2.weight", "vector_in.out_layer.weight"),
        ("time_text_embed.text_embedder.linear_2.bias", "vector_in.out_layer.bias"),
        ("time_text_embed.guidance_embedder.linear_1.weight", "guidance_in.in_layer.weight"),
        ("time_text_embed.guidance_embedder.linear_1.bias", "guidance_in.in_layer.bias"),
        ("time_text_embed.guidance_embedder.linear_2.weight", "guidance_in.out_layer.weight"),
        ("time_text_embed.guidance_embedder.linear_2.bias", "guidance_in.out_layer.bias"),
        ("context_embedder.weight", "txt_in.weight"),
        ("context_embedder.bias", "txt_in.bias"),
        ("x_embedder.weight", "img_in.weight"),
        ("x_embedder.bias", "img_in.bias"),
        ("proj_out.weight", "final_layer.linear.weight"),
        ("proj_out.bias", "final_layer.linear.bias"),
        ("norm_out.linear.weight", "final_layer.adaLN_modulation.1.weight"),
        ("norm_out.linear.bias", "final_layer.adaLN_modulation.1.bias"),
    ]);
    for i in 0..19 {
        let b = format!("transformer_blocks.{i}.");
        let d = format!("double_blocks.{i}.");
        let per_block: &[(&str, &str)] = &[
            ("norm1.linear.weight", "img_mod.lin.weight"),
            ("norm1.linear.bias", "img_mod.lin.bias"),
            ("norm1_context.linear.weight", "txt_mod.lin.weight"),
            ("norm1_context.linear.bias", "txt_mod.lin.bias"),
            ("attn.to_q.weight", "img_attn.qkv.weight"),
            ("attn.to_q.bias", "img_attn.qkv.bias"),
            ("attn.to_k.weight", "img_attn.qkv.weight.1"),
            ("attn.to_k.bias", "img_attn.qkv.bias.1"),
            ("attn.to_v.weight", "img_attn.qkv.weight.2"),
            ("attn.to_v.bias", "img_attn.qkv.bias.2"),
            ("attn.add_q_proj.weight", "txt_attn.qkv.weight"),
            ("attn.add_q_proj.bias", "txt_attn.qkv.bias"),
            ("attn.add_k_proj.weight", "txt_attn.qkv.weight.1"),
            ("attn.add_k_proj.bias", "txt_attn.qkv.bias.1"),
            ("attn.add_v_proj.weight", "txt_attn.qkv.weight.2"),
            ("attn.add_v_proj.bias", "txt_attn.qkv.bias.2"),
            ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"),
            ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
            ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
            ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
            ("ff.net.0.proj.weight", "img_mlp.0.weight"),
            ("ff.net.0.proj.bias", "img_mlp.0.bias"),
            ("ff.net.2.weight", "img_mlp.2.weight"),
            ("ff.net.2.bias", "img_mlp.2.bias"),
            ("ff_context.net.0.proj.weight", "txt_mlp.0.weight"),
            ("ff_context.net.0.proj.bias", "txt_mlp.0.bias"),
            ("ff_context.net.2.weight", "txt_mlp.2.weight"),
            ("ff_context.net.2.bias", "txt_mlp.2.bias"),
            ("attn.to_out.0.weight", "img_attn.proj.weight"),
            ("attn.to_out.0.bias", "img_attn.proj.bias"),
            ("attn.to_add_out.weight", "txt_attn.proj.weight"),
            ("attn.to_add_out.bias", "txt_attn.proj.bias"),
        ];
        for (from, to) in per_block {
            m.push((format!("{b}{from}"), format!("{d}{to}")));
        }
        // LongCat checkpoints store the converted RMSNorm scales as `.weight`.
        for n in ["img_attn.norm.query_norm", "img_attn.norm.key_norm", "txt_attn.norm.query_norm", "txt_attn.norm.key_norm"] {
            m.push((format!("{d}{n}.weight"), format!("{d}{n}.scale")));
        }
    }
    for i in 0..38 {
        let b = format!("single_transformer_blocks.{i}.");
        let d = format!("single_blocks.{i}.");
        let per_block: &[(&str, &str)] = &[
            ("norm.linear.weight", "modulation.lin.weight"),
            ("norm.linear.bias", "modulation.lin.bias"),
            ("attn.to_q.weight", "linear1.weight"),
            ("attn.to_q.bias", "linear1.bias"),
            ("attn.to_k.weight", "linear1.weight.1"),
            ("attn.to_k.bias", "linear1.bias.1"),
            ("attn.to_v.weight", "linear1.weight.2"),
            ("attn.to_v.bias", "linear1.bias.2"),
            ("proj_mlp.weight", "linear1.weight.3"),
            ("proj_mlp.bias", "linear1.bias.3"),
            ("attn.norm_q.weight", "norm.query_norm.scale"),
            ("attn.norm_k.weight", "norm.key_norm.scale"),
            ("proj_out.weight", "linear2.weight"),
            ("proj_out.bias", "linear2.bias"),
        ];
        for (from, to) in per_block {
            m.push((format!("{b}{from}"), format!("{d}{to}")));
        }
        for n in ["norm.query_norm", "norm.key_norm"] {
            m.push((format!("{d}{n}.weight"), format!("{d}{n}.scale")));
        }
    }
    m
});

/// Hunyuan Video (first 54 double blocks) to Flux-style names.
static HUNYUAN_NAMES: Lazy<Pairs> = Lazy::new(|| {
    let mut m = Vec::new();
    for i in 0..54 {
        let b = format!("double_blocks.{i}.");
        let per_block: &[(&str, &str)] = &[
            ("img_mod.linear", "img_mod.lin"),
            ("txt_mod.linear", "txt_mod.lin"),
            ("img_attn_qkv", "img_attn.qkv"),
            ("txt_attn_qkv", "txt_attn.qkv"),
            ("img_attn_q_norm.weight", "img_attn.norm.query_norm.scale"),
            ("img_attn_k_norm.weight", "img_attn.norm.key_norm.scale"),
            ("txt_attn_q_norm.weight", "txt_attn.norm.query_norm.scale"),
            ("txt_attn_k_norm.weight", "txt_attn.norm.key_norm.scale"),
            ("img_mlp.fc1", "img_mlp.0"),
            ("img_mlp.fc2", "img_mlp.2"),
            ("txt_mlp.fc1", "txt_mlp.0"),
            ("txt_mlp.fc2", "txt_mlp.2"),
            ("img_attn_proj", "img_attn.proj"),
            ("txt_attn_proj", "txt_attn.proj"),
        ];
        for (from, to) in per_block {
            m.push((format!("{b}{from}"), format!("{b}{to}")));
        }
    }
    m.extend(pairs(&[
        ("time_in.mlp.0", "time_in.in_layer"),
        ("time_in.mlp.2", "time_in.out_layer"),
        ("time_r_in.mlp.0", "time_r_in.in_layer"),
        ("time_r_in.mlp.2", "time_r_in.out_layer"),
        ("vector_in.mlp.0", "vector_in.in_layer"),
        ("vector_in.mlp.2", "vector_in.out_layer"),
        ("guidance_in.mlp.0", "guidance_in.in_layer"),
        ("guidance_in.mlp.2", "guidance_in.out_layer"),
        ("txt_in.c_embedder.linear_1", "txt_in.c_embedder.in_layer"),
        ("txt_in.c_embedder.linear_2", "txt_in.c_embedder.out_layer"),
        ("txt_in.t_embedder.mlp.0", "txt_in.t_embedder.in_layer"),
        ("txt_in.t_embedder.mlp.2", "txt_in.t_embedder.out_layer"),
    ]));
    m
});

fn hunyuan_to_flux(mut name: String) -> String {
    replace_prefix_pairs(&mut name, &HUNYUAN_NAMES);
    replace_each_str(
        &mut name,
        &[
            ("_attn_qkv.", "_attn.qkv."),
            ("_attn_proj.", "_attn.proj."),
            ("mlp.fc1.", "mlp.0."),
            ("mlp.fc2.", "mlp.2."),
            (".modulation.linear.", ".modulation.lin."),
        ],
    );
    name
}

/// Lumina 2 / Z-Image: diffusers attention names (2 refiner blocks each, 30 layers).
static LUMINA2_NAMES: Lazy<Pairs> = Lazy::new(|| {
    let mut m = pairs(&[("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer.")]);
    for (prefix, n) in [("noise_refiner.", 2), ("context_refiner.", 2), ("layers.", 30)] {
        for i in 0..n {
            let b = format!("{prefix}{i}.");
            for (from, to) in [
                ("attention.norm_q.", "attention.q_norm."),
                ("attention.norm_k.", "attention.k_norm."),
                ("attention.to_out.0.", "attention.out."),
                ("attention.to_q.weight", "attention.qkv.weight"),
                ("attention.to_q.bias", "attention.qkv.bias"),
                ("attention.to_k.weight", "attention.qkv.weight.1"),
                ("attention.to_k.bias", "attention.qkv.bias.1"),
                ("attention.to_v.weight", "attention.qkv.weight.2"),
                ("attention.to_v.bias", "attention.qkv.bias.2"),
            ] {
                m.push((format!("{b}{from}"), format!("{b}{to}")));
            }
        }
    }
    m
});

fn krea2_to_original(mut name: String) -> String {
    replace_prefix(
        &mut name,
        [
            ("img_in.", "first."),
            ("time_embed.linear_1.", "tmlp.0."),
            ("time_embed.linear_2.", "tmlp.2."),
            ("time_mod_proj.", "tproj.1."),
            ("txt_in.linear_1.", "txtmlp.1."),
            ("txt_in.linear_2.", "txtmlp.3."),
            ("text_fusion.", "txtfusion."),
            ("transformer_blocks.", "blocks."),
            ("final_layer.", "last."),
        ],
    );
    replace_each_str(
        &mut name,
        &[
            ("attn.to_out.0.", "attn.wo."),
            ("attn.to_out.", "attn.wo."),
            ("attn.to_gate.", "attn.gate."),
            ("attn.to_q.", "attn.wq."),
            ("attn.to_k.", "attn.wk."),
            ("attn.to_v.", "attn.wv."),
            ("ff.gate.", "mlp.gate."),
            ("ff.up.", "mlp.up."),
            ("ff.down.", "mlp.down."),
            ("txt_in.norm.", "txtmlp.0."),
            ("last.norm.weight", "last.norm.scale"),
            ("last.modulation.weight", "last.modulation.lin"),
        ],
    );
    name
}

/// diffusers SDXL ControlNet to the LDM ControlNet layout.
fn diffusers_controlnet_to_ldm_sdxl(name: &str) -> String {
    let name = diffusers_unet_to_ldm(name, true);
    const HEADS: &[(&str, &str)] = &[
        ("controlnet_cond_embedding.conv_in.", "input_hint_block.0."),
        ("controlnet_cond_embedding.blocks.0.", "input_hint_block.2."),
        ("controlnet_cond_embedding.blocks.1.", "input_hint_block.4."),
        ("controlnet_cond_embedding.blocks.2.", "input_hint_block.6."),
        ("controlnet_cond_embedding.blocks.3.", "input_hint_block.8."),
        ("controlnet_cond_embedding.blocks.4.", "input_hint_block.10."),
        ("controlnet_cond_embedding.blocks.5.", "input_hint_block.12."),
        ("controlnet_cond_embedding.conv_out.", "input_hint_block.14."),
        ("controlnet_mid_block.", "middle_block_out.0."),
    ];
    for (from, to) in HEADS {
        if let Some(rest) = name.strip_prefix(from) {
            return format!("{to}{rest}");
        }
    }
    if let Some(rest) = name.strip_prefix("controlnet_down_blocks.") {
        if let Some(dot) = rest.find('.') {
            return format!("zero_convs.{}.0{}", &rest[..dot], &rest[dot..]);
        }
    }
    name
}

fn is_diffusers_controlnet_name(name: &str) -> bool {
    [
        "controlnet_cond_embedding.",
        "controlnet_down_blocks.",
        "controlnet_mid_block.",
        "down_blocks.",
        "mid_block.",
        "time_embedding.",
        "add_embedding.",
        "conv_in.",
    ]
    .iter()
    .any(|h| name.starts_with(h))
}

fn convert_diffusion_model_name(name: &str, version: Option<SdVersion>) -> String {
    let Some(v) = version else { return name.to_string() };
    if v.is_sd1() || v.is_sd2() {
        diffusers_unet_to_ldm(name, false)
    } else if v.is_sdxl() {
        diffusers_unet_to_ldm(name, true)
    } else if v.is_sd3() {
        let mut n = name.to_string();
        replace_prefix_pairs(&mut n, &SD3_NAMES);
        n
    } else if v.is_flux() || v.is_flux2() || v.is_longcat() || v.is_sefi_image() {
        let mut n = name.to_string();
        replace_prefix_pairs(&mut n, &FLUX_NAMES);
        n
    } else if v.is_hunyuan_video() {
        hunyuan_to_flux(name.to_string())
    } else if v.is_z_image() {
        let mut n = name.to_string();
        replace_prefix_pairs(&mut n, &LUMINA2_NAMES);
        n
    } else if v.is_anima() {
        if name.starts_with("net.") {
            name.to_string()
        } else {
            format!("net.{name}")
        }
    } else if v.is_krea2() {
        krea2_to_original(name.to_string())
    } else {
        name.to_string()
    }
}

// ---------------------------------------------------------------------------------------
// VAEs

/// (LDM, diffusers) prefix pairs of the SD AutoencoderKL.
static VAE_LAYERS: Lazy<Pairs> = Lazy::new(|| {
    let mut m = Vec::new();
    for i in 0..4 {
        for j in 0..2 {
            m.push((format!("encoder.down.{i}.block.{j}."), format!("encoder.down_blocks.{i}.resnets.{j}.")));
        }
        if i < 3 {
            m.push((format!("down.{i}.downsample."), format!("down_blocks.{i}.downsamplers.0.")));
            m.push((format!("up.{}.upsample.", 3 - i), format!("up_blocks.{i}.upsamplers.0.")));
        }
        for j in 0..3 {
            m.push((format!("decoder.up.{}.block.{j}.", 3 - i), format!("decoder.up_blocks.{i}.resnets.{j}.")));
        }
    }
    for i in 0..2 {
        m.push((format!("mid.block_{}.", i + 1), format!("mid_block.resnets.{i}.")));
    }
    m
});

fn diffusers_vae_to_ldm(name: &str) -> String {
    let mut r = name.to_string();
    for (ldm, hf) in [("nin_shortcut", "conv_shortcut"), ("norm_out", "conv_norm_out"), ("mid.attn_1.", "mid_block.attentions.0.")] {
        replace_first(&mut r, hf, ldm);
    }
    for (ldm, hf) in VAE_LAYERS.iter() {
        replace_first(&mut r, hf, ldm);
    }
    if name.contains("attentions") {
        for (ldm, hf) in [("norm.", "group_norm."), ("q.", "query."), ("k.", "key."), ("v.", "value."), ("proj_out.", "proj_attn.")] {
            replace_first(&mut r, hf, ldm);
        }
    }
    if r.contains("mid.attn_1.") {
        replace_each_str(&mut r, &[("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")]);
    }
    r
}

const WAN_VAE_PREFIXES: &[(&str, &str)] = &[
    ("quant_conv.", "conv1."),
    ("post_quant_conv.", "conv2."),
    ("decoder.up_blocks.0.resnets.0.", "decoder.upsamples.0.residual."),
    ("decoder.up_blocks.0.resnets.1.", "decoder.upsamples.1.residual."),
    ("decoder.up_blocks.0.resnets.2.", "decoder.upsamples.2.residual."),
    ("decoder.up_blocks.0.upsamplers.0.", "decoder.upsamples.3."),
    ("decoder.up_blocks.1.resnets.0.conv_shortcut.", "decoder.upsamples.4.shortcut."),
    ("decoder.up_blocks.1.resnets.0.", "decoder.upsamples.4.residual."),
    ("decoder.up_blocks.1.resnets.1.", "decoder.upsamples.5.residual."),
    ("decoder.up_blocks.1.resnets.2.", "decoder.upsamples.6.residual."),
    ("decoder.up_blocks.1.upsamplers.0.", "decoder.upsamples.7."),
    ("decoder.up_blocks.2.resnets.0.", "decoder.upsamples.8.residual."),
    ("decoder.up_blocks.2.resnets.1.", "decoder.upsamples.9.residual."),
    ("decoder.up_blocks.2.resnets.2.", "decoder.upsamples.10.residual."),
    ("decoder.up_blocks.2.upsamplers.0.", "decoder.upsamples.11."),
    ("decoder.up_blocks.3.resnets.0.", "decoder.upsamples.12.residual."),
    ("decoder.up_blocks.3.resnets.1.", "decoder.upsamples.13.residual."),
    ("decoder.up_blocks.3.resnets.2.", "decoder.upsamples.14.residual."),
    ("encoder.down_blocks.0.", "encoder.downsamples.0.residual."),
    ("encoder.down_blocks.1.", "encoder.downsamples.1.residual."),
    ("encoder.down_blocks.2.", "encoder.downsamples.2."),
    ("encoder.down_blocks.3.conv_shortcut.", "encoder.downsamples.3.shortcut."),
    ("encoder.down_blocks.3.", "encoder.downsamples.3.residual."),
    ("encoder.down_blocks.4.", "encoder.downsamples.4.residual."),
    ("encoder.down_blocks.5.", "encoder.downsamples.5."),
    ("encoder.down_blocks.6.conv_shortcut.", "encoder.downsamples.6.shortcut."),
    ("encoder.down_blocks.6.", "encoder.downsamples.6.residual."),
    ("encoder.down_blocks.7.", "encoder.downsamples.7.residual."),
    ("encoder.down_blocks.8.", "encoder.downsamples.8."),
    ("encoder.down_blocks.9.", "encoder.downsamples.9.residual."),
    ("encoder.down_blocks.10.", "encoder.downsamples.10.residual."),
];

fn diffusers_to_wan_vae(mut name: String) -> String {
    replace_each_str(
        &mut name,
        &[
            (".conv_in.", ".conv1."),
            (".norm_out.", ".head.0."),
            (".conv_out.", ".head.2."),
            (".mid_block.attentions.0.", ".middle.1."),
            (".mid_block.resnets.0.", ".middle.0.residual."),
            (".mid_block.resnets.1.", ".middle.2.residual."),
        ],
    );
    replace_prefix(&mut name, WAN_VAE_PREFIXES.iter().copied());
    // Only ResNet blocks rename their convolutions and norms.
    if name.contains(".residual.") {
        replace_each_str(&mut name, &[(".norm1.", ".0."), (".conv1.", ".2."), (".norm2.", ".3."), (".conv2.", ".6.")]);
    }
    name
}

fn convert_first_stage_name(name: &str, version: Option<SdVersion>) -> String {
    if let Some(v) = version {
        if v.is_hunyuan_video() || v.is_mage_flow() || v.is_minimax_h3() {
            return name.to_string();
        }
        if v.uses_wan_vae() {
            return diffusers_to_wan_vae(name.to_string());
        }
    }
    let mut n = name.to_string();
    replace_prefix(&mut n, [("decoder.post_quant_conv.", "post_quant_conv."), ("encoder.quant_conv.", "quant_conv.")]);
    diffusers_vae_to_ldm(&n)
}

// ---------------------------------------------------------------------------------------
// Adapters and others

fn convert_pmid_name(name: String) -> String {
    if name == "pmid.vision_model.visual_projection.weight" {
        return "pmid.visual_projection.weight".into();
    }
    if let Some(rest) = name.strip_prefix("pmid.qformer_perceiver.") {
        for l in 0..4 {
            if rest == format!("perceiver_resampler.layers.{l}.1.1.weight") {
                return format!("pmid.qformer_perceiver.perceiver_resampler.layers.{l}.1.1.fc1.weight");
            }
            if rest == format!("perceiver_resampler.layers.{l}.1.3.weight") {
                return format!("pmid.qformer_perceiver.perceiver_resampler.layers.{l}.1.1.fc2.weight");
            }
        }
        for (from, to) in [
            ("token_proj.0.bias", "token_proj.fc1.bias"),
            ("token_proj.2.bias", "token_proj.fc2.bias"),
            ("token_proj.0.weight", "token_proj.fc1.weight"),
            ("token_proj.2.weight", "token_proj.fc2.weight"),
        ] {
            if rest == from {
                return format!("pmid.qformer_perceiver.{to}");
            }
        }
    }
    name
}

/// Tokens whose underscores are part of the name (kohya LoRA keys use `_` for `.`).
const PROTECTED_TOKENS: &[&str] = &[
    "self_attn",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "to_k",
    "to_q",
    "to_v",
    "to_out",
    "text_model",
    "down_blocks",
    "mid_block",
    "up_block",
    "proj_in",
    "proj_out",
    "transformer_blocks",
    "single_transformer_blocks",
    "single_blocks",
    "diffusion_model",
    "cond_stage_model",
    "first_stage_model",
    "conv_in",
    "conv_out",
    "lora_down",
    "lora_mid",
    "lora_up",
    "diff_b",
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "hada_t1",
    "hada_t2",
    ".lokr_w1",
    ".lokr_w1_a",
    ".lokr_w1_b",
    ".lokr_w2",
    ".lokr_w2_a",
    ".lokr_w2_b",
    "time_emb_proj",
    "conv_shortcut",
    "time_embedding",
    "conv_norm_out",
    "double_blocks",
    "txt_attn",
    "img_attn",
    "input_blocks",
    "output_blocks",
    "middle_block",
    "skip_connection",
    "emb_layers",
    "in_layers",
    "out_layers",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "add_out_proj",
    "ff_context",
    "norm_added_q",
    "norm_added_v",
    "to_add_out",
    "txt_mod",
    "img_mod",
    "txt_mlp",
    "img_mlp",
    "proj_mlp",
    "wi_0",
    "wi_1",
    "norm1_context",
    "ff_context",
    "x_embedder",
    "cross_attn",
    "output_proj",
    "token_refiner",
];

/// Turns kohya-style `_` separators into `.`, keeping underscores inside known tokens.
pub fn convert_sep_to_dot(name: &str) -> String {
    let mut protected = vec![false; name.len()];
    for token in PROTECTED_TOKENS {
        let mut start = 0;
        while let Some(found) = name[start..].find(token) {
            let at = start + found;
            for (i, b) in token.bytes().enumerate() {
                if b == b'_' {
                    protected[at + i] = true;
                }
            }
            start = at + token.len();
        }
    }
    let mut out = name.as_bytes().to_vec();
    for (b, &p) in out.iter_mut().zip(&protected) {
        if *b == b'_' && !p {
            *b = b'.';
        }
    }
    // Only ASCII bytes changed, so this is still UTF-8.
    String::from_utf8(out).unwrap_or_else(|_| name.to_string())
}

static ESRGAN_NAMES: Lazy<Pairs> = Lazy::new(|| {
    let mut m = vec![("model.0.".to_string(), "conv_first.".to_string())];
    for i in 0..64 {
        let b = format!("model.1.sub.{i}.");
        for rdb in 1..=3 {
            for conv in 1..=5 {
                m.push((format!("{b}RDB{rdb}.conv{conv}.0."), format!("body.{i}.rdb{rdb}.conv{conv}.")));
            }
        }
        m.push((format!("{b}weight"), "conv_body.weight".into()));
        m.push((format!("{b}bias"), "conv_body.bias".into()));
    }
    // RealESRGAN keeps only the learned layers of its Sequential: x1, x2 and x4 layouts.
    m.extend(pairs(&[
        ("model.2.", "conv_hr."),
        ("model.3.", "conv_up1."),
        ("model.4.", "conv_last."),
        ("model.5.", "conv_hr."),
        ("model.6.", "conv_up2."),
        ("model.7.", "conv_last."),
        ("model.8.", "conv_hr."),
        ("model.10.", "conv_last."),
    ]));
    m
});

/// IP-Adapter attention index → UNet transformer block.
fn ip_adapter_block(idx: i64, sdxl: bool) -> Option<String> {
    if idx < 1 || idx % 2 == 0 {
        return None;
    }
    if sdxl {
        let order: [(&str, i64); 11] = [
            ("input_blocks.4.1", 2),
            ("input_blocks.5.1", 2),
            ("input_blocks.7.1", 10),
            ("input_blocks.8.1", 10),
            ("output_blocks.0.1", 10),
            ("output_blocks.1.1", 10),
            ("output_blocks.2.1", 10),
            ("output_blocks.3.1", 2),
            ("output_blocks.4.1", 2),
            ("output_blocks.5.1", 2),
            ("middle_block.1", 10),
        ];
        let mut k = (idx - 1) / 2;
        for (block, depth) in order {
            if k < depth {
                return Some(format!("{block}.transformer_blocks.{k}"));
            }
            k -= depth;
        }
        None
    } else {
        const SD15: [&str; 16] = [
            "input_blocks.1.1",
            "input_blocks.2.1",
            "input_blocks.4.1",
            "input_blocks.5.1",
            "input_blocks.7.1",
            "input_blocks.8.1",
            "output_blocks.3.1",
            "output_blocks.4.1",
            "output_blocks.5.1",
            "output_blocks.6.1",
            "output_blocks.7.1",
            "output_blocks.8.1",
            "output_blocks.9.1",
            "output_blocks.10.1",
            "output_blocks.11.1",
            "middle_block.1",
        ];
        SD15.get(((idx - 1) / 2) as usize).map(|b| format!("{b}.transformer_blocks.0"))
    }
}

/// C `atoi`: optional whitespace and sign, then leading digits (0 if none).
fn atoi(s: &str) -> i64 {
    let s = s.trim_start();
    let (neg, digits) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let mut v: i64 = 0;
    for b in digits.bytes().take_while(u8::is_ascii_digit) {
        v = v.saturating_mul(10).saturating_add((b - b'0') as i64);
    }
    if neg {
        -v
    } else {
        v
    }
}

fn convert_ip_adapter_name(name: &str, version: Option<SdVersion>) -> String {
    if name.starts_with("image_proj.") {
        return format!("ip_adapter.{name}");
    }
    let items: Vec<&str> = name.split('.').collect();
    if items.len() < 4 {
        return name.to_string();
    }
    let sdxl = version.is_some_and(SdVersion::is_sdxl);
    match ip_adapter_block(atoi(items[1]) as i32 as i64, sdxl) {
        Some(block) => format!("model.diffusion_model.{block}.attn2.{}.{}", items[2], items[3]),
        None => name.to_string(),
    }
}

// ---------------------------------------------------------------------------------------

const COND_STAGE_PREFIXES: &[&str] = &["cond_stage_model.1.", "cond_stage_model.", "conditioner.embedders.", "text_encoders."];
const DIFFUSION_PREFIXES: &[&str] = &["model.diffusion_model."];
const FIRST_STAGE_PREFIXES: &[&str] = &["first_stage_model.", "vae."];

fn has_part_prefix(name: &str, prefixes: &[&str]) -> bool {
    prefixes
        .iter()
        .any(|p| name.starts_with(p) || name.strip_prefix("lora.").is_some_and(|n| n.starts_with(p)))
}

/// True for (possibly LoRA) names of the text encoders.
pub fn is_cond_stage_model_name(name: &str) -> bool {
    has_part_prefix(name, COND_STAGE_PREFIXES)
}

/// True for (possibly LoRA) names of the diffusion model.
pub fn is_diffusion_model_name(name: &str) -> bool {
    has_part_prefix(name, DIFFUSION_PREFIXES)
}

/// True for (possibly LoRA) names of the VAE.
pub fn is_first_stage_model_name(name: &str) -> bool {
    has_part_prefix(name, FIRST_STAGE_PREFIXES)
}

/// LoRA key suffixes and what they become, in the bytewise order the reference tries
/// them.
static LORA_SUFFIXES: Lazy<Vec<(&'static str, &'static str)>> = Lazy::new(|| {
    let mut v = vec![
        (".lora_down.weight", ".weight.lora_down"),
        (".lora_mid.weight", ".weight.lora_mid"),
        (".lora_up.weight", ".weight.lora_up"),
        (".lora.down.weight", ".weight.lora_down"),
        (".lora.mid.weight", ".weight.lora_mid"),
        (".lora.up.weight", ".weight.lora_up"),
        ("_lora.down.weight", ".weight.lora_down"),
        ("_lora.mid.weight", ".weight.lora_mid"),
        ("_lora.up.weight", ".weight.lora_up"),
        (".lora_A.weight", ".weight.lora_down"),
        (".lora_B.weight", ".weight.lora_up"),
        (".lora_A.default.weight", ".weight.lora_down"),
        (".lora_B.default.weight", ".weight.lora_up"),
        (".lora_A", ".weight.lora_down"),
        (".lora_B", ".weight.lora_up"),
        (".lora_linear", ".weight.alpha"),
        (".alpha", ".weight.alpha"),
        (".scale", ".weight.scale"),
        (".diff", ".weight.diff"),
        (".diff_b", ".bias.diff"),
        (".hada_w1_a", ".weight.hada_w1_a"),
        (".hada_w1_b", ".weight.hada_w1_b"),
        (".hada_w2_a", ".weight.hada_w2_a"),
        (".hada_w2_b", ".weight.hada_w2_b"),
        (".hada_t1", ".weight.hada_t1"),
        (".hada_t2", ".weight.hada_t2"),
        (".lokr_w1", ".weight.lokr_w1"),
        (".lokr_w1_a", ".weight.lokr_w1_a"),
        (".lokr_w1_b", ".weight.lokr_w1_b"),
        (".lokr_w2", ".weight.lokr_w2"),
        (".lokr_w2_a", ".weight.lokr_w2_a"),
        (".lokr_w2_b", ".weight.lokr_w2_b"),
    ];
    v.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    v
});

/// Component prefixes and their internal homes. Where two overlap, the one listed first
/// wins, as it does in the reference (`text_encoder.2.` therefore never applies).
fn component_prefixes(version: Option<SdVersion>) -> [(&'static str, &'static str); 16] {
    let unet = version.is_some_and(SdVersion::is_unet);
    let flux = version.is_some_and(SdVersion::is_flux);
    [
        ("diffusion_model.", "model.diffusion_model."),
        ("unet.", "model.diffusion_model."),
        ("transformer.", "model.diffusion_model."),
        ("vae.", "first_stage_model."),
        ("text_encoder.", "cond_stage_model.transformer."),
        ("text_encoder.2.", "cond_stage_model.1.transformer."),
        ("te.", "cond_stage_model.transformer."),
        ("conditioner.embedders.0.open_clip.", "cond_stage_model."),
        ("conditioner.embedders.0.", "cond_stage_model."),
        ("conditioner.embedders.1.", "cond_stage_model.1."),
        ("te2.", "cond_stage_model.1.transformer."),
        ("te1.", if flux { "text_encoders.clip_l.transformer." } else { "cond_stage_model.transformer." }),
        ("te3.", "text_encoders.t5xxl.transformer."),
        ("clip_vision.", "cond_stage_model.transformer."),
        ("clip_l.", if unet { "cond_stage_model.transformer." } else { "text_encoders.clip_l.transformer." }),
        ("clip_g.", if unet { "cond_stage_model.1.transformer." } else { "text_encoders.clip_g.transformer." }),
    ]
}

/// Converts a tensor name to the internal naming for a model of `version` (`None`: not
/// known). LoRA names keep their `lora.` prefix and get `.weight.lora_up`-style suffixes.
pub fn convert_tensor_name(name: &str, version: Option<SdVersion>) -> String {
    if version == Some(SdVersion::Esrgan) {
        let mut n = name.to_string();
        replace_prefix_pairs(&mut n, &ESRGAN_NAMES);
        return n;
    }
    if name.starts_with("ip_adapter.") || name.starts_with("image_proj.") {
        return convert_ip_adapter_name(name, version);
    }

    let mut name = name.to_string();
    let mut is_lora = false;
    let mut underscored = false;
    for prefix in ["lora.lora.", "lora.lora_", "lora.lycoris_", "lora.lycoris.", "lora."] {
        if let Some(rest) = name.strip_prefix(prefix) {
            is_lora = true;
            let rest = rest.to_string();
            underscored = prefix.contains("lycoris_")
                || ["unet_", "te_", "te1_", "te2_", "te3_", "vae_"].iter().any(|p| rest.starts_with(p));
            name = rest;
            break;
        }
    }
    if is_lora {
        for (old, new) in LORA_SUFFIXES.iter() {
            if let Some(stem) = name.strip_suffix(old) {
                name = format!("{stem}{new}");
                break;
            }
        }
        replace_first(&mut name, ".processor", "");
        if name.starts_with("transformer_blocks") || name.starts_with("single_transformer_blocks") {
            name = format!("transformer.{name}");
        }
        if version.is_some_and(SdVersion::is_unet) || underscored {
            name = convert_sep_to_dot(&name);
        }
    }

    replace_prefix(&mut name, component_prefixes(version));

    let vision_llm = version.is_some_and(|v| v.is_boogu_image() || v.is_krea2() || v.is_mage_flow() || v.is_minimax_h3());
    if vision_llm {
        if let Some(rest) = name.strip_prefix("text_encoders.llm.model.visual.") {
            name = format!("text_encoders.llm.visual.{rest}");
        }
        if name.starts_with("text_encoders.llm.visual.") {
            name = convert_qwen3_vl_vision(name);
        }
    }

    // diffusion model
    let mut matched = false;
    for prefix in DIFFUSION_PREFIXES {
        if let Some(rest) = name.strip_prefix(prefix) {
            name = format!("{prefix}{}", convert_diffusion_model_name(rest, version));
            matched = true;
            break;
        }
    }
    if is_lora && !matched {
        let bare_unet = ["down_blocks.", "up_blocks.", "mid_block.", "conv_in.", "conv_out.", "time_embedding.", "conv_norm_out."];
        if bare_unet.iter().any(|p| name.starts_with(p)) {
            name = format!("{}{}", DIFFUSION_PREFIXES[0], convert_diffusion_model_name(&name, version));
        }
    }

    for prefix in COND_STAGE_PREFIXES {
        if let Some(rest) = name.strip_prefix(prefix) {
            name = format!("{prefix}{}", convert_cond_stage_name(rest.to_string()));
            break;
        }
    }

    for prefix in FIRST_STAGE_PREFIXES {
        if let Some(rest) = name.strip_prefix(prefix) {
            let converted = convert_first_stage_name(rest, version);
            let tiny = matches!(version, Some(SdVersion::Sdxs512Ds) | Some(SdVersion::Sdxs09));
            name = if tiny { format!("tae.{converted}") } else { format!("{prefix}{converted}") };
            break;
        }
    }

    if name.starts_with("pmid.") {
        name = convert_pmid_name(name);
    }

    if name.starts_with("control_model.") {
        if let Some(pos) = name.find('.') {
            name = name[pos + 1..].to_string();
        }
    }
    if version.is_some_and(SdVersion::is_sdxl) && is_diffusers_controlnet_name(&name) {
        name = diffusers_controlnet_to_ldm_sdxl(&name);
    }

    if is_lora {
        name = format!("lora.{name}");
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use SdVersion::*;

    fn c(n: &str, v: SdVersion) -> String {
        convert_tensor_name(n, Some(v))
    }

    #[test]
    fn diffusers_unet_and_vae() {
        assert_eq!(c("unet.conv_in.weight", Sd1), "model.diffusion_model.input_blocks.0.0.weight");
        assert_eq!(
            c("unet.down_blocks.0.resnets.1.norm1.weight", Sd1),
            "model.diffusion_model.input_blocks.2.0.in_layers.0.weight"
        );
        assert_eq!(
            c("unet.up_blocks.1.attentions.2.transformer_blocks.0.attn1.to_out.0.weight", Sd1),
            "model.diffusion_model.output_blocks.5.1.transformer_blocks.0.attn1.to_out.0.weight"
        );
        assert_eq!(c("unet.add_embedding.linear_1.weight", Sdxl), "model.diffusion_model.label_emb.0.0.weight");
        assert_eq!(c("unet.up_blocks.0.upsamplers.0.conv.weight", Sdxl), "model.diffusion_model.output_blocks.2.2.conv.weight");
        assert_eq!(c("vae.decoder.up_blocks.0.resnets.0.conv1.weight", Sd1), "first_stage_model.decoder.up.3.block.0.conv1.weight");
        assert_eq!(c("vae.encoder.mid_block.attentions.0.to_q.weight", Sd1), "first_stage_model.encoder.mid.attn_1.q.weight");
        assert_eq!(c("vae.decoder.conv_norm_out.bias", Sd1), "first_stage_model.decoder.norm_out.bias");
        assert_eq!(c("vae.encoder.quant_conv.weight", Sd1), "first_stage_model.quant_conv.weight");
        assert_eq!(c("vae.decoder.conv_in.weight", Sdxs512Ds), "tae.decoder.conv_in.weight");
    }

    #[test]
    fn text_encoders() {
        assert_eq!(
            c("te.text_model.encoder.layers.0.mlp.fc1.weight", Sd1),
            "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight"
        );
        assert_eq!(
            c("cond_stage_model.model.transformer.resblocks.3.attn.in_proj_weight", Sd2),
            "cond_stage_model.transformer.text_model.encoder.layers.3.self_attn.in_proj.weight"
        );
        assert_eq!(
            c("conditioner.embedders.1.model.ln_final.weight", Sdxl),
            "cond_stage_model.1.transformer.text_model.final_layer_norm.weight"
        );
        assert_eq!(
            c("conditioner.embedders.0.open_clip.model.token_embedding.weight", Sdxl),
            "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
        );
        assert_eq!(c("clip_l.text_model.final_layer_norm.weight", Flux), "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight");
        assert_eq!(c("clip_l.text_model.final_layer_norm.weight", Sdxl), "cond_stage_model.transformer.text_model.final_layer_norm.weight");
        assert_eq!(
            c("text_encoders.t5xxl.transformer.enc.blk.0.attn_q.weight", Flux),
            "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"
        );
        assert_eq!(c("text_encoders.llm.blk.3.ffn_down.weight", QwenImage), "text_encoders.llm.model.layers.3.mlp.down_proj.weight");
        // Qwen2.5-VL's vision tower: HF names (`visual.` in `llm_path`, bare in `llm_vision_path`)
        // stay; llama.cpp mmproj names become them.
        let v = "text_encoders.llm.visual.";
        for (mmproj, hf) in [
            ("blocks.3.attn.qkv.weight", "blocks.3.attn.qkv.weight"),
            ("merger.mlp.0.weight", "merger.mlp.0.weight"),
            ("v.blk.3.attn_q.bias", "blocks.3.attn.q_proj.bias"),
            ("v.blk.3.attn_out.weight", "blocks.3.attn.proj.weight"),
            ("v.blk.3.ln2.weight", "blocks.3.norm2.weight"),
            ("v.blk.3.ffn_gate.weight", "blocks.3.mlp.gate_proj.weight"),
            ("v.patch_embd.weight", "patch_embed.proj.0.weight"),
            ("v.patch_embd.weight.1", "patch_embed.proj.1.weight"),
            ("v.post_ln.weight", "merger.ln_q.weight"),
            ("mm.2.bias", "merger.mlp.2.bias"),
        ] {
            assert_eq!(c(&format!("{v}{mmproj}"), QwenImage), format!("{v}{hf}"));
        }
        // A llama.cpp Qwen3 GGUF as `llm_path` (Z-Image): HF names; HF names stay as they are.
        for (gguf, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("blk.35.attn_q_norm.weight", "model.layers.35.self_attn.q_norm.weight"),
            ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
            ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
            ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
            ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
            ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"),
            ("output_norm.weight", "model.norm.weight"),
        ] {
            assert_eq!(c(&format!("text_encoders.llm.{gguf}"), ZImage), format!("text_encoders.llm.{hf}"));
            assert_eq!(c(&format!("text_encoders.llm.{hf}"), ZImage), format!("text_encoders.llm.{hf}"));
        }
        // Mistral Small 3.2 as llama.cpp writes it (arch "llama", Flux.2 dev): the same names
        // without q/k norms; q/k stay as stored (the reference rotates them as they come).
        for (gguf, hf) in [
            ("blk.39.attn_q.weight", "model.layers.39.self_attn.q_proj.weight"),
            ("blk.10.attn_v.weight", "model.layers.10.self_attn.v_proj.weight"),
            ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
            ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
        ] {
            assert_eq!(c(&format!("text_encoders.llm.{gguf}"), Flux2), format!("text_encoders.llm.{hf}"));
        }
        assert_eq!(c("text_encoder.2.x", Sdxl), "cond_stage_model.transformer.2.x");
    }

    #[test]
    fn dit_transformers() {
        assert_eq!(
            c("model.diffusion_model.transformer_blocks.3.attn.to_k.weight", Flux),
            "model.diffusion_model.double_blocks.3.img_attn.qkv.weight.1"
        );
        assert_eq!(
            c("model.diffusion_model.single_transformer_blocks.37.proj_mlp.bias", Flux),
            "model.diffusion_model.single_blocks.37.linear1.bias.3"
        );
        assert_eq!(
            c("model.diffusion_model.single_transformer_blocks.38.proj_mlp.bias", Flux),
            "model.diffusion_model.single_transformer_blocks.38.proj_mlp.bias"
        );
        assert_eq!(
            c("model.diffusion_model.transformer_blocks.0.norm1_context.linear.bias", Sd3),
            "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"
        );
        assert_eq!(
            c("model.diffusion_model.double_blocks.5.img_attn_qkv.weight", HunyuanVideo),
            "model.diffusion_model.double_blocks.5.img_attn.qkv.weight"
        );
        assert_eq!(
            c("model.diffusion_model.layers.29.attention.to_v.bias", ZImage),
            "model.diffusion_model.layers.29.attention.qkv.bias.2"
        );
        assert_eq!(c("model.diffusion_model.blocks.0.x", Anima), "model.diffusion_model.net.blocks.0.x");
        assert_eq!(c("model.diffusion_model.transformer_blocks.1.attn.to_out.0.weight", Krea2), "model.diffusion_model.blocks.1.attn.wo.weight");
        assert_eq!(c("first_stage_model.decoder.up_blocks.1.resnets.0.norm1.gamma", Wan2), "first_stage_model.decoder.upsamples.4.residual.0.gamma");
    }

    #[test]
    fn lora_schemes() {
        // kohya
        assert_eq!(
            c("lora.lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight", Sd1),
            "lora.model.diffusion_model.input_blocks.1.1.proj_in.weight.lora_down"
        );
        assert_eq!(
            c("lora.lora_te_text_model_encoder_layers_0_self_attn_k_proj.alpha", Sd1),
            "lora.cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.k_proj.weight.alpha"
        );
        // PEFT / diffusers
        assert_eq!(
            c("lora.transformer.transformer_blocks.0.attn.to_q.lora_A.weight", Flux),
            "lora.model.diffusion_model.double_blocks.0.img_attn.qkv.weight.lora_down"
        );
        assert_eq!(
            c("lora.unet.down_blocks.1.attentions.0.proj_in.lora.up.weight", Sd1),
            "lora.model.diffusion_model.input_blocks.4.1.proj_in.weight.lora_up"
        );
        // LyCORIS
        assert_eq!(
            c("lora.lycoris_unet_mid_block_attentions_0_proj_out.hada_w1_a", Sdxl),
            "lora.model.diffusion_model.middle_block.1.proj_out.weight.hada_w1_a"
        );
        assert_eq!(convert_sep_to_dot("lora_unet_input_blocks_1_1_proj_in"), "lora.unet.input_blocks.1.1.proj_in");
    }

    #[test]
    fn adapters_and_upscalers() {
        assert_eq!(c("model.1.sub.3.RDB2.conv4.0.weight", Esrgan), "body.3.rdb2.conv4.weight");
        assert_eq!(c("model.10.bias", Esrgan), "conv_last.bias");
        assert_eq!(c("ip_adapter.31.to_k_ip.weight", Sd1), "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k_ip.weight");
        assert_eq!(c("ip_adapter.139.to_v_ip.weight", Sdxl), "model.diffusion_model.middle_block.1.transformer_blocks.9.attn2.to_v_ip.weight");
        assert_eq!(c("ip_adapter.141.to_v_ip.weight", Sdxl), "ip_adapter.141.to_v_ip.weight");
        assert_eq!(c("ip_adapter.2.to_k_ip.weight", Sd1), "ip_adapter.2.to_k_ip.weight");
        assert_eq!(c("image_proj.proj.weight", Sd1), "ip_adapter.image_proj.proj.weight");
        assert_eq!(c("control_model.input_blocks.0.0.weight", Sd1), "input_blocks.0.0.weight");
        assert_eq!(c("controlnet_down_blocks.3.weight", Sdxl), "zero_convs.3.0.weight");
        assert_eq!(c("pmid.qformer_perceiver.token_proj.2.weight", Sd1), "pmid.qformer_perceiver.token_proj.fc2.weight");
        assert!(is_cond_stage_model_name("lora.text_encoders.x"));
        assert!(is_first_stage_model_name("vae.x") && !is_diffusion_model_name("unet.x"));
    }
}
