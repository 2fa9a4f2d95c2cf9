//! Address units shared by slat's engine (`slat`) and its libraries (`slat-dirty`,
//! `slat-migrate`): a guest physical address ([`Gpa`]), a guest frame number ([`Gfn`]), a host
//! address ([`Hva`]) and a page index within a memslot ([`PageIndex`]).
//!
//! Each is a distinct type over a `u64`, so passing a frame number where an address is wanted
//! does not compile. Conversions are explicit methods; arithmetic that can overflow is
//! `checked_*` and returns `None` instead of wrapping or panicking, as `vm-memory`'s
//! `GuestAddress` does. Counts (pages, bytes) stay plain integers: the type says what is
//! counted from, the count says how many.
//!
//! ```
//! use slat_addr::{Gfn, Gpa, PageIndex};
//!
//! let gpa = Gpa::new(0x10_2345);
//! assert_eq!(gpa.gfn(), Gfn::new(0x102));
//! assert_eq!(gpa.page_offset(), 0x345);
//! // A memslot that starts at frame 0x100: the address is page 2 of it.
//! let index = PageIndex::of(gpa.gfn(), Gfn::new(0x100)).unwrap();
//! assert_eq!(index, PageIndex::new(2));
//! assert_eq!(index.gfn(Gfn::new(0x100)), Some(Gfn::new(0x102)));
//! // Overflow is a None, never a wrap.
//! assert_eq!(Gpa::new(u64::MAX).checked_add(1), None);
//! assert_eq!(Gfn::new(u64::MAX).checked_gpa(), None);
//! ```

#![deny(missing_docs)]

use core::fmt;

/// log2 of the base page size.
pub const PAGE_SHIFT: u32 = 12;
/// The base page size in bytes (4 KiB).
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;

