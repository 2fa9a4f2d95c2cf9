//! What can go wrong, as one readable line each.

pub use crate::page_error::PageError;
use crate::stream::{
    Region, DELTA_MAX, GPA_BITS, MAX_BATCH_PAGES, MAX_GUEST_BYTES, MAX_HASHES, MAX_MACHINE,
    MAX_REGIONS, MAX_STATE_BLOB, MAX_STATE_BLOBS, MAX_STATE_BYTES, MAX_STATE_ID, MAX_STREAMS,
    PAGE_BYTES,
};
use slat_addr::{Gpa, Hva};
use std::sync::Arc;
use std::time::Duration;

/// Why a stream could not be read: every way a peer's bytes can be wrong or missing. The
/// decoder turns each into one of these and never panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The first bytes are not a slat migration stream.
    #[error("not a slat migration stream (bad magic {found:02x?})")]
    BadMagic {
        /// What arrived instead.
        found: [u8; 8],
    },
    /// A stream of another protocol version.
    #[error("stream version {found} is not supported (this side speaks version {supported})")]
    Version {
        /// The peer's version.
        found: u32,
        /// Ours.
        supported: u32,
    },
    /// A page size this side does not use.
    #[error("stream page size {found} does not match this side's {expected}")]
    PageSize {
        /// The peer's page size.
        found: u32,
        /// Ours.
        expected: u32,
    },
    /// The connection ended in the middle of a frame (or of the preamble).
    #[error(
        "stream truncated: the connection closed in the middle of {what} after {offset} bytes"
    )]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes of the stream read so far.
        offset: u64,
    },
    /// The connection ended cleanly between frames, before the protocol was done.
    #[error("the connection closed before {what}")]
    Closed {
        /// What was still expected.
        what: &'static str,
    },
    /// A frame failed its checksum, or its contents do not parse.
    #[error("stream corrupted at byte {offset}: {why}")]
    Corrupt {
        /// Stream offset of the frame.
        offset: u64,
        /// What is wrong.
        why: Corruption,
    },
    /// A well-formed frame that the protocol does not allow here.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// A page entry of a batch that cannot go into guest memory.
    #[error("stream corrupted at byte {offset}: {err}")]
    Page {
        /// Stream offset of the frame (or of the reader when the batch was applied).
        offset: u64,
        /// What is wrong with the page.
        err: PageError,
    },
    /// The peer sent nothing for too long, or took longer than that to complete a frame's
    /// header or payload (a trickling peer).
    #[error("the peer sent nothing, or did not complete a frame, within {0:?}")]
    Timeout(Duration),
    /// A socket error.
    #[error("connection error: {0}")]
    Io(Cause),
}

impl StreamError {
    /// Maps a socket error, telling timeouts apart.
    pub(crate) fn io(e: std::io::Error, timeout: Duration) -> StreamError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                StreamError::Timeout(timeout)
            }
            _ => StreamError::Io(Cause::new(e)),
        }
    }
}

