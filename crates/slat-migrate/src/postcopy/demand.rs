//! The destination's demand pager: which pages are missing, the faults on them turned into
//! requests for the source, and each arriving page placed once.

use super::uffd::{self, Uffd};
use super::{Blocktime, PageBits, PostcopyDestReport, PostcopyError};
use crate::guest::MemoryMap;
use crate::stream::PAGE_BYTES;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the fault thread and the page readers share under one lock.
#[derive(Default)]
struct Shared {
    /// Pages asked for and not placed yet, with the time their first fault was read.
    requested: HashMap<u64, Instant>,
    /// Pages to ask the source for, oldest first.
    queue: VecDeque<u64>,
    /// Fault latencies of the pages placed.
    samples: Vec<Duration>,
    report: PostcopyDestReport,
    /// When the last missing page was placed.
    last: Option<Instant>,
}

/// Guest memory filled on demand through a userfaultfd (see [`super`]).
pub(crate) struct Demand {
    uffd: Uffd,
    map: MemoryMap,
    /// Set: the page has not arrived.
    missing: PageBits,
    left: AtomicU64,
    shared: Mutex<Shared>,
    /// Signalled when a request is queued or the last page arrives.
    cv: Condvar,
    stop: AtomicBool,
    /// When the guest started here.
    t_run: Mutex<Option<Instant>>,
    fault_thread: Mutex<Option<JoinHandle<()>>>,
}

/// How long the fault thread waits for a fault before it looks at its stop flag.
const POLL: Duration = Duration::from_millis(20);

