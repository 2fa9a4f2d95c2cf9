//! `--clock virtual`: the simulated machine's threads as simulated CPUs with their own clocks,
//! one running at a time (docs/design/virtual-time.md), through `slat-vt`.
//!
//! The main thread is host CPU 0 for the whole run: it builds the machine (which registers
//! each vCPU thread before spawning it), drives the passes, and steps out of the simulation
//! only to join the vCPU threads. The run's times are then virtual; its wall time and the
//! simulation's counters are reported beside them.

use crate::error::{CliError, CliResult};
use clap::{Args, ValueEnum};
use serde::Serialize;
use slat::clock::Cost;
use slat_machine::vtime::{SimThreads, ThreadToken};
use slat_vt::{CpuHandle, Entry, Profile, Sim};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whose time a benchmark measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum ClockArg {
    /// The host's: real threads on the host's cores.
    #[default]
    Real,
    /// Simulated: every vCPU and the host thread have their own clock, one runs at a time,
    /// costs come from a cost profile and contention from a model (deterministic).
    Virtual,
}

/// The `--clock` flag.
#[derive(Debug, Clone, Args)]
pub struct ClockArgs {
    /// Whose time to measure: `real` (the host's) or `virtual` (simulated CPUs with their own
    /// clocks, one running at a time, costs from the built-in cost profile: deterministic;
    /// simulated machine only, not with -u).
    #[arg(long = "clock", value_enum, default_value = "real")]
    pub clock: ClockArg,
    /// With --clock virtual: the cost profile to simulate with (TOML, as `slat calibrate`
    /// writes, as crates/slat-vt/profiles/host-2core-nested.toml) instead of the built-in
    /// profile of this host; or a built-in one by name when no such file exists: host (this
    /// host's, host-2core-nested), x86-server or arm64-server (the seed threads' machines).
    #[arg(long = "cost-profile", value_name = "FILE|NAME")]
    pub cost_profile: Option<std::path::PathBuf>,
    /// With --clock virtual: how far, in ns of virtual time, the running simulated CPU may
    /// run ahead of the lowest runnable clock before it passes the baton (default: the cost
    /// profile's). Larger runs faster; smaller keeps events closer to virtual-time order.
    #[arg(long = "lookahead", value_name = "NS")]
    pub lookahead_ns: Option<f64>,
}

impl ClockArgs {
    /// Whether the run is in virtual time.
    pub fn is_virtual(&self) -> bool {
        self.clock == ClockArg::Virtual
    }
}

/// A timer of host-side phases: the calling thread's virtual clock when it is a simulated CPU
/// (`--clock virtual`), the host's otherwise.
#[derive(Debug, Clone, Copy)]
pub enum Stopwatch {
    /// Started at this virtual time, ns.
    Virtual(u64),
    /// Started at this instant.
    Real(Instant),
}

impl Stopwatch {
    /// Starts now.
    pub fn start() -> Stopwatch {
        match slat_vt::simulated_now_ns() {
            Some(ns) => Stopwatch::Virtual(ns),
            None => Stopwatch::Real(Instant::now()),
        }
    }

    /// Time since the start, on the clock it started on.
    pub fn elapsed(&self) -> Duration {
        match *self {
            Stopwatch::Virtual(t0) => Duration::from_nanos(
                slat_vt::simulated_now_ns().map_or(0, |t| t.saturating_sub(t0)),
            ),
            Stopwatch::Real(t0) => t0.elapsed(),
        }
    }
}

/// Waits `d`: on the calling thread's virtual clock when it is a simulated CPU (the other
/// simulated CPUs run meanwhile), in real time otherwise.
pub fn sleep(d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    if !slat_vt::sleep_current(ns) {
        std::thread::sleep(d);
    }
}

/// Runs `f`, real-time work on host threads of the calling thread's own (the native baseline),
/// without letting the simulation move meanwhile: under `--clock virtual` the host CPU keeps
/// the baton (so the run stays deterministic) and the watchdog lets it be.
pub fn outside<R>(f: impl FnOnce() -> R) -> R {
    slat_vt::hold_while(f)
}

/// A run in virtual time: the simulation and the main thread's place in it (host CPU 0).
pub struct VirtualRun {
    sim: Arc<Sim>,
    host: Option<CpuHandle>,
    wall: Instant,
}

