//! The rounds: pre-copy until the rest fits the downtime allowed, the pause, and the
//! stop-and-copy round.

use super::attempt::harvester;
use super::conn::Conn;
use super::sender::Sender;
use super::{rate, Event, MigrationReport, Progress, Source, SourceConfig};
use crate::error::MigrateError;
use crate::guest::Memory;
use crate::throttle::AutoConverge;
use std::time::{Duration, Instant};

impl Source {
    /// Pre-copy, the pause and the stop-and-copy round; returns when the guest paused.
    ///
    /// Pre-copy: round 0 sends everything owed; each later round first harvests, and
    /// pre-copy ends when the rest fits `max_downtime` (or after `max_rounds`); the round
    /// that comes next is the stop-and-copy round. A later round ends early once what it has
    /// left fits `max_downtime` at its own rate (QEMU syncs the bitmap then), so the harvest
    /// and the decision come while the rest is still small.
    pub(super) fn rounds(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        sender: &mut Sender,
        ac: &mut AutoConverge,
        report: &mut MigrationReport,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<Instant, MigrateError> {
        let log = harvester(&mut self.log, &*self.guest, &self.ring_counts)?;
        let mut round = 0u32;
        let mut last_owed = u64::MAX;
        let round = loop {
            // Re-armed before it returns; dropped on an error below, it is owed again.
            let t_take = Instant::now();
            let mut set = log.take()?;
            // The final harvest after the pause walks the same log: as long again.
            let harvest = t_take.elapsed();
            let dirtied = set.collected() + std::mem::take(&mut sender.collected);
            if let Some(prev) = report.rounds.last_mut() {
                prev.dirtied = dirtied;
                report.dirtied += dirtied;
                if let Some(t) = ac.after_round(prev.round, dirtied, prev.pages) {
                    self.guest.set_throttle(t);
                    progress(Event::Throttle(t));
                }
            }
            // The take just counted the ring: no second collect needed.
            sender.tick_limit(None, progress)?;
            let owed = set.pages() + sender.ro_pages();
            progress(Event::Progress(progress_of(
                report,
                round,
                owed,
                dirtied,
                self.guest.throttle(),
                sender.vcpu_throttles(),
                false,
                sender.t0,
            )));
            let switch = &mut self.switch;
            let at = (round, owed, harvest);
            if precopy_ends(&self.cfg, switch, at, &mut last_owed, report) {
                // Not sent: owed again, for the take after the pause.
                set.abort();
                break round;
            }
            let r = sender.round(
                conn,
                mem,
                self.guest.throttle(),
                &mut set,
                round,
                false,
                (round > 0).then_some(self.cfg.max_downtime),
                &format!("round {round}"),
                progress,
            )?;
            // Every page sent was acknowledged (and left the set) before the round returned;
            // a round that ended early leaves the rest in the set, owed again.
            if r.pages < owed {
                set.abort();
            } else {
                set.commit();
            }
            // Range hashes of what this round sent, while the guest runs.
            sender.digests.refresh();
            progress(Event::Round(&r));
            report.rounds.push(r);
            round += 1;
        };
        if let Some(d) = self.cfg.faults.pause_delay {
            std::thread::sleep(d);
        }
        let t_pause = Instant::now();
        self.guest.pause()?;
        if self.switch.is_some() {
            return Ok(t_pause);
        }
        self.stop_and_copy(conn, mem, sender, round, report, progress)?;
        Ok(t_pause)
    }

    /// With the vCPUs paused: the final harvest, then the stop-and-copy round `round`.
    fn stop_and_copy(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        sender: &mut Sender,
        round: u32,
        report: &mut MigrationReport,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(), MigrateError> {
        let log = harvester(&mut self.log, &*self.guest, &self.ring_counts)?;
        let t = Instant::now();
        let mut set = if self.cfg.faults.skip_final_harvest {
            log.take_owed()
        } else {
            log.take()?
        };
        // The last pre-copy round's writes reach up to the pause.
        if let Some(prev) = report.rounds.last_mut() {
            prev.dirtied += set.collected();
            report.dirtied += set.collected();
        }
        report.final_harvest = t.elapsed();
        progress(Event::Paused(set.pages() + sender.ro_pages()));
        if let Some(n) = self.cfg.faults.cut_in_final_round {
            conn.link.cut_in(n);
        }
        let t = Instant::now();
        let last = sender.round(
            conn,
            mem,
            self.guest.throttle(),
            &mut set,
            round,
            true,
            None,
            "stop-and-copy",
            progress,
        )?;
        set.commit();
        report.final_send = t.elapsed();
        progress(Event::Round(&last));
        report.rounds.push(last);
        progress(Event::Progress(progress_of(
            report,
            round,
            0,
            0,
            self.guest.throttle(),
            sender.vcpu_throttles(),
            true,
            sender.t0,
        )));
        Ok(())
    }
}

/// Whether pre-copy ends before round `round` with `owed` pages just harvested: in
/// stop-and-copy ([`precopy_done`]) or, when post-copy is on, in post-copy (its trigger then
/// in `switch`).
fn precopy_ends(
    cfg: &SourceConfig,
    switch: &mut Option<&'static str>,
    (round, owed, harvest): (u32, u64, Duration),
    last_owed: &mut u64,
    report: &mut MigrationReport,
) -> bool {
    if round > 0 && precopy_done(cfg, (owed, harvest), round, report) {
        if cfg.postcopy.is_some() && !report.converged {
            *switch = Some("max-rounds");
        }
        return true;
    }
    *switch = postcopy_due(cfg, round, owed, last_owed);
    switch.is_some()
}

/// Whether pre-copy ends before round `round` (> 0): the final harvest (as long as the
/// harvest just done, `harvest`) and the `owed` pages (harvested just now) at the bandwidth
/// of the round that just ended (recorded in `report`) fit `max_downtime`, or the rounds are
/// used up.
fn precopy_done(
    cfg: &SourceConfig,
    (owed, harvest): (u64, Duration),
    round: u32,
    report: &mut MigrationReport,
) -> bool {
    let expect = expected_transfer(report, owed);
    report.expected_final = expect;
    if expect.saturating_add(harvest) <= cfg.max_downtime {
        report.converged = true;
        return true;
    }
    round > cfg.max_rounds || round == u32::MAX
}

/// Whether pre-copy switches to post-copy before round `round`, with `owed` pages just
/// harvested (`last`: those harvested before the previous round, updated): after the rounds
/// asked for, or when the last round did not shrink the remaining set below
/// [`STALL_SHRINK`](crate::postcopy::STALL_SHRINK) of what it was.
fn postcopy_due(cfg: &SourceConfig, round: u32, owed: u64, last: &mut u64) -> Option<&'static str> {
    use crate::postcopy::{PostcopyTrigger, STALL_SHRINK};
    let before = std::mem::replace(last, owed);
    match cfg.postcopy? {
        PostcopyTrigger::After(n) => (round >= n).then_some("rounds"),
        PostcopyTrigger::Stalled => {
            (round >= 1 && owed as f64 > before as f64 * STALL_SHRINK).then_some("stalled")
        }
    }
}

/// How long `owed` pages would take at the bandwidth and bytes per page of the last round
/// that sent any.
///
/// QEMU's rule: the threshold is the bandwidth measured over the recent period times the
/// downtime allowed. An average over all rounds would let round 0 (which ran while the guest
/// was quiet, or while the link warmed up) hide what the link carries now.
fn expected_transfer(report: &MigrationReport, owed: u64) -> Duration {
    // Nothing measured yet (or nothing owed): nothing to wait for, as before any round.
    let Some(last) = report.rounds.iter().rev().find(|r| r.pages > 0) else {
        return Duration::ZERO;
    };
    let per_page = last.bytes as f64 / last.pages as f64;
    let bw = rate(last.bytes as f64, last.time).max(1.0);
    Duration::try_from_secs_f64(owed as f64 * per_page / bw).unwrap_or(Duration::MAX)
}

/// The progress after the rounds in `report`, with `owed` pages left.
#[allow(clippy::too_many_arguments)]
fn progress_of(
    report: &MigrationReport,
    round: u32,
    owed: u64,
    dirtied: u64,
    throttle: u32,
    vcpu_throttle_permille: Vec<u32>,
    paused: bool,
    t0: Instant,
) -> Progress {
    Progress {
        round,
        pages_sent: report.pages(),
        pages_remaining: owed,
        dirtied,
        bandwidth: report.bandwidth(),
        expected_downtime: expected_transfer(report, owed),
        throttle,
        vcpu_throttle_permille,
        paused,
        elapsed: t0.elapsed(),
    }
}
