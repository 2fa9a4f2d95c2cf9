//! The dirty-log ioctls and the per-vCPU dirty ring: `slat-dirty`'s [`slat_dirty::log`],
//! re-exported under this crate's historical path. Its errors are [`slat_dirty::Error`],
//! which converts into [`crate::KvmError`] variant for variant.

pub use slat_dirty::log::*;
