//! What a Wan checkpoint is, read from its weights the way the reference reads it
//! (`WanConfig::detect_from_weights` plus the fixed per-size table of `WanRunner`).

use crate::error::Result;
use crate::graph::TypeMap;

/// Which job a Wan transformer does (the reference keeps it in `desc` strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WanMode {
    /// Text to video: 16 latent channels in.
    T2v,
    /// Image to video: 36 channels in (16 noisy + 4 mask + 16 encoded frames). Wan2.1 reads
    /// the CLIP-vision tokens through `img_emb`; Wan2.2's I2V has no `img_emb`.
    I2v,
    /// First and last frame to video: I2V with `img_emb.emb_pos` (514 CLIP tokens).
    Flf2v,
    /// Wan2.2 TI2V 5B: 48-channel latent, one timestep per latent frame.
    Ti2v,
    /// VACE: `vace_blocks` whose hints are added after some of the main blocks.
    Vace,
}

/// A Wan transformer's configuration. Every field is public so tests can build tiny ones;
/// files only reach [`WanConfig::detect`], which admits the sizes the reference admits.
#[derive(Clone, Debug, PartialEq)]
pub struct WanConfig {
    pub mode: WanMode,
    /// Transformer blocks (30 or 40 in real files).
    pub num_layers: usize,
    pub vace_layers: usize,
    /// Channels of the latent the patch embedding reads (noisy + concat).
    pub in_dim: i64,
    pub out_dim: i64,
    pub dim: i64,
    pub ffn_dim: i64,
    pub num_heads: i64,
    /// Width of the sinusoidal timestep embedding.
    pub freq_dim: i64,
    /// Width of the text context (UMT5-XXL hidden states).
    pub text_dim: i64,
    /// Text tokens the model was trained with (the conditioner pads to it).
    pub text_len: i64,
    /// Width of the CLIP-vision hidden states `img_emb` reads.
    pub clip_dim: i64,
    /// `(t, h, w)` patch size.
    pub patch_size: [i64; 3],
    pub vace_in_dim: i64,
    /// The cross-attention has `k_img` / `v_img` and the model an `img_emb` (the
    /// reference's `model_type == "i2v"`).
    pub has_img_emb: bool,
    /// Learned positions added to the CLIP tokens (FLF2V: 514), 0 without.
    pub flf_pos_tokens: i64,
    /// Detected as Wan2.2 I2V 14B or TI2V 5B (the reference decides these from its version).
    pub wan22: bool,
    pub eps: f32,
    pub theta: f32,
    /// RoPE dimensions of the frame, row and column axes (sum = head dimension).
    pub axes_dim: Vec<usize>,
}

/// The patch embedding's `IC·OC` of Wan2.2 I2V 14B (36 × 5120) and TI2V 5B (48 × 3072),
/// the numbers the reference's version detection looks for.
const WAN22_I2V_PATCH: i64 = 36 * 5120;
const WAN22_TI2V_PATCH: i64 = 48 * 3072;

/// Index of the block in `…marker<i>.…` when the name has `marker`.
fn block_index(name: &str, marker: &str) -> Option<Option<usize>> {
    let pos = name.find(marker)?;
    Some(name[pos + marker.len()..].split('.').next().and_then(|s| s.parse().ok()))
}

