//! What a pass (or a workload run until halted) reports, per vCPU and in all.

use crate::latency::{merged, LatencyHistogram};
use std::time::Duration;

/// One vCPU's part of a pass (or of a workload run until halted). `C` holds the counters only
/// one machine has (the simulated hardware's walks and faults, KVM's entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VcpuPass<C = ()> {
    /// The vCPU's own time, from its start of the pass to its sync.
    pub time: Duration,
    /// Pages touched (writes, for the dirty-log writer).
    pub pages: u64,
    /// Full passes completed (a loop may stop in the middle of one).
    pub passes: u64,
    /// Dirty-ring-full exits taken.
    pub ring_full_exits: u64,
    /// The machine's own counters.
    pub counters: C,
}

/// A completed pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PassReport<C = ()> {
    /// From releasing the vCPUs to the last one's sync.
    pub wall: Duration,
    /// Per vCPU.
    pub vcpus: Vec<VcpuPass<C>>,
    /// Per vCPU, its write latencies when the pass was timed ([`crate::PassParams::timed`]);
    /// empty otherwise. What a machine counts as a write's latency: [`crate::WriteLatency`].
    pub latency: Vec<LatencyHistogram>,
}

impl<C> VcpuPass<C> {
    /// The same pass without the machine's own counters.
    pub fn without_counters(&self) -> VcpuPass {
        VcpuPass {
            time: self.time,
            pages: self.pages,
            passes: self.passes,
            ring_full_exits: self.ring_full_exits,
            counters: (),
        }
    }
}

impl<C> PassReport<C> {
    /// The same report without the machine's own counters, for code that drives either
    /// machine.
    pub fn without_counters(&self) -> PassReport {
        PassReport {
            wall: self.wall,
            vcpus: self.vcpus.iter().map(VcpuPass::without_counters).collect(),
            latency: self.latency.clone(),
        }
    }

    /// Pages touched by every vCPU.
    pub fn pages(&self) -> u64 {
        self.vcpus.iter().map(|v| v.pages).sum()
    }

    /// Every vCPU's write latencies in one histogram (empty when the pass was not timed).
    pub fn merged_latency(&self) -> LatencyHistogram {
        merged(&self.latency)
    }

    /// Dirty-ring-full exits taken by every vCPU.
    pub fn ring_full_exits(&self) -> u64 {
        self.vcpus.iter().map(|v| v.ring_full_exits).sum()
    }
}
