//! The receiving end; documented on [`Destination`]. [`incoming`] holds the steps of one
//! connection after the handshake.

mod incoming;
mod postcopy;
mod striped;

use crate::transport::Acceptor;

use crate::error::{Cause, HelloError, MigrateError, ProtocolError, StreamError};
use crate::guest::{Guest, MemoryMap};
use crate::stream::{
    self, check_regions, FrameReader, Hello, Msg, PostcopyMsg, Region, PAGE_BYTES,
};
use crate::transport::Channel;
use crate::verify::{Digests, VerifyMode, VerifyReport, RANGE_PAGES};
use incoming::{Incoming, State};
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
    /// Most page streams a source may open beside the control connection (at most
    /// [`stream::MAX_STREAMS`]; 0 or 1: none, the pages come over the one connection).
    pub max_streams: u32,
    /// Accept a source's offer of delta pages ([`stream::delta`]): each is patched into the
    /// copy of the page this side holds and hashed as patched.
    pub delta: bool,
}

impl Default for DestConfig {
    fn default() -> Self {
        DestConfig {
            resume_for: Duration::from_millis(100),
            timeout: Duration::from_secs(30),
            max_memory: 0,
            max_streams: stream::MAX_STREAMS,
            delta: true,
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
    /// Page streams beside the control connection (0: the pages came over it).
    pub streams: u32,
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
    /// Post-copy's figures, when the guest switched over in post-copy.
    pub postcopy: Option<crate::postcopy::PostcopyDestReport>,
}

struct Session {
    id: u64,
    regions: Vec<Region>,
    guest: Arc<dyn Guest>,
    /// How its source verifies.
    verify: VerifyMode,
    /// Per page, the digest of the bytes written into it ([`VerifyMode::Sent`]).
    digests: Digests,
    /// Post-copy's demand pager, once the guest runs here in post-copy.
    post: Option<Arc<crate::postcopy::demand::Demand>>,
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
///   its batch is written, and [`Memory`](crate::Memory) checks again;
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
    /// Opens the source's extra connections (post-copy's preempt channel).
    acceptor: Option<Acceptor>,
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
            acceptor: None,
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
            acceptor: None,
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

    /// Accepts one connection on `listener` and serves it; the source's extra connections
    /// (its page streams, post-copy's preempt channel) are accepted from the same listener
    /// (it becomes this destination's acceptor, see [`Destination::set_acceptor`]).
    pub fn accept(&mut self, listener: &TcpListener) -> Result<DestReport, MigrateError> {
        let timeout = self.cfg.timeout;
        if timeout.is_zero() {
            return Err(MigrateError::ZeroTimeout);
        }
        let io = |e| MigrateError::stream("accepting a connection", StreamError::Io(Cause::new(e)));
        let (s, _) = listener.accept().map_err(io)?;
        let l = listener.try_clone().map_err(io)?;
        self.acceptor = Some(Box::new(move || {
            crate::transport::accept_tcp_within(&l, timeout, timeout)
        }));
        self.serve(s)
    }

    /// Accepts one migration on `l` and serves it; the source's extra connections are
    /// accepted from `l` too (it becomes this destination's acceptor; a descriptor or a file,
    /// which carry one stream, leave the acceptor as it was).
    pub fn accept_from(
        &mut self,
        l: &mut crate::transport::Listener,
    ) -> Result<DestReport, MigrateError> {
        let t = self.cfg.timeout;
        if let Some(a) = l.acceptor(t) {
            self.acceptor = Some(a);
        }
        let c = l.accept(t)?;
        self.serve_channel(c)
    }

    /// Receives one migration over TCP stream `s` (extra connections from the acceptor).
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
    /// kept for a source that reconnects. The source's extra connections — the page streams
    /// it asks for ([`crate::SourceConfig::connections`]), each opening with its header naming
    /// this migration's session and attempt and a stream index, and post-copy's preempt
    /// channel — come from this destination's acceptor ([`Destination::set_acceptor`]; set by
    /// [`Destination::accept`] and [`Destination::accept_from`]); without one, a source
    /// asking for them is refused.
    pub fn serve_channel(&mut self, c: Channel) -> Result<DestReport, MigrateError> {
        self.serve_inner(c)
    }

    fn serve_inner(&mut self, c: Channel) -> Result<DestReport, MigrateError> {
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
        let mut link = Control {
            reader: &mut reader,
            out: &mut out,
            close: closer.clone(),
            timeout: self.cfg.timeout,
            max_streams: self.cfg.max_streams.min(stream::MAX_STREAMS),
        };
        let r = self.receive(&mut link);
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

    /// Answers `hello` with the welcome; returns whether it accepted delta pages (only where
    /// an answer tells the source so: a file's reader answers nobody).
    fn welcome(
        &self,
        out: &mut Option<Box<dyn Write + Send>>,
        hello: &stream::Hello,
        report: &DestReport,
    ) -> Result<bool, MigrateError> {
        let delta = self.cfg.delta && hello.delta && !hello.one_way;
        let welcome = Msg::Welcome {
            resume: report.resumed,
            backend: report.backend.clone(),
            delta,
        };
        send(out, &welcome, "handshake")?;
        Ok(delta)
    }

    /// Receives one migration: the handshake, then the protocol's frames in order (each kind
    /// handled by a step of [`Incoming`]), until the commit hands the guest over.
    fn receive(&mut self, link: &mut Control<'_>) -> Result<DestReport, MigrateError> {
        let (reader, out) = (&mut *link.reader, &mut *link.out);
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
        let delta = self.welcome(out, &hello, &report)?;
        let digests = match &mut self.session {
            Some(s) => std::mem::take(&mut s.digests),
            None => Digests::default(),
        };
        let mut inc = Incoming::new(&*guest, report, hello.verify, digests)?;
        inc.delta = delta;
        let post = self.session.as_ref().and_then(|s| s.post.clone());
        let r = match post {
            Some(d) if resumed => self
                .postcopy_recover(&d, &mut inc, link.reader, link.out)
                .map(|()| 0),
            _ => match frames(&mut inc, link, self.acceptor.as_mut()) {
                Ok(End::PostcopyRun(pages)) => self
                    .postcopy_run(&guest, &mut inc, pages, link.reader, link.out)
                    .map(|()| 0),
                Ok(End::Commit(bytes)) => Ok(bytes),
                Err(e) => Err(e),
            },
        };
        let r = r.and_then(|bytes| match inc.state {
            State::Verified => Ok(bytes),
            // Post-copy's pages are all here: the verification and the commit follow.
            _ => match frames(&mut inc, link, self.acceptor.as_mut())? {
                End::Commit(more) => Ok(bytes + more),
                End::PostcopyRun(_) => Err(protocol(
                    "post-copy",
                    ProtocolError::Unexpected {
                        msg: "a second post-copy run",
                    },
                )),
            },
        });
        // The digests describe the memory kept for a resume.
        if let Some(s) = &mut self.session {
            s.digests = std::mem::take(&mut inc.digests);
        }
        let bytes = r?;
        let mut report = inc.finish(t0, link.reader.offset() + bytes);
        if let Some(d) = self.session.as_mut().and_then(|s| s.post.take()) {
            d.stop();
            let p = d.report();
            report.pages += p.background_pages + p.preempt_pages;
            report.postcopy = Some(p);
        }
        let postcopy = report.postcopy.is_some();
        self.commit(&guest, &mut report, link.out)?;
        if postcopy && self.cfg.resume_for.is_zero() {
            // It has run since post-copy's run; left stopped as `resume_for` zero asks.
            guest.pause()?;
        }
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
            if s.post.is_some() {
                // Its guest runs here on memory still partly at its source.
                return Err(crate::postcopy::PostcopyError::Recover(
                    "this destination runs another session's guest in post-copy".into(),
                )
                .into());
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
            post: None,
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

/// The control connection of one migration and what goes with it.
struct Control<'r> {
    reader: &'r mut FrameReader<Box<dyn Read + Send>>,
    out: &'r mut Option<Box<dyn Write + Send>>,
    /// Breaks the connection off (unblocks a reader thread).
    close: Option<crate::transport::Closer>,
    timeout: Duration,
    /// Most page streams taken.
    max_streams: u32,
}

/// What a control frame did.
enum Step {
    /// Go on.
    More,
    /// The commit: the guest is this side's.
    Commit,
    /// Post-copy's run: the guest starts here with this many pages still missing.
    PostcopyRun(u64),
}

/// Where the frames of [`frames`] ended.
enum End {
    /// The commit, with the bytes the page streams read.
    Commit(u64),
    /// Post-copy's run, with the pages still missing.
    PostcopyRun(u64),
}

/// The protocol's frames in order, each kind handled by a step of [`Incoming`], until the
/// verified stream's commit (with the bytes the page streams read, 0 without them) or
/// post-copy's run (the guest is to start with that many pages still missing); a source's
/// page streams switch to [`striped::receive`].
fn frames(
    inc: &mut Incoming<'_>,
    link: &mut Control<'_>,
    mut accept: Option<&mut Acceptor>,
) -> Result<End, MigrateError> {
    loop {
        let phase = inc.phase();
        let m = link
            .reader
            .read_msg("the switch-over")
            .map_err(|e| MigrateError::stream(phase.clone(), e))?;
        match (inc.state, m) {
            (State::Rounds, Msg::Pages(b)) => {
                inc.pages(&b, &phase, link.reader.offset(), link.out)?;
                link.reader.recycle(b.data);
            }
            (_, Msg::Streams { count }) if inc.fresh() => {
                return striped::receive(inc, link, accept.take(), count, &phase).map(End::Commit);
            }
            (state, m) => match control(inc, state, m, &phase, link.out)? {
                Step::More => {}
                Step::Commit => return Ok(End::Commit(0)),
                Step::PostcopyRun(pages) => return Ok(End::PostcopyRun(pages)),
            },
        }
    }
}

/// One control frame (anything but a batch of pages) in protocol state `state`.
fn control(
    inc: &mut Incoming<'_>,
    state: State,
    m: Msg,
    phase: &str,
    out: &mut Option<Box<dyn Write + Send>>,
) -> Result<Step, MigrateError> {
    match (state, m) {
        (State::Rounds, Msg::RoundEnd { round, pages }) => inc.round_end(round, pages, phase)?,
        (State::Rounds | State::Device, Msg::State(b)) => inc.state_blob(b, phase)?,
        (State::Rounds | State::Device, Msg::StateEnd { blobs, bytes }) => {
            inc.state_end(blobs, bytes, phase)?
        }
        (State::Rounds | State::Device, Msg::Hashes { .. } | Msg::Verify { .. }) => {
            return Err(protocol(phase, ProtocolError::NoState))
        }
        (State::Restored | State::Hashes, Msg::Hashes { first, hashes }) => {
            inc.hashes(first, &hashes, phase)?
        }
        (
            State::Restored | State::Hashes,
            Msg::Verify {
                ranges,
                range_pages,
            },
        ) => inc.verify(ranges, range_pages, phase, out)?,
        (State::Verified, Msg::Commit) => return Ok(Step::Commit),
        (State::Rounds | State::Device, Msg::Postcopy(PostcopyMsg::Discard(runs))) => {
            inc.discard(runs, phase)?
        }
        (State::Restored, Msg::Postcopy(PostcopyMsg::Run { pages }))
            if !inc.discards.is_empty() || pages == 0 =>
        {
            return Ok(Step::PostcopyRun(pages))
        }
        (State::Rounds | State::Device, Msg::Postcopy(PostcopyMsg::Recover)) => {
            // A source that believes it is in post-copy; this side never ran the guest: it
            // lacks the switch-over, which the source sends again.
            let end = PostcopyMsg::LackingEnd {
                pages: 0,
                running: false,
            };
            send(out, &Msg::Postcopy(end), phase)?
        }
        (_, Msg::Commit) => return Err(protocol(phase, ProtocolError::EarlyCommit)),
        (_, Msg::Refuse(reason)) => {
            return Err(MigrateError::Refused {
                who: "source",
                reason,
            })
        }
        (_, Msg::Streams { count }) => {
            return Err(protocol(
                phase,
                ProtocolError::StreamCount {
                    count,
                    max: stream::MAX_STREAMS,
                },
            ))
        }
        (State::Hashes | State::Verified, m @ (Msg::Pages(_) | Msg::RoundEnd { .. })) => {
            return Err(protocol(
                phase,
                ProtocolError::AfterHashes { msg: m.name() },
            ))
        }
        (_, m) => return Err(protocol(phase, ProtocolError::Unexpected { msg: m.name() })),
    }
    Ok(Step::More)
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