impl WanConfig {
    /// The configuration of the Wan transformer under `prefix`, decided like the reference:
    /// block counts and the `img_emb` / `emb_pos` markers from the names, the Wan2.2
    /// variants from the patch embedding's size (as its version detection does), every width
    /// from its table for 30 (1.3B / 5B) or 40 (14B) blocks. Other block counts, which the
    /// reference aborts on, are refused.
    pub fn detect(types: &TypeMap, shape_of: &dyn Fn(&str) -> Option<Vec<i64>>, prefix: &str) -> Result<WanConfig> {
        let (mut layers, mut vace_layers, mut img_emb, mut emb_pos) = (0usize, 0usize, false, false);
        for name in types.keys().filter(|n| n.starts_with(prefix)) {
            // `vace_blocks.` also contains `blocks.`: it is looked for first.
            if let Some(i) = block_index(name, "vace_blocks.") {
                vace_layers = vace_layers.max(i.map_or(0, |i| i + 1));
                continue;
            }
            if let Some(i) = block_index(name, "blocks.") {
                layers = layers.max(i.map_or(0, |i| i + 1));
                continue;
            }
            img_emb |= name.contains("img_emb");
            emb_pos |= name.contains("img_emb.emb_pos");
        }
        let patch = shape_of(&format!("{prefix}patch_embedding.weight")).and_then(|s| s.get(3).copied()).unwrap_or(0);
        let wan22_i2v = patch == WAN22_I2V_PATCH && !img_emb;
        let ti2v = patch == WAN22_TI2V_PATCH && !img_emb;

        let mut cfg = WanConfig {
            mode: WanMode::T2v,
            num_layers: layers,
            vace_layers,
            in_dim: 16,
            out_dim: 16,
            dim: 1536,
            ffn_dim: 8960,
            num_heads: 12,
            freq_dim: 256,
            text_dim: 4096,
            text_len: 512,
            clip_dim: 1280,
            patch_size: [1, 2, 2],
            vace_in_dim: 96,
            has_img_emb: img_emb,
            flf_pos_tokens: if emb_pos { 514 } else { 0 },
            wan22: false,
            eps: 1e-6,
            theta: 10000.0,
            axes_dim: vec![44, 42, 42],
        };
        match layers {
            30 if ti2v => {
                (cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.in_dim, cfg.out_dim) = (3072, 14336, 24, 48, 48);
                cfg.wan22 = true;
            }
            30 => {
                // VACE wins over I2V here, as in the reference.
                cfg.in_dim = if vace_layers == 0 && img_emb { 36 } else { 16 };
            }
            40 => {
                (cfg.dim, cfg.ffn_dim, cfg.num_heads) = (5120, 13824, 40);
                cfg.in_dim = if img_emb || wan22_i2v { 36 } else { 16 };
                cfg.wan22 = !img_emb && wan22_i2v;
            }
            n => bail!("invalid num_layers({n}) of wan: only 30 (1.3B, TI2V 5B) or 40 (14B) blocks are supported"),
        }
        // As `desc` says. A 1.3B file with `emb_pos` is I2V there too: the reference's
        // pipeline then hands it the start image's 257 CLIP tokens, which its 514 positions
        // do not fit (the reference aborts; `compute` refuses them).
        cfg.mode = if cfg.wan22 {
            if layers == 30 {
                WanMode::Ti2v
            } else {
                WanMode::I2v
            }
        } else if vace_layers > 0 && !(layers == 40 && img_emb) {
            WanMode::Vace
        } else if emb_pos && img_emb && layers == 40 {
            WanMode::Flf2v
        } else if img_emb {
            WanMode::I2v
        } else {
            WanMode::T2v
        };
        cfg.vace_mapping()?;
        sd_debug!(
            "wan: model_type = {}, num_layers = {}, vace_layers = {}, dim = {}, ffn_dim = {}, num_heads = {}",
            if img_emb { "i2v" } else { "t2v" },
            cfg.num_layers,
            cfg.vace_layers,
            cfg.dim,
            cfg.ffn_dim,
            cfg.num_heads
        );
        sd_info!("{}", cfg.desc());
        Ok(cfg)
    }

