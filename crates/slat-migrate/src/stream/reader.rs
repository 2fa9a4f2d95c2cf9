//! Reading: the preamble and then frames off a byte stream, each checked before it is
//! decoded.

use super::{Msg, HEADER_LEN, MAGIC, MAX_FRAME, PAGE_BYTES, PREAMBLE_LEN, T_PAGES, VERSION};
use crate::error::{Corruption, StreamError};
use std::io::Read;
use std::time::Duration;

/// Reads frames (and the preamble) from a byte stream, counting bytes for error messages.
pub struct FrameReader<R> {
    r: R,
    offset: u64,
    timeout: Duration,
    /// A page batch's payload handed back ([`FrameReader::recycle`]) for the next batch: a
    /// 2 MiB buffer allocated and zeroed per batch cost the destination more than the CRC.
    spare: Vec<u8>,
}

impl<R: Read> FrameReader<R> {
    /// Reads from `r`; `timeout` is the read timeout set on the socket, named in errors, and
    /// the time a frame's header or payload has to arrive in. A zero `timeout` sets no such
    /// deadline: for readers over memory (a socket has none that is zero, and both ends of a
    /// migration refuse a zero timeout before they read).
    pub fn new(r: R, timeout: Duration) -> FrameReader<R> {
        FrameReader {
            r,
            offset: 0,
            timeout,
            spare: Vec::new(),
        }
    }

    /// Gives back a batch's payload ([`crate::stream::Batch::data`]) once its pages are
    /// written, so the next batch reuses it.
    pub fn recycle(&mut self, payload: Vec<u8>) {
        self.spare = payload;
    }

    /// Bytes consumed so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Reads and checks the preamble.
    pub fn read_preamble(&mut self) -> Result<(), StreamError> {
        let mut p = [0u8; PREAMBLE_LEN];
        if !self.fill(&mut p, "the stream preamble")? {
            return Err(StreamError::Closed {
                what: "the stream preamble",
            });
        }
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&p[..8]);
        if magic != MAGIC {
            return Err(StreamError::BadMagic { found: magic });
        }
        let version = u32::from_le_bytes([p[8], p[9], p[10], p[11]]);
        if version != VERSION {
            return Err(StreamError::Version {
                found: version,
                supported: VERSION,
            });
        }
        let page = u32::from_le_bytes([p[12], p[13], p[14], p[15]]);
        if page != PAGE_BYTES as u32 {
            return Err(StreamError::PageSize {
                found: page,
                expected: PAGE_BYTES as u32,
            });
        }
        Ok(())
    }

    /// Reads one frame; `expecting` names what a clean close here would have cut short.
    pub fn read_msg(&mut self, expecting: &'static str) -> Result<Msg, StreamError> {
        let start = self.offset;
        let mut h = [0u8; HEADER_LEN];
        if !self.fill(&mut h, "a frame header")? {
            return Err(StreamError::Closed { what: expecting });
        }
        let ty = h[0];
        let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
        let crc = u32::from_le_bytes([h[5], h[6], h[7], h[8]]);
        let hcrc = u32::from_le_bytes([h[9], h[10], h[11], h[12]]);
        if crc32fast::hash(&h[..9]) != hcrc {
            return Err(StreamError::Corrupt {
                offset: start,
                why: Corruption::HeaderChecksum,
            });
        }
        if len > MAX_FRAME {
            return Err(StreamError::Corrupt {
                offset: start,
                why: Corruption::FrameTooLong {
                    len,
                    max: MAX_FRAME,
                },
            });
        }
        let mut payload = if ty == T_PAGES {
            // Only what the last batch did not reach is zeroed (batches are the same size).
            let mut p = std::mem::take(&mut self.spare);
            p.resize(len as usize, 0);
            p
        } else {
            vec![0u8; len as usize]
        };
        if !self.fill(&mut payload, "a frame")? && len != 0 {
            return Err(StreamError::Truncated {
                what: "a frame",
                offset: self.offset,
            });
        }
        if crc32fast::hash(&payload) != crc {
            return Err(StreamError::Corrupt {
                offset: start,
                why: Corruption::PayloadChecksum { ty, len },
            });
        }
        Msg::decode(ty, payload, start)
    }

    /// [`FrameReader::read_msg`] on a connection that may sit idle for longer than the
    /// timeout between frames (a page stream between rounds, a control connection during
    /// one): a timeout before the first byte of a frame reads on while `keep_waiting()` says
    /// so. Whoever owns the connection bounds the wait by its own clock and closes it.
    pub fn read_msg_waiting(
        &mut self,
        expecting: &'static str,
        keep_waiting: &dyn Fn() -> bool,
    ) -> Result<Msg, StreamError> {
        loop {
            let start = self.offset;
            match self.read_msg(expecting) {
                Err(StreamError::Timeout(_)) if self.offset == start && keep_waiting() => {}
                r => return r,
            }
        }
    }

    /// Fills `buf`. `Ok(false)`: the stream ended cleanly before its first byte.
    fn fill(&mut self, buf: &mut [u8], what: &'static str) -> Result<bool, StreamError> {
        let mut got = 0;
        // The socket's read timeout bounds each read, not the frame: a peer trickling a byte
        // just inside it would hold the destination for as long as it likes. The whole header
        // or payload must arrive within the timeout (a 4 MiB frame at the slowest
        // `--bandwidth`, 1 MiB/s, takes 4 s); so a stalled frame fails within twice the
        // timeout at most.
        let start = std::time::Instant::now();
        while got < buf.len() {
            // A zero timeout means none (in-memory readers; sockets refuse zero).
            if got > 0 && !self.timeout.is_zero() && start.elapsed() > self.timeout {
                return Err(StreamError::Timeout(self.timeout));
            }
            match self.r.read(&mut buf[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => {
                    return Err(StreamError::Truncated {
                        what,
                        offset: self.offset,
                    })
                }
                Ok(n) => {
                    got += n;
                    self.offset += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StreamError::io(e, self.timeout)),
            }
        }
        Ok(true)
    }
}
