//! `--vary KEY=V1,V2,...`: run one benchmark over the cross product of variant settings in one
//! process and print one table, so a seed's before/after comparison is one command and one
//! run on one machine state, not numbers gathered from separate invocations.

use crate::args::{
    clear_chunk, ClearChunk, DirtyArgs, FormatArg, LogArgs, LogKind, MachineArgs, Switch, Variant,
};
use clap::ValueEnum;
use slat::{
    CmoPolicy, DirtyTrack, GetLogVariant, MmuLockKind, RebuildOrder, RecoverVariant, WrprotVariant,
};

/// A setting a sweep may vary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// `-v`.
    Vcpus,
    /// `--format`.
    Format,
    /// `--fast-pf`.
    FastPf,
    /// `--mmu-lock`.
    MmuLock,
    /// `--ad-bits`.
    AdBits,
    /// `--cmo`.
    Cmo,
    /// `--get-dirty-log`.
    GetDirtyLog,
    /// `--dirty-tracking`.
    DirtyTracking,
    /// `--eager-split`.
    EagerSplit,
    /// `--recover`.
    Recover,
    /// `--rebuild`.
    Rebuild,
    /// `--wrprot`.
    Wrprot,
    /// The harvest: `-g` (get), manual protect (clear), `--dirty-ring` (ring).
    Log,
    /// `--clear-chunk`.
    ClearChunk,
}

const KEYS: [(&str, Key); 14] = [
    ("vcpus", Key::Vcpus),
    ("format", Key::Format),
    ("fast-pf", Key::FastPf),
    ("mmu-lock", Key::MmuLock),
    ("ad-bits", Key::AdBits),
    ("cmo", Key::Cmo),
    ("get-dirty-log", Key::GetDirtyLog),
    ("dirty-tracking", Key::DirtyTracking),
    ("eager-split", Key::EagerSplit),
    ("recover", Key::Recover),
    ("rebuild", Key::Rebuild),
    ("wrprot", Key::Wrprot),
    ("log", Key::Log),
    ("clear-chunk", Key::ClearChunk),
];

impl Key {
    /// The flag name, as written in `--vary`.
    pub fn name(self) -> &'static str {
        KEYS.iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }

    /// Whether the key sets an engine switch (refused with `--backend kvm`, which does not run
    /// the engine); the vCPU count and the harvest apply to both machines.
    pub fn engine_only(self) -> bool {
        !matches!(self, Key::Vcpus | Key::Log | Key::ClearChunk)
    }
}

/// One value of a varied setting, parsed once when the flag is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// `vcpus=N`.
    Vcpus(u32),
    /// `format=...`.
    Format(FormatArg),
    /// `fast-pf=...`.
    FastPf(Switch),
    /// `mmu-lock=...`.
    MmuLock(MmuLockKind),
    /// `ad-bits=...`.
    AdBits(Switch),
    /// `cmo=...`.
    Cmo(CmoPolicy),
    /// `get-dirty-log=...`.
    GetDirtyLog(GetLogVariant),
    /// `dirty-tracking=...`.
    DirtyTracking(DirtyTrack),
    /// `eager-split=...`.
    EagerSplit(Switch),
    /// `recover=...`.
    Recover(RecoverVariant),
    /// `rebuild=...`.
    Rebuild(RebuildOrder),
    /// `wrprot=...`.
    Wrprot(WrprotVariant),
    /// `log=get|clear|clear:N|ring` (`clear:N`: CLEAR in chunks of N pages).
    Log(LogKind, Option<ClearChunk>),
    /// `clear-chunk=N|slot`.
    ClearChunk(ClearChunk),
}

