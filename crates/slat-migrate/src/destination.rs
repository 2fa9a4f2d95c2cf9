//! The receiving end: checks the stream, builds (or reuses) a machine of the source's shape,
//! writes pages into its guest RAM, acknowledges every batch, verifies all memory against the
//! source's hashes, and on the source's commit runs the guest.
//!
//! A [`Destination`] outlives a connection: if a stream breaks, it keeps the session (the
//! source's id, the machine and the pages written so far), and a source reconnecting with the
//! same session id resumes instead of resending all memory. Pages of a batch that was not
//! acknowledged may or may not have been written; the source still owes them and sends them
//! again, so either is fine.
//!
//! Nothing the source sends can make this side panic, abort, allocate without bound, write
//! outside guest memory or report success falsely:
//!
//! - every frame is checksummed and bounds-checked ([`crate::stream`]);
//! - the hello's shape is checked with checked arithmetic ([`Shape::check`]) and bounded by
//!   [`DestConfig::max_memory`] and the host's RAM and swap before a machine is built, and its
//!   memslot list must follow from it entry by entry;
//! - every page index is checked against the pages the machine really mapped
//!   ([`Guest::pages`]) before anything of its batch is written, and [`Memory`] checks again;
//! - the frames must come in the protocol's order: batches in sequence and labelled with the
//!   round in progress, each round's end naming its number and the pages its batches carried,
//!   then hashes (each range at most once, inside the guest), the verification request for
//!   this guest's ranges, and the commit; anything else is a [`ProtocolError`];
//! - success needs a hash match on every range of guest memory followed by an explicit commit.

use crate::error::{
    Cause, GuestError, HelloError, MigrateError, PageError, ProtocolError, StreamError,
};
use crate::guest::{Guest, Memory};
use crate::stream::{self, Batch, FrameReader, Hello, Msg, Shape, PAGE_SIZE};
use crate::verify::{self, VerifyReport, RANGE_PAGES};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Builds a machine of the shape the source announces.
pub type Factory = Box<dyn FnMut(&Shape) -> Result<Arc<dyn Guest>, GuestError> + Send>;

/// How the destination behaves.
#[derive(Debug, Clone)]
pub struct DestConfig {
    /// How long the guest runs here after the switch-over, to show it runs (zero: it is
    /// left stopped, e.g. for a test that compares memory byte by byte).
    pub resume_for: Duration,
    /// Longest silence from the source before giving up (must not be zero).
    pub timeout: Duration,
    /// Largest guest accepted, bytes (0: no limit of its own). The host's RAM and swap bound
    /// it in any case ([`crate::limits::memory_limit`]).
    pub max_memory: u64,
}

impl Default for DestConfig {
    fn default() -> Self {
        DestConfig {
            resume_for: Duration::from_millis(100),
            timeout: Duration::from_secs(30),
            max_memory: 0,
        }
    }
}

/// An incoming migration that completed.
#[derive(Debug, Clone, Default)]
pub struct DestReport {
    /// The source's session id.
    pub session: u64,
    /// The source's attempt number.
    pub attempt: u32,
    /// This connection continued a session whose memory was kept from a broken one.
    pub resumed: bool,
    /// The source's machine.
    pub source_backend: String,
    /// This side's machine.
    pub backend: String,
    /// The guest's shape.
    pub shape: Option<Shape>,
    /// Pages written into guest memory.
    pub pages: u64,
    /// Of which zero-page markers.
    pub zero_pages: u64,
    /// Stream bytes read.
    pub bytes: u64,
    /// Rounds received.
    pub rounds: u32,
    /// Hello to welcome (building the machine).
    pub setup: Duration,
    /// Preamble to commit.
    pub total: Duration,
    /// The comparison of all memory with the source's hashes.
    pub verify: VerifyReport,
    /// Time spent hashing this side's memory.
    pub verify_time: Duration,
    /// The guest's run after the switch-over: pages touched and for how long.
    pub run: (u64, Duration),
}

struct Session {
    id: u64,
    shape: Shape,
    guest: Arc<dyn Guest>,
}

/// The receiving end.
pub struct Destination {
    factory: Option<Factory>,
    cfg: DestConfig,
    /// A machine given up front (its shape must match the source's).
    prebuilt: Option<Arc<dyn Guest>>,
    session: Option<Session>,
    /// The guest after a completed migration.
    done: Option<Arc<dyn Guest>>,
}

impl Destination {
    /// A destination that builds a machine of each source's shape with `factory`.
    pub fn new(factory: Factory, cfg: DestConfig) -> Destination {
        Destination {
            factory: Some(factory),
            cfg,
            prebuilt: None,
            session: None,
            done: None,
        }
    }

