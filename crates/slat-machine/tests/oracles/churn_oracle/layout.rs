//! Layout: where each memslot lives. Every position is 2 MiB aligned, so THP-backed slots map
//! with 2 MiB leaves wherever logging allows.

use super::*;

pub(crate) const MIB: u64 = 1 << 20;
/// Checked memslots (ids 1 and 2).
pub(crate) const CHECKED: usize = 2;
pub(crate) const CHECKED_BYTES: u64 = 8 * MIB;
pub(crate) const PAGES: u64 = CHECKED_BYTES / PAGE_SIZE;
/// Checked pages over all checked slots.
pub(crate) const TOTAL: usize = CHECKED * PAGES as usize;
/// Pages at the start of each checked slot that every vCPU writes often, so vCPUs race on
/// the same entries and bitmap words.
pub(crate) const HOT_PAGES: u64 = 16;
/// The auxiliary slot: moved between positions, its log toggled, never checked.
pub(crate) const AUX_ID: SlotId = 10;
pub(crate) const AUX_BYTES: u64 = 4 * MIB;
pub(crate) const AUX_POSITIONS: u64 = 3;
/// Read-only slots: added and deleted, at positions no writable slot ever takes.
pub(crate) const RO_FIRST: SlotId = 20;
pub(crate) const RO_SLOTS: u64 = 4;
pub(crate) const RO_BYTES: u64 = 64 << 10;

pub(crate) fn checked_id(s: usize) -> SlotId {
    1 + s as SlotId
}

/// The checked slot of a memslot id, if it is one.
pub(crate) fn checked_index(id: SlotId) -> Option<usize> {
    (1..=CHECKED as SlotId)
        .contains(&id)
        .then(|| (id - 1) as usize)
}

/// Checked slot `s` at position `k` (0 or 1): moves alternate between the two.
pub(crate) fn checked_gpa(s: usize, k: usize) -> u64 {
    (1 << 30) + s as u64 * 64 * MIB + k as u64 * 32 * MIB
}

pub(crate) fn aux_gpa(k: u64) -> u64 {
    (2 << 30) + k * 16 * MIB
}

pub(crate) fn ro_gpa(i: u64) -> u64 {
    (3 << 30) + i * MIB
}

/// What read-only slot `i` holds in the first word of its page `q`.
pub(crate) fn ro_pattern(i: u64, q: u64) -> u64 {
    0x5a5a_0000_0000_0000 | (i << 32) | q
}
