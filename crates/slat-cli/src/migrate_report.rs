//! The reports of `slat migrate`, `migrate-perf` ([`Migration`], the source's view) and
//! `migrate-listen` ([`DestinationDoc`]). Each is the one type its command's JSON document,
//! text report, metrics and plots are drawn from; the field names are the ones the documents
//! always had. slat-migrate's own reports are not serializable (the library does not depend
//! on serde), so these are built from them once, when a migration ends.

use crate::migrate::{CompressArg, ConvergeArg, GuestArgs, MigrationArgs};
use crate::output::secs;
use serde::Serialize;
use slat_migrate::{DestReport, MigrationReport, RoundReport};
use std::time::Duration;

/// The source's flags.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    pub backend: &'static str,
    pub vcpus: u32,
    pub bytes_per_vcpu: u64,
    pub backing: &'static str,
    pub slots: u32,
    pub overlap: bool,
    pub random: bool,
    pub write_percent: u32,
    pub seed: u32,
    pub dirty_rate_per_vcpu: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_rate_vcpu0: Option<u64>,
    pub fill_percent: u32,
    pub log: &'static str,
    pub fast_pf: bool,
    pub max_downtime_ms: u64,
    pub max_rounds: u32,
    pub bandwidth_mib_per_s: Option<u64>,
    /// `--compress lz4`.
    pub compress: bool,
    pub auto_converge: bool,
    pub converge: &'static str,
    /// Only with `--converge dirty-limit` (as is the period).
    pub dirty_limit_pages_per_s: Option<u64>,
    pub dirty_limit_period_ms: Option<u64>,
}

/// One round (the last is the stop-and-copy).
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// 0: the full copy.
    pub round: u32,
    pub pages: u64,
    pub zero_pages: u64,
    /// Written to the socket.
    pub bytes: u64,
    /// From the first byte to the last acknowledgement.
    #[serde(rename = "time_s", serialize_with = "secs")]
    pub time: Duration,
    /// Pages the guest dirtied while the round ran: owed to the next round.
    pub dirtied: u64,
    pub throttle_percent: u32,
    pub stop_and_copy: bool,
}

impl Round {
    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        per_s(self.bytes as f64, self.time)
    }
}

/// A change of auto-converge's throttle.
#[derive(Debug, Clone, Serialize)]
pub struct ThrottleChange {
    pub after_round: u32,
    pub percent: u32,
}

/// Auto-converge.
#[derive(Debug, Clone, Serialize)]
pub struct Throttle {
    pub max_percent: u32,
    pub changes: Vec<ThrottleChange>,
    /// vCPU time kept out of the guest, summed over the vCPUs.
    #[serde(rename = "vcpu_time_s", serialize_with = "secs")]
    pub vcpu_time: Duration,
}

/// Dirty-limit, when it was on.
#[derive(Debug, Clone, Serialize)]
pub struct DirtyLimit {
    pub limit_pages_per_s: u64,
    #[serde(rename = "period_s", serialize_with = "secs")]
    pub period: Duration,
    pub periods: u32,
    /// Highest throttle per vCPU, per mille of its time kept out of the guest.
    pub vcpu_max_throttle_permille: Vec<u32>,
    /// At the pause.
    pub vcpu_last_throttle_permille: Vec<u32>,
    /// Over the last period.
    pub vcpu_last_dirty_pages_per_s: Vec<f64>,
}

/// The verification at switch-over.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    pub ok: bool,
    pub ranges: u64,
    pub range_pages: u32,
    /// Destination side only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatched: Option<u64>,
    /// `--verify` (source side only, as is the next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'static str>,
    /// Pages hashed with the vCPUs paused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_hashed_pages: Option<u64>,
}

/// The guest's run on the destination after the switch-over.
#[derive(Debug, Clone, Serialize)]
pub struct Resumed {
    pub pages_touched: u64,
    #[serde(rename = "time_s", serialize_with = "secs")]
    pub time: Duration,
}

/// What the destination reports: `migrate-listen`'s report, and part of `migrate-perf`'s.
#[derive(Debug, Clone, Serialize)]
pub struct DestinationDoc {
    /// The migration session's id.
    pub session: u64,
    /// The source's attempt.
    pub attempt: u32,
    /// The session resumed an earlier, interrupted one.
    pub resumed: bool,
    pub source_backend: String,
    pub backend: String,
    /// The guest's memory.
    pub memory_bytes: u64,
    /// Received, zero pages included.
    pub pages: u64,
    pub zero_pages: u64,
    /// Of stream.
    pub bytes: u64,
    pub rounds: u32,
    /// Connection to first page.
    #[serde(rename = "setup_s", serialize_with = "secs")]
    pub setup: Duration,
    #[serde(rename = "total_s", serialize_with = "secs")]
    pub total: Duration,
    pub verification: Verification,
    /// Hashing this side's memory.
    #[serde(rename = "verify_time_s", serialize_with = "secs")]
    pub verify_time: Duration,
    pub run: Resumed,
}

