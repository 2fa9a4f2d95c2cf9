//! `--vary KEY=V1,V2,...`: run one benchmark over the cross product of variant settings in one
//! process and print one table, so a seed's before/after comparison is one command and one
//! run on one machine state, not numbers gathered from separate invocations.

use crate::args::{
    CmoArg, FormatArg, GetLogArg, LockArg, RebuildArg, RecoverArg, Switch, TrackArg,
};
use clap::ValueEnum;

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
}

const KEYS: [(&str, Key); 11] = [
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
];

impl Key {
    /// The flag name, as written in `--vary`.
    pub fn name(self) -> &'static str {
        KEYS.iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }
}

/// One `--vary` flag: a key and the values to try, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vary {
    /// What is varied.
    pub key: Key,
    /// The values, already checked to be valid for the key.
    pub values: Vec<String>,
}

fn check_enum<E: ValueEnum>(key: &str, v: &str) -> Result<(), String> {
    E::from_str(v, true).map(|_| ()).map_err(|_| {
        let names: Vec<String> = E::value_variants()
            .iter()
            .filter_map(|e| e.to_possible_value().map(|p| p.get_name().to_string()))
            .collect();
        format!("--vary {key}: `{v}` is not one of {}", names.join(", "))
    })
}

/// Parses `KEY=V1,V2,...`.
pub fn parse_vary(s: &str) -> Result<Vary, String> {
    let (k, vs) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=V1,V2,... (e.g. fast-pf=on,off)"))?;
    let key = KEYS
        .iter()
        .find(|(n, _)| *n == k)
        .map(|(_, key)| *key)
        .ok_or_else(|| {
            let names: Vec<&str> = KEYS.iter().map(|(n, _)| *n).collect();
            format!("--vary: unknown key `{k}` (known: {})", names.join(", "))
        })?;
    let values: Vec<String> = vs.split(',').map(|v| v.trim().to_string()).collect();
    if values.iter().any(|v| v.is_empty()) {
        return Err(format!("--vary {k}: empty value in `{vs}`"));
    }
    for v in &values {
        match key {
            Key::Vcpus => match v.parse::<u32>() {
                Ok(n) if (1..=512).contains(&n) => {}
                _ => return Err(format!("--vary vcpus: `{v}` is not a count from 1 to 512")),
            },
            Key::FastPf | Key::AdBits | Key::EagerSplit => check_enum::<Switch>(k, v)?,
            Key::MmuLock => check_enum::<LockArg>(k, v)?,
            Key::GetDirtyLog => check_enum::<GetLogArg>(k, v)?,
            Key::DirtyTracking => check_enum::<TrackArg>(k, v)?,
            Key::Recover => check_enum::<RecoverArg>(k, v)?,
            Key::Format => check_enum::<FormatArg>(k, v)?,
            Key::Cmo => check_enum::<CmoArg>(k, v)?,
            Key::Rebuild => check_enum::<RebuildArg>(k, v)?,
        }
    }
    Ok(Vary { key, values })
}

/// Every combination of the values, first key slowest: each a list of (key, value).
pub fn combinations(vary: &[Vary]) -> Vec<Vec<(Key, String)>> {
    let mut out: Vec<Vec<(Key, String)>> = vec![Vec::new()];
    for v in vary {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                v.values.iter().map(move |val| {
                    let mut p = prefix.clone();
                    p.push((v.key, val.clone()));
                    p
                })
            })
            .collect();
    }
    out
}

/// Refuses a key given twice (the cross product would be ambiguous).
pub fn check_distinct(vary: &[Vary]) -> Result<(), String> {
    for (i, a) in vary.iter().enumerate() {
        if vary[..i].iter().any(|b| b.key == a.key) {
            return Err(format!(
                "--vary {} given twice: list all its values in one flag",
                a.key.name()
            ));
        }
    }
    Ok(())
}

/// Parses a value `parse_vary` accepted.
pub fn enum_value<E: ValueEnum>(v: &str) -> E {
    // parse_vary validated every value against the same enum.
    E::from_str(v, true).unwrap_or_else(|_| unreachable!("validated by parse_vary"))
}

/// Prints a Markdown table: `head` columns, then `rows`.
pub fn print_table(head: &[String], rows: &[Vec<String>]) {
    let widths: Vec<usize> = (0..head.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([head[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(head);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    println!("|-{}-|", rule.join("-|-"));
    for r in rows {
        line(r);
    }
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
        assert_eq!(
            c[1],
            vec![(Key::FastPf, "on".into()), (Key::Vcpus, "2".into())]
        );
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
        let twice = [
            parse_vary("vcpus=1").unwrap(),
            parse_vary("vcpus=2").unwrap(),
        ];
        assert!(check_distinct(&twice).is_err());
    }
}
