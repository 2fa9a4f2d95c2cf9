//! The sending end; documented on [`Source`].
//!
//! An attempt ([`attempt`]) runs the handshake, the rounds ([`rounds`]: pre-copy, the pause,
//! stop-and-copy), the device state, verification and the switch-over; [`sender`] sends a
//! round's pages in batches and settles the acknowledgements that [`conn`]'s reader thread
//! passes on.

mod attempt;
pub(crate) mod cache;
mod conn;
mod postcopy;
mod rounds;
mod sender;
mod striped;

use crate::dirty_limit::{DirtyLimitConfig, RingCounts};
use crate::error::{Cause, MigrateError};
use crate::guest::{splitmix, Guest, GuestHarvester, GuestLog, Memory};
use crate::link::{Faults, Link};
use crate::stream::{Compression, MAX_BATCH_PAGES, MAX_STREAMS};
use crate::transport::Connector;
use crate::transport::{self, Channel, Endpoint};
use crate::verify::{Digests, VerifyMode};
use conn::{spawn_reader, Conn};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A round's pages: taken from the guest's harvester, committed as they are acknowledged.
type RoundSet<'h> = slat_dirty::DirtySet<'h, GuestLog>;

/// How the source migrates.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// Longest acceptable stop-and-copy transfer: pre-copy ends once the owed pages could be
    /// sent in this time at the bandwidth of the last round (QEMU's rule).
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
    /// Later throttle steps only as large as the measured dirty rate asks for (QEMU's
    /// `cpu-throttle-tailslow`; [`crate::throttle`]).
    pub throttle_tailslow: bool,
    /// Converge by QEMU's dirty-limit instead of auto-converge: each vCPU's dirty rate is
    /// measured from its dirty ring and only the vCPUs above the limit are slowed
    /// ([`crate::dirty_limit`]). Needs the ring log and a guest with per-vCPU throttles;
    /// auto-converge is off while it is on.
    pub dirty_limit: Option<DirtyLimitConfig>,
    /// Pages per batch (one acknowledgement each).
    pub batch_pages: u32,
    /// Page streams: 1 sends the pages over the one connection; N > 1 (at most
    /// [`crate::stream::MAX_STREAMS`]) opens N connections of their own beside it, stripes
    /// the batches across them and reads, hashes and compresses each stream's pages on a
    /// thread of its own. Needs an endpoint to connect to (`tcp:` or `unix:`).
    pub connections: u32,
    /// Connect, write and acknowledgement timeout.
    pub timeout: Duration,
    /// Switch to post-copy ([`crate::postcopy`]) after some pre-copy rounds or when
    /// pre-copy stalls (`None`: pre-copy only).
    pub postcopy: Option<crate::postcopy::PostcopyTrigger>,
    /// Most bytes of sent-page copies kept to send a re-dirtied page as a delta against
    /// ([`crate::stream::delta`]; 0: off, every page goes whole). Used when the destination
    /// accepts, over one page stream; the cache is at most the guest's size and allocated
    /// as pages are first sent.
    pub delta_cache: u64,
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
            throttle_tailslow: false,
            dirty_limit: None,
            batch_pages: 256,
            connections: 1,
            timeout: Duration::from_secs(30),
            postcopy: None,
            delta_cache: DEFAULT_DELTA_CACHE,
            faults: Faults::default(),
        }
    }
}

/// [`SourceConfig::delta_cache`]'s default: a guest of up to 1 GiB is cached whole (QEMU's
/// XBZRLE cache defaults to 64 MiB, which a guest sweeping more memory than that evicts
/// before any page is sent twice).
pub const DEFAULT_DELTA_CACHE: u64 = 1 << 30;

/// One round.
#[derive(Debug, Clone, Default)]
pub struct RoundReport {
    /// 0: the full copy; the stop-and-copy round is the last.
    pub round: u32,
    /// Pages sent.
    pub pages: u64,
    /// Of which zero pages (sent as markers).
    pub zero_pages: u64,
    /// Of which pages sent as deltas against the copy the destination held.
    pub delta_pages: u64,
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
    /// Page streams (1: the pages went over the one connection).
    pub connections: u32,
    /// Connect to the destination's welcome (and the page streams open).
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
    /// Post-copy's figures, when the migration switched over in post-copy (its downtime is
    /// then the pause to the run, and `total` runs to the last page and the commit).
    pub postcopy: Option<crate::postcopy::PostcopyReport>,
    /// The delta cache, when pages went as deltas.
    pub delta: Option<DeltaReport>,
}

