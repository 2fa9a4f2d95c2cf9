//! Reading the tree without changing it: the audit (tests, debugging) and single lookups.

use super::walk::Walk;
use super::Mmu;
use crate::format::{Level, PteFormat, PAGE_SHIFT};
use crate::sync::pin;

impl<F: PteFormat> Mmu<F> {
    /// Walks the whole table and counts leaves per level and linked tables (tests and
    /// debugging: compare with [`crate::Vm::stats`]). Takes the MMU lock exclusively.
    pub fn audit(&self) -> Audit {
        let _lock = self.lock.write();
        let guard = pin();
        let mut a = Audit {
            tables: 1,
            ..Audit::default()
        };
        let mut it = Walk::<F>::new(
            &guard,
            self.root(),
            1,
            0,
            1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT),
        );
        while it.valid() {
            let v = it.old;
            if F::is_present(v) {
                if F::is_leaf(v, it.level) {
                    a.leaves[it.level as usize - 1] += 1;
                } else {
                    a.tables += 1;
                }
            } else if v == F::FROZEN {
                a.frozen += 1;
            }
            it.next();
        }
        a
    }

    /// The leaf mapping `gfn`, if any: (entry value, level). Lock-free read for tests and tools.
    pub fn lookup(&self, gfn: u64) -> Option<(u64, Level)> {
        let guard = pin();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, gfn, gfn + 1);
        while it.valid() {
            let v = it.old;
            if !F::is_present(v) {
                return None;
            }
            if F::is_leaf(v, it.level) {
                return Some((v, it.level));
            }
            it.next();
        }
        None
    }
}

/// What [`crate::Vm::audit`] found in the tree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Audit {
    /// Leaves per level (index 0 = 4 KiB).
    pub leaves: [u64; 3],
    /// Table pages, root included.
    pub tables: u64,
    /// Frozen entries (must be 0 when no operation is in flight).
    pub frozen: u64,
}
