//! Dirty-rate measurement without migrating (QEMU's `calc-dirty-rate` / `query-dirty-rate`):
//! how many distinct guest pages the guest dirties per second, overall and per vCPU, read
//! from the dirty log alone.
//!
//! # Why here
//!
//! A VMM decides whether a live migration can converge, or how hard to throttle, from this
//! figure, before it migrates anything; so the sampler is written over [`DirtyLogSource`], the
//! same seam [`crate::Harvester`] uses: a VMM measures its own VM through [`crate::KvmLog`],
//! slat's benchmark machines through `slat_harness::MachineLog`, and the `slat dirty-rate`
//! command only renders what [`DirtyRate`] returns. It does not go through the
//! [`crate::Harvester`]: a measurement copies nothing, so there is nothing to commit or to owe
//! again, and the harvester's ring path folds every vCPU's ring into one set, which loses the
//! vCPU a per-vCPU rate needs ([`DirtyLogSource::collect_ring_by_vcpu`] keeps it).
//!
//! # What is counted
//!
//! **Distinct pages dirtied per window**, as the log reports them: a page written a thousand
//! times in a window counts once, because the log holds one bit (or one ring entry, until the
//! next reset) per page. So a guest rewriting a small hot set has a low dirty rate whatever
//! its store rate — which is what a migration pays for: each window's dirty pages are resent
//! once. A window is the time between two harvests; each harvest re-arms the log (GET that
//! clears; GET + CLEAR of what it returned with manual protect; collect + reset of the rings),
//! so windows follow each other with no gap, and a window's length is measured from the
//! start of one harvest to the start of the next.
//!
//! # Per vCPU
//!
//! - **Ring mode**: each entry names the vCPU whose ring held it. A page is credited to the
//!   vCPU that logged it first in the window; a second entry for it (after a ring-full
//!   reset, or another vCPU's write after one) is not counted again, so the per-vCPU figures
//!   add up to the overall one. Entries the source cannot attribute (reaped into a shared
//!   list on a ring-full exit) are counted as `unattributed`.
//! - **Bitmap modes**: a bitmap does not say who wrote a page. If the caller knows that each
//!   vCPU writes only its own region of guest memory ([`DirtyRate::with_regions`]), the pages
//!   dirtied in region `i` are vCPU `i`'s; otherwise there is no per-vCPU figure.
//!
//! The sampler must be the only reader of the log while it runs (like any harvest: another
//! reader would take bits it never sees) — QEMU likewise refuses `calc-dirty-rate` in its
//! bitmap mode while a migration owns the log.

use crate::error::{try_filled, Error};
use crate::harvest::LogMode;
use crate::source::{DirtyLogSource, SlotInfo};
use slat_addr::PageIndex;
use std::num::NonZeroU32;
use std::ops::Range;
use std::time::{Duration, Instant};

/// The shortest sample window: below it the harvest's own time and the timer's granularity
/// are a large share of the window.
pub const MIN_WINDOW: Duration = Duration::from_millis(10);
/// The longest sample window (QEMU's `calc-time` is at most 60 s too).
pub const MAX_WINDOW: Duration = Duration::from_secs(60);

/// The length of one sample window, within [`MIN_WINDOW`]`..=`[`MAX_WINDOW`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleWindow(Duration);

/// A sample window [`SampleWindow::from_millis`] refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a sample window of {ms} ms: it must be {} to {} ms",
    MIN_WINDOW.as_millis(),
    MAX_WINDOW.as_millis()
)]
pub struct WindowError {
    /// The length asked for.
    pub ms: u64,
}

impl SampleWindow {
    /// A window of `ms` milliseconds; refused outside [`MIN_WINDOW`]`..=`[`MAX_WINDOW`].
    pub fn from_millis(ms: u64) -> Result<SampleWindow, WindowError> {
        let d = Duration::from_millis(ms);
        if d < MIN_WINDOW || d > MAX_WINDOW {
            return Err(WindowError { ms });
        }
        Ok(SampleWindow(d))
    }

    /// The window's length.
    pub fn duration(self) -> Duration {
        self.0
    }
}

/// Where the per-vCPU figures of a [`Sample`] come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attribution {
    /// Each ring entry names its vCPU.
    Ring,
    /// Each vCPU writes only its own region ([`DirtyRate::with_regions`]).
    Regions,
    /// No per-vCPU figures: a bitmap without regions.
    None,
}

