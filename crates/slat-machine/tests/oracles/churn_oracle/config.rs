//! A round's configuration.

use super::*;

/// How the VMM harvests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum LogMode {
    /// GET_DIRTY_LOG clears and re-protects (`VmConfig::get_log`: xchg or switch).
    Get,
    /// Manual protect: GET copies, CLEAR clears and re-protects.
    Clear { initially_set: bool },
    /// Per-vCPU rings of this many entries (small: vCPUs take ring-full exits).
    Ring { entries: u32 },
}

/// A log mode with its tracking and GET variant.
pub(crate) type Mode = (LogMode, DirtyTrack, GetLogVariant);

/// Every mode this format supports; rounds cycle through them.
pub(crate) fn modes<F: PteFormat>() -> Vec<Mode> {
    let clear = |initially_set| LogMode::Clear { initially_set };
    let mut v = Vec::new();
    // Stage-2 has no D bit.
    let tracks: &[DirtyTrack] = match F::HARDWARE_DIRTY {
        true => &[DirtyTrack::WriteProtect, DirtyTrack::HardwareDirty],
        false => &[DirtyTrack::WriteProtect],
    };
    for &t in tracks {
        v.push((LogMode::Get, t, GetLogVariant::Xchg));
        v.push((LogMode::Get, t, GetLogVariant::Switch));
        v.push((clear(false), t, GetLogVariant::Xchg));
        v.push((clear(true), t, GetLogVariant::Xchg));
    }
    // Rings log from the fault path only (no D-bit tracking with rings).
    let ring = LogMode::Ring { entries: 256 };
    v.push((ring, DirtyTrack::WriteProtect, GetLogVariant::Xchg));
    v
}

/// What the churn thread and the host do besides harvesting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Churn {
    /// The host turns logging off and on on a checked slot (harvesting first).
    pub(crate) toggle: bool,
    /// Partial and whole zaps of the checked slots.
    pub(crate) zap: bool,
    /// Every form of aging over the checked slots.
    pub(crate) age: bool,
    /// The auxiliary slot moves, its log toggles and is harvested.
    pub(crate) aux: bool,
    /// The checked slots move (their bitmap and ring entries survive the move).
    pub(crate) move_checked: bool,
    /// Read-only slots come and go; READONLY toggles are refused.
    pub(crate) ro_slots: bool,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct RoundCfg {
    pub(crate) seed: u64,
    pub(crate) log: LogMode,
    pub(crate) vm: VmConfig,
    pub(crate) backing: Backing,
    pub(crate) vcpus: usize,
    pub(crate) tlb_entries: usize,
    pub(crate) churn: Churn,
    pub(crate) duration: Duration,
    /// Longest pause between two harvests.
    pub(crate) harvest_gap: Duration,
    /// Longest pause between two churn operations.
    pub(crate) churn_gap: Duration,
    /// Longest pause before logging is first turned on (vCPUs map memory meanwhile).
    pub(crate) settle: Duration,
    /// Longest time logging stays off when the host toggles it.
    pub(crate) toggle_gap: Duration,
    /// Virtual time: how far a simulated CPU may run ahead of the others before it passes the
    /// baton (zero: the cost profile's, and always in real time). Smaller interleaves finer.
    pub(crate) lookahead: Duration,
}

impl RoundCfg {
    /// The configuration of a round seed: the log mode is `seed % modes`, so cycling the
    /// seeds cycles the modes, and a seed replays the same configuration in any round. The
    /// round lasts 150 to 500 ms, cut to what is `left` of the run (100 ms at least); in
    /// virtual time every time is divided by [`VIRTUAL_PACE`] (the rest is the same).
    pub(crate) fn random<F: PteFormat>(seed: u64, left: Duration) -> RoundCfg {
        let all = modes::<F>();
        let (log, dirty_track, get_log) = all[(seed % all.len() as u64) as usize];
        let mut r = Rng::new(seed);
        let log = match log {
            LogMode::Ring { .. } => LogMode::Ring {
                entries: r.pick(&[128, 256, 1024]),
            },
            m => m,
        };
        let vm = random_vm(&mut r, dirty_track, get_log);
        let churn = Churn {
            toggle: r.chance(75),
            zap: r.chance(80),
            age: r.chance(80),
            aux: r.chance(80),
            move_checked: r.chance(50),
            ro_slots: r.chance(80),
        };
        let pace = pace::<F>();
        let ms = (150 + r.below(351))
            .min(left.saturating_mul(pace).as_millis() as u64)
            .max(100);
        RoundCfg {
            seed,
            log,
            vm,
            backing: r.pick(&[
                Backing::Anonymous,
                Backing::AnonymousThp,
                Backing::AnonymousThp,
            ]),
            vcpus: r.pick(&[2, 3, 4, 4, 4]),
            tlb_entries: r.pick(&[256, 2048]),
            churn,
            duration: Duration::from_millis(ms) / pace,
            harvest_gap: Duration::from_micros(r.pick(&[1000, 3000, 8000])) / pace,
            churn_gap: Duration::from_micros(r.pick(&[100, 500, 2000])) / pace,
            settle: Duration::from_millis(20) / pace,
            toggle_gap: Duration::from_millis(2) / pace,
            // Drawn last, so a seed's other choices are the same in both clocks.
            lookahead: match F::Clock::VIRTUAL {
                true => Duration::from_nanos(r.pick(&[1_000, 10_000])),
                false => Duration::ZERO,
            },
        }
    }