/// What a report says about its clock.
#[derive(Debug, Clone, Serialize)]
pub struct ClockReport {
    /// `real` or `virtual`.
    pub clock: &'static str,
    /// The cost profile's name and hash (virtual only).
    #[serde(rename = "clock_profile", skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(rename = "clock_profile_hash", skip_serializing_if = "Option::is_none")]
    pub profile_hash: Option<String>,
    /// Wall time of the simulated part, s (virtual only).
    #[serde(rename = "sim_wall_s", skip_serializing_if = "Option::is_none")]
    pub wall_s: Option<f64>,
    /// Scheduler calls and baton switches (virtual only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_hooks: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_switches: Option<u64>,
    /// The lookahead the simulation ran with, ns (virtual only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_lookahead_ns: Option<f64>,
    /// Guest data accesses simulated (virtual only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_accesses: Option<u64>,
    /// Page faults simulated, fast and slow ([`count_faults`](Self::count_faults)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_faults: Option<u64>,
    /// The simulation's speed: those per second of wall time (virtual only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_accesses_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_faults_per_s: Option<f64>,
    /// What the contention model did (virtual only): [`SimModel`], as JSON (two runs' merge
    /// adds their counters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_model: Option<serde_json::Value>,
}

/// What the contention model did in a virtual run: how many times each cost of the profile
/// was charged, and the counters of the line, lock and entry-version models. A phase's
/// virtual time is those charges at the profile's prices plus the waits the models made, so
/// a researcher can see where it went (docs/design/virtual-time.md §3).
#[derive(Debug, Clone, Serialize)]
pub struct SimModel {
    /// Charges by cost name (a charge of `n` units counts `n`).
    pub charges: std::collections::BTreeMap<&'static str, u64>,
    /// The cache-line model: RMWs, stores, loads, transfers, upgrades, misses.
    pub lines: slat_vt::LineStats,
    /// The lock model: acquires, queued, barged.
    pub locks: slat_vt::LockStats,
    /// Entry writes kept for walks behind in virtual time, and walks that saw an older value.
    pub versions: slat_vt::VersionStats,
}

impl SimModel {
    fn of(stats: &slat_vt::SimStats) -> SimModel {
        let charges = Cost::ALL
            .iter()
            .filter_map(|&c| Some((slat_vt::cost_name(c)?, stats.charged(c))))
            .collect();
        SimModel {
            charges,
            lines: stats.lines,
            locks: stats.locks,
            versions: stats.versions,
        }
    }

    /// One text line: the model's headline counters.
    fn line(m: &serde_json::Value) -> Option<String> {
        model_line(m)
    }
}

/// One text line of a report's or a phase's `sim_model`: the model's headline counters.
pub fn model_line(m: &serde_json::Value) -> Option<String> {
    let n = |a: &str, b: &str| m.get(a)?.get(b)?.as_u64();
    Some(format!(
            "Model: {} line transfers ({} late), {} upgrades, {} misses; {} of {} lock acquires queued; {} walk loads saw an older entry",
            n("lines", "transfers")?,
            n("lines", "late_transfers")?,
            n("lines", "upgrades")?,
            n("lines", "misses")?,
            n("locks", "queued")?,
            n("locks", "acquires")?,
            n("versions", "stale_reads")?,
        ))
}

/// `a` and `b` with their counters combined by `op`, member by member (objects of one
/// shape, as [`SimModel`] serialises): two runs' sum, or a phase's difference.
fn zip_counters(
    a: &serde_json::Value,
    b: &serde_json::Value,
    op: fn(u64, u64) -> u64,
) -> serde_json::Value {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => Value::Object(
            x.iter()
                .map(|(k, v)| {
                    let w = y
                        .get(k)
                        .map_or_else(|| v.clone(), |w| zip_counters(v, w, op));
                    (k.clone(), w)
                })
                .collect(),
        ),
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(x), Some(y)) => Value::from(op(x, y)),
            _ => a.clone(),
        },
        _ => a.clone(),
    }
}

impl ClockReport {
    /// A real-time run.
    pub fn real() -> ClockReport {
        ClockReport {
            clock: "real",
            profile: None,
            profile_hash: None,
            wall_s: None,
            sim_hooks: None,
            sim_switches: None,
            sim_lookahead_ns: None,
            sim_accesses: None,
            sim_faults: None,
            sim_accesses_per_s: None,
            sim_faults_per_s: None,
            sim_model: None,
        }
    }

    /// The text line of a virtual run (none for a real one: its output is unchanged).
    pub fn line(&self) -> Option<String> {
        let mut l = format!(
            "Clock: virtual, cost profile {} ({}), lookahead {} ns; simulated in {:.3} s of wall time, {} scheduler calls, {} baton switches; {:.0} accesses/s",
            self.profile.as_deref()?,
            self.profile_hash.as_deref()?,
            self.sim_lookahead_ns?,
            self.wall_s?,
            self.sim_hooks?,
            self.sim_switches?,
            self.sim_accesses_per_s?,
        );
        if let Some(f) = self.sim_faults_per_s {
            l.push_str(&format!(", {f:.0} faults/s"));
        }
        if let Some(m) = self.sim_model.as_ref().and_then(SimModel::line) {
            l.push('\n');
            l.push_str(&m);
        }
        Some(l)
    }