    /// A destination that receives into `guest` (a source of another shape is refused).
    pub fn with_guest(guest: Arc<dyn Guest>, cfg: DestConfig) -> Destination {
        Destination {
            factory: None,
            cfg,
            prebuilt: Some(guest),
            session: None,
            done: None,
        }
    }

    /// The migrated guest, once a migration completed.
    pub fn guest(&self) -> Option<&Arc<dyn Guest>> {
        self.done.as_ref()
    }

    /// Whether a broken session's memory is kept for a resume.
    pub fn holds_session(&self) -> bool {
        self.session.is_some()
    }

    /// Accepts one connection on `listener` and serves it.
    pub fn accept(&mut self, listener: &TcpListener) -> Result<DestReport, MigrateError> {
        let (s, _) = listener.accept().map_err(|e| {
            MigrateError::stream("accepting a connection", StreamError::Io(Cause::new(e)))
        })?;
        self.serve(s)
    }

    /// Receives one migration over `s`. On success the guest has run here; on failure the
    /// session is kept for a source that reconnects.
    pub fn serve(&mut self, s: TcpStream) -> Result<DestReport, MigrateError> {
        if self.done.is_some() {
            let e = HelloError::AlreadyMigrated;
            let mut w = &s;
            let _ = stream::write_msg(&mut w, &Msg::Refuse(e.to_string()));
            return Err(e.into());
        }
        let timeout = self.cfg.timeout;
        let io =
            |e: std::io::Error| MigrateError::stream("accepting", StreamError::Io(Cause::new(e)));
        if timeout.is_zero() {
            return Err(MigrateError::ZeroTimeout);
        }
        s.set_read_timeout(Some(timeout)).map_err(io)?;
        s.set_write_timeout(Some(timeout)).map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        let mut reader = FrameReader::new(s.try_clone().map_err(io)?, timeout);
        let mut out = s;
        let r = self.receive(&mut reader, &mut out);
        if let Err(e) = &r {
            // Tell the source why, if it still listens; it may already be gone.
            let why = match e {
                MigrateError::Refused { who: "source", .. } => None,
                MigrateError::Refused { reason, .. } => Some(reason.clone()),
                MigrateError::Rejected(h) => Some(h.to_string()),
                e => Some(e.to_string()),
            };
            if let Some(why) = why {
                let _ = stream::write_msg(&mut out, &Msg::Refuse(why));
            }
        }
        let _ = out.shutdown(std::net::Shutdown::Both);
        r
    }

    /// Receives one migration: the handshake, then the protocol's frames in order (each kind
    /// handled by a step of [`Incoming`]), until the commit runs the guest here.
    fn receive(
        &mut self,
        reader: &mut FrameReader<TcpStream>,
        out: &mut TcpStream,
    ) -> Result<DestReport, MigrateError> {
        let t0 = Instant::now();
        let hello = read_hello(reader)?;
        let (guest, resumed) = self.session_for(&hello)?;
        let report = DestReport {
            session: hello.session,
            attempt: hello.attempt,
            resumed,
            source_backend: hello.backend.clone(),
            backend: guest.backend().name().into(),
            shape: Some(hello.shape),
            setup: t0.elapsed(),
            ..DestReport::default()
        };
        send(
            out,
            &Msg::Welcome {
                resume: resumed,
                backend: report.backend.clone(),
            },
            "handshake",
        )?;
        let mut inc = Incoming::new(&*guest, report);
        loop {
            let phase = inc.phase();
            let m = reader
                .read_msg("the switch-over")
                .map_err(|e| MigrateError::stream(phase.clone(), e))?;
            match (inc.state, m) {
                (State::Rounds, Msg::Pages(b)) => inc.pages(&b, &phase, reader.offset(), out)?,
                (State::Rounds, Msg::RoundEnd { round, pages }) => {
                    inc.round_end(round, pages, &phase)?
                }
                (State::Rounds | State::Hashes, Msg::Hashes { first, hashes }) => {
                    inc.hashes(first, &hashes, &phase)?
                }
                (
                    State::Rounds | State::Hashes,
                    Msg::Verify {
                        ranges,
                        range_pages,
                    },
                ) => inc.verify(ranges, range_pages, &phase, out)?,
                (State::Verified, Msg::Commit) => {
                    let mut report = inc.finish(t0, reader.offset());
                    self.commit(&guest, &hello, &mut report, out)?;
                    return Ok(report);
                }
                (_, Msg::Commit) => return Err(protocol(&phase, ProtocolError::EarlyCommit)),
                (_, Msg::Refuse(reason)) => {
                    return Err(MigrateError::Refused {
                        who: "source",
                        reason,
                    })
                }
                (State::Hashes | State::Verified, m @ (Msg::Pages(_) | Msg::RoundEnd { .. })) => {
                    return Err(protocol(
                        &phase,
                        ProtocolError::AfterHashes { msg: m.name() },
                    ))
                }
                (_, m) => {
                    return Err(protocol(
                        &phase,
                        ProtocolError::Unexpected { msg: m.name() },
                    ))
                }
            }
        }
    }

