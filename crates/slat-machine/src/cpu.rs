//! A simulated vCPU: guest-mode entry and exit, request servicing, the software TLB, and the
//! hardware page walker that reads the real PTE format.
//!
//! Every guest access is: service pending requests → TLB lookup → on a miss, walk the table
//! (setting A/D bits the way EPT hardware does) → on a missing or insufficient permission,
//! try the engine's lock-free fast path *in guest mode*, else exit guest mode, run the slow
//! path, and re-enter → retry → the real load or store on host memory.
//!
//! A timed pass ([`Cpu::start_timing`]) writes with [`Cpu::write_u64_timed`], which times each
//! write that faults from the fault to its completion; an untimed pass pays one predictable
//! branch per fault and never reads the clock.
//!
//! Everything the simulated hardware does is reported to the format's clock (`F::Clock`):
//! TLB hits, misses and flushes, walk steps and the A/D compare-and-swap, data accesses, VM
//! exits and entries, request polls. With `RealTime` each report compiles to nothing.

use crate::sched::PcpuPool;
use crate::tlb::{Tlb, TlbError};
use slat::clock::{addr_of, Clock, Cost};
use slat::direct_map::{HostCpu, Online};
use slat::hw::{self, bytes_per_entry, table_index, TablePage};
use slat::{Access, Fault, FaultOutcome, GuestMode, HostRange, PteFormat, Vcpu, Vm};
use slat_addr::{Gfn, Gpa, Hva};
use slat_workload::latency::{latency_histogram, record_latency, LatencyHistogram};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Accesses between checks whether another vCPU waits for a physical CPU.
const QUANTUM: u32 = 4096;

/// Why an access could not complete: an exit to the VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// No memslot at this address (MMIO).
    Mmio {
        /// The address.
        gpa: u64,
    },
    /// A write to a read-only memslot.
    ReadOnly {
        /// The address.
        gpa: u64,
    },
    /// The dirty ring is full and no handler was installed to empty it.
    DirtyRingFull,
    /// The walker was about to cache a translation of `gpa` while the TLB still held one of
    /// another size for it: an arm64 TLB conflict abort, which only a broken break-before-make
    /// causes (checked on formats that require it; x86 may hold both).
    TlbConflict {
        /// The address.
        gpa: u64,
    },
    /// An 8-byte access at an address that is not 8-byte aligned (an alignment check): the
    /// bytes could straddle two guest pages, which translate to unrelated host pages.
    Unaligned {
        /// The address.
        gpa: u64,
    },
    /// The access's kind (private or shared, see [`Cpu::set_private`]) disagrees with the
    /// page's memory attribute (KVM_EXIT_MEMORY_FAULT): the VMM converts the page or stops.
    MemoryFault {
        /// The faulting page.
        gpa: u64,
        /// Bytes covered.
        size: u64,
        /// The access was private.
        private: bool,
    },
    /// A guest access while the vCPU is outside guest mode ([`Cpu::enter`] first): outside
    /// it, flushes do not wait for this vCPU, so its TLB and walks could use freed tables.
    NotInGuest,
}

/// PAUSE instructions standing in for the guest entry and exit between a retried fault and the
/// next (about 1.5 µs on current x86 cores).
const RETRY_ROUND_TRIP_PAUSES: u32 = 64;

/// The real-time stand-in for a guest exit and entry ([`Cost::GuestRoundTrip`]): a PAUSE loop.
/// `slat calibrate` times this very function for the host's profile, so virtual time charges
/// what the real-time machine spends here.
#[inline(never)]
pub fn guest_round_trip_stand_in() {
    for _ in 0..RETRY_ROUND_TRIP_PAUSES {
        std::hint::spin_loop();
    }
}

/// A guest exit and entry around an event the guest does not see: the PAUSE loop in real time,
/// its cost in virtual time.
#[inline]
fn guest_round_trip<C: Clock>() {
    if C::VIRTUAL {
        C::charge(Cost::GuestRoundTrip, 1);
    } else {
        guest_round_trip_stand_in();
    }
}