    /// The report of two virtual runs one after the other with the same profile (a
    /// benchmark that runs each variant in a simulation of its own): their wall times,
    /// calls, switches, accesses and faults added, the speeds over the sum. A real-time
    /// report stays as it is.
    pub fn merged(&self, other: &ClockReport) -> ClockReport {
        let add = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_add(b?));
        let Some(wall) = self.wall_s.zip(other.wall_s).map(|(a, b)| a + b) else {
            return self.clone();
        };
        let accesses = add(self.sim_accesses, other.sim_accesses);
        let faults = add(self.sim_faults, other.sim_faults);
        ClockReport {
            wall_s: Some(wall),
            sim_hooks: add(self.sim_hooks, other.sim_hooks),
            sim_switches: add(self.sim_switches, other.sim_switches),
            sim_accesses: accesses,
            sim_faults: faults,
            sim_accesses_per_s: accesses.map(|n| per_second(n, wall)),
            sim_faults_per_s: faults.map(|n| per_second(n, wall)),
            sim_model: match (&self.sim_model, &other.sim_model) {
                (Some(a), Some(b)) => Some(zip_counters(a, b, u64::saturating_add)),
                (a, b) => a.clone().or_else(|| b.clone()),
            },
            ..self.clone()
        }
    }

    /// Adds the faults of a virtual run to its speed figures, from the simulated machine's
    /// engine counters (`stats`: the backend's; the fast, fixed, spurious and retried faults).
    pub fn count_faults(&mut self, stats: &serde_json::Value) {
        let Some(wall) = self.wall_s else { return };
        let faults: u64 = ["pf_fast", "pf_fixed", "pf_spurious", "pf_retry"]
            .iter()
            .filter_map(|k| stats.get(*k).and_then(serde_json::Value::as_u64))
            .fold(0, u64::saturating_add);
        self.sim_faults = Some(faults);
        self.sim_faults_per_s = Some(per_second(faults, wall));
    }
}

impl ClockArgs {
    /// The simulation of a `--clock virtual` run (started, the calling thread its host CPU),
    /// `None` in real time.
    pub fn start(&self) -> CliResult<Option<VirtualRun>> {
        if !self.is_virtual() && self.lookahead_ns.is_some() {
            return Err(CliError::bad("--lookahead needs --clock virtual"));
        }
        let profile = self.profile()?;
        profile.map(VirtualRun::start_with).transpose()
    }

    /// The profile of a `--clock virtual` run (`--cost-profile` or the built-in one), `None`
    /// in real time; a profile given without `--clock virtual`, or a file that is not a valid
    /// profile, is refused (exit status 2) with one line naming the file.
    pub fn profile(&self) -> CliResult<Option<Profile>> {
        match (&self.cost_profile, self.is_virtual()) {
            (Some(_), false) => Err(CliError::bad(
                "--cost-profile needs --clock virtual (a real-time run has no cost profile)",
            )),
            (None, false) => Ok(None),
            (None, true) => self.with_lookahead(Profile::host_default()).map(Some),
            (Some(path), true) => {
                if let Some(p) = builtin(path) {
                    return self.with_lookahead(p).map(Some);
                }
                let p = Profile::load(path).map_err(|e| {
                    let names = match path.exists() {
                        true => String::new(),
                        false => format!(
                            " (nor a built-in profile: {})",
                            slat_vt::BUILTIN_PROFILES.join(", ")
                        ),
                    };
                    CliError::bad(format!(
                        "--cost-profile {}: {}{names}",
                        path.display(),
                        one_line(&e.to_string())
                    ))
                })?;
                self.with_lookahead(p).map(Some)
            }
        }
    }

    /// `p` with `--lookahead` applied, if given (checked against the profile's bounds).
    fn with_lookahead(&self, mut p: Profile) -> CliResult<Profile> {
        if let Some(ns) = self.lookahead_ns {
            p.model.lookahead = Entry::new(ns, "--lookahead");
            p.validate()
                .map_err(|e| CliError::bad(format!("--lookahead {ns:?}: {e}")))?;
        }
        Ok(p)
    }
}

/// The built-in profile `path` names, when no file of that name exists (a file wins, so a
/// profile saved as `x86-server` in the working directory is the one loaded).
fn builtin(path: &std::path::Path) -> Option<Profile> {
    if path.exists() {
        return None;
    }
    path.to_str().and_then(Profile::builtin)
}

