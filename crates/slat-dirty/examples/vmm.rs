//! What a VMM author writes: a KVM VM from `kvm-ioctls` with memory this program maps, a tiny
//! guest that writes a few pages, transactional harvests of its dirty pages, and a snapshot of
//! guest RAM reset from those harvests (copying back only the dirty pages).
//!
//! `cargo run --release -p slat-dirty --example vmm` (needs /dev/kvm). The guest is set up in 64-bit
//! user mode with the tests' small page-table and GDT setup (`tests/common/long_mode.rs`); any VMM's own setup works.

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use slat_dirty::{GuestRegion, Harvester, LogMode, Memslot, Snapshot};
#[path = "../tests/common/long_mode.rs"]
mod long_mode;

use long_mode::LowLayout;
use std::sync::Arc;

const RAM_GPA: u64 = 1 << 30;
const RAM_PAGES: u64 = 256;

/// Increments byte 0 of each page listed in the control page (`[r13]` = count, then the
/// addresses), then `out 0x88, al`, and starts over.
const WRITER: [u8; 31] = [
    0x49, 0x8b, 0x4d, 0x00, 0x49, 0x8d, 0x75, 0x08, 0x48, 0x85, 0xc9, 0x74, 0x0e, 0x48, 0x8b, 0x06,
    0xfe, 0x00, 0x48, 0x83, 0xc6, 0x08, 0x48, 0xff, 0xc9, 0x75, 0xf2, 0xe6, 0x88, 0xeb, 0xe1,
];

fn map(len: usize) -> &'static mut [u8] {
    // SAFETY: a fresh anonymous mapping; it is never unmapped (leaked for the program's life),
    // so the VM can use it for as long as it exists.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        std::slice::from_raw_parts_mut(p.cast(), len)
    }
}

/// Any error of the example: it only reports them.
type AnyError = Box<dyn std::error::Error>;

fn main() -> Result<(), AnyError> {
    let kvm = Kvm::new()?;
    let vm = Arc::new(kvm.create_vm()?);
    // Manual protect with INITIALLY_SET: no write-protect storm when logging starts; the first
    // take reports every page (the initial full copy).
    slat_dirty::log::enable_manual_protect(&vm, true)?;
    let (layout, low) = map_low(&vm)?;
    let (ram, slot) = map_ram(&vm)?;
    let mut harvester = Harvester::new(vec![slot], LogMode::ManualProtect { chunk_pages: 64 })?;

    let vcpu = vm.create_vcpu(0)?;
    let mut sregs = vcpu.get_sregs()?;
    layout.setup_long_mode(&mut sregs);
    vcpu.set_sregs(&sregs)?;
    let mut regs = layout.initial_regs();
    regs.r13 = layout.control;
    vcpu.set_regs(&regs)?;
    let mut guest = Guest {
        vcpu,
        low,
        control: layout.control as usize,
    };

    transactional_harvests(&mut harvester, &mut guest, ram)?;
    snapshot_and_reset(&mut harvester, &mut guest, ram)
}

/// Low memory: page tables, GDT, the writer and its control page (not logged).
fn map_low(vm: &VmFd) -> Result<(LowLayout, &'static mut [u8]), AnyError> {
    let layout = LowLayout::new(RAM_GPA + (2 << 20))?;
    let low = map(layout.size as usize);
    layout.build(low)?;
    low[layout.code as usize..][..WRITER.len()].copy_from_slice(&WRITER);
    // SAFETY: `low` is mapped for the rest of the program.
    unsafe {
        vm.set_user_memory_region(kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: low.len() as u64,
            userspace_addr: low.as_ptr() as u64,
        })?
    };
    Ok((layout, low))
}

/// Guest RAM, dirty-logged, registered through the library so its handle knows its size.
fn map_ram(vm: &Arc<VmFd>) -> Result<(&'static mut [u8], Memslot), AnyError> {
    let ram = map((RAM_PAGES * 4096) as usize);
    // SAFETY: `ram` is mapped for the rest of the program and holds only guest memory; the
    // slot is never deleted.
    let slot = unsafe {
        Memslot::register(
            vm,
            kvm_userspace_memory_region {
                slot: 1,
                flags: KVM_MEM_LOG_DIRTY_PAGES,
                guest_phys_addr: RAM_GPA,
                memory_size: ram.len() as u64,
                userspace_addr: ram.as_ptr() as u64,
            },
        )?
    };
    Ok((ram, slot))
}