    /// The switch-over: the guest is this side's now. Runs it for a moment and tells the
    /// source how that went.
    fn commit(
        &mut self,
        guest: &Arc<dyn Guest>,
        hello: &Hello,
        report: &mut DestReport,
        out: &mut TcpStream,
    ) -> Result<(), MigrateError> {
        self.session = None;
        self.done = Some(guest.clone());
        report.run = self.run_guest(guest, hello)?;
        let (touched, d) = report.run;
        let _ = stream::write_msg(
            out,
            &Msg::Resumed {
                touched,
                micros: d.as_micros().try_into().unwrap_or(u64::MAX),
            },
        );
        Ok(())
    }

    /// The machine for `hello`'s guest, and whether it continues a kept session.
    ///
    /// Everything the hello says about sizes is checked here, before anything is mapped:
    /// the shape's arithmetic and counts, each memslot entry against the shape, the range
    /// size, the workload's percentage, and the memory against this destination's limit
    /// and the host's RAM and swap. A machine built for it must then map exactly the pages
    /// the shape has.
    fn session_for(&mut self, hello: &Hello) -> Result<(Arc<dyn Guest>, bool), MigrateError> {
        let shape = hello.shape;
        let pages = shape.check().map_err(HelloError::from)?;
        if hello.slots.len() != shape.slots as usize {
            return Err(HelloError::SlotCount {
                listed: hello.slots.len(),
                slots: shape.slots,
            }
            .into());
        }
        // `check` passed: `slots` divides `pages`, and `index * pps < pages`.
        let pps = pages / shape.slots as u64;
        for (index, &got) in hello.slots.iter().enumerate() {
            let want = (index as u64 * pps, pps);
            if got != want {
                return Err(HelloError::SlotEntry { index, got, want }.into());
            }
        }
        if hello.range_pages != RANGE_PAGES {
            return Err(HelloError::RangePages {
                got: hello.range_pages,
                want: RANGE_PAGES,
            }
            .into());
        }
        if hello.work.write_percent > 100 {
            return Err(HelloError::WritePercent(hello.work.write_percent).into());
        }
        // `check` bounded the memory by 2^48 bytes: no overflow.
        let bytes = pages * PAGE_SIZE as u64;
        if let Some((limit, why)) = crate::limits::memory_limit(self.cfg.max_memory) {
            if bytes > limit {
                return Err(HelloError::TooBig { bytes, limit, why }.into());
            }
        }
        if let Some(s) = &self.session {
            if s.id == hello.session && s.shape == shape {
                return Ok((s.guest.clone(), true));
            }
        }
        // A new session: the pages of any earlier one are overwritten by its full copy.
        let guest = match (&self.prebuilt, &mut self.factory) {
            (Some(g), _) => {
                if g.shape() != shape {
                    return Err(HelloError::Mismatch {
                        theirs: shape,
                        ours: g.shape(),
                    }
                    .into());
                }
                g.clone()
            }
            (None, Some(f)) => {
                // Drop a kept session's machine before building another.
                self.session = None;
                f(&shape).map_err(HelloError::Build)?
            }
            (None, None) => return Err(HelloError::NoMachine.into()),
        };
        if guest.pages() != pages {
            return Err(HelloError::Built {
                want: pages,
                got: guest.pages(),
            }
            .into());
        }
        self.session = Some(Session {
            id: hello.session,
            shape,
            guest: guest.clone(),
        });
        Ok((guest, false))
    }

    /// Runs the source's workload on this side's vCPUs for a moment.
    fn run_guest(
        &self,
        guest: &Arc<dyn Guest>,
        hello: &Hello,
    ) -> Result<(u64, Duration), MigrateError> {
        if self.cfg.resume_for.is_zero() {
            return Ok((0, Duration::ZERO));
        }
        let mut work = hello.work;
        if guest.backend() == crate::BackendKind::Kvm {
            // The KVM guest's writer only writes; a simulated source's read share has no
            // equivalent there, and refusing after the commit would strand the guest.
            work.write_percent = 100;
        }
        let w0 = guest.writes();
        let t = Instant::now();
        guest.start(work)?;
        std::thread::sleep(self.cfg.resume_for);
        guest.pause()?;
        Ok((guest.writes().saturating_sub(w0), t.elapsed()))
    }
}

