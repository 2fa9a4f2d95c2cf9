//! The typed reports of `slat migrate`, `migrate-listen` and `migrate-perf`, serialized into
//! their JSON documents (the field names are the ones the documents always had).

use crate::migrate::{CompressArg, ConvergeArg, GuestArgs, MigrationArgs};
use crate::output::secs;
use serde::Serialize;
use slat_migrate::{DestReport, MigrationReport, RoundReport};
use std::time::Duration;

/// The source's settings.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// `--backend`.
    pub backend: &'static str,
    /// `-v`.
    pub vcpus: u32,
    /// `-b`.
    pub bytes_per_vcpu: u64,
    /// `-s`.
    pub backing: &'static str,
    /// `-x`.
    pub slots: u32,
    /// `-o`.
    pub overlap: bool,
    /// `-a`.
    pub random: bool,
    /// `-w`.
    pub write_percent: u32,
    /// `-r`.
    pub seed: u32,
    /// `--dirty-rate`.
    pub dirty_rate_per_vcpu: u64,
    /// `--dirty-rate-vcpu0`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_rate_vcpu0: Option<u64>,
    /// `--fill`.
    pub fill_percent: u32,
    /// `--log`.
    pub log: &'static str,
    /// `--fast-pf`.
    pub fast_pf: bool,
    /// `--max-downtime`.
    pub max_downtime_ms: u64,
    /// `--max-rounds`.
    pub max_rounds: u32,
    /// `--bandwidth`.
    pub bandwidth_mib_per_s: Option<u64>,
    /// `--compress lz4`.
    pub compress: bool,
    /// `--auto-converge`.
    pub auto_converge: bool,
    /// `--converge`: auto, dirty-limit or none.
    pub converge: &'static str,
    /// `--dirty-limit` (with `--converge dirty-limit`).
    pub dirty_limit_pages_per_s: Option<u64>,
    /// `--dirty-limit-period` (with `--converge dirty-limit`).
    pub dirty_limit_period_ms: Option<u64>,
}

/// One pre-copy round (the last is the stop-and-copy).
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// 0: the full copy.
    pub round: u32,
    /// Pages sent.
    pub pages: u64,
    /// Of which zero pages.
    pub zero_pages: u64,
    /// Bytes written to the socket.
    pub bytes: u64,
    /// From the first byte to the last acknowledgement.
    #[serde(rename = "time_s", serialize_with = "secs")]
    pub time: Duration,
    /// Pages the guest dirtied while the round ran: owed to the next round.
    pub dirtied: u64,
    /// Throttle while the round ran.
    pub throttle_percent: u32,
    /// The vCPUs were stopped.
    pub stop_and_copy: bool,
}

/// A throttle change.
#[derive(Debug, Clone, Serialize)]
pub struct ThrottleChange {
    /// The round after which it changed.
    pub after_round: u32,
    /// The new throttle.
    pub percent: u32,
}

/// Auto-converge.
#[derive(Debug, Clone, Serialize)]
pub struct Throttle {
    /// The highest throttle.
    pub max_percent: u32,
    /// Every change.
    pub changes: Vec<ThrottleChange>,
    /// vCPU time spent throttled.
    #[serde(rename = "vcpu_time_s", serialize_with = "secs")]
    pub vcpu_time: Duration,
}

/// Dirty-limit, when it was on.
#[derive(Debug, Clone, Serialize)]
pub struct DirtyLimit {
    /// Dirty pages per second per vCPU allowed.
    pub limit_pages_per_s: u64,
    /// The measurement period.
    #[serde(rename = "period_s", serialize_with = "secs")]
    pub period: Duration,
    /// Periods measured.
    pub periods: u32,
    /// Highest throttle per vCPU, per mille of its time kept out of the guest.
    pub vcpu_max_throttle_permille: Vec<u32>,
    /// Throttle per vCPU at the pause, per mille.
    pub vcpu_last_throttle_permille: Vec<u32>,
    /// Dirty pages per second per vCPU over the last period.
    pub vcpu_last_dirty_pages_per_s: Vec<f64>,
}

/// The verification at switch-over.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    /// Every range matched.
    pub ok: bool,
    /// Ranges compared.
    pub ranges: u64,
    /// Pages per range.
    pub range_pages: u32,
    /// Ranges that did not match (destination side only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatched: Option<u64>,
    /// `--verify`: `sent` or `full` (source side only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'static str>,
    /// Pages hashed with the vCPUs paused (source side only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_hashed_pages: Option<u64>,
}

