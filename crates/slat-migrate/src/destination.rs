//! The receiving end; documented on [`Destination`].

use crate::error::{Cause, HelloError, MigrateError, PageError, ProtocolError, StreamError};
use crate::guest::{Guest, Memory, MemoryMap};
use crate::state::StateBlob;
use crate::stream::{
    self, check_regions, Batch, FrameReader, Hello, Msg, Region, MAX_STATE_BLOBS, MAX_STATE_BYTES,
    PAGE_BYTES,
};
use crate::transport::Channel;
use crate::verify::{self, Digests, VerifyMode, VerifyReport, NEVER_RECEIVED, RANGE_PAGES};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Builds a guest for the memory map (checked) and machine description the source
/// announces; a map it cannot build is [`HelloError::Mismatch`], a description it cannot
/// read [`HelloError::Machine`].
pub type Factory = Box<dyn FnMut(&[Region], &[u8]) -> Result<Arc<dyn Guest>, HelloError> + Send>;

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
    /// The guest's memory map.
    pub regions: Vec<Region>,
    /// Device-state blobs restored.
    pub state_blobs: u32,
    /// Their bytes.
    pub state_bytes: u64,
    /// The stream was one-way (a file): nothing was acknowledged.
    pub one_way: bool,
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
    regions: Vec<Region>,
    guest: Arc<dyn Guest>,
    /// How its source verifies.
    verify: VerifyMode,
    /// Per page, the digest of the bytes written into it ([`VerifyMode::Sent`]).
    digests: Digests,
}

