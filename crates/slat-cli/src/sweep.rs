//! `--vary` parsing of the subcommands not yet on the driver's table (`crate::driver::vary`).

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

