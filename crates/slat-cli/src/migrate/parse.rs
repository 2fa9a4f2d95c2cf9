//! Parsers of the migration commands' flag values.

use super::*;

/// Parses `--to` and `--listen` (QEMU's URI forms; a bare HOST:PORT is TCP).
pub(super) fn endpoint(s: &str) -> Result<Endpoint, transport::EndpointError> {
    s.parse()
}

/// Takes inherited descriptor `n` of `ep` (`fd:N`).
pub(super) fn claim_fd(ep: &Endpoint, n: i32) -> Result<std::os::fd::OwnedFd, RunError> {
    // SAFETY: `fd:N` names a descriptor this process inherited for the migration (N > 2, so
    // not stdin, stdout or stderr); nothing else in the process opens, uses or closes it.
    unsafe { transport::inherited_fd(n) }.map_err(|e| RunError::Fd(ep.clone(), e))
}

pub(super) fn inject(s: &str) -> Result<Inject, FlagError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| FlagError::NotKeyValue(s.into()))?;
    let n: u64 = v.parse().map_err(|_| FlagError::NotNumber(v.into()))?;
    match k {
        "cut-after" => Ok(Inject::CutAfter(n)),
        "corrupt-at" => Ok(Inject::CorruptAt(n)),
        "version" => u32::try_from(n)
            .map(Inject::Version)
            .map_err(|_| FlagError::Version(v.into())),
        _ => Err(FlagError::InjectKey(k.into())),
    }
}

/// A count with an optional k/m suffix (powers of 1000).
pub(super) fn count(s: &str) -> Result<u64, FlagError> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1_000),
        Some('m') => (&t[..t.len() - 1], 1_000_000),
        _ => (&t[..], 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| FlagError::NotCount(s.into()))
}

/// Parses `--dirty-rate` (a count, at most [`MAX_DIRTY_RATE`]).
pub(super) fn dirty_rate(s: &str) -> Result<u64, FlagError> {
    let n = count(s)?;
    if n > MAX_DIRTY_RATE {
        return Err(FlagError::DirtyRate(s.into()));
    }
    Ok(n)
}

/// Parses `--dirty-limit` (a count, 1 to the library's maximum).
pub(super) fn dirty_limit(s: &str) -> Result<u64, FlagError> {
    match count(s)? {
        n if n == 0 || n > slat_migrate::dirty_limit::MAX_LIMIT => {
            Err(FlagError::DirtyLimit(s.into()))
        }
        n => Ok(n),
    }
}

/// Parses a `--max-downtime` of `--vary` (milliseconds, at most [`MAX_DOWNTIME_MS`]).
pub(super) fn max_downtime(s: &str) -> Result<u64, FlagError> {
    match s.parse::<u64>() {
        Ok(n) if n <= MAX_DOWNTIME_MS => Ok(n),
        _ => Err(FlagError::MaxDowntime(s.into())),
    }
}
