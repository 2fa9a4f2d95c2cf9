//! Bad input is refused where the flags are checked: exit status 2 and one line on stderr that
//! names the flag(s), before any memory is mapped — for every subcommand, for sizes whose
//! products overflow, sizes the host or the guest physical address space cannot hold,
//! memslot counts that do not divide the memory, misaligned addresses, counts used as
//! allocation sizes, flag combinations that can never run, and `--timeout 0`.
//!
//! Every run has a deadline: a command that hangs (as `migrate-listen --timeout 0` did) fails
//! its test instead of stalling the suite.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `slat args`, killing it after `limit`; returns (status, stdout, stderr), status -1 if
/// it had to be killed.
fn slat_within(args: &[&str], limit: Duration) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_slat"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run slat");
    let t = Instant::now();
    let code = loop {
        if let Some(s) = c.try_wait().expect("wait") {
            break s.code().unwrap_or(-1);
        }
        if t.elapsed() > limit {
            let _ = c.kill();
            let _ = c.wait();
            break -1;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut o) = c.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = c.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (code, out, err)
}

/// Expects exit status 2, nothing on stdout, one line on stderr containing every needle.
fn refused(args: &[&str], needles: &[&str]) {
    let (code, out, err) = slat_within(args, Duration::from_secs(60));
    let cmd = args.join(" ");
    assert_eq!(code, 2, "slat {cmd}: status {code}\n{out}\n{err}");
    assert!(out.is_empty(), "slat {cmd} printed: {out}");
    assert_eq!(err.lines().count(), 1, "slat {cmd}: {err}");
    for n in needles {
        assert!(err.contains(n), "slat {cmd}: {err:?} does not name {n:?}");
    }
    assert!(!err.contains("panicked"), "slat {cmd}: {err}");
}

/// 4 x (2^62 - 16 KiB) wraps to 16 KiB in 64 bits.
const WRAPS: &str = "4611686018427392000";

#[test]
fn vcpus_times_bytes_that_overflow_are_refused_by_every_subcommand() {
    let naming = ["-v 4 x -b 4611686018427392000", "overflows"];
    for cmd in [
        "demand-paging",
        "dirty-log-perf",
        "dirty-log-test",
        "access-tracking-perf",
        "migrate-perf",
    ] {
        refused(&[cmd, "-v", "4", "-b", WRAPS], &naming);
    }
    refused(
        &["migrate", "--to", "127.0.0.1:1", "-v", "4", "-b", WRAPS],
        &naming,
    );
    // The selftest's 3 extra pages per vCPU overflow -b alone (this one used to pass, on
    // 8 KiB of wrapped memory).
    refused(
        &["dirty-log-test", "-b", "18446744073709547520"],
        &["-b 18446744073709547520", "overflows"],
    );
    // page-table-test's -b is shared; aligned up to a 1 GiB page it overflows.
    refused(
        &[
            "page-table-test",
            "-b",
            "18446744073709547520",
            "-s",
            "anonymous_hugetlb_1gb",
        ],
        &["-b 18446744073709547520", "overflows"],
    );
}

#[test]
fn memory_beyond_the_host_or_the_address_space_is_refused() {
    // 32 PiB: more than any host's RAM and swap, and than a 48-bit guest physical space.
    for cmd in [
        "demand-paging",
        "dirty-log-perf",
        "dirty-log-test",
        "access-tracking-perf",
        "migrate-perf",
    ] {
        refused(&[cmd, "-v", "512", "-b", "64T"], &["-v 512 x -b"]);
    }
    refused(&["page-table-test", "-b", "64T", "-v", "2"], &["-b"]);
    // 16 TiB is inside 2^48, so the host is what refuses it.
    refused(
        &["demand-paging", "-v", "16", "-b", "1T"],
        &["-v 16 x -b", "RAM and swap"],
    );
    // Past the 2^39 a kvm guest lays memory out in.
    refused(
        &["demand-paging", "-v", "2", "-b", "256G", "--backend", "kvm"],
        &["-v 2 x -b", "39-bit", "kvm"],
    );
    // A sweep row that cannot be held is refused before the first row runs.
    refused(
        &["dirty-log-perf", "-b", "1G", "--vary", "vcpus=1,512"],
        &["-v 512 x -b"],
    );
}

