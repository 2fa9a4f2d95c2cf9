//! Loom models of the dirty bitmap's summary levels (`crates/slat/src/dirty/bitmap.rs`) on
//! the real engine: a vCPU's fast-path write fix marks page [`P`] (its word, then the summary
//! bits above it, including the skip of a summary bit it finds set) while the host harvests —
//! GET by exchange or by the bitmap switch, or manual protection's CLEAR of a neighbour
//! [`Q`] whose word or summary word it shares. No mark may be lost: when both are done, the
//! write is in the harvest or still marked where the next harvest, which reads only what the
//! summary names, finds it.
//! `RUSTFLAGS="--cfg loom" cargo test -p slat --test loom_summary --release`.
#![cfg(loom)]

#[path = "common/loom_thread.rs"]
mod thread;
use slat::dirty::MANUAL_PROTECT_ENABLE;
use slat::{Access, Ept, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, Vm, VmConfig};
use slat_addr::Gpa;
use std::sync::Arc;

const GPA: u64 = 1 << 30;
/// 66 bitmap words: two summary levels (2 words, then 1).
const PAGES: u64 = 66 * 64;
/// Word 64: bit 0 of level-1 word 1, under bit 1 of the top word.
const P: u64 = 64 * 64;
/// In [`P`]'s word: its summary bits are [`P`]'s.
const Q_SAME_WORD: u64 = P + 1;
/// Word 65: a sibling of [`P`]'s word under the same level-1 word.
const Q_SIBLING: u64 = P + 64;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    // Enabling logging walks the slot's leaf tables: many loads before the race.
    b.max_branches = 1_000_000;
    // The model's own thread has loom's default stack: run the body on one with more room.
    let f = std::sync::Arc::new(f);
    b.check(move || {
        let f = std::sync::Arc::clone(&f);
        thread::spawn(move || f()).join().expect("model body");
    });
}

fn write(gfn_off: u64, present: bool) -> Fault {
    Fault {
        private: false,
        gpa: Gpa::new(GPA + gfn_off * 4096),
        access: Access::Write,
        present,
    }
}

/// A VM whose logged slot of [`PAGES`] has [`P`] mapped and write-protected (its next write
/// takes the fast path) and `q` marked by a host write; the vCPU, ready to write [`P`].
fn vm_with(config: VmConfig, manual: bool, q: u64) -> (Arc<Vm<Ept>>, slat::Vcpu<Ept>) {
    let vm = Vm::<Ept>::new(config);
    if manual {
        vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE)
            .unwrap();
    }
    let buf = HostBuffer::new(PAGES * 4096, 4096).expect("allocate the slot's memory");
    let host = HostRange::new(Arc::new(buf)).expect("host range");
    vm.add_memslot(1, Gpa::new(GPA), PAGES * 4096, host, MemslotFlags::empty())
        .unwrap();
    let mut v = vm.create_vcpu(0);
    assert_eq!(v.handle_fault(write(P, false)), FaultOutcome::Fixed);
    vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
        .unwrap();
    assert!(vm.mark_page_dirty(Gpa::new(GPA + q * 4096)).unwrap());
    (vm, v)
}

/// The vCPU's write to [`P`] on its own thread; drops the vCPU (which holds its VM).
fn spawn_write(mut v: slat::Vcpu<Ept>) -> thread::JoinHandle<FaultOutcome> {
    thread::spawn(move || {
        let o = v.handle_fault(write(P, true));
        drop(v);
        o
    })
}

fn pages(words: &[(usize, u64)]) -> Vec<u64> {
    let mut v = Vec::new();
    for &(i, mut w) in words {
        while w != 0 {
            v.push(64 * i as u64 + u64::from(w.trailing_zeros()));
            w &= w - 1;
        }
    }
    v
}

/// GET without manual protection against the write fix: [`P`] is in this harvest or the next.
fn get_vs_write(config: VmConfig, q: u64) {
    let (vm, v) = vm_with(config, false, q);
    let writer = spawn_write(v);
    let mut first = Vec::new();
    vm.get_dirty_log_sparse(1, &mut first).unwrap();
    let o = writer.join().unwrap();
    assert_eq!(o, FaultOutcome::FixedFast);
    let mut second = Vec::new();
    vm.get_dirty_log_sparse(1, &mut second).unwrap();
    let (first, second) = (pages(&first), pages(&second));
    assert!(
        first.contains(&q),
        "the host's mark of {q} was not harvested"
    );
    assert!(
        first.contains(&P) || second.contains(&P),
        "the write fix was reported by neither harvest: {first:?} {second:?}"
    );
}

#[test]
fn a_mark_sharing_the_word_survives_a_get() {
    model(|| get_vs_write(VmConfig::default(), Q_SAME_WORD));
}

#[test]
fn a_mark_sharing_the_summary_word_survives_a_get() {
    model(|| get_vs_write(VmConfig::default(), Q_SIBLING));
}

#[test]
fn a_mark_survives_a_switch_get() {
    model(|| {
        let config = VmConfig {
            get_log: slat::GetLogVariant::Switch,
            ..VmConfig::default()
        };
        get_vs_write(config, Q_SIBLING)
    });
}

/// Manual protection: CLEAR of `q` alone (which empties its word, or its summary word, unless
/// the write's mark got there first) against the write fix: afterwards [`P`] must still be
/// marked, and reachable from the summary.
fn clear_vs_write(q: u64) {
    let (vm, v) = vm_with(VmConfig::default(), true, q);
    let writer = spawn_write(v);
    let cleared = vm
        .clear_dirty_log_sparse(1, &[((q / 64) as usize, 1 << (q % 64))])
        .unwrap();
    let o = writer.join().unwrap();
    assert_eq!(o, FaultOutcome::FixedFast);
    assert_eq!(cleared, 1);
    let mut after = Vec::new();
    vm.get_dirty_log_sparse(1, &mut after).unwrap();
    assert_eq!(
        pages(&after),
        vec![P],
        "a mark hidden by CLEAR's summary update"
    );
}

#[test]
fn a_mark_sharing_the_word_survives_a_clear() {
    model(|| clear_vs_write(Q_SAME_WORD));
}

#[test]
fn a_mark_sharing_the_summary_word_survives_a_clear() {
    model(|| clear_vs_write(Q_SIBLING));
}
