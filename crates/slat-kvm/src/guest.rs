//! The guest: its code (assembled with iced-x86 at run time), its low-memory layout, its
//! identity page tables and its 64-bit register state.
//!
//! Each vCPU runs one program whose parameters sit in a 128-byte block of the parameter area
//! (register `rdi` points at it on entry). The program loads the block, runs the workload the
//! block's `mode` names, stores what it did back into the block, and leaves with one `out` to
//! [`SYNC_PORT`] (KVM's GUEST_SYNC). When the host re-enters the vCPU, the program starts over
//! from the block, which the host rewrote for the next pass. So there is exactly one exit per
//! pass, and the vCPU's registers are only set once, when it is created.

use crate::error::KvmError;
use crate::histogram;
use iced_x86::code_asm::*;
use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use slat_workload::{ParkMiller, MEMSTRESS_PATTERN};

/// The I/O port the guest writes to at the end of each pass.
pub const SYNC_PORT: u16 = 0x88;

/// Workload selector in a parameter block.
pub const MODE_PASS: u64 = 0;
/// Memstress passes back to back until the halt flag is set.
pub const MODE_LOOP: u64 = 1;
/// The dirty-log writer until the halt flag is set.
pub const MODE_WRITER: u64 = 2;

/// Parameter block fields (byte offsets; all are u64).
pub mod param {
    /// Guest address of the vCPU's region.
    pub const BASE: u64 = 0;
    /// Pages in the region.
    pub const PAGES: u64 = 8;
    /// Normalized Park–Miller start state (`ParkMiller::normalize(seed + idx)`).
    pub const SEED: u64 = 16;
    /// Write percentage, 0–100.
    pub const WRITE_PERCENT: u64 = 24;
    /// 1 = random order.
    pub const RANDOM: u64 = 32;
    /// `MODE_*`.
    pub const MODE: u64 = 40;
    /// Guest address of the control page (halt flag, iteration value).
    pub const CONTROL: u64 = 48;
    /// The constant 100 (a memory divisor: the loop has no register left for it).
    pub const HUNDRED: u64 = 56;
    /// Out: pages touched (writes, for the writer).
    pub const TOUCHED: u64 = 64;
    /// Out: full passes completed.
    pub const PASSES: u64 = 72;
    /// Non-zero: the memstress modes time every write into the histogram at `HIST`.
    pub const TIMED: u64 = 80;
    /// Guest address of the vCPU's histogram page ([`crate::histogram`]); only this vCPU
    /// writes it.
    pub const HIST: u64 = 88;
    /// Accesses per memstress pass (`PassParams::touches`, at most `PAGES`).
    pub const COUNT: u64 = 96;
    /// Bytes per block.
    pub const SIZE: u64 = 128;
}

const _: () = assert!(param::COUNT + 8 <= param::SIZE);

/// Control page fields (byte offsets).
pub mod control {
    /// Non-zero: stop at the next check.
    pub const HALT: u64 = 0;
    /// The value the dirty-log writer stores.
    pub const ITERATION: u64 = 8;
}

/// Where things are in the low memslot (guest physical = guest virtual = offset in the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowLayout {
    /// Global descriptor table (code, data, TSS descriptors).
    pub gdt: u64,
    /// The 64-bit TSS the task register points at (VMX entry needs a usable TR).
    pub tss: u64,
    /// Level-4 table.
    pub pml4: u64,
    /// The one level-3 table (everything lies below 512 GiB).
    pub pdpt: u64,
    /// First level-2 table; `pd_pages` follow.
    pub pd: u64,
    /// Level-2 tables.
    pub pd_pages: u64,
    /// Control page.
    pub control: u64,
    /// First parameter block.
    pub params: u64,
    /// Guest code.
    pub code: u64,
    /// Bytes reserved for the code.
    pub code_len: u64,
    /// vCPU 0's write-latency histogram page ([`crate::histogram`]); vCPU i's is i pages on.
    pub hists: u64,
    /// Top of vCPU 0's stack (each vCPU gets one page below the previous one's).
    pub stacks_top: u64,
    /// Size of the low slot (a multiple of 2 MiB).
    pub size: u64,
}

