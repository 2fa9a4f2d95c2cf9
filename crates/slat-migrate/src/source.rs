//! The sending end; documented on [`Source`].

use crate::dirty_limit::{DirtyLimitConfig, DirtyLimiter, RingCounts, RingMeter};
use crate::error::GuestError;
use crate::error::{Cause, MigrateError, ProtocolError, StreamError};
use crate::guest::{splitmix, Guest, GuestHarvester, GuestLog, Memory};
use crate::link::{Faults, Link};
use crate::stream::{
    self, BatchBuilder, Compression, FrameReader, Hello, Msg, MAX_BATCH_PAGES, MAX_HASHES,
    PAGE_BYTES, VERSION,
};
use crate::throttle::AutoConverge;
use crate::transport::{self, Channel, Endpoint};
use crate::verify::{self, Digests, VerifyMode, NEVER_SENT, RANGE_PAGES};
use slat_addr::PageIndex;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A round's pages: taken from the guest's harvester, committed as they are acknowledged.
type RoundSet<'h> = slat_dirty::DirtySet<'h, GuestLog>;

/// How the source migrates.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// Longest acceptable stop-and-copy transfer: pre-copy ends once the owed pages could be
    /// sent in this time at the measured bandwidth.
    pub max_downtime: Duration,
    /// Pre-copy rounds after the full copy before stopping regardless.
    pub max_rounds: u32,
    /// Bytes per second on the wire (0: unlimited).
    pub bandwidth: u64,
    /// Compression of non-zero pages.
    pub compression: Compression,
    /// How the switch-over verifies memory ([`VerifyMode::Sent`]: digests kept while
    /// pre-copy runs, off the paused path).
    pub verify: VerifyMode,
    /// Throttle the vCPUs when the guest outruns the link.
    pub auto_converge: bool,
    /// First throttle step, percent.
    pub throttle_initial: u32,
    /// Later throttle steps, percent.
    pub throttle_step: u32,
    /// Converge by QEMU's dirty-limit instead of auto-converge: each vCPU's dirty rate is
    /// measured from its dirty ring and only the vCPUs above the limit are slowed
    /// ([`crate::dirty_limit`]). Needs the ring log and a guest with per-vCPU throttles;
    /// auto-converge is off while it is on.
    pub dirty_limit: Option<DirtyLimitConfig>,
    /// Pages per batch (one acknowledgement each).
    pub batch_pages: u32,
    /// Connect, write and acknowledgement timeout.
    pub timeout: Duration,
    /// Deliberate faults (tests).
    #[doc(hidden)]
    pub faults: Faults,
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            max_downtime: Duration::from_millis(300),
            max_rounds: 30,
            bandwidth: 0,
            compression: Compression::None,
            verify: VerifyMode::Sent,
            auto_converge: true,
            throttle_initial: 20,
            throttle_step: 10,
            dirty_limit: None,
            batch_pages: 256,
            timeout: Duration::from_secs(30),
            faults: Faults::default(),
        }
    }
}

/// One round.
#[derive(Debug, Clone, Default)]
pub struct RoundReport {
    /// 0: the full copy; the stop-and-copy round is the last.
    pub round: u32,
    /// Pages sent.
    pub pages: u64,
    /// Of which zero pages (sent as markers).
    pub zero_pages: u64,
    /// Bytes written to the socket.
    pub bytes: u64,
    /// From the first byte to the last acknowledgement.
    pub time: Duration,
    /// Pages the next harvest reported: what the guest dirtied while this round ran.
    pub dirtied: u64,
    /// Throttle while the round ran.
    pub throttle: u32,
    /// The round ran with the vCPUs stopped.
    pub stop_and_copy: bool,
}

impl RoundReport {
    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        rate(self.bytes as f64, self.time)
    }
}

/// A completed migration.
#[derive(Debug, Clone, Default)]
pub struct MigrationReport {
    /// Which attempt of this source succeeded (1 = the first).
    pub attempt: u32,
    /// The destination kept this guest's memory from an earlier attempt.
    pub resumed: bool,
    /// The destination's machine.
    pub dest_backend: String,
    /// Connect to the destination's welcome.
    pub setup: Duration,
    /// Connect to switch-over.
    pub total: Duration,
    /// vCPUs paused to switch-over (final harvest + final send + verification + round trip).
    pub downtime: Duration,
    /// Of the downtime: the harvest after the pause.
    pub final_harvest: Duration,
    /// Of the downtime: sending the last pages until acknowledged.
    pub final_send: Duration,
    /// Of the downtime: saving and sending the device state.
    pub state: Duration,
    /// Device-state blobs sent.
    pub state_blobs: u32,
    /// Their bytes.
    pub state_bytes: u64,
    /// Of the downtime: hashing on both sides and the answer.
    pub verify: Duration,
    /// The channel was one-way (a file): nothing was acknowledged.
    pub one_way: bool,
    /// Every round, the stop-and-copy round last.
    pub rounds: Vec<RoundReport>,
    /// Pre-copy ended because the rest fitted `max_downtime` (not because of `max_rounds`).
    pub converged: bool,
    /// The transfer time the last decision expected for the stop-and-copy round.
    pub expected_final: Duration,
    /// Highest throttle, percent.
    pub throttle_max: u32,
    /// (round, percent) at each throttle change.
    pub throttle_changes: Vec<(u32, u32)>,
    /// vCPU time taken away by the throttle during the attempt (summed over vCPUs).
    pub throttled: Duration,
    /// Guest activity ([`Guest::activity`], e.g. writes) from connect to pause.
    pub guest_writes: u64,
    /// Connect to pause.
    pub precopy: Duration,
    /// Pages the harvests reported after the full copy started (dirtied during pre-copy).
    pub dirtied: u64,
    /// Verification ranges compared (all matched).
    pub verify_ranges: u64,
    /// How memory was verified.
    pub verify_mode: VerifyMode,
    /// Pages hashed on this side with the vCPUs paused: the stop-and-copy round's with
    /// [`VerifyMode::Sent`], all memory with [`VerifyMode::Full`].
    pub paused_hashed_pages: u64,
    /// Pages per range.
    pub range_pages: u32,
    /// What the destination reported after running the guest: (pages touched, for how long).
    pub dest_resumed: Option<(u64, Duration)>,
    /// Guest activity per vCPU from connect to pause (empty if the guest does not count it).
    pub vcpu_writes: Vec<u64>,
    /// What dirty-limit did, when it was on.
    pub dirty_limit: Option<DirtyLimitReport>,
}

