//! Guest RAM and the selftests' size syntax: `slat-workload`'s, shared with the KVM machine,
//! re-exported where this crate's users have always found them.

pub use slat_workload::backing::Backing;
pub use slat_workload::guest_ram::{GuestRam, RamError};
pub use slat_workload::size::{format_size, parse_size, SizeError};
