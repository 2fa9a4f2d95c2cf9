//! Encoding: each message's payload, the page batches, and the frame header sealed over
//! them.

use super::delta;
use super::{
    Compression, Encoding, Hello, Msg, HEADER_LEN, MAGIC, MAX_BATCH_PAGES, MAX_TEXT, PAGE_BYTES,
    PREAMBLE_LEN, T_ACK, T_COMMIT, T_HASHES, T_HELLO, T_PAGES, T_REFUSE, T_RESUMED, T_ROUND_END,
    T_STATE, T_STATE_END, T_STREAMS, T_STREAM_HELLO, T_VERIFIED, T_VERIFY, T_WELCOME,
};
use crate::source::cache::{Base, DeltaCache};
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
            Msg::Welcome { .. } => put_welcome(out, self),
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
            Msg::Streams { .. } | Msg::StreamHello { .. } => put_streams(out, self),
            Msg::Commit => T_COMMIT,
            Msg::Postcopy(m) => m.encode(out),
            Msg::Resumed { touched, micros } => {
                put_u64(out, *touched);
                put_u64(out, *micros);
                T_RESUMED
            }
        }
    }
}

/// The welcome: whether the session resumes, the destination's machine, and whether it
/// accepts delta pages.
fn put_welcome(out: &mut Vec<u8>, m: &Msg) -> u8 {
    if let Msg::Welcome {
        resume,
        backend,
        delta,
    } = m
    {
        out.push(*resume as u8);
        put_text(out, backend);
        out.push(*delta as u8);
    }
    T_WELCOME
}

