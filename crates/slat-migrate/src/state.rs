//! Device and vCPU state: opaque, versioned blobs that travel after the last round of pages.
//!
//! The library never looks inside a blob. A source's [`crate::Guest::save_state`] names each
//! one (`id`, e.g. `"vcpu0"`, `"serial"`) and versions its format; the destination's
//! [`crate::Guest::restore_state`] gets them back in the order they were sent, and refuses a
//! version it does not read — before the switch-over, so the source simply runs on. On the
//! wire each blob is one checksummed frame ([`crate::stream::Msg::State`]), bounded by
//! [`MAX_STATE_BLOB`]; a guest's blobs are bounded by [`MAX_STATE_BLOBS`] and
//! [`MAX_STATE_BYTES`], and their ids must be distinct. A larger device state would need
//! chunking, which no guest here has needed.

use crate::error::StateError;
use crate::stream::{MAX_STATE_BLOB, MAX_STATE_BLOBS, MAX_STATE_BYTES, MAX_STATE_ID};

/// One piece of device or vCPU state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateBlob {
    /// What it is, unique within a guest (1 to [`MAX_STATE_ID`] bytes of UTF-8).
    pub id: String,
    /// Version of `data`'s format, for the restoring side to check.
    pub version: u32,
    /// The state itself (at most [`MAX_STATE_BLOB`] bytes).
    pub data: Vec<u8>,
}

/// Checks a guest's blobs before they are sent: sizes, count, total and distinct ids.
/// Returns their bytes in all.
pub fn check_blobs(blobs: &[StateBlob]) -> Result<u64, StateError> {
    if blobs.len() > MAX_STATE_BLOBS as usize {
        return Err(StateError::TooMany(blobs.len()));
    }
    let mut total = 0u64;
    let mut ids = std::collections::HashSet::new();
    for b in blobs {
        if b.id.is_empty() || b.id.len() > MAX_STATE_ID {
            return Err(StateError::Id(b.id.len()));
        }
        if b.data.len() > MAX_STATE_BLOB as usize {
            return Err(StateError::TooBig {
                id: b.id.clone(),
                len: b.data.len(),
            });
        }
        if !ids.insert(b.id.as_str()) {
            return Err(StateError::Duplicate(b.id.clone()));
        }
        total += b.data.len() as u64;
    }
    if total > MAX_STATE_BYTES {
        return Err(StateError::Total(total));
    }
    Ok(total)
}