/// Called on the vCPU thread, outside guest mode, when its dirty ring reached the soft limit
/// (KVM_EXIT_DIRTY_RING_FULL): must harvest and reset the rings before returning.
pub type RingFullHandler = Arc<dyn Fn() + Send + Sync>;

/// Counters of one vCPU's hardware activity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuCounters {
    /// Guest accesses completed.
    pub accesses: u64,
    /// Page walks (TLB misses).
    pub walks: u64,
    /// Faults taken (fast or slow).
    pub faults: u64,
    /// TLB flushes serviced.
    pub tlb_flushes: u64,
    /// Accessed/Dirty bit updates by the walker.
    pub ad_updates: u64,
    /// Exits because the dirty ring was full.
    pub ring_full_exits: u64,
    /// Walks that faulted on an entry as it was at this vCPU's virtual time, before another
    /// CPU's write later in virtual time (always 0 in real time).
    pub stale_walks: u64,
    /// TLB conflicts (see [`Exit::TlbConflict`]).
    pub tlb_conflicts: u64,
    /// Kernel TLB flushes of the host direct map this CPU acknowledged.
    pub kernel_tlb_flushes: u64,
}

/// A vCPU thread's hardware state.
pub struct Cpu<F: PteFormat> {
    vcpu: Vcpu<F>,
    tlb: Tlb,
    pool: Arc<PcpuPool>,
    root: u64,
    /// Present while in guest mode (and holding a physical CPU).
    guest: Option<GuestMode<F::Clock>>,
    quantum: u32,
    ring_full: Option<RingFullHandler>,
    /// The latencies of faulting writes, during a timed pass.
    latency: Option<LatencyHistogram>,
    /// When (`F::Clock::now_ns`) the timed write in progress found it had to fault (moved
    /// later by the time spent in ring-full exits, which is the VMM's harvest, not the fault's).
    fault_start: Option<u64>,
    /// Ordinary accesses are private (a confidential guest mapping its memory with the
    /// C-bit set); [`Cpu::write_u64_as`] picks the kind per access.
    private: bool,
    /// Host addresses of private memory (SNP's RMP, reduced to "is this page a guest's
    /// private page"): the walker faults when an access's kind disagrees with its leaf's.
    rmp: Option<(u64, u64)>,
    /// This thread as a host CPU of the direct map, online exactly while in guest mode.
    host: Option<(HostCpu, Option<Online<F::Clock>>)>,
    /// The pool guest data accesses go to when guest memory is phantom
    /// ([`Cpu::set_phantom`]), 0 otherwise: one predictable test per access.
    phantom_pool: u64,
    /// Keeps that pool mapped.
    phantom: Option<HostRange>,
    /// Other vCPUs access the same guest data ([`Cpu::set_shared_data`]).
    shared_data: bool,
    /// Counters.
    pub counters: CpuCounters,
}

impl<F: PteFormat> Cpu<F> {
    /// A vCPU of `vm` with a TLB of `tlb_entries` entries (see [`Tlb::new`]), scheduled on
    /// `pool`.
    pub fn new(
        vm: Arc<Vm<F>>,
        id: u32,
        tlb_entries: usize,
        pool: Arc<PcpuPool>,
    ) -> Result<Self, TlbError> {
        // The TLB first: a refused count leaves no vCPU behind in the VM.
        let tlb = Tlb::new(tlb_entries)?;
        let vcpu = vm.create_vcpu(id);
        let root = hw::root_addr(&vm);
        Ok(Cpu {
            vcpu,
            tlb,
            pool,
            root: root.raw(),
            guest: None,
            quantum: 0,
            ring_full: None,
            latency: None,
            fault_start: None,
            private: false,
            rmp: None,
            host: None,
            phantom_pool: 0,
            phantom: None,
            shared_data: false,
            counters: CpuCounters::default(),
        })
    }

    /// Declares that other vCPUs access the data this one accesses (`kvm_page_table_test`'s
    /// vCPUs all walk one region): in virtual time each data access then goes through
    /// [`Clock::data_access`], so a line written by one vCPU and accessed by another costs
    /// its transfer. Off by default: memstress's vCPUs each have their own region, and the
    /// hook would only slow the simulation. No effect in real time.
    pub fn set_shared_data(&mut self, shared: bool) {
        self.shared_data = shared;
    }

