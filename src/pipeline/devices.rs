//! Which device each model part computes on, from the context's `backend` and
//! `params_backend` specs. (Moving to `graph` with the device layer.)

use crate::error::{Context as _, Result};
use crate::graph::Backend;
use crate::params::CtxParams;
use std::collections::HashMap;
use std::sync::Arc;

/// Which device each part computes on: `DEVICE` for all, or `module=DEVICE` entries
/// (modules `te`, `diffusion`, `vae` and the reference's aliases), comma-separated.
#[derive(Debug, Default, Clone, PartialEq)]
struct DeviceSpec {
    default: Option<String>,
    modules: HashMap<&'static str, String>,
}

impl DeviceSpec {
    fn parse(spec: Option<&str>) -> Result<DeviceSpec> {
        let mut out = DeviceSpec::default();
        for part in spec.unwrap_or("").split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                out.default = Some(part.to_string());
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            ensure!(!key.is_empty() && !value.is_empty(), "invalid backend assignment '{part}'");
            let k: String = key.to_ascii_lowercase().chars().filter(|c| *c != '-' && *c != '_').collect();
            let module = match k.as_str() {
                "all" | "default" | "*" => {
                    out.default = Some(value.to_string());
                    continue;
                }
                "diffusion" | "model" | "unet" | "dit" => "diffusion",
                "te" | "clip" | "text" | "textencoder" | "textencoders" | "conditioner" | "cond" | "llm" | "t5" | "t5xxl" => "te",
                "vae" | "firststage" | "autoencoder" | "tae" => "vae",
                "clipvision" | "vision" | "controlnet" | "control" | "photomaker" | "photomakerid" | "pmid" | "photo" | "upscaler"
                | "esrgan" | "hires" | "detector" | "adetailer" | "yolo" => continue,
                _ => bail!("unknown backend module '{key}'"),
            };
            out.modules.insert(module, value.to_string());
        }
        Ok(out)
    }

    fn device(&self, module: &str) -> Option<&str> {
        self.modules.get(module).or(self.default.as_ref()).map(String::as_str).filter(|d| {
            let d = d.to_ascii_lowercase();
            !(d == "default" || d == "auto" || d == "disk")
        })
    }
}

/// Backends by device name, initialised once per context.
#[derive(Default)]
struct Backends(HashMap<String, Arc<Backend>>);

impl Backends {
    fn get(&mut self, device: Option<&str>) -> Result<Arc<Backend>> {
        let key = device.unwrap_or("CPU").to_ascii_lowercase();
        if let Some(b) = self.0.get(&key) {
            return Ok(b.clone());
        }
        let b = Arc::new(match device {
            None => Backend::cpu()?,
            Some(name) => {
                let found = crate::graph::backend::devices().into_iter().find(|d| d.name.eq_ignore_ascii_case(name));
                Backend::by_name(found.map_or(name.to_string(), |d| d.name).as_str())?
            }
        });
        self.0.insert(key, b.clone());
        Ok(b)
    }
}

/// The backends of one context: one per device, shared by the modules placed on it.
pub struct Devices {
    runtime: DeviceSpec,
    weights_on: DeviceSpec,
    backends: Backends,
}

impl Devices {
    pub fn new(params: &CtxParams) -> Result<Devices> {
        Ok(Devices {
            runtime: DeviceSpec::parse(params.backend.as_deref()).context("backend")?,
            weights_on: DeviceSpec::parse(params.params_backend.as_deref()).context("params_backend")?,
            backends: Backends::default(),
        })
    }

    /// The backend `module` (`te`, `diffusion`, `vae`) computes on.
    pub fn backend_for(&mut self, module: &str) -> Result<Arc<Backend>> {
        let run = self.runtime.device(module);
        if let Some(p) = self.weights_on.device(module) {
            if !p.eq_ignore_ascii_case(run.unwrap_or("CPU")) {
                sd_warn!("{module}: keeping weights on the compute device (params backend '{p}' is not supported separately)");
            }
        }
        self.backends.get(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs() {
        let s = DeviceSpec::parse(Some("CUDA0, vae = CPU,text-encoder=Vulkan0")).unwrap();
        assert_eq!(s.device("diffusion"), Some("CUDA0"));
        assert_eq!(s.device("vae"), Some("CPU"));
        assert_eq!(s.device("te"), Some("Vulkan0"));
        assert_eq!(DeviceSpec::parse(None).unwrap().device("vae"), None);
        assert_eq!(DeviceSpec::parse(Some("auto")).unwrap().device("vae"), None);
        assert!(DeviceSpec::parse(Some("bogus=CPU")).is_err());
        assert!(DeviceSpec::parse(Some("vae=")).is_err());
    }
}