/// Reads the preamble and the hello that must follow it.
fn read_hello(reader: &mut FrameReader<TcpStream>) -> Result<Hello, MigrateError> {
    reader
        .read_preamble()
        .map_err(|e| MigrateError::stream("reading the stream preamble", e))?;
    match reader
        .read_msg("the hello")
        .map_err(|e| MigrateError::stream("reading the hello", e))?
    {
        Msg::Hello(h) => Ok(h),
        m => Err(protocol(
            "handshake",
            ProtocolError::BeforeHello { msg: m.name() },
        )),
    }
}

/// One connection's receive state after the handshake: where the protocol is, what arrived,
/// and the comparison of the hashes so far. Each frame kind the protocol allows is one step.
struct Incoming<'g> {
    /// The bound of every page index: what the machine mapped, not what the hello says.
    mem: Memory<'g>,
    /// Ranges of this guest's memory.
    nranges: u64,
    /// One flag per range (`nranges` follows from memory this side mapped).
    hashed: Vec<bool>,
    verdict: VerifyReport,
    state: State,
    /// The batch due next.
    seq: u64,
    /// Pages the batches of the round in progress carried.
    round_pages: u64,
    /// One page, decoded.
    buf: Vec<u8>,
    /// One verification range, copied out of guest memory.
    range: Vec<u8>,
    report: DestReport,
}

