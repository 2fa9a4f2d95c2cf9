//! Transactional harvests: one API over the three ways KVM logs dirty pages.

use crate::error::{try_filled, Error};
use crate::log::DirtyRing;
use crate::memslot::Memslot;
use crate::ranges::{ranges, Ranges};
use crate::source::{DirtyLogSource, KvmLog, SlotInfo};
use crate::summary_bitmap::SummaryBitmap;
use slat_addr::PageIndex;

/// How the VM logs dirty pages (it must have been set up so: see each variant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogMode {
    /// `KVM_GET_DIRTY_LOG` clears as it reads (the VM has no manual protect).
    Get,
    /// Manual protect ([`crate::log::enable_manual_protect`], with or without `INITIALLY_SET`): GET
    /// copies, then `KVM_CLEAR_DIRTY_LOG` in chunks of `chunk_pages` pages (a non-zero
    /// multiple of 64; the last chunk of a slot may be shorter) re-protects. Chunks without a
    /// dirty page are not cleared at all. With `INITIALLY_SET` the first take reports every
    /// page (the initial full copy).
    ManualProtect {
        /// Pages per `KVM_CLEAR_DIRTY_LOG` call.
        chunk_pages: u64,
    },
    /// The per-vCPU dirty ring ([`crate::log::enable_dirty_ring`]); the harvester owns the rings.
    Ring,
}

