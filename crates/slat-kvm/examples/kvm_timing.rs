//! Times the basic operations on this host's KVM: `cargo run --release -p slat-kvm --example
//! kvm_timing -- [vcpus] [MiB per vCPU] [backing] [user|kernel]`
//! (defaults 1, 256, anonymous, user).

use slat_dirty::DirtyLogSource;
use slat_kvm::{KvmConfig, KvmMachine};
use slat_workload::TestMachine;
use slat_workload::{Backing, PassParams, RegionSpec};
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The command line: what every machine of the run is built with.
#[derive(Clone, Copy)]
struct Opts {
    vcpus: usize,
    mib: u64,
    backing: Backing,
    guest_mode: slat_kvm::GuestMode,
}

impl Opts {
    /// A machine with these options and the dirty-log configuration `dirty`.
    fn machine(&self, dirty: slat_workload::DirtyConfig) -> Res<KvmMachine> {
        Ok(KvmMachine::new(KvmConfig {
            region: RegionSpec {
                vcpus: self.vcpus,
                bytes_per_vcpu: self.mib << 20,
                backing: self.backing,
                dirty,
                ..RegionSpec::default()
            },
            guest_mode: self.guest_mode,
            ..KvmConfig::default()
        })?)
    }
}

fn main() -> Res<()> {
    let o = parse_args()?;
    let buf = time_bitmap(&o)?;
    time_clear_log(&o, buf)?;
    time_ring(&o)
}

fn parse_args() -> Res<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let vcpus: usize = args.first().map_or(Ok(1), |s| s.parse())?;
    let mib: u64 = args.get(1).map_or(Ok(256), |s| s.parse())?;
    let backing = match args.get(2).map(String::as_str) {
        None | Some("anonymous") => Backing::Anonymous,
        Some("anonymous_thp") => Backing::AnonymousThp,
        Some("anonymous_hugetlb") => Backing::AnonymousHugetlb2M,
        Some(other) => return Err(format!("unknown backing {other}").into()),
    };
    let guest_mode = match args.get(3).map(String::as_str) {
        None | Some("user") => slat_kvm::GuestMode::User,
        Some("kernel") => slat_kvm::GuestMode::Kernel,
        Some(other) => return Err(format!("unknown guest mode {other}").into()),
    };
    Ok(Opts {
        vcpus,
        mib,
        backing,
        guest_mode,
    })
}

/// The populate, write, read passes, and dirty logging with the bitmap; returns the bitmap
/// buffer for the clear-log timings.
fn time_bitmap(o: &Opts) -> Res<Vec<u64>> {
    let Opts {
        vcpus,
        mib,
        backing,
        guest_mode,
    } = *o;
    let t = Instant::now();
    let m = o.machine(RegionSpec::default().dirty)?;
    println!(
        "{vcpus} vCPU(s) x {mib} MiB ({}, {guest_mode:?} mode), test region at {:#x}",
        backing.name(),
        m.layout().gpa
    );
    println!("create (mmap + prefault + VM): {:?}", t.elapsed());
    let seq = PassParams::default();
    let r = m.run_pass(seq)?;
    println!("populate pass (first touch):   {:?}", r.wall);
    let before = m.vcpu_stats(None).unwrap_or_default();
    let r = m.run_pass(seq)?;
    println!("second write pass:             {:?}", r.wall);
    let after = m.vcpu_stats(None).unwrap_or_default();
    let interesting = [
        "exits",
        "pf_fixed",
        "pf_emulate",
        "pf_spurious",
        "pf_fast",
        "pf_guest",
        "pf_taken",
        "insn_emulation",
        "io_exits",
        "invlpg",
        "tlb_flush",
    ];
    let d: Vec<String> = slat_kvm::stats::delta(&before, &after)
        .into_iter()
        .filter(|s| interesting.contains(&s.name.as_str()))
        .map(|s| format!("{}={}", s.name, s.value))
        .collect();
    println!("  vCPU counters during it: {}", d.join(" "));
    let r = m.run_pass(PassParams {
        write_percent: 0,
        ..seq
    })?;
    println!("read pass:                     {:?}", r.wall);
    let t = Instant::now();
    m.set_dirty_logging(true)?;
    println!("enable dirty logging:          {:?}", t.elapsed());
    let mut buf = vec![0u64; m.pages_per_slot().div_ceil(64) as usize];
    for i in 1..=3 {
        let r = m.run_pass(seq)?;
        println!("iteration {i} dirty memory:     {:?}", r.wall);
        let t = Instant::now();
        m.dirty_log().get_log(0, &mut buf)?;
        let n: u32 = buf.iter().map(|w| w.count_ones()).sum();
        println!(
            "iteration {i} get dirty log:    {:?} ({n} pages)",
            t.elapsed()
        );
    }
    let r = m.run_pass(seq)?;
    let r2 = m.run_pass(seq)?;
    println!(
        "write pass, logging on, no harvest before it: {:?}, and again: {:?}",
        r.wall, r2.wall
    );
    let t = Instant::now();
    m.set_dirty_logging(false)?;
    println!("disable dirty logging:         {:?}", t.elapsed());
    let r = m.run_pass(seq)?;
    println!("write pass after disabling:    {:?}", r.wall);
    let r = m.run_pass(seq)?;
    println!("and again:                     {:?}", r.wall);
    Ok(buf)
}

