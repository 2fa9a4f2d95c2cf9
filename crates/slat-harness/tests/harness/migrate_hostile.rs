//! A hostile source against a live destination, one defect at a time: each test sends a
//! crafted stream over loopback and checks that the destination refuses it with a typed error
//! and one line — before mapping anything for a memory map that does not add up, and without ever
//! writing outside guest memory or accepting frames out of the protocol's order.

use crate::common;

use common::wire::{self, ty, Payload};
use common::{dest_config, spawn_dest};
use slat_addr::PageIndex;
use slat_harness::migrate::{self, GuestSpec, LogMode, Shape};
use slat_migrate::stream::{self, BatchBuilder, Compression, FrameReader, Msg, Region};
use slat_migrate::{DestConfig, Destination, Memory, MigrateError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

/// A factory that records every memory map it is asked to build for (and builds small
/// benchmark guests).
fn recording_factory() -> (slat_migrate::Factory, Arc<Mutex<Vec<Vec<Region>>>>) {
    let asked = Arc::new(Mutex::new(Vec::new()));
    let a = asked.clone();
    let mut inner = migrate::factory(GuestSpec::sim(small(), LogMode::Get));
    let f: slat_migrate::Factory = Box::new(move |r: &[Region], m: &[u8]| {
        a.lock().unwrap().push(r.to_vec());
        inner(r, m)
    });
    (f, asked)
}

/// Sends `frames` after a valid preamble to a fresh destination; returns its result, its
/// replies and the maps its factory was asked for.
fn against_destination(
    frames: &[Vec<u8>],
    cfg: DestConfig,
) -> (
    Result<slat_migrate::DestReport, MigrateError>,
    Vec<Msg>,
    Vec<Vec<Region>>,
) {
    let (f, asked) = recording_factory();
    let (addr, h) = spawn_dest(Destination::new(f, cfg), 1);
    let mut bytes = stream::preamble(stream::VERSION).to_vec();
    for fr in frames {
        bytes.extend_from_slice(fr);
    }
    let raw = wire::exchange(&addr, bytes, TIMEOUT);
    let (mut results, _) = h.join().expect("the destination thread panicked");
    let asked = asked.lock().unwrap().clone();
    (results.remove(0), wire::replies(&raw), asked)
}

/// The destination failed with one line and told the source why (first reply a refusal);
/// returns the error's text.
fn refused(r: &Result<slat_migrate::DestReport, MigrateError>, replies: &[Msg]) -> String {
    let e = match r {
        Ok(_) => panic!("the destination accepted a hostile stream; replies {replies:?}"),
        Err(e) => e.to_string(),
    };
    assert_eq!(e.lines().count(), 1, "{e}");
    e
}

fn hello_frame(regions: &[Region], machine: &[u8]) -> Vec<u8> {
    wire::hello_payload(7, 1, false, regions, machine, 0, 64, 0, b"sim").frame(ty::HELLO)
}

fn rw(gpa: u64, pages: u64) -> Region {
    Region {
        gpa: slat_addr::Gpa::new(gpa),
        pages,
        read_only: false,
    }
}

/// The adversarial tester's stream of protocol 1 came back: a size that overflows 64 bits
/// (there vCPUs x bytes per vCPU, here a region's pages x 4 KiB and its end) must be refused
/// before anything is built, not wrap to a small guest whose later pages land outside it.
#[test]
fn a_hello_whose_size_overflows_is_refused_before_anything_is_built() {
    let saturated = u64::MAX / 4096;
    for regions in [
        vec![rw(0, saturated)],
        vec![rw(!4095, 1)],
        vec![rw(0, 4), rw(1 << 40, u64::MAX)],
    ] {
        let frames = vec![hello_frame(&regions, &small().encode())];
        let (r, replies, asked) = against_destination(&frames, dest_config());
        let e = refused(&r, &replies);
        assert!(e.contains("reaches past"), "{e}");
        assert!(asked.is_empty(), "a machine was built for {asked:?}");
        assert!(
            matches!(replies.first(), Some(Msg::Refuse(why)) if why.contains("reaches past")),
            "{replies:?}"
        );
    }
}

/// A hello announcing billions of regions is refused by the decoder, before it allocates
/// anything for them.
#[test]
fn a_hello_with_billions_of_regions_is_refused() {
    let f = Payload::default()
        .u64(7)
        .u32(1)
        .u8(0)
        .u32(u32::MAX)
        .u64(0)
        .u64(1)
        .u8(0)
        .frame(ty::HELLO);
    let (r, replies, asked) = against_destination(&[f], dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("memory regions"), "{e}");
    assert!(asked.is_empty(), "a machine was built for {asked:?}");
}

/// Overlapping, unordered, empty or unaligned regions are refused with a typed error.
#[test]
fn a_memory_map_that_does_not_add_up_is_refused() {
    for (regions, want) in [
        (vec![rw(0, 16), rw(8 * 4096, 16)], "overlaps"),
        (vec![rw(1 << 20, 16), rw(0, 16)], "overlaps"),
        (vec![rw(0, 0)], "no pages"),
        (vec![rw(100, 1)], "page boundary"),
        (vec![], "0 memory regions"),
    ] {
        let (r, replies, asked) =
            against_destination(&[hello_frame(&regions, &small().encode())], dest_config());
        let e = refused(&r, &replies);
        assert!(e.contains(want), "{want}: {e}");
        assert!(asked.is_empty(), "a machine was built for {asked:?}");
    }
}

/// More guest memory than the host's RAM and swap is refused before the factory maps it,
/// also when the destination has no limit of its own.
#[test]
fn a_hello_beyond_the_host_is_refused_without_a_configured_limit() {
    let pps = (64u64 << 30) / 4096;
    let regions: Vec<Region> = (0..512).map(|s| rw(s * pps * 4096, pps)).collect();
    let frames = vec![hello_frame(&regions, &[])];
    let (r, replies, asked) = against_destination(&frames, dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("RAM and swap"), "{e}");
    assert!(asked.is_empty(), "a machine was built for {asked:?}");
}

/// A machine description the factory cannot read, or a map it does not give, is refused
/// with a typed error after the factory looked at it (and built nothing).
#[test]
fn a_machine_the_factory_cannot_build_is_refused() {
    let (r, replies, _) = against_destination(&[hello_frame(&[rw(0, 32)], b"junk")], dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("machine description"), "{e}");
    let (r, replies, _) = against_destination(
        &[hello_frame(&[rw(0, 32)], &small().encode())],
        dest_config(),
    );
    let e = refused(&r, &replies);
    assert!(e.contains("does not match"), "{e}");
}

fn small() -> Shape {
    Shape {
        vcpus: 2,
        bytes_per_vcpu: 64 << 10,
        slots: 2,
        overlap: false,
    }
}

/// A page index past the guest's memory is refused before anything of its batch is written.
#[test]
fn a_page_beyond_the_guest_is_refused() {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 1), Compression::None, 8, &[]);
    let mut frames = vec![v.frames[0].clone()];
    let mut b = BatchBuilder::new(Compression::None);
    b.start(0, 0);
    b.push(PageIndex::new(1), &[7u8; 4096]);
    b.push(PageIndex::new(32), &[7u8; 4096]);
    frames.push(b.frame().to_vec());
    let (r, replies, _) = against_destination(&frames, dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("page 32 is outside the guest's 32 pages"), "{e}");
}

