//! slat-migrate's integration tests as one binary (one link instead of one per file).

mod example_vmm;
mod spawn_failure;
mod vmm;
