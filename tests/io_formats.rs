//! Every reader on small real-world-shaped files: the fuzz seeds (fuzz/corpus), made by
//! fuzz/make_seeds.py the way torch.save, safetensors and ggml write them.

use stable_diffusion::io::{FileFormat, ModelFiles, ModelSource, SdVersion};
use stable_diffusion::types::SdType;
use std::path::PathBuf;

fn seed(target: &str, name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus")).join(target).join(name)
}

fn open(p: PathBuf) -> ModelFiles {
    ModelFiles::open(&[ModelSource::new(&p, "")]).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn read_i32(m: &ModelFiles, name: &str) -> Vec<i32> {
    let ts = m.get(name).unwrap();
    let mut b = vec![0u8; ts.nbytes() as usize];
    m.read_tensor(ts, SdType::I32, &mut b).unwrap();
    b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn torch_checkpoints() {
    for (target, file, fmt) in [
        ("torch_zip", "stored_p2.ckpt", FileFormat::TorchZip),
        ("torch_zip", "stored_p4.ckpt", FileFormat::TorchZip),
        ("torch_zip", "deflated.ckpt", FileFormat::TorchZip),
        ("torch_legacy", "legacy.pt", FileFormat::TorchLegacy),
    ] {
        for mmap in [false, true] {
            let mut m = open(seed(target, file));
            m.set_mmap(mmap);
            assert_eq!(m.files()[0].1, fmt);
            assert_eq!(m.len(), 6, "{file}");
            let w = m.get("model.diffusion_model.w").unwrap();
            assert_eq!((w.ty(), w.shape()), (SdType::F16, &[3i64, 2][..]));
            assert_eq!(m.read_f32("model.diffusion_model.w").unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
            assert_eq!(m.read_f32("model.diffusion_model.b").unwrap(), [1.0, 1.5, 2.0, 2.5], "{file}");
            assert_eq!(m.read_f32("model.diffusion_model.view").unwrap()[7], 3.5);
            assert_eq!(read_i32(&m, "position_ids"), [7, 8, 9]);
            assert_eq!(m.get("first_stage_model.bf").unwrap().ty(), SdType::Bf16);
            assert_eq!(m.read_f32("first_stage_model.bf").unwrap(), [1.0, -2.0]);
            assert_eq!(m.read_f32("alphas_cumprod").unwrap(), [0.25]);
        }
    }
}

#[test]
fn safetensors_dtypes() {
    let m = open(seed("safetensors", "dtypes.safetensors"));
    assert_eq!(m.len(), 8, "U8 blobs are not tensors");
    assert_eq!(m.read_f32("x.f64").unwrap(), [1.5, -1.0]);
    assert_eq!(read_i32(&m, "x.i64"), [3]);
    assert_eq!(m.read_f32("x.f8").unwrap(), [1.0, 2.0, -1.0, 1.0 / 512.0]);
    assert_eq!(m.read_f32("x.f8b").unwrap(), [1.0, -1.0]);
    assert_eq!(m.read_f32("x.bf16").unwrap(), [1.0, -2.0]);
    assert_eq!(m.get("x.i8").unwrap().ty(), SdType::I8);
    assert_eq!(m.read_f32("model.diffusion_model.w").unwrap()[7], 3.5);
    assert_eq!(m.metadata()["format"], "pt");
}

#[test]
fn gguf_types() {
    for mmap in [false, true] {
        let mut m = open(seed("gguf", "types.gguf"));
        m.set_mmap(mmap);
        let q = m.get("model.diffusion_model.q").unwrap();
        assert_eq!((q.ty(), q.shape()), (SdType::Q8_0, &[32i64, 2][..]));
        let v = m.read_f32("model.diffusion_model.q").unwrap();
        assert_eq!((v[0], v[3], v[32 + 31]), (0.0, 1.5, 15.5));
        let mut same = vec![0u8; 68];
        m.read_tensor(q, SdType::Q8_0, &mut same).unwrap();
        assert_eq!(m.get("first_stage_model.f").unwrap().shape(), &[2, 2]);
        assert_eq!(m.read_f32("first_stage_model.f").unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m.read_f32("model.diffusion_model.h").unwrap()[2], 1.0);
    }
    assert_eq!(open(seed("gguf", "v2.gguf")).read_f32("w").unwrap(), [1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn names_and_versions_through_model_files() {
    let mut m = open(seed("torch_zip", "stored_p2.ckpt"));
    assert_eq!(m.detect_version(), None);
    m.convert_names(Some(SdVersion::Sd1));
    assert!(m.get("model.diffusion_model.w").is_some());
    let mut m = ModelFiles::open(&[ModelSource::new(seed("safetensors", "one.safetensors"), "vae.")]).unwrap();
    m.convert_names(Some(SdVersion::Sd1));
    assert!(m.get("first_stage_model.w").is_some());
}
