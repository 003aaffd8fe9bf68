//! Blocks shared by several networks.
pub mod blocks;
pub mod dit;
pub mod rope;