/// The guest's run on the destination after the switch-over.
#[derive(Debug, Clone, Serialize)]
pub struct Resumed {
    /// Pages it touched.
    pub pages_touched: u64,
    /// How long it ran.
    #[serde(rename = "time_s", serialize_with = "secs")]
    pub time: Duration,
}

/// What the destination reports.
#[derive(Debug, Clone, Serialize)]
pub struct DestinationDoc {
    /// The migration session's id.
    pub session: u64,
    /// Which attempt of the source.
    pub attempt: u32,
    /// The session resumed an earlier, interrupted one.
    pub resumed: bool,
    /// The source's machine.
    pub source_backend: String,
    /// This machine.
    pub backend: String,
    /// Pages received.
    pub pages: u64,
    /// Of which zero pages.
    pub zero_pages: u64,
    /// Bytes received.
    pub bytes: u64,
    /// Rounds received.
    pub rounds: u32,
    /// Connection to first page.
    #[serde(rename = "setup_s", serialize_with = "secs")]
    pub setup: Duration,
    /// The whole session.
    #[serde(rename = "total_s", serialize_with = "secs")]
    pub total: Duration,
    /// The verification.
    pub verification: Verification,
    /// Time verifying.
    #[serde(rename = "verify_time_s", serialize_with = "secs")]
    pub verify_time: Duration,
    /// The guest's run after the switch-over.
    pub run: Resumed,
}

