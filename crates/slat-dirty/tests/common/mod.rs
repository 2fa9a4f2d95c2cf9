//! A tiny VM built the way a VMM would, with `kvm-ioctls` and memory mapped here: one vCPU in
//! 64-bit user mode (page tables and GDT from `long_mode.rs`) running a writer that
//! increments byte 0 of each page of a list the host puts in the control page, then exits
//! with `out`. So the host decides exactly which pages are written, and when.

#![allow(dead_code)]

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use slat_dirty::log::{DirtyRing, RingSize};
use slat_dirty::{Harvester, LogMode, Memslot};
pub mod long_mode;

use long_mode::LowLayout;
use std::sync::Arc;

/// Guest physical address of the test region (two logged slots).
pub const REGION: u64 = 1 << 30;
/// Pages of the two logged slots: not multiples of 64, so words and slots end mid-word.
pub const SLOT_PAGES: [u64; 2] = [520, 70];
/// Guest physical address of each logged slot.
pub const SLOT_GPA: [u64; 2] = [REGION, REGION + (4 << 20)];
const REGION_END: u64 = REGION + (6 << 20);
/// Most pages one pass writes (the control page holds a count and the addresses).
pub const MAX_LIST: usize = 511;
/// The port the writer's `out` uses.
const PORT: u16 = 0x88;

/// Anonymous shared memory of this process, unmapped on drop.
pub struct Mapping {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Mapping {
    pub fn new(len: usize) -> Mapping {
        // SAFETY: a new anonymous mapping at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        Mapping { ptr: p.cast(), len }
    }

    /// The mapping as bytes. The guest may write it concurrently only while a vCPU runs, and
    /// the vCPU here runs only inside `TinyVm::pass`, which holds `&mut` of the VM.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped by `new`, alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` is the only access from this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping `new` created.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// How the VM logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    Get,
    Manual {
        chunk_pages: u64,
        initially_set: bool,
    },
    Ring {
        entries: u32,
    },
}

pub struct TinyVm {
    // Field order is drop order: the harvester (slot handles, rings) and the vCPU go before
    // the VM fd, and all of them before the memory.
    pub harvester: Harvester,
    pub vcpu: VcpuFd,
    pub vm: Arc<VmFd>,
    pub layout: LowLayout,
    pub low: Mapping,
    pub slots: Vec<Mapping>,
}

/// True (after saying so) when /dev/kvm cannot be opened.
pub fn kvm_unavailable() -> bool {
    match Kvm::new() {
        Ok(_) => false,
        Err(e) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            true
        }
    }
}

/// The writer: `rcx = [r13]`, then `inc byte [addr]` for each address at `r13 + 8..`,
/// `out 0x88, al`, start over.
const WRITER: [u8; 31] = [
    0x49, 0x8b, 0x4d, 0x00, // mov rcx, [r13]
    0x49, 0x8d, 0x75, 0x08, // lea rsi, [r13 + 8]
    0x48, 0x85, 0xc9, // test rcx, rcx
    0x74, 0x0e, // jz done
    0x48, 0x8b, 0x06, // next: mov rax, [rsi]
    0xfe, 0x00, // inc byte [rax]
    0x48, 0x83, 0xc6, 0x08, // add rsi, 8
    0x48, 0xff, 0xc9, // dec rcx
    0x75, 0xf2, // jnz next
    0xe6, 0x88, // done: out 0x88, al
    0xeb, 0xe1, // jmp 0
];

