//! A minimal VMM on `kvm-ioctls`, live-migrated with `slat-migrate`: what a VMM author writes.
//!
//! - Two RAM regions with a hole between them (2 MiB at 0, 4 MiB at 16 MiB), mapped by this
//!   program, registered with KVM through `slat_dirty::Memslot` so their dirty logs are sized
//!   from the slots.
//! - A guest of seven instructions (32-bit protected mode, no paging) that counts in `eax`,
//!   stores the count to two pages of each region and sends a byte to a fake serial port,
//!   forever. A vCPU thread runs it; pausing stops the run loop at the next exit.
//! - `slat_migrate::Guest` for it: the regions, pause/resume, the KVM dirty log, and one
//!   versioned device-state blob (the serial port and the vCPU's registers).
//! - A migration over a UNIX socket to a destination thread whose VM the `Factory` builds
//!   from the source's memory map, verification on; then the checks: both memories equal at
//!   the switch-over, the device state handed back, and the guest counting on at the
//!   destination.
//!
//! `cargo run -p slat-migrate --example minimal_vmm --release` (needs /dev/kvm);
//! `tests/migrate/example_vmm.rs` runs it.

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use slat_addr::{Gpa, PageIndex};
use slat_dirty::{LogMode, Memslot};
use slat_migrate::postcopy::PostcopyTrigger;
use slat_migrate::stream::Region;
use slat_migrate::transport::{Endpoint, Listener};
use slat_migrate::{
    kvm_dirty_log, DestConfig, DestReport, Destination, Factory, Guest, GuestError, GuestHarvester,
    GuestRegion, HelloError, Memory, MigrationReport, Source, SourceConfig, StateBlob,
};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The memory map: (guest-physical address, bytes). Nothing between 2 MiB and 16 MiB.
const RAM: [(u64, u64); 2] = [(0, 2 << 20), (16 << 20, 4 << 20)];
/// The fake serial port's data register.
const SERIAL: u16 = 0x3f8;
/// Where the guest stores its count: two pages in each region.
const COUNTERS: [u64; 4] = [0x1000, 0x8000, 0x100_0000, 0x120_0000];
/// The guest, at guest-physical 0 (`edx` = `SERIAL`):
/// `l: inc eax; mov [COUNTERS[0..4]], eax; out dx, al; jmp l`.
const CODE: [u8; 24] = [
    0x40, // inc eax
    0xa3, 0x00, 0x10, 0x00, 0x00, // mov [0x1000], eax
    0xa3, 0x00, 0x80, 0x00, 0x00, // mov [0x8000], eax
    0xa3, 0x00, 0x00, 0x00, 0x01, // mov [0x100_0000], eax
    0xa3, 0x00, 0x00, 0x20, 0x01, // mov [0x120_0000], eax
    0xee, // out dx, al
    0xeb, 0xe8, // jmp l
];
/// The device state's id and format version: serial (8 + 1 bytes), `kvm_regs`, `kvm_sregs`.
const STATE_ID: &str = "minimal-vmm";
const STATE_VERSION: u32 = 1;
const TIMEOUT: Duration = Duration::from_secs(10);

/// The fake serial port: bytes the guest sent and the last one.
#[derive(Default)]
struct Serial {
    sent: AtomicU64,
    last: AtomicU8,
}

impl Serial {
    /// A byte from the guest.
    fn write(&self, data: &[u8]) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        if let Some(&b) = data.first() {
            self.last.store(b, Ordering::Relaxed);
        }
    }
    /// Its state, 9 bytes: `sent` (little-endian), `last`.
    fn save(&self) -> Vec<u8> {
        let mut out = self.sent.load(Ordering::Relaxed).to_le_bytes().to_vec();
        out.push(self.last.load(Ordering::Relaxed));
        out
    }
    fn restore(&self, b: &[u8; 9]) {
        let (sent, last) = b.split_at(8);
        let sent = u64::from_le_bytes(sent.try_into().unwrap_or_default());
        self.sent.store(sent, Ordering::Relaxed);
        self.last.store(last[0], Ordering::Relaxed);
    }
}

