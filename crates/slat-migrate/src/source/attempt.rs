//! One attempt: the handshake, the log set up for the rounds, the device state,
//! verification and the switch-over.

use super::cache::DeltaCache;
use super::conn::{unexpected, Conn};
use super::sender::{Limit, Sender};
use super::{DeltaReport, Event, MigrationReport, Source};
use crate::dirty_limit::{DirtyLimiter, RingCounts, RingMeter};
use crate::error::{GuestError, MigrateError, StreamError};
use crate::guest::{Guest, GuestHarvester, GuestLog, Memory};
use crate::stream::{self, BatchBuilder, Hello, Msg, MAX_HASHES, PAGE_BYTES, VERSION};
use crate::throttle::{AutoConverge, Schedule};
use crate::verify::{self, Digests, VerifyMode, NEVER_SENT, RANGE_PAGES};
use slat_addr::PageIndex;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pages as (first, count) runs.
type Runs = Vec<(u64, u64)>;

/// The guest's activity counters when an attempt begins; the report gets what they grew by.
struct Counters {
    writes: u64,
    vcpu_writes: Vec<u64>,
    throttled: Duration,
}

impl Counters {
    fn read(guest: &dyn Guest) -> Counters {
        Counters {
            writes: guest.activity().unwrap_or(0),
            vcpu_writes: guest.vcpu_activity(),
            throttled: guest.throttled(),
        }
    }

    /// Into `report`: the writes and the time throttled since [`Counters::read`].
    fn since(&self, guest: &dyn Guest, report: &mut MigrationReport) {
        report.vcpu_writes = guest
            .vcpu_activity()
            .iter()
            .zip(self.vcpu_writes.iter().chain(std::iter::repeat(&0)))
            .map(|(a, b)| a.saturating_sub(*b))
            .collect();
        report.guest_writes = guest.activity().unwrap_or(0).saturating_sub(self.writes);
        report.throttled = guest.throttled().saturating_sub(self.throttled);
    }
}

impl Source {
    /// One attempt over `conn`: the handshake, pre-copy, stop-and-copy, verification and
    /// switch-over, each a step below.
    pub(super) fn run(
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
        self.open_streams(conn)?;
        report.connections = self.cfg.connections;
        report.setup = t_connect.elapsed();
        if self.post.is_some() {
            self.postcopy_recover(conn, &mem, &mut report, t_connect)?;
            return Ok(report);
        }
        let (starts, ro) = self.prepare_log(&mem, report.resumed)?;
        progress(Event::Connected {
            resume: report.resumed,
            backend: &report.dest_backend,
            connections: report.connections,
        });
        if !self.logging {
            self.guest.set_dirty_logging(true)?;
            self.logging = true;
        }
        let before = Counters::read(&*self.guest);
        let mut ac = AutoConverge::with_schedule(
            self.cfg.auto_converge && self.cfg.dirty_limit.is_none(),
            Schedule {
                initial: self.cfg.throttle_initial,
                increment: self.cfg.throttle_step,
                tailslow: self.cfg.throttle_tailslow,
            },
        );
        let mut sender = self.sender(starts, ro, t_connect);
        sender.cache = (report.delta.as_ref()).map(|d| DeltaCache::new(d.cache_bytes, mem.pages()));
        let r = self.rounds(conn, &mem, &mut sender, &mut ac, &mut report, progress);
        // The digests outlive the attempt: a resumed destination holds what they describe.
        self.digests = std::mem::take(&mut sender.digests);
        sender_report(&mut report, &sender);
        let t_pause = r?;
        before.since(&*self.guest, &mut report);
        report.precopy = t_pause - t_connect;
        if let Some(trigger) = self.switch.take() {
            let times = (t_pause, t_connect);
            self.postcopy_switch(
                conn,
                &mem,
                &mut sender,
                trigger,
                &mut report,
                times,
                progress,
            )?;
            return Ok(with_throttle(report, &ac));
        }
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

        self.switch_over(conn, &mut report, t_pause, t_connect)?;
        Ok(with_throttle(report, &ac))
    }

