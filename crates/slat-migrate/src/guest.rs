//! What a migration needs from a VMM; documented on [`Guest`].

use crate::error::{GuestError, MapError, MemoryError};
use crate::state::StateBlob;
use crate::stream::{check_regions, Region, PAGE_BYTES};
use slat_addr::{Hva, PageIndex};
use slat_dirty::{DirtyLogSource, Harvester, KvmLog, LogMode, Memslot, SlotInfo};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One region of guest memory as the host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestRegion {
    /// Where it is in the guest, how big, and whether the guest may write it.
    pub region: Region,
    /// Host address of its first byte (8-byte aligned; see [`Guest`]'s safety contract).
    pub host: Hva,
}

/// The guest a migration moves, as any VMM can offer it: a memory map of guest-physical
/// regions, pause and resume, a dirty log, and device state. Object safe: the ends hold an
/// `Arc<dyn Guest>`.
///
/// [`Guest`] is what the two ends need and nothing more. Memory is a list of regions
/// ([`GuestRegion`]: guest-physical address, pages, host address, read-only flag), with holes
/// between them where the guest has none; the writable ones are dirty-logged through
/// `slat_dirty`'s transactional [`Harvester`] over any [`DirtyLogSource`] (a KVM VM's
/// `KvmLog`, slat's machines, a VMM's own software log); read-only regions (ROM) are copied
/// once and never logged. Device and vCPU state leave as opaque, versioned blobs
/// ([`StateBlob`]) once the vCPUs are paused and come back through
/// [`Guest::restore_state`] on the destination. Nothing here knows a workload: slat's own
/// benchmark guests and their synthetic writer live in the `slat-harness` crate, which
/// depends on this one.
///
/// A minimal KVM VMM implements it in a few lines per method: `regions` lists its memslots'
/// (gpa, size, mmap address), `dirty_log` wraps its memslots in `Harvester::new`, `pause` and
/// `resume` stop and start its vCPU threads, and `save_state`/`restore_state` carry its
/// registers (`KVM_GET_REGS` & co.) and device models. A sketch, for a VM with two RAM slots
/// around a hole (the VMM's own `Vcpus` thread handling elided; `tests/migrate/common/soft.rs` is a
/// complete guest without KVM; `examples/minimal_vmm.rs` a complete one on KVM):
///
/// ```ignore
/// struct MyVm { vm: Arc<VmFd>, ram: [(slat_addr::Gpa, &'static mut [u8]); 2], vcpus: Vcpus }
///
/// // SAFETY: both RAM mappings are mmap'd for the VM's life and touched only by the vCPUs.
/// unsafe impl Guest for MyVm {
///     fn kind(&self) -> &str { "my-vmm" }
///     fn regions(&self) -> Vec<GuestRegion> {
///         self.ram.iter().map(|(gpa, m)| GuestRegion {
///             region: Region { gpa: *gpa, pages: m.len() as u64 / 4096, read_only: false },
///             host: slat_addr::Hva::from_ptr(m.as_ptr()),
///         }).collect()
///     }
///     fn pause(&self) -> Result<(), GuestError> { self.vcpus.stop(); Ok(()) }
///     fn resume(&self) -> Result<(), GuestError> { self.vcpus.run(); Ok(()) }
///     fn running(&self) -> bool { self.vcpus.running() }
///     fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError> {
///         for s in self.memslots() { s.set_dirty_logging(on).map_err(GuestError::machine)? }
///         Ok(())
///     }
///     fn dirty_log(&self) -> Result<GuestHarvester, GuestError> {
///         kvm_dirty_log(self.memslots(), LogMode::Get)
///     }
///     fn save_state(&self) -> Result<Vec<StateBlob>, GuestError> {
///         let regs = self.vcpus.regs(); // KVM_GET_REGS, SREGS, ...: the VMM's encoding
///         Ok(vec![StateBlob { id: "vcpu0".into(), version: 1, data: regs }])
///     }
///     fn restore_state(&self, blobs: Vec<StateBlob>) -> Result<(), GuestError> {
///         for b in blobs { self.vcpus.set_regs(&b.id, b.version, &b.data)?; }
///         Ok(())
///     }
/// }
/// ```
///
/// # Safety
///
/// [`Memory`] reads and writes guest memory through the host addresses of
/// [`Guest::regions`] without further checks, so an implementor guarantees, for every region
/// it returns: `[host, host + pages * 4 KiB)` is mapped readable and writable by the host,
/// `host` is 8-byte aligned, and the mapping stays so for as long as the guest lives (and
/// `regions` returns the same list every time); the guest's own code accesses those bytes
/// only atomically (or, for a KVM vCPU, by hardware outside the program) and never lends
/// them out as references, so [`Memory`]'s atomic accesses race with nothing; and
/// [`Guest::running`] is true whenever any vCPU may write that memory.
///
/// A guest whose [`Guest::demand_paged`] is true also guarantees, as a post-copy destination,
/// that every region's host range is private anonymous memory of 4 KiB pages (what
/// `mmap(MAP_PRIVATE | MAP_ANONYMOUS)` gives) with no userfaultfd of its own, which the
/// migration may discard (`MADV_DONTNEED`) and register with a userfaultfd while the guest is
/// paused; and that whatever touches guest memory while the guest runs (its vCPUs, its
/// devices) may wait for a page that has not arrived.
pub unsafe trait Guest: Send + Sync {
    /// A short name of the machine or VMM, for reports and the peer ("sim", "kvm", ...).
    fn kind(&self) -> &str;
    /// The memory map, in ascending guest-physical order, regions disjoint.
    fn regions(&self) -> Vec<GuestRegion>;
    /// An opaque description of the machine that a destination's factory may need to build
    /// one to fit ([`crate::stream::MAX_MACHINE`] bytes at most). Empty by default: a VMM's
    /// destination is normally started with the same configuration.
    fn machine(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Stops the vCPUs (out of guest mode) and waits for them. Idempotent.
    fn pause(&self) -> Result<(), GuestError>;
    /// Runs the vCPUs again (after a failed migration on the source; after the switch-over
    /// on the destination). Idempotent.
    fn resume(&self) -> Result<(), GuestError>;
    /// Whether a vCPU may be running.
    fn running(&self) -> bool;
    /// Turns dirty logging on or off on every writable region.
    fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError>;
    /// The dirty log: one tracked slot per *writable* region, in the map's order, each of the
    /// region's pages (checked when a migration starts). Its takes re-arm the log before they
    /// return; a set dropped uncommitted is owed again.
    fn dirty_log(&self) -> Result<GuestHarvester, GuestError>;
    /// Device and vCPU state, called with the vCPUs paused, after the last pages were sent.
    fn save_state(&self) -> Result<Vec<StateBlob>, GuestError> {
        Ok(Vec::new())
    }
    /// The source's device state, called with the vCPUs paused before the switch-over; an
    /// error (an id or version this guest does not read) refuses the migration and the source
    /// runs on.
    fn restore_state(&self, blobs: Vec<StateBlob>) -> Result<(), GuestError> {
        match blobs.into_iter().next() {
            None => Ok(()),
            Some(b) => Err(GuestError::State {
                id: b.id,
                version: b.version,
                why: "this guest has no device state".into(),
            }),
        }
    }
    /// Sets the auto-converge throttle: percent of time the vCPUs are kept out of the guest.
    /// A guest without one ignores it (auto-converge then cannot slow it down).
    fn set_throttle(&self, _percent: u32) {}
    /// The throttle now.
    fn throttle(&self) -> u32 {
        0
    }
    /// vCPU time taken away by the throttle, summed over vCPUs, since creation.
    fn throttled(&self) -> Duration {
        Duration::ZERO
    }
    /// A counter of work the guest did (e.g. writes), for reports; `None` if it has none.
    fn activity(&self) -> Option<u64> {
        None
    }
    /// vCPUs a per-vCPU dirty limit can slow one by one ([`Guest::set_vcpu_throttle_ppm`]);
    /// 0 (the default): none, and the source refuses `Converge::DirtyLimit`.
    fn limitable_vcpus(&self) -> usize {
        0
    }
    /// Sets vCPU `vcpu`'s own throttle (dirty-limit): parts per million of its time kept out
    /// of the guest, at most [`crate::dirty_limit::MAX_PPM`].
    fn set_vcpu_throttle_ppm(&self, _vcpu: usize, _ppm: u32) {}
    /// [`Guest::activity`] per vCPU (empty if the guest does not count it so).
    fn vcpu_activity(&self) -> Vec<u64> {
        Vec::new()
    }
    /// Whether this guest, as a post-copy destination, can run before all its memory has
    /// arrived: its memory is filled on demand through a userfaultfd (the contract is in the
    /// trait's safety section). False by default: a destination then refuses post-copy.
    fn demand_paged(&self) -> bool {
        false
    }
}

/// A guest's dirty log as the source harvests it: any machine's, errors as [`GuestError`]
/// (`Box::new(log.map_err(GuestError::machine)) as GuestLog`, with
/// [`DirtyLogSource::map_err`]).
pub type GuestLog = Box<dyn DirtyLogSource<Error = GuestError> + Send>;

/// The transactional harvester of a guest's dirty log ([`Guest::dirty_log`]).
pub type GuestHarvester = Harvester<GuestLog>;

/// The dirty log of a KVM VMM's own memslots, as [`Guest::dirty_log`] returns it: `slots`
/// (one per writable region, in the map's order, as the VMM registered them with
/// [`Memslot::register`] or described them with [`Memslot::adopt`]) in `mode` — GET, or
/// manual protect if the VMM enabled it on the VM. (The ring mode needs the vCPUs' rings:
/// build a [`KvmLog`] with them and map its errors as this does.)
pub fn kvm_dirty_log(slots: Vec<Memslot>, mode: LogMode) -> Result<GuestHarvester, GuestError> {
    let log = KvmLog::new(slots, mode, Vec::new()).map_err(GuestError::harvest)?;
    let log: GuestLog = Box::new(log.map_err(GuestError::machine));
    Harvester::from_source(log).map_err(GuestError::harvest)
}

/// A checked memory map with its *memory index*: the regions laid end to end, so page `p`
/// of the stream is page `p - start[i]` of the region `i` whose pages hold it.
#[derive(Debug, Clone)]
pub struct MemoryMap {
    regions: Vec<GuestRegion>,
    /// Memory index of each region's first page.
    starts: Vec<u64>,
    pages: u64,
}

impl MemoryMap {
    /// Checks `regions` ([`check_regions`], and 8-byte aligned host addresses whose ends fit
    /// the address space).
    pub fn new(regions: Vec<GuestRegion>) -> Result<MemoryMap, MapError> {
        let wire: Vec<Region> = regions.iter().map(|r| r.region).collect();
        let pages = check_regions(&wire)?;
        let mut starts = Vec::with_capacity(regions.len());
        let mut at = 0u64;
        for (index, r) in regions.iter().enumerate() {
            // `check_regions` bounded every region by 2^52 bytes.
            let ok = r.host.is_aligned(8)
                && r.host
                    .checked_add(r.region.pages * PAGE_BYTES as u64)
                    .is_some();
            if !ok {
                return Err(MapError::Host {
                    index,
                    host: r.host,
                });
            }
            starts.push(at);
            at += r.region.pages;
        }
        Ok(MemoryMap {
            regions,
            starts,
            pages,
        })
    }

