//! slat-migrate is embedded in VMMs: a thread the operating system refuses is a typed
//! [`MigrateError::Thread`], never a panic in the embedder's process or a hang, and the
//! threads of a half-started round are ended and joined. Forced in a child under an
//! address-space limit, with the address space used up (mapped inaccessible) right before
//! the round's stream threads start.

use crate::vmm::soft::SoftGuest;
use crate::vmm::{assert_same, config, map, serve, source};
use slat_migrate::transport::{Endpoint, Listener};
use slat_migrate::{Event, Guest, MigrateError, Source, SourceConfig};
use std::time::{Duration, Instant};

#[path = "../../../test-support/as_limit.rs"]
mod as_limit;
use as_limit::rerun_under_as_limit_within;

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

fn threads_of_this_process() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

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
