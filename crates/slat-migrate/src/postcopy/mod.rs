//! Post-copy: the switch to running the guest on the destination before all its memory has
//! arrived, what both ends share for it, and its figures.
//!
//! At the switch the source pauses the guest, takes the last harvest and sends the set of
//! pages the destination does not hold (or holds stale) as discard runs, then the device
//! state and the run. The destination discards those pages, registers guest memory with a
//! userfaultfd (`uffd.rs`) and runs the guest: a vCPU that touches a missing page waits in the
//! kernel while the demand pager (`demand.rs`) asks the source for it on the return path. The source
//! sends requested pages on a second connection (the preempt channel) ahead of the
//! background stream, which sends the rest in memory order; a page goes out once, claimed
//! in a page bitmap by whichever channel takes it first. Failure semantics:
//! `docs/design/migration.md`.

pub(crate) mod demand;
pub(crate) mod uffd;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The label of post-copy's page batches ([`crate::stream::Batch::round`]).
pub const POSTCOPY_ROUND: u32 = u32::MAX;

/// When the source switches to post-copy ([`crate::SourceConfig::postcopy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostcopyTrigger {
    /// After this many pre-copy rounds (0: pure post-copy, nothing sent before the switch).
    After(u32),
    /// When pre-copy stops converging: a harvest after round 1 or later finds more than
    /// [`STALL_SHRINK`] of the pages the previous harvest found (the round did not shrink the
    /// remaining set by a fifth), or the rounds run out.
    Stalled,
}

/// A pre-copy round has stalled when the pages remaining after it are more than this share
/// of those remaining before it.
pub const STALL_SHRINK: f64 = 0.8;

/// Why post-copy cannot go on, or how it stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostcopyError {
    /// The destination's guest cannot be filled on demand ([`crate::Guest::demand_paged`]).
    #[error("the {0} guest's memory cannot be filled on demand (post-copy needs private anonymous memory)")]
    NotDemandPaged(String),
    /// Post-copy verifies what crossed the wire; hashing all memory would touch missing pages.
    #[error("post-copy verifies with --verify sent (full verification reads memory the guest may still lack)")]
    NeedsSentVerify,
    /// Post-copy runs on the control connection and one preempt channel, not page streams.
    #[error("post-copy runs over one connection and its preempt channel, not {0} page streams (--connections 1)")]
    WithStreams(u32),
    /// Post-copy needs a second connection and the channel came without a way to open one.
    #[error(
        "post-copy needs a second connection (the preempt channel) and none can be opened: {0}"
    )]
    NoPreempt(String),
    /// A one-way channel (a file) cannot carry post-copy.
    #[error("post-copy needs a two-way channel")]
    OneWay,
    /// The link broke during post-copy: both ends wait; the guest runs on the destination,
    /// whose vCPUs wait for the pages still on the source. A new connection recovers.
    #[error(
        "post-copy paused with {missing} pages still on the source ({why}); reconnect to recover"
    )]
    Paused {
        /// Pages the destination lacks (as far as this side knows).
        missing: u64,
        /// What broke.
        why: String,
    },
    /// The source is gone for good: the guest cannot run on partial memory.
    #[error("the source went away during post-copy with {missing} pages the guest never received: the guest cannot run on partial memory and was stopped")]
    SourceLost {
        /// Pages never received.
        missing: u64,
    },
    /// The destination of a recovery does not hold the session in post-copy.
    #[error("cannot recover post-copy: {0}")]
    Recover(String),
    /// The discard runs do not add up or leave the guest.
    #[error("post-copy discard set: {0}")]
    Discard(String),
    /// Demand paging failed on this host.
    #[error("post-copy demand paging: {0}")]
    Uffd(String),
}

/// Post-copy's figures on the source.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PostcopyReport {
    /// Pre-copy rounds before the switch.
    pub after_rounds: u32,
    /// Why it switched: "rounds" (`After(n)`), "stalled" or "max-rounds".
    pub trigger: &'static str,
    /// Pages the destination lacked at the switch.
    pub discarded: u64,
    /// Pages sent by the background stream.
    pub background_pages: u64,
    /// Pages sent on the preempt channel (requested by the destination).
    pub preempt_pages: u64,
    /// Pages the destination requested (as received, duplicates included).
    pub requested: u64,
    /// Requests for pages already sent (skipped).
    pub requests_already_sent: u64,
    /// Bytes written in post-copy on both channels.
    pub bytes: u64,
    /// From the run to the last page written.
    pub time_to_last_page: Duration,
    /// Connections that recovered a broken post-copy.
    pub recoveries: u32,
}

