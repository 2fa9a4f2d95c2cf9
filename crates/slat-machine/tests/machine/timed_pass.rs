//! Timed passes (`PassParams::timed`): each vCPU records the latency of exactly the writes
//! that faulted, one histogram per vCPU in vCPU order; untimed passes report none.
//!
//! Enabling dirty logging without manual protection write-protects every page, so a
//! sequential write pass right after it faults once per page; a second pass without a harvest
//! in between faults on none.

use slat::{HostRange, MemslotFlags, PteFormat, Vm, VmConfig};
use slat_addr::Gpa;
use slat_machine::sched::PcpuPool;
use slat_machine::{Cpu, Exit, Machine, MachineConfig, PassReport};
use slat_workload::{Backing, GuestRam, PassParams, RegionSpec, TestMachine};
use std::sync::Arc;
use std::time::Duration;

/// 256 pages per vCPU: a pass takes well under a millisecond.
const BYTES_PER_VCPU: u64 = 1 << 20;

both_formats! {
    first_writes_after_enabling_logging_are_timed_on_one_vcpu,
    first_writes_after_enabling_logging_are_timed_on_two_vcpus,
    first_touch_writes_are_timed,
    an_untimed_pass_reports_no_latency,
    writes_that_did_not_fault_are_not_recorded,
    a_timed_loop_reports_one_histogram_per_vcpu,
    reads_are_never_recorded,
    a_read_fault_or_an_exit_does_not_time_the_next_write,
}

fn machine<F: PteFormat>(vcpus: usize) -> Machine<F> {
    Machine::<F>::new(MachineConfig {
        region: RegionSpec {
            vcpus,
            bytes_per_vcpu: BYTES_PER_VCPU,
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine")
}

fn pass(write_percent: u32, timed: bool) -> PassParams {
    PassParams {
        write_percent,
        timed,
        ..PassParams::default()
    }
}

/// A machine with every page mapped (an untimed write pass), then write-protected by
/// enabling dirty logging.
fn logging_machine<F: PteFormat>(vcpus: usize) -> Machine<F> {
    let m = machine::<F>(vcpus);
    let r = m.run_pass(pass(100, false)).expect("populate");
    assert!(r.latency.is_empty(), "the populating pass was not timed");
    m.set_dirty_logging(true).expect("enable logging");
    m
}

fn pages_per_vcpu<F: PteFormat>(m: &Machine<F>) -> u64 {
    m.layout().region(0).2
}

/// One histogram per vCPU holding `expected(vcpu)` latencies, all of them positive.
fn assert_counts(r: &PassReport, expected: impl Fn(usize) -> u64) {
    assert_eq!(r.latency.len(), r.vcpus.len(), "one histogram per vCPU");
    for (i, h) in r.latency.iter().enumerate() {
        assert_eq!(h.len(), expected(i), "vCPU {i}: faulting writes recorded");
        if !h.is_empty() {
            assert!(h.min() > 0, "vCPU {i}: a latency of 0 ns");
        }
    }
}

fn first_writes_are_timed<F: PteFormat>(vcpus: usize) {
    let m = logging_machine::<F>(vcpus);
    let pages = pages_per_vcpu(&m);
    let r = m.run_pass(pass(100, true)).expect("timed pass");
    assert_counts(&r, |_| pages);
    for v in &r.vcpus {
        assert!(v.counters.faults >= pages, "every write faulted: {v:?}");
    }
}

fn first_writes_after_enabling_logging_are_timed_on_one_vcpu<F: PteFormat>() {
    first_writes_are_timed::<F>(1);
}

fn first_writes_after_enabling_logging_are_timed_on_two_vcpus<F: PteFormat>() {
    first_writes_are_timed::<F>(2);
}

/// Missing pages: the slow path's faults are timed too.
fn first_touch_writes_are_timed<F: PteFormat>() {
    let m = machine::<F>(2);
    let pages = pages_per_vcpu(&m);
    let r = m.run_pass(pass(100, true)).expect("timed pass");
    assert_counts(&r, |_| pages);
}

fn an_untimed_pass_reports_no_latency<F: PteFormat>() {
    let m = logging_machine::<F>(2);
    let r = m.run_pass(pass(100, false)).expect("untimed pass");
    assert!(r.latency.is_empty(), "{} histograms", r.latency.len());
    assert!(
        r.vcpus.iter().all(|v| v.counters.faults > 0),
        "the pass faulted (and still recorded nothing)"
    );
}

/// No harvest between the passes, so nothing is write-protected again: the second pass's
/// writes complete without a fault and none is recorded.
fn writes_that_did_not_fault_are_not_recorded<F: PteFormat>() {
    let m = logging_machine::<F>(2);
    let pages = pages_per_vcpu(&m);
    assert_counts(&m.run_pass(pass(100, true)).expect("first pass"), |_| pages);
    let r = m.run_pass(pass(100, true)).expect("second pass");
    assert_counts(&r, |_| 0);
    assert!(r.vcpus.iter().all(|v| v.counters.accesses == pages));
}

/// Only the first pass of the loop faults (no harvest while it runs), so each vCPU recorded
/// one latency per page it wrote in that pass (all of them unless halted during it).
fn a_timed_loop_reports_one_histogram_per_vcpu<F: PteFormat>() {
    let m = logging_machine::<F>(2);
    let pages = pages_per_vcpu(&m);
    m.start_loop(pass(100, true)).expect("start loop");
    std::thread::sleep(Duration::from_millis(20));
    let r = TestMachine::halt(&m).expect("halt");
    assert_counts(&r, |i| r.vcpus[i].pages.min(pages));
}

/// Reads that fault (missing pages, on a fresh machine) are not recorded.
fn reads_are_never_recorded<F: PteFormat>() {
    let m = machine::<F>(2);
    let pages = pages_per_vcpu(&m);
    let r = m.run_pass(pass(0, true)).expect("read pass");
    assert_counts(&r, |_| 0);
    for v in &r.vcpus {
        assert!(v.counters.faults >= pages, "every read faulted: {v:?}");
    }
}

/// At the vCPU: a read's fault does not start a timer, nor does a write that exits (MMIO)
/// leave one behind, so the non-faulting write after each records nothing.
fn a_read_fault_or_an_exit_does_not_time_the_next_write<F: PteFormat>() {
    const GPA: u64 = 64 << 20;
    let vm = Vm::<F>::new(VmConfig::default());
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, 2 << 20, true).unwrap());
    let host = HostRange::slice(ram.clone(), 0, 2 * 4096).unwrap();
    vm.add_memslot(1, Gpa::new(GPA), 2 * 4096, host, MemslotFlags::empty())
        .unwrap();
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    cpu.start_timing();
    cpu.enter();
    // A missing page: faults once, recorded once.
    cpu.write_u64_timed(GPA, 1).unwrap();
    let faults = cpu.counters.faults;
    // The other page is missing too: the read faults.
    cpu.read_u64(GPA + 4096).unwrap();
    assert!(cpu.counters.faults > faults, "the read faulted");
    // The first page is mapped and in the TLB: no fault, nothing recorded.
    cpu.write_u64_timed(GPA + 8, 2).unwrap();
    let mmio = GPA + 2 * 4096;
    assert_eq!(cpu.write_u64_timed(mmio, 3), Err(Exit::Mmio { gpa: mmio }));
    cpu.write_u64_timed(GPA + 16, 4).unwrap();
    cpu.exit();
    let h = cpu.take_latency().expect("timed");
    assert_eq!(h.len(), 1, "only the first write's fault is recorded");
    assert!(cpu.take_latency().is_none(), "timing ended");
}