/// The vCPU running the writer, and where in low memory its control page is.
struct Guest {
    vcpu: VcpuFd,
    low: &'static mut [u8],
    control: usize,
}

impl Guest {
    /// Lists `pages` in the control page and runs one pass of the writer over them.
    fn run(&mut self, pages: &[u64]) -> Result<(), AnyError> {
        let list = &mut self.low[self.control..self.control + 8 * (pages.len() + 1)];
        list[..8].copy_from_slice(&(pages.len() as u64).to_le_bytes());
        for (k, p) in pages.iter().enumerate() {
            list[8 + 8 * k..16 + 8 * k].copy_from_slice(&(RAM_GPA + p * 4096).to_le_bytes());
        }
        // One pass: the writer exits once, at its `out`.
        match self.vcpu.run()? {
            VcpuExit::IoOut(0x88, _) => Ok(()),
            e => Err(format!("unexpected exit {e:?}").into()),
        }
    }
}

fn print(what: &str, set: &slat_dirty::DirtySet<'_>) {
    let runs: Vec<String> = set
        .ranges(0)
        .map(|(first, n)| format!("{first}..{}", first + n))
        .collect();
    println!("{what}: {} pages: [{}]", set.pages(), runs.join(", "));
}

/// Takes, an aborted copy and a committed one.
fn transactional_harvests(
    harvester: &mut Harvester,
    guest: &mut Guest,
    ram: &[u8],
) -> Result<(), AnyError> {
    // The initial copy: every page (INITIALLY_SET).
    let set = harvester.take()?;
    print("initial take", &set);
    set.commit();

    guest.run(&[3, 4, 5, 64, 200])?;
    // A device model wrote page 10 through the VMM (e.g. vm-memory's AtomicBitmap).
    harvester.mark_pages(0, slat_addr::PageIndex::new(10), 1)?;
    let set = harvester.take()?;
    print("take", &set);
    // Suppose the copy fails (the destination went away): dropping the set aborts it.
    drop(set);
    println!("copy failed: set aborted");

    guest.run(&[5, 6, 255])?;
    let set = harvester.take()?;
    print(
        "retake (the aborted pages are back, with the new ones)",
        &set,
    );
    // Copy the pages (here: just read byte 0 of each), then commit.
    let copied: u32 = set
        .ranges(0)
        .flat_map(|(f, n)| f..f + n)
        .map(|p| u32::from(ram[(p * 4096) as usize]))
        .sum();
    println!("copied; sum of byte 0 of the dirty pages: {copied}");
    set.commit();
    let set = harvester.take()?;
    print("after commit", &set);
    set.commit();
    Ok(())
}

/// Snapshot and reset, as a fuzzer loops: re-arm the log (take + commit), copy the RAM
/// once, then after each run copy back only what the guest dirtied — taken (and so
/// re-armed) before the copy, committed after it; a failed copy (`?`) drops the set, which
/// owes its pages to the next take.
fn snapshot_and_reset(
    harvester: &mut Harvester,
    guest: &mut Guest,
    ram: &'static mut [u8],
) -> Result<(), AnyError> {
    harvester.take()?.commit();
    // SAFETY: `ram` stays mapped for the rest of the program; only the vCPU writes it, and
    // never while the snapshot is taken, reset or verified (it runs only inside `Guest::run`);
    // this program no longer touches `ram` itself.
    let region = unsafe { GuestRegion::new(ram.as_mut_ptr(), ram.len() as u64)? };
    let snap = Snapshot::take(vec![region])?;
    let mut dirty = snap.dirty_pages();
    for (run, pages) in [&[1u64, 2, 3][..], &[100, 101, 255], &[3, 7, 64, 65, 66]]
        .into_iter()
        .enumerate()
    {
        guest.run(pages)?;
        let changed = snap.verify().is_err();
        let set = harvester.take()?;
        dirty.add_dirty_set(&set)?;
        let stats = snap.reset(&mut dirty)?;
        set.commit();
        snap.verify()?;
        println!(
            "reset {run}: guest changed memory: {changed}; {} dirty pages copied back; \
             memory equals the snapshot",
            stats.pages
        );
    }
    Ok(())
}