/// Tracks the dirty pages of some memslots of one VM.
///
/// A [`Harvester`] owns the source of the log it harvests — a [`DirtyLogSource`]: by default
/// [`KvmLog`], the [`Memslot`]s of a VMM's own VM (and, for the ring, the vCPUs'
/// [`DirtyRing`]s); slat's benchmark machines bring their own — and a bitmap per slot of pages
/// it *owes*: pages reported dirty that no committed harvest has covered yet. The
/// transactional part below is the same for every source; the guarantees hold for any source
/// that keeps the [`DirtyLogSource`] contract (KVM's semantics). [`Harvester::take`] pulls
/// everything KVM has logged into
/// those bitmaps, re-arms the log, and hands the whole owed set over as a [`DirtySet`]. The
/// caller copies the pages of the set (to a migration stream, a snapshot, a reset source) and
/// then either [`DirtySet::commit`]s — the pages are no longer owed — or aborts
/// ([`DirtySet::abort`], or just drops the set, e.g. on `?`): every page of the set is owed
/// again and the next take reports it, merged with whatever was dirtied since.
///
/// # Why nothing is lost
///
/// A page's contents must be copied *after* the log was re-armed for it, otherwise a write
/// that lands after the copy but before the re-arm is neither in the copy nor in the next
/// harvest. So every take re-arms before it returns, and the set is returned only then:
///
/// - [`LogMode::Get`]: `KVM_GET_DIRTY_LOG` atomically takes the bitmap and write-protects the
///   pages it reported (flushing TLBs) before it returns. A write after that faults and sets
///   the bit again; the next take sees it.
/// - [`LogMode::ManualProtect`]: GET only copies the bitmap. The take then issues
///   `KVM_CLEAR_DIRTY_LOG`, in the caller's chunk size, for exactly the bits GET returned —
///   clearing and write-protecting those pages — before returning. If CLEAR waited for
///   `commit` instead (after the copy), a write between the copy and the CLEAR would be wiped
///   by the CLEAR and be in no copy: lost. Clearing first, a write after the CLEAR sets the bit
///   again (next take), and a write between GET and CLEAR to a reported page lands before the
///   copy starts, so the copy has it. A page first dirtied between GET and CLEAR has its bit
///   set but not in the mask, so the CLEAR leaves it for the next take.
/// - [`LogMode::Ring`]: each entry is collected (flagged RESET) into the owed bitmaps, then
///   `KVM_RESET_DIRTY_RINGS` write-protects the collected pages again, all before the take
///   returns. A write between collection and reset hits a still-writable page and is seen by
///   the copy, which starts after the reset; a write after the reset faults and pushes a new
///   entry.
///
/// Since the log is re-armed at take time, what is at stake on failure is only the set
/// itself: its bits exist nowhere else (KVM has cleared them). Abort puts them back into the
/// owed bitmaps, so the next take reports them again — the same remedy Firecracker adopted for
/// failed snapshots (merging the bits back). Commit drops them. A failure inside `take`
/// itself (an ioctl error on the second slot, say) is covered the same way: bits are moved
/// into the owed bitmaps as soon as KVM hands them over, before anything else can fail, and the
/// error leaves them owed.
///
/// Writes KVM does not see — by the VMM itself or its devices (`vm-memory` records them in an
/// `AtomicBitmap`; `get_and_reset()` gives its words) — are merged with
/// [`Harvester::mark_words`] or [`Harvester::mark_pages`] before a take, or
/// [`DirtySet::mark_words`] into a set being copied.
///
///
/// `S` is where the log comes from: by default a VMM's own KVM VM ([`KvmLog`], built by
/// [`Harvester::new`] and [`Harvester::with_rings`]); any [`DirtyLogSource`] through
/// [`Harvester::from_source`] (slat's benchmark machines: `slat_harness::MachineLog`).
///
/// It must be the only reader of those slots' logs (no other GET, CLEAR or ring harvest of
/// them): another reader would take bits this harvester then never sees.
///
/// # Cost
///
/// A take reads the log through [`DirtyLogSource::get_log_words`] and re-arms it through
/// [`DirtyLogSource::clear_log_words`], and keeps, per slot, the list of the bitmap words it
/// has set: neither the owed bitmaps nor a set's are scanned or zeroed whole. Over a source
/// that lists its dirty words (slat's simulated machine), a take of k pages costs O(k)
/// whatever the slots' size; over KVM, GET itself costs the slot's size. [`DirtySet::words`]
/// and [`DirtySet::pages`] follow the set; [`DirtySet::bitmap`] and [`DirtySet::ranges`] are
/// the whole-slot views. A whole-bitmap mark ([`Harvester::mark_words`], `mark_all`, …) makes
/// the next take scan its slot once.
#[derive(Debug)]
pub struct Harvester<S: DirtyLogSource = KvmLog> {
    source: S,
    /// The source's slots, read once: every bitmap below is sized from them.
    slots: Vec<SlotInfo>,
    mode: LogMode,
    /// Per slot: pages owed (reported, not yet committed). Exactly `ceil(pages / 64)` long.
    owed: Vec<Vec<u64>>,
    /// Per slot: the words of `owed` that may be non-zero, so a take of k pages neither scans
    /// nor zeroes a slot-sized bitmap.
    touched: Vec<Touched>,
    /// Scratch bitmap for a source's whole-slot GET and CLEAR (the largest slot's length).
    scratch: Vec<u64>,
    /// The non-zero words of one GET.
    words: Vec<(usize, u64)>,
    /// Zeroed bitmaps shaped as `owed`, allocated (fallibly) with it: a take swaps them in
    /// for the owed ones and the set gives them back, zeroed, when it is settled, so a take
    /// allocates nothing.
    spare: Vec<Vec<u64>>,
    /// Ring entries for a slot this harvester does not track, or past its end.
    foreign: u64,
}

/// The words of a whole-slot bitmap that may be non-zero: a list (no index twice: an index
/// is listed when its word leaves zero), or every word once a whole-bitmap operation (or a
/// list longer than an eighth of the bitmap) made listing pointless.
#[derive(Debug, Default, Clone)]
struct Touched {
    list: Vec<usize>,
    all: bool,
}

impl Touched {
    /// ORs `bits` into word `i` of `into` (inside it), listing the word if it left zero.
    #[inline]
    fn or(&mut self, into: &mut [u64], i: usize, bits: u64) {
        let len = into.len();
        let Some(w) = into.get_mut(i) else { return };
        if *w == 0 && bits != 0 && !self.all {
            if self.list.len() >= len / 8 {
                self.all = true;
                self.list.clear();
            } else {
                self.list.push(i);
            }
        }
        *w |= bits;
    }

    /// The indices of `bits`' non-zero words, in order.
    fn nonzero<'a>(&'a self, bits: &'a [u64]) -> Box<dyn Iterator<Item = usize> + 'a> {
        if self.all {
            Box::new((0..bits.len()).filter(move |&i| bits[i] != 0))
        } else {
            Box::new(self.list.iter().copied().filter(move |&i| bits[i] != 0))
        }
    }