/// The page streams' frames: the count announced, and a stream's header.
fn put_streams(out: &mut Vec<u8>, m: &Msg) -> u8 {
    match *m {
        Msg::Streams { count } => {
            put_u32(out, count);
            T_STREAMS
        }
        Msg::StreamHello {
            session,
            attempt,
            index,
        } => {
            put_u64(out, session);
            put_u32(out, attempt);
            put_u32(out, index);
            T_STREAM_HELLO
        }
        // Only the two above are passed here.
        _ => 0,
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
    out.push(h.delta as u8);
    put_u32(out, h.range_pages);
    out.push(match h.verify {
        crate::verify::VerifyMode::Full => 0,
        crate::verify::VerifyMode::Sent => 1,
    });
    put_text(out, &h.backend);
}

/// Builds the payload of a [`Msg::Pages`] frame, choosing each page's encoding.
///
/// A page is copied once on this side: from guest memory straight into the frame
/// ([`BatchBuilder::push_with`]), where it is checked for zeroes and hashed in place. The
/// frame buffer keeps its length (zeroed once) and `len` marks its end, so making room for a
/// page costs no memset.
#[derive(Debug)]
pub struct BatchBuilder {
    buf: Vec<u8>,
    len: usize,
    count: u32,
    scratch: Vec<u8>,
    compression: Compression,
    /// Zero pages in this batch.
    pub zero: u32,
    /// Pages of this batch sent as deltas.
    pub delta: u32,
    /// The round of this batch (a cache slot is not taken from a page sent in the same one).
    round: u32,
}

/// Bytes of an entry before its data: the page index and the encoding.
const ENTRY_HEAD: usize = 9;
/// Largest delta sent: past half a page, the page goes whole (the destination's patch would
/// cost about as much as the copy, and the compare on the source was wasted anyway).
pub const DELTA_MAX: usize = PAGE_BYTES / 2;
/// The base of a delta against a page sent as zero.
static ZERO_PAGE: [u8; PAGE_BYTES] = [0; PAGE_BYTES];

impl BatchBuilder {
    /// A builder using `compression` for non-zero pages.
    pub fn new(compression: Compression) -> BatchBuilder {
        BatchBuilder {
            buf: vec![0; HEADER_LEN + 16 + MAX_BATCH_PAGES as usize * (PAGE_BYTES + ENTRY_HEAD)],
            len: 0,
            count: 0,
            scratch: vec![0; lz4_flex::block::get_maximum_output_size(PAGE_BYTES)],
            compression,
            zero: 0,
            delta: 0,
            round: 0,
        }
    }

    /// Starts batch `seq` of round `round`.
    pub fn start(&mut self, seq: u64, round: u32) {
        // Room for the frame header, filled in by `frame`.
        self.len = HEADER_LEN;
        self.put(&seq.to_le_bytes());
        self.put(&round.to_le_bytes());
        self.put(&0u32.to_le_bytes());
        self.count = 0;
        self.zero = 0;
        self.delta = 0;
        self.round = round;
    }

    /// Pages in the batch.
    pub fn len(&self) -> u32 {
        self.count
    }

    /// No page yet.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Room for `n` more bytes (the buffer grows only past [`MAX_BATCH_PAGES`] raw pages).
    fn room(&mut self, n: usize) -> std::ops::Range<usize> {
        let end = self.len + n;
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        let r = self.len..end;
        self.len = end;
        r
    }

    fn put(&mut self, bytes: &[u8]) {
        let r = self.room(bytes.len());
        self.buf[r].copy_from_slice(bytes);
    }

    /// Adds page `page` (a memory index) with contents `data` (one page).
    pub fn push(&mut self, page: PageIndex, data: &[u8]) {
        debug_assert_eq!(data.len(), PAGE_BYTES);
        let _ = self.push_with(
            page,
            |out| {
                let n = data.len().min(PAGE_BYTES);
                out[..n].copy_from_slice(&data[..n]);
                out[n..].fill(0);
                Ok::<bool, ()>(out.iter().fold(0u8, |a, &b| a | b) == 0)
            },
            |_, _| {},
        );
    }

    /// Adds page `page` (a memory index) whose contents `fill` writes into the frame (one
    /// page; `fill` writes all of it, the space holds an earlier batch's bytes) and says
    /// whether they are all zero (found while copying, so nothing scans the page again; a
    /// wrong answer sends a wrong page, which verification reports). `seen` then gets the page
    /// as it will arrive (before compression) and that answer, e.g. to hash it. On an error
    /// from `fill` the batch is as before.
    pub fn push_with<E>(
        &mut self,
        page: PageIndex,
        fill: impl FnOnce(&mut [u8]) -> Result<bool, E>,
        seen: impl FnOnce(&[u8], bool),
    ) -> Result<(), E> {
        self.push_inner(page, fill, seen, None)
    }

    /// [`BatchBuilder::push_with`], sending the page as a delta against `cache`'s copy of it
    /// where that copy exists and the delta is at most [`DELTA_MAX`] bytes; `cache` then
    /// holds the page as sent.
    pub fn push_cached<E>(
        &mut self,
        page: PageIndex,
        fill: impl FnOnce(&mut [u8]) -> Result<bool, E>,
        seen: impl FnOnce(&[u8], bool),
        cache: &mut DeltaCache,
    ) -> Result<(), E> {
        self.push_inner(page, fill, seen, Some(cache))
    }

    fn push_inner<E>(
        &mut self,
        page: PageIndex,
        fill: impl FnOnce(&mut [u8]) -> Result<bool, E>,
        seen: impl FnOnce(&[u8], bool),
        cache: Option<&mut DeltaCache>,
    ) -> Result<(), E> {
        let at = self.len;
        self.put(&page.raw().to_le_bytes());
        self.put(&[Encoding::Raw as u8]);
        let data = self.room(PAGE_BYTES);
        let zero = match fill(&mut self.buf[data.clone()]) {
            Ok(z) => z,
            Err(e) => {
                self.len = at;
                return Err(e);
            }
        };
        let bytes = &self.buf[data.clone()];
        seen(bytes, zero);
        self.count += 1;
        if let Some(cache) = cache {
            if !zero && self.delta(at, page.raw(), cache) {
                return Ok(());
            }
            cache.put(page.raw(), &self.buf[data.clone()], zero, self.round);
        }
        if zero {
            self.buf[at + 8] = Encoding::Zero as u8;
            self.len = data.start;
            self.zero += 1;
        } else if self.compression == Compression::Lz4 {
            let bytes = &self.buf[data.clone()];
            let packed = lz4_flex::block::compress_into(bytes, &mut self.scratch)
                .ok()
                .filter(|&n| n < PAGE_BYTES);
            if let Some(n) = packed {
                self.buf[at + 8] = Encoding::Lz4 as u8;
                self.len = data.start;
                self.put(&(n as u32).to_le_bytes());
                let r = self.room(n);
                self.buf[r].copy_from_slice(&self.scratch[..n]);
            }
        }
        Ok(())
    }

    /// Turns the raw entry at `at` (the last one) into a delta against `cache`'s copy of
    /// `page`, patching the copy; `false` (the entry untouched) on a miss or a delta larger
    /// than [`DELTA_MAX`].
    fn delta(&mut self, at: usize, page: u64, cache: &mut DeltaCache) -> bool {
        let data = at + ENTRY_HEAD..at + ENTRY_HEAD + PAGE_BYTES;
        let bytes = &self.buf[data.clone()];
        let out = &mut self.scratch[..DELTA_MAX];
        let n = match cache.base(page) {
            Base::Miss => None,
            Base::Zero => delta::encode(&ZERO_PAGE, bytes, out),
            Base::Page(b) => delta::encode(b, bytes, out),
        };
        let Some(n) = n else {
            cache.misses += 1;
            return false;
        };
        cache.hits += 1;
        self.delta += 1;
        cache.patch(page, &self.scratch[..n], self.round);
        self.buf[at + 8] = Encoding::Delta as u8;
        self.len = data.start;
        self.put(&(n as u32).to_le_bytes());
        let r = self.room(n);
        self.buf[r].copy_from_slice(&self.scratch[..n]);
        true
    }

    /// The finished frame (header included), ready to write.
    pub fn frame(&mut self) -> &[u8] {
        let n = self.count.to_le_bytes();
        self.buf[HEADER_LEN + 12..HEADER_LEN + 16].copy_from_slice(&n);
        seal(&mut self.buf[..self.len], T_PAGES);
        &self.buf[..self.len]
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
