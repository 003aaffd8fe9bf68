//! Model families, and telling which one a set of tensors is from names and shapes.

use super::storage::TensorStorage;
use std::collections::HashMap;

macro_rules! versions {
    ($($v:ident => $text:expr),* $(,)?) => {
        /// The model families the reference knows, in its order (the discriminant is the
        /// reference's `SDVersion` value).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum SdVersion { $($v,)* }

        impl SdVersion {
            pub const ALL: &'static [SdVersion] = &[$(SdVersion::$v,)*];

            /// The reference's display name ("SD 1.x", "SDXL", ...).
            pub fn name(self) -> &'static str {
                match self { $(SdVersion::$v => $text,)* }
            }
        }
    };
}

versions! {
    Sd1 => "SD 1.x",
    Sd1Inpaint => "SD 1.x Inpaint",
    Sd1Pix2Pix => "Instruct-Pix2Pix",
    Sd1TinyUnet => "SD 1.x Tiny UNet",
    Sd2 => "SD 2.x",
    Sd2Inpaint => "SD 2.x Inpaint",
    Sd2TinyUnet => "SD 2.x Tiny UNet",
    Sdxs512Ds => "SDXS (512-DS)",
    Sdxs09 => "SDXS (09)",
    Sdxl => "SDXL",
    SdxlInpaint => "SDXL Inpaint",
    SdxlPix2Pix => "SDXL Instruct-Pix2Pix",
    SdxlVega => "SDXL (Vega)",
    SdxlSsd1b => "SDXL (SSD1B)",
    Svd => "SVD",
    Sd3 => "SD3.x",
    Flux => "Flux",
    FluxFill => "Flux Fill",
    FluxControls => "Flux Control",
    Flex2 => "Flex.2",
    ChromaRadiance => "Chroma Radiance",
    Wan2 => "Wan 2.x",
    Wan2_2I2v => "Wan 2.2 I2V",
    Wan2_2Ti2v => "Wan 2.2 TI2V",
    LingbotVideo => "LingBot Video",
    QwenImage => "Qwen Image",
    QwenImageLayered => "Qwen Image Layered",
    HunyuanVideo => "Hunyuan Video",
    Anima => "Anima",
    Flux2 => "Flux.2",
    Flux2Klein => "Flux.2 klein",
    Ltxav => "LTXAV",
    MinimaxH3 => "MiniMax-H3",
    HidreamO1 => "HiDream O1",
    ZImage => "Z-Image",
    BooguImage => "Boogu Image",
    OvisImage => "Ovis Image",
    ErnieImage => "Ernie Image",
    Lens => "Lens",
    Minit2i => "MiniT2I",
    Longcat => "Longcat-Image",
    Pid => "PiD",
    Ideogram4 => "Ideogram 4",
    SefiImage => "SeFi-Image",
    Krea2 => "Krea2",
    MageFlow => "Mage Flow",
    Esrgan => "ESRGAN",
}

impl std::fmt::Display for SdVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl SdVersion {
    /// The reference's numeric value.
    pub fn raw(self) -> u32 {
        self as u32
    }

    pub fn from_raw(v: u32) -> Option<Self> {
        Self::ALL.get(v as usize).copied()
    }

