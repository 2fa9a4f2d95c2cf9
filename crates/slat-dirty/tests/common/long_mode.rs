//! The smallest 64-bit guest setup the tests and the `vmm` example need, written for them so
//! that `slat-dirty` has no dependency (not even a dev-dependency) on slat's benchmark guest:
//! one vCPU at CPL 3 with IOPL 3 (so its `out` exits without an IDT), an identity map of 2 MiB
//! pages over the low slot and the test region, a GDT with flat 64-bit segments and a TSS.
//!
//! The low slot (guest-physical 0, 2 MiB, not logged):
//!
//! ```text
//! 0x1000  GDT (null, kernel code/data, user data 0x1b, user code 0x23, TSS 0x28); TSS at 0x1800
//! 0x2000  level-4 table        0x3000  level-3 table
//! 0x4000  control page (the guest's r13)
//! 0x5000  guest code           0x6000  stack page (grows down from 0x7000)
//! 0x7000  level-2 tables, one per GiB mapped
//! ```
//!
//! User mode, because some hosts (PVM-style shadow paging, as on this project's development
//! host) emulate guest supervisor code instruction by instruction but run user code natively.

#![allow(dead_code)]

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};

use slat_addr::PAGE_SIZE as PAGE;
const HUGE_2M: u64 = 2 << 20;
const GIB: u64 = 1 << 30;
const PTE_P: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_US: u64 = 1 << 2;
const PTE_PS: u64 = 1 << 7;
const TSS_SELECTOR: u16 = 0x28;

/// Where the setup lives in the low slot.
#[derive(Debug, Clone, Copy)]
pub struct LowLayout {
    /// The GDT.
    pub gdt: u64,
    /// The 64-bit TSS.
    pub tss: u64,
    /// The level-4 table (CR3).
    pub pml4: u64,
    /// The one level-3 table.
    pub pdpt: u64,
    /// The first level-2 table.
    pub pd: u64,
    /// The control page the guest code reads (its `r13`).
    pub control: u64,
    /// The guest code (one page).
    pub code: u64,
    /// The top of the stack page.
    pub stack_top: u64,
    /// Bytes of the low slot.
    pub size: u64,
    /// End of the identity map (whole GiBs).
    map_end: u64,
}

impl LowLayout {
    /// A layout whose identity map covers `[0, region_end)` (rounded up to whole GiBs, at most
    /// 64 GiB, so the tables fit the 2 MiB low slot).
    pub fn new(region_end: u64) -> Result<LowLayout, String> {
        let gibs = region_end.div_ceil(GIB).max(1);
        if gibs > 64 {
            return Err(format!(
                "a test region ending at {region_end:#x} (at most 64 GiB)"
            ));
        }
        Ok(LowLayout {
            gdt: PAGE,
            tss: PAGE + PAGE / 2,
            pml4: 2 * PAGE,
            pdpt: 3 * PAGE,
            control: 4 * PAGE,
            code: 5 * PAGE,
            stack_top: 7 * PAGE,
            pd: 7 * PAGE,
            size: HUGE_2M,
            map_end: gibs * GIB,
        })
    }

    /// Writes the page tables and the GDT into `low` (the low slot's memory).
    pub fn build(&self, low: &mut [u8]) -> Result<(), String> {
        if (low.len() as u64) < self.size {
            return Err(format!("a low slot of {} bytes", low.len()));
        }
        let mut put = |at: u64, v: u64| low[at as usize..][..8].copy_from_slice(&v.to_le_bytes());
        put(self.pml4, self.pdpt | PTE_P | PTE_RW | PTE_US);
        for gib in 0..self.map_end / GIB {
            let pd = self.pd + gib * PAGE;
            put(self.pdpt + gib * 8, pd | PTE_P | PTE_RW | PTE_US);
            for i in 0..512 {
                let a = gib * GIB + i * HUGE_2M;
                put(pd + i * 8, a | PTE_P | PTE_RW | PTE_US | PTE_PS);
            }
        }
        // Descriptors: null; kernel code, kernel data; user data, user code (DPL 3); TSS.
        let descriptors = [
            0,
            0x00af_9b00_0000_ffff,
            0x00cf_9300_0000_ffff,
            0x00cf_f300_0000_ffff,
            0x00af_fb00_0000_ffff,
        ];
        for (k, d) in descriptors.iter().enumerate() {
            put(self.gdt + 8 * k as u64, *d);
        }
        let (base, limit) = (self.tss, 0x67u64);
        let tss_lo =
            limit | ((base & 0xff_ffff) << 16) | (0x8b << 40) | ((base >> 24) & 0xff) << 56;
        put(self.gdt + TSS_SELECTOR as u64, tss_lo);
        put(self.gdt + TSS_SELECTOR as u64 + 8, base >> 32);
        Ok(())
    }

    /// Puts `sregs` into 64-bit long mode at CPL 3, paging through this layout's tables.
    pub fn setup_long_mode(&self, sregs: &mut kvm_sregs) {
        // CR0: PE, MP, ET, NE, WP, PG. CR4: PAE, OSFXSR, OSXMMEXCPT. EFER: LME, LMA.
        sregs.cr0 = 1 | 1 << 1 | 1 << 4 | 1 << 5 | 1 << 16 | 1 << 31;
        sregs.cr3 = self.pml4;
        sregs.cr4 = 1 << 5 | 1 << 9 | 1 << 10;
        sregs.efer = 1 << 8 | 1 << 10;
        let seg = |selector: u16, type_: u8, code: bool| kvm_segment {
            base: 0,
            limit: 0xffff_ffff,
            selector,
            type_,
            present: 1,
            dpl: 3,
            db: u8::from(!code),
            s: 1,
            l: u8::from(code),
            g: 1,
            ..kvm_segment::default()
        };
        sregs.cs = seg(0x23, 0xb, true);
        let data = seg(0x1b, 0x3, false);
        (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
        sregs.tr = kvm_segment {
            base: self.tss,
            limit: 0x67,
            selector: TSS_SELECTOR,
            type_: 0xb,
            present: 1,
            ..kvm_segment::default()
        };
        sregs.ldt = kvm_segment {
            type_: 0x2,
            present: 1,
            unusable: 1,
            ..kvm_segment::default()
        };
        sregs.gdt.base = self.gdt;
        sregs.gdt.limit = TSS_SELECTOR + 15;
        sregs.idt.base = 0;
        sregs.idt.limit = 0;
    }

    /// The first general registers: at the code, `r13` the control page, interrupts off, IOPL 3.
    pub fn initial_regs(&self) -> kvm_regs {
        kvm_regs {
            rip: self.code,
            rsp: self.stack_top,
            r13: self.control,
            rflags: 0x2 | 3 << 12,
            ..kvm_regs::default()
        }
    }
}