impl DestinationDoc {
    pub fn new(r: &DestReport) -> DestinationDoc {
        DestinationDoc {
            session: r.session,
            attempt: r.attempt,
            resumed: r.resumed,
            source_backend: r.source_backend.clone(),
            backend: r.backend.clone(),
            memory_bytes: r.regions.iter().map(|x| x.pages).sum::<u64>() * 4096,
            pages: r.pages,
            zero_pages: r.zero_pages,
            bytes: r.bytes,
            rounds: r.rounds,
            setup: r.setup,
            total: r.total,
            verification: Verification {
                ok: r.verify.ok(),
                ranges: r.verify.ranges,
                range_pages: r.verify.range_pages,
                mismatched: Some(r.verify.mismatched),
                mode: None,
                paused_hashed_pages: None,
            },
            verify_time: r.verify_time,
            run: Resumed {
                pages_touched: r.run.0,
                time: r.run.1,
            },
        }
    }
}

/// One migration, as the source saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Migration {
    /// `migrate` or `migrate-perf`.
    pub benchmark: &'static str,
    pub config: Config,
    /// Why earlier attempts failed.
    pub failed_attempts: Vec<String>,
    /// The attempt that succeeded.
    pub attempt: u32,
    /// It resumed an interrupted session.
    pub resumed: bool,
    pub destination_backend: String,
    /// Connection and handshake.
    #[serde(rename = "setup_s", serialize_with = "secs")]
    pub setup: Duration,
    #[serde(rename = "total_s", serialize_with = "secs")]
    pub total: Duration,
    /// vCPUs stopped, of which the final harvest, the final send and the verification.
    #[serde(rename = "downtime_s", serialize_with = "secs")]
    pub downtime: Duration,
    #[serde(rename = "final_harvest_s", serialize_with = "secs")]
    pub final_harvest: Duration,
    #[serde(rename = "final_send_s", serialize_with = "secs")]
    pub final_send: Duration,
    #[serde(rename = "verify_s", serialize_with = "secs")]
    pub verify: Duration,
    pub device_state_blobs: u32,
    pub device_state_bytes: u64,
    /// Saving and sending the device state, vCPUs stopped.
    #[serde(rename = "device_state_s", serialize_with = "secs")]
    pub device_state: Duration,
    /// Into a file (nothing acknowledged).
    pub one_way: bool,
    /// Pre-copy ended below --max-downtime (not at --max-rounds).
    pub converged: bool,
    /// The stop-and-copy time pre-copy expected.
    #[serde(rename = "expected_final_transfer_s", serialize_with = "secs")]
    pub expected_final: Duration,
    pub rounds: Vec<Round>,
    pub pages: u64,
    pub bytes: u64,
    pub bandwidth_bytes_per_s: f64,
    /// As the harvests saw them during pre-copy.
    pub dirty_pages_per_s: f64,
    /// During the warm-up.
    pub guest_writes_per_s_before: f64,
    /// During pre-copy.
    pub guest_writes_per_s_during: f64,
    /// The share of the guest's writes per second the migration cost, percent; `None`
    /// without a rate before.
    pub guest_throughput_lost_percent: Option<f64>,
    /// The rate before times the pre-copy time, less the writes made (at least 0). A short
    /// migration that throttles hard can lose fewer writes than a long one that throttles less.
    pub guest_writes_lost: f64,
    /// Empty where the guest's writes are not counted per vCPU (as in the next two).
    pub vcpu_writes_per_s_before: Vec<f64>,
    pub vcpu_writes_per_s_during: Vec<f64>,
    pub vcpu_throughput_lost_percent: Vec<f64>,
    pub dirty_limit: Option<DirtyLimit>,
    pub throttle: Throttle,
    pub verification: Verification,
    /// As the destination reported it back.
    pub destination_resumed: Option<Resumed>,
    /// The destination's own report (migrate-perf, both ends in this process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination: Option<DestinationDoc>,
}