/// What is wrong with a frame that failed its checksum or does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    /// The header's own checksum failed.
    #[error("checksum mismatch in a frame header")]
    HeaderChecksum,
    /// A frame longer than any the protocol sends.
    #[error("frame length {len} exceeds the limit of {max}")]
    FrameTooLong {
        /// The announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The payload's checksum failed.
    #[error("checksum mismatch in a frame of type {ty} and {len} bytes")]
    PayloadChecksum {
        /// The frame type.
        ty: u8,
        /// Its length.
        len: u32,
    },
    /// A frame type this side does not know.
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    /// A hello listing more regions than a guest may have.
    #[error("hello lists {0} memory regions (at most {MAX_REGIONS})")]
    TooManyRegions(usize),
    /// A machine description longer than a hello carries.
    #[error("a machine description of {0} bytes (at most {MAX_MACHINE})")]
    MachineLen(usize),
    /// A device-state id that is empty or too long.
    #[error("a device-state id of {0} bytes (1 to {MAX_STATE_ID})")]
    StateId(usize),
    /// A device-state blob larger than a frame carries.
    #[error("a device-state blob of {0} bytes (at most {MAX_STATE_BLOB})")]
    StateTooBig(u32),
    /// A verification mode this side does not know.
    #[error("unknown verification mode {0}")]
    UnknownVerify(u8),
    /// A compression this side does not know.
    #[error("unknown compression {0}")]
    UnknownCompression(u8),
    /// A batch of more pages than a batch may carry.
    #[error("a batch of {0} pages (at most {MAX_BATCH_PAGES})")]
    BatchTooBig(u32),
    /// A compressed page of a length no page compresses to.
    #[error("compressed page of {0} bytes")]
    CompressedLen(usize),
    /// A delta page of a length no delta the source sends has.
    #[error("delta page of {0} bytes (1 to {DELTA_MAX})")]
    DeltaLen(usize),
    /// A page encoding this side does not know.
    #[error("unknown page encoding {0}")]
    UnknownEncoding(u8),
    /// More hashes in one frame than a frame may carry.
    #[error("{0} hashes in one frame (at most {MAX_HASHES})")]
    TooManyHashes(u32),
    /// More examples of differing ranges than the protocol sends.
    #[error("{0} mismatch examples")]
    TooManyExamples(u32),
    /// A field past the end of the payload.
    #[error("frame payload ends early ({len} bytes, needed {need} more at {at})")]
    EndsEarly {
        /// Payload bytes.
        len: usize,
        /// Bytes the field needs.
        need: usize,
        /// Where it starts.
        at: usize,
    },
    /// A count of entries that the rest of the payload cannot hold.
    #[error("{count} entries of {size} bytes announced, {left} bytes left in the frame")]
    Entries {
        /// Entries announced.
        count: usize,
        /// Least bytes per entry.
        size: usize,
        /// Bytes left.
        left: usize,
    },
    /// More post-copy runs or requested pages in one frame than a frame may carry.
    #[error("{0} runs or pages in one post-copy frame")]
    TooManyRuns(u32),
    /// A boolean that is neither 0 nor 1.
    #[error("flag byte {0}")]
    Flag(u8),
    /// A text longer than the protocol sends.
    #[error("text of {0} bytes")]
    TextLen(usize),
    /// A text that is not UTF-8.
    #[error("text is not UTF-8")]
    NotUtf8,
    /// Bytes after the message's last field.
    #[error("{0} unexpected bytes after the message")]
    Trailing(usize),
}

