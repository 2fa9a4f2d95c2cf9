//! slat-vt's integration tests: real threads through the real hooks.
//!
//! No test here calls a hook from a thread that is not a simulated CPU: foreign calls are
//! counted process-wide and would fail the other tests' `finish` (the one test of them is a
//! unit test of the library).

mod coherence;
mod common;
mod credit;
mod deadlock;
mod determinism;
mod flush;
mod profiles;
mod queueing;
mod spin;
mod stress;
mod waits;
mod walk_load;
