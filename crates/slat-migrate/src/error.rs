//! What can go wrong, as one readable line each.

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
        why: String,
    },
    /// A well-formed frame that the protocol does not allow here.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer sent nothing for too long.
    #[error("no data from the peer for {0:?}")]
    Timeout(Duration),
    /// A socket error.
    #[error("connection error: {0}")]
    Io(String),
}

impl StreamError {
    /// Maps a socket error, telling timeouts apart.
    pub(crate) fn io(e: &std::io::Error, timeout: Duration) -> StreamError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                StreamError::Timeout(timeout)
            }
            _ => StreamError::Io(e.to_string()),
        }
    }
}

/// Why the guest machine refused an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GuestError(pub String);

impl GuestError {
    pub(crate) fn from<E: std::fmt::Display>(e: E) -> GuestError {
        GuestError(e.to_string())
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
        why: String,
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
    /// A configuration value is unusable.
    #[error("{0}")]
    Config(String),
    /// The guest was already migrated away by an earlier attempt.
    #[error("the guest has already been migrated away")]
    AlreadyMigrated,
}

impl MigrateError {
    pub(crate) fn stream(phase: impl Into<String>, err: StreamError) -> MigrateError {
        MigrateError::Stream {
            phase: phase.into(),
            err,
        }
    }
}
