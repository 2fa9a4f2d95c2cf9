//! `--vary KEY=V1,V2,...`: every benchmark's varied settings come from one table of
//! [`Key`]s. The table parses and checks the flag, applies a value to a copy of the
//! benchmark's flags, and writes the flag's `--help`, so the keys and values a user reads are
//! the ones the code accepts.

use clap::ValueEnum;

/// The values a key takes: one of a list (the list is the help text and the check), or
/// free-form values described in words and checked by a function.
pub enum Values {
    OneOf(fn() -> Vec<String>),
    Text(&'static str, fn(&str) -> Result<(), String>),
}

/// One row of a benchmark's `--vary` table: the key, its values, how a (checked) value is
/// set on a copy of the benchmark's flags, and which flag it sets (`-v`, `--fast-pf`).
pub struct Key<A> {
    pub name: &'static str,
    pub values: Values,
    pub apply: fn(&mut A, &str) -> Result<(), String>,
    pub sets: &'static str,
}

/// One `--vary` flag as given: a key of the table and its values, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vary {
    pub key: &'static str,
    pub values: Vec<String>,
}

/// The names of a clap value enum.
pub fn names<E: ValueEnum>() -> Vec<String> {
    E::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value())
        .map(|p| p.get_name().to_string())
        .collect()
}

/// The spellings of an engine variant enum.
pub fn variants<E: crate::args::Variant>() -> Vec<String> {
    E::ALL.iter().map(|e| e.name().to_string()).collect()
}

/// A count from `lo` to `hi`.
pub fn count_in(v: &str, lo: u64, hi: u64) -> Result<u64, String> {
    match v.parse::<u64>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!("`{v}` is not a count from {lo} to {hi}")),
    }
}

/// Parses `KEY=V1,V2,...` against `table`.
pub fn parse<A>(s: &str, table: &[Key<A>]) -> Result<Vary, String> {
    let example = table.first().map_or("KEY", |k| k.name);
    let (k, vs) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=V1,V2,... (e.g. {example}=...)"))?;
    let key = table.iter().find(|key| key.name == k).ok_or_else(|| {
        let names: Vec<&str> = table.iter().map(|k| k.name).collect();
        format!("--vary: unknown key `{k}` (known: {})", names.join(", "))
    })?;
    let values: Vec<String> = vs.split(',').map(|v| v.trim().to_string()).collect();
    if values.iter().any(String::is_empty) {
        return Err(format!("--vary {k}: empty value in `{vs}`"));
    }
    for v in &values {
        check_value(&key.values, v).map_err(|e| format!("--vary {k}: {e}"))?;
    }
    Ok(Vary {
        key: key.name,
        values,
    })
}

fn check_value(values: &Values, v: &str) -> Result<(), String> {
    match values {
        Values::OneOf(list) => {
            let list = list();
            if list.iter().any(|x| x == v) {
                Ok(())
            } else {
                Err(format!("`{v}` is not one of {}", list.join(", ")))
            }
        }
        Values::Text(_, check) => check(v),
    }
}

/// The help of `--vary`: what it does, then every key with its values, from the table.
pub fn help<A>(table: &[Key<A>], examples: &str) -> String {
    let mut s = String::from(
        "Run the benchmark once per combination of the listed settings (the cross product, \
         first key slowest), in this process, and print one table. KEY=V1,V2,...; repeat the \
         flag for more keys. Keys:",
    );
    for k in table {
        let vals = match &k.values {
            Values::OneOf(list) => list().join(", "),
            Values::Text(words, _) => words.to_string(),
        };
        s += &format!("\n  {} ({}): {vals}", k.name, k.sets);
    }
    if !examples.is_empty() {
        s += "\n";
        s += examples;
    }
    s
}

/// The clap value parser of `--vary` for a benchmark whose table is `table`.
pub fn parser<A: 'static>(
    table: &'static [Key<A>],
) -> impl Fn(&str) -> Result<Vary, String> + Clone + Send + Sync + 'static {
    move |s| parse(s, table)
}

/// One row of a sweep: `key=value` labels and the flags with those values applied.
pub struct Row<A> {
    pub settings: Vec<String>,
    pub args: A,
}

