//! The transactional harvest over both machines (`MachineLog`), with failures injected at
//! every call a take makes, before and after the machine did the work: whatever failed and
//! whatever was aborted, the next good take reports exactly the pages the guest wrote since
//! the last commit (the memstress model says which), on the simulated machine and on KVM,
//! with several vCPUs, in all three log modes.

use slat_addr::PageIndex;
use slat_addr::PAGE_SIZE;
use slat_dirty::{DirtyLogSource, DirtySet, Harvester, LogMode as Mode, SlotInfo};
use slat_harness::MachineLog;
use slat_machine::{Machine, MachineConfig};
use slat_workload::dirty_oracle::LogMode;
use slat_workload::{PassParams, Pattern, RegionSpec, TestMachine};
use std::cell::Cell;
use std::collections::BTreeSet;
use std::rc::Rc;

const VCPUS: usize = 4;
const BYTES_PER_VCPU: u64 = 192 * PAGE_SIZE;
const SLOTS: usize = 3;

/// Where a [`Flaky`] source fails.
#[derive(Debug, Clone, Copy, Default)]
struct Plan {
    /// Fail the call with this number (1 = the next call); 0 = never.
    at: u64,
    /// Fail after the machine did the call's work (the log handed over, or re-armed) rather
    /// than before it.
    after: bool,
}

/// A source that fails one chosen call: the test's failure injection.
struct Flaky<S> {
    inner: S,
    plan: Rc<Cell<Plan>>,
    calls: u64,
    /// Calls that failed.
    failed: Rc<Cell<u64>>,
}

#[derive(Debug)]
enum FlakyError<E> {
    Injected,
    #[allow(dead_code)] // read through Debug when a test fails
    Inner(E),
}

impl<S: DirtyLogSource> Flaky<S> {
    /// Runs `op` as call number `calls + 1`, failing it as the plan says.
    fn call<T>(
        &mut self,
        op: impl FnOnce(&mut S) -> Result<T, S::Error>,
    ) -> Result<T, FlakyError<S::Error>> {
        self.calls += 1;
        let plan = self.plan.get();
        let fail = plan.at != 0 && self.calls == plan.at;
        if fail {
            self.failed.set(self.failed.get() + 1);
            if !plan.after {
                return Err(FlakyError::Injected);
            }
        }
        let r = op(&mut self.inner).map_err(FlakyError::Inner)?;
        if fail {
            return Err(FlakyError::Injected);
        }
        Ok(r)
    }
}

impl<S: DirtyLogSource> DirtyLogSource for Flaky<S> {
    type Error = FlakyError<S::Error>;