    /// Makes ordinary accesses private (or shared again), as a confidential guest does.
    pub fn set_private(&mut self, private: bool) {
        self.private = private;
    }

    /// Declares `[start, end)` (host addresses) the private pool: a leaf into it serves only
    /// private accesses, any other leaf only shared ones (the hardware's RMP check).
    pub fn set_private_pool(&mut self, start: u64, end: u64) {
        self.rmp = Some((start, end));
    }

    /// Guest memory is phantom ([`slat::HostMemory::phantom_pool`]): every data access goes
    /// to [`slat::phantom_addr`] in `range`'s pool, which this CPU keeps mapped. A vCPU of a
    /// VM with phantom memslots needs this before its first access (the reservation itself
    /// is inaccessible); a range that is not phantom changes nothing.
    pub fn set_phantom(&mut self, range: HostRange) {
        if let Some(pool) = range.phantom_pool() {
            self.phantom_pool = pool.raw();
            self.phantom = Some(range);
        }
    }

    /// Where the data of `hva` lives: itself, or its frame in the phantom pool. A compare and
    /// a branch for real memory: the redirect is out of line, so the compiler does not compute
    /// it on every access to select it afterwards (6 instructions per access instead).
    #[inline(always)]
    fn data_addr(&self, hva: u64) -> u64 {
        if self.phantom_pool != 0 {
            return self.phantom_data_addr(hva);
        }
        hva
    }

    #[cold]
    #[inline(never)]
    fn phantom_data_addr(&self, hva: u64) -> u64 {
        slat::phantom_addr(Hva::new(self.phantom_pool), Hva::new(hva)).raw()
    }

    /// Runs this thread as `host`, a host CPU of a direct map: online (waited for by kernel
    /// TLB flushes) exactly while in guest mode, and acknowledging at access boundaries.
    /// Call outside guest mode.
    pub fn attach_host_cpu(&mut self, host: HostCpu) {
        debug_assert!(self.guest.is_none());
        self.host = Some((host, None));
    }

    /// Installs what a dirty-ring-full exit runs.
    pub fn set_ring_full_handler(&mut self, h: RingFullHandler) {
        self.ring_full = Some(h);
    }

    /// Starts a timed pass: [`Cpu::write_u64_timed`] records into a new, empty histogram.
    /// Until [`Cpu::take_latency`], every write must go through it (a fault of
    /// [`Cpu::write_u64`] would leave its start for the next timed write).
    pub fn start_timing(&mut self) {
        self.latency = Some(latency_histogram());
    }

    /// Ends a timed pass: the latencies recorded since [`Cpu::start_timing`] (`None` if the
    /// pass was not timed).
    pub fn take_latency(&mut self) -> Option<LatencyHistogram> {
        self.latency.take()
    }

    /// The engine's vCPU.
    pub fn vcpu(&self) -> &Vcpu<F> {
        &self.vcpu
    }

    /// Takes a physical CPU and enters guest mode (nothing if already in it).
    pub fn enter(&mut self) {
        if self.guest.is_some() {
            return;
        }
        self.pool.acquire();
        self.enter_guest_mode();
    }

    /// Leaves guest mode and gives the physical CPU back (a sync exit: GUEST_SYNC, stop).
    pub fn exit(&mut self) {
        if self.guest.is_some() {
            self.leave_guest_mode();
            self.pool.release();
        }
    }

    #[inline]
    fn enter_guest_mode(&mut self) {
        F::Clock::charge(Cost::VmEntry, 1);
        let guest = self.vcpu.enter_guest();
        if guest.requests_at_entry() != 0 {
            self.service();
        }
        self.guest = Some(guest);
        if self.host.is_some() {
            self.host_online();
        }
    }

    /// Leaves guest mode (keeping the physical CPU): the slow path may block.
    #[inline]
    fn leave_guest_mode(&mut self) {
        F::Clock::charge(Cost::VmExit, 1);
        self.guest = None;
        if let Some((_, online)) = &mut self.host {
            *online = None;
        }
    }

