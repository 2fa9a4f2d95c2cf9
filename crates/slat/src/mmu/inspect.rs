//! Reading the tree without changing it: the audit (tests, debugging) and single lookups.

use super::walk::Walk;
use super::Mmu;
use crate::format::{Level, PteFormat};
use slat_addr::{Gfn, PAGE_SHIFT};

impl<F: PteFormat> Mmu<F> {
    /// Walks the whole table and counts leaves per level and linked tables (tests and
    /// debugging: compare with [`crate::Vm::stats`]). Takes the MMU lock exclusively.
    pub fn audit(&self) -> Audit {
        let _lock = self.lock.write::<F::Clock>();
        let guard = crate::sync::pin_c::<F::Clock>();
        let mut a = Audit {
            tables: 1,
            ..Audit::default()
        };
        let mut it = Walk::<F>::new(
            &guard,
            self.root(),
            1,
            Gfn::new(0),
            Gfn::new(1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT)),
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
    pub fn lookup(&self, gfn: Gfn) -> Option<(u64, Level)> {
        let guard = crate::sync::pin_c::<F::Clock>();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, gfn, Gfn::new(gfn.raw() + 1));
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

impl<F: PteFormat> Mmu<F> {
    /// Checks the reverse map against the tree (tests): every present leaf at levels 1–3 is in
    /// the rmap of the range holding it, naming its table, and every set rmap slot names a
    /// linked table whose header and entry agree — nothing else. Takes the MMU lock
    /// exclusively; call it when no operation is in flight. With `wrprot` `walk` the rmap must
    /// be empty. Returns the leaves checked, or what disagreed.
    pub fn audit_rmap(&self) -> Result<u64, String> {
        let _lock = self.lock.write::<F::Clock>();
        let guard = crate::sync::pin_c::<F::Clock>();
        let mut leaves = std::collections::HashSet::new();
        let mut it = Walk::<F>::new(
            &guard,
            self.root(),
            1,
            Gfn::new(0),
            Gfn::new(1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT)),
        );
        while it.valid() {
            let v = it.old;
            if F::is_present(v) && F::is_leaf(v, it.level) {
                if self.rmap.enabled() {
                    let Some(s) = self.rmap.find::<F::Clock>(it.gfn) else {
                        return Err(format!(
                            "leaf at gfn {:#x} level {} outside every registered range",
                            it.gfn, it.level
                        ));
                    };
                    let got = s
                        .slot(it.gfn, it.level)
                        .map(|x| x.load(crate::sync::Ordering::Acquire));
                    if got != Some(it.table().raw()) {
                        return Err(format!(
                            "leaf at gfn {:#x} level {} in table {:#x}: rmap has {:?}",
                            it.gfn,
                            it.level,
                            it.table(),
                            got
                        ));
                    }
                }
                leaves.insert((it.gfn, it.level));
            }
            it.next();
        }
        let mut set = 0u64;
        for s in self.rmap.all().iter() {
            for (gfn, level, t) in s.entries() {
                set += 1;
                if !leaves.contains(&(gfn, level)) {
                    return Err(format!(
                        "rmap names table {t:#x} for gfn {gfn:#x} level {level}, which no leaf maps"
                    ));
                }
                // SAFETY: the slot names the table of a leaf the walk above just found linked,
                // under the exclusive lock we still hold.
                let page = unsafe { super::table::TablePage::at(t) };
                let want = super::table::TableMeta::pack(
                    Gfn::new(gfn.raw() & !(crate::format::pages_per_entry(level + 1) - 1)),
                    level,
                );
                if page.meta().get() != want {
                    return Err(format!(
                        "table {t:#x} header {:#x}, expected gfn {gfn:#x} level {level}",
                        page.meta().get()
                    ));
                }
            }
        }
        if set != leaves.len() as u64 && self.rmap.enabled() {
            return Err(format!("{} leaves but {set} rmap slots set", leaves.len()));
        }
        if self.rmap.leaked() != 0 {
            return Err(format!(
                "{} rmap slots were left set when their range was unregistered",
                self.rmap.leaked()
            ));
        }
        Ok(leaves.len() as u64)
    }
}