/// Manual protect: GET copies, CLEAR re-protects.
fn time_clear_log(o: &Opts, mut buf: Vec<u64>) -> Res<()> {
    let seq = PassParams::default();
    let m = o.machine(slat_workload::DirtyConfig {
        manual_protect: slat_workload::MANUAL_PROTECT_ENABLE | slat_workload::INITIALLY_SET,
        ring_entries: 0,
        ..slat_workload::DirtyConfig::default()
    })?;
    m.run_pass(seq)?;
    m.set_dirty_logging(true)?;
    let pps = m.pages_per_slot();
    for i in 1..=2 {
        let r = m.run_pass(seq)?;
        let t = Instant::now();
        m.dirty_log().get_log(0, &mut buf)?;
        let get = t.elapsed();
        let t = Instant::now();
        m.dirty_log()
            .clear_log(0, slat_addr::PageIndex::new(0), pps, &buf)?;
        println!(
            "clear-log iteration {i}: dirty memory {:?}, get {get:?}, clear {:?}",
            r.wall,
            t.elapsed()
        );
    }
    Ok(())
}

/// The dirty ring: collect and reset.
fn time_ring(o: &Opts) -> Res<()> {
    let seq = PassParams::default();
    let caps = slat_kvm::host_caps(slat_kvm::DEFAULT_DEVICE)?;
    let entries = (caps.dirty_ring_max_bytes / 16).min(65536);
    if entries == 0 {
        println!("dirty ring: not supported by this host");
        return Ok(());
    }
    let m = o.machine(slat_workload::DirtyConfig {
        manual_protect: 0,
        ring_entries: entries,
        ..slat_workload::DirtyConfig::default()
    })?;
    m.run_pass(seq)?;
    m.set_dirty_logging(true)?;
    for i in 1..=2 {
        let r = m.run_pass(seq)?;
        let exits: u64 = r.vcpus.iter().map(|v| v.ring_full_exits).sum();
        let t = Instant::now();
        let n = m.dirty_log().collect_ring(&mut |_, _| {})?;
        let collect = t.elapsed();
        let t = Instant::now();
        let reset = m.dirty_log().reset_rings()?;
        println!(
            "ring ({entries} entries) iteration {i}: dirty memory {:?} ({exits} ring-full \
             exits), collect {collect:?} ({n} entries), reset {:?} ({reset} entries)",
            r.wall,
            t.elapsed()
        );
    }
    Ok(())
}
