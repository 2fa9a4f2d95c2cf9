//! Virtual time for slat (docs/design/virtual-time.md): run many simulated CPUs on a few host
//! cores, deterministically, with the real engine code.
//!
//! Every simulated CPU is an OS thread with its own clock. Exactly one runs at a time (it
//! holds the *baton*); the next to run is the lowest `(clock, rank)` runnable CPU, ranks being
//! the registration order or a seed's permutation of it. The engine reports its
//! synchronisation and work through [`slat::clock::Clock`]; [`Virtual`] turns those calls
//! into virtual time:
//!
//! - `charge` adds a [`Profile`] cost to the running CPU's clock (no switch);
//! - `rmw`, `shared_load` and `fence` go through the cache-line model: RMWs on a line
//!   serialise, a line last written elsewhere pays a transfer;
//! - `lock`/`unlock` go through the lock model: a queue per lock, readers together, a waiting
//!   writer blocks later readers, hand-off by the profile's policy (`fifo` or `barging`);
//! - `spin_until` blocks the CPU until a watched line is written, then re-evaluates;
//! - every one of those is a scheduling point: the running CPU yields when it is more than
//!   the profile's lookahead ahead of the lowest runnable clock.
//!
//! ```no_run
//! use slat::clock::{Clock, Cost};
//! use slat_vt::{Profile, Sim, Virtual};
//!
//! let sim = Sim::new(Profile::host_default(), 7)?;
//! let host = sim.register("host")?;
//! host.attach()?; // the main thread is host CPU 0
//! let vcpu = sim.register("vcpu0")?;
//! let t = std::thread::spawn(move || {
//!     vcpu.attach().ok();
//!     Virtual::charge(Cost::TlbHit, 1);
//! });
//! host.detach()?; // joining waits outside the simulation
//! t.join().ok();
//! host.attach_at(0)?;
//! drop(host);
//! sim.finish()?;
//! # Ok::<(), slat_vt::SimError>(())
//! ```

mod alloc;
mod error;
mod freed;
mod hooks;
mod host;
mod machines;
mod model;
mod profile;
mod scheduler;
mod sim;
mod virtual_clock;
mod wait;
mod watchdog;

pub use alloc::LineAligned;
pub use error::{ProfileError, SimError};
pub use machines::BUILTIN_PROFILES;
pub use model::line::{LineStats, MAX_CPUS};
pub use model::lock::LockStats;
pub use model::versions::VersionStats;
pub use profile::{cost_name, Entry, LockPolicy, Model, PolicyEntry, Profile, MAX_PROFILE_BYTES};
pub use sim::{
    attach_current, detach_current, hold_while, sleep_current, CpuHandle, CpuReport, Sim, SimStats,
    WATCHDOG,
};
pub use virtual_clock::{foreign_ops, simulated_now_ns, Hook, Virtual};
pub use wait::{Barrier, Condvar};
