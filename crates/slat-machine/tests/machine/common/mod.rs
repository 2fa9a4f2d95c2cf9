//! Shared by the integration tests (`#[macro_use] mod common;`): [`both_formats!`] runs each
//! test on every page-table format. (Test crates cannot share modules, so the
//! macro's one definition is included from `crates/slat/tests/engine/common/formats.rs`.)
#![allow(unused_macros)]

include!("../../../../slat/tests/engine/common/formats.rs");
