//! slat's host backend: KVM's memstress and dirty-log workloads run as real guests on
//! `/dev/kvm`, with the same semantics as the simulated machine in `slat-machine`, so a
//! benchmark can run on either and compare them.
//!
//! Built on the rust-vmm crates (`kvm-ioctls`, `kvm-bindings`; `vmm-sys-util` for the dirty-log
//! ioctls `kvm-ioctls` does not wrap). The guest code is assembled at run time with iced-x86
//! ([`guest`]), so it reads as instructions.
//!
//! # The guest
//!
//! Every vCPU starts directly in 64-bit long mode (no firmware, no real mode): CR0.PG, CR4.PAE,
//! EFER.LME|LMA, flat 64-bit code and data segments from a small GDT, a TSS for the task
//! register, interrupts off and no IDT (the workload never faults: an exception would shut the
//! guest down, which the host reports as an unexpected exit). Paging is an identity map
//! (guest virtual = guest physical) built from 2 MiB pages, which every x86-64 CPU has (1 GiB
//! pages are optional); it costs one level-2 table per GiB mapped.
//!
//! The workload runs at CPL 3 by default ([`GuestMode::User`], IOPL 3 so its `out` is legal):
//! the instructions and memory accesses are the same as at CPL 0, but hypervisors that cannot
//! run guest supervisor code natively run user code natively. On this project's development
//! host (KVM with PVM-style shadow paging, no VMX/SVM) CPL 0 code is emulated instruction by
//! instruction (`insn_emulation` ≈ 14 per page, about 10 µs per page), while CPL 3 code runs at
//! native speed (a 1 GiB write pass over mapped memory takes ~4 ms). [`GuestMode::Kernel`]
//! keeps the selftests' CPL 0.
//!
//! Guest physical memory, like KVM's memstress:
//!
//! ```text
//! 0                 low slot (id 0, 2 MiB or more, never dirty-logged)
//!   0x1000          GDT, TSS
//!   0x2000          level-4 table, then the one level-3 table
//!   0x4000          control page: halt flag, writer's iteration value
//!   0x5000          one 128-byte parameter block per vCPU
//!   ...             guest code, level-2 tables, one write-latency histogram page per vCPU,
//!                   one stack page per vCPU
//! ...               (unmapped hole)
//! gpa               test region: slots FIRST_SLOT.. of equal size, vCPU i's partition at
//!                   gpa + i * bytes_per_vcpu (or all of it with overlap)
//! 2^min(39, MAXPHYADDR) - 4 KiB   end of the test region (rounded down to 2 MiB)
//! ```
//!
//! The test region sits at the top of guest physical memory as in the selftests, so code and
//! page tables never share a memslot (or a dirty bitmap) with it. The top is capped at 2^39
//! ([`MAX_GPA_BITS`]): below it every address lies under one level-4 entry, so one level-3
//! table maps all of it, and it is below the physical-address width of every x86-64 host
//! (39 bits on the smallest), so the guest's page tables never hold an address with reserved
//! bits set — which matters most under shadow paging (this project's nested development host
//! has no TDP), where KVM walks the guest's tables itself. 2^39 leaves room for ~500 GiB of
//! test memory.
//!
//! # Host and guest protocol
//!
//! One thread per vCPU owns its vCPU fd. The host writes each vCPU's parameter block, releases
//! the threads at a barrier, and each calls `KVM_RUN` until the guest's `out` to
//! [`guest::SYNC_PORT`] (GUEST_SYNC): one exit per pass. The workloads that run until halted
//! poll the control page's halt flag (every 1024 pages for [`Workload::Loop`], every 64 writes
//! for [`Workload::Writer`], as the simulated machine does). On `KVM_EXIT_DIRTY_RING_FULL` the
//! vCPU thread harvests and resets the rings itself and re-enters.
//!
//! A timed pass ([`PassParams::timed`](slat_workload::PassParams::timed)) has the guest time each of its memstress writes with
//! the TSC into a histogram page of its own ([`histogram`]); after the sync the host converts
//! it into nanoseconds with the frequency `KVM_GET_TSC_KHZ` reports, one histogram per vCPU in
//! [`PassReport::latency`](slat_workload::PassReport::latency).
//!
//! # Errors
//!
//! Everything returns [`KvmError`]: a missing `/dev/kvm` names the device and the fix; a
//! missing capability names it (`KVM_CAP_DIRTY_LOG_RING not supported by this host kernel`).

#![deny(missing_docs)]

pub mod error;
pub mod guest;
pub mod histogram;
pub mod machine;
pub mod stats;

pub use error::KvmError;
pub use guest::GuestMode;
pub use machine::{
    host_caps, HostCaps, KvmConfig, KvmCounters, KvmMachine, PassReport, VcpuPass, Workload,
    DEFAULT_DEVICE, LOW_SLOT, MAX_GPA_BITS,
};
