//! Which ggml type each weight gets: the `wtype` override and `tensor_type_rules`
//! (`regex=type,...`), with the reference's fixed exceptions.

use super::dtype;
use super::storage::TensorStorage;
use crate::types::SdType;
use regex::Regex;

/// A weight type named like ggml names it ("f32", "q8_0", "q4_K", ...): any type ggml can
/// dequantize that we can also produce.
pub fn parse_type_name(name: &str) -> Option<SdType> {
    if name == "f32" {
        return Some(SdType::F32);
    }
    SdType::ALL
        .iter()
        .copied()
        .find(|&t| t.name() == name && dtype::can_dequantize(t) && dtype::can_quantize_to(t))
}

/// Parsed `tensor_type_rules`: the first rule whose pattern matches somewhere in a
/// tensor's name gives its type.
#[derive(Debug, Default, Clone)]
pub struct TypeRules {
    rules: Vec<(Regex, SdType)>,
}

impl TypeRules {
    /// Parses `pattern=type,pattern=type,...`; invalid items are logged and ignored.
    pub fn parse(spec: &str) -> Self {
        let mut rules = Vec::new();
        for item in spec.split(',').filter(|i| !i.is_empty()) {
            let Some((pattern, type_name)) = item.split_once('=') else {
                sd_warn!("ignoring invalid quant override \"{}\"", item);
                continue;
            };
            let Some(ty) = parse_type_name(type_name) else {
                sd_warn!("ignoring invalid quant override \"{}\"", item);
                continue;
            };
            match Regex::new(pattern) {
                Ok(re) => rules.push((re, ty)),
                Err(e) => sd_warn!("ignoring invalid quant override \"{}\": {}", item, e),
            }
        }
        TypeRules { rules }
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The type of the first rule matching `name`.
    pub fn rule_for(&self, name: &str) -> Option<SdType> {
        self.rules.iter().find(|(re, _)| re.is_match(name)).map(|(_, t)| *t)
    }
}

/// Whether a tensor may be stored as `ty` when a weight type is requested: biases,
/// scales, embeddings and the input/output layers of the known architectures keep their
/// type, and so do rows that are not whole blocks of a quantized type.
pub fn should_convert(ts: &TensorStorage, ty: SdType) -> bool {
    let name = ts.name();
    if let Some(l) = dtype::layout(ty) {
        if l.blck > 1 && ts.ne()[0] as u64 % l.blck != 0 {
            return false;
        }
    }
    const KEEP_SUFFIXES: &[&str] = &[".bias", ".scale", ".weight_scale"];
    const KEEP_PARTS: &[&str] = &[
        // Flux
        "img_in.",
        "txt_in.",
        "time_in.",
        "vector_in.",
        "guidance_in.",
        "final_layer.",
        // MMDiT
        "x_embedder.",
        "t_embedder.",
        "y_embedder.",
        "pos_embed",
        "context_embedder.",
        // UNet
        "time_embed.",
        "label_emb.",
        "embedding",
    ];
    !(KEEP_SUFFIXES.iter().any(|s| name.ends_with(s)) || KEEP_PARTS.iter().any(|p| name.contains(p)))
}

/// The type `ts` should be loaded or written as under a `wtype` override and rules, or
/// `None` to keep its own type. Integer tensors keep theirs (the reference fails on them).
pub fn target_type(ts: &TensorStorage, wtype: Option<SdType>, rules: &TypeRules) -> Option<SdType> {
    let ty = rules.rule_for(ts.name()).or(wtype)?;
    (should_convert(ts, ty) && (ty == ts.ty() || dtype::can_dequantize(ts.ty()))).then_some(ty)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::dtype::SourceDtype;

    fn ts(name: &str, ne: &[i64]) -> TensorStorage {
        TensorStorage::new(name, SdType::F16, ne, SourceDtype::Native).unwrap()
    }

    #[test]
    fn type_names() {
        assert_eq!(parse_type_name("q4_K"), Some(SdType::Q4K));
        assert_eq!(parse_type_name("f32"), Some(SdType::F32));
        assert_eq!(parse_type_name("bf16"), Some(SdType::Bf16));
        assert_eq!(parse_type_name("Q8_0"), None);
        assert_eq!(parse_type_name("i32"), None);
        assert_eq!(parse_type_name("q8_K"), None);
        assert_eq!(parse_type_name("q8_1"), None);
    }

    #[test]
    fn rules_and_exceptions() {
        let r = TypeRules::parse("attn.*weight=q8_0,,bad,mlp=nope,[=q4_0,^model\\.=q4_K");
        assert_eq!(r.rules.len(), 2);
        let w = ts("model.diffusion_model.x.attn1.to_k.weight", &[320, 320]);
        assert_eq!(target_type(&w, Some(SdType::F16), &r), Some(SdType::Q8_0));
        let m = ts("model.diffusion_model.x.ff.weight", &[256, 3]);
        assert_eq!(target_type(&m, None, &r), Some(SdType::Q4K));
        assert_eq!(target_type(&ts("first_stage_model.w", &[64]), Some(SdType::Q8_0), &TypeRules::default()), Some(SdType::Q8_0));
        assert_eq!(target_type(&ts("cond.w", &[64]), None, &TypeRules::default()), None);
        for keep in ["a.bias", "x.time_embed.0.weight", "x.token_embedding.weight", "m.img_in.weight", "m.pos_embed", "x.scale"] {
            assert!(!should_convert(&ts(keep, &[64]), SdType::Q8_0), "{keep}");
        }
        assert!(!should_convert(&ts("w", &[40]), SdType::Q8_0));
        assert!(should_convert(&ts("w", &[40]), SdType::F16));
        assert!(should_convert(&ts("x.norm.weight", &[64]), SdType::Q8_0));
        let ids = TensorStorage::new("ids", SdType::I32, &[64], SourceDtype::Native).unwrap();
        assert_eq!(target_type(&ids, Some(SdType::Q8_0), &TypeRules::default()), None);
    }
}