    /// The reference's name for the checkpoint (its `desc`), for logs.
    pub fn desc(&self) -> &'static str {
        let vace = self.vace_layers > 0;
        match self.num_layers {
            30 if self.wan22 => "Wan2.2-TI2V-5B",
            30 if vace => "Wan2.1-VACE-1.3B",
            30 if self.has_img_emb => "Wan2.1-I2V-1.3B",
            30 => "Wan2.1-T2V-1.3B",
            40 if self.has_img_emb && self.flf_pos_tokens > 0 => "Wan2.1-FLF2V-14B",
            40 if self.has_img_emb => "Wan2.1-I2V-14B",
            40 if self.wan22 => "Wan2.2-I2V-14B",
            40 if vace => "Wan2.x-VACE-14B",
            40 => "Wan2.x-T2V-14B",
            _ => "Wan",
        }
    }

    pub fn head_dim(&self) -> i64 {
        self.dim / self.num_heads.max(1)
    }

    /// Main block → VACE block whose hint is added after it: every `num_layers /
    /// vace_layers`-th block from 0 on. A layout that would need a VACE block the file does not
    /// have (the reference dereferences a missing block there) is refused.
    pub fn vace_mapping(&self) -> Result<Vec<Option<usize>>> {
        let mut map = vec![None; self.num_layers];
        if self.vace_layers == 0 {
            return Ok(map);
        }
        ensure!(
            self.vace_layers <= self.num_layers,
            "wan: {} VACE blocks for {} blocks (at most one per block)",
            self.vace_layers,
            self.num_layers
        );
        let step = self.num_layers / self.vace_layers;
        for (n, i) in (0..self.num_layers).step_by(step).enumerate() {
            ensure!(
                n < self.vace_layers,
                "wan: {} blocks with {} VACE blocks would need a VACE block {n} after block {i}, which the file does not have",
                self.num_layers,
                self.vace_layers
            );
            map[i] = Some(n);
        }
        Ok(map)
    }

    /// What the graphs need of a configuration (tests build their own).
    pub fn validate(&self) -> Result<()> {
        ensure!(self.num_layers > 0, "wan: no transformer blocks");
        ensure!(
            self.num_heads > 0 && self.dim % self.num_heads == 0,
            "wan: width {} does not split into {} heads",
            self.dim,
            self.num_heads
        );
        let axes: usize = self.axes_dim.iter().sum();
        ensure!(
            axes as i64 == self.head_dim() && self.axes_dim.len() == 3 && self.axes_dim.iter().all(|d| d % 2 == 0),
            "wan: RoPE axes {:?} do not cover the head dimension {}",
            self.axes_dim,
            self.head_dim()
        );
        let [pt, ph, pw] = self.patch_size;
        ensure!(pt == 1 && ph > 0 && ph == pw, "wan: patch size {:?} is not (1, p, p)", self.patch_size);
        self.vace_mapping()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{F16, F32};
    use std::collections::HashMap;

    const P: &str = "model.diffusion_model.";

    /// Names (and the patch embedding's shape) of a Wan file with `layers` blocks.
    fn file(layers: usize, vace: usize, i2v: bool, flf: bool, patch_ic_oc: i64) -> (TypeMap, HashMap<String, Vec<i64>>) {
        let mut types = TypeMap::new();
        let mut shapes = HashMap::new();
        let mut add = |n: &str, ty, s: &[i64]| {
            types.insert(format!("{P}{n}"), ty);
            shapes.insert(format!("{P}{n}"), s.to_vec());
        };
        add("patch_embedding.weight", F16, &[2, 2, 1, patch_ic_oc]);
        add("head.modulation", F32, &[1, 2, 1]);
        for i in 0..layers {
            add(&format!("blocks.{i}.self_attn.q.weight"), F16, &[1, 1]);
        }
        for i in 0..vace {
            add(&format!("vace_blocks.{i}.after_proj.weight"), F16, &[1, 1]);
        }
        if i2v {
            add("img_emb.proj.1.weight", F16, &[1280, 1280]);
        }
        if flf {
            add("img_emb.emb_pos", F32, &[1280, 514, 1]);
        }
        (types, shapes)
    }

    fn detect(layers: usize, vace: usize, i2v: bool, flf: bool, patch: i64) -> Result<WanConfig> {
        let (types, shapes) = file(layers, vace, i2v, flf, patch);
        WanConfig::detect(&types, &|n| shapes.get(n).cloned(), P)
    }

    #[test]
    fn every_mode_and_size_is_detected_like_the_reference() {
        let c = detect(30, 0, false, false, 16 * 1536).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.out_dim, c.dim, c.ffn_dim, c.num_heads), (WanMode::T2v, "Wan2.1-T2V-1.3B", 16, 16, 1536, 8960, 12));
        assert_eq!(c.head_dim(), 128);
        c.validate().unwrap();

        let c = detect(40, 0, false, false, 16 * 5120).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.dim, c.ffn_dim, c.num_heads), (WanMode::T2v, "Wan2.x-T2V-14B", 16, 5120, 13824, 40));
        c.validate().unwrap();

        let c = detect(40, 0, true, false, 36 * 5120).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.has_img_emb, c.flf_pos_tokens), (WanMode::I2v, "Wan2.1-I2V-14B", 36, true, 0));
        let c = detect(30, 0, true, false, 36 * 1536).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim), (WanMode::I2v, "Wan2.1-I2V-1.3B", 36));
        // emb_pos at 1.3B size: still called I2V (and given 257 CLIP tokens) by the reference.
        let c = detect(30, 0, true, true, 36 * 1536).unwrap();
        assert_eq!((c.mode, c.desc(), c.flf_pos_tokens), (WanMode::I2v, "Wan2.1-I2V-1.3B", 514));

        // Wan2.2 I2V: no img_emb, told apart by its 36-channel patch embedding.
        let c = detect(40, 0, false, false, 36 * 5120).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.has_img_emb, c.wan22), (WanMode::I2v, "Wan2.2-I2V-14B", 36, false, true));

        let c = detect(40, 0, true, true, 36 * 5120).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.flf_pos_tokens), (WanMode::Flf2v, "Wan2.1-FLF2V-14B", 36, 514));

        let c = detect(30, 0, false, false, 48 * 3072).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.out_dim, c.dim, c.ffn_dim, c.num_heads), (WanMode::Ti2v, "Wan2.2-TI2V-5B", 48, 48, 3072, 14336, 24));
        c.validate().unwrap();

        let c = detect(30, 15, false, false, 16 * 1536).unwrap();
        assert_eq!((c.mode, c.desc(), c.in_dim, c.vace_layers), (WanMode::Vace, "Wan2.1-VACE-1.3B", 16, 15));
        let map = c.vace_mapping().unwrap();
        assert_eq!((map[0], map[1], map[2], map[28], map[29]), (Some(0), None, Some(1), Some(14), None));
        let c = detect(40, 8, false, false, 16 * 5120).unwrap();
        assert_eq!((c.mode, c.desc()), (WanMode::Vace, "Wan2.x-VACE-14B"));
        let map = c.vace_mapping().unwrap();
        assert_eq!(map.iter().flatten().count(), 8);
        assert_eq!((map[35], map[36]), (Some(7), None));
        // The synthetic VACE fixture: one VACE block after block 0 only.
        let c = detect(30, 1, false, false, 16 * 1536).unwrap();
        assert_eq!(c.vace_mapping().unwrap().iter().flatten().count(), 1);
    }

    #[test]
    fn block_counts_the_reference_aborts_on_are_errors() {
        let e = detect(1, 0, false, false, 16 * 1536).unwrap_err().to_string();
        assert!(e.contains("invalid num_layers(1) of wan"), "{e}");
        let e = detect(0, 0, false, false, 0).unwrap_err().to_string();
        assert!(e.contains("num_layers(0)"), "{e}");
        // 4 VACE blocks over 30 blocks: every 7th block from 0 needs a fifth.
        let e = detect(30, 4, false, false, 16 * 1536).unwrap_err().to_string();
        assert!(e.contains("VACE block 4"), "{e}");
        // Names of another prefix do not count.
        let (types, shapes) = file(30, 0, false, false, 16 * 1536);
        assert!(WanConfig::detect(&types, &|n| shapes.get(n).cloned(), "other.").is_err());
    }
}
