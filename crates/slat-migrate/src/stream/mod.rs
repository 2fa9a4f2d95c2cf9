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
//! exactly one page), a delta page the runs that changed since the copy the destination holds
//! ([`delta`]; only when the destination's welcome accepted the source's offer). Every decode is bounds-checked and returns a
//! [`StreamError`](crate::StreamError); nothing in here panics on bad input. Counts are
//! bounded before anything is allocated for them
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

mod decode;
pub mod delta;
mod encode;
mod postcopy;
mod reader;
#[cfg(test)]
mod tests;

use crate::error::{MapError, PageError};
use crate::state::StateBlob;
use delta::DeltaError;
use slat_addr::Gpa;

pub use crate::source::cache::DeltaCache;
pub use encode::{frame, preamble, write_msg, BatchBuilder, DELTA_MAX};
pub use postcopy::{PostcopyMsg, MAX_REQUEST, MAX_RUNS};
pub use reader::FrameReader;

/// The first eight bytes of every stream.
pub const MAGIC: [u8; 8] = *b"SLATMIGR";
/// The protocol version this build speaks. 3: range hashes are XXH3-based (2 used BLAKE3;
/// a version-2 peer would fail verification, so it is refused at the preamble instead).
/// 4: the hello offers delta pages and the welcome answers (a version-3 peer would misread
/// both messages).
pub const VERSION: u32 = 4;
/// `slat_addr::PAGE_SIZE` (the page the stream carries) as a `usize`, for buffer lengths.
pub(crate) const PAGE_BYTES: usize = slat_addr::PAGE_SIZE as usize;
/// Largest frame payload (a batch of [`MAX_BATCH_PAGES`] raw pages fits with room to spare).
pub const MAX_FRAME: u32 = 4 << 20;
/// Most page streams of one migration beside its control connection ([`Msg::Streams`]).
pub const MAX_STREAMS: u32 = 16;
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
    /// The runs that differ from the copy of the page the destination holds ([`delta`]).
    Delta = 3,
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
    /// The source offers to send pages as deltas against the copy the destination holds
    /// (used only if the welcome accepts).
    pub delta: bool,
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
        /// The destination accepts the delta pages the hello offered.
        delta: bool,
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
        /// One 256-bit hash per range ([`crate::verify::hash_range`] or `hash_digests`).
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
    /// Source, on the control connection right after the welcome: `count` page streams
    /// follow, each a connection of its own opening with [`Msg::StreamHello`]; the pages go
    /// over them and only the control frames over this one.
    Streams {
        /// Page streams (2 to [`MAX_STREAMS`]).
        count: u32,
    },
    /// Source, first frame of a page stream: whose it is.
    StreamHello {
        /// The session of the control connection's hello.
        session: u64,
        /// Its attempt.
        attempt: u32,
        /// This stream's index (below the count announced).
        index: u32,
    },
    /// Destination: the guest ran on the destination.
    Resumed {
        /// Pages its vCPUs touched.
        touched: u64,
        /// For how long, in microseconds.
        micros: u64,
    },
    /// Post-copy's frames (either side).
    Postcopy(PostcopyMsg),
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
    /// The bytes of entry `i` when they are the page itself (a raw page of exactly one page),
    /// so the destination writes them to guest memory without a staging copy.
    pub fn raw_page(&self, i: usize) -> Option<&[u8]> {
        match self.entries.get(i)? {
            (_, Encoding::Raw, r) if r.len() == PAGE_BYTES => self.data.get(r.clone()),
            _ => None,
        }
    }

    /// Writes the page of entry `i` into `out` (exactly one page). A `Batch` from the decoder
    /// has every entry's bytes inside `data`; one built otherwise is checked all the same.
    /// A delta entry is an error here ([`DeltaError::NoBase`]): it needs the page's previous
    /// copy ([`Batch::patch_into`]).
    pub fn page_into(&self, i: usize, out: &mut [u8]) -> Result<(), PageError> {
        self.decode_into(i, out, false)
    }

    /// [`Batch::page_into`], where `out` holds the page as the destination has it, which a
    /// delta entry patches.
    pub fn patch_into(&self, i: usize, out: &mut [u8]) -> Result<(), PageError> {
        self.decode_into(i, out, true)
    }

    fn decode_into(&self, i: usize, out: &mut [u8], based: bool) -> Result<(), PageError> {
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
            Encoding::Delta => {
                let err = if based {
                    delta::apply(bytes, out).err()
                } else {
                    Some(DeltaError::NoBase)
                };
                if let Some(err) = err {
                    return Err(PageError::Delta { page: *page, err });
                }
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
const T_STREAMS: u8 = 20;
const T_STREAM_HELLO: u8 = 21;

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
            Msg::Streams { .. } => "streams",
            Msg::StreamHello { .. } => "stream hello",
            Msg::Postcopy(m) => m.name(),
        }
    }
}