/// Dirty-limit over one attempt.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DirtyLimitReport {
    /// Dirty pages per second per vCPU.
    pub limit: u64,
    /// The measurement period.
    pub period: Duration,
    /// Periods measured.
    pub periods: u32,
    /// Highest throttle per vCPU, per mille.
    pub max_permille: Vec<u32>,
    /// Throttle per vCPU at the pause, per mille.
    pub last_permille: Vec<u32>,
    /// Dirty pages per second per vCPU over the last period.
    pub last_rates: Vec<f64>,
}

impl MigrationReport {
    /// Pages sent over all rounds.
    pub fn pages(&self) -> u64 {
        self.rounds.iter().map(|r| r.pages).sum()
    }
    /// Bytes sent over all rounds (page batches only).
    pub fn bytes(&self) -> u64 {
        self.rounds.iter().map(|r| r.bytes).sum()
    }
    /// Average bandwidth over all rounds, bytes per second.
    pub fn bandwidth(&self) -> f64 {
        rate(
            self.bytes() as f64,
            self.rounds.iter().map(|r| r.time).sum(),
        )
    }
    /// Pages dirtied per second during pre-copy (as the harvests saw them).
    pub fn dirty_rate(&self) -> f64 {
        rate(self.dirtied as f64, self.precopy)
    }
    /// Guest writes per second during pre-copy.
    pub fn write_rate(&self) -> f64 {
        rate(self.guest_writes as f64, self.precopy)
    }
}

fn rate(x: f64, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        x / t.as_secs_f64()
    }
}

/// What the source reports while it works.
#[derive(Debug)]
pub enum Event<'a> {
    /// The destination answered.
    Connected {
        /// It kept this guest's memory from an earlier attempt.
        resume: bool,
        /// Its machine.
        backend: &'a str,
    },
    /// A round finished (its `dirtied` is filled in by the next harvest, so still 0 here).
    Round(&'a RoundReport),
    /// The throttle changed.
    Throttle(u32),
    /// The vCPUs stopped; this many pages are owed.
    Paused(u64),
    /// Where the migration stands: after every harvest and after the stop-and-copy round.
    Progress(Progress),
    /// Dirty-limit measured the vCPUs and set their throttles (once per period).
    DirtyLimit {
        /// Dirty pages per second per vCPU allowed.
        limit: u64,
        /// Each vCPU's dirty pages per second over the period.
        rates: &'a [f64],
        /// Each vCPU's throttle now, per mille.
        throttles: &'a [u32],
    },
}

/// A snapshot of the migration's progress ([`Event::Progress`]), for a live,
/// machine-readable stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// The round about to run (pre-copy), or the stop-and-copy round that just ended.
    pub round: u32,
    /// Pages sent so far in this attempt.
    pub pages_sent: u64,
    /// Pages still owed to the destination.
    pub pages_remaining: u64,
    /// Pages the last harvest reported (dirtied while the last round ran).
    pub dirtied: u64,
    /// Bytes per second measured over the rounds so far.
    pub bandwidth: f64,
    /// The stop-and-copy transfer time the owed pages would take at that bandwidth.
    pub expected_downtime: Duration,
    /// The auto-converge throttle, percent.
    pub throttle: u32,
    /// Dirty-limit's throttle per vCPU, per mille (empty when dirty-limit is off).
    pub vcpu_throttle_permille: Vec<u32>,
    /// The vCPUs are paused (the stop-and-copy round ran).
    pub paused: bool,
    /// Since the attempt connected.
    pub elapsed: Duration,
}

/// The sending end: pre-copy rounds driven by the dirty log, auto-converge, stop-and-copy,
/// verification and switch-over; and what survives a failed attempt.
///
/// # What the source remembers between attempts
///
/// [`Source`] owns the guest's dirty log as a transactional harvester
/// ([`crate::GuestHarvester`], `slat_dirty`'s — the one a VMM uses on its own KVM VM) whose
/// *owed* pages are the pages the destination does not provably hold in their current
/// contents. A page is owed when a take reports it dirty (or, for a destination that starts
/// empty, all pages at once: `mark_all`). Each round takes the owed pages as a set; a page
/// leaves the set ([`slat_dirty::DirtySet::commit_pages`]) only when the destination
/// acknowledges the batch that carried it, and the round commits the (then empty) set. Dirty
/// logging stays on from the first attempt to the end, so a write at any time is either in the
/// log or after the read that sent the page.
///
/// A take *consumes* the log: once it returns, the engine (or KVM) no longer remembers those
/// pages. If the connection breaks after a take and before the destination acknowledged the
/// pages, the set is dropped on the error path — aborted — and its pages are owed again, so
/// the next attempt sends them first. A source that forgot them would resume into a
/// destination with stale pages, which is the bug of Firecracker issue #4545 (a failed
/// snapshot write lost the dirty bits KVM had already cleared);
/// [`crate::Faults::skip_merge_back`] reproduces it (pages leave the set when queued, not when
/// acknowledged) so a test can watch verification catch it.
///
/// # Rounds
///
/// Round 0 sends everything owed (all memory for a fresh destination). Each later round
/// first harvests; if the owed pages could then be sent within `max_downtime` at the
/// bandwidth measured so far — or `max_rounds` are done — pre-copy ends. Otherwise the round
/// sends them. The destination acknowledges every batch; a round ends when all its batches
/// are acknowledged, and only then does the next harvest run (an acknowledgement arriving
/// after a later harvest re-added the page would wrongly clear it).
///
/// # Switch-over
///
/// Pause the vCPUs → final harvest → send what is owed → send the device state
/// ([`Guest::save_state`]) → verification → the destination compares and answers → on a
/// match, send `Commit`. Downtime is measured from the pause to the moment `Commit` is
/// written. On any failure before `Commit` the vCPUs run again on the source
/// ([`Guest::resume`]).
///
/// # Read-only regions
///
/// A read-only region has no dirty log: its pages are owed until the first round of an
/// attempt that carries them completes (acknowledged), and are sent again only to a
/// destination that starts over.
///
/// # One-way channels
///
/// Into a file nothing is acknowledged: a page leaves the owed set once its batch is
/// written, the destination is taken to start empty, and the reader checks the hashes when
/// it reads the stream back.
pub struct Source {
    guest: Arc<dyn Guest>,
    cfg: SourceConfig,
    /// The read-only regions' pages are owed (not yet acknowledged by this session's
    /// destination).
    ro_owed: bool,
    /// The guest's dirty log and the pages owed, from the first attempt on (before it, every
    /// page is owed).
    log: Option<GuestHarvester>,
    session: u64,
    attempts: u32,
    logging: bool,
    migrated: bool,
    /// The guest ran when the attempt began (so a failed one resumes it).
    was_running: bool,
    /// Per page (memory index), the digest of the bytes last sent ([`VerifyMode::Sent`]).
    digests: Digests,
    /// Ring entries per vCPU, counted by the harvester's log in the ring mode (dirty-limit).
    ring_counts: Arc<RingCounts>,
}