impl DestinationDoc {
    /// From the destination's report.
    pub fn new(r: &DestReport) -> DestinationDoc {
        DestinationDoc {
            session: r.session,
            attempt: r.attempt,
            resumed: r.resumed,
            source_backend: r.source_backend.clone(),
            backend: r.backend.clone(),
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
    /// The settings.
    pub config: Config,
    /// Why earlier attempts failed.
    pub failed_attempts: Vec<String>,
    /// The attempt that succeeded.
    pub attempt: u32,
    /// It resumed an interrupted session.
    pub resumed: bool,
    /// The destination's machine.
    pub destination_backend: String,
    /// Connection and handshake.
    #[serde(rename = "setup_s", serialize_with = "secs")]
    pub setup: Duration,
    /// The whole migration.
    #[serde(rename = "total_s", serialize_with = "secs")]
    pub total: Duration,
    /// vCPUs stopped.
    #[serde(rename = "downtime_s", serialize_with = "secs")]
    pub downtime: Duration,
    /// The last harvest, vCPUs stopped.
    #[serde(rename = "final_harvest_s", serialize_with = "secs")]
    pub final_harvest: Duration,
    /// The last send, vCPUs stopped.
    #[serde(rename = "final_send_s", serialize_with = "secs")]
    pub final_send: Duration,
    /// The verification at switch-over.
    #[serde(rename = "verify_s", serialize_with = "secs")]
    pub verify: Duration,
    /// Device-state blobs sent.
    pub device_state_blobs: u32,
    /// Saving and sending them, vCPUs stopped.
    #[serde(rename = "device_state_s", serialize_with = "secs")]
    pub device_state: Duration,
    /// Into a file (nothing acknowledged).
    pub one_way: bool,
    /// Pre-copy converged below --max-downtime.
    pub converged: bool,
    /// The stop-and-copy time pre-copy expected.
    #[serde(rename = "expected_final_transfer_s", serialize_with = "secs")]
    pub expected_final: Duration,
    /// Every round.
    pub rounds: Vec<Round>,
    /// Pages sent.
    pub pages: u64,
    /// Bytes sent.
    pub bytes: u64,
    /// Bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Pages the guest dirtied per second during pre-copy.
    pub dirty_pages_per_s: f64,
    /// The guest's writes per second before the migration.
    pub guest_writes_per_s_before: f64,
    /// And during it.
    pub guest_writes_per_s_during: f64,
    /// The share of the guest's writes per second the migration cost (before vs during
    /// pre-copy), percent; `None` without a rate before.
    pub guest_throughput_lost_percent: Option<f64>,
    /// Guest writes lost to the migration: the rate before times the pre-copy time, less the
    /// writes made (0 if none were lost). A short migration that throttles hard can lose fewer
    /// writes than a long one that throttles less.
    pub guest_writes_lost: f64,
    /// Per vCPU, writes per second before the migration (empty if not counted per vCPU).
    pub vcpu_writes_per_s_before: Vec<f64>,
    /// Per vCPU, during pre-copy.
    pub vcpu_writes_per_s_during: Vec<f64>,
    /// Per vCPU, the share lost, percent (empty without both).
    pub vcpu_throughput_lost_percent: Vec<f64>,
    /// Dirty-limit (`--converge dirty-limit`).
    pub dirty_limit: Option<DirtyLimit>,
    /// Auto-converge.
    pub throttle: Throttle,
    /// The verification.
    pub verification: Verification,
    /// The guest's run on the destination, as reported back.
    pub destination_resumed: Option<Resumed>,
    /// The destination's own report (migrate-perf, both ends in this process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination: Option<DestinationDoc>,
}

impl Migration {
    /// From the source's report.
    pub fn new(
        benchmark: &'static str,
        g: &GuestArgs,
        m: &MigrationArgs,
        r: &MigrationReport,
        baseline: f64,
        failures: &[String],
    ) -> Migration {
        Migration {
            benchmark,
            config: Config::new(g, m),
            failed_attempts: failures.to_vec(),
            attempt: r.attempt,
            resumed: r.resumed,
            destination_backend: r.dest_backend.clone(),
            setup: r.setup,
            total: r.total,
            downtime: r.downtime,
            final_harvest: r.final_harvest,
            final_send: r.final_send,
            verify: r.verify,
            converged: r.converged,
            expected_final: r.expected_final,
            rounds: r.rounds.iter().map(Round::new).collect(),
            pages: r.pages(),
            bytes: r.bytes(),
            bandwidth_bytes_per_s: r.bandwidth(),
            dirty_pages_per_s: r.dirty_rate(),
            guest_writes_per_s_before: baseline,
            guest_writes_per_s_during: r.write_rate(),
            guest_throughput_lost_percent: lost(baseline, r.write_rate()),
            guest_writes_lost: (baseline * r.precopy.as_secs_f64() - r.guest_writes as f64)
                .max(0.0),
            vcpu_writes_per_s_before: Vec::new(),
            vcpu_writes_per_s_during: r
                .vcpu_writes
                .iter()
                .map(|&w| {
                    if r.precopy.is_zero() {
                        0.0
                    } else {
                        w as f64 / r.precopy.as_secs_f64()
                    }
                })
                .collect(),
            vcpu_throughput_lost_percent: Vec::new(),
            dirty_limit: r.dirty_limit.as_ref().map(|d| DirtyLimit {
                limit_pages_per_s: d.limit,
                period: d.period,
                periods: d.periods,
                vcpu_max_throttle_permille: d.max_permille.clone(),
                vcpu_last_throttle_permille: d.last_permille.clone(),
                vcpu_last_dirty_pages_per_s: d.last_rates.clone(),
            }),
            throttle: Throttle::new(r),
            verification: Verification {
                ok: true,
                ranges: r.verify_ranges,
                range_pages: r.range_pages,
                mismatched: None,
                mode: Some(r.verify_mode.name()),
                paused_hashed_pages: Some(r.paused_hashed_pages),
            },
            device_state_blobs: r.state_blobs,
            device_state: r.state,
            one_way: r.one_way,
            destination_resumed: r.dest_resumed.map(|(n, d)| Resumed {
                pages_touched: n,
                time: d,
            }),
            destination: None,
        }
    }
}

impl Config {
    /// The flags of the guest and of the migration.
    fn new(g: &GuestArgs, m: &MigrationArgs) -> Config {
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
            dirty_limit_pages_per_s: (m.converge == ConvergeArg::DirtyLimit)
                .then_some(m.dirty_limit),
            dirty_limit_period_ms: (m.converge == ConvergeArg::DirtyLimit)
                .then_some(m.dirty_limit_period),
        }
    }
}

impl Round {
    /// One pre-copy round of the source's report.
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

impl Throttle {
    /// Auto-converge's throttling in the source's report.
    fn new(r: &MigrationReport) -> Throttle {
        Throttle {
            max_percent: r.throttle_max,
            changes: r
                .throttle_changes
                .iter()
                .map(|&(after_round, percent)| ThrottleChange {
                    after_round,
                    percent,
                })
                .collect(),
            vcpu_time: r.throttled,
        }
    }
}

/// The share of `before` lost in `during`, percent (`None` without a rate before).
fn lost(before: f64, during: f64) -> Option<f64> {
    (before > 0.0).then(|| 100.0 * (1.0 - during / before))
}

impl Migration {
    /// Records the per-vCPU write rates before the migration (measured by the caller during
    /// the warm-up) and the share each vCPU lost.
    pub fn set_vcpu_before(&mut self, before: Vec<f64>) {
        self.vcpu_throughput_lost_percent = before
            .iter()
            .zip(&self.vcpu_writes_per_s_during)
            .filter_map(|(&b, &d)| lost(b, d))
            .collect();
        self.vcpu_writes_per_s_before = before;
    }
}