/// A valid stream with one frame replaced: the destination must refuse it.
fn with_frame(at: usize, frame: Vec<u8>, insert: bool) -> String {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::Lz4, 8, &[]);
    let mut frames = v.frames.clone();
    if insert {
        frames.insert(at, frame);
    } else {
        frames[at] = frame;
    }
    let (r, replies, _) = against_destination(&frames, dest_config());
    refused(&r, &replies)
}

/// The unmodified stream of `with_frame` migrates (so the refusals below are the frame's).
#[test]
fn the_crafted_streams_are_valid_without_the_hostile_frame() {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::Lz4, 8, &[]);
    let (r, replies, _) = against_destination(&v.frames, dest_config());
    assert!(r.is_ok(), "{r:?} {replies:?}");
}

/// Pages after the verification used to be written into a guest already verified (and the
/// commit then ran a guest whose memory no hash had checked).
#[test]
fn pages_after_the_verification_are_refused() {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::Lz4, 8, &[]);
    let mut b = BatchBuilder::new(Compression::None);
    b.start(4, 0);
    b.push(PageIndex::new(3), &[0xee; 4096]);
    // Just before the commit, after Verify.
    let e = with_frame(v.frames.len() - 1, b.frame().to_vec(), true);
    assert!(e.contains("after the verification hashes"), "{e}");
}

