//! Remote TLB flushes: the request/acknowledge protocol between the engine and vCPUs.
//!
//! A flush sets `REQ_TLB_FLUSH` on every vCPU, then waits for each vCPU that is in guest mode
//! to acknowledge. A vCPU checks its requests at every access boundary while in guest mode and
//! when it enters guest mode; it services a flush by emptying its TLB and publishing the flush
//! generation it observed. A vCPU outside guest mode needs no wait: it will see the request
//! before its next access. The two sides form a Dekker pair — the vCPU stores its mode then
//! loads its requests, the flusher stores the request then loads the mode — so at least one of
//! them sees the other. Each side separates its store from its load with a `SeqCst` fence (KVM's
//! `smp_mb()` in `vcpu_enter_guest` / `kvm_make_all_cpus_request`): `SeqCst` *accesses* alone
//! give the same guarantee on x86 and under the C++20 model, but loom does not model `SeqCst`
//! loads (it treats them as acquire), and with them it reported a lost dirty mark in the
//! bitmap-switch harvest that was the model's artefact, not the protocol's. Fences it models
//! exactly, so the model checks the protocol we rely on.
//!
//! Acknowledgement is by generation rather than by the request bit alone, so concurrent flushes
//! coalesce: one TLB flush on the vCPU satisfies every flush requested before it took the bit.
//!
//! Every operation that unmaps, write-protects or unlinks returns a [`PendingFlush`], which is
//! `#[must_use]` and owns the table pages the operation unlinked. The only way to free those
//! pages is [`crate::Vm::complete_flush`], which flushes first (invariant 2).

use crate::clock::{addr_of, Clock, Cost, RealTime};
use crate::mmu::table::OwnedTable;
use crate::sync::{self, Arc, AtomicU32, AtomicU64, Ordering, RwLock};
use core::marker::PhantomData;

/// Request bit: empty the TLB.
pub const REQ_TLB_FLUSH: u32 = 1 << 0;

const OUTSIDE_GUEST: u32 = 0;
const IN_GUEST: u32 = 1;

/// The part of a vCPU the flusher talks to.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct VcpuLink {
    mode: AtomicU32,
    requests: AtomicU32,
    acked: AtomicU64,
    /// Live [`GuestMode`] tokens of this vCPU: guest mode lasts while there is one. Only the
    /// vCPU's owner changes it (entering needs `&mut Vcpu`); atomic because a token may be
    /// dropped on another thread.
    tokens: AtomicU32,
    /// The thread that put the vCPU in guest mode ([`current_thread`]), 0 outside it: a flush
    /// from that thread would wait for itself. A `std` atomic even under loom: it is not part
    /// of the protocol (each thread compares it only with its own id), and the models never
    /// flush from a thread in guest mode.
    holder: std::sync::atomic::AtomicU64,
}

/// A flush refused because it would wait for the calling thread itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FlushError {
    /// The calling thread holds a [`GuestMode`] token of a vCPU the flush waits for (or is an
    /// online [`crate::direct_map::HostCpu`] of the direct map being flushed): that vCPU
    /// acknowledges only between its accesses, on this thread, so the wait would never end.
    /// Drop the token (leave guest mode, go offline) and call again.
    #[error("the calling thread is in guest mode on a CPU this flush waits for: it would wait for itself")]
    OwnGuestMode,
}

/// A number for the calling thread, never 0 and never reused (thread ids of `std` have no
/// stable integer form).
fn current_thread() -> u64 {
    use std::sync::atomic::{AtomicU64 as StdU64, Ordering as StdOrdering};
    static NEXT: StdU64 = StdU64::new(1);
    THREAD.with(|t| match t.id.get() {
        0 => {
            let id = NEXT.fetch_add(1, StdOrdering::Relaxed);
            t.id.set(id);
            id
        }
        id => id,
    })
}

/// The calling thread's part in the own-flush check: its id (0 until first asked) and how
/// many vCPU links it put in guest mode and has not taken out again. The count lets every
/// thread that holds none — every fault and flush of a well-behaved caller — skip the scan of
/// the VM's vCPUs (a lock and a pass over the list) with one thread-local read; it only errs
/// high (a token moved to another thread and dropped there leaves it counted), which costs
/// that thread the scan, never a missed refusal.
struct ThreadFlushState {
    id: std::cell::Cell<u64>,
    held: std::cell::Cell<u32>,
}

std::thread_local! {
    static THREAD: ThreadFlushState = const {
        ThreadFlushState { id: std::cell::Cell::new(0), held: std::cell::Cell::new(0) }
    };
}

/// Whether the calling thread may hold a vCPU link in guest mode (see [`ThreadFlushState`]).
#[inline]
fn may_hold_links() -> bool {
    THREAD.with(|t| t.held.get() != 0)
}

