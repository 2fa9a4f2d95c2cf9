//! A guest as a VMM would bring it (`common/soft.rs`: regions of its own memory with holes
//! between them and a read-only one, a software dirty log, a writing vCPU, device state),
//! migrated over TCP, a UNIX socket, an inherited descriptor and a file; and the faults of
//! the new interface: a cut during the device state and during the final round lose nothing,
//! a destination that cannot read the state or has another memory map refuses cleanly.
//! Needs no machine: runs with `--no-default-features`.

#[path = "common/soft.rs"]
pub(crate) mod soft;

use slat_addr::{Gpa, PageIndex};
use slat_migrate::stream::Region;
use slat_migrate::transport::{Channel, Endpoint, Listener};
use slat_migrate::{
    DestConfig, DestReport, Destination, Guest, Memory, MigrateError, Source, SourceConfig,
    StateBlob,
};
use soft::SoftGuest;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);

fn region(gpa: u64, pages: u64, read_only: bool) -> Region {
    Region {
        gpa: Gpa::new(gpa),
        pages,
        read_only,
    }
}

/// Low RAM, a ROM after a hole, RAM above 4 GiB after a big hole, and a small region right
/// after it with another hole between.
pub(crate) fn map() -> Vec<Region> {
    vec![
        region(0, 64, false),
        region(1 << 20, 8, true),
        region(4 << 30, 96, false),
        region((4 << 30) + (1 << 20), 16, false),
    ]
}

fn blob(id: &str, version: u32, data: &[u8]) -> StateBlob {
    StateBlob {
        id: id.into(),
        version,
        data: data.to_vec(),
    }
}

/// A running source guest with memory and device state.
pub(crate) fn source() -> Arc<SoftGuest> {
    let g = SoftGuest::new(&map());
    g.fill(0xfeed);
    g.set_state(vec![
        blob("vcpu0", 1, &[0xab; 1200]),
        blob("vcpu1", 1, &[0xcd; 1200]),
        blob("serial", 1, b"16550 registers"),
        blob("empty", 1, &[]),
    ]);
    g.resume().unwrap();
    g
}

pub(crate) fn config() -> SourceConfig {
    SourceConfig {
        max_downtime: Duration::from_millis(20),
        timeout: TIMEOUT,
        batch_pages: 16,
        ..SourceConfig::default()
    }
}

pub(crate) fn dest_config() -> DestConfig {
    DestConfig {
        resume_for: Duration::ZERO,
        timeout: TIMEOUT,
        max_memory: 0,
        max_streams: 16,
        delta: true,
    }
}

/// Both guests stopped: memory byte for byte, and the device state.
pub(crate) fn assert_same(src: &SoftGuest, dst: &SoftGuest) {
    assert!(!src.running() && !dst.running());
    let (a, b) = (Memory::new(src).unwrap(), Memory::new(dst).unwrap());
    assert_eq!(a.pages(), 184);
    assert_eq!(a.map().wire(), b.map().wire());
    assert!(
        a.stopped_range(PageIndex::new(0), PageIndex::new(a.pages()))
            .unwrap()
            == b.stopped_range(PageIndex::new(0), PageIndex::new(b.pages()))
                .unwrap(),
        "memory differs"
    );
    assert_eq!(src.state(), dst.state(), "device state differs");
}

/// A destination receiving into `dst` over `l`, serving up to `conns` connections.
pub(crate) fn serve(
    mut l: Listener,
    dst: Arc<SoftGuest>,
    conns: usize,
) -> JoinHandle<Vec<Result<DestReport, MigrateError>>> {
    std::thread::spawn(move || {
        let mut d = Destination::with_guest(dst, dest_config());
        let mut out = Vec::new();
        for _ in 0..conns {
            let r = d.accept_from(&mut l);
            let ok = r.is_ok();
            out.push(r);
            if ok {
                break;
            }
        }
        out
    })
}

fn unix_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("slat-vmm-{}-{name}", std::process::id()))
}

fn migrate_over(to: Endpoint, listen: Endpoint) {
    migrate_with(to, listen, 1);
}

