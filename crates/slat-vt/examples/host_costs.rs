//! Rough costs of this host for the built-in profile (`Profile::host_default`): an
//! uncontended compare-and-swap, a cache-line transfer between two threads, zeroing a 4 KiB
//! page, and a thread wake-up (park/unpark), the `barging` hand-off's main part.
//!
//! `cargo run --release -p slat-vt --example host_costs`. Not a calibration (`slat calibrate`
//! is): threads are not pinned, and on a loaded VM the numbers move.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn ns_per(iters: u64, f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_nanos() as f64 / iters as f64
}

fn cas_local() -> f64 {
    let x = AtomicU64::new(0);
    let n = 20_000_000;
    ns_per(n, || {
        for i in 0..n {
            let _ = black_box(&x).compare_exchange(i, i + 1, Ordering::AcqRel, Ordering::Acquire);
        }
    })
}

/// Two threads take turns incrementing one counter: each turn moves the line once.
fn line_transfer() -> f64 {
    let x = Arc::new(AtomicU64::new(0));
    let n = 1_000_000u64;
    let y = Arc::clone(&x);
    let other = std::thread::spawn(move || {
        for i in 0..n {
            while y.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            y.store(2 * i + 2, Ordering::Release);
        }
    });
    let per = ns_per(2 * n, || {
        for i in 0..n {
            while x.load(Ordering::Acquire) != 2 * i {
                std::hint::spin_loop();
            }
            x.store(2 * i + 1, Ordering::Release);
        }
        while x.load(Ordering::Acquire) != 2 * n {
            std::hint::spin_loop();
        }
    });
    let _ = other.join();
    per
}

fn zero_page() -> f64 {
    let mut pages = vec![[0u8; 4096]; 64];
    let n = 200_000u64;
    ns_per(n, || {
        for i in 0..n {
            let p = &mut pages[(i % 64) as usize];
            // SAFETY: `p` is a valid, exclusively borrowed 4096-byte array.
            unsafe { std::ptr::write_bytes(p.as_mut_ptr(), 0, 4096) };
            black_box(&p);
        }
    })
}

/// One thread wakes another and parks until woken back: half a round trip is a wake-up.
fn park_round_trip() -> f64 {
    let n = 50_000u64;
    let turn = Arc::new(AtomicU64::new(0));
    let main = std::thread::current();
    let t2 = Arc::clone(&turn);
    let other = std::thread::spawn(move || {
        for i in 0..n {
            while t2.load(Ordering::Acquire) != 2 * i + 1 {
                std::thread::park();
            }
            t2.store(2 * i + 2, Ordering::Release);
            main.unpark();
        }
    });
    let worker = other.thread().clone();
    let per = ns_per(n, || {
        for i in 0..n {
            turn.store(2 * i + 1, Ordering::Release);
            worker.unpark();
            while turn.load(Ordering::Acquire) != 2 * i + 2 {
                std::thread::park();
            }
        }
    });
    let _ = other.join();
    per
}

fn main() {
    println!("cas_local_ns        {:8.1}", cas_local());
    println!("line_transfer_ns    {:8.1}", line_transfer());
    println!("zero_page_ns        {:8.1}", zero_page());
    println!("park_round_trip_ns  {:8.1}", park_round_trip());
}
