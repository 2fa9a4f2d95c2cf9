//! The reports of `slat migrate`, `migrate-perf` ([`Migration`], the source's view) and
//! `migrate-listen` ([`Dest`]): slat-migrate's own reports, with what the CLI adds. The
//! library does not depend on serde, so their JSON is written here, by hand, one field a line
//! and in the order the documents always had (durations as `*_s` seconds).

use crate::migrate::{Before, CompressArg, ConvergeArg, GuestArgs, MigrationArgs};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use slat_migrate::postcopy::{PostcopyDestReport, PostcopyReport};
use slat_migrate::{DestReport, DirtyLimitReport, MigrationReport, RoundReport};
use std::time::Duration;

/// One migration, as the source saw it.
#[derive(Debug, Clone)]
pub struct Migration {
    /// `migrate` or `migrate-perf`.
    pub benchmark: &'static str,
    pub guest: GuestArgs,
    pub migration: MigrationArgs,
    /// Why earlier attempts failed.
    pub failed_attempts: Vec<String>,
    pub r: MigrationReport,
    /// The guest's write rates during the warm-up.
    pub before: Before,
    /// The destination's own report (migrate-perf, both ends in this process).
    pub destination: Option<Dest>,
}

/// The destination's report.
#[derive(Debug, Clone)]
pub struct Dest(pub DestReport);

impl Migration {
    /// Per vCPU, guest writes per second during pre-copy (empty where not counted).
    pub fn vcpu_during(&self) -> Vec<f64> {
        let r = &self.r;
        (r.vcpu_writes.iter())
            .map(|&w| per_s(w as f64, r.precopy))
            .collect()
    }

    /// The share of the guest's writes per second the migration cost (before vs during
    /// pre-copy), percent; `None` without a rate before.
    pub fn throughput_lost(&self) -> Option<f64> {
        lost(self.before.0, self.r.write_rate())
    }

    /// The same per vCPU (empty without both rates).
    pub fn vcpu_lost(&self) -> Vec<f64> {
        let during = self.vcpu_during();
        (self.before.1.iter().zip(&during))
            .filter_map(|(&b, &d)| lost(b, d))
            .collect()
    }

    /// Guest writes lost to the migration: the rate before times the pre-copy time, less the
    /// writes made (at least 0). A short migration that throttles hard can lose fewer writes
    /// than a long one that throttles less.
    pub fn writes_lost(&self) -> f64 {
        let r = &self.r;
        (self.before.0 * r.precopy.as_secs_f64() - r.guest_writes as f64).max(0.0)
    }
}