use slat_addr::PAGE_SIZE as PAGE;
const HUGE_2M: u64 = 2 << 20;
const CODE_LEN: u64 = 2 * PAGE;

impl LowLayout {
    /// The layout for `vcpus` vCPUs whose test region is `[region_start, region_end)` (not
    /// empty). Sizes that overflow are refused with [`KvmError::Config`].
    pub fn new(vcpus: u64, region_start: u64, region_end: u64) -> Result<Self, KvmError> {
        let bad = |what: &str| {
            KvmError::Config(format!(
                "low slot layout for {vcpus} vCPUs and region {region_start:#x}..{region_end:#x}: \
                 {what}"
            ))
        };
        if region_end <= region_start {
            return Err(bad("the region is empty"));
        }
        let first_gib = region_start >> 30;
        let last_gib = (region_end - 1) >> 30;
        // One PD for the low slot's GiB (0) and one per GiB the region touches.
        let pd_pages = 1 + (last_gib - first_gib + 1) - u64::from(first_gib == 0);
        let too_big = || bad("it does not fit a 64-bit address space");
        let pages = |n: u64| n.checked_mul(PAGE).ok_or_else(too_big);
        let param_pages = vcpus
            .checked_mul(param::SIZE)
            .ok_or_else(too_big)?
            .div_ceil(PAGE);
        let gdt = PAGE;
        let tss = gdt + PAGE / 2;
        let pml4 = 2 * PAGE;
        let pdpt = 3 * PAGE;
        let control = 4 * PAGE;
        let params = 5 * PAGE;
        let add = |a: u64, b: u64| a.checked_add(b).ok_or_else(too_big);
        let code = add(params, pages(param_pages)?)?;
        let pd = add(code, CODE_LEN)?;
        let hists = add(pd, pages(pd_pages)?)?;
        let stacks = add(hists, pages(vcpus)?)?;
        let end = add(stacks, pages(vcpus)?)?;
        let size = end.checked_next_multiple_of(HUGE_2M).ok_or_else(too_big)?;
        Ok(LowLayout {
            gdt,
            tss,
            pml4,
            pdpt,
            pd,
            pd_pages,
            control,
            params,
            code,
            code_len: CODE_LEN,
            hists,
            stacks_top: end,
            size,
        })
    }

    /// Guest address of vCPU `i`'s parameter block.
    pub fn param_block(&self, i: usize) -> u64 {
        // Only an address; whoever dereferences it checks it against the low slot.
        self.params
            .wrapping_add((i as u64).wrapping_mul(param::SIZE))
    }

    /// Guest address of vCPU `i`'s histogram page.
    pub fn hist_page(&self, i: usize) -> u64 {
        // Only an address, as for `param_block`.
        self.hists
            .wrapping_add((i as u64).wrapping_mul(histogram::PAGE))
    }
}

const PTE_P: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_US: u64 = 1 << 2;
const PTE_PS: u64 = 1 << 7;

/// The 8 bytes of `mem` at `at`, or a typed error if they are not all inside it.
fn word_at(mem: &mut [u8], at: u64) -> Result<&mut [u8], KvmError> {
    let len = mem.len();
    usize::try_from(at)
        .ok()
        .and_then(|a| mem.get_mut(a..a.checked_add(8)?))
        .ok_or_else(|| {
            KvmError::Config(format!(
                "low slot of {len} bytes has no room for a word at {at:#x}"
            ))
        })
}

fn put(mem: &mut [u8], at: u64, v: u64) -> Result<(), KvmError> {
    word_at(mem, at)?.copy_from_slice(&v.to_le_bytes());
    Ok(())
}

