//! slat-dirty's integration tests as one binary (one link instead of one per file). The
//! harvests racing a running guest (tests/kvm_concurrent.rs) stay a binary of their own: they
//! assert that the guest wrote while the harvester ran, which a CPU-heavy neighbour from
//! another file could starve.

#[path = "../common/mod.rs"]
mod common;

mod generic_source;
mod kvm_dirty_rate;
mod kvm_harvest;
mod kvm_snapshot;
mod ranges;
mod rules;
mod sizes;
mod snapshot;
mod sparse_source;