/// Ends `vt` (a run's simulation, if virtual) once its machine is gone: the report's clock.
pub fn finish(vt: Option<VirtualRun>) -> CliResult<ClockReport> {
    vt.map_or_else(|| Ok(ClockReport::real()), VirtualRun::finish)
}

thread_local! {
    /// The simulation the calling thread started and runs as host CPU 0, if any.
    static CURRENT: std::cell::RefCell<Option<Arc<Sim>>> = const { std::cell::RefCell::new(None) };
}

/// The contention model's counters so far ([`SimModel`], as JSON) of the virtual run the
/// calling thread drives, `None` in real time. Charges count once their CPU has stopped
/// running (a vCPU thread that exited), so take them between phases whose threads are gone.
pub fn model_now() -> Option<serde_json::Value> {
    CURRENT.with(|c| {
        let sim = c.borrow().clone()?;
        serde_json::to_value(SimModel::of(&sim.stats())).ok()
    })
}

/// `a - b`, member by member (a phase's counters from two [`model_now`]s).
pub fn model_since(a: &serde_json::Value, b: &serde_json::Value) -> serde_json::Value {
    zip_counters(a, b, u64::saturating_sub)
}

impl VirtualRun {
    /// Starts a simulation with `profile` and makes the calling thread host CPU 0.
    pub fn start_with(profile: Profile) -> CliResult<VirtualRun> {
        let sim = Arc::new(Sim::new(profile, 0).map_err(runtime)?);
        let host = sim.register("host").map_err(runtime)?;
        host.attach().map_err(runtime)?;
        CURRENT.with(|c| *c.borrow_mut() = Some(Arc::clone(&sim)));
        Ok(VirtualRun {
            sim,
            host: Some(host),
            wall: Instant::now(),
        })
    }

    /// What the machine registers its threads with.
    pub fn threads(&self) -> Arc<dyn SimThreads> {
        Arc::new(Threads(Arc::clone(&self.sim)))
    }

    /// Ends the host's part (after the machine is gone) and the simulation: its report, or
    /// why the run failed (a deadlock, the watchdog, hooks from unregistered threads).
    pub fn finish(mut self) -> CliResult<ClockReport> {
        CURRENT.with(|c| c.borrow_mut().take());
        drop(self.host.take());
        let stats = self.sim.finish().map_err(runtime)?;
        let p = self.sim.profile();
        let wall = self.wall.elapsed().as_secs_f64();
        let accesses = stats.charged(Cost::GuestAccess);
        Ok(ClockReport {
            clock: "virtual",
            profile: Some(p.name.clone()),
            profile_hash: Some(p.hash()),
            wall_s: Some(wall),
            sim_hooks: Some(stats.hooks),
            sim_switches: Some(stats.switches),
            sim_lookahead_ns: Some(p.model.lookahead.ns),
            sim_accesses: Some(accesses),
            sim_faults: None,
            sim_accesses_per_s: Some(per_second(accesses, wall)),
            sim_faults_per_s: None,
            sim_model: serde_json::to_value(SimModel::of(&stats)).ok(),
        })
    }
}

/// A (TOML parser's) multi-line message as one line: its first line, and its last when that
/// says what is wrong (the lines between quote the file).
fn one_line(msg: &str) -> String {
    let lines: Vec<&str> = msg
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    match lines.as_slice() {
        [] => String::new(),
        [only] => (*only).to_string(),
        [first, .., last] => format!("{first}: {last}"),
    }
}

/// `n` per second of `wall` seconds (0 for no time).
fn per_second(n: u64, wall: f64) -> f64 {
    if wall > 0.0 {
        n as f64 / wall
    } else {
        0.0
    }
}

fn runtime(e: slat_vt::SimError) -> CliError {
    CliError::Runtime(e.to_string())
}

struct Threads(Arc<Sim>);

impl SimThreads for Threads {
    fn register(&self, name: &str) -> Result<Box<dyn ThreadToken>, String> {
        let h = self.0.register(name).map_err(|e| e.to_string())?;
        Ok(Box::new(Token(h)))
    }

    fn register_observer(&self, name: &str) -> Result<Box<dyn ThreadToken>, String> {
        let h = self.0.register_observer(name).map_err(|e| e.to_string())?;
        Ok(Box::new(Token(h)))
    }

    fn step_out(&self) {
        // Only misuse (a thread that runs no CPU) fails, and then there is nothing to leave.
        let _ = slat_vt::detach_current();
    }

    fn step_in(&self) {
        let _ = slat_vt::attach_current();
    }

    fn sleep(&self, d: Duration) {
        sleep(d);
    }
}

struct Token(CpuHandle);

impl ThreadToken for Token {
    fn attach(&mut self) {
        // A failed simulation lets the thread run in real time; `finish` reports it.
        let _ = self.0.attach();
    }
}