#[test]
fn memslots_that_do_not_divide_the_memory_are_refused() {
    refused(
        &["dirty-log-perf", "-b", "4k", "-x", "3"],
        &["-x 3", "-b 4096"],
    );
    refused(
        &["migrate-perf", "-b", "4k", "-x", "3"],
        &["-x 3", "-b 4096"],
    );
    refused(
        &[
            "migrate",
            "--to",
            "127.0.0.1:1",
            "-v",
            "3",
            "-b",
            "8k",
            "-x",
            "4",
        ],
        &["-x 4", "-v 3 x -b 8192"],
    );
}

#[test]
fn a_bad_guest_physical_address_is_refused() {
    refused(&["page-table-test", "-p", "1"], &["-p 0x1", "not aligned"]);
    refused(
        &["page-table-test", "-p", "0x1001", "-b", "8M"],
        &["-p 0x1001", "not aligned"],
    );
    refused(
        &[
            "page-table-test",
            "-p",
            "0x200000",
            "-b",
            "8M",
            "-s",
            "anonymous_hugetlb_1gb",
        ],
        &["-p 0x200000", "0x40000000"],
    );
    refused(
        &["page-table-test", "-p", "0xffffffffffff0000", "-b", "8M"],
        &["-p 0xffffffffffff0000", "48-bit"],
    );
}

#[test]
fn counts_used_as_allocation_sizes_are_bounded() {
    // Each vCPU allocates its TLB: 2^63 entries used to panic with a capacity overflow.
    refused(
        &[
            "demand-paging",
            "-b",
            "1M",
            "--tlb-entries",
            "9223372036854775808",
        ],
        &["--tlb-entries"],
    );
    // MiB/s x 2^20 must fit bytes per second; 0 used to mean "no cap".
    refused(
        &[
            "migrate",
            "--to",
            "127.0.0.1:1",
            "--bandwidth",
            "17592186044416",
        ],
        &["--bandwidth"],
    );
    refused(
        &[
            "migrate",
            "--to",
            "127.0.0.1:1",
            "-b",
            "4M",
            "--bandwidth",
            "0",
        ],
        &["--bandwidth"],
    );
    // -c is documented as a power of two.
    refused(
        &["dirty-log-test", "-M", "dirty-ring", "-c", "300"],
        &["-c"],
    );
}

#[test]
fn combinations_that_can_never_run_are_refused_before_running() {
    for cmd in [
        vec!["demand-paging", "-b", "1M"],
        vec!["dirty-log-perf", "-b", "1M"],
        vec!["dirty-log-test", "-b", "1M"],
        vec!["migrate", "--to", "127.0.0.1:1", "-b", "1M"],
        vec!["migrate-listen", "--listen", "127.0.0.1:0"],
    ] {
        let mut args = cmd.clone();
        args.extend(["-s", "shmem", "--backend", "kvm"]);
        refused(&args, &["-s shmem", "kvm"]);
    }
    refused(
        &["access-tracking-perf", "-b", "1M", "--backend", "kvm"],
        &["--backend kvm"],
    );
    refused(
        &[
            "migrate",
            "--to",
            "127.0.0.1:1",
            "-b",
            "1M",
            "-w",
            "50",
            "--backend",
            "kvm",
        ],
        &["-w"],
    );
}

#[test]
fn vary_rows_that_can_never_run_are_refused_before_running() {
    refused(
        &[
            "migrate-perf",
            "-b",
            "4M",
            "-w",
            "50",
            "--vary",
            "backend=sim,kvm",
        ],
        &["--vary row backend=kvm", "-w"],
    );
    refused(
        &[
            "migrate-perf",
            "-b",
            "4M",
            "--vary",
            "log=get",
            "--vary",
            "log=clear",
        ],
        &["--vary", "log"],
    );
}