/// The vCPU: its fd while paused, or the thread running it (which hands the fd back).
enum Vcpu {
    Paused(VcpuFd),
    Running(Arc<AtomicBool>, JoinHandle<(VcpuFd, Result<(), String>)>),
    /// The run thread panicked, or could not be started, and the fd went with it.
    Lost,
}

/// A VM with one vCPU and the RAM regions of a memory map.
struct Vm {
    /// One dirty-logged memslot per region, in map order (they hold the `VmFd`).
    slots: Vec<Memslot>,
    vcpu: Mutex<Vcpu>,
    serial: Arc<Serial>,
}

/// Maps `len` bytes of zeroed memory for guest RAM and returns its address. It is never
/// unmapped: KVM may reach it for as long as the VM lives, which is until the last
/// `Memslot` handle (held by harvesters the migration keeps) is gone.
fn guest_ram(len: u64) -> std::io::Result<u64> {
    // SAFETY: a new anonymous mapping at an address of the kernel's choosing: it overlaps no
    // memory this program uses.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p as u64)
}

impl Vm {
    /// A VM with RAM for each of `map`'s regions and a vCPU in its reset state.
    fn new(map: &[Region]) -> Result<Vm, GuestError> {
        let kvm = Kvm::new().map_err(GuestError::machine)?;
        let vm = Arc::new(kvm.create_vm().map_err(GuestError::machine)?);
        let mut slots = Vec::new();
        for (slot, r) in (0..).zip(map) {
            let region = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: r.gpa.raw(),
                memory_size: r.pages * 4096,
                userspace_addr: guest_ram(r.pages * 4096).map_err(GuestError::machine)?,
            };
            // SAFETY: the host range is a mapping of its own (`guest_ram`) that is never
            // unmapped and holds nothing but this guest's memory; this program never deletes
            // a slot.
            let slot = unsafe { Memslot::register(&vm, region) };
            slots.push(slot.map_err(GuestError::harvest)?);
        }
        let vcpu = vm.create_vcpu(0).map_err(GuestError::machine)?;
        Ok(Vm {
            vcpu: Mutex::new(Vcpu::Paused(vcpu)),
            slots,
            serial: Arc::default(),
        })
    }

    /// Loads the guest's code and points the (paused) vCPU at it: flat 4 GiB segments,
    /// protected mode without paging (set directly in the segment caches, so no GDT).
    fn boot(&self) -> Result<(), Error> {
        // Guest memory is written like the migration writes it: through `Memory` (atomic
        // stores, vCPU stopped), never through a `&mut [u8]` a vCPU could race with.
        let mut page = vec![0u8; 4096];
        page[..CODE.len()].copy_from_slice(&CODE);
        Memory::new(self)?.stopped_write_page(PageIndex::new(0), &page)?;
        let guard = self.vcpu();
        let Vcpu::Paused(vcpu) = &*guard else {
            return Err("boot: the vCPU is not paused".into());
        };
        let flat = |selector, type_| kvm_segment {
            base: 0,
            limit: 0xffff_ffff,
            selector,
            type_,
            present: 1,
            s: 1,
            db: 1,
            g: 1,
            ..Default::default()
        };
        let mut sregs = vcpu.get_sregs()?;
        sregs.cs = flat(0x08, 0xb); // code, execute/read, accessed
        sregs.ds = flat(0x10, 0x3); // data, read/write, accessed
        (sregs.es, sregs.fs, sregs.gs, sregs.ss) = (sregs.ds, sregs.ds, sregs.ds, sregs.ds);
        sregs.cr0 |= 1; // PE
        vcpu.set_sregs(&sregs)?;
        vcpu.set_regs(&kvm_regs {
            rip: 0,
            rdx: SERIAL.into(),
            rflags: 2,
            ..Default::default()
        })?;
        Ok(())
    }

    /// The vCPU's state. Every change of it is one `mem::replace`, so it is consistent even
    /// after a panic elsewhere poisoned the lock.
    fn vcpu(&self) -> MutexGuard<'_, Vcpu> {
        self.vcpu.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The vCPU thread: runs the guest until `stop`, serving the serial port.