    /// Zeroes `bits` (only the listed words) and empties the list.
    fn clear(&mut self, bits: &mut [u64]) {
        if self.all {
            bits.fill(0);
        } else {
            for &i in &self.list {
                bits[i] = 0;
            }
        }
        self.list.clear();
        self.all = false;
    }
}

/// Words of `slot`'s bitmaps, if this host can hold them.
fn words_of(slot: &SlotInfo) -> Result<usize, Error> {
    usize::try_from(slot.pages.div_ceil(64))
        .map_err(|_| Error::Harvest(format!("slot {} is too large for this host", slot.id)))
}

/// A zeroed bitmap for `slot`. A source is safe code and may claim any page count: an
/// allocation this host cannot make is a typed error ([`Error::Alloc`]), not an abort. (A
/// reservation that is dropped proves nothing about the next allocation: the bitmap itself
/// is the fallible one.)
fn bitmap_for(slot: &SlotInfo) -> Result<Vec<u64>, Error> {
    try_filled(words_of(slot)?, 0u64, || {
        format!(
            "the dirty bitmap of slot {} ({} pages)",
            slot.id, slot.pages
        )
    })
}

/// Refuses what no harvest can work with: no slot, a slot twice, a bad CLEAR chunk.
fn check_source(slots: &[SlotInfo], mode: LogMode) -> Result<(), Error> {
    if slots.is_empty() {
        return Err(Error::Harvest("no memslot to track".into()));
    }
    for (i, s) in slots.iter().enumerate() {
        if slots[..i].iter().any(|t| t.id == s.id) {
            return Err(Error::Harvest(format!("slot {} given twice", s.id)));
        }
    }
    if let LogMode::ManualProtect { chunk_pages } = mode {
        if chunk_pages == 0 || chunk_pages % 64 != 0 {
            return Err(Error::Harvest(format!(
                "a CLEAR chunk of {chunk_pages} pages: it must be a non-zero multiple of 64"
            )));
        }
    }
    Ok(())
}

impl Harvester<KvmLog> {
    /// A harvester of `slots` (all of one VM, distinct) logged with `mode`, which must be
    /// [`LogMode::Get`] or [`LogMode::ManualProtect`] (see [`Harvester::with_rings`]).
    /// Dirty logging is not switched on here: see [`Memslot::set_dirty_logging`].
    pub fn new(slots: Vec<Memslot>, mode: LogMode) -> Result<Self, Error> {
        if mode == LogMode::Ring {
            return Err(Error::Harvest(
                "the ring mode needs the vCPUs' rings: use Harvester::with_rings".into(),
            ));
        }
        Self::from_source(KvmLog::new(slots, mode, Vec::new())?)
    }

    /// A harvester of `slots` logged through the dirty rings `rings` (one per vCPU of the VM;
    /// more can be added with [`Harvester::add_ring`]).
    pub fn with_rings(slots: Vec<Memslot>, rings: Vec<DirtyRing>) -> Result<Self, Error> {
        Self::from_source(KvmLog::new(slots, LogMode::Ring, rings)?)
    }

    /// Adds a vCPU's ring (ring mode only).
    pub fn add_ring(&mut self, ring: DirtyRing) -> Result<(), Error> {
        self.source.add_ring(ring)
    }

    /// The slots tracked, in the order the sets index them.
    pub fn slots(&self) -> &[Memslot] {
        self.source.memslots()
    }
}

impl<S: DirtyLogSource> Harvester<S> {
    /// A harvester of everything `source` tracks, in its mode. Every bitmap is sized from the
    /// source's slots, read here once. Refused: no slot, a slot id twice, a CLEAR chunk that
    /// is not a non-zero multiple of 64, a slot too large for this host.
    pub fn from_source(source: S) -> Result<Self, Error> {
        let slots = source.slots();
        let mode = source.mode();
        check_source(&slots, mode)?;
        let owed = slots
            .iter()
            .map(bitmap_for)
            .collect::<Result<Vec<_>, Error>>()?;
        let spare = slots
            .iter()
            .map(bitmap_for)
            .collect::<Result<Vec<_>, Error>>()?;
        let largest = owed.iter().map(Vec::len).max().unwrap_or(0);
        let scratch = match mode {
            LogMode::Get | LogMode::ManualProtect { .. } => {
                try_filled(largest, 0u64, || "the GET scratch bitmap".into())?
            }
            LogMode::Ring => Vec::new(),
        };
        Ok(Harvester {
            source,
            touched: vec![Touched::default(); slots.len()],
            slots,
            mode,
            owed,
            scratch,
            words: Vec::new(),
            spare,
            foreign: 0,
        })
    }

