//! [`LineAligned`]: the global allocator that keeps the cache-line model deterministic.
//!
//! The line model (`model::line`) keys lines by `addr >> 6`, and prices a line that no cache
//! holds by its neighbour: a stream if the line before it in its 4 KiB page is cached, a full
//! miss otherwise. So which hooked words share a line, and which lines count as neighbours,
//! depend on where the allocator put their objects. `malloc` aligns to 16 bytes only, and
//! where an object lands modulo 64 or 4096 depends on the heap's history: a second run in the
//! same process (`--repeat`, `slat reproduce`) found its `TableAlloc` counters, lock words and
//! gates on other line boundaries, or a four-line object across a page boundary that the
//! first run had inside one page, and other line transfers or misses changed its faults.
//! While a [`Sim`](crate::Sim) exists, this allocator places every allocation so that its
//! lines depend on its own field offsets only:
//! - it starts on a line of its own, so no two objects share a line;
//! - one of up to 4 KiB is aligned to its size rounded up to a power of two, so it never
//!   crosses a page; a larger one starts on a page, so it crosses pages at fixed offsets;
//! - one spare line follows it, so the line before an object is never another object's: an
//!   object's first line is a full miss, whatever was allocated next to it.
//!
//! Without a simulation it is the system allocator, at the cost of one relaxed load per call.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The line model's line size.
const LINE: usize = 64;

/// The page the line model's streams stay within.
const PAGE: usize = 4096;

/// What `malloc` guarantees on the 64-bit targets slat builds for (std's `MIN_ALIGN`).
const MALLOC_ALIGN: usize = 16;

/// Simulations alive: while non-zero, allocations are line-aligned.
static SIMS: AtomicUsize = AtomicUsize::new(0);

/// A simulation starts: line-aligned allocations from now on.
pub(crate) fn sim_started() {
    SIMS.fetch_add(1, Ordering::SeqCst);
}

/// A simulation ended.
pub(crate) fn sim_ended() {
    let _ = SIMS.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}

/// The system allocator, with every allocation made while a [`Sim`](crate::Sim) exists
/// aligned to a 64-byte cache line. A binary that runs simulations installs it:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: slat_vt::LineAligned = slat_vt::LineAligned;
/// ```
///
/// Everything is freed with `free`, so memory allocated before, during or after a
/// simulation may be freed at any time.
#[derive(Debug, Clone, Copy, Default)]
pub struct LineAligned;

/// Where to put a block: `malloc` as is, or `posix_memalign` at an alignment with a size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Malloc,
    Aligned {
        align: usize,
        size: usize,
    },
    /// The size cannot be padded without overflowing: allocation fails.
    TooLarge,
}

impl LineAligned {
    /// Where to allocate `layout` now.
    #[inline]
    fn place(layout: Layout) -> Place {
        let min = std::mem::size_of::<usize>();
        if SIMS.load(Ordering::Relaxed) == 0 {
            return if layout.align() <= MALLOC_ALIGN && layout.align() <= layout.size() {
                Place::Malloc
            } else {
                Place::Aligned {
                    align: layout.align().max(min),
                    size: layout.size(),
                }
            };
        }
        // The object's lines, and a spare line after them (see the module's comment).
        let Some(used) = layout.size().checked_next_multiple_of(LINE) else {
            return Place::TooLarge;
        };
        let Some(size) = used.checked_add(LINE) else {
            return Place::TooLarge;
        };
        // `used <= PAGE` here, so its power of two cannot overflow.
        let span = if used <= PAGE {
            used.next_power_of_two()
        } else {
            PAGE
        };
        Place::Aligned {
            align: layout.align().max(span).max(LINE),
            size,
        }
    }
}

/// `posix_memalign` of `size` bytes at `align` (a power of two, at least a pointer's size).
fn aligned(align: usize, size: usize) -> *mut u8 {
    let mut out = std::ptr::null_mut();
    // SAFETY: `align` is a power of two (a `Layout`'s, `LINE`, `PAGE` or a power of two
    // at most `PAGE`) and a multiple of the
    // pointer size (`place` raises it to at least that); `out` is a valid place to write.
    let rc = unsafe { libc::posix_memalign(&mut out, align, size) };
    if rc == 0 {
        out.cast()
    } else {
        std::ptr::null_mut()
    }
}

