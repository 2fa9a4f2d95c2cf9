//! The wire format from a hostile peer's side: frames sealed with valid checksums around any
//! payload, payloads written field by field with any values, valid streams produced by the
//! library's own encoder (to mutate), and a loopback exchange with a live destination.
//!
//! Written from the format's description in `stream/mod.rs`, not from its code: a frame is
//! `type u8 | length u32 | payload crc32 u32 | header crc32 u32 | payload`, little-endian.

use slat_harness::migrate::Shape;
use slat_migrate::stream::{self, BatchBuilder, Compression, DeltaCache, Hello, Msg, Region};
use slat_migrate::verify::{self, RANGE_PAGES};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

/// Frame type bytes.
pub mod ty {
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const REFUSE: u8 = 3;
    pub const PAGES: u8 = 4;
    pub const ACK: u8 = 5;
    pub const ROUND_END: u8 = 6;
    pub const HASHES: u8 = 7;
    pub const VERIFY: u8 = 8;
    pub const VERIFIED: u8 = 9;
    pub const COMMIT: u8 = 10;
    pub const RESUMED: u8 = 11;
    pub const STATE: u8 = 12;
    pub const STATE_END: u8 = 13;
    pub const STREAMS: u8 = 20;
    pub const STREAM_HELLO: u8 = 21;
    /// Post-copy's frames: discard, run, request, end, recover, lacking, lacking end,
    /// preempt.
    pub const POSTCOPY_FIRST: u8 = 32;
    pub const POSTCOPY_LAST: u8 = 39;
}

/// Bytes of a frame header.
pub const HEADER: usize = 13;

/// A frame of type `t` around `payload`, with correct checksums (the length is the payload's).
pub fn seal(t: u8, payload: &[u8]) -> Vec<u8> {
    seal_len(t, payload, payload.len() as u32)
}