/// A round's end must name the round in progress and the pages its batches carried.
#[test]
fn round_ends_must_match_their_batches() {
    let e = with_frame(
        5,
        stream::frame(&Msg::RoundEnd {
            round: 0,
            pages: 1_000_000,
        }),
        false,
    );
    assert!(e.contains("announced 1000000 pages"), "{e}");
    let e = with_frame(
        1,
        stream::frame(&Msg::RoundEnd { round: 9, pages: 0 }),
        true,
    );
    assert!(e.contains("the end of round 9"), "{e}");
}

/// Each range is hashed once: a repeated hash (which made hashing work unbounded by the
/// guest's size, and could double-count) is refused.
#[test]
fn each_range_is_hashed_once() {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::Lz4, 8, &[]);
    let hashes_at = v.frames.len() - 3;
    let dup = v.frames[hashes_at].clone();
    let e = with_frame(hashes_at, dup, true);
    assert!(e.contains("hashed twice"), "{e}");
}

/// Guest memory addressed past its end is an error, not a panic.
#[test]
fn guest_memory_out_of_range_is_an_error() {
    let g = migrate::build(&GuestSpec::sim(small(), LogMode::Get)).unwrap();
    let mem = Memory::new(g.as_dyn()).unwrap();
    let pages = mem.pages();
    let page = vec![1u8; 4096];
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (
            mem.stopped_write_page(PageIndex::new(pages), &page)
                .is_err(),
            mem.stopped_write_page(PageIndex::new(u64::MAX), &page)
                .is_err(),
            mem.stopped_write_page(PageIndex::new(0), &page[..100])
                .is_err(),
            mem.stopped_range(PageIndex::new(0), PageIndex::new(pages + 1))
                .is_err(),
            mem.stopped_range(PageIndex::new(3), PageIndex::new(2))
                .is_err(),
        )
    }));
    assert_eq!(r.ok(), Some((true, true, true, true, true)));
}

/// A batch entry that does not exist, or an output buffer that is not a page, is an error.
#[test]
fn batch_entries_are_checked() {
    let mut b = BatchBuilder::new(Compression::Lz4);
    b.start(0, 0);
    b.push(PageIndex::new(1), &[5u8; 4096]);
    let f = b.frame().to_vec();
    let Ok(Msg::Pages(batch)) = FrameReader::new(&f[..], TIMEOUT).read_msg("test") else {
        panic!("not a batch")
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut out = vec![0u8; 4096];
        let mut short = vec![0u8; 10];
        (
            batch.page_into(0, &mut out).is_ok(),
            batch.page_into(1, &mut out).is_err(),
            batch.page_into(usize::MAX, &mut out).is_err(),
            batch.page_into(0, &mut short).is_err(),
        )
    }));
    assert_eq!(r.ok(), Some((true, true, true, true)));
}

/// A peer's text (a refusal's reason, a backend name) prints as one line without terminal
/// escapes.
#[test]
fn peer_text_is_one_harmless_line() {
    let f = Payload::default()
        .text(b"no\nsecond line\x1b[2J\r")
        .frame(ty::REFUSE);
    let Ok(Msg::Refuse(why)) = FrameReader::new(&f[..], TIMEOUT).read_msg("test") else {
        panic!("not a refusal")
    };
    assert!(!why.chars().any(char::is_control), "{why:?}");
    assert!(
        why.starts_with("no") && why.contains("second line"),
        "{why:?}"
    );
}

/// A destination that answers with a multi-line refusal: the source's error stays one line.
#[test]
fn a_hostile_refusal_reaches_the_source_as_one_line() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut r = FrameReader::new(s.try_clone().unwrap(), TIMEOUT);
        r.read_preamble().unwrap();
        r.read_msg("hello").unwrap();
        let f = Payload::default()
            .text(b"go away\n\x1b[31mslat: migration complete")
            .frame(ty::REFUSE);
        std::io::Write::write_all(&mut s, &f).unwrap();
    });
    let g = common::source_guest(migrate::BackendKind::Sim, small(), LogMode::Get);
    let mut src = common::start_source(&g, common::work(1000), common::source_config());
    let e = src.migrate(&addr, &mut |_| {}).unwrap_err().to_string();
    peer.join().unwrap();
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(!e.contains('\x1b'), "{e:?}");
}