/// One window's measurement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// From the start of the previous harvest to the start of this one.
    pub window: Duration,
    /// Distinct pages dirtied in the window.
    pub pages: u64,
    /// Distinct pages per vCPU (empty without [`Attribution`]); they add up to `pages` less
    /// `unattributed`.
    pub per_vcpu: Vec<u64>,
    /// Pages no vCPU could be credited with: ring entries without a vCPU, or bitmap pages
    /// outside every region.
    pub unattributed: u64,
    /// Ring entries for slots the source does not track, or past their end (not counted).
    pub foreign: u64,
}

/// `pages` over `window`, per second (0 for an empty window).
fn per_second(pages: u64, window: Duration) -> f64 {
    let s = window.as_secs_f64();
    if s > 0.0 {
        pages as f64 / s
    } else {
        0.0
    }
}

impl Sample {
    /// Distinct pages dirtied per second in the window.
    pub fn pages_per_s(&self) -> f64 {
        per_second(self.pages, self.window)
    }

    /// vCPU `i`'s distinct pages per second (`None` without a figure for it).
    pub fn vcpu_pages_per_s(&self, i: usize) -> Option<f64> {
        self.per_vcpu.get(i).map(|&p| per_second(p, self.window))
    }
}

/// Several back-to-back windows ([`DirtyRate::measure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measurement {
    /// How the per-vCPU figures were obtained.
    pub attribution: Attribution,
    /// The windows, in order.
    pub samples: Vec<Sample>,
}

impl Measurement {
    /// The time measured: the windows' sum, saturated at [`Duration::MAX`] (the fields are
    /// public, so a caller's windows may add up to more).
    pub fn time(&self) -> Duration {
        self.samples
            .iter()
            .fold(Duration::ZERO, |t, s| t.saturating_add(s.window))
    }

    /// Distinct pages, summed over the windows (a page dirtied in two windows counts twice,
    /// as a migration would send it twice); saturated at `u64::MAX`.
    pub fn pages(&self) -> u64 {
        saturating_sum(self.samples.iter().map(|s| s.pages))
    }

    /// The dirty rate over the whole measurement: [`Self::pages`] over [`Self::time`].
    pub fn pages_per_s(&self) -> f64 {
        per_second(self.pages(), self.time())
    }

    /// Each vCPU's rate over the whole measurement (empty without per-vCPU figures).
    pub fn vcpu_pages_per_s(&self) -> Vec<f64> {
        let n = self
            .samples
            .iter()
            .map(|s| s.per_vcpu.len())
            .max()
            .unwrap_or(0);
        let t = self.time();
        (0..n)
            .map(|i| {
                let p = saturating_sum(
                    self.samples
                        .iter()
                        .map(|s| s.per_vcpu.get(i).copied().unwrap_or(0)),
                );
                per_second(p, t)
            })
            .collect()
    }

    /// Pages no vCPU was credited with, summed over the windows (saturated at `u64::MAX`).
    pub fn unattributed(&self) -> u64 {
        saturating_sum(self.samples.iter().map(|s| s.unattributed))
    }
}

/// The sum of `v`, saturated at `u64::MAX`: the figures may be a caller's.
fn saturating_sum(v: impl Iterator<Item = u64>) -> u64 {
    v.fold(0, u64::saturating_add)
}

/// Samples the dirty rate of everything a [`DirtyLogSource`] tracks; see the
/// [module](self) documentation.
#[derive(Debug)]
pub struct DirtyRate<S: DirtyLogSource> {
    source: S,
    slots: Vec<SlotInfo>,
    /// Slot ids with their index, sorted by id: ring entries name slots by id.
    by_id: Vec<(u32, usize)>,
    /// First page of each slot in the pages of all slots, in slot order.
    base: Vec<u64>,
    mode: LogMode,
    /// Per slot: the GET buffer (bitmap modes) or the pages seen this window (ring).
    bits: Vec<Vec<u64>>,
    /// Bitmap modes: vCPU `i` writes pages `regions[i]` (numbered as `base`).
    regions: Vec<Range<u64>>,
    /// Ring mode: vCPUs the per-vCPU figures cover at least.
    vcpus: usize,
    /// Start of the last harvest, if a window is open.
    last: Option<Instant>,
}