/// A migration to `listen` over `connections` page streams (1: the one connection).
fn migrate_with(to: Endpoint, listen: Endpoint, connections: u32) {
    let src = source();
    let dst = SoftGuest::new(&map());
    let l = Listener::bind(&listen).unwrap();
    let to = match to {
        Endpoint::Tcp(_) => Endpoint::Tcp(l.describe().trim_start_matches("tcp:").into()),
        e => e,
    };
    let h = serve(l, dst.clone(), 1);
    std::thread::sleep(Duration::from_millis(20));
    let mut s = Source::new(
        src.clone(),
        SourceConfig {
            connections,
            ..config()
        },
    );
    let r = s.migrate_to(&to, &mut |_| {}).unwrap();
    let d = h.join().unwrap().pop().unwrap().unwrap();
    assert_eq!(r.connections, connections);
    assert!(
        r.dest_resumed.is_some(),
        "the destination's resume report arrived"
    );
    assert_eq!(d.streams, if connections > 1 { connections } else { 0 });
    assert_eq!(r.state_blobs, 4);
    assert_eq!(d.state_blobs, 4);
    assert_eq!(d.regions, map());
    assert!(r.rounds[0].pages == 184, "round 0 sends RAM and ROM");
    assert!(src.writes() > 0);
    assert_same(&src, &dst);
}

#[test]
fn a_guest_with_holes_and_rom_migrates_over_tcp() {
    migrate_over(
        Endpoint::Tcp(String::new()),
        Endpoint::Tcp("127.0.0.1:0".into()),
    );
}

#[test]
fn a_guest_with_holes_and_rom_migrates_over_a_unix_socket() {
    let p = unix_path("sock");
    let _ = std::fs::remove_file(&p);
    migrate_over(Endpoint::Unix(p.clone()), Endpoint::Unix(p));
}

#[test]
fn a_guest_migrates_over_three_tcp_page_streams() {
    migrate_with(
        Endpoint::Tcp(String::new()),
        Endpoint::Tcp("127.0.0.1:0".into()),
        3,
    );
}

#[test]
fn a_guest_migrates_over_two_unix_page_streams() {
    let p = unix_path("streams");
    let _ = std::fs::remove_file(&p);
    migrate_with(Endpoint::Unix(p.clone()), Endpoint::Unix(p), 2);
}

#[test]
fn page_streams_need_an_endpoint_to_connect_to() {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let c = Channel::unix(a, TIMEOUT, "pair".into()).unwrap();
    let src = source();
    let cfg = SourceConfig {
        connections: 2,
        ..config()
    };
    let e = Source::new(src.clone(), cfg)
        .migrate_over(c, &mut |_| {})
        .unwrap_err();
    assert!(matches!(e, MigrateError::StreamsNeedEndpoint(2)), "{e}");
    let cfg = SourceConfig {
        connections: 17,
        ..config()
    };
    let e = Source::new(src.clone(), cfg)
        .migrate("127.0.0.1:1", &mut |_| {})
        .unwrap_err();
    assert!(matches!(e, MigrateError::Connections(17)), "{e}");
    assert!(src.running());
}

#[test]
fn a_page_stream_cut_mid_migration_fails_cleanly_and_a_retry_completes() {
    for at in [100, 40_000, 200_000] {
        let src = source();
        let dst = SoftGuest::new(&map());
        let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
        let addr = l.describe();
        let h = serve(l, dst.clone(), 2);
        let mut cfg = config();
        cfg.connections = 2;
        cfg.faults.cut_stream = Some((1, at));
        let mut s = Source::new(src.clone(), cfg);
        let e = s.migrate(&addr, &mut |_| {}).unwrap_err();
        // The cut stream, or another one the destination closed when it saw the cut.
        assert!(matches!(e, MigrateError::PageStream { .. }), "{at}: {e}");
        assert_eq!(e.to_string().lines().count(), 1, "{e}");
        assert!(!s.migrated() && src.running(), "the source runs on");
        s.config_mut().faults = Default::default();
        let r = s.migrate(&addr, &mut |_| {}).unwrap();
        assert_eq!(r.connections, 2);
        let results = h.join().unwrap();
        let first = results[0].as_ref().unwrap_err().to_string();
        assert_eq!(first.lines().count(), 1, "{first}");
        assert!(results[1].is_ok());
        assert_same(&src, &dst);
    }
}

#[test]
fn a_guest_migrates_over_an_inherited_socket_descriptor() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let src = source();
    let dst = SoftGuest::new(&map());
    let d2 = dst.clone();
    let h = std::thread::spawn(move || {
        let c = Channel::unix(b, TIMEOUT, "pair".into()).unwrap();
        Destination::with_guest(d2, dest_config()).serve_channel(c)
    });
    let c = Channel::fd(std::os::fd::OwnedFd::from(a), TIMEOUT, true).unwrap();
    assert!(!c.one_way(), "a socket is two-way");
    let r = Source::new(src.clone(), config())
        .migrate_over(c, &mut |_| {})
        .unwrap();
    h.join().unwrap().unwrap();
    assert!(!r.one_way);
    assert_same(&src, &dst);
}

