//! The floor of a reset: the same page writes between two warm host buffers, timed as the
//! reset times its own copy.
//!
//! Why the earlier floor was not one: it copied between buffers the rest of the iteration had
//! pushed out of the cache, while the reset writes pages the guest wrote a moment before (in
//! the cache, mapped, their TLB entries warm). A copy into cold lines pays a read for
//! ownership from memory per line, so at k = 4096 the "floor" ran slower than the reset it
//! bounded. Here each copy's destination pages are written first, as the guest's pass writes
//! them (one word per page), and both buffers are faulted in before any copy and page-aligned
//! (a heap buffer's pages start 16 bytes past a page boundary, so each "page" copy spans two
//! pages, unaligned for the copy's fast-string path); the copy is one
//! `memcpy` per page (a reset's per-page copy) and one zeroing per page the snapshot holds as
//! zero (a reset's zeroing).

use slat_addr::PAGE_SIZE;
use slat_workload::TestMachine;
use std::time::Duration;

const PS: usize = PAGE_SIZE as usize;

/// Two buffers of as many pages as a reset writes, each page-aligned as guest pages are.
pub(super) struct Floor {
    src: Aligned,
    dst: Aligned,
}

/// `pages` 4 KiB pages at a page boundary inside a `Vec` one page longer.
struct Aligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize, fill: u8) -> Result<Self, String> {
        let total = len
            .checked_add(PS)
            .ok_or("the floor's buffers do not fit this host's address space")?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(total)
            .map_err(|_| format!("cannot allocate the floor's {total} bytes"))?;
        // Non-zero, so no page is the shared zero page: every page is faulted in.
        buf.resize(total, fill);
        let start = buf.as_ptr().align_offset(PS).min(PS);
        Ok(Aligned { buf, start, len })
    }

    fn get(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl Floor {
    /// Buffers of `pages` pages (at least one), both written once so they are faulted in.
    pub(super) fn new(pages: u64) -> Result<Self, String> {
        let n = usize::try_from(pages.max(1))
            .ok()
            .and_then(|p| p.checked_mul(PS))
            .ok_or("the floor's buffers do not fit this host's address space")?;
        Ok(Floor {
            src: Aligned::new(n, 0xa5)?,
            dst: Aligned::new(n, 0x5a)?,
        })
    }

    /// Writes `copied` pages from the source and zeroes `zeroed` more (at most the buffers'
    /// pages in all), after writing a word to each as the guest did; only the copy is timed,
    /// on `m`'s clock (the host's; in virtual time the host CPU's, charged as a reset's page
    /// copies and zeroings are).
    pub(super) fn copy<M: TestMachine>(&mut self, m: &M, copied: u64, zeroed: u64) -> Duration {
        let pages = self.dst.len / PS;
        let copied = (copied as usize).min(pages);
        let zeroed = (zeroed as usize).min(pages - copied);
        let (src, dst) = (self.src.get(), self.dst.get_mut());
        for page in dst.chunks_exact_mut(PS).take(copied + zeroed) {
            page[..8].copy_from_slice(&slat_workload::MEMSTRESS_PATTERN.to_ne_bytes());
        }
        std::hint::black_box(&mut *dst);
        let t = m.now_ns();
        let (head, tail) = dst.split_at_mut(copied * PS);
        for (d, s) in head.chunks_exact_mut(PS).zip(src.chunks_exact(PS)) {
            d.copy_from_slice(s);
        }
        for d in tail.chunks_exact_mut(PS).take(zeroed) {
            d.fill(0);
        }
        std::hint::black_box(&mut *dst);
        m.charge_host_pages(copied as u64, zeroed as u64);
        Duration::from_nanos(m.now_ns().saturating_sub(t))
    }
}