impl Serialize for Migration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (r, mut m) = (&self.r, s.serialize_map(None)?);
        m.serialize_entry("benchmark", self.benchmark)?;
        m.serialize_entry("config", &Config(&self.guest, &self.migration))?;
        m.serialize_entry("failed_attempts", &self.failed_attempts)?;
        m.serialize_entry("attempt", &r.attempt)?;
        m.serialize_entry("resumed", &r.resumed)?;
        m.serialize_entry("destination_backend", &r.dest_backend)?;
        m.serialize_entry("setup_s", &r.setup.as_secs_f64())?;
        m.serialize_entry("total_s", &r.total.as_secs_f64())?;
        // The vCPUs stopped: the final harvest, the final send and the verification.
        m.serialize_entry("downtime_s", &r.downtime.as_secs_f64())?;
        m.serialize_entry("final_harvest_s", &r.final_harvest.as_secs_f64())?;
        m.serialize_entry("final_send_s", &r.final_send.as_secs_f64())?;
        m.serialize_entry("verify_s", &r.verify.as_secs_f64())?;
        m.serialize_entry("device_state_blobs", &r.state_blobs)?;
        m.serialize_entry("device_state_bytes", &r.state_bytes)?;
        m.serialize_entry("device_state_s", &r.state.as_secs_f64())?;
        m.serialize_entry("one_way", &r.one_way)?;
        m.serialize_entry("connections", &r.connections)?;
        m.serialize_entry("converged", &r.converged)?;
        m.serialize_entry("expected_final_transfer_s", &r.expected_final.as_secs_f64())?;
        let rounds: Vec<Round> = r.rounds.iter().map(Round).collect();
        m.serialize_entry("rounds", &rounds)?;
        m.serialize_entry("pages", &r.pages())?;
        m.serialize_entry("bytes", &r.bytes())?;
        m.serialize_entry("bandwidth_bytes_per_s", &r.bandwidth())?;
        m.serialize_entry("dirty_pages_per_s", &r.dirty_rate())?;
        m.serialize_entry("guest_writes_per_s_before", &self.before.0)?;
        m.serialize_entry("guest_writes_per_s_during", &r.write_rate())?;
        m.serialize_entry("guest_throughput_lost_percent", &self.throughput_lost())?;
        m.serialize_entry("guest_writes_lost", &self.writes_lost())?;
        m.serialize_entry("vcpu_writes_per_s_before", &self.before.1)?;
        m.serialize_entry("vcpu_writes_per_s_during", &self.vcpu_during())?;
        m.serialize_entry("vcpu_throughput_lost_percent", &self.vcpu_lost())?;
        m.serialize_entry("dirty_limit", &r.dirty_limit.as_ref().map(DirtyLimit))?;
        m.serialize_entry("throttle", &Throttle(r))?;
        let verification = Verification {
            ok: true,
            ranges: r.verify_ranges,
            range_pages: r.range_pages,
            mismatched: None,
            mode: Some(r.verify_mode.name()),
            paused_hashed_pages: Some(r.paused_hashed_pages),
        };
        m.serialize_entry("verification", &verification)?;
        m.serialize_entry("destination_resumed", &r.dest_resumed.map(Resumed))?;
        m.serialize_entry("postcopy", &r.postcopy.as_ref().map(Postcopy))?;
        m.serialize_entry("delta", &r.delta.as_ref().map(Delta))?;
        if let Some(d) = &self.destination {
            m.serialize_entry("destination", d)?;
        }
        m.end()
    }
}

impl Serialize for Dest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (r, mut m) = (&self.0, s.serialize_map(None)?);
        m.serialize_entry("session", &r.session)?;
        m.serialize_entry("attempt", &r.attempt)?;
        m.serialize_entry("resumed", &r.resumed)?;
        m.serialize_entry("source_backend", &r.source_backend)?;
        m.serialize_entry("backend", &r.backend)?;
        m.serialize_entry("memory_bytes", &self.memory_bytes())?;
        m.serialize_entry("pages", &r.pages)?;
        m.serialize_entry("zero_pages", &r.zero_pages)?;
        m.serialize_entry("bytes", &r.bytes)?;
        m.serialize_entry("rounds", &r.rounds)?;
        m.serialize_entry("streams", &r.streams)?;
        m.serialize_entry("setup_s", &r.setup.as_secs_f64())?;
        m.serialize_entry("total_s", &r.total.as_secs_f64())?;
        let verification = Verification {
            ok: r.verify.ok(),
            ranges: r.verify.ranges,
            range_pages: r.verify.range_pages,
            mismatched: Some(r.verify.mismatched),
            mode: None,
            paused_hashed_pages: None,
        };
        m.serialize_entry("verification", &verification)?;
        m.serialize_entry("verify_time_s", &r.verify_time.as_secs_f64())?;
        m.serialize_entry("run", &Resumed(r.run))?;
        m.serialize_entry("postcopy", &r.postcopy.as_ref().map(PostcopyDest))?;
        m.end()
    }
}

impl Dest {
    /// The guest's memory.
    pub fn memory_bytes(&self) -> u64 {
        self.0.regions.iter().map(|x| x.pages).sum::<u64>() * 4096
    }
}

/// The source's flags.
struct Config<'a>(&'a GuestArgs, &'a MigrationArgs);

