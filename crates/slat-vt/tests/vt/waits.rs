//! The scheduler-aware condition variable and barrier, and waits outside the simulation.

use parking_lot::Mutex;
use slat::clock::{Clock, Cost};
use slat_vt::{Barrier, Condvar, Virtual};

use crate::common::{self, STEP};

#[test]
fn a_barrier_releases_everyone_at_the_last_arrival() {
    let sim = common::sim(common::profile(), 0);
    let barrier = Barrier::new(&sim, 3);
    let after = Mutex::new([0u64; 3]);
    let leaders = Mutex::new(0);
    common::run(&sim, 3, |i| {
        Virtual::charge(Cost::VmExit, 1 + 2 * i as u64);
        if barrier.wait() {
            *leaders.lock() += 1;
        }
        after.lock()[i] = Virtual::now_ns();
    });
    sim.finish().expect("clean run");
    assert_eq!(*after.lock(), [5 * STEP; 3]);
    assert_eq!(*leaders.lock(), 1);
}

#[test]
fn a_condvar_waiter_resumes_at_the_notifier_clock() {
    let sim = common::sim(common::profile(), 0);
    let cv = Condvar::new(&sim);
    let queue = Mutex::new(Vec::<u64>::new());
    let got = Mutex::new(Vec::new());
    common::run(&sim, 2, |i| {
        if i == 0 {
            for _ in 0..3 {
                let mut q = cv.lock(&queue);
                while q.is_empty() {
                    cv.wait(&mut q);
                }
                let item = q.remove(0);
                drop(q);
                got.lock().push((item, Virtual::now_ns()));
            }
        } else {
            for k in 1..=3u64 {
                Virtual::charge(Cost::VmExit, 4);
                cv.lock(&queue).push(k);
                cv.notify_one();
            }
        }
    });
    sim.finish().expect("clean run");
    let got = got.into_inner();
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [1, 2, 3]);
    for (k, t) in got {
        assert!(
            t >= 4 * STEP * k,
            "item {k} consumed at {t} ns, before it was produced"
        );
    }
}

#[test]
fn detach_and_attach_at_move_the_clock() {
    let sim = common::sim(common::profile(), 0);
    let host = sim.register("host").unwrap();
    let worker = sim.register("worker").unwrap();
    host.attach().unwrap();
    let t = std::thread::spawn(move || {
        worker.attach().unwrap();
        Virtual::charge(Cost::VmExit, 2);
        Virtual::fence();
        worker.now_ns()
    });
    host.detach().unwrap();
    let worker_end = t.join().unwrap();
    host.attach_at(50_000).unwrap();
    assert_eq!(host.now_ns(), 50_000);
    assert_eq!(worker_end, 2 * STEP);
    drop(host);
    sim.finish().expect("clean run");
    assert!(host_misuse_is_an_error(&sim));
}

fn host_misuse_is_an_error(sim: &slat_vt::Sim) -> bool {
    let h = sim.register("late").unwrap();
    // Not attached on this thread: detach and attach_at refuse.
    h.detach().is_err() && h.attach_at(0).is_err()
}

#[test]
fn the_current_thread_steps_out_and_back_without_its_handle() {
    let sim = common::sim(common::profile(), 0);
    let host = sim.register("host").unwrap();
    host.attach().unwrap();
    Virtual::charge(Cost::VmExit, 3);
    assert_eq!(slat_vt::simulated_now_ns(), Some(3 * STEP));
    slat_vt::detach_current().unwrap();
    // Outside: not a simulated CPU (and no hook is called here).
    assert_eq!(slat_vt::simulated_now_ns(), None);
    slat_vt::attach_current().unwrap();
    assert_eq!(slat_vt::simulated_now_ns(), Some(3 * STEP));
    drop(host);
    sim.finish().expect("clean run");
    // A thread that runs no CPU: nothing to do, no error.
    assert!(slat_vt::detach_current().is_ok() && slat_vt::attach_current().is_ok());
}

#[test]
fn hold_while_keeps_the_others_still() {
    let sim = slat_vt::Sim::with_watchdog(
        common::profile(),
        0,
        Some(std::time::Duration::from_millis(100)),
    )
    .unwrap();
    let host = sim.register("host").unwrap();
    host.attach().unwrap();
    let ran = std::sync::atomic::AtomicBool::new(false);
    let worker = sim.register("worker").unwrap();
    std::thread::scope(|s| {
        let ran = &ran;
        s.spawn(move || {
            worker.attach().unwrap();
            ran.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        // Longer than the watchdog's period: held on purpose, so no failure.
        slat_vt::hold_while(|| std::thread::sleep(std::time::Duration::from_millis(400)));
        assert!(
            !ran.load(std::sync::atomic::Ordering::SeqCst),
            "nobody ran meanwhile"
        );
        slat_vt::detach_current().unwrap();
    });
    slat_vt::attach_current().unwrap();
    drop(host);
    sim.finish().expect("no watchdog failure");
}