/// A source that trickles its hello one byte at a time, each just inside the socket's read
/// timeout, used to hold the destination for as long as it liked (every read succeeded): the
/// whole frame must now arrive within the timeout.
#[test]
fn a_trickling_source_times_out_within_the_frame_deadline() {
    use std::io::Write;
    let timeout = Duration::from_millis(600);
    let cfg = DestConfig {
        timeout,
        ..dest_config()
    };
    let (f, asked) = recording_factory();
    let (addr, h) = spawn_dest(Destination::new(f, cfg), 1);
    let mut bytes = stream::preamble(stream::VERSION).to_vec();
    bytes.extend_from_slice(&hello_frame(
        &wire::shape_regions(&small()),
        &small().encode(),
    ));
    let mut s = std::net::TcpStream::connect(&addr).expect("connect");
    let t0 = std::time::Instant::now();
    // One byte every 200 ms: 150+ bytes would take 30 s; the old reader waited it out.
    for b in bytes {
        if s.write_all(&[b]).is_err() || t0.elapsed() > Duration::from_secs(20) {
            break; // the destination hung up (the fix) or we gave up (the bug)
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (mut results, _) = h.join().expect("the destination thread panicked");
    let elapsed = t0.elapsed();
    match results.remove(0) {
        Err(e) => assert!(e.to_string().contains("did not complete a frame"), "{e}"),
        Ok(_) => panic!("a trickled stream was accepted after {elapsed:?}"),
    }
    assert!(
        elapsed < Duration::from_secs(10),
        "the destination waited {elapsed:?} for a trickled frame (timeout {timeout:?})"
    );
    assert!(asked.lock().unwrap().is_empty(), "a machine was built");
}

/// Whole-range reads hand out copies, never references into guest memory: a guest started
/// (or a page written) after the read cannot change what the caller holds, and a read while
/// the vCPUs run is refused rather than returning a torn snapshot.
#[test]
fn whole_range_reads_are_copies_and_need_stopped_vcpus() {
    let g = migrate::build(&GuestSpec::sim(small(), LogMode::Get)).unwrap();
    let mem = Memory::new(g.as_dyn()).unwrap();
    mem.stopped_write_page(PageIndex::new(0), &[7u8; 4096])
        .unwrap();
    let before = mem
        .stopped_range(PageIndex::new(0), PageIndex::new(2))
        .unwrap();
    mem.stopped_write_page(PageIndex::new(0), &[9u8; 4096])
        .unwrap();
    assert!(before[..4096].iter().all(|&b| b == 7));
    let mut buf = vec![0u8; 4096];
    assert!(
        mem.stopped_read(PageIndex::new(0), PageIndex::new(2), &mut buf)
            .is_err(),
        "a buffer of the wrong size"
    );
    mem.stopped_read(PageIndex::new(0), PageIndex::new(1), &mut buf)
        .unwrap();
    assert!(buf.iter().all(|&b| b == 9));
    let work = migrate::WorkSpec {
        write_percent: 100,
        random: true,
        seed: 3,
        rate: 1000,
    };
    g.start(work).unwrap();
    assert!(mem
        .stopped_read(PageIndex::new(0), PageIndex::new(1), &mut buf)
        .is_err());
    assert!(mem
        .stopped_range(PageIndex::new(0), PageIndex::new(1))
        .is_err());
    assert!(mem
        .stopped_write_page(PageIndex::new(1), &[1u8; 4096])
        .is_err());
    // Reading page by page beside running vCPUs is what pre-copy does.
    mem.read_page(PageIndex::new(0), &mut buf).unwrap();
    g.pause().unwrap();
    assert!(before[..4096].iter().all(|&b| b == 7));
}

fn state_frame(id: &[u8], version: u32, data: &[u8]) -> Vec<u8> {
    Payload::default()
        .text(id)
        .u32(version)
        .u32(data.len() as u32)
        .bytes(data)
        .frame(ty::STATE)
}

/// The index of the `StateEnd` frame in `with_frame`'s stream.
fn state_end_at() -> usize {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::Lz4, 8, &[]);
    v.frames
        .iter()
        .position(|f| f[0] == ty::STATE_END)
        .expect("a state end")
}

/// Device state is bounded and counted: a repeated id, a count that does not match what
/// arrived, hashes before the state ended, a blob larger than a frame carries, and state in
/// the middle of a round are each refused with a typed error.
#[test]
fn device_state_is_checked() {
    let at = state_end_at();
    // A blob the end does not count.
    let e = with_frame(at, state_frame(b"slat.workload", 1, &[0; 17]), true);
    assert!(e.contains("announcing 0 blobs"), "{e}");
    let mut dup = vec![state_frame(b"a", 1, b"x"), state_frame(b"a", 1, b"y")];
    dup.push(Payload::default().u32(2).u64(2).frame(ty::STATE_END));
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::Lz4, 8, &[]);
    let mut frames = v.frames.clone();
    frames.splice(at..at + 1, dup);
    let (r, replies, _) = against_destination(&frames, dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("device state `a` arrived twice"), "{e}");
    // Hashes with no device state before them.
    let mut frames = v.frames.clone();
    frames.remove(at);
    let (r, replies, _) = against_destination(&frames, dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("before the device state ended"), "{e}");
    // A blob announcing more than a frame may carry is a corrupt frame, not an allocation.
    let big = Payload::default()
        .text(b"gpu")
        .u32(1)
        .u32(u32::MAX)
        .frame(ty::STATE);
    let e = with_frame(at, big, true);
    assert!(e.contains("device-state blob of 4294967295 bytes"), "{e}");
    // State in the middle of round 0 (after its first batch).
    let e = with_frame(2, state_frame(b"x", 1, b""), true);
    assert!(e.contains("device state in the middle of round 0"), "{e}");
}

