//! Decoding: a checksummed frame's payload back into a message, every read bounds-checked.

use super::{
    Batch, Compression, Encoding, Hello, Msg, Region, DELTA_MAX, MAX_BATCH_PAGES, MAX_HASHES,
    MAX_MACHINE, MAX_REGIONS, MAX_STATE_BLOB, MAX_STATE_ID, MAX_TEXT, PAGE_BYTES, T_ACK, T_COMMIT,
    T_HASHES, T_HELLO, T_PAGES, T_REFUSE, T_RESUMED, T_ROUND_END, T_STATE, T_STATE_END, T_STREAMS,
    T_STREAM_HELLO, T_VERIFIED, T_VERIFY, T_WELCOME,
};
use crate::error::{Corruption, StreamError};
use crate::state::StateBlob;
use slat_addr::Gpa;

impl Msg {
    /// Parses a frame whose checksum passed.
    pub(super) fn decode(ty: u8, payload: Vec<u8>, offset: u64) -> Result<Msg, StreamError> {
        if ty == T_PAGES {
            // The batch keeps the payload: its pages are decoded where they are written.
            return Dec::pages(payload, offset);
        }
        if super::PostcopyMsg::is_type(ty) {
            return super::PostcopyMsg::decode(ty, &payload, offset);
        }
        let mut d = Dec {
            b: &payload,
            at: 0,
            offset,
        };
        let m = match ty {
            T_HELLO => Msg::Hello(d.hello()?),
            T_WELCOME => Msg::Welcome {
                resume: d.flag()?,
                backend: d.text()?,
                delta: d.flag()?,
            },
            T_REFUSE => Msg::Refuse(d.text()?),
            T_ACK => Msg::Ack { seq: d.u64()? },
            T_ROUND_END => Msg::RoundEnd {
                round: d.u32()?,
                pages: d.u64()?,
            },
            T_HASHES => d.hashes()?,
            T_VERIFY => Msg::Verify {
                ranges: d.u64()?,
                range_pages: d.u32()?,
            },
            T_VERIFIED => d.verified()?,
            T_STATE => d.state()?,
            T_STATE_END => Msg::StateEnd {
                blobs: d.u32()?,
                bytes: d.u64()?,
            },
            T_STREAMS => Msg::Streams { count: d.u32()? },
            T_STREAM_HELLO => Msg::StreamHello {
                session: d.u64()?,
                attempt: d.u32()?,
                index: d.u32()?,
            },
            T_COMMIT => Msg::Commit,
            T_RESUMED => Msg::Resumed {
                touched: d.u64()?,
                micros: d.u64()?,
            },
            t => {
                return Err(StreamError::Corrupt {
                    offset,
                    why: Corruption::UnknownType(t),
                })
            }
        };
        d.end()?;
        Ok(m)
    }
}

