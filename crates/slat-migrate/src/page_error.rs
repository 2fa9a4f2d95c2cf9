//! Why one page entry of a batch cannot be written to guest memory (`PageError`, exported at
//! the crate root beside the other errors).

use crate::stream::PAGE_BYTES;

/// Why one page entry of a batch cannot be written to guest memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// The page index is past the end of the destination's guest memory.
    #[error("page {page} is outside the guest's {pages} pages")]
    OutOfRange {
        /// The index.
        page: u64,
        /// Pages of guest memory here.
        pages: u64,
    },
    /// The LZ4 block is malformed.
    #[error("page {page} does not decompress ({why})")]
    Decompress {
        /// The page.
        page: u64,
        /// What the decoder found.
        why: &'static str,
    },
    /// The LZ4 block decompresses to something other than one page.
    #[error("page {page} decompresses to {len} bytes, not {PAGE_BYTES}")]
    Size {
        /// The page.
        page: u64,
        /// Bytes it gave.
        len: usize,
    },
    /// An entry index past the batch, or an entry whose bytes lie outside the payload.
    #[error(
        "entry {index} of a batch of {len} entries does not exist or lies outside the payload"
    )]
    Entry {
        /// The entry.
        index: usize,
        /// Entries in the batch.
        len: usize,
    },
    /// A delta page that does not apply.
    #[error("page {page}: {err}")]
    Delta {
        /// The page.
        page: u64,
        /// Why.
        err: crate::stream::delta::DeltaError,
    },
    /// The output buffer is not one page.
    #[error("a page buffer of {len} bytes (a page is {PAGE_BYTES})")]
    Buffer {
        /// Its length.
        len: usize,
    },
}
