//! A memslot's private backing: plain host memory, or a range of a [`DirectMap`]'s pool, in
//! which case private faults accept pages lazily and conversions back to shared release them.

use super::{Acceptance, DirectMap, DirectMapError};
use crate::clock::{Clock, RealTime};
use crate::host_memory::HostRange;
use crate::sync::{self, AtomicU64, Ordering};
use slat_addr::PAGE_SHIFT;
use std::sync::Arc;

/// What backs a memslot's `PRIVATE` pages (`Vm::add_memslot_with_private`).
#[derive(Debug, Clone)]
pub struct PrivateMemory {
    pub(crate) range: HostRange,
    pub(crate) lease: Option<Arc<PoolLease>>,
}

impl From<HostRange> for PrivateMemory {
    /// Host memory with no direct map to keep (the host kernel does not map it, or a
    /// TDX-style host that leaves its direct map alone): nothing happens on first touch.
    fn from(range: HostRange) -> Self {
        PrivateMemory { range, lease: None }
    }
}

impl PrivateMemory {
    pub(super) fn bind(
        map: &Arc<DirectMap>,
        offset: u64,
        len: u64,
    ) -> Result<PrivateMemory, DirectMapError> {
        let size = map.pool.len();
        let bad = DirectMapError::BadRange { offset, len, size };
        let range = map.pool.subrange(offset, len).map_err(|_| bad.clone())?;
        if len == 0 {
            return Err(bad);
        }
        let (first, frames) = (offset >> PAGE_SHIFT, len >> PAGE_SHIFT);
        let mut bound = sync::lock(&map.bound);
        if bound
            .iter()
            .any(|&(f, n)| first < f + n && f < first + frames)
        {
            return Err(DirectMapError::AlreadyBound { offset, len });
        }
        bound.push((first, frames));
        drop(bound);
        let lease = PoolLease {
            map: map.clone(),
            first,
            frames,
            slots: AtomicU64::new(0),
        };
        Ok(PrivateMemory {
            range,
            lease: Some(Arc::new(lease)),
        })
    }

    /// The host memory.
    pub fn range(&self) -> &HostRange {
        &self.range
    }

    /// The pool binding, if the memory is a direct map's.
    pub fn lease(&self) -> Option<&Arc<PoolLease>> {
        self.lease.as_ref()
    }
}

/// A pool range bound to (at most) one memslot. When the last copy goes (the slot was
/// deleted and nothing else holds the [`PrivateMemory`]), every page it accepted is released
/// to the direct map and the range can be bound again.
#[derive(Debug)]
pub struct PoolLease {
    map: Arc<DirectMap>,
    /// First pool frame.
    first: u64,
    frames: u64,
    /// Memslots that took it (at most one ever: see [`Self::take_for_slot`]).
    slots: AtomicU64,
}

impl PoolLease {
    /// The direct map of the pool.
    pub fn direct_map(&self) -> &Arc<DirectMap> {
        &self.map
    }

    /// Bytes bound.
    pub fn len(&self) -> u64 {
        self.frames << PAGE_SHIFT
    }

    /// True if nothing is bound (never: binding refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.frames == 0
    }

    /// A memslot takes the lease; false if one already did (two slots would share frames).
    pub(crate) fn take_for_slot(&self) -> bool {
        self.slots.fetch_add(1, Ordering::AcqRel) == 0
    }

    /// Lazy acceptance of page `rel` of the range.
    pub(crate) fn accept<C: Clock>(&self, rel: u64) -> Acceptance {
        debug_assert!(rel < self.frames);
        self.map.accept_frame::<C>(self.first + rel)
    }

    /// Releases the claimed pages of `[lo, hi)` (range-relative); returns how many. From a
    /// thread that is not an online host CPU (the VMM's, converting or deleting).
    pub(crate) fn release_range<C: Clock>(&self, lo: u64, hi: u64) -> u64 {
        let mut n = 0;
        for rel in lo..hi.min(self.frames) {
            let f = self.first + rel;
            if self.map.states.is_claimed::<C>(f) && self.map.release_frame::<C>(f, true) {
                n += 1;
            }
        }
        n
    }
}

impl Drop for PoolLease {
    fn drop(&mut self) {
        // Whatever thread drops the last copy (a vCPU refreshing its memslots, even) must not
        // block on the direct map's lock: hand the range to the map, which releases what is
        // still assigned at its next operation and only then lets it be bound again.
        // (`Vm::delete_memslot` released everything already, so usually nothing is left.)
        let (first, frames) = (self.first, self.frames);
        let assigned = (first..first + frames).any(|f| self.map.states.is_claimed::<RealTime>(f));
        if assigned {
            sync::lock(&self.map.orphans).push((first, frames));
            self.map.has_orphans.store(true, Ordering::Release);
        } else {
            sync::lock(&self.map.bound).retain(|&r| r != (first, frames));
        }
    }
}
