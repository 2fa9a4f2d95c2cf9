//! The generated guest code, checked by running it: after one pass, guest memory must hold
//! exactly what the host-side model of memstress says.

use crate::common;

use common::{expected_writes, machine_or_skip};
use slat_kvm::{GuestMode, KvmConfig, Workload};
use slat_workload::TestMachine;
use slat_workload::{PassParams, RegionSpec, MEMSTRESS_PATTERN};

/// Runs one pass with `params` on a fresh 2-vCPU machine and compares every page.
fn check_pass(overlap: bool, params: PassParams) {
    check_pass_in(GuestMode::User, overlap, params)
}

fn check_pass_in(guest_mode: GuestMode, overlap: bool, params: PassParams) {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 2 << 20,
            slots: 2,
            overlap,
            ..RegionSpec::default()
        },
        guest_mode,
        ..KvmConfig::default()
    }) else {
        return;
    };
    let layout = m.layout();
    let report = m.run_pass(params).expect("pass");
    let pages_each = layout.region(0).2;
    for v in &report.vcpus {
        assert_eq!(
            (v.pages, v.passes, v.counters.entries),
            (pages_each, 1, 1),
            "{v:?}"
        );
    }
    let want = expected_writes(&layout, params);
    let writes = want.iter().filter(|&&w| w).count();
    let mut wrong = Vec::new();
    for (p, &w) in want.iter().enumerate() {
        let got = m.page_value(p as u64).unwrap();
        let expect = if w { MEMSTRESS_PATTERN } else { 0 };
        if got != expect {
            wrong.push((p, got));
        }
    }
    assert!(
        wrong.is_empty(),
        "{params:?} overlap={overlap}: {} of {} pages differ from the model ({writes} writes \
         expected), first: {:x?}",
        wrong.len(),
        want.len(),
        &wrong[..wrong.len().min(8)]
    );
    // A pass that writes nothing, or everything, would make this test unable to tell a wrong
    // PRNG from a right one.
    if params.write_percent == 100 && !params.random {
        assert_eq!(writes, want.len());
    } else {
        assert!(
            writes > 0 && writes < want.len(),
            "{writes} of {}",
            want.len()
        );
    }
}

#[test]
fn sequential_all_writes_partitioned() {
    check_pass(false, PassParams::default());
}

#[test]
fn random_all_writes_partitioned() {
    check_pass(
        false,
        PassParams {
            write_percent: 100,
            random: true,
            seed: 7,
            timed: false,
            touches: None,
        },
    );
}

#[test]
fn sequential_half_writes_partitioned() {
    check_pass(
        false,
        PassParams {
            write_percent: 50,
            random: false,
            seed: 3,
            timed: false,
            touches: None,
        },
    );
}

#[test]
fn random_thirty_percent_writes_partitioned() {
    check_pass(
        false,
        PassParams {
            write_percent: 30,
            random: true,
            seed: 12345,
            timed: false,
            touches: None,
        },
    );
}

#[test]
fn random_half_writes_overlapped() {
    check_pass(
        true,
        PassParams {
            write_percent: 50,
            random: true,
            seed: 99,
            timed: false,
            touches: None,
        },
    );
}

#[test]
fn seed_zero_and_wrapping_seed_match_the_model() {
    // Seed 0 is mapped to 1; u32::MAX + vCPU 1 wraps to 0.
    check_pass(
        false,
        PassParams {
            write_percent: 100,
            random: true,
            seed: u32::MAX,
            timed: false,
            touches: None,
        },
    );
}

#[test]
fn kernel_mode_guest_matches_the_model() {
    // The same program at CPL 0, as KVM's selftests run it.
    check_pass_in(
        GuestMode::Kernel,
        false,
        PassParams {
            write_percent: 50,
            random: true,
            seed: 8,
            timed: false,
            touches: None,
        },
    );
    check_pass_in(GuestMode::Kernel, true, PassParams::default());
}

