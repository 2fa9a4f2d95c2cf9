//! The destination in post-copy: demand paging armed at the run, the guest started, faulted
//! pages requested on the return path, pages placed from the preempt channel and the
//! background stream, the recovery handshake after a broken link, and the end.

use super::incoming::{Incoming, State};
use super::{protocol, send, Destination};
use crate::error::{Cause, MigrateError, PageError, ProtocolError, StreamError};
use crate::guest::{Guest, MemoryMap};
use crate::postcopy::demand::Demand;
use crate::postcopy::{PostcopyError, POSTCOPY_ROUND};
use crate::stream::{self, Batch, FrameReader, Msg, PostcopyMsg, MAX_REQUEST, MAX_RUNS};
use crate::transport::Acceptor;
use crate::verify::{self, Digests, VerifyMode};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Out = Option<Box<dyn Write + Send>>;
type Reader = FrameReader<Box<dyn Read + Send>>;

impl Destination {
    /// Sets how this destination accepts the source's extra connections (its page streams,
    /// post-copy's preempt channel) for migrations served with
    /// [`Destination::serve_channel`] or [`Destination::serve`]; [`Destination::accept`] and
    /// [`Destination::accept_from`] set one from their listener.
    pub fn set_acceptor(&mut self, a: Acceptor) {
        self.acceptor = Some(a);
    }

    /// Pages a paused post-copy still lacks (`None`: not in post-copy).
    pub fn postcopy_missing(&self) -> Option<u64> {
        self.session.as_ref()?.post.as_ref().map(|d| d.missing())
    }

    /// Gives up a paused post-copy whose source will not come back: the guest, which cannot
    /// run on partial memory, is stopped and dropped, and the error says so. `None` when no
    /// post-copy is paused.
    pub fn abandon_postcopy(&mut self) -> Option<MigrateError> {
        let s = self.session.as_mut()?;
        let demand = s.post.take()?;
        let missing = demand.missing();
        demand.stop();
        // Closing the userfaultfd lets a vCPU waiting on a missing page go on (it finds a
        // zero page) so that the pause below returns; the guest is not run again.
        drop(demand);
        let _ = s.guest.pause();
        self.session = None;
        Some(PostcopyError::SourceLost { missing }.into())
    }

    /// The run: checks the discard set, arms demand paging, starts the guest, and serves
    /// post-copy until all pages arrived.
    pub(super) fn postcopy_run(
        &mut self,
        guest: &Arc<dyn Guest>,
        inc: &mut Incoming<'_>,
        pages: u64,
        reader: &mut Reader,
        out: &mut Out,
    ) -> Result<(), MigrateError> {
        if !guest.demand_paged() {
            return Err(PostcopyError::NotDemandPaged(guest.kind().to_string()).into());
        }
        if inc.verify_mode() != VerifyMode::Sent {
            return Err(PostcopyError::NeedsSentVerify.into());
        }
        if out.is_none() {
            return Err(PostcopyError::OneWay.into());
        }
        if self.acceptor.is_none() {
            // Checked before the guest runs here: without its preempt channel it would wait.
            return Err(PostcopyError::NoPreempt("this destination has no acceptor".into()).into());
        }
        let runs = std::mem::take(&mut inc.discards);
        let map = MemoryMap::new(guest.regions()).map_err(crate::error::GuestError::from)?;
        // SAFETY: the guest has not run here yet (a destination runs it only from here on),
        // and it says its memory may be discarded and filled on demand (`demand_paged`).
        let demand = unsafe { Demand::arm(map, &runs) }?;
        if demand.missing() != pages {
            return Err(PostcopyError::Discard(format!(
                "the run announces {pages} pages, the discards name {}",
                demand.missing()
            ))
            .into());
        }
        if let Some(s) = &mut self.session {
            s.post = Some(demand.clone());
        }
        demand.start()?;
        guest.resume()?;
        self.postcopy_serve(&demand, inc, reader, out)
    }