    /// A quiet round for the failure-injection test: no churn (zaps and aging flush TLBs,
    /// which would hide a missing harvest flush for a while).
    pub(crate) fn quiet<F: PteFormat>(seed: u64, mode: Mode) -> RoundCfg {
        let pace = pace::<F>();
        RoundCfg {
            seed,
            log: mode.0,
            vm: VmConfig {
                dirty_track: mode.1,
                get_log: mode.2,
                ..VmConfig::default()
            },
            backing: Backing::Anonymous,
            vcpus: 2,
            tlb_entries: 2048,
            churn: Churn {
                toggle: false,
                zap: false,
                age: false,
                aux: false,
                move_checked: false,
                ro_slots: false,
            },
            duration: Duration::from_millis(300) / pace,
            harvest_gap: Duration::from_millis(3) / pace,
            churn_gap: Duration::from_millis(1) / pace,
            settle: Duration::from_millis(20) / pace,
            toggle_gap: Duration::from_millis(2) / pace,
            lookahead: Duration::ZERO,
        }
    }

    pub(crate) fn manual(&self) -> bool {
        matches!(self.log, LogMode::Clear { .. })
    }

    pub(crate) fn mode_name(&self) -> String {
        let base = match self.log {
            LogMode::Get => format!("get-{}", self.vm.get_log.name()),
            LogMode::Clear {
                initially_set: false,
            } => "clear".into(),
            LogMode::Clear {
                initially_set: true,
            } => "clear-initset".into(),
            LogMode::Ring { .. } => "ring".into(),
        };
        match self.vm.dirty_track {
            DirtyTrack::HardwareDirty => format!("dbit-{base}"),
            DirtyTrack::WriteProtect => base,
        }
    }

    /// The discrete choices (what "configurations covered" counts); `bbm`: the format uses
    /// the rebuild order and cache maintenance.
    pub(crate) fn key(&self, bbm: bool) -> String {
        let v = &self.vm;
        let mut k = format!(
            "{} {} v{} tlb{} {} fpf{} ad{} eager{} {} {:?}",
            self.mode_name(),
            self.backing,
            self.vcpus,
            self.tlb_entries,
            v.mmu_lock.name(),
            v.fast_pf as u8,
            v.ad_bits as u8,
            v.eager_split as u8,
            v.recover.name(),
            self.churn,
        );
        if bbm {
            k += &format!(" {} {}", v.rebuild.name(), v.cmo.name());
        }
        k
    }
}

/// The engine's switches, at random (rebuild order and cache maintenance matter on stage-2
/// only).
pub(crate) fn random_vm(r: &mut Rng, dirty_track: DirtyTrack, get_log: GetLogVariant) -> VmConfig {
    let hw = dirty_track == DirtyTrack::HardwareDirty;
    VmConfig {
        mmu_lock: match r.chance(20) {
            true => MmuLockKind::Mutex,
            false => MmuLockKind::RwLock,
        },
        fast_pf: r.chance(75),
        // Hardware D-bit tracking wants A/D bits (without, it falls back to protection).
        ad_bits: r.chance(if hw { 85 } else { 65 }),
        eager_split: r.chance(50),
        get_log,
        recover: r.pick(&[
            RecoverVariant::InPlace,
            RecoverVariant::Zap,
            RecoverVariant::OnFault,
        ]),
        dirty_track,
        cmo: r.pick(&[CmoPolicy::Always, CmoPolicy::OnInstall]),
        rebuild: r.pick(&[RebuildOrder::BreakFirst, RebuildOrder::InstallFirst]),
        // Write-protect variant: harvests walk, look pages up in the rmap, or do so without the
        // MMU lock. `SLAT_TEST_WRPROT=walk|rmap|rmap-lockless` pins it (to compare a failing
        // round).
        wrprot: {
            let w = r.pick(WrprotVariant::ALL);
            match std::env::var("SLAT_TEST_WRPROT") {
                Ok(v) => v.parse().expect("SLAT_TEST_WRPROT"),
                Err(_) => w,
            }
        },
    }
}

impl fmt::Display for RoundCfg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = &self.vm;
        let c = &self.churn;
        let ring = match self.log {
            LogMode::Ring { entries } => format!(" ring_entries={entries}"),
            _ => String::new(),
        };
        write!(
            f,
            "mode={}{ring} backing={} vcpus={} tlb={} lock={} fast_pf={} ad_bits={} \
             eager_split={} recover={} rebuild={} cmo={} wrprot={} churn=[toggle={} zap={} age={} aux={} \
             move_checked={} ro_slots={}] duration={:?} harvest_gap={:?} churn_gap={:?}{}",
            self.mode_name(),
            self.backing,
            self.vcpus,
            self.tlb_entries,
            v.mmu_lock.name(),
            v.fast_pf,
            v.ad_bits,
            v.eager_split,
            v.recover.name(),
            v.rebuild.name(),
            v.cmo.name(),
            v.wrprot.name(),
            c.toggle,
            c.zap,
            c.age,
            c.aux,
            c.move_checked,
            c.ro_slots,
            self.duration,
            self.harvest_gap,
            self.churn_gap,
            match self.lookahead.is_zero() {
                true => String::new(),
                false => format!(" lookahead={:?}", self.lookahead),
            },
        )
    }
}

/// The seed of round `k`: round 0 uses the base seed itself; later rounds step the log mode
/// (`seed % modes`) by one each, so every mode is covered once per `n` rounds.
pub(crate) fn round_seed(base: u64, k: u64, n: u64) -> u64 {
    if k == 0 {
        return base;
    }
    let m = mix(base ^ mix(k)) >> 8;
    m - m % n + (base % n + k) % n
}