/// The concurrent writer: until the halt flag (`[r13 + 8]`) is set, pass after pass, stores
/// the pass number (`rbx`, from 1) into the first 8 bytes of each page listed at `r13 + 16..`
/// (`[r13]` of them, at least one); then `out 0x88, al`.
const LOOPING_WRITER: [u8; 37] = [
    0x49, 0x8b, 0x4d, 0x00, // mov rcx, [r13]
    0x49, 0x8d, 0x75, 0x10, // lea rsi, [r13 + 16]
    0x48, 0xff, 0xc3, // inc rbx
    0x48, 0x8b, 0x06, // next: mov rax, [rsi]
    0x48, 0x89, 0x18, // mov [rax], rbx
    0x48, 0x83, 0xc6, 0x08, // add rsi, 8
    0x48, 0xff, 0xc9, // dec rcx
    0x75, 0xf1, // jnz next
    0x49, 0x83, 0x7d, 0x08, 0x00, // cmp qword [r13 + 8], 0
    0x74, 0xdf, // je 0
    0xe6, 0x88, // out 0x88, al
    0xeb, 0xdb, // jmp 0
];

/// Most pages the looping writer's list holds.
pub const MAX_LOOP_LIST: usize = 510;

impl TinyVm {
    /// Replaces the guest code with the looping writer over `pages`, halt flag clear.
    pub fn load_looping_writer(&mut self, pages: &[(usize, u64)]) {
        assert!(!pages.is_empty() && pages.len() <= MAX_LOOP_LIST);
        let code = self.layout.code as usize;
        let ctl = self.layout.control as usize;
        let low = self.low.bytes_mut();
        low[code..code + LOOPING_WRITER.len()].copy_from_slice(&LOOPING_WRITER);
        low[ctl..ctl + 8].copy_from_slice(&(pages.len() as u64).to_le_bytes());
        low[ctl + 8..ctl + 16].copy_from_slice(&0u64.to_le_bytes());
        for (k, &(s, p)) in pages.iter().enumerate() {
            let at = ctl + 16 + 8 * k;
            low[at..at + 8].copy_from_slice(&(SLOT_GPA[s] + p * 4096).to_le_bytes());
        }
        let mut regs = self.layout.initial_regs();
        regs.r13 = self.layout.control;
        self.vcpu.set_regs(&regs).unwrap();
    }

    /// The VM, logging set up as `setup`, or `None` without /dev/kvm.
    pub fn new(setup: Setup) -> Option<TinyVm> {
        if kvm_unavailable() {
            return None;
        }
        let kvm = Kvm::new().unwrap();
        let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
        let layout = LowLayout::new(REGION_END).unwrap();
        let mut low = Mapping::new(layout.size as usize);
        layout.build(low.bytes_mut()).unwrap();
        let code = layout.code as usize;
        low.bytes_mut()[code..code + WRITER.len()].copy_from_slice(&WRITER);
        let region = |slot, gpa, m: &Mapping, flags| kvm_userspace_memory_region {
            slot,
            flags,
            guest_phys_addr: gpa,
            memory_size: m.len as u64,
            userspace_addr: m.ptr as u64,
        };
        // SAFETY: `low` is mapped for as long as the VM (dropped before it, field order).
        unsafe { vm.set_user_memory_region(region(0, 0, &low, 0)) }.unwrap();
        match setup {
            Setup::Manual { initially_set, .. } => {
                slat_dirty::log::enable_manual_protect(&vm, initially_set).unwrap()
            }
            Setup::Ring { entries } => {
                let size = RingSize::from_entries(entries).unwrap();
                slat_dirty::log::enable_dirty_ring(&vm, size, false).unwrap();
            }
            Setup::Get => {}
        }
        let mut maps = Vec::new();
        let mut handles = Vec::new();
        for (i, (&pages, &gpa)) in SLOT_PAGES.iter().zip(&SLOT_GPA).enumerate() {
            let m = Mapping::new(pages as usize * 4096);
            // SAFETY: `m` is a fresh mapping of exactly this size that outlives the VM (field
            // order of `TinyVm`); the slot is never deleted while its handle lives.
            let s = unsafe {
                Memslot::register(&vm, region(i as u32 + 1, gpa, &m, KVM_MEM_LOG_DIRTY_PAGES))
            }
            .unwrap();
            handles.push(s);
            maps.push(m);
        }
        let vcpu = vm.create_vcpu(0).unwrap();
        let mut sregs = vcpu.get_sregs().unwrap();
        layout.setup_long_mode(&mut sregs);
        vcpu.set_sregs(&sregs).unwrap();
        let mut regs = layout.initial_regs();
        regs.r13 = layout.control;
        vcpu.set_regs(&regs).unwrap();
        let harvester = match setup {
            Setup::Get => Harvester::new(handles, LogMode::Get).unwrap(),
            Setup::Manual { chunk_pages, .. } => {
                Harvester::new(handles, LogMode::ManualProtect { chunk_pages }).unwrap()
            }
            Setup::Ring { entries } => {
                let size = RingSize::from_entries(entries).unwrap();
                let ring = DirtyRing::map(&vcpu, size).unwrap();
                Harvester::with_rings(handles, vec![ring]).unwrap()
            }
        };
        Some(TinyVm {
            harvester,
            vcpu,
            vm,
            layout,
            low,
            slots: maps,
        })
    }