/// Proof that a vCPU is in guest mode, returned only by [`crate::Vcpu::enter_guest`]; the vCPU
/// leaves guest mode when its last token is dropped.
///
/// While a vCPU is in guest mode every remote flush waits for it to acknowledge, which it does
/// only between accesses ([`crate::Vcpu::service_requests`]). That is what lets the lock-free
/// fast path ([`crate::Vcpu::fast_page_fault`]) read table pages without an epoch pin and
/// makes its dirty marks visible to any harvest that could miss them, so the fast path takes
/// the token and refuses one of another vCPU.
///
/// `C` is the clock of the vCPU's format, which its exit from guest mode is reported to.
#[must_use = "dropping the token leaves guest mode"]
#[derive(Debug)]
pub struct GuestMode<C: Clock = RealTime> {
    pub(crate) link: Arc<VcpuLink>,
    requests: u32,
    _clock: PhantomData<C>,
}

impl<C: Clock> GuestMode<C> {
    /// Requests that were pending when guest mode was entered: service them (with
    /// [`crate::Vcpu::service_requests`]) before the first access.
    pub fn requests_at_entry(&self) -> u32 {
        self.requests
    }
}

impl<C: Clock> Drop for GuestMode<C> {
    fn drop(&mut self) {
        if sync::fetch_sub::<C, _>(&self.link.tokens, 1, Ordering::Relaxed) == 1 {
            let holder = self
                .link
                .holder
                .swap(0, std::sync::atomic::Ordering::Relaxed);
            #[cfg(not(loom))]
            if holder != 0 && holder == current_thread() {
                THREAD.with(|t| t.held.set(t.held.get().saturating_sub(1)));
            }
            #[cfg(loom)]
            let _ = holder;
            self.link.exit_guest::<C>();
        }
    }
}