    #[cold]
    fn host_online(&mut self) {
        if let Some((cpu, online)) = &mut self.host {
            let token = cpu.online_with::<F::Clock>();
            if token.requests_at_entry() != 0 {
                self.counters.kernel_tlb_flushes += 1;
                cpu.service_with::<F::Clock>(|| {});
            }
            *online = Some(token);
        }
    }

    #[cold]
    fn host_service(&mut self) {
        if let Some((cpu, _)) = &self.host {
            let counters = &mut self.counters;
            // This CPU caches no direct-map translation, but the flush reached it as an
            // interrupt while it ran a guest: a VM exit, the handler and the re-entry, which
            // the flusher waits for, as a retried fault's round trip.
            cpu.service_with::<F::Clock>(|| {
                counters.kernel_tlb_flushes += 1;
                F::Clock::charge(Cost::IpiHandler, 1);
                guest_round_trip::<F::Clock>();
            });
        }
    }

    #[inline]
    fn service(&mut self) {
        let tlb = &mut self.tlb;
        let counters = &mut self.counters;
        self.vcpu.service_requests(|| {
            F::Clock::charge(Cost::TlbFlush, 1);
            tlb.flush();
            counters.tlb_flushes += 1;
        });
    }

    /// Checks requests and the quantum at an access boundary.
    #[inline]
    fn boundary(&mut self) {
        if self.vcpu.pending_requests() != 0 {
            self.service();
        }
        if let Some((cpu, _)) = &self.host {
            if cpu.pending_with::<F::Clock>() != 0 {
                self.host_service();
            }
        }
        self.quantum += 1;
        if self.quantum >= QUANTUM {
            self.quantum = 0;
            if self.pool.contended() {
                self.exit();
                self.enter();
            }
        }
    }

    /// Writes `val` to guest physical address `gpa`, which must be 8-byte aligned
    /// ([`Exit::Unaligned`] otherwise), in guest mode ([`Exit::NotInGuest`] otherwise).
    #[inline]
    pub fn write_u64(&mut self, gpa: u64, val: u64) -> Result<(), Exit> {
        let hva = self.translate(gpa, Access::Write, self.private)?;
        self.store(hva, val);
        Ok(())
    }

    /// [`Cpu::write_u64`] as a private (`true`) or shared access, whatever
    /// [`Cpu::set_private`] says.
    pub fn write_u64_as(&mut self, gpa: u64, val: u64, private: bool) -> Result<(), Exit> {
        let hva = self.translate(gpa, Access::Write, private)?;
        self.store(hva, val);
        Ok(())
    }

    /// [`Cpu::read_u64`] as a private (`true`) or shared access.
    pub fn read_u64_as(&mut self, gpa: u64, private: bool) -> Result<u64, Exit> {
        let hva = self.translate(gpa, Access::Read, private)?;
        Ok(self.load(hva))
    }

    /// The store of a write whose translation `hva` the walk or the TLB just gave.
    #[inline]
    fn store(&mut self, hva: u64, val: u64) {
        F::Clock::charge(Cost::GuestAccess, 1);
        if F::Clock::VIRTUAL && self.shared_data {
            // The guest's own address, not the phantom pool's that it may be redirected to:
            // guest pages that share a pool frame do not share lines.
            F::Clock::data_access(hva as usize, true);
        }
        let hva = self.data_addr(hva);
        // SAFETY: `hva` is what `translate` just returned (both callers store right after it),
        // so it is inside the host page of a leaf the engine installed for a memslot
        // (`translate` adds only the offset of an 8-byte-aligned `gpa` within its 4 KiB page,
        // so all 8 bytes are in that page). The memslot's `HostRange` keeps that memory mapped
        // for as long as any leaf or cached translation of it can be used: a slot is removed
        // only after its leaves are zapped and a flush this vCPU acknowledged (we do, between
        // accesses, in guest mode). Atomic because other vCPUs and the host may touch the same
        // page concurrently. Phantom memory keeps none of that mapped: the access goes to the
        // same offset of a pool frame, which `self.phantom` keeps mapped.
        unsafe { AtomicU64::from_ptr(hva as *mut u64) }.store(val, Ordering::Relaxed);
        self.counters.accesses += 1;
    }

