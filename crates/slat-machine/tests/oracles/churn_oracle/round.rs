//! A round.

use super::*;

/// What a round did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RoundOut {
    pub(crate) host: HostOut,
    pub(crate) churn: ChurnOut,
    pub(crate) vcpu: VcpuOut,
    pub(crate) sim: SimOut,
}

pub(crate) fn new_vm<F: PteFormat>(cfg: &RoundCfg) -> Result<Arc<Vm<F>>, Failure> {
    let vm = Vm::<F>::new(cfg.vm);
    match cfg.log {
        LogMode::Get => {}
        LogMode::Clear { initially_set } => {
            let flags = MANUAL_PROTECT_ENABLE | if initially_set { INITIALLY_SET } else { 0 };
            vm.set_manual_dirty_log_protect(flags).map_err(other)?;
        }
        LogMode::Ring { entries } => vm.enable_dirty_ring(entries, false).map_err(other)?,
    }
    Ok(vm)
}

/// Guest memory of several memslots.
pub(crate) type Rams = Vec<Arc<GuestRam>>;

/// Read-only memory holding `ro_pattern` in the first word of each page.
pub(crate) fn ro_ram(i: u64) -> Result<Arc<GuestRam>, Failure> {
    let ram = GuestRam::new(Backing::Anonymous, RO_BYTES, true).map_err(other)?;
    for q in 0..RO_BYTES / PAGE_SIZE {
        word(&ram, q, 0).store(ro_pattern(i, q), Ordering::Relaxed);
    }
    Ok(Arc::new(ram))
}

/// Guest memory and memslots: the checked slots and the auxiliary slot (logging off for now),
/// and every read-only slot.
pub(crate) fn add_slots<F: PteFormat>(vm: &Vm<F>, cfg: &RoundCfg) -> Result<(Rams, Rams), Failure> {
    let ram = |bytes| {
        GuestRam::new(cfg.backing, bytes, true)
            .map(Arc::new)
            .map_err(other)
    };
    let rams = (0..CHECKED)
        .map(|_| ram(CHECKED_BYTES))
        .collect::<Result<Vec<_>, _>>()?;
    for (s, r) in rams.iter().enumerate() {
        let host = HostRange::new(r.clone()).map_err(other)?;
        vm.add_memslot(
            checked_id(s),
            Gpa::new(checked_gpa(s, 0)),
            CHECKED_BYTES,
            host,
            MemslotFlags::empty(),
        )
        .map_err(other)?;
    }
    let aux = HostRange::new(ram(AUX_BYTES)?).map_err(other)?;
    vm.add_memslot(
        AUX_ID,
        Gpa::new(aux_gpa(0)),
        AUX_BYTES,
        aux,
        MemslotFlags::empty(),
    )
    .map_err(other)?;
    let ro = (0..RO_SLOTS).map(ro_ram).collect::<Result<Vec<_>, _>>()?;
    for (i, r) in ro.iter().enumerate() {
        let host = HostRange::new(r.clone()).map_err(other)?;
        let id = RO_FIRST + i as SlotId;
        vm.add_memslot(
            id,
            Gpa::new(ro_gpa(i as u64)),
            RO_BYTES,
            host,
            MemslotFlags::READONLY,
        )
        .map_err(other)?;
    }
    Ok((rams, ro))
}

pub(crate) fn start_vcpus<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    sh: &Arc<Shared>,
    cfg: &RoundCfg,
    rsim: &RoundSim,
) -> Result<Vec<JoinHandle<VcpuOut>>, Failure> {
    // In virtual time every vCPU has a physical CPU of its own: a pool wait would block a
    // simulated CPU in the operating system.
    let pcpus = match F::Clock::VIRTUAL {
        true => cfg.vcpus,
        false => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let pool = Arc::new(PcpuPool::new(pcpus));
    let mut handles = Vec::new();
    for v in 0..cfg.vcpus {
        let mut cpu =
            Cpu::new(vm.clone(), v as u32, cfg.tlb_entries, pool.clone()).expect("TLB size");
        if let LogMode::Ring { .. } = cfg.log {
            cpu.set_ring_full_handler(ring_full_handler(vm, sh));
        }
        let g = Guest {
            cpu,
            v,
            sh: sh.clone(),
            rng: Rng::new(cfg.seed ^ mix(v as u64 + 1)),
            seq: 0,
            mine: vec![0; TOTAL],
            out: VcpuOut::default(),
        };
        let started = rsim
            .register(&format!("vcpu{v}"))
            .and_then(|t| spawn(format!("churn-vcpu{v}"), t, move || g.run()));
        match started {
            Ok(h) => handles.push(h),
            Err(e) => {
                sh.stop.store(true, Ordering::SeqCst);
                rsim.outside(|| handles.into_iter().for_each(|h| drop(h.join())));
                return Err(e);
            }
        }
    }
    Ok(handles)
}

pub(crate) fn start_churn<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    sh: &Arc<Shared>,
    cfg: &RoundCfg,
    ro_rams: Vec<Arc<GuestRam>>,
    rsim: &RoundSim,
) -> Result<JoinHandle<ChurnOut>, Failure> {
    let c = Churner {
        vm: vm.clone(),
        sh: sh.clone(),
        cfg: *cfg,
        rng: Rng::new(cfg.seed ^ 0xc4u64),
        ro_rams,
        ro_present: [true; RO_SLOTS as usize],
        aux_pos: 0,
        aux_logging: false,
        checked_pos: [0; CHECKED],
        out: ChurnOut::default(),
    };
    let cpu = rsim.register("churn")?;
    spawn("churn".into(), cpu, move || c.run())
}