#[test]
fn kvm_dirty_rings_below_a_page_of_entries_are_refused() {
    // KVM's ring is at least a page of entries; the selftest's clamp to 1 MiB's pages gives 256.
    refused(
        &[
            "dirty-log-test",
            "-M",
            "dirty-ring",
            "-c",
            "128",
            "-b",
            "1M",
            "--backend",
            "kvm",
        ],
        &["-c", "256"],
    );
    refused(
        &[
            "dirty-log-perf",
            "-b",
            "1M",
            "--dirty-ring",
            "128",
            "--backend",
            "kvm",
        ],
        &["--dirty-ring", "256"],
    );
}

#[test]
fn a_zero_timeout_is_refused_and_the_help_says_so() {
    // It used to be taken as "wait forever" by migrate-listen (and silently as 1 s by migrate).
    refused(
        &[
            "migrate-listen",
            "--listen",
            "127.0.0.1:0",
            "--timeout",
            "0",
        ],
        &["--timeout", "0"],
    );
    refused(
        &[
            "migrate",
            "--to",
            "127.0.0.1:1",
            "-b",
            "4M",
            "--warmup",
            "0",
            "--timeout",
            "0",
        ],
        &["--timeout", "0"],
    );
    for cmd in ["migrate-listen", "migrate"] {
        let (code, out, _) = slat_within(&[cmd, "--help"], Duration::from_secs(30));
        assert_eq!(code, 0);
        let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(flat.contains("1-86400"), "{cmd} --help: {out}");
        assert!(flat.contains("0 is refused"), "{cmd} --help: {out}");
    }
}

/// The shipped binary carries no deliberate engine bugs: `--break` names the build feature
/// that has them (`cargo test` builds the CLI without it).
#[test]
#[cfg(not(feature = "broken-engine"))]
fn break_needs_the_broken_engine_build() {
    refused(
        &[
            "dirty-log-test",
            "--break",
            "skip-harvest-flush",
            "-b",
            "4M",
        ],
        &["--break", "broken-engine"],
    );
}

#[test]
fn durations_and_counts_of_the_migrate_commands_are_bounded() {
    let to = ["migrate", "--to", "127.0.0.1:1", "-b", "4M"];
    let with = |extra: &[&'static str]| {
        let mut v = to.to_vec();
        v.extend_from_slice(extra);
        v
    };
    // Each is a sleep or a loop of the command: a huge value is a typo that would hang it.
    refused(&with(&["--warmup", "600001"]), &["--warmup", "600000"]);
    refused(
        &with(&["--retry-delay", "600001"]),
        &["--retry-delay", "600000"],
    );
    refused(&with(&["--retries", "1001"]), &["--retries", "1000"]);
    refused(&with(&["--max-downtime", "3600001"]), &["--max-downtime"]);
    refused(&with(&["--dirty-rate", "1001m"]), &["--dirty-rate"]);
    refused(&with(&["--inject", "version=4294967296"]), &["--inject"]);
}

#[test]
fn durations_and_counts_of_migrate_listen_and_migrate_perf_are_bounded() {
    refused(
        &[
            "migrate-listen",
            "--listen",
            "127.0.0.1:0",
            "--resume-ms",
            "600001",
        ],
        &["--resume-ms", "600000"],
    );
    refused(
        &[
            "migrate-listen",
            "--listen",
            "127.0.0.1:0",
            "--retries",
            "1001",
        ],
        &["--retries"],
    );
    refused(
        &[
            "migrate-perf",
            "-b",
            "4M",
            "--resume-ms",
            "18446744073709551615",
        ],
        &["--resume-ms"],
    );
    refused(
        &[
            "migrate-perf",
            "-b",
            "4M",
            "--vary",
            "max-downtime=10,3600001",
        ],
        &["--vary", "3600001"],
    );
    refused(
        &["migrate-perf", "-b", "4M", "--vary", "dirty-rate=1k,2000m"],
        &["--vary", "2000m"],
    );
    // What migrate-listen cannot do, it refuses.
    refused(
        &[
            "migrate-listen",
            "--listen",
            "127.0.0.1:0",
            "--plot",
            "x.svg",
        ],
        &["--plot"],
    );
}