/// A one-way stream (a file's) over a connection that answers, or the reverse, is refused.
#[test]
fn a_one_way_hello_on_a_connection_is_refused() {
    let hello = wire::hello_payload(
        7,
        1,
        true,
        &wire::shape_regions(&small()),
        &small().encode(),
        0,
        64,
        0,
        b"sim",
    )
    .frame(ty::HELLO);
    let (r, replies, asked) = against_destination(&[hello], dest_config());
    let e = refused(&r, &replies);
    assert!(e.contains("one-way"), "{e}");
    assert!(asked.is_empty());
}

/// The hello, then batch 0 of round 0 with page 1 whole, then batch 1 with page 1 as the
/// delta `delta` (its bytes as given, its length as written).
fn delta_frames(delta: &[u8]) -> Vec<Vec<u8>> {
    let v = wire::valid_stream(small(), &wire::image(32, 50, 2), Compression::None, 8, &[]);
    let whole = Payload::default().u64(0).u32(0).u32(1).u64(1).u8(1);
    let delta = Payload::default()
        .u64(1)
        .u32(0)
        .u32(1)
        .u64(1)
        .u8(3)
        .u32(delta.len() as u32)
        .bytes(delta);
    vec![
        v.frames[0].clone(),
        whole.bytes(&[9u8; 4096]).frame(ty::PAGES),
        delta.frame(ty::PAGES),
    ]
}

/// A run of a delta page: (skip, len) and `len` bytes.
fn run(skip: u16, len: u16) -> Vec<u8> {
    let mut d = skip.to_le_bytes().to_vec();
    d.extend(len.to_le_bytes());
    d.extend(std::iter::repeat_n(0xee, len as usize));
    d
}

/// A delta whose runs reach past the page (one run, or the skips of two adding up) or lie
/// about their length is refused with a typed error, never written outside the page.
#[test]
fn a_delta_that_runs_past_the_page_is_refused() {
    let (r, _, _) = against_destination(&delta_frames(&run(0, 8)), dest_config());
    assert!(r.is_ok() || !format!("{r:?}").contains("delta"), "{r:?}");
    for d in [run(4095, 2), [run(4000, 1), run(95, 1)].concat()] {
        let (r, replies, _) = against_destination(&delta_frames(&d), dest_config());
        let e = refused(&r, &replies);
        assert!(
            e.contains("page 1: a run of") && e.contains("past the page"),
            "{e}"
        );
    }
    let (r, replies, _) = against_destination(&delta_frames(&run(0, 0)), dest_config());
    assert!(refused(&r, &replies).contains("an empty run"));
    let mut short = run(0, 8);
    short.truncate(6);
    let (r, replies, _) = against_destination(&delta_frames(&short), dest_config());
    assert!(refused(&r, &replies).contains("past the page or the entry"));
}

/// A delta where the destination did not accept deltas is refused.
#[test]
fn a_delta_the_destination_did_not_accept_is_refused() {
    let cfg = DestConfig {
        delta: false,
        ..dest_config()
    };
    let (r, replies, _) = against_destination(&delta_frames(&run(0, 8)), cfg);
    let e = refused(&r, &replies);
    assert!(e.contains("which this destination did not accept"), "{e}");
}
