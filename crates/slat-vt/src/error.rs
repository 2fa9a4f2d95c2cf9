//! Typed errors of profiles and simulations.

use thiserror::Error;

/// A profile that cannot be read, parsed or used.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ProfileError {
    /// The file could not be read or written.
    #[error("cost profile {path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's message.
        error: String,
    },
    /// The file is larger than any profile (a device or a wrong path): refused unread.
    #[error("cost profile {path}: larger than {limit} bytes, not a cost profile")]
    TooLarge {
        /// The file.
        path: String,
        /// The largest profile accepted, in bytes.
        limit: u64,
    },
    /// The text is not a profile (TOML syntax, a wrong type, an unknown field).
    #[error("cost profile: {0}")]
    Parse(String),
    /// The profile could not be written as TOML.
    #[error("cost profile: {0}")]
    Serialize(String),
    /// A cost the simulation charges has no entry.
    #[error("cost profile: no entry for cost `{0}`")]
    Missing(&'static str),
    /// An entry names a cost that does not exist.
    #[error("cost profile: unknown cost `{0}`")]
    Unknown(String),
    /// A number is negative, not finite, too large, or zero where it must not be.
    #[error("cost profile: `{name}` = {value:?} ns is out of range")]
    BadValue {
        /// The entry.
        name: &'static str,
        /// Its value in ns.
        value: f64,
    },
}

/// Why a simulation failed, or a request to it was refused.
///
/// A failure ([`Deadlock`](SimError::Deadlock), [`Watchdog`](SimError::Watchdog),
/// [`Stalled`](SimError::Stalled)) is sticky:
/// every later hook of the simulation sees it and behaves as real time, so the simulated
/// threads run to their end and the caller reports the error (the CLI exits 1).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SimError {
    /// The profile is not usable.
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// More simulated CPUs than the line model's sharer sets hold.
    #[error("virtual time: at most {max} simulated CPUs")]
    TooManyCpus {
        /// The limit.
        max: usize,
    },
    /// `attach` on a thread that already runs a simulated CPU.
    #[error("virtual time: this thread already runs simulated CPU `{0}`")]
    AlreadyAttached(String),
    /// `detach`/`attach_at` from a thread that does not run this CPU, or in the wrong state.
    #[error("virtual time: `{cpu}` cannot {op} here: {why}")]
    Misuse {
        /// The CPU's name.
        cpu: String,
        /// What was asked.
        op: &'static str,
        /// Why it was refused.
        why: &'static str,
    },
    /// No simulated CPU can run and some wait: nothing can ever wake them.
    #[error("virtual time: deadlock, no simulated CPU can run:\n{report}")]
    Deadlock {
        /// Every CPU's clock and state, one line each.
        report: String,
    },
    /// No scheduler call for the watchdog's period while a CPU held the baton: it blocked in
    /// the operating system on something the simulation does not route.
    #[error("virtual time: no scheduler call for {ms} ms (a simulated CPU blocked outside the simulation):\n{report}")]
    Watchdog {
        /// The watchdog's period, ms.
        ms: u64,
        /// Every CPU's clock and state, one line each.
        report: String,
    },
    /// Scheduler calls kept coming without a simulated CPU's clock advancing: the profile
    /// makes the work being simulated free, so virtual time stands still.
    #[error("virtual time: {calls} scheduler calls in a row without the calling CPU's clock advancing (the cost profile makes the simulated work free, so a wait for virtual time would never end):\n{report}")]
    Stalled {
        /// The calls.
        calls: u64,
        /// Every CPU's clock and state, one line each.
        report: String,
    },
    /// Threads that run no simulated CPU called virtual-time hooks while the simulation ran.
    #[error("virtual time: {count} hook call(s) from threads that are not simulated CPUs (first: {first})")]
    Foreign {
        /// How many.
        count: u64,
        /// The first hook so called in this process.
        first: String,
    },
    /// The simulation had already failed.
    #[error("virtual time: the simulation failed earlier")]
    Failed,
}
