//! A round's pages, sent in batches inside a window of unacknowledged ones; the owed-page
//! bookkeeping that acknowledgements settle; dirty-limit's periodic tick.

use super::cache::DeltaCache;
use super::conn::{unexpected, Conn, MAX_INFLIGHT};
use super::{DirtyLimitReport, Event, RoundReport, RoundSet};
use crate::dirty_limit::{DirtyLimiter, RingCounts};
use crate::error::{GuestError, MigrateError, ProtocolError, StreamError};
use crate::guest::{Guest, Memory};
use crate::link::Faults;
use crate::stream::{BatchBuilder, Msg};
use crate::verify::{self, Digests};
use slat_addr::PageIndex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// Sends rounds of pages in batches and settles their acknowledgements.
pub(super) struct Sender {
    pub(super) builder: BatchBuilder,
    pub(super) seq: u64,
    pub(super) batch: usize,
    pub(super) faults: Faults,
    /// Memory index of each dirty-log slot's first page.
    pub(super) starts: Vec<u64>,
    /// Read-only pages still owed, as (first, count) runs: sent with the next round.
    pub(super) ro: Vec<(u64, u64)>,
    /// Per page, the digest of what was last sent (empty: verification reads memory).
    pub(super) digests: Digests,
    /// When the attempt connected.
    pub(super) t0: Instant,
    /// Dirty-limit, when on.
    pub(super) limit: Option<Limit>,
    /// Pages dirty-limit's collects moved to the pages owed during the last round: dirtied
    /// while it ran, so counted with the next take's.
    pub(super) collected: u64,
    /// Copies of the pages sent, when they go as deltas.
    pub(super) cache: Option<DeltaCache>,
}

/// Dirty-limit's controller and what it reads and drives.
pub(super) struct Limit {
    pub(super) l: DirtyLimiter,
    pub(super) counts: Arc<RingCounts>,
    pub(super) guest: Arc<dyn Guest>,
    /// When the rings were last collected for the meter.
    pub(super) last_collect: Instant,
}

/// How often dirty-limit's meter collects the rings during a round. A page counts once per
/// window between two collects; a guest sweeping its memory faster than once a window would
/// be under-counted, and at 10 ms the window is short against the 1 s period (and against the
/// sweep of a guest held near its limit), so the count is what the guest writes. The check
/// runs between batches, so over a link slower than a batch (1 MiB) per 10 ms the windows
/// are a batch's time instead.
pub(super) const METER_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

impl Limit {
    /// What dirty-limit did in this attempt.
    pub(super) fn report(&self) -> DirtyLimitReport {
        DirtyLimitReport {
            limit: self.l.config().limit,
            period: self.l.config().period,
            periods: self.l.periods,
            max_permille: self.l.max_permille.clone(),
            last_permille: self.l.throttles(),
            last_rates: self.l.rates.clone(),
        }
    }
}

/// What a round is, for [`Sender::round_striped`].
pub(super) struct RoundSpec {
    pub(super) throttle: u32,
    pub(super) round: u32,
    pub(super) stop_and_copy: bool,
    pub(super) resync: Option<std::time::Duration>,
}

impl Sender {
    /// The pages of a round: those of `owed`, then the read-only pages still owed.
    pub(super) fn todo(&self, owed: &RoundSet<'_>) -> Vec<Page> {
        let mut todo = pages_of(owed, &self.starts);
        for &(first, n) in &self.ro {
            todo.extend((first..first + n).map(|p| (NO_SLOT, 0, p)));
        }
        todo
    }

    /// Read-only pages still owed.
    pub(super) fn ro_pages(&self) -> u64 {
        self.ro.iter().map(|r| r.1).sum()
    }

    /// Dirty-limit's per-vCPU throttles now (empty when it is off).
    pub(super) fn vcpu_throttles(&self) -> Vec<u32> {
        self.limit.as_ref().map_or(Vec::new(), |x| x.l.throttles())
    }