/// Fault latency ("blocktime") as the destination measured it: from a fault read on the
/// userfaultfd to the page placed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Blocktime {
    /// Faults that waited for a page.
    pub faults: u64,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Longest.
    pub max: Duration,
}

impl Blocktime {
    /// The figures of `samples` (sorted here).
    pub fn of(samples: &mut [Duration]) -> Blocktime {
        samples.sort_unstable();
        let at = |q: f64| {
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(i).copied().unwrap_or_default()
        };
        Blocktime {
            faults: samples.len() as u64,
            p50: at(0.5),
            p99: at(0.99),
            max: samples.last().copied().unwrap_or_default(),
        }
    }
}

/// Post-copy's figures on the destination.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PostcopyDestReport {
    /// Pages discarded at the switch (missing when the guest started).
    pub discarded: u64,
    /// Pages requested from the source.
    pub requested: u64,
    /// Pages placed from the background stream.
    pub background_pages: u64,
    /// Pages placed from the preempt channel.
    pub preempt_pages: u64,
    /// Pages that arrived when the destination already had them (kept as they were).
    pub duplicates: u64,
    /// Fault latency.
    pub blocktime: Blocktime,
    /// From the run to the last missing page placed.
    pub time_to_last_page: Duration,
    /// Connections that recovered a broken post-copy.
    pub recoveries: u32,
}

/// One bit per page (memory index), set and claimed atomically.
#[derive(Debug)]
pub(crate) struct PageBits {
    words: Vec<AtomicU64>,
    pages: u64,
}

impl PageBits {
    /// `pages` bits, all clear.
    pub(crate) fn new(pages: u64) -> PageBits {
        let n = usize::try_from(pages.div_ceil(64)).unwrap_or(0);
        PageBits {
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
            pages,
        }
    }

    /// Sets page `p`'s bit; false if `p` is out of range or was set.
    pub(crate) fn set(&self, p: u64) -> bool {
        match self.words.get((p / 64) as usize) {
            Some(w) if p < self.pages => {
                w.fetch_or(1 << (p % 64), Ordering::AcqRel) & (1 << (p % 64)) == 0
            }
            _ => false,
        }
    }

    /// Clears page `p`'s bit; true if this call cleared it (the caller claimed the page).
    pub(crate) fn claim(&self, p: u64) -> bool {
        match self.words.get((p / 64) as usize) {
            Some(w) if p < self.pages => {
                w.fetch_and(!(1 << (p % 64)), Ordering::AcqRel) & (1 << (p % 64)) != 0
            }
            _ => false,
        }
    }

    /// Whether page `p`'s bit is set.
    pub(crate) fn get(&self, p: u64) -> bool {
        self.words
            .get((p / 64) as usize)
            .is_some_and(|w| p < self.pages && w.load(Ordering::Acquire) & (1 << (p % 64)) != 0)
    }

    /// Bits set.
    pub(crate) fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum()
    }

    /// The first set bit at or after `from`.
    pub(crate) fn next_set(&self, from: u64) -> Option<u64> {
        let mut i = (from / 64) as usize;
        let mut mask = u64::MAX.checked_shl((from % 64) as u32).unwrap_or(0);
        while let Some(w) = self.words.get(i) {
            let v = w.load(Ordering::Acquire) & mask;
            if v != 0 {
                let p = i as u64 * 64 + v.trailing_zeros() as u64;
                return (p < self.pages).then_some(p);
            }
            i += 1;
            mask = u64::MAX;
        }
        None
    }

    /// The set bits as (first, count) runs, at most `max` runs per call from `from`; returns
    /// them and where to go on (`None`: done).
    pub(crate) fn runs(&self, from: u64, max: usize) -> (Vec<(u64, u64)>, Option<u64>) {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut p = from;
        while let Some(a) = self.next_set(p) {
            if out.len() == max {
                return (out, Some(a));
            }
            let mut b = a + 1;
            while b < self.pages && self.get(b) {
                b += 1;
            }
            out.push((a, b - a));
            p = b;
        }
        (out, None)
    }

    /// Sets every page of `runs` (each checked against the size); the pages newly set.
    pub(crate) fn set_runs(&self, runs: &[(u64, u64)]) -> Result<u64, PostcopyError> {
        let mut n = 0;
        for &(a, len) in runs {
            let end = a.checked_add(len).filter(|&e| e <= self.pages && len > 0);
            let Some(end) = end else {
                return Err(PostcopyError::Discard(format!(
                    "run of {len} pages at page {a} outside the guest's {} pages",
                    self.pages
                )));
            };
            n += (a..end).filter(|&p| self.set(p)).count() as u64;
        }
        Ok(n)
    }
}