    /// [`Cpu::write_u64`] in a timed pass: if the write faults, records the time from the
    /// fault to the write's completion (retries included) in the pass's histogram.
    #[inline]
    pub fn write_u64_timed(&mut self, gpa: u64, val: u64) -> Result<(), Exit> {
        let r = self.translate(gpa, Access::Write, self.private);
        // A write that exits never completes: its start must not leak into the next one.
        let hva = r.inspect_err(|_| self.fault_start = None)?;
        self.store(hva, val);
        if let Some(t0) = self.fault_start.take() {
            self.record_fault_latency(t0);
        }
        Ok(())
    }

    /// In a timed pass, at a fault: starts timing the access if it is a write and its first
    /// fault (a retried write keeps its first start).
    #[cold]
    #[inline(never)]
    fn start_fault_timer(&mut self, write: bool) {
        if write && self.fault_start.is_none() {
            self.fault_start = Some(F::Clock::now_ns());
        }
    }

    /// Records the latency of a faulting write that just completed, its fault found at `t0`.
    #[cold]
    fn record_fault_latency(&mut self, t0: u64) {
        let ns = F::Clock::now_ns().saturating_sub(t0);
        if let Some(h) = &mut self.latency {
            record_latency(h, ns);
        }
    }

    /// Reads the 8 bytes at guest physical address `gpa` (8-byte aligned, in guest mode).
    #[inline]
    pub fn read_u64(&mut self, gpa: u64) -> Result<u64, Exit> {
        let hva = self.translate(gpa, Access::Read, self.private)?;
        Ok(self.load(hva))
    }

    /// The load of a read whose translation `hva` the walk or the TLB just gave.
    #[inline]
    fn load(&mut self, hva: u64) -> u64 {
        F::Clock::charge(Cost::GuestAccess, 1);
        if F::Clock::VIRTUAL && self.shared_data {
            // As in `store`.
            F::Clock::data_access(hva as usize, false);
        }
        let hva = self.data_addr(hva);
        // SAFETY: as in `store`.
        let v = unsafe { AtomicU64::from_ptr(hva as *mut u64) }.load(Ordering::Relaxed);
        self.counters.accesses += 1;
        v
    }

    /// Translates `gpa` for `access` of this kind (`private`), faulting as needed; returns the
    /// host address. In a timed pass, a write notes when it found it had to fault in
    /// `fault_start`.
    #[inline]
    fn translate(&mut self, gpa: u64, access: Access, private: bool) -> Result<u64, Exit> {
        if gpa % 8 != 0 {
            return Err(Exit::Unaligned { gpa });
        }
        if self.guest.is_none() {
            return Err(Exit::NotInGuest);
        }
        self.boundary();
        let gfn = gpa >> 12;
        let write = access == Access::Write;
        loop {
            if let Some(page) = self.tlb.lookup(gfn, write, private) {
                F::Clock::charge(Cost::TlbHit, 1);
                return Ok(page + (gpa & 0xfff));
            }
            F::Clock::charge(Cost::TlbMiss, 1);
            let conflicts = self.counters.tlb_conflicts;
            match self.walk(gpa, access, private) {
                Ok(_) if self.counters.tlb_conflicts != conflicts => {
                    return Err(Exit::TlbConflict { gpa })
                }
                Ok(hva) => return Ok(hva),
                Err(present) => self.fault(Fault {
                    private,
                    gpa: Gpa::new(gpa),
                    access,
                    present,
                })?,
            }
            // Requests may have arrived while we faulted (e.g. the flush of a harvest).
            if self.vcpu.pending_requests() != 0 {
                self.service();
            }
        }
    }

