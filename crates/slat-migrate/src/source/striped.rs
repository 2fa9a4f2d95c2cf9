//! Page streams on the source ([`crate::SourceConfig::connections`]): N connections beside
//! the control one, the round's batches striped across them, and one thread per stream that
//! reads its pages out of guest memory, hashes and compresses them, writes the batch and
//! settles its acknowledgements. The control thread hands out batches, keeps the owed set
//! (a page leaves it when its batch is acknowledged, as over one connection), ends rounds
//! early at QEMU's sync point and runs dirty-limit's meter; it ends a round on the control
//! connection only once every batch of it is acknowledged, which is what lets the
//! destination book batches from several streams in the right rounds
//! (`destination/striped.rs`).

use super::conn::{spawn_reader_idle, unexpected, Conn, Inbox, MAX_INFLIGHT};
use super::sender::{commit_acked, resync_now, Page, RoundSpec, Sender};
use super::{Event, RoundReport, RoundSet, Source};
use crate::error::{Cause, MigrateError, StreamError};
use crate::guest::Memory;
use crate::link::{Faults, Link};
use crate::stream::{self, BatchBuilder, Msg, VERSION};
use crate::transport::{Channel, Closer, Connector};
use crate::verify::{self, Digests};
use slat_addr::PageIndex;
use std::collections::VecDeque;
use std::io::Write;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender as Tx, SyncSender};
use std::sync::{Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Batches one stream has written and not had acknowledged, at most.
const STREAM_WINDOW: usize = 64;
/// Batches queued for a stream's thread, at most.
const STREAM_QUEUE: usize = 4;

/// One page stream of an attempt.
pub(crate) struct PageStream {
    pub(super) link: Link,
    pub(super) inbox: Inbox,
    pub(super) thread: JoinHandle<()>,
    pub(super) close: Option<Closer>,
    /// The next batch's sequence number (per stream).
    seq: u64,
    builder: BatchBuilder,
    /// (sequence, pages, zero pages) of each batch written and not acknowledged.
    inflight: VecDeque<(u64, Vec<Page>, u64)>,
}

/// What a stream's thread tells the control thread.
enum Done {
    /// A batch was acknowledged: its pages and how many were zero.
    Acked(Vec<Page>, u64),
    /// The stream failed.
    Failed(u32, MigrateError),
}

impl Source {
    /// With more than one connection configured: announces the page streams on `conn` and
    /// opens them with this source's connector (the one [`Source::migrate_to`] derives from
    /// its endpoint, or [`Source::set_connector`]'s), each with its header.
    pub(super) fn open_streams(&mut self, conn: &mut Conn) -> Result<(), MigrateError> {
        let n = self.cfg.connections;
        if n <= 1 {
            return Ok(());
        }
        let Some(mut connect) = self.connector.take() else {
            return Err(MigrateError::StreamsNeedEndpoint(n));
        };
        let r = self.open_each(conn, &mut connect, n);
        self.connector = Some(connect);
        r
    }

    /// [`Source::open_streams`]'s `n` streams, each opened with `connect`.
    fn open_each(
        &self,
        conn: &mut Conn,
        connect: &mut Connector,
        n: u32,
    ) -> Result<(), MigrateError> {
        if conn.one_way() {
            return Err(MigrateError::StreamsNeedEndpoint(n));
        }
        const PHASE: &str = "opening the page streams";
        conn.send(&Msg::Streams { count: n }, PHASE)?;
        let cap = match self.cfg.bandwidth {
            0 => 0,
            b => (b / n as u64).max(1),
        };
        for index in 0..n {
            let Channel {
                reader,
                writer,
                closer,
                ..
            } = connect()?;
            let (Some(reader), Some(writer)) = (reader, writer) else {
                return Err(MigrateError::StreamsNeedEndpoint(n));
            };
            let faults = Faults {
                cut_after: self
                    .cfg
                    .faults
                    .cut_stream
                    .filter(|&(i, _)| i == index)
                    .map(|(_, at)| at),
                ..Faults::default()
            };
            let mut link = Link::new(writer, closer.clone(), cap, faults);
            let hello = Msg::StreamHello {
                session: self.session,
                attempt: self.attempts,
                index,
            };
            let io = |e| MigrateError::stream(PHASE, StreamError::io(e, self.cfg.timeout));
            link.write_all(&stream::preamble(VERSION)).map_err(io)?;
            stream::write_msg(&mut link, &hello).map_err(io)?;
            let (inbox, thread) = spawn_reader_idle(reader, self.cfg.timeout, true)?;
            conn.streams.push(PageStream {
                link,
                inbox,
                thread,
                close: closer,
                seq: 0,
                builder: BatchBuilder::new(self.cfg.compression),
                inflight: VecDeque::new(),
            });
        }
        Ok(())
    }
}

impl Sender {
    /// [`Sender::round`] over the page streams.
    pub(super) fn round_striped(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        owed: &mut RoundSet<'_>,
        spec: RoundSpec,
        phase: &str,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<RoundReport, MigrateError> {
        let RoundSpec {
            throttle,
            round,
            stop_and_copy,
            resync,
        } = spec;
        let t0 = Instant::now();
        let bytes0 = conn.written();
        let todo = self.todo(owed);
        let resync = resync.filter(|_| self.ro.is_empty() && !stop_and_copy);
        let plan = Plan {
            todo: &todo,
            t0,
            resync,
            stop_and_copy,
            timeout: conn.timeout,
        };
        let digests = Mutex::new(std::mem::take(&mut self.digests));
        let r = self.stripe(conn, mem, &digests, owed, &plan, (round, phase), progress);
        self.digests = digests.into_inner().unwrap_or_else(PoisonError::into_inner);
        let (sent, zero) = r?;
        // Every batch of the round is acknowledged: its end may go now.
        conn.send(
            &Msg::RoundEnd {
                round,
                pages: sent as u64,
            },
            phase,
        )?;
        self.ro.clear();
        Ok(RoundReport {
            round,
            pages: sent as u64,
            zero_pages: zero,
            delta_pages: 0,
            bytes: conn.written() - bytes0,
            time: t0.elapsed(),
            dirtied: 0,
            throttle,
            stop_and_copy,
        })
    }

    /// Runs a thread per stream for the round and hands them its batches
    /// ([`Sender::dispatch`]); returns the pages sent and the zero pages among them.
    #[allow(clippy::too_many_arguments)]
    fn stripe(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        digests: &Mutex<Digests>,
        owed: &mut RoundSet<'_>,
        plan: &Plan<'_>,
        (round, phase): (u32, &str),
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(usize, u64), MigrateError> {
        let closers: Vec<Closer> = conn
            .streams
            .iter()
            .filter_map(|s| s.close.clone())
            .collect();
        let timeout = plan.timeout;
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::scope(|s| {
            let mut work = Vec::with_capacity(conn.streams.len());
            let mut threads = Vec::with_capacity(conn.streams.len());
            for (i, st) in conn.streams.iter_mut().enumerate() {
                let (tx, rx) = mpsc::sync_channel(STREAM_QUEUE);
                work.push(tx);
                let done = done_tx.clone();
                let t = std::thread::Builder::new()
                    .name(format!("migrate-send{i}"))
                    .spawn_scoped(s, move || {
                        let w = Worker {
                            mem,
                            round,
                            digests,
                            timeout,
                            phase,
                        };
                        if let Err(e) = w.run(st, &rx, &done) {
                            let _ = done.send(Done::Failed(i as u32, e));
                        }
                    });
                match t {
                    Ok(h) => threads.push(h),
                    Err(e) => {
                        // The threads started wait for batches with nothing in flight:
                        // dropping their queues' senders ends them.
                        drop(work);
                        join(threads);
                        return Err(MigrateError::Thread(Cause::new(e)));
                    }
                }
            }
            drop(done_tx);
            let r = self.dispatch(work, &done_rx, plan, owed, progress);
            if r.is_err() {
                // The stream threads may wait on their connections: closing them ends them.
                for c in &closers {
                    c();
                }
            }
            join(threads);
            r
        })
    }

    /// Hands the round's batches to the streams in turn, settling acknowledgements as they
    /// come, until all are acknowledged (or the round ends early). Returns the pages sent and
    /// the zero pages among them.
    fn dispatch(
        &mut self,
        work: Vec<SyncSender<Vec<Page>>>,
        done: &Receiver<Done>,
        plan: &Plan<'_>,
        owed: &mut RoundSet<'_>,
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(usize, u64), MigrateError> {
        let (mut outstanding, mut sent, mut zero) = (0usize, 0usize, 0u64);
        let mut book = |d: Done, owed: &mut RoundSet<'_>, outstanding: &mut usize| match d {
            Done::Acked(pages, z) => {
                *outstanding -= 1;
                zero += z;
                commit_acked(&pages, owed)
            }
            Done::Failed(index, why) => Err(MigrateError::PageStream {
                index,
                why: Box::new(why),
            }),
        };
        for (k, chunk) in plan.todo.chunks(self.batch).enumerate() {
            if let Some(d) = plan.resync {
                if resync_now(plan.t0, sent, plan.todo.len() - sent, d) {
                    break;
                }
            }
            while outstanding >= MAX_INFLIGHT {
                book(wait(done, plan.timeout)?, owed, &mut outstanding)?;
            }
            if self.faults.skip_merge_back {
                // The bug under test: the pages count as delivered once queued.
                commit_acked(chunk, owed)?;
            }
            if work[k % work.len()].send(chunk.to_vec()).is_err() {
                // That stream's thread ended: its failure is on the way.
                loop {
                    book(wait(done, plan.timeout)?, owed, &mut outstanding)?;
                }
            }
            outstanding += 1;
            sent += chunk.len();
            while let Ok(d) = done.try_recv() {
                book(d, owed, &mut outstanding)?;
            }
            if !plan.stop_and_copy {
                self.tick_limit(Some(owed), progress)?;
            }
        }
        drop(work);
        while outstanding > 0 {
            book(wait(done, plan.timeout)?, owed, &mut outstanding)?;
        }
        Ok((sent, zero))
    }
}

/// Joins the stream threads here rather than in the scope, which only waits for them to
/// finish: they are gone when the round returns.
fn join(threads: Vec<std::thread::ScopedJoinHandle<'_, ()>>) {
    for t in threads {
        let _ = t.join();
    }
}

/// What a round sends and how.
struct Plan<'a> {
    todo: &'a [Page],
    t0: Instant,
    resync: Option<Duration>,
    stop_and_copy: bool,
    timeout: Duration,
}

/// The next word from the stream threads, within twice the timeout (each of them waits at
/// most the timeout for its connection).
fn wait(done: &Receiver<Done>, timeout: Duration) -> Result<Done, MigrateError> {
    done.recv_timeout(timeout * 2).map_err(|e| {
        MigrateError::stream(
            "waiting for the page streams",
            match e {
                RecvTimeoutError::Timeout => StreamError::Timeout(timeout),
                RecvTimeoutError::Disconnected => StreamError::Closed {
                    what: "the page streams",
                },
            },
        )
    })
}

/// One stream's thread for one round.
struct Worker<'a, 'g> {
    mem: &'a Memory<'g>,
    round: u32,
    digests: &'a Mutex<Digests>,
    timeout: Duration,
    phase: &'a str,
}

impl Worker<'_, '_> {
    /// Writes the batches handed to it, at most [`STREAM_WINDOW`] unacknowledged, and passes
    /// each acknowledgement on; once the control thread has no more, waits for the rest.
    fn run(
        &self,
        st: &mut PageStream,
        rx: &Receiver<Vec<Page>>,
        done: &Tx<Done>,
    ) -> Result<(), MigrateError> {
        loop {
            while let Ok(m) = st.inbox.try_recv() {
                self.ack(st, m, done)?;
            }
            while st.inflight.len() >= STREAM_WINDOW {
                let m = self.next_ack(st)?;
                self.ack(st, m, done)?;
            }
            let chunk = if st.inflight.is_empty() {
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => break,
                }
            } else {
                match rx.recv_timeout(Duration::from_millis(1)) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            };
            let zero = self.send(st, &chunk)?;
            st.inflight.push_back((st.seq, chunk, zero));
            st.seq += 1;
        }
        while !st.inflight.is_empty() {
            let m = self.next_ack(st)?;
            self.ack(st, m, done)?;
        }
        Ok(())
    }

    /// Builds and writes one batch (pages read, hashed and compressed here); returns its zero
    /// pages.
    fn send(&self, st: &mut PageStream, chunk: &[Page]) -> Result<u64, MigrateError> {
        st.builder.start(st.seq, self.round);
        let want = !self
            .digests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        let mut sums = Vec::with_capacity(if want { chunk.len() } else { 0 });
        for &(_, _, p) in chunk {
            st.builder.push_with(
                PageIndex::new(p),
                |out| self.mem.read_page_zero(PageIndex::new(p), out),
                |page, zero| {
                    if want {
                        sums.push((p, verify::page_digest_known(page, zero)));
                    }
                },
            )?;
        }
        if want {
            let mut d = self.digests.lock().unwrap_or_else(PoisonError::into_inner);
            for (p, h) in sums {
                d.set(p, h);
            }
        }
        st.link
            .write_all(st.builder.frame())
            .map_err(|e| MigrateError::stream(self.phase, StreamError::io(e, self.timeout)))?;
        Ok(st.builder.zero as u64)
    }

    /// The stream's next frame, waiting at most the timeout.
    fn next_ack(&self, st: &PageStream) -> Result<Result<Msg, StreamError>, MigrateError> {
        st.inbox.recv_timeout(self.timeout).map_err(|e| {
            MigrateError::stream(
                self.phase,
                match e {
                    RecvTimeoutError::Timeout => StreamError::Timeout(self.timeout),
                    RecvTimeoutError::Disconnected => StreamError::Closed {
                        what: "the acknowledgements",
                    },
                },
            )
        })
    }

    /// An acknowledgement of the oldest batch in flight, passed on with its pages.
    fn ack(
        &self,
        st: &mut PageStream,
        m: Result<Msg, StreamError>,
        done: &Tx<Done>,
    ) -> Result<(), MigrateError> {
        let m = m.map_err(|e| MigrateError::stream(self.phase, e))?;
        let seq = match m {
            Msg::Ack { seq } => seq,
            Msg::Refuse(reason) => {
                return Err(MigrateError::Refused {
                    who: "destination",
                    reason,
                })
            }
            m => return Err(unexpected(self.phase, &m)),
        };
        match st.inflight.pop_front() {
            Some((s, pages, zero)) if s == seq => {
                let _ = done.send(Done::Acked(pages, zero));
                Ok(())
            }
            _ => Err(MigrateError::stream(
                self.phase,
                StreamError::Protocol(crate::error::ProtocolError::AckOrder { seq }),
            )),
        }
    }
}
