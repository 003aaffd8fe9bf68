//! Blocks shared by several networks.
pub mod blocks;
