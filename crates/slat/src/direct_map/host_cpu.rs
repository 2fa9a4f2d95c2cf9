//! Host CPUs in the direct map's flush protocol: a kernel TLB flush (after a page left the
//! direct map) is acknowledged by every host CPU that is online, exactly as a guest TLB flush
//! is by every vCPU in guest mode — the same request/acknowledge protocol (`mmu::flush`).

use super::DirectMap;
use crate::clock::{Clock, RealTime};
use crate::mmu::flush::{GuestMode, VcpuLink};
use crate::sync::Arc;

/// Handles to the map are plain `std` (as `Vm`'s are); the flush links are the engine's.
type MapHandle = std::sync::Arc<DirectMap>;

/// A host CPU (a thread that may hold direct-map translations in its kernel TLB). Leaves
/// the flush protocol when dropped.
#[derive(Debug)]
pub struct HostCpu {
    map: MapHandle,
    link: Arc<VcpuLink>,
    /// Still in the flush protocol (until [`HostCpu::leave_with`] or the drop).
    joined: bool,
}

/// Proof that a [`HostCpu`] is online: while one lives, every kernel TLB flush waits for the
/// CPU to acknowledge with [`HostCpu::service`] (at its next access boundary). Take it only
/// while the thread runs and checks for requests; drop it before the thread blocks (on a
/// lock, a sleep, or a flush of its own), or a flusher would wait for it.
///
/// `C` is the clock its coming online and going offline are reported to: a flusher waiting
/// in virtual time watches the CPU's mode word, and only a store reported to the simulation
/// wakes it (unreported, a CPU that went offline instead of acknowledging left the flusher
/// waiting forever).
#[must_use = "dropping the token takes the CPU offline"]
#[derive(Debug)]
pub struct Online<C: Clock = RealTime>(#[allow(dead_code)] GuestMode<C>);

impl<C: Clock> Online<C> {
    /// Requests that were pending when the CPU came online: service them first.
    pub fn requests_at_entry(&self) -> u32 {
        self.0.requests_at_entry()
    }
}

impl HostCpu {
    pub(super) fn join(map: MapHandle) -> HostCpu {
        let link = Arc::new(VcpuLink::new());
        map.mmu.flush.join::<RealTime>(link.clone());
        HostCpu {
            map,
            link,
            joined: true,
        }
    }

    /// Comes online (see [`Online`]).
    pub fn online(&mut self) -> Online {
        self.online_with::<RealTime>()
    }

    /// [`Self::online`], its mode changes reported to clock `C` (the thread's own).
    pub fn online_with<C: Clock>(&mut self) -> Online<C> {
        Online(VcpuLink::enter_guest::<C>(&self.link))
    }

    /// Requests pending now (one relaxed load: cheap enough for every access boundary).
    #[inline]
    pub fn pending(&self) -> u32 {
        self.pending_with::<RealTime>()
    }

    /// [`Self::pending`], reported to clock `C` (a load of a line flushers write).
    #[inline]
    pub fn pending_with<C: Clock>(&self) -> u32 {
        self.link.pending::<C>()
    }

    /// Services pending requests: on a kernel TLB flush, runs `flush_tlb`, then acknowledges.
    pub fn service(&self, flush_tlb: impl FnOnce()) -> u32 {
        self.service_with::<RealTime>(flush_tlb)
    }

    /// [`Self::service`], reported to clock `C`.
    pub fn service_with<C: Clock>(&self, flush_tlb: impl FnOnce()) -> u32 {
        self.map.mmu.flush.service::<C>(&self.link, flush_tlb)
    }

    /// Leaves the flush protocol now, the wait for the protocol's lock reported to clock `C`:
    /// a thread simulated in virtual time must not block outside the simulation, and a
    /// flusher holds that lock while it waits for acknowledgements. Dropping a `HostCpu`
    /// leaves with the real-time clock.
    pub fn leave_with<C: Clock>(mut self) {
        self.map.mmu.flush.leave::<C>(&self.link);
        self.joined = false;
    }

    /// The direct map this CPU caches.
    pub fn direct_map(&self) -> &MapHandle {
        &self.map
    }
}

impl Drop for HostCpu {
    fn drop(&mut self) {
        if self.joined {
            self.map.mmu.flush.leave::<RealTime>(&self.link);
        }
    }
}
