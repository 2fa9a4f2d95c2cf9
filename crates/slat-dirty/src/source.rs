//! Where a [`crate::Harvester`]'s log comes from: the [`DirtyLogSource`] trait, and
//! [`KvmLog`], its implementation over a VMM's own KVM VM (memslot handles and dirty rings).
//!
//! The transactional part of a harvest — owed bitmaps, re-arm before the set is returned,
//! abort puts the set back — does not depend on who keeps the log, so it is written once in
//! [`crate::harvest`] over this trait. A source only says which slots it tracks and performs
//! the four log operations KVM has (GET, CLEAR, collect the rings, reset them). slat's own
//! benchmark machines implement it in `slat-harness` (`MachineLog`), over their
//! `TestMachine` trait.

use crate::error::Error;
use crate::harvest::LogMode;
use crate::log::{clear_dirty_log, get_dirty_log, reset_dirty_rings, DirtyRing};
use crate::memslot::Memslot;
use slat_addr::PageIndex;

/// One tracked memslot as a source reports it: the id its ring entries carry and its page
/// count, which sizes every bitmap of the slot (GET buffers, owed pages, sets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    /// The slot id as ring entries name it (KVM: `as_id << 16 | id`).
    pub id: u32,
    /// Pages in the slot.
    pub pages: u64,
}

/// A dirty log a [`crate::Harvester`] can harvest: the tracked slots, addressed by their
/// index in [`DirtyLogSource::slots`], and the log operations of one [`LogMode`].
///
/// # Contract (what the harvester relies on to lose nothing)
///
/// - [`slots`](Self::slots) and [`mode`](Self::mode) never change: the harvester reads them
///   once, when it is built, and sizes every buffer from them.
/// - [`get_log`](Self::get_log) writes the slot's log into `bitmap` (exactly
///   `ceil(pages / 64)` words; the source may refuse any other length). Without manual
///   protect it also clears and re-protects the pages it reports. Bits it wrote before
///   failing are owed by the harvester all the same, so a source that consumes bits and then
///   fails (KVM's GET clears before it copies out) loses nothing.
/// - [`clear_log`](Self::clear_log) (manual protect) clears and re-protects the pages of
///   `first..first + pages` whose bits are set in `bitmap` (bit 0 = `first`).
/// - [`get_log_words`](Self::get_log_words) and [`clear_log_words`](Self::clear_log_words)
///   are the same two operations over the non-zero words only; their defaults go through the
///   whole-slot forms, and a source that can list its dirty words without a pass over the
///   slot (slat's simulated machine) overrides them, so a harvest of k pages costs O(k).
/// - [`collect_ring`](Self::collect_ring) hands every ring entry not handed over before to
///   `f(slot id, offset)`; entries given to `f` are the harvester's even if the call then
///   fails. [`reset_rings`](Self::reset_rings) re-protects the pages of every collected entry.
///
/// Implementations are safe to get wrong in the sense of Rust: every buffer the harvester
/// hands over is a slice, so a bad source can only report wrong pages, never touch memory.
pub trait DirtyLogSource {
    /// Why a log operation failed.
    type Error;