    /// The source of the log (for what it reports about itself; reading its log directly
    /// would take bits this harvester then never sees).
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Gives the source back (e.g. to measure its dirty rate with
    /// [`crate::dirty_rate::DirtyRate`]). Pages still owed are dropped: the next reader of the log
    /// sees only what was dirtied since the last take.
    pub fn into_source(self) -> S {
        self.source
    }

    /// The tracked slots' ids and sizes, in the order the sets index them.
    pub fn slot_info(&self) -> &[SlotInfo] {
        &self.slots
    }

    /// The log mode.
    pub fn mode(&self) -> LogMode {
        self.mode
    }

    /// Ring entries seen so far for slots this harvester does not track (or past their end);
    /// they are collected and reset but reported nowhere.
    pub fn foreign_entries(&self) -> u64 {
        self.foreign
    }

    /// Pages owed now (reported or marked, not yet committed), without asking the source.
    pub fn owed_pages(&self) -> u64 {
        let per_slot = self.owed.iter().zip(&self.touched);
        per_slot
            .map(|(o, t)| count(t.nonzero(o).map(|i| &o[i])))
            .sum()
    }

    fn index(&self, slot_index: usize) -> Result<usize, Error> {
        if slot_index < self.slots.len() {
            Ok(slot_index)
        } else {
            Err(Error::Harvest(format!(
                "slot index {slot_index}: the harvester tracks {} slots",
                self.slots.len()
            )))
        }
    }

    /// Merges writes the log did not see (by the VMM or its devices) into the pages owed:
    /// `words` is a bitmap of slot `slot_index` (an index into [`Harvester::slot_info`]),
    /// exactly `ceil(pages / 64)` words long — e.g. `vm-memory`'s
    /// `AtomicBitmap::get_and_reset()` of the region behind the slot, with a 4 KiB page size.
    /// Bits past the slot's end are ignored.
    pub fn mark_words(&mut self, slot_index: usize, words: &[u64]) -> Result<(), Error> {
        let i = self.index(slot_index)?;
        or_into(
            &self.slots[i],
            &mut self.owed[i],
            words,
            "Harvester::mark_words",
        )?;
        self.touched[i].all = true;
        Ok(())
    }

    /// Merges the VMM-side writes `vm-memory` recorded for the region behind slot
    /// `slot_index`: takes and resets `bitmap` (`AtomicBitmap::get_and_reset`) and owes its
    /// pages. The bits are owed from then on, so nothing is lost if a later take fails.
    ///
    /// `bitmap` must cover exactly the slot with 4 KiB pages: `len()` equal to the slot's
    /// pages and `byte_size()` to its bytes ([`Error::BitmapLength`] otherwise; the bitmap
    /// is then left untouched). (`AtomicBitmap` does not expose its page size; one other than
    /// 4 KiB with these two sizes would only mark the wrong pages, never memory outside.)
    #[cfg(feature = "vm-memory")]
    pub fn mark_atomic_bitmap(
        &mut self,
        slot_index: usize,
        bitmap: &vm_memory::bitmap::AtomicBitmap,
    ) -> Result<(), Error> {
        let i = self.index(slot_index)?;
        let s = &self.slots[i];
        let bytes = s.pages.checked_mul(slat_addr::PAGE_SIZE);
        if u64::try_from(bitmap.len()) != Ok(s.pages)
            || u64::try_from(bitmap.byte_size()).ok() != bytes
        {
            return Err(Error::BitmapLength {
                op: "Harvester::mark_atomic_bitmap",
                slot: s.id,
                pages: s.pages,
                expected: s.pages.div_ceil(64),
                got: bitmap.len().div_ceil(64),
            });
        }
        let words = bitmap.get_and_reset();
        self.touched[i].all = true;
        or_into(
            s,
            &mut self.owed[i],
            &words,
            "Harvester::mark_atomic_bitmap",
        )
    }

    /// Takes the VMM-side writes a [`SummaryBitmap`] recorded for the memory behind slot
    /// `slot_index` (e.g. the region's bitmap of a `GuestMemoryMmap<SummaryBitmap>`) and owes
    /// them: only the bitmap's dirty words are read and cleared, straight into the owed set
    /// (no whole-bitmap copy), and they are owed from then on, so a later failed take loses
    /// nothing. Returns the pages taken. `bitmap` must cover exactly the slot with 4 KiB pages
    /// ([`Error::BitmapLength`] otherwise; the bitmap is then left untouched).
    pub fn mark_summary_bitmap(
        &mut self,
        slot_index: usize,
        bitmap: &SummaryBitmap,
    ) -> Result<u64, Error> {
        let i = self.index(slot_index)?;
        let s = &self.slots[i];
        if u64::try_from(bitmap.page_size().get()) != Ok(slat_addr::PAGE_SIZE) {
            let size = bitmap.page_size();
            return Err(Error::Harvest(format!(
                "a bitmap of {size}-byte pages, not 4 KiB"
            )));
        }
        if u64::try_from(bitmap.len()) != Ok(s.pages) {
            return Err(Error::BitmapLength {
                op: "Harvester::mark_summary_bitmap",
                slot: s.id,
                pages: s.pages,
                expected: s.pages.div_ceil(64),
                got: bitmap.len().div_ceil(64),
            });
        }
        let words = &mut self.words;
        words.clear();
        bitmap.take_words(|w, bits| words.push((w, bits)));
        Ok(or_words(s, &mut self.owed[i], &mut self.touched[i], words))
    }

    /// Marks `pages` pages of slot `slot_index` from `first_page` as owed (VMM writes).
    pub fn mark_pages(
        &mut self,
        slot_index: usize,
        first_page: PageIndex,
        pages: u64,
    ) -> Result<(), Error> {
        let i = self.index(slot_index)?;
        let first = first_page.raw();
        set_range(&self.slots[i], &mut self.owed[i], first, pages, true)?;
        self.touched[i].all = true;
        Ok(())
    }

    /// Marks every page of every tracked slot as owed: the next take hands over all memory
    /// (e.g. a migration to a destination that starts empty).
    pub fn mark_all(&mut self) {
        for ((s, o), t) in self.slots.iter().zip(&mut self.owed).zip(&mut self.touched) {
            o.fill(u64::MAX);
            trim(s, o);
            t.all = true;
        }
    }

    /// Pulls everything the log holds into the pages owed and re-arms the log for those pages
    /// (GET; GET + CLEAR; collect the rings + reset), without handing a set over. This is what
    /// a VMM calls on `KVM_EXIT_DIRTY_RING_FULL` before re-entering the vCPU (the entries stay
    /// owed until a take). Returns the pages the log reported (for the ring: entries of
    /// tracked slots).
    pub fn collect(&mut self) -> Result<u64, S::Error> {
        match self.mode {
            LogMode::Get => self.collect_bitmaps(None),
            LogMode::ManualProtect { chunk_pages } => self.collect_bitmaps(Some(chunk_pages)),
            LogMode::Ring => self.collect_rings(),
        }
    }

    /// GET of every slot, each followed by CLEAR of what it returned in chunks of `clear`
    /// pages with manual protect. Through the source's word lists, so with a source that
    /// lists its dirty words without a pass over the slot, nothing here costs the slot's size.
    fn collect_bitmaps(&mut self, clear: Option<u64>) -> Result<u64, S::Error> {
        let mut n = 0;
        for (i, s) in self.slots.iter().enumerate() {
            let (owed, touched) = (&mut self.owed[i], &mut self.touched[i]);
            let scratch = &mut self.scratch[..owed.len()];
            let r = self.source.get_log_words(i, scratch, &mut self.words);
            // From here the log may have let go of these bits: owe them before anything else
            // can fail — even if the source failed after handing some over. (With manual
            // protect, owe before re-protecting: a CLEAR failing midway leaves bits the next
            // GET reports again, harmlessly.)
            n += or_words(s, owed, touched, &mut self.words);
            r?;
            if let Some(chunk) = clear {
                clear_chunks(&mut self.source, i, s.pages, &self.words, chunk, scratch)?;
            }
        }
        Ok(n)
    }

    /// Collects the ring entries into the pages owed, then resets the rings.
    fn collect_rings(&mut self) -> Result<u64, S::Error> {
        let mut n = 0u64;
        let (slots, owed, foreign) = (&self.slots, &mut self.owed, &mut self.foreign);
        let touched = &mut self.touched;
        // Each entry is owed the moment it is handed over, so a failure after some entries
        // (here or in the reset) loses none of them.
        self.source.collect_ring(&mut |slot, offset| {
            let offset = offset.raw();
            match slots.iter().position(|s| s.id == slot) {
                Some(i) if offset < slots[i].pages => {
                    // offset < pages, so the word index is in the bitmap.
                    touched[i].or(&mut owed[i], (offset / 64) as usize, 1 << (offset % 64));
                    n += 1;
                }
                _ => *foreign += 1,
            }
        })?;
        // Every collected entry is owed; now re-protect those pages.
        self.source.reset_rings()?;
        Ok(n)
    }

    /// Takes the dirty set: collects (see [`Harvester::collect`]), re-arming the log, and hands
    /// every owed page over. Copy the pages, then [`DirtySet::commit`]; dropping the set
    /// without committing makes them owed again. On an error nothing is lost either: what was
    /// collected stays owed.
    pub fn take(&mut self) -> Result<DirtySet<'_, S>, S::Error> {
        let collected = self.collect()?;
        Ok(self.hand_over(collected))
    }

