//! Memslot handles that know their page count: `slat-dirty`'s [`slat_dirty::memslot`],
//! re-exported under this crate's historical path.

pub use slat_dirty::memslot::*;
