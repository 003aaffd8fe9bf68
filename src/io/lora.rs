//! LoRA files: their tensors under the reference's LoRA names, grouped by the model weight
//! each group adapts.
//!
//! A LoRA file is listed like a model file under the prefix `lora.` and its names go through
//! [`convert_tensor_name`](super::names::convert_tensor_name) for the model's version: that maps every naming scheme
//! (kohya `lora_unet_…`/`lora_te1_…`, LyCORIS `lycoris_…`, PEFT `….lora_A.weight`, diffusers
//! `….lora.up.weight` and `processor.to_q_lora.down`, full `diff`/`diff_b`) to
//! `lora.<internal weight name>[.<piece>].<part>`, e.g.
//! `lora.model.diffusion_model.input_blocks.1.1.proj_in.weight.lora_down`. The per-family
//! rules are in two tables: the name conversions of `io::names` (shared with model loading; a
//! DiT family adds its diffusers → original tables there, where fused q/k/v layers already
//! become pieces `qkv.weight`, `qkv.weight.1`, `qkv.weight.2`) and [`FUSED`] below, for
//! layers a model stores fused while LoRAs name them apart and the name tables keep them apart.

use super::{ModelFiles, SdVersion, TensorStorage};
use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// Layers some models store fused (torch `nn.MultiheadAttention`'s `in_proj` = q | k | v
/// rows, the OpenCLIP text encoders of SD 2.x and SDXL) while LoRAs name the parts:
/// (part name ending, fused name ending, piece index). Applied only when the model has the
/// fused weight and not the part.
pub const FUSED: &[(&str, &str, usize)] = &[
    ("self_attn.q_proj.weight", "self_attn.in_proj.weight", 0),
    ("self_attn.k_proj.weight", "self_attn.in_proj.weight", 1),
    ("self_attn.v_proj.weight", "self_attn.in_proj.weight", 2),
    ("self_attn.q_proj.bias", "self_attn.in_proj.bias", 0),
    ("self_attn.k_proj.bias", "self_attn.in_proj.bias", 1),
    ("self_attn.v_proj.bias", "self_attn.in_proj.bias", 2),
];

/// The LoRA tensors of one piece of a weight, by part name (`lora_up`, `alpha`, `hada_w1_a`,
/// …: the last component of the converted name).
pub type Parts = BTreeMap<String, String>;

/// A model weight and the LoRA tensors adapting it, by piece: one piece, or several when the
/// model fuses layers the LoRA names apart (stacked along the weight's last dimension in
/// piece order).
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub weight: String,
    pub pieces: BTreeMap<usize, Parts>,
}

/// One LoRA file, listed (no data read).
#[derive(Debug)]
pub struct LoraFile {
    path: String,
    files: ModelFiles,
}

/// `lora.<base>.<part>` → (base, part).
pub fn split_name(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix("lora.")?;
    let dot = rest.rfind('.')?;
    Some((&rest[..dot], &rest[dot + 1..])).filter(|(b, p)| !b.is_empty() && !p.is_empty())
}

/// The model weight a LoRA base name adapts and the piece it is: the weight itself,
/// `<weight>.<n>` (piece n), or a part of a fused weight ([`FUSED`]).
pub fn resolve(base: &str, has: &dyn Fn(&str) -> bool) -> Option<(String, usize)> {
    if has(base) {
        return Some((base.to_string(), 0));
    }
    if let Some((stem, n)) = base.rsplit_once('.') {
        if let Ok(n) = n.parse::<usize>() {
            if has(stem) {
                return Some((stem.to_string(), n));
            }
        }
    }
    FUSED.iter().find_map(|(part, fused, n)| {
        let stem = base.strip_suffix(part)?;
        let weight = format!("{stem}{fused}");
        has(&weight).then_some((weight, *n))
    })
}

