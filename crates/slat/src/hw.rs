//! What a hardware walker and TLB need from the engine — the simulated machine
//! (`slat-machine`'s `cpu.rs` and `tlb.rs`), an emulator — and nothing else:
//!
//! - **the root** of a VM's table ([`root_addr`]) and **table entries** ([`TablePage`], read
//!   with acquire loads at [`table_index`]); the entry encoding and the hardware view of it
//!   (`hw_is_table`, `permits`, `set_accessed_dirty`) are the VM's [`PteFormat`];
//! - **A/D updates**: hardware sets Accessed/Dirty with a compare-and-swap of the entry it
//!   walked (as EPT and FEAT_HAFDBS do); the engine's own changes go through its one SPTE
//!   update path, whose compare-and-swaps fail and retry against such an update. A D 0→1 is
//!   reported with [`crate::Vcpu::log_hardware_dirty`] in guest mode;
//! - **guest mode**: a [`GuestMode`](crate::GuestMode) token from [`crate::Vcpu::enter_guest`] while the
//!   walker may hold translations, and [`REQ_TLB_FLUSH`] serviced between accesses with
//!   [`crate::Vcpu::service_requests`];
//! - **leak accounting** for tests of the walker: [`table_alloc`].
//!
//! A table page reached through present entries stays allocated until a remote flush that
//! this vCPU acknowledged (invariant 2): a walker in guest mode may dereference it until its
//! next access boundary, and a paging-structure cache must be emptied when it services a
//! flush.

use crate::format::PteFormat;
pub use crate::format::{
    bytes_per_entry, pages_per_entry, table_index, ENTRIES_PER_TABLE, LEVEL_BITS, MAX_LEVELS,
};
pub use crate::mmu::flush::REQ_TLB_FLUSH;
pub use crate::mmu::table::{TableAlloc, TablePage};
use crate::sync::Arc;
use crate::vm::Vm;
use slat_addr::Hva;

/// Host address of the VM's root table page: where a hardware walk starts. It lives as long
/// as the VM.
pub fn root_addr<F: PteFormat>(vm: &Vm<F>) -> Hva {
    vm.mmu.root_addr()
}

/// The VM's table-page allocator, to check for leaked table pages (live pages settle to the
/// ones linked in the tree once epoch reclamation has run).
pub fn table_alloc<F: PteFormat>(vm: &Vm<F>) -> &Arc<TableAlloc> {
    &vm.mmu.alloc
}