/// A well-formed frame the protocol does not allow where it arrived, or whose numbers do not
/// add up with what came before. Every field of the peer's frames that counts, orders or
/// indexes something is checked against this side's state; a mismatch is one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Anything but a hello opened the stream.
    #[error("a {msg} message before the hello")]
    BeforeHello {
        /// The message's name.
        msg: &'static str,
    },
    /// A message this side never expects from the peer, or not at this point.
    #[error("unexpected {msg} message")]
    Unexpected {
        /// The message's name.
        msg: &'static str,
    },
    /// A message that belongs before the hashes arrived after them.
    #[error("a {msg} message after the verification hashes")]
    AfterHashes {
        /// The message's name.
        msg: &'static str,
    },
    /// A batch out of sequence.
    #[error("batch {got} where {want} was due")]
    BatchOrder {
        /// The batch's sequence number.
        got: u64,
        /// The one due.
        want: u64,
    },
    /// A batch labelled with another round than the one in progress.
    #[error("batch {seq} belongs to round {got}, but round {want} is in progress")]
    BatchRound {
        /// The batch.
        seq: u64,
        /// Its round.
        got: u32,
        /// The round in progress.
        want: u32,
    },
    /// The end of a round out of sequence.
    #[error("the end of round {got} where round {want} was in progress")]
    RoundOrder {
        /// The round that ended.
        got: u32,
        /// The round in progress.
        want: u32,
    },
    /// A round's end announced another page count than its batches carried.
    #[error("round {round} announced {announced} pages, but its batches carried {received}")]
    RoundPages {
        /// The round.
        round: u32,
        /// What its end said.
        announced: u64,
        /// What arrived.
        received: u64,
    },
    /// More rounds or batches than a counter holds.
    #[error("the {what} counter overflows")]
    Overflow {
        /// Which counter.
        what: &'static str,
    },
    /// Hashes arrived while a round was still open.
    #[error("hashes in the middle of round {round}")]
    HashesMidRound {
        /// The open round.
        round: u32,
    },
    /// Hashes for ranges outside the guest.
    #[error("hashes for {count} ranges from {first}, beyond the guest's {ranges} ranges")]
    HashRange {
        /// First range.
        first: u64,
        /// Hashes in the frame.
        count: u64,
        /// Ranges the guest has.
        ranges: u64,
    },
    /// A range hashed twice.
    #[error("range {range} was hashed twice")]
    HashTwice {
        /// The range.
        range: u64,
    },
    /// A verification request for another layout of ranges than this guest's.
    #[error(
        "verification of {ranges} ranges of {range_pages} pages; this guest has {want_ranges} of {want_range_pages}"
    )]
    VerifyLayout {
        /// Ranges asked for.
        ranges: u64,
        /// Pages per range asked for.
        range_pages: u32,
        /// Ranges here.
        want_ranges: u64,
        /// Pages per range here.
        want_range_pages: u32,
    },
    /// A commit before verification passed.
    #[error("a commit before a successful verification")]
    EarlyCommit,
    /// Two device-state blobs with one id.
    #[error("device state `{id}` arrived twice")]
    StateTwice {
        /// The id.
        id: String,
    },
    /// More device state than a guest may have.
    #[error("more than {MAX_STATE_BLOBS} device-state blobs or {MAX_STATE_BYTES} bytes")]
    StateTooMuch,
    /// The end of the device state counted other blobs than arrived.
    #[error("the device state ended announcing {blobs} blobs of {bytes} bytes; {got_blobs} of {got_bytes} arrived")]
    StateCount {
        /// Blobs announced.
        blobs: u32,
        /// Bytes announced.
        bytes: u64,
        /// Blobs received.
        got_blobs: u32,
        /// Bytes received.
        got_bytes: u64,
    },
    /// Device state while a round was still open.
    #[error("device state in the middle of round {round}")]
    StateMidRound {
        /// The open round.
        round: u32,
    },
    /// Verification began without the device state.
    #[error("verification hashes before the device state ended")]
    NoState,
    /// An acknowledgement of a batch that is not the oldest in flight.
    #[error("acknowledgement of batch {seq}, which is not the oldest in flight")]
    AckOrder {
        /// The batch acknowledged.
        seq: u64,
    },
    /// Page streams asked for in a number this side does not take, or after pages began.
    #[error("{count} page streams asked for (this side takes 1 to {max}, before the first page)")]
    StreamCount {
        /// Streams asked for.
        count: u32,
        /// Most this side takes.
        max: u32,
    },
    /// A page stream's header that does not belong to this migration.
    #[error("page stream header for session {session:#x} attempt {attempt} stream {index}; expected session {want_session:#x} attempt {want_attempt}, streams 0 to {count} once each")]
    StreamHeader {
        /// The session it names.
        session: u64,
        /// The attempt it names.
        attempt: u32,
        /// Its index.
        index: u32,
        /// This migration's session.
        want_session: u64,
        /// This migration's attempt.
        want_attempt: u32,
        /// Streams announced (indexes below it).
        count: u32,
    },
    /// A page batch of a round that is neither the round in progress nor the next.
    #[error("page stream batch of round {got} while round {want} is in progress")]
    StreamRound {
        /// The batch's round.
        got: u32,
        /// The round in progress.
        want: u32,
    },
    /// Page streams were asked for, but this destination was given no way to accept them.
    #[error("page streams asked for, but this destination serves one connection")]
    NoStreams,
}

