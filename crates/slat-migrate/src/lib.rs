//! Live migration of any guest whose VMM implements [`Guest`]: pre-copy with the dirty log,
//! auto-converge, device state, verification, and retries that lose nothing; and post-copy
//! ([`postcopy`]) for a guest that dirties memory faster than the link carries it.
//!
//! - [`Guest`]: what a migration needs from a VMM — a memory map of guest-physical regions
//!   (holes and read-only regions allowed), pause/resume, the dirty log as `slat_dirty`'s
//!   harvester, and device state as opaque versioned blobs ([`StateBlob`]).
//! - [`stream`]: the versioned, framed, checksummed wire format; [`transport`]: the channels
//!   it travels over.
//! - [`Source`]: rounds, convergence, stop-and-copy, and the pages owed across attempts.
//! - [`Destination`]: receive, acknowledge, verify, restore device state.
//! - [`postcopy`]: the switch to running the guest on the destination before its memory has
//!   arrived (pages on demand through a userfaultfd, a preempt channel, recovery after a cut).
//! - [`throttle`]: auto-converge; [`dirty_limit`]: the per-vCPU dirty-rate limiter;
//!   [`verify`]: range hashes; [`Faults`]: test faults on the sending side's bandwidth-capped
//!   link; [`limits`]: how much guest memory this host can hold.
//!
//! The crate depends on `slat-dirty` and nothing of slat's benchmarks: slat's simulated and
//! `/dev/kvm` benchmark guests are clients of it, in the `slat-harness` crate.
//!
//! Everything that arrives from the network is untrusted: every count, size, index and
//! offset in it is checked (with checked arithmetic) against what this side has before it is
//! used, and a bad stream is a typed error — never a panic, an abort, a huge allocation or a
//! write outside guest memory. `slat-harness`'s `tests/harness/migrate_fuzz/` holds the decoder and a live destination to
//! that with random and mutated streams.
//!
//! # Example: a VMM migrates its guest
//!
//! The VMM implements [`Guest`] over its own memory map and dirty log (here 16 pages of RAM
//! at guest-physical 1 MiB, and a software log that reports no write because no vCPU runs; a
//! KVM VMM hands its memslots to [`guest::kvm_dirty_log`] instead), then sends the guest
//! over a UNIX socket pair to a destination receiving into a second guest. The destination
//! verifies memory before it commits, so a returned report means the copy is exact.
//!
//! ```
//! use slat_addr::{Gpa, Hva, PageIndex};
//! use slat_dirty::{DirtyLogSource, Harvester, LogMode, SlotInfo};
//! use slat_migrate::transport::Channel;
//! use slat_migrate::{DestConfig, Destination, Guest, GuestError, GuestHarvester};
//! use slat_migrate::{GuestLog, GuestRegion, Source, SourceConfig};
//! use slat_migrate::stream::Region;
//! use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! const PAGES: u64 = 16;
//!
//! /// The VMM's guest: RAM as atomic words (the vCPUs, elided, would write it too).
//! struct VmmGuest {
//!     ram: Box<[AtomicU64]>,
//!     running: AtomicBool,
//! }
//!
//! /// The VMM's dirty log of that RAM: one slot, GET mode, nothing written.
//! struct VmmLog;
//!
//! impl DirtyLogSource for VmmLog {
//!     type Error = std::convert::Infallible;
//!     fn slots(&self) -> Vec<SlotInfo> {
//!         vec![SlotInfo { id: 0, pages: PAGES }]
//!     }
//!     fn mode(&self) -> LogMode {
//!         LogMode::Get
//!     }
//!     fn get_log(&mut self, _: usize, bitmap: &mut [u64]) -> Result<(), Self::Error> {
//!         bitmap.fill(0);
//!         Ok(())
//!     }
//!     fn clear_log(&mut self, _: usize, _: PageIndex, _: u64, _: &[u64]) -> Result<(), Self::Error> {
//!         Ok(())
//!     }
//!     fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Self::Error> {
//!         Ok(0)
//!     }
//!     fn reset_rings(&mut self) -> Result<u64, Self::Error> {
//!         Ok(0)
//!     }
//! }
//!
//! // SAFETY: the one region is `ram`, PAGES pages of 8-byte aligned words owned by the guest
//! // for its whole life and accessed only atomically; nothing writes it while not running.
//! unsafe impl Guest for VmmGuest {
//!     fn kind(&self) -> &str {
//!         "my-vmm"
//!     }
//!     fn regions(&self) -> Vec<GuestRegion> {
//!         let region = Region { gpa: Gpa::new(1 << 20), pages: PAGES, read_only: false };
//!         vec![GuestRegion { region, host: Hva::from_ptr(self.ram.as_ptr()) }]
//!     }
//!     fn pause(&self) -> Result<(), GuestError> {
//!         Ok(self.running.store(false, Ordering::SeqCst))
//!     }
//!     fn resume(&self) -> Result<(), GuestError> {
//!         Ok(self.running.store(true, Ordering::SeqCst))
//!     }
//!     fn running(&self) -> bool {
//!         self.running.load(Ordering::SeqCst)
//!     }
//!     fn set_dirty_logging(&self, _on: bool) -> Result<(), GuestError> {
//!         Ok(())
//!     }
//!     fn dirty_log(&self) -> Result<GuestHarvester, GuestError> {
//!         let log: GuestLog = Box::new(VmmLog.map_err(GuestError::machine));
//!         Harvester::from_source(log).map_err(GuestError::harvest)
//!     }
//! }
//!
//! fn guest(fill: u64) -> Arc<VmmGuest> {
//!     let words = (PAGES * 512) as usize;
//!     let ram = (0..words).map(|i| AtomicU64::new(fill.wrapping_mul(i as u64))).collect();
//!     Arc::new(VmmGuest { ram, running: AtomicBool::new(false) })
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (src, dst) = (guest(0x9e37_79b9), guest(0));
//! src.resume()?;
//! let timeout = Duration::from_secs(10);
//! let (a, b) = std::os::unix::net::UnixStream::pair()?;
//! let to_source = Channel::unix(b, timeout, "source".into())?;
//! let cfg = DestConfig { resume_for: Duration::ZERO, timeout, ..DestConfig::default() };
//! let dest_guest = dst.clone();
//! let dest = std::thread::spawn(move || {
//!     Destination::with_guest(dest_guest, cfg).serve_channel(to_source)
//! });
//! let to_dest = Channel::unix(a, timeout, "destination".into())?;
//! let report = Source::new(src.clone(), SourceConfig::default())
//!     .migrate_over(to_dest, &mut |_event| {})?;
//! let received = dest.join().expect("the destination thread")?;
//! assert!(received.verify.ok());
//! assert_eq!(report.rounds[0].pages, PAGES);
//! let same = src.ram.iter().zip(dst.ram.iter());
//! assert!(same.into_iter().all(|(a, b)| a.load(Ordering::Relaxed) == b.load(Ordering::Relaxed)));
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

// One public path per item (checked by slat-harness's `tests/harness/public_paths.rs`): the two ends, the
// guest they move and the errors live in private modules re-exported here; the public modules (wire
// format, transports, dirty-rate limiter, auto-converge, verification, host limits) are cohesive
// groups whose items are not re-exported here.
pub mod dirty_limit;
pub mod limits;
pub mod postcopy;
pub mod stream;
pub mod throttle;
pub mod transport;
pub mod verify;

mod destination;
mod error;
mod guest;
mod link;
mod page_error;
mod source;
mod state;

pub use destination::{DestConfig, DestReport, Destination, Factory};
pub use error::{
    describe_map, Cause, Corruption, GuestError, HelloError, MapError, MemoryError, MigrateError,
    PageError, ProtocolError, StateError, StreamError,
};
pub use guest::{
    kvm_dirty_log, splitmix, Guest, GuestHarvester, GuestLog, GuestRegion, Memory, MemoryMap,
};
pub use link::Faults;
pub use source::{
    DeltaReport, DirtyLimitReport, Event, MigrationReport, Progress, RoundReport, Source,
    SourceConfig, DEFAULT_DELTA_CACHE,
};
pub use state::{check_blobs, StateBlob};
