//! Sizes, counts and indexes from a caller never panic, abort or hang: every public
//! constructor of this crate that takes one answers with a typed error or a value. The
//! allocation-heavy ones run again in a child process under `prlimit --as`.
//!
//! Constructors covered (each with 0, 1, `u64::MAX`, `usize::MAX`, powers of two and their
//! neighbours, and random values):
//! - `Rendezvous::new(vcpus)`, and `Rendezvous::report(idx, ..)` with any index
//! - `VcpuTids::new(n)`
//! - `RegionSize::new(vcpus, bytes_per_vcpu, slots)`
//! - `GuestRam::new(backing, size, prefault)` (anonymous)
//! - `Pattern::new(params, vcpu, pages)`, `WriterPattern::new(seed, vcpu, pages)`

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use slat_workload::cpus::VcpuTids;
use slat_workload::{
    Backing, GuestRam, PassParams, Pattern, RegionSize, Rendezvous, RendezvousError, WriterPattern,
};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

#[path = "../../test-support/as_limit.rs"]
mod as_limit;
use as_limit::{rerun_under_as_limit, size};

const AS_LIMIT: u64 = 1 << 30;

type Rdv = Rendezvous<u32, u64, String>;

/// A vCPU thread that reports with an index past the vCPU count panicked (indexing the
/// results) while holding the lock, and the host then waited for a sync that never came.
/// Now the report is refused, after the sync, and the host's collect returns.
#[test]
fn a_report_past_the_vcpu_count_is_refused_and_the_host_is_not_left_waiting() {
    let r: Arc<Rdv> = Arc::new(Rendezvous::new(1).unwrap());
    let (tx, rx) = mpsc::channel();
    let vcpu = {
        let r = r.clone();
        std::thread::spawn(move || {
            while let Some(job) = r.next_job() {
                let _ = tx.send(r.report(5, Ok(u64::from(job))));
            }
        })
    };
    assert!(r.claim());
    r.release(7);
    let (_, results) = r.collect(Instant::now());
    assert!(results.is_ok());
    let refused = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the vCPU thread's report returned");
    assert_eq!(
        refused,
        Err(RendezvousError::NoSuchVcpu { idx: 5, vcpus: 1 })
    );
    r.shut_down(vec![vcpu], || {});
}

/// Rendezvous and tid tables for 0 or absurdly many vCPUs: refused (the old `vcpus + 1`
/// overflowed, and the result table aborted).
#[test]
fn vcpu_counts_out_of_range_are_refused() {
    for n in [0, 4097, 1 << 40, usize::MAX] {
        assert!(matches!(
            Rdv::new(n),
            Err(RendezvousError::Vcpus(m)) if m == n
        ));
    }
    for n in [4097, usize::MAX] {
        assert!(VcpuTids::new(n).is_err());
    }
    assert!(WriterPattern::new(1, 0, 0).next().is_none(), "zero pages");
}

/// Every constructor with any size (in a child, under the address-space limit).
#[test]
fn constructors_of_any_size() {
    if rerun_under_as_limit(module_path!(), "constructors_of_any_size", AS_LIMIT) {
        return;
    }
    let cfg = Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new(cfg)
        .run(&(size(), size(), size()), |(a, b, c)| {
            if let Ok(r) = Rdv::new(a as usize) {
                prop_assert_eq!(r.vcpus(), a as usize);
            }
            let _ = VcpuTids::new(a as usize);
            let _ = RegionSize::new(a as usize, b, c as usize);
            let _ = GuestRam::new(Backing::Anonymous, b, false);
            let params = PassParams {
                random: c % 2 == 0,
                write_percent: (c % 101) as u32,
                ..PassParams::default()
            };
            prop_assert!(Pattern::new(params, a as u32, b)
                .take(3)
                .all(|(p, _)| p < b));
            prop_assert!(WriterPattern::new(c as u32, a as u32, b)
                .take(3)
                .all(|p| p < b));
            Ok(())
        })
        .unwrap();
}