    /// Pages in all regions.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The map as the stream carries it.
    pub fn wire(&self) -> Vec<Region> {
        self.regions.iter().map(|r| r.region).collect()
    }

    /// The regions.
    pub fn regions(&self) -> &[GuestRegion] {
        &self.regions
    }

    /// Memory index of region `i`'s first page.
    pub fn start(&self, i: usize) -> u64 {
        self.starts[i]
    }

    /// (region, page in it) of memory index `p < pages`.
    pub(crate) fn locate(&self, p: u64) -> (usize, u64) {
        let i = self.starts.partition_point(|&s| s <= p) - 1;
        (i, p - self.starts[i])
    }

    /// Memory indexes of the read-only regions' pages, as (first, count) runs.
    pub fn read_only(&self) -> Vec<(u64, u64)> {
        self.regions
            .iter()
            .zip(&self.starts)
            .filter(|(r, _)| r.region.read_only)
            .map(|(r, &s)| (s, r.region.pages))
            .collect()
    }

    /// The memory index of the first page of each writable region, checked against the
    /// slots of a dirty log (one per writable region, in order, of its size).
    pub fn log_starts(&self, slots: &[SlotInfo]) -> Result<Vec<u64>, MapError> {
        let writable: Vec<(u64, u64)> = self
            .regions
            .iter()
            .zip(&self.starts)
            .filter(|(r, _)| !r.region.read_only)
            .map(|(r, &s)| (s, r.region.pages))
            .collect();
        let same = writable.len() == slots.len()
            && writable.iter().zip(slots).all(|(w, s)| w.1 == s.pages);
        if !same {
            return Err(MapError::LogSlots {
                slots: slots.len(),
                slot_pages: slots.iter().take(8).map(|s| s.pages).collect(),
                regions: writable.iter().take(8).map(|w| w.1).collect(),
            });
        }
        Ok(writable.into_iter().map(|w| w.0).collect())
    }
}

/// Guest memory, read and written by the host, addressed by memory index.
///
/// Every access goes through relaxed atomic loads and stores of aligned 8-byte words, and
/// nothing here hands out a reference into guest memory. That is what keeps it sound from
/// safe code: a vCPU storing to a page (atomically, as [`Guest`]'s contract requires), or
/// another thread's `Memory` writing it, races with nothing here in the language's sense;
/// at worst a copy holds a mix of old and new words, which the dirty log (during pre-copy)
/// and the verification (at switch-over) account for.
///
/// The `stopped_*` methods also check that no vCPU runs: not for soundness but for meaning
/// (a hash or a received page is only right for memory that does not change meanwhile).
///
/// Why copy out rather than lend `&[u8]` over guest memory: a slice would need the guest to
/// stay stopped, and no other writer to run, for as long as it lives. A `running()` check when
/// it is made does not ensure that (another holder of the `Arc<dyn Guest>` can start the vCPUs
/// a moment later, and a data race on memory behind a shared reference is undefined
/// behaviour); a guard blocking `Guest::start` would put a lock into every machine and a
/// deadlock into any caller that forgot to drop it; an `unsafe fn` would move the problem to
/// every caller. A copy of one verification range (256 KiB, reused) costs a cache-resident
/// memcpy beside the hash of the same bytes, and misuse is then impossible.
pub struct Memory<'g> {
    guest: &'g dyn Guest,
    map: MemoryMap,
}