    /// Hands the pages owed now over as a set without reading the log: pages the log holds
    /// stay there for the next take. Every owed page was re-armed when it was collected (or
    /// was marked by the caller), so copying them is safe; what this misses is only what was
    /// dirtied since the last collect. (slat-migrate's test knob that skips the final
    /// harvest uses it to show verification catching the pages it misses.)
    pub fn take_owed(&mut self) -> DirtySet<'_, S> {
        self.hand_over(0)
    }

    /// Moves every owed page into a new set: the spare bitmaps become the owed ones.
    fn hand_over(&mut self, collected: u64) -> DirtySet<'_, S> {
        if self.spare.len() != self.owed.len() {
            // A set was leaked (`mem::forget`) and its bitmaps never came back: allocate again
            // (fallibly first; only a leak followed by exhausted memory reaches the fallback).
            self.spare = self
                .slots
                .iter()
                .map(bitmap_for)
                .collect::<Result<_, _>>()
                .unwrap_or_else(|_| self.owed.iter().map(|o| vec![0; o.len()]).collect());
        }
        let bitmaps = std::mem::replace(&mut self.owed, std::mem::take(&mut self.spare));
        let fresh = vec![Touched::default(); self.touched.len()];
        let mut touched = std::mem::replace(&mut self.touched, fresh);
        for t in &mut touched {
            t.list.sort_unstable();
        }
        DirtySet {
            h: self,
            bitmaps,
            touched,
            collected,
            settled: false,
        }
    }
}

