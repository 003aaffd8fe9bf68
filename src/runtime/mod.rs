//! runtime
pub mod imatrix;
pub mod preprocess;
