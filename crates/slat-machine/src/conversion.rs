//! The private-memory conversion test (KVM's `private_mem_conversions_test`): each
//! vCPU converts chunks of its own memory between shared and private, over and over, while
//! the others do the same and a host thread reads the private pool through the host direct
//! map; every access is checked against what the rules allow:
//!
//! 1. a shared access reads what was last written through shared accesses (the shared backing
//!    keeps its data while the page is private);
//! 2. a page becoming private reads zero on its first private access (lazy acceptance clears
//!    it), then what was last written privately;
//! 3. an access of the wrong kind exits with a memory fault, never touching the other backing;
//! 4. private writes never reach the shared backing;
//! 5. the host never reads private data through the direct map: an assigned page is not
//!    mapped there, and a page comes back scrubbed. (With `--direct-map none` the direct map
//!    keeps private pages, as TDX's does, so the host *can* read them: not checked, and said.
//!    With `kernel-flush off` a host CPU may read through a stale translation of a page that
//!    just left the direct map: counted as stale reads, the risk that option takes.)

use crate::cpu::{Cpu, Exit};
use crate::machine::MachineError;
use crate::sched::PcpuPool;
use slat::direct_map::{DirectMap, DirectMapConfig, DirectMapStats};
use slat::{DirectMapPolicy, Ept, HostRange, MemoryAttributes, MemslotFlags, Vm, VmConfig};
use slat_addr::{Gfn, Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use slat_workload::{Backing, GuestRam};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Marks a private stamp: the host scanner recognises private data by it.
const PRIVATE_MARK: u64 = 1 << 63;
/// Chunk sizes in pages, cycled through (KVM's test also converts odd sizes).
const CHUNKS: [u64; 6] = [1, 2, 3, 16, 511, 512];
/// Where guest memory starts.
const GPA: u64 = 1 << 32;
/// Violations kept word for word (all are counted).
const KEEP: usize = 16;

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct ConversionParams {
    /// vCPUs, each converting its own region.
    pub vcpus: usize,
    /// Bytes per vCPU (a non-zero multiple of 4 KiB).
    pub bytes_per_vcpu: u64,
    /// The host direct map.
    pub direct_map: DirectMapConfig,
    /// Passes over each vCPU's region.
    pub rounds: u32,
    /// Seeds the stamps.
    pub seed: u64,
}

/// What the test saw.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ConversionReport {
    /// Conversions to private (all vCPUs).
    pub to_private: u64,
    /// Conversions to shared.
    pub to_shared: u64,
    /// Bytes converted each way, summed.
    pub bytes_converted: u64,
    /// Time spent in `set_memory_attributes`, summed over vCPUs, seconds.
    pub convert_s: f64,
    /// Bytes converted per second of conversion, GiB/s.
    pub convert_gib_per_s: f64,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Guest accesses checked.
    pub accesses_checked: u64,
    /// Memory-fault exits that the rules required (and got).
    pub memory_fault_exits: u64,
    /// Host reads of pool pages through the direct map.
    pub host_reads: u64,
    /// Of those, reads that found the page mapped.
    pub host_reads_mapped: u64,
    /// Host reads of private data through a stale translation (only without kernel flush).
    pub stale_host_reads: u64,
    /// Whether rule 5 was checked (not with the `none` policy).
    pub host_isolation_checked: bool,
    /// Violations of the rules, counted.
    pub violations: u64,
    /// The first violations, described.
    pub first_violations: Vec<String>,
    /// Pages accepted, splits and collapses of the direct map.
    pub accepted: u64,
    /// Splits.
    pub splits: u64,
    /// Collapses.
    pub collapses: u64,
}

#[derive(Default)]
struct Tally {
    report: ConversionReport,
}