/// Set bits among `words`.
fn count<'a>(words: impl IntoIterator<Item = &'a u64>) -> u64 {
    words.into_iter().map(|w| u64::from(w.count_ones())).sum()
}

/// ORs the words `(index, bits)` of one GET into `owed`, listing them in `touched`; drops
/// indices past the slot and bits past its end from `words` (a source is safe code and may
/// report them), so what is cleared next is what is owed. Returns the bits inside the slot.
fn or_words(
    s: &SlotInfo,
    owed: &mut [u64],
    touched: &mut Touched,
    words: &mut Vec<(usize, u64)>,
) -> u64 {
    let tail = s.pages % 64;
    let last = owed.len().checked_sub(1);
    words.retain_mut(|(i, bits)| {
        if Some(*i) == last && tail != 0 {
            *bits &= (1u64 << tail) - 1;
        }
        *i < owed.len() && *bits != 0
    });
    // A source may list words in any order; chunked CLEARs want them in order.
    if !words.is_sorted_by_key(|&(i, _)| i) {
        words.sort_unstable_by_key(|&(i, _)| i);
    }
    for &(i, bits) in words.iter() {
        touched.or(owed, i, bits);
    }
    words.iter().map(|&(_, b)| u64::from(b.count_ones())).sum()
}

/// Clears (re-protects) the pages of `words` (the non-zero words of slot `i`, `pages` pages,
/// in index order) in chunks of `chunk` pages, skipping chunks with no bit set: one CLEAR per
/// chunk that holds a dirty word, found from the list, not by scanning the chunks.
fn clear_chunks<S: DirtyLogSource>(
    source: &mut S,
    i: usize,
    pages: u64,
    words: &[(usize, u64)],
    chunk: u64,
    scratch: &mut [u64],
) -> Result<(), S::Error> {
    let mut rest = words;
    while let Some(&(w, _)) = rest.first() {
        // chunk is a multiple of 64: the chunk holding word w starts on a word.
        let first = (w as u64 * 64) / chunk * chunk;
        let n = chunk.min(pages - first);
        let end_word = (first + n).div_ceil(64);
        let k = rest.partition_point(|&(x, _)| (x as u64) < end_word);
        source.clear_log_words(i, PageIndex::new(first), n, &rest[..k], scratch)?;
        rest = &rest[k..];
    }
    Ok(())
}

