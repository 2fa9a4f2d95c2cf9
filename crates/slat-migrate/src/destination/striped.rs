//! Page streams: a source's pages over connections of their own beside the control one
//! ([`crate::SourceConfig::connections`]), each read, checked, written into guest memory and
//! hashed on a thread of its own.
//!
//! The order of work is kept by the source, not by the streams: a stream's thread hands its
//! batch to the control thread's queue *before* it acknowledges it, and the source ends a
//! round on the control connection only once every batch of the round is acknowledged. So
//! everything of round `r` is in the queue before round `r`'s end, and a page sent again in a
//! later round is written and counted after its earlier copy. A stream may run ahead of the
//! control connection by a round (its batches of the next round can be queued before the
//! control reader queues this round's end): [`Incoming::striped`] holds those until the round
//! they belong to. Across streams the batches arrive in any order; the whole set is checked
//! at the end as always (the page digests and their range hashes).

use super::incoming::Incoming;
use super::{control, protocol, Control, Step};
use crate::error::{Cause, MigrateError, PageError, ProtocolError, StreamError};
use crate::guest::{Guest, Memory};
use crate::stream::{Batch, FrameReader, Msg};
use crate::transport::{Acceptor, Channel, Closer};
use crate::verify::{self, PageDigest};
use slat_addr::PageIndex;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// A page stream's batch, written and hashed: what the control thread books.
pub(crate) struct StripedBatch {
    /// The round its batch is labelled with.
    pub(crate) round: u32,
    /// (page, digest) of each page (empty when digests are not kept).
    pub(crate) digests: Vec<(u64, PageDigest)>,
    /// Pages written.
    pub(crate) pages: u64,
    /// Of which zero pages.
    pub(crate) zero: u64,
}

/// What the control thread waits for.
enum Event {
    /// A frame of the control connection (or why it stopped).
    Control(Result<Msg, StreamError>),
    /// A batch a page stream wrote.
    Batch(StripedBatch),
    /// A page stream stopped.
    Failed(u32, MigrateError),
}

/// One accepted page stream.
struct PageStream {
    index: u32,
    reader: FrameReader<Box<dyn Read + Send>>,
    out: Box<dyn Write + Send>,
}

/// The rest of the migration with `count` page streams: accepts them, then runs the control
/// frames on this thread and the pages on one thread per stream. Returns the bytes the
/// streams read.
pub(super) fn receive(
    inc: &mut Incoming<'_>,
    link: &mut Control<'_>,
    accept: Option<&mut Acceptor>,
    count: u32,
    phase: &str,
) -> Result<u64, MigrateError> {
    let max = link.max_streams;
    if !(2..=max).contains(&count) {
        return Err(protocol(phase, ProtocolError::StreamCount { count, max }));
    }
    let Some(accept) = accept else {
        return Err(protocol(phase, ProtocolError::NoStreams));
    };
    let (streams, closers) = accept_streams(&mut **accept, count, inc.session(), link.timeout)?;
    inc.set_streams(count);
    let stop = AtomicBool::new(false);
    let bytes = AtomicU64::new(0);
    let (tx, rx) = mpsc::channel();
    let guest = inc.guest();
    let digests = inc.wants_digests();
    let timeout = link.timeout;
    let control_close = link.close.clone();
    let reader = &mut *link.reader;
    let out = &mut *link.out;
    std::thread::scope(|s| {
        let txc = tx.clone();
        let stop_ref = &stop;
        let mut threads = Vec::with_capacity(count as usize + 1);
        let mut started = std::thread::Builder::new()
            .name("migrate-control".into())
            .spawn_scoped(s, move || loop {
                let m = reader
                    .read_msg_waiting("the switch-over", &|| !stop_ref.load(Ordering::Relaxed));
                let end = !matches!(m, Ok(ref m) if !matches!(m, Msg::Commit));
                if txc.send(Event::Control(m)).is_err() || end {
                    break;
                }
            })
            .map(|h| threads.push(h));
        for st in streams {
            if started.is_err() {
                break;
            }
            let ctx = StreamCtx {
                guest,
                digests,
                tx: tx.clone(),
                stop: &stop,
                bytes: &bytes,
            };
            started = spawn_stream(s, st, ctx).map(|h| threads.push(h));
        }
        drop(tx);
        // A thread that could not start fails the migration; the threads started are ended
        // below as after any failure (stopped, their connections closed) and joined.
        let r = match started {
            Ok(()) => control_loop(inc, &rx, out, timeout),
            Err(e) => Err(MigrateError::Thread(Cause::new(e))),
        };
        if let (Err(e), Some(w)) = (&r, out.as_mut()) {
            // Before the connections close: the source learns why.
            let _ = crate::stream::write_msg(w, &Msg::Refuse(e.to_string()));
        }
        // The stream threads block in reads of their connections: closing them ends them.
        // The control reader stopped at the commit; after a failure it may be reading, and
        // its connection is closed too (on success it stays open for the resume report).
        stop.store(true, Ordering::Relaxed);
        let control = control_close.as_ref().filter(|_| r.is_err());
        for c in closers.iter().chain(control) {
            c();
        }
        // Joined here rather than by the scope, which only waits for them to finish: gone
        // when this returns.
        threads.into_iter().for_each(|t| drop(t.join()));
        r
    })?;
    Ok(bytes.load(Ordering::Relaxed))
}

