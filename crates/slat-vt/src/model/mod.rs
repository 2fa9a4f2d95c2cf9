//! The contention model (docs/design/virtual-time.md §3): cache lines, store buffers and
//! locks; and what a page-table entry held before writes later in virtual time (§3, "What a
//! walk sees").
//!
//! Pure bookkeeping over virtual times: no threads, no waiting. The scheduler asks it when an
//! access completes or who gets a lock, and makes CPUs wait accordingly.

pub(crate) mod calendar;
pub(crate) mod line;
pub(crate) mod lock;
pub(crate) mod owners;
pub(crate) mod store_buffer;
pub(crate) mod versions;

use std::hash::{BuildHasherDefault, Hasher};

/// A multiplicative hasher for the models' integer keys (line numbers, lock addresses): std's
/// SipHash costs more than the rest of a hook, and the keys are not attacker-chosen.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        // The high bits of the product are the well-mixed ones; hashbrown uses the top 7 for
        // its control bytes and the low ones for the bucket, so fold the high half down.
        self.0 ^ (self.0 >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// The models' map hasher.
pub(crate) type FastHash = BuildHasherDefault<KeyHasher>;
