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
//! - [`bench`](mod@bench) (feature `machines`, on by default): slat's simulated and `/dev/kvm` guests
//!   with the synthetic workload the benchmarks run. Without the feature the crate builds
//!   without either machine.
//!
//! Everything that arrives from the network is untrusted: every count, size, index and
//! offset in it is checked (with checked arithmetic) against what this side has before it is
//! used, and a bad stream is a typed error — never a panic, an abort, a huge allocation or a
//! write outside guest memory. `tests/fuzz.rs` holds the decoder and a live destination to
//! that with random and mutated streams.
//!
//! ```no_run
//! # #[cfg(feature = "machines")] {
//! use slat_migrate::bench::{self, BenchGuest, GuestSpec, LogMode, Shape, WorkSpec};
//! use slat_migrate::{DestConfig, Destination, Source, SourceConfig};
//! use std::net::TcpListener;
//! let shape = Shape { vcpus: 2, bytes_per_vcpu: 32 << 20, slots: 1, overlap: false };
//! let listener = TcpListener::bind("127.0.0.1:0").unwrap();
//! let addr = listener.local_addr().unwrap().to_string();
//! let dest = std::thread::spawn(move || {
//!     let factory = bench::factory(GuestSpec::sim(shape, LogMode::Get));
//!     Destination::new(factory, DestConfig::default()).accept(&listener)
//! });
//! let g = bench::build(&GuestSpec::sim(shape, LogMode::Clear)).unwrap();
//! g.start(WorkSpec { write_percent: 100, random: true, seed: 1, rate: 10_000 }).unwrap();
//! let mut src = Source::new(g.as_guest(), SourceConfig::default());
//! let report = src.migrate(&addr, &mut |_| {}).unwrap();
//! println!("downtime {:?}", report.downtime);
//! dest.join().unwrap().unwrap();
//! # }
//! ```

#![deny(missing_docs)]

#[cfg(feature = "machines")]
pub mod bench;
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
    ProtocolError, ShapeError, StateError, StreamError,
};
pub use guest::{Guest, GuestErrors, GuestHarvester, GuestLog, GuestRegion, Memory, MemoryMap};
pub use link::Faults;
pub use source::{Event, MigrationReport, Progress, RoundReport, Source, SourceConfig};
pub use state::StateBlob;
pub use stream::Region;
pub use transport::{Channel, Endpoint, Listener};
