//! dirty-log-perf's `--vary` table: the vCPU count, the page-table format, the engine's
//! switches and the harvest.

use super::DirtyLogPerfArgs;
use crate::args::{clear_chunk, keys, ClearChunk, LogKind};
use crate::driver::vary::{pick, Key, Values};
use crate::vary_key;

/// The keys that apply on `--backend kvm` too (the others set the engine, which kvm does not
/// run).
pub const BOTH_MACHINES: &[&str] = &["vcpus", "log", "clear-chunk"];

/// Examples under the keys in `--help`.
pub const EXAMPLES: &str = "--repeat N runs every combination N times. On --backend kvm only vcpus, log and clear-chunk apply. Lockless \
write-protect through the reverse map, per harvest: --concurrent --vary wrprot=walk,rmap,rmap-lockless \
--vary log=get,clear,ring --vary vcpus=1,2. Fast page fault and the MMU lock: --vary vcpus=1,2 \
--vary fast-pf=on,off --vary mmu-lock=rwlock,mutex; the two GET_DIRTY_LOG variants: -g --vary \
get-dirty-log=xchg,switch; both page-table formats: --vary format=ept,stage2.";

/// `log=get|clear|clear:N|ring`.
fn log(v: &str) -> Result<(LogKind, Option<ClearChunk>), String> {
    match v.split_once(':') {
        Some(("clear", n)) => Ok((LogKind::Clear, Some(clear_chunk(n)?))),
        Some(_) => Err(format!("`{v}`: only clear takes a chunk size (clear:N)")),
        None => Ok((pick(v)?, None)),
    }
}

fn set_log(a: &mut DirtyLogPerfArgs, v: &str) -> Result<(), String> {
    let (kind, chunk) = log(v)?;
    a.log.set_kind(kind);
    if let Some(c) = chunk {
        a.log.clear_chunk = c;
    }
    Ok(())
}

crate::vary_flags!(DirtyLogPerfArgs, dirty);

/// The table.
pub const VARY: &[Key<DirtyLogPerfArgs>] = &[
    keys::vcpus(),
    keys::format(),
    keys::fast_pf(),
    keys::mmu_lock(),
    keys::ad_bits(),
    keys::cmo(),
    keys::get_log(),
    keys::tracking(),
    keys::eager_split(),
    keys::recover(),
    keys::rebuild(),
    keys::wrprot(),
    vary_key!(
        "log",
        "-g, --dirty-ring, manual protect",
        Values::Text(
            "get, clear, clear:N (CLEAR in chunks of N pages, a power of two from 64), ring",
            |v| log(v).map(drop)
        ),
        |a, v| set_log(a, v)?
    ),
    vary_key!(
        "clear-chunk",
        "--clear-chunk",
        Values::Text("a power of two from 64, or slot", |v| clear_chunk(v)
            .map(drop)),
        |a, v| a.log.clear_chunk = clear_chunk(v)?
    ),
];