    fn slots(&self) -> Vec<SlotInfo> {
        self.inner.slots()
    }
    fn mode(&self) -> Mode {
        self.inner.mode()
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), Self::Error> {
        self.call(|s| s.get_log(slot, bitmap))
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), Self::Error> {
        self.call(|s| s.clear_log(slot, first, pages, bitmap))
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Self::Error> {
        self.call(|s| s.collect_ring(f))
    }
    fn reset_rings(&mut self) -> Result<u64, Self::Error> {
        self.call(|s| s.reset_rings())
    }
}

type Page = (usize, u64);

/// Pages (slot index, page in slot) one memstress pass with `params` writes.
fn written<M: TestMachine>(m: &M, params: PassParams) -> BTreeSet<Page> {
    let l = m.layout();
    let pps = m.pages_per_slot();
    let mut out = BTreeSet::new();
    for i in 0..l.vcpus {
        let (gpa, _, pages) = l.region(i);
        let first = (gpa - l.gpa) / PAGE_SIZE;
        for (page, write) in Pattern::new(params, i as u32, pages) {
            if write {
                let p = first + page;
                out.insert(((p / pps) as usize, p % pps));
            }
        }
    }
    out
}

fn pages_of<S: DirtyLogSource>(set: &DirtySet<'_, S>) -> BTreeSet<Page> {
    (0..set.slot_info().len())
        .flat_map(|i| {
            set.ranges(i)
                .flat_map(move |(f, n)| (f..f + n).map(move |p| (i, p)))
        })
        .collect()
}

fn pass(seed: u32) -> PassParams {
    PassParams {
        write_percent: if seed % 3 == 0 { 40 } else { 100 },
        random: seed % 2 == 1,
        seed,
        timed: false,
        touches: None,
    }
}

/// Calls one take makes in `mode` on a machine of `SLOTS` slots, at most.
fn calls_per_take(mode: Mode) -> u64 {
    match mode {
        Mode::Get => SLOTS as u64,
        Mode::ManualProtect { .. } => 2 * SLOTS as u64,
        Mode::Ring => 2,
    }
}

/// For every call of a take, failed before and after its work: a pass, the failing take (or,
/// past the last call, a take that is aborted), another pass, then a clean take that must
/// report exactly the pages both passes wrote.
fn aborts_lose_nothing<M: TestMachine>(m: &M) {
    let plan = Rc::new(Cell::new(Plan::default()));
    let failed = Rc::new(Cell::new(0));
    let source = Flaky {
        inner: MachineLog::new(m),
        plan: plan.clone(),
        calls: 0,
        failed: failed.clone(),
    };
    let mut h = Harvester::from_source(source).expect("harvester");
    m.set_dirty_logging(true).expect("logging on");
    // Start clean (INITIALLY_SET's bits included).
    h.take().expect("first take").commit();
    let mut seed = 1;
    let mut owed = BTreeSet::new();
    for at in 1..=calls_per_take(h.mode()) + 1 {
        for after in [false, true] {
            for _ in 0..2 {
                m.run_pass(pass(seed)).expect("pass");
                owed.extend(written(m, pass(seed)));
                seed += 1;
            }
            let calls = h.source().calls;
            plan.set(Plan {
                at: calls + at,
                after,
            });
            let failures = failed.get();
            match h.take() {
                Err(FlakyError::Injected) => assert_eq!(failed.get(), failures + 1),
                Err(e) => panic!("the machine failed: {e:?}"),
                // Past the take's last call: the copy "fails" instead.
                Ok(set) => {
                    assert_eq!(
                        failed.get(),
                        failures,
                        "call {at} failed, yet the take worked"
                    );
                    set.abort();
                }
            }
            plan.set(Plan::default());
            m.run_pass(pass(seed)).expect("pass");
            owed.extend(written(m, pass(seed)));
            seed += 1;
            let set = h.take().expect("clean take");
            let got = pages_of(&set);
            assert_eq!(
                got.len(),
                owed.len(),
                "failure at call {at} (after: {after}): {} pages missing, {} extra",
                owed.difference(&got).count(),
                got.difference(&owed).count()
            );
            assert_eq!(got, owed, "failure at call {at} (after: {after})");
            set.commit();
            owed.clear();
        }
    }
    // Everything committed: nothing is owed, and a take with no writes is empty.
    assert_eq!(h.owed_pages(), 0);
    let set = h.take().expect("take");
    assert!(set.is_empty(), "{} pages after a commit", set.pages());
    set.commit();
}

/// A partial commit (`commit_pages`, as migration's acknowledgements do it) then an abort:
/// only the uncommitted pages come back, with what was written since.
fn partial_commit_then_abort<M: TestMachine>(m: &M) {
    let mut h = MachineLog::harvester(m).expect("harvester");
    m.set_dirty_logging(true).expect("logging on");
    h.take().expect("first take").commit();
    m.run_pass(pass(7)).expect("pass");
    let mut set = h.take().expect("take");
    let all = pages_of(&set);
    assert_eq!(all, written(m, pass(7)));
    let committed: BTreeSet<Page> = all.iter().copied().step_by(2).collect();
    for &(i, p) in &committed {
        set.commit_pages(i, PageIndex::new(p), 1)
            .expect("commit_pages");
    }
    assert!(
        set.commit_pages(SLOTS, PageIndex::ZERO, 1).is_err(),
        "no such slot"
    );
    assert!(
        set.commit_pages(0, PageIndex::new(m.pages_per_slot()), 1)
            .is_err(),
        "past the slot"
    );
    set.abort();
    m.run_pass(pass(8)).expect("pass");
    let mut want: BTreeSet<Page> = all.difference(&committed).copied().collect();
    want.extend(written(m, pass(8)));
    let set = h.take().expect("take");
    assert_eq!(pages_of(&set), want);
    set.commit();
}

fn region(mode: LogMode) -> RegionSpec {
    RegionSpec {
        vcpus: VCPUS,
        bytes_per_vcpu: BYTES_PER_VCPU,
        slots: SLOTS,
        dirty: mode.dirty_config(4096),
        ..RegionSpec::default()
    }
}

fn sim(mode: LogMode) -> Machine<slat::Ept> {
    Machine::<slat::Ept>::new(MachineConfig {
        region: region(mode),
        ..MachineConfig::default()
    })
    .expect("machine")
}

fn kvm(mode: LogMode) -> Option<slat_kvm::KvmMachine> {
    match slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
        region: region(mode),
        ..slat_kvm::KvmConfig::default()
    }) {
        Ok(m) => Some(m),
        Err(e @ slat_kvm::KvmError::DeviceUnavailable { .. }) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            None
        }
        Err(e) => panic!("cannot build the KVM machine: {e}"),
    }
}

#[test]
fn sim_aborts_lose_nothing() {
    for mode in LogMode::ALL {
        aborts_lose_nothing(&sim(mode));
    }
}

#[test]
fn kvm_aborts_lose_nothing() {
    for mode in LogMode::ALL {
        if let Some(m) = kvm(mode) {
            aborts_lose_nothing(&m);
        }
    }
}

#[test]
fn sim_partial_commit_then_abort() {
    for mode in LogMode::ALL {
        partial_commit_then_abort(&sim(mode));
    }
}

#[test]
fn kvm_partial_commit_then_abort() {
    for mode in LogMode::ALL {
        if let Some(m) = kvm(mode) {
            partial_commit_then_abort(&m);
        }
    }
}