#[test]
fn a_snapshot_is_a_migration_into_a_file_and_restores() {
    let p = unix_path("snap");
    let src = source();
    let mut s = Source::new(src.clone(), config());
    let r = s
        .migrate(&format!("file:{}", p.display()), &mut |_| {})
        .unwrap();
    assert!(r.one_way && !r.resumed && s.migrated());
    assert!(!src.running(), "the source stays paused after a snapshot");
    assert!(r.rounds.len() >= 2, "pre-copy rounds appended to the file");
    let dst = SoftGuest::new(&map());
    let h = serve(
        Listener::bind(&Endpoint::File(p.clone())).unwrap(),
        dst.clone(),
        1,
    );
    let d = h.join().unwrap().pop().unwrap().unwrap();
    assert!(d.one_way && d.verify.ok());
    assert_same(&src, &dst);
    // A flipped byte anywhere in the file fails the restore with one line.
    let mut bytes = std::fs::read(&p).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&p, &bytes).unwrap();
    let dst = SoftGuest::new(&map());
    let h = serve(Listener::bind(&Endpoint::File(p.clone())).unwrap(), dst, 1);
    let e = h.join().unwrap().pop().unwrap().unwrap_err();
    assert_eq!(e.to_string().lines().count(), 1, "{e}");
    let _ = std::fs::remove_file(&p);
}

/// Cut the stream at `fault`, then retry to the same destination: nothing is lost, the
/// source ran on meanwhile, and the retry resumes the kept session.
fn cut_then_retry(fault: impl Fn(&mut SourceConfig), phase: &str) {
    let src = source();
    let dst = SoftGuest::new(&map());
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let h = serve(l, dst.clone(), 2);
    let mut cfg = config();
    fault(&mut cfg);
    let mut s = Source::new(src.clone(), cfg);
    let e = s.migrate(&addr, &mut |_| {}).unwrap_err();
    assert!(e.to_string().starts_with(phase), "{e}");
    assert_eq!(e.to_string().lines().count(), 1, "{e}");
    assert!(!s.migrated());
    assert!(src.running(), "the source runs on after a failed attempt");
    // The guest writes on: wait (up to 10 s, so a loaded host cannot fail it) for a write.
    let w = src.writes();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while src.writes() == w && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        src.writes() > w,
        "the source guest stopped writing after a failed attempt"
    );
    s.config_mut().faults = Default::default();
    let r = s.migrate(&addr, &mut |_| {}).unwrap();
    assert!(r.resumed, "the destination kept the session");
    let results = h.join().unwrap();
    assert!(results[0].is_err() && results[1].is_ok());
    assert_same(&src, &dst);
}

#[test]
fn a_cut_during_the_device_state_loses_nothing() {
    cut_then_retry(|c| c.faults.cut_in_state = Some(700), "device state:");
}

#[test]
fn a_cut_during_the_final_round_loses_nothing() {
    cut_then_retry(
        |c| {
            // Pages dirtied after pre-copy ended, so the final round has something to cut.
            c.faults.pause_delay = Some(Duration::from_millis(30));
            c.faults.cut_in_final_round = Some(3000);
        },
        "stop-and-copy:",
    );
}

#[test]
fn device_state_the_destination_cannot_read_is_refused_before_the_switch_over() {
    let src = source();
    src.set_state(vec![blob("vcpu0", 2, &[1; 64])]);
    let dst = SoftGuest::reading(&map(), 1);
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let h = serve(l, dst, 1);
    let mut s = Source::new(src.clone(), config());
    let e = s.migrate(&addr, &mut |_| {}).unwrap_err();
    assert!(
        matches!(&e, MigrateError::Refused { reason, .. } if reason.contains("version 2")),
        "{e}"
    );
    let de = h.join().unwrap().pop().unwrap().unwrap_err();
    assert!(matches!(de, MigrateError::Guest(_)), "{de}");
    assert!(!s.migrated() && src.running());
}