impl Serialize for Config<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (g, a, mut m) = (self.0, self.1, s.serialize_map(None)?);
        m.serialize_entry("backend", g.backend.name())?;
        m.serialize_entry("vcpus", &g.work.vcpus)?;
        m.serialize_entry("bytes_per_vcpu", &g.work.bytes)?;
        m.serialize_entry("backing", g.work.backing.name())?;
        m.serialize_entry("slots", &g.slots)?;
        m.serialize_entry("overlap", &g.work.overlap)?;
        m.serialize_entry("random", &g.random)?;
        m.serialize_entry("write_percent", &g.write_percent)?;
        m.serialize_entry("seed", &g.seed)?;
        m.serialize_entry("dirty_rate_per_vcpu", &g.dirty_rate)?;
        if let Some(v0) = g.dirty_rate_vcpu0 {
            m.serialize_entry("dirty_rate_vcpu0", &v0)?;
        }
        m.serialize_entry("fill_percent", &g.fill)?;
        m.serialize_entry("log", g.log.mode().name())?;
        m.serialize_entry("fast_pf", &g.machine.fast_pf.on())?;
        m.serialize_entry("max_downtime_ms", &a.max_downtime)?;
        m.serialize_entry("max_rounds", &a.max_rounds)?;
        m.serialize_entry("bandwidth_mib_per_s", &a.bandwidth)?;
        m.serialize_entry("compress", &(a.compress == CompressArg::Lz4))?;
        m.serialize_entry("connections", &a.connections)?;
        m.serialize_entry("delta", &a.delta.on())?;
        m.serialize_entry("delta_cache_bytes", &a.delta_cache)?;
        m.serialize_entry("auto_converge", &a.auto_converge.on())?;
        m.serialize_entry("cpu_throttle_initial", &a.throttle_initial)?;
        m.serialize_entry("cpu_throttle_increment", &a.throttle_increment)?;
        m.serialize_entry("cpu_throttle_tailslow", &a.throttle_tailslow.on())?;
        m.serialize_entry("converge", a.converge.name())?;
        let dirty_limit = a.converge == ConvergeArg::DirtyLimit;
        m.serialize_entry(
            "dirty_limit_pages_per_s",
            &dirty_limit.then_some(a.dirty_limit),
        )?;
        let period = dirty_limit.then_some(a.dirty_limit_period);
        m.serialize_entry("dirty_limit_period_ms", &period)?;
        m.serialize_entry("postcopy", &a.postcopy_trigger().is_some())?;
        m.serialize_entry("postcopy_after", &a.postcopy_after)?;
        m.end()
    }
}

/// The delta cache of the attempt that succeeded.
struct Delta<'a>(&'a slat_migrate::DeltaReport);

impl Serialize for Delta<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (d, mut m) = (self.0, s.serialize_map(None)?);
        m.serialize_entry("cache_bytes", &d.cache_bytes)?;
        m.serialize_entry("allocated_bytes", &d.allocated)?;
        m.serialize_entry("delta_pages", &d.hits)?;
        m.serialize_entry("whole_pages", &d.misses)?;
        m.serialize_entry("refused_chunks", &d.refused)?;
        m.end()
    }
}

/// One round (0: the full copy; the last: the stop-and-copy).
struct Round<'a>(&'a RoundReport);

impl Serialize for Round<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (x, mut m) = (self.0, s.serialize_map(None)?);
        m.serialize_entry("round", &x.round)?;
        m.serialize_entry("pages", &x.pages)?;
        m.serialize_entry("zero_pages", &x.zero_pages)?;
        m.serialize_entry("delta_pages", &x.delta_pages)?;
        m.serialize_entry("bytes", &x.bytes)?;
        m.serialize_entry("time_s", &x.time.as_secs_f64())?;
        // Owed to the next round.
        m.serialize_entry("dirtied", &x.dirtied)?;
        m.serialize_entry("throttle_percent", &x.throttle)?;
        m.serialize_entry("stop_and_copy", &x.stop_and_copy)?;
        m.end()
    }
}

/// Auto-converge: the highest throttle, every change, and the vCPU time it took.
struct Throttle<'a>(&'a MigrationReport);

impl Serialize for Throttle<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (r, mut m) = (self.0, s.serialize_map(None)?);
        m.serialize_entry("max_percent", &r.throttle_max)?;
        #[derive(Serialize)]
        struct Change {
            after_round: u32,
            percent: u32,
        }
        let changes: Vec<Change> = (r.throttle_changes.iter())
            .map(|&(after_round, percent)| Change {
                after_round,
                percent,
            })
            .collect();
        m.serialize_entry("changes", &changes)?;
        m.serialize_entry("vcpu_time_s", &r.throttled.as_secs_f64())?;
        m.end()
    }
}

