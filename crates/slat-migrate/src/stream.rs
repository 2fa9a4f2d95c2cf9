//! The migration stream: a preamble, then checksummed frames in both directions.
//!
//! ```text
//! preamble   "SLATMIGR" | version u32 | page size u32              (source → destination, once)
//! frame      type u8 | length u32 | payload crc32 u32 | header crc32 u32 | payload
//! ```
//!
//! Integers are little-endian. The header has a checksum of its own, so a corrupted length
//! is caught before the reader waits for bytes that will never come (a length that points
//! past the end would otherwise stall both sides until a timeout); it is also bounded by
//! [`MAX_FRAME`] before anything is allocated. The payload checksum catches a flipped bit
//! anywhere else before the contents are used. Pages travel in batches ([`Msg::Pages`]) of
//! entries `page u64 | encoding u8 | [length u32 | bytes]`: a zero page is only a marker, a
//! raw page its 4096 bytes, a compressed page its LZ4 block (which must decompress to
//! exactly one page). Every decode is bounds-checked and returns a [`StreamError`]; nothing in
//! here panics on bad input. Counts are bounded before anything is allocated for them
//! ([`MAX_BATCH_PAGES`], [`MAX_HASHES`], [`MAX_REGIONS`], [`MAX_STATE_BLOBS`]), and text
//! fields are capped and have their control characters escaped, so a peer's words print as
//! one harmless line.
//!
//! The memory map a peer announces — its [`Region`]s — is checked by [`check_regions`] with
//! checked arithmetic (page-aligned, sorted, disjoint, inside a 52-bit guest-physical space,
//! at most [`MAX_GUEST_BYTES`] in all); the destination then bounds it by what it is willing
//! and able to map. Device state ([`Msg::State`]) is opaque to the stream: each blob is
//! capped at [`MAX_STATE_BLOB`] bytes and a guest's blobs at [`MAX_STATE_BLOBS`] and
//! [`MAX_STATE_BYTES`] in all.
//!
//! The preamble is outside the frames so that a destination can reject another protocol
//! version before trying to parse a frame whose layout may have changed.

use crate::error::{Corruption, MapError, PageError, StreamError};
use crate::state::StateBlob;
use slat_addr::Gpa;
use std::io::{Read, Write};
use std::time::Duration;

/// The first eight bytes of every stream.
pub const MAGIC: [u8; 8] = *b"SLATMIGR";
/// The protocol version this build speaks.
pub const VERSION: u32 = 2;
/// `slat_addr::PAGE_SIZE` (the page the stream carries) as a `usize`, for buffer lengths.
pub(crate) const PAGE_BYTES: usize = slat_addr::PAGE_SIZE as usize;
/// Largest frame payload (a batch of [`MAX_BATCH_PAGES`] raw pages fits with room to spare).
pub const MAX_FRAME: u32 = 4 << 20;
/// Most pages in one [`Msg::Pages`] batch.
pub const MAX_BATCH_PAGES: u32 = 512;
/// Most hashes in one [`Msg::Hashes`] frame.
pub const MAX_HASHES: u32 = 4096;
/// Longest reason string in a [`Msg::Refuse`].
const MAX_TEXT: usize = 1024;
/// Most regions in a guest's memory map (one memslot each at most; KVM has 32764 memslots
/// per address space).
pub const MAX_REGIONS: u32 = 32_000;
/// Highest guest-physical address bit a region may reach (x86-64 and arm64 top out at 52).
pub const GPA_BITS: u32 = 52;
/// Largest machine description a hello carries ([`Hello::machine`]).
pub const MAX_MACHINE: usize = 4096;
/// Largest device-state blob (one frame, with room for its id and header).
pub const MAX_STATE_BLOB: u32 = MAX_FRAME - 4096;
/// Most device-state blobs of one guest.
pub const MAX_STATE_BLOBS: u32 = 4096;
/// Most device-state bytes of one guest in all.
pub const MAX_STATE_BYTES: u64 = 256 << 20;
/// Longest device-state id.
pub const MAX_STATE_ID: usize = 256;
/// Most guest memory: a 48-bit guest physical address space, less the page above the test
/// region (the simulated machine places it one page below the top, as KVM's selftests do).
pub const MAX_GUEST_BYTES: u64 = (1 << 48) - PAGE_BYTES as u64;