#[test]
fn a_destination_with_another_memory_map_refuses_with_a_typed_error() {
    let src = source();
    let mut other = map();
    other[2].pages += 1;
    let dst = SoftGuest::new(&other);
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let h = serve(l, dst, 1);
    let e = Source::new(src.clone(), config())
        .migrate(&addr, &mut |_| {})
        .unwrap_err();
    assert!(e.to_string().contains("does not match"), "{e}");
    let de = h.join().unwrap().pop().unwrap().unwrap_err();
    assert!(
        matches!(
            de,
            MigrateError::Rejected(slat_migrate::HelloError::Mismatch { .. })
        ),
        "{de}"
    );
    assert!(src.running());
}

#[test]
fn a_factory_builds_the_guest_from_the_map() {
    let src = source();
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let built = Arc::new(std::sync::Mutex::new(None));
    let b2 = built.clone();
    let h = std::thread::spawn(move || {
        let mut l = l;
        let f: slat_migrate::Factory = Box::new(move |r: &[Region], _m: &[u8]| {
            let g = SoftGuest::new(r);
            *b2.lock().unwrap() = Some(g.clone());
            Ok(g as Arc<dyn Guest>)
        });
        let c = l.accept(TIMEOUT).unwrap();
        Destination::new(f, dest_config()).serve_channel(c)
    });
    Source::new(src.clone(), config())
        .migrate(&addr, &mut |_| {})
        .unwrap();
    h.join().unwrap().unwrap();
    let dst = built.lock().unwrap().take().unwrap();
    assert_same(&src, &dst);
}

/// A migration over TCP with `cfg` to a destination that accepts deltas or not; returns the
/// source's report after checking memory byte for byte.
fn migrate_delta(cfg: SourceConfig, accept: bool) -> slat_migrate::MigrationReport {
    let src = source();
    let dst = SoftGuest::new(&map());
    let mut l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let d = dst.clone();
    let h = std::thread::spawn(move || {
        let dc = DestConfig {
            delta: accept,
            ..dest_config()
        };
        Destination::with_guest(d, dc).accept_from(&mut l)
    });
    let mut s = Source::new(src.clone(), cfg);
    let r = s.migrate(&addr, &mut |_| {}).unwrap();
    h.join().unwrap().unwrap();
    assert_same(&src, &dst);
    r
}

/// Rounds until some page went as a delta (the guest's writes are random: a round may find
/// none of its pages cached yet).
fn rounds_with_deltas(cfg: SourceConfig) -> slat_migrate::MigrationReport {
    for _ in 0..20 {
        let r = migrate_delta(cfg.clone(), true);
        if r.rounds.iter().any(|x| x.delta_pages > 0) {
            return r;
        }
    }
    panic!("no page went as a delta in 20 migrations");
}

#[test]
fn pages_written_in_several_places_go_as_deltas_and_arrive_exact() {
    // The guest writes words at random offsets of random pages: a page sent again has
    // changed in one or several places since its cached copy.
    let r = rounds_with_deltas(SourceConfig {
        max_rounds: 6,
        ..config()
    });
    let d = r.delta.expect("the destination accepted deltas");
    assert_eq!(d.cache_bytes, 184 * 4096, "the cache is at most the guest");
    assert!(d.hits > 0 && d.refused == 0, "{d:?}");
}

#[test]
fn a_cache_smaller_than_the_guest_evicts_and_evicted_pages_go_whole() {
    let r = rounds_with_deltas(SourceConfig {
        delta_cache: 64 * 4096,
        max_rounds: 6,
        ..config()
    });
    let d = r.delta.unwrap();
    assert_eq!((d.cache_bytes, d.allocated), (64 * 4096, 64 * 4096));
    // 184 pages share 64 slots: in round 0 the first 64 keep them and the other 120 go
    // whole uncached; later a page whose slot another page of the same round holds, or
    // whose copy was evicted, goes whole too, and memory still matched.
    let nonzero_sent: u64 = r.rounds.iter().map(|x| x.pages - x.zero_pages).sum();
    assert_eq!(d.hits + d.misses, nonzero_sent);
    assert!(d.misses > 184 - 64, "{d:?}");
}

#[test]
fn deltas_off_or_refused_send_every_page_whole() {
    for (cfg, accept) in [
        (
            SourceConfig {
                delta_cache: 0,
                ..config()
            },
            true,
        ),
        (config(), false),
    ] {
        let r = migrate_delta(cfg, accept);
        assert!(r.delta.is_none());
        assert!(r.rounds.iter().all(|x| x.delta_pages == 0));
    }
}