    /// The hardware page walk. `Err(present)` reports a fault and whether a leaf with some
    /// permission was there (a permission fault) or not (a not-present fault).
    #[inline]
    fn walk(&mut self, gpa: u64, access: Access, private: bool) -> Result<u64, bool> {
        self.counters.walks += 1;
        let gfn = gpa >> 12;
        let (mut table, mut level) = match self.tlb.leaf_table(gfn) {
            Some(t) => (t, 1),
            None => (self.root, F::ROOT_LEVEL),
        };
        loop {
            // SAFETY: `table` is the root, a table reached through present entries during
            // this access, or the paging-structure cache's table, reached so since our last
            // TLB flush. A table unlinked since is freed only after a remote flush, which
            // waits for us to reach an access boundary while we are in guest mode, or which
            // we service (emptying that cache) before our next access if we were outside; so
            // it is still allocated for the rest of this walk.
            let t = unsafe { TablePage::at(Hva::new(table)) };
            let ep = &t.entries[table_index(Gfn::new(gfn), level)];
            F::Clock::charge(Cost::HwWalkStep, 1);
            let (e, seen) = F::Clock::walk_load(addr_of(ep), || ep.load(Ordering::Acquire));
            if let Err(present) = self.seen_in_time(e, seen, level, access) {
                self.tlb.drop_leaf_table();
                return Err(present);
            }
            if F::hw_is_table(e, level) {
                table = F::output_addr(e).raw();
                level -= 1;
                if level == 1 {
                    self.tlb.insert_leaf_table(gfn, table);
                }
                continue;
            }
            if !F::permits(e, access) {
                // A fault drops the cached structures used for this address (SDM 4.10.4.1):
                // the fix may live in a table that replaced the cached one.
                self.tlb.drop_leaf_table();
                return Err(F::permits(e, Access::Read) || F::permits(e, Access::Exec));
            }
            if let Some((lo, hi)) = self.rmp {
                // The RMP check: a private access through a shared page, or the reverse, is a
                // fault the engine turns into a memory-fault exit (or a retry, while a
                // conversion is still zapping the old leaf).
                if (lo..hi).contains(&F::output_addr(e).raw()) != private {
                    self.tlb.drop_leaf_table();
                    return Err(true);
                }
            }
            let want = F::set_accessed_dirty(e, access);
            if want != e {
                // EPT sets A/D atomically; losing the race means the entry changed: re-walk.
                self.counters.ad_updates += 1;
                F::Clock::rmw(addr_of(ep));
                if ep
                    .compare_exchange(e, want, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    self.tlb.drop_leaf_table();
                    table = self.root;
                    level = F::ROOT_LEVEL;
                    continue;
                }
                F::Clock::entry_replaced(addr_of(ep), e);
                if !F::is_dirty(e) && F::is_dirty(want) {
                    // D 0->1: what PML logs. Before the write this walk allows.
                    if let Some(guest) = &self.guest {
                        self.vcpu.log_hardware_dirty(guest, Gfn::new(gfn));
                    }
                }
            }
            if F::BREAK_BEFORE_MAKE && self.tlb.conflicts(gfn, level) {
                self.counters.tlb_conflicts += 1;
            }
            let size = bytes_per_entry(level);
            let base = F::output_addr(e);
            // The TLB caches "dirty" with "writable", as x86 does: a translation loaded by a
            // read of a clean leaf must walk again on the first write, to set D.
            let writable = F::is_writable(want) && F::is_dirty(want);
            self.tlb.insert(gfn, level, base.raw(), writable, private);
            return Ok(base.raw() + (gpa & (size - 1)));
        }
    }

    /// `Err(present)` if the entry, which holds `e`, faults as this vCPU sees it at its clock
    /// (`seen`) while `e` itself would not: another CPU wrote `e` later in virtual time, though
    /// earlier in real order ([`Clock::walk_load`]). The real machine faults here too (two
    /// vCPUs faulting on one page together; the later handler finds it fixed), so the walk
    /// faults as the older value would have. It never translates through that value: it only
    /// adds a fault, which the engine finds spurious. Always `Ok` in real time.
    #[inline(always)]
    fn seen_in_time(&mut self, e: u64, seen: u64, level: u8, access: Access) -> Result<(), bool> {
        if seen == e || F::hw_is_table(seen, level) || F::permits(seen, access) {
            return Ok(());
        }
        if !F::hw_is_table(e, level) && !F::permits(e, access) {
            // The walk faults on `e` anyway.
            return Ok(());
        }
        self.counters.stale_walks += 1;
        Err(F::permits(seen, Access::Read) || F::permits(seen, Access::Exec))
    }

