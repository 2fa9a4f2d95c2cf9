//! Reset on both machines, every log mode, several vCPUs: after every iteration of guest
//! writes, the reset test region equals the snapshot byte for byte (checked against the
//! snapshot and against this test's own copy), and every page the guest wrote was copied.
//! Incremental (child) snapshots on both machines, every log mode: reset to the child and back
//! to the base, byte-exact.

use slat_addr::PAGE_SIZE;
use slat_harness::MachineSnapshot;
use slat_machine::{Machine, MachineConfig};
use slat_workload::dirty_oracle::LogMode;
use slat_workload::{GuestRam, PassParams, Pattern, RegionSpec, TestMachine};

const VCPUS: usize = 4;
const BYTES_PER_VCPU: u64 = 256 * PAGE_SIZE;

fn region(mode: LogMode) -> RegionSpec {
    RegionSpec {
        vcpus: VCPUS,
        bytes_per_vcpu: BYTES_PER_VCPU,
        slots: 2,
        dirty: mode.dirty_config(4096),
        ..RegionSpec::default()
    }
}

/// The test region's bytes, read while no workload runs.
fn region_bytes<M: TestMachine>(m: &M) -> Vec<u8> {
    let l = m.layout();
    // SAFETY: the test region is mapped for the machine's lifetime and no workload runs
    // (passes have returned), so nothing writes it during the read.
    unsafe {
        std::slice::from_raw_parts(l.host as *const u8, (l.total_pages() * PAGE_SIZE) as usize)
    }
    .to_vec()
}

/// Fills the test region with bytes the guest never writes, so a reset has more to restore
/// than the memstress pattern's first 8 bytes.
fn fill<M: TestMachine>(m: &M, seed: u64) {
    let l = m.layout();
    let mut x = seed | 1;
    for off in (0..l.total_pages() * PAGE_SIZE).step_by(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // SAFETY: in the test region, 8-byte aligned (page-aligned host + multiple of 8); no
        // workload runs, so the host is the only writer.
        unsafe { ((l.host + off) as *mut u64).write(x) }
    }
}

/// Distinct pages one memstress pass with `params` writes (the shared reference model).
fn written_pages<M: TestMachine>(m: &M, params: PassParams) -> u64 {
    let l = m.layout();
    let mut hit = vec![false; l.total_pages() as usize];
    for i in 0..l.vcpus {
        let (gpa, _, pages) = l.region(i);
        let first = (gpa - l.gpa) / PAGE_SIZE;
        for (page, write) in Pattern::new(params, i as u32, pages) {
            hit[(first + page) as usize] |= write;
        }
    }
    hit.iter().filter(|&&h| h).count() as u64
}

/// Iterations of one memstress pass each (sequential and random, varying seeds), reset after
/// each, checked exactly.
fn reset_is_exact<M: TestMachine>(m: &M, ram: &GuestRam) {
    fill(m, 0x5eed);
    // SAFETY: `ram` is `m`'s RAM; passes run only through `run_pass`, which returns with the
    // vCPUs stopped, so nothing writes it during take, reset or verify.
    let mut snap = unsafe { MachineSnapshot::take(m, ram) }.expect("snapshot");
    let original = region_bytes(m);
    snap.verify().expect("equal right after the snapshot");
    for it in 0..12u32 {
        let params = PassParams {
            write_percent: if it % 3 == 2 { 30 } else { 100 },
            random: it % 2 == 1,
            seed: 1 + it,
            timed: false,
            touches: None,
        };
        let pass = m.run_pass(params).expect("pass");
        assert!(pass.vcpus.iter().all(|v| v.pages > 0));
        assert!(
            snap.verify().is_err(),
            "iteration {it}: the guest changed nothing"
        );
        let r = snap.reset().expect("reset");
        // The log is exact on both machines, so the reset copies exactly the pages the
        // memstress model writes.
        assert_eq!(
            r.pages,
            written_pages(m, params),
            "iteration {it} ({params:?}): {r:?}"
        );
        snap.verify()
            .unwrap_or_else(|e| panic!("iteration {it} ({params:?}): {e}"));
        assert!(
            region_bytes(m) == original,
            "iteration {it}: differs from the copy"
        );
    }
    // A full-copy reset is exact too, and leaves the log clean for the next reset.
    m.run_pass(PassParams::default()).expect("pass");
    snap.reset_all().expect("full reset");
    snap.verify().expect("after a full reset");
    assert_eq!(snap.reset().expect("reset").pages, 0);
}