impl<'g> Memory<'g> {
    /// The memory of `guest`, its map checked.
    pub fn new(guest: &'g dyn Guest) -> Result<Memory<'g>, MapError> {
        Ok(Memory {
            guest,
            map: MemoryMap::new(guest.regions())?,
        })
    }

    /// Pages in all regions.
    pub fn pages(&self) -> u64 {
        self.map.pages
    }

    /// The map.
    pub fn map(&self) -> &MemoryMap {
        &self.map
    }

    /// Checks that pages `first..end` exist.
    fn check(&self, first: u64, end: u64) -> Result<(), MemoryError> {
        if first > end || end > self.map.pages {
            return Err(MemoryError::OutOfRange {
                first,
                end,
                pages: self.map.pages,
            });
        }
        Ok(())
    }

    /// Calls `f(host address, pages, bytes before it in the access)` for each piece of pages
    /// `first..end` (checked) that lies in one region.
    fn pieces(
        &self,
        first: u64,
        end: u64,
        mut f: impl FnMut(u64, u64, usize),
    ) -> Result<(), MemoryError> {
        self.check(first, end)?;
        let mut p = first;
        while p < end {
            let (i, off) = self.map.locate(p);
            let r = &self.map.regions[i];
            let n = (r.region.pages - off).min(end - p);
            // `off < pages` of a region whose host range fits 64 bits (`MemoryMap::new`).
            f(
                r.host.raw() + off * PAGE_BYTES as u64,
                n,
                ((p - first) * PAGE_BYTES as u64) as usize,
            );
            p += n;
        }
        Ok(())
    }

    /// Copies pages `first..end` into `out` (exactly their size) word by word, whether or not
    /// vCPUs run; returns the OR of all words copied (zero: every byte was zero), folded into
    /// the copy so that the send path does not scan the page a second time.
    fn load_pages(&self, first: u64, end: u64, out: &mut [u8]) -> Result<u64, MemoryError> {
        self.check(first, end)?;
        let want = (end - first) * PAGE_BYTES as u64;
        if out.len() as u64 != want {
            return Err(MemoryError::RangeBuffer {
                len: out.len(),
                want,
            });
        }
        let mut any = 0u64;
        self.pieces(first, end, |addr, n, at| {
            let src = addr as *const u64;
            let dst = &mut out[at..at + n as usize * PAGE_BYTES];
            for (i, chunk) in dst.chunks_exact_mut(8).enumerate() {
                // SAFETY: `[addr, addr + n pages)` lies in one region of the map (checked
                // against the map's pages), which stays mapped while the guest (borrowed by
                // `self`) lives, by `Guest`'s contract; `addr` is 8-byte aligned and
                // `i * 8 < n pages`, so the word is aligned and inside it. Every other access
                // to guest memory is atomic (the vCPUs', by `Guest`'s contract, and this
                // type's stores), so an atomic load races with nothing.
                let v =
                    unsafe { AtomicU64::from_ptr(src.add(i) as *mut u64) }.load(Ordering::Relaxed);
                any |= v;
                chunk.copy_from_slice(&v.to_ne_bytes());
            }
        })?;
        Ok(any)
    }

    /// Copies page `p` (a memory index) into `out` (one page) while vCPUs may be writing it.
    pub fn read_page(&self, p: PageIndex, out: &mut [u8]) -> Result<(), MemoryError> {
        self.read_page_zero(p, out).map(drop)
    }

    /// [`Memory::read_page`], also saying whether the copy is all zero bytes (found during
    /// the copy, not by a second pass).
    pub fn read_page_zero(&self, p: PageIndex, out: &mut [u8]) -> Result<bool, MemoryError> {
        let p = p.raw();
        if out.len() != PAGE_BYTES {
            return Err(MemoryError::Buffer { len: out.len() });
        }
        Ok(self.load_pages(p, p.saturating_add(1), out)? == 0)
    }

    /// Copies pages `first..end` into `out` (exactly their size), while the vCPUs are stopped.
    pub fn stopped_read(
        &self,
        first: PageIndex,
        end: PageIndex,
        out: &mut [u8],
    ) -> Result<(), MemoryError> {
        let (first, end) = (first.raw(), end.raw());
        if self.guest.running() {
            return Err(MemoryError::Running("read as a whole"));
        }
        self.load_pages(first, end, out).map(drop)
    }

    /// Pages `first..end`, copied out while the vCPUs are stopped.
    pub fn stopped_range(&self, first: PageIndex, end: PageIndex) -> Result<Vec<u8>, MemoryError> {
        self.check(first.raw(), end.raw())?;
        let want = (end.raw() - first.raw()) * PAGE_BYTES as u64;
        let len = usize::try_from(want).map_err(|_| MemoryError::RangeBuffer { len: 0, want })?;
        let mut out = vec![0u8; len];
        self.stopped_read(first, end, &mut out)?;
        Ok(out)
    }

    /// Writes page `p` while the vCPUs are stopped (the destination, before switch-over).
    pub fn stopped_write_page(&self, p: PageIndex, data: &[u8]) -> Result<(), MemoryError> {
        self.stopped_write_page_zero(p, data).map(drop)
    }

    /// [`Memory::stopped_write_page`], also saying whether the page written is all zero bytes
    /// (found during the write, not by a second pass).
    pub fn stopped_write_page_zero(&self, p: PageIndex, data: &[u8]) -> Result<bool, MemoryError> {
        Ok(self.stopped_write_words(p, data, 0..PAGE_BYTES / 8)? == 0)
    }

    /// Stores the words `words` (8-byte word indexes, clipped to the page) of `data` (one
    /// page) into page `p` while the vCPUs are stopped: a delta's runs are written back
    /// without the rest of the page. Returns the OR of the words stored.
    pub fn stopped_write_words(
        &self,
        p: PageIndex,
        data: &[u8],
        words: std::ops::Range<usize>,
    ) -> Result<u64, MemoryError> {
        let p = p.raw();
        if self.guest.running() {
            return Err(MemoryError::Running("written"));
        }
        if data.len() != PAGE_BYTES {
            return Err(MemoryError::Buffer { len: data.len() });
        }
        let words = words.start.min(PAGE_BYTES / 8)..words.end.min(PAGE_BYTES / 8);
        let mut any = 0u64;
        self.pieces(p, p.saturating_add(1), |addr, _, _| {
            let dst = addr as *const u64;
            let chunks = data.chunks_exact(8).enumerate();
            for (i, chunk) in chunks.skip(words.start).take(words.len()) {
                let mut w = [0u8; 8];
                w.copy_from_slice(chunk);
                let v = u64::from_ne_bytes(w);
                any |= v;
                // SAFETY: page `p` lies in one region of the map (checked against the map's
                // pages), which stays mapped while the guest (borrowed by `self`) lives, by
                // `Guest`'s contract; `i < 512`, so the word is inside the page, 8-byte
                // aligned. The store is atomic, like every other access to guest memory, so
                // a vCPU started meanwhile or another writer races with nothing.
                unsafe { AtomicU64::from_ptr(dst.add(i) as *mut u64) }.store(v, Ordering::Relaxed);
            }
        })?;
        Ok(any)
    }

    /// Fills `percent` of the pages (chosen by `seed`) with pseudo-random bytes and zeroes
    /// the rest, while the vCPUs are stopped: a guest whose memory holds data, not only
    /// the 8-byte stamps of its workload, so pages cost their real size on the wire and a
    /// wrong byte anywhere shows in the hashes.
    pub fn stopped_fill(&self, percent: u32, seed: u64) -> Result<(), MemoryError> {
        let mut page = vec![0u8; PAGE_BYTES];
        for p in 0..self.map.pages {
            let mut x = splitmix(seed ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            if x % 100 < percent as u64 {
                for c in page.chunks_exact_mut(8) {
                    x = splitmix(x);
                    c.copy_from_slice(&x.to_ne_bytes());
                }
            } else {
                page.fill(0);
            }
            self.stopped_write_page(PageIndex::new(p), &page)?;
        }
        Ok(())
    }
}

/// SplitMix64: a fast, well-mixed step for filler bytes and seeded test schedules.
pub fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