/// Runs one round on a fresh VM (in a simulation of its own in virtual time); then checks
/// that every table page came back.
pub(crate) fn run_round<F: PteFormat>(
    cfg: &RoundCfg,
    inject_bugs: u32,
) -> Result<RoundOut, Failure> {
    let rsim = RoundSim::start::<F>(cfg)?;
    let vm = new_vm::<F>(cfg)?;
    vm.inject_bugs(inject_bugs);
    let alloc = slat::hw::table_alloc(&vm).clone();
    let r = run_vm(&vm, cfg, &rsim);
    // Dropped by the host while it is still a simulated CPU: the drop runs the engine's code.
    drop(vm);
    // A failed simulation (a deadlock, the watchdog) explains whatever the round then saw.
    let out = match (r, rsim.finish()) {
        (Ok(out), Ok(sim)) => RoundOut { sim, ..out },
        (Err(f), Ok(_)) => return Err(f),
        (Ok(_), Err(e)) => return Err(e),
        (Err(f), Err(e)) => return Err(other(format!("{e}; and then the round: {f}"))),
    };
    wait_for_reclaim(&alloc)?;
    Ok(out)
}

pub(crate) fn run_vm<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    cfg: &RoundCfg,
    rsim: &RoundSim,
) -> Result<RoundOut, Failure> {
    let (rams, ro_rams) = add_slots(vm, cfg)?;
    let sh = Arc::new(Shared::new(cfg.vcpus));
    let vcpus = start_vcpus(vm, &sh, cfg, rsim)?;
    let churn = match start_churn(vm, &sh, cfg, ro_rams, rsim) {
        Ok(c) => c,
        Err(e) => {
            sh.stop.store(true, Ordering::SeqCst);
            rsim.outside(|| vcpus.into_iter().for_each(|h| drop(h.join())));
            return Err(e);
        }
    };
    let mut host = Host::new(vm, &sh, cfg, &rams);
    let driven = host.drive(after::<F>(cfg.duration));
    // Stop everyone before judging: a failing round must not leave threads running.
    sh.stop.store(true, Ordering::SeqCst);
    let (vcpus, churn) = rsim.outside(|| {
        let v: Vec<_> = vcpus.into_iter().map(JoinHandle::join).collect();
        (v, churn.join())
    });
    let mut out = RoundOut::default();
    for v in vcpus {
        add_vcpu(
            &mut out.vcpu,
            &v.map_err(|_| other("a vCPU thread panicked"))?,
        );
    }
    out.churn = churn.map_err(|_| other("the churn thread panicked"))?;
    if let Some(f) = sh.failure() {
        return Err(Failure::Other(f));
    }
    driven?;
    host.finish()?;
    out.host = host.out;
    check_quiet(vm, &out)?;
    Ok(out)
}

/// After the round: no TLB conflict (stage-2's break-before-make), no locked entry left.
pub(crate) fn check_quiet<F: PteFormat>(vm: &Vm<F>, out: &RoundOut) -> Result<(), Failure> {
    if out.vcpu.counters.tlb_conflicts != 0 {
        return Err(other(format!(
            "{} TLB conflicts (a broken break-before-make)",
            out.vcpu.counters.tlb_conflicts
        )));
    }
    let a = vm.audit();
    if a.frozen != 0 {
        return Err(other(format!("locked entries left in the tree: {a:?}")));
    }
    // The reverse map (`VmConfig::wrprot`) against the tree: every leaf in it, nothing else.
    vm.audit_rmap()
        .map_err(|e| other(format!("rmap audit ({}): {e}", vm.config().wrprot)))?;
    Ok(())
}

pub(crate) fn add_vcpu(t: &mut VcpuOut, v: &VcpuOut) {
    t.writes += v.writes;
    t.reads += v.reads;
    t.aux += v.aux;
    t.ro_exits += v.ro_exits;
    t.ro_reads += v.ro_reads;
    t.mmio_retries += v.mmio_retries;
    let (a, b) = (&mut t.counters, &v.counters);
    a.accesses += b.accesses;
    a.walks += b.walks;
    a.faults += b.faults;
    a.tlb_flushes += b.tlb_flushes;
    a.ad_updates += b.ad_updates;
    a.ring_full_exits += b.ring_full_exits;
    a.tlb_conflicts += b.tlb_conflicts;
}

/// Every table page of the dropped VM is freed: the VM frees its tree at once, pages
/// unlinked earlier wait for an epoch grace period. Pinning (through a scratch VM's lookups:
/// this crate does not depend on crossbeam-epoch) makes the collector advance and free them.
/// The scratch VM is a real-time one whatever the round's clock: the epoch is the process's,
/// and after a virtual round's simulation has ended no hook may run.
pub(crate) fn wait_for_reclaim(alloc: &slat::hw::TableAlloc) -> Result<(), Failure> {
    let scratch = Vm::<slat::Ept>::new(VmConfig::default());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let live = alloc.live_pages();
        if live == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(other(format!(
                "table pages leaked: {live} live after the VM was dropped ({} ever allocated)",
                alloc.allocated_pages()
            )));
        }
        for _ in 0..4096 {
            scratch.lookup(Gfn::new(0));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