/// The delta cache over one attempt ([`SourceConfig::delta_cache`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeltaReport {
    /// Bytes of page copies it may hold (at most the guest's size).
    pub cache_bytes: u64,
    /// Bytes of them allocated by the end.
    pub allocated: u64,
    /// Pages sent as deltas.
    pub hits: u64,
    /// Non-zero pages sent whole: first sends, evicted copies, deltas no smaller.
    pub misses: u64,
    /// Chunks of the cache the host could not give (their pages went whole).
    pub refused: u64,
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
    /// Pages sent over all rounds and post-copy.
    pub fn pages(&self) -> u64 {
        let post = self.postcopy.as_ref();
        self.rounds.iter().map(|r| r.pages).sum::<u64>()
            + post.map_or(0, |p| p.background_pages + p.preempt_pages)
    }
    /// Bytes sent over all rounds and post-copy (page batches only).
    pub fn bytes(&self) -> u64 {
        self.rounds.iter().map(|r| r.bytes).sum::<u64>()
            + self.postcopy.as_ref().map_or(0, |p| p.bytes)
    }
    /// Average bandwidth over all rounds and post-copy, bytes per second.
    pub fn bandwidth(&self) -> f64 {
        let post = self
            .postcopy
            .as_ref()
            .map_or(Duration::ZERO, |p| p.time_to_last_page);
        rate(
            self.bytes() as f64,
            self.rounds.iter().map(|r| r.time).sum::<Duration>() + post,
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
        /// Page streams open to it (1: the pages go over the one connection).
        connections: u32,
    },
    /// A round finished (its `dirtied` is filled in by the next harvest, so still 0 here).
    Round(&'a RoundReport),
    /// The throttle changed.
    Throttle(u32),
    /// The vCPUs stopped; this many pages are owed.
    Paused(u64),
    /// The guest runs on the destination in post-copy; this many pages are still here.
    Postcopy {
        /// Pages the destination lacked at the switch.
        discarded: u64,
    },
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
    /// The stop-and-copy transfer time the owed pages would take at the last round's
    /// bandwidth (what the switch-over decision uses).
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
/// bandwidth of the last round (QEMU's rule) — or `max_rounds` are done — pre-copy ends.
/// Otherwise the round sends them, ending early once the rest fits `max_downtime` at its own
/// rate (QEMU's sync point; the rest stays owed). The destination acknowledges every batch;
/// a round ends when all the batches it sent are acknowledged, and only then does the next
/// harvest run (an acknowledgement arriving after a later harvest re-added the page would
/// wrongly clear it).
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
    /// Post-copy's state once the guest switched over in post-copy.
    post: Option<postcopy::PostState>,
    /// Why the rounds just ended in post-copy (its trigger), for the attempt.
    switch: Option<&'static str>,
    /// Opens the extra connections: page streams, post-copy's preempt channel.
    connector: Option<Connector>,
}

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
            post: None,
            switch: None,
            connector: None,
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
        // The extra connections (page streams, post-copy's preempt channel) go where the
        // control connection goes; a file carries one stream.
        self.connector = match to {
            Endpoint::Tcp(_) | Endpoint::Unix(_) => {
                let (to, timeout) = (to.clone(), self.cfg.timeout);
                Some(Box::new(move || transport::connect(&to, timeout)))
            }
            _ => None,
        };
        self.check()?;
        if self.cfg.connections > 1 && self.connector.is_none() {
            return Err(MigrateError::StreamsNeedEndpoint(self.cfg.connections));
        }
        self.attempts += 1;
        let r = transport::connect(to, self.cfg.timeout).and_then(|c| self.attempt(c, progress));
        self.settle_attempt(r)
    }

    /// Migrates the guest over a channel of the caller's (any `Read + Write` stream, an
    /// inherited descriptor, a file); page streams and post-copy's preempt channel are opened
    /// with the connector ([`Source::set_connector`]).
    pub fn migrate_over(
        &mut self,
        channel: Channel,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<MigrationReport, MigrateError> {
        self.check()?;
        if self.cfg.connections > 1 && self.connector.is_none() {
            return Err(MigrateError::StreamsNeedEndpoint(self.cfg.connections));
        }
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
        if self.cfg.connections == 0 || self.cfg.connections > MAX_STREAMS {
            return Err(MigrateError::Connections(self.cfg.connections));
        }
        if self.cfg.postcopy.is_some() && self.cfg.connections > 1 {
            // Post-copy's requests and pages run on the control connection and one preempt
            // channel; striping them over page streams too is not built.
            return Err(crate::postcopy::PostcopyError::WithStreams(self.cfg.connections).into());
        }
        if self.cfg.postcopy.is_some() && self.cfg.verify != VerifyMode::Sent {
            return Err(crate::postcopy::PostcopyError::NeedsSentVerify.into());
        }
        if (self.cfg.postcopy.is_some() || self.post.is_some()) && self.connector.is_none() {
            // Refused before the switch: without its preempt channel the guest would wait.
            return Err(crate::postcopy::PostcopyError::NoPreempt(
                "no connector for this channel (Source::set_connector)".into(),
            )
            .into());
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
            self.guest.set_vcpu_throttle_ppm(i, 0);
        }
        // In post-copy the guest runs on the destination: it never runs here again.
        let here = !self.migrated && self.post.is_none();
        if r.is_err() && here && !self.guest.running() && self.was_running {
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
            streams: Vec::new(),
        };
        let r = self.run(&mut conn, t_connect, progress);
        conn.close_streams();
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
}
