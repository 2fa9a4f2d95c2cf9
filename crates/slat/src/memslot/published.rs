//! The published memslot set: the slots lock that serialises changes, the current set (read
//! without a lock) and its generation, and each vCPU's cached snapshot of it.

use super::{Memslot, MemslotSet};
use crate::clock::Clock;
use crate::format::PteFormat;
use crate::mmu::Mmu;
use crate::sync::{self, Arc, AtomicU64, Mutex, Ordering, Published};

/// The VM's memslots as faults and harvests see them.
pub(crate) struct Memslots {
    /// Serialises memslot changes and dirty-log capability changes and harvests.
    lock: Mutex<()>,
    set: Published<MemslotSet>,
    /// The generation of the newest set, bumped after it is published: a fault re-checks it
    /// under the MMU lock.
    generation: AtomicU64,
}

impl Memslots {
    pub(crate) fn new() -> Self {
        Memslots {
            lock: Mutex::new(()),
            set: Published::new(MemslotSet::default()),
            generation: AtomicU64::new(0),
        }
    }

    /// Takes the slots lock.
    pub(crate) fn lock<C: Clock>(&self) -> sync::MutexHeld<'_, (), C> {
        sync::lock_c::<C, _>(&self.lock)
    }

    /// The current set.
    pub(crate) fn load(&self) -> Arc<MemslotSet> {
        self.set.load_full()
    }

    /// The generation of the newest set (`Relaxed`: for a re-check under the MMU lock, which
    /// orders it after the publisher's store).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Publishes the current set changed by `change`, under the slots lock.
    pub(crate) fn publish<F: PteFormat>(
        &self,
        mmu: &Mmu<F>,
        change: impl FnOnce(&mut Vec<Arc<Memslot>>),
    ) {
        let cur = self.set.load_full();
        let gen = cur.generation() + 1;
        self.set.store(Arc::new(cur.with(gen, change)));
        // After the new set: a fault that reads this generation finds the new set; a fault that
        // read an older one fails its re-check under the MMU lock.
        sync::store::<F::Clock, _>(&self.generation, gen, Ordering::SeqCst);
        // Wait out faults that passed their generation check against the old set and still
        // hold the MMU lock: after this, every fault that installs anything saw the new set
        // (KVM's synchronize_srcu after a memslot swap). Without it, a fault could install a
        // huge writable leaf behind the split/write-protect walk of enabling dirty logging.
        drop(mmu.lock.write::<F::Clock>());
    }

    /// A snapshot for a new vCPU.
    pub(crate) fn hint(&self) -> SlotHint {
        SlotHint {
            set: self.load(),
            index: 0,
        }
    }

    /// The vCPU's memslot snapshot, refreshed if a newer set was published, and its slot hint.
    #[inline]
    pub(crate) fn refresh<'v, C: Clock>(
        &self,
        h: &'v mut SlotHint,
    ) -> (&'v MemslotSet, &'v mut usize) {
        let gen = sync::load::<C, _>(&self.generation, Ordering::Acquire);
        if h.set.generation() != gen {
            h.set = self.set.load_full_c::<C>();
        }
        (&h.set, &mut h.index)
    }
}

/// A vCPU's cached memslot set and the index of the slot it last found.
pub(crate) struct SlotHint {
    set: Arc<MemslotSet>,
    index: usize,
}
