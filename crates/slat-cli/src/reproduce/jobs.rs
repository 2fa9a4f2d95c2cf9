//! `slat reproduce --jobs N`: up to N commands at once, each in its own `slat` process.
//!
//! A virtual-time run is deterministic per process, so each runs exactly as its printed
//! command would in a fresh process: the hidden `slat reproduce-worker BENCH -- ARGS` parses
//! the flags as the runner does, runs one round through the driver and prints one JSON line
//! ([`Outcome`]). Simulations never share a process: concurrent ones would share malloc arenas
//! and reuse each other's freed blocks, and the line model would see other addresses.
//!
//! The [`Pool`] is N threads of this process, each starting one worker process at a time from
//! a queue: every run the tables will ask for, queued up front in the order the rows ask for
//! them ([`plan`]), and any other run (`--sensitivity`'s) when asked for. [`Pool::take`] waits
//! for a run's result; a worker that fails becomes that run's error.

use super::experiments::{self, Bench};
use super::published::Seed;
use super::runner::{key, Runner};
use super::{sweep_cells, sweep_commands, what, Commands, Ctx, GET_SWEEP};
use crate::error::{CliError, CliResult};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Flags of the hidden `slat reproduce-worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The benchmark's subcommand.
    #[arg(value_parser = bench)]
    pub bench: Bench,
    /// Its flags, after `--`, as `slat reproduce` prints them.
    #[arg(last = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

fn bench(s: &str) -> Result<Bench, String> {
    let all = Bench::ALL.iter();
    all.copied()
        .find(|b| b.name() == s)
        .ok_or_else(|| format!("`{s}` is not a benchmark `slat reproduce` runs"))
}

/// One round of a command, as a worker prints it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    /// Each run's figures: name, unit, and the value's IEEE 754 bits (`null`: no such figure
    /// in that run). Bits, so the value read back is the one measured, to the last bit.
    pub runs: Vec<Vec<(String, String, Option<u64>)>>,
    pub pages_per_vcpu: Option<u64>,
}

/// Runs `slat reproduce-worker`: one round of the command, one JSON line on stdout.
pub fn worker(a: &WorkerArgs) -> CliResult {
    let out = Runner::outcome(a.bench, &a.args.join(" "))?;
    let line = serde_json::to_string(&out)
        .map_err(|e| CliError::Runtime(format!("reproduce-worker: {e}")))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .map_err(|e| CliError::Runtime(format!("reproduce-worker: stdout: {e}")))
}

/// A run to make: the command, which round of `--repeat` (from 0), and how to announce it.
#[derive(Debug, Clone)]
pub struct Want {
    pub bench: Bench,
    pub args: String,
    pub round: usize,
    /// The seed and the words of its progress line (`None`: silent, as `--sensitivity`'s runs
    /// are, which print their own progress).
    pub say: Option<(&'static str, String)>,
}

/// Every run the tables of `seeds` ask for, in the order their rows ask for them (as the
/// rows of one process would run them): 004's grid first, then each experiment's before and
/// after, round by round.
pub(super) fn plan(seeds: &[&'static Seed], ctx: &Ctx) -> Vec<Want> {
    let mut wants = Vec::new();
    for seed in seeds {
        let mut rows: Vec<(Bench, Commands)> = Vec::new();
        if seed.id == GET_SWEEP.row.seed {
            let cells = sweep_cells().map(|(sz, d)| sweep_commands(sz, d, "", ctx));
            rows.extend(cells.map(|c| (GET_SWEEP.row.bench, c)));
        }
        rows.extend(experiments::of(seed.id).map(|e| (e.bench, Commands::of(e, ctx))));
        for (bench, c) in rows.iter().filter(|(_, c)| c.needs.is_none()) {
            for round in 0..ctx.repeat {
                for args in &c.here {
                    wants.push(Want {
                        bench: *bench,
                        args: args.clone(),
                        round,
                        say: Some((seed.id, what(*bench, args, round + 1, ctx))),
                    });
                }
            }
        }
    }
    wants
}

/// A run queued, and its number among the announced ones.
struct Job {
    want: Want,
    n: usize,
}

/// A run's name in the pool: its command and round.
type Key = (String, usize);

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Every run ever queued (none runs twice).
    seen: HashSet<Key>,
    done: HashMap<Key, Result<Outcome, String>>,
    /// Announced runs queued, and finished.
    announced: usize,
    finished: usize,
    /// Pool threads still taking jobs: with none, nothing waits for a result forever.
    alive: usize,
    stop: bool,
}

impl State {
    fn enqueue(&mut self, want: Want, front: bool) {
        if !self.seen.insert((key(want.bench, &want.args), want.round)) {
            return;
        }
        if want.say.is_some() {
            self.announced += 1;
        }
        let job = Job {
            want,
            n: self.announced,
        };
        match front {
            true => self.queue.push_front(job),
            false => self.queue.push_back(job),
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or finishes, a thread ends, or the pool stops.
    cv: Condvar,
    quiet: bool,
}

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    // The state stays consistent at every unlock; a panicked holder leaves it usable.
    s.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// N threads each running one worker process at a time. Dropped, it kills the workers still
/// running and waits for its threads.
pub struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    pub fn new(n: usize, quiet: bool) -> CliResult<Pool> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            quiet,
        });
        let mut pool = Pool {
            shared,
            threads: Vec::with_capacity(n),
        };
        for i in 0..n {
            let s = Arc::clone(&pool.shared);
            lock(&s).alive += 1;
            let t = std::thread::Builder::new().name(format!("reproduce-jobs-{i}"));
            match t.spawn(move || work(&s)) {
                Ok(h) => pool.threads.push(h),
                Err(e) => {
                    lock(&pool.shared).alive -= 1;
                    return Err(CliError::Runtime(format!(
                        "--jobs: cannot start a thread: {e}"
                    )));
                }
            }
        }
        Ok(pool)
    }

    /// Queues `wants` behind the runs already queued (a run queued before is not again).
    pub fn prefetch(&self, wants: Vec<Want>) {
        let mut st = lock(&self.shared);
        for w in wants {
            st.enqueue(w, false);
        }
        self.shared.cv.notify_all();
    }

    /// Round `round` of `slat BENCH ARGS`, waiting for it; queued first if it was not.
    pub fn take(&self, bench: Bench, args: &str, round: usize) -> CliResult<Outcome> {
        let k = (key(bench, args), round);
        let mut st = lock(&self.shared);
        if !st.seen.contains(&k) {
            let want = Want {
                bench,
                args: args.to_string(),
                round,
                say: None,
            };
            st.enqueue(want, true);
            self.shared.cv.notify_all();
        }
        loop {
            if let Some(r) = st.done.get(&k) {
                return r.clone().map_err(CliError::Runtime);
            }
            if st.alive == 0 || st.stop {
                let cmd = format!("slat {}", k.0);
                return Err(CliError::Runtime(format!(
                    "{cmd}: no worker left to run it"
                )));
            }
            st = self
                .shared
                .cv
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.shared).stop = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Counts a pool thread out when it ends, however it ends.
struct Alive<'a>(&'a Shared);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        lock(self.0).alive -= 1;
        self.0.cv.notify_all();
    }
}

/// A pool thread: the next queued job's worker process, until the pool stops.
fn work(s: &Shared) {
    let _alive = Alive(s);
    loop {
        let job = {
            let mut st = lock(s);
            loop {
                if st.stop {
                    return;
                }
                if let Some(j) = st.queue.pop_front() {
                    break j;
                }
                st = s.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let say = job.want.say.as_ref().filter(|_| !s.quiet);
        if let Some((seed, what)) = say {
            let _ = writeln!(
                std::io::stderr(),
                "[slat] reproduce {seed} #{}: {what}",
                job.n
            );
        }
        let t0 = Instant::now();
        let r = child(s, &job.want);
        let mut st = lock(s);
        if job.want.say.is_some() {
            st.finished += 1;
        }
        if let Some((seed, _)) = say {
            let (n, secs) = (job.n, t0.elapsed().as_secs_f64());
            let how = if r.is_ok() { "done" } else { "failed" };
            let of = format!("{} of {} runs finished", st.finished, st.announced);
            let _ = writeln!(
                std::io::stderr(),
                "[slat] reproduce {seed} #{n}: {how} in {secs:.1} s ({of})"
            );
        }
        let k = (key(job.want.bench, &job.want.args), job.want.round);
        st.done.insert(k, r);
        s.cv.notify_all();
    }
}

/// The `slat` binary running now: `/proc/self/exe` is this process's own file even when
/// the path was rebuilt since, so every worker runs the same build as the tables.
fn exe() -> std::path::PathBuf {
    let own = std::path::Path::new("/proc/self/exe");
    match own.exists() {
        true => own.to_path_buf(),
        false => std::env::current_exe().unwrap_or_else(|_| "slat".into()),
    }
}

/// Reads `r` to its end on a thread of its own (so neither pipe of a worker fills and stalls
/// it).
fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::io::Result<Option<JoinHandle<Vec<u8>>>> {
    let Some(mut r) = r else { return Ok(None) };
    let t = std::thread::Builder::new().name("reproduce-jobs-pipe".into());
    t.spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
    .map(Some)
}

fn joined(h: Option<JoinHandle<Vec<u8>>>) -> Vec<u8> {
    h.and_then(|h| h.join().ok()).unwrap_or_default()
}

/// One worker process for `w`: its outcome, or why it failed (naming the command).
fn child(s: &Shared, w: &Want) -> Result<Outcome, String> {
    let fail = |why: String| format!("slat {} {}: {why}", w.bench.name(), w.args);
    let mut cmd = Command::new(exe());
    cmd.args(["reproduce-worker", w.bench.name(), "--"])
        .args(w.args.split_whitespace())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd);
    let mut c = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot start a worker: {e}")))?;
    let pipes = drain(c.stdout.take()).and_then(|o| Ok((o, drain(c.stderr.take())?)));
    let (out, err) = match pipes {
        Ok(p) => p,
        Err(e) => {
            let _ = c.kill();
            let _ = c.wait();
            return Err(fail(format!("cannot read a worker: {e}")));
        }
    };
    let status = wait(s, &mut c).map_err(&fail)?;
    let (out, err) = (joined(out), joined(err));
    if !status.success() {
        return Err(fail(format!("{} ({})", last_line(&err), exit(status))));
    }
    let text = String::from_utf8_lossy(&out);
    serde_json::from_str(text.trim()).map_err(|e| fail(format!("worker's output: {e}")))
}

/// Makes the worker `cmd` starts end with the thread that starts it (which waits for it):
/// when `slat reproduce` is killed, its workers do not run on for minutes unseen.
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec; it makes only
    // async-signal-safe system calls (prctl, getppid) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then no signal would come.
            match u32::try_from(libc::getppid()) == Ok(parent) {
                true => Ok(()),
                false => Err(std::io::Error::from_raw_os_error(libc::ESRCH)),
            }
        });
    }
}

/// Waits for `c` to exit; kills it when the pool stops.
fn wait(s: &Shared, c: &mut Child) -> Result<ExitStatus, String> {
    loop {
        if let Some(status) = c.try_wait().map_err(|e| format!("worker: {e}"))? {
            return Ok(status);
        }
        let st = lock(s);
        if st.stop {
            drop(st);
            let _ = c.kill();
            let _ = c.wait();
            return Err("stopped".into());
        }
        // Woken early by the pool's stop; the timeout is how soon an exit is seen.
        let _ = s.cv.wait_timeout(st, Duration::from_millis(20));
    }
}

/// The worker's last line on stderr (its error), without the `slat: error: ` every error
/// line starts with.
fn last_line(err: &[u8]) -> String {
    let text = String::from_utf8_lossy(err);
    let line = text.lines().rev().map(str::trim).find(|l| !l.is_empty());
    let line = line.unwrap_or("no message");
    let line = line.strip_prefix("slat: ").unwrap_or(line);
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

fn exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        // SIGKILL from nobody the user knows of is most often the kernel's out-of-memory
        // killer: each seed-scale run takes gigabytes, and `--jobs` runs several at once.
        (None, Some(libc::SIGKILL)) => format!(
            "killed by signal {} (SIGKILL: if no one sent it, likely the kernel's out-of-memory killer; fewer --jobs run fewer at once)",
            libc::SIGKILL
        ),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        (None, None) => "ended".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_worker_says_how() {
        use std::os::unix::process::ExitStatusExt;
        // Raw wait statuses: a signal number alone, an exit code shifted left by 8.
        assert!(exit(ExitStatus::from_raw(9)).contains("out-of-memory killer"));
        assert_eq!(exit(ExitStatus::from_raw(15)), "killed by signal 15");
        assert_eq!(exit(ExitStatus::from_raw(1 << 8)), "exit status 1");
    }

    #[test]
    fn a_workers_error_is_its_last_line_without_the_prefix() {
        let err = b"[slat] progress\nslat: error: out of memory\n\n";
        assert_eq!(last_line(err), "out of memory");
        assert_eq!(last_line(b""), "no message");
        assert_eq!(last_line(b"slat: bad flag\n"), "bad flag");
    }

    #[test]
    fn every_benchmark_is_named_back() {
        for b in Bench::ALL {
            assert_eq!(bench(b.name()), Ok(b));
        }
        assert!(bench("migrate").is_err());
    }

    /// The value's bits survive JSON, where a decimal might not.
    #[test]
    fn an_outcome_round_trips_exactly() {
        let x = 0.1f64 + 0.2;
        let o = Outcome {
            runs: vec![vec![
                ("t".into(), "s".into(), Some(x.to_bits())),
                ("n".into(), "x".into(), None),
            ]],
            pages_per_vcpu: Some(4096),
        };
        let back: Outcome = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
        assert_eq!(back.runs[0][0].2.map(f64::from_bits), Some(x));
        assert_eq!(back.runs[0][1].2, None);
        assert_eq!(back.pages_per_vcpu, Some(4096));
    }
}