#[test]
fn the_help_of_the_migrate_commands_names_each_bound() {
    // The help says where each bound is.
    for (cmd, flags) in [
        ("migrate", &["--warmup", "--retry-delay", "--retries"][..]),
        ("migrate-listen", &["--resume-ms", "--retries"][..]),
        ("migrate-perf", &["--resume-ms", "--warmup"][..]),
    ] {
        let (code, out, _) = slat_within(&[cmd, "--help"], Duration::from_secs(30));
        assert_eq!(code, 0);
        let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
        for f in flags {
            assert!(flat.contains(f), "{cmd} --help: {out}");
        }
        assert!(
            flat.contains("0-600000") || flat.contains("at most 600000"),
            "{cmd} --help: {out}"
        );
    }
}

#[test]
fn harvest_flags_that_cannot_apply_are_refused() {
    refused(
        &["dirty-log-perf", "-b", "4M", "-g", "--clear-chunk", "64"],
        &["--clear-chunk", "-g"],
    );
    refused(
        &["dirty-log-perf", "-b", "4M", "--clear-chunk", "100"],
        &["--clear-chunk", "power of two"],
    );
    refused(
        &["dirty-log-perf", "-b", "4M", "--harvest-interval", "5"],
        &["--concurrent"],
    );
    refused(
        &[
            "dirty-log-perf",
            "-b",
            "4M",
            "--vary",
            "log=get,clear",
            "--vary",
            "clear-chunk=64",
        ],
        &["--vary row", "--clear-chunk"],
    );
    // The harvest and vCPU keys apply to KVM; engine keys do not.
    refused(
        &[
            "dirty-log-perf",
            "-b",
            "4M",
            "--backend",
            "kvm",
            "--vary",
            "wrprot=walk,rmap",
        ],
        &["--vary", "simulated engine"],
    );
}

/// An output file that cannot be written is refused before the benchmark runs (the plot was
/// drawn at the end, so a bad `--plot` threw a whole run away and exited 1 after it), and a
/// migration into a snapshot file that cannot be created is refused before the guest is built.
#[test]
fn unwritable_output_files_are_refused_before_any_work() {
    let missing = "/nonexistent-slat-dir/plot.svg";
    refused(
        &["dirty-log-perf", "-b", "4M", "-i", "2", "--plot", missing],
        &["--plot", missing, "cannot write"],
    );
    refused(
        &["migrate-perf", "-b", "4M", "--plot", missing],
        &["--plot", "cannot write"],
    );
    // A directory is not a file either.
    refused(
        &["dirty-log-perf", "-b", "4M", "-i", "2", "--plot", "/"],
        &["--plot", "cannot write"],
    );
    refused(
        &[
            "migrate",
            "--to",
            "file:/nonexistent-slat-dir/snap",
            "-b",
            "4M",
        ],
        &["--to", "/nonexistent-slat-dir/snap", "cannot write"],
    );
    // A writable path is only checked: nothing is left behind by a refusal that follows.
    let dir = std::env::temp_dir().join(format!("slat-plot-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("p.svg");
    let svg_s = svg.to_str().unwrap();
    // Refused after the check, by the benchmark's own flag rules (stage-2 is the simulated
    // machine's format only).
    refused(
        &[
            "demand-paging",
            "-b",
            "4M",
            "--format",
            "stage2",
            "--backend",
            "kvm",
            "--plot",
            svg_s,
        ],
        &["stage2"],
    );
    assert!(!svg.exists(), "the check left {svg_s} behind");
    let _ = std::fs::remove_dir(&dir);
}