/// The control frames and the streams' batches in the order they were queued, until the
/// commit. Silence from every connection for the timeout fails it.
fn control_loop(
    inc: &mut Incoming<'_>,
    rx: &mpsc::Receiver<Event>,
    out: &mut Option<Box<dyn Write + Send>>,
    timeout: Duration,
) -> Result<(), MigrateError> {
    loop {
        let phase = inc.phase();
        let ev = rx
            .recv_timeout(timeout)
            .map_err(|_| MigrateError::stream(phase.clone(), StreamError::Timeout(timeout)))?;
        match ev {
            Event::Batch(b) => inc.striped(b, &phase)?,
            Event::Failed(index, why) => {
                return Err(MigrateError::PageStream {
                    index,
                    why: Box::new(why),
                })
            }
            Event::Control(m) => {
                let m = m.map_err(|e| MigrateError::stream(phase.clone(), e))?;
                match m {
                    Msg::Pages(_) | Msg::Streams { .. } | Msg::StreamHello { .. } => {
                        return Err(protocol(
                            &phase,
                            ProtocolError::Unexpected { msg: m.name() },
                        ))
                    }
                    Msg::RoundEnd { .. } => {}
                    // Batches of a round the control connection has not ended are held: any
                    // other frame now would leave them out.
                    ref m if inc.holds_early() => {
                        return Err(protocol(
                            &phase,
                            ProtocolError::Unexpected { msg: m.name() },
                        ))
                    }
                    _ => {}
                }
                match control(inc, inc.state, m, &phase, out)? {
                    Step::More => {}
                    Step::Commit => return Ok(()),
                    // Post-copy runs over the control connection only (the source refuses
                    // both at once); a run here is a hostile or broken source.
                    Step::PostcopyRun(_) => {
                        return Err(protocol(
                            &phase,
                            ProtocolError::Unexpected {
                                msg: "post-copy's run beside page streams",
                            },
                        ))
                    }
                }
            }
        }
    }
}

/// Accepts `count` page streams, each opening with the preamble and a header naming this
/// migration (`session`) and an index not seen yet. Returns them and their closers.
fn accept_streams(
    accept: &mut dyn FnMut() -> Result<Channel, MigrateError>,
    count: u32,
    (session, attempt): (u64, u32),
    timeout: Duration,
) -> Result<(Vec<PageStream>, Vec<Closer>), MigrateError> {
    const PHASE: &str = "accepting the page streams";
    let mut streams: Vec<PageStream> = Vec::with_capacity(count as usize);
    let mut closers = Vec::new();
    for _ in 0..count {
        let Channel {
            reader,
            writer,
            closer,
            ..
        } = accept()?;
        closers.extend(closer);
        let (Some(reader), Some(out)) = (reader, writer) else {
            return Err(MigrateError::stream(
                PHASE,
                StreamError::Closed {
                    what: "a page stream that reads and writes",
                },
            ));
        };
        let mut reader = FrameReader::new(reader, timeout);
        reader
            .read_preamble()
            .map_err(|e| MigrateError::stream(PHASE, e))?;
        let m = reader
            .read_msg("a page stream header")
            .map_err(|e| MigrateError::stream(PHASE, e))?;
        let Msg::StreamHello {
            session: s,
            attempt: a,
            index,
        } = m
        else {
            return Err(protocol(PHASE, ProtocolError::Unexpected { msg: m.name() }));
        };
        if s != session
            || a != attempt
            || index >= count
            || streams.iter().any(|x| x.index == index)
        {
            return Err(protocol(
                PHASE,
                ProtocolError::StreamHeader {
                    session: s,
                    attempt: a,
                    index,
                    want_session: session,
                    want_attempt: attempt,
                    count,
                },
            ));
        }
        streams.push(PageStream { index, reader, out });
    }
    Ok((streams, closers))
}

