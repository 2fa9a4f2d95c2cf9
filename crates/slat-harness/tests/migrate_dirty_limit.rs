//! Dirty-limit on the simulated machine: the per-vCPU limiter, fed by the dirty ring, slows a
//! vCPU that dirties too fast down to the limit and leaves a slow one alone; and a migration
//! that cannot converge without a convergence mechanism converges with it.

mod common;

use common::*;
use slat_dirty::Harvester;
use slat_harness::migrate::{BackendKind, LogMode, WorkSpec};
use slat_migrate::dirty_limit::{DirtyLimitConfig, DirtyLimiter, RingCounts, RingMeter};
use slat_migrate::{GuestLog, MigrateError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sequential writes (so within a window each write is a new page) at `rate` per vCPU.
fn sequential(rate: u64) -> WorkSpec {
    WorkSpec {
        random: false,
        ..work(rate)
    }
}

#[test]
fn the_limiter_brings_a_heavy_vcpu_to_the_limit_and_leaves_a_light_one_alone() {
    // 2 x 64 MiB (16384 pages per vCPU): a window of 250 ms holds at most 10k writes of the
    // heavy vCPU, all to distinct pages. vCPU 0 writes 40k/s (5x the limit), vCPU 1 2k/s.
    let g = source_guest(BackendKind::Sim, shape(64), LogMode::Ring);
    g.set_vcpu_rate(0, 40_000);
    g.start(sequential(2_000)).unwrap();
    g.set_dirty_logging(true).unwrap();
    let counts = Arc::new(RingCounts::default());
    let log = g.dirty_log().unwrap().into_source();
    let mut h =
        Harvester::from_source(Box::new(RingMeter::new(log, counts.clone())) as GuestLog).unwrap();
    let cfg = DirtyLimitConfig {
        limit: 8_000,
        period: Duration::from_millis(250),
    };
    let mut l = DirtyLimiter::new(cfg, g.limitable_vcpus(), &counts.per_vcpu(), Instant::now());
    let run = |h: &mut Harvester<GuestLog>, l: &mut DirtyLimiter, for_: Duration| {
        let end = Instant::now() + for_;
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
            if l.due(Instant::now()) {
                h.collect().unwrap();
                if let Some(th) = l.update(&counts.per_vcpu(), Instant::now()) {
                    for (i, t) in th.iter().enumerate() {
                        g.set_vcpu_throttle_ppm(i, *t);
                    }
                }
            }
        }
    };
    // Settle, then measure over two seconds with the limiter still running.
    run(&mut h, &mut l, Duration::from_secs(3));
    let (c0, t0) = (counts.per_vcpu(), Instant::now());
    run(&mut h, &mut l, Duration::from_secs(2));
    h.collect().unwrap();
    let c1 = counts.per_vcpu();
    let dt = t0.elapsed().as_secs_f64();
    let rate = |i: usize| (c1[i] - c0[i]) as f64 / dt;
    let th = l.throttles();
    g.pause().unwrap();
    assert!(
        (6_000.0..=10_000.0).contains(&rate(0)),
        "vCPU 0 dirtied {:.0} pages/s, limit 8000 (throttle {th:?})",
        rate(0)
    );
    assert_eq!(th[1], 0, "vCPU 1 is under the limit: unthrottled");
    assert!(
        (1_000.0..=2_500.0).contains(&rate(1)),
        "vCPU 1 kept its rate: {:.0} pages/s",
        rate(1)
    );
    assert!(th[0] > 500, "vCPU 0 throttled hard: {th:?}");
}

/// A flat-out guest (no rate limit: millions of writes/s per vCPU) is held near the limit: the
/// per-vCPU throttle reaches 99.9%, so its floor is a thousandth of the vCPU's own rate. At
/// the former 99% ceiling these vCPUs still wrote ~75k/s, nine times the limit. The bound is
/// generous (3x) so that a loaded machine does not fail it; the meter collects every 10 ms, as
/// the source does during a round, so it counts each write of the held guest.
#[test]
fn the_limiter_holds_a_flat_out_guest_near_the_limit() {
    const LIMIT: u64 = 8_000;
    let g = source_guest(BackendKind::Sim, shape(64), LogMode::Ring);
    g.start(sequential(0)).unwrap();
    g.set_dirty_logging(true).unwrap();
    let counts = Arc::new(RingCounts::default());
    let log = g.dirty_log().unwrap().into_source();
    let mut h =
        Harvester::from_source(Box::new(RingMeter::new(log, counts.clone())) as GuestLog).unwrap();
    let cfg = DirtyLimitConfig {
        limit: LIMIT,
        period: Duration::from_millis(250),
    };
    let mut l = DirtyLimiter::new(cfg, g.limitable_vcpus(), &counts.per_vcpu(), Instant::now());
    let mut run = |for_: Duration| {
        let end = Instant::now() + for_;
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
            h.collect().unwrap();
            if let Some(th) = l.update(&counts.per_vcpu(), Instant::now()) {
                for (i, t) in th.iter().enumerate() {
                    g.set_vcpu_throttle_ppm(i, *t);
                }
            }
        }
    };
    run(Duration::from_millis(2500));
    let (w0, t0) = (g.vcpu_activity(), Instant::now());
    run(Duration::from_millis(1500));
    let (w1, dt) = (g.vcpu_activity(), t0.elapsed().as_secs_f64());
    g.pause().unwrap();
    let th = l.throttles();
    for (i, (a, b)) in w0.iter().zip(&w1).enumerate() {
        let rate = (b - a) as f64 / dt;
        assert!(
            rate <= 3.0 * LIMIT as f64 && rate >= LIMIT as f64 / 8.0,
            "vCPU {i} wrote {rate:.0}/s against a limit of {LIMIT} (throttles {th:?}, rates {:?})",
            l.rates
        );
    }
    assert_eq!(w1.len(), 2);
}