impl Migration {
    /// From the source's report, the guest's write rate during the warm-up (in all and per
    /// vCPU, where counted) and why earlier attempts failed.
    pub fn new(
        benchmark: &'static str,
        (g, m): (&GuestArgs, &MigrationArgs),
        r: &MigrationReport,
        (before, vcpu_before): (f64, Vec<f64>),
        failed_attempts: Vec<String>,
    ) -> Migration {
        let during: Vec<f64> = r
            .vcpu_writes
            .iter()
            .map(|&w| per_s(w as f64, r.precopy))
            .collect();
        Migration {
            benchmark,
            config: Config::new(g, m),
            failed_attempts,
            attempt: r.attempt,
            resumed: r.resumed,
            destination_backend: r.dest_backend.clone(),
            setup: r.setup,
            total: r.total,
            downtime: r.downtime,
            final_harvest: r.final_harvest,
            final_send: r.final_send,
            verify: r.verify,
            device_state_blobs: r.state_blobs,
            device_state_bytes: r.state_bytes,
            device_state: r.state,
            one_way: r.one_way,
            converged: r.converged,
            expected_final: r.expected_final,
            rounds: r.rounds.iter().map(Round::new).collect(),
            pages: r.pages(),
            bytes: r.bytes(),
            bandwidth_bytes_per_s: r.bandwidth(),
            dirty_pages_per_s: r.dirty_rate(),
            guest_writes_per_s_before: before,
            guest_writes_per_s_during: r.write_rate(),
            guest_throughput_lost_percent: lost(before, r.write_rate()),
            guest_writes_lost: (before * r.precopy.as_secs_f64() - r.guest_writes as f64).max(0.0),
            vcpu_throughput_lost_percent: (vcpu_before.iter().zip(&during))
                .filter_map(|(&b, &d)| lost(b, d))
                .collect(),
            vcpu_writes_per_s_before: vcpu_before,
            vcpu_writes_per_s_during: during,
            dirty_limit: r.dirty_limit.as_ref().map(|d| DirtyLimit {
                limit_pages_per_s: d.limit,
                period: d.period,
                periods: d.periods,
                vcpu_max_throttle_permille: d.max_permille.clone(),
                vcpu_last_throttle_permille: d.last_permille.clone(),
                vcpu_last_dirty_pages_per_s: d.last_rates.clone(),
            }),
            throttle: Throttle {
                max_percent: r.throttle_max,
                changes: (r.throttle_changes.iter())
                    .map(|&(after_round, percent)| ThrottleChange {
                        after_round,
                        percent,
                    })
                    .collect(),
                vcpu_time: r.throttled,
            },
            verification: Verification {
                ok: true,
                ranges: r.verify_ranges,
                range_pages: r.range_pages,
                mismatched: None,
                mode: Some(r.verify_mode.name()),
                paused_hashed_pages: Some(r.paused_hashed_pages),
            },
            destination_resumed: (r.dest_resumed).map(|(pages_touched, time)| Resumed {
                pages_touched,
                time,
            }),
            destination: None,
        }
    }
}

impl Config {
    fn new(g: &GuestArgs, m: &MigrationArgs) -> Config {
        let dirty_limit = m.converge == ConvergeArg::DirtyLimit;
        Config {
            backend: g.backend.name(),
            vcpus: g.work.vcpus,
            bytes_per_vcpu: g.work.bytes,
            backing: g.work.backing.name(),
            slots: g.slots,
            overlap: g.work.overlap,
            random: g.random,
            write_percent: g.write_percent,
            seed: g.seed,
            dirty_rate_per_vcpu: g.dirty_rate,
            dirty_rate_vcpu0: g.dirty_rate_vcpu0,
            fill_percent: g.fill,
            log: g.log.mode().name(),
            fast_pf: g.machine.fast_pf.on(),
            max_downtime_ms: m.max_downtime,
            max_rounds: m.max_rounds,
            bandwidth_mib_per_s: m.bandwidth,
            compress: m.compress == CompressArg::Lz4,
            auto_converge: m.auto_converge.on(),
            converge: m.converge.name(),
            dirty_limit_pages_per_s: dirty_limit.then_some(m.dirty_limit),
            dirty_limit_period_ms: dirty_limit.then_some(m.dirty_limit_period),
        }
    }
}

impl Round {
    fn new(x: &RoundReport) -> Round {
        Round {
            round: x.round,
            pages: x.pages,
            zero_pages: x.zero_pages,
            bytes: x.bytes,
            time: x.time,
            dirtied: x.dirtied,
            throttle_percent: x.throttle,
            stop_and_copy: x.stop_and_copy,
        }
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
