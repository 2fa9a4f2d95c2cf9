//! The connection of an attempt: frames out through the link, the destination's replies in
//! through a reader thread of their own.

use crate::error::{Cause, MigrateError, ProtocolError, StreamError};
use crate::link::Link;
use crate::stream::{self, FrameReader, Msg, PostcopyMsg};
use std::io::{Read, Write};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Frames the reader thread received, or why it stopped.
pub(super) type Inbox = Receiver<Result<Msg, StreamError>>;

/// The connection of one attempt.
pub(super) struct Conn {
    pub(super) link: Link,
    /// The destination's frames (none over a one-way channel).
    pub(super) inbox: Option<Inbox>,
    pub(super) timeout: Duration,
    /// Where the channel leads.
    pub(super) peer: String,
    /// Page streams beside this connection (empty: the pages go over it).
    pub(super) streams: Vec<super::striped::PageStream>,
}

impl Conn {
    /// Bytes written over this connection and its page streams.
    pub(super) fn written(&self) -> u64 {
        self.link.written() + self.streams.iter().map(|s| s.link.written()).sum::<u64>()
    }

    /// Closes the page streams and waits for their reader threads.
    pub(super) fn close_streams(&mut self) {
        for s in &self.streams {
            if let Some(c) = &s.close {
                c();
            }
        }
        for s in self.streams.drain(..) {
            drop(s.inbox);
            let _ = s.thread.join();
        }
    }

    pub(super) fn send_raw(&mut self, bytes: &[u8], phase: &str) -> Result<(), MigrateError> {
        match self.link.write_all(bytes) {
            Ok(()) => Ok(()),
            // The destination may have said why it stopped reading.
            Err(e) => Err(self
                .refusal()
                .unwrap_or_else(|| MigrateError::stream(phase, StreamError::io(e, self.timeout)))),
        }
    }

    pub(super) fn send(&mut self, m: &Msg, phase: &str) -> Result<(), MigrateError> {
        self.send_raw(&stream::frame(m), phase)
    }

    /// Nothing comes back.
    pub(super) fn one_way(&self) -> bool {
        self.inbox.is_none()
    }

    /// A refusal the destination sent, if one is waiting.
    pub(super) fn refusal(&self) -> Option<MigrateError> {
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
    pub(super) fn recv(&mut self, phase: &str) -> Result<Msg, MigrateError> {
        let Some(inbox) = &self.inbox else {
            return Err(MigrateError::stream(
                phase,
                StreamError::Closed {
                    what: "a reply (the channel is one-way)",
                },
            ));
        };
        let mut m = inbox.recv_timeout(self.timeout);
        // A post-copy page request that arrived after its page went out needs nothing.
        while let Ok(Ok(Msg::Postcopy(PostcopyMsg::Request(_)))) = m {
            m = inbox.recv_timeout(self.timeout);
        }
        match m {
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
    pub(super) fn try_recv(&mut self, phase: &str) -> Result<Option<Msg>, MigrateError> {
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

pub(super) fn unexpected(phase: &str, m: &Msg) -> MigrateError {
    MigrateError::stream(
        phase,
        StreamError::Protocol(ProtocolError::Unexpected { msg: m.name() }),
    )
}

/// Batches sent and not yet acknowledged, at most.
pub(super) const MAX_INFLIGHT: usize = 1024;

/// Frames the reader thread holds for the source, at most: the acknowledgements of a full
/// window and the few other replies. A destination that sends more is not read from until
/// the source catches up (its socket fills; it cannot make this side buffer without bound).
const INBOX: usize = MAX_INFLIGHT + 16;

/// Reads the destination's frames on a thread of their own, so acknowledgements drain while
/// the source is busy writing. Only the frames a destination sends are passed on (all of
/// them small); any other ends the connection.
pub(super) fn spawn_reader(
    s: Box<dyn Read + Send>,
    timeout: Duration,
) -> Result<(Inbox, JoinHandle<()>), MigrateError> {
    spawn_reader_idle(s, timeout, false)
}

/// [`spawn_reader`]; with `idle`, the connection may sit silent for longer than the timeout
/// between frames (a page stream between rounds): its owner watches the time and closes it.
pub(super) fn spawn_reader_idle(
    s: Box<dyn Read + Send>,
    timeout: Duration,
    idle: bool,
) -> Result<(Inbox, JoinHandle<()>), MigrateError> {
    let (tx, rx): (SyncSender<_>, _) = mpsc::sync_channel(INBOX);
    let h = std::thread::Builder::new()
        .name("migrate-acks".into())
        .spawn(move || {
            let mut r = FrameReader::new(s, timeout);
            loop {
                let m = match r.read_msg_waiting("the destination's reply", &|| idle) {
                    Ok(
                        m @ (Msg::Welcome { .. }
                        | Msg::Refuse(_)
                        | Msg::Ack { .. }
                        | Msg::Verified { .. }
                        | Msg::Resumed { .. }
                        | Msg::Postcopy(
                            PostcopyMsg::Request(_)
                            | PostcopyMsg::Lacking(_)
                            | PostcopyMsg::LackingEnd { .. },
                        )),
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
