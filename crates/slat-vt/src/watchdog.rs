//! The watchdog: a CPU holding the baton that makes no scheduler call for a whole period has
//! blocked in the operating system on something the simulation does not route (a lock taken
//! directly and held by a parked CPU, a join without `detach`). Nothing else would ever end
//! such a hang, so the watchdog fails the simulation with every CPU's state.
//!
//! A holder that is working rather than blocked (its thread's CPU time advances: mapping and
//! prefaulting guest memory, say) is given up to [`BUSY_PERIODS`] periods: how long real
//! work takes depends on the host's load, and a simulation must not fail because the host
//! was busy.

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::SimError;
use crate::scheduler::{cpu_time_ns, Inner, Shared};

/// How many periods a baton holder that keeps using CPU time may go without a scheduler call.
pub(crate) const BUSY_PERIODS: u32 = 30;

/// CPU time a holder must use in a tick to count as working, ns (a blocked thread's spurious
/// wake-ups use microseconds).
const BUSY_NS: u64 = 1_000_000;

/// The baton holder and its thread's CPU time, ns.
fn holder_cpu_time(g: &Inner) -> Option<(usize, u64)> {
    let i = g.baton?;
    let t = cpu_time_ns(g.cpus.get(i)?.cpu_clock?)?;
    Some((i, t))
}

#[derive(Debug, Default)]
pub(crate) struct Watchdog {
    stop: Mutex<bool>,
    cv: Condvar,
}

impl Watchdog {
    /// Starts watching `shared` (`None` if the thread could not be spawned: the simulation
    /// then runs unwatched).
    pub(crate) fn spawn(
        shared: &Arc<Shared>,
        period: Duration,
    ) -> Option<(Arc<Watchdog>, JoinHandle<()>)> {
        let w = Arc::new(Watchdog::default());
        let weak = Arc::downgrade(shared);
        let w2 = Arc::clone(&w);
        std::thread::Builder::new()
            .name("slat-vt-watchdog".into())
            .spawn(move || w2.run(&weak, period))
            .ok()
            .map(|h| (w, h))
    }

    pub(crate) fn stop(&self) {
        *self.stop.lock() = true;
        self.cv.notify_all();
    }

    fn run(&self, weak: &Weak<Shared>, period: Duration) {
        let tick = (period / 4).max(Duration::from_millis(10));
        let mut last_calls = u64::MAX;
        let mut since = Instant::now();
        // The last scheduler call or idle moment (`since`: or tick in which the holder worked).
        let mut since_call = Instant::now();
        let mut last_cpu = None;
        loop {
            {
                let mut stop = self.stop.lock();
                if !*stop {
                    self.cv.wait_for(&mut stop, tick);
                }
                if *stop {
                    return;
                }
            }
            let Some(s) = weak.upgrade() else { return };
            let mut g = s.inner.lock();
            if g.failed.is_some() {
                return;
            }
            // Idle (nobody holds the baton: all wait outside or have exited) or progressing.
            if g.baton.is_none() || g.holding_outside || g.calls != last_calls {
                last_calls = g.calls;
                since = Instant::now();
                since_call = since;
                last_cpu = holder_cpu_time(&g);
                continue;
            }
            let cpu = holder_cpu_time(&g);
            let working = matches!((last_cpu, cpu), (Some((a, t0)), Some((b, t1)))
                if a == b && t1.saturating_sub(t0) >= BUSY_NS);
            last_cpu = cpu;
            if working && since_call.elapsed() < period.saturating_mul(BUSY_PERIODS) {
                since = Instant::now();
                continue;
            }
            if since.elapsed() >= period {
                let report = g.report();
                let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
                let u = g.fail(SimError::Watchdog { ms, report });
                drop(g);
                u.run();
                return;
            }
        }
    }
}
