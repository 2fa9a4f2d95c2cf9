//! Shared helpers: small guests, destinations on loopback threads, memory comparison.

#![allow(dead_code)]

pub mod wire;

use slat_addr::PageIndex;
use slat_harness::migrate::{self, BackendKind, BenchGuest, GuestSpec, LogMode, Shape, WorkSpec};
use slat_migrate::{
    DestConfig, DestReport, Destination, Guest, Memory, MigrateError, Source, SourceConfig,
};
use std::net::TcpListener;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// 2 vCPUs × `mib_per_vcpu` MiB, one memslot per vCPU.
pub fn shape(mib_per_vcpu: u64) -> Shape {
    Shape {
        vcpus: 2,
        bytes_per_vcpu: mib_per_vcpu << 20,
        slots: 2,
        overlap: false,
    }
}

/// A source guest on `backend`, memory filled (half the pages random), populated.
pub fn source_guest(backend: BackendKind, shape: Shape, log: LogMode) -> Arc<dyn BenchGuest> {
    let spec = GuestSpec {
        backend,
        ..GuestSpec::sim(shape, log)
    };
    let g = migrate::build(&spec).expect("build the source guest");
    g.populate().expect("populate");
    Memory::new(g.as_dyn())
        .expect("memory map")
        .stopped_fill(50, 42)
        .expect("fill");
    g
}

/// Starts `work` on `g` and makes a source of it.
pub fn start_source(g: &Arc<dyn BenchGuest>, work: WorkSpec, cfg: SourceConfig) -> Source {
    g.start(work).expect("start the workload");
    Source::new(g.clone().as_guest(), cfg)
}

/// A workload writing random pages at `rate` per vCPU per second.
pub fn work(rate: u64) -> WorkSpec {
    WorkSpec {
        write_percent: 100,
        random: true,
        seed: 7,
        rate,
    }
}

/// Fast test settings.
pub fn source_config() -> SourceConfig {
    SourceConfig {
        max_downtime: Duration::from_millis(50),
        max_rounds: 20,
        timeout: Duration::from_secs(10),
        ..SourceConfig::default()
    }
}

/// A factory building destination machines on `backend`.
pub fn factory(backend: BackendKind) -> slat_migrate::Factory {
    migrate::factory(GuestSpec {
        backend,
        ..GuestSpec::sim(shape(1), LogMode::Get)
    })
}

/// Destination settings: the guest is left stopped so memory can be compared.
pub fn dest_config() -> DestConfig {
    DestConfig {
        resume_for: Duration::ZERO,
        timeout: Duration::from_secs(10),
        max_memory: 0,
        max_streams: 16,
        delta: true,
    }
}

/// What a destination thread returns: every connection's result, and the destination.
pub type Served = (Vec<Result<DestReport, MigrateError>>, Destination);

/// A destination serving connections on a thread until one migration completes or
/// `max_conns` connections were served; returns every connection's result and the
/// destination.
pub fn spawn_dest(mut d: Destination, max_conns: usize) -> (String, JoinHandle<Served>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let h = std::thread::spawn(move || {
        let mut results = Vec::new();
        for _ in 0..max_conns {
            let r = d.accept(&l);
            let ok = r.is_ok();
            results.push(r);
            if ok {
                break;
            }
        }
        (results, d)
    });
    (addr, h)
}

/// Asserts the two guests' test regions are byte-identical (both stopped).
pub fn assert_same_memory(a: &dyn Guest, b: &dyn Guest) {
    let (ma, mb) = (Memory::new(a).unwrap(), Memory::new(b).unwrap());
    assert_eq!(ma.pages(), mb.pages());
    let x = ma
        .stopped_range(PageIndex::new(0), PageIndex::new(ma.pages()))
        .expect("source memory");
    let y = mb
        .stopped_range(PageIndex::new(0), PageIndex::new(mb.pages()))
        .expect("destination memory");
    if x != y {
        let p = x
            .chunks(4096)
            .zip(y.chunks(4096))
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!("memory differs, first at page {p}");
    }
}

/// Migrates `src` to a fresh destination on `backend`; returns both reports and the
/// destination.
pub fn migrate_once(
    src: &mut Source,
    backend: BackendKind,
) -> (
    Result<slat_migrate::MigrationReport, MigrateError>,
    Vec<Result<DestReport, MigrateError>>,
    Destination,
) {
    let (addr, h) = spawn_dest(Destination::new(factory(backend), dest_config()), 1);
    let r = src.migrate(&addr, &mut |_| {});
    let (d, dest) = h.join().expect("destination thread");
    (r, d, dest)
}
