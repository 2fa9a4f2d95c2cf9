//! Untimed write throughput and in-guest write latencies on this host's KVM:
//! `cargo run --release -p slat-kvm --example kvm_latency -- [vcpus] [MiB per vCPU] [passes]
//! [user|kernel] [sequential|random]` (defaults 1, 256, 20, user, sequential).
//!
//! Prints the median pages/s of `passes` untimed 100%-write passes over mapped memory (the
//! number the timing code must not slow down), then the latencies of timed passes: over
//! mapped memory, right after dirty logging is enabled (every page's first write exits),
//! again with no harvest in between (no exits), and a loop of passes while the host harvests
//! the dirty log back to back.

use slat_dirty::DirtyLogSource;
use slat_kvm::{KvmConfig, KvmMachine};
use slat_workload::TestMachine;
use slat_workload::{PassParams, RegionSpec};
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let vcpus: usize = args.first().map_or(Ok(1), |s| s.parse())?;
    let mib: u64 = args.get(1).map_or(Ok(256), |s| s.parse())?;
    let passes: usize = args.get(2).map_or(Ok(20), |s| s.parse())?;
    let guest_mode = match args.get(3).map(String::as_str) {
        None | Some("user") => slat_kvm::GuestMode::User,
        Some("kernel") => slat_kvm::GuestMode::Kernel,
        Some(other) => return Err(format!("unknown guest mode {other}").into()),
    };
    let random = match args.get(4).map(String::as_str) {
        None | Some("sequential") => false,
        Some("random") => true,
        Some(other) => return Err(format!("unknown order {other}").into()),
    };
    let m = KvmMachine::new(KvmConfig {
        region: RegionSpec {
            vcpus,
            bytes_per_vcpu: mib << 20,
            ..RegionSpec::default()
        },
        guest_mode,
        ..KvmConfig::default()
    })?;
    let untimed = PassParams {
        random,
        ..PassParams::default()
    };
    let timed = PassParams {
        timed: true,
        ..untimed
    };
    m.run_pass(untimed)?; // populate
    let pages = m.layout().total_pages();
    let mut walls: Vec<Duration> = Vec::with_capacity(passes);
    for _ in 0..passes.max(1) {
        walls.push(m.run_pass(untimed)?.wall);
    }
    walls.sort();
    let median = walls[walls.len() / 2];
    println!(
        "untimed write pass, {vcpus} vCPU(s) x {mib} MiB ({guest_mode:?}, random {random}): median {median:?}, \
         {:.1} Mpages/s (min {:?}, max {:?})",
        pages as f64 / median.as_secs_f64() / 1e6,
        walls[0],
        walls[walls.len() - 1]
    );
    println!("guest TSC: {} kHz (KVM_GET_TSC_KHZ)", m.tsc_khz()?);
    show("timed pass, mapped memory", &m.run_pass(timed)?);
    m.set_dirty_logging(true)?;
    show("timed pass, logging just enabled", &m.run_pass(timed)?);
    show("timed pass, no harvest before it", &m.run_pass(timed)?);
    // The stall a vCPU sees while the host harvests: GET_DIRTY_LOG (which write-protects what
    // it reports under KVM's MMU lock) back to back while the guest loops over its memory.
    let mut bitmap = vec![0u64; m.pages_per_slot().div_ceil(64) as usize];
    m.start_loop(timed)?;
    let t = Instant::now();
    let mut harvests = 0u32;
    while t.elapsed() < Duration::from_millis(300) {
        for slot in m.slot_ids() {
            m.dirty_log()
                .get_log((slot - slat_workload::FIRST_SLOT) as usize, &mut bitmap)?;
        }
        harvests += 1;
    }
    let r = m.halt()?;
    show(
        &format!("timed loop, {harvests} concurrent harvests in 300 ms"),
        &r,
    );
    Ok(())
}

fn show(what: &str, r: &slat_kvm::PassReport) {
    let h = r.merged_latency();
    if h.is_empty() {
        println!("{what}: no latencies recorded");
        return;
    }
    println!(
        "{what}: wall {:?}, {} writes, ns p50 {} p99 {} p99.9 {} max {}",
        r.wall,
        h.len(),
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
        h.max()
    );
}