    /// The tracked slots, in the order the harvester's sets index them.
    fn slots(&self) -> Vec<SlotInfo>;
    /// How the log works (fixed for the source's life).
    fn mode(&self) -> LogMode;
    /// GET of slot `slot` (an index into [`DirtyLogSource::slots`]) into `bitmap`.
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), Self::Error>;
    /// CLEAR of the set bits of `bitmap` over `first..first + pages` of `slot`.
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), Self::Error>;
    /// [`get_log`](Self::get_log) as the list of the slot's non-zero words `(index, bits)`,
    /// in index order (bit `b` of word `i` is page `64 i + b`), replacing `words`' contents;
    /// words listed before a failure are the harvester's, as with `get_log`. `scratch` holds
    /// `ceil(pages / 64)` words: the default GETs into it and lists its non-zero words (KVM's
    /// GET costs the slot's size anyway); an override leaves it alone.
    fn get_log_words(
        &mut self,
        slot: usize,
        scratch: &mut [u64],
        words: &mut Vec<(usize, u64)>,
    ) -> Result<(), Self::Error> {
        scratch.fill(0);
        let r = self.get_log(slot, scratch);
        words.clear();
        let nonzero = scratch.iter().enumerate().filter(|(_, &w)| w != 0);
        words.extend(nonzero.map(|(i, &w)| (i, w)));
        r
    }
    /// [`clear_log`](Self::clear_log) over `first..first + pages` of the bits of `words`
    /// `(index, bits)`, slot-relative word indices inside that range (others are ignored).
    /// The default builds the range's bitmap in `scratch` (or, if it is shorter than the
    /// range, clears word by word) and calls `clear_log`.
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        scratch: &mut [u64],
    ) -> Result<(), Self::Error> {
        let (w0, end) = (first.raw() / 64, first.raw().saturating_add(pages));
        let inside = |&&(i, _): &&(usize, u64)| {
            (i as u64) >= w0 && (i as u64).checked_mul(64).is_some_and(|p| p < end)
        };
        let n = usize::try_from(pages.div_ceil(64)).unwrap_or(usize::MAX);
        if let Some(buf) = scratch.get_mut(..n) {
            buf.fill(0);
            for &(i, bits) in words.iter().filter(inside) {
                if let Some(b) = buf.get_mut((i as u64 - w0) as usize) {
                    *b |= bits;
                }
            }
            return self.clear_log(slot, first, pages, buf);
        }
        for &(i, bits) in words.iter().filter(inside) {
            let start = i as u64 * 64;
            let here = (end - start).min(64);
            self.clear_log(slot, PageIndex::new(start), here, &[bits])?;
        }
        Ok(())
    }
    /// Hands every uncollected ring entry to `f(slot id, offset)`; returns how many.
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Self::Error>;
    /// [`collect_ring`](Self::collect_ring) that also names the vCPU whose ring held each
    /// entry: `f(vcpu, slot id, offset)`, `None` when the source cannot tell (entries a vCPU
    /// reaped into a shared list on a ring-full exit). Same contract otherwise. The default
    /// names no vCPU; a source that keeps one ring per vCPU overrides it, so a per-vCPU dirty
    /// rate ([`crate::dirty_rate`]) can be measured over it.
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, Self::Error> {
        self.collect_ring(&mut |slot, offset| f(None, slot, offset))
    }
    /// Re-protects the pages of every collected ring entry; returns how many were reset.
    fn reset_rings(&mut self) -> Result<u64, Self::Error>;

    /// This source with its errors turned into `E` by `f` (e.g. into a caller's own error
    /// type, or into text), the log operations unchanged.
    fn map_err<E, F: FnMut(Self::Error) -> E>(self, f: F) -> MapErr<Self, F>
    where
        Self: Sized,
    {
        MapErr { source: self, f }
    }
}

/// A [`DirtyLogSource`] whose errors are mapped by a function: [`DirtyLogSource::map_err`].
#[derive(Debug)]
pub struct MapErr<S, F> {
    source: S,
    f: F,
}

impl<S, F> MapErr<S, F> {
    /// The source inside.
    pub fn get_ref(&self) -> &S {
        &self.source
    }
}

impl<S: DirtyLogSource, E, F: FnMut(S::Error) -> E> DirtyLogSource for MapErr<S, F> {
    type Error = E;