    /// A reconnect of a session in post-copy: answers the source's recover with the pages
    /// still lacking, asks again for every page requested and not arrived, and serves on.
    pub(super) fn postcopy_recover(
        &mut self,
        demand: &Arc<Demand>,
        inc: &mut Incoming<'_>,
        reader: &mut Reader,
        out: &mut Out,
    ) -> Result<(), MigrateError> {
        let phase = "post-copy recovery";
        match reader
            .read_msg("the recover request")
            .map_err(|e| MigrateError::stream(phase, e))?
        {
            Msg::Postcopy(PostcopyMsg::Recover) => {}
            m => return Err(protocol(phase, ProtocolError::Unexpected { msg: m.name() })),
        }
        let mut from = Some(0);
        while let Some(f) = from {
            let (runs, next) = demand.missing_runs(f, MAX_RUNS as usize);
            from = next;
            if !runs.is_empty() {
                send(out, &Msg::Postcopy(PostcopyMsg::Lacking(runs)), phase)?;
            }
        }
        let end = PostcopyMsg::LackingEnd {
            pages: demand.missing(),
            running: true,
        };
        send(out, &Msg::Postcopy(end), phase)?;
        demand.requeue();
        // The device state was restored by the connection that ran the guest.
        inc.state = State::Restored;
        self.postcopy_serve(demand, inc, reader, out)
    }

    /// Serves post-copy over the main connection and a preempt connection until every page
    /// arrived; a broken link pauses (the session and the running guest are kept).
    fn postcopy_serve(
        &mut self,
        demand: &Arc<Demand>,
        inc: &mut Incoming<'_>,
        reader: &mut Reader,
        out: &mut Out,
    ) -> Result<(), MigrateError> {
        let timeout = self.cfg.timeout;
        let r = self.accept_preempt(inc).and_then(|(pre, close)| {
            serve_channels(demand, inc, reader, out, (pre, close), timeout)
        });
        r.map_err(|e| match e {
            MigrateError::Postcopy(_) => e,
            e => PostcopyError::Paused {
                missing: demand.missing(),
                why: e.to_string(),
            }
            .into(),
        })
    }

    /// The source's preempt connection: its preamble and the frame naming this session.
    fn accept_preempt(
        &mut self,
        inc: &Incoming<'_>,
    ) -> Result<(Reader, Option<crate::transport::Closer>), MigrateError> {
        let phase = "accepting the preempt channel";
        let Some(acceptor) = &mut self.acceptor else {
            return Err(PostcopyError::NoPreempt("this destination has no acceptor".into()).into());
        };
        let c = acceptor()?;
        let Some(r) = c.reader else {
            return Err(PostcopyError::OneWay.into());
        };
        let mut r = FrameReader::new(r, self.cfg.timeout);
        r.read_preamble()
            .map_err(|e| MigrateError::stream(phase, e))?;
        let (session, attempt) = (inc.session_id(), inc.attempt());
        match r
            .read_msg("the preempt channel's opening")
            .map_err(|e| MigrateError::stream(phase, e))?
        {
            Msg::Postcopy(PostcopyMsg::Preempt {
                session: s,
                attempt: a,
            }) if s == session && a == attempt => Ok((r, c.closer)),
            m => Err(protocol(phase, ProtocolError::Unexpected { msg: m.name() })),
        }
    }
}

/// The two readers and the request writer, until the source's end and every page placed.
fn serve_channels(
    demand: &Arc<Demand>,
    inc: &mut Incoming<'_>,
    reader: &mut Reader,
    out: &mut Out,
    (mut pre, close): (Reader, Option<crate::transport::Closer>),
    timeout: Duration,
) -> Result<(), MigrateError> {
    let digests = Mutex::new(std::mem::take(&mut inc.digests));
    let out_m = Mutex::new(out.take());
    let done = AtomicBool::new(false);
    let pages = demand_pages(inc);
    let r = std::thread::scope(|s| {
        let writer = std::thread::Builder::new()
            .name("postcopy-requests".into())
            .spawn_scoped(s, || write_requests(demand, &out_m, &done))
            .map_err(|e| MigrateError::Thread(Cause::new(e)))?;
        let preempt = std::thread::Builder::new()
            .name("postcopy-preempt".into())
            .spawn_scoped(s, || {
                let mut seq = 0u64;
                loop {
                    match pre.read_msg("preempt pages") {
                        Ok(Msg::Pages(b)) => {
                            place_batch(demand, &b, &mut seq, true, pages, &digests)?
                        }
                        Ok(m) => {
                            return Err(protocol(
                                "preempt channel",
                                ProtocolError::Unexpected { msg: m.name() },
                            ))
                        }
                        Err(_) if done.load(Ordering::Acquire) => return Ok(()),
                        Err(e) => return Err(MigrateError::stream("preempt channel", e)),
                    }
                }
            });
        let preempt = match preempt {
            Ok(h) => h,
            Err(e) => {
                // The request writer polls `done` every 20 ms: set, it ends; the scope joins it.
                done.store(true, Ordering::Release);
                return Err(MigrateError::Thread(Cause::new(e)));
            }
        };
        let r = main_channel(demand, reader, pages, &digests, timeout);
        done.store(true, Ordering::Release);
        // Ends the preempt reader's wait (without a closer it ends at its read timeout).
        if let Some(c) = &close {
            c();
        }
        let w = writer.join();
        // A failure of the preempt reader only matters while pages are missing, and then
        // the main channel's wait says so.
        let _ = preempt.join();
        match w {
            Ok(Err(e)) if r.is_ok() => Err(e),
            _ => r,
        }
    });
    *out = out_m.into_inner().unwrap_or_else(|e| e.into_inner());
    inc.digests = digests.into_inner().unwrap_or_else(|e| e.into_inner());
    inc.digests.refresh();
    r
}