/// Frames the reader thread received, or why it stopped.
type Inbox = Receiver<Result<Msg, StreamError>>;

impl Source {
    /// A source for `guest` (running or not: the migration pauses it at the switch-over, and
    /// resumes it if an attempt fails after that).
    pub fn new(guest: Arc<dyn Guest>, cfg: SourceConfig) -> Source {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ ((std::process::id() as u64) << 32);
        Source {
            guest,
            cfg,
            ro_owed: true,
            log: None,
            session: splitmix(seed),
            attempts: 0,
            logging: false,
            migrated: false,
            was_running: false,
            digests: Digests::default(),
            ring_counts: Arc::default(),
        }
    }

    /// The guest.
    pub fn guest(&self) -> &Arc<dyn Guest> {
        &self.guest
    }

    /// Pages the destination does not have yet, as far as this source knows.
    pub fn owed(&self) -> u64 {
        let Ok(mem) = Memory::new(&*self.guest) else {
            return 0;
        };
        let ro: u64 = mem.map().read_only().iter().map(|r| r.1).sum();
        let rw = mem.pages() - ro;
        self.log.as_ref().map_or(rw, GuestHarvester::owed_pages) + if self.ro_owed { ro } else { 0 }
    }

    /// The guest has been switched over to a destination.
    pub fn migrated(&self) -> bool {
        self.migrated
    }

    /// Attempts so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The configuration (tests change faults between attempts).
    pub fn config_mut(&mut self) -> &mut SourceConfig {
        &mut self.cfg
    }

