//! A remote TLB flush through the real engine (`Vm::flush_remote_tlbs`) waits for exactly the
//! vCPUs in guest mode: each of them costs the flusher, one outside guest mode costs it only
//! the request word it is sent (no IPI, no wait).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use slat::clock::{Clock, Cost};
use slat::{Ept, Timed, Vcpu, Vm, VmConfig};
use slat_vt::{Barrier, Entry, Profile, Virtual};

use crate::common::{self, LT, STEP};

type F = Timed<Ept, Virtual>;

/// What one measured flush showed: its duration on the flusher's clock, and the latest
/// acknowledgement by a vCPU in guest mode (ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Flush {
    took: u64,
    started: u64,
    last_ack: Option<u64>,
}

/// A TLB flush's cost on the target, ns: vCPU `i` (from 1) takes `i` of them, so the targets
/// acknowledge one after another.
const FLUSH: u64 = 300;

/// A VM with `k + m` vCPUs of which `k` run in guest mode on their own simulated CPUs, taking
/// a `STEP` between access boundaries where they service requests; the flusher (CPU 0) makes
/// one warm-up flush, then the measured one. Vcpus outside guest mode have no thread: they
/// are in the flush domain and never run.
fn flush(mut p: Profile, k: usize, m: usize) -> Flush {
    p.set_cost(Cost::TlbFlush, Entry::new(FLUSH as f64, "test"));
    let sim = common::sim(p, 0);
    let slots: Mutex<Vec<Option<Vcpu<F>>>> = Mutex::new(Vec::new());
    let vm: Mutex<Option<Arc<Vm<F>>>> = Mutex::new(None);
    let start = Barrier::new(&sim, k + 1);
    let done = Barrier::new(&sim, k + 1);
    let stop = AtomicBool::new(false);
    let measuring = AtomicBool::new(false);
    let acks = Mutex::new(Vec::new());
    let result = Mutex::new(None);
    common::run(&sim, k + 1, |i| {
        if i == 0 {
            // Everything the engine allocates is made and freed on a simulated CPU.
            let v = Vm::<F>::new(VmConfig::default());
            *slots.lock() = (0..k + m)
                .map(|id| Some(v.create_vcpu(id as u32)))
                .collect();
            *vm.lock() = Some(v.clone());
            start.wait(); // the vCPUs take theirs and enter guest mode
            start.wait();
            v.flush_remote_tlbs().expect("warm-up flush");
            measuring.store(true, Ordering::SeqCst);
            let t0 = Virtual::now_ns();
            v.flush_remote_tlbs().expect("flush");
            let t1 = Virtual::now_ns();
            *result.lock() = Some((t0, t1));
            stop.store(true, Ordering::SeqCst);
            done.wait();
            slots.lock().clear();
            vm.lock().take();
            drop(v);
        } else {
            start.wait();
            let mut vcpu = slots.lock()[i - 1].take().expect("a vcpu per thread");
            let guest = vcpu.enter_guest();
            start.wait();
            while !stop.load(Ordering::SeqCst) {
                Virtual::charge(Cost::VmExit, 1); // one STEP of guest work
                if vcpu.pending_requests() != 0 {
                    vcpu.service_requests(|| {
                        Virtual::charge(Cost::TlbFlush, i as u64);
                        if measuring.load(Ordering::SeqCst) {
                            acks.lock().push(Virtual::now_ns());
                        }
                    });
                }
            }
            drop(guest);
            drop(vcpu);
            done.wait();
        }
    });
    sim.finish().expect("clean run");
    let (t0, t1) = result.into_inner().expect("the flusher ran");
    Flush {
        took: t1 - t0,
        started: t0,
        last_ack: acks.into_inner().into_iter().max(),
    }
}

#[test]
fn a_flush_waits_for_exactly_the_cpus_in_guest_mode() {
    let took: Vec<Flush> = (0..=4).map(|k| flush(common::profile(), k, 0)).collect();
    for (k, f) in took.iter().enumerate() {
        match f.last_ack {
            None => assert_eq!(k, 0, "every vCPU in guest mode acknowledges"),
            Some(ack) => {
                assert!(ack >= f.started, "acknowledged the measured flush");
                assert!(
                    f.started + f.took > ack,
                    "k = {k}: the flush returned before its last target acknowledged"
                );
                // The targets acknowledge at a boundary after the request reached them: within
                // two steps, their TLB flush and the protocol's few line transfers each.
                let bound = 2 * STEP + k as u64 * (FLUSH + 4 * LT);
                assert!(ack <= f.started + bound, "k = {k}: {f:?}");
            }
        }
    }
    for w in took.windows(2) {
        assert!(
            w[1].took >= w[0].took + FLUSH,
            "one more vCPU in guest mode, a TLB flush slower than the others: the flush waits for it too: {took:?}"
        );
    }
}

#[test]
fn a_cpu_outside_guest_mode_costs_the_flusher_nothing() {
    // `common::profile` prices local RMWs and fences at 0: the request word sent to a vCPU
    // outside guest mode (the flusher's own line after the warm-up flush) is free.
    for k in [0, 1, 3] {
        let alone = flush(common::profile(), k, 0);
        for m in [1, 5] {
            let with = flush(common::profile(), k, m);
            assert_eq!(
                with.took, alone.took,
                "k = {k} in guest mode, {m} outside: outside vCPUs changed the flush"
            );
            assert_eq!(with.last_ack.is_some(), k > 0);
        }
    }
}

#[test]
fn an_outside_cpu_costs_only_its_request_word() {
    // With a price on local RMWs, the request sent to each vCPU outside guest mode shows, and
    // nothing else does: no IPI is sent to it, and it is not waited for. (With no vCPU at all
    // the flush returns before its fence, so the baseline has one outside vCPU.)
    const RMW: u64 = 7;
    let mut p = common::profile();
    p.model.rmw_local = Entry::new(RMW as f64, "test");
    p.set_cost(Cost::IpiSend, Entry::new(500.0, "test"));
    let one = flush(p.clone(), 0, 1);
    for m in [2, 5] {
        let with = flush(p.clone(), 0, m);
        assert_eq!(with.took, one.took + (m as u64 - 1) * RMW, "m = {m}");
    }
}
