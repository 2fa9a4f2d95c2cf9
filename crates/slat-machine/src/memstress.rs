//! KVM's memstress guest workload on a simulated vCPU ([`guest_pass`]); the pattern itself is
//! `slat-workload`'s, shared with the KVM guest and the native baseline.
//!
//! Per pass each vCPU touches each page of its region once — in order, or at pseudo-random
//! pages drawn from a Park–Miller generator seeded with `seed + vcpu index` — writing
//! `0x0123456789ABCDEF` to the first 8 bytes with probability `write_percent`, else reading
//! them. The host waits until every vCPU has finished the pass (KVM's GUEST_SYNC).

use crate::cpu::{Cpu, Exit};
use slat::PteFormat;
use slat_addr::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) use slat_workload::pattern::{
    ParkMiller, PassParams, Pattern, WriterPattern, MEMSTRESS_PATTERN,
};

/// Runs one memstress pass of vCPU `vcpu_idx` over `pages` pages starting at `gpa`; with
/// `halt`, stops early once it is set (checked every 1024 pages). Returns the pages touched.
/// A timed pass ([`PassParams::timed`]) times its faulting writes; the caller started the
/// vCPU's timing ([`Cpu::start_timing`]).
pub fn guest_pass<F: PteFormat>(
    cpu: &mut Cpu<F>,
    gpa: u64,
    pages: u64,
    params: PassParams,
    vcpu_idx: u32,
    halt: Option<&AtomicBool>,
) -> Result<u64, Exit> {
    // Chosen once per pass, so an untimed pass's loop does not test it per write.
    if params.timed {
        pass::<F, true>(cpu, gpa, pages, params, vcpu_idx, halt)
    } else {
        pass::<F, false>(cpu, gpa, pages, params, vcpu_idx, halt)
    }
}

fn pass<F: PteFormat, const TIMED: bool>(
    cpu: &mut Cpu<F>,
    gpa: u64,
    pages: u64,
    params: PassParams,
    vcpu_idx: u32,
    halt: Option<&AtomicBool>,
) -> Result<u64, Exit> {
    let mut touched = 0;
    for (n, (page, write)) in Pattern::new(params, vcpu_idx, pages).enumerate() {
        touched = n as u64 + 1;
        if n % 1024 == 1023 && halt.is_some_and(|h| h.load(Ordering::Relaxed)) {
            return Ok(n as u64);
        }
        let a = gpa + page * PAGE_SIZE;
        if write && TIMED {
            cpu.write_u64_timed(a, MEMSTRESS_PATTERN)?;
        } else if write {
            cpu.write_u64(a, MEMSTRESS_PATTERN)?;
        } else {
            std::hint::black_box(cpu.read_u64(a)?);
        }
    }
    Ok(touched)
}