impl VcpuLink {
    pub(crate) fn new() -> Self {
        VcpuLink {
            mode: AtomicU32::new(OUTSIDE_GUEST),
            requests: AtomicU32::new(0),
            acked: AtomicU64::new(0),
            tokens: AtomicU32::new(0),
            holder: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Enters guest mode (or stays in it, with one more token); the token reports the
    /// requests pending at entry, which the caller services before its first access.
    #[inline]
    pub(crate) fn enter_guest<C: Clock>(link: &Arc<Self>) -> GuestMode<C> {
        if sync::fetch_add::<C, _>(&link.tokens, 1, Ordering::Relaxed) == 0 {
            #[cfg(not(loom))]
            {
                link.holder
                    .store(current_thread(), std::sync::atomic::Ordering::Relaxed);
                THREAD.with(|t| t.held.set(t.held.get().saturating_add(1)));
            }
            sync::store::<C, _>(&link.mode, IN_GUEST, Ordering::Relaxed);
            sync::fence_c::<C>(Ordering::SeqCst);
        }
        // Acquire: a request we see comes with everything its flusher did before asking (the
        // bitmap switch, the write-protection).
        let requests = sync::load::<C, _>(&link.requests, Ordering::Acquire);
        GuestMode {
            link: link.clone(),
            requests,
            _clock: PhantomData,
        }
    }

    /// True while a [`GuestMode`] token of this vCPU lives.
    #[inline]
    pub(crate) fn in_guest(&self) -> bool {
        self.tokens.load(Ordering::Relaxed) != 0
    }

    /// Leaves guest mode (a VM exit: fault, sync, end of a scheduling quantum). Every access
    /// made before this is visible to a flusher that sees the vCPU outside.
    #[inline]
    fn exit_guest<C: Clock>(&self) {
        sync::store::<C, _>(&self.mode, OUTSIDE_GUEST, Ordering::Release);
    }

    /// Requests pending now (cheap; checked at every access boundary).
    #[inline]
    pub(crate) fn pending<C: Clock>(&self) -> u32 {
        sync::load::<C, _>(&self.requests, Ordering::Relaxed)
    }

    /// Services pending requests: for a TLB flush, calls `flush_tlb` and then acknowledges.
    /// Returns the requests that were taken.
    #[inline]
    pub(crate) fn service_requests<C: Clock>(
        &self,
        flush_gen: &AtomicU64,
        flush_tlb: impl FnOnce(),
    ) -> u32 {
        // Take the bits before reading the generation: any flusher whose bit we consumed bumped
        // the generation before setting the bit, so the generation we read covers it.
        let reqs = sync::swap::<C, _>(&self.requests, 0, Ordering::AcqRel);
        if reqs & REQ_TLB_FLUSH != 0 {
            let gen = sync::load::<C, _>(flush_gen, Ordering::SeqCst);
            flush_tlb();
            // Release: the TLB flush and every earlier guest access happen-before the
            // flusher's return.
            sync::fetch_max::<C, _>(&self.acked, gen, Ordering::Release);
        }
        reqs
    }

    fn request<C: Clock>(&self, bits: u32) {
        sync::fetch_or::<C, _>(&self.requests, bits, Ordering::Release);
    }

    /// Waits until this vCPU acknowledged `gen` or is outside guest mode.
    fn wait_ack<C: Clock>(&self, gen: u64) {
        if sync::load::<C, _>(&self.acked, Ordering::Acquire) >= gen
            || sync::load::<C, _>(&self.mode, Ordering::Acquire) != IN_GUEST
        {
            return;
        }
        // In guest mode and not acknowledged yet: the interrupt that makes it exit. It
        // acknowledges within one access, so spin first, then give our CPU away (the clock's
        // wait): its thread is probably not running. Only its acknowledgement or its exit
        // (the two words watched) ends the wait.
        C::charge(Cost::IpiSend, 1);
        sync::spin_until::<C>(&[addr_of(&self.acked), addr_of(&self.mode)], || {
            self.acked.load(Ordering::Acquire) >= gen
                || self.mode.load(Ordering::Acquire) != IN_GUEST
        });
    }
}

/// The vCPUs a remote flush waits for, and the generation they acknowledge.
#[derive(Debug)]
pub(crate) struct FlushDomain {
    vcpus: RwLock<Vec<Arc<VcpuLink>>>,
    gen: AtomicU64,
}

impl FlushDomain {
    pub(crate) fn new() -> Self {
        FlushDomain {
            vcpus: RwLock::new(Vec::new()),
            gen: AtomicU64::new(0),
        }
    }

    /// From now on, flushes wait for `link` whenever its vCPU is in guest mode.
    pub(crate) fn join<C: Clock>(&self, link: Arc<VcpuLink>) {
        sync::write_c::<C, _>(&self.vcpus).push(link);
    }

    /// Flushes stop waiting for `link` (its vCPU is going away).
    pub(crate) fn leave<C: Clock>(&self, link: &Arc<VcpuLink>) {
        sync::write_c::<C, _>(&self.vcpus).retain(|l| !Arc::ptr_eq(l, link));
    }

    /// vCPUs that joined and have not left.
    pub(crate) fn len(&self) -> usize {
        sync::read(&self.vcpus).len()
    }

    /// Services `link`'s pending requests (see [`VcpuLink::service_requests`]).
    #[inline]
    pub(crate) fn service<C: Clock>(&self, link: &VcpuLink, flush_tlb: impl FnOnce()) -> u32 {
        link.service_requests::<C>(&self.gen, flush_tlb)
    }

    /// Whether the calling thread put one of these vCPUs in guest mode (a flush would wait
    /// for itself): [`FlushError::OwnGuestMode`] if so.
    #[inline]
    pub(crate) fn check_own<C: Clock>(&self) -> Result<(), FlushError> {
        if cfg!(loom) || !may_hold_links() {
            return Ok(());
        }
        held_here(&sync::read_c::<C, _>(&self.vcpus))
    }

    /// Requests a flush on every vCPU and waits for the acknowledgements; returns whether any
    /// vCPU had to be asked. Refused, before anything is requested, if the calling thread
    /// holds one of them in guest mode.
    pub(crate) fn flush_all<C: Clock>(&self) -> Result<bool, FlushError> {
        let vcpus = sync::read_c::<C, _>(&self.vcpus);
        held_here(&vcpus)?;
        let gen = sync::fetch_add::<C, _>(&self.gen, 1, Ordering::SeqCst) + 1;
        if vcpus.is_empty() {
            return Ok(false);
        }
        for v in vcpus.iter() {
            v.request::<C>(REQ_TLB_FLUSH);
        }
        // The flusher's half of the Dekker pair: requests stored, then modes loaded.
        sync::fence_c::<C>(Ordering::SeqCst);
        for v in vcpus.iter() {
            v.wait_ack::<C>(gen);
        }
        Ok(true)
    }
}

/// [`FlushError::OwnGuestMode`] if the calling thread put one of `links` in guest mode.
fn held_here(links: &[Arc<VcpuLink>]) -> Result<(), FlushError> {
    if cfg!(loom) || links.is_empty() || !may_hold_links() {
        return Ok(());
    }
    let me = current_thread();
    let held = links
        .iter()
        .any(|l| l.holder.load(std::sync::atomic::Ordering::Relaxed) == me);
    if held {
        return Err(FlushError::OwnGuestMode);
    }
    Ok(())
}

/// A TLB flush an operation still owes, and the table pages it unlinked (freed only once the
/// flush completed and a reclamation grace period passed).
#[must_use = "a pending flush must be completed with Vm::complete_flush"]
#[derive(Debug, Default)]
pub struct PendingFlush {
    pub(crate) needed: bool,
    pub(crate) graveyard: Vec<OwnedTable>,
}

impl PendingFlush {
    /// No flush owed.
    pub fn none() -> Self {
        Self::default()
    }
    /// Something changed that hardware may have cached.
    pub(crate) fn require(&mut self) {
        self.needed = true;
    }
    /// Folds another pending flush into this one.
    pub fn merge(&mut self, other: PendingFlush) {
        self.needed |= other.needed;
        let mut o = other;
        self.graveyard.append(&mut o.graveyard);
    }
    /// A flush is owed.
    pub fn is_needed(&self) -> bool {
        self.needed || !self.graveyard.is_empty()
    }
}
