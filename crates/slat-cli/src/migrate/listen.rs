//! `slat migrate-listen`: receive migrations, verify them and run the guests, on the driver.
//! One run is one incoming migration, received into a machine of its own; `--repeat N`
//! receives N one after the other on the same endpoint. The endpoint is opened by `check`,
//! which the driver calls once before the first run: its address is printed before any
//! run's progress, and a source can connect from then on.

use super::guest::machine_spec;
use super::*;
use crate::args::backing;
use crate::migrate_report::Dest;
use crate::output::Better::Lower;
use slat_migrate::transport::Listener;
use slat_migrate::{DestConfig, Destination};
use slat_workload::parse_size;
use std::cell::RefCell;
use std::rc::Rc;

/// Flags of `slat migrate-listen`.
#[derive(Debug, Clone, Args)]
pub struct ListenArgs {
    /// Where migrations come from: tcp:HOST:PORT or HOST:PORT (port 0: any free port,
    /// printed), unix:PATH (created; must not exist), fd:N (an inherited connected socket,
    /// pipe or file: one migration) or file:PATH (restore a snapshot `slat migrate --to
    /// file:PATH` wrote).
    #[arg(long)]
    pub listen: Endpoint,
    /// The machine incoming guests run on.
    #[arg(long, value_enum, default_value = "sim")]
    pub backend: BackendArg,
    /// Host memory behind guest RAM (as for the source).
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// Milliseconds the guest runs here after the switch-over (0: leave it stopped;
    /// at most 600000).
    #[arg(long = "resume-ms", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 200)]
    pub resume_ms: u64,
    /// Failed incoming migrations to survive, keeping the guest's memory so the source can
    /// reconnect and resume (0-1000; with --repeat, per migration).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=MAX_RETRIES as i64), default_value_t = 0)]
    pub retries: u32,
    /// Seconds without data from a connected source before the incoming migration fails
    /// (1-86400; there is no "never": 0 is refused, so a silent source cannot hold the
    /// destination forever). Waiting for a source to connect has no time limit.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_S), default_value_t = 30)]
    pub timeout: u64,
    /// Largest guest accepted (k/m/g/t suffixes; default: the host's RAM and swap, which
    /// bound a larger value too).
    #[arg(long = "max-memory", value_parser = parse_size)]
    pub max_memory: Option<u64>,
    /// Most page streams a source may open beside its connection (1-16; 1 refuses page
    /// streams: the source's `--connections N` needs N here or more).
    #[arg(long, value_name = "N", value_parser = super::parse::connections, default_value_t = slat_migrate::stream::MAX_STREAMS)]
    pub connections: u32,
    // `--json`; `--repeat N` receives N migrations one after the other (from `slat migrate
    // --repeat N`), each into a machine of its own; `--plot` is refused (the source draws the
    // migration).
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
}

/// `migrate-listen` as a benchmark: its flags and the endpoint, once `check` opened it (with
/// the address it describes itself by).
#[derive(Clone)]
pub struct Listen {
    a: ListenArgs,
    at: Rc<RefCell<Option<(Listener, String)>>>,
}

impl Listen {
    pub fn new(a: ListenArgs) -> Listen {
        let at = Rc::default();
        Listen { a, at }
    }
}

impl Benchmark for Listen {
    type Report = Dest;
    const NAME: &'static str = "migrate-listen";

    fn common(&self) -> Common<'_> {
        Common {
            backends: std::slice::from_ref(&self.a.backend),
            vary: &[],
            out: &self.a.out,
        }
    }

    fn refuse(&self) -> Option<String> {
        let why = "--plot: migrate-listen has nothing to draw (the source's `slat migrate --plot` draws the migration)";
        self.a.out.plot.is_some().then(|| why.to_string())
    }

    fn check(&self) -> CliResult {
        let a = &self.a;
        check_machine(&a.machine, a.backend, a.backing, &[])?;
        if matches!(a.listen, Endpoint::Fd(_)) && (a.out.repeat > 1 || a.retries > 0) {
            return Err(bad(
                "--listen fd:N carries one migration: --repeat and --retries need tcp: or unix:",
            ));
        }
        let listener = match &a.listen {
            Endpoint::Fd(n) => Listener::Fd(Some(claim_fd(&a.listen, *n)?)),
            at => Listener::bind(at).map_err(|e| failed(format!("cannot listen on {at}: {e}")))?,
        };
        let local = listener.describe();
        let what = format!("{} machine", a.backend.name());
        progress(
            quiet(a.out.json),
            &format!("listening on {local} for a migration ({what})"),
        );
        *self.at.borrow_mut() = Some((listener, local));
        Ok(())
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Dest> {
        let mut at = self.at.borrow_mut();
        let (listener, local) = at
            .as_mut()
            .ok_or("migrate-listen: the endpoint is not open")?;
        Ok(Dest(receive_one(&self.a, listener, local)?))
    }

    fn metrics(&self) -> Vec<Metric<Dest>> {
        METRICS.to_vec()
    }

    fn print(&self, r: &Dest) {
        text::print_dest(r)
    }
}

/// The figures `migrate-listen --repeat` summarizes.
#[rustfmt::skip]
const METRICS: &[Metric<Dest>] = &[
    Metric { name: "total migration time", unit: "s", better: Lower, get: |d| Some(d.0.total.as_secs_f64()) },
    Metric { name: "setup", unit: "s", better: Lower, get: |d| Some(d.0.setup.as_secs_f64()) },
    Metric { name: "verification hashing", unit: "s", better: Lower, get: |d| Some(d.0.verify_time.as_secs_f64()) },
    Metric { name: "stream received", unit: "bytes", better: Lower, get: |d| Some(d.0.bytes as f64) },
];

/// Serves connections on `listener` until one migration completes, into a destination of its
/// own, surviving `--retries` failed ones.
fn receive_one(
    a: &ListenArgs,
    listener: &mut Listener,
    local: &str,
) -> CliResult<slat_migrate::DestReport> {
    let q = quiet(a.out.json);
    let cfg = DestConfig {
        resume_for: Duration::from_millis(a.resume_ms),
        timeout: Duration::from_secs(a.timeout),
        max_memory: a.max_memory.unwrap_or(0),
        max_streams: a.connections,
        delta: true,
    };
    let mut spec = machine_spec(&a.machine, a.backend);
    spec.backing = a.backing;
    let mut dest = Destination::new(bench::factory(spec), cfg);
    // The source's page streams and post-copy's preempt channel come to the same socket.
    if let Some(a) = listener.acceptor(Duration::from_secs(a.timeout)) {
        dest.set_acceptor(a);
    }
    let mut failures = 0;
    loop {
        let c = (listener.accept(Duration::from_secs(a.timeout)))
            .map_err(|e| failed(format!("accepting on {local}: {e}")))?;
        let peer = c.peer.clone();
        progress(q, &format!("incoming migration from {peer}"));
        let err = match dest.serve_channel(c) {
            Ok(r) => return Ok(r),
            Err(err) => err,
        };
        failures += 1;
        if failures > a.retries {
            if let Some(lost) = dest.abandon_postcopy() {
                return Err(failed(format!("incoming migration from {peer}: {lost}")));
            }
            return Err(failed(format!(
                "incoming migration from {peer} failed: {err}"
            )));
        }
        progress(q, &format!(
            "incoming migration from {peer} failed: {err}; {} waiting for the source to retry ({failures} of {})",
            when(dest.holds_session(), "keeping the guest's memory and"),
            a.retries
        ));
    }
}