    pub fn is_sd1(self) -> bool {
        use SdVersion::*;
        matches!(self, Sd1 | Sd1Inpaint | Sd1Pix2Pix | Sd1TinyUnet | Sdxs512Ds)
    }
    pub fn is_sd2(self) -> bool {
        use SdVersion::*;
        matches!(self, Sd2 | Sd2Inpaint | Sd2TinyUnet | Sdxs09)
    }
    pub fn is_sdxl(self) -> bool {
        use SdVersion::*;
        matches!(self, Sdxl | SdxlInpaint | SdxlPix2Pix | SdxlSsd1b | SdxlVega)
    }
    pub fn is_unet(self) -> bool {
        self.is_sd1() || self.is_sd2() || self.is_sdxl()
    }
    pub fn is_sd3(self) -> bool {
        self == SdVersion::Sd3
    }
    pub fn is_flux(self) -> bool {
        use SdVersion::*;
        matches!(self, Flux | FluxFill | FluxControls | Flex2 | OvisImage | ChromaRadiance)
    }
    pub fn is_flux2(self) -> bool {
        matches!(self, SdVersion::Flux2 | SdVersion::Flux2Klein)
    }
    pub fn is_ltxav(self) -> bool {
        self == SdVersion::Ltxav
    }
    pub fn is_minimax_h3(self) -> bool {
        self == SdVersion::MinimaxH3
    }
    pub fn is_wan(self) -> bool {
        matches!(self, SdVersion::Wan2 | SdVersion::Wan2_2I2v | SdVersion::Wan2_2Ti2v)
    }
    pub fn is_lingbot_video(self) -> bool {
        self == SdVersion::LingbotVideo
    }
    pub fn is_qwen_image(self) -> bool {
        matches!(self, SdVersion::QwenImage | SdVersion::QwenImageLayered)
    }
    pub fn is_hunyuan_video(self) -> bool {
        self == SdVersion::HunyuanVideo
    }
    pub fn is_anima(self) -> bool {
        self == SdVersion::Anima
    }
    pub fn is_z_image(self) -> bool {
        self == SdVersion::ZImage
    }
    pub fn is_boogu_image(self) -> bool {
        self == SdVersion::BooguImage
    }
    pub fn is_longcat(self) -> bool {
        self == SdVersion::Longcat
    }
    pub fn is_ernie_image(self) -> bool {
        self == SdVersion::ErnieImage
    }
    pub fn is_lens(self) -> bool {
        self == SdVersion::Lens
    }
    pub fn is_minit2i(self) -> bool {
        self == SdVersion::Minit2i
    }
    pub fn is_pid(self) -> bool {
        self == SdVersion::Pid
    }
    pub fn is_ideogram4(self) -> bool {
        self == SdVersion::Ideogram4
    }
    pub fn is_sefi_image(self) -> bool {
        self == SdVersion::SefiImage
    }
    pub fn is_krea2(self) -> bool {
        self == SdVersion::Krea2
    }
    pub fn is_mage_flow(self) -> bool {
        self == SdVersion::MageFlow
    }
    pub fn uses_flux_vae(self) -> bool {
        self.is_flux() || self.is_z_image() || self.is_boogu_image() || self.is_longcat()
    }
    pub fn uses_flux2_vae(self) -> bool {
        self.is_flux2() || self.is_ernie_image() || self.is_lens() || self.is_ideogram4() || self.is_sefi_image()
    }
    pub fn uses_wan_vae(self) -> bool {
        self.is_wan() || self.is_lingbot_video() || self.is_qwen_image() || self.is_krea2() || self.is_anima()
    }
    pub fn uses_hunyuan_video_vae(self) -> bool {
        self.is_hunyuan_video()
    }
    pub fn is_inpaint(self) -> bool {
        use SdVersion::*;
        matches!(self, Sd1Inpaint | Sd2Inpaint | SdxlInpaint | FluxFill | Flex2)
    }
    pub fn is_dit(self) -> bool {
        self.is_flux()
            || self.is_flux2()
            || self.is_ltxav()
            || self.is_minimax_h3()
            || self.is_sd3()
            || self.is_wan()
            || self.is_lingbot_video()
            || self.is_qwen_image()
            || self.is_hunyuan_video()
            || self == SdVersion::HidreamO1
            || self.is_anima()
            || self.is_z_image()
            || self.is_boogu_image()
            || self.is_ernie_image()
            || self.is_lens()
            || self.is_minit2i()
            || self.is_longcat()
            || self.is_pid()
            || self.is_ideogram4()
            || self.is_sefi_image()
            || self.is_krea2()
            || self.is_mage_flow()
    }
    pub fn is_unet_edit(self) -> bool {
        matches!(self, SdVersion::Sd1Pix2Pix | SdVersion::SdxlPix2Pix)
    }
    pub fn is_control(self) -> bool {
        matches!(self, SdVersion::FluxControls | SdVersion::Flex2)
    }
    pub fn is_inpaint_or_unet_edit(self) -> bool {
        self.is_unet_edit() || self.is_inpaint() || self.is_control()
    }
}

/// Anything that can be scanned for version detection: a name and a ggml shape.
pub trait NamedShape {
    fn tensor_name(&self) -> &str;
    /// The four ggml dimensions (missing ones are 1).
    fn ggml_ne(&self) -> [i64; 4];
}

impl NamedShape for TensorStorage {
    fn tensor_name(&self) -> &str {
        self.name()
    }
    fn ggml_ne(&self) -> [i64; 4] {
        self.ne()
    }
}

impl<S: AsRef<str>> NamedShape for (S, Vec<i64>) {
    fn tensor_name(&self) -> &str {
        self.0.as_ref()
    }
    fn ggml_ne(&self) -> [i64; 4] {
        let mut ne = [1i64; 4];
        for (i, d) in self.1.iter().take(4).enumerate() {
            ne[i] = *d;
        }
        ne
    }
}