/// The receiving end: checks the stream, builds (or reuses) a guest with the source's memory
/// map, writes pages into its memory, acknowledges every batch, restores the device state,
/// verifies all memory against the source's hashes, and on the source's commit takes the
/// guest over. Over a one-way channel (a file) it acknowledges nothing and checks all the
/// same.
///
/// A [`Destination`] outlives a connection: if a stream breaks, it keeps the session (the
/// source's id, the machine and the pages written so far), and a source reconnecting with the
/// same session id resumes instead of resending all memory. Pages of a batch that was not
/// acknowledged may or may not have been written; the source still owes them and sends them
/// again, so either is fine.
///
/// Nothing the source sends can make this side panic, abort, allocate without bound, write
/// outside guest memory or report success falsely:
///
/// - every frame is checksummed and bounds-checked ([`crate::stream`]);
/// - the hello's memory map is checked with checked arithmetic
///   ([`crate::stream::check_regions`]) and bounded by [`DestConfig::max_memory`] and the
///   host's RAM and swap before a guest is built, and the guest must then have that map;
/// - every page index is checked against the pages the guest really has before anything of
///   its batch is written, and [`Memory`] checks again;
/// - device state is bounded in size and count, each id arrives once, and the end of it must
///   count what arrived;
/// - the frames must come in the protocol's order: batches in sequence and labelled with the
///   round in progress, each round's end naming its number and the pages its batches carried,
///   then the device state, then hashes (each range at most once, inside the guest), the verification request for
///   this guest's ranges, and the commit; anything else is a [`ProtocolError`];
/// - success needs a hash match on every range of guest memory followed by an explicit commit.
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
    /// A destination that builds a guest for each source's memory map with `factory`.
    pub fn new(factory: Factory, cfg: DestConfig) -> Destination {
        Destination {
            factory: Some(factory),
            cfg,
            prebuilt: None,
            session: None,
            done: None,
        }
    }

    /// A destination that receives into `guest` (a source with another memory map is
    /// refused).
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

    /// Receives one migration over TCP stream `s`.
    pub fn serve(&mut self, s: TcpStream) -> Result<DestReport, MigrateError> {
        if self.cfg.timeout.is_zero() {
            return Err(MigrateError::ZeroTimeout);
        }
        let c = Channel::tcp(s, self.cfg.timeout)
            .map_err(|e| MigrateError::stream("accepting", StreamError::Io(Cause::new(e))))?;
        self.serve_channel(c)
    }

    /// Receives one migration over `c` (see [`crate::transport`]). On success the guest is
    /// this side's (and has run for [`DestConfig::resume_for`]); on failure the session is
    /// kept for a source that reconnects.
    pub fn serve_channel(&mut self, c: Channel) -> Result<DestReport, MigrateError> {
        let Channel {
            reader,
            writer: mut out,
            closer,
            ..
        } = c;
        let close = || {
            if let Some(c) = &closer {
                c();
            }
        };
        if self.done.is_some() {
            let e = HelloError::AlreadyMigrated;
            if let Some(w) = &mut out {
                let _ = stream::write_msg(w, &Msg::Refuse(e.to_string()));
            }
            close();
            return Err(e.into());
        }
        if self.cfg.timeout.is_zero() {
            return Err(MigrateError::ZeroTimeout);
        }
        let Some(reader) = reader else {
            return Err(MigrateError::stream(
                "accepting",
                StreamError::Closed {
                    what: "a readable stream (this channel only writes)",
                },
            ));
        };
        let mut reader = FrameReader::new(reader, self.cfg.timeout);
        let r = self.receive(&mut reader, &mut out);
        if let (Err(e), Some(w)) = (&r, &mut out) {
            // Tell the source why, if it still listens; it may already be gone.
            let why = match e {
                MigrateError::Refused { who: "source", .. } => None,
                MigrateError::Refused { reason, .. } => Some(reason.clone()),
                MigrateError::Rejected(h) => Some(h.to_string()),
                e => Some(e.to_string()),
            };
            if let Some(why) = why {
                let _ = stream::write_msg(w, &Msg::Refuse(why));
            }
        }
        close();
        r
    }

    /// Receives one migration: the handshake, then the protocol's frames in order (each kind
    /// handled by a step of [`Incoming`]), until the commit hands the guest over.
    fn receive(
        &mut self,
        reader: &mut FrameReader<Box<dyn Read + Send>>,
        out: &mut Option<Box<dyn Write + Send>>,
    ) -> Result<DestReport, MigrateError> {
        let t0 = Instant::now();
        let hello = read_hello(reader)?;
        if hello.one_way != out.is_none() {
            return Err(HelloError::OneWay { got: hello.one_way }.into());
        }
        let (guest, resumed) = self.session_for(&hello)?;
        let report = DestReport {
            session: hello.session,
            attempt: hello.attempt,
            resumed,
            source_backend: hello.backend.clone(),
            backend: guest.kind().to_string(),
            regions: hello.regions.clone(),
            one_way: hello.one_way,
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
        let digests = match &mut self.session {
            Some(s) => std::mem::take(&mut s.digests),
            None => Digests::default(),
        };
        let mut inc = Incoming::new(&*guest, report, hello.verify, digests)?;
        let r = frames(&mut inc, reader, out);
        // The digests describe the memory kept for a resume.
        if let Some(s) = &mut self.session {
            s.digests = std::mem::take(&mut inc.digests);
        }
        r?;
        let mut report = inc.finish(t0, reader.offset());
        self.commit(&guest, &mut report, out)?;
        Ok(report)
    }

    /// The switch-over: the guest is this side's now. Runs it for a moment and tells the
    /// source how that went.
    fn commit(
        &mut self,
        guest: &Arc<dyn Guest>,
        report: &mut DestReport,
        out: &mut Option<Box<dyn Write + Send>>,
    ) -> Result<(), MigrateError> {
        self.session = None;
        self.done = Some(guest.clone());
        report.run = self.run_guest(guest)?;
        let (touched, d) = report.run;
        if let Some(w) = out {
            let _ = stream::write_msg(
                w,
                &Msg::Resumed {
                    touched,
                    micros: d.as_micros().try_into().unwrap_or(u64::MAX),
                },
            );
        }
        Ok(())
    }

    /// The guest for `hello`'s memory map, and whether it continues a kept session.
    ///
    /// Everything the hello says about sizes is checked here, before anything is mapped:
    /// the map's arithmetic and counts, the range size, and the memory against this
    /// destination's limit and the host's RAM and swap. The guest (given, or built for it)
    /// must then have exactly that map.
    fn session_for(&mut self, hello: &Hello) -> Result<(Arc<dyn Guest>, bool), MigrateError> {
        let pages = check_regions(&hello.regions).map_err(HelloError::from)?;
        if hello.range_pages != RANGE_PAGES {
            return Err(HelloError::RangePages {
                got: hello.range_pages,
                want: RANGE_PAGES,
            }
            .into());
        }
        // `check_regions` bounded the memory by 2^48 bytes: no overflow.
        let bytes = pages * PAGE_BYTES as u64;
        if let Some((limit, why)) = crate::limits::memory_limit(self.cfg.max_memory) {
            if bytes > limit {
                return Err(HelloError::TooBig { bytes, limit, why }.into());
            }
        }
        if let Some(s) = &self.session {
            if s.id == hello.session && s.regions == hello.regions && s.verify == hello.verify {
                return Ok((s.guest.clone(), true));
            }
        }
        // A new session: the pages of any earlier one are overwritten by its full copy.
        let guest = match (&self.prebuilt, &mut self.factory) {
            (Some(g), _) => g.clone(),
            (None, Some(f)) => {
                // Drop a kept session's guest before building another.
                self.session = None;
                f(&hello.regions, &hello.machine)?
            }
            (None, None) => return Err(HelloError::NoMachine.into()),
        };
        let ours = MemoryMap::new(guest.regions())
            .map_err(|e| HelloError::Build(e.into()))?
            .wire();
        if ours != hello.regions {
            return Err(HelloError::Mismatch {
                theirs: hello.regions.clone(),
                ours,
            }
            .into());
        }
        self.session = Some(Session {
            id: hello.session,
            regions: hello.regions.clone(),
            guest: guest.clone(),
            verify: hello.verify,
            digests: Digests::default(),
        });
        Ok((guest, false))
    }

    /// Runs the guest here for [`DestConfig::resume_for`] (its restored device state says
    /// what it runs), then stops it again; returns its activity meanwhile.
    fn run_guest(&self, guest: &Arc<dyn Guest>) -> Result<(u64, Duration), MigrateError> {
        if self.cfg.resume_for.is_zero() {
            return Ok((0, Duration::ZERO));
        }
        let w0 = guest.activity().unwrap_or(0);
        let t = Instant::now();
        guest.resume()?;
        std::thread::sleep(self.cfg.resume_for);
        guest.pause()?;
        let w1 = guest.activity().unwrap_or(0);
        Ok((w1.saturating_sub(w0), t.elapsed()))
    }
}