    #[inline]
    fn fault(&mut self, f: Fault) -> Result<(), Exit> {
        // A timed write's clock starts here, before the engine's handlers. Untimed passes pay
        // this one predictable branch per fault: a timed copy of the access loop instead would
        // call the handlers from two places, and the compiler then stops inlining them, which
        // cost untimed passes over twice as much (measured on dirty-log-perf).
        if self.latency.is_some() {
            self.start_fault_timer(f.access == Access::Write);
        }
        self.counters.faults += 1;
        let fast = match &self.guest {
            Some(guest) => self.vcpu.fast_page_fault(guest, f),
            None => None,
        };
        let o = match fast {
            Some(o) => {
                // On hardware this fault was an exit too (structurally free here: see the cost).
                F::Clock::charge(Cost::FastFaultExit, 1);
                o
            }
            None => {
                // The slow path may block on the MMU lock, whose holder may be waiting for our
                // flush acknowledgement: leave guest mode (keep the physical CPU; host work).
                // Offline for the direct map too: the fault may flush its kernel TLBs.
                self.leave_guest_mode();
                let o = self.vcpu.slow_page_fault(f);
                self.enter_guest_mode();
                o
            }
        };
        if o == FaultOutcome::DirtyRingFull || self.vcpu.dirty_ring_full() {
            self.ring_full_exit()?;
        }
        if o == FaultOutcome::Retry {
            // The entry is locked or changing under another vCPU. On hardware the re-executed
            // access faults again only after a return to the guest and a new exit, a round
            // trip of a microsecond or two; a retry here costs a tenth of that, and a vCPU
            // re-faulting that fast on a locked entry measurably slows the vCPU that holds it
            // (on this nested 2-core host it doubled the time of a 2 MiB cache clean). The
            // pause loop stands in for the round trip.
            guest_round_trip::<F::Clock>();
        }
        check(o, f.gpa.raw())
    }

    /// KVM_EXIT_DIRTY_RING_FULL: leave guest mode and the physical CPU, let the handler empty
    /// the rings, come back.
    #[cold]
    fn ring_full_exit(&mut self) -> Result<(), Exit> {
        let Some(h) = self.ring_full.clone() else {
            return Err(Exit::DirtyRingFull);
        };
        self.counters.ring_full_exits += 1;
        let t0 = self.fault_start.is_some().then(F::Clock::now_ns);
        self.exit();
        h();
        self.enter();
        if let (Some(t0), Some(start)) = (t0, &mut self.fault_start) {
            *start += F::Clock::now_ns().saturating_sub(t0);
        }
        Ok(())
    }

    /// Consumes the CPU, unregistering its vCPU from the engine.
    pub fn destroy(self) {
        drop(self);
    }
}

impl<F: PteFormat> Drop for Cpu<F> {
    fn drop(&mut self) {
        // Leave guest mode and give the physical CPU back; dropping the vCPU then removes it
        // from the VM's flush protocol.
        self.exit();
        // Offline now (the exit); out of the direct map's flush protocol on this thread's
        // clock, whose lock a flusher may hold while it waits.
        if let Some((host, online)) = self.host.take() {
            drop(online);
            host.leave_with::<F::Clock>();
        }
    }
}

#[inline]
fn check(o: FaultOutcome, gpa: u64) -> Result<(), Exit> {
    match o {
        FaultOutcome::NoSlot => Err(Exit::Mmio { gpa }),
        FaultOutcome::ReadOnly => Err(Exit::ReadOnly { gpa }),
        FaultOutcome::MemoryFault { gpa, size, private } => Err(Exit::MemoryFault {
            gpa: gpa.raw(),
            size,
            private,
        }),
        // Handled by the caller (a ring-full exit); re-execute the access.
        _ => Ok(()),
    }
}