/// The rows of `vary` over `base`, every combination with the first key slowest; refuses a
/// key given twice.
pub fn rows<A: Clone>(base: &A, vary: &[Vary], table: &[Key<A>]) -> Result<Vec<Row<A>>, String> {
    let mut rows = vec![Row {
        settings: Vec::new(),
        args: base.clone(),
    }];
    for (i, v) in vary.iter().enumerate() {
        let k = v.key;
        if vary[..i].iter().any(|w| w.key == k) {
            return Err(format!(
                "--vary {k} given twice: list all its values in one flag"
            ));
        }
        let key = table.iter().find(|t| t.name == k);
        let key = key.ok_or_else(|| format!("--vary: unknown key `{k}`"))?;
        let mut next = Vec::new();
        for row in &rows {
            for x in &v.values {
                let mut args = row.args.clone();
                (key.apply)(&mut args, x).map_err(|e| format!("--vary {k}: {e}"))?;
                let settings = [&row.settings[..], &[format!("{k}={x}")]].concat();
                next.push(Row { settings, args });
            }
        }
        rows = next;
    }
    Ok(rows)
}

/// A value of a clap value enum, as `--vary` wrote it.
pub fn pick<E: ValueEnum>(v: &str) -> Result<E, String> {
    E::from_str(v, true).map_err(|_| format!("`{v}` is not one of {}", names::<E>().join(", ")))
}

/// An engine variant by its spelling.
pub fn engine<E: crate::args::Variant>(v: &str) -> Result<E, String> {
    v.parse::<E>()
        .map_err(|_| format!("`{v}` is not one of {}", variants::<E>().join(", ")))
}

/// A row of a `--vary` table: `key!("name", "what it sets", values, |args, value| body)`,
/// the body setting the value (with `?` for its parse) on the flags.
#[macro_export]
macro_rules! vary_key {
    ($name:literal, $sets:literal, $values:expr, |$a:ident, $v:ident| $body:expr) => {
        $crate::driver::vary::Key {
            name: $name,
            sets: $sets,
            values: $values,
            apply: |$a, $v| {
                $body;
                Ok(())
            },
        }
    };
}

#[cfg(test)]
/// Checks that `help` (a subcommand's `--help`) lists exactly `table`'s keys, each with
/// exactly the values the table accepts, and that every listed value applies to `base`.
/// Returns what is wrong, if anything.
pub fn help_matches<A: Clone>(help: &str, table: &[Key<A>], base: &A) -> Result<(), String> {
    let listed: Vec<(&str, &str)> = help
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let (head, vals) = l.split_once("): ")?;
            let (name, _) = head.split_once(" (")?;
            (!name.contains(' ')).then_some((name, vals))
        })
        .collect();
    let names: Vec<&str> = listed.iter().map(|l| l.0).collect();
    let want: Vec<&str> = table.iter().map(|k| k.name).collect();
    if names != want {
        return Err(format!(
            "--help lists keys {names:?}, the table has {want:?}"
        ));
    }
    for (k, (_, vals)) in table.iter().zip(&listed) {
        if let Values::OneOf(list) = &k.values {
            let shown: Vec<&str> = vals.split(", ").collect();
            let list = list();
            if shown != list {
                return Err(format!(
                    "--vary {}: --help lists {shown:?}, the code takes {list:?}",
                    k.name
                ));
            }
            for v in &list {
                let mut a = base.clone();
                (k.apply)(&mut a, v).map_err(|e| format!("--vary {}={v}: {e}", k.name))?;
            }
            let bogus = "no-such-value";
            if parse(&format!("{}={bogus}", k.name), table).is_ok() {
                return Err(format!("--vary {} accepts {bogus}", k.name));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Default)]
    struct A(u64, String);

    const T: &[Key<A>] = &[
        crate::vary_key!(
            "n",
            "-n",
            Values::Text("1-4", |v| count_in(v, 1, 4).map(|_| ())),
            |a, v| a.0 = count_in(v, 1, 4)?
        ),
        crate::vary_key!(
            "c",
            "-c",
            Values::OneOf(|| vec!["x".into(), "y".into()]),
            |a, v| a.1 = v.into()
        ),
    ];

    #[test]
    fn parses_checks_and_crosses() {
        assert!(parse("n", T).unwrap_err().contains("KEY=V1"));
        assert!(parse("m=1", T).unwrap_err().contains("unknown key"));
        assert!(parse("n=0", T).unwrap_err().contains("1 to 4"));
        assert!(parse("n=1,,2", T).unwrap_err().contains("empty"));
        assert!(parse("c=z", T).unwrap_err().contains("x, y"));
        let v = [parse("n=1,2", T).unwrap(), parse("c=x,y", T).unwrap()];
        let r = rows(&A::default(), &v, T).unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(r[1].settings, ["n=1", "c=y"]);
        assert_eq!((r[3].args.0, r[3].args.1.as_str()), (2, "y"));
        let twice = [parse("n=1", T).unwrap(), parse("n=2", T).unwrap()];
        assert!(rows(&A::default(), &twice, T).is_err());
        let h = help(T, "");
        assert!(
            h.contains("n (-n): 1-4") && h.contains("c (-c): x, y"),
            "{h}"
        );
    }
}
