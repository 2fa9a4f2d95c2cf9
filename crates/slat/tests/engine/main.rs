//! The engine's integration tests as one binary: each file under tests/engine/ is a module, so
//! the engine's generics are instantiated and linked once rather than once per file. The loom
//! models (tests/loom*.rs, built only with `--cfg loom`) stay binaries of their own.
#![cfg(not(loom))]

#[macro_use]
mod common;

mod aging;
mod direct_map;
mod dirty_log;
mod fault_paths;
mod layering;
mod memslot_errors;
mod model;
mod own_flush;
mod private_memory;
mod rmap;
mod sizes;
mod stress;
mod trust;
