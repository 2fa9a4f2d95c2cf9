//! Page streams against a live destination, driven by hand: batches arriving out of order
//! across streams still verify, and a stream header or count that does not belong to the
//! migration is refused with a typed error and one line.

use crate::common;

use common::wire::{self, ty, Payload};
use common::{dest_config, spawn_dest};
use slat_harness::migrate::{self, GuestSpec, LogMode, Shape};
use slat_migrate::stream::{self, BatchBuilder, Compression, FrameReader, Msg};
use slat_migrate::{DestConfig, Destination, Memory, MigrateError, ProtocolError};
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);
const SESSION: u64 = 0x5eed;

fn small() -> Shape {
    Shape {
        vcpus: 2,
        bytes_per_vcpu: 64 << 10,
        slots: 2,
        overlap: false,
    }
}

fn destination(cfg: DestConfig) -> Destination {
    Destination::new(migrate::factory(GuestSpec::sim(small(), LogMode::Get)), cfg)
}

/// A connection to `addr` that has sent the preamble and `frames`.
fn open(addr: &str, frames: &[Vec<u8>]) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(&stream::preamble(stream::VERSION)).unwrap();
    for f in frames {
        s.write_all(f).unwrap();
    }
    s
}

/// The control connection: preamble, hello, then `count` page streams announced.
fn control(addr: &str, count: u32) -> TcpStream {
    let hello = Msg::Hello(wire::honest_hello(SESSION, small(), Compression::None));
    open(
        addr,
        &[
            stream::frame(&hello),
            stream::frame(&Msg::Streams { count }),
        ],
    )
}

fn stream_hello(session: u64, attempt: u32, index: u32) -> Vec<u8> {
    stream::frame(&Msg::StreamHello {
        session,
        attempt,
        index,
    })
}

