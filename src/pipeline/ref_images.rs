//! How reference images are used (`ref_image_args`), parsed once where a request enters the
//! pipeline: a preset (the family's default, or `preset=NAME`) with `key=value` overrides,
//! like the reference's `resolve_ref_image_params` and its `REF_IMAGE_PRESETS`.

use crate::models::common::rope::RefIndexMode;
use crate::runtime::args::{parse_key_value_args, parse_strict_bool, parse_strict_int};

/// How a reference image is resized for a vision-language encoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VlmResizeMode {
    None,
    LongestSide,
    Area,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefImageParams {
    /// Reference images go to the text encoder (vision-language models).
    pub pass_to_vlm: bool,
    /// Reference latents (or concatenated image channels) go to the diffusion model.
    pub pass_to_dit: bool,
    pub ref_index_mode: RefIndexMode,
    pub force_ref_timestep_zero: bool,
    /// Resize each reference to about the request's area (at most `vae_input_max_pixels`,
    /// default 1024²) before encoding it.
    pub resize_before_vae: bool,
    pub vae_input_max_pixels: i32,
    pub vlm_resize_mode: VlmResizeMode,
    pub vlm_min_size: i32,
    pub vlm_max_size: i32,
    /// Resize references to the request's size instead.
    pub resize_vae_to_target: bool,
}

impl Default for RefImageParams {
    fn default() -> Self {
        RefImageParams {
            pass_to_vlm: false,
            pass_to_dit: true,
            ref_index_mode: RefIndexMode::Fixed,
            force_ref_timestep_zero: false,
            resize_before_vae: true,
            vae_input_max_pixels: -1,
            vlm_resize_mode: VlmResizeMode::Area,
            vlm_min_size: -1,
            vlm_max_size: -1,
            resize_vae_to_target: false,
        }
    }
}

const fn preset(
    pass_to_vlm: bool,
    ref_index_mode: RefIndexMode,
    force_ref_timestep_zero: bool,
    resize_before_vae: bool,
    vae_input_max_pixels: i32,
    vlm_resize_mode: VlmResizeMode,
    vlm_sizes: (i32, i32),
    resize_vae_to_target: bool,
) -> RefImageParams {
    RefImageParams {
        pass_to_vlm,
        pass_to_dit: true,
        ref_index_mode,
        force_ref_timestep_zero,
        resize_before_vae,
        vae_input_max_pixels,
        vlm_resize_mode,
        vlm_min_size: vlm_sizes.0,
        vlm_max_size: vlm_sizes.1,
        resize_vae_to_target,
    }
}

use RefIndexMode::{Decrease, Fixed, Increase};
use VlmResizeMode::{Area, LongestSide};

/// The reference's presets, by name.
pub const PRESETS: &[(&str, RefImageParams)] = &[
    ("flux_kontext", preset(false, Fixed, false, true, -1, VlmResizeMode::None, (-1, -1), false)),
    ("longcat", preset(true, Fixed, false, true, -1, Area, (-1, -1), false)),
    ("flux2", preset(false, Increase, false, true, -1, VlmResizeMode::None, (-1, -1), false)),
    ("qwen", preset(true, Increase, false, true, -1, Area, (-1, -1), false)),
    ("qwen_layered", preset(true, Decrease, false, true, -1, Area, (-1, -1), false)),
    ("mage_flow", preset(true, Increase, false, true, -1, LongestSide, (-1, 384), true)),
    ("z_image_omni", preset(true, Fixed, false, true, -1, Area, (-1, -1), false)),
    ("krea2_ostris_edit", preset(true, Increase, true, true, -1, Area, (-1, -1), false)),
    ("krea2_edit", preset(true, Increase, false, true, -1, LongestSide, (768, 768), false)),
    ("cosmos_reference", preset(false, Increase, false, false, -1, VlmResizeMode::None, (-1, -1), false)),
];

fn find_preset(name: &str) -> Option<RefImageParams> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
}