const PREAMBLE_LEN: usize = 16;
const HEADER_LEN: usize = 13;

/// How a page travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Encoding {
    /// All zero bytes: no data follows.
    Zero = 0,
    /// The page's 4096 bytes.
    Raw = 1,
    /// An LZ4 block that decompresses to the page.
    Lz4 = 2,
}

/// What compression the source uses for non-zero pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Pages go raw.
    #[default]
    None,
    /// LZ4 blocks (`lz4_flex`), used for a page only when they are smaller.
    Lz4,
}

impl Compression {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
        }
    }
}

/// One region of guest-physical memory as the stream describes it. Pages travel under
/// their *memory index*: the regions of a map, in address order, laid end to end (holes
/// between regions take no index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// Guest-physical address of its first byte (page aligned).
    pub gpa: Gpa,
    /// Pages in it (at least one).
    pub pages: u64,
    /// The guest cannot write it (ROM): copied once, never dirty-logged.
    pub read_only: bool,
}

impl Region {
    /// Guest-physical address one past its last byte (`None`: past 64 bits).
    pub fn end(&self) -> Option<Gpa> {
        self.pages
            .checked_mul(PAGE_BYTES as u64)
            .and_then(|b| self.gpa.checked_add(b))
    }
}

/// Checks a memory map with checked arithmetic: 1 to [`MAX_REGIONS`] regions, each non-empty,
/// page aligned and below 2^[`GPA_BITS`], in ascending order without overlap, at most
/// [`MAX_GUEST_BYTES`] in all. Returns the pages of the map.
pub fn check_regions(regions: &[Region]) -> Result<u64, MapError> {
    if regions.is_empty() || regions.len() > MAX_REGIONS as usize {
        return Err(MapError::Count(regions.len()));
    }
    let mut total = 0u64;
    let mut prev_end = Gpa::ZERO;
    for (index, r) in regions.iter().enumerate() {
        if r.pages == 0 {
            return Err(MapError::Empty { index });
        }
        if !r.gpa.is_page_aligned() {
            return Err(MapError::Unaligned { index, gpa: r.gpa });
        }
        let end = r.end().filter(|&e| e <= Gpa::new(1u64 << GPA_BITS));
        let Some(end) = end else {
            return Err(MapError::Beyond {
                index,
                gpa: r.gpa,
                pages: r.pages,
            });
        };
        if index > 0 && r.gpa < prev_end {
            return Err(MapError::Overlap { index, gpa: r.gpa });
        }
        prev_end = end;
        // Each region is below 2^52 bytes: the sum of a few thousand cannot overflow, and is
        // checked against the limit as it grows.
        total += r.pages;
        if total > MAX_GUEST_BYTES / PAGE_BYTES as u64 {
            return Err(MapError::TooBig {
                bytes: total.saturating_mul(PAGE_BYTES as u64),
            });
        }
    }
    Ok(total)
}