fn run(
    mut vcpu: VcpuFd,
    stop: Arc<AtomicBool>,
    serial: Arc<Serial>,
) -> (VcpuFd, Result<(), String>) {
    while !stop.load(Ordering::Acquire) {
        let why = match vcpu.run() {
            Ok(VcpuExit::IoOut(SERIAL, data)) => {
                serial.write(data);
                continue;
            }
            Err(e) if e.errno() == libc::EINTR => continue,
            Ok(exit) => format!("unexpected exit {exit:?}"),
            Err(e) => format!("KVM_RUN: {e}"),
        };
        return (vcpu, Err(why));
    }
    (vcpu, Ok(()))
}

/// The bytes of `t`.
///
/// # Safety
///
/// `T` has no padding (every byte belongs to a field of an integer type).
unsafe fn bytes_of<T>(t: &T) -> &[u8] {
    // SAFETY: `t` is `size_of::<T>()` readable bytes, all initialized (no padding: the
    // caller's promise), borrowed for the slice's life.
    unsafe { std::slice::from_raw_parts((t as *const T).cast(), size_of::<T>()) }
}

/// A `T` from exactly its bytes, `None` if `b` has another length.
///
/// # Safety
///
/// Every bit pattern is a valid `T` (`T` is made of integers).
unsafe fn from_bytes<T>(b: &[u8]) -> Option<T> {
    // SAFETY: `b` holds `size_of::<T>()` bytes (checked), read unaligned; any bits make a
    // valid `T` (the caller's promise).
    (b.len() == size_of::<T>()).then(|| unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) })
}

// Both register structs are made of integers with explicit padding fields: no padding.
const _: () = assert!(size_of::<kvm_regs>() == 18 * 8);
const _: () = assert!(size_of::<kvm_sregs>() == 8 * 24 + 2 * 16 + 7 * 8 + 4 * 8);
const REGS: usize = size_of::<kvm_regs>();