macro_rules! unit {
    ($(#[$doc:meta])* $name:ident, $label:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        #[cfg_attr(feature = "serde", serde(transparent))]
        #[repr(transparent)]
        pub struct $name(u64);

        impl $name {
            /// The smallest value (0).
            pub const ZERO: $name = $name(0);

            /// The unit for a raw number.
            #[inline]
            pub const fn new(raw: u64) -> Self {
                $name(raw)
            }

            /// The raw number.
            #[inline]
            pub const fn raw(self) -> u64 {
                self.0
            }

            /// The raw number as a `usize`, or `None` if it does not fit (32-bit hosts).
            #[inline]
            pub fn to_usize(self) -> Option<usize> {
                usize::try_from(self.0).ok()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($label, "({:#x})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }

        impl fmt::LowerHex for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

unit!(
    /// A guest physical address, in bytes.
    Gpa,
    "Gpa"
);
unit!(
    /// A guest frame number: a guest physical address divided by [`PAGE_SIZE`].
    Gfn,
    "Gfn"
);
unit!(
    /// A host (virtual) address, in bytes: where a guest page's data lives in the process.
    /// In slat's model it is also what a leaf entry of the second-stage table holds.
    Hva,
    "Hva"
);
unit!(
    /// A page's index within one memslot (0 is the slot's first page): the bit number in the
    /// slot's dirty bitmap, the page a ring entry's offset names. Also a page's index in a
    /// guest's memory map laid end to end (migration's memory index), which is one slot's
    /// index for a guest of one slot.
    PageIndex,
    "PageIndex"
);

impl Gpa {
    /// The frame holding this address.
    #[inline]
    pub const fn gfn(self) -> Gfn {
        Gfn(self.0 >> PAGE_SHIFT)
    }

    /// The byte offset within its 4 KiB page.
    #[inline]
    pub const fn page_offset(self) -> u64 {
        self.0 & (PAGE_SIZE - 1)
    }

    /// Whether the address is a multiple of `align`; false if `align` is not a power of two.
    #[inline]
    pub const fn is_aligned(self, align: u64) -> bool {
        align.is_power_of_two() && self.0 & (align - 1) == 0
    }

    /// Whether the address starts a 4 KiB page.
    #[inline]
    pub const fn is_page_aligned(self) -> bool {
        self.page_offset() == 0
    }

    /// `self + bytes`, or `None` on overflow.
    #[inline]
    pub const fn checked_add(self, bytes: u64) -> Option<Gpa> {
        match self.0.checked_add(bytes) {
            Some(v) => Some(Gpa(v)),
            None => None,
        }
    }

    /// `self - bytes`, or `None` below zero.
    #[inline]
    pub const fn checked_sub(self, bytes: u64) -> Option<Gpa> {
        match self.0.checked_sub(bytes) {
            Some(v) => Some(Gpa(v)),
            None => None,
        }
    }

    /// Bytes from `base` up to `self`, or `None` if `self` is below `base`.
    #[inline]
    pub const fn checked_offset_from(self, base: Gpa) -> Option<u64> {
        self.0.checked_sub(base.0)
    }
}

impl Gfn {
    /// The largest frame whose address fits in 64 bits.
    pub const MAX: Gfn = Gfn(u64::MAX >> PAGE_SHIFT);

    /// The address of the frame's first byte, or `None` if it does not fit in 64 bits.
    #[inline]
    pub const fn checked_gpa(self) -> Option<Gpa> {
        if self.0 > Gfn::MAX.0 {
            None
        } else {
            Some(Gpa(self.0 << PAGE_SHIFT))
        }
    }

    /// `self + pages`, or `None` on overflow.
    #[inline]
    pub const fn checked_add(self, pages: u64) -> Option<Gfn> {
        match self.0.checked_add(pages) {
            Some(v) => Some(Gfn(v)),
            None => None,
        }
    }

    /// `self - pages`, or `None` below zero.
    #[inline]
    pub const fn checked_sub(self, pages: u64) -> Option<Gfn> {
        match self.0.checked_sub(pages) {
            Some(v) => Some(Gfn(v)),
            None => None,
        }
    }

    /// Pages from `base` up to `self`, or `None` if `self` is below `base`.
    #[inline]
    pub const fn checked_pages_from(self, base: Gfn) -> Option<u64> {
        self.0.checked_sub(base.0)
    }

    /// The frame rounded down to a multiple of `pages` (a huge page's first frame); `None`
    /// if `pages` is not a power of two.
    #[inline]
    pub const fn align_down(self, pages: u64) -> Option<Gfn> {
        if pages.is_power_of_two() {
            Some(Gfn(self.0 & !(pages - 1)))
        } else {
            None
        }
    }

    /// Whether the frame is a multiple of `pages`; false if `pages` is not a power of two.
    #[inline]
    pub const fn is_aligned(self, pages: u64) -> bool {
        pages.is_power_of_two() && self.0 & (pages - 1) == 0
    }
}

impl Hva {
    /// The address of `ptr`.
    #[inline]
    pub fn from_ptr<T>(ptr: *const T) -> Hva {
        Hva(ptr as usize as u64)
    }

    /// The address as a raw pointer. Making the pointer is safe; dereferencing it is the
    /// caller's `unsafe` business, under whatever keeps the memory mapped.
    #[inline]
    pub fn as_ptr<T>(self) -> *mut T {
        self.0 as usize as *mut T
    }

    /// `self + bytes`, or `None` on overflow.
    #[inline]
    pub const fn checked_add(self, bytes: u64) -> Option<Hva> {
        match self.0.checked_add(bytes) {
            Some(v) => Some(Hva(v)),
            None => None,
        }
    }

    /// Bytes from `base` up to `self`, or `None` if `self` is below `base`.
    #[inline]
    pub const fn checked_offset_from(self, base: Hva) -> Option<u64> {
        self.0.checked_sub(base.0)
    }

    /// Whether the address is a multiple of `align`; false if `align` is not a power of two.
    #[inline]
    pub const fn is_aligned(self, align: u64) -> bool {
        align.is_power_of_two() && self.0 & (align - 1) == 0
    }
}

impl PageIndex {
    /// The index of frame `gfn` in a slot whose first frame is `base`, or `None` if `gfn` is
    /// below it. Whether the index is inside the slot is the slot's to check.
    #[inline]
    pub const fn of(gfn: Gfn, base: Gfn) -> Option<PageIndex> {
        match gfn.checked_pages_from(base) {
            Some(v) => Some(PageIndex(v)),
            None => None,
        }
    }

    /// The frame at this index of a slot whose first frame is `base`, or `None` on overflow.
    #[inline]
    pub const fn gfn(self, base: Gfn) -> Option<Gfn> {
        base.checked_add(self.0)
    }

    /// `self + pages`, or `None` on overflow.
    #[inline]
    pub const fn checked_add(self, pages: u64) -> Option<PageIndex> {
        match self.0.checked_add(pages) {
            Some(v) => Some(PageIndex(v)),
            None => None,
        }
    }

    /// The byte offset of the page within its slot, or `None` on overflow.
    #[inline]
    pub const fn checked_byte_offset(self) -> Option<u64> {
        self.0.checked_mul(PAGE_SIZE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip_and_refuse_overflow() {
        let g = Gpa::new(0xdead_b000);
        assert_eq!(g.gfn().checked_gpa(), Some(g));
        assert_eq!(Gfn::MAX.checked_gpa(), Some(Gpa::new(!(PAGE_SIZE - 1))));
        assert_eq!(Gfn::new(Gfn::MAX.raw() + 1).checked_gpa(), None);
        assert_eq!(Gfn::new(7).align_down(4), Some(Gfn::new(4)));
        assert_eq!(Gfn::new(7).align_down(3), None);
        assert!(!Gpa::new(0).is_aligned(0));
        assert_eq!(PageIndex::of(Gfn::new(1), Gfn::new(2)), None);
        assert_eq!(PageIndex::new(u64::MAX).checked_byte_offset(), None);
        assert_eq!(PageIndex::new(1).gfn(Gfn::new(u64::MAX)), None);
        assert_eq!(format!("{:?}", Gfn::new(255)), "Gfn(0xff)");
        assert_eq!(format!("{}", Gpa::new(4096)), "0x1000");
    }
}