/// The source's opening message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Identifies the source guest across attempts; a destination holding this session's
    /// memory from a broken attempt can resume instead of starting over.
    pub session: u64,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// A one-way stream (a file): the reader never answers, and the writer counts a page
    /// delivered once written.
    pub one_way: bool,
    /// The guest's memory map.
    pub regions: Vec<Region>,
    /// Opaque description of the machine, for a destination that builds one to fit (at most
    /// [`MAX_MACHINE`] bytes; empty for a VMM whose destination is configured alike).
    pub machine: Vec<u8>,
    /// Compression of page data.
    pub compression: Compression,
    /// Pages per verification range.
    pub range_pages: u32,
    /// How the switch-over verifies memory.
    pub verify: crate::verify::VerifyMode,
    /// The source's machine ("sim", "kvm").
    pub backend: String,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Source: who and what is coming.
    Hello(Hello),
    /// Destination: ready; `resume` if it holds the session's memory from an earlier attempt.
    Welcome {
        /// The destination kept this session's memory and acknowledged pages.
        resume: bool,
        /// The destination's machine.
        backend: String,
    },
    /// Either side: will not go on, and why.
    Refuse(String),
    /// Source: a batch of pages.
    Pages(Batch),
    /// Destination: batch `seq` is in guest memory.
    Ack {
        /// The batch.
        seq: u64,
    },
    /// Source: round `round` sent `pages` pages.
    RoundEnd {
        /// The round (0: the full copy; the last is the stop-and-copy).
        round: u32,
        /// Pages sent in it.
        pages: u64,
    },
    /// Source: hashes of ranges `first..first + hashes.len()`, computed after the vCPUs
    /// stopped.
    Hashes {
        /// First range index.
        first: u64,
        /// One BLAKE3 hash per range.
        hashes: Vec<[u8; 32]>,
    },
    /// Source: one device-state blob (vCPU registers, device models), after the last round.
    State(StateBlob),
    /// Source: the device state is complete.
    StateEnd {
        /// Blobs sent.
        blobs: u32,
        /// Their bytes in all.
        bytes: u64,
    },
    /// Source: all pages and hashes are sent; compare and answer.
    Verify {
        /// Ranges the hashes cover (the whole test region).
        ranges: u64,
        /// Pages per range.
        range_pages: u32,
    },
    /// Destination: the comparison.
    Verified {
        /// Ranges compared.
        ranges: u64,
        /// Ranges that differ (or were never hashed).
        mismatched: u64,
        /// The first few differing range indexes.
        first: Vec<u64>,
    },
    /// Source: switch over; the guest now runs on the destination.
    Commit,
    /// Destination: the guest ran on the destination.
    Resumed {
        /// Pages its vCPUs touched.
        touched: u64,
        /// For how long, in microseconds.
        micros: u64,
    },
}

/// A batch of pages, validated: every entry's page, encoding and bytes lie inside `data`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Sequence number (per attempt, from 0).
    pub seq: u64,
    /// The round it belongs to.
    pub round: u32,
    /// (page, encoding, byte range in `data`).
    pub entries: Vec<(u64, Encoding, std::ops::Range<usize>)>,
    /// The frame payload.
    pub data: Vec<u8>,
}

impl Batch {
    /// Writes the page of entry `i` into `out` (exactly one page). A `Batch` from the decoder
    /// has every entry's bytes inside `data`; one built otherwise is checked all the same.
    pub fn page_into(&self, i: usize, out: &mut [u8]) -> Result<(), PageError> {
        let entry = PageError::Entry {
            index: i,
            len: self.entries.len(),
        };
        let (page, enc, r) = self.entries.get(i).ok_or(entry.clone())?;
        let bytes = self.data.get(r.clone()).ok_or(entry)?;
        if out.len() != PAGE_BYTES {
            return Err(PageError::Buffer { len: out.len() });
        }
        match enc {
            Encoding::Zero => out.fill(0),
            Encoding::Raw if bytes.len() == PAGE_BYTES => out.copy_from_slice(bytes),
            Encoding::Raw => {
                return Err(PageError::Size {
                    page: *page,
                    len: bytes.len(),
                })
            }
            Encoding::Lz4 => {
                let n = lz4_flex::block::decompress_into(bytes, out).map_err(|e| {
                    PageError::Decompress {
                        page: *page,
                        why: lz4_reason(&e),
                    }
                })?;
                if n != PAGE_BYTES {
                    return Err(PageError::Size {
                        page: *page,
                        len: n,
                    });
                }
            }
        }
        Ok(())
    }
}

/// What was wrong with an LZ4 block, without allocating.
fn lz4_reason(e: &lz4_flex::block::DecompressError) -> &'static str {
    use lz4_flex::block::DecompressError as E;
    match e {
        E::OutputTooSmall { .. } => "it is larger than one page",
        E::LiteralOutOfBounds => "a literal runs past the block",
        E::ExpectedAnotherByte => "the block ends early",
        E::OffsetZero => "a match at offset zero",
        E::OffsetOutOfBounds => "a match before the start of the page",
        _ => "malformed block",
    }
}

