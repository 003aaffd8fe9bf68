//! Model files in and out.
//!
//! A model is opened as a [`ModelFiles`]: one or more files (safetensors, sharded
//! safetensors, GGUF, PyTorch zip or legacy checkpoints, diffusers folders), each with an
//! optional name prefix, listed as [`TensorStorage`]s (name, ggml type, shape, where the
//! bytes are) without reading data. A tensor is read on demand into the caller's buffer,
//! converted to the ggml type the caller asks for. [`names`] maps every naming scheme to
//! the internal one, [`version`] tells the model family from names and shapes,
//! [`type_rules`] decides weight types and [`convert`] writes GGUF/safetensors files.
//!
//! Every reader treats its input as hostile: sizes are checked before allocating, data
//! must lie inside the file, and malformed input is an error naming the file and the
//! problem, never a panic or an abort.

pub mod convert;
pub mod dtype;
#[doc(hidden)]
pub mod fuzzing;
pub mod gguf;
pub mod lora;
pub mod names;
pub mod pickle;
pub mod safetensors;
pub mod source;
pub mod storage;
pub mod torch;
pub mod type_rules;
pub mod version;

pub use convert::{convert, OutputFormat, PlannedTensor};
pub use dtype::SourceDtype;
pub use names::convert_tensor_name;
pub use source::{is_unused_tensor, Component, FileFormat, ModelFiles, ModelPart, ModelSource};
pub use storage::TensorStorage;
pub use type_rules::TypeRules;
pub use version::SdVersion;
