//! A guest as a small VMM would write it, without slat's machines: regions of host memory it
//! owns (with holes between them, and read-only ones), a software dirty log with KVM's GET
//! semantics, a "vCPU" thread writing pages, and device state. What `Guest` asks of a VMM, in
//! about a hundred lines.

use slat_addr::{Hva, PageIndex};
use slat_dirty::{DirtyLogSource, Harvester, LogMode, SlotInfo};
use slat_migrate::stream::Region;
use slat_migrate::{Guest, GuestError, GuestHarvester, GuestLog, GuestRegion, StateBlob};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Memory and dirty bitmaps, shared with the vCPU thread and the log.
struct Inner {
    map: Vec<Region>,
    /// One allocation per region: its words.
    mem: Vec<Box<[AtomicU64]>>,
    /// One bitmap per writable region (by index into `map`; read-only regions get none).
    dirty: Vec<Option<Box<[AtomicU64]>>>,
    logging: AtomicBool,
    writes: AtomicU64,
}

/// A software guest.
pub struct SoftGuest {
    inner: Arc<Inner>,
    vcpu: Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
    state: Mutex<Vec<StateBlob>>,
    /// Device-state versions this guest reads.
    pub reads_version: u32,
}

impl SoftGuest {
    /// A guest with `map`'s regions, zeroed.
    pub fn new(map: &[Region]) -> Arc<SoftGuest> {
        SoftGuest::reading(map, 1)
    }

    /// A guest that reads device state up to `version`.
    pub fn reading(map: &[Region], version: u32) -> Arc<SoftGuest> {
        let words = |r: &Region| (0..r.pages * 512).map(|_| AtomicU64::new(0)).collect();
        Arc::new(SoftGuest {
            inner: Arc::new(Inner {
                map: map.to_vec(),
                mem: map.iter().map(words).collect(),
                dirty: map
                    .iter()
                    .map(|r| {
                        (!r.read_only).then(|| {
                            (0..r.pages.div_ceil(64))
                                .map(|_| AtomicU64::new(0))
                                .collect()
                        })
                    })
                    .collect(),
                logging: AtomicBool::new(false),
                writes: AtomicU64::new(0),
            }),
            vcpu: Mutex::new(None),
            state: Mutex::new(Vec::new()),
            reads_version: version,
        })
    }

