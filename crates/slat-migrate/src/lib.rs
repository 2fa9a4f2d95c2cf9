//! Live migration of slat guests: pre-copy over TCP with the dirty log, auto-converge,
//! verification at switch-over, and retries that lose nothing.
//!
//! - [`stream`]: the versioned, framed, checksummed wire format.
//! - [`guest`]: the machine a migration moves (the simulated machine or a `/dev/kvm` guest),
//!   its workload and its dirty log in one of three modes (GET, CLEAR, ring).
//! - [`source`]: rounds, convergence, stop-and-copy, and the pages owed across attempts.
//! - [`destination`]: receive, acknowledge, verify, resume the guest.
//! - [`throttle`]: auto-converge; [`verify`]: range hashes; [`link`]: the sending socket with
//!   a bandwidth cap and test faults; [`limits`]: how much guest memory this host can hold.
//!
//! Everything that arrives from the network is untrusted: every count, size, index and
//! offset in it is checked (with checked arithmetic) against what this side has before it is
//! used, and a bad stream is a typed error — never a panic, an abort, a huge allocation or a
//! write outside guest memory. `tests/fuzz.rs` holds the decoder and a live destination to
//! that with random and mutated streams.
//!
//! ```no_run
//! use slat_migrate::{guest, DestConfig, Destination, Source, SourceConfig};
//! use slat_migrate::stream::{Shape, WorkSpec};
//! use std::net::TcpListener;
//! let shape = Shape { vcpus: 2, bytes_per_vcpu: 32 << 20, slots: 1, overlap: false };
//! let listener = TcpListener::bind("127.0.0.1:0").unwrap();
//! let addr = listener.local_addr().unwrap().to_string();
//! let dest = std::thread::spawn(move || {
//!     let factory = Box::new(|s: &Shape| guest::build(&guest::GuestSpec::sim(*s, guest::LogMode::Get)));
//!     Destination::new(factory, DestConfig::default()).accept(&listener)
//! });
//! let g = guest::build(&guest::GuestSpec::sim(shape, guest::LogMode::Clear)).unwrap();
//! let work = WorkSpec { write_percent: 100, random: true, seed: 1, rate: 10_000 };
//! let mut src = Source::new(g, work, SourceConfig::default());
//! src.start_guest().unwrap();
//! let report = src.migrate(&addr, &mut |_| {}).unwrap();
//! println!("downtime {:?}", report.downtime);
//! dest.join().unwrap().unwrap();
//! ```

#![deny(missing_docs)]

pub mod destination;
pub mod error;
pub mod guest;
pub mod limits;
pub mod link;
pub mod source;
pub mod stream;
pub mod throttle;
pub mod verify;

pub use destination::{DestConfig, DestReport, Destination, Factory};
pub use error::{
    Cause, Corruption, GuestError, HelloError, MemoryError, MigrateError, PageError, ProtocolError,
    ShapeError, StreamError,
};
pub use guest::{BackendKind, Guest, GuestHarvester, GuestLog, GuestSpec, LogMode};
pub use link::Faults;
pub use source::{Event, MigrationReport, RoundReport, Source, SourceConfig};