fn value_name<E: ValueEnum>(e: &E) -> String {
    e.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

impl Setting {
    /// The key it sets.
    pub fn key(self) -> Key {
        match self {
            Setting::Vcpus(_) => Key::Vcpus,
            Setting::Format(_) => Key::Format,
            Setting::FastPf(_) => Key::FastPf,
            Setting::MmuLock(_) => Key::MmuLock,
            Setting::AdBits(_) => Key::AdBits,
            Setting::Cmo(_) => Key::Cmo,
            Setting::GetDirtyLog(_) => Key::GetDirtyLog,
            Setting::DirtyTracking(_) => Key::DirtyTracking,
            Setting::EagerSplit(_) => Key::EagerSplit,
            Setting::Recover(_) => Key::Recover,
            Setting::Rebuild(_) => Key::Rebuild,
            Setting::Wrprot(_) => Key::Wrprot,
            Setting::Log(..) => Key::Log,
            Setting::ClearChunk(_) => Key::ClearChunk,
        }
    }

    /// The value as written on the command line.
    pub fn value(self) -> String {
        match self {
            Setting::Vcpus(n) => n.to_string(),
            Setting::Format(v) => value_name(&v),
            Setting::FastPf(v) | Setting::AdBits(v) | Setting::EagerSplit(v) => value_name(&v),
            Setting::MmuLock(v) => v.to_string(),
            Setting::Cmo(v) => v.to_string(),
            Setting::GetDirtyLog(v) => v.to_string(),
            Setting::DirtyTracking(v) => v.to_string(),
            Setting::Recover(v) => v.to_string(),
            Setting::Rebuild(v) => v.to_string(),
            Setting::Wrprot(v) => v.to_string(),
            Setting::Log(v, None) => value_name(&v),
            Setting::Log(v, Some(c)) => format!("{}:{}", value_name(&v), c.name()),
            Setting::ClearChunk(v) => v.name(),
        }
    }

    /// `key=value`.
    pub fn label(self) -> String {
        format!("{}={}", self.key().name(), self.value())
    }

    /// Applies the setting to a run's vCPU count, switches and harvest.
    pub fn apply(
        self,
        vcpus: &mut u32,
        machine: &mut MachineArgs,
        dirty: &mut DirtyArgs,
        log: &mut LogArgs,
    ) {
        match self {
            Setting::Vcpus(n) => *vcpus = n,
            Setting::Format(v) => machine.format = v,
            Setting::FastPf(v) => machine.fast_pf = v,
            Setting::MmuLock(v) => machine.mmu_lock = v,
            Setting::AdBits(v) => machine.ad_bits = v,
            Setting::Cmo(v) => machine.cmo = v,
            Setting::GetDirtyLog(v) => dirty.get_log = v,
            Setting::DirtyTracking(v) => dirty.tracking = v,
            Setting::EagerSplit(v) => dirty.eager_split = v,
            Setting::Recover(v) => dirty.recover = v,
            Setting::Rebuild(v) => dirty.rebuild = v,
            Setting::Wrprot(v) => dirty.wrprot = v,
            Setting::Log(v, chunk) => {
                log.set_kind(v);
                if let Some(c) = chunk {
                    log.clear_chunk = c;
                }
            }
            Setting::ClearChunk(v) => log.clear_chunk = v,
        }
    }
}

/// One `--vary` flag: a key and the values to try, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vary {
    /// What is varied.
    pub key: Key,
    /// The values, parsed.
    pub values: Vec<Setting>,
}

fn choice<E: ValueEnum>(key: &str, v: &str) -> Result<E, String> {
    E::from_str(v, true).map_err(|_| {
        let names: Vec<String> = E::value_variants().iter().map(value_name).collect();
        format!("--vary {key}: `{v}` is not one of {}", names.join(", "))
    })
}

/// An engine variant by its spelling (`slat::config`), refused with the accepted ones.
fn engine<E: Variant>(key: &str, v: &str) -> Result<E, String> {
    v.parse::<E>().map_err(|_| {
        let names: Vec<&str> = E::ALL.iter().map(|e| e.name()).collect();
        format!("--vary {key}: `{v}` is not one of {}", names.join(", "))
    })
}

fn parse_value(key: Key, k: &str, v: &str) -> Result<Setting, String> {
    Ok(match key {
        Key::Vcpus => match v.parse::<u32>() {
            Ok(n) if (1..=512).contains(&n) => Setting::Vcpus(n),
            _ => return Err(format!("--vary vcpus: `{v}` is not a count from 1 to 512")),
        },
        Key::FastPf => Setting::FastPf(choice(k, v)?),
        Key::AdBits => Setting::AdBits(choice(k, v)?),
        Key::EagerSplit => Setting::EagerSplit(choice(k, v)?),
        Key::MmuLock => Setting::MmuLock(engine(k, v)?),
        Key::GetDirtyLog => Setting::GetDirtyLog(engine(k, v)?),
        Key::DirtyTracking => Setting::DirtyTracking(engine(k, v)?),
        Key::Recover => Setting::Recover(engine(k, v)?),
        Key::Format => Setting::Format(choice(k, v)?),
        Key::Cmo => Setting::Cmo(engine(k, v)?),
        Key::Rebuild => Setting::Rebuild(engine(k, v)?),
        Key::Wrprot => Setting::Wrprot(engine(k, v)?),
        Key::Log => match v.split_once(':') {
            Some(("clear", n)) => Setting::Log(
                LogKind::Clear,
                Some(clear_chunk(n).map_err(|e| format!("--vary {k}: {e}"))?),
            ),
            Some(_) => {
                return Err(format!(
                    "--vary {k}: `{v}`: only clear takes a chunk size (clear:N)"
                ))
            }
            None => Setting::Log(choice(k, v)?, None),
        },
        Key::ClearChunk => {
            Setting::ClearChunk(clear_chunk(v).map_err(|e| format!("--vary {k}: {e}"))?)
        }
    })
}

/// Parses `KEY=V1,V2,...`.
pub fn parse_vary(s: &str) -> Result<Vary, String> {
    let (key, values) = parse_keyed(s, &KEYS, parse_value)?;
    Ok(Vary { key, values })
}