const T_HELLO: u8 = 1;
const T_WELCOME: u8 = 2;
const T_REFUSE: u8 = 3;
const T_PAGES: u8 = 4;
const T_ACK: u8 = 5;
const T_ROUND_END: u8 = 6;
const T_HASHES: u8 = 7;
const T_VERIFY: u8 = 8;
const T_VERIFIED: u8 = 9;
const T_COMMIT: u8 = 10;
const T_RESUMED: u8 = 11;
const T_STATE: u8 = 12;
const T_STATE_END: u8 = 13;

impl Msg {
    /// A short name for messages and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello(_) => "hello",
            Msg::Welcome { .. } => "welcome",
            Msg::Refuse(_) => "refuse",
            Msg::Pages(_) => "pages",
            Msg::Ack { .. } => "ack",
            Msg::RoundEnd { .. } => "round end",
            Msg::Hashes { .. } => "hashes",
            Msg::Verify { .. } => "verify",
            Msg::Verified { .. } => "verified",
            Msg::Commit => "commit",
            Msg::Resumed { .. } => "resumed",
            Msg::State(_) => "device state",
            Msg::StateEnd { .. } => "device state end",
        }
    }

    /// Type byte and payload. `Pages` is built by [`BatchBuilder`] instead.
    fn encode(&self, out: &mut Vec<u8>) -> u8 {
        match self {
            Msg::Hello(h) => {
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

    /// Parses a frame whose checksum passed.
    fn decode(ty: u8, payload: Vec<u8>, offset: u64) -> Result<Msg, StreamError> {
        if ty == T_PAGES {
            // The batch keeps the payload: its pages are decoded where they are written.
            return Dec::pages(payload, offset);
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

    /// Adds page `page` with contents `data` (one page).
    pub fn push(&mut self, page: u64, data: &[u8]) {
        debug_assert_eq!(data.len(), PAGE_BYTES);
        put_u64(&mut self.buf, page);
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
fn seal(frame: &mut [u8], ty: u8) {
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

/// Reads frames (and the preamble) from a byte stream, counting bytes for error messages.
pub struct FrameReader<R> {
    r: R,
    offset: u64,
    timeout: Duration,
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
        }
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
        let mut payload = vec![0u8; len as usize];
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            session: 7,
            attempt: 1,
            one_way: false,
            regions: vec![
                Region {
                    gpa: Gpa::ZERO,
                    pages: 256,
                    read_only: false,
                },
                Region {
                    gpa: Gpa::new(1 << 30),
                    pages: 16,
                    read_only: true,
                },
            ],
            machine: vec![1, 2, 3],
            verify: crate::verify::VerifyMode::Sent,
            compression: Compression::Lz4,
            range_pages: 64,
            backend: "sim".into(),
        }
    }

    fn roundtrip(m: &Msg) -> Msg {
        let bytes = frame(m);
        FrameReader::new(&bytes[..], Duration::from_secs(1))
            .read_msg("test")
            .unwrap()
    }

    #[test]
    fn messages_roundtrip() {
        for m in [
            Msg::Hello(hello()),
            Msg::Welcome {
                resume: true,
                backend: "kvm".into(),
            },
            Msg::Refuse("no".into()),
            Msg::Ack { seq: 9 },
            Msg::RoundEnd { round: 2, pages: 5 },
            Msg::Hashes {
                first: 4,
                hashes: vec![[1; 32], [2; 32]],
            },
            Msg::Verify {
                ranges: 8,
                range_pages: 64,
            },
            Msg::Verified {
                ranges: 8,
                mismatched: 1,
                first: vec![3],
            },
            Msg::Commit,
            Msg::Resumed {
                touched: 1,
                micros: 2,
            },
            Msg::State(StateBlob {
                id: "vcpu0".into(),
                version: 3,
                data: vec![9; 100],
            }),
            Msg::StateEnd {
                blobs: 1,
                bytes: 100,
            },
        ] {
            assert_eq!(roundtrip(&m), m);
        }
    }

    #[test]
    fn batches_roundtrip_every_encoding() {
        let mut b = BatchBuilder::new(Compression::Lz4);
        b.start(5, 1);
        let zero = vec![0u8; PAGE_BYTES];
        let mut sparse = vec![0u8; PAGE_BYTES];
        sparse[0] = 42;
        let noise: Vec<u8> = (0..PAGE_BYTES as u64)
            .map(|i| crate::guest::splitmix(i) as u8)
            .collect();
        b.push(1, &zero);
        b.push(2, &sparse);
        b.push(3, &noise);
        let bytes = b.frame().to_vec();
        let Msg::Pages(batch) = FrameReader::new(&bytes[..], Duration::from_secs(1))
            .read_msg("test")
            .unwrap()
        else {
            panic!("not pages")
        };
        assert_eq!((batch.seq, batch.round), (5, 1));
        let encs: Vec<Encoding> = batch.entries.iter().map(|e| e.1).collect();
        assert_eq!(encs, [Encoding::Zero, Encoding::Lz4, Encoding::Raw]);
        let mut out = vec![1u8; PAGE_BYTES];
        for (i, want) in [&zero, &sparse, &noise].into_iter().enumerate() {
            batch.page_into(i, &mut out).unwrap();
            assert_eq!(&out, want);
        }
    }

    #[test]
    fn every_flipped_bit_and_every_truncation_is_an_error() {
        let bytes = frame(&Msg::Hello(hello()));
        for i in 0..bytes.len() {
            for bit in [0, 3, 7] {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(FrameReader::new(&b[..], Duration::from_secs(1))
                    .read_msg("test")
                    .is_err());
            }
            let r = FrameReader::new(&bytes[..i], Duration::from_secs(1)).read_msg("test");
            match r {
                Err(StreamError::Truncated { .. }) => assert!(i > 0),
                Err(StreamError::Closed { .. }) => assert_eq!(i, 0),
                other => panic!("{i}: {other:?}"),
            }
        }
    }

    #[test]
    fn preamble_checks_magic_version_and_page_size() {
        let ok = preamble(VERSION);
        assert!(FrameReader::new(&ok[..], Duration::ZERO)
            .read_preamble()
            .is_ok());
        let v = preamble(VERSION + 1);
        assert!(matches!(
            FrameReader::new(&v[..], Duration::ZERO).read_preamble(),
            Err(StreamError::Version { found: 3, .. })
        ));
        let mut m = ok;
        m[0] = b'X';
        assert!(matches!(
            FrameReader::new(&m[..], Duration::ZERO).read_preamble(),
            Err(StreamError::BadMagic { .. })
        ));
        let mut p = ok;
        p[13] = 0x20;
        assert!(matches!(
            FrameReader::new(&p[..], Duration::ZERO).read_preamble(),
            Err(StreamError::PageSize { .. })
        ));
        assert!(matches!(
            FrameReader::new(&ok[..5], Duration::ZERO).read_preamble(),
            Err(StreamError::Truncated { .. })
        ));
    }

    #[test]
    fn memory_maps_are_checked() {
        let r = |gpa, pages, read_only| Region {
            gpa: Gpa::new(gpa),
            pages,
            read_only,
        };
        assert_eq!(
            check_regions(&[r(0, 16, false), r(1 << 20, 4, true)]),
            Ok(20)
        );
        assert!(matches!(check_regions(&[]), Err(MapError::Count(0))));
        assert!(matches!(
            check_regions(&[r(0, 0, false)]),
            Err(MapError::Empty { .. })
        ));
        assert!(matches!(
            check_regions(&[r(5, 1, false)]),
            Err(MapError::Unaligned { .. })
        ));
        assert!(matches!(
            check_regions(&[r(0, 16, false), r(4096, 1, false)]),
            Err(MapError::Overlap { .. })
        ));
        assert!(matches!(
            check_regions(&[r(!4095, u64::MAX, false)]),
            Err(MapError::Beyond { .. })
        ));
        assert!(matches!(
            check_regions(&[r(0, 1 << 40, false)]),
            Err(MapError::Beyond { .. }) | Err(MapError::TooBig { .. })
        ));
    }

    #[test]
    fn garbage_never_panics() {
        // A deterministic sweep of junk frames with valid checksums: decode must only error.
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ty = (x % 15) as u8;
            let len = ((x >> 8) % 64) as usize;
            let mut f = vec![0u8; HEADER_LEN];
            for i in 0..len {
                f.push((x >> (i % 56)) as u8);
            }
            seal(&mut f, ty);
            let _ = FrameReader::new(&f[..], Duration::ZERO).read_msg("test");
        }
    }
}