impl Tally {
    fn violation(&mut self, what: String) {
        self.report.violations += 1;
        if self.report.first_violations.len() < KEEP {
            self.report.first_violations.push(what);
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A shared stamp (never 0, never marked private).
fn shared_stamp(seed: u64, vcpu: usize, round: u32, page: u64) -> u64 {
    (splitmix(seed ^ (vcpu as u64) << 48 ^ u64::from(round) << 32 ^ page) & !PRIVATE_MARK) | 1
}

/// A private stamp (marked).
fn private_stamp(seed: u64, vcpu: usize, round: u32, page: u64) -> u64 {
    splitmix(!seed ^ (vcpu as u64) << 48 ^ u64::from(round) << 32 ^ page) | PRIVATE_MARK
}

/// The guest's memory size, or why `p` cannot be run.
fn checked_total(p: &ConversionParams) -> Result<u64, MachineError> {
    if !(1..=512).contains(&p.vcpus) || p.bytes_per_vcpu == 0 || p.bytes_per_vcpu % PAGE_SIZE != 0 {
        return Err(MachineError::Config(format!(
            "{} vCPUs x {} bytes: need 1-512 vCPUs (a thread each) and a non-zero multiple of 4 KiB each",
            p.vcpus, p.bytes_per_vcpu
        )));
    }
    p.bytes_per_vcpu
        .checked_mul(p.vcpus as u64)
        .filter(|t| t.checked_add(2 << 20).is_some())
        .ok_or_else(|| MachineError::Config("the memory size overflows 64 bits".into()))
}

/// Runs the test; `Err` only if the machine could not be built.
pub fn run_conversion_test(p: ConversionParams) -> Result<ConversionReport, MachineError> {
    let total = checked_total(&p)?;
    let shared = Arc::new(GuestRam::new(Backing::Anonymous, total, true)?);
    let pool_len = total.div_ceil(2 << 20) * (2 << 20);
    let pool = Arc::new(GuestRam::new(Backing::AnonymousThp, pool_len, true)?);
    let map = DirectMap::new(HostRange::new(pool.clone())?, p.direct_map)?;
    let vm = Vm::<Ept>::new(VmConfig::default());
    let private = map.bind(0, total)?;
    vm.add_memslot_with_private(
        1,
        Gpa::new(GPA),
        total,
        HostRange::new(shared.clone())?,
        private,
        MemslotFlags::empty(),
    )?;
    let before = map.stats();
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let check_host = p.direct_map.policy != DirectMapPolicy::Untouched;
    let t0 = Instant::now();
    let up = Arc::new(AtomicBool::new(false));
    let scanner = scan(
        map.clone(),
        pool.addr(),
        total,
        [stop.clone(), up.clone()],
        tally.clone(),
    )
    .map_err(MachineError::Thread)?;
    // The host reads all along: the vCPUs start once it is online.
    while !up.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    let pcpus = Arc::new(PcpuPool::new(p.vcpus));
    let mut workers = Vec::with_capacity(p.vcpus);
    let mut failed = None;
    for i in 0..p.vcpus {
        let w = Worker {
            vm: vm.clone(),
            map: map.clone(),
            shared: shared.clone(),
            p,
            vcpu: i,
            check_host,
            tally: tally.clone(),
        };
        match w.start(pool.addr(), pool_len, &pcpus) {
            Ok(h) => workers.push(h),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    // On a failed start the vCPUs already running finish their rounds (they wait for nothing
    // but the host thread's flush service, which runs until they are joined) and are joined.
    for w in workers {
        if w.join().is_err() {
            tally
                .lock()
                .unwrap()
                .violation("a vCPU thread panicked".into());
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (reads, mapped, stale) = scanner.join().unwrap_or((0, 0, 0));
    if let Some(e) = failed {
        return Err(e);
    }
    let report = std::mem::take(&mut tally.lock().unwrap().report);
    let host = HostScan {
        reads,
        mapped,
        stale,
        checked: check_host,
    };
    Ok(complete_report(report, &p, t0, host, &before, &map.stats()))
}

/// What the host thread saw: its reads, those that found a mapping, those that read private
/// data, and whether isolation was checked at all.
struct HostScan {
    reads: u64,
    mapped: u64,
    stale: u64,
    checked: bool,
}

/// Completes the vCPUs' report with the wall time, the host's reads and the direct map's
/// counters since `before`, and counts stale host reads as violations where the kernel flush
/// promised none.
fn complete_report(
    mut t: ConversionReport,
    p: &ConversionParams,
    t0: Instant,
    host: HostScan,
    before: &DirectMapStats,
    s: &DirectMapStats,
) -> ConversionReport {
    t.wall_s = t0.elapsed().as_secs_f64();
    t.host_reads = host.reads;
    t.host_reads_mapped = host.mapped;
    t.stale_host_reads = host.stale;
    t.host_isolation_checked = host.checked;
    t.convert_gib_per_s = if t.convert_s > 0.0 {
        t.bytes_converted as f64 / t.convert_s / (1u64 << 30) as f64
    } else {
        0.0
    };
    t.accepted = s.accepted - before.accepted;
    t.splits = s.splits - before.splits;
    t.collapses = s.collapses - before.collapses;
    if host.checked && p.direct_map.kernel_flush && host.stale != 0 {
        t.violations += host.stale;
        t.first_violations.push(format!(
            "the host read private data through the direct map {} times despite the kernel TLB flush",
            host.stale
        ));
    }
    t
}

/// The host thread: reads every pool page's first word through the direct map, round and
/// round, as an online host CPU (so kernel TLB flushes wait for it between two reads).
fn scan(
    map: Arc<DirectMap>,
    base: u64,
    len: u64,
    [stop, up]: [Arc<AtomicBool>; 2],
    tally: Arc<Mutex<Tally>>,
) -> std::io::Result<std::thread::JoinHandle<(u64, u64, u64)>> {
    let thread = std::thread::Builder::new().name("host-scan".into());
    thread.spawn(move || {
        let mut cpu = map.host_cpu();
        let online = cpu.online();
        cpu.service(|| {});
        up.store(true, Ordering::Release);
        let (mut reads, mut mapped, mut stale) = (0u64, 0u64, 0u64);
        let mut page = 0;
        while !stop.load(Ordering::Relaxed) {
            if cpu.pending() != 0 {
                cpu.service(|| {});
            }
            let hva = base + page * PAGE_SIZE;
            page = (page + 1) % (len >> PAGE_SHIFT);
            reads += 1;
            let Ok(Some(v)) = map.read_u64(Hva::new(hva)) else {
                continue;
            };
            mapped += 1;
            // With the `none` policy private pages stay in the direct map: nothing to check.
            let isolated = map.config().policy != DirectMapPolicy::Untouched;
            if isolated && v & PRIVATE_MARK != 0 {
                stale += 1;
                if !map.config().kernel_flush {
                    continue; // the risk that option takes: counted, not a violation
                }
                let mut t = tally.lock().unwrap();
                t.violation(format!("host read private data {v:#x} at pool page {page}"));
            }
        }
        drop(online);
        (reads, mapped, stale)
    })
}

struct Worker {
    vm: Arc<Vm<Ept>>,
    map: Arc<DirectMap>,
    shared: Arc<GuestRam>,
    p: ConversionParams,
    vcpu: usize,
    check_host: bool,
    tally: Arc<Mutex<Tally>>,
}

/// What one vCPU's pass counted (merged into the tally at the end).
#[derive(Default)]
struct Local {
    checked: u64,
    faults: u64,
    to_private: u64,
    to_shared: u64,
    bytes: u64,
    convert: Duration,
    violations: Vec<String>,
}

impl Worker {
    /// Builds vCPU `self.vcpu` on the private pool `[pool, pool + pool_len)` and starts its
    /// thread.
    fn start(
        self,
        pool: u64,
        pool_len: u64,
        pcpus: &Arc<PcpuPool>,
    ) -> Result<std::thread::JoinHandle<()>, MachineError> {
        let mut cpu = Cpu::new(self.vm.clone(), self.vcpu as u32, 512, pcpus.clone())?;
        cpu.set_private_pool(pool, pool + pool_len);
        cpu.attach_host_cpu(self.map.host_cpu());
        std::thread::Builder::new()
            .name(format!("vcpu{}", self.vcpu))
            .spawn(move || self.run(cpu))
            .map_err(MachineError::Thread)
    }

    fn run(self, mut cpu: Cpu<Ept>) {
        let mut l = Local::default();
        let pages = self.p.bytes_per_vcpu >> PAGE_SHIFT;
        let first = self.vcpu as u64 * pages;
        cpu.enter();
        let mut c = self.vcpu; // vCPUs start at different chunk sizes
        for round in 0..self.p.rounds {
            let mut page = 0;
            while page < pages {
                let n = CHUNKS[c % CHUNKS.len()].min(pages - page);
                c += 1;
                self.chunk(&mut cpu, &mut l, round, first + page, n);
                page += n;
            }
        }
        cpu.exit();
        cpu.destroy();
        let mut t = self.tally.lock().unwrap();
        let r = &mut t.report;
        r.accesses_checked += l.checked;
        r.memory_fault_exits += l.faults;
        r.to_private += l.to_private;
        r.to_shared += l.to_shared;
        r.bytes_converted += l.bytes;
        r.convert_s += l.convert.as_secs_f64();
        for v in l.violations {
            t.violation(v);
        }
    }

    fn gpa(page: u64) -> u64 {
        GPA + page * PAGE_SIZE
    }

    /// The VMM's side of the guest's conversion hypercall: leave guest mode, convert, return.
    fn convert(&self, cpu: &mut Cpu<Ept>, l: &mut Local, page: u64, n: u64, private: bool) {
        cpu.exit();
        let attrs = if private {
            MemoryAttributes::PRIVATE
        } else {
            MemoryAttributes::empty()
        };
        let t0 = Instant::now();
        let r = self
            .vm
            .set_memory_attributes(Gfn::new(Self::gpa(page) >> PAGE_SHIFT), n, attrs);
        l.convert += t0.elapsed();
        if let Err(e) = r {
            l.violations
                .push(format!("vCPU {}: conversion refused: {e}", self.vcpu));
        }
        if private {
            l.to_private += 1;
        } else {
            l.to_shared += 1;
        }
        l.bytes += n * PAGE_SIZE;
        cpu.enter();
    }

    /// Checks one access's result against what the rules allow.
    fn expect(&self, l: &mut Local, what: &str, got: Result<u64, Exit>, want: Result<u64, Exit>) {
        l.checked += 1;
        if got != want {
            l.violations.push(format!(
                "vCPU {} seed {:#x}: {what}: got {got:x?}, the rules allow {want:x?}",
                self.vcpu, self.p.seed
            ));
        } else if want.is_err() {
            l.faults += 1;
        }
    }

    fn chunk(&self, cpu: &mut Cpu<Ept>, l: &mut Local, round: u32, first: u64, n: u64) {
        let (seed, v) = (self.p.seed, self.vcpu);
        let fault = |page: u64, private| {
            Err(Exit::MemoryFault {
                gpa: Self::gpa(page),
                size: PAGE_SIZE,
                private,
            })
        };
        // Rule 1: shared writes, read back.
        for pg in first..first + n {
            let s = shared_stamp(seed, v, round, pg);
            let w = cpu.write_u64_as(Self::gpa(pg), s, false).map(|_| s);
            self.expect(l, "shared write", w, Ok(s));
        }
        self.convert(cpu, l, first, n, true);
        // Rule 3: the shared view is gone.
        let got = cpu.read_u64_as(Self::gpa(first), false);
        self.expect(l, "shared read of a private page", got, fault(first, false));
        // Rule 2: zero on first private touch, then what was written.
        for pg in first..first + n {
            let got = cpu.read_u64_as(Self::gpa(pg), true);
            self.expect(l, "first private read", got, Ok(0));
            let p = private_stamp(seed, v, round, pg);
            let w = cpu.write_u64_as(Self::gpa(pg), p, true).map(|_| p);
            self.expect(l, "private write", w, Ok(p));
        }
        self.check_backings(l, round, first, n, true);
        self.convert(cpu, l, first, n, false);
        // Rule 3 again, and rule 1: the shared data survived the private period.
        let got = cpu.read_u64_as(Self::gpa(first), true);
        self.expect(l, "private read of a shared page", got, fault(first, true));
        for pg in first..first + n {
            let got = cpu.read_u64_as(Self::gpa(pg), false);
            self.expect(
                l,
                "shared read after",
                got,
                Ok(shared_stamp(seed, v, round, pg)),
            );
        }
        self.check_backings(l, round, first, n, false);
    }

    /// Rules 4 and 5 from the host's side: the shared backing holds the shared stamps; the
    /// pool's pages are out of the direct map while private, and scrubbed once shared.
    fn check_backings(&self, l: &mut Local, round: u32, first: u64, n: u64, private: bool) {
        for pg in first..first + n {
            let off = pg * PAGE_SIZE;
            // SAFETY: `off` is inside the shared RAM (pages of this vCPU's region), which
            // `self.shared` keeps mapped; aligned, atomic since vCPUs may access it.
            let s = unsafe { AtomicU64::from_ptr((self.shared.addr() + off) as *mut u64) }
                .load(Ordering::Relaxed);
            let want = shared_stamp(self.p.seed, self.vcpu, round, pg);
            self.expect(l, "host read of the shared backing", Ok(s), Ok(want));
            if !self.check_host {
                continue;
            }
            let hva = self.map.pool().addr().raw() + off;
            let got = self.map.read_u64(Hva::new(hva)).ok().flatten();
            l.checked += 1;
            let allowed = if private { None } else { Some(0) };
            if got != allowed {
                l.violations.push(format!(
                    "vCPU {} seed {:#x}: host read of pool page {pg} through the direct map while {}: got {got:x?}, allowed {allowed:x?}",
                    self.vcpu,
                    self.p.seed,
                    if private { "private" } else { "shared again" }
                ));
            }
        }
    }
}
