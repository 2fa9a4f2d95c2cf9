//! Blocks freed while a simulation runs, for the contention models to forget.
//!
//! The line and lock models key their state by address. A block freed and allocated again at
//! the same address inherited the freed block's history (lines still cached, their owners, a
//! lock's recent busy periods), while a block the allocator put elsewhere started cold. Which
//! addresses come back depends on the heap: on the malloc arena a thread got, which the real
//! order of the threads' first allocations decides, and on what earlier work in the process
//! freed. So one simulation priced an access as a hit in one process and as a DRAM miss in
//! another: the churn oracle's replay of a seed differed in 10 of 12 pairs of fresh
//! processes. Forgetting a block's state when it is freed makes a reused address look like a
//! fresh one, so the models see objects, not where the allocator put them.
//!
//! [`LineAligned`](crate::LineAligned)'s `dealloc` records each block freed while a
//! simulation exists in a fixed buffer of the freeing thread: the allocator cannot take the
//! scheduler's lock, under which the models themselves allocate. The thread hands the blocks
//! to its simulation at its next hook (`Shared::enter`), before any other CPU runs and can
//! reuse the memory. A thread that frees more blocks between two hooks than the buffer holds
//! makes the models forget every idle line and lock instead, which is as deterministic.

use std::cell::RefCell;

/// Blocks a thread can free between two hooks before the models forget everything.
const CAP: usize = 256;

struct Freed {
    blocks: [(usize, usize); CAP],
    len: usize,
    overflowed: bool,
}

thread_local! {
    static FREED: RefCell<Freed> = const {
        RefCell::new(Freed {
            blocks: [(0, 0); CAP],
            len: 0,
            overflowed: false,
        })
    };
}

/// Records that `[addr, addr + size)` was freed by this thread. Never allocates; a thread
/// being torn down (its buffer gone) records nothing, and has no hook left either.
#[inline]
pub(crate) fn record(addr: usize, size: usize) {
    let _ = FREED.try_with(|f| {
        if let Ok(mut f) = f.try_borrow_mut() {
            match f.len {
                n if n < CAP => {
                    f.blocks[n] = (addr, size);
                    f.len = n + 1;
                }
                _ => f.overflowed = true,
            }
        }
    });
}

/// What this thread freed since the last call: each block to `forget`, or, if there were
/// more than the buffer holds, `Err(())` (forget everything idle).
pub(crate) fn take(mut forget: impl FnMut(usize, usize)) -> Result<(), ()> {
    FREED
        .try_with(|f| {
            let Ok(mut f) = f.try_borrow_mut() else {
                return Ok(());
            };
            let n = f.len;
            f.len = 0;
            if std::mem::take(&mut f.overflowed) {
                return Err(());
            }
            for &(addr, size) in &f.blocks[..n] {
                forget(addr, size);
            }
            Ok(())
        })
        .unwrap_or(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_over_once_and_an_overflow_says_so() {
        let _ = take(|_, _| {});
        record(0x1000, 64);
        record(0x2000, 128);
        let mut got = Vec::new();
        assert_eq!(take(|a, s| got.push((a, s))), Ok(()));
        assert_eq!(got, vec![(0x1000, 64), (0x2000, 128)]);
        assert_eq!(take(|_, _| panic!("handed over twice")), Ok(()));
        for i in 0..=CAP {
            record(i * 64, 64);
        }
        assert_eq!(take(|_, _| {}), Err(()));
        assert_eq!(take(|_, _| panic!("nothing left")), Ok(()));
    }
}
