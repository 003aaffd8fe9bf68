//! `convert`: read model files, optionally rename and re-type their tensors, and write
//! one GGUF or safetensors file.
//!
//! Tensors are streamed: each worker reads, converts and writes one tensor at a time at
//! its final offset, so memory stays at a few tensors. Output goes to a temporary file in
//! the destination folder that is renamed on success and removed on failure.

use super::source::{ModelFiles, ModelSource};
use super::storage::{TensorStorage, WriteEntry};
use super::type_rules::{self, TypeRules};
use super::{dtype, gguf, safetensors};
use crate::error::{Context, Error, Result};
use crate::types::SdType;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// One tensor of the output: its name, the type it is written as, its ggml shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    pub name: String,
    pub ty: SdType,
    pub shape: Vec<i64>,
}

/// Output format, chosen from the file name like the reference does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    Gguf,
    Safetensors,
}

impl OutputFormat {
    pub fn for_path(path: &Path) -> Self {
        if path.to_string_lossy().ends_with(".safetensors") {
            OutputFormat::Safetensors
        } else {
            OutputFormat::Gguf
        }
    }
}

/// Decides the output type of every tensor (`output_type` = the `wtype` override) and
/// checks each conversion can be done.
pub fn plan(tensors: &[TensorStorage], output_type: Option<SdType>, rules: &TypeRules, format: OutputFormat) -> Result<Vec<PlannedTensor>> {
    let mut out = Vec::with_capacity(tensors.len());
    for ts in tensors {
        let ty = type_rules::target_type(ts, output_type, rules).unwrap_or(ts.ty());
        dtype::check_conversion(ts.ty(), ty, ts.rows().0)
            .map_err(|e| Error::new(format!("tensor '{}' cannot be written as {}: {e}", ts.name(), ty.name())))?;
        if format == OutputFormat::Safetensors {
            ensure!(
                safetensors::type_to_dtype(ty).is_some(),
                "unsupported safetensors dtype '{}' for tensor '{}' (write a .gguf file for quantized types)",
                ty.name(),
                ts.name()
            );
        }
        out.push(PlannedTensor { name: ts.name().to_string(), ty, shape: ts.shape().to_vec() });
    }
    Ok(out)
}

/// Converts `inputs` into `output` (GGUF, or safetensors if the name ends with
/// `.safetensors`). `output_type` retypes the tensors the rules allow; `rules` is the
/// `tensor_type_rules` string; `convert_name` renames tensors to the internal naming.
pub fn convert(inputs: &[ModelSource], output: &Path, output_type: Option<SdType>, rules: &str, convert_name: bool, n_threads: usize) -> Result<()> {
    convert_with_importance(inputs, output, output_type, rules, convert_name, n_threads, None)
}

/// [`convert`], quantizing with an importance matrix when one is given.
pub fn convert_with_importance(
    inputs: &[ModelSource],
    output: &Path,
    output_type: Option<SdType>,
    rules: &str,
    convert_name: bool,
    n_threads: usize,
    importance: Option<super::source::Importance>,
) -> Result<()> {
    ensure!(!inputs.is_empty(), "no input model path provided for convert");
    let mut files = ModelFiles::new();
    files.set_importance(importance);
    for s in inputs {
        files
            .add_source(s)
            .map_err(|e| Error::new(format!("init model loader from file failed: '{}': {e}", s.path.display())))?;
    }
    if convert_name {
        files.convert_names(None);
    }
    write_model(&files, output, output_type, &TypeRules::parse(rules), n_threads)
}

