//! Output helpers: the selftests' time format, progress lines on stderr, ratios, and the
//! page-table format's lines.

use crate::args::{BackendArg, FormatArg};
use slat_workload::format_size;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// KVM selftests' `%ld.%.9lds`.
pub fn ts(d: Duration) -> String {
    format!("{}.{:09}s", d.as_secs(), d.subsec_nanos())
}

/// `a / b` as a ratio, guarding a zero baseline.
pub fn ratio(a: Duration, b: Duration) -> f64 {
    if b.is_zero() {
        f64::INFINITY
    } else {
        a.as_secs_f64() / b.as_secs_f64()
    }
}

/// `p / q`, or `None` unless `q` is positive.
pub fn per(p: f64, q: f64) -> Option<f64> {
    (q > 0.0).then(|| p / q)
}

/// A machine's error as a failure while running (exit status 1).
pub fn runtime<E: std::fmt::Display>(e: E) -> crate::error::CliError {
    crate::error::CliError::Runtime(e.to_string())
}

/// A phase announced on stderr; its duration is printed when it took over a second.
pub struct Phase {
    name: String,
    t0: Instant,
    quiet: bool,
}

/// The progress line of a benchmark's native baselines, which run after its last guest phase
/// (one run between two guest phases evicts from the host's caches what the next one finds).
pub const NATIVE_PHASE: &str = "native baselines: the same passes on host memory";

impl Phase {
    /// Starts a phase (silent when `quiet`, e.g. under `--json` with stderr redirected).
    pub fn start(name: impl Into<String>, quiet: bool) -> Phase {
        let name = name.into();
        if !quiet {
            eprintln!("[slat] {name} ...");
        }
        Phase {
            name,
            t0: Instant::now(),
            quiet,
        }
    }
    /// Ends the phase.
    pub fn done(self) {
        let d = self.t0.elapsed();
        if !self.quiet && d > Duration::from_secs(1) {
            eprintln!("[slat] {} took {:.1}s", self.name, d.as_secs_f64());
        }
        let _ = std::io::stderr().flush();
    }
}

/// Progress output is wanted: always on a terminal, and otherwise unless JSON was asked for.
pub fn quiet(json: bool) -> bool {
    json && !std::io::stderr().is_terminal()
}

/// The header line naming the page-table format.
pub fn format_header(kind: BackendArg, format: FormatArg, vm: &slat::VmConfig) -> String {
    match kind {
        BackendArg::Sim => format.header(vm),
        BackendArg::Kvm => "Page table format: the host's own (KVM), not slat's".to_string(),
    }
}

/// ` (stage2)` after the machine's name in progress lines, for a non-default format.
pub fn sim_format(kind: BackendArg, format: FormatArg) -> String {
    if kind == BackendArg::Sim && format != FormatArg::Ept {
        format!(" ({})", format.name())
    } else {
        String::new()
    }
}

/// Break-before-make and cache-maintenance counters, for formats that do either.
pub fn bbm_cmo_line(format: FormatArg, s: &slat::Stats) -> Option<String> {
    let i = format.info();
    if !i.break_before_make && !i.cache_maintenance {
        return None;
    }
    Some(format!(
        "Break-before-make: {} entries broken; cache maintenance: {} passes over {}",
        s.bbm_breaks,
        s.cache_cleans,
        format_size(s.cache_clean_bytes)
    ))
}

/// The `-c` line: where each vCPU's thread runs, as `sched_getaffinity` reported it after
/// pinning (nothing without `-c`).
pub fn pinned_line(cpus: Option<&[usize]>) -> Option<String> {
    let cpus = cpus?;
    let each: Vec<String> = cpus
        .iter()
        .enumerate()
        .map(|(i, c)| format!("vCPU {i} on CPU {c}"))
        .collect();
    Some(format!(
        "Pinned (-c, affinity read back with sched_getaffinity): {}",
        each.join(", ")
    ))
}