/// The protocol's frames in order, each kind handled by a step of [`Incoming`], until the
/// verified stream's commit.
fn frames(
    inc: &mut Incoming<'_>,
    reader: &mut FrameReader<Box<dyn Read + Send>>,
    out: &mut Option<Box<dyn Write + Send>>,
) -> Result<(), MigrateError> {
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
            (State::Rounds | State::Device, Msg::State(b)) => inc.state_blob(b, &phase)?,
            (State::Rounds | State::Device, Msg::StateEnd { blobs, bytes }) => {
                inc.state_end(blobs, bytes, &phase)?
            }
            (State::Rounds | State::Device, Msg::Hashes { .. } | Msg::Verify { .. }) => {
                return Err(protocol(&phase, ProtocolError::NoState))
            }
            (State::Restored | State::Hashes, Msg::Hashes { first, hashes }) => {
                inc.hashes(first, &hashes, &phase)?
            }
            (
                State::Restored | State::Hashes,
                Msg::Verify {
                    ranges,
                    range_pages,
                },
            ) => inc.verify(ranges, range_pages, &phase, out)?,
            (State::Verified, Msg::Commit) => return Ok(()),
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

/// Reads the preamble and the hello that must follow it.
fn read_hello<R: Read>(reader: &mut FrameReader<R>) -> Result<Hello, MigrateError> {
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
    guest: &'g dyn Guest,
    verify_mode: VerifyMode,
    /// Per page, the digest of what was written into it (`Sent` mode; empty otherwise).
    digests: Digests,
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
    /// Device state so far.
    blobs: Vec<StateBlob>,
    /// Its bytes.
    blob_bytes: u64,
    report: DestReport,
}

impl<'g> Incoming<'g> {
    /// `digests`: those kept with the session (empty for a new one).
    fn new(
        guest: &'g dyn Guest,
        report: DestReport,
        verify_mode: VerifyMode,
        mut digests: Digests,
    ) -> Result<Incoming<'g>, MigrateError> {
        let mem = Memory::new(guest).map_err(|e| HelloError::Build(e.into()))?;
        let nranges = verify::ranges(mem.pages(), RANGE_PAGES);
        let pages = usize::try_from(mem.pages()).unwrap_or(usize::MAX);
        if verify_mode == VerifyMode::Full {
            digests = Digests::default();
        } else if digests.len() != pages {
            // A new session: nothing received yet. The map was checked against this host's
            // memory, and a digest is 16 bytes per 4 KiB page.
            digests = Digests::new(pages, NEVER_RECEIVED);
        }
        Ok(Incoming {
            guest,
            verify_mode,
            digests,
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
            buf: vec![0u8; PAGE_BYTES],
            range: vec![0u8; RANGE_PAGES as usize * PAGE_BYTES],
            blobs: Vec::new(),
            blob_bytes: 0,
            report,
        })
    }

    /// Where the protocol is, for error messages.
    fn phase(&self) -> String {
        match self.state {
            State::Rounds => format!("receiving round {}", self.report.rounds),
            State::Device => "receiving the device state".to_string(),
            State::Restored => "restoring the device state".to_string(),
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
        out: &mut Option<Box<dyn Write + Send>>,
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
            if !self.digests.is_empty() {
                // Hash what guest memory now holds, read back (cache-hot), not the buffer:
                // a write that went astray shows.
                let back = &mut self.range[..PAGE_BYTES];
                self.mem.stopped_read(p, p + 1, back)?;
                self.digests.set(p, verify::page_digest(back));
            }
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
        // Range hashes of what this round wrote; the source paused only for the last one.
        self.digests.refresh();
        Ok(())
    }

    /// A device-state blob: after a round ended, its id new, the guest's state bounded.
    fn state_blob(&mut self, b: StateBlob, phase: &str) -> Result<(), MigrateError> {
        if self.round_pages != 0 {
            return Err(protocol(
                phase,
                ProtocolError::StateMidRound {
                    round: self.report.rounds,
                },
            ));
        }
        self.state = State::Device;
        if self.blobs.iter().any(|x| x.id == b.id) {
            return Err(protocol(phase, ProtocolError::StateTwice { id: b.id }));
        }
        // Each blob is at most a frame: the sum cannot overflow before the bound trips.
        self.blob_bytes += b.data.len() as u64;
        if self.blobs.len() >= MAX_STATE_BLOBS as usize || self.blob_bytes > MAX_STATE_BYTES {
            return Err(protocol(phase, ProtocolError::StateTooMuch));
        }
        self.blobs.push(b);
        Ok(())
    }

    /// The end of the device state: it must count what arrived; the guest restores it (and
    /// may refuse it, before the switch-over).
    fn state_end(&mut self, blobs: u32, bytes: u64, phase: &str) -> Result<(), MigrateError> {
        if self.round_pages != 0 {
            return Err(protocol(
                phase,
                ProtocolError::StateMidRound {
                    round: self.report.rounds,
                },
            ));
        }
        let got_blobs = self.blobs.len() as u32;
        if blobs != got_blobs || bytes != self.blob_bytes {
            return Err(protocol(
                phase,
                ProtocolError::StateCount {
                    blobs,
                    bytes,
                    got_blobs,
                    got_bytes: self.blob_bytes,
                },
            ));
        }
        self.report.state_blobs = got_blobs;
        self.report.state_bytes = self.blob_bytes;
        self.guest.restore_state(std::mem::take(&mut self.blobs))?;
        self.state = State::Restored;
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
            let ours = if self.verify_mode == VerifyMode::Sent {
                // One digest per page (`new`), `i < nranges`: the range exists.
                self.digests.range(i).unwrap_or([0; 32])
            } else {
                // `b - a <= RANGE_PAGES`: the range fits the buffer.
                let bytes = &mut self.range[..(b - a) as usize * PAGE_BYTES];
                self.mem.stopped_read(a, b, bytes)?;
                verify::hash_range(i, bytes)
            };
            if &ours != h {
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
        out: &mut Option<Box<dyn Write + Send>>,
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
    /// Device-state blobs.
    Device,
    /// The device state is restored; hashes may come.
    Restored,
    /// Verification hashes (no more pages).
    Hashes,
    /// Verified: only the commit may follow.
    Verified,
}

/// Sends `m` back to the source; over a one-way channel nothing goes back.
fn send(out: &mut Option<Box<dyn Write + Send>>, m: &Msg, phase: &str) -> Result<(), MigrateError> {
    let Some(out) = out else {
        return Ok(());
    };
    out.write_all(&stream::frame(m))
        .map_err(|e| MigrateError::stream(phase, StreamError::Io(Cause::new(e))))
}

fn protocol(phase: &str, why: ProtocolError) -> MigrateError {
    MigrateError::stream(phase.to_string(), StreamError::Protocol(why))
}