impl Dec<'_> {
    /// The fields of a hello (the region list and the machine description bounded before
    /// they are allocated; the map's arithmetic is the receiver's [`check_regions`]).
    fn hello(&mut self) -> Result<Hello, StreamError> {
        let d = self;
        let session = d.u64()?;
        let attempt = d.u32()?;
        let one_way = d.flag()?;
        let n = d.u32()? as usize;
        if n > MAX_REGIONS as usize {
            return Err(d.bad(Corruption::TooManyRegions(n)));
        }
        d.need(n, 17)?;
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            regions.push(Region {
                gpa: Gpa::new(d.u64()?),
                pages: d.u64()?,
                read_only: d.flag()?,
            });
        }
        let m = d.u32()? as usize;
        if m > MAX_MACHINE {
            return Err(d.bad(Corruption::MachineLen(m)));
        }
        let machine = d.bytes(m)?.to_vec();
        let compression = match d.u8()? {
            0 => Compression::None,
            1 => Compression::Lz4,
            c => return Err(d.bad(Corruption::UnknownCompression(c))),
        };
        let delta = d.flag()?;
        let range_pages = d.u32()?;
        let verify = match d.u8()? {
            0 => crate::verify::VerifyMode::Full,
            1 => crate::verify::VerifyMode::Sent,
            v => return Err(d.bad(Corruption::UnknownVerify(v))),
        };
        Ok(Hello {
            session,
            attempt,
            one_way,
            regions,
            machine,
            compression,
            delta,
            range_pages,
            verify,
            backend: d.text()?,
        })
    }

    /// A device-state blob (its size bounded before it is copied).
    fn state(&mut self) -> Result<Msg, StreamError> {
        let id = self.text()?;
        if id.len() > MAX_STATE_ID || id.is_empty() {
            return Err(self.bad(Corruption::StateId(id.len())));
        }
        let version = self.u32()?;
        let len = self.u32()?;
        if len > MAX_STATE_BLOB {
            return Err(self.bad(Corruption::StateTooBig(len)));
        }
        let data = self.bytes(len as usize)?.to_vec();
        Ok(Msg::State(StateBlob { id, version, data }))
    }

    /// A batch of pages: its entries are located (each inside the payload) but not decoded.
    fn pages(payload: Vec<u8>, offset: u64) -> Result<Msg, StreamError> {
        let mut d = Dec {
            b: &payload,
            at: 0,
            offset,
        };
        let seq = d.u64()?;
        let round = d.u32()?;
        let n = d.u32()?;
        if n > MAX_BATCH_PAGES {
            return Err(d.bad(Corruption::BatchTooBig(n)));
        }
        // Each entry is at least its page index and encoding.
        d.need(n as usize, 9)?;
        let mut entries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let page = d.u64()?;
            let (enc, len) = match d.u8()? {
                0 => (Encoding::Zero, 0),
                1 => (Encoding::Raw, PAGE_BYTES),
                2 => {
                    let len = d.u32()? as usize;
                    if len == 0 || len > PAGE_BYTES + PAGE_BYTES / 255 + 16 {
                        return Err(d.bad(Corruption::CompressedLen(len)));
                    }
                    (Encoding::Lz4, len)
                }
                3 => {
                    let len = d.u32()? as usize;
                    if len == 0 || len > DELTA_MAX {
                        return Err(d.bad(Corruption::DeltaLen(len)));
                    }
                    (Encoding::Delta, len)
                }
                e => return Err(d.bad(Corruption::UnknownEncoding(e))),
            };
            let start = d.at;
            d.skip(len)?;
            entries.push((page, enc, start..d.at));
        }
        d.end()?;
        Ok(Msg::Pages(Batch {
            seq,
            round,
            entries,
            data: payload,
        }))
    }

    /// A frame of verification hashes (their count bounded before they are allocated).
    fn hashes(&mut self) -> Result<Msg, StreamError> {
        let first = self.u64()?;
        let n = self.u32()?;
        if n > MAX_HASHES {
            return Err(self.bad(Corruption::TooManyHashes(n)));
        }
        self.need(n as usize, 32)?;
        let mut hashes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let mut h = [0u8; 32];
            h.copy_from_slice(self.bytes(32)?);
            hashes.push(h);
        }
        Ok(Msg::Hashes { first, hashes })
    }

    /// The destination's verdict (at most 64 examples of differing ranges).
    fn verified(&mut self) -> Result<Msg, StreamError> {
        let ranges = self.u64()?;
        let mismatched = self.u64()?;
        let n = self.u32()?;
        if n > 64 {
            return Err(self.bad(Corruption::TooManyExamples(n)));
        }
        self.need(n as usize, 8)?;
        let mut first = Vec::with_capacity(n as usize);
        for _ in 0..n {
            first.push(self.u64()?);
        }
        Ok(Msg::Verified {
            ranges,
            mismatched,
            first,
        })
    }
}

/// A bounds-checked cursor over a payload.
struct Dec<'a> {
    b: &'a [u8],
    at: usize,
    offset: u64,
}

impl<'a> Dec<'a> {
    fn bad(&self, why: Corruption) -> StreamError {
        StreamError::Corrupt {
            offset: self.offset,
            why,
        }
    }
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], StreamError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(e) => {
                let s = &self.b[self.at..e];
                self.at = e;
                Ok(s)
            }
            None => Err(self.bad(Corruption::EndsEarly {
                len: self.b.len(),
                need: n,
                at: self.at,
            })),
        }
    }
    fn skip(&mut self, n: usize) -> Result<(), StreamError> {
        self.bytes(n).map(drop)
    }
    /// Fails unless `count` items of at least `size` bytes each can still follow: checked
    /// before a vector for them is allocated.
    fn need(&self, count: usize, size: usize) -> Result<(), StreamError> {
        let left = self.b.len() - self.at;
        match count.checked_mul(size) {
            Some(n) if n <= left => Ok(()),
            _ => Err(self.bad(Corruption::Entries { count, size, left })),
        }
    }
    fn u8(&mut self) -> Result<u8, StreamError> {
        Ok(self.bytes(1)?[0])
    }
    fn flag(&mut self) -> Result<bool, StreamError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.bad(Corruption::Flag(v))),
        }
    }
    fn u32(&mut self) -> Result<u32, StreamError> {
        let s = self.bytes(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, StreamError> {
        let s = self.bytes(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn text(&mut self) -> Result<String, StreamError> {
        let s = self.bytes(2)?;
        let n = u16::from_le_bytes([s[0], s[1]]) as usize;
        if n > MAX_TEXT {
            return Err(self.bad(Corruption::TextLen(n)));
        }
        let t = self.bytes(n)?;
        let t = std::str::from_utf8(t).map_err(|_| self.bad(Corruption::NotUtf8))?;
        // A peer's words end up in this side's one-line messages: no newlines, no escape
        // sequences for the terminal.
        let mut out = String::with_capacity(t.len());
        for c in t.chars() {
            if c.is_control() {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
        Ok(out)
    }
    fn end(&self) -> Result<(), StreamError> {
        if self.at == self.b.len() {
            Ok(())
        } else {
            Err(self.bad(Corruption::Trailing(self.b.len() - self.at)))
        }
    }
}