/// Clears the bits past the slot's last page in a whole-slot bitmap: they are no pages.
fn trim(s: &SlotInfo, bits: &mut [u64]) {
    let tail = s.pages % 64;
    if tail != 0 {
        if let Some(last) = bits.last_mut() {
            *last &= (1u64 << tail) - 1;
        }
    }
}

/// ORs the `words` of a whole-slot bitmap into `into`, which is the slot's length.
fn or_into(s: &SlotInfo, into: &mut [u64], words: &[u64], op: &'static str) -> Result<(), Error> {
    if words.len() != into.len() {
        return Err(Error::BitmapLength {
            op,
            slot: s.id,
            pages: s.pages,
            expected: into.len() as u64,
            got: words.len(),
        });
    }
    for (o, w) in into.iter_mut().zip(words) {
        *o |= w;
    }
    trim(s, into);
    Ok(())
}

/// Sets (`set`) or clears the bits of `pages` pages from `first` in a whole-slot bitmap,
/// checked against the slot.
fn set_range(
    s: &SlotInfo,
    into: &mut [u64],
    first: u64,
    pages: u64,
    set: bool,
) -> Result<(), Error> {
    let end = first.checked_add(pages).filter(|&e| e <= s.pages);
    let Some(end) = end else {
        return Err(Error::Harvest(format!(
            "pages {first}..{first}+{pages} are not inside slot {} ({} pages)",
            s.id, s.pages
        )));
    };
    let mut p = first;
    while p < end {
        let bit = p % 64;
        let n = (64 - bit).min(end - p);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << bit
        };
        // p < end <= pages, so the word is in the slot's bitmap.
        let w = &mut into[(p / 64) as usize];
        if set {
            *w |= mask;
        } else {
            *w &= !mask;
        }
        p += n;
    }
    Ok(())
}

/// A harvested dirty set: per tracked slot, a bitmap of the pages to copy. Commit it once they
/// are copied; dropped uncommitted (or [aborted](DirtySet::abort)), its pages are owed again.
#[derive(Debug)]
#[must_use = "dropping a dirty set without commit() makes its pages owed again"]
pub struct DirtySet<'h, S: DirtyLogSource = KvmLog> {
    h: &'h mut Harvester<S>,
    bitmaps: Vec<Vec<u64>>,
    /// Per slot: the words of `bitmaps` that may be non-zero, in order.
    touched: Vec<Touched>,
    /// What the take's collect reported.
    collected: u64,
    settled: bool,
}

impl DirtySet<'_, KvmLog> {
    /// The slots, in the order of [`DirtySet::bitmap`]'s index.
    pub fn slots(&self) -> &[Memslot] {
        self.h.slots()
    }
}