fn sim(mode: LogMode) {
    let m = Machine::<slat::Ept>::new(MachineConfig {
        region: region(mode),
        ..MachineConfig::default()
    })
    .expect("machine");
    reset_is_exact(&m, m.ram());
}

fn kvm(mode: LogMode) {
    let m = match slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
        region: region(mode),
        ..slat_kvm::KvmConfig::default()
    }) {
        Ok(m) => m,
        Err(e @ slat_kvm::KvmError::DeviceUnavailable { .. }) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            return;
        }
        Err(e) => panic!("cannot build the KVM machine: {e}"),
    };
    reset_is_exact(&m, m.ram());
}

#[test]
fn sim_dirty_log() {
    sim(LogMode::DirtyLog)
}

#[test]
fn sim_clear_log() {
    sim(LogMode::ClearLog)
}

#[test]
fn sim_dirty_ring() {
    sim(LogMode::DirtyRing)
}

#[test]
fn kvm_dirty_log() {
    kvm(LogMode::DirtyLog)
}

#[test]
fn kvm_clear_log() {
    kvm(LogMode::ClearLog)
}

#[test]
fn kvm_dirty_ring() {
    kvm(LogMode::DirtyRing)
}

#[test]
fn the_ram_must_hold_the_test_region() {
    let m = Machine::<slat::Ept>::new(MachineConfig {
        region: region(LogMode::DirtyLog),
        ..MachineConfig::default()
    })
    .expect("machine");
    let other = GuestRam::new(slat_workload::Backing::Anonymous, 1 << 20, false).unwrap();
    // SAFETY: refused before any region is made from `other`; no workload runs.
    let r = unsafe { MachineSnapshot::take(&m, &other) };
    assert!(matches!(
        r,
        Err(slat_harness::ResetError::NotTheMachinesRam { .. })
    ));
}

/// Incremental snapshots: base taken; pass A; child taken; pass B; reset to the child equals
/// the state after A; pass C; reset to the base equals the base; then back to the child from
/// the base, and to the base again after the child is dropped (each byte-exact against this
/// test's own copies).
fn child_is_exact<M: TestMachine>(m: &M, ram: &GuestRam) {
    // Map every page first: KVM may log a page the first time a read faults it in, so the
    // exact page counts below hold only once the guest has touched the whole region.
    m.run_pass(PassParams::default()).expect("priming pass");
    fill(m, 0xc41d);
    // SAFETY: `ram` is `m`'s RAM; passes run only through `run_pass`, which returns with the
    // vCPUs stopped, so nothing writes it during take, reset or verify (of base or child).
    let mut snap = unsafe { MachineSnapshot::take(m, ram) }.expect("snapshot");
    let base = region_bytes(m);
    // The guest writes one value, so passes differ only in which pages they write: 30 %
    // random writes keep each pass's pages apart from the others'.
    let pass = |seed: u32, random: bool| {
        let params = PassParams {
            write_percent: if random { 30 } else { 100 },
            random,
            seed,
            timed: false,
            touches: None,
        };
        m.run_pass(params).expect("pass");
        params
    };
    let a = pass(7, true);
    let after_a = region_bytes(m);
    assert!(after_a != base, "pass A changed nothing");
    {
        let mut child = snap.take_child().expect("child");
        assert_eq!(child.own_pages(), written_pages(m, a));
        child.verify().expect("equal right after the child");
        for round in 0..3u32 {
            let b = pass(11 + round, true);
            assert!(region_bytes(m) != after_a, "pass B changed nothing");
            let r = child.reset().expect("reset to the child");
            // From the child: exactly the pages B wrote (the first round), those and the
            // child's own pages (later rounds start from the base).
            if round == 0 {
                assert_eq!(r.pages, written_pages(m, b), "{r:?}");
            }
            child.verify().expect("child after reset");
            assert!(
                region_bytes(m) == after_a,
                "round {round}: not the state after A"
            );
            pass(21 + round, true);
            child.reset_to_base().expect("reset to the base");
            child.verify_base().expect("base after reset");
            assert!(region_bytes(m) == base, "round {round}: not the base");
        }
        // Drop the child while memory equals it: the base still resets exactly.
        pass(31, true);
        child.reset().expect("reset to the child");
        assert!(region_bytes(m) == after_a);
    }
    pass(32, true);
    snap.reset().expect("reset to the base after the child");
    snap.verify().expect("base");
    assert!(region_bytes(m) == base, "the dropped child's pages stayed");
    assert_eq!(snap.reset().expect("reset").pages, 0);
}

