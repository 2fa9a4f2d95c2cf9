//! Encoding: each message's payload, the page batches, and the frame header sealed over
//! them.

use super::{
    Compression, Encoding, Hello, Msg, HEADER_LEN, MAGIC, MAX_BATCH_PAGES, MAX_TEXT, PAGE_BYTES,
    PREAMBLE_LEN, T_ACK, T_COMMIT, T_HASHES, T_HELLO, T_PAGES, T_REFUSE, T_RESUMED, T_ROUND_END,
    T_STATE, T_STATE_END, T_VERIFIED, T_VERIFY, T_WELCOME,
};
use slat_addr::PageIndex;
use std::io::Write;

impl Msg {
    /// Type byte and payload. `Pages` is built by [`BatchBuilder`] instead.
    fn encode(&self, out: &mut Vec<u8>) -> u8 {
        match self {
            Msg::Hello(h) => {
                put_hello(out, h);
                T_HELLO
            }
            Msg::Welcome { resume, backend } => {
                out.push(*resume as u8);
                put_text(out, backend);
                T_WELCOME
            }
            Msg::Refuse(r) => {
                put_text(out, r);
                T_REFUSE
            }
            Msg::Pages(b) => {
                out.extend_from_slice(&b.data);
                T_PAGES
            }
            Msg::Ack { seq } => {
                put_u64(out, *seq);
                T_ACK
            }
            Msg::RoundEnd { round, pages } => {
                put_u32(out, *round);
                put_u64(out, *pages);
                T_ROUND_END
            }
            Msg::Hashes { first, hashes } => {
                put_u64(out, *first);
                put_u32(out, hashes.len() as u32);
                for h in hashes {
                    out.extend_from_slice(h);
                }
                T_HASHES
            }
            Msg::Verify {
                ranges,
                range_pages,
            } => {
                put_u64(out, *ranges);
                put_u32(out, *range_pages);
                T_VERIFY
            }
            Msg::Verified {
                ranges,
                mismatched,
                first,
            } => {
                put_u64(out, *ranges);
                put_u64(out, *mismatched);
                put_u32(out, first.len() as u32);
                for &r in first {
                    put_u64(out, r);
                }
                T_VERIFIED
            }
            Msg::State(b) => {
                put_text(out, &b.id);
                put_u32(out, b.version);
                put_u32(out, b.data.len() as u32);
                out.extend_from_slice(&b.data);
                T_STATE
            }
            Msg::StateEnd { blobs, bytes } => {
                put_u32(out, *blobs);
                put_u64(out, *bytes);
                T_STATE_END
            }
            Msg::Commit => T_COMMIT,
            Msg::Resumed { touched, micros } => {
                put_u64(out, *touched);
                put_u64(out, *micros);
                T_RESUMED
            }
        }
    }
}

/// A hello's payload: the session, the memory map, the machine and the options chosen.
fn put_hello(out: &mut Vec<u8>, h: &Hello) {
    put_u64(out, h.session);
    put_u32(out, h.attempt);
    out.push(h.one_way as u8);
    put_u32(out, h.regions.len() as u32);
    for r in &h.regions {
        put_u64(out, r.gpa.raw());
        put_u64(out, r.pages);
        out.push(r.read_only as u8);
    }
    put_u32(out, h.machine.len() as u32);
    out.extend_from_slice(&h.machine);
    out.push(match h.compression {
        Compression::None => 0,
        Compression::Lz4 => 1,
    });
    put_u32(out, h.range_pages);
    out.push(match h.verify {
        crate::verify::VerifyMode::Full => 0,
        crate::verify::VerifyMode::Sent => 1,
    });
    put_text(out, &h.backend);
}

/// Builds the payload of a [`Msg::Pages`] frame, choosing each page's encoding.
#[derive(Debug)]
pub struct BatchBuilder {
    buf: Vec<u8>,
    count: u32,
    scratch: Vec<u8>,
    compression: Compression,
    /// Zero pages in this batch.
    pub zero: u32,
}