impl<S: DirtyLogSource> DirtySet<'_, S> {
    /// The slots' ids and sizes, in the order of [`DirtySet::bitmap`]'s index.
    pub fn slot_info(&self) -> &[SlotInfo] {
        &self.h.slots
    }

    /// The bitmap of slot `i` (bit `p` = page `p` of the slot), `None` past the last slot.
    pub fn bitmap(&self, i: usize) -> Option<&[u64]> {
        self.bitmaps.get(i).map(Vec::as_slice)
    }

    /// The dirty runs `(first_page, pages)` of slot `i` (empty past the last slot).
    pub fn ranges(&self, i: usize) -> Ranges<'_> {
        let pages = self.h.slots.get(i).map_or(0, |s| s.pages);
        ranges(self.bitmap(i).unwrap_or(&[]), pages)
    }

    /// The non-zero words `(index, bits)` of slot `i`'s bitmap, in index order (empty past
    /// the last slot): bit `b` of word `w` is page `64 w + b`. Costs the set's words, not the
    /// slot's size (unless a whole-bitmap mark made the set's words unknown).
    pub fn words(&self, i: usize) -> impl Iterator<Item = (usize, u64)> + '_ {
        let bits = self.bitmaps.get(i).map_or(&[][..], Vec::as_slice);
        let t = self.touched.get(i);
        t.into_iter()
            .flat_map(move |t| t.nonzero(bits).map(move |w| (w, bits[w])))
    }

    /// Dirty pages in the set.
    pub fn pages(&self) -> u64 {
        (0..self.bitmaps.len())
            .flat_map(|i| self.words(i))
            .map(|(_, b)| u64::from(b.count_ones()))
            .sum()
    }

    /// Pages the log reported in the take that made this set (ring: entries of tracked
    /// slots), before they were merged with the pages already owed: what was dirtied since
    /// the take before.
    pub fn collected(&self) -> u64 {
        self.collected
    }

    /// True if no page is dirty.
    pub fn is_empty(&self) -> bool {
        (0..self.bitmaps.len()).all(|i| self.words(i).next().is_none())
    }

    /// Merges VMM-side writes into this set (see [`Harvester::mark_words`]).
    pub fn mark_words(&mut self, slot_index: usize, words: &[u64]) -> Result<(), Error> {
        let i = self.h.index(slot_index)?;
        or_into(
            &self.h.slots[i],
            &mut self.bitmaps[i],
            words,
            "DirtySet::mark_words",
        )?;
        self.touched[i].all = true;
        Ok(())
    }

    /// A partial commit: `pages` pages of slot `slot_index` from `first_page` are copied (a
    /// migration's destination acknowledged them) and leave the set, so an abort no longer
    /// owes them again. Pages dirtied since the take are not affected: they are in the log or
    /// owed, not in this set.
    pub fn commit_pages(
        &mut self,
        slot_index: usize,
        first_page: PageIndex,
        pages: u64,
    ) -> Result<(), Error> {
        let i = self.h.index(slot_index)?;
        set_range(
            &self.h.slots[i],
            &mut self.bitmaps[i],
            first_page.raw(),
            pages,
            false,
        )
    }

    /// [`Harvester::collect`] while this set is out — e.g. on `KVM_EXIT_DIRTY_RING_FULL`
    /// during the copy. What it collects was dirtied after the take: it goes to the pages owed
    /// (the next take), not into this set.
    pub fn collect(&mut self) -> Result<u64, S::Error> {
        self.h.collect()
    }

    /// The pages are copied: they are owed no more.
    pub fn commit(mut self) {
        self.settled = true;
    }

    /// The copy failed: every page of the set is owed again (the same as dropping the set).
    pub fn abort(self) {}
}

impl<S: DirtyLogSource> Drop for DirtySet<'_, S> {
    fn drop(&mut self) {
        let h = &mut *self.h;
        for ((b, t), (o, ot)) in self
            .bitmaps
            .iter_mut()
            .zip(&mut self.touched)
            .zip(h.owed.iter_mut().zip(&mut h.touched))
        {
            if !self.settled {
                for w in t.nonzero(b) {
                    ot.or(o, w, b[w]);
                }
            }
            // The bitmaps go back, zeroed word by listed word, as the next take's spare.
            t.clear(b);
        }
        h.spare = std::mem::take(&mut self.bitmaps);
    }
}
