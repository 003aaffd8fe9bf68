//! Model-family detection from names and shapes (no tensor data).

mod io_common;

use stable_diffusion::io::version::detect;
use stable_diffusion::io::SdVersion::{self, *};

type Tensors = Vec<(String, Vec<i64>)>;

/// `name:ne0xne1...` (ggml order) or just `name` (shape [1]).
fn ts(items: &[&str]) -> Tensors {
    items
        .iter()
        .map(|s| match s.split_once(':') {
            Some((n, shape)) => (n.to_string(), shape.split('x').map(|d| d.parse().unwrap()).collect()),
            None => (s.to_string(), vec![1]),
        })
        .collect()
}

const SD1_TOK: &str = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight:768x49408";
const SD2_TOK: &str = "cond_stage_model.model.token_embedding.weight:1024x49408";
const MID: &str = "model.diffusion_model.middle_block.1.proj_in.weight";
const OUT71: &str = "model.diffusion_model.output_blocks.7.1.norm.weight";

fn unet_in(channels: i64) -> String {
    format!("model.diffusion_model.input_blocks.0.0.weight:3x3x{channels}x320")
}

fn case(v: SdVersion, items: &[&str]) -> (SdVersion, Tensors) {
    (v, ts(items))
}

#[test]
fn every_family_from_names_and_shapes() {
    let in4 = unet_in(4);
    let in9 = unet_in(9);
    let in8 = unet_in(8);
    let dm = |s: &str| format!("model.diffusion_model.{s}");
    let owned: Vec<(SdVersion, Vec<String>)> = vec![
        (Sd1, vec![SD1_TOK.into(), in4.clone(), MID.into(), OUT71.into()]),
        // split components: diffusion_model_path + clip_l_path (+ vae_path)
        (
            Sd1,
            vec!["clip_l.text_model.embeddings.token_embedding.weight:768x49408".into(), in4.clone(), MID.into(), OUT71.into(), "vae.decoder.conv_in.weight".into()],
        ),
        (Sd2, vec!["clip_l.text_model.embeddings.token_embedding.weight:1024x49408".into(), in4.clone(), MID.into(), OUT71.into()]),
        (Sd1Inpaint, vec![SD1_TOK.into(), in9.clone(), MID.into()]),
        (Sd1Pix2Pix, vec![SD1_TOK.into(), in8.clone(), MID.into()]),
        (Sd1TinyUnet, vec![SD1_TOK.into(), in4.clone(), OUT71.into()]),
        (Sdxs512Ds, vec![SD1_TOK.into(), in4.clone()]),
        (Sd2, vec![SD2_TOK.into(), in4.clone(), MID.into()]),
        (Sd2Inpaint, vec![SD2_TOK.into(), in9.clone(), MID.into()]),
        (Sd2TinyUnet, vec![SD2_TOK.into(), in4.clone(), OUT71.into()]),
        (
            Sdxs09,
            vec![SD2_TOK.into(), in4.clone(), "model.diffusion_model.output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight:1024x640".into()],
        ),
        (Sdxl, vec![in4.clone(), "conditioner.embedders.1.model.ln_final.weight".into(), MID.into()]),
        // split components: diffusion_model_path + clip_l_path + clip_g_path
        (
            Sdxl,
            vec![
                in4.clone(),
                "clip_l.text_model.embeddings.token_embedding.weight:768x49408".into(),
                "clip_g.text_model.embeddings.token_embedding.weight:1280x49408".into(),
                MID.into(),
            ],
        ),
        (Sdxl, vec!["clip_g.text_model.final_layer_norm.weight".into(), in4.clone(), MID.into()]),
        (SdxlInpaint, vec!["conditioner.embedders.1.x".into(), in9.clone(), MID.into()]),
        (SdxlPix2Pix, vec!["conditioner.embedders.1.x".into(), in8.clone(), MID.into()]),
        (SdxlSsd1b, vec![in4.clone(), "cond_stage_model.1.x".into(), dm("output_blocks.3.1.transformer_blocks.1.attn1.to_q.weight")]),
        (SdxlVega, vec![in4.clone(), "cond_stage_model.1.x".into()]),
        (Svd, vec![in4.clone(), dm("input_blocks.8.0.time_mixer.mix_factor")]),
        (Sd3, vec![dm("joint_blocks.0.x_block.attn.qkv.weight")]),
        (Flux, vec![dm("double_blocks.0.img_attn.qkv.weight"), dm("img_in.weight:64x3072")]),
        (FluxFill, vec![dm("double_blocks.0.x"), dm("img_in.weight:384x3072")]),
        (FluxControls, vec![dm("double_blocks.0.x"), dm("img_in.weight:128x3072")]),
        (Flex2, vec![dm("double_blocks.0.x"), dm("img_in.weight:196x3072")]),
        (ChromaRadiance, vec![dm("double_blocks.0.x"), dm("nerf_final_layer_conv.conv.weight")]),
        (Longcat, vec![dm("double_blocks.0.x"), dm("txt_in.weight:3584x3072")]),
        (Wan2, vec![dm("blocks.0.cross_attn.norm_k.weight"), dm("patch_embedding.weight:2x2x1x80"), dm("img_emb.proj.0.weight")]),
        (Wan2_2I2v, vec![dm("blocks.0.cross_attn.norm_k.weight"), dm("patch_embedding.weight:2x2x1x184320")]),
        (Wan2_2Ti2v, vec![dm("blocks.0.cross_attn.norm_k.weight"), dm("patch_embedding.weight:2x2x1x147456")]),
        (LingbotVideo, vec![dm("patch_embedder.weight")]),
        (QwenImage, vec![dm("transformer_blocks.0.img_mod.1.weight"), dm("img_in.weight:64x3072")]),
        (QwenImageLayered, vec![dm("transformer_blocks.0.img_mod.1.weight"), dm("time_text_embed.addition_t_embedding.weight")]),
        (MageFlow, vec![dm("img_in.weight:128x3072"), dm("transformer_blocks.0.img_mod.1.weight")]),
        (HunyuanVideo, vec![dm("txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight")]),
        (Anima, vec![dm("net.llm_adapter.blocks.0.cross_attn.q_proj.weight")]),
        (Flux2, vec![dm("double_stream_modulation_img.lin.weight"), dm("double_blocks.0.x"), dm("single_blocks.47.linear1.weight")]),
        (Flux2Klein, vec![dm("double_stream_modulation_img.lin.weight"), dm("single_blocks.19.linear1.weight")]),
        (Ltxav, vec![dm("adaln_single.emb.timestep_embedder.linear_1.bias")]),
        (MinimaxH3, vec![dm("video_patch_proj.weight"), dm("audio_patch_proj.weight")]),
        (HidreamO1, vec!["model.x_embedder.proj1.weight".into(), "model.language_model.layers.0.self_attn.q_proj.weight".into()]),
        (ZImage, vec![dm("cap_embedder.0.weight")]),
        (BooguImage, vec![dm("double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight")]),
        (OvisImage, vec![dm("double_blocks.0.img_mlp.gate_proj.weight")]),
        (ErnieImage, vec![dm("layers.0.adaLN_sa_ln.weight")]),
        (Lens, vec![dm("transformer_blocks.0.img_mlp.w1.weight"), dm("transformer_blocks.0.attn.norm_added_q.weight")]),
        (Minit2i, vec!["net.img_embedder.proj1.weight".into()]),
        (Pid, vec![dm("net.lq_proj.latent_proj.0.weight")]),
        (Ideogram4, vec![dm("embed_image_indicator.weight")]),
        (SefiImage, vec![dm("dual_time_embed.semantic_embedder.linear_1.weight")]),
        (Krea2, vec![dm("text_fusion.projector.weight")]),
    ];
    let mut seen = std::collections::HashSet::new();
    for (want, items) in &owned {
        let refs: Vec<&str> = items.iter().map(String::as_str).collect();
        let (want, tensors) = case(*want, &refs);
        assert_eq!(detect(&tensors), Some(want), "{items:?}");
        seen.insert(want);
    }
    // ESRGAN is never detected: the upscaler says it.
    let missing: Vec<_> = SdVersion::ALL.iter().filter(|v| !seen.contains(v) && **v != Esrgan).collect();
    assert!(missing.is_empty(), "untested: {missing:?}");
    assert_eq!(SdVersion::ALL.len(), 47);
}

