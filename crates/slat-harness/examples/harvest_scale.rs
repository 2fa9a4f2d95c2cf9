//! How a harvest and a reset of k dirty pages scale with the guest's size on the simulated
//! machine: k pages spread over one slot of 64 MiB, 1 GiB or 16 GiB are dirtied as a VMM
//! write does (host write, `mark_page_dirty`), then (a) a transactional take + commit through
//! `MachineLog` and (b) a `MachineSnapshot` reset (harvest + copy back; skipped above 1 GiB,
//! whose snapshot copy would not fit beside other work on a small host). Medians of many
//! iterations, in microseconds.
//!
//! `cargo run --profile ci -p slat-harness --example harvest_scale [max-GiB]`

use slat_addr::{Gpa, PAGE_SIZE};
use slat_harness::{MachineLog, MachineSnapshot};
use slat_machine::{Machine, MachineConfig};
use slat_workload::dirty_oracle::LogMode;
use slat_workload::RegionSpec;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const ITERS: usize = 200;

fn machine(bytes: u64, mode: LogMode) -> Machine<slat::Ept> {
    Machine::new(MachineConfig {
        region: RegionSpec {
            vcpus: 1,
            bytes_per_vcpu: bytes,
            slots: 1,
            prefault: false,
            dirty: mode.dirty_config(4096),
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine")
}

/// Dirties `k` pages spread over the region (iteration `it` shifts them inside their words).
fn dirty(m: &Machine<slat::Ept>, k: u64, it: u64) {
    let l = m.layout();
    let pages = l.total_pages();
    for i in 0..k {
        let p = i * (pages / k) + (i + it) % 64;
        // SAFETY: page `p` is inside the test region; no workload runs.
        unsafe { ((l.host + p * PAGE_SIZE) as *mut u64).write(it) };
        m.vm()
            .mark_page_dirty(Gpa::new(l.gpa + p * PAGE_SIZE))
            .expect("mark");
    }
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2].as_secs_f64() * 1e6
}

fn harvest(m: &Machine<slat::Ept>, k: u64) -> f64 {
    let mut h = MachineLog::harvester(m).expect("harvester");
    h.take().expect("take").commit();
    let times = (0..ITERS as u64)
        .map(|it| {
            dirty(m, k, it);
            let t = Instant::now();
            let set = h.take().expect("take");
            assert_eq!(set.collected(), k);
            set.commit();
            t.elapsed()
        })
        .collect();
    median(times)
}

fn reset(m: &Machine<slat::Ept>, k: u64) -> f64 {
    // SAFETY: `m.ram()` is `m`'s RAM; no workload runs, this is the only writer.
    let mut snap = unsafe { MachineSnapshot::take(m, m.ram()) }.expect("snapshot");
    let times = (0..ITERS as u64)
        .map(|it| {
            dirty(m, k, it);
            let t = Instant::now();
            let r = snap.reset().expect("reset");
            assert_eq!(r.pages, k);
            t.elapsed()
        })
        .collect();
    median(times)
}

fn main() {
    let max_gib: u64 = std::env::args()
        .nth(1)
        .map_or(16, |a| a.parse().expect("max GiB"));
    println!("mode      size     k   take+commit µs   reset µs");
    for mode in [LogMode::DirtyLog, LogMode::ClearLog] {
        for bytes in [64 * MIB, 1024 * MIB, 16 * 1024 * MIB] {
            if bytes > max_gib * 1024 * MIB {
                continue;
            }
            let m = machine(bytes, mode);
            m.set_dirty_logging(true).expect("logging on");
            for k in [16, 256] {
                let h = harvest(&m, k);
                let r = if bytes <= 1024 * MIB {
                    format!("{:10.1}", reset(&m, k))
                } else {
                    "         -".into()
                };
                println!(
                    "{:9} {:5}M {:4} {:16.1} {r}",
                    format!("{mode:?}"),
                    bytes / MIB,
                    k,
                    h
                );
            }
        }
    }
}
