//! The guest of KVM's `kvm_page_table_test`: every vCPU walks the *same* region in three
//! stages, so concurrent faults on one address (and on one block) are the norm, which is what
//! that test measures (and what KVM arm64's stage-2 page-table efficiency series measured with
//! it).
//!
//! - `KVM_CREATE_MAPPINGS`: touch the first 8 bytes of every large page (backing page size), so
//!   the MMU creates one mapping per large page: 4 KiB pages on small backings, blocks on huge
//!   ones. vCPUs with an even index write, odd ones read.
//! - `KVM_UPDATE_MAPPINGS` (dirty logging on): on a 4 KiB backing, write every page
//!   (read-only → read-write updates); on a huge backing, per large page write its first page
//!   (the write fault splits the block) and read every page of its second half (new 4 KiB
//!   mappings in the split block).
//! - `KVM_ADJUST_MAPPINGS` (dirty logging off): read every page; faults on what the update
//!   left unmapped rebuild blocks.
//!
//! [`StageAccesses`] is the access sequence; the guest runs it through a vCPU and the native
//! baseline straight on host memory, so both do the same work.

use crate::cpu::{Cpu, Exit};
use crate::machine::MachineError;
use crate::memstress::MEMSTRESS_PATTERN;
use slat::PteFormat;
use slat_addr::{Hva, PAGE_SIZE};
use slat_workload::{Gate, ThreadBarrier};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A stage of the test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Touch every large page.
    CreateMappings,
    /// Logging on: writes (permission updates, block splits) and reads of new pages.
    UpdateMappings,
    /// Logging off: read every page.
    AdjustMappings,
}

impl Stage {
    /// The selftest's name for the stage.
    pub fn name(self) -> &'static str {
        match self {
            Stage::CreateMappings => "KVM_CREATE_MAPPINGS",
            Stage::UpdateMappings => "KVM_UPDATE_MAPPINGS",
            Stage::AdjustMappings => "KVM_ADJUST_MAPPINGS",
        }
    }

    /// The three stages in order.
    pub const ALL: [Stage; 3] = [
        Stage::CreateMappings,
        Stage::UpdateMappings,
        Stage::AdjustMappings,
    ];
}

/// One stage's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageParams {
    /// The stage.
    pub stage: Stage,
    /// Large-page size: the backing's page size (4 KiB for anonymous memory).
    pub large_page: u64,
    /// Bytes of the test region, from its start (a multiple of `large_page`; the machine's
    /// region may be a little larger when it is split evenly between vCPUs).
    pub bytes: u64,
}

/// The byte offsets one vCPU touches in a stage, in order, and whether each is a write.
#[derive(Debug, Clone)]
pub struct StageAccesses {
    p: StageParams,
    bytes: u64,
    writer: bool,
    /// Current large page and the access within it.
    large: u64,
    step: u64,
}

impl StageAccesses {
    /// The accesses of vCPU `vcpu_idx`.
    pub fn new(p: StageParams, vcpu_idx: u32) -> Self {
        debug_assert!(p.large_page >= PAGE_SIZE && p.bytes % p.large_page == 0);
        StageAccesses {
            p,
            bytes: p.bytes,
            writer: vcpu_idx % 2 == 0,
            large: 0,
            step: 0,
        }
    }

    /// Accesses per large page in this stage.
    fn per_large(&self) -> u64 {
        let pages = self.p.large_page / PAGE_SIZE;
        match self.p.stage {
            Stage::CreateMappings => 1,
            Stage::UpdateMappings if pages == 1 => 1,
            // The first page, then the second half's pages.
            Stage::UpdateMappings => 1 + pages / 2,
            Stage::AdjustMappings => pages,
        }
    }
}

impl Iterator for StageAccesses {
    type Item = (u64, bool);

    fn next(&mut self) -> Option<(u64, bool)> {
        let base = self.large * self.p.large_page;
        if base >= self.bytes {
            return None;
        }
        let (off, write) = match self.p.stage {
            Stage::CreateMappings => (0, self.writer),
            Stage::UpdateMappings if self.step == 0 => (0, true),
            Stage::UpdateMappings => (self.p.large_page / 2 + (self.step - 1) * PAGE_SIZE, false),
            Stage::AdjustMappings => (self.step * PAGE_SIZE, false),
        };
        self.step += 1;
        if self.step == self.per_large() {
            self.step = 0;
            self.large += 1;
        }
        Some((base + off, write))
    }
}

/// Runs a stage on a vCPU over `[gpa, gpa + p.bytes)`; returns the accesses made.
pub fn guest_stage<F: PteFormat>(
    cpu: &mut Cpu<F>,
    gpa: u64,
    p: StageParams,
    vcpu_idx: u32,
) -> Result<u64, Exit> {
    let mut n = 0;
    for (off, write) in StageAccesses::new(p, vcpu_idx) {
        if write {
            cpu.write_u64(gpa + off, MEMSTRESS_PATTERN)?;
        } else {
            std::hint::black_box(cpu.read_u64(gpa + off)?);
        }
        n += 1;
    }
    Ok(n)
}