/// Why a memory map cannot be used: the checks every map passes before memory is built for
/// it or a page is addressed with it ([`crate::stream::check_regions`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// No region, or more than a guest may have.
    #[error("{0} memory regions (a guest has 1 to {MAX_REGIONS})")]
    Count(usize),
    /// A region without pages.
    #[error("region {index} has no pages")]
    Empty {
        /// The region.
        index: usize,
    },
    /// A region that does not start on a page boundary.
    #[error("region {index} starts at {gpa:#x}, not on a page boundary")]
    Unaligned {
        /// The region.
        index: usize,
        /// Its address.
        gpa: Gpa,
    },
    /// A region reaching past the guest-physical address space.
    #[error("region {index} ({pages} pages at {gpa:#x}) reaches past the {GPA_BITS}-bit guest-physical space")]
    Beyond {
        /// The region.
        index: usize,
        /// Its address.
        gpa: Gpa,
        /// Its pages.
        pages: u64,
    },
    /// A region below or overlapping the one before it.
    #[error("region {index} at {gpa:#x} overlaps or precedes the region before it")]
    Overlap {
        /// The region.
        index: usize,
        /// Its address.
        gpa: Gpa,
    },
    /// More memory than a guest may have.
    #[error("{bytes} bytes of guest memory (at most {MAX_GUEST_BYTES})")]
    TooBig {
        /// Bytes (at least).
        bytes: u64,
    },
    /// A region whose host address is not 8-byte aligned or whose host range overflows.
    #[error("region {index} has an unusable host address {host:#x}")]
    Host {
        /// The region.
        index: usize,
        /// Its host address.
        host: Hva,
    },
    /// A dirty log whose slots are not the map's writable regions.
    #[error("the dirty log has {slots} slots of {slot_pages:?} pages; the writable regions are {regions:?} pages")]
    LogSlots {
        /// Slots of the log.
        slots: usize,
        /// Their pages.
        slot_pages: Vec<u64>,
        /// Pages of the writable regions.
        regions: Vec<u64>,
    },
}

/// Why device state cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// More blobs than the stream carries.
    #[error("{0} device-state blobs (at most {MAX_STATE_BLOBS})")]
    TooMany(usize),
    /// An id that is empty or too long.
    #[error("a device-state id of {0} bytes (1 to {MAX_STATE_ID})")]
    Id(usize),
    /// A blob larger than a frame carries.
    #[error("device state `{id}` has {len} bytes (at most {MAX_STATE_BLOB})")]
    TooBig {
        /// The blob.
        id: String,
        /// Its size.
        len: usize,
    },
    /// Two blobs with one id.
    #[error("two device-state blobs are called `{0}`")]
    Duplicate(String),
    /// More bytes than the stream carries.
    #[error("{0} bytes of device state (at most {MAX_STATE_BYTES})")]
    Total(u64),
}

/// A memory map, readable on one line.
pub fn describe_map(regions: &[Region]) -> String {
    let v: Vec<String> = regions
        .iter()
        .take(8)
        .map(|r| {
            format!(
                "{:#x}+{}p{}",
                r.gpa,
                r.pages,
                if r.read_only { " ro" } else { "" }
            )
        })
        .collect();
    let more = regions.len().saturating_sub(8);
    if more > 0 {
        format!("[{} and {more} more]", v.join(", "))
    } else {
        format!("[{}]", v.join(", "))
    }
}