/// Reads frames from `s` until `want` matches one (or the connection ends: `None`).
fn read_until(s: &TcpStream, want: impl Fn(&Msg) -> bool) -> Option<Msg> {
    let mut r = FrameReader::new(s, TIMEOUT);
    loop {
        match r.read_msg("test") {
            Ok(m) if want(&m) => return Some(m),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}

/// Round 0 over two streams with the batches out of order: stream 1 carries the upper
/// half of memory and goes first, acknowledged before stream 0 sends the lower half in
/// descending order. The destination verifies all of memory against the image.
#[test]
fn pages_arriving_out_of_order_across_streams_still_verify() {
    let pages = small().bytes_per_vcpu * small().vcpus as u64 / 4096;
    let image = wire::image(pages, 60, 7);
    let valid = wire::valid_stream(small(), &image, Compression::None, 4, &[]);
    let (addr, h) = spawn_dest(destination(dest_config()), 1);
    let mut ctl = control(&addr, 2);
    let streams: Vec<TcpStream> = (0..2)
        .map(|i| open(&addr, &[stream_hello(SESSION, 1, i)]))
        .collect();
    let half = pages / 2;
    let upper: Vec<u64> = (half..pages).collect();
    let lower: Vec<u64> = (0..half).rev().collect();
    let mut b = BatchBuilder::new(Compression::None);
    for (s, list) in [(&streams[1], &upper), (&streams[0], &lower)] {
        let mut w = s;
        for (seq, chunk) in list.chunks(3).enumerate() {
            b.start(seq as u64, 0);
            for &p in chunk {
                let at = (p * 4096) as usize;
                b.push(slat_addr::PageIndex::new(p), &image[at..at + 4096]);
            }
            w.write_all(b.frame()).unwrap();
        }
        let last = (list.len() as u64).div_ceil(3) - 1;
        let got = read_until(s, |m| matches!(m, Msg::Ack { seq } if *seq == last));
        assert!(got.is_some(), "stream's batches not acknowledged");
    }
    ctl.write_all(&stream::frame(&Msg::RoundEnd { round: 0, pages }))
        .unwrap();
    // The rest of the valid stream from its device state on: hashes, verify, commit.
    let tail = valid
        .frames
        .iter()
        .skip_while(|f| f[0] != ty::STATE_END)
        .cloned();
    for f in tail {
        ctl.write_all(&f).unwrap();
    }
    let (mut results, d) = h.join().expect("the destination thread panicked");
    let report = results.remove(0).expect("the migration failed");
    assert_eq!(report.streams, 2);
    assert_eq!(report.pages, pages);
    assert!(report.verify.ok());
    let g = d.guest().expect("the migrated guest");
    let m = Memory::new(&**g).unwrap();
    let mem = m
        .stopped_range(
            slat_addr::PageIndex::new(0),
            slat_addr::PageIndex::new(m.pages()),
        )
        .unwrap();
    assert!(mem == image, "memory differs from the image");
    assert!(!g.running());
}

/// The destination's result for a control connection announcing `count` streams, then
/// stream connections sending `headers` (one each) after their preamble.
fn refused(count: u32, headers: &[Vec<u8>], cfg: DestConfig) -> MigrateError {
    let (addr, h) = spawn_dest(destination(cfg), 1);
    let ctl = control(&addr, count);
    let conns: Vec<TcpStream> = headers
        .iter()
        .map(|f| open(&addr, std::slice::from_ref(f)))
        .collect();
    let (mut results, _) = h.join().expect("the destination thread panicked");
    drop((ctl, conns));
    let e = results.remove(0).expect_err("accepted");
    assert_eq!(e.to_string().lines().count(), 1, "{e}");
    e
}

fn protocol(e: &MigrateError) -> Option<&ProtocolError> {
    match e {
        MigrateError::Stream {
            err: slat_migrate::StreamError::Protocol(p),
            ..
        } => Some(p),
        _ => None,
    }
}

#[test]
fn a_stream_count_out_of_bounds_is_refused() {
    for count in [0, 1, 17, u32::MAX] {
        let e = refused(count, &[], dest_config());
        assert!(
            matches!(protocol(&e), Some(ProtocolError::StreamCount { .. })),
            "{count}: {e}"
        );
    }
    // More than this destination takes.
    let cfg = DestConfig {
        max_streams: 2,
        ..dest_config()
    };
    let e = refused(3, &[], cfg);
    assert!(
        matches!(
            protocol(&e),
            Some(ProtocolError::StreamCount { count: 3, max: 2 })
        ),
        "{e}"
    );
}

#[test]
fn stream_headers_of_another_migration_are_refused() {
    for h in [
        stream_hello(SESSION + 1, 1, 0),
        stream_hello(SESSION, 2, 0),
        stream_hello(SESSION, 1, 2),
        stream_hello(SESSION, 1, u32::MAX),
    ] {
        let e = refused(2, &[h], dest_config());
        assert!(
            matches!(protocol(&e), Some(ProtocolError::StreamHeader { .. })),
            "{e}"
        );
    }
    // The same index twice.
    let e = refused(
        2,
        &[stream_hello(SESSION, 1, 1), stream_hello(SESSION, 1, 1)],
        dest_config(),
    );
    assert!(
        matches!(
            protocol(&e),
            Some(ProtocolError::StreamHeader { index: 1, .. })
        ),
        "{e}"
    );
    // Anything but a stream header first.
    let e = refused(2, &[Payload::default().frame(ty::COMMIT)], dest_config());
    assert!(
        matches!(protocol(&e), Some(ProtocolError::Unexpected { .. })),
        "{e}"
    );
}

#[test]
fn streams_announced_and_never_opened_fail_within_the_timeout() {
    let cfg = DestConfig {
        timeout: Duration::from_millis(500),
        ..dest_config()
    };
    let t0 = std::time::Instant::now();
    let e = refused(2, &[], cfg);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(e.to_string().contains("page stream"), "{e}");
}

#[test]
fn a_page_batch_on_the_control_connection_after_streams_is_refused() {
    let (addr, h) = spawn_dest(destination(dest_config()), 1);
    let mut ctl = control(&addr, 2);
    let _s: Vec<TcpStream> = (0..2)
        .map(|i| open(&addr, &[stream_hello(SESSION, 1, i)]))
        .collect();
    let mut b = BatchBuilder::new(Compression::None);
    b.start(0, 0);
    b.push(slat_addr::PageIndex::new(0), &[1u8; 4096]);
    ctl.write_all(b.frame()).unwrap();
    let (mut results, _) = h.join().expect("the destination thread panicked");
    let e = results.remove(0).expect_err("accepted");
    assert!(
        matches!(
            protocol(&e),
            Some(ProtocolError::Unexpected { msg: "pages" })
        ),
        "{e}"
    );
}