    /// Every [`METER_INTERVAL`] while a round's `set` is out: collects the rings into the
    /// pages owed for the next round (nothing is lost to the migration), so the meter counts
    /// what the guest dirties, not distinct pages per period. Once a period: lets the limiter
    /// set each vCPU's throttle from the counts.
    pub(super) fn tick_limit(
        &mut self,
        set: Option<&mut RoundSet<'_>>,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(), MigrateError> {
        let Some(x) = &mut self.limit else {
            return Ok(());
        };
        let now = Instant::now();
        let due = x.l.due(now);
        if let Some(set) = set {
            if due || now.duration_since(x.last_collect) >= METER_INTERVAL {
                self.collected += set.collect()?;
                x.last_collect = now;
            }
        }
        if !due {
            return Ok(());
        }
        let counts = x.counts.per_vcpu();
        if let Some(th) = x.l.update(&counts, Instant::now()) {
            for (i, &t) in th.iter().enumerate() {
                x.guest.set_vcpu_throttle_ppm(i, t);
            }
            progress(Event::DirtyLimit {
                limit: x.l.config().limit,
                rates: &x.l.rates,
                throttles: &x.l.throttles(),
            });
        }
        Ok(())
    }

    /// Builds the batch of `chunk`'s pages (each read from guest memory straight into the
    /// frame), recording each page's digest; returns the batch's zero pages. Over a one-way
    /// channel (or with the merge-back fault) a page leaves `owed` here, as no
    /// acknowledgement will come.
    fn fill_batch(
        &mut self,
        mem: &Memory<'_>,
        owed: &mut RoundSet<'_>,
        chunk: &[Page],
        round: u32,
        one_way: bool,
    ) -> Result<u64, MigrateError> {
        self.builder.start(self.seq, round);
        for &(slot, off, p) in chunk {
            let digests = &mut self.digests;
            let fill = |out: &mut [u8]| mem.read_page_zero(PageIndex::new(p), out);
            let seen = |page: &[u8], zero| {
                if !digests.is_empty() {
                    digests.set(p, verify::page_digest_known(page, zero));
                }
            };
            match &mut self.cache {
                Some(c) => self.builder.push_cached(PageIndex::new(p), fill, seen, c)?,
                None => self.builder.push_with(PageIndex::new(p), fill, seen)?,
            }
            if slot == NO_SLOT {
                continue;
            }
            if self.faults.skip_merge_back || one_way {
                // The bug under test: the page counts as delivered once it is queued.
                owed.commit_pages(slot, PageIndex::new(off), 1)
                    .map_err(GuestError::harvest)?;
            }
        }
        Ok(self.builder.zero as u64)
    }

    /// Sends the pages of `owed`; returns when the destination acknowledged all it sent
    /// (each acknowledged page has left the set).
    ///
    /// With `resync` (a pre-copy round after the first, no read-only pages owed) the round
    /// ends early, as QEMU's iteration does, once the pages it has still to send could go
    /// within `resync` at the rate this round measures: the rest stay in the set (the caller
    /// aborts it, so they are owed again) and the next harvest and switch-over decision come
    /// now rather than after pages that the guest will have re-dirtied by then.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn round(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        throttle: u32,
        owed: &mut RoundSet<'_>,
        round: u32,
        stop_and_copy: bool,
        resync: Option<std::time::Duration>,
        phase: &str,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<RoundReport, MigrateError> {
        let t0 = Instant::now();
        if !conn.streams.is_empty() {
            let spec = RoundSpec {
                throttle,
                round,
                stop_and_copy,
                resync,
            };
            return self.round_striped(conn, mem, owed, spec, phase, progress);
        }
        let bytes0 = conn.link.written();
        let todo = self.todo(owed);
        let mut inflight: VecDeque<(u64, Vec<Page>)> = VecDeque::new();
        let (mut zero, mut delta) = (0u64, 0u64);
        let resync = resync.filter(|_| self.ro.is_empty() && !stop_and_copy);
        let mut sent = 0usize;
        for chunk in todo.chunks(self.batch) {
            if let Some(d) = resync {
                if resync_now(t0, sent, todo.len() - sent, d) {
                    break;
                }
            }
            sent += chunk.len();
            // A window of batches in flight: the destination's acknowledgements (and so the
            // reader's bounded inbox) never run more than this far behind.
            while inflight.len() >= MAX_INFLIGHT {
                let m = conn.recv(phase)?;
                settle(m, &mut inflight, owed, phase)?;
            }
            zero += self.fill_batch(mem, owed, chunk, round, conn.one_way())?;
            delta += self.builder.delta as u64;
            conn.send_raw(self.builder.frame(), phase)?;
            if !conn.one_way() {
                inflight.push_back((self.seq, chunk.to_vec()));
            }
            self.seq += 1;
            while let Some(m) = conn.try_recv(phase)? {
                settle(m, &mut inflight, owed, phase)?;
            }
            if !stop_and_copy {
                self.tick_limit(Some(owed), progress)?;
            }
        }
        conn.send(
            &Msg::RoundEnd {
                round,
                pages: sent as u64,
            },
            phase,
        )?;
        while !inflight.is_empty() {
            let m = conn.recv(phase)?;
            settle(m, &mut inflight, owed, phase)?;
        }
        // Every read-only page went out with this round and is acknowledged (or written).
        self.ro.clear();
        Ok(RoundReport {
            round,
            pages: sent as u64,
            zero_pages: zero,
            delta_pages: delta,
            bytes: conn.link.written() - bytes0,
            time: t0.elapsed(),
            dirtied: 0,
            throttle,
            stop_and_copy,
        })
    }
}