/// What a page stream's thread shares with the others.
struct StreamCtx<'a> {
    guest: &'a dyn Guest,
    digests: bool,
    tx: mpsc::Sender<Event>,
    stop: &'a AtomicBool,
    bytes: &'a AtomicU64,
}

/// Starts the thread that serves page stream `st`; a failure it meets is sent as
/// [`Event::Failed`].
fn spawn_stream<'scope>(
    s: &'scope std::thread::Scope<'scope, '_>,
    st: PageStream,
    ctx: StreamCtx<'scope>,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, ()>> {
    let index = st.index;
    std::thread::Builder::new()
        .name(format!("migrate-recv{index}"))
        .spawn_scoped(s, move || {
            let c = ctx;
            if let Err(e) = serve_stream(st, c.guest, c.digests, &c.tx, c.stop, c.bytes) {
                let _ = c.tx.send(Event::Failed(index, e));
            }
        })
}

/// One page stream's thread: batches in its own sequence, every index checked before any
/// page of the batch is written, each page written and hashed, the batch queued for the
/// control thread and then acknowledged.
fn serve_stream(
    mut st: PageStream,
    guest: &dyn Guest,
    digests: bool,
    tx: &mpsc::Sender<Event>,
    stop: &AtomicBool,
    bytes: &AtomicU64,
) -> Result<(), MigrateError> {
    let mem = Memory::new(guest).map_err(|e| crate::error::HelloError::Build(e.into()))?;
    let phase = format!("receiving page stream {}", st.index);
    let mut seq = 0u64;
    let mut buf = vec![0u8; crate::stream::PAGE_BYTES];
    let mut last = st.reader.offset();
    loop {
        let m = st
            .reader
            .read_msg_waiting("a page batch", &|| !stop.load(Ordering::Relaxed))
            .map_err(|e| MigrateError::stream(phase.clone(), e))?;
        bytes.fetch_add(st.reader.offset() - last, Ordering::Relaxed);
        last = st.reader.offset();
        let Msg::Pages(b) = m else {
            return Err(protocol(
                &phase,
                ProtocolError::Unexpected { msg: m.name() },
            ));
        };
        if b.seq != seq {
            return Err(protocol(
                &phase,
                ProtocolError::BatchOrder {
                    got: b.seq,
                    want: seq,
                },
            ));
        }
        let done = write_batch(&mem, &b, digests, &mut buf, st.reader.offset(), &phase)?;
        if tx.send(Event::Batch(done)).is_err() {
            return Ok(());
        }
        crate::stream::write_msg(&mut st.out, &Msg::Ack { seq })
            .map_err(|e| MigrateError::stream(phase.clone(), StreamError::Io(Cause::new(e))))?;
        st.reader.recycle(b.data);
        seq = seq
            .checked_add(1)
            .ok_or_else(|| protocol(&phase, ProtocolError::Overflow { what: "batch" }))?;
    }
}

/// Writes batch `b`'s pages (all indexes checked first) and hashes them.
fn write_batch(
    mem: &Memory<'_>,
    b: &Batch,
    digests: bool,
    buf: &mut [u8],
    offset: u64,
    phase: &str,
) -> Result<StripedBatch, MigrateError> {
    let pages = mem.pages();
    let page_error = |err| MigrateError::stream(phase, StreamError::Page { offset, err });
    if let Some(&(page, _, _)) = b.entries.iter().find(|e| e.0 >= pages) {
        return Err(page_error(PageError::OutOfRange { page, pages }));
    }
    let mut out = StripedBatch {
        round: b.round,
        digests: Vec::with_capacity(if digests { b.entries.len() } else { 0 }),
        pages: b.entries.len() as u64,
        zero: 0,
    };
    for (i, &(p, enc, _)) in b.entries.iter().enumerate() {
        let data = match b.raw_page(i) {
            Some(d) => d,
            None => {
                b.page_into(i, buf).map_err(page_error)?;
                &*buf
            }
        };
        let zero = mem.stopped_write_page_zero(PageIndex::new(p), data)?;
        if digests {
            out.digests.push((p, verify::page_digest_known(data, zero)));
        }
        out.zero += (enc == crate::stream::Encoding::Zero) as u64;
    }
    Ok(out)
}
