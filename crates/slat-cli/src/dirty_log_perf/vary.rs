//! dirty-log-perf's `--vary` table: the vCPU count, the page-table format, the engine's
//! switches and the harvest.

use super::DirtyLogPerfArgs;
use crate::args::{clear_chunk, ClearChunk, FormatArg, LogKind, Switch};
use crate::driver::vary::{count_in, engine, names, pick, variants, Key, Values};
use crate::vary_key;
use slat::{
    CmoPolicy, DirtyTrack, GetLogVariant, MmuLockKind, RebuildOrder, RecoverVariant, WrprotVariant,
};

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

/// The table.
pub const VARY: &[Key<DirtyLogPerfArgs>] = &[
    vary_key!(
        "vcpus",
        "-v",
        Values::Text("1-512", |v| count_in(v, 1, 512).map(drop)),
        |a, v| { a.work.vcpus = count_in(v, 1, 512)? as u32 }
    ),
    vary_key!(
        "format",
        "--format",
        Values::OneOf(names::<FormatArg>),
        |a, v| { a.machine.format = pick(v)? }
    ),
    vary_key!(
        "fast-pf",
        "--fast-pf",
        Values::OneOf(names::<Switch>),
        |a, v| { a.machine.fast_pf = pick(v)? }
    ),
    vary_key!(
        "mmu-lock",
        "--mmu-lock",
        Values::OneOf(variants::<MmuLockKind>),
        |a, v| { a.machine.mmu_lock = engine(v)? }
    ),
    vary_key!(
        "ad-bits",
        "--ad-bits",
        Values::OneOf(names::<Switch>),
        |a, v| { a.machine.ad_bits = pick(v)? }
    ),
    vary_key!(
        "cmo",
        "--cmo",
        Values::OneOf(variants::<CmoPolicy>),
        |a, v| { a.machine.cmo = engine(v)? }
    ),
    vary_key!(
        "get-dirty-log",
        "--get-dirty-log",
        Values::OneOf(variants::<GetLogVariant>),
        |a, v| { a.dirty.get_log = engine(v)? }
    ),
    vary_key!(
        "dirty-tracking",
        "--dirty-tracking",
        Values::OneOf(variants::<DirtyTrack>),
        |a, v| { a.dirty.tracking = engine(v)? }
    ),
    vary_key!(
        "eager-split",
        "--eager-split",
        Values::OneOf(names::<Switch>),
        |a, v| { a.dirty.eager_split = pick(v)? }
    ),
    vary_key!(
        "recover",
        "--recover",
        Values::OneOf(variants::<RecoverVariant>),
        |a, v| { a.dirty.recover = engine(v)? }
    ),
    vary_key!(
        "rebuild",
        "--rebuild",
        Values::OneOf(variants::<RebuildOrder>),
        |a, v| { a.dirty.rebuild = engine(v)? }
    ),
    vary_key!(
        "wrprot",
        "--wrprot",
        Values::OneOf(variants::<WrprotVariant>),
        |a, v| { a.dirty.wrprot = engine(v)? }
    ),
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
