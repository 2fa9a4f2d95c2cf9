//! slat-kvm's integration tests as one binary (one link instead of one per file).

mod common;

mod dirty_bounds;
mod dirty_log;
mod errors;
mod latency;
mod memstress;
mod oracle;
