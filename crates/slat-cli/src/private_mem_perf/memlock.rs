//! memfd_secret memory is locked memory: mapping it counts against `RLIMIT_MEMLOCK` unless the
//! process holds `CAP_IPC_LOCK`. Checked before the run, and the soft limit raised when the
//! hard limit allows, so a fill fails with a line saying what to change rather than `EAGAIN`.

use serde::Serialize;

/// `CAP_IPC_LOCK`'s bit in the capability sets.
const CAP_IPC_LOCK: u32 = 14;

/// What was found and done about the limit.
#[derive(Debug, Clone, Serialize)]
pub struct Memlock {
    /// Bytes of secret memory mapped at once (every thread's share).
    pub needed_bytes: u64,
    /// The soft limit before the run (`null`: unlimited).
    pub soft_before: Option<u64>,
    /// The soft limit the run had (`null`: unlimited).
    pub soft_after: Option<u64>,
    /// The hard limit (`null`: unlimited).
    pub hard: Option<u64>,
    /// The process holds `CAP_IPC_LOCK` (the limit does not apply); `null` if unreadable.
    pub cap_ipc_lock: Option<bool>,
    /// `within-limit`, `bypassed-by-cap-ipc-lock` or `raised-soft-limit`.
    pub action: &'static str,
}

fn limit(v: libc::rlim_t) -> Option<u64> {
    (v != libc::RLIM_INFINITY).then_some(v)
}

/// The effective capability set's `CAP_IPC_LOCK` bit, from `/proc/self/status`.
fn has_ipc_lock() -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    Some(caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Makes room for `needed` bytes of secret memory, or says why it cannot.
pub fn prepare(needed: u64) -> Result<Memlock, String> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct this function owns.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return Err(format!(
            "getrlimit(RLIMIT_MEMLOCK) failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let (soft, hard) = (limit(rl.rlim_cur), limit(rl.rlim_max));
    let cap = has_ipc_lock();
    let m = |action, soft_after| Memlock {
        needed_bytes: needed,
        soft_before: soft,
        soft_after,
        hard,
        cap_ipc_lock: cap,
        action,
    };
    if soft.is_none_or(|s| s >= needed) {
        return Ok(m("within-limit", soft));
    }
    if cap == Some(true) {
        return Ok(m("bypassed-by-cap-ipc-lock", soft));
    }
    if hard.is_none_or(|h| h >= needed) {
        let raised = libc::rlimit {
            rlim_cur: needed,
            rlim_max: rl.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit from a struct this function owns.
        if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raised) } == 0 {
            return Ok(m("raised-soft-limit", Some(needed)));
        }
    }
    Err(format!(
        "memfd_secret memory is locked memory: {needed} bytes are needed at once, RLIMIT_MEMLOCK is {} (hard {}) and this process has no CAP_IPC_LOCK; raise it (`ulimit -l`) or use a smaller -v/-b",
        show(soft),
        show(hard)
    ))
}

fn show(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), |b| format!("{b} bytes"))
}
