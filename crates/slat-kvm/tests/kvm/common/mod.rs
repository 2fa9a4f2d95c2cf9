//! Shared helpers: build a machine or skip (visibly) when /dev/kvm cannot be opened.

#![allow(dead_code)]

use slat_dirty::DirtyLogSource;
use slat_kvm::{KvmConfig, KvmError, KvmMachine, DEFAULT_DEVICE};
use slat_workload::pattern::Pattern;
use slat_workload::TestMachine;
use slat_workload::{Layout, PassParams};

/// The machine, or `None` (after saying so on stderr) when the host has no usable /dev/kvm.
pub fn machine_or_skip(config: KvmConfig) -> Option<KvmMachine> {
    match KvmMachine::new(config) {
        Ok(m) => Some(m),
        Err(e @ KvmError::DeviceUnavailable { .. }) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            None
        }
        Err(e) => panic!("cannot build the KVM machine: {e}"),
    }
}

/// True (after saying so) when /dev/kvm cannot be opened.
pub fn kvm_unavailable() -> bool {
    match slat_kvm::host_caps(DEFAULT_DEVICE) {
        Ok(_) => false,
        Err(e) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            true
        }
    }
}

/// Per test-region page: did the memstress model write it in one pass with `params`?
pub fn expected_writes(layout: &Layout, params: PassParams) -> Vec<bool> {
    let total = layout.total_pages();
    let mut w = vec![false; total as usize];
    for i in 0..layout.vcpus {
        let (gpa, _, pages) = layout.region(i);
        let first = (gpa - layout.gpa) / 4096;
        for (page, write) in Pattern::new(params, i as u32, pages) {
            if write {
                w[(first + page) as usize] = true;
            }
        }
    }
    w
}

/// Bitmap of the test region (bit p = page p) from a per-page bool vector.
pub fn to_bitmap(pages: &[bool]) -> Vec<u64> {
    let mut b = vec![0u64; pages.len().div_ceil(64)];
    for (p, &set) in pages.iter().enumerate() {
        if set {
            b[p / 64] |= 1 << (p % 64);
        }
    }
    b
}

/// The GET dirty logs of every test slot, concatenated into one region bitmap.
pub fn get_region_log(m: &KvmMachine) -> Vec<u64> {
    let pps = m.pages_per_slot();
    let total = m.layout().total_pages();
    let mut region = vec![0u64; total.div_ceil(64) as usize];
    let mut buf = vec![0u64; pps.div_ceil(64) as usize];
    for (s, id) in m.slot_ids().enumerate() {
        m.dirty_log()
            .get_log((id - slat_workload::FIRST_SLOT) as usize, &mut buf)
            .expect("KVM_GET_DIRTY_LOG");
        for p in 0..pps {
            if buf[(p / 64) as usize] & (1 << (p % 64)) != 0 {
                let q = s as u64 * pps + p;
                region[(q / 64) as usize] |= 1 << (q % 64);
            }
        }
    }
    region
}

/// Page indices set in a bitmap (for readable assertion failures).
pub fn pages_of(bitmap: &[u64]) -> Vec<u64> {
    let mut v = Vec::new();
    for (w, &bits) in bitmap.iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            v.push(w as u64 * 64 + b.trailing_zeros() as u64);
            b &= b - 1;
        }
    }
    v
}