/// A zeroed bitmap of `pages` pages, or a typed error if this host cannot hold it.
fn bitmap(slot: &SlotInfo) -> Result<Vec<u64>, Error> {
    let words = usize::try_from(slot.pages.div_ceil(64))
        .map_err(|_| Error::Harvest(format!("slot {} is too large for this host", slot.id)))?;
    try_filled(words, 0, || {
        format!(
            "the dirty bitmap of slot {} ({} pages)",
            slot.id, slot.pages
        )
    })
}

/// Set bits of `words` among bits `from..to`.
fn count_bits(words: &[u64], from: u64, to: u64) -> u64 {
    let mut n = 0u64;
    let mut b = from;
    while b < to {
        let w = (b / 64) as usize;
        let lo = b % 64;
        let hi = (to - (b - lo)).min(64);
        let mask = if hi - lo == 64 {
            u64::MAX
        } else {
            ((1u64 << (hi - lo)) - 1) << lo
        };
        n += u64::from((words.get(w).copied().unwrap_or(0) & mask).count_ones());
        b = b - lo + hi;
    }
    n
}

/// vCPU indexes above this are not attributed (KVM's `KVM_MAX_VCPUS` on x86 is 4096).
pub const MAX_VCPUS: usize = 4096;

impl<S: DirtyLogSource> DirtyRate<S> {
    /// A sampler of everything `source` tracks, in its mode. Refused: no slot, a slot id
    /// twice, a bad CLEAR chunk, slots whose pages overflow or do not fit this host.
    pub fn new(source: S) -> Result<Self, Error> {
        let slots = source.slots();
        let mode = source.mode();
        if slots.is_empty() {
            return Err(Error::Harvest("no memslot to measure".into()));
        }
        if let LogMode::ManualProtect { chunk_pages } = mode {
            if chunk_pages == 0 || chunk_pages % 64 != 0 {
                return Err(Error::Harvest(format!(
                    "a CLEAR chunk of {chunk_pages} pages: it must be a non-zero multiple of 64"
                )));
            }
        }
        let mut by_id: Vec<(u32, usize)> =
            slots.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        by_id.sort_unstable();
        if let Some(w) = by_id.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::Harvest(format!("slot {} given twice", w[0].0)));
        }
        let mut base = Vec::with_capacity(slots.len());
        let mut total = 0u64;
        for s in &slots {
            base.push(total);
            total = total
                .checked_add(s.pages)
                .ok_or_else(|| Error::Harvest("the slots' pages overflow 64 bits".into()))?;
        }
        let bits = slots.iter().map(bitmap).collect::<Result<Vec<_>, _>>()?;
        Ok(DirtyRate {
            source,
            slots,
            by_id,
            base,
            mode,
            bits,
            regions: Vec::new(),
            vcpus: 0,
            last: None,
        })
    }

    /// Bitmap modes: vCPU `i` writes only pages `regions[i]` (numbering every tracked page
    /// in slot order: slot 0's pages first), so the pages dirtied there are its own. Refused:
    /// in the ring mode (entries name their vCPU), a region past the last page, regions that
    /// overlap (a page would be credited twice).
    pub fn with_regions(mut self, regions: Vec<Range<u64>>) -> Result<Self, Error> {
        if self.mode == LogMode::Ring {
            return Err(Error::Harvest(
                "per-vCPU regions are for bitmaps: ring entries name their vCPU".into(),
            ));
        }
        let total = self.total_pages();
        if let Some(r) = regions.iter().find(|r| r.start > r.end || r.end > total) {
            return Err(Error::Harvest(format!(
                "region {}..{} is not inside the {total} pages tracked",
                r.start, r.end
            )));
        }
        let mut sorted = regions.clone();
        sorted.sort_unstable_by_key(|r| r.start);
        if sorted.windows(2).any(|w| w[0].end > w[1].start) {
            return Err(Error::Harvest(
                "per-vCPU regions overlap: no vCPU owns the shared pages".into(),
            ));
        }
        self.regions = regions;
        Ok(self)
    }

    /// Ring mode: report at least `n` vCPUs, so one that dirtied nothing still has a figure
    /// (0). More appear if entries name them.
    /// At most [`MAX_VCPUS`]: a larger count is clamped.
    pub fn with_vcpus(mut self, n: usize) -> Self {
        self.vcpus = n.min(MAX_VCPUS);
        self
    }

    /// How the per-vCPU figures are obtained.
    pub fn attribution(&self) -> Attribution {
        match self.mode {
            LogMode::Ring => Attribution::Ring,
            _ if !self.regions.is_empty() => Attribution::Regions,
            _ => Attribution::None,
        }
    }

    /// Pages tracked (all slots).
    pub fn total_pages(&self) -> u64 {
        // Checked in `new`: the sum does not overflow (saturating all the same).
        saturating_sum(self.slots.iter().map(|s| s.pages))
    }

    /// The source (for what it reports about itself).
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Gives the source back.
    pub fn into_source(self) -> S {
        self.source
    }

    /// Opens a window: harvests and re-arms the log, discarding what it held (pages dirtied
    /// before now are not this window's).
    pub fn start(&mut self) -> Result<(), S::Error> {
        self.last = None;
        let t = Instant::now();
        self.harvest()?;
        self.last = Some(t);
        Ok(())
    }

    /// Closes the open window and opens the next: harvests and re-arms the log and returns
    /// the window's [`Sample`]. `None` if no window was open (never started, or the last
    /// harvest failed): the window starts now.
    pub fn sample(&mut self) -> Result<Option<Sample>, S::Error> {
        let prev = self.last.take();
        let t = Instant::now();
        let s = self.harvest()?;
        self.last = Some(t);
        Ok(prev.map(|p| Sample {
            window: t.duration_since(p),
            ..s
        }))
    }

    /// Opens a window, then takes `samples` windows of at least `window` each, calling
    /// `on_sample` with each as it completes (progress). Each window ends `window` after the
    /// start of the harvest that opened it, so the harvest's own time is inside the window
    /// (the guest keeps writing through it); a harvest longer than `window` makes its window
    /// longer, never one of almost no time.
    pub fn measure(
        &mut self,
        window: SampleWindow,
        samples: NonZeroU32,
        mut on_sample: impl FnMut(usize, &Sample),
    ) -> Result<Measurement, S::Error> {
        self.start()?;
        // Grown as windows complete: the count is the caller's, and each window takes real
        // time, so only a bounded start is reserved.
        let mut out = Vec::with_capacity(samples.get().min(1024) as usize);
        for _ in 0..samples.get() {
            let opened = self.last.unwrap_or_else(Instant::now);
            let now = Instant::now();
            if let Some(rest) = (opened + window.duration()).checked_duration_since(now) {
                std::thread::sleep(rest);
            }
            if let Some(s) = self.sample()? {
                on_sample(out.len(), &s);
                out.push(s);
            }
        }
        Ok(Measurement {
            attribution: self.attribution(),
            samples: out,
        })
    }

    /// One harvest: counts and re-arms. The window is filled in by the caller.
    fn harvest(&mut self) -> Result<Sample, S::Error> {
        match self.mode {
            LogMode::Ring => self.harvest_rings(),
            LogMode::Get => self.harvest_bitmaps(None),
            LogMode::ManualProtect { chunk_pages } => self.harvest_bitmaps(Some(chunk_pages)),
        }
    }

    fn harvest_bitmaps(&mut self, clear: Option<u64>) -> Result<Sample, S::Error> {
        let mut pages = 0;
        for (i, (s, got)) in self.slots.iter().zip(&mut self.bits).enumerate() {
            got.fill(0);
            self.source.get_log(i, got)?;
            if let Some(chunk) = clear {
                // Re-protect exactly what GET returned, chunk by chunk, skipping clean chunks.
                let mut first = 0u64;
                while first < s.pages {
                    let n = chunk.min(s.pages - first);
                    let (w0, w1) = ((first / 64) as usize, (first + n).div_ceil(64) as usize);
                    let words = &got[w0..w1];
                    if words.iter().any(|&w| w != 0) {
                        self.source.clear_log(i, PageIndex::new(first), n, words)?;
                    }
                    first += n;
                }
            }
            pages += count_bits(got, 0, s.pages);
        }
        let mut per_vcpu = Vec::with_capacity(self.regions.len());
        for r in &self.regions {
            let mut n = 0;
            for ((s, got), &b) in self.slots.iter().zip(&self.bits).zip(&self.base) {
                let (lo, hi) = (r.start.max(b), r.end.min(b + s.pages));
                if lo < hi {
                    n += count_bits(got, lo - b, hi - b);
                }
            }
            per_vcpu.push(n);
        }
        let credited = saturating_sum(per_vcpu.iter().copied());
        Ok(Sample {
            window: Duration::ZERO,
            pages,
            unattributed: if per_vcpu.is_empty() {
                0
            } else {
                pages.saturating_sub(credited)
            },
            per_vcpu,
            foreign: 0,
        })
    }

    fn harvest_rings(&mut self) -> Result<Sample, S::Error> {
        let Self {
            source,
            slots,
            by_id,
            bits,
            vcpus,
            ..
        } = self;
        for b in bits.iter_mut() {
            b.fill(0);
        }
        let mut per_vcpu = vec![0u64; *vcpus];
        let (mut pages, mut unattributed, mut foreign) = (0u64, 0u64, 0u64);
        let r = source.collect_ring_by_vcpu(&mut |vcpu, id, offset| {
            let offset = offset.raw();
            let slot = by_id
                .binary_search_by_key(&id, |&(id, _)| id)
                .ok()
                .map(|k| by_id[k].1)
                .filter(|&i| offset < slots[i].pages);
            let Some(i) = slot else {
                foreign += 1;
                return;
            };
            let (w, bit) = ((offset / 64) as usize, 1u64 << (offset % 64));
            if bits[i][w] & bit != 0 {
                return; // already counted this window
            }
            bits[i][w] |= bit;
            pages += 1;
            match vcpu {
                // An index no KVM VM can have (a source's bug) is not trusted with an
                // allocation: its pages count, unattributed.
                Some(v) if v >= MAX_VCPUS => unattributed += 1,
                Some(v) => {
                    if v >= per_vcpu.len() {
                        per_vcpu.resize(v + 1, 0);
                    }
                    per_vcpu[v] += 1;
                }
                None => unattributed += 1,
            }
        });
        r?;
        source.reset_rings()?;
        Ok(Sample {
            window: Duration::ZERO,
            pages,
            per_vcpu,
            unattributed,
            foreign,
        })
    }
}

