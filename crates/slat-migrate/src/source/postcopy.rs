//! The source in post-copy: the switch (last harvest, discard set, device state, run), the
//! background stream and the preempt channel, and the recovery of a broken link.

use super::attempt::harvester;
use super::conn::{unexpected, Conn};
use super::sender::{pages_of, Sender};
use super::{Event, MigrationReport, Source};
use crate::error::{Cause, MigrateError, StreamError};
use crate::guest::Memory;
use crate::link::{Faults, Link};
use crate::postcopy::{PageBits, PostcopyError, PostcopyReport, POSTCOPY_ROUND};
use crate::stream::{self, BatchBuilder, Compression, Msg, PostcopyMsg, MAX_RUNS, VERSION};
use crate::transport::Connector;
use crate::verify::{self, PageDigest};
use slat_addr::PageIndex;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a source in post-copy keeps across connections.
pub(super) struct PostState {
    /// Pages still to send on this connection (claimed by the channel that sends them).
    pending: Arc<PageBits>,
    /// The switch's discard set, for a destination that never got the run.
    switched: Vec<(u64, u64)>,
    report: PostcopyReport,
    t_pause: Instant,
}

/// Pages sent on one channel: their digests, how many, and when the last went out.
#[derive(Default)]
struct Sent {
    digests: Vec<(u64, PageDigest)>,
    pages: u64,
    last: Option<Instant>,
    requested: u64,
    already: u64,
}

impl Source {
    /// Sets how this source opens its extra connections (page streams, post-copy's preempt
    /// channel) for migrations over a channel of the caller's ([`Source::migrate_over`]);
    /// [`Source::migrate_to`] replaces it with one for its endpoint.
    pub fn set_connector(&mut self, c: Connector) {
        self.connector = Some(c);
    }

    /// Whether the guest is in post-copy (running on the destination, pages still here): a
    /// failed attempt then leaves it paused here, and the next one recovers.
    pub fn in_postcopy(&self) -> bool {
        self.post.is_some()
    }

    /// The switch, with the vCPUs paused after `round` pre-copy rounds: the last harvest
    /// becomes the discard set; then the device state, the run, and the pages.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn postcopy_switch(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        sender: &mut Sender,
        trigger: &'static str,
        report: &mut MigrationReport,
        (t_pause, t_connect): (Instant, Instant),
        progress: &mut dyn FnMut(Event<'_>),
    ) -> Result<(), MigrateError> {
        let round = report.rounds.len() as u32;
        let log = harvester(&mut self.log, &*self.guest, &self.ring_counts)?;
        let set = log.take()?;
        let pending = PageBits::new(mem.pages());
        for (_, _, p) in pages_of(&set, &sender.starts) {
            pending.set(p);
        }
        for &(a, n) in &sender.ro {
            (a..a + n).for_each(|p| {
                pending.set(p);
            });
        }
        // From here the pages are post-copy's to account for, not the log's.
        set.commit();
        sender.ro.clear();
        self.ro_owed = false;
        let discarded = pending.count();
        progress(Event::Paused(discarded));
        let (switched, _) = pending.runs(0, usize::MAX);
        self.post = Some(PostState {
            pending: Arc::new(pending),
            switched,
            report: PostcopyReport {
                after_rounds: round,
                trigger,
                discarded,
                ..PostcopyReport::default()
            },
            t_pause,
        });
        self.send_switch(conn, report)?;
        report.downtime = t_pause.elapsed();
        progress(Event::Postcopy { discarded });
        self.postcopy_send(conn, mem, report, t_connect)
    }

    /// Discards, device state and the run.
    fn send_switch(
        &mut self,
        conn: &mut Conn,
        report: &mut MigrationReport,
    ) -> Result<(), MigrateError> {
        let phase = "post-copy switch";
        let Some(st) = &self.post else {
            return Ok(());
        };
        let runs = st.switched.clone();
        let pages = st.report.discarded;
        for chunk in runs.chunks(MAX_RUNS as usize) {
            conn.send(&Msg::Postcopy(PostcopyMsg::Discard(chunk.to_vec())), phase)?;
        }
        self.send_state(conn, report)?;
        conn.send(&Msg::Postcopy(PostcopyMsg::Run { pages }), phase)
    }