/// The same stage straight on host memory at `host` (the native baseline).
///
/// # Safety
///
/// `[host, host + p.bytes)` must be mapped readable and writable for the whole call, `host`
/// 8-byte aligned, and no `&`/`&mut` references to those bytes may exist meanwhile; or, with
/// `pool`, the range is phantom memory whose pool at `pool` is so.
unsafe fn native_stage(host: u64, pool: Option<u64>, p: StageParams, vcpu_idx: u32) -> u64 {
    let mut n = 0;
    for (off, write) in StageAccesses::new(p, vcpu_idx) {
        if off % 8 != 0 || off.saturating_add(8) > p.bytes {
            break; // never happens: the stage's offsets are aligned and inside `p.bytes`
        }
        let addr = match pool {
            Some(pool) => slat::phantom_addr(Hva::new(pool), Hva::new(host + off)).raw(),
            None => host + off,
        };
        // SAFETY: `off + 8 <= p.bytes` and `off` is 8-byte aligned (checked above), so the word
        // is inside the range the caller vouched for, or in its phantom pool. Atomic because
        // every thread touches the same region.
        let a = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        if write {
            a.store(MEMSTRESS_PATTERN, Ordering::Relaxed);
        } else {
            std::hint::black_box(a.load(Ordering::Relaxed));
        }
        n += 1;
    }
    n
}

/// The native baseline of a stage: `vcpus` threads each run the stage over the same
/// `p.bytes` at the start of `ram`, released together; returns the time until the last one
/// finished. [`MachineError::Config`] if `ram` is smaller than `p.bytes`;
/// [`MachineError::Thread`] if a thread could not be started (those already started are
/// released without running the stage and joined).
pub fn native_stage_baseline(
    ram: &slat_workload::GuestRam,
    p: StageParams,
    vcpus: usize,
) -> Result<Duration, MachineError> {
    if p.bytes > ram.len() {
        return Err(MachineError::Config(format!(
            "the native baseline's memory ({} bytes) is smaller than the test region ({} bytes)",
            ram.len(),
            p.bytes
        )));
    }
    let host = ram.addr();
    let pool = ram.phantom_pool();
    // Abandonable: a thread that cannot start leaves the others waiting for a party that
    // never comes.
    let start = ThreadBarrier::new(vcpus + 1);
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(vcpus);
        for i in 0..vcpus {
            let start = &start;
            let t = std::thread::Builder::new()
                .name(format!("native{i}"))
                .spawn_scoped(s, move || {
                    if !start.wait() {
                        return None;
                    }
                    let t0 = Instant::now();
                    // SAFETY: `p.bytes <= ram.len()` (checked above) and `ram` (with its
                    // phantom pool) is borrowed, so mapped, until the scope's threads are
                    // joined; `GuestRam` hands out no references to its bytes.
                    unsafe { native_stage(host, pool, p, i as u32) };
                    Some((t0, Instant::now()))
                });
            match t {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Joined here rather than by the scope, which only waits for them to
                    // finish: gone when this returns.
                    start.abandon();
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(MachineError::Thread(e));
                }
            }
        }
        start.wait();
        // Each thread times itself: the host thread is a third on two cores, so a clock it
        // read after the barrier could start when the stage was already over (3 µs stages
        // were reported at `-v 2` with both vCPU threads pinned).
        let spans: Vec<_> = handles
            .into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect();
        let first = spans.iter().map(|s| s.0).min();
        let last = spans.iter().map(|s| s.1).max();
        Ok(match (first, last) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn collect(stage: Stage, large: u64, bytes: u64, idx: u32) -> Vec<(u64, bool)> {
        StageAccesses::new(
            StageParams {
                stage,
                large_page: large,
                bytes,
            },
            idx,
        )
        .collect()
    }

    #[test]
    fn create_touches_each_large_page_once_even_vcpus_write() {
        let a = collect(Stage::CreateMappings, 2 * MIB, 8 * MIB, 0);
        assert_eq!(a, (0..4).map(|j| (j * 2 * MIB, true)).collect::<Vec<_>>());
        assert!(collect(Stage::CreateMappings, PAGE_SIZE, 4 * PAGE_SIZE, 1)
            .iter()
            .all(|&(_, w)| !w));
    }

    #[test]
    fn update_on_small_pages_writes_every_page() {
        let a = collect(Stage::UpdateMappings, PAGE_SIZE, 3 * PAGE_SIZE, 1);
        assert_eq!(a, vec![(0, true), (4096, true), (8192, true)]);
    }

    #[test]
    fn update_on_blocks_writes_the_first_page_and_reads_the_second_half() {
        let a = collect(Stage::UpdateMappings, 2 * MIB, 4 * MIB, 1);
        assert_eq!(a.len(), 2 * (1 + 256));
        assert_eq!(a[0], (0, true));
        assert_eq!(a[1], (MIB, false));
        assert_eq!(a[256], (2 * MIB - PAGE_SIZE, false));
        assert_eq!(a[257], (2 * MIB, true));
        assert_eq!(a[258], (3 * MIB, false));
    }

    #[test]
    fn adjust_reads_every_page() {
        let a = collect(Stage::AdjustMappings, 2 * MIB, 2 * MIB, 0);
        assert_eq!(a.len(), 512);
        assert!(a
            .iter()
            .enumerate()
            .all(|(i, &(o, w))| o == i as u64 * PAGE_SIZE && !w));
    }
}