    /// Fills every page (read-only ones too) with words derived from `seed`.
    pub fn fill(&self, seed: u64) {
        for (i, m) in self.inner.mem.iter().enumerate() {
            for (j, w) in m.iter().enumerate() {
                w.store(
                    slat_migrate::splitmix(seed ^ ((i as u64) << 40) ^ j as u64),
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// Sets the device state `save_state` returns.
    pub fn set_state(&self, blobs: Vec<StateBlob>) {
        *self.state.lock().unwrap() = blobs;
    }

    /// The device state (restored, on a destination).
    pub fn state(&self) -> Vec<StateBlob> {
        self.state.lock().unwrap().clone()
    }

    /// Pages the vCPU wrote.
    pub fn writes(&self) -> u64 {
        self.inner.writes.load(Ordering::Relaxed)
    }
}

/// The vCPU: writes a new value into a pseudo-random writable page, then logs it (a write
/// logged after it lands may be missed by a harvest running meanwhile, and is reported by the
/// next; the final harvest runs after the vCPU stopped).
fn vcpu(inner: Arc<Inner>, stop: Arc<AtomicBool>) {
    let writable: Vec<usize> = (0..inner.map.len())
        .filter(|&i| !inner.map[i].read_only)
        .collect();
    let mut x = inner.writes.load(Ordering::Relaxed) ^ 0x5eed;
    while !stop.load(Ordering::Relaxed) {
        x = slat_migrate::splitmix(x);
        let r = writable[(x % writable.len() as u64) as usize];
        let page = (x >> 8) % inner.map[r].pages;
        inner.mem[r][(page * 512 + (x >> 40) % 512) as usize].store(x, Ordering::Relaxed);
        if inner.logging.load(Ordering::Relaxed) {
            let bits = inner.dirty[r].as_ref().unwrap();
            bits[(page / 64) as usize].fetch_or(1 << (page % 64), Ordering::Relaxed);
        }
        inner.writes.fetch_add(1, Ordering::Relaxed);
        if x % 64 == 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The software log: slots are the writable regions, in order.
struct SoftLog(Arc<Inner>);

impl DirtyLogSource for SoftLog {
    type Error = std::io::Error;
    fn slots(&self) -> Vec<SlotInfo> {
        let w = self.0.map.iter().filter(|r| !r.read_only);
        (0..)
            .zip(w)
            .map(|(id, r)| SlotInfo { id, pages: r.pages })
            .collect()
    }
    fn mode(&self) -> LogMode {
        LogMode::Get
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), std::io::Error> {
        let bits = self
            .0
            .dirty
            .iter()
            .flatten()
            .nth(slot)
            .ok_or(std::io::ErrorKind::NotFound)?;
        for (b, d) in bitmap.iter_mut().zip(bits.iter()) {
            *b = d.swap(0, Ordering::Relaxed);
        }
        Ok(())
    }
    fn clear_log(
        &mut self,
        _: usize,
        _: slat_addr::PageIndex,
        _: u64,
        _: &[u64],
    ) -> Result<(), std::io::Error> {
        Ok(())
    }
    fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, std::io::Error> {
        Ok(0)
    }
    fn reset_rings(&mut self) -> Result<u64, std::io::Error> {
        Ok(0)
    }
}

// SAFETY: each region's host range is the region's own boxed words (pages * 512 of them,
// 8-byte aligned), owned by `inner`, which the guest holds for as long as it lives and never
// reallocates; the vCPU thread accesses them only atomically, and `running` is true while
// the thread may run.
unsafe impl Guest for SoftGuest {
    fn kind(&self) -> &str {
        "soft"
    }
    fn regions(&self) -> Vec<GuestRegion> {
        let i = &self.inner;
        i.map
            .iter()
            .zip(&i.mem)
            .map(|(&region, m)| GuestRegion {
                region,
                host: Hva::from_ptr(m.as_ptr()),
            })
            .collect()
    }
    fn pause(&self) -> Result<(), GuestError> {
        if let Some((stop, h)) = self.vcpu.lock().unwrap().take() {
            stop.store(true, Ordering::Relaxed);
            h.join().map_err(|_| GuestError::NothingToResume)?;
        }
        Ok(())
    }
    fn resume(&self) -> Result<(), GuestError> {
        let mut v = self.vcpu.lock().unwrap();
        if v.is_none() {
            let stop = Arc::new(AtomicBool::new(false));
            let (i, s) = (self.inner.clone(), stop.clone());
            *v = Some((stop, std::thread::spawn(move || vcpu(i, s))));
        }
        Ok(())
    }
    fn running(&self) -> bool {
        self.vcpu.lock().unwrap().is_some()
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError> {
        self.inner.logging.store(on, Ordering::Relaxed);
        Ok(())
    }
    fn dirty_log(&self) -> Result<GuestHarvester, GuestError> {
        let log = Box::new(SoftLog(self.inner.clone()).map_err(GuestError::machine)) as GuestLog;
        Harvester::from_source(log).map_err(GuestError::harvest)
    }
    fn save_state(&self) -> Result<Vec<StateBlob>, GuestError> {
        Ok(self.state())
    }
    fn restore_state(&self, blobs: Vec<StateBlob>) -> Result<(), GuestError> {
        if let Some(b) = blobs.iter().find(|b| b.version > self.reads_version) {
            return Err(GuestError::State {
                id: b.id.clone(),
                version: b.version,
                why: format!("this VMM reads up to version {}", self.reads_version),
            });
        }
        self.set_state(blobs);
        Ok(())
    }
    fn activity(&self) -> Option<u64> {
        Some(self.writes())
    }
}

impl Drop for SoftGuest {
    fn drop(&mut self) {
        let _ = self.pause();
    }
}
