//! Parsers of the migration commands' flag values (clap prints a refusal on one line and
//! exits with status 2).

use super::{failed, Inject, MAX_DIRTY_RATE, MAX_DOWNTIME_MS};
use crate::error::CliResult;
use slat_migrate::transport::{self, Endpoint};

/// Takes inherited descriptor `n` of `ep` (`fd:N`).
pub(super) fn claim_fd(ep: &Endpoint, n: i32) -> CliResult<std::os::fd::OwnedFd> {
    // SAFETY: `fd:N` names a descriptor this process inherited for the migration (N > 2, so
    // not stdin, stdout or stderr); nothing else in the process opens, uses or closes it.
    unsafe { transport::inherited_fd(n) }.map_err(|e| failed(format!("{ep}: {e}")))
}

/// Parses `--inject KEY=N`.
pub(super) fn inject(s: &str) -> Result<Inject, String> {
    let (k, v) = (s.split_once('=')).ok_or_else(|| format!("`{s}`: expected KEY=VALUE"))?;
    let n: u64 = v.parse().map_err(|_| format!("`{v}` is not a number"))?;
    match k {
        "cut-after" => Ok(Inject::CutAfter(n)),
        "corrupt-at" => Ok(Inject::CorruptAt(n)),
        "version" => (u32::try_from(n).map(Inject::Version))
            .map_err(|_| format!("`{v}` is not a 32-bit version")),
        _ => Err(format!("`{k}`: one of cut-after, corrupt-at, version")),
    }
}

/// Parses `--vary postcopy-after=N`: pre-copy rounds before post-copy (0-1000), or `off`.
pub(super) fn postcopy_after(s: &str) -> Result<Option<u32>, String> {
    match s {
        "off" => Ok(None),
        _ => (s.parse::<u32>().ok().filter(|&n| n <= 1000).map(Some))
            .ok_or_else(|| format!("`{s}`: rounds from 0 to 1000, or off")),
    }
}

/// A count with an optional k/m suffix (powers of 1000), from `lo` to `hi`; `range` says
/// which in the refusal.
fn count(s: &str, lo: u64, hi: u64, range: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1_000),
        Some('m') => (&t[..t.len() - 1], 1_000_000),
        _ => (&t[..], 1),
    };
    let n = (num.parse::<u64>().ok().and_then(|n| n.checked_mul(mul)))
        .ok_or_else(|| format!("`{s}` is not a count (e.g. 5000, 20k, 1m)"))?;
    match (lo..=hi).contains(&n) {
        true => Ok(n),
        false => Err(format!("`{s}`: {range}")),
    }
}

/// Parses `--dirty-rate` (0 is unlimited).
pub(super) fn dirty_rate(s: &str) -> Result<u64, String> {
    let range = format!("at most {MAX_DIRTY_RATE} writes per second per vCPU (1000m)");
    count(s, 0, MAX_DIRTY_RATE, &range)
}

/// Parses `--dirty-limit` (1 to the library's maximum).
pub(super) fn dirty_limit(s: &str) -> Result<u64, String> {
    let hi = slat_migrate::dirty_limit::MAX_LIMIT;
    let range = format!("a dirty limit is 1 to {hi} pages per second per vCPU (1000m)");
    count(s, 1, hi, &range)
}

/// Parses a `--max-downtime` of `--vary` (milliseconds).
pub(super) fn max_downtime(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n <= MAX_DOWNTIME_MS => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of milliseconds from 0 to {MAX_DOWNTIME_MS}"
        )),
    }
}

/// Parses an auto-converge throttle percentage of `--vary` (1-99).
pub(super) fn throttle_percent(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n) if (1..=99).contains(&n) => Ok(n),
        _ => Err(format!("`{s}` is not a throttle percentage from 1 to 99")),
    }
}

/// `--delta-cache`: a size from one page to 1 TiB.
pub fn delta_cache(v: &str) -> Result<u64, String> {
    match slat_workload::parse_size(v) {
        Ok(n) if (4096..=1 << 40).contains(&n) => Ok(n),
        Ok(_) => Err(format!("`{v}`: a delta cache of 4K to 1T")),
        Err(e) => Err(e.to_string()),
    }
}

/// `--connections`: 1 to [`slat_migrate::stream::MAX_STREAMS`] page streams.
pub fn connections(v: &str) -> Result<u32, String> {
    let max = slat_migrate::stream::MAX_STREAMS;
    match v.parse::<u32>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("`{v}`: page streams, 1 to {max}")),
    }
}