    fn slots(&self) -> Vec<SlotInfo> {
        self.source.slots()
    }
    fn mode(&self) -> LogMode {
        self.source.mode()
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), E> {
        self.source.get_log(slot, bitmap).map_err(&mut self.f)
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), E> {
        let r = self.source.clear_log(slot, first, pages, bitmap);
        r.map_err(&mut self.f)
    }
    fn get_log_words(
        &mut self,
        slot: usize,
        scratch: &mut [u64],
        words: &mut Vec<(usize, u64)>,
    ) -> Result<(), E> {
        let r = self.source.get_log_words(slot, scratch, words);
        r.map_err(&mut self.f)
    }
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        scratch: &mut [u64],
    ) -> Result<(), E> {
        let r = self
            .source
            .clear_log_words(slot, first, pages, words, scratch);
        r.map_err(&mut self.f)
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, E> {
        self.source.collect_ring(f).map_err(&mut self.f)
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, E> {
        self.source.collect_ring_by_vcpu(f).map_err(&mut self.f)
    }
    fn reset_rings(&mut self) -> Result<u64, E> {
        self.source.reset_rings().map_err(&mut self.f)
    }
}

impl<S: DirtyLogSource + ?Sized> DirtyLogSource for Box<S> {
    type Error = S::Error;

    fn slots(&self) -> Vec<SlotInfo> {
        (**self).slots()
    }
    fn mode(&self) -> LogMode {
        (**self).mode()
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), Self::Error> {
        (**self).get_log(slot, bitmap)
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), Self::Error> {
        (**self).clear_log(slot, first, pages, bitmap)
    }
    fn get_log_words(
        &mut self,
        slot: usize,
        scratch: &mut [u64],
        words: &mut Vec<(usize, u64)>,
    ) -> Result<(), Self::Error> {
        (**self).get_log_words(slot, scratch, words)
    }
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        scratch: &mut [u64],
    ) -> Result<(), Self::Error> {
        (**self).clear_log_words(slot, first, pages, words, scratch)
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Self::Error> {
        (**self).collect_ring(f)
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, Self::Error> {
        (**self).collect_ring_by_vcpu(f)
    }
    fn reset_rings(&mut self) -> Result<u64, Self::Error> {
        (**self).reset_rings()
    }
}

/// The log of a VMM's own KVM VM: [`Memslot`] handles (which know their sizes) and, in the
/// ring mode, the vCPUs' [`DirtyRing`]s. What [`crate::Harvester::new`] and
/// [`crate::Harvester::with_rings`] build.
#[derive(Debug)]
pub struct KvmLog {
    slots: Vec<Memslot>,
    mode: LogMode,
    rings: Vec<DirtyRing>,
}

impl KvmLog {
    /// The log of `slots` (all of one VM, distinct, at least one) in `mode`; the ring mode
    /// takes the vCPUs' `rings`, the others none.
    pub fn new(slots: Vec<Memslot>, mode: LogMode, rings: Vec<DirtyRing>) -> Result<Self, Error> {
        let Some(first) = slots.first() else {
            return Err(Error::Harvest("no memslot to track".into()));
        };
        if let Some(s) = slots.iter().find(|s| !first.same_vm(s)) {
            return Err(Error::Harvest(format!(
                "slot {} belongs to another VM than slot {}",
                s.id(),
                first.id()
            )));
        }
        if mode != LogMode::Ring && !rings.is_empty() {
            return Err(Error::Harvest(
                "rings are only used in the ring mode".into(),
            ));
        }
        Ok(KvmLog { slots, mode, rings })
    }

    /// The slots, in the order the sets index them.
    pub fn memslots(&self) -> &[Memslot] {
        &self.slots
    }

    /// Adds a vCPU's ring (ring mode only).
    pub fn add_ring(&mut self, ring: DirtyRing) -> Result<(), Error> {
        if self.mode != LogMode::Ring {
            return Err(Error::Harvest(
                "rings are only used in the ring mode".into(),
            ));
        }
        self.rings.push(ring);
        Ok(())
    }

    fn slot(&self, i: usize) -> Result<&Memslot, Error> {
        self.slots.get(i).ok_or_else(|| {
            Error::Harvest(format!(
                "slot index {i}: the log tracks {} slots",
                self.slots.len()
            ))
        })
    }
}

impl DirtyLogSource for KvmLog {
    type Error = Error;

    fn slots(&self) -> Vec<SlotInfo> {
        self.slots
            .iter()
            .map(|s| SlotInfo {
                id: s.id(),
                pages: s.pages(),
            })
            .collect()
    }
    fn mode(&self) -> LogMode {
        self.mode
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), Error> {
        // The length is checked against the handle's own page count, KVM's.
        get_dirty_log(self.slot(slot)?, bitmap)
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), Error> {
        clear_dirty_log(self.slot(slot)?, first, pages, bitmap)
    }
    /// One CLEAR per run of the harvested chunks ([`crate::clear_harvested_chunks`]), not
    /// one over the whole range: the kernel walks only what it is given.
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        scratch: &mut [u64],
    ) -> Result<(), Error> {
        let s = self.slot(slot)?;
        crate::clear_harvested_chunks(first, pages, words, scratch, |f, n, b| {
            clear_dirty_log(s, f, n, b)
        })
        .map(drop)
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Error> {
        Ok(self
            .rings
            .iter_mut()
            .map(|r| u64::from(r.harvest(&mut *f)))
            .sum())
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, Error> {
        // Rings are numbered in the order they were given (`with_rings`, then `add_ring`):
        // a VMM that gives them in vCPU order gets vCPU indexes.
        Ok(self
            .rings
            .iter_mut()
            .enumerate()
            .map(|(i, r)| u64::from(r.harvest(|slot, offset| f(Some(i), slot, offset))))
            .sum())
    }
    fn reset_rings(&mut self) -> Result<u64, Error> {
        reset_dirty_rings(self.slot(0)?.vm())
    }
}