/// Parses `KEY=V1,V2,...` against a subcommand's own keys: `keys` names each, `value` parses
/// one value (given the key, its name and the text). Every subcommand's `--vary` is read here;
/// its own refusals are words (`E: From<String>`), the values' are the subcommand's.
pub fn parse_keyed<K: Copy, S, E: From<String>>(
    s: &str,
    keys: &[(&str, K)],
    value: impl Fn(K, &str, &str) -> Result<S, E>,
) -> Result<(K, Vec<S>), E> {
    let example = keys.first().map_or("KEY", |(n, _)| *n);
    let (k, vs) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=V1,V2,... (e.g. {example}=...)"))?;
    let key = keys
        .iter()
        .find(|(n, _)| *n == k)
        .map(|(_, key)| *key)
        .ok_or_else(|| {
            let names: Vec<&str> = keys.iter().map(|(n, _)| *n).collect();
            format!("--vary: unknown key `{k}` (known: {})", names.join(", "))
        })?;
    let raw: Vec<&str> = vs.split(',').map(str::trim).collect();
    if raw.iter().any(|v| v.is_empty()) {
        return Err(format!("--vary {k}: empty value in `{vs}`").into());
    }
    let values = raw
        .iter()
        .map(|v| value(key, k, v))
        .collect::<Result<_, _>>()?;
    Ok((key, values))
}

/// Every combination of one value from each axis, first axis slowest. Shared by every
/// subcommand with `--vary`, whatever its settings are.
pub fn cross<S: Clone>(axes: &[&[S]]) -> Vec<Vec<S>> {
    let mut out: Vec<Vec<S>> = vec![Vec::new()];
    for axis in axes {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                axis.iter().map(move |val| {
                    let mut p = prefix.clone();
                    p.push(val.clone());
                    p
                })
            })
            .collect();
    }
    out
}

/// Refuses a key given twice (the cross product would be ambiguous); `names` are the keys in
/// the order given.
pub fn check_distinct_names(names: &[&str]) -> Result<(), String> {
    for (i, a) in names.iter().enumerate() {
        if names[..i].contains(a) {
            return Err(format!(
                "--vary {a} given twice: list all its values in one flag"
            ));
        }
    }
    Ok(())
}

/// Every combination of the values, first key slowest.
pub fn combinations(vary: &[Vary]) -> Vec<Vec<Setting>> {
    let axes: Vec<&[Setting]> = vary.iter().map(|v| &v.values[..]).collect();
    cross(&axes)
}

/// Refuses a key given twice.
pub fn check_distinct(vary: &[Vary]) -> Result<(), String> {
    let names: Vec<&str> = vary.iter().map(|v| v.key.name()).collect();
    check_distinct_names(&names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_crosses() {
        let a = parse_vary("fast-pf=on,off").unwrap();
        let b = parse_vary("vcpus=1,2").unwrap();
        let c = combinations(&[a, b]);
        assert_eq!(c.len(), 4);
        assert_eq!(c[1], vec![Setting::FastPf(Switch::On), Setting::Vcpus(2)]);
    }

    #[test]
    fn bad_input_is_refused_with_the_reason() {
        assert!(parse_vary("fast-pf").unwrap_err().contains("KEY=V1"));
        assert!(parse_vary("speed=1").unwrap_err().contains("unknown key"));
        assert!(parse_vary("fast-pf=maybe")
            .unwrap_err()
            .contains("not one of"));
        assert!(parse_vary("vcpus=0").unwrap_err().contains("1 to 512"));
        assert!(parse_vary("vcpus=1,,2").unwrap_err().contains("empty"));
        assert!(parse_vary("format=ept,arm")
            .unwrap_err()
            .contains("ept, stage2"));
        assert!(parse_vary("format=ept,stage2").is_ok());
        assert!(parse_vary("recover=inplace,on-fault").is_ok());
        assert!(parse_vary("cmo=always,on-install").is_ok());
        assert!(parse_vary("rebuild=break-first,install-first").is_ok());
        assert!(parse_vary("log=get,clear,ring,clear:64,clear:slot").is_ok());
        assert!(parse_vary("log=get:64").unwrap_err().contains("only clear"));
        assert!(parse_vary("log=clear:65")
            .unwrap_err()
            .contains("power of two"));
        let l = parse_vary("log=clear:4096").unwrap();
        assert_eq!(l.values[0].label(), "log=clear:4096");
        assert!(parse_vary("log=bitmap")
            .unwrap_err()
            .contains("get, clear, ring"));
        assert!(parse_vary("clear-chunk=64,4096,slot").is_ok());
        assert!(parse_vary("clear-chunk=63")
            .unwrap_err()
            .contains("power of two"));
        let twice = [
            parse_vary("vcpus=1").unwrap(),
            parse_vary("vcpus=2").unwrap(),
        ];
        assert!(check_distinct(&twice).is_err());
    }
}
