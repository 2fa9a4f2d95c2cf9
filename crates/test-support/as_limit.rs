//! Shared by the `sizes` property tests of slat, slat-dirty, slat-machine and
//! slat-workload (included with `#[path]`; not a crate, so no library depends on it): re-running
//! a test in a child process under an address-space limit, so an aborting allocation is a
//! failure instead of the end of the test binary, and the sizes every constructor is fed.

#![allow(dead_code)] // each test file uses what it needs

use proptest::prelude::*;

/// Set in the child a test re-runs itself in.
const CHILD: &str = "SLAT_SIZES_CHILD";

/// In the parent: runs test `name` of module `module` (the caller's `module_path!()`) again in
/// a child limited to `limit` bytes of address space and fails unless it passes (a signal, such
/// as the SIGABRT of a failed infallible allocation, is a failure); returns true. In the
/// child: returns false (run the body).
pub fn rerun_under_as_limit(module: &str, name: &str, limit: u64) -> bool {
    rerun_under_as_limit_within(module, name, limit, None)
}

/// [`rerun_under_as_limit`], and with `seconds` the child is killed after that long (a hang
/// is a failure instead of a test binary that never ends).
pub fn rerun_under_as_limit_within(
    module: &str,
    name: &str,
    limit: u64,
    seconds: Option<u32>,
) -> bool {
    rerun(module, name, limit, seconds, None)
}

/// [`rerun_under_as_limit_within`] for a test that runs out of address space by starting
/// threads: in the child each new thread's stack is `stack` bytes (`RUST_MIN_STACK`). With
/// the default 2 MiB stacks the room left after the last stack that fits is under 64 KiB one
/// time in thirty or so, and then the thread that got it aborts the process when `std`
/// cannot map its signal stack (CI saw it); with 64 MiB stacks one time in thousands.
pub fn rerun_with_thread_stacks(
    module: &str,
    name: &str,
    limit: u64,
    seconds: Option<u32>,
    stack: u64,
) -> bool {
    rerun(module, name, limit, seconds, Some(stack))
}

fn rerun(module: &str, name: &str, limit: u64, seconds: Option<u32>, stack: Option<u64>) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    // libtest names a test by its module path without the crate (the test binary's) root.
    let name = match module.split_once("::") {
        Some((_, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    };
    let name = name.as_str();
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = match seconds {
        // coreutils' timeout: SIGTERM at the deadline, SIGKILL 5 s later; status 124.
        Some(s) => {
            let mut c = std::process::Command::new("timeout");
            c.args(["--kill-after=5", s.to_string().as_str(), "prlimit"]);
            c
        }
        None => std::process::Command::new("prlimit"),
    };
    let out = cmd
        .arg(format!("--as={limit}"))
        .arg("--")
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .envs(stack.map(|b| ("RUST_MIN_STACK", b.to_string())))
        .output()
        .expect("prlimit (util-linux) runs the child (under coreutils' timeout if asked)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} under RLIMIT_AS={limit}: {} (a signal is an abort; 124 a timeout)\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("1 passed"), "{name}: no test ran\n{stdout}");
    true
}

/// The threads this process has now (`/proc/self/task`): a test that makes thread starts
/// fail checks that none is left behind.
pub fn threads_of_this_process() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// 0, 1, the largest values, powers of two and their neighbours, and anything.
pub fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(isize::MAX as u64),
        (0u32..64, -1i64..=1).prop_map(|(k, d)| (1u64 << k).wrapping_add(d as u64)),
        any::<u64>(),
    ]
}