impl<'g> Incoming<'g> {
    fn new(guest: &'g dyn Guest, report: DestReport) -> Incoming<'g> {
        let mem = Memory::new(guest);
        let nranges = verify::ranges(mem.pages(), RANGE_PAGES);
        Incoming {
            mem,
            nranges,
            hashed: vec![false; nranges as usize],
            verdict: VerifyReport {
                ranges: nranges,
                range_pages: RANGE_PAGES,
                ..VerifyReport::default()
            },
            state: State::Rounds,
            seq: 0,
            round_pages: 0,
            buf: vec![0u8; PAGE_SIZE],
            range: vec![0u8; RANGE_PAGES as usize * PAGE_SIZE],
            report,
        }
    }

    /// Where the protocol is, for error messages.
    fn phase(&self) -> String {
        match self.state {
            State::Rounds => format!("receiving round {}", self.report.rounds),
            State::Hashes => "receiving the verification hashes".to_string(),
            State::Verified => "waiting for the commit".to_string(),
        }
    }

    /// A batch of pages: checks its sequence, round and every index, writes its pages and
    /// acknowledges it. `offset` is the stream offset, for errors.
    fn pages(
        &mut self,
        b: &Batch,
        phase: &str,
        offset: u64,
        out: &mut TcpStream,
    ) -> Result<(), MigrateError> {
        let (seq, pages) = (self.seq, self.mem.pages());
        if b.seq != seq {
            return Err(protocol(
                phase,
                ProtocolError::BatchOrder {
                    got: b.seq,
                    want: seq,
                },
            ));
        }
        if b.round != self.report.rounds {
            return Err(protocol(
                phase,
                ProtocolError::BatchRound {
                    seq,
                    got: b.round,
                    want: self.report.rounds,
                },
            ));
        }
        let page_error = |err| MigrateError::stream(phase, StreamError::Page { offset, err });
        // Every index first: nothing of a batch is written unless all of it fits.
        if let Some(&(page, _, _)) = b.entries.iter().find(|e| e.0 >= pages) {
            return Err(page_error(PageError::OutOfRange { page, pages }));
        }
        for (i, &(p, enc, _)) in b.entries.iter().enumerate() {
            b.page_into(i, &mut self.buf).map_err(page_error)?;
            self.mem.stopped_write_page(p, &self.buf)?;
            self.report.pages += 1;
            self.report.zero_pages += (enc == stream::Encoding::Zero) as u64;
        }
        // At most MAX_BATCH_PAGES per batch: the sums cannot overflow before the sequence
        // number would.
        self.round_pages += b.entries.len() as u64;
        send(out, &Msg::Ack { seq }, phase)?;
        self.seq = seq
            .checked_add(1)
            .ok_or_else(|| protocol(phase, ProtocolError::Overflow { what: "batch" }))?;
        Ok(())
    }

    /// The end of a round: it must be the round in progress and count the pages its batches
    /// carried.
    fn round_end(&mut self, round: u32, announced: u64, phase: &str) -> Result<(), MigrateError> {
        if round != self.report.rounds {
            return Err(protocol(
                phase,
                ProtocolError::RoundOrder {
                    got: round,
                    want: self.report.rounds,
                },
            ));
        }
        if announced != self.round_pages {
            return Err(protocol(
                phase,
                ProtocolError::RoundPages {
                    round,
                    announced,
                    received: self.round_pages,
                },
            ));
        }
        self.report.rounds = self
            .report
            .rounds
            .checked_add(1)
            .ok_or_else(|| protocol(phase, ProtocolError::Overflow { what: "round" }))?;
        self.round_pages = 0;
        Ok(())
    }

    /// Hashes of ranges `first..`: each range inside the guest and hashed once, compared
    /// with this side's memory.
    fn hashes(&mut self, first: u64, hashes: &[[u8; 32]], phase: &str) -> Result<(), MigrateError> {
        if self.round_pages != 0 {
            return Err(protocol(
                phase,
                ProtocolError::HashesMidRound {
                    round: self.report.rounds,
                },
            ));
        }
        self.state = State::Hashes;
        let t = Instant::now();
        let count = hashes.len() as u64;
        let end = first.checked_add(count);
        if end.is_none_or(|e| e > self.nranges) {
            return Err(protocol(
                phase,
                ProtocolError::HashRange {
                    first,
                    count,
                    ranges: self.nranges,
                },
            ));
        }
        let pages = self.mem.pages();
        for (k, h) in hashes.iter().enumerate() {
            // `first + k < end <= nranges`: no overflow, and the index is in bounds.
            let i = first + k as u64;
            let seen = &mut self.hashed[i as usize];
            if *seen {
                return Err(protocol(phase, ProtocolError::HashTwice { range: i }));
            }
            *seen = true;
            let (a, b) = verify::range_pages(i, RANGE_PAGES, pages);
            // `b - a <= RANGE_PAGES`: the range fits the buffer.
            let bytes = &mut self.range[..(b - a) as usize * PAGE_SIZE];
            self.mem.stopped_read(a, b, bytes)?;
            if &verify::hash_range(i, bytes) != h {
                self.verdict.mismatched += 1;
                if self.verdict.first.len() < 8 {
                    self.verdict.first.push(i);
                }
            }
        }
        self.report.verify_time += t.elapsed();
        Ok(())
    }

    /// The verification request: it must name this guest's ranges; a range without a hash
    /// counts as differing. Answers the source, and fails unless everything matched.
    fn verify(
        &mut self,
        ranges: u64,
        range_pages: u32,
        phase: &str,
        out: &mut TcpStream,
    ) -> Result<(), MigrateError> {
        if ranges != self.nranges || range_pages != RANGE_PAGES {
            return Err(protocol(
                phase,
                ProtocolError::VerifyLayout {
                    ranges,
                    range_pages,
                    want_ranges: self.nranges,
                    want_range_pages: RANGE_PAGES,
                },
            ));
        }
        let missing = self.hashed.iter().filter(|h| !**h).count() as u64;
        self.verdict.mismatched += missing;
        send(
            out,
            &Msg::Verified {
                ranges: self.nranges,
                mismatched: self.verdict.mismatched,
                first: self.verdict.first.clone(),
            },
            phase,
        )?;
        if !self.verdict.ok() {
            return Err(MigrateError::Verification {
                ranges: self.nranges,
                mismatched: self.verdict.mismatched,
                range_pages: RANGE_PAGES,
                first: self.verdict.describe_first(),
            });
        }
        self.state = State::Verified;
        Ok(())
    }

    /// The report at the commit: `t0` was the preamble, `bytes` the stream read.
    fn finish(self, t0: Instant, bytes: u64) -> DestReport {
        DestReport {
            total: t0.elapsed(),
            verify: self.verdict,
            bytes,
            ..self.report
        }
    }
}

/// Where the receive loop is in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Pre-copy and stop-and-copy rounds: batches and round ends.
    Rounds,
    /// Verification hashes (no more pages).
    Hashes,
    /// Verified: only the commit may follow.
    Verified,
}

fn send(out: &mut TcpStream, m: &Msg, phase: &str) -> Result<(), MigrateError> {
    out.write_all(&stream::frame(m))
        .map_err(|e| MigrateError::stream(phase, StreamError::Io(Cause::new(e))))
}

fn protocol(phase: &str, why: ProtocolError) -> MigrateError {
    MigrateError::stream(phase.to_string(), StreamError::Protocol(why))
}
