//! Post-copy's frames ([`PostcopyMsg`], carried as [`Msg::Postcopy`]): the switch-over's
//! discard set, the run, page requests on the return path, the end of the background stream,
//! the recovery handshake and the preempt channel's opening.
//!
//! ```text
//! discard      count u32 | (first u64 | pages u64) * count        source → destination
//! run          pages u64                                          source → destination
//! request      count u32 | page u64 * count                       destination → source
//! end          pages u64                                          source → destination
//! recover      (empty)                                            source → destination
//! lacking      count u32 | (first u64 | pages u64) * count        destination → source
//! lacking end  pages u64 | running u8                             destination → source
//! preempt      session u64 | attempt u32                          source → destination
//! ```
//!
//! Counts are bounded ([`MAX_RUNS`], [`MAX_REQUEST`]) before anything is allocated; the
//! receiver checks every page against its guest.

use super::Msg;
use crate::error::{Corruption, StreamError};

/// Most runs in one discard or lacking frame (1 MiB of payload).
pub const MAX_RUNS: u32 = 65_536;
/// Most pages in one page request.
pub const MAX_REQUEST: u32 = 512;

pub(super) const T_DISCARD: u8 = 32;
pub(super) const T_RUN: u8 = 33;
pub(super) const T_REQUEST: u8 = 34;
pub(super) const T_END: u8 = 35;
pub(super) const T_RECOVER: u8 = 36;
pub(super) const T_LACKING: u8 = 37;
pub(super) const T_LACKING_END: u8 = 38;
pub(super) const T_PREEMPT: u8 = 39;

/// Post-copy's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostcopyMsg {
    /// Source, at the switch-over: pages (memory-index runs `(first, pages)`) the destination
    /// does not hold, or holds stale; they are discarded there and arrive on demand.
    Discard(Vec<(u64, u64)>),
    /// Source: the device state is sent, the discards add up to `pages`; run the guest.
    Run {
        /// Pages discarded in all.
        pages: u64,
    },
    /// Destination: the guest faulted on these pages (memory indexes); send them first.
    Request(Vec<u64>),
    /// Source: the background stream has sent every page this connection owed; `pages`
    /// went out on both channels. Verification follows once all have arrived.
    End {
        /// Pages sent on this connection in post-copy.
        pages: u64,
    },
    /// Source, on a new connection of a session in post-copy: which pages do you lack?
    Recover,
    /// Destination: pages it still lacks (memory-index runs).
    Lacking(Vec<(u64, u64)>),
    /// Destination: the lacking runs add up to `pages`; `running`: the guest runs here (a
    /// destination that never got the run answers `false` and lacks the switch-over).
    LackingEnd {
        /// Pages lacking in all.
        pages: u64,
        /// The guest runs on the destination.
        running: bool,
    },
    /// Source, first frame of a second connection: the preempt channel of this session.
    Preempt {
        /// The session.
        session: u64,
        /// Its attempt.
        attempt: u32,
    },
}