/// Writes every tensor of `files` to `output`, typed per `output_type` and `rules`.
pub fn write_model(files: &ModelFiles, output: &Path, output_type: Option<SdType>, rules: &TypeRules, n_threads: usize) -> Result<()> {
    let format = OutputFormat::for_path(output);
    let planned = plan(files.tensors(), output_type, rules, format)?;
    ensure!(!planned.is_empty(), "no tensors to write to '{}'", output.display());
    let sizes: Vec<u64> = files
        .tensors()
        .iter()
        .zip(&planned)
        .map(|(ts, p)| ts.nbytes_as(p.ty).expect("checked by plan"))
        .collect();

    let entries: Vec<WriteEntry> = planned
        .iter()
        .zip(&sizes)
        .map(|(p, &nbytes)| WriteEntry { name: &p.name, ty: p.ty, shape: &p.shape, nbytes })
        .collect();
    let (head, offsets, total) = match format {
        OutputFormat::Gguf => gguf::write_header(&entries)?,
        OutputFormat::Safetensors => {
            let (head, offsets) = safetensors::write_header(&entries)?;
            let total = head.len() as u64 + sizes.iter().sum::<u64>();
            (head, offsets, total)
        }
    };

    let tmp = temp_path(output);
    sd_info!("trying to save tensors to {}", output.display());
    let result = (|| -> Result<()> {
        let file = File::create(&tmp).with_context(|| format!("failed to open output file '{}'", tmp.display()))?;
        file.set_len(total).with_context(|| format!("failed to size output file '{}'", tmp.display()))?;
        write_all_at(&file, &head, 0).with_context(|| format!("failed to write to '{}'", tmp.display()))?;
        stream_tensors(files, &planned, &offsets, &sizes, &file, n_threads, &tmp)?;
        file.sync_all().with_context(|| format!("failed to flush '{}'", tmp.display()))?;
        Ok(())
    })();
    match result {
        Ok(()) => std::fs::rename(&tmp, output).with_context(|| format!("failed to move the output to '{}'", output.display())),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn temp_path(output: &Path) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    output.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

fn stream_tensors(
    files: &ModelFiles,
    planned: &[PlannedTensor],
    offsets: &[u64],
    sizes: &[u64],
    out: &File,
    n_threads: usize,
    out_path: &Path,
) -> Result<()> {
    let n_threads = if n_threads > 0 { n_threads } else { std::thread::available_parallelism().map_or(1, |n| n.get()) };
    let n_threads = n_threads.clamp(1, planned.len().max(1));
    sd_info!("streaming convert with {} threads", n_threads);
    let started = std::time::Instant::now();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..n_threads {
            s.spawn(|| {
                let mut buf = Vec::new();
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= planned.len() {
                        break;
                    }
                    let ts = &files.tensors()[i];
                    buf.clear();
                    buf.resize(sizes[i] as usize, 0);
                    let r = files
                        .read_tensor(ts, planned[i].ty, &mut buf)
                        .and_then(|()| {
                            write_all_at(out, &buf, offsets[i])
                                .with_context(|| format!("failed to write tensor '{}' to '{}'", ts.name(), out_path.display()))
                        });
                    if let Err(e) = r {
                        failed.store(true, Ordering::Relaxed);
                        first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    sd_info!("streaming conversion completed, taking {:.2}s", started.elapsed().as_secs_f32());
    Ok(())
}

#[cfg(unix)]
fn write_all_at(f: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(f, buf, offset)
}

#[cfg(windows)]
fn write_all_at(f: &File, mut buf: &[u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match f.seek_write(buf, offset) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::safetensors::tests::file as st_file;

    fn tmpdir(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("sd-io-conv-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// f32 [64, 2] "w.weight", f32 [64] "w.bias", f32 [40] "odd.weight".
    fn input(dir: &Path) -> PathBuf {
        let vals: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) / 16.0).collect();
        let mut data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        data.extend(vals[..64].iter().flat_map(|v| v.to_le_bytes()));
        data.extend(vals[..40].iter().flat_map(|v| v.to_le_bytes()));
        let h = r#"{"w.weight":{"dtype":"F32","shape":[2,64],"data_offsets":[0,512]},
                    "w.bias":{"dtype":"F32","shape":[64],"data_offsets":[512,768]},
                    "odd.weight":{"dtype":"F32","shape":[40],"data_offsets":[768,928]}}"#;
        let p = dir.join("in.safetensors");
        std::fs::write(&p, st_file(h, &data)).unwrap();
        p
    }

    #[test]
    fn gguf_and_safetensors_outputs() {
        let dir = tmpdir("ok");
        let inp = input(&dir);
        let out = dir.join("out.gguf");
        convert(&[ModelSource::new(&inp, "")], &out, Some(SdType::Q8_0), "", false, 2).unwrap();
        let m = ModelFiles::open(&[ModelSource::new(&out, "")]).unwrap();
        let types: Vec<_> = m.tensors().iter().map(|t| (t.name(), t.ty())).collect();
        assert_eq!(types, [("odd.weight", SdType::F32), ("w.bias", SdType::F32), ("w.weight", SdType::Q8_0)]);
        let w = m.read_f32("w.weight").unwrap();
        assert!((w[5] - (5.0 - 64.0) / 16.0).abs() < 0.05);
        assert_eq!(m.read_f32("w.bias").unwrap()[63], (63.0 - 64.0) / 16.0);

        let out2 = dir.join("out.safetensors");
        convert(&[ModelSource::new(&inp, "x.")], &out2, Some(SdType::F16), "bias=f32", false, 1).unwrap();
        let m = ModelFiles::open(&[ModelSource::new(&out2, "")]).unwrap();
        assert_eq!(m.get("x.w.weight").unwrap().ty(), SdType::F16);
        assert_eq!(m.get("x.w.bias").unwrap().ty(), SdType::F32);
        assert_eq!(m.get("x.odd.weight").unwrap().ty(), SdType::F16);
        assert_eq!(m.read_f32("x.w.weight").unwrap()[0], -4.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn failures_leave_no_file() {
        let dir = tmpdir("fail");
        let inp = input(&dir);
        let out = dir.join("out.safetensors");
        let e = convert(&[ModelSource::new(&inp, "")], &out, Some(SdType::Q8_0), "", false, 1).unwrap_err();
        assert!(e.to_string().contains("unsupported safetensors dtype"), "{e}");
        assert!(convert(&[], &out, None, "", false, 1).is_err());
        assert!(convert(&[ModelSource::new(dir.join("missing.ckpt"), "")], &out, None, "", false, 1).is_err());
        // data that vanishes mid-way: the input is truncated after listing
        let m = ModelFiles::open(&[ModelSource::new(&inp, "")]).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&inp).unwrap();
        f.set_len(300).unwrap();
        drop(f);
        let out_g = dir.join("out.gguf");
        assert!(write_model(&m, &out_g, None, &TypeRules::default(), 2).is_err());
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("in.safetensors")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
