//! The vCPU threads: each runs its vCPU once per job and reports the pass.

use super::{lock, Control, Rings, VcpuPass};
use crate::guest::{param, SYNC_PORT};
use kvm_bindings::KVM_EXIT_DIRTY_RING_FULL;
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};
use slat_dirty::log as dirty;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub(super) struct VcpuContext {
    pub(super) idx: usize,
    pub(super) vcpu: VcpuFd,
    pub(super) ctl: Arc<Control>,
    pub(super) rings: Arc<Mutex<Rings>>,
    pub(super) vm: Arc<VmFd>,
    /// Host address of this vCPU's parameter block.
    pub(super) block: u64,
    pub(super) regs: kvm_bindings::kvm_regs,
}

impl VcpuContext {
    fn out(&self, field: u64) -> u64 {
        // SAFETY: the block lies in the low mapping, which outlives the vCPU threads (the
        // machine joins them before unmapping); the guest is out of guest mode (it synced).
        unsafe { AtomicU64::from_ptr((self.block + field) as *mut u64) }.load(Ordering::Relaxed)
    }

    /// What a vCPU does on `KVM_EXIT_DIRTY_RING_FULL`, like QEMU's vCPU thread when the reaper
    /// lags: harvest every ring into the machine's reaped list, then reset them.
    fn ring_full(&self) -> Result<(), String> {
        let mut r = lock(&self.rings);
        let Rings { rings, reaped } = &mut *r;
        for (i, ring) in rings.iter_mut().enumerate() {
            ring.harvest(|s, o| reaped.push((i, s, o)));
        }
        dirty::reset_dirty_rings(&self.vm)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Runs the guest until it syncs.
    fn run(&mut self) -> Result<VcpuPass, String> {
        let mut p = VcpuPass::default();
        let t0 = Instant::now();
        loop {
            p.counters.entries += 1;
            let exit = match self.vcpu.run() {
                Ok(VcpuExit::IoOut(port, _)) if port == SYNC_PORT => break,
                Ok(VcpuExit::Unsupported(r)) if r == KVM_EXIT_DIRTY_RING_FULL => {
                    p.ring_full_exits += 1;
                    self.ring_full()?;
                    continue;
                }
                Ok(e) => format!("{e:?}"),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => format!("KVM_RUN failed: {e}"),
            };
            let rip = self
                .vcpu
                .get_regs()
                .map_or_else(|_| "unknown".to_string(), |r| format!("{:#x}", r.rip));
            return Err(format!("{exit} at RIP {rip}"));
        }
        p.time = t0.elapsed();
        p.pages = self.out(param::TOUCHED);
        p.passes = self.out(param::PASSES);
        Ok(p)
    }
}

pub(super) fn vcpu_thread(mut ctx: VcpuContext) {
    let mut broken = false;
    while ctx.ctl.next_job().is_some() {
        if broken {
            // The last run ended somewhere in the guest: start the program over.
            broken = ctx.vcpu.set_regs(&ctx.regs).is_err();
        }
        let r = if broken {
            Err("cannot reset the vCPU's registers after an earlier failure".to_string())
        } else {
            ctx.run()
        };
        broken = r.is_err();
        // `idx` is this thread's own index, below the count the rendezvous was built for.
        let _ = ctx.ctl.report(ctx.idx, r);
    }
}
