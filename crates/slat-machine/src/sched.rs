//! Physical-CPU tokens: at most `pcpus` vCPU threads execute guest code at once.
//!
//! A remote flush waits for every vCPU in guest mode to acknowledge at an access boundary. If
//! more vCPU threads than host cores were runnable, the kernel would preempt some of them in the
//! middle of guest mode, and every flush would wait for a scheduler time slice until they ran
//! again. Real KVM never has this problem: a preempted vCPU has exited the guest. So, like a
//! hypervisor's own vCPU scheduler, the machine lets a vCPU enter guest mode only while it holds
//! one of `pcpus` tokens, and a vCPU gives its token up (leaving guest mode first) after a
//! quantum when others are waiting. With no more runnable guest threads than cores, the kernel
//! has no reason to preempt one in guest mode, and a flusher that yields its core lets any
//! straggler finish promptly.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The token pool.
pub struct PcpuPool {
    free: Mutex<usize>,
    cv: Condvar,
    waiting: AtomicUsize,
    total: usize,
}

impl PcpuPool {
    /// A pool of `n` tokens (at least 1).
    pub fn new(n: usize) -> PcpuPool {
        let n = n.max(1);
        PcpuPool {
            free: Mutex::new(n),
            cv: Condvar::new(),
            waiting: AtomicUsize::new(0),
            total: n,
        }
    }

    /// Tokens in the pool.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks until a token is free and takes it.
    pub fn acquire(&self) {
        let mut free = self.free.lock();
        if *free == 0 {
            self.waiting.fetch_add(1, Ordering::Relaxed);
            while *free == 0 {
                self.cv.wait(&mut free);
            }
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        *free -= 1;
    }

    /// Returns a token. A release without an acquire gives none: the pool never holds more
    /// than its tokens.
    pub fn release(&self) {
        let mut free = self.free.lock();
        *free = free.saturating_add(1).min(self.total);
        drop(free);
        self.cv.notify_one();
    }

    /// Some vCPU is waiting for a token (the holder should yield at its next quantum end).
    #[inline]
    pub fn contended(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn never_more_holders_than_tokens() {
        let pool = Arc::new(PcpuPool::new(2));
        let inside = Arc::new(AtomicUsize::new(0));
        let max = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let (pool, inside, max) = (pool.clone(), inside.clone(), max.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        pool.acquire();
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        max.fetch_max(n, Ordering::SeqCst);
                        std::hint::spin_loop();
                        inside.fetch_sub(1, Ordering::SeqCst);
                        pool.release();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert!(max.load(Ordering::SeqCst) <= 2);
        assert!(max.load(Ordering::SeqCst) >= 1);
    }
}
