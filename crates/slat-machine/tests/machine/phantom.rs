//! Phantom guest memory (`Backing::Phantom*`): the vCPUs' data accesses, the engine's cache
//! maintenance (stage-2) and the direct map's page clears and reads all stay in the 64-frame
//! pool. The reservation itself is inaccessible (checked in /proc/self/maps), so a stray access
//! would kill the test with SIGSEGV: a pass that completes touched only the pool.

use slat::direct_map::DirectMapConfig;
use slat::{DirectMapPolicy, Ept, PteFormat, Stage2};
use slat_addr::{Gfn, Hva, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::{Machine, MachineConfig};
use slat_workload::{Backing, PassParams, RegionSpec};

const MIB: u64 = 1 << 20;

/// The permissions /proc/self/maps lists for the mapping that starts at `addr`.
fn perms_at(addr: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read maps");
    let start = format!("{addr:x}-");
    let line = maps
        .lines()
        .find(|l| l.starts_with(&start))
        .expect("mapping listed in /proc/self/maps");
    line.split_whitespace().nth(1).expect("perms").to_owned()
}

fn machine<F: PteFormat>(backing: Backing, vcpus: usize, bytes: u64) -> Machine<F> {
    Machine::<F>::new(MachineConfig {
        region: RegionSpec {
            backing,
            vcpus,
            bytes_per_vcpu: bytes,
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .unwrap()
}

#[test]
fn a_pass_on_phantom_memory_touches_only_the_pool() {
    for backing in [Backing::Phantom, Backing::PhantomThp] {
        let m = machine::<Ept>(backing, 2, 32 * MIB);
        assert!(m.ram().is_phantom());
        assert_eq!(
            perms_at(m.ram().addr()),
            "---p",
            "{backing}: the reservation is accessible"
        );
        assert_eq!(m.ram().page_size(), backing.page_size());
        let before = m.vm().mmu_memory();
        m.run_pass(PassParams::default()).unwrap();
        let after = m.vm().mmu_memory();
        let s = m.vm().stats();
        let pages = m.layout().total_pages();
        match backing {
            // The twin's page size: the same leaves as anonymous (4K) and THP (2M).
            Backing::Phantom => assert_eq!(s.leaves_4k, pages, "{s:?}"),
            _ => assert_eq!(s.leaves_2m, pages / 512, "{s:?}"),
        }
        assert!(
            after.table_bytes > before.table_bytes,
            "{before:?} {after:?}"
        );
        assert_eq!(after.rmap_bytes, 0, "the walk variant allocates no rmap");
        // The data is not kept: nothing reads it back.
        assert_eq!(m.page_value(0), None);
    }
}

#[test]
fn stage2_cache_maintenance_skips_phantom_lines_but_counts_them() {
    let m = machine::<Stage2>(Backing::PhantomThp, 1, 8 * MIB);
    m.run_pass(PassParams::default()).unwrap();
    let s = m.vm().stats();
    assert!(s.cache_cleans > 0, "{s:?}");
    assert_eq!(s.leaves_2m, 4, "{s:?}");
}

#[test]
fn the_mmu_memory_grows_with_what_the_guest_touched() {
    let m = machine::<Ept>(Backing::Phantom, 1, 256 * MIB);
    let empty = m.vm().mmu_memory().table_bytes;
    let touches = |n| PassParams {
        touches: Some(n),
        ..PassParams::default()
    };
    m.run_pass(touches(1024)).unwrap();
    let some = m.vm().mmu_memory().table_bytes;
    m.run_pass(PassParams::default()).unwrap();
    let all = m.vm().mmu_memory().table_bytes;
    assert!(empty < some && some < all, "{empty} {some} {all}");
    // 65536 pages at 4K: 128 leaf tables of 8 KiB, and a few above.
    assert!((1 << 20..2 << 20).contains(&all), "{all}");
}

#[test]
fn a_phantom_confidential_guest_accepts_through_the_pool() {
    for policy in DirectMapPolicy::ALL.iter().copied() {
        let m = Machine::<Ept>::new(MachineConfig {
            region: RegionSpec {
                backing: Backing::Phantom,
                vcpus: 2,
                bytes_per_vcpu: 8 * MIB,
                ..RegionSpec::default()
            },
            private: Some(DirectMapConfig {
                policy,
                kernel_flush: true,
                collapse: false,
            }),
            ..MachineConfig::default()
        })
        .unwrap();
        let map = m.direct_map().unwrap().clone();
        assert!(map.pool().is_phantom(), "{policy}");
        assert_eq!(perms_at(map.pool().addr().raw()), "---p", "{policy}");
        m.run_pass(PassParams::default()).unwrap();
        let pages = m.layout().total_pages();
        assert_eq!(map.stats().accepted, pages, "{policy}");
        // Converting back to shared clears each page (in the pool) and maps it again; a read
        // through the direct map then goes to the pool too.
        let gfn = m.layout().gpa >> PAGE_SHIFT;
        m.vm()
            .set_memory_attributes(Gfn::new(gfn), pages, slat::MemoryAttributes::empty())
            .unwrap();
        let hva = map.pool().addr().raw() + 5 * PAGE_SIZE;
        assert_eq!(map.read_u64(Hva::new(hva)).unwrap(), Some(0), "{policy}");
    }
}