/// Writes the identity page tables into `low` (the host view of the low slot): the low slot
/// and `[region_start, region_end)` mapped with 2 MiB pages, user-accessible (CR4.SMEP and
/// SMAP stay off, so CPL 0 code uses them too). `region_start` must be 2 MiB aligned and the
/// region must end at or below 512 GiB; the tables must fit `l`'s level-2 pages and `low`
/// ([`KvmError::Config`] otherwise).
pub fn build_page_tables(
    low: &mut [u8],
    l: &LowLayout,
    region_start: u64,
    region_end: u64,
) -> Result<(), KvmError> {
    if region_start % HUGE_2M != 0 || region_end <= region_start || region_end > 512 << 30 {
        return Err(KvmError::Config(format!(
            "test region {region_start:#x}..{region_end:#x} must be 2 MiB aligned, not empty, \
             and end at or below 512 GiB"
        )));
    }
    if l.size > 512 << 30 {
        return Err(KvmError::Config(
            "the low slot must end below 512 GiB".into(),
        ));
    }
    put(low, l.pml4, l.pdpt | PTE_P | PTE_RW | PTE_US)?;
    // GiB index (below 512, checked above) -> PD page, allocated in order from `l.pd`.
    let pd_end = l
        .pd_pages
        .checked_mul(PAGE)
        .and_then(|b| l.pd.checked_add(b));
    let mut next_pd = l.pd;
    let mut pd_of = |mem: &mut [u8], gib: u64| -> Result<u64, KvmError> {
        let e = l.pdpt + gib * 8;
        let cur = u64::from_le_bytes(word_at(mem, e)?.try_into().unwrap_or([0; 8]));
        if cur & PTE_P != 0 {
            return Ok(cur & !0xfff);
        }
        let pd = next_pd;
        if pd_end.is_none_or(|end| pd >= end) {
            return Err(KvmError::Config(format!(
                "the layout's {} level-2 tables cannot map the region",
                l.pd_pages
            )));
        }
        next_pd += PAGE;
        put(mem, e, pd | PTE_P | PTE_RW | PTE_US)?;
        Ok(pd)
    };
    let mut map = |mem: &mut [u8], start: u64, end: u64| -> Result<(), KvmError> {
        let mut a = start & !(HUGE_2M - 1);
        while a < end {
            let pd = pd_of(mem, a >> 30)?;
            put(
                mem,
                pd + ((a >> 21) & 511) * 8,
                a | PTE_P | PTE_RW | PTE_US | PTE_PS,
            )?;
            a += HUGE_2M;
        }
        Ok(())
    };
    map(low, 0, l.size)?;
    map(low, region_start, region_end)
}

/// Selector of the 64-bit TSS descriptor (two GDT slots).
const TSS_SELECTOR: u16 = 0x28;
/// Bytes of GDT in use.
const GDT_LEN: u16 = TSS_SELECTOR + 16;

