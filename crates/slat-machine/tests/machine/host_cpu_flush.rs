//! A vCPU thread that is a host CPU of the direct map goes offline while a kernel TLB flush
//! waits for it, in virtual time: the flusher must see it leave instead of waiting forever.
//!
//! The machine used to report its host CPU's mode changes to the real-time clock, so a
//! flusher that had found the CPU online and blocked was never woken by its exit. At 128
//! vCPUs and 640 GB (seed 003 at its own scale) a vCPU then left guest mode for a fault while
//! a split's flush waited for it, and queued on the global lock behind the flusher, as did
//! every other vCPU: a hang, which the fault-in's sampler, the one CPU left running, kept the
//! deadlock detector from seeing.

use slat::direct_map::{DirectMap, DirectMapConfig};
use slat::{DirectMapPolicy, Ept, HostBuffer, HostRange, Timed, Vm, VmConfig};
use slat_machine::sched::PcpuPool;
use slat_machine::Cpu;
use slat_vt::{Profile, Sim, Virtual};
use std::sync::Arc;

type F = Timed<Ept, Virtual>;

const MIB: u64 = 1 << 20;

#[test]
fn a_host_cpu_going_offline_releases_the_flush_waiting_for_it() {
    // Everything that reports to the clock is built before the simulation exists.
    let buf = HostBuffer::new(2 * MIB, 2 * MIB).expect("pool");
    let pool = HostRange::new(Arc::new(buf)).expect("pool range");
    let cfg = DirectMapConfig {
        policy: DirectMapPolicy::Pre4K,
        kernel_flush: true,
        collapse: false,
    };
    let map = DirectMap::new(pool.clone(), cfg).expect("direct map");
    let vm = Vm::<F>::new(VmConfig::default());
    let mut cpu = Cpu::new(vm, 0, 64, Arc::new(PcpuPool::new(2))).expect("vCPU");
    cpu.attach_host_cpu(map.host_cpu());
    let sim = Sim::new(Profile::host_default(), 0).expect("simulation");
    let vcpu = sim.register("vcpu").expect("register");
    let flusher = sim.register("flusher").expect("register");
    std::thread::scope(|s| {
        s.spawn(move || {
            vcpu.attach().expect("attach");
            cpu.enter();
            // Online, not at an access boundary for 1 ms: the flush is requested meanwhile.
            assert!(slat_vt::sleep_current(1_000_000));
            // Offline without acknowledging (a VM exit): the flush must stop waiting.
            cpu.exit();
            drop(cpu);
            drop(vcpu);
        });
        s.spawn(|| {
            flusher.attach().expect("attach");
            // Past the lookahead, so the vCPU is online before the flush is requested.
            assert!(slat_vt::sleep_current(100_000));
            map.accept_with::<Virtual>(pool.addr()).expect("accept");
            assert_eq!(map.stats().flush_requests, 1, "the acceptance flushed");
            drop(flusher);
        });
    });
    sim.finish()
        .expect("the flush ended when the host CPU went offline");
}
