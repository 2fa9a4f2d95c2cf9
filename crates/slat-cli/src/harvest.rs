//! The host's harvest of the dirty log, as dirty-log-perf runs it: the rings (collect, then
//! RESET_DIRTY_RINGS), or GET_DIRTY_LOG on every slot followed, under manual protect, by
//! CLEAR_DIRTY_LOG in `--clear-chunk` pages. Each call is timed as it is made, through the
//! machine's [`DirtyLogSource`] (the one dirty-log interface), not a transactional harvest.

use crate::args::ClearChunk;
use crate::backend::{Backend, Spec};
use crate::error::CliResult;
use crate::output::{opt_secs, secs};
use crate::virtual_time::Stopwatch;
use serde::Serialize;
use slat_addr::PageIndex;
use slat_dirty::DirtyLogSource;
use std::time::Duration;

/// What one harvest took.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct HarvestTimes {
    /// GET_DIRTY_LOG over every slot, or collecting the rings.
    #[serde(rename = "get_dirty_log_time_s", serialize_with = "secs")]
    pub get: Duration,
    /// CLEAR_DIRTY_LOG (manual protect, bitmaps).
    #[serde(rename = "clear_dirty_log_time_s", serialize_with = "opt_secs")]
    pub clear: Option<Duration>,
    /// Resetting the dirty rings (with `--dirty-ring`).
    #[serde(rename = "reset_dirty_rings_time_s", serialize_with = "opt_secs")]
    pub reset: Option<Duration>,
    pub dirty_pages: u64,
}

impl HarvestTimes {
    /// The whole harvest: get plus clear or reset.
    pub fn total(&self) -> Duration {
        self.get + self.clear.or(self.reset).unwrap_or_default()
    }
}

/// The harvest buffers: one bitmap per slot.
pub struct Harvest {
    pages_per_slot: u64,
    bitmaps: Vec<Vec<u64>>,
    chunk: ClearChunk,
}

impl Harvest {
    /// Buffers for `m`'s slots; CLEAR in `chunk` pages.
    pub fn new(m: &dyn Backend, chunk: ClearChunk) -> Harvest {
        let pps = m.pages_per_slot();
        let bitmaps = m
            .slot_ids()
            .iter()
            .map(|_| vec![0u64; pps.div_ceil(64) as usize])
            .collect();
        Harvest {
            pages_per_slot: pps,
            bitmaps,
            chunk,
        }
    }

    /// Harvests the log once: the rings, or GET (and CLEAR under manual protect) on every slot.
    pub fn run(&mut self, m: &dyn Backend, spec: &Spec) -> CliResult<HarvestTimes> {
        let mut h = HarvestTimes::default();
        let mut log = m.dirty_log();
        if spec.region.dirty.ring_entries != 0 {
            let t0 = Stopwatch::start();
            h.dirty_pages = log.collect_ring(&mut |_, _| {})?;
            h.get = t0.elapsed();
            let t0 = Stopwatch::start();
            log.reset_rings()?;
            h.reset = Some(t0.elapsed());
            return Ok(h);
        }
        let t0 = Stopwatch::start();
        for (i, b) in self.bitmaps.iter_mut().enumerate() {
            log.get_log(i, b)?;
            h.dirty_pages += b.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        }
        h.get = t0.elapsed();
        if spec.manual_protect() {
            let t0 = Stopwatch::start();
            for (i, b) in self.bitmaps.iter().enumerate() {
                self.clear_slot(&mut *log, i, b)?;
            }
            h.clear = Some(t0.elapsed());
        }
        Ok(h)
    }

    /// CLEAR_DIRTY_LOG of one slot in chunks. Chunks are powers of two of at least 64 pages,
    /// so every call starts on a bitmap word, as KVM requires; a chunk whose bits are all
    /// clear is still issued, as a VMM clearing ahead of its copy does.
    fn clear_slot(
        &self,
        log: &mut dyn DirtyLogSource<Error = String>,
        slot: usize,
        bitmap: &[u64],
    ) -> CliResult {
        let step = self.chunk.pages(self.pages_per_slot);
        let mut first = 0u64;
        while first < self.pages_per_slot {
            let num = step.min(self.pages_per_slot - first);
            // Exactly the chunk's words: KVM's CLEAR reads num/64 words, and the typed API
            // refuses any other length.
            let word = (first / 64) as usize;
            let end = (word + num.div_ceil(64) as usize).min(bitmap.len());
            log.clear_log(
                slot,
                PageIndex::new(first),
                num,
                &bitmap[word.min(end)..end],
            )?;
            first += num;
        }
        Ok(())
    }
}