impl BatchBuilder {
    /// A builder using `compression` for non-zero pages.
    pub fn new(compression: Compression) -> BatchBuilder {
        BatchBuilder {
            buf: Vec::with_capacity(HEADER_LEN + 16 + MAX_BATCH_PAGES as usize * (PAGE_BYTES + 9)),
            count: 0,
            scratch: vec![0; lz4_flex::block::get_maximum_output_size(PAGE_BYTES)],
            compression,
            zero: 0,
        }
    }

    /// Starts batch `seq` of round `round`.
    pub fn start(&mut self, seq: u64, round: u32) {
        self.buf.clear();
        // Room for the frame header, filled in by `frame`.
        self.buf.resize(HEADER_LEN, 0);
        put_u64(&mut self.buf, seq);
        put_u32(&mut self.buf, round);
        put_u32(&mut self.buf, 0);
        self.count = 0;
        self.zero = 0;
    }

    /// Pages in the batch.
    pub fn len(&self) -> u32 {
        self.count
    }

    /// No page yet.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Adds page `page` (a memory index) with contents `data` (one page).
    pub fn push(&mut self, page: PageIndex, data: &[u8]) {
        debug_assert_eq!(data.len(), PAGE_BYTES);
        put_u64(&mut self.buf, page.raw());
        // OR-reduce instead of an early-exit scan: it vectorises, and 4 KiB is cheap.
        if data.iter().fold(0u8, |a, &b| a | b) == 0 {
            self.buf.push(Encoding::Zero as u8);
            self.zero += 1;
        } else {
            let packed = match self.compression {
                Compression::None => None,
                Compression::Lz4 => lz4_flex::block::compress_into(data, &mut self.scratch)
                    .ok()
                    .filter(|&n| n < PAGE_BYTES),
            };
            match packed {
                Some(n) => {
                    self.buf.push(Encoding::Lz4 as u8);
                    put_u32(&mut self.buf, n as u32);
                    self.buf.extend_from_slice(&self.scratch[..n]);
                }
                None => {
                    self.buf.push(Encoding::Raw as u8);
                    self.buf.extend_from_slice(data);
                }
            }
        }
        self.count += 1;
    }

    /// The finished frame (header included), ready to write.
    pub fn frame(&mut self) -> &[u8] {
        let n = self.count.to_le_bytes();
        self.buf[HEADER_LEN + 12..HEADER_LEN + 16].copy_from_slice(&n);
        seal(&mut self.buf, T_PAGES);
        &self.buf
    }
}

/// Fills in the header of a frame whose payload follows `HEADER_LEN` reserved bytes.
pub(super) fn seal(frame: &mut [u8], ty: u8) {
    let len = (frame.len() - HEADER_LEN) as u32;
    frame[0] = ty;
    frame[1..5].copy_from_slice(&len.to_le_bytes());
    let payload = crc32fast::hash(&frame[HEADER_LEN..]);
    frame[5..9].copy_from_slice(&payload.to_le_bytes());
    let header = crc32fast::hash(&frame[..9]);
    frame[9..13].copy_from_slice(&header.to_le_bytes());
}

/// The stream preamble with `version` (tests send a wrong one).
pub fn preamble(version: u32) -> [u8; PREAMBLE_LEN] {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..8].copy_from_slice(&MAGIC);
    p[8..12].copy_from_slice(&version.to_le_bytes());
    p[12..16].copy_from_slice(&(PAGE_BYTES as u32).to_le_bytes());
    p
}

/// Encodes `m` as a complete frame.
pub fn frame(m: &Msg) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    let ty = m.encode(&mut out);
    seal(&mut out, ty);
    out
}

/// Writes `m` as one frame.
pub fn write_msg<W: Write>(w: &mut W, m: &Msg) -> std::io::Result<()> {
    w.write_all(&frame(m))
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_text(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}