    /// Readies the dirty log and the digests for this attempt's rounds: everything owed
    /// again unless the destination resumes. Returns each log slot's first memory index and
    /// the read-only runs still owed.
    fn prepare_log(
        &mut self,
        mem: &Memory<'_>,
        resumed: bool,
    ) -> Result<(Vec<u64>, Runs), MigrateError> {
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
        if !resumed {
            // A destination that starts empty needs every page.
            log.mark_all();
            self.ro_owed = true;
        }
        if self.cfg.verify == VerifyMode::Sent
            && (!resumed || self.digests.len() as u64 != mem.pages())
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
        Ok((starts, ro))
    }

    /// The round sender of this attempt; it holds the digests until the rounds are over.
    fn sender(&mut self, starts: Vec<u64>, ro: Runs, t0: Instant) -> Sender {
        let limit = self.cfg.dirty_limit.map(|cfg| Limit {
            l: DirtyLimiter::new(
                cfg,
                self.guest.limitable_vcpus(),
                &self.ring_counts.per_vcpu(),
                Instant::now(),
            ),
            counts: self.ring_counts.clone(),
            guest: self.guest.clone(),
            last_collect: Instant::now(),
        });
        Sender {
            builder: BatchBuilder::new(self.cfg.compression),
            seq: 0,
            batch: self.cfg.batch_pages as usize,
            faults: self.cfg.faults,
            starts,
            ro,
            digests: std::mem::take(&mut self.digests),
            t0,
            limit,
            collected: 0,
            cache: None,
        }
    }

    /// Switch-over: from the written `Commit` on, the guest is the destination's.
    pub(super) fn switch_over(
        &mut self,
        conn: &mut Conn,
        report: &mut MigrationReport,
        t_pause: Instant,
        t_connect: Instant,
    ) -> Result<(), MigrateError> {
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
        Ok(())
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
                delta: self.offers_delta(conn),
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
            Msg::Welcome {
                resume,
                backend,
                delta,
            } => {
                report.resumed = resume;
                report.dest_backend = backend;
                if delta && self.offers_delta(conn) {
                    let pages = mem.pages();
                    let cache_bytes = (self.cfg.delta_cache / PAGE_BYTES as u64).min(pages);
                    report.delta = Some(DeltaReport {
                        cache_bytes: cache_bytes * PAGE_BYTES as u64,
                        ..DeltaReport::default()
                    });
                }
                Ok(())
            }
            m => Err(unexpected(phase, &m)),
        }
    }

    /// Whether the hello offers delta pages: a cache of at least a page, and one page stream
    /// answered by its reader (page streams and files carry whole pages).
    fn offers_delta(&self, conn: &Conn) -> bool {
        self.cfg.delta_cache >= PAGE_BYTES as u64 && self.cfg.connections <= 1 && !conn.one_way()
    }

    /// The device state, saved with the vCPUs paused, sent blob by blob and counted.
    pub(super) fn send_state(
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
    pub(super) fn verify(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
    ) -> Result<u64, MigrateError> {
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
                mem.stopped_read(PageIndex::new(a), PageIndex::new(b), bytes)?;
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

/// What the delta cache and dirty-limit did, into `report`.
fn sender_report(report: &mut MigrationReport, sender: &Sender) {
    report.dirty_limit = sender.limit.as_ref().map(Limit::report);
    if let (Some(d), Some(c)) = (&mut report.delta, &sender.cache) {
        (d.allocated, d.hits, d.misses, d.refused) = (c.allocated(), c.hits, c.misses, c.refused);
    }
}

/// `report` with what auto-converge did.
fn with_throttle(mut report: MigrationReport, ac: &AutoConverge) -> MigrationReport {
    report.throttle_max = ac.max();
    report.throttle_changes = ac.changes.clone();
    report
}

/// The guest's harvester, made on first use with every page owed.
///
/// In the ring mode its log counts every entry per vCPU into `counts` on the way
/// ([`RingMeter`]), for dirty-limit; the harvester still gets every entry.
pub(super) fn harvester<'a>(
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