    /// A new connection of a session in post-copy: asks what the destination lacks, then
    /// sends it; or, if the destination never got the run, switches again.
    pub(super) fn postcopy_recover(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        report: &mut MigrationReport,
        t_connect: Instant,
    ) -> Result<(), MigrateError> {
        let phase = "post-copy recovery";
        if !report.resumed {
            return Err(PostcopyError::Recover(
                "the destination does not hold this session (its guest runs elsewhere)".into(),
            )
            .into());
        }
        conn.send(&Msg::Postcopy(PostcopyMsg::Recover), phase)?;
        let lacking = PageBits::new(mem.pages());
        let (pages, running) = loop {
            match conn.recv(phase)? {
                Msg::Postcopy(PostcopyMsg::Lacking(runs)) => {
                    lacking.set_runs(&runs)?;
                }
                Msg::Postcopy(PostcopyMsg::LackingEnd { pages, running }) => {
                    break (pages, running)
                }
                m => return Err(unexpected(phase, &m)),
            }
        };
        let Some(st) = &mut self.post else {
            return Ok(());
        };
        st.report.recoveries += 1;
        if running {
            if lacking.count() != pages {
                return Err(PostcopyError::Recover(format!(
                    "the destination's lacking runs name {} pages, its end {pages}",
                    lacking.count()
                ))
                .into());
            }
            st.pending = Arc::new(lacking);
        } else {
            let again = PageBits::new(mem.pages());
            again.set_runs(&st.switched)?;
            st.pending = Arc::new(again);
            self.send_switch(conn, report)?;
        }
        self.postcopy_send(conn, mem, report, t_connect)
    }

    /// Sends every pending page — requested ones on the preempt channel, the rest in order on
    /// this connection — then the end, the verification and the commit.
    fn postcopy_send(
        &mut self,
        conn: &mut Conn,
        mem: &Memory<'_>,
        report: &mut MigrationReport,
        t_connect: Instant,
    ) -> Result<(), MigrateError> {
        let r = self.postcopy_pages(conn, mem);
        let missing = self.post.as_ref().map_or(0, |s| s.pending.count());
        r.map_err(|e| match e {
            MigrateError::Postcopy(_) => e,
            e => PostcopyError::Paused {
                missing,
                why: e.to_string(),
            }
            .into(),
        })?;
        self.digests.refresh();
        let t_pause = self.post.as_ref().map_or_else(Instant::now, |s| s.t_pause);
        report.verify_ranges = self.verify(conn, mem)?;
        // In post-copy the guest stopped from the pause to the run, not to the commit.
        let downtime = report.downtime;
        self.switch_over(conn, report, t_pause, t_connect)?;
        report.downtime = downtime;
        report.postcopy = self.post.take().map(|s| s.report);
        Ok(())
    }

    /// The two channels until every pending page went out, and the end frame.
    fn postcopy_pages(&mut self, conn: &mut Conn, mem: &Memory<'_>) -> Result<(), MigrateError> {
        let (mut pre, close) = self.open_preempt(conn)?;
        let Some(st) = &self.post else {
            return Ok(());
        };
        let pending = st.pending.clone();
        let inbox = conn.inbox.take();
        let (batch, compression) = (self.cfg.batch_pages as usize, self.cfg.compression);
        let done = AtomicBool::new(false);
        let t0 = Instant::now();
        let bytes0 = conn.link.written();
        let (mut bg, mut fg) = (Sent::default(), Sent::default());
        let (rb, rf) = std::thread::scope(|s| {
            let h = std::thread::Builder::new()
                .name("postcopy-serve".into())
                .spawn_scoped(s, || {
                    let r = serve_requests(
                        inbox.as_ref(),
                        &mut pre,
                        mem,
                        &pending,
                        &done,
                        compression,
                        &mut fg,
                    );
                    (r, inbox)
                });
            // The only thread: none to stop. The inbox went with it (its reader thread ends
            // at its next frame; the connection is given up with this error).
            let h = match h {
                Ok(h) => h,
                Err(e) => return (Ok(()), Err(MigrateError::Thread(Cause::new(e)))),
            };
            let rb = background(conn, mem, &pending, batch, compression, &mut bg);
            done.store(true, Ordering::Release);
            let (rf, inbox) = h.join().unwrap_or_else(|_| {
                let e = std::io::Error::other("the preempt thread panicked");
                (Err(MigrateError::Thread(Cause::new(e))), None)
            });
            conn.inbox = inbox;
            (rb, rf)
        });
        if let Some(c) = close {
            c();
        }
        // Recorded even when a channel broke: the pages that arrived stay arrived, and a
        // recovery verifies them against these digests.
        for (p, d) in bg.digests.iter().chain(&fg.digests) {
            self.digests.set(*p, *d);
        }
        rb?;
        rf?;
        let Some(st) = &mut self.post else {
            return Ok(());
        };
        let r = &mut st.report;
        r.background_pages += bg.pages;
        r.preempt_pages += fg.pages;
        r.requested += fg.requested;
        r.requests_already_sent += fg.already;
        r.bytes += conn.link.written() - bytes0 + pre.written();
        let last = bg.last.max(fg.last).unwrap_or(t0);
        r.time_to_last_page = last.saturating_duration_since(t0);
        let pages = bg.pages + fg.pages;
        conn.send(&Msg::Postcopy(PostcopyMsg::End { pages }), "post-copy end")
    }

