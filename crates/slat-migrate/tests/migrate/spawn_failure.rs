//! slat-migrate is embedded in VMMs: a thread the operating system refuses is a typed
//! [`MigrateError::Thread`], never a panic in the embedder's process or a hang, and the
//! threads of a half-started round are ended and joined. Forced in a child under an
//! address-space limit, with the address space used up (mapped inaccessible) right before
//! the round's stream threads start.

use crate::vmm::soft::SoftGuest;
use crate::vmm::{assert_same, config, dest_config, map, serve, source, TIMEOUT};
use slat_migrate::transport::{Endpoint, Listener};
use slat_migrate::{Destination, Event, Guest, MigrateError, Source, SourceConfig};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../../../test-support/as_limit.rs"]
mod as_limit;
use as_limit::{rerun_under_as_limit_within, threads_of_this_process};

/// Room for the test process's threads and their allocator arenas.
const AS_LIMIT: u64 = 4 << 30;
const STREAMS: u32 = 16;

fn threads_named(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// Waits (at most 10 s) until `n` threads of this process have names starting with `prefix`.
fn wait_for_threads(prefix: &str, n: usize) {
    let t0 = Instant::now();
    while threads_named(prefix) < n {
        assert!(t0.elapsed() < TIMEOUT, "{n} threads named {prefix}*");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Left free by [`Exhausted::leaving`]: small allocations, and about two 2 MiB thread stacks
/// (with their guard pages).
const ROOM: usize = (1 << 20) + 2 * ((2 << 20) + (64 << 10));

/// The address space left under the limit, mapped inaccessible except for `room` bytes (and
/// less than 64 KiB more): small allocations still succeed, a 2 MiB thread stack does not.
struct Exhausted(Vec<(*mut libc::c_void, usize)>);

impl Exhausted {
    fn leaving(room: usize) -> Exhausted {
        let mut maps = Vec::new();
        let mut size = 1usize << 30;
        while size >= 64 << 10 {
            // SAFETY: a new anonymous mapping at an address the kernel picks; nothing of
            // this process is touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                size /= 2;
            } else {
                maps.push((p, size));
            }
        }
        // Give `room` back, from the end of the mappings.
        let mut give = room;
        while give > 0 {
            let (p, len) = maps.pop().expect("the limit left room to reserve");
            let n = len.min(give);
            // SAFETY: the last `n` bytes of a mapping made above, which nothing uses.
            unsafe { libc::munmap(p.cast::<u8>().add(len - n).cast(), n) };
            if n < len {
                maps.push((p, len - n));
            }
            give -= n;
        }
        Exhausted(maps)
    }
}

// SAFETY: the addresses of mappings nobody accesses (PROT_NONE); only `drop` uses them, to
// unmap them, on whichever thread.
unsafe impl Send for Exhausted {}

impl Drop for Exhausted {
    fn drop(&mut self) {
        for &(p, len) in &self.0 {
            // SAFETY: mappings made by `leaving`, which nothing uses.
            unsafe { libc::munmap(p, len) };
        }
    }
}

/// The source's stream threads start at each round, after the connections are open: the
/// address space is used up at `Event::Connected` (once the destination's threads are all
/// up), so the round's spawns fail part-way (room for about two stacks is left). The old
/// code panicked in `thread::scope`'s spawn, unwinding through the embedder. Now the attempt
/// fails with the typed error, the guest runs on, no thread is left, and a retry with the
/// address space back completes.
#[test]
fn a_striped_source_whose_stream_threads_cannot_start_fails_with_a_typed_error() {
    if rerun_under_as_limit_within(
        module_path!(),
        "a_striped_source_whose_stream_threads_cannot_start_fails_with_a_typed_error",
        AS_LIMIT,
        Some(120),
    ) {
        return;
    }
    let before = threads_of_this_process();
    let src = source();
    let dst = SoftGuest::new(&map());
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let h = serve(l, dst.clone(), 2);
    let mut s = Source::new(
        src.clone(),
        SourceConfig {
            connections: STREAMS,
            ..config()
        },
    );
    let mut exhausted = None;
    let mut on_event = |e: Event<'_>| {
        if let Event::Connected { .. } = e {
            let t0 = Instant::now();
            while threads_named("migrate-recv") < STREAMS as usize {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "destination threads"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            exhausted = Some(Exhausted::leaving((1 << 20) + 2 * ((2 << 20) + (64 << 10))));
        }
    };
    let e = s.migrate(&addr, &mut on_event).unwrap_err();
    drop(exhausted.take());
    assert!(matches!(e, MigrateError::Thread(_)), "{e}");
    assert_eq!(threads_named("migrate-send"), 0, "stream threads left");
    assert!(!s.migrated() && src.running(), "the source runs on");
    let r = s.migrate(&addr, &mut |_| {}).unwrap();
    assert_eq!(r.connections, STREAMS);
    let results = h.join().unwrap();
    assert!(results[0].is_err() && results[1].is_ok(), "{results:?}");
    assert_same(&src, &dst);
    drop((s, src, dst));
    assert_eq!(threads_of_this_process(), before, "threads left");
}

/// The destination starts its threads (the control reader, one per stream) once every page
/// stream is accepted: the address space is used up right after the last one (once the
/// source's reader threads are all up; the source then waits in `Event::Connected` until the
/// destination has answered), so they fail part-way. The old code panicked in
/// `thread::scope`'s spawn, and the scope then waited for the threads started, blocked in
/// reads of connections that stayed open. Now the destination fails with the typed error
/// and closes the connections (the source's attempt fails on them), no thread is left, and a
/// retry completes.
#[test]
fn a_striped_destination_whose_threads_cannot_start_fails_with_a_typed_error() {
    if rerun_under_as_limit_within(
        module_path!(),
        "a_striped_destination_whose_threads_cannot_start_fails_with_a_typed_error",
        AS_LIMIT,
        Some(120),
    ) {
        return;
    }
    let before = threads_of_this_process();
    let src = source();
    let dst = SoftGuest::new(&map());
    let mut l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.describe();
    let released = Arc::new(AtomicBool::new(false));
    let mut streams = l.acceptor(TIMEOUT).unwrap();
    let exhausted = Arc::new(Mutex::new(None));
    let (mut accepted, held) = (0, exhausted.clone());
    let mut d = Destination::with_guest(dst.clone(), dest_config());
    d.set_acceptor(Box::new(move || {
        let c = streams()?;
        accepted += 1;
        if accepted == STREAMS {
            // The source's control connection and every stream have their reader thread.
            wait_for_threads("migrate-acks", STREAMS as usize + 1);
            *held.lock().unwrap() = Some(Exhausted::leaving(ROOM));
        }
        Ok(c)
    }));
    let done = released.clone();
    let h = std::thread::spawn(move || {
        let first = l.accept(TIMEOUT).and_then(|c| d.serve_channel(c));
        drop(exhausted.lock().unwrap().take());
        done.store(true, Ordering::Release);
        let second = l.accept(TIMEOUT).and_then(|c| d.serve_channel(c));
        (first, second)
    });
    let mut s = Source::new(
        src.clone(),
        SourceConfig {
            connections: STREAMS,
            ..config()
        },
    );
    let mut on_event = |e: Event<'_>| {
        if let Event::Connected { .. } = e {
            let t0 = Instant::now();
            while !released.load(Ordering::Acquire) {
                assert!(t0.elapsed() < TIMEOUT, "the destination never answered");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    let e = s.migrate(&addr, &mut on_event).unwrap_err();
    assert!(!s.migrated() && src.running(), "the source runs on: {e}");
    let r = s.migrate(&addr, &mut |_| {}).unwrap();
    assert_eq!(r.connections, STREAMS);
    let (first, second) = h.join().unwrap();
    assert!(matches!(first, Err(MigrateError::Thread(_))), "{first:?}");
    assert_eq!(second.unwrap().streams, STREAMS);
    assert_same(&src, &dst);
    drop((s, src, dst));
    assert_eq!(threads_of_this_process(), before, "threads left");
}