#[test]
fn diffusers_layouts_and_unknowns() {
    let sd1 = ts(&["unet.down_blocks.0.resnets.0.conv1.weight", "unet.mid_block.resnets.1.conv1.weight", "te.text_model.embeddings.token_embedding.weight:768x49408", "unet.up_blocks.2.attentions.1.proj_in.weight"]);
    assert_eq!(detect(&sd1), Some(Sd1));
    let xl = ts(&["te.1.text_model.x", "unet.down_blocks.0.x", "unet.mid_block.resnets.1.x"]);
    assert_eq!(detect(&xl), Some(Sdxl));
    let vae_only = ts(&["first_stage_model.decoder.conv_in.weight:3x3x4x512"]);
    assert_eq!(detect(&vae_only), None);
    assert_eq!(detect::<(String, Vec<i64>)>(&[]), None);
    // The first decisive name wins, as in the reference.
    let both = ts(&["model.diffusion_model.joint_blocks.0.x", "model.diffusion_model.cap_embedder.0.weight"]);
    assert_eq!(detect(&both), Some(Sd3));
}

#[test]
fn version_helpers() {
    assert!(Sd1.is_sd1() && Sdxs512Ds.is_sd1() && Sdxs09.is_sd2() && SdxlVega.is_sdxl());
    assert!(Sd2Inpaint.is_unet() && !Flux.is_unet() && Flux.is_dit() && HidreamO1.is_dit() && !Svd.is_dit());
    assert!(OvisImage.is_flux() && OvisImage.uses_flux_vae() && Flux2Klein.uses_flux2_vae() && Anima.uses_wan_vae());
    assert!(Flex2.is_inpaint() && Flex2.is_control() && Sd1Pix2Pix.is_inpaint_or_unet_edit());
    assert_eq!(SdVersion::from_raw(46), Some(Esrgan));
    assert_eq!(SdVersion::from_raw(47), None);
    assert_eq!(Sd1.name(), "SD 1.x");
    assert_eq!(Wan2_2Ti2v.raw(), 23);
}

