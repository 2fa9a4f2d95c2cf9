//! The `slat` command: KVM-selftest-style benchmarks of the slat second-stage MMU.

mod access_tracking_perf;
mod args;
mod backend;
mod calibrate;
mod concurrent_harvest;
mod demand_paging;
mod dirty_log_perf;
mod dirty_log_test;
mod dirty_rate;
mod driver;
mod error;
mod harvest;
mod host;
mod latency;
mod limits;
mod migrate;
mod migrate_report;
mod mmu_memory;
mod output;
mod page_table_test;
mod plot;
mod private_mem_perf;
mod private_mem_test;
mod report;
mod reproduce;
mod snapshot_perf;
mod virtual_time;

use clap::{Parser, Subcommand};

/// Line-aligned allocations while a simulation runs, so `--clock virtual` reports do not
/// depend on what the process allocated before (slat-vt's `LineAligned`).
#[global_allocator]
static ALLOC: slat_vt::LineAligned = slat_vt::LineAligned;

/// slat: a concurrent user-space second-stage (EPT) MMU, benchmarked like KVM's selftests.
#[derive(Debug, Parser)]
#[command(name = "slat", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// First touch of all guest memory through the engine's fault path (demand_paging_test),
    /// with a native baseline and the ratio.
    DemandPaging(demand_paging::DemandPagingArgs),
    /// Dirty logging for live migration (dirty_log_perf_test): populate, enable logging, N
    /// iterations of dirtying memory and harvesting the log, disable logging; native baseline
    /// and ratio for every pass.
    DirtyLogPerf(dirty_log_perf::DirtyLogPerfArgs),
    /// The dirty-log correctness oracle (dirty_log_test): writers stamp pages while the host
    /// harvests; every page is checked, and any lost or misreported page fails the run. As in
    /// the selftest, 3 pages are added to each vCPU's -b so the memslot is not a multiple of
    /// 64 pages.
    DirtyLogTest(dirty_log_test::DirtyLogTestArgs),
    /// Aging and idle page tracking (access_tracking_perf_test): populate, access, mark idle,
    /// access idle memory; native baseline and ratio for every pass; `--compare` runs fast page
    /// fault on and off, each with -v 1 and -v 2, in one process.
    AccessTrackingPerf(access_tracking_perf::AccessTrackingPerfArgs),
    /// Create, update and rebuild mappings with every vCPU on the same memory
    /// (kvm_page_table_test): per-stage times, faults, break-before-make and cache-maintenance
    /// work, native baseline and ratio.
    PageTableTest(page_table_test::PageTableTestArgs),
    /// Live-migrate a guest under write load to `slat migrate-listen` over TCP (pre-copy with
    /// the dirty log, auto-converge, verification at switch-over, retries).
    Migrate(migrate::MigrateArgs),
    /// Receive a live migration, verify it and run the guest.
    MigrateListen(migrate::ListenArgs),
    /// Both ends of a live migration in one process over loopback:
    /// migration time, downtime, rounds, dirty rate, bandwidth, throttling.
    MigratePerf(migrate::MigratePerfArgs),
    /// Snapshot-fuzzer resets: the guest dirties k pages per iteration and the host copies
    /// back only the dirty pages (harvest, re-arm, copy); reset time per k against a memcpy
    /// floor measured in the same run and against a full-copy reset of all guest RAM. With
    /// --clock virtual the host's harvest and resets run on a simulated CPU, each page copied
    /// or zeroed priced by the cost profile (page_copy, zero_page).
    SnapshotPerf(snapshot_perf::SnapshotPerfArgs),
    /// Dirty rate without migrating (QEMU's calc-dirty-rate): sample the dirty log (bitmap or
    /// rings) of a running guest for N ms windows and report distinct pages dirtied per
    /// second, overall and per vCPU, beside the guest's known write rate where there is one.
    DirtyRate(dirty_rate::DirtyRateArgs),
    /// The host kernel's cost of private memory (host direct map for private memory): threads fault in memfd_secret
    /// memory, whose pages the kernel removes from its direct map (splitting huge leaves),
    /// against plain memfd memory; direct-map splits, DirectMap sizes, TLB shootdowns.
    PrivateMemPerf(private_mem_perf::PrivateMemPerfArgs),
    /// Private-memory conversions (KVM's private_mem_conversions_test) on the simulated
    /// machine: vCPUs convert their memory between shared and private while a host CPU reads
    /// it through the host direct map; every access is checked. Exits 1 on a violation.
    PrivateMemTest(private_mem_test::PrivateMemTestArgs),
    /// A seed thread's experiment (000-004, or all) as slat's own benchmarks, before and after
    /// its change, beside the numbers the thread published: both after/before ratios and
    /// whether the direction and the magnitude (within 2x) are reproduced.
    Reproduce(reproduce::ReproduceArgs),
    /// One round of one of `slat reproduce`'s commands, its figures as one JSON line (what
    /// `reproduce --jobs` runs in each of its processes).
    #[command(hide = true)]
    ReproduceWorker(reproduce::WorkerArgs),
    /// Measure this host's costs with micro-benchmarks (atomics, a line transfer between the
    /// cores, a lock hand-off, a page zeroed, the simulated TLB and walks, ...) and write a
    /// cost profile for --clock virtual, each number with how it was measured.
    Calibrate(calibrate::CalibrateArgs),
}

/// Clap's error as one line: the problem and what it lists under it (the missing flags, the
/// accepted values, a tip), without the usage and help pointer that follow.
fn one_line(text: &str) -> String {
    let parts: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    match parts.join(" ") {
        s if s.is_empty() => "invalid arguments".into(),
        s => s.trim_start_matches("error: ").to_string(),
    }
}