/// Why a destination will not take the guest a source announced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The memory map is not one memory can be built for.
    #[error("unusable memory map: {0}")]
    Map(#[from] MapError),
    /// Verification ranges of another size.
    #[error("verification ranges of {got} pages (this side uses {want})")]
    RangePages {
        /// The source's.
        got: u32,
        /// Ours.
        want: u32,
    },
    /// More memory than this destination takes.
    #[error("a guest of {bytes} bytes exceeds this destination's limit of {limit} bytes ({why})")]
    TooBig {
        /// The guest's memory.
        bytes: u64,
        /// The limit.
        limit: u64,
        /// Where the limit comes from.
        why: &'static str,
    },
    /// This destination's guest (given, or built by the factory) has another memory map.
    #[error(
        "the source's memory map {} does not match this destination's {}",
        describe_map(theirs),
        describe_map(ours)
    )]
    Mismatch {
        /// The source's map.
        theirs: Vec<Region>,
        /// This side's.
        ours: Vec<Region>,
    },
    /// The machine description is not one this destination's factory reads.
    #[error("unusable machine description: {0}")]
    Machine(String),
    /// The machine could not be built.
    #[error("cannot build a machine: {0}")]
    Build(GuestError),
    /// Nothing to receive into.
    #[error("no machine to receive into")]
    NoMachine,
    /// A migration already completed here.
    #[error("this destination already holds a migrated guest")]
    AlreadyMigrated,
    /// A two-way stream to a one-way reader, or the reverse.
    #[error("a {} stream where a {} one was expected", if *got { "one-way" } else { "two-way" }, if *got { "two-way" } else { "one-way" })]
    OneWay {
        /// The stream's flag.
        got: bool,
    },
}

/// Guest memory addressed outside the test region, with the wrong buffer, or while vCPUs run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// Whole-range access while the vCPUs ran.
    #[error("guest memory was {0} while the vCPUs ran")]
    Running(&'static str),
    /// Pages outside the region.
    #[error("pages {first}..{end} are outside the guest's {pages} pages")]
    OutOfRange {
        /// First page.
        first: u64,
        /// End page (exclusive).
        end: u64,
        /// Pages in the region.
        pages: u64,
    },
    /// A buffer that is not one page.
    #[error("a page buffer of {len} bytes (a page is {PAGE_BYTES})")]
    Buffer {
        /// Its length.
        len: usize,
    },
    /// A buffer for a range of pages that is not the range's size.
    #[error("a buffer of {len} bytes for a range of {want} bytes")]
    RangeBuffer {
        /// Its length.
        len: usize,
        /// The range's size.
        want: u64,
    },
}

/// An error of another crate (the machine, the OS) kept with its source chain, shareable and
/// comparable by what it says: machine errors are neither `Clone` nor `PartialEq`, and the
/// errors here are both.
#[derive(Debug, Clone)]
pub struct Cause(pub Arc<dyn std::error::Error + Send + Sync>);

impl Cause {
    /// Wraps `e`.
    pub fn new<E: std::error::Error + Send + Sync + 'static>(e: E) -> Cause {
        Cause(Arc::new(e))
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Cause) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Cause {}

/// Why the guest machine refused an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuestError {
    /// The VMM's machine (its KVM VM, its devices, or any other part behind [`crate::Guest`])
    /// failed.
    #[error(transparent)]
    Machine(Cause),
    /// Guest memory was addressed wrongly.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The dirty-log harvester refused the machine's log or a request (a page outside the
    /// test region's memslots).
    #[error("dirty-log harvester: {0}")]
    Harvest(Cause),
    /// The guest's memory map is unusable.
    #[error("memory map: {0}")]
    Map(#[from] MapError),
    /// The guest cannot restore a piece of device state (an unknown id or version).
    #[error("device state `{id}` version {version}: {why}")]
    State {
        /// The blob.
        id: String,
        /// Its version.
        version: u32,
        /// Why.
        why: String,
    },
    /// `resume` of a guest that has nothing to run.
    #[error("the guest has nothing to resume")]
    NothingToResume,
}

impl GuestError {
    /// A machine's error.
    pub fn machine<E: std::error::Error + Send + Sync + 'static>(e: E) -> GuestError {
        GuestError::Machine(Cause::new(e))
    }

    /// A refusal of `slat_dirty`'s harvester.
    pub fn harvest(e: slat_dirty::Error) -> GuestError {
        GuestError::Harvest(Cause::new(e))
    }
}