/// Dirty-limit, when it was on.
struct DirtyLimit<'a>(&'a DirtyLimitReport);

impl Serialize for DirtyLimit<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (d, mut m) = (self.0, s.serialize_map(None)?);
        m.serialize_entry("limit_pages_per_s", &d.limit)?;
        m.serialize_entry("period_s", &d.period.as_secs_f64())?;
        m.serialize_entry("periods", &d.periods)?;
        // Per mille of each vCPU's time kept out of the guest.
        m.serialize_entry("vcpu_max_throttle_permille", &d.max_permille)?;
        m.serialize_entry("vcpu_last_throttle_permille", &d.last_permille)?;
        m.serialize_entry("vcpu_last_dirty_pages_per_s", &d.last_rates)?;
        m.end()
    }
}

/// The verification at switch-over.
#[derive(Serialize)]
struct Verification {
    ok: bool,
    ranges: u64,
    range_pages: u32,
    /// Destination side only.
    #[serde(skip_serializing_if = "Option::is_none")]
    mismatched: Option<u64>,
    /// `--verify` (source side only, as is the next).
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<&'static str>,
    /// Pages hashed with the vCPUs paused.
    #[serde(skip_serializing_if = "Option::is_none")]
    paused_hashed_pages: Option<u64>,
}

/// The guest's run on the destination after the switch-over: pages touched, for how long.
struct Resumed((u64, Duration));

impl Serialize for Resumed {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("pages_touched", &self.0 .0)?;
        m.serialize_entry("time_s", &self.0 .1.as_secs_f64())?;
        m.end()
    }
}

/// `x` per second of `t` (0 over no time).
fn per_s(x: f64, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        x / t.as_secs_f64()
    }
}

/// The share of `before` lost in `during`, percent (`None` without a rate before).
fn lost(before: f64, during: f64) -> Option<f64> {
    (before > 0.0).then(|| 100.0 * (1.0 - during / before))
}

/// Post-copy on the source.
struct Postcopy<'a>(&'a PostcopyReport);

impl Serialize for Postcopy<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (p, mut m) = (self.0, s.serialize_map(None)?);
        m.serialize_entry("after_rounds", &p.after_rounds)?;
        m.serialize_entry("trigger", p.trigger)?;
        m.serialize_entry("discarded_pages", &p.discarded)?;
        m.serialize_entry("background_pages", &p.background_pages)?;
        m.serialize_entry("preempt_pages", &p.preempt_pages)?;
        m.serialize_entry("requested_pages", &p.requested)?;
        m.serialize_entry("requests_already_sent", &p.requests_already_sent)?;
        m.serialize_entry("bytes", &p.bytes)?;
        m.serialize_entry("time_to_last_page_s", &p.time_to_last_page.as_secs_f64())?;
        m.serialize_entry("recoveries", &p.recoveries)?;
        m.end()
    }
}

/// Post-copy on the destination: QEMU's figures (pages requested, blocktime).
struct PostcopyDest<'a>(&'a PostcopyDestReport);

impl Serialize for PostcopyDest<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (p, mut m) = (self.0, s.serialize_map(None)?);
        m.serialize_entry("discarded_pages", &p.discarded)?;
        m.serialize_entry("requested_pages", &p.requested)?;
        m.serialize_entry("background_pages", &p.background_pages)?;
        m.serialize_entry("preempt_pages", &p.preempt_pages)?;
        m.serialize_entry("duplicate_pages", &p.duplicates)?;
        m.serialize_entry("faults", &p.blocktime.faults)?;
        m.serialize_entry("blocktime_p50_s", &p.blocktime.p50.as_secs_f64())?;
        m.serialize_entry("blocktime_p99_s", &p.blocktime.p99.as_secs_f64())?;
        m.serialize_entry("blocktime_max_s", &p.blocktime.max.as_secs_f64())?;
        m.serialize_entry("time_to_last_page_s", &p.time_to_last_page.as_secs_f64())?;
        m.serialize_entry("recoveries", &p.recoveries)?;
        m.end()
    }
}
