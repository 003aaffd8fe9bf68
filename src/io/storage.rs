//! Where one tensor's bytes live in a model file, without the bytes.

use super::dtype::{self, SourceDtype};
use crate::error::Result;
use crate::types::SdType;

/// ggml tensors have at most four dimensions; readers fold extra outer dimensions.
pub const MAX_DIMS: usize = 4;

/// One tensor of a model file: name, ggml type and shape, and the location of its data.
///
/// Constructed only through [`TensorStorage::new`], which checks that the shape and sizes
/// are representable, so the size accessors never overflow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorStorage {
    name: String,
    ty: SdType,
    ne: [i64; MAX_DIMS],
    n_dims: usize,
    nbytes: u64,
    source: SourceDtype,
    pub(crate) file_index: usize,
    /// Absolute byte offset of the data in the file or, for a compressed zip entry, the
    /// offset inside the entry's uncompressed data.
    pub(crate) offset: u64,
    /// Set when the data sits in a compressed zip entry (index of the entry).
    pub(crate) zip_entry: Option<usize>,
    /// A ComfyUI `int8_tensorwise` weight: its ConvRot group size (0: no rotation).
    int8_group: Option<u32>,
}

impl TensorStorage {
    /// A storage of type `ty` (what reading yields) with shape `ne` in ggml order
    /// (`ne[0]` varies fastest). `source` says how the file's bytes differ from `ty`.
    /// More than four dimensions are folded into the outermost one.
    pub fn new(name: impl Into<String>, ty: SdType, ne: &[i64], source: SourceDtype) -> Result<Self> {
        let name = name.into();
        let mut dims = [1i64; MAX_DIMS];
        let n_dims = ne.len().clamp(1, MAX_DIMS);
        for (i, &d) in ne.iter().enumerate() {
            ensure!(d >= 0, "tensor '{}' has a negative dimension ({})", name, d);
            if i < MAX_DIMS {
                dims[i] = d;
            } else {
                dims[MAX_DIMS - 1] = dims[MAX_DIMS - 1]
                    .checked_mul(d)
                    .ok_or_else(|| crate::error::Error::new(format!("tensor '{name}' is too large")))?;
            }
        }
        let nbytes = dtype::nbytes(ty, &dims).ok_or_else(|| {
            crate::error::Error::new(format!(
                "tensor '{}' has an invalid shape {:?} for type {}",
                name,
                ne,
                ty.name()
            ))
        })?;
        ensure!(
            nbytes <= i64::MAX as u64 && source.file_bytes(nbytes).is_some_and(|b| b <= i64::MAX as u64),
            "tensor '{}' is too large ({:?})",
            name,
            ne
        );
        if matches!(source, SourceDtype::F8E4M3 | SourceDtype::F8E5M2) {
            ensure!(ty == SdType::F16, "internal: float8 data must be read as f16");
        }
        Ok(TensorStorage { name, ty, ne: dims, n_dims, nbytes, source, file_index: 0, offset: 0, zip_entry: None, int8_group: None })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn set_name(&mut self, name: String) {
        self.name = name;
    }

    /// The ggml type the data has once read.
    pub fn ty(&self) -> SdType {
        self.ty
    }

    /// How the file's bytes relate to [`ty`](Self::ty).
    pub fn source(&self) -> SourceDtype {
        self.source
    }

    /// Shape in ggml order, `n_dims` entries.
    pub fn shape(&self) -> &[i64] {
        &self.ne[..self.n_dims]
    }

    /// All four ggml dimensions (unused ones are 1).
    pub fn ne(&self) -> [i64; MAX_DIMS] {
        self.ne
    }

    pub fn n_dims(&self) -> usize {
        self.n_dims
    }

    /// For a ComfyUI `int8_tensorwise` weight (I8 rows, one scale per row in
    /// `<module>.weight_scale`), the group size of its ConvRot rotation, 0 without one.
    pub fn int8_group(&self) -> Option<u32> {
        self.int8_group
    }

    pub(crate) fn set_int8_group(&mut self, group: u32) {
        self.int8_group = Some(group);
    }

    /// The same elements seen as a 1-D tensor (ComfyUI's `[out, 1]` row scales).
    pub(crate) fn flatten(&mut self) {
        self.ne = [self.nelements() as i64, 1, 1, 1];
        self.n_dims = 1;
    }

    /// Number of dimensions without trailing ones (at least 1), like `ggml_n_dims`.
    pub fn ggml_n_dims(&self) -> usize {
        let mut n = MAX_DIMS;
        while n > 1 && self.ne[n - 1] == 1 {
            n -= 1;
        }
        n
    }

    pub fn nelements(&self) -> u64 {
        self.ne.iter().product::<i64>() as u64
    }

    /// Bytes of the data in the storage type.
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Bytes of the data as stored in the file.
    pub fn file_nbytes(&self) -> u64 {
        self.source.file_bytes(self.nbytes).unwrap_or(u64::MAX)
    }

    /// Bytes the data takes as type `ty`, or `None` if its rows cannot be stored as `ty`.
    pub fn nbytes_as(&self, ty: SdType) -> Option<u64> {
        dtype::nbytes(ty, &self.ne)
    }

    /// Length of a row (`ne[0]`) and number of rows.
    pub fn rows(&self) -> (u64, u64) {
        let row = self.ne[0] as u64;
        let n = self.nelements();
        (row, if row == 0 { 0 } else { n / row })
    }

    /// Index of the file (in its [`ModelFiles`](super::ModelFiles)) holding the data.
    pub fn file_index(&self) -> usize {
        self.file_index
    }

    /// Offset of the data: absolute in the file, or inside a compressed zip entry.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The compressed zip entry holding the data, if any (then `offset` is inside it).
    pub fn zip_entry(&self) -> Option<usize> {
        self.zip_entry
    }

    /// The reference's one-line description: `name | type | n_dims [ne0, ne1, ...]`.
    pub fn describe(&self) -> String {
        let ty = self.source.name().unwrap_or(self.ty.name());
        let dims: Vec<String> = self.ne.iter().map(|d| d.to_string()).collect();
        format!("{} | {} | {} [{}]", self.name, ty, self.n_dims, dims.join(", "))
    }
}

/// One tensor to be written by a file writer: name, type, ggml shape and its byte size.
pub struct WriteEntry<'a> {
    pub name: &'a str,
    pub ty: SdType,
    pub shape: &'a [i64],
    pub nbytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_sizes() {
        let t = TensorStorage::new("w", SdType::F16, &[320, 4, 3, 3], SourceDtype::Native).unwrap();
        assert_eq!(t.nbytes(), 320 * 4 * 9 * 2);
        assert_eq!(t.rows(), (320, 36));
        assert_eq!(t.ggml_n_dims(), 4);
        let t = TensorStorage::new("w", SdType::F32, &[2, 3, 4, 5, 6], SourceDtype::F64).unwrap();
        assert_eq!(t.shape(), &[2, 3, 4, 30]);
        assert_eq!(t.file_nbytes(), t.nbytes() * 2);
        let t = TensorStorage::new("s", SdType::F32, &[], SourceDtype::Native).unwrap();
        assert_eq!((t.shape(), t.nbytes()), (&[1i64][..], 4));
        let t = TensorStorage::new("b", SdType::F16, &[8, 1, 1], SourceDtype::F8E4M3).unwrap();
        assert_eq!((t.ggml_n_dims(), t.file_nbytes()), (1, 8));
        assert!(t.describe().starts_with("b | f8_e4m3 | 3 [8, 1, 1, 1]"));
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(TensorStorage::new("n", SdType::F32, &[-1], SourceDtype::Native).is_err());
        assert!(TensorStorage::new("o", SdType::F32, &[1 << 40, 1 << 40], SourceDtype::Native).is_err());
        assert!(TensorStorage::new("o", SdType::F32, &[1 << 61], SourceDtype::Native).is_err());
        assert!(TensorStorage::new("o", SdType::F32, &[1 << 20, 1 << 20, 1 << 20, 1, 1 << 20], SourceDtype::Native).is_err());
        assert!(TensorStorage::new("q", SdType::Q4K, &[100], SourceDtype::Native).is_err());
        assert!(TensorStorage::new("f", SdType::F32, &[1 << 60], SourceDtype::F64).is_err());
    }
}