    /// Migrates the guest to `to`: an [`Endpoint`] in QEMU's URI forms (`tcp:HOST:PORT` or
    /// `HOST:PORT`, `unix:PATH`, `file:PATH`; `fd:N` goes through [`Source::migrate_over`]).
    /// On failure the guest keeps running here, and a later call continues where the
    /// destination's memory allows.
    pub fn migrate(
        &mut self,
        to: &str,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<MigrationReport, MigrateError> {
        let ep: Endpoint = to.parse().map_err(|e| MigrateError::Connect {
            addr: to.to_string(),
            why: Cause::new(e),
        })?;
        self.migrate_to(&ep, progress)
    }

    /// Migrates the guest to endpoint `to`.
    pub fn migrate_to(
        &mut self,
        to: &Endpoint,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<MigrationReport, MigrateError> {
        self.check()?;
        self.attempts += 1;
        let r = transport::connect(to, self.cfg.timeout).and_then(|c| self.attempt(c, progress));
        self.settle_attempt(r)
    }

    /// Migrates the guest over a channel of the caller's (any `Read + Write` stream, an
    /// inherited descriptor, a file).
    pub fn migrate_over(
        &mut self,
        channel: Channel,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<MigrationReport, MigrateError> {
        self.check()?;
        self.attempts += 1;
        let r = self.attempt(channel, progress);
        self.settle_attempt(r)
    }

    fn check(&self) -> Result<(), MigrateError> {
        if self.migrated {
            return Err(MigrateError::AlreadyMigrated);
        }
        if self.cfg.timeout.is_zero() {
            return Err(MigrateError::ZeroTimeout);
        }
        if self.cfg.batch_pages == 0 || self.cfg.batch_pages > MAX_BATCH_PAGES {
            return Err(MigrateError::BatchPages(self.cfg.batch_pages));
        }
        if let Some(dl) = self.cfg.dirty_limit {
            dl.check()?;
            if self.guest.limitable_vcpus() == 0 {
                return Err(MigrateError::DirtyLimitUnsupported(
                    self.guest.kind().to_string(),
                ));
            }
        }
        Ok(())
    }

    /// After an attempt: the throttle off, and a guest stopped for a switch-over that did
    /// not happen runs again.
    fn settle_attempt(
        &mut self,
        r: Result<MigrationReport, MigrateError>,
    ) -> Result<MigrationReport, MigrateError> {
        self.guest.set_throttle(0);
        for i in 0..self.guest.limitable_vcpus() {
            self.guest.set_vcpu_throttle(i, 0);
        }
        if r.is_err() && !self.migrated && !self.guest.running() && self.was_running {
            if let (Err(restart), Err(first)) = (self.guest.resume(), &r) {
                return Err(MigrateError::Restart {
                    first: Box::new(first.clone()),
                    restart,
                });
            }
        }
        r
    }

    fn attempt(
        &mut self,
        c: Channel,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<MigrationReport, MigrateError> {
        let t_connect = Instant::now();
        let Channel {
            reader,
            writer,
            closer,
            peer,
        } = c;
        let Some(writer) = writer else {
            return Err(MigrateError::Connect {
                addr: peer,
                why: Cause::new(std::io::Error::other("the channel cannot be written")),
            });
        };
        let close = closer.clone();
        let (inbox, thread) = match reader {
            Some(r) => {
                let (inbox, h) = spawn_reader(r, self.cfg.timeout)?;
                (Some(inbox), Some(h))
            }
            None => (None, None),
        };
        let link = Link::new(writer, closer, self.cfg.bandwidth, self.cfg.faults);
        let mut conn = Conn {
            link,
            inbox,
            timeout: self.cfg.timeout,
            peer,
        };
        let r = self.run(&mut conn, t_connect, progress);
        // Ends the reader thread whatever happened: its read fails, and with the inbox gone a
        // send it is blocked in (the channel is bounded) fails too.
        if let Some(c) = close {
            c();
        }
        drop(conn);
        if let Some(h) = thread {
            let _ = h.join();
        }
        r
    }

    /// One attempt over `conn`: the handshake, pre-copy, stop-and-copy, verification and
    /// switch-over, each a step below.
    fn run(
        &mut self,
        conn: &mut Conn,
        t_connect: Instant,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<MigrationReport, MigrateError> {
        let mut report = MigrationReport {
            attempt: self.attempts,
            range_pages: RANGE_PAGES,
            one_way: conn.one_way(),
            ..MigrationReport::default()
        };
        self.was_running = self.guest.running();
        let guest = self.guest.clone();
        let mem = Memory::new(&*guest).map_err(GuestError::from)?;
        self.handshake(conn, &mem, &mut report)?;
        report.setup = t_connect.elapsed();
        let log = harvester(&mut self.log, &*self.guest, &self.ring_counts)?;
        if self.cfg.dirty_limit.is_some() && log.mode() != slat_dirty::LogMode::Ring {
            return Err(MigrateError::DirtyLimitNeedsRing(match log.mode() {
                slat_dirty::LogMode::Get => "GET_DIRTY_LOG",
                _ => "a bitmap",
            }));
        }
        let starts = mem
            .map()
            .log_starts(log.slot_info())
            .map_err(GuestError::from)?;
        if !report.resumed {
            // A destination that starts empty needs every page.
            log.mark_all();
            self.ro_owed = true;
        }
        if self.cfg.verify == VerifyMode::Sent
            && (!report.resumed || self.digests.len() as u64 != mem.pages())
        {
            // Every page goes out again, and is hashed as it does.
            self.digests = Digests::new(usize::try_from(mem.pages()).unwrap_or(0), NEVER_SENT);
        } else if self.cfg.verify == VerifyMode::Full {
            self.digests = Digests::default();
        }
        let ro = if self.ro_owed {
            mem.map().read_only()
        } else {
            Vec::new()
        };
        progress(Event::Connected {
            resume: report.resumed,
            backend: &report.dest_backend,
        });
        if !self.logging {
            self.guest.set_dirty_logging(true)?;
            self.logging = true;
        }
        let writes0 = self.guest.activity().unwrap_or(0);
        let vcpu_writes0 = self.guest.vcpu_activity();
        let throttled0 = self.guest.throttled();
        let limit = self.cfg.dirty_limit.map(|cfg| Limit {
            l: DirtyLimiter::new(
                cfg,
                self.guest.limitable_vcpus(),
                &self.ring_counts.per_vcpu(),
                Instant::now(),
            ),
            counts: self.ring_counts.clone(),
            guest: self.guest.clone(),
        });
        let mut ac = AutoConverge::new(
            self.cfg.auto_converge && self.cfg.dirty_limit.is_none(),
            self.cfg.throttle_initial,
            self.cfg.throttle_step,
        );
        let mut sender = Sender {
            builder: BatchBuilder::new(self.cfg.compression),
            seq: 0,
            batch: self.cfg.batch_pages as usize,
            faults: self.cfg.faults,
            starts,
            ro,
            digests: std::mem::take(&mut self.digests),
            t0: t_connect,
            limit,
            collected: 0,
        };
        let r = self.rounds(conn, &mem, &mut sender, &mut ac, &mut report, progress);
        // The digests outlive the attempt: a resumed destination holds what they describe.
        self.digests = std::mem::take(&mut sender.digests);
        report.dirty_limit = sender.limit.as_ref().map(|x| DirtyLimitReport {
            limit: x.l.config().limit,
            period: x.l.config().period,
            periods: x.l.periods,
            max_permille: x.l.max_permille.clone(),
            last_permille: x.l.throttles(),
            last_rates: x.l.rates.clone(),
        });
        let t_pause = r?;
        report.vcpu_writes = self
            .guest
            .vcpu_activity()
            .iter()
            .zip(vcpu_writes0.iter().chain(std::iter::repeat(&0)))
            .map(|(a, b)| a.saturating_sub(*b))
            .collect();

        report.precopy = t_pause - t_connect;
        report.guest_writes = self.guest.activity().unwrap_or(0).saturating_sub(writes0);
        report.throttled = self.guest.throttled().saturating_sub(throttled0);
        self.ro_owed = false;

        let t = Instant::now();
        self.send_state(conn, &mut report)?;
        report.state = t.elapsed();

        let t = Instant::now();
        report.verify_ranges = self.verify(conn, &mem)?;
        report.verify = t.elapsed();
        report.verify_mode = self.cfg.verify;
        report.paused_hashed_pages = match self.cfg.verify {
            VerifyMode::Sent => report.rounds.last().map_or(0, |r| r.pages),
            VerifyMode::Full => mem.pages(),
        };

        // Switch-over: from the written `Commit` on, the guest is the destination's.
        conn.send(&Msg::Commit, "switch-over")?;
        if conn.one_way() {
            // A snapshot is taken once it is durable.
            conn.link.flush().map_err(|e| {
                MigrateError::stream("switch-over", StreamError::io(e, conn.timeout))
            })?;
        }
        report.downtime = t_pause.elapsed();
        report.total = t_connect.elapsed();
        self.migrated = true;
        // The destination runs the guest briefly and says so; not hearing it does not undo a
        // committed switch-over.
        if !conn.one_way() {
            if let Ok(Msg::Resumed { touched, micros }) =
                conn.recv("the destination's resume report")
            {
                report.dest_resumed = Some((touched, Duration::from_micros(micros)));
            }
        }
        report.throttle_max = ac.max();
        report.throttle_changes = ac.changes.clone();
        Ok(report)
    }

    /// Pre-copy, the pause and the stop-and-copy round; returns when the guest paused.
    fn rounds(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        sender: &mut Sender,
        ac: &mut AutoConverge,
        report: &mut MigrationReport,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<Instant, MigrateError> {
        let round = self.precopy(conn, mem, sender, ac, report, progress)?;
        if let Some(d) = self.cfg.faults.pause_delay {
            std::thread::sleep(d);
        }
        let t_pause = Instant::now();
        self.guest.pause()?;
        self.stop_and_copy(conn, mem, sender, round, report, progress)?;
        Ok(t_pause)
    }

    /// Sends the preamble and the hello; records the destination's welcome in `report`.
    fn handshake(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        report: &mut MigrationReport,
    ) -> Result<(), MigrateError> {
        let phase = "handshake";
        let version = self.cfg.faults.version.unwrap_or(VERSION);
        conn.send_raw(&stream::preamble(version), phase)?;
        conn.send(
            &Msg::Hello(Hello {
                session: self.session,
                attempt: self.attempts,
                one_way: conn.one_way(),
                regions: mem.map().wire(),
                machine: self.guest.machine(),
                compression: self.cfg.compression,
                range_pages: RANGE_PAGES,
                verify: self.cfg.verify,
                backend: self.guest.kind().into(),
            }),
            phase,
        )?;
        if conn.one_way() {
            // Nobody answers a file; its reader starts empty.
            report.resumed = false;
            report.dest_backend = conn.peer.clone();
            return Ok(());
        }
        match conn.recv(phase)? {
            Msg::Welcome { resume, backend } => {
                report.resumed = resume;
                report.dest_backend = backend;
                Ok(())
            }
            m => Err(unexpected(phase, &m)),
        }
    }

    /// Pre-copy: round 0 sends everything owed; each later round first harvests, and ends
    /// pre-copy when the rest fits `max_downtime` (or after `max_rounds`). Returns the number
    /// of the round that comes next (the stop-and-copy round).
    fn precopy(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        sender: &mut Sender,
        ac: &mut AutoConverge,
        report: &mut MigrationReport,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<u32, MigrateError> {
        let log = harvester(&mut self.log, &*self.guest, &self.ring_counts)?;
        let mut round = 0u32;
        loop {
            // Re-armed before it returns; dropped on an error below, it is owed again.
            let mut set = log.take()?;
            let dirtied = set.collected() + std::mem::take(&mut sender.collected);
            if let Some(prev) = report.rounds.last_mut() {
                prev.dirtied = dirtied;
                report.dirtied += dirtied;
                if let Some(t) = ac.after_round(prev.round, dirtied, prev.pages) {
                    self.guest.set_throttle(t);
                    progress(Event::Throttle(t));
                }
            }
            // The take just counted the ring: no second collect needed.
            sender.tick_limit(None, progress)?;
            let owed = set.pages() + sender.ro_pages();
            progress(Event::Progress(progress_of(
                report,
                round,
                owed,
                dirtied,
                self.guest.throttle(),
                sender.vcpu_throttles(),
                false,
                sender.t0,
            )));
            if round > 0 && precopy_done(&self.cfg, owed, round, report) {
                // Not sent: owed again, for the take after the pause.
                set.abort();
                return Ok(round);
            }
            let r = sender.round(
                conn,
                mem,
                self.guest.throttle(),
                &mut set,
                round,
                false,
                &format!("round {round}"),
                progress,
            )?;
            // Every page was acknowledged (and left the set) before the round returned.
            set.commit();
            // Range hashes of what this round sent, while the guest runs.
            sender.digests.refresh();
            progress(Event::Round(&r));
            report.rounds.push(r);
            round += 1;
        }
    }

    /// With the vCPUs paused: the final harvest, then the stop-and-copy round `round`.
    fn stop_and_copy(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        sender: &mut Sender,
        round: u32,
        report: &mut MigrationReport,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(), MigrateError> {
        let log = harvester(&mut self.log, &*self.guest, &self.ring_counts)?;
        let t = Instant::now();
        let mut set = if self.cfg.faults.skip_final_harvest {
            log.take_owed()
        } else {
            log.take()?
        };
        // The last pre-copy round's writes reach up to the pause.
        if let Some(prev) = report.rounds.last_mut() {
            prev.dirtied += set.collected();
            report.dirtied += set.collected();
        }
        report.final_harvest = t.elapsed();
        progress(Event::Paused(set.pages() + sender.ro_pages()));
        if let Some(n) = self.cfg.faults.cut_in_final_round {
            conn.link.cut_in(n);
        }
        let t = Instant::now();
        let last = sender.round(
            conn,
            mem,
            self.guest.throttle(),
            &mut set,
            round,
            true,
            "stop-and-copy",
            progress,
        )?;
        set.commit();
        report.final_send = t.elapsed();
        progress(Event::Round(&last));
        report.rounds.push(last);
        progress(Event::Progress(progress_of(
            report,
            round,
            0,
            0,
            self.guest.throttle(),
            sender.vcpu_throttles(),
            true,
            sender.t0,
        )));
        Ok(())
    }

    /// The device state, saved with the vCPUs paused, sent blob by blob and counted.
    fn send_state(
        &self,
        conn: &mut Conn,
        report: &mut MigrationReport,
    ) -> Result<(), MigrateError> {
        let phase = "device state";
        if let Some(n) = self.cfg.faults.cut_in_state {
            conn.link.cut_in(n);
        }
        let blobs = self.guest.save_state()?;
        let bytes = crate::state::check_blobs(&blobs)?;
        let n = blobs.len() as u32;
        for b in blobs {
            conn.send(&Msg::State(b), phase)?;
        }
        conn.send(&Msg::StateEnd { blobs: n, bytes }, phase)?;
        report.state_blobs = n;
        report.state_bytes = bytes;
        Ok(())
    }

    /// Verification: sends the hashes of memory as it is now (the vCPUs stopped) and the
    /// request; returns the ranges the destination found all matching (over a one-way
    /// channel, the ranges the reader will check).
    fn verify(&mut self, conn: &mut Conn, mem: &Memory<'_>) -> Result<u64, MigrateError> {
        let phase = "verification";
        let pages = mem.pages();
        let nranges = verify::ranges(pages, RANGE_PAGES);
        let mut hashes = Vec::with_capacity(HASHES_PER_FRAME);
        let mut buf = vec![0u8; RANGE_PAGES as usize * PAGE_BYTES];
        let mut first = 0u64;
        for i in 0..nranges {
            if self.cfg.verify == VerifyMode::Sent {
                // `digests` has one entry per page (set at the start of the attempt); only
                // the ranges the stop-and-copy round touched are hashed now.
                hashes.push(self.digests.range(i).unwrap_or([0; 32]));
            } else {
                let (a, b) = verify::range_pages(i, RANGE_PAGES, pages);
                // `b - a <= RANGE_PAGES`: the range fits the buffer.
                let bytes = &mut buf[..(b - a) as usize * PAGE_BYTES];
                mem.stopped_read(a, b, bytes)?;
                hashes.push(verify::hash_range(i, bytes));
            }
            // Frames of 256 hashes (64 MiB of guest memory): the destination hashes one
            // while the next is computed here.
            if hashes.len() == HASHES_PER_FRAME || i + 1 == nranges {
                let n = hashes.len() as u64;
                let hashes = std::mem::replace(&mut hashes, Vec::with_capacity(HASHES_PER_FRAME));
                conn.send(&Msg::Hashes { first, hashes }, phase)?;
                first += n;
            }
        }
        conn.send(
            &Msg::Verify {
                ranges: nranges,
                range_pages: RANGE_PAGES,
            },
            phase,
        )?;
        if conn.one_way() {
            return Ok(nranges);
        }
        match conn.recv(phase)? {
            Msg::Verified {
                ranges,
                mismatched,
                first,
            } => {
                let v = verify::VerifyReport {
                    ranges,
                    range_pages: RANGE_PAGES,
                    mismatched,
                    first,
                };
                if !v.ok() || ranges != nranges {
                    return Err(MigrateError::Verification {
                        ranges,
                        mismatched,
                        range_pages: RANGE_PAGES,
                        first: v.describe_first(),
                    });
                }
                Ok(ranges)
            }
            m => Err(unexpected(phase, &m)),
        }
    }
}

/// Whether pre-copy ends before round `round` (> 0): the `owed` pages could be sent within
/// `max_downtime` at the bandwidth measured so far (recorded in `report`), or the rounds are
/// used up.
fn precopy_done(cfg: &SourceConfig, owed: u64, round: u32, report: &mut MigrationReport) -> bool {
    let expect = expected_transfer(report, owed);
    report.expected_final = expect;
    if expect <= cfg.max_downtime {
        report.converged = true;
        return true;
    }
    round > cfg.max_rounds || round == u32::MAX
}

/// How long `owed` pages would take at the bandwidth and bytes per page measured so far.
fn expected_transfer(report: &MigrationReport, owed: u64) -> Duration {
    let sent: u64 = report.rounds.iter().map(|r| r.bytes).sum();
    let spent: Duration = report.rounds.iter().map(|r| r.time).sum();
    let per_page = sent as f64 / report.pages().max(1) as f64;
    let bw = rate(sent as f64, spent).max(1.0);
    Duration::from_secs_f64(owed as f64 * per_page / bw)
}

/// The progress after the rounds in `report`, with `owed` pages left.
#[allow(clippy::too_many_arguments)]
fn progress_of(
    report: &MigrationReport,
    round: u32,
    owed: u64,
    dirtied: u64,
    throttle: u32,
    vcpu_throttle_permille: Vec<u32>,
    paused: bool,
    t0: Instant,
) -> Progress {
    Progress {
        round,
        pages_sent: report.pages(),
        pages_remaining: owed,
        dirtied,
        bandwidth: report.bandwidth(),
        expected_downtime: expected_transfer(report, owed),
        throttle,
        vcpu_throttle_permille,
        paused,
        elapsed: t0.elapsed(),
    }
}

/// The guest's harvester, made on first use with every page owed.
///
/// In the ring mode its log counts every entry per vCPU into `counts` on the way
/// ([`RingMeter`]), for dirty-limit; the harvester still gets every entry.
fn harvester<'a>(
    log: &'a mut Option<GuestHarvester>,
    guest: &dyn Guest,
    counts: &Arc<RingCounts>,
) -> Result<&'a mut GuestHarvester, GuestError> {
    let h = match log.take() {
        Some(h) => h,
        None => {
            let mut h = guest.dirty_log()?;
            if h.mode() == slat_dirty::LogMode::Ring {
                // Fresh: nothing owed yet that re-wrapping could lose.
                let src = RingMeter::new(h.into_source(), counts.clone());
                h = slat_dirty::Harvester::from_source(Box::new(src) as GuestLog)
                    .map_err(GuestError::harvest)?;
            }
            h.mark_all();
            h
        }
    };
    Ok(log.insert(h))
}

/// Hashes per `Hashes` frame.
const HASHES_PER_FRAME: usize = 256;
const _: () = assert!(HASHES_PER_FRAME <= MAX_HASHES as usize);

/// The connection of one attempt.
struct Conn {
    link: Link,
    /// The destination's frames (none over a one-way channel).
    inbox: Option<Inbox>,
    timeout: Duration,
    /// Where the channel leads.
    peer: String,
}

impl Conn {
    fn send_raw(&mut self, bytes: &[u8], phase: &str) -> Result<(), MigrateError> {
        match self.link.write_all(bytes) {
            Ok(()) => Ok(()),
            // The destination may have said why it stopped reading.
            Err(e) => Err(self
                .refusal()
                .unwrap_or_else(|| MigrateError::stream(phase, StreamError::io(e, self.timeout)))),
        }
    }

    fn send(&mut self, m: &Msg, phase: &str) -> Result<(), MigrateError> {
        self.send_raw(&stream::frame(m), phase)
    }

    /// Nothing comes back.
    fn one_way(&self) -> bool {
        self.inbox.is_none()
    }

    /// A refusal the destination sent, if one is waiting.
    fn refusal(&self) -> Option<MigrateError> {
        let inbox = self.inbox.as_ref()?;
        let deadline = Instant::now() + Duration::from_millis(200);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match inbox.recv_timeout(left) {
                Ok(Ok(Msg::Refuse(reason))) => {
                    return Some(MigrateError::Refused {
                        who: "destination",
                        reason,
                    })
                }
                Ok(Ok(_)) => continue,
                _ => return None,
            }
        }
        None
    }

    /// The next message, waiting at most the timeout.
    fn recv(&mut self, phase: &str) -> Result<Msg, MigrateError> {
        let Some(inbox) = &self.inbox else {
            return Err(MigrateError::stream(
                phase,
                StreamError::Closed {
                    what: "a reply (the channel is one-way)",
                },
            ));
        };
        match inbox.recv_timeout(self.timeout) {
            Ok(Ok(Msg::Refuse(reason))) => Err(MigrateError::Refused {
                who: "destination",
                reason,
            }),
            Ok(Ok(m)) => Ok(m),
            Ok(Err(e)) => Err(MigrateError::stream(phase, e)),
            Err(RecvTimeoutError::Timeout) => Err(MigrateError::stream(
                phase,
                StreamError::Timeout(self.timeout),
            )),
            Err(RecvTimeoutError::Disconnected) => Err(MigrateError::stream(
                phase,
                StreamError::Closed { what: "the reply" },
            )),
        }
    }

    /// Like `recv`, without waiting.
    fn try_recv(&mut self, phase: &str) -> Result<Option<Msg>, MigrateError> {
        let Some(inbox) = &self.inbox else {
            return Ok(None);
        };
        match inbox.try_recv() {
            Ok(Ok(Msg::Refuse(reason))) => Err(MigrateError::Refused {
                who: "destination",
                reason,
            }),
            Ok(Ok(m)) => Ok(Some(m)),
            Ok(Err(e)) => Err(MigrateError::stream(phase, e)),
            Err(mpsc::TryRecvError::Empty) => Ok(None),
            Err(mpsc::TryRecvError::Disconnected) => Err(MigrateError::stream(
                phase,
                StreamError::Closed {
                    what: "the acknowledgements",
                },
            )),
        }
    }
}

/// Sends rounds of pages in batches and settles their acknowledgements.
struct Sender {
    builder: BatchBuilder,
    seq: u64,
    batch: usize,
    faults: Faults,
    /// Memory index of each dirty-log slot's first page.
    starts: Vec<u64>,
    /// Read-only pages still owed, as (first, count) runs: sent with the next round.
    ro: Vec<(u64, u64)>,
    /// Per page, the digest of what was last sent (empty: verification reads memory).
    digests: Digests,
    /// When the attempt connected.
    t0: Instant,
    /// Dirty-limit, when on.
    limit: Option<Limit>,
    /// Pages dirty-limit's collects moved to the pages owed during the last round: dirtied
    /// while it ran, so counted with the next take's.
    collected: u64,
}

/// Dirty-limit's controller and what it reads and drives.
struct Limit {
    l: DirtyLimiter,
    counts: Arc<RingCounts>,
    guest: Arc<dyn Guest>,
}

impl Sender {
    /// Read-only pages still owed.
    fn ro_pages(&self) -> u64 {
        self.ro.iter().map(|r| r.1).sum()
    }

    /// Dirty-limit's per-vCPU throttles now (empty when it is off).
    fn vcpu_throttles(&self) -> Vec<u32> {
        self.limit.as_ref().map_or(Vec::new(), |x| x.l.throttles())
    }

    /// Once a period: brings the ring counts up to date (collecting into the pages owed for
    /// the next round, when a round's `set` is out: nothing is lost to the migration), then
    /// lets the limiter set each vCPU's throttle.
    fn tick_limit(
        &mut self,
        set: Option<&mut RoundSet<'_>>,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(), MigrateError> {
        let Some(x) = &mut self.limit else {
            return Ok(());
        };
        if !x.l.due(Instant::now()) {
            return Ok(());
        }
        if let Some(set) = set {
            self.collected += set.collect()?;
        }
        let counts = x.counts.per_vcpu();
        if let Some(th) = x.l.update(&counts, Instant::now()) {
            for (i, &t) in th.iter().enumerate() {
                x.guest.set_vcpu_throttle(i, t);
            }
            progress(Event::DirtyLimit {
                limit: x.l.config().limit,
                rates: &x.l.rates,
                throttles: &th,
            });
        }
        Ok(())
    }

    /// Sends every page of `owed`; returns when the destination acknowledged all of them
    /// (each acknowledged page has left the set).
    #[allow(clippy::too_many_arguments)]
    fn round(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        throttle: u32,
        owed: &mut RoundSet<'_>,
        round: u32,
        stop_and_copy: bool,
        phase: &str,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<RoundReport, MigrateError> {
        let t0 = Instant::now();
        let bytes0 = conn.link.written();
        let mut todo = pages_of(owed, &self.starts);
        for &(first, n) in &self.ro {
            todo.extend((first..first + n).map(|p| (NO_SLOT, 0, p)));
        }
        let mut inflight: VecDeque<(u64, Vec<Page>)> = VecDeque::new();
        let mut page = vec![0u8; PAGE_BYTES];
        let mut zero = 0u64;
        for chunk in todo.chunks(self.batch) {
            // A window of batches in flight: the destination's acknowledgements (and so the
            // reader's bounded inbox) never run more than this far behind.
            while inflight.len() >= MAX_INFLIGHT {
                let m = conn.recv(phase)?;
                settle(m, &mut inflight, owed, phase)?;
            }
            self.builder.start(self.seq, round);
            for &(slot, off, p) in chunk {
                mem.read_page(p, &mut page)?;
                self.builder.push(p, &page);
                if !self.digests.is_empty() {
                    self.digests.set(p, verify::page_digest(&page));
                }
                if slot == NO_SLOT {
                    continue;
                }
                if self.faults.skip_merge_back || conn.one_way() {
                    // The bug under test: the page counts as delivered once it is queued.
                    owed.commit_pages(slot, PageIndex::new(off), 1)
                        .map_err(GuestError::harvest)?;
                }
            }
            zero += self.builder.zero as u64;
            let frame = self.builder.frame();
            if let Err(e) = conn.link.write_all(frame) {
                return Err(conn.refusal().unwrap_or_else(|| {
                    MigrateError::stream(phase, StreamError::io(e, conn.timeout))
                }));
            }
            if !conn.one_way() {
                inflight.push_back((self.seq, chunk.to_vec()));
            }
            self.seq += 1;
            while let Some(m) = conn.try_recv(phase)? {
                settle(m, &mut inflight, owed, phase)?;
            }
            if !stop_and_copy {
                self.tick_limit(Some(owed), progress)?;
            }
        }
        conn.send(
            &Msg::RoundEnd {
                round,
                pages: todo.len() as u64,
            },
            phase,
        )?;
        while !inflight.is_empty() {
            let m = conn.recv(phase)?;
            settle(m, &mut inflight, owed, phase)?;
        }
        // Every read-only page went out with this round and is acknowledged (or written).
        self.ro.clear();
        Ok(RoundReport {
            round,
            pages: todo.len() as u64,
            zero_pages: zero,
            bytes: conn.link.written() - bytes0,
            time: t0.elapsed(),
            dirtied: 0,
            throttle,
            stop_and_copy,
        })
    }
}

/// A page of a round: (slot index in the harvester, page in the slot, memory index); a
/// read-only page has the slot [`NO_SLOT`].
type Page = (usize, u64, u64);

/// The slot of a page without a dirty log (a read-only region's).
const NO_SLOT: usize = usize::MAX;

/// The pages of `set`, in memory-index order (`starts`: each slot's first memory index,
/// checked against the map by [`crate::MemoryMap::log_starts`]).
fn pages_of(set: &RoundSet<'_>, starts: &[u64]) -> Vec<Page> {
    let mut out = Vec::with_capacity(usize::try_from(set.pages()).unwrap_or(0));
    for (i, &start) in starts.iter().enumerate().take(set.slot_info().len()) {
        for (first, n) in set.ranges(i) {
            out.extend((first..first + n).map(|p| (i, p, start + p)));
        }
    }
    out
}

/// Applies an acknowledgement: the pages of the oldest batch in flight have landed, and leave
/// the set (a later abort does not owe them again).
fn settle(
    m: Msg,
    inflight: &mut VecDeque<(u64, Vec<Page>)>,
    owed: &mut RoundSet<'_>,
    phase: &str,
) -> Result<(), MigrateError> {
    let Msg::Ack { seq } = m else {
        return Err(unexpected(phase, &m));
    };
    match inflight.pop_front() {
        Some((s, pages)) if s == seq => {
            for (slot, off, _) in pages.into_iter().filter(|p| p.0 != NO_SLOT) {
                owed.commit_pages(slot, PageIndex::new(off), 1)
                    .map_err(GuestError::harvest)?;
            }
            Ok(())
        }
        _ => Err(MigrateError::stream(
            phase,
            StreamError::Protocol(ProtocolError::AckOrder { seq }),
        )),
    }
}

fn unexpected(phase: &str, m: &Msg) -> MigrateError {
    MigrateError::stream(
        phase,
        StreamError::Protocol(ProtocolError::Unexpected { msg: m.name() }),
    )
}

/// Batches sent and not yet acknowledged, at most.
const MAX_INFLIGHT: usize = 1024;

/// Frames the reader thread holds for the source, at most: the acknowledgements of a full
/// window and the few other replies. A destination that sends more is not read from until
/// the source catches up (its socket fills; it cannot make this side buffer without bound).
const INBOX: usize = MAX_INFLIGHT + 16;

/// Reads the destination's frames on a thread of their own, so acknowledgements drain while
/// the source is busy writing. Only the frames a destination sends are passed on (all of
/// them small); any other ends the connection.
fn spawn_reader(
    s: Box<dyn Read + Send>,
    timeout: Duration,
) -> Result<(Inbox, JoinHandle<()>), MigrateError> {
    let (tx, rx): (SyncSender<_>, _) = mpsc::sync_channel(INBOX);
    let h = std::thread::Builder::new()
        .name("migrate-acks".into())
        .spawn(move || {
            let mut r = FrameReader::new(s, timeout);
            loop {
                let m = match r.read_msg("the destination's reply") {
                    Ok(
                        m @ (Msg::Welcome { .. }
                        | Msg::Refuse(_)
                        | Msg::Ack { .. }
                        | Msg::Verified { .. }
                        | Msg::Resumed { .. }),
                    ) => Ok(m),
                    Ok(m) => Err(StreamError::Protocol(ProtocolError::Unexpected {
                        msg: m.name(),
                    })),
                    Err(e) => Err(e),
                };
                let stop = m.is_err();
                if tx.send(m).is_err() || stop {
                    break;
                }
            }
        })
        .map_err(|e| MigrateError::Thread(Cause::new(e)))?;
    Ok((rx, h))
}
