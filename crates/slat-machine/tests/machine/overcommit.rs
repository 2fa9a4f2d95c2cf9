//! vCPUs outnumbering host cores stay correct and keep flushes moving: passes complete while
//! the host zaps the region over and over (every zap waits for all in-guest vCPUs to ack),
//! and every page holds the memstress pattern afterwards.

use slat::PteFormat;
use slat_addr::Gfn;
use slat_machine::{Machine, MachineConfig};
use slat_workload::MEMSTRESS_PATTERN;
use slat_workload::{Backing, PassParams, RegionSpec};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

both_formats! {
    eight_vcpus_on_two_cores,
    sixty_four_vcpus_small_memory,
}

fn run<F: PteFormat>(vcpus: usize, bytes: u64, passes: usize) {
    let m = Machine::<F>::new(MachineConfig {
        region: RegionSpec {
            backing: Backing::Anonymous,
            vcpus,
            bytes_per_vcpu: bytes,
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine");
    let layout = m.layout();
    let vm = m.vm().clone();
    let stop = Arc::new(AtomicBool::new(false));
    let zaps = Arc::new(AtomicU64::new(0));
    let worst = Arc::new(AtomicU64::new(0));
    let zapper = {
        let (stop, zaps, worst) = (stop.clone(), zaps.clone(), worst.clone());
        let start = layout.gpa >> 12;
        let end = start + layout.total_pages();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                vm.zap_gfn_range(Gfn::new(start), Gfn::new(end))
                    .expect("not refused: no CPU of this thread in guest mode");
                worst.fetch_max(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                zaps.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    // Keep running passes until the zapper has interleaved with them many times.
    let mut done = 0;
    while done < passes || zaps.load(Ordering::Relaxed) < 50 {
        let r = m.run_pass(PassParams::default()).expect("pass");
        assert_eq!(r.vcpus.len(), vcpus);
        done += 1;
    }
    stop.store(true, Ordering::Relaxed);
    zapper.join().unwrap();
    let s = m.vm().stats();
    assert!(zaps.load(Ordering::Relaxed) > 0);
    // Zaps of an already empty range owe no flush; the rest must have flushed.
    assert!(s.remote_tlb_flush > 0 && s.remote_tlb_flush <= s.remote_tlb_flush_requests);
    eprintln!(
        "{vcpus} vCPUs: {} zaps, worst zap+flush {} us, {} faults",
        zaps.load(Ordering::Relaxed),
        worst.load(Ordering::Relaxed),
        s.pf_fixed
    );
    // Every page was written through whatever translation was current.
    for p in 0..layout.total_pages() {
        // SAFETY: the test region is mapped guest RAM owned by `m`, alive here; 8-byte aligned.
        let v = unsafe { *((layout.host + p * 4096) as *const u64) };
        assert_eq!(v, MEMSTRESS_PATTERN, "page {p} lost its write");
    }
    let audit = m.vm().audit();
    assert_eq!(audit.frozen, 0);
}

fn eight_vcpus_on_two_cores<F: PteFormat>() {
    run::<F>(8, 4 << 20, 20);
}

fn sixty_four_vcpus_small_memory<F: PteFormat>() {
    run::<F>(64, 256 << 10, 10);
}