/// Writes the GDT (null; kernel code 0x08 and data 0x10; user data 0x18 and code 0x20, used as
/// 0x1b and 0x23 with RPL 3; 64-bit TSS 0x28) into `low` ([`KvmError::Config`] if it does not
/// fit).
pub fn build_gdt(low: &mut [u8], l: &LowLayout) -> Result<(), KvmError> {
    let at = |off: u64| {
        l.gdt
            .checked_add(off)
            .ok_or_else(|| KvmError::Config("the GDT address overflows".into()))
    };
    put(low, at(0)?, 0)?;
    put(low, at(8)?, 0x00af_9b00_0000_ffff)?; // code: P, DPL 0, S, exec/read, accessed, L, G
    put(low, at(16)?, 0x00cf_9300_0000_ffff)?; // data: P, S, read/write, accessed, D/B, G
    put(low, at(24)?, 0x00cf_f300_0000_ffff)?; // user data: as data, DPL 3
    put(low, at(32)?, 0x00af_fb00_0000_ffff)?; // user code: as code, DPL 3
    let base = l.tss;
    let limit = 0x67u64;
    let lo = (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | (0x8bu64 << 40) // P, type 11 (busy 64-bit TSS)
        | (((limit >> 16) & 0xf) << 48)
        | (((base >> 24) & 0xff) << 56);
    put(low, at(TSS_SELECTOR as u64)?, lo)?;
    put(low, at(TSS_SELECTOR as u64 + 8)?, base >> 32)
}

fn segment(selector: u16, type_: u8, code: bool, dpl: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// The privilege level the workload runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GuestMode {
    /// CPL 3 (user mode), with IOPL 3 so the sync `out` needs no exception. The default: it
    /// runs the same instructions with the same memory semantics as CPL 0, and hypervisors
    /// that run guest supervisor code by emulation or by binary translation (PVM-style
    /// shadow-paging hosts, such as this project's development host) run user code natively.
    #[default]
    User,
    /// CPL 0, like KVM's selftest guests.
    Kernel,
}

/// Puts `sregs` into 64-bit long mode with paging through `l.pml4`, at `mode`'s privilege.
pub fn setup_long_mode(sregs: &mut kvm_sregs, l: &LowLayout, mode: GuestMode) {
    const CR0_PE: u64 = 1;
    const CR0_MP: u64 = 1 << 1;
    const CR0_ET: u64 = 1 << 4;
    const CR0_NE: u64 = 1 << 5;
    const CR0_WP: u64 = 1 << 16;
    const CR0_PG: u64 = 1 << 31;
    const CR4_PAE: u64 = 1 << 5;
    const CR4_OSFXSR: u64 = 1 << 9;
    const CR4_OSXMMEXCPT: u64 = 1 << 10;
    const EFER_LME: u64 = 1 << 8;
    const EFER_LMA: u64 = 1 << 10;
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.cr3 = l.pml4;
    // CR4.TSD (bit 2) stays clear: timed passes execute `rdtsc` at CPL 3, which TSD would
    // turn into a #GP (and, with no IDT, a shutdown).
    sregs.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
    sregs.efer = EFER_LME | EFER_LMA;
    let (code_sel, data_sel, dpl) = match mode {
        GuestMode::Kernel => (0x08, 0x10, 0),
        GuestMode::User => (0x23, 0x1b, 3),
    };
    sregs.cs = segment(code_sel, 0xb, true, dpl);
    let data = segment(data_sel, 0x3, false, dpl);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        base: l.tss,
        limit: 0x67,
        selector: TSS_SELECTOR,
        type_: 0xb,
        present: 1,
        s: 0,
        ..kvm_segment::default()
    };
    sregs.ldt = kvm_segment {
        type_: 0x2,
        present: 1,
        unusable: 1,
        ..kvm_segment::default()
    };
    sregs.gdt.base = l.gdt;
    sregs.gdt.limit = GDT_LEN - 1;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
}

/// The initial general registers of vCPU `i`: interrupts off; at CPL 3, IOPL 3.
pub fn initial_regs(l: &LowLayout, i: usize, mode: GuestMode) -> kvm_regs {
    const RFLAGS_FIXED: u64 = 0x2;
    const RFLAGS_IOPL3: u64 = 3 << 12;
    kvm_regs {
        rip: l.code,
        rdi: l.param_block(i),
        // Only a register value (the layout puts vCPU i's stack there); wrapping keeps a
        // nonsense `i` from panicking.
        rsp: l.stacks_top.wrapping_sub((i as u64).wrapping_mul(PAGE)),
        rflags: RFLAGS_FIXED
            | match mode {
                GuestMode::User => RFLAGS_IOPL3,
                GuestMode::Kernel => 0,
            },
        ..kvm_regs::default()
    }
}

fn asm_err(e: iced_x86::IcedError) -> KvmError {
    KvmError::Assembler(e.to_string())
}