/// Every file the command will write, checked before any work (exit status 2): `--plot`, and
/// a migration into a snapshot file (`--to file:PATH`). `--json` prints to stdout.
fn check_outputs(command: &Command) -> error::CliResult {
    let out = match command {
        Command::DemandPaging(a) => &a.out,
        Command::DirtyLogPerf(a) => &a.out,
        Command::DirtyLogTest(a) => &a.out,
        Command::AccessTrackingPerf(a) => &a.out,
        Command::PageTableTest(a) => &a.out,
        Command::Migrate(a) => {
            if let slat_migrate::transport::Endpoint::File(p) = &a.to {
                args::check_writable("--to", p)?;
            }
            &a.out
        }
        Command::MigrateListen(a) => &a.out,
        Command::MigratePerf(a) => &a.out,
        Command::SnapshotPerf(a) => &a.out,
        Command::DirtyRate(a) => &a.out,
        Command::PrivateMemPerf(a) => &a.out,
        Command::PrivateMemTest(_) | Command::Calibrate(_) | Command::ReproduceWorker(_) => {
            return Ok(())
        }
        Command::Reproduce(a) => {
            return match &a.plot {
                Some(p) => args::check_writable("--plot", p),
                None => Ok(()),
            }
        }
    };
    out.check_paths()
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    std::process::exit(0);
                }
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    std::process::exit(2);
                }
                _ => {
                    eprintln!("slat: {}", one_line(&e.render().to_string()));
                    std::process::exit(2);
                }
            }
        }
    };
    if !matches!(
        cli.command,
        Command::Migrate(_) | Command::MigrateListen(_) | Command::MigratePerf(_)
    ) {
        // Die of SIGPIPE like other command-line tools when stdout is a closed pipe (`slat ...
        // | head`), instead of the panic `println!` raises on EPIPE. Not for the migration
        // commands: their sockets must see EPIPE as an error, not kill the process.
        // SAFETY: called before this process starts any thread; it only restores the default
        // disposition of one signal.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let r = check_outputs(&cli.command).and_then(|()| match &cli.command {
        Command::DemandPaging(a) => driver::run(a),
        Command::DirtyLogPerf(a) => driver::run(a),
        Command::DirtyLogTest(a) => driver::run(a),
        Command::AccessTrackingPerf(a) => driver::run(a),
        Command::PageTableTest(a) => driver::run(a),
        Command::Migrate(a) => driver::run(a),
        Command::MigrateListen(a) => driver::run(&migrate::Listen::new(a.clone())),
        Command::MigratePerf(a) => driver::run(a),
        Command::SnapshotPerf(a) => driver::run(a),
        Command::DirtyRate(a) => driver::run(a),
        Command::PrivateMemPerf(a) => driver::run(a),
        Command::PrivateMemTest(a) => private_mem_test::run(a),
        Command::Reproduce(a) => reproduce::run(a),
        Command::ReproduceWorker(a) => reproduce::worker(a),
        Command::Calibrate(a) => calibrate::run(a),
    });
    if let Err(e) = r {
        // The one place an error becomes an exit status: 2 for refused input, 1 for a failed
        // run.
        eprintln!("slat: {e}");
        std::process::exit(e.exit_code());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use driver::Benchmark;

    /// The `--help` of `sub`, as wide as the test's lines need.
    fn help(sub: &str) -> String {
        let mut cmd = Cli::command().term_width(1000);
        cmd.build();
        let sub = cmd.find_subcommand_mut(sub).expect("subcommand");
        sub.render_long_help().to_string()
    }

    fn parse<T: clap::FromArgMatches>(args: &[&str]) -> T {
        let m = Cli::command().get_matches_from(args);
        let (_, sub) = m.subcommand().expect("subcommand");
        T::from_arg_matches(sub).expect("flags")
    }

    /// Every `--vary` table against the help it writes: the keys and values listed are the
    /// ones the code accepts, and each listed value applies.
    #[test]
    fn vary_help_lists_exactly_what_the_table_accepts() {
        fn check<B: Benchmark + clap::FromArgMatches>(sub: &str) {
            let base: B = parse(&["slat", sub]);
            let table = B::vary_table();
            assert!(!table.is_empty(), "{sub}");
            driver::vary::help_matches(&help(sub), table, &base)
                .unwrap_or_else(|e| panic!("{sub}: {e}"));
        }
        check::<dirty_log_perf::DirtyLogPerfArgs>("dirty-log-perf");
        check::<snapshot_perf::SnapshotPerfArgs>("snapshot-perf");
        check::<migrate::MigratePerfArgs>("migrate-perf");
        let base = private_mem_perf::sim::Variant {
            policy: Default::default(),
            kernel_flush: false,
        };
        let table = private_mem_perf::VARY;
        driver::vary::help_matches(&help("private-mem-perf"), table, &base).unwrap();
    }

    /// The check itself fails when the help and the table disagree.
    #[test]
    fn vary_help_check_catches_a_drift() {
        let dlp: dirty_log_perf::DirtyLogPerfArgs = parse(&["slat", "dirty-log-perf"]);
        let table = dirty_log_perf::DirtyLogPerfArgs::vary_table();
        let h = help("dirty-log-perf");
        let dropped = h.replace("wrprot (--wrprot)", "wrprot-gone (--wrprot)");
        assert!(driver::vary::help_matches(&dropped, table, &dlp).is_err());
        let fewer = h.replace("walk, rmap, rmap-each, rmap-lockless", "walk, rmap");
        assert!(driver::vary::help_matches(&fewer, table, &dlp).is_err());
    }
}
