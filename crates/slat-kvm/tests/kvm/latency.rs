//! Timed passes: the guest times each of its writes with the TSC, and the host turns each
//! vCPU's in-guest histogram into nanoseconds. Timings on a nested host are noisy, so only
//! counts and robust orderings are asserted.

use crate::common;

use common::{expected_writes, machine_or_skip};
use slat_kvm::histogram;
use slat_kvm::{GuestMode, KvmConfig, KvmMachine, Workload};
use slat_workload::LatencyHistogram;
use slat_workload::TestMachine;
use slat_workload::{PassParams, RegionSpec};

const TIMED: PassParams = PassParams {
    write_percent: 100,
    random: false,
    seed: 1,
    timed: true,
    touches: None,
};

fn machine(vcpus: usize, bytes_per_vcpu: u64, guest_mode: GuestMode) -> Option<KvmMachine> {
    machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus,
            bytes_per_vcpu,
            ..RegionSpec::default()
        },
        guest_mode,
        ..KvmConfig::default()
    })
}

/// One histogram per vCPU, each counting exactly the writes that vCPU did (`writes[i]`), all
/// of them positive.
fn assert_counts(latency: &[LatencyHistogram], writes: &[u64]) {
    assert_eq!(latency.len(), writes.len());
    for (i, (h, &w)) in latency.iter().zip(writes).enumerate() {
        assert_eq!(h.len(), w, "vCPU {i}: histogram count vs writes");
        assert!(w == 0 || h.min() > 0, "vCPU {i}: min {}", h.min());
    }
}

fn timed_full_write_pass(vcpus: usize) {
    let Some(m) = machine(vcpus, 4 << 20, GuestMode::User) else {
        return;
    };
    for _ in 0..2 {
        // The second pass counts its own writes only: the host zeroes the histograms first.
        let r = m.run_pass(TIMED).unwrap();
        let pages: Vec<u64> = r.vcpus.iter().map(|v| v.pages).collect();
        assert!(pages.iter().all(|&p| p == m.layout().region(0).2));
        assert_counts(&r.latency, &pages);
    }
}

#[test]
fn guest_buckets_agree_with_the_rust_mirror() {
    // The guest's assembly computes `histogram::bucket`; its max must land in the highest
    // bucket it counted, and its counters sum to its writes.
    let Some(m) = machine(2, 2 << 20, GuestMode::User) else {
        return;
    };
    m.run_pass(TIMED).unwrap();
    let pages = m.layout().region(0).2;
    for i in 0..2 {
        let (counts, max) = m.guest_histogram(i).unwrap();
        assert_eq!(counts.len(), histogram::BUCKETS);
        assert_eq!(counts.iter().sum::<u64>(), pages, "vCPU {i}");
        let top = counts.iter().rposition(|&n| n > 0).unwrap();
        assert_eq!(histogram::bucket(max), top, "vCPU {i}: max {max} cycles");
    }
    assert!(m.guest_histogram(2).is_none());
}

#[test]
fn timed_pass_counts_every_write_one_vcpu() {
    timed_full_write_pass(1);
}

#[test]
fn timed_pass_counts_every_write_two_vcpus() {
    timed_full_write_pass(2);
}

#[test]
fn timed_random_partial_pass_counts_only_writes() {
    let Some(m) = machine(2, 2 << 20, GuestMode::User) else {
        return;
    };
    let params = PassParams {
        write_percent: 30,
        random: true,
        seed: 17,
        timed: true,
        touches: None,
    };
    let r = m.run_pass(params).unwrap();
    // Writes per vCPU from the model (reads are not timed). A page written twice in one pass
    // is one page in the model but two timed writes, so compare against the model's count
    // of write accesses, not of written pages.
    let layout = m.layout();
    let writes: Vec<u64> = (0..2)
        .map(|i| {
            slat_workload::pattern::Pattern::new(params, i as u32, layout.region(i).2)
                .filter(|&(_, w)| w)
                .count() as u64
        })
        .collect();
    assert!(writes.iter().all(|&w| w > 0 && w < layout.region(0).2));
    assert_counts(&r.latency, &writes);
    // And the pass still writes what the model says.
    let want = expected_writes(&layout, params);
    let written = (0..layout.total_pages())
        .filter(|&p| m.page_value(p) != Some(0))
        .count();
    assert_eq!(written, want.iter().filter(|&&w| w).count());
}

#[test]
fn write_protected_pass_shows_the_exits() {
    let Some(m) = machine(1, 8 << 20, GuestMode::User) else {
        return;
    };
    let untimed = PassParams {
        timed: false,
        ..TIMED
    };
    m.run_pass(untimed).unwrap(); // populate: every page mapped writable
    m.set_dirty_logging(true).unwrap();
    // Enabling logging write-protected the region: each page's first write exits.
    let protected = m.run_pass(TIMED).unwrap().merged_latency();
    // No harvest since: the pages stay writable, no write exits.
    let unprotected = m.run_pass(TIMED).unwrap().merged_latency();
    let pages = m.layout().total_pages();
    assert_eq!((protected.len(), unprotected.len()), (pages, pages));
    let show = |h: &LatencyHistogram| {
        format!(
            "p50 {} p99 {} max {} ns",
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.max()
        )
    };
    let msg = format!(
        "protected: {}; unprotected: {}",
        show(&protected),
        show(&unprotected)
    );
    eprintln!("{msg}");
    // A VM exit and KVM's page fault handling take well over a microsecond somewhere among
    // thousands of them, and every protected write pays one; a write that stays in the guest
    // does not.
    assert!(protected.max() >= 1_000, "{msg}");
    assert!(
        protected.max() > unprotected.value_at_quantile(0.5),
        "{msg}"
    );
    assert!(
        protected.value_at_quantile(0.5) > unprotected.value_at_quantile(0.5),
        "{msg}"
    );
}

#[test]
fn untimed_workloads_report_no_latency() {
    let Some(m) = machine(2, 1 << 20, GuestMode::User) else {
        return;
    };
    let r = m.run_pass(PassParams::default()).unwrap();
    assert!(r.latency.is_empty());
    // After a timed pass, an untimed one again reports none.
    assert_eq!(m.run_pass(TIMED).unwrap().latency.len(), 2);
    assert!(m
        .run_pass(PassParams::default())
        .unwrap()
        .latency
        .is_empty());
    m.start(Workload::Writer {
        seed: 3,
        iteration: 9,
    })
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(m.halt().unwrap().latency.is_empty());
}

#[test]
fn timed_loop_and_halt_return_one_histogram_per_vcpu() {
    let Some(m) = machine(2, 4 << 20, GuestMode::User) else {
        return;
    };
    m.start_loop(TIMED).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let r = m.halt().unwrap();
    let pages: Vec<u64> = r.vcpus.iter().map(|v| v.pages).collect();
    assert!(r.vcpus.iter().all(|v| v.passes >= 1), "{:?}", r.vcpus);
    // Every page touched in every pass (whole or halted part) was one timed write.
    assert_counts(&r.latency, &pages);
}

#[test]
fn kernel_mode_guest_times_its_writes() {
    // CPL 0 is emulated on PVM-style hosts: keep it small.
    let Some(m) = machine(1, 1 << 20, GuestMode::Kernel) else {
        return;
    };
    let r = m.run_pass(TIMED).unwrap();
    assert_counts(&r.latency, &[m.layout().total_pages()]);
}