/// Emits `rax = r8 = next Park–Miller state of r8` (clobbers rdx).
///
/// `x = state * 48271 < 2^47`; since `2^31 ≡ 1 (mod 2^31 - 1)`, `x ≡ (x & M) + (x >> 31)`,
/// which is below `2M`, so one conditional subtraction of `M` gives `x mod M` exactly. No `div`,
/// so no register is spent on the modulus.
fn emit_next(a: &mut CodeAssembler) -> Result<(), IcedError> {
    let mut done = a.create_label();
    a.mov(eax, r8d)?;
    a.imul_3(rax, rax, ParkMiller::MULTIPLIER as i32)?;
    a.mov(rdx, rax)?;
    a.shr(rdx, 31)?;
    a.and(eax, ParkMiller::MODULUS as i32)?;
    a.add(rax, rdx)?;
    a.mov(edx, ParkMiller::MODULUS)?;
    a.cmp(rax, rdx)?;
    a.jb(done)?;
    a.sub(rax, rdx)?;
    a.set_label(&mut done)?;
    a.mov(r8, rax)?;
    Ok(())
}

/// Emits `rax = TSC` (clobbers rdx).
fn emit_rdtsc(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    Ok(())
}

/// Emits, at `entry`, the memstress write of `rbp` to `[rcx]` timed with the TSC, the cycles
/// it took added to the histogram at `[rdi + param::HIST]` ([`histogram::bucket`], and the
/// max); then jumps to `done`. Clobbers rax, rcx, rdx; borrows rbx through the stack.
///
/// The window is `lfence; rdtsc; lfence; <store>; lfence; rdtsc`. The first `lfence` keeps
/// the page choice before it out of the window, the second keeps the store from starting
/// before the first read. The third makes the second read wait until the store has *retired*:
/// a store retires only after its translation and permission checks, and a write to a
/// write-protected page faults precisely, before retirement, so the VM exit it causes, the
/// host's handling (including any wait for KVM's MMU lock held by a concurrent harvest) and
/// the store's re-execution all fall inside the window. What stays outside is the store
/// buffer's drain to the cache, which the vCPU does not wait for (an `mfence` would add that
/// memory latency to every sample). `rdtscp` would order the same way on the end side, but
/// needs the guest's CPUID to offer it, clobbers rcx, and still needs an `lfence` to start
/// the window, so plain `rdtsc` serves both ends. It runs at CPL 3 because CR4.TSD is clear
/// ([`setup_long_mode`]), and at CPL 0 regardless.
fn emit_timed_write(
    a: &mut CodeAssembler,
    entry: &mut CodeLabel,
    done: CodeLabel,
) -> Result<(), IcedError> {
    let mut forward = a.create_label();
    let mut not_max = a.create_label();
    let mut have_bucket = a.create_label();
    a.set_label(entry)?;
    a.push(rbx)?;
    a.lfence()?;
    emit_rdtsc(a)?;
    a.lfence()?;
    a.mov(rbx, rax)?;
    a.mov(qword_ptr(rcx), rbp)?;
    a.lfence()?;
    emit_rdtsc(a)?;
    a.sub(rax, rbx)?;
    a.pop(rbx)?;
    // A TSC that went backwards (the vCPU moved to a host CPU whose TSC lags) counts as 0.
    a.jae(forward)?;
    a.xor(eax, eax)?;
    a.set_label(&mut forward)?;
    a.mov(rdx, qword_ptr(rdi + param::HIST))?;
    a.cmp(rax, qword_ptr(rdx + histogram::MAX))?;
    a.jbe(not_max)?;
    a.mov(qword_ptr(rdx + histogram::MAX), rax)?;
    a.set_label(&mut not_max)?;
    // bucket = v below EXACT, else 8 s + (v >> s) with s = msb(v) - 3.
    a.cmp(rax, histogram::EXACT as i32)?;
    a.jb(have_bucket)?;
    a.bsr(rcx, rax)?;
    a.sub(ecx, 3)?;
    a.shr(rax, cl)?;
    a.lea(rax, qword_ptr(rax + rcx * 8))?;
    a.set_label(&mut have_bucket)?;
    a.inc(qword_ptr(rdx + rax * 8 + histogram::COUNTS))?;
    a.jmp(done)?;
    Ok(())
}