/// Whether a round that began at `t0` and has sent `sent` pages ends now, `left` pages
/// before its end: they could be sent within `limit` at the round's rate so far. Only after
/// [`RESYNC_MIN_TIME`], so the rate is the link's and not the socket buffer's.
pub(super) fn resync_now(
    t0: Instant,
    sent: usize,
    left: usize,
    limit: std::time::Duration,
) -> bool {
    let spent = t0.elapsed();
    if spent < RESYNC_MIN_TIME {
        return false;
    }
    let rate = sent as f64 / spent.as_secs_f64();
    (left as f64) < rate * limit.as_secs_f64()
}

/// How long a round sends before it may end early: QEMU's bandwidth period
/// (`BUFFER_DELAY`, 100 ms). Over a few milliseconds the rate is what the socket buffers
/// swallowed, well above what the link sustains.
const RESYNC_MIN_TIME: std::time::Duration = std::time::Duration::from_millis(100);

/// A page of a round: (slot index in the harvester, page in the slot, memory index); a
/// read-only page has the slot [`NO_SLOT`].
pub(super) type Page = (usize, u64, u64);

/// The slot of a page without a dirty log (a read-only region's).
pub(super) const NO_SLOT: usize = usize::MAX;

/// The pages of `set`, in memory-index order (`starts`: each slot's first memory index,
/// checked against the map by [`crate::MemoryMap::log_starts`]).
pub(super) fn pages_of(set: &RoundSet<'_>, starts: &[u64]) -> Vec<Page> {
    let mut out = Vec::with_capacity(usize::try_from(set.pages()).unwrap_or(0));
    for (i, &start) in starts.iter().enumerate().take(set.slot_info().len()) {
        for (first, n) in set.ranges(i) {
            out.extend((first..first + n).map(|p| (i, p, start + p)));
        }
    }
    out
}

/// Applies an acknowledgement: the pages of the oldest batch in flight have landed, and leave
/// the set (a later abort does not owe them again).
pub(super) fn settle(
    m: Msg,
    inflight: &mut VecDeque<(u64, Vec<Page>)>,
    owed: &mut RoundSet<'_>,
    phase: &str,
) -> Result<(), MigrateError> {
    let Msg::Ack { seq } = m else {
        return Err(unexpected(phase, &m));
    };
    match inflight.pop_front() {
        Some((s, pages)) if s == seq => commit_acked(&pages, owed),
        _ => Err(MigrateError::stream(
            phase,
            StreamError::Protocol(ProtocolError::AckOrder { seq }),
        )),
    }
}

/// The pages of an acknowledged batch leave the set (a later abort does not owe them again),
/// in runs of consecutive pages of one slot: one bitmap update per run.
pub(super) fn commit_acked(pages: &[Page], owed: &mut RoundSet<'_>) -> Result<(), MigrateError> {
    let mut run: Option<(usize, u64, u64)> = None;
    for &(slot, off, _) in pages.iter().filter(|p| p.0 != NO_SLOT) {
        match &mut run {
            Some((s, first, n)) if *s == slot && *first + *n == off => *n += 1,
            _ => {
                if let Some((s, first, n)) = run.replace((slot, off, 1)) {
                    owed.commit_pages(s, PageIndex::new(first), n)
                        .map_err(GuestError::harvest)?;
                }
            }
        }
    }
    if let Some((s, first, n)) = run {
        owed.commit_pages(s, PageIndex::new(first), n)
            .map_err(GuestError::harvest)?;
    }
    Ok(())
}