    /// The preempt channel: a second connection opened with the session's frame.
    fn open_preempt(
        &mut self,
        conn: &Conn,
    ) -> Result<(Link, Option<crate::transport::Closer>), MigrateError> {
        if conn.one_way() {
            return Err(PostcopyError::OneWay.into());
        }
        let Some(connect) = &mut self.connector else {
            return Err(PostcopyError::NoPreempt(
                "no connector for this channel (Source::set_connector)".into(),
            )
            .into());
        };
        let c = connect()?;
        let Some(w) = c.writer else {
            return Err(PostcopyError::OneWay.into());
        };
        let faults = Faults {
            cut_after: self.cfg.faults.cut_preempt_after,
            ..Faults::default()
        };
        let mut link = Link::new(w, c.closer.clone(), 0, faults);
        let phase = "opening the preempt channel";
        let io = |e| MigrateError::stream(phase, StreamError::io(e, self.cfg.timeout));
        link.write_all(&stream::preamble(VERSION)).map_err(io)?;
        let m = Msg::Postcopy(PostcopyMsg::Preempt {
            session: self.session,
            attempt: self.attempts,
        });
        link.write_all(&stream::frame(&m)).map_err(io)?;
        Ok((link, c.closer))
    }
}

/// Fills `b` with the claimed `pages` read from guest memory (paused); their digests go to
/// `sent`.
fn fill(
    b: &mut BatchBuilder,
    seq: u64,
    pages: &[u64],
    mem: &Memory<'_>,
    sent: &mut Sent,
) -> Result<(), MigrateError> {
    b.start(seq, POSTCOPY_ROUND);
    for &p in pages {
        let mut d = verify::NEVER_SENT;
        b.push_with(
            PageIndex::new(p),
            |out| mem.read_page_zero(PageIndex::new(p), out),
            |page, zero| d = verify::page_digest_known(page, zero),
        )?;
        sent.digests.push((p, d));
    }
    sent.pages += pages.len() as u64;
    Ok(())
}

/// The background stream: every pending page not claimed by a request, in memory order.
fn background(
    conn: &mut Conn,
    mem: &Memory<'_>,
    pending: &PageBits,
    batch: usize,
    compression: Compression,
    sent: &mut Sent,
) -> Result<(), MigrateError> {
    let mut b = BatchBuilder::new(compression);
    let mut seq = 0u64;
    let mut at = 0u64;
    let mut pages = Vec::with_capacity(batch);
    loop {
        pages.clear();
        while pages.len() < batch {
            let Some(p) = pending.next_set(at) else { break };
            at = p + 1;
            if pending.claim(p) {
                pages.push(p);
            }
        }
        if pages.is_empty() {
            return Ok(());
        }
        fill(&mut b, seq, &pages, mem, sent)?;
        conn.send_raw(b.frame(), "post-copy background")?;
        sent.last = Some(Instant::now());
        seq += 1;
    }
}

/// The preempt channel's sender: the destination's requests, each page sent at once unless
/// a channel already took it; until `done` (the background stream has claimed the rest).
fn serve_requests(
    inbox: Option<&super::conn::Inbox>,
    link: &mut Link,
    mem: &Memory<'_>,
    pending: &PageBits,
    done: &AtomicBool,
    compression: Compression,
    sent: &mut Sent,
) -> Result<(), MigrateError> {
    let phase = "post-copy requests";
    let Some(inbox) = inbox else {
        return Ok(());
    };
    let mut b = BatchBuilder::new(compression);
    let mut seq = 0u64;
    while !done.load(Ordering::Acquire) {
        let reqs = match inbox.recv_timeout(Duration::from_millis(5)) {
            Ok(Ok(Msg::Postcopy(PostcopyMsg::Request(r)))) => r,
            Ok(Ok(Msg::Refuse(reason))) => {
                return Err(MigrateError::Refused {
                    who: "destination",
                    reason,
                })
            }
            Ok(Ok(m)) => return Err(unexpected(phase, &m)),
            Ok(Err(e)) => return Err(MigrateError::stream(phase, e)),
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(MigrateError::stream(
                    phase,
                    StreamError::Closed {
                        what: "the page requests",
                    },
                ))
            }
        };
        let n = reqs.len() as u64;
        let mine: Vec<u64> = reqs.into_iter().filter(|&p| pending.claim(p)).collect();
        sent.requested += n;
        sent.already += n - mine.len() as u64;
        if mine.is_empty() {
            continue;
        }
        fill(&mut b, seq, &mine, mem, sent)?;
        link.write_all(b.frame())
            .map_err(|e| MigrateError::stream(phase, StreamError::io(e, Duration::ZERO)))?;
        sent.last = Some(Instant::now());
        seq += 1;
    }
    Ok(())
}