// SAFETY: every block comes from `malloc`, `calloc`, `realloc` or `posix_memalign`, each
// aligned to at least the layout's alignment and at least its size (`place`), and goes back through `free` or
// `realloc`, which accept any of them. `realloc` keeps the old block's first
// `min(old, new)` bytes, as `GlobalAlloc::realloc` requires.
unsafe impl GlobalAlloc for LineAligned {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match Self::place(layout) {
            // SAFETY: `malloc` may be called with any size.
            Place::Malloc => unsafe { libc::malloc(layout.size()).cast() },
            Place::Aligned { align, size } => aligned(align, size),
            Place::TooLarge => std::ptr::null_mut(),
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match Self::place(layout) {
            // SAFETY: `calloc` may be called with any count and size.
            Place::Malloc => unsafe { libc::calloc(layout.size(), 1).cast() },
            Place::TooLarge => std::ptr::null_mut(),
            Place::Aligned { align, size } => {
                let p = aligned(align, size);
                if !p.is_null() {
                    // SAFETY: `p` is a fresh block of at least `layout.size()` writable bytes.
                    unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                }
                p
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if SIMS.load(Ordering::Relaxed) != 0 {
            crate::freed::record(ptr as usize, layout.size());
        }
        // SAFETY: the caller passes a block this allocator returned; all come from the
        // `malloc` family.
        unsafe { libc::free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `layout.align()` and a non-zero `new_size` that does
        // not overflow when rounded up to it, so this layout is valid.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if Self::place(new) == Place::Malloc {
            // SAFETY: `ptr` came from this allocator (the `malloc` family); `realloc` keeps
            // the malloc alignment, which is all `new` needs.
            return unsafe { libc::realloc(ptr.cast(), new_size).cast() };
        }
        // SAFETY: `new` is a valid non-zero-size layout (above).
        let p = unsafe { self.alloc(new) };
        if !p.is_null() {
            // SAFETY: both blocks hold at least `min(old, new)` bytes and do not overlap
            // (`p` is fresh); the old block is ours to free once copied.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_line_aligned_only_while_a_simulation_exists() {
        let a = LineAligned;
        let l = Layout::from_size_align(24, 8).unwrap();
        sim_started();
        let ps: Vec<*mut u8> = (0..64).map(|_| unsafe { a.alloc(l) }).collect();
        assert!(ps.iter().all(|&p| !p.is_null() && p as usize % LINE == 0));
        let z = unsafe { a.alloc_zeroed(Layout::from_size_align(100, 4).unwrap()) };
        assert_eq!(z as usize % LINE, 0);
        assert!((0..100).all(|i| unsafe { *z.add(i) } == 0));
        let grown = unsafe { a.realloc(ps[0], l, 4000) };
        assert_eq!(grown as usize % LINE, 0);
        sim_ended();
        let plain = unsafe { a.alloc(l) };
        assert!(!plain.is_null() && plain as usize % MALLOC_ALIGN == 0);
        // Blocks from either mode are freed alike.
        unsafe {
            a.dealloc(grown, Layout::from_size_align(4000, 8).unwrap());
            for &p in &ps[1..] {
                a.dealloc(p, l);
            }
            a.dealloc(z, Layout::from_size_align(100, 4).unwrap());
            a.dealloc(plain, l);
        }
    }

    /// The lines of a block of `size` bytes at `p`.
    fn lines(p: *mut u8, size: usize) -> std::ops::Range<usize> {
        let first = p as usize / LINE;
        first..(p as usize + size).div_ceil(LINE)
    }

    #[test]
    fn blocks_stay_in_a_page_and_never_follow_another_block_s_line() {
        let a = LineAligned;
        // Sizes a heap's history would place across a page or next to each other.
        let sizes: Vec<usize> = (0..400)
            .map(|i| 1 + (i * 37) % 300 + (i % 7) * 700)
            .collect();
        sim_started();
        let blocks: Vec<(*mut u8, Layout)> = sizes
            .iter()
            .map(|&n| {
                let l = Layout::from_size_align(n, 8).unwrap();
                (unsafe { a.alloc(l) }, l)
            })
            .collect();
        sim_ended();
        let used: std::collections::HashSet<usize> = blocks
            .iter()
            .flat_map(|&(p, l)| lines(p, l.size()))
            .collect();
        for &(p, l) in &blocks {
            assert!(!p.is_null());
            let r = lines(p, l.size());
            if l.size() <= PAGE {
                // Within one page, so streaming inside it does not depend on where it is.
                assert_eq!(
                    r.start * LINE / PAGE,
                    (r.end - 1) * LINE / PAGE,
                    "{l:?} at {p:?}"
                );
            } else {
                assert_eq!(p as usize % PAGE, 0, "{l:?} at {p:?}");
            }
            // The line before it is no block's: its first line is never streamed.
            assert!(
                !used.contains(&(r.start - 1)),
                "{l:?} at {p:?} follows a block"
            );
        }
        for (p, l) in blocks {
            unsafe { a.dealloc(p, l) };
        }
    }

    #[test]
    fn sizes_that_cannot_be_padded_fail() {
        let a = LineAligned;
        let l = Layout::from_size_align(isize::MAX as usize - 63, 8).unwrap();
        sim_started();
        let p = unsafe { a.alloc(l) };
        sim_ended();
        assert!(p.is_null());
    }

    #[test]
    fn large_alignments_are_kept_in_both_modes() {
        let a = LineAligned;
        let l = Layout::from_size_align(4096, 4096).unwrap();
        let p = unsafe { a.alloc_zeroed(l) };
        assert_eq!(p as usize % 4096, 0);
        let q = unsafe { a.realloc(p, l, 8192) };
        assert_eq!(q as usize % 4096, 0);
        unsafe { a.dealloc(q, Layout::from_size_align(8192, 4096).unwrap()) };
    }
}
