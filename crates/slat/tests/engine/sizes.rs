//! Sizes, counts and ranges from a caller never panic or abort: every public constructor and
//! ranged call of the engine answers with a typed error or a value. The allocation-heavy ones
//! run again in a child process under `prlimit --as` (an address-space limit), where an
//! allocation that fails aborts only the child and the parent reports it.
//!
//! Covered (each with 0, 1, `u64::MAX`, powers of two and their neighbours, and random
//! values):
//! - `IdleBitmap::new::<Ept | Stage2>(start_gfn, npages)`
//! - `HostBuffer::new(len, align)`, `HostBuffer::with_page_size`, `HostRange::slice`
//! - `Vm::add_memslot(id, gpa, size, ..)`, `Vm::move_memslot`, `Vm::enable_dirty_ring(entries)`
//! - `Vm::set_memory_attributes(first_gfn, npages)`, `Vm::get_dirty_log`,
//!   `Vm::clear_dirty_log(first_page, num_pages, bitmap)`, `Vm::mark_page_dirty(gpa)`
//! - `Vm::zap_gfn_range`, `Vm::clear_young`, `Vm::test_young`, `Vm::lookup` over any range
//! - `DirectMap::new(pool)`, `DirectMap::bind(offset, len)`
#![cfg(not(loom))]

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use slat::direct_map::{DirectMap, DirectMapConfig};
use slat::{
    Ept, HostBuffer, HostRange, IdleBitmap, IdleError, MemoryAttributes, MemslotFlags, Stage2, Vm,
    VmConfig,
};
use slat_addr::{Gfn, Gpa, PageIndex};
use std::sync::Arc;

#[path = "../../../test-support/as_limit.rs"]
mod as_limit;
use as_limit::{rerun_under_as_limit, size};

const AS_LIMIT: u64 = 1 << 30;

/// An idle bitmap over the whole guest physical space of EPT (2^36 pages, 8 GiB of bits)
/// aborted the process when the allocation failed; it is a typed error.
#[test]
fn an_idle_bitmap_too_large_to_allocate_is_refused() {
    if rerun_under_as_limit(
        module_path!(),
        "an_idle_bitmap_too_large_to_allocate_is_refused",
        AS_LIMIT,
    ) {
        return;
    }
    let pages = 1u64 << 36;
    assert_eq!(
        IdleBitmap::new::<Ept>(Gfn::new(0), pages),
        Err(IdleError::Alloc { npages: pages })
    );
    assert!(IdleBitmap::new::<Ept>(Gfn::new(0), 1 << 20).is_ok());
}

/// Every ranged engine call with any size (in a child, under the address-space limit).
#[test]
fn engine_calls_of_any_size() {
    if rerun_under_as_limit(module_path!(), "engine_calls_of_any_size", AS_LIMIT) {
        return;
    }
    let cfg = Config {
        cases: 192,
        failure_persistence: None,
        ..Config::default()
    };
    let vm = Vm::<Ept>::new(VmConfig::default());
    let buf = Arc::new(HostBuffer::new(4 << 20, 2 << 20).unwrap());
    let pool = Arc::new(HostBuffer::new(2 << 20, 2 << 20).unwrap());
    let map = DirectMap::new(
        HostRange::slice(pool, 0, 2 << 20).unwrap(),
        DirectMapConfig::default(),
    )
    .unwrap();
    TestRunner::new(cfg)
        .run(
            &(size(), size(), size(), size(), any::<u32>()),
            |(a, b, c, d, e)| {
                let _ = IdleBitmap::new::<Ept>(Gfn::new(a), b);
                let _ = IdleBitmap::new::<Stage2>(Gfn::new(c), d);
                if let Ok(h) = HostBuffer::new(a, b) {
                    let h = h.with_page_size(c);
                    let _ = HostRange::slice(Arc::new(h), d, a);
                }
                let slot = HostRange::slice(buf.clone(), a % (4 << 20), b);
                if let Ok(range) = slot {
                    let range = range.with_page_size(c);
                    if vm
                        .add_memslot(
                            1,
                            Gpa::new(d),
                            b,
                            range,
                            MemslotFlags::from_bits_truncate(e),
                        )
                        .is_ok()
                    {
                        let _ = vm.move_memslot(1, Gpa::new(a));
                        vm.delete_memslot(1).unwrap();
                    }
                }
                let _ = vm.enable_dirty_ring(e, a % 2 == 0);
                let _ = vm.set_memory_attributes(Gfn::new(a), b, MemoryAttributes::PRIVATE);
                let mut words = vec![0u64; (c % 1024) as usize];
                let _ = vm.get_dirty_log(e, &mut words);
                let _ = vm.clear_dirty_log(e, PageIndex::new(a), b, &words);
                let _ = vm.mark_page_dirty(Gpa::new(d));
                vm.zap_gfn_range(Gfn::new(a), Gfn::new(b)).unwrap();
                let _ = vm.clear_young(Gfn::new(c), Gfn::new(d), |_, _| {});
                let _ = vm.test_young(Gfn::new(a), Gfn::new(d));
                let _ = vm.lookup(Gfn::new(c));
                let _ = map.bind(a, b);
                Ok(())
            },
        )
        .unwrap();
}
