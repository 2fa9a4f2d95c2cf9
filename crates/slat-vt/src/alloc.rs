//! [`LineAligned`]: the global allocator that keeps the cache-line model deterministic.
//!
//! The line model (`model::line`) keys lines by `addr >> 6`, so which hooked words share a
//! line depends on where the allocator put their objects. `malloc` aligns to 16 bytes only,
//! and where an object lands modulo 64 depends on the heap's history: a second run in the same
//! process (`--repeat`, `slat reproduce`) found its `TableAlloc` counters, lock words and
//! gates on other line boundaries, and different line transfers changed its spurious faults.
//! While a [`Sim`](crate::Sim) exists, this allocator starts every allocation on a line of
//! its own, so the lines of an object are fixed by its own field offsets and no two objects
//! share one, whatever ran before. Without a simulation it is the system allocator, at the
//! cost of one relaxed load per call.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The line model's line size.
const LINE: usize = 64;

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

impl LineAligned {
    /// The alignment to allocate `layout` with now; `None`: plain `malloc` will do.
    #[inline]
    fn align_for(layout: Layout) -> Option<usize> {
        let want = if SIMS.load(Ordering::Relaxed) != 0 {
            layout.align().max(LINE)
        } else {
            layout.align()
        };
        if want <= MALLOC_ALIGN && want <= layout.size() {
            None
        } else {
            Some(want.max(std::mem::size_of::<usize>()))
        }
    }
}

/// `posix_memalign` of `size` bytes at `align` (a power of two, at least a pointer's size).
fn aligned(align: usize, size: usize) -> *mut u8 {
    let mut out = std::ptr::null_mut();
    // SAFETY: `align` is a power of two (a `Layout`'s, or `LINE`) and a multiple of the
    // pointer size (`align_for` raises it to at least that); `out` is a valid place to write.
    let rc = unsafe { libc::posix_memalign(&mut out, align, size) };
    if rc == 0 {
        out.cast()
    } else {
        std::ptr::null_mut()
    }
}

// SAFETY: every block comes from `malloc`, `calloc`, `realloc` or `posix_memalign`, each
// aligned to at least the layout's alignment (`align_for`), and goes back through `free` or
// `realloc`, which accept any of them. `realloc` keeps the old block's first
// `min(old, new)` bytes, as `GlobalAlloc::realloc` requires.
unsafe impl GlobalAlloc for LineAligned {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match Self::align_for(layout) {
            // SAFETY: `malloc` may be called with any size.
            None => unsafe { libc::malloc(layout.size()).cast() },
            Some(a) => aligned(a, layout.size()),
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match Self::align_for(layout) {
            // SAFETY: `calloc` may be called with any count and size.
            None => unsafe { libc::calloc(layout.size(), 1).cast() },
            Some(a) => {
                let p = aligned(a, layout.size());
                if !p.is_null() {
                    // SAFETY: `p` is a fresh block of `layout.size()` writable bytes.
                    unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                }
                p
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller passes a block this allocator returned; all come from the
        // `malloc` family.
        unsafe { libc::free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `layout.align()` and a non-zero `new_size` that does
        // not overflow when rounded up to it, so this layout is valid.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if Self::align_for(new).is_none() {
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
                libc::free(ptr.cast());
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