fn sim_child(mode: LogMode) {
    let m = Machine::<slat::Ept>::new(MachineConfig {
        region: region(mode),
        ..MachineConfig::default()
    })
    .expect("machine");
    child_is_exact(&m, m.ram());
}

fn kvm_child(mode: LogMode) {
    let m = match slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
        region: region(mode),
        ..slat_kvm::KvmConfig::default()
    }) {
        Ok(m) => m,
        Err(e @ slat_kvm::KvmError::DeviceUnavailable { .. }) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            return;
        }
        Err(e) => panic!("cannot build the KVM machine: {e}"),
    };
    child_is_exact(&m, m.ram());
}

#[test]
fn sim_child_dirty_log() {
    sim_child(LogMode::DirtyLog)
}

#[test]
fn sim_child_clear_log() {
    sim_child(LogMode::ClearLog)
}

#[test]
fn sim_child_dirty_ring() {
    sim_child(LogMode::DirtyRing)
}

#[test]
fn kvm_child_dirty_log() {
    kvm_child(LogMode::DirtyLog)
}

#[test]
fn kvm_child_clear_log() {
    kvm_child(LogMode::ClearLog)
}

#[test]
fn kvm_child_dirty_ring() {
    kvm_child(LogMode::DirtyRing)
}

/// A reset of k dirty pages on a large simulated guest reads O(k) words of the engine's dirty
/// bitmap (its summary levels name the dirty words), never the clean rest: a harvest that
/// scans the slot reads its 1024 words per reset. The pages are dirtied as a VMM write
/// does (host write, then `mark_page_dirty`), spread so each has its own word.
fn sim_reset_reads_only_dirty_words(mode: LogMode) {
    const K: u64 = 16;
    const BYTES: u64 = 256 << 20;
    let m = Machine::<slat::Ept>::new(MachineConfig {
        region: RegionSpec {
            vcpus: 1,
            bytes_per_vcpu: BYTES,
            slots: 1,
            dirty: mode.dirty_config(4096),
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine");
    // SAFETY: `m.ram()` is `m`'s RAM; no workload runs, the test is the only writer.
    let mut snap = unsafe { MachineSnapshot::take(&m, m.ram()) }.expect("snapshot");
    let l = m.layout();
    let pages = BYTES / PAGE_SIZE;
    for it in 0..3u64 {
        for i in 0..K {
            let p = i * (pages / K) + (i + it) % 64;
            // SAFETY: page `p` is in the test region; no workload runs.
            unsafe { ((l.host + p * PAGE_SIZE) as *mut u64).write(0xd1e7 + it) };
            let gpa = slat_addr::Gpa::new(l.gpa + p * PAGE_SIZE);
            assert!(m.vm().mark_page_dirty(gpa).expect("mark"));
        }
        let before = m.vm().stats().dirty_words_read;
        let r = snap.reset().expect("reset");
        let read = m.vm().stats().dirty_words_read - before;
        assert_eq!(r.pages, K, "{mode:?}: {r:?}");
        // Per dirty page: its word and one word per summary level (two here) to GET it, and
        // with manual protect CLEAR's word, summary clears and re-reads.
        assert!(
            read <= 8 * K + 8,
            "{mode:?} iteration {it}: the reset read {read} bitmap words for {K} dirty pages"
        );
        snap.verify().expect("reset exactly");
    }
}

#[test]
fn sim_dirty_log_reset_reads_only_dirty_words() {
    sim_reset_reads_only_dirty_words(LogMode::DirtyLog)
}

#[test]
fn sim_clear_log_reset_reads_only_dirty_words() {
    sim_reset_reads_only_dirty_words(LogMode::ClearLog)
}
