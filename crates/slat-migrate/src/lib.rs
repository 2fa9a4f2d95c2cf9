//! Live migration of any guest whose VMM implements [`Guest`]: pre-copy with the dirty log,
//! auto-converge, device state, verification, and retries that lose nothing.
//!
//! - [`guest`]: what a migration needs from a VMM — a memory map of guest-physical regions
//!   (holes and read-only regions allowed), pause/resume, the dirty log as `slat_dirty`'s
//!   harvester, and device state as opaque versioned blobs ([`state`]).
//! - [`stream`]: the versioned, framed, checksummed wire format.
//! - [`source`]: rounds, convergence, stop-and-copy, and the pages owed across attempts.
//! - [`destination`]: receive, acknowledge, verify, restore device state.
//! - [`throttle`]: auto-converge; [`verify`]: range hashes; [`link`]: the sending side with
//!   a bandwidth cap and test faults; [`limits`]: how much guest memory this host can hold.
//!
//! The crate depends on `slat-dirty` and nothing of slat's benchmarks: slat's simulated and
//! `/dev/kvm` benchmark guests are clients of it, in the `slat-harness` crate.
//!
//! Everything that arrives from the network is untrusted: every count, size, index and
//! offset in it is checked (with checked arithmetic) against what this side has before it is
//! used, and a bad stream is a typed error — never a panic, an abort, a huge allocation or a
//! write outside guest memory. `slat-harness`'s `tests/migrate_fuzz.rs` holds the decoder and a live destination to
//! that with random and mutated streams.
//!

#![deny(missing_docs)]

pub mod destination;
pub mod dirty_limit;
pub mod error;
pub mod guest;
pub mod limits;
pub mod link;
pub mod source;
pub mod state;
pub mod stream;
pub mod throttle;
pub mod transport;
pub mod verify;

pub use destination::{DestConfig, DestReport, Destination, Factory};
pub use dirty_limit::{DirtyLimitConfig, DirtyLimitError, DirtyLimiter};
pub use error::{
    Cause, Corruption, GuestError, HelloError, MapError, MemoryError, MigrateError, PageError,
    ProtocolError, StateError, StreamError,
};
pub use guest::{Guest, GuestHarvester, GuestLog, GuestRegion, Memory, MemoryMap};
pub use link::Faults;
pub use source::{Event, MigrationReport, Progress, RoundReport, Source, SourceConfig};
pub use state::StateBlob;
pub use stream::Region;
pub use transport::{Channel, Endpoint, Listener};