/// A heavy-dirty guest (2 x 8 MiB, 40k writes/s per vCPU) over a 128 MiB/s link and 20 ms
/// of downtime: `(converged, report)` with the given setting.
fn heavy(dirty_limit: Option<DirtyLimitConfig>, rounds: u32) -> slat_migrate::MigrationReport {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Ring);
    let mut cfg = source_config();
    cfg.max_downtime = Duration::from_millis(20);
    cfg.max_rounds = rounds;
    cfg.bandwidth = 128 << 20;
    // Whole pages: sent as deltas, the guest's re-dirtied pages take a few bytes each and
    // fit the link without any mechanism; this is about a guest that outruns it.
    cfg.delta_cache = 0;
    cfg.auto_converge = false;
    cfg.dirty_limit = dirty_limit;
    let mut src = start_source(&g, work(40_000), cfg);
    let (r, _, dest) = migrate_once(&mut src, BackendKind::Sim);
    let r = r.unwrap();
    assert_same_memory(g.as_dyn(), &**dest.guest().unwrap());
    r
}

#[test]
fn dirty_limit_converges_where_nothing_else_would() {
    let none = heavy(None, 8);
    assert!(!none.converged, "without a mechanism: {:?}", none.rounds);
    let dl = heavy(
        Some(DirtyLimitConfig {
            limit: 2_000,
            period: Duration::from_millis(200),
        }),
        60,
    );
    assert!(dl.converged, "{:?}", dl.rounds);
    let rep = dl.dirty_limit.unwrap();
    assert!(rep.periods > 0);
    assert!(rep.max_permille.iter().all(|&t| t > 0), "{rep:?}");
    assert_eq!(dl.throttle_max, 0, "auto-converge stayed off");
    assert_eq!(dl.vcpu_writes.len(), 2);
}

#[test]
fn dirty_limit_needs_the_ring() {
    let g = source_guest(BackendKind::Sim, shape(4), LogMode::Clear);
    let mut cfg = source_config();
    cfg.dirty_limit = Some(DirtyLimitConfig::default());
    let mut src = start_source(&g, work(1_000), cfg);
    let (r, _, _) = migrate_once(&mut src, BackendKind::Sim);
    assert!(
        matches!(r, Err(MigrateError::DirtyLimitNeedsRing(_))),
        "{r:?}"
    );
    let mut bad = source_config();
    bad.dirty_limit = Some(DirtyLimitConfig {
        limit: 0,
        ..DirtyLimitConfig::default()
    });
    let mut src = slat_migrate::Source::new(g.clone().as_guest(), bad);
    let r = src.migrate("127.0.0.1:1", &mut |_| {});
    assert!(matches!(r, Err(MigrateError::DirtyLimit(_))), "{r:?}");
}

/// The meter counts what the guest dirties, not distinct pages per period: a vCPU sweeping
/// its 4096 pages at 200k writes/s covers them several times per 200 ms period, and its
/// measured rate is far above the 20,480 pages/s that one count per page per period would cap
/// it at. (The meter collects between batches: 1 MiB batches over 64 MiB/s, every ~16 ms.)
#[test]
fn the_meter_counts_a_sweeping_guest_beyond_its_size() {
    let g = source_guest(BackendKind::Sim, shape(16), LogMode::Ring);
    let mut cfg = source_config();
    cfg.max_downtime = Duration::from_millis(20);
    cfg.max_rounds = 1;
    cfg.bandwidth = 64 << 20;
    cfg.auto_converge = false;
    cfg.dirty_limit = Some(DirtyLimitConfig {
        limit: slat_migrate::dirty_limit::MAX_LIMIT,
        period: Duration::from_millis(200),
    });
    let mut src = start_source(&g, sequential(200_000), cfg);
    let (r, _, dest) = migrate_once(&mut src, BackendKind::Sim);
    let r = r.unwrap();
    assert_same_memory(g.as_dyn(), &**dest.guest().unwrap());
    let rep = r.dirty_limit.unwrap();
    assert!(rep.periods > 0, "{rep:?}");
    assert!(rep.last_rates[0] > 40_000.0, "{rep:?}");
}