/// The entry prologue: loads the pass's parameters into the registers `assemble` names and
/// zeroes the counters.
fn emit_load_params(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.mov(rsi, qword_ptr(rdi + param::BASE))?;
    a.mov(r9, qword_ptr(rdi + param::PAGES))?;
    a.mov(r10, qword_ptr(rdi + param::WRITE_PERCENT))?;
    a.mov(r11, qword_ptr(rdi + param::RANDOM))?;
    a.mov(r12, qword_ptr(rdi + param::MODE))?;
    a.mov(r13, qword_ptr(rdi + param::CONTROL))?;
    a.xor(r15d, r15d)?;
    a.xor(ebx, ebx)?;
    a.mov(rbp, MEMSTRESS_PATTERN)?;
    Ok(())
}

/// MODE_LOOP: every 1024 pages (at page n with n % 1024 == 1023) check the halt flag, and
/// jump to `halted` if it is set.
fn emit_halt_check(a: &mut CodeAssembler, halted: CodeLabel) -> Result<(), IcedError> {
    let mut no_check = a.create_label();
    a.cmp(r12, MODE_LOOP as i32)?;
    a.jne(no_check)?;
    a.mov(eax, r14d)?;
    a.and(eax, 1023)?;
    a.cmp(eax, 1023)?;
    a.jne(no_check)?;
    a.cmp(qword_ptr(r13 + control::HALT), 0)?;
    a.jne(halted)?;
    a.set_label(&mut no_check)?;
    Ok(())
}

/// Leaves in `rcx` the address of the pass's next page: page index `r14`, or PRNG % pages.
fn emit_page_address(a: &mut CodeAssembler) -> Result<(), IcedError> {
    let mut sequential = a.create_label();
    let mut have_page = a.create_label();
    a.test(r11, r11)?;
    a.jz(sequential)?;
    emit_next(a)?;
    a.xor(edx, edx)?;
    a.div(r9)?;
    a.mov(rcx, rdx)?;
    a.jmp(have_page)?;
    a.set_label(&mut sequential)?;
    a.mov(rcx, r14)?;
    a.set_label(&mut have_page)?;
    a.shl(rcx, 12)?;
    a.add(rcx, rsi)?;
    Ok(())
}

/// The dirty-log writer at `entry`: until halted (checked every 64 writes), store the
/// iteration value at page ((next << 31) | next) % pages; then jump to `sync`.
fn emit_writer(
    a: &mut CodeAssembler,
    entry: &mut CodeLabel,
    sync: CodeLabel,
) -> Result<(), IcedError> {
    let mut writer_loop = a.create_label();
    let mut writer_go = a.create_label();
    a.set_label(entry)?;
    a.mov(r8, qword_ptr(rdi + param::SEED))?;
    a.set_label(&mut writer_loop)?;
    a.test(r15, 63)?;
    a.jnz(writer_go)?;
    a.cmp(qword_ptr(r13 + control::HALT), 0)?;
    a.jne(sync)?;
    a.set_label(&mut writer_go)?;
    emit_next(a)?;
    a.mov(rcx, rax)?;
    a.shl(rcx, 31)?;
    emit_next(a)?;
    a.or(rax, rcx)?;
    a.xor(edx, edx)?;
    a.div(r9)?;
    a.shl(rdx, 12)?;
    a.add(rdx, rsi)?;
    a.mov(rax, qword_ptr(r13 + control::ITERATION))?;
    a.mov(qword_ptr(rdx), rax)?;
    a.inc(r15)?;
    a.jmp(writer_loop)?;
    Ok(())
}

/// GUEST_SYNC at `at`: report, exit to the host, start over at `entry` when re-entered.
fn emit_sync(a: &mut CodeAssembler, at: &mut CodeLabel, entry: CodeLabel) -> Result<(), IcedError> {
    a.set_label(at)?;
    a.mov(qword_ptr(rdi + param::TOUCHED), r15)?;
    a.mov(qword_ptr(rdi + param::PASSES), rbx)?;
    a.out(SYNC_PORT as u32, al)?;
    a.jmp(entry)?;
    Ok(())
}