    /// Runs one pass of the writer over `pages` (see [`pass_with`]); a full ring is collected
    /// into the harvester's pages owed.
    pub fn pass(&mut self, pages: &[(usize, u64)]) -> u32 {
        let h = &mut self.harvester;
        pass_with(
            &mut self.vcpu,
            &mut self.low,
            self.layout.control,
            pages,
            || {
                h.collect().unwrap();
            },
        )
    }

    /// Byte 0 of page `page` of logged slot `slot`, as the host sees it.
    pub fn byte(&self, slot: usize, page: u64) -> u8 {
        self.slots[slot].bytes()[page as usize * 4096]
    }
}

/// Runs one pass of the writer over `pages` (`(slot index, page)`, at most [`MAX_LIST`]),
/// calling `on_full` on each `KVM_EXIT_DIRTY_RING_FULL` before re-entering. Returns how many
/// ring-full exits there were.
pub fn pass_with(
    vcpu: &mut VcpuFd,
    low: &mut Mapping,
    control: u64,
    pages: &[(usize, u64)],
    mut on_full: impl FnMut(),
) -> u32 {
    assert!(pages.len() <= MAX_LIST);
    let ctl = control as usize;
    let low = low.bytes_mut();
    low[ctl..ctl + 8].copy_from_slice(&(pages.len() as u64).to_le_bytes());
    for (k, &(s, p)) in pages.iter().enumerate() {
        assert!(p < SLOT_PAGES[s]);
        let gpa = SLOT_GPA[s] + p * 4096;
        let at = ctl + 8 + 8 * k;
        low[at..at + 8].copy_from_slice(&gpa.to_le_bytes());
    }
    let mut full = 0;
    loop {
        match vcpu.run().expect("KVM_RUN") {
            VcpuExit::IoOut(PORT, _) => return full,
            VcpuExit::Unsupported(r) if r == kvm_bindings::KVM_EXIT_DIRTY_RING_FULL => {
                full += 1;
                on_full();
            }
            e => panic!("unexpected exit {e:?}"),
        }
    }
}

/// The first 8 bytes of page `page` of `m`, read while the guest may be writing them.
pub fn read_word(m: &Mapping, page: u64) -> u64 {
    let off = page as usize * 4096;
    assert!(off + 8 <= m.len);
    // SAFETY: inside the mapping (checked), 8-aligned (page aligned); a volatile read, since
    // the guest may store to it concurrently (an aligned 8-byte store is not torn on x86-64).
    unsafe { m.ptr.add(off).cast::<u64>().read_volatile() }
}

/// Sets the looping writer's halt flag.
pub fn set_halt(low: &mut Mapping, control: u64) {
    let at = control as usize + 8;
    assert!(at + 8 <= low.len);
    // SAFETY: inside the mapping (checked), 8-aligned; volatile since the guest polls it.
    unsafe { low.ptr.add(at).cast::<u64>().write_volatile(1) }
}
