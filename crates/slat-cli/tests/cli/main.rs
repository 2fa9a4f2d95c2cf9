//! The `slat` command's tests as one binary (one link instead of one per file). They run the
//! binary cargo built (`CARGO_BIN_EXE_slat`) in child processes; the `--help` snapshots stay
//! in tests/help/.

mod common;

mod backend_kvm;
mod bad_input;
mod calibrate;
mod dirty_rate;
mod docs;
mod format;
mod help;
mod migrate;
mod page_table_test;
mod parity;
mod phantom;
mod private_mem;
mod private_mem_test;
mod reports;
mod reproduce;
mod snapshot;
mod snapshot_virtual;
mod virtual_time;