impl RefImageParams {
    /// `args` applied over `default_preset` (the family's; `None`: the plain defaults).
    pub fn resolve(args: &str, default_preset: Option<&str>) -> RefImageParams {
        let pairs = parse_key_value_args(Some(args), "reference image args");
        let mut name = default_preset;
        if let Some((_, v)) = pairs.iter().find(|(k, _)| k == "preset") {
            if find_preset(v).is_some() {
                name = Some(v.as_str());
            } else if v != "default" {
                let valid: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
                sd_warn!("ignoring invalid reference image preset '{v}'. Valid options: [{}]", valid.join(", "));
            }
        }
        let mut p = RefImageParams::default();
        if let Some(preset) = name.and_then(|n| find_preset(n).map(|p| (n, p))) {
            sd_info!("Using '{}' preset for reference images", preset.0);
            p = preset.1;
        }
        let bool_arg = |target: &mut bool, k: &str, v: &str| match parse_strict_bool(v) {
            Some(b) => *target = b,
            None => sd_warn!("ignoring invalid reference image arg '{k}={v}'"),
        };
        let int_arg = |target: &mut i32, k: &str, v: &str| match parse_strict_int(v) {
            Some(n) => *target = n,
            None => sd_warn!("ignoring invalid reference image arg '{k}={v}'"),
        };
        for (k, v) in &pairs {
            match k.as_str() {
                "pass_to_vlm" => bool_arg(&mut p.pass_to_vlm, k, v),
                "pass_to_dit" => bool_arg(&mut p.pass_to_dit, k, v),
                "force_ref_timestep_zero" => bool_arg(&mut p.force_ref_timestep_zero, k, v),
                "resize_before_vae" => bool_arg(&mut p.resize_before_vae, k, v),
                "vae_input_max_pixels" => int_arg(&mut p.vae_input_max_pixels, k, v),
                "vlm_max_size" => int_arg(&mut p.vlm_max_size, k, v),
                "vlm_min_size" => int_arg(&mut p.vlm_min_size, k, v),
                "ref_index_mode" => match v.as_str() {
                    "fixed" => p.ref_index_mode = Fixed,
                    "increase" => p.ref_index_mode = Increase,
                    "decrease" => p.ref_index_mode = Decrease,
                    _ => sd_warn!("ignoring invalid reference image arg '{k}={v}'"),
                },
                "vlm_resize_mode" => match v.as_str() {
                    "longest_side" => p.vlm_resize_mode = LongestSide,
                    "area" => p.vlm_resize_mode = Area,
                    "none" => p.vlm_resize_mode = VlmResizeMode::None,
                    _ => sd_warn!("ignoring invalid reference image arg '{k}={v}'"),
                },
                "preset" | "vlm_size" => {}
                _ => sd_warn!("ignoring unknown reference image arg '{k}'"),
            }
        }
        if let Some((k, v)) = pairs.iter().find(|(k, _)| k == "vlm_size") {
            match parse_strict_int(v) {
                Some(n) => {
                    sd_info!("vlm_size override: setting both min and max size to {n}");
                    (p.vlm_min_size, p.vlm_max_size) = (n, n);
                }
                None => sd_warn!("ignoring invalid reference image arg '{k}={v}'"),
            }
        }
        // The reference warns for every other family (Krea2's presets are its own).
        if p.force_ref_timestep_zero && !default_preset.is_some_and(|n| n.starts_with("krea2")) {
            sd_warn!("force_ref_timestep_zero is only supported by Krea2 architecture for now");
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_overrides() {
        let d = RefImageParams::resolve("", None);
        assert_eq!(d, RefImageParams::default());
        let k = RefImageParams::resolve("", Some("flux_kontext"));
        assert_eq!((k.vlm_resize_mode, k.ref_index_mode, k.pass_to_dit), (VlmResizeMode::None, Fixed, true));
        let q = RefImageParams::resolve("preset=qwen, pass_to_dit=false", Some("flux_kontext"));
        assert!(q.pass_to_vlm && !q.pass_to_dit && q.ref_index_mode == Increase);
        // An unknown preset keeps the family's; "default" too.
        assert_eq!(RefImageParams::resolve("preset=nope", Some("flux_kontext")), k);
        assert_eq!(RefImageParams::resolve("preset=default", Some("flux_kontext")), k);
        let v = RefImageParams::resolve("vlm_size=512,ref_index_mode=decrease,pass_to_dit=maybe", None);
        assert_eq!((v.vlm_min_size, v.vlm_max_size, v.ref_index_mode, v.pass_to_dit), (512, 512, Decrease, true));
    }
}