#[test]
fn read_only_pass_writes_nothing() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let r = m
        .run_pass(PassParams {
            write_percent: 0,
            random: true,
            seed: 5,
            timed: false,
            touches: None,
        })
        .unwrap();
    assert_eq!(r.vcpus.len(), 2);
    assert!((0..m.layout().total_pages()).all(|p| m.page_value(p) == Some(0)));
}

#[test]
fn passes_repeat_with_fresh_parameters() {
    // The guest starts over from its parameter block after each sync: a second pass with other
    // parameters must follow them (here: write everything after a read-only pass).
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 1,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let total = m.layout().total_pages();
    for (i, wp) in [0u32, 100, 0].into_iter().enumerate() {
        let r = m
            .run_pass(PassParams {
                write_percent: wp,
                random: false,
                seed: 1,
                timed: false,
                touches: None,
            })
            .unwrap();
        assert_eq!(r.vcpus[0].pages, total);
        let written = (0..total)
            .filter(|&p| m.page_value(p) == Some(MEMSTRESS_PATTERN))
            .count() as u64;
        assert_eq!(written, if i == 0 { 0 } else { total }, "pass {i}");
    }
}

#[test]
fn loop_runs_until_halted_and_counts_like_the_simulator() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 4 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let pages = m.layout().region(0).2;
    m.start(Workload::Loop(PassParams::default())).unwrap();
    // A second start while running is refused.
    assert!(matches!(
        m.start(Workload::Loop(PassParams::default())),
        Err(slat_kvm::KvmError::Busy(_))
    ));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let r = m.halt().unwrap();
    for v in &r.vcpus {
        assert!(v.passes >= 1, "{v:?}");
        // Stopped at a pass boundary, or at a halt check (page n with n % 1024 == 1023).
        let partial = v.pages - v.passes * pages;
        assert!(partial == 0 || partial % 1024 == 1023, "{v:?}");
    }
    assert!((0..m.layout().total_pages()).all(|p| m.page_value(p) == Some(MEMSTRESS_PATTERN)));
    // Nothing is running now.
    assert!(matches!(m.halt(), Err(slat_kvm::KvmError::Busy(_))));
    // And the machine still runs passes.
    m.run_pass(PassParams::default()).unwrap();
}

#[test]
fn writer_stamps_pages_of_its_own_partition() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    m.start(Workload::Writer {
        seed: 4,
        iteration: 77,
    })
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let r = m.halt().unwrap();
    let layout = m.layout();
    for (i, v) in r.vcpus.iter().enumerate() {
        assert!(v.pages > 0 && v.pages % 64 == 0, "{v:?}");
        // The first writes of the model must all be there.
        let (gpa, _, pages) = layout.region(i);
        let first = (gpa - layout.gpa) / 4096;
        let model = slat_workload::pattern::WriterPattern::new(4, i as u32, pages);
        for page in model.take(v.pages.min(64) as usize) {
            assert_eq!(m.page_value(first + page), Some(77), "vCPU {i} page {page}");
        }
    }
    let stamped = (0..layout.total_pages())
        .filter(|&p| m.page_value(p) == Some(77))
        .count() as u64;
    let untouched = (0..layout.total_pages())
        .filter(|&p| m.page_value(p) == Some(0))
        .count() as u64;
    assert_eq!(stamped + untouched, layout.total_pages());
}

#[test]
fn native_baseline_writes_the_same_pages_as_the_guest() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let params = PassParams {
        write_percent: 40,
        random: true,
        seed: 21,
        timed: false,
        touches: None,
    };
    m.run_pass(params).unwrap();
    let layout = m.layout();
    let mem = slat_workload::GuestRam::new(
        slat_workload::Backing::Anonymous,
        layout.bytes_per_vcpu * 2,
        true,
    )
    .unwrap();
    let r = slat_workload::native_baseline::<()>(layout, &mem, params).unwrap();
    assert_eq!(r.vcpus.len(), 2);
    for p in 0..layout.total_pages() {
        // SAFETY: in bounds of `mem`, which the baseline threads no longer touch.
        let native = unsafe { ((mem.addr() + p * 4096) as *const u64).read_volatile() };
        assert_eq!(Some(native), m.page_value(p), "page {p}");
    }
}
