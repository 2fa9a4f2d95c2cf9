//! Reset on both machines, every log mode, several vCPUs: after every iteration of guest
//! writes, the reset test region equals the snapshot byte for byte (checked against the
//! snapshot and against this test's own copy), and every page the guest wrote was copied.

use slat_machine::dirty_oracle::LogMode;
use slat_machine::{Machine, MachineConfig};
use slat_snapshot::MachineSnapshot;
use slat_workload::{GuestRam, PassParams, Pattern, RegionSpec, TestMachine, PAGE_SIZE};

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
        Err(slat_snapshot::ResetError::NotTheMachinesRam { .. })
    ));
}