/// Assembles the guest program for address `ip`.
///
/// Registers: `rdi` parameter block, `rsi` region base, `r9` pages, `r8` PRNG state, `r10`
/// write percent, `r11` random flag, `r12` mode, `r13` control page, `r14` page counter of the
/// pass, `r15` pages touched (or writes), `rbx` passes, `rbp` the memstress pattern; `rax`,
/// `rcx`, `rdx` scratch. A timed write borrows `rbx` through the stack.
pub fn assemble(ip: u64) -> Result<Vec<u8>, KvmError> {
    build(ip).map_err(asm_err)
}

// The guest program's listing, read top to bottom like its assembly source; the sections
// that jump only to their own labels (and to labels passed in) are emitted by helpers.
fn build(ip: u64) -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(64)?;
    let mut entry = a.create_label();
    let mut pass_start = a.create_label();
    let mut pass_loop = a.create_label();
    let mut no_halt_check = a.create_label();
    let mut do_read = a.create_label();
    let mut do_write = a.create_label();
    let mut next_page = a.create_label();
    let mut pass_done = a.create_label();
    let mut halted_mid_pass = a.create_label();
    let mut writer = a.create_label();
    let mut sync = a.create_label();
    let mut timed_write = a.create_label();

    a.set_label(&mut entry)?;
    emit_load_params(&mut a)?;
    a.cmp(r12, MODE_WRITER as i32)?;
    a.je(writer)?;

    // ---- memstress: one pass, or passes until halted (MODE_LOOP checks before each pass).
    a.set_label(&mut pass_start)?;
    a.cmp(r12, MODE_LOOP as i32)?;
    a.jne(no_halt_check)?;
    a.cmp(qword_ptr(r13 + control::HALT), 0)?; // MODE_LOOP: halted before this pass?
    a.jne(sync)?;
    a.set_label(&mut no_halt_check)?;
    a.mov(r8, qword_ptr(rdi + param::SEED))?; // the PRNG restarts at every pass
    a.xor(r14d, r14d)?;

    a.set_label(&mut pass_loop)?;
    a.cmp(r14, qword_ptr(rdi + param::COUNT))?;
    a.jae(pass_done)?;
    emit_halt_check(&mut a, halted_mid_pass)?;
    emit_page_address(&mut a)?;
    // Write with probability write_percent: 100 always, 0 never, else PRNG % 100 < percent.
    a.cmp(r10, 100)?;
    a.je(do_write)?;
    a.test(r10, r10)?;
    a.jz(do_read)?;
    emit_next(&mut a)?;
    a.xor(edx, edx)?;
    a.div(qword_ptr(rdi + param::HUNDRED))?;
    a.cmp(rdx, r10)?;
    a.jb(do_write)?;
    a.set_label(&mut do_read)?;
    a.mov(rax, qword_ptr(rcx))?;
    a.jmp(next_page)?;
    a.set_label(&mut do_write)?;
    // All an untimed pass pays for timing: this test, on writes only (an L1-resident word).
    a.cmp(qword_ptr(rdi + param::TIMED), 0)?;
    a.jne(timed_write)?;
    a.mov(qword_ptr(rcx), rbp)?;
    a.set_label(&mut next_page)?;
    a.inc(r14)?;
    a.jmp(pass_loop)?;

    a.set_label(&mut pass_done)?;
    a.add(r15, qword_ptr(rdi + param::COUNT))?;
    a.inc(rbx)?;
    a.cmp(r12, MODE_LOOP as i32)?;
    a.je(pass_start)?;
    a.jmp(sync)?;

    a.set_label(&mut halted_mid_pass)?;
    a.add(r15, r14)?;
    a.jmp(sync)?;

    emit_timed_write(&mut a, &mut timed_write, next_page)?;

    emit_writer(&mut a, &mut writer, sync)?;

    emit_sync(&mut a, &mut sync, entry)?;

    a.assemble(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_assembles_and_fits() {
        let l = LowLayout::new(4, 60 << 30, 64 << 30).unwrap();
        let code = assemble(l.code).unwrap();
        assert!(!code.is_empty() && code.len() as u64 <= l.code_len);
    }

    #[test]
    fn low_layout_covers_tables_and_stacks() {
        let l = LowLayout::new(3, (512 << 30) - (2 << 30), 512 << 30).unwrap();
        // Two GiBs of region plus the low GiB.
        assert_eq!(l.pd_pages, 3);
        assert!(l.stacks_top <= l.size && l.size % HUGE_2M == 0);
        assert!(l.params + 3 * param::SIZE <= l.code);
        // Histogram pages after the level-2 tables, before the lowest stack page.
        assert!(l.pd + l.pd_pages * PAGE <= l.hists);
        assert_eq!(l.hist_page(2) + PAGE, l.stacks_top - 3 * PAGE);
    }

    #[test]
    fn user_mode_may_read_the_tsc() {
        const CR4_TSD: u64 = 1 << 2;
        let l = LowLayout::new(1, 4 << 30, 6 << 30).unwrap();
        for mode in [GuestMode::User, GuestMode::Kernel] {
            let mut sregs = kvm_sregs::default();
            setup_long_mode(&mut sregs, &l, mode);
            assert_eq!(sregs.cr4 & CR4_TSD, 0, "{mode:?}");
        }
    }

    #[test]
    fn page_tables_map_low_and_region() {
        let (start, end) = (5u64 << 30, (5u64 << 30) + (6 << 20));
        let l = LowLayout::new(1, start, end).unwrap();
        let mut low = vec![0u8; l.size as usize];
        build_page_tables(&mut low, &l, start, end).unwrap();
        let get =
            |at: u64| u64::from_le_bytes(low[at as usize..at as usize + 8].try_into().unwrap());
        let walk = |va: u64| -> Option<u64> {
            let e4 = get(l.pml4 + ((va >> 39) & 511) * 8);
            if e4 & PTE_P == 0 {
                return None;
            }
            let e3 = get((e4 & !0xfff) + ((va >> 30) & 511) * 8);
            if e3 & PTE_P == 0 {
                return None;
            }
            let e2 = get((e3 & !0xfff) + ((va >> 21) & 511) * 8);
            (e2 & PTE_P != 0 && e2 & PTE_PS != 0).then_some((e2 & !0x1f_ffff) | (va & 0x1f_ffff))
        };
        assert_eq!(walk(l.code), Some(l.code));
        assert_eq!(walk(start + 0x1234), Some(start + 0x1234));
        assert_eq!(walk(end - 8), Some(end - 8));
        assert_eq!(walk(end), None);
        assert_eq!(walk(4 << 30), None);
    }

    #[test]
    fn bad_layouts_and_buffers_are_typed_errors() {
        // The old code panicked (subtraction overflow, slice index) on each of these.
        assert!(LowLayout::new(1, 4 << 30, 4 << 30).is_err());
        assert!(LowLayout::new(u64::MAX, 0, 1).is_err());
        let l = LowLayout::new(1, 4 << 30, 6 << 30).unwrap();
        let mut small = vec![0u8; 4096];
        assert!(matches!(
            build_gdt(&mut small[..8], &l),
            Err(KvmError::Config(_))
        ));
        assert!(matches!(
            build_page_tables(&mut small, &l, 4 << 30, 6 << 30),
            Err(KvmError::Config(_))
        ));
        let mut low = vec![0u8; l.size as usize];
        // A region the layout's level-2 tables were not sized for, past 512 GiB, unaligned.
        for (s, e) in [
            (0, 8 << 30),
            (511 << 30, 513 << 30),
            (4 << 30 | 4096, 5 << 30),
        ] {
            assert!(
                matches!(
                    build_page_tables(&mut low, &l, s, e),
                    Err(KvmError::Config(_))
                ),
                "{s:#x}..{e:#x}"
            );
        }
        build_page_tables(&mut low, &l, 4 << 30, 6 << 30).unwrap();
        build_gdt(&mut low, &l).unwrap();
    }
}