// SAFETY: every region is a memslot's host range, mapped by `guest_ram` for the program's
// life (never unmapped), page aligned, and `regions` always lists the same slots. Only the
// vCPU writes it, by hardware; this program reads and writes it only through `Memory`
// (atomically) once the guest exists. `running` is true while the run thread exists.
// `demand_paged`: the ranges are `MAP_PRIVATE | MAP_ANONYMOUS` with 4 KiB pages and no
// userfaultfd of this program's; only the vCPU (through KVM) touches them while it runs.
unsafe impl Guest for Vm {
    fn kind(&self) -> &str {
        "minimal-vmm"
    }
    fn regions(&self) -> Vec<GuestRegion> {
        let region = |s: &Memslot| Region {
            gpa: s.guest_phys_addr(),
            pages: s.pages(),
            read_only: false,
        };
        self.slots
            .iter()
            .map(|s| GuestRegion {
                region: region(s),
                host: s.userspace_addr(),
            })
            .collect()
    }
    /// Stops the run loop at the guest's next exit (its `out`, every iteration). A VMM whose
    /// guests may run without exiting also kicks the thread out of `KVM_RUN`: a signal to
    /// it with `set_kvm_immediate_exit(1)` set (KVM_RUN then returns `EINTR`).
    fn pause(&self) -> Result<(), GuestError> {
        let mut v = self.vcpu();
        let Vcpu::Running(stop, thread) = std::mem::replace(&mut *v, Vcpu::Lost) else {
            return Ok(()); // already paused (or lost: `resume` says so)
        };
        stop.store(true, Ordering::Release);
        let (vcpu, result) = thread
            .join()
            .map_err(|_| GuestError::machine(std::io::Error::other("the vCPU thread panicked")))?;
        *v = Vcpu::Paused(vcpu);
        result.map_err(|e| GuestError::machine(std::io::Error::other(e)))
    }
    fn resume(&self) -> Result<(), GuestError> {
        let mut v = self.vcpu();
        *v = match std::mem::replace(&mut *v, Vcpu::Lost) {
            Vcpu::Paused(vcpu) => {
                let stop = Arc::new(AtomicBool::new(false));
                let (s, serial) = (stop.clone(), self.serial.clone());
                let thread = std::thread::Builder::new().name("vcpu0".into());
                // (A failed spawn drops the vCPU: the guest is lost, as its error says.)
                let thread = thread.spawn(move || run(vcpu, s, serial));
                Vcpu::Running(stop, thread.map_err(GuestError::machine)?)
            }
            Vcpu::Lost => return Err(GuestError::NothingToResume),
            running => running,
        };
        Ok(())
    }
    fn running(&self) -> bool {
        matches!(*self.vcpu(), Vcpu::Running(..))
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError> {
        for s in &self.slots {
            s.set_dirty_logging(on).map_err(GuestError::harvest)?;
        }
        Ok(())
    }
    fn dirty_log(&self) -> Result<GuestHarvester, GuestError> {
        kvm_dirty_log(self.slots.clone(), LogMode::Get)
    }
    fn save_state(&self) -> Result<Vec<StateBlob>, GuestError> {
        let v = self.vcpu();
        let Vcpu::Paused(vcpu) = &*v else {
            return Err(GuestError::machine(std::io::Error::other(
                "save_state: vCPU not paused",
            )));
        };
        let (regs, sregs) = (
            vcpu.get_regs().map_err(GuestError::machine)?,
            vcpu.get_sregs().map_err(GuestError::machine)?,
        );
        let mut data = self.serial.save();
        // SAFETY: both are KVM ABI structs of integers without padding (asserted above).
        unsafe {
            data.extend_from_slice(bytes_of(&regs));
            data.extend_from_slice(bytes_of(&sregs));
        }
        Ok(vec![StateBlob {
            id: STATE_ID.into(),
            version: STATE_VERSION,
            data,
        }])
    }
    fn restore_state(&self, blobs: Vec<StateBlob>) -> Result<(), GuestError> {
        let refuse = |b: &StateBlob, why: &str| GuestError::State {
            id: b.id.clone(),
            version: b.version,
            why: why.into(),
        };
        let [b] = &blobs[..] else {
            return Err(GuestError::machine(std::io::Error::other(format!(
                "expected one device-state blob, got {}",
                blobs.len()
            ))));
        };
        if b.id != STATE_ID || b.version != STATE_VERSION {
            return Err(refuse(b, "this VMM reads minimal-vmm version 1"));
        }
        let (serial, cpu) = b
            .data
            .split_first_chunk::<9>()
            .ok_or_else(|| refuse(b, "too short"))?;
        let (regs, sregs) = cpu
            .split_at_checked(REGS)
            .ok_or_else(|| refuse(b, "too short"))?;
        // SAFETY: both are KVM ABI structs made of integers: any bytes are valid values
        // (KVM checks what it is given).
        let (regs, sregs) =
            unsafe { (from_bytes::<kvm_regs>(regs), from_bytes::<kvm_sregs>(sregs)) };
        let (Some(regs), Some(sregs)) = (regs, sregs) else {
            return Err(refuse(b, "wrong length"));
        };
        let v = self.vcpu();
        let Vcpu::Paused(vcpu) = &*v else {
            return Err(GuestError::machine(std::io::Error::other(
                "restore_state: vCPU runs",
            )));
        };
        vcpu.set_sregs(&sregs).map_err(GuestError::machine)?;
        vcpu.set_regs(&regs).map_err(GuestError::machine)?;
        self.serial.restore(serial);
        Ok(())
    }
    fn activity(&self) -> Option<u64> {
        Some(self.serial.sent.load(Ordering::Relaxed))
    }
    fn demand_paged(&self) -> bool {
        true
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.pause();
    }
}

/// The guest's count as stored at `gpa` (one of `COUNTERS`), read through `Memory`.
fn counter(g: &dyn Guest, gpa: u64) -> Result<u32, Error> {
    let mem = Memory::new(g)?;
    let map = mem.map();
    let (i, r) = (map.regions().iter().enumerate())
        .find(|(_, r)| {
            (r.region.gpa.raw()..r.region.gpa.raw() + r.region.pages * 4096).contains(&gpa)
        })
        .ok_or("address in a hole")?;
    let mut page = vec![0u8; 4096];
    mem.read_page(
        PageIndex::new(map.start(i) + (gpa - r.region.gpa.raw()) / 4096),
        &mut page,
    )?;
    let at = (gpa % 4096) as usize;
    Ok(u32::from_le_bytes(page[at..at + 4].try_into()?))
}

/// What the destination ends with: its report and the guest it took.
type Migrated = (DestReport, Arc<dyn Guest>);

/// The destination: a thread that serves one migration from `listener`; its VM is built from
/// the map the source announces, and left paused.
fn spawn_destination(mut listener: Listener) -> JoinHandle<Result<Migrated, Error>> {
    std::thread::spawn(move || -> Result<_, Error> {
        let factory: Factory = Box::new(|map: &[Region], _machine: &[u8]| {
            Ok(Arc::new(Vm::new(map).map_err(HelloError::Build)?) as Arc<dyn Guest>)
        });
        let cfg = DestConfig {
            resume_for: Duration::ZERO, // left paused, to compare memory below
            timeout: TIMEOUT,
            ..DestConfig::default()
        };
        let mut d = Destination::new(factory, cfg);
        // Post-copy's second connection (the preempt channel) comes to the same socket:
        // `accept_from` takes it (and any page streams) from `listener` too.
        let report = d.accept_from(&mut listener)?;
        let guest = d.guest().ok_or("no guest after a migration")?.clone();
        Ok((report, guest))
    })
}

/// The rounds and the totals of a migration.
fn print_report(report: &MigrationReport, dreport: &DestReport) {
    for r in &report.rounds {
        let last = if r.stop_and_copy {
            " (stop-and-copy)"
        } else {
            ""
        };
        println!(
            "round {}: {} pages ({} zero) in {:.1?}{last}",
            r.round, r.pages, r.zero_pages, r.time
        );
    }
    println!(
        "migrated {} pages in {:.1?} (the guest looped {} times meanwhile); downtime {:.1?}; \
         device state {} bytes; all {} ranges verified ({:?} mode)",
        report.pages(),
        report.total,
        report.guest_writes,
        report.downtime,
        report.state_bytes,
        dreport.verify.ranges,
        report.verify_mode,
    );
}

/// At the switch-over: the source is paused for good, the destination not yet running, and
/// their memories, count and device state are the same. Returns the count.
fn check_switch_over(src: &dyn Guest, dst: &dyn Guest) -> Result<u32, Error> {
    if src.running() || dst.running() {
        return Err("a guest runs after the switch-over".into());
    }
    let (a, b) = (Memory::new(src)?, Memory::new(dst)?);
    if a.map().wire() != b.map().wire()
        || a.stopped_range(PageIndex::new(0), PageIndex::new(a.pages()))?
            != b.stopped_range(PageIndex::new(0), PageIndex::new(b.pages()))?
    {
        return Err("destination memory differs from the source's".into());
    }
    if src.save_state()? != dst.save_state()? {
        return Err("the device state was not handed back".into());
    }
    let at_switch = counter(dst, COUNTERS[3])?;
    println!(
        "switch-over: memory ({} pages) and device state equal; count {at_switch}",
        a.pages()
    );
    Ok(at_switch)
}

/// `pub`: `tests/migrate/example_vmm.rs` runs it.
pub fn main() -> Result<(), Error> {
    let map: Vec<Region> = RAM
        .iter()
        .map(|&(gpa, len)| Region {
            gpa: Gpa::new(gpa),
            pages: len / 4096,
            read_only: false,
        })
        .collect();

    // The source: boot the guest and let it run.
    let src = Arc::new(Vm::new(&map)?);
    src.boot()?;
    src.resume()?;
    std::thread::sleep(Duration::from_millis(200));
    println!(
        "source: guest counting, count {} after 200 ms",
        counter(&*src, COUNTERS[3])?
    );

    // The destination listens on a UNIX socket.
    let path = std::env::temp_dir().join(format!("minimal-vmm-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = Listener::bind(&Endpoint::Unix(path.clone()))?;
    let dest = spawn_destination(listener);

    // Migrate (verification on: `VerifyMode::Sent` is the default).
    let cfg = SourceConfig {
        max_downtime: Duration::from_millis(50),
        timeout: TIMEOUT,
        ..SourceConfig::default()
    };
    let mut source = Source::new(src.clone(), cfg);
    let report = source.migrate(&format!("unix:{}", path.display()), &mut |_| {});
    let dest = dest.join().map_err(|_| "the destination thread panicked")?;
    let _ = std::fs::remove_file(&path);
    let (report, (dreport, dst)) = (report?, dest?);

    print_report(&report, &dreport);

    let at_switch = check_switch_over(&*src, &*dst)?;

    // The guest runs on at the destination, from where it stopped.
    dst.resume()?;
    std::thread::sleep(Duration::from_millis(200));
    dst.pause()?;
    let counts = (COUNTERS.iter())
        .map(|&gpa| counter(&*dst, gpa))
        .collect::<Result<Vec<_>, _>>()?;
    let now = counts[0];
    if now <= at_switch || counts.iter().any(|&c| c != now) {
        return Err(format!("the destination guest did not count on: {counts:?}").into());
    }
    println!("destination: guest counting on, count {now} in both regions");
    postcopy_onward(dst, now)
}

/// Moves the guest on from `dst` to a third VM in pure post-copy: the new VM runs it at once
/// and pulls every page it touches from `dst` (`count`: where the guest stopped on `dst`).
fn postcopy_onward(dst: Arc<dyn Guest>, count: u32) -> Result<(), Error> {
    let path = std::env::temp_dir().join(format!("minimal-vmm-pc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let third = spawn_destination(Listener::bind(&Endpoint::Unix(path.clone()))?);
    let cfg = SourceConfig {
        postcopy: Some(PostcopyTrigger::After(0)),
        timeout: TIMEOUT,
        ..SourceConfig::default()
    };
    dst.resume()?;
    let report =
        Source::new(dst.clone(), cfg).migrate(&format!("unix:{}", path.display()), &mut |_| {});
    let third = third
        .join()
        .map_err(|_| "the destination thread panicked")?;
    let _ = std::fs::remove_file(&path);
    let (report, (dreport, guest)) = (report?, third?);
    let (p, dp) = (
        report.postcopy.ok_or("no post-copy figures")?,
        dreport
            .postcopy
            .ok_or("no post-copy figures at the destination")?,
    );
    let counts = (COUNTERS.iter())
        .map(|&gpa| counter(&*guest, gpa))
        .collect::<Result<Vec<_>, _>>()?;
    if counts[0] <= count || counts.iter().any(|&c| c != counts[0]) {
        return Err(format!("the post-copy guest did not count on: {counts:?}").into());
    }
    println!(
        "post-copy: {} pages ({} requested by faults, blocktime p99 {:.1?}), all verified; the guest counted on to {}",
        p.background_pages + p.preempt_pages,
        dp.requested,
        dp.blocktime.p99,
        counts[0]
    );
    Ok(())
}