/// Why a migration attempt failed. On every one of these the source guest keeps running (or
/// runs again) on the source, and every page not acknowledged by the destination is still
/// owed to the next attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigrateError {
    /// The destination could not be reached.
    #[error("cannot connect to {addr}: {why}")]
    Connect {
        /// The address tried.
        addr: String,
        /// The socket error.
        why: Cause,
    },
    /// The stream broke or carried bad data (`phase`: where the migration was).
    #[error("{phase}: {err}")]
    Stream {
        /// Where the migration was.
        phase: String,
        /// What went wrong.
        err: StreamError,
    },
    /// The peer refused (the destination, or the source aborting).
    #[error("{who} refused the migration: {reason}")]
    Refused {
        /// "destination" or "source".
        who: &'static str,
        /// Its reason.
        reason: String,
    },
    /// The destination's memory did not match the source's at switch-over.
    #[error(
        "verification failed: {mismatched} of {ranges} ranges of {range_pages} pages differ{first}"
    )]
    Verification {
        /// Ranges compared.
        ranges: u64,
        /// Ranges that differ.
        mismatched: u64,
        /// Pages per range.
        range_pages: u32,
        /// The first differing ranges, readable.
        first: String,
    },
    /// The guest machine failed.
    #[error("guest: {0}")]
    Guest(#[from] GuestError),
    /// Guest memory was addressed wrongly (a bug on this side, reported instead of a panic).
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
    /// This destination will not take the source's guest (and told the source why).
    #[error("refused the incoming guest: {0}")]
    Rejected(#[from] HelloError),
    /// A batch size the stream cannot carry.
    #[error("batch of {0} pages: between 1 and {MAX_BATCH_PAGES}")]
    BatchPages(u32),
    /// A number of page streams the protocol does not carry.
    #[error("{0} connections: between 1 and {MAX_STREAMS}")]
    Connections(u32),
    /// Page streams over a channel that cannot open more connections (an inherited
    /// descriptor, a file, a caller's stream).
    #[error("{0} page streams need an endpoint to connect to (tcp: or unix:) or a connector (Source::set_connector)")]
    StreamsNeedEndpoint(u32),
    /// A page stream failed (the others and the control connection are closed with it).
    #[error("page stream {index}: {why}")]
    PageStream {
        /// The stream's index.
        index: u32,
        /// What went wrong on it.
        why: Box<MigrateError>,
    },
    /// A thread of the migration could not be started.
    #[error("cannot start a thread: {0}")]
    Thread(Cause),
    /// An attempt failed after the vCPUs stopped, and they could not run again on the source.
    #[error("guest: {first}; then the guest could not be restarted on the source: {restart}")]
    Restart {
        /// Why the attempt failed.
        first: Box<MigrateError>,
        /// Why the guest did not start again.
        restart: GuestError,
    },
    /// A zero timeout: the peer could hold this side forever.
    #[error("the timeout must not be zero (a silent peer would hold this side forever)")]
    ZeroTimeout,
    /// The guest's device state cannot be sent.
    #[error("device state: {0}")]
    State(#[from] StateError),
    /// The guest was already migrated away by an earlier attempt.
    #[error("the guest has already been migrated away")]
    AlreadyMigrated,
    /// A dirty-limit setting out of range.
    #[error(transparent)]
    DirtyLimit(#[from] crate::dirty_limit::DirtyLimitError),
    /// Dirty-limit measures each vCPU's rate from its dirty ring: other logs cannot say who
    /// dirtied a page.
    #[error("dirty-limit needs the dirty ring (the guest logs with {0})")]
    DirtyLimitNeedsRing(&'static str),
    /// The guest cannot slow one vCPU without the others.
    #[error("dirty-limit: this {0} guest has no per-vCPU throttle")]
    DirtyLimitUnsupported(String),
    /// Post-copy could not go on, or stopped (paused for a recovery, or lost).
    #[error(transparent)]
    Postcopy(#[from] crate::postcopy::PostcopyError),
}

impl MigrateError {
    pub(crate) fn stream(phase: impl Into<String>, err: StreamError) -> MigrateError {
        MigrateError::Stream {
            phase: phase.into(),
            err,
        }
    }
}