impl Demand {
    /// Registers every region of `map` with a new userfaultfd and discards the pages of
    /// `runs` (memory-index runs, checked), so the guest's first touch of one waits for it.
    ///
    /// # Safety
    ///
    /// `map` is the memory of a paused guest whose [`crate::Guest::demand_paged`] is true
    /// (private anonymous memory this migration may discard and register), and nothing reads
    /// the discarded pages except through the guest's own accesses, which wait for them.
    pub(crate) unsafe fn arm(
        map: MemoryMap,
        runs: &[(u64, u64)],
    ) -> Result<Arc<Demand>, PostcopyError> {
        let missing = PageBits::new(map.pages());
        let discarded = missing.set_runs(runs)?;
        let err = |what: &str, e: std::io::Error| PostcopyError::Uffd(format!("{what}: {e}"));
        let uffd = Uffd::new().map_err(|e| err("opening a userfaultfd", e))?;
        for r in map.regions() {
            let len = r.region.pages * PAGE_BYTES as u64;
            uffd.register(r.host.raw(), len)
                .map_err(|e| err("registering guest memory", e))?;
        }
        let (out, _) = missing.runs(0, usize::MAX);
        for (a, n) in out {
            for (host, len) in pieces(&map, a, n) {
                // SAFETY: the caller's contract: the guest is paused, its memory may be
                // discarded, and the range (inside one region of the checked map) is refilled
                // on demand through the registration above.
                unsafe { uffd::discard(host, len) }.map_err(|e| err("discarding pages", e))?;
            }
        }
        let d = Demand {
            uffd,
            map,
            missing,
            left: AtomicU64::new(discarded),
            shared: Mutex::new(Shared {
                report: PostcopyDestReport {
                    discarded,
                    ..PostcopyDestReport::default()
                },
                ..Shared::default()
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            t_run: Mutex::new(None),
            fault_thread: Mutex::new(None),
        };
        Ok(Arc::new(d))
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the fault thread (the guest is about to run).
    pub(crate) fn start(self: &Arc<Self>) -> Result<(), PostcopyError> {
        *self.t_run.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        // A weak handle: the thread never holds the last reference, so the pager is never
        // dropped (and never joins) on its own thread.
        let me = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("postcopy-faults".into())
            .spawn(move || {
                let mut addrs = Vec::new();
                while let Some(d) = me.upgrade() {
                    if d.stop.load(Ordering::Acquire) {
                        return;
                    }
                    d.serve_faults(&mut addrs);
                }
            })
            .map_err(|e| PostcopyError::Uffd(format!("starting the fault thread: {e}")))?;
        *self.fault_thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(())
    }

    /// One wait of the fault thread: every fault on a missing page becomes a request (once
    /// per page).
    fn serve_faults(&self, addrs: &mut Vec<u64>) {
        addrs.clear();
        if self.uffd.faults(POLL, addrs).is_err() {
            std::thread::sleep(POLL);
            return;
        }
        {
            for &a in addrs.iter() {
                match self.index_of(a) {
                    Some(p) if self.missing.get(p) => {
                        let mut s = self.lock();
                        if let std::collections::hash_map::Entry::Vacant(e) = s.requested.entry(p) {
                            e.insert(Instant::now());
                            s.queue.push_back(p);
                            s.report.requested += 1;
                            self.cv.notify_all();
                        }
                    }
                    // Placed between the fault and now (the copy woke it), or not guest
                    // memory: make sure nobody sleeps on it.
                    _ => self.uffd.wake(a),
                }
            }
        }
    }

    /// The memory index of host address `a`.
    fn index_of(&self, a: u64) -> Option<u64> {
        self.map.regions().iter().enumerate().find_map(|(i, r)| {
            let off = a.checked_sub(r.host.raw())? / PAGE_BYTES as u64;
            (off < r.region.pages).then(|| self.map.start(i) + off)
        })
    }

    /// Places page `p` with `data` (one page) if it is still missing; false (and the page
    /// left as the guest has it) if it is not — a page the guest wrote after it arrived is
    /// never overwritten by a late copy.
    pub(crate) fn place(&self, p: u64, data: &[u8], preempt: bool) -> Result<bool, PostcopyError> {
        if !self.missing.get(p) {
            self.lock().report.duplicates += 1;
            return Ok(false);
        }
        let (i, off) = self.map.locate(p);
        let host = self.map.regions()[i].host.raw() + off * PAGE_BYTES as u64;
        let placed = self
            .uffd
            .copy(host, data)
            .map_err(|e| PostcopyError::Uffd(format!("placing page {p}: {e}")))?;
        if !placed || !self.missing.claim(p) {
            self.lock().report.duplicates += 1;
            return Ok(false);
        }
        let left = self.left.fetch_sub(1, Ordering::AcqRel) - 1;
        let mut s = self.lock();
        if let Some(t) = s.requested.remove(&p) {
            s.samples.push(t.elapsed());
        }
        if preempt {
            s.report.preempt_pages += 1;
        } else {
            s.report.background_pages += 1;
        }
        if left == 0 {
            s.last = Some(Instant::now());
            self.cv.notify_all();
        }
        Ok(true)
    }

    /// Whether page `p` is still missing.
    pub(crate) fn is_missing(&self, p: u64) -> bool {
        self.missing.get(p)
    }

    /// Pages still missing.
    pub(crate) fn missing(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// The missing pages as runs, at most `max` from page `from` (and where to go on).
    pub(crate) fn missing_runs(&self, from: u64, max: usize) -> (Vec<(u64, u64)>, Option<u64>) {
        self.missing.runs(from, max)
    }

    /// Up to `max` pages to request, waiting at most `wait` for the first.
    pub(crate) fn requests(&self, max: usize, wait: Duration) -> Vec<u64> {
        let mut s = self.lock();
        if s.queue.is_empty() {
            s = self
                .cv
                .wait_timeout(s, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let n = s.queue.len().min(max);
        s.queue
            .drain(..n)
            .filter(|&p| self.missing.get(p))
            .collect()
    }

    /// After a reconnect: every page requested and not arrived is asked for again (the old
    /// connection may have lost the request or the page).
    pub(crate) fn requeue(&self) {
        let mut s = self.lock();
        let mut again: Vec<u64> = s
            .requested
            .keys()
            .copied()
            .filter(|&p| self.missing.get(p))
            .collect();
        again.sort_unstable();
        s.queue = again.into();
        s.report.recoveries += 1;
    }

    /// Waits until every page arrived or `timeout` passed; true if all did.
    pub(crate) fn wait_all(&self, timeout: Duration) -> bool {
        let s = self.lock();
        let (_s, r) = self
            .cv
            .wait_timeout_while(s, timeout, |_| self.missing() > 0)
            .unwrap_or_else(|e| e.into_inner());
        !r.timed_out() || self.missing() == 0
    }

    /// The figures so far.
    pub(crate) fn report(&self) -> PostcopyDestReport {
        let t_run = *self.t_run.lock().unwrap_or_else(|e| e.into_inner());
        let s = self.lock();
        let mut samples = s.samples.clone();
        PostcopyDestReport {
            blocktime: Blocktime::of(&mut samples),
            time_to_last_page: match (t_run, s.last) {
                (Some(a), Some(b)) => b.saturating_duration_since(a),
                _ => Duration::ZERO,
            },
            ..s.report.clone()
        }
    }

    /// Stops the fault thread and drops the registration's users. With pages still
    /// missing, a vCPU that touches one afterwards gets a zero page: only a guest that is
    /// being stopped for good may be left so ([`crate::Destination`] reports it).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.cv.notify_all();
        let h = self
            .fault_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

impl Drop for Demand {
    fn drop(&mut self) {
        // The fault thread holds only a weak handle and ends at its next wake-up.
        self.stop.store(true, Ordering::Release);
    }
}

/// The host pieces `(address, bytes)` of pages `a..a + n`, each inside one region.
fn pieces(map: &MemoryMap, a: u64, n: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut p = a;
    while p < a + n {
        let (i, off) = map.locate(p);
        let r = &map.regions()[i];
        let k = (r.region.pages - off).min(a + n - p);
        out.push((
            r.host.raw() + off * PAGE_BYTES as u64,
            k * PAGE_BYTES as u64,
        ));
        p += k;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::GuestRegion;
    use crate::stream::Region;
    use slat_addr::{Gpa, Hva};
    use std::sync::atomic::AtomicU64;

    /// Four pages of private anonymous memory, unmapped on drop.
    struct Anon(*mut u8);

    impl Anon {
        fn new() -> Anon {
            // SAFETY: a fresh private anonymous mapping; checked below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4 * PAGE_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Anon(p.cast())
        }
        fn word(&self, page: usize) -> &AtomicU64 {
            // SAFETY: page < 4 of a live mapping, 8-byte aligned, accessed only atomically.
            unsafe { AtomicU64::from_ptr(self.0.add(page * PAGE_BYTES).cast()) }
        }
    }

    // SAFETY: the mapping is only accessed atomically (`word`).
    unsafe impl Sync for Anon {}

    impl Drop for Anon {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`, no longer used.
            unsafe { libc::munmap(self.0.cast(), 4 * PAGE_BYTES) };
        }
    }

    fn page(v: u64) -> Vec<u8> {
        (0..PAGE_BYTES / 8).flat_map(|_| v.to_ne_bytes()).collect()
    }

    /// A late copy of a page (the background stream's, after the preempt channel placed it)
    /// must not overwrite what the guest wrote since; a touch of a missing page waits for it
    /// and becomes a request.
    #[test]
    fn a_late_page_never_overwrites_the_guests_write() {
        let mem = Anon::new();
        let region = Region {
            gpa: Gpa::new(0),
            pages: 4,
            read_only: false,
        };
        let map = MemoryMap::new(vec![GuestRegion {
            region,
            host: Hva::from_ptr(mem.0),
        }])
        .unwrap();
        mem.word(0).store(7, Ordering::Relaxed);
        // SAFETY: nothing touches pages 1 and 2 but this test, through the pager.
        let d = unsafe { Demand::arm(map, &[(1, 2)]) }.unwrap();
        d.start().unwrap();
        assert_eq!(d.missing(), 2);
        assert!(d.place(1, &page(0xaaaa), true).unwrap());
        mem.word(1).store(0xbbbb, Ordering::Relaxed);
        assert!(!d.place(1, &page(0xcccc), false).unwrap(), "a late page");
        assert_eq!(
            mem.word(1).load(Ordering::Relaxed),
            0xbbbb,
            "the guest's write stays"
        );
        assert!(
            !d.place(0, &page(0xcccc), false).unwrap(),
            "a page never missing"
        );
        assert_eq!(mem.word(0).load(Ordering::Relaxed), 7);
        std::thread::scope(|s| {
            let r = s.spawn(|| mem.word(2).load(Ordering::Relaxed));
            let reqs = loop {
                let r = d.requests(8, Duration::from_millis(50));
                if !r.is_empty() {
                    break r;
                }
            };
            assert_eq!(reqs, vec![2]);
            assert!(d.place(2, &page(0xdddd), false).unwrap());
            assert_eq!(r.join().unwrap(), 0xdddd, "the touch waited for the page");
        });
        assert!(d.wait_all(Duration::from_secs(1)));
        let rep = d.report();
        assert_eq!(
            (rep.duplicates, rep.requested, rep.blocktime.faults),
            (2, 1, 1)
        );
        d.stop();
    }
}