/// The family of a model, from tensor names and shapes in listing order (the reference
/// stops at the first decisive name, so order matters). `None` when nothing matches.
pub fn detect<T: NamedShape>(tensors: &[T]) -> Option<SdVersion> {
    use SdVersion::*;
    let by_name: HashMap<&str, usize> = tensors.iter().enumerate().map(|(i, t)| (t.tensor_name(), i)).collect();
    let has = |n: &str| by_name.contains_key(n);
    let ne_of = |n: &str| by_name.get(n).map(|&i| tensors[i].ggml_ne());

    let mut token_embedding = [1i64; 4];
    let mut input_block = [1i64; 4];
    let mut context_embedding = [1i64; 4];
    let mut has_multiple_encoders = false;
    let mut is_unet = false;
    let mut is_xl = false;
    let mut is_flux = false;
    let mut is_flux2 = false;
    let mut has_single_block_47 = false;
    let mut is_wan = false;
    let mut patch_embedding_channels = 0i64;
    let mut has_img_emb = false;
    let mut has_middle_block_1 = false;
    let mut has_output_block_311 = false;
    let mut has_output_block_71 = false;
    let mut has_attn_1024 = false;

    for t in tensors {
        let name = t.tensor_name();
        let ne = t.ggml_ne();
        let c = |s: &str| name.contains(s);
        if c("model.diffusion_model.double_blocks.") || c("model.diffusion_model.single_transformer_blocks.") {
            is_flux = true;
        }
        if c("model.diffusion_model.net.lq_proj.latent_proj.0.weight") {
            return Some(Pid);
        }
        if c("embed_image_indicator.weight") {
            return Some(Ideogram4);
        }
        if c("model.diffusion_model.txtfusion.projector.weight") || c("model.diffusion_model.text_fusion.projector.weight") {
            return Some(Krea2);
        }
        if c("model.diffusion_model.nerf_final_layer_conv.") {
            return Some(ChromaRadiance);
        }
        if c("model.diffusion_model.joint_blocks.") {
            return Some(Sd3);
        }
        if c("model.x_embedder.proj1.weight") && has("model.language_model.layers.0.self_attn.q_proj.weight") {
            return Some(HidreamO1);
        }
        if c("model.diffusion_model.transformer_blocks.0.attn.norm_added_q.weight")
            && has("model.diffusion_model.transformer_blocks.0.img_mlp.w1.weight")
        {
            return Some(Lens);
        }
        if c("net.img_embedder.proj1.weight") {
            return Some(Minit2i);
        }
        if c("model.diffusion_model.transformer_blocks.0.img_mod.1.weight") {
            if ne_of("model.diffusion_model.img_in.weight").is_some_and(|n| n[0] == 128) {
                return Some(MageFlow);
            }
            if has("model.diffusion_model.time_text_embed.addition_t_embedding.weight") {
                return Some(QwenImageLayered);
            }
            return Some(QwenImage);
        }
        if c("model.diffusion_model.txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.weight") {
            return Some(HunyuanVideo);
        }
        if c("llm_adapter.blocks.0.cross_attn.q_proj.weight") {
            return Some(Anima);
        }
        if c("model.diffusion_model.double_stream_modulation_img.lin.weight") {
            is_flux2 = true;
        }
        if c("dual_time_embed.semantic_embedder.linear_1.weight") {
            return Some(SefiImage);
        }
        if c("single_blocks.47.linear1.weight") {
            has_single_block_47 = true;
        }
        if c("model.diffusion_model.double_blocks.0.img_mlp.gate_proj.weight") {
            return Some(OvisImage);
        }
        if c("model.diffusion_model.cap_embedder.0.weight") {
            return Some(ZImage);
        }
        if c("double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight") {
            return Some(BooguImage);
        }
        if c("model.diffusion_model.layers.0.adaLN_sa_ln.weight") {
            return Some(ErnieImage);
        }
        if c("model.diffusion_model.adaln_single.emb.timestep_embedder.linear_1.bias") {
            return Some(Ltxav);
        }
        if c("model.diffusion_model.video_patch_proj.weight") && has("model.diffusion_model.audio_patch_proj.weight") {
            return Some(MinimaxH3);
        }
        if c("model.diffusion_model.blocks.0.cross_attn.norm_k.weight") {
            is_wan = true;
        }
        if c("model.diffusion_model.patch_embedder.weight") {
            return Some(LingbotVideo);
        }
        if c("model.diffusion_model.patch_embedding.weight") {
            patch_embedding_channels = ne[3];
        }
        if c("model.diffusion_model.img_emb") {
            has_img_emb = true;
        }
        if c("model.diffusion_model.input_blocks.") || c("unet.down_blocks.") {
            is_unet = true;
            if has_multiple_encoders {
                is_xl = true;
            }
        }
        // `clip_g.`: a standalone OpenCLIP-bigG given as `clip_g_path` next to a standalone
        // UNet (SDXL split into components; the reference detects SDXL only from a checkpoint).
        if c("conditioner.embedders.1") || c("cond_stage_model.1") || c("te.1") || name.starts_with("clip_g.") {
            has_multiple_encoders = true;
            if is_unet {
                is_xl = true;
            }
        }
        if c("model.diffusion_model.input_blocks.8.0.time_mixer.mix_factor") {
            return Some(Svd);
        }
        if c("model.diffusion_model.middle_block.1.") || c("unet.mid_block.resnets.1.") {
            has_middle_block_1 = true;
        }
        if c("model.diffusion_model.output_blocks.3.1.transformer_blocks.1")
            || c("unet.up_blocks.1.attentions.0.transformer_blocks.1")
        {
            has_output_block_311 = true;
        }
        if c("model.diffusion_model.output_blocks.7.1") || c("unet.up_blocks.2.attentions.1") {
            has_output_block_71 = true;
            if c("model.diffusion_model.output_blocks.7.1.transformer_blocks.0.attn1.to_k.weight") && ne[0] == 1024 {
                has_attn_1024 = true;
            }
        }
        if matches!(
            name,
            "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
                | "cond_stage_model.model.token_embedding.weight"
                | "text_model.embeddings.token_embedding.weight"
                | "te.text_model.embeddings.token_embedding.weight"
                | "conditioner.embedders.0.model.token_embedding.weight"
                | "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"
                // A standalone CLIP given as `clip_l_path` next to a standalone UNet. The
                // reference stops at "get sd version" for SD 1.x/2.x split into components;
                // we accept them (families with their own markers are decided before this).
                | "clip_l.text_model.embeddings.token_embedding.weight"
        ) {
            token_embedding = ne;
        }
        if matches!(name, "model.diffusion_model.input_blocks.0.0.weight" | "model.diffusion_model.img_in.weight" | "unet.conv_in.weight") {
            input_block = ne;
        }
        if matches!(name, "model.diffusion_model.txt_in.weight" | "model.diffusion_model.context_embedder.weight") {
            context_embedding = ne;
        }
    }

    if is_wan {
        sd_debug!("patch_embedding_channels {}", patch_embedding_channels);
        if patch_embedding_channels == 184320 && !has_img_emb {
            return Some(Wan2_2I2v);
        }
        if patch_embedding_channels == 147456 && !has_img_emb {
            return Some(Wan2_2Ti2v);
        }
        return Some(Wan2);
    }
    let is_inpaint = input_block[2] == 9;
    let is_ip2p = input_block[2] == 8;
    if is_xl {
        return Some(if is_inpaint {
            SdxlInpaint
        } else if is_ip2p {
            SdxlPix2Pix
        } else if !has_middle_block_1 {
            if has_output_block_311 {
                SdxlSsd1b
            } else {
                SdxlVega
            }
        } else {
            Sdxl
        });
    }
    if is_flux && !is_flux2 {
        if context_embedding[0] == 3584 {
            return Some(Longcat);
        }
        return Some(match input_block[0] {
            384 => FluxFill,
            128 => FluxControls,
            196 => Flex2,
            _ => Flux,
        });
    }
    if is_flux2 {
        return Some(if has_single_block_47 { Flux2 } else { Flux2Klein });
    }
    match token_embedding[0] {
        768 => Some(if is_inpaint {
            Sd1Inpaint
        } else if is_ip2p {
            Sd1Pix2Pix
        } else if !has_middle_block_1 {
            if has_output_block_71 {
                Sd1TinyUnet
            } else {
                Sdxs512Ds
            }
        } else {
            Sd1
        }),
        1024 => Some(if is_inpaint {
            Sd2Inpaint
        } else if !has_middle_block_1 {
            if has_attn_1024 {
                Sdxs09
            } else {
                Sd2TinyUnet
            }
        } else {
            Sd2
        }),
        _ => None,
    }
}
