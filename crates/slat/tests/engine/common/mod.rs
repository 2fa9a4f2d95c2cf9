//! Helpers shared by the integration tests: host memory for memslots, a seeded PRNG, leak
//! checks, and small accessors for what the engine exposes about a leaf.
//!
//! Every test binary includes this module (`#[macro_use] mod common;`) and uses a different
//! part of it; [`both_formats!`] runs each test on every page-table format.
#![allow(dead_code)]

use slat::hw::pages_per_entry;
use slat::hw::TableAlloc;
use slat::{Access, Ept, Fault, FaultOutcome, HostRange, Level, PteFormat, Vcpu, Vm};
use slat_addr::{Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use std::alloc::Layout;
use std::any::TypeId;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 2 MiB, the alignment of every [`HostMem`] so 2 MiB leaves can map it.
pub const HUGE_2M: u64 = 2 << 20;
/// 1 GiB.
pub const HUGE_1G: u64 = 1 << 30;

/// Zeroed, 2 MiB-aligned host memory backing a memslot; freed when the last of this handle
/// and the memslots over it is dropped.
///
/// The engine never dereferences guest memory on EPT, but the tests that pretend the host maps
/// a range with 2 MiB pages still give it real, suitably aligned memory, so the addresses in
/// leaves are addresses the test owns.
#[derive(Clone)]
pub struct HostMem(Arc<Block>);

/// The allocation behind a [`HostMem`].
pub struct Block {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: Block uniquely owns its allocation, like a Box<[u8]>; its bytes are only reached
// through raw pointers and atomics.
unsafe impl Send for Block {}
// SAFETY: as above; `&Block` exposes only the address and length.
unsafe impl Sync for Block {}

// SAFETY: the allocation is live, 4 KiB aligned (at least) and a 4 KiB multiple long until
// the last `Arc<Block>` drops; no references to its bytes are handed out.
unsafe impl slat::HostMemory for Block {
    fn host_addr(&self) -> Hva {
        Hva::from_ptr(self.ptr)
    }
    fn len(&self) -> u64 {
        self.layout.size() as u64
    }
}

impl HostMem {
    /// `len` bytes (rounded up to 4 KiB), 2 MiB aligned.
    pub fn new(len: u64) -> Self {
        Self::with_align(len, HUGE_2M)
    }

    /// `len` bytes (rounded up to 4 KiB) aligned to `align` (a power of two >= 4 KiB).
    pub fn with_align(len: u64, align: u64) -> Self {
        Self::alloc(len, align, true)
    }

    /// `len` bytes (rounded up to 4 KiB) of address space aligned to `align`, *not* zeroed and
    /// never read or written by the tests: for big slots whose pages only need to be real host
    /// addresses (1 GiB host pages, whole GiBs of "memory"). Untouched, they cost only address
    /// space. Formats with cache maintenance (stage-2) do touch them: a fault cleans the data
    /// cache over the range it maps.
    pub fn reserve(len: u64, align: u64) -> Self {
        Self::alloc(len, align, false)
    }

    fn alloc(len: u64, align: u64, zeroed: bool) -> Self {
        assert!(align.is_power_of_two() && align >= PAGE_SIZE);
        let len = len.max(PAGE_SIZE).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let layout = Layout::from_size_align(len as usize, align as usize).expect("host layout");
        // SAFETY: the layout has a non-zero size. Uninitialised memory (`reserve`) is never
        // read through Rust references: the engine only flushes its cache lines.
        let ptr = unsafe {
            if zeroed {
                std::alloc::alloc_zeroed(layout)
            } else {
                std::alloc::alloc(layout)
            }
        };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        HostMem(Arc::new(Block { ptr, layout }))
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.0.ptr as u64
    }

    /// Bytes allocated.
    pub fn len(&self) -> u64 {
        self.0.layout.size() as u64
    }

    /// The whole allocation as a memslot host range mapped with `page_size` pages.
    pub fn range(&self, page_size: u64) -> HostRange {
        HostRange::new(self.0.clone())
            .expect("whole allocation")
            .with_page_size(page_size)
    }

    /// `[offset, offset + len)` of the allocation as a host range.
    pub fn sub_range(&self, offset: u64, len: u64, page_size: u64) -> HostRange {
        HostRange::slice(self.0.clone(), offset, len)
            .expect("sub-range inside the allocation")
            .with_page_size(page_size)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostMem::alloc` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// A host range at an arbitrary address, not mapped in this process: for memslots that are
/// refused, or whose pages are never touched. Only EPT VMs may fault such a slot in (the
/// engine stores EPT leaves' addresses without touching them; stage-2 cleans the cache over a
/// new mapping): use [`HostMem::reserve`] for slots that are faulted in on every format.
pub fn fake_host(addr: u64, len: u64, page_size: u64) -> HostRange {
    // SAFETY: the tests that use this either have the slot refused (never touched) or fault
    // it in on EPT without any vCPU hardware, where nothing dereferences the addresses.
    unsafe { HostRange::from_raw(Hva::new(addr), len, page_size) }
}

/// xorshift64*: small, fast, good enough to drive randomised tests reproducibly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        // Mix the seed (splitmix64 finaliser) so neighbouring seeds diverge at once; never 0.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        Rng(if z == 0 { 0x2545_f491_4f6c_dd1d } else { z })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[0, n)` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// A random element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
}

/// The seed from `SLAT_TEST_SEED` (decimal or `0x` hex), else `default`.
pub fn seed_from_env(default: u64) -> u64 {
    match std::env::var("SLAT_TEST_SEED") {
        Ok(s) => {
            let s = s.trim();
            let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(h) => u64::from_str_radix(h, 16),
                None => s.parse(),
            };
            v.unwrap_or_else(|_| panic!("SLAT_TEST_SEED={s:?} is not a number"))
        }
        Err(_) => default,
    }
}

/// Waits until `alloc` has exactly `expect_live` live pages: deferred frees run through the
/// global epoch collector, which advances only when threads pin and flush, so this drives it.
/// Panics (a leak, or an accounting bug if the count drops below) after ~2 s.
pub fn wait_for_reclaim(alloc: &TableAlloc, expect_live: u64) {
    // Generous: reclamation needs every pinned thread of the test binary to move on, which on
    // a loaded 2-core host took over 2 s; a real leak stays forever, so the length costs
    // nothing but the time to report one.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let live = alloc.live_pages();
        if live == expect_live {
            return;
        }
        assert!(
            live > expect_live,
            "table pages freed twice? live {live} < expected {expect_live}"
        );
        if Instant::now() > deadline {
            panic!(
                "table pages leaked: {live} live, expected {expect_live} ({} ever allocated)",
                alloc.allocated_pages()
            );
        }
        // Each flush moves this thread's deferred frees to the global queue and tries to
        // advance the epoch and collect; other test threads may be pinned for a moment.
        for _ in 0..4 {
            crossbeam_epoch::pin().flush();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Destroys the vCPUs, drops the VM and asserts every table page it ever allocated is freed.
pub fn teardown<F: PteFormat>(vm: Arc<Vm<F>>, vcpus: impl IntoIterator<Item = Vcpu<F>>) {
    let alloc = slat::hw::table_alloc(&vm).clone();
    for v in vcpus {
        drop(v);
    }
    assert_eq!(
        Arc::strong_count(&vm),
        1,
        "test bug: someone still holds the VM"
    );
    drop(vm);
    wait_for_reclaim(&alloc, 0);
}

/// The host address `gfn` translates to through `leaf` at `level`.
pub fn leaf_hva<F: PteFormat>(leaf: u64, level: Level, gfn: u64) -> u64 {
    F::output_addr(leaf).raw() + ((gfn & (pages_per_entry(level) - 1)) << PAGE_SHIFT)
}

/// Checks the audit of the tree against the statistics; returns the audit.
pub fn check_audit<F: PteFormat>(vm: &Vm<F>, ctx: &str) -> slat::Audit {
    let a = vm.audit();
    let s = vm.stats();
    assert_eq!(a.frozen, 0, "{ctx}: frozen entries left in the tree: {a:?}");
    assert_eq!(
        [s.leaves_4k, s.leaves_2m, s.leaves_1g],
        a.leaves,
        "{ctx}: leaf gauges disagree with the tree (stats {s:?}, audit {a:?})"
    );
    assert_eq!(
        s.table_pages, a.tables,
        "{ctx}: table gauge disagrees with the tree (stats {s:?}, audit {a:?})"
    );
    assert_eq!(
        s.table_bytes,
        a.tables * PAGE_SIZE,
        "{ctx}: table_bytes is not table_pages * 4 KiB"
    );
    assert!(
        s.table_pages_live >= s.table_pages,
        "{ctx}: fewer live pages ({}) than linked tables ({})",
        s.table_pages_live,
        s.table_pages
    );
    if !F::BREAK_BEFORE_MAKE {
        assert_eq!(s.bbm_breaks, 0, "{ctx}: break-before-make on {}", F::NAME);
    }
    if !F::CACHE_MAINTENANCE {
        assert_eq!(
            (s.cache_cleans, s.cache_clean_bytes),
            (0, 0),
            "{ctx}: cache maintenance on {}",
            F::NAME
        );
    }
    a
}

/// Invariant 6 on one leaf: W ⇒ MMU-writable ⇒ host-writable.
pub fn check_write_chain<F: PteFormat>(leaf: u64, ctx: &str) {
    if F::is_writable(leaf) {
        assert!(
            F::is_mmu_writable(leaf),
            "{ctx}: W without MMU-writable: {leaf:#x}"
        );
    }
    if F::is_mmu_writable(leaf) {
        assert!(
            F::is_host_writable(leaf),
            "{ctx}: MMU-writable without host-writable: {leaf:#x}"
        );
    }
}

/// The gfns set in a dirty bitmap harvested from a slot starting at `base_gfn`.
pub fn bitmap_gfns(base_gfn: u64, words: &[u64]) -> Vec<u64> {
    let mut v = Vec::new();
    for (i, &w) in words.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let b = w.trailing_zeros() as u64;
            v.push(base_gfn + 64 * i as u64 + b);
            w &= w - 1;
        }
    }
    v
}

/// Words a dirty bitmap for `npages` pages needs.
pub fn bitmap_words(npages: u64) -> usize {
    npages.div_ceil(64) as usize
}

/// Resolves one fault on `vcpu` as `Vm::handle_fault` does.
pub fn fault<F: PteFormat>(
    vm: &Vm<F>,
    vcpu: &mut Vcpu<F>,
    gpa: u64,
    access: Access,
    present: bool,
) -> FaultOutcome {
    assert!(
        std::ptr::eq(&**vcpu.vm(), vm),
        "test bug: vCPU of another VM"
    );
    vcpu.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(gpa),
        access,
        present,
    })
}

/// `F` is x86 EPT (whatever its clock). For the few expectations that differ by format for reasons the format
/// constants do not name (each use says why).
pub fn is_ept<F: PteFormat>() -> bool {
    TypeId::of::<F::Inner>() == TypeId::of::<Ept>()
}

include!("formats.rs");
