//! Sizes and counts from a caller never panic or abort: every public constructor of this crate
//! that takes one answers with a typed error or a value. The allocation-heavy ones run again in
//! a child process under `prlimit --as` (an address-space limit), where an allocation that
//! fails aborts only the child and the parent reports it.
//!
//! Constructors covered (each with sizes 0, 1, `u64::MAX`, `usize::MAX`, powers of two and
//! their neighbours, and random values):
//! - `Harvester::from_source` (slot page counts, CLEAR chunk)
//! - `DirtyRate::new` (slot page counts), `DirtyRate::with_vcpus`, `DirtyRate::with_regions`
//! - `SampleWindow::from_millis`
//! - `RingSize::from_entries`, `RingSize::from_bytes`
//! - `SummaryBitmap::new`, `SummaryBitmap::new_or_saturated` (bytes and page size), and its
//!   marks and takes over any range
//! - `Measurement` built by the caller: `time`, `pages`, `pages_per_s`, `vcpu_pages_per_s`,
//!   `unattributed` over any windows and counts

use proptest::prelude::*;
use slat_addr::PageIndex;
use slat_dirty::dirty_rate::{Attribution, DirtyRate, Measurement, Sample, SampleWindow};
use slat_dirty::log::RingSize;
use slat_dirty::{DirtyLogSource, Error, Harvester, LogMode, SlotInfo, SummaryBitmap};
use std::num::NonZeroUsize;
use std::time::Duration;

#[path = "../../../test-support/as_limit.rs"]
mod as_limit;
use as_limit::{rerun_under_as_limit, size};

const AS_LIMIT: u64 = 1 << 30;

/// A log of slots that claim any page counts, and reports nothing.
struct Claims {
    slots: Vec<SlotInfo>,
    mode: LogMode,
}

impl DirtyLogSource for Claims {
    type Error = Error;
    fn slots(&self) -> Vec<SlotInfo> {
        self.slots.clone()
    }
    fn mode(&self) -> LogMode {
        self.mode
    }
    fn get_log(&mut self, _: usize, _: &mut [u64]) -> Result<(), Error> {
        Ok(())
    }
    fn clear_log(&mut self, _: usize, _: PageIndex, _: u64, _: &[u64]) -> Result<(), Error> {
        Ok(())
    }
    fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Error> {
        Ok(0)
    }
    fn reset_rings(&mut self) -> Result<u64, Error> {
        Ok(0)
    }
}

fn claims(pages: &[u64], mode: LogMode) -> Claims {
    Claims {
        slots: pages
            .iter()
            .enumerate()
            .map(|(i, &pages)| SlotInfo {
                id: i as u32,
                pages,
            })
            .collect(),
        mode,
    }
}

/// The harvester documents a typed error for a slot this host cannot hold; its GET scratch
/// bitmap (as large as the largest slot's) was allocated infallibly after the owed bitmaps,
/// so a slot whose bitmap fit once but not twice aborted the process.
#[test]
fn a_harvester_whose_bitmaps_do_not_fit_twice_is_refused() {
    if rerun_under_as_limit(
        module_path!(),
        "a_harvester_whose_bitmaps_do_not_fit_twice_is_refused",
        AS_LIMIT,
    ) {
        return;
    }
    // 600 MiB of bitmap: one fits under the 1 GiB limit, two do not.
    let pages = 600u64 << 20 << 3;
    match Harvester::from_source(claims(&[pages], LogMode::Get)) {
        Err(Error::Alloc { .. }) => {}
        other => panic!("expected Error::Alloc, got {:?}", other.map(|_| ())),
    }
    match DirtyRate::new(claims(&[pages, pages], LogMode::Get)) {
        Err(Error::Alloc { .. }) => {}
        other => panic!("expected Error::Alloc, got {:?}", other.map(|_| ())),
    }
}

/// Measurements a caller built: windows that add up past `Duration::MAX` and page counts
/// past `u64::MAX` used to overflow the sums and panic; they saturate.
#[test]
fn a_callers_measurement_that_overflows_saturates() {
    let s = |window, pages| Sample {
        window,
        pages,
        per_vcpu: vec![pages, u64::MAX],
        unattributed: pages,
        foreign: 0,
    };
    let m = Measurement {
        attribution: Attribution::Ring,
        samples: vec![s(Duration::MAX, u64::MAX), s(Duration::MAX, 2)],
    };
    assert_eq!(m.time(), Duration::MAX);
    assert_eq!(m.pages(), u64::MAX);
    assert_eq!(m.unattributed(), u64::MAX);
    assert!(m.pages_per_s().is_finite());
    assert_eq!(m.vcpu_pages_per_s().len(), 2);
}

fn modes() -> impl Strategy<Value = LogMode> {
    prop_oneof![
        Just(LogMode::Get),
        Just(LogMode::Ring),
        size().prop_map(|chunk_pages| LogMode::ManualProtect { chunk_pages }),
    ]
}

/// The harvester and the dirty-rate sampler over slots of any claimed size: a typed error or
/// a value, never an abort (in the child, under the address-space limit).
#[test]
fn harvesters_and_samplers_of_any_size() {
    if rerun_under_as_limit(
        module_path!(),
        "harvesters_and_samplers_of_any_size",
        AS_LIMIT,
    ) {
        return;
    }
    let cfg = ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let cases = (
        prop::collection::vec(size(), 0..4),
        modes(),
        size(),
        (size(), size()),
    );
    proptest::test_runner::TestRunner::new(cfg)
        .run(&cases, |(pages, mode, vcpus, region)| {
            if let Ok(mut h) = Harvester::from_source(claims(&pages, mode)) {
                if let Ok(set) = h.take() {
                    set.commit();
                }
            }
            let bytes = pages.first().map_or(0, |&p| p as usize);
            let page_size = NonZeroUsize::new(vcpus as usize).unwrap_or(NonZeroUsize::MIN);
            for b in [
                SummaryBitmap::new(bytes, page_size).ok(),
                Some(SummaryBitmap::new_or_saturated(bytes, page_size)).filter(|b| {
                    // A saturated bitmap's take lists every word: only small ones here.
                    !b.is_saturated() || b.len() < 1 << 20
                }),
            ]
            .into_iter()
            .flatten()
            {
                b.mark_pages(region.0 as usize, region.1 as usize);
                b.set_addr_range(region.1 as usize, region.0 as usize);
                let _ = b.is_bit_set(region.0 as usize);
                b.take_words(|_, _| {});
            }
            if let Ok(r) = DirtyRate::new(claims(&pages, mode)) {
                let r = r.with_vcpus(vcpus as usize);
                // One region per vCPU: a one-element list of ranges.
                #[allow(clippy::single_range_in_vec_init)]
                let regions = vec![region.0..region.1];
                let _ = r.with_regions(regions);
            }
            Ok(())
        })
        .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Windows, ring sizes: typed errors or values.
    #[test]
    fn windows_and_ring_sizes_of_any_size(n in size()) {
        let _ = SampleWindow::from_millis(n);
        let _ = RingSize::from_entries(n as u32);
        let _ = RingSize::from_bytes(n);
    }
}
