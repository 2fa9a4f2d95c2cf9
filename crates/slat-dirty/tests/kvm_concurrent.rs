//! Harvests while the guest writes, on another thread, all the time: whatever the
//! interleaving, a replica that copies only the pages of committed sets (some sets aborted)
//! ends equal to guest memory once the guest stops and a last set is committed. This is the
//! check of "re-arm before copying": a write landing between a copy and a late re-arm would
//! be in neither.

mod common;

use common::{read_word, set_halt, Mapping, Setup, TinyVm, MAX_LOOP_LIST, SLOT_PAGES};
use kvm_ioctls::VcpuExit;
use std::time::{Duration, Instant};

fn concurrent(setup: Setup, takes: u32) {
    let Some(mut vm) = TinyVm::new(setup) else {
        return;
    };
    let pages: Vec<(usize, u64)> = (0..SLOT_PAGES[0] - 80)
        .map(|p| (0, p))
        .chain((0..SLOT_PAGES[1]).map(|p| (1, p)))
        .take(MAX_LOOP_LIST)
        .collect();
    vm.load_looping_writer(&pages);
    let mut replica: Vec<Vec<u64>> = SLOT_PAGES.iter().map(|&n| vec![0; n as usize]).collect();
    let control = vm.layout.control;
    let TinyVm {
        harvester,
        vcpu,
        low,
        slots,
        ..
    } = &mut vm;
    std::thread::scope(|sc| {
        // The writer leaves the guest only at its `out`, once halted.
        let guest = sc.spawn(move || match vcpu.run().expect("KVM_RUN") {
            VcpuExit::IoOut(0x88, _) => {}
            e => panic!("unexpected exit {e:?}"),
        });
        // Harvest only once the guest is writing, and for a while.
        wait_for_first_write(&slots[0]);
        let start = Instant::now();
        let mut busy = 0u32;
        let mut seen = 0u64;
        let mut t = 0;
        // Harvest while the guest runs; after a while ask it to stop, and keep harvesting
        // until it has, so its last writes too race with copies and commits.
        let mut halted = false;
        loop {
            if !halted && t >= takes && start.elapsed() >= Duration::from_millis(300) {
                set_halt(low, control);
                halted = true;
            }
            if halted && guest.is_finished() {
                break;
            }
            t += 1;
            let set = harvester.take().unwrap();
            busy += u32::from(!set.is_empty());
            seen += set.pages();
            let mut staged = replica.clone();
            copy_set(&set, slots, &mut staged);
            // A slow copy (a network send, say): the guest keeps writing meanwhile, also to
            // pages already copied.
            std::thread::sleep(Duration::from_micros(50));
            if t % 3 == 0 {
                set.abort();
            } else {
                set.commit();
                replica = staged;
            }
        }
        guest.join().unwrap();
        eprintln!("{setup:?}: {busy} of {t} takes found dirty pages, {seen} pages in all");
        // The guest really ran during the harvests (not only before or after them).
        assert!(busy >= 10, "{busy} of {t} takes saw writes");
    });
    // The guest is stopped: one last harvest covers everything still owed.
    let set = vm.harvester.take().unwrap();
    copy_set(&set, &vm.slots, &mut replica);
    set.commit();
    let written = check_replica(setup, &replica, &vm.slots);
    assert_eq!(written, pages.len() as u64, "every listed page was written");
    eprintln!(
        "{setup:?}: the guest made {} passes",
        read_word(&vm.slots[0], 0)
    );
}

/// Waits until the guest has written page 0 of `slot` (its pass counter): it is running.
fn wait_for_first_write(slot: &Mapping) {
    let start = Instant::now();
    while read_word(slot, 0) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the guest never wrote"
        );
        std::thread::yield_now();
    }
}

/// Copies the first word of every page `set` reports from `slots` into `replica`.
fn copy_set(set: &slat_dirty::DirtySet<'_>, slots: &[Mapping], replica: &mut [Vec<u64>]) {
    for (i, m) in slots.iter().enumerate() {
        for (first, n) in set.ranges(i) {
            for p in first..first + n {
                replica[i][p as usize] = read_word(m, p);
            }
        }
    }
}

/// Checks that `replica` equals guest memory; returns how many pages were ever written.
fn check_replica(setup: Setup, replica: &[Vec<u64>], slots: &[Mapping]) -> u64 {
    let mut written = 0;
    for (i, m) in slots.iter().enumerate() {
        for p in 0..SLOT_PAGES[i] {
            let now = read_word(m, p);
            written += u64::from(now != 0);
            assert_eq!(
                replica[i][p as usize], now,
                "{setup:?}: slot {i} page {p} lost"
            );
        }
    }
    written
}

#[test]
fn get_while_the_guest_writes() {
    concurrent(Setup::Get, 300);
}

#[test]
fn manual_protect_while_the_guest_writes() {
    concurrent(
        Setup::Manual {
            chunk_pages: 64,
            initially_set: false,
        },
        300,
    );
}

#[test]
fn ring_while_the_guest_writes() {
    concurrent(Setup::Ring { entries: 65536 }, 300);
}