/// A frame whose header claims `len` bytes, checksummed as if honest.
pub fn seal_len(t: u8, payload: &[u8], len: u32) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.push(t);
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    let h = crc32fast::hash(&f[..9]);
    f.extend_from_slice(&h.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// Re-seals a frame whose payload was changed: type and payload kept, checksums and length
/// recomputed (a frame too short for a header is returned as it is).
pub fn reseal(frame: &[u8]) -> Vec<u8> {
    if frame.len() < HEADER {
        return frame.to_vec();
    }
    seal(frame[0], &frame[HEADER..])
}

/// A payload written field by field.
#[derive(Debug, Clone, Default)]
pub struct Payload(pub Vec<u8>);

impl Payload {
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    /// Text as the stream carries it: a u16 length and the bytes.
    pub fn text(self, s: &[u8]) -> Self {
        self.u16(s.len() as u16).bytes(s)
    }
    pub fn frame(&self, t: u8) -> Vec<u8> {
        seal(t, &self.0)
    }
}

/// A hello payload with every field given.
#[allow(clippy::too_many_arguments)]
pub fn hello_payload(
    session: u64,
    attempt: u32,
    one_way: bool,
    regions: &[Region],
    machine: &[u8],
    compression: u8,
    range_pages: u32,
    verify: u8,
    backend: &[u8],
) -> Payload {
    let mut p = Payload::default()
        .u64(session)
        .u32(attempt)
        .u8(one_way as u8)
        .u32(regions.len() as u32);
    for r in regions {
        p = p.u64(r.gpa.raw()).u64(r.pages).u8(r.read_only as u8);
    }
    p.u32(machine.len() as u32)
        .bytes(machine)
        .u8(compression)
        // Offers delta pages.
        .u8(1)
        .u32(range_pages)
        .u8(verify)
        .text(backend)
}

/// The regions of a benchmark guest of `shape` (one per memslot from gpa 0), computed here
/// rather than with the library's helper.
pub fn shape_regions(shape: &Shape) -> Vec<Region> {
    let pages = shape.bytes_per_vcpu * shape.vcpus as u64 / 4096;
    let pps = pages / shape.slots as u64;
    (0..shape.slots as u64)
        .map(|s| Region {
            gpa: slat_addr::Gpa::new(s * pps * 4096),
            pages: pps,
            read_only: false,
        })
        .collect()
}

/// The hello an honest source of `shape` sends (verifying memory in full: the stream's
/// hashes are of the image).
pub fn honest_hello(session: u64, shape: Shape, compression: Compression) -> Hello {
    Hello {
        session,
        attempt: 1,
        one_way: false,
        regions: shape_regions(&shape),
        machine: shape.encode(),
        compression,
        delta: true,
        range_pages: RANGE_PAGES,
        verify: slat_migrate::verify::VerifyMode::Full,
        backend: "sim".into(),
    }
}

/// Pieces of a valid stream made by the library's encoder, frame by frame.
#[derive(Debug, Clone)]
pub struct ValidStream {
    /// The preamble.
    pub preamble: Vec<u8>,
    /// Every frame, in order (hello first, commit last).
    pub frames: Vec<Vec<u8>>,
    /// The guest memory the stream leaves on the destination.
    pub image: Vec<u8>,
}

impl ValidStream {
    /// The stream as one byte string.
    pub fn bytes(&self) -> Vec<u8> {
        let mut v = self.preamble.clone();
        for f in &self.frames {
            v.extend_from_slice(f);
        }
        v
    }
}

/// A valid stream for a guest of `shape` whose memory becomes `image`: round 0 sends every
/// page, then `resend` rounds send the pages `pick` chooses again (in batches of `batch`
/// pages), then the hashes, the verification request and the commit.
pub fn valid_stream(
    shape: Shape,
    image: &[u8],
    compression: Compression,
    batch: usize,
    resend: &[Vec<u64>],
) -> ValidStream {
    let pages = image.len() as u64 / 4096;
    let mut frames = vec![stream::frame(&Msg::Hello(honest_hello(
        0x5eed,
        shape,
        compression,
    )))];
    let mut b = BatchBuilder::new(compression);
    // Half the guest's pages: a page sent again goes as a delta unless another took its slot.
    let mut cache = DeltaCache::new(pages.div_ceil(2) * 4096, pages);
    let mut seq = 0u64;
    let all: Vec<u64> = (0..pages).collect();
    let mut rounds: Vec<&[u64]> = vec![&all];
    rounds.extend(resend.iter().map(|r| &r[..]));
    let resent: std::collections::HashSet<u64> = resend.iter().flatten().copied().collect();
    for (round, list) in rounds.iter().enumerate() {
        for chunk in list.chunks(batch.max(1)) {
            b.start(seq, round as u32);
            for &p in chunk {
                let at = (p * 4096) as usize;
                let mut page = image[at..at + 4096].to_vec();
                if round == 0 && resent.contains(&p) {
                    // Changed in several places before it is sent again.
                    for o in [p as usize * 37 % 4096, 1000, 1001, 2050, 4095] {
                        page[o] ^= 0xa5;
                    }
                }
                let fill = |out: &mut [u8]| {
                    out.copy_from_slice(&page);
                    Ok::<bool, ()>(page.iter().all(|&x| x == 0))
                };
                let _ = b.push_cached(slat_addr::PageIndex::new(p), fill, |_, _| {}, &mut cache);
            }
            frames.push(b.frame().to_vec());
            seq += 1;
        }
        frames.push(stream::frame(&Msg::RoundEnd {
            round: round as u32,
            pages: list.len() as u64,
        }));
    }
    frames.push(stream::frame(&Msg::StateEnd { blobs: 0, bytes: 0 }));
    let nranges = verify::ranges(pages, RANGE_PAGES);
    let hashes: Vec<[u8; 32]> = (0..nranges)
        .map(|i| {
            let (a, e) = verify::range_pages(i, RANGE_PAGES, pages);
            verify::hash_range(i, &image[(a * 4096) as usize..(e * 4096) as usize])
        })
        .collect();
    for (k, chunk) in hashes.chunks(100).enumerate() {
        frames.push(stream::frame(&Msg::Hashes {
            first: k as u64 * 100,
            hashes: chunk.to_vec(),
        }));
    }
    frames.push(stream::frame(&Msg::Verify {
        ranges: nranges,
        range_pages: RANGE_PAGES,
    }));
    frames.push(stream::frame(&Msg::Commit));
    ValidStream {
        preamble: stream::preamble(stream::VERSION).to_vec(),
        frames,
        image: image.to_vec(),
    }
}

/// Sends `bytes` to `addr` from a thread of its own (then closes the sending side) and reads
/// the replies until the destination closes; returns the raw replies and whether they ended
/// cleanly. They may not: a destination that stops reading with bytes of ours unread (after a
/// commit, or an error) closes with a reset, and the kernel then drops replies not yet read.
pub fn exchange_all(addr: &str, bytes: Vec<u8>, timeout: Duration) -> (Vec<u8>, bool) {
    let s = TcpStream::connect(addr).expect("connect to the destination");
    s.set_read_timeout(Some(timeout)).expect("read timeout");
    s.set_write_timeout(Some(timeout)).expect("write timeout");
    let mut w = s.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        // The destination may stop reading and close early: a failed write is expected.
        let _ = w.write_all(&bytes);
        let _ = w.shutdown(Shutdown::Write);
    });
    let mut out = Vec::new();
    let mut r = &s;
    let clean = r.read_to_end(&mut out).is_ok();
    let _ = s.shutdown(Shutdown::Both);
    let _ = writer.join();
    (out, clean)
}

/// [`exchange_all`] without the flag.
pub fn exchange(addr: &str, bytes: Vec<u8>, timeout: Duration) -> Vec<u8> {
    exchange_all(addr, bytes, timeout).0
}

/// The destination's replies, decoded until the first error or the end.
pub fn replies(raw: &[u8]) -> Vec<Msg> {
    let mut r = stream::FrameReader::new(raw, Duration::from_secs(1));
    let mut v = Vec::new();
    while let Ok(m) = r.read_msg("replies") {
        v.push(m);
    }
    v
}

/// Pseudo-random page contents: `fill` percent of the pages hold noise, the rest zeros.
pub fn image(pages: u64, fill: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; (pages * 4096) as usize];
    for p in 0..pages {
        let mut x = slat_migrate::splitmix(seed ^ p);
        if x % 100 < fill {
            for c in v[(p * 4096) as usize..((p + 1) * 4096) as usize].chunks_exact_mut(8) {
                x = slat_migrate::splitmix(x);
                // Some runs of equal bytes, so LZ4 has something to find.
                c.copy_from_slice(&(if x % 3 == 0 { 0 } else { x }).to_le_bytes());
            }
        }
    }
    v
}

/// Splits a recorded stream into its preamble and frames by their headers' lengths (a tail
/// too short for its header's length is the last "frame").
pub fn split(bytes: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let pre = bytes.len().min(16);
    let mut frames = Vec::new();
    let mut at = pre;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let n = if rest.len() >= HEADER {
            let len = u32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            (HEADER + len).min(rest.len())
        } else {
            rest.len()
        };
        frames.push(rest[..n].to_vec());
        at += n;
    }
    (bytes[..pre].to_vec(), frames)
}
