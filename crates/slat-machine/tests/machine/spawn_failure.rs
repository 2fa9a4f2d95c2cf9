//! A thread the operating system refuses ends the call with a typed error, and leaves no
//! thread behind: the ones already started are released and joined. Forced in a child under
//! an address-space limit, where thousands of 64 MiB stacks cannot all be mapped.

use slat_machine::page_table_stage::{native_stage_baseline, Stage, StageParams};
use slat_machine::MachineError;
use slat_workload::{Backing, GuestRam};

use crate::sizes::as_limit::{rerun_with_thread_stacks, threads_of_this_process};
use crate::sizes::THREAD_STACK;

const AS_LIMIT: u64 = 2 << 30;

/// The native stage's threads waited at a start barrier of every thread and the host: when
/// the k-th could not start, `thread::scope`'s spawn panicked and the scope then joined the k
/// waiting for ever (a hang, here a timeout). Now the barrier is abandoned, they return, and
/// the error says why.
#[test]
fn a_native_stage_whose_threads_cannot_all_start_fails_and_leaves_no_thread() {
    if rerun_with_thread_stacks(
        module_path!(),
        "a_native_stage_whose_threads_cannot_all_start_fails_and_leaves_no_thread",
        AS_LIMIT,
        Some(120),
        THREAD_STACK,
    ) {
        return;
    }
    let ram = GuestRam::new(Backing::Anonymous, 1 << 20, false).expect("1 MiB of guest RAM");
    let p = StageParams {
        stage: Stage::CreateMappings,
        large_page: 4096,
        bytes: 1 << 20,
    };
    let before = threads_of_this_process();
    // 4096 stacks of 64 MiB: the spawns fail part-way under the 2 GiB limit.
    for round in 0..3 {
        let r = native_stage_baseline(&ram, p, 4096);
        assert!(
            matches!(r, Err(MachineError::Thread(_))),
            "round {round}: {r:?}"
        );
        assert_eq!(threads_of_this_process(), before, "round {round}");
    }
    native_stage_baseline(&ram, p, 2).expect("2 threads after the failed starts");
}
