//! Loom model of the host direct map (`slat::direct_map`), run on the real engine compiled
//! against loom (`RUSTFLAGS="--cfg loom" cargo test -p slat --test loom_direct_map --release`).
//!
//! The property: a page that is never accepted stays readable through the direct map at every
//! instant, while its neighbour's acceptance splits their 2 MiB leaf (a full table published
//! in one compare-and-swap) and its release collapses the table back into a leaf (the table's
//! entries are frozen as it leaves the tree, and its page is freed after a flush and a grace
//! period: the loom build poisons freed table pages, so a reader using one is reported).
#![cfg(loom)]

#[path = "common/loom_thread.rs"]
mod thread;
use slat::direct_map::{Acceptance, DirectMap, DirectMapConfig};
use slat::{DirectMapPolicy, HostBuffer, HostRange};
use std::sync::Arc;

const MIB2: u64 = 2 << 20;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.max_branches = 500_000;
    // The model's own thread has loom's default stack: run the body on one with more room.
    let f = std::sync::Arc::new(f);
    b.check(move || {
        let f = std::sync::Arc::clone(&f);
        thread::spawn(move || f()).join().expect("model body");
    });
}

#[test]
fn a_reader_never_sees_a_hole_while_a_block_splits_and_collapses() {
    model(|| {
        let buf = HostBuffer::new(MIB2, MIB2).unwrap();
        let pool = HostRange::new(Arc::new(buf)).unwrap();
        let base = pool.addr();
        let map = DirectMap::new(
            pool,
            DirectMapConfig {
                policy: DirectMapPolicy::Split2M,
                kernel_flush: false,
                collapse: true,
            },
        )
        .unwrap();
        let hva = base.checked_add(5 * 4096).expect("inside the pool");
        let reader = {
            let map = map.clone();
            thread::spawn(move || {
                // Bounded, and no panic inside a model thread: report after the join.
                (0..2)
                    .map(|_| map.translate(hva).ok().flatten().map(|t| t.0))
                    .find(|t| *t != Some(hva))
            })
        };
        let page7 = base.checked_add(7 * 4096).expect("inside the pool");
        let a = map.accept(page7).unwrap();
        let released = map.release(page7).unwrap();
        let bad = reader.join().unwrap();
        assert_eq!(bad, None, "the reader found page 5 unmapped or moved");
        assert_eq!(a, Acceptance::Accepted { split: true });
        assert!(released);
        assert_eq!(map.stats().collapses, 1);
        if let Some(uaf) = slat::hw::TablePage::loom_use_after_free() {
            panic!("{uaf}");
        }
    });
}
