//! What the vCPUs, the churn thread and the host share.

use super::*;

#[derive(Debug)]
pub(crate) enum Failure {
    /// A written page no harvest reported.
    Lost(String),
    /// A reported page nobody wrote.
    Spurious(String),
    /// Anything else: a vCPU exit or engine error that should not happen, a conflict, a leak.
    Other(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Lost(s) => write!(f, "LOST pages: {s}"),
            Failure::Spurious(s) => write!(f, "SPURIOUS pages: {s}"),
            Failure::Other(s) => write!(f, "{s}"),
        }
    }
}

pub(crate) fn other(what: impl fmt::Display) -> Failure {
    Failure::Other(what.to_string())
}

/// A write record: `b` and `c` are the epoch read before and after the write. Packed so that
/// `fetch_max` keeps the write that completed last (then the one that began last); 0 is "no
/// write".
pub(crate) fn pack(b: u32, c: u32) -> u64 {
    ((u64::from(c) + 1) << 32) | u64::from(b)
}

pub(crate) fn unpack(rec: u64) -> Option<(u32, u32)> {
    (rec != 0).then(|| (rec as u32, ((rec >> 32) - 1) as u32))
}

/// A move of checked slot `slot` from `from` to `to`, while the epoch went from `before` to
/// `after`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Move {
    pub(crate) slot: usize,
    pub(crate) before: u32,
    pub(crate) after: u32,
    pub(crate) from: u64,
    pub(crate) to: u64,
}

pub(crate) struct Shared {
    /// The host's event counter (see `Host::bump`).
    pub(crate) epoch: AtomicU32,
    pub(crate) stop: AtomicBool,
    /// Where each checked slot is now (the churn thread moves them).
    pub(crate) checked_gpa: [AtomicU64; CHECKED],
    pub(crate) aux_gpa: AtomicU64,
    /// Per checked page: the latest completed write (`pack`).
    pub(crate) rec: Vec<AtomicU64>,
    /// Per checked page: the latest write abandoned when the round stopped (`pack`, `c` the
    /// epoch it was given up at). Its fault may have logged the page already (a mark is
    /// made when W is granted, before the access retries, as in KVM) although the store never
    /// happened (the slot moved away first): a report of it is not spurious. It owes nothing.
    pub(crate) abandoned: Vec<AtomicU64>,
    /// Per vCPU: 1 + the checked page it is writing now (0: none).
    pub(crate) inflight: Vec<AtomicU64>,
    /// Per checked page: the guest address of its last write (for failure reports).
    pub(crate) wrote_at: Vec<AtomicU64>,
    /// Moves of the checked slots (for failure reports).
    pub(crate) moves: Mutex<Vec<Move>>,
    pub(crate) failure: Mutex<Option<String>>,
    /// Ring entries vCPUs harvested and reset on ring-full exits. Its lock is held across a
    /// whole harvest-and-reset (by the host and by exit handlers), so the host never takes an
    /// entry whose page is not re-protected yet, nor misses one a vCPU took from under it.
    pub(crate) reaped: Mutex<Vec<(SlotId, u64)>>,
}

impl Shared {
    pub(crate) fn new(vcpus: usize) -> Shared {
        Shared {
            epoch: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            checked_gpa: std::array::from_fn(|s| AtomicU64::new(checked_gpa(s, 0))),
            aux_gpa: AtomicU64::new(aux_gpa(0)),
            rec: (0..TOTAL).map(|_| AtomicU64::new(0)).collect(),
            abandoned: (0..TOTAL).map(|_| AtomicU64::new(0)).collect(),
            inflight: (0..vcpus).map(|_| AtomicU64::new(0)).collect(),
            wrote_at: (0..TOTAL).map(|_| AtomicU64::new(0)).collect(),
            moves: Mutex::new(Vec::new()),
            failure: Mutex::new(None),
            reaped: Mutex::new(Vec::new()),
        }
    }

    /// Records the first failure and stops everyone.
    pub(crate) fn fail(&self, msg: String) {
        lock(&self.failure).get_or_insert(msg);
        self.stop.store(true, Ordering::SeqCst);
    }

    pub(crate) fn failure(&self) -> Option<String> {
        lock(&self.failure).clone()
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// The word vCPU `v` writes in page `p` of `ram`.
pub(crate) fn word(ram: &GuestRam, p: u64, v: usize) -> &AtomicU64 {
    assert!(p < ram.len() / PAGE_SIZE && v < 512);
    let addr = ram.addr() + p * PAGE_SIZE + v as u64 * 8;
    // SAFETY: the address is inside the mapping (checked above), 8-byte aligned, and stays
    // mapped while `ram` is borrowed; vCPUs access guest memory only atomically.
    unsafe { AtomicU64::from_ptr(addr as *mut u64) }
}