// One region per vCPU is exactly a one-element `Vec<Range>` here.
#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A log the test writes into: per slot the dirty pages, and ring entries.
    #[derive(Debug)]
    struct Fake {
        slots: Vec<SlotInfo>,
        mode: LogMode,
        dirty: Vec<BTreeSet<u64>>,
        ring: Vec<(Option<usize>, u32, u64)>,
        clears: Vec<(usize, u64, u64)>,
        resets: u32,
    }

    impl Fake {
        fn new(mode: LogMode, pages: &[u64]) -> Fake {
            Fake {
                slots: pages
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| SlotInfo {
                        id: 10 + i as u32,
                        pages: p,
                    })
                    .collect(),
                mode,
                dirty: vec![BTreeSet::new(); pages.len()],
                ring: Vec::new(),
                clears: Vec::new(),
                resets: 0,
            }
        }
    }

    impl DirtyLogSource for Fake {
        type Error = String;
        fn slots(&self) -> Vec<SlotInfo> {
            self.slots.clone()
        }
        fn mode(&self) -> LogMode {
            self.mode
        }
        fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), String> {
            for &p in &self.dirty[slot] {
                bitmap[(p / 64) as usize] |= 1 << (p % 64);
            }
            if self.mode == LogMode::Get {
                self.dirty[slot].clear();
            }
            Ok(())
        }
        fn clear_log(
            &mut self,
            slot: usize,
            first: PageIndex,
            n: u64,
            bm: &[u64],
        ) -> Result<(), String> {
            let first = first.raw();
            assert_eq!(bm.len() as u64, n.div_ceil(64));
            for p in first..first + n {
                let q = p - first;
                if bm[(q / 64) as usize] & (1 << (q % 64)) != 0 {
                    self.dirty[slot].remove(&p);
                }
            }
            self.clears.push((slot, first, n));
            Ok(())
        }
        fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, String> {
            self.collect_ring_by_vcpu(&mut |_, s, o| f(s, o))
        }
        fn collect_ring_by_vcpu(
            &mut self,
            f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
        ) -> Result<u64, String> {
            let n = self.ring.len() as u64;
            for (v, s, o) in self.ring.drain(..) {
                f(v, s, PageIndex::new(o));
            }
            Ok(n)
        }
        fn reset_rings(&mut self) -> Result<u64, String> {
            self.resets += 1;
            Ok(0)
        }
    }

    fn dirty(r: &mut DirtyRate<Fake>, slot: usize, pages: impl IntoIterator<Item = u64>) {
        r.source.dirty[slot].extend(pages);
    }

    #[test]
    fn windows_are_bounded() {
        assert!(SampleWindow::from_millis(0).is_err());
        assert!(SampleWindow::from_millis(9).is_err());
        assert!(SampleWindow::from_millis(60_001).is_err());
        assert!(SampleWindow::from_millis(u64::MAX).is_err());
        let w = SampleWindow::from_millis(1000).unwrap();
        assert_eq!(w.duration(), Duration::from_secs(1));
    }

    #[test]
    fn count_bits_counts_partial_words() {
        let w = [u64::MAX, 0b1011, u64::MAX];
        assert_eq!(count_bits(&w, 0, 192), 64 + 3 + 64);
        assert_eq!(count_bits(&w, 3, 64), 61);
        assert_eq!(count_bits(&w, 64, 66), 2);
        assert_eq!(count_bits(&w, 65, 130), 2 + 2);
        assert_eq!(count_bits(&w, 70, 70), 0);
    }

    #[test]
    fn start_discards_what_was_dirtied_before() {
        let mut r = DirtyRate::new(Fake::new(LogMode::Get, &[100])).unwrap();
        dirty(&mut r, 0, 0..50);
        assert_eq!(r.sample().unwrap(), None, "no window was open");
        dirty(&mut r, 0, 0..50);
        r.start().unwrap();
        dirty(&mut r, 0, [3, 4, 5, 99]);
        let s = r.sample().unwrap().unwrap();
        assert_eq!((s.pages, s.unattributed, s.foreign), (4, 0, 0));
        assert!(s.per_vcpu.is_empty());
        assert_eq!(r.attribution(), Attribution::None);
    }

    #[test]
    fn manual_protect_clears_exactly_what_get_returned_in_chunks() {
        let mode = LogMode::ManualProtect { chunk_pages: 64 };
        let mut r = DirtyRate::new(Fake::new(mode, &[200])).unwrap();
        r.start().unwrap();
        dirty(&mut r, 0, [1, 130, 199]);
        let s = r.sample().unwrap().unwrap();
        assert_eq!(s.pages, 3);
        // Chunks 0..64, 128..192 and the short last one 192..200; 64..128 was clean.
        assert_eq!(r.source.clears, vec![(0, 0, 64), (0, 128, 64), (0, 192, 8)]);
        assert!(r.source.dirty[0].is_empty());
        let s = r.sample().unwrap().unwrap();
        assert_eq!(s.pages, 0, "the CLEAR re-armed every page");
    }

    #[test]
    fn regions_credit_their_vcpu_across_slots() {
        let mut r = DirtyRate::new(Fake::new(LogMode::Get, &[100, 100]))
            .unwrap()
            .with_regions(vec![0..100, 100..150])
            .unwrap();
        assert_eq!(r.attribution(), Attribution::Regions);
        r.start().unwrap();
        dirty(&mut r, 0, [0, 99]);
        dirty(&mut r, 1, [0, 49, 50, 99]);
        let s = r.sample().unwrap().unwrap();
        assert_eq!(s.pages, 6);
        assert_eq!(s.per_vcpu, vec![2, 2]);
        assert_eq!(s.unattributed, 2, "pages 150 and 199 are in no region");
    }

    #[test]
    fn bad_regions_are_refused() {
        let f = || DirtyRate::new(Fake::new(LogMode::Get, &[100])).unwrap();
        assert!(f().with_regions(vec![0..101]).is_err());
        assert!(f().with_regions(vec![0..60, 50..100]).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = vec![60..50];
        assert!(f().with_regions(backwards).is_err());
        let ring = DirtyRate::new(Fake::new(LogMode::Ring, &[100])).unwrap();
        assert!(ring.with_regions(vec![0..50]).is_err());
    }

    #[test]
    fn bad_sources_are_refused() {
        assert!(DirtyRate::new(Fake::new(LogMode::Get, &[])).is_err());
        let mut f = Fake::new(LogMode::Get, &[1, 1]);
        f.slots[1].id = f.slots[0].id;
        assert!(DirtyRate::new(f).is_err());
        let f = Fake::new(LogMode::ManualProtect { chunk_pages: 100 }, &[1]);
        assert!(DirtyRate::new(f).is_err());
        assert!(DirtyRate::new(Fake::new(LogMode::Get, &[u64::MAX, 2])).is_err());
    }

    #[test]
    fn ring_counts_distinct_pages_and_credits_the_first_vcpu() {
        let mut r = DirtyRate::new(Fake::new(LogMode::Ring, &[100, 100]))
            .unwrap()
            .with_vcpus(3);
        r.start().unwrap();
        r.source.ring = vec![
            (Some(0), 10, 5),
            (Some(0), 10, 6),
            (Some(1), 10, 5), // again, after a reset: not counted twice
            (Some(1), 11, 5), // same offset, other slot: another page
            (None, 11, 7),
            (Some(4), 11, 8),
            (Some(0), 12, 1),   // a slot not tracked
            (Some(0), 10, 100), // past the slot's end
        ];
        let s = r.sample().unwrap().unwrap();
        assert_eq!(s.pages, 5);
        assert_eq!(s.per_vcpu, vec![2, 1, 0, 0, 1]);
        assert_eq!((s.unattributed, s.foreign), (1, 2));
        assert_eq!(r.source.resets, 2, "start and sample each reset");
        // The next window starts empty: page 5 counts again.
        r.source.ring = vec![(Some(2), 10, 5)];
        let s = r.sample().unwrap().unwrap();
        assert_eq!((s.pages, s.per_vcpu.clone()), (1, vec![0, 0, 1]));
        // A source naming an impossible vCPU: counted, unattributed, no huge allocation.
        r.source.ring = vec![(Some(usize::MAX), 10, 1), (Some(1 << 40), 11, 2)];
        let s = r.sample().unwrap().unwrap();
        assert_eq!((s.pages, s.unattributed, s.per_vcpu.len()), (2, 2, 3));
    }

    #[test]
    fn measure_times_back_to_back_windows() {
        let mut r = DirtyRate::new(Fake::new(LogMode::Ring, &[64]))
            .unwrap()
            .with_vcpus(1);
        let window = SampleWindow::from_millis(20).unwrap();
        let mut seen = 0;
        let m = r
            .measure(window, NonZeroU32::new(3).unwrap(), |i, _| {
                assert_eq!(i, seen);
                seen += 1;
            })
            .unwrap();
        assert_eq!((m.samples.len(), seen), (3, 3));
        assert_eq!(m.attribution, Attribution::Ring);
        // Each window lasts at least the length asked for.
        for s in &m.samples {
            assert!(s.window >= Duration::from_millis(20), "{:?}", s.window);
        }
        let t = m.time();
        assert!(t < Duration::from_millis(2000), "{t:?}");
        assert_eq!((m.pages(), m.pages_per_s()), (0, 0.0));
        assert_eq!(m.vcpu_pages_per_s(), vec![0.0]);
    }

    #[test]
    fn measurement_rates_sum_windows() {
        let s = |ms, pages, v: Vec<u64>| Sample {
            window: Duration::from_millis(ms),
            pages,
            per_vcpu: v,
            unattributed: 1,
            foreign: 0,
        };
        let m = Measurement {
            attribution: Attribution::Ring,
            samples: vec![s(500, 100, vec![60, 40]), s(1500, 300, vec![200])],
        };
        assert_eq!(m.time(), Duration::from_secs(2));
        assert_eq!(m.pages_per_s(), 200.0);
        assert_eq!(m.vcpu_pages_per_s(), vec![130.0, 20.0]);
        assert_eq!(m.unattributed(), 2);
        assert_eq!(m.samples[0].pages_per_s(), 200.0);
        assert_eq!(m.samples[1].vcpu_pages_per_s(1), None);
    }
}