impl LoraFile {
    /// Lists the tensors of the LoRA at `path` with names converted for `version`. A LoRA
    /// for the high-noise model of a two-expert video model only names weights under
    /// `model.high_noise_`.
    pub fn open(path: &str, version: SdVersion, high_noise: bool) -> Result<LoraFile> {
        let prefix = if high_noise { "lora.model.high_noise_" } else { "lora." };
        let mut files = ModelFiles::new();
        files.add(path, prefix).map_err(|e| Error::new(format!("cannot read LoRA '{path}': {e}")))?;
        files.convert_names(Some(version));
        Ok(LoraFile { path: path.to_string(), files })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Every tensor of the file, names converted.
    pub fn tensors(&self) -> &[TensorStorage] {
        self.files.tensors()
    }

    pub fn get(&self, name: &str) -> Option<&TensorStorage> {
        self.files.get(name)
    }

    /// Groups the tensors by the weight they adapt, for a model whose weights `has` names,
    /// in file order of each group's first tensor. Tensors that fit no weight are left out.
    pub fn targets(&self, has: &dyn Fn(&str) -> bool) -> Vec<Target> {
        let mut out: Vec<Target> = Vec::new();
        let mut index: BTreeMap<String, usize> = BTreeMap::new();
        for ts in self.files.tensors() {
            let Some((base, part)) = split_name(ts.name()) else { continue };
            let Some((weight, piece)) = resolve(base, has) else { continue };
            let i = *index.entry(weight.clone()).or_insert_with(|| {
                out.push(Target { weight, pieces: BTreeMap::new() });
                out.len() - 1
            });
            out[i].pieces.entry(piece).or_default().insert(part.to_string(), ts.name().to_string());
        }
        out
    }

    /// Reads tensor `name` as type `ty` into `dst` (exactly its size in that type).
    pub fn read(&self, name: &str, ty: crate::types::SdType, dst: &mut [u8]) -> Result<()> {
        let ts = self.files.get(name).ok_or_else(|| Error::new(format!("LoRA '{}': no tensor '{name}'", self.path)))?;
        self.files.read_tensor(ts, ty, dst).map_err(|e| Error::new(format!("LoRA '{}': {e}", self.path)))
    }

    /// A one-element tensor (`alpha`, `scale`) as f32.
    pub fn scalar(&self, name: &str) -> Result<f32> {
        let values = self.files.read_f32(name).map_err(|e| Error::new(format!("LoRA '{}': {e}", self.path)))?;
        match values[..] {
            [v] => Ok(v),
            _ => bail!("LoRA '{}': '{name}' has {} values, expected one", self.path, values.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_into_base_and_part() {
        assert_eq!(split_name("lora.a.b.weight.lora_up"), Some(("a.b.weight", "lora_up")));
        assert_eq!(split_name("lora.x.weight.1.alpha"), Some(("x.weight.1", "alpha")));
        assert_eq!(split_name("model.x.weight"), None);
        assert_eq!(split_name("lora.alpha"), None);
    }

    #[test]
    fn bases_resolve_to_weights_pieces_and_fused_parts() {
        let model = ["m.attn.qkv.weight", "te.layers.0.self_attn.in_proj.weight", "te.layers.0.self_attn.in_proj.bias", "w.weight"];
        let has = |n: &str| model.contains(&n);
        assert_eq!(resolve("w.weight", &has), Some(("w.weight".into(), 0)));
        assert_eq!(resolve("m.attn.qkv.weight.2", &has), Some(("m.attn.qkv.weight".into(), 2)));
        assert_eq!(resolve("te.layers.0.self_attn.k_proj.weight", &has), Some(("te.layers.0.self_attn.in_proj.weight".into(), 1)));
        assert_eq!(resolve("te.layers.0.self_attn.v_proj.bias", &has), Some(("te.layers.0.self_attn.in_proj.bias".into(), 2)));
        assert_eq!(resolve("te.layers.1.self_attn.q_proj.weight", &has), None);
        assert_eq!(resolve("nothing.weight", &has), None);
    }
}