impl PostcopyMsg {
    /// A short name for messages and errors.
    pub fn name(&self) -> &'static str {
        match self {
            PostcopyMsg::Discard(_) => "post-copy discard",
            PostcopyMsg::Run { .. } => "post-copy run",
            PostcopyMsg::Request(_) => "page request",
            PostcopyMsg::End { .. } => "post-copy end",
            PostcopyMsg::Recover => "post-copy recover",
            PostcopyMsg::Lacking(_) => "lacking pages",
            PostcopyMsg::LackingEnd { .. } => "lacking end",
            PostcopyMsg::Preempt { .. } => "preempt channel",
        }
    }

    /// Type byte and payload.
    pub(super) fn encode(&self, out: &mut Vec<u8>) -> u8 {
        let u32_ = |out: &mut Vec<u8>, v: u32| out.extend_from_slice(&v.to_le_bytes());
        let u64_ = |out: &mut Vec<u8>, v: u64| out.extend_from_slice(&v.to_le_bytes());
        let runs = |out: &mut Vec<u8>, rs: &[(u64, u64)]| {
            u32_(out, rs.len() as u32);
            for &(a, n) in rs {
                u64_(out, a);
                u64_(out, n);
            }
        };
        match self {
            PostcopyMsg::Discard(rs) => {
                runs(out, rs);
                T_DISCARD
            }
            PostcopyMsg::Run { pages } => {
                u64_(out, *pages);
                T_RUN
            }
            PostcopyMsg::Request(ps) => {
                u32_(out, ps.len() as u32);
                for &p in ps {
                    u64_(out, p);
                }
                T_REQUEST
            }
            PostcopyMsg::End { pages } => {
                u64_(out, *pages);
                T_END
            }
            PostcopyMsg::Recover => T_RECOVER,
            PostcopyMsg::Lacking(rs) => {
                runs(out, rs);
                T_LACKING
            }
            PostcopyMsg::LackingEnd { pages, running } => {
                u64_(out, *pages);
                out.push(*running as u8);
                T_LACKING_END
            }
            PostcopyMsg::Preempt { session, attempt } => {
                u64_(out, *session);
                u32_(out, *attempt);
                T_PREEMPT
            }
        }
    }

    /// Whether `ty` is one of post-copy's frame types.
    pub(super) fn is_type(ty: u8) -> bool {
        (T_DISCARD..=T_PREEMPT).contains(&ty)
    }

    /// Parses a post-copy frame whose checksum passed (`offset`: the frame's, for errors).
    pub(super) fn decode(ty: u8, payload: &[u8], offset: u64) -> Result<Msg, StreamError> {
        let mut d = Rd {
            b: payload,
            at: 0,
            offset,
        };
        let m = match ty {
            T_DISCARD => PostcopyMsg::Discard(d.runs()?),
            T_RUN => PostcopyMsg::Run { pages: d.u64()? },
            T_REQUEST => {
                let n = d.u32()?;
                if n > MAX_REQUEST {
                    return Err(d.bad(Corruption::TooManyRuns(n)));
                }
                d.need(n as usize, 8)?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(d.u64()?);
                }
                PostcopyMsg::Request(v)
            }
            T_END => PostcopyMsg::End { pages: d.u64()? },
            T_RECOVER => PostcopyMsg::Recover,
            T_LACKING => PostcopyMsg::Lacking(d.runs()?),
            T_LACKING_END => PostcopyMsg::LackingEnd {
                pages: d.u64()?,
                running: match d.u8()? {
                    0 => false,
                    1 => true,
                    f => return Err(d.bad(Corruption::Flag(f))),
                },
            },
            _ => PostcopyMsg::Preempt {
                session: d.u64()?,
                attempt: d.u32()?,
            },
        };
        if d.at != d.b.len() {
            return Err(d.bad(Corruption::Trailing(d.b.len() - d.at)));
        }
        Ok(Msg::Postcopy(m))
    }
}

/// A bounds-checked reader of one payload.
struct Rd<'a> {
    b: &'a [u8],
    at: usize,
    offset: u64,
}

impl Rd<'_> {
    fn bad(&self, why: Corruption) -> StreamError {
        StreamError::Corrupt {
            offset: self.offset,
            why,
        }
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], StreamError> {
        let end = self.at.checked_add(N).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(self.bad(Corruption::EndsEarly {
                len: self.b.len(),
                need: N,
                at: self.at,
            }));
        };
        let mut out = [0u8; N];
        out.copy_from_slice(&self.b[self.at..end]);
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, StreamError> {
        Ok(self.take::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, StreamError> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    fn u64(&mut self) -> Result<u64, StreamError> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    /// `count` entries of `size` bytes fit what is left.
    fn need(&self, count: usize, size: usize) -> Result<(), StreamError> {
        let left = self.b.len() - self.at;
        if count.checked_mul(size).is_none_or(|n| n > left) {
            return Err(self.bad(Corruption::Entries { count, size, left }));
        }
        Ok(())
    }

    fn runs(&mut self) -> Result<Vec<(u64, u64)>, StreamError> {
        let n = self.u32()?;
        if n > MAX_RUNS {
            return Err(self.bad(Corruption::TooManyRuns(n)));
        }
        self.need(n as usize, 16)?;
        let mut v = Vec::with_capacity(n as usize);
        for _ in 0..n {
            v.push((self.u64()?, self.u64()?));
        }
        Ok(v)
    }
}