/// Pages of the guest (the bound of every index).
fn demand_pages(inc: &Incoming<'_>) -> u64 {
    inc.guest_pages()
}

/// The main connection in post-copy: background batches until the source's end, then the
/// wait for every page.
fn main_channel(
    demand: &Demand,
    reader: &mut Reader,
    pages: u64,
    digests: &Mutex<Digests>,
    timeout: Duration,
) -> Result<(), MigrateError> {
    let phase = "post-copy";
    let mut seq = 0u64;
    loop {
        match reader
            .read_msg("post-copy pages")
            .map_err(|e| MigrateError::stream(phase, e))?
        {
            Msg::Pages(b) => place_batch(demand, &b, &mut seq, false, pages, digests)?,
            Msg::Postcopy(PostcopyMsg::End { .. }) => break,
            Msg::Refuse(reason) => {
                return Err(MigrateError::Refused {
                    who: "source",
                    reason,
                })
            }
            m => return Err(protocol(phase, ProtocolError::Unexpected { msg: m.name() })),
        }
    }
    if !demand.wait_all(timeout) {
        return Err(MigrateError::stream(phase, StreamError::Timeout(timeout)));
    }
    Ok(())
}

/// Places a batch's pages (each index checked first), recording the digest of each page
/// placed; a page the destination already has is left as it is.
fn place_batch(
    demand: &Demand,
    b: &Batch,
    seq: &mut u64,
    preempt: bool,
    pages: u64,
    digests: &Mutex<Digests>,
) -> Result<(), MigrateError> {
    let phase = if preempt {
        "preempt channel"
    } else {
        "post-copy"
    };
    if b.seq != *seq || b.round != POSTCOPY_ROUND {
        return Err(protocol(
            phase,
            ProtocolError::BatchRound {
                seq: b.seq,
                got: b.round,
                want: POSTCOPY_ROUND,
            },
        ));
    }
    let page_error = |err| MigrateError::stream(phase, StreamError::Page { offset: 0, err });
    if let Some(&(page, _, _)) = b.entries.iter().find(|e| e.0 >= pages) {
        return Err(page_error(PageError::OutOfRange { page, pages }));
    }
    let mut buf = vec![0u8; stream::PAGE_BYTES];
    let mut placed = Vec::with_capacity(b.entries.len());
    for (i, &(p, _, _)) in b.entries.iter().enumerate() {
        if !demand.is_missing(p) {
            // Arrived already, or never missing: the guest's copy stays.
            demand.place(p, &buf, preempt)?;
            continue;
        }
        let data = match b.raw_page(i) {
            Some(d) => d,
            None => {
                b.page_into(i, &mut buf).map_err(page_error)?;
                &buf
            }
        };
        let d = verify::page_digest(data);
        if demand.place(p, data, preempt)? {
            placed.push((p, d));
        }
    }
    let mut g = digests.lock().unwrap_or_else(|e| e.into_inner());
    for (p, d) in placed {
        g.set(p, d);
    }
    *seq += 1;
    Ok(())
}

/// Sends the fault thread's requests on the return path until `done`.
fn write_requests(
    demand: &Demand,
    out: &Mutex<Out>,
    done: &AtomicBool,
) -> Result<(), MigrateError> {
    while !done.load(Ordering::Acquire) {
        let reqs = demand.requests(MAX_REQUEST as usize, Duration::from_millis(20));
        if reqs.is_empty() {
            continue;
        }
        let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
        send(
            &mut o,
            &Msg::Postcopy(PostcopyMsg::Request(reqs)),
            "page requests",
        )?;
    }
    Ok(())
}