#[test]
fn synthetic_checkpoints() {
    for (arch, want) in [("sd1", Sd1), ("sd2", Sd2), ("sdxl", Sdxl), ("sd1-inpaint", Sd1Inpaint)] {
        let Some(mut list) = io_common::synth_list(arch) else {
            eprintln!("skipping: python3 with numpy is needed to list the synthetic {arch} checkpoint");
            return;
        };
        list.sort_by(|a, b| a.0.cmp(&b.0)); // safetensors files list names sorted
        assert_eq!(detect(&list), Some(want), "{arch}");
    }
}

#[test]
fn cached_synthetic_files() {
    use stable_diffusion::io::{ModelFiles, ModelSource};
    for (file, want) in [("sd1.safetensors", Sd1), ("sd2.safetensors", Sd2), ("sdxl.safetensors", Sdxl), ("sd1_inpaint.safetensors", Sd1Inpaint)] {
        let Some(path) = io_common::cached_file(file) else { continue };
        let m = ModelFiles::open(&[ModelSource::new(&path, "")]).unwrap();
        assert_eq!(m.detect_version(), Some(want), "{file}");
        let t = &m.tensors()[0];
        let mut buf = vec![0u8; t.nelements() as usize * 4];
        m.read_tensor(t, stable_diffusion::types::SdType::F32, &mut buf).unwrap();
    }
    // A separate VAE whose names already carry `first_stage_model.` gets the `vae.` prefix
    // on top, like in the reference, and so does not replace the checkpoint's own VAE.
    if let (Some(sd1), Some(vae)) = (io_common::cached_file("sd1.safetensors"), io_common::cached_file("vae.safetensors")) {
        let mut m = ModelFiles::open(&[ModelSource::new(&sd1, ""), ModelSource::new(&vae, "vae.")]).unwrap();
        m.convert_names(None);
        assert_eq!(m.get("first_stage_model.decoder.conv_in.weight").unwrap().file_index(), 0);
        let extra = m.get("first_stage_model.first_stage_model.decoder.conv_in.weight").expect("vae tensor");
        assert_eq!(extra.file_index(), 1);
    }
}
